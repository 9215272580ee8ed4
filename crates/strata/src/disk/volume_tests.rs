//! Tests of writable disks: reads after writes against a byte model, flush costs, clones,
//! crash recovery from the log, and compaction.

use super::volume::Volume;
use super::*;
use crate::progress::NoProgress;
use crate::store::InitOptions;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn store() -> (tempfile::TempDir, Store) {
    let d = tempfile::tempdir().unwrap();
    let s = Store::init_local(&d.path().join("s"), InitOptions::default()).unwrap();
    (d, s)
}

#[test]
fn random_ops_match_a_byte_model_across_compaction_and_reopen() {
    let (_d, s) = store();
    let size = 3 * 1024 * 1024 + 4096;
    create(&s, "v", size).unwrap();
    let mut model = vec![0u8; size as usize];
    let mut rng = StdRng::seed_from_u64(7);
    let mut v = Volume::open(&s, "v").unwrap();
    for step in 0..400 {
        let off = rng.gen_range(0..size - 1);
        let len = rng.gen_range(1..=(size - off).min(200_000));
        match rng.gen_range(0..10) {
            0..=5 => {
                let b: u8 = rng.gen();
                let data: Vec<u8> = (0..len).map(|i| b.wrapping_add(i as u8)).collect();
                v.write(off, &data, rng.gen_bool(0.1)).unwrap();
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            6 => {
                v.write_zeroes(off, len, false).unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            }
            7 => {
                v.trim(off, len, false).unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            }
            8 => {
                if step % 3 == 0 {
                    v.compact().unwrap();
                } else {
                    v.flush().unwrap();
                }
            }
            _ => {
                v.flush().unwrap();
                drop(v);
                v = Volume::open(&s, "v").unwrap();
            }
        }
        let qo = rng.gen_range(0..size - 1);
        let ql = rng.gen_range(1..=(size - qo).min(300_000));
        let mut buf = vec![0xeeu8; ql as usize];
        v.read(qo, &mut buf).unwrap();
        assert!(
            buf == model[qo as usize..(qo + ql) as usize],
            "step {step}: read {qo}+{ql} differs"
        );
    }
    v.close().unwrap();
    drop(v);
    let out = _d.path().join("out.raw");
    export(&s, "v", &out, &NoProgress).unwrap();
    assert!(std::fs::read(&out).unwrap() == model);
}

#[test]
fn each_flush_costs_at_most_one_fdatasync() {
    let (_d, s) = store();
    create(&s, "v", 64 << 20).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    for i in 0..50u64 {
        v.write(i * 1_000_000, &[i as u8; 4096], false).unwrap();
        v.flush().unwrap();
    }
    assert_eq!(v.stats().fdatasyncs.load(Ordering::Relaxed), 50);
    v.flush().unwrap();
    assert_eq!(
        v.stats().fdatasyncs.load(Ordering::Relaxed),
        50,
        "a flush with nothing new costs nothing"
    );
    v.write(0, &[1; 512], true).unwrap();
    assert_eq!(v.stats().fdatasyncs.load(Ordering::Relaxed), 51, "FUA costs one");
    // Concurrent flushers share syncs (group commit).
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let v = &v;
            sc.spawn(move || {
                for i in 0..50u64 {
                    v.write((t * 100 + i) * 8192, &[t as u8; 4096], false).unwrap();
                    v.flush().unwrap();
                }
            });
        }
    });
    let syncs = v.stats().fdatasyncs.load(Ordering::Relaxed) - 51;
    assert!(syncs <= 200, "{syncs} fdatasyncs for 200 flushes");
}

#[test]
fn a_4k_write_into_a_clone_logs_about_4k() {
    let (d, s) = store();
    let img = d.path().join("g.raw");
    std::fs::write(&img, (0..8 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>()).unwrap();
    import(&s, "golden", &img, Codec::Lz4, &NoProgress).unwrap();
    snapshot(&s, "golden", "base").unwrap();
    let c = clone(&s, "golden@base", "desk", false).unwrap();
    assert_eq!(c.parent.as_deref(), Some("golden@base"));
    let v = Volume::open(&s, "desk").unwrap();
    v.write(65536 * 3 + 4096, &[0xab; 4096], false).unwrap();
    v.flush().unwrap();
    let logged = v.stats().log_bytes_written.load(Ordering::Relaxed);
    assert!(logged <= 4096 + 64, "a 4 KiB write logged {logged} bytes");
    let mut b = vec![0u8; 65536];
    v.read(65536 * 3, &mut b).unwrap();
    assert_eq!(&b[4096..8192], &[0xab; 4096]);
    assert_eq!(b[0], ((65536 * 3) % 251) as u8, "the rest of the block still comes from the base");
    assert!(Volume::open(&s, "golden@base").is_err(), "snapshots are read-only");
}

#[test]
fn flushed_writes_survive_a_crash_and_a_torn_tail() {
    let (_d, s) = store();
    create(&s, "v", 16 << 20).unwrap();
    let logdir;
    {
        let v = Volume::open(&s, "v").unwrap();
        v.write(4096, b"durable!", false).unwrap();
        v.flush().unwrap();
        v.write(8192, b"maybe", false).unwrap();
        logdir = s.local_dir().join("disks");
        // Dropped without close: nothing compacted, as after kill -9.
    }
    // Tear the tail: cut the last record in half.
    let log = std::fs::read_dir(logdir.read_dir().unwrap().next().unwrap().unwrap().path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("log."))
        .unwrap();
    // The file is zero-filled past its last record; cut that record 3 bytes short.
    let (_, recs, valid) = super::log::scan(&std::fs::read(&log).unwrap()).unwrap();
    assert_eq!(recs.len(), 2);
    std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(valid - 3).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    let mut b = [0u8; 8];
    v.read(4096, &mut b).unwrap();
    assert_eq!(&b, b"durable!");
    let mut m = [9u8; 5];
    v.read(8192, &mut m).unwrap();
    assert_eq!(m, [0; 5], "the torn record is dropped whole");
}

#[test]
fn a_log_already_folded_into_the_base_is_not_replayed() {
    let (_d, s) = store();
    create(&s, "v", 1 << 20).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    v.write(0, b"old", false).unwrap();
    v.flush().unwrap();
    let dir = s.local_dir().join("disks");
    let disk_dir = dir.read_dir().unwrap().next().unwrap().unwrap().path();
    let saved: Vec<(std::path::PathBuf, Vec<u8>)> = disk_dir
        .read_dir()
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_str().unwrap().starts_with("log."))
        .map(|e| (e.path(), std::fs::read(e.path()).unwrap()))
        .collect();
    v.compact().unwrap();
    v.write(0, b"new", false).unwrap();
    v.flush().unwrap();
    drop(v);
    // Crash between the compaction's commit and the old log's removal: the old log reappears.
    for (p, b) in saved {
        std::fs::write(p, b).unwrap();
    }
    let v = Volume::open(&s, "v").unwrap();
    let mut b = [0u8; 3];
    v.read(0, &mut b).unwrap();
    assert_eq!(&b, b"new");
}

#[test]
fn out_of_range_and_in_use_are_refused() {
    let (_d, s) = store();
    create(&s, "v", 1 << 20).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    assert!(matches!(v.write((1 << 20) - 2, b"abc", false), Err(DiskError::OutOfRange { .. })));
    assert!(matches!(Volume::open(&s, "v"), Err(DiskError::InUse { .. })));
    assert!(matches!(create(&s, "bad@name", 10), Err(DiskError::BadName { .. })));
}

#[test]
fn writes_go_on_while_background_compactions_fold_the_log() {
    let (_d, s) = store();
    let size = 8u64 << 20;
    create(&s, "v", size).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    v.set_compact_at(256 << 10);
    let mut model = vec![0u8; size as usize];
    let mut rng = StdRng::seed_from_u64(3);
    for step in 0..600u64 {
        let len = rng.gen_range(1..=16) * 4096u64;
        let off = rng.gen_range(0..(size - len) / 512) * 512;
        let data: Vec<u8> =
            (0..len).map(|i| (step as u8).wrapping_mul(31).wrapping_add(i as u8)).collect();
        v.write(off, &data, false).unwrap();
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
        if step % 7 == 0 {
            v.flush().unwrap();
        }
        let qo = rng.gen_range(0..size - 200_000);
        let mut buf = vec![0u8; 200_000];
        v.read(qo, &mut buf).unwrap();
        assert!(buf == model[qo as usize..qo as usize + 200_000], "step {step}: read {qo} differs");
    }
    v.wait_compaction();
    let st = v.stats();
    assert!(st.compactions.load(Ordering::Relaxed) >= 5, "{st:?}");
    // Each guest flush cost one fdatasync, plus one for the frozen file after a rollover.
    let (flushes, syncs) =
        (st.flushes.load(Ordering::Relaxed), st.fdatasyncs.load(Ordering::Relaxed));
    assert!(
        syncs <= flushes + st.compactions.load(Ordering::Relaxed),
        "{flushes} flushes, {syncs} fdatasyncs"
    );
    drop(v);
    // Dropped without close (as after kill -9): reopening replays what was not folded.
    let v = Volume::open(&s, "v").unwrap();
    let mut all = vec![0u8; size as usize];
    v.read(0, &mut all).unwrap();
    assert!(all == model, "contents differ after reopen");
    v.close().unwrap();
    drop(v);
    let out = _d.path().join("out.raw");
    export(&s, "v", &out, &NoProgress).unwrap();
    assert!(std::fs::read(&out).unwrap() == model);
}

#[test]
fn a_fold_that_fails_before_its_commit_leaves_two_logs_that_replay_in_order() {
    use super::volume::SyncEvent;
    let (_d, s) = store();
    create(&s, "v", 4 << 20).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    v.set_compact_at(64 << 10);
    // The fold waits at its start until the test says go, then fails (power cut before any
    // chunk or ref is written).
    let gate = Arc::new((parking_lot::Mutex::new(false), parking_lot::Condvar::new()));
    let g = gate.clone();
    v.set_sync_hook(Arc::new(move |ev: &SyncEvent| {
        if let SyncEvent::FoldStart(_) = ev {
            let mut go = g.0.lock();
            while !*go {
                g.1.wait(&mut go);
            }
            return Err(std::io::Error::other("power cut"));
        }
        Ok(())
    }));
    // Into the first log: past the threshold, so it freezes and a fold starts (and waits).
    v.write(0, &[1u8; 70 << 10], false).unwrap();
    // Into the second log, one of them over part of the first one's data.
    v.write(100 << 10, &[2u8; 4096], false).unwrap();
    v.write(8192, &[3u8; 4096], false).unwrap();
    v.flush().unwrap();
    assert_eq!(
        v.stats().fdatasyncs.load(Ordering::Relaxed),
        2,
        "the first flush after a rollover syncs the frozen log too"
    );
    let mut b = vec![0u8; 110 << 10];
    v.read(0, &mut b).unwrap();
    *gate.0.lock() = true;
    gate.1.notify_all();
    v.wait_compaction();
    assert!(
        matches!(v.write(0, b"x", false), Err(DiskError::Failed { .. })),
        "a failed fold stops I/O"
    );
    drop(v);
    let logs =
        std::fs::read_dir(s.local_dir().join("disks")).unwrap().next().unwrap().unwrap().path();
    let n = logs
        .read_dir()
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_str().unwrap().starts_with("log."))
        .count();
    assert_eq!(n, 2, "the frozen and the active log are both still there");
    let v = Volume::open(&s, "v").unwrap();
    let mut after = vec![0u8; 110 << 10];
    v.read(0, &mut after).unwrap();
    assert!(after == b, "replaying both logs in order gives what was read before the failure");
    assert_eq!(&after[8192..8192 + 4096], &[3u8; 4096]);
    assert_eq!(after[0], 1);
    assert_eq!(after[100 << 10], 2);
}

#[test]
fn a_writer_held_back_by_a_fold_waits_for_that_fold_only() {
    use super::volume::SyncEvent;
    use std::sync::atomic::AtomicU64;
    let (_d, s) = store();
    let size = 16u64 << 20;
    create(&s, "v", size).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    v.set_compact_at(64 << 10);
    // Slow folds, so writers pile up past twice the threshold and wait.
    let folds = Arc::new(AtomicU64::new(0));
    let f = folds.clone();
    v.set_sync_hook(Arc::new(move |ev: &SyncEvent| {
        if let SyncEvent::FoldStart(_) = ev {
            f.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(())
    }));
    // The most folds that started while one write call ran: the one it waited for (which may
    // have started during its append) and the next, started by it or another writer. When
    // waiting writers were released one per fold, 8 writers saw up to ~7.
    let worst = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let (v, folds, worst) = (&v, &folds, &worst);
            sc.spawn(move || {
                for i in 0..120u64 {
                    let before = folds.load(Ordering::SeqCst);
                    v.write(((t * 120 + i) * 4096) % size, &[t as u8 + 1; 4096], false).unwrap();
                    worst.fetch_max(folds.load(Ordering::SeqCst) - before, Ordering::SeqCst);
                }
            });
        }
    });
    v.wait_compaction();
    let (n, worst) = (folds.load(Ordering::SeqCst), worst.load(Ordering::SeqCst));
    assert!(
        v.stats().compaction_waits.load(Ordering::Relaxed) > 0,
        "no writer was held back ({n} folds)"
    );
    // One more than the two for a thread descheduled on a loaded host.
    assert!(worst <= 3, "a write spanned {worst} folds ({n} in all)");
    let mut all = vec![0u8; 8 * 120 * 4096];
    v.read(0, &mut all).unwrap();
    for (k, b) in all.chunks(4096).enumerate() {
        assert!(b.iter().all(|&x| x == (k / 120) as u8 + 1), "block {k}");
    }
}

#[test]
fn past_the_threshold_writers_are_paced_by_the_fold_and_released_by_it() {
    use super::volume::SyncEvent;
    let (_d, s) = store();
    create(&s, "v", 8 << 20).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    v.set_compact_at(64 << 10);
    // The fold waits at its start (no block folded yet) until the test says go.
    let gate = Arc::new((parking_lot::Mutex::new(false), parking_lot::Condvar::new()));
    let g = gate.clone();
    v.set_sync_hook(Arc::new(move |ev: &SyncEvent| {
        if let SyncEvent::FoldStart(_) = ev {
            let mut go = g.0.lock();
            while !*go {
                g.1.wait(&mut go);
            }
        }
        Ok(())
    }));
    // Past the threshold: the log freezes and a fold starts (and waits at the gate).
    v.write(0, &[1u8; 68 << 10], false).unwrap();
    // The new log takes up to the threshold freely...
    for i in 0..15u64 {
        v.write((1 << 20) + i * 4096, &[2u8; 4096], false).unwrap();
    }
    // ...and a write past it waits, as nothing is folded yet.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        let v2 = &v;
        sc.spawn(move || {
            for i in 15..20u64 {
                v2.write((1 << 20) + i * 4096, &[2u8; 4096], false).unwrap();
            }
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(300)).is_err(),
            "a write past the threshold went on with nothing folded"
        );
        *gate.0.lock() = true;
        gate.1.notify_all();
        rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the fold released the writer");
    });
    v.wait_compaction();
    assert!(v.stats().compaction_waits.load(Ordering::Relaxed) >= 1);
    let mut b = vec![0u8; 20 * 4096];
    v.read(1 << 20, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 2));
}

/// A cut holds exactly the writes acknowledged before it, through later writes and a
/// compaction that folds and unlinks the logs the cut reads from.
#[test]
fn a_cut_holds_the_writes_before_it_and_none_after() {
    let (_d, s) = store();
    let size = 1024 * 1024;
    create(&s, "v", size).unwrap();
    let v = Volume::open(&s, "v").unwrap();
    v.set_compact_at(200_000);
    let mut rng = StdRng::seed_from_u64(11);
    let mut model = vec![0u8; size as usize];
    let mut cuts = Vec::new();
    for round in 0..6u8 {
        for _ in 0..40 {
            let off = rng.gen_range(0..size - 70_000);
            let len = rng.gen_range(1..70_000u64);
            let data = vec![round.wrapping_mul(37).wrapping_add(rng.gen()); len as usize];
            v.write(off, &data, false).unwrap();
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
        }
        cuts.push((v.cut().unwrap(), model.clone()));
    }
    v.compact().unwrap();
    for (i, (c, want)) in cuts.iter().enumerate() {
        let f = c.fold(&s.session()).unwrap();
        let snap = format!("c{i}");
        commit_cut_snapshot(&s, &snap, &f).unwrap();
        let out = _d.path().join(format!("c{i}.raw"));
        export(&s, &format!("v@c{i}"), &out, &NoProgress).unwrap();
        assert!(std::fs::read(&out).unwrap() == *want, "cut {i} differs from the writes before it");
    }
    let mut now = vec![0u8; size as usize];
    v.read(0, &mut now).unwrap();
    assert!(now == model);
}

/// Several volumes cut together: a write pair (a then b) is never seen half in one cut.
#[test]
fn cut_all_is_one_instant_across_disks() {
    let (_d, s) = store();
    create(&s, "a", 65536).unwrap();
    create(&s, "b", 65536).unwrap();
    let (a, b) = (Volume::open(&s, "a").unwrap(), Volume::open(&s, "b").unwrap());
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                a.write(0, &n.to_le_bytes(), false).unwrap();
                b.write(0, &n.to_le_bytes(), false).unwrap();
            }
        });
        for _ in 0..50 {
            let cs = cut::cut_all(&[a.clone(), b.clone()]).unwrap();
            let read = |c: &cut::Cut| {
                let f = c.fold(&s.session()).unwrap();
                let blocks = crate::store::map::read_map(&s, &f.root).unwrap();
                if blocks[0].is_zero() {
                    0
                } else {
                    u64::from_le_bytes(s.get(&blocks[0]).unwrap()[..8].try_into().unwrap())
                }
            };
            let (na, nb) = (read(&cs[0]), read(&cs[1]));
            assert!(na == nb || na == nb + 1, "a={na} b={nb}: b is ahead of a");
        }
        stop.store(true, Ordering::Relaxed);
    });
}

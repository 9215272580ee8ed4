//! Unit tests of the store: round trips, dedup, refs, reopen, damage, GC and poisoning.

use super::objects::{Ref, Tree};
use super::pack::ChunkKind;
use super::session::*;
use super::*;
use crate::backend::fault::FaultBackend;
use crate::backend::memory::MemoryBackend;
use crate::backend::Backend;
use crate::endian;
use crate::progress::NoProgress;
use check::CheckOptions;

pub(super) fn data(seed: u64, len: usize) -> Vec<u8> {
    // Distinct per seed, and only partly compressible (6 random bits per byte).
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0x3f) as u8
        })
        .collect()
}

pub(super) fn mem_store(pack_size: u64) -> (tempfile::TempDir, Store, MemoryBackend) {
    let d = tempfile::tempdir().unwrap();
    let b = MemoryBackend::new();
    let s = Store::init(
        Arc::new(b.clone()),
        &d.path().join("m.redb"),
        InitOptions { pack_size, default_codec: Codec::Lz4 },
    )
    .unwrap();
    (d, s, b)
}

#[test]
fn put_get_round_trip_every_codec_and_dedup() {
    let (_d, s, _) = mem_store(1 << 20);
    let ses = s.session();
    let mut ids = vec![];
    for (i, c) in [Codec::None, Codec::Lz4, Codec::Zstd(1), Codec::Zstd(3)].into_iter().enumerate()
    {
        let d = data(i as u64, 65536);
        let id = ses.put_with(&d, ChunkKind::Data, c).unwrap();
        assert_eq!(id, ChunkId::of(&d));
        ids.push((id, d));
    }
    // Readable before and after flush.
    for (id, d) in &ids {
        assert_eq!(&s.get(id).unwrap(), d);
    }
    s.flush().unwrap();
    for (id, d) in &ids {
        assert_eq!(&s.get(id).unwrap(), d);
    }
    let before = s.stats().chunks_new.load(Ordering::Relaxed);
    ses.put(&ids[0].1, ChunkKind::Data).unwrap();
    assert_eq!(s.stats().chunks_new.load(Ordering::Relaxed), before, "duplicate stored twice");
    assert_eq!(s.stats().chunks_dedup.load(Ordering::Relaxed), 1);
}

#[test]
fn multi_chunk_frames_dedup_per_chunk() {
    let (_d, s, _) = mem_store(1 << 20);
    let ses = s.session();
    let pages: Vec<Vec<u8>> = (0..16).map(|i| data(i, 4096)).collect();
    let items: Vec<(ChunkId, &[u8])> = pages.iter().map(|p| (ChunkId::of(p), &p[..])).collect();
    assert_eq!(ses.put_frame(&items, ChunkKind::Data, Codec::Zstd(1)).unwrap(), 16);
    assert_eq!(ses.put_frame(&items[4..8], ChunkKind::Data, Codec::Zstd(1)).unwrap(), 0);
    s.flush().unwrap();
    for (id, p) in &items {
        assert_eq!(&s.get(id).unwrap()[..], *p);
    }
}

#[test]
fn precompressed_frames_are_kept_only_when_their_ids_match() {
    let (_d, s, _) = mem_store(1 << 20);
    let ses = s.session();
    let pages: Vec<Vec<u8>> = (0..8).map(|i| data(100 + i, 4096)).collect();
    let items: Vec<(ChunkId, &[u8])> = pages.iter().map(|p| (ChunkId::of(p), &p[..])).collect();
    let join = |ps: &[Vec<u8>]| ps.concat();
    // Matching ids: the given bytes are stored as they are (a marker size proves it was not
    // recompressed: level 19 output differs in size from level 1's).
    let z19 = zstd::bulk::compress(&join(&pages[..4]), 19).unwrap();
    let z1 = Codec::Zstd(1).compress(&join(&pages[..4])).unwrap();
    assert_ne!(z19.len(), z1.len());
    let before = s.stats().stored_bytes_new.load(Ordering::Relaxed);
    let pre = Precompressed {
        ids: items[..4].iter().map(|(id, _)| *id).collect(),
        stored: Some(z19.clone()),
    };
    assert_eq!(
        ses.put_frame_pre(&items[..4], ChunkKind::Data, Codec::Zstd(1), Some(pre)).unwrap(),
        4
    );
    assert_eq!(s.stats().stored_bytes_new.load(Ordering::Relaxed) - before, z19.len() as u64);
    // Ids that no longer match (two of them are stored now): ignored, the frame is compressed.
    let before = s.stats().stored_bytes_new.load(Ordering::Relaxed);
    let stale = Precompressed {
        ids: items[2..6].iter().map(|(id, _)| *id).collect(),
        stored: Some(vec![0xee; 100]),
    };
    assert_eq!(
        ses.put_frame_pre(&items[2..6], ChunkKind::Data, Codec::Zstd(1), Some(stale)).unwrap(),
        2
    );
    let z = Codec::Zstd(1).compress(&join(&pages[4..6])).unwrap();
    assert_eq!(s.stats().stored_bytes_new.load(Ordering::Relaxed) - before, z.len() as u64);
    // A sample that did not pay: stored raw.
    let before = s.stats().stored_bytes_new.load(Ordering::Relaxed);
    let raw = Precompressed { ids: items[6..].iter().map(|(id, _)| *id).collect(), stored: None };
    assert_eq!(
        ses.put_frame_pre(&items[6..], ChunkKind::Data, Codec::Zstd(1), Some(raw)).unwrap(),
        2
    );
    assert_eq!(s.stats().stored_bytes_new.load(Ordering::Relaxed) - before, 8192);
    s.flush().unwrap();
    for (id, p) in &items {
        assert_eq!(&s.get(id).unwrap()[..], *p);
    }
}

#[test]
fn refs_reopen_and_sealing_across_packs() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("store");
    let mut expect = vec![];
    {
        let s = Store::init_local(
            &dir,
            InitOptions { pack_size: 256 << 10, default_codec: Codec::Zstd(1) },
        )
        .unwrap();
        let ses = s.session();
        let ids: Vec<ChunkId> =
            (0..100).map(|i| ses.put(&data(i, 16384), ChunkKind::Data).unwrap()).collect();
        let root = ses.put_tree(&Tree { children: ids.clone(), payload: b"p".to_vec() }).unwrap();
        ses.commit_ref("disk/a", Ref::new(vec![root], b"{\"size\":1}".to_vec())).unwrap();
        ses.commit_ref("disk/a", Ref::new(vec![root], b"{\"size\":2}".to_vec())).unwrap();
        expect = ids;
        s.close().unwrap();
    }
    let s = Store::open_local(&dir).unwrap();
    let r = s.get_ref("disk/a").unwrap().unwrap();
    assert_eq!(r.generation, 2);
    assert_eq!(r.payload, b"{\"size\":2}");
    let t = Tree::decode(&s.get(&r.roots[0]).unwrap()).unwrap();
    assert_eq!(t.children, expect);
    for (i, id) in expect.iter().enumerate() {
        assert_eq!(s.get(id).unwrap(), data(i as u64, 16384));
    }
    assert!(s.list_refs("").unwrap() == vec!["disk/a".to_string()]);
    let packs = s.backend().list("packs/").unwrap().len();
    assert!(packs >= 3, "100 x 16 KiB should span several 256 KiB packs, got {packs}");
    // A deleted metadata cache is rebuilt from the backend's index objects.
    drop(s);
    std::fs::remove_file(local_meta_path(&dir)).unwrap();
    let s = Store::open_local(&dir).unwrap();
    assert_eq!(s.chunk_count(), 101);
    assert_eq!(s.get(&expect[42]).unwrap(), data(42, 16384));
}

#[test]
fn not_a_store_newer_version_and_in_use() {
    let d = tempfile::tempdir().unwrap();
    let e = Store::open_local(d.path()).err().unwrap();
    assert!(matches!(e, StoreError::NotAStore { .. }));
    assert!(e.to_string().contains("strata init"), "{e}");
    let dir = d.path().join("s");
    let s = Store::init_local(&dir, InitOptions::default()).unwrap();
    assert!(matches!(
        Store::init_local(&dir, InitOptions::default()),
        Err(StoreError::AlreadyExists { .. })
    ));
    // A second opener while the first holds the metadata cache gets a private cache rebuilt
    // from the backend: it sees what the first committed, and the first sees its writes.
    let ses = s.session();
    let a = ses.put(&data(1, 8192), ChunkKind::Data).unwrap();
    ses.commit_ref("disk/a", Ref::new(vec![a], vec![])).unwrap();
    drop(ses);
    let second = Store::open_local(&dir).unwrap();
    assert_eq!(second.get_ref("disk/a").unwrap().unwrap().roots, vec![a]);
    assert_eq!(second.get(&a).unwrap(), data(1, 8192));
    let ses = second.session();
    let b = ses.put(&data(2, 8192), ChunkKind::Data).unwrap();
    ses.commit_ref("disk/b", Ref::new(vec![b], vec![])).unwrap();
    drop(ses);
    assert_eq!(s.get(&b).unwrap(), data(2, 8192), "the first instance finds the second's chunk");
    drop(second);
    let private = dir.join(".meta/private");
    assert_eq!(std::fs::read_dir(&private).unwrap().count(), 0, "the private cache is unlinked");
    drop(s);
    let mut cfg = std::fs::read(dir.join("config")).unwrap();
    cfg[8] = 7;
    std::fs::write(dir.join("config"), &cfg).unwrap();
    let e = Store::open_local(&dir).err().unwrap();
    let msg = format!("{e}: {}", std::error::Error::source(&e).unwrap());
    assert!(msg.contains("version 7") && msg.contains("upgrade strata"), "{msg}");
}

#[test]
fn check_names_flipped_chunk_missing_and_truncated_packs() {
    let (_d, s, b) = mem_store(64 << 10);
    let ses = s.session();
    let ids: Vec<ChunkId> =
        (0..40).map(|i| ses.put(&data(i, 8192), ChunkKind::Data).unwrap()).collect();
    let root = ses.put_tree(&Tree { children: ids.clone(), payload: vec![] }).unwrap();
    ses.commit_ref("disk/x", Ref::new(vec![root], vec![])).unwrap();
    let clean = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(!clean.is_damaged(), "{:?}", clean.problems);
    assert_eq!(clean.chunks, 41);

    // Flip one byte inside the frame of chunk 7.
    let loc = s.inner.sh.index.read().chunks[&ids[7]];
    let pid = s.inner.sh.index.read().slot(loc.pack).unwrap().id;
    b.tamper(&pid.pack_key(), |v| v[loc.entry.frame_off as usize + 3] ^= 0x01);
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(rep.is_damaged());
    let p = rep
        .problems
        .iter()
        .find(|p| p.chunk.as_deref() == Some(&ids[7].to_hex()[..]))
        .expect("names the chunk");
    assert!(p.refs.contains(&"disk/x".to_string()), "names the ref: {p:?}");
    assert!(matches!(s.get(&ids[7]), Err(StoreError::Corrupt { .. })));

    // Truncate another pack, and delete a third.
    let mut packs: Vec<String> = b.list("packs/").unwrap().into_iter().map(|o| o.key).collect();
    packs.retain(|k| *k != pid.pack_key());
    b.tamper(&packs[0], |v| v.truncate(v.len() - 10));
    b.delete(&packs[1]).unwrap();
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(
        rep.problems.iter().any(|p| p.object == packs[0] && p.message.contains("truncated")),
        "{:?}",
        rep.problems
    );
    assert!(
        rep.problems.iter().any(|p| p.object == packs[1] && p.message.contains("missing")),
        "{:?}",
        rep.problems
    );
}

#[test]
fn failed_sync_poisons_until_reopen() {
    let d = tempfile::tempdir().unwrap();
    let base = MemoryBackend::new();
    {
        let s =
            Store::init(Arc::new(base.clone()), &d.path().join("a.redb"), InitOptions::default())
                .unwrap();
        s.close().unwrap();
    }
    let mut fb = FaultBackend::new(&base);
    fb.fail_sync_at = Some(1);
    let fb = Arc::new(fb);
    let s = Store::open(fb.clone(), &d.path().join("b.redb")).unwrap();
    let ses = s.session();
    ses.put(&data(1, 4096), ChunkKind::Data).unwrap();
    let e = ses.commit_ref("r", Ref::new(vec![], vec![])).unwrap_err();
    assert!(s.is_poisoned(), "{e}");
    let e2 = ses.put(&data(2, 4096), ChunkKind::Data).unwrap_err();
    assert!(matches!(e2, StoreError::Poisoned { .. }), "{e2}");
    assert!(e2.to_string().contains("reopen"), "{e2}");
}

#[test]
fn full_backend_is_reported_and_poisons() {
    let d = tempfile::tempdir().unwrap();
    let base = MemoryBackend::new();
    Store::init(Arc::new(base.clone()), &d.path().join("a.redb"), InitOptions::default())
        .unwrap()
        .close()
        .unwrap();
    let mut fb = FaultBackend::new(&base);
    fb.space_limit = Some(100_000);
    let s = Store::open(Arc::new(fb), &d.path().join("b.redb")).unwrap();
    let ses = s.session();
    let mut err = None;
    for i in 0..100 {
        let r = ses.put_with(&data(i, 65536), ChunkKind::Data, Codec::None).and_then(|_| s.flush());
        if let Err(e) = r {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("a full backend must fail");
    assert!(e.to_string().contains("out of space"), "{e}");
}

/// A memory backend that says it is a network backend, with slow puts (a link), and with
/// slow reads too when made by [`SlowNetwork::slow_reads`].
#[derive(Debug, Clone)]
struct SlowNetwork(MemoryBackend, u64);

impl SlowNetwork {
    fn new(mem: MemoryBackend) -> SlowNetwork {
        SlowNetwork(mem, 0)
    }
    fn slow_reads(mem: MemoryBackend, get_ms: u64) -> SlowNetwork {
        SlowNetwork(mem, get_ms)
    }
}

impl Backend for SlowNetwork {
    fn name(&self) -> String {
        "slow-network".into()
    }
    fn capabilities(&self) -> crate::backend::Capabilities {
        crate::backend::Capabilities { network: true, ..self.0.capabilities() }
    }
    fn get(&self, key: &str) -> crate::backend::BResult<Vec<u8>> {
        std::thread::sleep(std::time::Duration::from_millis(self.1));
        self.0.get(key)
    }
    fn put(&self, key: &str, data: &[u8]) -> crate::backend::BResult<()> {
        std::thread::sleep(std::time::Duration::from_millis(20));
        self.0.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> crate::backend::BResult<bool> {
        self.0.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> crate::backend::BResult<Vec<crate::backend::ObjectInfo>> {
        self.0.list(prefix)
    }
    fn delete(&self, key: &str) -> crate::backend::BResult<()> {
        self.0.delete(key)
    }
    fn sync(&self) -> crate::backend::BResult<()> {
        Ok(())
    }
}

/// Host B opened the store before host A wrote; then several of B's threads miss A's chunks
/// at once (a restore or delta-base plan reading page maps). Every one must find its chunk:
/// the refresh one of them starts must not make the others report it missing (they found
/// the lock it holds taken, counted no new pack and gave up).
#[test]
fn concurrent_misses_on_a_second_host_all_find_the_other_hosts_chunks() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let a = Store::init(
        Arc::new(SlowNetwork::slow_reads(mem.clone(), 30)),
        &d.path().join("a.redb"),
        InitOptions { pack_size: 1 << 20, default_codec: Codec::None },
    )
    .unwrap();
    let b =
        Store::open(Arc::new(SlowNetwork::slow_reads(mem.clone(), 30)), &d.path().join("b.redb"))
            .unwrap();
    let ses = a.session();
    let ids: Vec<ChunkId> =
        (0..8u64).map(|i| ses.put(&data(7000 + i, 300 << 10), ChunkKind::Data).unwrap()).collect();
    ses.commit_ref("r", Ref { roots: ids.clone(), ..Default::default() }).unwrap();
    assert!(mem.list("packs/").unwrap().len() >= 2, "the chunks span several packs");
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = ids.iter().map(|id| s.spawn(|| b.get(id))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, g) in got.into_iter().enumerate() {
        assert_eq!(
            g.unwrap_or_else(|e| panic!("chunk {i} on host B: {e}")),
            data(7000 + i as u64, 300 << 10)
        );
    }
}

#[test]
fn network_backend_seals_early_and_each_pack_indexes_itself() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let b = SlowNetwork::new(mem.clone());
    let s = Store::init(
        Arc::new(b),
        &d.path().join("m.redb"),
        InitOptions { pack_size: 16 << 20, default_codec: Codec::None },
    )
    .unwrap();
    let ses = s.session();
    assert_eq!(s.unsent_bytes(), 0);
    // 6 MiB, far below one 16 MiB pack: the first EARLY_SEAL_FIRST_BYTES are sealed at once
    // (the uploader is idle), then more whenever the uploader has room, the rest at the commit.
    let mut ids = Vec::new();
    let mut most_unsent = 0;
    for i in 0..96u64 {
        ids.push(ses.put(&data(1000 + i, 64 << 10), ChunkKind::Data).unwrap());
        // Everything stored is either still unsent or already acknowledged by the backend.
        let unsent = s.unsent_bytes();
        most_unsent = most_unsent.max(unsent);
        assert!(
            unsent + s.upload_speed().0 >= (i + 1) * (64 << 10),
            "{unsent} unsent after {} chunks",
            i + 1
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(most_unsent >= 64 << 10, "{most_unsent}");
    // Packs go up without any flush: at least two before the commit (6 MiB would make only
    // one of EARLY_SEAL_BYTES), the first of them sealed at EARLY_SEAL_FIRST_BYTES because
    // nothing was uploading.
    let t = std::time::Instant::now();
    while mem.list("packs/").unwrap().len() < 2 && t.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let early = mem.list("packs/").unwrap();
    assert!(
        early.len() >= 2,
        "{} packs before the commit: the idle uploader did not get a small pack",
        early.len()
    );
    let smallest = early.iter().map(|o| o.size).min().unwrap();
    assert!(
        (EARLY_SEAL_FIRST_BYTES..EARLY_SEAL_IDLE_BYTES).contains(&smallest),
        "smallest early pack {smallest} bytes"
    );
    let (bytes, busy) = s.upload_speed();
    assert!(bytes >= 2 * EARLY_SEAL_FIRST_BYTES && !busy.is_zero(), "{bytes} bytes in {busy:?}");
    ses.commit_ref("r", Ref { roots: vec![ids[0]], ..Default::default() }).unwrap();
    assert_eq!(s.unsent_bytes(), 0, "a committed store has nothing left to upload");
    let packs = mem.list("packs/").unwrap().len();
    assert!(packs >= 2, "{packs} packs: nothing sealed early");
    assert_eq!(mem.list("index/").unwrap().len(), 0, "a network pack is its own index");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(s.get(id).unwrap(), data(1000 + i as u64, 64 << 10));
    }
    // Another host, cold (no metadata cache), finds every chunk from the packs' tails; check
    // sees no orphan, and its gc keeps everything the ref holds.
    let other =
        Store::open(Arc::new(SlowNetwork::new(mem.clone())), &d.path().join("other.redb")).unwrap();
    assert_eq!(other.get(&ids[0]).unwrap(), data(1000, 64 << 10));
    let rep = other.check(CheckOptions { read_data: true }, &NoProgress).unwrap();
    assert!(rep.problems.is_empty() && rep.packs == packs, "{rep:?}");
    drop(other);
    // A local-style backend (not network) keeps one pack for the same data.
    let (_d2, s2, mem2) = mem_store(16 << 20);
    let ses2 = s2.session();
    for i in 0..96u64 {
        ses2.put_with(&data(1000 + i, 64 << 10), ChunkKind::Data, Codec::None).unwrap();
    }
    s2.flush().unwrap();
    assert_eq!(mem2.list("packs/").unwrap().len(), 1);
}

/// Idle seals ramp like TCP slow start: a burst's first pack is EARLY_SEAL_FIRST_BYTES, each
/// idle seal after it doubles, up to EARLY_SEAL_IDLE_BYTES; a ref commit starts the ramp
/// again, a flush alone (a long save's periodic one) does not.
#[test]
fn idle_seals_ramp_from_a_small_first_pack_and_restart_after_a_commit() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let s = Store::init(
        Arc::new(SlowNetwork::new(mem.clone())),
        &d.path().join("m.redb"),
        InitOptions { pack_size: 16 << 20, default_codec: Codec::None },
    )
    .unwrap();
    let ses = s.session();
    let chunk = 64u64 << 10;
    let mut n = 0u64;
    // Put chunks one at a time, each only once no upload is pending, so every seal is idle;
    // record the size of each pack as it lands.
    let mut burst = |count: usize| -> Vec<u64> {
        let before: HashSet<String> =
            mem.list("packs/").unwrap().into_iter().map(|o| o.key).collect();
        let mut sizes = Vec::new();
        let mut seen = before.clone();
        while sizes.len() < count {
            n += 1;
            ses.put(&data(5000 + n, chunk as usize), ChunkKind::Data).unwrap();
            let t = std::time::Instant::now();
            while s.inner.sh.uploads.pending() > 0
                && t.elapsed() < std::time::Duration::from_secs(10)
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            for o in mem.list("packs/").unwrap() {
                if seen.insert(o.key.clone()) {
                    sizes.push(o.size);
                }
            }
        }
        sizes
    };
    let check = |sizes: &[u64]| {
        // Each pack holds whole 64 KiB chunks plus its trailer: its payload is the first
        // multiple of 64 KiB at or above the threshold.
        let want = [
            EARLY_SEAL_FIRST_BYTES,
            2 * EARLY_SEAL_FIRST_BYTES,
            4 * EARLY_SEAL_FIRST_BYTES,
            EARLY_SEAL_IDLE_BYTES,
            EARLY_SEAL_IDLE_BYTES,
        ];
        for (got, want) in sizes.iter().zip(want) {
            assert!(
                (want..want + chunk + (64 << 10)).contains(got),
                "pack of {got} bytes, wanted ~{want}: {sizes:?}"
            );
        }
    };
    let first = burst(5);
    check(&first);
    s.flush().unwrap();
    let after_flush = burst(2);
    assert!(
        after_flush.iter().all(|&n| n >= EARLY_SEAL_IDLE_BYTES),
        "a flush restarted the ramp: {after_flush:?}"
    );
    ses.commit_ref("r", Ref { roots: vec![], ..Default::default() }).unwrap();
    check(&burst(3));
}

type Permits = Arc<(std::sync::Mutex<u64>, std::sync::Condvar)>;

/// A store on a [`GatedPacks`] backend (64 MiB packs, stored raw), its gate (no permits yet) and
/// the sizes of the packs whose puts began.
fn gated_store(dir: &std::path::Path) -> (Store, Permits, Arc<std::sync::Mutex<Vec<u64>>>) {
    let permits: Permits = Arc::new((std::sync::Mutex::new(0u64), std::sync::Condvar::new()));
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let b =
        GatedPacks { mem: MemoryBackend::new(), permits: permits.clone(), sizes: sizes.clone() };
    let s = Store::init(
        Arc::new(b),
        &dir.join("m.redb"),
        InitOptions { pack_size: 64 << 20, default_codec: Codec::None },
    )
    .unwrap();
    (s, permits, sizes)
}

/// Let `k` more pack puts through the gate.
fn release_puts(permits: &Permits, k: u64) {
    let (m, cv) = &**permits;
    *m.lock().unwrap() += k;
    cv.notify_all();
}

/// Opens a [`GatedPacks`] gate for good when dropped: declared after the store, it is dropped
/// first, so a failed assertion does not leave the store's drop waiting on held puts.
struct OpenGate(Permits);

impl Drop for OpenGate {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) = u64::MAX / 2;
        self.0 .1.notify_all();
    }
}

/// A network backend whose pack puts wait for a permit; it records every pack's size as its
/// put begins.
#[derive(Debug)]
struct GatedPacks {
    mem: MemoryBackend,
    permits: Arc<(std::sync::Mutex<u64>, std::sync::Condvar)>,
    sizes: Arc<std::sync::Mutex<Vec<u64>>>,
}

impl Backend for GatedPacks {
    fn name(&self) -> String {
        "gated".into()
    }
    fn capabilities(&self) -> crate::backend::Capabilities {
        crate::backend::Capabilities { network: true, ..self.mem.capabilities() }
    }
    fn get(&self, key: &str) -> crate::backend::BResult<Vec<u8>> {
        self.mem.get(key)
    }
    fn put(&self, key: &str, data: &[u8]) -> crate::backend::BResult<()> {
        if key.starts_with("packs/") {
            self.sizes.lock().unwrap_or_else(|e| e.into_inner()).push(data.len() as u64);
            let (m, cv) = &*self.permits;
            let mut p = cv
                .wait_while(m.lock().unwrap_or_else(|e| e.into_inner()), |p| *p == 0)
                .unwrap_or_else(|e| e.into_inner());
            *p -= 1;
        }
        self.mem.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> crate::backend::BResult<bool> {
        self.mem.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> crate::backend::BResult<Vec<crate::backend::ObjectInfo>> {
        self.mem.list(prefix)
    }
    fn delete(&self, key: &str) -> crate::backend::BResult<()> {
        self.mem.delete(key)
    }
    fn sync(&self) -> crate::backend::BResult<()> {
        Ok(())
    }
}

/// Busy seals ramp too: while one pack is uploading, the next is sealed at twice
/// EARLY_SEAL_FIRST_BYTES, then at double the last busy seal, up to EARLY_SEAL_BYTES, so a
/// save's first uploads overlap (two in flight) instead of each waiting for the last one's
/// reply; a ref commit starts the ramp again.
#[test]
fn busy_seals_ramp_up_to_the_full_early_seal_and_restart_after_a_commit() {
    let d = tempfile::tempdir().unwrap();
    let (s, permits, sizes) = gated_store(d.path());
    let ses = s.session();
    // Dropped before the store (declared after it): a failed assertion must not leave the
    // store's drop waiting on held puts.
    let _open_on_exit = OpenGate(permits.clone());
    let chunk = 64u64 << 10;
    let mut n = 0u64;
    // Puts begin on the uploader's threads a moment after the seal counts as pending.
    let wait_sizes = |k: usize| {
        let t = std::time::Instant::now();
        while sizes.lock().unwrap().len() < k && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    let release = |k: u64| release_puts(&permits, k);
    // Put chunks until two packs are uploading (their puts held), then let one finish: each
    // round seals exactly one busy pack.
    let mut until_two_pending = |ids: &mut Vec<ChunkId>| {
        let mut k = 0;
        while s.inner.sh.uploads.pending() < 2 {
            n += 1;
            k += 1;
            assert!(k < 400, "no busy seal after {k} chunks");
            ids.push(ses.put(&data(9000 + n, chunk as usize), ChunkKind::Data).unwrap());
        }
    };
    let wait_one_landed = |want_pending: usize| {
        let t = std::time::Instant::now();
        while s.inner.sh.uploads.pending() > want_pending {
            assert!(t.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    let mut ids = Vec::new();
    for _ in 0..6 {
        until_two_pending(&mut ids);
        release(1);
        wait_one_landed(1);
    }
    wait_sizes(7);
    let payload = |v: &[u64]| v.iter().map(|&b| b / chunk * chunk).collect::<Vec<u64>>();
    let want: Vec<u64> =
        [1u64, 2, 4, 8, 16, 32, 32].iter().map(|&k| k * EARLY_SEAL_FIRST_BYTES).collect();
    let got = payload(&sizes.lock().unwrap());
    assert_eq!(&got[..], &want[..], "pack payloads (whole 64 KiB chunks) in seal order");
    assert_eq!(32 * EARLY_SEAL_FIRST_BYTES, EARLY_SEAL_BYTES);
    release(1 << 20);
    ses.commit_ref("r", Ref { roots: vec![ids[0]], ..Default::default() }).unwrap();
    // After the commit: 256 KiB (idle), then 512 KiB (busy) again.
    sizes.lock().unwrap().clear();
    *permits.0.lock().unwrap() = 0;
    until_two_pending(&mut ids);
    wait_sizes(2);
    assert_eq!(
        payload(&sizes.lock().unwrap()),
        vec![EARLY_SEAL_FIRST_BYTES, 2 * EARLY_SEAL_FIRST_BYTES]
    );
    release(1 << 20);
    ses.commit_ref("r2", Ref { roots: vec![ids[1]], ..Default::default() }).unwrap();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(s.get(id).unwrap(), data(9001 + i as u64, chunk as usize));
    }
}

/// At the end of a stream a memory save asks for an early seal (`seal_for_upload`), so its last
/// pages go up while the page maps are written. While a megabyte or more of packs is still
/// uploading the link stays busy anyway: the open pack is left for the maps to join (one
/// object fewer at the end); with less in flight it is sealed at once.
#[test]
fn seal_for_upload_leaves_the_open_pack_while_a_big_upload_is_running() {
    let d = tempfile::tempdir().unwrap();
    let (s, permits, sizes) = gated_store(d.path());
    let ses = s.session();
    let _open_on_exit = OpenGate(permits.clone());
    let chunk = 64usize << 10;
    let release = |k: u64| release_puts(&permits, k);
    let pending = || s.inner.sh.uploads.pending();
    let wait_pending = |want: usize| {
        let t = std::time::Instant::now();
        while pending() != want {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(10),
                "{} uploads pending, want {want}",
                pending()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    let mut ids = Vec::new();
    let mut n = 0u64;
    let mut put_one = |ids: &mut Vec<ChunkId>| {
        n += 1;
        ids.push(ses.put(&data(5000 + n, chunk), ChunkKind::Data).unwrap());
    };
    // Idle seals ramp 256 KiB, 512 KiB, 1 MiB, 2 MiB: each lands before the next is sealed.
    let mut sealed = 0;
    for _ in 0..4 {
        while pending() == 0 {
            put_one(&mut ids);
            assert!(ids.len() < 100);
        }
        sealed += 1;
        if s.inner.sh.uploads.pending_bytes() >= EARLY_SEAL_BUSY_BYTES {
            break;
        }
        release(1);
        wait_pending(0);
    }
    let big = s.inner.sh.uploads.pending_bytes();
    assert!(big >= EARLY_SEAL_BUSY_BYTES, "the held upload is {big} bytes");
    // The held pack's put begins on an uploader thread a moment after its seal counts as
    // pending (on a loaded CI host, long enough for the count below to miss it).
    let t = std::time::Instant::now();
    while sizes.lock().unwrap().len() < sealed {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the held pack's put never began"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    put_one(&mut ids);
    let packs_begun = sizes.lock().unwrap().len();
    s.seal_for_upload().unwrap();
    assert_eq!(pending(), 1, "sealed early although {big} bytes were uploading");
    // Once that upload has landed the link would idle: the open pack (2 chunks) goes at once.
    put_one(&mut ids);
    release(1);
    wait_pending(0);
    s.seal_for_upload().unwrap();
    assert_eq!(pending(), 1, "not sealed with nothing uploading");
    let t = std::time::Instant::now();
    while sizes.lock().unwrap().len() == packs_begun
        && t.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let last = *sizes.lock().unwrap().last().unwrap();
    assert_eq!(
        last / chunk as u64,
        2,
        "the early-sealed pack holds the two chunks put after the big one ({last} bytes)"
    );
    release(1 << 20);
    ses.commit_ref("r", Ref { roots: vec![ids[0]], ..Default::default() }).unwrap();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(s.get(id).unwrap(), data(5001 + i as u64, chunk));
    }
}

/// A pack's buffer comes back for the next open pack as soon as its put finishes, before any
/// flush makes it durable (otherwise a disk fold fills ~30 fresh 32 MiB buffers and holds them
/// all until its commit); reads of such a pack go to the backend; spares are dropped with
/// the last session.
#[test]
fn pack_buffers_are_reused_once_put_and_dropped_after_the_last_session() {
    let (_d, s, b) = mem_store(256 << 10);
    let ses = s.session();
    let mut ids = vec![];
    let t = std::time::Instant::now();
    let mut i = 0u64;
    while s.inner.sh.spare_packs.lock().is_empty()
        && t.elapsed() < std::time::Duration::from_secs(20)
    {
        let d = data(1000 + i, 16 << 10);
        ids.push((ses.put_with(&d, ChunkKind::Data, Codec::None).unwrap(), d));
        i += 1;
    }
    assert!(
        !s.inner.sh.spare_packs.lock().is_empty(),
        "no pack buffer came back after {} chunks",
        ids.len()
    );
    {
        let idx = s.inner.sh.index.read();
        let put_not_durable = idx
            .packs
            .iter()
            .flatten()
            .filter(|p| !p.durable && p.mem.is_none() && p.size > 0)
            .count();
        assert!(put_not_durable >= 1, "a put pack is not durable before a flush");
    }
    assert!(b.list("index/").unwrap().is_empty(), "no index object before the flush");
    // Before any flush, those chunks are read back from the backend.
    for (id, d) in &ids {
        assert_eq!(&s.get(id).unwrap(), d);
    }
    // A new open pack takes a spare buffer; what it holds must be only its own bytes.
    s.flush().unwrap();
    let spare = s.inner.sh.spare_packs.lock().len();
    assert!(spare >= 1);
    let d = data(999, 16 << 10);
    ids.push((ses.put_with(&d, ChunkKind::Data, Codec::None).unwrap(), d));
    assert_eq!(
        s.inner.sh.spare_packs.lock().len(),
        spare - 1,
        "the new open pack took a spare buffer"
    );
    for i in 0..80u64 {
        let d = data(5000 + i, 16 << 10);
        ids.push((ses.put_with(&d, ChunkKind::Data, Codec::None).unwrap(), d));
    }
    s.flush().unwrap();
    for (id, d) in &ids {
        assert_eq!(&s.get(id).unwrap(), d);
    }
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
    drop(ses);
    assert_eq!(
        s.inner.sh.spare_packs.lock().len(),
        0,
        "no spare buffers kept once no session writes"
    );
}

/// Packs are sealed (their entry tables compressed) outside the open-pack lock: a chunk in a
/// pack being sealed stays readable, and a flush waits for seals other threads started.
#[test]
fn chunks_stay_readable_and_flushable_while_their_pack_is_sealed() {
    // 64-byte chunks: a 1 MiB pack holds ~16k entries, so each seal compresses ~1 MiB of
    // entries and the window between leaving the open pack and reaching memory is wide.
    let (_d, s, b) = mem_store(1 << 20);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        for w in 0..2u64 {
            let (s, stop) = (&s, &stop);
            sc.spawn(move || {
                let ses = s.session();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    ses.put_with(&data(w << 40 | i, 64), ChunkKind::Data, Codec::None).unwrap();
                    i += 1;
                }
            });
        }
        // Stop the writers even when an assertion below fails (the scope joins them).
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = Stop(&stop);
        let ses = s.session();
        // Put a chunk, wait until a writer thread takes its pack for sealing, then at once
        // read the chunk (first half) or flush and expect its pack indexed (second half).
        for i in 0..40u64 {
            let id = ses.put_with(&data(7 << 40 | i, 64), ChunkKind::Data, Codec::None).unwrap();
            let no = s.inner.sh.index.read().chunks[&id].pack;
            let t = std::time::Instant::now();
            while s.inner.open.lock().no == no && t.elapsed() < std::time::Duration::from_secs(10) {
                std::hint::spin_loop();
            }
            if i < 20 {
                s.get(&id)
                    .unwrap_or_else(|e| panic!("chunk unreadable while its pack was sealed: {e}"));
            } else {
                s.flush().unwrap();
                let (pack, _) = s.locate(&id).unwrap();
                assert!(
                    b.get(&pack.index_key()).is_ok(),
                    "flush returned before the pack of a chunk put before it was indexed"
                );
            }
        }
    });
}

/// A network pack whose entry table is larger than one tail read is indexed with a second,
/// exact read; a pack with a damaged tail is reported by `check` and its chunks stay invisible,
/// and `gc` on a network store deletes no pack for lacking an index object.
#[test]
fn network_store_reads_big_pack_tables_and_reports_damaged_tails() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let s = Store::init(
        Arc::new(SlowNetwork::new(mem.clone())),
        &d.path().join("a.redb"),
        InitOptions { pack_size: 64 << 20, default_codec: Codec::None },
    )
    .unwrap();
    let ses = s.session();
    // 3000 chunks of 64 bytes in one frame each: a ~3000-entry table, well over 64 KiB raw,
    // and over PACK_TAIL_READ compressed (ids are random).
    let ids: Vec<ChunkId> = (0..3000u64)
        .map(|i| ses.put_with(&data(i, 64), ChunkKind::Data, Codec::None).unwrap())
        .collect();
    ses.commit_ref("r", Ref { roots: vec![], ..Default::default() }).unwrap();
    drop(ses);
    s.close().unwrap();
    let packs = mem.list("packs/").unwrap();
    let big = packs.iter().max_by_key(|o| o.size).unwrap();
    let bytes = mem.get(&big.key).unwrap();
    let trailer_off = endian::le64(&bytes, bytes.len() - 24);
    assert!(
        big.size - trailer_off > crate::store::pack::PACK_TAIL_READ,
        "table of {} bytes fits one read",
        big.size - trailer_off
    );
    let other =
        Store::open(Arc::new(SlowNetwork::new(mem.clone())), &d.path().join("b.redb")).unwrap();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(other.get(id).unwrap(), data(i as u64, 64));
    }
    other.close().unwrap();
    // Flip a byte of the big pack's table: a cold host does not see its chunks, check names it.
    let mut bad = bytes.clone();
    bad[trailer_off as usize + 100] ^= 0x40;
    mem.put(&big.key, &bad).unwrap();
    let third =
        Store::open(Arc::new(SlowNetwork::new(mem.clone())), &d.path().join("c.redb")).unwrap();
    let in_big = ids
        .iter()
        .filter(|id| matches!(third.get(id), Err(StoreError::ChunkMissing { .. })))
        .count();
    assert!(in_big > 1000, "{in_big} chunks invisible");
    let rep = third.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(rep.problems.iter().any(|p| p.object == big.key), "{:?}", rep.problems);
    let r = third.gc(&NoProgress).unwrap();
    assert_eq!(r.orphan_packs_deleted, 0);
    assert!(mem.get(&big.key).is_ok(), "gc deleted a pack it could not read");
}

/// On a network backend an acknowledged upload makes the pack durable at once: its buffer is
/// back on the spare list for the next open pack before any flush, and reads (now from the
/// backend) return the right bytes.
#[test]
fn network_pack_buffers_return_when_the_upload_is_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let s = Store::init(
        Arc::new(SlowNetwork::new(mem.clone())),
        &d.path().join("m.redb"),
        InitOptions { pack_size: 16 << 20, default_codec: Codec::None },
    )
    .unwrap();
    let ses = s.session();
    let mut ids = Vec::new();
    let t = std::time::Instant::now();
    let mut i = 0u64;
    // Write until an uploaded pack's buffer came back (no flush meanwhile).
    while s.inner.sh.spare_packs.lock().is_empty()
        && t.elapsed() < std::time::Duration::from_secs(20)
    {
        let c = data(5000 + i, 64 << 10);
        ids.push((ses.put(&c, ChunkKind::Data).unwrap(), c));
        i += 1;
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(
        !s.inner.sh.spare_packs.lock().is_empty(),
        "no pack buffer came back after {} chunks",
        ids.len()
    );
    let durable = s
        .inner
        .sh
        .index
        .read()
        .packs
        .iter()
        .flatten()
        .filter(|p| p.durable && p.mem.is_none())
        .count();
    assert!(durable >= 1, "an acknowledged network pack is durable before any flush");
    // Reuse: the next packs fill recycled buffers and still hold only their own bytes.
    for j in 0..64u64 {
        let c = data(9000 + j, 64 << 10);
        ids.push((ses.put(&c, ChunkKind::Data).unwrap(), c));
    }
    s.flush().unwrap();
    for (id, c) in &ids {
        assert_eq!(&s.get(id).unwrap(), c);
    }
    assert!(!s.check(CheckOptions { read_data: true }, &NoProgress).unwrap().is_damaged());
}

/// `commit_new_ref` writes a new name, and refuses (writing nothing) one that exists.
#[test]
fn commit_new_ref_refuses_an_existing_name() {
    let (_d, s, _) = mem_store(1 << 20);
    let ses = s.session();
    let a = ses.put(&data(1, 4096), ChunkKind::Data).unwrap();
    let b = ses.put(&data(2, 4096), ChunkKind::Data).unwrap();
    ses.commit_new_ref("vm/x", Ref { roots: vec![a], ..Default::default() }).unwrap();
    let e = ses.commit_new_ref("vm/x", Ref { roots: vec![b], ..Default::default() }).unwrap_err();
    assert!(matches!(e, StoreError::RefExists { .. }), "{e}");
    let r = s.get_ref("vm/x").unwrap().unwrap();
    assert_eq!((r.roots, r.generation), (vec![a], 1), "the first commit stands");
    // commit_ref replaces, with the next generation.
    ses.commit_ref("vm/x", Ref { roots: vec![b], ..Default::default() }).unwrap();
    let r = s.get_ref("vm/x").unwrap().unwrap();
    assert_eq!((r.roots, r.generation), (vec![b], 2));
}

#[test]
fn locate_many_matches_locate_across_lock_batches() {
    let (_d, s, _) = mem_store(1 << 20);
    let ses = s.session();
    // More ids than one lock hold covers, with absent ids in between.
    let mut ids = Vec::new();
    for i in 0..(crate::store::read::LOCATE_BATCH as u64 + 100) {
        if i % 97 == 0 {
            ids.push(ChunkId::of(format!("absent {i}").as_bytes()));
        } else {
            ids.push(ses.put(&i.to_le_bytes(), ChunkKind::Data).unwrap());
        }
    }
    s.flush().unwrap();
    // Collected first: the callback runs under the index lock and must not call the store.
    let mut got: Vec<Option<Option<(PackId, PackEntry)>>> = vec![None; ids.len()];
    s.locate_many(&ids, |i, hit| {
        assert!(got[i].is_none(), "id {i} reported twice");
        got[i] = Some(hit.map(|(p, e)| (p, *e)));
    });
    for (i, g) in got.into_iter().enumerate() {
        let g = g.unwrap_or_else(|| panic!("id {i} not reported"));
        match (g, s.locate(&ids[i])) {
            (None, None) => assert_eq!(i % 97, 0, "id {i} should be found"),
            (Some((p, e)), Some((wp, we))) => {
                assert_eq!(p, wp);
                assert_eq!(e.id, ids[i]);
                assert_eq!((e.frame_off, e.off_in_frame), (we.frame_off, we.off_in_frame));
            }
            (h, w) => {
                panic!("id {i}: locate_many {:?}, locate {:?}", h.map(|h| h.0), w.map(|w| w.0))
            }
        }
    }
}

//! GC tests: sweeping what refs and sessions no longer reach, never what they do, while
//! writers run; each race between GC and a writer is pinned by a backend hook that lands the
//! writer's step at the exact point where GC would go wrong without its guard; and the sweep
//! plan's partition of packs, without a backend.

use super::objects::{Ref, Tree};
use super::pack::{ChunkKind, PackEntry};
use super::tests::{data, mem_store};
use super::*;
use crate::backend::memory::MemoryBackend;
use crate::backend::Backend;
use crate::progress::NoProgress;
use check::CheckOptions;

#[test]
fn gc_reclaims_deleted_refs_and_keeps_shared_chunks() {
    let (_d, s, b) = mem_store(64 << 10);
    let ses = s.session();
    let shared: Vec<ChunkId> =
        (0..20).map(|i| ses.put(&data(i, 8192), ChunkKind::Data).unwrap()).collect();
    let only_a: Vec<ChunkId> =
        (100..140).map(|i| ses.put(&data(i, 8192), ChunkKind::Data).unwrap()).collect();
    let ra = ses
        .put_tree(&Tree { children: [shared.clone(), only_a.clone()].concat(), payload: vec![] })
        .unwrap();
    let rb = ses.put_tree(&Tree { children: shared.clone(), payload: vec![] }).unwrap();
    ses.commit_ref("disk/a", Ref::new(vec![ra], vec![])).unwrap();
    ses.commit_ref("disk/b", Ref::new(vec![rb], vec![])).unwrap();
    drop(ses);
    let r0 = s.gc(&NoProgress).unwrap();
    assert_eq!(r0.dead_chunks, 0);
    let stored_before: u64 = b.list("packs/").unwrap().iter().map(|o| o.size).sum();
    s.delete_ref("disk/a").unwrap();
    let r = s.gc(&NoProgress).unwrap();
    assert_eq!(r.dead_chunks, 41, "40 data chunks + the tree");
    assert!(r.bytes_freed > 0);
    let stored_after: u64 = b.list("packs/").unwrap().iter().map(|o| o.size).sum();
    assert!(stored_after < stored_before);
    for id in &shared {
        s.get(id).unwrap();
    }
    for id in &only_a {
        assert!(matches!(s.get(id), Err(StoreError::ChunkMissing { .. })));
    }
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
    assert_eq!(b.list("index/").unwrap().len(), b.list("packs/").unwrap().len());
}

#[test]
fn gc_never_collects_what_live_sessions_hold() {
    let (_d, s, _) = mem_store(64 << 10);
    let w = s.session();
    let kept = w.put(&data(1, 4096), ChunkKind::Data).unwrap();
    s.flush().unwrap();
    s.gc(&NoProgress).unwrap();
    assert!(s.contains(&kept), "pinned chunk collected");
    // Dedup hit after GC still has its data; committing works.
    let again = w.put(&data(1, 4096), ChunkKind::Data).unwrap();
    w.commit_ref("r", Ref::new(vec![again], vec![])).unwrap();
    drop(w);
    s.gc(&NoProgress).unwrap();
    assert_eq!(s.get(&kept).unwrap(), data(1, 4096));
}

#[test]
fn gc_concurrent_with_writers_loses_nothing() {
    let (_d, s, _) = mem_store(32 << 10);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let s = s.clone();
                let stop = &stop;
                sc.spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) || n < 30 {
                        let ses = s.session();
                        // Half the chunks repeat earlier content (dedup hits on possibly-dead chunks).
                        let ids: Vec<ChunkId> = (0..8)
                            .map(|i| {
                                ses.put(&data((n + i) % 20 + t * 1000, 4096), ChunkKind::Data)
                                    .unwrap()
                            })
                            .collect();
                        let root = ses.put_tree(&Tree { children: ids, payload: vec![] }).unwrap();
                        ses.commit_ref(&format!("w{t}/{}", n % 5), Ref::new(vec![root], vec![]))
                            .unwrap();
                        n += 1;
                    }
                })
            })
            .collect();
        // Writers stop even when a GC fails, so the failure is reported instead of hanging.
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(&stop);
        for _ in 0..15 {
            s.gc(&NoProgress).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
    });
    s.gc(&NoProgress).unwrap();
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
    assert_eq!(rep.refs, 10);
}

/// Run once, when the backend call its key names happens.
type Hook = Box<dyn FnOnce() + Send>;

/// A memory backend that runs a hook once: before the first listing of a prefix
/// (`list:packs/`) or after the first read of a key (`get:refs/a`); and can fail one read.
struct HookBackend {
    inner: MemoryBackend,
    hook: parking_lot::Mutex<Option<(String, Hook)>>,
    fail_next_get: parking_lot::Mutex<Option<String>>,
}

impl HookBackend {
    fn new(inner: &MemoryBackend) -> Arc<HookBackend> {
        Arc::new(HookBackend {
            inner: inner.clone(),
            hook: Default::default(),
            fail_next_get: Default::default(),
        })
    }
    fn set_hook(&self, on: &str, f: impl FnOnce() + Send + 'static) {
        *self.hook.lock() = Some((on.to_string(), Box::new(f)));
    }
    fn fire(&self, on: &str) {
        let hook = {
            let mut h = self.hook.lock();
            if h.as_ref().is_some_and(|(k, _)| k == on) {
                h.take()
            } else {
                None
            }
        };
        if let Some((_, f)) = hook {
            f();
        }
    }
    fn fired(&self) -> bool {
        self.hook.lock().is_none()
    }
}

impl std::fmt::Debug for HookBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HookBackend")
    }
}

impl Backend for HookBackend {
    fn name(&self) -> String {
        "hook".into()
    }
    fn capabilities(&self) -> crate::backend::Capabilities {
        self.inner.capabilities()
    }
    fn get(&self, key: &str) -> crate::backend::BResult<Vec<u8>> {
        if self.fail_next_get.lock().take_if(|k| k == key).is_some() {
            return Err(crate::backend::BackendError::new(
                crate::backend::ErrorKind::Other,
                "get",
                key,
            ));
        }
        let r = self.inner.get(key);
        self.fire(&format!("get:{key}"));
        r
    }
    fn get_range(&self, key: &str, offset: u64, len: u64) -> crate::backend::BResult<Vec<u8>> {
        self.inner.get_range(key, offset, len)
    }
    fn put(&self, key: &str, data: &[u8]) -> crate::backend::BResult<()> {
        self.inner.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> crate::backend::BResult<bool> {
        self.inner.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> crate::backend::BResult<Vec<crate::backend::ObjectInfo>> {
        self.fire(&format!("list:{prefix}"));
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> crate::backend::BResult<()> {
        self.inner.delete(key)
    }
    fn sync(&self) -> crate::backend::BResult<()> {
        self.inner.sync()
    }
}

/// GC marks refs without blocking writers, then re-marks the refs that changed meanwhile. A
/// commit that cannot read the old ref restarts its generation at 1, so "changed" must mean
/// other roots, not another generation number.
#[test]
fn gc_re_marks_a_ref_rewritten_during_its_mark_even_with_the_same_generation() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let hb = HookBackend::new(&mem);
    let s = Store::init(
        hb.clone(),
        &d.path().join("m.redb"),
        InitOptions { pack_size: 32 << 10, default_codec: Codec::None },
    )
    .unwrap();
    let w = s.session();
    let a = w.put(&data(1, 4096), ChunkKind::Data).unwrap();
    w.commit_ref("a", Ref::new(vec![a], vec![])).unwrap();
    drop(w);
    assert_eq!(s.get_ref("a").unwrap().unwrap().generation, 1);
    // Right after GC's mark reads ref `a`, a writer points it at new content; reading the
    // old ref fails, so the new one has generation 1 too.
    let (s2, hb2) = (s.clone(), hb.clone());
    hb.set_hook("get:refs/a", move || {
        let w = s2.session();
        let b = w.put(&data(2, 4096), ChunkKind::Data).unwrap();
        *hb2.fail_next_get.lock() = Some("refs/a".into());
        w.commit_ref("a", Ref::new(vec![b], vec![])).unwrap();
    });
    s.gc(&NoProgress).unwrap();
    assert!(hb.fired(), "GC did not read ref a");
    let r = s.get_ref("a").unwrap().unwrap();
    assert_eq!(r.generation, 1, "the old ref was read after all");
    assert_eq!(s.get(&r.roots[0]).unwrap(), data(2, 4096), "GC swept the rewritten ref's content");
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
}

/// GC's orphan sweep deletes packs no index object names. A pack this process opens and puts
/// while GC runs has no index object until the next flush: GC must know it is ours, so it
/// reads its list of known packs after listing the backend (read before, it would delete such
/// a pack under live chunks, which `gc_concurrent_with_writers_loses_nothing` hits about one
/// run in 50).
#[test]
fn gc_keeps_packs_put_while_it_lists_orphans() {
    let d = tempfile::tempdir().unwrap();
    let mem = MemoryBackend::new();
    let hb = HookBackend::new(&mem);
    let s = Store::init(
        hb.clone(),
        &d.path().join("m.redb"),
        InitOptions { pack_size: 32 << 10, default_codec: Codec::None },
    )
    .unwrap();
    let ses = s.session();
    let packs =
        |m: &MemoryBackend| m.keys().into_iter().filter(|k| k.starts_with("packs/")).count();
    let before = packs(&mem);
    // Just before GC lists packs for its orphan sweep, a writer fills a pack: it is sealed
    // and put, and its index object waits for the next flush.
    let (s2, mem2) = (s.clone(), mem.clone());
    let ids: Arc<parking_lot::Mutex<Vec<ChunkId>>> = Arc::default();
    let ids2 = ids.clone();
    hb.set_hook("list:packs/", move || {
        let w = s2.session();
        let mut i = 0;
        let t = std::time::Instant::now();
        while packs(&mem2) == before && t.elapsed() < std::time::Duration::from_secs(10) {
            ids2.lock().push(w.put(&data(500 + i, 8192), ChunkKind::Data).unwrap());
            i += 1;
            if i >= 8 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        assert!(packs(&mem2) > before, "no pack was put");
    });
    let rep = s.gc(&NoProgress).unwrap();
    assert!(hb.fired(), "GC did not list packs/");
    assert_eq!(rep.orphan_packs_deleted, 0, "{rep:?}");
    let ids = ids.lock().clone();
    let root = ses.put_tree(&Tree { children: ids.clone(), payload: vec![] }).unwrap();
    ses.commit_ref("kept", Ref::new(vec![root], vec![])).unwrap();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(s.get(id).unwrap(), data(500 + i as u64, 8192), "chunk {i} lost");
    }
    let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
}

/// A long-open instance (a serving daemon) runs GC after another instance wrote a ref whose
/// tree it has never seen, deduplicated against chunks it knows: GC must learn the other's
/// packs first, or it would treat those chunks as dead and break the other's ref.
#[test]
fn gc_learns_packs_written_by_other_instances_first() {
    let d = tempfile::tempdir().unwrap();
    let b = MemoryBackend::new();
    let opts = InitOptions { pack_size: 64 << 10, default_codec: Codec::Lz4 };
    let a = Store::init(Arc::new(b.clone()), &d.path().join("a.redb"), opts).unwrap();
    let ses = a.session();
    let ids: Vec<ChunkId> =
        (0..20).map(|i| ses.put(&data(i, 8192), ChunkKind::Data).unwrap()).collect();
    let root = ses.put_tree(&Tree { children: ids.clone(), payload: vec![] }).unwrap();
    ses.commit_ref("disk/x", Ref::new(vec![root], vec![])).unwrap();
    drop(ses);
    a.flush().unwrap();
    {
        let other = Store::open(Arc::new(b.clone()), &d.path().join("b.redb")).unwrap();
        let ses = other.session();
        let same: Vec<ChunkId> =
            (0..20).map(|i| ses.put(&data(i, 8192), ChunkKind::Data).unwrap()).collect();
        assert_eq!(same, ids);
        let root = ses.put_tree(&Tree { children: same, payload: b"y".to_vec() }).unwrap();
        ses.commit_ref("disk/y", Ref::new(vec![root], vec![])).unwrap();
        drop(ses);
        other.close().unwrap();
    }
    a.delete_ref("disk/x").unwrap();
    let r = a.gc(&NoProgress).unwrap();
    assert!(r.dead_chunks <= 1, "at most x's tree is dead (its pack may be kept): {r:?}");
    let fresh = Store::open(Arc::new(b.clone()), &d.path().join("c.redb")).unwrap();
    let y = fresh.get_ref("disk/y").unwrap().unwrap();
    let t = Tree::decode(&fresh.get(&y.roots[0]).unwrap()).unwrap();
    for (i, id) in t.children.iter().enumerate() {
        assert_eq!(fresh.get(id).unwrap(), data(i as u64, 8192));
    }
    assert!(!fresh.check(CheckOptions::default(), &NoProgress).unwrap().is_damaged());
}

fn gc_entry(n: u8, raw_len: u32) -> PackEntry {
    PackEntry {
        id: ChunkId([n; 32]),
        frame_off: n as u64 * 100,
        frame_len: 100,
        frame_raw_len: raw_len,
        off_in_frame: 0,
        raw_len,
        codec: crate::codec::Codec::None,
        kind: ChunkKind::Data,
        frame_crc: 0,
    }
}

/// A pack with nothing live is deleted; one at least a quarter dead (by raw bytes) is
/// repacked; a mostly live one is kept.
#[test]
fn a_packs_fate_follows_its_dead_fraction() {
    let (a, b, c, d) = (gc_entry(1, 100), gc_entry(2, 100), gc_entry(3, 100), gc_entry(4, 100));
    assert_eq!(super::gc::fate(&[], &[a]), super::gc::Fate::Delete);
    assert_eq!(super::gc::fate(&[a, b, c], &[d]), super::gc::Fate::Repack);
    assert_eq!(super::gc::fate(&[a, b, c], &[gc_entry(4, 99)]), super::gc::Fate::Keep);
    assert_eq!(super::gc::fate(&[gc_entry(1, 10)], &[gc_entry(2, 4000)]), super::gc::Fate::Repack);
}

/// The sweep plan partitions durable packs by fate, counts and unlinks only the dead entries
/// of doomed and repacked packs, forgets doomed packs' slots, and leaves packs that are not
/// durable yet alone.
#[test]
fn the_sweep_partitions_packs_and_unlinks_only_dead_entries() {
    use super::gc::{plan_sweep, Doomed};
    let mut idx = super::Index::default();
    let pack = |n: u8, durable: bool| super::PackSlot {
        id: PackId([n; 16]),
        size: 1000 + n as u64,
        mem: None,
        durable,
    };
    let dead_pack = idx.add_slot(pack(1, true));
    let mixed = idx.add_slot(pack(2, true));
    let live_pack = idx.add_slot(pack(3, true));
    let fresh = idx.add_slot(pack(4, false));
    let mut put = |no: u32, n: u8| {
        idx.chunks.insert(ChunkId([n; 32]), super::Loc { pack: no, entry: gc_entry(n, 100) });
    };
    put(dead_pack, 10);
    put(dead_pack, 11);
    put(mixed, 20);
    put(mixed, 21);
    put(live_pack, 30);
    put(fresh, 40);
    let marked: HashSet<ChunkId> = [20u8, 30].iter().map(|&n| ChunkId([n; 32])).collect();
    let sweep = plan_sweep(&idx, &marked);
    assert_eq!(sweep.dead_chunks, 3);
    assert_eq!(sweep.doomed.len(), 1);
    let mut doomed: Doomed = sweep.doomed[0].clone();
    doomed.chunks.sort();
    assert_eq!(
        doomed,
        Doomed {
            pack: PackId([1; 16]),
            size: 1001,
            chunks: vec![ChunkId([10; 32]), ChunkId([11; 32])]
        }
    );
    assert_eq!(sweep.repack.len(), 1);
    assert_eq!(sweep.repack[0].pack, PackId([2; 16]));
    assert_eq!(sweep.repack[0].live, vec![gc_entry(20, 100)]);
    sweep.unlink(&mut idx);
    let mut left: Vec<u8> = idx.chunks.keys().map(|id| id.0[0]).collect();
    left.sort();
    assert_eq!(left, vec![20, 30, 40], "the unmarked chunk of a pack not yet durable stays");
    assert!(idx.slot(dead_pack).is_none() && !idx.by_id.contains_key(&PackId([1; 16])));
    assert!(idx.slot(mixed).is_some(), "a repacked pack keeps its slot until its copy is durable");
}

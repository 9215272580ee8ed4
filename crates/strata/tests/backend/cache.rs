//! The SSD cache decorator against the store and real files: conformance, miss coalescing,
//! lazy fill, eviction, restart recovery with hash verification, write-through fill of packs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use strata::backend::cache::{CacheBackend, CacheOptions, Splitter};
use strata::backend::{conformance, local::LocalBackend, memory::MemoryBackend};
use strata::backend::{BResult, Backend, DynBackend, ObjectInfo};
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store};

/// Counts what reaches the backend, optionally slowly (a remote link).
#[derive(Debug)]
struct Counting {
    inner: MemoryBackend,
    range_reads: AtomicU64,
    range_bytes: AtomicU64,
    delay: Duration,
}

impl Counting {
    fn new(delay: Duration) -> Arc<Counting> {
        Arc::new(Counting {
            inner: MemoryBackend::new(),
            range_reads: AtomicU64::new(0),
            range_bytes: AtomicU64::new(0),
            delay,
        })
    }
    fn reads(&self) -> u64 {
        self.range_reads.load(Ordering::SeqCst)
    }
}

impl Backend for Counting {
    fn name(&self) -> String {
        "counting".into()
    }
    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        self.range_reads.fetch_add(1, Ordering::SeqCst);
        self.range_bytes.fetch_add(len, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        self.inner.get_range(key, offset, len)
    }
    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.inner.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        self.inner.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> BResult<()> {
        self.inner.delete(key)
    }
    fn sync(&self) -> BResult<()> {
        Ok(())
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Splits a pack into its frames, as the CLI wires it.
fn pack_frames() -> Splitter {
    Arc::new(|_key: &str, bytes: &[u8]| match strata::store::pack::parse_pack(bytes) {
        Ok((_, entries)) => {
            let mut v: Vec<(u64, u64)> =
                entries.iter().map(|e| (e.frame_off, e.frame_len as u64)).collect();
            v.sort_unstable();
            v.dedup();
            v
        }
        Err(_) => Vec::new(),
    })
}

#[test]
fn cache_over_memory_and_local_conforms() {
    let d = tempfile::tempdir().unwrap();
    let c = CacheBackend::open(
        Arc::new(MemoryBackend::new()),
        &d.path().join("c1"),
        CacheOptions::new(16 << 20),
    )
    .unwrap();
    conformance::run_all(&c);
    // The conformance keys are not packs: make every key cacheable to exercise the cache path.
    let all = CacheOptions { cacheable: |_| true, ..CacheOptions::new(16 << 20) };
    let c = CacheBackend::open(
        Arc::new(LocalBackend::open(d.path().join("be")).unwrap()),
        &d.path().join("c2"),
        all.clone(),
    )
    .unwrap();
    conformance::run_all(&c);
    assert!(c.counters().hits + c.counters().misses > 0, "the cache path must have been used");
    let c = CacheBackend::open(Arc::new(MemoryBackend::new()), &d.path().join("c3"), all).unwrap();
    conformance::run_concurrent(Arc::new(c));
}

#[test]
fn ten_concurrent_misses_cause_one_backend_read() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::from_millis(150));
    let data = pattern(1, 200_000);
    be.put("packs/aa/p1", &data).unwrap();
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(8 << 20)).unwrap();
    let barrier = std::sync::Barrier::new(10);
    let results: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..10)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    c.get_range("packs/aa/p1", 4096, 50_000).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(be.reads(), 1, "N concurrent misses of one range must cause one backend read");
    for r in &results {
        assert_eq!(r, &data[4096..54_096]);
    }
    let k = c.counters();
    assert_eq!((k.misses, k.coalesced), (1, 9), "{k:?}");
    // Different ranges are not coalesced with each other.
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let c = &c;
            s.spawn(move || c.get_range("packs/aa/p1", 100_000 + i * 1000, 1000).unwrap());
        }
    });
    assert_eq!(be.reads(), 5);
}

#[test]
fn a_miss_is_answered_before_the_fill_and_then_hits() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::ZERO);
    let data = pattern(2, 1 << 20);
    be.put("packs/bb/p", &data).unwrap();
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(8 << 20)).unwrap();
    for i in 0..64u64 {
        assert_eq!(
            c.get_range("packs/bb/p", i * 16384, 16384).unwrap(),
            &data[(i * 16384) as usize..((i + 1) * 16384) as usize]
        );
    }
    assert_eq!(be.reads(), 64);
    // Reads right after the misses are hits whether the fill is done or still staged.
    for i in 0..64u64 {
        c.get_range("packs/bb/p", i * 16384, 16384).unwrap();
    }
    assert_eq!(be.reads(), 64, "staged or filled ranges are never re-read from the backend");
    c.wait_idle();
    let k = c.counters();
    assert_eq!((k.hits, k.misses, k.fills, k.entries), (64, 64, 64, 64), "{k:?}");
    assert_eq!(k.data_bytes, 64 * 16384);
    assert_eq!(k.used_bytes, 64 * 16384, "16 KiB entries take 16 KiB blocks");
    // Non-pack objects and whole gets pass through.
    be.put("refs/x", b"ref").unwrap();
    assert_eq!(c.get_range("refs/x", 0, 3).unwrap(), b"ref");
    assert_eq!(c.get("packs/bb/p").unwrap().len(), data.len());
    assert_eq!(c.counters().bypass, 2);
}

#[test]
fn eviction_keeps_within_capacity_and_prefers_recent_entries() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::ZERO);
    let data = pattern(3, 8 << 20);
    be.put("packs/cc/p", &data).unwrap();
    let opts = CacheOptions::new(1 << 20); // 1 MiB region
    let c = CacheBackend::open(be.clone(), d.path(), opts).unwrap();
    let rd = |i: u64, len: u64| {
        let v = c.get_range("packs/cc/p", i * 40_000, len).unwrap();
        assert_eq!(v, &data[(i * 40_000) as usize..(i * 40_000 + len) as usize]);
    };
    // 40 entries of 20-30 KiB (32 KiB blocks): ~1.25 MiB of blocks for a 1 MiB cache.
    for i in 0..40 {
        rd(i, 20_000 + (i % 3) * 5000);
        c.wait_idle();
        rd(0, 20_000); // keep entry 0 hot
        c.wait_idle();
    }
    let k = c.counters();
    assert!(k.evictions > 0, "{k:?}");
    assert!(k.used_bytes <= k.capacity && k.capacity == 1 << 20, "{k:?}");
    let before = be.reads();
    rd(0, 20_000);
    assert_eq!(be.reads(), before, "the hot entry survived eviction");
    rd(1, 25_000);
    assert_eq!(be.reads(), before + 1, "the oldest cold entry was evicted");
    // Mixed sizes, including ones that need merged blocks, still fit after evictions.
    for i in 0..20u64 {
        rd(100 + i, 4096 << (i % 7));
        c.wait_idle();
    }
    let k = c.counters();
    assert!(k.used_bytes <= k.capacity, "{k:?}");
    assert_eq!(k.fill_dropped, 0);
}

#[test]
fn the_cache_survives_a_restart_and_verifies_entries() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::ZERO);
    let data = pattern(4, 2 << 20);
    be.put("packs/dd/p", &data).unwrap();
    let ranges: Vec<(u64, u64)> = (0..50u64).map(|i| (i * 40_000, 10_000 + i * 500)).collect();
    {
        let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(16 << 20)).unwrap();
        for &(o, l) in &ranges {
            c.get_range("packs/dd/p", o, l).unwrap();
        }
        c.wait_idle();
        assert_eq!(c.counters().entries, 50);
    }
    let reads = be.reads();
    {
        let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(16 << 20)).unwrap();
        assert_eq!(c.counters().recovered, 50);
        for &(o, l) in &ranges {
            assert_eq!(
                c.get_range("packs/dd/p", o, l).unwrap(),
                &data[o as usize..(o + l) as usize]
            );
        }
        assert_eq!(be.reads(), reads, "a restarted cache serves its entries");
        assert_eq!(c.verify_all(), (50, 0));
    }
    // Flip a byte inside one entry's block: the entry fails its hash and is re-read.
    let index = std::fs::read(d.path().join("cache.index")).unwrap();
    let (recs, _) = strata::backend::cache::format::parse_records(&index[64..]);
    let victim = recs
        .iter()
        .find_map(|r| match r {
            strata::backend::cache::format::Record::Insert { block, obj_off, len, .. }
                if *obj_off == ranges[7].0 =>
            {
                Some((*block, *len))
            }
            _ => None,
        })
        .unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(d.path().join("cache.data")).unwrap();
        f.write_all_at(&[0x5A ^ data[(ranges[7].0 + 100) as usize]], 4096 + victim.0 + 100)
            .unwrap();
    }
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(16 << 20)).unwrap();
    let (o, l) = ranges[7];
    assert_eq!(
        c.get_range("packs/dd/p", o, l).unwrap(),
        &data[o as usize..(o + l) as usize],
        "never wrong bytes"
    );
    assert_eq!(c.counters().verify_failed, 1);
    assert_eq!(be.reads(), reads + 1);
    c.wait_idle();
    assert_eq!(c.verify_all(), (50, 0), "the entry was refilled");
    drop(c);

    // A torn index tail costs entries, not the cache.
    let idx = std::fs::read(d.path().join("cache.index")).unwrap();
    std::fs::write(d.path().join("cache.index"), &idx[..idx.len() - 30]).unwrap();
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(16 << 20)).unwrap();
    assert_eq!(c.counters().recovered, 49);
    drop(c);

    // Another size: the cache starts empty, with a new file of the new size.
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(32 << 20)).unwrap();
    assert_eq!((c.counters().recovered, c.counters().capacity), (0, 32 << 20));
    assert_eq!(std::fs::metadata(d.path().join("cache.data")).unwrap().len(), 4096 + (32 << 20));
}

#[test]
fn write_through_fills_packs_and_the_store_reads_from_the_cache() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::ZERO);
    let opts = CacheOptions { splitter: Some(pack_frames()), ..CacheOptions::new(64 << 20) };
    let cache: Arc<CacheBackend> =
        Arc::new(CacheBackend::open(be.clone(), &d.path().join("cache"), opts.clone()).unwrap());
    let store = Store::init(
        cache.clone() as DynBackend,
        &d.path().join("meta.redb"),
        InitOptions { pack_size: 1 << 20, ..Default::default() },
    )
    .unwrap();
    let ses = store.session();
    let chunks: Vec<Vec<u8>> = (0..300).map(|i| pattern(100 + i, 16384)).collect();
    let ids: Vec<_> = chunks.iter().map(|c| ses.put(c, ChunkKind::Data).unwrap()).collect();
    let root = ses
        .put_tree(&strata::store::objects::Tree { children: ids.clone(), payload: vec![] })
        .unwrap();
    ses.commit_ref("disk/golden", strata::store::objects::Ref::new(vec![root], vec![])).unwrap();
    drop(ses);
    cache.wait_idle();
    let k = cache.counters();
    assert!(k.fills >= 300, "packs written through the cache fill it: {k:?}");
    // Reopen the store (new metadata, like a second host) over the same cache: no backend range reads.
    drop(store);
    let store = Store::open(cache.clone() as DynBackend, &d.path().join("meta2.redb")).unwrap();
    let before = be.reads();
    for (id, c) in ids.iter().zip(&chunks) {
        assert_eq!(&store.get(id).unwrap(), c);
    }
    assert_eq!(be.reads(), before, "every chunk came from the cache");
    let rep = store.check(CheckOptions::default(), &NoProgress).unwrap();
    assert_eq!(rep.errors(), 0, "check finds the store intact: {:?}", rep.problems);

    // GC deletes packs: their entries go too.
    drop(store);
    let store = Store::open(cache.clone() as DynBackend, &d.path().join("meta3.redb")).unwrap();
    store.delete_ref("disk/golden").unwrap();
    store.gc(&NoProgress).unwrap();
    let k = cache.counters();
    assert_eq!(k.entries, 0, "{k:?}");
    assert!(k.invalidations >= 300);
}

#[test]
fn concurrent_readers_under_eviction_never_see_wrong_bytes() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::from_micros(200));
    let data = pattern(5, 4 << 20);
    be.put("packs/ee/p", &data).unwrap();
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(512 << 10)).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let c = &c;
            let data = &data;
            s.spawn(move || {
                let mut x = t + 1;
                for _ in 0..400 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let i = (x >> 33) % 120;
                    let len = 3000 + (i % 5) * 9000;
                    let off = i * 30_000;
                    let v = c.get_range("packs/ee/p", off, len).unwrap();
                    assert_eq!(v, &data[off as usize..(off + len) as usize]);
                    // A part of the range: served from its entry without re-hashing it, while
                    // other threads evict and refill blocks.
                    let (po, pl) = (off + len / 3, len / 3);
                    let v = c.get_range("packs/ee/p", po, pl).unwrap();
                    assert_eq!(v, &data[po as usize..(po + pl) as usize]);
                }
            });
        }
    });
    c.wait_idle();
    let k = c.counters();
    assert!(
        k.evictions > 0 && k.hits > 0 && k.part_hits > 0 && k.used_bytes <= k.capacity,
        "{k:?}"
    );
    assert_eq!(c.verify_all().1, 0);
}

#[test]
fn one_process_per_cache_directory() {
    let d = tempfile::tempdir().unwrap();
    let a =
        CacheBackend::open(Arc::new(MemoryBackend::new()), d.path(), CacheOptions::new(1 << 20))
            .unwrap();
    let e =
        CacheBackend::open(Arc::new(MemoryBackend::new()), d.path(), CacheOptions::new(1 << 20))
            .unwrap_err();
    assert!(e.to_string().contains("in use by another strata process"), "{e}");
    drop(a);
    CacheBackend::open(Arc::new(MemoryBackend::new()), d.path(), CacheOptions::new(1 << 20))
        .unwrap();
}

#[test]
fn too_small_and_unwritable_caches_name_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let e = CacheBackend::open(Arc::new(MemoryBackend::new()), d.path(), CacheOptions::new(1000))
        .unwrap_err();
    assert!(e.to_string().contains("--cache-size"), "{e}");
    let file = d.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = CacheBackend::open(
        Arc::new(MemoryBackend::new()),
        &file.join("sub"),
        CacheOptions::new(1 << 20),
    )
    .unwrap_err();
    assert!(e.to_string().contains("writable"), "{e}");
}

/// Where `needle` (unique random bytes) sits in the cache's data file.
fn find_in_cache_file(dir: &std::path::Path, needle: &[u8]) -> u64 {
    let file = std::fs::read(dir.join("cache.data")).unwrap();
    file.windows(needle.len()).position(|w| w == needle).expect("the bytes are in the cache file")
        as u64
}

fn flip_byte(dir: &std::path::Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f =
        std::fs::OpenOptions::new().read(true).write(true).open(dir.join("cache.data")).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5A], at).unwrap();
}

#[test]
fn parts_of_entries_verified_here_skip_the_hash_and_recovered_entries_are_hashed_first() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::ZERO);
    let data = pattern(21, 256 << 10);
    be.put("packs/aa/p", &data).unwrap();
    let frame = (65536u64, 65536u64);
    let part = (frame.0 + 8192, 4096u64);
    let want = |o: u64, l: u64| data[o as usize..(o + l) as usize].to_vec();

    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(16 << 20)).unwrap();
    assert_eq!(c.get_range("packs/aa/p", frame.0, frame.1).unwrap(), want(frame.0, frame.1));
    c.wait_idle();
    assert_eq!(c.get_range("packs/aa/p", part.0, part.1).unwrap(), want(part.0, part.1));
    let k = c.counters();
    assert_eq!((k.hits, k.part_hits, k.verify_failed, be.reads()), (1, 1, 0, 1), "{k:?}");
    drop(c);

    // After a restart an entry is hashed whole before any part of it is served: damage
    // outside the part asked for is still caught, and the bytes come from the backend.
    let at = find_in_cache_file(d.path(), &data[frame.0 as usize..frame.0 as usize + 64]);
    flip_byte(d.path(), at + 100);
    let c = CacheBackend::open(be.clone(), d.path(), CacheOptions::new(16 << 20)).unwrap();
    assert_eq!(c.get_range("packs/aa/p", part.0, part.1).unwrap(), want(part.0, part.1));
    let k = c.counters();
    assert_eq!((k.part_hits, k.verify_failed, be.reads()), (0, 1, 2), "{k:?}");
    // The refetched part is staged and filled as its own entry; the next reads hit.
    c.wait_idle();
    assert_eq!(c.get_range("packs/aa/p", part.0 + 100, 1000).unwrap(), want(part.0 + 100, 1000));
    assert_eq!(c.get_range("packs/aa/p", part.0, part.1).unwrap(), want(part.0, part.1));
    let k = c.counters();
    assert_eq!((k.part_hits, k.verify_failed, be.reads()), (1, 1, 2), "{k:?}");
}

#[test]
fn a_piece_gone_bad_in_a_verified_entry_is_caught_by_the_store_and_refetched() {
    let d = tempfile::tempdir().unwrap();
    let be = Counting::new(Duration::ZERO);
    let opts = CacheOptions { splitter: Some(pack_frames()), ..CacheOptions::new(64 << 20) };
    let cdir = d.path().join("cache");
    let cache: Arc<CacheBackend> = Arc::new(CacheBackend::open(be.clone(), &cdir, opts).unwrap());
    let store = Store::init(
        cache.clone() as DynBackend,
        &d.path().join("meta.redb"),
        InitOptions { pack_size: 1 << 20, ..Default::default() },
    )
    .unwrap();
    let ses = store.session();
    let block = pattern(77, 65536); // incompressible: stored raw, read piece by piece
    let id = ses.put(&block, ChunkKind::Data).unwrap();
    let root = ses
        .put_tree(&strata::store::objects::Tree { children: vec![id], payload: vec![] })
        .unwrap();
    ses.commit_ref("disk/d", strata::store::objects::Ref::new(vec![root], vec![])).unwrap();
    drop(ses);
    drop(store);
    cache.wait_idle();
    // A second store over the same cache reads from the backend (through the cache), not memory.
    let store = Store::open(cache.clone() as DynBackend, &d.path().join("meta2.redb")).unwrap();
    let mut buf = vec![0u8; 4096];
    store.read_range(&id, 0, &mut buf).unwrap(); // whole frame: verified, piece CVs kept
    assert_eq!(buf, &block[..4096]);
    store.read_range(&id, 8192, &mut buf).unwrap();
    assert_eq!(buf, &block[8192..12288]);
    let k = cache.counters();
    assert!(
        k.part_hits >= 1 && k.verify_failed == 0,
        "the piece came from the verified entry: {k:?}"
    );
    let reads = be.reads();

    // The SSD flips a bit inside that piece. The cache serves the part unhashed; the store
    // finds the piece does not match its CV, reads the whole frame, the cache's hash check
    // drops the entry, and the backend's bytes are returned.
    let at = find_in_cache_file(&cdir, &block[8192..8192 + 64]);
    flip_byte(&cdir, at + 300);
    store.read_range(&id, 8192, &mut buf).unwrap();
    assert_eq!(buf, &block[8192..12288], "never wrong bytes");
    let k = cache.counters();
    assert_eq!(k.verify_failed, 1, "{k:?}");
    assert_eq!(be.reads(), reads + 1, "one backend read replaced the bad entry");
}

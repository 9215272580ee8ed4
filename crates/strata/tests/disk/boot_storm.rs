//! Boot traces, working sets and `disk warm`, on a real S3 server (versitygw on loopback) with
//! three store instances ("hosts") sharing one bucket:
//! - host A imports a golden image;
//! - host B serves a clone of it through the trace recorder, a client reads a boot-like
//!   pattern over NBD, and the trace becomes the golden image's working set in the bucket;
//! - host C (own metadata, cold cache) warms its cache with that working set, after which the
//!   same boot reads from fresh clones cost zero backend bytes; without warming they do not.
//!
//! The replayer runs the recorded trace with several clients and must return identical bytes.

use std::path::Path;
use std::sync::Arc;
use strata::backend::cache::{CacheBackend, CacheOptions};
use strata::backend::s3::S3Backend;
use strata::backend::servers::S3Server;
use strata::backend::DynBackend;
use strata::boot::trace::Op;
use strata::boot::{replay, workset, Recorder, TracingExports};
use strata::nbd::client::{Client, Target};
use strata::nbd::Server;
use strata::progress::NoProgress;
use strata::serve::DiskExports;
use strata::store::{InitOptions, Store};
use strata::{disk, Codec};

const MIB: u64 = 1 << 20;

/// A 24 MiB image: compressible data with holes, like a small root filesystem.
fn image(path: &Path) -> Vec<u8> {
    let mut data = vec![0u8; 24 * MIB as usize];
    let mut x: u64 = 0x243F6A8885A308D3;
    for (i, blk) in data.chunks_mut(64 << 10).enumerate() {
        if i % 5 == 3 {
            continue; // a hole
        }
        for b in blk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x % 11) as u8;
        }
    }
    std::fs::write(path, &data).unwrap();
    data
}

/// A boot-like read pattern: scattered, some reads crossing 64 KiB block boundaries.
fn boot_reads() -> Vec<(u64, u32)> {
    let mut v =
        vec![(0u64, 4096u32), (1024, 65536), (3 * MIB, 128 << 10), (5 * MIB + 60_000, 20_000)];
    for i in 0..40u64 {
        v.push(((i * 7919 * 4096) % (22 * MIB), 32 << 10));
    }
    v.push((23 * MIB, 512 << 10));
    v
}

struct Host {
    store: Store,
    cache: Option<Arc<CacheBackend>>,
}

fn host(s: &S3Server, dir: &Path, cached: bool, init: bool) -> Host {
    let s3: DynBackend = Arc::new(S3Backend::open(s.config("s3://boot/store").unwrap()).unwrap());
    let cache = cached.then(|| {
        Arc::new(
            CacheBackend::open(s3.clone(), &dir.join("cache"), CacheOptions::new(64 * MIB))
                .unwrap(),
        )
    });
    let backend: DynBackend = match &cache {
        Some(c) => c.clone(),
        None => s3,
    };
    let meta = strata::store::local_meta_path(dir);
    let store = if init {
        Store::init(backend, &meta, InitOptions { pack_size: 4 * MIB, default_codec: Codec::Lz4 })
            .unwrap()
    } else {
        Store::open(backend, &meta).unwrap()
    };
    Host { store, cache }
}

fn serve(
    store: &Store,
    sock: &Path,
    rec: Option<Arc<Recorder>>,
) -> (strata::nbd::ServerHandle, Arc<DiskExports>) {
    let exports = DiskExports::new(store.clone());
    let set: Arc<dyn strata::nbd::ExportSet> = match rec {
        Some(r) => TracingExports::new(exports.clone(), r),
        None => exports.clone(),
    };
    (Server::bind_unix(sock).unwrap().serve(set).unwrap(), exports)
}

fn read_all(sock: &Path, export: &str, reads: &[(u64, u32)], img: &[u8]) {
    let mut c = Client::connect(&Target::Unix(sock.to_path_buf()), export).unwrap();
    assert_eq!(c.size(), img.len() as u64);
    let mut buf = Vec::new();
    for &(off, len) in reads {
        buf.resize(len as usize, 0);
        c.read(off, &mut buf).unwrap();
        assert!(buf == img[off as usize..off as usize + len as usize], "wrong bytes at {off}");
    }
    c.disconnect().unwrap();
}

#[test]
fn a_recorded_boot_warms_another_hosts_cache_so_the_boot_costs_no_backend_bytes() {
    let d = tempfile::tempdir().unwrap();
    let s = S3Server::start(&d.path().join("s3root")).unwrap_or_else(|e| panic!("{e}"));
    s.create_bucket("boot").unwrap();
    let img_path = d.path().join("golden.raw");
    let img = image(&img_path);

    // Host A imports the golden image.
    {
        let a = host(&s, &d.path().join("a"), false, true);
        disk::import(&a.store, "golden", &img_path, Codec::Lz4, &NoProgress).unwrap();
        disk::snapshot(&a.store, "golden", "base").unwrap();
        a.store.close().unwrap();
    }

    // Host B records a boot of a clone.
    let reads = boot_reads();
    let trace = {
        let b = host(&s, &d.path().join("b"), true, false);
        disk::clone(&b.store, "golden@base", "rec", false).unwrap();
        let rec = Recorder::new(&["rec"]);
        let sock = d.path().join("b.sock");
        let (h, ex) = serve(&b.store, &sock, Some(rec.clone()));
        read_all(&sock, "rec", &reads, &img);
        rec.stop();
        h.shutdown();
        ex.close_all().unwrap();
        let t = rec.trace();
        let got: Vec<(u64, u64)> = t.reads();
        let want: Vec<(u64, u64)> = reads.iter().map(|&(o, l)| (o, l as u64)).collect();
        assert_eq!(got, want, "the trace holds the client's reads, in order");
        assert!(t.records.iter().all(|r| r.op == Op::Read && r.inflight == 1));
        // The CSV form round-trips.
        assert_eq!(strata::boot::Trace::parse_csv(&t.to_csv()).unwrap(), t);
        let ws = workset::from_trace(&b.store, "golden@base", &t).unwrap();
        // Distinct non-hole 64 KiB blocks the reads touch.
        let mut blocks = std::collections::BTreeSet::new();
        for &(o, l) in &reads {
            for blk in o / 65536..=(o + l as u64 - 1) / 65536 {
                if blk % 5 != 3 {
                    blocks.insert(blk);
                }
            }
        }
        // The block map (root + one leaf for 384 blocks), then one chunk per touched data block.
        assert_eq!(ws.chunks.len(), 2 + blocks.len());
        assert_eq!(ws.chunks[0], ws.root);
        workset::save(&b.store, "golden@base", &ws).unwrap();
        disk::remove(&b.store, "rec").unwrap();
        t
    };
    assert!(
        s.root.join("boot/store/bootsets/golden@base").is_file(),
        "working set is in the bucket"
    );

    // Host C: own metadata, cold cache. Without warming, the boot reads hit S3.
    let c = host(&s, &d.path().join("c"), true, false);
    let cache = c.cache.clone().unwrap();
    for n in ["d1", "d2", "d3"] {
        disk::clone(&c.store, "golden@base", n, false).unwrap();
    }
    let sock = d.path().join("c.sock");
    let (h, ex) = serve(&c.store, &sock, None);
    let before = cache.counters().bytes_from_backend();
    read_all(&sock, "d1", &reads, &img);
    let cold = cache.counters().bytes_from_backend() - before;
    assert!(cold > 0, "a cold cache must fetch the boot from S3");

    // Warm (found through d2's parent), then the same boot from d2 costs nothing.
    cache.clear();
    let rep = workset::warm(&c.store, "d2", 4).unwrap();
    assert_eq!(rep.working_set_of, "golden@base");
    assert_eq!(rep.missing, 0);
    assert!(rep.backend_bytes > 0 && rep.backend_bytes == rep.bytes, "{rep:?}");
    // Opening the clone reads its ref (a mutable object, never cached: a few hundred bytes)
    // and its block map (in the working set: cached).
    let before = cache.counters();
    let mut cl = Client::connect(&Target::Unix(sock.clone()), "d2").unwrap();
    let opened = cache.counters();
    assert_eq!(opened.miss_bytes, before.miss_bytes, "opening the clone fetched pack data");
    assert!(opened.bypass_bytes - before.bypass_bytes < 4096, "more than the clone's ref");
    let mut buf = Vec::new();
    for &(off, len) in &reads {
        buf.resize(len as usize, 0);
        cl.read(off, &mut buf).unwrap();
        assert!(buf == img[off as usize..off as usize + len as usize], "wrong bytes at {off}");
    }
    cl.disconnect().unwrap();
    let after = cache.counters();
    assert_eq!(
        after.bytes_from_backend(),
        opened.bytes_from_backend(),
        "after warm, the boot fetched from S3"
    );
    assert!(after.hits > opened.hits);
    // A second warm finds everything cached.
    assert_eq!(workset::warm(&c.store, "golden@base", 4).unwrap().backend_bytes, 0);

    // Replay the recorded trace with three clients: same bytes for all, all from the cache.
    let before = cache.counters();
    let clients: Vec<(Target, String)> =
        ["d1", "d2", "d3"].iter().map(|n| (Target::Unix(sock.clone()), n.to_string())).collect();
    let runs = replay::replay(&clients, &trace.reads(), 4).unwrap();
    let want_bytes: u64 = reads.iter().map(|r| r.1 as u64).sum();
    assert_eq!(runs.len(), 3);
    for r in &runs {
        assert_eq!(
            (r.bytes, r.requests, r.digest),
            (want_bytes, reads.len() as u64, runs[0].digest),
            "{r:?}"
        );
    }
    let after = cache.counters();
    assert_eq!(after.miss_bytes, before.miss_bytes, "replay fetched pack data from S3");
    assert!(after.bypass_bytes - before.bypass_bytes < 3 * 4096, "more than the clones' refs");
    h.shutdown();
    ex.close_all().unwrap();

    // No working set: a clear error naming the fix.
    let e = workset::warm(&c.store, "golden", 2).unwrap_err().to_string();
    assert!(e.contains("strata disk record-boot golden"), "{e}");
}

#[test]
fn the_nbd_client_reports_refusals_and_server_errors() {
    let d = tempfile::tempdir().unwrap();
    let store = Store::init_local(&d.path().join("s"), InitOptions::default()).unwrap();
    disk::create(&store, "small", 1 << 20).unwrap();
    let sock = d.path().join("s.sock");
    let (h, ex) = serve(&store, &sock, None);
    let t = Target::Unix(sock.clone());
    let e = Client::connect(&t, "nope").unwrap_err().to_string();
    assert!(e.contains("refused export 'nope'"), "{e}");
    let mut c = Client::connect(&t, "small").unwrap();
    let mut buf = vec![0u8; 8192];
    c.read(4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // Past the end: the server answers EINVAL, the client says which read failed.
    let e = c.read((1 << 20) - 4096, &mut buf).unwrap_err().to_string();
    assert!(e.contains("offset 1044480"), "{e}");
    drop(c);
    h.shutdown();
    ex.close_all().unwrap();
    let e = Client::connect(&t, "small").unwrap_err().to_string();
    assert!(e.contains("Cannot connect"), "{e}");
}

/// A trace of `reads` as the recorder would write it.
fn trace_of(reads: &[(u64, u32)]) -> strata::boot::Trace {
    let records = reads
        .iter()
        .enumerate()
        .map(|(i, &(offset, len))| strata::boot::trace::Record {
            t_us: i as u64 * 100,
            dur_us: 50,
            op: Op::Read,
            offset,
            len: len as u64,
            inflight: 1,
        })
        .collect();
    strata::boot::Trace { records }
}

#[test]
fn serving_a_clone_prefetches_its_images_working_set_once_and_only_with_a_cache() {
    let d = tempfile::tempdir().unwrap();
    let s = S3Server::start(&d.path().join("s3root")).unwrap_or_else(|e| panic!("{e}"));
    s.create_bucket("boot").unwrap();
    let img_path = d.path().join("golden.raw");
    let img = image(&img_path);
    let reads = boot_reads();

    // Host A imports the golden image (with a recorded working set) and a second image without one.
    {
        let a = host(&s, &d.path().join("a"), false, true);
        for name in ["golden", "plain"] {
            disk::import(&a.store, name, &img_path, Codec::Lz4, &NoProgress).unwrap();
            disk::snapshot(&a.store, name, "base").unwrap();
        }
        let ws = workset::from_trace(&a.store, "golden@base", &trace_of(&reads)).unwrap();
        workset::save(&a.store, "golden@base", &ws).unwrap();
        a.store.close().unwrap();
    }

    // Baseline on host B (cold cache, prefetch off): how many misses the boot of one clone causes.
    let b = host(&s, &d.path().join("b"), true, false);
    let bcache = b.cache.clone().unwrap();
    disk::clone(&b.store, "golden@base", "b1", false).unwrap();
    let sock = d.path().join("b.sock");
    let (h, ex) = serve(&b.store, &sock, None);
    let before = bcache.counters();
    read_all(&sock, "b1", &reads, &img);
    let cold_misses = bcache.counters().misses - before.misses;
    assert!(ex.prefetches().is_empty(), "prefetch started without being enabled");
    h.shutdown();
    ex.close_all().unwrap();
    assert!(cold_misses >= 40, "the boot should miss on most of its blocks: {cold_misses}");

    // Host C (cold cache, prefetch on): opening clones of golden@base starts one prefetch.
    let c = host(&s, &d.path().join("c"), true, false);
    let cache = c.cache.clone().unwrap();
    for n in ["c1", "c2", "p1"] {
        let base = if n == "p1" { "plain@base" } else { "golden@base" };
        disk::clone(&c.store, base, n, false).unwrap();
    }
    let sock = d.path().join("c.sock");
    let (h, ex) = serve(&c.store, &sock, None);
    assert!(ex.enable_prefetch(4));
    // A clone of an image without a working set starts none.
    read_all(&sock, "p1", &reads[..3], &img);
    ex.wait_prefetch_lookups();
    assert!(ex.prefetches().is_empty(), "{:?}", ex.prefetches());
    let cl = Client::connect(&Target::Unix(sock.clone()), "c1").unwrap();
    let cl2 = Client::connect(&Target::Unix(sock.clone()), "c2").unwrap();
    ex.wait_prefetch_lookups();
    let st = ex.prefetches();
    assert_eq!(st.len(), 1, "one prefetch per image, however many clones: {st:?}");
    assert_eq!(st[0].image, "golden@base");
    let p = ex.prefetch_of("golden@base").unwrap();
    p.wait();
    let st = p.status();
    assert_eq!(
        (st.state, st.ranges_done, st.ranges_failed, st.missing),
        ("done", st.ranges, 0, 0),
        "{st:?}"
    );
    assert!(
        st.ranges as usize >= cold_misses as usize && st.bytes_done == st.bytes && st.bytes > 0,
        "{st:?}"
    );
    cache.wait_idle();
    cl.disconnect().unwrap();
    cl2.disconnect().unwrap();

    // The boot from a clone after the prefetch: right bytes, (almost) no misses.
    let before = cache.counters();
    read_all(&sock, "c1", &reads, &img);
    let warm = cache.counters();
    let misses = warm.misses - before.misses;
    assert!(misses * 10 <= cold_misses, "after the prefetch {misses} misses, cold {cold_misses}");
    assert_eq!(warm.miss_bytes, before.miss_bytes, "the prefetched boot fetched pack data");
    assert!(warm.hits - before.hits >= cold_misses);

    // A replay racing a fresh prefetch (cache cleared, new server) returns the right bytes.
    h.shutdown();
    ex.close_all().unwrap();
    assert_eq!(ex.prefetches()[0].state, "done");
    cache.clear();
    let sock2 = d.path().join("c2.sock");
    let (h, ex) = serve(&c.store, &sock2, None);
    assert!(ex.enable_prefetch(8));
    let before = cache.counters();
    let clients: Vec<(Target, String)> =
        ["c1", "c2"].iter().map(|n| (Target::Unix(sock2.clone()), n.to_string())).collect();
    let runs = replay::replay(&clients, &trace_of(&reads).reads(), 4).unwrap();
    let want_bytes: u64 = reads.iter().map(|r| r.1 as u64).sum();
    assert!(runs.iter().all(|r| r.bytes == want_bytes && r.digest == runs[0].digest), "{runs:?}");
    read_all(&sock2, "c2", &reads, &img);
    ex.wait_prefetch_lookups();
    ex.prefetch_of("golden@base").unwrap().wait();
    let after = cache.counters();
    // Prefetch and demand reads together fetched about one copy of the working set: demand
    // reads of a frame the prefetch is fetching wait for it. (Not exactly one: a demand read
    // that starts before the prefetch reaches its frame, for a range of a different shape
    // than the whole frame, is its own miss.)
    let fetched = after.miss_bytes - before.miss_bytes;
    assert!(
        fetched >= st.bytes && fetched <= st.bytes * 5 / 4,
        "{fetched} bytes fetched for a working set of {}: {before:?} {after:?}",
        st.bytes
    );
    h.shutdown();
    ex.close_all().unwrap();
}

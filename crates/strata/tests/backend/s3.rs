//! The S3 backend against a real S3 server: versitygw v1.8.0 (posix backend) on loopback,
//! started and killed by each test. Needs `versitygw` (scripts/setup.sh installs it).

use crate::common;
use common::CrashRun;
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata::backend::cache::{CacheBackend, CacheOptions};
use strata::backend::retry::{RetryBackend, RetryPolicy};
use strata::backend::s3::{S3Backend, S3Error, S3_PACK_SIZE};
use strata::backend::servers::{free_port, S3Server};
use strata::backend::{conformance, Backend, DynBackend, ErrorKind};
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::objects::{Ref, Tree};
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store, StoreError};

fn server(dir: &std::path::Path) -> S3Server {
    let s = S3Server::start(&dir.join("s3root")).unwrap_or_else(|e| panic!("{e}"));
    s.create_bucket("strata-test").unwrap();
    s
}

use strata::error_chain as chain;

fn chunk(i: u64, len: usize) -> Vec<u8> {
    common::chunk(i, len, 7) // compressible, like real disk data
}

#[test]
fn s3_backend_conforms_on_versitygw() {
    let d = tempfile::tempdir().unwrap();
    let s = server(d.path());
    let be = S3Backend::open(s.config("s3://strata-test").unwrap()).unwrap();
    assert_eq!(be.name(), "s3://strata-test");
    let caps = be.capabilities();
    assert!(caps.native_range && caps.persistent && caps.preferred_pack_size == S3_PACK_SIZE);
    conformance::run_all(&be);
    // Under a prefix, and concurrently (conditional puts race on the server).
    let be = S3Backend::open(s.config("s3://strata-test/hosts/a").unwrap()).unwrap();
    conformance::run_all(&be);
    conformance::run_concurrent(Arc::new(
        S3Backend::open(s.config("s3://strata-test/race").unwrap()).unwrap(),
    ));
    // The prefix really is a prefix in the bucket.
    assert!(s.root.join("strata-test/hosts/a/conf/a").is_file());
}

#[test]
fn a_store_round_trips_on_s3_and_a_second_host_sees_it() {
    let d = tempfile::tempdir().unwrap();
    let s = server(d.path());
    let open = || -> DynBackend {
        Arc::new(S3Backend::open(s.config("s3://strata-test/store").unwrap()).unwrap())
    };
    let chunks: Vec<Vec<u8>> = (0..200).map(|i| chunk(i, 32768)).collect();
    let ids = {
        let store = Store::init(
            open(),
            &d.path().join("a/meta.redb"),
            InitOptions { pack_size: 1 << 20, ..Default::default() },
        )
        .unwrap();
        let ses = store.session();
        let ids: Vec<_> = chunks.iter().map(|c| ses.put(c, ChunkKind::Data).unwrap()).collect();
        let root =
            ses.put_tree(&Tree { children: ids.clone(), payload: b"golden".to_vec() }).unwrap();
        ses.commit_ref("disk/golden", Ref::new(vec![root], b"{}".to_vec())).unwrap();
        ids
    };
    // Host B: its own (empty) metadata, same bucket.
    let store = Store::open(open(), &d.path().join("b/meta.redb")).unwrap();
    assert!(store.get_ref("disk/golden").unwrap().is_some());
    for (id, c) in ids.iter().zip(&chunks) {
        assert_eq!(&store.get(id).unwrap(), c);
    }
    let rep = store.check(CheckOptions::default(), &NoProgress).unwrap();
    assert_eq!(rep.errors(), 0, "{:?}", rep.problems);
    assert!(rep.packs >= 3, "several packs were written: {}", rep.packs);
    // A second init on the same prefix is refused.
    let e = Store::init(open(), &d.path().join("c/meta.redb"), InitOptions::default())
        .err()
        .expect("second init refused");
    assert!(matches!(e, StoreError::AlreadyExists { .. }), "{e}");
}

#[test]
fn wrong_credentials_missing_bucket_and_dead_server_name_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let s = server(d.path());
    let mut cfg = s.config("s3://strata-test").unwrap();
    cfg.secret_access_key = "wrong-secret".into();
    let e = S3Backend::open(cfg).unwrap_err();
    assert!(matches!(e, S3Error::BadCredentials { .. }), "{}", chain(&e));
    assert!(e.to_string().contains("AWS_SECRET_ACCESS_KEY"), "{e}");

    let mut cfg = s.config("s3://strata-test").unwrap();
    cfg.access_key_id = "nobody".into();
    let e = S3Backend::open(cfg).unwrap_err();
    assert!(matches!(e, S3Error::BadCredentials { .. }), "{}", chain(&e));

    let e = S3Backend::open(s.config("s3://no-such-bucket").unwrap()).unwrap_err();
    assert!(matches!(e, S3Error::NoSuchBucket { .. }), "{e}");
    assert!(e.to_string().contains("aws s3 mb s3://no-such-bucket"), "{e}");

    let mut cfg = s.config("s3://strata-test").unwrap();
    cfg.endpoint = Some(format!("http://127.0.0.1:{}", free_port(false)));
    let t = Instant::now();
    let e = S3Backend::open(cfg).unwrap_err();
    assert!(matches!(e, S3Error::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("AWS_ENDPOINT_URL"), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a dead endpoint must fail fast: {:?}",
        t.elapsed()
    );

    let be = S3Backend::open(s.config("s3://strata-test").unwrap()).unwrap();
    be.put("k", b"v").unwrap();
    assert_eq!(be.get("k").unwrap(), b"v");

    // Missing bucket after open (deleted under us): an error naming the bucket, not "not found".
    std::fs::remove_dir_all(s.root.join("strata-test")).unwrap();
    let e = be.get("k").unwrap_err();
    assert_ne!(e.kind, ErrorKind::NotFound, "{e}");
    let msg = format!(
        "{e}: {}",
        std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default()
    );
    assert!(msg.contains("Bucket 'strata-test' does not exist"), "{msg}");
}

#[test]
fn callable_from_inside_an_async_runtime() {
    let d = tempfile::tempdir().unwrap();
    let s = server(d.path());
    let cfg = s.config("s3://strata-test").unwrap();
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.block_on(async move {
        // A blocking backend call from an async task must not panic ("runtime within runtime").
        let be = S3Backend::open(cfg).unwrap();
        be.put("in-runtime", b"ok").unwrap();
        assert_eq!(be.get_range("in-runtime", 1, 1).unwrap(), b"k");
        drop(be); // dropping inside a runtime must not panic either
    });
}

/// Kill -9 the server while a store is writing: the write fails with an error that says the
/// backend is unavailable, no ref appears for the interrupted commit, and after a restart
/// every commit acknowledged before the kill is intact.
#[test]
fn killing_the_server_mid_write_loses_nothing_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let s = Arc::new(std::sync::Mutex::new(server(d.path())));
    let url = "s3://strata-test/crash";
    let be: DynBackend = Arc::new(S3Backend::open(s.lock().unwrap().config(url).unwrap()).unwrap());
    let store = Store::init(
        be,
        &d.path().join("a.redb"),
        InitOptions { pack_size: 256 << 10, ..Default::default() },
    )
    .unwrap();
    let run = CrashRun { chunks: 40, chunk_len: 16384, alphabet: 7, jitter_ms: 40 };
    let killer = s.clone();
    common::kill_mid_write(
        store,
        &run,
        move || killer.lock().unwrap().kill(),
        || {
            let mut s = s.lock().unwrap();
            s.restart().unwrap();
            let be: DynBackend = Arc::new(S3Backend::open(s.config(url).unwrap()).unwrap());
            Store::open(be, &d.path().join("b.redb")).unwrap()
        },
    );
}

/// With the retry decorator, a server that dies and comes back within the retry budget is
/// invisible to the store: the commit in flight succeeds.
#[test]
fn retry_rides_out_a_server_restart() {
    let d = tempfile::tempdir().unwrap();
    let mut s = server(d.path());
    let url = "s3://strata-test/retry";
    let retry = Arc::new(RetryBackend::new(
        Arc::new(S3Backend::open(s.config(url).unwrap()).unwrap()),
        RetryPolicy {
            max_attempts: 40,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_millis(500),
            max_elapsed: Duration::from_secs(30),
        },
    ));
    let store = Store::init(
        retry.clone(),
        &d.path().join("m.redb"),
        InitOptions { pack_size: 256 << 10, ..Default::default() },
    )
    .unwrap();
    s.kill();
    let restarter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        s.restart().unwrap();
        s
    });
    let ses = store.session();
    let ids: Vec<_> =
        (0..64).map(|i| ses.put(&chunk(i, 16384), ChunkKind::Data).unwrap()).collect();
    let root = ses.put_tree(&Tree { children: ids.clone(), payload: vec![] }).unwrap();
    ses.commit_ref("survivor", Ref::new(vec![root], vec![])).unwrap();
    let _s = restarter.join().unwrap();
    let c = retry.counters();
    assert!(c.retries > 0 && c.recovered > 0 && c.gave_up == 0, "{c:?}");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(store.get(id).unwrap(), chunk(i as u64, 16384));
    }
}

/// The full remote stack a host runs: store -> cache -> retry -> S3. Host A imports, host B
/// (own metadata, cold cache) reads twice: the second pass costs no backend reads.
#[test]
fn cache_in_front_of_s3_serves_rereads_locally() {
    let d = tempfile::tempdir().unwrap();
    let s = server(d.path());
    let url = "s3://strata-test/cached";
    let chunks: Vec<Vec<u8>> = (0..150).map(|i| chunk(1000 + i, 65536)).collect();
    let ids = {
        let be: DynBackend = Arc::new(S3Backend::open(s.config(url).unwrap()).unwrap());
        let store = Store::init(
            be,
            &d.path().join("a.redb"),
            InitOptions { pack_size: 2 << 20, ..Default::default() },
        )
        .unwrap();
        let ses = store.session();
        let ids: Vec<_> = chunks.iter().map(|c| ses.put(c, ChunkKind::Data).unwrap()).collect();
        let root = ses.put_tree(&Tree { children: ids.clone(), payload: vec![] }).unwrap();
        ses.commit_ref("disk/golden", Ref::new(vec![root], vec![])).unwrap();
        ids
    };
    let s3: DynBackend = Arc::new(S3Backend::open(s.config(url).unwrap()).unwrap());
    let retry: DynBackend = Arc::new(RetryBackend::new(s3, RetryPolicy::default()));
    let cache = Arc::new(
        CacheBackend::open(retry, &d.path().join("cache-b"), CacheOptions::new(64 << 20)).unwrap(),
    );
    let store = Store::open(cache.clone(), &d.path().join("b.redb")).unwrap();
    for (id, c) in ids.iter().zip(&chunks) {
        assert_eq!(&store.get(id).unwrap(), c);
    }
    cache.wait_idle();
    let cold = cache.counters();
    assert_eq!(cold.misses, 150, "each frame fetched once: {cold:?}");
    for (id, c) in ids.iter().zip(&chunks) {
        assert_eq!(&store.get(id).unwrap(), c);
    }
    let warm = cache.counters();
    assert_eq!(warm.miss_bytes, cold.miss_bytes, "rereads cost no bytes from S3");
    assert_eq!(warm.hits - cold.hits, 150);
}

/// scripts/storage-host.sh: versitygw in a network namespace behind a veth shaped to 1 Gbit/s
/// in both directions. Raw TCP through the link, and S3 GETs/PUTs of packs through it, must run
/// at about 114 MB/s and never above the 125 MB/s a gigabit carries.
#[test]
fn the_storage_host_link_is_one_gigabit() {
    let root = std::env::var_os("STRATA_REPO_ROOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let script = root.join("scripts/storage-host.sh");
    let d = tempfile::tempdir().unwrap();
    let ns = format!("strata-t{}", std::process::id());
    let net = format!("10.{}.{}", 200 + std::process::id() % 50, std::process::id() % 250);
    let run = |arg: &str, extra: Option<&str>| {
        let mut c = std::process::Command::new("bash");
        c.arg(&script)
            .arg(arg)
            .env("STRATA_NS", &ns)
            .env("STRATA_NET", &net)
            .env("STRATA_DIR", d.path());
        if let Some(x) = extra {
            c.arg(x);
        }
        let out = c.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "storage-host.sh {arg} failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    struct Down<'a>(&'a dyn Fn());
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let env_text = run("up", None);
    let _down = Down(&|| {
        let _ = std::process::Command::new("bash")
            .arg(&script)
            .arg("down")
            .env("STRATA_NS", &ns)
            .env("STRATA_NET", &net)
            .env("STRATA_DIR", d.path())
            .output();
    });
    let rates: Vec<f64> = run("measure", Some("256"))
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    eprintln!("raw TCP through the link (host->storage, storage->host): {rates:?} MB/s");
    assert_eq!(rates.len(), 2);
    for r in &rates {
        assert!(*r < 126.0, "the link must be limited to 1 Gbit/s: {r} MB/s");
        assert!(*r > 90.0, "the link is far slower than 1 Gbit/s: {r} MB/s");
    }
    let env: Vec<(String, String)> = env_text
        .lines()
        .filter_map(|l| {
            l.strip_prefix("export ")?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let cfg =
        strata::backend::s3::S3Config::from_url_with(&get("STRATA_S3_URL").unwrap(), get).unwrap();
    let be = S3Backend::open(cfg).unwrap();
    let pack = chunk(7, 64 << 20);
    let t = Instant::now();
    for i in 0..2 {
        be.put(&format!("packs/00/{i}"), &pack).unwrap();
    }
    let up = (128 << 20) as f64 / t.elapsed().as_secs_f64() / 1e6;
    let t = Instant::now();
    for i in 0..2 {
        assert_eq!(be.get(&format!("packs/00/{i}")).unwrap().len(), pack.len());
    }
    let down = (128 << 20) as f64 / t.elapsed().as_secs_f64() / 1e6;
    eprintln!("S3 through the link: PUT {up:.1} MB/s, GET {down:.1} MB/s");
    assert!(up < 126.0 && down < 126.0, "S3 traffic must go through the shaped link");
    // versitygw's CPU shares the host's 2 cores: on a loaded machine GETs fell to ~48 MB/s.
    assert!(down > 30.0, "S3 GETs are far below the link rate: {down:.1} MB/s");
}

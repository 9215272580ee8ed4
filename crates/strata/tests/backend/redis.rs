//! The Redis backend against Debian's redis-server, single node and a 3-master cluster, each
//! started on free loopback ports and killed by the test.

use crate::common;
use common::CrashRun;
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata::backend::redis::{Durability, RedisBackend, RedisConfig, RedisError, REDIS_PACK_SIZE};
use strata::backend::servers::{free_port, raw_command, RedisCluster, RedisServer};
use strata::backend::{conformance, Backend, DynBackend, ErrorKind};
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::objects::{Ref, Tree};
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store};

fn open(url: &str) -> RedisBackend {
    RedisBackend::open(RedisConfig::from_url(url).unwrap()).unwrap_or_else(|e| panic!("{e}"))
}

fn chunk(i: u64, len: usize) -> Vec<u8> {
    common::chunk(i, len, 5)
}

#[test]
fn redis_single_node_conforms() {
    let d = tempfile::tempdir().unwrap();
    let r = RedisServer::start(d.path(), true).unwrap();
    let be = open(&r.url());
    assert!(!be.is_cluster());
    let caps = be.capabilities();
    assert!(caps.native_range && caps.persistent && caps.preferred_pack_size == REDIS_PACK_SIZE);
    conformance::run_all(&be);
    conformance::run_concurrent(Arc::new(open(&format!("{}?prefix=race", r.url()))));
    // Prefixes separate stores sharing a server.
    let a = open(&format!("{}?prefix=a", r.url()));
    let b = open(&format!("{}?prefix=b", r.url()));
    a.put("x/1", b"a").unwrap();
    assert!(b.list("x/").unwrap().is_empty());
    assert_eq!(a.list("x/").unwrap().len(), 1);
}

#[test]
fn redis_cluster_conforms_and_spreads_keys_over_masters() {
    let d = tempfile::tempdir().unwrap();
    let c = RedisCluster::start(d.path(), 3, true).unwrap();
    let be = open(&c.url());
    assert!(be.is_cluster());
    conformance::run_all(&be);
    conformance::run_concurrent(Arc::new(open(&c.url())));
    for i in 0..60 {
        be.put(&format!("packs/{i:02x}/obj"), &[i as u8; 100]).unwrap();
    }
    assert_eq!(be.list("packs/").unwrap().len(), 60, "SCAN must cover every master");
    let per_node: Vec<u64> = c
        .nodes
        .iter()
        .map(|n| {
            let r = raw_command(&n.addr(), &["DBSIZE"]).unwrap();
            r.trim().trim_start_matches(':').parse().unwrap()
        })
        .collect();
    assert!(
        per_node.iter().filter(|&&n| n > 0).count() == 3,
        "keys live on all masters: {per_node:?}"
    );
    // Any node's address works as the URL.
    let via_other = open(&c.nodes[2].url());
    assert_eq!(via_other.get("packs/07/obj").unwrap(), [7u8; 100]);
}

#[test]
fn a_store_round_trips_on_redis() {
    let d = tempfile::tempdir().unwrap();
    let r = RedisServer::start(&d.path().join("redis"), true).unwrap();
    let url = format!("{}?prefix=store", r.url());
    let chunks: Vec<Vec<u8>> = (0..300).map(|i| chunk(i, 4096)).collect();
    let ids = {
        let be: DynBackend = Arc::new(open(&url));
        let store = Store::init(
            be,
            &d.path().join("a.redb"),
            InitOptions { pack_size: 256 << 10, ..Default::default() },
        )
        .unwrap();
        let ses = store.session();
        let ids: Vec<_> = chunks.iter().map(|c| ses.put(c, ChunkKind::Data).unwrap()).collect();
        let root = ses.put_tree(&Tree { children: ids.clone(), payload: vec![] }).unwrap();
        ses.commit_ref("mem/vm1", Ref::new(vec![root], vec![])).unwrap();
        ids
    };
    let store = Store::open(Arc::new(open(&url)), &d.path().join("b.redb")).unwrap();
    for (id, c) in ids.iter().zip(&chunks) {
        assert_eq!(&store.get(id).unwrap(), c);
    }
    let rep = store.check(CheckOptions::default(), &NoProgress).unwrap();
    assert_eq!(rep.errors(), 0, "{:?}", rep.problems);
}

#[test]
fn durability_is_checked_and_errors_name_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let r = RedisServer::start(&d.path().join("volatile"), false).unwrap();
    let e = RedisBackend::open(RedisConfig::from_url(&r.url()).unwrap()).unwrap_err();
    assert!(matches!(e, RedisError::NotDurable { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("CONFIG SET appendfsync always") && msg.contains("durability=volatile"),
        "{msg}"
    );
    let be = open(&format!("{}?durability=volatile", r.url()));
    assert_eq!(be.config().durability, Durability::Volatile);
    assert!(!be.capabilities().persistent);

    let t = Instant::now();
    let e = RedisBackend::open(
        RedisConfig::from_url(&format!("redis://127.0.0.1:{}", free_port(false))).unwrap(),
    )
    .unwrap_err();
    assert!(matches!(e, RedisError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("redis-server is running"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));

    let r2 = RedisServer::start(&d.path().join("auth"), true).unwrap();
    raw_command(&r2.addr(), &["CONFIG", "SET", "requirepass", "s3cret"]).unwrap();
    let e = RedisBackend::open(
        RedisConfig::from_url(&format!("redis://:wrong@{}", r2.addr())).unwrap(),
    )
    .unwrap_err();
    assert!(matches!(e, RedisError::Auth { .. }), "{e}");
    assert!(e.to_string().contains("USER:PASSWORD"), "{e}");
    let e = RedisBackend::open(RedisConfig::from_url(&r2.url()).unwrap()).unwrap_err();
    assert!(matches!(e, RedisError::Auth { .. }), "no password at all: {e}");
    let ok = open(&format!("redis://:s3cret@{}", r2.addr()));
    ok.put("k", b"v").unwrap();

    // A full server (maxmemory) is NoSpace.
    let mut cmd = std::process::Command::new("redis-cli");
    cmd.args([
        "-p",
        &r2.port.to_string(),
        "-a",
        "s3cret",
        "--no-auth-warning",
        "CONFIG",
        "SET",
        "maxmemory",
        "1",
    ]);
    assert!(cmd.output().unwrap().status.success());
    let e = ok.put("big", &[7u8; 4096]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NoSpace, "{e}");
}

/// Kill -9 redis-server (appendfsync always) while a store writes; after a restart, which
/// replays the AOF, every acknowledged commit is intact and the interrupted one is invisible.
#[test]
fn killing_redis_mid_write_loses_nothing_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let s =
        Arc::new(std::sync::Mutex::new(RedisServer::start(&d.path().join("redis"), true).unwrap()));
    let url = s.lock().unwrap().url();
    let store = Store::init(
        Arc::new(open(&url)),
        &d.path().join("a.redb"),
        InitOptions { pack_size: 128 << 10, ..Default::default() },
    )
    .unwrap();
    let run = CrashRun { chunks: 32, chunk_len: 8192, alphabet: 5, jitter_ms: 20 };
    let killer = s.clone();
    common::kill_mid_write(
        store,
        &run,
        move || killer.lock().unwrap().kill(),
        || {
            s.lock().unwrap().restart().unwrap();
            Store::open(Arc::new(open(&url)), &d.path().join("b.redb")).unwrap()
        },
    );
}

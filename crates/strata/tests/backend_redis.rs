//! The Redis backend against Debian's redis-server, single node and a 3-master cluster, each
//! started on free loopback ports and killed by the test.

use strata::backend::redis::{Durability, RedisBackend, RedisConfig, RedisError, REDIS_PACK_SIZE};
use strata::backend::servers::{free_port, raw_command, RedisCluster, RedisServer};
use strata::backend::{conformance, Backend, DynBackend, ErrorKind};
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::objects::{Ref, Tree};
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store, StoreError};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn open(url: &str) -> RedisBackend {
    RedisBackend::open(RedisConfig::from_url(url).unwrap()).unwrap_or_else(|e| panic!("{e}"))
}

fn chunk(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 5) as u8
        })
        .collect()
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
    assert!(per_node.iter().filter(|&&n| n > 0).count() == 3, "keys live on all masters: {per_node:?}");
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
        let store = Store::init(be, &d.path().join("a.redb"), InitOptions { pack_size: 256 << 10, ..Default::default() }).unwrap();
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
    assert!(msg.contains("CONFIG SET appendfsync always") && msg.contains("durability=volatile"), "{msg}");
    let be = open(&format!("{}?durability=volatile", r.url()));
    assert_eq!(be.config().durability, Durability::Volatile);
    assert!(!be.capabilities().persistent);

    let t = Instant::now();
    let e = RedisBackend::open(RedisConfig::from_url(&format!("redis://127.0.0.1:{}", free_port(false))).unwrap()).unwrap_err();
    assert!(matches!(e, RedisError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("redis-server is running"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));

    let r2 = RedisServer::start(&d.path().join("auth"), true).unwrap();
    raw_command(&r2.addr(), &["CONFIG", "SET", "requirepass", "s3cret"]).unwrap();
    let e = RedisBackend::open(RedisConfig::from_url(&format!("redis://:wrong@{}", r2.addr())).unwrap()).unwrap_err();
    assert!(matches!(e, RedisError::Auth { .. }), "{e}");
    assert!(e.to_string().contains("USER:PASSWORD"), "{e}");
    let e = RedisBackend::open(RedisConfig::from_url(&r2.url()).unwrap()).unwrap_err();
    assert!(matches!(e, RedisError::Auth { .. }), "no password at all: {e}");
    let ok = open(&format!("redis://:s3cret@{}", r2.addr()));
    ok.put("k", b"v").unwrap();

    // A full server (maxmemory) is NoSpace.
    let mut cmd = std::process::Command::new("redis-cli");
    cmd.args(["-p", &r2.port.to_string(), "-a", "s3cret", "--no-auth-warning", "CONFIG", "SET", "maxmemory", "1"]);
    assert!(cmd.output().unwrap().status.success());
    let e = ok.put("big", &[7u8; 4096]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NoSpace, "{e}");
}

/// Kill -9 redis-server (appendfsync always) while a store writes; after a restart, which
/// replays the AOF, every acknowledged commit is intact and the interrupted one is invisible.
#[test]
fn killing_redis_mid_write_loses_nothing_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let s = Arc::new(std::sync::Mutex::new(RedisServer::start(&d.path().join("redis"), true).unwrap()));
    let url = s.lock().unwrap().url();
    let store = Store::init(Arc::new(open(&url)), &d.path().join("a.redb"), InitOptions { pack_size: 128 << 10, ..Default::default() }).unwrap();
    let committed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let killer = {
        let (s, committed) = (s.clone(), committed.clone());
        std::thread::spawn(move || {
            while committed.load(std::sync::atomic::Ordering::SeqCst) < 5 {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(rand::random::<u64>() % 20));
            s.lock().unwrap().kill();
        })
    };
    let mut acknowledged: Vec<(String, Vec<u64>)> = Vec::new();
    let mut n = 0u64;
    let mut failure = None;
    for round in 0..100_000 {
        let ses = store.session();
        let seeds: Vec<u64> = (0..32)
            .map(|_| {
                n += 1;
                n
            })
            .collect();
        let res = (|| -> Result<(), StoreError> {
            let ids: Vec<_> = seeds.iter().map(|&i| ses.put(&chunk(i, 8192), ChunkKind::Data)).collect::<Result<_, _>>()?;
            let root = ses.put_tree(&Tree { children: ids, payload: vec![] })?;
            ses.commit_ref(&format!("ckpt/{round}"), Ref::new(vec![root], vec![]))
        })();
        match res {
            Ok(()) => {
                acknowledged.push((format!("ckpt/{round}"), seeds));
                committed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Err(e) => {
                failure = Some((round, e));
                break;
            }
        }
    }
    killer.join().unwrap();
    if let Some((round, e)) = &failure {
        eprintln!("redis killed: {} commits acknowledged, round {round} failed with: {e}", acknowledged.len());
    }
    let (failed_round, e) = failure.expect("writes fail once the server is dead");
    assert!(e.to_string().to_lowercase().contains("unavailable"), "{e}");
    drop(store);
    s.lock().unwrap().restart().unwrap();
    let store = Store::open(Arc::new(open(&url)), &d.path().join("b.redb")).unwrap();
    assert!(store.get_ref(&format!("ckpt/{failed_round}")).unwrap().is_none());
    for (name, seeds) in &acknowledged {
        let r = store.get_ref(name).unwrap().unwrap_or_else(|| panic!("acknowledged {name} lost"));
        let tree = Tree::decode(&store.get(&r.roots[0]).unwrap()).unwrap();
        for (id, &seed) in tree.children.iter().zip(seeds) {
            assert_eq!(store.get(id).unwrap(), chunk(seed, 8192));
        }
    }
    let rep = store.check(CheckOptions::default(), &NoProgress).unwrap();
    assert_eq!(rep.errors(), 0, "{:?}", rep.problems);
}

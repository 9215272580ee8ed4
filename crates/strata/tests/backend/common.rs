//! Test support shared by the remote backends' tests (`s3.rs`, `redis.rs`).
//!
//! [`kill_mid_write`] is the crash check every remote backend must pass: a store commits
//! checkpoints in a loop while another thread kills the server at a moment the test does not
//! choose; the failing write must say the backend is unavailable, and after a restart the
//! interrupted commit is invisible while every acknowledged one reads back intact.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::objects::{Ref, Tree};
use strata::store::pack::ChunkKind;
use strata::store::{Store, StoreError};

/// Deterministic test data: `len` bytes from seed `i`, drawn from `alphabet` symbols (small
/// alphabets compress, like real disk data).
pub fn chunk(i: u64, len: usize, alphabet: u64) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % alphabet) as u8
        })
        .collect()
}

/// The shape of one crash run.
pub struct CrashRun {
    /// Chunks per commit, and bytes per chunk.
    pub chunks: usize,
    pub chunk_len: usize,
    pub alphabet: u64,
    /// Upper bound of the random delay (ms) between the 5th commit and the kill.
    pub jitter_ms: u64,
}

/// Commit rounds into `store` until `kill` (run on another thread after 5 commits) takes the
/// server down; then `reopen` restarts it and opens a second store instance on it, which must
/// show every acknowledged commit and not the interrupted one. Returns the number of commits
/// acknowledged before the kill.
pub fn kill_mid_write(
    store: Store,
    run: &CrashRun,
    kill: impl FnOnce() + Send + 'static,
    reopen: impl FnOnce() -> Store,
) -> usize {
    let committed = Arc::new(AtomicUsize::new(0));
    let jitter = run.jitter_ms.max(1);
    let killer = {
        let committed = committed.clone();
        std::thread::spawn(move || {
            while committed.load(Ordering::SeqCst) < 5 {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(rand::random::<u64>() % jitter));
            kill();
        })
    };
    let mut acknowledged: Vec<(String, Vec<u64>)> = Vec::new();
    let mut n = 0u64;
    let mut failure = None;
    for round in 0..100_000 {
        let ses = store.session();
        let seeds: Vec<u64> = (0..run.chunks)
            .map(|_| {
                n += 1;
                n
            })
            .collect();
        let res = (|| -> Result<(), StoreError> {
            let ids: Vec<_> = seeds
                .iter()
                .map(|&i| ses.put(&chunk(i, run.chunk_len, run.alphabet), ChunkKind::Data))
                .collect::<Result<_, _>>()?;
            let root = ses.put_tree(&Tree { children: ids, payload: vec![] })?;
            ses.commit_ref(&format!("ckpt/{round}"), Ref::new(vec![root], vec![]))
        })();
        match res {
            Ok(()) => {
                acknowledged.push((format!("ckpt/{round}"), seeds));
                committed.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) => {
                failure = Some((round, e));
                break;
            }
        }
    }
    killer.join().unwrap();
    let (failed_round, e) = failure.expect("writes must fail once the server is dead");
    eprintln!(
        "server killed: {} commits acknowledged, round {failed_round} failed with: {e}",
        acknowledged.len()
    );
    let text = e.to_string();
    assert!(text.to_lowercase().contains("unavailable"), "the error says what happened: {text}");
    assert!(acknowledged.len() >= 5, "commits before the kill were acknowledged");
    drop(store);

    let store = reopen();
    // The interrupted commit is all or nothing. It may be visible: the server can apply the
    // ref write and die before its reply, so the client saw a failure for a complete commit.
    let interrupted = format!("ckpt/{failed_round}");
    let mut must_read = acknowledged.clone();
    if store.get_ref(&interrupted).unwrap().is_some() {
        eprintln!("the interrupted commit {interrupted} landed before the server died (reply lost); it must be whole");
        let first = acknowledged.last().map_or(0, |(_, s)| *s.last().unwrap()) + 1;
        must_read.push((interrupted, (first..first + run.chunks as u64).collect()));
    }
    for (name, seeds) in &must_read {
        let r = store.get_ref(name).unwrap().unwrap_or_else(|| panic!("acknowledged {name} lost"));
        let tree = Tree::decode(&store.get(&r.roots[0]).unwrap()).unwrap();
        for (id, &seed) in tree.children.iter().zip(seeds) {
            assert_eq!(store.get(id).unwrap(), chunk(seed, run.chunk_len, run.alphabet));
        }
    }
    let rep = store.check(CheckOptions::default(), &NoProgress).unwrap();
    assert_eq!(rep.errors(), 0, "{:?}", rep.problems);
    acknowledged.len()
}

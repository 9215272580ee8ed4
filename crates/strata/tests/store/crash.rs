//! Crash harness for the chunk store: cut power at every sync point of a workload.
//!
//! The workload (a few thousand chunk writes, ref commits, ref deletes and GCs, with dedup
//! across rounds) first runs clean to count its syncs. Then, for every N, it runs again on a
//! fault backend that cuts power at the N-th sync (dropping, keeping, or randomly keeping the
//! unsynced operations). The store is reopened over what survived, with a fresh and with a
//! stale metadata cache, and we assert:
//! - `check` finds no damage (orphan packs are allowed: they are reclaimable leftovers);
//! - every acknowledged ref has exactly its acknowledged content, all chunks readable and
//!   verified; the one operation in flight at the cut is either fully there or not at all;
//! - the reopened store accepts new writes.

use std::collections::BTreeMap;
use std::sync::Arc;
use strata::backend::fault::{CutMode, FaultBackend};
use strata::backend::memory::MemoryBackend;
use strata::progress::NoProgress;
use strata::store::check::CheckOptions;
use strata::store::objects::{Ref, Tree};
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store};
use strata::{ChunkId, Codec};

const ROUNDS: u64 = 36;
const PER_ROUND: u64 = 100;

fn chunk(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0x1f) as u8
        })
        .collect()
}

type Model = BTreeMap<String, Option<Vec<ChunkId>>>;

/// Runs until done or the backend dies. Returns the acknowledged state and the op in flight.
fn workload(
    store: &Store,
    acked: &mut Model,
    inflight: &mut Option<(String, Option<Vec<ChunkId>>)>,
) -> Result<(), String> {
    for round in 0..ROUNDS {
        let ses = store.session();
        let name = format!("vm/{}", round % 7);
        // A third of each round repeats content of earlier rounds (dedup across refs).
        let ids: Vec<ChunkId> = (0..PER_ROUND)
            .map(|i| {
                let seed = if i % 3 == 0 { i } else { round * 1000 + i };
                ses.put(&chunk(seed), ChunkKind::Data).map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        let root = ses
            .put_tree(&Tree { children: ids.clone(), payload: vec![] })
            .map_err(|e| e.to_string())?;
        *inflight = Some((name.clone(), Some(ids.clone())));
        ses.commit_ref(&name, Ref::new(vec![root], round.to_le_bytes().to_vec()))
            .map_err(|e| e.to_string())?;
        acked.insert(name, Some(ids));
        *inflight = None;
        drop(ses);
        if round % 5 == 4 {
            let victim = format!("vm/{}", (round / 5) % 7);
            if acked.get(&victim).is_some_and(|v| v.is_some()) {
                *inflight = Some((victim.clone(), None));
                store.delete_ref(&victim).map_err(|e| e.to_string())?;
                acked.insert(victim, None);
                *inflight = None;
            }
        }
        if round % 8 == 7 {
            store.gc(&NoProgress).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

fn ref_content(store: &Store, name: &str) -> Option<Vec<ChunkId>> {
    let r =
        store.get_ref(name).unwrap_or_else(|e| panic!("ref {name} unreadable after crash: {e}"))?;
    let tree =
        Tree::decode(&store.get(&r.roots[0]).unwrap_or_else(|e| panic!("root of {name}: {e}")))
            .unwrap();
    for id in &tree.children {
        store.get(id).unwrap_or_else(|e| panic!("chunk {id} of {name} lost after crash: {e}"));
    }
    Some(tree.children)
}

fn fresh_base() -> (tempfile::TempDir, MemoryBackend) {
    let d = tempfile::tempdir().unwrap();
    let base = MemoryBackend::new();
    let s = Store::init(
        Arc::new(base.clone()),
        &d.path().join("init.redb"),
        InitOptions { pack_size: 64 << 10, default_codec: Codec::Lz4 },
    )
    .unwrap();
    s.close().unwrap();
    (d, base)
}

#[test]
fn power_cut_at_every_sync_point_loses_nothing_acknowledged() {
    // Count the sync points of a clean run.
    let (d, base) = fresh_base();
    let fb = Arc::new(FaultBackend::new(&base));
    let total = {
        let s = Store::open(fb.clone(), &d.path().join("clean.redb")).unwrap();
        let (mut acked, mut inflight) = (Model::new(), None);
        workload(&s, &mut acked, &mut inflight).unwrap();
        fb.sync_count()
    };
    assert!(total > 60, "workload too small to be interesting: {total} syncs");
    eprintln!("workload: {} chunk writes, {total} sync points", ROUNDS * PER_ROUND);

    for n in 1..=total {
        let (d, base) = fresh_base();
        let mut fb = FaultBackend::new(&base);
        fb.cut_at_sync = Some(n);
        fb.cut_mode = match n % 3 {
            0 => CutMode::DropAll,
            1 => CutMode::KeepAll,
            _ => CutMode::Random(n),
        };
        let fb = Arc::new(fb);
        let meta = d.path().join("host.redb");
        let (mut acked, mut inflight) = (Model::new(), None);
        {
            let s = Store::open(fb.clone(), &meta).unwrap();
            let r = workload(&s, &mut acked, &mut inflight);
            assert!(r.is_err(), "cut at sync {n} went unnoticed");
            assert!(fb.crashed());
        }
        // Reopen what survived: alternately with the stale local cache and a fresh one.
        let survivor = Arc::new(fb.durable());
        let meta2 = if n % 2 == 0 { meta.clone() } else { d.path().join("fresh.redb") };
        let s = Store::open(survivor.clone(), &meta2)
            .unwrap_or_else(|e| panic!("reopen after cut {n}: {e}"));
        let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
        assert!(!rep.is_damaged(), "cut at sync {n}: check found damage: {:#?}", rep.problems);
        for (name, want) in &acked {
            let got = ref_content(&s, name);
            let ok = got == *want
                || inflight.as_ref().is_some_and(|(iname, iv)| iname == name && got == *iv);
            assert!(
                ok,
                "cut at sync {n}: ref {name} is {:?}, acknowledged {:?}",
                got.map(|v| v.len()),
                want.as_ref().map(|v| v.len())
            );
        }
        if let Some((iname, iv)) = &inflight {
            if !acked.contains_key(iname) {
                let got = ref_content(&s, iname);
                assert!(
                    got.is_none() || got == *iv,
                    "cut at sync {n}: in-flight ref {iname} is half-written"
                );
            }
        }
        // The reopened store keeps working.
        let ses = s.session();
        let id = ses.put(&chunk(987654), ChunkKind::Data).unwrap();
        ses.commit_ref("after", Ref::new(vec![id], vec![])).unwrap();
        drop(ses);
        s.gc(&NoProgress).unwrap();
        let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
        assert!(
            !rep.is_damaged(),
            "cut at sync {n}: damage after recovery writes: {:#?}",
            rep.problems
        );
    }
}

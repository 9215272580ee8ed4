//! Crash harness for the desktop-snapshot commit: power cut at every sync point.
//!
//! The workload is what a desktop snapshot does to the store, in order: the disks are cut
//! while being written (`disk::cut`), the cuts are folded into block maps and the store is
//! flushed (the daemon's side), then one ref `vm/NAME` names the memory's roots and the
//! disks' roots (the saver's side). It first runs clean to count its syncs, then once per
//! sync with the power cut there (dropping, keeping or randomly keeping unsynced writes). On
//! the store that survives: `check` finds no damage, every acknowledged snapshot holds
//! exactly the disks' content at its cut, and the snapshot in flight is whole or absent.

use crate::backend::fault::{CutMode, FaultBackend};
use crate::backend::memory::MemoryBackend;
use crate::codec::Codec;
use crate::disk::{self, cut, volume::Volume};
use crate::id::ChunkId;
use crate::memory::manifest::{tests::sample, Checkpoint, DiskRecord, VERSION_DISKS};
use crate::progress::NoProgress;
use crate::store::check::CheckOptions;
use crate::store::map;
use crate::store::pack::ChunkKind;
use crate::store::{InitOptions, Store};
use std::collections::BTreeMap;
use std::sync::Arc;

const DISK: u64 = 1 << 20;
const ROUNDS: u64 = 6;

/// Acknowledged snapshots: name -> each disk's bytes at its cut.
type Model = BTreeMap<String, Vec<Vec<u8>>>;

fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0x0f) as u8
        })
        .collect()
}

fn workload(
    s: &Store,
    models: &mut [Vec<u8>; 2],
    acked: &mut Model,
    inflight: &mut Option<(String, Vec<Vec<u8>>)>,
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let vols: Vec<Arc<Volume>> = ["a", "b"]
        .iter()
        .map(|n| Volume::open(s, n))
        .collect::<Result<_, _>>()
        .map_err(|x| e(&x))?;
    for round in 0..ROUNDS {
        for (i, v) in vols.iter().enumerate() {
            for k in 0..6u64 {
                let off = (round * 7 + k * 13 + i as u64 * 5) % 15 * 65536 + k * 511;
                let data = fill(round * 100 + k + i as u64 * 1000, 70_000);
                v.write(off, &data, false).map_err(|x| e(&x))?;
                models[i][off as usize..off as usize + data.len()].copy_from_slice(&data);
            }
        }
        let cuts = cut::cut_all(&vols).map_err(|x| e(&x))?;
        let at_cut = vec![models[0].clone(), models[1].clone()];
        // Writes after the cut must not show in the snapshot.
        for (i, v) in vols.iter().enumerate() {
            let data = fill(round + 77 + i as u64, 9000);
            v.write(4096, &data, false).map_err(|x| e(&x))?;
            models[i][4096..4096 + data.len()].copy_from_slice(&data);
        }
        let name = format!("desk@{round}");
        *inflight = Some((name.clone(), at_cut.clone()));
        // The daemon: fold and make durable.
        let daemon = s.session();
        let folded: Vec<cut::Folded> =
            cuts.iter().map(|c| c.fold(&daemon)).collect::<Result<_, _>>().map_err(|x| e(&x))?;
        // The saver: memory roots, then the one ref naming memory and disks.
        let saver = s.session();
        let mut memory = Vec::new();
        for k in 0..3 {
            memory
                .push(saver.put(&fill(round * 10 + k, 4096), ChunkKind::Data).map_err(|x| e(&x))?);
        }
        let mut m = sample();
        m.name = name.clone();
        m.version = VERSION_DISKS;
        m.disks = folded
            .iter()
            .map(|f| DiskRecord {
                device: format!("virtio-{}", f.name),
                disk: f.name.clone(),
                uri: format!("nbd+unix:///{}?socket=/s", f.name),
                size: f.meta.size,
                block_size: f.meta.block_size,
                allocated: f.meta.allocated.unwrap_or(0),
                parent: None,
            })
            .collect();
        let mut disk_roots = Vec::new();
        for f in &folded {
            saver.pin(f.root).map_err(|x| e(&x))?;
            disk_roots.push(f.root);
        }
        let ckpt = Checkpoint {
            manifest: m,
            tail_root: memory[0],
            map_roots: memory[1..].to_vec(),
            disk_roots,
            generation: 0,
        };
        saver
            .commit_new_ref(&crate::memory::manifest::ref_name(&name), ckpt.to_ref())
            .map_err(|x| e(&x))?;
        acked.insert(name, at_cut);
        *inflight = None;
        drop((daemon, saver));
        if round % 3 == 2 {
            s.gc(&NoProgress).map_err(|x| e(&x))?;
        }
    }
    Ok(())
}

/// The disks of snapshot `name` as stored, or None if it is not there.
fn stored(s: &Store, name: &str) -> Option<Vec<Vec<u8>>> {
    let r = s.get_ref(&crate::memory::manifest::ref_name(name)).unwrap()?;
    let c = Checkpoint::from_ref(&r).unwrap_or_else(|e| panic!("{name} is half-written: {e}"));
    let mut out = Vec::new();
    for (d, root) in c.manifest.disks.iter().zip(&c.disk_roots) {
        let blocks = map::read_map(s, root).unwrap_or_else(|e| panic!("{name}: map lost: {e}"));
        let mut bytes = vec![0u8; d.size as usize];
        for (i, id) in blocks.iter().enumerate() {
            if !id.is_zero() {
                let b = s.get(id).unwrap_or_else(|e| panic!("{name}: block {i} lost: {e}"));
                let at = i * d.block_size as usize;
                let n = b.len().min(bytes.len() - at);
                bytes[at..at + n].copy_from_slice(&b[..n]);
            }
        }
        out.push(bytes);
    }
    Some(out)
}

fn fresh(dir: &std::path::Path) -> MemoryBackend {
    let base = MemoryBackend::new();
    let s = Store::init(
        Arc::new(base.clone()),
        &dir.join("init.redb"),
        InitOptions { pack_size: 64 << 10, default_codec: Codec::Lz4 },
    )
    .unwrap();
    disk::create(&s, "a", DISK).unwrap();
    disk::create(&s, "b", DISK).unwrap();
    s.close().unwrap();
    base
}

#[test]
fn power_cut_at_every_sync_of_a_desktop_snapshot_leaves_it_whole_or_absent() {
    let d = tempfile::tempdir().unwrap();
    let fb = Arc::new(FaultBackend::new(&fresh(d.path())));
    let total = {
        let s = Store::open(fb.clone(), &d.path().join("clean.redb")).unwrap();
        let mut models = [vec![0u8; DISK as usize], vec![0u8; DISK as usize]];
        workload(&s, &mut models, &mut Model::new(), &mut None).unwrap();
        fb.sync_count()
    };
    assert!(total > 12, "workload too small: {total} syncs");
    let _ = ChunkId::ZERO;
    for n in 1..=total {
        let d = tempfile::tempdir().unwrap();
        let mut fb = FaultBackend::new(&fresh(d.path()));
        fb.cut_at_sync = Some(n);
        fb.cut_mode = match n % 3 {
            0 => CutMode::DropAll,
            1 => CutMode::KeepAll,
            _ => CutMode::Random(n),
        };
        let fb = Arc::new(fb);
        let (mut acked, mut inflight) = (Model::new(), None);
        {
            let s = Store::open(fb.clone(), &d.path().join("host.redb")).unwrap();
            let mut models = [vec![0u8; DISK as usize], vec![0u8; DISK as usize]];
            let r = workload(&s, &mut models, &mut acked, &mut inflight);
            assert!(r.is_err() && fb.crashed(), "cut at sync {n} went unnoticed");
        }
        let s = Store::open(Arc::new(fb.durable()), &d.path().join("fresh.redb")).unwrap();
        let rep = s.check(CheckOptions::default(), &NoProgress).unwrap();
        assert!(!rep.is_damaged(), "cut at sync {n}: damage: {:#?}", rep.problems);
        for (name, want) in &acked {
            assert!(stored(&s, name).as_ref() == Some(want), "cut at sync {n}: {name} differs");
        }
        if let Some((name, want)) = &inflight {
            let got = stored(&s, name);
            assert!(got.is_none() || got.as_ref() == Some(want), "cut at sync {n}: {name} half");
        }
    }
}

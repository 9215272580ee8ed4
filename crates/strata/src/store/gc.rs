//! Garbage collection: mark from refs and live sessions, sweep unreachable chunks.
//!
//! Mark runs without blocking writers. The final phase takes the GC write lock, which excludes
//! puts, pins and ref commits: it re-reads the refs (new ones written during the mark), marks
//! every chunk live sessions have put or pinned, and removes unreachable entries from the
//! in-memory index. From then on a writer that wants such content misses the index and stores
//! a fresh copy, so the sweep can't delete anything a writer is about to reference.
//!
//! Sweep order is the reverse of the write order (`docs/durability.md`): packs with no live
//! chunk lose their index object first (synced), then their pack data (synced). Packs that are
//! mostly dead are repacked: live frames are copied into new packs, which are made durable and
//! indexed *before* the old pack's index and data are deleted. A crash at any point leaves at
//! worst an orphan pack (reported by `check`), never a ref pointing at nothing.

use super::objects::Tree;
use super::pack::{parse_pack, ChunkKind, PackEntry};
use super::{Result, Store, StoreError};
use crate::id::{ChunkId, PackId};
use crate::progress::{Progress, Unit};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Repack a pack when at least this fraction of its chunks' bytes is dead.
const REPACK_DEAD_FRACTION: f64 = 0.25;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct GcReport {
    pub refs: usize,
    pub live_chunks: usize,
    pub dead_chunks: usize,
    pub packs_deleted: usize,
    pub packs_repacked: usize,
    pub bytes_freed: u64,
    /// Packs no index object names (left by interrupted writes), deleted.
    pub orphan_packs_deleted: usize,
}

impl Store {
    /// Mark everything reachable from `roots` (skipping subtrees already marked).
    pub(crate) fn mark_from(
        &self,
        roots: impl IntoIterator<Item = ChunkId>,
        marked: &mut HashSet<ChunkId>,
    ) -> Result<()> {
        let mut stack: Vec<ChunkId> = roots.into_iter().collect();
        while let Some(id) = stack.pop() {
            if id.is_zero() || !marked.insert(id) {
                continue;
            }
            match self.chunk_info(&id) {
                Some((_, ChunkKind::Tree)) => {
                    // A tree we cannot read could hide live chunks: refuse to sweep at all.
                    let t = self.get(&id).and_then(|b| {
                        Tree::decode(&b).map_err(|source| StoreError::Format {
                            key: format!("chunk {id}"),
                            source,
                        })
                    })?;
                    stack.extend(t.children.iter().filter(|c| !c.is_zero() && !marked.contains(c)));
                }
                Some(_) => {}
                // It could be a tree whose children are live: refuse to sweep rather than guess.
                None => return Err(StoreError::GcMissingChunk { chunk: id }),
            }
        }
        Ok(())
    }

    /// Collect garbage. Safe to run while sessions write.
    pub fn gc(&self, progress: &dyn Progress) -> Result<GcReport> {
        let _one_gc_at_a_time = self.inner.gc_running.lock();
        // Across processes and hosts: GC runs only when no other store instance is open.
        let _gc_lease = self.inner.leases.acquire_gc()?;
        self.flush()?;
        // Learn every pack other instances wrote since we opened (a daemon opens once and runs
        // for weeks). Their refs may reach our chunks through trees only their packs hold;
        // marking without those trees would sweep live chunks. No other instance is open now,
        // so the listing is complete.
        super::writer::refresh_index(&self.inner.sh)?;
        let mut report = GcReport::default();
        let mut marked = HashSet::new();
        progress.phase("marking", None, Unit::Items);
        // The roots each ref had when marked. The final phase compares roots, not generations:
        // a commit that could not read the old ref restarts its generation at 1, so a number
        // seen here may come back with other roots.
        let mut seen_refs: HashMap<String, Vec<ChunkId>> = HashMap::new();
        for name in self.list_refs("")? {
            if let Some(r) = self.get_ref(&name)? {
                self.mark_from(r.roots.iter().copied(), &mut marked)?;
                seen_refs.insert(name, r.roots);
                progress.advance(1);
            }
        }
        // Final phase: writers are held off while we catch up and unlink dead entries.
        let (doomed, repack) = {
            let _w = self.inner.gc_lock.write();
            for name in self.list_refs("")? {
                if let Some(r) = self.get_ref(&name)? {
                    if seen_refs.get(&name) != Some(&r.roots) {
                        self.mark_from(r.roots.iter().copied(), &mut marked)?;
                    }
                    seen_refs.insert(name, r.roots);
                }
            }
            let pins: Vec<ChunkId> = self
                .inner
                .sessions
                .lock()
                .values()
                .flat_map(|p| p.lock().iter().copied().collect::<Vec<_>>())
                .collect();
            self.mark_from(pins, &mut marked)?;
            report.refs = seen_refs.len();

            let mut idx = self.inner.sh.index.write();
            // Per durable pack: live and dead entries.
            let mut per_pack: BTreeMap<u32, (Vec<PackEntry>, Vec<PackEntry>)> = BTreeMap::new();
            for (id, loc) in idx.chunks.iter() {
                if !idx.slot(loc.pack).is_some_and(|s| s.durable) {
                    continue;
                }
                let e = per_pack.entry(loc.pack).or_default();
                if marked.contains(id) {
                    e.0.push(loc.entry);
                } else {
                    e.1.push(loc.entry);
                }
            }
            report.live_chunks = marked.len();
            let mut doomed: Vec<(PackId, u64, Vec<ChunkId>)> = Vec::new();
            let mut repack: Vec<(PackId, u64, Vec<PackEntry>, Vec<ChunkId>)> = Vec::new();
            for (no, (live, dead)) in per_pack {
                if dead.is_empty() {
                    continue;
                }
                let dead_bytes: u64 = dead.iter().map(|e| e.raw_len as u64).sum();
                let live_bytes: u64 = live.iter().map(|e| e.raw_len as u64).sum();
                let slot = idx.slot(no).expect("slot of indexed chunk");
                let (pid, size) = (slot.id, slot.size);
                let all_ids: Vec<ChunkId> = live.iter().chain(&dead).map(|e| e.id).collect();
                if live.is_empty() {
                    report.dead_chunks += dead.len();
                    for e in &dead {
                        idx.chunks.remove(&e.id);
                    }
                    idx.packs[no as usize] = None;
                    idx.by_id.remove(&pid);
                    doomed.push((pid, size, all_ids));
                } else if dead_bytes as f64
                    >= REPACK_DEAD_FRACTION * (dead_bytes + live_bytes) as f64
                {
                    report.dead_chunks += dead.len();
                    for e in &dead {
                        idx.chunks.remove(&e.id);
                    }
                    repack.push((pid, size, live, all_ids));
                }
            }
            (doomed, repack)
        };

        // Repack: copy live frames into new packs, and make them durable first.
        progress.phase("repacking", Some(repack.len() as u64), Unit::Items);
        for (pid, _, live, _) in &repack {
            let bytes = self.backend().get(&pid.pack_key())?;
            let (_, entries) = parse_pack(&bytes)
                .map_err(|source| StoreError::Format { key: pid.pack_key(), source })?;
            let live_ids: HashSet<ChunkId> = live.iter().map(|e| e.id).collect();
            let mut frames: BTreeMap<u64, Vec<PackEntry>> = BTreeMap::new();
            for e in entries.into_iter().filter(|e| live_ids.contains(&e.id)) {
                frames.entry(e.frame_off).or_default().push(e);
            }
            for (off, es) in frames {
                let stored = &bytes[off as usize..off as usize + es[0].frame_len as usize];
                let chunks: Vec<_> =
                    es.iter().map(|e| (e.id, e.off_in_frame, e.raw_len, e.kind)).collect();
                self.put_raw_frame(stored, &es[0], &chunks)?;
            }
            progress.advance(1);
        }
        self.flush()?;
        {
            let mut idx = self.inner.sh.index.write();
            for (pid, ..) in &repack {
                if let Some(no) = idx.by_id.remove(pid) {
                    idx.packs[no as usize] = None;
                }
            }
        }
        report.packs_deleted = doomed.len();
        report.packs_repacked = repack.len();
        // Delete in reverse order of writing: index objects, sync, then pack data, sync.
        progress.phase("deleting", Some((doomed.len() + repack.len()) as u64), Unit::Items);
        let victims: Vec<(PackId, u64, Vec<ChunkId>)> = doomed
            .into_iter()
            .chain(repack.into_iter().map(|(p, s, _, ids)| (p, s, ids)))
            .collect();
        if !victims.is_empty() {
            let sh = &self.inner.sh;
            // (A network pack is its own index: deleting it is one atomic step, and the index
            // object it may have from an older writer goes first all the same.)
            for (pid, ..) in &victims {
                sh.backend.delete(&pid.index_key())?;
            }
            sh.sync()?;
            for (pid, size, _) in &victims {
                sh.backend.delete(&pid.pack_key())?;
                report.bytes_freed += size;
                progress.advance(1);
            }
            sh.sync()?;
            let rows: Vec<(PackId, Vec<ChunkId>)> =
                victims.iter().map(|(p, _, ids)| (*p, ids.clone())).collect();
            sh.meta.remove_packs(&rows, true)?;
        }
        // Orphan packs: written but never indexed (a write interrupted by a crash or a full
        // disk; only on backends where packs need index objects, `discover.rs`). The GC lease
        // keeps other instances out, and a pack this process writes joins its index when it
        // is opened, before its data is put. So the index is read *after* the listings: a
        // pack listed then is known by then, unless it is a true orphan. (Read before, it
        // missed packs opened and put meanwhile, whose index objects wait for the next
        // flush, and deleted them under live chunks.)
        let visible = super::discover::list_packs(&**self.backend())?;
        let unindexed = super::discover::orphan_packs(&**self.backend(), &visible)?;
        let known: HashSet<PackId> = self.inner.sh.index.read().by_id.keys().copied().collect();
        let mut orphans = 0;
        for (pid, key, size) in unindexed {
            if !known.contains(&pid) {
                self.backend().delete(&key)?;
                report.bytes_freed += size;
                orphans += 1;
            }
        }
        if orphans > 0 {
            self.inner.sh.sync()?;
        }
        report.orphan_packs_deleted = orphans;
        progress.finish();
        tracing::info!(target: "strata::gc", ?report, "gc done");
        Ok(report)
    }
}

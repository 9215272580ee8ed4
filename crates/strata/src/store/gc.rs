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
use super::{Index, Result, Store, StoreError};
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

    /// Collect garbage. Safe to run while sessions write. Stages: mark from the refs; under
    /// the GC write lock, catch up with new refs and live sessions and unlink the dead
    /// entries; repack the mostly dead packs; delete dead packs (index objects first); delete
    /// orphan packs.
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
        // a commit that cannot read the old ref restarts its generation at 1, so a number seen
        // here may come back with other roots.
        let mut seen_refs: HashMap<String, Vec<ChunkId>> = HashMap::new();
        for name in self.list_refs("")? {
            if let Some(r) = self.get_ref(&name)? {
                self.mark_from(r.roots.iter().copied(), &mut marked)?;
                seen_refs.insert(name, r.roots);
                progress.advance(1);
            }
        }
        // Final phase: writers are held off while we catch up and unlink dead entries.
        let sweep = {
            let _w = self.inner.gc_lock.write();
            self.catch_up(&mut marked, &mut seen_refs)?;
            report.refs = seen_refs.len();
            report.live_chunks = marked.len();
            let mut idx = self.inner.sh.index.write();
            let sweep = plan_sweep(&idx, &marked);
            report.dead_chunks = sweep.dead_chunks;
            sweep.unlink(&mut idx);
            sweep
        };
        self.repack(&sweep.repack, progress)?;
        report.packs_deleted = sweep.doomed.len();
        report.packs_repacked = sweep.repack.len();
        report.bytes_freed += self.delete_packs(sweep, progress)?;
        let (orphans, freed) = self.delete_orphans()?;
        report.orphan_packs_deleted = orphans;
        report.bytes_freed += freed;
        progress.finish();
        tracing::info!(target: "strata::gc", ?report, "gc done");
        Ok(report)
    }

    /// Under the GC write lock: mark from the refs written or changed since the mark, and
    /// from every chunk live sessions have put or pinned.
    fn catch_up(
        &self,
        marked: &mut HashSet<ChunkId>,
        seen_refs: &mut HashMap<String, Vec<ChunkId>>,
    ) -> Result<()> {
        for name in self.list_refs("")? {
            if let Some(r) = self.get_ref(&name)? {
                if seen_refs.get(&name) != Some(&r.roots) {
                    self.mark_from(r.roots.iter().copied(), marked)?;
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
        self.mark_from(pins, marked)
    }

    /// Repack: copy the live frames of each pack into new packs, and make them durable, then
    /// forget the old packs' slots (their data is deleted with the dead packs).
    fn repack(&self, repack: &[Repack], progress: &dyn Progress) -> Result<()> {
        progress.phase("repacking", Some(repack.len() as u64), Unit::Items);
        for r in repack {
            let bytes = self.backend().get(&r.pack.pack_key())?;
            let (_, entries) = parse_pack(&bytes)
                .map_err(|source| StoreError::Format { key: r.pack.pack_key(), source })?;
            let live_ids: HashSet<ChunkId> = r.live.iter().map(|e| e.id).collect();
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
        let mut idx = self.inner.sh.index.write();
        for r in repack {
            if let Some(no) = idx.by_id.remove(&r.pack) {
                idx.packs[no as usize] = None;
            }
        }
        Ok(())
    }

    /// Delete the dead and repacked packs in reverse order of writing: index objects, sync,
    /// then pack data, sync; then their rows in the metadata. Returns the bytes freed.
    fn delete_packs(&self, sweep: Sweep, progress: &dyn Progress) -> Result<u64> {
        progress.phase("deleting", Some(sweep.victims()), Unit::Items);
        let victims: Vec<Doomed> =
            sweep.doomed.into_iter().chain(sweep.repack.into_iter().map(|r| r.old)).collect();
        if victims.is_empty() {
            return Ok(0);
        }
        let sh = &self.inner.sh;
        // (A network pack is its own index: deleting it is one atomic step, and the index
        // object it may have from an older writer goes first all the same.)
        for v in &victims {
            sh.backend.delete(&v.pack.index_key())?;
        }
        sh.sync()?;
        let mut freed = 0;
        for v in &victims {
            sh.backend.delete(&v.pack.pack_key())?;
            freed += v.size;
            progress.advance(1);
        }
        sh.sync()?;
        let rows: Vec<(PackId, Vec<ChunkId>)> =
            victims.into_iter().map(|v| (v.pack, v.chunks)).collect();
        sh.meta.remove_packs(&rows, true)?;
        Ok(freed)
    }

    /// Orphan packs: written but never indexed (a write interrupted by a crash or a full
    /// disk; only on backends where packs need index objects, `discover.rs`). The GC lease
    /// keeps other instances out, and a pack this process writes joins its index when it is
    /// opened, before its data is put. So the index is read *after* the listings: a pack
    /// listed then is known by then, unless it is a true orphan. (Read before the listings,
    /// the index would miss packs opened and put meanwhile, whose index objects wait for the
    /// next flush, and GC would delete them under live chunks.) Returns the packs deleted and
    /// their bytes.
    fn delete_orphans(&self) -> Result<(usize, u64)> {
        let visible = super::discover::list_packs(&**self.backend())?;
        let unindexed = super::discover::orphan_packs(&**self.backend(), &visible)?;
        let known: HashSet<PackId> = self.inner.sh.index.read().by_id.keys().copied().collect();
        let (mut orphans, mut freed) = (0, 0);
        for (pid, key, size) in unindexed {
            if !known.contains(&pid) {
                self.backend().delete(&key)?;
                freed += size;
                orphans += 1;
            }
        }
        if orphans > 0 {
            self.inner.sh.sync()?;
        }
        Ok((orphans, freed))
    }
}

/// A pack to delete: its id, size, and every chunk it held (for the metadata rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Doomed {
    pub(crate) pack: PackId,
    pub(crate) size: u64,
    pub(crate) chunks: Vec<ChunkId>,
}

/// A pack to repack: its live entries, then deleted as [`Doomed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Repack {
    pub(crate) pack: PackId,
    pub(crate) live: Vec<PackEntry>,
    pub(crate) old: Doomed,
}

/// The sweep's plan, under the GC write lock: packs with no live chunk, packs to repack, and
/// the dead entries to drop from the index.
#[derive(Debug, Default)]
pub(crate) struct Sweep {
    /// Index numbers of the doomed packs, with the packs.
    doomed_slots: Vec<u32>,
    pub(crate) doomed: Vec<Doomed>,
    pub(crate) repack: Vec<Repack>,
    /// Dead chunks of doomed and repacked packs: unlinked from the index.
    dead: Vec<ChunkId>,
    pub(crate) dead_chunks: usize,
}

impl Sweep {
    /// Packs the deletion stage removes.
    fn victims(&self) -> u64 {
        (self.doomed.len() + self.repack.len()) as u64
    }

    /// Drop the dead entries from the index, and the doomed packs' slots: from here on a
    /// writer that wants such content misses the index and stores a fresh copy.
    pub(super) fn unlink(&self, idx: &mut Index) {
        for id in &self.dead {
            idx.chunks.remove(id);
        }
        for (&no, d) in self.doomed_slots.iter().zip(&self.doomed) {
            idx.packs[no as usize] = None;
            idx.by_id.remove(&d.pack);
        }
    }
}

/// What becomes of a pack with dead chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Nothing live: delete it.
    Delete,
    /// At least [`REPACK_DEAD_FRACTION`] of its chunks' bytes dead: copy the live ones out.
    Repack,
    /// Mostly live: leave it.
    Keep,
}

/// The fate of a pack with `live` and `dead` entries (`dead` not empty).
pub(crate) fn fate(live: &[PackEntry], dead: &[PackEntry]) -> Fate {
    let dead_bytes: u64 = dead.iter().map(|e| e.raw_len as u64).sum();
    let live_bytes: u64 = live.iter().map(|e| e.raw_len as u64).sum();
    if live.is_empty() {
        Fate::Delete
    } else if dead_bytes as f64 >= REPACK_DEAD_FRACTION * (dead_bytes + live_bytes) as f64 {
        Fate::Repack
    } else {
        Fate::Keep
    }
}

/// Split every durable pack's entries into live (marked) and dead, and decide each pack's
/// fate.
pub(crate) fn plan_sweep(idx: &Index, marked: &HashSet<ChunkId>) -> Sweep {
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
    let mut sweep = Sweep::default();
    for (no, (live, dead)) in per_pack {
        if dead.is_empty() {
            continue;
        }
        let slot = idx.slot(no).expect("slot of indexed chunk");
        let chunks: Vec<ChunkId> = live.iter().chain(&dead).map(|e| e.id).collect();
        let old = Doomed { pack: slot.id, size: slot.size, chunks };
        match fate(&live, &dead) {
            Fate::Keep => continue,
            Fate::Delete => {
                sweep.doomed_slots.push(no);
                sweep.doomed.push(old);
            }
            Fate::Repack => sweep.repack.push(Repack { pack: slot.id, live, old }),
        }
        sweep.dead_chunks += dead.len();
        sweep.dead.extend(dead.iter().map(|e| e.id));
    }
    sweep
}

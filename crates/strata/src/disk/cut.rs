//! Point-in-time cuts of open disks: exact snapshots and clones of a disk while it is served.
//!
//! A cut records what an open volume holds at one instant: its base map, its frozen and
//! active overlays and the log files they point into. It takes no I/O and copies nothing
//! (the overlays are shared `Arc`s; the next append copies the active one), so a cut fits
//! inside a guest's pause. A write is acknowledged only after its overlay insert, under the
//! state lock, so every write acknowledged before the cut is in the cut and none that starts
//! after it is. Log files are append-only and stay readable through their handles after a
//! compaction unlinks them, so a cut stays valid while the disk goes on being written and
//! compacted.
//!
//! [`Cut::fold`] then does what a compaction does, on the cut's layers: it assembles every
//! block the overlays touch, stores the blocks as chunks on all cores and writes the block
//! map, whose root is the disk's content at the cut. It commits no ref: the caller names
//! the result (a disk snapshot, a clone, or one disk of a desktop snapshot). [`cut_all`]
//! cuts several disks at one instant by holding all their append locks at once.
//!
//! [`store_blocks`] is the block assembler both folds share.

use super::extent::ExtentMap;
use super::volume::{fetch, plan, Volume};
use super::{block_codec, DiskMeta, Result};
use crate::id::ChunkId;
use crate::store::map;
use crate::store::pack::ChunkKind;
use crate::store::{Session, Store};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// An open disk's content at one instant (see the module comment).
pub struct Cut {
    name: String,
    meta: DiskMeta,
    store: Store,
    dir: PathBuf,
    base: Arc<Vec<ChunkId>>,
    /// Newest first: the active overlay, then the frozen one.
    layers: Vec<Arc<ExtentMap>>,
    files: HashMap<u32, Arc<File>>,
}

/// A cut folded into a block map: the root and the disk's description at the cut.
#[derive(Debug, Clone)]
pub struct Folded {
    /// The disk the cut was taken of.
    pub name: String,
    pub root: ChunkId,
    /// Size, block size and allocated blocks of the content; `parent` as the disk had it.
    pub meta: DiskMeta,
}

impl Volume {
    /// Cut this disk now (see the module comment).
    pub fn cut(&self) -> Result<Cut> {
        self.check_failed()?;
        let _appends = self.log.lock();
        Ok(self.cut_locked())
    }

    /// The cut, with the append lock held by the caller.
    fn cut_locked(&self) -> Cut {
        let st = self.state.read();
        let mut layers = vec![st.active.clone()];
        layers.extend(st.frozen.clone());
        Cut {
            name: self.name.clone(),
            meta: self.meta.clone(),
            store: self.store.clone(),
            dir: self.dir.clone(),
            base: st.base.clone(),
            layers,
            files: st.files.clone(),
        }
    }
}

/// Cut every volume at one instant: all their append locks are held together, taken in name
/// order (so two concurrent calls cannot deadlock), while the cuts are recorded. Returns the
/// cuts in the order of `vols`.
pub fn cut_all(vols: &[Arc<Volume>]) -> Result<Vec<Cut>> {
    let mut order: Vec<usize> = (0..vols.len()).collect();
    order.sort_by(|&a, &b| vols[a].name.cmp(&vols[b].name));
    order.dedup_by(|a, b| vols[*a].name == vols[*b].name);
    for v in vols {
        v.check_failed()?;
    }
    let guards: Vec<_> = order.iter().map(|&i| vols[i].log.lock()).collect();
    let cuts = vols.iter().map(|v| v.cut_locked()).collect();
    drop(guards);
    Ok(cuts)
}

impl Cut {
    /// The disk this is a cut of.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of log data the cut's overlays hold (what a fold reads from the log files).
    pub fn overlay_extents(&self) -> usize {
        self.layers.iter().map(|l| l.len()).sum()
    }

    /// Store the blocks the cut's overlays touch and write its block map (see the module
    /// comment). The chunks are durable when it returns, and `ses`'s (safe from this
    /// process's GC) until a ref names the root.
    pub fn fold(&self, ses: &Session) -> Result<Folded> {
        let bs = self.meta.block_size as u64;
        let maps: Vec<&ExtentMap> = self.layers.iter().map(|l| &**l).collect();
        let touched = touched_blocks(&maps, bs);
        let layers = Layers { maps: &maps, base: &self.base, files: &self.files };
        let counted = AtomicU64::new(0);
        let stored = store_blocks(
            &self.store,
            &self.dir,
            ses,
            &layers,
            (bs, self.meta.size),
            &touched,
            &counted,
            &|_, _| {},
        )?;
        let mut blocks = (*self.base).clone();
        for (b, id) in stored {
            blocks[b as usize] = id;
        }
        let root = map::write_map(ses, &blocks)?;
        // Durable before anyone names it: the caller may commit the ref from another process.
        self.store.flush()?;
        let mut meta = self.meta.clone();
        meta.log_folded = None;
        meta.allocated = Some(blocks.iter().filter(|b| !b.is_zero()).count() as u64);
        tracing::debug!(target: "strata::disk", disk = %self.name, blocks = touched.len(), root = %root, "cut folded");
        Ok(Folded { name: self.name.clone(), root, meta })
    }
}

/// Blocks any of `maps` touches, ascending, each once.
pub(super) fn touched_blocks(maps: &[&ExtentMap], bs: u64) -> Vec<u64> {
    let mut touched: Vec<u64> = Vec::new();
    for m in maps {
        let mut last: Option<u64> = None;
        for (off, len, _) in m.iter() {
            let (first, end) = (off / bs, (off + len).div_ceil(bs));
            let from = last.map_or(first, |l| first.max(l + 1));
            touched.extend(from..end);
            last = Some(end.saturating_sub(1).max(last.unwrap_or(0)));
        }
    }
    if maps.len() > 1 {
        touched.sort_unstable();
        touched.dedup();
    }
    touched
}

/// Where the bytes of a block come from: overlays (newest first) over the base map.
pub(super) struct Layers<'a> {
    pub maps: &'a [&'a ExtentMap],
    pub base: &'a [ChunkId],
    pub files: &'a HashMap<u32, Arc<File>>,
}

/// Assemble each block of `touched` from `layers` (`geometry` = block size, disk size), store
/// it as a chunk through `ses` (all-zero blocks become holes) and return `(block, id)` pairs.
/// Runs on up to 4 threads; `stored_bytes` counts the bytes of non-zero blocks and
/// `on_block(done, total)` is called after each block.
#[allow(clippy::too_many_arguments)]
pub(super) fn store_blocks(
    store: &Store,
    dir: &Path,
    ses: &Session,
    layers: &Layers,
    geometry: (u64, u64),
    touched: &[u64],
    stored_bytes: &AtomicU64,
    on_block: &(dyn Fn(u64, u64) + Sync),
) -> Result<Vec<(u64, ChunkId)>> {
    let (bs, size) = geometry;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).clamp(1, 4);
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let total = touched.len().max(1) as u64;
    let stop = AtomicBool::new(false);
    let parts: Vec<Result<Vec<(u64, ChunkId)>>> = std::thread::scope(|sc| {
        let work = || -> Result<Vec<(u64, ChunkId)>> {
            let mut out = Vec::new();
            let mut buf = vec![0u8; bs as usize];
            let mut pieces = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&b) = touched.get(i) else { break };
                let off = b * bs;
                let n = (size - off).min(bs);
                pieces.clear();
                let r = plan(layers.maps, layers.base, layers.files, bs, off, n, &mut pieces)
                    .and_then(|_| fetch(store, dir, off, &pieces, &mut buf[..n as usize]));
                if let Err(e) = r {
                    stop.store(true, Ordering::Relaxed);
                    return Err(e);
                }
                buf[n as usize..].fill(0);
                let id = if buf.iter().all(|&x| x == 0) {
                    ChunkId::ZERO
                } else {
                    stored_bytes.fetch_add(bs, Ordering::Relaxed);
                    let codec = block_codec(&buf, store.default_codec());
                    match ses.put_with(&buf, ChunkKind::Data, codec) {
                        Ok(id) => id,
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            return Err(e.into());
                        }
                    }
                };
                out.push((b, id));
                on_block(done.fetch_add(1, Ordering::Relaxed) as u64 + 1, total);
            }
            Ok(out)
        };
        let hs: Vec<_> = (1..threads).map(|_| sc.spawn(work)).collect();
        let mut all = vec![work()];
        all.extend(hs.into_iter().map(|h| h.join().expect("block assembler")));
        all
    });
    let mut out = Vec::with_capacity(touched.len());
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::extent::Src;

    #[test]
    fn touched_blocks_cover_every_layer_once() {
        let mut a = ExtentMap::new();
        a.insert(0, 10, Src::Zero);
        a.insert(65536 * 3 - 1, 2, Src::Zero);
        let mut b = ExtentMap::new();
        b.insert(65536 * 2, 65536 * 2, Src::Zero);
        assert_eq!(touched_blocks(&[&a], 65536), vec![0, 2, 3]);
        assert_eq!(touched_blocks(&[&a, &b], 65536), vec![0, 2, 3]);
        assert_eq!(touched_blocks(&[&b], 65536), vec![2, 3]);
        assert!(touched_blocks(&[], 65536).is_empty());
    }
}

//! Disks as NBD exports: the glue between `disk` and `nbd` that `strata serve` runs.
//!
//! Every writable disk is exported read-write under its name, every snapshot (`name@snap`)
//! read-only. All connections to one disk share one open `Volume`, so a flush on any
//! connection makes the writes of every connection durable (NBD multi-conn consistency): the
//! volume's group commit covers everything appended to its log before the flush began.
//! Volumes stay open while the server runs and are flushed and compacted on shutdown.
//!
//! With an SSD cache (a backend stack that can prefetch) and prefetch enabled
//! (`enable_prefetch`, the `strata serve` default),
//! opening a disk whose image has a recorded boot working set starts one background prefetch
//! of it per image (`boot::prefetch`), shared by all its clones; `close_all` stops them.

use crate::boot::prefetch::{Prefetch, PrefetchStatus};
use crate::boot::workset;
use crate::disk::{self, volume::Volume, DiskError};
use crate::nbd::{
    BlockSize, Export, ExportError, ExportInfo, ExportSet, Extent, Hangup, OpenError,
};
use crate::store::map;
use crate::store::slice::RangeRead;
use crate::store::Store;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

fn map_err(op: &'static str, offset: u64, e: DiskError) -> ExportError {
    match e {
        DiskError::OutOfRange { .. } => {
            ExportError::Invalid { op, offset, reason: "beyond the end of the disk".into() }
        }
        DiskError::ReadOnlySnapshot { .. } => ExportError::ReadOnly { op },
        DiskError::Io { source, .. } => ExportError::io(op, offset, source),
        DiskError::Store(crate::store::StoreError::Backend(b))
            if b.kind == crate::backend::ErrorKind::NoSpace =>
        {
            ExportError::NoSpace { op, offset }
        }
        other => {
            tracing::error!(target: "strata::serve", op, offset, error = %other, "I/O failed");
            ExportError::io(op, offset, std::io::Error::other(other.to_string()))
        }
    }
}

/// What every connection to one disk shares: once revoked (the disk was removed or reverted
/// with `--force`), every request fails with ESHUTDOWN and each connection's hangup has been
/// called, so the connections end even when their clients are idle.
#[derive(Default)]
pub struct Revocation {
    revoked: AtomicBool,
    hangups: Mutex<Vec<Weak<dyn Fn() + Send + Sync>>>,
}

impl Revocation {
    /// Refuse every request from now on and end the connections.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
        let hangups = std::mem::take(&mut *self.hangups.lock());
        for h in hangups.iter().filter_map(Weak::upgrade) {
            h();
        }
    }

    fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

/// A writable disk behind NBD (see [`Revocation`]).
pub struct VolumeExport {
    vol: Arc<Volume>,
    revoked: Arc<Revocation>,
}

impl VolumeExport {
    fn live(&self, op: &'static str) -> Result<&Volume, ExportError> {
        if self.revoked.is_revoked() {
            return Err(ExportError::Shutdown { op });
        }
        Ok(&self.vol)
    }
}

impl Export for VolumeExport {
    fn size(&self) -> u64 {
        self.vol.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.live("read")?.read(offset, buf).map_err(|e| map_err("read", offset, e))
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.live("write")?.write(offset, data, fua).map_err(|e| map_err("write", offset, e))
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.live("flush")?.flush().map_err(|e| map_err("flush", 0, e))
    }
    fn description(&self) -> Option<String> {
        Some(format!("strata disk {}", self.vol.name()))
    }
    fn can_trim(&self) -> bool {
        true
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.live("trim")?.trim(offset, len, fua).map_err(|e| map_err("trim", offset, e))
    }
    fn can_zero(&self) -> bool {
        true
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        _may_trim: bool,
        fua: bool,
    ) -> Result<(), ExportError> {
        // One small log record whatever the length: always fast.
        self.live("write_zeroes")?
            .write_zeroes(offset, len, fua)
            .map_err(|e| map_err("write_zeroes", offset, e))
    }
    fn can_multi_conn(&self) -> bool {
        true
    }
    fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, ExportError> {
        Ok(self
            .live("block_status")?
            .allocation(offset, len as u64)
            .into_iter()
            .map(|(l, alloc)| if alloc { Extent::data(l) } else { Extent::hole(l) })
            .collect())
    }
    fn block_size(&self) -> BlockSize {
        BlockSize { min: 1, preferred: 4096, max: 32 << 20 }
    }
    fn on_revoke(&self, hangup: &Hangup) {
        let mut hs = self.revoked.hangups.lock();
        if self.revoked.is_revoked() {
            drop(hs);
            hangup();
            return;
        }
        hs.retain(|h| h.strong_count() > 0);
        hs.push(Arc::downgrade(hangup));
    }
}

/// A snapshot behind NBD: read-only, straight from its block map.
pub struct SnapshotExport {
    store: Store,
    size: u64,
    block_size: u64,
    blocks: Vec<crate::id::ChunkId>,
    name: String,
}

impl Export for SnapshotExport {
    fn size(&self) -> u64 {
        self.size
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        if offset.checked_add(buf.len() as u64).is_none_or(|e| e > self.size) {
            return Err(ExportError::Invalid {
                op: "read",
                offset,
                reason: "beyond the end of the disk".into(),
            });
        }
        // The blocks of one read are fetched together (see `Store::read_ranges`).
        let mut reads = Vec::new();
        let mut rest: &mut [u8] = buf;
        let mut pos = offset;
        while !rest.is_empty() {
            let blk = (pos / self.block_size) as usize;
            let inb = pos % self.block_size;
            let n = (self.block_size - inb).min(rest.len() as u64) as usize;
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            pos += n as u64;
            let id = self.blocks.get(blk).copied().unwrap_or_default();
            if id.is_zero() {
                part.fill(0);
            } else {
                reads.push(RangeRead { id, offset: inb, buf: part });
            }
        }
        let got = self
            .store
            .read_ranges(&mut reads)
            .map_err(|e| map_err("read", offset, DiskError::Store(e)))?;
        for (r, n) in reads.into_iter().zip(got) {
            r.buf[n..].fill(0);
        }
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
        Err(ExportError::ReadOnly { op: "write" })
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn is_read_only(&self) -> bool {
        true
    }
    fn description(&self) -> Option<String> {
        Some(format!("strata snapshot {} (read-only)", self.name))
    }
    fn can_multi_conn(&self) -> bool {
        true
    }
    fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, ExportError> {
        let mut out: Vec<Extent> = Vec::new();
        let end = (offset + len as u64).min(self.size);
        let mut cur = offset;
        while cur < end {
            let blk = cur / self.block_size;
            let e = ((blk + 1) * self.block_size).min(end);
            let alloc = self.blocks.get(blk as usize).is_some_and(|id| !id.is_zero());
            let ext = if alloc { Extent::data(e - cur) } else { Extent::hole(e - cur) };
            match out.last_mut() {
                Some(last) if last.hole == ext.hole => last.len += ext.len,
                _ => out.push(ext),
            }
            cur = e;
        }
        Ok(out)
    }
}

/// The store's disks as a set of NBD exports.
pub struct DiskExports {
    store: Store,
    open: Mutex<HashMap<String, Held>>,
    opening: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    compact_at: std::sync::atomic::AtomicU64,
    prefetch: Arc<Mutex<PrefetchState>>,
}

/// Boot prefetches: batches in flight per prefetch (None: prefetch off), the names already
/// looked up, the prefetch per image.
#[derive(Default)]
struct PrefetchState {
    parallel: Option<usize>,
    checked: HashSet<String>,
    by_image: HashMap<String, Arc<Prefetch>>,
    lookups: Vec<std::thread::JoinHandle<()>>,
}

/// Walk up from `name` (itself, then the image it was cloned or snapshotted from) to the first
/// image with a working set, and start its prefetch unless one of the images on the way is
/// being prefetched already.
fn start_prefetch(store: &Store, state: &Mutex<PrefetchState>, name: &str) {
    let mut cur = name.to_string();
    for _ in 0..16 {
        if state.lock().by_image.contains_key(&cur) {
            return;
        }
        let ws = match workset::load(store, &cur) {
            Ok(ws) => ws,
            Err(e) => {
                tracing::warn!(target: "strata::serve", name = %cur, error = %e, "cannot read the boot working set; no prefetch");
                return;
            }
        };
        if let Some(ws) = ws {
            let mut st = state.lock();
            let Some(parallel) = st.parallel else { return };
            st.by_image
                .entry(cur)
                .or_insert_with_key(|cur| Prefetch::start(store, cur, &ws, parallel));
            return;
        }
        match disk::load(store, &cur) {
            Ok((_, m)) => match m.parent.or(m.snapshot_of) {
                Some(p) => cur = p,
                None => return,
            },
            Err(e) => {
                tracing::warn!(target: "strata::serve", name = %cur, error = %e, "cannot follow the parent chain; no prefetch");
                return;
            }
        }
    }
}

impl DiskExports {
    pub fn new(store: Store) -> Arc<DiskExports> {
        Arc::new(DiskExports {
            store,
            open: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
            compact_at: std::sync::atomic::AtomicU64::new(crate::disk::volume::DEFAULT_COMPACT_AT),
            prefetch: Arc::new(Mutex::new(PrefetchState::default())),
        })
    }

    /// From now on, opening a disk whose image has a recorded boot working set starts a
    /// background prefetch of it into the cache of the store's backend stack (once per image),
    /// `parallel` batches at a time. Returns false, and changes nothing, when the stack cannot
    /// prefetch (no cache).
    pub fn enable_prefetch(&self, parallel: usize) -> bool {
        let can = self.store.backend().can_prefetch();
        if can {
            self.prefetch.lock().parallel = Some(parallel);
        }
        can
    }

    /// The prefetches started so far (image, progress).
    pub fn prefetches(&self) -> Vec<PrefetchStatus> {
        let mut v: Vec<PrefetchStatus> =
            self.prefetch.lock().by_image.values().map(|p| p.status()).collect();
        v.sort_by(|a, b| a.image.cmp(&b.image));
        v
    }

    /// The prefetch of `image`'s working set, if one was started.
    pub fn prefetch_of(&self, image: &str) -> Option<Arc<Prefetch>> {
        self.prefetch.lock().by_image.get(image).cloned()
    }

    /// Start the prefetch of `name`'s image's working set unless it runs already (or there is
    /// no cache, no working set, or `name` was looked up before). The lookup reads from the
    /// backend, so it runs on its own thread: opening a disk never waits for it.
    fn maybe_prefetch(&self, name: &str) {
        let mut st = self.prefetch.lock();
        if st.parallel.is_none() || !st.checked.insert(name.to_string()) {
            return;
        }
        let (store, state, name) = (self.store.clone(), self.prefetch.clone(), name.to_string());
        match std::thread::Builder::new()
            .name("strata-bootset".into())
            .spawn(move || start_prefetch(&store, &state, &name))
        {
            Ok(h) => st.lookups.push(h),
            Err(e) => {
                tracing::warn!(target: "strata::serve", error = %e, "cannot start the boot working set lookup")
            }
        }
    }

    /// Wait until the working set lookups of the disks opened so far have ended (each has
    /// started its prefetch, found one running, or found no working set).
    pub fn wait_prefetch_lookups(&self) {
        let lookups = std::mem::take(&mut self.prefetch.lock().lookups);
        for h in lookups {
            let _ = h.join();
        }
    }

    /// Stop every prefetch (after its batches in flight) and wait for it.
    pub fn stop_prefetch(&self) {
        let lookups = {
            let mut st = self.prefetch.lock();
            st.parallel = None;
            std::mem::take(&mut st.lookups)
        };
        for h in lookups {
            let _ = h.join();
        }
        let ps: Vec<Arc<Prefetch>> = self.prefetch.lock().by_image.values().cloned().collect();
        for p in ps {
            p.stop();
        }
    }

    /// Log size at which volumes opened from now on start a background compaction.
    pub fn set_compact_at(&self, bytes: u64) {
        self.compact_at.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The open volume of a disk, if a client has opened it.
    pub fn volume(&self, name: &str) -> Option<Arc<Volume>> {
        self.open.lock().get(name).map(|h| h.vol.clone())
    }

    /// Stop the boot prefetches, then flush and compact every open volume (on shutdown).
    pub fn close_all(&self) -> Result<(), DiskError> {
        self.stop_prefetch();
        let vols: Vec<Arc<Volume>> = self.open.lock().drain().map(|(_, h)| h.vol).collect();
        for v in vols {
            v.close()?;
        }
        Ok(())
    }
}

impl ExportSet for DiskExports {
    fn list(&self) -> Vec<ExportInfo> {
        match disk::list(&self.store) {
            Ok(l) => l
                .into_iter()
                .map(|d| ExportInfo {
                    description: Some(if d.snapshot_of.is_some() {
                        "strata snapshot (read-only)".into()
                    } else {
                        "strata disk".into()
                    }),
                    name: d.name,
                })
                .collect(),
            Err(e) => {
                tracing::error!(target: "strata::serve", error = %e, "cannot list disks");
                vec![]
            }
        }
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, OpenError> {
        let unavailable = |e: DiskError| match e {
            DiskError::NotFound { .. } => OpenError::NotFound { name: name.into() },
            other => OpenError::Unavailable { name: name.into(), reason: other.to_string() },
        };
        let (r, m) = disk::load(&self.store, name).map_err(unavailable)?;
        self.maybe_prefetch(name);
        if m.snapshot_of.is_some() {
            let blocks = map::read_map(&self.store, &r.roots[0])
                .map_err(|e| unavailable(DiskError::Store(e)))?;
            return Ok(Arc::new(SnapshotExport {
                store: self.store.clone(),
                size: m.size,
                block_size: m.block_size as u64,
                blocks,
                name: name.into(),
            }));
        }
        let h = self.hold(name).map_err(unavailable)?;
        Ok(Arc::new(VolumeExport { vol: h.vol, revoked: h.revoked }))
    }
}

mod ops;
use ops::Held;

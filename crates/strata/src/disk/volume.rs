//! A writable disk: the base block map from the store, overlaid by the write log.
//!
//! Reads take each byte from the newest source: the log overlay (an extent map into the log
//! file), else the base map's chunk (decompressed and verified once, then served from a small
//! block cache), else zeros. Writes append one log record and update the overlay under the
//! append lock, so the overlay and the log agree on order. Flush is group commit: the first
//! flusher `fdatasync`s the log, and flushes that arrive meanwhile wait for it and return if it
//! covered their writes; each guest flush costs at most one host fdatasync, and
//! `stats().fdatasyncs` counts them.
//!
//! Compaction folds the overlay into the base: for every block the log touched, the block is
//! assembled (base + overlay) and stored as a chunk, the new map is committed as the disk's ref
//! (generation G+1), then a fresh log whose header says "applies on G+1" replaces the old one.
//! Recovery keeps only logs whose base generation equals the ref's, so a crash between the
//! commit and the log switch cannot apply old records twice. Compaction currently holds the
//! append lock, so writes wait while it runs (see docs/disks.md for its cost).

use super::extent::{ExtentMap, Src};
use super::log::{self, LogError, LogHeader, LogWriter, RecKind};
use super::{map, ref_name, DiskError, DiskMeta, Result};
use crate::id::ChunkId;
use crate::store::objects::Ref;
use crate::store::pack::ChunkKind;
use crate::store::Store;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes of decompressed base blocks kept per volume.
const CACHE_BYTES: usize = 256 << 20;
/// Compact automatically when the log grows past this.
pub const DEFAULT_COMPACT_AT: u64 = 1 << 30;

#[derive(Default, Debug, serde::Serialize)]
pub struct VolumeStats {
    pub writes: AtomicU64,
    pub guest_bytes_written: AtomicU64,
    pub log_bytes_written: AtomicU64,
    pub flushes: AtomicU64,
    pub fdatasyncs: AtomicU64,
    pub compactions: AtomicU64,
    pub compaction_bytes: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
}

struct State {
    generation: u64,
    base: Vec<ChunkId>,
    overlay: ExtentMap,
}

struct SyncState {
    synced_seq: u64,
    syncing: bool,
}

struct BlockCache {
    map: HashMap<ChunkId, Arc<Vec<u8>>>,
    order: VecDeque<ChunkId>,
    bytes: usize,
}

pub struct Volume {
    store: Store,
    name: String,
    meta: DiskMeta,
    dir: PathBuf,
    state: RwLock<State>,
    log: Mutex<LogWriter>,
    log_id: AtomicU64,
    /// Records appended over the volume's life (across log files); flush targets count these.
    appended: AtomicU64,
    /// Read handles of log files, by log id.
    files: RwLock<HashMap<u32, Arc<File>>>,
    sync: Mutex<SyncState>,
    sync_cv: Condvar,
    cache: Mutex<BlockCache>,
    failed: Mutex<Option<String>>,
    _lock: File,
    _lease: Option<crate::store::lease::LeaseGuard>,
    compact_at: AtomicU64,
    stats: VolumeStats,
    sync_hook: RwLock<Option<SyncHook>>,
}

/// What a [`SyncHook`] is told about.
#[derive(Debug, Clone)]
pub enum SyncEvent {
    /// The log at this path is about to be fdatasync'ed; an error fails the sync.
    LogSync(PathBuf),
    /// A new, empty log was created (durably) at this path.
    LogCreated(PathBuf),
}

/// Test seam for crash harnesses: observes (and may fail) the volume's durability points.
pub type SyncHook = Arc<dyn Fn(&SyncEvent) -> std::io::Result<()> + Send + Sync>;

fn io_err(op: &'static str, path: &std::path::Path, e: std::io::Error) -> DiskError {
    DiskError::Io { op, path: path.to_path_buf(), source: e }
}

impl From<LogError> for DiskError {
    fn from(e: LogError) -> DiskError {
        match e {
            LogError::Io { op, path, source } => DiskError::Io { op, path, source },
            other => DiskError::Log(other.to_string()),
        }
    }
}

impl Volume {
    /// Open disk `name` for writing: take its lock, load its map, replay its log.
    pub fn open(store: &Store, name: &str) -> Result<Arc<Volume>> {
        let (r, meta) = super::load(store, name)?;
        if meta.snapshot_of.is_some() {
            return Err(DiskError::ReadOnlySnapshot { name: name.into() });
        }
        let disk_id = meta.id.clone().ok_or_else(|| DiskError::Log(format!("disk '{name}' has no id")))?;
        let dir = store.local_dir().join("disks").join(&disk_id);
        std::fs::create_dir_all(&dir).map_err(|e| io_err("create", &dir, e))?;
        let lock_path = dir.join("lock");
        let lock = File::create(&lock_path).map_err(|e| io_err("create", &lock_path, e))?;
        // SAFETY: flock on a valid fd.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(DiskError::InUse { name: name.into() });
        }
        // The writer lease: no other host (or process) writes this disk while we hold it.
        let lease = store.lease_if_needed(&super::ref_name(name))?;
        let base = map::read_map(store, &r.roots[0])?;
        let mut id_bytes = [0u8; 16];
        hex::decode_to_slice(&disk_id, &mut id_bytes).map_err(|_| DiskError::Log(format!("disk '{name}' has a bad id")))?;

        // Logs: keep the one that applies on the current generation; older ones were compacted.
        let mut logs: Vec<(u64, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(|e| io_err("list", &dir, e))?.flatten() {
            let fname = e.file_name().to_string_lossy().into_owned();
            if let Some(seq) = fname.strip_prefix("log.").and_then(|s| s.parse::<u64>().ok()) {
                logs.push((seq, e.path()));
            }
        }
        logs.sort();
        let mut overlay = ExtentMap::new();
        let mut current: Option<LogWriter> = None;
        let mut next_file = 1;
        for (seq, path) in logs {
            next_file = next_file.max(seq + 1);
            let (w, recs) = LogWriter::recover(&path)?;
            if w.header.base_generation < r.generation {
                tracing::info!(target: "strata::disk", path = %path.display(), "removing log already folded into the base");
                drop(w);
                std::fs::remove_file(&path).map_err(|e| io_err("remove", &path, e))?;
                continue;
            }
            if w.header.base_generation > r.generation || w.header.disk_id != id_bytes || current.is_some() {
                return Err(DiskError::Log(format!(
                    "log {} does not belong on generation {} of disk '{name}'; move it aside and reopen",
                    path.display(),
                    r.generation
                )));
            }
            for rec in &recs {
                let src = match rec.kind {
                    RecKind::Write => Src::Log { log: seq as u32, pos: rec.data_pos },
                    RecKind::Zero | RecKind::Trim => Src::Zero,
                };
                overlay.insert(rec.offset, rec.len, src);
            }
            current = Some(w);
        }
        let w = match current {
            Some(w) => w,
            None => LogWriter::create(
                &dir.join(format!("log.{next_file}")),
                LogHeader { disk_id: id_bytes, base_generation: r.generation, file_seq: next_file },
            )?,
        };
        let log_id = w.header.file_seq;
        let mut files = HashMap::new();
        files.insert(log_id as u32, Arc::new(w.file_handle()?));
        let synced = 0;
        Ok(Arc::new(Volume {
            store: store.clone(),
            name: name.into(),
            meta,
            dir,
            state: RwLock::new(State { generation: r.generation, base, overlay }),
            log: Mutex::new(w),
            log_id: AtomicU64::new(log_id),
            appended: AtomicU64::new(0),
            files: RwLock::new(files),
            sync: Mutex::new(SyncState { synced_seq: synced, syncing: false }),
            sync_cv: Condvar::new(),
            cache: Mutex::new(BlockCache { map: HashMap::new(), order: VecDeque::new(), bytes: 0 }),
            failed: Mutex::new(None),
            _lock: lock,
            _lease: lease,
            compact_at: AtomicU64::new(DEFAULT_COMPACT_AT),
            stats: VolumeStats::default(),
            sync_hook: RwLock::new(None),
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn size(&self) -> u64 {
        self.meta.size
    }
    pub fn block_size(&self) -> u32 {
        self.meta.block_size
    }
    pub fn stats(&self) -> &VolumeStats {
        &self.stats
    }

    /// Compact automatically once the log passes this many bytes.
    pub fn set_compact_at(&self, bytes: u64) {
        self.compact_at.store(bytes, Ordering::Relaxed);
    }

    /// Install a hook on the volume's durability points (crash tests).
    pub fn set_sync_hook(&self, hook: SyncHook) {
        *self.sync_hook.write() = Some(hook);
    }

    fn hook(&self, ev: SyncEvent) -> std::io::Result<()> {
        match &*self.sync_hook.read() {
            Some(h) => h(&ev),
            None => Ok(()),
        }
    }

    fn check_failed(&self) -> Result<()> {
        match &*self.failed.lock() {
            Some(why) => Err(DiskError::Failed { name: self.name.clone(), reason: why.clone() }),
            None => Ok(()),
        }
    }

    fn bounds(&self, op: &'static str, off: u64, len: u64) -> Result<()> {
        if off.checked_add(len).is_none_or(|e| e > self.meta.size) {
            return Err(DiskError::OutOfRange { op, offset: off, len, size: self.meta.size });
        }
        Ok(())
    }

    /// A verified, decompressed base block.
    fn block(&self, id: &ChunkId) -> Result<Arc<Vec<u8>>> {
        if let Some(b) = self.cache.lock().map.get(id).cloned() {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(b);
        }
        self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        let data = Arc::new(self.store.get(id)?);
        let mut c = self.cache.lock();
        if c.map.insert(*id, data.clone()).is_none() {
            c.order.push_back(*id);
            c.bytes += data.len();
            while c.bytes > CACHE_BYTES {
                let Some(old) = c.order.pop_front() else { break };
                if let Some(v) = c.map.remove(&old) {
                    c.bytes -= v.len();
                }
            }
        }
        Ok(data)
    }

    /// Fill `buf` from the base map at `off`.
    fn read_base(&self, base: &[ChunkId], off: u64, buf: &mut [u8]) -> Result<()> {
        let bs = self.meta.block_size as u64;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = off + done as u64;
            let blk = (pos / bs) as usize;
            let in_blk = (pos % bs) as usize;
            let n = (bs as usize - in_blk).min(buf.len() - done);
            let id = base.get(blk).copied().unwrap_or(ChunkId::ZERO);
            if id.is_zero() {
                buf[done..done + n].fill(0);
            } else {
                let b = self.block(&id)?;
                let avail = b.len().saturating_sub(in_blk).min(n);
                buf[done..done + avail].copy_from_slice(&b[in_blk..in_blk + avail]);
                buf[done + avail..done + n].fill(0);
            }
            done += n;
        }
        Ok(())
    }

    pub fn read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        self.bounds("read", off, buf.len() as u64)?;
        let st = self.state.read();
        for (p, len, src) in st.overlay.lookup(off, buf.len() as u64) {
            let b = &mut buf[(p - off) as usize..(p - off + len) as usize];
            match src {
                None => self.read_base(&st.base, p, b)?,
                Some(Src::Zero) => b.fill(0),
                Some(Src::Log { log, pos }) => {
                    let f = self.files.read().get(&log).cloned().ok_or_else(|| DiskError::Log(format!("log {log} is not open")))?;
                    log::read_at(&f, pos, b).map_err(|e| io_err("read", &self.dir, e))?;
                }
            }
        }
        Ok(())
    }

    fn append(&self, kind: RecKind, off: u64, len: u64, data: &[u8]) -> Result<()> {
        self.check_failed()?;
        self.bounds(kind_name(kind), off, len)?;
        let grown = {
            let mut w = self.log.lock();
            let rec = w.append(kind, off, len, data)?;
            let src = match kind {
                RecKind::Write => Src::Log { log: self.log_id.load(Ordering::Relaxed) as u32, pos: rec.data_pos },
                _ => Src::Zero,
            };
            self.state.write().overlay.insert(off, len, src);
            self.appended.fetch_add(1, Ordering::Release);
            self.stats.log_bytes_written.fetch_add(log::REC_HEADER_LEN + data.len() as u64, Ordering::Relaxed);
            w.pos
        };
        if kind == RecKind::Write {
            self.stats.writes.fetch_add(1, Ordering::Relaxed);
            self.stats.guest_bytes_written.fetch_add(len, Ordering::Relaxed);
        }
        if grown > self.compact_at.load(Ordering::Relaxed) {
            self.flush()?;
            self.compact()?;
        }
        Ok(())
    }

    pub fn write(&self, off: u64, data: &[u8], fua: bool) -> Result<()> {
        self.append(RecKind::Write, off, data.len() as u64, data)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    pub fn write_zeroes(&self, off: u64, len: u64, fua: bool) -> Result<()> {
        self.append(RecKind::Zero, off, len, &[])?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    pub fn trim(&self, off: u64, len: u64, fua: bool) -> Result<()> {
        self.append(RecKind::Trim, off, len, &[])?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Make every completed write durable: at most one fdatasync, shared by concurrent callers.
    pub fn flush(&self) -> Result<()> {
        self.check_failed()?;
        self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        let target = {
            let _w = self.log.lock();
            self.appended.load(Ordering::Acquire)
        };
        let mut s = self.sync.lock();
        loop {
            if s.synced_seq >= target {
                return Ok(());
            }
            if !s.syncing {
                s.syncing = true;
                drop(s);
                let (upto, file, path) = {
                    let w = self.log.lock();
                    (self.appended.load(Ordering::Acquire), w.file_handle(), w.path.clone())
                };
                let res = file.map_err(DiskError::from).and_then(|f| {
                    self.hook(SyncEvent::LogSync(path.clone())).map_err(|e| io_err("fdatasync", &path, e))?;
                    self.stats.fdatasyncs.fetch_add(1, Ordering::Relaxed);
                    f.sync_data().map_err(|e| io_err("fdatasync", &path, e))
                });
                s = self.sync.lock();
                s.syncing = false;
                self.sync_cv.notify_all();
                if let Err(e) = res {
                    // After a failed fdatasync the page cache may hold data that never reaches
                    // the disk; refuse everything until the disk is reopened.
                    *self.failed.lock() = Some(e.to_string());
                    return Err(e);
                }
                s.synced_seq = s.synced_seq.max(upto);
            } else {
                self.sync_cv.wait(&mut s);
            }
        }
    }

    /// Fold the log into the base map and start a new log. Returns the new generation.
    pub fn compact(&self) -> Result<u64> {
        let r = self.compact_inner();
        if let Err(e) = &r {
            // The base and the log may now disagree about which is current; reopening resolves
            // it from the ref generation, so refuse I/O until then.
            *self.failed.lock() = Some(format!("compaction failed: {e}"));
        }
        r
    }

    fn compact_inner(&self) -> Result<u64> {
        self.check_failed()?;
        let mut w = self.log.lock();
        let (gen, root) = {
            let st = self.state.read();
            if st.overlay.is_empty() {
                return Ok(st.generation);
            }
            let bs = self.meta.block_size as u64;
            let mut touched = HashSet::new();
            for (off, len, _) in st.overlay.iter() {
                for b in off / bs..(off + len).div_ceil(bs) {
                    touched.insert(b);
                }
            }
            let mut touched: Vec<u64> = touched.into_iter().collect();
            touched.sort_unstable();
            drop(st);
            let ses = self.store.session();
            let mut new_base = self.state.read().base.clone();
            let mut buf = vec![0u8; bs as usize];
            for b in touched {
                let off = b * bs;
                let n = (self.meta.size - off).min(bs) as usize;
                self.read(off, &mut buf[..n])?;
                buf[n..].fill(0);
                let id = if buf.iter().all(|&x| x == 0) {
                    ChunkId::ZERO
                } else {
                    self.stats.compaction_bytes.fetch_add(bs, Ordering::Relaxed);
                    ses.put(&buf, ChunkKind::Data)?
                };
                new_base[b as usize] = id;
            }
            let root = map::write_map(&ses, &new_base)?;
            let payload = serde_json::to_vec(&self.meta).expect("json");
            ses.commit_ref(&ref_name(&self.name), Ref::new(vec![root], payload))?;
            let gen = self.store.get_ref(&ref_name(&self.name))?.map(|r| r.generation).unwrap_or(0);
            self.state.write().base = new_base;
            (gen, root)
        };
        // Switch to a fresh log that applies on the new generation, then drop the old one.
        let next = w.header.file_seq + 1;
        let nw = LogWriter::create(
            &self.dir.join(format!("log.{next}")),
            LogHeader { disk_id: w.header.disk_id, base_generation: gen, file_seq: next },
        )?;
        let _ = self.hook(SyncEvent::LogCreated(nw.path.clone()));
        let old_path = w.path.clone();
        let old_id = w.header.file_seq as u32;
        self.files.write().insert(next as u32, Arc::new(nw.file_handle()?));
        {
            let mut st = self.state.write();
            st.generation = gen;
            st.overlay = ExtentMap::new();
        }
        *w = nw;
        self.log_id.store(next, Ordering::Relaxed);
        {
            // Everything appended so far is in the committed base now.
            let mut s = self.sync.lock();
            s.synced_seq = s.synced_seq.max(self.appended.load(Ordering::Acquire));
        }
        self.files.write().remove(&old_id);
        std::fs::remove_file(&old_path).map_err(|e| io_err("remove", &old_path, e))?;
        self.stats.compactions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(target: "strata::disk", disk = %self.name, generation = gen, root = %root, "compacted");
        Ok(gen)
    }

    /// Block status for NBD: (length, allocated) runs over [off, off+len).
    pub fn allocation(&self, off: u64, len: u64) -> Vec<(u64, bool)> {
        let st = self.state.read();
        let bs = self.meta.block_size as u64;
        let mut out: Vec<(u64, bool)> = Vec::new();
        let mut push = |l: u64, a: bool| match out.last_mut() {
            Some((pl, pa)) if *pa == a => *pl += l,
            _ => out.push((l, a)),
        };
        for (p, l, src) in st.overlay.lookup(off, len) {
            match src {
                Some(Src::Log { .. }) => push(l, true),
                Some(Src::Zero) => push(l, false),
                None => {
                    let mut cur = p;
                    while cur < p + l {
                        let blk = cur / bs;
                        let end = ((blk + 1) * bs).min(p + l);
                        let alloc = st.base.get(blk as usize).is_some_and(|id| !id.is_zero());
                        push(end - cur, alloc);
                        cur = end;
                    }
                }
            }
        }
        out
    }

    /// Flush and fold the log into the base (e.g. before a snapshot or on shutdown).
    pub fn close(&self) -> Result<()> {
        self.flush()?;
        self.compact()?;
        Ok(())
    }
}

fn kind_name(k: RecKind) -> &'static str {
    match k {
        RecKind::Write => "write",
        RecKind::Zero => "write_zeroes",
        RecKind::Trim => "trim",
    }
}

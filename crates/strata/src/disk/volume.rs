//! A writable disk: the base block map from the store, overlaid by the write log.
//!
//! Reads take each byte from the newest source: the active log's overlay (an extent map into
//! the log file), else the frozen log's overlay while a compaction folds it, else the base
//! map's chunk (read through the store's verified range reads, `store/slice.rs`), else zeros.
//! A read plans its pieces under the state lock and does its I/O after releasing it: log
//! files are append-only and chunks are immutable, so a plan stays valid while writes and
//! compactions go on (an unlinked log stays readable through its open handle).
//!
//! Writes append one log record and update the overlay under the append lock, so the overlay
//! and the log agree on order. Flush is group commit: the first flusher `fdatasync`s the log,
//! and flushes that arrive meanwhile wait for it and return if it covered their writes; each
//! guest flush costs one host fdatasync (two for the first flush after the log rolled over to a
//! new file while the old one is still being folded, see `compact.rs`), and
//! `stats().fdatasyncs` counts them.
//!
//! Compaction (`compact.rs`) folds a frozen log file into the base in the background while
//! writes go on into the next file.

use super::extent::{ExtentMap, Src};
use super::log::{self, LogError, LogHeader, LogWriter, RecKind};
use super::{DiskError, DiskMeta, Result};
use crate::endian;
use crate::id::ChunkId;
use crate::store::map;
use crate::store::slice::RangeRead;
use crate::store::Store;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Compact automatically when the log grows past this.
pub(crate) const DEFAULT_COMPACT_AT: u64 = 1 << 30;

#[derive(Default, Debug, serde::Serialize)]
pub struct VolumeStats {
    pub writes: AtomicU64,
    pub guest_bytes_written: AtomicU64,
    pub log_bytes_written: AtomicU64,
    pub flushes: AtomicU64,
    pub fdatasyncs: AtomicU64,
    pub compactions: AtomicU64,
    pub compaction_bytes: AtomicU64,
    /// Times a writer waited because the log was twice the threshold while a compaction ran.
    pub compaction_waits: AtomicU64,
}

pub(super) struct State {
    pub generation: u64,
    pub base: Arc<Vec<ChunkId>>,
    /// Writes in the active log file. Shared with the cuts taken of it (`cut.rs`): the next
    /// append after a cut copies it (`Arc::make_mut`), so a cut costs no copy of its own.
    pub active: Arc<ExtentMap>,
    /// Writes in the frozen log file(s) a compaction is folding into the base.
    pub frozen: Option<Arc<ExtentMap>>,
    /// Read handles of the log files the overlays point into, by file number.
    pub files: HashMap<u32, Arc<File>>,
}

/// A log file that no longer takes appends and is not yet folded into the base.
pub(super) struct FrozenLog {
    pub seq: u64,
    pub file: Arc<File>,
    pub path: PathBuf,
    /// Whether a flush has made all its records durable.
    pub synced: bool,
}

struct SyncState {
    synced_seq: u64,
    syncing: bool,
}

pub(super) struct CompactState {
    pub running: bool,
    /// Folds finished (or failed) so far: a writer held back by one waits for this to move,
    /// not for `running` to clear, which another writer may set again first.
    pub finished: u64,
    /// Explicit `compact()` calls waiting for the running fold: writers start no background
    /// fold meanwhile, so a snapshot under a write storm is not held back fold after fold.
    pub explicit: u32,
    pub thread: Option<std::thread::JoinHandle<()>>,
}

pub struct Volume {
    pub(super) store: Store,
    pub(super) name: String,
    pub(super) meta: DiskMeta,
    pub(super) dir: PathBuf,
    pub(super) me: Weak<Volume>,
    pub(super) state: RwLock<State>,
    pub(super) log: Mutex<LogWriter>,
    /// Records appended over the volume's life (across log files); flush targets count these.
    pub(super) appended: AtomicU64,
    pub(super) frozen_log: Mutex<Option<FrozenLog>>,
    sync: Mutex<SyncState>,
    sync_cv: Condvar,
    pub(super) compaction: Mutex<CompactState>,
    pub(super) compaction_cv: Condvar,
    /// How far the running fold is through its blocks, in 1/65536ths: paces writers once the
    /// active log passes the threshold (`compact.rs`).
    pub(super) fold_progress: AtomicU64,
    pub(super) failed: Mutex<Option<String>>,
    _lock: File,
    _lease: Option<crate::store::lease::LeaseGuard>,
    pub(super) compact_at: AtomicU64,
    pub(super) stats: VolumeStats,
    sync_hook: RwLock<Option<SyncHook>>,
}

/// What a [`SyncHook`] is told about.
#[derive(Debug, Clone)]
pub enum SyncEvent {
    /// The log at this path is about to be fdatasync'ed; an error fails the sync.
    LogSync(PathBuf),
    /// A new, empty log was created (durably) at this path.
    LogCreated(PathBuf),
    /// A compaction is about to fold the (frozen) log at this path into the base; an error
    /// fails the compaction.
    FoldStart(PathBuf),
}

/// Test seam for crash harnesses: observes (and may fail) the volume's durability points.
pub type SyncHook = Arc<dyn Fn(&SyncEvent) -> std::io::Result<()> + Send + Sync>;

pub(super) fn io_err(op: &'static str, path: &std::path::Path, e: std::io::Error) -> DiskError {
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

/// Where a piece of a read comes from.
pub(super) enum Piece {
    Zero,
    Log(Arc<File>, u64),
    /// A base chunk, from this offset in it.
    Chunk(ChunkId, u64),
}

/// The pieces of `[off, off + len)`: from the first layer that has each byte, else the base.
pub(super) fn plan(
    layers: &[&ExtentMap],
    base: &[ChunkId],
    files: &HashMap<u32, Arc<File>>,
    bs: u64,
    off: u64,
    len: u64,
    out: &mut Vec<(u64, u64, Piece)>,
) -> Result<()> {
    let Some((top, rest)) = layers.split_first() else {
        let mut cur = off;
        while cur < off + len {
            let blk = cur / bs;
            let end = ((blk + 1) * bs).min(off + len);
            let id = base.get(blk as usize).copied().unwrap_or(ChunkId::ZERO);
            let piece = if id.is_zero() { Piece::Zero } else { Piece::Chunk(id, cur - blk * bs) };
            out.push((cur, end - cur, piece));
            cur = end;
        }
        return Ok(());
    };
    for (p, l, src) in top.lookup(off, len) {
        match src {
            None => plan(rest, base, files, bs, p, l, out)?,
            Some(Src::Zero) => out.push((p, l, Piece::Zero)),
            Some(Src::Log { log, pos }) => {
                let f = files
                    .get(&log)
                    .cloned()
                    .ok_or_else(|| DiskError::Log(format!("log {log} is not open")))?;
                out.push((p, l, Piece::Log(f, pos)));
            }
        }
    }
    Ok(())
}

/// Fill `buf` (which starts at disk offset `off`) from planned pieces. The base chunks of
/// one read are fetched together (`Store::read_ranges`): adjacent frames of a pack become one
/// backend request, and different packs are read concurrently.
pub(super) fn fetch(
    store: &Store,
    dir: &std::path::Path,
    off: u64,
    pieces: &[(u64, u64, Piece)],
    buf: &mut [u8],
) -> Result<()> {
    let mut order: Vec<&(u64, u64, Piece)> = pieces.iter().collect();
    order.sort_by_key(|(p, _, _)| *p);
    let mut reads = Vec::new();
    let mut rest: &mut [u8] = buf;
    let mut at = off;
    for (p, l, piece) in order {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((p - at) as usize);
        let (b, tail) = tail.split_at_mut(*l as usize);
        rest = tail;
        at = p + l;
        match piece {
            Piece::Zero => b.fill(0),
            Piece::Log(f, pos) => log::read_at(f, *pos, b).map_err(|e| io_err("read", dir, e))?,
            Piece::Chunk(id, o) => reads.push(RangeRead { id: *id, offset: *o, buf: b }),
        }
    }
    let got = store.read_ranges(&mut reads)?;
    for (r, n) in reads.into_iter().zip(got) {
        r.buf[n..].fill(0);
    }
    Ok(())
}

/// Does disk `name` have log records not yet folded into its ref on this host? If not, its
/// ref alone is its content and snapshot/clone need not open it (which loads the whole map).
/// Takes and releases what `Volume::open` would: the disk's lock (an error if it is being
/// served) and its writer lease (an error if another host writes it). Errs towards yes.
pub(super) fn has_unfolded_log(store: &Store, name: &str, meta: &DiskMeta) -> Result<bool> {
    let Some(id) = &meta.id else { return Ok(true) };
    let dir = store.local_dir().join("disks").join(id);
    let _lease = store.lease_if_needed(&super::ref_name(name))?;
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err("list", &dir, e)),
    };
    let lock_path = dir.join("lock");
    if let Ok(lock) = File::open(&lock_path) {
        // SAFETY: flock on a valid fd; released when `lock` is dropped.
        if unsafe {
            libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB)
        } != 0
        {
            return Err(DiskError::InUse { name: name.into() });
        }
    }
    for e in entries.flatten() {
        let fname = e.file_name().to_string_lossy().into_owned();
        let Some(seq) = fname.strip_prefix("log.").and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        let mut head = [0u8; (log::LOG_HEADER_LEN + 4) as usize];
        let f = File::open(e.path()).map_err(|err| io_err("open", &e.path(), err))?;
        if std::os::unix::fs::FileExt::read_exact_at(&f, &mut head, 0).is_err() {
            return Ok(true);
        }
        let Ok(h) = LogHeader::decode(&head[..log::LOG_HEADER_LEN as usize]) else {
            return Ok(true);
        };
        if h.version >= 2 && meta.log_folded.is_some_and(|f| seq <= f) {
            continue;
        }
        let magic = endian::le32(&head, log::LOG_HEADER_LEN as usize);
        if magic == log::REC_MAGIC {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Take the lock of the disk whose log directory is `dir` (created if missing): refused with
/// `InUse` while another volume, in this process or another, has the disk open.
fn lock_dir(dir: &std::path::Path, name: &str) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| io_err("create", dir, e))?;
    let lock_path = dir.join("lock");
    let lock = File::create(&lock_path).map_err(|e| io_err("create", &lock_path, e))?;
    // SAFETY: flock on a valid fd.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) }
        != 0
    {
        return Err(DiskError::InUse { name: name.into() });
    }
    Ok(lock)
}

/// The lock of writable disk `name` (see [`lock_dir`]), for operations that replace its
/// content without opening it (`disk::revert`).
pub(super) fn lock_disk(store: &Store, name: &str, meta: &DiskMeta) -> Result<Option<File>> {
    match &meta.id {
        Some(id) => lock_dir(&store.local_dir().join("disks").join(id), name).map(Some),
        None => Ok(None),
    }
}

impl Volume {
    /// Open disk `name` for writing: take its lock, load its map, replay its log.
    pub fn open(store: &Store, name: &str) -> Result<Arc<Volume>> {
        let (r, meta) = super::load(store, name)?;
        if meta.snapshot_of.is_some() {
            return Err(DiskError::ReadOnlySnapshot { name: name.into() });
        }
        let disk_id =
            meta.id.clone().ok_or_else(|| DiskError::Log(format!("disk '{name}' has no id")))?;
        let dir = store.local_dir().join("disks").join(&disk_id);
        std::fs::create_dir_all(&dir).map_err(|e| io_err("create", &dir, e))?;
        let lock = lock_dir(&dir, name)?;
        // The writer lease: no other host (or process) writes this disk while we hold it.
        let lease = store.lease_if_needed(&super::ref_name(name))?;
        let base = map::read_map(store, &r.roots[0])?;
        let mut id_bytes = [0u8; 16];
        hex::decode_to_slice(&disk_id, &mut id_bytes)
            .map_err(|_| DiskError::Log(format!("disk '{name}' has a bad id")))?;

        // Logs: replay, in file order, every log not yet folded into the base; remove the rest.
        let mut logs: Vec<(u64, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(|e| io_err("list", &dir, e))?.flatten() {
            let fname = e.file_name().to_string_lossy().into_owned();
            if let Some(seq) = fname.strip_prefix("log.").and_then(|s| s.parse::<u64>().ok()) {
                logs.push((seq, e.path()));
            }
        }
        logs.sort();
        let mut overlay = ExtentMap::new();
        let mut files = HashMap::new();
        let mut current: Option<LogWriter> = None;
        let mut next_file = meta.log_folded.unwrap_or(0) + 1;
        for (seq, path) in logs {
            next_file = next_file.max(seq + 1);
            let (w, recs) = LogWriter::recover(&path)?;
            let h = w.header;
            if h.disk_id != id_bytes {
                return Err(DiskError::Log(format!(
                    "log {} belongs to another disk; move it aside and reopen '{name}'",
                    path.display()
                )));
            }
            // Version 1 logs name the generation their records apply on; version 2 logs are
            // folded once the ref says so (`log_folded`), whatever generation made them.
            let folded = match h.version {
                1 => h.base_generation < r.generation,
                _ => meta.log_folded.is_some_and(|f| seq <= f),
            };
            if folded {
                tracing::info!(target: "strata::disk", path = %path.display(), "removing log already folded into the base");
                drop(w);
                std::fs::remove_file(&path).map_err(|e| io_err("remove", &path, e))?;
                continue;
            }
            if h.base_generation > r.generation || (h.version == 1 && current.is_some()) {
                return Err(DiskError::Log(format!(
                    "log {} does not belong on generation {} of disk '{name}'; move it aside and reopen",
                    path.display(),
                    r.generation
                )));
            }
            if !recs.is_empty() {
                // What was replayed is durable from here on, whatever the last process synced.
                w.file_handle()?.sync_data().map_err(|e| io_err("fdatasync", &path, e))?;
            }
            for rec in &recs {
                let src = match rec.kind {
                    RecKind::Write => Src::Log { log: seq as u32, pos: rec.data_pos },
                    RecKind::Zero | RecKind::Trim => Src::Zero,
                };
                overlay.insert(rec.offset, rec.len, src);
            }
            files.insert(seq as u32, Arc::new(w.file_handle()?));
            current = Some(w);
        }
        let w = match current {
            Some(w) => w,
            None => {
                let w = LogWriter::create(
                    &dir.join(format!("log.{next_file}")),
                    LogHeader::new(id_bytes, r.generation, next_file),
                )?;
                files.insert(next_file as u32, Arc::new(w.file_handle()?));
                w
            }
        };
        Ok(Arc::new_cyclic(|me| Volume {
            store: store.clone(),
            name: name.into(),
            meta,
            dir,
            me: me.clone(),
            state: RwLock::new(State {
                generation: r.generation,
                base: Arc::new(base),
                active: Arc::new(overlay),
                frozen: None,
                files,
            }),
            log: Mutex::new(w),
            appended: AtomicU64::new(0),
            frozen_log: Mutex::new(None),
            sync: Mutex::new(SyncState { synced_seq: 0, syncing: false }),
            sync_cv: Condvar::new(),
            compaction: Mutex::new(CompactState {
                running: false,
                finished: 0,
                explicit: 0,
                thread: None,
            }),
            compaction_cv: Condvar::new(),
            fold_progress: AtomicU64::new(0),
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
    /// Records appended over the volume's life: a cheap "has it been written since" token.
    pub fn appended(&self) -> u64 {
        self.appended.load(Ordering::Acquire)
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

    pub(super) fn hook(&self, ev: SyncEvent) -> std::io::Result<()> {
        match &*self.sync_hook.read() {
            Some(h) => h(&ev),
            None => Ok(()),
        }
    }

    pub fn check_failed(&self) -> Result<()> {
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

    pub fn read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        self.bounds("read", off, buf.len() as u64)?;
        let mut pieces = Vec::new();
        {
            let st = self.state.read();
            let (both, one);
            let layers: &[&ExtentMap] = match st.frozen.as_deref() {
                Some(f) => {
                    both = [&*st.active, f];
                    &both
                }
                None => {
                    one = [&*st.active];
                    &one
                }
            };
            plan(
                layers,
                &st.base,
                &st.files,
                self.meta.block_size as u64,
                off,
                buf.len() as u64,
                &mut pieces,
            )?;
        }
        fetch(&self.store, &self.dir, off, &pieces, buf)
    }

    fn append(&self, kind: RecKind, off: u64, len: u64, data: &[u8]) -> Result<()> {
        self.check_failed()?;
        self.bounds(kind_name(kind), off, len)?;
        let (grown, seq) = {
            let mut w = self.log.lock();
            let rec = w.append(kind, off, len, data)?;
            let src = match kind {
                RecKind::Write => Src::Log { log: w.header.file_seq as u32, pos: rec.data_pos },
                _ => Src::Zero,
            };
            Arc::make_mut(&mut self.state.write().active).insert(off, len, src);
            self.appended.fetch_add(1, Ordering::Release);
            self.stats
                .log_bytes_written
                .fetch_add(log::REC_HEADER_LEN + data.len() as u64, Ordering::Relaxed);
            (w.pos, w.header.file_seq)
        };
        if kind == RecKind::Write {
            self.stats.writes.fetch_add(1, Ordering::Relaxed);
            self.stats.guest_bytes_written.fetch_add(len, Ordering::Relaxed);
        }
        if grown > self.compact_at.load(Ordering::Relaxed) {
            self.compact_in_background(grown, seq)?;
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

    fn sync_file(&self, f: &File, path: &std::path::Path) -> Result<()> {
        self.hook(SyncEvent::LogSync(path.to_path_buf()))
            .map_err(|e| io_err("fdatasync", path, e))?;
        self.stats.fdatasyncs.fetch_add(1, Ordering::Relaxed);
        f.sync_data().map_err(|e| io_err("fdatasync", path, e))
    }

    /// Make every completed write durable: one fdatasync, shared by concurrent callers.
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
                // Under the append lock: what is appended so far lies in the active file and,
                // if a compaction has not folded it yet, the frozen one.
                let (upto, file, path, frozen) = {
                    let w = self.log.lock();
                    let frozen = self
                        .frozen_log
                        .lock()
                        .as_ref()
                        .filter(|f| !f.synced)
                        .map(|f| (f.seq, f.file.clone(), f.path.clone()));
                    (self.appended.load(Ordering::Acquire), w.file_handle(), w.path.clone(), frozen)
                };
                let res = (|| -> Result<()> {
                    if let Some((seq, f, p)) = frozen {
                        self.sync_file(&f, &p)?;
                        if let Some(fl) = self.frozen_log.lock().as_mut().filter(|fl| fl.seq == seq)
                        {
                            fl.synced = true;
                        }
                    }
                    self.sync_file(&file?, &path)
                })();
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

    /// Record that every record appended before `upto` is durable (a compaction committed it).
    pub(super) fn mark_durable(&self, upto: u64) {
        let mut s = self.sync.lock();
        s.synced_seq = s.synced_seq.max(upto);
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
        let mut pieces = Vec::new();
        let (both, one);
        let layers: &[&ExtentMap] = match st.frozen.as_deref() {
            Some(f) => {
                both = [&*st.active, f];
                &both
            }
            None => {
                one = [&*st.active];
                &one
            }
        };
        // Planning only resolves log handles, which are open for every extent; it cannot fail.
        if plan(layers, &st.base, &st.files, bs, off, len, &mut pieces).is_err() {
            return vec![(len, true)];
        }
        for (_, l, piece) in &pieces {
            push(*l, !matches!(piece, Piece::Zero));
        }
        out
    }

    /// Flush and fold the log into the base (e.g. before a snapshot or on shutdown).
    pub fn close(&self) -> Result<()> {
        self.wait_compaction();
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

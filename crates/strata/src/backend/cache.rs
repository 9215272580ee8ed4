//! SSD cache decorator: a fixed-size cache file on local disk in front of any (remote) backend,
//! a client-side SSD cache for VM images built for boot storms (many clones reading the same
//! frames at once).
//!
//! What is cached, and why that is "keyed by content": the store reads a chunk as one range of
//! an immutable pack (`get_range(packs/XX/<id>, frame_off, frame_len)`), and a chunk lives in
//! exactly one pack (the store deduplicates by BLAKE3 id) whose name is random and never reused.
//! So an entry keyed by (pack key, offset, length) *is* an entry keyed by chunk id: every clone,
//! snapshot and image that shares a chunk shares its one cache entry, and entries never go stale
//! (GC deletes whole packs; `delete` drops their entries). Only keys the `cacheable` predicate
//! accepts (default: `packs/`) are cached; refs, config and index objects pass straight through,
//! as do whole-object `get`s (those are `check` and GC verifying the backend itself).
//! Entries are whole frames (typically 20-64 KiB compressed), not 4 MiB objects: a boot reads
//! only the frames it needs.
//!
//! Paths through the cache:
//! - Hit: look up the range, bump its LRU tick, `pread` the block, check the entry's BLAKE3
//!   (truncated to 128 bits) and return. A mismatch (bit rot, a torn write before a crash, or a
//!   block reused while we read it) drops the entry and falls through to a miss: the cache can
//!   lose data, never return wrong data.
//! - Hit on part of an entry (the store's 4 KiB piece reads of a verified 64 KiB frame): the
//!   first such read in a process hashes the whole entry as above; once an entry has been
//!   hashed or written by this process, only the part is read, and the entry's identity is
//!   checked after the read (a block is rewritten only after its entry leaves it). That is
//!   2.3 us of this layer's CPU per warm 4 KiB read instead of 19.9 (reading and hashing
//!   64 KiB); the caller's own check covers the part (the store checks each piece against its
//!   chaining value and on a mismatch reads the whole frame, which is hashed here and
//!   re-fetched).
//! - Miss, with coalescing: the first reader of a range becomes its leader and reads the
//!   backend; concurrent readers of the same range wait for the leader's bytes instead of
//!   issuing their own read (N clones booting together fetch each frame once).
//! - Lazy fill: the leader answers its caller at once and hands the bytes to the fill thread
//!   through a staging map (which also serves hits until the entry is on disk). The fill thread
//!   allocates a block (evicting if needed), writes it, then publishes the entry and appends an
//!   `Insert` record to the index log. Staging is bounded in bytes; beyond it fills are dropped.
//! - Writes are write-through: `put` goes to the backend first and its result is the caller's;
//!   with a `splitter` (which cuts a pack into its frame ranges), the bytes of a new pack are
//!   also staged for filling, so a host reads back what it just wrote from the SSD.
//!   There is no write-back mode: the disk layer's local write log already gives low-latency
//!   durable writes, and acknowledging a pack before the backend has it would break the
//!   store's durability ordering (pack -> index -> ref).
//! - Eviction: least recently used. The buddy allocator needs a free block of a given order;
//!   if the LRU entry is at least that big, evicting it suffices, otherwise every entry inside
//!   the aligned block of that order around the LRU entry is evicted (the block then merges
//!   free). Collateral evictions are bounded by one block of the needed order.
//! - Restart: `cache.index` is replayed (torn tail ignored), overlapping or invalid records are
//!   dropped, the allocator is rebuilt with `reserve`, and the log is rewritten compacted.
//!   Entries are verified lazily, on their first (and every) use. One process owns a cache
//!   directory at a time (`flock` on the data file).
//!
//! - Batched reads (`get_ranges`, `cache/batch.rs`): hits are answered from the cache, and all
//!   the misses a reader leads go to the backend in one `get_ranges` call (which S3 merges
//!   into few GETs); each range is still its own entry, coalesced and filled as above.
//! - Prefetch (`Backend::prefetch`, the one backend that has it): ranges read through the
//!   cache with N threads, then a wait for their fills, so a boot working set is on the SSD
//!   before the storm (`strata disk warm`, `strata serve`'s background prefetch).
//!
//! Files: this one holds the options, counters and the read/write paths; `cache/index.rs` the
//! in-memory index, eviction and the index log; `cache/fill.rs` the fill thread;
//! `cache/buddy.rs` the allocator; `cache/format.rs` the on-disk layout (`docs/format-cache.md`).

mod batch;
pub mod buddy;
mod fill;
pub mod format;
mod index;

use super::{BResult, Backend, BackendError, Capabilities, DynBackend, ErrorKind, ObjectInfo};
use buddy::Buddy;
use fill::fill_loop;
use format::{Geometry, DATA_HEADER_LEN, HASH_LEN, INDEX_HEADER_LEN};
use index::{flush_log, remove_entry, replay, rewrite_log, Entry, Log, RangeKey, Slice, State};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

const TARGET: &str = "strata::backend::cache";
const DATA_FILE: &str = "cache.data";
const INDEX_FILE: &str = "cache.index";

/// Cuts a freshly written object into the ranges worth caching (a pack into its frames).
pub type Splitter = Arc<dyn Fn(&str, &[u8]) -> Vec<(u64, u64)> + Send + Sync>;

/// How to build the cache.
#[derive(Clone)]
pub struct CacheOptions {
    /// Size of the cache file's data region in bytes (rounded down to whole top blocks).
    pub size: u64,
    /// Smallest block; entries are rounded up to a power-of-two multiple of it.
    pub min_block: u32,
    /// Largest entry (rounded up to a power of two); bigger ranges bypass the cache.
    pub max_entry: u64,
    /// Which keys hold immutable objects worth caching.
    pub cacheable: fn(&str) -> bool,
    /// Fill the cache from `put`s of cacheable objects, cut by this function.
    pub splitter: Option<Splitter>,
    /// Most bytes staged for filling at once; fills beyond it are dropped.
    pub max_staged: u64,
}

/// The default predicate: pack objects, and nothing else.
pub fn packs_only(key: &str) -> bool {
    key.starts_with("packs/")
}

impl CacheOptions {
    pub fn new(size: u64) -> CacheOptions {
        CacheOptions {
            size,
            min_block: 4096,
            max_entry: 16 << 20,
            cacheable: packs_only,
            splitter: None,
            max_staged: 128 << 20,
        }
    }

    /// The region geometry these options give, or None if the size is below one block.
    pub fn geometry(&self) -> Option<(u8, u8, u64)> {
        let min_shift = self.min_block.max(512).next_power_of_two().trailing_zeros() as u8;
        let max_shift =
            self.max_entry.max(self.min_block as u64).next_power_of_two().trailing_zeros() as u8;
        let size_shift = 63 - self.size.max(1).leading_zeros() as u8;
        if size_shift < min_shift {
            return None;
        }
        let top_order = max_shift.min(size_shift).saturating_sub(min_shift);
        let n_top = self.size >> (min_shift + top_order);
        Some((min_shift, top_order, n_top))
    }
}

impl std::fmt::Debug for CacheOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheOptions")
            .field("size", &self.size)
            .field("min_block", &self.min_block)
            .field("max_entry", &self.max_entry)
            .field("splitter", &self.splitter.is_some())
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("Cache size of {size} bytes is too small: give at least {min} bytes (--cache-size)")]
    TooSmall { size: u64, min: u64 },
    #[error("Cannot {op} {path}: check that the cache directory exists and is writable")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "Cannot reserve {size} bytes for {path}: free disk space or give a smaller --cache-size"
    )]
    NoSpace { size: u64, path: PathBuf },
    #[error(
        "Cache {dir} is in use by another strata process: give each process its own --cache DIR"
    )]
    InUse { dir: PathBuf },
}

/// Monotonic counters and gauges, for `strata stats --json` and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheCounters {
    /// Reads answered from the cache file or the staging area.
    pub hits: u64,
    pub hit_bytes: u64,
    /// Reads that went to the backend (one per coalesced group).
    pub misses: u64,
    pub miss_bytes: u64,
    /// Reads that waited for another reader's backend read of the same range.
    pub coalesced: u64,
    /// Reads of objects or sizes the cache does not hold (passed through).
    pub bypass: u64,
    pub bypass_bytes: u64,
    /// Entries written to the cache file.
    pub fills: u64,
    pub fill_bytes: u64,
    /// Fills skipped because the staging area was full.
    pub fill_dropped: u64,
    pub evictions: u64,
    pub evicted_bytes: u64,
    /// Hits on part of an entry already verified by this process, served without hashing the
    /// whole entry again (the store's 4 KiB piece reads; counted in `hits` too).
    pub part_hits: u64,
    /// Entries whose bytes failed their hash check (dropped, re-read from the backend).
    pub verify_failed: u64,
    pub io_errors: u64,
    /// Entries dropped because their object was deleted or overwritten.
    pub invalidations: u64,
    /// Entries recovered from the index at open.
    pub recovered: u64,
    /// Gauges: current entries, bytes of their blocks, bytes of their data, region size.
    pub entries: u64,
    pub used_bytes: u64,
    pub data_bytes: u64,
    pub capacity: u64,
}

impl CacheCounters {
    /// All bytes read from the backend through this cache (misses and pass-throughs).
    pub fn bytes_from_backend(&self) -> u64 {
        self.miss_bytes + self.bypass_bytes
    }
}

#[derive(Default)]
struct Stats {
    hits: AtomicU64,
    hit_bytes: AtomicU64,
    misses: AtomicU64,
    miss_bytes: AtomicU64,
    coalesced: AtomicU64,
    bypass: AtomicU64,
    bypass_bytes: AtomicU64,
    fills: AtomicU64,
    fill_bytes: AtomicU64,
    fill_dropped: AtomicU64,
    evictions: AtomicU64,
    evicted_bytes: AtomicU64,
    part_hits: AtomicU64,
    verify_failed: AtomicU64,
    io_errors: AtomicU64,
    invalidations: AtomicU64,
    recovered: AtomicU64,
}

fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// How a leader's backend read ended, as its followers see it.
enum Outcome {
    Data(Arc<Vec<u8>>),
    Failed(ErrorKind, String),
    /// The range was filled meanwhile: look it up again.
    Retry,
}

/// A backend read in progress that other readers of the same range wait for.
#[derive(Default)]
struct Flight {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

struct Shared {
    inner: DynBackend,
    opts: CacheOptions,
    data: File,
    dir: PathBuf,
    geo: Geometry,
    state: Mutex<State>,
    idle: Condvar,
    flights: Mutex<HashMap<RangeKey, Arc<Flight>>>,
    stats: Stats,
}

/// The cache decorator. Cheap to share behind an `Arc<dyn Backend>`.
pub struct CacheBackend {
    sh: Arc<Shared>,
    tx: Mutex<Option<mpsc::Sender<(RangeKey, Slice)>>>,
    filler: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for CacheBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheBackend")
            .field("inner", &self.sh.inner.name())
            .field("dir", &self.sh.dir)
            .field("capacity", &self.sh.geo.region_size)
            .finish()
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CacheError + 'a {
    move |source| CacheError::Io { op, path: path.to_path_buf(), source }
}

impl CacheBackend {
    /// Open (or create) the cache in `dir` in front of `inner`. A cache file of another size
    /// or format is recreated empty; an intact one is recovered with its entries.
    pub fn open(
        inner: DynBackend,
        dir: &Path,
        opts: CacheOptions,
    ) -> Result<CacheBackend, CacheError> {
        let (min_shift, top_order, n_top) = opts
            .geometry()
            .filter(|g| g.2 > 0)
            .ok_or(CacheError::TooSmall { size: opts.size, min: opts.min_block as u64 })?;
        std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
        let region_size = n_top << (min_shift + top_order);
        let data_path = dir.join(DATA_FILE);
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&data_path)
            .map_err(io_err("open", &data_path))?;
        lock_exclusive(&data).map_err(|e| match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => CacheError::InUse { dir: dir.to_path_buf() },
            _ => CacheError::Io { op: "lock", path: data_path.clone(), source: e },
        })?;
        let mut head = vec![0u8; DATA_HEADER_LEN as usize];
        let old = data
            .read_exact_at(&mut head, 0)
            .ok()
            .and_then(|_| format::parse_data_header(&head).ok());
        let same = |g: &Geometry| {
            g.region_size == region_size && g.min_shift == min_shift && g.top_order == top_order
        };
        let file_len = data.metadata().map_err(io_err("stat", &data_path))?.len();
        let geo = match old {
            Some(g) if same(&g) && file_len == DATA_HEADER_LEN + region_size => g,
            _ => {
                let g = Geometry { instance: rand::random(), region_size, min_shift, top_order };
                tracing::info!(target: TARGET, path = %data_path.display(), size = region_size, "creating the cache file");
                data.set_len(0).map_err(io_err("truncate", &data_path))?;
                reserve_space(&data, DATA_HEADER_LEN + region_size).map_err(|_| {
                    CacheError::NoSpace {
                        size: DATA_HEADER_LEN + region_size,
                        path: data_path.clone(),
                    }
                })?;
                data.write_all_at(&format::encode_data_header(&g), 0)
                    .map_err(io_err("write", &data_path))?;
                g
            }
        };

        let index_path = dir.join(INDEX_FILE);
        let mut raw = Vec::new();
        match File::open(&index_path) {
            Ok(mut f) => {
                f.read_to_end(&mut raw).map_err(io_err("read", &index_path))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("open", &index_path)(e)),
        }
        let records = match format::parse_index_header(&raw) {
            Ok(g) if g == geo => format::parse_records(&raw[INDEX_HEADER_LEN..]).0,
            _ => Vec::new(),
        };
        let mut buddy = Buddy::new(min_shift as u32, top_order, n_top);
        let (by_block, dropped) = replay(&buddy, &records);
        let mut st = State {
            buddy: buddy.clone(),
            by_block: BTreeMap::new(),
            by_range: BTreeMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            staged: BTreeMap::new(),
            staged_bytes: 0,
            // `file` is a placeholder until `rewrite_log` below opens the real index.
            log: Log {
                file: data.try_clone().map_err(io_err("open", &index_path))?,
                path: index_path,
                buf: Vec::new(),
                len: 0,
                live: 0,
            },
        };
        let mut recovered = 0;
        let mut ordered: Vec<(u64, Entry)> = by_block.into_iter().collect();
        ordered.sort_by_key(|(_, e)| e.tick);
        for (block, e) in ordered {
            let rk: RangeKey = (e.key.clone(), e.obj_off, e.len);
            if let Some(old) = st.by_range.get(&rk).copied() {
                // Two blocks for one range: keep the newer.
                let o = st.by_block.remove(&old).expect("indexed");
                buddy.free(old, o.order);
                st.lru.remove(&o.tick);
            }
            let ok = buddy.reserve(block, e.order);
            debug_assert!(ok, "replay yields disjoint blocks");
            st.tick = st.tick.max(e.tick + 1);
            st.lru.insert(e.tick, block);
            st.by_range.insert(rk, block);
            st.by_block.insert(block, e);
            recovered += 1;
        }
        st.buddy = buddy;
        rewrite_log(&mut st, &geo).map_err(io_err("write", &dir.join(INDEX_FILE)))?;
        tracing::info!(target: TARGET, dir = %dir.display(), entries = recovered, dropped, capacity = region_size, "cache opened");

        let sh = Arc::new(Shared {
            inner,
            opts,
            data,
            dir: dir.to_path_buf(),
            geo,
            state: Mutex::new(st),
            idle: Condvar::new(),
            flights: Mutex::new(HashMap::new()),
            stats: Stats::default(),
        });
        bump(&sh.stats.recovered, recovered);
        let (tx, rx) = mpsc::channel();
        let sh2 = sh.clone();
        let filler = std::thread::Builder::new()
            .name("strata-cache-fill".into())
            .spawn(move || fill_loop(&sh2, rx))
            .map_err(io_err("start the fill thread for", dir))?;
        Ok(CacheBackend { sh, tx: Mutex::new(Some(tx)), filler: Mutex::new(Some(filler)) })
    }

    pub fn inner(&self) -> &DynBackend {
        &self.sh.inner
    }

    pub fn dir(&self) -> &Path {
        &self.sh.dir
    }

    pub fn counters(&self) -> CacheCounters {
        let s = &self.sh.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let st = self.sh.state.lock();
        CacheCounters {
            hits: l(&s.hits),
            hit_bytes: l(&s.hit_bytes),
            misses: l(&s.misses),
            miss_bytes: l(&s.miss_bytes),
            coalesced: l(&s.coalesced),
            bypass: l(&s.bypass),
            bypass_bytes: l(&s.bypass_bytes),
            fills: l(&s.fills),
            fill_bytes: l(&s.fill_bytes),
            fill_dropped: l(&s.fill_dropped),
            evictions: l(&s.evictions),
            evicted_bytes: l(&s.evicted_bytes),
            part_hits: l(&s.part_hits),
            verify_failed: l(&s.verify_failed),
            io_errors: l(&s.io_errors),
            invalidations: l(&s.invalidations),
            recovered: l(&s.recovered),
            entries: st.by_block.len() as u64,
            used_bytes: st.buddy.used(),
            data_bytes: st.by_block.values().map(|e| e.len).sum(),
            capacity: self.sh.geo.region_size,
        }
    }

    /// Wait until every staged fill is on disk and recorded in the index log.
    pub fn wait_idle(&self) {
        let mut st = self.sh.state.lock();
        while !st.staged.is_empty() {
            self.sh.idle.wait(&mut st);
        }
        let _ = flush_log(&mut st);
    }

    /// Drop every entry (for cold-cache measurements).
    pub fn clear(&self) {
        self.wait_idle();
        let mut st = self.sh.state.lock();
        let blocks: Vec<u64> = st.by_block.keys().copied().collect();
        for b in blocks {
            remove_entry(&mut st, b);
        }
        let _ = flush_log(&mut st);
    }

    /// Read every entry back and drop those whose bytes fail their hash. Returns (good, bad).
    pub fn verify_all(&self) -> (u64, u64) {
        self.wait_idle();
        let entries: Vec<(u64, Entry)> =
            self.sh.state.lock().by_block.iter().map(|(b, e)| (*b, e.clone())).collect();
        let (mut good, mut bad) = (0, 0);
        for (block, e) in entries {
            if self.sh.read_block(block, &e).is_some() {
                self.sh.mark_verified(block, e.seq);
                good += 1;
            } else {
                bad += 1;
                self.sh.drop_if_same(block, &e.hash);
            }
        }
        (good, bad)
    }

    /// Stage bytes for the fill thread, within the staging budget.
    fn stage(&self, rk: RangeKey, slice: Slice) {
        let len = slice.len as u64;
        {
            let mut st = self.sh.state.lock();
            if st.by_range.contains_key(&rk) || st.staged.contains_key(&rk) {
                return;
            }
            if st.staged_bytes + len > self.sh.opts.max_staged {
                bump(&self.sh.stats.fill_dropped, 1);
                return;
            }
            st.staged_bytes += len;
            st.staged.insert(rk.clone(), slice.clone());
        }
        let sent =
            self.tx.lock().as_ref().map(|tx| tx.send((rk.clone(), slice)).is_ok()).unwrap_or(false);
        if !sent {
            let mut st = self.sh.state.lock();
            if st.staged.remove(&rk).is_some() {
                st.staged_bytes -= len;
            }
            self.sh.idle.notify_all();
        }
    }

    fn entry_fits(&self, len: u64) -> bool {
        len > 0 && len <= 1u64 << (self.sh.geo.min_shift as u32 + self.sh.geo.top_order as u32)
    }

    /// Write-through `put`: the backend first, then the object's chunks are staged for the
    /// cache. `shared` is the caller's buffer when it has one (`put_shared`): it goes down
    /// uncopied and the staged slices point into it.
    fn put_through(&self, key: &str, data: &[u8], shared: Option<&Arc<Vec<u8>>>) -> BResult<()> {
        let cacheable = (self.sh.opts.cacheable)(key);
        if cacheable {
            // Entries of the old object must not outlive it (packs are never overwritten, but
            // the predicate is configurable).
            self.invalidate(key);
        }
        match shared {
            Some(b) => self.sh.inner.put_shared(key, b)?,
            None => self.sh.inner.put(key, data)?,
        }
        if let (true, Some(split)) = (cacheable, &self.sh.opts.splitter) {
            let buf = match shared {
                Some(b) => b.clone(),
                None => Arc::new(data.to_vec()),
            };
            let k: Arc<str> = Arc::from(key);
            for (off, len) in split(key, data) {
                let in_bounds = off.checked_add(len).is_some_and(|e| e <= data.len() as u64);
                if in_bounds && self.entry_fits(len) {
                    let s = Slice { buf: buf.clone(), off: off as usize, len: len as usize };
                    self.stage((k.clone(), off, len), s);
                }
            }
        }
        Ok(())
    }

    /// Drop every entry and staged fill of `key` (its object was deleted or overwritten).
    fn invalidate(&self, key: &str) {
        let k: Arc<str> = Arc::from(key);
        let lo = (k.clone(), 0u64, 0u64);
        let hi = (k, u64::MAX, u64::MAX);
        let mut st = self.sh.state.lock();
        let blocks: Vec<u64> =
            st.by_range.range(lo.clone()..=hi.clone()).map(|(_, b)| *b).collect();
        for b in &blocks {
            remove_entry(&mut st, *b);
        }
        bump(&self.sh.stats.invalidations, blocks.len() as u64);
        let staged: Vec<RangeKey> = st.staged.range(lo..=hi).map(|(k, _)| k.clone()).collect();
        for rk in staged {
            if let Some(s) = st.staged.remove(&rk) {
                st.staged_bytes -= s.len as u64;
            }
        }
        self.sh.idle.notify_all();
    }
}

impl Drop for CacheBackend {
    fn drop(&mut self) {
        self.tx.lock().take();
        if let Some(t) = self.filler.lock().take() {
            let _ = t.join();
        }
        let mut st = self.sh.state.lock();
        if let Err(e) = flush_log(&mut st) {
            tracing::warn!(target: TARGET, error = %e, "cache index not flushed; entries will be lost");
        }
    }
}

impl Shared {
    /// Read and verify one entry's bytes; None if unreadable or not matching its hash.
    fn read_block(&self, block: u64, e: &Entry) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; e.len as usize];
        if let Err(err) = self.data.read_exact_at(&mut buf, DATA_HEADER_LEN + block) {
            bump(&self.stats.io_errors, 1);
            tracing::warn!(target: TARGET, block, error = %err, "cache read failed");
            return None;
        }
        if format::entry_hash(&buf) != e.hash {
            bump(&self.stats.verify_failed, 1);
            tracing::debug!(target: TARGET, block, key = %e.key, "cache entry failed its hash check");
            return None;
        }
        Some(buf)
    }

    /// A part of an entry this process has verified: bytes `[at, at + len)` of it, read without
    /// hashing the whole entry again. `None` if unreadable, or if the entry left its block
    /// while we read (the block may then hold another entry's bytes).
    fn read_part(&self, block: u64, e: &Entry, at: usize, len: u64) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len as usize];
        if let Err(err) = self.data.read_exact_at(&mut buf, DATA_HEADER_LEN + block + at as u64) {
            bump(&self.stats.io_errors, 1);
            tracing::warn!(target: TARGET, block, error = %err, "cache read failed");
            return None;
        }
        // A block is written only after its entry is removed: if the same entry is still there,
        // nothing overwrote what we read.
        let st = self.state.lock();
        st.by_block.get(&block).is_some_and(|x| x.seq == e.seq).then_some(buf)
    }

    fn mark_verified(&self, block: u64, seq: u64) {
        if let Some(x) = self.state.lock().by_block.get_mut(&block).filter(|x| x.seq == seq) {
            x.verified = true;
        }
    }

    /// The range's bytes if the cache (disk or staging) has them; counts the hit. A whole
    /// entry is hash-checked on every read. Part of an entry (the store's 4 KiB piece reads)
    /// is hash-checked with the whole entry until this process has verified it once; after
    /// that only the part is read, and the caller's own check covers it: the store checks
    /// every piece against its chaining value and, on a mismatch, reads the whole frame,
    /// which is hash-checked here and re-fetched if the entry went bad.
    fn hit(&self, rk: &RangeKey) -> Option<Vec<u8>> {
        let len = rk.2;
        loop {
            match self.lookup(rk) {
                Lookup::Block(block, e, at) => {
                    let part = at != 0 || len < e.len;
                    if part && e.verified {
                        if let Some(v) = self.read_part(block, &e, at, len) {
                            bump(&self.stats.hits, 1);
                            bump(&self.stats.hit_bytes, len);
                            bump(&self.stats.part_hits, 1);
                            return Some(v);
                        }
                    } else if let Some(v) = self.read_block(block, &e) {
                        if !e.verified {
                            self.mark_verified(block, e.seq);
                        }
                        bump(&self.stats.hits, 1);
                        bump(&self.stats.hit_bytes, len);
                        if !part {
                            return Some(v);
                        }
                        return Some(v[at..at + len as usize].to_vec());
                    }
                    self.drop_if_same(block, &e.hash);
                }
                Lookup::Staged(v) => {
                    bump(&self.stats.hits, 1);
                    bump(&self.stats.hit_bytes, len);
                    return Some(v);
                }
                Lookup::Miss => return None,
            }
        }
    }

    /// Remove the entry at `block` unless it was replaced meanwhile.
    fn drop_if_same(&self, block: u64, hash: &[u8; HASH_LEN]) {
        let mut st = self.state.lock();
        if st.by_block.get(&block).is_some_and(|e| &e.hash == hash) {
            remove_entry(&mut st, block);
        }
    }

    /// Look the range up; on a hit, bump it in the LRU and return where it is.
    /// An exact entry wins; else an entry of the same object that contains the range (the
    /// store reads 4 KiB pieces of a frame once it has verified the whole frame, see
    /// `store/slice.rs`: those must hit the cached frame). Frames do not overlap, so only the
    /// few entries starting at or just before the range's offset can contain it.
    fn lookup(&self, rk: &RangeKey) -> Lookup {
        let mut st = self.state.lock();
        let found = st.by_range.get(rk).map(|&b| (b, 0)).or_else(|| {
            let (k, off, len) = (rk.0.clone(), rk.1, rk.2);
            st.by_range
                .range((k.clone(), 0, 0)..=(k, off, u64::MAX))
                .rev()
                .take(4)
                .find(|(ek, _)| ek.1 + ek.2 >= off + len)
                .map(|(ek, &b)| (b, (off - ek.1) as usize))
        });
        if let Some((block, at)) = found {
            let tick = st.tick;
            st.tick += 1;
            let e = st.by_block.get_mut(&block).expect("by_range and by_block agree");
            let old = std::mem::replace(&mut e.tick, tick);
            let e = e.clone();
            st.lru.remove(&old);
            st.lru.insert(tick, block);
            return Lookup::Block(block, e, at);
        }
        if let Some(s) = st.staged.get(rk) {
            return Lookup::Staged(s.bytes().to_vec());
        }
        let (k, off, len) = (rk.0.clone(), rk.1, rk.2);
        let within = st
            .staged
            .range((k.clone(), 0, 0)..=(k, off, u64::MAX))
            .rev()
            .take(4)
            .find(|(ek, _)| ek.1 + ek.2 >= off + len);
        if let Some((ek, s)) = within {
            let at = (off - ek.1) as usize;
            return Lookup::Staged(s.bytes()[at..at + len as usize].to_vec());
        }
        Lookup::Miss
    }
}

enum Lookup {
    /// A cached entry, and where the requested range starts inside it.
    Block(u64, Entry, usize),
    Staged(Vec<u8>),
    Miss,
}

/// Publishes a leader's outcome to its followers, also if the leader unwinds.
struct Leader<'a> {
    sh: &'a Shared,
    rk: RangeKey,
    flight: Arc<Flight>,
    result: Option<Outcome>,
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        let r = self
            .result
            .take()
            .unwrap_or_else(|| Outcome::Failed(ErrorKind::Other, "cache leader failed".into()));
        *self.flight.done.lock() = Some(r);
        self.flight.cv.notify_all();
        self.sh.flights.lock().remove(&self.rk);
    }
}

impl Backend for CacheBackend {
    fn name(&self) -> String {
        format!("cache({})", self.sh.inner.name())
    }

    fn capabilities(&self) -> Capabilities {
        self.sh.inner.capabilities()
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        let v = self.sh.inner.get(key)?;
        bump(&self.sh.stats.bypass, 1);
        bump(&self.sh.stats.bypass_bytes, v.len() as u64);
        Ok(v)
    }

    fn get_meta_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        let v = self.sh.inner.get_meta_range(key, offset, len)?;
        bump(&self.sh.stats.bypass, 1);
        bump(&self.sh.stats.bypass_bytes, len);
        Ok(v)
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        let sh = &*self.sh;
        if !(sh.opts.cacheable)(key) || !self.entry_fits(len) {
            let v = sh.inner.get_range(key, offset, len)?;
            bump(&sh.stats.bypass, 1);
            bump(&sh.stats.bypass_bytes, len);
            return Ok(v);
        }
        let rk: RangeKey = (Arc::from(key), offset, len);
        loop {
            if let Some(v) = sh.hit(&rk) {
                return Ok(v);
            }
            // Miss: lead the backend read or follow the one in flight.
            let (flight, lead) = {
                let mut fl = sh.flights.lock();
                match fl.get(&rk) {
                    Some(f) => (f.clone(), false),
                    None => {
                        let f = Arc::new(Flight::default());
                        fl.insert(rk.clone(), f.clone());
                        (f, true)
                    }
                }
            };
            if !lead {
                match self.follow(key, &flight) {
                    Some(r) => return r,
                    None => continue,
                }
            }
            let mut leader = Leader { sh, rk: rk.clone(), flight, result: None };
            // The range may have been filled between our lookup and taking the lead.
            if let Lookup::Block(..) | Lookup::Staged(_) = sh.lookup(&rk) {
                leader.result = Some(Outcome::Retry);
                drop(leader);
                continue;
            }
            return match sh.inner.get_range(key, offset, len) {
                Ok(v) => {
                    bump(&sh.stats.misses, 1);
                    bump(&sh.stats.miss_bytes, len);
                    let buf = Arc::new(v);
                    // Stage before the flight ends, so no reader misses both.
                    self.stage(rk.clone(), Slice { buf: buf.clone(), off: 0, len: len as usize });
                    leader.result = Some(Outcome::Data(buf.clone()));
                    drop(leader);
                    Ok(Arc::try_unwrap(buf).unwrap_or_else(|b| (*b).clone()))
                }
                Err(e) => {
                    leader.result = Some(Outcome::Failed(e.kind, e.to_string()));
                    Err(e)
                }
            };
        }
    }

    fn get_ranges(&self, key: &str, ranges: &[(u64, u64)]) -> BResult<Vec<Vec<u8>>> {
        self.read_batch(key, ranges)
    }

    fn put_volatile(&self, key: &str, data: &[u8]) -> BResult<()> {
        if (self.sh.opts.cacheable)(key) {
            return self.put(key, data);
        }
        self.sh.inner.put_volatile(key, data)
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.put_through(key, data, None)
    }

    fn put_shared(&self, key: &str, data: &Arc<Vec<u8>>) -> BResult<()> {
        self.put_through(key, data, Some(data))
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        self.sh.inner.put_if_absent(key, data)
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        self.sh.inner.list(prefix)
    }

    fn delete(&self, key: &str) -> BResult<()> {
        self.sh.inner.delete(key)?;
        if (self.sh.opts.cacheable)(key) {
            self.invalidate(key);
        }
        Ok(())
    }

    fn sync(&self) -> BResult<()> {
        self.sh.inner.sync()
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        self.sh.inner.head(key)
    }

    fn can_prefetch(&self) -> bool {
        true
    }

    /// Read the ranges through the cache with `parallel` threads, then wait for their fills,
    /// so they are cached. Returns the bytes that had to come from the backend.
    fn prefetch(&self, ranges: &[(String, u64, u64)], parallel: usize) -> BResult<u64> {
        let before = self.counters().miss_bytes;
        let next = AtomicU64::new(0);
        let first_err: Mutex<Option<BackendError>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..parallel.max(1) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some((k, off, len)) = ranges.get(i) else { break };
                    if let Err(e) = self.get_range(k, *off, *len) {
                        first_err.lock().get_or_insert(e);
                        break;
                    }
                });
            }
        });
        if let Some(e) = first_err.into_inner() {
            return Err(e);
        }
        self.wait_idle();
        Ok(self.counters().miss_bytes - before)
    }
}

/// One process per cache directory: an exclusive `flock` on the data file, released when the
/// file is closed (also when the process dies).
fn lock_exclusive(f: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on an owned, open descriptor.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Give the file its full size with real blocks (fallocate), so the cache cannot hit ENOSPC
/// later; falls back to a sparse file where fallocate is unsupported.
fn reserve_space(f: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on an owned, open descriptor.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) };
    match r {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => f.set_len(len),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemoryBackend;
    use crate::backend::retry::{RetryBackend, RetryPolicy};

    /// Prefetch is a capability of the backend trait: a plain backend refuses it, the cache
    /// has it, and a decorator over the cache forwards it. Prefetched ranges are then cached.
    #[test]
    fn prefetch_fills_the_cache_through_the_trait() {
        let d = tempfile::tempdir().unwrap();
        let mem = MemoryBackend::new();
        let data: Vec<u8> = (0..64u32 << 10).map(|i| (i % 251) as u8).collect();
        mem.put("packs/aa/p1", &data).unwrap();
        let plain: DynBackend = Arc::new(mem);
        assert!(!plain.can_prefetch());
        assert_eq!(plain.prefetch(&[], 1).unwrap_err().kind, ErrorKind::Unsupported);
        let cache =
            Arc::new(CacheBackend::open(plain, d.path(), CacheOptions::new(8 << 20)).unwrap());
        let stack = RetryBackend::new(cache.clone(), RetryPolicy::default());
        assert!(cache.can_prefetch() && stack.can_prefetch());
        let key = "packs/aa/p1".to_string();
        let ranges = vec![(key.clone(), 0, 4096), (key.clone(), 8192, 4096)];
        assert_eq!(stack.prefetch(&ranges, 2).unwrap(), 8192);
        assert_eq!(stack.prefetch(&ranges, 2).unwrap(), 0, "a second prefetch finds both cached");
        let before = cache.counters();
        assert_eq!(stack.get_range(&key, 8192, 4096).unwrap(), data[8192..12288]);
        assert_eq!(cache.counters().hits, before.hits + 1);
    }

    #[test]
    fn geometry_follows_size_and_limits() {
        let o = CacheOptions::new(1 << 30);
        assert_eq!(o.geometry(), Some((12, 12, 64)), "1 GiB = 64 blocks of 16 MiB");
        let o = CacheOptions::new((1 << 20) + 5);
        assert_eq!(o.geometry(), Some((12, 8, 1)), "small caches use a smaller top order");
        assert_eq!(CacheOptions::new(100).geometry(), None);
        let o = CacheOptions { max_entry: 65536, ..CacheOptions::new(10 << 20) };
        assert_eq!(o.geometry(), Some((12, 4, 160)));
    }
}

//! The content-addressed chunk store: chunks in packs in a backend, indexed locally.
//!
//! Write path: a [`Session`] hashes a chunk (BLAKE3 of the raw bytes), skips it if the index
//! already knows the id (dedup), otherwise compresses it and appends a frame to the open pack.
//! A full pack is sealed and handed to the writer thread, which `put`s it while callers keep
//! compressing. [`Store::flush`] is the durability point: the writer thread syncs the packs,
//! then writes and syncs their index objects. [`Session::commit_ref`] flushes and only then
//! writes the ref. That is the ordering invariant of `docs/durability.md`:
//! pack data -> sync -> index object -> sync -> ref -> sync; deletion runs in reverse.
//! On a network backend (an acknowledged put is durable) a pack is also sealed early, while
//! fewer than [`EARLY_SEAL_UPLOADS`] packs are uploading (at least [`EARLY_SEAL_BYTES`], or
//! [`EARLY_SEAL_IDLE_BYTES`] while nothing is), and its index object
//! follows its put at once, so a flush waits only for uploads still running.
//!
//! Failure policy (as in fjall): any failed backend write or sync on the commit path poisons
//! the store; writes then fail until it is reopened, because after a failed fsync nobody knows
//! what reached the media. Reads keep working.
//!
//! GC safety: chunks a live session has put or pinned are never collected, and the final phase
//! of GC runs under a write lock that excludes puts, so a dedup hit can't race with a sweep.

pub mod check;
pub mod discover;
pub mod du;
pub mod format;
pub mod gc;
pub mod lease;
pub mod meta;
pub mod objects;
pub mod pack;
pub mod slice;
pub mod tree_cache;
mod writer;

use crate::backend::{local::LocalBackend, BackendError, DynBackend, ErrorKind};
use crate::codec::{Codec, CodecError, MAX_FRAME_RAW};
use crate::id::{ChunkId, PackId};
use format::{FormatError, FORMAT_VERSION};
use meta::{Meta, MetaError};
use objects::{valid_ref_name, Ref, StoreConfig, StoreSettings, Tree};
use pack::{ChunkKind, PackBuilder, PackEntry};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use writer::Job;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("Not a strata store: {location} has no config object; create one with `strata init --store {location}`")]
    NotAStore { location: String },
    #[error("A strata store already exists at {location}")]
    AlreadyExists { location: String },
    #[error("GC refused: chunk {chunk} is reachable from a ref but in no pack; nothing was deleted. Run `strata check` to find the damage, then remove or restore the refs it names")]
    GcMissingChunk { chunk: ChunkId },
    #[error("Object '{key}' is unreadable")]
    Format { key: String, #[source] source: FormatError },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error("Chunk {id} is not in the store")]
    ChunkMissing { id: ChunkId },
    #[error("Chunk {id} in pack {pack} (frame at byte {offset}) is corrupt: {reason}")]
    Corrupt { id: ChunkId, pack: PackId, offset: u64, reason: String },
    #[error("Pack {pack} holding chunk {id} is missing from the backend")]
    PackMissing { id: ChunkId, pack: PackId },
    #[error("Ref '{name}' does not exist")]
    RefNotFound { name: String },
    #[error("Ref '{name}' already exists")]
    RefExists { name: String },
    #[error("Invalid ref name '{name}': use letters, digits, '._@=+-' and '/' separators, at most 255 bytes")]
    BadRefName { name: String },
    #[error("Root chunk {id} of ref '{name}' is not in the store (was its source deleted meanwhile?)")]
    MissingRoot { name: String, id: ChunkId },
    #[error("Store is poisoned after a failed write ({reason}); fix the cause and reopen the store")]
    Poisoned { reason: String },
    #[error("Chunk of {size} bytes exceeds the {MAX_FRAME_RAW}-byte cap")]
    TooLarge { size: usize },
    #[error("Codec failure")]
    Codec(#[from] CodecError),
    #[error(transparent)]
    Lease(#[from] lease::LeaseError),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Where a chunk lives: the process-local pack number and its entry.
/// Ids located per hold of the index lock by [`Store::locate_many`]: a writer (a save
/// sealing a pack) waits at most this many lookups (~0.2 ms).
pub const LOCATE_BATCH: usize = 4096;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Loc {
    pub pack: u32,
    pub entry: PackEntry,
}

#[derive(Debug)]
pub(crate) struct PackSlot {
    pub id: PackId,
    pub size: u64,
    /// Bytes of a sealed pack until its index object is durable.
    pub mem: Option<Arc<Vec<u8>>>,
    pub durable: bool,
}

#[derive(Default, Debug)]
pub(crate) struct Index {
    pub chunks: HashMap<ChunkId, Loc>,
    pub packs: Vec<Option<PackSlot>>,
    pub by_id: HashMap<PackId, u32>,
}

impl Index {
    fn add_slot(&mut self, slot: PackSlot) -> u32 {
        let no = self.packs.len() as u32;
        self.by_id.insert(slot.id, no);
        self.packs.push(Some(slot));
        no
    }
    pub(crate) fn slot(&self, no: u32) -> Option<&PackSlot> {
        self.packs.get(no as usize).and_then(|s| s.as_ref())
    }
}

/// Counters for `stats` and benchmarks.
#[derive(Default, Debug)]
pub struct Stats {
    pub chunks_new: AtomicU64,
    pub chunks_dedup: AtomicU64,
    pub raw_bytes_new: AtomicU64,
    pub stored_bytes_new: AtomicU64,
    pub packs_written: AtomicU64,
    pub syncs: AtomicU64,
}

pub(crate) struct Shared {
    pub backend: DynBackend,
    pub config: StoreConfig,
    pub meta: Meta,
    pub index: RwLock<Index>,
    pub poison: Mutex<Option<String>>,
    pub stats: Stats,
    pub uploads: writer::UploadMeter,
    /// Buffers of packs that became durable, for the next open packs (at most
    /// [`SPARE_PACK_BUFFERS`], dropped when the last session ends): a fresh 16 MiB buffer
    /// costs ~4,000 page faults as it fills, a quarter of a memory save's pool CPU before
    /// buffers were reused.
    pub spare_packs: Mutex<Vec<Vec<u8>>>,
}

/// Pack buffers kept for reuse (each the size of a full pack plus slack): a memory save makes
/// packs durable every 128 MiB, eight 16 MiB packs at a time.
const SPARE_PACK_BUFFERS: usize = 8;

impl Shared {
    /// Keep a durable pack's buffer for reuse if it is the last reference and there is room.
    pub(crate) fn recycle_pack(&self, bytes: Arc<Vec<u8>>) {
        if let Ok(v) = Arc::try_unwrap(bytes) {
            let mut spare = self.spare_packs.lock();
            if spare.len() < SPARE_PACK_BUFFERS {
                spare.push(v);
            }
        }
    }
}

impl Shared {
    pub(crate) fn check_poison(&self) -> Result<()> {
        match &*self.poison.lock() {
            Some(reason) => Err(StoreError::Poisoned { reason: reason.clone() }),
            None => Ok(()),
        }
    }
    pub(crate) fn poison(&self, why: &dyn std::fmt::Display) {
        let mut p = self.poison.lock();
        if p.is_none() {
            tracing::error!(target: "strata::store", reason = %why, "store poisoned");
            *p = Some(format!("{why}, on {}", self.backend.name()));
        }
    }
    /// Sync the backend; a failure poisons the store.
    pub(crate) fn sync(&self) -> Result<()> {
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        self.backend.sync().map_err(|e| {
            self.poison(&e);
            StoreError::Backend(e)
        })
    }
}

/// Smallest pack sealed early while one pack is waiting or uploading, on a network backend:
/// a second upload starts once this much is ready, so the link has two in flight and one
/// request's latency is hidden behind the other. While both are in flight packs grow, so a
/// large save does not pay a request per pack-let. History: 1 MiB from session 5 (4 MiB then
/// left a 128 MiB save one upload at a time for its first 100 ms); 8 MiB since session 11,
/// when a 128 MiB save made ~45 objects of ~0.5 MB and the server's per-object work (request,
/// file, fsync) was what the 2-core host ran short of: over 12 alternating rounds each
/// (`bench save-restore --remote --sizes 128`), 2 MiB / 8 MiB made 11–17 objects instead of 33–50, cut
/// versitygw's CPU per restore from 0.12–0.18 to 0.07–0.13 s, and the median save from 0.40
/// to 0.355 s; restores were within the noise (docs/results/README.md, session 11).
pub const EARLY_SEAL_BYTES: u64 = 8 << 20;
/// Smallest pack sealed early while nothing is uploading: the link would otherwise idle until
/// more is ready. 2 MiB (was 256 KiB): the first upload leaves ~20 ms into a 128 MiB save
/// instead of ~3 ms, for a third of the objects (see [`EARLY_SEAL_BYTES`]).
pub const EARLY_SEAL_IDLE_BYTES: u64 = 2 << 20;
/// A network backend's open pack is sealed early while fewer packs than this are waiting or
/// uploading: two small uploads in flight hide a request's latency, one would leave the link
/// idle between them (measured: ~60 MB/s of a 1 Gbit/s link with one).
pub const EARLY_SEAL_UPLOADS: usize = 2;

/// A frame its caller compressed already (a memory save's codec sample): the ids of the
/// chunks joined into it, in order, and the stored bytes under the frame's codec (None: the
/// codec did not pay, store the chunks raw).
#[derive(Debug)]
pub struct Precompressed {
    pub ids: Vec<ChunkId>,
    pub stored: Option<Vec<u8>>,
}

struct OpenPack {
    builder: Option<PackBuilder>,
    no: u32,
}

/// A pack taken out of [`OpenPack`] whose trailer is not encoded yet.
struct Sealing<'a> {
    no: u32,
    builder: PackBuilder,
    _gate: parking_lot::RwLockReadGuard<'a, ()>,
}

pub(crate) struct Inner {
    pub sh: Arc<Shared>,
    open: Mutex<OpenPack>,
    /// Held shared by each pack from leaving `open` until it is with the writer (its trailer
    /// is compressed meanwhile, outside `open`); `flush`, and readers of a pack in that
    /// window, take it exclusively to wait for them.
    sealing: RwLock<()>,
    writer: writer::WriterHandle,
    flush_lock: Mutex<()>,
    pub gc_lock: RwLock<()>,
    pub gc_running: Mutex<()>,
    pub sessions: Mutex<HashMap<u64, Arc<Mutex<HashSet<ChunkId>>>>>,
    next_session: AtomicU64,
    pub default_codec: Codec,
    pub pack_size: u64,
    /// Seal packs early while the uploader has room (`Capabilities::network`).
    early_seal: bool,
    pub(crate) leases: Arc<lease::Leases>,
    pub location: String,
    pub local_dir: PathBuf,
    /// Verified piece CVs and decompressed chunks, shared by every reader (`slice.rs`).
    pub slices: slice::SliceCache,
    /// Local copies of page-map trees (network backends only; `tree_cache.rs`).
    pub trees: Option<tree_cache::TreeCache>,
}

/// A handle to an open store; cheap to clone and share between threads.
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<Inner>,
}

/// Options for creating a store.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Target pack size; 0 = what the backend prefers.
    pub pack_size: u64,
    pub default_codec: Codec,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions { pack_size: 0, default_codec: Codec::Lz4 }
    }
}

impl Store {
    /// Create a new store in `backend`, keeping local metadata at `meta_path`.
    /// A `pack_size` of 0 takes the backend's preferred size (`Capabilities`).
    pub fn init(backend: DynBackend, meta_path: &Path, mut opts: InitOptions) -> Result<Store> {
        if opts.pack_size == 0 {
            opts.pack_size = backend.capabilities().preferred_pack_size;
        }
        match backend.head("config") {
            Ok(Some(_)) => return Err(StoreError::AlreadyExists { location: backend.name() }),
            Ok(None) => {}
            Err(e) => return Err(e.into()),
        }
        let cfg = StoreConfig {
            store_id: rand::random(),
            version: FORMAT_VERSION,
            settings: StoreSettings {
                pack_size: opts.pack_size,
                default_codec: opts.default_codec.to_string(),
                created_by: format!("strata {}", env!("CARGO_PKG_VERSION")),
                created_unix: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
            },
        };
        if !backend.put_if_absent("config", &cfg.encode())? {
            return Err(StoreError::AlreadyExists { location: backend.name() });
        }
        backend.sync()?;
        Store::open(backend, meta_path)
    }

    /// Open an existing store.
    pub fn open(backend: DynBackend, meta_path: &Path) -> Result<Store> {
        let raw = match backend.get("config") {
            Ok(b) => b,
            Err(e) if e.kind == ErrorKind::NotFound => {
                return Err(StoreError::NotAStore { location: backend.name() })
            }
            Err(e) => return Err(e.into()),
        };
        let config = StoreConfig::decode(&raw).map_err(|source| StoreError::Format { key: "config".into(), source })?;
        let (meta, _private) = Meta::open_or_private(meta_path, &config.store_id)?;
        // Announce this instance before trusting the index: a GC elsewhere must see us (and we
        // must not open while one runs), see `lease.rs`.
        let leases = lease::Leases::new(backend.clone());
        leases.announce()?;
        let index = writer::load_index(&*backend, &meta)?;
        let default_codec = config.settings.default_codec.parse().unwrap_or(Codec::Lz4);
        let pack_size = config
            .settings
            .pack_size
            .clamp(64 << 10, backend.capabilities().max_object_size.min(pack::MAX_PACK_SIZE) / 2);
        let location = backend.name();
        let caps_network = backend.capabilities().network;
        let local_dir = meta_path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
        let sh = Arc::new(Shared {
            backend,
            config,
            meta,
            index: RwLock::new(index),
            poison: Mutex::new(None),
            stats: Stats::default(),
            uploads: writer::UploadMeter::default(),
            spare_packs: Mutex::new(Vec::new()),
        });
        let writer = writer::WriterHandle::spawn(sh.clone());
        Ok(Store {
            inner: Arc::new(Inner {
                sh,
                open: Mutex::new(OpenPack { builder: None, no: u32::MAX }),
                sealing: RwLock::new(()),
                writer,
                flush_lock: Mutex::new(()),
                gc_lock: RwLock::new(()),
                gc_running: Mutex::new(()),
                sessions: Mutex::new(HashMap::new()),
                next_session: AtomicU64::new(1),
                default_codec,
                pack_size,
                early_seal: caps_network,
                location,
                trees: caps_network.then(|| tree_cache::TreeCache::new(local_dir.join("trees"))),
                local_dir,
                leases,
                slices: slice::SliceCache::default(),
            }),
        })
    }

    /// Create a store in a local directory (the embedded default).
    pub fn init_local(dir: &Path, opts: InitOptions) -> Result<Store> {
        if dir.join("config").exists() {
            return Err(StoreError::AlreadyExists { location: dir.display().to_string() });
        }
        let b = LocalBackend::open(dir)?;
        Store::init(Arc::new(b), &local_meta_path(dir), opts)
    }

    /// Open a store in a local directory.
    pub fn open_local(dir: &Path) -> Result<Store> {
        if !dir.join("config").is_file() {
            return Err(StoreError::NotAStore { location: dir.display().to_string() });
        }
        let b = LocalBackend::open(dir)?;
        Store::open(Arc::new(b), &local_meta_path(dir))
    }

    pub fn backend(&self) -> &DynBackend {
        &self.inner.sh.backend
    }
    pub fn config(&self) -> &StoreConfig {
        &self.inner.sh.config
    }
    /// Bytes of packs uploaded by this instance, and the wall time uploads were running.
    pub fn upload_speed(&self) -> (u64, std::time::Duration) {
        self.inner.sh.uploads.measured()
    }
    pub fn stats(&self) -> &Stats {
        &self.inner.sh.stats
    }
    pub fn location(&self) -> &str {
        &self.inner.location
    }
    /// Host-local state directory (disk write logs, caches): next to the metadata cache.
    pub fn local_dir(&self) -> &Path {
        &self.inner.local_dir
    }

    /// Local copies of page-map trees, on a network backend (`tree_cache.rs`).
    pub fn tree_cache(&self) -> Option<&tree_cache::TreeCache> {
        self.inner.trees.as_ref()
    }

    pub fn default_codec(&self) -> Codec {
        self.inner.default_codec
    }
    pub fn is_poisoned(&self) -> bool {
        self.inner.sh.poison.lock().is_some()
    }

    /// Start a write session: chunks it puts or pins are safe from GC until it is dropped.
    pub fn session(&self) -> Session {
        let id = self.inner.next_session.fetch_add(1, Ordering::Relaxed);
        let pins = Arc::new(Mutex::new(HashSet::new()));
        self.inner.sessions.lock().insert(id, pins.clone());
        Session { store: self.clone(), id, pins }
    }

    /// Wall time (ns, all threads) spent waiting to hand sealed packs and flushes to the pack
    /// writer because its queue was full; a producer measures its share as a difference.
    pub fn writer_wait_ns(&self) -> u64 {
        self.inner.writer.wait_ns.load(Ordering::Relaxed)
    }

    pub fn contains(&self, id: &ChunkId) -> bool {
        self.inner.sh.index.read().chunks.contains_key(id)
    }

    /// Number of chunks in the index.
    pub fn chunk_count(&self) -> usize {
        self.inner.sh.index.read().chunks.len()
    }

    /// The pack and entry that hold a chunk.
    pub fn locate(&self, id: &ChunkId) -> Option<(PackId, PackEntry)> {
        let idx = self.inner.sh.index.read();
        let loc = idx.chunks.get(id)?;
        Some((idx.slot(loc.pack)?.id, loc.entry))
    }

    /// Locate many chunks, taking the index lock once per [`LOCATE_BATCH`] ids instead of once
    /// per id (a restore locates every page of a checkpoint: ~15,000 for 128 MiB). `f` gets
    /// each id's position in `ids` and its pack and entry, or `None` if the index lacks it. It
    /// runs under the lock, so it must not call back into the store.
    pub fn locate_many(&self, ids: &[ChunkId], mut f: impl FnMut(usize, Option<(PackId, &PackEntry)>)) {
        for (b, batch) in ids.chunks(LOCATE_BATCH).enumerate() {
            let idx = self.inner.sh.index.read();
            for (i, id) in batch.iter().enumerate() {
                let hit = idx.chunks.get(id).and_then(|loc| Some((idx.slot(loc.pack)?.id, &loc.entry)));
                f(b * LOCATE_BATCH + i, hit);
            }
        }
    }

    /// Raw length and kind of a chunk, without reading it.
    pub fn chunk_info(&self, id: &ChunkId) -> Option<(u32, ChunkKind)> {
        self.inner.sh.index.read().chunks.get(id).map(|l| (l.entry.raw_len, l.entry.kind))
    }

    /// Read a chunk and verify it against its id.
    pub fn get(&self, id: &ChunkId) -> Result<Vec<u8>> {
        let mut refreshed = false;
        for attempt in 0..3 {
            let loc = self.inner.sh.index.read().chunks.get(id).copied();
            let Some(loc) = loc else {
                // Another host may have written it since we opened: look once.
                if !refreshed && self.refresh()? > 0 {
                    refreshed = true;
                    continue;
                }
                return Err(StoreError::ChunkMissing { id: *id });
            };
            match self.read_loc(id, &loc) {
                // GC may have moved the chunk to a new pack between lookup and read.
                Err(StoreError::PackMissing { .. }) if attempt < 2 => continue,
                other => return other,
            }
        }
        unreachable!()
    }

    fn read_frame(&self, loc: &Loc) -> Result<Vec<u8>> {
        self.read_frame_range(loc, 0, loc.entry.frame_len as u64)
    }

    /// Bytes `[start, start + len)` of a chunk's stored frame (unverified; callers verify).
    fn read_frame_range(&self, loc: &Loc, start: u64, len: u64) -> Result<Vec<u8>> {
        let e = &loc.entry;
        let (pid, mem, durable) = {
            let idx = self.inner.sh.index.read();
            let slot = idx.slot(loc.pack).ok_or(StoreError::PackMissing { id: e.id, pack: PackId::default() })?;
            (slot.id, slot.mem.clone(), slot.durable)
        };
        let first = e.frame_off as usize + start as usize;
        let range = first..first + len as usize;
        if let Some(mem) = mem {
            return Ok(mem[range].to_vec());
        }
        if !durable {
            let open = self.inner.open.lock();
            if open.no == loc.pack {
                if let Some(b) = &open.builder {
                    return Ok(b.bytes()[range].to_vec());
                }
            }
        }
        // The pack may have been sealed while we looked; check memory once more, after any
        // seal still encoding its trailer.
        if !durable {
            drop(self.inner.sealing.write());
        }
        if let Some(mem) = self.inner.sh.index.read().slot(loc.pack).and_then(|s| s.mem.clone()) {
            return Ok(mem[range].to_vec());
        }
        self.inner
            .sh
            .backend
            .get_range(&pid.pack_key(), e.frame_off + start, len)
            .map_err(|err| match err.kind {
                ErrorKind::NotFound => StoreError::PackMissing { id: e.id, pack: pid },
                _ => StoreError::Backend(err),
            })
    }

    fn read_loc(&self, id: &ChunkId, loc: &Loc) -> Result<Vec<u8>> {
        let frame = self.read_frame(loc)?;
        let e = &loc.entry;
        if e.codec == Codec::None && e.off_in_frame == 0 && e.raw_len == e.frame_raw_len {
            // The frame is the chunk: verify in place and hand the buffer over without a copy.
            if format::crc(&frame) == e.frame_crc && ChunkId::of(&frame) == *id {
                return Ok(frame);
            }
        }
        let pack = self.inner.sh.index.read().slot(loc.pack).map(|s| s.id).unwrap_or_default();
        decode_chunk(&frame, e, pack)
    }

    /// Learn about packs other store instances (hosts) wrote since we opened. Returns how
    /// many were new. Called by reads that miss; cheap when nothing changed (one listing).
    pub fn refresh(&self) -> Result<usize> {
        // Never while our own GC runs: it may have unlinked chunks whose index objects it has
        // not deleted yet, and re-adding them would let a writer dedup against the dead.
        let Some(_no_gc) = self.inner.gc_running.try_lock() else { return Ok(0) };
        writer::refresh_index(&self.inner.sh)
    }

    /// Make every chunk put so far durable (packs, then their index objects).
    pub fn flush(&self) -> Result<()> {
        let _f = self.inner.flush_lock.lock();
        self.inner.sh.check_poison()?;
        let sealing = {
            let mut open = self.inner.open.lock();
            self.seal_locked(&mut open)
        };
        self.send_sealed(sealing)?;
        // Packs other threads sealed before this flush must reach the writer before it does.
        drop(self.inner.sealing.write());
        self.inner.writer.flush()
    }

    /// On a network backend, seal the open pack now and queue its upload without waiting for
    /// it: a memory save calls this when the stream has ended, so its last pages go up while
    /// the page maps are written (they then make a small pack of their own). [`Store::flush`]
    /// stays the durability point. A no-op on other backends (one pack fewer to sync).
    pub fn seal_for_upload(&self) -> Result<()> {
        if !self.inner.early_seal {
            return Ok(());
        }
        let _f = self.inner.flush_lock.lock();
        self.inner.sh.check_poison()?;
        let sealing = {
            let mut open = self.inner.open.lock();
            self.seal_locked(&mut open)
        };
        self.send_sealed(sealing)
    }

    /// Take the open pack (if any) for sealing, under the `open` lock; the caller drops that
    /// lock and passes the result to [`Store::send_sealed`], which encodes the pack's trailer
    /// (compressing it: ~1 ms per 5000 chunks) without blocking other writers.
    fn seal_locked(&self, open: &mut OpenPack) -> Option<Sealing<'_>> {
        let b = open.builder.take()?;
        if b.is_empty() {
            return None;
        }
        // Taken before `open` is released: a reader that then finds the pack neither open nor
        // in memory waits on it (see `read_frame_range`).
        let gate = self.inner.sealing.read();
        let no = open.no;
        open.no = u32::MAX;
        self.inner.sh.uploads.sealed();
        Some(Sealing { no, builder: b, _gate: gate })
    }

    /// Finish a pack taken by [`Store::seal_locked`], make it readable from memory and hand
    /// it to the writer.
    fn send_sealed(&self, sealing: Option<Sealing<'_>>) -> Result<()> {
        let Some(Sealing { no, builder, _gate }) = sealing else { return Ok(()) };
        let id = builder.id;
        let (bytes, entries) = builder.finish();
        let bytes = Arc::new(bytes);
        {
            let mut idx = self.inner.sh.index.write();
            if let Some(Some(slot)) = idx.packs.get_mut(no as usize) {
                slot.size = bytes.len() as u64;
                slot.mem = Some(bytes.clone());
            }
        }
        // The gate is held until the writer has the pack, so a flush queued after it waits.
        self.inner.writer.send(Job::Pack { no, id, bytes, entries })
    }

    /// Append one frame holding `items` (ids must be BLAKE3 of the data). Returns the number of
    /// chunks that were new. Used by sessions.
    fn put_frame_inner(&self, items: &[(ChunkId, &[u8])], kind: ChunkKind, codec: Codec, pre: Option<Precompressed>) -> Result<usize> {
        let sh = &self.inner.sh;
        let fresh: Vec<(ChunkId, &[u8])> = {
            let idx = sh.index.read();
            let mut fresh: Vec<(ChunkId, &[u8])> = Vec::with_capacity(items.len());
            for &(id, d) in items {
                // Frames are small (<= 16 chunks): a linear scan finds repeats within one.
                if !idx.chunks.contains_key(&id) && !fresh.iter().any(|(f, _)| *f == id) {
                    fresh.push((id, d));
                }
            }
            fresh
        };
        let dups = (items.len() - fresh.len()) as u64;
        sh.stats.chunks_dedup.fetch_add(dups, Ordering::Relaxed);
        if fresh.is_empty() {
            return Ok(0);
        }
        let raw_total: usize = fresh.iter().map(|(_, d)| d.len()).sum();
        if raw_total > MAX_FRAME_RAW {
            return Err(StoreError::TooLarge { size: raw_total });
        }
        // Compressed frames need their chunks joined; raw ones are copied part by part
        // straight into the pack.
        let pre = pre.filter(|p| p.ids.len() == fresh.len() && p.ids.iter().zip(&fresh).all(|(a, (b, _))| a == b));
        let compressed: Option<Vec<u8>> = if codec == Codec::None {
            None
        } else if let Some(p) = pre {
            p.stored
        } else if fresh.len() == 1 {
            codec.compress(fresh[0].1)
        } else {
            let mut j = Vec::with_capacity(raw_total);
            for (_, d) in &fresh {
                j.extend_from_slice(d);
            }
            codec.compress(&j)
        };
        let stored_len = compressed.as_ref().map_or(raw_total, Vec::len);
        let job = {
            let mut open = self.inner.open.lock();
            sh.check_poison()?;
            // Another thread may have stored some of these meanwhile; the frame still holds
            // their bytes but only absent ids get index entries.
            let absent: Vec<bool> = {
                let idx = sh.index.read();
                fresh.iter().map(|(id, _)| !idx.chunks.contains_key(id)).collect()
            };
            if !absent.iter().any(|a| *a) {
                return Ok(0);
            }
            if open.builder.is_none() {
                let id = PackId::random();
                open.no = sh.index.write().add_slot(PackSlot { id, size: 0, mem: None, durable: false });
                let reserve = self.pack_reserve();
                let spare = sh.spare_packs.lock().pop().filter(|b| b.capacity() >= reserve);
                open.builder = Some(match spare {
                    Some(buf) => PackBuilder::with_buffer(id, buf),
                    None => PackBuilder::with_capacity(id, reserve),
                });
            }
            let no = open.no;
            let b = open.builder.as_mut().unwrap();
            let chunks: Vec<(ChunkId, u32, ChunkKind)> =
                fresh.iter().map(|(id, d)| (*id, d.len() as u32, kind)).collect();
            let entries = match &compressed {
                Some(z) => b.add_frame(z, codec, &chunks).to_vec(),
                None => {
                    let parts: Vec<&[u8]> = fresh.iter().map(|(_, d)| *d).collect();
                    b.add_frame_parts(&parts, &chunks).to_vec()
                }
            };
            {
                let mut idx = sh.index.write();
                for (e, a) in entries.iter().zip(&absent) {
                    if *a {
                        idx.chunks.insert(e.id, Loc { pack: no, entry: *e });
                    }
                }
            }
            let n_new = absent.iter().filter(|a| **a).count();
            sh.stats.chunks_new.fetch_add(n_new as u64, Ordering::Relaxed);
            sh.stats.raw_bytes_new.fetch_add(raw_total as u64, Ordering::Relaxed);
            sh.stats.stored_bytes_new.fetch_add(stored_len as u64, Ordering::Relaxed);
            // On a network backend a pack is also sealed as soon as the uploader has room, so
            // uploads overlap the producer (a small save would otherwise upload only at its
            // flush); while the backend is the bottleneck packs still grow to full size.
            let early = self.inner.early_seal
                && match sh.uploads.pending() {
                    0 => b.len() >= EARLY_SEAL_IDLE_BYTES,
                    n => n < EARLY_SEAL_UPLOADS && b.len() >= EARLY_SEAL_BYTES,
                };
            let sealed = if b.len() >= self.inner.pack_size || early { self.seal_locked(&mut open) } else { None };
            (sealed, n_new)
        };
        let (sealing, n_new) = job;
        self.send_sealed(sealing)?;
        Ok(n_new)
    }

    /// Bytes reserved for an open pack: a full pack, its largest last frame and its trailer
    /// (64-byte entries per chunk of at least 4 KiB).
    fn pack_reserve(&self) -> usize {
        let p = self.inner.pack_size as usize;
        p + p / 32 + MAX_FRAME_RAW + (1 << 16)
    }

    /// Copy an existing stored frame into the open pack (GC repacking): the chunks listed
    /// (id, offset in frame, length, kind) are re-pointed at the copy.
    pub(crate) fn put_raw_frame(&self, stored: &[u8], template: &PackEntry, chunks: &[(ChunkId, u32, u32, ChunkKind)]) -> Result<()> {
        let sh = &self.inner.sh;
        let job = {
            let mut open = self.inner.open.lock();
            sh.check_poison()?;
            if open.builder.is_none() {
                let id = PackId::random();
                open.no = sh.index.write().add_slot(PackSlot { id, size: 0, mem: None, durable: false });
                open.builder = Some(PackBuilder::new(id));
            }
            let no = open.no;
            let b = open.builder.as_mut().unwrap();
            let entries = b.add_frame_at(stored, template.codec, template.frame_raw_len, chunks).to_vec();
            {
                let mut idx = sh.index.write();
                for e in entries {
                    idx.chunks.insert(e.id, Loc { pack: no, entry: e });
                }
            }
            if b.len() >= self.inner.pack_size { self.seal_locked(&mut open) } else { None }
        };
        self.send_sealed(job)
    }

    /// Read a ref.
    pub fn get_ref(&self, name: &str) -> Result<Option<Ref>> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        let key = format!("refs/{name}");
        match self.inner.sh.backend.get(&key) {
            Ok(b) => Ref::decode(&b).map(Some).map_err(|source| StoreError::Format { key, source }),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Names of all refs under `prefix` (e.g. `disk/`), sorted.
    pub fn list_refs(&self, prefix: &str) -> Result<Vec<String>> {
        let mut v: Vec<String> = self
            .inner
            .sh
            .backend
            .list(&format!("refs/{prefix}"))?
            .into_iter()
            .filter_map(|o| o.key.strip_prefix("refs/").map(str::to_string))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Delete a ref durably. Its chunks become garbage for the next GC.
    pub fn delete_ref(&self, name: &str) -> Result<()> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        self.inner.sh.check_poison()?;
        let _tmp = self.lease_for_commit(name)?;
        if self.get_ref(name)?.is_none() {
            return Err(StoreError::RefNotFound { name: name.into() });
        }
        let key = format!("refs/{name}");
        self.inner.sh.backend.delete(&key).map_err(|e| {
            self.inner.sh.poison(&e);
            StoreError::Backend(e)
        })?;
        self.inner.sh.sync()
    }

    /// Take the writer lease on ref `name` (e.g. `disk/desk1`) for as long as the guard lives:
    /// no other store instance, on any host, can commit or delete that ref meanwhile.
    pub fn lease(&self, name: &str) -> Result<lease::LeaseGuard> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        Ok(self.inner.leases.acquire_ref(name)?)
    }

    /// Like [`Store::lease`], but None if this instance already holds the lease (an outer
    /// operation took it), so nested operations on one name compose.
    pub fn lease_if_needed(&self, name: &str) -> Result<Option<lease::LeaseGuard>> {
        if self.inner.leases.holds_ref(name) {
            self.inner.leases.check_ref(name)?;
            return Ok(None);
        }
        self.lease(name).map(Some)
    }

    /// Lease time-to-live for leases taken from now on (default 30 s, `STRATA_LEASE_TTL_MS`).
    pub fn set_lease_ttl(&self, ttl: std::time::Duration) {
        self.inner.leases.set_ttl(ttl);
    }

    /// Before a ref is written: our presence must be unbroken (no GC can have run), and we
    /// must hold the name's lease, taking it for this commit if nobody does.
    fn lease_for_commit(&self, name: &str) -> Result<Option<lease::LeaseGuard>> {
        self.inner.leases.check_presence()?;
        if self.inner.leases.holds_ref(name) {
            self.inner.leases.check_ref(name)?;
            Ok(None)
        } else {
            match self.inner.leases.acquire_ref(name) {
                Ok(g) => Ok(Some(g)),
                // Another thread of this instance is committing it right now: same writer.
                Err(lease::LeaseError::AlreadyHeld { .. }) => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
    }

    /// Persist the metadata cache and stop the writer (also done on drop).
    pub fn close(self) -> Result<()> {
        self.flush()?;
        self.inner.sh.meta.persist()?;
        Ok(())
    }
}

/// Decompress a frame, slice the chunk out, and verify its hash.
pub(crate) fn decode_chunk(frame: &[u8], e: &PackEntry, pack: PackId) -> Result<Vec<u8>> {
    let corrupt = |reason: String| StoreError::Corrupt { id: e.id, pack, offset: e.frame_off, reason };
    if format::crc(frame) != e.frame_crc {
        return Err(corrupt("frame checksum mismatch".into()));
    }
    if e.codec == Codec::None && e.off_in_frame == 0 && e.raw_len == e.frame_raw_len {
        // A whole uncompressed frame is the chunk itself: verify it in place.
        if ChunkId::of(frame) != e.id {
            return Err(corrupt("content does not match its hash".into()));
        }
        return Ok(frame.to_vec());
    }
    let raw = e.codec.decompress(frame, e.frame_raw_len as usize).map_err(|err| corrupt(err.to_string()))?;
    let data = raw[e.off_in_frame as usize..(e.off_in_frame + e.raw_len) as usize].to_vec();
    if ChunkId::of(&data) != e.id {
        return Err(corrupt("content does not match its hash".into()));
    }
    Ok(data)
}

/// Where the local backend keeps its metadata cache.
pub fn local_meta_path(dir: &Path) -> PathBuf {
    dir.join(".meta").join("meta.redb")
}

/// A writer's view of the store; see the module comment for why writes go through sessions.
pub struct Session {
    store: Store,
    id: u64,
    pins: Arc<Mutex<HashSet<ChunkId>>>,
}

impl Session {
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Store one chunk with the store's default codec.
    pub fn put(&self, data: &[u8], kind: ChunkKind) -> Result<ChunkId> {
        self.put_with(data, kind, self.store.inner.default_codec)
    }

    pub fn put_with(&self, data: &[u8], kind: ChunkKind, codec: Codec) -> Result<ChunkId> {
        let id = ChunkId::of(data);
        self.put_frame(&[(id, data)], kind, codec)?;
        Ok(id)
    }

    /// Store several chunks compressed together as one frame (ids must be BLAKE3 of the
    /// data; chunks already present are skipped). Returns how many were new.
    pub fn put_frame(&self, items: &[(ChunkId, &[u8])], kind: ChunkKind, codec: Codec) -> Result<usize> {
        self.put_frame_pre(items, kind, codec, None)
    }

    /// [`put_frame`](Self::put_frame) with the frame possibly compressed already: `pre` is
    /// used when its ids are exactly the chunks the frame stores (those not in the store, in
    /// order, repeats once), and ignored otherwise (another thread stored one meanwhile).
    pub fn put_frame_pre(&self, items: &[(ChunkId, &[u8])], kind: ChunkKind, codec: Codec, pre: Option<Precompressed>) -> Result<usize> {
        debug_assert!(items.iter().all(|(id, d)| ChunkId::of(d) == *id));
        let _g = self.store.inner.gc_lock.read();
        self.store.inner.sh.check_poison()?;
        self.pins.lock().extend(items.iter().map(|(id, _)| *id));
        self.store.put_frame_inner(items, kind, codec, pre)
    }

    /// Store a tree chunk.
    pub fn put_tree(&self, tree: &Tree) -> Result<ChunkId> {
        self.put(&tree.encode(), ChunkKind::Tree)
    }

    /// Keep an existing chunk (e.g. the root of a clone source) alive for this session.
    pub fn pin(&self, id: ChunkId) -> Result<()> {
        let _g = self.store.inner.gc_lock.read();
        if !id.is_zero() && !self.store.contains(&id) && (self.store.refresh()? == 0 || !self.store.contains(&id)) {
            return Err(StoreError::ChunkMissing { id });
        }
        self.pins.lock().insert(id);
        Ok(())
    }

    /// Durably point `name` at `r`: flush everything first, then write the ref.
    pub fn commit_ref(&self, name: &str, r: Ref) -> Result<()> {
        self.commit_ref_inner(name, r, false)
    }

    /// [`commit_ref`](Self::commit_ref), refused with [`StoreError::RefExists`] (and nothing
    /// written) when `name` already exists: the check runs under the name's lease, after the
    /// flush, so it is the last word on a name a caller checked earlier.
    pub fn commit_new_ref(&self, name: &str, r: Ref) -> Result<()> {
        self.commit_ref_inner(name, r, true)
    }

    fn commit_ref_inner(&self, name: &str, mut r: Ref, must_be_new: bool) -> Result<()> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        let inner = &self.store.inner;
        let _g = inner.gc_lock.read();
        for root in &r.roots {
            if !root.is_zero() && !self.store.contains(root) && (self.store.refresh()? == 0 || !self.store.contains(root)) {
                return Err(StoreError::MissingRoot { name: name.into(), id: *root });
            }
            self.pins.lock().insert(*root);
        }
        // One writer per name: commit under our lease, or take one for this commit alone.
        let _tmp = self.store.lease_for_commit(name)?;
        let t0 = std::time::Instant::now();
        // The old ref (for the generation, and `must_be_new`) is read while the packs are
        // flushed: under the lease nobody else writes it meanwhile.
        let (flushed, old) = std::thread::scope(|s| {
            let old = s.spawn(|| self.store.get_ref(name));
            (self.store.flush(), old.join())
        });
        flushed?;
        tracing::debug!(target: "strata::store", name, flush_ms = t0.elapsed().as_secs_f64() * 1e3, "flushed for a ref");
        let old = match old {
            Ok(Ok(o)) => o,
            // An unreadable old ref only costs its generation number, unless the name must be
            // new: then not knowing is a refusal.
            Ok(Err(e)) if must_be_new => return Err(e),
            _ => None,
        };
        if must_be_new && old.is_some() {
            return Err(StoreError::RefExists { name: name.into() });
        }
        r.generation = old.map(|o| o.generation + 1).unwrap_or(1);
        let key = format!("refs/{name}");
        inner.sh.backend.put(&key, &r.encode()).map_err(|e| {
            inner.sh.poison(&e);
            StoreError::Backend(e)
        })?;
        inner.sh.sync()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let mut sessions = self.store.inner.sessions.lock();
        sessions.remove(&self.id);
        // The last writer is gone: do not keep spare pack buffers (up to ~140 MiB) in an idle
        // process such as `strata serve`.
        if sessions.is_empty() {
            self.store.inner.sh.spare_packs.lock().clear();
        }
    }
}

#[cfg(test)]
mod gc_tests;
#[cfg(test)]
mod tests;

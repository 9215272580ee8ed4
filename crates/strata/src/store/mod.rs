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
//! [`EARLY_SEAL_IDLE_BYTES`] while nothing is, both ramping up from
//! [`EARLY_SEAL_FIRST_BYTES`] after each ref commit), and its index object
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
pub mod map;
pub mod meta;
pub mod objects;
pub mod pack;
mod read;
pub mod ref_copies;
mod refs;
mod session;
pub mod slice;
pub mod tree_cache;
mod writer;

use crate::backend::{local::LocalBackend, BackendError, DynBackend, ErrorKind};
use crate::codec::{Codec, CodecError, MAX_FRAME_RAW};
use crate::id::{ChunkId, PackId};
use format::{FormatError, FORMAT_VERSION};
use meta::{Meta, MetaError};
use objects::{StoreConfig, StoreSettings};
use pack::{PackBuilder, PackEntry};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) use read::decode_chunk;
pub use session::{Precompressed, Session};
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
    Format {
        key: String,
        #[source]
        source: FormatError,
    },
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
    #[error(
        "Root chunk {id} of ref '{name}' is not in the store (was its source deleted meanwhile?)"
    )]
    MissingRoot { name: String, id: ChunkId },
    #[error(
        "Store is poisoned after a failed write ({reason}); fix the cause and reopen the store"
    )]
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
    /// Buffers of packs whose put finished, for the next open packs (at most
    /// [`SPARE_PACK_BUFFERS`], dropped when the last session ends): a fresh 16 MiB buffer
    /// costs ~4,000 page faults as it fills, a quarter of a memory save's pool CPU before
    /// buffers were reused.
    pub spare_packs: Mutex<Vec<Vec<u8>>>,
}

/// Pack buffers kept for reuse (each the size of a full pack plus slack): a memory save flushes
/// every 128 MiB, eight 16 MiB packs; [`writer::UPLOADS`] puts, the queue and the open pack
/// need fewer.
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

struct OpenPack {
    builder: Option<PackBuilder>,
    no: u32,
    /// Size at which the open pack is sealed early while nothing is uploading: ramps from
    /// `session::EARLY_SEAL_FIRST_BYTES` to `EARLY_SEAL_IDLE_BYTES` (doubling per idle seal)
    /// after each ref commit, so the first upload of a save leaves within a few ms.
    idle_seal_at: u64,
    /// Size at which the open pack is sealed early while one pack is uploading: ramps from
    /// twice `EARLY_SEAL_FIRST_BYTES` to `EARLY_SEAL_BYTES` (doubling per such seal) after
    /// each ref commit, so a save's first uploads overlap instead of leaving the link idle at
    /// every request's end.
    busy_seal_at: u64,
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
    /// One refresh at a time (`read.rs`), so a reader that misses while another refreshes
    /// waits for it instead of finding the GC lock taken and giving up.
    refreshing: Mutex<()>,
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
    /// Local copies of refs (network backends only; `ref_copies.rs`).
    pub ref_copies: Option<ref_copies::RefCopies>,
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
        let config = StoreConfig::decode(&raw)
            .map_err(|source| StoreError::Format { key: "config".into(), source })?;
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
        let local_dir =
            meta_path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
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
                open: Mutex::new(OpenPack {
                    builder: None,
                    no: u32::MAX,
                    idle_seal_at: session::EARLY_SEAL_FIRST_BYTES,
                    busy_seal_at: 2 * session::EARLY_SEAL_FIRST_BYTES,
                }),
                sealing: RwLock::new(()),
                writer,
                flush_lock: Mutex::new(()),
                gc_lock: RwLock::new(()),
                gc_running: Mutex::new(()),
                refreshing: Mutex::new(()),
                sessions: Mutex::new(HashMap::new()),
                next_session: AtomicU64::new(1),
                default_codec,
                pack_size,
                early_seal: caps_network,
                location,
                trees: caps_network.then(|| tree_cache::TreeCache::new(local_dir.join("trees"))),
                ref_copies: caps_network
                    .then(|| ref_copies::RefCopies::new(local_dir.join("refs"))),
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
    /// Bytes stored but not yet acknowledged by the backend: the open pack and the sealed
    /// packs waiting or uploading. A save reads it to tell whether the link is what holds it
    /// back (see `memory::codec_choice::ADAPT_QUEUED_SECS`).
    pub fn unsent_bytes(&self) -> u64 {
        let open = self.inner.open.lock().builder.as_ref().map_or(0, |b| b.len());
        open + self.inner.sh.uploads.pending_bytes()
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

    /// Local copies of refs, on a network backend (`ref_copies.rs`).
    pub fn ref_copies(&self) -> Option<&ref_copies::RefCopies> {
        self.inner.ref_copies.as_ref()
    }

    pub fn default_codec(&self) -> Codec {
        self.inner.default_codec
    }
    pub fn is_poisoned(&self) -> bool {
        self.inner.sh.poison.lock().is_some()
    }

    /// Wall time (ns, all threads) spent waiting to hand sealed packs and flushes to the pack
    /// writer because its queue was full; a producer measures its share as a difference.
    pub fn writer_wait_ns(&self) -> u64 {
        self.inner.writer.wait_ns.load(Ordering::Relaxed)
    }

    /// Persist the metadata cache and stop the writer (also done on drop).
    pub fn close(self) -> Result<()> {
        self.flush()?;
        self.inner.sh.meta.persist()?;
        Ok(())
    }
}

/// Where the local backend keeps its metadata cache.
pub fn local_meta_path(dir: &Path) -> PathBuf {
    dir.join(".meta").join("meta.redb")
}

#[cfg(test)]
mod gc_tests;
#[cfg(test)]
mod tests;

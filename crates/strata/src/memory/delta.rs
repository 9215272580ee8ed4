//! Delta pages: a page that is new to the store but differs from the page at the same
//! (ramblock, offset) of a *base checkpoint* in only a few bytes is stored as the changed byte
//! runs against that base page, not as a whole page.
//!
//! ```text
//! page map entry of a delta page = id of a delta record (a tree chunk):
//!   children  [base page id]            (zero id = an all-zero base page)
//!   payload   "SVMP" | page id (32, BLAKE3 of the page) | runs
//!   runs      repeated: le16 offset | le16 length (1..=4096) | new bytes, in order, inside the page
//! ```
//!
//! Why this shape:
//! * Integrity is unchanged: the page map names the record by its BLAKE3 id, the record holds
//!   the page's full BLAKE3 id, and a restore reads and verifies the base page, applies the
//!   runs and verifies the result against that id before QEMU sees it.
//! * The base page is the record's *child*, so GC, `check` and `du` reach it through the
//!   dependent checkpoint's own page maps like any tree: removing the base checkpoint never
//!   breaks a checkpoint whose deltas need its pages, and nothing in the store layer knows
//!   about deltas. Base pages are always whole pages (a base entry that is itself a delta
//!   record is rebuilt, and the new delta is taken against *its* base), so a restore reads
//!   at most one base page per delta page: no chains. A page unchanged since a base where it
//!   was a delta reuses the base's record (same id: no new chunk).
//! * Base selection needs no thought from the operator: the most recent checkpoint in the
//!   store with the same machine type and ramblocks (names and sizes), which includes an
//!   earlier checkpoint of the same VM; `--base NAME` picks one, `--no-delta` turns it off.
//! * Cost: only pages that are new to the store are tried, and a worker that sees a batch
//!   where deltas mostly do not pay skips the next batches (exponential back-off), so random
//!   per-user data costs few base reads. Without a base nothing changes.
//!
//! [`parse_record`] and [`apply`] are pure functions over bytes, fuzzed by
//! `fuzz/fuzz_targets/checkpoint_delta.rs`; `docs/format-checkpoint.md` has the tables.
#![allow(clippy::result_large_err)] // a MemError is returned once per save or restore

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::error::MemError;
use super::manifest::{Checkpoint, REF_PREFIX, RUN_BYTES, RUN_PAGES};
use super::stream::PAGE_SIZE;
use crate::endian;
use crate::id::{ChunkId, PackId};
use crate::store::format::crc;
use crate::store::objects::Tree;
use crate::store::pack::ChunkKind;
use crate::store::{Session, Store, StoreError};

const TARGET: &str = "strata::memory";
/// Magic at the start of a delta record's payload.
pub(crate) const RECORD_MAGIC: &[u8; 4] = b"SVMP";
/// Delta records written together in one compressed frame.
pub(crate) const RECORDS_PER_FRAME: usize = 16;
/// Longest encoded delta a save keeps: beyond this the page is stored whole.
pub(crate) const MAX_KEPT: usize = 2048;
/// Deltas up to this many bytes are always kept; longer ones only when at most half the size
/// of the page compressed on its own (lz4), i.e. when the delta is much smaller.
pub(crate) const ALWAYS_KEPT: usize = 256;

/// Is a delta of `enc_len` bytes worth keeping instead of `page`?
pub fn pays(enc_len: usize, page: &[u8]) -> bool {
    if enc_len <= ALWAYS_KEPT {
        return true;
    }
    if enc_len > MAX_KEPT {
        return false;
    }
    let alone = crate::codec::Codec::Lz4.compress(page).map_or(page.len(), |c| c.len());
    enc_len * 2 <= alone
}
/// Most batches a pool worker skips after batches where deltas did not pay.
pub(crate) const MAX_BACK_OFF: u32 = 8;
/// Longest encoded delta a reader accepts (one run covering the page).
pub const MAX_ENCODED: usize = PAGE_SIZE + 4;

/// Which base checkpoint a save takes deltas against.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BasePolicy {
    /// The most recent checkpoint with the same machine type and RAM layout.
    #[default]
    Auto,
    /// This checkpoint (`--base NAME`); its layout must match.
    Named(String),
    /// No delta pages (`--no-delta`).
    Off,
}

/// Why a delta object was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeltaError {
    #[error("Delta object is malformed: {why}")]
    Malformed { why: String },
}

fn malformed(why: impl Into<String>) -> DeltaError {
    DeltaError::Malformed { why: why.into() }
}

/// Encode `page` as runs of bytes that differ from `base`, word by word. Returns false (and
/// leaves `out` unspecified) when the encoding would exceed `limit` bytes.
pub fn encode(base: &[u8], page: &[u8], out: &mut Vec<u8>, limit: usize) -> bool {
    debug_assert!(base.len() == PAGE_SIZE && page.len() == PAGE_SIZE);
    out.clear();
    let words = PAGE_SIZE / 8;
    let word =
        |b: &[u8], i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let mut i = 0;
    while i < words {
        if word(base, i) == word(page, i) {
            i += 1;
            continue;
        }
        let start = i;
        while i < words && word(base, i) != word(page, i) {
            i += 1;
        }
        let (a, z) = (start * 8, i * 8);
        if out.len() + 4 + (z - a) > limit {
            return false;
        }
        out.extend_from_slice(&(a as u16).to_le_bytes());
        out.extend_from_slice(&((z - a) as u16).to_le_bytes());
        out.extend_from_slice(&page[a..z]);
    }
    true
}

/// Apply encoded runs to a copy of `base`. Runs must be in order, non-overlapping and inside
/// the page; anything else is an error (never a panic).
pub fn apply(base: &[u8], enc: &[u8]) -> Result<Box<[u8; PAGE_SIZE]>, DeltaError> {
    if base.len() != PAGE_SIZE {
        return Err(malformed("base is not one page"));
    }
    if enc.len() > MAX_ENCODED {
        return Err(malformed("delta longer than a page"));
    }
    let mut page: Box<[u8; PAGE_SIZE]> = Box::new(base.try_into().expect("page-sized"));
    let mut pos = 0usize;
    let mut next = 0usize;
    while pos < enc.len() {
        let head = enc.get(pos..pos + 4).ok_or_else(|| malformed("truncated run header"))?;
        let off = endian::le16(head, 0) as usize;
        let len = endian::le16(head, 2) as usize;
        pos += 4;
        if len == 0 || off < next || off + len > PAGE_SIZE {
            return Err(malformed(format!("run {off:#x}+{len} out of order or outside the page")));
        }
        let bytes = enc.get(pos..pos + len).ok_or_else(|| malformed("truncated run"))?;
        page[off..off + len].copy_from_slice(bytes);
        pos += len;
        next = off + len;
    }
    Ok(page)
}

/// One delta page: the page's id, the whole base page it is relative to, the runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaEntry {
    pub target: ChunkId,
    pub base: ChunkId,
    pub enc: Vec<u8>,
}

/// Build a delta record (a tree chunk).
pub fn record_tree(e: &DeltaEntry) -> Tree {
    let mut payload = Vec::with_capacity(36 + e.enc.len());
    payload.extend_from_slice(RECORD_MAGIC);
    payload.extend_from_slice(&e.target.0);
    payload.extend_from_slice(&e.enc);
    Tree { children: vec![e.base], payload }
}

/// True when a tree looks like a delta record (one child, `SVMP` payload).
pub fn is_record(t: &Tree) -> bool {
    t.children.len() == 1 && t.payload.starts_with(RECORD_MAGIC)
}

/// Read a delta record back (runs are checked when applied). Pure, for cargo-fuzz.
pub fn parse_record(t: &Tree) -> Result<DeltaEntry, DeltaError> {
    if t.children.len() != 1 {
        return Err(malformed(format!("{} base ids, expected 1", t.children.len())));
    }
    let p = &t.payload;
    if p.len() < 36 || &p[..4] != RECORD_MAGIC {
        return Err(malformed("payload is not SVMP + page id"));
    }
    if p.len() - 36 > MAX_ENCODED {
        return Err(malformed("delta longer than a page"));
    }
    let target = ChunkId(endian::array(p, 4));
    if target.is_zero() {
        return Err(malformed("zero page id"));
    }
    Ok(DeltaEntry { target, base: t.children[0], enc: p[36..].to_vec() })
}

/// Read a delta record from the store and rebuild its page: the record and the base page
/// are verified against their ids, the result against the page id the record holds.
pub fn rebuild(
    store: &Store,
    record: &ChunkId,
) -> Result<(ChunkId, Box<[u8; PAGE_SIZE]>), StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        id: *record,
        pack: Default::default(),
        offset: 0,
        reason,
    };
    let t = Tree::decode(&store.get(record)?)
        .map_err(|source| StoreError::Format { key: format!("chunk {record}"), source })?;
    let e = parse_record(&t).map_err(|e| corrupt(e.to_string()))?;
    let base_page = if e.base.is_zero() { vec![0u8; PAGE_SIZE] } else { store.get(&e.base)? };
    let page = apply(&base_page, &e.enc)
        .map_err(|x| corrupt(format!("delta against base {}: {x}", e.base)))?;
    if ChunkId::of(&page[..]) != e.target {
        return Err(corrupt(format!(
            "delta applied to base {} does not match page {}",
            e.base, e.target
        )));
    }
    Ok((e.target, page))
}

/// The base checkpoint of a save: its page maps by ramblock name.
#[derive(Debug)]
pub struct Base {
    pub name: String,
    /// (ramblock name, used length, page ids or delta record ids).
    pub blocks: Vec<(String, u64, Vec<ChunkId>)>,
}

/// Pick and load the base checkpoint for a save of a VM with `machine` and `ram` (ramblock
/// name and used length). `Ok(None)` when there is none to use; a named base that does not
/// fit is an error.
pub fn select_base(
    store: &Store,
    policy: &BasePolicy,
    saving: &str,
    machine: &str,
    ram: &[(String, u64)],
) -> Result<Option<Base>, MemError> {
    let fits = |c: &Checkpoint| {
        let m = &c.manifest;
        let mut a: Vec<(&str, u64)> =
            m.blocks.iter().map(|b| (b.name.as_str(), b.used_len)).collect();
        let mut b: Vec<(&str, u64)> = ram.iter().map(|(n, l)| (n.as_str(), *l)).collect();
        a.sort_unstable();
        b.sort_unstable();
        m.qemu.machine_type == machine && a == b
    };
    let ckpt = match policy {
        BasePolicy::Off => return Ok(None),
        BasePolicy::Named(n) => {
            let c = super::restore::load_checkpoint(store, n)?;
            if !fits(&c) {
                return Err(MemError::BaseMismatch {
                    base: n.clone(),
                    why: format!(
                        "it was taken on '{}' with ramblocks {}, this VM is '{machine}' with {}",
                        c.manifest.qemu.machine_type,
                        c.manifest
                            .blocks
                            .iter()
                            .map(|b| format!("{}={}K", b.name, b.used_len >> 10))
                            .collect::<Vec<_>>()
                            .join(","),
                        ram.iter()
                            .map(|(n, l)| format!("{n}={}K", l >> 10))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                });
            }
            c
        }
        BasePolicy::Auto => {
            let names = store.list_refs(REF_PREFIX).map_err(MemError::store("list", "vm/"))?;
            let mut best: Option<Checkpoint> = None;
            for r in names {
                let n = r.strip_prefix(REF_PREFIX).unwrap_or(&r);
                // Unreadable refs are skipped: a base is an optimisation, never a requirement.
                let Ok(c) = super::restore::load_checkpoint(store, n) else { continue };
                if !fits(&c) {
                    continue;
                }
                let key = |c: &Checkpoint| (c.manifest.created_unix, c.manifest.name == saving);
                if best.as_ref().is_none_or(|b| key(&c) > key(b)) {
                    best = Some(c);
                }
            }
            match best {
                Some(c) => c,
                None => return Ok(None),
            }
        }
    };
    let name = ckpt.manifest.name.clone();
    // Slot tables (version 4) are not needed here: a base page that names a run is compared
    // with the run's slot at its own place, and mapped back only to that slot when equal.
    let maps = super::restore::read_maps(store, &ckpt.map_roots, super::restore::MAP_READERS)
        .map(|m| m.ids)
        .map_err(|(bi, source)| MemError::MetaDamaged {
            name: name.clone(),
            what: format!(
                "page map of ramblock '{}' (as a delta base)",
                ckpt.manifest.blocks[bi].name
            ),
            source,
        })?;
    let blocks = ckpt
        .manifest
        .blocks
        .iter()
        .zip(maps)
        .map(|(b, ids)| (b.name.clone(), b.used_len, ids))
        .collect();
    tracing::debug!(target: TARGET, base = %name, "delta base loaded");
    Ok(Some(Base { name, blocks }))
}

/// Save-side state shared by the ingest pool.
pub struct DeltaSink<'a> {
    pub base: &'a Base,
    /// Stream ramblock index -> index into `base.blocks` (set when the stream lists its blocks).
    pub by_stream_block: std::sync::OnceLock<Vec<Option<usize>>>,
    /// Page id -> delta record id, for pages this save stored as deltas.
    targets: Mutex<HashMap<ChunkId, ChunkId>>,
    pub pages: AtomicU64,
    pub bytes: AtomicU64,
    pub records: AtomicU64,
    pub attempts: AtomicU64,
    pub skipped_batches: AtomicU64,
    /// Decompressed frames of base chunks read lately ([`DeltaSink::read_base`]).
    frames: Mutex<BaseFrames>,
    reads: BaseReads,
    /// Backend bytes base reads may cost beyond [`READ_PER_SAVED`] per byte the deltas saved
    /// (None: no limit; see [`DeltaSink::with_read_budget`]).
    allowance: Option<u64>,
    /// Page bytes the deltas kept out of the store (page size minus runs, an upper bound).
    saved: AtomicU64,
}

/// Bytes of base frames a save on a network backend may read before its deltas have saved
/// anything (about 70 frames of pages).
pub(crate) const READ_ALLOWANCE: u64 = 4 << 20;
/// Past the allowance, base reads may cost this many bytes per byte the deltas saved.
pub(crate) const READ_PER_SAVED: u64 = 2;

/// Frames of base chunks, decompressed, the last [`BASE_FRAMES`] read. A live checkpoint's
/// dirtied pages lie side by side, and so do their base pages in the base's frames (32 pages
/// each): read through `Store::get`, every base page would fetch and decompress its whole
/// frame again, and a second checkpoint would read back from Redis about three times the
/// bytes it stores (`bench live --redis`).
#[derive(Default)]
struct BaseFrames {
    map: HashMap<(PackId, u64), Arc<Vec<u8>>>,
    order: VecDeque<(PackId, u64)>,
}

/// Base frames kept (at most 128 KiB each decompressed: 8 MiB).
pub(crate) const BASE_FRAMES: usize = 64;

/// Base chunks read for deltas, and what they cost.
#[derive(Default)]
struct BaseReads {
    chunks: AtomicU64,
    over_budget: AtomicU64,
    frame_hits: AtomicU64,
    frames_read: AtomicU64,
    bytes_read: AtomicU64,
}

/// What a save's deltas amounted to.
#[derive(Debug, Clone, Default)]
pub struct DeltaOutcome {
    pub base: String,
    /// Distinct pages stored as deltas.
    pub pages: u64,
    /// Encoded bytes of their runs.
    pub bytes: u64,
    /// Delta records new to the store.
    pub records: u64,
    pub attempts: u64,
    pub skipped_batches: u64,
    pub reads: DeltaReads,
}

/// Base chunks a save read for its deltas (in `SaveReport`, not in the manifest).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DeltaReads {
    /// Base chunks read (pages and delta records).
    pub chunks: u64,
    /// Of those, found in a frame read before (`BASE_FRAMES`).
    pub frame_hits: u64,
    /// Frames read from the backend, and their stored bytes.
    pub frames_read: u64,
    pub bytes_read: u64,
    /// Pages not tried because their base frame was not at hand and the read budget was
    /// spent, and page bytes the deltas saved (page size minus runs: an upper bound).
    pub over_budget: u64,
    pub saved_bytes: u64,
}

impl<'a> DeltaSink<'a> {
    pub fn new(base: &'a Base) -> DeltaSink<'a> {
        DeltaSink {
            base,
            by_stream_block: std::sync::OnceLock::new(),
            targets: Mutex::new(HashMap::new()),
            pages: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            records: AtomicU64::new(0),
            attempts: AtomicU64::new(0),
            skipped_batches: AtomicU64::new(0),
            frames: Mutex::new(BaseFrames::default()),
            reads: BaseReads::default(),
            allowance: None,
            saved: AtomicU64::new(0),
        }
    }

    /// Limit what base reads may cost: `allowance` bytes of frames, plus `READ_PER_SAVED`
    /// per byte saved. For network backends, where a base read is a round trip and a frame
    /// (~56 KB for 32 pages) over the link: without a budget, a guest that rewrites its pages
    /// with new data makes a second live checkpoint read 48 MB from Redis for 73 delta pages
    /// (~0.3 MB saved; `bench live --redis`). Base chunks in frames already read cost
    /// nothing and are always used.
    pub fn with_read_budget(mut self, allowance: u64) -> Self {
        self.allowance = Some(allowance);
        self
    }

    fn within_budget(&self) -> bool {
        self.allowance.is_none_or(|a| {
            self.reads.bytes_read.load(Ordering::Relaxed)
                < a + READ_PER_SAVED * self.saved.load(Ordering::Relaxed)
        })
    }

    /// Base chunk `id` (a page or a delta record), verified against its id. Its frame is read
    /// once while it stays among the last `BASE_FRAMES`; anything unusual (a chunk not in
    /// the index or not in a durable pack, a failed read, a checksum or hash mismatch) goes
    /// through `Store::get`, which refreshes, follows GC and reports damage.
    /// `Ok(None)`: not read, because the read budget is spent ([`DeltaSink::with_read_budget`]).
    pub fn read_base(&self, store: &Store, id: &ChunkId) -> Result<Option<Vec<u8>>, StoreError> {
        let r = &self.reads;
        let Some((pack, e)) = store.locate(id) else { return store.get(id).map(Some) };
        let key = (pack, e.frame_off);
        let cached = self.frames.lock().map.get(&key).cloned();
        let raw = match cached {
            Some(f) => {
                r.chunks.fetch_add(1, Ordering::Relaxed);
                r.frame_hits.fetch_add(1, Ordering::Relaxed);
                f
            }
            None => {
                if !self.within_budget() {
                    r.over_budget.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
                r.chunks.fetch_add(1, Ordering::Relaxed);
                let Ok(frame) =
                    store.backend().get_range(&pack.pack_key(), e.frame_off, e.frame_len as u64)
                else {
                    return store.get(id).map(Some);
                };
                r.frames_read.fetch_add(1, Ordering::Relaxed);
                r.bytes_read.fetch_add(frame.len() as u64, Ordering::Relaxed);
                if crc(&frame) != e.frame_crc {
                    return store.get(id).map(Some);
                }
                let Ok(raw) = e.codec.decompress(&frame, e.frame_raw_len as usize) else {
                    return store.get(id).map(Some);
                };
                let raw = Arc::new(raw);
                let mut f = self.frames.lock();
                if f.map.insert(key, raw.clone()).is_none() {
                    f.order.push_back(key);
                    while f.order.len() > BASE_FRAMES {
                        if let Some(old) = f.order.pop_front() {
                            f.map.remove(&old);
                        }
                    }
                }
                raw
            }
        };
        match raw.get(e.off_in_frame as usize..(e.off_in_frame as usize + e.raw_len as usize)) {
            Some(data) if ChunkId::of(data) == *id => Ok(Some(data.to_vec())),
            _ => store.get(id).map(Some),
        }
    }

    /// The stream listed its ramblocks: map them to the base's by name and length.
    pub fn set_blocks(&self, blocks: &[(String, u64)]) {
        let _ = self.by_stream_block.set(
            blocks
                .iter()
                .map(|(n, l)| self.base.blocks.iter().position(|(bn, bl, _)| bn == n && bl == l))
                .collect(),
        );
    }

    /// The base's page map entry at a stream address.
    pub fn base_id(&self, block: u32, page: u32) -> Option<ChunkId> {
        let bi = (*self.by_stream_block.get()?.get(block as usize)?)?;
        self.base.blocks[bi].2.get(page as usize).copied()
    }

    pub fn outcome(&self) -> DeltaOutcome {
        DeltaOutcome {
            base: self.base.name.clone(),
            pages: self.pages.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
            attempts: self.attempts.load(Ordering::Relaxed),
            skipped_batches: self.skipped_batches.load(Ordering::Relaxed),
            reads: DeltaReads {
                chunks: self.reads.chunks.load(Ordering::Relaxed),
                frame_hits: self.reads.frame_hits.load(Ordering::Relaxed),
                frames_read: self.reads.frames_read.load(Ordering::Relaxed),
                bytes_read: self.reads.bytes_read.load(Ordering::Relaxed),
                over_budget: self.reads.over_budget.load(Ordering::Relaxed),
                saved_bytes: self.saved.load(Ordering::Relaxed),
            },
        }
    }
}

/// One pool worker's delta state: records not yet written, and the back-off.
#[derive(Default)]
pub struct DeltaWorker {
    /// Encoded record trees waiting for `flush`: (record id, bytes).
    pending: Vec<(ChunkId, Vec<u8>)>,
    buf: Vec<u8>,
    /// Batches left to skip, and the next penalty.
    skip: u32,
    penalty: u32,
    tried: u32,
    paid: u32,
    /// The base's run chunk read last (its 32 pages arrive together), verified.
    run: Option<(ChunkId, Arc<Vec<u8>>)>,
}

impl DeltaWorker {
    /// Start of a batch: false when this worker is backing off.
    pub fn batch_start(&mut self, sink: &DeltaSink<'_>) -> bool {
        self.tried = 0;
        self.paid = 0;
        if self.skip > 0 {
            self.skip -= 1;
            sink.skipped_batches.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// End of a batch: back off (1, 2, 4, 8 batches) when deltas mostly did not pay.
    pub fn batch_end(&mut self) {
        if self.tried >= 8 && self.paid * 4 < self.tried {
            self.penalty = (self.penalty * 2).clamp(1, MAX_BACK_OFF);
            self.skip = self.penalty;
        } else if self.paid > 0 {
            self.penalty = 0;
        }
    }

    /// Try to keep a page that is new to the store as a delta. Returns the delta record id to
    /// put in the page map instead of the page id (the caller then does not store the page).
    #[allow(clippy::too_many_arguments)]
    pub fn offer(
        &mut self,
        sink: &DeltaSink<'_>,
        ses: &Session,
        id: ChunkId,
        block: u32,
        page_no: u32,
        page: &[u8],
        read_base: bool,
    ) -> Option<ChunkId> {
        if let Some(r) = sink.targets.lock().get(&id) {
            return Some(*r);
        }
        if !read_base {
            return None;
        }
        let store = ses.store();
        let base_id = sink.base_id(block, page_no)?;
        self.tried += 1;
        sink.attempts.fetch_add(1, Ordering::Relaxed);
        let warn = |e: &StoreError| {
            tracing::warn!(target: TARGET, base = %sink.base.name, id = %base_id, error = %e, "base page unreadable; page stored whole");
        };
        // Over the read budget: not an attempt (nothing was compared), the page goes whole.
        let untried = |w: &mut Self| {
            w.tried -= 1;
            sink.attempts.fetch_sub(1, Ordering::Relaxed);
        };
        // Resolve the base entry to a whole page (a delta record goes one level down).
        let (whole, content) = if base_id.is_zero() {
            (ChunkId::ZERO, vec![0u8; PAGE_SIZE])
        } else {
            match store.chunk_info(&base_id) {
                Some((_, ChunkKind::Tree)) => {
                    let rec = match sink
                        .read_base(store, &base_id)
                        .map(|b| b.map(|b| Tree::decode(&b)))
                    {
                        Ok(Some(Ok(t))) if is_record(&t) => parse_record(&t).ok()?,
                        Ok(None) => {
                            untried(self);
                            return None;
                        }
                        Ok(_) => return None,
                        Err(e) => {
                            warn(&e);
                            return None;
                        }
                    };
                    if rec.target == id {
                        // Unchanged since the base, where it was a delta: reuse its record.
                        ses.pin(base_id).ok()?;
                        self.paid += 1;
                        return Some(self.record(sink, id, base_id, None, rec.enc.len()));
                    }
                    let base_page = if rec.base.is_zero() {
                        vec![0u8; PAGE_SIZE]
                    } else {
                        match sink.read_base(store, &rec.base) {
                            Ok(Some(p)) => p,
                            Ok(None) => {
                                untried(self);
                                return None;
                            }
                            Err(e) => {
                                warn(&e);
                                return None;
                            }
                        }
                    };
                    (rec.base, base_page)
                }
                // A run chunk (version 3): the base page is the run's slot. Unchanged, the
                // page maps to the run again (same place, same slot); changed, it is stored
                // whole (a record's base must be a whole page). Not in `targets`: the run
                // stands for this page only at this place.
                Some((len, ChunkKind::Data)) if len as usize == RUN_BYTES => {
                    let run = match &self.run {
                        Some((rid, run)) if *rid == base_id => run.clone(),
                        _ => match sink.read_base(store, &base_id) {
                            Ok(Some(c)) if c.len() == RUN_BYTES => {
                                let c = Arc::new(c);
                                self.run = Some((base_id, c.clone()));
                                c
                            }
                            Ok(None) => {
                                untried(self);
                                return None;
                            }
                            Ok(_) => return None,
                            Err(e) => {
                                warn(&e);
                                return None;
                            }
                        },
                    };
                    let slot = page_no as usize % RUN_PAGES;
                    if run[slot * PAGE_SIZE..(slot + 1) * PAGE_SIZE] == *page {
                        ses.pin(base_id).ok()?;
                        self.paid += 1;
                        return Some(base_id);
                    }
                    return None;
                }
                Some(_) => match sink.read_base(store, &base_id) {
                    Ok(Some(c)) if c.len() == PAGE_SIZE => (base_id, c),
                    Ok(None) => {
                        untried(self);
                        return None;
                    }
                    Ok(_) => return None,
                    Err(e) => {
                        warn(&e);
                        return None;
                    }
                },
                None => return None,
            }
        };
        let mut buf = std::mem::take(&mut self.buf);
        // The base page must outlive this save even if its checkpoint is removed and GC runs
        // before the commit: pin it like the pages the session stores.
        let r = if encode(&content, page, &mut buf, MAX_KEPT)
            && pays(buf.len(), page)
            && (whole.is_zero() || ses.pin(whole).is_ok())
        {
            self.paid += 1;
            let tree =
                record_tree(&DeltaEntry { target: id, base: whole, enc: buf.clone() }).encode();
            let rid = ChunkId::of(&tree);
            Some(self.record(sink, id, rid, Some(tree), buf.len()))
        } else {
            None
        };
        self.buf = buf;
        r
    }

    fn record(
        &mut self,
        sink: &DeltaSink<'_>,
        id: ChunkId,
        rid: ChunkId,
        tree: Option<Vec<u8>>,
        enc_len: usize,
    ) -> ChunkId {
        let mut t = sink.targets.lock();
        if let Some(r) = t.get(&id) {
            return *r;
        }
        t.insert(id, rid);
        drop(t);
        sink.pages.fetch_add(1, Ordering::Relaxed);
        sink.bytes.fetch_add(enc_len as u64, Ordering::Relaxed);
        sink.saved.fetch_add(PAGE_SIZE.saturating_sub(enc_len) as u64, Ordering::Relaxed);
        if let Some(tree) = tree {
            self.pending.push((rid, tree));
        }
        rid
    }

    /// Store the pending records, `RECORDS_PER_FRAME` to a compressed frame. Called at the
    /// end of every batch, before the batch's page map entries are set.
    pub fn flush(&mut self, sink: &DeltaSink<'_>, ses: &Session) -> Result<(), StoreError> {
        let codec = ses.store().default_codec();
        for group in self.pending.chunks(RECORDS_PER_FRAME) {
            let items: Vec<(ChunkId, &[u8])> = group.iter().map(|(id, b)| (*id, &b[..])).collect();
            let n = ses.put_frame(&items, ChunkKind::Tree, codec)?;
            sink.records.fetch_add(n as u64, Ordering::Relaxed);
        }
        self.pending.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seed: u8) -> Vec<u8> {
        (0..PAGE_SIZE).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn encode_apply_round_trip_and_limit() {
        let base = page(1);
        let mut new = base.clone();
        new[5] ^= 1;
        new[4000..4010].copy_from_slice(&[9; 10]);
        let mut out = Vec::new();
        assert!(encode(&base, &new, &mut out, MAX_KEPT));
        // Word runs: [0, 8) and [4000, 4016).
        assert_eq!(out.len(), 4 + 8 + 4 + 16);
        assert_eq!(&out[..4], &[0, 0, 8, 0]);
        assert_eq!(&apply(&base, &out).unwrap()[..], &new[..]);
        // Identical pages encode to nothing.
        assert!(encode(&base, &base, &mut out, 0));
        assert!(out.is_empty());
        // A page unlike its base does not fit.
        assert!(!encode(&base, &page(77), &mut out, MAX_KEPT));
        assert!(encode(&base, &page(77), &mut out, MAX_ENCODED));
        assert_eq!(out.len(), MAX_ENCODED);
        assert_eq!(&apply(&base, &out).unwrap()[..], &page(77)[..]);
    }

    #[test]
    fn a_delta_pays_when_much_smaller_than_the_compressed_page() {
        assert!(pays(ALWAYS_KEPT, &page(1)));
        assert!(!pays(MAX_KEPT + 1, &[7u8; PAGE_SIZE]));
        // A page of one repeated byte compresses to a few dozen bytes: a 300-byte delta loses.
        assert!(!pays(300, &[7u8; PAGE_SIZE]));
        // A page that does not compress: deltas up to half a page pay.
        let mut x = 0x2545_F491u32;
        let noise: Vec<u8> = (0..PAGE_SIZE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        assert!(pays(2000, &noise));
        assert!(!pays(2100, &noise));
    }

    #[test]
    fn apply_refuses_bad_runs() {
        let base = page(0);
        for bad in [
            vec![0u8, 0, 0, 0],                 // zero length
            vec![0xff, 0x0f, 2, 0, 1, 2],       // past the page end
            vec![8, 0, 1, 0, 1, 0, 0, 1, 0, 1], // out of order
            vec![0, 0, 4, 0, 1],                // truncated
            vec![0, 0],                         // truncated header
        ] {
            assert!(apply(&base, &bad).is_err(), "{bad:?}");
        }
        assert!(apply(&base[..100], &[]).is_err());
    }

    #[test]
    fn record_bytes_are_pinned() {
        let e = DeltaEntry {
            target: ChunkId([5; 32]),
            base: ChunkId([6; 32]),
            enc: vec![0, 0, 1, 0, 42],
        };
        let t = record_tree(&e);
        let b = t.encode();
        // Tree header (16 bytes: STRT, version, flags, 1 child, payload length), the base id,
        // then the payload: SVMP, page id, runs.
        assert_eq!(&b[0..4], b"STRT");
        assert_eq!(endian::le32(&b, 8), 1);
        assert_eq!(endian::le32(&b, 12), 4 + 32 + 5);
        assert_eq!(&b[16..48], &[6; 32]);
        assert_eq!(&b[48..52], b"SVMP");
        assert_eq!(&b[52..84], &[5; 32]);
        assert_eq!(&b[84..89], &[0, 0, 1, 0, 42]);
        assert_eq!(b.len(), 89);
        let back = Tree::decode(&b).unwrap();
        assert!(is_record(&back));
        assert_eq!(parse_record(&back).unwrap(), e);
        // One base id, a page id, and the magic are required.
        let mut two = t.clone();
        two.children.push(ChunkId([1; 32]));
        assert!(parse_record(&two).is_err());
        for cut in 0..36 {
            let mut c = t.clone();
            c.payload.truncate(cut);
            assert!(parse_record(&c).is_err());
        }
        let mut zero = t.clone();
        zero.payload[4..36].fill(0);
        assert!(parse_record(&zero).is_err());
    }

    #[test]
    fn back_off_after_batches_that_do_not_pay() {
        let base = Base { name: "b".into(), blocks: vec![] };
        let sink = DeltaSink::new(&base);
        let mut w = DeltaWorker::default();
        assert!(w.batch_start(&sink));
        w.tried = 10;
        w.batch_end();
        assert!(!w.batch_start(&sink), "one batch skipped");
        assert!(w.batch_start(&sink));
        w.tried = 10;
        w.batch_end();
        assert!(!w.batch_start(&sink) && !w.batch_start(&sink), "two skipped");
        assert!(w.batch_start(&sink));
        w.tried = 10;
        w.paid = 9;
        w.batch_end();
        assert!(w.batch_start(&sink));
        assert_eq!(sink.skipped_batches.load(Ordering::Relaxed), 3);
    }

    /// Base pages that share a frame are read from the backend once, and every one is still
    /// verified: a damaged frame goes through `Store::get`, which reports it.
    #[test]
    fn base_pages_sharing_a_frame_are_read_once_and_verified() {
        use crate::backend::memory::MemoryBackend;
        use crate::backend::Backend;
        use crate::codec::Codec;
        use crate::store::{InitOptions, Store};
        let d = tempfile::tempdir().unwrap();
        let mem = MemoryBackend::new();
        let store = Store::init(
            std::sync::Arc::new(mem.clone()),
            &d.path().join("m.redb"),
            InitOptions { pack_size: 1 << 20, default_codec: Codec::Zstd(1) },
        )
        .unwrap();
        let pages: Vec<Vec<u8>> = (0..64u32)
            .map(|i| (0..PAGE_SIZE).map(|b| ((b as u32 * 7 + i) % 251) as u8).collect())
            .collect();
        let ids: Vec<ChunkId> = pages.iter().map(|p| ChunkId::of(p)).collect();
        let ses = store.session();
        for half in [0..32, 32..64] {
            let items: Vec<(ChunkId, &[u8])> = half.map(|i| (ids[i], &pages[i][..])).collect();
            ses.put_frame(&items, ChunkKind::Data, Codec::Zstd(1)).unwrap();
        }
        ses.commit_ref(
            "vm/base",
            crate::store::objects::Ref { roots: vec![ids[0]], ..Default::default() },
        )
        .unwrap();
        drop(ses);
        drop(store);
        // Reopened, so every read goes to the backend (no pack buffer of the writer's).
        let store =
            Store::open(std::sync::Arc::new(mem.clone()), &d.path().join("m2.redb")).unwrap();
        let base = Base { name: "base".into(), blocks: Vec::new() };
        let sink = DeltaSink::new(&base);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(sink.read_base(&store, id).unwrap(), Some(pages[i].clone()), "page {i}");
        }
        let r = sink.outcome().reads;
        assert_eq!((r.chunks, r.frames_read, r.frame_hits), (64, 2, 62), "two frames of 32 pages");
        // Damage the second frame in the pack: its pages are no longer served from the cache
        // of a fresh sink, and the store's read reports the damage.
        let (pack, e) = store.locate(&ids[40]).unwrap();
        let key = pack.pack_key();
        let mut bytes = mem.get(&key).unwrap();
        bytes[(e.frame_off + 8) as usize] ^= 0x55;
        mem.put(&key, &bytes).unwrap();
        let sink = DeltaSink::new(&base);
        assert_eq!(
            sink.read_base(&store, &ids[1]).unwrap(),
            Some(pages[1].clone()),
            "the first frame is intact"
        );
        let err = sink.read_base(&store, &ids[40]).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");

        // With a read budget of one frame and nothing saved, the second frame is not read,
        // but pages of the frame already read still are.
        let (_, e0) = store.locate(&ids[0]).unwrap();
        let sink = DeltaSink::new(&base).with_read_budget(e0.frame_len as u64);
        assert_eq!(sink.read_base(&store, &ids[0]).unwrap(), Some(pages[0].clone()));
        assert_eq!(sink.read_base(&store, &ids[40]).unwrap(), None, "over budget: not read");
        assert_eq!(
            sink.read_base(&store, &ids[5]).unwrap(),
            Some(pages[5].clone()),
            "a frame at hand costs nothing"
        );
        // Savings raise the budget.
        sink.saved.fetch_add(1 << 20, Ordering::Relaxed);
        assert!(
            sink.read_base(&store, &ids[40]).is_err(),
            "within budget again: read (and found damaged)"
        );
        let r = sink.outcome().reads;
        assert_eq!((r.chunks, r.frames_read, r.frame_hits, r.over_budget), (3, 2, 1, 1));
    }
}

//! The receive pipeline: one parse thread feeds a pool that hashes, deduplicates, compresses
//! and stores pages, and the page map keeps the latest record of every page.
//!
//! ```text
//!  socket ─read 1 MiB─► parse thread (stream::Parser) ──batches of 256 pages──► pool × N
//!                         │ ZERO records                                        │ BLAKE3, 16 pages/pass
//!                         ▼                                                     │ frames of ≤32 pages
//!                      page map (per page: id + record number) ◄────────────────┘ Session::put_frame
//! ```
//!
//! Why this shape:
//! * One parser, because the stream is a sequence; it only copies each page once into a
//!   batch buffer (recycled) and never hashes or compresses, so it keeps up with QEMU.
//! * A pool of `workers` threads (all cores by default) does the CPU work. Pages are grouped
//!   into frames of up to 32 consecutive pages (128 KiB of codec context) for `put_frame`,
//!   which still deduplicates per 4 KiB page, so a page seen before in this stream, in an
//!   earlier checkpoint or in another VM costs nothing but its id.
//! * Precopy sends pages several times and workers finish batches out of order, so every
//!   record gets a sequence number and the map keeps, per page, the id with the highest one:
//!   the latest record wins whatever the completion order. ZERO records go straight into the
//!   map as the zero id; an all-zero PAGE is detected too. Zero pages are never stored.
//! * A page sent a second time is *hot* (precopy resends what the guest dirtied, and will
//!   likely send it again): its records are held back in memory, each replacing the last, and
//!   stored once when the stream ends. Precopy's intermediate versions thus never reach the
//!   store; the buffer is capped (`hot_bytes`), beyond which pages go straight to the pool.
//! * Any failure (store full, parse error, a worker panic) stops the parse via the sink's
//!   error and is reported once; whatever was put stays unreferenced (garbage for GC).

use std::io::{ErrorKind, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};

use parking_lot::Mutex;

use super::codec_choice::{thread_cpu_ns, Chooser};
use super::delta::{Base, DeltaOutcome, DeltaSink, DeltaWorker};
use super::stream::{Event, Limits, Parser, SinkError, StreamError, StreamInfo, StreamSink, PAGE_SIZE};
use crate::id::ChunkId;
use crate::page_hash::{as_page, hash_pages};
use crate::progress::{Progress, Unit};
use crate::store::pack::ChunkKind;
use crate::store::{Precompressed, Session, StoreError};

const TARGET: &str = "strata::memory";
const READ_BYTES: usize = 1 << 20;
/// The first batches of a stream are a quarter of the usual size, so every worker has pages
/// at once and the first pack (and the first upload) is ready sooner: one full batch is 16
/// frames for a single worker, while the other waits for the next batch.
const RAMP_BATCHES: u64 = 4;
/// Batches queued between the parse thread and the pool, in bytes (the default).
pub const QUEUE_BYTES: usize = 32 << 20;
/// The queue of a stop-and-copy save ([`IngestOptions::queue_bytes`]).
pub const SAVE_QUEUE_BYTES: usize = 8 << 20;

/// Pages per compressed frame by default (128 KiB). zstd -1 compresses and decompresses
/// 64 KiB blocks ~20% slower than 128 KiB ones on these hosts (`zstd -b1 -B64K` against
/// `-B128K`), and a 128 MiB save to S3, bound by its compressing CPU, took a median 0.314 s
/// against 0.35 s with 16-page frames, its restore 0.224 s against 0.229 s (10 rounds each,
/// `bench save-restore --remote`, session 14). Bigger frames make a single page's read (a
/// delta's base) decode more, so the gain stops here.
pub const FRAME_PAGES: usize = 32;
/// Largest frame a save writes (256 KiB).
pub const MAX_FRAME_PAGES: usize = 64;

/// Tuning of the pipeline.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Hashing/compressing threads (default: available cores).
    pub workers: usize,
    /// Pages per batch handed to a worker.
    pub batch_pages: usize,
    /// Pages per compressed frame (at most [`MAX_FRAME_PAGES`]).
    pub frame_pages: usize,
    /// Bytes of re-sent (hot) pages held back until the stream ends, so precopy's
    /// intermediate versions of a page are not stored (0 disables).
    pub hot_bytes: usize,
    /// Make stored packs durable (`Store::flush`, on a helper thread) every time this many
    /// new bytes were stored, so the final commit has little left to do (0: only at the end).
    pub flush_every: u64,
    /// Bytes of batches queued between the parse thread and the pool. A deep queue rides out
    /// short stalls of the pool without QEMU's sender blocking, which a live checkpoint wants
    /// (the guest runs meanwhile). A stop-and-copy save gains nothing from QEMU finishing
    /// early, and every queued batch beyond the few in flight is fresh memory: 32 MiB of
    /// batches cost a 128 MiB save ~6,000 page faults, so `save` queues
    /// [`SAVE_QUEUE_BYTES`].
    pub queue_bytes: usize,
    pub limits: Limits,
    /// Base checkpoint for delta pages (`delta`); None stores every new page whole.
    pub base: Option<std::sync::Arc<Base>>,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            workers: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            batch_pages: 256,
            frame_pages: FRAME_PAGES,
            hot_bytes: 256 << 20,
            flush_every: 128 << 20,
            queue_bytes: QUEUE_BYTES,
            limits: Limits::default(),
            base: None,
        }
    }
}

/// Why the pipeline stopped.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("Reading the migration stream failed after {bytes} bytes")]
    Read {
        bytes: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("Migration stream was refused")]
    Stream(#[source] StreamError),
    #[error("Storing pages failed")]
    Store(#[source] StoreError),
    #[error("A pipeline worker panicked")]
    Panic,
}

/// Counters of one ingest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestCounters {
    pub page_records: u64,
    pub zero_records: u64,
    /// PAGE records whose content was all zero.
    pub zero_content: u64,
    /// Page chunks new to the store.
    pub new_chunks: u64,
    pub frames: u64,
    /// Page records superseded by a later record while held back (never stored).
    pub superseded: u64,
}

/// What a finished ingest hands back: the stream summary and the final page ids.
#[derive(Debug)]
pub struct Ingested {
    pub info: StreamInfo,
    /// Per ramblock, per page: the id of its latest content (zero id = zero page).
    pub maps: Vec<Vec<ChunkId>>,
    /// Per ramblock, pages no record covered (0 for a complete stream) and the first one.
    pub missing: Vec<(u64, u64)>,
    pub counters: IngestCounters,
    /// From the stream's last byte until every batch was stored, ms.
    pub drain_ms: f64,
    /// CPU time of the parse thread (reading the socket, parsing, batching), ms.
    pub parse_cpu_ms: f64,
    /// CPU time of the pool (hashing, dedup, compression, packing), ms.
    pub pool_cpu_ms: f64,
    /// Where the pipeline waited (wall ms, summed over threads): the parse thread in `read`
    /// (QEMU had sent nothing more) and on the full batch queue (the pool was behind); the
    /// pool's threads for a batch (idle) and inside `put_frame` (packing, and waiting for the
    /// pack writer when its queue was full).
    pub waits: IngestWaits,
    /// Delta pages against the base, when there was one.
    pub delta: Option<DeltaOutcome>,
}

/// See [`Ingested::waits`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IngestWaits {
    pub parse_read_ms: f64,
    pub parse_queue_ms: f64,
    pub pool_idle_ms: f64,
    pub pool_put_ms: f64,
    /// Of `pool_put_ms`: waiting for the pack writer's queue (store-wide during the stream).
    pub pack_writer_ms: f64,
    /// Of `stream_ms`: background flushes (packs and index objects made durable).
    pub flushes_ms: f64,
}

struct Batch {
    data: Vec<u8>,
    /// (block, page index, record number) per page in `data`.
    pages: Vec<(u32, u32, u64)>,
}

#[derive(Default)]
struct PageMap {
    ids: Vec<Vec<ChunkId>>,
    recs: Vec<Vec<u64>>,
}

impl PageMap {
    fn set(&mut self, block: u32, page: u32, rec: u64, id: ChunkId) {
        let (b, p) = (block as usize, page as usize);
        if let Some(r) = self.recs.get_mut(b).and_then(|v| v.get_mut(p)) {
            if rec > *r {
                *r = rec;
                self.ids[b][p] = id;
            }
        }
    }
}

struct Shared<'a> {
    session: &'a Session,
    chooser: &'a Chooser,
    map: Mutex<PageMap>,
    failed: AtomicBool,
    error: Mutex<Option<StoreError>>,
    new_chunks: AtomicU64,
    zero_content: AtomicU64,
    frames: AtomicU64,
    /// CPU time the pool's threads used.
    worker_cpu_ns: AtomicU64,
    /// Wall time the pool's threads waited for a batch, and spent in `put_frame`.
    idle_ns: AtomicU64,
    put_ns: AtomicU64,
    /// Wall time the parse thread waited on the full batch queue.
    queue_ns: AtomicU64,
    frame_pages: usize,
    /// Store-wide stored-bytes counter value at which the next background flush is due.
    next_flush: AtomicU64,
    flush_every: u64,
    flush_tx: Mutex<Option<SyncSender<()>>>,
    delta: Option<DeltaSink<'a>>,
}

impl Shared<'_> {
    /// Ask the flusher thread for a background flush when enough new bytes were stored.
    fn maybe_flush(&self) {
        if self.flush_every == 0 {
            return;
        }
        let stored = self.session.store().stats().stored_bytes_new.load(Ordering::Relaxed);
        let due = self.next_flush.load(Ordering::Relaxed);
        if stored >= due
            && self
                .next_flush
                .compare_exchange(due, stored + self.flush_every, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            if let Some(tx) = self.flush_tx.lock().as_ref() {
                let _ = tx.try_send(());
            }
        }
    }

    fn fail(&self, e: StoreError) {
        let mut slot = self.error.lock();
        if slot.is_none() {
            *slot = Some(e);
        }
        self.failed.store(true, Ordering::SeqCst);
    }
}

/// All-zero test that the compiler vectorises (an OR-fold per 64-byte block).
pub(crate) fn is_zero(page: &[u8]) -> bool {
    page.chunks(64).all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}

fn worker(sh: &Shared<'_>, rx: &Mutex<Receiver<Batch>>, free: &SyncSender<Vec<u8>>) {
    let mut ids: Vec<ChunkId> = Vec::new();
    let mut nonzero: Vec<usize> = Vec::new();
    let mut hashed: Vec<ChunkId> = Vec::new();
    let mut fresh: Vec<u8> = Vec::with_capacity(sh.frame_pages * PAGE_SIZE);
    let mut dw = DeltaWorker::default();
    loop {
        let t_wait = std::time::Instant::now();
        let got = rx.lock().recv();
        sh.idle_ns.fetch_add(t_wait.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let batch = match got {
            Ok(b) => b,
            Err(_) => break,
        };
        if sh.failed.load(Ordering::Relaxed) {
            let _ = free.try_send(batch.data);
            continue;
        }
        // Zero pages get the zero id; the others are hashed together, 16 per SIMD pass.
        ids.clear();
        ids.resize(batch.pages.len(), ChunkId::ZERO);
        nonzero.clear();
        let mut zeros = 0;
        for (i, page) in batch.data.chunks_exact(PAGE_SIZE).take(batch.pages.len()).enumerate() {
            if is_zero(page) {
                zeros += 1;
            } else {
                nonzero.push(i);
            }
        }
        {
            let pages: Vec<&[u8; PAGE_SIZE]> = nonzero
                .iter()
                .map(|&i| as_page(&batch.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]).expect("page"))
                .collect();
            hashed.clear();
            hashed.resize(pages.len(), ChunkId::ZERO);
            hash_pages(&pages, &mut hashed);
            for (&i, id) in nonzero.iter().zip(&hashed) {
                ids[i] = *id;
            }
        }
        sh.zero_content.fetch_add(zeros, Ordering::Relaxed);
        // Frames of up to `frame_pages` non-zero pages, in stream order.
        let mut items: Vec<(ChunkId, &[u8])> = Vec::with_capacity(sh.frame_pages);
        let pages: Vec<&[u8]> = batch.data.chunks_exact(PAGE_SIZE).take(batch.pages.len()).collect();
        let mut ok = true;
        let mut flush = |items: &mut Vec<(ChunkId, &[u8])>| -> bool {
            if items.is_empty() {
                return true;
            }
            // The codec chooser measures (on sampled frames only) bytes the store does not
            // hold yet, as the store will pick them (absent, each once), and the store then
            // keeps the sample's output for the chosen codec instead of compressing again.
            fresh.clear();
            let mut fresh_ids: Vec<ChunkId> = Vec::new();
            if sh.chooser.wants_sample() {
                let store = sh.session.store();
                for (id, d) in items.iter() {
                    if !store.contains(id) && !fresh_ids.contains(id) {
                        fresh.extend_from_slice(d);
                        fresh_ids.push(*id);
                    }
                }
            }
            let (codec, sampled) = sh.chooser.codec_for_frame(&fresh);
            let pre = sampled.map(|stored| Precompressed { ids: fresh_ids, stored });
            sh.frames.fetch_add(1, Ordering::Relaxed);
            let t_put = std::time::Instant::now();
            let r = sh.session.put_frame_pre(items, ChunkKind::Data, codec, pre);
            sh.put_ns.fetch_add(t_put.elapsed().as_nanos() as u64, Ordering::Relaxed);
            items.clear();
            match r {
                Ok(n) => {
                    sh.new_chunks.fetch_add(n as u64, Ordering::Relaxed);
                    sh.maybe_flush();
                    true
                }
                Err(e) => {
                    sh.fail(e);
                    false
                }
            }
        };
        let read_base = sh.delta.as_ref().is_some_and(|d| dw.batch_start(d));
        let mut as_delta: Vec<(usize, ChunkId)> = Vec::new();
        for (i, ((id, page), &(block, page_no, _))) in ids.iter().zip(&pages).zip(&batch.pages).enumerate() {
            if id.is_zero() {
                continue;
            }
            // A page new to the store may be kept as a delta against the base checkpoint:
            // its map entry is then the delta record's id.
            if let Some(d) = &sh.delta {
                if !sh.session.store().contains(id) {
                    if let Some(rid) = dw.offer(d, sh.session, *id, block, page_no, page, read_base) {
                        as_delta.push((i, rid));
                        continue;
                    }
                }
            }
            items.push((*id, page));
            if items.len() == sh.frame_pages && !flush(&mut items) {
                ok = false;
                break;
            }
        }
        if ok && !flush(&mut items) {
            ok = false;
        }
        if let Some(d) = &sh.delta {
            if read_base {
                dw.batch_end();
            }
            if ok {
                if let Err(e) = dw.flush(d, sh.session) {
                    sh.fail(e);
                    ok = false;
                }
            }
        }
        for (i, rid) in as_delta {
            ids[i] = rid;
        }
        if ok {
            let mut map = sh.map.lock();
            for ((block, page, rec), id) in batch.pages.iter().zip(&ids) {
                map.set(*block, *page, *rec, *id);
            }
        }
        let _ = free.try_send(batch.data);
    }
}

/// A re-sent page held back until the stream ends: (record number, content).
type HeldPage = (u64, Box<[u8; PAGE_SIZE]>);

/// The parse thread's sink: copies pages into batches, records ZERO pages.
struct Dispatch<'a, 'p> {
    sh: &'a Shared<'a>,
    tx: SyncSender<Batch>,
    free: &'a Receiver<Vec<u8>>,
    cur: Batch,
    zeros: Vec<(u32, u32, u64)>,
    rec: u64,
    batch_pages: usize,
    /// Batches handed to the pool so far (the first [`RAMP_BATCHES`] are smaller).
    sent: u64,
    progress: &'p dyn Progress,
    pending_progress: u64,
    /// Pages seen once already (one bit per page).
    seen: Vec<Vec<u64>>,
    /// Re-sent pages held back: (block, page) -> (record number, content).
    hot: std::collections::HashMap<(u32, u32), HeldPage>,
    hot_cap: usize,
    superseded: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("The storing pipeline stopped")]
struct PipelineStopped;

impl Dispatch<'_, '_> {
    fn new_buffer(&self) -> Vec<u8> {
        match self.free.try_recv() {
            Ok(mut v) => {
                v.clear();
                v
            }
            Err(_) => Vec::with_capacity(self.batch_pages * PAGE_SIZE),
        }
    }

    fn send(&mut self) -> Result<(), SinkError> {
        self.flush_zeros();
        if self.cur.pages.is_empty() {
            return Ok(());
        }
        let data = self.new_buffer();
        let full = std::mem::replace(
            &mut self.cur,
            Batch {
                data,
                pages: Vec::with_capacity(self.batch_pages),
            },
        );
        let t_send = std::time::Instant::now();
        let sent = !self.sh.failed.load(Ordering::Relaxed) && self.tx.send(full).is_ok();
        self.sh.queue_ns.fetch_add(t_send.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if !sent {
            return Err(Box::new(PipelineStopped));
        }
        Ok(())
    }

    fn flush_zeros(&mut self) {
        if self.zeros.is_empty() {
            return;
        }
        let mut map = self.sh.map.lock();
        for (b, p, r) in self.zeros.drain(..) {
            map.set(b, p, r, ChunkId::ZERO);
        }
    }

    fn tick(&mut self) {
        self.pending_progress += PAGE_SIZE as u64;
        if self.pending_progress >= 4 << 20 {
            self.progress.advance(self.pending_progress);
            self.pending_progress = 0;
        }
    }

    /// A page record arrived: hold it back if the page was sent before (precopy will likely
    /// send it again), else queue it for the pool.
    fn page_record(&mut self, block: u32, page: u32, data: &[u8; PAGE_SIZE]) -> Result<(), SinkError> {
        self.rec += 1;
        self.tick();
        let rec = self.rec;
        let Some(word) = self
            .seen
            .get_mut(block as usize)
            .and_then(|v| v.get_mut(page as usize / 64))
        else {
            return self.push(block, page, rec, data);
        };
        let bit = 1u64 << (page % 64);
        if *word & bit == 0 {
            *word |= bit;
            return self.push(block, page, rec, data);
        }
        if let Some(slot) = self.hot.get_mut(&(block, page)) {
            self.superseded += 1;
            slot.0 = rec;
            slot.1.copy_from_slice(data);
            return Ok(());
        }
        if (self.hot.len() + 1) * PAGE_SIZE <= self.hot_cap {
            self.hot.insert((block, page), (rec, Box::new(*data)));
            return Ok(());
        }
        self.push(block, page, rec, data)
    }

    fn push(&mut self, block: u32, page: u32, rec: u64, data: &[u8]) -> Result<(), SinkError> {
        self.cur.data.extend_from_slice(data);
        self.cur.pages.push((block, page, rec));
        let target = if self.sent < RAMP_BATCHES { (self.batch_pages / 4).max(16) } else { self.batch_pages };
        if self.cur.pages.len() >= target {
            self.sent += 1;
            self.send()?;
        }
        Ok(())
    }

    /// Queue the held-back pages (at the end of the stream).
    fn flush_hot(&mut self) -> Result<(), SinkError> {
        let mut hot: Vec<_> = self.hot.drain().collect();
        hot.sort_unstable_by_key(|(k, _)| *k);
        for ((b, p), (rec, data)) in hot {
            self.push(b, p, rec, &data[..])?;
        }
        Ok(())
    }
}

impl StreamSink for Dispatch<'_, '_> {
    fn event(&mut self, ev: Event<'_>) -> Result<(), SinkError> {
        match ev {
            Event::RamBlocks(blocks) => {
                if let Some(d) = &self.sh.delta {
                    d.set_blocks(&blocks.iter().map(|b| (b.name.clone(), b.used_len)).collect::<Vec<_>>());
                }
                self.seen = blocks
                    .iter()
                    .map(|b| vec![0u64; (b.pages() as usize).div_ceil(64)])
                    .collect();
                let mut map = self.sh.map.lock();
                map.ids = blocks.iter().map(|b| vec![ChunkId::ZERO; b.pages() as usize]).collect();
                map.recs = blocks.iter().map(|b| vec![0u64; b.pages() as usize]).collect();
                let total: u64 = blocks.iter().map(|b| b.used_len).sum();
                self.progress.phase("receiving", Some(total), Unit::Bytes);
            }
            Event::Page { block, offset, data } => {
                self.page_record(block.0, (offset / PAGE_SIZE as u64) as u32, data)?;
            }
            Event::Zero { block, offset, fill } => {
                let page = (offset / PAGE_SIZE as u64) as u32;
                if fill == 0 {
                    self.rec += 1;
                    if let Some(w) = self
                        .seen
                        .get_mut(block.get())
                        .and_then(|v| v.get_mut(page as usize / 64))
                    {
                        *w |= 1 << (page % 64);
                    }
                    self.zeros.push((block.0, page, self.rec));
                    self.tick();
                    // A held-back version is superseded by this zero page.
                    if self.hot.remove(&(block.0, page)).is_some() {
                        self.superseded += 1;
                    }
                    if self.zeros.len() >= 4096 {
                        self.flush_zeros();
                    }
                } else {
                    self.page_record(block.0, page, &[fill; PAGE_SIZE])?;
                }
            }
            Event::SectionEnd { .. } => {
                // Hand over partial batches at section ends so the pool never idles while
                // QEMU is between passes.
                self.send()?;
            }
            _ => {}
        }
        Ok(())
    }
}

/// Read a whole migration stream from `src`, storing pages through `session`. Returns when
/// the stream ended correctly (EOF + VMDESCRIPTION) and every batch is stored; nothing is
/// committed here.
pub fn ingest<R: Read>(
    mut src: R,
    session: &Session,
    chooser: &Chooser,
    opts: &IngestOptions,
    progress: &dyn Progress,
) -> Result<Ingested, IngestError> {
    let workers = opts.workers.max(1);
    let frame_pages = opts.frame_pages.clamp(1, MAX_FRAME_PAGES);
    let batch_pages = opts.batch_pages.max(frame_pages);
    let sh = Shared {
        session,
        chooser,
        map: Mutex::new(PageMap::default()),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        new_chunks: AtomicU64::new(0),
        zero_content: AtomicU64::new(0),
        frames: AtomicU64::new(0),
        worker_cpu_ns: AtomicU64::new(0),
        idle_ns: AtomicU64::new(0),
        put_ns: AtomicU64::new(0),
        queue_ns: AtomicU64::new(0),
        frame_pages,
        next_flush: AtomicU64::new(session.store().stats().stored_bytes_new.load(Ordering::Relaxed) + opts.flush_every),
        flush_every: opts.flush_every,
        flush_tx: Mutex::new(None),
        delta: opts.base.as_deref().map(DeltaSink::new),
    };
    let (flush_tx, flush_rx) = mpsc::sync_channel::<()>(1);
    *sh.flush_tx.lock() = Some(flush_tx);
    // A deep queue rides out short stalls of the pool (a pack write, a background flush)
    // without QEMU's sender blocking on the socket (`IngestOptions::queue_bytes`).
    let depth = (opts.queue_bytes / (batch_pages * PAGE_SIZE)).max(workers * 2);
    let (tx, rx) = mpsc::sync_channel::<Batch>(depth);
    let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(depth + workers + 2);
    let rx = Mutex::new(rx);
    let drain = Mutex::new(0.0f64);
    let parse_cpu_start = thread_cpu_ns();
    let parse_cpu = Mutex::new(0u64);
    let mut read_ns = 0u64;
    let writer_wait0 = session.store().writer_wait_ns();
    let flush_ns = AtomicU64::new(0);

    let parsed: Result<(StreamInfo, u64, u64), IngestError> = std::thread::scope(|s| {
        let flusher = {
            let sh = &sh;
            let flush_ns = &flush_ns;
            std::thread::Builder::new()
                .name("strata-mem-flush".into())
                .spawn_scoped(s, move || {
                    for () in flush_rx {
                        if sh.failed.load(Ordering::Relaxed) {
                            continue;
                        }
                        let t = std::time::Instant::now();
                        if let Err(e) = sh.session.store().flush() {
                            sh.fail(e);
                        }
                        flush_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                })
                .expect("spawn flusher")
        };
        let handles: Vec<_> = (0..workers)
            .map(|i| {
                let (sh, rx, free) = (&sh, &rx, free_tx.clone());
                std::thread::Builder::new()
                    .name(format!("strata-mem-{i}"))
                    .spawn_scoped(s, move || {
                        worker(sh, rx, &free);
                        sh.worker_cpu_ns.fetch_add(thread_cpu_ns(), Ordering::Relaxed);
                    })
                    .expect("spawn pipeline worker")
            })
            .collect();
        let mut d = Dispatch {
            sh: &sh,
            tx,
            free: &free_rx,
            cur: Batch {
                data: Vec::with_capacity(batch_pages * PAGE_SIZE),
                pages: Vec::with_capacity(batch_pages),
            },
            zeros: Vec::new(),
            rec: 0,
            batch_pages,
            sent: 0,
            progress,
            pending_progress: 0,
            seen: Vec::new(),
            hot: std::collections::HashMap::new(),
            hot_cap: opts.hot_bytes,
            superseded: 0,
        };
        let mut parser = Parser::new(opts.limits.clone());
        let mut buf = vec![0u8; READ_BYTES];
        let result = (|| -> Result<StreamInfo, IngestError> {
            loop {
                let t_read = std::time::Instant::now();
                let r = src.read(&mut buf);
                read_ns += t_read.elapsed().as_nanos() as u64;
                let n = match r {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(source) => {
                        return Err(IngestError::Read {
                            bytes: parser.bytes_fed(),
                            source,
                        })
                    }
                };
                parser.feed(&buf[..n], &mut d).map_err(IngestError::Stream)?;
            }
            let info = parser.finish(&mut d).map_err(IngestError::Stream)?;
            d.flush_hot().and_then(|_| d.send()).map_err(|_| IngestError::Panic)?;
            Ok(info)
        })();
        *parse_cpu.lock() = thread_cpu_ns();
        let rec = d.rec;
        let superseded = d.superseded;
        progress.advance(d.pending_progress);
        drop(d); // closes the batch channel: workers drain it and exit
        let t_drain = std::time::Instant::now();
        let mut panicked = false;
        for h in handles {
            panicked |= h.join().is_err();
        }
        *drain.lock() = t_drain.elapsed().as_secs_f64() * 1e3;
        sh.flush_tx.lock().take(); // ends the flusher
        panicked |= flusher.join().is_err();
        if panicked {
            return Err(IngestError::Panic);
        }
        result.map(|info| (info, rec, superseded))
    });
    // A store failure explains a stopped pipeline better than the sink error it caused.
    if let Some(e) = sh.error.lock().take() {
        return Err(IngestError::Store(e));
    }
    let (info, _, superseded) = parsed?;
    progress.finish();
    let map = sh.map.into_inner();
    let missing = map
        .recs
        .iter()
        .map(|r| {
            let n = r.iter().filter(|&&x| x == 0).count() as u64;
            (n, r.iter().position(|&x| x == 0).unwrap_or(0) as u64)
        })
        .collect();
    let counters = IngestCounters {
        page_records: info.stats.page_records,
        zero_records: info.stats.zero_records,
        zero_content: sh.zero_content.load(Ordering::Relaxed),
        new_chunks: sh.new_chunks.load(Ordering::Relaxed),
        frames: sh.frames.load(Ordering::Relaxed),
        superseded,
    };
    tracing::debug!(target: TARGET, ?counters, "stream ingested");
    Ok(Ingested {
        info,
        maps: map.ids,
        missing,
        counters,
        drain_ms: drain.into_inner(),
        parse_cpu_ms: parse_cpu.into_inner().saturating_sub(parse_cpu_start) as f64 / 1e6,
        pool_cpu_ms: sh.worker_cpu_ns.load(Ordering::Relaxed) as f64 / 1e6,
        waits: IngestWaits {
            parse_read_ms: read_ns as f64 / 1e6,
            parse_queue_ms: sh.queue_ns.load(Ordering::Relaxed) as f64 / 1e6,
            pool_idle_ms: sh.idle_ns.load(Ordering::Relaxed) as f64 / 1e6,
            pool_put_ms: sh.put_ns.load(Ordering::Relaxed) as f64 / 1e6,
            pack_writer_ms: session.store().writer_wait_ns().saturating_sub(writer_wait0) as f64 / 1e6,
            flushes_ms: flush_ns.load(Ordering::Relaxed) as f64 / 1e6,
        },
        delta: sh.delta.as_ref().map(DeltaSink::outcome),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;
    use crate::memory::codec_choice::CodecPolicy;
    use crate::memory::stream::{BlockIdx, RamBlock, RamSectionHeader, StreamLayout, StreamWriter};
    use crate::progress::NoProgress;
    use crate::store::{InitOptions, Store};

    fn layout() -> StreamLayout {
        StreamLayout {
            version: 3,
            machine_type: Some("pc-i440fx-7.2".into()),
            config_subsections: vec![],
            ram_section: RamSectionHeader {
                section_id: 2,
                instance_id: 0,
                version_id: 4,
            },
            blocks: vec![
                RamBlock {
                    name: "pc.ram".into(),
                    used_len: 64 * 4096,
                },
                RamBlock {
                    name: "pc.bios".into(),
                    used_len: 4 * 4096,
                },
            ],
        }
    }

    /// A minimal valid tail: EOF + VMDESCRIPTION with an empty device list.
    fn tail() -> Vec<u8> {
        let json = br#"{"page_size":4096,"devices":[]}"#;
        let mut t = vec![0x00, 0x06];
        t.extend_from_slice(&(json.len() as u32).to_be_bytes());
        t.extend_from_slice(json);
        t
    }

    fn page(seed: u32) -> [u8; 4096] {
        let mut p = [0u8; 4096];
        for (i, w) in p.chunks_exact_mut(4).enumerate() {
            w.copy_from_slice(&(seed.wrapping_mul(2654435761).wrapping_add(i as u32 % 7)).to_le_bytes());
        }
        p
    }

    #[test]
    fn latest_record_wins_zero_pages_are_not_stored_and_dedup_counts() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
        // Stream: every page once, then page 5 rewritten twice and page 6 zeroed (precopy).
        // Build by hand with allow_partial for the second pass.
        let mut w = StreamWriter::new(Vec::new(), &layout()).unwrap();
        for p in 0..64u64 {
            let c = if p % 4 == 0 { None } else { Some(page((p % 10) as u32)) };
            match c {
                None => w.zero(BlockIdx(0), p * 4096, 0).unwrap(),
                Some(d) => w.page(BlockIdx(0), p * 4096, &d).unwrap(),
            }
        }
        w.page(BlockIdx(0), 5 * 4096, &page(100)).unwrap();
        w.page(BlockIdx(0), 5 * 4096, &page(101)).unwrap();
        w.zero(BlockIdx(0), 6 * 4096, 0).unwrap();
        w.page(BlockIdx(0), 8 * 4096, &[0u8; 4096]).unwrap();
        for p in 0..4u64 {
            w.page(BlockIdx(1), p * 4096, &page(7)).unwrap();
        }
        w.tail(&tail()).unwrap();
        let (bytes, _) = w.finish().unwrap();

        let ses = store.session();
        let chooser = Chooser::new(CodecPolicy::Fixed(Codec::Lz4), 1.0, 2);
        let opts = IngestOptions {
            workers: 3,
            batch_pages: 16,
            ..Default::default()
        };
        // Feed in odd-sized reads.
        struct Slow<'a>(&'a [u8]);
        impl Read for Slow<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(buf.len()).min(5000);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let got = ingest(Slow(&bytes), &ses, &chooser, &opts, &NoProgress).unwrap();
        assert_eq!(got.missing, vec![(0, 0), (0, 0)]);
        assert_eq!(got.maps[0][5], ChunkId::of(&page(101)), "latest record wins");
        assert!(got.maps[0][6].is_zero());
        assert!(got.maps[0][8].is_zero(), "an all-zero PAGE record is a zero page");
        assert!(got.maps[0][4].is_zero());
        assert_eq!(got.maps[0][1], ChunkId::of(&page(1)));
        assert_eq!(got.maps[1], vec![ChunkId::of(&page(7)); 4]);
        // Distinct non-zero contents: page(1..=9) minus multiples of 4 pattern + 100 + 101 + 7.
        // page(100) was superseded while held back: never stored.
        assert!(!store.contains(&ChunkId::of(&page(100))));
        assert_eq!(got.counters.superseded, 1);
        let mut distinct: Vec<ChunkId> = got.maps.iter().flatten().filter(|i| !i.is_zero()).copied().collect();
        distinct.push(ChunkId::of(&page(5)));
        distinct.sort();
        distinct.dedup();
        assert_eq!(got.counters.new_chunks, distinct.len() as u64);
        assert_eq!(got.counters.zero_content, 1);
        for id in &distinct {
            assert!(store.contains(id));
        }
        assert!(
            !store.contains(&ChunkId::of(&[0u8; 4096])),
            "zero pages are never stored"
        );

        // The same stream again: everything deduplicates.
        let again = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
        assert_eq!(again.counters.new_chunks, 0);
        assert_eq!(again.maps, got.maps);
    }

    #[test]
    fn truncated_stream_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
        let mut w = StreamWriter::new(Vec::new(), &layout()).unwrap();
        for p in 0..64u64 {
            w.page(BlockIdx(0), p * 4096, &page(p as u32)).unwrap();
        }
        for p in 0..4u64 {
            w.zero(BlockIdx(1), p * 4096, 0).unwrap();
        }
        w.tail(&tail()).unwrap();
        let (bytes, _) = w.finish().unwrap();
        let ses = store.session();
        let chooser = Chooser::new(CodecPolicy::Auto, 100e6, 2);
        for cut in [10, 5000, bytes.len() / 2, bytes.len() - 3] {
            let e = ingest(&bytes[..cut], &ses, &chooser, &IngestOptions::default(), &NoProgress).unwrap_err();
            assert!(
                matches!(
                    e,
                    IngestError::Stream(StreamError::Truncated { .. } | StreamError::BadTail { .. })
                ),
                "cut {cut}: {e:?}"
            );
        }
    }
}

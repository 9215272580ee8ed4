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
//!   into frames of up to 32 consecutive pages (128 KiB of codec context; 64 in a
//!   stop-and-copy save to a network backend, `SAVE_NETWORK_FRAME_PAGES`) for `put_frame`,
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
use super::stream::{
    Event, Limits, Parser, SinkError, StreamError, StreamInfo, StreamSink, PAGE_SIZE,
};
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
pub(crate) const QUEUE_BYTES: usize = 32 << 20;
/// The queue of a stop-and-copy save ([`IngestOptions::queue_bytes`]): with 2 workers, 4
/// batches queued and 2 in progress. A 128 MiB save to S3 takes ~10% fewer page faults with
/// 4 MiB than with 8 MiB (4 rounds each: 9.5k / 5.0k / 6.6k / 2.2k against 10.5k / 6.6k /
/// 7.1k / 2.5k), each one fresh memory the host is slow to hand out.
pub(crate) const SAVE_QUEUE_BYTES: usize = 4 << 20;

/// Pages per compressed frame by default (128 KiB). zstd -1 compresses and decompresses
/// 64 KiB blocks ~20% slower than 128 KiB ones on these hosts (`zstd -b1 -B64K` against
/// `-B128K`), and a 128 MiB save to S3, bound by its compressing CPU, takes a median 0.314 s
/// against 0.35 s with 16-page frames, its restore 0.224 s against 0.229 s (10 rounds each,
/// `bench save-restore --remote`). Bigger frames make a single page's read (a
/// delta's base) decode more, so the gain stops here.
pub(crate) const FRAME_PAGES: usize = 32;
/// Pages per frame of a stop-and-copy save to a network backend (256 KiB), with
/// [`SAVE_NETWORK_START`](super::codec_choice::SAVE_NETWORK_START) (zstd:1 with a minimum
/// match of 5 on these frames, raised to zstd:2 while uploads queue). On a captured idle
/// 512 MiB guest's 74 MB of non-zero pages (`zstd -b2 -B256K` against `-b3 -B128K`), zstd:2
/// on 256 KiB blocks stores the same bytes as zstd:3 on 128 KiB ones (16.26 against 16.29 MB)
/// at 544 against 436 MB/s: the same link time for a fifth less of the pool's CPU, which is
/// what such a save on 2 cores is short of. Idle-guest saves with `--codec zstd:2` on these
/// frames take 0.169-0.177 s against 0.183-0.199 s by median at 128 MiB in three pools of 10
/// rounds (`docs/results/README.md`). zstd:3 on 256 KiB frames stores 2.6% less but costs
/// more CPU, and is slower. Live checkpoints keep [`FRAME_PAGES`]: their delta
/// pages read single pages of a base, which decode whole frames.
pub(crate) const SAVE_NETWORK_FRAME_PAGES: usize = 64;
/// Largest frame a save writes (256 KiB).
pub(crate) const MAX_FRAME_PAGES: usize = 64;

mod dispatch;
mod pool;
mod run_table;
#[cfg(test)]
mod tests;

use dispatch::Dispatch;
use pool::worker;
pub use run_table::RunTableStats;

/// Tuning of the pipeline.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// Hashing/compressing threads (default: available cores).
    pub workers: usize,
    /// Pages per batch handed to a worker.
    pub batch_pages: usize,
    /// Pages per compressed frame (at most `MAX_FRAME_PAGES`).
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
    /// `SAVE_QUEUE_BYTES`.
    pub queue_bytes: usize,
    pub limits: Limits,
    /// Base checkpoint for delta pages (`delta`); None stores every new page whole.
    pub base: Option<std::sync::Arc<Base>>,
    /// Store aligned groups of new uniform pages as run chunks (`pool.rs`; manifest version
    /// 3). Off only to compare.
    pub runs: bool,
    /// Also make runs of groups whose pages compress (stored in frames of the save's codec,
    /// two runs to a 256 KiB frame), and name a later copy of a page inside a run by the
    /// run's slot (a slot table, format version 4) instead of storing it again: a stop-and-copy
    /// save to a network backend.
    pub compressible_runs: bool,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            workers: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            batch_pages: 256,
            frame_pages: FRAME_PAGES,
            compressible_runs: false,
            hot_bytes: 256 << 20,
            flush_every: 128 << 20,
            queue_bytes: QUEUE_BYTES,
            limits: Limits::default(),
            base: None,
            runs: true,
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
    /// Per ramblock, `(page, slot)` of the pages that name a run's slot other than their
    /// page number's (`pool.rs`), in page order: the page maps' slot tables (version 4).
    pub slots: Vec<Vec<(u32, u8)>>,
    /// Run chunks the maps name (`pool.rs`): a page mapped to one of these is its slot
    /// (page number modulo [`RUN_PAGES`](crate::memory::manifest::RUN_PAGES), unless `slots`
    /// names another).
    pub runs: std::collections::HashSet<ChunkId>,
    /// What the save's table of pages inside its runs held at the end (compressible runs).
    pub run_table: RunTableStats,
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
    /// Per block, per page: the run slot a page names when it is not its page number's
    /// (`pool.rs`: a copy of a page inside a run made elsewhere), [`NO_SLOT`] otherwise; a
    /// block's vector is allocated on its first such page.
    slots: Vec<Vec<u8>>,
}

/// [`PageMap::slots`] of a page that names no other slot.
const NO_SLOT: u8 = u8::MAX;

impl PageMap {
    fn set(&mut self, block: u32, page: u32, rec: u64, id: ChunkId) {
        let (b, p) = (block as usize, page as usize);
        if let Some(r) = self.recs.get_mut(b).and_then(|v| v.get_mut(p)) {
            if rec > *r {
                *r = rec;
                self.ids[b][p] = id;
                if let Some(s) = self.slots.get_mut(b).and_then(|v| v.get_mut(p)) {
                    *s = NO_SLOT;
                }
            }
        }
    }

    /// After [`set`](Self::set) of record `rec` naming a run: the page is that run's `slot`
    /// (kept only while `rec` is the page's latest record).
    fn set_slot(&mut self, block: u32, page: u32, rec: u64, slot: u8) {
        let (b, p) = (block as usize, page as usize);
        if self.recs.get(b).and_then(|v| v.get(p)) != Some(&rec) {
            return;
        }
        if self.slots.len() <= b {
            self.slots.resize(b + 1, Vec::new());
        }
        if self.slots[b].is_empty() {
            self.slots[b] = vec![NO_SLOT; self.ids[b].len()];
        }
        self.slots[b][p] = slot;
    }

    /// Per ramblock, `(page, slot)` in page order.
    fn slot_tables(&self) -> Vec<Vec<(u32, u8)>> {
        let mut out = vec![Vec::new(); self.ids.len()];
        for (b, v) in self.slots.iter().enumerate() {
            out[b] = v
                .iter()
                .enumerate()
                .filter(|(_, &s)| s != NO_SLOT)
                .map(|(p, &s)| (p as u32, s))
                .collect();
        }
        out
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
    runs_enabled: bool,
    compressible_runs: bool,
    /// Run chunks the maps name (new or found in the store).
    runs: Mutex<std::collections::HashSet<ChunkId>>,
    /// With `compressible_runs`: the run and slot of every page inside a run this save made,
    /// so a copy elsewhere names that slot instead of being stored again (`run_table.rs`).
    run_pages: Mutex<run_table::RunTable>,
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
                .compare_exchange(
                    due,
                    stored + self.flush_every,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
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

impl<'a> Shared<'a> {
    fn new(
        session: &'a Session,
        chooser: &'a Chooser,
        opts: &'a IngestOptions,
        frame_pages: usize,
    ) -> Shared<'a> {
        let stored = session.store().stats().stored_bytes_new.load(Ordering::Relaxed);
        Shared {
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
            next_flush: AtomicU64::new(stored + opts.flush_every),
            flush_every: opts.flush_every,
            flush_tx: Mutex::new(None),
            // On a network backend base reads cross the link: they get a budget (`delta.rs`).
            delta: opts.base.as_deref().map(|b| {
                let sink = DeltaSink::new(b);
                if session.store().backend().capabilities().network {
                    sink.with_read_budget(super::delta::READ_ALLOWANCE)
                } else {
                    sink
                }
            }),
            runs_enabled: opts.runs,
            compressible_runs: opts.compressible_runs,
            runs: Mutex::new(std::collections::HashSet::new()),
            run_pages: Mutex::new(run_table::RunTable::default()),
        }
    }
}

/// What the parse thread measured, for [`Ingested`].
#[derive(Default)]
struct ParseTimes {
    read_ns: u64,
    parse_cpu_ns: u64,
    drain_ms: f64,
    flush_ns: AtomicU64,
}

/// Read a whole migration stream from `src`, storing pages through `session`. Returns when
/// the stream ended correctly (EOF + VMDESCRIPTION) and every batch is stored; nothing is
/// committed here. Stages: start the flusher and the pool, parse the stream into batches,
/// drain the pool, then collect the maps and counters.
pub fn ingest<R: Read>(
    src: R,
    session: &Session,
    chooser: &Chooser,
    opts: &IngestOptions,
    progress: &dyn Progress,
) -> Result<Ingested, IngestError> {
    let workers = opts.workers.max(1);
    let frame_pages = opts.frame_pages.clamp(1, MAX_FRAME_PAGES);
    let batch_pages = opts.batch_pages.max(frame_pages);
    let sh = Shared::new(session, chooser, opts, frame_pages);
    let (flush_tx, flush_rx) = mpsc::sync_channel::<()>(1);
    *sh.flush_tx.lock() = Some(flush_tx);
    // A deep queue rides out short stalls of the pool (a pack write, a background flush)
    // without QEMU's sender blocking on the socket (`IngestOptions::queue_bytes`).
    let depth = (opts.queue_bytes / (batch_pages * PAGE_SIZE)).max(workers * 2);
    let (tx, rx) = mpsc::sync_channel::<Batch>(depth);
    let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(depth + workers + 2);
    let rx = Mutex::new(rx);
    let parse_cpu_start = thread_cpu_ns();
    let writer_wait0 = session.store().writer_wait_ns();
    let mut times = ParseTimes::default();

    let parsed: Result<(StreamInfo, u64), IngestError> = std::thread::scope(|s| {
        let flusher = spawn_flusher(s, &sh, flush_rx, &times.flush_ns);
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
        let mut d = Dispatch::new(&sh, tx, &free_rx, batch_pages, opts.hot_bytes, progress);
        let result = parse(src, opts, &mut d, &mut times.read_ns);
        times.parse_cpu_ns = thread_cpu_ns();
        let superseded = d.superseded;
        progress.advance(d.pending_progress);
        drop(d); // closes the batch channel: workers drain it and exit
        let t_drain = std::time::Instant::now();
        let mut panicked = false;
        for h in handles {
            panicked |= h.join().is_err();
        }
        times.drain_ms = t_drain.elapsed().as_secs_f64() * 1e3;
        sh.flush_tx.lock().take(); // ends the flusher
        panicked |= flusher.join().is_err();
        if panicked {
            return Err(IngestError::Panic);
        }
        result.map(|info| (info, superseded))
    });
    // A store failure explains a stopped pipeline better than the sink error it caused.
    if let Some(e) = sh.error.lock().take() {
        return Err(IngestError::Store(e));
    }
    let (info, superseded) = parsed?;
    progress.finish();
    let waits = IngestWaits {
        parse_read_ms: times.read_ns as f64 / 1e6,
        parse_queue_ms: sh.queue_ns.load(Ordering::Relaxed) as f64 / 1e6,
        pool_idle_ms: sh.idle_ns.load(Ordering::Relaxed) as f64 / 1e6,
        pool_put_ms: sh.put_ns.load(Ordering::Relaxed) as f64 / 1e6,
        pack_writer_ms: session.store().writer_wait_ns().saturating_sub(writer_wait0) as f64 / 1e6,
        flushes_ms: times.flush_ns.load(Ordering::Relaxed) as f64 / 1e6,
    };
    let parse_cpu_ms = times.parse_cpu_ns.saturating_sub(parse_cpu_start) as f64 / 1e6;
    Ok(collect(sh, info, superseded, waits, times.drain_ms, parse_cpu_ms))
}

/// The background flusher: makes packs and index objects durable when the pool asks
/// (`Shared::maybe_flush`), until its channel closes.
fn spawn_flusher<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    sh: &'s Shared<'_>,
    flush_rx: Receiver<()>,
    flush_ns: &'s AtomicU64,
) -> std::thread::ScopedJoinHandle<'s, ()> {
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
}

/// The parse thread's loop: read `src` in [`READ_BYTES`] pieces into the parser, which hands
/// records to the dispatcher; at the end, send the held-back pages and the last batch.
fn parse<R: Read>(
    mut src: R,
    opts: &IngestOptions,
    d: &mut Dispatch<'_, '_>,
    read_ns: &mut u64,
) -> Result<StreamInfo, IngestError> {
    let mut parser = Parser::new(opts.limits.clone());
    let mut buf = vec![0u8; READ_BYTES];
    loop {
        let t_read = std::time::Instant::now();
        let r = src.read(&mut buf);
        *read_ns += t_read.elapsed().as_nanos() as u64;
        let n = match r {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(source) => return Err(IngestError::Read { bytes: parser.bytes_fed(), source }),
        };
        parser.feed(&buf[..n], d).map_err(IngestError::Stream)?;
    }
    let info = parser.finish(d).map_err(IngestError::Stream)?;
    d.flush_hot().and_then(|_| d.send()).map_err(|_| IngestError::Panic)?;
    Ok(info)
}

/// Per ramblock, the pages no record covered (record number 0) and the first of them.
fn missing_pages(recs: &[Vec<u64>]) -> Vec<(u64, u64)> {
    recs.iter()
        .map(|r| {
            let n = r.iter().filter(|&&x| x == 0).count() as u64;
            (n, r.iter().position(|&x| x == 0).unwrap_or(0) as u64)
        })
        .collect()
}

/// The finished ingest: maps, slot tables, runs and counters out of the shared state.
fn collect(
    sh: Shared<'_>,
    info: StreamInfo,
    superseded: u64,
    waits: IngestWaits,
    drain_ms: f64,
    parse_cpu_ms: f64,
) -> Ingested {
    let map = sh.map.into_inner();
    let runs = sh.runs.into_inner();
    let run_table = sh.run_pages.into_inner().stats();
    let missing = missing_pages(&map.recs);
    let counters = IngestCounters {
        page_records: info.stats.page_records,
        zero_records: info.stats.zero_records,
        zero_content: sh.zero_content.load(Ordering::Relaxed),
        new_chunks: sh.new_chunks.load(Ordering::Relaxed),
        frames: sh.frames.load(Ordering::Relaxed),
        superseded,
    };
    tracing::debug!(target: TARGET, ?counters, "stream ingested");
    let slots = map.slot_tables();
    Ingested {
        info,
        maps: map.ids,
        slots,
        run_table,
        missing,
        counters,
        drain_ms,
        parse_cpu_ms,
        pool_cpu_ms: sh.worker_cpu_ns.load(Ordering::Relaxed) as f64 / 1e6,
        waits,
        delta: sh.delta.as_ref().map(DeltaSink::outcome),
        runs,
    }
}

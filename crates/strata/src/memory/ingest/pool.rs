//! The pool's side of the pipeline: each worker takes a batch, detects zero pages, hashes the
//! rest 16 at a time, offers new pages to the delta sink and stores the others in frames.
//! Apart from the parse side (`dispatch.rs`): the two only share the batch queue and `Shared`.
//!
//! Run chunks (checkpoint format version 3): an aligned group of [`RUN_PAGES`] consecutive
//! pages that are all new to the store, distinct and uniform bytes (no codec shrinks them) is
//! stored as **one** chunk of 128 KiB instead of 32 page chunks, and every page of the group
//! maps to it (the page's slot is its page number modulo 32). Such pages never deduplicate
//! one by one anyway, and each page chunk costs a 32-byte id in its pack's table and another
//! in the page map: 1.6% of an incompressible page, enough to make an all-random guest's save
//! 1.4% larger than QEMU's `zstd -1` stream without runs (`docs/results`). A group
//! that comes back unchanged (same pages at the same place) is the same run chunk, so it
//! still deduplicates, as a whole. With a base checkpoint, a group whose 32 pages the base
//! held in one run that differs from this one is left to the delta sink page by page, which
//! maps every page still equal to its slot in the base's run back to that run; any other
//! group of new uniform pages (the base had zeros, or other pages there) is a run.
//!
//! Compressible runs (`IngestOptions::compressible_runs`: stop-and-copy saves to a network
//! backend): groups whose pages compress become runs too, two to a frame of the save's codec.
//! Every page inside a run this save made is entered in `run_pages` (`run_table.rs`), so
//! a later copy of it, which could not find it in the store, names that run's slot (a slot
//! table entry, format version 4) instead of being stored again; a group holding such a copy
//! is left page by page, and two workers cannot take one page into two runs.

use super::*;
use crate::codec::{byte_entropy, Codec};
use crate::memory::manifest::{is_run_chunk, RUN_PAGES, RUN_UNIFORM_BITS};
use crate::store::Store;

/// Whether a page's bytes look uniform: the entropy of two 512-byte runs (its start and its
/// middle) above [`RUN_UNIFORM_BITS`]. A page of text or code measures 4-6.5 bits, any page
/// with a run of zeros far less; 1 KiB of uniform bytes ~7.82.
pub(crate) fn uniform_page(page: &[u8]) -> bool {
    byte_entropy(&[&page[..512], &page[2048..2560]]) > RUN_UNIFORM_BITS
}

/// The run chunk the base checkpoint maps the group at (`block`, `p0`) to, if it maps all
/// [`RUN_PAGES`] of them to one.
fn base_run(d: &DeltaSink<'_>, store: &Store, block: u32, p0: u32) -> Option<ChunkId> {
    let first = d.base_id(block, p0)?;
    if first.is_zero() || (1..RUN_PAGES as u32).any(|k| d.base_id(block, p0 + k) != Some(first)) {
        return None;
    }
    is_run_chunk(store, &first).then_some(first)
}

/// Batch indices where a run starts: [`RUN_PAGES`] batch entries of one ramblock with
/// consecutive page numbers from a multiple of [`RUN_PAGES`], none zero, all distinct, none in
/// the store yet and all uniform. Cheap tests first: the store lookups and the entropy only
/// for groups of the right shape.
fn find_runs(
    store: &Store,
    batch: &Batch,
    ids: &[ChunkId],
    any_content: bool,
    out: &mut Vec<usize>,
) {
    out.clear();
    let n = batch.pages.len();
    let mut i = 0;
    let mut sorted: Vec<ChunkId> = Vec::with_capacity(RUN_PAGES);
    while i + RUN_PAGES <= n {
        let (b0, p0, _) = batch.pages[i];
        if !(p0 as usize).is_multiple_of(RUN_PAGES) {
            i += 1;
            continue;
        }
        let group = i..i + RUN_PAGES;
        let shaped = batch.pages[group.clone()]
            .iter()
            .enumerate()
            .all(|(k, &(b, p, _))| b == b0 && p == p0 + k as u32)
            && ids[group.clone()].iter().all(|id| !id.is_zero());
        if !shaped {
            i += 1;
            continue;
        }
        sorted.clear();
        sorted.extend_from_slice(&ids[group.clone()]);
        sorted.sort_unstable();
        let ok = sorted.windows(2).all(|w| w[0] != w[1])
            && (any_content
                || batch.data[i * PAGE_SIZE..(i + RUN_PAGES) * PAGE_SIZE]
                    .chunks_exact(PAGE_SIZE)
                    .all(uniform_page))
            && ids[group].iter().all(|id| !store.contains(id));
        if ok {
            out.push(i);
        }
        // No other aligned group starts inside this one.
        i += RUN_PAGES;
    }
}

/// All-zero test that the compiler vectorises (an OR-fold per 64-byte block).
pub(crate) fn is_zero(page: &[u8]) -> bool {
    page.chunks(64).all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}

/// A pool worker: take batches until the queue closes, and store each (unless the ingest
/// already failed), handing its buffer back for reuse.
pub(super) fn worker(sh: &Shared<'_>, rx: &Mutex<Receiver<Batch>>, free: &SyncSender<Vec<u8>>) {
    let mut w = Worker::new(sh.frame_pages);
    loop {
        let t_wait = std::time::Instant::now();
        let got = rx.lock().recv();
        sh.idle_ns.fetch_add(t_wait.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let Ok(batch) = got else { break };
        if !sh.failed.load(Ordering::Relaxed) {
            w.store_batch(sh, &batch);
        }
        let _ = free.try_send(batch.data);
    }
}

/// A worker's buffers, reused from batch to batch.
#[derive(Default)]
struct Worker {
    /// Per batch page: its id (zero id for a zero page; a run's or delta record's id once
    /// stored that way).
    ids: Vec<ChunkId>,
    nonzero: Vec<usize>,
    hashed: Vec<ChunkId>,
    /// The new bytes of a sampled frame, for the codec chooser.
    fresh: Vec<u8>,
    dw: DeltaWorker,
    starts: Vec<usize>,
    /// Runs stored raw, one frame each: (batch index of the first page, run id).
    runs: Vec<(usize, ChunkId)>,
    /// Runs whose pages compress, stored in frames of the save's codec.
    packed_runs: Vec<(usize, ChunkId)>,
    in_run: Vec<bool>,
}

/// Where the pages of a batch that are neither zero nor in a run went, besides frames.
#[derive(Default)]
struct Placed {
    /// Pages kept as delta records: (batch index, record id).
    as_delta: Vec<(usize, ChunkId)>,
    /// Copies of pages inside runs of this save: (batch index, run, slot).
    aliases: Vec<(usize, ChunkId, u8)>,
}

/// The frame being filled: up to `frame_pages` items, and the batch indices they span.
struct Frames<'b> {
    data: &'b [u8],
    items: Vec<(ChunkId, &'b [u8])>,
    /// The batch indices `items` span: when that is exactly their number they are
    /// consecutive pages of the batch, end to end in `data`, and the codec reads them in
    /// place.
    span: Option<(usize, usize)>,
}

impl<'b> Frames<'b> {
    /// Store a frame of the items: the number of them new to the store, None on failure
    /// (recorded in `sh`).
    fn flush(&mut self, sh: &Shared<'_>, fresh: &mut Vec<u8>) -> Option<usize> {
        if self.items.is_empty() {
            return Some(0);
        }
        // The codec chooser measures (on sampled frames only) bytes the store does not hold
        // yet, as the store will pick them (absent, each once), and the store then keeps the
        // sample's output for the chosen codec instead of compressing again.
        fresh.clear();
        let mut fresh_ids: Vec<ChunkId> = Vec::new();
        if sh.chooser.wants_sample() {
            let store = sh.session.store();
            for (id, d) in self.items.iter() {
                if !store.contains(id) && !fresh_ids.contains(id) {
                    fresh.extend_from_slice(d);
                    fresh_ids.push(*id);
                }
            }
        }
        let (codec, sampled) = sh.chooser.codec_for_frame(fresh);
        let pre = sampled.map(|stored| Precompressed { ids: fresh_ids, stored });
        sh.frames.fetch_add(1, Ordering::Relaxed);
        let t_put = std::time::Instant::now();
        let data = self.data;
        let n = self.items.len();
        let joined = self
            .span
            .take()
            .filter(|(a, b)| b - a == n)
            .map(|(a, b)| &data[a * PAGE_SIZE..b * PAGE_SIZE]);
        let r = sh.session.put_frame_joined(&self.items, ChunkKind::Data, codec, pre, joined);
        sh.put_ns.fetch_add(t_put.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.items.clear();
        match r {
            Ok(n) => {
                sh.new_chunks.fetch_add(n as u64, Ordering::Relaxed);
                sh.maybe_flush();
                Some(n)
            }
            Err(e) => {
                sh.fail(e);
                None
            }
        }
    }
}

/// The bytes of the run starting at batch index `i`.
fn run_bytes(batch: &Batch, i: usize) -> &[u8] {
    &batch.data[i * PAGE_SIZE..(i + RUN_PAGES) * PAGE_SIZE]
}

impl Worker {
    fn new(frame_pages: usize) -> Worker {
        Worker { fresh: Vec::with_capacity(frame_pages * PAGE_SIZE), ..Default::default() }
    }

    /// Store one batch, in stages: hash, pick the runs, store the pages in frames (or as
    /// delta records, or as aliases of run slots), store the compressible runs, flush the
    /// deltas, store the raw runs, and enter every page in the map. A failure is recorded in
    /// `sh` and leaves the map untouched.
    fn store_batch(&mut self, sh: &Shared<'_>, batch: &Batch) {
        self.hash(sh, batch);
        self.pick_runs(sh, batch);
        let read_base = sh.delta.as_ref().is_some_and(|d| self.dw.batch_start(d));
        let mut frames =
            Frames { data: &batch.data, items: Vec::with_capacity(sh.frame_pages), span: None };
        let (placed, mut ok) = self.store_pages(sh, batch, &mut frames, read_base);
        ok = ok && self.store_packed_runs(sh, batch, &mut frames);
        if let Some(d) = &sh.delta {
            if read_base {
                self.dw.batch_end();
            }
            if ok {
                if let Err(e) = self.dw.flush(d, sh.session) {
                    sh.fail(e);
                    ok = false;
                }
            }
        }
        for &(i, rid) in &placed.as_delta {
            self.ids[i] = rid;
        }
        ok = ok && self.store_raw_runs(sh, batch);
        for &(i, rid, _) in &placed.aliases {
            self.ids[i] = rid;
        }
        if ok {
            self.record(sh, batch, &placed.aliases);
        }
    }

    /// Zero pages get the zero id; the others are hashed together, 16 per SIMD pass.
    fn hash(&mut self, sh: &Shared<'_>, batch: &Batch) {
        self.ids.clear();
        self.ids.resize(batch.pages.len(), ChunkId::ZERO);
        self.nonzero.clear();
        let mut zeros = 0;
        for (i, page) in batch.data.chunks_exact(PAGE_SIZE).take(batch.pages.len()).enumerate() {
            if is_zero(page) {
                zeros += 1;
            } else {
                self.nonzero.push(i);
            }
        }
        let pages: Vec<&[u8; PAGE_SIZE]> = self
            .nonzero
            .iter()
            .map(|&i| as_page(&batch.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]).expect("page"))
            .collect();
        self.hashed.clear();
        self.hashed.resize(pages.len(), ChunkId::ZERO);
        hash_pages(&pages, &mut self.hashed);
        for (&i, id) in self.nonzero.iter().zip(&self.hashed) {
            self.ids[i] = *id;
        }
        sh.zero_content.fetch_add(zeros, Ordering::Relaxed);
    }

    /// The batch's runs: raw ones in `runs`, compressible ones in `packed_runs`, and
    /// `in_run` marking their pages.
    fn pick_runs(&mut self, sh: &Shared<'_>, batch: &Batch) {
        self.runs.clear();
        if sh.runs_enabled {
            let store = sh.session.store();
            find_runs(store, batch, &self.ids, sh.compressible_runs, &mut self.starts);
            for &i in &self.starts {
                let rid = ChunkId::of(run_bytes(batch, i));
                let (block, p0, _) = batch.pages[i];
                if let Some(d) = &sh.delta {
                    if base_run(d, store, block, p0).is_some_and(|b| b != rid) {
                        continue;
                    }
                }
                // A group with a page already inside another run of this save is left to
                // name that run's slot page by page (`store_pages`); otherwise its pages are
                // entered, under one lock, so two workers cannot both take a page into runs.
                if sh.compressible_runs {
                    let group = &self.ids[i..i + RUN_PAGES];
                    let mut rp = sh.run_pages.lock();
                    if rp.holds_any(group) || !rp.enter(rid, group) {
                        continue;
                    }
                }
                self.runs.push((i, rid));
            }
        }
        // Runs whose pages compress go into frames of the save's codec, the rest raw.
        self.packed_runs.clear();
        if sh.compressible_runs {
            let packed = &mut self.packed_runs;
            self.runs.retain(|&(i, rid)| {
                let uniform = run_bytes(batch, i).chunks_exact(PAGE_SIZE).all(uniform_page);
                if !uniform {
                    packed.push((i, rid));
                }
                uniform
            });
        }
        self.in_run.clear();
        self.in_run.resize(batch.pages.len(), false);
        for &(i, _) in self.runs.iter().chain(&self.packed_runs) {
            self.in_run[i..i + RUN_PAGES].fill(true);
        }
    }

    /// Store the pages outside runs in frames of up to `frame_pages`, in stream order, except
    /// copies of pages inside this save's runs (aliases) and pages kept as delta records.
    /// Returns where those went, and false on a failure.
    fn store_pages<'b>(
        &mut self,
        sh: &Shared<'_>,
        batch: &'b Batch,
        frames: &mut Frames<'b>,
        read_base: bool,
    ) -> (Placed, bool) {
        let mut placed = Placed::default();
        let pages = batch.data.chunks_exact(PAGE_SIZE).take(batch.pages.len());
        let store = sh.session.store();
        for (i, ((id, page), &(block, page_no, _))) in
            self.ids.iter().zip(pages).zip(&batch.pages).enumerate()
        {
            if id.is_zero() || self.in_run[i] {
                continue;
            }
            // A page the store does not hold as a chunk, but a run of this save does: the map
            // names the run and the slot (version 4) instead of storing the page again.
            if sh.compressible_runs && !store.contains(id) {
                if let Some((rid, slot)) = sh.run_pages.lock().get(id) {
                    placed.aliases.push((i, rid, slot));
                    continue;
                }
            }
            // A page new to the store may be kept as a delta against the base checkpoint:
            // its map entry is then the delta record's id.
            if let Some(d) = &sh.delta {
                if !store.contains(id) {
                    if let Some(rid) =
                        self.dw.offer(d, sh.session, *id, block, page_no, page, read_base)
                    {
                        // Unchanged since the base, where it was in a run: the run again.
                        if is_run_chunk(store, &rid) {
                            sh.runs.lock().insert(rid);
                        }
                        placed.as_delta.push((i, rid));
                        continue;
                    }
                }
            }
            // Indices only grow, so the frame is consecutive pages iff it spans len pages.
            frames.span = Some((frames.span.map_or(i, |(a, _)| a), i + 1));
            frames.items.push((*id, page));
            if frames.items.len() == sh.frame_pages && frames.flush(sh, &mut self.fresh).is_none() {
                return (placed, false);
            }
        }
        let ok = frames.flush(sh, &mut self.fresh).is_some();
        (placed, ok)
    }

    /// Compressible runs: as many to a frame as `frame_pages` holds (two on 256 KiB frames).
    /// False on a failure.
    fn store_packed_runs<'b>(
        &mut self,
        sh: &Shared<'_>,
        batch: &'b Batch,
        frames: &mut Frames<'b>,
    ) -> bool {
        if self.packed_runs.is_empty() {
            return true;
        }
        let per_frame = (sh.frame_pages / RUN_PAGES).max(1);
        // Runs new to the store (one that comes back unchanged is deduplicated whole).
        let mut new_runs = 0;
        for &(i, rid) in &self.packed_runs {
            frames.items.push((rid, run_bytes(batch, i)));
            if frames.items.len() == per_frame {
                match frames.flush(sh, &mut self.fresh) {
                    Some(n) => new_runs += n,
                    None => return false,
                }
            }
        }
        match frames.flush(sh, &mut self.fresh) {
            Some(n) => new_runs += n,
            None => return false,
        }
        // `flush` counted each new run once; a run stands for its pages, as raw runs do.
        sh.new_chunks.fetch_add((new_runs * (RUN_PAGES - 1)) as u64, Ordering::Relaxed);
        let mut set = sh.runs.lock();
        for &(i, rid) in &self.packed_runs {
            self.ids[i..i + RUN_PAGES].fill(rid);
            set.insert(rid);
        }
        true
    }

    /// Raw runs: one frame each, and every page of the group maps to the run's id. False on a
    /// failure.
    fn store_raw_runs(&mut self, sh: &Shared<'_>, batch: &Batch) -> bool {
        for &(i, rid) in &self.runs {
            sh.frames.fetch_add(1, Ordering::Relaxed);
            let t_put = std::time::Instant::now();
            let r =
                sh.session.put_frame(&[(rid, run_bytes(batch, i))], ChunkKind::Data, Codec::None);
            sh.put_ns.fetch_add(t_put.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match r {
                Ok(n) => {
                    sh.new_chunks.fetch_add((n * RUN_PAGES) as u64, Ordering::Relaxed);
                    sh.maybe_flush();
                }
                Err(e) => {
                    sh.fail(e);
                    return false;
                }
            }
            self.ids[i..i + RUN_PAGES].fill(rid);
            sh.runs.lock().insert(rid);
        }
        true
    }

    /// Enter the batch's pages in the map, and the aliases' slots.
    fn record(&self, sh: &Shared<'_>, batch: &Batch, aliases: &[(usize, ChunkId, u8)]) {
        if !aliases.is_empty() {
            let mut set = sh.runs.lock();
            set.extend(aliases.iter().map(|a| a.1));
        }
        let mut map = sh.map.lock();
        for ((block, page, rec), id) in batch.pages.iter().zip(&self.ids) {
            map.set(*block, *page, *rec, *id);
        }
        for &(i, _, slot) in aliases {
            let (block, page, rec) = batch.pages[i];
            map.set_slot(block, page, rec, slot);
        }
    }
}

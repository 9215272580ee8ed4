//! Streaming: fetchers read the planned ranges, decoders verify and decompress whole frames,
//! and one writer emits the pages, zero pages and tail as a QEMU migration stream.

use super::*;

/// Decoded frames' buffers, handed back by the writer once their pages are in the stream and
/// taken again by the decoders: a restore touches its working set once instead of fresh memory
/// for every frame. Fresh memory is a page fault per 4 KiB, and on a host whose free memory
/// is handed back to a hypervisor an expensive one (`bench save-restore --remote` logs the
/// faults of every restore).
pub(super) struct Buffers {
    pub(super) free: parking_lot::Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept for reuse (of up to a frame each: 128 KiB for memory frames).
pub(super) const KEPT_BUFFERS: usize = 512;

impl Buffers {
    pub(super) fn new() -> Buffers {
        Buffers { free: parking_lot::Mutex::new(Vec::new()) }
    }

    pub(super) fn take(&self) -> Vec<u8> {
        self.free.lock().pop().unwrap_or_default()
    }

    pub(super) fn give(&self, b: Vec<u8>) {
        let mut free = self.free.lock();
        if free.len() < KEPT_BUFFERS {
            free.push(b);
        }
    }
}

/// A verified frame: its raw bytes and the pages (unique ids) to write from it.
pub(super) struct Decoded {
    pub(super) raw: Vec<u8>,
    pub(super) chunks: Vec<(u32, u32)>,
    pub(super) read: u64,
}

/// Compressed bytes handed to the decoders at a time. Frames are decoded as their bytes
/// arrive, not once their whole read is in: reads in flight share the link and end together,
/// and decoding each read whole left the last ones' decoding (~10 MiB of pages at 128 MiB)
/// for after the last byte, with the pages reaching QEMU in bursts.
pub(super) const BATCH_BYTES: u64 = 256 << 10;

/// Batches queued per fetcher for the decoders (a few MiB in all).
pub(super) const BATCHES_PER_FETCHER: usize = 8;

/// Frames `f0..f1` of job `j`, whose bytes start at pack offset `base`.
pub(super) struct Batch {
    pub(super) j: usize,
    pub(super) f0: usize,
    pub(super) f1: usize,
    pub(super) base: u64,
    pub(super) bytes: Vec<u8>,
}

/// Cuts one read's bytes, as they arrive, into batches of whole frames.
pub(super) struct Splitter<'a> {
    pub(super) j: usize,
    pub(super) job: &'a Job,
    pub(super) bufs: &'a Buffers,
    pub(super) buf: Vec<u8>,
    pub(super) base: u64,
    pub(super) f0: usize,
    pub(super) f1: usize,
}

impl<'a> Splitter<'a> {
    pub(super) fn new(j: usize, job: &'a Job, bufs: &'a Buffers) -> Self {
        let mut buf = bufs.take();
        buf.clear();
        Splitter { j, job, bufs, buf, base: job.start, f0: 0, f1: 0 }
    }

    /// Take arrived bytes; `emit` gets every batch they complete.
    pub(super) fn push(&mut self, mut piece: &[u8], emit: &mut dyn FnMut(Batch)) {
        let frames = &self.job.frames;
        while !piece.is_empty() {
            // Copy up to the end of the batch that can be cut next, so a buffer never holds
            // more than a batch (plus a frame).
            let want = self.next_cut().saturating_sub(self.base + self.buf.len() as u64).max(1);
            let n = (want as usize).min(piece.len());
            self.buf.extend_from_slice(&piece[..n]);
            piece = &piece[n..];
            let have = self.base + self.buf.len() as u64;
            while self.f1 < frames.len() && frames[self.f1].off + frames[self.f1].len as u64 <= have
            {
                self.f1 += 1;
            }
            if self.f1 > self.f0 && have >= self.next_cut() {
                let end = frames[self.f1 - 1].off + frames[self.f1 - 1].len as u64;
                let cut = (end - self.base) as usize;
                let mut rest = self.bufs.take();
                rest.clear();
                rest.extend_from_slice(&self.buf[cut..]);
                let mut bytes = std::mem::replace(&mut self.buf, rest);
                bytes.truncate(cut);
                emit(Batch { j: self.j, f0: self.f0, f1: self.f1, base: self.base, bytes });
                self.base = end;
                self.f0 = self.f1;
            }
        }
    }

    /// Pack offset at which the next batch is cut: the end of the first frame reaching
    /// [`BATCH_BYTES`] past the batch's start, or of the read's last frame.
    pub(super) fn next_cut(&self) -> u64 {
        let frames = &self.job.frames[self.f0..];
        frames
            .iter()
            .map(|f| f.off + f.len as u64)
            .find(|&e| e - self.base >= BATCH_BYTES)
            .unwrap_or(self.job.end)
    }

    /// Every frame handed over.
    pub(super) fn done(&self) -> bool {
        self.f0 == self.job.frames.len()
    }
}

/// Read job `j` and hand its frames to the decoders as they arrive (`send` false: the
/// decoders stopped). Returns the job's outcome when there is nothing (more) to decode: the
/// pack is gone (read through the index), or the read failed.
pub(super) fn fetch_job(
    store: &Store,
    plan: &Plan,
    j: usize,
    job: &Job,
    bufs: &Buffers,
    send: &mut dyn FnMut(Batch) -> bool,
) -> Option<Result<Vec<Decoded>, (u32, StoreError)>> {
    let early = plan.early.get(j).and_then(|h| h.lock().take()).and_then(|h| h.join().ok());
    let started = plan.t0.elapsed();
    let prefetched = early.is_some();
    let mut split = Splitter::new(j, job, bufs);
    let mut open = true;
    let mut emit = |b: Batch| open = open && send(b);
    let read = match early {
        Some(r) => r.map(|b| split.push(&b, &mut emit)),
        None => store.backend().get_range_to(
            &job.pack.pack_key(),
            job.start,
            job.end - job.start,
            &mut |piece| split.push(piece, &mut emit),
        ),
    };
    tracing::trace!(
        target: TARGET,
        j,
        bytes = job.end - job.start,
        prefetched,
        start_ms = started.as_secs_f64() * 1e3,
        end_ms = plan.t0.elapsed().as_secs_f64() * 1e3,
        "read"
    );
    let uid = |f: usize| job.frames[f.min(job.frames.len() - 1)].chunks[0].1;
    match read {
        Ok(()) if split.done() => None,
        Ok(()) => Some(Err((
            uid(split.f0),
            StoreError::Backend(crate::backend::BackendError::new(
                crate::backend::ErrorKind::Invalid,
                "get_range",
                job.pack.pack_key(),
            )),
        ))),
        Err(e) if e.is_not_found() => Some(fallback(store, plan, &job.frames[split.f0..])),
        Err(e) => Some(Err((uid(split.f0), StoreError::Backend(e)))),
    }
}

/// Check, decompress and verify the frames of one batch.
pub(super) fn decode_batch(
    plan: &Plan,
    batch: &Batch,
    bufs: &Buffers,
) -> Result<Vec<Decoded>, (u32, StoreError)> {
    let job = &plan.jobs[batch.j];
    let frames = &job.frames[batch.f0..batch.f1];
    let mut out = Vec::with_capacity(frames.len());
    for f in frames {
        let a = (f.off - batch.base) as usize;
        let u0 = f.chunks[0].1;
        let stored = batch.bytes.get(a..a + f.len as usize).ok_or_else(|| {
            (
                u0,
                StoreError::Backend(crate::backend::BackendError::new(
                    crate::backend::ErrorKind::Invalid,
                    "get_range",
                    job.pack.pack_key(),
                )),
            )
        })?;
        let corrupt = |u: u32, reason: String| {
            (
                u,
                StoreError::Corrupt {
                    id: plan.uids[u as usize],
                    pack: job.pack,
                    offset: f.off,
                    reason,
                },
            )
        };
        if crc(stored) != f.crc {
            return Err(corrupt(u0, "frame checksum mismatch".into()));
        }
        let mut raw = bufs.take();
        f.codec
            .decompress_into(stored, f.raw_len as usize, &mut raw)
            .map_err(|e| corrupt(u0, e.to_string()))?;
        // Every page is verified against its id, a frame's pages hashed together; a run
        // chunk (version 3) is verified whole, once, before any of its slots is used.
        let mut pages: Vec<&[u8; PAGE_SIZE]> = Vec::with_capacity(f.chunks.len());
        let mut page_uids: Vec<u32> = Vec::with_capacity(f.chunks.len());
        let mut runs_checked: Vec<usize> = Vec::new();
        for &(o, u) in &f.chunks {
            let slot = plan.slots[u as usize];
            if slot != NOT_A_RUN {
                let start = (o as usize).checked_sub(slot as usize * PAGE_SIZE);
                let run = start.and_then(|a| Some((a, raw.get(a..a + RUN_BYTES)?)));
                let (a, run) =
                    run.ok_or_else(|| corrupt(u, "chunk lies outside its frame".into()))?;
                if !runs_checked.contains(&a) {
                    if ChunkId::of(run) != plan.uids[u as usize] {
                        return Err(corrupt(u, "content does not match its hash".into()));
                    }
                    runs_checked.push(a);
                }
                continue;
            }
            let page = raw
                .get(o as usize..o as usize + PAGE_SIZE)
                .and_then(as_page)
                .ok_or_else(|| corrupt(u, "chunk lies outside its frame".into()))?;
            pages.push(page);
            page_uids.push(u);
        }
        let mut got = vec![ChunkId::ZERO; pages.len()];
        hash_pages(&pages, &mut got);
        for (&u, id) in page_uids.iter().zip(&got) {
            if *id != plan.uids[u as usize] {
                return Err(corrupt(u, "content does not match its hash".into()));
            }
        }
        out.push(Decoded { raw, chunks: f.chunks.clone(), read: 0 });
    }
    if let Some(d) = out.first_mut() {
        d.read = batch.bytes.len() as u64;
    }
    Ok(out)
}

/// Rebuild delta pages: each base page is read and verified, the runs applied, and the result
/// verified against the page's id.
pub(super) fn decode_deltas(
    store: &Store,
    plan: &Plan,
    uids: &[u32],
) -> Result<Vec<Decoded>, (u32, StoreError)> {
    uids.iter()
        .map(|&u| {
            let (_, page) =
                crate::memory::delta::rebuild(store, &plan.uids[u as usize]).map_err(|e| (u, e))?;
            Ok(Decoded { raw: page.to_vec(), chunks: vec![(0, u)], read: 0 })
        })
        .collect()
}

/// The pack went away (GC repacked it after the plan was made): read chunk by chunk through
/// the index, which follows the move.
pub(super) fn fallback(
    store: &Store,
    plan: &Plan,
    frames: &[FramePlan],
) -> Result<Vec<Decoded>, (u32, StoreError)> {
    let mut out = Vec::new();
    for f in frames {
        for &(_, u) in &f.chunks {
            let data = store.get(&plan.uids[u as usize]).map_err(|e| (u, e))?;
            // A run's page is its slot (the chunk was verified whole by `get`).
            let slot = plan.slots[u as usize];
            let at = if slot == NOT_A_RUN { 0 } else { slot as u32 * PAGE_SIZE as u32 };
            if data.len() < at as usize + PAGE_SIZE {
                return Err((
                    u,
                    StoreError::Corrupt {
                        id: plan.uids[u as usize],
                        pack: PackId::default(),
                        offset: 0,
                        reason: format!("chunk is {} bytes, not a page or a run", data.len()),
                    },
                ));
            }
            out.push(Decoded { read: data.len() as u64, raw: data, chunks: vec![(at, u)] });
        }
    }
    Ok(out)
}

/// A checkpoint ready to stream: maps and tail read and verified, every chunk located.
pub struct Prepared<'a> {
    pub(super) store: &'a Store,
    pub(super) ckpt: &'a Checkpoint,
    pub(super) layout: crate::memory::stream::StreamLayout,
    pub(super) plan: Plan,
    pub(super) plan_ms: f64,
}

/// Everything that can fail before the first byte goes to QEMU: maps, tail, missing chunks
/// or packs.
pub fn prepare<'a>(
    store: &'a Store,
    ckpt: &'a Checkpoint,
    opts: &RestoreOptions,
) -> Result<Prepared<'a>, MemError> {
    let t0 = Instant::now();
    let name = &ckpt.manifest.name;
    let layout = ckpt
        .manifest
        .layout()
        .map_err(|source| MemError::Manifest { name: name.clone(), source })?;
    let plan = make_plan(store, ckpt, opts.read_bytes)?;
    Ok(Prepared { store, ckpt, layout, plan, plan_ms: t0.elapsed().as_secs_f64() * 1e3 })
}

/// Generate the checkpoint's migration stream into `out`, every page verified first.
pub fn write_stream<W: Write>(
    store: &Store,
    ckpt: &Checkpoint,
    out: W,
    opts: &RestoreOptions,
    progress: &dyn Progress,
) -> Result<(W, RestoreReport), MemError> {
    let p = prepare(store, ckpt, opts)?;
    stream(p, out, opts, progress)
}

/// Write a prepared checkpoint's stream into `out`.
pub fn stream<W: Write>(
    p: Prepared<'_>,
    out: W,
    opts: &RestoreOptions,
    progress: &dyn Progress,
) -> Result<(W, RestoreReport), MemError> {
    let Prepared { store, ckpt, layout, plan, plan_ms } = p;
    let name = ckpt.manifest.name.clone();
    let t1 = Instant::now();
    let gen = |source| MemError::Generate { name: name.clone(), source };
    let mut w = StreamWriter::new(Timed::new(out), &layout).map_err(gen)?;
    progress.phase("restoring", Some(layout.total_ram()), Unit::Bytes);
    for &(b, p) in &plan.zeros {
        w.zero(BlockIdx(b), p as u64 * PAGE_SIZE as u64, 0).map_err(gen)?;
    }
    progress.advance(plan.zeros.len() as u64 * PAGE_SIZE as u64);
    let zeros_ms = t1.elapsed().as_secs_f64() * 1e3;
    // Fetchers keep FETCHERS reads in flight and hand the bytes to the decoders, so the link
    // never waits for a decode; delta jobs (small reads of their own) run on the fetchers.
    let workers = opts.workers.max(1);
    let fetchers = FETCHERS;
    let (tx, rx) = mpsc::sync_channel::<Decodes>(workers * 2);
    let (ftx, frx) = mpsc::sync_channel::<Batch>(fetchers * BATCHES_PER_FETCHER);
    // Shared by the decoders and dropped with the last of them, so a fetcher blocked on a full
    // queue wakes up (with an error) when the decoders stop.
    let frx = std::sync::Arc::new(parking_lot::Mutex::new(frx));
    let st = Stages {
        store,
        plan: &plan,
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        bufs: Buffers::new(),
        batch_bufs: Buffers::new(),
        fetch_blocked: AtomicU64::new(0),
        decode_blocked: AtomicU64::new(0),
    };
    let mut bytes_read = 0u64;
    // Time the writer waited for decoded pages (the link or the decoders were behind).
    let mut starved = std::time::Duration::ZERO;
    // A page's other addresses are written at the pace of the stream, not in one burst.
    let mut spread = Spread::new(&plan.ref_ranges, MAX_SLOTS);
    let result: Result<(), MemError> = std::thread::scope(|s| {
        for i in 0..fetchers {
            let (st, tx, ftx) = (&st, tx.clone(), ftx.clone());
            std::thread::Builder::new()
                .name(format!("strata-fetch-{i}"))
                .spawn_scoped(s, move || st.fetch(&tx, &ftx))
                .expect("spawn restore fetcher");
        }
        drop(ftx);
        for i in 0..workers {
            let (st, tx, frx) = (&st, tx.clone(), frx.clone());
            std::thread::Builder::new()
                .name(format!("strata-restore-{i}"))
                .spawn_scoped(s, move || st.decode(&tx, &frx))
                .expect("spawn restore worker");
        }
        drop(frx);
        // The writer's receiver is dropped when this closure returns, before the scope joins the
        // threads: a thread blocked on a full queue then gets an error instead of waiting forever.
        let rx = rx;
        drop(tx);
        loop {
            let t = Instant::now();
            let Ok(r) = rx.recv() else { break };
            starved += t.elapsed();
            let written = match r {
                Ok(frames) => {
                    write_frames(&mut w, &mut spread, &st, frames, &mut bytes_read).map_err(gen)
                }
                Err((u, source)) => {
                    let (a, _) = plan.ref_ranges[u as usize];
                    let (block, offset) = page_of(ckpt, plan.refs[a as usize]);
                    let id = plan.uids[u as usize];
                    Err(MemError::PageDamaged { name: name.clone(), block, offset, id, source })
                }
            };
            match written {
                Ok(n) => progress.advance(n * PAGE_SIZE as u64),
                Err(e) => {
                    st.stop.store(true, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
        Ok(())
    });
    let (fetch_blocked, decode_blocked) = (st.fetch_blocked, st.decode_blocked);
    result?;
    let held = spread.held();
    let n = spread
        .finish(&plan.refs, &mut |(b, p), page| {
            w.page(BlockIdx(b), p as u64 * PAGE_SIZE as u64, page)
        })
        .map_err(gen)?;
    progress.advance(n * PAGE_SIZE as u64);
    let pages_ms = t1.elapsed().as_secs_f64() * 1e3;
    w.tail(&plan.tail).map_err(gen)?;
    let (out, st): (Timed<W>, GenerateStats) = w.finish().map_err(gen)?;
    // Time in write calls is time QEMU's loader was behind (the socket buffer was full).
    tracing::debug!(
        target: TARGET,
        pages_ms,
        zeros_ms,
        held_at_end = held,
        most_held = spread.most_held,
        unspread = spread.unspread,
        starved_ms = starved.as_secs_f64() * 1e3,
        end_ms = t1.elapsed().as_secs_f64() * 1e3,
        write_ms = out.busy.as_secs_f64() * 1e3,
        writes = out.calls,
        longest_write_ms = out.longest.0.as_secs_f64() * 1e3,
        longest_write_at_ms = out.longest.1.as_secs_f64() * 1e3,
        fetch_blocked_ms = fetch_blocked.load(Ordering::Relaxed) as f64 / 1e6,
        decode_blocked_ms = decode_blocked.load(Ordering::Relaxed) as f64 / 1e6,
        "stream written"
    );
    let out = out.inner;
    progress.finish();
    let report = RestoreReport {
        name: name.clone(),
        plan_ms,
        stream_ms: t1.elapsed().as_secs_f64() * 1e3,
        stream_bytes: st.bytes,
        pages: st.page_records + st.zero_records,
        zero_pages: st.zero_records,
        chunks_verified: plan.uids.len() as u64,
        delta_pages: plan.delta_jobs.iter().map(|j| j.len() as u64).sum(),
        bytes_read,
        reads: plan.jobs.len() as u64,
        early_reads: plan.early.len() as u64,
        ..Default::default()
    };
    tracing::debug!(target: TARGET, name, ?report, "stream generated");
    Ok((out, report))
}

/// What a fetcher or a decoder hands the writer: decoded frames, or the unique page that
/// failed.
type Decodes = Result<Vec<Decoded>, (u32, StoreError)>;

/// What the fetchers and decoders share while streaming.
struct Stages<'a> {
    store: &'a Store,
    plan: &'a Plan,
    /// The next job to take (reads, then delta jobs).
    next: AtomicUsize,
    /// Set by the writer on a failure: the threads stop taking work.
    stop: AtomicBool,
    /// Decoded pages' buffers, and fetched batches' buffers, for reuse.
    bufs: Buffers,
    batch_bufs: Buffers,
    /// Time fetchers and decoders waited on full queues (the stage after them was behind).
    fetch_blocked: AtomicU64,
    decode_blocked: AtomicU64,
}

impl Stages<'_> {
    /// A fetcher: take jobs until none is left or the writer stops; a read's frames go to the
    /// decoders, a delta job is decoded here.
    fn fetch(&self, tx: &mpsc::SyncSender<Decodes>, ftx: &mpsc::SyncSender<Batch>) {
        let plan = self.plan;
        loop {
            let j = self.next.fetch_add(1, Ordering::Relaxed);
            if j >= plan.jobs.len() + plan.delta_jobs.len() || self.stop.load(Ordering::Relaxed) {
                return;
            }
            let done = match plan.jobs.get(j) {
                Some(job) => {
                    let mut send = |b| timed_send(ftx, b, &self.fetch_blocked);
                    match fetch_job(self.store, plan, j, job, &self.batch_bufs, &mut send) {
                        None => continue,
                        Some(r) => r,
                    }
                }
                None => decode_deltas(self.store, plan, &plan.delta_jobs[j - plan.jobs.len()]),
            };
            let failed = done.is_err();
            if tx.send(done).is_err() || failed {
                return;
            }
        }
    }

    /// A decoder: decode fetched batches until the fetchers are done or the writer stops.
    fn decode(
        &self,
        tx: &mpsc::SyncSender<Decodes>,
        frx: &parking_lot::Mutex<mpsc::Receiver<Batch>>,
    ) {
        loop {
            let got = frx.lock().recv();
            let Ok(batch) = got else { return };
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let r = decode_batch(self.plan, &batch, &self.bufs);
            self.batch_bufs.give(batch.bytes);
            let failed = r.is_err();
            if !timed_send(tx, r, &self.decode_blocked) || failed {
                return;
            }
        }
    }
}

/// Write decoded frames' pages at their first addresses (and, as slots allow, the others:
/// `spread.rs`). Returns the pages written.
fn write_frames<W: Write>(
    w: &mut StreamWriter<W>,
    spread: &mut Spread,
    st: &Stages<'_>,
    frames: Vec<Decoded>,
    bytes_read: &mut u64,
) -> Result<u64, crate::memory::stream::GenerateError> {
    let plan = st.plan;
    let mut put = |(b, p): (u32, u32), page: &[u8; PAGE_SIZE]| {
        w.page(BlockIdx(b), p as u64 * PAGE_SIZE as u64, page)
    };
    let mut n = 0u64;
    for d in frames {
        *bytes_read += d.read;
        for &(o, u) in &d.chunks {
            let page: &[u8; PAGE_SIZE] =
                d.raw[o as usize..o as usize + PAGE_SIZE].try_into().expect("page-sized slice");
            n += spread.page(plan.ref_ranges[u as usize], page, &plan.refs, &mut put)?;
        }
        st.bufs.give(d.raw);
    }
    n += spread.catch_up(&plan.refs, &mut put)?;
    Ok(n)
}

/// Send on a bounded queue, adding the time it was full to `blocked` (nanoseconds); false
/// once the receiver is gone.
fn timed_send<T>(tx: &mpsc::SyncSender<T>, v: T, blocked: &AtomicU64) -> bool {
    match tx.try_send(v) {
        Ok(()) => true,
        Err(mpsc::TrySendError::Disconnected(_)) => false,
        Err(mpsc::TrySendError::Full(v)) => {
            let t = Instant::now();
            let ok = tx.send(v).is_ok();
            blocked.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            ok
        }
    }
}

/// A writer that counts the time spent in its inner writer's calls.
pub(super) struct Timed<W> {
    pub(super) inner: W,
    pub(super) busy: std::time::Duration,
    pub(super) calls: u64,
    /// The longest single call, and when it started (since `new`).
    pub(super) longest: (std::time::Duration, std::time::Duration),
    t0: Instant,
}

impl<W> Timed<W> {
    pub(super) fn new(inner: W) -> Self {
        Timed {
            inner,
            busy: std::time::Duration::ZERO,
            calls: 0,
            longest: Default::default(),
            t0: Instant::now(),
        }
    }
}

impl<W: Write> Write for Timed<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let t = Instant::now();
        let r = self.inner.write(b);
        let took = t.elapsed();
        self.busy += took;
        self.calls += 1;
        if took > self.longest.0 {
            self.longest = (took, t - self.t0);
        }
        r
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let t = Instant::now();
        let r = self.inner.flush();
        self.busy += t.elapsed();
        r
    }
}

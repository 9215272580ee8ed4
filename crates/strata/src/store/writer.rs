//! The pack writer thread, and loading the chunk index at open.
//!
//! Sealed packs are queued (bounded, so fast producers are throttled by the backend) to one
//! thread that `put`s them, [`UPLOADS`] at a time on as many long-lived upload threads. A flush request travels down the same queue,
//! so when the thread reaches it every earlier pack has been put: it then syncs (packs durable), writes each
//! pack's index object, syncs again (indexes durable), marks the packs durable in memory and
//! hands them to the metadata-cache thread. Any failure poisons the store.
//!
//! On a network backend (`Capabilities::network`: an acknowledged put is durable and atomic,
//! `sync` adds nothing) a pack is its own index (`discover.rs`): no index object is written,
//! so a flush only waits for the uploads still running, and a save sends each entry table
//! once, in one request per pack. Every
//! upload is timed ([`UploadMeter`]: bytes over the wall time with at least one upload in
//! flight), which is how a memory save learns the backend's speed from its own packs.
//!
//! The metadata cache (redb) is only a cache of the index objects and pack tails (a store
//! opens without it, reading those instead), so updating it is off the commit path: a low-priority
//! thread applies the rows of durable packs in order, after `flush` has returned. Inserting a
//! save's ~100k chunk rows cost ~0.1 s per 30k rows inside every flush before; now a flush
//! waits only for the data. The thread is joined (and the cache persisted) when the store
//! closes; a crash before that only means the next open reads those index objects.

use super::discover::{self, Source};
use super::meta::Meta;
use super::pack::{index_object_of_pack, IndexObject, PackEntry};
use super::{Index, Loc, PackSlot, Result, Shared, StoreError};
use crate::backend::Backend;
use crate::id::PackId;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

pub enum Job {
    Pack { no: u32, id: PackId, bytes: Arc<Vec<u8>>, entries: Vec<PackEntry> },
    Flush(mpsc::Sender<Result<()>>),
}

pub(crate) struct WriterHandle {
    tx: Mutex<Option<SyncSender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    meta_thread: Mutex<Option<JoinHandle<()>>>,
    sh: Arc<Shared>,
    /// Wall time producers spent waiting for room in the queue (the writer was behind).
    pub(crate) wait_ns: std::sync::atomic::AtomicU64,
}

/// Rows for the metadata cache: pack id, size, entries.
type MetaRows = Vec<(PackId, u64, Vec<PackEntry>)>;

impl WriterHandle {
    pub fn spawn(sh: Arc<Shared>) -> WriterHandle {
        let (tx, rx) = mpsc::sync_channel(2);
        let (meta_tx, meta_rx) = mpsc::channel::<MetaRows>();
        let sh2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name("strata-pack-writer".into())
            .spawn(move || run(sh2, rx, meta_tx))
            .expect("spawn pack writer");
        let sh3 = sh.clone();
        let meta_thread = std::thread::Builder::new()
            .name("strata-meta".into())
            .spawn(move || run_meta(sh3, meta_rx))
            .expect("spawn metadata cache writer");
        WriterHandle {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            meta_thread: Mutex::new(Some(meta_thread)),
            sh,
            wait_ns: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn gone(&self) -> StoreError {
        StoreError::Poisoned { reason: "pack writer stopped".into() }
    }

    pub fn send(&self, job: Job) -> Result<()> {
        let tx = self.tx.lock().clone().ok_or_else(|| self.gone())?;
        let t = std::time::Instant::now();
        let r = tx.send(job).map_err(|_| self.gone());
        self.wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    pub fn flush(&self) -> Result<()> {
        let (rtx, rrx) = mpsc::channel();
        self.send(Job::Flush(rtx))?;
        match rrx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.gone()),
        }
    }
}

impl Drop for WriterHandle {
    fn drop(&mut self) {
        self.tx.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        // The writer's exit closed the metadata channel: wait for the rows still queued.
        if let Some(t) = self.meta_thread.lock().take() {
            let _ = t.join();
        }
        let _ = self.sh.meta.persist();
    }
}

struct Written {
    no: u32,
    id: PackId,
    size: u64,
    entries: Vec<PackEntry>,
    /// Its index object, still to be written; `None` once written (network backends).
    index: Option<Vec<u8>>,
}

/// The index object of a pack we sealed: its trailer copied (already compressed), or, should
/// the pack not parse (it always does), encoded afresh from the entries.
fn index_bytes(id: PackId, pack: &[u8], entries: &[PackEntry]) -> Vec<u8> {
    index_object_of_pack(pack).unwrap_or_else(|e| {
        tracing::warn!(target: "strata::store", pack = %id, error = %e, "sealed pack does not parse; index object re-encoded");
        IndexObject { pack: id, pack_size: pack.len() as u64, entries: entries.to_vec() }.encode()
    })
}

/// Sealed packs not yet uploaded, and how fast uploads go.
#[derive(Debug, Default)]
pub struct UploadMeter {
    inner: Mutex<MeterState>,
}

#[derive(Debug, Default)]
struct MeterState {
    /// Sealed, not yet uploaded (queued or in flight).
    pending: usize,
    /// Their bytes (counted from when their trailer is encoded).
    pending_bytes: u64,
    inflight: usize,
    busy_since: Option<std::time::Instant>,
    busy: std::time::Duration,
    bytes: u64,
}

impl UploadMeter {
    pub(crate) fn sealed(&self) {
        self.inner.lock().pending += 1;
    }
    /// Sealed packs waiting or uploading.
    pub(crate) fn pending(&self) -> usize {
        self.inner.lock().pending
    }
    /// A sealed pack of `bytes` (trailer included) is on its way to the writer.
    pub(crate) fn queued(&self, bytes: u64) {
        self.inner.lock().pending_bytes += bytes;
    }
    /// Bytes of sealed packs waiting or uploading.
    pub(crate) fn pending_bytes(&self) -> u64 {
        self.inner.lock().pending_bytes
    }
    /// A sealed pack of `size` bytes that will not be uploaded (store poisoned).
    fn dropped(&self, size: u64) {
        let mut m = self.inner.lock();
        m.pending = m.pending.saturating_sub(1);
        m.pending_bytes = m.pending_bytes.saturating_sub(size);
    }
    fn start(&self) {
        let mut m = self.inner.lock();
        if m.inflight == 0 {
            m.busy_since = Some(std::time::Instant::now());
        }
        m.inflight += 1;
    }
    fn end(&self, size: u64, ok: bool) {
        let mut m = self.inner.lock();
        m.inflight = m.inflight.saturating_sub(1);
        m.pending = m.pending.saturating_sub(1);
        m.pending_bytes = m.pending_bytes.saturating_sub(size);
        if ok {
            m.bytes += size;
        }
        if m.inflight == 0 {
            if let Some(t) = m.busy_since.take() {
                m.busy += t.elapsed();
            }
        }
    }
    /// Bytes uploaded and the wall time uploads were running (including any running now).
    pub fn measured(&self) -> (u64, std::time::Duration) {
        let m = self.inner.lock();
        (m.bytes, m.busy + m.busy_since.map(|t| t.elapsed()).unwrap_or_default())
    }
}

/// Pack uploads in flight at once. Several keep a network link busy while requests are being
/// set up or finished by the server (a serial writer idles the link between PUTs; with two, a
/// 2 GiB save to S3 over 1 Gbit/s moved only ~60 MB/s), and cost little on a local disk.
pub(crate) const UPLOADS: usize = 4;
/// Index objects written at once by a flush (small objects: latency-bound on a remote backend).
pub(crate) const INDEX_PUTS: usize = 8;

type PutResult = std::result::Result<Written, crate::backend::BackendError>;
type PutJob = Box<dyn FnOnce() -> PutResult + Send>;

/// One upload running on an [`Uploaders`] thread; its outcome (or its panic) comes back here.
struct Upload {
    rx: Receiver<std::thread::Result<PutResult>>,
    got: Option<std::thread::Result<PutResult>>,
}

impl Upload {
    fn is_finished(&mut self) -> bool {
        if self.got.is_none() {
            self.got = self.rx.try_recv().ok();
        }
        self.got.is_some()
    }

    /// Wait for the outcome; a thread that vanished counts as a panic.
    fn join(self) -> std::thread::Result<PutResult> {
        match self.got {
            Some(r) => r,
            None => self.rx.recv().unwrap_or_else(|_| Err(Box::new("upload thread gone"))),
        }
    }
}

/// [`UPLOADS`] long-lived upload threads, started with the first pack. A thread spawned per
/// upload starts late on a busy 2-core host: a new thread waits behind the running ones (the
/// scheduler's start debit), while a sleeping one is woken ahead of them, so a save's first
/// uploads would go out 1-2 ms after their packs are sealed, with the link idle (debug trace
/// of a 128 MiB save to S3).
struct Uploaders {
    tx: Option<mpsc::Sender<(PutJob, SyncSender<std::thread::Result<PutResult>>)>>,
    threads: Vec<JoinHandle<()>>,
}

impl Uploaders {
    fn new() -> Uploaders {
        Uploaders { tx: None, threads: Vec::new() }
    }

    fn submit(&mut self, job: PutJob) -> std::io::Result<Upload> {
        if self.tx.is_none() {
            let (tx, rx) = mpsc::channel::<(PutJob, SyncSender<std::thread::Result<PutResult>>)>();
            let rx = Arc::new(Mutex::new(rx));
            for _ in 0..UPLOADS {
                let rx = rx.clone();
                self.threads.push(
                    std::thread::Builder::new().name("strata-pack-put".into()).spawn(
                        move || loop {
                            let next = rx.lock().recv();
                            let Ok((job, done)) = next else { return };
                            let _ = done
                                .send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)));
                        },
                    )?,
                );
            }
            self.tx = Some(tx);
        }
        let (done, rx) = mpsc::sync_channel(1);
        self.tx
            .as_ref()
            .expect("started above")
            .send((job, done))
            .map_err(|_| std::io::Error::other("upload threads gone"))?;
        Ok(Upload { rx, got: None })
    }
}

impl Drop for Uploaders {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Wait for the oldest upload; record it, or poison the store.
fn reap(
    sh: &Shared,
    inflight: &mut std::collections::VecDeque<Upload>,
    written: &mut Vec<Written>,
) {
    if let Some(h) = inflight.pop_front() {
        match h.join() {
            Ok(Ok(w)) => {
                sh.stats.packs_written.fetch_add(1, Ordering::Relaxed);
                // The put is done, so the pack is readable from the backend: reads go there,
                // and the buffer serves the next open pack at once instead of fresh memory
                // (~250 page faults per MiB; without reuse a disk fold of 1 GiB fills ~30 fresh
                // 32 MiB buffers and holds them all until its flush). An acknowledged network
                // put is also durable now; a local pack becomes durable at the next flush
                // (its directory entry is synced there).
                let mut idx = sh.index.write();
                if let Some(Some(slot)) = idx.packs.get_mut(w.no as usize) {
                    if w.index.is_none() {
                        slot.durable = true;
                    }
                    if let Some(bytes) = slot.mem.take() {
                        drop(idx);
                        sh.recycle_pack(bytes);
                    }
                }
                written.push(w);
            }
            Ok(Err(e)) => sh.poison(&e),
            Err(_) => sh.poison(&crate::backend::BackendError::with_source(
                crate::backend::ErrorKind::Other,
                "put",
                "packs/",
                std::io::Error::other("pack upload thread panicked"),
            )),
        }
    }
}

/// Apply metadata-cache rows in order, at low CPU priority (it only speeds up the next open).
fn run_meta(sh: Arc<Shared>, rx: Receiver<MetaRows>) {
    // SAFETY: plain syscalls on the calling thread; failure only leaves the priority as is.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
    for rows in rx {
        let refs: Vec<(PackId, u64, &[PackEntry])> =
            rows.iter().map(|(p, s, e)| (*p, *s, &e[..])).collect();
        if let Err(e) = sh.meta.add_packs(&refs, false) {
            tracing::warn!(target: "strata::store", error = %e, "metadata cache update failed; it will be rebuilt");
        }
    }
}

fn run(sh: Arc<Shared>, rx: Receiver<Job>, meta: mpsc::Sender<MetaRows>) {
    let mut written: Vec<Written> = Vec::new();
    let mut inflight: std::collections::VecDeque<Upload> = std::collections::VecDeque::new();
    let mut uploaders = Uploaders::new();
    for job in rx {
        match job {
            Job::Pack { no, id, bytes, entries } => {
                if sh.poison.lock().is_some() {
                    sh.uploads.dropped(bytes.len() as u64);
                    continue;
                }
                // Uploads already done are reaped first (in order), so their buffers are back
                // for the next open packs; then wait for room.
                while inflight.front_mut().is_some_and(|h| h.is_finished())
                    || inflight.len() >= UPLOADS
                {
                    reap(&sh, &mut inflight, &mut written);
                }
                let sh2 = sh.clone();
                let network = sh.backend.capabilities().network;
                let size = bytes.len() as u64;
                let spawned = uploaders.submit(Box::new(move || {
                    sh2.uploads.start();
                    let t0 = std::time::Instant::now();
                    let r = sh2.backend.put_shared(&id.pack_key(), &bytes);
                    sh2.uploads.end(size, r.is_ok());
                    r?;
                    // Acknowledged on a network backend: durable, whole, and its own index.
                    if network {
                        tracing::debug!(target: "strata::store", size, put_ms = t0.elapsed().as_secs_f64() * 1e3, "pack uploaded");
                        return Ok(Written { no, id, size, entries, index: None });
                    }
                    let index = index_bytes(id, &bytes, &entries);
                    drop(bytes);
                    Ok(Written { no, id, size, entries, index: Some(index) })
                }));
                match spawned {
                    Ok(h) => inflight.push_back(h),
                    Err(e) => {
                        sh.uploads.dropped(size);
                        sh.poison(&crate::backend::BackendError::from_io("put", id.pack_key(), e))
                    }
                }
            }
            Job::Flush(reply) => {
                while !inflight.is_empty() {
                    reap(&sh, &mut inflight, &mut written);
                }
                let _ = reply.send(commit(&sh, &mut written, &meta));
            }
        }
    }
    while !inflight.is_empty() {
        reap(&sh, &mut inflight, &mut written);
    }
}

/// Make the written packs durable, then their index objects.
fn commit(sh: &Shared, written: &mut Vec<Written>, meta: &mpsc::Sender<MetaRows>) -> Result<()> {
    sh.check_poison()?;
    if written.is_empty() {
        return Ok(());
    }
    sh.sync()?;
    // Index objects are independent: put them concurrently (a flush after a large save has
    // one per pack, and each is a round trip on a remote backend).
    let todo: Vec<(PackId, &[u8])> =
        written.iter().filter_map(|w| Some((w.id, w.index.as_deref()?))).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed: Mutex<Option<crate::backend::BackendError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..INDEX_PUTS.min(todo.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(id, index)) = todo.get(i) else { return };
                if failed.lock().is_some() {
                    return;
                }
                if let Err(e) = sh.backend.put(&id.index_key(), index) {
                    failed.lock().get_or_insert(e);
                    return;
                }
            });
        }
    });
    if let Some(e) = failed.into_inner() {
        sh.poison(&e);
        return Err(StoreError::Backend(e));
    }
    if !todo.is_empty() {
        sh.sync()?;
    }
    {
        let mut idx = sh.index.write();
        for w in written.iter() {
            if let Some(Some(slot)) = idx.packs.get_mut(w.no as usize) {
                slot.durable = true;
                if let Some(bytes) = slot.mem.take() {
                    sh.recycle_pack(bytes);
                }
            }
        }
    }
    let rows: MetaRows = written.drain(..).map(|w| (w.id, w.size, w.entries)).collect();
    let _ = meta.send(rows);
    Ok(())
}

/// Build the in-memory index from the metadata cache, reconciled with the packs the backend
/// makes visible (`discover.rs`: index objects, and on a network backend the packs
/// themselves), which are the source of truth.
pub(crate) fn load_index(backend: &dyn Backend, meta: &Meta) -> Result<Index> {
    let visible = discover::list_packs(backend)?;
    let listed: HashSet<PackId> = visible.keys().copied().collect();
    let cached: HashMap<PackId, u64> = meta.packs()?.into_iter().collect();
    let todo: Vec<(PackId, Source)> =
        visible.iter().filter(|(p, _)| !cached.contains_key(p)).map(|(p, s)| (*p, *s)).collect();
    let mut fresh = Vec::new();
    for ((pid, source), r) in todo.iter().zip(discover::read_many(backend, &todo)) {
        let key = match source {
            Source::Index => pid.index_key(),
            Source::Tail { .. } => pid.pack_key(),
        };
        match r {
            Ok(o) => fresh.push(o),
            Err(e) => {
                tracing::warn!(target: "strata::store", key, error = %e, "unreadable pack index ignored (run `strata check`)")
            }
        }
    }
    if !fresh.is_empty() {
        let rows: Vec<(PackId, u64, &[PackEntry])> =
            fresh.iter().map(|o| (o.pack, o.pack_size, &o.entries[..])).collect();
        meta.add_packs(&rows, true)?;
    }
    let mut idx = Index::default();
    for (pid, size) in cached.iter().filter(|(p, _)| listed.contains(p)) {
        idx.add_slot(PackSlot { id: *pid, size: *size, mem: None, durable: true });
    }
    for o in &fresh {
        idx.add_slot(PackSlot { id: o.pack, size: o.pack_size, mem: None, durable: true });
    }
    let mut stale: HashMap<PackId, Vec<crate::id::ChunkId>> = HashMap::new();
    meta.for_each_chunk(|pid, e| match idx.by_id.get(&pid) {
        Some(&no) => {
            idx.chunks.insert(e.id, Loc { pack: no, entry: e });
        }
        None => stale.entry(pid).or_default().push(e.id),
    })?;
    for pid in cached.keys().filter(|p| !listed.contains(p)) {
        stale.entry(*pid).or_default();
    }
    if !stale.is_empty() {
        let rows: Vec<(PackId, Vec<crate::id::ChunkId>)> = stale.into_iter().collect();
        meta.remove_packs(&rows, true)?;
    }
    Ok(idx)
}

/// Load the packs other hosts wrote since this instance opened (the store is shared:
/// `docs/backends.md`). Only adds; packs never vanish while we are open, because GC needs the
/// store to itself. Returns how many packs were new.
pub(crate) fn refresh_index(sh: &Shared) -> Result<usize> {
    let visible = discover::list_packs(&*sh.backend)?;
    let unknown: Vec<(PackId, Source)> = {
        let idx = sh.index.read();
        visible.into_iter().filter(|(p, _)| !idx.by_id.contains_key(p)).collect()
    };
    let mut fresh = Vec::new();
    for ((pid, _), r) in unknown.iter().zip(discover::read_many(&*sh.backend, &unknown)) {
        match r {
            Ok(o) => fresh.push(o),
            // Our own writer may be renaming it right now; it is ours then, and known.
            Err(StoreError::Backend(e)) if e.is_not_found() => {}
            Err(StoreError::Backend(e)) => return Err(e.into()),
            Err(e) => {
                tracing::warn!(target: "strata::store", pack = %pid, error = %e, "unreadable pack index ignored (run `strata check`)")
            }
        }
    }
    if fresh.is_empty() {
        return Ok(0);
    }
    let rows: Vec<(PackId, u64, &[PackEntry])> =
        fresh.iter().map(|o| (o.pack, o.pack_size, &o.entries[..])).collect();
    sh.meta.add_packs(&rows, false)?;
    let mut idx = sh.index.write();
    let mut n = 0;
    for o in &fresh {
        if idx.by_id.contains_key(&o.pack) {
            continue;
        }
        let no = idx.add_slot(PackSlot { id: o.pack, size: o.pack_size, mem: None, durable: true });
        for e in &o.entries {
            idx.chunks.entry(e.id).or_insert(Loc { pack: no, entry: *e });
        }
        n += 1;
    }
    tracing::debug!(target: "strata::store", packs = n, "index refreshed from the backend");
    Ok(n)
}

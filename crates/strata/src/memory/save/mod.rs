//! `vm save` and `vm checkpoint`: drive a running QEMU over QMP to migrate into a unix socket
//! strata listens on, store what arrives, and commit the checkpoint ref last.
//!
//! The sequence, and why each step is there:
//! 1. Refuse early, before the guest is touched: a bad or taken name, a migration already
//!    running, or capabilities strata cannot store (xbzrle, compress, postcopy, block, ...:
//!    `qmp::caps` names each with the fix). The queries go out first, in one write. The
//!    name's lease is taken from the moment `migrate` is answered and waited for only at
//!    step 5 (a save losing it to another host fails there, nothing visible).
//! 2. A starting Speed_Transfer for the codec choice (`codec_choice`: a speed this host
//!    remembered for the backend, 1 Gbit/s on a network backend, or a probe of a local disk;
//!    the save's own pack uploads then measure it), and remember QEMU's `max-bandwidth` and
//!    `background-snapshot` settings
//!    to put them back afterwards: strata raises the bandwidth (QEMU 7.2 throttles to
//!    128 MiB/s by default) and sets the capability the mode needs.
//! 3. Listen on a fresh unix socket, send the settings, `stop` (a save) and `migrate
//!    unix:PATH` in one write, and run the receive pipeline
//!    (`ingest`) on a thread while this thread polls `query-migrate`. Whichever side fails
//!    first stops the other: a failed/cancelled migration or a dead QEMU shuts the socket
//!    down; a pipeline failure (store full, refused stream) cancels the migration.
//! 4. Modes: `Save` stops the VM first and leaves it paused (like `virsh save`);
//!    `BackgroundSnapshot` lets QEMU pause for milliseconds at the start and keeps running;
//!    `Precopy` migrates live, then `cont`s the source (paused at switchover).
//! 5. Only after the stream ended correctly and every page is in the store: page maps, tail,
//!    manifest, then `commit_ref` (flush, then the ref). Any failure before that leaves no
//!    ref; what was put is garbage for GC. If a save fails, a VM that was running is resumed.
#![allow(clippy::result_large_err)] // a MemError is returned once per save or restore

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

use super::codec_choice::{
    metered_speed, probe_backend, remember_speed, remembered_speed, usable_cores, Chooser,
    CodecPolicy, Model, CANDIDATES, DEFAULT_NETWORK_BPS, NETWORK_START, PROBE_BYTES,
    SAVE_NETWORK_START,
};
use super::delta::{select_base, BasePolicy};
use super::error::MemError;
use super::ingest::{ingest, IngestError, IngestOptions, Ingested};
use super::manifest::{
    ref_name, tail_tree, valid_name, BlockMeta, Checkpoint, CodecReport, DeltaMeta, Manifest, Mode,
    QemuInfo, SaveStats, SlotTable, StreamMeta, TailMeta, FORMAT, REF_PREFIX, TAIL_CHUNK, VERSION,
    VERSION_NO_RUNS, VERSION_RUNS,
};
use crate::codec::Codec;
use crate::id::ChunkId;
use crate::progress::{Progress, Unit};
use crate::qmp::{
    machine_type_request, set_capabilities_request, CapabilityPolicy, MigrateParameters, QmpClient,
    QmpError, QmpEvent, Request,
};
use crate::store::map::{write_map_payloads, LEAF_IDS};
use crate::store::pack::ChunkKind;
use crate::store::{Session, Store};

const TARGET: &str = "strata::memory";

mod counts;
mod listing;
mod migrate;
#[cfg(test)]
mod tests;

use counts::count_pages;
use migrate::run;

/// How to save.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    pub mode: Mode,
    pub codec: CodecPolicy,
    pub ingest: IngestOptions,
    /// `max-bandwidth` while saving, bytes/s.
    pub max_bandwidth: u64,
    /// How long QEMU may take to connect to the socket.
    pub connect_timeout: Duration,
    /// Where the migration socket is created (default: the system temp dir).
    pub socket_dir: Option<PathBuf>,
    /// Replace an existing checkpoint of the same name.
    pub replace: bool,
    /// Base checkpoint for delta pages (default: automatic).
    pub base: BasePolicy,
}

impl SaveOptions {
    pub fn new(mode: Mode) -> SaveOptions {
        SaveOptions {
            mode,
            codec: CodecPolicy::Auto,
            ingest: IngestOptions::default(),
            max_bandwidth: 64 << 30,
            connect_timeout: Duration::from_secs(30),
            socket_dir: None,
            replace: false,
            base: BasePolicy::Auto,
        }
    }
}

/// Summary of one save, for `--json` and benchmarks.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SaveReport {
    pub name: String,
    pub mode: Mode,
    /// QEMU's run state afterwards (`paused`/`postmigrate` for save, `running` for checkpoints).
    pub vm_status: String,
    /// QEMU's downtime figure (ms); for `save` the time the VM was stopped while saving.
    pub downtime_ms: f64,
    /// Pause seen in QMP events, STOP to RESUME (ms), for the live modes.
    pub pause_ms: Option<f64>,
    /// First QMP command to durable ref.
    pub total_ms: f64,
    /// `migrate` to QEMU's `completed`.
    pub migrate_ms: f64,
    /// Maps, tail, flush and ref after the stream ended.
    pub commit_ms: f64,
    pub logical_bytes: u64,
    pub stream_bytes: u64,
    pub new_bytes: u64,
    /// Bytes of the frames this save added to the store (compressed pages, page maps, tail);
    /// the packs' entry tables, headers and footers (~1.5% more for a memory save) and the
    /// ref are not counted.
    pub stored_bytes: u64,
    /// Bytes of non-zero pages / raw bytes new to the store.
    pub dedup_ratio: f64,
    /// Raw new bytes / stored bytes.
    pub compression_ratio: f64,
    /// Guest RAM / stored bytes.
    pub reduction: f64,
    pub pages_sent: u64,
    pub pages_stored: u64,
    pub pages_deduped: u64,
    pub zero_pages: u64,
    pub unique_pages: u64,
    pub codec: CodecReport,
    /// Base checkpoint and delta pages (absent without a base).
    pub delta: Option<DeltaMeta>,
    /// What computing the deltas read from the store (absent without a base).
    pub delta_reads: Option<super::delta::DeltaReads>,
    /// The save's table of pages inside its runs (`ingest/run_table.rs`): absent unless
    /// compressible runs were on (stop-and-copy to a network backend).
    pub run_table: Option<super::ingest::RunTableStats>,
    /// Where the time went.
    pub stages: SaveStages,
}

/// Wall time of each step of a save, ms (they add up to about `total_ms`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SaveStages {
    /// Name check, QMP queries, capability check, backend probe, QEMU settings.
    pub setup_ms: f64,
    /// `migrate` until the stream ended and every page was stored (= `migrate_ms`).
    pub stream_ms: f64,
    /// Of `stream_ms`: from the stream's last byte until the pool had stored every page.
    pub drain_ms: f64,
    /// CPU time of the parse thread and of the pool during the stream.
    pub parse_cpu_ms: f64,
    pub pool_cpu_ms: f64,
    /// Where the receive pipeline waited during the stream (wall ms, summed over threads).
    pub waits: super::ingest::IngestWaits,
    /// Page maps and tail chunks.
    pub maps_ms: f64,
    /// Final flush of packs and index objects, then the ref (`commit_ref`).
    pub commit_ref_ms: f64,
}

/// Resumes the guest when dropped armed (a save that failed after pausing it).
struct ResumeOnError<'a> {
    qmp: &'a mut QmpClient,
    armed: bool,
}

impl Drop for ResumeOnError<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Ok(s) = self.qmp.query_status() {
                if !s.running && s.status != "shutdown" {
                    let _ = self.qmp.cont();
                }
            }
        }
    }
}

type LeaseResult = Result<Option<crate::store::lease::LeaseGuard>, crate::store::StoreError>;

/// The save's lease, being taken on a helper thread. Dropped on any path (a failed save), it
/// waits for the attempt, so a lease it won is released before `save` returns and a retry
/// right after does not find it held.
struct PendingLease(Option<std::thread::JoinHandle<LeaseResult>>);

impl PendingLease {
    /// The lease (None: the store needs none); `Err(None)` if the helper panicked.
    fn wait(
        &mut self,
    ) -> Result<Option<crate::store::lease::LeaseGuard>, Option<crate::store::StoreError>> {
        match self.0.take().map(|h| h.join()) {
            Some(Ok(r)) => r.map_err(Some),
            Some(Err(_)) | None => Err(None),
        }
    }
}

impl Drop for PendingLease {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

/// Take the checkpoint's lease on a helper thread, at low CPU priority: it is needed only at
/// the commit. None if the thread cannot start (the commit then fails, nothing visible).
fn take_lease(store: &Store, rname: &str) -> Option<std::thread::JoinHandle<LeaseResult>> {
    let (store, rname) = (store.clone(), rname.to_string());
    std::thread::Builder::new()
        .name("strata-save-lease".into())
        .spawn(move || {
            // SAFETY: a plain syscall on the calling thread; failure leaves the priority.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, 10);
            }
            let t = Instant::now();
            let lease = store.lease_if_needed(&rname);
            tracing::debug!(target: TARGET, lease_ms = t.elapsed().as_secs_f64() * 1e3, "save: lease taken");
            lease
        })
        .ok()
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Settings changed for the save, put back afterwards.
struct Restorer {
    max_bandwidth: Option<u64>,
    background_snapshot: Option<bool>,
}

impl Restorer {
    /// Put the settings back, in one round trip, with a `query-status` read ahead for the
    /// caller's next step.
    fn put_back(&self, qmp: &mut QmpClient) {
        let set = self
            .max_bandwidth
            .map(|bw| MigrateParameters { max_bandwidth: Some(bw), ..Default::default() });
        let mut reqs: Vec<Request> = Vec::new();
        if let Some(r) = set.as_ref().and_then(|p| p.request().ok()) {
            reqs.push(r);
        }
        if let Some(state) = self.background_snapshot {
            reqs.push(set_capabilities_request(&[("background-snapshot", state)]));
        }
        reqs.push(("query-status", None));
        // A transport failure shows again at the next command.
        let _ = qmp.pipeline(&reqs);
        if let Some(bw) = self.max_bandwidth {
            let _ = qmp.migrate_set_parameters(&MigrateParameters {
                max_bandwidth: Some(bw),
                ..Default::default()
            });
        }
        if let Some(state) = self.background_snapshot {
            let _ = qmp.migrate_set_capabilities(&[("background-snapshot", state)]);
        }
    }
}

const ACTIVE: [&str; 9] = [
    "setup",
    "active",
    "pre-switchover",
    "device",
    "postcopy-active",
    "postcopy-paused",
    "postcopy-recover",
    "cancelling",
    "wait-unplug",
];

/// Save the VM behind `qmp` as checkpoint `name` in `store`.
pub fn save(
    store: &Store,
    qmp: &mut QmpClient,
    name: &str,
    opts: &SaveOptions,
    progress: &dyn Progress,
) -> Result<SaveReport, MemError> {
    let r = save_inner(store, qmp, name, opts, progress);
    // Replies read ahead for a step an error skipped must not answer the caller's next query.
    qmp.discard_pipelined();
    r
}

fn save_inner(
    store: &Store,
    qmp: &mut QmpClient,
    name: &str,
    opts: &SaveOptions,
    progress: &dyn Progress,
) -> Result<SaveReport, MemError> {
    let t0 = Instant::now();
    if !valid_name(name) {
        return Err(MemError::BadName { name: name.into() });
    }
    let rname = ref_name(name);
    // 1. The source's queries go out first, in one write, so QEMU answers them while the
    // helpers below start and the backend round trips run; the replies are read where they
    // are checked (session 35: sent after the helpers started, the replies came 2-5.6 ms
    // after t0 on the 2-core bench host).
    let sent = qmp.send_pipeline(&[
        ("query-migrate", None),
        ("query-migrate-capabilities", None),
        ("query-status", None),
        machine_type_request(),
        ("query-migrate-parameters", None),
    ]);
    // The pool's zstd contexts are warmed (their workspaces allocated and page-faulted) on a
    // helper thread while the QMP set-up below goes back and forth, not on the first frames.
    let levels: Vec<i32> = match opts.codec {
        CodecPolicy::Auto => CANDIDATES
            .iter()
            .filter_map(|c| if let Codec::Zstd(l) = *c { Some(l) } else { None })
            .collect(),
        CodecPolicy::Fixed(Codec::Zstd(l)) => vec![l],
        CodecPolicy::Fixed(_) => vec![],
    };
    if !levels.is_empty() {
        let per_level = opts.ingest.workers.max(1);
        let _ = std::thread::Builder::new().name("strata-zstd-warm".into()).spawn(move || {
            // Below the set-up's own threads and QEMU, which answer the queries on the
            // critical path; the host has idle CPU while those round trips go on.
            // SAFETY: a plain syscall on the calling thread; failure leaves the priority.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, 10);
            }
            crate::codec::prewarm_zstd(&levels, per_level)
        });
    }
    // One writer per checkpoint name, across hosts (docs/backends.md). The listing (is the
    // name taken, could any checkpoint be a delta base) is a backend round trip run beside the
    // read-only QMP queries, and waited for before QEMU is changed only when its answer can
    // change the save (`listing.rs`); otherwise it is checked during the stream and before the
    // commit. The lease is waited for
    // only before the commit, since the pages a save stores are invisible until its ref is
    // written and the commit takes the name under the lease anyway: a save whose lease is
    // held elsewhere fails there, with nothing visible (session 29: the lease took 3.8-5.8 ms,
    // the QMP queries 2.7-4.2, and the save waited for the difference). Its thread starts once
    // `migrate` has been answered (`run`'s `on_migrating`, session 35): on a 2-core host its
    // requests, and the server's work on them, slowed QEMU's answers to the set-up queries,
    // which are the save's critical path, while the commit is far off.
    let mut lease = PendingLease(None);
    let mut listing = listing::Listing::start(store, &rname, name, opts.replace)?;
    let path = qmp.path().to_path_buf();
    let q = |op| MemError::qmp(op, &path);
    // Step 2's prior: remembered, assumed (network) or probed (local disk, while the QMP
    // queries below go back and forth).
    let location = store.location().to_string();
    let remembered = remembered_speed(store.local_dir(), &location);
    let network = store.backend().capabilities().network;
    let probe = (opts.codec == CodecPolicy::Auto && remembered.is_none() && !network).then(|| {
        let backend = store.backend().clone();
        std::thread::spawn(move || probe_backend(&*backend, PROBE_BYTES))
    });

    // 1. The source, and what it would send (the replies to the queries sent above).
    let source = (|| {
        sent.map_err(q("query-migrate"))?;
        let mig = qmp.query_migrate().map_err(q("query-migrate"))?;
        if ACTIVE.contains(&mig.status.as_str()) {
            return Err(MemError::Busy { path: path.clone(), status: mig.status });
        }
        // One query serves the check and the restore of the settings at the end.
        let caps = qmp.query_migrate_capabilities().map_err(q("capability check"))?;
        crate::qmp::check_capabilities_with(&caps, &CapabilityPolicy::default())
            .map_err(|e| q("capability check")(e.into()))?;
        let status = qmp.query_status().map_err(q("query-status"))?;
        let machine = qmp.machine_type().map_err(q("query-machines"))?;
        let params = qmp.query_migrate_parameters().map_err(q("query-migrate-parameters"))?;
        let version = qmp.version().clone();
        let local = qmp.peer_pid().is_ok();
        let cmdline = qmp.peer_cmdline().unwrap_or_else(|e| {
            tracing::warn!(target: TARGET, error = %e, "QEMU's command line is unknown; `vm restore --launch` will not work for this checkpoint");
            Vec::new()
        });
        Ok((status, machine, version, local, cmdline, caps, params))
    })();
    let qmp_ms = t0.elapsed().as_secs_f64() * 1e3;
    // None: the answer is late and not needed yet (no checkpoint this host knows of).
    let any_checkpoint = listing.before_migrate(store, &opts.base)?.unwrap_or(false);
    tracing::debug!(target: TARGET, qmp_ms, joined_ms = t0.elapsed().as_secs_f64() * 1e3, "save: source queried");
    let (status, machine, version, local, cmdline, caps, params) = source?;
    // The delta base: the newest checkpoint with this machine type and RAM layout.
    let base = match &opts.base {
        BasePolicy::Off => None,
        BasePolicy::Auto if !any_checkpoint => None,
        policy => match qmp.ram_blocks() {
            Ok(ram) => {
                let ram: Vec<(String, u64)> = ram.into_iter().map(|b| (b.name, b.used)).collect();
                select_base(store, policy, name, &machine, &ram)?
            }
            Err(e) => {
                tracing::warn!(target: TARGET, error = %e, "ramblocks unknown; saving without delta pages");
                None
            }
        },
    };
    if let Some(b) = &base {
        progress.note(&format!("delta base: checkpoint '{}'", b.name));
    }
    let mut with_base = opts.clone();
    with_base.ingest.base = base.map(std::sync::Arc::new);
    if opts.mode == Mode::Save {
        with_base.ingest.queue_bytes =
            with_base.ingest.queue_bytes.min(super::ingest::SAVE_QUEUE_BYTES);
        // Only where the caller kept the default: tests and benches may pin a frame size.
        if network && with_base.ingest.frame_pages == super::ingest::FRAME_PAGES {
            with_base.ingest.frame_pages = super::ingest::SAVE_NETWORK_FRAME_PAGES;
            with_base.ingest.compressible_runs = with_base.ingest.runs;
        }
    }
    let opts = &with_base;

    // 2. Codec inputs and QEMU settings.
    let workers = opts.ingest.workers.max(1);
    let (backend_bps, prior_from) = match (probe, remembered) {
        (Some(probe), _) => {
            let bps = probe
                .join()
                .map_err(|_| MemError::Panic { what: "backend probe" })?
                .map_err(|e| MemError::Store {
                    op: "backend probe",
                    name: name.into(),
                    source: e.into(),
                })?;
            progress.note(&format!(
                "backend writes {:.0} MB/s (put + sync of {} MiB)",
                bps / 1e6,
                PROBE_BYTES >> 20
            ));
            (bps, "probe".to_string())
        }
        (None, Some((bps, age))) => (bps, format!("remembered from a save {age} s ago")),
        (None, None) => (DEFAULT_NETWORK_BPS, "assumed 1 Gbit/s".to_string()),
    };
    // The store's meter counts every upload of this instance; the save's share starts now.
    let (b0, t0_busy) = store.upload_speed();
    let meter_store = store.clone();
    let meter = Box::new(move || {
        let (b, t) = meter_store.upload_speed();
        metered_speed(b - b0, t.saturating_sub(t0_busy))
    });
    // Uploads to a network backend overlap compression (docs/memory.md, "Adaptive compression").
    let model = if network { Model::Overlapped } else { Model::Serial };
    // A stop-and-copy save to a network backend compresses on every core: the guest is
    // stopped, and QEMU's migration thread blocks on the bounded queue whenever the pool
    // falls behind, so it holds no core of its own; the uploads wait on the link. Counting one
    // core there made zstd:1 look CPU-bound on a dip of its samples and handed 128 MiB saves
    // to lz4, which was slower both ways in every forced run (docs/memory.md). A live
    // checkpoint's guest keeps running, so it keeps `usable_cores`.
    let cores =
        if network && opts.mode == Mode::Save { workers } else { usable_cores(local).min(workers) };
    let chooser = Chooser::new(opts.codec, backend_bps, cores)
        .with_meter(meter, &prior_from)
        .with_model(model);
    let chooser = if network {
        let backlog_store = store.clone();
        let chooser = if opts.mode == Mode::Save {
            chooser.with_start(SAVE_NETWORK_START).without_warmup()
        } else {
            chooser.with_start(NETWORK_START)
        };
        chooser.with_backlog(Box::new(move || backlog_store.unsent_bytes()))
    } else {
        chooser
    };
    let want_bg = opts.mode == Mode::BackgroundSnapshot;
    let bg_state = caps.iter().find(|c| c.capability == "background-snapshot").map(|c| c.state);
    // Only what the save changes is put back afterwards, and the capability is set only when
    // it is not already as the mode needs (one QMP command less on the way to `migrate`).
    let restorer = Restorer {
        max_bandwidth: params.get("max-bandwidth").and_then(Value::as_u64),
        background_snapshot: bg_state.filter(|&s| s != want_bg),
    };
    if bg_state.is_none() && want_bg {
        return Err(MemError::SourceFailed {
            name: name.into(),
            status: "setup".into(),
            desc: format!("QEMU {version} has no background-snapshot capability; use --precopy"),
        });
    }
    let result = (|| {
        let set =
            MigrateParameters { max_bandwidth: Some(opts.max_bandwidth), ..Default::default() };
        let mut settings: Vec<Request> =
            vec![set.request().map_err(q("migrate-set-parameters"))?];
        if restorer.background_snapshot.is_some() {
            settings.push(set_capabilities_request(&[("background-snapshot", want_bg)]));
        }
        // The settings go out in one write with `stop` and `migrate` (`run`).
        let mut on_migrating = || lease.0 = take_lease(store, &rname);
        let mut check = || listing.poll();
        run(
            store,
            qmp,
            name,
            opts,
            &chooser,
            status.running,
            &settings,
            &mut on_migrating,
            &mut check,
            progress,
            t0,
        )
    })();
    restorer.put_back(qmp);
    // A failed save must not leave a running desktop paused: from here until the ref is
    // committed, an error resumes the guest (a stream cut, or a commit refused: store full,
    // the name's lease held by another host).
    let mut resume = ResumeOnError { qmp, armed: status.running };
    let (ingested, timing) = result?;
    listing.finish()?;
    let vm_status =
        resume.qmp.query_status().map(|s| s.status).unwrap_or_else(|_| "unknown".into());

    // 5. Maps, tail, manifest, ref.
    let t_commit = Instant::now();
    progress.phase("committing", None, Unit::Items);
    let ses = &timing.session;
    let layout = &ingested.info.layout;
    if let Some((bi, &(missing, first))) =
        ingested.missing.iter().enumerate().find(|(_, m)| m.0 > 0)
    {
        return Err(MemError::Incomplete {
            name: name.into(),
            block: layout.blocks[bi].name.clone(),
            offset: first * 4096,
            missing,
        });
    }
    let t_maps = Instant::now();
    // The page maps and the device-state tail are written on two helper threads while this
    // one counts pages; all three are CPU work on a host whose link is still busy with the
    // last data packs, so they overlap instead of adding up (session 29: 4-8 ms in series).
    let mut kept: Vec<(ChunkId, Vec<u8>)> = Vec::new();
    let keeping = store.tree_cache().is_some();
    let tail = &ingested.info.tail;
    let (map_roots, tail_root, blocks, unique_total, zero_pages, data_pages, run_pages) =
        std::thread::scope(|s| {
            let maps = &ingested.maps;
            let slot_tables = &ingested.slots;
            let kept = &mut kept;
            let writer = s.spawn(move || -> Result<(Vec<ChunkId>, f64), MemError> {
                let t = Instant::now();
                let roots = maps
                    .iter()
                    .enumerate()
                    .map(|(bi, ids)| {
                        // This host keeps a copy, so restoring here needs no map from the link:
                        // collected here, written to the tree cache beside the commit below.
                        let mut keep = |id: ChunkId, raw: Vec<u8>| {
                            if keeping {
                                kept.push((id, raw))
                            }
                        };
                        // Each leaf's slot table (version 4): its pages' entries, by index.
                        let over = slot_tables.get(bi).map(Vec::as_slice).unwrap_or_default();
                        let mut payload = |leaf: usize| -> Vec<u8> {
                            let (lo, hi) =
                                ((leaf * LEAF_IDS) as u32, ((leaf + 1) * LEAF_IDS) as u32);
                            let a = over.partition_point(|&(p, _)| p < lo);
                            let b = over.partition_point(|&(p, _)| p < hi);
                            SlotTable(
                                over[a..b]
                                    .iter()
                                    .map(|&(p, slot)| ((p - lo) as u16, slot))
                                    .collect(),
                            )
                            .encode()
                        };
                        write_map_payloads(ses, ids, &mut payload, &mut keep)
                            .map_err(MemError::store("page map write", name))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((roots, t.elapsed().as_secs_f64() * 1e3))
            });
            let tail_writer = s.spawn(move || -> Result<(ChunkId, f64), MemError> {
                let t = Instant::now();
                let mut pieces = Vec::with_capacity(tail.len().div_ceil(TAIL_CHUNK));
                for piece in tail.chunks(TAIL_CHUNK) {
                    pieces.push(
                        ses.put_with(piece, ChunkKind::Data, Codec::Zstd(3))
                            .map_err(MemError::store("tail write", name))?,
                    );
                }
                let root = ses
                    .put_tree(&tail_tree(pieces, tail.len() as u64))
                    .map_err(MemError::store("tail write", name))?;
                Ok((root, t.elapsed().as_secs_f64() * 1e3))
            });
            let t_count = Instant::now();
            let counts = count_pages(maps, &ingested.runs);
            let blocks: Vec<BlockMeta> = layout
                .blocks
                .iter()
                .zip(&counts.per_block)
                .map(|(b, &(zero_pages, unique_pages))| BlockMeta {
                    name: b.name.clone(),
                    used_len: b.used_len,
                    zero_pages,
                    unique_pages,
                })
                .collect();
            let (zero_pages, data_pages, all) = (counts.zero, counts.data, counts.unique);
            let count_ms = t_count.elapsed().as_secs_f64() * 1e3;
            let roots = writer.join().map_err(|_| MemError::Panic { what: "page map writer" });
            let tail_root = tail_writer.join().map_err(|_| MemError::Panic { what: "tail writer" });
            if let (Ok(Ok((_, maps_ms))), Ok(Ok((_, tail_ms)))) = (&roots, &tail_root) {
                tracing::debug!(target: TARGET, maps_ms, tail_ms, count_ms, "save: page maps and tail written");
            }
            (roots, tail_root, blocks, all, zero_pages, data_pages, counts.run_pages)
        });
    let map_roots = map_roots??.0;
    let tail_root = tail_root??.0;
    let delta_meta = ingested.delta.as_ref().map(|d| DeltaMeta {
        base: d.base.clone(),
        pages: d.pages,
        bytes: d.bytes,
        records: d.records,
        attempts: d.attempts,
        skipped_batches: d.skipped_batches,
    });
    let delta_pages = delta_meta.as_ref().map_or(0, |d| d.pages);
    let st = store.stats();
    let new_bytes = st.raw_bytes_new.load(Ordering::Relaxed) - timing.raw_before;
    let stored_bytes = st.stored_bytes_new.load(Ordering::Relaxed) - timing.stored_before;
    let c = &ingested.counters;
    let data_records = c.page_records - c.zero_content;
    let logical = layout.total_ram();
    let stats = SaveStats {
        logical_bytes: logical,
        pages_sent: c.page_records + c.zero_records,
        zero_pages,
        data_pages,
        unique_pages: unique_total,
        pages_stored: c.new_chunks,
        pages_deduped: data_records.saturating_sub(c.new_chunks + delta_pages),
        new_bytes,
        stored_bytes,
        downtime_ms: timing.downtime_ms,
        total_ms: 0.0,
    };
    let mut manifest = Manifest {
        format: FORMAT.into(),
        // Run chunks need version 3; without them older readers can still read it.
        version: if ingested.slots.iter().any(|t| !t.is_empty()) {
            VERSION
        } else if run_pages > 0 {
            VERSION_RUNS
        } else {
            VERSION_NO_RUNS
        },
        name: name.into(),
        created_unix: now_unix(),
        mode: opts.mode,
        qemu: QemuInfo {
            version: version.to_string(),
            package: version.package.clone(),
            machine_type: machine,
            cmdline,
        },
        stream: StreamMeta {
            file_version: layout.version,
            machine_type: layout.machine_type.clone(),
            config_subsections: hex::encode(&layout.config_subsections),
            ram_section: layout.ram_section.clone(),
            bytes: ingested.info.stats.bytes,
            background_snapshot: ingested.info.background_snapshot,
            vmdesc_devices: ingested.info.vmdesc_devices as u64,
        },
        blocks,
        tail: TailMeta { len: tail.len() as u64, blake3: blake3::hash(tail).to_hex().to_string() },
        codec: chooser.report(),
        stats,
        delta: delta_meta,
    };
    manifest.stats.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let ckpt = Checkpoint { manifest, tail_root, map_roots, generation: 0 };
    let maps_ms = t_maps.elapsed().as_secs_f64() * 1e3;
    // The tree cache's copies (one file per tree: ~8 ms for a 128 MiB guest's 31, session 28)
    // are written while the commit waits on the link, and joined before the save returns, so
    // a restore on this host right after finds them. Best effort, as the cache is.
    let copies = (!kept.is_empty())
        .then(|| {
            let store = store.clone();
            std::thread::Builder::new().name("strata-tree-copy".into()).spawn(move || {
                if let Some(c) = store.tree_cache() {
                    for (id, raw) in &kept {
                        c.put(id, raw);
                    }
                }
            })
        })
        .and_then(|r| r.ok());
    let t_ref = Instant::now();
    let _lease = lease.wait().map_err(|e| match e {
        Some(e) => MemError::store("lease", name)(e),
        None => MemError::Panic { what: "lease" },
    })?;
    // Without --replace the name must still be free: checked at the start, and again by the
    // commit, under the lease, while the last packs flush.
    let committed = if opts.replace {
        ses.commit_ref(&rname, ckpt.to_ref())
    } else {
        ses.commit_new_ref(&rname, ckpt.to_ref())
    };
    committed.map_err(|e| match e {
        crate::store::StoreError::RefExists { .. } => MemError::Exists { name: name.into() },
        e => MemError::store("commit", name)(e),
    })?;
    resume.armed = false;
    let commit_ref_ms = t_ref.elapsed().as_secs_f64() * 1e3;
    if let Some(h) = copies {
        let _ = h.join();
    }
    if let Some(bps) = chooser.measured_bps() {
        remember_speed(store.local_dir(), &location, bps);
    }
    progress.finish();
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let m = &ckpt.manifest;
    let report = SaveReport {
        name: name.into(),
        mode: opts.mode,
        vm_status,
        downtime_ms: timing.downtime_ms,
        pause_ms: timing.pause_ms,
        total_ms,
        migrate_ms: timing.migrate_ms,
        commit_ms: t_commit.elapsed().as_secs_f64() * 1e3,
        logical_bytes: logical,
        stream_bytes: m.stream.bytes,
        new_bytes,
        stored_bytes,
        dedup_ratio: (data_pages * 4096) as f64 / new_bytes.max(1) as f64,
        compression_ratio: new_bytes as f64 / stored_bytes.max(1) as f64,
        reduction: logical as f64 / stored_bytes.max(1) as f64,
        pages_sent: m.stats.pages_sent,
        pages_stored: m.stats.pages_stored,
        pages_deduped: m.stats.pages_deduped,
        zero_pages,
        unique_pages: m.stats.unique_pages,
        codec: m.codec.clone(),
        delta: m.delta.clone(),
        delta_reads: ingested.delta.as_ref().map(|d| d.reads.clone()),
        run_table: opts.ingest.compressible_runs.then_some(ingested.run_table),
        stages: SaveStages {
            setup_ms: timing.setup_ms,
            stream_ms: timing.migrate_ms,
            drain_ms: ingested.drain_ms,
            parse_cpu_ms: ingested.parse_cpu_ms,
            pool_cpu_ms: ingested.pool_cpu_ms,
            waits: ingested.waits.clone(),
            maps_ms,
            commit_ref_ms,
        },
    };
    tracing::info!(target: TARGET, name, mode = opts.mode.as_str(), total_ms, stored_bytes, "checkpoint committed");
    Ok(report)
}

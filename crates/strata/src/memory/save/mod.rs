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
    ref_name, tail_tree, valid_name, BlockMeta, Checkpoint, CodecReport, DeltaMeta, DiskRecord,
    Manifest, Mode, QemuInfo, SaveStats, SlotTable, StreamMeta, TailMeta, FORMAT, REF_PREFIX,
    TAIL_CHUNK, VERSION_DISKS, VERSION_NO_RUNS, VERSION_RUNS, VERSION_SLOTS,
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

mod commit;
mod counts;
mod drain;
mod listing;
mod migrate;
mod setup;
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

/// The disks of a desktop snapshot (`vm snapshot`), cut at the guest instant of its memory.
///
/// The instant: the guest is stopped (QEMU's own stop for the device state of a background
/// snapshot, strata's `stop` for a save, precopy's switchover with `pause-before-switchover`);
/// QEMU drains and flushes its block layer before the guest is stopped, so every write the
/// guest issued has been acknowledged by the disks' server and nothing more arrives until it
/// resumes. [`Placement`] says how the cut finds that instant.
pub trait DiskCut {
    /// The placement the disks allow for a background snapshot; a save and a precopy
    /// snapshot always cut `AtStop` (the guest stays stopped, or is stopped at switchover).
    fn placement(&self) -> Placement;
    /// `AtStop`: cut every disk now, with the guest stopped (it runs inside the guest's
    /// pause: no I/O that can be avoided). `AtFlush`: arm the disks, before the migration
    /// starts.
    fn cut(&mut self, at: Placement) -> Result<(), String>;
    /// After every page is stored and before the commit: each cut disk's record and block
    /// map root, durable in the store. `resumed_us` is QEMU's RESUME event time (wall-clock
    /// microseconds) when the guest ran again during the save.
    fn finish(&mut self, resumed_us: Option<u64>) -> Result<Vec<(DiskRecord, ChunkId)>, String>;
}

/// How a [`DiskCut`] finds the guest's instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Cut while strata holds the guest stopped (`stop`, cut, `migrate`): exact whatever the
    /// disks' cache mode, at the cost of the round trips in the pause.
    AtStop,
    /// The disks' server cuts at every flush from the moment they are armed; the last cut
    /// before the guest resumed is the one (`serve::arm`). Adds nothing to the pause; needs
    /// QEMU to flush the disks on stop (not `cache=unsafe`).
    AtFlush,
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

/// Take the checkpoint's lease on a helper thread, at low CPU priority, once `migrate` has
/// been answered (`run`'s `on_migrating`). It is needed only at the commit: the pages a save
/// stores are invisible until its ref is written, and the commit takes the name under the
/// lease, so a save whose lease is held elsewhere fails there with nothing visible. Taken
/// during the set-up, its requests (and the server's work on them) slow QEMU's answers to the
/// set-up queries, the save's critical path, on a 2-core host. None if the thread cannot
/// start (the commit then fails, nothing visible).
fn take_lease(store: &Store, rname: &str) -> Option<std::thread::JoinHandle<LeaseResult>> {
    let (store, rname) = (store.clone(), rname.to_string());
    std::thread::Builder::new()
        .name("strata-save-lease".into())
        .spawn(move || {
            setup::lower_priority();
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
    pause_before_switchover: Option<bool>,
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
        if let Some(state) = self.pause_before_switchover {
            reqs.push(set_capabilities_request(&[("pause-before-switchover", state)]));
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
        if let Some(state) = self.pause_before_switchover {
            let _ = qmp.migrate_set_capabilities(&[("pause-before-switchover", state)]);
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
    let r = save_inner(store, qmp, name, opts, None, progress);
    // Replies read ahead for a step an error skipped must not answer the caller's next query.
    qmp.discard_pipelined();
    r
}

/// Save the VM behind `qmp` as desktop snapshot `name`: its memory and the disks `disks`
/// cuts, at one guest instant (see [`DiskCut`]), committed as one ref.
pub fn save_desktop(
    store: &Store,
    qmp: &mut QmpClient,
    name: &str,
    opts: &SaveOptions,
    disks: &mut dyn DiskCut,
    progress: &dyn Progress,
) -> Result<SaveReport, MemError> {
    let r = save_inner(store, qmp, name, opts, Some(disks), progress);
    // Replies read ahead for a step an error skipped must not answer the caller's next query.
    qmp.discard_pipelined();
    r
}

/// The save's stages, in order: open (queries out, helpers started) and read the source;
/// plan the migration; build the codec chooser; set up QEMU and migrate while the pipeline
/// drains into the store; write the maps; build the manifest; commit; report.
fn save_inner(
    store: &Store,
    qmp: &mut QmpClient,
    name: &str,
    opts: &SaveOptions,
    mut disks: Option<&mut (dyn DiskCut + '_)>,
    progress: &dyn Progress,
) -> Result<SaveReport, MemError> {
    let t0 = Instant::now();
    if !valid_name(name) {
        return Err(MemError::BadName { name: name.into() });
    }
    let rname = ref_name(name);
    // Declared before the listing so that, on a failed save, the listing is dropped first.
    let mut lease = PendingLease(None);
    let mut open = setup::open(store, qmp, &rname, name, opts)?;
    let sent = open.sent.take().unwrap_or(Ok(()));
    let source = setup::query_source(qmp, sent);
    let qmp_ms = t0.elapsed().as_secs_f64() * 1e3;
    // None: the answer is late and not needed yet (no checkpoint this host knows of).
    let any_checkpoint = open.listing.before_migrate(store, &opts.base)?.unwrap_or(false);
    tracing::debug!(target: TARGET, qmp_ms, joined_ms = t0.elapsed().as_secs_f64() * 1e3, "save: source queried");
    let source = source?;
    let planned = setup::plan_migration(
        store,
        qmp,
        name,
        opts,
        &source.machine,
        any_checkpoint,
        open.network,
        progress,
    )?;
    let opts = &planned;
    let chooser = setup::codec_chooser(store, name, opts, &mut open, source.local, progress)?;
    let restorer = setup::settings_to_restore(name, opts.mode, disks.is_some(), &source)?;

    // Set up QEMU and migrate; the receive pipeline drains into the store meanwhile.
    let result = setup::migrate_settings(qmp.path(), opts, &restorer).and_then(|settings| {
        let mut on_migrating = || lease.0 = take_lease(store, &rname);
        let mut check = || open.listing.poll();
        run(
            store,
            qmp,
            name,
            opts,
            &chooser,
            source.status.running,
            &settings,
            disks.as_deref_mut(),
            &mut on_migrating,
            &mut check,
            progress,
            t0,
        )
    });
    restorer.put_back(qmp);
    // A failed save must not leave a running desktop paused: from here until the ref is
    // committed, an error resumes the guest (a stream cut, or a commit refused: store full,
    // the name's lease held by another host).
    let mut resume = ResumeOnError { qmp, armed: source.status.running };
    let (ingested, timing) = result?;
    open.listing.finish()?;
    let cut_disks = match disks {
        Some(d) => d
            .finish(timing.resumed_us)
            .map_err(|reason| MemError::DiskCut { name: name.into(), reason })?,
        None => Vec::new(),
    };
    let vm_status =
        resume.qmp.query_status().map(|s| s.status).unwrap_or_else(|_| "unknown".into());

    // Maps, tail, manifest, ref.
    let t_commit = Instant::now();
    progress.phase("committing", None, Unit::Items);
    let ses = &timing.session;
    commit::check_complete(name, &ingested)?;
    let t_maps = Instant::now();
    let mut written = commit::write_maps(store, ses, name, &ingested)?;
    let st = store.stats();
    let added = commit::Added {
        new_bytes: st.raw_bytes_new.load(Ordering::Relaxed) - timing.raw_before,
        stored_bytes: st.stored_bytes_new.load(Ordering::Relaxed) - timing.stored_before,
    };
    let delta = ingested.delta.as_ref().map(commit::delta_meta);
    let stats = commit::save_stats(
        &ingested.counters,
        &written.counts,
        delta.as_ref().map_or(0, |d| d.pages),
        ingested.info.layout.total_ram(),
        &added,
        timing.downtime_ms,
    );
    let inputs = commit::ManifestInputs {
        name,
        mode: opts.mode,
        source,
        codec: chooser.report(),
        stats,
        delta,
    };
    let mut manifest = commit::build_manifest(inputs, &ingested, &written);
    manifest.stats.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (records, disk_roots): (Vec<DiskRecord>, Vec<ChunkId>) = cut_disks.into_iter().unzip();
    if !records.is_empty() {
        manifest.version = manifest.version.max(VERSION_DISKS);
        manifest.disks = records;
        for root in &disk_roots {
            ses.pin(*root).map_err(|source| MemError::Store {
                op: "disk snapshot",
                name: name.into(),
                source,
            })?;
        }
    }
    let ckpt = Checkpoint {
        manifest,
        tail_root: written.tail_root,
        map_roots: std::mem::take(&mut written.map_roots),
        disk_roots,
        generation: 0,
    };
    let maps_ms = t_maps.elapsed().as_secs_f64() * 1e3;
    let copies = commit::copy_trees(store, std::mem::take(&mut written.kept));
    let t_ref = Instant::now();
    let _lease = commit::commit_ref(ses, &mut lease, &rname, name, &ckpt, opts.replace)?;
    resume.armed = false;
    let commit_ref_ms = t_ref.elapsed().as_secs_f64() * 1e3;
    if let Some(h) = copies {
        let _ = h.join();
    }
    if let Some(bps) = chooser.measured_bps() {
        remember_speed(store.local_dir(), &open.location, bps);
    }
    progress.finish();
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let clock = commit::Clock {
        total_ms,
        commit_ms: t_commit.elapsed().as_secs_f64() * 1e3,
        maps_ms,
        commit_ref_ms,
    };
    let report = commit::report(&ckpt, opts, vm_status, &ingested, &timing, clock);
    tracing::info!(target: TARGET, name, mode = opts.mode.as_str(), total_ms, stored_bytes = added.stored_bytes, "checkpoint committed");
    Ok(report)
}

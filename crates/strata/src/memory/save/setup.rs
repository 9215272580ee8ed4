//! The save's stages before `migrate` (steps 1 and 2 of the module's sequence): open (the
//! source's queries go out, helpers start), read the source, plan the migration (delta base,
//! queue and frame sizes), build the codec chooser, and decide which QEMU settings the save
//! changes and puts back.

use std::thread::JoinHandle;

use super::*;
use crate::backend::BackendError;
use crate::qmp::{MigrationCapability, QemuVersion, RunStatus};

/// What `open` started: the queries in flight, the ref listing, the backend probe.
pub(super) struct Opening {
    /// Whether the source's queries were written.
    pub(super) sent: Option<Result<(), QmpError>>,
    pub(super) listing: listing::Listing,
    pub(super) probe: Option<JoinHandle<Result<f64, BackendError>>>,
    /// The backend's speed this host remembered, and its age in seconds.
    pub(super) remembered: Option<(f64, u64)>,
    pub(super) network: bool,
    pub(super) location: String,
}

/// zstd levels the save may compress with, whose contexts are warmed before the stream.
pub(super) fn warm_levels(codec: CodecPolicy) -> Vec<i32> {
    match codec {
        CodecPolicy::Auto => CANDIDATES
            .iter()
            .filter_map(|c| if let Codec::Zstd(l) = *c { Some(l) } else { None })
            .collect(),
        CodecPolicy::Fixed(Codec::Zstd(l)) => vec![l],
        CodecPolicy::Fixed(_) => vec![],
    }
}

/// Lower the calling thread's CPU priority: helpers off the critical path yield to the
/// set-up's own threads and to QEMU.
pub(super) fn lower_priority() {
    // SAFETY: a plain syscall on the calling thread; failure leaves the priority.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}

/// Step 1's start: send the source's queries, warm the codec, start the ref listing and (on
/// a local disk with nothing remembered) the backend probe.
pub(super) fn open(
    store: &Store,
    qmp: &mut QmpClient,
    rname: &str,
    name: &str,
    opts: &SaveOptions,
) -> Result<Opening, MemError> {
    // The source's queries go out first, in one write, so QEMU answers them while the
    // helpers below start and the backend round trips run; the replies are read where they
    // are checked. Sent after the helpers, the replies come 2-5.6 ms later on a 2-core host.
    let sent = qmp.send_pipeline(&[
        ("query-migrate", None),
        ("query-migrate-capabilities", None),
        ("query-status", None),
        machine_type_request(),
        ("query-migrate-parameters", None),
    ]);
    // The pool's zstd contexts are warmed (their workspaces allocated and page-faulted) on a
    // helper thread while the QMP set-up below goes back and forth, not on the first frames.
    let levels = warm_levels(opts.codec);
    if !levels.is_empty() {
        let per_level = opts.ingest.workers.max(1);
        let _ = std::thread::Builder::new().name("strata-zstd-warm".into()).spawn(move || {
            // Below the set-up's own threads and QEMU, which answer the queries on the
            // critical path; the host has idle CPU while those round trips go on.
            lower_priority();
            crate::codec::prewarm_zstd(&levels, per_level)
        });
    }
    // One writer per checkpoint name, across hosts (docs/backends.md). The listing (is the
    // name taken, could any checkpoint be a delta base) is a backend round trip run beside the
    // read-only QMP queries, and waited for before QEMU is changed only when its answer can
    // change the save (`listing.rs`); otherwise it is checked during the stream and before the
    // commit. The lease is taken only once `migrate` has been answered and waited for only
    // before the commit (`take_lease`).
    let listing = listing::Listing::start(store, rname, name, opts.replace)?;
    // Step 2's prior: remembered, assumed (network) or probed (local disk, while the QMP
    // queries below go back and forth).
    let location = store.location().to_string();
    let remembered = remembered_speed(store.local_dir(), &location);
    let network = store.backend().capabilities().network;
    let probe = (opts.codec == CodecPolicy::Auto && remembered.is_none() && !network).then(|| {
        let backend = store.backend().clone();
        std::thread::spawn(move || probe_backend(&*backend, PROBE_BYTES))
    });
    Ok(Opening { sent: Some(sent), listing, probe, remembered, network, location })
}

/// The source, as its answers to the queries `open` sent describe it.
pub(super) struct Source {
    pub(super) status: RunStatus,
    pub(super) machine: String,
    pub(super) version: QemuVersion,
    /// QEMU runs on this host (its pid is known).
    pub(super) local: bool,
    pub(super) cmdline: Vec<String>,
    pub(super) caps: Vec<MigrationCapability>,
    pub(super) params: Value,
}

/// Step 1's checks: read the replies; refuse a migration already running or capabilities
/// strata cannot store.
pub(super) fn query_source(
    qmp: &mut QmpClient,
    sent: Result<(), QmpError>,
) -> Result<Source, MemError> {
    let path = qmp.path().to_path_buf();
    let q = |op| MemError::qmp(op, &path);
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
    Ok(Source { status, machine, version, local, cmdline, caps, params })
}

/// Plan the migration: the delta base (the newest checkpoint with this machine type and RAM
/// layout) and the receive pipeline's sizes for the mode and backend.
#[allow(clippy::too_many_arguments)] // one call, each input a different part of the save
pub(super) fn plan_migration(
    store: &Store,
    qmp: &mut QmpClient,
    name: &str,
    opts: &SaveOptions,
    machine: &str,
    any_checkpoint: bool,
    network: bool,
    progress: &dyn Progress,
) -> Result<SaveOptions, MemError> {
    let base = match &opts.base {
        BasePolicy::Off => None,
        BasePolicy::Auto if !any_checkpoint => None,
        policy => match qmp.ram_blocks() {
            Ok(ram) => {
                let ram: Vec<(String, u64)> = ram.into_iter().map(|b| (b.name, b.used)).collect();
                select_base(store, policy, name, machine, &ram)?
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
    let mut planned = size_pipeline(opts, network);
    planned.ingest.base = base.map(std::sync::Arc::new);
    Ok(planned)
}

/// The receive pipeline's sizes: a stop-and-copy save bounds its queue, and on a network
/// backend uses the larger frames and compressible runs, unless the caller pinned a frame
/// size (tests and benches do).
pub(super) fn size_pipeline(opts: &SaveOptions, network: bool) -> SaveOptions {
    let mut sized = opts.clone();
    if opts.mode == Mode::Save {
        sized.ingest.queue_bytes =
            sized.ingest.queue_bytes.min(crate::memory::ingest::SAVE_QUEUE_BYTES);
        if network && sized.ingest.frame_pages == crate::memory::ingest::FRAME_PAGES {
            sized.ingest.frame_pages = crate::memory::ingest::SAVE_NETWORK_FRAME_PAGES;
            sized.ingest.compressible_runs = sized.ingest.runs;
        }
    }
    sized
}

/// Step 2: the codec chooser's inputs (the backend's starting speed, the cores, the cost
/// model) and the chooser.
pub(super) fn codec_chooser(
    store: &Store,
    name: &str,
    opts: &SaveOptions,
    open: &mut Opening,
    local: bool,
    progress: &dyn Progress,
) -> Result<Chooser, MemError> {
    let network = open.network;
    let (backend_bps, prior_from) = match (open.probe.take(), open.remembered) {
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
    let cores = compression_cores(network, opts.mode, opts.ingest.workers.max(1), local);
    let chooser = Chooser::new(opts.codec, backend_bps, cores)
        .with_meter(meter, &prior_from)
        .with_model(model);
    Ok(if network {
        let backlog_store = store.clone();
        let chooser = if opts.mode == Mode::Save {
            chooser.with_start(SAVE_NETWORK_START).without_warmup()
        } else {
            chooser.with_start(NETWORK_START)
        };
        chooser.with_backlog(Box::new(move || backlog_store.unsent_bytes()))
    } else {
        chooser
    })
}

/// Cores the chooser counts on for compression. A stop-and-copy save to a network backend
/// compresses on every worker: the guest is stopped, and QEMU's migration thread blocks on
/// the bounded queue whenever the pool falls behind, so it holds no core of its own; the
/// uploads wait on the link. Counting one core there makes zstd:1 look CPU-bound on a dip of
/// its samples and hands 128 MiB saves to lz4, which is slower both ways (docs/memory.md). A
/// live checkpoint's guest keeps running, so it keeps `usable_cores`.
pub(super) fn compression_cores(network: bool, mode: Mode, workers: usize, local: bool) -> usize {
    if network && mode == Mode::Save {
        workers
    } else {
        usable_cores(local).min(workers)
    }
}

/// The QEMU settings the save changes, to put back afterwards. Only what the save changes is
/// put back, and the capability is set only when it is not already as the mode needs (one
/// QMP command less on the way to `migrate`).
pub(super) fn settings_to_restore(
    name: &str,
    mode: Mode,
    desktop: bool,
    source: &Source,
) -> Result<Restorer, MemError> {
    let want_bg = mode == Mode::BackgroundSnapshot;
    let cap = |n: &str| source.caps.iter().find(|c| c.capability == n).map(|c| c.state);
    let bg_state = cap("background-snapshot");
    // A precopy desktop snapshot cuts the disks in the pre-switchover pause.
    let want_pause = desktop && mode == Mode::Precopy;
    let restorer = Restorer {
        max_bandwidth: source.params.get("max-bandwidth").and_then(Value::as_u64),
        background_snapshot: bg_state.filter(|&s| s != want_bg),
        pause_before_switchover: cap("pause-before-switchover").filter(|&s| s != want_pause),
    };
    if bg_state.is_none() && want_bg {
        return Err(MemError::SourceFailed {
            name: name.into(),
            status: "setup".into(),
            desc: format!(
                "QEMU {} has no background-snapshot capability; use --precopy",
                source.version
            ),
        });
    }
    Ok(restorer)
}

/// The settings sent in one write with `stop` and `migrate` (`run`).
pub(super) fn migrate_settings(
    qmp_path: &Path,
    opts: &SaveOptions,
    restorer: &Restorer,
) -> Result<Vec<Request>, MemError> {
    let set = MigrateParameters { max_bandwidth: Some(opts.max_bandwidth), ..Default::default() };
    let mut settings: Vec<Request> =
        vec![set.request().map_err(MemError::qmp("migrate-set-parameters", qmp_path))?];
    if restorer.background_snapshot.is_some() {
        let want_bg = opts.mode == Mode::BackgroundSnapshot;
        settings.push(set_capabilities_request(&[("background-snapshot", want_bg)]));
    }
    if let Some(was) = restorer.pause_before_switchover {
        settings.push(set_capabilities_request(&[("pause-before-switchover", !was)]));
    }
    Ok(settings)
}

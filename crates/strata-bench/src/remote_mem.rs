//! Memory benchmarks over the 1 Gbit/s storage host: `strata-bench save-restore --remote` and
//! `strata-bench live --redis`.
//!
//! Same guests and desktop workload as the local `save-restore` / `live`
//! (`mem/`), but the bytes go through the link:
//! * **QEMU baselines** migrate with `exec:` to a [`Relay`] that writes the stream into a file
//!   on the storage host's disk (starting writeback every 4 MiB as it arrives) and fsyncs it:
//!   `cat` (raw), `zstd -1` and `lzop`, compressing
//!   on this host before the link (as a compressed save to remote storage does). Save time runs from
//!   the `stop` of the running guest (then `migrate`) to the fsync on the storage host, as
//!   strata's `vm save` clock runs from the request on the running guest (it stops it itself). Restores start a fresh
//!   QEMU with `-incoming defer`; the relay serves the file and the filter decompresses here.
//! * **strata** saves into a store on the storage host's S3 (versitygw) with no SSD cache, so
//!   the restore really reads through the link. The codec is chosen adaptively (the measured
//!   link speed makes it compress); the chosen codec and the reason are reported. versitygw
//!   does not fsync its objects, so the harness does what a durable server would
//!   (`objsync.rs`): it starts the writeback of objects as they arrive (every 4 MiB the
//!   server receives, as the relay does for a stream), fsyncs each object as it lands, and at
//!   the commit (inside the save's clock, [`DurableAtCommit`]) waits for those fsyncs and
//!   fsyncs every object file the watcher did not sync or that changed since (and every
//!   directory the save wrote, unless a file's fsync makes its name durable there, as for the
//!   relay: `names_durable_with_files`). The S3 server starts fresh with
//!   the benchmark, so 256 MiB are put to it and read back before the first timed step
//!   ([`StorageHost::warm_s3`]), as a long-running server would be.
//! * `live --redis`: checkpoints (background-snapshot, precopy + cont, stop-and-copy) into a
//!   store on the storage host's Redis (`appendfsync always`), one key prefix per run.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use strata::backend::open::open_location;
use strata::backend::retry::RetryPolicy;
use strata::fixtures::{Fixtures, Guest, Machine};
use strata::memory::codec_choice::CodecPolicy;
use strata::memory::manifest::Mode;
use strata::memory::restore::{RestoreOptions, RestoreReport};
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::progress::NoProgress;
use strata::store::Store;
use strata::Codec;

use crate::chart::{bars, stack, Series};
use crate::guest::{
    check_sum, desktop_guest, dirty_checkpoint, machine, qemu_restore, results_name, scratch_dir,
    start_dest, workload_guest, CheckpointCost, Workload, WorkloadMix, LIVE_MODES,
};
use crate::hostmem::{retake, warm_host, warm_mib};
use crate::remote::{
    host_cpu_s, mb, proc_cpu_s, proc_cpu_split, HostCpu, Link, Relay, StorageHost,
};
use crate::results::{env_json, write_outputs};

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    mem_mib: u32,
    /// Which round (0-based); `None` for the median of all rounds.
    round: Option<u32>,
    method: String,
    save_s: f64,
    restore_s: f64,
    stored_bytes: u64,
    save_link: Link,
    restore_link: Link,
    save_vs_cat: f64,
    restore_vs_cat: f64,
    codec: String,
    verified: bool,
    restore_cpu: RestoreCpu,
    /// Host CPU from the save's start until it was durable.
    save_cpu: HostCpu,
}

/// CPU seconds during one restore (until QEMU reported the load completed): the target QEMU's,
/// and the whole host's busy time against what its cores had (wall time x cores). On this
/// 2-core host a restore whose `host_busy_s` nears `host_avail_s` is bound by CPU, not the link.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
struct RestoreCpu {
    target_qemu_s: f64,
    /// Of that, system time, and the page faults (minor, major) the target QEMU took.
    target_qemu_sys_s: f64,
    target_qemu_faults: (u64, u64),
    /// Seconds the target QEMU's threads were runnable but waiting for a CPU.
    target_qemu_wait_s: f64,
    host_busy_s: f64,
    host_avail_s: f64,
}

type CpuSample = ((f64, f64, u64, u64), f64, (f64, f64));

impl RestoreCpu {
    fn sample(d: &crate::guest::Dest) -> CpuSample {
        (d.cpu_split(), d.run_wait_s(), host_cpu_s())
    }

    fn since(d: &crate::guest::Dest, (q0, w0, h0): CpuSample) -> RestoreCpu {
        let (q1, w1, h1) = RestoreCpu::sample(d);
        RestoreCpu {
            target_qemu_s: (q1.0 + q1.1) - (q0.0 + q0.1),
            target_qemu_sys_s: q1.1 - q0.1,
            target_qemu_faults: (q1.2 - q0.2, q1.3 - q0.3),
            target_qemu_wait_s: w1 - w0,
            host_busy_s: h1.0 - h0.0,
            host_avail_s: h1.1 - h0.1,
        }
    }
}

impl std::fmt::Display for RestoreCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "target QEMU {:.2} ({:.2} sys, {}+{} faults, {:.3} waiting for a CPU), host busy {:.2} of {:.2}",
            self.target_qemu_s, self.target_qemu_sys_s, self.target_qemu_faults.0, self.target_qemu_faults.1, self.target_qemu_wait_s, self.host_busy_s, self.host_avail_s
        )
    }
}

/// Save the running guest with QEMU through `relay` (`stop`, then `migrate`); seconds from the
/// `stop` until the file is fsynced there. strata's `vm save` stops the guest inside its own
/// clock too, so both clocks start at the same point: a running desktop and a save request.
fn qemu_save_remote(
    q: &mut strata::qmp::QmpClient,
    uri: &str,
    relay: Relay,
) -> Result<(f64, u64, HostCpu)> {
    let c0 = HostCpu::start();
    let t = c0.1;
    q.stop()?;
    q.migrate(uri)?;
    q.wait_migration(Duration::from_secs(1800), Duration::from_millis(5))?;
    let (n, end) = relay.wait()?;
    let cpu = HostCpu::since(c0);
    q.cont()?;
    Ok((end.duration_since(t).as_secs_f64(), n, cpu))
}

/// MiB put to and read from the fresh S3 server before the first timed step
/// ([`StorageHost::warm_s3`]).
const WARM_S3_MIB: usize = 256;

/// Largest range GET of the strata restore over the link: the library's default, what
/// `strata vm restore` uses.
const RESTORE_READ_BYTES: u64 = strata::memory::restore::DEFAULT_READ_BYTES;

/// The three QEMU streams: decoder, encoder and file name on the storage host.
const STREAMS: [(&str, &str, &str, &str); 3] = [
    ("exec:cat", "", "", "cat.bin"),
    ("exec:zstd -1", "zstd -1 -q", "zstd -dc", "zstd.bin"),
    ("exec:lzop", "lzop -c", "lzop -dc", "lzop.bin"),
];

/// One QEMU stream's save: seconds, bytes stored, link bytes, and its file there.
struct StreamSaved {
    name: &'static str,
    decoder: &'static str,
    save_s: f64,
    bytes: u64,
    link: Link,
    cpu: HostCpu,
    remote: std::path::PathBuf,
}

fn save_stream(
    host: &StorageHost,
    q: &mut strata::qmp::QmpClient,
    mem: u32,
    i: usize,
    port: &mut u16,
    warm: u32,
) -> Result<StreamSaved> {
    let (name, enc, dec, file) = STREAMS[i];
    let remote = host.dir().join(format!("m{mem}-{file}"));
    *port += 1;
    let relay = Relay::receive(host, *port, remote.clone())?;
    let uri = relay.exec_save(enc);
    warm_host(warm);
    let l0 = host.link();
    let (s, n, cpu) = qemu_save_remote(q, &uri, relay)?;
    let link = host.link().since(l0);
    retake(warm);
    eprintln!(
        "  {name:<14} save {s:>6.2} s  {:>6.0} MB stored, {:>6.0} MB over the link (host CPU busy {:.3} of {:.3} s)",
        mb(n),
        mb(link.total()),
        cpu.host_busy_s,
        cpu.host_avail_s
    );
    Ok(StreamSaved { name, decoder: dec, save_s: s, bytes: n, link, cpu, remote })
}

/// A stream's restore into a fresh `-incoming defer` QEMU: seconds and link bytes. The file
/// is removed afterwards.
fn restore_stream(
    host: &StorageHost,
    g: &Guest,
    dir: &Path,
    s: &StreamSaved,
    port: &mut u16,
    warm: u32,
) -> Result<(f64, Link, RestoreCpu)> {
    let mut d = start_dest(
        g,
        dir,
        &format!("dst-{}", s.name.trim_start_matches("exec:").replace(' ', "")),
    )?;
    *port += 1;
    let relay = Relay::send(host, *port, s.remote.clone())?;
    let uri = relay.exec_restore(s.decoder);
    warm_host(warm);
    let l0 = host.link();
    let c0 = RestoreCpu::sample(&d);
    let t = qemu_restore(&mut d, &uri)?;
    let cpu = RestoreCpu::since(&d, c0);
    let rl = host.link().since(l0);
    retake(warm);
    relay.wait()?;
    eprintln!(
        "  {:<14} restore {t:>6.2} s  {:>6.0} MB over the link (CPU s: {cpu})",
        s.name,
        mb(rl.total())
    );
    std::fs::remove_file(&s.remote).ok();
    Ok((t, rl, cpu))
}

/// strata's save into a fresh store under `prefix` on the storage host's S3.
struct StrataSaved {
    store: Store,
    report: SaveReport,
    save_s: f64,
    link: Link,
    fsync_s: f64,
    synced_live: u64,
    /// CPU seconds of versitygw and of strata (this process) during the save.
    cpu: (f64, f64),
    /// Of strata's, system time, and its minor page faults.
    sys: f64,
    faults: u64,
    /// Bytes of its objects on the storage host ([`save_object_bytes`]).
    object_bytes: u64,
    /// Host CPU from the save's start until its objects were durable.
    host_cpu: HostCpu,
    /// This process's resident MB when the save began, and its peak during the save
    /// ([`peak_rss_reset`]).
    rss_mb: (f64, f64),
}

/// Resident MB of this process (`VmRSS`), after resetting its peak (`VmHWM`) to that.
fn peak_rss_reset() -> f64 {
    // Writing 5 to clear_refs resets the peak resident set size (Linux 4.0+).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    status_mb("VmRSS:")
}

/// A `/proc/self/status` field given in kB, as MB.
fn status_mb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb * 1024.0 / 1e6)
}

/// Makes a save's objects durable the moment it commits, on its clock. `save` ends its
/// "committing" phase (`Progress::finish`) right after writing the ref and before its
/// `total_ms` is taken, so the watcher's last fsyncs and the final pass over every object
/// (`objsync.rs`) are part of the save's time, and nothing after the commit (the lease
/// release) is.
struct DurableAtCommit {
    phase: std::sync::Mutex<String>,
    sync: std::sync::Mutex<Option<crate::objsync::ObjectSync>>,
    dir: std::path::PathBuf,
    /// (objects the watcher fsynced as they landed, files fsynced at the end (not synced by
    /// it, or changed since), seconds from the commit until all were durable).
    done: std::sync::Mutex<Option<Result<(u64, u64, f64)>>>,
    /// Host CPU and time when the objects were durable (the end of the save's clock).
    durable_at: std::sync::Mutex<Option<(u64, Instant)>>,
}

impl DurableAtCommit {
    fn new(sync: crate::objsync::ObjectSync, dir: std::path::PathBuf) -> DurableAtCommit {
        DurableAtCommit {
            phase: Default::default(),
            sync: std::sync::Mutex::new(Some(sync)),
            dir,
            done: Default::default(),
            durable_at: Default::default(),
        }
    }
}

impl strata::progress::Progress for DurableAtCommit {
    fn phase(&self, name: &str, _: Option<u64>, _: strata::progress::Unit) {
        *self.phase.lock().unwrap() = name.to_string();
    }
    fn advance(&self, _: u64) {}
    fn finish(&self) {
        if *self.phase.lock().unwrap() != "committing" {
            return;
        }
        if let Some(wb) = self.sync.lock().unwrap().take() {
            let t = Instant::now();
            let live = wb.stop();
            let stop_ms = t.elapsed().as_secs_f64() * 1e3;
            let r = StorageHost::fsync_tree(&self.dir, &live)
                .map(|(files, _)| (live.len() as u64, files, t.elapsed().as_secs_f64()));
            tracing::debug!(target: "strata::bench", stop_ms, total_ms = t.elapsed().as_secs_f64() * 1e3, "save's objects durable");
            *self.durable_at.lock().unwrap() = Some(HostCpu::start());
            *self.done.lock().unwrap() = Some(r);
        }
    }
}

fn strata_save(
    host: &StorageHost,
    q: &mut strata::qmp::QmpClient,
    dir: &Path,
    prefix: &str,
    codec: CodecPolicy,
    warm: u32,
) -> Result<StrataSaved> {
    let (backend, _) = host.s3(prefix, None)?;
    let meta = dir.join(format!("{prefix}-meta"));
    let store = StorageHost::init_store(backend, &meta, Codec::Lz4)?;
    warm_host(warm);
    let l0 = host.link();
    let (s3c0, me0) = (host.s3_cpu_s(), proc_cpu_s("/proc/self/stat"));
    let self0 = proc_cpu_split("/proc/self/stat");
    let h0 = HostCpu::start();
    let objects = host.bucket_dir().join(prefix);
    let at_commit = DurableAtCommit::new(host.sync_objects(objects.clone()), objects.clone());
    let opts = SaveOptions { codec, ..SaveOptions::new(Mode::Save) };
    let rss0 = peak_rss_reset();
    let r = save(&store, q, "bench", &opts, &at_commit);
    let rss_mb = (rss0, status_mb("VmHWM:"));
    let r: SaveReport = r?;
    // Normally done at the commit, inside the save's clock; if the hook did not run (the save
    // changed shape), after it, and added.
    let (synced_live, files, fsync_s, inside) = match at_commit.done.lock().unwrap().take() {
        Some(d) => {
            let (live, files, s) = d?;
            (live, files, s, true)
        }
        None => {
            let t = Instant::now();
            let live = at_commit.sync.lock().unwrap().take().map(|w| w.stop()).unwrap_or_default();
            let (files, _) = StorageHost::fsync_tree(&objects, &live)?;
            (live.len() as u64, files, t.elapsed().as_secs_f64(), false)
        }
    };
    let host_cpu = match at_commit.durable_at.lock().unwrap().take() {
        Some(end) if inside => HostCpu::between(h0, end),
        _ => HostCpu::since(h0),
    };
    let link = host.link().since(l0);
    let cpu = (host.s3_cpu_s() - s3c0, proc_cpu_s("/proc/self/stat") - me0);
    let self1 = proc_cpu_split("/proc/self/stat");
    // After every measurement of this process (the pool is touched here).
    retake(warm);
    let object_bytes = save_object_bytes(&objects)?;
    q.cont()?;
    let save_s = r.total_ms / 1e3 + if inside { 0.0 } else { fsync_s };
    eprintln!(
        "  {:<14} save {save_s:>6.2} s  {:>6.0} MB stored, {:>6.0} MB over the link (host CPU busy {:.3} of {:.3} s; CPU s: versitygw {:.2}, strata {:.2} ({:.2} sys, {} faults); codec {}: {}; {synced_live} objects fsynced as they landed, then {files} more{}; {fsync_s:.3} s from the commit until all were durable)",
        "strata",
        mb(object_bytes),
        mb(link.total()),
        host_cpu.host_busy_s,
        host_cpu.host_avail_s,
        cpu.0,
        cpu.1,
        self1.1 - self0.1,
        self1.2 - self0.2,
        r.codec.chosen,
        r.codec.why,
        if crate::remote::names_durable_with_files(&objects) { "" } else { " and the directories" }
    );
    let (sys, faults) = (self1.1 - self0.1, self1.2 - self0.2);
    if let Some(t) = &r.run_table {
        eprintln!(
            "  {:<14} resident {:.0} MB, peak {:.0} MB during the save; run table {} pages in {} runs, {:.1} MB",
            "",
            rss_mb.0,
            rss_mb.1,
            t.pages,
            t.runs,
            t.heap_bytes as f64 / 1e6
        );
    }
    Ok(StrataSaved {
        store,
        report: r,
        save_s,
        link,
        fsync_s,
        synced_live,
        cpu,
        sys,
        faults,
        object_bytes,
        host_cpu,
        rss_mb,
    })
}

/// Bytes of the objects a save put under its prefix on the storage host: its packs (frames,
/// entry tables, headers and footers), index objects if any, and its ref. The save report's
/// `stored_bytes` counts frames only (the store's `stored_bytes_new`), ~1.5% less for a
/// memory save (its pack tables), so the tables report the objects' sizes, which compare
/// fairly with the streams' files.
fn save_object_bytes(prefix_dir: &Path) -> Result<u64> {
    fn walk(d: &Path, total: &mut u64) -> std::io::Result<()> {
        for e in std::fs::read_dir(d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                walk(&e.path(), total)?;
            } else if ft.is_file() {
                *total += e.metadata()?.len();
            }
        }
        Ok(())
    }
    let mut total = 0;
    for sub in ["packs", "index", "refs"] {
        let d = prefix_dir.join(sub);
        if d.exists() {
            walk(&d, &mut total).with_context(|| format!("sizing {}", d.display()))?;
        }
    }
    Ok(total)
}

/// One strata restore: seconds, link bytes, the report, the target QEMU's CPU (user, system)
/// and the host's CPU.
type StrataRestore = (f64, Link, RestoreReport, (f64, f64), RestoreCpu);

/// strata's restore: the index and (unless `cold_maps`) the page maps are local (this host saved
/// them), the pages come over the link.
/// Seconds until QEMU reported the load completed, as for the streams (resuming the guest
/// after it, in `total_ms`, is not in their times either).
// The saved store, the guest and this run's settings; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
fn strata_restore(
    host: &StorageHost,
    s: &StrataSaved,
    g: &Guest,
    dir: &Path,
    w: &Workload,
    workers: usize,
    warm: u32,
    cold_maps: bool,
) -> Result<StrataRestore> {
    let mut d = start_dest(g, dir, "dst-strata")?;
    if cold_maps {
        // As on a host that did not save it: the page maps come over the link.
        // And its copy of the ref: the ref GET comes first, as there.
        let trees =
            s.store.tree_cache().context("an S3 store has a tree cache")?.dir().to_path_buf();
        let refs =
            s.store.ref_copies().context("an S3 store keeps ref copies")?.dir().to_path_buf();
        for d in [trees, refs] {
            if d.exists() {
                std::fs::remove_dir_all(&d).with_context(|| format!("removing {}", d.display()))?;
            }
        }
    }
    warm_host(warm);
    let l0 = host.link();
    let (s3c0, me0) = (host.s3_cpu_s(), proc_cpu_s("/proc/self/stat"));
    let self0 = proc_cpu_split("/proc/self/stat");
    let c0 = RestoreCpu::sample(&d);
    let opts = RestoreOptions { workers, read_bytes: RESTORE_READ_BYTES, ..Default::default() };
    let rr = strata::memory::restore::restore(&s.store, "bench", &mut d.qmp, &opts, &NoProgress)?;
    let link = host.link().since(l0);
    let cpu = (host.s3_cpu_s() - s3c0, proc_cpu_s("/proc/self/stat") - me0);
    let host_cpu = RestoreCpu::since(&d, c0);
    let self1 = proc_cpu_split("/proc/self/stat");
    retake(warm);
    check_sum(&d, w)?;
    let t = rr.load_ms / 1e3;
    eprintln!(
        "  {:<14} restore {t:>6.2} s  {:>6.0} MB over the link (plan {:.2} s; CPU s: versitygw {:.2}, strata {:.2} ({:.2} sys, {} faults), {host_cpu}; memwork sum verified)",
        "strata",
        mb(link.total()),
        rr.plan_ms / 1e3,
        cpu.0,
        cpu.1,
        self1.1 - self0.1,
        self1.2 - self0.2
    );
    Ok((t, link, rr, cpu, host_cpu))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The median row of one method at one size over its rounds: median save and restore time
/// (each on its own), the link bytes of the round nearest each median.
fn median_row(rs: &[&Row]) -> Row {
    let save_s = median(rs.iter().map(|r| r.save_s).collect());
    let restore_s = median(rs.iter().map(|r| r.restore_s).collect());
    let near = |f: &dyn Fn(&Row) -> f64, m: f64| {
        *rs.iter().min_by(|a, b| (f(a) - m).abs().total_cmp(&(f(b) - m).abs())).unwrap()
    };
    let (sr, rr) = (near(&|r| r.save_s, save_s), near(&|r| r.restore_s, restore_s));
    let mut codecs: Vec<&str> = rs.iter().map(|r| r.codec.as_str()).collect();
    codecs.sort();
    codecs.dedup();
    Row {
        round: None,
        save_s,
        restore_s,
        stored_bytes: median(rs.iter().map(|r| r.stored_bytes as f64).collect()) as u64,
        save_link: sr.save_link,
        restore_link: rr.restore_link,
        restore_cpu: rr.restore_cpu,
        save_cpu: sr.save_cpu,
        codec: codecs.join("+"),
        verified: rs.iter().all(|r| r.verified),
        ..rs[0].clone()
    }
}

/// strata's cells (save or restore at one size, in one round or the medians) that were
/// slower than the best QEMU stream of the same rows: (mem, round, what, ratio).
fn slower_cells(rows: &[Row]) -> Vec<(u32, Option<u32>, &'static str, f64)> {
    let mut out = Vec::new();
    for s in rows.iter().filter(|r| r.method == "strata") {
        let peers = || {
            rows.iter()
                .filter(|r| r.mem_mib == s.mem_mib && r.round == s.round && r.method != "strata")
        };
        let best_save = peers().map(|r| r.save_s).fold(f64::MAX, f64::min);
        let best_restore = peers().map(|r| r.restore_s).fold(f64::MAX, f64::min);
        if s.save_s > best_save {
            out.push((s.mem_mib, s.round, "save", s.save_s / best_save));
        }
        if s.restore_s > best_restore {
            out.push((s.mem_mib, s.round, "restore", s.restore_s / best_restore));
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
pub fn bench_save_restore_remote(
    sizes: &[u32],
    mach: &str,
    workers: usize,
    codec: CodecPolicy,
    rounds: u32,
    warm_memory: bool,
    cold_maps: bool,
    mix: &WorkloadMix,
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
    anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
    let m = machine(mach)?;
    let tmp = scratch_dir(scratch)?;
    let fx = Fixtures::ensure()?;
    for t in ["zstd", "lzop", "bash"] {
        crate::disk::ensure_tool(t)?;
    }
    let host = StorageHost::up(tmp.path())?;
    host.warm_s3(WARM_S3_MIB).context("warming up the storage host's S3 server")?;
    let probe = crate::hostmem::probe();
    eprintln!(
        "host memory: touching fresh memory costs {:.2} ms/MiB after a pause, {:.2} ms/MiB right after a free; {}",
        probe.after_pause_ms_per_mib,
        probe.right_after_free_ms_per_mib,
        if warm_memory { "every timed step is preceded by a warm (--no-warm to measure without)" } else { "no warm (--no-warm)" }
    );
    let mut round_rows: Vec<Row> = Vec::new();
    let mut reports: Vec<serde_json::Value> = Vec::new();
    let mut workloads = Vec::new();
    let mut port = 7100u16;
    for &mem in sizes {
        let dir = tmp.path().join(format!("m{mem}"));
        std::fs::create_dir_all(&dir)?;
        eprintln!("bench save-restore --remote: {mem} MiB guest ({mach})");
        let (g, w, mut q) = workload_guest(&fx, mem, m, &format!("sr{mem}"), mix)?;
        let warm = warm_mib(mem, warm_memory);
        for round in 0..rounds {
            // The four methods take turns at going first, in the saves and in the restores:
            // whatever state one leaves the host in (page cache, a guest just resumed) falls
            // on each in turn.
            let order: Vec<usize> = (0..4).map(|k| (k + round as usize) % 4).collect();
            if rounds > 1 {
                eprintln!("  round {} of {rounds}", round + 1);
            }
            let prefix = format!("sr-{mem}-{round}");
            let mut stream_saved: Vec<Option<StreamSaved>> = (0..3).map(|_| None).collect();
            let mut st = None;
            for &k in &order {
                if k == 3 {
                    st = Some(strata_save(&host, &mut q, &dir, &prefix, codec, warm)?);
                } else {
                    stream_saved[k] = Some(save_stream(&host, &mut q, mem, k, &mut port, warm)?);
                }
            }
            let streams: Vec<StreamSaved> =
                stream_saved.into_iter().map(|s| s.expect("saved")).collect();
            let st = st.expect("saved");
            let mut stream_restored: Vec<Option<(f64, Link, RestoreCpu)>> = vec![None; 3];
            let mut sr = None;
            for &k in &order {
                if k == 3 {
                    sr = Some(strata_restore(&host, &st, &g, &dir, &w, workers, warm, cold_maps)?);
                } else {
                    stream_restored[k] =
                        Some(restore_stream(&host, &g, &dir, &streams[k], &mut port, warm)?);
                }
            }
            let restored: Vec<(f64, Link, RestoreCpu)> =
                stream_restored.into_iter().map(|r| r.expect("restored")).collect();
            let (t, restore_link, rr, restore_cpu, host_cpu) = sr.expect("restored");
            let (cat_save, cat_restore) = (streams[0].save_s, restored[0].0);
            for (s, (rt, rl, rc)) in streams.iter().zip(&restored) {
                round_rows.push(Row {
                    mem_mib: mem,
                    round: Some(round),
                    method: s.name.to_string(),
                    save_s: s.save_s,
                    restore_s: *rt,
                    stored_bytes: s.bytes,
                    save_link: s.link,
                    restore_link: *rl,
                    save_vs_cat: s.save_s / cat_save,
                    restore_vs_cat: rt / cat_restore,
                    codec: s.name.trim_start_matches("exec:").to_string(),
                    verified: false,
                    restore_cpu: *rc,
                    save_cpu: s.cpu,
                });
            }
            round_rows.push(Row {
                mem_mib: mem,
                round: Some(round),
                method: "strata".into(),
                save_s: st.save_s,
                restore_s: t,
                stored_bytes: st.object_bytes,
                save_link: st.link,
                restore_link,
                save_vs_cat: st.save_s / cat_save,
                restore_vs_cat: t / cat_restore,
                codec: st.report.codec.chosen.to_string(),
                verified: true,
                restore_cpu: host_cpu,
                save_cpu: st.host_cpu,
            });
            reports.push(serde_json::json!({
                "mem_mib": mem, "round": round, "save": st.report, "save_fsync_s": st.fsync_s, "save_rss_mb": {"before": st.rss_mb.0, "peak": st.rss_mb.1}, "save_objects_synced_live": st.synced_live, "restore": rr,
                "cpu_s": {"save_versitygw": st.cpu.0, "save_strata": st.cpu.1, "save_strata_sys": st.sys, "save_strata_faults": st.faults, "restore_versitygw": restore_cpu.0, "restore_strata": restore_cpu.1},
            }));
            drop(st);
            std::fs::remove_dir_all(host.bucket_dir().join(&prefix)).ok();
        }
        workloads.push(serde_json::json!({"mem_mib": mem, "workload": w}));
        drop(g);
        std::fs::remove_dir_all(&dir).ok();
    }
    drop(host);

    // The reported rows: per size and method, the median over the rounds.
    let names = ["exec:cat", "exec:zstd -1", "exec:lzop", "strata"];
    let mut rows: Vec<Row> = Vec::new();
    for &mem in sizes {
        for n in names {
            let rs: Vec<&Row> =
                round_rows.iter().filter(|r| r.mem_mib == mem && r.method == n).collect();
            rows.push(median_row(&rs));
        }
        let (cat_save, cat_restore) = {
            let c = rows.iter().find(|r| r.mem_mib == mem && r.method == "exec:cat").unwrap();
            (c.save_s, c.restore_s)
        };
        for r in rows.iter_mut().filter(|r| r.mem_mib == mem) {
            r.save_vs_cat = r.save_s / cat_save;
            r.restore_vs_cat = r.restore_s / cat_restore;
        }
    }
    let slower_median = slower_cells(&rows);
    let slower_rounds = slower_cells(&round_rows);
    let cells = sizes.len() * 2;
    if rounds > 1 {
        eprintln!("  medians of {rounds} rounds:");
        for r in &rows {
            eprintln!(
                "  {:>5} MiB {:<14} save {:>6.3} s  restore {:>6.3} s  {:>6.0} MB stored",
                r.mem_mib,
                r.method,
                r.save_s,
                r.restore_s,
                mb(r.stored_bytes)
            );
        }
    }
    for (mem, round, what, ratio) in &slower_rounds {
        eprintln!(
            "  slower than the best stream: {mem} MiB {what}, round {}: {ratio:.3} of its time",
            round.map_or(0, |r| r + 1)
        );
    }
    eprintln!(
        "  strata slower than the best stream: {} of {cells} cells by median, {} of {} cells in single rounds",
        slower_median.len(),
        slower_rounds.len(),
        cells * rounds as usize
    );

    // Targets at the largest size: saves 2x and restores 1.8x as fast as exec:cat.
    let big = *sizes.iter().max().unwrap_or(&0);
    let at = |meth: &str| rows.iter().find(|r| r.mem_mib == big && r.method == meth);
    let mut targets = serde_json::Value::Null;
    if let (Some(c), Some(s)) = (at("exec:cat"), at("strata")) {
        let best = |mem: u32, f: &dyn Fn(&Row) -> f64| {
            rows.iter()
                .filter(|r| r.mem_mib == mem && r.method != "strata")
                .map(f)
                .fold(f64::MAX, f64::min)
        };
        let never_slower = slower_median.is_empty();
        let (best_save, best_restore) = (best(big, &|r| r.save_s), best(big, &|r| r.restore_s));
        let cell = |c: &(u32, Option<u32>, &str, f64)| serde_json::json!({"mem_mib": c.0, "round": c.1, "what": c.2, "vs_best_stream": c.3});
        targets = serde_json::json!({
            "mem_mib": big,
            "rounds": rounds,
            "save_speedup_vs_raw": c.save_s / s.save_s, "save_target": 2.0,
            "restore_speedup_vs_raw": c.restore_s / s.restore_s, "restore_target": 1.8,
            "save_vs_best_qemu_stream": s.save_s / best_save,
            "restore_vs_best_qemu_stream": s.restore_s / best_restore,
            "never_slower_than_best_stream_at_any_size": never_slower,
            "slower_cells_by_median": slower_median.iter().map(cell).collect::<Vec<_>>(),
            "slower_cells_in_single_rounds": slower_rounds.iter().map(cell).collect::<Vec<_>>(),
            "cells_per_round": cells,
        });
        eprintln!(
            "  {big} MiB: strata saves {:.2}x and restores {:.2}x faster than exec:cat over the link (targets 2x, 1.8x); vs best stream: save {:.2}, restore {:.2} of its time; never slower at any size{}: {never_slower}",
            c.save_s / s.save_s,
            c.restore_s / s.restore_s,
            s.save_s / best_save,
            s.restore_s / best_restore,
            if rounds > 1 { " (medians)" } else { "" }
        );
    }
    for &mem in sizes {
        let load = |m: &str| {
            median(
                round_rows
                    .iter()
                    .filter(|r| r.mem_mib == mem && r.method == m)
                    .map(|r| r.save_cpu.load())
                    .collect(),
            )
        };
        eprintln!(
            "  {mem} MiB: host CPU busy during saves (median share of both cores): exec:zstd -1 {:.2}, strata {:.2}",
            load("exec:zstd -1"),
            load("strata")
        );
    }
    let mut csv = String::from("mem_mib,round,method,codec,save_s,restore_s,stored_bytes,save_link_bytes,restore_link_bytes,save_vs_cat,restore_vs_cat,verified\n");
    for r in rows.iter().chain(&round_rows) {
        csv += &format!(
            "{},{},{},{},{:.3},{:.3},{},{},{},{:.3},{:.3},{}\n",
            r.mem_mib,
            r.round.map_or("median".to_string(), |n| (n + 1).to_string()),
            r.method,
            r.codec,
            r.save_s,
            r.restore_s,
            r.stored_bytes,
            r.save_link.total(),
            r.restore_link.total(),
            r.save_vs_cat,
            r.restore_vs_cat,
            r.verified
        );
    }
    let json = serde_json::json!({
        "benchmark": "save-restore-remote",
        "command": format!(
            "strata-bench save-restore --remote --sizes {} --machine {mach} --rounds {rounds}{}{}{}{}",
            sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","),
            if codec == CodecPolicy::Auto { String::new() } else { format!(" --codec {codec}") },
            if warm_memory { "" } else { " --no-warm" },
            if cold_maps { " --cold-maps" } else { "" },
            if *mix == WorkloadMix::DESKTOP { String::new() } else { format!(" --workload {mix}") }
        ),
        "page_maps": if cold_maps {
            "cold: this host's copies of the page maps and of the ref were deleted before every strata restore, so the maps crossed the link, after the ref, as on a host that did not save the checkpoint"
        } else {
            "local: the restoring host is the one that saved, and reads the page maps from its tree cache and plans from its copy of the ref while it fetches the ref (the pages still all cross the link); --cold-maps measures a host without them"
        },
        "link": "veth pair into a network namespace (the storage host), tbf rate 1gbit on both ends; versitygw 1.8 (S3, posix backend) there, run by scripts/storage-host.sh with --keep-alive, --data-integrity-etag, --io-buffer-size 65536 and GOGC=400",
        "how": "QEMU baselines: running guest, stop, migrate exec:'FILTER > /dev/tcp/storage/PORT' (FILTER = cat, zstd -1 -q, lzop -c, run on this host), a thread in the storage host's namespace writes the stream to a file, starting its writeback every 4 MiB, and fsyncs it; save time = stop (included) to fsync, as strata's clock includes its own stop. Restore: fresh QEMU -incoming defer, migrate-incoming exec:'DECODER < /dev/tcp/storage/PORT', time to completed. strata: vm save (stop-and-copy, adaptive codec) into a fresh store on the storage host's S3 without SSD cache; versitygw does not fsync, so as a durable server would, the harness starts the writeback of objects as they arrive (every 4 MiB the server receives, as for the streams), a watcher fsyncs each object as it lands (inotify), and at the commit, on the save's clock, the harness waits for the watcher and fsyncs every object file the watcher did not sync or that changed since; directories are fsynced too, and the relay's directory, only where a file's fsync does not make its name durable (not on ext4, where the storage host is); strata's stored bytes are its objects' sizes on the storage host (packs with their entry tables, and the ref); restore reads every page through the link (no SSD cache; the page maps from this host's tree cache unless --cold-maps, see page_maps), verified, and the resumed guest's memwork sum is compared. Each round saves and restores with every method on the same running guest, the methods taking turns at going first (round r starts with method r mod 4 of cat, zstd -1, lzop, strata, in the saves and in the restores); before every timed step the harness warms host memory (see host_memory); `rows` are the medians over the rounds, `round_rows` every round",
        "link_bytes": "veth counters of the host end, both directions, Ethernet frames",
        "save_cpu": "per row, the host's CPU from a save's start until it was durable: host_busy_s, what every task ran (the root cgroup's cpuacct.usage, in ns; /proc/stat ticks where that is missing), against host_avail_s, wall time x cores; the storage host's server and the relay share these cores",
        "rounds": rounds,
        "host_memory": {
            "probe": probe,
            "warm_mib_per_step": sizes.iter().map(|&m| serde_json::json!({"mem_mib": m, "warm_mib": warm_mib(m, warm_memory)})).collect::<Vec<_>>(),
            "settle_ms": if warm_memory { crate::hostmem::SETTLE_MS } else { 0 },
            "quiet_ms": if warm_memory { crate::hostmem::QUIET_MS } else { 0 },
            "method": "before every timed save and restore, of every method, outside the clock: hold warm_mib (4x the guest's RAM, capped at 2048 MiB, + 64 MiB) of touched memory for quiet_ms, free it, wait settle_ms, then start the step; the memory is taken back right after the step's clock stops. These hosts are VMs with free page reporting (memory free for ~1 s costs an outer fault per page when next touched; probe: ms per MiB after a pause and right after a free), and a bare-metal KVM host has no such cost. --no-warm turns it off",
        },
        "restore_workers": workers,
        "codec_policy": codec.to_string(),
        "restore_read_bytes": RESTORE_READ_BYTES,
        "targets": targets,
        "workloads": workloads,
        "strata_reports": reports,
        "env": env_json(),
        "rows": rows,
        "round_rows": round_rows,
    });
    let cats: Vec<String> = sizes.iter().map(|s| format!("{s} MiB")).collect();
    let series = |f: &dyn Fn(&Row) -> f64| -> Vec<Series> {
        names
            .iter()
            .map(|n| Series {
                name: n.to_string(),
                values: sizes
                    .iter()
                    .map(|s| {
                        rows.iter()
                            .find(|r| r.mem_mib == *s && r.method == *n)
                            .map(f)
                            .unwrap_or(0.0)
                    })
                    .collect(),
            })
            .collect()
    };
    let med = if rounds > 1 { format!(", median of {rounds} rounds") } else { String::new() };
    let svg = stack(vec![
        bars(
            &format!("Save over 1 Gbit/s to the storage host (durable), seconds{med}"),
            "seconds",
            &cats,
            &series(&|r| r.save_s),
        ),
        bars(
            &format!("Restore over 1 Gbit/s from the storage host, seconds{med}"),
            "seconds",
            &cats,
            &series(&|r| r.restore_s),
        ),
        bars(
            "Stored bytes on the storage host",
            "MB",
            &cats,
            &series(&|r| r.stored_bytes as f64 / 1e6),
        ),
    ]);
    write_outputs(out, &results_name("save-restore-remote", mix), csv, &json, svg)
}

// ---------------------------------------------------------------------------------------------
// bench live --redis
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, serde::Serialize)]
struct LiveRow {
    #[serde(flatten)]
    cost: CheckpointCost,
    link_bytes: u64,
    /// The two directions of `link_bytes`: uploads, and what the checkpoint read back.
    link_to_storage: u64,
    link_from_storage: u64,
    codec: String,
    /// Base chunks read for delta pages (a checkpoint with a base).
    delta_reads: Option<strata::memory::delta::DeltaReads>,
    delta_pages: u64,
}

impl std::ops::Deref for LiveRow {
    type Target = CheckpointCost;
    fn deref(&self) -> &CheckpointCost {
        &self.cost
    }
}

fn redis_store(host: &StorageHost, prefix: &str, local: &Path) -> Result<Store> {
    let b = open_location(
        &format!("{}?prefix={prefix}", host.redis_url),
        Some(RetryPolicy::default()),
    )?;
    StorageHost::init_store(b, local, Codec::Lz4)
}

/// Remove every key of a store (Redis keeps them in RAM).
fn wipe(store: Store) -> Result<()> {
    let b = store.backend().clone();
    drop(store);
    for o in b.list("")? {
        b.delete(&o.key)?;
    }
    Ok(())
}

pub fn bench_live_redis(mem: u32, rates: &[u32], out: &Path, scratch: Option<&Path>) -> Result<()> {
    let tmp = scratch_dir(scratch)?;
    let fx = Fixtures::ensure()?;
    let host = StorageHost::up(tmp.path())?;
    eprintln!("bench live --redis: {mem} MiB guest, dirtying at {rates:?} MiB/s, pages in Redis on the storage host");
    let (mut g, w, mut q) = desktop_guest(&fx, mem, Machine::Pc, "live")?;
    let mut rows: Vec<LiveRow> = Vec::new();
    let mut n = 0;
    let row = |rate: u32, label: &str, r: &SaveReport, link: Link, written: u64| LiveRow {
        cost: CheckpointCost::of(rate, label, r, written),
        link_bytes: link.total(),
        link_to_storage: link.to_storage,
        link_from_storage: link.from_storage,
        codec: r.codec.chosen.to_string(),
        delta_reads: r.delta_reads.clone(),
        delta_pages: r.delta.as_ref().map_or(0, |d| d.pages),
    };
    let print = |lr: &LiveRow, label: &str| {
        eprintln!(
            "  {:>4} MiB/s {label:<20} pause {:>8.1} ms  total {:>7.0} ms  sent {:>7}  stored {:>7}  dedup {:>7}  link {:>5.0} MB ({:.0} up, {:.0} down)  codec {}  ({} dirtied){}",
            lr.rate_mib_s,
            lr.pause_ms,
            lr.total_ms,
            lr.pages_sent,
            lr.pages_stored,
            lr.pages_deduped,
            mb(lr.link_bytes),
            mb(lr.link_to_storage),
            mb(lr.link_from_storage),
            lr.codec,
            lr.guest_pages_dirtied,
            lr.delta_reads.as_ref().map_or(String::new(), |d| format!(
                "; {} delta pages, base chunks read {} ({} from frames already read), {} frames / {:.1} MB from Redis",
                lr.delta_pages,
                d.chunks,
                d.frame_hits,
                d.frames_read,
                mb(d.bytes_read)
            ))
        )
    };
    for &rate in rates {
        let mut bg_store: Option<Store> = None;
        for (label, mode) in LIVE_MODES {
            n += 1;
            let store =
                redis_store(&host, &format!("live{n}"), &tmp.path().join(format!("meta{n}")))?;
            let l0 = host.link();
            let (r, written) = dirty_checkpoint(
                &mut g,
                &mut q,
                &store,
                "ckpt",
                mode,
                rate,
                rate,
                Duration::from_secs(1),
            )
            .with_context(|| format!("{label} into Redis"))?;
            let lr = row(rate, label, &r, host.link().since(l0), written);
            print(&lr, label);
            rows.push(lr);
            if mode == Mode::BackgroundSnapshot {
                bg_store = Some(store);
            } else {
                wipe(store)?;
            }
        }
        if let Some(store) = bg_store {
            let l0 = host.link();
            let (r, written) = dirty_checkpoint(
                &mut g,
                &mut q,
                &store,
                "ckpt2",
                Mode::BackgroundSnapshot,
                rate,
                rate + 1000,
                Duration::from_secs(5),
            )?;
            let lr =
                row(rate, "2nd background-snapshot (+5 s)", &r, host.link().since(l0), written);
            print(&lr, "2nd bg-snapshot");
            rows.push(lr);
            wipe(store)?;
        }
    }
    drop(g);
    drop(host);
    let mut csv = String::from("rate_mib_s,method,pause_ms,total_ms,pages_sent,pages_stored,pages_deduped,zero_pages,stored_bytes,link_bytes,link_to_storage,link_from_storage,guest_pages_dirtied,codec,delta_pages,base_chunks_read,base_frames_read,base_bytes_read\n");
    for r in &rows {
        let d = r.delta_reads.clone().unwrap_or_default();
        csv += &format!(
            "{},{},{:.2},{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            r.rate_mib_s,
            r.method,
            r.pause_ms,
            r.total_ms,
            r.pages_sent,
            r.pages_stored,
            r.pages_deduped,
            r.zero_pages,
            r.stored_bytes,
            r.link_bytes,
            r.link_to_storage,
            r.link_from_storage,
            r.guest_pages_dirtied,
            r.codec,
            r.delta_pages,
            d.chunks,
            d.frames_read,
            d.bytes_read
        );
    }
    let json = serde_json::json!({
        "benchmark": "live-redis",
        "command": format!("strata-bench live --redis --mem {mem} --rates {}", rates.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")),
        "how": "as `strata-bench live`, but every checkpoint goes into a fresh store on the storage host's Redis (appendonly, appendfsync always: every acknowledged SET is fsynced), 8 MiB packs, through the 1 Gbit/s link; link_bytes = veth counters, both directions. The '2nd background-snapshot' row is a second checkpoint 5 s later into the first snapshot's store (incremental cost)",
        "workload": w,
        "env": env_json(),
        "rows": rows,
    });
    let cats: Vec<String> =
        rows.iter().map(|r| format!("{} @{}", r.method, r.rate_mib_s)).collect();
    let svg = stack(vec![
        bars(
            "Guest pause per checkpoint into Redis over 1 Gbit/s",
            "ms",
            &cats,
            &[Series { name: "pause".into(), values: rows.iter().map(|r| r.pause_ms).collect() }],
        ),
        bars(
            "Total checkpoint time",
            "ms",
            &cats,
            &[Series { name: "total".into(), values: rows.iter().map(|r| r.total_ms).collect() }],
        ),
        bars(
            "Pages per checkpoint",
            "pages",
            &cats,
            &[
                Series {
                    name: "sent".into(),
                    values: rows.iter().map(|r| r.pages_sent as f64).collect(),
                },
                Series {
                    name: "stored".into(),
                    values: rows.iter().map(|r| r.pages_stored as f64).collect(),
                },
                Series {
                    name: "skipped by dedup".into(),
                    values: rows.iter().map(|r| r.pages_deduped as f64).collect(),
                },
            ],
        ),
    ]);
    write_outputs(out, "live-redis", csv, &json, svg)
}

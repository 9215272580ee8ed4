//! `strata-bench storm`: N guests boot at once from clones of a golden image
//! kept on a storage host behind a 1 Gbit/s link, and the same boot replayed as a block trace.
//!
//! Setup, all made and removed by the benchmark:
//! - The storage host: `scripts/storage-host.sh` (network namespace, versitygw + redis, veth
//!   shaped with tbf to 1 Gbit/s), through the remote benchmarks' driver
//!   (`remote::StorageHost`), with this benchmark's own namespace name and subnet.
//! - Host A (its own metadata directory) imports the golden image into the S3 bucket there.
//! - The qcow2 baseline: the golden image as qcow2 on the storage host, served by qemu-nbd
//!   inside the namespace over TCP; every guest gets its own qcow2 overlay on this host whose
//!   backing file is that nbd:// URL (the nearest thing to a golden image on NFS).
//! - Each strata run uses a fresh "host B": new metadata directory, new (cold) SSD cache,
//!   same bucket. It makes N linked clones and serves them over NBD in this process.
//!
//! Measured per (mode, N): time from launching N guests together to the last one printing
//! `STRATA-READY` (each reads its boot working set first), and the bytes that crossed the
//! link (the host end's veth counters, so TCP/IP and HTTP overhead included).
//! The trace part records one guest's boot through `boot::TracingExports`, stores it as
//! `bench-storm-trace.csv` and as the golden image's working set in the bucket, then replays
//! its reads with N concurrent NBD clients against each mode (no guest CPU in the way). One
//! extra guest row warms the cache with `disk warm`'s code path before the largest storm.
//! Fairness: at each N the modes take turns at going first, and before
//! every guest boot the host's memory is warmed outside the clock (`hostmem`): these
//! hosts are VMs whose hypervisor takes back free memory, and N fresh guests' RAM otherwise
//! costs whichever mode boots first after a pause several CPU-seconds of outer faults.

use crate::chart::{bars, Series};
use crate::disk::ensure_tool;
use crate::remote::StorageHost;
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use strata::backend::cache::{CacheBackend, CacheOptions};
use strata::backend::DynBackend;
use strata::boot::{replay, workset, Recorder, Trace, TracingExports};
use strata::fixtures::{reply_field, Fixtures, GuestMode};
use strata::nbd::client::Target;
use strata::nbd::{ExportSet, Server};
use strata::progress::NoProgress;
use strata::serve::DiskExports;
use strata::store::{local_meta_path, InitOptions, Store};
use strata::{disk, Codec};

const NBD_PORT: u16 = 10809;
const GOLDEN: &str = "golden@base";

pub struct StormOpts {
    pub guests: Vec<usize>,
    pub memory_mib: u32,
    pub depth: usize,
    pub cache_size: u64,
    pub no_guests: bool,
    pub trace: Option<PathBuf>,
    pub ns: String,
    pub net: String,
    pub out: PathBuf,
    pub scratch: Option<PathBuf>,
}

/// Bytes received and sent by this host over the link so far.
fn counters(sh: &StorageHost) -> (u64, u64) {
    let l = sh.link();
    (l.from_storage, l.to_storage)
}

/// A process we started, killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_tcp(addr: &str, what: &str) -> Result<()> {
    let a: std::net::SocketAddr = addr.parse()?;
    let t = Instant::now();
    while std::net::TcpStream::connect_timeout(&a, Duration::from_millis(200)).is_err() {
        ensure!(t.elapsed().as_secs() < 30, "{what} did not start on {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A strata host on the bucket: its own metadata directory and, optionally, a cold cache.
struct Host {
    store: Store,
    cache: Option<Arc<CacheBackend>>,
}

fn open_host(sh: &StorageHost, dir: &Path, cache_size: Option<u64>, init: bool) -> Result<Host> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let s3 = sh.s3_backend("storm")?;
    let cache = match cache_size {
        Some(size) => Some(Arc::new(CacheBackend::open(
            s3.clone(),
            &dir.join("cache"),
            CacheOptions::new(size),
        )?)),
        None => None,
    };
    let backend: DynBackend = match &cache {
        Some(c) => c.clone(),
        None => s3,
    };
    let meta = local_meta_path(dir);
    let store = if init {
        Store::init(backend, &meta, InitOptions { pack_size: 64 << 20, default_codec: Codec::Lz4 })?
    } else {
        Store::open(backend, &meta)?
    };
    Ok(Host { store, cache })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// strata with a cold cache, served as `strata serve` does by default: the recorded
    /// working set is prefetched in the background when the first clone is opened.
    Cache,
    /// strata with a cold cache and `serve --no-prefetch`: demand misses only.
    CacheNoPrefetch,
    NoCache,
    Qcow2,
    /// strata with the cache, warmed with the recorded working set before the storm.
    Warm,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Cache => "strata+cache (cold, prefetch)",
            Mode::CacheNoPrefetch => "strata+cache, no prefetch",
            Mode::NoCache => "strata, no cache",
            Mode::Qcow2 => "qemu-nbd qcow2 + overlays",
            Mode::Warm => "strata+cache, warmed",
        }
    }
    fn tag(self) -> &'static str {
        match self {
            Mode::Cache => "c",
            Mode::CacheNoPrefetch => "p",
            Mode::NoCache => "n",
            Mode::Qcow2 => "q",
            Mode::Warm => "w",
        }
    }
}

#[derive(serde::Serialize, Clone, Copy, Default)]
struct CacheFigures {
    hits: u64,
    misses: u64,
    coalesced: u64,
    bytes_from_backend: u64,
}

#[derive(serde::Serialize, Clone)]
struct GuestRow {
    mode: String,
    guests: usize,
    all_ready_s: f64,
    mean_ready_s: f64,
    mean_bootset_ms: f64,
    max_bootset_ms: u64,
    link_rx_bytes: u64,
    link_tx_bytes: u64,
    cache: Option<CacheFigures>,
    warm_s: Option<f64>,
    warm_link_rx_bytes: Option<u64>,
}

#[derive(serde::Serialize, Clone)]
struct ReplayRow {
    mode: String,
    clients: usize,
    all_done_s: f64,
    mean_s: f64,
    /// Launching the clients to the common start (connecting opens the exports; with prefetch
    /// on, the prefetch starts then).
    connect_s: f64,
    bytes_per_client: u64,
    link_rx_bytes: u64,
    link_tx_bytes: u64,
    cache: Option<CacheFigures>,
    /// The background prefetch of the working set (strata+cache with prefetch only).
    prefetch: Option<strata::boot::PrefetchStatus>,
    /// Digest of the bytes read, equal for every client (else None).
    digest: Option<String>,
}

fn cache_delta(
    c: &Option<Arc<CacheBackend>>,
    before: &Option<strata::backend::cache::CacheCounters>,
) -> Option<CacheFigures> {
    let (c, b) = (c.as_ref()?, before.as_ref()?);
    let a = c.counters();
    Some(CacheFigures {
        hits: a.hits - b.hits,
        misses: a.misses - b.misses,
        coalesced: a.coalesced - b.coalesced,
        bytes_from_backend: a.bytes_from_backend() - b.bytes_from_backend(),
    })
}

struct Ctx<'a> {
    fx: &'a Fixtures,
    sh: &'a StorageHost,
    scratch: &'a Path,
    opts: &'a StormOpts,
    run: usize,
}

/// Launch `drives.len()` guests at once; returns each one's (seconds to ready, bootset_ms).
fn boot_guests(ctx: &Ctx, drives: &[Drive]) -> Result<Vec<(f64, u64)>> {
    // Outside the clock, for every mode alike: the guests' RAM comes from backed memory.
    crate::hostmem::warm_host(crate::hostmem::warm_mib(
        drives.len() as u32 * ctx.opts.memory_mib,
        true,
    ));
    let barrier = Barrier::new(drives.len());
    let t0 = std::sync::OnceLock::new();
    let results: Vec<Result<(f64, u64, strata::fixtures::Guest)>> = std::thread::scope(|s| {
        let hs: Vec<_> = drives
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let (barrier, t0) = (&barrier, &t0);
                let mut b = ctx
                    .fx
                    .guest()
                    .mode(GuestMode::Root)
                    .memory_mib(ctx.opts.memory_mib)
                    .ready_timeout(Duration::from_secs(1200))
                    .name(&format!("storm{i}"));
                b = match d {
                    Drive::Nbd(sock, export) => b.drive_nbd_unix(sock, export),
                    Drive::Qcow2(path) => b.drive_file(path, "qcow2"),
                };
                s.spawn(move || -> Result<(f64, u64, strata::fixtures::Guest)> {
                    barrier.wait();
                    let start: &Instant = t0.get_or_init(Instant::now);
                    let g = b.launch().context("guest did not boot")?;
                    let secs = start.elapsed().as_secs_f64();
                    let line = g.ready_line().unwrap_or_default().to_string();
                    ensure!(
                        reply_field(&line, "bootset_rc") == Some("0"),
                        "guest could not read its boot working set: {line}"
                    );
                    let ms =
                        reply_field(&line, "bootset_ms").and_then(|v| v.parse().ok()).unwrap_or(0);
                    Ok((secs, ms, g))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("guest thread panicked"))))
            .collect()
    });
    let mut out = Vec::new();
    let mut guests = Vec::new();
    for r in results {
        let (s, ms, g) = r?;
        out.push((s, ms));
        guests.push(g);
    }
    drop(guests); // kills QEMU
    Ok(out)
}

enum Drive {
    Nbd(PathBuf, String),
    Qcow2(PathBuf),
}

/// One strata storm or replay: fresh host B, `n` clones, served in this process.
fn strata_run(
    ctx: &mut Ctx,
    mode: Mode,
    n: usize,
    reads: Option<(&[(u64, u64)], usize)>,
) -> Result<(Option<GuestRow>, Option<ReplayRow>)> {
    ctx.run += 1;
    let dir = ctx.scratch.join(format!("host-b-{}", ctx.run));
    let cached = mode != Mode::NoCache;
    let host = open_host(ctx.sh, &dir, cached.then_some(ctx.opts.cache_size), false)?;
    let names: Vec<String> = (0..n).map(|i| format!("r{}-{}{i}", ctx.run, mode.tag())).collect();
    for name in &names {
        disk::clone(&host.store, GOLDEN, name, false)?;
    }
    let (mut warm_s, mut warm_rx) = (None, None);
    if mode == Mode::Warm {
        let (rx0, _) = counters(ctx.sh);
        let rep = workset::warm(&host.store, GOLDEN, 16)?;
        warm_s = Some(rep.secs);
        warm_rx = Some(counters(ctx.sh).0 - rx0);
        eprintln!(
            "    warm: {} chunks, {} ranges, {:.1} MiB from S3 in {:.2} s",
            rep.chunks,
            rep.ranges,
            rep.backend_bytes as f64 / 1048576.0,
            rep.secs
        );
    }
    let exports = DiskExports::new(host.store.clone());
    if mode != Mode::CacheNoPrefetch {
        exports.enable_prefetch(strata::boot::prefetch::DEFAULT_PARALLEL);
    }
    let sock = dir.join("nbd.sock");
    let handle = Server::bind_unix(&sock)?.serve(exports.clone())?;
    let before = host.cache.as_ref().map(|c| c.counters());
    let (rx0, tx0) = counters(ctx.sh);
    let result = match reads {
        None => {
            let drives: Vec<Drive> =
                names.iter().map(|nm| Drive::Nbd(sock.clone(), nm.clone())).collect();
            boot_guests(ctx, &drives).map(|r| (Some(guest_row(mode, n, &r)), None))
        }
        Some((reads, depth)) => {
            let clients: Vec<(Target, String)> =
                names.iter().map(|nm| (Target::Unix(sock.clone()), nm.clone())).collect();
            replay::replay(&clients, reads, depth)
                .map_err(anyhow::Error::from)
                .map(|r| (None, Some(replay_row(mode, n, &r))))
        }
    };
    let (rx1, tx1) = counters(ctx.sh);
    let figs = cache_delta(&host.cache, &before);
    let prefetch = exports.prefetches().into_iter().next();
    for p in exports.prefetches() {
        eprintln!(
            "    prefetch of {}: {}, {}/{} ranges, {:.1} MiB in {:.2} s",
            p.image,
            p.state,
            p.ranges_done,
            p.ranges,
            p.bytes_done as f64 / 1048576.0,
            p.secs
        );
    }
    handle.shutdown();
    exports.close_all()?;
    for name in &names {
        disk::remove(&host.store, name)?;
    }
    drop(host);
    let _ = std::fs::remove_dir_all(&dir);
    let (mut g, mut r) = result?;
    if let Some(g) = g.as_mut() {
        (g.link_rx_bytes, g.link_tx_bytes, g.cache, g.warm_s, g.warm_link_rx_bytes) =
            (rx1 - rx0, tx1 - tx0, figs, warm_s, warm_rx);
    }
    if let Some(r) = r.as_mut() {
        (r.link_rx_bytes, r.link_tx_bytes, r.cache, r.prefetch) =
            (rx1 - rx0, tx1 - tx0, figs, prefetch);
    }
    Ok((g, r))
}

fn guest_row(mode: Mode, n: usize, r: &[(f64, u64)]) -> GuestRow {
    GuestRow {
        mode: mode.label().into(),
        guests: n,
        all_ready_s: r.iter().map(|x| x.0).fold(0.0, f64::max),
        mean_ready_s: r.iter().map(|x| x.0).sum::<f64>() / n as f64,
        mean_bootset_ms: r.iter().map(|x| x.1 as f64).sum::<f64>() / n as f64,
        max_bootset_ms: r.iter().map(|x| x.1).max().unwrap_or(0),
        link_rx_bytes: 0,
        link_tx_bytes: 0,
        cache: None,
        warm_s: None,
        warm_link_rx_bytes: None,
    }
}

fn replay_row(mode: Mode, n: usize, r: &[replay::ClientRun]) -> ReplayRow {
    ReplayRow {
        mode: mode.label().into(),
        clients: n,
        all_done_s: r.iter().map(|x| x.secs).fold(0.0, f64::max),
        mean_s: r.iter().map(|x| x.secs).sum::<f64>() / n as f64,
        connect_s: r.iter().map(|x| x.connect_secs).fold(0.0, f64::max),
        bytes_per_client: r.first().map(|x| x.bytes).unwrap_or(0),
        link_rx_bytes: 0,
        link_tx_bytes: 0,
        cache: None,
        prefetch: None,
        digest: r
            .first()
            .filter(|a| r.iter().all(|b| b.digest == a.digest && b.bytes == a.bytes))
            .map(|a| format!("{:016x}", a.digest)),
    }
}

/// The qcow2 baseline: overlays on this host backed by qemu-nbd on the storage host.
fn qcow2_run(
    ctx: &mut Ctx,
    n: usize,
    reads: Option<(&[(u64, u64)], usize)>,
) -> Result<(Option<GuestRow>, Option<ReplayRow>)> {
    ctx.run += 1;
    let url = format!("nbd://{}:{NBD_PORT}/golden", ctx.sh.ip);
    let dir = ctx.scratch.join(format!("qcow2-{}", ctx.run));
    std::fs::create_dir_all(&dir)?;
    let (rx0, tx0) = counters(ctx.sh);
    let (g, r) = match reads {
        None => {
            let mut drives = Vec::new();
            for i in 0..n {
                let ovl = dir.join(format!("ovl{i}.qcow2"));
                let o = Command::new("qemu-img")
                    .args(["create", "-q", "-f", "qcow2", "-b", &url, "-F", "raw"])
                    .arg(&ovl)
                    .output()?;
                ensure!(
                    o.status.success(),
                    "qemu-img create overlay failed: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                drives.push(Drive::Qcow2(ovl));
            }
            // Creating overlays probes the backing file over the link: measure the boot only.
            let (rx0, tx0) = counters(ctx.sh);
            let mut row = guest_row(Mode::Qcow2, n, &boot_guests(ctx, &drives)?);
            let (rx1, tx1) = counters(ctx.sh);
            (row.link_rx_bytes, row.link_tx_bytes) = (rx1 - rx0, tx1 - tx0);
            (Some(row), None)
        }
        Some((reads, depth)) => {
            let addr: std::net::SocketAddr = format!("{}:{NBD_PORT}", ctx.sh.ip).parse()?;
            let clients: Vec<(Target, String)> =
                (0..n).map(|_| (Target::Tcp(addr), "golden".to_string())).collect();
            let runs = replay::replay(&clients, reads, depth)?;
            let mut row = replay_row(Mode::Qcow2, n, &runs);
            let (rx1, tx1) = counters(ctx.sh);
            (row.link_rx_bytes, row.link_tx_bytes) = (rx1 - rx0, tx1 - tx0);
            (None, Some(row))
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    Ok((g, r))
}

/// Boot one guest from a clone through the trace recorder; the trace ends at STRATA-READY.
fn record_trace(ctx: &mut Ctx) -> Result<Trace> {
    ctx.run += 1;
    let dir = ctx.scratch.join("host-trace");
    let host = open_host(ctx.sh, &dir, Some(ctx.opts.cache_size), false)?;
    disk::clone(&host.store, GOLDEN, "trace0", false)?;
    let rec = Recorder::new(&["trace0"]);
    let exports = DiskExports::new(host.store.clone());
    let set: Arc<dyn ExportSet> = TracingExports::new(exports.clone(), rec.clone());
    let sock = dir.join("nbd.sock");
    let handle = Server::bind_unix(&sock)?.serve(set)?;
    let g = ctx
        .fx
        .guest()
        .mode(GuestMode::Root)
        .memory_mib(ctx.opts.memory_mib)
        .ready_timeout(Duration::from_secs(600))
        .drive_nbd_unix(&sock, "trace0")
        .name("trace0")
        .launch();
    rec.stop();
    let g = g.context("the trace guest did not boot")?;
    eprintln!("  trace guest: {}", g.ready_line().unwrap_or_default());
    drop(g);
    handle.shutdown();
    exports.close_all()?;
    let trace = rec.trace();
    let ws = workset::from_trace(&host.store, GOLDEN, &trace)?;
    workset::save(&host.store, GOLDEN, &ws)?;
    eprintln!(
        "  working set of {GOLDEN}: {} chunks, saved as {}",
        ws.chunks.len(),
        workset::key(GOLDEN)
    );
    disk::remove(&host.store, "trace0")?;
    drop(host);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(trace)
}

pub fn bench_storm(o: &StormOpts) -> Result<()> {
    for t in ["qemu-system-x86_64", "qemu-img", "qemu-nbd", "ip", "tc"] {
        ensure_tool(t)?;
    }
    ensure!(unsafe { libc::geteuid() } == 0, "bench storm needs root (network namespace, tc)");
    ensure!(!o.guests.is_empty(), "--guests: give at least one count, e.g. 1,2,5,10");
    let fx = Fixtures::ensure()?;
    let tmp = match &o.scratch {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir())?,
    };
    let scratch = tmp.path();
    eprintln!(
        "bench storm: guests {:?}, {} MiB each, scratch {}",
        o.guests,
        o.memory_mib,
        scratch.display()
    );
    let sh = StorageHost::up_named(scratch, &o.ns, &o.net)?;

    // Host A imports the golden image into the bucket.
    let t = Instant::now();
    let (_, tx0) = counters(&sh);
    {
        let a = open_host(&sh, &scratch.join("host-a"), None, true)?;
        disk::import(&a.store, "golden", &fx.golden(), Codec::Lz4, &NoProgress)?;
        disk::snapshot(&a.store, "golden", "base")?;
        a.store.close()?;
    }
    let import_s = t.elapsed().as_secs_f64();
    let import_tx = counters(&sh).1 - tx0;
    eprintln!(
        "  host A imported {} in {import_s:.1} s ({:.0} MiB over the link)",
        fx.golden().display(),
        import_tx as f64 / 1048576.0
    );

    // The qcow2 golden image on the storage host, served by qemu-nbd there.
    let qcow = sh.dir().join("golden.qcow2");
    let st = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(fx.golden())
        .arg(&qcow)
        .status()?;
    ensure!(st.success(), "qemu-img convert failed");
    let ip = sh.ip.clone();
    let _qnbd = Proc(
        Command::new("ip")
            .args([
                "netns", "exec", &sh.ns, "qemu-nbd", "-f", "qcow2", "-r", "-t", "-e", "64", "-x",
                "golden", "-b", &ip, "-p",
            ])
            .arg(NBD_PORT.to_string())
            .arg(&qcow)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(scratch.join("qemu-nbd.log"))?)
            .spawn()
            .context("starting qemu-nbd in the storage namespace")?,
    );
    wait_tcp(&format!("{ip}:{NBD_PORT}"), "qemu-nbd")?;
    // The storage host's page cache holds both copies, as a busy file server's would.
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cat {}/golden.qcow2 $(find {}/s3 -type f) > /dev/null",
            sh.dir().display(),
            sh.dir().display()
        ))
        .status();

    let mut ctx = Ctx { fx: &fx, sh: &sh, scratch, opts: o, run: 0 };
    let trace = match &o.trace {
        Some(p) => {
            let t = Trace::parse_csv(
                &std::fs::read_to_string(p)
                    .with_context(|| format!("Cannot read {}", p.display()))?,
            )?;
            // The working set still comes from the trace, for the warm row.
            let h = open_host(&sh, &scratch.join("host-ws"), None, false)?;
            workset::save(&h.store, GOLDEN, &workset::from_trace(&h.store, GOLDEN, &t)?)?;
            t
        }
        None => record_trace(&mut ctx)?,
    };
    let sum = trace.summary();
    let reads = trace.reads();
    let mean_inflight = {
        let r: Vec<u32> = trace
            .records
            .iter()
            .filter(|r| r.op == strata::boot::trace::Op::Read)
            .map(|r| r.inflight)
            .collect();
        (r.iter().map(|&x| x as f64).sum::<f64>() / r.len().max(1) as f64).ceil() as usize
    };
    let depth = if o.depth == 0 { mean_inflight.max(1) } else { o.depth };
    eprintln!(
        "  trace: {} requests, {} reads ({:.1} MiB), {} writes, max {} in flight; replay depth {depth}",
        sum.requests, sum.reads, sum.read_bytes as f64 / 1048576.0, sum.writes, sum.max_inflight
    );
    std::fs::create_dir_all(&o.out)?;
    std::fs::write(o.out.join("bench-storm-trace.csv"), trace.to_csv())?;

    // Replay first (quick), then the guests; N outer so drift hits all modes alike, and the
    // modes take turns at going first (the first after a pause lands on host memory the
    // hypervisor took back, see `bench_hostmem`).
    let modes_at = |k: usize| {
        let mut m = [Mode::Cache, Mode::CacheNoPrefetch, Mode::NoCache, Mode::Qcow2];
        m.rotate_left(k % 4);
        m
    };
    let mut replays = Vec::new();
    for (k, &n) in o.guests.iter().enumerate() {
        for m in modes_at(k) {
            let (_, r) = match m {
                Mode::Qcow2 => qcow2_run(&mut ctx, n, Some((&reads, depth)))?,
                _ => strata_run(&mut ctx, m, n, Some((&reads, depth)))?,
            };
            let r = r.expect("replay row");
            eprintln!("  replay {:<28} N={n:<2} all done {:>6.2} s (+ {:.3} s connecting), link {:>7.1} MiB", r.mode, r.all_done_s, r.connect_s, r.link_rx_bytes as f64 / 1048576.0);
            replays.push(r);
        }
    }
    let mut guests = Vec::new();
    if !o.no_guests {
        for (k, &n) in o.guests.iter().enumerate() {
            for m in modes_at(k) {
                let (g, _) = match m {
                    Mode::Qcow2 => qcow2_run(&mut ctx, n, None)?,
                    _ => strata_run(&mut ctx, m, n, None)?,
                };
                let g = g.expect("guest row");
                eprintln!(
                    "  guests {:<28} N={n:<2} all ready {:>6.1} s, boot set {:>6.0} ms mean, link {:>7.1} MiB",
                    g.mode, g.all_ready_s, g.mean_bootset_ms, g.link_rx_bytes as f64 / 1048576.0
                );
                guests.push(g);
            }
        }
        let n = *o.guests.iter().max().expect("nonempty");
        let (g, _) = strata_run(&mut ctx, Mode::Warm, n, None)?;
        let g = g.expect("guest row");
        eprintln!(
            "  guests {:<28} N={n:<2} all ready {:>6.1} s, link {:>7.1} MiB (+ warm)",
            g.mode,
            g.all_ready_s,
            g.link_rx_bytes as f64 / 1048576.0
        );
        guests.push(g);
    }
    write_results(o, &fx, &trace, depth, import_s, &guests, &replays)?;
    drop(_qnbd);
    drop(sh);
    Ok(())
}

fn find<T>(rows: &[T], f: impl Fn(&T) -> bool) -> Option<&T> {
    rows.iter().find(|r| f(r))
}

fn write_results(
    o: &StormOpts,
    fx: &Fixtures,
    trace: &Trace,
    depth: usize,
    import_s: f64,
    guests: &[GuestRow],
    replays: &[ReplayRow],
) -> Result<()> {
    let nmax = *o.guests.iter().max().unwrap_or(&1);
    let nmin = *o.guests.iter().min().unwrap_or(&1);
    let mib = |b: u64| b as f64 / 1048576.0;
    // Headline figures.
    let g = |m: Mode, n: usize| find(guests, |r| r.mode == m.label() && r.guests == n);
    let r = |m: Mode, n: usize| find(replays, |r| r.mode == m.label() && r.clients == n);
    let bytes_ratio = match (g(Mode::Cache, nmax), g(Mode::Cache, nmin)) {
        (Some(a), Some(b)) => Some(a.link_rx_bytes as f64 / b.link_rx_bytes.max(1) as f64),
        _ => None,
    };
    let replay_bytes_ratio = match (r(Mode::Cache, nmax), r(Mode::Cache, nmin)) {
        (Some(a), Some(b)) => Some(a.link_rx_bytes as f64 / b.link_rx_bytes.max(1) as f64),
        _ => None,
    };
    let replay_speedup = match (r(Mode::NoCache, nmax), r(Mode::Cache, nmax)) {
        (Some(a), Some(b)) => Some(a.all_done_s / b.all_done_s),
        _ => None,
    };
    // The same with the connect phase counted (with prefetch on it starts there).
    let replay_speedup_incl_connect = match (r(Mode::NoCache, nmax), r(Mode::Cache, nmax)) {
        (Some(a), Some(b)) => Some((a.all_done_s + a.connect_s) / (b.all_done_s + b.connect_s)),
        _ => None,
    };
    let replay_speedup_no_prefetch = match (r(Mode::NoCache, nmax), r(Mode::CacheNoPrefetch, nmax))
    {
        (Some(a), Some(b)) => Some(a.all_done_s / b.all_done_s),
        _ => None,
    };
    let replay_prefetch_gain = match (r(Mode::CacheNoPrefetch, nmax), r(Mode::Cache, nmax)) {
        (Some(a), Some(b)) => Some(a.all_done_s / b.all_done_s),
        _ => None,
    };
    let replay_vs_qcow2 = match (r(Mode::Qcow2, nmax), r(Mode::Cache, nmax)) {
        (Some(a), Some(b)) => Some(a.all_done_s / b.all_done_s),
        _ => None,
    };
    let guest_speedup = match (g(Mode::NoCache, nmax), g(Mode::Cache, nmax)) {
        (Some(a), Some(b)) => Some(a.all_ready_s / b.all_ready_s),
        _ => None,
    };
    let guest_vs_qcow2 = match (g(Mode::Qcow2, nmax), g(Mode::Cache, nmax)) {
        (Some(a), Some(b)) => Some(a.all_ready_s / b.all_ready_s),
        _ => None,
    };
    let fmt = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "n/a".into());
    eprintln!(
        "  link bytes, strata+cache N={nmax} over N={nmin}: {} (target <= 1.2)",
        fmt(bytes_ratio)
    );
    eprintln!(
        "  replay N={nmax}: no cache / cache (prefetch) = {} (target >= 5), qcow2 / cache = {}",
        fmt(replay_speedup),
        fmt(replay_vs_qcow2)
    );
    eprintln!(
        "  replay N={nmax}, connecting included: no cache / cache (prefetch) = {}",
        fmt(replay_speedup_incl_connect)
    );
    eprintln!(
        "  replay N={nmax}: no cache / cache without prefetch = {}, no prefetch / prefetch = {}",
        fmt(replay_speedup_no_prefetch),
        fmt(replay_prefetch_gain)
    );
    eprintln!(
        "  replay link bytes, strata+cache N={nmax} over N={nmin}: {}",
        fmt(replay_bytes_ratio)
    );
    eprintln!(
        "  guests N={nmax}: no cache / cache = {}, qcow2 / cache = {}",
        fmt(guest_speedup),
        fmt(guest_vs_qcow2)
    );

    let cache_cols = |c: &Option<CacheFigures>| match c {
        Some(c) => format!("{},{},{},{}", c.hits, c.misses, c.coalesced, c.bytes_from_backend),
        None => ",,,".into(),
    };
    let mut csv = String::from("mode,guests,all_ready_s,mean_ready_s,mean_bootset_ms,max_bootset_ms,link_rx_mib,link_tx_mib,cache_hits,cache_misses,cache_coalesced,cache_backend_bytes,warm_s,warm_link_rx_mib\n");
    for x in guests {
        csv += &format!(
            "\"{}\",{},{:.2},{:.2},{:.0},{},{:.2},{:.2},{},{},{}\n",
            x.mode,
            x.guests,
            x.all_ready_s,
            x.mean_ready_s,
            x.mean_bootset_ms,
            x.max_bootset_ms,
            mib(x.link_rx_bytes),
            mib(x.link_tx_bytes),
            cache_cols(&x.cache),
            x.warm_s.map(|v| format!("{v:.2}")).unwrap_or_default(),
            x.warm_link_rx_bytes.map(|v| format!("{:.2}", mib(v))).unwrap_or_default()
        );
    }
    let mut rcsv = String::from("mode,clients,all_done_s,mean_s,connect_s,mib_per_client,link_rx_mib,link_tx_mib,cache_hits,cache_misses,cache_coalesced,cache_backend_bytes,digest\n");
    for x in replays {
        rcsv += &format!(
            "\"{}\",{},{:.3},{:.3},{:.3},{:.2},{:.2},{:.2},{},{}\n",
            x.mode,
            x.clients,
            x.all_done_s,
            x.mean_s,
            x.connect_s,
            mib(x.bytes_per_client),
            mib(x.link_rx_bytes),
            mib(x.link_tx_bytes),
            cache_cols(&x.cache),
            x.digest.as_deref().unwrap_or("MISMATCH")
        );
    }
    let guests_arg = o.guests.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let common = serde_json::json!({
        "storage_host": "scripts/storage-host.sh: netns + veth, tbf 1gbit both ways; versitygw v1.8.0 (posix) and qemu-nbd inside",
        "golden": {"image": fx.golden(), "bytes": std::fs::metadata(fx.golden()).map(|m| m.len()).unwrap_or(0), "host_a_import_s": import_s},
        "link_bytes": "host end of the veth (rx = storage -> host), includes TCP/IP and HTTP overhead",
        "env": crate::results::env_json(),
        "trace": {"file": "bench-storm-trace.csv", "summary": trace.summary(), "replay_depth": depth},
    });
    if !guests.is_empty() {
        let meta = serde_json::json!({
            "benchmark": "storm",
            "command": format!("strata-bench storm --guests {guests_arg} --memory {}", o.memory_mib),
            "method": "N TCG guests (-accel tcg, root on NBD or a qcow2 overlay) launched together; each mounts its clone, reads the boot working set (fixtures/bootset.txt) and prints STRATA-READY; time = launch to the last READY",
            "setup": common,
            "modes": {
                Mode::Cache.label(): "fresh host B (own metadata, cold SSD cache), N linked clones served over NBD in-process as `strata serve` does by default: opening the first clone starts the background prefetch of the recorded working set",
                Mode::CacheNoPrefetch.label(): "as strata+cache, with `serve --no-prefetch`: demand misses only",
                Mode::NoCache.label(): "fresh host B without the cache: every clone's misses go to S3",
                Mode::Qcow2.label(): "qemu-nbd -r serving golden.qcow2 inside the storage namespace over TCP; one qcow2 overlay per guest on this host, backing = nbd:// URL",
                Mode::Warm.label(): "as strata+cache, but the recorded working set was prefetched (disk warm) before launching; warm_s and warm_link_rx are its cost",
            },
            "results": {
                "link_bytes_cache_nmax_over_nmin": bytes_ratio,
                "all_ready_nocache_over_cache_nmax": guest_speedup,
                "all_ready_qcow2_over_cache_nmax": guest_vs_qcow2,
                "replay_all_done_nocache_over_cache_nmax": replay_speedup,
            },
            "rows": guests,
        });
        std::fs::write(o.out.join("bench-storm.csv"), csv)?;
        std::fs::write(o.out.join("bench-storm.json"), serde_json::to_string_pretty(&meta)?)?;
        let ns: Vec<usize> = o.guests.clone();
        let cats: Vec<String> = ns.iter().map(|n| format!("{n} guests")).collect();
        let series = |val: &dyn Fn(&GuestRow) -> f64| -> Vec<Series> {
            [Mode::Cache, Mode::CacheNoPrefetch, Mode::NoCache, Mode::Qcow2]
                .iter()
                .map(|m| Series {
                    name: m.label().into(),
                    values: ns.iter().map(|&n| g(*m, n).map(val).unwrap_or(0.0)).collect(),
                })
                .collect()
        };
        let svg = bars(
            "Boot storm: time until every guest is ready (s, lower is better)",
            "seconds",
            &cats,
            &series(&|r| r.all_ready_s),
        );
        std::fs::write(o.out.join("bench-storm.svg"), svg)?;
        let svg = bars(
            "Boot storm: MiB fetched over the 1 Gbit/s link (lower is better)",
            "MiB",
            &cats,
            &series(&|r| mib(r.link_rx_bytes)),
        );
        std::fs::write(o.out.join("bench-storm-bytes.svg"), svg)?;
    }
    let meta = serde_json::json!({
        "benchmark": "storm-replay",
        "command": format!("strata-bench storm --guests {guests_arg}"),
        "method": "the recorded boot's reads (bench-storm-trace.csv), in order, no think time, `replay_depth` in flight per client; N clients start together, each on its own clone (qemu-nbd: N connections to its one export); time = start to the last client's last reply; connect_s = launching the clients (connect + handshake, which opens the clones and, with prefetch, starts it) to that start",
        "setup": common,
        "modes": {
            Mode::Cache.label(): "fresh host B (own metadata, cold SSD cache), N linked clones served over NBD in-process as `strata serve` does by default: opening the first clone starts the background prefetch of the recorded working set (8 batches in flight); the clients connect (which opens the clones) just before the common start",
            Mode::CacheNoPrefetch.label(): "as strata+cache, with `serve --no-prefetch`: demand misses only",
            Mode::NoCache.label(): "fresh host B without the cache: every clone's misses go to S3 (no prefetch: it needs a cache)",
            Mode::Qcow2.label(): "qemu-nbd -r serving golden.qcow2 inside the storage namespace over TCP; N connections to its one export",
        },
        "results": {
            "all_done_nocache_over_cache_nmax": replay_speedup,
            "connect_plus_all_done_nocache_over_cache_nmax": replay_speedup_incl_connect,
            "all_done_nocache_over_cache_no_prefetch_nmax": replay_speedup_no_prefetch,
            "all_done_no_prefetch_over_prefetch_nmax": replay_prefetch_gain,
            "all_done_qcow2_over_cache_nmax": replay_vs_qcow2,
            "link_bytes_cache_nmax_over_nmin": replay_bytes_ratio,
            "guest_storm_all_ready_nocache_over_cache_nmax": guest_speedup,
        },
        "rows": replays,
    });
    std::fs::write(o.out.join("bench-storm-replay.csv"), rcsv)?;
    std::fs::write(o.out.join("bench-storm-replay.json"), serde_json::to_string_pretty(&meta)?)?;
    let cats: Vec<String> = o.guests.iter().map(|n| format!("{n} clients")).collect();
    let series: Vec<Series> = [Mode::Cache, Mode::CacheNoPrefetch, Mode::NoCache, Mode::Qcow2]
        .iter()
        .map(|m| Series {
            name: m.label().into(),
            values: o
                .guests
                .iter()
                .map(|&n| r(*m, n).map(|x| x.all_done_s).unwrap_or(0.0))
                .collect(),
        })
        .collect();
    std::fs::write(
        o.out.join("bench-storm-replay.svg"),
        bars(
            "Boot-trace replay: time until every client is done (s, lower is better)",
            "seconds",
            &cats,
            &series,
        ),
    )?;
    // Every client of every mode read the same blocks of the same image: same bytes.
    if replays.iter().any(|r| r.digest.is_none() || r.digest != replays[0].digest) {
        bail!("replay clients read different bytes (digest column of bench-storm-replay.csv): a server returned wrong data");
    }
    eprintln!("wrote {}/bench-storm{{,-replay}}.{{csv,json,svg}}, bench-storm-bytes.svg, bench-storm-trace.csv", o.out.display());
    Ok(())
}

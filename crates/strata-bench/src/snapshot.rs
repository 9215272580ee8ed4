//! `strata-bench snapshot`: the guest pause and total time of a desktop snapshot (memory and
//! every strata disk at one guest instant, `strata vm snapshot`) against a memory-only
//! background snapshot of the same guest and against libvirt-style external snapshots done by
//! hand with QEMU, for each guest size.
//!
//! Setup, per size: two identical TCG guests booted from the golden desktop disk in
//! `strata.mode=root` (with the `memwork` agent written into the image), both running the same
//! workload: memwork holding `--resident` MiB (10% zero, 50% repeated, 40% random pages)
//! and rewriting `--dirty` MiB/s of it, and a loop writing 1 MiB to the disk with `sync` about
//! five times a second. The strata guest's disk is a linked clone served by `strata serve` over
//! NBD; the libvirt-style guest's disk is a local qcow2 overlay of the same image, as libvirt
//! sets a domain up.
//!
//! Variants, taking turns round by round (the guest not being measured is paused, so it does
//! not compete for the 2 cores):
//! * `desktop`: `strata vm snapshot --json` (QMP stop, disk cut in the daemon, background
//!   snapshot that resumes the guest);
//! * `memory-only`: `strata vm snapshot --memory-only --json` (or `vm checkpoint`, the same
//!   background snapshot, on a `strata` without `vm snapshot`);
//! * `libvirt-style`: what `virsh snapshot-create-as --memspec file=..,snapshot=external
//!   --diskspec vda,snapshot=external` does on a running domain: `stop`, migrate to a file,
//!   fdatasync it, `transaction` of `blockdev-snapshot-sync` onto a new qcow2 overlay, `cont`;
//! * `libvirt-style --live`: the same with the migration run live first (QEMU pauses the
//!   guest when precopy converges).
//!
//! The pause is measured the same way for all: STOP to RESUME from QMP event timestamps
//! (QEMU's clock), seen on a monitor of the harness's own. Total time runs from the command's
//! start to a durable result (the strata process's exit; `cont` after the fdatasync and the
//! overlay for the baseline).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use strata::fixtures::{Fixtures, Guest, GuestMode};
use strata::progress::NoProgress;
use strata::qmp::{MigrateParameters, QmpClient, QmpEvent};
use strata::store::{InitOptions, Store};
use strata::Codec;

use crate::chart::{bars, stack, Series};
use crate::guest::scratch_dir;
use crate::results::{env_json, write_outputs};

/// What `strata-bench snapshot` runs.
pub struct SnapshotOpts {
    pub sizes: Vec<u32>,
    pub rounds: u32,
    pub resident_mib: u32,
    pub dirty_mib_s: u32,
    pub out: PathBuf,
    pub scratch: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Desktop,
    MemoryOnly,
    Libvirt,
    LibvirtLive,
}

impl Variant {
    const ALL: [Variant; 4] =
        [Variant::Desktop, Variant::MemoryOnly, Variant::Libvirt, Variant::LibvirtLive];

    fn label(self) -> &'static str {
        match self {
            Variant::Desktop => "desktop",
            Variant::MemoryOnly => "memory-only",
            Variant::Libvirt => "libvirt-style",
            Variant::LibvirtLive => "libvirt-style --live",
        }
    }

    fn on_strata_guest(self) -> bool {
        matches!(self, Variant::Desktop | Variant::MemoryOnly)
    }
}

/// One variant's measurement in one round.
#[derive(Debug, Clone, serde::Serialize)]
struct Round {
    size_mib: u32,
    variant: &'static str,
    round: u32,
    /// STOP to RESUME on the harness's monitor.
    pause_ms: f64,
    /// Command start to durable result, measured by the harness.
    total_ms: f64,
    /// What strata's own report says (STOP to RESUME on its monitor; its total).
    reported_pause_ms: Option<f64>,
    reported_total_ms: Option<f64>,
    /// Desktop snapshot: the daemon's disk cut and the disks cut.
    cut_ms: Option<f64>,
    disks: Option<usize>,
    /// libvirt-style: the memory file's size.
    memory_file_bytes: Option<u64>,
    /// From the command's start to the guest's STOP (wall clocks of this host): a desktop
    /// snapshot stops the guest before `migrate`, a memory-only one after QEMU's migration
    /// set-up, so the difference shows what moved into the pause.
    stop_after_start_ms: f64,
    /// QMP events on the harness's monitor: [name, status, ms from the STOP].
    events: Vec<Value>,
    /// strata's report's `stages` (where its time went).
    stages: Option<Value>,
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(v: &[f64]) -> Option<Spread> {
        if v.is_empty() {
            return None;
        }
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
        Some(Spread { median, min: s[0], max: s[n - 1] })
    }
}

#[derive(Debug, Clone, serde::Serialize)]
struct Summary {
    size_mib: u32,
    variant: &'static str,
    rounds: usize,
    pause_ms: Spread,
    total_ms: Spread,
    stop_after_start_ms: Spread,
}

/// A desktop/baseline pause ratio: ratio of the medians, and the per-round ratios' spread.
#[derive(Debug, Clone, serde::Serialize)]
struct Ratio {
    size_mib: u32,
    against: &'static str,
    of_medians: f64,
    per_round: Spread,
}

pub fn bench_snapshot(o: &SnapshotOpts) -> Result<()> {
    ensure!(o.rounds >= 1, "--rounds must be at least 1");
    let fx = Fixtures::ensure()?;
    let tmp = scratch_dir(o.scratch.as_deref())?;
    let dir = tmp.path();
    let strata = crate::disk::strata_binary()?;
    let has_snapshot = Command::new(&strata)
        .args(["vm", "snapshot", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !has_snapshot {
        eprintln!(
            "bench snapshot: {} has no `vm snapshot`: the desktop variant is skipped and \
             memory-only uses `vm checkpoint`",
            strata.display()
        );
    }
    let image = golden_with_memwork(&fx, dir)?;
    let store_dir = dir.join("store");
    {
        let store = Store::init_local(&store_dir, InitOptions::default())?;
        strata::disk::import(&store, "golden", &image, Codec::Lz4, &NoProgress)?;
        strata::disk::snapshot(&store, "golden", "base")?;
        for &mem in &o.sizes {
            strata::disk::clone(&store, "golden@base", &format!("vm{mem}"), false)?;
        }
    }
    let mut serve = Serve::start(&strata, &store_dir)?;
    let mut rounds: Vec<Round> = Vec::new();
    let mut activity: Vec<Value> = Vec::new();
    for &mem in &o.sizes {
        let lab = Lab { fx: &fx, dir, image: &image, strata: &strata, store: &store_dir };
        let (r, a) = bench_size(&lab, &serve, mem, o, has_snapshot)?;
        rounds.extend(r);
        activity.extend(a);
    }
    serve.stop()?;
    let (summaries, ratios) = summarise(&rounds, &o.sizes);
    print_summary(&summaries, &ratios);
    write_results(o, has_snapshot, &rounds, &activity, &summaries, &ratios)
}

/// The golden disk with memwork written into it (`/memwork`), so the root-mode guest can hold
/// and dirty memory the way the memory guests do.
fn golden_with_memwork(fx: &Fixtures, dir: &Path) -> Result<PathBuf> {
    let img = dir.join("golden-memwork.raw");
    let st = Command::new("cp").arg("--sparse=always").arg(fx.golden()).arg(&img).status()?;
    ensure!(st.success(), "cp of the golden disk failed");
    let mw = fx.memwork().display().to_string();
    for req in [format!("write {mw} memwork"), "sif /memwork mode 0100755".into()] {
        let out = Command::new("debugfs")
            .args(["-w", "-R", &req])
            .arg(&img)
            .stdin(Stdio::null())
            .output();
        let out = out.context("Cannot run debugfs (install e2fsprogs)")?;
        ensure!(
            out.status.success(),
            "debugfs {req}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(img)
}

/// `strata serve` on the bench's store, on its default socket (STORE/.meta/nbd.sock).
struct Serve {
    child: Child,
    sock: PathBuf,
}

impl Serve {
    fn start(strata: &Path, store: &Path) -> Result<Serve> {
        let sock = store.join(".meta").join("nbd.sock");
        let child = Command::new(strata)
            .arg("--store")
            .arg(store)
            .arg("serve")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(store.with_file_name("serve.log"))?)
            .spawn()
            .context("Cannot start strata serve")?;
        let t = Instant::now();
        while !sock.exists() {
            ensure!(t.elapsed() < Duration::from_secs(30), "strata serve did not open {sock:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Serve { child, sock })
    }

    /// SIGINT: the daemon flushes and compacts, then exits.
    fn stop(&mut self) -> Result<()> {
        // SAFETY: signalling the process this harness started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let t = Instant::now();
        while self.child.try_wait()?.is_none() {
            if t.elapsed() > Duration::from_secs(120) {
                let _ = self.child.kill();
                bail!("strata serve did not stop within 120 s of SIGINT");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What every size's run shares.
struct Lab<'a> {
    fx: &'a Fixtures,
    dir: &'a Path,
    image: &'a Path,
    strata: &'a Path,
    store: &'a Path,
}

/// A benchmark guest: QEMU, the harness's monitor (events, and the baseline's commands) and,
/// for the strata guest, the QMP socket `strata` connects to.
struct BenchGuest {
    g: Guest,
    mon: QmpClient,
    cli_qmp: PathBuf,
    running: bool,
}

impl BenchGuest {
    fn boot(lab: &Lab, mem: u32, tag: &str, drive: &str) -> Result<BenchGuest> {
        let mon_path = lab.dir.join(format!("{tag}-mon.sock"));
        let g = lab
            .fx
            .guest()
            .mode(GuestMode::Root)
            .memory_mib(mem)
            .qmp(true)
            .drive(drive)
            .arg("-qmp")
            .arg(&format!("unix:{},server=on,wait=off", mon_path.display()))
            .ready_timeout(Duration::from_secs(300))
            .name(tag)
            .launch()
            .with_context(|| format!("Cannot boot the {mem} MiB guest {tag}"))?;
        let mut mon = QmpClient::connect(&mon_path)?;
        // libvirt lifts the bandwidth limit for saves; strata sets its own.
        mon.migrate_set_parameters(&MigrateParameters {
            max_bandwidth: Some(64 << 30),
            ..Default::default()
        })?;
        let cli_qmp = g.qmp_path().context("guest has no QMP socket")?.to_path_buf();
        Ok(BenchGuest { g, mon, cli_qmp, running: true })
    }

    /// One memwork request through the fifo (memwork runs in the background, the console
    /// belongs to the golden agent); returns memwork's reply.
    fn memwork(&mut self, req: &str, timeout: Duration) -> Result<String> {
        let line = format!(
            "sh n=$(wc -l </tmp/mw.out); echo '{req}' >/tmp/mw.in; \
             while [ $(wc -l </tmp/mw.out) -le $n ]; do sleep 0.05; done; tail -n 1 /tmp/mw.out"
        );
        let r = self.g.command(&line, timeout).with_context(|| format!("memwork `{req}`"))?;
        ensure!(r.starts_with("OK"), "memwork refused `{req}`: {r}");
        Ok(r)
    }

    /// Start the workload: memwork holding `resident` MiB and dirtying `dirty` MiB/s of it,
    /// and the disk writer.
    fn start_workload(&mut self, resident: u32, dirty: u32) -> Result<()> {
        let t = Duration::from_secs(600);
        self.g
            .command(
                "sh mkfifo /tmp/mw.in && (sleep 999999 >/tmp/mw.in 2>/dev/null </dev/null &) && \
                 (/memwork </tmp/mw.in >/tmp/mw.out 2>&1 &) && i=0 && \
                 while ! grep -q STRATA-READY /tmp/mw.out 2>/dev/null; do sleep 0.1; \
                 i=$((i+1)); [ $i -lt 600 ] || exit 1; done; echo memwork up",
                t,
            )
            .context("Cannot start memwork in the guest")?;
        self.memwork(&format!("fill {resident} 10 50 1"), t)?;
        self.memwork(&format!("dirty {dirty} 0"), t)?;
        self.g
            .command(
                "sh (while :; do dd if=/dev/urandom of=/root/bench-writes bs=64k count=16 \
                 2>/dev/null; sync; sleep 0.2; done) >/dev/null 2>&1 </dev/null & echo writer up",
                t,
            )
            .context("Cannot start the disk writer in the guest")?;
        Ok(())
    }

    fn set_running(&mut self, on: bool) -> Result<()> {
        if on != self.running {
            if on {
                self.mon.cont()?;
            } else {
                self.mon.stop()?;
            }
            self.running = on;
        }
        Ok(())
    }

    /// Forget the events received so far.
    fn drain_events(&mut self) -> Result<()> {
        self.mon.poll_events(Duration::from_millis(1))?;
        self.mon.take_events();
        Ok(())
    }

    /// STOP to RESUME (ms) in the events received since the last drain, and those events
    /// with their time relative to the STOP (ms), where the pause goes.
    /// Also: the STOP's wall-clock time, µs since the epoch.
    fn pause_ms(&mut self) -> Result<(f64, Vec<Value>, f64)> {
        self.mon.poll_events(Duration::from_millis(200))?;
        let ev = self.mon.take_events();
        let pause = pause_of(&ev).context("no STOP followed by RESUME on the harness's monitor")?;
        let us = |e: &QmpEvent| e.seconds as f64 * 1e6 + e.microseconds as f64;
        let t0 = ev.iter().find(|e| e.name == "STOP").map(us).unwrap_or(0.0);
        let timeline = ev
            .iter()
            .filter(|e| e.name != "MIGRATION_PASS")
            .map(|e| {
                let status = e.data.get("status").and_then(Value::as_str).unwrap_or("");
                json!([e.name, status, ((us(e) - t0) / 10.0).round() / 100.0])
            })
            .collect();
        Ok((pause, timeline, t0))
    }
}

fn wall_us() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(0.0)
}

fn pause_of(ev: &[QmpEvent]) -> Option<f64> {
    let us = |e: &QmpEvent| e.seconds as f64 * 1e6 + e.microseconds as f64;
    let stop = ev.iter().position(|e| e.name == "STOP")?;
    let resume = ev[stop..].iter().find(|e| e.name == "RESUME")?;
    Some((us(resume) - us(&ev[stop])) / 1000.0)
}

/// Boot both guests of one size, start their workloads and run the rounds.
fn bench_size(
    lab: &Lab,
    serve: &Serve,
    mem: u32,
    o: &SnapshotOpts,
    has_snapshot: bool,
) -> Result<(Vec<Round>, Vec<Value>)> {
    eprintln!("bench snapshot: {mem} MiB guests, {} rounds", o.rounds);
    let export = format!("vm{mem}");
    let nbd =
        format!("file=nbd:unix:{}:exportname={export},if=virtio,format=raw", serve.sock.display());
    let mut sg = BenchGuest::boot(lab, mem, &format!("snap-strata-{mem}"), &nbd)?;
    let qcow = lab.dir.join(format!("vm{mem}.qcow2"));
    strata::fixtures::create_overlay(lab.image, "raw", &qcow)?;
    let drive = format!("file={},if=virtio,format=qcow2,id=vda", qcow.display());
    let mut lg = BenchGuest::boot(lab, mem, &format!("snap-libvirt-{mem}"), &drive)?;
    for g in [&mut sg, &mut lg] {
        g.start_workload(o.resident_mib, o.dirty_mib_s)?;
    }
    let variants: Vec<Variant> =
        Variant::ALL.into_iter().filter(|v| has_snapshot || *v != Variant::Desktop).collect();
    let mut out = Vec::new();
    for round in 1..=o.rounds {
        // The two strata variants swap places every round: a snapshot right after another
        // one of the same guest finds its memory in a different state (page tables split by
        // the first one's write tracking) than one after the guest was paused.
        let mut order = variants.clone();
        if round % 2 == 0 {
            if let (Some(a), Some(b)) = (
                order.iter().position(|v| *v == Variant::Desktop),
                order.iter().position(|v| *v == Variant::MemoryOnly),
            ) {
                order.swap(a, b);
            }
        }
        for &v in &order {
            let (on, off) =
                if v.on_strata_guest() { (&mut sg, &mut lg) } else { (&mut lg, &mut sg) };
            off.set_running(false)?;
            on.set_running(true)?;
            // Let the workload run (memwork catches up on its pacing after a pause).
            std::thread::sleep(Duration::from_secs(2));
            on.drain_events()?;
            let r = match v {
                Variant::Desktop | Variant::MemoryOnly => {
                    run_strata(lab, on, v, mem, round, has_snapshot)?
                }
                Variant::Libvirt | Variant::LibvirtLive => run_libvirt(lab, on, v, mem, round)?,
            };
            eprintln!(
                "  {mem:>5} MiB  round {round}  {:<22} pause {:>9.2} ms  total {:>8.0} ms  stop at {:>7.1} ms{}",
                v.label(),
                r.pause_ms,
                r.total_ms,
                r.stop_after_start_ms,
                r.cut_ms.map(|c| format!("  cut {c:.2} ms")).unwrap_or_default()
            );
            out.push(r);
        }
    }
    // The guests really worked through the rounds: memwork's rewrites and the writer's file.
    let mut activity = Vec::new();
    for (g, guest) in [(&mut sg, "strata"), (&mut lg, "libvirt-style")] {
        g.set_running(true)?;
        let stop = g.memwork("dirty stop", Duration::from_secs(60))?;
        let dirtied: u64 = strata::fixtures::reply_field(stop.trim_start_matches("OK "), "written")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let written = g.g.command("sh wc -c </root/bench-writes", Duration::from_secs(60))?;
        ensure!(dirtied > 0, "memwork in the {guest} guest dirtied no page during the rounds");
        activity.push(json!({"size_mib": mem, "guest": guest, "pages_dirtied": dirtied,
            "disk_writer_file_bytes": written.trim().parse::<u64>().unwrap_or(0)}));
    }
    Ok((out, activity))
}

/// `strata vm snapshot` (desktop or `--memory-only`), or `vm checkpoint` for memory-only on a
/// `strata` without `vm snapshot`.
fn run_strata(
    lab: &Lab,
    g: &mut BenchGuest,
    v: Variant,
    mem: u32,
    round: u32,
    has_snapshot: bool,
) -> Result<Round> {
    let name = format!("{}-{mem}-r{round}", if v == Variant::Desktop { "desktop" } else { "mem" });
    let mut cmd = Command::new(lab.strata);
    cmd.arg("--store").arg(lab.store).arg("--json").arg("vm");
    cmd.arg(if has_snapshot { "snapshot" } else { "checkpoint" });
    cmd.arg("--qmp").arg(&g.cli_qmp).arg(&name);
    if v == Variant::MemoryOnly && has_snapshot {
        cmd.arg("--memory-only");
    }
    let (t, wall) = (Instant::now(), wall_us());
    let out = cmd.stdin(Stdio::null()).output().context("Cannot run strata")?;
    let total_ms = t.elapsed().as_secs_f64() * 1e3;
    ensure!(
        out.status.success(),
        "strata vm {} {name} failed: {}",
        if has_snapshot { "snapshot" } else { "checkpoint" },
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let rep: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("strata printed no JSON report for {name}"))?;
    let (pause_ms, events, stop_us) = g.pause_ms()?;
    let disks = rep.get("disks").and_then(Value::as_array).map(Vec::len);
    ensure!(
        v != Variant::Desktop || disks.unwrap_or(0) >= 1,
        "the desktop snapshot {name} reports no disk cut: is the guest's disk a strata disk?"
    );
    let field = |k: &str| {
        rep.get(k)
            .or_else(|| rep.get("save").and_then(|s| s.get(k)))
            .or_else(|| rep.get("memory").and_then(|s| s.get(k)))
            .and_then(Value::as_f64)
    };
    Ok(Round {
        size_mib: mem,
        variant: v.label(),
        round,
        pause_ms,
        total_ms,
        stop_after_start_ms: (stop_us - wall) / 1e3,
        reported_pause_ms: field("pause_ms"),
        reported_total_ms: field("total_ms"),
        cut_ms: field("cut_ms"),
        disks,
        memory_file_bytes: None,
        events,
        stages: rep.get("stages").cloned(),
    })
}

/// libvirt's external snapshot of a running domain with memory, by hand: (`stop` unless live)
/// migrate to a file, fdatasync it, snapshot the disk onto a new qcow2 overlay in one
/// `transaction`, `cont`.
fn run_libvirt(lab: &Lab, g: &mut BenchGuest, v: Variant, mem: u32, round: u32) -> Result<Round> {
    let live = v == Variant::LibvirtLive;
    let tag = format!("{mem}-r{round}{}", if live { "-live" } else { "" });
    let mem_file = lab.dir.join(format!("libvirt-{tag}.mem"));
    let overlay = lab.dir.join(format!("libvirt-{tag}.qcow2"));
    let q = &mut g.mon;
    let (t, wall) = (Instant::now(), wall_us());
    if !live {
        q.stop()?;
    }
    q.migrate(&format!("exec:cat > {}", mem_file.display()))?;
    q.wait_migration(Duration::from_secs(1800), Duration::from_millis(5))?;
    std::fs::File::open(&mem_file)?.sync_data().context("fdatasync of the memory file")?;
    q.execute(
        "transaction",
        Some(json!({"actions": [{"type": "blockdev-snapshot-sync", "data": {
            "device": "vda",
            "snapshot-file": overlay.display().to_string(),
            "format": "qcow2",
            "mode": "absolute-paths",
        }}]})),
    )?;
    q.cont()?;
    let total_ms = t.elapsed().as_secs_f64() * 1e3;
    let (pause_ms, events, stop_us) = g.pause_ms()?;
    let bytes = std::fs::metadata(&mem_file)?.len();
    std::fs::remove_file(&mem_file)?;
    Ok(Round {
        size_mib: mem,
        variant: v.label(),
        round,
        pause_ms,
        total_ms,
        stop_after_start_ms: (stop_us - wall) / 1e3,
        reported_pause_ms: None,
        reported_total_ms: None,
        cut_ms: None,
        disks: None,
        memory_file_bytes: Some(bytes),
        events,
        stages: None,
    })
}

fn summarise(rounds: &[Round], sizes: &[u32]) -> (Vec<Summary>, Vec<Ratio>) {
    let mut sums = Vec::new();
    let mut ratios = Vec::new();
    for &mem in sizes {
        let of = |v: Variant| -> Vec<&Round> {
            rounds.iter().filter(|r| r.size_mib == mem && r.variant == v.label()).collect()
        };
        for v in Variant::ALL {
            let rs = of(v);
            let p: Vec<f64> = rs.iter().map(|r| r.pause_ms).collect();
            let t: Vec<f64> = rs.iter().map(|r| r.total_ms).collect();
            let st: Vec<f64> = rs.iter().map(|r| r.stop_after_start_ms).collect();
            if let (Some(pause_ms), Some(total_ms), Some(stop_after_start_ms)) =
                (Spread::of(&p), Spread::of(&t), Spread::of(&st))
            {
                sums.push(Summary {
                    size_mib: mem,
                    variant: v.label(),
                    rounds: rs.len(),
                    pause_ms,
                    total_ms,
                    stop_after_start_ms,
                });
            }
        }
        let desk = of(Variant::Desktop);
        for base in [Variant::MemoryOnly, Variant::Libvirt, Variant::LibvirtLive] {
            let b = of(base);
            let per: Vec<f64> = desk
                .iter()
                .filter_map(|d| {
                    b.iter().find(|x| x.round == d.round).map(|x| d.pause_ms / x.pause_ms)
                })
                .collect();
            let med =
                |rs: &[&Round]| Spread::of(&rs.iter().map(|r| r.pause_ms).collect::<Vec<_>>());
            if let (Some(per_round), Some(dm), Some(bm)) = (Spread::of(&per), med(&desk), med(&b)) {
                ratios.push(Ratio {
                    size_mib: mem,
                    against: base.label(),
                    of_medians: dm.median / bm.median,
                    per_round,
                });
            }
        }
    }
    (sums, ratios)
}

fn print_summary(sums: &[Summary], ratios: &[Ratio]) {
    eprintln!("\nsnapshot: guest pause and total time, median [min-max]");
    for s in sums {
        eprintln!(
            "  {:>5} MiB  {:<22} pause {:>9.2} ms [{:.2}-{:.2}]  total {:>8.0} ms [{:.0}-{:.0}]  stop at {:.1} ms",
            s.size_mib,
            s.variant,
            s.pause_ms.median,
            s.pause_ms.min,
            s.pause_ms.max,
            s.total_ms.median,
            s.total_ms.min,
            s.total_ms.max,
            s.stop_after_start_ms.median
        );
    }
    for r in ratios {
        eprintln!(
            "  {:>5} MiB  desktop / {:<22} pause x{:.3} (per round {:.3}-{:.3})",
            r.size_mib, r.against, r.of_medians, r.per_round.min, r.per_round.max
        );
    }
    for s in sums.iter().filter(|s| s.variant == Variant::Desktop.label()) {
        let vs = ratios
            .iter()
            .find(|r| r.size_mib == s.size_mib && r.against == Variant::MemoryOnly.label());
        let ok = s.pause_ms.median <= 15.0 && vs.is_some_and(|r| r.of_medians <= 1.3);
        eprintln!(
            "  target (pause <= 15 ms and <= 1.3x memory-only), {} MiB: {}",
            s.size_mib,
            if ok { "met" } else { "NOT met" }
        );
    }
}

fn write_results(
    o: &SnapshotOpts,
    has_snapshot: bool,
    rounds: &[Round],
    activity: &[Value],
    sums: &[Summary],
    ratios: &[Ratio],
) -> Result<()> {
    let mut csv = String::from("size_mib,variant,rounds,pause_ms_median,pause_ms_min,pause_ms_max,total_ms_median,total_ms_min,total_ms_max,pause_vs_desktop\n");
    for s in sums {
        let desk = sums
            .iter()
            .find(|d| d.size_mib == s.size_mib && d.variant == Variant::Desktop.label())
            .map(|d| format!("{:.4}", s.pause_ms.median / d.pause_ms.median))
            .unwrap_or_default();
        csv += &format!(
            "{},{},{},{:.3},{:.3},{:.3},{:.1},{:.1},{:.1},{desk}\n",
            s.size_mib,
            s.variant,
            s.rounds,
            s.pause_ms.median,
            s.pause_ms.min,
            s.pause_ms.max,
            s.total_ms.median,
            s.total_ms.min,
            s.total_ms.max
        );
    }
    let sizes: Vec<String> = o.sizes.iter().map(|s| s.to_string()).collect();
    let json = json!({
        "benchmark": "snapshot",
        "command": format!(
            "strata-bench snapshot --sizes {} --rounds {} --resident {} --dirty {}",
            sizes.join(","), o.rounds, o.resident_mib, o.dirty_mib_s
        ),
        "how": "Per size two identical TCG guests boot the golden disk (root mode, memwork added) and run the same workload: memwork holding RESIDENT MiB (10% zero, 50% repeated, 40% random pages) and rewriting DIRTY MiB/s of it, plus a loop writing 1 MiB to the disk and syncing about 5 times a second. The strata guest's disk is a linked clone served by strata serve over NBD, the other's a local qcow2 overlay. Variants take turns each round (the guest not measured is paused): desktop = strata vm snapshot; memory-only = strata vm snapshot --memory-only (vm checkpoint without vm snapshot); libvirt-style = stop, migrate to exec:cat > file, fdatasync, transaction[blockdev-snapshot-sync onto a new qcow2 overlay], cont (virsh snapshot-create-as --memspec/--diskspec snapshot=external on a running domain); --live = the migration runs live and QEMU pauses the guest at convergence. Pause: STOP to RESUME from QMP event timestamps on the harness's own monitor. Total: command start to a durable result (strata's exit; cont after the memory file's fdatasync and the overlay). Ratios: desktop pause over the baseline's, of the medians and per round",
        "desktop_measured": has_snapshot,
        "memory_only_command": if has_snapshot { "strata vm snapshot --memory-only" } else { "strata vm checkpoint" },
        "workload": {"resident_mib": o.resident_mib, "zero_pct": 10, "repeat_pct": 50, "dirty_mib_s": o.dirty_mib_s, "disk_writes": "1 MiB + sync every ~0.2 s"},
        "target": "desktop pause <= 15 ms (median) and <= 1.3x the memory-only pause",
        "env": env_json(),
        "summary": sums,
        "ratios": ratios,
        "guest_activity": activity,
        "rounds": rounds,
    });
    write_outputs(&o.out, "snapshot", csv, &json, chart(sums))
}

fn chart(sums: &[Summary]) -> String {
    let mut sizes: Vec<u32> = sums.iter().map(|s| s.size_mib).collect();
    sizes.dedup();
    let cats: Vec<String> = sizes.iter().map(|s| format!("{s} MiB guest")).collect();
    let series = |vs: &[Variant], f: &dyn Fn(&Summary) -> f64| -> Vec<Series> {
        vs.iter()
            .map(|v| Series {
                name: v.label().into(),
                values: sizes
                    .iter()
                    .map(|&m| {
                        sums.iter()
                            .find(|s| s.size_mib == m && s.variant == v.label())
                            .map(f)
                            .unwrap_or(0.0)
                    })
                    .collect(),
            })
            .collect()
    };
    let strata_only = [Variant::Desktop, Variant::MemoryOnly];
    stack(vec![
        bars(
            "Guest pause, strata (median, STOP to RESUME)",
            "ms",
            &cats,
            &series(&strata_only, &|s| s.pause_ms.median),
        ),
        bars(
            "Guest pause against libvirt-style external snapshots (median)",
            "ms",
            &cats,
            &series(&Variant::ALL, &|s| s.pause_ms.median),
        ),
        bars(
            "Total time to a durable snapshot (median)",
            "ms",
            &cats,
            &series(&Variant::ALL, &|s| s.total_ms.median),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(name: &str, s: i64, us: i64) -> QmpEvent {
        QmpEvent { name: name.into(), data: Value::Null, seconds: s, microseconds: us }
    }

    #[test]
    fn pause_is_first_stop_to_the_next_resume() {
        let e = [ev("RESUME", 9, 0), ev("STOP", 10, 999_000), ev("RESUME", 11, 2_500)];
        assert_eq!(pause_of(&e), Some(3.5));
        assert_eq!(pause_of(&e[..2]), None);
    }

    #[test]
    fn spread_takes_the_middle_of_odd_and_even_counts() {
        let s = Spread::of(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 5.0));
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert!(Spread::of(&[]).is_none());
    }
}

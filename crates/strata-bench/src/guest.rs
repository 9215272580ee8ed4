//! The guest side shared by the memory benchmarks (`mem/`: local `codecs`,
//! `save-restore`, `live`; `remote_mem.rs`: the same over the 1 Gbit/s storage host):
//! booting the TCG guest with the golden desktop disk, loading the desktop workload, QMP,
//! destination QEMUs for restores, the QEMU baseline save/restore, a checkpoint taken while
//! the guest dirties memory, a strata restore verified by the guest's memwork checksum, and
//! writing the result files. One place, so the local and remote benchmarks measure the same
//! guest the same way.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use strata::fixtures::{Fixtures, Guest, Machine};
use strata::memory::launch::launch_args;
use strata::memory::manifest::Mode;
use strata::memory::restore::{restore, RestoreOptions, RestoreReport};
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::progress::NoProgress;
use strata::qmp::{MigrateParameters, QmpClient};
use strata::store::Store;

pub(crate) fn scratch_dir(p: Option<&Path>) -> Result<tempfile::TempDir> {
    Ok(match p {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir())?,
    })
}

pub(crate) fn machine(s: &str) -> Result<Machine> {
    match s {
        "pc" => Ok(Machine::Pc),
        "q35" => Ok(Machine::Q35),
        other => bail!("Unknown machine '{other}': use pc or q35"),
    }
}

/// What was loaded into the guest.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Workload {
    /// The `--workload` it was loaded from.
    pub mix: String,
    pub text_mib: u32,
    pub fill_mib: u32,
    pub zero_pct: u32,
    pub repeat_pct: u32,
    seed: u64,
    /// memwork's checksum of all its regions afterwards.
    pub sum: String,
}

pub(crate) fn boot(fx: &Fixtures, mem: u32, m: Machine, name: &str) -> Result<Guest> {
    let golden = fx.golden();
    fx.guest()
        .memory_mib(mem)
        .machine(m)
        .qmp(true)
        .drive(&format!("file={},if=virtio,format=raw,readonly=on", golden.display()))
        .name(name)
        .launch()
        .with_context(|| format!("Cannot boot the {mem} MiB benchmark guest"))
}

/// The guest's free memory in MiB, as memwork reports it when refusing an oversized `fill`
/// ("... N MiB available; ...").
pub(crate) fn available_mib(g: &mut Guest) -> Result<u32> {
    match g.command("fill 65536 0 0 1", Duration::from_secs(60)) {
        Ok(_) => bail!("memwork accepted a 64 GiB fill"),
        Err(e) => {
            let msg = e.to_string();
            msg.split(" MiB available")
                .next()
                .and_then(|h| h.rsplit(' ').next())
                .and_then(|n| n.parse::<u32>().ok())
                .with_context(|| format!("cannot read the free memory from: {msg}"))
        }
    }
}

/// What the benchmark guest's memory holds besides its kernel and initramfs: `--workload`.
/// The golden files' text takes `text_pct` of the free memory (at most the caller's cap), then
/// (unless `fill` is off) memwork's synthetic pages take the rest: `zero_pct` zero pages,
/// `repeat_pct` pages repeating one of 16 patterns, the others pseudo-random (incompressible).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WorkloadMix {
    pub text_pct: u32,
    pub fill: bool,
    pub zero_pct: u32,
    pub repeat_pct: u32,
}

impl WorkloadMix {
    /// Half the free memory as golden-file text, the rest 10% zero, 50% repeated, 40% random.
    pub const DESKTOP: WorkloadMix =
        WorkloadMix { text_pct: 50, fill: true, zero_pct: 10, repeat_pct: 50 };
    const PRESETS: [(&'static str, WorkloadMix); 4] = [
        ("desktop", WorkloadMix::DESKTOP),
        ("random", WorkloadMix { text_pct: 0, fill: true, zero_pct: 0, repeat_pct: 0 }),
        ("text", WorkloadMix { text_pct: 100, fill: false, zero_pct: 0, repeat_pct: 0 }),
        ("idle", WorkloadMix { text_pct: 0, fill: false, zero_pct: 0, repeat_pct: 0 }),
    ];
}

impl Default for WorkloadMix {
    fn default() -> Self {
        WorkloadMix::DESKTOP
    }
}

impl std::fmt::Display for WorkloadMix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some((name, _)) = WorkloadMix::PRESETS.iter().find(|(_, m)| m == self) {
            return f.write_str(name);
        }
        write!(f, "text={}", self.text_pct)?;
        if self.fill {
            write!(f, ",zero={},repeat={}", self.zero_pct, self.repeat_pct)
        } else {
            f.write_str(",fill=off")
        }
    }
}

impl std::str::FromStr for WorkloadMix {
    type Err = String;

    /// A preset (`desktop`, `random`, `text`, `idle`) or `KEY=VALUE,...` over `desktop` with
    /// keys `text`, `zero`, `repeat` (percentages) and `fill` (`on`/`off`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if let Some((_, m)) = WorkloadMix::PRESETS.iter().find(|(n, _)| *n == s) {
            return Ok(*m);
        }
        let names: Vec<&str> = WorkloadMix::PRESETS.iter().map(|(n, _)| *n).collect();
        let mut m = WorkloadMix::DESKTOP;
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                format!("Unknown workload '{part}': use one of {} or text=PCT,zero=PCT,repeat=PCT,fill=on|off", names.join(", "))
            })?;
            let pct = || -> std::result::Result<u32, String> {
                match v.trim().parse::<u32>() {
                    Ok(n) if n <= 100 => Ok(n),
                    _ => Err(format!("Workload {k}={v}: give a percentage 0-100")),
                }
            };
            match k.trim() {
                "text" => m.text_pct = pct()?,
                "zero" => m.zero_pct = pct()?,
                "repeat" => m.repeat_pct = pct()?,
                "fill" => {
                    m.fill = match v.trim() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(format!("Workload fill={v}: use fill=on or fill=off")),
                    }
                }
                other => {
                    return Err(format!(
                        "Unknown workload key '{other}': use text, zero, repeat or fill"
                    ))
                }
            }
        }
        if m.zero_pct + m.repeat_pct > 100 {
            return Err(format!(
                "Workload zero={} + repeat={} is over 100%",
                m.zero_pct, m.repeat_pct
            ));
        }
        Ok(m)
    }
}

/// The result files' name for benchmark `base` run on workload `mix`: `base` for the desktop
/// workload, `base-workload-NAME` otherwise (`=` and `,` become `-`).
pub(crate) fn results_name(base: &str, mix: &WorkloadMix) -> String {
    if *mix == WorkloadMix::DESKTOP {
        base.to_string()
    } else {
        format!("{base}-workload-{}", mix.to_string().replace(['=', ','], "-"))
    }
}

/// Load a workload: golden files (at most `text_cap` MiB, one pass of the tree repeated), then
/// anonymous memory, so that most of RAM is touched.
pub(crate) fn load_workload(
    g: &mut Guest,
    mix: &WorkloadMix,
    seed: u64,
    text_cap: u32,
) -> Result<Workload> {
    // memwork refuses a fill of N MiB unless N + 24 <= MemAvailable; keep 16 MiB more spare.
    let usable = available_mib(g)?.saturating_sub(40).max(8);
    let t = Duration::from_secs(600);
    let text_mib =
        if mix.text_pct == 0 { 0 } else { (usable * mix.text_pct / 100).min(text_cap).max(4) };
    if text_mib > 0 {
        g.command(&format!("text {text_mib}"), t).context("text workload")?;
    }
    let (zero_pct, repeat_pct) = (mix.zero_pct, mix.repeat_pct);
    let fill_mib = if mix.fill { available_mib(g)?.saturating_sub(40).max(4) } else { 0 };
    if fill_mib > 0 {
        g.command(&format!("fill {fill_mib} {zero_pct} {repeat_pct} {seed}"), t)
            .context("fill workload")?;
    }
    let sum = g.command("sum", t).context("sum")?;
    Ok(Workload { mix: mix.to_string(), text_mib, fill_mib, zero_pct, repeat_pct, seed, sum })
}

pub(crate) fn qmp_of(g: &Guest) -> Result<QmpClient> {
    let p = g.qmp_path().context("guest has no QMP socket")?;
    let mut q = QmpClient::connect(p)?;
    q.migrate_set_parameters(&MigrateParameters {
        max_bandwidth: Some(64 << 30),
        ..Default::default()
    })?;
    Ok(q)
}

pub(crate) fn qemu_program() -> String {
    std::env::var("STRATA_QEMU")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "qemu-system-x86_64".into())
}

/// A destination QEMU with the guest's arguments, `-incoming defer -S` and its own console.
pub(crate) struct Dest {
    child: Child,
    pub qmp: QmpClient,
    pub console: PathBuf,
}

impl Dest {
    /// The QEMU process's (user s, system s, minor faults, major faults) so far.
    pub fn cpu_split(&self) -> (f64, f64, u64, u64) {
        crate::remote::proc_cpu_split(&format!("/proc/{}/stat", self.child.id()))
    }

    /// Seconds the QEMU process's threads have waited, runnable, for a CPU so far (the
    /// second field of every `/proc/PID/task/*/schedstat`; 0 without schedstats).
    pub fn run_wait_s(&self) -> f64 {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else {
            return 0.0;
        };
        dir.flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>() as f64
            / 1e9
    }
}

impl Drop for Dest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn start_dest(g: &Guest, dir: &Path, tag: &str) -> Result<Dest> {
    let con_src = g.dir().join("console.sock").display().to_string();
    let console = dir.join(format!("{tag}-console.sock"));
    let mut cmd = vec![qemu_program()];
    cmd.extend(g.args().iter().map(|a| a.replace(&con_src, &console.display().to_string())));
    let qmp_path = dir.join(format!("{tag}.qmp"));
    let _ = std::fs::remove_file(&qmp_path);
    let (prog, args) = launch_args(&cmd, &qmp_path).map_err(anyhow::Error::msg)?;
    let child = Command::new(prog)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{tag}.log")))?)
        .spawn()?;
    let t0 = Instant::now();
    let qmp = loop {
        match QmpClient::connect(&qmp_path) {
            Ok(q) => break q,
            Err(_) if t0.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(e).context("destination QEMU did not start"),
        }
    };
    Ok(Dest { child, qmp, console })
}

/// One request on the restored guest's console, e.g. `sum`.
pub(crate) fn console_command(path: &Path, line: &str) -> Result<String> {
    let s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    (&s).write_all(format!("{line}\n").as_bytes())?;
    let mut rd = BufReader::new(&s);
    let mut l = String::new();
    loop {
        l.clear();
        if rd.read_line(&mut l)? == 0 {
            bail!("console closed before replying to `{line}`");
        }
        let t = l.trim_matches(|c: char| c.is_whitespace() || c == '\0');
        if let Some(p) = t.strip_prefix("OK ") {
            return Ok(p.to_string());
        }
        if t.starts_with("ERR") {
            bail!("guest refused `{line}`: {t}");
        }
    }
}

/// `stop` the running source and `migrate URI`, then `sync` when asked; returns seconds from
/// the `stop` (strata's `vm save` stops the guest inside its own clock too).
pub(crate) fn qemu_save(q: &mut QmpClient, uri: &str, sync: bool) -> Result<f64> {
    let t = Instant::now();
    q.stop()?;
    q.migrate(uri)?;
    q.wait_migration(Duration::from_secs(1800), Duration::from_millis(5))?;
    if sync {
        let st = Command::new("sync").status()?;
        anyhow::ensure!(st.success(), "sync failed");
    }
    let s = t.elapsed().as_secs_f64();
    q.cont()?;
    Ok(s)
}

pub(crate) fn qemu_restore(d: &mut Dest, uri: &str) -> Result<f64> {
    let t = Instant::now();
    d.qmp.migrate_incoming(uri)?;
    d.qmp.wait_migration(Duration::from_secs(1800), Duration::from_millis(2))?;
    Ok(t.elapsed().as_secs_f64())
}

/// Boot a guest of `mem` MiB and load the desktop workload; returns it with its QMP client.
pub(crate) fn desktop_guest(
    fx: &Fixtures,
    mem: u32,
    m: Machine,
    name: &str,
) -> Result<(Guest, Workload, QmpClient)> {
    workload_guest(fx, mem, m, name, &WorkloadMix::DESKTOP)
}

/// Boot a guest of `mem` MiB and load workload `mix`; returns it with its QMP client.
pub(crate) fn workload_guest(
    fx: &Fixtures,
    mem: u32,
    m: Machine,
    name: &str,
    mix: &WorkloadMix,
) -> Result<(Guest, Workload, QmpClient)> {
    let mut g = boot(fx, mem, m, name)?;
    let w = load_workload(&mut g, mix, 1, 240)?;
    eprintln!(
        "  workload {}: text {} MiB + fill {} MiB ({}% zero, {}% repeated); sum {}",
        w.mix, w.text_mib, w.fill_mib, w.zero_pct, w.repeat_pct, w.sum
    );
    let q = qmp_of(&g)?;
    Ok((g, w, q))
}

/// `vm restore` of checkpoint `name` into `d`, resumed, and the guest's memwork sum compared
/// with the workload's.
pub(crate) fn restore_verified(
    store: &Store,
    name: &str,
    d: &mut Dest,
    w: &Workload,
    opts: RestoreOptions,
) -> Result<RestoreReport> {
    let rr =
        restore(store, name, &mut d.qmp, &RestoreOptions { resume: true, ..opts }, &NoProgress)?;
    check_sum(d, w)?;
    Ok(rr)
}

/// The restored (and resumed) guest's memwork sum compared with the workload's.
pub(crate) fn check_sum(d: &Dest, w: &Workload) -> Result<()> {
    let sum = console_command(&d.console, "sum")?;
    anyhow::ensure!(sum == w.sum, "restored guest's memwork sum differs: {sum} vs {}", w.sum);
    Ok(())
}

/// The guest pause of a checkpoint: the whole stopped time for stop-and-copy, STOP to RESUME
/// for the live modes.
pub(crate) fn pause_ms(r: &SaveReport) -> f64 {
    match r.mode {
        Mode::Save => r.downtime_ms,
        _ => r.pause_ms.unwrap_or(r.downtime_ms),
    }
}

/// A checkpoint taken while memwork dirties `rate` MiB/s over `span` MiB of its regions
/// (started `lead` before the save): the save's report and the pages the guest dirtied.
/// A stop-and-copy source is resumed afterwards.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dirty_checkpoint(
    g: &mut Guest,
    q: &mut QmpClient,
    store: &Store,
    name: &str,
    mode: Mode,
    rate: u32,
    span: u32,
    lead: Duration,
) -> Result<(SaveReport, u64)> {
    let t = Duration::from_secs(120);
    g.command(&format!("dirty {rate} 0 {span}"), t)?;
    std::thread::sleep(lead);
    let r = save(store, q, name, &SaveOptions::new(mode), &NoProgress)
        .with_context(|| format!("{} checkpoint {name}", mode.as_str()))?;
    if mode == Mode::Save {
        q.cont()?;
    }
    let stop = g.command("dirty stop", t)?;
    let written =
        strata::fixtures::reply_field(&stop, "written").and_then(|v| v.parse().ok()).unwrap_or(0);
    Ok((r, written))
}

/// The columns every live-benchmark row has: one checkpoint's cost.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct CheckpointCost {
    pub rate_mib_s: u32,
    pub method: String,
    pub pause_ms: f64,
    pub total_ms: f64,
    pub pages_sent: u64,
    pub pages_stored: u64,
    pub pages_deduped: u64,
    pub zero_pages: u64,
    pub stored_bytes: u64,
    pub guest_pages_dirtied: u64,
}

impl CheckpointCost {
    pub fn of(rate: u32, label: &str, r: &SaveReport, written: u64) -> CheckpointCost {
        CheckpointCost {
            rate_mib_s: rate,
            method: label.into(),
            pause_ms: pause_ms(r),
            total_ms: r.total_ms,
            pages_sent: r.pages_sent,
            pages_stored: r.pages_stored,
            pages_deduped: r.pages_deduped,
            zero_pages: r.zero_pages,
            stored_bytes: r.stored_bytes,
            guest_pages_dirtied: written,
        }
    }
}

/// The three checkpoint modes the live benchmarks compare, with their labels.
pub(crate) const LIVE_MODES: [(&str, Mode); 3] = [
    ("stop-and-copy", Mode::Save),
    ("background-snapshot", Mode::BackgroundSnapshot),
    ("precopy+cont", Mode::Precopy),
];

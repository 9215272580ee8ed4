//! `strata vm ...`: save, checkpoint, restore, list, rm and inspect VM memory checkpoints.
//!
//! Each subcommand is one call into `strata::memory` plus output: a progress bar on a
//! terminal (bytes, pages/s, ETA) and either a short human summary or, with `--json`, the
//! library's report as one JSON document (downtime, total time, logical/stored/new bytes,
//! dedup ratio, codec and why). Errors keep the library's chain, printed by `main` with
//! `{:#}`, so an operator sees what failed, on which checkpoint/page, and what to do.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use strata::memory::catalog;
use strata::memory::codec_choice::CodecPolicy;
use strata::memory::delta::BasePolicy;
use strata::memory::launch::{restore_launch, LaunchOptions};
use strata::memory::manifest::Mode;
use strata::memory::restore::{restore, RestoreOptions, RestoreReport};
use strata::memory::save::{save, save_desktop, DiskCut, Placement, SaveOptions, SaveReport};
use strata::qmp::QmpClient;

use crate::{desktop, ui};

#[derive(Subcommand)]
pub enum VmCmd {
    /// Stop-and-copy: pause the VM, store its memory and its strata disks, leave it paused
    /// (like `virsh save`).
    Save {
        /// QMP socket of the running QEMU (-qmp unix:PATH,server=on,wait=off).
        #[arg(long)]
        qmp: PathBuf,
        /// Snapshot name (letters, digits, '._@=+-', '/' separators).
        name: String,
        #[command(flatten)]
        disks: DiskArgs,
        #[command(flatten)]
        opts: SaveArgs,
    },
    /// Desktop snapshot of a running VM: its memory and every strata disk it has attached, at
    /// one guest instant; the VM keeps running. Default: background-snapshot (the state at the
    /// start, a pause of milliseconds). --precopy: precopy, the disks cut at switchover.
    #[command(alias = "checkpoint")]
    Snapshot {
        #[arg(long)]
        qmp: PathBuf,
        name: String,
        /// Precopy + cont instead of background-snapshot.
        #[arg(long)]
        precopy: bool,
        #[command(flatten)]
        disks: DiskArgs,
        #[command(flatten)]
        opts: SaveArgs,
    },
    /// Restore into a QEMU started with `-incoming defer` (--qmp), or start one from the
    /// command line recorded at save time (--launch). Every page is verified first.
    Restore {
        name: String,
        /// QMP socket of a QEMU started with -incoming defer (add -S to keep it paused).
        #[arg(long, required_unless_present_any = ["launch", "disks_only"], conflicts_with = "launch")]
        qmp: Option<PathBuf>,
        /// Start QEMU with the recorded command line plus -incoming defer -S, load, resume.
        #[arg(long)]
        launch: bool,
        /// Leave the VM paused after loading.
        #[arg(long)]
        paused: bool,
        /// With --launch: where the new QEMU's QMP socket and log go
        /// (default $XDG_RUNTIME_DIR/strata, else /tmp/strata-run).
        #[arg(long)]
        run_dir: Option<PathBuf>,
        /// With --launch: QEMU binary to use instead of the recorded one.
        #[arg(long)]
        qemu: Option<String>,
        /// Reading/verifying threads (default: all cores).
        #[arg(long)]
        workers: Option<usize>,
        /// A desktop snapshot's disks: give the original disks the snapshot's content instead
        /// of starting on clones of them (their current content is kept as a disk snapshot).
        #[arg(long)]
        revert: bool,
        /// With --revert: do not keep the disks' current content.
        #[arg(long, requires = "revert")]
        discard_current: bool,
        /// With --revert: disconnect the NBD clients of the disks (a VM still running on them).
        #[arg(long, requires = "revert")]
        force: bool,
        /// Only make the disks (clones, or --revert) and print the command line that uses
        /// them; start no QEMU.
        #[arg(long, conflicts_with_all = ["qmp", "launch"])]
        disks_only: bool,
        /// Restore the memory only; the command line keeps the disks it recorded.
        #[arg(long, conflicts_with_all = ["revert", "disks_only"])]
        memory_only: bool,
    },
    /// List snapshots.
    List,
    /// Remove a checkpoint (space is reclaimed by `strata gc`; pages other checkpoints use stay).
    Rm { name: String },
    /// Show a checkpoint: ramblocks, pages, dedup, codec, QEMU version, machine type, command line.
    Inspect {
        name: String,
        /// Also count pages shared with other checkpoints (reads every checkpoint's page maps).
        #[arg(long)]
        sharing: bool,
    },
}

/// Which disks a snapshot takes with the memory.
#[derive(Args)]
pub struct DiskArgs {
    /// Memory only: leave the VM's disks out.
    #[arg(long)]
    memory_only: bool,
    /// Leave out writable disks that are not strata disks of this store (with a warning)
    /// instead of refusing the snapshot.
    #[arg(long)]
    allow_foreign_disks: bool,
    /// Cut the disks while strata holds the guest stopped (`stop`, cut, `migrate`) instead of
    /// at the guest's last flush; chosen by itself for disks QEMU never flushes
    /// (`cache=unsafe`). Adds the round trips to the guest's pause.
    #[arg(long, conflicts_with = "memory_only")]
    cut_at_stop: bool,
}

#[derive(Args)]
pub struct SaveArgs {
    /// auto (measure backend and codecs, per batch), none, lz4 or zstd[:LEVEL].
    #[arg(long, default_value = "auto")]
    codec: String,
    /// Hashing/compressing threads (default: all cores).
    #[arg(long)]
    workers: Option<usize>,
    /// Replace an existing checkpoint of the same name.
    #[arg(long)]
    replace: bool,
    /// Store pages that changed little as deltas against this checkpoint (default: the most
    /// recent one with the same machine type and RAM layout).
    #[arg(long, conflicts_with = "no_delta")]
    base: Option<String>,
    /// Store every new page whole (no delta pages).
    #[arg(long)]
    no_delta: bool,
}

impl SaveArgs {
    fn options(&self, mode: Mode) -> Result<SaveOptions> {
        let mut o = SaveOptions::new(mode);
        o.codec = self
            .codec
            .parse::<CodecPolicy>()
            .with_context(|| format!("Invalid --codec '{}'", self.codec))?;
        if let Some(w) = self.workers {
            o.ingest.workers = w.max(1);
        }
        o.replace = self.replace;
        o.base = match (&self.base, self.no_delta) {
            (_, true) => BasePolicy::Off,
            (Some(b), false) => BasePolicy::Named(b.clone()),
            (None, false) => BasePolicy::Auto,
        };
        Ok(o)
    }
}

fn connect(qmp: &Path) -> Result<QmpClient> {
    QmpClient::connect(qmp).with_context(|| format!("Cannot talk to QEMU at {}", qmp.display()))
}

fn run_dir(arg: &Option<PathBuf>) -> PathBuf {
    if let Some(d) = arg {
        return d.clone();
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("strata"),
        None => PathBuf::from("/tmp/strata-run"),
    }
}

fn secs(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

fn save_text(r: &SaveReport) -> String {
    let paused = match r.mode {
        Mode::Save => format!("VM paused {} and stays paused", secs(r.downtime_ms)),
        _ => format!(
            "VM kept running (paused {}{})",
            secs(r.downtime_ms),
            r.pause_ms
                .map(|p| format!(", {} between STOP and RESUME", secs(p)))
                .unwrap_or_default()
        ),
    };
    format!(
        "Saved '{}' ({}): {} of RAM in {}; {}\n  stored {} new ({} raw; dedup {:.2}x, compression {:.2}x, {:.2}x smaller than RAM)\n  pages: {} sent, {} stored, {} deduplicated, {} zero, {} distinct\n  codec {}: {}",
        r.name,
        r.mode.as_str(),
        ui::human(r.logical_bytes),
        secs(r.total_ms),
        paused,
        ui::human(r.stored_bytes),
        ui::human(r.new_bytes),
        r.dedup_ratio,
        r.compression_ratio,
        r.reduction,
        r.pages_sent,
        r.pages_stored,
        r.pages_deduped,
        r.zero_pages,
        r.unique_pages,
        r.codec.chosen,
        r.codec.why
    ) + &delta_text(r.delta.as_ref())
}

fn delta_text(d: Option<&strata::memory::manifest::DeltaMeta>) -> String {
    match d {
        None => String::new(),
        Some(d) => format!(
            "\n  delta base '{}': {} pages stored as deltas ({} of runs, {} new records; {} tried)",
            d.base,
            d.pages,
            ui::human(d.bytes),
            d.records,
            d.attempts
        ),
    }
}

fn restore_text(r: &RestoreReport) -> String {
    format!(
        "Restored '{}' in {} (prepare {}, stream {}, {} pages, {} distinct verified, {} read); VM {}",
        r.name,
        secs(r.total_ms),
        secs(r.plan_ms),
        secs(r.stream_ms),
        r.pages,
        r.chunks_verified,
        ui::human(r.bytes_read),
        r.vm_status
    )
}

fn date(unix: u64) -> String {
    // Days since the epoch to a civil date (UTC), without a time crate.
    let days = (unix / 86_400) as i64;
    let (h, m) = ((unix % 86_400) / 3600, (unix % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02}Z")
}

/// The table `strata vm list` prints.
fn list_text(l: &[catalog::CheckpointSummary]) -> String {
    if l.is_empty() {
        return "No snapshots (take one with `strata vm snapshot --qmp SOCK NAME`)".into();
    }
    let mut out = format!(
        "{:<28} {:<20} {:<17} {:<15} {:>10} {:>10}  {:<8} {}\n",
        "NAME", "MODE", "CREATED", "MACHINE", "RAM", "STORED", "CODEC", "DISKS"
    );
    for c in l {
        match &c.error {
            Some(e) => out += &format!("{:<28} UNREADABLE: {e}\n", c.name),
            None => {
                out += &format!(
                    "{:<28} {:<20} {:<17} {:<15} {:>10} {:>10}  {:<8} {}\n",
                    c.name,
                    c.mode,
                    date(c.created_unix),
                    c.machine_type,
                    ui::human(c.ram_bytes),
                    ui::human(c.stored_bytes),
                    c.codec,
                    if c.disks.is_empty() { "-".to_string() } else { c.disks.join(",") }
                )
            }
        }
    }
    out.trim_end().to_string()
}

/// What `strata vm inspect` prints.
fn inspect_text(i: &catalog::Inspection) -> String {
    let m = &i.manifest;
    let s = &m.stats;
    let mut out = format!(
        "Snapshot '{}' ({}), taken {} by QEMU {} ({})\n  machine {}  RAM {}  {} pages, {} zero, {} distinct\n  stream {} bytes, device state {} bytes, {} devices\n  save: {} total, downtime {}; stored {} new of {} raw (dedup: {} pages skipped, {} stored)\n  codec {} ({}): {}\n  ramblocks:\n",
        i.name,
        m.mode.as_str(),
        date(m.created_unix),
        m.qemu.version,
        m.qemu.package,
        m.qemu.machine_type,
        ui::human(s.logical_bytes),
        i.total_pages,
        s.zero_pages,
        s.unique_pages,
        m.stream.bytes,
        m.tail.len,
        m.stream.vmdesc_devices,
        secs(s.total_ms),
        secs(s.downtime_ms),
        ui::human(s.stored_bytes),
        ui::human(s.new_bytes),
        s.pages_deduped,
        s.pages_stored,
        m.codec.chosen,
        m.codec.policy,
        m.codec.why
    );
    if m.delta.is_some() {
        out += &delta_text(m.delta.as_ref())[1..];
        out.push('\n');
    }
    for b in &m.blocks {
        out += &format!(
            "    {:<24} {:>10}  {:>8} pages  {:>8} zero  {:>8} distinct\n",
            b.name,
            ui::human(b.used_len),
            b.pages(),
            b.zero_pages,
            b.unique_pages
        );
    }
    if let Some(sh) = &i.sharing {
        out += &format!(
            "  sharing with {} other checkpoints: {} of {} distinct pages shared, {} only here (~{} before compression)\n",
            sh.other_checkpoints,
            sh.shared_pages,
            sh.distinct_pages,
            sh.exclusive_pages,
            ui::human(sh.exclusive_pages * 4096)
        );
    }
    if m.disks.is_empty() {
        out += "  disks: none taken (memory only)\n";
    }
    for d in &m.disks {
        out += &format!(
            "  disk {}: '{}' ({} of {} allocated{}), cut with the memory\n",
            d.device,
            d.disk,
            ui::human(d.allocated * d.block_size as u64),
            ui::human(d.size),
            d.parent.as_ref().map(|p| format!(", clone of {p}")).unwrap_or_default()
        );
    }
    if m.qemu.cmdline.is_empty() {
        out += "  command line: unknown (--launch unavailable)";
    } else {
        out += &format!("  command line: {}", m.qemu.cmdline.join(" "));
    }
    out
}

/// `vm save` and `vm snapshot`: the memory, and the VM's strata disks unless `--memory-only`.
fn snapshot(
    store: strata::Store,
    qmp: &Path,
    name: &str,
    mode: Mode,
    disks: &DiskArgs,
    opts: &SaveArgs,
    json: bool,
) -> Result<()> {
    let o = opts.options(mode)?;
    let mut q = connect(qmp)?;
    let plan = if disks.memory_only {
        None
    } else {
        Some(desktop::plan(store.local_dir(), &mut q, disks.allow_foreign_disks)?)
    };
    for w in plan.iter().flat_map(|p| &p.warnings) {
        eprintln!("warning: {w}");
    }
    let bar = crate::ui::bar(json).with_pages();
    let (r, cut_ms, placement) = match plan.filter(|p| !p.disks.is_empty()) {
        Some(p) => {
            let mut cut = desktop::DaemonCut::new(store.local_dir(), &p);
            if disks.cut_at_stop {
                cut = cut.at_stop();
            }
            let r = save_desktop(&store, &mut q, name, &o, &mut cut, &bar)?;
            (r, cut.cut_ms, Some(cut.placement()))
        }
        None => (save(&store, &mut q, name, &o, &bar)?, None, None),
    };
    drop(bar);
    let recorded =
        catalog::inspect(&store, name, false).map(|i| i.manifest.disks).unwrap_or_default();
    let mut v = serde_json::to_value(&r)?;
    v["disks"] = serde_json::to_value(&recorded)?;
    v["cut_ms"] = serde_json::json!(cut_ms);
    v["cut_placement"] = serde_json::json!(placement.map(|p| match p {
        Placement::AtStop => "at-stop",
        Placement::AtFlush => "at-flush",
    }));
    ui::emit(json, &v, || {
        let mut t = save_text(&r);
        for d in &recorded {
            t += &format!(
                "\n  disk {} ({}): {} of {} allocated, cut with the memory",
                d.device,
                d.disk,
                ui::human(d.allocated * d.block_size as u64),
                ui::human(d.size)
            );
        }
        match (placement, cut_ms) {
            (Some(Placement::AtStop), Some(c)) => {
                t += &format!("\n  disks cut in {} inside the guest's pause", secs(c))
            }
            (Some(Placement::AtFlush), _) => {
                t += "\n  disks cut at the guest's last flush before it resumed"
            }
            _ => {}
        }
        t
    });
    store.close()?;
    Ok(())
}

/// `vm restore`: memory into a QEMU (`--qmp`) or a QEMU started from the recorded command
/// line (`--launch`); a desktop snapshot's disks become clones, or are reverted.
fn restore_cmd(store: &strata::Store, cmd: &VmCmd, json: bool) -> Result<()> {
    let VmCmd::Restore {
        name,
        qmp,
        launch,
        paused,
        run_dir: rd,
        qemu,
        workers,
        revert,
        discard_current,
        force,
        disks_only,
        memory_only,
    } = cmd
    else {
        unreachable!("restore_cmd takes vm restore")
    };
    let ckpt = strata::memory::restore::load_checkpoint(store, name)?;
    let has_disks = !ckpt.manifest.disks.is_empty() && !memory_only;
    if !has_disks && *disks_only {
        anyhow::bail!("Snapshot '{name}' has no disks: there is nothing for --disks-only to make");
    }
    if has_disks && qmp.is_some() {
        anyhow::bail!(
            "Snapshot '{name}' has {} disk(s): restore it with --launch (strata starts QEMU on the right disks), or make the disks with --disks-only and start QEMU on them yourself with -incoming defer, or pass --memory-only",
            ckpt.manifest.disks.len()
        );
    }
    let prepared = if has_disks {
        let mode = if *revert {
            desktop::DiskMode::Revert { discard_current: *discard_current, force: *force }
        } else {
            desktop::DiskMode::Clone
        };
        Some(desktop::prepare(store, &ckpt, mode)?)
    } else {
        None
    };
    let disks_text = |p: &[desktop::Prepared]| {
        p.iter()
            .map(|d| match &d.kept_as {
                Some(k) => format!(
                    "\n  disk {}: '{}' reverted (its content before is '{k}')",
                    d.device, d.now
                ),
                None if d.now == d.disk => format!("\n  disk {}: '{}' reverted", d.device, d.now),
                None => format!("\n  disk {}: clone '{}' of '{}'", d.device, d.now, d.disk),
            })
            .collect::<String>()
    };
    if *disks_only {
        let (p, line) = prepared.expect("disks made above");
        let v = serde_json::json!({"disks": p, "cmdline": line});
        ui::emit(json, &v, || {
            format!("Disks of '{name}':{}\nCommand line: {}", disks_text(&p), line.join(" "))
        });
        return Ok(());
    }
    let mut ro = RestoreOptions { resume: !paused, ..Default::default() };
    if let Some(w) = workers {
        ro.workers = (*w).max(1);
    }
    let bar = crate::ui::bar(json).with_pages();
    if *launch {
        let mut lo = LaunchOptions::new(run_dir(rd));
        lo.program = qemu.clone();
        lo.restore = ro;
        lo.cmdline = prepared.as_ref().map(|(_, line)| line.clone());
        let l = restore_launch(store, name, &lo, &bar)?;
        drop(bar);
        let mut q = connect(&l.qmp_path)?;
        let status = q.query_status().map(|s| s.status).unwrap_or_else(|_| "unknown".into());
        let disks = prepared.as_ref().map(|(p, _)| p.clone()).unwrap_or_default();
        let v = serde_json::json!({
            "restore": l.report, "pid": l.child.id(), "qmp": l.qmp_path, "log": l.log_path,
            "program": l.program, "args": l.args, "vm_status": status, "disks": disks,
        });
        ui::emit(json, &v, || {
            format!(
                "{}\nLaunched QEMU pid {} ({}), QMP {}, log {}{}",
                restore_text(&l.report),
                l.child.id(),
                status,
                l.qmp_path.display(),
                l.log_path.display(),
                disks_text(&disks)
            )
        });
    } else {
        let sock = qmp.as_ref().expect("clap requires --qmp without --launch");
        let mut q = connect(sock)?;
        let r = restore(store, name, &mut q, &ro, &bar)?;
        drop(bar);
        ui::emit(json, &r, || restore_text(&r));
    }
    Ok(())
}

pub fn run(store_path: &Path, json: bool, cmd: &VmCmd) -> Result<()> {
    let open = || {
        strata::host::open(store_path, &Default::default())
            .map(|h| h.store)
            .with_context(|| format!("Cannot open store at {}", store_path.display()))
    };
    match cmd {
        VmCmd::Save { qmp, name, disks, opts } => {
            snapshot(open()?, qmp, name, Mode::Save, disks, opts, json)?
        }
        VmCmd::Snapshot { qmp, name, precopy, disks, opts } => {
            let mode = if *precopy { Mode::Precopy } else { Mode::BackgroundSnapshot };
            snapshot(open()?, qmp, name, mode, disks, opts, json)?
        }
        VmCmd::Restore { .. } => restore_cmd(&open()?, cmd, json)?,
        VmCmd::List => {
            let store = open()?;
            let l = catalog::list(&store)?;
            ui::emit(json, &l, || list_text(&l));
        }
        VmCmd::Rm { name } => {
            let store = open()?;
            let disks =
                catalog::inspect(&store, name, false).map(|i| i.manifest.disks.len()).unwrap_or(0);
            catalog::remove(&store, name)?;
            ui::emit(json, &serde_json::json!({"removed": name, "disks": disks}), || {
                let with = if disks > 0 {
                    format!(" with its {disks} disk snapshot(s)")
                } else {
                    String::new()
                };
                format!("Removed snapshot '{name}'{with} (run `strata gc` to reclaim space)")
            });
        }
        VmCmd::Inspect { name, sharing } => {
            let store = open()?;
            let i = catalog::inspect(&store, name, *sharing)?;
            ui::emit(json, &i, || inspect_text(&i));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(date(0), "1970-01-01 00:00Z");
        assert_eq!(date(1_700_000_000), "2023-11-14 22:13Z");
        assert_eq!(date(951_782_400), "2000-02-29 00:00Z");
    }
}

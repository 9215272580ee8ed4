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
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::qmp::QmpClient;

use crate::ui;

#[derive(Subcommand)]
pub enum VmCmd {
    /// Stop-and-copy: pause the VM, store its memory, leave it paused (like `virsh save`).
    Save {
        /// QMP socket of the running QEMU (-qmp unix:PATH,server=on,wait=off).
        #[arg(long)]
        qmp: PathBuf,
        /// Checkpoint name (letters, digits, '._@=+-', '/' separators).
        name: String,
        #[command(flatten)]
        opts: SaveArgs,
    },
    /// Live checkpoint; the VM keeps running. Default: background-snapshot (the state at the
    /// start, a pause of milliseconds). --precopy: precopy then `cont` (the state at switchover).
    Checkpoint {
        #[arg(long)]
        qmp: PathBuf,
        name: String,
        /// Precopy + cont instead of background-snapshot.
        #[arg(long)]
        precopy: bool,
        #[command(flatten)]
        opts: SaveArgs,
    },
    /// Restore into a QEMU started with `-incoming defer` (--qmp), or start one from the
    /// command line recorded at save time (--launch). Every page is verified first.
    Restore {
        name: String,
        /// QMP socket of a QEMU started with -incoming defer (add -S to keep it paused).
        #[arg(long, required_unless_present = "launch", conflicts_with = "launch")]
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
    },
    /// List checkpoints.
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
        return "No checkpoints (save one with `strata vm save --qmp SOCK NAME`)".into();
    }
    let mut out = format!(
        "{:<28} {:<20} {:<17} {:<15} {:>10} {:>10}  {}\n",
        "NAME", "MODE", "CREATED", "MACHINE", "RAM", "STORED", "CODEC"
    );
    for c in l {
        match &c.error {
            Some(e) => out += &format!("{:<28} UNREADABLE: {e}\n", c.name),
            None => {
                out += &format!(
                    "{:<28} {:<20} {:<17} {:<15} {:>10} {:>10}  {}\n",
                    c.name,
                    c.mode,
                    date(c.created_unix),
                    c.machine_type,
                    ui::human(c.ram_bytes),
                    ui::human(c.stored_bytes),
                    c.codec
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
        "Checkpoint '{}' ({}), taken {} by QEMU {} ({})\n  machine {}  RAM {}  {} pages, {} zero, {} distinct\n  stream {} bytes, device state {} bytes, {} devices\n  save: {} total, downtime {}; stored {} new of {} raw (dedup: {} pages skipped, {} stored)\n  codec {} ({}): {}\n  ramblocks:\n",
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
    if m.qemu.cmdline.is_empty() {
        out += "  command line: unknown (--launch unavailable)";
    } else {
        out += &format!("  command line: {}", m.qemu.cmdline.join(" "));
    }
    out
}

pub fn run(store_path: &Path, json: bool, cmd: &VmCmd) -> Result<()> {
    let open = || {
        strata::host::open(store_path, &Default::default())
            .map(|h| h.store)
            .with_context(|| format!("Cannot open store at {}", store_path.display()))
    };
    match cmd {
        VmCmd::Save { qmp, name, opts } | VmCmd::Checkpoint { qmp, name, opts, precopy: _ } => {
            let mode = match cmd {
                VmCmd::Save { .. } => Mode::Save,
                VmCmd::Checkpoint { precopy: true, .. } => Mode::Precopy,
                _ => Mode::BackgroundSnapshot,
            };
            let o = opts.options(mode)?;
            let store = open()?;
            let mut q = connect(qmp)?;
            let bar = crate::ui::bar(json).with_pages();
            let r = save(&store, &mut q, name, &o, &bar)?;
            drop(bar);
            ui::emit(json, &r, || save_text(&r));
            store.close()?;
        }
        VmCmd::Restore { name, qmp, launch, paused, run_dir: rd, qemu, workers } => {
            let store = open()?;
            let mut ro = RestoreOptions { resume: !paused, ..Default::default() };
            if let Some(w) = workers {
                ro.workers = (*w).max(1);
            }
            let bar = crate::ui::bar(json).with_pages();
            if *launch {
                let mut lo = LaunchOptions::new(run_dir(rd));
                lo.program = qemu.clone();
                lo.restore = ro;
                let l = restore_launch(&store, name, &lo, &bar)?;
                drop(bar);
                let mut q = connect(&l.qmp_path)?;
                let status =
                    q.query_status().map(|s| s.status).unwrap_or_else(|_| "unknown".into());
                let v = serde_json::json!({
                    "restore": l.report, "pid": l.child.id(), "qmp": l.qmp_path, "log": l.log_path,
                    "program": l.program, "args": l.args, "vm_status": status,
                });
                ui::emit(json, &v, || {
                    format!(
                        "{}\nLaunched QEMU pid {} ({}), QMP {}, log {}",
                        restore_text(&l.report),
                        l.child.id(),
                        status,
                        l.qmp_path.display(),
                        l.log_path.display()
                    )
                });
            } else {
                let sock = qmp.as_ref().expect("clap requires --qmp without --launch");
                let mut q = connect(sock)?;
                let r = restore(&store, name, &mut q, &ro, &bar)?;
                drop(bar);
                ui::emit(json, &r, || restore_text(&r));
            }
        }
        VmCmd::List => {
            let store = open()?;
            let l = catalog::list(&store)?;
            ui::emit(json, &l, || list_text(&l));
        }
        VmCmd::Rm { name } => {
            let store = open()?;
            catalog::remove(&store, name)?;
            ui::emit(json, &serde_json::json!({"removed": name}), || {
                format!("Removed checkpoint '{name}' (run `strata gc` to reclaim space)")
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

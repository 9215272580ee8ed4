//! `strata disk ...`: create, snapshot, import, export, clone, compact, list, inspect and
//! remove disk images, and record or warm a boot working set.
//!
//! While `strata serve` runs for the store it owns the disks its clients opened, so
//! snapshot, clone, export, compact, rm and info go to it over the control socket
//! (`control`, `docs/control.md`): a snapshot or clone of a disk being written is then an
//! exact cut of it. Without a daemon they run in this process. Create, import, list,
//! record-boot and warm always run here: they touch no disk the daemon holds (a second
//! process opens the store beside the daemon with its own metadata cache and, on a remote
//! store, reads the backend directly because the daemon has the SSD cache). Both paths print
//! the same reports.

use anyhow::Result;
use clap::Subcommand;
use serde_json::{json, Value};
use std::path::PathBuf;
use strata::store::Store;

use crate::{boot_cmd, control, open_host, parse_size, store_location, ui, Cli};

#[derive(Subcommand)]
pub enum DiskCmd {
    /// Create an empty, thin-provisioned disk.
    Create {
        name: String,
        /// Size, e.g. 20G.
        #[arg(long)]
        size: String,
    },
    /// Take an immutable snapshot NAME@SNAP. With --also, the other disks are snapshotted
    /// as DISK@SNAP at the same instant (a served disk is cut while its clients write: the
    /// snapshot holds every write acknowledged before the command, none after).
    Snapshot {
        name: String,
        snap: String,
        /// Another disk to snapshot at the same instant (repeatable).
        #[arg(long, value_name = "DISK")]
        also: Vec<String>,
    },
    /// Import a raw image (for qcow2: `qemu-img convert -O raw in.qcow2 out.raw` first).
    Import {
        name: String,
        file: PathBuf,
        /// none, lz4 or zstd[:LEVEL]; default: the store's codec.
        #[arg(long)]
        codec: Option<String>,
    },
    /// Write a disk to a raw image file (sparse).
    Export { name: String, file: PathBuf },
    /// Clone a disk or snapshot (SRC or SRC@SNAP) into a new writable disk. Both kinds copy
    /// only metadata; a linked clone records its parent, --full does not.
    Clone {
        src: String,
        dst: String,
        #[arg(long)]
        full: bool,
    },
    /// Fold a disk's write log into its block map.
    Compact { name: String },
    /// List disks.
    List,
    /// Show one disk.
    Info { name: String },
    /// Remove a disk (space is reclaimed by `strata gc`).
    Rm {
        name: String,
        /// Disconnect the disk's NBD clients first (they get ESHUTDOWN and are closed).
        #[arg(long)]
        force: bool,
    },
    /// Record the boot working set of image NAME: serve a temporary clone of it over NBD,
    /// boot a guest from it, and when the guest disconnects (or on Ctrl-C) store the chunks
    /// its boot read as `bootsets/NAME` in the backend.
    RecordBoot {
        name: String,
        /// Unix socket to serve on (default STORE/.meta/record-boot.sock).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Also write the block trace (CSV) here.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Stop recording after this many seconds.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Prefetch the recorded boot working set of NAME (or of its parent image) into the cache.
    Warm {
        name: String,
        /// Parallel reads.
        #[arg(long, default_value_t = 16)]
        parallel: usize,
    },
}

/// Run a disk command: through the serving daemon when one answers and the command is one it
/// runs, else in this process.
pub fn run(cli: &Cli, cmd: &DiskCmd) -> Result<()> {
    let json = cli.json;
    if let Some(req) = daemon_request(cmd)? {
        let local = store_location(&cli.store).join(".meta");
        let t = std::time::Instant::now();
        if let Some(report) = control::request(&local, &req)? {
            show(cmd, &from_daemon(cmd, report), t.elapsed().as_secs_f64(), json);
            return Ok(());
        }
    }
    let h = open_host(cli, false)?;
    run_local(&h.store, cmd, json)
}

/// The control request for a command the daemon runs.
fn daemon_request(cmd: &DiskCmd) -> Result<Option<Value>> {
    Ok(Some(match cmd {
        DiskCmd::Snapshot { name, snap, also } => {
            let snaps: Vec<[&str; 2]> =
                std::iter::once(name).chain(also).map(|d| [d.as_str(), snap.as_str()]).collect();
            json!({"op": "disk-snapshot", "snaps": snaps})
        }
        DiskCmd::Clone { src, dst, full } => {
            json!({"op": "disk-clone", "src": src, "dst": dst, "full": full})
        }
        DiskCmd::Export { name, file } => {
            json!({"op": "disk-export", "name": name, "file": std::path::absolute(file)?})
        }
        DiskCmd::Compact { name } => json!({"op": "disk-compact", "name": name}),
        DiskCmd::Rm { name, force } => json!({"op": "disk-rm", "name": name, "force": force}),
        DiskCmd::Info { name } => json!({"op": "disk-info", "name": name}),
        _ => return Ok(None),
    }))
}

/// A daemon's report in the shape `run_local` reports.
fn from_daemon(cmd: &DiskCmd, report: Value) -> Value {
    match cmd {
        DiskCmd::Export { name, file } => {
            json!({"disk": name, "file": file, "bytes": report["bytes"]})
        }
        DiskCmd::Compact { name } => json!({"disk": name, "generation": report["generation"]}),
        _ => report,
    }
}

/// Print the report of a snapshot, clone, export, compact, rm or info (`secs`: its time).
fn show(cmd: &DiskCmd, r: &Value, secs: f64, json: bool) {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let s = |v: &Value| v.as_str().unwrap_or("?").to_string();
    match cmd {
        DiskCmd::Snapshot { also, .. } => {
            // One disk: its DiskInfo, as ever; several: the list.
            let single = also.is_empty() && r.is_array();
            let out = if single { r[0].clone() } else { r.clone() };
            ui::emit(json, &out, || {
                let names: Vec<String> = r
                    .as_array()
                    .map(|a| a.iter().map(|i| format!("'{}'", s(&i["name"]))).collect())
                    .unwrap_or_default();
                format!("Snapshot {} taken", names.join(", "))
            });
        }
        DiskCmd::Clone { src, dst, .. } => {
            ui::emit(json, &json!({"disk": r, "seconds": secs}), || {
                format!(
                    "Cloned '{src}' to '{dst}' ({}) in {:.1} ms",
                    ui::human(n(&r["size"])),
                    secs * 1000.0
                )
            });
        }
        DiskCmd::Export { name, file } => ui::emit(json, r, || {
            format!("Exported disk '{name}' to {} ({})", file.display(), ui::human(n(&r["bytes"])))
        }),
        DiskCmd::Compact { name } => {
            ui::emit(json, r, || format!("Compacted '{name}' (generation {})", n(&r["generation"])))
        }
        DiskCmd::Rm { name, .. } => ui::emit(json, r, || {
            format!("Removed disk '{name}' (run `strata gc` to reclaim space)")
        }),
        DiskCmd::Info { .. } => ui::emit(json, r, || {
            let mut t = format!(
                "{}: {} bytes, block {} bytes, {} blocks allocated, root {}",
                s(&r["name"]),
                n(&r["size"]),
                n(&r["block_size"]),
                n(&r["allocated_blocks"]),
                s(&r["root"])
            );
            if let Some(c) = r["served"]["clients"].as_u64() {
                t += &format!("; open in strata serve, {c} NBD client(s) connected");
            }
            t
        }),
        _ => ui::emit(json, r, || r.to_string()),
    }
}

/// Run a command in this process (no daemon, or a command the daemon does not run).
fn run_local(s: &Store, cmd: &DiskCmd, json: bool) -> Result<()> {
    use strata::disk;
    let t = std::time::Instant::now();
    let report = match cmd {
        DiskCmd::Import { name, file, codec } => {
            let codec = match codec {
                Some(c) => c.parse()?,
                None => s.default_codec(),
            };
            let p = ui::bar(json);
            let i = disk::import(s, name, file, codec, &p)?;
            drop(p);
            let secs = t.elapsed().as_secs_f64();
            ui::emit(json, &json!({"disk": i, "seconds": secs}), || {
                format!(
                    "Imported {} as disk '{name}': {} ({} blocks allocated) in {secs:.2} s",
                    file.display(),
                    ui::human(i.size),
                    i.allocated_blocks
                )
            });
            return Ok(());
        }
        DiskCmd::Create { name, size } => {
            let i = disk::create(s, name, parse_size(size)?)?;
            ui::emit(json, &i, || format!("Created disk '{name}' of {} (thin)", ui::human(i.size)));
            return Ok(());
        }
        DiskCmd::List => {
            list(s, json)?;
            return Ok(());
        }
        DiskCmd::RecordBoot { name, socket, trace, timeout } => {
            return boot_cmd::record_boot(
                s,
                name,
                socket.as_deref(),
                trace.as_deref(),
                *timeout,
                json,
            );
        }
        DiskCmd::Warm { name, parallel } => return boot_cmd::warm(s, name, *parallel, json),
        DiskCmd::Export { name, file } => {
            let p = ui::bar(json);
            let n = disk::export(s, name, file, &p)?;
            drop(p);
            json!({"disk": name, "file": file, "bytes": n})
        }
        DiskCmd::Snapshot { name, snap, also } => {
            let infos = std::iter::once(name)
                .chain(also)
                .map(|d| disk::snapshot(s, d, snap))
                .collect::<Result<Vec<_>, _>>()?;
            serde_json::to_value(infos)?
        }
        DiskCmd::Compact { name } => {
            let v = disk::volume::Volume::open(s, name)?;
            json!({"disk": name, "generation": v.compact()?})
        }
        DiskCmd::Clone { src, dst, full } => {
            serde_json::to_value(disk::clone(s, src, dst, *full)?)?
        }
        DiskCmd::Info { name } => serde_json::to_value(disk::info(s, name)?)?,
        DiskCmd::Rm { name, .. } => {
            disk::remove(s, name)?;
            json!({"removed": name})
        }
    };
    show(cmd, &report, t.elapsed().as_secs_f64(), json);
    Ok(())
}

fn list(s: &Store, json: bool) -> Result<()> {
    let l = strata::disk::list(s)?;
    ui::emit(json, &l, || {
        l.iter()
            .map(|d| {
                let kind = match (&d.snapshot_of, &d.parent) {
                    (Some(_), _) => "snapshot".to_string(),
                    (None, Some(p)) => format!("clone of {p}"),
                    _ => String::new(),
                };
                format!(
                    "{:<28} {:>10}  {:>8} blocks  {kind}",
                    d.name,
                    ui::human(d.size),
                    d.allocated_blocks
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    Ok(())
}

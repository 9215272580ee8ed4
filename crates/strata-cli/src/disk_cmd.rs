//! `strata disk ...`: create, snapshot, import, export, clone, compact, list, inspect and
//! remove disk images, and record or warm a boot working set.

use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;
use strata::store::Store;

use crate::{boot_cmd, parse_size, ui};

#[derive(Subcommand)]
pub enum DiskCmd {
    /// Create an empty, thin-provisioned disk.
    Create {
        name: String,
        /// Size, e.g. 20G.
        #[arg(long)]
        size: String,
    },
    /// Take an immutable snapshot NAME@SNAP.
    Snapshot { name: String, snap: String },
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
    Rm { name: String },
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

pub fn run(s: &Store, cmd: &DiskCmd, json: bool) -> Result<()> {
    use strata::disk;
    match cmd {
        DiskCmd::Import { name, file, codec } => {
            let codec = match codec {
                Some(c) => c.parse()?,
                None => s.default_codec(),
            };
            let p = ui::bar(json);
            let t = std::time::Instant::now();
            let i = disk::import(s, name, file, codec, &p)?;
            drop(p);
            let secs = t.elapsed().as_secs_f64();
            ui::emit(json, &serde_json::json!({"disk": i, "seconds": secs}), || {
                format!(
                    "Imported {} as disk '{name}': {} ({} blocks allocated) in {secs:.2} s",
                    file.display(),
                    ui::human(i.size),
                    i.allocated_blocks
                )
            });
        }
        DiskCmd::Export { name, file } => {
            let p = ui::bar(json);
            let n = disk::export(s, name, file, &p)?;
            drop(p);
            ui::emit(json, &serde_json::json!({"disk": name, "file": file, "bytes": n}), || {
                format!("Exported disk '{name}' to {} ({})", file.display(), ui::human(n))
            });
        }
        DiskCmd::Create { name, size } => {
            let i = disk::create(s, name, parse_size(size)?)?;
            ui::emit(json, &i, || format!("Created disk '{name}' of {} (thin)", ui::human(i.size)));
        }
        DiskCmd::Snapshot { name, snap } => {
            let i = disk::snapshot(s, name, snap)?;
            ui::emit(json, &i, || format!("Snapshot '{}' taken", i.name));
        }
        DiskCmd::Compact { name } => {
            let v = disk::volume::Volume::open(s, name)?;
            let g = v.compact()?;
            ui::emit(json, &serde_json::json!({"disk": name, "generation": g}), || {
                format!("Compacted '{name}' (generation {g})")
            });
        }
        DiskCmd::Clone { src, dst, full } => {
            let t = std::time::Instant::now();
            let i = disk::clone(s, src, dst, *full)?;
            let secs = t.elapsed().as_secs_f64();
            ui::emit(json, &serde_json::json!({"disk": i, "seconds": secs}), || {
                format!(
                    "Cloned '{src}' to '{dst}' ({}) in {:.1} ms",
                    ui::human(i.size),
                    secs * 1000.0
                )
            });
        }
        DiskCmd::List => {
            let l = disk::list(s)?;
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
        }
        DiskCmd::Info { name } => {
            let i = disk::info(s, name)?;
            ui::emit(json, &i, || {
                format!(
                    "{}: {} bytes, block {} bytes, {} blocks allocated, root {}",
                    i.name, i.size, i.block_size, i.allocated_blocks, i.root
                )
            });
        }
        DiskCmd::RecordBoot { name, socket, trace, timeout } => {
            boot_cmd::record_boot(s, name, socket.as_deref(), trace.as_deref(), *timeout, json)?
        }
        DiskCmd::Warm { name, parallel } => boot_cmd::warm(s, name, *parallel, json)?,
        DiskCmd::Rm { name } => {
            disk::remove(s, name)?;
            ui::emit(json, &serde_json::json!({"removed": name}), || {
                format!("Removed disk '{name}' (run `strata gc` to reclaim space)")
            });
        }
    }
    Ok(())
}

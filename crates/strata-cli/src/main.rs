//! The `strata` command: a thin clap front end over the library.
//!
//! Each subcommand parses arguments, opens the store (location from `--store`, then
//! `$STRATA_STORE`, then the default in `store_location`), calls one library function, and
//! prints either a human summary or, with `--json`, one JSON document for scripts. Progress
//! bars come from the library's `Progress` trait, drawn with indicatif on a terminal only.

mod bench;
mod bench_disk;
mod bench_io;
mod bench_mem;
mod bench_storm;
mod boot_cmd;
mod bench_sync;
mod chart;
mod inspect;
mod ui;
mod vm;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use strata::store::check::CheckOptions;
use strata::store::{InitOptions, Store};
use strata::Codec;

#[derive(Parser)]
#[command(name = "strata", version, about = "Content-addressed storage for VM disks and memory")]
struct Cli {
    /// Store directory (default: $STRATA_STORE, else /var/lib/strata for root, else ~/.local/share/strata).
    #[arg(long, global = true, env = "STRATA_STORE")]
    store: Option<PathBuf>,
    /// Print one JSON document instead of text (for scripts).
    #[arg(long, global = true)]
    json: bool,
    /// Log level filter (e.g. info, strata::store=debug); also $STRATA_LOG.
    #[arg(long, global = true, env = "STRATA_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a new store.
    Init {
        /// Codec for writers that don't choose: none, lz4, zstd[:LEVEL].
        #[arg(long, default_value = "lz4")]
        codec: String,
        /// Target pack size, e.g. 32M.
        #[arg(long, default_value = "32M")]
        pack_size: String,
    },
    /// Verify every pack, chunk and ref; exit 1 on damage.
    Check {
        /// Only check structure and refs, do not read chunk data.
        #[arg(long)]
        quick: bool,
    },
    /// Show a stored object with its format version: config, ref NAME, pack ID, index ID, chunk ID.
    Inspect {
        /// config | ref | pack | index | chunk
        kind: String,
        /// Name or hex id (not needed for config).
        what: Option<String>,
    },
    /// Logical, unique and stored bytes.
    Du,
    /// Reclaim chunks no ref reaches.
    Gc,
    /// List refs.
    Refs {
        #[arg(default_value = "")]
        prefix: String,
    },
    /// Disk images: import, export, clone, list, info, rm.
    Disk {
        #[command(subcommand)]
        cmd: DiskCmd,
    },
    /// Serve every disk over NBD (writable disks read-write, snapshots read-only) until
    /// SIGINT/SIGTERM; then flush and compact. Default: unix socket STORE/.meta/nbd.sock.
    Serve {
        /// Unix socket path.
        #[arg(long, conflicts_with = "tcp")]
        socket: Option<PathBuf>,
        /// Loopback TCP address instead, e.g. 127.0.0.1:10809.
        #[arg(long)]
        tcp: Option<std::net::SocketAddr>,
    },
    /// VM memory: save, live checkpoints, restore, list, rm, inspect.
    Vm {
        #[command(subcommand)]
        cmd: vm::VmCmd,
    },
    /// Benchmarks that write tables and charts to docs/results/.
    Bench {
        #[command(subcommand)]
        which: bench::BenchCmd,
    },
}

#[derive(Subcommand)]
enum DiskCmd {
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

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(cli) {
        eprintln!("strata: {e:#}");
        std::process::exit(2);
    }
}

/// `--store`, then `$STRATA_STORE` (both via clap), then a per-user default.
pub fn store_location(arg: &Option<PathBuf>) -> PathBuf {
    if let Some(p) = arg {
        return p.clone();
    }
    if unsafe { libc_geteuid() } == 0 {
        return PathBuf::from("/var/lib/strata");
    }
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("strata")
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..].to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1u64 << 40,
                other => bail!("Unknown size suffix '{other}' in '{s}': use K, M, G or T"),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n: u64 = num.trim().parse().with_context(|| format!("Invalid size '{s}': expected e.g. 4096, 64K, 30G"))?;
    n.checked_mul(mult).with_context(|| format!("Size '{s}' is too large"))
}

fn open(cli: &Cli) -> Result<Store> {
    let loc = store_location(&cli.store);
    Store::open_local(&loc).with_context(|| format!("Cannot open store at {}", loc.display()))
}

fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Init { codec, pack_size } => {
            let loc = store_location(&cli.store);
            let codec: Codec = codec.parse()?;
            let pack_size = parse_size(pack_size)?;
            Store::init_local(&loc, InitOptions { pack_size, default_codec: codec })
                .with_context(|| format!("Cannot create store at {}", loc.display()))?
                .close()?;
            ui::emit(cli.json, &serde_json::json!({"store": loc, "codec": codec.to_string(), "pack_size": pack_size}), || {
                format!("Created strata store at {} (codec {codec}, packs of {pack_size} bytes)", loc.display())
            });
        }
        Cmd::Check { quick } => {
            let s = open(&cli)?;
            let p = ui::bar(cli.json);
            let rep = s.check(CheckOptions { read_data: !quick }, &p)?;
            drop(p);
            ui::emit(cli.json, &rep, || {
                let mut out = format!(
                    "Checked {} packs, {} chunks, {} refs ({} bytes read)\n",
                    rep.packs, rep.chunks, rep.refs, rep.bytes_read
                );
                for pr in &rep.problems {
                    let sev = match pr.severity {
                        strata::store::check::Severity::Error => "ERROR",
                        strata::store::check::Severity::Warning => "warning",
                    };
                    out += &format!("{sev}: {}: {}", pr.object, pr.message);
                    if !pr.refs.is_empty() {
                        out += &format!(" [used by: {}]", pr.refs.join(", "));
                    }
                    out.push('\n');
                }
                out += if rep.is_damaged() { "Store is DAMAGED" } else { "No damage found" };
                out
            });
            if rep.is_damaged() {
                std::process::exit(1);
            }
        }
        Cmd::Inspect { kind, what } => {
            let s = open(&cli)?;
            inspect::run(&s, kind, what.as_deref(), cli.json)?;
        }
        Cmd::Du => {
            let s = open(&cli)?;
            let u = s.du()?;
            ui::emit(cli.json, &u, || {
                let mut out = String::new();
                for r in &u.refs {
                    out += &format!("{:>12}  {}\n", ui::human(r.logical_bytes), r.name);
                }
                out += &format!(
                    "logical {}  unique {}  stored {}  (dedup {:.2}x, compression {:.2}x)\nchunks {}  packs {}  unreachable {} in {} chunks (run `strata gc`)",
                    ui::human(u.logical_bytes),
                    ui::human(u.unique_bytes),
                    ui::human(u.stored_bytes),
                    u.dedup_ratio,
                    u.compression_ratio,
                    u.chunks,
                    u.packs,
                    ui::human(u.unreachable_bytes),
                    u.unreachable_chunks
                );
                out
            });
        }
        Cmd::Gc => {
            let s = open(&cli)?;
            let p = ui::bar(cli.json);
            let r = s.gc(&p)?;
            drop(p);
            ui::emit(cli.json, &r, || {
                format!(
                    "Collected {} dead chunks: {} packs deleted, {} repacked, {} orphan packs removed, {} freed",
                    r.dead_chunks,
                    r.packs_deleted,
                    r.packs_repacked,
                    r.orphan_packs_deleted,
                    ui::human(r.bytes_freed)
                )
            });
        }
        Cmd::Refs { prefix } => {
            let s = open(&cli)?;
            let refs = s.list_refs(prefix)?;
            ui::emit(cli.json, &refs, || refs.join("\n"));
        }
        Cmd::Disk { cmd } => {
            let s = open(&cli)?;
            disk_cmd(&s, cmd, cli.json)?;
        }
        Cmd::Serve { socket, tcp } => serve(&cli, socket.clone(), *tcp)?,
        Cmd::Bench { which } => bench::run(which)?,
        Cmd::Vm { cmd } => vm::run(&store_location(&cli.store), cli.json, cmd)?,
    }
    Ok(())
}

fn disk_cmd(s: &Store, cmd: &DiskCmd, json: bool) -> Result<()> {
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
                format!("Imported {} as disk '{name}': {} ({} blocks allocated) in {secs:.2} s", file.display(), ui::human(i.size), i.allocated_blocks)
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
            ui::emit(json, &serde_json::json!({"disk": name, "generation": g}), || format!("Compacted '{name}' (generation {g})"));
        }
        DiskCmd::Clone { src, dst, full } => {
            let t = std::time::Instant::now();
            let i = disk::clone(s, src, dst, *full)?;
            let secs = t.elapsed().as_secs_f64();
            ui::emit(json, &serde_json::json!({"disk": i, "seconds": secs}), || {
                format!("Cloned '{src}' to '{dst}' ({}) in {:.1} ms", ui::human(i.size), secs * 1000.0)
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
                        format!("{:<28} {:>10}  {:>8} blocks  {kind}", d.name, ui::human(d.size), d.allocated_blocks)
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        DiskCmd::Info { name } => {
            let i = disk::info(s, name)?;
            ui::emit(json, &i, || format!("{}: {} bytes, block {} bytes, {} blocks allocated, root {}", i.name, i.size, i.block_size, i.allocated_blocks, i.root));
        }
        DiskCmd::RecordBoot { name, socket, trace, timeout } => boot_cmd::record_boot(s, name, socket.as_deref(), trace.as_deref(), *timeout, json)?,
        DiskCmd::Warm { name, parallel } => boot_cmd::warm(s, name, *parallel, json)?,
        DiskCmd::Rm { name } => {
            disk::remove(s, name)?;
            ui::emit(json, &serde_json::json!({"removed": name}), || format!("Removed disk '{name}' (run `strata gc` to reclaim space)"));
        }
    }
    Ok(())
}

fn serve(cli: &Cli, socket: Option<PathBuf>, tcp: Option<std::net::SocketAddr>) -> Result<()> {
    use strata::nbd::Server;
    // Block SIGINT/SIGTERM in every thread; one thread waits for them.
    // SAFETY: plain libc signal-mask calls with a properly initialised set.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let s = open(cli)?;
    let exports = strata::serve::DiskExports::new(s.clone());
    let server = match tcp {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                tracing::warn!("serving on a non-loopback address {addr}: NBD has no authentication");
            }
            Server::bind_tcp(addr)?
        }
        None => {
            let path = socket.unwrap_or_else(|| store_location(&cli.store).join(".meta").join("nbd.sock"));
            if let Some(d) = path.parent() {
                std::fs::create_dir_all(d)?;
            }
            Server::bind_unix(&path).with_context(|| format!("Cannot listen on {}", path.display()))?
        }
    };
    let handle = server.serve(exports.clone())?;
    let disks: Vec<String> = strata::disk::list(&s)?.into_iter().map(|d| d.name).collect();
    ui::emit(cli.json, &serde_json::json!({"uri": handle.uri(""), "exports": disks}), || {
        format!("Serving {} disk(s) at {} (export name = disk name); Ctrl-C to stop", disks.len(), handle.uri("NAME"))
    });
    use std::io::Write;
    std::io::stdout().flush().ok();
    let mut sig: libc::c_int = 0;
    // SAFETY: waits on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    eprintln!("strata serve: signal {sig}, stopping");
    handle.shutdown();
    // Fold every open disk's log into its map, then report per-disk I/O counters (flushes vs
    // host fdatasyncs, guest/log/compaction bytes) for operators and benchmarks.
    let vols: Vec<(String, std::sync::Arc<strata::disk::volume::Volume>)> =
        disks.iter().filter_map(|d| exports.volume(d).map(|v| (d.clone(), v))).collect();
    exports.close_all()?;
    let stats: serde_json::Map<String, serde_json::Value> =
        vols.iter().map(|(d, v)| (d.clone(), serde_json::to_value(v.stats()).unwrap_or_default())).collect();
    eprintln!("strata serve: stats {}", serde_json::Value::Object(stats));
    s.close()?;
    Ok(())
}

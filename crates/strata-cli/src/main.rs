//! The `strata` command: a thin clap front end over the library.
//!
//! Each subcommand parses arguments, opens the store (location from `--store`, then
//! `$STRATA_STORE`, then the default in `store_location`), calls one library function, and
//! prints either a human summary or, with `--json`, one JSON document for scripts. Progress
//! bars come from the library's `Progress` trait, drawn with indicatif on a terminal only.

mod boot_cmd;
mod control;
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
    /// Create a new store: in the --store directory (the default), or in a remote backend
    /// with --backend, the --store directory then holding only this host's state. If the
    /// remote backend already holds a store, this host joins it.
    Init {
        /// Codec for writers that don't choose: none, lz4, zstd[:LEVEL].
        #[arg(long, default_value = "lz4")]
        codec: String,
        /// Target pack size, e.g. 32M (default: what the backend prefers, see docs/backends.md).
        #[arg(long)]
        pack_size: Option<String>,
        /// s3://BUCKET[/PREFIX] (endpoint and credentials from AWS_ENDPOINT_URL,
        /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP) or
        /// redis://HOST:PORT.
        #[arg(long)]
        backend: Option<String>,
        /// Host-local SSD cache directory in front of a remote backend.
        #[arg(long, requires = "cache_size")]
        cache: Option<PathBuf>,
        /// Size of the cache file, e.g. 20G.
        #[arg(long, requires = "cache")]
        cache_size: Option<String>,
    },
    /// Cache and backend counters (of the running `strata serve` if there is one).
    Stats,
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
        /// Read straight from the backend, bypassing the SSD cache (for comparisons).
        #[arg(long)]
        no_cache: bool,
        /// Do not prefetch a recorded boot working set into the cache when a clone of its
        /// image is opened (prefetch is on whenever there is a cache).
        #[arg(long)]
        no_prefetch: bool,
    },
    /// VM memory: save, live checkpoints, restore, list, rm, inspect.
    Vm {
        #[command(subcommand)]
        cmd: vm::VmCmd,
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

/// Keep freed heap memory for reuse instead of handing it back to the kernel at once.
///
/// A save moves ~1 MiB batch buffers, frame outputs and pack buffers between threads. With
/// glibc's defaults, blocks that size are mmapped or trimmed on free, so the next one is fresh
/// memory: a 128 MiB save to S3 took ~23,000 page faults (each zeroed and charged to the
/// cgroup), ~5% of the two cores. Allocations under 32 MiB now come from the heap, and only
/// more than 64 MiB of free space at a heap's top is trimmed, so an idle daemon still
/// shrinks after a large save.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}

fn main() {
    tune_malloc();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "warn".into()),
        )
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
    let n: u64 = num
        .trim()
        .parse()
        .with_context(|| format!("Invalid size '{s}': expected e.g. 4096, 64K, 30G"))?;
    n.checked_mul(mult).with_context(|| format!("Size '{s}' is too large"))
}

fn open(cli: &Cli) -> Result<Store> {
    Ok(open_host(cli, false)?.store)
}

fn open_host(cli: &Cli, no_cache: bool) -> Result<strata::host::Host> {
    let loc = store_location(&cli.store);
    strata::host::open(&loc, &strata::host::OpenOptions { no_cache })
        .with_context(|| format!("Cannot open store at {}", loc.display()))
}

fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Init { codec, pack_size, backend, cache, cache_size } => {
            let loc = store_location(&cli.store);
            let codec: Codec = codec.parse()?;
            let pack_size = pack_size.as_deref().map(parse_size).transpose()?.unwrap_or(0);
            let cache = match (cache, cache_size) {
                (Some(dir), Some(size)) => {
                    Some(strata::host::CacheConfig { dir: dir.clone(), size: parse_size(size)? })
                }
                _ => None,
            };
            let (h, created) = strata::host::init(
                &loc,
                backend.as_deref(),
                cache,
                InitOptions { pack_size, default_codec: codec },
            )
            .with_context(|| {
                format!(
                    "Cannot create store at {}",
                    backend.as_deref().unwrap_or(&loc.display().to_string())
                )
            })?;
            let where_ = h.store.location().to_string();
            let cfg = h.store.config().settings.clone();
            let cache_dir = h.config.as_ref().and_then(|c| c.cache.clone());
            h.store.close()?;
            ui::emit(
                cli.json,
                &serde_json::json!({"store": loc, "backend": where_, "created": created, "codec": cfg.default_codec,
                    "pack_size": cfg.pack_size, "cache": cache_dir}),
                || {
                    let verb = if created {
                        "Created strata store"
                    } else {
                        "Joined the existing strata store"
                    };
                    let mut t = format!(
                        "{verb} in {where_} (codec {}, packs of {} bytes)",
                        cfg.default_codec, cfg.pack_size
                    );
                    if h.config.is_some() {
                        t += &format!("\nThis host's state is in {}", loc.display());
                    }
                    if let Some(c) = &cache_dir {
                        t +=
                            &format!("; SSD cache of {} in {}", ui::human(c.size), c.dir.display());
                    }
                    t
                },
            );
        }
        Cmd::Stats => stats(&cli)?,
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
            // A running `strata serve` keeps the store open, so it runs the GC itself.
            let local = store_location(&cli.store).join(".meta");
            let r = match control::request(&local, "gc")? {
                Some(r) => r,
                None => {
                    let s = open(&cli)?;
                    let p = ui::bar(cli.json);
                    let r = s.gc(&p)?;
                    drop(p);
                    serde_json::to_value(r)?
                }
            };
            let n = |k: &str| r[k].as_u64().unwrap_or(0);
            ui::emit(cli.json, &r, || {
                format!(
                    "Collected {} dead chunks: {} packs deleted, {} repacked, {} orphan packs removed, {} freed",
                    n("dead_chunks"),
                    n("packs_deleted"),
                    n("packs_repacked"),
                    n("orphan_packs_deleted"),
                    ui::human(n("bytes_freed"))
                )
            });
        }
        Cmd::Refs { prefix } => {
            let s = open(&cli)?;
            let refs = s.list_refs(prefix)?;
            ui::emit(cli.json, &refs, || refs.join("\n"));
        }
        Cmd::Disk { cmd } => {
            let h = open_host(&cli, false)?;
            disk_cmd(&h.store, h.cache.as_deref(), cmd, cli.json)?;
        }
        Cmd::Serve { socket, tcp, no_cache, no_prefetch } => {
            serve(&cli, socket.clone(), *tcp, *no_cache, *no_prefetch)?
        }
        Cmd::Vm { cmd } => vm::run(&store_location(&cli.store), cli.json, cmd)?,
    }
    Ok(())
}

fn disk_cmd(
    s: &Store,
    cache: Option<&strata::backend::cache::CacheBackend>,
    cmd: &DiskCmd,
    json: bool,
) -> Result<()> {
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
        DiskCmd::Warm { name, parallel } => boot_cmd::warm(s, cache, name, *parallel, json)?,
        DiskCmd::Rm { name } => {
            disk::remove(s, name)?;
            ui::emit(json, &serde_json::json!({"removed": name}), || {
                format!("Removed disk '{name}' (run `strata gc` to reclaim space)")
            });
        }
    }
    Ok(())
}

/// Block SIGINT and SIGTERM in this thread and every thread it starts afterwards, so one
/// thread can wait for them (sigtimedwait) and stop cleanly. Returns the blocked set.
pub(crate) fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-mask calls with a properly initialised set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn serve(
    cli: &Cli,
    socket: Option<PathBuf>,
    tcp: Option<std::net::SocketAddr>,
    no_cache: bool,
    no_prefetch: bool,
) -> Result<()> {
    use strata::nbd::Server;
    // Block SIGINT/SIGTERM in every thread; one thread waits for them.
    let set = block_stop_signals();
    let host = open_host(cli, no_cache)?;
    let s = host.store.clone();
    let exports = strata::serve::DiskExports::new(s.clone());
    if let (Some(c), false) = (&host.cache, no_prefetch) {
        exports.enable_prefetch(c.clone(), strata::boot::prefetch::DEFAULT_PARALLEL);
    }
    let server = match tcp {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                tracing::warn!(
                    "serving on a non-loopback address {addr}: NBD has no authentication"
                );
            }
            Server::bind_tcp(addr)?
        }
        None => {
            let path =
                socket.unwrap_or_else(|| store_location(&cli.store).join(".meta").join("nbd.sock"));
            if let Some(d) = path.parent() {
                std::fs::create_dir_all(d)?;
            }
            Server::bind_unix(&path)
                .with_context(|| format!("Cannot listen on {}", path.display()))?
        }
    };
    let handle = server.serve(exports.clone())?;
    let control = control::Control::start(s.clone())?;
    let disks: Vec<String> = strata::disk::list(&s)?.into_iter().map(|d| d.name).collect();
    ui::emit(cli.json, &serde_json::json!({"uri": handle.uri(""), "exports": disks}), || {
        format!(
            "Serving {} disk(s) at {} (export name = disk name); Ctrl-C to stop",
            disks.len(),
            handle.uri("NAME")
        )
    });
    use std::io::Write;
    std::io::stdout().flush().ok();
    // Publish counters for `strata stats` while serving.
    let stats_path = s.local_dir().join(STATS_FILE);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, exports, cache, path, disks) =
            (stop.clone(), exports.clone(), host.cache.clone(), stats_path.clone(), disks.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                write_stats(&path, &exports, cache.as_deref(), &disks);
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        })
    };
    let mut sig: libc::c_int = 0;
    // SAFETY: waits on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = writer.join();
    let _ = std::fs::remove_file(&stats_path);
    eprintln!("strata serve: signal {sig}, stopping");
    handle.shutdown();
    drop(control);
    // Fold every open disk's log into its map, then report per-disk I/O counters (flushes vs
    // host fdatasyncs, guest/log/compaction bytes) for operators and benchmarks.
    let vols: Vec<(String, std::sync::Arc<strata::disk::volume::Volume>)> =
        disks.iter().filter_map(|d| exports.volume(d).map(|v| (d.clone(), v))).collect();
    exports.close_all()?;
    let stats: serde_json::Map<String, serde_json::Value> = vols
        .iter()
        .map(|(d, v)| (d.clone(), serde_json::to_value(v.stats()).unwrap_or_default()))
        .collect();
    eprintln!("strata serve: stats {}", serde_json::Value::Object(stats));
    s.close()?;
    Ok(())
}

const STATS_FILE: &str = "serve-stats.json";

/// The counters `strata stats` shows: store, SSD cache, backend, and per-disk I/O.
fn stats_value(
    store: &Store,
    cache: Option<&strata::backend::cache::CacheBackend>,
    volumes: serde_json::Value,
) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let st = store.stats();
    let b = store.backend();
    let caps = b.capabilities();
    serde_json::json!({
        "pid": std::process::id(),
        "unix_ms": strata::store::lease::now_ms(),
        "backend": {"name": b.name(), "native_range": caps.native_range, "preferred_pack_size": caps.preferred_pack_size,
            "bytes_from_backend": cache.map(|c| c.counters().bytes_from_backend())},
        "store": {"chunks_new": st.chunks_new.load(Relaxed), "chunks_dedup": st.chunks_dedup.load(Relaxed),
            "raw_bytes_new": st.raw_bytes_new.load(Relaxed), "stored_bytes_new": st.stored_bytes_new.load(Relaxed),
            "packs_written": st.packs_written.load(Relaxed), "syncs": st.syncs.load(Relaxed)},
        "cache": cache.map(|c| serde_json::json!({"dir": c.dir(), "counters": c.counters()})),
        "disks": volumes,
    })
}

fn write_stats(
    path: &std::path::Path,
    exports: &strata::serve::DiskExports,
    cache: Option<&strata::backend::cache::CacheBackend>,
    disks: &[String],
) {
    let vols: serde_json::Map<String, serde_json::Value> = disks
        .iter()
        .filter_map(|d| {
            exports
                .volume(d)
                .map(|v| (d.clone(), serde_json::to_value(v.stats()).unwrap_or_default()))
        })
        .collect();
    let mut v = stats_value(exports.store(), cache, serde_json::Value::Object(vols));
    v["prefetch"] = serde_json::to_value(exports.prefetches()).unwrap_or_default();
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, serde_json::to_vec_pretty(&v).unwrap_or_default()).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

fn stats(cli: &Cli) -> Result<()> {
    let loc = store_location(&cli.store);
    // A running `strata serve` owns the cache; show what it publishes.
    let local = loc.join(".meta");
    let live = std::fs::read(local.join(STATS_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .filter(|v| {
            let pid = v["pid"].as_u64().unwrap_or(0) as i32;
            // SAFETY: signal 0 only checks that the process exists.
            pid > 0 && unsafe { libc::kill(pid, 0) } == 0
        });
    let (v, source) = match live {
        Some(v) => (v, "strata serve"),
        None => {
            let h = open_host(cli, false)?;
            (
                stats_value(&h.store, h.cache.as_deref(), serde_json::json!({})),
                "this process (no strata serve running)",
            )
        }
    };
    ui::emit(cli.json, &v, || {
        let mut t = format!(
            "Counters of {source}\nbackend {}",
            v["backend"]["name"].as_str().unwrap_or("?")
        );
        if let Some(c) = v["cache"].as_object() {
            let k = &c["counters"];
            let (h, m) = (k["hits"].as_u64().unwrap_or(0), k["misses"].as_u64().unwrap_or(0));
            t += &format!(
                "\ncache {}: {} hits, {} misses ({:.1}% hit), {} coalesced, {} evictions, {} from backend, {} of {} used",
                c["dir"].as_str().unwrap_or("?"),
                h,
                m,
                if h + m > 0 { 100.0 * h as f64 / (h + m) as f64 } else { 0.0 },
                k["coalesced"].as_u64().unwrap_or(0),
                k["evictions"].as_u64().unwrap_or(0),
                ui::human(k["miss_bytes"].as_u64().unwrap_or(0) + k["bypass_bytes"].as_u64().unwrap_or(0)),
                ui::human(k["used_bytes"].as_u64().unwrap_or(0)),
                ui::human(k["capacity"].as_u64().unwrap_or(0)),
            );
        } else {
            t += "\nno SSD cache";
        }
        for p in v["prefetch"].as_array().into_iter().flatten() {
            t += &format!(
                "\nboot prefetch of {} ({}): {} of {} ranges, {} of {}{}",
                p["image"].as_str().unwrap_or("?"),
                p["state"].as_str().unwrap_or("?"),
                p["ranges_done"],
                p["ranges"],
                ui::human(p["bytes_done"].as_u64().unwrap_or(0)),
                ui::human(p["bytes"].as_u64().unwrap_or(0)),
                match p["ranges_failed"].as_u64().unwrap_or(0) {
                    0 => String::new(),
                    n => format!(", {n} ranges failed"),
                }
            );
        }
        let st = &v["store"];
        t += &format!(
            "\nstore: {} new chunks ({} stored), {} dedup hits, {} packs written, {} syncs",
            st["chunks_new"],
            ui::human(st["stored_bytes_new"].as_u64().unwrap_or(0)),
            st["chunks_dedup"],
            st["packs_written"],
            st["syncs"]
        );
        t
    });
    Ok(())
}

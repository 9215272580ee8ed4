//! `strata-bench`: the benchmarks, apart from the `strata` product binary.
//!
//! Each subcommand writes `docs/results/bench-<name>.{csv,json,svg}` (a table, the run's
//! environment and parameters, and a chart) and compares strata against what a user would use
//! instead, measured in the same run; ratios are reported because these machines are noisy.
//! Benchmarks that serve disks the way a deployment does spawn `strata serve`, the `strata`
//! binary next to this one (see [`disk::strata_binary`]).

mod chart;
mod disk;
mod guest;
mod hostmem;
mod io;
mod mem;
mod multifd;
mod objsync;
mod remote;
mod remote_disk;
mod remote_mem;
mod results;
mod snapshot;
mod store;
mod storm;
mod sync;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "strata-bench",
    version,
    about = "strata's benchmarks: tables and charts in docs/results/"
)]
struct Cli {
    /// Log level filter (e.g. info, strata::memory=debug); also $STRATA_LOG.
    #[arg(long, global = true, env = "STRATA_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    cmd: BenchCmd,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Chunk-store put/get throughput for 4 KiB and 64 KiB chunks with each codec, against
    /// writing the same bytes to a plain file with fsync (what `cp` + `sync` costs).
    Store {
        /// Bytes of data per case.
        #[arg(long, default_value = "128M")]
        size: String,
        /// Writer threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Where results go.
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        /// Scratch directory for the stores (default: a temp dir under /var/tmp).
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Host fdatasyncs per guest flush and 64 KiB append+flush throughput: strata against
    /// qemu-nbd serving qcow2 (default, lazy_refcounts) and raw, same qemu-io workloads.
    Sync {
        /// Write+flush pairs per case.
        #[arg(long, default_value_t = 200)]
        ops: usize,
        /// Skip the in-guest dd test (needs the guest fixtures).
        #[arg(long)]
        no_guest: bool,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// fio over NBD: 4 KiB random and 1 MiB sequential read/write, strata against qemu-nbd
    /// raw and qcow2.
    Io {
        /// Seconds per fio test.
        #[arg(long, default_value_t = 15)]
        runtime: u32,
        /// Store on an emulated 1 Gbit/s storage host (S3): no/cold/warm SSD cache against
        /// qemu-nbd serving raw/qcow2 there (needs root).
        #[arg(long)]
        remote: bool,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Full clones of a large image: strata's O(metadata) clone against
    /// `cp --sparse=always` and `qemu-img convert`, for 1, 2, 5 and 10 copies.
    Clone {
        /// Virtual size of the image.
        #[arg(long, default_value = "30G")]
        size: String,
        /// Bytes of data in it.
        #[arg(long, default_value = "3G")]
        data: String,
        #[arg(long, default_value = "1,2,5,10")]
        copies: String,
        /// Image on an emulated 1 Gbit/s storage host: strata on S3 against qemu-img convert
        /// between qemu-nbd servers there (needs root).
        #[arg(long)]
        remote: bool,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Boot storm: 1, 2, 5, 10 TCG guests boot together from clones of a golden
    /// image on an emulated storage host (1 Gbit/s link): strata with a cold cache, without
    /// it, and qemu-nbd qcow2 with overlays; plus the recorded boot trace replayed by N NBD
    /// clients, and one warmed-cache row. Needs root.
    Storm {
        #[arg(long, default_value = "1,2,5,10")]
        guests: String,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 224)]
        memory: u32,
        /// Requests in flight per replay client (0: the recorded boot's mean).
        #[arg(long, default_value_t = 0)]
        depth: usize,
        /// SSD cache size of each strata host.
        #[arg(long, default_value = "1G")]
        cache_size: String,
        /// Only the trace replay, no guest storms.
        #[arg(long)]
        no_guests: bool,
        /// Replay this trace (CSV from an earlier run) instead of recording one.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Network namespace and /24 of the storage host.
        #[arg(long, default_value = "strata-storm")]
        ns: String,
        #[arg(long, default_value = "10.211.0")]
        net: String,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Guest pause and total time of a desktop snapshot (`strata vm snapshot`: memory and
    /// disks) against a memory-only background snapshot and libvirt-style external snapshots
    /// (memory to a file + qcow2 overlays), rounds alternating, per guest size.
    Snapshot {
        /// Guest sizes in MiB.
        #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
        sizes: Vec<u32>,
        /// Rounds of every variant (medians with min/max are reported).
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// MiB of memory memwork holds in each guest.
        #[arg(long, default_value_t = 512)]
        resident: u32,
        /// MiB/s memwork rewrites during the runs.
        #[arg(long, default_value_t = 32)]
        dirty: u32,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    #[command(flatten)]
    Mem(mem::MemBenchCmd),
}

fn main() {
    strata::memory::tune_allocator();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(&cli.cmd) {
        eprintln!("strata-bench: {e:#}");
        std::process::exit(2);
    }
}

/// A comma-separated list of counts, e.g. `1,2,5,10`.
fn counts(s: &str, flag: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()
        .with_context(|| format!("{flag}: e.g. 1,2,5,10"))
}

fn run(cmd: &BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Store { size, threads, out, scratch } => {
            store::bench_store(parse_size(size)?, *threads, out, scratch.as_deref())
        }
        BenchCmd::Io { runtime, remote: true, out, scratch } => {
            remote_disk::bench_io_remote(*runtime, out, scratch.as_deref())
        }
        BenchCmd::Io { runtime, out, scratch, .. } => {
            io::bench_io(*runtime, out, scratch.as_deref())
        }
        BenchCmd::Sync { ops, no_guest, out, scratch } => {
            sync::bench_sync(*ops, !no_guest, out, scratch.as_deref())
        }
        BenchCmd::Clone { size, data, copies, remote, out, scratch } => {
            let (size, data, copies) =
                (parse_size(size)?, parse_size(data)?, counts(copies, "--copies")?);
            if *remote {
                remote_disk::bench_clone_remote(size, data, &copies, out, scratch.as_deref())
            } else {
                disk::bench_clone(size, data, &copies, out, scratch.as_deref())
            }
        }
        BenchCmd::Storm {
            guests,
            memory,
            depth,
            cache_size,
            no_guests,
            trace,
            ns,
            net,
            out,
            scratch,
        } => storm::bench_storm(&storm::StormOpts {
            guests: counts(guests, "--guests")?,
            memory_mib: *memory,
            depth: *depth,
            cache_size: parse_size(cache_size)?,
            no_guests: *no_guests,
            trace: trace.clone(),
            ns: ns.clone(),
            net: net.clone(),
            out: out.clone(),
            scratch: scratch.clone(),
        }),
        BenchCmd::Snapshot { sizes, rounds, resident, dirty, out, scratch } => {
            snapshot::bench_snapshot(&snapshot::SnapshotOpts {
                sizes: sizes.clone(),
                rounds: *rounds,
                resident_mib: *resident,
                dirty_mib_s: *dirty,
                out: out.clone(),
                scratch: scratch.clone(),
            })
        }
        BenchCmd::Mem(c) => mem::run(c),
    }
}

fn parse_size(s: &str) -> Result<u64> {
    Ok(strata::units::parse_size(s)?)
}

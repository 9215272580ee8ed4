//! `strata-bench codecs | save-restore | live`: the VM-memory benchmarks, on a real TCG
//! guest (`strata::fixtures` memory guest with the golden desktop disk attached).
//!
//! Every run boots the guest, loads the *desktop workload* — the golden disk's binaries,
//! libraries and data read into memory page-cache style (`text`), then anonymous memory with
//! 10% zero, 50% repeated and 40% unique random pages (`fill`) — so that most of RAM is
//! touched and the data is neither synthetic-only nor cherry-picked. Results go to
//! `docs/results/bench-<name>.{csv,json,svg}`, and every comparison is measured in the same
//! run, because these 2-core machines are noisy:
//! * `codecs`: ratio, compress and decompress MB/s and the expected
//!   transfer speeds Speed × (1 − Rate) of each codec on 64 KiB frames of the captured memory.
//! * `save-restore`: per guest size, save and restore time and stored bytes
//!   of strata against QEMU's `exec:cat > file` + `sync`, `exec:zstd -1`, `exec:lzop`.
//! * `live`: a guest dirtying memory at set rates, checkpointed by
//!   background-snapshot, precopy + cont and stop-and-copy: pause, total time, pages sent,
//!   stored and skipped by dedup, plus the cost of a second (incremental) checkpoint.
//!
//! LZO is GPL, so it is only built with the bench-only `lzo` cargo feature.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Subcommand;
use strata::fixtures::{Fixtures, Machine};
use strata::memory::manifest::Mode;
use strata::memory::restore::RestoreOptions;
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::memory::stream::{Event, Parser, SinkError};
use strata::progress::NoProgress;
use strata::qmp::QmpClient;
use strata::store::{InitOptions, Store};

use crate::chart::{bars, stack, Series};
use crate::guest::{
    available_mib, boot, desktop_guest, dirty_checkpoint, machine, qemu_restore, qemu_save, qmp_of,
    restore_verified, results_name, scratch_dir, start_dest, workload_guest, CheckpointCost,
    WorkloadMix, LIVE_MODES,
};
use crate::results::{env_json, write_outputs};

mod codecs;
mod live;
mod save_restore;
#[cfg(test)]
mod tests;

use codecs::bench_codecs;
use live::bench_live;
use save_restore::bench_save_restore;
pub(crate) use save_restore::file_len;

#[derive(Subcommand)]
pub enum MemBenchCmd {
    /// Codec ratio and speed on memory captured from a real guest.
    Codecs {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 1024)]
        mem: u32,
        /// MiB of captured non-zero pages each codec compresses (evenly sampled).
        #[arg(long, default_value_t = 256)]
        sample: u32,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        /// Scratch directory (default: a temp dir under /var/tmp).
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Save and restore time and stored bytes vs QEMU exec:cat + sync, zstd -1 and lzop.
    SaveRestore {
        /// Guest sizes in MiB.
        #[arg(long, value_delimiter = ',', default_value = "128,256,384,512,768,1024,2048")]
        sizes: Vec<u32>,
        /// pc or q35.
        #[arg(long, default_value = "pc")]
        machine: String,
        /// Also boot this many guests from the same image and save them all into one store
        /// (dedup across VMs); 0 skips.
        #[arg(long, default_value_t = 5)]
        vms: u32,
        /// RAM of each of those guests, MiB.
        #[arg(long, default_value_t = 512)]
        vms_mem: u32,
        /// Save to and restore from an emulated 1 Gbit/s storage host (S3 for strata, files
        /// there for the QEMU streams); --vms is ignored (needs root).
        #[arg(long)]
        remote: bool,
        /// Restore decoder threads for --remote (4 fetchers keep the ranged GETs in flight);
        /// default: what `strata vm restore` uses, the host's cores.
        #[arg(long)]
        restore_workers: Option<usize>,
        /// Codec of strata's saves for --remote: auto (measured per batch) or a fixed one
        /// (none, lz4, zstd:N), to compare the chooser against a fixed codec.
        #[arg(long, default_value = "auto")]
        codec: strata::memory::codec_choice::CodecPolicy,
        /// Rounds for --remote: every method saves and restores once per round, the methods
        /// taking turns at going first; medians are reported (the link and 2 cores are noisy).
        #[arg(long, default_value_t = 4)]
        rounds: u32,
        /// For --remote: do not warm host memory before each timed step. These hosts are VMs
        /// that hand free memory back to their hypervisor; by default every method's save and
        /// restore is preceded by touching and freeing memory, outside its clock, so it gets
        /// backed pages as on bare metal (see docs/results/README.md).
        #[arg(long)]
        no_warm: bool,
        /// For --remote: restore as a host that did not save the checkpoint. strata keeps the
        /// page maps it writes in the saving host's local tree cache; this deletes them before
        /// every strata restore, so they cross the link as on any other host.
        #[arg(long)]
        cold_maps: bool,
        /// What the guests' memory holds: `desktop` (half the free memory golden-file text,
        /// the rest 10% zero, 50% repeated and 40% random pages), `random` (incompressible),
        /// `text` (golden-file text only), `idle` (just booted), or KEY=VALUE,... over desktop
        /// (text=PCT,zero=PCT,repeat=PCT,fill=on|off). Other than desktop, the result files are
        /// named bench-save-restore[-remote]-workload-NAME.*.
        #[arg(long, default_value = "desktop")]
        workload: crate::guest::WorkloadMix,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Would QEMU's multifd make a save cheaper? The QEMU side measured alone: one stopped
    /// desktop guest migrated into exec:cat + sync, strata vm save, a drained unix socket and
    /// multifd with N drained channels (wall time, CPU of QEMU and of the receiver).
    Multifd {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 2048)]
        mem: u32,
        /// pc or q35.
        #[arg(long, default_value = "pc")]
        machine: String,
        /// multifd-channels values to try.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        channels: Vec<u32>,
        /// Rounds of every method (medians are reported).
        #[arg(long, default_value_t = 3)]
        reps: u32,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Live checkpoints of a guest dirtying memory.
    Live {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 1024)]
        mem: u32,
        /// Dirtying rates in MiB/s.
        #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
        rates: Vec<u32>,
        /// Keep the pages in Redis on an emulated 1 Gbit/s storage host (needs root).
        #[arg(long)]
        redis: bool,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
}

pub fn run(cmd: &MemBenchCmd) -> Result<()> {
    match cmd {
        MemBenchCmd::Codecs { mem, sample, out, scratch } => {
            bench_codecs(*mem, *sample, out, scratch.as_deref())
        }
        MemBenchCmd::SaveRestore {
            sizes,
            machine,
            remote: true,
            restore_workers,
            codec,
            rounds,
            no_warm,
            cold_maps,
            workload,
            out,
            scratch,
            ..
        } => crate::remote_mem::bench_save_restore_remote(
            sizes,
            machine,
            restore_workers
                .unwrap_or_else(|| strata::memory::restore::RestoreOptions::default().workers),
            *codec,
            *rounds,
            !*no_warm,
            *cold_maps,
            workload,
            out,
            scratch.as_deref(),
        ),
        MemBenchCmd::SaveRestore {
            sizes, machine, vms, vms_mem, workload, out, scratch, ..
        } => bench_save_restore(sizes, machine, *vms, *vms_mem, workload, out, scratch.as_deref()),
        MemBenchCmd::Multifd { mem, machine, channels, reps, out, scratch } => {
            crate::multifd::bench_multifd(*mem, machine, channels, *reps, out, scratch.as_deref())
        }
        MemBenchCmd::Live { mem, rates, redis: true, out, scratch } => {
            crate::remote_mem::bench_live_redis(*mem, rates, out, scratch.as_deref())
        }
        MemBenchCmd::Live { mem, rates, out, scratch, .. } => {
            bench_live(*mem, rates, out, scratch.as_deref())
        }
    }
}

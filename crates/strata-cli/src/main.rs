//! The `strata` command: a thin clap front end over the library.
//!
//! Each subcommand parses arguments, opens the store (location from `--store`, then
//! `$STRATA_STORE`, then the default in `store_location`), calls one library function, and
//! prints either a human summary or, with `--json`, one JSON document for scripts. Progress
//! bars come from the library's `Progress` trait, drawn with indicatif on a terminal only.

mod boot_cmd;
mod control;
mod desktop;
mod disk_cmd;
mod inspect;
mod serve;
mod store_cmd;
mod ui;
mod vm;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use strata::store::Store;

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
    /// Create a new store: in the --store directory (the default), or in a remote backend
    /// with --backend, the --store directory then holding only this host's state. If the
    /// remote backend already holds a store, this host joins it.
    Init(store_cmd::InitArgs),
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
        cmd: disk_cmd::DiskCmd,
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
        /// Close an NBD connection that has not finished its handshake this many seconds after
        /// connecting.
        #[arg(
            long,
            value_name = "SECS",
            default_value_t = strata::nbd::ServerConfig::default().handshake_timeout.as_secs(),
            value_parser = clap::value_parser!(u64).range(1..)
        )]
        handshake_timeout: u64,
        /// NBD connections in handshake at once from one client (an IP address; on the Unix
        /// socket, a peer uid other than the server's own and root); further ones are closed.
        #[arg(
            long,
            value_name = "N",
            default_value_t = strata::nbd::ServerConfig::default().max_handshakes_per_client as u64,
            value_parser = clap::value_parser!(u64).range(1..)
        )]
        max_handshakes_per_client: u64,
    },
    /// VM memory: save, live checkpoints, restore, list, rm, inspect.
    Vm {
        #[command(subcommand)]
        cmd: vm::VmCmd,
    },
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
    Ok(strata::units::parse_size(s)?)
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
        Cmd::Init(args) => store_cmd::init(&cli, args)?,
        Cmd::Stats => serve::stats(&cli)?,
        Cmd::Check { quick } => store_cmd::check(&cli, *quick)?,
        Cmd::Inspect { kind, what } => {
            let s = open(&cli)?;
            inspect::run(&s, kind, what.as_deref(), cli.json)?;
        }
        Cmd::Du => store_cmd::du(&cli)?,
        Cmd::Gc => store_cmd::gc(&cli)?,
        Cmd::Refs { prefix } => {
            let s = open(&cli)?;
            let refs = s.list_refs(prefix)?;
            ui::emit(cli.json, &refs, || refs.join("\n"));
        }
        Cmd::Disk { cmd } => disk_cmd::run(&cli, cmd)?,
        Cmd::Serve {
            socket,
            tcp,
            no_cache,
            no_prefetch,
            handshake_timeout,
            max_handshakes_per_client,
        } => {
            let nbd = strata::nbd::ServerConfig {
                handshake_timeout: std::time::Duration::from_secs(*handshake_timeout),
                max_handshakes_per_client: *max_handshakes_per_client as usize,
                ..strata::nbd::ServerConfig::default()
            };
            serve::serve(&cli, socket.clone(), *tcp, *no_cache, *no_prefetch, nbd)?
        }
        Cmd::Vm { cmd } => vm::run(&store_location(&cli.store), cli.json, cmd)?,
    }
    Ok(())
}

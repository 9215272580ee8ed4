//! The serving daemon's control socket: how other `strata` processes on this host reach the
//! daemon that owns the store's open disks.
//!
//! `strata serve` holds each disk a client has opened as one volume (its lock and writer
//! lease), so a disk command run in another process would be refused the disk, and a GC must
//! run where the session pins of the writers are. Those commands ask the daemon instead, over
//! a Unix socket in the store's local state directory (`STORE/.meta/control.sock`, mode 0600).
//! The protocol (JSON lines; `docs/control.md`) is served by [`server`] and spoken by
//! [`client`]; a command that finds no daemon listening runs in its own process.

pub mod client;
pub mod server;

use std::path::{Path, PathBuf};

pub use client::request;
pub use server::Control;

const SOCKET: &str = "control.sock";

/// Where the daemon of the store whose local state is in `local_dir` listens.
pub fn socket_path(local_dir: &Path) -> PathBuf {
    local_dir.join(SOCKET)
}

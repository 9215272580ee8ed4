//! NBD server: serves named exports to QEMU, qemu-img, libnbd tools (nbdinfo, nbdcopy,
//! nbdfuse) and fio over Unix or TCP sockets.
//!
//! Split by concept so each piece can be tested without the others:
//! - `proto`: wire constants and fixed-size headers as pure functions over bytes;
//! - `export`: the `Export`/`ExportSet` traits, the seam where copy-on-write disks plug in;
//! - `handshake`: the fixed-newstyle negotiation as a socket-free state machine;
//! - `transmission`: request validation (pure) and the pipelined reader/worker engine;
//! - `server`: listeners, per-connection threads and graceful shutdown;
//! - `client`: a small blocking client (benchmarks replay block traces with it).
//!
//! Blocking threads, no async runtime (the library's design choice). See `docs/nbd.md` for
//! what is supported, the caps, and measured performance.

pub mod client;
pub mod export;
pub mod handshake;
pub mod proto;
pub mod server;
pub mod transmission;

pub use export::{
    BlockSize, Export, ExportError, ExportInfo, ExportSet, Extent, Hangup, OpenError,
};
pub use handshake::{
    Handshake, HandshakeError, Negotiated, Phase, MAX_OPTION_LEN, MAX_REQUEST_LEN,
};
pub use proto::{parse_request, NbdErrno, Request};
pub use server::{Server, ServerAddr, ServerConfig, ServerError, ServerHandle, Stopper};
pub use transmission::{check_request, Limits, TransmissionConfig};

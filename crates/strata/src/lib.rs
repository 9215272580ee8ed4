//! strata: content-addressed storage for VM disks and memory.
//!
//! Every top-level module sits on one layer and uses only the layers below it (checked by the
//! `layers` unit test; `ARCHITECTURE.md` draws the same table):
//!
//! ```text
//! 6  fixtures                      test guests (feature `testkit`)
//! 5  serve                         disks and snapshots as NBD exports
//! 4  boot                          boot traces, working sets, prefetch
//! 3  disk  memory  host            disk images, VM memory checkpoints, a host's stack
//! 2  store                         chunks, packs, index, refs, block maps, GC, check
//! 1  backend  page_hash  nbd  qmp  object stores and decorators; page hashing; protocols
//! 0  error  id  codec  progress  endian   the ground floor: imports nothing
//! ```
//!
//! The library never prints: progress goes through [`progress::Progress`], errors through one
//! `thiserror` enum per module. The binaries are `strata` (`crates/strata-cli`, the product
//! commands) and `strata-bench` (`crates/strata-bench`, the benchmark lab). Start reading at
//! `backend/mod.rs` and `store/mod.rs`.

pub mod backend;
pub mod boot;
pub mod codec;
pub mod disk;
pub mod endian;
pub mod error;
#[cfg(any(test, feature = "testkit"))]
pub mod fixtures;
pub mod host;
pub mod id;
#[cfg(test)]
mod layers;
pub mod memory;
pub mod nbd;
pub mod page_hash;
pub mod progress;
pub mod qmp;
pub mod serve;
pub mod store;
pub mod units;

pub use codec::Codec;
pub use error::error_chain;
pub use id::{ChunkId, PackId};
pub use store::{Session, Store, StoreError};

//! strata: content-addressed storage for VM disks and memory.
//!
//! Layers point downward only: `backend` (object stores) -> `store` (chunks, packs, refs,
//! GC) -> disk / memory views -> NBD / QMP -> the `strata` binary. Start reading at
//! `store/mod.rs`; `ARCHITECTURE.md` has the map.

pub mod backend;
pub mod boot;
pub mod codec;
pub mod disk;
pub mod endian;
pub mod fixtures;
pub mod host;
pub mod id;
pub mod memory;
pub mod nbd;
pub mod page_hash;
pub mod progress;
pub mod qmp;
pub mod serve;
pub mod store;

pub use codec::Codec;
pub use id::{ChunkId, PackId};
pub use store::{Session, Store, StoreError};

/// An error and its sources, joined with ": " for one-line reports (check reports, the
/// daemon's control replies, test assertions).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

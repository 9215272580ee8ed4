//! strata: content-addressed storage for VM disks and memory.
//!
//! Layers point downward only: `backend` (object stores) -> `store` (chunks, packs, refs,
//! GC) -> disk / memory views -> NBD / QMP -> the `strata` binary. Start reading at
//! `store/mod.rs`; `ARCHITECTURE.md` has the map.

pub mod backend;
pub mod boot;
pub mod codec;
pub mod disk;
pub mod error;
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
pub use error::error_chain;
pub use id::{ChunkId, PackId};
pub use store::{Session, Store, StoreError};

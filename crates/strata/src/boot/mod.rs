//! Boot storms: record which blocks a guest's boot reads, keep that as a working set in the
//! backend, warm a host's SSD cache with it, and replay the block trace with many NBD clients.
//!
//! - `trace`: a recording wrapper around any NBD export set, and the trace's CSV form;
//! - `workset`: the persisted boot working set (`bootsets/<image>`, `docs/format-bootset.md`)
//!   and `warm`, which prefetches it into the cache (`strata disk warm`);
//! - `prefetch`: the same working set read into the cache in the background when `strata
//!   serve` opens a clone of the image (one per image per process);
//! - `replay`: N concurrent NBD clients replaying a trace's reads (the boot-storm benchmark).
//!
//! This sits above `disk`, `store` and the `nbd` protocol and below `serve` (which starts the
//! prefetches): it wraps exports and reads block maps, and never changes how either works.
//! Prefetching is a capability of the store's backend stack (`Backend::prefetch`), so nothing
//! here knows the SSD cache.

pub mod prefetch;
pub mod replay;
pub mod trace;
pub mod workset;

pub use prefetch::{Prefetch, PrefetchStatus};
pub use trace::{Recorder, Trace, TracingExports};
pub use workset::{warm, BootError, WarmReport, WorkingSet};

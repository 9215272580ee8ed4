//! Progress reporting seam: the library says what it is doing, the CLI draws it (indicatif).
//!
//! Long operations (check, gc, import, save, restore) take a `&dyn Progress`. The library
//! never prints; [`NoProgress`] discards everything for tests and scripts.

pub trait Progress: Send + Sync {
    /// A new phase begins; `total` is in `unit`s when known.
    fn phase(&self, name: &str, total: Option<u64>, unit: Unit);
    /// `n` more units done in the current phase.
    fn advance(&self, n: u64);
    /// A one-line note for the user (e.g. "codec lz4 chosen: backend 114 MB/s").
    fn note(&self, _msg: &str) {}
    /// The current phase is over.
    fn finish(&self) {}
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    Items,
}

/// Discards all progress.
pub struct NoProgress;

impl Progress for NoProgress {
    fn phase(&self, _: &str, _: Option<u64>, _: Unit) {}
    fn advance(&self, _: u64) {}
}

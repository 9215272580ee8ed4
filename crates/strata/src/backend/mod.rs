//! The backend seam: where the chunk store keeps its objects (packs, indexes, refs, config).
//!
//! One small object-store trait, in the spirit of restic's backend interface and nbdkit's
//! `can_*` callbacks: a handful of required operations, optional capabilities with defaults.
//! Keys are `/`-separated ASCII paths (`packs/ab/<hex>`, `index/<hex>`, `refs/<name>`, `config`).
//!
//! Contract every backend must meet (checked by `conformance`, built with feature `testkit`):
//! - `put` is atomic: a reader sees the whole old object, the whole new object, or (for a new
//!   key) nothing; never a prefix.
//! - A `put`/`delete` that returned Ok is *durable* only once a later `sync` returned Ok. After
//!   a crash, each unsynced operation may or may not have happened, independently.
//! - `put_if_absent` is atomic with respect to other writers of the same backend (leases build on it).
//! - Errors carry a kind (`NotFound`, `NoSpace`, `Unavailable`, ...) so callers can give advice.
//!
//! Optional capabilities: `get_range_to` (streamed ranges), `get_ranges` (merged ranges),
//! `put_shared` (no copy), `put_volatile`, `get_meta_range`, and `prefetch` (read ranges into
//! a cache, announced by `can_prefetch`). Decorators (`cache`, `retry`, fault injection) wrap
//! any `Backend` and forward what they do not change, so a capability of the backend under
//! them stays visible from above.

pub mod cache;
#[cfg(any(test, feature = "testkit"))]
pub mod conformance;
#[cfg(any(test, feature = "testkit"))]
pub mod fault;
pub mod local;
pub mod memory;
pub mod open;
pub mod redis;
pub mod retry;
pub mod s3;
#[cfg(feature = "testkit")]
pub mod servers;

use std::fmt;
use std::sync::Arc;

/// What a backend can do beyond the required operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `get_range` is served natively (not by reading the whole object).
    pub native_range: bool,
    /// Objects survive the process (false for the in-memory backend).
    pub persistent: bool,
    /// Largest object the backend accepts.
    pub max_object_size: u64,
    /// Pack size the store should aim for on this backend.
    pub preferred_pack_size: u64,
    /// Objects cross a network, and an acknowledged `put` is as durable as the backend gets
    /// (`sync` adds nothing). The store then starts uploads early (a pack is sealed as soon
    /// as the uploader is idle) and writes each pack's index object right after the pack.
    pub network: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            native_range: false,
            persistent: true,
            max_object_size: 5 << 30,
            preferred_pack_size: 32 << 20,
            network: false,
        }
    }
}

/// One listed object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    /// The device or bucket is full.
    NoSpace,
    /// The backend cannot be reached or has failed (dead server, crashed fault backend).
    Unavailable,
    PermissionDenied,
    /// A key or argument the backend refuses.
    Invalid,
    /// An optional capability this backend lacks (see [`Backend::can_prefetch`]).
    Unsupported,
    Other,
}

/// A backend failure, with the operation and key it concerns.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.describe())]
pub struct BackendError {
    pub kind: ErrorKind,
    pub op: &'static str,
    pub key: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl BackendError {
    pub fn new(kind: ErrorKind, op: &'static str, key: impl Into<String>) -> Self {
        BackendError { kind, op, key: key.into(), source: None }
    }

    pub fn with_source(
        kind: ErrorKind,
        op: &'static str,
        key: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        BackendError { kind, op, key: key.into(), source: Some(Box::new(source)) }
    }

    pub fn from_io(op: &'static str, key: impl Into<String>, e: std::io::Error) -> Self {
        let kind = match e.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            std::io::ErrorKind::InvalidInput => ErrorKind::Invalid,
            _ if e.raw_os_error() == Some(libc::ENOSPC)
                || e.raw_os_error() == Some(libc::EDQUOT) =>
            {
                ErrorKind::NoSpace
            }
            _ => ErrorKind::Other,
        };
        BackendError::with_source(kind, op, key, e)
    }

    pub fn is_not_found(&self) -> bool {
        self.kind == ErrorKind::NotFound
    }

    fn describe(&self) -> String {
        let what = match self.kind {
            ErrorKind::NotFound => "Object not found",
            ErrorKind::NoSpace => {
                "Backend is out of space (free space or grow the filesystem/bucket)"
            }
            ErrorKind::Unavailable => {
                "Backend is unavailable (check that the server is up and reachable)"
            }
            ErrorKind::PermissionDenied => "Backend denied access (check permissions/credentials)",
            ErrorKind::Invalid => "Backend refused the request",
            ErrorKind::Unsupported => "Backend cannot do this",
            ErrorKind::Other => "Backend I/O failed",
        };
        if self.key.is_empty() {
            format!("{what} during {}", self.op)
        } else {
            format!("{what} during {} of '{}'", self.op, self.key)
        }
    }
}

pub type BResult<T> = Result<T, BackendError>;

/// The object store under the chunk store.
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short human name for messages, e.g. `local:/var/lib/strata`.
    fn name(&self) -> String;

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// Read a whole object.
    fn get(&self, key: &str) -> BResult<Vec<u8>>;

    /// Read `len` bytes at `offset`. A range past the end is an `Invalid` error.
    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        let all = self.get(key)?;
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= all.len() as u64)
            .ok_or_else(|| BackendError::new(ErrorKind::Invalid, "get_range", key))?;
        Ok(all[offset as usize..end as usize].to_vec())
    }

    /// [`get_range`](Self::get_range) handed over as it arrives: `sink` gets consecutive pieces
    /// of the range, in order, `len` bytes in all, so a caller can work on the first bytes
    /// while the rest are on the link. On an error, the pieces already given stay valid and
    /// the rest can be read at `offset` plus what was given (the retry decorator resumes
    /// there). The default gives the whole range as one piece; decorators that keep it
    /// streaming forward it.
    fn get_range_to(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]),
    ) -> BResult<()> {
        let data = self.get_range(key, offset, len)?;
        sink(&data);
        Ok(())
    }

    /// [`get_range`](Self::get_range) of metadata read once per host (a network pack's tail,
    /// its index): caches pass it through instead of keeping it beside chunk data. Other
    /// decorators need not forward it: the default is their own `get_range`.
    fn get_meta_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        self.get_range(key, offset, len)
    }

    /// Read several ranges of one object: the result holds one buffer per range, in order.
    /// Backends that pay per request (S3) merge nearby ranges into fewer, concurrent reads;
    /// decorators forward the call whole so that merging happens. Errors as `get_range`.
    fn get_ranges(&self, key: &str, ranges: &[(u64, u64)]) -> BResult<Vec<Vec<u8>>> {
        ranges.iter().map(|&(off, len)| self.get_range(key, off, len)).collect()
    }

    /// Create or replace an object, atomically.
    fn put(&self, key: &str, data: &[u8]) -> BResult<()>;

    /// [`put`](Self::put) of a buffer the caller shares: a backend that sends from memory it
    /// owns (S3: the HTTP body) takes a reference instead of a copy, so the pack writer gets
    /// the buffer back for the next pack once the upload is done. Decorators forward it; the
    /// default copies through `put`.
    fn put_shared(&self, key: &str, data: &std::sync::Arc<Vec<u8>>) -> BResult<()> {
        self.put(key, data)
    }

    /// Like `put`, for objects that need not survive a power cut (leases, which then simply
    /// expire): backends that sync per object may skip it. Atomic all the same.
    fn put_volatile(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.put(key, data)
    }

    /// Create an object only if the key is free. Returns false (and writes nothing) if it exists.
    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool>;

    /// All objects whose key starts with `prefix`, in no particular order.
    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>>;

    /// Remove an object. Deleting a missing key is not an error.
    fn delete(&self, key: &str) -> BResult<()>;

    /// Make every completed `put`/`delete` durable.
    fn sync(&self) -> BResult<()>;

    /// Whether [`prefetch`](Self::prefetch) fills a cache: true for the SSD cache
    /// ([`cache::CacheBackend`]) and for decorators over one.
    fn can_prefetch(&self) -> bool {
        false
    }

    /// Read `ranges` (key, offset, length) into this backend's cache with `parallel` threads,
    /// so later reads of them are hits (a recorded boot working set, before a boot storm).
    /// Returns the bytes that had to come from below the cache. Backends without a cache
    /// return an `Unsupported` error; callers ask [`can_prefetch`](Self::can_prefetch) first.
    fn prefetch(&self, ranges: &[(String, u64, u64)], parallel: usize) -> BResult<u64> {
        let _ = (ranges, parallel);
        Err(BackendError::new(ErrorKind::Unsupported, "prefetch", ""))
    }

    /// Size of an object, or None if it does not exist.
    fn head(&self, key: &str) -> BResult<Option<u64>> {
        match self.get(key) {
            Ok(v) => Ok(Some(v.len() as u64)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }
}

pub type DynBackend = Arc<dyn Backend>;

/// Keys are relative `/`-separated paths of `[A-Za-z0-9._@=+-]` segments; no `.`/`..` segments.
pub fn validate_key(key: &str) -> BResult<()> {
    let ok = !key.is_empty()
        && key.len() <= 1024
        && key.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg.bytes().all(|b| b.is_ascii_alphanumeric() || b"._@=+-".contains(&b))
        });
    if ok {
        Ok(())
    } else {
        Err(BackendError::new(ErrorKind::Invalid, "validate", key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated() {
        assert!(validate_key("packs/ab/0123").is_ok());
        assert!(validate_key("refs/disk/desk-01@snap.1").is_ok());
        for bad in ["", "/abs", "a//b", "a/../b", "a/./b", "sp ace", "a/b/"] {
            assert!(validate_key(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn errors_name_op_key_and_advice() {
        let e = BackendError::from_io(
            "put",
            "packs/ab/cd",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(e.kind, ErrorKind::NoSpace);
        let msg = e.to_string();
        assert!(msg.contains("out of space") && msg.contains("packs/ab/cd"), "{msg}");
    }
}

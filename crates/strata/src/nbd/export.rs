//! The seam between the NBD server and whatever stores the bytes: one `Export` trait and one
//! `ExportSet` trait.
//!
//! Shaped like nbdkit's plugin callbacks: a few required methods (size, read, write, flush)
//! and optional capabilities that default to "not supported" (`can_trim`, `can_fast_zero`,
//! `can_multi_conn`, ...). The server derives the transmission flags from these answers once
//! per connection, so an export never sees a command it did not advertise. Every method takes
//! `&self` and may be called from several worker threads at once (and from several
//! connections when `can_multi_conn` is true): implementations do their own locking.
//! Errors carry a kind that maps onto the protocol's small errno set (`NbdErrno`).

use std::io;
use std::sync::Arc;

use super::proto::NbdErrno;

/// Why an export operation failed. The variant decides the NBD error code sent to the client.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("I/O error during {op} at offset {offset}")]
    Io {
        op: &'static str,
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("No space left for {op} at offset {offset}")]
    NoSpace { op: &'static str, offset: u64 },
    #[error("Invalid {op} at offset {offset}: {reason}")]
    Invalid { op: &'static str, offset: u64, reason: String },
    #[error("Export is read-only; {op} refused")]
    ReadOnly { op: &'static str },
    #[error("{op} is not supported by this export")]
    NotSupported { op: &'static str },
    #[error("Export is shutting down; {op} refused")]
    Shutdown { op: &'static str },
}

impl ExportError {
    /// Wrap an `io::Error`, keeping its kind visible to `errno()`.
    pub fn io(op: &'static str, offset: u64, source: io::Error) -> ExportError {
        ExportError::Io { op, offset, source }
    }

    /// The NBD error code for this failure. Host errnos that the protocol names are mapped
    /// as the spec asks (EDQUOT/EFBIG become ENOSPC); anything else is EIO.
    pub fn errno(&self) -> NbdErrno {
        match self {
            ExportError::Io { source, .. } => match source.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => NbdErrno::NoSpc,
                Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => NbdErrno::Perm,
                Some(libc::EINVAL) => NbdErrno::Inval,
                Some(libc::ENOMEM) => NbdErrno::NoMem,
                Some(libc::EOPNOTSUPP) => NbdErrno::NotSup,
                _ => NbdErrno::Io,
            },
            ExportError::NoSpace { .. } => NbdErrno::NoSpc,
            ExportError::Invalid { .. } => NbdErrno::Inval,
            ExportError::ReadOnly { .. } => NbdErrno::Perm,
            ExportError::NotSupported { .. } => NbdErrno::NotSup,
            ExportError::Shutdown { .. } => NbdErrno::Shutdown,
        }
    }
}

/// Why `ExportSet::open` refused a name. Becomes an option error reply (or, for the legacy
/// `NBD_OPT_EXPORT_NAME`, a closed connection, since that option cannot report errors).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("No export named '{name}'; list exports with `nbdinfo --list`")]
    NotFound { name: String },
    #[error("Export '{name}' is not available: {reason}")]
    Unavailable { name: String, reason: String },
    #[error("Export '{name}' refused by policy: {reason}")]
    Denied { name: String, reason: String },
}

/// One run of blocks with the same `base:allocation` status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (must be nonzero; zero-length extents are dropped by the server).
    pub len: u64,
    /// Not allocated in the backing store (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
}

impl Extent {
    pub fn data(len: u64) -> Extent {
        Extent { len, hole: false, zero: false }
    }
    pub fn hole(len: u64) -> Extent {
        Extent { len, hole: true, zero: true }
    }
    pub fn zero(len: u64) -> Extent {
        Extent { len, hole: false, zero: true }
    }
}

/// Block size constraints advertised with `NBD_INFO_BLOCK_SIZE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSize {
    /// Power of two, 1..=65536. Requests not aligned to it are refused with EINVAL.
    pub min: u32,
    /// Power of two, >= max(min, 512).
    pub preferred: u32,
    /// Largest READ/WRITE length; clamped by the server to its own cap (32 MiB).
    pub max: u32,
}

impl Default for BlockSize {
    fn default() -> BlockSize {
        BlockSize { min: 1, preferred: 4096, max: 32 << 20 }
    }
}

/// Ends one connection (see [`Export::on_revoke`]).
pub type Hangup = Arc<dyn Fn() + Send + Sync>;

/// A byte-addressed disk served over NBD. See the module comment for threading rules.
pub trait Export: Send + Sync {
    /// Size in bytes; fixed for the life of a connection.
    fn size(&self) -> u64;

    /// Fill `buf` from `offset`. The server has checked `offset + buf.len() <= size()`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError>;

    /// Write `data` at `offset`; with `fua`, the data must be durable before returning.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError>;

    /// Make every write that has completed (on ANY connection to this export) durable.
    fn flush(&self) -> Result<(), ExportError>;

    /// Writes are refused with EPERM and `NBD_FLAG_READ_ONLY` is advertised.
    fn is_read_only(&self) -> bool {
        false
    }

    /// Human-readable description for `NBD_INFO_DESCRIPTION`.
    fn description(&self) -> Option<String> {
        None
    }

    /// Advertise `NBD_FLAG_SEND_TRIM`.
    fn can_trim(&self) -> bool {
        false
    }

    /// Discard a range (a hint: contents afterwards are unspecified until rewritten).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        let _ = (offset, len, fua);
        Err(ExportError::NotSupported { op: "trim" })
    }

    /// The export has a native `write_zeroes` (otherwise the default writes zero buffers).
    fn can_zero(&self) -> bool {
        false
    }

    /// Zeroing is faster than writing (answers `NBD_CMD_FLAG_FAST_ZERO`; when false such
    /// requests fail at once with ENOTSUP and the client falls back to writing).
    fn can_fast_zero(&self) -> bool {
        false
    }

    /// Make `len` bytes at `offset` read as zero. `may_trim`: a hole may be punched (the
    /// client did not send NO_HOLE). The default writes zero buffers of at most 1 MiB.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> Result<(), ExportError> {
        let _ = may_trim;
        const STEP: u64 = 1 << 20;
        let zeroes = vec![0u8; len.min(STEP) as usize];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(STEP);
            self.write(offset + done, &zeroes[..n as usize], false)?;
            done += n;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Flush and FUA are visible across all connections (`NBD_FLAG_CAN_MULTI_CONN`).
    fn can_multi_conn(&self) -> bool {
        false
    }

    /// Called as a connection enters transmission with the function that ends it (the
    /// server stops reading; requests already received are answered, then it closes). An
    /// export that can be withdrawn while clients use it (a disk removed with `--force`)
    /// keeps a weak handle and calls it; the default ignores it. A request answered with
    /// [`ExportError::Shutdown`] ends its connection in any case.
    fn on_revoke(&self, hangup: &Hangup) {
        let _ = hangup;
    }

    /// Allocation status from `offset` for about `len` bytes. Return at least one extent;
    /// extents may cover less or more than asked (the server trims them). The default says
    /// "all allocated data", which is always correct.
    fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, ExportError> {
        let _ = offset;
        Ok(vec![Extent::data(len as u64)])
    }

    /// Block size constraints; the default is minimum 1, preferred 4096, maximum 32 MiB.
    fn block_size(&self) -> BlockSize {
        BlockSize::default()
    }
}

/// An entry of `NBD_OPT_LIST`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: Option<String>,
}

/// The named exports a server offers. `open` is called for `NBD_OPT_INFO`, `NBD_OPT_GO`,
/// `NBD_OPT_EXPORT_NAME` and to check names in meta-context options, so it should be cheap
/// (return a cached `Arc`). The empty name is the "default export": map it as you like or
/// answer `NotFound`.
pub trait ExportSet: Send + Sync {
    fn list(&self) -> Vec<ExportInfo>;
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, OpenError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping() {
        let e = |code| ExportError::io("write", 0, io::Error::from_raw_os_error(code)).errno();
        assert_eq!(e(libc::ENOSPC), NbdErrno::NoSpc);
        assert_eq!(e(libc::EDQUOT), NbdErrno::NoSpc);
        assert_eq!(e(libc::EFBIG), NbdErrno::NoSpc);
        assert_eq!(e(libc::EROFS), NbdErrno::Perm);
        assert_eq!(e(libc::EIO), NbdErrno::Io);
        assert_eq!(e(libc::ENXIO), NbdErrno::Io);
        assert_eq!(ExportError::ReadOnly { op: "write" }.errno(), NbdErrno::Perm);
        assert_eq!(ExportError::NotSupported { op: "trim" }.errno(), NbdErrno::NotSup);
        let kind_only = ExportError::io("read", 0, io::Error::other("x"));
        assert_eq!(kind_only.errno(), NbdErrno::Io);
    }

    #[test]
    fn messages_do_not_repeat_source() {
        let e = ExportError::io("read", 512, io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(e.to_string(), "I/O error during read at offset 512");
    }
}

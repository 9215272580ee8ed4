//! Byte-level helpers shared by every persisted object of the store, and the error type for
//! decoding them.
//!
//! All store formats are little-endian, start with an 8-byte ASCII magic and a u16 format
//! version (separate from the crate version), are covered by a CRC-32C, and have explicit size
//! caps checked *before* any allocation, so a hostile or corrupt object can't make a reader
//! allocate unbounded memory. `docs/format-store.md` has the byte tables; the unit tests in
//! each format file pin the offsets.

use crate::endian;

/// The on-disk format version this build writes and the newest it reads, for the store config,
/// refs, leases and tree chunks. Packs and index objects have their own
/// (`pack::PACK_VERSION`).
pub(crate) const FORMAT_VERSION: u16 = 1;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("Bad magic in {what}: expected {expected:?}")]
    BadMagic { what: &'static str, expected: &'static str },
    #[error("{what} has format version {found}, newer than this strata supports ({supported}): upgrade strata")]
    TooNew { what: &'static str, found: u16, supported: u16 },
    #[error("{what} is truncated: needs {needed} bytes, has {have}")]
    Truncated { what: &'static str, needed: u64, have: u64 },
    #[error("Checksum mismatch in {what}")]
    Checksum { what: &'static str },
    #[error("{what} field {field} = {value} exceeds the cap {cap}")]
    Cap { what: &'static str, field: &'static str, value: u64, cap: u64 },
    #[error("{what} is malformed: {detail}")]
    Malformed { what: &'static str, detail: String },
}

pub type FResult<T> = Result<T, FormatError>;

pub fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// A bounds-checked little-endian reader over a store object: [`endian::Reader`] with the
/// object's name, so a short read reports which object is truncated.
pub struct Rd<'a> {
    r: endian::Reader<'a>,
    what: &'static str,
}

impl<'a> Rd<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Rd { r: endian::Reader::new(buf), what }
    }
    pub fn pos(&self) -> usize {
        self.r.pos()
    }
    fn short(&self, e: endian::Short) -> FormatError {
        FormatError::Truncated { what: self.what, needed: e.needed, have: e.have }
    }
    pub fn bytes(&mut self, n: usize) -> FResult<&'a [u8]> {
        self.r.bytes(n).map_err(|e| self.short(e))
    }
    pub fn u8(&mut self) -> FResult<u8> {
        self.r.u8().map_err(|e| self.short(e))
    }
    pub fn u16(&mut self) -> FResult<u16> {
        self.r.u16_le().map_err(|e| self.short(e))
    }
    pub fn u32(&mut self) -> FResult<u32> {
        self.r.u32_le().map_err(|e| self.short(e))
    }
    pub fn u64(&mut self) -> FResult<u64> {
        self.r.u64_le().map_err(|e| self.short(e))
    }
    pub fn arr<const N: usize>(&mut self) -> FResult<[u8; N]> {
        self.r.array().map_err(|e| self.short(e))
    }
    /// Check the magic and the version (older or equal versions are accepted).
    pub fn magic_version(&mut self, magic: &'static [u8; 8]) -> FResult<u16> {
        self.magic_version_upto(magic, FORMAT_VERSION)
    }
    /// Check the magic and that the version is 1 to `newest`.
    pub fn magic_version_upto(&mut self, magic: &'static [u8; 8], newest: u16) -> FResult<u16> {
        if self.bytes(8)? != magic {
            return Err(FormatError::BadMagic {
                what: self.what,
                expected: std::str::from_utf8(magic).unwrap_or("?"),
            });
        }
        let v = self.u16()?;
        if v > newest || v == 0 {
            return Err(FormatError::TooNew { what: self.what, found: v, supported: newest });
        }
        Ok(v)
    }
}

/// Flags and reserved fields must be zero in every format version so far.
pub fn zero(what: &'static str, field: &'static str, value: u64) -> FResult<()> {
    if value != 0 {
        Err(FormatError::Malformed { what, detail: format!("{field} is {value:#x}, must be 0") })
    } else {
        Ok(())
    }
}

/// Fail with a cap error when `value > cap`.
pub fn cap(what: &'static str, field: &'static str, value: u64, cap: u64) -> FResult<()> {
    if value > cap {
        Err(FormatError::Cap { what, field, value, cap })
    } else {
        Ok(())
    }
}

/// Little-endian append helpers.
pub trait Wr {
    fn u16le(&mut self, v: u16);
    fn u32le(&mut self, v: u32);
    fn u64le(&mut self, v: u64);
}

impl Wr for Vec<u8> {
    fn u16le(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn u32le(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn u64le(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
}

//! Checked byte-order decoding: the one place the crate turns bytes into integers.
//!
//! [`Reader`] is a cursor over a byte slice that reads little- and big-endian integers and
//! fixed-size arrays, and fails with [`Short`] instead of panicking when the input ends early,
//! so a hostile or torn object can only produce an error. The positional `*_at` functions are
//! the same checked reads at a fixed offset (returning `None` on short input). The `le*` /
//! `be*` functions without `_at` are for callers that have already checked the length (a
//! fixed-size header, a slice whose length a guard just proved); they panic on short input
//! like slice indexing does.
//!
//! This module is the ground floor: it imports nothing from the crate, so every layer
//! (store formats, the disk log, NBD, the QEMU stream parser) can use it.

/// A read ran past the end of its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("Input is truncated: needs {needed} bytes, has {have}")]
pub struct Short {
    /// Bytes the read needed from the start of the input.
    pub needed: u64,
    /// Bytes the input has.
    pub have: u64,
}

/// A bounds-checked cursor over a byte slice.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

macro_rules! reads {
    ($($name:ident: $t:ty = $from:ident;)*) => {$(
        #[doc = concat!("Read a `", stringify!($t), "` (`", stringify!($from), "`).")]
        pub fn $name(&mut self) -> Result<$t, Short> {
            self.array().map(<$t>::$from)
        }
    )*};
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    /// Bytes consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Bytes left to read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// The unread rest of the input (the cursor does not move).
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], Short> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(Short {
            needed: (self.pos as u64).saturating_add(n as u64),
            have: self.buf.len() as u64,
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    /// Skip `n` bytes.
    pub fn skip(&mut self, n: usize) -> Result<(), Short> {
        self.bytes(n).map(|_| ())
    }
    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let b = self.bytes(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, Short> {
        Ok(self.bytes(1)?[0])
    }
    reads! {
        u16_le: u16 = from_le_bytes;
        u32_le: u32 = from_le_bytes;
        u64_le: u64 = from_le_bytes;
        u16_be: u16 = from_be_bytes;
        u32_be: u32 = from_be_bytes;
        u64_be: u64 = from_be_bytes;
    }
}

/// The `N` bytes at `at`, or `None` when `b` is shorter than `at + N`.
pub fn array_at<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    let s = b.get(at..at.checked_add(N)?)?;
    let mut a = [0u8; N];
    a.copy_from_slice(s);
    Some(a)
}

macro_rules! positional {
    ($($checked:ident, $unchecked:ident: $t:ty = $from:ident;)*) => {$(
        #[doc = concat!("The `", stringify!($t), "` (`", stringify!($from), "`) at `at`, or \
            `None` when `b` is too short.")]
        pub fn $checked(b: &[u8], at: usize) -> Option<$t> {
            array_at(b, at).map(<$t>::$from)
        }
        #[doc = concat!("The `", stringify!($t), "` (`", stringify!($from), "`) at `at`, for \
            callers that checked the length.\n\n# Panics\n\nWhen `b` is shorter than `at` \
            plus the integer's size.")]
        pub fn $unchecked(b: &[u8], at: usize) -> $t {
            match $checked(b, at) {
                Some(v) => v,
                None => panic!(
                    "{} at {at} past the end of {} bytes",
                    stringify!($t),
                    b.len()
                ),
            }
        }
    )*};
}

positional! {
    le16_at, le16: u16 = from_le_bytes;
    le32_at, le32: u32 = from_le_bytes;
    le64_at, le64: u64 = from_le_bytes;
    be16_at, be16: u16 = from_be_bytes;
    be32_at, be32: u32 = from_be_bytes;
    be64_at, be64: u64 = from_be_bytes;
}

/// The `N` bytes at `at` as an array, for callers that checked the length.
///
/// # Panics
///
/// When `b` is shorter than `at + N`.
pub fn array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    match array_at(b, at) {
        Some(a) => a,
        None => panic!("{N} bytes at {at} past the end of {} bytes", b.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_reads_both_byte_orders_and_stops_at_the_end() {
        let b = [1, 0, 0, 0, 0, 0, 0, 2, 0xaa, 0xbb];
        let mut r = Reader::new(&b);
        assert_eq!(r.u32_le(), Ok(1));
        assert_eq!(r.u32_be(), Ok(2));
        assert_eq!(r.remaining(), 2);
        assert_eq!(r.u32_le(), Err(Short { needed: 12, have: 10 }));
        assert_eq!(r.pos(), 8, "a failed read does not move the cursor");
        assert_eq!(r.rest(), &[0xaa, 0xbb]);
        assert_eq!(r.array::<2>(), Ok([0xaa, 0xbb]));
        assert_eq!(r.u8(), Err(Short { needed: 11, have: 10 }));
        assert_eq!(Reader::new(&b).bytes(usize::MAX), Err(Short { needed: u64::MAX, have: 10 }));
    }

    #[test]
    fn positional_reads_are_checked() {
        let b = [0x12, 0x34, 0x56, 0x78];
        assert_eq!(le32_at(&b, 0), Some(0x7856_3412));
        assert_eq!(be32(&b, 0), 0x1234_5678);
        assert_eq!(be16(&b, 2), 0x5678);
        assert_eq!(le16_at(&b, 3), None);
        assert_eq!(le64_at(&b, 0), None);
        assert_eq!(array_at::<2>(&b, usize::MAX), None);
        assert_eq!(array::<3>(&b, 1), [0x34, 0x56, 0x78]);
        assert!(std::panic::catch_unwind(|| be64(&b, 0)).is_err());
    }
}

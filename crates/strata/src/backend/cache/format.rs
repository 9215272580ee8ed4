//! On-disk format of the SSD cache: the data file header and the index log
//! (`docs/format-cache.md` has the byte tables; the tests below pin them).
//!
//! Two files in the cache directory:
//! - `cache.data`: a 4096-byte header, then the buddy region holding entry bytes.
//! - `cache.index`: a 64-byte header, then an append-only log of `Insert`/`Remove` records,
//!   each with its own CRC-32C. It is replayed at open and rewritten compacted.
//!
//! Nothing here is ever fsynced, on purpose: a cache may lose entries, but it must never return
//! wrong bytes, and that is guaranteed by the BLAKE3 hash each `Insert` records for its bytes and
//! that every hit re-checks. A torn or lost record therefore costs an entry, never correctness,
//! and a record whose block was rewritten later simply fails its hash check.
//!
//! Parsing is pure over `&[u8]` (fuzzable): [`parse_data_header`], [`parse_index_header`],
//! [`parse_records`].

use crate::endian;
use thiserror::Error;

pub(crate) const DATA_MAGIC: &[u8; 8] = b"STRACDAT";
pub(crate) const INDEX_MAGIC: &[u8; 8] = b"STRACIDX";
pub(crate) const VERSION: u32 = 1;
pub(crate) const DATA_HEADER_LEN: u64 = 4096;
pub(crate) const INDEX_HEADER_LEN: usize = 64;
/// Bytes of BLAKE3 kept per entry.
pub(crate) const HASH_LEN: usize = 16;
pub(crate) const REC_INSERT: u8 = 1;
pub(crate) const REC_REMOVE: u8 = 2;
/// Longest key a record may carry (backend keys are at most 1024 bytes).
pub(crate) const MAX_KEY: usize = 1024;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("Cache {what} has a bad magic number (not a strata cache file)")]
    Magic { what: &'static str },
    #[error("Cache {what} is format version {found}, this build reads {VERSION}")]
    Version { what: &'static str, found: u32 },
    #[error("Cache {what} header checksum mismatch")]
    Checksum { what: &'static str },
    #[error("Cache {what} is too short ({len} bytes)")]
    Short { what: &'static str, len: usize },
    #[error("Cache {what} header field {field} is invalid")]
    Field { what: &'static str, field: &'static str },
}

/// Geometry and identity shared by both headers; a mismatch means "start afresh".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Random id tying an index to its data file.
    pub instance: [u8; 16],
    pub region_size: u64,
    /// log2 of the smallest block.
    pub min_shift: u8,
    pub top_order: u8,
}

impl Geometry {
    fn check(&self, what: &'static str) -> Result<(), FormatError> {
        let shift_ok = (9..=20).contains(&self.min_shift) && self.top_order <= 24;
        if !shift_ok {
            return Err(FormatError::Field { what, field: "min_shift/top_order" });
        }
        let top = 1u64 << (self.min_shift as u32 + self.top_order as u32);
        if self.region_size == 0 || self.region_size & (top - 1) != 0 {
            return Err(FormatError::Field { what, field: "region_size" });
        }
        Ok(())
    }
}

/// Data file header, 4096 bytes:
/// `magic[8] version u32 flags u32 instance[16] region_size u64 min_shift u8 top_order u8
/// reserved[18] crc32c u32` (the CRC over bytes 0..60), then zeros.
pub fn encode_data_header(g: &Geometry) -> Vec<u8> {
    let mut b = encode_header(DATA_MAGIC, g);
    b.resize(DATA_HEADER_LEN as usize, 0);
    b
}

pub fn parse_data_header(b: &[u8]) -> Result<Geometry, FormatError> {
    parse_header(b, DATA_MAGIC, "data file")
}

/// Index header, 64 bytes: same layout as the first 64 bytes of the data header, other magic.
pub fn encode_index_header(g: &Geometry) -> Vec<u8> {
    encode_header(INDEX_MAGIC, g)
}

pub fn parse_index_header(b: &[u8]) -> Result<Geometry, FormatError> {
    parse_header(b, INDEX_MAGIC, "index")
}

fn encode_header(magic: &[u8; 8], g: &Geometry) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(magic);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&g.instance);
    b.extend_from_slice(&g.region_size.to_le_bytes());
    b.push(g.min_shift);
    b.push(g.top_order);
    b.extend_from_slice(&[0u8; 18]);
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(b.len(), INDEX_HEADER_LEN);
    b
}

fn parse_header(b: &[u8], magic: &[u8; 8], what: &'static str) -> Result<Geometry, FormatError> {
    if b.len() < INDEX_HEADER_LEN {
        return Err(FormatError::Short { what, len: b.len() });
    }
    if &b[0..8] != magic {
        return Err(FormatError::Magic { what });
    }
    let crc = endian::le32(b, 60);
    if crc32c::crc32c(&b[..60]) != crc {
        return Err(FormatError::Checksum { what });
    }
    let version = endian::le32(b, 8);
    if version != VERSION {
        return Err(FormatError::Version { what, found: version });
    }
    if b[12..16] != [0; 4] || b[42..60] != [0; 18] {
        return Err(FormatError::Field { what, field: "flags/reserved" });
    }
    let g = Geometry {
        instance: endian::array(b, 16),
        region_size: endian::le64(b, 32),
        min_shift: b[40],
        top_order: b[41],
    };
    g.check(what)?;
    Ok(g)
}

/// One log record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// `len` bytes of object `key` at `obj_off` live in the block at `block` of `order`.
    Insert { block: u64, order: u8, len: u32, hash: [u8; HASH_LEN], obj_off: u64, key: String },
    /// The block at `block` no longer holds an entry.
    Remove { block: u64 },
}

/// Record framing: body_len u32, type u8, body, crc32c u32 over (body_len, type, body).
///
/// Insert body (35 + key bytes): `block u64, order u8, len u32, hash[16], obj_off u64,
/// key_len u16, key`. Remove body (8): `block u64`.
pub fn encode_record(r: &Record, out: &mut Vec<u8>) {
    let start = out.len();
    let mut body = Vec::with_capacity(64);
    let ty = match r {
        Record::Insert { block, order, len, hash, obj_off, key } => {
            body.extend_from_slice(&block.to_le_bytes());
            body.push(*order);
            body.extend_from_slice(&len.to_le_bytes());
            body.extend_from_slice(hash);
            body.extend_from_slice(&obj_off.to_le_bytes());
            body.extend_from_slice(&(key.len() as u16).to_le_bytes());
            body.extend_from_slice(key.as_bytes());
            REC_INSERT
        }
        Record::Remove { block } => {
            body.extend_from_slice(&block.to_le_bytes());
            REC_REMOVE
        }
    };
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.push(ty);
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Decode records from the log bytes after the header. Stops at the first record that is
/// short, fails its CRC or is malformed (a torn tail after a crash). Returns the records and
/// the number of bytes they span, so the caller can truncate the rest.
pub fn parse_records(b: &[u8]) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while let Some((r, n)) = parse_one(&b[pos..]) {
        out.push(r);
        pos += n;
    }
    (out, pos)
}

fn parse_one(b: &[u8]) -> Option<(Record, usize)> {
    let body_len = u32::from_le_bytes(b.get(0..4)?.try_into().ok()?) as usize;
    if body_len > 64 + MAX_KEY {
        return None;
    }
    let total = 4 + 1 + body_len + 4;
    let rec = b.get(..total)?;
    let crc = u32::from_le_bytes(rec[total - 4..].try_into().ok()?);
    if crc32c::crc32c(&rec[..total - 4]) != crc {
        return None;
    }
    let body = &rec[5..total - 4];
    let u64at = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(body.get(i..i + 8)?.try_into().ok()?))
    };
    let r = match rec[4] {
        REC_INSERT => {
            let block = u64at(0)?;
            let order = *body.get(8)?;
            let len = u32::from_le_bytes(body.get(9..13)?.try_into().ok()?);
            let hash: [u8; HASH_LEN] = body.get(13..29)?.try_into().ok()?;
            let obj_off = u64at(29)?;
            let key_len = u16::from_le_bytes(body.get(37..39)?.try_into().ok()?) as usize;
            if body.len() != 39 + key_len || key_len == 0 || key_len > MAX_KEY {
                return None;
            }
            let key = std::str::from_utf8(&body[39..]).ok()?.to_string();
            Record::Insert { block, order, len, hash, obj_off, key }
        }
        REC_REMOVE if body.len() == 8 => Record::Remove { block: u64at(0)? },
        _ => return None,
    };
    Some((r, total))
}

/// BLAKE3 of an entry's bytes, truncated to 16 bytes (`HASH_LEN`).
pub fn entry_hash(data: &[u8]) -> [u8; HASH_LEN] {
    let h = blake3::hash(data);
    h.as_bytes()[..HASH_LEN].try_into().expect("16 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> Geometry {
        Geometry { instance: [0xAB; 16], region_size: 64 << 20, min_shift: 12, top_order: 12 }
    }

    #[test]
    fn header_layout_is_pinned() {
        let h = encode_index_header(&geo());
        assert_eq!(h.len(), 64);
        assert_eq!(&h[0..8], b"STRACIDX");
        assert_eq!(&h[8..12], &1u32.to_le_bytes());
        assert_eq!(&h[12..16], &[0; 4]);
        assert_eq!(&h[16..32], &[0xAB; 16]);
        assert_eq!(&h[32..40], &(64u64 << 20).to_le_bytes());
        assert_eq!((h[40], h[41]), (12, 12));
        assert_eq!(&h[42..56], &[0; 14]);
        assert_eq!(&h[56..60], &[0; 4], "reserved up to the CRC");
        assert_eq!(&h[60..64], &crc32c::crc32c(&h[..60]).to_le_bytes());
        assert_eq!(parse_index_header(&h).unwrap(), geo());

        let d = encode_data_header(&geo());
        assert_eq!(d.len(), 4096);
        assert_eq!(&d[0..8], b"STRACDAT");
        assert_eq!(&d[8..60], &h[8..60]);
        assert!(d[64..].iter().all(|&x| x == 0));
        assert_eq!(parse_data_header(&d).unwrap(), geo());
        assert_eq!(parse_index_header(&d).unwrap_err(), FormatError::Magic { what: "index" });
    }

    #[test]
    fn bad_headers_are_refused() {
        let h = encode_index_header(&geo());
        let mut flip = h.clone();
        flip[33] ^= 1;
        assert_eq!(parse_index_header(&flip).unwrap_err(), FormatError::Checksum { what: "index" });
        assert!(matches!(parse_index_header(&h[..10]), Err(FormatError::Short { .. })));
        let bad = Geometry { region_size: 12345, ..geo() };
        let e = parse_index_header(&encode_index_header(&bad)).unwrap_err();
        assert_eq!(e, FormatError::Field { what: "index", field: "region_size" });
        let mut v2 = h.clone();
        v2[8] = 2;
        let crc = crc32c::crc32c(&v2[..60]);
        v2[60..64].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            parse_index_header(&v2).unwrap_err(),
            FormatError::Version { what: "index", found: 2 }
        );
    }

    #[test]
    fn record_layout_is_pinned() {
        let r = Record::Insert {
            block: 0x1122334455667788,
            order: 4,
            len: 0xA0B0C0D0,
            hash: [7; 16],
            obj_off: 0x0102030405060708,
            key: "packs/ab/cd".into(),
        };
        let mut b = Vec::new();
        encode_record(&r, &mut b);
        assert_eq!(b.len(), 4 + 1 + 39 + 11 + 4);
        assert_eq!(&b[0..4], &(39u32 + 11).to_le_bytes());
        assert_eq!(b[4], REC_INSERT);
        assert_eq!(&b[5..13], &0x1122334455667788u64.to_le_bytes());
        assert_eq!(b[13], 4);
        assert_eq!(&b[14..18], &0xA0B0C0D0u32.to_le_bytes());
        assert_eq!(&b[18..34], &[7; 16]);
        assert_eq!(&b[34..42], &0x0102030405060708u64.to_le_bytes());
        assert_eq!(&b[42..44], &11u16.to_le_bytes());
        assert_eq!(&b[44..55], b"packs/ab/cd");
        assert_eq!(&b[55..59], &crc32c::crc32c(&b[..55]).to_le_bytes());

        let mut rm = Vec::new();
        encode_record(&Record::Remove { block: 4096 }, &mut rm);
        assert_eq!(
            rm,
            [
                &8u32.to_le_bytes()[..],
                &[REC_REMOVE],
                &4096u64.to_le_bytes(),
                &crc32c::crc32c(&rm[..13]).to_le_bytes()
            ]
            .concat()
        );

        let mut all = b.clone();
        all.extend_from_slice(&rm);
        let (recs, used) = parse_records(&all);
        assert_eq!(recs, vec![r, Record::Remove { block: 4096 }]);
        assert_eq!(used, all.len());
    }

    #[test]
    fn a_torn_tail_stops_the_replay() {
        let mut b = Vec::new();
        for i in 0..10u64 {
            encode_record(&Record::Remove { block: i * 4096 }, &mut b);
        }
        let one = b.len() / 10;
        for cut in [b.len() - 1, b.len() - one + 3] {
            let (recs, used) = parse_records(&b[..cut]);
            assert_eq!(recs.len(), 9);
            assert_eq!(used, 9 * one);
        }
        let mut bad = b.clone();
        bad[5 * one + 6] ^= 0x40;
        let (recs, used) = parse_records(&bad);
        assert_eq!((recs.len(), used), (5, 5 * one), "a bad CRC ends the log");
        // Garbage never panics.
        for seed in 0..200u32 {
            let g: Vec<u8> = (0..300u32)
                .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 13) as u8)
                .collect();
            let _ = parse_records(&g);
            let _ = parse_index_header(&g);
        }
    }
}

//! The version-2 entry table of packs and index objects: the 64-byte entries as one zstd frame
//! (level 1), then the CRC-32C of that frame.
//!
//! The CRC of the stored bytes means damage is refused before zstd sees it, and that no flip
//! goes unnoticed (zstd ignores a few header bits); the footer's (or index header's) CRC of the
//! raw entries still checks the result end to end. Expansion is bounded: the output must be
//! exactly 64·N bytes for the N the caller already capped, whatever the frame header claims, and
//! the table must be exactly one zstd frame. If zstd cannot set up a context (out of memory)
//! the table is written as a frame of raw blocks, which every reader accepts too.

use super::super::format::{crc, FResult, FormatError, Wr};
use super::ENTRY_LEN;
use crate::endian;
use std::cell::RefCell;

/// zstd level of entry tables (level 3 saves only ~1% more, at twice the CPU).
const LEVEL: i32 = 1;
/// The CRC-32C after the zstd frame.
pub(crate) const TABLE_CRC_LEN: usize = 4;
pub(crate) const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// Largest raw block of a zstd frame.
const MAX_BLOCK: usize = 128 << 10;

thread_local! {
    // Contexts are reused per thread: creating one costs about as much as compressing a table.
    static TABLE_C: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static TABLE_D: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Append the version-2 entry table of `raw` (the 64-byte entries) to `out`: one zstd frame,
/// then the CRC-32C of that frame.
pub(super) fn append_table(raw: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.reserve(zstd::zstd_safe::compress_bound(raw.len()) + TABLE_CRC_LEN);
    let done = TABLE_C.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = zstd::bulk::Compressor::new(LEVEL).ok();
        }
        let mut cur = std::io::Cursor::new(std::mem::take(out));
        cur.set_position(start as u64);
        let r = c.as_mut().map(|c| c.compress_to_buffer(raw, &mut cur));
        *out = cur.into_inner();
        matches!(r, Some(Ok(_)))
    });
    if !done {
        // zstd could not set up a context (out of memory): store the table in raw blocks,
        // which is still one valid zstd frame.
        tracing::warn!(target: "strata::store", bytes = raw.len(), "zstd unavailable; entry table stored uncompressed");
        out.truncate(start);
        stored_zstd_frame(raw, out);
    }
    let c = crc(&out[start..]);
    out.u32le(c);
}

/// `raw` as a zstd frame of uncompressed ("raw") blocks: magic, a single-segment header with
/// an 8-byte content size, then blocks of at most 128 KiB.
pub(super) fn stored_zstd_frame(raw: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&ZSTD_MAGIC);
    out.push(0xe0); // single segment, 8-byte frame content size, no checksum, no dictionary
    out.u64le(raw.len() as u64);
    let mut blocks = raw.chunks(MAX_BLOCK).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0]); // one empty last raw block
    }
    while let Some(b) = blocks.next() {
        let last = blocks.peek().is_none() as u32;
        let h = (b.len() as u32) << 3 | last;
        out.extend_from_slice(&h.to_le_bytes()[..3]);
        out.extend_from_slice(b);
    }
}

/// Expand a version-2 entry table of `count` entries back to its 64-byte entries. The table
/// must be one zstd frame and its CRC-32C, and expand to exactly 64·`count` bytes.
pub(super) fn expand_table(table: &[u8], count: u64, what: &'static str) -> FResult<Vec<u8>> {
    let malformed = |detail: String| FormatError::Malformed { what, detail };
    if table.len() < ZSTD_MAGIC.len() + TABLE_CRC_LEN {
        return Err(FormatError::Truncated {
            what,
            needed: (ZSTD_MAGIC.len() + TABLE_CRC_LEN) as u64,
            have: table.len() as u64,
        });
    }
    let (frame, stored_crc) = table.split_at(table.len() - TABLE_CRC_LEN);
    if crc(frame) != endian::le32(stored_crc, 0) {
        return Err(FormatError::Checksum { what });
    }
    if frame[..4] != ZSTD_MAGIC {
        return Err(malformed("entry table is not a zstd frame".into()));
    }
    match zstd::zstd_safe::find_frame_compressed_size(frame) {
        Ok(n) if n == frame.len() => {}
        Ok(n) => {
            return Err(malformed(format!(
                "{} bytes follow the entry table's zstd frame",
                frame.len() - n
            )))
        }
        Err(_) => return Err(malformed("entry table's zstd frame is damaged".into())),
    }
    // `count` is capped (MAX_ENTRIES) by the caller: at most 64 MiB, and only what the table
    // expands to is ever written, never more than asked for.
    let want = count as usize * ENTRY_LEN;
    let mut out = Vec::with_capacity(want);
    let r = TABLE_D.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = zstd::bulk::Decompressor::new().ok();
        }
        match d.as_mut() {
            Some(d) => d.decompress_to_buffer(frame, &mut out),
            None => zstd::bulk::decompress_to_buffer(frame, &mut out),
        }
    });
    match r {
        Ok(n) if n == want => Ok(out),
        Ok(n) => {
            Err(malformed(format!("entry table expands to {n} bytes, not 64 x {count} entries")))
        }
        Err(_) => Err(malformed(format!("entry table does not expand to 64 x {count} entries"))),
    }
}

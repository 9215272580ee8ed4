//! Pack files and index objects: how chunks are laid out in the backend.
//!
//! A pack is an append-only object: a 32-byte header, then *frames* back to back, then a trailer
//! of 64-byte entries (one per chunk) and a 32-byte footer. A frame is a run of one or more
//! chunks compressed together: disk blocks use one chunk per frame, memory pages pack 16 pages
//! per frame so the codec sees 64 KiB of context while dedup still works per 4 KiB page. Each
//! entry locates its chunk (frame offset/length, offset inside the decompressed frame) and
//! carries the frame's CRC-32C, so `check` can tell a flipped byte from a bad codec.
//!
//! After a pack is durable, its trailer is also written as a separate small *index object*
//! (`index/<pack id>`), so a host opening the store reads only indexes, never whole packs. The
//! pack's own trailer makes every pack self-describing, for recovery and `check`.

use super::format::{cap, crc, zero, FResult, FormatError, Rd, Wr, FORMAT_VERSION};
use crate::codec::{Codec, MAX_FRAME_RAW};
use crate::id::{ChunkId, PackId};

pub const PACK_MAGIC: &[u8; 8] = b"STRAPACK";
pub const PACK_END_MAGIC: &[u8; 8] = b"STRAPEND";
pub const INDEX_MAGIC: &[u8; 8] = b"STRAINDX";
pub const PACK_HEADER_LEN: usize = 32;
pub const PACK_FOOTER_LEN: usize = 32;
pub const ENTRY_LEN: usize = 64;
pub const INDEX_HEADER_LEN: usize = 48;
/// Most chunks one pack may hold.
pub const MAX_ENTRIES: u64 = 1 << 20;
/// Largest pack accepted (4 GiB).
pub const MAX_PACK_SIZE: u64 = 4 << 30;

/// What a chunk holds; trees name other chunks and are followed by GC and `check`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChunkKind {
    Data = 0,
    Tree = 1,
}

impl ChunkKind {
    pub fn from_u8(b: u8) -> Option<ChunkKind> {
        match b {
            0 => Some(ChunkKind::Data),
            1 => Some(ChunkKind::Tree),
            _ => None,
        }
    }
}

/// One chunk's location inside a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackEntry {
    pub id: ChunkId,
    pub frame_off: u64,
    pub frame_len: u32,
    pub frame_raw_len: u32,
    pub off_in_frame: u32,
    pub raw_len: u32,
    pub codec: Codec,
    pub kind: ChunkKind,
    pub frame_crc: u32,
}

impl PackEntry {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.0);
        out.u64le(self.frame_off);
        out.u32le(self.frame_len);
        out.u32le(self.frame_raw_len);
        out.u32le(self.off_in_frame);
        out.u32le(self.raw_len);
        let (c, l) = self.codec.to_bytes();
        out.push(c);
        out.push(l);
        out.push(self.kind as u8);
        out.push(0);
        out.u32le(self.frame_crc);
    }

    pub fn decode(rd: &mut Rd<'_>) -> FResult<PackEntry> {
        let id = ChunkId(rd.arr()?);
        let frame_off = rd.u64()?;
        let frame_len = rd.u32()?;
        let frame_raw_len = rd.u32()?;
        let off_in_frame = rd.u32()?;
        let raw_len = rd.u32()?;
        let (c, l) = (rd.u8()?, rd.u8()?);
        let kind = rd.u8()?;
        let reserved = rd.u8()?;
        let frame_crc = rd.u32()?;
        let what = "pack entry";
        zero(what, "reserved", reserved as u64)?;
        let codec = Codec::from_bytes(c, l)
            .map_err(|_| FormatError::Malformed { what, detail: format!("codec byte {c}") })?;
        let kind = ChunkKind::from_u8(kind)
            .ok_or(FormatError::Malformed { what, detail: format!("chunk kind {kind}") })?;
        cap(what, "frame_raw_len", frame_raw_len as u64, MAX_FRAME_RAW as u64)?;
        cap(what, "frame_len", frame_len as u64, MAX_FRAME_RAW as u64 + 65536)?;
        if off_in_frame as u64 + raw_len as u64 > frame_raw_len as u64 {
            return Err(FormatError::Malformed { what, detail: "chunk extends past its frame".into() });
        }
        if codec == Codec::None && frame_len != frame_raw_len {
            return Err(FormatError::Malformed { what, detail: "uncompressed frame length mismatch".into() });
        }
        Ok(PackEntry { id, frame_off, frame_len, frame_raw_len, off_in_frame, raw_len, codec, kind, frame_crc })
    }
}

fn encode_entries(entries: &[PackEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * ENTRY_LEN);
    for e in entries {
        e.encode(&mut out);
    }
    out
}

fn decode_entries(bytes: &[u8], count: u64, data_end: u64) -> FResult<Vec<PackEntry>> {
    let mut rd = Rd::new(bytes, "pack entries");
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let e = PackEntry::decode(&mut rd)?;
        if e.frame_off < PACK_HEADER_LEN as u64 || e.frame_off + e.frame_len as u64 > data_end {
            return Err(FormatError::Malformed {
                what: "pack entry",
                detail: format!("frame at {}+{} outside the pack data", e.frame_off, e.frame_len),
            });
        }
        out.push(e);
    }
    Ok(out)
}

/// Builds a pack in memory.
pub struct PackBuilder {
    pub id: PackId,
    buf: Vec<u8>,
    entries: Vec<PackEntry>,
}

/// One chunk handed to [`PackBuilder::add_frame`].
pub struct FrameChunk<'a> {
    pub id: ChunkId,
    pub data: &'a [u8],
    pub kind: ChunkKind,
}

impl PackBuilder {
    pub fn new(id: PackId) -> PackBuilder {
        PackBuilder::with_capacity(id, 1 << 20)
    }

    /// A builder whose buffer is reserved for `cap` bytes up front (the store reserves a
    /// whole pack, so growing never copies it; untouched capacity costs no memory).
    pub fn with_capacity(id: PackId, cap: usize) -> PackBuilder {
        PackBuilder::with_buffer(id, Vec::with_capacity(cap.max(PACK_HEADER_LEN)))
    }

    /// Build into `buf` (emptied first), e.g. a sealed pack's buffer handed back once the pack
    /// was durable: its pages are already mapped, so filling it costs no page faults.
    pub fn with_buffer(id: PackId, mut buf: Vec<u8>) -> PackBuilder {
        buf.clear();
        buf.extend_from_slice(PACK_MAGIC);
        buf.u16le(FORMAT_VERSION);
        buf.u16le(0);
        buf.extend_from_slice(&id.0);
        let c = crc(&buf);
        buf.u32le(c);
        debug_assert_eq!(buf.len(), PACK_HEADER_LEN);
        PackBuilder { id, buf, entries: Vec::new() }
    }

    pub fn len(&self) -> u64 {
        self.buf.len() as u64
    }

    /// The pack bytes written so far (header and frames).
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn chunk_count(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Append a frame already compressed by the caller: `stored` is what goes in the pack,
    /// `codec` how to expand it, and `chunks` (id, raw length, kind) what it expands to, back
    /// to back. Returns the entries added.
    pub fn add_frame(&mut self, stored: &[u8], codec: Codec, chunks: &[(ChunkId, u32, ChunkKind)]) -> &[PackEntry] {
        let frame_raw_len: u32 = chunks.iter().map(|c| c.1).sum();
        let mut off = 0u32;
        let placed: Vec<(ChunkId, u32, u32, ChunkKind)> = chunks
            .iter()
            .map(|&(id, len, kind)| {
                let p = (id, off, len, kind);
                off += len;
                p
            })
            .collect();
        self.add_frame_at(stored, codec, frame_raw_len, &placed)
    }

    /// Append an uncompressed frame given as consecutive parts (one per chunk, in order),
    /// copied straight into the pack: the same bytes as `add_frame` of the joined parts with
    /// `Codec::None`, without joining them first.
    pub fn add_frame_parts(&mut self, parts: &[&[u8]], chunks: &[(ChunkId, u32, ChunkKind)]) -> &[PackEntry] {
        debug_assert_eq!(parts.len(), chunks.len());
        let frame_off = self.buf.len() as u64;
        let mut frame_crc = 0u32;
        for p in parts {
            frame_crc = crc32c::crc32c_append(frame_crc, p);
            self.buf.extend_from_slice(p);
        }
        let frame_len = (self.buf.len() as u64 - frame_off) as u32;
        let first = self.entries.len();
        let mut off = 0u32;
        for &(id, raw_len, kind) in chunks {
            self.entries.push(PackEntry {
                id,
                frame_off,
                frame_len,
                frame_raw_len: frame_len,
                off_in_frame: off,
                raw_len,
                codec: Codec::None,
                kind,
                frame_crc,
            });
            off += raw_len;
        }
        &self.entries[first..]
    }

    /// Append a frame whose chunks sit at explicit offsets (id, offset, length, kind) inside
    /// the `frame_raw_len` decompressed bytes; used when GC copies frames between packs.
    pub fn add_frame_at(
        &mut self,
        stored: &[u8],
        codec: Codec,
        frame_raw_len: u32,
        chunks: &[(ChunkId, u32, u32, ChunkKind)],
    ) -> &[PackEntry] {
        let frame_off = self.buf.len() as u64;
        let frame_crc = crc(stored);
        self.buf.extend_from_slice(stored);
        let first = self.entries.len();
        for &(id, off_in_frame, raw_len, kind) in chunks {
            self.entries.push(PackEntry {
                id,
                frame_off,
                frame_len: stored.len() as u32,
                frame_raw_len,
                off_in_frame,
                raw_len,
                codec,
                kind,
                frame_crc,
            });
        }
        &self.entries[first..]
    }

    /// Seal the pack: returns (pack bytes, entries).
    pub fn finish(mut self) -> (Vec<u8>, Vec<PackEntry>) {
        let trailer_off = self.buf.len() as u64;
        let entries = encode_entries(&self.entries);
        let entries_crc = crc(&entries);
        self.buf.extend_from_slice(&entries);
        let mut footer = Vec::with_capacity(PACK_FOOTER_LEN);
        footer.u64le(self.entries.len() as u64);
        footer.u64le(trailer_off);
        footer.u32le(entries_crc);
        let fc = crc(&footer);
        footer.u32le(fc);
        footer.extend_from_slice(PACK_END_MAGIC);
        self.buf.extend_from_slice(&footer);
        (self.buf, self.entries)
    }
}

/// The parsed footer of a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackFooter {
    pub count: u64,
    pub trailer_off: u64,
    pub entries_crc: u32,
}

/// Parse and check a pack header; returns the pack id it names.
pub fn parse_pack_header(b: &[u8]) -> FResult<PackId> {
    let mut rd = Rd::new(b, "pack header");
    rd.magic_version(PACK_MAGIC)?;
    zero("pack header", "flags", rd.u16()? as u64)?;
    let id = PackId(rd.arr()?);
    let stored = rd.u32()?;
    if crc(&b[..28]) != stored {
        return Err(FormatError::Checksum { what: "pack header" });
    }
    Ok(id)
}

/// Parse the last [`PACK_FOOTER_LEN`] bytes of a pack of `pack_len` bytes.
pub fn parse_pack_footer(b: &[u8], pack_len: u64) -> FResult<PackFooter> {
    let what = "pack footer";
    if b.len() != PACK_FOOTER_LEN {
        return Err(FormatError::Truncated { what, needed: PACK_FOOTER_LEN as u64, have: b.len() as u64 });
    }
    if &b[24..32] != PACK_END_MAGIC {
        return Err(FormatError::BadMagic { what, expected: "STRAPEND" });
    }
    let mut rd = Rd::new(b, what);
    let count = rd.u64()?;
    let trailer_off = rd.u64()?;
    let entries_crc = rd.u32()?;
    let fc = rd.u32()?;
    if crc(&b[..20]) != fc {
        return Err(FormatError::Checksum { what });
    }
    cap(what, "count", count, MAX_ENTRIES)?;
    let expect_end = trailer_off
        .checked_add(count * ENTRY_LEN as u64)
        .and_then(|v| v.checked_add(PACK_FOOTER_LEN as u64));
    if trailer_off < PACK_HEADER_LEN as u64 || expect_end != Some(pack_len) {
        return Err(FormatError::Malformed { what, detail: "trailer does not end the pack".into() });
    }
    Ok(PackFooter { count, trailer_off, entries_crc })
}

/// Parse a whole pack held in memory: header, footer and entries (not the frames).
pub fn parse_pack(b: &[u8]) -> FResult<(PackId, Vec<PackEntry>)> {
    let len = b.len() as u64;
    cap("pack", "size", len, MAX_PACK_SIZE)?;
    if b.len() < PACK_HEADER_LEN + PACK_FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: "pack",
            needed: (PACK_HEADER_LEN + PACK_FOOTER_LEN) as u64,
            have: len,
        });
    }
    let id = parse_pack_header(&b[..PACK_HEADER_LEN])?;
    let f = parse_pack_footer(&b[b.len() - PACK_FOOTER_LEN..], len)?;
    let entries = &b[f.trailer_off as usize..b.len() - PACK_FOOTER_LEN];
    if crc(entries) != f.entries_crc {
        return Err(FormatError::Checksum { what: "pack entries" });
    }
    Ok((id, decode_entries(entries, f.count, f.trailer_off)?))
}

/// The index object of one pack: its id, size and entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexObject {
    pub pack: PackId,
    pub pack_size: u64,
    pub entries: Vec<PackEntry>,
}

impl IndexObject {
    pub fn encode(&self) -> Vec<u8> {
        let entries = encode_entries(&self.entries);
        let mut out = Vec::with_capacity(INDEX_HEADER_LEN + entries.len());
        out.extend_from_slice(INDEX_MAGIC);
        out.u16le(FORMAT_VERSION);
        out.u16le(0);
        out.extend_from_slice(&self.pack.0);
        out.u64le(self.pack_size);
        out.u32le(self.entries.len() as u32);
        out.u32le(crc(&entries));
        let hc = crc(&out);
        out.u32le(hc);
        debug_assert_eq!(out.len(), INDEX_HEADER_LEN);
        out.extend_from_slice(&entries);
        out
    }

    pub fn decode(b: &[u8]) -> FResult<IndexObject> {
        let what = "index object";
        let mut rd = Rd::new(b, what);
        rd.magic_version(INDEX_MAGIC)?;
        zero(what, "flags", rd.u16()? as u64)?;
        let pack = PackId(rd.arr()?);
        let pack_size = rd.u64()?;
        let count = rd.u32()? as u64;
        let entries_crc = rd.u32()?;
        let hc = rd.u32()?;
        if crc(&b[..44]) != hc {
            return Err(FormatError::Checksum { what });
        }
        cap(what, "count", count, MAX_ENTRIES)?;
        cap(what, "pack_size", pack_size, MAX_PACK_SIZE)?;
        let body = rd.bytes(count as usize * ENTRY_LEN)?;
        if rd.pos() != b.len() {
            return Err(FormatError::Malformed { what, detail: "trailing bytes".into() });
        }
        if crc(body) != entries_crc {
            return Err(FormatError::Checksum { what: "index entries" });
        }
        let data_end = pack_size.saturating_sub(PACK_FOOTER_LEN as u64 + count * ENTRY_LEN as u64);
        Ok(IndexObject { pack, pack_size, entries: decode_entries(body, count, data_end)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_from_parts_is_the_joined_raw_frame() {
        let (a, b2, c) = (vec![1u8; 4096], vec![2u8; 4096], vec![3u8; 100]);
        let chunks = [
            (ChunkId::of(&a), 4096, ChunkKind::Data),
            (ChunkId::of(&b2), 4096, ChunkKind::Data),
            (ChunkId::of(&c), 100, ChunkKind::Tree),
        ];
        let mut joined = PackBuilder::new(PackId([9; 16]));
        joined.add_frame(&[a.clone(), b2.clone(), c.clone()].concat(), Codec::None, &chunks);
        let mut parts = PackBuilder::with_capacity(PackId([9; 16]), 1 << 16);
        parts.add_frame_parts(&[&a, &b2, &c], &chunks);
        assert_eq!(joined.finish(), parts.finish());
    }

    fn sample_pack() -> (Vec<u8>, Vec<PackEntry>) {
        let mut b = PackBuilder::new(PackId([7; 16]));
        let a = vec![1u8; 4096];
        b.add_frame(&a, Codec::None, &[(ChunkId::of(&a), 4096, ChunkKind::Data)]);
        let two: Vec<u8> = [vec![2u8; 4096], vec![3u8; 4096]].concat();
        let z = Codec::Lz4.compress(&two).unwrap();
        b.add_frame(
            &z,
            Codec::Lz4,
            &[
                (ChunkId::of(&two[..4096]), 4096, ChunkKind::Data),
                (ChunkId::of(&two[4096..]), 4096, ChunkKind::Tree),
            ],
        );
        b.finish()
    }

    #[test]
    fn pack_layout_is_pinned() {
        let (bytes, entries) = sample_pack();
        assert_eq!(&bytes[0..8], b"STRAPACK");
        assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 1, "format version at offset 8");
        assert_eq!(&bytes[12..28], &[7u8; 16], "pack id at offset 12");
        assert_eq!(u32::from_le_bytes(bytes[28..32].try_into().unwrap()), crc(&bytes[..28]));
        assert_eq!(entries[0].frame_off, 32, "first frame follows the 32-byte header");
        let n = bytes.len();
        assert_eq!(&bytes[n - 8..], b"STRAPEND");
        let count = u64::from_le_bytes(bytes[n - 32..n - 24].try_into().unwrap());
        let trailer = u64::from_le_bytes(bytes[n - 24..n - 16].try_into().unwrap()) as usize;
        assert_eq!(count, 3);
        assert_eq!(trailer + 3 * 64 + 32, n);
        // Entry layout: id 0..32, frame_off 32..40, frame_len 40..44, frame_raw 44..48,
        // off_in_frame 48..52, raw_len 52..56, codec 56, level 57, kind 58, crc 60..64.
        let e2 = &bytes[trailer + 128..trailer + 192];
        assert_eq!(&e2[0..32], entries[2].id.as_bytes());
        assert_eq!(u64::from_le_bytes(e2[32..40].try_into().unwrap()), 32 + 4096);
        assert_eq!(u32::from_le_bytes(e2[44..48].try_into().unwrap()), 8192);
        assert_eq!(u32::from_le_bytes(e2[48..52].try_into().unwrap()), 4096);
        assert_eq!(u32::from_le_bytes(e2[52..56].try_into().unwrap()), 4096);
        assert_eq!((e2[56], e2[58]), (1, 1), "lz4, tree");
        let (id, parsed) = parse_pack(&bytes).unwrap();
        assert_eq!(id, PackId([7; 16]));
        assert_eq!(parsed, entries);
    }

    #[test]
    fn index_object_layout_is_pinned() {
        let (bytes, entries) = sample_pack();
        let idx = IndexObject { pack: PackId([7; 16]), pack_size: bytes.len() as u64, entries };
        let enc = idx.encode();
        assert_eq!(&enc[0..8], b"STRAINDX");
        assert_eq!(&enc[12..28], &[7u8; 16]);
        assert_eq!(u64::from_le_bytes(enc[28..36].try_into().unwrap()), bytes.len() as u64);
        assert_eq!(u32::from_le_bytes(enc[36..40].try_into().unwrap()), 3);
        assert_eq!(enc.len(), 48 + 3 * 64);
        assert_eq!(IndexObject::decode(&enc).unwrap(), idx);
    }

    #[test]
    fn damage_is_detected() {
        let (bytes, _) = sample_pack();
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            // Flips inside frames are caught by the frame CRC at read time; flips anywhere
            // else must fail parsing.
            if i >= 32 && i < bytes.len() - 32 - 3 * 64 {
                continue;
            }
            assert!(parse_pack(&b).is_err(), "flip at {i} went unnoticed");
        }
        for cut in [0, 10, 31, 40, bytes.len() - 1] {
            assert!(parse_pack(&bytes[..cut]).is_err(), "truncation at {cut} went unnoticed");
        }
    }

    #[test]
    fn newer_versions_are_refused_with_advice() {
        let (mut bytes, _) = sample_pack();
        bytes[8] = 9;
        let e = parse_pack_header(&bytes[..32]).unwrap_err();
        assert!(e.to_string().contains("upgrade strata"), "{e}");
    }
}

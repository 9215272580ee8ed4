//! Pack files and index objects: how chunks are laid out in the backend.
//!
//! A pack is an append-only object: a 32-byte header, then *frames* back to back, then a trailer
//! (the table of 64-byte entries, one per chunk) and a 32-byte footer. A frame is a run of one or more
//! chunks compressed together: disk blocks use one chunk per frame, memory pages pack 32 pages
//! per frame so the codec sees 128 KiB of context while dedup still works per 4 KiB page. Each
//! entry locates its chunk (frame offset/length, offset inside the decompressed frame) and
//! carries the frame's CRC-32C, so `check` can tell a flipped byte from a bad codec.
//!
//! On a local backend, after a pack is durable its trailer is also written as a separate small
//! *index object* (`index/<pack id>`): a pack file can be torn by a crash, so the index object
//! is what says it is whole. On a network backend an upload is atomic (a listed object is
//! whole), so the pack is its own index: a host opening the store reads the last
//! [`PACK_TAIL_READ`] bytes of each pack it does not know ([`parse_pack_tail`]), never whole
//! packs, and a save sends each table once (index objects would be 2% of a memory save's bytes
//! and half its requests). Index objects already in such a store are read too.
//!
//! Packs and index objects have their own format version ([`PACK_VERSION`]). Version 2 stores
//! the entry table as one zstd frame (level 1) followed by a CRC-32C of that frame: half of an
//! entry is a random id, but the other half repeats for every chunk of a frame, so the table
//! shrinks to ~55% (a 128 MiB memory save moves 0.9 MB less: trailers and indexes). The index
//! object's body is the pack's trailer byte for byte, so the writer copies it instead of
//! compressing twice. Version 1 (raw 64-byte entries) is still read. Decompression is bounded:
//! the output must be exactly 64·N bytes (N capped), whatever the zstd frame header claims.

use super::format::{cap, crc, zero, FResult, FormatError, Rd, Wr};
use crate::codec::{Codec, MAX_FRAME_RAW};
use crate::id::{ChunkId, PackId};
use table::{append_table, expand_table};

mod table;

pub(crate) const PACK_MAGIC: &[u8; 8] = b"STRAPACK";
pub(crate) const PACK_END_MAGIC: &[u8; 8] = b"STRAPEND";
pub(crate) const INDEX_MAGIC: &[u8; 8] = b"STRAINDX";
pub(crate) const PACK_HEADER_LEN: usize = 32;
pub(crate) const PACK_FOOTER_LEN: usize = 32;
pub(crate) const ENTRY_LEN: usize = 64;
pub(crate) const INDEX_HEADER_LEN: usize = 48;
/// Format version of packs and index objects this build writes, and the newest it reads:
/// 2 = entry table compressed (one zstd frame, then its CRC-32C).
pub(crate) const PACK_VERSION: u16 = 2;
/// The first version: the entry table is the raw 64-byte entries. Still read, never written.
pub const PACK_VERSION_RAW: u16 = 1;
/// Most chunks one pack may hold.
pub(crate) const MAX_ENTRIES: u64 = 1 << 20;
/// Largest pack accepted (4 GiB).
pub(crate) const MAX_PACK_SIZE: u64 = 4 << 30;

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
            return Err(FormatError::Malformed {
                what,
                detail: "chunk extends past its frame".into(),
            });
        }
        if codec == Codec::None && frame_len != frame_raw_len {
            return Err(FormatError::Malformed {
                what,
                detail: "uncompressed frame length mismatch".into(),
            });
        }
        Ok(PackEntry {
            id,
            frame_off,
            frame_len,
            frame_raw_len,
            off_in_frame,
            raw_len,
            codec,
            kind,
            frame_crc,
        })
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
        buf.u16le(PACK_VERSION);
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
    pub fn add_frame(
        &mut self,
        stored: &[u8],
        codec: Codec,
        chunks: &[(ChunkId, u32, ChunkKind)],
    ) -> &[PackEntry] {
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
    pub fn add_frame_parts(
        &mut self,
        parts: &[&[u8]],
        chunks: &[(ChunkId, u32, ChunkKind)],
    ) -> &[PackEntry] {
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

    /// Seal the pack: returns (pack bytes, entries). Compresses the entry table (about 1 ms
    /// per 5000 entries), so callers run it outside their locks.
    pub fn finish(mut self) -> (Vec<u8>, Vec<PackEntry>) {
        let trailer_off = self.buf.len() as u64;
        let entries = encode_entries(&self.entries);
        let entries_crc = crc(&entries);
        append_table(&entries, &mut self.buf);
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

/// The parsed footer of a pack. The trailer runs from `trailer_off` to the footer; how it is
/// encoded is the header's business ([`parse_pack_header`]): 64·`count` raw bytes in version
/// 1, a compressed table of any length in version 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackFooter {
    pub count: u64,
    pub trailer_off: u64,
    pub trailer_len: u64,
    /// CRC-32C of the 64·`count` raw entry bytes (uncompressed, in every version).
    pub entries_crc: u32,
}

/// Parse and check a pack header; returns the pack id it names.
pub fn parse_pack_header(b: &[u8]) -> FResult<PackId> {
    parse_pack_header_version(b).map(|(id, _)| id)
}

/// Parse and check a pack header; returns the pack id and the pack's format version
/// ([`PACK_VERSION_RAW`] or [`PACK_VERSION`]).
pub fn parse_pack_header_version(b: &[u8]) -> FResult<(PackId, u16)> {
    let mut rd = Rd::new(b, "pack header");
    let version = rd.magic_version_upto(PACK_MAGIC, PACK_VERSION)?;
    zero("pack header", "flags", rd.u16()? as u64)?;
    let id = PackId(rd.arr()?);
    let stored = rd.u32()?;
    if crc(&b[..28]) != stored {
        return Err(FormatError::Checksum { what: "pack header" });
    }
    Ok((id, version))
}

/// Parse the last [`PACK_FOOTER_LEN`] bytes of a pack of `pack_len` bytes. Valid for every
/// version: the footer says where the trailer starts, and it ends where the footer begins.
pub fn parse_pack_footer(b: &[u8], pack_len: u64) -> FResult<PackFooter> {
    let what = "pack footer";
    if b.len() != PACK_FOOTER_LEN {
        return Err(FormatError::Truncated {
            what,
            needed: PACK_FOOTER_LEN as u64,
            have: b.len() as u64,
        });
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
    let trailer_end = pack_len.checked_sub(PACK_FOOTER_LEN as u64);
    match trailer_end {
        Some(end) if trailer_off >= PACK_HEADER_LEN as u64 && trailer_off <= end => {
            Ok(PackFooter { count, trailer_off, trailer_len: end - trailer_off, entries_crc })
        }
        _ => Err(FormatError::Malformed {
            what,
            detail: "trailer offset is outside the pack".into(),
        }),
    }
}

/// The raw 64-byte entries of a trailer of a pack of `version`, checked against the footer's
/// entry CRC.
fn trailer_entries(
    trailer: &[u8],
    f: &PackFooter,
    version: u16,
    what: &'static str,
) -> FResult<Vec<u8>> {
    let raw = if version == PACK_VERSION_RAW {
        if trailer.len() as u64 != f.count * ENTRY_LEN as u64 {
            return Err(FormatError::Malformed {
                what,
                detail: format!(
                    "{} bytes of raw entries, expected 64 x {}",
                    trailer.len(),
                    f.count
                ),
            });
        }
        trailer.to_vec()
    } else {
        expand_table(trailer, f.count, what)?
    };
    if crc(&raw) != f.entries_crc {
        return Err(FormatError::Checksum { what });
    }
    Ok(raw)
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
    let (id, version) = parse_pack_header_version(&b[..PACK_HEADER_LEN])?;
    let f = parse_pack_footer(&b[b.len() - PACK_FOOTER_LEN..], len)?;
    let trailer = &b[f.trailer_off as usize..b.len() - PACK_FOOTER_LEN];
    let raw = trailer_entries(trailer, &f, version, "pack entries")?;
    Ok((id, decode_entries(&raw, f.count, f.trailer_off)?))
}

/// Bytes read from the end of a pack to find its entries without an index object: the footer
/// and, in one request, the compressed table of packs of up to ~900 chunks (~35 bytes per
/// entry compressed). The 1 MiB packs of a 128 MiB memory save had 4.5-30 KB tables, a 16 MiB
/// disk pack of 64 KiB blocks ~10-20 KB. A larger table takes a second, exact read.
pub(crate) const PACK_TAIL_READ: u64 = 32 << 10;

/// Largest trailer [`parse_pack_tail`] asks for: raw version-1 entries at [`MAX_ENTRIES`].
pub(crate) const MAX_TRAILER_LEN: u64 = MAX_ENTRIES * ENTRY_LEN as u64;

/// What the last bytes of a pack say (see [`parse_pack_tail`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackTail {
    /// The entries, checked against the footer's CRC.
    Entries(Vec<PackEntry>),
    /// The trailer starts before the bytes given: read this many bytes from the end instead.
    Need(u64),
}

/// The entries of a pack of `pack_len` bytes from its last bytes `tail` (the footer and the
/// trailer; more is fine): how a network store indexes a pack that has no index object. The
/// header is not read, so the version comes from the trailer itself: a zstd frame with its
/// CRC (version 2) or exactly 64·N raw bytes (version 1); either way the footer's CRC of the
/// raw entries must match, so a misread is caught. `check --read-data` reads the header.
pub fn parse_pack_tail(tail: &[u8], pack_len: u64) -> FResult<PackTail> {
    let what = "pack trailer";
    cap("pack", "size", pack_len, MAX_PACK_SIZE)?;
    if tail.len() < PACK_FOOTER_LEN
        || tail.len() as u64 > pack_len
        || pack_len < (PACK_HEADER_LEN + PACK_FOOTER_LEN) as u64
    {
        return Err(FormatError::Truncated {
            what,
            needed: PACK_FOOTER_LEN as u64,
            have: tail.len() as u64,
        });
    }
    let f = parse_pack_footer(&tail[tail.len() - PACK_FOOTER_LEN..], pack_len)?;
    let need = pack_len - f.trailer_off;
    cap(what, "length", f.trailer_len, MAX_TRAILER_LEN)?;
    if need > tail.len() as u64 {
        return Ok(PackTail::Need(need));
    }
    let trailer = &tail[tail.len() - need as usize..tail.len() - PACK_FOOTER_LEN];
    let version = if trailer.starts_with(&table::ZSTD_MAGIC)
        && trailer.len() as u64 != f.count * ENTRY_LEN as u64
    {
        PACK_VERSION
    } else if trailer.len() as u64 == f.count * ENTRY_LEN as u64 {
        // A raw table; a compressed one of exactly this length fails the CRC here and is
        // retried as compressed.
        match trailer_entries(trailer, &f, PACK_VERSION_RAW, what) {
            Ok(raw) => return Ok(PackTail::Entries(decode_entries(&raw, f.count, f.trailer_off)?)),
            Err(e) if !trailer.starts_with(&table::ZSTD_MAGIC) => return Err(e),
            Err(_) => PACK_VERSION,
        }
    } else {
        PACK_VERSION
    };
    let raw = trailer_entries(trailer, &f, version, what)?;
    Ok(PackTail::Entries(decode_entries(&raw, f.count, f.trailer_off)?))
}

/// The index object of one pack: its id, size and entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexObject {
    pub pack: PackId,
    pub pack_size: u64,
    pub entries: Vec<PackEntry>,
}

fn index_header(
    version: u16,
    pack: PackId,
    pack_size: u64,
    count: u32,
    entries_crc: u32,
    body_len: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(INDEX_HEADER_LEN + body_len);
    out.extend_from_slice(INDEX_MAGIC);
    out.u16le(version);
    out.u16le(0);
    out.extend_from_slice(&pack.0);
    out.u64le(pack_size);
    out.u32le(count);
    out.u32le(entries_crc);
    let hc = crc(&out);
    out.u32le(hc);
    debug_assert_eq!(out.len(), INDEX_HEADER_LEN);
    out
}

/// The index object of a pack this process sealed, in the pack's version: its header, then
/// the pack's trailer as it is (already compressed; nothing is decoded).
pub fn index_object_of_pack(pack: &[u8]) -> FResult<Vec<u8>> {
    if pack.len() < PACK_HEADER_LEN + PACK_FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: "pack",
            needed: (PACK_HEADER_LEN + PACK_FOOTER_LEN) as u64,
            have: pack.len() as u64,
        });
    }
    let (id, version) = parse_pack_header_version(&pack[..PACK_HEADER_LEN])?;
    let f = parse_pack_footer(&pack[pack.len() - PACK_FOOTER_LEN..], pack.len() as u64)?;
    let trailer = &pack[f.trailer_off as usize..pack.len() - PACK_FOOTER_LEN];
    let mut out =
        index_header(version, id, pack.len() as u64, f.count as u32, f.entries_crc, trailer.len());
    out.extend_from_slice(trailer);
    Ok(out)
}

impl IndexObject {
    /// Encode in the current version ([`PACK_VERSION`]): the same bytes
    /// [`index_object_of_pack`] gives for the pack these entries were sealed in.
    pub fn encode(&self) -> Vec<u8> {
        let entries = encode_entries(&self.entries);
        let mut table = Vec::new();
        append_table(&entries, &mut table);
        let count = self.entries.len() as u32;
        let mut out = index_header(
            PACK_VERSION,
            self.pack,
            self.pack_size,
            count,
            crc(&entries),
            table.len(),
        );
        out.extend_from_slice(&table);
        out
    }

    /// Decode an index object of either version.
    pub fn decode(b: &[u8]) -> FResult<IndexObject> {
        let what = "index object";
        let mut rd = Rd::new(b, what);
        let version = rd.magic_version_upto(INDEX_MAGIC, PACK_VERSION)?;
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
        // The body is the pack's trailer byte for byte, so frames end before its length.
        let body = rd.bytes(b.len() - INDEX_HEADER_LEN)?;
        let f = PackFooter {
            count,
            trailer_off: pack_size.saturating_sub(PACK_FOOTER_LEN as u64 + body.len() as u64),
            trailer_len: body.len() as u64,
            entries_crc,
        };
        let raw = trailer_entries(body, &f, version, "index entries")?;
        Ok(IndexObject { pack, pack_size, entries: decode_entries(&raw, count, f.trailer_off)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endian;

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

    /// Where a pack's trailer is: (trailer offset, footer offset).
    fn trailer_of(bytes: &[u8]) -> (usize, usize) {
        let n = bytes.len();
        (endian::le64(bytes, n - 24) as usize, n - 32)
    }

    #[test]
    fn pack_layout_is_pinned() {
        let (bytes, entries) = sample_pack();
        assert_eq!(&bytes[0..8], b"STRAPACK");
        assert_eq!(endian::le16(&bytes, 8), 2, "format version at offset 8");
        assert_eq!(&bytes[12..28], &[7u8; 16], "pack id at offset 12");
        assert_eq!(endian::le32(&bytes, 28), crc(&bytes[..28]));
        assert_eq!(entries[0].frame_off, 32, "first frame follows the 32-byte header");
        let n = bytes.len();
        assert_eq!(&bytes[n - 8..], b"STRAPEND");
        let count = endian::le64(&bytes, n - 32);
        let (trailer, footer) = trailer_of(&bytes);
        assert_eq!(count, 3);
        assert_eq!(
            trailer,
            32 + 4096 + entries[1].frame_len as usize,
            "trailer follows the last frame"
        );
        // Trailer: one zstd frame of the 64-byte entries, then the CRC-32C of that frame.
        let frame = &bytes[trailer..footer - 4];
        assert_eq!(&frame[..4], &[0x28, 0xb5, 0x2f, 0xfd], "zstd magic");
        assert_eq!(endian::le32(&bytes, footer - 4), crc(frame));
        let raw = zstd::bulk::decompress(frame, 1 << 20).unwrap();
        assert_eq!(raw.len(), 3 * 64);
        assert_eq!(endian::le32(&bytes, n - 16), crc(&raw), "CRC of the raw entries");
        assert_eq!(endian::le32(&bytes, n - 12), crc(&bytes[n - 32..n - 12]));
        // Entry layout: id 0..32, frame_off 32..40, frame_len 40..44, frame_raw 44..48,
        // off_in_frame 48..52, raw_len 52..56, codec 56, level 57, kind 58, crc 60..64.
        let e2 = &raw[128..192];
        assert_eq!(&e2[0..32], entries[2].id.as_bytes());
        assert_eq!(endian::le64(e2, 32), 32 + 4096);
        assert_eq!(endian::le32(e2, 40), entries[2].frame_len);
        assert_eq!(endian::le32(e2, 44), 8192);
        assert_eq!(endian::le32(e2, 48), 4096);
        assert_eq!(endian::le32(e2, 52), 4096);
        assert_eq!((e2[56], e2[57], e2[58], e2[59]), (1, 0, 1, 0), "lz4, level 0, tree, reserved");
        assert_eq!(endian::le32(e2, 60), entries[2].frame_crc);
        let (id, parsed) = parse_pack(&bytes).unwrap();
        assert_eq!(id, PackId([7; 16]));
        assert_eq!(parsed, entries);
        let f = parse_pack_footer(&bytes[n - 32..], n as u64).unwrap();
        assert_eq!(
            (f.count, f.trailer_off as usize, f.trailer_len as usize),
            (3, trailer, footer - trailer)
        );
    }

    #[test]
    fn index_object_layout_is_pinned() {
        let (bytes, entries) = sample_pack();
        let idx = IndexObject { pack: PackId([7; 16]), pack_size: bytes.len() as u64, entries };
        let enc = idx.encode();
        assert_eq!(&enc[0..8], b"STRAINDX");
        assert_eq!(endian::le16(&enc, 8), 2, "format version at offset 8");
        assert_eq!(&enc[12..28], &[7u8; 16]);
        assert_eq!(endian::le64(&enc, 28), bytes.len() as u64);
        assert_eq!(endian::le32(&enc, 36), 3);
        let n = bytes.len();
        assert_eq!(
            &enc[40..44],
            &bytes[n - 16..n - 12],
            "CRC of the raw entries, as in the pack footer"
        );
        assert_eq!(endian::le32(&enc, 44), crc(&enc[..44]));
        // The body is the pack's trailer byte for byte.
        let (trailer, footer) = trailer_of(&bytes);
        assert_eq!(&enc[48..], &bytes[trailer..footer]);
        assert_eq!(
            index_object_of_pack(&bytes).unwrap(),
            enc,
            "copied from the pack = encoded afresh"
        );
        assert_eq!(IndexObject::decode(&enc).unwrap(), idx);
    }

    /// The 64-byte entry encoding written out field by field (not with `PackEntry::encode`).
    fn v1_entry(e: &PackEntry) -> Vec<u8> {
        let mut b = e.id.as_bytes().to_vec();
        b.extend_from_slice(&e.frame_off.to_le_bytes());
        for v in [e.frame_len, e.frame_raw_len, e.off_in_frame, e.raw_len] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let (c, l) = e.codec.to_bytes();
        b.extend_from_slice(&[c, l, e.kind as u8, 0]);
        b.extend_from_slice(&e.frame_crc.to_le_bytes());
        b
    }

    /// A version-1 pack and index object, as strata wrote them before version 2, built by hand
    /// around the frames of `sample_pack`.
    fn v1_pack_and_index() -> (Vec<u8>, Vec<u8>, Vec<PackEntry>) {
        let (v2, entries) = sample_pack();
        let (trailer, _) = trailer_of(&v2);
        let mut p = b"STRAPACK".to_vec();
        p.extend_from_slice(&[1, 0, 0, 0]);
        p.extend_from_slice(&[7u8; 16]);
        p.extend_from_slice(&crc(&p).to_le_bytes());
        p.extend_from_slice(&v2[32..trailer]);
        let raw: Vec<u8> = entries.iter().flat_map(v1_entry).collect();
        assert_eq!(raw.len(), 3 * 64);
        p.extend_from_slice(&raw);
        let mut footer = 3u64.to_le_bytes().to_vec();
        footer.extend_from_slice(&(trailer as u64).to_le_bytes());
        footer.extend_from_slice(&crc(&raw).to_le_bytes());
        footer.extend_from_slice(&crc(&footer).to_le_bytes());
        footer.extend_from_slice(b"STRAPEND");
        p.extend_from_slice(&footer);
        let mut i = b"STRAINDX".to_vec();
        i.extend_from_slice(&[1, 0, 0, 0]);
        i.extend_from_slice(&[7u8; 16]);
        i.extend_from_slice(&(p.len() as u64).to_le_bytes());
        i.extend_from_slice(&3u32.to_le_bytes());
        i.extend_from_slice(&crc(&raw).to_le_bytes());
        i.extend_from_slice(&crc(&i).to_le_bytes());
        i.extend_from_slice(&raw);
        (p, i, entries)
    }

    #[test]
    fn version_1_packs_and_index_objects_still_decode() {
        let (pack, index, entries) = v1_pack_and_index();
        let (id, parsed) = parse_pack(&pack).unwrap();
        assert_eq!((id, &parsed), (PackId([7; 16]), &entries));
        assert_eq!(parse_pack_header_version(&pack[..32]).unwrap().1, PACK_VERSION_RAW);
        let idx = IndexObject::decode(&index).unwrap();
        assert_eq!(
            idx,
            IndexObject {
                pack: PackId([7; 16]),
                pack_size: pack.len() as u64,
                entries: entries.clone()
            }
        );
        assert_eq!(
            index_object_of_pack(&pack).unwrap(),
            index,
            "a version-1 pack's index is version 1"
        );
        // Re-encoding writes version 2, with the same meaning.
        let v2 = idx.encode();
        assert_eq!(v2[8], 2);
        assert_eq!(IndexObject::decode(&v2).unwrap(), idx);
        // Version 1's raw trailer must be exactly 64·N bytes, and is still checked.
        let mut short = index.clone();
        short.pop();
        assert!(IndexObject::decode(&short).is_err());
        let mut flipped = pack.clone();
        let (trailer, _) = trailer_of(&pack);
        flipped[trailer + 70] ^= 1;
        assert!(matches!(parse_pack(&flipped), Err(FormatError::Checksum { .. })));
    }

    #[test]
    fn damage_is_detected() {
        let (v1, _, _) = v1_pack_and_index();
        for bytes in [sample_pack().0, v1] {
            let (trailer, _) = trailer_of(&bytes);
            for i in 0..bytes.len() {
                // Flips inside frames are caught by the frame CRC at read time; flips anywhere
                // else must fail parsing.
                if (32..trailer).contains(&i) {
                    continue;
                }
                for bit in 0..8 {
                    let mut b = bytes.clone();
                    b[i] ^= 1 << bit;
                    assert!(parse_pack(&b).is_err(), "flip of bit {bit} at {i} went unnoticed");
                }
            }
            for cut in [0, 10, 31, 40, trailer, trailer + 5, bytes.len() - 33, bytes.len() - 1] {
                assert!(parse_pack(&bytes[..cut]).is_err(), "truncation at {cut} went unnoticed");
            }
        }
    }

    #[test]
    fn damage_in_a_compressed_table_is_refused_clearly() {
        let (bytes, entries) = sample_pack();
        let (trailer, _) = trailer_of(&bytes);
        let mut b = bytes.clone();
        b[trailer + 9] ^= 0x40;
        let e = parse_pack(&b).unwrap_err();
        assert_eq!(e, FormatError::Checksum { what: "pack entries" });
        assert_eq!(e.to_string(), "Checksum mismatch in pack entries");
        let enc =
            IndexObject { pack: PackId([7; 16]), pack_size: bytes.len() as u64, entries }.encode();
        for i in 0..enc.len() {
            for bit in 0..8 {
                let mut b = enc.clone();
                b[i] ^= 1 << bit;
                assert!(
                    IndexObject::decode(&b).is_err(),
                    "flip of bit {bit} at {i} of the index object went unnoticed"
                );
            }
        }
        let mut b = enc.clone();
        b[60] ^= 0x40;
        assert_eq!(
            IndexObject::decode(&b).unwrap_err(),
            FormatError::Checksum { what: "index entries" }
        );
        for cut in [47, 48, 52, enc.len() - 1] {
            assert!(
                IndexObject::decode(&enc[..cut]).is_err(),
                "truncation at {cut} went unnoticed"
            );
        }
    }

    /// A v2 pack whose trailer is `table` (a CRC is appended) and whose footer claims `count`
    /// entries with raw-entry CRC `entries_crc`.
    fn pack_with_table(frame: &[u8], count: u64, entries_crc: u32) -> Vec<u8> {
        let (bytes, _) = sample_pack();
        let (trailer, _) = trailer_of(&bytes);
        let mut p = bytes[..trailer].to_vec();
        p.extend_from_slice(frame);
        p.extend_from_slice(&crc(frame).to_le_bytes());
        let mut footer = count.to_le_bytes().to_vec();
        footer.extend_from_slice(&(trailer as u64).to_le_bytes());
        footer.extend_from_slice(&entries_crc.to_le_bytes());
        footer.extend_from_slice(&crc(&footer).to_le_bytes());
        footer.extend_from_slice(b"STRAPEND");
        p.extend_from_slice(&footer);
        p
    }

    #[test]
    fn hostile_tables_are_refused_without_trusting_the_frame() {
        let (_, entries) = sample_pack();
        let raw: Vec<u8> = entries.iter().flat_map(v1_entry).collect();
        let c = crc(&raw);
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        // Any valid single zstd frame of the right entries is accepted (another level, raw blocks).
        assert_eq!(parse_pack(&pack_with_table(&z, 3, c)).unwrap().1, entries);
        let mut stored = Vec::new();
        table::stored_zstd_frame(&raw, &mut stored);
        assert_eq!(parse_pack(&pack_with_table(&stored, 3, c)).unwrap().1, entries);
        let malformed = |p: &[u8]| {
            matches!(parse_pack(p), Err(FormatError::Malformed { what: "pack entries", .. }))
        };
        // Fewer or more entries than the footer says.
        assert!(malformed(&pack_with_table(&z, 2, c)));
        assert!(malformed(&pack_with_table(&z, 4, c)));
        // A frame that expands to far more than 64·N (a zip bomb) stops at 64·N.
        let bomb = zstd::bulk::compress(&vec![0u8; 64 << 20], 1).unwrap();
        assert!(bomb.len() < 8192);
        assert!(malformed(&pack_with_table(&bomb, 3, c)));
        // The most entries allowed, from a tiny frame: refused, bounded by 64 MiB.
        assert!(malformed(&pack_with_table(&z, MAX_ENTRIES, c)));
        assert!(matches!(
            parse_pack(&pack_with_table(&z, MAX_ENTRIES + 1, c)),
            Err(FormatError::Cap { .. })
        ));
        // Two frames, trailing bytes, something else than zstd, nothing at all.
        assert!(malformed(&pack_with_table(&[z.clone(), z.clone()].concat(), 3, c)));
        assert!(malformed(&pack_with_table(&[&z[..], &[0]].concat(), 3, c)));
        let lz4 = lz4_flex::block::compress(&raw);
        assert!(malformed(&pack_with_table(&lz4, 3, c)));
        assert!(parse_pack(&pack_with_table(&[], 3, c)).is_err());
        assert!(parse_pack(&pack_with_table(&z[..z.len() - 1], 3, c)).is_err());
    }

    #[test]
    fn empty_tables_round_trip() {
        let (bytes, entries) = PackBuilder::new(PackId([5; 16])).finish();
        assert!(entries.is_empty());
        assert_eq!(parse_pack(&bytes).unwrap(), (PackId([5; 16]), vec![]));
        let idx = IndexObject { pack: PackId([5; 16]), pack_size: bytes.len() as u64, entries };
        assert_eq!(IndexObject::decode(&idx.encode()).unwrap(), idx);
        assert_eq!(index_object_of_pack(&bytes).unwrap(), idx.encode());
    }

    #[test]
    fn newer_versions_are_refused_with_advice() {
        let (mut bytes, entries) = sample_pack();
        bytes[8] = 3;
        let e = parse_pack_header(&bytes[..32]).unwrap_err();
        assert_eq!(
            e,
            FormatError::TooNew { what: "pack header", found: 3, supported: PACK_VERSION }
        );
        assert!(e.to_string().contains("upgrade strata"), "{e}");
        let mut idx = IndexObject { pack: PackId([7; 16]), pack_size: 1 << 20, entries }.encode();
        idx[8] = 3;
        let e = IndexObject::decode(&idx).unwrap_err();
        assert!(matches!(e, FormatError::TooNew { found: 3, supported: 2, .. }), "{e}");
        // Version 0 never existed.
        idx[8] = 0;
        assert!(IndexObject::decode(&idx).is_err());
    }

    /// A network store indexes a pack from its last bytes: any suffix that holds the trailer
    /// gives the same entries as the whole pack, a shorter one says how much to read, and
    /// every flipped bit of the trailer or footer is refused.
    #[test]
    fn pack_tail_gives_the_entries_of_both_versions() {
        let (v2, entries) = sample_pack();
        let (v1, _, _) = v1_pack_and_index();
        for pack in [&v2, &v1] {
            let n = pack.len() as u64;
            let (trailer, _) = trailer_of(pack);
            let need = n - trailer as u64;
            for start in [0, trailer - 1, trailer] {
                assert_eq!(
                    parse_pack_tail(&pack[start..], n).unwrap(),
                    PackTail::Entries(entries.clone())
                );
            }
            assert_eq!(parse_pack_tail(&pack[pack.len() - 32..], n).unwrap(), PackTail::Need(need));
            assert_eq!(
                parse_pack_tail(&pack[pack.len() - need as usize + 1..], n).unwrap(),
                PackTail::Need(need)
            );
            for bit in 0..need * 8 {
                let mut bad = pack.clone();
                bad[trailer + (bit / 8) as usize] ^= 1 << (bit % 8);
                let r = parse_pack_tail(&bad[trailer..], n);
                assert!(
                    !matches!(r, Ok(PackTail::Entries(_))),
                    "bit {bit} of a {need}-byte tail flipped, still accepted: {r:?}"
                );
            }
            // The wrong pack size moves the trailer: refused, never misread.
            assert!(!matches!(parse_pack_tail(&pack[trailer..], n + 1), Ok(PackTail::Entries(_))));
            assert!(parse_pack_tail(&pack[..10], n).is_err());
        }
    }
}

//! What the stream parser hands out: events for a [`StreamSink`], the limits it enforces, and
//! the summary of a finished parse, plus the pure whole-buffer entry points used by cargo-fuzz.
//!
//! Kept apart from the state machine in `parse.rs` so the contract a consumer codes against
//! (event order, borrowing rules, what `finish` returns) reads in one place. Events borrow
//! from the parser's input: a sink that needs a page beyond the call must copy or hash it
//! there.

use super::error::{SinkError, StreamError};
use super::parse::Parser;
use super::{BlockIdx, RamBlock, SectionKind, StreamLayout, PAGE_SIZE};

/// Caps on sizes taken from the stream, so hostile input cannot make the parser allocate
/// without bound.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most ramblocks in `MEM_SIZE` (a pc guest has 6–10).
    pub max_blocks: usize,
    /// Largest single ramblock.
    pub max_block_bytes: u64,
    /// Longest machine-type string in CONFIGURATION.
    pub max_machine_type: usize,
    /// Largest device-state tail kept for validation (QEMU 7.2 x86 tails are 100–400 KB).
    pub max_tail_bytes: usize,
    /// Require EOF + VMDESCRIPTION at the end. Turn off only for sources started with
    /// `-machine suppress-vmdesc=on`, whose streams end at EOF.
    pub require_vmdesc: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_blocks: 1024,
            max_block_bytes: 16 << 40,
            max_machine_type: 256,
            max_tail_bytes: 64 << 20,
            require_vmdesc: true,
        }
    }
}

/// What the parser reports, in stream order.
#[derive(Debug)]
pub enum Event<'a> {
    /// File magic and version were accepted.
    Header { version: u32 },
    /// CONFIGURATION section: the source's machine type.
    Configuration { machine_type: &'a str },
    /// A RAM section header (START, PART or END) was read.
    SectionBegin { kind: SectionKind, section_id: u32 },
    /// The ramblock list from `MEM_SIZE`, in stream order ([`BlockIdx`] indexes it).
    RamBlocks(&'a [RamBlock]),
    /// A full page. `data` is borrowed from the fed slice (or the staging buffer).
    Page { block: BlockIdx, offset: u64, data: &'a [u8; PAGE_SIZE] },
    /// A page filled with one byte (QEMU 7.2 only sends 0).
    Zero { block: BlockIdx, offset: u64, fill: u8 },
    /// A RAM section's EOS and footer were read.
    SectionEnd { kind: SectionKind, section_id: u32 },
    /// Device-state tail bytes, verbatim; may arrive in several pieces.
    Tail(&'a [u8]),
    /// The stream ended correctly (sent by `finish`).
    End { layout: &'a StreamLayout },
}

/// Receiver of parser events. A sink error stops the parse and is returned wrapped in
/// [`StreamError::Sink`] with the stream offset.
pub trait StreamSink {
    fn event(&mut self, ev: Event<'_>) -> Result<(), SinkError>;
}

impl<F> StreamSink for F
where
    F: FnMut(Event<'_>) -> Result<(), SinkError>,
{
    fn event(&mut self, ev: Event<'_>) -> Result<(), SinkError> {
        self(ev)
    }
}

/// Counters kept while parsing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParseStats {
    pub bytes: u64,
    pub page_records: u64,
    pub zero_records: u64,
    pub part_sections: u64,
    pub end_sections: u64,
}

/// Result of a successful parse.
#[derive(Debug, Clone)]
pub struct StreamInfo {
    pub layout: StreamLayout,
    pub stats: ParseStats,
    /// Stream offset where the tail starts.
    pub tail_offset: u64,
    /// The tail, verbatim (FULL sections, EOF, VMDESCRIPTION).
    pub tail: Vec<u8>,
    /// Entries in the VMDESCRIPTION `devices` array (0 without VMDESCRIPTION).
    pub vmdesc_devices: usize,
    /// True when the RAM data had no END section (a `background-snapshot` stream).
    pub background_snapshot: bool,
}

/// Everything [`parse_all`] learns, without the tail bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedSummary {
    pub layout: StreamLayout,
    pub stats: ParseStats,
    pub tail_offset: u64,
    pub tail_len: usize,
    pub vmdesc_devices: usize,
    pub background_snapshot: bool,
}

/// Parse a whole stream held in memory. Pure function over bytes, for cargo-fuzz.
pub fn parse_all(bytes: &[u8]) -> Result<ParsedSummary, StreamError> {
    parse_all_chunked(bytes, bytes.len().max(1))
}

/// Parse a stream fed in `chunk`-byte pieces (exercises the staging path; same result as
/// [`parse_all`] for every chunk size).
pub fn parse_all_chunked(bytes: &[u8], chunk: usize) -> Result<ParsedSummary, StreamError> {
    let mut p = Parser::new(Limits::default());
    let mut sink = |_: Event<'_>| -> Result<(), SinkError> { Ok(()) };
    for piece in bytes.chunks(chunk.max(1)) {
        p.feed(piece, &mut sink)?;
    }
    let info = p.finish(&mut sink)?;
    Ok(ParsedSummary {
        layout: info.layout,
        stats: info.stats,
        tail_offset: info.tail_offset,
        tail_len: info.tail.len(),
        vmdesc_devices: info.vmdesc_devices,
        background_snapshot: info.background_snapshot,
    })
}

//! QEMU 7.2 precopy migration stream: a push parser and a generator.
//!
//! strata receives VM memory by letting QEMU `migrate` into a pipe or socket that strata reads.
//! The stream is split into three parts that are stored differently:
//!
//! * the *layout* (file version, machine type, the RAM section's id/instance/version and the
//!   ramblock list from `MEM_SIZE`), a few hundred bytes kept as metadata;
//! * the *pages*, 4 KiB each, addressed by (ramblock, offset): these feed the content-addressed
//!   chunk store, so they must reach the hashing pool with as few copies as possible;
//! * the *tail*: every byte from the first non-RAM section after the RAM data (FULL device
//!   sections, EOF, VMDESCRIPTION JSON), kept verbatim as one opaque blob.
//!
//! To restore, [`generate()`] writes a fresh stream from those three parts (every page once, in one
//! RAM END section) that QEMU 7.2 loads with `migrate-incoming`.
//!
//! Shape of the code, and why:
//! * [`parse::Parser`] is *push* based (`feed(&[u8])` as bytes arrive, `finish()` at EOF) so a
//!   socket reader never holds the stream in memory, and it is an explicit state machine whose
//!   units (a record, a section header) are parsed straight from the caller's slice. A page is
//!   lent to the sink as `&[u8; 4096]` borrowed from the input; only a unit that straddles two
//!   feeds goes through a small staging buffer.
//! * Everything QEMU can put in a stream that strata cannot store faithfully (XBZRLE deltas,
//!   compressed pages, multifd, postcopy commands, other iterable sections, `x-ignore-shared`)
//!   is refused with an error naming the capability to turn off. Every error carries the stream
//!   byte offset.
//! * [`wire`] holds the constants and byte encodings, pinned by unit tests; [`parse_all`] is the
//!   pure `&[u8]` entry point for cargo-fuzz.
//!
//! The byte tables live in `docs/format-migration-stream.md`.

pub mod error;
pub mod generate;
pub mod parse;
pub mod sink;
mod tail;
pub mod wire;

#[cfg(test)]
mod tests;

pub use error::{GenerateError, SinkError, StreamError};
pub use generate::{generate, GenerateStats, PageContent, PageRecord, StreamWriter};
pub use parse::Parser;
pub use sink::{
    parse_all, parse_all_chunked, Event, Limits, ParseStats, ParsedSummary, StreamInfo, StreamSink,
};
pub use wire::PAGE_SIZE;

/// Index of a ramblock in the stream's `MEM_SIZE` list (the order QEMU sent them in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockIdx(pub u32);

impl BlockIdx {
    /// The index as a `usize`, for indexing [`StreamLayout::blocks`].
    pub fn get(self) -> usize {
        self.0 as usize
    }
}

/// One ramblock as announced by `MEM_SIZE`: its QEMU id string and its used length in bytes
/// (always a multiple of [`PAGE_SIZE`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RamBlock {
    pub name: String,
    pub used_len: u64,
}

impl RamBlock {
    /// Number of 4 KiB pages in the block.
    pub fn pages(&self) -> u64 {
        self.used_len / PAGE_SIZE as u64
    }
}

/// The kind of a RAM section: QEMU sends one START, any number of PARTs and (except for
/// background snapshots) one END.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SectionKind {
    Start,
    Part,
    End,
}

/// What a `START` section header says about the `ram` section. The generator reuses these
/// numbers so the regenerated stream matches what the original source announced.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RamSectionHeader {
    pub section_id: u32,
    pub instance_id: u32,
    pub version_id: u32,
}

/// Everything needed, besides pages and the tail, to write a stream QEMU accepts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamLayout {
    /// File format version (always 3 for streams this module accepts).
    pub version: u32,
    /// Machine type from the CONFIGURATION section (e.g. `pc-i440fx-7.2`); `None` when the
    /// source machine type does not send one.
    pub machine_type: Option<String>,
    /// Configuration subsections (`configuration/uuid`, `configuration/target-page-bits`),
    /// verbatim.
    pub config_subsections: Vec<u8>,
    /// Numbers of the `ram` section header.
    pub ram_section: RamSectionHeader,
    /// Ramblocks in stream order.
    pub blocks: Vec<RamBlock>,
}

impl StreamLayout {
    /// Sum of the used lengths of all blocks (the `MEM_SIZE` total).
    pub fn total_ram(&self) -> u64 {
        self.blocks.iter().map(|b| b.used_len).sum()
    }

    /// Index of the block with this name.
    pub fn block_index(&self, name: &str) -> Option<BlockIdx> {
        self.blocks.iter().position(|b| b.name == name).map(|i| BlockIdx(i as u32))
    }
}

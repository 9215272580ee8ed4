//! Errors of the migration-stream parser and generator.
//!
//! Every parser error names the stream byte offset where the problem starts, so a bad capture
//! can be inspected with `xxd -s OFFSET`. Errors caused by a QEMU capability that strata does
//! not store say which capability to disable. Messages never repeat a source error's text;
//! the source is chained instead.

use std::io;

/// Error type a [`super::StreamSink`] may return to stop the parse (e.g. the store is full).
pub type SinkError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a migration stream was refused.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("Not a QEMU migration stream: magic {found:#010x} at byte {offset}, expected 0x5145564d (\"QEVM\")")]
    BadMagic { offset: u64, found: u32 },

    #[error("Unsupported stream version {found} at byte {offset}: only version 3 (QEMU 2.0 and later) is parsed")]
    BadVersion { offset: u64, found: u32 },

    #[error("Configuration at byte {offset}: {why}")]
    BadConfiguration { offset: u64, why: String },

    #[error("Unknown configuration subsection '{name}' at byte {offset}: only configuration/uuid and configuration/target-page-bits are accepted")]
    UnknownSubsection { offset: u64, name: String },

    #[error("Stream at byte {offset} was saved with capability '{capability}': {fix}")]
    RefusedCapability { offset: u64, capability: String, fix: &'static str },

    #[error("COMMAND section at byte {offset} (postcopy, return path, ping or packaged stream): disable the postcopy-ram and return-path capabilities")]
    Command { offset: u64 },

    #[error("Iterable section '{idstr}' at byte {offset} is not supported, only 'ram' is: disable the block and dirty-bitmaps capabilities and remove VFIO devices")]
    ForeignIterable { offset: u64, idstr: String },

    #[error("Unexpected section type {kind:#04x} at byte {offset}: {why}")]
    UnexpectedSection { offset: u64, kind: u8, why: &'static str },

    #[error("RAM section at byte {offset} has version {found}, expected 4")]
    RamVersion { offset: u64, found: u32 },

    #[error("Section id {found} at byte {offset} is not the RAM section id {expected}")]
    SectionIdMismatch { offset: u64, found: u32, expected: u32 },

    #[error("Bad section footer at byte {offset}: found {found_type:#04x} id {found_id}, expected 0x7e id {expected_id} (machine types 2.3 and older, and Xen, send no footers; use a current machine type)")]
    BadFooter { offset: u64, found_type: u8, found_id: u32, expected_id: u32 },

    #[error("RAM record at byte {offset} has flag {flag} ({flags:#x}): {fix}")]
    RefusedFlag { offset: u64, flags: u64, flag: &'static str, fix: &'static str },

    #[error("Unknown RAM flag combination {flags:#x} at byte {offset}")]
    UnknownFlags { offset: u64, flags: u64 },

    #[error("RAM record at byte {offset} out of order: {why}")]
    RecordOrder { offset: u64, why: &'static str },

    #[error("Ramblock list at byte {offset}: {why}")]
    BadBlockList { offset: u64, why: String },

    #[error("Unknown ramblock '{name}' at byte {offset}: not in the stream's MEM_SIZE list")]
    UnknownBlock { offset: u64, name: String },

    #[error("Offset {page_offset:#x} in ramblock '{name}' at byte {offset} is beyond its used length {used_len:#x}")]
    OffsetBeyondBlock { offset: u64, name: String, page_offset: u64, used_len: u64 },

    #[error("Device-state tail passed {max} bytes at byte {offset}: raise Limits::max_tail_bytes if this stream is genuine")]
    TailTooLarge { offset: u64, max: usize },

    #[error("Stream truncated at byte {offset} while expecting {expected}: the source stopped early or the capture is incomplete")]
    Truncated { offset: u64, expected: &'static str },

    #[error("Device-state tail ending at byte {offset} is malformed: {why}")]
    BadTail { offset: u64, why: String },

    #[error("Sink refused the event at byte {offset}")]
    Sink {
        offset: u64,
        #[source]
        source: SinkError,
    },

    #[error("Parser already failed at byte {offset}: create a new parser for a new stream")]
    Poisoned { offset: u64 },
}

impl StreamError {
    /// Stream byte offset the error refers to.
    pub fn offset(&self) -> u64 {
        use StreamError::*;
        match self {
            BadMagic { offset, .. }
            | BadVersion { offset, .. }
            | BadConfiguration { offset, .. }
            | UnknownSubsection { offset, .. }
            | RefusedCapability { offset, .. }
            | Command { offset }
            | ForeignIterable { offset, .. }
            | UnexpectedSection { offset, .. }
            | RamVersion { offset, .. }
            | SectionIdMismatch { offset, .. }
            | BadFooter { offset, .. }
            | RefusedFlag { offset, .. }
            | UnknownFlags { offset, .. }
            | RecordOrder { offset, .. }
            | BadBlockList { offset, .. }
            | UnknownBlock { offset, .. }
            | OffsetBeyondBlock { offset, .. }
            | TailTooLarge { offset, .. }
            | Truncated { offset, .. }
            | BadTail { offset, .. }
            | Sink { offset, .. }
            | Poisoned { offset } => *offset,
        }
    }
}

/// Why a stream could not be generated.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("Write failed at stream byte {offset} while writing {what}")]
    Io {
        offset: u64,
        what: &'static str,
        #[source]
        source: io::Error,
    },

    #[error("Layout cannot be encoded: {why}")]
    Layout { why: String },

    #[error("Block index {block} is out of range: the layout has {count} ramblocks")]
    BlockIndex { block: u32, count: usize },

    #[error("Offset {page_offset:#x} in ramblock '{name}' is unaligned or beyond its used length {used_len:#x}")]
    BadOffset { name: String, page_offset: u64, used_len: u64 },

    #[error("{call} called after {state}: write pages, then the tail, then finish")]
    Order { call: &'static str, state: &'static str },

    #[error("Ramblock '{name}' is missing {missing} pages (first at offset {first:#x}): write every page, or call allow_partial()")]
    MissingPages { name: String, missing: u64, first: u64 },
}

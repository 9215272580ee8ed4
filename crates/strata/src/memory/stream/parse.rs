//! Push parser for QEMU 7.2 precopy migration streams.
//!
//! The caller feeds byte slices as they arrive (`feed`), of any size and split anywhere, and
//! calls `finish` when the source closes. The parser is an explicit state machine:
//!
//! ```text
//!  Magic ─► AfterHeader ─(0x07)─► AfterConfig ─(0x05)─► AfterConfig ...
//!              │                      │
//!              └──────────┬───────────┘
//!                         ▼
//!                      Section ─(START ram)─► RamRecord ─(MEM_SIZE)─► MemSizeEntry ×N ─► RamRecord
//!                       ▲  │ (PART/END ram)─► RamRecord ─(ZERO/PAGE)─► RamRecord
//!                       │  │                  RamRecord ─(EOS)───────► Footer ─► Section
//!                       │  └─(FULL/EOF)─► Tail (verbatim until finish)
//! ```
//!
//! Each state parses one *unit* (a record, a section header, a footer) from a contiguous
//! slice and either consumes it or answers "I need N bytes". When the caller's slice holds the
//! whole unit, the unit is parsed in place and a page is lent to the sink straight from the
//! caller's buffer; otherwise the unit's prefix is copied into a small staging buffer (at most
//! 8 + 256 + 4096 bytes for a page record) until it is complete. That keeps the hot path free
//! of copies, which matters because this single thread feeds the hashing pool.
//!
//! The tail (FULL device sections, EOF, VMDESCRIPTION) is not interpreted: it is passed on
//! verbatim and a copy (capped) is kept so `finish` can check that the stream really ended
//! with EOF + VMDESCRIPTION and hand the blob back. Background-snapshot streams have no RAM
//! END: their tail starts at the first FULL after a PART. Multiple precopy passes simply repeat
//! page records; the sink sees every record and the latest one wins.
//!
//! The event types and the summary live in `sink.rs`; the end-of-stream check of the tail in
//! `tail.rs`.

use super::error::StreamError;
use super::sink::{Event, Limits, ParseStats, StreamInfo, StreamSink};
use super::tail::validate_tail;
use super::wire::{self, FlagProblem, RecordKind};
use super::{BlockIdx, RamBlock, RamSectionHeader, SectionKind, StreamLayout, PAGE_SIZE};

const TARGET: &str = "strata::memory::stream";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Magic,
    AfterHeader,
    AfterConfig,
    Section,
    RamRecord,
    MemSizeEntry,
    Footer,
    Tail,
    Failed,
}

impl State {
    fn expecting(self) -> &'static str {
        match self {
            State::Magic => "the file header",
            State::AfterHeader | State::AfterConfig => "the configuration or the RAM START section",
            State::Section => "a section header (the stream stopped before its device state)",
            State::RamRecord => "a RAM record",
            State::MemSizeEntry => "a ramblock entry of MEM_SIZE",
            State::Footer => "a section footer",
            State::Tail | State::Failed => "nothing",
        }
    }
}

enum Step {
    Consumed(usize),
    Need(usize),
}

/// The push parser. One parser per stream.
pub struct Parser {
    limits: Limits,
    state: State,
    /// Stream offset of the first byte not consumed yet (the start of `stage`).
    offset: u64,
    /// Prefix of a unit that straddles two `feed` calls.
    stage: Vec<u8>,
    /// Bytes the staged unit needs before it can be parsed further.
    need: usize,
    version: u32,
    machine_type: Option<String>,
    config_subsections: Vec<u8>,
    ram: Option<RamSectionHeader>,
    blocks: Vec<RamBlock>,
    mem_remaining: u64,
    mem_size_seen: bool,
    ram_ended: bool,
    section: Option<(SectionKind, u32)>,
    records_in_section: u64,
    last_block: Option<u32>,
    tail: Vec<u8>,
    tail_offset: u64,
    stats: ParseStats,
}

impl Default for Parser {
    fn default() -> Self {
        Parser::new(Limits::default())
    }
}

impl Parser {
    pub fn new(limits: Limits) -> Self {
        Parser {
            limits,
            state: State::Magic,
            offset: 0,
            stage: Vec::with_capacity(PAGE_SIZE + 512),
            need: 0,
            version: 0,
            machine_type: None,
            config_subsections: Vec::new(),
            ram: None,
            blocks: Vec::new(),
            mem_remaining: 0,
            mem_size_seen: false,
            ram_ended: false,
            section: None,
            records_in_section: 0,
            last_block: None,
            tail: Vec::new(),
            tail_offset: 0,
            stats: ParseStats::default(),
        }
    }

    /// Bytes fed so far.
    pub fn bytes_fed(&self) -> u64 {
        self.offset + self.stage.len() as u64
    }

    /// The ramblock list, once `MEM_SIZE` has been read.
    pub fn blocks(&self) -> &[RamBlock] {
        if self.mem_size_seen {
            &self.blocks
        } else {
            &[]
        }
    }

    /// True once the RAM data is over and the device-state tail is being received.
    pub fn in_tail(&self) -> bool {
        self.state == State::Tail
    }

    /// Feed the next bytes of the stream. After an error the parser is poisoned.
    pub fn feed<S: StreamSink + ?Sized>(
        &mut self,
        input: &[u8],
        sink: &mut S,
    ) -> Result<(), StreamError> {
        if self.state == State::Failed {
            return Err(StreamError::Poisoned { offset: self.offset });
        }
        let r = self.feed_inner(input, sink);
        if r.is_err() {
            self.state = State::Failed;
        }
        r
    }

    fn feed_inner<S: StreamSink + ?Sized>(
        &mut self,
        mut input: &[u8],
        sink: &mut S,
    ) -> Result<(), StreamError> {
        while !input.is_empty() {
            if !self.stage.is_empty() {
                let take = self.need.saturating_sub(self.stage.len()).min(input.len());
                self.stage.extend_from_slice(&input[..take]);
                input = &input[take..];
                if self.stage.len() < self.need {
                    return Ok(());
                }
                self.drain_stage(sink)?;
            } else {
                match self.step(input, sink)? {
                    Step::Consumed(n) => {
                        self.offset += n as u64;
                        input = &input[n..];
                    }
                    Step::Need(k) => {
                        self.stage.extend_from_slice(input);
                        self.need = k;
                        input = &[];
                    }
                }
            }
        }
        Ok(())
    }

    /// Run units over the staging buffer until it is empty or needs more bytes.
    fn drain_stage<S: StreamSink + ?Sized>(&mut self, sink: &mut S) -> Result<(), StreamError> {
        let mut stage = std::mem::take(&mut self.stage);
        let mut pos = 0;
        let r = loop {
            if pos == stage.len() {
                break Ok(());
            }
            match self.step(&stage[pos..], sink) {
                Ok(Step::Consumed(n)) => {
                    pos += n;
                    self.offset += n as u64;
                }
                Ok(Step::Need(k)) => {
                    self.need = k;
                    break Ok(());
                }
                Err(e) => break Err(e),
            }
        };
        stage.drain(..pos);
        self.stage = stage;
        r
    }

    /// Check that the stream ended after its tail, validate the tail and return what was
    /// parsed. A stream that stops anywhere else is reported as truncated at its last byte.
    pub fn finish<S: StreamSink + ?Sized>(
        mut self,
        sink: &mut S,
    ) -> Result<StreamInfo, StreamError> {
        match self.state {
            State::Tail => {}
            State::Failed => return Err(StreamError::Poisoned { offset: self.offset }),
            s => {
                return Err(StreamError::Truncated {
                    offset: self.bytes_fed(),
                    expected: s.expecting(),
                });
            }
        }
        let end = self.bytes_fed();
        let vmdesc_devices = validate_tail(&self.tail, end, self.limits.require_vmdesc)?;
        // The tail is only entered after a RAM START, so the header is always known here.
        let Some(ram_section) = self.ram.clone() else {
            return Err(StreamError::Poisoned { offset: end });
        };
        let layout = StreamLayout {
            version: self.version,
            machine_type: self.machine_type.take(),
            config_subsections: std::mem::take(&mut self.config_subsections),
            ram_section,
            blocks: std::mem::take(&mut self.blocks),
        };
        self.stats.bytes = end;
        sink.event(Event::End { layout: &layout })
            .map_err(|source| StreamError::Sink { offset: end, source })?;
        tracing::debug!(target: TARGET, bytes = end, pages = self.stats.page_records,
            zeros = self.stats.zero_records, tail = self.tail.len(), "stream parsed");
        Ok(StreamInfo {
            layout,
            stats: self.stats,
            tail_offset: self.tail_offset,
            tail: self.tail,
            vmdesc_devices,
            background_snapshot: !self.ram_ended,
        })
    }

    fn emit<S: StreamSink + ?Sized>(&self, sink: &mut S, ev: Event<'_>) -> Result<(), StreamError> {
        sink.event(ev).map_err(|source| StreamError::Sink { offset: self.offset, source })
    }

    fn step<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        match self.state {
            State::RamRecord => self.step_record(b, sink),
            State::Magic => self.step_magic(b, sink),
            State::AfterHeader | State::AfterConfig | State::Section => self.step_section(b, sink),
            State::MemSizeEntry => self.step_mem_entry(b, sink),
            State::Footer => self.step_footer(b, sink),
            State::Tail => self.step_tail(b, sink),
            State::Failed => Err(StreamError::Poisoned { offset: self.offset }),
        }
    }

    fn step_magic<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if b.len() < 8 {
            return Ok(Step::Need(8));
        }
        let magic = wire::be32(b, 0);
        if magic != wire::FILE_MAGIC {
            return Err(StreamError::BadMagic { offset: self.offset, found: magic });
        }
        let version = wire::be32(b, 4);
        if version != wire::FILE_VERSION {
            return Err(StreamError::BadVersion { offset: self.offset + 4, found: version });
        }
        self.version = version;
        self.state = State::AfterHeader;
        self.emit(sink, Event::Header { version })?;
        Ok(Step::Consumed(8))
    }

    fn step_section<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        let off = self.offset;
        let unexpected = |why| Err(StreamError::UnexpectedSection { offset: off, kind: b[0], why });
        match b[0] {
            wire::SEC_CONFIGURATION if self.state == State::AfterHeader => {
                self.step_configuration(b, sink)
            }
            wire::SEC_SUBSECTION if self.state == State::AfterConfig => self.step_subsection(b),
            wire::SEC_START => self.step_start(b, sink),
            wire::SEC_PART | wire::SEC_END => self.step_part_end(b, sink),
            wire::SEC_FULL | wire::SEC_EOF => {
                if self.ram.is_none() {
                    return unexpected(
                        "device state before the RAM section (QEMU 8+ early_setup, or a stream without RAM)",
                    );
                }
                tracing::debug!(target: TARGET, offset = off, background = !self.ram_ended, "device-state tail starts");
                self.state = State::Tail;
                self.tail_offset = off;
                self.step_tail(b, sink)
            }
            wire::SEC_COMMAND => Err(StreamError::Command { offset: off }),
            wire::SEC_CONFIGURATION => {
                unexpected("CONFIGURATION is only valid right after the file header")
            }
            wire::SEC_SUBSECTION => unexpected("SUBSECTION outside the configuration"),
            wire::SEC_VMDESCRIPTION => unexpected("VMDESCRIPTION before EOF"),
            _ => unexpected("not a QEMU 7.2 section type"),
        }
    }

    fn step_configuration<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if b.len() < 5 {
            return Ok(Step::Need(5));
        }
        let len = wire::be32(b, 1) as usize;
        if len > self.limits.max_machine_type {
            return Err(StreamError::BadConfiguration {
                offset: self.offset + 1,
                why: format!(
                    "machine type is {len} bytes, over the {}-byte cap",
                    self.limits.max_machine_type
                ),
            });
        }
        if b.len() < 5 + len {
            return Ok(Step::Need(5 + len));
        }
        let name =
            std::str::from_utf8(&b[5..5 + len]).map_err(|_| StreamError::BadConfiguration {
                offset: self.offset + 5,
                why: "machine type is not UTF-8".into(),
            })?;
        self.machine_type = Some(name.to_owned());
        self.state = State::AfterConfig;
        self.emit(sink, Event::Configuration { machine_type: name })?;
        Ok(Step::Consumed(5 + len))
    }

    /// `0x05 | idstr name | be32 version | body`. `configuration/uuid` (16 bytes) and
    /// `configuration/target-page-bits` (be32, must be 12) are kept verbatim;
    /// `configuration/capabilities` is parsed so the error can name the capability.
    fn step_subsection(&mut self, b: &[u8]) -> Result<Step, StreamError> {
        if b.len() < 2 {
            return Ok(Step::Need(2));
        }
        let n = b[1] as usize;
        let hdr = 2 + n + 4;
        if b.len() < hdr {
            return Ok(Step::Need(hdr));
        }
        let name = String::from_utf8_lossy(&b[2..2 + n]).into_owned();
        let total = match name.as_str() {
            wire::SUBSECTION_UUID => hdr + 16,
            wire::SUBSECTION_TARGET_PAGE_BITS => {
                if b.len() < hdr + 4 {
                    return Ok(Step::Need(hdr + 4));
                }
                let bits = wire::be32(b, hdr);
                if bits != wire::PAGE_BITS {
                    return Err(StreamError::BadConfiguration {
                        offset: self.offset + hdr as u64,
                        why: format!(
                            "target page size is 2^{bits} bytes; only 4 KiB pages are parsed"
                        ),
                    });
                }
                hdr + 4
            }
            wire::SUBSECTION_CAPABILITIES => {
                if b.len() < hdr + 4 {
                    return Ok(Step::Need(hdr + 4));
                }
                let count = wire::be32(b, hdr) as usize;
                if count > 64 {
                    return Err(StreamError::BadConfiguration {
                        offset: self.offset + hdr as u64,
                        why: format!("{count} capabilities listed, over the cap of 64"),
                    });
                }
                let mut pos = hdr + 4;
                let mut caps = Vec::new();
                for _ in 0..count {
                    if b.len() < pos + 1 {
                        return Ok(Step::Need(pos + 1));
                    }
                    let l = b[pos] as usize;
                    if b.len() < pos + 1 + l {
                        return Ok(Step::Need(pos + 1 + l));
                    }
                    caps.push(String::from_utf8_lossy(&b[pos + 1..pos + 1 + l]).into_owned());
                    pos += 1 + l;
                }
                // QEMU 7.2 lists only capabilities that change the stream (x-ignore-shared),
                // and none of them can be stored faithfully.
                return Err(StreamError::RefusedCapability {
                    offset: self.offset,
                    capability: caps.join(","),
                    fix: "shared ramblocks are left out of such streams; disable x-ignore-shared",
                });
            }
            _ => return Err(StreamError::UnknownSubsection { offset: self.offset, name }),
        };
        if b.len() < total {
            return Ok(Step::Need(total));
        }
        self.config_subsections.extend_from_slice(&b[..total]);
        Ok(Step::Consumed(total))
    }

    fn step_start<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if b.len() < 6 {
            return Ok(Step::Need(6));
        }
        let n = b[5] as usize;
        let total = 6 + n + 8;
        if b.len() < total {
            return Ok(Step::Need(total));
        }
        let section_id = wire::be32(b, 1);
        let idstr = &b[6..6 + n];
        if idstr != wire::RAM_IDSTR.as_bytes() {
            return Err(StreamError::ForeignIterable {
                offset: self.offset,
                idstr: String::from_utf8_lossy(idstr).into_owned(),
            });
        }
        if self.ram.is_some() {
            return Err(StreamError::UnexpectedSection {
                offset: self.offset,
                kind: b[0],
                why: "second RAM START section",
            });
        }
        let instance_id = wire::be32(b, 6 + n);
        let version_id = wire::be32(b, 10 + n);
        if version_id != wire::RAM_SECTION_VERSION {
            return Err(StreamError::RamVersion {
                offset: self.offset + 10 + n as u64,
                found: version_id,
            });
        }
        tracing::debug!(target: TARGET, offset = self.offset, section_id, instance_id, "RAM START");
        self.ram = Some(RamSectionHeader { section_id, instance_id, version_id });
        self.begin_section(SectionKind::Start, section_id, sink)?;
        Ok(Step::Consumed(total))
    }

    fn step_part_end<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if b.len() < 5 {
            return Ok(Step::Need(5));
        }
        let kind = if b[0] == wire::SEC_PART { SectionKind::Part } else { SectionKind::End };
        let unexpected =
            |why| Err(StreamError::UnexpectedSection { offset: self.offset, kind: b[0], why });
        let Some(ram) = &self.ram else {
            return unexpected("PART or END before the RAM START section");
        };
        if self.ram_ended {
            return unexpected("RAM section after the RAM END section");
        }
        let id = wire::be32(b, 1);
        if id != ram.section_id {
            return Err(StreamError::SectionIdMismatch {
                offset: self.offset + 1,
                found: id,
                expected: ram.section_id,
            });
        }
        match kind {
            SectionKind::End => {
                self.ram_ended = true;
                self.stats.end_sections += 1;
                tracing::debug!(target: TARGET, offset = self.offset, "RAM END");
            }
            _ => {
                self.stats.part_sections += 1;
                tracing::trace!(target: TARGET, offset = self.offset, "RAM PART");
            }
        }
        self.begin_section(kind, id, sink)?;
        Ok(Step::Consumed(5))
    }

    fn begin_section<S: StreamSink + ?Sized>(
        &mut self,
        kind: SectionKind,
        id: u32,
        sink: &mut S,
    ) -> Result<(), StreamError> {
        self.section = Some((kind, id));
        self.records_in_section = 0;
        self.state = State::RamRecord;
        self.emit(sink, Event::SectionBegin { kind, section_id: id })
    }

    #[inline]
    fn step_record<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if b.len() < 8 {
            return Ok(Step::Need(8));
        }
        let word = wire::be64(b, 0);
        let h = wire::decode_record(word).map_err(|p| match p {
            FlagProblem::Refused(flag, fix) => StreamError::RefusedFlag {
                offset: self.offset,
                flags: word & !wire::PAGE_MASK,
                flag,
                fix,
            },
            FlagProblem::Unknown => {
                StreamError::UnknownFlags { offset: self.offset, flags: word & !wire::PAGE_MASK }
            }
        })?;
        let first = self.records_in_section == 0;
        match h.kind {
            RecordKind::Page | RecordKind::Zero => {
                if !self.mem_size_seen {
                    return Err(StreamError::RecordOrder {
                        offset: self.offset,
                        why: "page record before the MEM_SIZE ramblock list",
                    });
                }
                let (idx, hdr) = if h.cont {
                    match self.last_block {
                        Some(i) => (i, 8),
                        None => {
                            return Err(StreamError::RecordOrder {
                                offset: self.offset,
                                why: "CONTINUE with no previous ramblock",
                            })
                        }
                    }
                } else {
                    if b.len() < 9 {
                        return Ok(Step::Need(9));
                    }
                    let n = b[8] as usize;
                    if b.len() < 9 + n {
                        return Ok(Step::Need(9 + n));
                    }
                    (self.lookup(&b[9..9 + n])?, 9 + n)
                };
                let block = &self.blocks[idx as usize];
                if h.addr >= block.used_len {
                    return Err(StreamError::OffsetBeyondBlock {
                        offset: self.offset,
                        name: block.name.clone(),
                        page_offset: h.addr,
                        used_len: block.used_len,
                    });
                }
                let ev = if h.kind == RecordKind::Page {
                    let Some(data) = b[hdr..].first_chunk::<PAGE_SIZE>() else {
                        return Ok(Step::Need(hdr + PAGE_SIZE));
                    };
                    self.stats.page_records += 1;
                    (Event::Page { block: BlockIdx(idx), offset: h.addr, data }, hdr + PAGE_SIZE)
                } else {
                    let Some(&fill) = b.get(hdr) else {
                        return Ok(Step::Need(hdr + 1));
                    };
                    self.stats.zero_records += 1;
                    (Event::Zero { block: BlockIdx(idx), offset: h.addr, fill }, hdr + 1)
                };
                self.last_block = Some(idx);
                self.records_in_section += 1;
                self.emit(sink, ev.0)?;
                Ok(Step::Consumed(ev.1))
            }
            RecordKind::MemSize => {
                if self.mem_size_seen
                    || !first
                    || self.section.map(|s| s.0) != Some(SectionKind::Start)
                {
                    return Err(StreamError::RecordOrder {
                        offset: self.offset,
                        why: "MEM_SIZE is only valid as the first record of the RAM START section",
                    });
                }
                if h.addr == 0 {
                    return Err(StreamError::BadBlockList {
                        offset: self.offset,
                        why: "MEM_SIZE announces 0 bytes".into(),
                    });
                }
                self.mem_remaining = h.addr;
                self.records_in_section += 1;
                self.state = State::MemSizeEntry;
                Ok(Step::Consumed(8))
            }
            RecordKind::Eos => {
                if h.addr != 0 {
                    return Err(StreamError::UnknownFlags { offset: self.offset, flags: word });
                }
                if !self.mem_size_seen {
                    return Err(StreamError::RecordOrder {
                        offset: self.offset,
                        why: "RAM START section ended without a MEM_SIZE ramblock list",
                    });
                }
                self.state = State::Footer;
                Ok(Step::Consumed(8))
            }
        }
    }

    /// Block lookup by idstr; the list is short (6–10 blocks) and a non-CONTINUE record only
    /// comes once per block switch, so a linear scan is enough.
    fn lookup(&self, name: &[u8]) -> Result<u32, StreamError> {
        if let Some(i) = self.last_block {
            if self.blocks[i as usize].name.as_bytes() == name {
                return Ok(i);
            }
        }
        self.blocks.iter().position(|b| b.name.as_bytes() == name).map(|i| i as u32).ok_or_else(
            || StreamError::UnknownBlock {
                offset: self.offset + 9,
                name: String::from_utf8_lossy(name).into_owned(),
            },
        )
    }

    fn step_mem_entry<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        let n = b[0] as usize;
        let total = 1 + n + 8;
        if b.len() < total {
            return Ok(Step::Need(total));
        }
        let bad = |why: String| Err(StreamError::BadBlockList { offset: self.offset, why });
        let Ok(name) = std::str::from_utf8(&b[1..1 + n]) else {
            return bad("ramblock name is not UTF-8".into());
        };
        let used_len = wire::be64(b, 1 + n);
        if n == 0 {
            return bad("empty ramblock name".into());
        }
        if used_len == 0 || !used_len.is_multiple_of(PAGE_SIZE as u64) {
            return bad(format!(
                "ramblock '{name}' has length {used_len:#x}, not a non-zero multiple of 4 KiB"
            ));
        }
        if used_len > self.limits.max_block_bytes {
            return bad(format!(
                "ramblock '{name}' is {used_len} bytes, over the cap of {}",
                self.limits.max_block_bytes
            ));
        }
        if used_len > self.mem_remaining {
            return bad(format!(
                "ramblock '{name}' ({used_len:#x} bytes) overruns the MEM_SIZE total"
            ));
        }
        if self.blocks.iter().any(|blk| blk.name == name) {
            return bad(format!("ramblock '{name}' is listed twice"));
        }
        if self.blocks.len() >= self.limits.max_blocks {
            return bad(format!("more than {} ramblocks", self.limits.max_blocks));
        }
        self.blocks.push(RamBlock { name: name.to_owned(), used_len });
        self.mem_remaining -= used_len;
        if self.mem_remaining == 0 {
            self.mem_size_seen = true;
            self.state = State::RamRecord;
            tracing::debug!(target: TARGET, blocks = self.blocks.len(), "ramblock list read");
            self.emit(sink, Event::RamBlocks(&self.blocks))?;
        }
        Ok(Step::Consumed(total))
    }

    fn step_footer<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if b.len() < 5 {
            return Ok(Step::Need(5));
        }
        let Some((kind, id)) = self.section else {
            return Err(StreamError::Poisoned { offset: self.offset });
        };
        let found_id = wire::be32(b, 1);
        if b[0] != wire::SEC_FOOTER || found_id != id {
            return Err(StreamError::BadFooter {
                offset: self.offset,
                found_type: b[0],
                found_id,
                expected_id: id,
            });
        }
        self.section = None;
        self.state = State::Section;
        self.emit(sink, Event::SectionEnd { kind, section_id: id })?;
        Ok(Step::Consumed(5))
    }

    fn step_tail<S: StreamSink + ?Sized>(
        &mut self,
        b: &[u8],
        sink: &mut S,
    ) -> Result<Step, StreamError> {
        if self.tail.len() + b.len() > self.limits.max_tail_bytes {
            return Err(StreamError::TailTooLarge {
                offset: self.offset + (self.limits.max_tail_bytes - self.tail.len()) as u64,
                max: self.limits.max_tail_bytes,
            });
        }
        self.tail.extend_from_slice(b);
        self.emit(sink, Event::Tail(b))?;
        Ok(Step::Consumed(b.len()))
    }
}

//! Generator: writes a QEMU 7.2 migration stream from a layout, pages and a device-state tail.
//!
//! The stream written is the smallest one QEMU's loader accepts for a stored checkpoint:
//!
//! ```text
//! QEVM v3 | CONFIGURATION (+ subsections, verbatim) |
//! START ram: MEM_SIZE + ramblock list, EOS, footer |
//! END ram:   PAGE/ZERO records (CONTINUE while the block does not change), EOS, footer |
//! tail verbatim (FULL sections, EOF, VMDESCRIPTION)
//! ```
//!
//! Section id, instance id and version of the `ram` section are the ones the original source
//! used (kept in [`StreamLayout`]), so the ids cannot clash with the FULL sections of the tail.
//! By default every page of every block must be written before the tail: a page left out would
//! keep the destination's initial content, which for ROM blocks is not zero. Writes go through
//! a 1 MiB `BufWriter` so a page costs one memcpy and QEMU's loader stays the bottleneck.

use std::io::{BufWriter, Write};

use super::error::GenerateError;
use super::wire::{self, RecordKind};
use super::{BlockIdx, SectionKind, StreamLayout, PAGE_SIZE};

const TARGET: &str = "strata::memory::stream";
const BUF_BYTES: usize = 1 << 20;

/// Content of one page record.
#[derive(Debug, Clone, Copy)]
pub enum PageContent<'a> {
    /// A full page, sent as PAGE.
    Data(&'a [u8; PAGE_SIZE]),
    /// A page filled with one byte, sent as ZERO.
    Fill(u8),
}

/// One page record for [`generate`].
#[derive(Debug, Clone, Copy)]
pub struct PageRecord<'a> {
    pub block: BlockIdx,
    pub offset: u64,
    pub content: PageContent<'a>,
}

/// Counters of a generated stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GenerateStats {
    pub bytes: u64,
    pub page_records: u64,
    pub zero_records: u64,
    pub tail_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WState {
    Ram,
    Tail,
}

/// Incremental stream writer: `new` (header, configuration, RAM START), `page`/`zero` any
/// number of times, `tail`, `finish`.
pub struct StreamWriter<W: Write> {
    out: BufWriter<W>,
    layout: StreamLayout,
    state: WState,
    last_block: Option<u32>,
    stats: GenerateStats,
    coverage: Vec<Vec<u64>>,
    allow_partial: bool,
}

fn put<W: Write>(
    out: &mut BufWriter<W>,
    bytes: &mut u64,
    what: &'static str,
    data: &[u8],
) -> Result<(), GenerateError> {
    out.write_all(data).map_err(|source| GenerateError::Io { offset: *bytes, what, source })?;
    *bytes += data.len() as u64;
    Ok(())
}

fn check_layout(layout: &StreamLayout) -> Result<(), GenerateError> {
    let bad = |why: String| Err(GenerateError::Layout { why });
    if layout.version != wire::FILE_VERSION {
        return bad(format!("file version {} (only 3 is written)", layout.version));
    }
    if layout.ram_section.version_id != wire::RAM_SECTION_VERSION {
        return bad(format!(
            "RAM section version {} (QEMU 7.2 loads only 4)",
            layout.ram_section.version_id
        ));
    }
    if layout.machine_type.is_none() && !layout.config_subsections.is_empty() {
        return bad("configuration subsections without a machine type".into());
    }
    if layout.blocks.is_empty() {
        return bad("no ramblocks".into());
    }
    for (i, b) in layout.blocks.iter().enumerate() {
        if b.name.is_empty() || b.name.len() > 255 {
            return bad(format!("ramblock name '{}' must be 1 to 255 bytes", b.name));
        }
        if b.used_len == 0 || b.used_len % PAGE_SIZE as u64 != 0 {
            return bad(format!(
                "ramblock '{}' length {:#x} is not a non-zero multiple of 4 KiB",
                b.name, b.used_len
            ));
        }
        if layout.blocks[..i].iter().any(|o| o.name == b.name) {
            return bad(format!("ramblock '{}' is listed twice", b.name));
        }
    }
    Ok(())
}

impl<W: Write> StreamWriter<W> {
    /// Write the file header, CONFIGURATION and the RAM START section, and open the RAM END
    /// section that will carry the pages.
    pub fn new(out: W, layout: &StreamLayout) -> Result<Self, GenerateError> {
        check_layout(layout)?;
        let mut head = Vec::with_capacity(256);
        wire::put_file_header(&mut head, layout.version);
        if let Some(m) = &layout.machine_type {
            wire::put_configuration(&mut head, m, &layout.config_subsections);
        }
        let id = layout.ram_section.section_id;
        wire::put_ram_start(&mut head, &layout.ram_section);
        head.extend_from_slice(&wire::record_word(layout.total_ram(), RecordKind::MemSize, false));
        for b in &layout.blocks {
            // Names were checked to be at most 255 bytes.
            let _ = wire::put_idstr(&mut head, &b.name);
            head.extend_from_slice(&b.used_len.to_be_bytes());
        }
        head.extend_from_slice(&wire::record_word(0, RecordKind::Eos, false));
        wire::put_footer(&mut head, id);
        wire::put_section_short(&mut head, SectionKind::End, id);

        let mut w = StreamWriter {
            out: BufWriter::with_capacity(BUF_BYTES, out),
            layout: layout.clone(),
            state: WState::Ram,
            last_block: None,
            stats: GenerateStats::default(),
            coverage: layout
                .blocks
                .iter()
                .map(|b| vec![0u64; b.pages().div_ceil(64) as usize])
                .collect(),
            allow_partial: false,
        };
        put(&mut w.out, &mut w.stats.bytes, "the stream header", &head)?;
        tracing::debug!(target: TARGET, blocks = layout.blocks.len(), total = layout.total_ram(), "generating stream");
        Ok(w)
    }

    /// Accept a stream that does not write every page (the destination keeps its own content
    /// for the missing ones).
    pub fn allow_partial(&mut self) -> &mut Self {
        self.allow_partial = true;
        self
    }

    /// Write one full page.
    pub fn page(
        &mut self,
        block: BlockIdx,
        offset: u64,
        data: &[u8; PAGE_SIZE],
    ) -> Result<(), GenerateError> {
        self.record(block, offset, RecordKind::Page, data)
    }

    /// Write one page filled with `fill`.
    pub fn zero(&mut self, block: BlockIdx, offset: u64, fill: u8) -> Result<(), GenerateError> {
        self.record(block, offset, RecordKind::Zero, &[fill])
    }

    /// Write a [`PageRecord`].
    pub fn write_record(&mut self, rec: &PageRecord<'_>) -> Result<(), GenerateError> {
        match rec.content {
            PageContent::Data(d) => self.page(rec.block, rec.offset, d),
            PageContent::Fill(f) => self.zero(rec.block, rec.offset, f),
        }
    }

    #[inline]
    fn record(
        &mut self,
        block: BlockIdx,
        offset: u64,
        kind: RecordKind,
        payload: &[u8],
    ) -> Result<(), GenerateError> {
        if self.state != WState::Ram {
            return Err(GenerateError::Order { call: "page", state: "the tail" });
        }
        let Some(b) = self.layout.blocks.get(block.get()) else {
            return Err(GenerateError::BlockIndex {
                block: block.0,
                count: self.layout.blocks.len(),
            });
        };
        if !offset.is_multiple_of(PAGE_SIZE as u64) || offset >= b.used_len {
            return Err(GenerateError::BadOffset {
                name: b.name.clone(),
                page_offset: offset,
                used_len: b.used_len,
            });
        }
        let cont = self.last_block == Some(block.0);
        let mut hdr = [0u8; 8 + 256];
        hdr[..8].copy_from_slice(&wire::record_word(offset, kind, cont));
        let mut n = 8;
        if !cont {
            hdr[8] = b.name.len() as u8;
            hdr[9..9 + b.name.len()].copy_from_slice(b.name.as_bytes());
            n += 1 + b.name.len();
        }
        put(&mut self.out, &mut self.stats.bytes, "a page record", &hdr[..n])?;
        put(&mut self.out, &mut self.stats.bytes, "a page record", payload)?;
        let page = offset / PAGE_SIZE as u64;
        self.coverage[block.get()][(page / 64) as usize] |= 1 << (page % 64);
        self.last_block = Some(block.0);
        match kind {
            RecordKind::Page => self.stats.page_records += 1,
            _ => self.stats.zero_records += 1,
        }
        Ok(())
    }

    /// Close the RAM END section (EOS + footer). Called by `tail` if not called before.
    fn end_ram(&mut self) -> Result<(), GenerateError> {
        if !self.allow_partial {
            for (b, bits) in self.layout.blocks.iter().zip(&self.coverage) {
                let pages = b.pages();
                let present: u64 = bits.iter().map(|w| w.count_ones() as u64).sum();
                if present < pages {
                    let first = (0..pages)
                        .find(|p| bits[(p / 64) as usize] & (1 << (p % 64)) == 0)
                        .unwrap_or(0);
                    return Err(GenerateError::MissingPages {
                        name: b.name.clone(),
                        missing: pages - present,
                        first: first * PAGE_SIZE as u64,
                    });
                }
            }
        }
        let mut end = Vec::with_capacity(13);
        end.extend_from_slice(&wire::record_word(0, RecordKind::Eos, false));
        wire::put_footer(&mut end, self.layout.ram_section.section_id);
        put(&mut self.out, &mut self.stats.bytes, "the RAM END section", &end)?;
        self.state = WState::Tail;
        Ok(())
    }

    /// Close the RAM data and append device-state tail bytes verbatim. May be called several
    /// times; the first call's bytes must start with a FULL section or EOF.
    pub fn tail(&mut self, bytes: &[u8]) -> Result<(), GenerateError> {
        if self.state == WState::Ram {
            match bytes.first() {
                Some(&wire::SEC_FULL) | Some(&wire::SEC_EOF) => {}
                _ => {
                    return Err(GenerateError::Layout {
                        why: "the tail must start with a FULL section (0x04) or EOF (0x00)".into(),
                    })
                }
            }
            self.end_ram()?;
        }
        put(&mut self.out, &mut self.stats.bytes, "the device-state tail", bytes)?;
        self.stats.tail_bytes += bytes.len() as u64;
        Ok(())
    }

    /// Flush and return the writer. The tail must have been written.
    pub fn finish(self) -> Result<(W, GenerateStats), GenerateError> {
        if self.state == WState::Ram {
            return Err(GenerateError::Order { call: "finish", state: "no tail" });
        }
        let stats = self.stats;
        let out = self.out.into_inner().map_err(|e| GenerateError::Io {
            offset: stats.bytes,
            what: "the final flush",
            source: e.into_error(),
        })?;
        tracing::debug!(target: TARGET, bytes = stats.bytes, pages = stats.page_records, zeros = stats.zero_records, "stream generated");
        Ok((out, stats))
    }
}

/// Write a whole stream: layout, `pages` in the order given, then `tail`.
pub fn generate<'a, W, I>(
    out: W,
    layout: &StreamLayout,
    pages: I,
    tail: &[u8],
) -> Result<(W, GenerateStats), GenerateError>
where
    W: Write,
    I: IntoIterator<Item = PageRecord<'a>>,
{
    let mut w = StreamWriter::new(out, layout)?;
    for rec in pages {
        w.write_record(&rec)?;
    }
    w.tail(tail)?;
    w.finish()
}

//! Wire constants and byte encodings of QEMU 7.2's migration stream.
//!
//! Values come from QEMU's `migration/savevm.c` (section types, file magic, footer) and
//! `migration/ram.c` (RAM record flags), cross-checked against streams captured from
//! qemu-system-x86_64 7.2 on this machine. All integers are big-endian; an `idstr` is a `u8`
//! length followed by that many bytes. Both the parser and the generator use this file, and the
//! unit tests below pin every encoding byte for byte, so a change here cannot go unnoticed.

use super::{RamSectionHeader, SectionKind};

/// Target page size of x86 guests: RAM records address whole 4 KiB pages.
pub const PAGE_SIZE: usize = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_BITS: u32 = 12;
/// Mask of the page-aligned address part of a RAM record word; the low 12 bits are flags.
pub const PAGE_MASK: u64 = !(PAGE_SIZE as u64 - 1);

/// `QEMU_VM_FILE_MAGIC`, the ASCII bytes "QEVM".
pub const FILE_MAGIC: u32 = 0x5145_564d;
/// `QEMU_VM_FILE_VERSION`.
pub const FILE_VERSION: u32 = 3;
/// `QEMU_VM_FILE_VERSION_COMPAT`: the obsolete v2 format.
pub const FILE_VERSION_COMPAT: u32 = 2;

/// Section types (`QEMU_VM_*` in savevm.c).
pub const SEC_EOF: u8 = 0x00;
pub const SEC_START: u8 = 0x01;
pub const SEC_PART: u8 = 0x02;
pub const SEC_END: u8 = 0x03;
pub const SEC_FULL: u8 = 0x04;
pub const SEC_SUBSECTION: u8 = 0x05;
pub const SEC_VMDESCRIPTION: u8 = 0x06;
pub const SEC_CONFIGURATION: u8 = 0x07;
pub const SEC_COMMAND: u8 = 0x08;
pub const SEC_FOOTER: u8 = 0x7e;

/// RAM record flags (`RAM_SAVE_FLAG_*` in ram.c), in the low bits of the record's be64.
pub const RAM_FULL: u64 = 0x01;
pub const RAM_ZERO: u64 = 0x02;
pub const RAM_MEM_SIZE: u64 = 0x04;
pub const RAM_PAGE: u64 = 0x08;
pub const RAM_EOS: u64 = 0x10;
pub const RAM_CONTINUE: u64 = 0x20;
pub const RAM_XBZRLE: u64 = 0x40;
pub const RAM_HOOK: u64 = 0x80;
pub const RAM_COMPRESS_PAGE: u64 = 0x100;
pub const RAM_MULTIFD_FLUSH: u64 = 0x200;

/// The id string and section version of RAM's live section.
pub const RAM_IDSTR: &str = "ram";
pub const RAM_SECTION_VERSION: u32 = 4;

/// Configuration subsections that QEMU 7.2 can send after the machine type.
pub const SUBSECTION_CAPABILITIES: &str = "configuration/capabilities";
pub const SUBSECTION_UUID: &str = "configuration/uuid";
/// Only sent when a target's page size exceeds its minimum (never on x86).
pub const SUBSECTION_TARGET_PAGE_BITS: &str = "configuration/target-page-bits";

/// What one RAM record is, after its flags were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// Page filled with one byte: `[idstr] u8`.
    Zero,
    /// Full page: `[idstr] 4096 bytes`.
    Page,
    /// Block list; the address field holds the total RAM size.
    MemSize,
    /// End of the section's RAM body.
    Eos,
}

/// Why a RAM record's flags were refused. The parser turns this into a `StreamError` that
/// carries the byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagProblem {
    /// A known flag this module refuses: (flag name, how to avoid it).
    Refused(&'static str, &'static str),
    /// Not a combination QEMU 7.2 writes.
    Unknown,
}

/// A decoded RAM record word: kind, CONTINUE bit and the page-aligned address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub cont: bool,
    pub addr: u64,
}

/// Split a RAM record's be64 into kind, CONTINUE and address, refusing everything except
/// ZERO, PAGE (both with or without CONTINUE), MEM_SIZE and EOS.
pub fn decode_record(word: u64) -> Result<RecordHeader, FlagProblem> {
    let flags = word & !PAGE_MASK;
    let addr = word & PAGE_MASK;
    if flags & RAM_XBZRLE != 0 {
        return Err(FlagProblem::Refused("XBZRLE", "disable the xbzrle capability"));
    }
    if flags & RAM_COMPRESS_PAGE != 0 {
        return Err(FlagProblem::Refused("COMPRESS_PAGE", "disable the compress capability"));
    }
    if flags & RAM_MULTIFD_FLUSH != 0 {
        return Err(FlagProblem::Refused(
            "MULTIFD_FLUSH",
            "disable the multifd capability (this flag is from QEMU 8 or later)",
        ));
    }
    if flags & RAM_HOOK != 0 {
        return Err(FlagProblem::Refused(
            "HOOK",
            "RDMA migration is not supported; migrate over exec:, fd: or unix:",
        ));
    }
    let cont = flags & RAM_CONTINUE != 0;
    let kind = match flags & !RAM_CONTINUE {
        RAM_ZERO => RecordKind::Zero,
        RAM_PAGE => RecordKind::Page,
        RAM_MEM_SIZE if !cont => RecordKind::MemSize,
        RAM_EOS if !cont => RecordKind::Eos,
        _ => return Err(FlagProblem::Unknown),
    };
    Ok(RecordHeader { kind, cont, addr })
}

/// Encode a RAM record word.
pub fn record_word(addr: u64, kind: RecordKind, cont: bool) -> [u8; 8] {
    let flag = match kind {
        RecordKind::Zero => RAM_ZERO,
        RecordKind::Page => RAM_PAGE,
        RecordKind::MemSize => RAM_MEM_SIZE,
        RecordKind::Eos => RAM_EOS,
    };
    let c = if cont { RAM_CONTINUE } else { 0 };
    ((addr & PAGE_MASK) | flag | c).to_be_bytes()
}

/// Big-endian reads at a fixed offset, for callers that checked the length.
pub use crate::endian::{be32, be64};

/// Append an idstr (u8 length + bytes). Names longer than 255 bytes cannot be encoded.
pub fn put_idstr(out: &mut Vec<u8>, name: &str) -> Result<(), usize> {
    let n = name.len();
    if n > 255 {
        return Err(n);
    }
    out.push(n as u8);
    out.extend_from_slice(name.as_bytes());
    Ok(())
}

/// File header: magic + version.
pub fn put_file_header(out: &mut Vec<u8>, version: u32) {
    out.extend_from_slice(&FILE_MAGIC.to_be_bytes());
    out.extend_from_slice(&version.to_be_bytes());
}

/// CONFIGURATION section: type, be32 length, machine type, then raw subsections.
pub fn put_configuration(out: &mut Vec<u8>, machine_type: &str, subsections: &[u8]) {
    out.push(SEC_CONFIGURATION);
    out.extend_from_slice(&(machine_type.len() as u32).to_be_bytes());
    out.extend_from_slice(machine_type.as_bytes());
    out.extend_from_slice(subsections);
}

/// START section header of the `ram` section.
pub fn put_ram_start(out: &mut Vec<u8>, h: &RamSectionHeader) {
    out.push(SEC_START);
    out.extend_from_slice(&h.section_id.to_be_bytes());
    out.push(RAM_IDSTR.len() as u8);
    out.extend_from_slice(RAM_IDSTR.as_bytes());
    out.extend_from_slice(&h.instance_id.to_be_bytes());
    out.extend_from_slice(&h.version_id.to_be_bytes());
}

/// PART or END section header (type + be32 section id).
pub fn put_section_short(out: &mut Vec<u8>, kind: SectionKind, section_id: u32) {
    out.push(match kind {
        SectionKind::Start => SEC_START,
        SectionKind::Part => SEC_PART,
        SectionKind::End => SEC_END,
    });
    out.extend_from_slice(&section_id.to_be_bytes());
}

/// Section footer: 0x7e + be32 section id.
pub fn put_footer(out: &mut Vec<u8>, section_id: u32) {
    out.push(SEC_FOOTER);
    out.extend_from_slice(&section_id.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bytes() {
        let mut v = Vec::new();
        put_file_header(&mut v, FILE_VERSION);
        assert_eq!(v, b"QEVM\x00\x00\x00\x03");
    }

    #[test]
    fn configuration_bytes() {
        // As captured from `-machine pc` on QEMU 7.2.
        let mut v = Vec::new();
        put_configuration(&mut v, "pc-i440fx-7.2", &[]);
        assert_eq!(v, b"\x07\x00\x00\x00\x0dpc-i440fx-7.2");
    }

    #[test]
    fn ram_start_bytes() {
        let mut v = Vec::new();
        let h = RamSectionHeader { section_id: 2, instance_id: 0, version_id: 4 };
        put_ram_start(&mut v, &h);
        assert_eq!(v, b"\x01\x00\x00\x00\x02\x03ram\x00\x00\x00\x00\x00\x00\x00\x04");
        assert_eq!(v.len(), 1 + 4 + 1 + 3 + 4 + 4);
    }

    #[test]
    fn short_section_and_footer_bytes() {
        let mut v = Vec::new();
        put_section_short(&mut v, SectionKind::Part, 2);
        put_section_short(&mut v, SectionKind::End, 0x01020304);
        put_footer(&mut v, 2);
        assert_eq!(v, b"\x02\x00\x00\x00\x02\x03\x01\x02\x03\x04\x7e\x00\x00\x00\x02");
    }

    #[test]
    fn record_words() {
        // MEM_SIZE of a 128 MiB `pc` guest without VGA: 0x08082000 total bytes.
        assert_eq!(
            record_word(0x0808_2000, RecordKind::MemSize, false),
            [0, 0, 0, 0, 8, 8, 0x20, 0x04]
        );
        assert_eq!(record_word(0x1000, RecordKind::Page, true), [0, 0, 0, 0, 0, 0, 0x10, 0x28]);
        assert_eq!(record_word(0x2000, RecordKind::Zero, false), [0, 0, 0, 0, 0, 0, 0x20, 0x02]);
        assert_eq!(record_word(0, RecordKind::Eos, false), [0, 0, 0, 0, 0, 0, 0, 0x10]);
        // Flags never leak into the address.
        assert_eq!(record_word(0x1fff, RecordKind::Zero, true), [0, 0, 0, 0, 0, 0, 0x10, 0x22]);
    }

    #[test]
    fn decode_accepts_only_7_2_records() {
        let d = |w| decode_record(w);
        assert_eq!(
            d(0x1028).unwrap(),
            RecordHeader { kind: RecordKind::Page, cont: true, addr: 0x1000 }
        );
        assert_eq!(
            d(0x2002).unwrap(),
            RecordHeader { kind: RecordKind::Zero, cont: false, addr: 0x2000 }
        );
        assert_eq!(d(0x0808_2004).unwrap().kind, RecordKind::MemSize);
        assert_eq!(d(0x10).unwrap().kind, RecordKind::Eos);
        assert!(matches!(d(0x48), Err(FlagProblem::Refused("XBZRLE", _))));
        assert!(matches!(d(0x128), Err(FlagProblem::Refused("COMPRESS_PAGE", _))));
        assert!(matches!(d(0x200), Err(FlagProblem::Refused("MULTIFD_FLUSH", _))));
        assert!(matches!(d(0x80), Err(FlagProblem::Refused("HOOK", _))));
        for bad in [0u64, RAM_FULL, 0x0a, 0x30, 0x24, 0x20, 0x18, 0x400, 0x800] {
            assert_eq!(d(bad), Err(FlagProblem::Unknown), "flags {bad:#x}");
        }
    }

    #[test]
    fn idstr_limits() {
        let mut v = Vec::new();
        put_idstr(&mut v, "pc.ram").unwrap();
        assert_eq!(v, b"\x06pc.ram");
        assert_eq!(put_idstr(&mut v, &"x".repeat(256)), Err(256));
    }

    #[test]
    fn be_readers() {
        let b = [0x51, 0x45, 0x56, 0x4d, 0, 0, 0, 3, 9];
        assert_eq!(be32(&b, 0), FILE_MAGIC);
        assert_eq!(be64(&b, 0), 0x5145_564d_0000_0003);
        assert_eq!(be32(&b, 4), 3);
    }
}

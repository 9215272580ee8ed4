//! Unit tests of the stream parser and generator on synthetic streams: round trips, every
//! chunking, truncation at every offset, random corruption, and each refusal. Tests against a
//! real QEMU live in the integration suite (they need qemu-system-x86_64).

use super::wire::{self, RecordKind};
use super::*;

fn layout() -> StreamLayout {
    StreamLayout {
        version: 3,
        machine_type: Some("pc-i440fx-7.2".into()),
        config_subsections: Vec::new(),
        ram_section: RamSectionHeader { section_id: 2, instance_id: 0, version_id: 4 },
        blocks: vec![
            RamBlock { name: "pc.ram".into(), used_len: 16 * 4096 },
            RamBlock { name: "/rom@etc/acpi/tables".into(), used_len: 2 * 4096 },
            RamBlock { name: "pc.bios".into(), used_len: 4096 },
        ],
    }
}

/// A plausible tail: one FULL section, EOF and a VMDESCRIPTION with two devices.
fn tail() -> Vec<u8> {
    let mut t = vec![wire::SEC_FULL, 0, 0, 0, 3];
    wire::put_idstr(&mut t, "timer").unwrap();
    t.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 2]);
    t.extend_from_slice(&[0xaa; 24]);
    wire::put_footer(&mut t, 3);
    t.push(wire::SEC_EOF);
    let json = br#"{"page_size": 4096, "devices": [{"name": "timer"}, {"name": "cpu"}]}"#;
    t.push(wire::SEC_VMDESCRIPTION);
    t.extend_from_slice(&(json.len() as u32).to_be_bytes());
    t.extend_from_slice(json);
    t
}

fn page_data(block: usize, page: u64, pass: u8) -> [u8; PAGE_SIZE] {
    let mut d = [0u8; PAGE_SIZE];
    for (i, b) in d.iter_mut().enumerate() {
        *b = (i as u64 ^ page.wrapping_mul(31) ^ (block as u64 * 7) ^ pass as u64) as u8;
    }
    d
}

/// Stream with every page once: odd pages of pc.ram are zero, the rest carry data.
fn stream() -> Vec<u8> {
    let l = layout();
    let datas: Vec<Vec<[u8; PAGE_SIZE]>> = l
        .blocks
        .iter()
        .enumerate()
        .map(|(bi, b)| (0..b.pages()).map(|p| page_data(bi, p, 0)).collect())
        .collect();
    let mut recs = Vec::new();
    for (bi, b) in l.blocks.iter().enumerate() {
        for p in 0..b.pages() {
            let content = if bi == 0 && p % 2 == 1 {
                PageContent::Fill(0)
            } else {
                PageContent::Data(&datas[bi][p as usize])
            };
            recs.push(PageRecord { block: BlockIdx(bi as u32), offset: p * 4096, content });
        }
    }
    generate(Vec::new(), &l, recs, &tail()).unwrap().0
}

/// Sink that rebuilds memory (latest record wins) and logs the event sequence.
#[derive(Default)]
struct Image {
    blocks: Vec<Vec<u8>>,
    log: Vec<String>,
    tail: Vec<u8>,
}

impl StreamSink for Image {
    fn event(&mut self, ev: Event<'_>) -> Result<(), SinkError> {
        match ev {
            Event::RamBlocks(b) => {
                self.blocks = b.iter().map(|b| vec![0u8; b.used_len as usize]).collect();
                self.log.push(format!("blocks {}", b.len()));
            }
            Event::Page { block, offset, data } => {
                let o = offset as usize;
                self.blocks[block.get()][o..o + PAGE_SIZE].copy_from_slice(data);
                self.log.push(format!("page {} {offset:#x}", block.0));
            }
            Event::Zero { block, offset, fill } => {
                let o = offset as usize;
                self.blocks[block.get()][o..o + PAGE_SIZE].fill(fill);
                self.log.push(format!("zero {} {offset:#x} {fill}", block.0));
            }
            Event::Tail(t) => self.tail.extend_from_slice(t),
            other => self.log.push(format!("{other:?}")),
        }
        Ok(())
    }
}

fn parse_with(bytes: &[u8], chunk: usize) -> Result<(StreamInfo, Image), StreamError> {
    let mut p = Parser::default();
    let mut img = Image::default();
    for c in bytes.chunks(chunk) {
        p.feed(c, &mut img)?;
    }
    let info = p.finish(&mut img)?;
    Ok((info, img))
}

#[test]
fn round_trip_synthetic() {
    let s = stream();
    let (info, img) = parse_with(&s, s.len()).unwrap();
    assert_eq!(info.layout, layout());
    assert_eq!(info.stats.page_records, 8 + 2 + 1);
    assert_eq!(info.stats.zero_records, 8);
    assert_eq!(info.stats.end_sections, 1);
    assert_eq!(info.stats.bytes, s.len() as u64);
    assert_eq!(info.tail, tail());
    assert_eq!(img.tail, tail());
    assert_eq!(info.tail_offset as usize, s.len() - tail().len());
    assert_eq!(info.vmdesc_devices, 2);
    assert!(!info.background_snapshot);
    for (bi, b) in layout().blocks.iter().enumerate() {
        for p in 0..b.pages() {
            let got = &img.blocks[bi][p as usize * 4096..][..4096];
            if bi == 0 && p % 2 == 1 {
                assert!(got.iter().all(|&x| x == 0));
            } else {
                assert_eq!(got, &page_data(bi, p, 0)[..], "block {bi} page {p}");
            }
        }
    }
    // Regenerating from the parse gives the same bytes.
    let recs: Vec<_> = layout()
        .blocks
        .iter()
        .enumerate()
        .flat_map(|(bi, b)| {
            let img = &img;
            (0..b.pages()).map(move |p| {
                let d: &[u8; PAGE_SIZE] =
                    img.blocks[bi][p as usize * 4096..][..4096].try_into().unwrap();
                let content =
                    if bi == 0 && p % 2 == 1 { PageContent::Fill(0) } else { PageContent::Data(d) };
                PageRecord { block: BlockIdx(bi as u32), offset: p * 4096, content }
            })
        })
        .collect();
    let again = generate(Vec::new(), &info.layout, recs, &info.tail).unwrap().0;
    assert_eq!(again, s);
}

#[test]
fn every_chunk_size_gives_the_same_events() {
    let s = stream();
    let (ref_info, ref_img) = parse_with(&s, s.len()).unwrap();
    for chunk in [1, 2, 3, 5, 7, 8, 9, 13, 100, 4095, 4096, 4097, 4105, 8192, 65536] {
        let (info, img) = parse_with(&s, chunk).unwrap();
        assert_eq!(info.layout, ref_info.layout, "chunk {chunk}");
        assert_eq!(info.stats, ref_info.stats, "chunk {chunk}");
        assert_eq!(info.tail, ref_info.tail, "chunk {chunk}");
        assert_eq!(img.blocks, ref_img.blocks, "chunk {chunk}");
        assert_eq!(img.log, ref_img.log, "chunk {chunk}");
        assert_eq!(parse_all_chunked(&s, chunk).unwrap(), parse_all(&s).unwrap());
    }
}

#[test]
fn pages_are_borrowed_from_the_input_when_contiguous() {
    let s = stream();
    let range = s.as_ptr_range();
    let mut borrowed = 0;
    let mut p = Parser::default();
    let mut sink = |ev: Event<'_>| -> Result<(), SinkError> {
        if let Event::Page { data, .. } = ev {
            assert!(range.contains(&data.as_ptr()), "page was copied");
            borrowed += 1;
        }
        Ok(())
    };
    p.feed(&s, &mut sink).unwrap();
    p.finish(&mut sink).unwrap();
    assert_eq!(borrowed, 11);
}

#[test]
fn truncation_at_every_offset_is_a_clean_error() {
    let s = stream();
    for cut in 0..s.len() {
        let err = parse_all(&s[..cut]).expect_err("truncated stream accepted");
        assert!(err.offset() <= cut as u64, "cut {cut}: offset {} beyond data", err.offset());
        match err {
            StreamError::Truncated { offset, .. } => assert_eq!(offset, cut as u64),
            StreamError::BadTail { .. } => assert!(cut as u64 > parse_all(&s).unwrap().tail_offset),
            other => panic!("cut {cut}: unexpected {other}"),
        }
    }
    // In pieces too: the error names the last byte received.
    let err = parse_all_chunked(&s[..5000], 7).unwrap_err();
    assert!(
        matches!(err, StreamError::Truncated { offset: 5000, expected: "a RAM record" }),
        "{err}"
    );
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_corruption_never_panics() {
    let s = stream();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut errors = 0;
    for round in 0..3000 {
        let mut c = s.clone();
        let flips = 1 + rng.next() % 4;
        for _ in 0..flips {
            let at = (rng.next() as usize) % c.len();
            c[at] = rng.next() as u8;
        }
        if round % 3 == 0 {
            let cut = (rng.next() as usize) % c.len();
            c.truncate(cut);
        }
        let chunk = 1 + (rng.next() as usize % 9000);
        let a = parse_all(&c);
        let b = parse_all_chunked(&c, chunk);
        assert_eq!(a.is_ok(), b.is_ok(), "round {round}: chunking changed the verdict");
        if let (Err(ea), Err(eb)) = (&a, &b) {
            assert_eq!(ea.offset(), eb.offset(), "round {round}: {ea} vs {eb}");
            errors += 1;
        }
    }
    assert!(errors > 1000, "only {errors} corruptions detected");
    // Pure garbage.
    for len in [0usize, 1, 7, 8, 64, 5000] {
        let g: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        assert!(parse_all(&g).is_err());
    }
}

/// Build streams by hand for the refusal tests.
struct B(Vec<u8>);
impl B {
    fn new() -> B {
        let mut v = Vec::new();
        wire::put_file_header(&mut v, 3);
        wire::put_configuration(&mut v, "pc-q35-7.2", &[]);
        B(v)
    }
    fn start(mut self) -> B {
        wire::put_ram_start(
            &mut self.0,
            &RamSectionHeader { section_id: 2, instance_id: 0, version_id: 4 },
        );
        self.0.extend_from_slice(&wire::record_word(0x3000, RecordKind::MemSize, false));
        wire::put_idstr(&mut self.0, "pc.ram").unwrap();
        self.0.extend_from_slice(&0x2000u64.to_be_bytes());
        wire::put_idstr(&mut self.0, "pc.bios").unwrap();
        self.0.extend_from_slice(&0x1000u64.to_be_bytes());
        self.eos()
    }
    fn eos(mut self) -> B {
        self.0.extend_from_slice(&wire::record_word(0, RecordKind::Eos, false));
        wire::put_footer(&mut self.0, 2);
        self
    }
    fn sec(mut self, kind: SectionKind) -> B {
        wire::put_section_short(&mut self.0, kind, 2);
        self
    }
    fn page(mut self, name: Option<&str>, off: u64, fill: u8) -> B {
        self.0.extend_from_slice(&wire::record_word(off, RecordKind::Page, name.is_none()));
        if let Some(n) = name {
            wire::put_idstr(&mut self.0, n).unwrap();
        }
        self.0.extend_from_slice(&[fill; PAGE_SIZE]);
        self
    }
    fn raw(mut self, b: &[u8]) -> B {
        self.0.extend_from_slice(b);
        self
    }
    fn tail(self) -> Vec<u8> {
        self.raw(&tail()).0
    }
}

fn err_of(bytes: &[u8]) -> StreamError {
    parse_all(bytes).expect_err("stream accepted")
}

#[test]
fn multiple_passes_latest_wins() {
    let s = B::new()
        .start()
        .sec(SectionKind::Part)
        .page(Some("pc.ram"), 0, 1)
        .page(None, 0x1000, 2)
        .eos()
        .sec(SectionKind::Part)
        .page(None, 0, 3) // CONTINUE across sections: still pc.ram
        .page(Some("pc.bios"), 0, 9)
        .eos()
        .sec(SectionKind::End)
        .page(Some("pc.ram"), 0x1000, 4)
        .eos()
        .tail();
    let (info, img) = parse_with(&s, 33).unwrap();
    assert_eq!(info.stats.part_sections, 2);
    assert_eq!(info.stats.page_records, 5);
    assert!(img.blocks[0][..4096].iter().all(|&b| b == 3));
    assert!(img.blocks[0][4096..].iter().all(|&b| b == 4));
    assert!(img.blocks[1].iter().all(|&b| b == 9));
}

#[test]
fn background_snapshot_has_no_end_section() {
    let s = B::new().start().sec(SectionKind::Part).page(Some("pc.ram"), 0, 1).eos().tail();
    let info = parse_all(&s).unwrap();
    assert!(info.background_snapshot);
    assert_eq!(info.stats.end_sections, 0);
}

#[test]
fn uuid_subsection_is_kept_and_regenerated() {
    let mut sub = vec![wire::SEC_SUBSECTION];
    wire::put_idstr(&mut sub, wire::SUBSECTION_UUID).unwrap();
    sub.extend_from_slice(&1u32.to_be_bytes());
    sub.extend_from_slice(&[0x42; 16]);
    let s =
        B::new().raw(&sub).start().sec(SectionKind::End).page(Some("pc.ram"), 0, 1).eos().tail();
    let info = parse_all(&s).unwrap();
    assert_eq!(info.layout.config_subsections, sub);
    assert_eq!(info.layout.machine_type.as_deref(), Some("pc-q35-7.2"));
    let mut w = StreamWriter::new(Vec::new(), &info.layout).unwrap();
    w.allow_partial();
    w.page(BlockIdx(0), 0, &[1; PAGE_SIZE]).unwrap();
    w.tail(&tail()).unwrap();
    let (out, _) = w.finish().unwrap();
    assert_eq!(parse_all(&out).unwrap().layout, info.layout);
}

#[test]
fn refusals_name_the_problem_and_offset() {
    let base = B::new().start().0.len() as u64;

    let mut bad = stream();
    bad[0] = b'X';
    assert!(matches!(err_of(&bad), StreamError::BadMagic { offset: 0, .. }));
    let mut v2 = stream();
    v2[7] = 2;
    assert!(matches!(err_of(&v2), StreamError::BadVersion { offset: 4, found: 2 }));

    let cmd = B::new().start().raw(&[wire::SEC_COMMAND, 0, 1, 0, 0]).0;
    assert!(matches!(err_of(&cmd), StreamError::Command { offset } if offset == base));

    let xb = B::new().start().sec(SectionKind::Part).raw(&0x48u64.to_be_bytes()).0;
    let e = err_of(&xb);
    assert!(
        matches!(e, StreamError::RefusedFlag { flag: "XBZRLE", offset, .. } if offset == base + 5),
        "{e}"
    );
    assert!(e.to_string().contains("disable the xbzrle capability"), "{e}");

    let comp = B::new().start().sec(SectionKind::Part).raw(&0x128u64.to_be_bytes()).0;
    assert!(matches!(err_of(&comp), StreamError::RefusedFlag { flag: "COMPRESS_PAGE", .. }));

    let unk = B::new().start().sec(SectionKind::Part).page(Some("vga.vram"), 0, 1).0;
    let e = err_of(&unk);
    assert!(
        matches!(&e, StreamError::UnknownBlock { name, offset } if name == "vga.vram" && *offset == base + 5 + 9),
        "{e}"
    );

    let beyond = B::new().start().sec(SectionKind::Part).page(Some("pc.bios"), 0x1000, 1).0;
    assert!(matches!(
        err_of(&beyond),
        StreamError::OffsetBeyondBlock { page_offset: 0x1000, used_len: 0x1000, .. }
    ));

    let mut blk = B::new().0;
    blk.extend_from_slice(&[wire::SEC_START, 0, 0, 0, 5]);
    wire::put_idstr(&mut blk, "block").unwrap();
    blk.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1]);
    assert!(matches!(err_of(&blk), StreamError::ForeignIterable { idstr, .. } if idstr == "block"));

    let mut caps = B::new().0;
    caps.push(wire::SEC_SUBSECTION);
    wire::put_idstr(&mut caps, wire::SUBSECTION_CAPABILITIES).unwrap();
    caps.extend_from_slice(&1u32.to_be_bytes());
    caps.extend_from_slice(&1u32.to_be_bytes());
    wire::put_idstr(&mut caps, "x-ignore-shared").unwrap();
    let e = err_of(&caps);
    assert!(
        matches!(&e, StreamError::RefusedCapability { capability, .. } if capability == "x-ignore-shared"),
        "{e}"
    );

    let cont = B::new().start().sec(SectionKind::Part).page(None, 0, 1).0;
    assert!(
        matches!(err_of(&cont), StreamError::RecordOrder { why, .. } if why.contains("CONTINUE"))
    );

    let part_first = B::new().sec(SectionKind::Part).0;
    assert!(matches!(err_of(&part_first), StreamError::UnexpectedSection { kind: 2, .. }));

    let after_end = B::new().start().sec(SectionKind::End).eos().sec(SectionKind::Part).0;
    assert!(
        matches!(err_of(&after_end), StreamError::UnexpectedSection { why, .. } if why.contains("after the RAM END"))
    );

    let mut wrong_id = B::new().start().0;
    wire::put_section_short(&mut wrong_id, SectionKind::Part, 7);
    assert!(matches!(
        err_of(&wrong_id),
        StreamError::SectionIdMismatch { found: 7, expected: 2, .. }
    ));

    let mut footer = B::new().start().sec(SectionKind::Part).0;
    footer.extend_from_slice(&wire::record_word(0, RecordKind::Eos, false));
    wire::put_footer(&mut footer, 9);
    assert!(matches!(err_of(&footer), StreamError::BadFooter { found_id: 9, expected_id: 2, .. }));

    let mut no_ram = B::new().0;
    no_ram.extend_from_slice(&tail());
    assert!(matches!(err_of(&no_ram), StreamError::UnexpectedSection { kind: 4, .. }));

    let mut overrun = B::new().0;
    wire::put_ram_start(
        &mut overrun,
        &RamSectionHeader { section_id: 2, instance_id: 0, version_id: 4 },
    );
    overrun.extend_from_slice(&wire::record_word(0x1000, RecordKind::MemSize, false));
    wire::put_idstr(&mut overrun, "pc.ram").unwrap();
    overrun.extend_from_slice(&0x2000u64.to_be_bytes());
    assert!(
        matches!(err_of(&overrun), StreamError::BadBlockList { why, .. } if why.contains("overruns"))
    );

    let mut badver = B::new().0;
    badver.extend_from_slice(&[wire::SEC_START, 0, 0, 0, 2]);
    wire::put_idstr(&mut badver, "ram").unwrap();
    badver.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 3]);
    assert!(matches!(err_of(&badver), StreamError::RamVersion { found: 3, .. }));

    // EOF + VMDESCRIPTION missing at the end.
    let s = stream();
    let e = err_of(&s[..s.len() - 1]);
    assert!(matches!(e, StreamError::BadTail { .. }), "{e}");
    let mut junk = stream();
    junk.push(b' ');
    assert!(matches!(err_of(&junk), StreamError::BadTail { .. }));
}

#[test]
fn caps_limit_the_tail_and_sink_errors_stop_the_parse() {
    let s = stream();
    let mut p = Parser::new(Limits { max_tail_bytes: 10, ..Limits::default() });
    let mut sink = |_: Event<'_>| -> Result<(), SinkError> { Ok(()) };
    let e = p.feed(&s, &mut sink).unwrap_err();
    assert!(matches!(e, StreamError::TailTooLarge { max: 10, .. }), "{e}");
    // Poisoned afterwards.
    assert!(matches!(p.feed(&s, &mut sink), Err(StreamError::Poisoned { .. })));

    let mut p = Parser::default();
    let mut n = 0;
    let mut failing = |ev: Event<'_>| -> Result<(), SinkError> {
        if matches!(ev, Event::Page { .. }) {
            n += 1;
            if n == 3 {
                return Err("store full".into());
            }
        }
        Ok(())
    };
    let e = p.feed(&s, &mut failing).unwrap_err();
    let StreamError::Sink { offset, source } = e else { panic!("not a sink error") };
    assert_eq!(source.to_string(), "store full");
    assert!(offset > 0 && offset < s.len() as u64);
}

#[test]
fn generator_refuses_bad_input() {
    let l = layout();
    let mut w = StreamWriter::new(Vec::new(), &l).unwrap();
    assert!(matches!(
        w.page(BlockIdx(3), 0, &[0; PAGE_SIZE]),
        Err(GenerateError::BlockIndex { block: 3, count: 3 })
    ));
    assert!(matches!(w.zero(BlockIdx(2), 0x1000, 0), Err(GenerateError::BadOffset { .. })));
    assert!(matches!(w.zero(BlockIdx(0), 0x10, 0), Err(GenerateError::BadOffset { .. })));
    w.zero(BlockIdx(0), 0, 0).unwrap();
    let e = w.tail(&tail()).unwrap_err();
    assert!(
        matches!(&e, GenerateError::MissingPages { name, missing: 15, first: 0x1000 } if name == "pc.ram"),
        "{e}"
    );

    let mut w = StreamWriter::new(Vec::new(), &l).unwrap();
    w.allow_partial();
    assert!(matches!(w.tail(b"\x07junk"), Err(GenerateError::Layout { .. })));
    w.tail(&tail()).unwrap();
    assert!(matches!(w.zero(BlockIdx(0), 0, 0), Err(GenerateError::Order { .. })));
    let (out, stats) = w.finish().unwrap();
    assert_eq!(stats.bytes, out.len() as u64);
    assert_eq!(parse_all(&out).unwrap().stats.page_records, 0);

    let w = StreamWriter::new(Vec::new(), &l).unwrap();
    assert!(matches!(w.finish(), Err(GenerateError::Order { .. })));

    let mut bad = l.clone();
    bad.blocks[1].used_len = 100;
    assert!(matches!(StreamWriter::new(Vec::new(), &bad), Err(GenerateError::Layout { .. })));
    bad = l.clone();
    bad.blocks[1].name = "pc.ram".into();
    assert!(matches!(StreamWriter::new(Vec::new(), &bad), Err(GenerateError::Layout { .. })));
}

#[test]
fn target_page_bits_subsection() {
    let sub = |bits: u32| {
        let mut v = vec![wire::SEC_SUBSECTION];
        wire::put_idstr(&mut v, wire::SUBSECTION_TARGET_PAGE_BITS).unwrap();
        v.extend_from_slice(&1u32.to_be_bytes());
        v.extend_from_slice(&bits.to_be_bytes());
        v
    };
    let ok = B::new().raw(&sub(12)).start().sec(SectionKind::End).eos().tail();
    assert_eq!(parse_all(&ok).unwrap().layout.config_subsections, sub(12));
    let bad = B::new().raw(&sub(14)).start().0;
    let e = err_of(&bad);
    assert!(matches!(&e, StreamError::BadConfiguration { why, .. } if why.contains("2^14")), "{e}");
    let mut unknown = B::new().0;
    unknown.push(wire::SEC_SUBSECTION);
    wire::put_idstr(&mut unknown, "configuration/new-thing").unwrap();
    unknown.extend_from_slice(&1u32.to_be_bytes());
    assert!(matches!(err_of(&unknown), StreamError::UnknownSubsection { .. }));
}

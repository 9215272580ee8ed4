//! Tests of the codec benchmark's round trips and of the stacked chart output.

use super::codecs::*;
use super::*;

#[test]
fn codecs_round_trip_and_rank() {
    let text: Vec<u8> =
        (0..(256 << 10)).map(|i| b"memory pages of a desktop guest "[i % 32]).collect();
    let frames: Vec<&[u8]> = text.chunks(64 << 10).collect();
    #[allow(unused_mut)]
    let mut codecs =
        vec![BenchCodec::Lz4, BenchCodec::Zstd(1), BenchCodec::Deflate, BenchCodec::Huffman];
    #[cfg(feature = "lzo")]
    codecs.push(BenchCodec::Lzo);
    for c in codecs {
        let (stored, cs, ds) = run_codec(c, &frames).unwrap();
        assert!(stored < text.len() as u64 / 2, "{}: {stored}", c.name());
        assert!(cs > 0.0 && ds > 0.0);
    }
    let (h, ..) = run_codec(BenchCodec::Huffman, &frames).unwrap();
    let (d, ..) = run_codec(BenchCodec::Deflate, &frames).unwrap();
    assert!(d < h, "deflate (LZ77 + Huffman) must beat Huffman alone on repetitive text");
}

#[test]
fn stacked_svg_offsets_charts() {
    let s = stack(vec!["<svg a></svg>".into(), "<svg b></svg>".into()]);
    assert!(
        s.contains("<svg y=\"0\" a>")
            && s.contains("<svg y=\"420\" b>")
            && s.contains("height=\"840\"")
    );
}

#[test]
fn workload_mixes_parse_print_and_name_their_result_files() {
    let parse = |s: &str| s.parse::<WorkloadMix>();
    assert_eq!(parse("desktop").unwrap(), WorkloadMix::DESKTOP);
    assert_eq!(WorkloadMix::default(), WorkloadMix::DESKTOP);
    let random = parse("random").unwrap();
    assert_eq!((random.text_pct, random.fill, random.zero_pct, random.repeat_pct), (0, true, 0, 0));
    let idle = parse("idle").unwrap();
    assert!(!idle.fill && idle.text_pct == 0);
    // KEY=VALUE starts from desktop; a custom mix prints back to what parses to it.
    let m = parse("text=20,repeat=30").unwrap();
    assert_eq!((m.text_pct, m.fill, m.zero_pct, m.repeat_pct), (20, true, 10, 30));
    assert_eq!(m.to_string(), "text=20,zero=10,repeat=30");
    assert_eq!(parse(&m.to_string()).unwrap(), m);
    let off = parse("text=70,fill=off").unwrap();
    assert_eq!(off.to_string(), "text=70,fill=off");
    // A mix equal to a preset prints as the preset.
    assert_eq!(parse("text=0,zero=0,repeat=0").unwrap().to_string(), "random");
    // Result files: desktop keeps the historical names.
    assert_eq!(results_name("save-restore-remote", &WorkloadMix::DESKTOP), "save-restore-remote");
    assert_eq!(results_name("save-restore-remote", &random), "save-restore-remote-workload-random");
    assert_eq!(results_name("save-restore", &m), "save-restore-workload-text-20-zero-10-repeat-30");
    // Bad input names the fix.
    for (bad, says) in [
        ("laptop", "use one of desktop, random, text, idle"),
        ("text=101", "percentage 0-100"),
        ("zero=60,repeat=50", "over 100%"),
        ("fill=maybe", "fill=on or fill=off"),
        ("size=3", "use text, zero, repeat or fill"),
    ] {
        let e = parse(bad).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

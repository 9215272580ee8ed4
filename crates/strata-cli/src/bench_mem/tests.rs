//! Tests of the codec benchmark's round trips and of the stacked chart output.

use super::codecs::*;
use super::*;

#[test]
fn codecs_round_trip_and_rank() {
    let text: Vec<u8> = (0..(256 << 10))
        .map(|i| b"memory pages of a desktop guest "[i % 32])
        .collect();
    let frames: Vec<&[u8]> = text.chunks(64 << 10).collect();
    #[allow(unused_mut)]
    let mut codecs = vec![
        BenchCodec::Lz4,
        BenchCodec::Zstd(1),
        BenchCodec::Deflate,
        BenchCodec::Huffman,
    ];
    #[cfg(feature = "lzo")]
    codecs.push(BenchCodec::Lzo);
    for c in codecs {
        let (stored, cs, ds) = run_codec(c, &frames).unwrap();
        assert!(stored < text.len() as u64 / 2, "{}: {stored}", c.name());
        assert!(cs > 0.0 && ds > 0.0);
    }
    let (h, ..) = run_codec(BenchCodec::Huffman, &frames).unwrap();
    let (d, ..) = run_codec(BenchCodec::Deflate, &frames).unwrap();
    assert!(
        d < h,
        "deflate (LZ77 + Huffman) must beat Huffman alone on repetitive text"
    );
}

#[test]
fn stacked_svg_offsets_charts() {
    let s = stack(vec!["<svg a></svg>".into(), "<svg b></svg>".into()]);
    assert!(s.contains("<svg y=\"0\" a>") && s.contains("<svg y=\"420\" b>") && s.contains("height=\"840\""));
}

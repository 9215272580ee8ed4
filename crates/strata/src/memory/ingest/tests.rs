//! Tests of the receive pipeline: latest record wins, zero pages, dedup, truncated streams.

use super::*;
use crate::codec::Codec;
use crate::memory::codec_choice::CodecPolicy;
use crate::memory::stream::{BlockIdx, RamBlock, RamSectionHeader, StreamLayout, StreamWriter};
use crate::progress::NoProgress;
use crate::store::{InitOptions, Store};

fn layout() -> StreamLayout {
    StreamLayout {
        version: 3,
        machine_type: Some("pc-i440fx-7.2".into()),
        config_subsections: vec![],
        ram_section: RamSectionHeader {
            section_id: 2,
            instance_id: 0,
            version_id: 4,
        },
        blocks: vec![
            RamBlock {
                name: "pc.ram".into(),
                used_len: 64 * 4096,
            },
            RamBlock {
                name: "pc.bios".into(),
                used_len: 4 * 4096,
            },
        ],
    }
}

/// A minimal valid tail: EOF + VMDESCRIPTION with an empty device list.
fn tail() -> Vec<u8> {
    let json = br#"{"page_size":4096,"devices":[]}"#;
    let mut t = vec![0x00, 0x06];
    t.extend_from_slice(&(json.len() as u32).to_be_bytes());
    t.extend_from_slice(json);
    t
}

fn page(seed: u32) -> [u8; 4096] {
    let mut p = [0u8; 4096];
    for (i, w) in p.chunks_exact_mut(4).enumerate() {
        w.copy_from_slice(&(seed.wrapping_mul(2654435761).wrapping_add(i as u32 % 7)).to_le_bytes());
    }
    p
}

#[test]
fn latest_record_wins_zero_pages_are_not_stored_and_dedup_counts() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
    // Stream: every page once, then page 5 rewritten twice and page 6 zeroed (precopy).
    // Build by hand with allow_partial for the second pass.
    let mut w = StreamWriter::new(Vec::new(), &layout()).unwrap();
    for p in 0..64u64 {
        let c = if p % 4 == 0 { None } else { Some(page((p % 10) as u32)) };
        match c {
            None => w.zero(BlockIdx(0), p * 4096, 0).unwrap(),
            Some(d) => w.page(BlockIdx(0), p * 4096, &d).unwrap(),
        }
    }
    w.page(BlockIdx(0), 5 * 4096, &page(100)).unwrap();
    w.page(BlockIdx(0), 5 * 4096, &page(101)).unwrap();
    w.zero(BlockIdx(0), 6 * 4096, 0).unwrap();
    w.page(BlockIdx(0), 8 * 4096, &[0u8; 4096]).unwrap();
    for p in 0..4u64 {
        w.page(BlockIdx(1), p * 4096, &page(7)).unwrap();
    }
    w.tail(&tail()).unwrap();
    let (bytes, _) = w.finish().unwrap();

    let ses = store.session();
    let chooser = Chooser::new(CodecPolicy::Fixed(Codec::Lz4), 1.0, 2);
    let opts = IngestOptions {
        workers: 3,
        batch_pages: 16,
        ..Default::default()
    };
    // Feed in odd-sized reads.
    struct Slow<'a>(&'a [u8]);
    impl Read for Slow<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(5000);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    let got = ingest(Slow(&bytes), &ses, &chooser, &opts, &NoProgress).unwrap();
    assert_eq!(got.missing, vec![(0, 0), (0, 0)]);
    assert_eq!(got.maps[0][5], ChunkId::of(&page(101)), "latest record wins");
    assert!(got.maps[0][6].is_zero());
    assert!(got.maps[0][8].is_zero(), "an all-zero PAGE record is a zero page");
    assert!(got.maps[0][4].is_zero());
    assert_eq!(got.maps[0][1], ChunkId::of(&page(1)));
    assert_eq!(got.maps[1], vec![ChunkId::of(&page(7)); 4]);
    // Distinct non-zero contents: page(1..=9) minus multiples of 4 pattern + 100 + 101 + 7.
    // page(100) was superseded while held back: never stored.
    assert!(!store.contains(&ChunkId::of(&page(100))));
    assert_eq!(got.counters.superseded, 1);
    let mut distinct: Vec<ChunkId> = got.maps.iter().flatten().filter(|i| !i.is_zero()).copied().collect();
    distinct.push(ChunkId::of(&page(5)));
    distinct.sort();
    distinct.dedup();
    assert_eq!(got.counters.new_chunks, distinct.len() as u64);
    assert_eq!(got.counters.zero_content, 1);
    for id in &distinct {
        assert!(store.contains(id));
    }
    assert!(
        !store.contains(&ChunkId::of(&[0u8; 4096])),
        "zero pages are never stored"
    );

    // The same stream again: everything deduplicates.
    let again = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
    assert_eq!(again.counters.new_chunks, 0);
    assert_eq!(again.maps, got.maps);
}

#[test]
fn truncated_stream_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
    let mut w = StreamWriter::new(Vec::new(), &layout()).unwrap();
    for p in 0..64u64 {
        w.page(BlockIdx(0), p * 4096, &page(p as u32)).unwrap();
    }
    for p in 0..4u64 {
        w.zero(BlockIdx(1), p * 4096, 0).unwrap();
    }
    w.tail(&tail()).unwrap();
    let (bytes, _) = w.finish().unwrap();
    let ses = store.session();
    let chooser = Chooser::new(CodecPolicy::Auto, 100e6, 2);
    for cut in [10, 5000, bytes.len() / 2, bytes.len() - 3] {
        let e = ingest(&bytes[..cut], &ses, &chooser, &IngestOptions::default(), &NoProgress).unwrap_err();
        assert!(
            matches!(
                e,
                IngestError::Stream(StreamError::Truncated { .. } | StreamError::BadTail { .. })
            ),
            "cut {cut}: {e:?}"
        );
    }
}

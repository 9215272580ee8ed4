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
        ram_section: RamSectionHeader { section_id: 2, instance_id: 0, version_id: 4 },
        blocks: vec![
            RamBlock { name: "pc.ram".into(), used_len: 64 * 4096 },
            RamBlock { name: "pc.bios".into(), used_len: 4 * 4096 },
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
        w.copy_from_slice(
            &(seed.wrapping_mul(2654435761).wrapping_add(i as u32 % 7)).to_le_bytes(),
        );
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
    // Page 9 re-sent (held back), then zeroed: the held version is superseded.
    w.page(BlockIdx(0), 9 * 4096, &page(102)).unwrap();
    w.zero(BlockIdx(0), 9 * 4096, 0).unwrap();
    w.page(BlockIdx(0), 8 * 4096, &[0u8; 4096]).unwrap();
    for p in 0..4u64 {
        w.page(BlockIdx(1), p * 4096, &page(7)).unwrap();
    }
    w.tail(&tail()).unwrap();
    let (bytes, _) = w.finish().unwrap();

    let ses = store.session();
    let chooser = Chooser::new(CodecPolicy::Fixed(Codec::Lz4), 1.0, 2);
    let opts = IngestOptions { workers: 3, batch_pages: 16, ..Default::default() };
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
    assert!(got.maps[0][9].is_zero(), "a zero record supersedes a held-back page");
    assert!(!store.contains(&ChunkId::of(&page(102))));
    assert!(got.maps[0][8].is_zero(), "an all-zero PAGE record is a zero page");
    assert!(got.maps[0][4].is_zero());
    assert_eq!(got.maps[0][1], ChunkId::of(&page(1)));
    assert_eq!(got.maps[1], vec![ChunkId::of(&page(7)); 4]);
    // Distinct non-zero contents: page(1..=9) minus multiples of 4 pattern + 100 + 101 + 7.
    // page(100) was superseded while held back, page(102) by a zero record: never stored.
    assert!(!store.contains(&ChunkId::of(&page(100))));
    assert_eq!(got.counters.superseded, 2);
    let mut distinct: Vec<ChunkId> =
        got.maps.iter().flatten().filter(|i| !i.is_zero()).copied().collect();
    distinct.push(ChunkId::of(&page(5)));
    distinct.sort();
    distinct.dedup();
    assert_eq!(got.counters.new_chunks, distinct.len() as u64);
    assert_eq!(got.counters.zero_content, 1);
    for id in &distinct {
        assert!(store.contains(id));
    }
    assert!(!store.contains(&ChunkId::of(&[0u8; 4096])), "zero pages are never stored");

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
        let e = ingest(&bytes[..cut], &ses, &chooser, &IngestOptions::default(), &NoProgress)
            .unwrap_err();
        assert!(
            matches!(
                e,
                IngestError::Stream(StreamError::Truncated { .. } | StreamError::BadTail { .. })
            ),
            "cut {cut}: {e:?}"
        );
    }
}

/// 4 KiB of uniform bytes from a seeded xorshift64.
fn random_page(seed: u64) -> [u8; 4096] {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut p = [0u8; 4096];
    for w in p.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    p
}

#[test]
fn uniform_pages_are_told_from_compressible_ones() {
    use crate::codec::byte_entropy;
    use crate::memory::manifest::RUN_UNIFORM_BITS;
    let (mut lo, mut hi) = (8.0f64, 0.0f64);
    for s in 0..10_000u64 {
        let p = random_page(s);
        let e = byte_entropy(&[&p[..512], &p[2048..2560]]);
        lo = lo.min(e);
        hi = hi.max(e);
        assert!(pool::uniform_page(&p), "random page {s}: {e} bits");
    }
    // The range quoted at RUN_UNIFORM_BITS.
    assert!(lo > 7.7 && hi < 7.9, "random pages measure {lo:.3}..{hi:.3} bits");
    assert!(lo - RUN_UNIFORM_BITS > 0.1);
    // Text, code-like words, half-zero pages and a page whose first quarter is zero are not.
    let text: Vec<u8> = b"The quick brown fox jumps over the lazy dog; "
        .iter()
        .cycle()
        .take(4096)
        .copied()
        .collect();
    assert!(!pool::uniform_page(&text));
    assert!(!pool::uniform_page(&page(3)));
    let mut half = random_page(1);
    half[2048..].fill(0);
    assert!(!pool::uniform_page(&half));
    let mut quarter = random_page(2);
    quarter[..1024].fill(0);
    assert!(!pool::uniform_page(&quarter));
    assert!(!pool::uniform_page(&[0u8; 4096]));
}

/// A 128-page ramblock: [0, 32) random, [32, 64) random but page 40 repeats page 33,
/// [64, 96) random but page 70 compressible, [96, 128) random, sent out of place (page 100
/// in a later batch).
fn runs_stream() -> (Vec<u8>, Vec<[u8; 4096]>) {
    let mut lay = layout();
    lay.blocks.truncate(1);
    lay.blocks[0].used_len = 128 * 4096;
    let mut pages: Vec<[u8; 4096]> = (0..128u64).map(|i| random_page(1000 + i)).collect();
    pages[40] = pages[33];
    pages[70] = page(70);
    let mut w = StreamWriter::new(Vec::new(), &lay).unwrap();
    for (i, p) in pages.iter().enumerate() {
        if i != 100 {
            w.page(BlockIdx(0), i as u64 * 4096, p).unwrap();
        }
    }
    w.page(BlockIdx(0), 100 * 4096, &pages[100]).unwrap();
    w.tail(&tail()).unwrap();
    (w.finish().unwrap().0, pages)
}

#[test]
fn aligned_groups_of_new_uniform_pages_become_one_run_chunk() {
    use crate::memory::manifest::{RUN_BYTES, RUN_PAGES};
    let (bytes, pages) = runs_stream();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
    let ses = store.session();
    let chooser = Chooser::new(CodecPolicy::Fixed(Codec::Lz4), 1.0, 2);
    // Batches of 24 pages (16 while ramping): a batch still ends at a group's end.
    let opts = IngestOptions { workers: 2, batch_pages: 24, ..Default::default() };
    let got = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
    let map = &got.maps[0];
    let run0 = ChunkId::of(&pages[..32].concat());
    assert!(map[..32].iter().all(|id| *id == run0), "group 0 is one run");
    assert_eq!(store.chunk_info(&run0), Some((RUN_BYTES as u32, ChunkKind::Data)));
    // A repeated page, a compressible page, a page out of place: page chunks.
    for g in [1usize, 2, 3] {
        for i in g * RUN_PAGES..(g + 1) * RUN_PAGES {
            assert_eq!(map[i], ChunkId::of(&pages[i]), "page {i} of group {g}");
            assert!(store.contains(&map[i]));
        }
    }
    assert!(!store.contains(&ChunkId::of(&pages[0])), "a run's pages have no chunks of their own");
    assert_eq!(got.runs, [run0].into_iter().collect());
    // 32 pages in the run, 95 others (page 40 is page 33).
    assert_eq!(got.counters.new_chunks, 32 + 95);

    // The same memory again: the run is found whole, nothing is new.
    let again = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
    assert_eq!(again.maps, got.maps);
    assert_eq!(again.counters.new_chunks, 0);

    // Runs off: page chunks only (in a fresh store).
    let dir2 = tempfile::tempdir().unwrap();
    let store2 = Store::init_local(dir2.path(), InitOptions::default()).unwrap();
    let ses2 = store2.session();
    let off = ingest(
        &bytes[..],
        &ses2,
        &chooser,
        &IngestOptions { runs: false, ..opts.clone() },
        &NoProgress,
    )
    .unwrap();
    assert!(off.runs.is_empty());
    assert!(off.maps[0].iter().zip(&pages).all(|(id, p)| *id == ChunkId::of(p)));
}

/// A one-ramblock stream of `pages` (then the tail).
fn one_block_stream(pages: &[[u8; 4096]]) -> Vec<u8> {
    let mut lay = layout();
    lay.blocks.truncate(1);
    lay.blocks[0].used_len = pages.len() as u64 * 4096;
    let mut w = StreamWriter::new(Vec::new(), &lay).unwrap();
    for (i, p) in pages.iter().enumerate() {
        w.page(BlockIdx(0), i as u64 * 4096, p).unwrap();
    }
    w.tail(&tail()).unwrap();
    w.finish().unwrap().0
}

/// A stop-and-copy save to a network backend (`compressible_runs`) also makes runs of groups
/// whose pages compress: they go into frames of the save's codec, two to a 64-page frame, and
/// read back whole. A group with a repeated page still stays page chunks.
#[test]
fn compressible_groups_become_runs_when_asked() {
    use crate::memory::manifest::{RUN_BYTES, RUN_PAGES};
    // [0, 32) and [32, 64) compressible, [64, 96) random, [96, 128) compressible but page 100
    // repeats page 97.
    let mut pages: Vec<[u8; 4096]> = (0..128u64)
        .map(
            |i| if (64..96).contains(&i) { random_page(5000 + i) } else { page((7000 + i) as u32) },
        )
        .collect();
    pages[100] = pages[97];
    let bytes = one_block_stream(&pages);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
    let ses = store.session();
    let chooser = Chooser::new(CodecPolicy::Fixed(Codec::Zstd(1)), 1.0, 2);
    let opts = IngestOptions {
        workers: 2,
        batch_pages: 128,
        frame_pages: 64,
        compressible_runs: true,
        ..Default::default()
    };
    let got = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
    store.flush().unwrap();
    let map = &got.maps[0];
    for g in 0..3usize {
        let run = ChunkId::of(&pages[g * RUN_PAGES..(g + 1) * RUN_PAGES].concat());
        assert!(
            map[g * RUN_PAGES..(g + 1) * RUN_PAGES].iter().all(|id| *id == run),
            "group {g} is one run"
        );
        assert_eq!(store.chunk_info(&run), Some((RUN_BYTES as u32, ChunkKind::Data)));
        assert_eq!(store.get(&run).unwrap(), pages[g * RUN_PAGES..(g + 1) * RUN_PAGES].concat());
    }
    for i in 96..128 {
        assert_eq!(map[i], ChunkId::of(&pages[i]), "page {i} of the group with a repeat");
    }
    assert_eq!(got.runs.len(), 3);
    assert_eq!(got.counters.new_chunks, 3 * 32 + 31);
    // The compressible runs were compressed: far fewer bytes stored than the raw pages.
    let stored = store.stats().stored_bytes_new.load(std::sync::atomic::Ordering::Relaxed);
    assert!(stored < 64 * 4096, "{stored} bytes stored for 64 compressible and 63 other pages");
    assert!(stored > 32 * 4096, "the random group is stored raw: {stored}");
    // The same memory saved again: every run is deduplicated whole, and none counts as new.
    let again = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
    assert_eq!(again.maps, got.maps);
    assert_eq!(again.counters.new_chunks, 0, "nothing new the second time");

    // Without the option (the default) the compressible groups stay page chunks.
    let dir2 = tempfile::tempdir().unwrap();
    let store2 = Store::init_local(dir2.path(), InitOptions::default()).unwrap();
    let ses2 = store2.session();
    let off = ingest(
        &bytes[..],
        &ses2,
        &chooser,
        &IngestOptions { compressible_runs: false, ..opts.clone() },
        &NoProgress,
    )
    .unwrap();
    assert_eq!(off.runs.len(), 1, "only the random group");
    assert_eq!(off.maps[0][5], ChunkId::of(&pages[5]));
}

/// With compressible runs, a later copy of a page inside a run names the run and its slot (a
/// slot table entry) instead of being stored again; a group holding such a copy is not made a
/// run of its own.
#[test]
fn copies_of_run_pages_name_the_runs_slot() {
    use crate::memory::manifest::RUN_PAGES;
    // [0, 32) a compressible group; pages 40..50 copy pages 3..13; 64..96 another group whose
    // page 70 copies page 20; the rest distinct.
    let mut pages: Vec<[u8; 4096]> = (0..128u64).map(|i| page((9000 + i) as u32)).collect();
    for k in 0..10 {
        pages[40 + k] = pages[3 + k];
    }
    pages[70] = pages[20];
    let bytes = one_block_stream(&pages);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(dir.path(), InitOptions::default()).unwrap();
    let ses = store.session();
    let chooser = Chooser::new(CodecPolicy::Fixed(Codec::Zstd(1)), 1.0, 2);
    let opts = IngestOptions {
        workers: 2,
        batch_pages: 128,
        frame_pages: 64,
        compressible_runs: true,
        ..Default::default()
    };
    let got = ingest(&bytes[..], &ses, &chooser, &opts, &NoProgress).unwrap();
    let map = &got.maps[0];
    let run0 = ChunkId::of(&pages[..RUN_PAGES].concat());
    assert!(map[..RUN_PAGES].iter().all(|id| *id == run0));
    let mut want_slots: Vec<(u32, u8)> = (0..10).map(|k| (40 + k as u32, 3 + k as u8)).collect();
    want_slots.push((70, 20));
    for &(p, _) in &want_slots {
        assert_eq!(map[p as usize], run0, "page {p} names the run");
    }
    assert_eq!(got.slots, vec![want_slots]);
    // Pages 64..96 hold a copy, so they are page chunks (and page 70 a slot of run 0).
    assert_eq!(map[64], ChunkId::of(&pages[64]));
    // [32, 64) minus its 10 copies and [96, 128) become... [96, 128) is a run; 32..64 holds
    // copies, so its 22 other pages are page chunks; 64..96 gives 31 page chunks.
    assert_eq!(got.counters.new_chunks, 32 + 22 + 31 + 32);
}

/// A ramblock's missing pages are those no record covered (record number 0), with the first.
#[test]
fn missing_pages_counts_uncovered_pages() {
    let recs = vec![vec![1, 2, 3], vec![4, 0, 5, 0], vec![]];
    assert_eq!(missing_pages(&recs), vec![(0, 0), (2, 1), (0, 0)]);
}

//! Tests of the save's stages that run without QEMU: the pause measured from QMP events, the
//! page counts, and the planning and commit stages' pure parts.

use super::commit::*;
use super::counts::PageCounts;
use super::migrate::*;
use super::setup::*;
use super::*;
use crate::memory::ingest::{
    IngestCounters, FRAME_PAGES, SAVE_NETWORK_FRAME_PAGES, SAVE_QUEUE_BYTES,
};

#[test]
fn pause_is_stop_to_resume() {
    let ev = |n: &str, s: i64, us: i64| QmpEvent {
        name: n.into(),
        data: Value::Null,
        seconds: s,
        microseconds: us,
    };
    let evs = vec![
        ev("MIGRATION", 9, 0),
        ev("STOP", 10, 500_000),
        ev("RESUME", 10, 502_500),
        ev("STOP", 11, 0),
    ];
    assert!((pause_from_events(&evs).unwrap() - 2.5).abs() < 1e-6);
    assert_eq!(pause_from_events(&evs[..2]), None);
}

/// `count_pages` agrees with sorting whole ids, including ids that share their first 8 bytes
/// (the only case where it compares whole ids) within one block and across blocks.
#[test]
fn page_counts_match_sorting_whole_ids() {
    let id = |prefix: u8, rest: u8| {
        let mut b = [0u8; 32];
        b[0] = prefix;
        b[31] = rest;
        ChunkId(b)
    };
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let maps: Vec<Vec<ChunkId>> = (0..3)
        .map(|_| {
            (0..4000)
                .map(|_| match next() % 4 {
                    0 => ChunkId::ZERO,
                    // Few prefixes, several tails: many equal prefixes with different ids.
                    1 => id((next() % 5) as u8 + 1, (next() % 7) as u8),
                    _ => ChunkId::of(&next().to_le_bytes()),
                })
                .collect()
        })
        .collect();
    let c = count_pages(&maps, &Default::default());
    let mut all: Vec<ChunkId> = Vec::new();
    for (b, ids) in maps.iter().enumerate() {
        let mut uniq: Vec<ChunkId> = ids.iter().filter(|i| !i.is_zero()).copied().collect();
        let zero = ids.len() - uniq.len();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(c.per_block[b], (zero as u64, uniq.len() as u64), "block {b}");
        all.extend(uniq);
    }
    all.sort_unstable();
    all.dedup();
    assert_eq!(c.unique, all.len() as u64);
    assert_eq!(c.zero + c.data, 12_000);
    assert_eq!(c.zero, c.per_block.iter().map(|p| p.0).sum::<u64>());
    // Repeats across blocks count once overall but once in each block.
    assert!(c.per_block.iter().map(|p| p.1).sum::<u64>() > c.unique);
}

/// A page mapped to a run chunk is (run, slot): a run's 32 pages count as 32 distinct pages,
/// and the same run at the same slots in another block counts once overall.
#[test]
fn run_pages_count_by_slot() {
    let run = ChunkId::of(b"run");
    let page = ChunkId::of(b"page");
    let runs: std::collections::HashSet<ChunkId> = [run].into_iter().collect();
    // Block 0: a run at [0, 32), a page at 32 and 33, a zero page at 34.
    let mut b0 = vec![run; 32];
    b0.extend([page, page, ChunkId::ZERO]);
    // Block 1: the same run at [32, 64) (same slots), the page again at 0.
    let mut b1 = vec![page];
    b1.extend(vec![ChunkId::ZERO; 31]);
    b1.extend(vec![run; 32]);
    let c = count_pages(&[b0.clone(), b1.clone()], &runs);
    assert_eq!(c.per_block, vec![(1, 33), (31, 33)]);
    assert_eq!((c.zero, c.data, c.unique, c.run_pages), (32, 67, 33, 64));
    // Without knowing the run, the 32 pages would be one.
    let c = count_pages(&[b0, b1], &Default::default());
    assert_eq!((c.unique, c.run_pages), (2, 0));
}

/// Auto warms every zstd candidate, a fixed zstd level only itself, a fixed lz4 nothing.
#[test]
fn warm_levels_follow_the_policy() {
    let auto = warm_levels(CodecPolicy::Auto);
    assert!(!auto.is_empty());
    assert_eq!(auto.len(), CANDIDATES.iter().filter(|c| matches!(c, Codec::Zstd(_))).count());
    assert_eq!(warm_levels(CodecPolicy::Fixed(Codec::Zstd(7))), vec![7]);
    assert!(warm_levels(CodecPolicy::Fixed(Codec::Lz4)).is_empty());
}

/// A save bounds its queue; on a network backend it takes the larger frames and compressible
/// runs unless the frame size was pinned; live checkpoints keep the caller's sizes.
#[test]
fn pipeline_sizes_follow_mode_and_backend() {
    let mut opts = SaveOptions::new(Mode::Save);
    opts.ingest.queue_bytes = SAVE_QUEUE_BYTES * 4;
    opts.ingest.runs = true;
    let local = size_pipeline(&opts, false);
    assert_eq!(local.ingest.queue_bytes, SAVE_QUEUE_BYTES);
    assert_eq!(local.ingest.frame_pages, FRAME_PAGES);
    let net = size_pipeline(&opts, true);
    assert_eq!(net.ingest.frame_pages, SAVE_NETWORK_FRAME_PAGES);
    assert!(net.ingest.compressible_runs);
    opts.ingest.frame_pages = 8;
    let pinned = size_pipeline(&opts, true);
    assert_eq!(pinned.ingest.frame_pages, 8);
    assert!(!pinned.ingest.compressible_runs);
    let mut live = SaveOptions::new(Mode::Precopy);
    live.ingest.queue_bytes = SAVE_QUEUE_BYTES * 4;
    let live = size_pipeline(&live, true);
    assert_eq!(live.ingest.queue_bytes, SAVE_QUEUE_BYTES * 4);
    assert_eq!(live.ingest.frame_pages, FRAME_PAGES);
}

/// A stop-and-copy save to a network backend counts every worker; otherwise at most the
/// usable cores.
#[test]
fn compression_cores_by_mode() {
    assert_eq!(compression_cores(true, Mode::Save, 64, true), 64);
    assert!(compression_cores(false, Mode::Save, 64, true) <= usable_cores(true));
    assert!(compression_cores(true, Mode::Precopy, 64, false) <= usable_cores(false));
    assert_eq!(compression_cores(false, Mode::Save, 1, true), 1);
}

/// A leaf's slot table holds the block's entries inside the leaf, numbered from its start.
#[test]
fn leaf_slot_tables_split_by_leaf() {
    let leaf = LEAF_IDS as u32;
    let over = [(3, 1u8), (leaf - 1, 2), (leaf, 3), (leaf + 5, 4), (3 * leaf + 1, 5)];
    assert_eq!(leaf_slot_table(&over, 0), SlotTable(vec![(3, 1), ((leaf - 1) as u16, 2)]));
    assert_eq!(leaf_slot_table(&over, 1), SlotTable(vec![(0, 3), (5, 4)]));
    assert_eq!(leaf_slot_table(&over, 2), SlotTable(vec![]));
    assert_eq!(leaf_slot_table(&over, 3), SlotTable(vec![(1, 5)]));
}

/// The manifest names the oldest format that holds what the save wrote.
#[test]
fn manifest_version_is_the_oldest_that_fits() {
    assert_eq!(manifest_version(&[vec![], vec![]], 0), VERSION_NO_RUNS);
    assert_eq!(manifest_version(&[vec![]], 32), VERSION_RUNS);
    assert_eq!(manifest_version(&[vec![], vec![(1, 2)]], 32), VERSION_SLOTS);
}

/// Records received, deduplicated and stored add up: a delta page is neither stored as a
/// page chunk nor counted as deduplicated.
#[test]
fn save_stats_account_for_every_record() {
    let c = IngestCounters {
        page_records: 100,
        zero_records: 20,
        zero_content: 10,
        new_chunks: 50,
        frames: 3,
        superseded: 0,
    };
    let counts =
        PageCounts { per_block: vec![(30, 60)], zero: 30, data: 90, unique: 60, run_pages: 0 };
    let added = Added { new_bytes: 1 << 20, stored_bytes: 1 << 19 };
    let s = save_stats(&c, &counts, 5, 8 << 20, &added, 12.5);
    assert_eq!(s.pages_sent, 120);
    assert_eq!(s.pages_deduped, 90 - 50 - 5);
    assert_eq!(s.pages_stored, 50);
    assert_eq!((s.zero_pages, s.data_pages, s.unique_pages), (30, 90, 60));
    assert_eq!((s.new_bytes, s.stored_bytes, s.logical_bytes), (1 << 20, 1 << 19, 8 << 20));
    assert_eq!(s.downtime_ms, 12.5);
    // More new chunks than data records (maps and tail are not records) saturates at zero.
    let s = save_stats(&IngestCounters { new_chunks: 200, ..c }, &counts, 0, 0, &added, 0.0);
    assert_eq!(s.pages_deduped, 0);
}

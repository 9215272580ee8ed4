//! Tests of the save's helpers (the pause measured from QMP events).

use super::migrate::*;
use super::*;

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

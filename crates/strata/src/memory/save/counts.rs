//! Page counts of a save, for its manifest: zero pages, and distinct non-zero pages per
//! ramblock and overall. They are counted at the commit, beside the page maps being written,
//! so their cost is on the save's critical path; hence the sort of 8-byte prefixes below.

use crate::endian;
use std::collections::HashSet;

use crate::id::ChunkId;
use crate::memory::manifest::RUN_PAGES;

/// Page counts of a save's maps: per ramblock (zero pages, distinct non-zero pages), and over
/// all blocks (zero, non-zero and distinct non-zero pages).
pub(super) struct PageCounts {
    pub(super) per_block: Vec<(u64, u64)>,
    pub(super) zero: u64,
    pub(super) data: u64,
    pub(super) unique: u64,
    /// Pages mapped to a slot of a run chunk (checkpoint format version 3).
    pub(super) run_pages: u64,
}

/// Count distinct pages without sorting 32-byte ids: ids are uniform, so their first 8 bytes
/// (an integer) with the page's position sort in half the memory with one integer compare
/// each, and only runs of equal prefixes (a repeated page, almost always) are compared whole.
/// Sorting the ids themselves (twice, with a 32-byte memcmp per compare, into fresh vectors)
/// takes 2.3-3.7 ms of a 128 MiB save's commit, longer than writing its maps.
///
/// A page mapped to a run chunk (an id in `runs`) is the pair (run, slot): the slot is mixed
/// into its prefix and compared with the id, so the 32 pages of a run count as 32.
pub(super) fn count_pages(maps: &[Vec<ChunkId>], runs: &HashSet<ChunkId>) -> PageCounts {
    let prefix = |id: &ChunkId| endian::be64(id.as_bytes(), 0);
    // Slot of the page at `i`, or RUN_PAGES for a page chunk.
    let slot = |id: &ChunkId, i: u32| {
        if runs.contains(id) {
            i % RUN_PAGES as u32
        } else {
            RUN_PAGES as u32
        }
    };
    let mut keys: Vec<(u64, u32, u32)> = Vec::new();
    let mut per_block = vec![(0u64, 0u64); maps.len()];
    let (mut zero, mut data, mut run_pages) = (0u64, 0u64, 0u64);
    for (b, ids) in maps.iter().enumerate() {
        for (i, id) in ids.iter().enumerate() {
            if id.is_zero() {
                per_block[b].0 += 1;
                zero += 1;
            } else {
                let s = if runs.is_empty() { RUN_PAGES as u32 } else { slot(id, i as u32) };
                if s < RUN_PAGES as u32 {
                    run_pages += 1;
                }
                keys.push((prefix(id) ^ u64::from(s), b as u32, i as u32));
                data += 1;
            }
        }
    }
    keys.sort_unstable_by_key(|k| k.0);
    let mut unique = 0u64;
    let mut run: Vec<((ChunkId, u32), u32)> = Vec::new();
    for same in keys.chunk_by(|a, b| a.0 == b.0) {
        if let [(_, b, _)] = same {
            per_block[*b as usize].1 += 1;
            unique += 1;
            continue;
        }
        // Whole ids of the run, each distinct (id, block) pair counted once in its block and
        // each distinct id once overall.
        run.clear();
        run.extend(same.iter().map(|&(_, b, i)| {
            let id = maps[b as usize][i as usize];
            let s = if runs.is_empty() { RUN_PAGES as u32 } else { slot(&id, i) };
            ((id, s), b)
        }));
        run.sort_unstable();
        run.dedup();
        for (k, &(page, b)) in run.iter().enumerate() {
            per_block[b as usize].1 += 1;
            if k == 0 || run[k - 1].0 != page {
                unique += 1;
            }
        }
    }
    PageCounts { per_block, zero, data, unique, run_pages }
}

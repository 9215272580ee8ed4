//! Page counts of a save, for its manifest: zero pages, and distinct non-zero pages per
//! ramblock and overall. They are counted at the commit, beside the page maps being written,
//! so their cost is on the save's critical path; hence the sort of 8-byte prefixes below.

use crate::id::ChunkId;

/// Page counts of a save's maps: per ramblock (zero pages, distinct non-zero pages), and over
/// all blocks (zero, non-zero and distinct non-zero pages).
pub(super) struct PageCounts {
    pub(super) per_block: Vec<(u64, u64)>,
    pub(super) zero: u64,
    pub(super) data: u64,
    pub(super) unique: u64,
}

/// Count distinct pages without sorting 32-byte ids: ids are uniform, so their first 8 bytes
/// (an integer) with the page's position sort in half the memory with one integer compare
/// each, and only runs of equal prefixes (a repeated page, almost always) are compared whole.
/// Sorting the ids themselves (twice, with a 32-byte memcmp per compare, into fresh vectors)
/// took 2.3-3.7 ms of a 128 MiB save's commit, longer than writing its maps (session 29).
pub(super) fn count_pages(maps: &[Vec<ChunkId>]) -> PageCounts {
    let prefix = |id: &ChunkId| u64::from_be_bytes(id.as_bytes()[..8].try_into().expect("8 bytes"));
    let mut keys: Vec<(u64, u32, u32)> = Vec::new();
    let mut per_block = vec![(0u64, 0u64); maps.len()];
    let (mut zero, mut data) = (0u64, 0u64);
    for (b, ids) in maps.iter().enumerate() {
        for (i, id) in ids.iter().enumerate() {
            if id.is_zero() {
                per_block[b].0 += 1;
                zero += 1;
            } else {
                keys.push((prefix(id), b as u32, i as u32));
                data += 1;
            }
        }
    }
    keys.sort_unstable_by_key(|k| k.0);
    let mut unique = 0u64;
    let mut run: Vec<(ChunkId, u32)> = Vec::new();
    for same in keys.chunk_by(|a, b| a.0 == b.0) {
        if let [(_, b, _)] = same {
            per_block[*b as usize].1 += 1;
            unique += 1;
            continue;
        }
        // Whole ids of the run, each distinct (id, block) pair counted once in its block and
        // each distinct id once overall.
        run.clear();
        run.extend(same.iter().map(|&(_, b, i)| (maps[b as usize][i as usize], b)));
        run.sort_unstable();
        run.dedup();
        for (k, &(id, b)) in run.iter().enumerate() {
            per_block[b as usize].1 += 1;
            if k == 0 || run[k - 1].0 != id {
                unique += 1;
            }
        }
    }
    PageCounts { per_block, zero, data, unique }
}

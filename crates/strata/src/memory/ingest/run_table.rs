//! The save's table of pages inside the runs it made (`pool.rs`, compressible runs): a later
//! copy of such a page, which the store cannot find as a chunk, names the run's slot (a slot
//! table entry, checkpoint format version 4) instead of being stored again.
//!
//! It is kept for the whole save and grows with the pages in runs, so it is laid out small:
//! each page's full 32-byte id (a truncated key could alias two pages, and an alias restores
//! the wrong bytes) maps to one `u32`, the run's number in `runs` times [`RUN_PAGES`] plus the
//! slot, and each run id is kept once. That is 36 bytes an entry, against 65 for a
//! `HashMap<ChunkId, (ChunkId, u8)>`; [`RunTable::heap_bytes`] reports what it
//! holds, and the save report carries it (`run_table`).

use std::collections::HashMap;

use crate::id::ChunkId;
use crate::memory::manifest::RUN_PAGES;

/// Most runs one table holds: their numbers times [`RUN_PAGES`] must fit a `u32` (2^27 runs
/// of 128 KiB, 16 TiB of guest memory). Past it, groups stay page chunks.
const MAX_RUNS: usize = (u32::MAX as usize + 1) / RUN_PAGES;

/// What the table held at the end of a save.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RunTableStats {
    /// Pages entered (every page of every run this save made).
    pub pages: u64,
    pub runs: u64,
    /// Heap bytes of the table, from its capacity: buckets of 36 bytes plus a control byte,
    /// and the run ids.
    pub heap_bytes: u64,
}

#[derive(Default)]
pub(super) struct RunTable {
    pages: HashMap<ChunkId, u32>,
    runs: Vec<ChunkId>,
}

impl RunTable {
    /// Whether any of `ids` is a page of a run already entered.
    pub(super) fn holds_any(&self, ids: &[ChunkId]) -> bool {
        ids.iter().any(|id| self.pages.contains_key(id))
    }

    /// Enter run `run` whose slot k holds page `ids[k]`. False (nothing entered) when the
    /// table is full; the caller then keeps the group as page chunks.
    pub(super) fn enter(&mut self, run: ChunkId, ids: &[ChunkId]) -> bool {
        debug_assert!(ids.len() <= RUN_PAGES);
        if self.runs.len() >= MAX_RUNS {
            return false;
        }
        let base = (self.runs.len() * RUN_PAGES) as u32;
        self.runs.push(run);
        self.pages.reserve(ids.len());
        for (k, id) in ids.iter().enumerate() {
            self.pages.insert(*id, base + k as u32);
        }
        true
    }

    /// The run and slot holding page `id`, if a run of this save does.
    pub(super) fn get(&self, id: &ChunkId) -> Option<(ChunkId, u8)> {
        let v = *self.pages.get(id)? as usize;
        Some((self.runs[v / RUN_PAGES], (v % RUN_PAGES) as u8))
    }

    pub(super) fn stats(&self) -> RunTableStats {
        RunTableStats {
            pages: self.pages.len() as u64,
            runs: self.runs.len() as u64,
            heap_bytes: self.heap_bytes(),
        }
    }

    /// Heap bytes held, from the capacities: hashbrown keeps a power of two of buckets, at
    /// most 7/8 full, each an entry and a control byte (plus one group of control bytes).
    pub(super) fn heap_bytes(&self) -> u64 {
        let cap = self.pages.capacity();
        let buckets = if cap == 0 {
            0
        } else if cap < 8 {
            (cap + 1).next_power_of_two()
        } else {
            (cap * 8 / 7).next_power_of_two()
        };
        let entry = std::mem::size_of::<(ChunkId, u32)>();
        let table = if buckets == 0 { 0 } else { buckets * (entry + 1) + 16 };
        (table + self.runs.capacity() * std::mem::size_of::<ChunkId>()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u32) -> ChunkId {
        ChunkId::of(&n.to_le_bytes())
    }

    #[test]
    fn pages_name_their_run_and_slot() {
        let mut t = RunTable::default();
        let a: Vec<ChunkId> = (0..RUN_PAGES as u32).map(id).collect();
        let b: Vec<ChunkId> = (100..100 + RUN_PAGES as u32).map(id).collect();
        assert!(!t.holds_any(&a));
        assert!(t.enter(id(1000), &a));
        assert!(t.enter(id(1001), &b));
        assert!(t.holds_any(&[id(5000), a[7]]));
        assert!(!t.holds_any(&[id(5000), id(5001)]));
        assert_eq!(t.get(&a[0]), Some((id(1000), 0)));
        assert_eq!(t.get(&a[31]), Some((id(1000), 31)));
        assert_eq!(t.get(&b[5]), Some((id(1001), 5)));
        assert_eq!(t.get(&id(5000)), None);
        let s = t.stats();
        assert_eq!((s.pages, s.runs), (64, 2));
        // 64 entries need 128 buckets of 37 bytes, plus the group, plus 2+ run ids.
        assert!(
            s.heap_bytes >= 128 * 37 + 16 + 64 && s.heap_bytes < 256 * 37 + 16 + 64 * 32,
            "{s:?}"
        );
    }

    #[test]
    fn an_entry_is_36_bytes() {
        // The layout the module comment and the reported heap bytes rely on.
        assert_eq!(std::mem::size_of::<(ChunkId, u32)>(), 36);
    }
}

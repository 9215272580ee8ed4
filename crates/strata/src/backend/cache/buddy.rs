//! Buddy allocator for the cache file: variable-size compressed frames in a fixed-size region.
//!
//! The region is `n_top` blocks of the top order; a block of order `k` is `min_block << k`
//! bytes and starts at a multiple of its size. Allocation takes the smallest free block of a
//! large enough order and splits it in halves down to the order asked for; freeing merges a
//! block with its buddy (the other half of its parent, at `off ^ size`) while the buddy is free.
//! A buddy allocator suits an SSD cache of frames: entries of any size, no external
//! fragmentation beyond power-of-two rounding (at most 2x, typically ~1.35x for compressed
//! 64 KiB frames), and O(log) work per operation.
//!
//! Free lists are ordered sets, so "is my buddy free" is a lookup, `reserve` (used when the
//! cache index is replayed after a restart) can carve a given block out of a larger free one,
//! and the allocator is deterministic, which the property test relies on.

use std::collections::BTreeSet;

#[derive(Debug, Clone)]
pub struct Buddy {
    min_shift: u32,
    top_order: u8,
    n_top: u64,
    free: Vec<BTreeSet<u64>>,
    used: u64,
}

impl Buddy {
    /// A region of `n_top` top blocks, all free. `min_shift` is log2 of the smallest block.
    pub fn new(min_shift: u32, top_order: u8, n_top: u64) -> Buddy {
        let mut free = vec![BTreeSet::new(); top_order as usize + 1];
        let top = 1u64 << (min_shift + top_order as u32);
        for i in 0..n_top {
            free[top_order as usize].insert(i * top);
        }
        Buddy { min_shift, top_order, n_top, free, used: 0 }
    }

    pub fn block_size(&self, order: u8) -> u64 {
        1u64 << (self.min_shift + order as u32)
    }

    pub fn top_order(&self) -> u8 {
        self.top_order
    }

    pub fn region_size(&self) -> u64 {
        self.n_top * self.block_size(self.top_order)
    }

    /// Bytes in allocated blocks.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The smallest order whose block holds `len` bytes, or None if no block is big enough.
    pub fn order_for(&self, len: u64) -> Option<u8> {
        let mut order = 0u8;
        while self.block_size(order) < len.max(1) {
            if order == self.top_order {
                return None;
            }
            order += 1;
        }
        Some(order)
    }

    /// Take a free block of `order`; None if none is free (the caller evicts and retries).
    pub fn alloc(&mut self, order: u8) -> Option<u64> {
        if order > self.top_order {
            return None;
        }
        let from = (order..=self.top_order).find(|&o| !self.free[o as usize].is_empty())?;
        let off = self.free[from as usize].pop_first()?;
        // Split down, keeping the low half each time and freeing the high half.
        for o in (order..from).rev() {
            let half = self.block_size(o);
            self.free[o as usize].insert(off + half);
        }
        self.used += self.block_size(order);
        Some(off)
    }

    /// Return a block; merges with free buddies.
    pub fn free(&mut self, mut off: u64, mut order: u8) {
        debug_assert!(self.is_valid_block(off, order), "free of a bad block {off}/{order}");
        self.used -= self.block_size(order);
        while order < self.top_order {
            let buddy = off ^ self.block_size(order);
            if !self.free[order as usize].remove(&buddy) {
                break;
            }
            off = off.min(buddy);
            order += 1;
        }
        self.free[order as usize].insert(off);
    }

    /// Is `off` a well-formed block of `order` inside the region?
    pub fn is_valid_block(&self, off: u64, order: u8) -> bool {
        order <= self.top_order
            && off & (self.block_size(order) - 1) == 0
            && off.checked_add(self.block_size(order)).is_some_and(|e| e <= self.region_size())
    }

    /// Mark the block `off` of `order` as allocated, if it is entirely free (replay after a
    /// restart). Returns false, changing nothing, if any part of it is in use.
    pub fn reserve(&mut self, off: u64, order: u8) -> bool {
        if !self.is_valid_block(off, order) {
            return false;
        }
        // Find the free block that contains it, at this order or above.
        let Some(from) = (order..=self.top_order).find(|&o| {
            let base = off & !(self.block_size(o) - 1);
            self.free[o as usize].contains(&base)
        }) else {
            return false;
        };
        let mut base = off & !(self.block_size(from) - 1);
        self.free[from as usize].remove(&base);
        // Split toward `off`, freeing the halves that don't contain it.
        for o in (order..from).rev() {
            let half = self.block_size(o);
            if off >= base + half {
                self.free[o as usize].insert(base);
                base += half;
            } else {
                self.free[o as usize].insert(base + half);
            }
        }
        debug_assert_eq!(base, off);
        self.used += self.block_size(order);
        true
    }

    /// Free bytes (region minus used).
    pub fn free_bytes(&self) -> u64 {
        self.region_size() - self.used
    }

    /// Number of free blocks per order (for stats and tests).
    pub fn free_counts(&self) -> Vec<usize> {
        self.free.iter().map(BTreeSet::len).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn orders_and_sizes() {
        let b = Buddy::new(12, 4, 2);
        assert_eq!(b.region_size(), 2 * 65536);
        assert_eq!(b.order_for(1), Some(0));
        assert_eq!(b.order_for(4096), Some(0));
        assert_eq!(b.order_for(4097), Some(1));
        assert_eq!(b.order_for(65536), Some(4));
        assert_eq!(b.order_for(65537), None);
    }

    #[test]
    fn split_and_merge_back() {
        let mut b = Buddy::new(12, 3, 1); // 32 KiB: 8 blocks of 4 KiB
        let a = b.alloc(0).unwrap();
        assert_eq!(a, 0);
        assert_eq!(b.free_counts(), vec![1, 1, 1, 0]);
        let c = b.alloc(1).unwrap();
        assert_eq!(c, 8192);
        let d = b.alloc(2).unwrap();
        assert_eq!(d, 16384);
        assert_eq!(b.alloc(2), None);
        let e = b.alloc(0).unwrap();
        assert_eq!(e, 4096);
        assert_eq!(b.free_bytes(), 0);
        for (off, o) in [(c, 1), (a, 0), (d, 2), (e, 0)] {
            b.free(off, o);
        }
        assert_eq!(b.free_counts(), vec![0, 0, 0, 1], "everything merges back to one top block");
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn reserve_carves_a_given_block() {
        let mut b = Buddy::new(12, 3, 2);
        assert!(b.reserve(5 * 4096, 0));
        assert!(!b.reserve(5 * 4096, 0), "already taken");
        assert!(!b.reserve(4 * 4096, 1), "overlaps a used block");
        assert!(!b.reserve(4096 * 3, 1), "misaligned");
        assert!(!b.reserve(65536, 0), "outside the region");
        assert!(b.reserve(32768, 3));
        assert_eq!(b.used(), 4096 + 32768);
        // The rest is still allocatable, and all of it.
        let mut got = 0;
        while b.alloc(0).is_some() {
            got += 1;
        }
        assert_eq!(got, 7);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u8),
        Free(usize),
        Reserve(u64, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..5).prop_map(Op::Alloc),
            (0usize..64).prop_map(Op::Free),
            (0u64..64, 0u8..5).prop_map(|(i, o)| Op::Reserve(i * 4096, o)),
        ]
    }

    proptest! {
        /// Against a model (a byte map of the region): blocks never overlap, never leave the
        /// region, are aligned, accounting is exact, and freeing everything merges completely.
        #[test]
        fn never_overlaps_and_merges_fully(ops in proptest::collection::vec(op(), 1..200)) {
            let mut b = Buddy::new(12, 4, 4); // 4 x 64 KiB
            let mut owner = vec![false; (b.region_size() / 4096) as usize];
            let mut live: Vec<(u64, u8)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(o) => {
                        if let Some(off) = b.alloc(o) {
                            prop_assert!(b.is_valid_block(off, o));
                            for p in off / 4096..(off + b.block_size(o)) / 4096 {
                                prop_assert!(!owner[p as usize], "overlap at page {p}");
                                owner[p as usize] = true;
                            }
                            live.push((off, o));
                        } else {
                            // Allocation may only fail when no aligned run of free pages exists.
                            let pages = (b.block_size(o) / 4096) as usize;
                            let any = owner.chunks(pages).any(|c| c.iter().all(|x| !x));
                            prop_assert!(!any, "alloc({o}) failed although a free block exists");
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (off, o) = live.swap_remove(i % live.len());
                        b.free(off, o);
                        for p in off / 4096..(off + b.block_size(o)) / 4096 {
                            owner[p as usize] = false;
                        }
                    }
                    Op::Free(_) => {}
                    Op::Reserve(off, o) => {
                        let valid = b.is_valid_block(off, o);
                        let pages = off / 4096..(off + b.block_size(o)) / 4096;
                        let free = valid && pages.clone().all(|p| !owner[p as usize]);
                        prop_assert_eq!(b.reserve(off, o), free);
                        if free {
                            for p in pages {
                                owner[p as usize] = true;
                            }
                            live.push((off, o));
                        }
                    }
                }
                let used: u64 = live.iter().map(|&(_, o)| b.block_size(o)).sum();
                prop_assert_eq!(b.used(), used);
            }
            for (off, o) in live.drain(..) {
                b.free(off, o);
            }
            prop_assert_eq!(b.free_counts(), vec![0, 0, 0, 0, 4]);
        }
    }
}

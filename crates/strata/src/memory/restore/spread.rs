//! Spreading a page's other places over the stream.
//!
//! A page content used at many addresses (a desktop's repeated pages: 16 patterns covered half
//! of `bench save-restore`'s anonymous fill) arrives with its frame and, written at once at
//! every address, made one burst of hundreds of MB for QEMU's loader: each page record faults
//! in guest memory, so QEMU's loader spent a second or two at full system time while the
//! writer, the decoders and then the fetchers waited on full queues and the link stood idle
//! (traced at 2 GiB: 0.4–2.0 s of idle link, ~1 s into every restore). QEMU's own stream,
//! which the baselines replay, has the same pages in address order, spread over the load.
//!
//! So a decoded page is written at its first address at once, and its other addresses are kept
//! for later (the page's bytes copied into a slot): after every written frame the writer
//! catches up to the share of the other addresses that matches the share of unique pages
//! written so far, lowest guest address first (consecutive records land in the same 2 MiB of
//! guest memory). The faults then come at the pace of the link, as in QEMU's stream, and QEMU's
//! loader keeps up. At most [`MAX_SLOTS`] pages are held (16 MiB); a page decoded with no slot
//! free is written at all its addresses at once, as before. Nothing is skipped or written
//! twice: each address is in exactly one place, the first-address write or the heap, and
//! [`Spread::finish`] drains the heap before the device-state tail.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::PAGE_SIZE;

/// Pages held for their later addresses.
pub(super) const MAX_SLOTS: usize = 4096;

type Page = [u8; PAGE_SIZE];
/// Writes a page at one of its addresses `(block, page)`.
type WritePage<'a, E> = dyn FnMut((u32, u32), &Page) -> Result<(), E> + 'a;

pub(super) struct Spread {
    /// (block, page, slot, index into `refs`) of each held page's next address.
    heap: BinaryHeap<Reverse<(u32, u32, u32, u32)>>,
    slots: Vec<Box<Page>>,
    free: Vec<u32>,
    cap: usize,
    /// End (exclusive) in `refs` of each slot's page's addresses.
    ends: Vec<u32>,
    /// Addresses past the first, over all unique pages.
    later: u64,
    uniques: u64,
    uniques_done: u64,
    later_done: u64,
    /// Later addresses written with their page for want of a slot; most pages held at once.
    pub(super) unspread: u64,
    pub(super) most_held: usize,
}

impl Spread {
    /// `ref_ranges`: each unique page's addresses (a range into the plan's `refs`).
    pub(super) fn new(ref_ranges: &[(u32, u32)], cap: usize) -> Spread {
        let later = ref_ranges.iter().map(|&(a, z)| (z - a).saturating_sub(1) as u64).sum();
        Spread {
            heap: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            cap,
            ends: Vec::new(),
            later,
            uniques: ref_ranges.len() as u64,
            uniques_done: 0,
            later_done: 0,
            unspread: 0,
            most_held: 0,
        }
    }

    /// Unique page `(a, z)` (its addresses in `refs`) is decoded: write it at its first address
    /// and keep it for the others, or write it everywhere now if no slot is free. Returns the
    /// pages written.
    pub(super) fn page<E>(
        &mut self,
        (a, z): (u32, u32),
        page: &Page,
        refs: &[(u32, u32)],
        write: &mut WritePage<'_, E>,
    ) -> Result<u64, E> {
        self.uniques_done += 1;
        if z <= a {
            return Ok(0);
        }
        write(refs[a as usize], page)?;
        if z - a == 1 {
            return Ok(1);
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None if self.slots.len() < self.cap => {
                self.slots.push(Box::new([0; PAGE_SIZE]));
                self.ends.push(0);
                (self.slots.len() - 1) as u32
            }
            None => {
                for &r in &refs[a as usize + 1..z as usize] {
                    write(r, page)?;
                }
                self.later_done += (z - a - 1) as u64;
                self.unspread += (z - a - 1) as u64;
                return Ok((z - a) as u64);
            }
        };
        self.slots[slot as usize].copy_from_slice(page);
        self.ends[slot as usize] = z;
        let (b, p) = refs[a as usize + 1];
        self.heap.push(Reverse((b, p, slot, a + 1)));
        self.most_held = self.most_held.max(self.held());
        Ok(1)
    }

    /// Write held addresses, lowest first, until their share matches the share of unique pages
    /// decoded so far. Returns the pages written.
    pub(super) fn catch_up<E>(
        &mut self,
        refs: &[(u32, u32)],
        write: &mut WritePage<'_, E>,
    ) -> Result<u64, E> {
        let due =
            (self.later as u128 * self.uniques_done as u128 / self.uniques.max(1) as u128) as u64;
        let mut n = 0;
        while self.later_done < due {
            if !self.write_next(refs, write)? {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Write every held address (all pages are decoded). Returns the pages written.
    pub(super) fn finish<E>(
        &mut self,
        refs: &[(u32, u32)],
        write: &mut WritePage<'_, E>,
    ) -> Result<u64, E> {
        let mut n = 0;
        while self.write_next(refs, write)? {
            n += 1;
        }
        Ok(n)
    }

    /// Pages held now.
    pub(super) fn held(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn write_next<E>(
        &mut self,
        refs: &[(u32, u32)],
        write: &mut WritePage<'_, E>,
    ) -> Result<bool, E> {
        let Some(Reverse((b, p, slot, i))) = self.heap.pop() else {
            return Ok(false);
        };
        write((b, p), &self.slots[slot as usize])?;
        self.later_done += 1;
        let next = i + 1;
        if next < self.ends[slot as usize] {
            let (b, p) = refs[next as usize];
            self.heap.push(Reverse((b, p, slot, next)));
        } else {
            self.free.push(slot);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(n: u8) -> Page {
        [n; PAGE_SIZE]
    }

    /// `(start, end)` ranges into the refs, or `(block, page)` addresses.
    type Pairs = Vec<(u32, u32)>;

    /// Unique page u at `counts[u]` addresses, every address distinct; returns (ranges, refs).
    fn layout(counts: &[u32]) -> (Pairs, Pairs) {
        let mut ranges = Vec::new();
        let mut refs = Vec::new();
        let total: u32 = counts.iter().sum();
        // Spread each page's addresses over the whole block, ascending (as the plan has them).
        let mut free = vec![true; total as usize];
        for (u, &c) in counts.iter().enumerate() {
            let a = refs.len() as u32;
            for k in 0..c as usize {
                // Every counts.len()-th address, or the next free one after it.
                let mut addr = (u + k * counts.len()) % total as usize;
                while !free[addr] {
                    addr = (addr + 1) % total as usize;
                }
                free[addr] = false;
                refs.push((0, addr as u32));
            }
            refs[a as usize..].sort_unstable();
            ranges.push((a, refs.len() as u32));
        }
        (ranges, refs)
    }

    fn run(counts: &[u32], cap: usize) -> (Vec<(u32, u32, u8)>, Vec<u64>, usize) {
        let (ranges, refs) = layout(counts);
        let mut s = Spread::new(&ranges, cap);
        let mut out: Vec<(u32, u32, u8)> = Vec::new();
        let mut after_each = Vec::new();
        let mut most_held = 0;
        for (u, &r) in ranges.iter().enumerate() {
            let mut w = |(b, p): (u32, u32), pg: &Page| -> Result<(), ()> {
                out.push((b, p, pg[0]));
                Ok(())
            };
            s.page(r, &page(u as u8), &refs, &mut w).unwrap();
            s.catch_up(&refs, &mut w).unwrap();
            most_held = most_held.max(s.held());
            after_each.push(out.len() as u64);
        }
        s.finish(&refs, &mut |(b, p), pg: &Page| -> Result<(), ()> {
            out.push((b, p, pg[0]));
            Ok(())
        })
        .unwrap();
        (out, after_each, most_held)
    }

    fn check_every_address_once(counts: &[u32], out: &[(u32, u32, u8)]) {
        let (ranges, refs) = layout(counts);
        let mut want: Vec<(u32, u32, u8)> = Vec::new();
        for (u, &(a, z)) in ranges.iter().enumerate() {
            for &(b, p) in &refs[a as usize..z as usize] {
                want.push((b, p, u as u8));
            }
        }
        want.sort_unstable();
        let mut got = out.to_vec();
        got.sort_unstable();
        assert_eq!(got, want, "every address written once, with its own page");
    }

    #[test]
    fn a_page_used_at_many_addresses_is_written_at_the_pace_of_the_unique_pages() {
        // Page 0 is used at 1000 addresses, pages 1..100 once each: before, all 1000 went out
        // with page 0.
        let mut counts = vec![1000];
        counts.extend(std::iter::repeat_n(1, 99));
        let (out, after_each, most_held) = run(&counts, MAX_SLOTS);
        check_every_address_once(&counts, &out);
        // After page 0: itself once and its share (1/100 of 999 later addresses).
        assert!(after_each[0] <= 1 + 10, "{}", after_each[0]);
        // Halfway through the unique pages, about half of everything is written.
        let half = after_each[49] as f64 / out.len() as f64;
        assert!((0.45..0.55).contains(&half), "{half}");
        assert_eq!(most_held, 1);
        // The held addresses go out lowest first.
        let zeros: Vec<u32> = out.iter().filter(|x| x.2 == 0).map(|x| x.1).collect();
        assert!(zeros.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn with_no_slot_free_a_page_is_written_at_every_address_at_once() {
        let counts = [5, 5, 5, 1, 1];
        let (out, after_each, most_held) = run(&counts, 2);
        check_every_address_once(&counts, &out);
        assert_eq!(most_held, 2);
        assert_eq!(s_unspread(&counts, 2), 4);
        // Page 2 found both slots taken: all 5 of its addresses went out with it.
        let third: Vec<_> = out[after_each[1] as usize..after_each[2] as usize]
            .iter()
            .filter(|x| x.2 == 2)
            .collect();
        assert_eq!(third.len(), 5);
    }

    fn s_unspread(counts: &[u32], cap: usize) -> u64 {
        let (ranges, refs) = layout(counts);
        let mut s = Spread::new(&ranges, cap);
        let mut w = |_: (u32, u32), _: &Page| -> Result<(), ()> { Ok(()) };
        for (u, &r) in ranges.iter().enumerate() {
            s.page(r, &page(u as u8), &refs, &mut w).unwrap();
        }
        s.finish(&refs, &mut w).unwrap();
        assert_eq!(s.most_held, cap.min(counts.iter().filter(|&&c| c > 1).count()));
        s.unspread
    }

    #[test]
    fn pages_used_once_pass_straight_through() {
        let counts = [1; 50];
        let (out, after_each, most_held) = run(&counts, MAX_SLOTS);
        check_every_address_once(&counts, &out);
        assert_eq!(after_each, (1..=50).collect::<Vec<u64>>());
        assert_eq!(most_held, 0);
    }

    #[test]
    fn a_failed_write_is_returned() {
        let (ranges, refs) = layout(&[3, 1]);
        let mut s = Spread::new(&ranges, MAX_SLOTS);
        let mut n = 0;
        let mut w = |_: (u32, u32), _: &Page| -> Result<(), &'static str> {
            n += 1;
            if n == 2 {
                Err("socket closed")
            } else {
                Ok(())
            }
        };
        s.page(ranges[0], &page(0), &refs, &mut w).unwrap();
        assert_eq!(s.finish(&refs, &mut w), Err("socket closed"));
    }
}

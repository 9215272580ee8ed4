//! An interval map over a disk's byte range: which bytes are overridden by the write log, and
//! from where. Writes at any alignment split and replace older extents, so a 4 KiB write into a
//! clone records 4 KiB, never a whole block. Lookups return the pieces of a range, with `None`
//! for bytes that still come from the base block map.

use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Src {
    /// Data in log file `log` at byte `pos`.
    Log { log: u32, pos: u64 },
    /// Reads as zeros (WRITE_ZEROES or TRIM).
    Zero,
}

impl Src {
    fn advance(self, k: u64) -> Src {
        match self {
            Src::Log { log, pos } => Src::Log { log, pos: pos + k },
            Src::Zero => Src::Zero,
        }
    }
}

#[derive(Default, Debug, Clone)]
pub struct ExtentMap {
    /// start -> (len, src); extents never overlap.
    map: BTreeMap<u64, (u64, Src)>,
}

impl ExtentMap {
    pub fn new() -> ExtentMap {
        ExtentMap::default()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Make [start, start+len) read from `src`.
    pub fn insert(&mut self, start: u64, len: u64, src: Src) {
        if len == 0 {
            return;
        }
        let end = start + len;
        let overlapping: Vec<(u64, u64, Src)> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(k, (l, _))| **k + *l > start)
            .map(|(k, (l, s))| (*k, *l, *s))
            .collect();
        for (k, l, s) in overlapping {
            self.map.remove(&k);
            if k < start {
                self.map.insert(k, (start - k, s));
            }
            if k + l > end {
                self.map.insert(end, (k + l - end, s.advance(end - k)));
            }
        }
        self.map.insert(start, (len, src));
    }

    /// The pieces of [start, start+len): (offset, length, Some(src) or None for "base").
    pub fn lookup(&self, start: u64, len: u64) -> Vec<(u64, u64, Option<Src>)> {
        let end = start + len;
        let mut out = Vec::new();
        let mut cur = start;
        // The extent that may begin before `start`.
        let first = self
            .map
            .range(..=start)
            .next_back()
            .filter(|(k, (l, _))| **k + *l > start)
            .map(|(k, v)| (*k, *v));
        let rest = self.map.range(start + 1..end).map(|(k, v)| (*k, *v));
        for (k, (l, s)) in first.into_iter().chain(rest) {
            if k > cur {
                out.push((cur, k - cur, None));
                cur = k;
            }
            let e = (k + l).min(end);
            if e > cur {
                out.push((cur, e - cur, Some(s.advance(cur - k))));
                cur = e;
            }
        }
        if cur < end {
            out.push((cur, end - cur, None));
        }
        out
    }

    /// All extents, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, Src)> + '_ {
        self.map.iter().map(|(k, (l, s))| (*k, *l, *s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a byte-per-byte model: every byte reads from the last write covering it.
        #[test]
        fn matches_byte_model(ops in prop::collection::vec((0u64..200, 1u64..60, any::<bool>()), 1..60), q in (0u64..200, 1u64..80)) {
            let mut m = ExtentMap::new();
            let mut model: Vec<Option<Src>> = vec![None; 300];
            for (i, (s, l, zero)) in ops.into_iter().enumerate() {
                let src = if zero { Src::Zero } else { Src::Log { log: i as u32, pos: 1000 * i as u64 } };
                m.insert(s, l, src);
                for b in s..s + l {
                    model[b as usize] = Some(src.advance(b - s));
                }
            }
            let pieces = m.lookup(q.0, q.1);
            let mut cur = q.0;
            for (off, len, src) in pieces {
                prop_assert_eq!(off, cur);
                for b in off..off + len {
                    prop_assert_eq!(model[b as usize], src.map(|s| s.advance(b - off)));
                }
                cur += len;
            }
            prop_assert_eq!(cur, q.0 + q.1);
        }
    }
}

//! The cache's in-memory index and its on-disk log: which byte ranges live in which blocks,
//! LRU order, the staging area of bytes waiting to be filled, and the allocator, all behind
//! one lock in [`State`]. Replay (restart), eviction and log compaction live here because they
//! are the operations that must keep those maps, the allocator and the log consistent.

use super::buddy::Buddy;
use super::format::{self, Geometry, Record, HASH_LEN};
use super::{bump, Stats};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// (object key, offset, length): one cacheable range.
pub(super) type RangeKey = (Arc<str>, u64, u64);

#[derive(Clone)]
pub(super) struct Entry {
    pub(super) key: Arc<str>,
    pub(super) obj_off: u64,
    pub(super) len: u64,
    pub(super) order: u8,
    pub(super) hash: [u8; HASH_LEN],
    pub(super) tick: u64,
    /// Identity of this entry, never reused (the tick it was inserted at): a reader that read
    /// the block outside the lock checks the same entry is still there afterwards.
    pub(super) seq: u64,
    /// Its bytes were written or hash-checked by this process: a read of part of it need not
    /// hash the whole entry again (see `Shared::hit`).
    pub(super) verified: bool,
}

/// Bytes shared with the caller that produced them (a range of a read or of a put pack).
#[derive(Clone)]
pub(super) struct Slice {
    pub(super) buf: Arc<Vec<u8>>,
    pub(super) off: usize,
    pub(super) len: usize,
}

impl Slice {
    pub(super) fn bytes(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
}

pub(super) struct Log {
    pub(super) file: File,
    pub(super) path: PathBuf,
    pub(super) buf: Vec<u8>,
    pub(super) len: u64,
    pub(super) live: u64,
}

pub(super) struct State {
    pub(super) buddy: Buddy,
    pub(super) by_block: BTreeMap<u64, Entry>,
    pub(super) by_range: BTreeMap<RangeKey, u64>,
    pub(super) lru: BTreeMap<u64, u64>,
    pub(super) tick: u64,
    pub(super) staged: BTreeMap<RangeKey, Slice>,
    pub(super) staged_bytes: u64,
    pub(super) log: Log,
}

/// Replay index records into disjoint entries (later records win over overlapping earlier
/// ones). Returns the entries by block and the number of records dropped as invalid.
pub(super) fn replay(buddy: &Buddy, records: &[Record]) -> (BTreeMap<u64, Entry>, u64) {
    let mut by_block: BTreeMap<u64, Entry> = BTreeMap::new();
    let mut dropped = 0;
    for (i, r) in records.iter().enumerate() {
        match r {
            Record::Insert { block, order, len, hash, obj_off, key } => {
                let valid = buddy.is_valid_block(*block, *order)
                    && buddy.order_for(*len as u64) == Some(*order)
                    && crate::backend::validate_key(key).is_ok();
                if !valid {
                    dropped += 1;
                    continue;
                }
                let end = block + buddy.block_size(*order);
                // Remove entries overlapping [block, end): walk back from the last one starting before `end`.
                let overlapping: Vec<u64> = by_block
                    .range(..end)
                    .rev()
                    .take_while(|(b, e)| *b + buddy.block_size(e.order) > *block)
                    .map(|(b, _)| *b)
                    .collect();
                for b in overlapping {
                    by_block.remove(&b);
                }
                by_block.insert(
                    *block,
                    Entry {
                        key: Arc::from(key.as_str()),
                        obj_off: *obj_off,
                        len: *len as u64,
                        order: *order,
                        hash: *hash,
                        tick: i as u64,
                        seq: i as u64,
                        // Written before a restart (maybe torn): hashed whole on first use.
                        verified: false,
                    },
                );
            }
            Record::Remove { block } => {
                by_block.remove(block);
            }
        }
    }
    (by_block, dropped)
}

/// Remove the entry at `block`: free it, forget it, log it.
pub(super) fn remove_entry(st: &mut State, block: u64) -> Option<Entry> {
    let e = st.by_block.remove(&block)?;
    st.by_range.remove(&(e.key.clone(), e.obj_off, e.len));
    st.lru.remove(&e.tick);
    st.buddy.free(block, e.order);
    format::encode_record(&Record::Remove { block }, &mut st.log.buf);
    st.log.live = st.log.live.saturating_sub(1);
    Some(e)
}

/// Allocate a block of `order`, evicting least recently used entries as needed.
pub(super) fn alloc_evicting(st: &mut State, stats: &Stats, order: u8) -> Option<u64> {
    loop {
        if let Some(b) = st.buddy.alloc(order) {
            return Some(b);
        }
        let (_, &victim) = st.lru.first_key_value()?;
        let v_order = st.by_block.get(&victim)?.order;
        let victims: Vec<u64> = if v_order >= order {
            vec![victim]
        } else {
            let size = st.buddy.block_size(order);
            let base = victim & !(size - 1);
            st.by_block.range(base..base + size).map(|(b, _)| *b).collect()
        };
        for b in victims {
            if let Some(e) = remove_entry(st, b) {
                bump(&stats.evictions, 1);
                bump(&stats.evicted_bytes, e.len);
            }
        }
    }
}

pub(super) fn flush_log(st: &mut State) -> std::io::Result<()> {
    if st.log.buf.is_empty() {
        return Ok(());
    }
    let buf = std::mem::take(&mut st.log.buf);
    st.log.file.write_all(&buf)?;
    st.log.len += buf.len() as u64;
    Ok(())
}

/// Write a fresh log holding only the live entries, and switch appends to it.
pub(super) fn rewrite_log(st: &mut State, geo: &Geometry) -> std::io::Result<()> {
    let tmp = st.log.path.with_extension("index.tmp");
    let mut out = format::encode_index_header(geo);
    let mut live: Vec<(&u64, &Entry)> = st.by_block.iter().collect();
    live.sort_by_key(|(_, e)| e.tick);
    for (b, e) in &live {
        let r = Record::Insert {
            block: **b,
            order: e.order,
            len: e.len as u32,
            hash: e.hash,
            obj_off: e.obj_off,
            key: e.key.to_string(),
        };
        format::encode_record(&r, &mut out);
    }
    std::fs::write(&tmp, &out)?;
    std::fs::rename(&tmp, &st.log.path)?;
    st.log.file = OpenOptions::new().append(true).open(&st.log.path)?;
    st.log.buf.clear();
    st.log.len = out.len() as u64;
    st.log.live = live.len() as u64;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_keeps_the_latest_of_overlapping_records() {
        let b = Buddy::new(12, 4, 1);
        let ins = |block: u64, len: u32, key: &str| Record::Insert {
            block,
            order: b.order_for(len as u64).unwrap(),
            len,
            hash: [1; 16],
            obj_off: 0,
            key: key.into(),
        };
        let recs = vec![
            ins(0, 4096, "packs/a"),
            ins(4096, 4096, "packs/b"),
            ins(8192, 8192, "packs/c"),
            Record::Remove { block: 4096 },
            ins(0, 16384, "packs/d"), // overlaps a and c: both superseded
            ins(16384, 100, "packs/e"),
            ins(20480, 8192, "packs/bad"), // misaligned for order 1
            ins(1 << 20, 10, "packs/far"), // outside the region
            ins(32768, 10, "../x"),        // invalid key
        ];
        let (m, dropped) = replay(&b, &recs);
        let keys: Vec<(u64, &str)> = m.iter().map(|(b, e)| (*b, &*e.key)).collect();
        assert_eq!(keys, vec![(0, "packs/d"), (16384, "packs/e")]);
        assert_eq!(dropped, 3);
    }
}

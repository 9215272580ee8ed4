//! Boot working sets: which chunks of a golden image a boot reads, kept in the backend so any
//! host can warm its cache with them before a boot storm (`strata disk warm NAME`).
//!
//! Recording: a boot's block trace (`trace.rs`) of a clone of image NAME is mapped through
//! NAME's block map to chunk ids, in first-read order, holes and duplicates dropped; the
//! block map's own chunks (root and leaves, read whenever a clone is opened) come first. Ids, not
//! pack ranges, are stored: they survive GC repacking, and each host resolves them through its
//! own index. The object lives at `bootsets/<NAME>` in the store's backend (next to `refs/`),
//! so a second host with its own metadata and cache finds it; GC and `check` ignore the
//! prefix, and a working set does not keep chunks alive: ids GC removed are skipped (and
//! counted) when warming. Layout: `docs/format-bootset.md`, pinned by the tests below.
//!
//! Warming resolves every id to the exact (pack, frame offset, frame length) range the store
//! reads, deduplicates ranges (several chunks may share a frame), and has the store's backend
//! stack prefetch them (`Backend::prefetch`: the SSD cache reads them in parallel), so the next
//! boot's reads are hits. A stack without a cache reads them through, in parallel all the
//! same.

use super::trace::{Op, Trace};
use crate::backend::{BackendError, ErrorKind};
use crate::disk::{self, DiskError};
use crate::endian;
use crate::id::ChunkId;
use crate::store::map;
use crate::store::objects::Tree;
use crate::store::{Store, StoreError};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

pub(crate) const MAGIC: &[u8; 8] = b"STRABSET";
pub(crate) const VERSION: u32 = 1;
pub(crate) const HEADER_LEN: usize = 80;
/// Most chunk ids in one working set (64 GiB of 64 KiB blocks; 32 MiB object).
pub(crate) const MAX_CHUNKS: usize = 1 << 20;
/// Backend key prefix of working sets.
pub(crate) const KEY_PREFIX: &str = "bootsets/";

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("Boot working set '{key}' is unreadable ({reason}): record it again with `strata disk record-boot`")]
    Format { key: String, reason: String },
    #[error("No boot working set for '{name}' or its parents: record one with `strata disk record-boot {name}`")]
    Missing { name: String },
    #[error("The trace has no reads of '{name}': boot a guest from it while recording")]
    EmptyTrace { name: String },
    #[error(
        "Boot working set of {n} chunks exceeds the cap of {MAX_CHUNKS}: record a shorter boot"
    )]
    TooLarge { n: usize },
}

pub type Result<T> = std::result::Result<T, BootError>;

/// The chunks a boot of one image read, in first-read order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkingSet {
    /// Block map root of the image when the boot was recorded (a later import or write of the
    /// image changes it; warming still works, on the chunks that remain).
    pub root: ChunkId,
    pub recorded_unix: u64,
    pub block_size: u32,
    /// Bytes the recorded boot read (all read requests, before deduplication).
    pub read_bytes: u64,
    pub chunks: Vec<ChunkId>,
}

fn fmt_err(key: &str, reason: &str) -> BootError {
    BootError::Format { key: key.into(), reason: reason.into() }
}

impl WorkingSet {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + 32 * self.chunks.len() + 4);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(self.root.as_bytes());
        b.extend_from_slice(&self.recorded_unix.to_le_bytes());
        b.extend_from_slice(&self.block_size.to_le_bytes());
        b.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.read_bytes.to_le_bytes());
        b.extend_from_slice(&[0u8; 8]);
        debug_assert_eq!(b.len(), HEADER_LEN);
        for c in &self.chunks {
            b.extend_from_slice(c.as_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parse and verify an encoded working set; `key` is only for messages.
    pub fn decode(key: &str, b: &[u8]) -> Result<WorkingSet> {
        if b.len() < HEADER_LEN + 4 {
            return Err(fmt_err(key, "too short"));
        }
        if &b[0..8] != MAGIC {
            return Err(fmt_err(key, "bad magic"));
        }
        let u32_at = |o: usize| endian::le32(b, o);
        let u64_at = |o: usize| endian::le64(b, o);
        let version = u32_at(8);
        if version != VERSION {
            return Err(fmt_err(key, &format!("version {version}, this strata reads {VERSION}")));
        }
        let n = u32_at(60) as usize;
        if n > MAX_CHUNKS {
            return Err(fmt_err(key, "chunk count over the cap"));
        }
        if b.len() != HEADER_LEN + 32 * n + 4 {
            return Err(fmt_err(key, "length does not match the chunk count"));
        }
        let body = &b[..b.len() - 4];
        if crc32c::crc32c(body) != u32_at(b.len() - 4) {
            return Err(fmt_err(key, "checksum mismatch"));
        }
        let id = |o: usize| ChunkId(endian::array(b, o));
        Ok(WorkingSet {
            root: id(16),
            recorded_unix: u64_at(48),
            block_size: u32_at(56),
            read_bytes: u64_at(64),
            chunks: (0..n).map(|i| id(HEADER_LEN + 32 * i)).collect(),
        })
    }
}

/// Backend key of the working set of image `name` (a disk or `disk@snap`).
pub fn key(name: &str) -> String {
    format!("{KEY_PREFIX}{name}")
}

/// Map a boot trace of a clone of `name` to `name`'s chunks.
pub fn from_trace(store: &Store, name: &str, trace: &Trace) -> Result<WorkingSet> {
    let (r, m) = disk::load(store, name)?;
    let blocks = map::read_map(store, &r.roots[0])?;
    let bs = m.block_size as u64;
    let mut seen = HashSet::new();
    let mut chunks = Vec::new();
    // Opening any clone of the image reads its block map first: root, then the leaves.
    let root = Tree::decode(&store.get(&r.roots[0])?)
        .map_err(|source| StoreError::Format { key: format!("chunk {}", r.roots[0]), source })?;
    for id in std::iter::once(r.roots[0]).chain(root.children.iter().copied()) {
        if !id.is_zero() && seen.insert(id) {
            chunks.push(id);
        }
    }
    let mut read_bytes = 0;
    for rec in trace.records.iter().filter(|r| r.op == Op::Read && r.len > 0) {
        read_bytes += rec.len;
        let first = rec.offset / bs;
        let last = (rec.offset + rec.len - 1) / bs;
        for blk in first..=last {
            if let Some(id) = blocks.get(blk as usize) {
                if !id.is_zero() && seen.insert(*id) {
                    chunks.push(*id);
                }
            }
        }
    }
    if read_bytes == 0 {
        return Err(BootError::EmptyTrace { name: name.into() });
    }
    if chunks.len() > MAX_CHUNKS {
        return Err(BootError::TooLarge { n: chunks.len() });
    }
    let recorded_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(WorkingSet { root: r.roots[0], recorded_unix, block_size: m.block_size, read_bytes, chunks })
}

/// Store `ws` as the working set of `name` (replacing any earlier one) and make it durable.
pub fn save(store: &Store, name: &str, ws: &WorkingSet) -> Result<()> {
    disk::load(store, name)?;
    let k = key(name);
    store.backend().put(&k, &ws.encode())?;
    store.backend().sync()?;
    tracing::info!(target: "strata::boot", name, chunks = ws.chunks.len(), "boot working set saved");
    Ok(())
}

/// The working set of exactly `name`, if one was recorded.
pub fn load(store: &Store, name: &str) -> Result<Option<WorkingSet>> {
    let k = key(name);
    match store.backend().get(&k) {
        Ok(b) => WorkingSet::decode(&k, &b).map(Some),
        Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The working set of `name`, else of its parent (a clone boots like its golden image), and so
/// on up the chain. Returns the name it was found under.
pub fn find(store: &Store, name: &str) -> Result<(String, WorkingSet)> {
    let mut cur = name.to_string();
    for _ in 0..16 {
        if let Some(ws) = load(store, &cur)? {
            return Ok((cur, ws));
        }
        let (_, m) = disk::load(store, &cur)?;
        match m.parent.or(m.snapshot_of) {
            Some(p) => cur = p,
            None => break,
        }
    }
    Err(BootError::Missing { name: name.into() })
}

/// The distinct (pack key, frame offset, frame length) ranges the store reads for `ws`'s
/// chunks, in recorded order, and how many of its ids are no longer in the store.
pub fn ranges_of(store: &Store, ws: &WorkingSet) -> (Vec<(String, u64, u64)>, u64) {
    let mut seen = HashSet::new();
    let mut ranges = Vec::new();
    let mut missing = 0;
    for id in &ws.chunks {
        match store.locate(id) {
            Some((pack, e)) => {
                let r = (pack.pack_key(), e.frame_off, e.frame_len as u64);
                if seen.insert(r.clone()) {
                    ranges.push(r);
                }
            }
            None => missing += 1,
        }
    }
    (ranges, missing)
}

/// What `warm` did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WarmReport {
    /// The image whose working set was used (NAME or an ancestor).
    pub working_set_of: String,
    pub chunks: u64,
    /// Ids no longer in the store (collected since the recording).
    pub missing: u64,
    /// Distinct pack ranges read.
    pub ranges: u64,
    /// Bytes of those ranges (compressed, as stored).
    pub bytes: u64,
    /// Bytes that had to come from the backend (the rest was cached already).
    pub backend_bytes: u64,
    pub secs: f64,
    /// Whether a cache was filled (false: read through the backend stack only).
    pub cached: bool,
}

/// Read `name`'s boot working set (or its nearest ancestor's) into the cache of the store's
/// backend stack, so it is cached before a boot storm. A stack that cannot prefetch (no cache)
/// has the ranges read through it (which warms whatever caches it has, e.g. the page cache of
/// a local store).
pub fn warm(store: &Store, name: &str, parallel: usize) -> Result<WarmReport> {
    let t = Instant::now();
    let (found, ws) = find(store, name)?;
    let (ranges, missing) = ranges_of(store, &ws);
    let bytes: u64 = ranges.iter().map(|r| r.2).sum();
    let cached = store.backend().can_prefetch();
    let backend_bytes = if cached {
        store.backend().prefetch(&ranges, parallel)?
    } else {
        read_all(store, &ranges, parallel)?
    };
    let rep = WarmReport {
        working_set_of: found,
        chunks: ws.chunks.len() as u64,
        missing,
        ranges: ranges.len() as u64,
        bytes,
        backend_bytes,
        secs: t.elapsed().as_secs_f64(),
        cached,
    };
    tracing::info!(target: "strata::boot", name, ?rep, "warmed");
    Ok(rep)
}

fn read_all(store: &Store, ranges: &[(String, u64, u64)], parallel: usize) -> Result<u64> {
    let next = AtomicUsize::new(0);
    let got = AtomicU64::new(0);
    let err: parking_lot::Mutex<Option<BackendError>> = parking_lot::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..parallel.max(1) {
            s.spawn(|| {
                while let Some((k, off, len)) = ranges.get(next.fetch_add(1, Ordering::Relaxed)) {
                    match store.backend().get_range(k, *off, *len) {
                        Ok(v) => {
                            got.fetch_add(v.len() as u64, Ordering::Relaxed);
                        }
                        Err(e) => {
                            err.lock().get_or_insert(e);
                            break;
                        }
                    }
                }
            });
        }
    });
    match err.into_inner() {
        Some(e) => Err(e.into()),
        None => Ok(got.into_inner()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WorkingSet {
        WorkingSet {
            root: ChunkId([7; 32]),
            recorded_unix: 0x0102_0304_0506_0708,
            block_size: 65536,
            read_bytes: 0x1122_3344,
            chunks: vec![ChunkId([1; 32]), ChunkId([2; 32])],
        }
    }

    #[test]
    fn layout_is_pinned() {
        let b = sample().encode();
        assert_eq!(b.len(), HEADER_LEN + 64 + 4);
        assert_eq!(&b[0..8], b"STRABSET");
        assert_eq!(&b[8..12], &1u32.to_le_bytes(), "version");
        assert_eq!(&b[12..16], &[0; 4], "flags");
        assert_eq!(&b[16..48], &[7; 32], "root");
        assert_eq!(&b[48..56], &0x0102_0304_0506_0708u64.to_le_bytes(), "recorded");
        assert_eq!(&b[56..60], &65536u32.to_le_bytes(), "block size");
        assert_eq!(&b[60..64], &2u32.to_le_bytes(), "count");
        assert_eq!(&b[64..72], &0x1122_3344u64.to_le_bytes(), "read bytes");
        assert_eq!(&b[72..80], &[0; 8], "reserved");
        assert_eq!(&b[80..112], &[1; 32]);
        assert_eq!(&b[112..144], &[2; 32]);
        assert_eq!(&b[144..148], &crc32c::crc32c(&b[..144]).to_le_bytes());
        assert_eq!(WorkingSet::decode("k", &b).unwrap(), sample());
    }

    #[test]
    fn damage_is_refused_with_advice() {
        let good = sample().encode();
        let mut flipped = good.clone();
        flipped[100] ^= 1;
        let mut wrong_n = good.clone();
        wrong_n[60] = 3;
        let mut huge = good.clone();
        huge[60..64].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut v2 = good.clone();
        v2[8] = 2;
        for (b, why) in [
            (&flipped, "checksum"),
            (&wrong_n, "length"),
            (&huge, "cap"),
            (&v2, "version"),
            (&good[..50].to_vec(), "short"),
        ] {
            let e = WorkingSet::decode("bootsets/g", b).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains("record-boot") && e.contains("bootsets/g"),
                "{e}"
            );
        }
    }
}

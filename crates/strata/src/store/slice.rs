//! Verified reads of byte ranges of chunks, and the store-wide cache that makes them cheap.
//!
//! A chunk id is the BLAKE3 hash of the chunk, and BLAKE3 is a Merkle tree over 1 KiB blocks:
//! in a chunk whose length is a multiple of 4 KiB (and at least 8 KiB), every aligned 4 KiB
//! piece is a whole subtree with its own chaining value (CV). The first read of such a chunk
//! verifies it whole, computing the root from the pieces' CVs, and keeps those CVs (32 bytes
//! per 4 KiB: 0.8% of the data). Later reads fetch only the pieces they need from the pack and
//! check each against its CV, so a 4 KiB read from a 64 KiB disk block costs a 4 KiB read and
//! a 4 KiB hash instead of 64 KiB of both, and stays verified: a piece matches its trusted CV
//! only if its bytes are the chunk's.
//!
//! Chunks that would have to be decompressed again (compressed frames, frames shared by
//! several chunks) or that are not sliceable are kept decompressed in a bounded data cache.
//! Both caches are keyed by chunk id and live in the `Store`, so every volume, snapshot and
//! clone served by one process shares them: clones of one golden image read its blocks once.
//! A chunk id names its content forever, so entries never go stale; they are only evicted
//! (first in, first out) to stay within their byte budgets.
//!
//! `read_ranges` does the same for all the chunks one disk read touches at once: the byte
//! ranges it needs are grouped by pack and each group is one `Backend::get_ranges` call
//! (merged into few requests by S3), different packs concurrently; each chunk is then
//! verified exactly as `read_range` would, and anything unusual (a chunk still in memory, a
//! failed pack read, a piece that does not match) falls back to `read_range`.

use super::{decode_chunk, Loc, Result, Store, StoreError};
use crate::codec::Codec;
use crate::id::{ChunkId, PackId};
use blake3::hazmat::{
    left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};
use parking_lot::RwLock;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes per verified piece (4 BLAKE3 chunks).
pub(crate) const PIECE: usize = 4096;
/// Largest chunk whose piece CVs are kept (256 CVs, 8 KiB).
const MAX_SLICED: usize = 1 << 20;
/// Default budget for piece CVs: about 7 GiB of 64 KiB blocks.
pub(crate) const DEFAULT_CV_BYTES: usize = 64 << 20;
/// Default budget for decompressed chunk data.
pub(crate) const DEFAULT_DATA_BYTES: usize = 256 << 20;
/// Rough per-entry overhead counted against a budget (map slot, queue slot, Arc header).
const ENTRY_OVERHEAD: usize = 96;

/// Counters of the verified-read path, for benchmarks and `serve` statistics.
#[derive(Default, Debug, serde::Serialize)]
pub struct SliceStats {
    /// Reads answered from verified pieces (only the needed 4 KiB pieces were read and hashed).
    pub piece_reads: AtomicU64,
    /// Reads answered from the decompressed-data cache.
    pub data_hits: AtomicU64,
    /// Reads that fetched and verified a whole chunk.
    pub full_reads: AtomicU64,
}

/// A byte-bounded first-in-first-out map from chunk ids to shared values.
struct Fifo<V> {
    map: HashMap<ChunkId, (V, usize)>,
    order: VecDeque<ChunkId>,
    bytes: usize,
    cap: usize,
}

impl<V: Clone> Fifo<V> {
    fn new(cap: usize) -> Fifo<V> {
        Fifo { map: HashMap::new(), order: VecDeque::new(), bytes: 0, cap }
    }

    fn get(&self, id: &ChunkId) -> Option<V> {
        self.map.get(id).map(|(v, _)| v.clone())
    }

    fn insert(&mut self, id: ChunkId, v: V, size: usize) {
        let size = size + ENTRY_OVERHEAD;
        if size > self.cap || self.map.contains_key(&id) {
            return;
        }
        self.map.insert(id, (v, size));
        self.order.push_back(id);
        self.bytes += size;
        while self.bytes > self.cap {
            let Some(old) = self.order.pop_front() else { break };
            if let Some((_, s)) = self.map.remove(&old) {
                self.bytes -= s;
            }
        }
    }
}

/// The store's caches of verified chunk pieces and decompressed chunks.
pub struct SliceCache {
    cvs: RwLock<Fifo<Arc<[ChainingValue]>>>,
    data: RwLock<Fifo<Arc<Vec<u8>>>>,
    pub stats: SliceStats,
}

impl SliceCache {
    pub fn new(cv_bytes: usize, data_bytes: usize) -> SliceCache {
        SliceCache {
            cvs: RwLock::new(Fifo::new(cv_bytes)),
            data: RwLock::new(Fifo::new(data_bytes)),
            stats: SliceStats::default(),
        }
    }
}

impl Default for SliceCache {
    fn default() -> SliceCache {
        SliceCache::new(DEFAULT_CV_BYTES, DEFAULT_DATA_BYTES)
    }
}

/// The range reads that go to one pack: (request index, location, what to fetch) each.
type PackGroup = (PackId, Vec<(usize, Loc, Want)>);

/// Whether a chunk of `len` bytes is verified piece by piece.
pub fn sliceable(len: usize) -> bool {
    len.is_multiple_of(PIECE) && (2 * PIECE..=MAX_SLICED).contains(&len)
}

/// The CV of piece `i` of a sliceable chunk.
fn piece_cv(i: usize, bytes: &[u8]) -> ChainingValue {
    let mut h = blake3::Hasher::new();
    h.set_input_offset((i * PIECE) as u64);
    h.update(bytes);
    h.finalize_non_root()
}

/// CV of the subtree made of `cvs` (pieces in order), which spans `cvs.len() * PIECE` bytes.
fn subtree(cvs: &[ChainingValue]) -> ChainingValue {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let left = (left_subtree_len((cvs.len() * PIECE) as u64) as usize) / PIECE;
    merge_subtrees_non_root(&subtree(&cvs[..left]), &subtree(&cvs[left..]), Mode::Hash)
}

/// The piece CVs of a sliceable chunk and the BLAKE3 hash (the chunk id) they add up to.
pub fn piece_cvs(data: &[u8]) -> (Vec<ChainingValue>, ChunkId) {
    debug_assert!(sliceable(data.len()));
    let cvs: Vec<ChainingValue> =
        data.chunks(PIECE).enumerate().map(|(i, p)| piece_cv(i, p)).collect();
    let left = (left_subtree_len(data.len() as u64) as usize) / PIECE;
    let root = merge_subtrees_root(&subtree(&cvs[..left]), &subtree(&cvs[left..]), Mode::Hash);
    (cvs, ChunkId(*root.as_bytes()))
}

impl Store {
    /// Copy bytes `[offset, offset + buf.len())` of chunk `id` into `buf`, verified against
    /// the id. Returns how many bytes the chunk has there (fewer than `buf.len()` where the
    /// chunk ends; the rest of `buf` is left alone).
    pub fn read_range(&self, id: &ChunkId, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let c = &self.inner.slices;
        if let Some(d) = c.data.read().get(id) {
            c.stats.data_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(copy_out(&d, offset, buf));
        }
        for attempt in 0..3 {
            let loc = self.inner.sh.index.read().chunks.get(id).copied();
            let Some(loc) = loc else { return Err(StoreError::ChunkMissing { id: *id }) };
            match self.read_range_at(id, &loc, offset, buf) {
                // GC may have moved the chunk to a new pack between lookup and read.
                Err(StoreError::PackMissing { .. }) if attempt < 2 => continue,
                other => return other,
            }
        }
        unreachable!()
    }

    fn read_range_at(&self, id: &ChunkId, loc: &Loc, offset: u64, buf: &mut [u8]) -> Result<usize> {
        if let Want::Pieces { cvs, start, len } = self.want(id, loc, offset, buf.len()) {
            let bytes = self.read_frame_range(loc, start, len)?;
            if let Some(n) = self.check_pieces(&cvs, start, &bytes, offset, buf) {
                return Ok(n);
            }
            // A piece failed its CV: read the whole chunk, which names the damage.
        }
        let frame = self.read_frame(loc)?;
        self.finish_frame(id, loc, frame, offset, buf)
    }

    /// What to fetch for a read of `len` bytes at `offset` of the chunk at `loc`.
    fn want(&self, id: &ChunkId, loc: &Loc, offset: u64, len: usize) -> Want {
        let e = &loc.entry;
        if !(sliceable(e.raw_len as usize) && whole_raw(loc)) {
            return Want::Frame;
        }
        let Some(cvs) = self.inner.slices.cvs.read().get(id) else { return Want::Frame };
        let end = (offset + len as u64).min(e.raw_len as u64);
        if offset >= end {
            return Want::Pieces { cvs, start: offset.min(e.raw_len as u64), len: 0 };
        }
        let start = offset / PIECE as u64 * PIECE as u64;
        let stop = end.div_ceil(PIECE as u64) * PIECE as u64;
        Want::Pieces { cvs, start, len: stop - start }
    }

    /// Check fetched pieces (`bytes`, from chunk offset `start`) against their CVs and copy
    /// the requested part out. `None` if a piece does not match.
    fn check_pieces(
        &self,
        cvs: &[ChainingValue],
        start: u64,
        bytes: &[u8],
        offset: u64,
        buf: &mut [u8],
    ) -> Option<usize> {
        let first = (start / PIECE as u64) as usize;
        for (k, p) in bytes.chunks(PIECE).enumerate() {
            if piece_cv(first + k, p) != cvs[first + k] {
                return None;
            }
        }
        self.inner.slices.stats.piece_reads.fetch_add(1, Ordering::Relaxed);
        let at = (offset - start) as usize;
        let n = bytes.len().saturating_sub(at).min(buf.len());
        buf[..n].copy_from_slice(&bytes[at..at + n]);
        Some(n)
    }

    /// Verify a whole fetched frame against the chunk id, remember what makes the next read
    /// cheap (piece CVs, or the decompressed chunk), and copy the requested part out.
    fn finish_frame(
        &self,
        id: &ChunkId,
        loc: &Loc,
        frame: Vec<u8>,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize> {
        let c = &self.inner.slices;
        let e = &loc.entry;
        let len = e.raw_len as usize;
        c.stats.full_reads.fetch_add(1, Ordering::Relaxed);
        let pack = || self.inner.sh.index.read().slot(loc.pack).map(|s| s.id).unwrap_or_default();
        if sliceable(len) && whole_raw(loc) {
            // The frame is the chunk: verify it through its pieces (no CRC: the hash covers it).
            let (cvs, root) = piece_cvs(&frame);
            if root != *id {
                return Err(corrupt(e.id, pack(), e.frame_off));
            }
            c.cvs.write().insert(*id, Arc::from(cvs.into_boxed_slice()), len / PIECE * 32);
            return Ok(copy_out(&frame, offset, buf));
        }
        let data = if whole_raw(loc) {
            if ChunkId::of(&frame) != *id {
                return Err(corrupt(e.id, pack(), e.frame_off));
            }
            frame
        } else {
            decode_chunk(&frame, e, pack())?
        };
        let n = copy_out(&data, offset, buf);
        c.data.write().insert(*id, Arc::new(data), len);
        Ok(n)
    }

    /// Several verified range reads at once (a disk read spanning many blocks). Reads of one
    /// pack go to the backend in one `get_ranges` call (merged into few requests by remote
    /// backends), and different packs are read concurrently. Every byte is verified as by
    /// [`Store::read_range`]; returns, per request, how many bytes the chunk had there.
    pub fn read_ranges(&self, reqs: &mut [RangeRead<'_>]) -> Result<Vec<usize>> {
        let mut done: Vec<Option<usize>> = vec![None; reqs.len()];
        // pack key -> (request index, location, what to fetch)
        let mut by_pack: HashMap<PackId, Vec<(usize, Loc, Want)>> = HashMap::new();
        for (i, r) in reqs.iter_mut().enumerate() {
            if let Some(d) = self.inner.slices.data.read().get(&r.id) {
                self.inner.slices.stats.data_hits.fetch_add(1, Ordering::Relaxed);
                done[i] = Some(copy_out(&d, r.offset, r.buf));
                continue;
            }
            let remote = {
                let idx = self.inner.sh.index.read();
                idx.chunks.get(&r.id).copied().and_then(|loc| {
                    let slot = idx.slot(loc.pack)?;
                    (slot.durable && slot.mem.is_none()).then_some((slot.id, loc))
                })
            };
            // Missing, or still in memory / the open pack: the one-at-a-time path handles it.
            let Some((pid, loc)) = remote else { continue };
            let want = self.want(&r.id, &loc, r.offset, r.buf.len());
            by_pack.entry(pid).or_default().push((i, loc, want));
        }
        let groups: Vec<PackGroup> = by_pack.into_iter().collect();
        let fetch = |(pid, items): &PackGroup| {
            let ranges: Vec<(u64, u64)> = items
                .iter()
                .map(|(_, loc, w)| match w {
                    Want::Pieces { start, len, .. } => (loc.entry.frame_off + start, *len),
                    Want::Frame => (loc.entry.frame_off, loc.entry.frame_len as u64),
                })
                .collect();
            self.inner.sh.backend.get_ranges(&pid.pack_key(), &ranges)
        };
        let fetched: Vec<_> = if groups.len() <= 1 {
            groups.iter().map(fetch).collect()
        } else {
            std::thread::scope(|s| {
                let hs: Vec<_> = groups.iter().map(|g| s.spawn(move || fetch(g))).collect();
                hs.into_iter().map(|h| h.join().expect("pack reader")).collect()
            })
        };
        for ((_, items), got) in groups.into_iter().zip(fetched) {
            // A failed pack read (GC moved it, or a backend error) is retried one at a time below.
            let Ok(got) = got else { continue };
            for ((i, loc, want), bytes) in items.into_iter().zip(got) {
                let r = &mut reqs[i];
                done[i] = match want {
                    Want::Pieces { cvs, start, .. } => {
                        self.check_pieces(&cvs, start, &bytes, r.offset, r.buf)
                    }
                    Want::Frame => Some(self.finish_frame(&r.id, &loc, bytes, r.offset, r.buf)?),
                };
            }
        }
        reqs.iter_mut()
            .zip(done)
            .map(|(r, d)| d.map_or_else(|| self.read_range(&r.id, r.offset, r.buf), Ok))
            .collect()
    }

    /// Counters of verified range reads.
    pub fn slice_stats(&self) -> &SliceStats {
        &self.inner.slices.stats
    }
}

/// One request of [`Store::read_ranges`]: bytes from `offset` of chunk `id`, into `buf`.
pub struct RangeRead<'a> {
    pub id: ChunkId,
    pub offset: u64,
    pub buf: &'a mut [u8],
}

/// What a range read fetches from the pack.
enum Want {
    /// Pieces `[start, start + len)` of a chunk whose piece CVs are known.
    Pieces { cvs: Arc<[ChainingValue]>, start: u64, len: u64 },
    /// The whole frame (first read of a chunk, or a compressed one).
    Frame,
}

/// Is the chunk its whole frame, stored uncompressed?
fn whole_raw(loc: &Loc) -> bool {
    let e = &loc.entry;
    e.codec == Codec::None && e.off_in_frame == 0 && e.raw_len == e.frame_raw_len
}

fn corrupt(id: ChunkId, pack: PackId, offset: u64) -> StoreError {
    StoreError::Corrupt { id, pack, offset, reason: "content does not match its hash".into() }
}

fn copy_out(data: &[u8], offset: u64, buf: &mut [u8]) -> usize {
    let from = (offset as usize).min(data.len());
    let n = (data.len() - from).min(buf.len());
    buf[..n].copy_from_slice(&data[from..from + n]);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn piece_cvs_add_up_to_the_blake3_hash() {
        for len in [8192usize, 12288, 20480, 65536, 69632, 3 * 65536, MAX_SLICED] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            let (cvs, root) = piece_cvs(&data);
            assert_eq!(cvs.len(), len / PIECE);
            assert_eq!(root, ChunkId::of(&data), "len {len}");
        }
        assert!(
            !sliceable(4096)
                && !sliceable(65535)
                && !sliceable(MAX_SLICED + PIECE)
                && sliceable(65536)
        );
    }

    fn corrupt_byte(dir: &std::path::Path, s: &Store, id: &ChunkId, at: u64) {
        use std::os::unix::fs::FileExt;
        let (pack, e) = s.locate(id).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(pack.pack_key()))
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, e.frame_off + at).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], e.frame_off + at).unwrap();
    }

    #[test]
    fn batched_reads_match_single_reads_and_are_verified() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("s");
        // Small packs, so a batch spans several packs (read concurrently).
        let s = Store::init_local(
            &dir,
            crate::store::InitOptions { pack_size: 200 << 10, ..Default::default() },
        )
        .unwrap();
        let ses = s.session();
        let mut chunks = Vec::new();
        for k in 0..12u32 {
            let raw: Vec<u8> =
                (0..65536u32).map(|i| (i.wrapping_mul(2654435761 + k) >> 13) as u8).collect();
            let codec = if k % 3 == 0 { Codec::Lz4 } else { Codec::None };
            let data =
                if k % 3 == 0 { (0..65536u32).map(|i| (i / 512 + k) as u8).collect() } else { raw };
            chunks.push((
                ses.put_with(&data, crate::store::pack::ChunkKind::Data, codec).unwrap(),
                data,
            ));
        }
        s.flush().unwrap();
        drop(ses);
        let run = |s: &Store, at: u64, len: usize| {
            let mut bufs: Vec<Vec<u8>> = chunks.iter().map(|_| vec![0u8; len]).collect();
            let mut reqs: Vec<RangeRead> = chunks
                .iter()
                .zip(bufs.iter_mut())
                .map(|((id, _), b)| RangeRead { id: *id, offset: at, buf: b })
                .collect();
            let n = s.read_ranges(&mut reqs).unwrap();
            for ((b, (_, data)), n) in bufs.iter().zip(&chunks).zip(n) {
                let end = (at as usize + len).min(data.len());
                assert_eq!(n, end - at as usize);
                assert_eq!(b[..n], data[at as usize..end]);
            }
        };
        run(&s, 100, 9000); // first reads: whole frames
        run(&s, 5000, 4096); // pieces (raw) and the data cache (compressed)
        run(&s, 60000, 8192); // short at the chunks' ends
        let st = s.slice_stats();
        assert_eq!(st.full_reads.load(Ordering::Relaxed), 12);
        assert_eq!(st.piece_reads.load(Ordering::Relaxed), 16);
        // A damaged piece is refused by a batch too, also before the chunk was ever verified.
        corrupt_byte(&dir, &s, &chunks[1].0, 4096 + 3);
        let mut b = vec![0u8; 100];
        let mut reqs = vec![RangeRead { id: chunks[1].0, offset: 4096, buf: &mut b }];
        assert!(matches!(s.read_ranges(&mut reqs), Err(StoreError::Corrupt { .. })));
        s.close().unwrap();
        let s = Store::open_local(&dir).unwrap();
        let mut b2 = vec![0u8; 100];
        let mut reqs = vec![
            RangeRead { id: chunks[2].0, offset: 0, buf: &mut b },
            RangeRead { id: chunks[1].0, offset: 0, buf: &mut b2 },
        ];
        assert!(matches!(s.read_ranges(&mut reqs), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn range_reads_are_verified_piece_by_piece() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("s");
        let s = Store::init_local(&dir, crate::store::InitOptions::default()).unwrap();
        let raw: Vec<u8> =
            (0..65536u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let packed: Vec<u8> = (0..65536u32).map(|i| (i / 512) as u8).collect();
        let ses = s.session();
        let a = ses.put_with(&raw, crate::store::pack::ChunkKind::Data, Codec::None).unwrap();
        let b = ses.put_with(&packed, crate::store::pack::ChunkKind::Data, Codec::Lz4).unwrap();
        s.flush().unwrap();
        let mut buf = vec![0u8; 6000];
        // First reads verify whole chunks; later ones only the pieces they touch.
        assert_eq!(s.read_range(&a, 3000, &mut buf).unwrap(), 6000);
        assert_eq!(buf, raw[3000..9000]);
        assert_eq!(s.read_range(&a, 62000, &mut buf).unwrap(), 3536, "short at the chunk's end");
        assert_eq!(buf[..3536], raw[62000..]);
        assert_eq!(s.read_range(&b, 100, &mut buf).unwrap(), 6000);
        assert_eq!(buf, packed[100..6100]);
        assert_eq!(s.read_range(&b, 30000, &mut buf).unwrap(), 6000);
        assert_eq!(buf, packed[30000..36000]);
        let st = s.slice_stats();
        assert_eq!(st.full_reads.load(Ordering::Relaxed), 2);
        assert_eq!(st.piece_reads.load(Ordering::Relaxed), 1);
        assert_eq!(st.data_hits.load(Ordering::Relaxed), 1);
        // Damage piece 2 of the raw chunk on disk: reads of it fail, reads of piece 0 do not.
        corrupt_byte(&dir, &s, &a, 2 * 4096 + 17);
        let err = s.read_range(&a, 8192, &mut buf[..100]).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(s.read_range(&a, 0, &mut buf[..4096]).unwrap(), 4096);
        assert_eq!(buf[..4096], raw[..4096]);
        // A store that has not verified the chunk yet refuses it too.
        drop(ses);
        s.close().unwrap();
        let s = Store::open_local(&dir).unwrap();
        assert!(matches!(s.read_range(&a, 0, &mut buf[..10]), Err(StoreError::Corrupt { .. })));
    }
}

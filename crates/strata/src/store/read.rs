//! The read path: finding chunks in the index ([`Store::locate_many`] batches the lookups) and
//! reading a chunk's frame from the open pack, a sealed pack still in memory, or the backend,
//! then decompressing and verifying it. Kept apart from the write path (`session.rs`); ranged
//! reads of large chunks (`slice.rs`) build on the same frame reads.

use super::format;
use super::pack::{ChunkKind, PackEntry};
use super::{writer, Loc, Result, Store, StoreError};
use crate::backend::ErrorKind;
use crate::codec::Codec;
use crate::id::{ChunkId, PackId};

/// Ids located per hold of the index lock by [`Store::locate_many`]: a writer (a save
/// sealing a pack) waits at most this many lookups (~0.2 ms).
pub(crate) const LOCATE_BATCH: usize = 4096;

impl Store {
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.inner.sh.index.read().chunks.contains_key(id)
    }

    /// Number of chunks in the index.
    pub fn chunk_count(&self) -> usize {
        self.inner.sh.index.read().chunks.len()
    }

    /// The pack and entry that hold a chunk.
    pub fn locate(&self, id: &ChunkId) -> Option<(PackId, PackEntry)> {
        let idx = self.inner.sh.index.read();
        let loc = idx.chunks.get(id)?;
        Some((idx.slot(loc.pack)?.id, loc.entry))
    }

    /// Locate many chunks, taking the index lock once per [`LOCATE_BATCH`] ids instead of once
    /// per id (a restore locates every page of a checkpoint: ~15,000 for 128 MiB). `f` gets
    /// each id's position in `ids` and its pack and entry, or `None` if the index lacks it. It
    /// runs under the lock, so it must not call back into the store.
    pub fn locate_many(
        &self,
        ids: &[ChunkId],
        mut f: impl FnMut(usize, Option<(PackId, &PackEntry)>),
    ) {
        for (b, batch) in ids.chunks(LOCATE_BATCH).enumerate() {
            let idx = self.inner.sh.index.read();
            for (i, id) in batch.iter().enumerate() {
                let hit =
                    idx.chunks.get(id).and_then(|loc| Some((idx.slot(loc.pack)?.id, &loc.entry)));
                f(b * LOCATE_BATCH + i, hit);
            }
        }
    }

    /// Raw length and kind of a chunk, without reading it.
    pub fn chunk_info(&self, id: &ChunkId) -> Option<(u32, ChunkKind)> {
        self.inner.sh.index.read().chunks.get(id).map(|l| (l.entry.raw_len, l.entry.kind))
    }

    /// Read a chunk and verify it against its id.
    pub fn get(&self, id: &ChunkId) -> Result<Vec<u8>> {
        let mut refreshed = false;
        for attempt in 0..3 {
            let loc = self.inner.sh.index.read().chunks.get(id).copied();
            let Some(loc) = loc else {
                // Another host may have written it since we opened: look once. Whatever the
                // count: a concurrent refresh (another reader's miss) may have added the pack
                // this one found, and then this one counts nothing new.
                if !refreshed {
                    self.refresh()?;
                    refreshed = true;
                    continue;
                }
                return Err(StoreError::ChunkMissing { id: *id });
            };
            match self.read_loc(id, &loc) {
                // GC may have moved the chunk to a new pack between lookup and read.
                Err(StoreError::PackMissing { .. }) if attempt < 2 => continue,
                other => return other,
            }
        }
        unreachable!()
    }

    pub(super) fn read_frame(&self, loc: &Loc) -> Result<Vec<u8>> {
        self.read_frame_range(loc, 0, loc.entry.frame_len as u64)
    }

    /// Bytes `[start, start + len)` of a chunk's stored frame (unverified; callers verify).
    pub(super) fn read_frame_range(&self, loc: &Loc, start: u64, len: u64) -> Result<Vec<u8>> {
        let e = &loc.entry;
        let (pid, mem, durable) = {
            let idx = self.inner.sh.index.read();
            let slot = idx
                .slot(loc.pack)
                .ok_or(StoreError::PackMissing { id: e.id, pack: PackId::default() })?;
            (slot.id, slot.mem.clone(), slot.durable)
        };
        let first = e.frame_off as usize + start as usize;
        let range = first..first + len as usize;
        if let Some(mem) = mem {
            return Ok(mem[range].to_vec());
        }
        if !durable {
            let open = self.inner.open.lock();
            if open.no == loc.pack {
                if let Some(b) = &open.builder {
                    return Ok(b.bytes()[range].to_vec());
                }
            }
        }
        // The pack may have been sealed while we looked; check memory once more, after any
        // seal still encoding its trailer.
        if !durable {
            drop(self.inner.sealing.write());
        }
        if let Some(mem) = self.inner.sh.index.read().slot(loc.pack).and_then(|s| s.mem.clone()) {
            return Ok(mem[range].to_vec());
        }
        self.inner.sh.backend.get_range(&pid.pack_key(), e.frame_off + start, len).map_err(|err| {
            match err.kind {
                ErrorKind::NotFound => StoreError::PackMissing { id: e.id, pack: pid },
                _ => StoreError::Backend(err),
            }
        })
    }

    fn read_loc(&self, id: &ChunkId, loc: &Loc) -> Result<Vec<u8>> {
        let frame = self.read_frame(loc)?;
        let e = &loc.entry;
        if e.codec == Codec::None && e.off_in_frame == 0 && e.raw_len == e.frame_raw_len {
            // The frame is the chunk: verify in place and hand the buffer over without a copy.
            if format::crc(&frame) == e.frame_crc && ChunkId::of(&frame) == *id {
                return Ok(frame);
            }
        }
        let pack = self.inner.sh.index.read().slot(loc.pack).map(|s| s.id).unwrap_or_default();
        decode_chunk(&frame, e, pack)
    }

    /// Learn about packs other store instances (hosts) wrote since we opened. Returns how
    /// many were new. Called by reads that miss; cheap when nothing changed (one listing).
    pub fn refresh(&self) -> Result<usize> {
        // Never while our own GC runs: it may have unlinked chunks whose index objects it has
        // not deleted yet, and re-adding them would let a writer dedup against the dead.
        // Readers that miss together (a plan's concurrent map reads on a second host) queue
        // here: the first lists and reads the new packs, the others then find nothing new,
        // and their callers look again. Without the queue they found the GC lock below held
        // by the first refresh, counted nothing and reported the chunk missing.
        let _one = self.inner.refreshing.lock();
        let Some(_no_gc) = self.inner.gc_running.try_lock() else { return Ok(0) };
        writer::refresh_index(&self.inner.sh)
    }
}

/// Decompress a frame, slice the chunk out, and verify its hash.
pub(crate) fn decode_chunk(frame: &[u8], e: &PackEntry, pack: PackId) -> Result<Vec<u8>> {
    let corrupt =
        |reason: String| StoreError::Corrupt { id: e.id, pack, offset: e.frame_off, reason };
    if format::crc(frame) != e.frame_crc {
        return Err(corrupt("frame checksum mismatch".into()));
    }
    if e.codec == Codec::None && e.off_in_frame == 0 && e.raw_len == e.frame_raw_len {
        // A whole uncompressed frame is the chunk itself: verify it in place.
        if ChunkId::of(frame) != e.id {
            return Err(corrupt("content does not match its hash".into()));
        }
        return Ok(frame.to_vec());
    }
    let raw = e
        .codec
        .decompress(frame, e.frame_raw_len as usize)
        .map_err(|err| corrupt(err.to_string()))?;
    let data = raw[e.off_in_frame as usize..(e.off_in_frame + e.raw_len) as usize].to_vec();
    if ChunkId::of(&data) != e.id {
        return Err(corrupt("content does not match its hash".into()));
    }
    Ok(data)
}

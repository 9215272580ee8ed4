//! The write path: a [`Session`] puts chunks into the open pack; a full (or, on a network
//! backend, early) pack is sealed and handed to the writer thread (`writer.rs`), and
//! [`Store::flush`] and [`Session::commit_ref`] make it durable before a ref is written.
//! The ordering invariant and failure policy this code keeps are in `mod.rs`'s comment.

use super::objects::{valid_ref_name, Ref, Tree};
use super::pack::{ChunkKind, PackBuilder, PackEntry};
use super::writer::Job;
use super::{Loc, OpenPack, PackSlot, Result, Store, StoreError};
use crate::codec::{Codec, MAX_FRAME_RAW};
use crate::id::{ChunkId, PackId};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Smallest pack sealed early while one pack is waiting or uploading, on a network backend:
/// a second upload starts once this much is ready, so the link has two in flight and one
/// request's latency is hidden behind the other. While both are in flight packs grow, so a
/// large save does not pay a request per pack-let. 8 MiB because the server's per-object work
/// (request, file, fsync) is what a 2-core host runs short of: over 12 alternating rounds
/// each (`bench save-restore --remote --sizes 128`), 2 MiB / 8 MiB make 11–17 objects of a
/// 128 MiB save instead of 33–50 at 1 MiB, cut versitygw's CPU per restore from 0.12–0.18 to
/// 0.07–0.13 s and the median save from 0.40 to 0.355 s, with restores within the noise
/// (docs/results/README.md); 4 MiB leaves a 128 MiB save one upload at a time for its first
/// 100 ms. A burst reaches it by doubling from twice [`EARLY_SEAL_FIRST_BYTES`] (512 KiB, 1,
/// 2, 4, 8 MiB), one busy seal at a time, so a save's first uploads overlap instead of going
/// one at a time (each sealed idle, as the last one's reply comes), which idles the link
/// ~10-15 ms of the first 40 (`scripts/link-trace.py`, 512 MiB saves).
pub(crate) const EARLY_SEAL_BYTES: u64 = 8 << 20;
/// Smallest pack sealed early while nothing is uploading: the link would otherwise idle until
/// more is ready. 2 MiB: the first upload leaves ~20 ms into a 128 MiB save instead of ~3 ms
/// at 256 KiB, for a third of the objects (see [`EARLY_SEAL_BYTES`]).
pub(crate) const EARLY_SEAL_IDLE_BYTES: u64 = 2 << 20;
/// The first pack sealed early after a ref commit (the start of a save): the idle-seal size then
/// doubles per idle seal up to [`EARLY_SEAL_IDLE_BYTES`] (256 KiB, 512 KiB, 1 MiB, 2 MiB), so a
/// save's first upload leaves a few ms after its first page instead of ~18 ms (a 2 MiB pack),
/// for three extra small objects. TCP slow start, the other way round.
pub(crate) const EARLY_SEAL_FIRST_BYTES: u64 = 256 << 10;
/// A network backend's open pack is sealed early while fewer packs than this are waiting or
/// uploading: two small uploads in flight hide a request's latency, one would leave the link
/// idle between them (measured: ~60 MB/s of a 1 Gbit/s link with one).
pub(crate) const EARLY_SEAL_UPLOADS: usize = 2;
/// [`Session::seal_for_upload`] leaves the open pack alone while this many bytes of sealed packs
/// are waiting or uploading: ~9 ms of a 1 Gbit/s link, several times the 1-3 ms a save takes
/// to write its page maps, so the link stays busy meanwhile and the last pages go up with
/// the maps, in one object.
pub(crate) const EARLY_SEAL_BUSY_BYTES: u64 = 1 << 20;

/// A frame its caller compressed already (a memory save's codec sample): the ids of the
/// chunks joined into it, in order, and the stored bytes under the frame's codec (None: the
/// codec did not pay, store the chunks raw).
#[derive(Debug)]
pub struct Precompressed {
    pub ids: Vec<ChunkId>,
    pub stored: Option<Vec<u8>>,
}

/// A pack taken out of [`OpenPack`] whose trailer is not encoded yet.
struct Sealing<'a> {
    no: u32,
    builder: PackBuilder,
    _gate: parking_lot::RwLockReadGuard<'a, ()>,
}

impl Store {
    /// Start a write session: chunks it puts or pins are safe from GC until it is dropped.
    pub fn session(&self) -> Session {
        let id = self.inner.next_session.fetch_add(1, Ordering::Relaxed);
        let pins = Arc::new(Mutex::new(HashSet::new()));
        self.inner.sessions.lock().insert(id, pins.clone());
        Session { store: self.clone(), id, pins }
    }

    /// Make every chunk put so far durable (packs, then their index objects).
    pub fn flush(&self) -> Result<()> {
        let _f = self.inner.flush_lock.lock();
        self.inner.sh.check_poison()?;
        let sealing = {
            let mut open = self.inner.open.lock();
            self.seal_locked(&mut open)
        };
        self.send_sealed(sealing)?;
        // Packs other threads sealed before this flush must reach the writer before it does.
        drop(self.inner.sealing.write());
        self.inner.writer.flush()
    }

    /// On a network backend, seal the open pack now and queue its upload without waiting for
    /// it: a memory save calls this when the stream has ended, so its last pages go up while
    /// the page maps are written (they then make a small pack of their own). [`Store::flush`]
    /// stays the durability point. A no-op on other backends (one pack fewer to sync), and
    /// while [`EARLY_SEAL_UPLOADS`] packs are already waiting or uploading: the link then stays
    /// busy while the maps are written (1-3 ms), so the last pages wait for them and go up in
    /// the same pack, one object fewer at the end of the save (one request, and one sync on a
    /// durable server). Likewise while [`EARLY_SEAL_BUSY_BYTES`] or more of sealed packs are
    /// waiting or uploading: a 4 MiB pack sealed just before the stream's end keeps the link
    /// busy for tens of ms, and an early seal would only add a pack, and a sync at the end, to
    /// the save.
    pub fn seal_for_upload(&self) -> Result<()> {
        let uploads = &self.inner.sh.uploads;
        if !self.inner.early_seal
            || uploads.pending() >= EARLY_SEAL_UPLOADS
            || uploads.pending_bytes() >= EARLY_SEAL_BUSY_BYTES
        {
            return Ok(());
        }
        let _f = self.inner.flush_lock.lock();
        self.inner.sh.check_poison()?;
        let sealing = {
            let mut open = self.inner.open.lock();
            self.seal_locked(&mut open)
        };
        self.send_sealed(sealing)
    }

    /// Take the open pack (if any) for sealing, under the `open` lock; the caller drops that
    /// lock and passes the result to [`Store::send_sealed`], which encodes the pack's trailer
    /// (compressing it: ~1 ms per 5000 chunks) without blocking other writers.
    fn seal_locked(&self, open: &mut OpenPack) -> Option<Sealing<'_>> {
        let b = open.builder.take()?;
        if b.is_empty() {
            return None;
        }
        // Taken before `open` is released: a reader that then finds the pack neither open nor
        // in memory waits on it (see `read_frame_range`).
        let gate = self.inner.sealing.read();
        let no = open.no;
        open.no = u32::MAX;
        self.inner.sh.uploads.sealed();
        Some(Sealing { no, builder: b, _gate: gate })
    }

    /// Finish a pack taken by [`Store::seal_locked`], make it readable from memory and hand
    /// it to the writer.
    fn send_sealed(&self, sealing: Option<Sealing<'_>>) -> Result<()> {
        let Some(Sealing { no, builder, _gate }) = sealing else { return Ok(()) };
        let id = builder.id;
        let (bytes, entries) = builder.finish();
        tracing::debug!(target: "strata::store", no, size = bytes.len(), chunks = entries.len(), "pack sealed");
        self.inner.sh.uploads.queued(bytes.len() as u64);
        let bytes = Arc::new(bytes);
        {
            let mut idx = self.inner.sh.index.write();
            if let Some(Some(slot)) = idx.packs.get_mut(no as usize) {
                slot.size = bytes.len() as u64;
                slot.mem = Some(bytes.clone());
            }
        }
        // The gate is held until the writer has the pack, so a flush queued after it waits.
        self.inner.writer.send(Job::Pack { no, id, bytes, entries })
    }

    /// Append one frame holding `items` (ids must be BLAKE3 of the data). Returns the number of
    /// chunks that were new. Used by sessions.
    fn put_frame_inner(
        &self,
        items: &[(ChunkId, &[u8])],
        kind: ChunkKind,
        codec: Codec,
        pre: Option<Precompressed>,
        joined: Option<&[u8]>,
    ) -> Result<usize> {
        let sh = &self.inner.sh;
        let fresh: Vec<(ChunkId, &[u8])> = {
            let idx = sh.index.read();
            let mut fresh: Vec<(ChunkId, &[u8])> = Vec::with_capacity(items.len());
            for &(id, d) in items {
                // Frames are small (<= 16 chunks): a linear scan finds repeats within one.
                if !idx.chunks.contains_key(&id) && !fresh.iter().any(|(f, _)| *f == id) {
                    fresh.push((id, d));
                }
            }
            fresh
        };
        let dups = (items.len() - fresh.len()) as u64;
        sh.stats.chunks_dedup.fetch_add(dups, Ordering::Relaxed);
        if fresh.is_empty() {
            return Ok(0);
        }
        let raw_total: usize = fresh.iter().map(|(_, d)| d.len()).sum();
        if raw_total > MAX_FRAME_RAW {
            return Err(StoreError::TooLarge { size: raw_total });
        }
        // Compressed frames need their chunks joined; raw ones are copied part by part
        // straight into the pack.
        let pre = pre.filter(|p| {
            p.ids.len() == fresh.len() && p.ids.iter().zip(&fresh).all(|(a, (b, _))| a == b)
        });
        let compressed: Option<Vec<u8>> = if codec == Codec::None {
            None
        } else if let Some(p) = pre {
            p.stored
        } else if fresh.len() == 1 {
            codec.compress(fresh[0].1)
        } else if let Some(j) =
            joined.filter(|j| fresh.len() == items.len() && j.len() == raw_total)
        {
            codec.compress(j)
        } else {
            let mut j = Vec::with_capacity(raw_total);
            for (_, d) in &fresh {
                j.extend_from_slice(d);
            }
            codec.compress(&j)
        };
        let stored_len = compressed.as_ref().map_or(raw_total, Vec::len);
        let job = {
            let mut open = self.inner.open.lock();
            sh.check_poison()?;
            // Another thread may have stored some of these meanwhile; the frame still holds
            // their bytes but only absent ids get index entries.
            let absent: Vec<bool> = {
                let idx = sh.index.read();
                fresh.iter().map(|(id, _)| !idx.chunks.contains_key(id)).collect()
            };
            if !absent.iter().any(|a| *a) {
                return Ok(0);
            }
            if open.builder.is_none() {
                let id = PackId::random();
                open.no =
                    sh.index.write().add_slot(PackSlot { id, size: 0, mem: None, durable: false });
                let reserve = self.pack_reserve();
                let spare = sh.spare_packs.lock().pop().filter(|b| b.capacity() >= reserve);
                open.builder = Some(match spare {
                    Some(buf) => PackBuilder::with_buffer(id, buf),
                    None => PackBuilder::with_capacity(id, reserve),
                });
            }
            let no = open.no;
            let b = open.builder.as_mut().unwrap();
            let chunks: Vec<(ChunkId, u32, ChunkKind)> =
                fresh.iter().map(|(id, d)| (*id, d.len() as u32, kind)).collect();
            let entries = match &compressed {
                Some(z) => b.add_frame(z, codec, &chunks).to_vec(),
                None => {
                    let parts: Vec<&[u8]> = fresh.iter().map(|(_, d)| *d).collect();
                    b.add_frame_parts(&parts, &chunks).to_vec()
                }
            };
            {
                let mut idx = sh.index.write();
                for (e, a) in entries.iter().zip(&absent) {
                    if *a {
                        idx.chunks.insert(e.id, Loc { pack: no, entry: *e });
                    }
                }
            }
            let n_new = absent.iter().filter(|a| **a).count();
            sh.stats.chunks_new.fetch_add(n_new as u64, Ordering::Relaxed);
            sh.stats.raw_bytes_new.fetch_add(raw_total as u64, Ordering::Relaxed);
            sh.stats.stored_bytes_new.fetch_add(stored_len as u64, Ordering::Relaxed);
            // On a network backend a pack is also sealed as soon as the uploader has room, so
            // uploads overlap the producer (a small save would otherwise upload only at its
            // flush); while the backend is the bottleneck packs still grow to full size.
            let len = b.len();
            let (early, idle) = match self.inner.early_seal.then(|| sh.uploads.pending()) {
                None => (false, false),
                Some(0) => (len >= open.idle_seal_at, true),
                Some(n) => (n < EARLY_SEAL_UPLOADS && len >= open.busy_seal_at, false),
            };
            if early && idle {
                open.idle_seal_at = (open.idle_seal_at * 2).min(EARLY_SEAL_IDLE_BYTES);
            } else if early {
                open.busy_seal_at = (open.busy_seal_at * 2).min(EARLY_SEAL_BYTES);
            }
            let sealed = if len >= self.inner.pack_size || early {
                self.seal_locked(&mut open)
            } else {
                None
            };
            (sealed, n_new)
        };
        let (sealing, n_new) = job;
        self.send_sealed(sealing)?;
        Ok(n_new)
    }

    /// Bytes reserved for an open pack: a full pack, its largest last frame and its trailer
    /// (64-byte entries per chunk of at least 4 KiB).
    fn pack_reserve(&self) -> usize {
        let p = self.inner.pack_size as usize;
        p + p / 32 + MAX_FRAME_RAW + (1 << 16)
    }

    /// Copy an existing stored frame into the open pack (GC repacking): the chunks listed
    /// (id, offset in frame, length, kind) are re-pointed at the copy.
    pub(crate) fn put_raw_frame(
        &self,
        stored: &[u8],
        template: &PackEntry,
        chunks: &[(ChunkId, u32, u32, ChunkKind)],
    ) -> Result<()> {
        let sh = &self.inner.sh;
        let job = {
            let mut open = self.inner.open.lock();
            sh.check_poison()?;
            if open.builder.is_none() {
                let id = PackId::random();
                open.no =
                    sh.index.write().add_slot(PackSlot { id, size: 0, mem: None, durable: false });
                open.builder = Some(PackBuilder::new(id));
            }
            let no = open.no;
            let b = open.builder.as_mut().unwrap();
            let entries =
                b.add_frame_at(stored, template.codec, template.frame_raw_len, chunks).to_vec();
            {
                let mut idx = sh.index.write();
                for e in entries {
                    idx.chunks.insert(e.id, Loc { pack: no, entry: e });
                }
            }
            if b.len() >= self.inner.pack_size {
                self.seal_locked(&mut open)
            } else {
                None
            }
        };
        self.send_sealed(job)
    }
}

/// A writer's view of the store; see the module comment for why writes go through sessions.
pub struct Session {
    store: Store,
    id: u64,
    pins: Arc<Mutex<HashSet<ChunkId>>>,
}

impl Session {
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Store one chunk with the store's default codec.
    pub fn put(&self, data: &[u8], kind: ChunkKind) -> Result<ChunkId> {
        self.put_with(data, kind, self.store.inner.default_codec)
    }

    pub fn put_with(&self, data: &[u8], kind: ChunkKind, codec: Codec) -> Result<ChunkId> {
        let id = ChunkId::of(data);
        self.put_frame(&[(id, data)], kind, codec)?;
        Ok(id)
    }

    /// Store several chunks compressed together as one frame (ids must be BLAKE3 of the
    /// data; chunks already present are skipped). Returns how many were new.
    pub fn put_frame(
        &self,
        items: &[(ChunkId, &[u8])],
        kind: ChunkKind,
        codec: Codec,
    ) -> Result<usize> {
        self.put_frame_pre(items, kind, codec, None)
    }

    /// [`put_frame`](Self::put_frame) with the frame possibly compressed already: `pre` is
    /// used when its ids are exactly the chunks the frame stores (those not in the store, in
    /// order, repeats once), and ignored otherwise (another thread stored one meanwhile).
    pub fn put_frame_pre(
        &self,
        items: &[(ChunkId, &[u8])],
        kind: ChunkKind,
        codec: Codec,
        pre: Option<Precompressed>,
    ) -> Result<usize> {
        self.put_frame_joined(items, kind, codec, pre, None)
    }

    /// [`put_frame_pre`](Self::put_frame_pre) for items whose bytes the caller also holds end
    /// to end in `joined` (a memory save's consecutive pages of one batch): when every item is
    /// new, the codec reads `joined` instead of a joined copy of the items (128 KiB a frame;
    /// ~3% of a memory save's compressing CPU).
    pub fn put_frame_joined(
        &self,
        items: &[(ChunkId, &[u8])],
        kind: ChunkKind,
        codec: Codec,
        pre: Option<Precompressed>,
        joined: Option<&[u8]>,
    ) -> Result<usize> {
        debug_assert!(items.iter().all(|(id, d)| ChunkId::of(d) == *id));
        debug_assert!(joined.is_none_or(
            |j| j == items.iter().flat_map(|(_, d)| d.iter().copied()).collect::<Vec<u8>>()
        ));
        let _g = self.store.inner.gc_lock.read();
        self.store.inner.sh.check_poison()?;
        self.pins.lock().extend(items.iter().map(|(id, _)| *id));
        self.store.put_frame_inner(items, kind, codec, pre, joined)
    }

    /// Store a tree chunk.
    pub fn put_tree(&self, tree: &Tree) -> Result<ChunkId> {
        self.put(&tree.encode(), ChunkKind::Tree)
    }

    /// Keep an existing chunk (e.g. the root of a clone source) alive for this session.
    pub fn pin(&self, id: ChunkId) -> Result<()> {
        let _g = self.store.inner.gc_lock.read();
        if !id.is_zero() && !self.store.contains(&id) && {
            self.store.refresh()?;
            !self.store.contains(&id)
        } {
            return Err(StoreError::ChunkMissing { id });
        }
        self.pins.lock().insert(id);
        Ok(())
    }

    /// Durably point `name` at `r`: flush everything first, then write the ref.
    pub fn commit_ref(&self, name: &str, r: Ref) -> Result<()> {
        self.commit_ref_inner(name, r, false)
    }

    /// [`commit_ref`](Self::commit_ref), refused with [`StoreError::RefExists`] (and nothing
    /// written) when `name` already exists: the check runs under the name's lease, after the
    /// flush, so it is the last word on a name a caller checked earlier.
    pub fn commit_new_ref(&self, name: &str, r: Ref) -> Result<()> {
        self.commit_ref_inner(name, r, true)
    }

    fn commit_ref_inner(&self, name: &str, mut r: Ref, must_be_new: bool) -> Result<()> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        let inner = &self.store.inner;
        let _g = inner.gc_lock.read();
        for root in &r.roots {
            if !root.is_zero() && !self.store.contains(root) && {
                self.store.refresh()?;
                !self.store.contains(root)
            } {
                return Err(StoreError::MissingRoot { name: name.into(), id: *root });
            }
            self.pins.lock().insert(*root);
        }
        // One writer per name: commit under our lease, or take one for this commit alone.
        let _tmp = self.store.lease_for_commit(name)?;
        let t0 = std::time::Instant::now();
        // The old ref (for the generation, and `must_be_new`) is read while the packs are
        // flushed: under the lease nobody else writes it meanwhile.
        let (flushed, old) = std::thread::scope(|s| {
            let old = s.spawn(|| self.store.get_ref(name));
            (self.store.flush(), old.join())
        });
        flushed?;
        // The next write starts a new burst (e.g. the next save): its first upload leaves
        // early. Not at every flush: a long save flushes every 128 MiB and keeps going.
        {
            let mut open = inner.open.lock();
            open.idle_seal_at = EARLY_SEAL_FIRST_BYTES;
            open.busy_seal_at = 2 * EARLY_SEAL_FIRST_BYTES;
        }
        tracing::debug!(target: "strata::store", name, flush_ms = t0.elapsed().as_secs_f64() * 1e3, "flushed for a ref");
        let old = match old {
            Ok(Ok(o)) => o,
            // An unreadable old ref only costs its generation number, unless the name must be
            // new: then not knowing is a refusal.
            Ok(Err(e)) if must_be_new => return Err(e),
            _ => None,
        };
        if must_be_new && old.is_some() {
            return Err(StoreError::RefExists { name: name.into() });
        }
        r.generation = old.map(|o| o.generation + 1).unwrap_or(1);
        let key = format!("refs/{name}");
        inner.sh.backend.put(&key, &r.encode()).map_err(|e| {
            inner.sh.poison(&e);
            StoreError::Backend(e)
        })?;
        inner.sh.sync()?;
        // Only once the ref is durable: a copy never runs ahead of the backend.
        if let Some(c) = self.store.ref_copies() {
            c.put(name, &r);
        }
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let mut sessions = self.store.inner.sessions.lock();
        sessions.remove(&self.id);
        // The last writer is gone: do not keep spare pack buffers (up to ~140 MiB) in an idle
        // process such as `strata serve`.
        if sessions.is_empty() {
            self.store.inner.sh.spare_packs.lock().clear();
        }
    }
}

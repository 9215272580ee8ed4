//! The read plan: every page located, sorted by its place in the packs, and cut into reads
//! (see the parent module for why), and the first reads started before the stream.

use super::*;
use crate::memory::manifest::BlockMeta;
use crate::store::pack::PackEntry;

/// One compressed frame to read, with the pages (unique ids) it holds.
#[derive(Debug, Clone)]
pub(super) struct FramePlan {
    pub(super) off: u64,
    pub(super) len: u32,
    pub(super) raw_len: u32,
    pub(super) codec: Codec,
    pub(super) crc: u32,
    /// (offset in frame, unique-id index)
    pub(super) chunks: Vec<(u32, u32)>,
}

impl FramePlan {
    /// The frame at `off` described by `f`, holding page `u` at `in_frame`.
    pub(super) fn new(off: u64, f: &FrameMeta, in_frame: u32, u: u32) -> FramePlan {
        FramePlan {
            off,
            len: f.len,
            raw_len: f.raw_len,
            codec: f.codec,
            crc: f.crc,
            chunks: vec![(in_frame, u)],
        }
    }
}

/// What the index says about the frame holding a page.
#[derive(Debug, Clone, Copy)]
pub(super) struct FrameMeta {
    pub(super) len: u32,
    pub(super) raw_len: u32,
    pub(super) codec: Codec,
    pub(super) crc: u32,
    /// The chunk is a delta record, not a page.
    pub(super) delta: bool,
    /// The chunk is a run of [`RUN_PAGES`] pages (version 3).
    pub(super) run: bool,
}

/// Add unique page `u` (at `in_frame` in the frame at `off` of `pack`) to the plan's reads,
/// which arrive in pack and offset order: same frame as the last, or the last read extended
/// over a gap of up to 256 KiB while it stays within `read_bytes`, or a new read.
pub(super) fn add_to_jobs(
    jobs: &mut Vec<Job>,
    pack: PackId,
    off: u64,
    in_frame: u32,
    u: u32,
    f: &FrameMeta,
    read_bytes: u64,
) {
    if let Some(j) = jobs.last_mut() {
        if j.pack == pack {
            let last = j.frames.last_mut().expect("a job has a frame");
            if last.off == off {
                last.chunks.push((in_frame, u));
                return;
            }
        }
    }
    let frame = FramePlan::new(off, f, in_frame, u);
    let end = off + f.len as u64;
    match jobs.last_mut() {
        Some(j)
            if j.pack == pack
                && off >= j.end
                && off - j.end <= READ_GAP
                && end - j.start <= read_bytes =>
        {
            j.end = end;
            j.frames.push(frame);
        }
        _ => jobs.push(Job { pack, start: off, end, frames: vec![frame] }),
    }
}

/// Put the largest reads first and the smallest last (stable, so pack order within a size).
/// The pages of a read are decoded, verified and written only once all its bytes are in, so
/// whatever the last reads hold is work left after the last byte arrives: with 1 MiB reads
/// last, a 128 MiB restore spends ~30 ms after it (`bench save-restore --remote`).
pub(super) fn order_reads(jobs: &mut [Job]) {
    jobs.sort_by_key(|j| std::cmp::Reverse(j.end - j.start));
}

/// Largest gap between two frames of one read (see [`add_to_jobs`]).
pub(super) const READ_GAP: u64 = 256 << 10;

/// A pack's last read holds whatever is left after the full ones, often a few dozen KiB; with
/// one per pack (11-17 packs in a 128 MiB checkpoint) and the smallest reads last, a traced
/// 128 MiB restore spends its last ~27 ms on eleven such reads of 12-270 KB, four at a time,
/// each waiting a request's round trip: ~0.7 MB that the link moves in 6 ms. A last read
/// smaller than a quarter of the read size is folded into the read before it (same pack, gap
/// within [`READ_GAP`]), so reads grow to at most 1.25x the read size and the restore ends on
/// reads big enough to keep the link busy. Expects the reads in pack and offset order.
pub(super) fn fold_small_tails(jobs: Vec<Job>, read_bytes: u64) -> Vec<Job> {
    let mut out: Vec<Job> = Vec::with_capacity(jobs.len());
    let mut it = jobs.into_iter().peekable();
    while let Some(j) = it.next() {
        let last_of_pack = it.peek().is_none_or(|next| next.pack != j.pack);
        match out.last_mut() {
            Some(prev)
                if last_of_pack
                    && prev.pack == j.pack
                    && j.end - j.start < read_bytes / 4
                    && j.start >= prev.end
                    && j.start - prev.end <= READ_GAP =>
            {
                prev.end = j.end;
                prev.frames.extend(j.frames);
            }
            _ => out.push(j),
        }
    }
    out
}

/// One read: a range of a pack covering several frames.
#[derive(Debug, Clone)]
pub(super) struct Job {
    pub(super) pack: PackId,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) frames: Vec<FramePlan>,
}

/// Default largest read (see [`RestoreOptions::read_bytes`]).
pub const DEFAULT_READ_BYTES: u64 = 2 << 20;

/// Reads in flight while restoring. Reads share the link, so reads started together also end
/// together: with many in flight the link delivers nothing decodable until a whole wave ends,
/// and the last wave's decoding is left for after the last byte. A few keep the link busy across
/// one read's end and the next one's first byte.
pub const FETCHERS: usize = 4;
/// Smallest planned read (a request's fixed cost stays small against its transfer).
pub(crate) const MIN_READ: u64 = 1 << 20;
/// A checkpoint is cut into at least this many reads per fetcher (up to `read_bytes` each), so
/// that the last reads, whose decoding cannot overlap the transfer, are a small part of it.
pub(super) const READS_PER_FETCHER: u64 = 8;

/// Size of the planned reads for `stored` bytes of frames: small checkpoints get smaller reads
/// so decoding starts early and little is left after the last byte arrives; large ones the
/// full `max`.
pub fn read_size(stored: u64, max: u64) -> u64 {
    (stored / (FETCHERS as u64 * READS_PER_FETCHER)).clamp(MIN_READ.min(max), max.max(1))
}

/// What a restore needs in memory: maps, tail, and the read plan.
pub(super) struct Plan {
    /// Unique page ids.
    pub(super) uids: Vec<ChunkId>,
    /// Per unique id: the page's slot in a run chunk (checkpoint format version 3; `uids`
    /// then holds the run's id, and the page is the chunk's `slot`-th 4 KiB), or
    /// [`NOT_A_RUN`] for a page chunk or a delta record.
    pub(super) slots: Vec<u8>,
    /// For each unique id, the pages using it: range into `refs`.
    pub(super) ref_ranges: Vec<(u32, u32)>,
    /// (block, page) sorted by unique id.
    pub(super) refs: Vec<(u32, u32)>,
    pub(super) zeros: Vec<(u32, u32)>,
    pub(super) jobs: Vec<Job>,
    /// The first jobs' reads, started as soon as the jobs were planned (see [`prefetch`]).
    pub(super) early: Vec<parking_lot::Mutex<Option<Early>>>,
    /// Delta pages (unique-id indexes), a few dozen per job, ordered by their base's place.
    pub(super) delta_jobs: Vec<Vec<u32>>,
    pub(super) tail: Vec<u8>,
    /// When planning began (read timings in the trace are relative to it).
    pub(super) t0: Instant,
}

/// [`Plan::slots`] of a page that is a chunk of its own.
pub(super) const NOT_A_RUN: u8 = u8::MAX;

/// A read started before the stream: its thread returns the bytes.
pub(super) type Early = std::thread::JoinHandle<Result<Vec<u8>, crate::backend::BackendError>>;

/// Bytes the early reads cover: past the first [`FETCHERS`] jobs, more start (up to twice as
/// many) until they reach this, so the link stays busy until the fetchers take over.
pub(super) const PREFETCH_BYTES: u64 = 3 << 20;

/// Start the reads of the first jobs now, on threads of their own: the rest of the plan, QEMU's
/// `migrate-incoming` and the connection take up to ~20 ms of a 128 MiB restore over 1 Gbit/s
/// (`bench save-restore --remote`), in which the link would otherwise idle. A plan that then
/// fails drops the handles; the threads end with their reads.
pub(super) fn prefetch(store: &Store, jobs: &[Job]) -> Vec<parking_lot::Mutex<Option<Early>>> {
    let mut bytes = 0u64;
    let n = jobs
        .iter()
        .take(2 * FETCHERS)
        .take_while(|j| {
            let take = bytes < PREFETCH_BYTES;
            bytes += j.end - j.start;
            take
        })
        .count()
        .max(FETCHERS.min(jobs.len()));
    jobs.iter()
        .take(n)
        .map(|j| {
            let (store, key, start, len) =
                (store.clone(), j.pack.pack_key(), j.start, j.end - j.start);
            let h = std::thread::Builder::new()
                .name("strata-prefetch".into())
                .spawn(move || store.backend().get_range(&key, start, len))
                .ok();
            parking_lot::Mutex::new(h)
        })
        .collect()
}

/// Plan a restore, in stages: start the tail and map reads and the head start (`head.rs`);
/// take the maps; start the head's second stage; list the pages; locate them in the packs;
/// group them into unique chunks and cut the reads; check the packs are there.
pub(super) fn make_plan(
    store: &Store,
    ckpt: &Checkpoint,
    read_bytes: u64,
) -> Result<Plan, MemError> {
    let t0 = Instant::now();
    let m = &ckpt.manifest;
    let name = &m.name;
    // The device-state tail is a few round trips of its own: fetched while the maps are.
    let tail = {
        let (store, ckpt) = (store.clone(), ckpt.clone());
        std::thread::spawn(move || load_tail(&store, &ckpt))
    };
    let hits0 = store.tree_cache().map_or(0, |c| c.counters().0);
    let remote_reader = start_map_reader(store, ckpt)?;
    // The first reads start now, from the first leaves only (`head.rs`).
    let head_read_bytes = read_size(m.stats.stored_bytes, read_bytes);
    let mut head = head_start(store, ckpt, head_read_bytes);
    let head_ms = t0.elapsed().as_secs_f64() * 1e3;
    let maps = match remote_reader {
        Some(r) => r.join().map_err(|_| MemError::Panic { what: "map reader" })?,
        None => read_maps(store, &ckpt.map_roots, MAP_READERS),
    };
    let mut slot_maps = maps.map_err(|(bi, source)| MemError::MetaDamaged {
        name: name.clone(),
        what: format!("page map of ramblock '{}'", m.blocks[bi].name),
        source,
    })?;
    let maps = std::mem::take(&mut slot_maps.ids);
    check_slot_tables(ckpt, &slot_maps)?;
    let maps_ms = t0.elapsed().as_secs_f64() * 1e3;
    let map_trees_local = store.tree_cache().map_or(0, |c| c.counters().0) - hits0;
    let head2_reads = extend_head(store, &mut head, &maps, head_read_bytes, m.stats.stored_bytes);
    let head2_ms = t0.elapsed().as_secs_f64() * 1e3;
    let listed = list_pages(name, &m.blocks, &ckpt.map_roots, maps)?;
    let mut head_jobs = head.jobs();
    let listed_ms = t0.elapsed().as_secs_f64() * 1e3;
    let located = locate_pages(store, ckpt, &listed, &slot_maps)?;
    let looked_up_ms = t0.elapsed().as_secs_f64() * 1e3;
    let read_bytes = read_size(frame_bytes(&located), read_bytes);
    let grouped = group_reads(
        located,
        listed.ids,
        &listed.pages,
        &slot_maps,
        &head,
        &mut head_jobs,
        read_bytes,
    );
    let Grouped { uids, slots, ref_ranges, refs, deltas, jobs: rest } = grouped;
    let mut rest = fold_small_tails(rest, read_bytes);
    order_reads(&mut rest);
    // The head start's reads come first (they are under way), then the rest, largest first.
    let (mut jobs, mut early) = head.into_parts(head_jobs);
    let head_reads = jobs.len();
    jobs.extend(rest);
    let located_ms = t0.elapsed().as_secs_f64() * 1e3;
    early.extend(prefetch(store, &jobs[head_reads..]));
    let packs = check_packs(store, ckpt, &jobs, &uids, &refs, &ref_ranges)?;
    let heads_ms = t0.elapsed().as_secs_f64() * 1e3;
    let delta_jobs = deltas.chunks(64).map(|c| c.to_vec()).collect();
    let tail = tail.join().map_err(|_| MemError::Panic { what: "tail reader" })??;
    tracing::debug!(
        target: TARGET,
        name,
        head_ms,
        head_reads,
        head2_reads,
        head2_ms,
        maps_ms,
        map_trees_local,
        listed_ms,
        looked_up_ms,
        located_ms,
        heads_ms,
        tail_ms = t0.elapsed().as_secs_f64() * 1e3,
        packs,
        reads = jobs.len(),
        read_bytes,
        "restore planned"
    );
    Ok(Plan {
        uids,
        slots,
        ref_ranges,
        refs,
        zeros: listed.zeros,
        jobs,
        early,
        delta_jobs,
        tail,
        t0,
    })
}

/// Start reading the maps on a thread of their own when they cross the link: they then have
/// the link to themselves until the head's reads begin (`head.rs`). Local ones (a local
/// backend, or this host's tree cache has them) are read after the head start, on the
/// planning thread: read beside it on a busy host they delay its reads, and QEMU connects
/// ~20-30 ms later. None: the maps are local.
#[allow(clippy::type_complexity)] // the reader's own result type, once
fn start_map_reader(
    store: &Store,
    ckpt: &Checkpoint,
) -> Result<
    Option<std::thread::JoinHandle<Result<super::maps::PageMaps, (usize, StoreError)>>>,
    MemError,
> {
    let local_maps = !store.backend().capabilities().network
        || ckpt.map_roots.first().is_none_or(|r| store.tree_cache().is_some_and(|c| c.contains(r)));
    if local_maps {
        return Ok(None);
    }
    let (store, roots) = (store.clone(), ckpt.map_roots.clone());
    std::thread::Builder::new()
        .name("strata-maps".into())
        .spawn(move || read_maps(&store, &roots, MAP_READERS))
        .map(Some)
        .map_err(|_| MemError::Panic { what: "map reader" })
}

/// Slot tables belong to version 4: one in an older checkpoint is damage.
fn check_slot_tables(ckpt: &Checkpoint, slot_maps: &super::maps::PageMaps) -> Result<(), MemError> {
    let m = &ckpt.manifest;
    if m.version >= 4 {
        return Ok(());
    }
    match slot_maps.slots.iter().position(|s| !s.is_empty()) {
        None => Ok(()),
        Some(bi) => Err(MemError::MetaDamaged {
            name: m.name.clone(),
            what: format!("page map of ramblock '{}'", m.blocks[bi].name),
            source: StoreError::Corrupt {
                id: ckpt.map_roots[bi],
                pack: PackId::default(),
                offset: 0,
                reason: format!("a slot table in a version-{} checkpoint", m.version),
            },
        }),
    }
}

/// Maps that came over the link: the head's second stage starts now (`head.rs`), on the
/// frames of the next [`HEAD_PAGES`] non-zero pages. Returns the reads it added.
fn extend_head(
    store: &Store,
    head: &mut Head,
    maps: &[Vec<ChunkId>],
    head_read_bytes: u64,
    stored_bytes: u64,
) -> usize {
    if !head.remote_maps || head.pages == 0 {
        return 0;
    }
    let next: Vec<ChunkId> = maps
        .iter()
        .flatten()
        .filter(|id| !id.is_zero())
        .skip(head.pages)
        .take(HEAD_PAGES)
        .copied()
        .collect();
    let mut frames = Vec::with_capacity(next.len());
    store.locate_many(&next, |_, hit| {
        if let Some((pack, e)) = hit {
            if e.kind == ChunkKind::Data {
                frames.push((pack, e.frame_off, e.frame_len));
            }
        }
    });
    head.extend(store, frames, head_read_bytes, HEAD_BYTES.min(stored_bytes / 4))
}

/// A checkpoint's pages, from its maps: the non-zero ones (id and `(block, page)`, in map
/// order) and the zero ones.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Listed {
    pub(super) ids: Vec<ChunkId>,
    pub(super) pages: Vec<(u32, u32)>,
    pub(super) zeros: Vec<(u32, u32)>,
}

/// List the pages of the maps, checking each map covers its ramblock.
pub(super) fn list_pages(
    name: &str,
    blocks: &[BlockMeta],
    roots: &[ChunkId],
    maps: Vec<Vec<ChunkId>>,
) -> Result<Listed, MemError> {
    let mut listed = Listed::default();
    for (bi, (b, (root, map))) in blocks.iter().zip(roots.iter().zip(maps)).enumerate() {
        if map.len() as u64 != b.pages() {
            return Err(MemError::MetaDamaged {
                name: name.into(),
                what: format!("page map of ramblock '{}'", b.name),
                source: StoreError::Corrupt {
                    id: *root,
                    pack: PackId::default(),
                    offset: 0,
                    reason: format!("{} pages mapped, {} expected", map.len(), b.pages()),
                },
            });
        }
        for (p, id) in map.into_iter().enumerate() {
            if id.is_zero() {
                listed.zeros.push((bi as u32, p as u32));
            } else {
                listed.ids.push(id);
                listed.pages.push((bi as u32, p as u32));
            }
        }
    }
    Ok(listed)
}

/// Every listed page's place: `hits` (pack, frame offset, offset in frame, page index) sorted
/// by place, and each page's frame (by page index).
pub(super) struct Located {
    pub(super) hits: Vec<(PackId, u64, u32, u32)>,
    pub(super) frames_of: Vec<FrameMeta>,
}

/// How the index entry `e` serves page number `page` (whose leaf's slot table names `slot`,
/// if any): its frame, the page's offset in the frame, and what is wrong with it, if
/// anything. A data chunk of 32 pages is a run (version 3 on): the page is its slot, the one
/// the slot table names (version 4) or its page number's.
pub(super) fn classify(
    e: &PackEntry,
    slot: Option<u8>,
    page: u32,
    runs_allowed: bool,
) -> (FrameMeta, u32, Option<String>) {
    let delta = e.kind == ChunkKind::Tree;
    let run = !delta && e.raw_len as usize == RUN_BYTES && runs_allowed;
    let mut wrong = None;
    if slot.is_some() && !run {
        wrong = Some("a slot table names a chunk that is not a run".to_string());
    }
    if !delta && !run && e.raw_len as usize != PAGE_SIZE {
        wrong.get_or_insert(format!("chunk is {} bytes, not a page", e.raw_len));
    }
    let slot = if run {
        slot.unwrap_or((page as usize % RUN_PAGES) as u8) as usize * PAGE_SIZE
    } else {
        0
    };
    let meta = FrameMeta {
        len: e.frame_len,
        raw_len: e.frame_raw_len,
        codec: e.codec,
        crc: e.frame_crc,
        delta,
        run,
    };
    (meta, e.off_in_frame + slot as u32, wrong)
}

/// Locate every page (one index lock per batch, not per page); a missing or malformed chunk
/// is reported now, before QEMU is touched. Sorting the pages by their place in the packs
/// groups the pages that share a chunk (one chunk, one place) and orders the reads, with no
/// sort by id.
fn locate_pages(
    store: &Store,
    ckpt: &Checkpoint,
    listed: &Listed,
    slot_maps: &super::maps::PageMaps,
) -> Result<Located, MemError> {
    let (ids, pages) = (&listed.ids, &listed.pages);
    let mut hits: Vec<(PackId, u64, u32, u32)> = Vec::with_capacity(ids.len());
    let mut frames_of: Vec<FrameMeta> = Vec::with_capacity(ids.len());
    let mut bad: Option<(usize, StoreError)> = None;
    let runs_allowed = ckpt.manifest.version >= 3;
    store.locate_many(ids, |i, hit| {
        let meta = match hit {
            None => {
                bad.get_or_insert((i, StoreError::ChunkMissing { id: ids[i] }));
                FrameMeta {
                    len: 0,
                    raw_len: 0,
                    codec: Codec::None,
                    crc: 0,
                    delta: false,
                    run: false,
                }
            }
            Some((pack, e)) => {
                let (bi, page) = pages[i];
                let slot = slot_maps.slot_override(bi as usize, page);
                let (meta, in_frame, wrong) = classify(e, slot, page, runs_allowed);
                if let Some(reason) = wrong {
                    let corrupt =
                        StoreError::Corrupt { id: ids[i], pack, offset: e.frame_off, reason };
                    bad.get_or_insert((i, corrupt));
                }
                hits.push((pack, e.frame_off, in_frame, i as u32));
                meta
            }
        };
        frames_of.push(meta);
    });
    if let Some((i, source)) = bad {
        let (block, offset) = page_of(ckpt, pages[i]);
        return Err(MemError::PageDamaged {
            name: ckpt.manifest.name.clone(),
            block,
            offset,
            id: ids[i],
            source,
        });
    }
    hits.sort_unstable();
    Ok(Located { hits, frames_of })
}

/// Stored bytes of the located pages' frames (each frame once, delta records aside), for the
/// read size.
pub(super) fn frame_bytes(located: &Located) -> u64 {
    let mut stored = 0u64;
    let mut last: Option<(PackId, u64)> = None;
    for &(pack, off, _, i) in &located.hits {
        let f = &located.frames_of[i as usize];
        if !f.delta && last != Some((pack, off)) {
            stored += f.len as u64;
            last = Some((pack, off));
        }
    }
    stored
}

/// The plan's unique chunks, the pages using each, the delta pages, and the reads not claimed
/// by the head start.
#[derive(Debug)]
pub(super) struct Grouped {
    pub(super) uids: Vec<ChunkId>,
    pub(super) slots: Vec<u8>,
    pub(super) ref_ranges: Vec<(u32, u32)>,
    pub(super) refs: Vec<(u32, u32)>,
    pub(super) deltas: Vec<u32>,
    pub(super) jobs: Vec<Job>,
}

/// Group the located pages into unique chunks (pages at one place with one id) and put each
/// chunk in a read: a head read that claims its frame, a delta job (a delta record is read,
/// its base read and both verified, and the rebuilt page verified, when streaming), or the
/// plan's reads of up to `read_bytes`.
pub(super) fn group_reads(
    located: Located,
    ids: Vec<ChunkId>,
    pages: &[(u32, u32)],
    slot_maps: &super::maps::PageMaps,
    head: &Head,
    head_jobs: &mut [Job],
    read_bytes: u64,
) -> Grouped {
    let Located { hits, frames_of } = located;
    let mut g = Grouped {
        uids: Vec::new(),
        slots: Vec::new(),
        ref_ranges: Vec::new(),
        refs: Vec::with_capacity(hits.len()),
        deltas: Vec::new(),
        jobs: Vec::new(),
    };
    let mut place: Option<(PackId, u64, u32)> = None;
    for (pack, off, in_frame, i) in hits {
        let i = i as usize;
        if place != Some((pack, off, in_frame)) || g.uids.last() != Some(&ids[i]) {
            place = Some((pack, off, in_frame));
            let u = g.uids.len() as u32;
            g.uids.push(ids[i]);
            let f = &frames_of[i];
            g.slots.push(if f.run {
                slot_maps.slot(pages[i].0 as usize, pages[i].1)
            } else {
                NOT_A_RUN
            });
            g.ref_ranges.push((g.refs.len() as u32, g.refs.len() as u32));
            if f.delta {
                g.deltas.push(u);
            } else if let Some(h) = head.claim(pack, off) {
                add_to_run(&mut head_jobs[h], off, in_frame, u, f);
            } else {
                add_to_jobs(&mut g.jobs, pack, off, in_frame, u, f, read_bytes);
            }
        }
        g.refs.push(pages[i]);
        g.ref_ranges.last_mut().expect("pushed").1 += 1;
    }
    g
}

/// A pack that vanished is reported now too (one HEAD per pack, not per page; concurrent), on
/// a local store: its index objects can outlive a pack file deleted by hand. A network store
/// knows only packs it listed (at open, or since) or wrote itself, and GC cannot run while it
/// is open (`docs/backends.md`), so there the HEADs are skipped: behind the early reads on the
/// link they keep QEMU waiting 11-30 ms of a 128 MiB restore. A pack deleted from the bucket
/// behind strata's back is still reported, by its read, with QEMU holding only the pages
/// before it (the stream is cut, never wrong). Returns the packs checked.
fn check_packs(
    store: &Store,
    ckpt: &Checkpoint,
    jobs: &[Job],
    uids: &[ChunkId],
    refs: &[(u32, u32)],
    ref_ranges: &[(u32, u32)],
) -> Result<usize, MemError> {
    let name = &ckpt.manifest.name;
    let mut packs: Vec<(PackId, u32)> = Vec::new();
    let mut checked: std::collections::HashSet<PackId> = std::collections::HashSet::new();
    for j in jobs.iter().filter(|_| !store.backend().capabilities().network) {
        if checked.insert(j.pack) {
            packs.push((j.pack, j.frames[0].chunks[0].1));
        }
    }
    let present =
        par_map(&packs, MAP_READERS, |(pack, _)| store.backend().head(&pack.pack_key())).map_err(
            |(_, e)| MemError::Store { op: "pack lookup", name: name.clone(), source: e.into() },
        )?;
    for ((_, u), present) in packs.iter().zip(present) {
        if present.is_none() {
            let id = uids[*u as usize];
            // GC may have just moved the chunks (then the index follows and reads fall back
            // to it); otherwise the pack is lost.
            if let Err(source) = store.get(&id) {
                let (block, offset) = page_of(ckpt, refs[ref_ranges[*u as usize].0 as usize]);
                return Err(MemError::PageDamaged {
                    name: name.clone(),
                    block,
                    offset,
                    id,
                    source,
                });
            }
        }
    }
    Ok(packs.len())
}

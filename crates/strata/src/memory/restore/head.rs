//! Head start: a restore's first reads begin before its plan is done.
//!
//! The plan locates every page of every ramblock before it knows its reads. For a 512 MiB
//! guest of distinct pages that takes ~125 ms (loading the maps, 115,000 index lookups,
//! sorting), in which the link would carry nothing: without a head start the restore takes
//! 1.03x `exec:zstd -1`'s time though it reads fewer bytes (`bench save-restore --remote
//! --workload random`).
//!
//! So before the full plan, [`head_start`] reads only the first page-map leaves (a root and a
//! few leaves: local copies, or a few small GETs), locates their pages, and starts reads of the
//! frames holding them, up to [`HEAD_BYTES`] in at most [`HEAD_READS`] runs of whole frames
//! (the same runs [`add_to_jobs`] would cut). The full plan then hands every frame that lies
//! inside one of those runs to that run's read ([`Head::claim`]), so no frame is read twice
//! and the runs' frames need not be known in advance, and puts those reads first.
//!
//! Best effort: a leaf that cannot be read or a page not in the index only shortens the head
//! (the full plan reports it). A plan that fails drops the handles; the threads end with
//! their reads, as [`prefetch`]'s do.
//!
//! On a host without the checkpoint's page maps (another host saved it; `bench save-restore
//! --remote --cold-maps`) every leaf is a GET: the leaves the head start needs (enough for
//! [`HEAD_PAGES`], at most [`HEAD_LEAVES`]) are then fetched together, not one after another.
//! And the maps cross the link beside the head's reads, so both end together, and the link
//! would then idle while the plan looks up every page and cuts its reads (~35-45 ms of a
//! 512 MiB restore). So there the head has a **second stage** ([`Head::extend`]): as soon
//! as the maps are in, the next [`HEAD_PAGES`] pages are located and up to [`HEAD_READS`] more
//! runs (another [`HEAD_BYTES`]) start, before the full plan's lookups. For that stage to
//! start while the first one's reads still fill the link, the plan reads the maps on a thread
//! of its own from its first moment, beside the head start.

use super::*;

/// Pages whose frames the head start locates: leaves are read until this many (4 full leaves,
/// 32 MiB of memory).
pub(super) const HEAD_PAGES: usize = 4 * LEAF_IDS;
/// Leaves read at most while looking for them (maps of mostly zero pages).
pub(super) const HEAD_LEAVES: usize = 8;
/// Bytes of reads started by the head start: at 1 Gbit/s, ~70 ms of link, about what a
/// 512 MiB plan took after it (then [`prefetch`]'s reads follow). A small checkpoint gets at
/// most a quarter of its stored bytes: reads sharing the link end together, and its stream
/// starts sooner.
pub(super) const HEAD_BYTES: u64 = 8 << 20;
/// Reads started by the head start at most: one per fetcher, as the stream keeps in flight.
pub(super) const HEAD_READS: usize = FETCHERS;

/// A frame: its pack, offset and stored length.
type Frame = (PackId, u64, u32);

/// The runs of frames the head start is reading, sorted by pack and offset.
pub(super) struct Head {
    runs: Vec<(PackId, u64, u64)>,
    handles: Vec<Early>,
    /// Non-zero pages (from the first) whose frames the head looked for.
    pub(super) pages: usize,
    /// The first map root was not local: the maps come over the link.
    pub(super) remote_maps: bool,
}

impl Head {
    pub(super) fn none() -> Head {
        Head { runs: Vec::new(), handles: Vec::new(), pages: 0, remote_maps: false }
    }

    /// Runs whose reads return nothing at once (tests of the plan's bookkeeping).
    #[cfg(test)]
    pub(super) fn with_runs(runs: Vec<(PackId, u64, u64)>) -> Head {
        let handles = runs.iter().map(|_| std::thread::spawn(|| Ok(Vec::new()))).collect();
        Head { runs, handles, pages: 0, remote_maps: false }
    }

    #[cfg(test)]
    pub(super) fn runs(&self) -> (&[(PackId, u64, u64)], usize) {
        (&self.runs, self.handles.len())
    }

    /// The second stage (module doc): start reads of runs covering those of `frames` that lie
    /// outside every run already started, at most `max_bytes` in [`HEAD_READS`] runs. Returns
    /// how many started.
    pub(super) fn extend(
        &mut self,
        store: &Store,
        frames: Vec<Frame>,
        read_bytes: u64,
        max_bytes: u64,
    ) -> usize {
        // Frames no run holds, grouped by the gap between started runs they lie in, so that no
        // new run spans a started one.
        let mut gaps: std::collections::BTreeMap<(PackId, usize), Vec<Frame>> = Default::default();
        for f in frames.into_iter().filter(|&(pack, off, _)| self.claim(pack, off).is_none()) {
            let k = self.runs.partition_point(|r| (r.0, r.1) <= (f.0, f.1));
            gaps.entry((f.0, k)).or_default().push(f);
        }
        let fresh: Vec<_> = gaps.into_values().flat_map(|g| runs_of(g, read_bytes)).collect();
        let picked = pick_runs(fresh, max_bytes);
        let mut started = 0;
        for &(pack, start, end) in &picked {
            let Some(h) = start_read(store, pack, start, end) else { break };
            let i = self.runs.partition_point(|r| *r < (pack, start, end));
            self.runs.insert(i, (pack, start, end));
            self.handles.insert(i, h);
            started += 1;
        }
        started
    }

    /// The run that holds the frame at `off` in `pack`, if any.
    pub(super) fn claim(&self, pack: PackId, off: u64) -> Option<usize> {
        let i = self.runs.partition_point(|r| (r.0, r.1) <= (pack, off));
        let r = self.runs.get(i.checked_sub(1)?)?;
        (r.0 == pack && off < r.2).then_some(i - 1)
    }

    /// An empty job per run, for the plan to fill with [`add_to_run`].
    pub(super) fn jobs(&self) -> Vec<Job> {
        self.runs
            .iter()
            .map(|&(pack, start, end)| Job { pack, start, end, frames: Vec::new() })
            .collect()
    }

    /// The filled jobs and their reads, first in the plan. A run the plan gave no frame to
    /// (impossible unless the maps changed under it) is dropped, its read with it.
    pub(super) fn into_parts(
        self,
        jobs: Vec<Job>,
    ) -> (Vec<Job>, Vec<parking_lot::Mutex<Option<Early>>>) {
        jobs.into_iter()
            .zip(self.handles)
            .filter(|(j, _)| !j.frames.is_empty())
            .map(|(j, h)| (j, parking_lot::Mutex::new(Some(h))))
            .unzip()
    }
}

/// Add page `u` (at `in_frame` in the frame at `off`) to a head run's job. Frames arrive in
/// offset order, so a page of the frame before it is the same frame.
pub(super) fn add_to_run(job: &mut Job, off: u64, in_frame: u32, u: u32, f: &FrameMeta) {
    if let Some(last) = job.frames.last_mut() {
        if last.off == off {
            last.chunks.push((in_frame, u));
            return;
        }
    }
    job.frames.push(FramePlan::new(off, f, in_frame, u));
}

/// A tree chunk from this host's copy or the store (kept for the full plan's map reads), and
/// whether it was local.
fn tree(store: &Store, id: &ChunkId) -> Option<(Tree, bool)> {
    let cache = store.tree_cache();
    let (raw, local) = match cache.and_then(|c| c.get(id)) {
        Some(r) => (r, true),
        None => {
            let r = store.get(id).ok()?;
            if let Some(c) = cache {
                c.put(id, &r);
            }
            (r, false)
        }
    };
    Tree::decode(&raw).ok().map(|t| (t, local))
}

/// The first non-zero page ids of the checkpoint's maps, in ramblock and page order, and
/// whether the first map root came from the backend. Local leaves are read one by one until
/// [`HEAD_PAGES`] are found; if the first root came from the backend, the first leaves that
/// could hold them are fetched together.
fn first_pages(store: &Store, ckpt: &Checkpoint) -> (Vec<ChunkId>, bool) {
    let Some((first, local)) = ckpt.map_roots.first().and_then(|r| tree(store, r)) else {
        return (Vec::new(), false);
    };
    let tops = std::iter::once(Some(first))
        .chain(ckpt.map_roots[1..].iter().map(|r| tree(store, r).map(|(t, _)| t)));
    let mut ids = Vec::new();
    if !local {
        let want = HEAD_PAGES.div_ceil(LEAF_IDS).min(HEAD_LEAVES);
        let mut leaves: Vec<ChunkId> = Vec::new();
        for top in tops.map_while(|t| t) {
            leaves.extend(top.children.iter().filter(|l| !l.is_zero()).take(want - leaves.len()));
            if leaves.len() == want {
                break;
            }
        }
        for t in par_map(&leaves, want, |leaf| tree(store, leaf).map(|(t, _)| t).ok_or(()))
            .unwrap_or_default()
        {
            ids.extend(t.children.iter().filter(|id| !id.is_zero()));
        }
        return (ids, true);
    }
    let mut leaves = 0;
    for top in tops.map_while(|t| t) {
        for leaf in top.children.iter().filter(|l| !l.is_zero()) {
            if leaves == HEAD_LEAVES || ids.len() >= HEAD_PAGES {
                return (ids, false);
            }
            leaves += 1;
            let Some((t, _)) = tree(store, leaf) else { return (ids, false) };
            ids.extend(t.children.iter().filter(|id| !id.is_zero()));
        }
    }
    (ids, false)
}

/// Runs of whole frames (sorted by pack and offset) covering `frames`, cut as
/// [`add_to_jobs`] cuts reads.
pub(super) fn runs_of(
    mut frames: Vec<(PackId, u64, u32)>,
    read_bytes: u64,
) -> Vec<(PackId, u64, u64)> {
    frames.sort_unstable();
    frames.dedup();
    let mut runs: Vec<(PackId, u64, u64)> = Vec::new();
    for (pack, off, len) in frames {
        let end = off + len as u64;
        match runs.last_mut() {
            Some(r)
                if r.0 == pack
                    && off >= r.2
                    && off - r.2 <= READ_GAP
                    && end - r.1 <= read_bytes =>
            {
                r.2 = end
            }
            _ => runs.push((pack, off, end)),
        }
    }
    runs
}

/// The runs to start: largest first while under `max_bytes` and [`HEAD_READS`], returned
/// sorted by pack and offset.
pub(super) fn pick_runs(
    mut runs: Vec<(PackId, u64, u64)>,
    max_bytes: u64,
) -> Vec<(PackId, u64, u64)> {
    runs.sort_by_key(|r| std::cmp::Reverse(r.2 - r.1));
    let mut bytes = 0;
    let mut picked: Vec<(PackId, u64, u64)> = runs
        .into_iter()
        .take(HEAD_READS)
        .take_while(|r| {
            let take = bytes < max_bytes;
            bytes += r.2 - r.1;
            take
        })
        .collect();
    picked.sort_unstable();
    picked
}

/// Locate the first pages and start reading the frames that hold them (see the module doc).
pub(super) fn head_start(store: &Store, ckpt: &Checkpoint, read_bytes: u64) -> Head {
    let t0 = std::time::Instant::now();
    let (ids, remote_maps) = first_pages(store, ckpt);
    let leaves_ms = t0.elapsed().as_secs_f64() * 1e3;
    if ids.is_empty() {
        return Head::none();
    }
    let mut frames = Vec::with_capacity(ids.len());
    store.locate_many(&ids, |_, hit| {
        if let Some((pack, e)) = hit {
            if e.kind == ChunkKind::Data {
                frames.push((pack, e.frame_off, e.frame_len));
            }
        }
    });
    let located_ms = t0.elapsed().as_secs_f64() * 1e3;
    let max = HEAD_BYTES.min(ckpt.manifest.stats.stored_bytes / 4);
    let runs = pick_runs(runs_of(frames, read_bytes), max);
    let handles = runs
        .iter()
        .filter_map(|&(pack, start, end)| start_read(store, pack, start, end))
        .collect::<Vec<_>>();
    tracing::debug!(target: TARGET, remote_maps, leaves_ms, located_ms, started_ms = t0.elapsed().as_secs_f64() * 1e3, pages = ids.len(), "restore head start");
    if handles.len() != runs.len() {
        // No thread for some run: no head start (the handles' reads just end).
        return Head::none();
    }
    Head { runs, handles, pages: ids.len(), remote_maps }
}

/// Read `[start, end)` of `pack` on a thread of its own.
fn start_read(store: &Store, pack: PackId, start: u64, end: u64) -> Option<Early> {
    let (store, key) = (store.clone(), pack.pack_key());
    std::thread::Builder::new()
        .name("strata-head".into())
        .spawn(move || store.backend().get_range(&key, start, end - start))
        .ok()
}

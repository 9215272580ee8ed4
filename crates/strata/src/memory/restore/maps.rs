//! Reading page maps and other small chunks while planning: concurrent ranged reads of
//! neighbouring chunks, verified chunk by chunk.

use super::*;

/// Concurrent reads while planning: page-map leaves and pack checks are small objects, so on
/// a remote backend their cost is round trips, not bytes (a 2 GiB guest's maps are 256 leaves).
pub(crate) const MAP_READERS: usize = 16;

/// Apply `f` to every item on up to `threads` threads; results in input order, or the first
/// error (with the index of the item that failed).
pub(crate) fn par_map<T: Sync, R: Send, E: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, (usize, E)> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let out: parking_lot::Mutex<Vec<Option<R>>> =
        parking_lot::Mutex::new((0..items.len()).map(|_| None).collect());
    let failed: parking_lot::Mutex<Option<(usize, E)>> = parking_lot::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= items.len() || stop.load(Ordering::Relaxed) {
                    return;
                }
                match f(&items[i]) {
                    Ok(r) => out.lock()[i] = Some(r),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        let mut g = failed.lock();
                        if g.as_ref().is_none_or(|(j, _)| i < *j) {
                            *g = Some((i, e));
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    Ok(out.into_inner().into_iter().map(|r| r.expect("every item mapped")).collect())
}

/// Largest ranged GET [`get_chunks`] makes: larger groups are split so their reads run side by
/// side (a 2 GiB guest's 256 map leaves are 16 MiB).
pub(super) const CHUNKS_SPAN: u64 = 2 << 20;

/// Read small chunks (page-map trees) with one ranged GET per run of neighbouring frames in a
/// pack instead of one per chunk: the commit writes a checkpoint's map leaves side by side, so
/// a 128 MiB guest's 16 leaves are one request, not 16 (on a remote backend each request costs
/// the server a request's work, and the plan waits for the slowest). Every chunk is verified
/// as [`Store::get`] does; a chunk not in the index, or a pack that is gone (GC moved it), is
/// read through `Store::get`. Errors carry the index of the failing chunk.
pub(crate) fn get_chunks(
    store: &Store,
    ids: &[ChunkId],
    threads: usize,
) -> Result<Vec<Vec<u8>>, (usize, StoreError)> {
    use crate::store::pack::PackEntry;
    let mut located: Vec<(PackId, u64, usize, PackEntry)> = Vec::with_capacity(ids.len());
    let mut loose: Vec<usize> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        match store.locate(id) {
            Some((pack, e)) => located.push((pack, e.frame_off, i, e)),
            None => loose.push(i),
        }
    }
    located.sort_unstable_by_key(|l| (l.0, l.1));
    // Runs of frames of one pack, each at most CHUNKS_SPAN long.
    let mut spans: Vec<(PackId, Vec<(usize, PackEntry)>)> = Vec::new();
    for (pack, off, i, e) in located {
        let fits = spans.last().is_some_and(|(p, run)| {
            *p == pack
                && run
                    .first()
                    .is_some_and(|f| off + e.frame_len as u64 - f.1.frame_off <= CHUNKS_SPAN)
        });
        if !fits {
            spans.push((pack, Vec::new()));
        }
        spans.last_mut().expect("pushed").1.push((i, e));
    }
    let get = |i: usize| store.get(&ids[i]).map(|d| (i, d)).map_err(|e| (i, e));
    let items: Vec<usize> = (0..spans.len() + loose.len()).collect();
    type Got = Result<Vec<(usize, Vec<u8>)>, (usize, StoreError)>;
    let got = par_map(&items, threads, |&k| -> Got {
        let Some((pack, run)) = spans.get(k) else {
            return get(loose[k - spans.len()]).map(|r| vec![r]);
        };
        let start = run[0].1.frame_off;
        let end =
            run.iter().map(|(_, e)| e.frame_off + e.frame_len as u64).max().expect("non-empty run");
        match store.backend().get_range(&pack.pack_key(), start, end - start) {
            Ok(bytes) => run
                .iter()
                .map(|(i, e)| {
                    let a = (e.frame_off - start) as usize;
                    let frame = bytes.get(a..a + e.frame_len as usize).ok_or_else(|| {
                        (
                            *i,
                            StoreError::Corrupt {
                                id: e.id,
                                pack: *pack,
                                offset: e.frame_off,
                                reason: "short read".into(),
                            },
                        )
                    })?;
                    crate::store::decode_chunk(frame, e, *pack)
                        .map(|d| (*i, d))
                        .map_err(|err| (*i, err))
                })
                .collect(),
            // GC moved the pack since the index was read: Store::get follows the move.
            Err(err) if err.is_not_found() => run.iter().map(|(i, _)| get(*i)).collect(),
            Err(err) => Err((run[0].0, StoreError::Backend(err))),
        }
    })
    .map_err(|(_, e)| e)?;
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); ids.len()];
    for (i, d) in got.into_iter().flatten() {
        out[i] = d;
    }
    Ok(out)
}

/// Read every ramblock's page map (the same trees `store::map::read_map` reads), fetching the
/// roots, then the leaves of all maps, a few ranged GETs at a time ([`get_chunks`]). Errors
/// carry the ramblock's index. Also returns each ramblock's slot overrides, `(page, slot)` in
/// page order, from the leaves' slot tables (version 4, `manifest::SlotTable`).
pub(crate) fn read_maps(
    store: &Store,
    roots: &[ChunkId],
    threads: usize,
) -> Result<PageMaps, (usize, StoreError)> {
    let decode = |id: &ChunkId, raw: &[u8]| -> Result<Tree, StoreError> {
        Tree::decode(raw)
            .map_err(|source| StoreError::Format { key: format!("chunk {id}"), source })
    };
    // Trees this host has a copy of (it saved or restored the checkpoint before) are not
    // fetched; fetched ones are kept for next time.
    let cache = store.tree_cache();
    // Trees fetched from the backend, to be copied to the tree cache once the maps are whole.
    let mut fetched_trees: Vec<(ChunkId, Vec<u8>)> = Vec::new();
    let mut decode_all = |ids: &[ChunkId]| -> Result<Vec<Tree>, (usize, StoreError)> {
        let mut raw: Vec<Option<Vec<u8>>> =
            ids.iter().map(|id| cache.and_then(|c| c.get(id))).collect();
        let missing: Vec<usize> = (0..ids.len()).filter(|&i| raw[i].is_none()).collect();
        if !missing.is_empty() {
            let want: Vec<ChunkId> = missing.iter().map(|&i| ids[i]).collect();
            let got = get_chunks(store, &want, threads).map_err(|(k, e)| (missing[k], e))?;
            for (&i, r) in missing.iter().zip(got) {
                raw[i] = Some(r);
            }
        }
        let trees = ids
            .iter()
            .zip(&raw)
            .enumerate()
            .map(|(i, (id, r))| {
                decode(id, r.as_deref().expect("every tree read")).map_err(|e| (i, e))
            })
            .collect::<Result<Vec<Tree>, _>>()?;
        if cache.is_some() {
            fetched_trees
                .extend(missing.iter().map(|&i| (ids[i], raw[i].take().expect("every tree read"))));
        }
        Ok(trees)
    };
    let tops = decode_all(roots)?;
    let mut counts = Vec::with_capacity(tops.len());
    let mut leaves: Vec<(usize, ChunkId)> = Vec::new();
    for (bi, t) in tops.iter().enumerate() {
        let n = t
            .payload
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(|b| u64::from_le_bytes(b) as usize)
            .ok_or_else(|| {
                (
                    bi,
                    StoreError::Format {
                        key: format!("chunk {}", roots[bi]),
                        source: crate::store::format::FormatError::Malformed {
                            what: "block map root",
                            detail: "no block count".into(),
                        },
                    },
                )
            })?;
        counts.push(n);
        leaves.extend(t.children.iter().filter(|l| !l.is_zero()).map(|l| (bi, *l)));
    }
    let leaf_ids: Vec<ChunkId> = leaves.iter().map(|l| l.1).collect();
    let fetched = decode_all(&leaf_ids).map_err(|(i, e)| (leaves[i].0, e))?;
    let mut fetched = fetched.into_iter();
    let mut maps = Vec::with_capacity(tops.len());
    let mut slots = Vec::with_capacity(tops.len());
    for (bi, (t, n)) in tops.iter().zip(counts).enumerate() {
        let mut out = Vec::with_capacity(n);
        let mut over: Vec<(u32, u8)> = Vec::new();
        for leaf in &t.children {
            let want = n.saturating_sub(out.len()).min(LEAF_IDS);
            if leaf.is_zero() {
                out.extend(std::iter::repeat_n(ChunkId::ZERO, want));
            } else {
                let lt = fetched.next().expect("one fetched tree per non-zero leaf");
                if !lt.payload.is_empty() {
                    let table =
                        SlotTable::parse(&lt.payload, lt.children.len()).map_err(|detail| {
                            (
                                bi,
                                StoreError::Format {
                                    key: format!("chunk {leaf}"),
                                    source: crate::store::format::FormatError::Malformed {
                                        what: "page map slot table",
                                        detail: detail.to_string(),
                                    },
                                },
                            )
                        })?;
                    let at = out.len() as u32;
                    over.extend(
                        table
                            .0
                            .iter()
                            .filter(|&&(i, _)| (i as usize) < want)
                            .map(|&(i, slot)| (at + i as u32, slot)),
                    );
                }
                out.extend(lt.children.into_iter().take(want));
            }
        }
        out.resize(n, ChunkId::ZERO);
        maps.push(out);
        slots.push(over);
    }
    // The copies are written on a thread of their own, after the maps are whole: on a host
    // without the maps the plan waits on them, and writing a 512 MiB guest's 62 leaves one file
    // at a time takes ~12 ms. Best effort, as the cache is: a copy not
    // written only costs the next restore here a fetch.
    if !fetched_trees.is_empty() {
        let store = store.clone();
        let _ = std::thread::Builder::new().name("strata-tree-copy".into()).spawn(move || {
            if let Some(c) = store.tree_cache() {
                for (id, raw) in &fetched_trees {
                    c.put(id, raw);
                }
            }
        });
    }
    Ok(PageMaps { ids: maps, slots })
}

/// Every ramblock's page map as [`read_maps`] reads it.
#[derive(Debug, Default)]
pub(crate) struct PageMaps {
    /// Per ramblock, per page: the map's entry.
    pub ids: Vec<Vec<ChunkId>>,
    /// Per ramblock: `(page, slot)` of the entries whose run slot a leaf's slot table names,
    /// in page order; every other run entry is slot `page mod RUN_PAGES`.
    pub slots: Vec<Vec<(u32, u8)>>,
}

impl PageMaps {
    /// The slot a leaf's slot table names for page `page` of ramblock `block`, if any.
    pub fn slot_override(&self, block: usize, page: u32) -> Option<u8> {
        let over = self.slots.get(block)?;
        over.binary_search_by_key(&page, |&(p, _)| p).ok().map(|k| over[k].1)
    }

    /// The run slot of page `page` of ramblock `block`, if its entry names a run chunk.
    pub fn slot(&self, block: usize, page: u32) -> u8 {
        self.slot_override(block, page).unwrap_or((page as usize % RUN_PAGES) as u8)
    }
}

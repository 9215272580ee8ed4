//! The save's stages after the stream (step 5 of the module's sequence): check every page
//! arrived, write the page maps and the tail, build the manifest, commit the ref under the
//! lease, and report. Nothing is visible before the ref; a failure leaves garbage for GC.

use std::thread::JoinHandle;

use super::counts::PageCounts;
use super::migrate::Timing;
use super::setup::Source;
use super::*;
use crate::memory::delta::DeltaOutcome;
use crate::memory::ingest::IngestCounters;
use crate::memory::stream::StreamLayout;

/// Fail a save whose stream left a page of some ramblock uncovered.
pub(super) fn check_complete(name: &str, ingested: &Ingested) -> Result<(), MemError> {
    match ingested.missing.iter().enumerate().find(|(_, m)| m.0 > 0) {
        Some((bi, &(missing, first))) => Err(MemError::Incomplete {
            name: name.into(),
            block: ingested.info.layout.blocks[bi].name.clone(),
            offset: first * 4096,
            missing,
        }),
        None => Ok(()),
    }
}

/// What `write_maps` put in the store and counted.
pub(super) struct Written {
    pub(super) map_roots: Vec<ChunkId>,
    pub(super) tail_root: ChunkId,
    pub(super) blocks: Vec<BlockMeta>,
    pub(super) counts: PageCounts,
    /// The map trees' encodings, for this host's tree cache (empty without one).
    pub(super) kept: Vec<(ChunkId, Vec<u8>)>,
}

/// The slot table of page-map leaf `leaf`: the entries of `over` (a block's `(page, slot)`
/// pairs, in page order) whose page falls in the leaf, numbered within it.
pub(super) fn leaf_slot_table(over: &[(u32, u8)], leaf: usize) -> SlotTable {
    let (lo, hi) = ((leaf * LEAF_IDS) as u32, ((leaf + 1) * LEAF_IDS) as u32);
    let a = over.partition_point(|&(p, _)| p < lo);
    let b = over.partition_point(|&(p, _)| p < hi);
    SlotTable(over[a..b].iter().map(|&(p, slot)| ((p - lo) as u16, slot)).collect())
}

/// Write the page maps and the device-state tail, and count the pages. The maps and the tail
/// are written on two helper threads while this one counts pages; all three are CPU work on
/// a host whose link is still busy with the last data packs, so they overlap instead of
/// adding up (4-8 ms in series for a 128 MiB guest).
pub(super) fn write_maps(
    store: &Store,
    ses: &Session,
    name: &str,
    ingested: &Ingested,
) -> Result<Written, MemError> {
    let mut kept: Vec<(ChunkId, Vec<u8>)> = Vec::new();
    let keeping = store.tree_cache().is_some();
    let tail = &ingested.info.tail;
    let layout = &ingested.info.layout;
    let (map_roots, tail_root, blocks, counts) = std::thread::scope(|s| {
        let maps = &ingested.maps;
        let slot_tables = &ingested.slots;
        let kept = &mut kept;
        let writer = s.spawn(move || -> Result<(Vec<ChunkId>, f64), MemError> {
            let t = Instant::now();
            let roots = maps
                .iter()
                .enumerate()
                .map(|(bi, ids)| {
                    // This host keeps a copy, so restoring here needs no map from the link:
                    // collected here, written to the tree cache beside the commit.
                    let mut keep = |id: ChunkId, raw: Vec<u8>| {
                        if keeping {
                            kept.push((id, raw))
                        }
                    };
                    // Each leaf's slot table (version 4): its pages' entries, by index.
                    let over = slot_tables.get(bi).map(Vec::as_slice).unwrap_or_default();
                    let mut payload = |leaf: usize| leaf_slot_table(over, leaf).encode();
                    write_map_payloads(ses, ids, &mut payload, &mut keep)
                        .map_err(MemError::store("page map write", name))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((roots, t.elapsed().as_secs_f64() * 1e3))
        });
        let tail_writer = s.spawn(move || -> Result<(ChunkId, f64), MemError> {
            let t = Instant::now();
            let mut pieces = Vec::with_capacity(tail.len().div_ceil(TAIL_CHUNK));
            for piece in tail.chunks(TAIL_CHUNK) {
                pieces.push(
                    ses.put_with(piece, ChunkKind::Data, Codec::Zstd(3))
                        .map_err(MemError::store("tail write", name))?,
                );
            }
            let root = ses
                .put_tree(&tail_tree(pieces, tail.len() as u64))
                .map_err(MemError::store("tail write", name))?;
            Ok((root, t.elapsed().as_secs_f64() * 1e3))
        });
        let t_count = Instant::now();
        let counts = count_pages(maps, &ingested.runs);
        let blocks = block_metas(layout, &counts);
        let count_ms = t_count.elapsed().as_secs_f64() * 1e3;
        let roots = writer.join().map_err(|_| MemError::Panic { what: "page map writer" });
        let tail_root = tail_writer.join().map_err(|_| MemError::Panic { what: "tail writer" });
        if let (Ok(Ok((_, maps_ms))), Ok(Ok((_, tail_ms)))) = (&roots, &tail_root) {
            tracing::debug!(target: TARGET, maps_ms, tail_ms, count_ms, "save: page maps and tail written");
        }
        (roots, tail_root, blocks, counts)
    });
    let map_roots = map_roots??.0;
    let tail_root = tail_root??.0;
    Ok(Written { map_roots, tail_root, blocks, counts, kept })
}

/// The manifest's per-ramblock entries.
pub(super) fn block_metas(layout: &StreamLayout, counts: &PageCounts) -> Vec<BlockMeta> {
    layout
        .blocks
        .iter()
        .zip(&counts.per_block)
        .map(|(b, &(zero_pages, unique_pages))| BlockMeta {
            name: b.name.clone(),
            used_len: b.used_len,
            zero_pages,
            unique_pages,
        })
        .collect()
}

/// The oldest checkpoint format that holds the save: slot tables need version 4, run chunks
/// version 3; without either, older readers can still read it.
pub(super) fn manifest_version(slots: &[Vec<(u32, u8)>], run_pages: u64) -> u32 {
    if slots.iter().any(|t| !t.is_empty()) {
        VERSION_SLOTS
    } else if run_pages > 0 {
        VERSION_RUNS
    } else {
        VERSION_NO_RUNS
    }
}

/// Store bytes the save added: raw bytes new to the store, and their stored size.
pub(super) struct Added {
    pub(super) new_bytes: u64,
    pub(super) stored_bytes: u64,
}

/// The manifest's page and byte accounting. `total_ms` is filled in by the caller.
pub(super) fn save_stats(
    c: &IngestCounters,
    counts: &PageCounts,
    delta_pages: u64,
    logical_bytes: u64,
    added: &Added,
    downtime_ms: f64,
) -> SaveStats {
    let data_records = c.page_records - c.zero_content;
    SaveStats {
        logical_bytes,
        pages_sent: c.page_records + c.zero_records,
        zero_pages: counts.zero,
        data_pages: counts.data,
        unique_pages: counts.unique,
        pages_stored: c.new_chunks,
        pages_deduped: data_records.saturating_sub(c.new_chunks + delta_pages),
        new_bytes: added.new_bytes,
        stored_bytes: added.stored_bytes,
        downtime_ms,
        total_ms: 0.0,
    }
}

/// The manifest's record of the delta pages.
pub(super) fn delta_meta(d: &DeltaOutcome) -> DeltaMeta {
    DeltaMeta {
        base: d.base.clone(),
        pages: d.pages,
        bytes: d.bytes,
        records: d.records,
        attempts: d.attempts,
        skipped_batches: d.skipped_batches,
    }
}

/// Everything the manifest is built from besides the stream.
pub(super) struct ManifestInputs<'a> {
    pub(super) name: &'a str,
    pub(super) mode: Mode,
    pub(super) source: Source,
    pub(super) codec: CodecReport,
    pub(super) stats: SaveStats,
    pub(super) delta: Option<DeltaMeta>,
}

/// The checkpoint's manifest.
pub(super) fn build_manifest(
    inputs: ManifestInputs<'_>,
    ingested: &Ingested,
    written: &Written,
) -> Manifest {
    let layout = &ingested.info.layout;
    let tail = &ingested.info.tail;
    let source = inputs.source;
    Manifest {
        format: FORMAT.into(),
        version: manifest_version(&ingested.slots, written.counts.run_pages),
        name: inputs.name.into(),
        created_unix: now_unix(),
        mode: inputs.mode,
        qemu: QemuInfo {
            version: source.version.to_string(),
            package: source.version.package.clone(),
            machine_type: source.machine,
            cmdline: source.cmdline,
        },
        stream: StreamMeta {
            file_version: layout.version,
            machine_type: layout.machine_type.clone(),
            config_subsections: hex::encode(&layout.config_subsections),
            ram_section: layout.ram_section.clone(),
            bytes: ingested.info.stats.bytes,
            background_snapshot: ingested.info.background_snapshot,
            vmdesc_devices: ingested.info.vmdesc_devices as u64,
        },
        blocks: written.blocks.clone(),
        tail: TailMeta { len: tail.len() as u64, blake3: blake3::hash(tail).to_hex().to_string() },
        codec: inputs.codec,
        stats: inputs.stats,
        delta: inputs.delta,
        disks: Vec::new(),
    }
}

/// Write the tree cache's copies (one file per tree: ~8 ms for a 128 MiB guest's 31) on a
/// helper thread while the commit waits on the link; joined before the save returns, so a
/// restore on this host right after finds them. Best effort, as the cache is.
pub(super) fn copy_trees(store: &Store, kept: Vec<(ChunkId, Vec<u8>)>) -> Option<JoinHandle<()>> {
    if kept.is_empty() {
        return None;
    }
    let store = store.clone();
    std::thread::Builder::new()
        .name("strata-tree-copy".into())
        .spawn(move || {
            if let Some(c) = store.tree_cache() {
                for (id, raw) in &kept {
                    c.put(id, raw);
                }
            }
        })
        .ok()
}

/// Wait for the lease, then write the ref. Without --replace the name must still be free:
/// checked at the start, and again by the commit, under the lease, while the last packs
/// flush.
pub(super) fn commit_ref(
    ses: &Session,
    lease: &mut PendingLease,
    rname: &str,
    name: &str,
    ckpt: &Checkpoint,
    replace: bool,
) -> Result<Option<crate::store::lease::LeaseGuard>, MemError> {
    let lease = lease.wait().map_err(|e| match e {
        Some(e) => MemError::store("lease", name)(e),
        None => MemError::Panic { what: "lease" },
    })?;
    let committed = if replace {
        ses.commit_ref(rname, ckpt.to_ref())
    } else {
        ses.commit_new_ref(rname, ckpt.to_ref())
    };
    committed.map_err(|e| match e {
        crate::store::StoreError::RefExists { .. } => MemError::Exists { name: name.into() },
        e => MemError::store("commit", name)(e),
    })?;
    Ok(lease)
}

/// Times of the save's stages, ms, for the report.
pub(super) struct Clock {
    pub(super) total_ms: f64,
    pub(super) commit_ms: f64,
    pub(super) maps_ms: f64,
    pub(super) commit_ref_ms: f64,
}

/// The save's summary.
pub(super) fn report(
    ckpt: &Checkpoint,
    opts: &SaveOptions,
    vm_status: String,
    ingested: &Ingested,
    timing: &Timing,
    clock: Clock,
) -> SaveReport {
    let m = &ckpt.manifest;
    let (new_bytes, stored_bytes) = (m.stats.new_bytes, m.stats.stored_bytes);
    let logical = m.stats.logical_bytes;
    SaveReport {
        name: m.name.clone(),
        mode: opts.mode,
        vm_status,
        downtime_ms: timing.downtime_ms,
        pause_ms: timing.pause_ms,
        total_ms: clock.total_ms,
        migrate_ms: timing.migrate_ms,
        commit_ms: clock.commit_ms,
        logical_bytes: logical,
        stream_bytes: m.stream.bytes,
        new_bytes,
        stored_bytes,
        dedup_ratio: (m.stats.data_pages * 4096) as f64 / new_bytes.max(1) as f64,
        compression_ratio: new_bytes as f64 / stored_bytes.max(1) as f64,
        reduction: logical as f64 / stored_bytes.max(1) as f64,
        pages_sent: m.stats.pages_sent,
        pages_stored: m.stats.pages_stored,
        pages_deduped: m.stats.pages_deduped,
        zero_pages: m.stats.zero_pages,
        unique_pages: m.stats.unique_pages,
        codec: m.codec.clone(),
        delta: m.delta.clone(),
        delta_reads: ingested.delta.as_ref().map(|d| d.reads.clone()),
        run_table: opts.ingest.compressible_runs.then_some(ingested.run_table),
        stages: SaveStages {
            setup_ms: timing.setup_ms,
            stream_ms: timing.migrate_ms,
            drain_ms: ingested.drain_ms,
            parse_cpu_ms: ingested.parse_cpu_ms,
            pool_cpu_ms: ingested.pool_cpu_ms,
            waits: ingested.waits.clone(),
            maps_ms: clock.maps_ms,
            commit_ref_ms: clock.commit_ref_ms,
        },
    }
}

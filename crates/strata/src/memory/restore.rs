//! `vm restore`: check the target QEMU against the checkpoint, then generate a migration stream
//! from the store straight into QEMU's `migrate-incoming` socket.
//!
//! Shape, and why:
//! * **Refuse before streaming.** The target must be waiting (`-incoming defer`, status
//!   `inmigrate`), with the checkpoint's machine type and ramblock list (names and used
//!   lengths, from HMP `info ramblock`): a mismatch would make QEMU abort halfway and exit.
//!   Every page's chunk is looked up in the index before the first byte is sent, so a missing
//!   chunk is reported with its checkpoint, ramblock and page while QEMU is still untouched.
//!   A delta record (`delta.rs`) is located like a page; its base page is read (and found
//!   missing, if it is) by the worker that rebuilds it, so a lost base aborts the stream.
//! * **Read by frame, not by page.** Pages were stored 16 to a compressed frame, so reading
//!   them one `get` at a time would decompress each frame 16 times and open the pack once per
//!   page. Instead the plan locates every page under a few holds of the index lock
//!   ([`Store::locate_many`]), sorts the pages by their place in the packs (which also groups
//!   the pages sharing a chunk: one chunk, one place), coalesces nearby frames into reads of
//!   1–8 MiB (sequential within a pack; smaller for a small checkpoint) and orders the reads
//!   largest first, so the last reads, whose decoding cannot overlap the transfer, are the
//!   smallest. [`FETCHERS`] threads keep that many reads in flight and hand the bytes to a
//!   pool of decoders, which check the frame CRC, decompress once, and verify every page
//!   against its BLAKE3 id. (Reads sharing a link end together: with a dozen in flight a small
//!   checkpoint's pages all arrived at the end, and their decoding came after the last byte.)
//!   Planning reads the page maps' leaves in ranged GETs of neighbouring leaves
//!   ([`get_chunks`]) and checks the packs [`MAP_READERS`] at a time: on a remote backend
//!   those are round trips, not bytes. The first reads start as soon as they are planned,
//!   while the packs are checked ([`prefetch`]).
//! * **Verified before sent.** The single writer thread only ever writes pages that a worker
//!   verified; the first damaged page aborts the stream with an error naming the checkpoint and
//!   page, so QEMU never receives bad memory (its load then fails and it exits).
//! * **Delta pages** are rebuilt by the same pool, 64 per job in the order of their records'
//!   places in the packs: record and base page verified against their ids, the rebuilt page
//!   against the page id in the record.
//! * **Any order.** QEMU's loader takes page records in any order, so pages are written as
//!   frames finish (a page id used at several addresses is written at each), zero pages as
//!   ZERO records first, the tail last. The generator checks that every page was written.
#![allow(clippy::result_large_err)] // a MemError is returned once per save or restore

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::error::MemError;
use super::manifest::{parse_tail_tree, ref_name, valid_name, Checkpoint};
use super::stream::{BlockIdx, GenerateStats, StreamWriter, PAGE_SIZE};
use crate::codec::Codec;
use crate::disk::map::LEAF_IDS;
use crate::id::{ChunkId, PackId};
use crate::page_hash::{as_page, hash_pages};
use crate::progress::{Progress, Unit};
use crate::qmp::{QmpClient, QmpError};
use crate::store::format::crc;
use crate::store::objects::Tree;
use crate::store::pack::ChunkKind;
use crate::store::{Store, StoreError};

const TARGET: &str = "strata::memory";

/// How to restore.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Decompressing/verifying threads (default: the host's cores). [`FETCHERS`] more threads
    /// read, whatever this is: reads wait on the link, not the CPU.
    pub workers: usize,
    /// `cont` the VM once loaded (like `virsh restore`; `--paused` turns it off).
    pub resume: bool,
    /// Largest single read from a pack (small checkpoints use smaller ones, see [`read_size`]).
    /// Reads run ahead of the target QEMU when it loads slower than the link delivers, and
    /// every read in flight or queued is memory this process holds meanwhile (~20 reads, and
    /// their decoded pages): with 8 MiB reads a 1 GiB restore held ~200 MB and its target
    /// QEMU spent 2.1 s of system time loading (4.6 s restores); with 2 MiB, 0.4 s (2.5 s)
    /// (`bench save-restore --remote`, session 13).
    pub read_bytes: u64,
    /// How long QEMU may take to finish loading after the last byte.
    pub load_timeout: Duration,
    /// Where the incoming socket is created (default: the system temp dir).
    pub socket_dir: Option<PathBuf>,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            workers: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            resume: true,
            read_bytes: DEFAULT_READ_BYTES,
            load_timeout: Duration::from_secs(120),
            socket_dir: None,
        }
    }
}

/// Summary of one restore.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RestoreReport {
    pub name: String,
    /// Loading maps, tail and planning reads (before the first byte to QEMU).
    pub plan_ms: f64,
    /// First to last byte written to QEMU.
    pub stream_ms: f64,
    /// Until QEMU reported the load completed.
    pub load_ms: f64,
    /// Everything, including the target checks and `cont`.
    pub total_ms: f64,
    pub stream_bytes: u64,
    pub pages: u64,
    pub zero_pages: u64,
    /// Distinct page chunks read and verified.
    pub chunks_verified: u64,
    /// Of those, pages rebuilt from a base page and a delta.
    pub delta_pages: u64,
    /// Bytes read from packs.
    pub bytes_read: u64,
    pub reads: u64,
    pub vm_status: String,
}

/// Read and check the checkpoint ref.
pub fn load_checkpoint(store: &Store, name: &str) -> Result<Checkpoint, MemError> {
    if !valid_name(name) {
        return Err(MemError::BadName { name: name.into() });
    }
    let r = store
        .get_ref(&ref_name(name))
        .map_err(MemError::store("lookup", name))?
        .ok_or_else(|| MemError::NotFound { name: name.into() })?;
    Checkpoint::from_ref(&r).map_err(|source| MemError::Manifest {
        name: name.into(),
        source,
    })
}

/// Compare the target QEMU with the checkpoint: machine type and ramblocks.
pub fn check_target(ckpt: &Checkpoint, qmp: &mut QmpClient) -> Result<(), MemError> {
    let m = &ckpt.manifest;
    let path = qmp.path().to_path_buf();
    let status = qmp.query_status().map_err(MemError::qmp("query-status", &path))?;
    if status.status != "inmigrate" {
        return Err(MemError::NotIncoming {
            path,
            status: status.status,
        });
    }
    let mismatch = |why: String| MemError::Mismatch {
        name: m.name.clone(),
        why,
    };
    let machine = qmp
        .machine_type()
        .map_err(MemError::qmp("qom-get machine type", &path))?;
    let want = m
        .stream
        .machine_type
        .clone()
        .unwrap_or_else(|| m.qemu.machine_type.clone());
    if machine != want {
        return Err(mismatch(format!(
            "machine type is '{machine}', the checkpoint needs '{want}' (-machine)"
        )));
    }
    let blocks = qmp.ram_blocks().map_err(MemError::qmp("info ramblock", &path))?;
    let mut problems = Vec::new();
    for b in &m.blocks {
        match blocks.iter().find(|t| t.name == b.name) {
            None => problems.push(format!("ramblock '{}' ({} KiB) is missing", b.name, b.used_len >> 10)),
            Some(t) if t.used != b.used_len => problems.push(format!(
                "ramblock '{}' is {} KiB, the checkpoint has {} KiB{}",
                b.name,
                t.used >> 10,
                b.used_len >> 10,
                if b.name.ends_with(".ram") { " (-m)" } else { "" }
            )),
            _ => {}
        }
    }
    for t in &blocks {
        if !m.blocks.iter().any(|b| b.name == t.name) {
            problems.push(format!(
                "the target has ramblock '{}' that the checkpoint lacks (a device not in the saved VM)",
                t.name
            ));
        }
    }
    if !problems.is_empty() {
        return Err(mismatch(problems.join("; ")));
    }
    Ok(())
}

/// One compressed frame to read, with the pages (unique ids) it holds.
#[derive(Debug, Clone)]
struct FramePlan {
    off: u64,
    len: u32,
    raw_len: u32,
    codec: Codec,
    crc: u32,
    /// (offset in frame, unique-id index)
    chunks: Vec<(u32, u32)>,
}

/// What the index says about the frame holding a page.
#[derive(Debug, Clone, Copy)]
struct FrameMeta {
    len: u32,
    raw_len: u32,
    codec: Codec,
    crc: u32,
    /// The chunk is a delta record, not a page.
    delta: bool,
}

/// Add unique page `u` (at `in_frame` in the frame at `off` of `pack`) to the plan's reads,
/// which arrive in pack and offset order: same frame as the last, or the last read extended
/// over a gap of up to 256 KiB while it stays within `read_bytes`, or a new read.
fn add_to_jobs(jobs: &mut Vec<Job>, pack: PackId, off: u64, in_frame: u32, u: u32, f: &FrameMeta, read_bytes: u64) {
    if let Some(j) = jobs.last_mut() {
        if j.pack == pack {
            let last = j.frames.last_mut().expect("a job has a frame");
            if last.off == off {
                last.chunks.push((in_frame, u));
                return;
            }
        }
    }
    let frame = FramePlan {
        off,
        len: f.len,
        raw_len: f.raw_len,
        codec: f.codec,
        crc: f.crc,
        chunks: vec![(in_frame, u)],
    };
    let end = off + f.len as u64;
    match jobs.last_mut() {
        Some(j) if j.pack == pack && off >= j.end && off - j.end <= READ_GAP && end - j.start <= read_bytes => {
            j.end = end;
            j.frames.push(frame);
        }
        _ => jobs.push(Job {
            pack,
            start: off,
            end,
            frames: vec![frame],
        }),
    }
}

/// Put the largest reads first and the smallest last (stable, so pack order within a size).
/// The pages of a read are decoded, verified and written only once all its bytes are in, so
/// whatever the last reads hold is work left after the last byte arrives: with 1 MiB reads
/// last, a 128 MiB restore spent ~30 ms after it (`bench save-restore --remote`, session 8).
fn order_reads(jobs: &mut [Job]) {
    jobs.sort_by_key(|j| std::cmp::Reverse(j.end - j.start));
}

/// Largest gap between two frames of one read (see [`add_to_jobs`]).
const READ_GAP: u64 = 256 << 10;

/// A pack's last read holds whatever is left after the full ones, often a few dozen KiB; with
/// one per pack (11-17 packs in a 128 MiB checkpoint) and the smallest reads last, a traced
/// 128 MiB restore spent its last ~27 ms on eleven such reads of 12-270 KB, four at a time,
/// each waiting a request's round trip: ~0.7 MB that the link moves in 6 ms. A last read
/// smaller than a quarter of the read size is folded into the read before it (same pack, gap
/// within [`READ_GAP`]), so reads grow to at most 1.25x the read size and the restore ends on
/// reads big enough to keep the link busy. Expects the reads in pack and offset order.
fn fold_small_tails(jobs: Vec<Job>, read_bytes: u64) -> Vec<Job> {
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
struct Job {
    pack: PackId,
    start: u64,
    end: u64,
    frames: Vec<FramePlan>,
}

/// Default largest read (see [`RestoreOptions::read_bytes`]).
pub const DEFAULT_READ_BYTES: u64 = 2 << 20;

/// Reads in flight while restoring. Reads share the link, so reads started together also end
/// together: with many in flight the link delivers nothing decodable until a whole wave ends,
/// and the last wave's decoding is left for after the last byte. A few keep the link busy across
/// one read's end and the next one's first byte.
pub const FETCHERS: usize = 4;
/// Smallest planned read (a request's fixed cost stays small against its transfer).
pub const MIN_READ: u64 = 1 << 20;
/// A checkpoint is cut into at least this many reads per fetcher (up to `read_bytes` each), so
/// that the last reads, whose decoding cannot overlap the transfer, are a small part of it.
const READS_PER_FETCHER: u64 = 8;

/// Size of the planned reads for `stored` bytes of frames: small checkpoints get smaller reads
/// so decoding starts early and little is left after the last byte arrives; large ones the
/// full `max`.
pub fn read_size(stored: u64, max: u64) -> u64 {
    (stored / (FETCHERS as u64 * READS_PER_FETCHER)).clamp(MIN_READ.min(max), max.max(1))
}

/// What a restore needs in memory: maps, tail, and the read plan.
struct Plan {
    /// Unique page ids.
    uids: Vec<ChunkId>,
    /// For each unique id, the pages using it: range into `refs`.
    ref_ranges: Vec<(u32, u32)>,
    /// (block, page) sorted by unique id.
    refs: Vec<(u32, u32)>,
    zeros: Vec<(u32, u32)>,
    jobs: Vec<Job>,
    /// The first jobs' reads, started as soon as the jobs were planned (see [`prefetch`]).
    early: Vec<parking_lot::Mutex<Option<Early>>>,
    /// Delta pages (unique-id indexes), a few dozen per job, ordered by their base's place.
    delta_jobs: Vec<Vec<u32>>,
    tail: Vec<u8>,
    /// When planning began (read timings in the trace are relative to it).
    t0: Instant,
}

/// A read started before the stream: its thread returns the bytes.
type Early = std::thread::JoinHandle<Result<Vec<u8>, crate::backend::BackendError>>;

/// Bytes the early reads cover: past the first [`FETCHERS`] jobs, more start (up to twice as
/// many) until they reach this, so the link stays busy until the fetchers take over.
const PREFETCH_BYTES: u64 = 3 << 20;

/// Start the reads of the first jobs now, on threads of their own: the rest of the plan (one
/// HEAD per pack), QEMU's `migrate-incoming` and the connection take ~20 ms of a 128 MiB
/// restore over 1 Gbit/s (`bench save-restore --remote`), in which the link would otherwise
/// carry only the HEADs. A plan that then fails drops the handles; the threads end with their
/// reads.
fn prefetch(store: &Store, jobs: &[Job]) -> Vec<parking_lot::Mutex<Option<Early>>> {
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
            let (store, key, start, len) = (store.clone(), j.pack.pack_key(), j.start, j.end - j.start);
            let h = std::thread::Builder::new()
                .name("strata-prefetch".into())
                .spawn(move || store.backend().get_range(&key, start, len))
                .ok();
            parking_lot::Mutex::new(h)
        })
        .collect()
}

fn page_of(ckpt: &Checkpoint, r: (u32, u32)) -> (String, u64) {
    (
        ckpt.manifest.blocks[r.0 as usize].name.clone(),
        r.1 as u64 * PAGE_SIZE as u64,
    )
}

fn load_tail(store: &Store, ckpt: &Checkpoint) -> Result<Vec<u8>, MemError> {
    let name = &ckpt.manifest.name;
    let dmg = |what: &str, source: StoreError| MemError::MetaDamaged {
        name: name.clone(),
        what: what.into(),
        source,
    };
    let raw = store
        .get(&ckpt.tail_root)
        .map_err(|e| dmg("device-state tail tree", e))?;
    let tree = Tree::decode(&raw).map_err(|source| {
        dmg(
            "device-state tail tree",
            StoreError::Format {
                key: format!("chunk {}", ckpt.tail_root),
                source,
            },
        )
    })?;
    let (pieces, len) = parse_tail_tree(&tree).map_err(|source| MemError::Manifest {
        name: name.clone(),
        source,
    })?;
    let mut tail = Vec::with_capacity(len as usize);
    for p in &pieces {
        tail.extend_from_slice(&store.get(p).map_err(|e| dmg("device-state tail", e))?);
    }
    let ok = tail.len() as u64 == len
        && len == ckpt.manifest.tail.len
        && blake3::hash(&tail).to_hex().as_str() == ckpt.manifest.tail.blake3;
    if !ok {
        return Err(dmg(
            "device-state tail",
            StoreError::Corrupt {
                id: ckpt.tail_root,
                pack: PackId::default(),
                offset: 0,
                reason: "tail length or hash differs from the manifest".into(),
            },
        ));
    }
    Ok(tail)
}

/// Concurrent reads while planning: page-map leaves and pack checks are small objects, so on
/// a remote backend their cost is round trips, not bytes (a 2 GiB guest's maps are 256 leaves).
pub const MAP_READERS: usize = 16;

/// Apply `f` to every item on up to `threads` threads; results in input order, or the first
/// error (with the index of the item that failed).
pub(crate) fn par_map<T: Sync, R: Send, E: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, (usize, E)> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let out: parking_lot::Mutex<Vec<Option<R>>> = parking_lot::Mutex::new((0..items.len()).map(|_| None).collect());
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
const CHUNKS_SPAN: u64 = 2 << 20;

/// Read small chunks (page-map trees) with one ranged GET per run of neighbouring frames in a
/// pack instead of one per chunk: the commit writes a checkpoint's map leaves side by side, so
/// a 128 MiB guest's 16 leaves are one request, not 16 (on a remote backend each request costs
/// the server a request's work, and the plan waits for the slowest). Every chunk is verified
/// as [`Store::get`] does; a chunk not in the index, or a pack that is gone (GC moved it), is
/// read through `Store::get`. Errors carry the index of the failing chunk.
pub(crate) fn get_chunks(store: &Store, ids: &[ChunkId], threads: usize) -> Result<Vec<Vec<u8>>, (usize, StoreError)> {
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
            *p == pack && run.first().is_some_and(|f| off + e.frame_len as u64 - f.1.frame_off <= CHUNKS_SPAN)
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
        let end = run.iter().map(|(_, e)| e.frame_off + e.frame_len as u64).max().expect("non-empty run");
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
                    crate::store::decode_chunk(frame, e, *pack).map(|d| (*i, d)).map_err(|err| (*i, err))
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

/// Read every ramblock's page map (the same trees `disk::map::read_map` reads), fetching the
/// roots, then the leaves of all maps, a few ranged GETs at a time ([`get_chunks`]). Errors
/// carry the ramblock's index.
pub(crate) fn read_maps(store: &Store, roots: &[ChunkId], threads: usize) -> Result<Vec<Vec<ChunkId>>, (usize, StoreError)> {
    let decode = |id: &ChunkId, raw: &[u8]| -> Result<Tree, StoreError> {
        Tree::decode(raw).map_err(|source| StoreError::Format {
            key: format!("chunk {id}"),
            source,
        })
    };
    // Trees this host has a copy of (it saved or restored the checkpoint before) are not
    // fetched; fetched ones are kept for next time.
    let cache = store.tree_cache();
    let decode_all = |ids: &[ChunkId]| -> Result<Vec<Tree>, (usize, StoreError)> {
        let mut raw: Vec<Option<Vec<u8>>> = ids.iter().map(|id| cache.and_then(|c| c.get(id))).collect();
        let missing: Vec<usize> = (0..ids.len()).filter(|&i| raw[i].is_none()).collect();
        if !missing.is_empty() {
            let want: Vec<ChunkId> = missing.iter().map(|&i| ids[i]).collect();
            let got = get_chunks(store, &want, threads).map_err(|(k, e)| (missing[k], e))?;
            for (&i, r) in missing.iter().zip(got) {
                if let Some(c) = cache {
                    c.put(&ids[i], &r);
                }
                raw[i] = Some(r);
            }
        }
        ids.iter()
            .zip(raw)
            .enumerate()
            .map(|(i, (id, r))| decode(id, &r.expect("every tree read")).map_err(|e| (i, e)))
            .collect()
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
    for (t, n) in tops.iter().zip(counts) {
        let mut out = Vec::with_capacity(n);
        for leaf in &t.children {
            let want = n.saturating_sub(out.len()).min(LEAF_IDS);
            if leaf.is_zero() {
                out.extend(std::iter::repeat_n(ChunkId::ZERO, want));
            } else {
                let lt = fetched.next().expect("one fetched tree per non-zero leaf");
                out.extend(lt.children.into_iter().take(want));
            }
        }
        out.resize(n, ChunkId::ZERO);
        maps.push(out);
    }
    Ok(maps)
}

fn make_plan(store: &Store, ckpt: &Checkpoint, read_bytes: u64) -> Result<Plan, MemError> {
    let t0 = Instant::now();
    let m = &ckpt.manifest;
    let name = &m.name;
    // The device-state tail is a few round trips of its own: fetched while the maps are.
    let tail = {
        let (store, ckpt) = (store.clone(), ckpt.clone());
        std::thread::spawn(move || load_tail(&store, &ckpt))
    };
    let mut ids: Vec<ChunkId> = Vec::new();
    let mut pages: Vec<(u32, u32)> = Vec::new(); // (block, page) of ids[i]
    let mut zeros = Vec::new();
    let hits0 = store.tree_cache().map_or(0, |c| c.counters().0);
    let maps = read_maps(store, &ckpt.map_roots, MAP_READERS).map_err(|(bi, source)| MemError::MetaDamaged {
        name: name.clone(),
        what: format!("page map of ramblock '{}'", m.blocks[bi].name),
        source,
    })?;
    let maps_ms = t0.elapsed().as_secs_f64() * 1e3;
    let map_trees_local = store.tree_cache().map_or(0, |c| c.counters().0) - hits0;
    for (bi, (b, (root, map))) in m.blocks.iter().zip(ckpt.map_roots.iter().zip(maps)).enumerate() {
        if map.len() as u64 != b.pages() {
            return Err(MemError::MetaDamaged {
                name: name.clone(),
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
                zeros.push((bi as u32, p as u32));
            } else {
                ids.push(id);
                pages.push((bi as u32, p as u32));
            }
        }
    }
    // Locate every page (one index lock per batch, not per page); a missing chunk is reported
    // now, before QEMU is touched. Sorting the pages by their place in the packs groups the
    // pages that share a chunk (one chunk, one place) and orders the reads, with no sort by id.
    let listed_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut hits: Vec<(PackId, u64, u32, u32)> = Vec::with_capacity(ids.len()); // pack, frame off, off in frame, page
    let mut frames_of: Vec<FrameMeta> = Vec::with_capacity(ids.len()); // by page
    let mut bad: Option<(usize, StoreError)> = None;
    store.locate_many(&ids, |i, hit| {
        let meta = match hit {
            None => {
                bad.get_or_insert((i, StoreError::ChunkMissing { id: ids[i] }));
                FrameMeta {
                    len: 0,
                    raw_len: 0,
                    codec: Codec::None,
                    crc: 0,
                    delta: false,
                }
            }
            Some((pack, e)) => {
                let delta = e.kind == ChunkKind::Tree;
                if !delta && e.raw_len as usize != PAGE_SIZE {
                    bad.get_or_insert((
                        i,
                        StoreError::Corrupt {
                            id: ids[i],
                            pack,
                            offset: e.frame_off,
                            reason: format!("chunk is {} bytes, not a page", e.raw_len),
                        },
                    ));
                }
                hits.push((pack, e.frame_off, e.off_in_frame, i as u32));
                FrameMeta {
                    len: e.frame_len,
                    raw_len: e.frame_raw_len,
                    codec: e.codec,
                    crc: e.frame_crc,
                    delta,
                }
            }
        };
        frames_of.push(meta);
    });
    if let Some((i, source)) = bad {
        let (block, offset) = page_of(ckpt, pages[i]);
        return Err(MemError::PageDamaged {
            name: name.clone(),
            block,
            offset,
            id: ids[i],
            source,
        });
    }
    let looked_up_ms = t0.elapsed().as_secs_f64() * 1e3;
    hits.sort_unstable();
    // Frames' stored bytes, for the read size.
    let mut stored = 0u64;
    let mut last: Option<(PackId, u64)> = None;
    for &(pack, off, _, i) in &hits {
        let f = &frames_of[i as usize];
        if !f.delta && last != Some((pack, off)) {
            stored += f.len as u64;
            last = Some((pack, off));
        }
    }
    let read_bytes = read_size(stored, read_bytes);
    // A delta record (manifest version 2) is read, its base read and both verified, and the
    // rebuilt page verified, when streaming; the others are read by frame.
    let mut uids: Vec<ChunkId> = Vec::new();
    let mut ref_ranges: Vec<(u32, u32)> = Vec::new();
    let mut refs: Vec<(u32, u32)> = Vec::with_capacity(hits.len());
    let mut deltas: Vec<u32> = Vec::new();
    let mut jobs: Vec<Job> = Vec::new();
    let mut place: Option<(PackId, u64, u32)> = None;
    for (pack, off, in_frame, i) in hits {
        let i = i as usize;
        if place != Some((pack, off, in_frame)) || uids.last() != Some(&ids[i]) {
            place = Some((pack, off, in_frame));
            let u = uids.len() as u32;
            uids.push(ids[i]);
            ref_ranges.push((refs.len() as u32, refs.len() as u32));
            let f = &frames_of[i];
            if f.delta {
                deltas.push(u);
            } else {
                add_to_jobs(&mut jobs, pack, off, in_frame, u, f, read_bytes);
            }
        }
        refs.push(pages[i]);
        ref_ranges.last_mut().expect("pushed").1 += 1;
    }
    drop((ids, pages, frames_of));
    let mut jobs = fold_small_tails(jobs, read_bytes);
    order_reads(&mut jobs);
    let located_ms = t0.elapsed().as_secs_f64() * 1e3;
    let early = prefetch(store, &jobs);
    // A pack that vanished is reported now too (one HEAD per pack, not per page; concurrent).
    let mut packs: Vec<(PackId, u32)> = Vec::new();
    let mut checked: std::collections::HashSet<PackId> = std::collections::HashSet::new();
    for j in &jobs {
        if checked.insert(j.pack) {
            packs.push((j.pack, j.frames[0].chunks[0].1));
        }
    }
    let present = par_map(&packs, MAP_READERS, |(pack, _)| store.backend().head(&pack.pack_key())).map_err(|(_, e)| {
        MemError::Store {
            op: "pack lookup",
            name: name.clone(),
            source: e.into(),
        }
    })?;
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
    let heads_ms = t0.elapsed().as_secs_f64() * 1e3;
    let delta_jobs = deltas.chunks(64).map(|c| c.to_vec()).collect();
    let tail = tail.join().map_err(|_| MemError::Panic { what: "tail reader" })??;
    tracing::debug!(
        target: TARGET,
        name,
        maps_ms,
        map_trees_local,
        listed_ms,
        looked_up_ms,
        located_ms,
        heads_ms,
        tail_ms = t0.elapsed().as_secs_f64() * 1e3,
        packs = packs.len(),
        reads = jobs.len(),
        read_bytes,
        "restore planned"
    );
    Ok(Plan {
        uids,
        ref_ranges,
        refs,
        zeros,
        jobs,
        early,
        delta_jobs,
        tail,
        t0,
    })
}

/// Decoded frames' buffers, handed back by the writer once their pages are in the stream and
/// taken again by the decoders: a restore touches its working set once instead of fresh memory
/// for every frame. Fresh memory is a page fault per 4 KiB, and on a host whose free memory
/// is handed back to a hypervisor an expensive one (`bench save-restore --remote` logs the
/// faults of every restore).
struct Buffers {
    free: parking_lot::Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept for reuse (of up to a frame each: 128 KiB for memory frames).
const KEPT_BUFFERS: usize = 512;

impl Buffers {
    fn new() -> Buffers {
        Buffers {
            free: parking_lot::Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> Vec<u8> {
        self.free.lock().pop().unwrap_or_default()
    }

    fn give(&self, b: Vec<u8>) {
        let mut free = self.free.lock();
        if free.len() < KEPT_BUFFERS {
            free.push(b);
        }
    }
}

/// A verified frame: its raw bytes and the pages (unique ids) to write from it.
struct Decoded {
    raw: Vec<u8>,
    chunks: Vec<(u32, u32)>,
    read: u64,
}

/// Compressed bytes handed to the decoders at a time. Frames are decoded as their bytes
/// arrive, not once their whole read is in: reads in flight share the link and end together,
/// and decoding each read whole left the last ones' decoding (~10 MiB of pages at 128 MiB)
/// for after the last byte, with the pages reaching QEMU in bursts.
const BATCH_BYTES: u64 = 256 << 10;

/// Batches queued per fetcher for the decoders (a few MiB in all).
const BATCHES_PER_FETCHER: usize = 8;

/// Frames `f0..f1` of job `j`, whose bytes start at pack offset `base`.
struct Batch {
    j: usize,
    f0: usize,
    f1: usize,
    base: u64,
    bytes: Vec<u8>,
}

/// Cuts one read's bytes, as they arrive, into batches of whole frames.
struct Splitter<'a> {
    j: usize,
    job: &'a Job,
    bufs: &'a Buffers,
    buf: Vec<u8>,
    base: u64,
    f0: usize,
    f1: usize,
}

impl<'a> Splitter<'a> {
    fn new(j: usize, job: &'a Job, bufs: &'a Buffers) -> Self {
        let mut buf = bufs.take();
        buf.clear();
        Splitter {
            j,
            job,
            bufs,
            buf,
            base: job.start,
            f0: 0,
            f1: 0,
        }
    }

    /// Take arrived bytes; `emit` gets every batch they complete.
    fn push(&mut self, mut piece: &[u8], emit: &mut dyn FnMut(Batch)) {
        let frames = &self.job.frames;
        while !piece.is_empty() {
            // Copy up to the end of the batch that can be cut next, so a buffer never holds
            // more than a batch (plus a frame).
            let want = self.next_cut().saturating_sub(self.base + self.buf.len() as u64).max(1);
            let n = (want as usize).min(piece.len());
            self.buf.extend_from_slice(&piece[..n]);
            piece = &piece[n..];
            let have = self.base + self.buf.len() as u64;
            while self.f1 < frames.len() && frames[self.f1].off + frames[self.f1].len as u64 <= have {
                self.f1 += 1;
            }
            if self.f1 > self.f0 && have >= self.next_cut() {
                let end = frames[self.f1 - 1].off + frames[self.f1 - 1].len as u64;
                let cut = (end - self.base) as usize;
                let mut rest = self.bufs.take();
                rest.clear();
                rest.extend_from_slice(&self.buf[cut..]);
                let mut bytes = std::mem::replace(&mut self.buf, rest);
                bytes.truncate(cut);
                emit(Batch {
                    j: self.j,
                    f0: self.f0,
                    f1: self.f1,
                    base: self.base,
                    bytes,
                });
                self.base = end;
                self.f0 = self.f1;
            }
        }
    }

    /// Pack offset at which the next batch is cut: the end of the first frame reaching
    /// [`BATCH_BYTES`] past the batch's start, or of the read's last frame.
    fn next_cut(&self) -> u64 {
        let frames = &self.job.frames[self.f0..];
        frames
            .iter()
            .map(|f| f.off + f.len as u64)
            .find(|&e| e - self.base >= BATCH_BYTES)
            .unwrap_or(self.job.end)
    }

    /// Every frame handed over.
    fn done(&self) -> bool {
        self.f0 == self.job.frames.len()
    }
}

/// Read job `j` and hand its frames to the decoders as they arrive (`send` false: the
/// decoders stopped). Returns the job's outcome when there is nothing (more) to decode: the
/// pack is gone (read through the index), or the read failed.
fn fetch_job(
    store: &Store,
    plan: &Plan,
    j: usize,
    job: &Job,
    bufs: &Buffers,
    send: &mut dyn FnMut(Batch) -> bool,
) -> Option<Result<Vec<Decoded>, (u32, StoreError)>> {
    let early = plan.early.get(j).and_then(|h| h.lock().take()).and_then(|h| h.join().ok());
    let started = plan.t0.elapsed();
    let prefetched = early.is_some();
    let mut split = Splitter::new(j, job, bufs);
    let mut open = true;
    let mut emit = |b: Batch| open = open && send(b);
    let read = match early {
        Some(r) => r.map(|b| split.push(&b, &mut emit)),
        None => store
            .backend()
            .get_range_to(&job.pack.pack_key(), job.start, job.end - job.start, &mut |piece| split.push(piece, &mut emit)),
    };
    tracing::trace!(
        target: TARGET,
        j,
        bytes = job.end - job.start,
        prefetched,
        start_ms = started.as_secs_f64() * 1e3,
        end_ms = plan.t0.elapsed().as_secs_f64() * 1e3,
        "read"
    );
    let uid = |f: usize| job.frames[f.min(job.frames.len() - 1)].chunks[0].1;
    match read {
        Ok(()) if split.done() => None,
        Ok(()) => Some(Err((
            uid(split.f0),
            StoreError::Backend(crate::backend::BackendError::new(crate::backend::ErrorKind::Invalid, "get_range", job.pack.pack_key())),
        ))),
        Err(e) if e.is_not_found() => Some(fallback(store, plan, &job.frames[split.f0..])),
        Err(e) => Some(Err((uid(split.f0), StoreError::Backend(e)))),
    }
}

/// Check, decompress and verify the frames of one batch.
fn decode_batch(plan: &Plan, batch: &Batch, bufs: &Buffers) -> Result<Vec<Decoded>, (u32, StoreError)> {
    let job = &plan.jobs[batch.j];
    let frames = &job.frames[batch.f0..batch.f1];
    let mut out = Vec::with_capacity(frames.len());
    for f in frames {
        let a = (f.off - batch.base) as usize;
        let u0 = f.chunks[0].1;
        let stored = batch
            .bytes
            .get(a..a + f.len as usize)
            .ok_or_else(|| (u0, StoreError::Backend(crate::backend::BackendError::new(crate::backend::ErrorKind::Invalid, "get_range", job.pack.pack_key()))))?;
        let corrupt = |u: u32, reason: String| {
            (
                u,
                StoreError::Corrupt {
                    id: plan.uids[u as usize],
                    pack: job.pack,
                    offset: f.off,
                    reason,
                },
            )
        };
        if crc(stored) != f.crc {
            return Err(corrupt(u0, "frame checksum mismatch".into()));
        }
        let mut raw = bufs.take();
        f.codec
            .decompress_into(stored, f.raw_len as usize, &mut raw)
            .map_err(|e| corrupt(u0, e.to_string()))?;
        // Every page is verified against its id, a frame's pages hashed together.
        let mut pages: Vec<&[u8; PAGE_SIZE]> = Vec::with_capacity(f.chunks.len());
        for &(o, u) in &f.chunks {
            let page = raw
                .get(o as usize..o as usize + PAGE_SIZE)
                .and_then(as_page)
                .ok_or_else(|| corrupt(u, "chunk lies outside its frame".into()))?;
            pages.push(page);
        }
        let mut got = vec![ChunkId::ZERO; pages.len()];
        hash_pages(&pages, &mut got);
        for (&(_, u), id) in f.chunks.iter().zip(&got) {
            if *id != plan.uids[u as usize] {
                return Err(corrupt(u, "content does not match its hash".into()));
            }
        }
        out.push(Decoded {
            raw,
            chunks: f.chunks.clone(),
            read: 0,
        });
    }
    if let Some(d) = out.first_mut() {
        d.read = batch.bytes.len() as u64;
    }
    Ok(out)
}

/// Rebuild delta pages: each base page is read and verified, the runs applied, and the result
/// verified against the page's id.
fn decode_deltas(store: &Store, plan: &Plan, uids: &[u32]) -> Result<Vec<Decoded>, (u32, StoreError)> {
    uids.iter()
        .map(|&u| {
            let (_, page) = super::delta::rebuild(store, &plan.uids[u as usize]).map_err(|e| (u, e))?;
            Ok(Decoded {
                raw: page.to_vec(),
                chunks: vec![(0, u)],
                read: 0,
            })
        })
        .collect()
}

/// The pack went away (GC repacked it after the plan was made): read chunk by chunk through
/// the index, which follows the move.
fn fallback(store: &Store, plan: &Plan, frames: &[FramePlan]) -> Result<Vec<Decoded>, (u32, StoreError)> {
    let mut out = Vec::new();
    for f in frames {
        for &(_, u) in &f.chunks {
            let data = store.get(&plan.uids[u as usize]).map_err(|e| (u, e))?;
            out.push(Decoded {
                read: data.len() as u64,
                raw: data,
                chunks: vec![(0, u)],
            });
        }
    }
    Ok(out)
}

/// A checkpoint ready to stream: maps and tail read and verified, every chunk located.
pub struct Prepared<'a> {
    store: &'a Store,
    ckpt: &'a Checkpoint,
    layout: super::stream::StreamLayout,
    plan: Plan,
    plan_ms: f64,
}

/// Everything that can fail before the first byte goes to QEMU: maps, tail, missing chunks
/// or packs.
pub fn prepare<'a>(store: &'a Store, ckpt: &'a Checkpoint, opts: &RestoreOptions) -> Result<Prepared<'a>, MemError> {
    let t0 = Instant::now();
    let name = &ckpt.manifest.name;
    let layout = ckpt.manifest.layout().map_err(|source| MemError::Manifest {
        name: name.clone(),
        source,
    })?;
    let plan = make_plan(store, ckpt, opts.read_bytes)?;
    Ok(Prepared {
        store,
        ckpt,
        layout,
        plan,
        plan_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}

/// Generate the checkpoint's migration stream into `out`, every page verified first.
pub fn write_stream<W: Write>(
    store: &Store,
    ckpt: &Checkpoint,
    out: W,
    opts: &RestoreOptions,
    progress: &dyn Progress,
) -> Result<(W, RestoreReport), MemError> {
    let p = prepare(store, ckpt, opts)?;
    stream(p, out, opts, progress)
}

/// Write a prepared checkpoint's stream into `out`.
pub fn stream<W: Write>(
    p: Prepared<'_>,
    out: W,
    opts: &RestoreOptions,
    progress: &dyn Progress,
) -> Result<(W, RestoreReport), MemError> {
    let Prepared {
        store,
        ckpt,
        layout,
        plan,
        plan_ms,
    } = p;
    let name = ckpt.manifest.name.clone();
    let t1 = Instant::now();
    let gen = |source| MemError::Generate {
        name: name.clone(),
        source,
    };
    let mut w = StreamWriter::new(Timed::new(out), &layout).map_err(gen)?;
    progress.phase("restoring", Some(layout.total_ram()), Unit::Bytes);
    for &(b, p) in &plan.zeros {
        w.zero(BlockIdx(b), p as u64 * PAGE_SIZE as u64, 0).map_err(gen)?;
    }
    progress.advance(plan.zeros.len() as u64 * PAGE_SIZE as u64);
    // Fetchers keep FETCHERS reads in flight and hand the bytes to the decoders, so the link
    // never waits for a decode; delta jobs (small reads of their own) run on the fetchers.
    let workers = opts.workers.max(1);
    let fetchers = FETCHERS;
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (tx, rx) = mpsc::sync_channel::<Result<Vec<Decoded>, (u32, StoreError)>>(workers * 2);
    let (ftx, frx) = mpsc::sync_channel::<Batch>(fetchers * BATCHES_PER_FETCHER);
    // Shared by the decoders and dropped with the last of them, so a fetcher blocked on a full
    // queue wakes up (with an error) when the decoders stop.
    let frx = std::sync::Arc::new(parking_lot::Mutex::new(frx));
    let bufs = Buffers::new();
    let batch_bufs = Buffers::new();
    let mut bytes_read = 0u64;
    // Time the writer waited for decoded pages (the link or the decoders were behind).
    let mut starved = std::time::Duration::ZERO;
    let result: Result<(), MemError> = std::thread::scope(|s| {
        for i in 0..fetchers {
            let (tx, ftx, plan, next, stop, batch_bufs) = (tx.clone(), ftx.clone(), &plan, &next, &stop, &batch_bufs);
            std::thread::Builder::new()
                .name(format!("strata-fetch-{i}"))
                .spawn_scoped(s, move || loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= plan.jobs.len() + plan.delta_jobs.len() || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let done = match plan.jobs.get(j) {
                        Some(job) => match fetch_job(store, plan, j, job, batch_bufs, &mut |b| ftx.send(b).is_ok()) {
                            None => continue,
                            Some(r) => r,
                        },
                        None => decode_deltas(store, plan, &plan.delta_jobs[j - plan.jobs.len()]),
                    };
                    let failed = done.is_err();
                    if tx.send(done).is_err() || failed {
                        return;
                    }
                })
                .expect("spawn restore fetcher");
        }
        drop(ftx);
        for i in 0..workers {
            let (tx, frx, plan, stop, bufs, batch_bufs) = (tx.clone(), frx.clone(), &plan, &stop, &bufs, &batch_bufs);
            std::thread::Builder::new()
                .name(format!("strata-restore-{i}"))
                .spawn_scoped(s, move || loop {
                    let got = frx.lock().recv();
                    let Ok(batch) = got else { return };
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let r = decode_batch(plan, &batch, bufs);
                    batch_bufs.give(batch.bytes);
                    let failed = r.is_err();
                    if tx.send(r).is_err() || failed {
                        return;
                    }
                })
                .expect("spawn restore worker");
        }
        drop(frx);
        // The writer's receiver is dropped when this closure returns, before the scope joins the
        // threads: a thread blocked on a full queue then gets an error instead of waiting forever.
        let rx = rx;
        drop(tx);
        let mut outcome = Ok(());
        loop {
            let t = Instant::now();
            let Ok(r) = rx.recv() else { break };
            starved += t.elapsed();
            match r {
                Ok(frames) => {
                    for d in frames {
                        bytes_read += d.read;
                        let mut n = 0u64;
                        for &(o, u) in &d.chunks {
                            let page: &[u8; PAGE_SIZE] = d.raw[o as usize..o as usize + PAGE_SIZE]
                                .try_into()
                                .expect("page-sized slice");
                            let (a, z) = plan.ref_ranges[u as usize];
                            for &(b, p) in &plan.refs[a as usize..z as usize] {
                                if let Err(e) = w.page(BlockIdx(b), p as u64 * PAGE_SIZE as u64, page) {
                                    stop.store(true, Ordering::Relaxed);
                                    return Err(gen(e));
                                }
                                n += 1;
                            }
                        }
                        progress.advance(n * PAGE_SIZE as u64);
                        bufs.give(d.raw);
                    }
                }
                Err((u, source)) => {
                    stop.store(true, Ordering::Relaxed);
                    let (a, _) = plan.ref_ranges[u as usize];
                    let (block, offset) = page_of(ckpt, plan.refs[a as usize]);
                    outcome = Err(MemError::PageDamaged {
                        name: name.clone(),
                        block,
                        offset,
                        id: plan.uids[u as usize],
                        source,
                    });
                    break;
                }
            }
        }
        outcome
    });
    result?;
    let pages_ms = t1.elapsed().as_secs_f64() * 1e3;
    w.tail(&plan.tail).map_err(gen)?;
    let (out, st): (Timed<W>, GenerateStats) = w.finish().map_err(gen)?;
    // Time in write calls is time QEMU's loader was behind (the socket buffer was full).
    tracing::debug!(
        target: TARGET,
        pages_ms,
        starved_ms = starved.as_secs_f64() * 1e3,
        end_ms = t1.elapsed().as_secs_f64() * 1e3,
        write_ms = out.busy.as_secs_f64() * 1e3,
        writes = out.calls,
        "stream written"
    );
    let out = out.inner;
    progress.finish();
    let report = RestoreReport {
        name: name.clone(),
        plan_ms,
        stream_ms: t1.elapsed().as_secs_f64() * 1e3,
        stream_bytes: st.bytes,
        pages: st.page_records + st.zero_records,
        zero_pages: st.zero_records,
        chunks_verified: plan.uids.len() as u64,
        delta_pages: plan.delta_jobs.iter().map(|j| j.len() as u64).sum(),
        bytes_read,
        reads: plan.jobs.len() as u64,
        ..Default::default()
    };
    tracing::debug!(target: TARGET, name, ?report, "stream generated");
    Ok((out, report))
}

/// A writer that counts the time spent in its inner writer's calls.
struct Timed<W> {
    inner: W,
    busy: std::time::Duration,
    calls: u64,
}

impl<W> Timed<W> {
    fn new(inner: W) -> Self {
        Timed {
            inner,
            busy: std::time::Duration::ZERO,
            calls: 0,
        }
    }
}

impl<W: Write> Write for Timed<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let t = Instant::now();
        let r = self.inner.write(b);
        self.busy += t.elapsed();
        self.calls += 1;
        r
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let t = Instant::now();
        let r = self.inner.flush();
        self.busy += t.elapsed();
        r
    }
}

/// Restore checkpoint `name` into the QEMU behind `qmp` (started with `-incoming defer`).
pub fn restore(
    store: &Store,
    name: &str,
    qmp: &mut QmpClient,
    opts: &RestoreOptions,
    progress: &dyn Progress,
) -> Result<RestoreReport, MemError> {
    let t0 = Instant::now();
    let ckpt = load_checkpoint(store, name)?;
    let loaded_ms = t0.elapsed().as_secs_f64() * 1e3;
    // The target check (a few QMP queries) runs while the plan reads the page maps: neither
    // changes the target, so a restore that fails here still leaves QEMU untouched. A wrong
    // target is reported before a damaged checkpoint, as when they ran one after the other.
    let (checked, prepared) = std::thread::scope(|s| {
        let plan = std::thread::Builder::new()
            .name("strata-plan".into())
            .spawn_scoped(s, || prepare(store, &ckpt, opts))
            .expect("spawn restore planner");
        let checked = check_target(&ckpt, qmp);
        (checked, plan.join())
    });
    checked?;
    let checked_and_planned_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prepared = prepared.map_err(|_| MemError::Panic { what: "restore planner" })??;
    let path = qmp.path().to_path_buf();
    let dir = opts.socket_dir.clone().unwrap_or_else(std::env::temp_dir);
    let sock = dir.join(format!(
        "strata-in-{}-{:08x}.sock",
        std::process::id(),
        rand::random::<u32>()
    ));
    qmp.migrate_incoming(&format!("unix:{}", sock.display()))
        .map_err(MemError::qmp("migrate-incoming", &path))?;
    let _cleanup = Remove(sock.clone());
    let mut conn = None;
    let mut last = None;
    for _ in 0..500 {
        match UnixStream::connect(&sock) {
            Ok(s) => {
                conn = Some(s);
                break;
            }
            Err(e) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    let Some(conn) = conn else {
        return Err(MemError::Io {
            op: "connect to QEMU's incoming socket",
            path: sock,
            source: last.expect("an error"),
        });
    };
    tracing::debug!(target: TARGET, name, loaded_ms, checked_and_planned_ms, connected_ms = t0.elapsed().as_secs_f64() * 1e3, "restore connected");
    let (conn, mut report) = stream(prepared, conn, opts, progress)?;
    let _ = conn.shutdown(std::net::Shutdown::Write);
    drop(conn);
    let deadline = Instant::now() + opts.load_timeout;
    loop {
        match qmp.query_migrate() {
            Ok(i) if i.status == "completed" => break,
            Ok(i) if i.status == "failed" || i.status == "cancelled" => {
                return Err(MemError::LoadFailed {
                    name: name.into(),
                    status: i.status,
                    desc: i.error_desc.unwrap_or_else(|| "see QEMU's stderr".into()),
                })
            }
            Ok(i) if Instant::now() > deadline => {
                return Err(MemError::LoadFailed {
                    name: name.into(),
                    status: i.status,
                    desc: format!("not loaded after {:?}", opts.load_timeout),
                })
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(2)),
            Err(QmpError::Closed { .. }) => {
                return Err(MemError::LoadFailed {
                    name: name.into(),
                    status: "exited".into(),
                    desc: "QEMU exited while loading; its stderr has the reason".into(),
                })
            }
            Err(source) => {
                return Err(MemError::Qmp {
                    op: "query-migrate",
                    path,
                    source,
                })
            }
        }
    }
    report.load_ms = t0.elapsed().as_secs_f64() * 1e3;
    if opts.resume {
        let s = qmp.query_status().map_err(MemError::qmp("query-status", &path))?;
        if !s.running {
            qmp.cont().map_err(MemError::qmp("cont", &path))?;
        }
    }
    report.vm_status = qmp
        .query_status()
        .map(|s| s.status)
        .unwrap_or_else(|_| "unknown".into());
    report.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    tracing::info!(target: TARGET, name, total_ms = report.total_ms, "checkpoint restored");
    Ok(report)
}

struct Remove(PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemoryBackend;
    use crate::disk::map::{read_map, write_map};
    use crate::backend::Backend;
    use crate::store::pack::ChunkKind;
    use crate::store::InitOptions;
    use std::sync::Arc;

    #[test]
    fn concurrent_map_reads_match_read_map() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::init(Arc::new(MemoryBackend::new()), &d.path().join("m.redb"), InitOptions::default()).unwrap();
        let ses = store.session();
        let ids: Vec<ChunkId> = (0..40u32).map(|i| ses.put(&i.to_le_bytes(), ChunkKind::Data).unwrap()).collect();
        // Map 0: a full leaf, an all-zero leaf, a partial leaf. Map 1: one short leaf. Map 2: empty.
        let mut m0: Vec<ChunkId> = (0..LEAF_IDS).map(|i| ids[i % 40]).collect();
        m0.extend(std::iter::repeat_n(ChunkId::ZERO, LEAF_IDS));
        m0.extend((0..123).map(|i| ids[(i * 7) % 40]));
        let m1: Vec<ChunkId> = ids[..5].to_vec();
        let maps = [m0, m1, Vec::new()];
        let roots: Vec<ChunkId> = maps.iter().map(|m| write_map(&ses, m).unwrap()).collect();
        store.flush().unwrap();
        for threads in [1, 3, MAP_READERS] {
            let got = read_maps(&store, &roots, threads).unwrap();
            for (i, (g, want)) in got.iter().zip(&maps).enumerate() {
                assert_eq!(g, want, "map {i} with {threads} threads");
                assert_eq!(g, &read_map(&store, &roots[i]).unwrap());
            }
        }
        // A root that is not stored: the error names the map (ramblock) it belongs to.
        let bad = [roots[0], ids[0], ChunkId::of(b"not stored")];
        let (i, _) = read_maps(&store, &bad, 4).unwrap_err();
        assert!(i == 1 || i == 2, "failing map index {i}");
    }

    #[test]
    fn get_chunks_reads_runs_per_pack_and_verifies_each_chunk() {
        let d = tempfile::tempdir().unwrap();
        let mem = MemoryBackend::new();
        let store = Store::init(Arc::new(mem.clone()), &d.path().join("m.redb"), InitOptions { default_codec: Codec::None, ..InitOptions::default() }).unwrap();
        let ses = store.session();
        let data = |i: u32| -> Vec<u8> { (0..64u32 << 10).map(|j| (j.wrapping_mul(2654435761) >> 13 ^ i) as u8).collect() };
        // Two packs, the first holding more than one CHUNKS_SPAN of chunks (several reads).
        let mut ids: Vec<ChunkId> = (0..48).map(|i| ses.put(&data(i), ChunkKind::Data).unwrap()).collect();
        store.flush().unwrap();
        ids.extend((48..52).map(|i| ses.put(&data(i), ChunkKind::Data).unwrap()));
        store.flush().unwrap();
        assert_eq!(mem.list("packs/").unwrap().len(), 2);
        // Asked out of order, with a repeat: answers in the order asked.
        let mut ask: Vec<ChunkId> = ids.iter().rev().copied().collect();
        ask.push(ids[3]);
        for threads in [1, 4] {
            let got = get_chunks(&store, &ask, threads).unwrap();
            for (a, g) in ask.iter().zip(&got) {
                assert_eq!(ChunkId::of(g), *a);
            }
        }
        // A chunk nobody stored: the error names its index.
        let mut bad = ids[..3].to_vec();
        bad.push(ChunkId::of(b"never stored"));
        let (i, e) = get_chunks(&store, &bad, 2).unwrap_err();
        assert_eq!(i, 3, "{e}");
        // A flipped byte in the small pack: caught by the frame checksum, naming that chunk.
        let small = mem.list("packs/").unwrap().into_iter().min_by_key(|o| o.size).unwrap();
        let (_, e) = store.locate(&ids[50]).unwrap();
        let mut bytes = mem.get(&small.key).unwrap();
        bytes[e.frame_off as usize + 10] ^= 1;
        mem.put(&small.key, &bytes).unwrap();
        let (i, e) = get_chunks(&store, &ids[48..], 1).unwrap_err();
        assert_eq!(i, 2, "{e}");
        assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
    }

    /// However the bytes arrive, a read is cut into batches of whole frames, in order, each
    /// holding exactly its bytes, none but the last under the batch size and none holding more
    /// than a batch and a frame.
    #[test]
    fn arriving_bytes_are_cut_into_batches_of_whole_frames() {
        use rand::{Rng, SeedableRng};
        let meta = |len: u32| FrameMeta {
            len,
            raw_len: 65536,
            codec: Codec::Zstd(1),
            crc: 0,
            delta: false,
        };
        let pack = PackId([3; 16]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut jobs = Vec::new();
        let mut off = 4096u64;
        for u in 0..60u32 {
            let len = rng.gen_range(1_000..70_000);
            add_to_jobs(&mut jobs, pack, off, 0, u, &meta(len), 4 << 20);
            // Now and then a gap between frames (pages of other checkpoints).
            off += len as u64 + if u % 7 == 3 { rng.gen_range(1..100_000) } else { 0 };
        }
        assert_eq!(jobs.len(), 1);
        let job = &jobs[0];
        let data: Vec<u8> = (0..job.end).map(|i| (i % 253) as u8).collect();
        let bufs = Buffers::new();
        for piece_max in [1usize, 777, 16 << 10, 1 << 20, 8 << 20] {
            let mut split = Splitter::new(0, job, &bufs);
            let mut batches = Vec::new();
            let mut at = job.start as usize;
            while at < job.end as usize {
                let n = rng.gen_range(1..=piece_max).min(job.end as usize - at);
                split.push(&data[at..at + n], &mut |b| batches.push(b));
                at += n;
            }
            assert!(split.done(), "every frame handed over (pieces up to {piece_max})");
            let mut next = (0usize, job.start);
            for (i, b) in batches.iter().enumerate() {
                assert_eq!((b.f0, b.base), next, "batches follow each other");
                assert!(b.f1 > b.f0);
                let end = job.frames[b.f1 - 1].off + job.frames[b.f1 - 1].len as u64;
                assert_eq!(b.bytes[..], data[b.base as usize..end as usize]);
                let len = end - b.base;
                if i + 1 < batches.len() {
                    assert!(len >= BATCH_BYTES, "a batch before the last is at least the batch size");
                }
                if b.f1 - b.f0 > 1 {
                    let f = &job.frames[b.f1 - 2];
                    assert!(f.off + f.len as u64 - b.base < BATCH_BYTES, "a batch is cut at the first frame reaching the batch size");
                }
                next = (b.f1, end);
            }
            assert_eq!(next, (job.frames.len(), job.end));
        }
    }

    #[test]
    fn reads_coalesce_per_pack_and_end_with_the_smallest() {
        let meta = |len: u32| FrameMeta {
            len,
            raw_len: 65536,
            codec: Codec::Zstd(1),
            crc: 0,
            delta: false,
        };
        let (a, b) = (PackId([1; 16]), PackId([2; 16]));
        let mut jobs = Vec::new();
        // Pack a: three frames, the second with two pages, a gap of 64 KiB before the third;
        // then one small frame in pack b; then a far frame in pack a (a new read).
        add_to_jobs(&mut jobs, a, 0, 0, 0, &meta(1000), 1 << 20);
        add_to_jobs(&mut jobs, a, 1000, 0, 1, &meta(2000), 1 << 20);
        add_to_jobs(&mut jobs, a, 1000, 4096, 2, &meta(2000), 1 << 20);
        add_to_jobs(&mut jobs, a, 3000 + (64 << 10), 0, 3, &meta(500), 1 << 20);
        add_to_jobs(&mut jobs, b, 0, 0, 4, &meta(300), 1 << 20);
        add_to_jobs(&mut jobs, a, 8 << 20, 0, 5, &meta(900_000), 1 << 20);
        let spans: Vec<(PackId, u64, u64, usize)> = jobs.iter().map(|j| (j.pack, j.start, j.end, j.frames.len())).collect();
        assert_eq!(
            spans,
            vec![(a, 0, 3500 + (64 << 10), 3), (b, 0, 300, 1), (a, 8 << 20, (8 << 20) + 900_000, 1)]
        );
        assert_eq!(jobs[0].frames[1].chunks, vec![(0, 1), (4096, 2)]);
        // A read never grows past the read size: the same frames with 4 KiB reads split.
        let mut small = Vec::new();
        add_to_jobs(&mut small, a, 0, 0, 0, &meta(1000), 4096);
        add_to_jobs(&mut small, a, 1000, 0, 1, &meta(2000), 4096);
        add_to_jobs(&mut small, a, 3000, 0, 2, &meta(2000), 4096);
        assert_eq!(small.iter().map(|j| j.frames.len()).collect::<Vec<_>>(), vec![2, 1]);
        // Largest first, smallest last; equal sizes keep their order.
        order_reads(&mut jobs);
        let sizes: Vec<u64> = jobs.iter().map(|j| j.end - j.start).collect();
        assert_eq!(sizes, vec![900_000, 3500 + (64 << 10), 300]);
        let mut same = vec![small[1].clone(), small[1].clone()];
        same[1].start = 1;
        same[1].end = 2001;
        order_reads(&mut same);
        assert_eq!(same[0].start, 3000, "stable for equal sizes");
    }

    #[test]
    fn a_packs_small_last_read_is_folded_into_the_one_before() {
        let meta = |len: u32| FrameMeta { len, raw_len: 65536, codec: Codec::Zstd(1), crc: 0, delta: false };
        let (a, b, c) = (PackId([1; 16]), PackId([2; 16]), PackId([3; 16]));
        let mut jobs = Vec::new();
        // Pack a: two full 1 MiB reads and a 100 KB remainder; pack b: a full read and a
        // 300 KB remainder (over a quarter: kept); pack c: a single small read (kept).
        let mut u = 0;
        let mut add = |jobs: &mut Vec<Job>, p: PackId, off: u64, len: u32| {
            add_to_jobs(jobs, p, off, 0, u, &meta(len), 1 << 20);
            u += 1;
        };
        for k in 0..32u64 {
            add(&mut jobs, a, k * 65536, 65536);
        }
        add(&mut jobs, a, 32 * 65536, 100_000);
        for k in 0..16u64 {
            add(&mut jobs, b, k * 65536, 65536);
        }
        add(&mut jobs, b, 16 * 65536, 300_000);
        add(&mut jobs, c, 0, 5_000);
        assert_eq!(jobs.len(), 6);
        let folded = fold_small_tails(jobs, 1 << 20);
        let spans: Vec<(PackId, u64, u64, usize)> = folded.iter().map(|j| (j.pack, j.start, j.end, j.frames.len())).collect();
        assert_eq!(
            spans,
            vec![
                (a, 0, 1 << 20, 16),
                (a, 1 << 20, (2 << 20) + 100_000, 17),
                (b, 0, 1 << 20, 16),
                (b, 1 << 20, (1 << 20) + 300_000, 1),
                (c, 0, 5_000, 1),
            ]
        );
    }

    #[test]
    fn small_checkpoints_get_small_reads() {
        // 24 MB: 1 MiB reads (24 of them, 6 per fetcher); 700 MB: the full 8 MiB.
        assert_eq!(read_size(24 << 20, 8 << 20), MIN_READ);
        assert_eq!(read_size(700 << 20, 8 << 20), 8 << 20);
        assert_eq!(read_size(96 << 20, 8 << 20), 3 << 20);
        // A caller's limit below MIN_READ wins.
        assert_eq!(read_size(24 << 20, 256 << 10), 256 << 10);
        assert!(read_size(0, 8 << 20) >= 1);
    }

    #[test]
    fn par_map_keeps_order_and_reports_the_first_failure() {
        let items: Vec<u32> = (0..100).collect();
        let out = par_map(&items, 7, |x| Ok::<u32, ()>(x * 2)).unwrap();
        assert_eq!(out, items.iter().map(|x| x * 2).collect::<Vec<_>>());
        let err = par_map(&items, 1, |x| if *x >= 40 { Err(*x) } else { Ok(*x) }).unwrap_err();
        assert_eq!(err, (40, 40));
        assert!(par_map(&[] as &[u32], 4, |x| Ok::<u32, ()>(*x)).unwrap().is_empty());
    }
}

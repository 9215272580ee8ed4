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
//! * **Read by frame, not by page.** Pages are stored up to 64 to a compressed frame, so
//!   reading them one `get` at a time would decompress each frame once per page and open the
//!   pack once per page. Instead the plan locates every page under a few holds of the index lock
//!   ([`Store::locate_many`]), sorts the pages by their place in the packs (which also groups
//!   the pages sharing a chunk: one chunk, one place), coalesces nearby frames into reads of
//!   1–8 MiB (sequential within a pack; smaller for a small checkpoint) and orders the reads
//!   largest first, so the last reads, whose decoding cannot overlap the transfer, are the
//!   smallest. [`FETCHERS`] threads keep that many reads in flight and hand the bytes to a
//!   pool of decoders, which check the frame CRC, decompress once, and verify every page
//!   against its BLAKE3 id. (Reads sharing a link end together: with a dozen in flight a small
//!   checkpoint's pages all arrived at the end, and their decoding came after the last byte.)
//!   Planning reads the page maps' leaves in ranged GETs of neighbouring leaves
//!   (`get_chunks`) and checks the packs `MAP_READERS` at a time: on a remote backend
//!   those are round trips, not bytes. The first reads start as soon as they are planned,
//!   while the packs are checked (`prefetch`).
//! * **Verified before sent.** The single writer thread only ever writes pages that a worker
//!   verified; the first damaged page aborts the stream with an error naming the checkpoint and
//!   page, so QEMU never receives bad memory (its load then fails and it exits).
//! * **Delta pages** are rebuilt by the same pool, 64 per job in the order of their records'
//!   places in the packs: record and base page verified against their ids, the rebuilt page
//!   against the page id in the record.
//! * **Any order.** QEMU's loader takes page records in any order, so pages are written as
//!   frames finish, zero pages as ZERO records first, the tail last. A page id used at several
//!   addresses is written at its first with its frame and at the others spread over the rest
//!   of the stream (`spread.rs`: written all at once they would be a burst of faults in
//!   QEMU's loader that stalls the link). The generator checks that every page was written.
#![allow(clippy::result_large_err)] // a MemError is returned once per save or restore

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::error::MemError;
use super::manifest::{
    parse_tail_tree, ref_name, valid_name, Checkpoint, SlotTable, RUN_BYTES, RUN_PAGES,
};
use super::stream::{BlockIdx, GenerateStats, StreamWriter, PAGE_SIZE};
use crate::codec::Codec;
use crate::id::{ChunkId, PackId};
use crate::page_hash::{as_page, hash_pages};
use crate::progress::{Progress, Unit};
use crate::qmp::{QmpClient, QmpError};
use crate::store::format::crc;
use crate::store::map::LEAF_IDS;
use crate::store::objects::{Ref, Tree};
use crate::store::pack::ChunkKind;
use crate::store::{Store, StoreError};

const TARGET: &str = "strata::memory";

mod head;
mod maps;
mod pipeline;
mod plan;
mod spread;
#[cfg(test)]
mod tests;

use head::*;
pub(crate) use maps::par_map;
pub(crate) use maps::read_maps;
pub(crate) use maps::MAP_READERS;
pub use pipeline::{prepare, stream, write_stream, Prepared};
use plan::*;
pub use plan::{read_size, DEFAULT_READ_BYTES, FETCHERS};
use spread::{Spread, MAX_SLOTS};

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
    /// their decoded pages): with 8 MiB reads a 1 GiB restore holds ~200 MB and its target
    /// QEMU spends 2.1 s of system time loading (4.6 s restores); with 2 MiB, 0.4 s (2.5 s)
    /// (`bench save-restore --remote`).
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
    /// Of those, reads started before the stream (head start and prefetch).
    pub early_reads: u64,
    /// This host's copy of the ref (`store/ref_copies.rs`): `used` (planned from it while the
    /// ref was fetched), `stale` (the ref had changed: planned again), `missing` (none yet:
    /// kept now), `not-kept` (a local backend).
    pub ref_copy: String,
    pub vm_status: String,
}

/// What became of this host's copy of the checkpoint's ref.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefCopyUse {
    Used,
    Stale,
    Missing,
    NotKept,
}

impl RefCopyUse {
    fn as_str(self) -> &'static str {
        match self {
            RefCopyUse::Used => "used",
            RefCopyUse::Stale => "stale",
            RefCopyUse::Missing => "missing",
            RefCopyUse::NotKept => "not-kept",
        }
    }
}

/// Read and check the checkpoint ref.
pub fn load_checkpoint(store: &Store, name: &str) -> Result<Checkpoint, MemError> {
    checkpoint_of(name, &fetch_ref(store, name)?)
}

/// The checkpoint's ref, from the backend.
fn fetch_ref(store: &Store, name: &str) -> Result<Ref, MemError> {
    if !valid_name(name) {
        return Err(MemError::BadName { name: name.into() });
    }
    store
        .get_ref(&ref_name(name))
        .map_err(MemError::store("lookup", name))?
        .ok_or_else(|| MemError::NotFound { name: name.into() })
}

fn checkpoint_of(name: &str, r: &Ref) -> Result<Checkpoint, MemError> {
    Checkpoint::from_ref(r).map_err(|source| MemError::Manifest { name: name.into(), source })
}

/// Compare the target QEMU with the checkpoint: machine type and ramblocks.
pub fn check_target(ckpt: &Checkpoint, qmp: &mut QmpClient) -> Result<(), MemError> {
    let m = &ckpt.manifest;
    let path = qmp.path().to_path_buf();
    let status = qmp.query_status().map_err(MemError::qmp("query-status", &path))?;
    if status.status != "inmigrate" {
        return Err(MemError::NotIncoming { path, status: status.status });
    }
    let mismatch = |why: String| MemError::Mismatch { name: m.name.clone(), why };
    let machine = qmp.machine_type().map_err(MemError::qmp("qom-get machine type", &path))?;
    let want = m.stream.machine_type.clone().unwrap_or_else(|| m.qemu.machine_type.clone());
    if machine != want {
        return Err(mismatch(format!(
            "machine type is '{machine}', the checkpoint needs '{want}' (-machine)"
        )));
    }
    let blocks = qmp.ram_blocks().map_err(MemError::qmp("info ramblock", &path))?;
    let mut problems = Vec::new();
    for b in &m.blocks {
        match blocks.iter().find(|t| t.name == b.name) {
            None => problems.push(format!(
                "ramblock '{}' ({} KiB) is missing",
                b.name,
                b.used_len >> 10
            )),
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

fn page_of(ckpt: &Checkpoint, r: (u32, u32)) -> (String, u64) {
    (ckpt.manifest.blocks[r.0 as usize].name.clone(), r.1 as u64 * PAGE_SIZE as u64)
}

fn load_tail(store: &Store, ckpt: &Checkpoint) -> Result<Vec<u8>, MemError> {
    let name = &ckpt.manifest.name;
    let dmg = |what: &str, source: StoreError| MemError::MetaDamaged {
        name: name.clone(),
        what: what.into(),
        source,
    };
    let raw = store.get(&ckpt.tail_root).map_err(|e| dmg("device-state tail tree", e))?;
    let tree = Tree::decode(&raw).map_err(|source| {
        dmg(
            "device-state tail tree",
            StoreError::Format { key: format!("chunk {}", ckpt.tail_root), source },
        )
    })?;
    let (pieces, len) = parse_tail_tree(&tree)
        .map_err(|source| MemError::Manifest { name: name.clone(), source })?;
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

/// Restore checkpoint `name` into the QEMU behind `qmp` (started with `-incoming defer`).
/// Stages: load the ref while checking the target and planning; open QEMU's incoming socket;
/// stream; wait until QEMU has loaded the state; resume.
pub fn restore(
    store: &Store,
    name: &str,
    qmp: &mut QmpClient,
    opts: &RestoreOptions,
    progress: &dyn Progress,
) -> Result<RestoreReport, MemError> {
    let t0 = Instant::now();
    if !valid_name(name) {
        return Err(MemError::BadName { name: name.into() });
    }
    let mut candidates = Candidates::default();
    let loaded = load_and_prepare(store, name, qmp, opts, t0, &mut candidates)?;
    loaded.checked?;
    let checked_and_planned_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prepared = loaded.prepared.map_err(|_| MemError::Panic { what: "restore planner" })??;
    let (conn, _cleanup) = connect_incoming(qmp, opts)?;
    tracing::debug!(target: TARGET, name, ref_copy = loaded.ref_copy.as_str(), loaded_ms = loaded.loaded_ms, checked_and_planned_ms, connected_ms = t0.elapsed().as_secs_f64() * 1e3, "restore connected");
    let (conn, mut report) = stream(prepared, conn, opts, progress)?;
    report.ref_copy = loaded.ref_copy.as_str().to_string();
    let _ = conn.shutdown(std::net::Shutdown::Write);
    drop(conn);
    wait_loaded(qmp, name, opts.load_timeout)?;
    report.load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let path = qmp.path().to_path_buf();
    if opts.resume {
        let s = qmp.query_status().map_err(MemError::qmp("query-status", &path))?;
        if !s.running {
            qmp.cont().map_err(MemError::qmp("cont", &path))?;
        }
    }
    report.vm_status = qmp.query_status().map(|s| s.status).unwrap_or_else(|_| "unknown".into());
    report.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    tracing::info!(target: TARGET, name, total_ms = report.total_ms, "checkpoint restored");
    Ok(report)
}

/// The checkpoints a restore may plan from: this host's copy of the ref (a guess), and the
/// one fetched from the store when it differs or there is no copy.
#[derive(Default)]
struct Candidates {
    copy: Option<(Ref, Checkpoint)>,
    fetched: Option<Checkpoint>,
}

/// The target check's result and the plan, from the checkpoint the store holds.
struct Loaded<'a> {
    checked: Result<(), MemError>,
    prepared: std::thread::Result<Result<Prepared<'a>, MemError>>,
    ref_copy: RefCopyUse,
    loaded_ms: f64,
}

/// The target check (a few QMP queries) runs while the plan reads the page maps: neither
/// changes the target, so a restore that fails here still leaves QEMU untouched. A wrong
/// target is reported before a damaged checkpoint, as when they run one after the other.
fn check_and_prepare<'a>(
    store: &'a Store,
    ckpt: &'a Checkpoint,
    qmp: &mut QmpClient,
    opts: &RestoreOptions,
) -> (Result<(), MemError>, std::thread::Result<Result<Prepared<'a>, MemError>>) {
    std::thread::scope(|s| {
        let plan = std::thread::Builder::new()
            .name("strata-plan".into())
            .spawn_scoped(s, || prepare(store, ckpt, opts))
            .expect("spawn restore planner");
        let checked = check_target(ckpt, qmp);
        (checked, plan.join())
    })
}

/// Load the checkpoint's ref, checking the target and planning meanwhile. With a copy of the
/// ref that this host wrote or read before (`store/ref_copies.rs`), the plan and the target
/// check start from it while the backend's ref is fetched, and are kept only if that ref is
/// the same. Otherwise (another host replaced it) they are done again from the fetched ref;
/// the guess's early reads end on their own threads.
fn load_and_prepare<'a>(
    store: &'a Store,
    name: &str,
    qmp: &mut QmpClient,
    opts: &RestoreOptions,
    t0: Instant,
    candidates: &'a mut Candidates,
) -> Result<Loaded<'a>, MemError> {
    let rname = ref_name(name);
    let Candidates { copy, fetched: fetched_ckpt } = candidates;
    *copy = store
        .ref_copies()
        .and_then(|c| c.get(&rname))
        .and_then(|r| Checkpoint::from_ref(&r).ok().map(|ck| (r, ck)));
    let keep_copy = |r: &Ref| {
        if let Some(c) = store.ref_copies() {
            c.put(&rname, r);
        }
    };
    let Some((copy_ref, guess)) = copy.as_ref() else {
        let r = fetch_ref(store, name)?;
        let loaded_ms = t0.elapsed().as_secs_f64() * 1e3;
        let ckpt: &'a Checkpoint = fetched_ckpt.insert(checkpoint_of(name, &r)?);
        keep_copy(&r);
        let ref_copy =
            if store.ref_copies().is_some() { RefCopyUse::Missing } else { RefCopyUse::NotKept };
        let (checked, prepared) = check_and_prepare(store, ckpt, qmp, opts);
        return Ok(Loaded { checked, prepared, ref_copy, loaded_ms });
    };
    let (fetched, loaded_ms, guessed) = std::thread::scope(|s| {
        let fetch = s.spawn(|| {
            let r = fetch_ref(store, name);
            (r, t0.elapsed().as_secs_f64() * 1e3)
        });
        let guessed = check_and_prepare(store, guess, qmp, opts);
        let (r, ms) = fetch.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (r, ms, guessed)
    });
    let fetched = match fetched {
        Ok(r) => r,
        Err(e) => {
            if matches!(e, MemError::NotFound { .. }) {
                if let Some(c) = store.ref_copies() {
                    c.remove(&rname);
                }
            }
            return Err(e);
        }
    };
    if fetched == *copy_ref {
        let (checked, prepared) = guessed;
        return Ok(Loaded { checked, prepared, ref_copy: RefCopyUse::Used, loaded_ms });
    }
    tracing::info!(
        target: TARGET,
        name,
        copy_generation = copy_ref.generation,
        generation = fetched.generation,
        "Checkpoint was replaced since this host's copy of its ref; planning again from the store's"
    );
    drop(guessed);
    keep_copy(&fetched);
    let ckpt: &'a Checkpoint = fetched_ckpt.insert(checkpoint_of(name, &fetched)?);
    let (checked, prepared) = check_and_prepare(store, ckpt, qmp, opts);
    Ok(Loaded { checked, prepared, ref_copy: RefCopyUse::Stale, loaded_ms })
}

/// Have QEMU listen on a fresh unix socket (`migrate-incoming`) and connect to it, retrying
/// for up to 5 s while QEMU opens it. The socket file is removed when the guard drops.
fn connect_incoming(
    qmp: &mut QmpClient,
    opts: &RestoreOptions,
) -> Result<(UnixStream, Remove), MemError> {
    let path = qmp.path().to_path_buf();
    let dir = opts.socket_dir.clone().unwrap_or_else(std::env::temp_dir);
    let sock =
        dir.join(format!("strata-in-{}-{:08x}.sock", std::process::id(), rand::random::<u32>()));
    qmp.migrate_incoming(&format!("unix:{}", sock.display()))
        .map_err(MemError::qmp("migrate-incoming", &path))?;
    let cleanup = Remove(sock.clone());
    let mut last = None;
    for _ in 0..500 {
        match UnixStream::connect(&sock) {
            Ok(s) => return Ok((s, cleanup)),
            Err(e) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    Err(MemError::Io {
        op: "connect to QEMU's incoming socket",
        path: sock,
        source: last.expect("an error"),
    })
}

/// Poll `query-migrate` until QEMU has loaded the stream: an error if it fails, exits, or is
/// not done within `timeout`.
fn wait_loaded(qmp: &mut QmpClient, name: &str, timeout: Duration) -> Result<(), MemError> {
    let deadline = Instant::now() + timeout;
    loop {
        match qmp.query_migrate() {
            Ok(i) if i.status == "completed" => return Ok(()),
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
                    desc: format!("not loaded after {timeout:?}"),
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
                let path = qmp.path().to_path_buf();
                return Err(MemError::Qmp { op: "query-migrate", path, source });
            }
        }
    }
}

struct Remove(PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

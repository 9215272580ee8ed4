//! Disk images on the chunk store: a ref `disk/<name>` naming a block map root, with the
//! image's size and block size in its JSON payload.
//!
//! This file has the immutable-image operations (import, export, list, remove, full clone);
//! all-zero blocks are holes and cost nothing. Import reads the source sequentially and hashes
//! and compresses blocks on all cores.

pub mod compact;
pub mod cut;
pub mod extent;
pub mod log;
pub mod volume;

use crate::codec::{byte_entropy, Codec};
use crate::id::ChunkId;
use crate::progress::{Progress, Unit};
use crate::store::map;
use crate::store::objects::Ref;
use crate::store::pack::ChunkKind;
use crate::store::{Store, StoreError};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub(crate) const DEFAULT_BLOCK: u32 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("Disk '{name}' does not exist (list disks with `strata disk list`)")]
    NotFound { name: String },
    #[error("Disk '{name}' already exists: remove it first or pick another name")]
    Exists { name: String },
    #[error("Disk '{name}' has unreadable metadata")]
    BadMeta {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("Cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("Disk log problem: {0}")]
    Log(String),
    #[error("'{name}' is a snapshot and cannot be written: clone it to get a writable disk")]
    ReadOnlySnapshot { name: String },
    #[error("Disk '{name}' is open in another strata process (stop it, or go through its daemon)")]
    InUse { name: String },
    #[error("Disk '{name}' has {clients} NBD client(s) connected: stop them first, or pass --force to disconnect them")]
    Connected { name: String, clients: usize },
    #[error(
        "Disk '{name}' refuses I/O after a failed write ({reason}); fix the cause and reopen it"
    )]
    Failed { name: String, reason: String },
    #[error("{op} of {len} bytes at offset {offset} is outside the disk ({size} bytes)")]
    OutOfRange { op: &'static str, offset: u64, len: u64, size: u64 },
    #[error("Invalid disk name '{name}': use letters, digits and '._-', without '@' or '/'")]
    BadName { name: String },
}

pub type Result<T> = std::result::Result<T, DiskError>;

/// Bytes at the start of a block that are compressed to decide whether the block is.
const SAMPLE: usize = 16 << 10;

/// The codec to store a disk block with: `codec` if a sample of the block shrinks by at least
/// 1/8, else none. Barely compressible blocks stored raw are read 4 KiB at a time through
/// verified piece reads (`store/slice.rs`) instead of a whole-block decompression per random
/// read; ZFS draws its line at the same 12.5%.
///
/// The trial compression is skipped when the sample's bytes look uniform (Shannon entropy
/// above [`UNIFORM_BITS`] per byte): encrypted data (a BitLocker or LUKS guest writes nothing
/// else) and already-compressed media. The histogram costs a fraction of the LZ4 pass, while
/// the trial takes 11% of all CPU samples under sustained incompressible writes (the `io`
/// benchmark, `docs/results`). btrfs's compression heuristic makes the same check.
pub(crate) fn block_codec(data: &[u8], codec: Codec) -> Codec {
    if codec == Codec::None {
        return codec;
    }
    let s = &data[..data.len().min(SAMPLE)];
    if sampled_entropy(s) > UNIFORM_BITS {
        return Codec::None;
    }
    match codec.compress(s) {
        Some(z) if z.len() <= s.len() - s.len() / 8 => codec,
        _ => Codec::None,
    }
}

/// Bits per byte above which a sample counts as uniform (see [`block_codec`]). 4 KiB of
/// uniform random bytes measure 7.95 (the histogram of a finite sample is never flat). The
/// line is drawn high because byte entropy does not see LZ4's matches: of 304 blocks of this
/// machine's files at 7.5 bits or more, 11 still shrink by 1/8 (jars, some `.gz`), but 1 of
/// 226 at 7.9 or more (`docs/disks.md`). fio's buffers measure 7.53-7.9, so the `io`
/// benchmark mostly still pays the trial.
const UNIFORM_BITS: f64 = 7.9;

/// [`byte_entropy`] of four 1 KiB runs spread over `s` (a histogram of the whole 16 KiB sample
/// cost a third of the LZ4 pass it saves). Runs, not scattered bytes: fio's buffers, for one,
/// have a 256-byte structure that 64 runs of 64 bytes at a 256-byte stride mistook for lower
/// entropy (7.56 bits against 7.85 for 4 KiB in one piece). 4 KiB of uniform bytes measure
/// ~7.95.
fn sampled_entropy(s: &[u8]) -> f64 {
    const RUN: usize = 1024;
    const RUNS: usize = 4;
    if s.len() <= RUN * RUNS {
        return byte_entropy(&[s]);
    }
    let stride = s.len() / RUNS;
    let parts: [&[u8]; RUNS] = std::array::from_fn(|i| &s[i * stride..i * stride + RUN]);
    byte_entropy(&parts)
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct DiskMeta {
    pub size: u64,
    pub block_size: u32,
    #[serde(default)]
    pub parent: Option<String>,
    /// Identity of the disk's local write log (hex); absent on snapshots.
    #[serde(default)]
    pub id: Option<String>,
    /// Set on snapshots: the disk this is an immutable snapshot of.
    #[serde(default)]
    pub snapshot_of: Option<String>,
    /// Number of the newest write-log file folded into this map (version 2 logs); logs up to
    /// it are obsolete, later ones are replayed on top.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_folded: Option<u64>,
    /// Allocated (non-hole) blocks of the map, so `info` need not read the whole map (for a
    /// 30 GiB image that is 15 MiB of leaves through the link). Absent in refs written before
    /// it existed: then the map is counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u64>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DiskInfo {
    pub name: String,
    pub size: u64,
    pub block_size: u32,
    pub allocated_blocks: u64,
    pub root: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_of: Option<String>,
}

fn new_id() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

pub fn ref_name(name: &str) -> String {
    format!("disk/{name}")
}

pub(crate) fn load(store: &Store, name: &str) -> Result<(Ref, DiskMeta)> {
    let r =
        store.get_ref(&ref_name(name))?.ok_or_else(|| DiskError::NotFound { name: name.into() })?;
    let m: DiskMeta = serde_json::from_slice(&r.payload)
        .map_err(|source| DiskError::BadMeta { name: name.into(), source })?;
    Ok((r, m))
}

/// Import a raw image file as disk `name`.
pub fn import(
    store: &Store,
    name: &str,
    file: &Path,
    codec: Codec,
    progress: &dyn Progress,
) -> Result<DiskInfo> {
    check_name(name)?;
    // One writer per name, across hosts (docs/backends.md).
    let _lease = store.lease_if_needed(&ref_name(name))?;
    if store.get_ref(&ref_name(name))?.is_some() {
        return Err(DiskError::Exists { name: name.into() });
    }
    let io = |op, e| DiskError::Io { op, path: file.to_path_buf(), source: e };
    let f = File::open(file).map_err(|e| io("open", e))?;
    let size = f.metadata().map_err(|e| io("stat", e))?.len();
    let bs = DEFAULT_BLOCK as usize;
    progress.phase("importing", Some(size), Unit::Bytes);
    let ses = store.session();
    let mut blocks = Vec::with_capacity(size.div_ceil(bs as u64) as usize);
    // Holes (SEEK_DATA/SEEK_HOLE) are skipped without reading; data is read in batches whose
    // blocks are hashed and compressed in parallel, in order.
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let fd = f.as_raw_fd();
    let seek = |off: u64, whence: libc::c_int| -> Option<u64> {
        // SAFETY: lseek on a valid fd; returns -1 (ENXIO) past the last data.
        let r = unsafe { libc::lseek(fd, off as libc::off_t, whence) };
        (r >= 0).then_some(r as u64)
    };
    let nblocks = size.div_ceil(bs as u64);
    let batch = 64u64;
    let mut buf = vec![0u8; bs * batch as usize];
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut blk = 0u64;
    while blk < nblocks {
        let pos = blk * bs as u64;
        let data_at = seek(pos, libc::SEEK_DATA).unwrap_or(size);
        let skip = (data_at.saturating_sub(pos) / bs as u64).min(nblocks - blk);
        if skip > 0 {
            blocks.extend(std::iter::repeat_n(ChunkId::ZERO, skip as usize));
            progress.advance((skip * bs as u64).min(size - pos));
            blk += skip;
            continue;
        }
        let hole_at = seek(pos, libc::SEEK_HOLE).unwrap_or(size).max(pos + 1);
        let n = (hole_at - pos).div_ceil(bs as u64).min(batch).min(nblocks - blk);
        let want = ((n * bs as u64).min(size - pos)) as usize;
        let mut filled = 0;
        while filled < want {
            let r = f
                .read_at(&mut buf[filled..want], pos + filled as u64)
                .map_err(|e| io("read", e))?;
            if r == 0 {
                break;
            }
            filled += r;
        }
        buf[filled..want].fill(0);
        let parts: Vec<&[u8]> = buf[..want].chunks(bs).collect();
        let per = parts.len().div_ceil(threads);
        let ids: Vec<ChunkId> = std::thread::scope(|sc| {
            let hs: Vec<_> = parts
                .chunks(per.max(1))
                .map(|group| {
                    let ses = &ses;
                    sc.spawn(move || -> std::result::Result<Vec<ChunkId>, StoreError> {
                        group
                            .iter()
                            .map(|b| {
                                if b.iter().all(|&x| x == 0) {
                                    Ok(ChunkId::ZERO)
                                } else {
                                    ses.put_with(b, ChunkKind::Data, block_codec(b, codec))
                                }
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("import worker"))
                .collect::<std::result::Result<Vec<_>, _>>()
        })?
        .into_iter()
        .flatten()
        .collect();
        blocks.extend(ids);
        progress.advance(want as u64);
        blk += n;
    }
    let root = map::write_map(&ses, &blocks)?;
    let allocated = Some(blocks.iter().filter(|b| !b.is_zero()).count() as u64);
    let meta = DiskMeta {
        size,
        block_size: DEFAULT_BLOCK,
        parent: None,
        id: Some(new_id()),
        snapshot_of: None,
        log_folded: None,
        allocated,
    };
    ses.commit_ref(
        &ref_name(name),
        Ref::new(vec![root], serde_json::to_vec(&meta).expect("json")),
    )?;
    progress.finish();
    info(store, name)
}

/// Write disk `name` to a raw file (sparse: holes are skipped).
pub fn export(store: &Store, name: &str, file: &Path, progress: &dyn Progress) -> Result<u64> {
    let (r, m) = settle(store, name)?;
    export_root(store, &r.roots[0], &m, file, progress)
}

/// Write the content of block map `root` (a disk of geometry `m`) to a raw file (sparse).
pub fn export_root(
    store: &Store,
    root: &ChunkId,
    m: &DiskMeta,
    file: &Path,
    progress: &dyn Progress,
) -> Result<u64> {
    let blocks = map::read_map(store, root)?;
    let io = |op, e| DiskError::Io { op, path: file.to_path_buf(), source: e };
    let mut f = File::create(file).map_err(|e| io("create", e))?;
    progress.phase("exporting", Some(m.size), Unit::Bytes);
    use std::io::{Seek, SeekFrom};
    for (i, id) in blocks.iter().enumerate() {
        let off = i as u64 * m.block_size as u64;
        let len = (m.size - off).min(m.block_size as u64);
        if !id.is_zero() {
            let data = store.get(id)?;
            f.seek(SeekFrom::Start(off)).map_err(|e| io("seek", e))?;
            f.write_all(&data[..len as usize]).map_err(|e| io("write", e))?;
        }
        progress.advance(len);
    }
    f.set_len(m.size).map_err(|e| io("truncate", e))?;
    f.sync_all().map_err(|e| io("sync", e))?;
    progress.finish();
    Ok(m.size)
}

fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(DiskError::BadName { name: name.into() })
    }
}

/// Create an empty (all-holes) disk of `size` bytes. O(metadata).
pub fn create(store: &Store, name: &str, size: u64) -> Result<DiskInfo> {
    check_name(name)?;
    // One writer per name, across hosts (docs/backends.md).
    let _lease = store.lease_if_needed(&ref_name(name))?;
    if store.get_ref(&ref_name(name))?.is_some() {
        return Err(DiskError::Exists { name: name.into() });
    }
    let bs = DEFAULT_BLOCK as u64;
    let ses = store.session();
    let root = map::write_map(&ses, &vec![ChunkId::ZERO; size.div_ceil(bs) as usize])?;
    let meta = DiskMeta {
        size,
        block_size: DEFAULT_BLOCK,
        parent: None,
        id: Some(new_id()),
        snapshot_of: None,
        log_folded: None,
        allocated: Some(0),
    };
    ses.commit_ref(
        &ref_name(name),
        Ref::new(vec![root], serde_json::to_vec(&meta).expect("json")),
    )?;
    info(store, name)
}

/// Fold a writable disk's log into its base map so its ref is complete (needs the disk not
/// to be open elsewhere). Snapshots are always complete.
fn settle(store: &Store, name: &str) -> Result<(Ref, DiskMeta)> {
    let (r, m) = load(store, name)?;
    if m.snapshot_of.is_none() {
        if !volume::has_unfolded_log(store, name, &m)? {
            // Nothing to fold: the ref is the disk's content, and the map need not be loaded
            // (cloning a large image stays O(1) objects).
            return Ok((r, m));
        }
        let v = volume::Volume::open(store, name)?;
        v.close()?;
    }
    load(store, name)
}

/// Immutable snapshot `disk@snap` of a disk's current content. O(metadata) after the log is folded.
pub fn snapshot(store: &Store, name: &str, snap: &str) -> Result<DiskInfo> {
    check_name(name)?;
    check_name(snap)?;
    let full = format!("{name}@{snap}");
    let _lease = store.lease_if_needed(&ref_name(&full))?;
    if store.get_ref(&ref_name(&full))?.is_some() {
        return Err(DiskError::Exists { name: full });
    }
    let (r, m) = settle(store, name)?;
    if m.snapshot_of.is_some() {
        return Err(DiskError::ReadOnlySnapshot { name: name.into() });
    }
    commit_snapshot_ref(store, name, snap, &r.roots, m)
}

/// Commit `name@snap` with these roots and `m` as the disk's description (under the
/// caller's lease on the snapshot's name).
fn commit_snapshot_ref(
    store: &Store,
    name: &str,
    snap: &str,
    roots: &[ChunkId],
    mut m: DiskMeta,
) -> Result<DiskInfo> {
    let full = format!("{name}@{snap}");
    let ses = store.session();
    for root in roots {
        ses.pin(*root)?;
    }
    m.snapshot_of = Some(name.into());
    m.id = None;
    m.log_folded = None;
    ses.commit_new_ref(
        &ref_name(&full),
        Ref::new(roots.to_vec(), serde_json::to_vec(&m).expect("json")),
    )
    .map_err(|e| match e {
        StoreError::RefExists { .. } => DiskError::Exists { name: full.clone() },
        other => other.into(),
    })?;
    info(store, &full)
}

/// Name a cut of an open disk (`cut.rs`), folded, as the snapshot `name@snap`: the
/// snapshot of a disk that is being served.
pub fn commit_cut_snapshot(store: &Store, snap: &str, folded: &cut::Folded) -> Result<DiskInfo> {
    check_name(snap)?;
    let name = folded.name.as_str();
    let full = format!("{name}@{snap}");
    let _lease = store.lease_if_needed(&ref_name(&full))?;
    if store.get_ref(&ref_name(&full))?.is_some() {
        return Err(DiskError::Exists { name: full });
    }
    commit_snapshot_ref(store, name, snap, &[folded.root], folded.meta.clone())
}

/// Clone a disk or snapshot (`src` or `src@snap`) into a new writable disk. Linked and full
/// clones both share the source's block map: O(metadata), no data copied. A linked clone
/// records its parent; a full clone is independent of it from the start (in a
/// content-addressed store sharing chunks is safe either way: GC keeps what any ref reaches).
pub fn clone(store: &Store, src: &str, dst: &str, full: bool) -> Result<DiskInfo> {
    check_name(dst)?;
    // One writer per name, across hosts (docs/backends.md).
    let _lease = store.lease_if_needed(&ref_name(dst))?;
    if store.get_ref(&ref_name(dst))?.is_some() {
        return Err(DiskError::Exists { name: dst.into() });
    }
    let (r, m) = settle(store, src)?;
    commit_clone_ref(store, dst, &r.roots, m, if full { None } else { Some(src.into()) })
}

/// Clone content given by a block map root (a folded cut, or one disk of a desktop
/// snapshot) into a new writable disk `dst` whose parent is `parent`.
pub fn clone_root(
    store: &Store,
    dst: &str,
    root: ChunkId,
    meta: DiskMeta,
    parent: Option<String>,
) -> Result<DiskInfo> {
    check_name(dst)?;
    let _lease = store.lease_if_needed(&ref_name(dst))?;
    if store.get_ref(&ref_name(dst))?.is_some() {
        return Err(DiskError::Exists { name: dst.into() });
    }
    commit_clone_ref(store, dst, &[root], meta, parent)
}

fn commit_clone_ref(
    store: &Store,
    dst: &str,
    roots: &[ChunkId],
    mut m: DiskMeta,
    parent: Option<String>,
) -> Result<DiskInfo> {
    let ses = store.session();
    for root in roots {
        ses.pin(*root)?;
    }
    m.parent = parent;
    m.id = Some(new_id());
    m.snapshot_of = None;
    m.log_folded = None;
    ses.commit_new_ref(
        &ref_name(dst),
        Ref::new(roots.to_vec(), serde_json::to_vec(&m).expect("json")),
    )
    .map_err(|e| match e {
        StoreError::RefExists { .. } => DiskError::Exists { name: dst.into() },
        other => other.into(),
    })?;
    info(store, dst)
}

/// Point writable disk `name` at `root` (its content becomes the one `meta` describes) with a
/// fresh log identity, so the log of its old content is never replayed on the new one. The
/// disk must not be open (`Volume::open` would refuse it elsewhere; the serving daemon closes
/// it first). The old local log goes.
pub fn revert(store: &Store, name: &str, root: ChunkId, meta: &DiskMeta) -> Result<DiskInfo> {
    let _lease = store.lease_if_needed(&ref_name(name))?;
    let (_, old) = load(store, name)?;
    // The disk's lock: refused while something has it open.
    let _lock = volume::lock_disk(store, name, &old)?;
    revert_released(store, name, root, meta)
}

/// [`revert`] for the serving daemon, which has closed its volume of the disk and revoked
/// its exports (`serve/ops.rs`).
pub fn revert_released(
    store: &Store,
    name: &str,
    root: ChunkId,
    meta: &DiskMeta,
) -> Result<DiskInfo> {
    let _lease = store.lease_if_needed(&ref_name(name))?;
    let (_, old) = load(store, name)?;
    if old.snapshot_of.is_some() {
        return Err(DiskError::ReadOnlySnapshot { name: name.into() });
    }
    let mut m = meta.clone();
    m.parent = old.parent.clone();
    m.id = Some(new_id());
    m.snapshot_of = None;
    m.log_folded = None;
    let ses = store.session();
    ses.pin(root)?;
    ses.commit_ref(&ref_name(name), Ref::new(vec![root], serde_json::to_vec(&m).expect("json")))?;
    if let Some(id) = &old.id {
        remove_log_dir(store.local_dir().join("disks").join(id))?;
    }
    info(store, name)
}

/// Full clone (kept for callers of the first API).
pub fn clone_full(store: &Store, src: &str, dst: &str) -> Result<DiskInfo> {
    clone(store, src, dst, true)
}

pub fn info(store: &Store, name: &str) -> Result<DiskInfo> {
    let (r, m) = load(store, name)?;
    let allocated = match m.allocated {
        Some(n) => n,
        None => map::read_map(store, &r.roots[0])?.iter().filter(|b| !b.is_zero()).count() as u64,
    };
    Ok(DiskInfo {
        name: name.into(),
        size: m.size,
        block_size: m.block_size,
        allocated_blocks: allocated,
        root: r.roots[0].to_hex(),
        parent: m.parent,
        snapshot_of: m.snapshot_of,
    })
}

pub fn list(store: &Store) -> Result<Vec<DiskInfo>> {
    store
        .list_refs("disk/")?
        .iter()
        .filter_map(|n| n.strip_prefix("disk/"))
        .map(|n| info(store, n))
        .collect()
}

/// Remove a disk or snapshot; its local log goes too. Space returns with `strata gc`.
pub fn remove(store: &Store, name: &str) -> Result<()> {
    let _lease = store.lease_if_needed(&ref_name(name))?;
    let (_, m) = load(store, name)?;
    // Take the disk's lock so a running server can't be writing it.
    let _lock = volume::lock_disk(store, name, &m)?;
    remove_released(store, name)
}

/// [`remove`] for the serving daemon, which has closed its volume of the disk and revoked
/// its exports (`serve/ops.rs`): connections that have not gone yet still hold the lock.
pub fn remove_released(store: &Store, name: &str) -> Result<()> {
    let _lease = store.lease_if_needed(&ref_name(name))?;
    let (_, m) = load(store, name)?;
    let dir = m.id.as_ref().map(|id| store.local_dir().join("disks").join(id));
    store.delete_ref(&ref_name(name))?;
    if let Some(dir) = dir {
        remove_log_dir(dir)?;
    }
    Ok(())
}

fn remove_log_dir(dir: PathBuf) -> Result<()> {
    std::fs::remove_dir_all(&dir)
        .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
        .map_err(|e| DiskError::Io { op: "remove", path: dir, source: e })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;
    use crate::store::InitOptions;

    #[test]
    fn byte_entropy_tells_uniform_bytes_from_compressible_ones() {
        assert_eq!(byte_entropy(&[]), 0.0);
        assert_eq!(byte_entropy(&[&[], &[]]), 0.0);
        assert_eq!(byte_entropy(&[&[7u8; 4096]]), 0.0);
        let all: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        assert!((byte_entropy(&[&all]) - 8.0).abs() < 1e-9);
        assert!(
            (byte_entropy(&[&all[..1000], &all[1000..]]) - 8.0).abs() < 1e-9,
            "parts count together"
        );
        let two: Vec<u8> = (0..4097u32).map(|i| (i % 2) as u8).collect();
        assert!((byte_entropy(&[&two]) - 1.0).abs() < 1e-3);
        let random: Vec<u8> = (0..SAMPLE).map(|_| rand::random::<u8>()).collect();
        assert!(byte_entropy(&[&random]) > 7.9);
        let text = b"The quick brown fox jumps over the lazy dog; 0123456789.\n".repeat(300);
        assert!(byte_entropy(&[&text]) < 5.5);
        // The spread sample sees what the whole does.
        assert!(sampled_entropy(&random) > 7.9);
        assert!(sampled_entropy(&text[..SAMPLE]) < 5.5);
        assert_eq!(sampled_entropy(&text[..100]), byte_entropy(&[&text[..100]]));
        let mut half = random.clone();
        half[SAMPLE / 2..].fill(0);
        let h = sampled_entropy(&half);
        assert!(h > 4.5 && h < 5.2, "both halves seen: {h}");
    }

    #[test]
    fn blocks_are_stored_raw_only_when_they_would_not_shrink_by_an_eighth() {
        let random: Vec<u8> = (0..DEFAULT_BLOCK).map(|_| rand::random::<u8>()).collect();
        assert_eq!(block_codec(&random, Codec::Lz4), Codec::None);
        // The check is seen, and its known cost: 8 KiB twice over is half LZ4's size, but the
        // four sampled runs hold every byte value equally often, so no trial runs.
        let mut r = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            r
        };
        let mut x: Vec<u8> = (0..8192).map(|_| next() as u8).collect();
        for run in [0, 4096] {
            let mut v: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
            for i in (1..v.len()).rev() {
                v.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            x[run..run + 1024].copy_from_slice(&v);
        }
        let mut twice = [x.clone(), x].concat();
        twice.extend_from_slice(&random[SAMPLE..]);
        assert!((sampled_entropy(&twice[..SAMPLE]) - 8.0).abs() < 1e-9);
        assert!(Codec::Lz4.compress(&twice[..SAMPLE]).unwrap().len() < SAMPLE * 5 / 8);
        assert_eq!(
            block_codec(&twice, Codec::Lz4),
            Codec::None,
            "uniform-looking samples skip the trial"
        );
        // Not uniform, and no repeats for LZ4: the trial decides (raw).
        let six: Vec<u8> = (0..DEFAULT_BLOCK).map(|_| rand::random::<u8>() & 0x3f).collect();
        assert!(sampled_entropy(&six[..SAMPLE]) < UNIFORM_BITS);
        assert_eq!(block_codec(&six, Codec::Lz4), Codec::None);
        // ... but zstd's entropy coder saves two bits in eight.
        assert_eq!(block_codec(&six, Codec::Zstd(1)), Codec::Zstd(1));
        let text = b"The quick brown fox jumps over the lazy dog; 0123456789.\n".repeat(1200);
        assert_eq!(block_codec(&text[..DEFAULT_BLOCK as usize], Codec::Lz4), Codec::Lz4);
        assert_eq!(block_codec(&text, Codec::None), Codec::None);
    }

    #[test]
    fn sparse_files_import_without_reading_holes() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let s = Store::init_local(&d.path().join("s"), InitOptions::default()).unwrap();
        let img = d.path().join("sparse.raw");
        let f = File::create(&img).unwrap();
        let size = (1u64 << 30) + 12345;
        f.set_len(size).unwrap();
        let mut expect = vec![];
        for (i, off) in
            [0u64, 7 << 20, 300 << 20, (1 << 30) - 100, (1 << 30) + 12000].into_iter().enumerate()
        {
            let data = vec![i as u8 + 1; 200];
            f.write_all_at(&data, off).unwrap();
            expect.push((off, data));
        }
        drop(f);
        let t = std::time::Instant::now();
        let i = import(&s, "sp", &img, Codec::Lz4, &NoProgress).unwrap();
        assert!(t.elapsed().as_secs() < 10, "holes were read");
        assert_eq!(i.size, size);
        assert_eq!(i.allocated_blocks, 5);
        let out = d.path().join("out.raw");
        export(&s, "sp", &out, &NoProgress).unwrap();
        let back = File::open(&out).unwrap();
        assert_eq!(back.metadata().unwrap().len(), size);
        for (off, data) in expect {
            let mut b = vec![0u8; 200];
            back.read_exact_at(&mut b, off).unwrap();
            assert_eq!(b, data, "at {off}");
        }
    }

    #[test]
    fn import_export_clone_round_trip_with_holes() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::init_local(&d.path().join("s"), InitOptions::default()).unwrap();
        let img = d.path().join("img.raw");
        let mut data = vec![0u8; 5 * 1024 * 1024 + 1234];
        for (i, b) in data.iter_mut().enumerate().skip(300_000).take(2_000_000) {
            *b = (i % 253) as u8;
        }
        std::fs::write(&img, &data).unwrap();
        let i = import(&s, "golden", &img, Codec::Lz4, &NoProgress).unwrap();
        assert_eq!(i.size, data.len() as u64);
        assert!(i.allocated_blocks < 40 && i.allocated_blocks > 25, "{i:?}");
        assert!(matches!(
            import(&s, "golden", &img, Codec::Lz4, &NoProgress),
            Err(DiskError::Exists { .. })
        ));
        let c = clone_full(&s, "golden", "desk1").unwrap();
        assert_eq!(c.root, i.root, "full clone shares the map");
        let out = d.path().join("out.raw");
        export(&s, "desk1", &out, &NoProgress).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), data);
        remove(&s, "golden").unwrap();
        s.gc(&NoProgress).unwrap();
        export(&s, "desk1", &out, &NoProgress).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), data);
        assert_eq!(list(&s).unwrap().len(), 1);
    }

    /// Counts reads of pack bytes (block-map leaves and data chunks).
    #[derive(Debug)]
    struct CountPackReads(crate::backend::DynBackend, std::sync::atomic::AtomicU64);

    impl crate::backend::Backend for CountPackReads {
        fn name(&self) -> String {
            self.0.name()
        }
        fn capabilities(&self) -> crate::backend::Capabilities {
            self.0.capabilities()
        }
        fn get(&self, key: &str) -> crate::backend::BResult<Vec<u8>> {
            if key.starts_with("packs/") {
                self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.0.get(key)
        }
        fn get_range(&self, key: &str, offset: u64, len: u64) -> crate::backend::BResult<Vec<u8>> {
            if key.starts_with("packs/") {
                self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.0.get_range(key, offset, len)
        }
        fn put(&self, key: &str, data: &[u8]) -> crate::backend::BResult<()> {
            self.0.put(key, data)
        }
        fn put_if_absent(&self, key: &str, data: &[u8]) -> crate::backend::BResult<bool> {
            self.0.put_if_absent(key, data)
        }
        fn list(&self, prefix: &str) -> crate::backend::BResult<Vec<crate::backend::ObjectInfo>> {
            self.0.list(prefix)
        }
        fn delete(&self, key: &str) -> crate::backend::BResult<()> {
            self.0.delete(key)
        }
        fn sync(&self) -> crate::backend::BResult<()> {
            self.0.sync()
        }
        fn head(&self, key: &str) -> crate::backend::BResult<Option<u64>> {
            self.0.head(key)
        }
    }

    #[test]
    fn clones_of_settled_disks_read_no_map_and_pending_logs_are_folded_first() {
        use std::sync::atomic::Ordering;
        let d = tempfile::tempdir().unwrap();
        let local = crate::backend::local::LocalBackend::open(d.path().join("b")).unwrap();
        let counted =
            std::sync::Arc::new(CountPackReads(std::sync::Arc::new(local), Default::default()));
        let meta = d.path().join("meta.redb");
        let s = Store::init(counted.clone(), &meta, InitOptions::default()).unwrap();
        let img = d.path().join("img.raw");
        let data: Vec<u8> = (0..3 * 1024 * 1024 + 4096).map(|i| (i % 251) as u8).collect();
        std::fs::write(&img, &data).unwrap();
        File::options().write(true).open(&img).unwrap().set_len(16 << 20).unwrap();
        let i = import(&s, "golden", &img, Codec::Lz4, &NoProgress).unwrap();
        s.close().unwrap();
        let s = Store::open(counted.clone(), &meta).unwrap();
        counted.1.store(0, Ordering::Relaxed);
        let c = clone(&s, "golden", "c1", true).unwrap();
        assert_eq!(
            counted.1.load(Ordering::Relaxed),
            0,
            "a clone of a settled disk reads no pack bytes"
        );
        assert_eq!((c.allocated_blocks, c.root.as_str()), (i.allocated_blocks, i.root.as_str()));
        assert_eq!(info(&s, "c1").unwrap().allocated_blocks, i.allocated_blocks);
        // Writes left in c1's log (the volume is dropped without closing): a clone folds them first.
        let v = volume::Volume::open(&s, "c1").unwrap();
        v.write(4096 * 1024 * 3, &[7u8; 8192], true).unwrap();
        assert!(
            matches!(clone(&s, "c1", "busy", true), Err(DiskError::InUse { .. })),
            "a served disk is not cloned"
        );
        drop(v);
        let c2 = clone(&s, "c1", "c2", true).unwrap();
        assert_ne!(c2.root, i.root);
        assert_eq!(
            c2.allocated_blocks,
            i.allocated_blocks + 1,
            "the write allocated one block past the image's data"
        );
        let out = d.path().join("out.raw");
        export(&s, "c2", &out, &NoProgress).unwrap();
        let got = std::fs::read(&out).unwrap();
        assert_eq!(got[..data.len()], data[..]);
        assert_eq!(got[4096 * 1024 * 3..4096 * 1024 * 3 + 8192], [7u8; 8192]);
    }
}

#[cfg(test)]
mod volume_tests;

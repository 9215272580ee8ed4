//! Disk images on the chunk store: a ref `disk/<name>` naming a block map root, with the
//! image's size and block size in its JSON payload.
//!
//! This file has the immutable-image operations (import, export, list, remove, full clone);
//! all-zero blocks are holes and cost nothing. Import reads the source sequentially and hashes
//! and compresses blocks on all cores.

pub mod map;

use crate::codec::Codec;
use crate::id::ChunkId;
use crate::progress::{Progress, Unit};
use crate::store::objects::Ref;
use crate::store::pack::ChunkKind;
use crate::store::{Store, StoreError};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

pub const DEFAULT_BLOCK: u32 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("Disk '{name}' does not exist (list disks with `strata disk list`)")]
    NotFound { name: String },
    #[error("Disk '{name}' already exists: remove it first or pick another name")]
    Exists { name: String },
    #[error("Disk '{name}' has unreadable metadata")]
    BadMeta { name: String, #[source] source: serde_json::Error },
    #[error("Cannot {op} {path}")]
    Io { op: &'static str, path: PathBuf, #[source] source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub type Result<T> = std::result::Result<T, DiskError>;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct DiskMeta {
    pub size: u64,
    pub block_size: u32,
    #[serde(default)]
    pub parent: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DiskInfo {
    pub name: String,
    pub size: u64,
    pub block_size: u32,
    pub allocated_blocks: u64,
    pub root: String,
}

pub fn ref_name(name: &str) -> String {
    format!("disk/{name}")
}

fn load(store: &Store, name: &str) -> Result<(Ref, DiskMeta)> {
    let r = store.get_ref(&ref_name(name))?.ok_or_else(|| DiskError::NotFound { name: name.into() })?;
    let m: DiskMeta = serde_json::from_slice(&r.payload).map_err(|source| DiskError::BadMeta { name: name.into(), source })?;
    Ok((r, m))
}

/// Import a raw image file as disk `name`.
pub fn import(store: &Store, name: &str, file: &Path, codec: Codec, progress: &dyn Progress) -> Result<DiskInfo> {
    if store.get_ref(&ref_name(name))?.is_some() {
        return Err(DiskError::Exists { name: name.into() });
    }
    let io = |op, e| DiskError::Io { op, path: file.to_path_buf(), source: e };
    let mut f = File::open(file).map_err(|e| io("open", e))?;
    let size = f.metadata().map_err(|e| io("stat", e))?.len();
    let bs = DEFAULT_BLOCK as usize;
    progress.phase("importing", Some(size), Unit::Bytes);
    let ses = store.session();
    let mut blocks = Vec::with_capacity(size.div_ceil(bs as u64) as usize);
    // Batches of blocks are hashed and compressed in parallel, in order.
    let batch = 64;
    let mut buf = vec![0u8; bs * batch];
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            let n = f.read(&mut buf[filled..]).map_err(|e| io("read", e))?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        let parts: Vec<&[u8]> = buf[..filled].chunks(bs).collect();
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
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
                                    ses.put_with(b, ChunkKind::Data, codec)
                                }
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("import worker")).collect::<std::result::Result<Vec<_>, _>>()
        })?
        .into_iter()
        .flatten()
        .collect();
        blocks.extend(ids);
        progress.advance(filled as u64);
        if filled < buf.len() {
            break;
        }
    }
    let root = map::write_map(&ses, &blocks)?;
    let meta = DiskMeta { size, block_size: DEFAULT_BLOCK, parent: None };
    ses.commit_ref(&ref_name(name), Ref::new(vec![root], serde_json::to_vec(&meta).expect("json")))?;
    progress.finish();
    info(store, name)
}

/// Write disk `name` to a raw file (sparse: holes are skipped).
pub fn export(store: &Store, name: &str, file: &Path, progress: &dyn Progress) -> Result<u64> {
    let (r, m) = load(store, name)?;
    let blocks = map::read_map(store, &r.roots[0])?;
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

/// Full clone: a new ref to the same block map. O(metadata).
pub fn clone_full(store: &Store, src: &str, dst: &str) -> Result<DiskInfo> {
    if store.get_ref(&ref_name(dst))?.is_some() {
        return Err(DiskError::Exists { name: dst.into() });
    }
    let (r, mut m) = load(store, src)?;
    let ses = store.session();
    for root in &r.roots {
        ses.pin(*root)?;
    }
    m.parent = Some(src.into());
    ses.commit_ref(&ref_name(dst), Ref::new(r.roots.clone(), serde_json::to_vec(&m).expect("json")))?;
    info(store, dst)
}

pub fn info(store: &Store, name: &str) -> Result<DiskInfo> {
    let (r, m) = load(store, name)?;
    let blocks = map::read_map(store, &r.roots[0])?;
    Ok(DiskInfo {
        name: name.into(),
        size: m.size,
        block_size: m.block_size,
        allocated_blocks: blocks.iter().filter(|b| !b.is_zero()).count() as u64,
        root: r.roots[0].to_hex(),
    })
}

pub fn list(store: &Store) -> Result<Vec<DiskInfo>> {
    store.list_refs("disk/")?.iter().filter_map(|n| n.strip_prefix("disk/")).map(|n| info(store, n)).collect()
}

pub fn remove(store: &Store, name: &str) -> Result<()> {
    load(store, name)?;
    store.delete_ref(&ref_name(name))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;
    use crate::store::InitOptions;

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
        assert!(matches!(import(&s, "golden", &img, Codec::Lz4, &NoProgress), Err(DiskError::Exists { .. })));
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
}

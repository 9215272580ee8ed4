//! Local metadata cache in redb: the chunk index and the set of known packs.
//!
//! The backend is the source of truth (index objects, refs); this database only saves a host
//! from re-reading every index object at each open. It can always be deleted and rebuilt, so it
//! is committed with `Durability::None` on the hot path and made durable at close. On open the
//! store reconciles it with the backend's `index/` listing (packs added or removed by another
//! host, or lost by a crash of this one). One process at a time may open it (redb's file lock):
//! a second strata process on the same host (say `strata vm checkpoint` while `strata serve`
//! runs) gets a private cache instead ([`Meta::open_or_private`]), rebuilt from the backend like
//! a second host's, and unlinked as soon as it is open so no crash can leave it behind.
//!
//! Tables (schema version 1, key `schema` in `meta`):
//! - `chunks`: chunk id (32 bytes) -> location (48 bytes, see [`encode_loc`]).
//! - `packs`:  pack id (16 bytes) -> pack size (u64).
//! - `meta`:   name -> bytes (`schema`, `store_id`).

use super::pack::{ChunkKind, PackEntry};
use crate::codec::Codec;
use crate::endian;
use crate::id::{ChunkId, PackId};
use redb::{Database, Durability, ReadableTable, ReadableTableMetadata, TableDefinition};
use std::path::{Path, PathBuf};

const CHUNKS: TableDefinition<&[u8; 32], &[u8; 48]> = TableDefinition::new("chunks");
const PACKS: TableDefinition<&[u8; 16], u64> = TableDefinition::new("packs");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
pub(crate) const SCHEMA: u8 = 1;

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("Store metadata at {path} is in use by another strata process: stop it, or talk to its daemon")]
    InUse { path: PathBuf },
    #[error("Store metadata at {path} cannot be opened")]
    Open {
        path: PathBuf,
        #[source]
        source: redb::DatabaseError,
    },
    #[error("Store metadata operation {op} failed")]
    Db {
        op: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn db<E: std::error::Error + Send + Sync + 'static>(
    op: &'static str,
) -> impl FnOnce(E) -> MetaError {
    move |e| MetaError::Db { op, source: Box::new(e) }
}

pub struct Meta {
    db: Database,
}

/// Encode one chunk location for the `chunks` table.
pub fn encode_loc(pack: &PackId, e: &PackEntry) -> [u8; 48] {
    let mut b = [0u8; 48];
    b[0..16].copy_from_slice(&pack.0);
    b[16..24].copy_from_slice(&e.frame_off.to_le_bytes());
    b[24..28].copy_from_slice(&e.frame_len.to_le_bytes());
    b[28..32].copy_from_slice(&e.frame_raw_len.to_le_bytes());
    b[32..36].copy_from_slice(&e.off_in_frame.to_le_bytes());
    b[36..40].copy_from_slice(&e.raw_len.to_le_bytes());
    let (c, l) = e.codec.to_bytes();
    b[40] = c;
    b[41] = l;
    b[42] = e.kind as u8;
    b[44..48].copy_from_slice(&e.frame_crc.to_le_bytes());
    b
}

pub fn decode_loc(id: ChunkId, b: &[u8; 48]) -> Option<(PackId, PackEntry)> {
    let u32at = |o: usize| endian::le32(b, o);
    Some((
        PackId(endian::array(b, 0)),
        PackEntry {
            id,
            frame_off: endian::le64(b, 16),
            frame_len: u32at(24),
            frame_raw_len: u32at(28),
            off_in_frame: u32at(32),
            raw_len: u32at(36),
            codec: Codec::from_bytes(b[40], b[41]).ok()?,
            kind: ChunkKind::from_u8(b[42])?,
            frame_crc: u32at(44),
        },
    ))
}

impl Meta {
    /// Open or create the cache for store `store_id`. A cache of another store, an unknown
    /// schema or an unreadable file is discarded and recreated (it is only a cache).
    pub fn open(path: &Path, store_id: &[u8; 16]) -> Result<Meta, MetaError> {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let database = match Database::create(path) {
            Ok(db) => db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(MetaError::InUse { path: path.to_path_buf() })
            }
            Err(redb::DatabaseError::Storage(redb::StorageError::Io(e)))
                if e.kind() == std::io::ErrorKind::WouldBlock =>
            {
                return Err(MetaError::InUse { path: path.to_path_buf() })
            }
            Err(e) => {
                tracing::warn!(target: "strata::store", path = %path.display(), error = %e, "discarding unreadable metadata cache");
                let _ = std::fs::remove_file(path);
                Database::create(path)
                    .map_err(|source| MetaError::Open { path: path.to_path_buf(), source })?
            }
        };
        let meta = Meta { db: database };
        let ok = {
            let rtx = meta.db.begin_read().map_err(db("begin_read"))?;
            match rtx.open_table(META) {
                Ok(t) => {
                    let schema = t.get("schema").map_err(db("get"))?.map(|v| v.value().to_vec());
                    let sid = t.get("store_id").map_err(db("get"))?.map(|v| v.value().to_vec());
                    schema.as_deref() == Some(&[SCHEMA][..])
                        && sid.as_deref() == Some(&store_id[..])
                }
                Err(_) => false,
            }
        };
        if !ok {
            let mut tx = meta.db.begin_write().map_err(db("begin_write"))?;
            tx.set_durability(Durability::Immediate);
            let _ = tx.delete_table(CHUNKS);
            let _ = tx.delete_table(PACKS);
            {
                let mut t = tx.open_table(META).map_err(db("open_table"))?;
                t.insert("schema", &[SCHEMA][..]).map_err(db("insert"))?;
                t.insert("store_id", &store_id[..]).map_err(db("insert"))?;
            }
            tx.open_table(CHUNKS).map_err(db("open_table"))?;
            tx.open_table(PACKS).map_err(db("open_table"))?;
            tx.commit().map_err(db("commit"))?;
        }
        Ok(meta)
    }

    /// Open the cache at `path`; if another process holds it, open a private one next to it
    /// (in `private/`, unlinked at once: it lives as long as this process holds it). Returns
    /// the cache and whether it is private.
    pub fn open_or_private(path: &Path, store_id: &[u8; 16]) -> Result<(Meta, bool), MetaError> {
        match Meta::open(path, store_id) {
            Err(MetaError::InUse { .. }) => {
                let dir = path.parent().unwrap_or(Path::new(".")).join("private");
                std::fs::create_dir_all(&dir)
                    .map_err(|e| MetaError::Db { op: "create_dir", source: Box::new(e) })?;
                let p =
                    dir.join(format!("{}-{:016x}.redb", std::process::id(), rand::random::<u64>()));
                let meta = Meta::open(&p, store_id)?;
                let _ = std::fs::remove_file(&p);
                tracing::info!(target: "strata::store", path = %path.display(),
                    "metadata cache in use by another strata process; using a private one rebuilt from the backend");
                Ok((meta, true))
            }
            other => other.map(|m| (m, false)),
        }
    }

    /// All known packs with their sizes.
    pub fn packs(&self) -> Result<Vec<(PackId, u64)>, MetaError> {
        let rtx = self.db.begin_read().map_err(db("begin_read"))?;
        let t = rtx.open_table(PACKS).map_err(db("open_table"))?;
        let mut out = Vec::with_capacity(t.len().unwrap_or(0) as usize);
        for r in t.iter().map_err(db("iter"))? {
            let (k, v) = r.map_err(db("iter"))?;
            out.push((PackId(*k.value()), v.value()));
        }
        Ok(out)
    }

    /// Visit every chunk location.
    pub fn for_each_chunk(&self, mut f: impl FnMut(PackId, PackEntry)) -> Result<(), MetaError> {
        let rtx = self.db.begin_read().map_err(db("begin_read"))?;
        let t = rtx.open_table(CHUNKS).map_err(db("open_table"))?;
        for r in t.iter().map_err(db("iter"))? {
            let (k, v) = r.map_err(db("iter"))?;
            if let Some((p, e)) = decode_loc(ChunkId(*k.value()), v.value()) {
                f(p, e);
            }
        }
        Ok(())
    }

    /// Record packs that became durable, with their entries.
    pub fn add_packs(
        &self,
        packs: &[(PackId, u64, &[PackEntry])],
        durable: bool,
    ) -> Result<(), MetaError> {
        let mut tx = self.db.begin_write().map_err(db("begin_write"))?;
        tx.set_durability(if durable { Durability::Immediate } else { Durability::None });
        {
            let mut pt = tx.open_table(PACKS).map_err(db("open_table"))?;
            let mut ct = tx.open_table(CHUNKS).map_err(db("open_table"))?;
            for (pid, size, entries) in packs {
                pt.insert(&pid.0, *size).map_err(db("insert"))?;
                for e in entries.iter() {
                    ct.insert(&e.id.0, &encode_loc(pid, e)).map_err(db("insert"))?;
                }
            }
        }
        tx.commit().map_err(db("commit"))
    }

    /// Forget packs: their pack rows, and chunk rows that still point at them.
    pub fn remove_packs(
        &self,
        packs: &[(PackId, Vec<ChunkId>)],
        durable: bool,
    ) -> Result<(), MetaError> {
        let mut tx = self.db.begin_write().map_err(db("begin_write"))?;
        tx.set_durability(if durable { Durability::Immediate } else { Durability::None });
        {
            let mut pt = tx.open_table(PACKS).map_err(db("open_table"))?;
            let mut ct = tx.open_table(CHUNKS).map_err(db("open_table"))?;
            for (pid, ids) in packs {
                pt.remove(&pid.0).map_err(db("remove"))?;
                for id in ids {
                    let still_here =
                        ct.get(&id.0).map_err(db("get"))?.map(|v| v.value()[0..16] == pid.0);
                    if still_here == Some(true) {
                        ct.remove(&id.0).map_err(db("remove"))?;
                    }
                }
            }
        }
        tx.commit().map_err(db("commit"))
    }

    /// Make everything committed so far durable.
    pub fn persist(&self) -> Result<(), MetaError> {
        let mut tx = self.db.begin_write().map_err(db("begin_write"))?;
        tx.set_durability(Durability::Immediate);
        tx.commit().map_err(db("commit"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loc_round_trips_and_layout_is_pinned() {
        let e = PackEntry {
            id: ChunkId([5; 32]),
            frame_off: 32,
            frame_len: 100,
            frame_raw_len: 8192,
            off_in_frame: 4096,
            raw_len: 4096,
            codec: Codec::Zstd(3),
            kind: ChunkKind::Tree,
            frame_crc: 0xdeadbeef,
        };
        let b = encode_loc(&PackId([1; 16]), &e);
        assert_eq!(&b[0..16], &[1u8; 16]);
        assert_eq!(b[40..43], [2, 3, 1]);
        assert_eq!(decode_loc(e.id, &b), Some((PackId([1; 16]), e)));
    }

    #[test]
    fn cache_of_another_store_is_discarded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.redb");
        let e = PackEntry {
            id: ChunkId([5; 32]),
            frame_off: 32,
            frame_len: 1,
            frame_raw_len: 1,
            off_in_frame: 0,
            raw_len: 1,
            codec: Codec::None,
            kind: ChunkKind::Data,
            frame_crc: 0,
        };
        {
            let m = Meta::open(&p, &[1; 16]).unwrap();
            m.add_packs(&[(PackId([2; 16]), 100, &[e])], true).unwrap();
            assert_eq!(m.packs().unwrap().len(), 1);
        }
        {
            let m = Meta::open(&p, &[1; 16]).unwrap();
            assert_eq!(m.packs().unwrap().len(), 1, "same store keeps its cache");
            let mut n = 0;
            m.for_each_chunk(|_, _| n += 1).unwrap();
            assert_eq!(n, 1);
            m.remove_packs(&[(PackId([2; 16]), vec![e.id])], true).unwrap();
            assert!(m.packs().unwrap().is_empty());
        }
        let m = Meta::open(&p, &[9; 16]).unwrap();
        assert!(m.packs().unwrap().is_empty(), "another store's cache is dropped");
    }
}

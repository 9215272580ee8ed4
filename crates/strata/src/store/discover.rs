//! Which packs a store's backend holds, and how to read each one's chunk entries.
//!
//! A pack becomes visible in one of two ways (`docs/format-store.md`, "Finding packs"):
//! * an **index object** `index/<pack id>`: written after the pack is durable, on backends
//!   where a pack file can be torn by a crash (local filesystems), and by every writer before
//!   network packs indexed themselves;
//! * on a **network** backend (`Capabilities::network`), the **pack itself**: an upload is
//!   atomic, so a listed pack is whole, and its last bytes (footer and entry table) are its
//!   index. One range GET of [`PACK_TAIL_READ`] bytes reads them ([`parse_pack_tail`]); a
//!   bigger table takes a second, exact one. Tails are read with `get_meta_range`, so an SSD
//!   cache in front passes them through: they are read once per host, then live in its
//!   metadata cache, and would only push chunk data out.
//!
//! Opening a store, refreshing it for other hosts' packs, `check` and `gc` all list packs
//! here, so they agree on what the store holds. Reads run on [`READERS`] threads: a host
//! opening a shared store cold reads one small object per pack.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::pack::{parse_pack_tail, IndexObject, PackTail, PACK_TAIL_READ};
use super::{Result, StoreError};
use crate::backend::{BResult, Backend};
use crate::id::PackId;

/// Concurrent reads of index objects or pack tails.
pub(crate) const READERS: usize = 8;

/// Where a pack's entries are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Its index object.
    Index,
    /// The pack's own tail; the pack is `size` bytes.
    Tail { size: u64 },
}

/// Every pack the backend makes visible. A pack with an index object is read from it; on a
/// network backend every other listed pack indexes itself. On other backends a pack without
/// an index object is not visible: it may be torn (see [`orphan_packs`]).
pub fn list_packs(backend: &dyn Backend) -> BResult<HashMap<PackId, Source>> {
    let mut out: HashMap<PackId, Source> = HashMap::new();
    if backend.capabilities().network {
        for o in backend.list("packs/")? {
            if let Some(pid) = o.key.rsplit('/').next().and_then(PackId::from_hex) {
                out.insert(pid, Source::Tail { size: o.size });
            }
        }
    }
    for o in backend.list("index/")? {
        if let Some(pid) = o.key.strip_prefix("index/").and_then(PackId::from_hex) {
            out.insert(pid, Source::Index);
        }
    }
    Ok(out)
}

/// Packs on a non-network backend that no index object names: written but never indexed (a
/// write interrupted by a crash or a full disk), with their sizes. Always empty on a network
/// backend, where every listed pack is whole.
pub fn orphan_packs(
    backend: &dyn Backend,
    visible: &HashMap<PackId, Source>,
) -> BResult<Vec<(PackId, String, u64)>> {
    if backend.capabilities().network {
        return Ok(Vec::new());
    }
    Ok(backend
        .list("packs/")?
        .into_iter()
        .filter_map(|o| {
            let pid = o.key.rsplit('/').next().and_then(PackId::from_hex)?;
            (!visible.contains_key(&pid)).then_some((pid, o.key, o.size))
        })
        .collect())
}

/// Read the entries of one pack from `source`.
pub fn read_entries(backend: &dyn Backend, pid: PackId, source: Source) -> Result<IndexObject> {
    match source {
        Source::Index => {
            let key = pid.index_key();
            let b = backend.get(&key)?;
            let o = IndexObject::decode(&b)
                .map_err(|source| StoreError::Format { key: key.clone(), source })?;
            if o.pack != pid {
                return Err(StoreError::Format {
                    key,
                    source: super::format::FormatError::Malformed {
                        what: "index object",
                        detail: format!("names pack {}", o.pack),
                    },
                });
            }
            Ok(o)
        }
        Source::Tail { size } => {
            let key = pid.pack_key();
            let fmt = |source| StoreError::Format { key: key.clone(), source };
            let n = size.min(PACK_TAIL_READ);
            let tail = backend.get_meta_range(&key, size - n, n)?;
            let entries = match parse_pack_tail(&tail, size).map_err(fmt)? {
                PackTail::Entries(e) => e,
                PackTail::Need(need) => {
                    let tail = backend.get_meta_range(&key, size - need, need)?;
                    match parse_pack_tail(&tail, size).map_err(fmt)? {
                        PackTail::Entries(e) => e,
                        // Only a backend returning fewer bytes than asked gets here.
                        PackTail::Need(_) => {
                            return Err(fmt(super::format::FormatError::Truncated {
                                what: "pack trailer",
                                needed: need,
                                have: tail.len() as u64,
                            }))
                        }
                    }
                }
            };
            Ok(IndexObject { pack: pid, pack_size: size, entries })
        }
    }
}

/// [`read_entries`] for many packs, [`READERS`] at a time; results in the order given.
pub fn read_many(backend: &dyn Backend, todo: &[(PackId, Source)]) -> Vec<Result<IndexObject>> {
    let slots: Vec<Mutex<Option<Result<IndexObject>>>> =
        todo.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..READERS.min(todo.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(pid, source)) = todo.get(i) else { return };
                *slots[i].lock() = Some(read_entries(backend, pid, source));
            });
        }
    });
    slots.into_iter().map(|s| s.into_inner().expect("every pack read")).collect()
}

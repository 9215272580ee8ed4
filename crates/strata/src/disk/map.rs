//! Block maps: a disk's logical blocks -> chunk ids, persisted as a two-level tree of chunks.
//!
//! Leaves are tree chunks of up to `LEAF_IDS` ids (the zero id is an unallocated, zero-reading
//! block); the root tree lists the leaves. Leaves are content-addressed like everything else,
//! so two images that share a region share its leaves, and a full clone is a new ref to the
//! same root: O(metadata), no data copied. With 64 KiB blocks and 2048-id leaves, one leaf
//! covers 128 MiB and a 30 GiB disk's map is 240 leaves (15 MiB of ids).

use crate::id::ChunkId;
use crate::store::objects::Tree;
use crate::store::pack::ChunkKind;
use crate::store::{Result, Session, Store, StoreError};

pub const LEAF_IDS: usize = 2048;

/// Write a block map; returns the root tree id.
pub fn write_map(ses: &Session, blocks: &[ChunkId]) -> Result<ChunkId> {
    write_map_with(ses, blocks, &mut |_, _| {})
}

/// [`write_map`], handing every tree chunk written (id, raw bytes) to `each` (a memory save
/// keeps its page maps in the store's tree cache).
pub fn write_map_with(
    ses: &Session,
    blocks: &[ChunkId],
    each: &mut dyn FnMut(ChunkId, Vec<u8>),
) -> Result<ChunkId> {
    write_map_payloads(ses, blocks, &mut |_| Vec::new(), each)
}

/// [`write_map_with`], each leaf's payload given by `payload(leaf number)` (a memory page
/// map's slot table, `memory/manifest.rs`; disks' leaves have none).
pub fn write_map_payloads(
    ses: &Session,
    blocks: &[ChunkId],
    payload: &mut dyn FnMut(usize) -> Vec<u8>,
    each: &mut dyn FnMut(ChunkId, Vec<u8>),
) -> Result<ChunkId> {
    let mut put = |t: Tree| -> Result<ChunkId> {
        let raw = t.encode();
        let id = ses.put(&raw, ChunkKind::Tree)?;
        each(id, raw);
        Ok(id)
    };
    let mut leaves = Vec::with_capacity(blocks.len().div_ceil(LEAF_IDS));
    for (n, part) in blocks.chunks(LEAF_IDS).enumerate() {
        if part.iter().all(|c| c.is_zero()) {
            leaves.push(ChunkId::ZERO);
        } else {
            leaves.push(put(Tree { children: part.to_vec(), payload: payload(n) })?);
        }
    }
    put(Tree { children: leaves, payload: (blocks.len() as u64).to_le_bytes().to_vec() })
}

/// Read a whole block map back.
pub fn read_map(store: &Store, root: &ChunkId) -> Result<Vec<ChunkId>> {
    let decode = |id: &ChunkId| -> Result<Tree> {
        Tree::decode(&store.get(id)?)
            .map_err(|source| StoreError::Format { key: format!("chunk {id}"), source })
    };
    let rt = decode(root)?;
    let n = rt
        .payload
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
        .ok_or_else(|| StoreError::Format {
            key: format!("chunk {root}"),
            source: crate::store::format::FormatError::Malformed {
                what: "block map root",
                detail: "no block count".into(),
            },
        })?;
    let mut out = Vec::with_capacity(n);
    for leaf in &rt.children {
        let want = (n - out.len()).min(LEAF_IDS);
        if leaf.is_zero() {
            out.extend(std::iter::repeat_n(ChunkId::ZERO, want));
        } else {
            let t = decode(leaf)?;
            out.extend(t.children.into_iter().take(want));
        }
    }
    out.resize(n, ChunkId::ZERO);
    Ok(out)
}

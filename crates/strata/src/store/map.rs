//! Block maps: a list of chunk ids (a disk's logical blocks, a ramblock's pages) persisted as
//! a two-level tree of chunks. Disk images (`disk/`) and memory checkpoints (`memory/`) both
//! keep their maps in this form, so it lives in the store beside the tree chunks it is made of.
//!
//! Leaves are tree chunks of up to `LEAF_IDS` ids (the zero id is an unallocated, zero-reading
//! block); the root tree lists the leaves and carries the id count. Leaves are
//! content-addressed like everything else, so two images that share a region share its
//! leaves, and a full clone is a new ref to the same root: O(metadata), no data copied. With
//! 64 KiB blocks and 2048-id leaves, one leaf covers 128 MiB and a 30 GiB disk's map is 240
//! leaves (15 MiB of ids). A leaf may carry a payload (a memory page map's slot table).

use super::format::FormatError;
use super::objects::Tree;
use super::pack::ChunkKind;
use super::{Result, Session, Store, StoreError};
use crate::endian;
use crate::id::ChunkId;

/// Ids per leaf.
pub(crate) const LEAF_IDS: usize = 2048;

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
    let n =
        endian::le64_at(&rt.payload, 0).map(|v| v as usize).ok_or_else(|| StoreError::Format {
            key: format!("chunk {root}"),
            source: FormatError::Malformed {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::mem_store;

    /// Maps of every shape read back as written: empty, one partial leaf, several leaves with
    /// an all-zero one in the middle (stored as the zero id, no chunk), and leaf payloads.
    #[test]
    fn maps_round_trip_and_zero_leaves_cost_nothing() {
        let (_d, s, _) = mem_store(1 << 20);
        let ses = s.session();
        let id = |n: u64| ChunkId::of(&n.to_le_bytes());
        let mut long: Vec<ChunkId> = (0..3 * LEAF_IDS as u64 + 5).map(id).collect();
        long[LEAF_IDS..2 * LEAF_IDS].fill(ChunkId::ZERO);
        for blocks in [Vec::new(), (0..7).map(id).collect(), long.clone()] {
            let root = write_map(&ses, &blocks).unwrap();
            assert_eq!(read_map(&s, &root).unwrap(), blocks);
        }
        let mut trees = Vec::new();
        let root = write_map_payloads(&ses, &long, &mut |n| vec![n as u8], &mut |id, raw| {
            trees.push((id, raw))
        })
        .unwrap();
        // Three non-zero leaves and the root.
        assert_eq!(trees.len(), 4);
        assert_eq!(trees.last().unwrap().0, root);
        let rt = Tree::decode(&trees[3].1).unwrap();
        assert!(rt.children[1].is_zero());
        assert_eq!(Tree::decode(&trees[1].1).unwrap().payload, vec![2u8]);
        assert_eq!(read_map(&s, &root).unwrap(), long);
    }
}

//! `strata du`: logical, unique and stored bytes, overall and per ref.
//!
//! Logical bytes count every reference (a disk and its full clone count twice); unique bytes
//! count each reachable chunk once; stored bytes are the packs' sizes in the backend. Their
//! ratios are the dedup ratio (logical / unique) and the compression ratio (unique / stored).
//! Tree sums are memoised, so the cost is proportional to the distinct tree chunks.

use super::objects::Tree;
use super::pack::ChunkKind;
use super::{Result, Store, StoreError};
use crate::id::ChunkId;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone, serde::Serialize)]
pub struct RefUsage {
    pub name: String,
    pub logical_bytes: u64,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Usage {
    pub refs: Vec<RefUsage>,
    pub logical_bytes: u64,
    pub unique_bytes: u64,
    pub stored_bytes: u64,
    pub chunks: usize,
    pub packs: usize,
    pub unreachable_chunks: usize,
    pub unreachable_bytes: u64,
    pub dedup_ratio: f64,
    pub compression_ratio: f64,
}

impl Store {
    pub fn du(&self) -> Result<Usage> {
        self.flush()?;
        let mut u = Usage::default();
        let mut memo: HashMap<ChunkId, u64> = HashMap::new();
        let mut reachable: HashSet<ChunkId> = HashSet::new();
        for name in self.list_refs("")? {
            if let Some(r) = self.get_ref(&name)? {
                let mut logical = 0;
                for root in &r.roots {
                    logical += self.logical(*root, &mut memo, &mut reachable)?;
                }
                u.logical_bytes += logical;
                u.refs.push(RefUsage { name, logical_bytes: logical });
            }
        }
        let idx = self.inner.sh.index.read();
        u.chunks = idx.chunks.len();
        u.packs = idx.packs.iter().flatten().count();
        u.stored_bytes = idx.packs.iter().flatten().map(|s| s.size).sum();
        for (id, loc) in &idx.chunks {
            if reachable.contains(id) {
                u.unique_bytes += loc.entry.raw_len as u64;
            } else {
                u.unreachable_chunks += 1;
                u.unreachable_bytes += loc.entry.raw_len as u64;
            }
        }
        u.dedup_ratio = ratio(u.logical_bytes, u.unique_bytes);
        u.compression_ratio = ratio(u.unique_bytes + u.unreachable_bytes, u.stored_bytes);
        Ok(u)
    }

    /// Logical data bytes under `id` (tree chunks themselves are metadata and not counted).
    fn logical(
        &self,
        id: ChunkId,
        memo: &mut HashMap<ChunkId, u64>,
        reachable: &mut HashSet<ChunkId>,
    ) -> Result<u64> {
        if id.is_zero() {
            return Ok(0);
        }
        if let Some(v) = memo.get(&id) {
            return Ok(*v);
        }
        reachable.insert(id);
        let v = match self.chunk_info(&id) {
            Some((_, ChunkKind::Tree)) => {
                let t = Tree::decode(&self.get(&id)?)
                    .map_err(|source| StoreError::Format { key: format!("chunk {id}"), source })?;
                let mut s = 0;
                for c in t.children {
                    s += self.logical(c, memo, reachable)?;
                }
                s
            }
            Some((len, ChunkKind::Data)) => len as u64,
            None => 0,
        };
        memo.insert(id, v);
        Ok(v)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        1.0
    } else {
        a as f64 / b as f64
    }
}

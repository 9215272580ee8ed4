//! `strata check`: verify every pack, index object, chunk and ref, and report precisely.
//!
//! Packs are read whole (one sequential read each): header, trailer and footer are parsed and
//! compared with the index object, each frame's CRC-32C is checked, each frame is decompressed
//! and each chunk re-hashed against its id. Then every ref is decoded and walked; each
//! reachable chunk must be in the index. Every problem names the object and, where there is
//! one, the chunk and the refs that reach it. Problems are errors (data is damaged or missing)
//! or warnings (space is wasted: orphan packs).

use super::discover::Source;
use super::objects::Tree;
use super::pack::{parse_pack, ChunkKind, PackEntry};
use super::{decode_chunk, Result, Store, StoreError};
use crate::backend::Backend;
use crate::id::{ChunkId, PackId};
use crate::progress::{Progress, Unit};
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Problem {
    pub severity: Severity,
    /// The object concerned: `packs/..`, `index/..` or `refs/..`.
    pub object: String,
    pub chunk: Option<String>,
    pub message: String,
    /// Refs that reach the damaged chunk.
    pub refs: Vec<String>,
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CheckReport {
    pub packs: usize,
    pub chunks: usize,
    pub refs: usize,
    pub bytes_read: u64,
    pub problems: Vec<Problem>,
}

impl CheckReport {
    pub fn errors(&self) -> usize {
        self.problems.iter().filter(|p| p.severity == Severity::Error).count()
    }
    pub fn is_damaged(&self) -> bool {
        self.errors() > 0
    }
}

#[derive(Debug, Clone, Copy)]
pub struct CheckOptions {
    /// Read and verify all chunk data (otherwise only structure and refs).
    pub read_data: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { read_data: true }
    }
}

/// The check's state: the report so far, and what the pack stage learnt for the ref stage.
#[derive(Default)]
struct Checker {
    rep: CheckReport,
    /// Damaged or missing chunk -> the index of its problem.
    bad_chunks: HashMap<ChunkId, usize>,
    indexed: HashSet<ChunkId>,
    kinds: HashMap<ChunkId, ChunkKind>,
}

impl Checker {
    /// Record a problem; returns its index.
    fn problem(
        &mut self,
        severity: Severity,
        object: String,
        chunk: Option<ChunkId>,
        message: String,
    ) -> usize {
        self.rep.problems.push(Problem {
            severity,
            object,
            chunk: chunk.map(|c| c.to_hex()),
            message,
            refs: vec![],
        });
        self.rep.problems.len() - 1
    }

    /// Record an error against every chunk of a pack.
    fn pack_lost(&mut self, pkey: String, entries: &[PackEntry], message: String) {
        let p = self.problem(Severity::Error, pkey, None, message);
        for e in entries {
            self.bad_chunks.insert(e.id, p);
        }
    }

    /// Check one pack against its index object: present, of the indexed size, and (reading
    /// data) its structure and every chunk.
    fn check_pack(
        &mut self,
        be: &dyn Backend,
        pid: PackId,
        source: Source,
        size: Option<u64>,
        opts: CheckOptions,
        progress: &dyn Progress,
    ) {
        let ikey = match source {
            Source::Index => pid.index_key(),
            Source::Tail { .. } => pid.pack_key(),
        };
        let idx = match super::discover::read_entries(be, pid, source) {
            Ok(i) => i,
            Err(e) => {
                let msg = format!("{}; the chunks of pack {pid} are invisible", chain(&e));
                self.problem(Severity::Error, ikey, None, msg);
                return;
            }
        };
        self.rep.packs += 1;
        for e in &idx.entries {
            self.indexed.insert(e.id);
            self.kinds.insert(e.id, e.kind);
        }
        let pkey = pid.pack_key();
        let Some(size) = size else {
            let msg = format!("pack is missing: {} chunks lost", idx.entries.len());
            self.pack_lost(pkey, &idx.entries, msg);
            return;
        };
        if size != idx.pack_size {
            let msg = format!(
                "pack is {size} bytes, its index says {} (truncated or replaced)",
                idx.pack_size
            );
            self.pack_lost(pkey.clone(), &idx.entries, msg);
            if !opts.read_data {
                return;
            }
        }
        if !opts.read_data {
            progress.advance(1);
            return;
        }
        let bytes = match be.get(&pkey) {
            Ok(b) => b,
            Err(e) => {
                self.problem(Severity::Error, pkey, None, format!("unreadable: {e}"));
                return;
            }
        };
        self.rep.bytes_read += bytes.len() as u64;
        progress.advance(bytes.len() as u64);
        if let Some(msg) = structure_problem(&bytes, pid, &idx.entries) {
            self.problem(Severity::Error, pkey.clone(), None, msg);
        }
        self.rep.chunks += idx.entries.len();
        for (id, off, reason) in corrupt_chunks(&bytes, pid, &idx.entries) {
            let msg = format!("chunk {id} (frame at byte {off}) is corrupt: {reason}");
            let p = self.problem(Severity::Error, pkey.clone(), Some(id), msg);
            self.bad_chunks.insert(id, p);
        }
    }

    /// Walk ref `name` from its roots: every reachable chunk must be indexed and intact, and
    /// every tree readable. Problems of damaged chunks it reaches name it. False if the ref
    /// could not be read (or is gone).
    fn check_ref(&mut self, store: &Store, name: &str) -> bool {
        self.rep.refs += 1;
        let rkey = format!("refs/{name}");
        let r = match store.get_ref(name) {
            Ok(Some(r)) => r,
            Ok(None) => return false,
            Err(e) => {
                self.problem(Severity::Error, rkey, None, chain(&e));
                return false;
            }
        };
        let mut seen = HashSet::new();
        let mut stack: Vec<ChunkId> = r.roots.clone();
        while let Some(id) = stack.pop() {
            if id.is_zero() || !seen.insert(id) {
                continue;
            }
            if let Some(&p) = self.bad_chunks.get(&id) {
                if !self.rep.problems[p].refs.iter().any(|r| r == name) {
                    self.rep.problems[p].refs.push(name.to_string());
                }
                continue;
            }
            if !self.indexed.contains(&id) {
                let msg = format!("reaches chunk {id}, which is not in the store");
                let p = self.problem(Severity::Error, rkey.clone(), Some(id), msg);
                self.rep.problems[p].refs.push(name.to_string());
                self.bad_chunks.insert(id, p);
                continue;
            }
            if self.kinds.get(&id) != Some(&ChunkKind::Tree) {
                continue;
            }
            let tree = store.get(&id).and_then(|b| {
                Tree::decode(&b)
                    .map_err(|source| StoreError::Format { key: format!("chunk {id}"), source })
            });
            match tree {
                Ok(t) => stack.extend(t.children),
                Err(e) => {
                    let msg = format!("tree unreadable: {}", chain(&e));
                    let p = self.problem(Severity::Error, rkey.clone(), Some(id), msg);
                    self.rep.problems[p].refs.push(name.to_string());
                }
            }
        }
        true
    }
}

/// What is wrong with a pack's structure (header, trailer, footer, and the trailer against
/// the index object's entries), if anything.
pub(crate) fn structure_problem(
    bytes: &[u8],
    pid: PackId,
    entries: &[PackEntry],
) -> Option<String> {
    match parse_pack(bytes) {
        Ok((id, parsed)) if id == pid && parsed == entries => None,
        Ok(_) => Some("pack trailer disagrees with its index object".into()),
        Err(e) => Some(format!("pack structure damaged: {e}")),
    }
}

/// The chunks of a pack that do not verify, chunk by chunk from the index entries (which is
/// what readers use): (chunk, frame offset, reason). A frame past the pack's end, a frame CRC
/// mismatch, a frame that does not decompress, or content that does not hash to its id.
pub(crate) fn corrupt_chunks(
    bytes: &[u8],
    pid: PackId,
    entries: &[PackEntry],
) -> Vec<(ChunkId, u64, String)> {
    let mut frames: BTreeMap<u64, Vec<&PackEntry>> = BTreeMap::new();
    for e in entries {
        frames.entry(e.frame_off).or_default().push(e);
    }
    let mut bad = Vec::new();
    for (off, es) in frames {
        let end = off as usize + es[0].frame_len as usize;
        for e in es {
            let res = if end <= bytes.len() {
                decode_chunk(&bytes[off as usize..end], e, pid).map(|_| ())
            } else {
                Err(StoreError::Corrupt {
                    id: e.id,
                    pack: pid,
                    offset: off,
                    reason: "frame past end of pack".into(),
                })
            };
            if let Err(err) = res {
                let reason = match err {
                    StoreError::Corrupt { reason, .. } => reason,
                    other => other.to_string(),
                };
                bad.push((e.id, off, reason));
            }
        }
    }
    bad
}

impl Store {
    /// Check the store, in stages: list the packs and their index objects, check each pack
    /// against its index, report orphan packs, then walk every ref.
    pub fn check(&self, opts: CheckOptions, progress: &dyn Progress) -> Result<CheckReport> {
        self.flush()?;
        let be = self.backend();
        let mut c = Checker::default();
        let packs: HashMap<PackId, u64> = be
            .list("packs/")?
            .into_iter()
            .filter_map(|o| {
                o.key.rsplit('/').next().and_then(PackId::from_hex).map(|p| (p, o.size))
            })
            .collect();
        let visible = super::discover::list_packs(&**be)?;
        let mut indexes: Vec<(PackId, Source)> = visible.iter().map(|(p, s)| (*p, *s)).collect();
        indexes.sort_unstable_by_key(|(p, _)| *p);
        let total: u64 = indexes.iter().filter_map(|(p, _)| packs.get(p)).sum();
        progress.phase(
            "checking packs",
            Some(if opts.read_data { total } else { indexes.len() as u64 }),
            Unit::Bytes,
        );
        for (pid, source) in &indexes {
            c.check_pack(&**be, *pid, *source, packs.get(pid).copied(), opts, progress);
        }
        for (pid, ..) in super::discover::orphan_packs(&**be, &visible)? {
            let msg =
                "orphan pack: no index object names it (left by an interrupted write; reclaimable)"
                    .to_string();
            c.problem(Severity::Warning, pid.pack_key(), None, msg);
        }
        progress.phase("checking refs", None, Unit::Items);
        for name in self.list_refs("")? {
            if c.check_ref(self, &name) {
                progress.advance(1);
            }
        }
        progress.finish();
        Ok(c.rep)
    }
}

use crate::error::error_chain as chain;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::mem_store;

    /// One pack's bytes and index entries, holding `n` distinct 8 KiB chunks.
    fn one_pack(n: u8) -> (Vec<u8>, PackId, Vec<PackEntry>) {
        let (_d, s, b) = mem_store(1 << 20);
        let ses = s.session();
        for i in 0..n {
            let data: Vec<u8> = (0..8192u32).map(|k| (k.wrapping_mul(31) as u8) ^ i).collect();
            ses.put(&data, ChunkKind::Data).unwrap();
        }
        s.flush().unwrap();
        let key = b.list("packs/").unwrap().into_iter().next().expect("a pack").key;
        let bytes = b.get(&key).unwrap();
        let (pid, entries) = parse_pack(&bytes).unwrap();
        (bytes, pid, entries)
    }

    /// A sound pack has no problem; a flipped byte names the chunks of its frame; a cut pack
    /// names the frames past its end and its structure.
    #[test]
    fn per_pack_verification_names_each_bad_chunk() {
        let (bytes, pid, entries) = one_pack(3);
        assert_eq!(entries.len(), 3);
        assert_eq!(structure_problem(&bytes, pid, &entries), None);
        assert!(corrupt_chunks(&bytes, pid, &entries).is_empty());

        let mut flipped = bytes.clone();
        let e = entries[1];
        flipped[e.frame_off as usize + 3] ^= 1;
        let bad = corrupt_chunks(&flipped, pid, &entries);
        let in_frame: Vec<ChunkId> =
            entries.iter().filter(|x| x.frame_off == e.frame_off).map(|x| x.id).collect();
        assert_eq!(bad.iter().map(|b| b.0).collect::<Vec<_>>(), in_frame);
        assert!(bad.iter().all(|b| b.1 == e.frame_off));

        let last = entries.iter().max_by_key(|x| x.frame_off).unwrap();
        let cut = &bytes[..last.frame_off as usize + 1];
        let bad = corrupt_chunks(cut, pid, &entries);
        assert!(bad.iter().any(|b| b.0 == last.id && b.2 == "frame past end of pack"), "{bad:?}");
        assert!(structure_problem(cut, pid, &entries).unwrap().contains("damaged"));
    }

    /// A trailer that lists other entries than the index object is named as such.
    #[test]
    fn a_trailer_unlike_the_index_is_a_structure_problem() {
        let (bytes, pid, entries) = one_pack(2);
        let msg = structure_problem(&bytes, pid, &entries[..1]).unwrap();
        assert!(msg.contains("disagrees"), "{msg}");
        let msg = structure_problem(&bytes, PackId([7; 16]), &entries).unwrap();
        assert!(msg.contains("disagrees"), "{msg}");
    }
}

//! `strata check`: verify every pack, index object, chunk and ref, and report precisely.
//!
//! Packs are read whole (one sequential read each): header, trailer and footer are parsed and
//! compared with the index object, each frame's CRC-32C is checked, each frame is decompressed
//! and each chunk re-hashed against its id. Then every ref is decoded and walked; each
//! reachable chunk must be in the index. Every problem names the object and, where there is
//! one, the chunk and the refs that reach it. Problems are errors (data is damaged or missing)
//! or warnings (space is wasted: orphan packs).

use super::objects::Tree;
use super::pack::{parse_pack, ChunkKind, PackEntry};
use super::{decode_chunk, Result, Store, StoreError};
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

impl Store {
    pub fn check(&self, opts: CheckOptions, progress: &dyn Progress) -> Result<CheckReport> {
        self.flush()?;
        let be = self.backend();
        let mut rep = CheckReport::default();
        let mut bad_chunks: HashMap<ChunkId, usize> = HashMap::new(); // chunk -> problem index
        let problem = |rep: &mut CheckReport,
                       sev,
                       object: String,
                       chunk: Option<ChunkId>,
                       message: String| {
            rep.problems.push(Problem {
                severity: sev,
                object,
                chunk: chunk.map(|c| c.to_hex()),
                message,
                refs: vec![],
            });
            rep.problems.len() - 1
        };

        let packs: HashMap<PackId, u64> = be
            .list("packs/")?
            .into_iter()
            .filter_map(|o| {
                o.key.rsplit('/').next().and_then(PackId::from_hex).map(|p| (p, o.size))
            })
            .collect();
        let visible = super::discover::list_packs(&**be)?;
        let mut indexes: Vec<(PackId, super::discover::Source)> =
            visible.iter().map(|(p, s)| (*p, *s)).collect();
        indexes.sort_unstable_by_key(|(p, _)| *p);
        let total: u64 = indexes.iter().filter_map(|(p, _)| packs.get(p)).sum();
        progress.phase(
            "checking packs",
            Some(if opts.read_data { total } else { indexes.len() as u64 }),
            Unit::Bytes,
        );

        let mut indexed: HashSet<ChunkId> = HashSet::new();
        let mut kinds: HashMap<ChunkId, ChunkKind> = HashMap::new();
        for (pid, source) in &indexes {
            let ikey = match source {
                super::discover::Source::Index => pid.index_key(),
                super::discover::Source::Tail { .. } => pid.pack_key(),
            };
            let idx = match super::discover::read_entries(&**be, *pid, *source) {
                Ok(i) => i,
                Err(e) => {
                    problem(
                        &mut rep,
                        Severity::Error,
                        ikey.clone(),
                        None,
                        format!("{}; the chunks of pack {pid} are invisible", chain(&e)),
                    );
                    continue;
                }
            };
            rep.packs += 1;
            for e in &idx.entries {
                indexed.insert(e.id);
                kinds.insert(e.id, e.kind);
            }
            let pkey = pid.pack_key();
            let Some(&size) = packs.get(pid) else {
                let msg = format!("pack is missing: {} chunks lost", idx.entries.len());
                let p = problem(&mut rep, Severity::Error, pkey, None, msg);
                for e in &idx.entries {
                    bad_chunks.insert(e.id, p);
                }
                continue;
            };
            if size != idx.pack_size {
                let msg = format!(
                    "pack is {size} bytes, its index says {} (truncated or replaced)",
                    idx.pack_size
                );
                let p = problem(&mut rep, Severity::Error, pkey.clone(), None, msg);
                for e in &idx.entries {
                    bad_chunks.insert(e.id, p);
                }
                if !opts.read_data {
                    continue;
                }
            }
            if !opts.read_data {
                progress.advance(1);
                continue;
            }
            let bytes = match be.get(&pkey) {
                Ok(b) => b,
                Err(e) => {
                    problem(&mut rep, Severity::Error, pkey, None, format!("unreadable: {e}"));
                    continue;
                }
            };
            rep.bytes_read += bytes.len() as u64;
            progress.advance(bytes.len() as u64);
            match parse_pack(&bytes) {
                Ok((id, entries)) if id == *pid && entries == idx.entries => {}
                Ok(_) => {
                    problem(
                        &mut rep,
                        Severity::Error,
                        pkey.clone(),
                        None,
                        "pack trailer disagrees with its index object".into(),
                    );
                }
                Err(e) => {
                    problem(
                        &mut rep,
                        Severity::Error,
                        pkey.clone(),
                        None,
                        format!("pack structure damaged: {e}"),
                    );
                }
            }
            // Verify chunk by chunk from the index (which is what readers use).
            let mut frames: BTreeMap<u64, Vec<&PackEntry>> = BTreeMap::new();
            for e in &idx.entries {
                frames.entry(e.frame_off).or_default().push(e);
            }
            for (off, es) in frames {
                let end = off as usize + es[0].frame_len as usize;
                for e in es {
                    rep.chunks += 1;
                    let res = if end <= bytes.len() {
                        decode_chunk(&bytes[off as usize..end], e, *pid).map(|_| ())
                    } else {
                        Err(StoreError::Corrupt {
                            id: e.id,
                            pack: *pid,
                            offset: off,
                            reason: "frame past end of pack".into(),
                        })
                    };
                    if let Err(err) = res {
                        let reason = match err {
                            StoreError::Corrupt { reason, .. } => reason,
                            other => other.to_string(),
                        };
                        let msg =
                            format!("chunk {} (frame at byte {off}) is corrupt: {reason}", e.id);
                        let p = problem(&mut rep, Severity::Error, pkey.clone(), Some(e.id), msg);
                        bad_chunks.insert(e.id, p);
                    }
                }
            }
        }
        for (pid, ..) in super::discover::orphan_packs(&**be, &visible)? {
            let msg =
                "orphan pack: no index object names it (left by an interrupted write; reclaimable)"
                    .to_string();
            problem(&mut rep, Severity::Warning, pid.pack_key(), None, msg);
        }

        // Refs: decode and walk; everything reachable must be indexed and intact.
        progress.phase("checking refs", None, Unit::Items);
        for name in self.list_refs("")? {
            rep.refs += 1;
            let rkey = format!("refs/{name}");
            let r = match self.get_ref(&name) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    problem(&mut rep, Severity::Error, rkey, None, chain(&e));
                    continue;
                }
            };
            let mut seen = HashSet::new();
            let mut stack: Vec<ChunkId> = r.roots.clone();
            while let Some(id) = stack.pop() {
                if id.is_zero() || !seen.insert(id) {
                    continue;
                }
                if let Some(&p) = bad_chunks.get(&id) {
                    if !rep.problems[p].refs.contains(&name) {
                        rep.problems[p].refs.push(name.clone());
                    }
                    continue;
                }
                if !indexed.contains(&id) {
                    let msg = format!("reaches chunk {id}, which is not in the store");
                    let p = problem(&mut rep, Severity::Error, rkey.clone(), Some(id), msg);
                    rep.problems[p].refs.push(name.clone());
                    bad_chunks.insert(id, p);
                    continue;
                }
                if kinds.get(&id) == Some(&ChunkKind::Tree) {
                    match self.get(&id).and_then(|b| {
                        Tree::decode(&b).map_err(|source| StoreError::Format {
                            key: format!("chunk {id}"),
                            source,
                        })
                    }) {
                        Ok(t) => stack.extend(t.children),
                        Err(e) => {
                            let p = problem(
                                &mut rep,
                                Severity::Error,
                                rkey.clone(),
                                Some(id),
                                format!("tree unreadable: {}", chain(&e)),
                            );
                            rep.problems[p].refs.push(name.clone());
                        }
                    }
                }
            }
            progress.advance(1);
        }
        progress.finish();
        Ok(rep)
    }
}

use crate::error::error_chain as chain;

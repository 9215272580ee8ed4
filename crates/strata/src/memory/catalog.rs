//! `vm list`, `vm rm` and `vm inspect`: what is stored, read from the refs under `vm/`.
//!
//! Listing reads only refs (the manifest is the ref payload), so it is cheap on any backend.
//! `inspect` adds, on request, a sharing analysis that reads the page maps of every checkpoint:
//! how many of this checkpoint's distinct pages no other checkpoint uses, which is what
//! `vm rm` + `gc` would free. Removing deletes only the ref; `strata gc` reclaims the chunks
//! nothing else references, so a page shared with another VM or checkpoint stays.
#![allow(clippy::result_large_err)] // a MemError is returned once per save or restore

use std::collections::{HashMap, HashSet};

use super::error::MemError;
use super::manifest::{is_run_chunk, ref_name, valid_name, Checkpoint, Manifest, REF_PREFIX};
use super::restore::load_checkpoint;
use crate::id::ChunkId;
use crate::store::Store;

/// One line of `vm list`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckpointSummary {
    pub name: String,
    pub mode: String,
    pub created_unix: u64,
    pub machine_type: String,
    pub qemu_version: String,
    pub ram_bytes: u64,
    /// Bytes the save added to the store (after dedup and compression).
    pub stored_bytes: u64,
    pub codec: String,
    /// Disks taken with the memory (a desktop snapshot).
    pub disks: Vec<String>,
    /// Set when the ref is not a readable checkpoint.
    pub error: Option<String>,
}

/// Every checkpoint, sorted by name; unreadable ones are listed with their error.
pub fn list(store: &Store) -> Result<Vec<CheckpointSummary>, MemError> {
    let names = store.list_refs(REF_PREFIX).map_err(MemError::store("list", "vm/"))?;
    let mut out = Vec::with_capacity(names.len());
    for r in names {
        let name = r.strip_prefix(REF_PREFIX).unwrap_or(&r).to_string();
        match load_checkpoint(store, &name) {
            Ok(c) => {
                let m = &c.manifest;
                out.push(CheckpointSummary {
                    name,
                    mode: m.mode.as_str().into(),
                    created_unix: m.created_unix,
                    machine_type: m.qemu.machine_type.clone(),
                    qemu_version: m.qemu.version.clone(),
                    ram_bytes: m.stats.logical_bytes,
                    stored_bytes: m.stats.stored_bytes,
                    codec: m.codec.chosen.clone(),
                    disks: m.disks.iter().map(|d| d.disk.clone()).collect(),
                    error: None,
                })
            }
            Err(e) => out.push(CheckpointSummary {
                name,
                mode: String::new(),
                created_unix: 0,
                machine_type: String::new(),
                qemu_version: String::new(),
                ram_bytes: 0,
                stored_bytes: 0,
                codec: String::new(),
                disks: Vec::new(),
                error: Some(format!("{e}")),
            }),
        }
    }
    Ok(out)
}

/// Delete checkpoint `name` (its ref). Space is reclaimed by `strata gc`.
pub fn remove(store: &Store, name: &str) -> Result<(), MemError> {
    if !valid_name(name) {
        return Err(MemError::BadName { name: name.into() });
    }
    match store.delete_ref(&ref_name(name)) {
        Ok(()) => Ok(()),
        Err(crate::store::StoreError::RefNotFound { .. }) => {
            Err(MemError::NotFound { name: name.into() })
        }
        Err(e) => Err(MemError::Store { op: "remove", name: name.into(), source: e }),
    }
}

/// Pages of this checkpoint that other checkpoints share.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sharing {
    pub distinct_pages: u64,
    /// Distinct pages also used by at least one other checkpoint.
    pub shared_pages: u64,
    /// Distinct pages only this checkpoint uses (what `rm` + `gc` would free, before compression).
    pub exclusive_pages: u64,
    pub other_checkpoints: u64,
}

/// `vm inspect`: the manifest plus, optionally, sharing with other checkpoints.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Inspection {
    pub name: String,
    pub generation: u64,
    pub manifest: Manifest,
    pub total_pages: u64,
    pub sharing: Option<Sharing>,
}

/// A checkpoint's distinct pages: (chunk id, slot), the slot being the page's place in a run
/// chunk (version 3: the page number modulo `RUN_PAGES`, or the one its leaf's slot table
/// names, version 4) or `u8::MAX` for a page chunk.
fn page_ids(store: &Store, c: &Checkpoint) -> Result<HashSet<(ChunkId, u8)>, MemError> {
    let mut set = HashSet::new();
    let mut runs: HashMap<ChunkId, bool> = HashMap::new();
    let maps = super::restore::read_maps(store, &c.map_roots, super::restore::MAP_READERS)
        .map_err(|(bi, source)| MemError::MetaDamaged {
            name: c.manifest.name.clone(),
            what: format!(
                "page map of ramblock '{}'",
                c.manifest.blocks.get(bi).map_or("?", |b| b.name.as_str())
            ),
            source,
        })?;
    for (bi, ids) in maps.ids.iter().enumerate() {
        for (p, id) in ids.iter().enumerate().filter(|(_, i)| !i.is_zero()) {
            let run = *runs
                .entry(*id)
                .or_insert_with(|| c.manifest.version >= 3 && is_run_chunk(store, id));
            set.insert((*id, if run { maps.slot(bi, p as u32) } else { u8::MAX }));
        }
    }
    Ok(set)
}

/// Describe checkpoint `name`; `sharing` reads every checkpoint's page maps.
pub fn inspect(store: &Store, name: &str, sharing: bool) -> Result<Inspection, MemError> {
    let c = load_checkpoint(store, name)?;
    let sharing = if sharing {
        let mine = page_ids(store, &c)?;
        let mut others: HashSet<(ChunkId, u8)> = HashSet::new();
        let mut n = 0;
        for s in list(store)? {
            if s.name == name || s.error.is_some() {
                continue;
            }
            let o = load_checkpoint(store, &s.name)?;
            others.extend(page_ids(store, &o)?);
            n += 1;
        }
        let shared = mine.iter().filter(|i| others.contains(i)).count() as u64;
        Some(Sharing {
            distinct_pages: mine.len() as u64,
            shared_pages: shared,
            exclusive_pages: mine.len() as u64 - shared,
            other_checkpoints: n,
        })
    } else {
        None
    };
    Ok(Inspection {
        name: name.into(),
        generation: c.generation,
        total_pages: c.manifest.total_pages(),
        manifest: c.manifest,
        sharing,
    })
}

//! Host-local copies of page-map tree chunks, so a restore on the host that saved a
//! checkpoint does not wait for its page maps to cross the link before the first page does.
//!
//! A 128 MiB checkpoint's page maps are ~1 MiB of chunk ids in 17 tree chunks. Read from a
//! remote backend they are two dependent round trips (roots, then leaves) and ~0.6 MB on the
//! link: ~12–18 ms in which no page can be read, because the maps say where the pages are
//! (`docs/memory.md`, Restore). A memory save already has every tree in hand, so it keeps a
//! copy here; a restore that finds none fetches the trees and keeps them for the next time.
//!
//! The backend stays the source of truth; this is a cache in the sense of `meta.rs`:
//! * **Content-addressed, so never stale.** A file is named by its chunk id and holds the
//!   tree's raw bytes. A read hashes the bytes (BLAKE3, ~1 ms per MiB) and treats a mismatch
//!   (a torn or damaged file) as a miss, deleting the file. No entry can say anything the
//!   backend does not.
//! * **Best effort.** Writes go to a temporary name and are renamed into place, without fsync:
//!   a crash can lose entries, never expose half of one. A failed write or a full disk is
//!   logged and ignored; the restore then reads the backend as it would without the cache.
//! * **Bounded.** At most [`TREE_CACHE_BYTES`]; when an insert passes the cap, the least
//!   recently used files (by mtime, refreshed on every hit) are deleted down to 3/4 of it.
//!   A 2 GiB guest's maps are ~16 MiB, so the cap keeps the maps of the last ~16 such saves.
//! * **Shared by processes.** Two strata processes on one local directory see each other's
//!   entries; renames are atomic and entries immutable, so they need no lock.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::id::ChunkId;

const TARGET: &str = "strata::store::tree_cache";

/// Cap on the bytes kept.
pub(crate) const TREE_CACHE_BYTES: u64 = 256 << 20;
/// Largest tree chunk kept (a leaf of 2048 ids is 64 KiB plus a header).
const MAX_ENTRY: usize = 1 << 20;

/// The directory of cached trees (`trees/` in the store's local directory).
#[derive(Debug)]
pub struct TreeCache {
    dir: PathBuf,
    cap: u64,
    /// Bytes in the directory as far as this process knows (`u64::MAX`: not counted yet).
    used: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl TreeCache {
    pub fn new(dir: PathBuf) -> TreeCache {
        Self::with_cap(dir, TREE_CACHE_BYTES)
    }

    pub fn with_cap(dir: PathBuf, cap: u64) -> TreeCache {
        TreeCache {
            dir,
            cap,
            used: AtomicU64::new(u64::MAX),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// (hits, misses) since this instance was made.
    pub fn counters(&self) -> (u64, u64) {
        (self.hits.load(Ordering::Relaxed), self.misses.load(Ordering::Relaxed))
    }

    fn path(&self, id: &ChunkId) -> PathBuf {
        self.dir.join(id.to_hex())
    }

    /// Whether a copy of tree `id` is here (not verified: [`TreeCache::get`] does that).
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.path(id).exists()
    }

    /// The tree's raw bytes, if a verified copy is here.
    pub fn get(&self, id: &ChunkId) -> Option<Vec<u8>> {
        let path = self.path(id);
        let got = std::fs::read(&path).ok().filter(|b| b.len() <= MAX_ENTRY);
        match got {
            Some(bytes) if ChunkId::of(&bytes) == *id => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                // Recency for eviction; a failure only makes the entry look older.
                if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                Some(bytes)
            }
            Some(_) => {
                tracing::warn!(target: TARGET, %id, path = %path.display(), "Cached tree does not match its id; dropped, reading the backend instead");
                let _ = std::fs::remove_file(&path);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Keep a copy of tree `id` (`raw` must be its bytes). Errors are logged, not returned.
    pub fn put(&self, id: &ChunkId, raw: &[u8]) {
        debug_assert_eq!(ChunkId::of(raw), *id);
        if raw.len() > MAX_ENTRY {
            return;
        }
        let path = self.path(id);
        if path.exists() {
            return;
        }
        if let Err(e) = self.write(&path, raw) {
            tracing::debug!(target: TARGET, %id, error = %e, "Tree not cached");
            return;
        }
        let before = self.used.load(Ordering::Relaxed);
        let used = if before == u64::MAX {
            self.count()
        } else {
            self.used.fetch_add(raw.len() as u64, Ordering::Relaxed) + raw.len() as u64
        };
        if used > self.cap {
            self.evict();
        }
    }

    fn write(&self, path: &Path, raw: &[u8]) -> std::io::Result<()> {
        write_whole(&self.dir, path, raw)
    }

    fn entries(&self) -> Vec<(SystemTime, u64, PathBuf)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        rd.flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                m.is_file()
                    .then(|| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len(), e.path()))
            })
            .collect()
    }

    /// Count the directory's bytes (once per instance, then kept up to date by `put`).
    fn count(&self) -> u64 {
        let n = self.entries().iter().map(|e| e.1).sum();
        self.used.store(n, Ordering::Relaxed);
        n
    }

    /// Delete the least recently used entries down to 3/4 of the cap.
    fn evict(&self) {
        let mut all = self.entries();
        all.sort();
        let mut used: u64 = all.iter().map(|e| e.1).sum();
        let mut dropped = 0;
        for (_, len, path) in all {
            if used <= self.cap / 4 * 3 {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                used -= len;
                dropped += 1;
            }
        }
        self.used.store(used, Ordering::Relaxed);
        tracing::debug!(target: TARGET, dropped, used, "Tree cache trimmed");
    }
}

/// Write `raw` to `path` in `dir` through a temporary name and a rename, without fsync: a
/// crash can lose the file, never expose part of it. Shared with `ref_copies.rs`.
pub(super) fn write_whole(dir: &Path, path: &Path, raw: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".tmp-{}-{:x}", std::process::id(), rand::random::<u64>()));
    let r = std::fs::write(&tmp, raw).and_then(|_| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_verified_and_a_damaged_one_is_a_miss() {
        let d = tempfile::tempdir().unwrap();
        let c = TreeCache::new(d.path().join("trees"));
        let raw = b"a tree".to_vec();
        let id = ChunkId::of(&raw);
        assert_eq!(c.get(&id), None);
        c.put(&id, &raw);
        assert_eq!(c.get(&id), Some(raw.clone()));
        // Another process sees it.
        assert_eq!(TreeCache::new(d.path().join("trees")).get(&id), Some(raw.clone()));
        std::fs::write(c.dir().join(id.to_hex()), b"a trex").unwrap();
        assert_eq!(c.get(&id), None);
        assert!(!c.dir().join(id.to_hex()).exists(), "damaged entry deleted");
        assert_eq!(c.counters(), (1, 2), "(hits, misses) of this instance");
        // No temporary files left behind.
        c.put(&id, &raw);
        let names: Vec<_> =
            std::fs::read_dir(c.dir()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(id.to_hex())]);
    }

    #[test]
    fn the_least_recently_used_entries_go_first() {
        let d = tempfile::tempdir().unwrap();
        let c = TreeCache::with_cap(d.path().join("t"), 4000);
        let items: Vec<(ChunkId, Vec<u8>)> = (0..4u8)
            .map(|i| {
                let raw = vec![i; 1000];
                (ChunkId::of(&raw), raw)
            })
            .collect();
        let old = SystemTime::now() - std::time::Duration::from_secs(100);
        for (k, (id, raw)) in items.iter().enumerate() {
            c.put(id, raw);
            let f = std::fs::File::options().append(true).open(c.dir().join(id.to_hex())).unwrap();
            f.set_modified(old + std::time::Duration::from_secs(k as u64)).unwrap();
        }
        // Entry 0 is used again, so 1 and 2 are the oldest when a fifth passes the cap.
        assert!(c.get(&items[0].0).is_some());
        let raw = vec![9u8; 1000];
        c.put(&ChunkId::of(&raw), &raw);
        let kept: Vec<bool> =
            items.iter().map(|(id, _)| c.dir().join(id.to_hex()).exists()).collect();
        assert_eq!(kept, vec![true, false, false, true]);
        assert!(c.get(&ChunkId::of(&raw)).is_some());
    }
}

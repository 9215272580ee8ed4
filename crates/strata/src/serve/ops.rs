//! Disk operations the serving daemon runs on the disks it holds open.
//!
//! `strata serve` owns every disk a client has opened: its volume (map, write log, lock and
//! writer lease) lives in the daemon, so a command run elsewhere would be refused the disk.
//! These operations are what the daemon's control socket runs instead: a snapshot or clone of
//! an open disk cuts it (`disk::cut`: every write acknowledged before, none after, with no
//! pause for the clients) and folds the cut on the caller's thread; several disks are cut at
//! one instant. A disk nobody has open is handled as the plain `disk` functions would.
//! Removing or reverting a disk with clients connected is refused unless forced; forcing
//! revokes the disk's exports (every request then fails with ESHUTDOWN and the connections
//! are closed) before the volume goes.

use super::{DiskExports, Revocation};
use crate::disk::cut::{self, Cut, Folded};
use crate::disk::{self, volume::Volume, DiskError, DiskInfo, DiskMeta};
use crate::id::ChunkId;
use crate::progress::Progress;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

type Result<T> = std::result::Result<T, DiskError>;

/// A disk the daemon has open: its volume and the revocation its connections share (its
/// `Arc` count minus one is the number of connected exports).
#[derive(Clone)]
pub struct Held {
    pub(super) vol: Arc<Volume>,
    pub(super) revoked: Arc<Revocation>,
}

impl Held {
    /// NBD connections that have this disk open.
    pub fn clients(&self) -> usize {
        Arc::strong_count(&self.revoked).saturating_sub(1)
    }
}

impl DiskExports {
    /// The open volume of writable disk `name`, opening it if nobody has: one volume per
    /// disk, shared by every connection and operation. Opens of the same disk wait for each
    /// other; opens of different disks (the clones of a boot storm) run in parallel.
    pub(super) fn hold(&self, name: &str) -> Result<Held> {
        let gate = self.opening.lock().entry(name.to_string()).or_default().clone();
        let _gate = gate.lock();
        if let Some(h) = self.open.lock().get(name) {
            return Ok(h.clone());
        }
        let v = Volume::open(&self.store, name)?;
        v.set_compact_at(self.compact_at.load(Ordering::Relaxed));
        let h = Held { vol: v, revoked: Arc::new(Revocation::default()) };
        self.open.lock().insert(name.into(), h.clone());
        Ok(h)
    }

    /// Whether the daemon has disk `name` open, and with how many connections.
    pub fn held(&self, name: &str) -> Option<usize> {
        self.open.lock().get(name).map(Held::clients)
    }

    /// Cut writable disks at one instant (see `disk::cut`), opening those nobody has open.
    pub fn cut(&self, names: &[String]) -> Result<Vec<Cut>> {
        let vols: Vec<Arc<Volume>> =
            names.iter().map(|n| self.hold(n).map(|h| h.vol)).collect::<Result<_>>()?;
        cut::cut_all(&vols)
    }

    /// Exact snapshots `disk@snap` of several disks, cut at one instant and then folded and
    /// committed one after another.
    pub fn snapshot(&self, pairs: &[(String, String)]) -> Result<Vec<DiskInfo>> {
        for (d, s) in pairs {
            let full = format!("{d}@{s}");
            if disk::load(&self.store, &full).is_ok() {
                return Err(DiskError::Exists { name: full });
            }
            if disk::load(&self.store, d)?.1.snapshot_of.is_some() {
                return Err(DiskError::ReadOnlySnapshot { name: d.clone() });
            }
        }
        let names: Vec<String> = pairs.iter().map(|(d, _)| d.clone()).collect();
        let cuts = self.cut(&names)?;
        let ses = self.store.session();
        let mut out = Vec::with_capacity(pairs.len());
        for (c, (_, snap)) in cuts.iter().zip(pairs) {
            let folded = c.fold(&ses)?;
            out.push(disk::commit_cut_snapshot(&self.store, snap, &folded)?);
        }
        Ok(out)
    }

    /// Fold one cut of `name` (the disk's content now), when the daemon has it open; `None`
    /// for a snapshot or a disk nobody has open (its ref is its content).
    fn fold_if_held(&self, name: &str) -> Result<Option<Folded>> {
        if self.held(name).is_none() {
            return Ok(None);
        }
        let cuts = self.cut(&[name.to_string()])?;
        Ok(Some(cuts[0].fold(&self.store.session())?))
    }

    /// Clone `src` (a disk, open or not, or a snapshot) into the new disk `dst`.
    pub fn clone_disk(&self, src: &str, dst: &str, full: bool) -> Result<DiskInfo> {
        match self.fold_if_held(src)? {
            Some(f) => {
                let parent = if full { None } else { Some(src.to_string()) };
                disk::clone_root(&self.store, dst, f.root, f.meta, parent)
            }
            None => disk::clone(&self.store, src, dst, full),
        }
    }

    /// Write `name`'s current content to a raw file.
    pub fn export(&self, name: &str, file: &Path, progress: &dyn Progress) -> Result<u64> {
        match self.fold_if_held(name)? {
            Some(f) => disk::export_root(&self.store, &f.root, &f.meta, file, progress),
            None => disk::export(&self.store, name, file, progress),
        }
    }

    /// Fold `name`'s log into its map now (through its open volume if held).
    pub fn compact(&self, name: &str) -> Result<u64> {
        self.hold(name)?.vol.compact()
    }

    /// Close the daemon's volume of `name` for an operation that replaces or removes the
    /// disk: refused while clients are connected unless `force`, which revokes their exports
    /// first. The volume is flushed and folded (a removal or revert then drops its content).
    /// True if the daemon had the disk open.
    fn release(&self, name: &str, force: bool) -> Result<bool> {
        let gate = self.opening.lock().entry(name.to_string()).or_default().clone();
        let _gate = gate.lock();
        // Counted in the map: a clone of the entry would count itself.
        let Some((clients, h)) = self.open.lock().get(name).map(|h| (h.clients(), h.clone()))
        else {
            return Ok(false);
        };
        if clients > 0 && !force {
            return Err(DiskError::Connected { name: name.into(), clients });
        }
        h.revoked.revoke();
        self.open.lock().remove(name);
        h.vol.close()?;
        Ok(true)
    }

    /// Remove disk or snapshot `name` (see [`release`](Self::release) for disks in use).
    pub fn remove(&self, name: &str, force: bool) -> Result<()> {
        if self.release(name, force)? {
            disk::remove_released(&self.store, name)
        } else {
            disk::remove(&self.store, name)
        }
    }

    /// Revert writable disk `name` to the content of `root` (`meta` its geometry), e.g. one
    /// disk of a desktop snapshot (see [`release`](Self::release) for disks in use).
    pub fn revert(
        &self,
        name: &str,
        root: ChunkId,
        meta: &DiskMeta,
        force: bool,
    ) -> Result<DiskInfo> {
        if self.release(name, force)? {
            disk::revert_released(&self.store, name, root, meta)
        } else {
            disk::revert(&self.store, name, root, meta)
        }
    }
}

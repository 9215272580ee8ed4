//! Refs and the writer leases that guard them: reading, listing and deleting refs, and the
//! per-name lease under which a ref is committed or deleted. Writing a ref is
//! `Session::commit_ref` (`session.rs`): it flushes first, then takes its lease through
//! `lease_for_commit` here.

use super::objects::{valid_ref_name, Ref};
use super::{lease, Result, Store, StoreError};

impl Store {
    /// Read a ref.
    pub fn get_ref(&self, name: &str) -> Result<Option<Ref>> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        let key = format!("refs/{name}");
        match self.inner.sh.backend.get(&key) {
            Ok(b) => Ref::decode(&b).map(Some).map_err(|source| StoreError::Format { key, source }),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Names of all refs under `prefix` (e.g. `disk/`), sorted.
    pub fn list_refs(&self, prefix: &str) -> Result<Vec<String>> {
        let mut v: Vec<String> = self
            .inner
            .sh
            .backend
            .list(&format!("refs/{prefix}"))?
            .into_iter()
            .filter_map(|o| o.key.strip_prefix("refs/").map(str::to_string))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Delete a ref durably. Its chunks become garbage for the next GC.
    pub fn delete_ref(&self, name: &str) -> Result<()> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        self.inner.sh.check_poison()?;
        let _tmp = self.lease_for_commit(name)?;
        if self.get_ref(name)?.is_none() {
            return Err(StoreError::RefNotFound { name: name.into() });
        }
        let key = format!("refs/{name}");
        // The copy goes first: a copy of a deleted ref would only be a wasted guess, but
        // one that outlived a failed delete is harmless too (the backend's ref decides).
        if let Some(c) = self.ref_copies() {
            c.remove(name);
        }
        self.inner.sh.backend.delete(&key).map_err(|e| {
            self.inner.sh.poison(&e);
            StoreError::Backend(e)
        })?;
        self.inner.sh.sync()
    }

    /// Take the writer lease on ref `name` (e.g. `disk/desk1`) for as long as the guard lives:
    /// no other store instance, on any host, can commit or delete that ref meanwhile.
    pub fn lease(&self, name: &str) -> Result<lease::LeaseGuard> {
        if !valid_ref_name(name) {
            return Err(StoreError::BadRefName { name: name.into() });
        }
        Ok(self.inner.leases.acquire_ref(name)?)
    }

    /// Like [`Store::lease`], but None if this instance already holds the lease (an outer
    /// operation took it), so nested operations on one name compose.
    pub fn lease_if_needed(&self, name: &str) -> Result<Option<lease::LeaseGuard>> {
        if self.inner.leases.holds_ref(name) {
            self.inner.leases.check_ref(name)?;
            return Ok(None);
        }
        self.lease(name).map(Some)
    }

    /// Lease time-to-live for leases taken from now on (default 30 s, `STRATA_LEASE_TTL_MS`).
    pub fn set_lease_ttl(&self, ttl: std::time::Duration) {
        self.inner.leases.set_ttl(ttl);
    }

    /// Before a ref is written: our presence must be unbroken (no GC can have run), and we
    /// must hold the name's lease, taking it for this commit if nobody does.
    pub(super) fn lease_for_commit(&self, name: &str) -> Result<Option<lease::LeaseGuard>> {
        self.inner.leases.check_presence()?;
        if self.inner.leases.holds_ref(name) {
            self.inner.leases.check_ref(name)?;
            Ok(None)
        } else {
            match self.inner.leases.acquire_ref(name) {
                Ok(g) => Ok(Some(g)),
                // Another thread of this instance is committing it right now: same writer.
                Err(lease::LeaseError::AlreadyHeld { .. }) => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
    }
}

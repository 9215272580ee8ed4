//! The save's listing of checkpoint refs: is the name taken, and could any checkpoint be a
//! delta base. It is one backend round trip, started beside the read-only QMP queries.
//!
//! On S3 a LIST is the slowest request there is (tens of ms on real object storage, up to
//! 14-19 ms even on a loopback server, against ~2 ms for the QMP queries), so waiting for it
//! before changing QEMU would hold up the whole save. The save waits only when the answer can
//! change what it sends: with the `auto` delta base on a host that has seen a checkpoint in
//! this store (a copy of a checkpoint ref, `store/ref_copies.rs`), or on a store that keeps no
//! such copies (the local backend, where listing is a directory read). Otherwise the
//! migration starts, and the answer is checked as it arrives (polled with the migration's
//! status) and, at the latest, before the commit:
//! * a taken name (without `--replace`) cancels the migration and fails the save with the
//!   same error as a check before the migration would; the guard of `mod.rs` resumes the
//!   guest, which was paused only that long, and nothing becomes visible (the packs already
//!   uploaded are unreferenced, for GC);
//! * checkpoints this host did not know of only mean this save has no delta base (logged).
//!
//! The commit still takes the name under its lease and refuses a ref that exists, so the
//! name check is never skipped, only moved.

use std::thread::JoinHandle;
use std::time::Instant;

use super::{BasePolicy, MemError, Store, REF_PREFIX, TARGET};
use crate::store::StoreError;

type Answer = Result<(bool, bool), StoreError>;

pub(super) struct Listing {
    handle: Option<JoinHandle<Answer>>,
    name: String,
    replace: bool,
}

impl Listing {
    /// Start listing the refs on a helper thread.
    pub(super) fn start(
        store: &Store,
        rname: &str,
        name: &str,
        replace: bool,
    ) -> Result<Listing, MemError> {
        let (store, rname) = (store.clone(), rname.to_string());
        let handle = std::thread::Builder::new()
            .name("strata-save-list".into())
            .spawn(move || -> Answer {
                let t = Instant::now();
                let refs = store.list_refs(REF_PREFIX)?;
                tracing::debug!(target: TARGET, list_ms = t.elapsed().as_secs_f64() * 1e3, "save: refs listed");
                Ok((refs.contains(&rname), !refs.is_empty()))
            })
            .map_err(|_| MemError::Panic { what: "ref listing" })?;
        Ok(Listing { handle: Some(handle), name: name.into(), replace })
    }

    /// Before QEMU is changed: whether any checkpoint exists, once the answer is in, waiting
    /// for it if it can change the save ([`needs_answer`]); `None` when the save goes on
    /// without it. A taken name fails here if the answer is in.
    pub(super) fn before_migrate(
        &mut self,
        store: &Store,
        base: &BasePolicy,
    ) -> Result<Option<bool>, MemError> {
        let pending = self.handle.as_ref().is_some_and(|h| !h.is_finished());
        if pending && !needs_answer(store, base) {
            tracing::debug!(target: TARGET, name = %self.name, "save: listing still running; checked during the stream");
            return Ok(None);
        }
        self.join().map(Some)
    }

    /// During the stream: check the answer if it has arrived.
    pub(super) fn poll(&mut self) -> Result<(), MemError> {
        if self.handle.as_ref().is_some_and(|h| h.is_finished()) {
            self.late()?;
        }
        Ok(())
    }

    /// Before the commit: the answer, waited for if it is still out.
    pub(super) fn finish(&mut self) -> Result<(), MemError> {
        if self.handle.is_some() {
            self.late()?;
        }
        Ok(())
    }

    fn late(&mut self) -> Result<(), MemError> {
        if self.join()? {
            tracing::info!(target: TARGET, name = %self.name, "checkpoints this host had not seen exist; saved without a delta base, as the listing came late");
        }
        Ok(())
    }

    /// Whether any checkpoint exists; `Exists` if this name does (and may not be replaced).
    fn join(&mut self) -> Result<bool, MemError> {
        let Some(h) = self.handle.take() else { return Ok(false) };
        let (exists, any) = h
            .join()
            .map_err(|_| MemError::Panic { what: "ref listing" })?
            .map_err(|e| MemError::store("list", &self.name)(e))?;
        if exists && !self.replace {
            return Err(MemError::Exists { name: self.name.clone() });
        }
        Ok(any)
    }
}

/// Whether the save must know the listing before it starts: the `auto` delta base picks the
/// newest fitting checkpoint, so it waits where one may exist (this host keeps a copy of a
/// checkpoint ref) or where it cannot tell (no ref copies: a local store). `--no-delta` and
/// `--base NAME` do not need it.
fn needs_answer(store: &Store, base: &BasePolicy) -> bool {
    match base {
        BasePolicy::Auto => store.ref_copies().is_none_or(|c| c.any_with_prefix(REF_PREFIX)),
        BasePolicy::Named(_) | BasePolicy::Off => false,
    }
}

//! Compaction: folding a frozen log file into the disk's base map, in the background.
//!
//! When the active log passes the threshold, the appending thread *freezes* it: a new, empty
//! log file N+1 is created durably and takes every later append, and file N with its overlay
//! becomes read-only. A background thread then assembles every block file N touched (base +
//! N's overlay, never N+1's), stores the blocks as chunks on all cores, writes the new map
//! and commits the disk's ref with `log_folded = N`; only then does it swap in the new base,
//! drop N's overlay and unlink the logs up to N. Reads meanwhile see active over frozen over
//! base, and writes go on into N+1.
//!
//! Crash safety (`docs/durability.md`): the ref commit is the one switch. Before it is
//! durable, recovery replays N and then N+1 on the old base; after it, recovery removes the
//! logs up to N and replays N+1 on the new base. The frozen file's records are not durable
//! until the fold commits, so the first guest flush after a freeze fdatasyncs the frozen file
//! as well as the active one (one extra fdatasync per rollover, once per threshold of
//! writes); later flushes sync only the active file.
//!
//! Back-pressure: while a fold runs, appends go on freely until the active log reaches the
//! threshold; past it, writers are paced by the fold's progress (the log may grow by the share
//! of the blocks folded), so it reaches twice the threshold only as the fold ends. The log (and
//! what recovery replays) stays bounded, writes slow down to the fold's speed in small steps
//! instead of stopping, and no write waits for more than the one fold (whoever starts the next).
//! Explicit `compact()` (snapshots, clones, exports, shutdown) waits for a running fold, with
//! no background fold starting meanwhile, and then folds the active log in the calling thread.

use super::cut::{store_blocks, touched_blocks, Layers};
use super::extent::ExtentMap;
use super::log::{LogHeader, LogWriter};
use super::volume::{io_err, FrozenLog, SyncEvent, Volume};
use super::{ref_name, Result};
use crate::store::map;
use crate::store::objects::Ref;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// `fold_progress` of a finished fold.
const PROGRESS_ONE: u64 = 1 << 16;

/// How large the active log may grow while a fold is `progress` (of [`PROGRESS_ONE`]) through
/// its blocks: the threshold, plus that share of it again.
fn paced_limit(limit: u64, progress: u64) -> u64 {
    limit.saturating_add(
        ((limit as u128 * progress.min(PROGRESS_ONE) as u128) / PROGRESS_ONE as u128) as u64,
    )
}

/// A frozen log file waiting to be folded.
pub(super) struct Segment {
    /// File number of the frozen log; every log up to it is folded by this segment.
    seq: u64,
    /// Its writes (and those of older unfolded logs replayed at open).
    map: Arc<ExtentMap>,
    /// Records appended (volume-wide count) when it was frozen.
    upto: u64,
}

impl Volume {
    /// Called by a writer once the active log passed the threshold: `grown` is where its record
    /// ended in log file `seq`.
    pub(super) fn compact_in_background(&self, grown: u64, seq: u64) -> Result<()> {
        let limit = self.compact_at.load(Ordering::Relaxed);
        let mut c = self.compaction.lock();
        if c.running {
            // Paced: past the threshold, the log may grow by the share of the fold done (up to
            // twice the threshold when it is done), so writers slow down to the fold's speed
            // a little at a time instead of stopping for the rest of the fold at twice the
            // threshold. Scattered writes make a fold slow (a 4 KiB write costs a 64 KiB
            // block): with the 1 GiB default, fio random writes over a 32 GiB disk saw a
            // 16.7 s stop.
            if grown <= paced_limit(limit, self.fold_progress.load(Ordering::Acquire)) {
                return Ok(());
            }
            // Wait for this fold to move on or end, not for no fold to run: when it ends,
            // every waiting writer wakes, and the first to take the lock freezes the log and
            // starts the next fold. Waiting on `running` left the others asleep again behind
            // that one, each released one fold later: a guest write under random-write load
            // waited 20 s behind ~15 folds (the `disk_crash` test).
            self.stats.compaction_waits.fetch_add(1, Ordering::Relaxed);
            let this = c.finished;
            // A record in a log frozen since is in the running fold's hands: no wait for it.
            while c.running
                && c.finished == this
                && grown > paced_limit(limit, self.fold_progress.load(Ordering::Acquire))
                && self.log.lock().header.file_seq == seq
            {
                // Fold workers notify at every 1/256 of progress; the timeout covers a notify
                // that came between the check and the wait.
                self.compaction_cv.wait_for(&mut c, std::time::Duration::from_millis(20));
            }
            self.check_failed()?;
            if c.running {
                // Still this fold (it moved on far enough), or another writer has frozen the
                // log and started the next one already.
                return Ok(());
            }
        }
        // An explicit compaction is about to fold the whole log; or another writer may have
        // frozen it meanwhile.
        if c.explicit > 0 || self.log.lock().pos <= limit {
            return Ok(());
        }
        let Some(me) = self.me.upgrade() else { return Ok(()) };
        c.running = true;
        self.fold_progress.store(0, Ordering::Release);
        if let Some(t) = c.thread.take() {
            // It already cleared `running`, so it is finishing.
            let _ = t.join();
        }
        drop(c);
        let seg = match self.freeze() {
            Ok(Some(seg)) => seg,
            other => {
                let r = other.map(|_| 0);
                self.finish_compaction(&r);
                return r.map(|_| ());
            }
        };
        let spawned = std::thread::Builder::new().name("disk-compact".into()).spawn(move || {
            let r = me.fold(seg);
            me.finish_compaction(&r);
        });
        match spawned {
            Ok(h) => self.compaction.lock().thread = Some(h),
            Err(e) => {
                // The closure (and the segment) are gone, but the frozen overlay is still in
                // the state: fold it here.
                tracing::warn!(target: "strata::disk", error = %e, "cannot start a compaction thread; compacting inline");
                let r = self.fold_frozen();
                self.finish_compaction(&r);
                r?;
            }
        }
        Ok(())
    }

    /// Fold the frozen overlay, if any, in this thread.
    fn fold_frozen(&self) -> Result<u64> {
        let (map, gen) = {
            let st = self.state.read();
            (st.frozen.clone(), st.generation)
        };
        let (Some(map), Some(seq)) = (map, self.frozen_log.lock().as_ref().map(|f| f.seq)) else {
            return Ok(gen);
        };
        // `upto` 0: nothing is marked durable beyond what flushes synced (conservative).
        self.fold(Segment { seq, map, upto: 0 })
    }

    fn finish_compaction(&self, r: &Result<u64>) {
        if let Err(e) = r {
            // The base and the logs may now disagree about which is current; reopening
            // resolves it from the ref, so refuse I/O until then.
            tracing::error!(target: "strata::disk", disk = %self.name, error = %e, "compaction failed");
            *self.failed.lock() = Some(format!("compaction failed: {e}"));
        }
        let mut c = self.compaction.lock();
        c.running = false;
        c.finished += 1;
        self.compaction_cv.notify_all();
    }

    /// Wait until no compaction runs (and reap its thread).
    pub fn wait_compaction(&self) {
        let mut c = self.compaction.lock();
        while c.running {
            self.compaction_cv.wait(&mut c);
        }
        let t = c.thread.take();
        drop(c);
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// Fold the whole log into the base map now and start a new log. Returns the new
    /// generation. Waits for a background fold first.
    pub fn compact(&self) -> Result<u64> {
        let mut c = self.compaction.lock();
        c.explicit += 1;
        while c.running {
            self.compaction_cv.wait(&mut c);
        }
        c.explicit -= 1;
        self.check_failed()?;
        c.running = true;
        self.fold_progress.store(0, Ordering::Release);
        drop(c);
        let r = match self.freeze() {
            Ok(Some(seg)) => self.fold(seg),
            Ok(None) => Ok(self.state.read().generation),
            Err(e) => Err(e),
        };
        self.finish_compaction(&r);
        r
    }

    /// Switch appends to a new log file and freeze the current one. `None` if it is empty.
    fn freeze(&self) -> Result<Option<Segment>> {
        self.check_failed()?;
        let mut w = self.log.lock();
        let gen = {
            let st = self.state.read();
            if w.next_seq == 1 && st.active.is_empty() && st.files.len() <= 1 {
                return Ok(None);
            }
            st.generation
        };
        let seq = w.header.file_seq;
        let next = seq + 1;
        let nw = LogWriter::create(
            &self.dir.join(format!("log.{next}")),
            LogHeader::new(w.header.disk_id, gen, next),
        )?;
        let _ = self.hook(SyncEvent::LogCreated(nw.path.clone()));
        let handle = Arc::new(nw.file_handle()?);
        let old = std::mem::replace(&mut *w, nw);
        let upto = self.appended.load(Ordering::Acquire);
        let (map, file) = {
            let mut st = self.state.write();
            st.files.insert(next as u32, handle);
            let m = std::mem::take(&mut st.active);
            st.frozen = Some(m.clone());
            (m, st.files.get(&(seq as u32)).cloned())
        };
        if let Some(file) = file {
            *self.frozen_log.lock() =
                Some(FrozenLog { seq, file, path: old.path.clone(), synced: false });
        }
        drop(w);
        Ok(Some(Segment { seq, map, upto }))
    }

    /// Fold a frozen segment into the base and commit it (see the module comment).
    fn fold(&self, seg: Segment) -> Result<u64> {
        let frozen_path = self.dir.join(format!("log.{}", seg.seq));
        self.hook(SyncEvent::FoldStart(frozen_path.clone()))
            .map_err(|e| io_err("fold", &frozen_path, e))?;
        let (base, files) = {
            let st = self.state.read();
            (st.base.clone(), st.files.clone())
        };
        let bs = self.meta.block_size as u64;
        let touched = touched_blocks(&[&*seg.map], bs);
        let ses = self.store.session();
        self.fold_progress.store(0, Ordering::Release);
        let maps = [&*seg.map];
        let layers = Layers { maps: &maps, base: &base, files: &files };
        let on_block = |d: u64, total: u64| {
            self.fold_progress.store(d * PROGRESS_ONE / total, Ordering::Release);
            if d * 256 / total != (d - 1) * 256 / total {
                self.compaction_cv.notify_all();
            }
        };
        let stored = store_blocks(
            &self.store,
            &self.dir,
            &ses,
            &layers,
            (bs, self.meta.size),
            &touched,
            &self.stats.compaction_bytes,
            &on_block,
        )?;
        let mut new_base = (*base).clone();
        for (b, id) in stored {
            new_base[b as usize] = id;
        }
        let root = map::write_map(&ses, &new_base)?;
        let mut meta = self.meta.clone();
        meta.log_folded = Some(seg.seq);
        meta.allocated = Some(new_base.iter().filter(|b| !b.is_zero()).count() as u64);
        ses.commit_ref(
            &ref_name(&self.name),
            Ref::new(vec![root], serde_json::to_vec(&meta).expect("json")),
        )?;
        let gen = self.store.get_ref(&ref_name(&self.name))?.map(|r| r.generation).unwrap_or(0);
        // Committed: readers switch to the new base, and the folded logs go.
        let dead: Vec<u32> = {
            let mut st = self.state.write();
            st.base = Arc::new(new_base);
            st.frozen = None;
            st.generation = gen;
            let dead: Vec<u32> =
                st.files.keys().copied().filter(|k| *k as u64 <= seg.seq).collect();
            for k in &dead {
                st.files.remove(k);
            }
            dead
        };
        *self.frozen_log.lock() = None;
        self.mark_durable(seg.upto);
        for k in dead {
            let p = self.dir.join(format!("log.{k}"));
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io_err("remove", &p, e))
                }
                _ => {}
            }
        }
        self.stats.compactions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(target: "strata::disk", disk = %self.name, generation = gen, root = %root, folded = seg.seq, "compacted");
        Ok(gen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paced_limit_grows_from_the_threshold_to_twice_it() {
        let l = 1u64 << 30;
        assert_eq!(paced_limit(l, 0), l);
        assert_eq!(paced_limit(l, PROGRESS_ONE / 4), l + l / 4);
        assert_eq!(paced_limit(l, PROGRESS_ONE), 2 * l);
        assert_eq!(paced_limit(l, 5 * PROGRESS_ONE), 2 * l, "capped at a finished fold");
        assert_eq!(paced_limit(u64::MAX, PROGRESS_ONE), u64::MAX);
    }
}

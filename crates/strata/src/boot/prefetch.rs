//! Boot-storm prefetch: when `strata serve` opens a disk whose image (the disk itself or the
//! snapshot it was cloned from, up its parent chain) has a recorded boot working set, it reads
//! that working set into the SSD cache in the background, in bulk and concurrently, instead of
//! leaving the storm to fetch it one demand miss at a time.
//!
//! One prefetch per image per process (`serve::DiskExports` keeps them by image name), shared
//! by every clone of it. It reads through the store's backend stack, whose top is the cache
//! (`serve` starts one only when that stack [can prefetch](Backend::can_prefetch)), like any
//! reader: ranges in the working set's recorded order (the boot's first-read order),
//! consecutive frames of one pack batched into one `get_ranges` (which the S3 backend merges
//! into few GETs), `parallel` batches in flight. A demand read of a frame the prefetch is
//! fetching waits for that fetch (the cache coalesces concurrent misses per frame), and
//! everything read is verified by its hash as usual. Stopping (server shutdown) lets the
//! batches in flight finish and joins the threads.
//! A failed batch is counted and logged and the rest carries on: demand reads still work.

use super::workset::{self, WorkingSet};
use crate::backend::{Backend, DynBackend};
use crate::store::Store;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Default number of batches in flight.
pub const DEFAULT_PARALLEL: usize = 8;
/// Most frames in one batch.
const BATCH_RANGES: usize = 16;
/// Most bytes in one batch. Small enough that the link queue the prefetch builds up (batches
/// in flight times this) delays other readers of the link (a clone's ref, a write-through)
/// by a few tens of milliseconds at most.
const BATCH_BYTES: u64 = 256 << 10;

/// Progress of one prefetch, for `strata stats --json`.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct PrefetchStatus {
    /// The image whose working set is prefetched.
    pub image: String,
    /// "running", "done" or "stopped".
    pub state: &'static str,
    pub chunks: u64,
    /// Chunk ids no longer in the store (skipped).
    pub missing: u64,
    pub ranges: u64,
    pub bytes: u64,
    pub ranges_done: u64,
    pub bytes_done: u64,
    /// Ranges whose batch failed (left to demand reads).
    pub ranges_failed: u64,
    pub secs: f64,
}

/// A running (or finished) background prefetch of one image's working set.
pub struct Prefetch {
    image: String,
    chunks: u64,
    missing: u64,
    ranges: u64,
    bytes: u64,
    ranges_done: AtomicU64,
    bytes_done: AtomicU64,
    ranges_failed: AtomicU64,
    stop: AtomicBool,
    finished: AtomicBool,
    started: Instant,
    secs: Mutex<Option<f64>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Consecutive ranges of one pack, at most `BATCH_RANGES` / `BATCH_BYTES`.
fn batches(ranges: Vec<(String, u64, u64)>) -> Vec<(String, Vec<(u64, u64)>)> {
    let mut out: Vec<(String, Vec<(u64, u64)>)> = Vec::new();
    for (key, off, len) in ranges {
        match out.last_mut() {
            Some((k, v))
                if *k == key
                    && v.len() < BATCH_RANGES
                    && v.iter().map(|r| r.1).sum::<u64>() + len <= BATCH_BYTES =>
            {
                v.push((off, len))
            }
            _ => out.push((key, vec![(off, len)])),
        }
    }
    out
}

impl Prefetch {
    /// Start prefetching `ws` (the working set of `image`) through the store's backend stack
    /// with `parallel` batches in flight. Returns at once; the work runs on its own threads.
    pub fn start(store: &Store, image: &str, ws: &WorkingSet, parallel: usize) -> Arc<Prefetch> {
        let backend: DynBackend = store.backend().clone();
        let (ranges, missing) = workset::ranges_of(store, ws);
        let p = Arc::new(Prefetch {
            image: image.into(),
            chunks: ws.chunks.len() as u64,
            missing,
            ranges: ranges.len() as u64,
            bytes: ranges.iter().map(|r| r.2).sum(),
            ranges_done: AtomicU64::new(0),
            bytes_done: AtomicU64::new(0),
            ranges_failed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            started: Instant::now(),
            secs: Mutex::new(None),
            thread: Mutex::new(None),
        });
        tracing::info!(target: "strata::boot", image, chunks = p.chunks, ranges = p.ranges, bytes = p.bytes, "boot prefetch started");
        let work = batches(ranges);
        let me = p.clone();
        let h = std::thread::Builder::new()
            .name("strata-prefetch".into())
            .spawn(move || me.run(&*backend, &work, parallel.max(1)));
        match h {
            Ok(h) => *p.thread.lock() = Some(h),
            Err(e) => {
                tracing::warn!(target: "strata::boot", image, error = %e, "cannot start the boot prefetch thread");
                p.finish();
            }
        }
        p
    }

    fn run(&self, backend: &dyn Backend, work: &[(String, Vec<(u64, u64)>)], parallel: usize) {
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..parallel.min(work.len()) {
                s.spawn(|| {
                    while !self.stop.load(Ordering::Relaxed) {
                        let Some((key, rs)) = work.get(next.fetch_add(1, Ordering::Relaxed)) else { break };
                        match backend.get_ranges(key, rs) {
                            Ok(got) => {
                                self.ranges_done.fetch_add(rs.len() as u64, Ordering::Relaxed);
                                self.bytes_done.fetch_add(got.iter().map(|v| v.len() as u64).sum(), Ordering::Relaxed);
                            }
                            Err(e) => {
                                self.ranges_failed.fetch_add(rs.len() as u64, Ordering::Relaxed);
                                tracing::warn!(target: "strata::boot", image = %self.image, key, error = %e, "boot prefetch batch failed");
                            }
                        }
                    }
                });
            }
        });
        self.finish();
    }

    fn finish(&self) {
        let secs = self.started.elapsed().as_secs_f64();
        *self.secs.lock() = Some(secs);
        self.finished.store(true, Ordering::Release);
        let st = self.status();
        tracing::info!(target: "strata::boot", image = %self.image, state = st.state, ranges_done = st.ranges_done,
            ranges_failed = st.ranges_failed, bytes_done = st.bytes_done, secs, "boot prefetch ended");
    }

    pub fn image(&self) -> &str {
        &self.image
    }

    pub fn status(&self) -> PrefetchStatus {
        let finished = self.finished.load(Ordering::Acquire);
        let stopped = self.stop.load(Ordering::Relaxed);
        let done = self.ranges_done.load(Ordering::Relaxed);
        let failed = self.ranges_failed.load(Ordering::Relaxed);
        PrefetchStatus {
            image: self.image.clone(),
            state: match (finished, stopped && done + failed < self.ranges) {
                (false, _) => "running",
                (true, true) => "stopped",
                (true, false) => "done",
            },
            chunks: self.chunks,
            missing: self.missing,
            ranges: self.ranges,
            bytes: self.bytes,
            ranges_done: done,
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            ranges_failed: failed,
            secs: self.secs.lock().unwrap_or_else(|| self.started.elapsed().as_secs_f64()),
        }
    }

    /// Wait until every batch has been read (or failed, or the prefetch was stopped).
    pub fn wait(&self) {
        let h = self.thread.lock().take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }

    /// Stop after the batches in flight and wait for the threads.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_runs_of_one_pack_within_the_caps() {
        let r = |k: &str, off: u64, len: u64| (k.to_string(), off, len);
        let mut v = vec![r("a", 0, 10), r("a", 10, 10), r("b", 0, 5), r("a", 20, 10)];
        v.extend((0..20).map(|i| r("c", i * 100, 100)));
        v.push(r("d", 0, 150 << 10));
        v.push(r("d", 150 << 10, 150 << 10));
        let b = batches(v);
        let shape: Vec<(&str, usize)> = b.iter().map(|(k, v)| (k.as_str(), v.len())).collect();
        assert_eq!(
            shape,
            vec![("a", 2), ("b", 1), ("a", 1), ("c", 16), ("c", 4), ("d", 1), ("d", 1)]
        );
        assert_eq!(b[0].1, vec![(0, 10), (10, 10)]);
    }
}

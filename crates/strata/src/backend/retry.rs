//! Retry decorator: repeats operations that failed for a transient reason, with capped
//! exponential backoff and jitter, and counts what it did.
//!
//! Shape, and why:
//! - Only `ErrorKind::Unavailable` is retried (dead or restarting server, connection reset,
//!   timeout, 5xx/SlowDown; the remote backends map all of those to it). `NotFound`, `Invalid`,
//!   `NoSpace`, `PermissionDenied` and `Other` are answers, not hiccups: repeating them only
//!   delays the error the user must act on.
//! - Bounded twice: at most `max_attempts` tries and at most `max_elapsed` in total, so a dead
//!   backend becomes an error in bounded time, and the last error is returned unchanged (its
//!   kind and advice intact).
//! - Delays double from `base_delay` up to `max_delay`, each drawn uniformly from
//!   [d/2, d] ("equal jitter"), so many clients that failed together do not retry in lockstep.
//! - Every operation of the trait is safe to repeat except one: a `put_if_absent` whose first
//!   attempt reached the server but whose reply was lost would be retried into a "key exists"
//!   answer although *we* created the key. After an ambiguous failure, a `false` answer is
//!   therefore checked by reading the object back: if it holds exactly our bytes, we won. Lease
//!   objects carry a unique holder token, so equal bytes mean our own write.
//! - A repeated `put` may land after a concurrent `put` of the same key by another writer;
//!   the store never has two writers of one key (packs and indexes have unique names, refs are
//!   guarded by leases), so this is the same "last writer wins" a single `put` has.

use super::{BResult, Backend, BackendError, Capabilities, DynBackend, ErrorKind, ObjectInfo};
use rand::Rng;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TARGET: &str = "strata::backend::retry";

/// How hard to try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in total, including the first (1 disables retrying).
    pub max_attempts: u32,
    pub base_delay: Duration,
    pub max_delay: Duration,
    /// No new attempt starts after this much time since the first.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 8,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(5),
            max_elapsed: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The delay before retry number `n` (1-based), jittered.
    pub fn delay(&self, n: u32) -> Duration {
        let exp = self.base_delay.saturating_mul(1u32 << (n.saturating_sub(1)).min(20));
        let d = exp.min(self.max_delay);
        let half = d / 2;
        half + rand::thread_rng().gen_range(Duration::ZERO..=d - half)
    }
}

/// Counters (monotonic) of what the decorator did.
#[derive(Debug, Default)]
pub struct RetryStats {
    /// Attempts beyond the first.
    pub retries: AtomicU64,
    /// Operations that failed at first and then succeeded.
    pub recovered: AtomicU64,
    /// Operations that failed transiently on every attempt.
    pub gave_up: AtomicU64,
    /// `put_if_absent` calls decided by reading the object back.
    pub ambiguous_resolved: AtomicU64,
}

/// A snapshot of [`RetryStats`], for `strata stats --json`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RetryCounters {
    pub retries: u64,
    pub recovered: u64,
    pub gave_up: u64,
    pub ambiguous_resolved: u64,
}

/// Retries transient failures of the backend it wraps.
#[derive(Debug)]
pub struct RetryBackend {
    inner: DynBackend,
    policy: RetryPolicy,
    stats: RetryStats,
}

impl RetryBackend {
    pub fn new(inner: DynBackend, policy: RetryPolicy) -> RetryBackend {
        RetryBackend { inner, policy, stats: RetryStats::default() }
    }

    pub fn inner(&self) -> &DynBackend {
        &self.inner
    }

    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    pub fn counters(&self) -> RetryCounters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RetryCounters {
            retries: l(&self.stats.retries),
            recovered: l(&self.stats.recovered),
            gave_up: l(&self.stats.gave_up),
            ambiguous_resolved: l(&self.stats.ambiguous_resolved),
        }
    }

    /// Run `f` until it succeeds, fails for good, or the budget is spent. `f` is told the
    /// attempt number (1-based) and whether an earlier attempt failed ambiguously.
    fn retry<T>(
        &self,
        op: &'static str,
        key: &str,
        mut f: impl FnMut(u32) -> BResult<T>,
    ) -> BResult<T> {
        let start = Instant::now();
        let mut attempt = 1;
        loop {
            match f(attempt) {
                Ok(v) => {
                    if attempt > 1 {
                        self.stats.recovered.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(target: TARGET, op, key, attempt, "recovered after retrying");
                    }
                    return Ok(v);
                }
                Err(e) if e.kind != ErrorKind::Unavailable => return Err(e),
                Err(e) => {
                    let delay = self.policy.delay(attempt);
                    if attempt >= self.policy.max_attempts
                        || start.elapsed() + delay > self.policy.max_elapsed
                    {
                        self.stats.gave_up.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(target: TARGET, op, key, attempt, error = %e, "giving up");
                        return Err(e);
                    }
                    tracing::debug!(target: TARGET, op, key, attempt, ?delay, error = %e, "transient failure; retrying");
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(delay);
                    attempt += 1;
                }
            }
        }
    }
}

impl Backend for RetryBackend {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        self.retry("get", key, |_| self.inner.get(key))
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        self.retry("get_range", key, |_| self.inner.get_range(key, offset, len))
    }

    fn get_ranges(&self, key: &str, ranges: &[(u64, u64)]) -> BResult<Vec<Vec<u8>>> {
        self.retry("get_range", key, |_| self.inner.get_ranges(key, ranges))
    }

    /// A retry resumes after the bytes already given, so the sink sees every byte once.
    fn get_range_to(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]),
    ) -> BResult<()> {
        let mut given = 0u64;
        self.retry("get_range", key, |_| {
            self.inner.get_range_to(key, offset + given, len - given, &mut |piece: &[u8]| {
                given += piece.len() as u64;
                sink(piece)
            })
        })
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.retry("put", key, |_| self.inner.put(key, data))
    }

    fn put_shared(&self, key: &str, data: &Arc<Vec<u8>>) -> BResult<()> {
        self.retry("put", key, |_| self.inner.put_shared(key, data))
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        let mut ambiguous = false;
        self.retry("put_if_absent", key, |_| {
            let r = self.inner.put_if_absent(key, data);
            match &r {
                Ok(false) if ambiguous => {
                    // Did the attempt whose reply we lost create the object? Equal bytes say yes.
                    let ours = match self.inner.get(key) {
                        Ok(v) => v == data,
                        Err(e) if e.is_not_found() => false,
                        Err(e) => return Err(e),
                    };
                    self.stats.ambiguous_resolved.fetch_add(1, Ordering::Relaxed);
                    return Ok(ours);
                }
                Err(e) if e.kind == ErrorKind::Unavailable => ambiguous = true,
                _ => {}
            }
            r
        })
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        self.retry("list", prefix, |_| self.inner.list(prefix))
    }

    fn delete(&self, key: &str) -> BResult<()> {
        self.retry("delete", key, |_| self.inner.delete(key))
    }

    fn sync(&self) -> BResult<()> {
        self.retry("sync", "", |_| self.inner.sync())
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        self.retry("head", key, |_| self.inner.head(key))
    }

    fn can_prefetch(&self) -> bool {
        self.inner.can_prefetch()
    }

    /// Forwarded whole: the cache under this decorator reads through its own backend stack.
    fn prefetch(&self, ranges: &[(String, u64, u64)], parallel: usize) -> BResult<u64> {
        self.inner.prefetch(ranges, parallel)
    }
}

/// A backend that fails on purpose, for tests of the retry path: each call fails with
/// `Unavailable` with probability `fail_per_mille / 1000` (seeded), before or after reaching the
/// inner backend, and optional hard failures of one kind.
#[derive(Debug)]
pub struct FlakyBackend {
    inner: DynBackend,
    rng: parking_lot::Mutex<rand::rngs::StdRng>,
    pub fail_per_mille: u32,
    /// Fail after the inner call succeeded (reply lost) instead of before it.
    pub fail_after: bool,
    /// Every call fails with this kind (not transient) when set.
    pub hard: Option<ErrorKind>,
    pub calls: AtomicU64,
    pub injected: AtomicU64,
}

impl FlakyBackend {
    pub fn new(inner: DynBackend, fail_per_mille: u32, seed: u64) -> FlakyBackend {
        use rand::SeedableRng;
        FlakyBackend {
            inner,
            rng: parking_lot::Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            fail_per_mille,
            fail_after: false,
            hard: None,
            calls: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        }
    }

    fn maybe<T>(&self, op: &'static str, key: &str, f: impl FnOnce() -> BResult<T>) -> BResult<T> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if let Some(kind) = self.hard {
            return Err(BackendError::new(kind, op, key));
        }
        let fail = self.rng.lock().gen_range(0..1000) < self.fail_per_mille;
        if fail && !self.fail_after {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(BackendError::new(ErrorKind::Unavailable, op, key));
        }
        let r = f();
        if fail && r.is_ok() {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(BackendError::new(ErrorKind::Unavailable, op, key));
        }
        r
    }
}

impl Backend for FlakyBackend {
    fn name(&self) -> String {
        format!("flaky({})", self.inner.name())
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        self.maybe("get", key, || self.inner.get(key))
    }
    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        self.maybe("get_range", key, || self.inner.get_range(key, offset, len))
    }
    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.maybe("put", key, || self.inner.put(key, data))
    }
    fn put_volatile(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.maybe("put", key, || self.inner.put_volatile(key, data))
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        self.maybe("put_if_absent", key, || self.inner.put_if_absent(key, data))
    }
    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        self.maybe("list", prefix, || self.inner.list(prefix))
    }
    fn delete(&self, key: &str) -> BResult<()> {
        self.maybe("delete", key, || self.inner.delete(key))
    }
    fn sync(&self) -> BResult<()> {
        self.maybe("sync", "", || self.inner.sync())
    }
    fn head(&self, key: &str) -> BResult<Option<u64>> {
        self.maybe("head", key, || self.inner.head(key))
    }
    fn can_prefetch(&self) -> bool {
        self.inner.can_prefetch()
    }
    fn prefetch(&self, ranges: &[(String, u64, u64)], parallel: usize) -> BResult<u64> {
        self.maybe("prefetch", "", || self.inner.prefetch(ranges, parallel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{conformance, memory::MemoryBackend};
    use std::sync::Arc;

    fn fast() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 30,
            base_delay: Duration::from_micros(100),
            max_delay: Duration::from_millis(2),
            max_elapsed: Duration::from_secs(10),
        }
    }

    #[test]
    fn delays_grow_are_capped_and_jittered() {
        let p = RetryPolicy {
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(100),
            ..RetryPolicy::default()
        };
        for _ in 0..100 {
            let d1 = p.delay(1);
            assert!(d1 >= Duration::from_millis(5) && d1 <= Duration::from_millis(10), "{d1:?}");
            let d3 = p.delay(3);
            assert!(d3 >= Duration::from_millis(20) && d3 <= Duration::from_millis(40), "{d3:?}");
            let d30 = p.delay(30);
            assert!(
                d30 >= Duration::from_millis(50) && d30 <= Duration::from_millis(100),
                "{d30:?}"
            );
        }
        let distinct: std::collections::HashSet<Duration> = (0..50).map(|_| p.delay(4)).collect();
        assert!(distinct.len() > 10, "jitter must spread retries");
    }

    #[test]
    fn a_flaky_backend_conforms_behind_retry() {
        for fail_after in [false, true] {
            let mut flaky = FlakyBackend::new(Arc::new(MemoryBackend::new()), 300, 7);
            flaky.fail_after = fail_after;
            let flaky = Arc::new(flaky);
            let r = RetryBackend::new(flaky.clone(), fast());
            conformance::run_all(&r);
            let c = r.counters();
            assert!(flaky.injected.load(Ordering::Relaxed) > 10, "the test must inject failures");
            assert_eq!(
                c.retries,
                flaky.injected.load(Ordering::Relaxed),
                "each injected failure costs one retry"
            );
            assert!(c.recovered > 0 && c.gave_up == 0, "{c:?}");
            if fail_after {
                assert!(
                    c.ambiguous_resolved > 0,
                    "lost replies of put_if_absent must be resolved: {c:?}"
                );
            }
            let mut flaky2 = FlakyBackend::new(Arc::new(MemoryBackend::new()), 300, 8);
            flaky2.fail_after = fail_after;
            conformance::run_concurrent(Arc::new(RetryBackend::new(Arc::new(flaky2), fast())));
        }
    }

    #[test]
    fn permanent_errors_are_not_retried() {
        for kind in [
            ErrorKind::NotFound,
            ErrorKind::Invalid,
            ErrorKind::NoSpace,
            ErrorKind::PermissionDenied,
            ErrorKind::Other,
        ] {
            let mut flaky = FlakyBackend::new(Arc::new(MemoryBackend::new()), 0, 1);
            flaky.hard = Some(kind);
            let flaky = Arc::new(flaky);
            let r = RetryBackend::new(flaky.clone(), fast());
            assert_eq!(r.put("a", b"x").unwrap_err().kind, kind);
            assert_eq!(flaky.calls.load(Ordering::Relaxed), 1, "{kind:?} must fail at once");
            assert_eq!(r.counters(), RetryCounters::default());
        }
        // A missing object is an answer, tried once.
        let flaky = Arc::new(FlakyBackend::new(Arc::new(MemoryBackend::new()), 0, 1));
        let r = RetryBackend::new(flaky.clone(), fast());
        assert!(r.get("nope").unwrap_err().is_not_found());
        assert_eq!(flaky.calls.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_dead_backend_gives_up_within_the_budget() {
        let mut flaky = FlakyBackend::new(Arc::new(MemoryBackend::new()), 1000, 1);
        flaky.fail_after = false;
        let flaky = Arc::new(flaky);
        let p = RetryPolicy { max_attempts: 5, ..fast() };
        let r = RetryBackend::new(flaky.clone(), p);
        let e = r.get("k").unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable);
        assert_eq!(flaky.calls.load(Ordering::Relaxed), 5);
        assert_eq!(r.counters().retries, 4);
        assert_eq!(r.counters().gave_up, 1);

        let p = RetryPolicy {
            max_attempts: 1000,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(20),
            max_elapsed: Duration::from_millis(150),
        };
        let r = RetryBackend::new(flaky.clone(), p);
        let t = Instant::now();
        assert!(r.sync().is_err());
        assert!(
            t.elapsed() < Duration::from_millis(400),
            "elapsed budget ignored: {:?}",
            t.elapsed()
        );
    }

    #[test]
    fn lost_reply_of_a_winning_put_if_absent_still_wins() {
        let mem = Arc::new(MemoryBackend::new());
        let mut flaky = FlakyBackend::new(mem.clone(), 1000, 1);
        flaky.fail_after = true;
        let flaky = Arc::new(flaky);
        let r = RetryBackend::new(flaky.clone(), RetryPolicy { max_attempts: 3, ..fast() });
        // Every reply is lost; after the first attempt created the key, later attempts see it.
        // With all replies lost the decorator gives up, but the object is ours.
        assert!(r.put_if_absent("lease", b"holder-1").is_err());
        assert_eq!(mem.get("lease").unwrap(), b"holder-1");
        // Now one lost reply, then clean replies: the caller must learn it won.
        mem.delete("lease").unwrap();
        let seq = Arc::new(FlakyBackend::new(mem.clone(), 0, 1));
        struct LoseFirst(Arc<FlakyBackend>, AtomicU64);
        impl std::fmt::Debug for LoseFirst {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("LoseFirst")
            }
        }
        impl Backend for LoseFirst {
            fn name(&self) -> String {
                "lose-first".into()
            }
            fn get(&self, key: &str) -> BResult<Vec<u8>> {
                self.0.get(key)
            }
            fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
                self.0.put(key, data)
            }
            fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
                let r = self.0.put_if_absent(key, data);
                if self.1.fetch_add(1, Ordering::Relaxed) == 0 {
                    return Err(BackendError::new(ErrorKind::Unavailable, "put_if_absent", key));
                }
                r
            }
            fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
                self.0.list(prefix)
            }
            fn delete(&self, key: &str) -> BResult<()> {
                self.0.delete(key)
            }
            fn sync(&self) -> BResult<()> {
                Ok(())
            }
        }
        let r = RetryBackend::new(Arc::new(LoseFirst(seq, AtomicU64::new(0))), fast());
        assert!(
            r.put_if_absent("lease", b"holder-2").unwrap(),
            "our own lost write must count as a win"
        );
        assert_eq!(r.counters().ambiguous_resolved, 1);
        // Someone else's object is not ours.
        assert!(!r.put_if_absent("lease", b"holder-3").unwrap());
    }

    /// A streamed read that breaks after part of the range resumes where it broke: the sink
    /// sees every byte exactly once, in order.
    #[test]
    fn a_broken_streamed_read_resumes_after_the_bytes_given() {
        #[derive(Debug)]
        struct Breaks(Arc<MemoryBackend>, AtomicU64);
        impl Backend for Breaks {
            fn name(&self) -> String {
                "breaks".into()
            }
            fn get(&self, key: &str) -> BResult<Vec<u8>> {
                self.0.get(key)
            }
            // Gives 1000 bytes in pieces of 300, then fails, on every call but the third.
            fn get_range_to(
                &self,
                key: &str,
                offset: u64,
                len: u64,
                sink: &mut dyn FnMut(&[u8]),
            ) -> BResult<()> {
                let all = self.0.get_range(key, offset, len)?;
                let call = self.1.fetch_add(1, Ordering::Relaxed);
                let upto = if call == 2 { all.len() } else { all.len().min(1000) };
                for p in all[..upto].chunks(300) {
                    sink(p);
                }
                if upto < all.len() {
                    return Err(BackendError::new(ErrorKind::Unavailable, "get_range", key));
                }
                Ok(())
            }
            fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
                self.0.put(key, data)
            }
            fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
                self.0.put_if_absent(key, data)
            }
            fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
                self.0.list(prefix)
            }
            fn delete(&self, key: &str) -> BResult<()> {
                self.0.delete(key)
            }
            fn sync(&self) -> BResult<()> {
                Ok(())
            }
        }
        let mem = Arc::new(MemoryBackend::new());
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        mem.put("k", &data).unwrap();
        let inner = Arc::new(Breaks(mem, AtomicU64::new(0)));
        let r = RetryBackend::new(inner.clone(), fast());
        let mut got = Vec::new();
        r.get_range_to("k", 100, 4000, &mut |p| got.extend_from_slice(p)).unwrap();
        assert_eq!(got, &data[100..4100]);
        assert_eq!(inner.1.load(Ordering::Relaxed), 3, "two broken reads, then the rest");
        assert_eq!(r.counters().retries, 2);
    }
}

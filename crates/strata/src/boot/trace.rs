//! Block traces of a guest's boot: a recording wrapper around any NBD export set, and the
//! trace's text form (CSV) that benchmarks keep next to their results.
//!
//! `TracingExports` wraps an `ExportSet` (strata's `DiskExports`, or anything else) and hands
//! out exports that forward every call and, for the export names it was told to watch, log
//! one record per request: when it started (microseconds since the recorder was made), how
//! long it took, the operation, offset, length and how many requests of the watched exports
//! were in flight when it arrived. It is a decorator rather than a hook in the NBD server so
//! the server's read path stays untouched, and so the same recording works for any export.
//! Recording costs one mutex push per request; it can be switched off (`stop`) when the guest
//! reports ready, so the trace holds the boot and nothing after it.
//!
//! CSV form, one request per line after the header `t_us,dur_us,op,offset,len,inflight`,
//! `op` one of `read write flush trim zero`; ordered by start time. Parsing is strict and
//! capped (`MAX_RECORDS`), with line numbers in errors.

use crate::nbd::{BlockSize, Export, ExportError, ExportInfo, ExportSet, Extent, OpenError};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Most records a trace file may hold (a desktop boot is a few thousand requests).
pub(crate) const MAX_RECORDS: usize = 4 << 20;
/// Header line of the CSV form.
pub(crate) const CSV_HEADER: &str = "t_us,dur_us,op,offset,len,inflight";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::Zero => "zero",
        }
    }

    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "read" => Op::Read,
            "write" => Op::Write,
            "flush" => Op::Flush,
            "trim" => Op::Trim,
            "zero" => Op::Zero,
            _ => return None,
        })
    }
}

/// One request of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Record {
    /// Start, in microseconds since recording began.
    pub t_us: u64,
    /// Time the export took to answer, in microseconds.
    pub dur_us: u64,
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    /// Requests of the watched exports in flight when this one arrived (itself included).
    pub inflight: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("Trace line {line} is malformed ({reason}): expected `{CSV_HEADER}`")]
    Parse { line: usize, reason: String },
    #[error("Trace has more than {MAX_RECORDS} records: record a shorter boot")]
    TooLong,
}

/// A recorded block trace, ordered by start time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub records: Vec<Record>,
}

/// Totals of a trace, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    pub requests: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    /// Most requests in flight at once.
    pub max_inflight: u32,
    /// From the first request's start to the last one's end.
    pub span_us: u64,
}

impl Trace {
    /// The reads, as (offset, length), in start order.
    pub fn reads(&self) -> Vec<(u64, u64)> {
        self.records.iter().filter(|r| r.op == Op::Read).map(|r| (r.offset, r.len)).collect()
    }

    pub fn summary(&self) -> Summary {
        let mut s = Summary { requests: self.records.len() as u64, ..Summary::default() };
        let t0 = self.records.first().map(|r| r.t_us).unwrap_or(0);
        for r in &self.records {
            match r.op {
                Op::Read => {
                    s.reads += 1;
                    s.read_bytes += r.len;
                }
                Op::Write | Op::Zero => {
                    s.writes += 1;
                    s.write_bytes += r.len;
                }
                Op::Flush => s.flushes += 1,
                Op::Trim => {}
            }
            s.max_inflight = s.max_inflight.max(r.inflight);
            s.span_us = s.span_us.max((r.t_us + r.dur_us).saturating_sub(t0));
        }
        s
    }

    pub fn to_csv(&self) -> String {
        let mut out = String::with_capacity(32 * self.records.len() + 64);
        out.push_str(CSV_HEADER);
        out.push('\n');
        for r in &self.records {
            out.push_str(&format!(
                "{},{},{},{},{},{}\n",
                r.t_us,
                r.dur_us,
                r.op.as_str(),
                r.offset,
                r.len,
                r.inflight
            ));
        }
        out
    }

    /// Parse the CSV form (the header line is required).
    pub fn parse_csv(text: &str) -> Result<Trace, TraceError> {
        let mut lines = text.lines().enumerate();
        match lines.next() {
            Some((_, h)) if h.trim() == CSV_HEADER => {}
            _ => return Err(TraceError::Parse { line: 1, reason: "missing header".into() }),
        }
        let mut records = Vec::new();
        for (i, line) in lines {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if records.len() >= MAX_RECORDS {
                return Err(TraceError::TooLong);
            }
            let bad = |reason: &str| TraceError::Parse { line: i + 1, reason: reason.into() };
            let f: Vec<&str> = line.split(',').collect();
            if f.len() != 6 {
                return Err(bad("not 6 fields"));
            }
            let num = |s: &str| s.parse::<u64>().map_err(|_| bad("not a number"));
            let r = Record {
                t_us: num(f[0])?,
                dur_us: num(f[1])?,
                op: Op::parse(f[2]).ok_or_else(|| bad("unknown op"))?,
                offset: num(f[3])?,
                len: num(f[4])?,
                inflight: f[5].parse::<u32>().map_err(|_| bad("not a number"))?,
            };
            if r.offset.checked_add(r.len).is_none() {
                return Err(bad("offset + len overflows"));
            }
            records.push(r);
        }
        records.sort_by_key(|r| r.t_us);
        Ok(Trace { records })
    }
}

/// Collects records from traced exports.
pub struct Recorder {
    start: Instant,
    watch: Vec<String>,
    on: AtomicBool,
    inflight: AtomicU32,
    records: Mutex<Vec<Record>>,
}

impl Recorder {
    /// Record requests to the named exports (empty: every export).
    pub fn new(watch: &[&str]) -> Arc<Recorder> {
        Arc::new(Recorder {
            start: Instant::now(),
            watch: watch.iter().map(|s| s.to_string()).collect(),
            on: AtomicBool::new(true),
            inflight: AtomicU32::new(0),
            records: Mutex::new(Vec::new()),
        })
    }

    fn watches(&self, name: &str) -> bool {
        self.watch.is_empty() || self.watch.iter().any(|w| w == name)
    }

    /// Stop recording (requests still pass through).
    pub fn stop(&self) {
        self.on.store(false, Ordering::SeqCst);
    }

    pub fn is_recording(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// Records so far, ordered by start time.
    pub fn trace(&self) -> Trace {
        let mut records = self.records.lock().clone();
        records.sort_by_key(|r| r.t_us);
        Trace { records }
    }

    fn time<T>(&self, op: Op, offset: u64, len: u64, f: impl FnOnce() -> T) -> T {
        if !self.on.load(Ordering::Relaxed) {
            return f();
        }
        let inflight = self.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        let t = Instant::now();
        let out = f();
        let dur_us = t.elapsed().as_micros() as u64;
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        let t_us = t.duration_since(self.start).as_micros() as u64;
        let mut recs = self.records.lock();
        if self.on.load(Ordering::Relaxed) && recs.len() < MAX_RECORDS {
            recs.push(Record { t_us, dur_us, op, offset, len, inflight });
        }
        out
    }
}

/// An export set whose watched exports are recorded.
pub struct TracingExports {
    inner: Arc<dyn ExportSet>,
    rec: Arc<Recorder>,
}

impl TracingExports {
    pub fn new(inner: Arc<dyn ExportSet>, rec: Arc<Recorder>) -> Arc<TracingExports> {
        Arc::new(TracingExports { inner, rec })
    }
}

impl ExportSet for TracingExports {
    fn list(&self) -> Vec<ExportInfo> {
        self.inner.list()
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, OpenError> {
        let e = self.inner.open(name)?;
        if self.rec.watches(name) {
            Ok(Arc::new(TracedExport { inner: e, rec: self.rec.clone() }))
        } else {
            Ok(e)
        }
    }
}

struct TracedExport {
    inner: Arc<dyn Export>,
    rec: Arc<Recorder>,
}

impl Export for TracedExport {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        let len = buf.len() as u64;
        self.rec.time(Op::Read, offset, len, || self.inner.read(offset, buf))
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.rec.time(Op::Write, offset, data.len() as u64, || self.inner.write(offset, data, fua))
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.rec.time(Op::Flush, 0, 0, || self.inner.flush())
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn description(&self) -> Option<String> {
        self.inner.description()
    }
    fn can_trim(&self) -> bool {
        self.inner.can_trim()
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.rec.time(Op::Trim, offset, len, || self.inner.trim(offset, len, fua))
    }
    fn can_zero(&self) -> bool {
        self.inner.can_zero()
    }
    fn can_fast_zero(&self) -> bool {
        self.inner.can_fast_zero()
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> Result<(), ExportError> {
        self.rec.time(Op::Zero, offset, len, || self.inner.write_zeroes(offset, len, may_trim, fua))
    }
    fn can_multi_conn(&self) -> bool {
        self.inner.can_multi_conn()
    }
    fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, ExportError> {
        self.inner.block_status(offset, len)
    }
    fn block_size(&self) -> BlockSize {
        self.inner.block_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trips_and_rejects_garbage() {
        let t = Trace {
            records: vec![
                Record { t_us: 5, dur_us: 100, op: Op::Read, offset: 0, len: 4096, inflight: 1 },
                Record {
                    t_us: 9,
                    dur_us: 3,
                    op: Op::Write,
                    offset: 1 << 30,
                    len: 512,
                    inflight: 2,
                },
                Record { t_us: 20, dur_us: 7, op: Op::Flush, offset: 0, len: 0, inflight: 1 },
            ],
        };
        let csv = t.to_csv();
        assert!(
            csv.starts_with("t_us,dur_us,op,offset,len,inflight\n5,100,read,0,4096,1\n"),
            "{csv}"
        );
        assert_eq!(Trace::parse_csv(&csv).unwrap(), t);
        let s = t.summary();
        assert_eq!(
            (s.reads, s.read_bytes, s.writes, s.flushes, s.max_inflight, s.span_us),
            (1, 4096, 1, 1, 2, 100)
        );
        assert_eq!(t.reads(), vec![(0, 4096)]);
        for bad in [
            "",
            "x\n",
            "t_us,dur_us,op,offset,len,inflight\n1,2,read,3\n",
            "t_us,dur_us,op,offset,len,inflight\n1,2,seek,3,4,1\n",
            "t_us,dur_us,op,offset,len,inflight\n1,2,read,18446744073709551615,4,1\n",
        ] {
            assert!(Trace::parse_csv(bad).is_err(), "{bad:?}");
        }
        let e =
            Trace::parse_csv("t_us,dur_us,op,offset,len,inflight\n1,2,read,-3,4,1\n").unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }
}

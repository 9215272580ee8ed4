//! Early reads: pack ranges read before the stream needs them, and before the plan exists.
//!
//! A restore cannot plan its reads until it has the page maps and has located every page in
//! the index: 10–30 ms at 128 MiB, longer for larger guests or on a host without the maps, in
//! which the link would carry nothing. Two kinds of read start sooner:
//! * **Speculative** ([`speculate`]): the manifest's `read_hint` lists the pack ranges the
//!   save wrote its pages to, in order. Their first MiB are read from the moment the restore
//!   starts, alongside the maps.
//! * **Planned** ([`prefetch`]): once the plan exists, its next reads start at once, while the
//!   packs are checked and QEMU connects.
//!
//! A planned read that lies wholly inside an early read takes its bytes from it:
//! [`cover_jobs`] cuts the plan's reads, frame by frame, at the early reads' edges. A frame
//! that straddles an edge stays with the part outside, which is read as usual. Bytes from an
//! early read are checked like any others (frame CRC, then every page against its id). An
//! early read that fails or comes back short (a pack GC moved, a stale hint) is read again
//! by the fetcher, which then reports any error. A hint costs at most [`SPECULATE_MAX`] of
//! bandwidth, never correctness.

use super::*;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// Least the speculative reads cover: about what the link carries while a 128 MiB
/// checkpoint's plan is made (~25 ms at 1 Gbit/s).
pub(super) const SPECULATE_MIN: u64 = 3 << 20;
/// Most they cover: a 2 GiB guest locates ~500,000 pages before its plan exists.
pub(super) const SPECULATE_MAX: u64 = 32 << 20;
/// The hinted bytes divided by this is what is read speculatively (within the bounds above):
/// planning time grows with the number of pages, and so does the idle link.
pub(super) const SPECULATE_SHARE: u64 = 32;

/// One early read, shared by the jobs whose bytes it holds.
pub(super) struct Early {
    pub(super) pack: PackId,
    pub(super) start: u64,
    pub(super) end: u64,
    state: Mutex<State>,
    cv: Condvar,
    /// Jobs that will take bytes from it; the last one frees them.
    users: AtomicUsize,
}

enum State {
    Pending,
    Ready(Arc<Vec<u8>>),
    /// The read failed, came back short, or every user took its bytes.
    Gone,
}

impl Early {
    /// Start reading `start..end` of `pack` on a thread of its own.
    pub(super) fn start(store: &Store, pack: PackId, start: u64, end: u64) -> Arc<Early> {
        let e = Arc::new(Early {
            pack,
            start,
            end,
            state: Mutex::new(State::Pending),
            cv: Condvar::new(),
            users: AtomicUsize::new(0),
        });
        let (store, e2) = (store.clone(), e.clone());
        let spawned = std::thread::Builder::new().name("strata-early".into()).spawn(move || {
            let len = e2.end - e2.start;
            let got = store.backend().get_range(&e2.pack.pack_key(), e2.start, len);
            e2.finish(match got {
                Ok(b) if b.len() as u64 == len => State::Ready(Arc::new(b)),
                _ => State::Gone,
            });
        });
        if spawned.is_err() {
            e.finish(State::Gone);
        }
        e
    }

    /// An early read that has already ended (`None`: it failed).
    #[cfg(test)]
    pub(super) fn settled(pack: PackId, start: u64, end: u64, bytes: Option<Vec<u8>>) -> Arc<Early> {
        Arc::new(Early {
            pack,
            start,
            end,
            state: Mutex::new(bytes.map_or(State::Gone, |b| State::Ready(Arc::new(b)))),
            cv: Condvar::new(),
            users: AtomicUsize::new(0),
        })
    }

    fn finish(&self, s: State) {
        *self.state.lock() = s;
        self.cv.notify_all();
    }

    /// A job will take its bytes from this read.
    pub(super) fn add_user(&self) {
        self.users.fetch_add(1, Ordering::Relaxed);
    }

    /// Wait for the bytes (`None`: the read failed; read them again). Each user calls this
    /// once; the last one leaves the read holding nothing.
    pub(super) fn take(&self) -> Option<Arc<Vec<u8>>> {
        let mut s = self.state.lock();
        while matches!(*s, State::Pending) {
            self.cv.wait(&mut s);
        }
        let got = match &*s {
            State::Ready(b) => Some(b.clone()),
            _ => None,
        };
        if self.users.fetch_sub(1, Ordering::Relaxed) <= 1 {
            *s = State::Gone;
        }
        got
    }

    /// Does this read hold all of frame `off..off + len` of `pack`?
    pub(super) fn holds(&self, pack: PackId, off: u64, len: u64) -> bool {
        self.pack == pack && self.start <= off && off + len <= self.end
    }
}

/// Start the speculative reads of a checkpoint's `read_hint`: its first ranges, cut into
/// reads of the plan's read size, up to the hinted bytes / [`SPECULATE_SHARE`] (within
/// [`SPECULATE_MIN`]..[`SPECULATE_MAX`]). Nothing without a hint.
pub(super) fn speculate(store: &Store, hint: &[PackRange], read_bytes: u64) -> Vec<Arc<Early>> {
    let ranges: Vec<(PackId, u64, u64)> = hint
        .iter()
        .filter_map(|r| Some((PackId::from_hex(&r.pack)?, r.start, r.end)))
        .filter(|(_, s, e)| s < e)
        .collect();
    let total: u64 = ranges.iter().map(|(_, s, e)| e - s).sum();
    if total == 0 {
        return Vec::new();
    }
    let budget = (total / SPECULATE_SHARE).clamp(SPECULATE_MIN, SPECULATE_MAX);
    let piece = read_size(total, read_bytes);
    let mut out = Vec::new();
    let mut left = budget;
    'ranges: for (pack, mut s, e) in ranges {
        while s < e {
            if left == 0 {
                break 'ranges;
            }
            let n = piece.min(e - s).min(left);
            out.push(Early::start(store, pack, s, s + n));
            left -= n;
            s += n;
        }
    }
    out
}

/// Cut the plan's reads (in pack and offset order) at the edges of the early reads: a part
/// lying wholly inside early read k gets `early = Some(k)` and takes its bytes from it. A
/// frame straddling an edge stays with the part outside. A part left over outside is joined
/// to the uncovered read beside it when they are close (same pack, gap within [`READ_GAP`],
/// together within 1.25 read sizes), as [`fold_small_tails`] does; reads no early read
/// touches stay as planned.
pub(super) fn cover_jobs(jobs: Vec<Job>, early: &[Arc<Early>], read_bytes: u64) -> Vec<Job> {
    if early.is_empty() {
        return jobs;
    }
    // (part, left over from a split read)
    let mut out: Vec<(Job, bool)> = Vec::with_capacity(jobs.len() + 2 * early.len());
    let push = |out: &mut Vec<(Job, bool)>, j: Job, leftover: bool| {
        if let Some((prev, prev_left)) = out.last_mut() {
            if (leftover || *prev_left)
                && j.early.is_none()
                && prev.early.is_none()
                && prev.pack == j.pack
                && j.start >= prev.end
                && j.start - prev.end <= READ_GAP
                && j.end - prev.start <= read_bytes + read_bytes / 4
            {
                prev.end = j.end;
                prev.frames.extend(j.frames);
                *prev_left = false;
                return;
            }
        }
        out.push((j, leftover));
    };
    for job in jobs {
        let pack = job.pack;
        if !early.iter().any(|e| e.pack == pack && e.start < job.end && job.start < e.end) {
            push(&mut out, job, false);
            continue;
        }
        let mut parts: Vec<Job> = Vec::new();
        for f in job.frames {
            let k = early.iter().position(|e| e.holds(pack, f.off, f.len as u64)).map(|k| k as u32);
            let end = f.off + f.len as u64;
            match parts.last_mut() {
                Some(j) if j.early == k => {
                    j.end = end;
                    j.frames.push(f);
                }
                _ => parts.push(Job {
                    pack,
                    start: f.off,
                    end,
                    frames: vec![f],
                    early: k,
                }),
            }
        }
        let split = parts.len() > 1;
        for p in parts {
            push(&mut out, p, split);
        }
    }
    let out: Vec<Job> = out.into_iter().map(|(j, _)| j).collect();
    for j in &out {
        if let Some(k) = j.early {
            early[k as usize].add_user();
        }
    }
    out
}

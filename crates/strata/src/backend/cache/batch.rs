//! Batched reads through the cache (`Backend::get_ranges`).
//!
//! A disk read that spans several frames of one pack asks for all of them at once. Each range
//! is handled as `get_range` handles one: a hit is answered from the SSD or the staging map;
//! a miss is led by this reader (or followed, if another reader already leads it, so N clones
//! still cause one backend read per frame). What differs is that every range this reader leads
//! goes to the backend in a single `get_ranges` call, which the S3 backend turns into a few
//! merged, concurrent GETs, and each range is then staged for filling as its own entry, so
//! entries stay whole frames whatever the batching.

use super::{
    bump, BResult, Backend, BackendError, CacheBackend, Flight, Leader, Outcome, RangeKey, Slice,
};
use std::sync::Arc;

impl CacheBackend {
    pub(super) fn read_batch(&self, key: &str, ranges: &[(u64, u64)]) -> BResult<Vec<Vec<u8>>> {
        let sh = &*self.sh;
        if !(sh.opts.cacheable)(key)
            || ranges.iter().any(|&(_, l)| !self.entry_fits(l))
            || ranges.len() <= 1
        {
            return ranges.iter().map(|&(o, l)| self.get_range(key, o, l)).collect();
        }
        let k: Arc<str> = Arc::from(key);
        let mut out: Vec<Option<Vec<u8>>> = vec![None; ranges.len()];
        let mut leaders: Vec<(usize, Leader<'_>)> = Vec::new();
        let mut followers: Vec<(usize, Arc<Flight>)> = Vec::new();
        for (i, &(off, len)) in ranges.iter().enumerate() {
            let rk: RangeKey = (k.clone(), off, len);
            if let Some(v) = sh.hit(&rk) {
                out[i] = Some(v);
                continue;
            }
            let (flight, lead) = {
                let mut fl = sh.flights.lock();
                match fl.get(&rk) {
                    Some(f) => (f.clone(), false),
                    None => {
                        let f = Arc::new(Flight::default());
                        fl.insert(rk.clone(), f.clone());
                        (f, true)
                    }
                }
            };
            if !lead {
                followers.push((i, flight));
                continue;
            }
            let mut leader = Leader { sh, rk: rk.clone(), flight, result: None };
            // The range may have been filled between our lookup and taking the lead.
            if let Some(v) = sh.hit(&rk) {
                leader.result = Some(Outcome::Retry);
                out[i] = Some(v);
                continue;
            }
            leaders.push((i, leader));
        }
        if !leaders.is_empty() {
            let want: Vec<(u64, u64)> = leaders.iter().map(|(i, _)| ranges[*i]).collect();
            match sh.inner.get_ranges(key, &want) {
                Ok(got) => {
                    for ((i, mut leader), v) in leaders.into_iter().zip(got) {
                        let len = v.len();
                        bump(&sh.stats.misses, 1);
                        bump(&sh.stats.miss_bytes, len as u64);
                        let buf = Arc::new(v);
                        // Stage before the flight ends, so no reader misses both.
                        self.stage(leader.rk.clone(), Slice { buf: buf.clone(), off: 0, len });
                        leader.result = Some(Outcome::Data(buf.clone()));
                        drop(leader);
                        out[i] = Some(Arc::try_unwrap(buf).unwrap_or_else(|b| (*b).clone()));
                    }
                }
                Err(e) => {
                    for (_, leader) in leaders.iter_mut() {
                        leader.result = Some(Outcome::Failed(e.kind, e.to_string()));
                    }
                    drop(leaders);
                    return Err(e);
                }
            }
        }
        for (i, flight) in followers {
            let (off, len) = ranges[i];
            out[i] = Some(match self.follow(key, &flight) {
                Some(r) => r?,
                None => self.get_range(key, off, len)?,
            });
        }
        Ok(out.into_iter().map(|v| v.expect("every range answered")).collect())
    }

    /// Wait for the leader of a flight. None: it found the range filled, so look again.
    pub(super) fn follow(&self, key: &str, flight: &Flight) -> Option<BResult<Vec<u8>>> {
        let mut done = flight.done.lock();
        while done.is_none() {
            flight.cv.wait(&mut done);
        }
        match done.as_ref().expect("set") {
            Outcome::Data(v) => {
                bump(&self.sh.stats.coalesced, 1);
                Some(Ok((**v).clone()))
            }
            Outcome::Failed(kind, msg) => Some(Err(BackendError::with_source(
                *kind,
                "get_range",
                key,
                std::io::Error::other(msg.clone()),
            ))),
            Outcome::Retry => None,
        }
    }
}

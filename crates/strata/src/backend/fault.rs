//! Fault-injection decorator: power cuts at the N-th sync, failing fsyncs, and a full disk.
//!
//! The model follows the backend contract: operations since the last successful `sync` are
//! volatile. `FaultBackend` keeps two states, the *current* view (every operation applied, what
//! a running process sees) and the *durable* view (what survives a power cut). A successful
//! `sync` copies current to durable. At the configured power cut, the sync does not complete:
//! each pending operation independently survives or not (per [`CutMode`]), the result is frozen
//! in the durable view, and every later call fails with `Unavailable`. A test then opens a new
//! store over [`FaultBackend::durable`] and checks that nothing acknowledged was lost.

use super::memory::MemoryBackend;
use super::{BResult, Backend, BackendError, Capabilities, ErrorKind, ObjectInfo};
use parking_lot::Mutex;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};

/// What happens to unsynced operations at a power cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutMode {
    /// None of them reached the media.
    DropAll,
    /// All of them did (the sync's flush finished but its caller never learned).
    KeepAll,
    /// Each one did with probability 1/2, seeded.
    Random(u64),
}

#[derive(Clone, Debug)]
enum Op {
    Put(String, Vec<u8>),
    Delete(String),
}

#[derive(Debug)]
struct State {
    pending: Vec<Op>,
    crashed: bool,
    bytes_written: u64,
}

#[derive(Debug)]
pub struct FaultBackend {
    current: MemoryBackend,
    durable: MemoryBackend,
    state: Mutex<State>,
    syncs: AtomicU64,
    /// Power cut at this (1-based) sync call.
    pub cut_at_sync: Option<u64>,
    pub cut_mode: CutMode,
    /// This (1-based) sync call fails with EIO but the process lives on.
    pub fail_sync_at: Option<u64>,
    /// Puts fail with NoSpace once this many bytes have been written in total.
    pub space_limit: Option<u64>,
}

impl FaultBackend {
    /// A fault backend starting from the durable contents of `base` (copied).
    pub fn new(base: &MemoryBackend) -> FaultBackend {
        let current = MemoryBackend::new();
        let durable = MemoryBackend::new();
        for k in base.keys() {
            let v = base.get(&k).expect("listed key");
            current.put(&k, &v).expect("memory put");
            durable.put(&k, &v).expect("memory put");
        }
        FaultBackend {
            current,
            durable,
            state: Mutex::new(State { pending: Vec::new(), crashed: false, bytes_written: 0 }),
            syncs: AtomicU64::new(0),
            cut_at_sync: None,
            cut_mode: CutMode::DropAll,
            fail_sync_at: None,
            space_limit: None,
        }
    }

    /// What survived: open a new store over this after a cut.
    pub fn durable(&self) -> MemoryBackend {
        self.durable.clone()
    }

    /// Number of sync calls so far (including the one that was cut).
    pub fn sync_count(&self) -> u64 {
        self.syncs.load(Ordering::SeqCst)
    }

    pub fn crashed(&self) -> bool {
        self.state.lock().crashed
    }

    fn check_alive(&self, op: &'static str, key: &str) -> BResult<()> {
        if self.state.lock().crashed {
            Err(BackendError::new(ErrorKind::Unavailable, op, key))
        } else {
            Ok(())
        }
    }

    /// Cut the power now (for harnesses that count sync points across several devices).
    pub fn power_cut(&self) {
        let n = self.syncs.load(Ordering::SeqCst);
        let mut st = self.state.lock();
        if !st.crashed {
            self.cut_locked(&mut st, n);
        }
    }

    fn cut_locked(&self, st: &mut State, n: u64) {
        let pending = std::mem::take(&mut st.pending);
        match self.cut_mode {
            CutMode::DropAll => {}
            CutMode::KeepAll => pending.iter().for_each(|op| Self::apply(&self.durable, op)),
            CutMode::Random(seed) => {
                let mut rng = StdRng::seed_from_u64(seed ^ n);
                for op in &pending {
                    if rng.gen_bool(0.5) {
                        Self::apply(&self.durable, op);
                    }
                }
            }
        }
        st.crashed = true;
    }

    fn apply(target: &MemoryBackend, op: &Op) {
        match op {
            Op::Put(k, v) => target.put(k, v).expect("memory put"),
            Op::Delete(k) => target.delete(k).expect("memory delete"),
        }
    }
}

impl Backend for FaultBackend {
    fn name(&self) -> String {
        "fault(memory)".into()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { persistent: true, ..self.current.capabilities() }
    }

    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        self.check_alive("get", key)?;
        self.current.get(key)
    }

    fn get_range(&self, key: &str, offset: u64, len: u64) -> BResult<Vec<u8>> {
        self.check_alive("get_range", key)?;
        self.current.get_range(key, offset, len)
    }

    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        let mut st = self.state.lock();
        if st.crashed {
            return Err(BackendError::new(ErrorKind::Unavailable, "put", key));
        }
        if let Some(limit) = self.space_limit {
            if st.bytes_written + data.len() as u64 > limit {
                return Err(BackendError::new(ErrorKind::NoSpace, "put", key));
            }
        }
        self.current.put(key, data)?;
        st.bytes_written += data.len() as u64;
        st.pending.push(Op::Put(key.to_string(), data.to_vec()));
        Ok(())
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        let mut st = self.state.lock();
        if st.crashed {
            return Err(BackendError::new(ErrorKind::Unavailable, "put_if_absent", key));
        }
        if !self.current.put_if_absent(key, data)? {
            return Ok(false);
        }
        st.bytes_written += data.len() as u64;
        st.pending.push(Op::Put(key.to_string(), data.to_vec()));
        Ok(true)
    }

    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        self.check_alive("list", prefix)?;
        self.current.list(prefix)
    }

    fn delete(&self, key: &str) -> BResult<()> {
        let mut st = self.state.lock();
        if st.crashed {
            return Err(BackendError::new(ErrorKind::Unavailable, "delete", key));
        }
        self.current.delete(key)?;
        st.pending.push(Op::Delete(key.to_string()));
        Ok(())
    }

    fn sync(&self) -> BResult<()> {
        let n = self.syncs.fetch_add(1, Ordering::SeqCst) + 1;
        let mut st = self.state.lock();
        if st.crashed {
            return Err(BackendError::new(ErrorKind::Unavailable, "sync", ""));
        }
        if self.cut_at_sync == Some(n) {
            self.cut_locked(&mut st, n);
            return Err(BackendError::new(ErrorKind::Unavailable, "sync", "(power cut)"));
        }
        if self.fail_sync_at == Some(n) {
            // Like Linux after a writeback error: the data may or may not be on the media,
            // and the error is reported once. We keep the ops pending (not durable).
            return Err(BackendError::with_source(
                ErrorKind::Other,
                "sync",
                "",
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        for op in std::mem::take(&mut st.pending) {
            Self::apply(&self.durable, &op);
        }
        Ok(())
    }

    fn head(&self, key: &str) -> BResult<Option<u64>> {
        self.check_alive("head", key)?;
        self.current.head(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_writes_vanish_at_a_cut() {
        let mut fb = FaultBackend::new(&MemoryBackend::new());
        fb.cut_at_sync = Some(2);
        fb.put("a", b"1").unwrap();
        fb.sync().unwrap();
        fb.put("b", b"2").unwrap();
        fb.delete("a").unwrap();
        assert!(fb.sync().is_err());
        assert!(fb.crashed());
        assert_eq!(fb.get("a").unwrap_err().kind, ErrorKind::Unavailable);
        let d = fb.durable();
        assert_eq!(d.get("a").unwrap(), b"1");
        assert!(d.get("b").is_err());
    }

    #[test]
    fn keep_all_and_space_limit() {
        let mut fb = FaultBackend::new(&MemoryBackend::new());
        fb.cut_at_sync = Some(1);
        fb.cut_mode = CutMode::KeepAll;
        fb.space_limit = Some(10);
        fb.put("a", b"12345").unwrap();
        assert_eq!(fb.put("b", b"123456").unwrap_err().kind, ErrorKind::NoSpace);
        let _ = fb.sync();
        assert_eq!(fb.durable().get("a").unwrap(), b"12345");
    }
}

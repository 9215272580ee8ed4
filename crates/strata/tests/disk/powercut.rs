//! Crash harness for disks served over NBD: cut power at every sync point of an NBD workload.
//!
//! Sync points are counted across both devices a disk uses: the host-local write log (each
//! guest FLUSH is one fdatasync there) and the store backend (compactions commit chunks, map
//! and ref through it). A `FaultBackend` models the backend; each log file's durable image is
//! a shadow copy taken at each successful fdatasync (and at its creation), so at a cut a log
//! loses everything written since its last sync, and a log a compaction deleted may come back
//! (the unlink was not synced). Compactions run in the background, as in `strata serve`: the
//! log rolls over to a new file and the frozen one is folded while the workload goes on (the
//! fold is held back a little at its start so that writes and flushes overlap it). For every
//! sync point N the workload runs until the N-th sync, which fails; the host then "reboots"
//! with the durable images, reopens the store and the disk, and the test asserts:
//! - every byte equals the last acknowledged-flush value, or a value written after it;
//! - `check` finds no damage, and nothing needed repair (opening is the whole recovery).

use crate::common;

use common::*;
use parking_lot::Mutex;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use strata::backend::fault::{CutMode, FaultBackend};
use strata::backend::memory::MemoryBackend;
use strata::backend::{BResult, Backend, BackendError, ErrorKind, ObjectInfo};
use strata::disk::volume::SyncEvent;
use strata::nbd::proto::Command as NbdCmd;
use strata::store::{InitOptions, Store};

const SIZE: u64 = 4 << 20;

/// Shared power: counts sync points across the backend and the log.
struct Power {
    n: AtomicU64,
    cut_at: u64,
    fault: Arc<FaultBackend>,
    /// Durable image of each log file (None = the file's creation was not durable).
    shadows: Mutex<HashMap<PathBuf, Vec<u8>>>,
}

impl Power {
    /// A sync point: Ok if it completes, Err if the power goes now (or went before).
    fn point(&self) -> bool {
        let n = self.n.fetch_add(1, Ordering::SeqCst) + 1;
        if n >= self.cut_at {
            self.fault.power_cut();
            return false;
        }
        true
    }
    fn dead(&self) -> bool {
        self.n.load(Ordering::SeqCst) >= self.cut_at
    }
}

/// The backend as seen by the store: every sync is a shared sync point.
struct CountedBackend {
    inner: Arc<FaultBackend>,
    power: Arc<Power>,
}
impl std::fmt::Debug for CountedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("counted")
    }
}
impl Backend for CountedBackend {
    fn name(&self) -> String {
        "counted(fault)".into()
    }
    fn get(&self, key: &str) -> BResult<Vec<u8>> {
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, o: u64, l: u64) -> BResult<Vec<u8>> {
        self.inner.get_range(key, o, l)
    }
    fn put(&self, key: &str, data: &[u8]) -> BResult<()> {
        self.inner.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> BResult<bool> {
        self.inner.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> BResult<Vec<ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> BResult<()> {
        self.inner.delete(key)
    }
    fn sync(&self) -> BResult<()> {
        if !self.power.point() {
            return Err(BackendError::new(ErrorKind::Unavailable, "sync", "(power cut)"));
        }
        self.inner.sync()
    }
    fn head(&self, key: &str) -> BResult<Option<u64>> {
        self.inner.head(key)
    }
}

fn fresh(dir: &Path) -> MemoryBackend {
    let base = MemoryBackend::new();
    let s = Store::init(
        Arc::new(base.clone()),
        &dir.join("meta").join("meta.redb"),
        InitOptions { pack_size: 64 << 10, ..Default::default() },
    )
    .unwrap();
    strata::disk::create(&s, "d", SIZE).unwrap();
    s.close().unwrap();
    base
}

/// What the disk may hold: the last flushed image, plus bytes written since.
struct Model {
    flushed: Vec<u8>,
    since: HashMap<usize, Vec<u8>>,
}

impl Model {
    fn write(&mut self, off: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            self.since.entry(off as usize + i).or_default().push(*b);
        }
    }
    fn flushed(&mut self) {
        for (i, v) in self.since.drain() {
            self.flushed[i] = *v.last().unwrap();
        }
    }
    fn check(&self, got: &[u8], ctx: &str) {
        for (i, b) in got.iter().enumerate() {
            if *b != self.flushed[i] && !self.since.get(&i).is_some_and(|v| v.contains(b)) {
                panic!(
                    "{ctx}: byte {i} is {b:#x}; last flushed value {:#x}, written since: {:?}",
                    self.flushed[i],
                    self.since.get(&i)
                );
            }
        }
    }
}

/// Steps of the workload in the run that counts sync points.
const STEPS: u64 = 160;

/// Runs the workload for `steps` steps or until the power goes; returns the model of what may
/// be on disk. Background compactions make the number of sync points vary a little from run
/// to run, so a run with a cut goes on past `STEPS` until the cut happens.
fn workload(
    sock: &Path,
    exports: &strata::serve::DiskExports,
    power: &Power,
    seed: u64,
    steps: u64,
) -> Model {
    let mut c = Client::connect(sock, "d", true, false).unwrap();
    let v = exports.volume("d").expect("volume open");
    v.set_compact_at(256 << 10);
    let mut model = Model { flushed: vec![0; SIZE as usize], since: HashMap::new() };
    let mut rng = StdRng::seed_from_u64(seed);
    for step in 0..steps {
        if power.dead() {
            break;
        }
        let len = rng.gen_range(1..=16) * 4096u64;
        let off = rng.gen_range(0..(SIZE - len) / 4096) * 4096;
        let r = match rng.gen_range(0..10) {
            0..=5 => {
                let data = pattern(seed * 10_000 + step, len as usize);
                model.write(off, &data);
                c.write(off, &data, 0)
            }
            6 => {
                model.write(off, &vec![0; len as usize]);
                c.simple(NbdCmd::WriteZeroes, 0, off, len as u32)
            }
            7 => {
                let r = c.simple(NbdCmd::Flush, 0, 0, 0);
                if r.is_ok() {
                    model.flushed();
                }
                r
            }
            8 => {
                // Waits for a background fold, then folds the rest of the log.
                let r = v.compact().map(|_| ()).map_err(|_| 5u32);
                if r.is_ok() {
                    // A compaction commits everything appended so far.
                    model.flushed();
                }
                r
            }
            _ => c.read(off, len as u32).map(|_| ()),
        };
        if r.is_err() {
            break;
        }
    }
    // Let a background fold finish (or fail) before the host goes down.
    v.wait_compaction();
    model
}

#[test]
fn power_cut_at_every_sync_point_of_an_nbd_workload() {
    // Count sync points of a clean run.
    let total = {
        let tmp = tempfile::tempdir().unwrap();
        let base = fresh(tmp.path());
        let fault = Arc::new(FaultBackend::new(&base));
        let power = Arc::new(Power {
            n: AtomicU64::new(0),
            cut_at: u64::MAX,
            fault: fault.clone(),
            shadows: Mutex::new(HashMap::new()),
        });
        let (sock, exports, _h, _s) = serve(tmp.path(), fault, power.clone());
        let _ = workload(&sock, &exports, &power, 1, STEPS);
        power.n.load(Ordering::SeqCst)
    };
    assert!(total >= 40, "workload too small: {total} sync points");
    eprintln!("NBD workload: {total} sync points");
    for n in 1..=total {
        run_cut(n, total);
    }
}

#[allow(clippy::type_complexity)]
fn serve(
    dir: &Path,
    fault: Arc<FaultBackend>,
    power: Arc<Power>,
) -> (PathBuf, Arc<strata::serve::DiskExports>, strata::nbd::ServerHandle, Store) {
    let store = Store::open(
        Arc::new(CountedBackend { inner: fault, power: power.clone() }),
        &dir.join("meta").join("meta.redb"),
    )
    .unwrap();
    let exports = strata::serve::DiskExports::new(store.clone());
    let sock = dir.join("nbd.sock");
    let _ = std::fs::remove_file(&sock);
    let h = strata::nbd::Server::bind_unix(&sock).unwrap().serve(exports.clone()).unwrap();
    // Open the volume now and install the log hook.
    use strata::nbd::ExportSet;
    exports.open("d").unwrap();
    let v = exports.volume("d").unwrap();
    let logs = dir.join("meta").join("disks");
    for d in std::fs::read_dir(&logs).unwrap().flatten() {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            if f.file_name().to_string_lossy().starts_with("log.") {
                power.shadows.lock().insert(f.path(), std::fs::read(f.path()).unwrap());
            }
        }
    }
    let p = power.clone();
    v.set_sync_hook(Arc::new(move |ev: &SyncEvent| match ev {
        SyncEvent::LogSync(path) => {
            if !p.point() {
                return Err(std::io::Error::other("power cut"));
            }
            // The sync completes: the durable image is the file as it is now.
            p.shadows.lock().insert(path.clone(), std::fs::read(path).unwrap_or_default());
            Ok(())
        }
        SyncEvent::LogCreated(path) => {
            if !p.dead() {
                p.shadows.lock().insert(path.clone(), std::fs::read(path).unwrap_or_default());
            }
            Ok(())
        }
        SyncEvent::FoldStart(_) => {
            // Hold the fold back so the next requests (writes, flushes that must also sync the
            // frozen log) run while it is pending.
            std::thread::sleep(std::time::Duration::from_millis(15));
            Ok(())
        }
    }));
    (sock, exports, h, store)
}

fn run_cut(n: u64, total: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let base = fresh(tmp.path());
    let mut f = FaultBackend::new(&base);
    f.cut_mode = match n % 3 {
        0 => CutMode::DropAll,
        1 => CutMode::KeepAll,
        _ => CutMode::Random(n),
    };
    let fault = Arc::new(f);
    let power = Arc::new(Power {
        n: AtomicU64::new(0),
        cut_at: n,
        fault: fault.clone(),
        shadows: Mutex::new(HashMap::new()),
    });
    let model = {
        let (sock, exports, h, store) = serve(tmp.path(), fault.clone(), power.clone());
        let m = workload(&sock, &exports, &power, 1, 3 * STEPS);
        h.shutdown();
        drop(exports);
        drop(store);
        m
    };
    assert!(power.dead(), "cut {n}/{total} never happened");
    // Reboot: logs revert to their durable images; an unlinked log may come back.
    let logs = tmp.path().join("meta").join("disks");
    let mut present = std::collections::HashSet::new();
    for d in std::fs::read_dir(&logs).unwrap().flatten() {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            if f.file_name().to_string_lossy().starts_with("log.") {
                present.insert(f.path());
                std::fs::remove_file(f.path()).unwrap();
            }
        }
    }
    // Every log still there at the cut was created durably, so it comes back (as of its last
    // sync). Logs a compaction unlinked (without a directory sync) may or may not come back.
    // A log created after the power went has no durable image and is gone.
    let mut rng = StdRng::seed_from_u64(n);
    let shadows = power.shadows.lock();
    for (path, bytes) in shadows.iter() {
        if present.contains(path) || rng.gen_bool(0.7) {
            std::fs::write(path, bytes).unwrap();
        }
    }
    drop(shadows);
    let store = Store::open(Arc::new(fault.durable()), &tmp.path().join("meta").join("meta.redb"))
        .unwrap_or_else(|e| panic!("cut {n}: store does not reopen: {e}"));
    let v = strata::disk::volume::Volume::open(&store, "d")
        .unwrap_or_else(|e| panic!("cut {n}: disk does not reopen: {e}"));
    let mut got = vec![0u8; SIZE as usize];
    v.read(0, &mut got).unwrap();
    model.check(&got, &format!("cut at sync point {n} of {total}"));
    drop(v);
    let rep = store.check(Default::default(), &strata::progress::NoProgress).unwrap();
    assert!(!rep.is_damaged(), "cut {n}: {:?}", rep.problems);
}

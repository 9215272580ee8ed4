//! Leases: one writer per name across hosts, and a GC that knows when it is alone.
//!
//! Several hosts may open one backend (a shared bucket). Two rules keep them from destroying
//! each other's work, and both rest on one primitive the backend already guarantees:
//! `put_if_absent` is atomic across writers.
//!
//! - **Writer leases.** Whoever writes a ref (a disk, a checkpoint) first holds the lease on its
//!   name. A lease is a sequence of generation objects `leases/ref/<name>/<gen:020>`; the newest
//!   generation is the lease. To take it, a host reads the newest one; if that is live (not
//!   released, not expired, holder not known dead) it is refused with the holder's name, else
//!   it creates generation `newest + 1` with `put_if_absent`, so of two racing takers exactly one
//!   wins. The holder renews by rewriting its own generation object every TTL/3 (only the holder
//!   ever writes an existing generation, so renewals never race with takers) and then checks no
//!   newer generation exists; if one does, the lease was lost and every later commit under it is
//!   refused. A clean release rewrites the object marked `released`, so the next taker needs no
//!   wait; a dead holder's lease expires after the TTL (30 s, `STRATA_LEASE_TTL_MS`).
//! - **Presence and GC.** Every open store instance announces itself under
//!   `leases/open/<instance>/`, renewed like a lease. GC takes the `leases/gc/` lease and then
//!   refuses if any other instance is present, because another instance's in-memory index may
//!   dedup against chunks a sweep is about to delete; an instance refuses to open while another
//!   holds a live GC lease. Each side writes before it reads, so of two racing sides at least one
//!   sees the other.
//!
//! Time: records carry wall-clock expiry (ms since the epoch), compared by other hosts, so
//! hosts' clocks must agree to well within the TTL (NTP). The holder itself judges its lease by a
//! monotonic deadline that ends TTL/4 before the expiry it wrote, and stops committing once that
//! passes without a successful renewal (the backend was unreachable): it gives up before anyone
//! else may take over. A holder on this host whose process is gone is dead at once (`kill(pid,
//! 0)`), so a `kill -9`ed `strata serve` does not block its restart for a TTL.
//!
//! Lease objects are written with `put_volatile`: they need no fsync, since losing one in a
//! power cut is the same as it expiring. The byte layout is in `docs/format-store.md`.

use super::format::{cap, crc, zero, FResult, FormatError, Rd, Wr};
use crate::backend::{BackendError, DynBackend};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::{mpsc, Arc, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub(crate) const LEASE_MAGIC: &[u8; 8] = b"STRALEAS";
pub(crate) const LEASE_VERSION: u16 = 1;
pub(crate) const MAX_LEASE_JSON: u64 = 4096;
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("'{name}' is being written by {holder} (lease expires in {expires_in_s} s unless renewed); stop that writer or wait")]
    Held { name: String, holder: String, expires_in_s: u64 },
    #[error("Lost the lease on '{name}' to {holder}; this writer stopped committing, reopen to continue")]
    Lost { name: String, holder: String },
    #[error("The lease on '{name}' lapsed: the backend could not be reached to renew it within {ttl_ms} ms; reopen once it is back")]
    Lapsed { name: String, ttl_ms: u64 },
    #[error("GC needs the store to itself, but {holder} has it open; stop it (or run gc there) and retry")]
    StoreInUse { holder: String },
    #[error("GC is running on {holder}; retry when it has finished (its lease expires in {expires_in_s} s unless renewed)")]
    GcRunning { holder: String, expires_in_s: u64 },
    #[error("'{name}' is already held by this store instance")]
    AlreadyHeld { name: String },
    /// The backend error names the operation and the lease key.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

pub type Result<T> = std::result::Result<T, LeaseError>;

/// One generation of a lease, as persisted.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaseRecord {
    /// What is leased: `ref:<name>`, `gc` or `open`.
    pub name: String,
    pub generation: u64,
    pub host: String,
    pub pid: u32,
    /// Random id of the store instance (several may live in one process).
    pub instance: String,
    /// The holding command, for messages (`strata serve`).
    pub purpose: String,
    pub acquired_unix_ms: u64,
    pub expires_unix_ms: u64,
    pub released: bool,
}

impl LeaseRecord {
    /// magic(8) | version u16 | flags u16 (0) | json_len u32 | json | crc32c u32 (of all before).
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("lease serializes");
        let mut out = Vec::with_capacity(20 + json.len());
        out.extend_from_slice(LEASE_MAGIC);
        out.u16le(LEASE_VERSION);
        out.u16le(0);
        out.u32le(json.len() as u32);
        out.extend_from_slice(&json);
        let c = crc(&out);
        out.u32le(c);
        out
    }

    pub fn decode(b: &[u8]) -> FResult<LeaseRecord> {
        let what = "lease";
        let mut rd = Rd::new(b, what);
        let version = rd.magic_version(LEASE_MAGIC)?;
        if version > LEASE_VERSION {
            return Err(FormatError::TooNew { what, found: version, supported: LEASE_VERSION });
        }
        zero(what, "flags", rd.u16()? as u64)?;
        let len = rd.u32()? as u64;
        cap(what, "json_len", len, MAX_LEASE_JSON)?;
        let json = rd.bytes(len as usize)?;
        let body_end = rd.pos();
        let stored = rd.u32()?;
        if crc(&b[..body_end]) != stored {
            return Err(FormatError::Checksum { what });
        }
        if rd.pos() != b.len() {
            return Err(FormatError::Malformed { what, detail: "trailing bytes".into() });
        }
        serde_json::from_slice(json)
            .map_err(|e| FormatError::Malformed { what, detail: e.to_string() })
    }

    /// `host pid N (purpose)`, for messages.
    pub fn holder(&self) -> String {
        format!("host {} pid {} ({})", self.host, self.pid, self.purpose)
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Instances alive in this process, so a lease left by a dropped-without-release instance of
/// this very process (a test's simulated crash) is known dead.
fn live_instances() -> &'static Mutex<HashSet<String>> {
    static S: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// The host name leases record; `STRATA_HOSTNAME` overrides it (tests simulate a second host).
pub fn host_name() -> String {
    if let Ok(h) = std::env::var("STRATA_HOSTNAME") {
        if !h.is_empty() {
            return h;
        }
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into a valid buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Who we are, as written into records.
#[derive(Clone, Debug)]
struct Me {
    host: String,
    pid: u32,
    instance: String,
    purpose: String,
}

impl Me {
    /// Is `r` a lease someone else holds right now?
    fn live_other(&self, r: &LeaseRecord, now: u64) -> bool {
        if r.released || r.expires_unix_ms <= now || r.instance == self.instance {
            return false;
        }
        if r.host == self.host {
            if r.pid == self.pid {
                return live_instances().lock().contains(&r.instance);
            }
            return pid_alive(r.pid);
        }
        true
    }
}

/// A lease this instance holds.
#[derive(Debug)]
struct Held {
    dir: String,
    name: String,
    generation: u64,
    acquired_unix_ms: u64,
    /// Monotonic end of our own belief in the lease.
    valid_until: Instant,
    lost: Option<String>,
}

/// The leases of one store instance, with the thread that renews them.
#[derive(Debug)]
pub(crate) struct Leases {
    backend: DynBackend,
    me: Me,
    ttl: Mutex<Duration>,
    held: Mutex<HashMap<String, Held>>,
    /// Dropping the sender stops the keeper thread.
    stop: Mutex<Option<mpsc::Sender<()>>>,
}

fn gen_key(dir: &str, g: u64) -> String {
    format!("{dir}{g:020}")
}

fn ref_dir(name: &str) -> String {
    format!("leases/ref/{name}/")
}
const GC_DIR: &str = "leases/gc/";
const OPEN_DIR: &str = "leases/open/";

impl Leases {
    pub(crate) fn new(backend: DynBackend) -> Arc<Leases> {
        let instance = hex::encode(rand::random::<[u8; 8]>());
        live_instances().lock().insert(instance.clone());
        let purpose = {
            let args: Vec<String> = std::env::args().take(3).collect();
            let mut p = args.join(" ");
            p.truncate(120);
            p
        };
        let ttl = std::env::var("STRATA_LEASE_TTL_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&ms| ms >= 200)
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_TTL);
        Arc::new(Leases {
            backend,
            me: Me { host: host_name(), pid: std::process::id(), instance, purpose },
            ttl: Mutex::new(ttl),
            held: Mutex::new(HashMap::new()),
            stop: Mutex::new(None),
        })
    }

    pub(crate) fn set_ttl(&self, ttl: Duration) {
        *self.ttl.lock() = ttl.max(Duration::from_millis(200));
    }

    fn ttl(&self) -> Duration {
        *self.ttl.lock()
    }

    fn record(&self, name: &str, generation: u64, acquired: u64, released: bool) -> LeaseRecord {
        let now = now_ms();
        LeaseRecord {
            name: name.to_string(),
            generation,
            host: self.me.host.clone(),
            pid: self.me.pid,
            instance: self.me.instance.clone(),
            purpose: self.me.purpose.clone(),
            acquired_unix_ms: acquired,
            expires_unix_ms: if released { now } else { now + self.ttl().as_millis() as u64 },
            released,
        }
    }

    fn be<T>(
        &self,
        _op: &'static str,
        _name: &str,
        r: std::result::Result<T, BackendError>,
    ) -> Result<T> {
        r.map_err(LeaseError::Backend)
    }

    /// Generations under `dir`, ascending.
    fn generations(&self, dir: &str, name: &str) -> Result<Vec<u64>> {
        let objs = self.be("list", name, self.backend.list(dir))?;
        let mut g: Vec<u64> = objs
            .iter()
            .filter_map(|o| o.key.strip_prefix(dir))
            .filter(|rest| rest.len() == 20 && rest.bytes().all(|c| c.is_ascii_digit()))
            .filter_map(|rest| rest.parse().ok())
            .collect();
        g.sort_unstable();
        Ok(g)
    }

    /// The newest generation under `dir` and its record (None: never leased, or unreadable).
    fn newest(&self, dir: &str, name: &str) -> Result<(u64, Option<LeaseRecord>)> {
        for _ in 0..5 {
            let gens = self.generations(dir, name)?;
            let Some(&g) = gens.last() else { return Ok((0, None)) };
            match self.backend.get(&gen_key(dir, g)) {
                Ok(b) => match LeaseRecord::decode(&b) {
                    Ok(r) => return Ok((g, Some(r))),
                    Err(e) => {
                        tracing::warn!(target: "strata::lease", key = gen_key(dir, g), error = %e, "unreadable lease treated as expired");
                        return Ok((g, None));
                    }
                },
                // Cleaned up between list and get: a newer one exists; look again.
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(LeaseError::Backend(e)),
            }
        }
        Ok((0, None))
    }

    fn acquire_dir(self: &Arc<Self>, dir: &str, name: &str) -> Result<()> {
        if self.held.lock().contains_key(dir) {
            return Err(LeaseError::AlreadyHeld { name: name.into() });
        }
        for _ in 0..8 {
            let (g, rec) = self.newest(dir, name)?;
            let now = now_ms();
            if let Some(r) = &rec {
                if self.me.live_other(r, now) {
                    return Err(LeaseError::Held {
                        name: name.into(),
                        holder: r.holder(),
                        expires_in_s: (r.expires_unix_ms - now).div_ceil(1000),
                    });
                }
            }
            let next = g + 1;
            let start = Instant::now();
            let rec = self.record(name, next, now, false);
            if self.be(
                "put_if_absent",
                name,
                self.backend.put_if_absent(&gen_key(dir, next), &rec.encode()),
            )? {
                self.held.lock().insert(
                    dir.to_string(),
                    Held {
                        dir: dir.to_string(),
                        name: name.to_string(),
                        generation: next,
                        acquired_unix_ms: now,
                        valid_until: start + self.ttl() * 3 / 4,
                        lost: None,
                    },
                );
                // Older generations are history; removing them keeps listings short.
                for old in self
                    .generations(dir, name)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|&o| o < next)
                {
                    let _ = self.backend.delete(&gen_key(dir, old));
                }
                self.start_keeper();
                tracing::debug!(target: "strata::lease", name, generation = next, "lease taken");
                return Ok(());
            }
        }
        Err(LeaseError::Held {
            name: name.into(),
            holder: "another writer racing for it".into(),
            expires_in_s: 0,
        })
    }

    fn release_dir(&self, dir: &str) {
        let Some(h) = self.held.lock().remove(dir) else { return };
        if h.lost.is_some() {
            return;
        }
        let rec = self.record(&h.name, h.generation, h.acquired_unix_ms, true);
        if let Err(e) = self.backend.put_volatile(&gen_key(dir, h.generation), &rec.encode()) {
            tracing::warn!(target: "strata::lease", name = h.name, error = %e, "lease release failed; it will expire");
        }
    }

    /// Take the writer lease on ref `name`.
    pub(crate) fn acquire_ref(self: &Arc<Self>, name: &str) -> Result<LeaseGuard> {
        let dir = ref_dir(name);
        self.acquire_dir(&dir, name)?;
        Ok(LeaseGuard { leases: Arc::downgrade(self), dir })
    }

    pub(crate) fn holds_ref(&self, name: &str) -> bool {
        self.held.lock().contains_key(&ref_dir(name))
    }

    /// May we commit under the lease on ref `name` right now?
    pub(crate) fn check_ref(&self, name: &str) -> Result<()> {
        self.check_dir(&ref_dir(name), name)
    }

    fn check_dir(&self, dir: &str, name: &str) -> Result<()> {
        let held = self.held.lock();
        let Some(h) = held.get(dir) else { return Ok(()) };
        if let Some(holder) = &h.lost {
            return Err(LeaseError::Lost { name: name.into(), holder: holder.clone() });
        }
        if Instant::now() > h.valid_until {
            return Err(LeaseError::Lapsed {
                name: name.into(),
                ttl_ms: self.ttl().as_millis() as u64,
            });
        }
        Ok(())
    }

    /// Announce this instance; refuse if another holds a live GC lease.
    pub(crate) fn announce(self: &Arc<Self>) -> Result<()> {
        let dir = format!("{OPEN_DIR}{}/", self.me.instance);
        self.acquire_dir(&dir, "open")?;
        let (_, rec) = self.newest(GC_DIR, "gc")?;
        let now = now_ms();
        if let Some(r) = rec.filter(|r| self.me.live_other(r, now)) {
            self.release_dir(&dir);
            return Err(LeaseError::GcRunning {
                holder: r.holder(),
                expires_in_s: (r.expires_unix_ms - now).div_ceil(1000),
            });
        }
        Ok(())
    }

    /// Is our presence still unbroken (renewed in time ever since `announce`)?
    pub(crate) fn check_presence(&self) -> Result<()> {
        self.check_dir(&format!("{OPEN_DIR}{}/", self.me.instance), "open")
    }

    /// Take the GC lease, and refuse unless no other instance is present.
    pub(crate) fn acquire_gc(self: &Arc<Self>) -> Result<LeaseGuard> {
        self.acquire_dir(GC_DIR, "gc")?;
        let guard = LeaseGuard { leases: Arc::downgrade(self), dir: GC_DIR.to_string() };
        let objs = self.be("list", "open", self.backend.list(OPEN_DIR))?;
        let mut seen = HashSet::new();
        for o in objs {
            let Some(rest) = o.key.strip_prefix(OPEN_DIR) else { continue };
            let Some((inst, _)) = rest.split_once('/') else { continue };
            if inst == self.me.instance || !seen.insert(inst.to_string()) {
                continue;
            }
            let dir = format!("{OPEN_DIR}{inst}/");
            let (_, rec) = self.newest(&dir, "open")?;
            let now = now_ms();
            match rec {
                Some(r) if self.me.live_other(&r, now) => {
                    return Err(LeaseError::StoreInUse { holder: r.holder() })
                }
                // A dead instance's presence: tidy it away.
                Some(r) if r.expires_unix_ms <= now || r.released || r.host == self.me.host => {
                    for g in self.generations(&dir, "open").unwrap_or_default() {
                        let _ = self.backend.delete(&gen_key(&dir, g));
                    }
                }
                _ => {}
            }
        }
        Ok(guard)
    }

    fn start_keeper(self: &Arc<Self>) {
        let mut stop = self.stop.lock();
        if stop.is_some() {
            return;
        }
        let (tx, rx) = mpsc::channel::<()>();
        *stop = Some(tx);
        let weak = Arc::downgrade(self);
        let _ = std::thread::Builder::new().name("strata-lease".into()).spawn(move || loop {
            let period = match weak.upgrade() {
                Some(l) => l.ttl() / 3,
                None => return,
            };
            match rx.recv_timeout(period) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            match weak.upgrade() {
                Some(l) => l.renew_all(),
                None => return,
            }
        });
    }

    /// Rewrite every held generation with a new expiry, then look for newer generations.
    fn renew_all(&self) {
        let dirs: Vec<(String, String, u64, u64)> = self
            .held
            .lock()
            .values()
            .filter(|h| h.lost.is_none())
            .map(|h| (h.dir.clone(), h.name.clone(), h.generation, h.acquired_unix_ms))
            .collect();
        for (dir, name, g, acquired) in dirs {
            let start = Instant::now();
            let rec = self.record(&name, g, acquired, false);
            let put = self.backend.put_volatile(&gen_key(&dir, g), &rec.encode());
            let lost = match (&put, self.generations(&dir, &name)) {
                (Ok(()), Ok(gens)) => match gens.last() {
                    Some(&newest) if newest > g => Some(
                        self.newest(&dir, &name)
                            .ok()
                            .and_then(|(_, r)| r)
                            .map(|r| r.holder())
                            .unwrap_or_else(|| "another host".into()),
                    ),
                    _ => None,
                },
                _ => {
                    tracing::warn!(target: "strata::lease", name, "lease renewal failed; will retry");
                    continue;
                }
            };
            let mut held = self.held.lock();
            if let Some(h) = held.get_mut(&dir).filter(|h| h.generation == g) {
                match lost {
                    Some(holder) => {
                        tracing::error!(target: "strata::lease", name, %holder, "lease lost");
                        h.lost = Some(holder);
                    }
                    // Only extend a lease still valid: once lapsed it stays lapsed.
                    None if Instant::now() <= h.valid_until => {
                        h.valid_until = start + self.ttl() * 3 / 4
                    }
                    None => {}
                }
            }
        }
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        self.stop.lock().take();
        let dirs: Vec<String> = self.held.lock().keys().cloned().collect();
        for d in dirs {
            self.release_dir(&d);
        }
        live_instances().lock().remove(&self.me.instance);
    }
}

/// A held lease; dropping it releases the lease.
#[derive(Debug)]
pub struct LeaseGuard {
    leases: Weak<Leases>,
    dir: String,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(l) = self.leases.upgrade() {
            l.release_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endian;

    fn rec() -> LeaseRecord {
        LeaseRecord {
            name: "ref:disk/a".into(),
            generation: 7,
            host: "h".into(),
            pid: 42,
            instance: "00112233".into(),
            purpose: "strata serve".into(),
            acquired_unix_ms: 1,
            expires_unix_ms: 2,
            released: false,
        }
    }

    #[test]
    fn layout_is_pinned() {
        let b = rec().encode();
        assert_eq!(&b[0..8], b"STRALEAS");
        assert_eq!(endian::le16(&b, 8), 1);
        assert_eq!(endian::le16(&b, 10), 0);
        let len = endian::le32(&b, 12) as usize;
        assert_eq!(b.len(), 16 + len + 4);
        assert_eq!(b[16], b'{');
        assert_eq!(endian::le32(&b, 16 + len), crc(&b[..16 + len]));
        assert_eq!(LeaseRecord::decode(&b).unwrap(), rec());
    }

    fn mem() -> DynBackend {
        Arc::new(crate::backend::memory::MemoryBackend::new())
    }

    #[test]
    fn of_racing_takers_exactly_one_wins_and_release_hands_over() {
        let b = mem();
        let ls: Vec<Arc<Leases>> = (0..8).map(|_| Leases::new(b.clone())).collect();
        let wins: Vec<Option<LeaseGuard>> = std::thread::scope(|s| {
            let hs: Vec<_> =
                ls.iter().map(|l| s.spawn(move || l.acquire_ref("disk/x").ok())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(wins.iter().filter(|w| w.is_some()).count(), 1);
        let winner = wins.iter().position(|w| w.is_some()).unwrap();
        let other = (winner + 1) % 8;
        let e = ls[other].acquire_ref("disk/x").unwrap_err();
        assert!(
            matches!(e, LeaseError::Held { .. }) && e.to_string().contains("being written by"),
            "{e}"
        );
        assert!(ls[winner].check_ref("disk/x").is_ok());
        drop(wins);
        // Released cleanly: the next taker needs no wait, and gets a newer generation.
        let _g = ls[other].acquire_ref("disk/x").unwrap();
        let gens = ls[other].generations(&ref_dir("disk/x"), "x").unwrap();
        assert_eq!(gens, vec![2], "older generations are tidied away");
        // Other names are independent.
        ls[winner].acquire_ref("disk/y").unwrap();
    }

    #[test]
    fn a_foreign_holder_blocks_until_expiry_and_a_newer_generation_means_lost() {
        let b = mem();
        let mut r = rec();
        r.host = "elsewhere".into();
        r.generation = 1;
        r.expires_unix_ms = now_ms() + 400;
        b.put(&gen_key(&ref_dir("vm/a"), 1), &r.encode()).unwrap();
        let l = Leases::new(b.clone());
        let e = l.acquire_ref("vm/a").unwrap_err();
        assert!(e.to_string().contains("host elsewhere pid 42 (strata serve)"), "{e}");
        std::thread::sleep(Duration::from_millis(500));
        let _g = l.acquire_ref("vm/a").unwrap();
        // Someone takes generation 3 behind our back (we were presumed dead): the next
        // renewal notices and commits are refused from then on.
        let mut t = rec();
        t.host = "thief".into();
        t.generation = 3;
        t.expires_unix_ms = now_ms() + 60_000;
        b.put(&gen_key(&ref_dir("vm/a"), 3), &t.encode()).unwrap();
        assert!(l.check_ref("vm/a").is_ok());
        l.renew_all();
        let e = l.check_ref("vm/a").unwrap_err();
        assert!(matches!(e, LeaseError::Lost { .. }) && e.to_string().contains("thief"), "{e}");
    }

    #[test]
    fn a_lease_that_cannot_be_renewed_lapses() {
        let b = mem();
        let l = Leases::new(b.clone());
        l.set_ttl(Duration::from_millis(400));
        let _g = l.acquire_ref("disk/z").unwrap();
        assert!(l.check_ref("disk/z").is_ok());
        // No renewal reaches the backend (simulated by not running the keeper long enough to
        // matter: stop it), so our own deadline passes.
        l.stop.lock().take();
        std::thread::sleep(Duration::from_millis(350));
        let e = l.check_ref("disk/z").unwrap_err();
        assert!(matches!(e, LeaseError::Lapsed { .. }), "{e}");
    }

    #[test]
    fn gc_needs_the_store_to_itself() {
        let b = mem();
        let a = Leases::new(b.clone());
        a.announce().unwrap();
        let other = Leases::new(b.clone());
        other.announce().unwrap();
        let e = a.acquire_gc().unwrap_err();
        assert!(matches!(e, LeaseError::StoreInUse { .. }), "{e}");
        drop(other);
        let g = a.acquire_gc().unwrap();
        // While GC runs, nobody else opens.
        let late = Leases::new(b.clone());
        let e = late.announce().unwrap_err();
        assert!(matches!(e, LeaseError::GcRunning { .. }), "{e}");
        drop(g);
        late.announce().unwrap();
        // A dropped-without-release instance of this process is dead, not present.
        let ghost = Leases::new(b.clone());
        ghost.announce().unwrap();
        ghost.stop.lock().take();
        live_instances().lock().remove(&ghost.me.instance);
        std::mem::forget(ghost);
        drop(late);
        a.acquire_gc().unwrap();
    }

    #[test]
    fn damage_is_refused() {
        let b = rec().encode();
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x40;
            assert!(LeaseRecord::decode(&c).is_err(), "flip at {i} accepted");
        }
        for n in 0..b.len() {
            assert!(LeaseRecord::decode(&b[..n]).is_err());
        }
        let mut big = b[..12].to_vec();
        big.extend_from_slice(&(MAX_LEASE_JSON as u32 + 1).to_le_bytes());
        assert!(matches!(LeaseRecord::decode(&big), Err(FormatError::Cap { .. })));
    }
}

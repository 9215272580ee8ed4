//! Durability of the objects a strata save puts on the storage host, emulated as a durable
//! S3 server would provide it (`strata-bench save-restore --remote`). versitygw writes through the
//! page cache and never syncs; a durable server writes an object to disk as it arrives and
//! syncs it before acknowledging it. [`ObjectSync`] gives the save's objects that treatment,
//! the same the stream baselines get from their [`Relay`](crate::remote::Relay) (which
//! starts writeback every [`RELAY_WRITEBACK_BYTES`] it receives and fsyncs its one file at the
//! end):
//!
//! - **As objects arrive** ([`Inflight`], its own thread): versitygw receives each object into
//!   an unnamed file (`O_TMPFILE` under the bucket's `.sgwtmp`, linked into place once whole),
//!   which inotify cannot see. Every [`POLL_MS`] the thread lists the server's open
//!   descriptors (`/proc/PID/fd`), keeps a descriptor of its own for each such file (opened
//!   through `/proc`), and once the server has received [`RELAY_WRITEBACK_BYTES`] more across
//!   them, starts the writeback of what each grew by (`SYNC_FILE_RANGE_WRITE`: queue, do not
//!   wait), as the relay does for its stream. Without it nothing is written back until an
//!   object lands: the fsync of a big last pack then writes it whole (5.8 ms for 8.6 MB) and
//!   holds the ref's PUT behind ext4's journal (5.9 ms instead of ~1.1).
//! - **As objects land** (the watcher thread): inotify reports each file linked, renamed or
//!   closed after writing anywhere under the save's prefix (new directories are watched, then
//!   scanned, as they appear) and [`SYNCERS`] threads fsync it while the save goes on (several,
//!   not one after another: a save's last packs and its ref land within milliseconds, and a
//!   server syncs each in its own request). Events, not a rescan of the tree every few
//!   milliseconds (~2% of a 128 MiB save's CPU at 5 ms).
//! - **At the end**, on the save's clock: [`ObjectSync::stop`] wakes the watcher (an eventfd
//!   beside inotify) and waits until it has synced what had landed, and
//!   [`StorageHost::fsync_tree`](crate::remote::StorageHost::fsync_tree) fsyncs every
//!   file the watcher did not sync or that changed since ([`Synced`]), so nothing the
//!   watcher missed is lost (not every file again: ~2 ms of fsyncs of clean files on the clock,
//!   which a server that synced each object would not spend). It syncs the directories too
//!   only where a file's fsync does not make its name durable (not on ext4; the relay then
//!   syncs its directory too), so both sides get the same treatment (directory syncs on ext4
//!   would cost strata ~4 ms of commit-to-durable by median).
//!   The watcher's own teardown (closing inotify waits for an RCU grace period, up to ~14 ms
//!   here) happens after it has answered, off the clock.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use crate::remote::{start_writeback, RELAY_WRITEBACK_BYTES};

/// Watches the objects a save writes under one prefix, and syncs them (see the module comment).
pub struct ObjectSync {
    stop: Arc<AtomicBool>,
    /// An eventfd the watcher polls beside inotify, so [`stop`](Self::stop) wakes it at once.
    wake: Arc<std::os::fd::OwnedFd>,
    /// The watcher's answer to `stop`: the objects it fsynced.
    done: mpsc::Receiver<SyncedFiles>,
}

impl ObjectSync {
    /// Start watching `dir`; `server_pid` is versitygw's (no writeback of arriving objects
    /// without it).
    pub fn start(dir: PathBuf, server_pid: Option<u32>) -> ObjectSync {
        let stop = Arc::new(AtomicBool::new(false));
        // SAFETY: plain syscall; the fd is owned below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(efd >= 0, "eventfd: {}", std::io::Error::last_os_error());
        // SAFETY: `efd` is a fresh descriptor nobody else owns.
        let wake =
            Arc::new(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(efd) });
        let (tx, done) = mpsc::channel();
        let (flag, wake2) = (stop.clone(), wake.clone());
        std::thread::Builder::new()
            .name("bench-objsync".into())
            .spawn(move || watch(dir, flag, wake2, tx))
            .expect("spawn the object sync thread");
        if let Some(mut inflight) = server_pid.and_then(Inflight::new) {
            let flag = stop.clone();
            std::thread::Builder::new()
                .name("bench-objwb".into())
                .spawn(move || {
                    while !flag.load(Ordering::Relaxed) {
                        inflight.poll();
                        std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
                    }
                    tracing::debug!(target: "strata::bench", writeback_starts = inflight.kicks, "object writeback done");
                })
                .expect("spawn the object writeback thread");
        }
        ObjectSync { stop, wake, done }
    }

    fn signal(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our own eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Stop watching, once the watcher has synced everything that had landed; returns the
    /// objects it fsynced. The threads finish on their own.
    pub fn stop(self) -> SyncedFiles {
        self.signal();
        self.done.recv().unwrap_or_default()
    }
}

impl Drop for ObjectSync {
    fn drop(&mut self) {
        self.signal();
    }
}

/// What a file looked like when its fsync returned: one that still looks the same at the end
/// needs no second fsync ([`StorageHost::fsync_tree`](crate::remote::StorageHost::fsync_tree)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Synced {
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl Synced {
    pub fn of(m: &std::fs::Metadata) -> Synced {
        use std::os::unix::fs::MetadataExt;
        Synced {
            ino: m.ino(),
            len: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        }
    }
}

/// The files the watcher fsynced, as they were then.
pub type SyncedFiles = HashMap<PathBuf, Synced>;

/// Objects fsynced at once as they land: a durable server syncs each in its own request, so
/// the last few of a save (its last packs and the ref land within milliseconds) overlap, and
/// their journal commits can be shared.
const SYNCERS: usize = 4;

/// The watcher thread: fsync each file under `dir` once, when it lands (on [`SYNCERS`]
/// threads); answer on `done` once every fsync it started has returned.
fn watch(
    dir: PathBuf,
    flag: Arc<AtomicBool>,
    wake: Arc<std::os::fd::OwnedFd>,
    done: mpsc::Sender<SyncedFiles>,
) {
    let mut seen = SyncedFiles::new();
    let Ok(mut w) = Watcher::new() else {
        let _ = done.send(seen);
        return;
    };
    w.wake = Some(wake);
    let (job_tx, job_rx) = mpsc::channel::<PathBuf>();
    let job_rx = Arc::new(std::sync::Mutex::new(job_rx));
    let (res_tx, res_rx) = mpsc::channel::<(PathBuf, Option<Synced>)>();
    let syncers: Vec<_> = (0..SYNCERS)
        .map(|_| {
            let (rx, tx) = (job_rx.clone(), res_tx.clone());
            std::thread::spawn(move || loop {
                let job = rx.lock().unwrap().recv();
                let Ok(f) = job else { return };
                let t = Instant::now();
                let synced = File::open(&f).and_then(|h| {
                    h.sync_all()?;
                    h.metadata()
                });
                tracing::debug!(target: "strata::bench", file = %f.display(), ms = t.elapsed().as_secs_f64() * 1e3, "object fsynced as it landed");
                let _ = tx.send((f, synced.ok().map(|m| Synced::of(&m))));
            })
        })
        .collect();
    drop(res_tx);
    let mut asked: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
    let mut files = Vec::new();
    w.add_tree(&dir, &mut files);
    loop {
        let last = flag.load(Ordering::Relaxed);
        w.wait(if last { 0 } else { POLL_MS as i32 }, &mut files);
        for f in files.drain(..) {
            // A file is synced once, when first reported whole; fsync_tree at the end covers
            // anything written to it later.
            if asked.insert(f.clone()) {
                let _ = job_tx.send(f);
            }
        }
        while let Ok((f, s)) = res_rx.try_recv() {
            if let Some(s) = s {
                seen.insert(f, s);
            }
        }
        if last {
            drop(job_tx);
            for t in syncers {
                let _ = t.join();
            }
            while let Ok((f, s)) = res_rx.try_recv() {
                if let Some(s) = s {
                    seen.insert(f, s);
                }
            }
            let _ = done.send(seen);
            // Dropping the watcher (closing inotify) can take a while: off the caller's clock.
            return;
        }
    }
}

/// Least time between two polls. 4 MiB arrive in ~35 ms at 1 Gbit/s, so a poll every 5 ms
/// starts writeback within ~0.6 MB of where the relay would.
pub const POLL_MS: u128 = 5;

/// A server file being received.
struct Tracked {
    /// What the server's descriptor pointed at when it was opened here (a reused descriptor
    /// number names another file).
    target: PathBuf,
    file: File,
    /// Bytes whose writeback was started.
    started: u64,
}

/// The S3 server's files still being received, and their writeback (see the module comment).
pub struct Inflight {
    fd_dir: PathBuf,
    files: HashMap<OsString, Tracked>,
    last: Option<Instant>,
    /// Writeback starts issued (reported in debug logs).
    pub kicks: u64,
}

impl Inflight {
    /// For the server process `pid`; `None` if it has no `/proc` entry.
    pub fn new(pid: u32) -> Option<Inflight> {
        let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
        fd_dir.is_dir().then(|| Inflight { fd_dir, files: HashMap::new(), last: None, kicks: 0 })
    }

    /// Poll unless the last poll was less than [`POLL_MS`] ago.
    pub fn poll(&mut self) {
        if self.last.is_some_and(|t| t.elapsed().as_millis() < POLL_MS) {
            return;
        }
        self.last = Some(Instant::now());
        let Ok(rd) = std::fs::read_dir(&self.fd_dir) else {
            // The server is gone, and its files with it.
            self.files.clear();
            return;
        };
        let mut live: Vec<OsString> = Vec::new();
        for e in rd.flatten() {
            let Ok(target) = std::fs::read_link(e.path()) else { continue };
            if !is_upload(&target) {
                continue;
            }
            let name = e.file_name();
            let known = self.files.get(&name).is_some_and(|t| t.target == target);
            if !known {
                // Through /proc: the file has no name of its own until it lands.
                let Ok(file) = File::open(e.path()) else { continue };
                self.files.insert(name.clone(), Tracked { target, file, started: 0 });
            }
            live.push(name);
        }
        self.files.retain(|k, _| live.contains(k));
        // The rule is the relay's, for the server as a whole: once it has received
        // RELAY_WRITEBACK_BYTES more (across all its uploads), start the writeback of all of it.
        let mut grown: Vec<(&mut Tracked, u64)> = Vec::new();
        for t in self.files.values_mut() {
            let len = t.file.metadata().map(|m| m.len()).unwrap_or(0);
            if len > t.started {
                grown.push((t, len));
            }
        }
        if grown.iter().map(|(t, len)| len - t.started).sum::<u64>() >= RELAY_WRITEBACK_BYTES {
            for (t, len) in grown {
                start_writeback(&t.file, t.started, len - t.started);
                t.started = len;
            }
            self.kicks += 1;
        }
    }
}

/// Whether a server descriptor's target is an object being received: versitygw's unnamed
/// upload files read `<bucket>/.sgwtmp/#<inode> (deleted)`.
fn is_upload(target: &std::path::Path) -> bool {
    target.as_os_str().as_bytes().windows(9).any(|w| w == b"/.sgwtmp/")
}

/// An inotify instance and its watches (wd → directory).
struct Watcher {
    fd: std::os::fd::OwnedFd,
    dirs: std::collections::HashMap<i32, PathBuf>,
    /// Polled too: readable when the watcher is told to stop.
    wake: Option<Arc<std::os::fd::OwnedFd>>,
}

impl Watcher {
    const MASK: u32 = libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_CLOSE_WRITE;

    fn new() -> std::io::Result<Watcher> {
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Watcher { fd, dirs: Default::default(), wake: None })
    }

    /// Watch `dir`, then report what is already in it (files to sync; subdirectories are
    /// watched and scanned the same way), so nothing created before the watch is missed.
    fn add_tree(&mut self, dir: &Path, files: &mut Vec<PathBuf>) {
        let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str()))
        else {
            return;
        };
        // SAFETY: valid fd and NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), Self::MASK) };
        if wd < 0 {
            return;
        }
        self.dirs.insert(wd, dir.to_path_buf());
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => self.add_tree(&e.path(), files),
                Ok(t) if t.is_file() => files.push(e.path()),
                _ => {}
            }
        }
    }

    /// Wait up to `ms` for events; the files they name (new directories are added).
    fn wait(&mut self, ms: i32, files: &mut Vec<PathBuf>) {
        let wake = self.wake.as_ref().map_or(-1, |w| w.as_raw_fd());
        let mut pfd = [
            libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            // A negative fd is ignored by poll.
            libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds.
        if unsafe { libc::poll(pfd.as_mut_ptr(), 2, ms) } <= 0 || pfd[0].revents == 0 {
            return;
        }
        let mut buf = [0u8; 16 << 10];
        loop {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return;
            }
            let mut off = 0usize;
            let head = std::mem::size_of::<libc::inotify_event>();
            while off + head <= n as usize {
                // SAFETY: the kernel wrote whole events; read_unaligned copes with the offset.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name = &buf[off + head..(off + head + ev.len as usize).min(n as usize)];
                let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
                off += head + ev.len as usize;
                let Some(dir) = self.dirs.get(&ev.wd) else { continue };
                let path = dir.join(std::ffi::OsStr::new(std::str::from_utf8(name).unwrap_or("")));
                if ev.mask & libc::IN_ISDIR != 0 {
                    if ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                        self.add_tree(&path, files);
                    }
                } else if !name.is_empty() {
                    files.push(path);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_servers_upload_files_are_tracked() {
        assert!(is_upload(std::path::Path::new(
            "/var/tmp/x/storage/s3/strata/.sgwtmp/#876781 (deleted)"
        )));
        assert!(!is_upload(std::path::Path::new(
            "/var/tmp/x/storage/s3/strata/sr-128-0/packs/e6/e695"
        )));
        assert!(!is_upload(std::path::Path::new("socket:[1234]")));
        assert!(!is_upload(std::path::Path::new("/var/tmp/x/storage/versitygw.log")));
    }

    #[test]
    fn a_file_synced_and_unchanged_is_skipped_at_the_end() {
        let dir = std::env::temp_dir().join(format!("strata-objsync-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("packs")).unwrap();
        let (a, b) = (dir.join("packs/a"), dir.join("b"));
        std::fs::write(&a, b"pack").unwrap();
        std::fs::write(&b, b"ref").unwrap();
        let mut synced = SyncedFiles::new();
        synced.insert(a.clone(), Synced::of(&std::fs::metadata(&a).unwrap()));
        synced.insert(b.clone(), Synced::of(&std::fs::metadata(&b).unwrap()));
        assert_eq!(crate::remote::StorageHost::fsync_tree(&dir, &synced).unwrap(), (0, 2));
        // Written again after its sync: synced again.
        std::fs::write(&b, b"ref, generation 2").unwrap();
        assert_eq!(crate::remote::StorageHost::fsync_tree(&dir, &synced).unwrap(), (1, 1));
        // Never seen by the watcher: synced.
        std::fs::write(dir.join("packs/c"), b"late").unwrap();
        assert_eq!(crate::remote::StorageHost::fsync_tree(&dir, &synced).unwrap(), (2, 1));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writeback_starts_every_relay_step_of_growth() {
        // A child process stands in for the server: it holds a file under a `.sgwtmp`
        // directory open (as its stdin) while this test makes it grow by 5 MiB, then 1 MiB.
        let dir = std::env::temp_dir().join(format!("strata-inflight-{}", std::process::id()));
        let tmp = dir.join(".sgwtmp");
        std::fs::create_dir_all(&tmp).unwrap();
        let path = tmp.join("upload");
        let mut f = std::fs::File::create(&path).unwrap();
        let mut server = std::process::Command::new("sleep")
            .arg("30")
            .stdin(File::open(&path).unwrap())
            .spawn()
            .unwrap();
        let mut w = Inflight::new(server.id()).expect("the child's /proc entry");
        use std::io::Write;
        f.write_all(&vec![7u8; 5 << 20]).unwrap();
        w.poll();
        assert_eq!((w.files.len(), w.kicks), (1, 1), "5 MiB grown: one writeback start");
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        w.last = None;
        w.poll();
        assert_eq!(w.kicks, 1, "1 MiB more is below the step");
        f.write_all(&vec![7u8; 3 << 20]).unwrap();
        w.last = None;
        w.poll();
        assert_eq!(w.kicks, 2, "4 MiB since the last start: another");
        let _ = server.kill();
        let _ = server.wait();
        w.last = None;
        w.poll();
        assert!(w.files.is_empty(), "a file the server closed is forgotten");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

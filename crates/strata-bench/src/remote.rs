//! The storage host of the remote benchmarks: `io --remote`, `clone --remote`,
//! `save-restore --remote` and `live --redis` all run against a network namespace holding
//! versitygw (S3) and redis-server behind a veth pair shaped to 1 Gbit/s with `tbf`, built by
//! `scripts/storage-host.sh` (embedded in the binary, so the benchmark works from any
//! directory).
//!
//! [`StorageHost::up`] creates it and [`Drop`] removes it, also when the benchmark fails, so no
//! namespace, veth or server is left behind. Every benchmark reports the bytes that crossed the
//! link beside its times: [`StorageHost::link`] reads the host end's veth counters (`tx` =
//! host to storage, `rx` = storage to host; Ethernet frames, so TCP/IP headers included).
//!
//! `storm` uses the same driver under its own namespace and subnet ([`StorageHost::up_named`]).
//!
//! Baselines that need a file on the storage host (QEMU migration streams, raw images) use
//! [`Relay`]: a thread of this process that enters the namespace with `setns(CLONE_NEWNET)`
//! (a per-thread switch) and receives a TCP stream into a file there (starting writeback every
//! few MiB as it arrives, then fsyncing it), or
//! serves a file from there. Neither socat nor a full netcat is installed on these hosts,
//! and busybox nc copies in pieces too small to fill the link on 2 busy cores.

use anyhow::{bail, ensure, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use strata::backend::cache::{CacheBackend, CacheOptions, Splitter};
use strata::backend::open::open_location;
use strata::backend::retry::RetryPolicy;
use strata::backend::DynBackend;
use strata::store::{InitOptions, Store};
use strata::Codec;

const SCRIPT: &str = include_str!("../../../scripts/storage-host.sh");
/// This benchmark's own namespace and subnet, apart from other users of the script.
pub const NS: &str = "strata-remote";
pub const NET: &str = "10.212.0";
pub const BUCKET: &str = "strata";

/// Bytes through the link so far: host to storage, storage to host.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Link {
    pub to_storage: u64,
    pub from_storage: u64,
}

impl Link {
    pub fn since(self, before: Link) -> Link {
        Link {
            to_storage: self.to_storage - before.to_storage,
            from_storage: self.from_storage - before.from_storage,
        }
    }
    pub fn total(self) -> u64 {
        self.to_storage + self.from_storage
    }
}

/// The emulated storage host; removed on drop.
pub struct StorageHost {
    script: PathBuf,
    dir: PathBuf,
    veth: String,
    /// The namespace's name.
    pub ns: String,
    net: String,
    pub ip: String,
    pub s3_url: String,
    pub redis_url: String,
    up: bool,
}

impl StorageHost {
    /// Build the namespace with its servers under `scratch` and export the `AWS_*` variables
    /// the S3 backend reads.
    pub fn up(scratch: &Path) -> Result<StorageHost> {
        StorageHost::up_named(scratch, NS, NET)
    }

    /// As [`StorageHost::up`], in namespace `ns` on subnet `net` (first three octets), so that
    /// benchmarks with their own namespace share this driver.
    pub fn up_named(scratch: &Path, ns: &str, net: &str) -> Result<StorageHost> {
        ensure!(
            unsafe { libc::geteuid() } == 0,
            "The remote benchmarks need root (ip netns, tc): run them as root"
        );
        let script = scratch.join("storage-host.sh");
        std::fs::write(&script, SCRIPT)?;
        let dir = scratch.join("storage");
        let run = |arg: &str| {
            script_cmd(&script, ns, net, &dir, arg)
                .output()
                .context("running scripts/storage-host.sh")
        };
        // A namespace left by a killed earlier run of this benchmark is ours: remove it.
        let listed = Command::new("ip").args(["netns", "list"]).output()?.stdout;
        if String::from_utf8_lossy(&listed).split_whitespace().any(|w| w == ns) {
            eprintln!("  namespace {ns} left over from an earlier run: removing it");
            let _ = run("down");
        }
        let tag = Command::new("sh")
            .arg("-c")
            .arg("printf '%s' \"$1\" | cksum | cut -c1-6")
            .arg("sh")
            .arg(ns)
            .output()?;
        let veth = format!("sh{}", String::from_utf8_lossy(&tag.stdout).trim());
        let mut host = StorageHost {
            script: script.clone(),
            dir: dir.clone(),
            veth,
            ns: ns.to_string(),
            net: net.to_string(),
            ip: format!("{net}.2"),
            s3_url: String::new(),
            redis_url: String::new(),
            up: true,
        };
        let o = run("up")?;
        if !o.status.success() {
            bail!("Cannot start the storage host: {}", String::from_utf8_lossy(&o.stderr).trim());
        }
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            let Some((k, v)) = line.strip_prefix("export ").and_then(|l| l.split_once('=')) else {
                continue;
            };
            match k {
                "STRATA_S3_URL" => host.s3_url = v.to_string(),
                "STRATA_REDIS_URL" => host.redis_url = v.to_string(),
                _ if k.starts_with("AWS_") => std::env::set_var(k, v),
                _ => {}
            }
        }
        ensure!(!host.s3_url.is_empty(), "storage-host.sh printed no S3 URL");
        ensure!(
            Path::new("/sys/class/net").join(&host.veth).exists(),
            "veth {} not found after setup",
            host.veth
        );
        eprintln!(
            "  storage host: namespace {ns}, 1 Gbit/s tbf, S3 {} (bucket {BUCKET}), {}",
            std::env::var("AWS_ENDPOINT_URL").unwrap_or_default(),
            host.redis_url
        );
        Ok(host)
    }

    /// The servers' data directory (versitygw's bucket is `s3/<bucket>` in it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn bucket_dir(&self) -> PathBuf {
        self.dir.join("s3").join(BUCKET)
    }

    /// CPU seconds (user + system) versitygw has used so far: the storage host's share of the
    /// 2 cores, which the emulated storage host takes from this host's.
    pub fn s3_cpu_s(&self) -> f64 {
        let pid = std::fs::read_to_string(self.dir.join("versitygw.pid")).unwrap_or_default();
        proc_cpu_s(&format!("/proc/{}/stat", pid.trim()))
    }

    pub fn link(&self) -> Link {
        let rd = |f: &str| -> u64 {
            std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{f}", self.veth))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        Link { to_storage: rd("tx_bytes"), from_storage: rd("rx_bytes") }
    }

    /// A command run inside the namespace.
    pub fn exec(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// Put and read back `mib` MiB of incompressible objects under a scratch prefix, then
    /// remove them, outside any clock. versitygw starts fresh with each benchmark, and its
    /// first saves spent 2-3x its usual CPU on the same PUTs (0.15-0.23 s against 0.05-0.10
    /// for a 128 MiB save: heap growth and collection of a new Go process, on the 2 cores strata
    /// shares with it); a storage server a user saves to has long been running.
    pub fn warm_s3(&self, mib: usize) -> Result<()> {
        let b = self.s3_backend("warm-up")?;
        let mut data = vec![0u8; 4 << 20];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for w in data.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
        }
        let n = mib.div_ceil(4);
        for i in 0..n {
            b.put(&format!("w{i}"), &data)?;
        }
        for i in 0..n {
            ensure!(
                b.get(&format!("w{i}"))?.len() == data.len(),
                "warm-up object w{i} came back short"
            );
        }
        for i in 0..n {
            b.delete(&format!("w{i}"))?;
        }
        std::fs::remove_dir_all(self.bucket_dir().join("warm-up")).ok();
        Ok(())
    }

    /// The S3 backend at `prefix` of the bucket, behind retries.
    pub fn s3_backend(&self, prefix: &str) -> Result<DynBackend> {
        Ok(open_location(&format!("{}/{prefix}", self.s3_url), Some(RetryPolicy::default()))?)
    }

    /// The S3 backend at `prefix` behind retries, optionally under an SSD cache.
    pub fn s3(
        &self,
        prefix: &str,
        cache: Option<(&Path, u64)>,
    ) -> Result<(DynBackend, Option<Arc<CacheBackend>>)> {
        let b = self.s3_backend(prefix)?;
        Ok(match cache {
            None => (b, None),
            Some((dir, size)) => {
                let mut opts = CacheOptions::new(size);
                opts.splitter = Some(pack_splitter());
                let c = Arc::new(CacheBackend::open(b, dir, opts)?);
                (c.clone() as DynBackend, Some(c))
            }
        })
    }

    /// A fresh store in `backend` (pack size as the backend prefers), metadata under `local`.
    pub fn init_store(backend: DynBackend, local: &Path, codec: Codec) -> Result<Store> {
        std::fs::create_dir_all(local)?;
        let pack_size = backend.capabilities().preferred_pack_size;
        Ok(Store::init(
            backend,
            &local.join("meta.redb"),
            InitOptions { pack_size, default_codec: codec },
        )?)
    }

    /// fsync, as they land, the objects a save puts under `dir`, and start the writeback of
    /// those still arriving as the relay does for a stream (`objsync.rs`).
    pub fn sync_objects(&self, dir: PathBuf) -> crate::objsync::ObjectSync {
        let pid = std::fs::read_to_string(self.dir.join("versitygw.pid"))
            .ok()
            .and_then(|p| p.trim().parse().ok());
        crate::objsync::ObjectSync::start(dir, pid)
    }

    /// fsync every file under `dir` on the storage host (versitygw's posix backend does not
    /// fsync its objects; the file baselines are fsynced, so strata's objects are too).
    /// Files already synced and unchanged since (`synced`, from the object watcher) are
    /// skipped; returns how many files were synced here and how many skipped. Directories are
    /// synced too unless [`names_durable_with_files`] holds there, exactly when the relay
    /// syncs its file's directory, so both get the same treatment (a directory sync costs
    /// ~4 ms of a 128 MiB save's commit-to-durable).
    pub fn fsync_tree(dir: &Path, synced: &crate::objsync::SyncedFiles) -> Result<(u64, u64)> {
        let mut files = Vec::new();
        let mut dirs = Vec::new();
        let mut skipped = 0u64;
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else { continue };
            for e in rd.flatten() {
                let ft = e.file_type()?;
                if ft.is_dir() {
                    stack.push(e.path());
                } else if ft.is_file() {
                    let p = e.path();
                    let same = synced.get(&p).is_some_and(|s| {
                        e.metadata().is_ok_and(|m| crate::objsync::Synced::of(&m) == *s)
                    });
                    if same {
                        skipped += 1;
                    } else {
                        files.push(p);
                    }
                }
            }
            dirs.push(d);
        }
        // Concurrently, as a server that fsyncs each object would (the objects are independent):
        // a serial loop made this a series of disk flushes (0.7 s for a 2 GiB save's 92 objects).
        // Directories too (a pack directory per first byte of its name), after their files.
        let par_sync = |paths: &[PathBuf]| -> Result<()> {
            let next = std::sync::atomic::AtomicUsize::new(0);
            let failed = std::sync::Mutex::new(None);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(f) = paths.get(i) else { return };
                        if let Err(e) = std::fs::File::open(f).and_then(|f| f.sync_all()) {
                            failed.lock().unwrap().get_or_insert(e);
                            return;
                        }
                    });
                }
            });
            match failed.into_inner().unwrap() {
                Some(e) => Err(e.into()),
                None => Ok(()),
            }
        };
        par_sync(&files)?;
        if !names_durable_with_files(dir) {
            par_sync(&dirs)?;
        }
        Ok((files.len() as u64, skipped))
    }

    fn down(&mut self) {
        if !self.up {
            return;
        }
        self.up = false;
        if let Err(e) = script_cmd(&self.script, &self.ns, &self.net, &self.dir, "down").output() {
            eprintln!("  storage host: cannot remove namespace {}: {e}", self.ns);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for StorageHost {
    fn drop(&mut self) {
        self.down();
    }
}

/// `scripts/storage-host.sh VERB` for namespace `ns`.
fn script_cmd(script: &Path, ns: &str, net: &str, dir: &Path, verb: &str) -> Command {
    let mut c = Command::new("bash");
    c.arg(script)
        .arg(verb)
        .env("STRATA_NS", ns)
        .env("STRATA_NET", net)
        .env("STRATA_DIR", dir)
        .env("STRATA_BUCKET", BUCKET);
    c
}

/// The splitter the cache needs to fill a new pack's frames on write-through.
pub fn pack_splitter() -> Splitter {
    Arc::new(|_key: &str, bytes: &[u8]| match strata::store::pack::parse_pack(bytes) {
        Ok((_, entries)) => {
            let mut v: Vec<(u64, u64)> =
                entries.iter().map(|e| (e.frame_off, e.frame_len as u64)).collect();
            v.sort_unstable();
            v.dedup();
            v
        }
        Err(_) => Vec::new(),
    })
}

/// Run `f` on a thread inside the storage host's network namespace.
fn in_namespace<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> JoinHandle<Result<T>> {
    std::thread::spawn(move || {
        let ns = std::fs::File::open(format!("/var/run/netns/{NS}"))
            .context("the storage host's namespace is gone")?;
        // SAFETY: setns on a valid namespace fd; it changes this thread's namespace only.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        ensure!(rc == 0, "setns into {NS}: {}", std::io::Error::last_os_error());
        f()
    })
}

/// Start the kernel writing `len` bytes of `f` from `off` to disk, without waiting (the fsync
/// at the end waits for it). Best effort: a failure only leaves more for that fsync.
pub(crate) fn start_writeback(f: &std::fs::File, off: u64, len: u64) {
    // SAFETY: a valid fd; SYNC_FILE_RANGE_WRITE only queues writeback of dirty pages.
    unsafe {
        libc::sync_file_range(
            f.as_raw_fd(),
            off as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Whether a file's fsync also makes its name durable on the filesystem holding `path`, so
/// neither the relay's file nor strata's objects need their directories synced. True on ext4:
/// creating or linking a file dirties its inode in the journal transaction that holds the new
/// directory entry (and the `mkdir`s before it are in that one or an earlier one), and fsync
/// waits until that transaction, and so every earlier one, has committed. The storage host's
/// directory is on ext4 here; elsewhere both the relay and the final pass sync directories.
pub(crate) fn names_durable_with_files(path: &Path) -> bool {
    let Ok(path) = path.canonicalize() else { return false };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    on_ext4(&path, &info)
}

/// Whether the mount holding the absolute `path` is ext4, per `mountinfo` (proc(5)).
fn on_ext4(path: &Path, info: &str) -> bool {
    // The longest mount point that holds `path` decides. Fields: id, parent, dev, root, mount
    // point, options, optional fields..., "-", fstype, source, super options.
    let mut best: Option<(usize, bool)> = None;
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let (Some(mp), Some(dash)) = (f.get(4), f.iter().position(|x| *x == "-")) else { continue };
        let mp = mp.replace("\\040", " ");
        if !path.starts_with(&mp) {
            continue;
        }
        let ext4 = f.get(dash + 1) == Some(&"ext4");
        if best.is_none_or(|(len, _)| mp.len() >= len) {
            best = Some((mp.len(), ext4));
        }
    }
    best.is_some_and(|(_, ext4)| ext4)
}

/// Bytes the relay receives between two writeback starts.
pub(crate) const RELAY_WRITEBACK_BYTES: u64 = 4 << 20;

/// One TCP transfer to or from a file on the storage host.
pub struct Relay {
    pub addr: SocketAddr,
    thread: Option<JoinHandle<Result<(u64, Instant)>>>,
}

impl Relay {
    fn listen(
        host: &StorageHost,
        port: u16,
        work: impl FnOnce(std::net::TcpStream) -> Result<u64> + Send + 'static,
    ) -> Result<Relay> {
        let addr: SocketAddr = format!("{}:{port}", host.ip).parse()?;
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = in_namespace(move || {
            let l = match TcpListener::bind(addr) {
                Ok(l) => {
                    let _ = tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    bail!("bind {addr}: {e}");
                }
            };
            let (s, _) = l.accept()?;
            let n = work(s)?;
            Ok((n, Instant::now()))
        });
        match rx.recv() {
            Ok(Ok(())) => Ok(Relay { addr, thread: Some(thread) }),
            Ok(Err(e)) => bail!("Cannot listen on the storage host at {addr}: {e}"),
            Err(_) => Err(thread
                .join()
                .map_err(|_| anyhow::anyhow!("relay thread panicked"))?
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("relay failed"))),
        }
    }

    /// Receive one connection's bytes into `file` (on the storage host's disk), then fsync it.
    pub fn receive(host: &StorageHost, port: u16, file: PathBuf) -> Result<Relay> {
        Relay::listen(host, port, move |mut s| {
            let mut f = std::fs::File::create(&file)?;
            let mut buf = vec![0u8; 1 << 20];
            let (mut n, mut written_back) = (0u64, 0u64);
            loop {
                let k = s.read(&mut buf)?;
                if k == 0 {
                    break;
                }
                f.write_all(&buf[..k])?;
                n += k as u64;
                if n - written_back >= RELAY_WRITEBACK_BYTES {
                    start_writeback(&f, written_back, n - written_back);
                    written_back = n;
                }
            }
            f.sync_all()?;
            // As the final pass over strata's objects does (`StorageHost::fsync_tree`).
            if let Some(parent) = file.parent().filter(|p| !names_durable_with_files(p)) {
                std::fs::File::open(parent)?.sync_all()?;
            }
            Ok(n)
        })
    }

    /// Send `file` to the one client that connects, then close.
    pub fn send(host: &StorageHost, port: u16, file: PathBuf) -> Result<Relay> {
        Relay::listen(host, port, move |mut s| {
            let mut f = std::fs::File::open(&file)?;
            let n = std::io::copy(&mut f, &mut s)?;
            s.shutdown(std::net::Shutdown::Both).ok();
            Ok(n)
        })
    }

    /// Wait for the transfer; returns its bytes and when it ended (after the fsync).
    pub fn wait(mut self) -> Result<(u64, Instant)> {
        let t = self.thread.take().context("relay waited twice")?;
        t.join().map_err(|_| anyhow::anyhow!("relay thread panicked"))?
    }

    /// A shell command for QEMU's `exec:` migration that pipes through `filter` ("" for none)
    /// to or from this relay (bash's /dev/tcp: QEMU runs `exec:` commands with /bin/sh).
    pub fn exec_save(&self, filter: &str) -> String {
        let dst = format!("/dev/tcp/{}/{}", self.addr.ip(), self.addr.port());
        if filter.is_empty() {
            format!("exec:bash -c 'cat > {dst}'")
        } else {
            format!("exec:bash -c '{filter} > {dst}'")
        }
    }

    pub fn exec_restore(&self, filter: &str) -> String {
        let src = format!("/dev/tcp/{}/{}", self.addr.ip(), self.addr.port());
        if filter.is_empty() {
            format!("exec:bash -c 'cat < {src}'")
        } else {
            format!("exec:bash -c '{filter} < {src}'")
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Unblock a relay still waiting in accept() so its thread ends.
        if let Some(t) = self.thread.take() {
            let addr = self.addr;
            let _ = in_namespace(move || {
                Ok(std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(1))
                    .map(|_| ())?)
            })
            .join();
            let _ = t.join();
        }
    }
}

/// utime + stime of a `/proc/PID/stat` (or `/proc/self/stat`) in seconds; 0 if unreadable.
/// A process's (user s, system s, minor faults, major faults) from its `/proc/PID/stat`.
pub fn proc_cpu_split(stat: &str) -> (f64, f64, u64, u64) {
    let text = std::fs::read_to_string(stat).unwrap_or_default();
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // minflt is field 10, majflt 12, utime 14, stime 15 (state is field 3, index 0 here).
    (n(11) / hz, n(12) / hz, n(7) as u64, n(9) as u64)
}

pub fn proc_cpu_s(stat: &str) -> f64 {
    let text = std::fs::read_to_string(stat).unwrap_or_default();
    // Fields after the ")" that closes the command name: state is field 3, utime 14, stime 15.
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

/// CPU seconds the whole host was busy so far, and the wall seconds of all its cores
/// (`/proc/stat`: everything but idle and iowait), to tell a CPU-bound phase from a
/// link-bound one on this 2-core host.
pub fn host_cpu_s() -> (f64, f64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = text
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let total: f64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0.0) + f.get(4).copied().unwrap_or(0.0);
    ((total - idle) / hz, total / hz)
}

/// CPU nanoseconds every task on the host has run so far: the root cgroup's
/// `cpuacct.usage` (cgroup v1, nanosecond resolution) where it exists, else
/// [`host_cpu_s`]'s 10 ms ticks. A 0.2 s save needs the former: two ticks of error are 10% of it.
pub fn host_busy_ns() -> u64 {
    match std::fs::read_to_string("/sys/fs/cgroup/cpuacct/cpuacct.usage")
        .ok()
        .and_then(|t| t.trim().parse().ok())
    {
        Some(ns) => ns,
        None => (host_cpu_s().0 * 1e9) as u64,
    }
}

/// Host CPU during one timed step: seconds busy (every task, [`host_busy_ns`]) and what the
/// cores had (wall time x cores). On this 2-core host, which also runs the storage host's
/// server, a step whose `host_busy_s` nears `host_avail_s` is bound by CPU, not the link.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct HostCpu {
    pub host_busy_s: f64,
    pub host_avail_s: f64,
}

impl HostCpu {
    pub fn start() -> (u64, std::time::Instant) {
        (host_busy_ns(), std::time::Instant::now())
    }

    pub fn since(start: (u64, std::time::Instant)) -> HostCpu {
        HostCpu::between(start, HostCpu::start())
    }

    pub fn between(
        (ns0, t0): (u64, std::time::Instant),
        (ns1, t1): (u64, std::time::Instant),
    ) -> HostCpu {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        HostCpu {
            host_busy_s: ns1.saturating_sub(ns0) as f64 / 1e9,
            host_avail_s: t1.duration_since(t0).as_secs_f64() * cores,
        }
    }

    /// Busy over available, 0 when nothing was measured.
    pub fn load(&self) -> f64 {
        if self.host_avail_s > 0.0 {
            self.host_busy_s / self.host_avail_s
        } else {
            0.0
        }
    }
}

pub fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::on_ext4;
    use std::path::Path;

    const INFO: &str = "22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard\n\
        30 22 0:26 / /tmp rw,nosuid shared:12 - tmpfs tmpfs rw\n\
        31 22 0:27 / /var/my\\040data rw - xfs /dev/vdb rw\n\
        32 30 253:0 /x /tmp/ext rw - ext4 /dev/vda rw\n";

    #[test]
    fn the_longest_mount_point_decides_the_filesystem() {
        assert!(on_ext4(Path::new("/var/tmp/storage/m128-zstd.bin"), INFO));
        assert!(!on_ext4(Path::new("/tmp/storage"), INFO));
        assert!(on_ext4(Path::new("/tmp/ext/storage"), INFO));
        assert!(
            !on_ext4(Path::new("/tmp/extra"), INFO),
            "a mount point is a path prefix, not a string prefix"
        );
        assert!(!on_ext4(Path::new("/var/my data/objects"), INFO));
        assert!(!on_ext4(Path::new("/x"), ""));
    }
}

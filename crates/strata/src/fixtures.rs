//! Test guests: the fixture files built by `scripts/fixtures.sh` and a harness that boots them
//! under `qemu-system-x86_64 -accel tcg`.
//!
//! Integration tests and benchmark commands use this module to get a real guest to talk to:
//! [`Fixtures::ensure`] builds (or reuses) the kernel, initramfs and golden disk, and
//! [`GuestBuilder`] launches QEMU with the guest's serial console on a unix-socket chardev.
//! The harness holds the client end of that socket, so a test drives the in-guest agent
//! (`memwork` in `strata.mode=mem`, the golden disk's `/sbin/init` in `strata.mode=root`) with
//! one request line and one reply line, exactly as a person at the console would.
//!
//! Why it is shaped this way:
//! - The console chardev is `server=on,wait=on`: QEMU does not run the guest until the harness
//!   has connected, so no boot output is lost and `wait_for` sees every line.
//! - A reader thread appends console lines to a shared log; `wait_for` and `command` only move
//!   a cursor over it. Kernel messages and echoes stay in the log (errors quote its tail) but
//!   are skipped by `command`, which accepts only lines that start with `OK`, `ERR` or `pong`
//!   (the agents' reply rule, see docs/fixtures.md).
//! - Every guest gets its own temporary directory (sockets, QEMU's stderr) that `Drop` removes
//!   after killing QEMU, so a failing test never leaves a VM behind.
//! - Std-only: tests and the CLI's benchmark commands share this code without extra deps.

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::{debug, info, warn};

const TARGET: &str = "strata::fixtures";
const CONSOLE_TARGET: &str = "strata::fixtures::console";

/// Marker the agents print when they accept commands.
pub const READY_MARKER: &str = "STRATA-READY";
/// Marker the golden disk's init prints before reading its boot working set.
pub const BOOT_START_MARKER: &str = "STRATA-BOOT-START";
/// Marker the initramfs prints (followed by a hint) when it cannot continue.
pub const ERROR_MARKER: &str = "STRATA-ERROR";

/// Files every fixture directory holds after a successful build.
const OUTPUTS: [&str; 6] = [
    "vmlinuz",
    "initramfs.cpio.gz",
    "memwork",
    "golden.img",
    "bootset.txt",
    "manifest.txt",
];
/// Console lines kept per guest (older ones are dropped).
const CONSOLE_KEEP: usize = 50_000;
/// Console lines quoted in error messages.
const CONSOLE_TAIL: usize = 25;

/// Errors of the fixture harness.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("Fixture script {path} not found; set STRATA_REPO to a strata checkout")]
    ScriptMissing { path: PathBuf },
    #[error("Fixture build failed ({status}); last output:\n{tail}")]
    Build { status: String, tail: String },
    #[error("Fixture {name} missing in {dir}; run scripts/fixtures.sh")]
    Missing { name: &'static str, dir: PathBuf },
    #[error("Cannot run {program}; install it with scripts/setup.sh")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
    #[error("I/O error during {op} on {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{tool} failed ({status}): {stderr}")]
    Tool {
        tool: &'static str,
        status: String,
        stderr: String,
    },
    #[error("Invalid guest option: {0}")]
    InvalidOption(String),
    #[error("QEMU exited ({status}) while {during}; QEMU said:\n{stderr}\nlast console lines:\n{console}")]
    Exited {
        status: String,
        during: String,
        stderr: String,
        console: String,
    },
    #[error("Timed out after {waited:?} waiting for {what}; last console lines:\n{console}")]
    Timeout {
        what: String,
        waited: Duration,
        console: String,
    },
    #[error("Guest reported an error for {what}: {message}")]
    GuestError { what: String, message: String },
    #[error("Guest agent rejected `{command}`: {message}")]
    Agent { command: String, message: String },
    #[error("Console of the guest is closed")]
    ConsoleClosed,
}

type Result<T> = std::result::Result<T, FixtureError>;

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FixtureError + '_ {
    move |source| FixtureError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------------------------------------
// Fixture files
// ---------------------------------------------------------------------------------------------

/// A directory of built fixtures (see docs/fixtures.md for what each file is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fixtures {
    dir: PathBuf,
}

/// Serialises builds within one process; the script's own lock covers other processes.
static BUILD_LOCK: Mutex<()> = Mutex::new(());

impl Fixtures {
    /// The strata checkout: `$STRATA_REPO`, else the workspace this crate was built in.
    pub fn repo_dir() -> PathBuf {
        match std::env::var_os("STRATA_REPO") {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
        }
    }

    /// Where fixtures live: `$STRATA_FIXTURES`, else `<repo>/target/fixtures`.
    pub fn default_dir() -> PathBuf {
        match std::env::var_os("STRATA_FIXTURES") {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => Self::repo_dir().join("target/fixtures"),
        }
    }

    /// Build the fixtures if they are missing or stale, then return them.
    ///
    /// Runs `scripts/fixtures.sh` (a no-op taking milliseconds when its stamp matches). When
    /// the script is absent but a complete fixture directory exists, that directory is used.
    pub fn ensure() -> Result<Fixtures> {
        Self::ensure_in(&Self::default_dir())
    }

    /// Like [`Fixtures::ensure`] with an explicit output directory.
    pub fn ensure_in(dir: &Path) -> Result<Fixtures> {
        let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let script = Self::repo_dir().join("scripts/fixtures.sh");
        if !script.is_file() {
            if let Ok(f) = Self::at(dir) {
                warn!(target: TARGET, script = %script.display(), dir = %dir.display(),
                      "fixture script not found; using existing fixtures as they are");
                return Ok(f);
            }
            return Err(FixtureError::ScriptMissing { path: script });
        }
        let started = Instant::now();
        let mut child = Command::new("bash")
            .arg(&script)
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| FixtureError::Spawn {
                program: "bash".into(),
                source,
            })?;
        let mut tail: VecDeque<String> = VecDeque::new();
        if let Some(err) = child.stderr.take() {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                info!(target: TARGET, "{line}");
                if tail.len() == 30 {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        }
        let status = child.wait().map_err(|source| FixtureError::Spawn {
            program: "bash".into(),
            source,
        })?;
        if !status.success() {
            return Err(FixtureError::Build {
                status: status.to_string(),
                tail: tail.into_iter().collect::<Vec<_>>().join("\n"),
            });
        }
        debug!(target: TARGET, elapsed_ms = started.elapsed().as_millis() as u64, "fixtures ready");
        Self::at(dir)
    }

    /// Use an existing fixture directory without building; fails if a file is missing.
    pub fn at(dir: &Path) -> Result<Fixtures> {
        for name in OUTPUTS {
            if !dir.join(name).is_file() {
                return Err(FixtureError::Missing {
                    name,
                    dir: dir.to_path_buf(),
                });
            }
        }
        Ok(Fixtures {
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Debian's kernel image.
    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }
    /// busybox + /init + memwork + virtio-blk/ext4 modules.
    pub fn initramfs(&self) -> PathBuf {
        self.dir.join("initramfs.cpio.gz")
    }
    /// The raw ext4 golden desktop disk. Never boot it read-write: use [`create_overlay`].
    pub fn golden(&self) -> PathBuf {
        self.dir.join("golden.img")
    }
    /// The memory agent binary (also inside the initramfs).
    pub fn memwork(&self) -> PathBuf {
        self.dir.join("memwork")
    }
    /// `PATH SIZE` lines: the files the golden init reads at every boot.
    pub fn bootset(&self) -> PathBuf {
        self.dir.join("bootset.txt")
    }
    /// Versions, module order and sha256 of every output.
    pub fn manifest(&self) -> PathBuf {
        self.dir.join("manifest.txt")
    }

    /// The boot working set as (path inside the golden disk, size in bytes).
    pub fn bootset_files(&self) -> Result<Vec<(String, u64)>> {
        let path = self.bootset();
        let text = fs::read_to_string(&path).map_err(io_err("read", &path))?;
        parse_bootset(&text).map_err(|line| FixtureError::GuestError {
            what: format!("{}", path.display()),
            message: format!("bad line {line:?}; rebuild with scripts/fixtures.sh"),
        })
    }

    /// A guest builder preset with these fixtures.
    pub fn guest(&self) -> GuestBuilder {
        GuestBuilder::new(self)
    }
}

/// Parse `bootset.txt`; the error is the offending line.
pub fn parse_bootset(text: &str) -> std::result::Result<Vec<(String, u64)>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut it = l.split_whitespace();
            match (it.next(), it.next().and_then(|s| s.parse().ok()), it.next()) {
                (Some(p), Some(n), None) if p.starts_with('/') => Ok((p.to_string(), n)),
                _ => Err(l.to_string()),
            }
        })
        .collect()
}

/// Create a qcow2 overlay at `path` whose backing file is `base` (`qemu-img create -f qcow2
/// -b BASE -F FORMAT`). Use it to boot the golden disk without modifying it.
pub fn create_overlay(base: &Path, base_format: &str, path: &Path) -> Result<()> {
    let base = fs::canonicalize(base).map_err(io_err("resolve backing file", base))?;
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", base_format, "-b"])
        .arg(&base)
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| FixtureError::Spawn {
            program: "qemu-img".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(FixtureError::Tool {
            tool: "qemu-img create",
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Guest options
// ---------------------------------------------------------------------------------------------

/// QEMU machine type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    /// i440fx (`-machine pc`).
    Pc,
    /// Q35 (`-machine q35`).
    Q35,
}

impl Machine {
    pub fn as_str(self) -> &'static str {
        match self {
            Machine::Pc => "pc",
            Machine::Q35 => "q35",
        }
    }
}

/// What the initramfs does (`strata.mode=` on the kernel command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestMode {
    /// Run the memory agent `memwork` on ttyS0.
    Mem,
    /// Mount /dev/vda (the golden disk or an overlay of it) and switch_root into it.
    Root,
}

impl GuestMode {
    pub fn as_str(self) -> &'static str {
        match self {
            GuestMode::Mem => "mem",
            GuestMode::Root => "root",
        }
    }
}

/// Options for one QEMU process. Build with [`Fixtures::guest`], start with
/// [`GuestBuilder::launch`]. Launching twice with the same builder gives the same command line
/// (apart from the per-guest socket directory), which is what an `-incoming` restore needs.
#[derive(Debug, Clone)]
pub struct GuestBuilder {
    qemu: PathBuf,
    kernel: PathBuf,
    initrd: PathBuf,
    memory_mib: u32,
    machine: Machine,
    mode: GuestMode,
    append: Vec<String>,
    drives: Vec<String>,
    extra: Vec<String>,
    qmp: bool,
    incoming: Option<String>,
    no_reboot: bool,
    wait_ready: bool,
    ready_timeout: Duration,
    name: String,
}

impl GuestBuilder {
    /// Defaults: 256 MiB, `pc`, `strata.mode=mem`, no QMP, `-no-reboot`, wait for
    /// `STRATA-READY` up to 120 s (TCG on a busy 2-core machine can be slow). The QEMU binary is
    /// `$STRATA_QEMU` or `qemu-system-x86_64`.
    pub fn new(fixtures: &Fixtures) -> GuestBuilder {
        let qemu = std::env::var_os("STRATA_QEMU")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"));
        GuestBuilder {
            qemu,
            kernel: fixtures.vmlinuz(),
            initrd: fixtures.initramfs(),
            memory_mib: 256,
            machine: Machine::Pc,
            mode: GuestMode::Mem,
            append: Vec::new(),
            drives: Vec::new(),
            extra: Vec::new(),
            qmp: false,
            incoming: None,
            no_reboot: true,
            wait_ready: true,
            ready_timeout: Duration::from_secs(120),
            name: "guest".into(),
        }
    }

    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }
    pub fn machine(mut self, machine: Machine) -> Self {
        self.machine = machine;
        self
    }
    pub fn mode(mut self, mode: GuestMode) -> Self {
        self.mode = mode;
        self
    }
    /// Extra kernel command-line words (after `console=ttyS0 strata.mode=...`).
    pub fn append(mut self, words: &str) -> Self {
        self.append.push(words.to_string());
        self
    }
    /// A virtio disk from a file (`-drive file=PATH,if=virtio,format=FORMAT`).
    pub fn drive_file(mut self, path: &Path, format: &str) -> Self {
        self.drives.push(format!(
            "file={},if=virtio,format={format}",
            escape_opt(&path.display().to_string())
        ));
        self
    }
    /// A virtio disk served over NBD on a unix socket.
    pub fn drive_nbd_unix(mut self, socket: &Path, export: &str) -> Self {
        self.drives.push(format!(
            "file=nbd:unix:{}:exportname={},if=virtio,format=raw",
            escape_opt(&socket.display().to_string()),
            escape_opt(export)
        ));
        self
    }
    /// A raw `-drive` option string, used as given.
    pub fn drive(mut self, spec: &str) -> Self {
        self.drives.push(spec.to_string());
        self
    }
    /// Any extra QEMU argument (appended last).
    pub fn arg(mut self, arg: &str) -> Self {
        self.extra.push(arg.to_string());
        self
    }
    /// Open a QMP socket (`-qmp unix:DIR/qmp.sock,server=on,wait=off`); see [`Guest::qmp_path`].
    pub fn qmp(mut self, on: bool) -> Self {
        self.qmp = on;
        self
    }
    /// Start with `-incoming URI`. The guest is already running when the migration completes,
    /// so this also turns off waiting for `STRATA-READY`.
    pub fn incoming(mut self, uri: &str) -> Self {
        self.incoming = Some(uri.to_string());
        self.wait_ready = false;
        self
    }
    /// `-no-reboot` (default on): a guest reboot or kernel panic makes QEMU exit.
    pub fn no_reboot(mut self, on: bool) -> Self {
        self.no_reboot = on;
        self
    }
    /// Whether `launch` waits for `STRATA-READY` (default on, off after `incoming`).
    pub fn wait_ready(mut self, on: bool) -> Self {
        self.wait_ready = on;
        self
    }
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }
    /// A label for logs and the temporary directory name.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(24)
            .collect();
        self
    }

    fn validate(&self) -> Result<()> {
        if !(64..=16384).contains(&self.memory_mib) {
            return Err(FixtureError::InvalidOption(format!(
                "memory {} MiB out of range; use 64..=16384",
                self.memory_mib
            )));
        }
        for w in &self.append {
            if w.contains('"') || w.contains('\n') {
                return Err(FixtureError::InvalidOption(format!(
                    "kernel argument {w:?} contains a quote or newline; remove it"
                )));
            }
        }
        Ok(())
    }

    /// The QEMU command line (without the program) for a guest whose sockets live in `dir`.
    pub fn qemu_args(&self, dir: &Path) -> Vec<String> {
        let mut cmdline = format!(
            "console=ttyS0 strata.mode={} panic=-1",
            self.mode.as_str()
        );
        for w in &self.append {
            cmdline.push(' ');
            cmdline.push_str(w);
        }
        let con = escape_opt(&dir.join("console.sock").display().to_string());
        let mut a: Vec<String> = vec![
            "-accel".into(),
            "tcg".into(),
            "-machine".into(),
            self.machine.as_str().into(),
            "-m".into(),
            self.memory_mib.to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-kernel".into(),
            self.kernel.display().to_string(),
            "-initrd".into(),
            self.initrd.display().to_string(),
            "-append".into(),
            cmdline,
            "-chardev".into(),
            format!("socket,id=con0,path={con},server=on,wait=on"),
            "-serial".into(),
            "chardev:con0".into(),
        ];
        if self.qmp {
            a.push("-qmp".into());
            a.push(format!(
                "unix:{},server=on,wait=off",
                escape_opt(&dir.join("qmp.sock").display().to_string())
            ));
        }
        if self.no_reboot {
            a.push("-no-reboot".into());
        }
        for d in &self.drives {
            a.push("-drive".into());
            a.push(d.clone());
        }
        if let Some(uri) = &self.incoming {
            a.push("-incoming".into());
            a.push(uri.clone());
        }
        a.extend(self.extra.iter().cloned());
        a
    }

    /// Start QEMU, connect to its console and (unless turned off) wait for `STRATA-READY`.
    pub fn launch(&self) -> Result<Guest> {
        self.validate()?;
        for (name, p) in [("vmlinuz", &self.kernel), ("initramfs.cpio.gz", &self.initrd)] {
            if !p.is_file() {
                return Err(FixtureError::Missing {
                    name,
                    dir: p.parent().map(Path::to_path_buf).unwrap_or_default(),
                });
            }
        }
        let dir = make_guest_dir(&self.name)?;
        let args = self.qemu_args(&dir);
        let log_path = dir.join("qemu.log");
        let log = File::create(&log_path).map_err(io_err("create", &log_path))?;
        let log2 = log.try_clone().map_err(io_err("dup", &log_path))?;
        info!(target: TARGET, name = %self.name, dir = %dir.display(),
              "launching {} {}", self.qemu.display(), args.join(" "));
        let child = match Command::new(&self.qemu)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
        {
            Ok(c) => c,
            Err(source) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(FixtureError::Spawn {
                    program: self.qemu.display().to_string(),
                    source,
                });
            }
        };
        let mut guest = Guest {
            child: Some(child),
            dir,
            console: None,
            cursor: 0,
            qmp_path: None,
            args,
            ready_line: None,
            name: self.name.clone(),
        };
        if self.qmp {
            guest.qmp_path = Some(guest.dir.join("qmp.sock"));
        }
        guest.connect_console(Duration::from_secs(30))?;
        if self.wait_ready {
            let line = guest.wait_for(READY_MARKER, self.ready_timeout)?;
            guest.ready_line = Some(line);
        }
        Ok(guest)
    }
}

/// QEMU option values escape ',' by doubling it.
fn escape_opt(s: &str) -> String {
    s.replace(',', ",,")
}

static GUEST_SEQ: AtomicU64 = AtomicU64::new(0);

fn make_guest_dir(name: &str) -> Result<PathBuf> {
    // unix socket paths must stay under 108 bytes: prefer a short base directory
    let mut base = std::env::temp_dir();
    if base.as_os_str().len() > 40 {
        base = PathBuf::from("/tmp");
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = base.join(format!(
        "strata-{name}-{}-{}-{nanos:x}",
        std::process::id(),
        GUEST_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).map_err(io_err("create guest directory", &dir))?;
    Ok(dir)
}

// ---------------------------------------------------------------------------------------------
// Console
// ---------------------------------------------------------------------------------------------

/// Lines received on a guest console, shared with the reader thread.
#[derive(Debug, Default)]
struct ConsoleLog {
    lines: VecDeque<String>,
    /// Absolute index of `lines[0]` (lines before it were dropped).
    first: usize,
    closed: bool,
}

impl ConsoleLog {
    fn end(&self) -> usize {
        self.first + self.lines.len()
    }
    fn push(&mut self, line: String) {
        if self.lines.len() == CONSOLE_KEEP {
            self.lines.pop_front();
            self.first += 1;
        }
        self.lines.push_back(line);
    }
    fn tail(&self, n: usize) -> String {
        let skip = self.lines.len().saturating_sub(n);
        let v: Vec<&str> = self.lines.iter().skip(skip).map(String::as_str).collect();
        if v.is_empty() {
            "(no console output)".into()
        } else {
            v.join("\n")
        }
    }
}

type Shared = Arc<(Mutex<ConsoleLog>, Condvar)>;

struct Console {
    stream: UnixStream,
    shared: Shared,
    reader: Option<JoinHandle<()>>,
}

/// Split a byte stream into console lines: `\n` ends a line, `\r` and other control bytes
/// (except tab) are dropped, invalid UTF-8 is replaced.
#[derive(Debug, Default)]
pub struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    /// Feed bytes; returns the lines they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        for &b in bytes {
            match b {
                b'\n' => {
                    out.push(String::from_utf8_lossy(&self.partial).into_owned());
                    self.partial.clear();
                }
                b'\t' => self.partial.push(b),
                0..=0x1f | 0x7f => {}
                _ => {
                    // guard against a guest that never sends a newline
                    if self.partial.len() < 1 << 20 {
                        self.partial.push(b);
                    }
                }
            }
        }
        out
    }
    /// The unterminated rest, if any.
    pub fn finish(&mut self) -> Option<String> {
        if self.partial.is_empty() {
            None
        } else {
            let s = String::from_utf8_lossy(&self.partial).into_owned();
            self.partial.clear();
            Some(s)
        }
    }
}

fn reader_loop(mut stream: UnixStream, shared: Shared, name: String) {
    let mut split = LineSplitter::default();
    let mut buf = [0u8; 4096];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let lines = split.feed(&buf[..n]);
        if lines.is_empty() {
            continue;
        }
        let (lock, cv) = &*shared;
        let mut log = lock.lock().unwrap_or_else(|e| e.into_inner());
        for l in lines {
            debug!(target: CONSOLE_TARGET, guest = %name, "{l}");
            log.push(l);
        }
        cv.notify_all();
    }
    let (lock, cv) = &*shared;
    let mut log = lock.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = split.finish() {
        log.push(l);
    }
    log.closed = true;
    cv.notify_all();
}

/// How an agent answered a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `OK` or `OK payload`: the payload (may be empty).
    Ok(String),
    /// `ERR message`.
    Err(String),
    /// `pong` (the answer to `ping`).
    Pong,
}

/// Classify a console line; `None` for anything that is not an agent reply (kernel messages,
/// echoes, markers).
pub fn classify_reply(line: &str) -> Option<Reply> {
    let line = line.trim_end();
    if line == "pong" {
        return Some(Reply::Pong);
    }
    if line == "OK" {
        return Some(Reply::Ok(String::new()));
    }
    if let Some(rest) = line.strip_prefix("OK ") {
        return Some(Reply::Ok(rest.to_string()));
    }
    if line == "ERR" {
        return Some(Reply::Err(String::new()));
    }
    line.strip_prefix("ERR ").map(|rest| Reply::Err(rest.to_string()))
}

/// Parse `key=value` words of a reply payload (e.g. `pages=16384 zero=4914 sum=...`).
pub fn reply_fields(payload: &str) -> Vec<(&str, &str)> {
    payload
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .collect()
}

/// Look up one `key=value` field of a reply payload.
pub fn reply_field<'a>(payload: &'a str, key: &str) -> Option<&'a str> {
    reply_fields(payload)
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// Undo the golden agent's escaping of multi-line output (`\n` and `\\`).
pub fn unescape_reply(payload: &str) -> String {
    let mut out = String::with_capacity(payload.len());
    let mut it = payload.chars();
    while let Some(c) = it.next() {
        if c == '\\' {
            match it.next() {
                Some('n') => out.push('\n'),
                Some('\\') => out.push('\\'),
                Some(o) => {
                    out.push('\\');
                    out.push(o);
                }
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Guest
// ---------------------------------------------------------------------------------------------

/// A running `qemu-system-x86_64 -accel tcg` with the test guest. Dropping it kills QEMU and
/// removes its temporary directory.
pub struct Guest {
    child: Option<Child>,
    dir: PathBuf,
    console: Option<Console>,
    /// Absolute index of the next console line `wait_for`/`command` will look at.
    cursor: usize,
    qmp_path: Option<PathBuf>,
    args: Vec<String>,
    ready_line: Option<String>,
    name: String,
}

impl std::fmt::Debug for Guest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guest")
            .field("name", &self.name)
            .field("pid", &self.pid())
            .field("dir", &self.dir)
            .finish()
    }
}

/// Look at console lines from `cursor` on: `Some(Ok)` for the first line `pick` accepts,
/// `Some(Err)` for a `STRATA-ERROR` line, `None` when the lines ran out.
fn scan_lines<T>(
    log: &ConsoleLog,
    cursor: &mut usize,
    what: &str,
    pick: &mut impl FnMut(&str) -> Option<T>,
) -> Option<Result<T>> {
    if *cursor < log.first {
        *cursor = log.first;
    }
    while *cursor < log.end() {
        let line = &log.lines[*cursor - log.first];
        *cursor += 1;
        if let Some(v) = pick(line) {
            return Some(Ok(v));
        }
        if let Some((_, rest)) = line.split_once(ERROR_MARKER) {
            return Some(Err(FixtureError::GuestError {
                what: what.to_string(),
                message: rest.trim().to_string(),
            }));
        }
    }
    None
}

impl Guest {
    fn connect_console(&mut self, timeout: Duration) -> Result<()> {
        let path = self.dir.join("console.sock");
        let start = Instant::now();
        let stream = loop {
            if let Some(status) = self.try_status() {
                return Err(self.exited_error(status, "starting"));
            }
            match UnixStream::connect(&path) {
                Ok(s) => break s,
                Err(_) if start.elapsed() < timeout => thread::sleep(Duration::from_millis(10)),
                Err(source) => {
                    return Err(FixtureError::Io {
                        op: "connect console",
                        path,
                        source,
                    })
                }
            }
        };
        let shared: Shared = Arc::new((Mutex::new(ConsoleLog::default()), Condvar::new()));
        let rd = stream.try_clone().map_err(io_err("dup console", &path))?;
        let sh = shared.clone();
        let name = self.name.clone();
        let reader = thread::Builder::new()
            .name(format!("console-{}", self.name))
            .spawn(move || reader_loop(rd, sh, name))
            .map_err(io_err("spawn console reader", &path))?;
        self.console = Some(Console {
            stream,
            shared,
            reader: Some(reader),
        });
        Ok(())
    }

    fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    fn qemu_stderr(&self) -> String {
        let s = fs::read_to_string(self.dir.join("qemu.log")).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        let tail = lines[lines.len().saturating_sub(10)..].join("\n");
        if tail.is_empty() {
            "(nothing)".into()
        } else {
            tail
        }
    }

    fn exited_error(&self, status: ExitStatus, during: &str) -> FixtureError {
        FixtureError::Exited {
            status: status.to_string(),
            during: during.to_string(),
            stderr: self.qemu_stderr(),
            console: self.console_tail(CONSOLE_TAIL),
        }
    }

    /// The path of the QMP socket, if the builder enabled QMP.
    pub fn qmp_path(&self) -> Option<&Path> {
        self.qmp_path.as_deref()
    }
    /// This guest's temporary directory (sockets, `qemu.log`); removed on drop.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The QEMU arguments this guest was started with.
    pub fn args(&self) -> &[String] {
        &self.args
    }
    /// The `STRATA-READY ...` line seen at launch, if the builder waited for it.
    pub fn ready_line(&self) -> Option<&str> {
        self.ready_line.as_deref()
    }
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether QEMU is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.is_some() && self.try_status().is_none()
    }

    /// The last `n` console lines, joined with newlines.
    pub fn console_tail(&self, n: usize) -> String {
        match &self.console {
            Some(c) => {
                let log = c.shared.0.lock().unwrap_or_else(|e| e.into_inner());
                log.tail(n)
            }
            None => "(console not connected)".into(),
        }
    }

    /// Every console line kept so far.
    pub fn console_log(&self) -> Vec<String> {
        match &self.console {
            Some(c) => {
                let log = c.shared.0.lock().unwrap_or_else(|e| e.into_inner());
                log.lines.iter().cloned().collect()
            }
            None => Vec::new(),
        }
    }

    /// Scan console lines after the cursor until `pick` returns a value; the cursor moves past
    /// the matching line. Fails on timeout, on QEMU exit and on a `STRATA-ERROR` line.
    fn scan<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pick: impl FnMut(&str) -> Option<T>,
    ) -> Result<T> {
        let start = Instant::now();
        let shared = match &self.console {
            Some(c) => c.shared.clone(),
            None => return Err(FixtureError::ConsoleClosed),
        };
        let (lock, cv) = &*shared;
        loop {
            let closed = {
                let mut log = lock.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(r) = scan_lines(&log, &mut self.cursor, what, &mut pick) {
                    return r;
                }
                if !log.closed {
                    let remaining = timeout.saturating_sub(start.elapsed());
                    if !remaining.is_zero() {
                        // wake up now and then to notice a QEMU that exited
                        let wait = remaining.min(Duration::from_millis(250));
                        log = cv.wait_timeout(log, wait).unwrap_or_else(|e| e.into_inner()).0;
                        if let Some(r) = scan_lines(&log, &mut self.cursor, what, &mut pick) {
                            return r;
                        }
                    }
                }
                log.closed
            };
            if let Some(status) = self.try_status() {
                // QEMU is gone: let the reader drain the socket, then look one last time
                let deadline = Instant::now() + Duration::from_secs(1);
                let mut log = lock.lock().unwrap_or_else(|e| e.into_inner());
                while !log.closed && Instant::now() < deadline {
                    log = cv
                        .wait_timeout(log, Duration::from_millis(50))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                if let Some(r) = scan_lines(&log, &mut self.cursor, what, &mut pick) {
                    return r;
                }
                drop(log);
                return Err(self.exited_error(status, &format!("waiting for {what}")));
            }
            if start.elapsed() >= timeout {
                return Err(FixtureError::Timeout {
                    what: what.to_string(),
                    waited: timeout,
                    console: self.console_tail(CONSOLE_TAIL),
                });
            }
            if closed {
                // console gone while QEMU still runs (about to exit): poll its status
                thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Wait until a console line containing `marker` arrives; returns that line.
    pub fn wait_for(&mut self, marker: &str, timeout: Duration) -> Result<String> {
        self.scan(marker, timeout, |l| {
            if l.contains(marker) {
                Some(l.to_string())
            } else {
                None
            }
        })
    }

    /// Write one line to the guest console (a newline is added).
    pub fn send_line(&mut self, line: &str) -> Result<()> {
        if line.contains('\n') || line.contains('\r') {
            return Err(FixtureError::InvalidOption(format!(
                "command {line:?} contains a newline; send one line at a time"
            )));
        }
        let path = self.dir.join("console.sock");
        let c = self.console.as_mut().ok_or(FixtureError::ConsoleClosed)?;
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        c.stream
            .write_all(&bytes)
            .map_err(io_err("write console", &path))?;
        Ok(())
    }

    /// Send a command line and return the agent's reply: the payload of `OK payload`, or
    /// `"pong"`. An `ERR` reply becomes [`FixtureError::Agent`]. Lines arriving before the
    /// command was sent are skipped, as are kernel messages and echoes.
    pub fn command(&mut self, line: &str, timeout: Duration) -> Result<String> {
        // discard anything already received: the reply must come after the request
        if let Some(c) = &self.console {
            let log = c.shared.0.lock().unwrap_or_else(|e| e.into_inner());
            self.cursor = self.cursor.max(log.end());
        }
        self.send_line(line)?;
        let what = format!("the reply to `{line}`");
        match self.scan(&what, timeout, classify_reply)? {
            Reply::Ok(p) => Ok(p),
            Reply::Pong => Ok("pong".into()),
            Reply::Err(message) => Err(FixtureError::Agent {
                command: line.to_string(),
                message,
            }),
        }
    }

    /// Wait for QEMU to exit by itself (after `poweroff`, or a reboot with `-no-reboot`).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let start = Instant::now();
        loop {
            match self.child.as_mut() {
                None => return Err(FixtureError::ConsoleClosed),
                Some(c) => {
                    if let Some(st) = c.try_wait().map_err(|source| FixtureError::Spawn {
                        program: "qemu-system-x86_64".into(),
                        source,
                    })? {
                        self.child = None;
                        self.join_reader();
                        return Ok(st);
                    }
                }
            }
            if start.elapsed() >= timeout {
                return Err(FixtureError::Timeout {
                    what: "QEMU to exit".into(),
                    waited: timeout,
                    console: self.console_tail(CONSOLE_TAIL),
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kill QEMU (SIGKILL) and reap it. The console log stays readable.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            c.wait().map_err(|source| FixtureError::Spawn {
                program: "qemu-system-x86_64".into(),
                source,
            })?;
            debug!(target: TARGET, name = %self.name, "killed QEMU");
        }
        self.join_reader();
        Ok(())
    }

    fn join_reader(&mut self) {
        if let Some(c) = self.console.as_mut() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            if let Some(h) = c.reader.take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.kill();
        if std::env::var_os("STRATA_KEEP_GUEST_DIR").is_some() {
            warn!(target: TARGET, dir = %self.dir.display(), "keeping guest directory");
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tests (pure parts; the QEMU-backed tests are in tests/guest_fixtures.rs)
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    fn fx() -> Fixtures {
        Fixtures {
            dir: PathBuf::from("/fx"),
        }
    }

    #[test]
    fn replies_are_classified() {
        assert_eq!(classify_reply("pong"), Some(Reply::Pong));
        assert_eq!(classify_reply("OK"), Some(Reply::Ok(String::new())));
        assert_eq!(
            classify_reply("OK pages=1 sum=ab\r"),
            Some(Reply::Ok("pages=1 sum=ab".into()))
        );
        assert_eq!(
            classify_reply("ERR usage: fill"),
            Some(Reply::Err("usage: fill".into()))
        );
        assert_eq!(classify_reply("[    3.42] Run /init as init process"), None);
        assert_eq!(classify_reply("OKAY"), None);
        assert_eq!(classify_reply("fill 64 30 30 1"), None);
        assert_eq!(classify_reply("STRATA-READY mode=mem"), None);
    }

    #[test]
    fn reply_fields_parse() {
        let p = "pages=16384 zero=4914 sum=d7764b56e7a24e75";
        assert_eq!(reply_field(p, "pages"), Some("16384"));
        assert_eq!(reply_field(p, "sum"), Some("d7764b56e7a24e75"));
        assert_eq!(reply_field(p, "nope"), None);
        assert_eq!(reply_fields("a=1 junk b=2").len(), 2);
    }

    #[test]
    fn unescape_round_trip() {
        assert_eq!(unescape_reply("a\\nb\\\\c"), "a\nb\\c");
        assert_eq!(unescape_reply("trailing\\"), "trailing\\");
        assert_eq!(unescape_reply("x\\ty"), "x\\ty");
    }

    #[test]
    fn splitter_handles_crlf_and_partial_lines() {
        let mut s = LineSplitter::default();
        assert!(s.feed(b"hel").is_empty());
        assert_eq!(s.feed(b"lo\r\nwor"), vec!["hello".to_string()]);
        assert_eq!(s.feed(b"ld\n\n"), vec!["world".to_string(), String::new()]);
        assert!(s.feed(b"\x1b[0mtail").is_empty());
        assert_eq!(s.finish(), Some("[0mtail".to_string()));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn bootset_parses_and_rejects_garbage() {
        let v = parse_bootset("/lib/a.so 10\n\n/usr/b 2\n").unwrap();
        assert_eq!(v, vec![("/lib/a.so".into(), 10), ("/usr/b".into(), 2)]);
        assert_eq!(parse_bootset("lib/a 1").unwrap_err(), "lib/a 1");
        assert_eq!(parse_bootset("/a x").unwrap_err(), "/a x");
        assert_eq!(parse_bootset("/a 1 2").unwrap_err(), "/a 1 2");
    }

    #[test]
    fn qemu_args_mem_defaults() {
        let a = fx().guest().qemu_args(Path::new("/tmp/g"));
        let s = a.join(" ");
        assert!(s.starts_with("-accel tcg -machine pc -m 256 -nodefaults"));
        assert!(s.contains("-kernel /fx/vmlinuz -initrd /fx/initramfs.cpio.gz"));
        let i = a.iter().position(|x| x == "-append").unwrap();
        assert_eq!(a[i + 1], "console=ttyS0 strata.mode=mem panic=-1");
        assert!(s.contains(
            "-chardev socket,id=con0,path=/tmp/g/console.sock,server=on,wait=on -serial chardev:con0"
        ));
        assert!(s.contains("-no-reboot"));
        assert!(!s.contains("-qmp"));
        assert!(!s.contains("-incoming"));
    }

    #[test]
    fn qemu_args_root_with_options() {
        let b = fx()
            .guest()
            .machine(Machine::Q35)
            .mode(GuestMode::Root)
            .memory_mib(512)
            .append("quiet")
            .drive_file(Path::new("/d/a,b.qcow2"), "qcow2")
            .drive_nbd_unix(Path::new("/s/nbd.sock"), "golden")
            .qmp(true)
            .no_reboot(false)
            .incoming("exec:cat /x")
            .arg("-S");
        assert!(!b.wait_ready);
        let a = b.qemu_args(Path::new("/tmp/g"));
        let s = a.join(" ");
        assert!(s.contains("-machine q35 -m 512"));
        assert!(s.contains("console=ttyS0 strata.mode=root panic=-1 quiet"));
        assert!(s.contains("-drive file=/d/a,,b.qcow2,if=virtio,format=qcow2"));
        assert!(s.contains("-drive file=nbd:unix:/s/nbd.sock:exportname=golden,if=virtio,format=raw"));
        assert!(s.contains("-qmp unix:/tmp/g/qmp.sock,server=on,wait=off"));
        assert!(!s.contains("-no-reboot"));
        assert!(s.ends_with("-incoming exec:cat /x -S"));
    }

    #[test]
    fn invalid_options_are_rejected_with_a_hint() {
        let e = fx().guest().memory_mib(8).validate().unwrap_err();
        assert!(e.to_string().contains("64..=16384"), "{e}");
        let e = fx().guest().append("a\"b").validate().unwrap_err();
        assert!(e.to_string().contains("remove it"), "{e}");
    }

    #[test]
    fn missing_fixture_names_the_fix() {
        let e = Fixtures::at(Path::new("/nonexistent/strata-fixtures")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("vmlinuz") && msg.contains("scripts/fixtures.sh"), "{msg}");
    }

    #[test]
    fn console_log_drops_oldest_and_tails() {
        let mut log = ConsoleLog::default();
        assert_eq!(log.tail(3), "(no console output)");
        for i in 0..CONSOLE_KEEP + 5 {
            log.push(format!("l{i}"));
        }
        assert_eq!(log.first, 5);
        assert_eq!(log.end(), CONSOLE_KEEP + 5);
        assert_eq!(
            log.tail(2),
            format!("l{}\nl{}", CONSOLE_KEEP + 3, CONSOLE_KEEP + 4)
        );
    }
}

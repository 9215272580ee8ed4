//! Test guests: the fixture files built by `scripts/fixtures.sh` and a harness that boots them
//! under `qemu-system-x86_64 -accel tcg`.
//!
//! Integration tests and the benchmarks (`strata-bench`) use this module to get a real guest
//! to talk to: [`Fixtures::ensure`] builds (or reuses) the kernel, initramfs and golden disk, and
//! [`GuestBuilder`] launches QEMU with the guest's serial console on a unix-socket chardev.
//! The harness holds the client end of that socket, so a test drives the in-guest agent
//! (`memwork` in `strata.mode=mem`, the golden disk's `/sbin/init` in `strata.mode=root`) with
//! one request line and one reply line, exactly as a person at the console would.
//!
//! Why it is shaped this way:
//! - The build lives in one shell script (cached by a stamp) so CI, developers and this
//!   module produce the same files; [`Fixtures::ensure`] only runs it and checks the outputs.
//! - The harness is split by concern: [`guest`] (QEMU process and options) and [`console`]
//!   (line log and the agents' reply rule); it talks to QEMU's monitor with the product's
//!   [`QmpClient`](crate::qmp::QmpClient). It is built only with the `testkit` feature, so
//!   the `strata` binary carries none of it.
//! - Errors carry what a person needs to fix the problem: the script's last output, QEMU's
//!   stderr and the last console lines of a guest that did not come up.

mod console;
mod guest;
pub mod records;

pub use console::{classify_reply, reply_field, reply_fields, unescape_reply, LineSplitter, Reply};
pub use guest::{Guest, GuestBuilder, GuestMode, Machine};

use std::collections::VecDeque;
use std::fs;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

const TARGET: &str = "strata::fixtures";

/// Marker the agents print when they accept commands.
pub const READY_MARKER: &str = "STRATA-READY";
/// Marker the golden disk's init prints before reading its boot working set.
pub const BOOT_START_MARKER: &str = "STRATA-BOOT-START";
/// Marker the initramfs prints (followed by a hint) when it cannot continue.
pub const ERROR_MARKER: &str = "STRATA-ERROR";
/// Marker the initramfs prints when memwork died (it is restarted with empty memory).
pub const AGENT_EXIT_MARKER: &str = "STRATA-AGENT-EXIT";

/// Files every fixture directory holds after a successful build.
const OUTPUTS: [&str; 8] = [
    "vmlinuz",
    "vmlinux",
    "initramfs.cpio.gz",
    "memwork",
    "recwriter",
    "golden.img",
    "bootset.txt",
    "manifest.txt",
];

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
    Tool { tool: &'static str, status: String, stderr: String },
    #[error("Invalid guest option: {0}")]
    InvalidOption(String),
    #[error("QEMU exited ({status}) while {during}; QEMU said:\n{stderr}\nlast console lines:\n{console}")]
    Exited { status: String, during: String, stderr: String, console: String },
    #[error("Timed out after {waited:?} waiting for {what}; last console lines:\n{console}")]
    Timeout { what: String, waited: Duration, console: String },
    #[error("Guest reported an error for {what}: {message}")]
    GuestError { what: String, message: String },
    #[error("Guest agent rejected `{command}`: {message}")]
    Agent { command: String, message: String },
    #[error("Console of the guest is closed")]
    ConsoleClosed,
    #[error("QMP failed")]
    Qmp(#[from] crate::qmp::QmpError),
}

type Result<T> = std::result::Result<T, FixtureError>;

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FixtureError + 'a {
    move |source| FixtureError::Io { op, path: path.to_path_buf(), source }
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
            .map_err(|source| FixtureError::Spawn { program: "bash".into(), source })?;
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
        let status = child
            .wait()
            .map_err(|source| FixtureError::Spawn { program: "bash".into(), source })?;
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
                return Err(FixtureError::Missing { name, dir: dir.to_path_buf() });
            }
        }
        Ok(Fixtures { dir: dir.to_path_buf() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Debian's kernel image (bzImage; its xz decompression costs ~4 s per boot under TCG).
    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }
    /// The same kernel uncompressed, an ELF that QEMU boots through its PVH entry (the default).
    pub fn vmlinux(&self) -> PathBuf {
        self.dir.join("vmlinux")
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
    /// The disk record writer binary (also inside the initramfs; see [`records`]).
    pub fn recwriter(&self) -> PathBuf {
        self.dir.join("recwriter")
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
        .map_err(|source| FixtureError::Spawn { program: "qemu-img".into(), source })?;
    if !out.status.success() {
        return Err(FixtureError::Tool {
            tool: "qemu-img create",
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootset_parses_and_rejects_garbage() {
        let v = parse_bootset("/lib/a.so 10\n\n/usr/b 2\n").unwrap();
        assert_eq!(v, vec![("/lib/a.so".into(), 10), ("/usr/b".into(), 2)]);
        assert_eq!(parse_bootset("lib/a 1").unwrap_err(), "lib/a 1");
        assert_eq!(parse_bootset("/a x").unwrap_err(), "/a x");
        assert_eq!(parse_bootset("/a 1 2").unwrap_err(), "/a 1 2");
    }

    #[test]
    fn missing_fixture_names_the_fix() {
        let e = Fixtures::at(Path::new("/nonexistent/strata-fixtures")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("vmlinuz") && msg.contains("scripts/fixtures.sh"), "{msg}");
    }
}

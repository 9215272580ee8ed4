//! `vm restore NAME --launch`: start a QEMU with the command line recorded at save time, plus
//! `-incoming defer -S` and a QMP socket of strata's own, restore into it, then resume (unless
//! `RestoreOptions::resume` is off).
//!
//! The recorded command line comes from `/proc/PID/cmdline` of the source (read over the QMP
//! socket's peer credentials), so it is exactly what the operator ran. [`launch_args`] is a
//! pure rewrite of it, unit-tested, because a few options cannot be replayed as they were:
//! * `-incoming`, `-S`, `-loadvm`: replaced by `-incoming defer -S`;
//! * `-qmp`, `-qmp-pretty`: the source's monitor socket may still be in use (a saved VM stays
//!   paused), so strata adds its own at a path it chooses;
//! * `-daemonize`, `-pidfile`: strata keeps the child's pid and log itself;
//! * socket chardevs with `server` and `wait=on` (QEMU's default for servers) would block QEMU
//!   until someone connects; they get `wait=off`.
//!
//! Everything else (machine, memory, devices, disks) is kept: a restore into a different
//! machine would fail in QEMU, and `restore::check_target` says so before streaming.
#![allow(clippy::result_large_err)] // a MemError is returned once per save or restore

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::error::MemError;
use super::restore::{load_checkpoint, restore, RestoreOptions, RestoreReport};
use crate::progress::Progress;
use crate::qmp::{QmpClient, QmpError};
use crate::store::Store;

const TARGET: &str = "strata::memory";

/// Options dropped together with their value.
const DROP_WITH_VALUE: [&str; 5] = ["incoming", "qmp", "qmp-pretty", "pidfile", "loadvm"];
/// Options dropped alone.
const DROP_FLAG: [&str; 2] = ["S", "daemonize"];
/// Options whose value may describe a listening socket chardev.
const CHARDEV_OPTS: [&str; 4] = ["chardev", "serial", "monitor", "parallel"];

/// Why a recorded command line cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdlineError {
    #[error("The recorded command line is empty")]
    Empty,
    #[error("The recorded program name is empty")]
    EmptyProgram,
    #[error("Option {option} has no value")]
    MissingValue { option: String },
}

fn opt_name(a: &str) -> Option<&str> {
    a.strip_prefix("--").or_else(|| a.strip_prefix('-')).filter(|n| !n.is_empty())
}

/// `server=on` sockets without `wait=off` block QEMU's start; make them not wait.
fn no_wait(value: &str) -> String {
    let parts: Vec<&str> = value.split(',').collect();
    let server =
        parts.iter().any(|p| matches!(*p, "server" | "server=on" | "server=yes" | "server=true"));
    if !server {
        return value.to_string();
    }
    let mut kept: Vec<&str> =
        parts.into_iter().filter(|p| !(p.starts_with("wait") || *p == "nowait")).collect();
    kept.push("wait=off");
    kept.join(",")
}

/// Rewrite a recorded QEMU command line for a restore: (program, arguments).
pub fn launch_args(
    cmdline: &[String],
    qmp_path: &Path,
) -> Result<(String, Vec<String>), CmdlineError> {
    let program = cmdline.first().ok_or(CmdlineError::Empty)?.clone();
    if program.is_empty() {
        return Err(CmdlineError::EmptyProgram);
    }
    let mut out = Vec::with_capacity(cmdline.len() + 6);
    let mut i = 1;
    while i < cmdline.len() {
        let a = &cmdline[i];
        match opt_name(a) {
            Some(n) if DROP_WITH_VALUE.contains(&n) => {
                if i + 1 >= cmdline.len() {
                    return Err(CmdlineError::MissingValue { option: a.clone() });
                }
                i += 2;
                continue;
            }
            Some(n) if DROP_FLAG.contains(&n) => {
                i += 1;
                continue;
            }
            Some(n) if CHARDEV_OPTS.contains(&n) && i + 1 < cmdline.len() => {
                out.push(a.clone());
                out.push(no_wait(&cmdline[i + 1]));
                i += 2;
                continue;
            }
            _ => out.push(a.clone()),
        }
        i += 1;
    }
    out.push("-qmp".into());
    out.push(format!("unix:{},server=on,wait=off", qmp_path.display()));
    out.extend(["-incoming", "defer", "-S"].iter().map(|s| s.to_string()));
    Ok((program, out))
}

/// Where the launched QEMU's socket and log go.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub run_dir: PathBuf,
    /// Use this QEMU binary instead of the recorded one.
    pub program: Option<String>,
    /// How long QEMU may take to open its QMP socket.
    pub start_timeout: Duration,
    pub restore: RestoreOptions,
    /// Launch this command line instead of the recorded one (a desktop snapshot's, with its
    /// disks pointed at their clones: `disks::rewrite_cmdline`).
    pub cmdline: Option<Vec<String>>,
}

impl LaunchOptions {
    pub fn new(run_dir: PathBuf) -> LaunchOptions {
        LaunchOptions {
            run_dir,
            program: None,
            start_timeout: Duration::from_secs(30),
            restore: RestoreOptions::default(),
            cmdline: None,
        }
    }
}

/// A QEMU started and restored by strata; it keeps running after strata exits.
#[derive(Debug)]
pub struct Launched {
    pub child: Child,
    pub qmp_path: PathBuf,
    pub log_path: PathBuf,
    pub program: String,
    pub args: Vec<String>,
    pub report: RestoreReport,
}

fn log_tail(p: &Path) -> String {
    let s = fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// Start QEMU from checkpoint `name`'s recorded command line and restore it.
pub fn restore_launch(
    store: &Store,
    name: &str,
    opts: &LaunchOptions,
    progress: &dyn Progress,
) -> Result<Launched, MemError> {
    let ckpt = load_checkpoint(store, name)?;
    if ckpt.manifest.qemu.cmdline.is_empty() {
        return Err(MemError::NoCmdline { name: name.into() });
    }
    fs::create_dir_all(&opts.run_dir).map_err(|source| MemError::Io {
        op: "create run dir",
        path: opts.run_dir.clone(),
        source,
    })?;
    let safe = name.replace('/', "_");
    let qmp_path = opts.run_dir.join(format!("{safe}.qmp"));
    let log_path = opts.run_dir.join(format!("{safe}.log"));
    if qmp_path.exists() && QmpClient::connect_timeout(&qmp_path, Duration::from_secs(1)).is_ok() {
        return Err(MemError::Launch {
            name: name.into(),
            why: format!(
                "a QEMU already answers on {}; stop it or use --run-dir",
                qmp_path.display()
            ),
        });
    }
    let _ = fs::remove_file(&qmp_path);
    let cmdline = opts.cmdline.as_ref().unwrap_or(&ckpt.manifest.qemu.cmdline);
    let (recorded, args) = launch_args(cmdline, &qmp_path)
        .map_err(|e| MemError::Launch { name: name.into(), why: e.to_string() })?;
    let program = opts.program.clone().unwrap_or(recorded);
    let log = fs::File::create(&log_path).map_err(|source| MemError::Io {
        op: "create log",
        path: log_path.clone(),
        source,
    })?;
    let log2 = log.try_clone().map_err(|source| MemError::Io {
        op: "create log",
        path: log_path.clone(),
        source,
    })?;
    tracing::info!(target: TARGET, name, %program, ?args, "launching QEMU");
    let mut child = Command::new(&program)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        // Its own process group: a Ctrl-C meant for strata must not kill the restored VM.
        .process_group(0)
        .spawn()
        .map_err(|e| MemError::Launch {
            name: name.into(),
            why: format!("cannot run {program}: {e}"),
        })?;
    let t0 = Instant::now();
    let fail = |child: &mut Child, why: String| {
        let _ = child.kill();
        let _ = child.wait();
        MemError::Launch { name: name.into(), why }
    };
    let mut qmp = loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(MemError::Launch {
                name: name.into(),
                why: format!("QEMU exited ({st}) at start: {}", log_tail(&log_path)),
            });
        }
        match QmpClient::connect_timeout(&qmp_path, Duration::from_secs(10)) {
            Ok(c) => break c,
            Err(QmpError::NoSocket { .. } | QmpError::Refused { .. })
                if t0.elapsed() < opts.start_timeout =>
            {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => {
                return Err(fail(
                    &mut child,
                    format!("no QMP socket: {e}; log: {}", log_tail(&log_path)),
                ))
            }
        }
    };
    match restore(store, name, &mut qmp, &opts.restore, progress) {
        Ok(report) => Ok(Launched { child, qmp_path, log_path, program, args, report }),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn rewrites_what_cannot_be_replayed() {
        let rec = v(&[
            "/usr/bin/qemu-system-x86_64",
            "-accel",
            "tcg",
            "-m",
            "256",
            "-qmp",
            "unix:/old.qmp,server=on,wait=off",
            "-S",
            "--daemonize",
            "-pidfile",
            "/run/x.pid",
            "-incoming",
            "unix:/x",
            "-chardev",
            "socket,id=con0,path=/c.sock,server=on,wait=on",
            "-serial",
            "chardev:con0",
            "-chardev",
            "socket,id=c1,path=/d.sock",
            "-serial",
            "unix:/e.sock,server",
            "-drive",
            "file=/disk.img,if=virtio",
        ]);
        let (prog, args) = launch_args(&rec, Path::new("/run/strata/vm.qmp")).unwrap();
        assert_eq!(prog, "/usr/bin/qemu-system-x86_64");
        assert_eq!(
            args,
            v(&[
                "-accel",
                "tcg",
                "-m",
                "256",
                "-chardev",
                "socket,id=con0,path=/c.sock,server=on,wait=off",
                "-serial",
                "chardev:con0",
                "-chardev",
                "socket,id=c1,path=/d.sock",
                "-serial",
                "unix:/e.sock,server,wait=off",
                "-drive",
                "file=/disk.img,if=virtio",
                "-qmp",
                "unix:/run/strata/vm.qmp,server=on,wait=off",
                "-incoming",
                "defer",
                "-S",
            ])
        );
        assert_eq!(launch_args(&[], Path::new("/q")), Err(CmdlineError::Empty));
        assert_eq!(
            launch_args(&v(&["qemu", "-qmp"]), Path::new("/q")),
            Err(CmdlineError::MissingValue { option: "-qmp".into() })
        );
    }
}

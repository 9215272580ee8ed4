//! Disk benchmarks: `strata-bench clone` (and, with the NBD server, sync and io).
//!
//! Clone: a sparse image of `size` bytes holding `data` bytes is imported once;
//! then N full clones are made with strata (a new ref to the same block map), with
//! `cp --sparse=always` of the raw file, and with `qemu-img convert -O qcow2`. Each method's N
//! copies are timed together, including a final sync, and removed before the next N.

use crate::chart::{bars, Series};
use anyhow::{ensure, Context, Result};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use strata::disk;
use strata::progress::NoProgress;
use strata::store::{InitOptions, Store};
use strata::Codec;

/// Fill `data` bytes of a sparse `size`-byte file: 1 MiB runs spread evenly, half-compressible.
pub(crate) fn make_image(path: &Path, size: u64, data: u64) -> Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.set_len(size)?;
    let runs = (data >> 20).max(1);
    let stride = (size / runs) & !((1 << 20) - 1);
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut buf = vec![0u8; 1 << 20];
    for r in 0..runs {
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x & 0x0f) as u8;
        }
        f.seek(SeekFrom::Start(r * stride))?;
        f.write_all(&buf)?;
    }
    f.sync_all()?;
    Ok(())
}

fn sync_all() {
    let _ = Command::new("sync").status();
}

fn run(cmd: &mut Command) -> Result<()> {
    let o = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(o.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    Ok(())
}

#[derive(serde::Serialize)]
struct Row {
    copies: usize,
    strata_s: f64,
    cp_sparse_s: f64,
    qemu_img_convert_s: f64,
    cp_over_strata: f64,
    qemu_img_over_strata: f64,
}

pub fn bench_clone(
    size: u64,
    data: u64,
    copies: &[usize],
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
    let tmp = match scratch {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir())?,
    };
    let img = tmp.path().join("golden.raw");
    eprintln!(
        "bench clone: {} GiB image with {} GiB of data in {}",
        size >> 30,
        data >> 30,
        tmp.path().display()
    );
    make_image(&img, size, data)?;
    let store = Store::init_local(
        &tmp.path().join("store"),
        InitOptions { pack_size: 64 << 20, default_codec: Codec::Lz4 },
    )?;
    let t = Instant::now();
    disk::import(&store, "golden", &img, Codec::Lz4, &NoProgress)?;
    let import_s = t.elapsed().as_secs_f64();
    eprintln!("  import (one-time): {import_s:.1} s");

    let mut rows = Vec::new();
    for &n in copies {
        let t = Instant::now();
        for i in 0..n {
            disk::clone(&store, "golden", &format!("c{n}-{i}"), true)?;
        }
        let strata_s = t.elapsed().as_secs_f64();
        for i in 0..n {
            disk::remove(&store, &format!("c{n}-{i}"))?;
        }

        let t = Instant::now();
        for i in 0..n {
            run(Command::new("cp")
                .arg("--sparse=always")
                .arg(&img)
                .arg(tmp.path().join(format!("cp{i}.raw"))))?;
        }
        sync_all();
        let cp_s = t.elapsed().as_secs_f64();
        for i in 0..n {
            std::fs::remove_file(tmp.path().join(format!("cp{i}.raw")))?;
        }

        let t = Instant::now();
        for i in 0..n {
            run(Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "qcow2"])
                .arg(&img)
                .arg(tmp.path().join(format!("q{i}.qcow2"))))?;
        }
        sync_all();
        let q_s = t.elapsed().as_secs_f64();
        for i in 0..n {
            std::fs::remove_file(tmp.path().join(format!("q{i}.qcow2")))?;
        }
        let row = Row {
            copies: n,
            strata_s,
            cp_sparse_s: cp_s,
            qemu_img_convert_s: q_s,
            cp_over_strata: cp_s / strata_s,
            qemu_img_over_strata: q_s / strata_s,
        };
        eprintln!(
            "  {n:>2} copies: strata {:.4} s, cp --sparse {:.1} s ({:.0}x), qemu-img convert {:.1} s ({:.0}x)",
            strata_s, cp_s, row.cp_over_strata, q_s, row.qemu_img_over_strata
        );
        rows.push(row);
    }
    std::fs::create_dir_all(out)?;
    let mut csv = String::from(
        "copies,strata_s,cp_sparse_s,qemu_img_convert_s,cp_over_strata,qemu_img_over_strata\n",
    );
    for r in &rows {
        csv += &format!(
            "{},{:.5},{:.3},{:.3},{:.1},{:.1}\n",
            r.copies,
            r.strata_s,
            r.cp_sparse_s,
            r.qemu_img_convert_s,
            r.cp_over_strata,
            r.qemu_img_over_strata
        );
    }
    std::fs::write(out.join("bench-clone.csv"), csv)?;
    let meta = serde_json::json!({
        "benchmark": "clone",
        "command": format!("strata-bench clone --size {}G --data {}G --copies {}", size >> 30, data >> 30,
            copies.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")),
        "image": {"virtual_bytes": size, "data_bytes": data, "strata_import_s": import_s},
        "env": crate::results::env_json(),
        "rows": rows,
    });
    std::fs::write(out.join("bench-clone.json"), serde_json::to_string_pretty(&meta)?)?;
    let cats: Vec<String> = rows.iter().map(|r| format!("{} copies", r.copies)).collect();
    let svg = bars(
        &format!(
            "Full clones of a {} GiB image holding {} GiB (seconds, lower is better)",
            size >> 30,
            data >> 30
        ),
        "seconds",
        &cats,
        &[
            Series {
                name: "strata clone --full".into(),
                values: rows.iter().map(|r| r.strata_s).collect(),
            },
            Series {
                name: "cp --sparse=always".into(),
                values: rows.iter().map(|r| r.cp_sparse_s).collect(),
            },
            Series {
                name: "qemu-img convert -O qcow2".into(),
                values: rows.iter().map(|r| r.qemu_img_convert_s).collect(),
            },
        ],
    );
    std::fs::write(out.join("bench-clone.svg"), svg)?;
    eprintln!("wrote {}/bench-clone.{{csv,json,svg}}", out.display());
    Ok(())
}

/// Fail early with advice when a peer tool is missing.
pub fn ensure_tool(name: &str) -> Result<()> {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    ensure!(ok, "{name} is not installed: run scripts/setup.sh");
    Ok(())
}

/// An NBD server process for benchmarks: `strata serve` or `qemu-nbd`, under strace.
pub struct Server {
    child: std::process::Child,
    uri: String,
    trace: std::path::PathBuf,
    strata: bool,
    stderr: std::path::PathBuf,
}

/// Whether servers run under strace (sync counting). ptrace stops cost every syscall dearly,
/// so throughput benchmarks turn it off.
static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

pub fn set_tracing(on: bool) {
    TRACE.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn traced(trace: &Path, program: &str) -> Command {
    if TRACE.load(std::sync::atomic::Ordering::Relaxed) {
        let mut c = Command::new("strace");
        c.args(["-f", "-qq", "-e", "trace=fsync,fdatasync,sync_file_range,syncfs,msync", "-o"])
            .arg(trace)
            .arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn wait_socket(sock: &Path) -> Result<()> {
    let t = Instant::now();
    while !sock.exists() {
        ensure!(t.elapsed().as_secs() < 30, "server socket {} did not appear", sock.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// The `strata` binary that serves disks: `$STRATA_BIN`, else `strata` next to this
/// executable (cargo builds both into the same target directory).
pub fn strata_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("STRATA_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("strata");
    anyhow::ensure!(
        bin.is_file(),
        "No strata binary at {} (build it with `cargo build --release -p strata-cli`, or set \
         STRATA_BIN)",
        bin.display()
    );
    Ok(bin)
}

impl Server {
    /// A fresh store with one disk `name` (optionally a clone of a golden disk whose blocks
    /// hold data), served by `strata serve` under strace.
    pub fn strata_disk(dir: &Path, name: &str, size: u64, clone: bool) -> Result<Server> {
        let st = dir.join(format!("store-{name}"));
        let _ = std::fs::remove_dir_all(&st);
        let store = Store::init_local(&st, InitOptions::default())?;
        if clone {
            let raw = dir.join("golden.raw");
            disk::import(&store, "golden", &raw, Codec::Lz4, &NoProgress)?;
            disk::snapshot(&store, "golden", "base")?;
            disk::clone(&store, "golden@base", name, false)?;
        } else {
            disk::create(&store, name, size)?;
        }
        drop(store);
        Server::spawn_strata(dir, name, &st)
    }

    fn spawn_strata(dir: &Path, name: &str, st: &Path) -> Result<Server> {
        let exe = strata_binary()?.display().to_string();
        let sock = dir.join(format!("{name}.sock"));
        let _ = std::fs::remove_file(&sock);
        let trace = dir.join(format!("{name}.strace"));
        let stderr = dir.join(format!("{name}.stderr"));
        let child = traced(&trace, &exe)
            .arg("--store")
            .arg(st)
            .args(["serve", "--socket"])
            .arg(&sock)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&stderr)?)
            .spawn()?;
        wait_socket(&sock)?;
        Ok(Server {
            child,
            uri: format!("nbd+unix:///{name}?socket={}", sock.display()),
            trace,
            strata: true,
            stderr,
        })
    }

    /// Serve an existing store made by `strata_disk` again.
    pub fn strata_existing(dir: &Path, name: &str) -> Result<Server> {
        Server::spawn_strata(dir, name, &dir.join(format!("store-{name}")))
    }

    pub fn qemu_nbd(dir: &Path, file: &Path, fmt: &str) -> Result<Server> {
        let stem = file.file_name().unwrap().to_string_lossy().into_owned();
        let sock = dir.join(format!("{stem}.sock"));
        let _ = std::fs::remove_file(&sock);
        let trace = dir.join(format!("{stem}.strace"));
        let stderr = dir.join(format!("{stem}.stderr"));
        let child = traced(&trace, "qemu-nbd")
            .args(["-f", fmt, "--cache=writeback", "--aio=threads", "-t", "-x", "x", "-k"])
            .arg(&sock)
            .arg(file)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&stderr)?)
            .spawn()?;
        wait_socket(&sock)?;
        Ok(Server {
            child,
            uri: format!("nbd+unix:///x?socket={}", sock.display()),
            trace,
            strata: false,
            stderr,
        })
    }

    pub fn uri(&self) -> String {
        self.uri.clone()
    }

    /// Sync-family system calls traced so far.
    pub fn sync_calls(&self) -> Result<usize> {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let t = std::fs::read_to_string(&self.trace).unwrap_or_default();
        Ok(t.lines()
            .filter(|l| {
                !l.contains("resumed>") && (l.contains("sync(") || l.contains("sync_file_range("))
            })
            .count())
    }

    /// Stop the server; for strata, return its own fdatasync counter for the disk.
    pub fn stop(&mut self) -> Result<Option<u64>> {
        Ok(self.stop_stats()?.and_then(|d| d["fdatasyncs"].as_u64()))
    }

    /// Stop the server; for strata, return the disk's I/O counters (after its final compaction).
    pub fn stop_stats(&mut self) -> Result<Option<serde_json::Value>> {
        // Signal the server itself (strace's child when traced), so it shuts down cleanly and
        // prints its counters; strace exits when it does.
        let tracer = self.child.id();
        let kids = if TRACE.load(std::sync::atomic::Ordering::Relaxed) {
            std::fs::read_to_string(format!("/proc/{tracer}/task/{tracer}/children"))
                .unwrap_or_default()
        } else {
            tracer.to_string()
        };
        for pid in kids.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            // SAFETY: signalling a process we started (through strace).
            unsafe { libc::kill(pid, libc::SIGINT) };
        }
        let t = Instant::now();
        loop {
            if self.child.try_wait()?.is_some() {
                break;
            }
            if t.elapsed().as_secs() > 60 {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if !self.strata {
            return Ok(None);
        }
        let err = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let stats = err
            .lines()
            .find_map(|l| l.strip_prefix("strata serve: stats "))
            .and_then(|j| serde_json::from_str::<serde_json::Value>(j).ok());
        Ok(stats.and_then(|v| v.as_object().and_then(|o| o.values().next().cloned())))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

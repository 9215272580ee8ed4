//! `strata-bench multifd`: would QEMU's multifd make `vm save` cheaper?
//!
//! With multifd, QEMU's channel threads send pages from guest RAM with iovecs, while the
//! single-channel path copies every page into its stream buffer, so multifd could take CPU
//! off QEMU's side of a save on these 2-core hosts. This benchmark measures the QEMU side
//! alone, with no strata receiver for multifd: the same stopped desktop guest migrated, in one
//! run, into
//! * `exec:cat > file` + `sync` (the baseline of `strata-bench save-restore`),
//! * `strata vm save` into a fresh local store (single channel),
//! * a unix socket drained by one reader thread (single channel, no storing),
//! * multifd with N channels, every connection drained by its own reader thread,
//!
//! and reports wall time (`migrate` to `completed`, plus `sync` for cat) and the CPU time QEMU
//! used (utime + stime of the process, all threads; the guest is stopped, so its vCPU does
//! not run) and the readers used. A drained socket is the cheapest receiver possible, so if
//! QEMU does not get cheaper there, no multifd receiver in strata can make a save faster.
//! Results: `bench-save-restore-multifd.{csv,json,svg}`.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use strata::fixtures::Fixtures;
use strata::memory::manifest::Mode;
use strata::memory::save::{save, SaveOptions};
use strata::progress::NoProgress;
use strata::qmp::{MigrateParameters, QmpClient};
use strata::store::{InitOptions, Store};

use crate::chart::{bars, stack, Series};
use crate::guest::{desktop_guest, machine, qemu_save, scratch_dir};
use crate::mem::file_len;
use crate::results::{env_json, write_outputs};

/// CPU seconds (user + system, all threads) of process `pid`.
fn process_cpu(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("bad /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks as f64 / hz)
}

fn thread_cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    rep: u32,
    method: String,
    wall_s: f64,
    qemu_cpu_s: f64,
    /// CPU of the receiving side: reader threads, or strata's parse thread + pool.
    rx_cpu_s: f64,
    bytes: u64,
}

/// Migrate the stopped guest into a unix socket whose connections (1, or 1 + `channels` with
/// multifd) are drained by one thread each; returns (wall s, reader CPU s, bytes).
fn drained(q: &mut QmpClient, dir: &Path, channels: u32) -> Result<(f64, f64, u64)> {
    q.migrate_set_capabilities(&[("multifd", channels > 0)])?;
    if channels > 0 {
        q.migrate_set_parameters(&MigrateParameters {
            multifd_channels: Some(channels),
            ..Default::default()
        })?;
    }
    let sock = dir.join("drain.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock)?;
    let conns = 1 + channels as usize;
    q.stop()?;
    let t = Instant::now();
    let (wall, cpu, bytes) = std::thread::scope(|s| -> Result<(f64, f64, u64)> {
        let acceptor = s.spawn(move || -> Result<(f64, u64)> {
            let readers: Vec<_> = (0..conns)
                .map(|_| {
                    let (mut c, _) = listener.accept()?;
                    Ok(std::thread::spawn(move || -> (f64, u64) {
                        let mut buf = vec![0u8; 1 << 20];
                        let mut n = 0u64;
                        while let Ok(k) = c.read(&mut buf) {
                            if k == 0 {
                                break;
                            }
                            n += k as u64;
                        }
                        (thread_cpu(), n)
                    }))
                })
                .collect::<std::io::Result<Vec<_>>>()?;
            let mut cpu = 0.0;
            let mut bytes = 0;
            for r in readers {
                let (c, n) = r.join().map_err(|_| anyhow::anyhow!("reader panicked"))?;
                cpu += c;
                bytes += n;
            }
            Ok((cpu, bytes))
        });
        let sent = q
            .migrate(&format!("unix:{}", sock.display()))
            .and_then(|_| q.wait_migration(Duration::from_secs(600), Duration::from_millis(5)));
        if sent.is_err() {
            // Unblock the acceptor: QEMU will not connect (any more).
            for _ in 0..conns {
                let _ = std::os::unix::net::UnixStream::connect(&sock);
            }
        }
        let wall = t.elapsed().as_secs_f64();
        let joined = acceptor.join().map_err(|_| anyhow::anyhow!("acceptor panicked"));
        sent.context("migrate into the drained socket")?;
        let (cpu, bytes) = joined??;
        Ok((wall, cpu, bytes))
    })?;
    q.cont()?;
    q.migrate_set_capabilities(&[("multifd", false)])?;
    Ok((wall, cpu, bytes))
}

pub fn bench_multifd(
    mem: u32,
    mach: &str,
    channels: &[u32],
    reps: u32,
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
    let m = machine(mach)?;
    let tmp = scratch_dir(scratch)?;
    let dir = tmp.path();
    let fx = Fixtures::ensure()?;
    eprintln!("bench multifd: {mem} MiB guest ({mach}), channels {channels:?}, {reps} rounds");
    let (g, w, mut q) = desktop_guest(&fx, mem, m, "mfd")?;
    let pid = q.peer_pid().context("QEMU's pid (QMP peer credentials)")?;
    let mut rows: Vec<Row> = Vec::new();
    for rep in 0..reps.max(1) {
        // exec:cat + sync
        let c0 = process_cpu(pid)?;
        let cat = dir.join("cat.bin");
        let s = qemu_save(&mut q, &format!("exec:cat > {}", cat.display()), true)?;
        let bytes = file_len(&cat);
        std::fs::remove_file(&cat).ok();
        rows.push(Row {
            rep,
            method: "exec:cat+sync".into(),
            wall_s: s,
            qemu_cpu_s: process_cpu(pid)? - c0,
            rx_cpu_s: 0.0,
            bytes,
        });
        // strata vm save (single channel), fresh store every round
        let sdir = dir.join("store");
        let _ = std::fs::remove_dir_all(&sdir);
        let store = Store::init_local(&sdir, InitOptions::default())?;
        let c0 = process_cpu(pid)?;
        let r = save(&store, &mut q, "bench", &SaveOptions::new(Mode::Save), &NoProgress)?;
        let qcpu = process_cpu(pid)? - c0;
        q.cont()?;
        rows.push(Row {
            rep,
            method: "strata vm save".into(),
            wall_s: r.total_ms / 1e3,
            qemu_cpu_s: qcpu,
            rx_cpu_s: (r.stages.parse_cpu_ms + r.stages.pool_cpu_ms) / 1e3,
            bytes: r.stream_bytes,
        });
        drop(store);
        // drained sockets
        for &n in std::iter::once(&0).chain(channels) {
            let c0 = process_cpu(pid)?;
            let (wall, cpu, bytes) = drained(&mut q, dir, n)?;
            rows.push(Row {
                rep,
                method: if n == 0 {
                    "socket (drained)".into()
                } else {
                    format!("multifd {n} (drained)")
                },
                wall_s: wall,
                qemu_cpu_s: process_cpu(pid)? - c0,
                rx_cpu_s: cpu,
                bytes,
            });
        }
        for r in rows.iter().filter(|r| r.rep == rep) {
            eprintln!(
                "  round {rep}: {:<18} {:>6.3} s  QEMU CPU {:>5.2} s  receiver CPU {:>5.2} s  {} MB",
                r.method,
                r.wall_s,
                r.qemu_cpu_s,
                r.rx_cpu_s,
                r.bytes / 1_000_000
            );
        }
    }
    // Medians per method.
    let mut methods: Vec<String> = Vec::new();
    for r in &rows {
        if !methods.contains(&r.method) {
            methods.push(r.method.clone());
        }
    }
    let median = |m: &str, f: &dyn Fn(&Row) -> f64| {
        let mut v: Vec<f64> = rows.iter().filter(|r| r.method == m).map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let cat_wall = median("exec:cat+sync", &|r| r.wall_s);
    let sock_cpu = median("socket (drained)", &|r| r.qemu_cpu_s);
    let summary: Vec<serde_json::Value> = methods
        .iter()
        .map(|m| {
            let wall = median(m, &|r| r.wall_s);
            let qcpu = median(m, &|r| r.qemu_cpu_s);
            serde_json::json!({
                "method": m,
                "wall_s": wall,
                "qemu_cpu_s": qcpu,
                "rx_cpu_s": median(m, &|r| r.rx_cpu_s),
                "wall_vs_cat": wall / cat_wall,
                "qemu_cpu_vs_single_socket": qcpu / sock_cpu,
            })
        })
        .collect();
    eprintln!("  medians:");
    for s in &summary {
        eprintln!(
            "    {:<18} {:>6.3} s ({:.2}x cat+sync)  QEMU CPU {:>5.2} s ({:.2}x single socket)",
            s["method"].as_str().unwrap_or(""),
            s["wall_s"].as_f64().unwrap_or(0.0),
            s["wall_vs_cat"].as_f64().unwrap_or(0.0),
            s["qemu_cpu_s"].as_f64().unwrap_or(0.0),
            s["qemu_cpu_vs_single_socket"].as_f64().unwrap_or(0.0)
        );
    }
    let mut csv = String::from("rep,method,wall_s,qemu_cpu_s,rx_cpu_s,bytes\n");
    for r in &rows {
        csv += &format!(
            "{},{},{:.4},{:.3},{:.3},{}\n",
            r.rep, r.method, r.wall_s, r.qemu_cpu_s, r.rx_cpu_s, r.bytes
        );
    }
    let json = serde_json::json!({
        "benchmark": "multifd",
        "what": "one stopped guest migrated by QEMU into exec:cat+sync, strata vm save, a drained unix socket, and multifd with N channels drained; wall time and CPU of QEMU (all threads) and of the receiver",
        "mem_mib": mem,
        "machine": mach,
        "workload": w,
        "env": env_json(),
        "rows": rows,
        "medians": summary,
    });
    let cats: Vec<String> = methods.clone();
    let series = |name: &str, f: &dyn Fn(&Row) -> f64| Series {
        name: name.into(),
        values: methods.iter().map(|m| median(m, f)).collect(),
    };
    let svg = stack(vec![
        bars(
            &format!("{mem} MiB guest: wall time (median of {reps})"),
            "s",
            &cats,
            &[series("wall", &|r| r.wall_s)],
        ),
        bars(
            &format!("{mem} MiB guest: CPU time (median of {reps})"),
            "CPU s",
            &cats,
            &[series("QEMU", &|r| r.qemu_cpu_s), series("receiver", &|r| r.rx_cpu_s)],
        ),
    ]);
    drop(q);
    drop(g);
    write_outputs(out, "save-restore-multifd", csv, &json, svg)
}

//! `strata-bench sync`: host fdatasync calls per guest flush, and 64 KiB
//! append + flush throughput, for strata against qemu-nbd serving qcow2 (default and
//! lazy_refcounts) and raw, all driven by the same qemu-io workloads over NBD.
//!
//! Each server runs under `strace -f -e trace=fsync,fdatasync,sync_file_range,syncfs,msync`;
//! the calls made between the end of a warm-up connection and the end of the workload are
//! counted from the trace, so start-up costs are excluded. strata's own counter (printed by
//! `strata serve` on exit) is reported beside the strace figure.

use crate::chart::{bars, Series};
use crate::disk::{ensure_tool, Server};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

#[derive(serde::Serialize, Clone)]
struct Row {
    case: String,
    system: String,
    flushes: usize,
    host_syncs: usize,
    syncs_per_flush: f64,
    strata_counter: Option<u64>,
}

#[derive(serde::Serialize, Clone)]
struct Tput {
    system: String,
    ops: usize,
    seconds: f64,
    mib_s: f64,
}

/// qemu-io commands for a case: (name, commands, needs a backing image).
fn workload(case: &str, n: usize) -> Vec<String> {
    let mut c = Vec::new();
    match case {
        "allocating" => {
            for i in 0..n {
                c.push(format!("write -P {} {} 4k", i % 250 + 1, i as u64 * 65536 * 3));
                c.push("flush".into());
            }
        }
        "overwrite" => {
            for i in 0..n {
                c.push(format!("write -P {} 0 4k", i % 250 + 1));
                c.push("flush".into());
            }
        }
        "clone-4k" => {
            for i in 0..n {
                c.push(format!("write -P {} {} 4k", i % 250 + 1, i as u64 * 65536 + 8192));
                c.push("flush".into());
            }
        }
        "far-apart" => {
            for i in 0..n {
                c.push(format!("write -P {} {} 4k", i % 250 + 1, i as u64 * (1 << 30) + 4096));
                c.push("flush".into());
            }
        }
        _ => unreachable!(),
    }
    c
}

fn qemu_io(uri: &str, cmds: &[String]) -> Result<f64> {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", uri]);
    for c in cmds {
        cmd.arg("-c").arg(c);
    }
    let t = Instant::now();
    let o = cmd.output().context("running qemu-io")?;
    anyhow::ensure!(
        o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("failed"),
        "qemu-io failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(t.elapsed().as_secs_f64())
}

pub fn bench_sync(n: usize, guest_dd: bool, out: &Path, scratch: Option<&Path>) -> Result<()> {
    for t in ["qemu-io", "qemu-nbd", "qemu-img", "strace", "nbdinfo"] {
        ensure_tool(t)?;
    }
    let tmp = match scratch {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir())?,
    };
    let dir = tmp.path();
    let size = 40u64 << 30;
    // A "golden" base with data in every block the clone case touches.
    let golden = dir.join("golden.raw");
    {
        let f = std::fs::File::create(&golden)?;
        f.set_len(size)?;
        use std::os::unix::fs::FileExt;
        let blk = vec![0x5au8; 65536];
        for i in 0..n as u64 + 1 {
            f.write_all_at(&blk, i * 65536)?;
        }
    }
    let mut rows = Vec::new();
    let cases = ["allocating", "overwrite", "clone-4k", "far-apart"];
    for case in cases {
        let n_case = if case == "far-apart" { n.min(36) } else { n };
        let cmds = workload(case, n_case);
        let flushes = n_case;
        // Systems: strata, qemu-nbd qcow2, qcow2 lazy_refcounts, raw.
        for system in ["strata", "qcow2", "qcow2-lazy", "raw"] {
            if system == "raw" && case == "clone-4k" {
                continue; // raw files have no clones
            }
            let mut server = match system {
                "strata" => Server::strata_disk(dir, case, size, case == "clone-4k")
                    .with_context(|| format!("{case}/{system}"))?,
                "raw" => {
                    let f = dir.join(format!("{case}.raw"));
                    std::fs::File::create(&f)?.set_len(size)?;
                    Server::qemu_nbd(dir, &f, "raw")?
                }
                _ => {
                    let f = dir.join(format!("{case}-{system}.qcow2"));
                    let mut c = Command::new("qemu-img");
                    c.args(["create", "-q", "-f", "qcow2"]);
                    if system == "qcow2-lazy" {
                        c.args(["-o", "lazy_refcounts=on"]);
                    }
                    if case == "clone-4k" {
                        c.args(["-b"]).arg(&golden).args(["-F", "raw"]);
                    }
                    c.arg(&f).arg(size.to_string());
                    anyhow::ensure!(c.status()?.success(), "qemu-img create failed");
                    Server::qemu_nbd(dir, &f, "qcow2")?
                }
            };
            // Warm-up: one connection (opens the image, creates logs), then count from here.
            qemu_io(&server.uri(), &["read 0 4k".to_string()])?;
            let before = server.sync_calls()?;
            qemu_io(&server.uri(), &cmds)?;
            let after = server.sync_calls()?;
            let counter = server.stop()?;
            let host = after - before;
            let row = Row {
                case: case.into(),
                system: system.into(),
                flushes,
                host_syncs: host,
                syncs_per_flush: host as f64 / flushes as f64,
                strata_counter: counter,
            };
            eprintln!(
                "  {case:<10} {system:<10} {host:>5} host syncs / {flushes} flushes = {:.2}{}",
                row.syncs_per_flush,
                counter.map(|c| format!(" (strata counter: {c})")).unwrap_or_default()
            );
            rows.push(row);
        }
    }
    // Throughput: 64 KiB append + flush, 800 ops, with servers not under strace.
    crate::disk::set_tracing(false);
    let ops = 800;
    let cmds: Vec<String> = (0..ops)
        .flat_map(|i| [format!("write -P 7 {} 64k", i as u64 * 65536), "flush".to_string()])
        .collect();
    let mut tput = Vec::new();
    for round in 0..3 {
        for system in ["strata", "raw", "qcow2"] {
            let mut server = match system {
                "strata" => Server::strata_disk(dir, &format!("tput{round}"), size, false)?,
                "raw" => {
                    let f = dir.join(format!("tput{round}.raw"));
                    std::fs::File::create(&f)?.set_len(size)?;
                    Server::qemu_nbd(dir, &f, "raw")?
                }
                _ => {
                    let f = dir.join(format!("tput{round}.qcow2"));
                    anyhow::ensure!(Command::new("qemu-img")
                        .args(["create", "-q", "-f", "qcow2"])
                        .arg(&f)
                        .arg(size.to_string())
                        .status()?
                        .success());
                    Server::qemu_nbd(dir, &f, "qcow2")?
                }
            };
            qemu_io(&server.uri(), &["read 0 4k".to_string()])?;
            let secs = qemu_io(&server.uri(), &cmds)?;
            server.stop()?;
            let mib_s = ops as f64 * 64.0 / 1024.0 / secs;
            eprintln!("  append+flush 64k x{ops} round {round}: {system:<7} {mib_s:>7.1} MiB/s");
            tput.push(Tput { system: system.into(), ops, seconds: secs, mib_s });
        }
    }
    let best = |s: &str| tput.iter().filter(|t| t.system == s).map(|t| t.mib_s).fold(0.0, f64::max);
    let (st, raw, q) = (best("strata"), best("raw"), best("qcow2"));
    eprintln!(
        "  append+flush best of 3: strata/raw = {:.2}, strata/qcow2 = {:.2}",
        st / raw,
        st / q
    );
    let guest = if guest_dd { in_guest_dd(dir)? } else { Vec::new() };

    std::fs::create_dir_all(out)?;
    let mut csv = String::from("case,system,flushes,host_syncs,syncs_per_flush,strata_counter\n");
    for r in &rows {
        csv += &format!(
            "{},{},{},{},{:.3},{}\n",
            r.case,
            r.system,
            r.flushes,
            r.host_syncs,
            r.syncs_per_flush,
            r.strata_counter.map(|c| c.to_string()).unwrap_or_default()
        );
    }
    csv += "\nsystem,ops,seconds,mib_s\n";
    for t in &tput {
        csv += &format!("{},{},{:.3},{:.1}\n", t.system, t.ops, t.seconds, t.mib_s);
    }
    std::fs::write(out.join("bench-sync.csv"), csv)?;
    let meta = serde_json::json!({
        "benchmark": "sync",
        "command": format!("strata-bench sync --ops {n}"),
        "method": "qemu-io over NBD (nbd+unix); host sync calls counted with strace -f on the server between warm-up and end of workload",
        "env": crate::results::env_json(),
        "rows": rows,
        "append_flush_64k": {"runs": tput, "best_mib_s": {"strata": st, "raw": raw, "qcow2": q}, "strata_over_raw": st / raw, "strata_over_qcow2": st / q},
        "in_guest_dd": {
            "method": "TCG guest (golden disk on a local qcow2 overlay) with a second virtio disk served over NBD; GNU dd if=/dev/zero of=/dev/vdb bs=64k count=4096 oflag=dsync: first pass = append (fresh blocks), second pass = overwrite",
            "rows": guest,
        },
    });
    std::fs::write(out.join("bench-sync.json"), serde_json::to_string_pretty(&meta)?)?;
    let systems = ["strata", "qcow2", "qcow2-lazy", "raw"];
    let series: Vec<Series> = systems
        .iter()
        .map(|s| Series {
            name: s.to_string(),
            values: cases
                .iter()
                .map(|c| {
                    rows.iter()
                        .find(|r| r.case == *c && r.system == *s)
                        .map(|r| r.syncs_per_flush)
                        .unwrap_or(0.0)
                })
                .collect(),
        })
        .collect();
    let svg = bars(
        "Host syncs per guest flush (lower is better; 0 = not applicable)",
        "syncs per flush",
        &cases.map(String::from),
        &series,
    );
    std::fs::write(out.join("bench-sync.svg"), svg)?;
    eprintln!("wrote {}/bench-sync.{{csv,json,svg}}", out.display());
    Ok(())
}

#[derive(serde::Serialize, Clone)]
struct GuestRow {
    system: String,
    pass: String,
    seconds: f64,
    mb_s: f64,
}

/// 64 KiB O_DSYNC writes from inside a TCG guest onto a disk served over NBD (`dd` with
/// `oflag=dsync`): 256 MiB appended, then the same 256 MiB overwritten.
fn in_guest_dd(dir: &Path) -> Result<Vec<GuestRow>> {
    use std::time::Duration;
    use strata::fixtures::{create_overlay, Fixtures, GuestMode};
    let fx = Fixtures::ensure().context("guest fixtures (run scripts/setup.sh)")?;
    let mut rows = Vec::new();
    for system in ["strata", "raw", "qcow2"] {
        let data_size = 512u64 << 20;
        let mut server = match system {
            "strata" => Server::strata_disk(dir, "dd", data_size, false)?,
            "raw" => {
                let f = dir.join("dd.raw");
                std::fs::File::create(&f)?.set_len(data_size)?;
                Server::qemu_nbd(dir, &f, "raw")?
            }
            _ => {
                let f = dir.join("dd.qcow2");
                anyhow::ensure!(Command::new("qemu-img")
                    .args(["create", "-q", "-f", "qcow2"])
                    .arg(&f)
                    .arg(data_size.to_string())
                    .status()?
                    .success());
                Server::qemu_nbd(dir, &f, "qcow2")?
            }
        };
        let overlay = dir.join(format!("root-{system}.qcow2"));
        let _ = std::fs::remove_file(&overlay);
        create_overlay(&fx.golden(), "raw", &overlay)?;
        let uri = server.uri();
        let (sock, export) = {
            let q = uri.split_once("?socket=").context("uri")?;
            (q.1.to_string(), q.0.trim_start_matches("nbd+unix:///").to_string())
        };
        let mut g = fx
            .guest()
            .mode(GuestMode::Root)
            .memory_mib(512)
            .drive_file(&overlay, "qcow2")
            .drive(&format!(
                "file=nbd:unix:{sock}:exportname={export},if=virtio,format=raw,cache=none"
            ))
            .name(&format!("dd-{system}"))
            .launch()
            .context("boot the dd guest")?;
        for pass in ["append", "overwrite"] {
            let t = Instant::now();
            let out = g.command(
                "sh /bin/dd if=/dev/zero of=/dev/vdb bs=64k count=4096 oflag=dsync 2>&1",
                Duration::from_secs(1800),
            )?;
            let secs = t.elapsed().as_secs_f64();
            anyhow::ensure!(out.contains("268435456 bytes"), "dd in the guest failed: {out}");
            let mb_s = 268.435456 / secs;
            eprintln!("  in-guest dd 64k oflag=dsync 256 MiB {pass:<9} {system:<7} {secs:>6.1} s {mb_s:>6.1} MB/s");
            rows.push(GuestRow { system: system.into(), pass: pass.into(), seconds: secs, mb_s });
        }
        g.kill()?;
        server.stop()?;
    }
    Ok(rows)
}

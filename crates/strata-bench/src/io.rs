//! `strata-bench io` (local): fio's nbd engine against strata, and
//! against qemu-nbd serving raw and qcow2, in the same run. 4 KiB random read/write IOPS
//! (iodepth 16) and 1 MiB sequential read/write MB/s over a 1 GiB region; three rounds with
//! the systems taking turns per test, medians reported.
//!
//! strata is measured in the state a long-lived disk is in: the region is written through
//! NBD, the server is stopped (which folds the write log into chunks) and restarted, so reads
//! come from verified chunks; the write tests then go to the log, and compactions fold it in
//! the background. Every system gets the same fill, restart and fio jobs, and nothing is
//! dropped from the page cache: reads are warm for all three (raw and qcow2 from the image
//! file's pages, strata from its packs' pages, verified per 4 KiB piece).
//!
//! The run also times 1 GiB written and fdatasync'ed to a plain file in the same directory:
//! sustained strata writes end up as chunks that compaction must make durable, so that is
//! their ceiling once the log's head start (twice the compaction threshold) is used up,
//! while qemu-nbd's writes over the 1 GiB region stay in the page cache.

use crate::chart::{bars, Series};
use crate::disk::{ensure_tool, Server};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;

#[derive(serde::Serialize, Clone)]
struct Row {
    system: String,
    test: String,
    iops: f64,
    mib_s: f64,
}

fn fio(
    uri: &str,
    name: &str,
    rw: &str,
    bs: &str,
    size: &str,
    runtime: Option<u32>,
) -> Result<(f64, f64)> {
    let mut c = Command::new("fio");
    c.args([
        &format!("--name={name}"),
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        &format!("--rw={rw}"),
        &format!("--bs={bs}"),
        &format!("--size={size}"),
        "--iodepth=16",
        "--output-format=json",
        "--randrepeat=1",
    ]);
    if let Some(t) = runtime {
        c.args([&format!("--runtime={t}"), "--time_based=1"]);
    }
    let o = c.output().context("running fio")?;
    anyhow::ensure!(o.status.success(), "fio {rw} failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let start = text.find('{').context("fio printed no JSON")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..])?;
    let job = &v["jobs"][0];
    let side = if rw.contains("read") { &job["read"] } else { &job["write"] };
    Ok((side["iops"].as_f64().unwrap_or(0.0), side["bw"].as_f64().unwrap_or(0.0) / 1024.0))
}

/// MiB/s of 1 GiB written in 1 MiB pieces to a new file in `dir`, then fdatasync'ed.
fn durable_write_mib_s(dir: &Path) -> Result<f64> {
    use std::io::Write;
    let path = dir.join("durable.bin");
    let piece: Vec<u8> =
        (0..1u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8).collect();
    let t = std::time::Instant::now();
    let mut f = std::fs::File::create(&path)?;
    for _ in 0..1024 {
        f.write_all(&piece)?;
    }
    f.sync_data()?;
    let secs = t.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(1024.0 / secs)
}

const SYSTEMS: [&str; 3] = ["strata", "raw", "qcow2"];
/// Rounds of each test per system; the median is reported.
const ROUNDS: u32 = 3;

pub fn bench_io(runtime: u32, out: &Path, scratch: Option<&Path>) -> Result<()> {
    for t in ["fio", "qemu-nbd", "qemu-img"] {
        ensure_tool(t)?;
    }
    // No strace here: it would tax every system call of the servers being measured.
    crate::disk::set_tracing(false);
    let tmp = match scratch {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir())?,
    };
    let dir = tmp.path();
    let size = 4u64 << 30;
    let region = "1G";
    let mut wa = None;
    let mk = |system: &str, round: u32| -> Result<Server> {
        match system {
            "strata" if round == 0 => Server::strata_disk(dir, "io", size, false),
            "strata" => Server::strata_existing(dir, "io"),
            "raw" => {
                let f = dir.join("io.raw");
                if round == 0 {
                    std::fs::File::create(&f)?.set_len(size)?;
                }
                Server::qemu_nbd(dir, &f, "raw")
            }
            _ => {
                let f = dir.join("io.qcow2");
                if round == 0 {
                    anyhow::ensure!(Command::new("qemu-img")
                        .args(["create", "-q", "-f", "qcow2"])
                        .arg(&f)
                        .arg(size.to_string())
                        .status()?
                        .success());
                }
                Server::qemu_nbd(dir, &f, "qcow2")
            }
        }
    };
    // Fill the region, restart the server (strata folds its log into chunks here).
    let mut servers = Vec::new();
    for system in SYSTEMS {
        let mut s = mk(system, 0)?;
        fio(&s.uri(), "fill", "write", "1M", region, None)?;
        s.stop()?;
        drop(s);
        servers.push((system, mk(system, 1)?));
    }
    // Rounds of every test on every system in turn, so load from other work on the machine
    // falls on all three alike; the median round counts. Nothing is reset between rounds: a
    // strata write test starts with whatever log the previous ones left.
    let tests = [
        ("4k randread", "randread", "4k"),
        ("1M read", "read", "1M"),
        ("4k randwrite", "randwrite", "4k"),
        ("1M write", "write", "1M"),
    ];
    let mut samples: Vec<(String, String, f64, f64)> = Vec::new();
    for round in 1..=ROUNDS {
        for (test, rw, bs) in tests {
            for (system, s) in &servers {
                let (iops, mib) = fio(&s.uri(), "t", rw, bs, region, Some(runtime))?;
                eprintln!(
                    "  round {round} {system:<7} {test:<13} {iops:>9.0} IOPS {mib:>8.1} MiB/s"
                );
                samples.push((system.to_string(), test.to_string(), iops, mib));
            }
        }
    }
    let mut rows = Vec::new();
    for system in SYSTEMS {
        for (test, _, _) in tests {
            let mut v: Vec<(f64, f64)> = samples
                .iter()
                .filter(|r| r.0 == system && r.1 == test)
                .map(|r| (r.2, r.3))
                .collect();
            v.sort_by(|x, y| x.0.total_cmp(&y.0));
            let (iops, mib_s) = v[v.len() / 2];
            rows.push(Row { system: system.into(), test: test.into(), iops, mib_s });
        }
    }
    for (_, mut s) in servers {
        if let Some(st) = s.stop_stats()? {
            let g = st["guest_bytes_written"].as_f64().unwrap_or(0.0);
            let l = st["log_bytes_written"].as_f64().unwrap_or(0.0);
            let c = st["compaction_bytes"].as_f64().unwrap_or(0.0);
            eprintln!("  strata write amplification: guest {:.0} MiB, log {:.0} MiB, compaction {:.0} MiB -> {:.2}x", g / 1048576.0, l / 1048576.0, c / 1048576.0, (l + c) / g.max(1.0));
            wa = Some(
                serde_json::json!({"guest_bytes": g, "log_bytes": l, "compaction_bytes": c, "write_amplification": (l + c) / g.max(1.0),
                "compactions": st["compactions"], "writer_waits_for_compaction": st["compaction_waits"],
                "note": "log = header+data per guest write; compaction rewrites every 64 KiB block the log touched (uncompressed bytes before the codec)"}),
            );
        }
    }
    let durable = durable_write_mib_s(dir)?;
    eprintln!("  1 GiB written + fdatasync to a plain file here: {durable:.0} MiB/s");
    let get = |sys: &str, test: &str| {
        rows.iter().find(|r| r.system == sys && r.test == test).map(|r| r.iops).unwrap_or(0.0)
    };
    let rr = get("strata", "4k randread") / get("raw", "4k randread");
    eprintln!(
        "  4k randread strata/raw = {rr:.2}; 4k randwrite strata/raw = {:.2}",
        get("strata", "4k randwrite") / get("raw", "4k randwrite")
    );
    std::fs::create_dir_all(out)?;
    let mut csv = String::from("system,test,iops,mib_s\n");
    for r in &rows {
        csv += &format!("{},{},{:.0},{:.1}\n", r.system, r.test, r.iops, r.mib_s);
    }
    std::fs::write(out.join("bench-io.csv"), csv)?;
    let tests = ["4k randread", "4k randwrite", "1M read", "1M write"];
    let ratios: serde_json::Map<String, serde_json::Value> = tests
        .iter()
        .map(|t| (t.to_string(), serde_json::json!({"strata_over_raw": get("strata", t) / get("raw", t), "strata_over_qcow2": get("strata", t) / get("qcow2", t)})))
        .collect();
    let meta = serde_json::json!({
        "benchmark": "io",
        "command": format!("strata-bench io --runtime {runtime}"),
        "rounds": ROUNDS,
        "samples": samples.iter().map(|r| serde_json::json!({"system": r.0, "test": r.1, "iops": r.2, "mib_s": r.3})).collect::<Vec<_>>(),
        "method": "fio --ioengine=nbd --iodepth=16 over nbd+unix, 1 GiB region of a 4 GiB disk, filled first with 1 MiB writes; every server restarted after the fill (strata folds its log into chunks then); page cache warm for all (nothing dropped)",
        "durable_write_mib_s": durable,
        "durable_write_note": "1 GiB written to a plain file in the same directory, then fdatasync: the ceiling for sustained strata writes, which compaction must store as durable chunks",
        "env": crate::results::env_json(),
        "rows": rows,
        "ratios": ratios,
        "strata_write_amplification": wa,
    });
    std::fs::write(out.join("bench-io.json"), serde_json::to_string_pretty(&meta)?)?;
    let series: Vec<Series> = ["strata", "raw", "qcow2"]
        .iter()
        .map(|s| Series {
            name: if *s == "strata" { "strata".into() } else { format!("qemu-nbd {s}") },
            values: tests.iter().map(|t| get(s, t) / get("raw", t)).collect(),
        })
        .collect();
    let svg = bars(
        "fio over NBD, relative to qemu-nbd raw (higher is better)",
        "x qemu-nbd raw",
        &tests.map(String::from),
        &series,
    );
    std::fs::write(out.join("bench-io.svg"), svg)?;
    eprintln!("wrote {}/bench-io.{{csv,json,svg}}", out.display());
    Ok(())
}

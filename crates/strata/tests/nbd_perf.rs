//! Throughput comparison with qemu-nbd through fio's nbd engine (libnbd), both serving the same
//! raw file from the page cache, alternating runs in one process. Ignored by default (it
//! takes about a minute and needs a quiet machine):
//!
//!     cargo test --release --test nbd_perf -- --ignored --nocapture
//!
//! Env: NBD_PERF_SECS (per run, default 10), NBD_PERF_ROUNDS (default 3),
//! NBD_PERF_WORKERS (server workers per connection, default: the library default).

#[path = "nbd/common.rs"]
mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use strata::nbd::ServerConfig;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn fio_iops(uri: &str, rw: &str, bs: &str, iodepth: u32, secs: u64) -> f64 {
    let out = run_status(
        Command::new("fio").args([
            "--name=perf",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            &format!("--iodepth={iodepth}"),
            "--size=256M",
            "--time_based",
            &format!("--runtime={secs}"),
            "--output-format=terse",
            "--terse-version=3",
        ]),
        Duration::from_secs(secs + 60),
    );
    assert!(out.status.success(), "fio failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.starts_with("3;")).expect("fio terse output");
    let f: Vec<&str> = line.split(';').collect();
    // terse v3: read iops is field 8, write iops field 49 (1-based).
    f[7].parse::<f64>().unwrap() + f[48].parse::<f64>().unwrap()
}

/// The measurements must not overlap (tests in one binary run in parallel by default).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn compare(rw: &str, bs: &str, iodepth: u32) -> f64 {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_tool("fio", "fio");
    let secs = env("NBD_PERF_SECS", 10);
    let rounds = env("NBD_PERF_ROUNDS", 3);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("perf.raw");
    std::fs::write(&file, pattern(42, 256 << 20)).unwrap();
    let mut cfg = ServerConfig::default();
    if let Some(w) = std::env::var("NBD_PERF_WORKERS").ok().and_then(|v| v.parse().ok()) {
        cfg.transmission.workers = w;
    }
    let ours = TestServer::start_with(
        Exports::new().add("disk", Arc::new(FileExport::open(&file, false))),
        cfg,
    );
    let q = QemuNbd::start(&file, &dir.path().join("q.sock"), "disk", &[]);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        a.push(fio_iops(&ours.uri("disk"), rw, bs, iodepth, secs));
        b.push(fio_iops(&q.uri("disk"), rw, bs, iodepth, secs));
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap());
        v[v.len() / 2]
    };
    let (ma, mb) = (med(&mut a), med(&mut b));
    eprintln!(
        "{rw} bs={bs} iodepth={iodepth}: strata {a:?} (median {ma:.0}), qemu-nbd {b:?} (median {mb:.0}), ratio {:.2}",
        ma / mb
    );
    ma / mb
}

#[test]
#[ignore = "performance measurement; run with --ignored on a quiet machine"]
fn randread_4k_iodepth16_vs_qemu_nbd() {
    let ratio = compare("randread", "4k", 16);
    assert!(ratio >= 0.9, "4 KiB random read IOPS at {ratio:.2}x qemu-nbd, target >= 0.9x");
}

#[test]
#[ignore = "performance measurement; run with --ignored on a quiet machine"]
fn randwrite_4k_iodepth16_vs_qemu_nbd() {
    let ratio = compare("randwrite", "4k", 16);
    assert!(ratio >= 0.9, "4 KiB random write IOPS at {ratio:.2}x qemu-nbd, target >= 0.9x");
}

//! Result files of the benchmarks: `bench-<name>.{csv,json,svg}` in the output directory
//! (docs/results/ by default), named per benchmark so a new run replaces the last one, and the
//! environment every JSON records (CPU, cores, memory, kernel, QEMU and strata versions).

use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;

pub(crate) fn write_outputs(
    out: &Path,
    name: &str,
    csv: String,
    json: &serde_json::Value,
    svg: String,
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("Cannot create {}", out.display()))?;
    std::fs::write(out.join(format!("bench-{name}.csv")), csv)?;
    std::fs::write(out.join(format!("bench-{name}.json")), serde_json::to_string_pretty(json)?)?;
    std::fs::write(out.join(format!("bench-{name}.svg")), svg)?;
    eprintln!("wrote {}/bench-{name}.{{csv,json,svg}}", out.display());
    Ok(())
}

/// The machine a benchmark ran on and the versions it ran: recorded in every result file, so
/// runs on different hosts are told apart.
pub(crate) fn env_json() -> serde_json::Value {
    let qemu = Command::new(crate::guest::qemu_program())
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_default();
    // Machines of one kind still differ (`zstd -1`'s save of the idle 128 MiB guest takes
    // ~0.37 s on one and ~0.18 s on another): the CPU model tells runs apart.
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_default();
    serde_json::json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "cpu": cpu,
        "qemu": qemu,
        "accel": "tcg",
        "kernel": first_line("/proc/sys/kernel/osrelease"),
        "memory_kib": meminfo_kib("MemTotal:"),
        "strata": env!("CARGO_PKG_VERSION"),
        "when_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
    })
}

fn first_line(path: &str) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_default()
}

fn meminfo_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix(field)?.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

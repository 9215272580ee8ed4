//! `strata disk record-boot NAME` and `strata disk warm NAME`: the CLI side of boot working
//! sets (`strata::boot`).
//!
//! record-boot serves a temporary linked clone of NAME (so the guest's writes never touch
//! NAME) through the trace recorder on a Unix socket, prints the QEMU `-drive` to use, and
//! stops when the guest has disconnected for two seconds, on Ctrl-C/SIGTERM, or at the
//! timeout. The reads become NAME's working set in the backend; the clone is removed.
//!
//! warm prefetches the working set into the host's SSD cache (`Backend::prefetch` of the
//! store's backend stack, whose top is the cache the host configuration opened). A store
//! without a cache (a local one, or a remote one
//! set up without `--cache`) has its ranges read through the backend stack, which warms the
//! page cache at most; the report says `cached: false`.

use crate::ui;
use anyhow::{Context, Result};
use std::path::Path;
use std::time::{Duration, Instant};
use strata::boot::{workset, Recorder, TracingExports};
use strata::nbd::{ExportSet, Server};
use strata::serve::DiskExports;
use strata::{disk, Store};

pub fn record_boot(
    s: &Store,
    name: &str,
    socket: Option<&Path>,
    trace_out: Option<&Path>,
    timeout: u64,
    json: bool,
) -> Result<()> {
    // Block SIGINT/SIGTERM in every thread; the wait loop below polls for them.
    let set = crate::serve::block_stop_signals();
    disk::info(s, name)?;
    let tmp = format!("{}.record-{:08x}", name.replace('@', "-"), rand_u32());
    disk::clone(s, name, &tmp, false)?;
    let result = serve_and_record(s, name, &tmp, socket, timeout, &set);
    disk::remove(s, &tmp).with_context(|| format!("Cannot remove the temporary clone '{tmp}'"))?;
    let trace = result?;
    if let Some(p) = trace_out {
        std::fs::write(p, trace.to_csv())
            .with_context(|| format!("Cannot write {}", p.display()))?;
    }
    let ws = workset::from_trace(s, name, &trace)?;
    workset::save(s, name, &ws)?;
    let sum = trace.summary();
    ui::emit(
        json,
        &serde_json::json!({"image": name, "key": workset::key(name), "chunks": ws.chunks.len(), "trace": sum}),
        || {
            format!(
                "Recorded the boot of '{name}': {} reads ({}), {} chunks saved as {}",
                sum.reads,
                ui::human(sum.read_bytes),
                ws.chunks.len(),
                workset::key(name)
            )
        },
    );
    Ok(())
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    t ^ std::process::id().rotate_left(16)
}

fn serve_and_record(
    s: &Store,
    name: &str,
    tmp: &str,
    socket: Option<&Path>,
    timeout: u64,
    set: &libc::sigset_t,
) -> Result<strata::boot::Trace> {
    let rec = Recorder::new(&[tmp]);
    let exports = DiskExports::new(s.clone());
    let traced: std::sync::Arc<dyn ExportSet> = TracingExports::new(exports.clone(), rec.clone());
    let path =
        socket.map(Path::to_path_buf).unwrap_or_else(|| s.local_dir().join("record-boot.sock"));
    let _ = std::fs::remove_file(&path);
    let handle = Server::bind_unix(&path)?
        .serve(traced)
        .with_context(|| format!("Cannot listen on {}", path.display()))?;
    eprintln!(
        "Recording the boot of '{name}': boot a guest with\n  -drive file=nbd:unix:{}:exportname={tmp},if=virtio,format=raw\n\
         Recording stops when it disconnects, on Ctrl-C, or after {timeout} s.",
        path.display()
    );
    let t = Instant::now();
    let mut idle_since: Option<Instant> = None;
    loop {
        let ts = libc::timespec { tv_sec: 0, tv_nsec: 200_000_000 };
        // SAFETY: waits on the set blocked by the caller, with a timeout.
        let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
        if sig > 0 || t.elapsed() > Duration::from_secs(timeout) {
            break;
        }
        if handle.total_connections() > 0 && handle.active_connections() == 0 {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                break;
            }
        } else {
            idle_since = None;
        }
    }
    rec.stop();
    handle.shutdown();
    exports.close_all()?;
    Ok(rec.trace())
}

pub fn warm(s: &Store, name: &str, parallel: usize, json: bool) -> Result<()> {
    let rep = workset::warm(s, name, parallel)?;
    ui::emit(json, &rep, || {
        format!(
            "Warmed '{name}' with the working set of '{}': {} chunks ({} ranges, {}), {} from the backend in {:.2} s{}{}",
            rep.working_set_of,
            rep.chunks,
            rep.ranges,
            ui::human(rep.bytes),
            ui::human(rep.backend_bytes),
            rep.secs,
            if rep.missing > 0 { format!("; {} chunks no longer in the store", rep.missing) } else { String::new() },
            if rep.cached { "" } else { " (this store has no SSD cache: ranges were only read through)" }
        )
    });
    Ok(())
}

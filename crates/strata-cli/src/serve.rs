//! `strata serve` (every disk over NBD until SIGINT/SIGTERM, with the control socket and the
//! counters it publishes) and `strata stats` (those counters, or this process's own when no
//! daemon runs).

use anyhow::{Context, Result};
use std::path::PathBuf;
use strata::store::Store;

use crate::{control, open_host, store_location, ui, Cli};

/// Block SIGINT and SIGTERM in this thread and every thread it starts afterwards, so one
/// thread can wait for them (sigtimedwait) and stop cleanly. Returns the blocked set.
pub(crate) fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-mask calls with a properly initialised set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

pub fn serve(
    cli: &Cli,
    socket: Option<PathBuf>,
    tcp: Option<std::net::SocketAddr>,
    no_cache: bool,
    no_prefetch: bool,
    nbd: strata::nbd::ServerConfig,
) -> Result<()> {
    use strata::nbd::Server;
    // Block SIGINT/SIGTERM in every thread; one thread waits for them.
    let set = block_stop_signals();
    let host = open_host(cli, no_cache)?;
    let s = host.store.clone();
    let exports = strata::serve::DiskExports::new(s.clone());
    if !no_prefetch {
        exports.enable_prefetch(strata::boot::prefetch::DEFAULT_PARALLEL);
    }
    let server = match tcp {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                tracing::warn!(
                    "serving on a non-loopback address {addr}: NBD has no authentication"
                );
            }
            Server::bind_tcp(addr)?
        }
        None => {
            let path =
                socket.unwrap_or_else(|| store_location(&cli.store).join(".meta").join("nbd.sock"));
            if let Some(d) = path.parent() {
                std::fs::create_dir_all(d)?;
            }
            Server::bind_unix(&path)
                .with_context(|| format!("Cannot listen on {}", path.display()))?
        }
    };
    let handle = server.with_config(nbd).serve(exports.clone())?;
    let control = control::Control::start(exports.clone(), handle.addr())?;
    let disks: Vec<String> = strata::disk::list(&s)?.into_iter().map(|d| d.name).collect();
    ui::emit(cli.json, &serde_json::json!({"uri": handle.uri(""), "exports": disks}), || {
        format!(
            "Serving {} disk(s) at {} (export name = disk name); Ctrl-C to stop",
            disks.len(),
            handle.uri("NAME")
        )
    });
    use std::io::Write;
    std::io::stdout().flush().ok();
    // Publish counters for `strata stats` while serving.
    let stats_path = s.local_dir().join(STATS_FILE);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, exports, cache, path, disks) =
            (stop.clone(), exports.clone(), host.cache.clone(), stats_path.clone(), disks.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                write_stats(&path, &exports, cache.as_deref(), &disks);
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        })
    };
    let mut sig: libc::c_int = 0;
    // SAFETY: waits on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = writer.join();
    let _ = std::fs::remove_file(&stats_path);
    eprintln!("strata serve: signal {sig}, stopping");
    handle.shutdown();
    drop(control);
    // Fold every open disk's log into its map, then report per-disk I/O counters (flushes vs
    // host fdatasyncs, guest/log/compaction bytes) for operators and benchmarks.
    let vols: Vec<(String, std::sync::Arc<strata::disk::volume::Volume>)> =
        disks.iter().filter_map(|d| exports.volume(d).map(|v| (d.clone(), v))).collect();
    exports.close_all()?;
    let stats: serde_json::Map<String, serde_json::Value> = vols
        .iter()
        .map(|(d, v)| (d.clone(), serde_json::to_value(v.stats()).unwrap_or_default()))
        .collect();
    eprintln!("strata serve: stats {}", serde_json::Value::Object(stats));
    s.close()?;
    Ok(())
}

const STATS_FILE: &str = "serve-stats.json";

/// The counters `strata stats` shows: store, SSD cache, backend, and per-disk I/O.
fn stats_value(
    store: &Store,
    cache: Option<&strata::backend::cache::CacheBackend>,
    volumes: serde_json::Value,
) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let st = store.stats();
    let b = store.backend();
    let caps = b.capabilities();
    serde_json::json!({
        "pid": std::process::id(),
        "unix_ms": strata::store::lease::now_ms(),
        "backend": {"name": b.name(), "native_range": caps.native_range, "preferred_pack_size": caps.preferred_pack_size,
            "bytes_from_backend": cache.map(|c| c.counters().bytes_from_backend())},
        "store": {"chunks_new": st.chunks_new.load(Relaxed), "chunks_dedup": st.chunks_dedup.load(Relaxed),
            "raw_bytes_new": st.raw_bytes_new.load(Relaxed), "stored_bytes_new": st.stored_bytes_new.load(Relaxed),
            "packs_written": st.packs_written.load(Relaxed), "syncs": st.syncs.load(Relaxed)},
        "cache": cache.map(|c| serde_json::json!({"dir": c.dir(), "counters": c.counters()})),
        "disks": volumes,
    })
}

fn write_stats(
    path: &std::path::Path,
    exports: &strata::serve::DiskExports,
    cache: Option<&strata::backend::cache::CacheBackend>,
    disks: &[String],
) {
    let vols: serde_json::Map<String, serde_json::Value> = disks
        .iter()
        .filter_map(|d| {
            exports
                .volume(d)
                .map(|v| (d.clone(), serde_json::to_value(v.stats()).unwrap_or_default()))
        })
        .collect();
    let mut v = stats_value(exports.store(), cache, serde_json::Value::Object(vols));
    v["prefetch"] = serde_json::to_value(exports.prefetches()).unwrap_or_default();
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, serde_json::to_vec_pretty(&v).unwrap_or_default()).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

pub fn stats(cli: &Cli) -> Result<()> {
    let loc = store_location(&cli.store);
    // A running `strata serve` owns the cache; show what it publishes.
    let local = loc.join(".meta");
    let live = std::fs::read(local.join(STATS_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .filter(|v| {
            let pid = v["pid"].as_u64().unwrap_or(0) as i32;
            // SAFETY: signal 0 only checks that the process exists.
            pid > 0 && unsafe { libc::kill(pid, 0) } == 0
        });
    let (v, source) = match live {
        Some(v) => (v, "strata serve"),
        None => {
            let h = open_host(cli, false)?;
            (
                stats_value(&h.store, h.cache.as_deref(), serde_json::json!({})),
                "this process (no strata serve running)",
            )
        }
    };
    ui::emit(cli.json, &v, || {
        let mut t = format!(
            "Counters of {source}\nbackend {}",
            v["backend"]["name"].as_str().unwrap_or("?")
        );
        if let Some(c) = v["cache"].as_object() {
            let k = &c["counters"];
            let (h, m) = (k["hits"].as_u64().unwrap_or(0), k["misses"].as_u64().unwrap_or(0));
            t += &format!(
                "\ncache {}: {} hits, {} misses ({:.1}% hit), {} coalesced, {} evictions, {} from backend, {} of {} used",
                c["dir"].as_str().unwrap_or("?"),
                h,
                m,
                if h + m > 0 { 100.0 * h as f64 / (h + m) as f64 } else { 0.0 },
                k["coalesced"].as_u64().unwrap_or(0),
                k["evictions"].as_u64().unwrap_or(0),
                ui::human(k["miss_bytes"].as_u64().unwrap_or(0) + k["bypass_bytes"].as_u64().unwrap_or(0)),
                ui::human(k["used_bytes"].as_u64().unwrap_or(0)),
                ui::human(k["capacity"].as_u64().unwrap_or(0)),
            );
        } else {
            t += "\nno SSD cache";
        }
        for p in v["prefetch"].as_array().into_iter().flatten() {
            t += &format!(
                "\nboot prefetch of {} ({}): {} of {} ranges, {} of {}{}",
                p["image"].as_str().unwrap_or("?"),
                p["state"].as_str().unwrap_or("?"),
                p["ranges_done"],
                p["ranges"],
                ui::human(p["bytes_done"].as_u64().unwrap_or(0)),
                ui::human(p["bytes"].as_u64().unwrap_or(0)),
                match p["ranges_failed"].as_u64().unwrap_or(0) {
                    0 => String::new(),
                    n => format!(", {n} ranges failed"),
                }
            );
        }
        let st = &v["store"];
        t += &format!(
            "\nstore: {} new chunks ({} stored), {} dedup hits, {} packs written, {} syncs",
            st["chunks_new"],
            ui::human(st["stored_bytes_new"].as_u64().unwrap_or(0)),
            st["chunks_dedup"],
            st["packs_written"],
            st["syncs"]
        );
        t
    });
    Ok(())
}

//! The serving daemon's control socket: store-wide maintenance while `strata serve` runs.
//!
//! GC may only run while no other instance has the store open (`store/lease.rs`), and a
//! daemon that serves desktops is always open. So `strata serve` listens on
//! `STORE/.meta/control.sock` (mode 0600) and runs such operations itself, in its own
//! process, where session pins protect its writers (open disks, compactions). `strata gc`
//! tries the socket first and falls back to opening the store when no daemon answers.
//!
//! Protocol: one request per connection, one JSON line each way.
//! Request `{"op": "gc"}`; reply `{"ok": true, "report": {...}}` or
//! `{"ok": false, "error": "..."}` (the error chain, as the daemon saw it). Requests are read
//! with a size cap and a timeout, and unknown ops are refused, so a stray client cannot wedge
//! the daemon; operations run one at a time.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use strata::progress::NoProgress;
use strata::Store;

const SOCKET: &str = "control.sock";
const MAX_REQUEST: u64 = 4096;

/// Where the daemon of the store whose local state is in `local_dir` listens.
pub fn socket_path(local_dir: &Path) -> PathBuf {
    local_dir.join(SOCKET)
}

/// The listening side, owned by `strata serve`; stops and removes the socket on drop.
pub struct Control {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Control {
    /// Listen on `socket_path(store.local_dir())`. A stale socket (no daemon behind it) is
    /// replaced; a live one means another daemon serves this store.
    pub fn start(store: Store) -> Result<Control> {
        let path = socket_path(store.local_dir());
        if UnixStream::connect(&path).is_ok() {
            bail!(
                "Another strata serve already runs for this store ({}): stop it first",
                path.display()
            );
        }
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .with_context(|| format!("Cannot listen on {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("control".into())
                .spawn(move || accept_loop(listener, store, stop))?
        };
        Ok(Control { path, stop, thread: Some(thread) })
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn accept_loop(listener: UnixListener, store: Store, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((conn, _)) => {
                let _ = conn.set_nonblocking(false);
                if let Err(e) = handle(conn, &store) {
                    tracing::warn!(target: "strata::control", error = %format!("{e:#}"), "control request failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => {
                tracing::warn!(target: "strata::control", error = %e, "control accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn handle(conn: UnixStream, store: &Store) -> Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new((&conn).take(MAX_REQUEST)).read_line(&mut line)?;
    let reply = match serde_json::from_str::<serde_json::Value>(line.trim()) {
        Ok(req) => match req["op"].as_str() {
            Some("gc") => {
                tracing::info!(target: "strata::control", "gc requested over the control socket");
                match store.gc(&NoProgress) {
                    Ok(r) => serde_json::json!({"ok": true, "report": r}),
                    Err(e) => serde_json::json!({"ok": false, "error": chain(&e)}),
                }
            }
            _ => {
                serde_json::json!({"ok": false, "error": "Unknown control request: this daemon knows {\"op\": \"gc\"}"})
            }
        },
        Err(_) => serde_json::json!({"ok": false, "error": "Control requests are one JSON line"}),
    };
    let mut w = &conn;
    w.write_all(format!("{reply}\n").as_bytes())?;
    Ok(())
}

use strata::error_chain as chain;

/// Ask the daemon of this store to run `op`. `Ok(None)` when no daemon listens; otherwise its
/// report, or its error.
pub fn request(local_dir: &Path, op: &str) -> Result<Option<serde_json::Value>> {
    let path = socket_path(local_dir);
    let Ok(conn) = UnixStream::connect(&path) else { return Ok(None) };
    let mut w = &conn;
    w.write_all(format!("{}\n", serde_json::json!({"op": op})).as_bytes())?;
    let mut line = String::new();
    BufReader::new(&conn)
        .read_line(&mut line)
        .context("The serving daemon closed the control socket without a reply")?;
    let v: serde_json::Value =
        serde_json::from_str(line.trim()).context("The serving daemon sent a malformed reply")?;
    if v["ok"].as_bool() == Some(true) {
        Ok(Some(v["report"].clone()))
    } else {
        bail!(
            "The serving daemon could not run {op}: {}",
            v["error"].as_str().unwrap_or("no reason given")
        )
    }
}

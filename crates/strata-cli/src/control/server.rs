//! The daemon's side of the control socket (protocol in `docs/control.md`).
//!
//! One accept thread polls the listener; each connection runs on its own thread, at most
//! [`MAX_CONNECTIONS`] at once (one more is answered with an error line and closed), so a long
//! operation (a GC, the export or compaction of a big disk) never delays another client's
//! `cut`. GCs run one at a time. A request is one JSON line of at most [`MAX_REQUEST`] bytes,
//! read within [`REQUEST_TIMEOUT`], so a stray client cannot wedge a thread; unknown ops are
//! refused. Every op but `cut` answers one line. `cut` answers twice: once the disks are cut
//! (no I/O: the line a paused guest waits for), then once the cuts are folded into block maps
//! and their chunks are durable; the fold's session then stays open, keeping its chunks safe
//! from a GC in this daemon, until the client closes the connection (or [`CUT_HOLD`] passes).

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use strata::disk::DiskMeta;
use strata::nbd::ServerAddr;
use strata::progress::NoProgress;
use strata::serve::DiskExports;
use strata::ChunkId;

use super::socket_path;

/// Longest request line.
pub const MAX_REQUEST: u64 = 64 << 10;
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a client has to send its request line.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a `cut` keeps its fold's session open waiting for the client to close.
pub const CUT_HOLD: Duration = Duration::from_secs(30 * 60);

const TARGET: &str = "strata::control";

/// The listening side, owned by `strata serve`; stops and removes the socket on drop.
pub struct Control {
    path: PathBuf,
    daemon: Arc<Daemon>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What every connection thread shares.
struct Daemon {
    exports: Arc<DiskExports>,
    /// `whoami`'s answer.
    whoami: Value,
    gc: Mutex<()>,
    active: AtomicUsize,
    stop: AtomicBool,
}

impl Control {
    /// Listen on `socket_path(store.local_dir())` for the daemon serving `exports` over NBD
    /// at `nbd`. A stale socket (no daemon behind it) is replaced; a live one means another
    /// daemon serves this store.
    pub fn start(exports: Arc<DiskExports>, nbd: &ServerAddr) -> Result<Control> {
        let local = exports.store().local_dir().to_path_buf();
        let path = socket_path(&local);
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
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let nbd = match nbd {
            ServerAddr::Unix(p) => json!({"unix": abs(p)}),
            ServerAddr::Tcp(a) => json!({"tcp": a.to_string()}),
        };
        let store_dir = abs(local.parent().unwrap_or(&local));
        let daemon = Arc::new(Daemon {
            exports,
            whoami: json!({"pid": std::process::id(), "nbd": nbd, "store": store_dir}),
            gc: Mutex::new(()),
            active: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let thread = {
            let daemon = daemon.clone();
            std::thread::Builder::new()
                .name("control".into())
                .spawn(move || accept_loop(listener, daemon))?
        };
        Ok(Control { path, daemon, thread: Some(thread) })
    }
}

impl Drop for Control {
    /// Stop accepting, give running requests a moment, remove the socket.
    fn drop(&mut self) {
        self.daemon.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let t = Instant::now();
        while self.daemon.active.load(Ordering::Acquire) > 0 && t.elapsed() < Duration::from_secs(2)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Counts a connection thread for as long as it runs.
struct Active(Arc<Daemon>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: UnixListener, d: Arc<Daemon>) {
    let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    while !d.stop.load(Ordering::Relaxed) {
        // SAFETY: one valid pollfd for the listener, which outlives the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 200) };
        if n <= 0 {
            continue;
        }
        let conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::warn!(target: TARGET, error = %e, "control accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let _ = conn.set_nonblocking(false);
        if d.active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            d.active.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(target: TARGET, max = MAX_CONNECTIONS, "too many control connections; refusing one");
            let _ = conn.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = send(
                &conn,
                &refusal(format!(
                    "The serving daemon has {MAX_CONNECTIONS} control requests running: retry when one ends"
                )),
            );
            continue;
        }
        let active = Active(d.clone());
        let spawned = std::thread::Builder::new().name("control-conn".into()).spawn(move || {
            if let Err(e) = handle(conn, &active.0) {
                tracing::warn!(target: TARGET, error = %format!("{e:#}"), "control request failed");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(target: TARGET, error = %e, "cannot start a control connection thread");
        }
    }
}

fn refusal(error: String) -> Value {
    json!({"ok": false, "error": error})
}

fn send(mut conn: &UnixStream, v: &Value) -> std::io::Result<()> {
    conn.write_all(format!("{v}\n").as_bytes())
}

/// Read one request and answer it.
fn handle(conn: UnixStream, d: &Daemon) -> Result<()> {
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut line = String::new();
    let n = BufReader::new((&conn).take(MAX_REQUEST))
        .read_line(&mut line)
        .context("Cannot read the control request")?;
    if n as u64 >= MAX_REQUEST && !line.ends_with('\n') {
        send(&conn, &refusal(format!("Control requests are at most {MAX_REQUEST} bytes")))?;
        return Ok(());
    }
    let req = match serde_json::from_str::<Value>(line.trim()) {
        Ok(v) if v.is_object() => v,
        _ => {
            send(&conn, &refusal("Control requests are one JSON object on one line".into()))?;
            return Ok(());
        }
    };
    let op = req["op"].as_str().unwrap_or("").to_string();
    if op == "cut" {
        return cut(&conn, &req, d);
    }
    if op == "arm" {
        return arm(&conn, &req, d);
    }
    let t = Instant::now();
    let reply = match run(&op, &req, d) {
        Ok(report) => json!({"ok": true, "report": report}),
        Err(e) => refusal(format!("{e:#}")),
    };
    tracing::info!(target: TARGET, op, ok = reply["ok"].as_bool(), ms = t.elapsed().as_secs_f64() * 1e3, "control request");
    send(&conn, &reply)?;
    Ok(())
}

fn str_field<'a>(req: &'a Value, key: &str) -> Result<&'a str> {
    req[key].as_str().ok_or_else(|| anyhow!("The request lacks \"{key}\" (a string)"))
}

fn bool_field(req: &Value, key: &str) -> bool {
    req[key].as_bool().unwrap_or(false)
}

/// Run a one-line op; its report, or the error to send.
fn run(op: &str, req: &Value, d: &Daemon) -> Result<Value> {
    let ex = &d.exports;
    Ok(match op {
        "gc" => {
            let _one = d.gc.lock().unwrap_or_else(|p| p.into_inner());
            tracing::info!(target: TARGET, "gc requested over the control socket");
            serde_json::to_value(ex.store().gc(&NoProgress)?)?
        }
        "whoami" => d.whoami.clone(),
        "disk-snapshot" => {
            let pairs: Vec<(String, String)> = serde_json::from_value(req["snaps"].clone())
                .context("\"snaps\" must be a list of [disk, snapshot] pairs")?;
            if pairs.is_empty() {
                bail!("\"snaps\" names no disk");
            }
            serde_json::to_value(ex.snapshot(&pairs)?)?
        }
        "disk-clone" => {
            let (src, dst) = (str_field(req, "src")?, str_field(req, "dst")?);
            serde_json::to_value(ex.clone_disk(src, dst, bool_field(req, "full"))?)?
        }
        "disk-export" => {
            let file = Path::new(str_field(req, "file")?);
            if !file.is_absolute() {
                bail!("The export file must be an absolute path (the daemon has its own directory)");
            }
            json!({"bytes": ex.export(str_field(req, "name")?, file, &NoProgress)?})
        }
        "disk-compact" => json!({"generation": ex.compact(str_field(req, "name")?)?}),
        "disk-rm" => {
            let name = str_field(req, "name")?;
            ex.remove(name, bool_field(req, "force"))?;
            json!({"removed": name})
        }
        "disk-info" => {
            let name = str_field(req, "name")?;
            let mut v = serde_json::to_value(strata::disk::info(ex.store(), name)?)?;
            if let Some(clients) = ex.held(name) {
                v["served"] = json!({"clients": clients});
            }
            v
        }
        "disk-revert" => {
            let name = str_field(req, "name")?;
            let root = ChunkId::from_hex(str_field(req, "root")?)
                .ok_or_else(|| anyhow!("\"root\" is not a chunk id (64 hex digits)"))?;
            let meta: DiskMeta = serde_json::from_value(req["meta"].clone())
                .context("\"meta\" is not a disk description")?;
            serde_json::to_value(ex.revert(name, root, &meta, bool_field(req, "force"))?)?
        }
        "" => bail!("The request lacks \"op\""),
        other => bail!(
            "Unknown control op '{other}': this daemon knows gc, whoami, cut, disk-snapshot, disk-clone, disk-export, disk-compact, disk-rm, disk-info and disk-revert"
        ),
    })
}

/// `cut`: the two reply lines, then hold the fold's session until the client closes.
fn cut(conn: &UnixStream, req: &Value, d: &Daemon) -> Result<()> {
    let names: Vec<String> = match serde_json::from_value(req["disks"].clone()) {
        Ok(v) if !Vec::<String>::is_empty(&v) => v,
        _ => {
            send(conn, &refusal("\"disks\" must be a non-empty list of disk names".into()))?;
            return Ok(());
        }
    };
    let t = Instant::now();
    let cuts = match d.exports.cut(&names) {
        Ok(c) => c,
        Err(e) => {
            send(conn, &refusal(strata::error_chain(&e)))?;
            return Ok(());
        }
    };
    let cut_ms = t.elapsed().as_secs_f64() * 1e3;
    send(conn, &json!({"ok": true, "cut_ms": cut_ms}))?;
    tracing::info!(target: TARGET, disks = ?names, cut_ms, "cut");
    fold_and_hold(conn, &cuts, d)
}

/// The second line of `cut` and `arm`: fold the cuts (durable when `fold` returns), send their roots,
/// then hold the fold's session until the client closes.
fn fold_and_hold(conn: &UnixStream, cuts: &[strata::disk::cut::Cut], d: &Daemon) -> Result<()> {
    let t = Instant::now();
    let store = d.exports.store();
    let ses = store.session();
    let folded = cuts
        .iter()
        .map(|c| {
            let f = c.fold(&ses)?;
            Ok(json!({"name": f.name, "root": f.root.to_hex(), "meta": f.meta}))
        })
        .collect::<Result<Vec<Value>, strata::disk::DiskError>>();
    let fold_ms = t.elapsed().as_secs_f64() * 1e3;
    tracing::info!(target: TARGET, disks = cuts.len(), fold_ms, ok = folded.is_ok(), "cuts folded");
    match folded {
        Ok(disks) => send(conn, &json!({"ok": true, "disks": disks}))?,
        Err(e) => {
            send(conn, &refusal(strata::error_chain(&e)))?;
            return Ok(());
        }
    }
    hold_until_closed(conn, d);
    drop(ses);
    Ok(())
}

/// `arm`: cut the disks at every flush (`strata::serve::arm`); line one once armed; then the
/// client's line `{"resumed_us": N}` (QEMU's RESUME time; `null` abandons) places the cut,
/// and the rest is `cut`'s second line.
fn arm(conn: &UnixStream, req: &Value, d: &Daemon) -> Result<()> {
    let names: Vec<String> = match serde_json::from_value(req["disks"].clone()) {
        Ok(v) if !Vec::<String>::is_empty(&v) => v,
        _ => {
            send(conn, &refusal("\"disks\" must be a non-empty list of disk names".into()))?;
            return Ok(());
        }
    };
    let id = match d.exports.arm(&names) {
        Ok(id) => id,
        Err(e) => {
            send(conn, &refusal(strata::error_chain(&e)))?;
            return Ok(());
        }
    };
    send(conn, &json!({"ok": true}))?;
    // The client answers once its snapshot's stream has ended: no read timeout but the hold.
    let _ = conn.set_read_timeout(Some(CUT_HOLD));
    let mut line = String::new();
    let read = BufReader::new(conn.take(MAX_REQUEST)).read_line(&mut line);
    let resumed_us = match read {
        Ok(n) if n > 0 => {
            serde_json::from_str::<Value>(line.trim()).ok().and_then(|v| v["resumed_us"].as_u64())
        }
        _ => None,
    };
    let cuts = match d.exports.disarm(id, resumed_us) {
        Ok(Some(c)) => c,
        Ok(None) => return Ok(()),
        Err(e) => {
            send(conn, &refusal(strata::error_chain(&e)))?;
            return Ok(());
        }
    };
    tracing::info!(target: TARGET, disks = ?names, resumed_us, "armed cut placed");
    fold_and_hold(conn, &cuts, d)
}

/// Wait for the client to close the connection (EOF), for at most [`CUT_HOLD`] or until the
/// daemon stops.
fn hold_until_closed(conn: &UnixStream, d: &Daemon) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let t = Instant::now();
    let mut buf = [0u8; 256];
    while t.elapsed() < CUT_HOLD && !d.stop.load(Ordering::Relaxed) {
        match (&*conn).read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
    if d.stop.load(Ordering::Relaxed) {
        return;
    }
    tracing::warn!(target: TARGET, "cut client kept its connection past the limit; releasing its chunks");
}

//! The client side of the control socket (protocol in `docs/control.md`): what `strata gc`,
//! the `disk` commands and `vm snapshot` use to reach the daemon serving their store.
//!
//! Every call first connects; `Ok(None)` means no daemon listens (no socket, or a stale one),
//! and the caller runs the operation in its own process. A daemon's refusal comes back as an
//! error carrying the daemon's own message. Replies are awaited without a timeout: an export
//! or clone of a big disk takes as long as it takes.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::socket_path;

/// Connect to the daemon of the store whose local state is in `local_dir`; `None` if none
/// listens.
fn connect(local_dir: &Path) -> Result<Option<UnixStream>> {
    let path = socket_path(local_dir);
    match UnixStream::connect(&path) {
        Ok(c) => Ok(Some(c)),
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) => {
            Ok(None)
        }
        Err(e) => {
            Err(e).with_context(|| format!("Cannot reach the serving daemon at {}", path.display()))
        }
    }
}

/// Read one reply line; its value when `"ok"` is true, else the daemon's error.
fn reply(r: &mut impl BufRead) -> Result<Value> {
    let mut line = String::new();
    let n = r.read_line(&mut line).context("Cannot read the serving daemon's reply")?;
    if n == 0 {
        bail!("The serving daemon closed the control socket without a reply (see its log)");
    }
    let v: Value =
        serde_json::from_str(line.trim()).context("The serving daemon sent a malformed reply")?;
    if v["ok"].as_bool() == Some(true) {
        Ok(v)
    } else {
        bail!("{}", v["error"].as_str().unwrap_or("The serving daemon refused without a reason"))
    }
}

fn send(mut conn: &UnixStream, op: &Value) -> Result<()> {
    conn.write_all(format!("{op}\n").as_bytes())
        .context("Cannot send the request to the serving daemon")
}

/// Ask the daemon of this store to run `op` (a request object such as `{"op": "gc"}`).
/// `Ok(None)` when no daemon listens; otherwise its report, or its error.
pub fn request(local_dir: &Path, op: &Value) -> Result<Option<Value>> {
    let Some(conn) = connect(local_dir)? else { return Ok(None) };
    send(&conn, op)?;
    let v = reply(&mut BufReader::new(&conn))?;
    Ok(Some(v["report"].clone()))
}

/// A `cut` in progress: the disks are cut once [`CutSession::start`] returns; the fold's
/// chunks stay pinned in the daemon until this is dropped (the connection closes).
#[allow(dead_code)] // The client of `vm snapshot`.
pub struct CutSession {
    reader: BufReader<UnixStream>,
    /// How long the cut itself took in the daemon, in milliseconds.
    pub cut_ms: f64,
}

#[allow(dead_code)] // The client of `vm snapshot`.
impl CutSession {
    /// Cut `disks` at one instant in the daemon; returns once they are cut (no I/O in the
    /// daemon). `Ok(None)` when no daemon listens.
    pub fn start(local_dir: &Path, disks: &[String]) -> Result<Option<CutSession>> {
        let Some(conn) = connect(local_dir)? else { return Ok(None) };
        send(&conn, &serde_json::json!({"op": "cut", "disks": disks}))?;
        let mut reader = BufReader::new(conn);
        let v = reply(&mut reader)?;
        Ok(Some(CutSession { reader, cut_ms: v["cut_ms"].as_f64().unwrap_or(0.0) }))
    }

    /// Wait for the folds: one `{"name", "root", "meta"}` per disk, in the order asked. Their
    /// chunks are durable in the store and pinned until `self` is dropped: name them (commit
    /// refs) before that.
    pub fn folded(&mut self) -> Result<Vec<Value>> {
        let v = reply(&mut self.reader)?;
        match v["disks"].as_array() {
            Some(d) => Ok(d.clone()),
            None => bail!("The serving daemon's cut reply lacks \"disks\""),
        }
    }
}

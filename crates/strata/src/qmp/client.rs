//! Blocking QMP client over a unix socket.
//!
//! QMP is line-delimited JSON: QEMU greets with `{"QMP": {...}}`, the client must send
//! `qmp_capabilities`, then every `{"execute", "arguments", "id"}` gets exactly one
//! `{"return"}` or `{"error"}` carrying the same id, while `{"event"}` messages can arrive at
//! any time in between. The client is a small state machine over that: it reads whole lines
//! into its own buffer (so a timeout in the middle of a line loses nothing), parks events in a
//! queue for `take_events`/`wait_event`, and matches replies by id. Every read has a deadline;
//! reads are done with plain blocking I/O (`SO_RCVTIMEO`), no async runtime.
//!
//! `peer_pid` reads `SO_PEERCRED` so the caller can inspect `/proc/PID/cmdline` of the QEMU it
//! talks to (to start a destination with the same arguments).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::error::QmpError;

const TARGET: &str = "strata::qmp";
/// Largest single QMP message accepted (query-qmp-schema is about 200 KB).
const MAX_MESSAGE: usize = 64 << 20;

/// QEMU version from the greeting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
    /// Distribution package string, e.g. `Debian 1:7.2+dfsg-7+deb12u18+b3`.
    pub package: String,
}

impl std::fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

/// An asynchronous event (STOP, RESUME, MIGRATION, ...).
#[derive(Debug, Clone)]
pub struct QmpEvent {
    pub name: String,
    pub data: Value,
    pub seconds: i64,
    pub microseconds: i64,
}

/// A connected, negotiated QMP session.
pub struct QmpClient {
    sock: UnixStream,
    path: PathBuf,
    rbuf: Vec<u8>,
    version: QemuVersion,
    server_caps: Vec<String>,
    events: VecDeque<QmpEvent>,
    next_id: u64,
    timeout: Duration,
    /// Replies read ahead by [`QmpClient::pipeline`], handed out in order by `execute`.
    pipelined: VecDeque<Pipelined>,
    /// Commands sent by [`QmpClient::send_pipeline`] whose replies are not read yet:
    /// (command, arguments, id).
    unread: Vec<(String, Option<Value>, String)>,
}

/// One reply read ahead by [`QmpClient::pipeline`].
struct Pipelined {
    cmd: String,
    args: Option<Value>,
    reply: Result<Value, QmpError>,
}

impl QmpClient {
    /// Timeout for a reply when none is set.
    pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

    /// Connect, read the greeting and negotiate capabilities.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, QmpError> {
        Self::connect_timeout(path, Self::DEFAULT_TIMEOUT)
    }

    /// Like [`connect`](Self::connect) with a custom timeout for every reply.
    pub fn connect_timeout(path: impl AsRef<Path>, timeout: Duration) -> Result<Self, QmpError> {
        let path = path.as_ref().to_path_buf();
        if !path.exists() {
            return Err(QmpError::NoSocket { path });
        }
        let sock = UnixStream::connect(&path).map_err(|source| match source.kind() {
            io::ErrorKind::ConnectionRefused => QmpError::Refused { path: path.clone() },
            io::ErrorKind::NotFound => QmpError::NoSocket { path: path.clone() },
            _ => QmpError::Connect { path: path.clone(), source },
        })?;
        sock.set_write_timeout(Some(timeout)).map_err(|source| QmpError::Io {
            op: "socket setup".into(),
            path: path.clone(),
            source,
        })?;
        let mut c = QmpClient {
            sock,
            path,
            rbuf: Vec::with_capacity(64 << 10),
            version: QemuVersion { major: 0, minor: 0, micro: 0, package: String::new() },
            server_caps: Vec::new(),
            events: VecDeque::new(),
            next_id: 1,
            timeout,
            pipelined: VecDeque::new(),
            unread: Vec::new(),
        };
        let greeting = c.read_message("the QMP greeting", Instant::now() + timeout, timeout)?;
        c.parse_greeting(&greeting)?;
        c.execute("qmp_capabilities", None)?;
        tracing::debug!(target: TARGET, path = %c.path.display(), version = %c.version, "QMP connected");
        Ok(c)
    }

    fn parse_greeting(&mut self, g: &Value) -> Result<(), QmpError> {
        let bad = |why: &str| QmpError::BadGreeting { path: self.path.clone(), why: why.into() };
        let q = g
            .get("QMP")
            .ok_or_else(|| bad("no \"QMP\" object; is this a QMP (not HMP) socket?"))?;
        let v = q.get("version").ok_or_else(|| bad("no version"))?;
        let num = |k: &str| {
            v.get("qemu").and_then(|x| x.get(k)).and_then(Value::as_u64).map(|n| n as u32)
        };
        match (num("major"), num("minor"), num("micro")) {
            (Some(major), Some(minor), Some(micro)) => {
                let package = v.get("package").and_then(Value::as_str).unwrap_or("").to_owned();
                self.version = QemuVersion { major, minor, micro, package };
            }
            _ => return Err(bad("version numbers missing")),
        }
        self.server_caps = q
            .get("capabilities")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(|c| c.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        Ok(())
    }

    /// QEMU version from the greeting.
    pub fn version(&self) -> &QemuVersion {
        &self.version
    }

    /// Capabilities the server offered in its greeting (e.g. `oob`).
    pub fn server_capabilities(&self) -> &[String] {
        &self.server_caps
    }

    /// Socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Timeout applied to each reply.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Run a command and return its `return` value. A QMP `error` becomes
    /// [`QmpError::Command`] with QEMU's class and description.
    ///
    /// If [`pipeline`](Self::pipeline) sent this command next (same name and arguments), its
    /// reply is returned without another round trip; any other command first drops the
    /// pipelined replies nobody asked for.
    pub fn execute(&mut self, cmd: &str, args: Option<Value>) -> Result<Value, QmpError> {
        self.read_pipelined()?;
        if let Some(p) = self.pipelined.pop_front() {
            if p.cmd == cmd && p.args == args {
                tracing::debug!(target: TARGET, cmd, "QMP reply (pipelined)");
                return p.reply;
            }
            tracing::debug!(target: TARGET, cmd, unused = self.pipelined.len() + 1, "dropping pipelined QMP replies");
            self.pipelined.clear();
        }
        let (id, line) = self.request(cmd, args.as_ref())?;
        self.sock.write_all(&line).map_err(|source| self.io_error(cmd, source))?;
        tracing::debug!(target: TARGET, cmd, "QMP execute");
        self.reply(cmd, &id)?
    }

    /// Send several commands in one write and read their replies in order, so a run of
    /// queries costs one round trip instead of one each (QMP answers commands in the order
    /// they were sent). The replies are handed out by the following [`execute`](Self::execute)
    /// calls of the same commands, in the same order, so the typed wrappers (`query_status`,
    /// ...) work unchanged. Only a transport failure is returned here; a command's own error
    /// is returned by its `execute`.
    pub fn pipeline(&mut self, cmds: &[(&str, Option<Value>)]) -> Result<(), QmpError> {
        self.send_pipeline(cmds)?;
        self.read_pipelined()
    }

    /// The first half of [`pipeline`](Self::pipeline): send the commands in one write and
    /// return at once, so QEMU works on them while the caller does something else. The
    /// replies are read by the next `execute` (or [`read_pipelined`](Self::read_pipelined))
    /// and handed out as `pipeline`'s are.
    pub fn send_pipeline(&mut self, cmds: &[(&str, Option<Value>)]) -> Result<(), QmpError> {
        self.read_pipelined()?;
        self.pipelined.clear();
        let mut buf = Vec::new();
        let mut sent = Vec::with_capacity(cmds.len());
        for (cmd, args) in cmds {
            let (id, line) = self.request(cmd, args.as_ref())?;
            buf.extend_from_slice(&line);
            sent.push((cmd.to_string(), args.clone(), id));
        }
        let names: Vec<&str> = cmds.iter().map(|c| c.0).collect();
        self.sock.write_all(&buf).map_err(|source| self.io_error(&names.join(", "), source))?;
        tracing::debug!(target: TARGET, cmds = ?names, "QMP pipeline");
        self.unread = sent;
        Ok(())
    }

    /// Read the replies of commands [`send_pipeline`](Self::send_pipeline) sent (a no-op when
    /// there are none). Only a transport failure is returned here.
    pub fn read_pipelined(&mut self) -> Result<(), QmpError> {
        if self.unread.is_empty() {
            return Ok(());
        }
        let sent = std::mem::take(&mut self.unread);
        for (cmd, args, id) in sent {
            let reply = self.reply(&cmd, &id)?;
            self.pipelined.push_back(Pipelined { cmd, args, reply });
        }
        Ok(())
    }

    /// Forget replies read ahead by [`pipeline`](Self::pipeline) that were not asked for, so a
    /// later command of the same name cannot be answered by an old reply.
    pub fn discard_pipelined(&mut self) {
        // Replies still unread are read (a later command must not meet them); a transport
        // failure shows again at that command.
        let _ = self.read_pipelined();
        if !self.pipelined.is_empty() {
            tracing::debug!(target: TARGET, unused = self.pipelined.len(), "dropping pipelined QMP replies");
            self.pipelined.clear();
        }
    }

    /// The next id and the request line for `cmd`.
    fn request(&mut self, cmd: &str, args: Option<&Value>) -> Result<(String, Vec<u8>), QmpError> {
        let id = format!("strata-{}", self.next_id);
        self.next_id += 1;
        let mut msg = json!({ "execute": cmd, "id": id });
        if let Some(a) = args {
            msg["arguments"] = a.clone();
        }
        let mut line = serde_json::to_vec(&msg)
            .map_err(|source| QmpError::BadJson { op: cmd.into(), source })?;
        line.push(b'\n');
        Ok((id, line))
    }

    /// Read until the reply carrying `id`, queueing events. The outer error is the transport's
    /// (or a reply that is not ours); the inner one is the command's own.
    fn reply(&mut self, cmd: &str, id: &str) -> Result<Result<Value, QmpError>, QmpError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let m = self.read_message(cmd, deadline, self.timeout)?;
            if m.get("event").is_some() {
                self.queue_event(m);
                continue;
            }
            let rid = m.get("id").and_then(Value::as_str);
            if rid != Some(id) {
                // A late reply to a command that timed out earlier: drop it.
                if let Some(n) =
                    rid.and_then(|r| r.strip_prefix("strata-")).and_then(|n| n.parse::<u64>().ok())
                {
                    let ours = id.strip_prefix("strata-").and_then(|n| n.parse::<u64>().ok());
                    if ours.is_some_and(|o| n < o) {
                        tracing::debug!(target: TARGET, stale = n, "dropping a late QMP reply");
                        continue;
                    }
                }
                return Err(QmpError::BadReply {
                    cmd: cmd.into(),
                    why: format!("reply without our id {id}: {m}"),
                });
            }
            if let Some(r) = m.get("return") {
                return Ok(Ok(r.clone()));
            }
            if let Some(e) = m.get("error") {
                let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
                return Ok(Err(QmpError::Command {
                    cmd: cmd.into(),
                    class: s("class"),
                    desc: s("desc"),
                }));
            }
            return Err(QmpError::BadReply {
                cmd: cmd.into(),
                why: format!("neither return nor error: {m}"),
            });
        }
    }

    /// Drain the events received so far (without reading the socket).
    pub fn take_events(&mut self) -> Vec<QmpEvent> {
        self.events.drain(..).collect()
    }

    /// Return the first queued or newly received event named `name`; other events stay queued.
    pub fn wait_event(&mut self, name: &str, timeout: Duration) -> Result<QmpEvent, QmpError> {
        self.read_pipelined()?;
        if let Some(i) = self.events.iter().position(|e| e.name == name) {
            if let Some(ev) = self.events.remove(i) {
                return Ok(ev);
            }
        }
        let deadline = Instant::now() + timeout;
        let op = format!("event {name}");
        loop {
            let m = self.read_message(&op, deadline, timeout)?;
            if m.get("event").and_then(Value::as_str) == Some(name) {
                return Ok(to_event(&m));
            }
            if m.get("event").is_some() {
                self.queue_event(m);
            }
        }
    }

    /// Read any events QEMU has sent, waiting at most `wait` for the first one.
    pub fn poll_events(&mut self, wait: Duration) -> Result<usize, QmpError> {
        self.read_pipelined()?;
        let before = self.events.len();
        let deadline = Instant::now() + wait;
        loop {
            match self.read_message("events", deadline, wait) {
                Ok(m) if m.get("event").is_some() => self.queue_event(m),
                Ok(m) => {
                    return Err(QmpError::BadReply {
                        cmd: "events".into(),
                        why: format!("unsolicited message {m}"),
                    })
                }
                Err(QmpError::Timeout { .. }) => return Ok(self.events.len() - before),
                Err(e) => return Err(e),
            }
        }
    }

    fn queue_event(&mut self, m: Value) {
        let ev = to_event(&m);
        tracing::debug!(target: TARGET, event = %ev.name, "QMP event");
        self.events.push_back(ev);
    }

    /// PID of the QEMU process on the other end (`SO_PEERCRED`).
    pub fn peer_pid(&self) -> Result<u32, QmpError> {
        let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` and `len` are valid for writes of the sizes given, and the fd is a
        // connected unix socket owned by `self.sock` for the whole call.
        let rc = unsafe {
            libc::getsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(QmpError::PeerCred {
                path: self.path.clone(),
                source: io::Error::last_os_error(),
            });
        }
        if cred.pid <= 0 {
            return Err(QmpError::PeerCred {
                path: self.path.clone(),
                source: io::Error::new(io::ErrorKind::NotFound, "no peer process"),
            });
        }
        Ok(cred.pid as u32)
    }

    /// Command line of the QEMU process on the other end, from `/proc/PID/cmdline`.
    pub fn peer_cmdline(&self) -> Result<Vec<String>, QmpError> {
        let pid = self.peer_pid()?;
        let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map_err(|source| QmpError::PeerCred { path: self.path.clone(), source })?;
        Ok(raw
            .split(|&b| b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect())
    }

    fn io_error(&self, op: &str, source: io::Error) -> QmpError {
        match source.kind() {
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                QmpError::Closed { op: op.into(), path: self.path.clone() }
            }
            _ => QmpError::Io { op: op.into(), path: self.path.clone(), source },
        }
    }

    /// Read one JSON line, keeping partial lines across calls.
    fn read_message(
        &mut self,
        op: &str,
        deadline: Instant,
        wait: Duration,
    ) -> Result<Value, QmpError> {
        let mut scanned = 0;
        loop {
            if let Some(nl) = self.rbuf[scanned..].iter().position(|&b| b == b'\n') {
                let end = scanned + nl;
                let v = serde_json::from_slice::<Value>(&self.rbuf[..end]);
                self.rbuf.drain(..=end);
                return v.map_err(|source| QmpError::BadJson { op: op.into(), source });
            }
            scanned = self.rbuf.len();
            if self.rbuf.len() > MAX_MESSAGE {
                return Err(QmpError::TooLarge { op: op.into(), max: MAX_MESSAGE });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error(op, wait));
            }
            self.sock
                .set_read_timeout(Some(deadline - now))
                .map_err(|source| self.io_error(op, source))?;
            let mut chunk = [0u8; 64 << 10];
            match self.sock.read(&mut chunk) {
                Ok(0) => return Err(QmpError::Closed { op: op.into(), path: self.path.clone() }),
                Ok(n) => self.rbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    return Err(self.timeout_error(op, wait));
                }
                Err(e) => return Err(self.io_error(op, e)),
            }
        }
    }

    fn timeout_error(&self, op: &str, wait: Duration) -> QmpError {
        QmpError::Timeout { op: op.into(), path: self.path.clone(), after: wait }
    }
}

fn to_event(m: &Value) -> QmpEvent {
    let ts = m.get("timestamp");
    let t = |k: &str| ts.and_then(|t| t.get(k)).and_then(Value::as_i64).unwrap_or(0);
    QmpEvent {
        name: m.get("event").and_then(Value::as_str).unwrap_or("").to_owned(),
        data: m.get("data").cloned().unwrap_or(Value::Null),
        seconds: t("seconds"),
        microseconds: t("microseconds"),
    }
}

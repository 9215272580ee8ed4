//! NBD transmission phase: one reader thread, a small worker pool, replies under a writer lock.
//!
//! Clients pipeline (fio at iodepth 16, qemu, nbdcopy), so a serial read-execute-reply loop
//! would leave the export idle while the socket waits. Here the calling thread only reads and
//! checks requests (`check_request`, a pure function) and queues them; `workers` threads
//! execute them against the `Export` and each writes its whole reply with one `write_all`
//! under the connection's writer lock, so replies leave in completion order and the client
//! matches them by handle. Requests that fail validation are answered by the reader itself
//! and never reach the export.
//!
//! 16 workers by default, as many as fio's and QEMU's usual queue depth: a read of a disk
//! whose store is remote waits milliseconds for its range GETs (`bench io --remote`), and a
//! worker waiting on the network uses no CPU, so 4 workers left a 1 Gbit/s link mostly idle.
//!
//! Memory is bounded per connection: the reader must reserve a request's payload size
//! (READ/WRITE length) against `max_inflight_bytes`, and a slot against
//! `max_inflight_requests`, before it reads a WRITE payload or queues anything; when the budget
//! is spent it stops reading and TCP back-pressure does the rest. Payloads above
//! `MAX_REQUEST_LEN` are never buffered: a WRITE that large is drained in 64 KiB pieces and
//! refused with EINVAL, a READ that large is refused.
//!
//! On `NBD_CMD_DISC`, EOF or a protocol error the reader stops, the queue is closed, and the
//! workers finish every request already queued (the spec requires outstanding requests to be
//! handled) before `serve_transmission` returns. An export that answers ESHUTDOWN (withdrawn,
//! e.g. a disk removed with `--force`) ends the connection the same way: after that reply the
//! worker calls the connection's hangup, which stops the reader, so the connection and its
//! hold on the export go instead of failing every request of a client that never gives up.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use parking_lot::{Condvar, Mutex};

use super::export::{Export, ExportError, Extent, Hangup};
use super::handshake::{Negotiated, MAX_REQUEST_LEN};
use super::proto::*;

const TARGET: &str = "strata::nbd";

/// Most descriptors sent in one block status reply (the spec lets a server send fewer).
pub(crate) const MAX_EXTENTS: usize = 1 << 16;

/// Tuning for one connection's transmission phase.
#[derive(Clone, Debug)]
pub struct TransmissionConfig {
    /// Worker threads per connection.
    pub workers: usize,
    /// READ/WRITE bytes that may be queued or executing at once (one request is always let
    /// through even if larger).
    pub max_inflight_bytes: usize,
    /// Requests that may be queued or executing at once.
    pub max_inflight_requests: usize,
}

impl Default for TransmissionConfig {
    fn default() -> TransmissionConfig {
        TransmissionConfig { workers: 16, max_inflight_bytes: 64 << 20, max_inflight_requests: 128 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TransmissionError {
    #[error("Socket read failed while reading a {what}")]
    Read {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("Client hung up in the middle of a {what}")]
    Truncated { what: &'static str },
    #[error("Socket write failed while replying to handle {handle:#x}")]
    Write {
        handle: u64,
        #[source]
        source: io::Error,
    },
    #[error("No worker thread could be started for the connection")]
    NoWorkers,
    #[error("Malformed request; closing the connection")]
    Protocol {
        #[source]
        source: ProtoError,
    },
}

/// How a transmission phase ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// `NBD_CMD_DISC` (soft disconnect).
    Disconnect,
    /// EOF at a request boundary (hard disconnect by the client, or server shutdown).
    Hangup,
}

/// Counters for one connection, readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
}

/// What the session allows, copied out of `Negotiated` so `check_request` stays pure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub size: u64,
    pub tflags: u16,
    pub structured: bool,
    pub base_allocation: bool,
    pub can_fast_zero: bool,
    pub min_block: u32,
    pub max_block: u32,
}

impl Limits {
    pub fn of(n: &Negotiated) -> Limits {
        Limits {
            size: n.size,
            tflags: n.tflags,
            structured: n.structured,
            base_allocation: n.base_allocation.is_some(),
            can_fast_zero: n.export.can_fast_zero(),
            min_block: n.block_size.min,
            max_block: n.block_size.max,
        }
    }
}

/// A request that passed `check_request`, with its flags decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Read { df: bool },
    Write { fua: bool },
    Flush,
    Trim { fua: bool },
    WriteZeroes { fua: bool, may_trim: bool },
    BlockStatus { req_one: bool },
    Cache,
    Disconnect,
}

/// Why a request is refused before reaching the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub errno: NbdErrno,
    pub reason: &'static str,
}

fn reject(errno: NbdErrno, reason: &'static str) -> Rejection {
    Rejection { errno, reason }
}

/// Validate a request header against the session. Pure; the `nbd_request` fuzz target calls
/// it on every header that parses. Errors follow the spec's SHOULDs: unknown commands and
/// flags EINVAL, writes past the end ENOSPC, reads/trims/status past the end EINVAL, writes on
/// a read-only export EPERM, fast zero that cannot be fast ENOTSUP.
pub fn check_request(r: &Request, l: &Limits) -> Result<Action, Rejection> {
    use NbdErrno::*;
    let has = |f: u16| l.tflags & f != 0;
    let ro = has(TFLAG_READ_ONLY);
    let mut allowed = if has(TFLAG_SEND_FUA) { CMD_FLAG_FUA } else { 0 };
    match r.command {
        Command::Read if has(TFLAG_SEND_DF) => allowed |= CMD_FLAG_DF,
        Command::WriteZeroes => {
            allowed |= CMD_FLAG_NO_HOLE;
            if has(TFLAG_SEND_FAST_ZERO) {
                allowed |= CMD_FLAG_FAST_ZERO;
            }
        }
        Command::BlockStatus => allowed |= CMD_FLAG_REQ_ONE,
        Command::Disc => allowed = u16::MAX,
        Command::Unknown(_) => return Err(reject(Inval, "unknown command")),
        _ => {}
    }
    if r.flags & !allowed != 0 {
        return Err(reject(Inval, "command flag not valid for this command or not negotiated"));
    }
    let fua = r.flags & CMD_FLAG_FUA != 0;
    let len = r.len as u64;
    let in_range = r.offset.checked_add(len).is_some_and(|end| end <= l.size);
    let aligned = l.min_block <= 1
        || (r.offset.is_multiple_of(l.min_block as u64) && len.is_multiple_of(l.min_block as u64));
    match r.command {
        Command::Read => {
            if r.len > l.max_block {
                return Err(reject(Inval, "read longer than the maximum block size"));
            }
            if !in_range {
                return Err(reject(Inval, "read beyond the end of the export"));
            }
            if !aligned {
                return Err(reject(Inval, "read not aligned to the minimum block size"));
            }
            Ok(Action::Read { df: r.flags & CMD_FLAG_DF != 0 })
        }
        Command::Write => {
            if ro {
                return Err(reject(Perm, "export is read-only"));
            }
            if r.len > l.max_block {
                return Err(reject(Inval, "write longer than the maximum block size"));
            }
            if !in_range {
                return Err(reject(NoSpc, "write beyond the end of the export"));
            }
            if !aligned {
                return Err(reject(Inval, "write not aligned to the minimum block size"));
            }
            Ok(Action::Write { fua })
        }
        Command::Flush => Ok(Action::Flush),
        Command::Trim => {
            if ro {
                return Err(reject(Perm, "export is read-only"));
            }
            if !has(TFLAG_SEND_TRIM) {
                return Err(reject(Inval, "trim was not negotiated"));
            }
            if !in_range {
                return Err(reject(Inval, "trim beyond the end of the export"));
            }
            if !aligned {
                return Err(reject(Inval, "trim not aligned to the minimum block size"));
            }
            Ok(Action::Trim { fua })
        }
        Command::WriteZeroes => {
            if ro {
                return Err(reject(Perm, "export is read-only"));
            }
            if !in_range {
                return Err(reject(NoSpc, "write zeroes beyond the end of the export"));
            }
            if !aligned {
                return Err(reject(Inval, "write zeroes not aligned to the minimum block size"));
            }
            if r.flags & CMD_FLAG_FAST_ZERO != 0 && !l.can_fast_zero {
                return Err(reject(NotSup, "export cannot zero faster than it writes"));
            }
            Ok(Action::WriteZeroes { fua, may_trim: r.flags & CMD_FLAG_NO_HOLE == 0 })
        }
        Command::BlockStatus => {
            if !l.base_allocation {
                return Err(reject(Inval, "no metadata context was negotiated"));
            }
            if r.len == 0 {
                return Err(reject(Inval, "block status of zero length"));
            }
            if !in_range {
                return Err(reject(Inval, "block status beyond the end of the export"));
            }
            Ok(Action::BlockStatus { req_one: r.flags & CMD_FLAG_REQ_ONE != 0 })
        }
        Command::Cache => {
            if !in_range {
                return Err(reject(Inval, "cache beyond the end of the export"));
            }
            Ok(Action::Cache)
        }
        Command::Disc => Ok(Action::Disconnect),
        Command::Unknown(_) => Err(reject(Inval, "unknown command")),
    }
}

/// Turn an export's extents into wire descriptors for `[offset, offset + len)`: drops empty
/// extents, clips to the request, merges equal neighbours, caps the count, and falls back to
/// one "allocated" descriptor when the export returned nothing usable.
pub fn block_status_descriptors(extents: &[Extent], len: u32, req_one: bool) -> Vec<Descriptor> {
    let mut out: Vec<Descriptor> = Vec::new();
    let mut left = len as u64;
    for e in extents {
        if left == 0 || out.len() >= MAX_EXTENTS {
            break;
        }
        if e.len == 0 {
            continue;
        }
        let n = e.len.min(left);
        left -= n;
        let flags = (if e.hole { STATE_HOLE } else { 0 }) | (if e.zero { STATE_ZERO } else { 0 });
        match out.last_mut() {
            Some(d) if d.flags == flags => d.len += n as u32,
            _ => out.push(Descriptor { len: n as u32, flags }),
        }
    }
    if out.is_empty() {
        out.push(Descriptor { len, flags: 0 });
    }
    if req_one {
        out.truncate(1);
    }
    out
}

struct Job {
    req: Request,
    action: Action,
    payload: Vec<u8>,
    cost: usize,
}

struct QueueState {
    jobs: VecDeque<Job>,
    closed: bool,
    bytes: usize,
    requests: usize,
}

struct Queue {
    state: Mutex<QueueState>,
    work: Condvar,
    space: Condvar,
    max_bytes: usize,
    max_requests: usize,
}

impl Queue {
    fn new(cfg: &TransmissionConfig) -> Queue {
        Queue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::new(),
                closed: false,
                bytes: 0,
                requests: 0,
            }),
            work: Condvar::new(),
            space: Condvar::new(),
            max_bytes: cfg.max_inflight_bytes.max(1),
            max_requests: cfg.max_inflight_requests.max(1),
        }
    }

    /// Block until `cost` bytes and one request slot fit in the budget, then take them.
    fn reserve(&self, cost: usize) {
        let mut s = self.state.lock();
        while s.requests >= self.max_requests || (s.bytes > 0 && s.bytes + cost > self.max_bytes) {
            self.space.wait(&mut s);
        }
        s.bytes += cost;
        s.requests += 1;
    }

    fn release(&self, cost: usize) {
        let mut s = self.state.lock();
        s.bytes -= cost;
        s.requests -= 1;
        drop(s);
        self.space.notify_one();
    }

    fn push(&self, job: Job) {
        self.state.lock().jobs.push_back(job);
        self.work.notify_one();
    }

    fn pop(&self) -> Option<Job> {
        let mut s = self.state.lock();
        loop {
            if let Some(j) = s.jobs.pop_front() {
                return Some(j);
            }
            if s.closed {
                return None;
            }
            self.work.wait(&mut s);
        }
    }

    fn close(&self) {
        self.state.lock().closed = true;
        self.work.notify_all();
    }
}

/// Shared by the reader and the workers of one connection.
struct Conn<'a, W: Write> {
    writer: Mutex<W>,
    broken: AtomicBool,
    n: &'a Negotiated,
    export: &'a dyn Export,
    stats: &'a Stats,
    hangup: &'a Hangup,
    /// The export answered ESHUTDOWN and the hangup was called.
    revoked: AtomicBool,
}

impl<W: Write> Conn<'_, W> {
    fn send(&self, handle: u64, bytes: &[u8]) -> Result<(), TransmissionError> {
        if self.broken.load(Ordering::Relaxed) {
            return Ok(());
        }
        let r = self.writer.lock().write_all(bytes);
        r.map_err(|source| {
            self.broken.store(true, Ordering::Relaxed);
            TransmissionError::Write { handle, source }
        })
    }

    /// An error reply: a structured ERROR chunk (with message) when negotiated, else simple.
    fn send_error(
        &self,
        req: &Request,
        errno: NbdErrno,
        message: &str,
    ) -> Result<(), TransmissionError> {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(target: TARGET, export = %self.n.name, cmd = req.command.name(), offset = req.offset,
            len = req.len, errno = %errno, message, "request failed");
        if self.n.structured {
            let payload = encode_error_payload(errno, message);
            let mut b = encode_chunk_header(
                REPLY_FLAG_DONE,
                REPLY_TYPE_ERROR,
                req.handle,
                payload.len() as u32,
            )
            .to_vec();
            b.extend_from_slice(&payload);
            self.send(req.handle, &b)
        } else {
            self.send(req.handle, &encode_simple_reply(req.handle, errno.code()))
        }
    }

    fn send_ok(&self, handle: u64) -> Result<(), TransmissionError> {
        self.send(handle, &encode_simple_reply(handle, 0))
    }

    fn export_error(&self, req: &Request, e: &ExportError) -> Result<(), TransmissionError> {
        let mut errno = e.errno();
        // ENOTSUP is reserved for refusing WRITE_ZEROES with FAST_ZERO; the spec forbids it
        // anywhere else (even for WRITE_ZEROES without the flag), so report EINVAL there.
        let fast_zero = req.command == Command::WriteZeroes && req.flags & CMD_FLAG_FAST_ZERO != 0;
        if errno == NbdErrno::NotSup && !fast_zero {
            errno = NbdErrno::Inval;
        }
        if errno == NbdErrno::Shutdown {
            let r = self.send_error(req, errno, &e.to_string());
            if !self.revoked.swap(true, Ordering::AcqRel) {
                tracing::info!(target: TARGET, export = %self.n.name, "export withdrawn; closing the connection");
                (self.hangup)();
            }
            return r;
        }
        tracing::warn!(target: TARGET, export = %self.n.name, cmd = req.command.name(), offset = req.offset,
            len = req.len, error = %e, "export operation failed");
        self.send_error(req, errno, &e.to_string())
    }

    fn execute(&self, job: Job) -> Result<(), TransmissionError> {
        let req = &job.req;
        let len = req.len as u64;
        match job.action {
            Action::Read { .. } => {
                // One buffer holds the reply header and the data: one allocation, one write.
                let prefix =
                    if self.n.structured { CHUNK_HEADER_LEN + 8 } else { SIMPLE_REPLY_LEN };
                if self.n.structured && req.len == 0 {
                    return self.send(
                        req.handle,
                        &encode_chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, req.handle, 0),
                    );
                }
                let mut buf = vec![0u8; prefix + req.len as usize];
                if let Err(e) = self.export.read(req.offset, &mut buf[prefix..]) {
                    return self.export_error(req, &e);
                }
                if self.n.structured {
                    let h = encode_chunk_header(
                        REPLY_FLAG_DONE,
                        REPLY_TYPE_OFFSET_DATA,
                        req.handle,
                        8 + req.len,
                    );
                    buf[..CHUNK_HEADER_LEN].copy_from_slice(&h);
                    buf[CHUNK_HEADER_LEN..prefix].copy_from_slice(&req.offset.to_be_bytes());
                } else {
                    buf[..prefix].copy_from_slice(&encode_simple_reply(req.handle, 0));
                }
                self.stats.bytes_read.fetch_add(len, Ordering::Relaxed);
                self.send(req.handle, &buf)
            }
            Action::Write { fua } => match self.export.write(req.offset, &job.payload, fua) {
                Ok(()) => {
                    self.stats.bytes_written.fetch_add(len, Ordering::Relaxed);
                    self.send_ok(req.handle)
                }
                Err(e) => self.export_error(req, &e),
            },
            Action::Flush => match self.export.flush() {
                Ok(()) => self.send_ok(req.handle),
                Err(e) => self.export_error(req, &e),
            },
            Action::Trim { fua } => match self.export.trim(req.offset, len, fua) {
                Ok(()) => self.send_ok(req.handle),
                Err(e) => self.export_error(req, &e),
            },
            Action::WriteZeroes { fua, may_trim } => {
                match self.export.write_zeroes(req.offset, len, may_trim, fua) {
                    Ok(()) => self.send_ok(req.handle),
                    Err(e) => self.export_error(req, &e),
                }
            }
            Action::BlockStatus { req_one } => {
                let extents = match self.export.block_status(req.offset, req.len) {
                    Ok(x) => x,
                    Err(e) => return self.export_error(req, &e),
                };
                let id = self.n.base_allocation.unwrap_or(0);
                let payload = encode_block_status_payload(
                    id,
                    &block_status_descriptors(&extents, req.len, req_one),
                );
                let h = encode_chunk_header(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_BLOCK_STATUS,
                    req.handle,
                    payload.len() as u32,
                );
                let mut b = Vec::with_capacity(CHUNK_HEADER_LEN + payload.len());
                b.extend_from_slice(&h);
                b.extend_from_slice(&payload);
                self.send(req.handle, &b)
            }
            Action::Cache => self.send_ok(req.handle),
            Action::Disconnect => Ok(()),
        }
    }
}

fn worker<W: Write>(queue: &Queue, conn: &Conn<'_, W>) {
    while let Some(job) = queue.pop() {
        let cost = job.cost;
        if let Err(e) = conn.execute(job) {
            tracing::debug!(target: TARGET, error = %e, "reply not delivered");
        }
        queue.release(cost);
    }
}

fn read_full<R: Read>(
    r: &mut R,
    buf: &mut [u8],
    what: &'static str,
    at_boundary: bool,
) -> Result<bool, TransmissionError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 && at_boundary => return Ok(false),
            Ok(0) => return Err(TransmissionError::Truncated { what }),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => return Err(TransmissionError::Read { what, source }),
        }
    }
    Ok(true)
}

/// A connection's byte stream. Write payloads are appended with [`Source::read_append`],
/// which sockets implement by reading into the buffer's uninitialised capacity (std's
/// `read_to_end` on a `UnixStream`/`TcpStream` does not zero it first); the default, for any
/// other reader, zeroes. Zeroing a 1 MiB buffer per write costs ~3% of all CPU under
/// sustained 1 MiB writes.
pub trait Source: Read {
    /// Append up to `n` bytes to `v`; 0 only at the end of the stream.
    fn read_append(&mut self, v: &mut Vec<u8>, n: usize) -> io::Result<usize> {
        Read::take(&mut *self, n as u64).read_to_end(v)
    }
}

/// Read a write's payload of `len` bytes into a new buffer: first what `r` has buffered, then
/// the rest straight from the connection.
fn read_payload<R: Source>(r: &mut BufReader<R>, len: usize) -> Result<Vec<u8>, TransmissionError> {
    let mut v = Vec::with_capacity(len);
    let k = r.buffer().len().min(len);
    v.extend_from_slice(&r.buffer()[..k]);
    r.consume(k);
    while v.len() < len {
        let want = len - v.len();
        match r.get_mut().read_append(&mut v, want) {
            Ok(0) => return Err(TransmissionError::Truncated { what: "write payload" }),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => return Err(TransmissionError::Read { what: "write payload", source }),
        }
    }
    Ok(v)
}

fn drain<R: Read>(r: &mut R, mut len: u64) -> Result<(), TransmissionError> {
    let mut scratch = [0u8; 64 * 1024];
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        read_full(r, &mut scratch[..n], "write payload", false)?;
        len -= n as u64;
    }
    Ok(())
}

fn read_loop<R: Source, W: Write>(
    reader: &mut BufReader<R>,
    queue: &Queue,
    conn: &Conn<'_, W>,
    limits: &Limits,
) -> Result<Ending, TransmissionError> {
    let mut header = [0u8; REQUEST_LEN];
    loop {
        if !read_full(reader, &mut header, "request header", true)? {
            return Ok(Ending::Hangup);
        }
        let req =
            parse_request(&header).map_err(|source| TransmissionError::Protocol { source })?;
        conn.stats.requests.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(target: TARGET, cmd = req.command.name(), handle = req.handle, offset = req.offset, len = req.len, flags = req.flags, "request");
        let action = match check_request(&req, limits) {
            Ok(a) => a,
            Err(rej) => {
                if req.command == Command::Write {
                    drain(reader, req.len as u64)?;
                }
                // A failed reply write means the client is gone; the next read will notice.
                let _ = conn.send_error(&req, rej.errno, rej.reason);
                continue;
            }
        };
        if action == Action::Disconnect {
            tracing::debug!(target: TARGET, export = %conn.n.name, "client sent NBD_CMD_DISC");
            return Ok(Ending::Disconnect);
        }
        let cost = match action {
            Action::Read { .. } | Action::Write { .. } => req.len as usize,
            _ => 0,
        };
        queue.reserve(cost);
        let mut payload = Vec::new();
        if let Action::Write { .. } = action {
            payload = match read_payload(reader, req.len as usize) {
                Ok(p) => p,
                Err(e) => {
                    queue.release(cost);
                    return Err(e);
                }
            };
        }
        queue.push(Job { req, action, payload, cost });
    }
}

/// Run the transmission phase until the client disconnects. `reader` and `writer` are the two
/// halves of the connection; the function returns after all queued requests are answered.
/// `hangup` must make `reader` report EOF (the server shuts the socket down for reading): it
/// is handed to the export (`Export::on_revoke`) and called after an ESHUTDOWN reply.
pub fn serve_transmission<R: Source, W: Write + Send>(
    reader: R,
    writer: W,
    n: &Negotiated,
    cfg: &TransmissionConfig,
    stats: &Stats,
    hangup: &Hangup,
) -> Result<Ending, TransmissionError> {
    debug_assert!(MAX_REQUEST_LEN as usize <= 64 << 20);
    let limits = Limits::of(n);
    let queue = Queue::new(cfg);
    let conn = Conn {
        writer: Mutex::new(writer),
        broken: AtomicBool::new(false),
        n,
        export: n.export.as_ref(),
        stats,
        hangup,
        revoked: AtomicBool::new(false),
    };
    n.export.on_revoke(hangup);
    let mut reader = BufReader::with_capacity(64 * 1024, reader);
    thread::scope(|s| {
        let mut started = 0;
        for i in 0..cfg.workers.max(1) {
            let (queue, conn) = (&queue, &conn);
            match thread::Builder::new()
                .name(format!("nbd-worker-{i}"))
                .spawn_scoped(s, move || worker(queue, conn))
            {
                Ok(_) => started += 1,
                Err(e) => {
                    tracing::warn!(target: TARGET, error = %e, "could not start an NBD worker thread")
                }
            }
        }
        if started == 0 {
            return Err(TransmissionError::NoWorkers);
        }
        let result = read_loop(&mut reader, &queue, &conn, &limits);
        queue.close();
        // Help the workers finish what is queued; they exit when the queue is empty.
        worker(&queue, &conn);
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            size: 1 << 20,
            tflags: TFLAG_HAS_FLAGS
                | TFLAG_SEND_FLUSH
                | TFLAG_SEND_FUA
                | TFLAG_SEND_TRIM
                | TFLAG_SEND_WRITE_ZEROES
                | TFLAG_SEND_FAST_ZERO
                | TFLAG_SEND_DF,
            structured: true,
            base_allocation: true,
            can_fast_zero: false,
            min_block: 1,
            max_block: MAX_REQUEST_LEN,
        }
    }

    fn req(command: Command, flags: u16, offset: u64, len: u32) -> Request {
        Request { flags, command, handle: 1, offset, len }
    }

    fn errno(r: Result<Action, Rejection>) -> NbdErrno {
        r.unwrap_err().errno
    }

    #[test]
    fn range_and_length_checks() {
        let l = limits();
        assert_eq!(
            check_request(&req(Command::Read, 0, 0, 4096), &l),
            Ok(Action::Read { df: false })
        );
        assert_eq!(
            check_request(&req(Command::Read, CMD_FLAG_DF, (1 << 20) - 1, 1), &l),
            Ok(Action::Read { df: true })
        );
        assert_eq!(errno(check_request(&req(Command::Read, 0, 1 << 20, 1), &l)), NbdErrno::Inval);
        assert_eq!(errno(check_request(&req(Command::Read, 0, u64::MAX, 2), &l)), NbdErrno::Inval);
        assert_eq!(
            errno(check_request(&req(Command::Read, 0, 0, MAX_REQUEST_LEN + 1), &l)),
            NbdErrno::Inval
        );
        assert_eq!(errno(check_request(&req(Command::Write, 0, 1 << 20, 1), &l)), NbdErrno::NoSpc);
        assert_eq!(
            errno(check_request(&req(Command::WriteZeroes, 0, 1 << 20, 1), &l)),
            NbdErrno::NoSpc
        );
        assert_eq!(errno(check_request(&req(Command::Trim, 0, 1 << 20, 1), &l)), NbdErrno::Inval);
        assert_eq!(errno(check_request(&req(Command::BlockStatus, 0, 0, 0), &l)), NbdErrno::Inval);
        assert_eq!(
            errno(check_request(&req(Command::BlockStatus, 0, 1, 1 << 20), &l)),
            NbdErrno::Inval
        );
        assert_eq!(check_request(&req(Command::Flush, CMD_FLAG_FUA, 0, 0), &l), Ok(Action::Flush));
        assert_eq!(check_request(&req(Command::Disc, 0xffff, 0, 0), &l), Ok(Action::Disconnect));
    }

    #[test]
    fn flag_and_command_checks() {
        let mut l = limits();
        assert_eq!(errno(check_request(&req(Command::Unknown(42), 0, 0, 0), &l)), NbdErrno::Inval);
        assert_eq!(
            errno(check_request(&req(Command::Read, CMD_FLAG_REQ_ONE, 0, 1), &l)),
            NbdErrno::Inval
        );
        assert_eq!(
            errno(check_request(&req(Command::Write, CMD_FLAG_NO_HOLE, 0, 1), &l)),
            NbdErrno::Inval
        );
        assert_eq!(errno(check_request(&req(Command::Read, 1 << 9, 0, 1), &l)), NbdErrno::Inval);
        assert_eq!(
            check_request(&req(Command::WriteZeroes, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 0, 10), &l),
            Ok(Action::WriteZeroes { fua: true, may_trim: false })
        );
        // Fast zero: refused with ENOTSUP when the export cannot zero fast, allowed otherwise.
        assert_eq!(
            errno(check_request(&req(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 0, 10), &l)),
            NbdErrno::NotSup
        );
        l.can_fast_zero = true;
        assert!(check_request(&req(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 0, 10), &l).is_ok());
        // Without SEND_FAST_ZERO the flag itself is invalid.
        l.tflags &= !TFLAG_SEND_FAST_ZERO;
        assert_eq!(
            errno(check_request(&req(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 0, 10), &l)),
            NbdErrno::Inval
        );
        // DF only when advertised.
        l.tflags &= !TFLAG_SEND_DF;
        assert_eq!(
            errno(check_request(&req(Command::Read, CMD_FLAG_DF, 0, 1), &l)),
            NbdErrno::Inval
        );
        // Block status needs a context.
        l.base_allocation = false;
        assert_eq!(errno(check_request(&req(Command::BlockStatus, 0, 0, 1), &l)), NbdErrno::Inval);
        // Trim not negotiated.
        l.tflags &= !TFLAG_SEND_TRIM;
        assert_eq!(errno(check_request(&req(Command::Trim, 0, 0, 1), &l)), NbdErrno::Inval);
    }

    #[test]
    fn read_only_and_alignment() {
        let mut l = limits();
        l.tflags = TFLAG_HAS_FLAGS | TFLAG_READ_ONLY | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA;
        assert_eq!(errno(check_request(&req(Command::Write, 0, 0, 1), &l)), NbdErrno::Perm);
        assert_eq!(errno(check_request(&req(Command::Trim, 0, 0, 1), &l)), NbdErrno::Perm);
        assert_eq!(errno(check_request(&req(Command::WriteZeroes, 0, 0, 1), &l)), NbdErrno::Perm);
        assert!(check_request(&req(Command::Read, 0, 0, 1), &l).is_ok());
        // Read-only wins even over inconsistent flags (found by the nbd_request fuzz target).
        l.tflags |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES;
        assert_eq!(errno(check_request(&req(Command::Trim, 0, 0, 1), &l)), NbdErrno::Perm);
        assert_eq!(errno(check_request(&req(Command::WriteZeroes, 0, 0, 1), &l)), NbdErrno::Perm);
        let mut l = limits();
        l.min_block = 512;
        assert_eq!(errno(check_request(&req(Command::Read, 0, 1, 512), &l)), NbdErrno::Inval);
        assert_eq!(errno(check_request(&req(Command::Write, 0, 0, 100), &l)), NbdErrno::Inval);
        assert!(check_request(&req(Command::Write, 0, 512, 1024), &l).is_ok());
    }

    /// Hands out at most 7 bytes per read, with an interruption before each.
    struct Dribble<'a> {
        data: &'a [u8],
        interrupt: bool,
    }
    impl Read for Dribble<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.interrupt = !self.interrupt;
            if self.interrupt {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let n = buf.len().min(self.data.len()).min(7);
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    impl Source for Dribble<'_> {}

    #[test]
    fn write_payloads_are_read_whole_and_short_ones_are_refused() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut r = BufReader::with_capacity(100, Dribble { data: &data, interrupt: false });
        // Part of the stream sits in the reader's buffer, as after a request header.
        let mut head = [0u8; 3];
        read_full(&mut r, &mut head, "header", true).unwrap();
        assert_eq!(head, data[..3]);
        assert!(!r.buffer().is_empty());
        assert_eq!(read_payload(&mut r, 65_536).unwrap(), data[3..65_539]);
        // The rest of the stream is left for the next request.
        assert_eq!(read_payload(&mut r, 34_461).unwrap(), data[65_539..]);
        assert!(read_payload(&mut r, 0).unwrap().is_empty());
        let mut short = BufReader::new(Dribble { data: &data[..1000], interrupt: false });
        assert!(matches!(
            read_payload(&mut short, 1001),
            Err(TransmissionError::Truncated { what: "write payload" })
        ));
    }

    #[test]
    fn socket_payloads_are_read_into_spare_capacity() {
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13) as u8).collect();
        let sent = data.clone();
        let t = std::thread::spawn(move || b.write_all(&sent).unwrap());
        let mut r = BufReader::new(super::super::server::Stream::Unix(a));
        assert_eq!(read_payload(&mut r, 200_000).unwrap(), data[..200_000]);
        assert_eq!(read_payload(&mut r, 100_000).unwrap(), data[200_000..]);
        t.join().unwrap();
        assert!(matches!(read_payload(&mut r, 1), Err(TransmissionError::Truncated { .. })));
    }

    #[test]
    fn descriptors_are_clipped_merged_and_never_empty() {
        let x = [
            Extent::data(100),
            Extent::data(0),
            Extent::data(50),
            Extent::hole(1000),
            Extent::zero(10),
        ];
        let d = block_status_descriptors(&x, 400, false);
        assert_eq!(
            d,
            vec![
                Descriptor { len: 150, flags: 0 },
                Descriptor { len: 250, flags: STATE_HOLE | STATE_ZERO }
            ]
        );
        assert_eq!(
            block_status_descriptors(&x, 400, true),
            vec![Descriptor { len: 150, flags: 0 }]
        );
        assert_eq!(block_status_descriptors(&[], 7, false), vec![Descriptor { len: 7, flags: 0 }]);
        assert_eq!(
            block_status_descriptors(&[Extent::hole(0)], 7, false),
            vec![Descriptor { len: 7, flags: 0 }]
        );
        // Short answers are allowed: the client asks again for the rest.
        assert_eq!(
            block_status_descriptors(&[Extent::zero(3)], 7, false),
            vec![Descriptor { len: 3, flags: STATE_ZERO }]
        );
        let many: Vec<Extent> = (0..(MAX_EXTENTS + 10))
            .map(|i| if i % 2 == 0 { Extent::data(1) } else { Extent::hole(1) })
            .collect();
        assert_eq!(block_status_descriptors(&many, u32::MAX, false).len(), MAX_EXTENTS);
    }
}

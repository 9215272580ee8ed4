//! Test support for the NBD server: two test-only exports, a minimal NBD client, and helpers
//! to start servers and run real peers (qemu-img, qemu-io, libnbd tools, fio).
//!
//! `FileExport` serves a sparse file with positional I/O, punch-hole trim and
//! SEEK_DATA/SEEK_HOLE block status, the closest stand-in for a real disk. `MemExport`
//! implements only the required methods, so it exercises the trait's defaults (write_zeroes
//! by writing, "all data" block status, no trim). The client is deliberately small and
//! strict: it checks magics, handles and chunk rules, so it doubles as a protocol checker.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command as Cmd, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use strata::nbd::export::{
    BlockSize, Export, ExportError, ExportInfo, ExportSet, Extent, OpenError,
};
use strata::nbd::proto::*;
use strata::nbd::{Server, ServerConfig, ServerHandle};

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("STRATA_LOG"))
        .with_test_writer()
        .try_init();
}

// ---------------------------------------------------------------------------------------
// Exports

/// A sparse regular file.
pub struct FileExport {
    file: File,
    size: u64,
    read_only: bool,
}

impl FileExport {
    pub fn create(path: &Path, size: u64) -> FileExport {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap();
        file.set_len(size).unwrap();
        FileExport { file, size, read_only: false }
    }

    pub fn open(path: &Path, read_only: bool) -> FileExport {
        let file = OpenOptions::new().read(true).write(!read_only).open(path).unwrap();
        let size = file.metadata().unwrap().len();
        FileExport { file, size, read_only }
    }

    fn fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain syscall on a descriptor we own.
        let r = unsafe {
            libc::fallocate(self.file.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t)
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn seek(&self, offset: u64, whence: i32) -> io::Result<Option<u64>> {
        // SAFETY: lseek on our descriptor; we only use positional I/O, so the offset is unused.
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), offset as libc::off_t, whence) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                return Ok(None);
            }
            return Err(e);
        }
        Ok(Some(r as u64))
    }
}

impl Export for FileExport {
    fn size(&self) -> u64 {
        self.size
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.file.read_exact_at(buf, offset).map_err(|e| ExportError::io("read", offset, e))
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.file.write_all_at(data, offset).map_err(|e| ExportError::io("write", offset, e))?;
        if fua {
            self.file.sync_data().map_err(|e| ExportError::io("fua", offset, e))?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.file.sync_data().map_err(|e| ExportError::io("flush", 0, e))
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
    fn description(&self) -> Option<String> {
        Some("sparse test file".into())
    }
    fn can_trim(&self) -> bool {
        true
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
            .map_err(|e| ExportError::io("trim", offset, e))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }
    fn can_zero(&self) -> bool {
        true
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> Result<(), ExportError> {
        let mode = if may_trim {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        self.fallocate(mode, offset, len)
            .map_err(|e| ExportError::io("write-zeroes", offset, e))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }
    fn can_multi_conn(&self) -> bool {
        true
    }
    fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, ExportError> {
        let end = (offset + len as u64).min(self.size);
        let mut pos = offset;
        let mut out = Vec::new();
        let err = |e| ExportError::io("block-status", offset, e);
        while pos < end {
            match self.seek(pos, libc::SEEK_DATA).map_err(err)? {
                None => {
                    out.push(Extent::hole(end - pos));
                    break;
                }
                Some(d) if d > pos => {
                    let d = d.min(end);
                    out.push(Extent::hole(d - pos));
                    pos = d;
                }
                Some(_) => {
                    let h = self.seek(pos, libc::SEEK_HOLE).map_err(err)?.unwrap_or(end).min(end);
                    out.push(Extent::data(h - pos));
                    pos = h;
                }
            }
        }
        Ok(out)
    }
}

/// In-memory disk implementing only the required methods (plus multi-conn).
pub struct MemExport {
    data: RwLock<Vec<u8>>,
    pub min_block: u32,
}

impl MemExport {
    pub fn new(size: usize) -> MemExport {
        MemExport { data: RwLock::new(vec![0; size]), min_block: 1 }
    }
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().clone()
    }
}

impl Export for MemExport {
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        let d = self.data.read();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), ExportError> {
        let mut d = self.data.write();
        d[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn can_multi_conn(&self) -> bool {
        true
    }
    fn block_size(&self) -> BlockSize {
        BlockSize { min: self.min_block, ..BlockSize::default() }
    }
}

/// Fails every I/O with a chosen host errno, to check error mapping end to end.
pub struct FailingExport {
    pub errno: i32,
}

impl Export for FailingExport {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read(&self, offset: u64, _buf: &mut [u8]) -> Result<(), ExportError> {
        Err(ExportError::io("read", offset, io::Error::from_raw_os_error(self.errno)))
    }
    fn write(&self, offset: u64, _data: &[u8], _fua: bool) -> Result<(), ExportError> {
        Err(ExportError::io("write", offset, io::Error::from_raw_os_error(self.errno)))
    }
    fn flush(&self) -> Result<(), ExportError> {
        Err(ExportError::io("flush", 0, io::Error::from_raw_os_error(self.errno)))
    }
}

/// Delays every write, to make the export slower than the client.
pub struct SlowExport<E: Export> {
    pub inner: E,
    pub delay: Duration,
}

impl<E: Export> Export for SlowExport<E> {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        std::thread::sleep(self.delay);
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.inner.flush()
    }
}

/// A fixed map of names to exports.
#[derive(Default)]
pub struct Exports {
    map: RwLock<HashMap<String, Arc<dyn Export>>>,
}

impl Exports {
    pub fn new() -> Arc<Exports> {
        Arc::new(Exports::default())
    }
    pub fn add(self: &Arc<Self>, name: &str, e: Arc<dyn Export>) -> Arc<Self> {
        self.map.write().insert(name.to_string(), e);
        self.clone()
    }
}

impl ExportSet for Exports {
    fn list(&self) -> Vec<ExportInfo> {
        let mut v: Vec<ExportInfo> = self
            .map
            .read()
            .iter()
            .map(|(k, e)| ExportInfo { name: k.clone(), description: e.description() })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, OpenError> {
        self.map
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| OpenError::NotFound { name: name.to_string() })
    }
}

// ---------------------------------------------------------------------------------------
// Servers and processes

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub handle: Option<ServerHandle>,
}

impl TestServer {
    pub fn start(exports: Arc<dyn ExportSet>) -> TestServer {
        TestServer::start_with(exports, ServerConfig::default())
    }
    pub fn start_with(exports: Arc<dyn ExportSet>, cfg: ServerConfig) -> TestServer {
        init_tracing();
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        let handle = Server::bind_unix(&sock).unwrap().with_config(cfg).serve(exports).unwrap();
        TestServer { dir, sock, handle: Some(handle) }
    }
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.sock.display())
    }
    pub fn handle(&self) -> &ServerHandle {
        self.handle.as_ref().unwrap()
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// Fail with a message that names the Debian package when a peer tool is missing.
pub fn require_tool(tool: &str, package: &str) {
    let ok = Cmd::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(ok, "{tool} is required for this test: apt-get install {package}");
}

/// Run a command with a timeout; panics with its output on failure.
pub fn run(cmd: &mut Cmd) -> Output {
    let out = run_status(cmd, Duration::from_secs(300));
    assert!(
        out.status.success(),
        "{:?} failed: {}\nstdout: {}\nstderr: {}",
        cmd,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn run_status(cmd: &mut Cmd, timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let t1 = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stdout.read_to_end(&mut v);
        v
    });
    let t2 = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} timed out after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output { status, stdout: t1.join().unwrap(), stderr: t2.join().unwrap() }
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A qemu-nbd child serving a raw file, killed on drop.
pub struct QemuNbd {
    pub child: std::process::Child,
    pub sock: PathBuf,
}

impl QemuNbd {
    pub fn start(file: &Path, sock: &Path, name: &str, extra: &[&str]) -> QemuNbd {
        require_tool("qemu-nbd", "qemu-utils");
        let child = Cmd::new("qemu-nbd")
            .args(["-f", "raw", "-t", "-x", name, "-k"])
            .arg(sock)
            .args(extra)
            .arg(file)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while UnixStream::connect(sock).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "qemu-nbd did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        QemuNbd { child, sock: sock.to_path_buf() }
    }
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.sock.display())
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deterministic pseudo-random bytes (xorshift), for patterns that are not all one byte.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Minimal NBD client

#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Ok,
    Data(Vec<u8>),
    Status(Vec<Descriptor>),
    Error(u32, String),
}

pub struct Client {
    pub s: UnixStream,
    pub size: u64,
    pub tflags: u16,
    pub structured: bool,
    pub meta_id: Option<u32>,
    pub block: (u32, u32, u32),
    next: u64,
    /// Lengths of outstanding reads, by handle (needed to parse simple replies).
    pending_reads: HashMap<u64, (u64, u32)>,
}

pub fn read_exact(s: &mut impl Read, n: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn be32(b: &[u8]) -> u32 {
    strata::endian::be32(b, 0)
}

impl Client {
    /// Connect and negotiate with NBD_OPT_GO.
    pub fn connect(sock: &Path, name: &str, structured: bool, meta: bool) -> io::Result<Client> {
        let mut s = UnixStream::connect(sock)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let g = read_exact(&mut s, 18)?;
        assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
        let mut c = Client {
            s,
            size: 0,
            tflags: 0,
            structured: false,
            meta_id: None,
            block: (0, 0, 0),
            next: 1,
            pending_reads: HashMap::new(),
        };
        if structured {
            let r = c.option(OPT_STRUCTURED_REPLY, &[])?;
            assert_eq!(r, vec![(REP_ACK, vec![])]);
            c.structured = true;
        }
        if meta {
            let mut d = (name.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(&1u32.to_be_bytes());
            d.extend_from_slice(&15u32.to_be_bytes());
            d.extend_from_slice(b"base:allocation");
            for (rep, data) in c.option(OPT_SET_META_CONTEXT, &d)? {
                if rep == REP_META_CONTEXT {
                    assert_eq!(&data[4..], b"base:allocation");
                    c.meta_id = Some(be32(&data));
                }
            }
        }
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        let replies = c.option(OPT_GO, &d)?;
        let (last, msg) = replies.last().unwrap();
        if *last != REP_ACK {
            return Err(io::Error::other(format!(
                "GO refused: {last:#x} {}",
                String::from_utf8_lossy(msg)
            )));
        }
        for (rep, data) in &replies {
            if *rep == REP_INFO {
                match strata::endian::be16(data, 0) {
                    INFO_EXPORT => {
                        c.size = strata::endian::be64(data, 2);
                        c.tflags = strata::endian::be16(data, 10);
                    }
                    INFO_BLOCK_SIZE => {
                        c.block = (be32(&data[2..]), be32(&data[6..]), be32(&data[10..]))
                    }
                    _ => {}
                }
            }
        }
        assert_ne!(c.tflags & TFLAG_HAS_FLAGS, 0);
        Ok(c)
    }

    /// Send an option and collect replies until a final one (ACK or error).
    pub fn option(&mut self, option: u32, data: &[u8]) -> io::Result<Vec<(u32, Vec<u8>)>> {
        let mut m = OptionHeader { option, len: data.len() as u32 }.to_bytes().to_vec();
        m.extend_from_slice(data);
        self.s.write_all(&m)?;
        let mut out = Vec::new();
        loop {
            let h = parse_option_reply(&read_exact(&mut self.s, 20)?).map_err(io::Error::other)?;
            assert_eq!(h.option, option);
            assert!(h.len <= 1 << 20, "option reply too long");
            let d = read_exact(&mut self.s, h.len as usize)?;
            let fin = h.reply == REP_ACK || h.reply & 0x8000_0000 != 0;
            out.push((h.reply, d));
            if fin {
                return Ok(out);
            }
        }
    }

    pub fn send(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<u64> {
        let handle = self.next;
        self.next += 1;
        let r = Request { flags, command, handle, offset, len };
        let mut m = r.to_bytes().to_vec();
        m.extend_from_slice(payload);
        self.s.write_all(&m)?;
        if command == Command::Read {
            self.pending_reads.insert(handle, (offset, len));
        }
        Ok(handle)
    }

    /// Read one complete reply (all chunks) and return its handle.
    pub fn recv(&mut self) -> io::Result<(u64, Reply)> {
        let mut head = read_exact(&mut self.s, 16)?;
        if be32(&head) == SIMPLE_REPLY_MAGIC {
            let Some(ReplyHeader::Simple(r)) = parse_reply_header(&head).unwrap() else {
                unreachable!()
            };
            let read = self.pending_reads.remove(&r.handle);
            if r.error != 0 {
                assert!(
                    read.is_none() || !self.structured,
                    "simple reply to a read after structured replies"
                );
                return Ok((r.handle, Reply::Error(r.error, String::new())));
            }
            return Ok(match read {
                Some((_, len)) => {
                    assert!(!self.structured, "simple reply to a read after structured replies");
                    (r.handle, Reply::Data(read_exact(&mut self.s, len as usize)?))
                }
                None => (r.handle, Reply::Ok),
            });
        }
        assert!(self.structured, "structured chunk without negotiation");
        let read = self.pending_reads.remove(&{
            head.extend(read_exact(&mut self.s, 4)?);
            let Some(ReplyHeader::Chunk(c)) = parse_reply_header(&head).unwrap() else {
                unreachable!()
            };
            c.handle
        });
        let mut data = read.map(|(_, len)| vec![0u8; len as usize]);
        let mut covered = 0u64;
        let mut result = None;
        loop {
            let Some(ReplyHeader::Chunk(c)) = parse_reply_header(&head).unwrap() else {
                panic!("bad chunk")
            };
            let payload = read_exact(&mut self.s, c.len as usize)?;
            match c.kind {
                REPLY_TYPE_NONE => assert_eq!(c.len, 0),
                REPLY_TYPE_OFFSET_DATA => {
                    let (base, len) = read.expect("data chunk for a non-read");
                    let off = strata::endian::be64(&payload, 0);
                    let n = payload.len() as u64 - 8;
                    assert!(
                        n > 0 && off >= base && off + n <= base + len as u64,
                        "data chunk outside the request"
                    );
                    data.as_mut().unwrap()[(off - base) as usize..(off - base + n) as usize]
                        .copy_from_slice(&payload[8..]);
                    covered += n;
                }
                REPLY_TYPE_OFFSET_HOLE => {
                    let (base, len) = read.expect("hole chunk for a non-read");
                    let off = strata::endian::be64(&payload, 0);
                    let n = be32(&payload[8..]) as u64;
                    assert!(n > 0 && off >= base && off + n <= base + len as u64);
                    covered += n;
                }
                REPLY_TYPE_BLOCK_STATUS => {
                    let (id, d) =
                        parse_block_status_payload(&payload).expect("bad block status payload");
                    assert_eq!(Some(id), self.meta_id);
                    assert!(!d.is_empty() && d.iter().all(|x| x.len > 0));
                    result = Some(Reply::Status(d));
                }
                REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                    let errno = be32(&payload);
                    let mlen = strata::endian::be16(&payload, 4) as usize;
                    assert!(errno != 0 && 6 + mlen <= payload.len());
                    result = Some(Reply::Error(
                        errno,
                        String::from_utf8_lossy(&payload[6..6 + mlen]).into_owned(),
                    ));
                }
                k => panic!("unknown chunk type {k}"),
            }
            if c.flags & REPLY_FLAG_DONE != 0 {
                let r = match (result, data) {
                    (Some(r), _) => r,
                    (None, Some(d)) => {
                        assert_eq!(
                            covered,
                            d.len() as u64,
                            "read reply does not cover the request"
                        );
                        Reply::Data(d)
                    }
                    (None, None) => Reply::Ok,
                };
                return Ok((c.handle, r));
            }
            head = read_exact(&mut self.s, 20)?;
            let Some(ReplyHeader::Chunk(n)) = parse_reply_header(&head).unwrap() else {
                panic!("expected a chunk")
            };
            assert_eq!(
                n.handle, c.handle,
                "chunks of different replies interleaved in this client's sequential use"
            );
        }
    }

    pub fn call(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<Reply> {
        let h = self.send(command, flags, offset, len, payload)?;
        let (rh, r) = self.recv()?;
        assert_eq!(rh, h);
        Ok(r)
    }

    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        match self.call(Command::Read, 0, offset, len, &[]).unwrap() {
            Reply::Data(d) => Ok(d),
            Reply::Error(e, _) => Err(e),
            r => panic!("unexpected {r:?}"),
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> Result<(), u32> {
        match self.call(Command::Write, flags, offset, data.len() as u32, data).unwrap() {
            Reply::Ok => Ok(()),
            Reply::Error(e, _) => Err(e),
            r => panic!("unexpected {r:?}"),
        }
    }

    pub fn simple(
        &mut self,
        command: Command,
        flags: u16,
        offset: u64,
        len: u32,
    ) -> Result<(), u32> {
        match self.call(command, flags, offset, len, &[]).unwrap() {
            Reply::Ok => Ok(()),
            Reply::Error(e, _) => Err(e),
            r => panic!("unexpected {r:?}"),
        }
    }

    pub fn block_status(
        &mut self,
        offset: u64,
        len: u32,
        flags: u16,
    ) -> Result<Vec<Descriptor>, u32> {
        match self.call(Command::BlockStatus, flags, offset, len, &[]).unwrap() {
            Reply::Status(d) => Ok(d),
            Reply::Error(e, _) => Err(e),
            r => panic!("unexpected {r:?}"),
        }
    }

    pub fn disconnect(mut self) {
        let _ = self.send(Command::Disc, 0, 0, 0, &[]);
        // The server closes after NBD_CMD_DISC: expect EOF, not a reply.
        let mut b = [0u8; 1];
        assert_eq!(self.s.read(&mut b).unwrap_or(0), 0, "server replied to NBD_CMD_DISC");
    }
}

/// Wait until `cond` holds or panic after `secs`.
pub fn wait_until(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(secs), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

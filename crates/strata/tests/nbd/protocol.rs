//! End-to-end protocol tests of the NBD server over a Unix socket, driven by the strict
//! minimal client in `common`: replies, error codes, flags, block status, pipelining,
//! legacy NBD_OPT_EXPORT_NAME, disconnect and shutdown.

use crate::common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use common::*;
use strata::nbd::proto::*;
use strata::nbd::{Export, ServerConfig};

fn file_server(size: u64) -> (TestServer, Arc<FileExport>) {
    let dir = tempfile::tempdir().unwrap();
    let f = Arc::new(FileExport::create(&dir.path().join("disk.raw"), size));
    let exports =
        Exports::new().add("disk", f.clone()).add("mem", Arc::new(MemExport::new(1 << 20)));
    // The file stays usable through its open descriptor after the directory is removed.
    (TestServer::start(exports), f)
}

#[test]
fn read_write_roundtrip_simple_and_structured() {
    let (s, _) = file_server(8 << 20);
    for structured in [false, true] {
        let mut c = Client::connect(&s.sock, "disk", structured, false).unwrap();
        assert_eq!(c.size, 8 << 20);
        assert_eq!(c.tflags & TFLAG_SEND_DF != 0, structured);
        let data = pattern(structured as u64 + 1, 100_003);
        c.write(12_345, &data, 0).unwrap();
        assert_eq!(c.read(12_345, data.len() as u32).unwrap(), data);
        assert_eq!(c.read(12_345 + 7, 10).unwrap(), data[7..17]);
        c.write(0, &data[..4096], CMD_FLAG_FUA).unwrap();
        c.simple(Command::Flush, 0, 0, 0).unwrap();
        assert_eq!(c.read(0, 4096).unwrap(), data[..4096]);
        // zero-length read is answered, not a disconnect
        assert_eq!(c.read(0, 0).unwrap(), Vec::<u8>::new());
        c.disconnect();
    }
}

#[test]
fn transmission_flags_follow_export_capabilities() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.raw");
    std::fs::write(&path, pattern(9, 65536)).unwrap();
    let exports = Exports::new()
        .add("file", Arc::new(FileExport::create(&dir.path().join("rw.raw"), 1 << 20)))
        .add("ro", Arc::new(FileExport::open(&path, true)))
        .add("mem", Arc::new(MemExport::new(4096)));
    let s = TestServer::start(exports);
    let c = Client::connect(&s.sock, "file", true, true).unwrap();
    let want = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_SEND_FAST_ZERO
        | TFLAG_SEND_DF
        | TFLAG_CAN_MULTI_CONN;
    assert_eq!(c.tflags, want);
    assert_eq!(c.block, (1, 4096, 32 << 20));
    let c = Client::connect(&s.sock, "ro", false, false).unwrap();
    assert_eq!(
        c.tflags,
        TFLAG_HAS_FLAGS
            | TFLAG_READ_ONLY
            | TFLAG_SEND_FLUSH
            | TFLAG_SEND_FUA
            | TFLAG_CAN_MULTI_CONN
    );
    let c = Client::connect(&s.sock, "mem", false, false).unwrap();
    assert_eq!(c.tflags & TFLAG_SEND_TRIM, 0);
    assert_ne!(c.tflags & TFLAG_SEND_WRITE_ZEROES, 0);
}

#[test]
fn error_codes() {
    let (s, _) = file_server(1 << 20);
    for structured in [false, true] {
        let mut c = Client::connect(&s.sock, "disk", structured, false).unwrap();
        let end = 1u64 << 20;
        assert_eq!(c.write(end - 10, &[1; 20], 0), Err(28), "write past end is ENOSPC");
        assert_eq!(c.read(end - 10, 20), Err(22), "read past end is EINVAL");
        assert_eq!(c.read(u64::MAX - 5, 10), Err(22), "offset overflow is EINVAL");
        assert_eq!(c.simple(Command::Trim, 0, end, 1), Err(22));
        assert_eq!(c.simple(Command::WriteZeroes, 0, end - 1, 2), Err(28));
        assert_eq!(c.simple(Command::Unknown(77), 0, 0, 0), Err(22), "unknown command is EINVAL");
        assert_eq!(c.simple(Command::Flush, 1 << 7, 0, 0), Err(22), "unknown flag is EINVAL");
        assert_eq!(c.read(0, (32 << 20) + 1), Err(22), "read over the cap is EINVAL");
        // block status without a negotiated context
        match c.call(Command::BlockStatus, 0, 0, 4096, &[]).unwrap() {
            Reply::Error(22, _) => {}
            r => panic!("block status without context: {r:?}"),
        }
        // the connection is still usable after every error
        c.write(0, b"still alive", 0).unwrap();
        assert_eq!(c.read(0, 11).unwrap(), b"still alive");
    }
    // Structured errors carry a message.
    let mut c = Client::connect(&s.sock, "disk", true, false).unwrap();
    match c.call(Command::Read, 0, 1 << 20, 1, &[]).unwrap() {
        Reply::Error(22, m) => assert!(m.contains("beyond the end"), "message: {m}"),
        r => panic!("{r:?}"),
    }
}

#[test]
fn read_only_export_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.raw");
    let content = pattern(3, 65536);
    std::fs::write(&path, &content).unwrap();
    let s = TestServer::start(Exports::new().add("ro", Arc::new(FileExport::open(&path, true))));
    let mut c = Client::connect(&s.sock, "ro", true, false).unwrap();
    assert_eq!(c.write(0, &[1; 512], 0), Err(1));
    assert_eq!(c.simple(Command::WriteZeroes, 0, 0, 512), Err(1));
    assert_eq!(c.simple(Command::Trim, 0, 0, 512), Err(1));
    assert_eq!(c.read(0, 65536).unwrap(), content);
    assert_eq!(std::fs::read(&path).unwrap(), content);
}

#[test]
fn write_zeroes_fast_zero_and_trim() {
    let (s, f) = file_server(4 << 20);
    let mut c = Client::connect(&s.sock, "disk", true, true).unwrap();
    c.write(0, &[0xee; 1 << 20], 0).unwrap();
    // NO_HOLE: zeroed but allocated; may-trim: zeroed.
    c.simple(Command::WriteZeroes, CMD_FLAG_NO_HOLE, 4096, 8192).unwrap();
    c.simple(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 65536, 65536).unwrap();
    let d = c.read(0, 1 << 20).unwrap();
    assert!(d[4096..12288].iter().all(|&b| b == 0));
    assert!(d[65536..131072].iter().all(|&b| b == 0));
    assert!(d[..4096].iter().chain(&d[12288..65536]).chain(&d[131072..]).all(|&b| b == 0xee));
    // The punched range is a hole now.
    let st = c.block_status(65536, 65536, 0).unwrap();
    assert_eq!(st, vec![Descriptor { len: 65536, flags: STATE_HOLE | STATE_ZERO }]);
    c.simple(Command::Trim, 0, 0, 4096).unwrap();
    assert_eq!(f.block_status(0, 4096).unwrap(), vec![strata::nbd::Extent::hole(4096)]);

    // The in-memory export has no fast zero: FAST_ZERO fails with ENOTSUP and changes nothing.
    let mut m = Client::connect(&s.sock, "mem", true, false).unwrap();
    m.write(0, &[7; 8192], 0).unwrap();
    assert_eq!(m.simple(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 0, 4096), Err(95));
    assert_eq!(m.read(0, 8192).unwrap(), vec![7; 8192]);
    // Without the flag the default (write zero buffers) is used.
    m.simple(Command::WriteZeroes, 0, 0, 4096).unwrap();
    let d = m.read(0, 8192).unwrap();
    assert!(d[..4096].iter().all(|&b| b == 0) && d[4096..].iter().all(|&b| b == 7));
    // No trim on the memory export.
    assert_eq!(m.simple(Command::Trim, 0, 0, 4096), Err(22));
}

#[test]
fn block_status_matches_sparse_file() {
    let (s, _) = file_server(16 << 20);
    let mut c = Client::connect(&s.sock, "disk", true, true).unwrap();
    assert!(c.meta_id.is_some());
    c.write(1 << 20, &[1; 65536], 0).unwrap();
    c.write(8 << 20, &[2; 4096], 0).unwrap();
    let st = c.block_status(0, 16 << 20, 0).unwrap();
    let hz = STATE_HOLE | STATE_ZERO;
    assert_eq!(
        st,
        vec![
            Descriptor { len: 1 << 20, flags: hz },
            Descriptor { len: 65536, flags: 0 },
            Descriptor { len: (7 << 20) - 65536, flags: hz },
            Descriptor { len: 4096, flags: 0 },
            Descriptor { len: (8 << 20) - 4096, flags: hz },
        ]
    );
    assert_eq!(
        c.block_status(0, 16 << 20, CMD_FLAG_REQ_ONE).unwrap(),
        vec![Descriptor { len: 1 << 20, flags: hz }]
    );
    // Unaligned start inside data.
    assert_eq!(
        c.block_status((1 << 20) + 100, 200, 0).unwrap(),
        vec![Descriptor { len: 200, flags: 0 }]
    );
    assert!(c.block_status(16 << 20, 1, 0).is_err());
    assert!(c.block_status(0, 0, 0).is_err());
}

#[test]
fn pipelined_requests_all_answered() {
    let (s, _) = file_server(8 << 20);
    let mut c = Client::connect(&s.sock, "disk", true, false).unwrap();
    let mut expect = std::collections::HashMap::new();
    // 64 writes in flight, then 64 reads in flight, replies collected by handle.
    for i in 0..64u64 {
        let data = pattern(i, 4096 + i as usize * 512);
        let h = c.send(Command::Write, 0, i * 65536, data.len() as u32, &data).unwrap();
        expect.insert(h, (i, data));
    }
    let mut done = 0;
    while done < 64 {
        let (h, r) = c.recv().unwrap();
        assert_eq!(r, Reply::Ok);
        assert!(expect.contains_key(&h));
        done += 1;
    }
    let mut reads = std::collections::HashMap::new();
    for (_, (i, data)) in expect.iter() {
        let h = c.send(Command::Read, 0, i * 65536, data.len() as u32, &[]).unwrap();
        reads.insert(h, data.clone());
    }
    let mut order = Vec::new();
    while !reads.is_empty() {
        let (h, r) = c.recv().unwrap();
        let want = reads.remove(&h).expect("reply for an unknown handle");
        assert_eq!(r, Reply::Data(want));
        order.push(h);
    }
    c.disconnect();
}

#[test]
fn export_errors_map_to_nbd_errnos() {
    let exports = Exports::new()
        .add("eio", Arc::new(FailingExport { errno: libc::EIO }))
        .add("enospc", Arc::new(FailingExport { errno: libc::EDQUOT }))
        .add("eperm", Arc::new(FailingExport { errno: libc::EROFS }));
    let s = TestServer::start(exports);
    for (name, code) in [("eio", 5), ("enospc", 28), ("eperm", 1)] {
        for structured in [false, true] {
            let mut c = Client::connect(&s.sock, name, structured, false).unwrap();
            assert_eq!(c.read(0, 4096), Err(code), "{name} read");
            assert_eq!(c.write(0, &[0; 4096], 0), Err(code), "{name} write");
            assert_eq!(c.simple(Command::Flush, 0, 0, 0), Err(code), "{name} flush");
            // Reads after a failed read still work on the same connection (no payload leaked).
            assert_eq!(c.read(4096, 512), Err(code));
        }
    }
}

#[test]
fn minimum_block_size_is_enforced() {
    let mut m = MemExport::new(1 << 20);
    m.min_block = 512;
    let s = TestServer::start(Exports::new().add("m", Arc::new(m)));
    let mut c = Client::connect(&s.sock, "m", true, false).unwrap();
    assert_eq!(c.block.0, 512);
    assert_eq!(c.read(1, 512), Err(22));
    assert_eq!(c.write(0, &[1; 100], 0), Err(22));
    c.write(512, &[1; 1024], 0).unwrap();
    assert_eq!(c.read(512, 1024).unwrap(), vec![1; 1024]);
}

/// Old clients: NBD_OPT_EXPORT_NAME with and without NO_ZEROES, then simple replies.
#[test]
fn legacy_export_name() {
    let (s, _) = file_server(1 << 20);
    for no_zeroes in [false, true] {
        let mut sock = UnixStream::connect(&s.sock).unwrap();
        let g = read_exact(&mut sock, 18).unwrap();
        assert_eq!(&g[..8], b"NBDMAGIC");
        let flags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
        sock.write_all(&flags.to_be_bytes()).unwrap();
        let mut o = OptionHeader { option: OPT_EXPORT_NAME, len: 4 }.to_bytes().to_vec();
        o.extend_from_slice(b"disk");
        sock.write_all(&o).unwrap();
        let r = read_exact(&mut sock, if no_zeroes { 10 } else { 134 }).unwrap();
        assert_eq!(strata::endian::be64(&r, 0), 1 << 20);
        let req = Request { flags: 0, command: Command::Read, handle: 99, offset: 0, len: 16 };
        sock.write_all(&req.to_bytes()).unwrap();
        let rep = read_exact(&mut sock, 32).unwrap();
        assert_eq!(&rep[..16], &encode_simple_reply(99, 0));
    }
    // Unknown name: the option cannot report an error, so the server closes.
    let mut sock = UnixStream::connect(&s.sock).unwrap();
    read_exact(&mut sock, 18).unwrap();
    sock.write_all(&1u32.to_be_bytes()).unwrap();
    let mut o = OptionHeader { option: OPT_EXPORT_NAME, len: 3 }.to_bytes().to_vec();
    o.extend_from_slice(b"xyz");
    sock.write_all(&o).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(sock.read(&mut b).unwrap(), 0);
}

#[test]
fn go_to_unknown_export_can_retry() {
    let (s, _) = file_server(1 << 20);
    assert!(Client::connect(&s.sock, "nope", true, false).is_err());
    let mut sock = UnixStream::connect(&s.sock).unwrap();
    read_exact(&mut sock, 18).unwrap();
    sock.write_all(&1u32.to_be_bytes()).unwrap();
    // LIST shows both exports, sorted.
    sock.write_all(&OptionHeader { option: OPT_LIST, len: 0 }.to_bytes()).unwrap();
    let mut names = Vec::new();
    loop {
        let h = parse_option_reply(&read_exact(&mut sock, 20).unwrap()).unwrap();
        let d = read_exact(&mut sock, h.len as usize).unwrap();
        if h.reply == REP_ACK {
            break;
        }
        assert_eq!(h.reply, REP_SERVER);
        let n = strata::endian::be32(&d, 0) as usize;
        names.push(String::from_utf8(d[4..4 + n].to_vec()).unwrap());
    }
    assert_eq!(names, vec!["disk", "mem"]);
    sock.write_all(&OptionHeader { option: OPT_ABORT, len: 0 }.to_bytes()).unwrap();
    let h = parse_option_reply(&read_exact(&mut sock, 20).unwrap()).unwrap();
    assert_eq!((h.option, h.reply), (OPT_ABORT, REP_ACK));
}

#[test]
fn shutdown_closes_clients_and_removes_socket() {
    let (mut s, _) = file_server(1 << 20);
    let mut c = Client::connect(&s.sock, "disk", true, false).unwrap();
    c.write(0, &[5; 4096], 0).unwrap();
    let idle = UnixStream::connect(&s.sock).unwrap(); // stuck in the handshake
    wait_until(5, "two connections", || s.handle().active_connections() == 2);
    let h = s.handle.take().unwrap();
    let t = std::time::Instant::now();
    h.shutdown();
    assert!(t.elapsed() < std::time::Duration::from_secs(3), "shutdown took {:?}", t.elapsed());
    assert!(!s.sock.exists(), "socket file left behind");
    // The transmission client sees the connection end.
    let _ = c.send(Command::Read, 0, 0, 4096, &[]);
    assert!(c.recv().is_err());
    drop(idle);
}

#[test]
fn many_sequential_and_parallel_connections() {
    let (s, _) = file_server(4 << 20);
    let sock = s.sock.clone();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                for round in 0..10u64 {
                    let mut c = Client::connect(&sock, "disk", round % 2 == 0, false).unwrap();
                    let data = pattern(t * 100 + round, 8192);
                    c.write(t * 65536, &data, 0).unwrap();
                    assert_eq!(c.read(t * 65536, 8192).unwrap(), data);
                    c.disconnect();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    wait_until(5, "connections to close", || s.handle().active_connections() == 0);
    assert_eq!(s.handle().total_connections(), 80);
}

#[test]
fn tcp_loopback_listener() {
    init_tracing();
    let exports = Exports::new().add("m", Arc::new(MemExport::new(65536)));
    let h = strata::nbd::Server::bind_tcp_loopback(Some(0))
        .unwrap()
        .with_config(ServerConfig::default())
        .serve(exports)
        .unwrap();
    let strata::nbd::ServerAddr::Tcp(addr) = h.addr().clone() else { panic!() };
    assert!(addr.ip().is_loopback());
    assert!(h.uri("m").starts_with("nbd://127.0.0.1:"));
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    let g = read_exact(&mut sock, 18).unwrap();
    assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
    h.shutdown();
}

#[test]
fn stopper_ends_wait_from_another_thread() {
    let (mut s, _) = file_server(1 << 20);
    let h = s.handle.take().unwrap();
    let stop = h.stopper();
    let mut c = Client::connect(&s.sock, "disk", true, false).unwrap();
    let waiter = std::thread::spawn(move || h.wait());
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!waiter.is_finished(), "wait returned while the server was running");
    c.write(0, b"x", 0).unwrap();
    stop.stop();
    stop.stop();
    waiter.join().unwrap();
    assert!(!s.sock.exists());
    assert!(UnixStream::connect(&s.sock).is_err());
}

#[test]
fn bind_unix_refuses_existing_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("taken");
    std::fs::write(&p, b"").unwrap();
    let e = strata::nbd::Server::bind_unix(&p).err().expect("bind over an existing file");
    assert!(e.to_string().contains("remove it"), "{e}");
}

/// An export whose fast zeroing turns out to be unavailable at run time.
struct ZeroRefuser(MemExport);

impl Export for ZeroRefuser {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), strata::nbd::ExportError> {
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), strata::nbd::ExportError> {
        self.0.write(offset, data, fua)
    }
    fn flush(&self) -> Result<(), strata::nbd::ExportError> {
        Ok(())
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn write_zeroes(
        &self,
        _: u64,
        _: u64,
        _: bool,
        _: bool,
    ) -> Result<(), strata::nbd::ExportError> {
        Err(strata::nbd::ExportError::NotSupported { op: "write-zeroes" })
    }
}

#[test]
fn enotsup_only_for_fast_zero() {
    let s =
        TestServer::start(Exports::new().add("z", Arc::new(ZeroRefuser(MemExport::new(65536)))));
    for structured in [false, true] {
        let mut c = Client::connect(&s.sock, "z", structured, false).unwrap();
        assert_eq!(c.simple(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 0, 4096), Err(95));
        assert_eq!(
            c.simple(Command::WriteZeroes, 0, 0, 4096),
            Err(22),
            "ENOTSUP without FAST_ZERO breaks the spec"
        );
    }
}

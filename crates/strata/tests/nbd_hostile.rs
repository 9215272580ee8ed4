//! Hostile and buggy clients: every test abuses one connection and then checks that the
//! server still serves a well-behaved client, that the abused connection was closed (or
//! correctly answered), and that no connection is left behind. The admission tests hold
//! many connections in handshake (silent, trickling, or over the per-client cap) and check
//! that real clients still get in and that the handshake deadline closes the rest.

#[path = "nbd/common.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata::nbd::proto::*;
use strata::nbd::ServerConfig;

fn setup() -> (TestServer, Arc<MemExport>) {
    let m = Arc::new(MemExport::new(4 << 20));
    let s = TestServer::start(Exports::new().add("m", m.clone()));
    (s, m)
}

/// The server is alive and correct for a fresh client, and the abusive connections are gone.
fn assert_healthy(s: &TestServer) {
    let mut c = Client::connect(&s.sock, "m", true, false).expect("server stopped serving");
    c.write(4096, b"healthy", 0).unwrap();
    assert_eq!(c.read(4096, 7).unwrap(), b"healthy");
    c.disconnect();
    wait_until(10, "abusive connections to close", || s.handle().active_connections() == 0);
}

fn handshaken(s: &TestServer) -> UnixStream {
    let c = Client::connect(&s.sock, "m", true, false).unwrap();
    c.s
}

fn expect_eof(sock: &mut UnixStream) {
    sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("expected the server to close the connection, got {e}"),
        }
    }
}

#[test]
fn bad_request_magic_closes_connection() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let (s, _) = setup();
    let mut sock = handshaken(&s);
    let mut r =
        Request { flags: 0, command: Command::Read, handle: 1, offset: 0, len: 512 }.to_bytes();
    r[0] ^= 0xff;
    sock.write_all(&r).unwrap();
    expect_eof(&mut sock);
    assert_healthy(&s);
}

#[test]
fn garbage_mid_stream_after_valid_requests() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let (s, m) = setup();
    let mut c = Client::connect(&s.sock, "m", false, false).unwrap();
    c.write(0, &[9; 1000], 0).unwrap();
    assert_eq!(c.read(0, 1000).unwrap(), vec![9; 1000]);
    c.s.write_all(&pattern(1, 5000)).unwrap();
    expect_eof(&mut c.s);
    assert_eq!(&m.snapshot()[..1000], &[9; 1000][..]);
    assert_healthy(&s);
}

#[test]
fn oversize_write_is_drained_and_refused() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let (s, m) = setup();
    let mut c = Client::connect(&s.sock, "m", true, false).unwrap();
    let len = (32u32 << 20) + 4096;
    // The payload follows the header as the protocol says; the server must consume it
    // without buffering it and keep the stream in sync.
    let h = c.send(Command::Write, 0, 0, len, &[]).unwrap();
    let chunk = vec![0x77u8; 1 << 20];
    let mut left = len as usize;
    while left > 0 {
        let n = left.min(chunk.len());
        c.s.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    let (rh, r) = c.recv().unwrap();
    assert_eq!(rh, h);
    assert!(matches!(r, Reply::Error(22, _)), "{r:?}");
    assert!(m.snapshot().iter().all(|&b| b == 0), "refused write changed data");
    // Same connection still in sync.
    c.write(0, b"after", 0).unwrap();
    assert_eq!(c.read(0, 5).unwrap(), b"after");
    // A huge read is refused, not attempted.
    assert_eq!(c.read(0, u32::MAX), Err(22));
    c.disconnect();
    assert_healthy(&s);
}

#[test]
fn disconnect_mid_request() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let (s, m) = setup();
    // Half a header.
    let mut sock = handshaken(&s);
    sock.write_all(
        &Request { flags: 0, command: Command::Read, handle: 1, offset: 0, len: 512 }.to_bytes()
            [..13],
    )
    .unwrap();
    drop(sock);
    // A write header with only part of its payload.
    let mut sock = handshaken(&s);
    sock.write_all(
        &Request { flags: 0, command: Command::Write, handle: 2, offset: 0, len: 1 << 20 }
            .to_bytes(),
    )
    .unwrap();
    sock.write_all(&[0xaa; 100]).unwrap();
    drop(sock);
    // Requests in flight whose replies nobody reads.
    let mut sock = handshaken(&s);
    for i in 0..32 {
        sock.write_all(
            &Request { flags: 0, command: Command::Read, handle: i, offset: 0, len: 1 << 20 }
                .to_bytes(),
        )
        .unwrap();
    }
    drop(sock);
    assert_healthy(&s);
    assert!(m.snapshot()[..100].iter().all(|&b| b == 0), "a truncated write reached the export");
}

#[test]
fn handshake_abuse() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let (s, _) = setup();
    let greet = |s: &TestServer| {
        let mut sock = UnixStream::connect(&s.sock).unwrap();
        read_exact(&mut sock, 18).unwrap();
        sock
    };
    // Unknown client flags.
    let mut sock = greet(&s);
    sock.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    expect_eof(&mut sock);
    // Bad option magic.
    let mut sock = greet(&s);
    sock.write_all(&1u32.to_be_bytes()).unwrap();
    sock.write_all(b"NOTMAGIC\0\0\0\x07\0\0\0\0").unwrap();
    expect_eof(&mut sock);
    // Huge option length, then hang up without sending it.
    let mut sock = greet(&s);
    sock.write_all(&1u32.to_be_bytes()).unwrap();
    sock.write_all(&OptionHeader { option: OPT_GO, len: u32::MAX }.to_bytes()).unwrap();
    sock.write_all(&[0; 1000]).unwrap();
    drop(sock);
    // Oversized option actually sent: skipped and answered with TOO_BIG, then GO still works.
    let mut sock = greet(&s);
    sock.write_all(&1u32.to_be_bytes()).unwrap();
    let len = strata::nbd::MAX_OPTION_LEN + 1;
    sock.write_all(&OptionHeader { option: OPT_LIST_META_CONTEXT, len }.to_bytes()).unwrap();
    sock.write_all(&vec![0x41; len as usize]).unwrap();
    let h = parse_option_reply(&read_exact(&mut sock, 20).unwrap()).unwrap();
    assert_eq!(h.reply, REP_ERR_TOO_BIG);
    read_exact(&mut sock, h.len as usize).unwrap();
    let mut go = 1u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"m");
    go.extend_from_slice(&0u16.to_be_bytes());
    let mut o = OptionHeader { option: OPT_GO, len: go.len() as u32 }.to_bytes().to_vec();
    o.extend(go);
    sock.write_all(&o).unwrap();
    loop {
        let h = parse_option_reply(&read_exact(&mut sock, 20).unwrap()).unwrap();
        read_exact(&mut sock, h.len as usize).unwrap();
        if h.reply == REP_ACK {
            break;
        }
        assert_eq!(h.reply, REP_INFO);
    }
    drop(sock);
    // Export name longer than the protocol allows via EXPORT_NAME.
    let mut sock = greet(&s);
    sock.write_all(&1u32.to_be_bytes()).unwrap();
    let mut o = OptionHeader { option: OPT_EXPORT_NAME, len: 5000 }.to_bytes().to_vec();
    o.extend(vec![b'a'; 5000]);
    sock.write_all(&o).unwrap();
    expect_eof(&mut sock);
    // Connect and say nothing, then leave.
    drop(greet(&s));
    drop(UnixStream::connect(&s.sock).unwrap());
    assert_healthy(&s);
}

/// Many connections that send seeded random bytes, in the handshake and after it.
#[test]
fn random_garbage_connections() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let (s, m) = setup();
    let before = m.snapshot();
    for seed in 0..200u64 {
        let mut sock = if seed % 2 == 0 {
            let mut x = UnixStream::connect(&s.sock).unwrap();
            read_exact(&mut x, 18).unwrap();
            if seed % 4 == 0 {
                x.write_all(&1u32.to_be_bytes()).unwrap();
            }
            x
        } else {
            handshaken(&s)
        };
        let junk = pattern(seed, 64 + (seed as usize * 37) % 4000);
        let _ = sock.write_all(&junk);
        sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut b = [0u8; 65536];
        let _ = sock.read(&mut b);
    }
    assert_healthy(&s);
    // Random bytes after the handshake hit bad magic at once (no write can get through
    // unless the junk started with the request magic, which this seed set does not).
    assert_eq!(m.snapshot()[8192..], before[8192..]);
}

/// The memory tests measure the whole test process's RSS: they must not run beside each
/// other (the test harness runs tests on parallel threads), or each sees the other's buffers.
/// Every other test holds it shared (their exports allocate too).
static RSS_TESTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn rss_kib() -> u64 {
    let st = std::fs::read_to_string("/proc/self/status").unwrap();
    st.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

/// A client that pipelines huge reads and never reads replies must not make the server
/// buffer without bound.
#[test]
fn unread_replies_do_not_grow_memory_without_bound() {
    let _alone = RSS_TESTS.write().unwrap_or_else(|e| e.into_inner());
    let (s, _) = setup();
    let base = rss_kib();
    let mut sock = handshaken(&s);
    sock.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    // 4 MiB reads: 1000 of them would be 4 GiB of replies.
    for i in 0..1000u64 {
        let r = Request { flags: 0, command: Command::Read, handle: i, offset: 0, len: 4 << 20 };
        if sock.write_all(&r.to_bytes()).is_err() {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let grown = rss_kib().saturating_sub(base);
    assert!(grown < 200 * 1024, "server memory grew by {grown} KiB with unread 4 MiB replies");
    drop(sock);
    assert_healthy(&s);
}

/// Writes arriving faster than a slow export completes them are held to the in-flight byte
/// budget (64 MiB by default): the server stops reading instead of queueing payloads.
#[test]
fn write_payloads_are_bounded_by_the_inflight_budget() {
    let _alone = RSS_TESTS.write().unwrap_or_else(|e| e.into_inner());
    let slow = SlowExport { inner: MemExport::new(64 << 20), delay: Duration::from_millis(100) };
    let s = TestServer::start(Exports::new().add("m", Arc::new(slow)));
    let base = rss_kib();
    let sock = Client::connect(&s.sock, "m", true, false).unwrap().s;
    let mut w = sock.try_clone().unwrap();
    // 100 writes of 4 MiB (400 MiB) pushed as fast as the server takes them.
    let writer = std::thread::spawn(move || {
        let payload = vec![0x5au8; 4 << 20];
        for i in 0..100u64 {
            let r = Request {
                flags: 0,
                command: Command::Write,
                handle: i,
                offset: (i % 16) * (4 << 20),
                len: 4 << 20,
            };
            if w.write_all(&r.to_bytes()).is_err() || w.write_all(&payload).is_err() {
                return;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(1500));
    let grown = rss_kib().saturating_sub(base);
    assert!(grown < 160 * 1024, "server buffered {grown} KiB of write payloads");
    sock.shutdown(std::net::Shutdown::Both).unwrap();
    let _ = writer.join();
    drop(sock);
    wait_until(30, "connections to close", || s.handle().active_connections() == 0);
}

/// A server on a Unix socket whose handshake deadline is `secs` seconds.
fn server_with_handshake_timeout(secs: u64) -> TestServer {
    let cfg = ServerConfig { handshake_timeout: Duration::from_secs(secs), ..Default::default() };
    TestServer::start_with(Exports::new().add("m", Arc::new(MemExport::new(1 << 20))), cfg)
}

/// 200 clients that connect and say nothing take handshake slots, not connection slots: a
/// real client still connects, negotiates and reads at once, and the server closes the
/// silent ones when the handshake deadline passes (and not before), while the real client,
/// being in transmission, stays.
#[test]
fn silent_clients_do_not_lock_out_a_real_client() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let s = server_with_handshake_timeout(2);
    let start = Instant::now();
    let mut silent: Vec<UnixStream> =
        (0..200).map(|_| UnixStream::connect(&s.sock).unwrap()).collect();
    let h = s.handle();
    wait_until(10, "200 connections accepted", || {
        h.total_connections() + h.refused_connections() == 200
    });
    let t = Instant::now();
    let mut c = Client::connect(&s.sock, "m", true, false).expect("real client refused");
    c.write(0, b"through", 0).unwrap();
    assert_eq!(c.read(0, 7).unwrap(), b"through");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "the real client took {took:?} behind 200 silent ones");
    assert_eq!(h.handshaking_connections(), 200);
    assert_eq!(h.refused_connections(), 0);
    wait_until(10, "the silent connections to be closed", || {
        h.handshaking_connections() == 0 && h.active_connections() == 1
    });
    assert!(start.elapsed() >= Duration::from_secs(2), "closed before the handshake deadline");
    for sock in &mut silent {
        expect_eof(sock);
    }
    assert_eq!(h.handshake_timeouts(), 200);
    assert_eq!(c.read(0, 7).unwrap(), b"through", "the deadline closed an established client");
    c.disconnect();
    wait_until(10, "all connections to close", || h.active_connections() == 0);
}

/// A client that sends a valid handshake one byte every 500 ms is closed at the deadline,
/// measured from accept, not per read.
#[test]
fn trickling_client_is_dropped_at_the_handshake_deadline() {
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    let s = server_with_handshake_timeout(2);
    let start = Instant::now();
    let mut sock = UnixStream::connect(&s.sock).unwrap();
    read_exact(&mut sock, 18).unwrap();
    // Client flags, then NBD_OPT_GO for "m": 27 bytes, 13.5 s at this pace.
    let mut bytes = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
    bytes.extend_from_slice(&OptionHeader { option: OPT_GO, len: 7 }.to_bytes());
    bytes.extend_from_slice(&[0, 0, 0, 1, b'm', 0, 0]);
    let mut w = sock.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for b in bytes {
            if w.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    expect_eof(&mut sock);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_millis(3500),
        "trickling client closed after {took:?}, deadline 2 s"
    );
    assert_eq!(s.handle().handshake_timeouts(), 1);
    drop(sock);
    writer.join().unwrap();
    assert_healthy(&s);
}

/// Over TCP, one address may hold `max_handshakes_per_client` connections in handshake; the
/// next is closed at once, without a greeting. Established connections from the same address
/// do not count: a client that finished its handshake before keeps being served, and a new
/// one gets in as soon as a handshake slot frees.
#[test]
fn per_address_cap_refuses_extra_handshakes_but_not_established_clients() {
    use std::net::TcpStream;
    use strata::nbd::client::{Client as NbdClient, Target};
    let _shared = RSS_TESTS.read().unwrap_or_else(|e| e.into_inner());
    init_tracing();
    let exports = Exports::new().add("m", Arc::new(MemExport::new(1 << 20)));
    let h = strata::nbd::Server::bind_tcp_loopback(Some(0)).unwrap().serve(exports).unwrap();
    let strata::nbd::ServerAddr::Tcp(addr) = h.addr().clone() else { panic!("not TCP") };
    let target = Target::Tcp(addr);
    let cap = ServerConfig::default().max_handshakes_per_client;
    let mut buf = vec![0u8; 4096];

    let mut established = NbdClient::connect(&target, "m").unwrap();
    let mut silent: Vec<TcpStream> = (0..cap)
        .map(|_| {
            let mut x = TcpStream::connect(addr).unwrap();
            read_exact(&mut x, 18).unwrap();
            x
        })
        .collect();
    wait_until(10, "the silent connections in handshake", || h.handshaking_connections() == cap);

    let t = Instant::now();
    let mut extra = TcpStream::connect(addr).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
    let mut got = Vec::new();
    match extra.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("connection over the per-address cap was not closed: {e}"),
    }
    assert!(got.is_empty(), "connection over the per-address cap got {} bytes", got.len());
    assert!(t.elapsed() < Duration::from_secs(2), "refused only after {:?}", t.elapsed());
    assert_eq!(h.refused_connections(), 1);

    established.read(0, &mut buf).expect("established client refused by the per-address cap");
    drop(silent.pop());
    wait_until(10, "a handshake slot to free", || h.handshaking_connections() == cap - 1);
    let mut late = NbdClient::connect(&target, "m").expect("new client refused after a slot freed");
    late.read(4096, &mut buf).unwrap();
    late.disconnect().unwrap();
    established.disconnect().unwrap();
    drop(silent);
    wait_until(10, "all connections to close", || h.active_connections() == 0);
    assert_eq!(h.handshake_timeouts(), 0);
    h.shutdown();
}

//! Crash tests of disks served over NBD.
//!
//! `kill9_under_fio_load_loses_no_acknowledged_write`: the server runs in a child process (this
//! test binary re-executed in server mode). While fio drives random writes at it, the test
//! writes numbered marker blocks, each followed by a FLUSH, and notes the last one the server
//! acknowledged. The server is killed with SIGKILL mid-load and restarted on the same store:
//! every acknowledged marker and an earlier flushed region must read back exactly, the store
//! must check clean, and no repair step is needed. The server compacts every 16 MiB of log, so
//! the kill comes while background compactions run and the log rolls over between files.

#[path = "nbd/common.rs"]
mod common;

use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use strata::nbd::proto::Command as NbdCmd;

const SERVE_ENV: &str = "STRATA_TEST_SERVE";

/// Server mode: serve the store named in $STRATA_TEST_SERVE ("STORE|SOCKET") until killed.
#[test]
#[ignore = "run by the crash tests as a child process"]
fn serve_child() {
    let Ok(spec) = std::env::var(SERVE_ENV) else { return };
    let (store, sock) = spec.split_once('|').unwrap();
    let s = strata::store::Store::open_local(std::path::Path::new(store)).unwrap();
    let exports = strata::serve::DiskExports::new(s);
    // A small compaction threshold, so the kill lands while logs roll over and background
    // compactions fold them (16 MiB of 4 KiB writes folds about 4000 blocks each time).
    exports.set_compact_at(16 << 20);
    let _h = strata::nbd::Server::bind_unix(sock).unwrap().serve(exports).unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The server child: killed (SIGKILL) and reaped when dropped, so a failed assert leaves no
/// server or zombie behind.
struct ServerChild(Child);

impl ServerChild {
    /// SIGKILL the server and reap it.
    fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_server(store: &std::path::Path, sock: &std::path::Path) -> ServerChild {
    let _ = std::fs::remove_file(sock);
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "serve_child", "--nocapture"])
        .env(SERVE_ENV, format!("{}|{}", store.display(), sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = ServerChild(child);
    wait_until(30, "the server socket", || std::os::unix::net::UnixStream::connect(sock).is_ok());
    child
}

#[test]
fn kill9_under_fio_load_loses_no_acknowledged_write() {
    require_tool("fio", "fio");
    let tmp = tempfile::tempdir().unwrap();
    let store_dir = tmp.path().join("store");
    {
        let s = strata::store::Store::init_local(&store_dir, Default::default()).unwrap();
        strata::disk::create(&s, "d", 512 << 20).unwrap();
    }
    let sock = tmp.path().join("nbd.sock");
    let mut server = spawn_server(&store_dir, &sock);

    // Region A: 8 MiB written and flushed before any load.
    let a = pattern(42, 8 << 20);
    let mut c = Client::connect(&sock, "d", true, false).unwrap();
    for (i, part) in a.chunks(1 << 20).enumerate() {
        c.write(i as u64 * (1 << 20), part, 0).unwrap();
    }
    assert_eq!(c.simple(NbdCmd::Flush, 0, 0, 0), Ok(()));

    // Background load: fio random writes over [64 MiB, 512 MiB).
    let uri = format!("nbd+unix:///d?socket={}", sock.display());
    let mut fio = Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--offset=64M",
            "--size=448M",
            "--iodepth=16",
            "--time_based=1",
            "--runtime=60",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    // Markers: block k at 16 MiB + k*4 KiB holds pattern(k), each followed by a flush.
    let marker_base = 16u64 << 20;
    let mut acked: i64 = -1;
    let t0 = Instant::now();
    let mut killed = false;
    for k in 0..100_000u64 {
        // At least 2.5 s of load and 20 acknowledged markers (a loaded host acknowledges
        // fewer per second), or 30 s whatever was acknowledged.
        let due = (t0.elapsed() > Duration::from_millis(2500) && acked >= 20)
            || t0.elapsed() > Duration::from_secs(30);
        if !killed && due {
            // SIGKILL mid-load: no chance to flush or compact.
            server.kill();
            killed = true;
        }
        // The test client panics on a dead socket; that, like an error reply, ends the run.
        let t = Instant::now();
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            c.write(marker_base + k * 4096, &pattern(1000 + k, 4096), 0).is_ok()
                && c.simple(NbdCmd::Flush, 0, 0, 0).is_ok()
        }))
        .unwrap_or(false);
        // Liveness under load: compaction back-pressure holds a writer for one fold at most
        // (~0.5 s here); releasing writers one per fold would make a marker wait 12-21 s.
        assert!(
            killed || t.elapsed() < Duration::from_secs(10),
            "marker {k}: write + flush took {:?} under load",
            t.elapsed()
        );
        if !ok {
            break;
        }
        acked = k as i64;
    }
    assert!(killed, "the server was never killed");
    assert!(acked > 10, "too few markers before the kill ({acked})");
    let _ = fio.kill();
    let _ = fio.wait();
    drop(c);

    // The logs as the kill left them: a newest file above 1 means compactions ran; two or more
    // files mean the kill came while one was being folded.
    let mut logs: Vec<u64> = std::fs::read_dir(store_dir.join(".meta").join("disks"))
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .filter_map(|f| {
            f.file_name().to_str().and_then(|n| n.strip_prefix("log.")).and_then(|n| n.parse().ok())
        })
        .collect();
    logs.sort();
    eprintln!("log files at the kill: {logs:?}");
    assert!(logs.last().is_some_and(|&n| n >= 2), "no compaction ran before the kill: {logs:?}");

    // Restart on the same store: recovery is the log replay at open, nothing else.
    let mut server = spawn_server(&store_dir, &sock);
    let mut c = Client::connect(&sock, "d", true, false).unwrap();
    for (i, part) in a.chunks(1 << 20).enumerate() {
        assert!(
            c.read(i as u64 * (1 << 20), 1 << 20).unwrap() == part,
            "flushed region A lost at MiB {i}"
        );
    }
    for k in 0..=acked as u64 {
        let got = c.read(marker_base + k * 4096, 4096).unwrap();
        assert!(
            got == pattern(1000 + k, 4096),
            "acknowledged marker {k} of {acked} lost after kill -9"
        );
    }
    eprintln!("kill -9 after {acked} acknowledged marker flushes under fio load: all intact");
    drop(c);
    server.kill();

    let s = strata::store::Store::open_local(&store_dir).unwrap();
    let rep = s.check(Default::default(), &strata::progress::NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
}

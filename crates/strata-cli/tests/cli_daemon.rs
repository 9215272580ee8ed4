//! Disk commands while `strata serve` owns the disks, through the `strata` binary: on the
//! embedded store and on an S3 store (versitygw on loopback) with an SSD cache.
//!
//! A record writer (a minimal NBD client in this file) writes numbered 4 KiB records one
//! after another, alternating between two served disks, and notes when each write started and
//! when it was acknowledged; fio writes and verifies a third disk meanwhile. Then `strata disk
//! snapshot desk1 s1 --also desk2`, `clone`, `clone --full`, `export`, `compact` and `info`
//! run beside it. Each image taken must hold a prefix of the record sequence (over both disks
//! for the two-disk snapshot: one instant) that contains every record acknowledged before the
//! command was started and none whose write started after it returned. `rm` is refused while
//! the writer is connected and `rm --force` disconnects it. Create, import and list run in
//! their own process beside the daemon, and the daemon serves what they made. The `cut`,
//! `whoami` and `disk-revert` control ops are spoken raw, as `vm snapshot` speaks them.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use strata::backend::servers::S3Server;

const REC: usize = 4096;
const DISK_MIB: u64 = 128;

/// How to run `strata` on one store.
struct Env {
    store: PathBuf,
    vars: Vec<(&'static str, String)>,
}

impl Env {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
        c.arg("--store").arg(&self.store).args(args);
        for (k, v) in &self.vars {
            c.env(k, v);
        }
        c.env_remove("STRATA_STORE").env_remove("STRATA_HOSTNAME");
        c
    }
    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run strata")
    }
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "strata {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.push("--json");
        serde_json::from_str(&self.ok(&a)).unwrap()
    }
    fn fails(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            !o.status.success(),
            "strata {args:?} should fail: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        String::from_utf8_lossy(&o.stderr).into_owned()
    }
    fn control(&self) -> PathBuf {
        self.store.join(".meta").join("control.sock")
    }
}

/// `strata serve`, stopped with SIGTERM on drop.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn serve(env: &Env, sock: &Path) -> Serve {
    let child = env
        .cmd(&["serve", "--socket", sock.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = Serve(child);
    let t = Instant::now();
    while raw(&env.control(), &json!({"op": "whoami"})).is_err() {
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    s
}

/// One control request, one reply line.
fn raw(sock: &Path, req: &Value) -> std::io::Result<Value> {
    let mut c = UnixStream::connect(sock)?;
    c.write_all(format!("{req}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line)?;
    Ok(serde_json::from_str(&line).unwrap())
}

// ---------------------------------------------------------------------------------------
// A minimal NBD client: newstyle handshake with NBD_OPT_EXPORT_NAME, simple replies.

struct Nbd(UnixStream);

impl Nbd {
    fn connect(sock: &Path, name: &str) -> Nbd {
        let mut s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..8], b"NBDMAGIC");
        s.write_all(&3u32.to_be_bytes()).unwrap(); // fixed newstyle, no zeroes
        let mut opt = b"IHAVEOPT".to_vec();
        opt.extend_from_slice(&1u32.to_be_bytes());
        opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
        opt.extend_from_slice(name.as_bytes());
        s.write_all(&opt).unwrap();
        let mut info = [0u8; 10];
        s.read_exact(&mut info).unwrap();
        Nbd(s)
    }

    /// Write and wait for the reply: Ok, or the NBD errno (0 for a closed connection).
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), u32> {
        let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
        m.extend_from_slice(&0u16.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
        m.extend_from_slice(&7u64.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.0.write_all(&m).map_err(|_| 0u32)?;
        let mut r = [0u8; 16];
        self.0.read_exact(&mut r).map_err(|_| 0u32)?;
        assert_eq!(&r[..4], &0x6744_6698u32.to_be_bytes());
        match u32::from_be_bytes(r[4..8].try_into().unwrap()) {
            0 => Ok(()),
            e => Err(e),
        }
    }

    /// Wait for the server to close the connection.
    fn closed_within(&mut self, d: Duration) -> bool {
        self.0.set_read_timeout(Some(d)).unwrap();
        let mut b = [0u8; 16];
        matches!(self.0.read(&mut b), Ok(0) | Err(_)) && {
            // A timeout is an error too: tell it from a close.
            let mut probe = [0u8; 1];
            self.0.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
            matches!(self.0.read(&mut probe), Ok(0))
        }
    }
}

/// Record `i` (from 0): its disk (i % 2), its offset there, its bytes.
fn record(i: usize) -> (usize, u64, Vec<u8>) {
    let mut b = vec![(i % 251) as u8 | 1; REC];
    b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    (i % 2, ((i / 2) * REC) as u64, b)
}

/// Writes records 0, 1, 2, ... one at a time over one connection per disk.
struct Writer {
    stop: Arc<AtomicBool>,
    /// (write started, acknowledged) per record written so far.
    log: Arc<Mutex<Vec<(Instant, Instant)>>>,
    thread: Option<std::thread::JoinHandle<[Nbd; 2]>>,
}

impl Writer {
    fn start(sock: &Path, disks: [&str; 2]) -> Writer {
        let mut conns = [Nbd::connect(sock, disks[0]), Nbd::connect(sock, disks[1])];
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (st, lg) = (stop.clone(), log.clone());
        let max = (DISK_MIB << 20) as usize / REC * 2;
        let thread = std::thread::spawn(move || {
            for i in 0..max {
                if st.load(Ordering::Relaxed) {
                    break;
                }
                let (d, off, data) = record(i);
                let t0 = Instant::now();
                conns[d].write(off, &data).unwrap_or_else(|e| panic!("record {i}: errno {e}"));
                lg.lock().unwrap().push((t0, Instant::now()));
                std::thread::sleep(Duration::from_micros(300));
            }
            conns
        });
        Writer { stop, log, thread: Some(thread) }
    }

    /// Records acknowledged before `t`, and records whose write started before `t`.
    fn bounds(&self, before: Instant, after: Instant) -> (usize, usize) {
        let log = self.log.lock().unwrap();
        (
            log.iter().filter(|(_, a)| *a < before).count(),
            log.iter().filter(|(s, _)| *s < after).count(),
        )
    }

    fn written(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    fn finish(mut self) -> [Nbd; 2] {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// How many records of the sequence `images` (the two disks' images) hold: they must hold
/// exactly a prefix of it (over both disks), zeroes elsewhere.
fn prefix_len(images: [&[u8]; 2]) -> usize {
    prefix_of(images, &[0, 1])
}

/// The same for the records of one disk (`which`) only: `img` must hold a prefix of them.
fn prefix_one(img: &[u8], which: usize) -> usize {
    let zero = vec![0u8; img.len()];
    let images = if which == 0 { [img, &zero[..]] } else { [&zero[..], img] };
    prefix_of(images, &[which])
}

fn prefix_of(images: [&[u8]; 2], disks: &[usize]) -> usize {
    let total = images[0].len() / REC * 2;
    let seq: Vec<usize> = (0..total).filter(|i| disks.contains(&(i % 2))).collect();
    let mut n = 0;
    let at = |i: usize| {
        let (d, off, want) = record(i);
        (images[d][off as usize..off as usize + REC].to_vec(), want)
    };
    while n < seq.len() {
        let (got, want) = at(seq[n]);
        if got != want {
            assert!(got.iter().all(|&b| b == 0), "record {} is neither written nor empty", seq[n]);
            break;
        }
        n += 1;
    }
    for &i in &seq[n..] {
        let (got, _) = at(i);
        assert!(got.iter().all(|&b| b == 0), "record {i} is present but an earlier one is not");
    }
    n
}

fn export(env: &Env, name: &str, dir: &Path) -> Vec<u8> {
    let f = dir.join(format!("{}.raw", name.replace('@', "_")));
    env.ok(&["disk", "export", name, f.to_str().unwrap()]);
    std::fs::read(f).unwrap()
}

/// Of the first `n` records of the sequence, those on disk `which`.
fn on_disk(n: usize, which: usize) -> usize {
    (n + 1 - which) / 2
}

fn fio(sock: &Path, disk: &str) -> Child {
    let uri = format!("nbd+unix:///{disk}?socket={}", sock.display());
    Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=16k",
            "--size=32m",
            "--iodepth=8",
            "--verify=crc32c",
            "--do_verify=1",
            "--output-format=terse",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fio (apt-get install fio)")
}

fn exercise(env: &Env, dir: &Path) {
    let size = format!("{DISK_MIB}M");
    env.ok(&["disk", "create", "desk1", "--size", &size]);
    env.ok(&["disk", "create", "desk2", "--size", &size]);
    env.ok(&["disk", "create", "load", "--size", "32M"]);
    let sock = dir.join("nbd.sock");
    let srv = serve(env, &sock);

    let who = raw(&env.control(), &json!({"op": "whoami"})).unwrap();
    assert_eq!(who["ok"], true, "{who}");
    assert_eq!(who["report"]["pid"], srv.0.id(), "{who}");
    assert_eq!(who["report"]["nbd"]["unix"], sock.to_str().unwrap(), "{who}");
    assert_eq!(
        Path::new(who["report"]["store"].as_str().unwrap()).canonicalize().unwrap(),
        env.store.canonicalize().unwrap()
    );

    let load = fio(&sock, "load");
    let w = Writer::start(&sock, ["desk1", "desk2"]);
    while w.written() < 200 {
        std::thread::sleep(Duration::from_millis(10));
    }

    // A two-disk snapshot at one instant, while both disks are written.
    let t0 = Instant::now();
    let snaps = env.json(&["disk", "snapshot", "desk1", "s1", "--also", "desk2"]);
    let t1 = Instant::now();
    assert_eq!(snaps[0]["name"], "desk1@s1", "{snaps}");
    assert_eq!(snaps[1]["name"], "desk2@s1", "{snaps}");
    let one = env.json(&["disk", "snapshot", "desk1", "s2"]);
    assert_eq!(one["name"], "desk1@s2", "one disk: one DiskInfo, as before: {one}");
    let snap_bounds = w.bounds(t0, t1);

    // Clones and an export of a disk being written.
    let t2 = Instant::now();
    let c = env.json(&["disk", "clone", "desk1", "c1"]);
    let t3 = Instant::now();
    assert_eq!(c["disk"]["parent"], "desk1", "{c}");
    let clone_bounds = w.bounds(t2, t3);
    let t4 = Instant::now();
    let c = env.json(&["disk", "clone", "desk2", "c2", "--full"]);
    let t5 = Instant::now();
    assert!(c["disk"].get("parent").is_none(), "{c}");
    let full_bounds = w.bounds(t4, t5);
    let t6 = Instant::now();
    let live = export(env, "desk1", dir);
    let export_bounds = w.bounds(t6, Instant::now());
    let g = env.json(&["disk", "compact", "desk1"]);
    assert!(g["generation"].as_u64().unwrap() >= 1, "{g}");
    let i = env.json(&["disk", "info", "desk1"]);
    assert_eq!(i["served"]["clients"], 1, "{i}");
    assert!(env.ok(&["disk", "info", "desk2"]).contains("1 NBD client(s) connected"));

    // The cut op as `vm snapshot` speaks it: two lines, then the session until we close.
    let t7 = Instant::now();
    let mut cut = UnixStream::connect(env.control()).unwrap();
    cut.write_all(b"{\"op\":\"cut\",\"disks\":[\"desk1\",\"desk2\"]}\n").unwrap();
    let mut r = BufReader::new(cut.try_clone().unwrap());
    let mut l1 = String::new();
    r.read_line(&mut l1).unwrap();
    let t8 = Instant::now();
    let l1: Value = serde_json::from_str(&l1).unwrap();
    assert_eq!(l1["ok"], true, "{l1}");
    assert!(l1["cut_ms"].as_f64().unwrap() < 1000.0, "{l1}");
    let cut_bounds = w.bounds(t7, t8);
    let mut l2 = String::new();
    r.read_line(&mut l2).unwrap();
    let l2: Value = serde_json::from_str(&l2).unwrap();
    assert_eq!(l2["ok"], true, "{l2}");
    let cut_disks = l2["disks"].as_array().unwrap().clone();
    assert_eq!(cut_disks.len(), 2);
    assert_eq!(cut_disks[1]["name"], "desk2");
    assert_eq!(cut_disks[1]["meta"]["size"], DISK_MIB << 20);

    let conns = w.finish();
    let (a, b) = (export(env, "desk1@s1", dir), export(env, "desk2@s1", dir));
    let n = prefix_len([&a, &b]);
    eprintln!(
        "two-disk snapshot: {n} records; acknowledged before, started before: {snap_bounds:?}"
    );
    assert!(
        n >= snap_bounds.0 && n <= snap_bounds.1,
        "snapshot: {n} records, bounds {snap_bounds:?}"
    );
    assert!(snap_bounds.0 > 0, "the writer had written before the snapshot");
    for (name, which, bounds) in
        [("c1", 0, clone_bounds), ("c2", 1, full_bounds), ("desk1", 0, export_bounds)]
    {
        let img = if name == "desk1" { live.clone() } else { export(env, name, dir) };
        let n = prefix_one(&img, which);
        eprintln!("{name}: {n} records of its disk; sequence bounds {bounds:?}");
        assert!(
            n >= on_disk(bounds.0, which) && n <= on_disk(bounds.1, which),
            "{name}: {n} records of its disk, bounds {bounds:?}"
        );
    }

    // Revert desk2 to the cut, as `vm revert` does: refused while connected, then forced.
    let req = json!({"op": "disk-revert", "name": "desk2", "root": cut_disks[1]["root"],
        "meta": cut_disks[1]["meta"], "force": false});
    let rep = raw(&env.control(), &req).unwrap();
    assert_eq!(rep["ok"], false, "{rep}");
    assert!(rep["error"].as_str().unwrap().contains("1 NBD client(s) connected"), "{rep}");
    let mut req = req;
    req["force"] = json!(true);
    let rep = raw(&env.control(), &req).unwrap();
    assert_eq!(rep["ok"], true, "{rep}");
    drop(r);
    drop(cut);
    let [mut c1, mut c2] = conns;
    assert!(c2.closed_within(Duration::from_secs(5)), "a forced revert disconnects");
    let n = prefix_one(&export(env, "desk2", dir), 1);
    assert!(
        n >= on_disk(cut_bounds.0, 1) && n <= on_disk(cut_bounds.1, 1),
        "cut: {n}, {cut_bounds:?}"
    );

    // rm: refused while the writer is connected, --force disconnects it.
    let e = env.fails(&["disk", "rm", "desk1"]);
    assert!(
        e.contains("Disk 'desk1' has 1 NBD client(s) connected") && e.contains("--force"),
        "{e}"
    );
    assert!(c1.write(0, &[9u8; REC]).is_ok(), "a refused rm leaves the client working");
    env.ok(&["disk", "rm", "desk1", "--force"]);
    assert!(c1.closed_within(Duration::from_secs(5)), "rm --force disconnects");
    let list = env.ok(&["disk", "list"]);
    assert!(!list.lines().any(|l| l.starts_with("desk1 ")), "{list}");

    // fio wrote and verified its disk beside all of this.
    let out = load.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Create, import and list run in their own process; the daemon serves what they made.
    env.ok(&["disk", "create", "fresh", "--size", "1M"]);
    let img = dir.join("img.raw");
    let data: Vec<u8> =
        (0..(2u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(&img, &data).unwrap();
    env.ok(&["disk", "import", "imported", img.to_str().unwrap()]);
    assert!(env.ok(&["disk", "list"]).contains("imported"));
    let mut c = Nbd::connect(&sock, "imported");
    c.write(0, &[5u8; REC]).unwrap();
    let got = export(env, "imported", dir);
    assert_eq!(&got[..REC], &[5u8; REC][..]);
    assert_eq!(&got[REC..], &data[REC..], "the daemon reads chunks another process stored");
    drop(c);

    // GC runs in the daemon; the store is sound after a clean stop.
    env.ok(&["gc"]);
    drop(srv);
    assert!(env.ok(&["check"]).contains("No damage found"));
    assert!(env.ok(&["disk", "list"]).contains("desk1@s1"));
}

#[test]
fn disk_commands_go_through_the_daemon_on_the_embedded_store() {
    let d = tempfile::tempdir().unwrap();
    let env = Env { store: d.path().join("store"), vars: vec![] };
    env.ok(&["init"]);
    exercise(&env, d.path());
}

#[test]
fn disk_commands_go_through_the_daemon_on_s3_with_a_cache() {
    let d = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&d.path().join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("daemon").unwrap();
    let env = Env { store: d.path().join("host"), vars: s3.env() };
    let cache = d.path().join("cache");
    env.ok(&[
        "init",
        "--backend",
        "s3://daemon/st",
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "64M",
    ]);
    exercise(&env, d.path());
}

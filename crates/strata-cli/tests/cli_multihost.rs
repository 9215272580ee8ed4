//! Two hosts, one bucket, through the `strata` binary: the way an operator would run it.
//!
//! A real S3 server (versitygw on loopback) holds the store. "Host A" and "host B" are two
//! `--store` directories (own metadata, own SSD cache) initialised with the same
//! `--backend s3://BUCKET`; B joins what A created. The test checks that B sees A's disks and
//! snapshots byte for byte, that a disk served (written) by A cannot be written, removed or
//! compacted by B, that GC refuses while another instance has the store open, and that a
//! writer's lease is taken over after its holder is killed: at once on the same host (dead
//! pid), after the TTL when the holder claims another host name.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use strata::backend::servers::S3Server;

struct Env {
    s3: S3Server,
    url: String,
}

impl Env {
    fn cmd(&self, store: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
        c.arg("--store").arg(store).args(args);
        for (k, v) in self.s3.env() {
            c.env(k, v);
        }
        c.env_remove("STRATA_HOSTNAME");
        c
    }
    fn run(&self, store: &Path, args: &[&str]) -> Output {
        self.cmd(store, args).output().expect("run strata")
    }
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "strata failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fails(o: &Output) -> String {
    assert!(
        !o.status.success(),
        "strata should have failed: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn image(path: &Path, mib: usize, seed: u64) {
    let mut v = vec![0u8; mib << 20];
    let mut x = seed | 1;
    for (i, b) in v.iter_mut().enumerate() {
        if (i >> 16) % 3 != 2 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    std::fs::write(path, v).unwrap();
}

fn setup(d: &Path) -> Env {
    let s3 = S3Server::start(&d.join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("shared").unwrap();
    Env { s3, url: "s3://shared/vdi".into() }
}

fn init(env: &Env, store: &Path, cache: &Path) -> serde_json::Value {
    let o = env.run(
        store,
        &[
            "init",
            "--backend",
            &env.url,
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "64M",
            "--json",
        ],
    );
    serde_json::from_str(&ok(&o)).unwrap()
}

/// Start `strata serve` for `store`, optionally claiming another host name and a short TTL.
fn serve(env: &Env, store: &Path, sock: &Path, hostname: Option<&str>) -> Child {
    let mut c = env.cmd(store, &["serve", "--socket", sock.to_str().unwrap()]);
    if let Some(h) = hostname {
        c.env("STRATA_HOSTNAME", h).env("STRATA_LEASE_TTL_MS", "3000");
    }
    let child = c.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

/// Write through NBD with qemu-io, which makes serve open the disk (and take its lease).
fn nbd_write(sock: &Path, disk: &str, pattern: u8) {
    let uri = format!("nbd+unix:///{disk}?socket={}", sock.display());
    let o = Command::new("qemu-io")
        .args(["-f", "raw", "-c", &format!("write -P {pattern} 0 64k"), "-c", "flush", &uri])
        .output()
        .expect("qemu-io (apt-get install qemu-utils)");
    assert!(o.status.success(), "qemu-io: {}", String::from_utf8_lossy(&o.stderr));
}

fn kill9(c: &mut Child) {
    // SAFETY: sending SIGKILL to our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
    let _ = c.wait();
}

fn stop(c: &mut Child) {
    // SAFETY: sending SIGTERM to our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    let _ = c.wait();
}

#[test]
fn a_second_host_sees_everything_and_leases_keep_one_writer() {
    let d = tempfile::tempdir().unwrap();
    let env = setup(d.path());
    let (a, b) = (d.path().join("hostA"), d.path().join("hostB"));

    // Host A creates the store in the bucket; B joins it.
    let ia = init(&env, &a, &d.path().join("cacheA"));
    assert_eq!(ia["created"], true, "{ia}");
    assert_eq!(
        ia["pack_size"],
        strata::backend::s3::S3_PACK_SIZE,
        "S3's preferred pack size: {ia}"
    );
    assert!(a.join("host.json").is_file());
    let ib = init(&env, &b, &d.path().join("cacheB"));
    assert_eq!(ib["created"], false, "B must join, not create: {ib}");

    // A imports a golden image and snapshots it; B sees both, byte for byte.
    let img = d.path().join("golden.raw");
    image(&img, 24, 7);
    ok(&env.run(&a, &["disk", "import", "golden", img.to_str().unwrap()]));
    ok(&env.run(&a, &["disk", "snapshot", "golden", "v1"]));
    let la = ok(&env.run(&a, &["disk", "list", "--json"]));
    let lb = ok(&env.run(&b, &["disk", "list", "--json"]));
    assert_eq!(la, lb);
    assert!(lb.contains("golden@v1"), "{lb}");
    let out = d.path().join("b-export.raw");
    ok(&env.run(&b, &["disk", "export", "golden@v1", out.to_str().unwrap()]));
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(&img).unwrap(),
        "B reads A's snapshot intact"
    );
    // B's reads came through its own cache: stats say so.
    let st: serde_json::Value =
        serde_json::from_str(&ok(&env.run(&b, &["stats", "--json"]))).unwrap();
    assert!(st["cache"]["dir"].as_str().unwrap().ends_with("cacheB"), "{st}");
    assert!(st["backend"]["name"].as_str().unwrap().contains("s3"), "{st}");

    // B clones A's snapshot; A sees the clone.
    ok(&env.run(&b, &["disk", "clone", "golden@v1", "desk1"]));
    assert!(ok(&env.run(&a, &["disk", "list"])).contains("desk1"));

    // A serves desk1 and a client writes it: A holds desk1's lease.
    let sock = d.path().join("a.sock");
    let mut srv = serve(&env, &a, &sock, None);
    nbd_write(&sock, "desk1", 0xa1);
    let e = fails(&env.run(&b, &["disk", "rm", "desk1"]));
    assert!(e.contains("being written by") && e.contains("strata"), "{e}");
    let e = fails(&env.run(&b, &["disk", "compact", "desk1"]));
    assert!(e.contains("being written by"), "{e}");
    // Other disks stay writable from B, and reading desk1 is fine.
    ok(&env.run(&b, &["disk", "clone", "golden@v1", "desk2"]));
    ok(&env.run(&b, &["disk", "info", "desk1"]));
    // GC needs the store to itself.
    let e = fails(&env.run(&b, &["gc"]));
    assert!(e.contains("GC needs the store to itself"), "{e}");
    // A clean stop releases the lease: B may now write desk1 and sees A's data.
    stop(&mut srv);
    ok(&env.run(&b, &["disk", "compact", "desk1"]));
    let x = d.path().join("desk1.raw");
    ok(&env.run(&b, &["disk", "export", "desk1", x.to_str().unwrap()]));
    assert!(
        std::fs::read(&x).unwrap()[..65536].iter().all(|&c| c == 0xa1),
        "A's acknowledged write is in the backend"
    );

    // kill -9 on the same host: the pid is dead, so the lease is free at once.
    let mut srv = serve(&env, &a, &sock, None);
    nbd_write(&sock, "desk2", 0xb2);
    kill9(&mut srv);
    ok(&env.run(&b, &["disk", "rm", "desk2"]));

    // A holder that claims another host (so its death can't be seen) blocks B until its
    // lease expires (TTL 3 s), then B takes over.
    let _ = std::fs::remove_file(&sock);
    let mut srv = serve(&env, &a, &sock, Some("host-a.example"));
    nbd_write(&sock, "desk1", 0xc3);
    kill9(&mut srv);
    let t = Instant::now();
    let e = fails(&env.run(&b, &["disk", "rm", "desk1"]));
    assert!(e.contains("host-a.example"), "names the holder: {e}");
    loop {
        let o = env.run(&b, &["disk", "rm", "desk1"]);
        if o.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "lease never expired: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "taken over before the TTL: {:?}",
        t.elapsed()
    );

    // With everyone gone, GC runs (the dead host's presence has expired too) and the store is sound.
    let t = Instant::now();
    loop {
        let o = env.run(&b, &["gc", "--json"]);
        if o.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "gc refused: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(ok(&env.run(&a, &["check"])).contains("No damage found"));
    assert!(ok(&env.run(&a, &["disk", "list"])).contains("golden@v1"));
}

#[test]
fn init_errors_name_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let env = setup(d.path());
    let a: PathBuf = d.path().join("h");
    // Wrong credentials.
    let o = env
        .cmd(&a, &["init", "--backend", &env.url])
        .env("AWS_SECRET_ACCESS_KEY", "wrong")
        .output()
        .unwrap();
    let e = fails(&o);
    assert!(e.to_lowercase().contains("credential") || e.contains("denied"), "{e}");
    assert!(!a.join("host.json").exists(), "a failed init leaves no host.json");
    // Missing bucket.
    let e = fails(&env.run(&a, &["init", "--backend", "s3://nosuchbucket"]));
    assert!(e.contains("nosuchbucket"), "{e}");
    // A cache without a remote backend.
    let e = fails(&env.run(&a, &["init", "--cache", "/tmp/x", "--cache-size", "1G"]));
    assert!(e.contains("--cache needs a remote --backend"), "{e}");
    // Opening a directory that is no store.
    let e = fails(&env.run(&d.path().join("none"), &["disk", "list"]));
    assert!(e.contains("strata init"), "{e}");
}

/// A desktop snapshot taken on host A restores on host B of the same bucket: B's
/// `vm restore --launch` clones the snapshot's disk in the shared store, rewrites the recorded
/// command line from A's NBD socket to B's, and the VM runs on B's daemon with the disk as it
/// was at the snapshot (A's later write is not in it).
#[test]
fn a_desktop_snapshot_from_one_host_restores_on_another() {
    let d = tempfile::tempdir().unwrap();
    let env = setup(d.path());
    let (a, b) = (d.path().join("hostA"), d.path().join("hostB"));
    init(&env, &a, &d.path().join("cacheA"));
    init(&env, &b, &d.path().join("cacheB"));
    ok(&env.run(&a, &["disk", "create", "desk1", "--size", "64M"]));
    let (sa, sb) = (d.path().join("a.sock"), d.path().join("b.sock"));
    let mut serve_a = serve(&env, &a, &sa, None);
    nbd_write(&sa, "desk1", 0x11);
    let qmp_a = d.path().join("a.qmp");
    let mut qemu_a = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg", "-m", "128", "-display", "none", "-nodefaults"])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_a.display()))
        .arg("-drive")
        .arg(format!("file=nbd+unix:///desk1?socket={},format=raw,if=virtio", sa.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !qmp_a.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "QEMU did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let snap: serde_json::Value = serde_json::from_str(&ok(
        &env.run(&a, &["--json", "vm", "snapshot", "--qmp", qmp_a.to_str().unwrap(), "desk1@mon"])
    ))
    .unwrap();
    assert_eq!(snap["disks"].as_array().map(Vec::len), Some(1), "{snap}");
    // After the snapshot, A's disk changes; the snapshot must not.
    nbd_write(&sa, "desk1", 0x22);
    kill9(&mut qemu_a);
    stop(&mut serve_a);

    let mut serve_b = serve(&env, &b, &sb, Some("hostB"));
    let rd = d.path().join("runB");
    let out: serde_json::Value = serde_json::from_str(&ok(&env.run(
        &b,
        &["--json", "vm", "restore", "desk1@mon", "--launch", "--run-dir", rd.to_str().unwrap()],
    )))
    .unwrap();
    let qemu_b = Pid(out["pid"].as_i64().unwrap_or_else(|| panic!("{out}")) as i32);
    assert_eq!(out["vm_status"], "running", "{out}");
    let clone = out["disks"][0]["now"].as_str().unwrap_or_else(|| panic!("{out}")).to_string();
    assert_ne!(clone, "desk1");
    let args: Vec<String> = serde_json::from_value(out["args"].clone()).unwrap();
    let drive = args.iter().find(|a| a.contains("nbd+unix")).unwrap_or_else(|| panic!("{out}"));
    assert!(
        drive.contains(&format!("///{clone}?socket={}", sb.display())),
        "the command line is not pointed at B's daemon and the clone: {drive}"
    );
    // The clone holds the disk as it was at the snapshot, read over B's daemon.
    let uri = format!("nbd+unix:///{clone}?socket={}", sb.display());
    let o = Command::new("qemu-io")
        .args(["-r", "-f", "raw", "-c", "read -P 17 0 64k", &uri])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && !said.contains("Pattern verification failed"), "{said}");
    drop(qemu_b);
    stop(&mut serve_b);
}

/// A process that is not our child (the QEMU `vm restore --launch` starts): killed on drop.
struct Pid(i32);

impl Drop for Pid {
    fn drop(&mut self) {
        // SAFETY: SIGKILL to the QEMU this test had strata start.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

//! What a desktop snapshot refuses, and how it says so: a VM with a disk that is not a strata
//! disk (named; `--allow-foreign-disks` records memory only for it, with a warning), disks
//! whose daemon is not running, and a snapshot name that exists. The VM is a real QEMU (TCG,
//! no guest OS: firmware idles) with one disk served by `strata serve` and one local qcow2.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

fn strata(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("run strata")
}

fn ok(store: &Path, args: &[&str]) -> String {
    let o = strata(store, args);
    assert!(o.status.success(), "strata {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn refused(store: &Path, args: &[&str]) -> String {
    let o = strata(store, args);
    assert!(!o.status.success(), "strata {args:?} should fail");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(p: &Path) {
    let t = Instant::now();
    while !p.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "{} did not appear", p.display());
        sleep(Duration::from_millis(50));
    }
}

fn serve(store: &Path, sock: &Path) -> Kill {
    let c = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(store)
        .args(["serve", "--socket", sock.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(sock);
    Kill(c)
}

#[test]
fn foreign_disks_missing_daemons_and_taken_names_are_refused_clearly() {
    let d = tempfile::tempdir().unwrap();
    let store = d.path().join("store");
    ok(&store, &["init"]);
    ok(&store, &["disk", "create", "desk1", "--size", "64M"]);
    let sock = d.path().join("nbd.sock");
    let qcow = d.path().join("local.qcow2");
    let qi = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", qcow.to_str().unwrap(), "64M"])
        .status()
        .unwrap();
    assert!(qi.success());
    let mut daemon = Some(serve(&store, &sock));
    let qmp: PathBuf = d.path().join("qmp.sock");
    let _qemu = Kill(
        Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-m", "128", "-display", "none", "-nodefaults"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .arg("-drive")
            .arg(format!("file=nbd+unix:///desk1?socket={},format=raw,if=virtio", sock.display()))
            .arg("-drive")
            .arg(format!("file={},format=qcow2,if=virtio,id=localdisk", qcow.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(&qmp);
    sleep(Duration::from_millis(500));
    let q = qmp.to_str().unwrap();

    // A writable disk that is not a strata disk: refused, naming it and the ways out.
    let e = refused(&store, &["vm", "snapshot", "--qmp", q, "s1"]);
    assert!(e.contains("localdisk") && e.contains("is not a strata disk"), "{e}");
    assert!(e.contains("--allow-foreign-disks") && e.contains("--memory-only"), "{e}");
    assert!(ok(&store, &["vm", "list"]).contains("No snapshots"), "a refused snapshot is listed");

    // Allowed: memory and the strata disk, with a warning for the other.
    let o =
        strata(&store, &["--json", "vm", "snapshot", "--qmp", q, "s1", "--allow-foreign-disks"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let warn = String::from_utf8_lossy(&o.stderr);
    assert!(warn.contains("warning") && warn.contains("localdisk"), "{warn}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let disks = v["disks"].as_array().unwrap();
    assert_eq!(disks.len(), 1, "{v}");
    assert_eq!(disks[0]["disk"], "desk1");

    // The name exists.
    let e = refused(&store, &["vm", "snapshot", "--qmp", q, "s1", "--allow-foreign-disks"]);
    assert!(e.contains("already exists") && e.contains("strata vm rm s1"), "{e}");

    // Memory only asks nothing of the daemon.
    ok(&store, &["vm", "snapshot", "--qmp", q, "s3", "--memory-only"]);

    // No daemon: refused, saying to start it.
    let _ = daemon.take();
    sleep(Duration::from_millis(300));
    let e = refused(&store, &["vm", "snapshot", "--qmp", q, "s2", "--allow-foreign-disks"]);
    assert!(e.contains("no strata serve runs") && e.contains("start `strata serve`"), "{e}");
    let l = ok(&store, &["vm", "list"]);
    assert!(l.contains("s1") && l.contains("desk1") && l.contains("s3"), "{l}");
    // A desktop snapshot needs the daemon to restore its disks too.
    let e = refused(&store, &["vm", "restore", "s1", "--disks-only"]);
    assert!(e.contains("no strata serve runs"), "{e}");
    // Removing it removes its disk with it.
    let out = ok(&store, &["vm", "rm", "s1"]);
    assert!(out.contains("1 disk snapshot"), "{out}");
}

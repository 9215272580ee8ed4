//! Integration tests of the test guests themselves (scripts/fixtures.sh + strata::fixtures),
//! against real `qemu-system-x86_64 -accel tcg`, `qemu-img` and `sha256sum`.
//!
//! They prove what every other guest-based test relies on: the memory guest boots on both
//! machine types, `memwork` fills memory deterministically (the in-guest checksum equals the
//! one the same binary computes on the host), its memory survives a QEMU migration round trip
//! through a file, and the golden disk boots from a qcow2 overlay and keeps writes across a
//! reboot and a QEMU restart while the base image stays untouched.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use strata::fixtures::{
    create_overlay, reply_field, FixtureError, Fixtures, Guest, GuestMode, Machine,
};
use strata::qmp::QmpClient;

const CMD: Duration = Duration::from_secs(120);

fn fixtures() -> Fixtures {
    Fixtures::ensure().expect("fixtures (scripts/fixtures.sh)")
}

fn field(payload: &str, key: &str) -> String {
    reply_field(payload, key)
        .unwrap_or_else(|| panic!("no {key}= in reply {payload:?}"))
        .to_string()
}

/// Run the fixture's memwork binary on the host with the given command lines; returns the
/// reply lines (the host is x86-64 Linux too, and the binary is static).
fn host_memwork(fx: &Fixtures, lines: &[&str]) -> Vec<String> {
    let mut child = Command::new(fx.memwork())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run memwork on the host");
    {
        let mut stdin = child.stdin.take().unwrap();
        for l in lines {
            writeln!(stdin, "{l}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .skip(1) // STRATA-READY banner
        .map(str::to_string)
        .collect()
}

fn mem_guest_checks(machine: Machine, bzimage: bool) {
    let fx = fixtures();
    let t0 = Instant::now();
    let mut g = fx
        .guest()
        .machine(machine)
        .bzimage(bzimage)
        .name(&format!("mem-{}", machine.as_str()))
        .launch()
        .expect("boot mem guest");
    eprintln!("{} (bzimage {bzimage}) booted in {:?}", machine.as_str(), t0.elapsed());
    assert!(g.ready_line().unwrap().contains("agent=memwork"));
    assert_eq!(g.command("ping", CMD).unwrap(), "pong");

    let t = Instant::now();
    let fill = g.command("fill 64 30 30 1", CMD).unwrap();
    eprintln!("fill 64 MiB took {:?}: {fill}", t.elapsed());
    assert_eq!(field(&fill, "pages"), "16384");
    let zero: f64 = field(&fill, "zero").parse().unwrap();
    let repeat: f64 = field(&fill, "repeat").parse().unwrap();
    assert!((zero / 16384.0 - 0.30).abs() < 0.02, "zero share off: {fill}");
    assert!((repeat / 16384.0 - 0.30).abs() < 0.02, "repeat share off: {fill}");

    let s1 = g.command("sum", CMD).unwrap();
    let s2 = g.command("sum", CMD).unwrap();
    assert_eq!(s1, s2, "sum is not stable");
    assert_eq!(field(&s1, "pages"), "16384");
    assert_eq!(field(&s1, "zero"), field(&fill, "zero"));

    // the same binary on the host gives the same bytes
    let host = host_memwork(&fx, &["fill 64 30 30 1", "sum"]);
    assert_eq!(host[1], format!("OK {s1}"), "guest and host disagree");

    // another seed gives other content
    g.command("free", CMD).unwrap();
    g.command("fill 64 30 30 2", CMD).unwrap();
    let s3 = g.command("sum", CMD).unwrap();
    assert_ne!(field(&s3, "sum"), field(&s1, "sum"));

    // bad input is refused with a usage hint, and the agent keeps serving
    match g.command("fill 64 80 30 1", CMD) {
        Err(FixtureError::Agent { message, .. }) => assert!(message.contains("at most 100")),
        other => panic!("expected an agent error, got {other:?}"),
    }
    // asking for more than the VM has is refused before the OOM killer could strike
    match g.command("fill 4096 0 0 1", CMD) {
        Err(FixtureError::Agent { message, .. }) => {
            assert!(message.contains("give the VM more memory"), "{message}")
        }
        other => panic!("expected an agent error, got {other:?}"),
    }
    assert_eq!(g.command("ping", CMD).unwrap(), "pong");

    // desktop-like content from files (the initramfs here) is stable too
    let text = g.command("text 8 /", CMD).unwrap();
    assert_eq!(field(&text, "pages"), "2048", "{text}");
    let t1 = g.command("sum", CMD).unwrap();
    assert_eq!(t1, g.command("sum", CMD).unwrap());
    assert_eq!(field(&t1, "pages"), (16384 + 2048).to_string());
    g.kill().unwrap();
}

/// `pc` boots Debian's bzImage as shipped (the path the task's command line uses).
#[test]
fn mem_guest_on_pc_is_deterministic() {
    mem_guest_checks(Machine::Pc, true);
}

/// `q35` boots the uncompressed PVH vmlinux, the harness's default.
#[test]
fn mem_guest_on_q35_is_deterministic() {
    mem_guest_checks(Machine::Q35, false);
}

/// Save the guest's state to `file` with QMP `migrate exec:cat > file`; returns the time taken.
fn migrate_to_file(g: &Guest, file: &Path) -> Duration {
    let mut q = QmpClient::connect(g.qmp_path().expect("guest started with qmp")).expect("QMP");
    let t = Instant::now();
    q.migrate(&format!("exec:cat > {}", file.display())).expect("migrate");
    q.wait_migration(Duration::from_secs(300), Duration::from_millis(100)).expect("migration");
    t.elapsed()
}

#[test]
fn mem_guest_survives_migration_round_trip() {
    let fx = fixtures();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("vm.state");
    let builder = fx.guest().machine(Machine::Pc).qmp(true).name("migrate-src");
    let mut src = builder.launch().expect("boot source guest");
    src.command("fill 64 30 30 7", CMD).unwrap();
    let before = src.command("sum", CMD).unwrap();
    // keep rewriting pages while QEMU migrates (precopy has to resend them)
    src.command("dirty 2 0 9", CMD).unwrap();
    thread::sleep(Duration::from_millis(500));

    let took = migrate_to_file(&src, &state);
    let size = std::fs::metadata(&state).unwrap().len();
    eprintln!("saved {size} bytes in {took:?}");
    // 70% of 64 MiB is non-zero: the stream must carry at least that
    assert!(size > 44 << 20, "stream too small: {size}");
    src.kill().unwrap();

    let uri = format!("exec:cat {}", state.display());
    let t = Instant::now();
    let mut dst =
        builder.clone().name("migrate-dst").incoming(&uri).launch().expect("start destination");
    assert_eq!(dst.command("ping", CMD).unwrap(), "pong");
    eprintln!("restored and answering in {:?}", t.elapsed());

    // the dirtier kept running across the migration
    let st = dst.command("stat", CMD).unwrap();
    assert_eq!(field(&st, "dirty"), "on", "{st}");
    thread::sleep(Duration::from_millis(500));
    let stop = dst.command("dirty stop", CMD).unwrap();
    let written: u64 = field(&stop, "written").parse().unwrap();
    assert!(written > 0, "{stop}");
    let after = dst.command("sum", CMD).unwrap();
    assert_eq!(after, dst.command("sum", CMD).unwrap(), "sum not stable after restore");
    assert_ne!(after, before, "dirty did not change memory");

    // replaying exactly those rewrites on the host gives the same bytes: nothing was lost or
    // corrupted by the save/restore, not even pages rewritten while it ran
    let replay = format!("dirty sync {written} 9");
    let host = host_memwork(&fx, &["fill 64 30 30 7", &replay, "sum"]);
    assert_eq!(host[2], format!("OK {after}"), "memory differs from a replay of {written} writes");
}

/// sha256 of a file inside an ext4 image, read on the host with e2fsprogs' debugfs.
fn sha256_in_image(image: &Path, path: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {path}"))
        .arg(image)
        .stderr(Stdio::null())
        .output()
        .expect("debugfs");
    assert!(out.status.success() && !out.stdout.is_empty(), "debugfs cat {path}");
    let mut sha =
        Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    sha.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let o = sha.wait_with_output().unwrap();
    String::from_utf8(o.stdout).unwrap()[..64].to_string()
}

fn sha256_host(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

#[test]
fn golden_disk_boots_from_overlay_and_keeps_writes() {
    let fx = fixtures();
    let tmp = tempfile::tempdir().unwrap();
    let overlay = tmp.path().join("golden.qcow2");
    let base_meta = std::fs::metadata(fx.golden()).unwrap();
    create_overlay(&fx.golden(), "raw", &overlay).unwrap();
    let builder = fx
        .guest()
        .mode(GuestMode::Root)
        .drive_file(&overlay, "qcow2")
        .no_reboot(false)
        .name("golden");
    let t0 = Instant::now();
    let mut g = builder.launch().expect("boot golden disk");
    let ready = g.ready_line().unwrap().to_string();
    eprintln!("golden booted in {:?}: {ready}", t0.elapsed());
    let bootset = fx.bootset_files().unwrap();
    assert_eq!(field(&ready, "bootset_files"), bootset.len().to_string());
    let bytes: u64 = bootset.iter().map(|(_, n)| n).sum();
    assert_eq!(field(&ready, "bootset_bytes"), bytes.to_string());
    assert_eq!(field(&ready, "bootset_rc"), "0", "a boot-set file could not be read");

    // the guest reads the same bytes the host built
    let (first, _) = &bootset[0];
    let guest_sha = g.command(&format!("sha {first}"), CMD).unwrap();
    assert_eq!(guest_sha, sha256_in_image(&fx.golden(), first));
    let guest_sha = g.command("sha /etc/strata/bootset.txt", CMD).unwrap();
    assert_eq!(guest_sha, sha256_host(&fx.bootset()));

    g.command("write /root/x hello", CMD).unwrap();
    assert_eq!(g.command("cat /root/x", CMD).unwrap(), "hello");
    match g.command("cat /root/missing", CMD) {
        Err(FixtureError::Agent { message, .. }) => assert!(message.contains("no such file")),
        other => panic!("expected an agent error, got {other:?}"),
    }

    // reboot inside the same QEMU
    g.command("reboot", CMD).unwrap();
    g.wait_for("STRATA-BOOT-START", CMD).unwrap();
    g.wait_for("STRATA-READY", CMD).unwrap();
    assert_eq!(g.command("cat /root/x", CMD).unwrap(), "hello");
    g.command("write /root/x again", CMD).unwrap();
    g.command("poweroff", CMD).unwrap();
    let st = g.wait_exit(CMD).unwrap();
    assert!(st.success(), "QEMU exit status after poweroff: {st}");
    drop(g);

    // a new QEMU on the same overlay sees both writes
    let mut g2 = builder.clone().name("golden-2").launch().expect("boot again");
    assert_eq!(g2.command("cat /root/x", CMD).unwrap(), "hello\\nagain");
    assert_eq!(
        strata::fixtures::unescape_reply(&g2.command("cat /root/x", CMD).unwrap()),
        "hello\nagain"
    );
    let out = g2.command("sh echo a; echo b", CMD).unwrap();
    assert_eq!(out, "a\\nb");
    g2.kill().unwrap();

    let after = std::fs::metadata(fx.golden()).unwrap();
    assert_eq!(after.modified().unwrap(), base_meta.modified().unwrap(), "base image written");
}

#[test]
fn root_mode_without_a_disk_fails_with_a_hint() {
    let fx = fixtures();
    let err = fx
        .guest()
        .mode(GuestMode::Root)
        .name("nodisk")
        .launch()
        .expect_err("must not boot without /dev/vda");
    let msg = err.to_string();
    assert!(
        matches!(err, FixtureError::GuestError { .. }) && msg.contains("-drive file=golden.img"),
        "{msg}"
    );
}

#[test]
fn qemu_startup_errors_quote_qemu() {
    let fx = fixtures();
    let err = fx
        .guest()
        .drive("file=/nonexistent/strata-disk.img,if=virtio,format=raw")
        .name("baddrive")
        .launch()
        .expect_err("QEMU cannot open the drive");
    let msg = err.to_string();
    assert!(matches!(err, FixtureError::Exited { .. }), "{msg}");
    assert!(msg.contains("/nonexistent/strata-disk.img"), "{msg}");
    eprintln!("{msg}");
}

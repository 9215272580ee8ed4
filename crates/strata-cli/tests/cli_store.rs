//! End-to-end tests of the `strata` binary on the embedded default store: what an operator
//! sees for damage (flipped byte, missing or truncated pack), bad store directories, and a
//! full disk (a small loop-mounted ext4 filesystem).

use std::path::Path;
use std::process::{Command, Output};

fn strata(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("run strata")
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

fn image(path: &Path, mib: usize, seed: u8) {
    let mut v = vec![0u8; mib << 20];
    let mut x = seed as u64 | 1;
    for (i, b) in v.iter_mut().enumerate() {
        if (i >> 16) % 4 != 3 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x & 0x3f) as u8;
        }
    }
    std::fs::write(path, v).unwrap();
}

fn packs(store: &Path) -> Vec<std::path::PathBuf> {
    let mut v = vec![];
    for d in std::fs::read_dir(store.join("packs")).unwrap().flatten() {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            v.push(f.path());
        }
    }
    v.sort();
    v
}

#[test]
fn check_reports_flipped_byte_missing_and_truncated_packs() {
    let d = tempfile::tempdir().unwrap();
    let st = d.path().join("store");
    ok(&strata(&st, &["init", "--pack-size", "1M"]));
    let img = d.path().join("a.raw");
    image(&img, 6, 3);
    ok(&strata(&st, &["disk", "import", "a", img.to_str().unwrap()]));
    let out = ok(&strata(&st, &["check"]));
    assert!(out.contains("No damage found"), "{out}");
    let ps = packs(&st);
    assert!(ps.len() >= 3, "want several packs, got {}", ps.len());

    // Flip one byte in the middle of the first pack's data.
    let mut b = std::fs::read(&ps[0]).unwrap();
    b[5000] ^= 0x10;
    std::fs::write(&ps[0], &b).unwrap();
    let o = strata(&st, &["check", "--json"]);
    assert_eq!(o.status.code(), Some(1), "damage must exit 1");
    let rep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let p = &rep["problems"][0];
    assert_eq!(p["severity"], "error");
    assert!(p["chunk"].as_str().unwrap().len() == 64, "names the chunk: {p}");
    assert!(p["message"].as_str().unwrap().contains("corrupt"), "{p}");
    assert_eq!(p["refs"][0], "disk/a");
    // The damaged chunk is refused on read, not returned.
    let e = strata(&st, &["disk", "export", "a", d.path().join("x.raw").to_str().unwrap()]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("corrupt"));
    b[5000] ^= 0x10;
    std::fs::write(&ps[0], &b).unwrap();

    // Truncated pack, then missing pack.
    let len = std::fs::metadata(&ps[1]).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&ps[1]).unwrap().set_len(len - 100).unwrap();
    std::fs::remove_file(&ps[2]).unwrap();
    let o = strata(&st, &["check"]);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    let name1 = ps[1].file_name().unwrap().to_str().unwrap();
    let name2 = ps[2].file_name().unwrap().to_str().unwrap();
    assert!(text.lines().any(|l| l.contains(name1) && l.contains("truncated")), "{text}");
    assert!(text.lines().any(|l| l.contains(name2) && l.contains("missing")), "{text}");
}

#[test]
fn bad_store_directories_are_refused_with_advice() {
    let d = tempfile::tempdir().unwrap();
    let o = strata(d.path(), &["du"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("Not a strata store") && err.contains("strata init"), "{err}");
    let st = d.path().join("s");
    ok(&strata(&st, &["init"]));
    let mut cfg = std::fs::read(st.join("config")).unwrap();
    cfg[8] = 9; // format version
    std::fs::write(st.join("config"), &cfg).unwrap();
    let o = strata(&st, &["du"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("version 9") && err.contains("upgrade strata"),
        "{err}"
    );
}

/// A full filesystem: the import fails with a clear error, nothing half-written is visible,
/// and after freeing space the store works and checks clean.
#[test]
fn full_disk_gives_clear_error_and_loses_nothing() {
    let d = tempfile::tempdir().unwrap();
    let fsimg = d.path().join("fs.img");
    let mnt = d.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let run = |c: &mut Command| {
        let o = c.output().unwrap();
        assert!(o.status.success(), "{c:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    run(Command::new("truncate").args(["-s", "24M"]).arg(&fsimg));
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&fsimg));
    run(Command::new("mount").args(["-o", "loop"]).arg(&fsimg).arg(&mnt));
    struct Umount<'a>(&'a Path);
    impl Drop for Umount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _u = Umount(&mnt);
    let st = mnt.join("store");
    ok(&strata(&st, &["init", "--pack-size", "1M", "--codec", "none"]));
    let small = d.path().join("small.raw");
    image(&small, 4, 1);
    ok(&strata(&st, &["disk", "import", "small", small.to_str().unwrap()]));
    let big = d.path().join("big.raw");
    image(&big, 40, 2);
    let o = strata(&st, &["disk", "import", "big", big.to_str().unwrap()]);
    assert!(!o.status.success(), "importing 40 MiB into a 24 MiB filesystem must fail");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("out of space"), "error must say the disk is full: {err}");
    // Nothing half-written is visible; what was acknowledged is intact.
    let refs = ok(&strata(&st, &["refs"]));
    assert!(!refs.contains("big"), "{refs}");
    let out = ok(&strata(&st, &["check"]));
    assert!(out.contains("No damage found"), "{out}");
    let back = d.path().join("back.raw");
    ok(&strata(&st, &["disk", "export", "small", back.to_str().unwrap()]));
    assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&small).unwrap());
    // Free space (GC reclaims nothing reachable), and writing works again.
    ok(&strata(&st, &["gc"]));
    let mid = d.path().join("mid.raw");
    image(&mid, 3, 5);
    ok(&strata(&st, &["disk", "import", "mid", mid.to_str().unwrap()]));
    assert!(ok(&strata(&st, &["check"])).contains("No damage found"));
}

/// `strata serve` holds the store's metadata cache; other strata commands on the same host
/// still work beside it (with a private cache rebuilt from the store), their writes are
/// durable and visible afterwards, `strata gc` runs inside the daemon, and nothing is left
/// behind.
#[test]
fn commands_work_beside_a_running_serve() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let d = tempfile::tempdir().unwrap();
    let st = d.path().join("store");
    ok(&strata(&st, &["init", "--pack-size", "1M"]));
    let (a, b) = (d.path().join("a.raw"), d.path().join("b.raw"));
    image(&a, 4, 1);
    image(&b, 4, 2);
    ok(&strata(&st, &["disk", "import", "a", a.to_str().unwrap()]));
    let sock = d.path().join("nbd.sock");
    let mut srv = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(&st)
        .args(["serve", "--socket", sock.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Beside the daemon: write a new disk, read the old one, list.
    ok(&strata(&st, &["disk", "import", "b", b.to_str().unwrap()]));
    let x = d.path().join("x.raw");
    ok(&strata(&st, &["disk", "export", "a", x.to_str().unwrap()]));
    assert!(
        std::fs::read(&x).unwrap() == std::fs::read(&a).unwrap(),
        "export beside serve differs"
    );
    let list = ok(&strata(&st, &["disk", "list"]));
    assert!(st.join(".meta/control.sock").exists(), "the daemon listens on its control socket");
    assert!(list.contains('a') && list.contains('b'), "{list}");
    // GC while serving: `strata gc` hands it to the daemon (which must first learn the packs
    // written beside it) and frees what the removed disk alone used.
    ok(&strata(&st, &["disk", "rm", "a"]));
    let g: serde_json::Value = serde_json::from_str(&ok(&strata(&st, &["gc", "--json"]))).unwrap();
    assert!(g["bytes_freed"].as_u64().unwrap() > 1 << 20, "{g}");
    unsafe { libc::kill(srv.id() as i32, libc::SIGINT) };
    assert!(srv.wait().unwrap().success());
    assert!(!st.join(".meta/control.sock").exists(), "the daemon removes its control socket");
    // After the daemon stops, its own cache learns of the packs written beside it.
    let y = d.path().join("y.raw");
    ok(&strata(&st, &["disk", "export", "b", y.to_str().unwrap()]));
    assert!(
        std::fs::read(&y).unwrap() == std::fs::read(&b).unwrap(),
        "disk written beside serve differs"
    );
    let out = ok(&strata(&st, &["check"]));
    assert!(out.contains("No damage found"), "{out}");
    let private = st.join(".meta/private");
    let left: Vec<_> =
        std::fs::read_dir(&private).map(|r| r.flatten().collect()).unwrap_or_default();
    assert!(left.is_empty(), "private metadata left behind: {left:?}");
    assert_eq!(std::fs::read_dir(st.join(".tmp")).unwrap().count(), 0, "temporaries left behind");
}

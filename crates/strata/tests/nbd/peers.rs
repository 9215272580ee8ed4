//! The conformance checks against real NBD clients, shared by `file_peers.rs` (a sparse file
//! export) and `disk_peers.rs` (a copy-on-write strata disk): qemu-img, qemu-io, nbdinfo,
//! nbdcopy, fio's nbd engine, nbdfuse + losetup + mkfs.ext4 + fsck, and QEMU's block layer.
//! Every check reads the data back, not just exit codes. Each test takes the suite's server
//! factory: `server(size)` starts a server with a writable export "disk" of `size` bytes and a
//! read-only 1 MiB export "ro" holding `pattern(77, 1 MiB)`, and returns a [`Backing`] that
//! reads what "disk" holds without going through NBD.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use crate::common::*;

/// One `#[test]` per shared check, each calling it with the suite's server factory.
macro_rules! peer_tests {
    ($server:ident) => {
        #[test]
        fn qemu_img_info_convert_compare() {
            peers::qemu_img_info_convert_compare($server);
        }
        #[test]
        fn qemu_io_patterns() {
            peers::qemu_io_patterns($server);
        }
        #[test]
        fn nbdcopy_both_ways_and_multi_conn() {
            peers::nbdcopy_both_ways_and_multi_conn($server);
        }
        #[test]
        fn nbdinfo_list_and_map() {
            peers::nbdinfo_list_and_map($server);
        }
        #[test]
        fn fio_nbd_engine_with_verify() {
            peers::fio_nbd_engine_with_verify($server);
        }
        #[test]
        fn nbdfuse_loop_mkfs_fsck() {
            peers::nbdfuse_loop_mkfs_fsck($server);
        }
        #[test]
        fn qemu_system_block_layer() {
            peers::qemu_system_block_layer($server);
        }
    };
}

/// What is behind the writable export, read directly (not over NBD).
pub trait Backing {
    fn contents(&self) -> Vec<u8>;
}

/// A file export: the file itself.
impl Backing for std::path::PathBuf {
    fn contents(&self) -> Vec<u8> {
        std::fs::read(self).unwrap()
    }
}

/// A raw image with data at known places and holes elsewhere.
pub fn make_source(path: &Path, size: u64) -> Vec<u8> {
    let mut content = vec![0u8; size as usize];
    for (i, &(off, len)) in
        [(0u64, 65536usize), (3 << 20, 1 << 20), (size - 8192, 8192)].iter().enumerate()
    {
        content[off as usize..off as usize + len].copy_from_slice(&pattern(i as u64 + 10, len));
    }
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    use std::os::unix::fs::FileExt;
    for &(off, len) in &[(0u64, 65536u64), (3 << 20, 1 << 20), (size - 8192, 8192)] {
        f.write_all_at(&content[off as usize..(off + len) as usize], off).unwrap();
    }
    content
}

pub fn qemu_img_info_convert_compare<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("qemu-img", "qemu-utils");
    let size = 16u64 << 20;
    let (s, disk) = server(size);
    let uri = s.uri("disk");
    let info = stdout(&run(Command::new("qemu-img").args(["info", "--output=json", &uri])));
    assert!(info.contains(&format!("\"virtual-size\": {size}")), "{info}");

    let src = s.path("src.raw");
    let content = make_source(&src, size);
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&uri));
    assert_eq!(disk.contents(), content, "qemu-img convert wrote wrong bytes");
    run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&src).arg(&uri));

    // Back out of the server into a new file.
    let out = s.path("out.qcow2");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "qcow2", &uri]).arg(&out));
    run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "qcow2"]).arg(&src).arg(&out));

    // compare must notice a difference.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&src)
        .map(|f| {
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"X", 5 << 20).unwrap();
        })
        .unwrap();
    let r = run_status(
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&src).arg(&uri),
        std::time::Duration::from_secs(60),
    );
    assert_eq!(r.status.code(), Some(1), "qemu-img compare missed a changed byte");
}

pub fn qemu_io_patterns<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("qemu-io", "qemu-utils");
    let (s, disk) = server(8 << 20);
    let uri = s.uri("disk");
    let cmds = [
        "write -P 0xab 0 1M",
        "read -P 0xab 0 1M",
        "write -P 0x5a 12345 77777",
        "read -P 0x5a 12345 77777",
        "read -P 0xab 0 12345",
        "write -z 2M 64k",
        "read -P 0 2M 64k",
        "write -z -u 3M 64k",
        "read -P 0 3M 64k",
        "write -f -P 0x11 4M 4k",
        "flush",
        "aio_write -P 0x22 5M 64k",
        "aio_write -P 0x33 6M 64k",
        "aio_flush",
        "read -P 0x22 5M 64k",
        "read -P 0x33 6M 64k",
        "discard 7M 1M",
        "read -P 0 7M 1M",
    ];
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", &uri]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    let out = run(&mut cmd);
    let text = stdout(&out) + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !text.contains("failed")
            && !text.contains("error")
            && !text.contains("Pattern verification"),
        "{text}"
    );
    assert_eq!(text.matches("read ").count(), 8, "{text}");
    // Check the file behind the export directly.
    let f = disk.contents();
    assert!(f[..12345].iter().all(|&b| b == 0xab));
    assert!(f[12345..12345 + 77777].iter().all(|&b| b == 0x5a));
    assert!(f[(4 << 20)..(4 << 20) + 4096].iter().all(|&b| b == 0x11));
    assert!(f[(2 << 20)..(2 << 20) + 65536].iter().all(|&b| b == 0));
    // A bad pattern check must fail (qemu-io reports it).
    let out = run_status(
        Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "read -P 0xcd 0 4k"]),
        std::time::Duration::from_secs(60),
    );
    let text = stdout(&out) + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Pattern verification failed"), "{text}");
}

pub fn nbdcopy_both_ways_and_multi_conn<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("nbdcopy", "libnbd-bin");
    let size = 32u64 << 20;
    let (s, disk) = server(size);
    let uri = s.uri("disk");
    let src = s.path("src.raw");
    let content = make_source(&src, size);
    // nbdcopy caps connections at its thread count (default: cores), so set both.
    let mut expected = 0;
    for conns in ["1", "4"] {
        let before = s.handle().total_connections();
        run(Command::new("nbdcopy").arg(&src).arg(&uri).args([
            "--connections",
            conns,
            "--threads",
            conns,
            "--requests",
            "16",
        ]));
        expected += conns.parse::<u64>().unwrap();
        assert_eq!(
            s.handle().total_connections() - before,
            conns.parse::<u64>().unwrap(),
            "nbdcopy connections"
        );
        assert_eq!(disk.contents(), content, "nbdcopy to server with {conns} connections");
        let out = s.path(&format!("out{conns}.raw"));
        run(Command::new("nbdcopy").arg(&uri).arg(&out).args([
            "--connections",
            conns,
            "--threads",
            conns,
        ]));
        assert_eq!(
            std::fs::read(&out).unwrap(),
            content,
            "nbdcopy from server with {conns} connections"
        );
    }
    assert!(s.handle().total_connections() >= 2 * expected);
    // Server to server (read-only export into the writable one), through two connections.
    run(Command::new("nbdcopy").arg(s.uri("ro")).arg(&uri));
    assert_eq!(disk.contents()[..1 << 20], pattern(77, 1 << 20)[..]);
}

pub fn nbdinfo_list_and_map<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("nbdinfo", "libnbd-bin");
    let (s, _) = server(16 << 20);
    let list = stdout(&run(Command::new("nbdinfo")
        .arg("--list")
        .arg(format!("nbd+unix:///?socket={}", s.sock.display()))));
    assert!(list.contains("export=\"disk\"") && list.contains("export=\"ro\""), "{list}");
    assert!(list.contains("is_read_only: true"), "{list}");
    assert!(list.contains("base:allocation"), "{list}");

    let uri = s.uri("disk");
    // Data at [1M, 1M+64K) and [9M, 9M+4K), holes elsewhere.
    let mut c = Client::connect(&s.sock, "disk", true, false).unwrap();
    c.write(1 << 20, &[1; 65536], 0).unwrap();
    c.write(9 << 20, &[2; 4096], 0).unwrap();
    c.disconnect();
    let map = stdout(&run(Command::new("nbdinfo").arg("--map").arg(&uri)));
    let rows: Vec<(u64, u64, u32)> = map
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect();
    let m = 1u64 << 20;
    assert_eq!(
        rows,
        vec![
            (0, m, 3),
            (m, 65536, 0),
            (m + 65536, 8 * m - 65536, 3),
            (9 * m, 4096, 0),
            (9 * m + 4096, 7 * m - 4096, 3)
        ],
        "{map}"
    );
    let total = stdout(&run(Command::new("nbdinfo").args(["--map", "--totals", &uri])));
    assert!(
        total.lines().any(|l| l.split_whitespace().next() == Some(&(65536 + 4096).to_string())),
        "{total}"
    );
}

pub fn fio_nbd_engine_with_verify<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("fio", "fio");
    let (s, _) = server(64 << 20);
    let uri = s.uri("disk");
    for (rw, bs) in [("randwrite", "4k"), ("write", "64k"), ("randrw", "16k")] {
        let out = run(Command::new("fio").args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            "--size=32M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=terse",
        ]));
        let text = stdout(&out);
        assert!(!text.contains("verify:") && !text.contains("bad magic"), "{text}");
        let terse = text.lines().find(|l| l.starts_with("3;")).expect("terse line");
        let f: Vec<&str> = terse.split(';').collect();
        assert_eq!(f[4], "0", "fio error field: {terse}");
        let read_kb: u64 = f[5].parse().unwrap();
        assert!(read_kb > 0, "fio verified nothing: {terse}");
    }
}

pub fn nbdfuse_loop_mkfs_fsck<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("nbdfuse", "nbdfuse");
    require_tool("mkfs.ext4", "e2fsprogs");
    require_tool("losetup", "mount");
    let (s, _) = server(128 << 20);
    let mnt = s.path("fuse");
    std::fs::create_dir(&mnt).unwrap();
    let mut fuse = Command::new("nbdfuse").arg(&mnt).arg(s.uri("disk")).spawn().unwrap();
    let dev_file = mnt.join("nbd");
    wait_until(10, "nbdfuse to mount", || {
        std::fs::metadata(&dev_file).map(|m| m.len() == 128 << 20).unwrap_or(false)
    });
    let lo = stdout(&run(Command::new("losetup").args(["-f", "--show"]).arg(&dev_file)))
        .trim()
        .to_string();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(Command::new("mkfs.ext4").args(["-q", "-F", &lo]));
        run(Command::new("fsck.ext4").args(["-fn", &lo]));
        let fsdir = s.path("fs");
        std::fs::create_dir(&fsdir).unwrap();
        run(Command::new("mount").arg(&lo).arg(&fsdir));
        let data = pattern(5, 3 << 20);
        std::fs::write(fsdir.join("file"), &data).unwrap();
        run(Command::new("umount").arg(&fsdir));
        run(Command::new("fsck.ext4").args(["-fn", &lo]));
        run(Command::new("mount").args(["-o", "ro"]).arg(&lo).arg(&fsdir));
        let back = std::fs::read(fsdir.join("file"));
        run(Command::new("umount").arg(&fsdir));
        assert_eq!(back.unwrap(), data, "file read back through ext4/loop/nbdfuse differs");
    }));
    let _ = Command::new("losetup").args(["-d", &lo]).status();
    let _ = Command::new("fusermount3").arg("-u").arg(&mnt).status();
    let _ = fuse.wait();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// QEMU's system emulator as the client (TCG, no guest): its block layer opens the export and
/// HMP `qemu-io` drives I/O through it, over QMP.
pub fn qemu_system_block_layer<B: Backing>(server: impl Fn(u64) -> (TestServer, B)) {
    require_tool("qemu-system-x86_64", "qemu-system-x86");
    let (s, disk) = server(16 << 20);
    let drive = format!("if=none,id=d0,format=raw,file={}", s.uri("disk"));
    let hmp = |c: &str| {
        format!(
            "{{\"execute\":\"human-monitor-command\",\"arguments\":{{\"command-line\":\"qemu-io d0 \\\"{c}\\\"\"}}}}\n"
        )
    };
    let mut script = String::from("{\"execute\":\"qmp_capabilities\"}\n");
    for c in [
        "write -P 0x42 0 1M",
        "read -P 0x42 0 1M",
        "write -z 64k 64k",
        "read -P 0 64k 64k",
        "aio_write -P 0x7 2M 512k",
        "aio_flush",
        "flush",
        "read -P 0x43 0 4k",
    ] {
        script += &hmp(c);
    }
    script += "{\"execute\":\"quit\"}\n";
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg",
            "-machine",
            "none",
            "-nodefaults",
            "-display",
            "none",
            "-S",
            "-qmp",
            "stdio",
            "-drive",
            &drive,
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    // Exactly one verification failure: the deliberate 0x43 read at the end.
    assert_eq!(text.matches("Pattern verification failed").count(), 1, "{text}");
    assert_eq!(text.matches("read ").count(), 3, "{text}");
    let f = disk.contents();
    assert!(f[..65536].iter().all(|&b| b == 0x42));
    assert!(f[65536..131072].iter().all(|&b| b == 0));
    assert!(f[131072..1 << 20].iter().all(|&b| b == 0x42));
    assert!(f[(2 << 20)..(2 << 20) + (512 << 10)].iter().all(|&b| b == 7));
}

//! Helpers for tests against a real qemu-system-x86_64 7.2 (TCG): process lifecycle, the test
//! guest, stream capture/restore and a "latest record wins" memory image.
#![allow(dead_code)]

use std::fs;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use strata::memory::stream::*;
use strata::qmp::*;

/// Scratch space cargo gives integration tests (under target/).
pub const ROOT: &str = env!("CARGO_TARGET_TMPDIR");

/// A fresh directory for one test's sockets and streams.
pub fn workdir(name: &str) -> PathBuf {
    let d = PathBuf::from(ROOT).join("qemu-tests").join(name);
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

/// The multiboot test guest (fills RAM, then keeps dirtying 8 MiB), built once with as/ld.
pub fn guest() -> &'static Path {
    static G: OnceLock<PathBuf> = OnceLock::new();
    G.get_or_init(|| {
        let dir = PathBuf::from(ROOT).join("guest");
        fs::create_dir_all(&dir).unwrap();
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/dirty.S");
        let obj = dir.join("dirty.o");
        let elf = dir.join("dirty.elf");
        let ok =
            Command::new("as").args(["--32", "-o"]).arg(&obj).arg(&src).status().unwrap().success()
                && Command::new("ld")
                    .args(["-m", "elf_i386", "-Ttext=0x100000", "-e", "_start", "-o"])
                    .arg(&elf)
                    .arg(&obj)
                    .status()
                    .unwrap()
                    .success();
        assert!(ok, "building the test guest failed (needs binutils)");
        elf
    })
}

/// Arguments shared by source and destination.
pub fn vm_args(machine: &str, mem_mib: u32, with_guest: bool) -> Vec<String> {
    let mut a: Vec<String> =
        ["-accel", "tcg", "-nodefaults", "-display", "none", "-machine", machine, "-m"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    a.push(mem_mib.to_string());
    if with_guest {
        a.push("-kernel".into());
        a.push(guest().display().to_string());
    }
    a
}

/// A qemu-system-x86_64 child with a QMP socket. Killed (by its own pid) on drop.
pub struct Qemu {
    pub child: Child,
    pub qmp: QmpClient,
    pub log: PathBuf,
    pub name: String,
}

impl Qemu {
    pub fn start(dir: &Path, name: &str, args: &[String]) -> Qemu {
        let sock = dir.join(format!("{name}.qmp"));
        let log = dir.join(format!("{name}.log"));
        let _ = fs::remove_file(&sock);
        let child = Command::new("qemu-system-x86_64")
            .args(args)
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .stdin(Stdio::null())
            .stdout(fs::File::create(&log).unwrap())
            .stderr(fs::File::create(dir.join(format!("{name}.err"))).unwrap())
            .spawn()
            .expect("qemu-system-x86_64 not installed");
        let t0 = Instant::now();
        let qmp = loop {
            match QmpClient::connect_timeout(&sock, Duration::from_secs(30)) {
                Ok(c) => break c,
                Err(QmpError::NoSocket { .. }) | Err(QmpError::Refused { .. })
                    if t0.elapsed() < Duration::from_secs(20) =>
                {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("QMP connect to {name}: {e}"),
            }
        };
        Qemu { child, qmp, log: dir.join(format!("{name}.err")), name: name.into() }
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Read a guest-physical u32 with HMP `xp`.
    pub fn read_u32(&mut self, addr: u64) -> u32 {
        let out = self.qmp.human_monitor_command(&format!("xp /1xw {addr:#x}")).unwrap();
        let hex = out.split(':').nth(1).unwrap().trim();
        u32::from_str_radix(hex.trim_start_matches("0x"), 16).unwrap()
    }

    /// Wait until the guest finished filling RAM.
    pub fn wait_guest_filled(&mut self) {
        let t0 = Instant::now();
        while self.read_u32(0x1000) != 0xD0E0_D0E0 {
            assert!(t0.elapsed() < Duration::from_secs(120), "guest did not finish filling RAM");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Raise bandwidth (the 128 MiB/s default throttles saves).
    pub fn fast_migration(&mut self) {
        self.qmp
            .migrate_set_parameters(&MigrateParameters {
                max_bandwidth: Some(10 << 30),
                ..Default::default()
            })
            .unwrap();
    }

    /// `migrate exec:cat > file` and wait for completion.
    pub fn save_to(&mut self, file: &Path) -> MigrationInfo {
        self.qmp.migrate(&format!("exec:cat > {}", file.display())).unwrap();
        self.qmp
            .wait_migration(Duration::from_secs(300), Duration::from_millis(20))
            .unwrap_or_else(|e| panic!("{}: {e}\n{}", self.name, self.stderr()))
    }

    /// Wait for an incoming migration to complete.
    pub fn wait_incoming(&mut self) -> MigrationInfo {
        match self.qmp.wait_migration(Duration::from_secs(300), Duration::from_millis(20)) {
            Ok(i) => i,
            Err(e) => {
                std::thread::sleep(Duration::from_millis(200));
                panic!("{} failed to load: {e}\nQEMU stderr: {}", self.name, self.stderr())
            }
        }
    }

    pub fn quit(mut self) {
        let _ = self.qmp.quit();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Start a destination with the same args, `-incoming defer -S`.
pub fn start_destination(dir: &Path, name: &str, args: &[String]) -> Qemu {
    let mut a = args.to_vec();
    a.extend(["-incoming", "defer", "-S"].iter().map(|s| s.to_string()));
    Qemu::start(dir, name, &a)
}

/// Memory rebuilt from a stream: the latest record of each page wins.
#[derive(Default)]
pub struct MemImage {
    pub blocks: Vec<RamBlock>,
    pub data: Vec<Vec<u8>>,
    /// Records seen per page (saturating), to count repeated pages.
    pub seen: Vec<Vec<u8>>,
    pub pages: u64,
    pub zeros: u64,
    pub sections: u64,
    pub tail: Vec<u8>,
}

impl StreamSink for MemImage {
    fn event(&mut self, ev: Event<'_>) -> Result<(), SinkError> {
        match ev {
            Event::RamBlocks(b) => {
                self.blocks = b.to_vec();
                self.data = b.iter().map(|b| vec![0u8; b.used_len as usize]).collect();
                self.seen = b.iter().map(|b| vec![0u8; b.pages() as usize]).collect();
            }
            Event::Page { block, offset, data } => {
                let o = offset as usize;
                self.data[block.get()][o..o + PAGE_SIZE].copy_from_slice(data);
                let s = &mut self.seen[block.get()][o / PAGE_SIZE];
                *s = s.saturating_add(1);
                self.pages += 1;
            }
            Event::Zero { block, offset, fill } => {
                let o = offset as usize;
                self.data[block.get()][o..o + PAGE_SIZE].fill(fill);
                let s = &mut self.seen[block.get()][o / PAGE_SIZE];
                *s = s.saturating_add(1);
                self.zeros += 1;
            }
            Event::SectionBegin { .. } => self.sections += 1,
            Event::Tail(t) => self.tail.extend_from_slice(t),
            _ => {}
        }
        Ok(())
    }
}

impl MemImage {
    /// Pages never sent (0 for a complete stream).
    pub fn missing(&self) -> u64 {
        self.seen.iter().flatten().filter(|&&s| s == 0).count() as u64
    }
    /// Pages sent more than once.
    pub fn repeated(&self) -> u64 {
        self.seen.iter().flatten().filter(|&&s| s > 1).count() as u64
    }
    pub fn nonzero_pages(&self) -> u64 {
        self.data
            .iter()
            .map(|d| d.chunks(PAGE_SIZE).filter(|p| p.iter().any(|&b| b != 0)).count() as u64)
            .sum()
    }
}

/// Parse a stream file, feeding it in `chunk`-byte pieces.
pub fn parse_file(path: &Path, chunk: usize) -> (StreamInfo, MemImage) {
    let mut f = fs::File::open(path).unwrap();
    let mut p = Parser::default();
    let mut img = MemImage::default();
    let mut buf = vec![0u8; chunk];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        p.feed(&buf[..n], &mut img).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let info = p.finish(&mut img).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(info.tail, img.tail);
    (info, img)
}

/// Write a stream holding every page of `img` once (zero pages as ZERO records).
pub fn regenerate<W: Write>(
    out: W,
    layout: &StreamLayout,
    img: &MemImage,
    tail: &[u8],
) -> (W, GenerateStats) {
    let mut w = StreamWriter::new(out, layout).unwrap();
    for (bi, data) in img.data.iter().enumerate() {
        for (pi, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let off = (pi * PAGE_SIZE) as u64;
            if page.iter().all(|&b| b == 0) {
                w.zero(BlockIdx(bi as u32), off, 0).unwrap();
            } else {
                w.page(BlockIdx(bi as u32), off, page.try_into().unwrap()).unwrap();
            }
        }
    }
    w.tail(tail).unwrap();
    w.finish().unwrap()
}

pub fn regenerate_file(
    path: &Path,
    layout: &StreamLayout,
    img: &MemImage,
    tail: &[u8],
) -> GenerateStats {
    let f = fs::File::create(path).unwrap();
    regenerate(f, layout, img, tail).1
}

/// Compare two images block by block and page by page; `ignore(block, page_offset, byte)`
/// masks bytes a running guest is known to change. Returns the number of differing pages.
pub fn diff_images(
    a: &MemImage,
    b: &MemImage,
    ignore: &dyn Fn(&str, u64, usize) -> bool,
) -> (u64, Option<String>) {
    assert_eq!(a.blocks, b.blocks, "ramblock lists differ");
    let mut bad = 0;
    let mut first = None;
    for (bi, blk) in a.blocks.iter().enumerate() {
        for (pi, (pa, pb)) in
            a.data[bi].chunks(PAGE_SIZE).zip(b.data[bi].chunks(PAGE_SIZE)).enumerate()
        {
            let off = (pi * PAGE_SIZE) as u64;
            if pa != pb && (0..PAGE_SIZE).any(|i| pa[i] != pb[i] && !ignore(&blk.name, off, i)) {
                bad += 1;
                first.get_or_insert_with(|| format!("{} page {off:#x}", blk.name));
            }
        }
    }
    (bad, first)
}

pub fn exact(_: &str, _: u64, _: usize) -> bool {
    false
}

/// Bytes the test guest keeps changing while it runs: the counter word at 0x1004 and two
/// words per page in [4 MiB, 12 MiB) of pc.ram.
pub fn guest_dirty(block: &str, off: u64, i: usize) -> bool {
    block == "pc.ram"
        && ((off == 0x1000 && (4..8).contains(&i))
            || ((0x40_0000..0xC0_0000).contains(&off)
                && ((0..4).contains(&i) || (2048..2052).contains(&i))))
}

/// Listen on a unix socket for QEMU's `migrate unix:` and feed what arrives to `parser` in
/// whatever pieces the socket gives, also writing the bytes to `copy`.
pub fn receive_unix(
    listener: UnixListener,
    copy: &Path,
) -> std::thread::JoinHandle<(StreamInfo, MemImage, u64, usize)> {
    let copy = copy.to_path_buf();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut out = std::io::BufWriter::new(fs::File::create(copy).unwrap());
        let mut p = Parser::default();
        let mut img = MemImage::default();
        let mut buf = vec![0u8; 256 << 10];
        let mut reads = 0usize;
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            reads += 1;
            out.write_all(&buf[..n]).unwrap();
            p.feed(&buf[..n], &mut img).unwrap();
        }
        out.flush().unwrap();
        let bytes = p.bytes_fed();
        let info = p.finish(&mut img).unwrap();
        (info, img, bytes, reads)
    })
}

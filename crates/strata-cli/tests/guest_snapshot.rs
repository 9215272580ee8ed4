//! Desktop snapshots of a guest that writes to its disks: the guest's memory and its disks
//! agree record for record after `strata vm restore --launch`.
//!
//! The test guest runs `recwriter` (`strata::fixtures::records`), which writes numbered 4 KiB
//! records to one or two disks served by `strata serve` over NBD (straight to the devices with
//! O_DIRECT, or to a file on ext4 with fsync per record) and keeps in memory the record it is
//! writing (`started`) and the last one that completed (`done`). While it writes:
//! 1. `strata vm snapshot` takes memory and disks at one instant; the guest writes on;
//! 2. `strata vm snapshot --memory-only` takes memory alone; the guest writes on, then dies.
//!
//! The two-disk cases also take a `--precopy` snapshot (cut at the switchover) between 1 and 2.
//!
//! Restoring 1 with `--launch --paused`, the paused guest's memory (QMP `pmemsave`) holds the
//! writer's state and the clones hold, per disk, every record up to `done` and none after
//! `started` (the ext4 clones also pass `e2fsck -fn` once the journal is replayed); the
//! original disks hold newer records, so the clones are not them. Resumed, the writer goes on
//! from its memory; stopped, its clones hold exactly the records up to its counter (ext4:
//! unmounted cleanly, fsck clean). Restoring 2 onto the original disks is the negative
//! control: the checker must report the disk ahead of memory. The precopy snapshot restores
//! to memory and clones that agree, as 1 does, and so do `vm snapshot --cut-at-stop` and the
//! stop-and-copy `vm save` (their own test). Both ways of being in flight occur at the
//! instant: record `started` already on the disk, or not yet.
//!
//! Two more: kill -9 of the saver at points spread over a desktop snapshot, and of the serving
//! daemon during one, never leave a snapshot listed but incomplete; `--revert` gives the
//! original disk the snapshot's content and keeps its content before as a disk snapshot.
//!
//! Run: cargo test -p strata-cli --test guest_snapshot (builds target/fixtures on first use).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata::fixtures::records::{check_cut, find_state, CutMismatch, DiskRecords, WriterState};
use strata::fixtures::{reply_field, Fixtures, Guest, GuestMode, Machine};
use strata::qmp::QmpClient;

const T: Duration = Duration::from_secs(120);
const MEM_MIB: u64 = 256;
const DISK_MIB: u64 = 64;
/// Slots per disk (4 MiB of records): the writer wraps around, the checker reads them all.
const RING: u64 = 1024;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fs {
    /// O_DIRECT writes to the block device.
    Direct,
    /// A file on ext4 (journal on), fsync per record.
    Ext4,
}

fn strata(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("run strata")
}

fn json_ok(store: &Path, args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let o = strata(store, &a);
    assert!(
        o.status.success(),
        "strata {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!("strata {args:?}: no JSON ({e}): {}", String::from_utf8_lossy(&o.stdout))
    })
}

fn run(tool: &str, args: &[&str]) -> Output {
    Command::new(tool).args(args).output().unwrap_or_else(|e| panic!("run {tool}: {e}"))
}

fn run_ok(tool: &str, args: &[&str]) -> String {
    let o = run(tool, args);
    assert!(
        o.status.success(),
        "{tool} {args:?} failed ({}): {}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A process this test started (`strata serve`, a restored QEMU); killed on drop.
struct Proc(u32);

impl Drop for Proc {
    fn drop(&mut self) {
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

/// A store with its disks served over NBD on a unix socket.
struct Lab {
    dir: tempfile::TempDir,
    store: PathBuf,
    sock: PathBuf,
    serve: Child,
}

impl Lab {
    fn new(disks: &[String], fs: Fs) -> Lab {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        json_ok(&store, &["init"]);
        for d in disks {
            match fs {
                Fs::Direct => {
                    json_ok(&store, &["disk", "create", d, "--size", &format!("{DISK_MIB}M")]);
                }
                Fs::Ext4 => {
                    let img = dir.path().join(format!("{d}.img"));
                    run_ok(
                        "mkfs.ext4",
                        &[
                            "-q",
                            "-F",
                            "-E",
                            "lazy_itable_init=0,lazy_journal_init=0",
                            img.to_str().unwrap(),
                            &format!("{DISK_MIB}M"),
                        ],
                    );
                    json_ok(&store, &["disk", "import", d, img.to_str().unwrap()]);
                    std::fs::remove_file(&img).unwrap();
                }
            }
        }
        let sock = dir.path().join("nbd.sock");
        let serve = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("--store")
            .arg(&store)
            .args(["serve", "--socket", sock.to_str().unwrap()])
            .env("STRATA_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !sock.exists() {
            assert!(t.elapsed() < Duration::from_secs(30), "strata serve did not start");
            sleep(Duration::from_millis(50));
        }
        Lab { dir, store, sock, serve }
    }

    fn drive(&self, disk: &str) -> String {
        format!(
            "file=nbd+unix:///{disk}?socket={},format=raw,if=virtio,cache=none",
            self.sock.display()
        )
    }

    /// The current content of export `name`, read over NBD (the writer's slots only).
    fn read_export(&self, name: &str) -> Vec<u8> {
        let out = self.dir.path().join(format!("{name}.raw"));
        let _ = std::fs::remove_file(&out);
        let url = format!("nbd+unix:///{name}?socket={}", self.sock.display());
        run_ok("nbdcopy", &[&url, out.to_str().unwrap()]);
        let b = std::fs::read(&out).unwrap();
        std::fs::remove_file(&out).unwrap();
        b
    }

    /// The writer's view of disk `index` (export `name`): its slots as they are now. An ext4
    /// disk is copied, its journal replayed (`e2fsck -E journal_only`), checked (`e2fsck -fn`
    /// must be clean), and its `records` file read.
    fn records(&self, name: &str, index: u32, fs: Fs, run: u64) -> DiskRecords {
        let bytes = self.read_export(name);
        let data = match fs {
            Fs::Direct => bytes,
            Fs::Ext4 => self.ext4_records(name, &bytes),
        };
        DiskRecords::scan(&data, index, run, RING)
    }

    fn ext4_records(&self, name: &str, image: &[u8]) -> Vec<u8> {
        let img = self.dir.path().join(format!("{name}.ext4"));
        let file = self.dir.path().join(format!("{name}.records"));
        std::fs::write(&img, image).unwrap();
        let i = img.to_str().unwrap();
        // replay the journal as a mount would, and nothing else
        run_ok("e2fsck", &["-E", "journal_only", "-y", i]);
        let fsck = run("e2fsck", &["-fn", i]);
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&fsck.stdout),
            String::from_utf8_lossy(&fsck.stderr)
        );
        assert!(
            fsck.status.success() && !said.contains("journal recovery"),
            "e2fsck -fn on {name} (journal replayed) is not clean: {said}"
        );
        let _ = std::fs::remove_file(&file);
        run_ok("debugfs", &["-R", &format!("dump /records {}", file.display()), i]);
        let b = std::fs::read(&file).unwrap_or_default();
        let _ = std::fs::remove_file(&file);
        std::fs::remove_file(&img).unwrap();
        b
    }

    /// `e2fsck -fn` of export `name` as it is (no journal replay): clean.
    fn fsck_clean(&self, name: &str) {
        let img = self.dir.path().join(format!("{name}.fsck"));
        std::fs::write(&img, self.read_export(name)).unwrap();
        let fsck = run("e2fsck", &["-fn", img.to_str().unwrap()]);
        assert!(
            fsck.status.success(),
            "e2fsck -fn on {name} is not clean: {}{}",
            String::from_utf8_lossy(&fsck.stdout),
            String::from_utf8_lossy(&fsck.stderr)
        );
        std::fs::remove_file(&img).unwrap();
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        unsafe { libc::kill(self.serve.id() as i32, libc::SIGINT) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.serve.try_wait() {
                return;
            }
            sleep(Duration::from_millis(50));
        }
        let _ = self.serve.kill();
        let _ = self.serve.wait();
    }
}

/// A line-protocol client of the agent on a restored guest's console.
struct Console {
    rd: BufReader<UnixStream>,
}

impl Console {
    fn connect(path: &Path) -> Console {
        let t = Instant::now();
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if t.elapsed() > Duration::from_secs(30) => panic!("console {path:?}: {e}"),
                Err(_) => sleep(Duration::from_millis(50)),
            }
        };
        s.set_read_timeout(Some(T)).unwrap();
        Console { rd: BufReader::new(s) }
    }

    fn command(&mut self, line: &str) -> String {
        self.rd.get_mut().write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut l = String::new();
        loop {
            l.clear();
            assert!(self.rd.read_line(&mut l).unwrap() > 0, "console closed");
            let t = l.trim_matches(|c: char| c.is_whitespace() || c == '\0');
            if let Some(p) = t.strip_prefix("OK ") {
                return p.to_string();
            }
            assert!(!t.starts_with("ERR"), "`{line}`: {t}");
        }
    }
}

fn field(reply: &str, key: &str) -> u64 {
    reply_field(reply, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {reply:?}"))
}

fn run_id(reply: &str) -> u64 {
    u64::from_str_radix(reply_field(reply, "run").expect("run="), 16).unwrap()
}

/// The writer's state in the memory of the paused QEMU behind `qmp`.
fn memory_state(qmp: &Path, dump: &Path, run: u64) -> WriterState {
    let mut q = QmpClient::connect(qmp).unwrap();
    assert_eq!(q.query_status().unwrap().status, "paused", "restore --paused left the VM running");
    q.execute("pmemsave", Some(json!({"val": 0, "size": MEM_MIB << 20, "filename": dump})))
        .unwrap();
    let s = find_state(dump, Some(run)).unwrap();
    std::fs::remove_file(dump).unwrap();
    s
}

/// A QEMU that `strata vm restore --launch --paused` started, and the writer's state in it.
struct Restored {
    json: Value,
    qmp: PathBuf,
    qemu: Proc,
    state: WriterState,
}

/// One guest's writer and its disks.
struct Case {
    lab: Lab,
    fs: Fs,
    run: u64,
    ndisks: u64,
    /// The guest's console socket, where a restored QEMU listens too.
    console: PathBuf,
    /// The guest's QMP socket.
    qmp: String,
}

impl Case {
    /// Restore checkpoint `name` with `--launch --paused` and read the writer's state.
    fn restore_paused(&self, name: &str) -> Restored {
        let rd = self.lab.dir.path().join(format!("run-{name}"));
        let json = json_ok(
            &self.lab.store,
            &["vm", "restore", name, "--launch", "--paused", "--run-dir", rd.to_str().unwrap()],
        );
        let pid = json["pid"].as_u64().unwrap_or_else(|| panic!("no pid in {json}")) as u32;
        let qemu = Proc(pid);
        let qmp = PathBuf::from(json["qmp"].as_str().unwrap_or_else(|| panic!("no qmp in {json}")));
        let state = memory_state(&qmp, &self.lab.dir.path().join(format!("{name}.dump")), self.run);
        Restored { json, qmp, qemu, state }
    }

    /// The disks a restored QEMU runs on: the clones the restore lists, else `originals`
    /// (a checkpoint without disks runs on the disks of its command line).
    fn disks_of(&self, r: &Restored, originals: &[String]) -> Vec<String> {
        match r.json["disks"].as_array() {
            Some(v) if !v.is_empty() => {
                assert_eq!(v.len(), originals.len(), "{}", r.json);
                let now = |orig: &String| -> String {
                    let d = v.iter().find(|d| d["disk"].as_str() == Some(orig.as_str()));
                    let d = d.unwrap_or_else(|| panic!("no disk {orig} in {}", r.json));
                    d["now"].as_str().unwrap_or_else(|| panic!("{}", r.json)).into()
                };
                originals.iter().map(now).collect()
            }
            _ => originals.to_vec(),
        }
    }

    /// The records on `disks` (exports, in the writer's order) as they are now.
    fn read(&self, disks: &[String]) -> Vec<DiskRecords> {
        disks
            .iter()
            .enumerate()
            .map(|(i, d)| self.lab.records(d, i as u32, self.fs, self.run))
            .collect()
    }

    /// Resume `r`, let the writer go on from its memory, stop it (and unmount ext4), stop
    /// QEMU: `disks` then hold exactly the records up to the writer's counter (ext4: clean).
    fn resume_and_check(&self, r: Restored, disks: &[String]) -> u64 {
        QmpClient::connect(&r.qmp).unwrap().execute("cont", None).unwrap();
        let mut con = Console::connect(&self.console);
        sleep(Duration::from_millis(500));
        let stop = con.command("stop");
        assert_eq!(run_id(&stop), self.run, "{stop}");
        assert_eq!(field(&stop, "errno"), 0, "{stop}");
        let done = field(&stop, "done");
        assert!(done > r.state.started, "writer did not go on: {stop} after {:?}", r.state);
        if self.fs == Fs::Ext4 {
            con.command("umount");
        }
        quit(&r.qmp, r.qemu);
        let after = WriterState::stopped(self.run, done, self.ndisks, RING);
        check_cut(&after, &self.read(disks))
            .unwrap_or_else(|e| panic!("after resume: {e} (writer at {done})"));
        if self.fs == Fs::Ext4 {
            for d in disks {
                self.lab.fsck_clean(d);
            }
        }
        done
    }
}

fn quit(qmp: &Path, qemu: Proc) {
    let mut q = QmpClient::connect(qmp).unwrap();
    let _ = q.execute("quit", None);
    drop(q);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if unsafe { libc::kill(qemu.0 as i32, 0) } != 0 {
            // gone: its pid must not be signalled again
            std::mem::forget(qemu);
            return;
        }
        sleep(Duration::from_millis(50));
    }
    drop(qemu);
}

/// Boot the record writer guest on `ndisks` fresh disks of a new store and start the writer
/// (`writer`: extra options of recwriter's `start`).
fn boot_writer(
    machine: Machine,
    ndisks: usize,
    fs: Fs,
    writer: &str,
) -> (Guest, Case, Vec<String>) {
    let fx = Fixtures::ensure().expect("fixtures (scripts/fixtures.sh)");
    let disks: Vec<String> = (0..ndisks).map(|i| format!("data{i}")).collect();
    let lab = Lab::new(&disks, fs);
    let mut b = fx
        .guest()
        .mode(GuestMode::Rec)
        .machine(machine)
        .memory_mib(MEM_MIB as u32)
        .qmp(true)
        .name(&format!("rec-{}-{ndisks}-{fs:?}", machine.as_str()));
    for d in &disks {
        b = b.drive(&lab.drive(d));
    }
    let mut g = b.launch().expect("boot the record writer guest");
    let devs: Vec<String> =
        (0..ndisks).map(|i| format!("/dev/vd{}", (b'a' + i as u8) as char)).collect();
    let mode = match fs {
        Fs::Direct => "direct",
        Fs::Ext4 => "ext4",
    };
    let start =
        g.command(&format!("start {mode} {} ring={RING} {writer}", devs.join(",")), T).unwrap();
    let run = run_id(&start);
    let qmp = g.qmp_path().unwrap().to_str().unwrap().to_string();
    let c =
        Case { lab, fs, run, ndisks: ndisks as u64, console: g.dir().join("console.sock"), qmp };
    (g, c, disks)
}

/// One case: boot, write (`writer`: extra options of recwriter's `start`), snapshot (memory
/// and disks; with `precopy` also a precopy one), memory-only snapshot, then check each.
fn snapshot_case(machine: Machine, ndisks: usize, fs: Fs, writer: &str, precopy: bool) {
    let t0 = Instant::now();
    let (mut g, c, disks) = boot_writer(machine, ndisks, fs, writer);
    let qmp = c.qmp.clone();
    sleep(Duration::from_millis(1500));

    // While the guest writes: memory and disks, then memory alone.
    let snap = json_ok(&c.lab.store, &["vm", "snapshot", "--qmp", &qmp, "full"]);
    let snap_disks = snap["disks"].as_array().unwrap_or_else(|| panic!("no disks in {snap}"));
    assert_eq!(snap_disks.len(), ndisks, "{snap}");
    sleep(Duration::from_millis(1000));
    if precopy {
        let pre = json_ok(&c.lab.store, &["vm", "snapshot", "--precopy", "--qmp", &qmp, "pre"]);
        assert_eq!(pre["disks"].as_array().map(Vec::len), Some(ndisks), "{pre}");
        sleep(Duration::from_millis(500));
    }
    let mem = json_ok(&c.lab.store, &["vm", "snapshot", "--memory-only", "--qmp", &qmp, "memonly"]);
    assert!(mem["disks"].as_array().is_none_or(|d| d.is_empty()), "{mem}");
    sleep(Duration::from_millis(1000));
    let stat = g.command("stat", T).unwrap();
    assert_eq!(field(&stat, "errno"), 0, "{stat}");
    let written = field(&stat, "done");
    g.kill().unwrap();

    // The memory-only snapshot on the original disks, which went on: the checker catches it.
    let r = c.restore_paused("memonly");
    assert_eq!(c.disks_of(&r, &disks), disks, "a memory-only restore got clones: {}", r.json);
    match check_cut(&r.state, &c.read(&disks)) {
        Err(CutMismatch::DiskAhead { last, started, .. }) => {
            eprintln!("memory-only: disk at {last}, memory started {started}: caught")
        }
        other => panic!("memory-only snapshot on the current disks not caught: {other:?}"),
    }
    quit(&r.qmp, r.qemu);

    // The precopy snapshot, cut at the switchover: memory and its clones agree.
    if precopy {
        let r = c.restore_paused("pre");
        let clones = c.disks_of(&r, &disks);
        assert_ne!(clones, disks, "the snapshot restored onto the original disks: {}", r.json);
        let lasts = check_cut(&r.state, &c.read(&clones))
            .unwrap_or_else(|e| panic!("precopy: {e} ({:?})", r.state));
        eprintln!("precopy: memory {}/{}, clones at {lasts:?}", r.state.started, r.state.done);
        quit(&r.qmp, r.qemu);
    }

    // The desktop snapshot: at the paused instant memory and the clones agree, and the
    // original disks went on past it (so the clones are not them).
    let r = c.restore_paused("full");
    let clones = c.disks_of(&r, &disks);
    assert_ne!(clones, disks, "the snapshot restored onto the original disks: {}", r.json);
    let st = r.state;
    assert!(st.done > 0 && st.done < written, "snapshot at {st:?}, {written} written by then");
    let lasts = check_cut(&st, &c.read(&clones)).unwrap_or_else(|e| panic!("{e} ({st:?})"));
    eprintln!("snapshot: memory {}/{}, clones at {lasts:?}", st.started, st.done);
    for (d, orig) in disks.iter().zip(c.read(&disks)) {
        assert!(orig.last() > st.started, "disk {d} has no record after the snapshot");
    }
    let done = c.resume_and_check(r, &clones);
    eprintln!("{machine:?} {ndisks} {fs:?}: resumed writer stopped at {done}; {:?}", t0.elapsed());
    drop(g);
}

/// O_DIRECT with fdatasync after each record (a flush per record).
#[test]
fn o_direct_records_one_disk_pc() {
    snapshot_case(Machine::Pc, 1, Fs::Direct, "sync=1", false);
}

#[test]
fn o_direct_records_two_disks_q35_and_precopy() {
    snapshot_case(Machine::Q35, 2, Fs::Direct, "", true);
}

#[test]
fn ext4_records_two_disks_pc_and_precopy() {
    snapshot_case(Machine::Pc, 2, Fs::Ext4, "", true);
}

#[test]
fn ext4_records_one_disk_q35() {
    snapshot_case(Machine::Q35, 1, Fs::Ext4, "", false);
}

/// The writer's records as the checker reads them: the fixture's `recwriter` runs on the host
/// (a static x86-64 binary) against two image files, and after `stop` each holds exactly the
/// records up to its counter.
#[test]
fn host_recwriter_records_pass_the_checker() {
    let fx = Fixtures::ensure().expect("fixtures (scripts/fixtures.sh)");
    let dir = tempfile::tempdir().unwrap();
    let imgs: Vec<PathBuf> = (0..2).map(|i| dir.path().join(format!("d{i}.img"))).collect();
    for p in &imgs {
        std::fs::write(p, vec![0u8; 8 << 20]).unwrap();
    }
    let list: Vec<&str> = imgs.iter().map(|p| p.to_str().unwrap()).collect();
    let mut child = Command::new(fx.recwriter())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run recwriter on the host");
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut reply = |cmd: &str| -> String {
        writeln!(stdin, "{cmd}").unwrap();
        loop {
            let mut l = String::new();
            assert!(out.read_line(&mut l).unwrap() > 0, "recwriter exited");
            if let Some(p) = l.trim().strip_prefix("OK ") {
                return p.to_string();
            }
            assert!(!l.starts_with("ERR"), "`{cmd}`: {l}");
        }
    };
    // a ring smaller than what is written, so the check covers wrapped slots
    let start = reply(&format!("start direct {} ring=64 rate=2000", list.join(",")));
    let run = run_id(&start);
    sleep(Duration::from_millis(300));
    let stop = reply("stop");
    let done = field(&stop, "done");
    assert!(done > 2 * 64, "only {done} records in 300 ms: {stop}");
    drop(stdin);
    assert!(child.wait().unwrap().success());
    let state = WriterState::stopped(run, done, 2, 64);
    let disks: Vec<DiskRecords> = imgs
        .iter()
        .enumerate()
        .map(|(i, p)| DiskRecords::scan(&std::fs::read(p).unwrap(), i as u32, run, 64))
        .collect();
    let lasts = check_cut(&state, &disks).unwrap();
    assert_eq!(lasts.iter().max(), Some(&done));
    // one record fewer in memory than on disk: the disk is ahead
    let behind = WriterState::stopped(run, done - 1, 2, 64);
    assert!(matches!(check_cut(&behind, &disks), Err(CutMismatch::DiskAhead { .. })));
}

/// The other placements of the cut: `vm snapshot --cut-at-stop` (stop, cut, then migrate) and
/// `vm save` (stop-and-copy: the VM stays paused); both restore to memory and disks that agree,
/// and the saved writer goes on from its memory.
#[test]
fn cut_at_stop_and_stop_and_copy_save() {
    let (mut g, c, disks) = boot_writer(Machine::Q35, 1, Fs::Direct, "");
    let qmp = c.qmp.clone();
    sleep(Duration::from_millis(1500));
    let snap = json_ok(&c.lab.store, &["vm", "snapshot", "--cut-at-stop", "--qmp", &qmp, "atstop"]);
    assert_eq!(snap["disks"].as_array().map(Vec::len), Some(1), "{snap}");
    sleep(Duration::from_millis(500));
    let saved = json_ok(&c.lab.store, &["vm", "save", "--qmp", &qmp, "saved"]);
    assert_eq!(saved["disks"].as_array().map(Vec::len), Some(1), "{saved}");
    g.kill().unwrap();
    for name in ["atstop", "saved"] {
        let r = c.restore_paused(name);
        let now = c.disks_of(&r, &disks);
        let lasts = check_cut(&r.state, &c.read(&now))
            .unwrap_or_else(|e| panic!("{name}: {e} ({:?})", r.state));
        eprintln!("{name}: memory {}/{}, disks at {lasts:?}", r.state.started, r.state.done);
        if name == "saved" {
            c.resume_and_check(r, &now);
        } else {
            quit(&r.qmp, r.qemu);
        }
    }
}

/// The migration of the guest behind `qmp` is over. A killed saver's background snapshot runs
/// to its end (its drain child reads the rest) and must not be cancelled: QEMU 7.2 leaves the
/// RAM of a cancelled one write-protected and the guest hangs (docs/memory.md).
fn migration_idle(qmp: &str) {
    let mut q = QmpClient::connect(Path::new(qmp)).unwrap();
    let t = Instant::now();
    let st = loop {
        let st = q.query_migrate().map(|m| m.status).unwrap_or_default();
        if !matches!(st.as_str(), "setup" | "active" | "device" | "cancelling" | "pre-switchover") {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the migration does not end: {st}");
        sleep(Duration::from_millis(50));
    };
    let status = q.query_status().unwrap();
    eprintln!("after the kill: migration {st}, guest {}", status.status);
    if !status.running {
        q.cont().unwrap();
    }
}

/// What the guest behind `qmp` (QEMU `pid`) is doing when it does not answer: QEMU's view, and
/// where each of its threads waits in the kernel (a vCPU in `handle_userfault` is blocked on a
/// write-protected page).
fn stuck_guest(qmp: &str, pid: Option<u32>) -> String {
    let mut q = QmpClient::connect(Path::new(qmp)).unwrap();
    let mut out = format!(
        "query-status: {:?}\nquery-migrate: {:?}\n",
        q.execute("query-status", None),
        q.execute("query-migrate", None)
    );
    if let Some(p) = pid {
        for t in std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten() {
            let wchan = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
            out += &format!("thread {:?} waits in {wchan}\n", t.file_name());
        }
    }
    out
}

/// kill -9 of `strata vm snapshot` at points spread over its run, then of the serving daemon
/// during one: every snapshot is either listed whole (its manifest and disks readable, the
/// store checks clean) or not at all, and the guest keeps running.
#[test]
fn kill_9_during_desktop_snapshots_leaves_each_whole_or_absent() {
    let (mut g, mut c, _disks) = boot_writer(Machine::Pc, 1, Fs::Direct, "");
    let qmp = c.qmp.clone();
    sleep(Duration::from_millis(1000));
    // How long one takes here, to spread the kills over it.
    let t = Instant::now();
    json_ok(&c.lab.store, &["vm", "snapshot", "--qmp", &qmp, "whole"]);
    let full = t.elapsed();
    let mut outcomes = (0, 0);
    for i in 0..8u32 {
        let name = format!("killed{i}");
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("--store")
            .arg(&c.lab.store)
            .args(["vm", "snapshot", "--qmp", &qmp, &name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        sleep(full * (i + 1) / 8);
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
        migration_idle(&qmp);
        let list = json_ok(&c.lab.store, &["vm", "list"]);
        let entry = list.as_array().unwrap().iter().find(|e| e["name"] == name.as_str()).cloned();
        match entry {
            Some(e) => {
                assert!(e["error"].is_null(), "{name} listed but unreadable: {e}");
                let i = json_ok(&c.lab.store, &["vm", "inspect", &name]);
                assert_eq!(i["manifest"]["disks"].as_array().map(Vec::len), Some(1), "{i}");
                outcomes.0 += 1;
            }
            None => outcomes.1 += 1,
        }
        let stat = g.command("stat", Duration::from_secs(20)).unwrap_or_else(|e| {
            let log =
                std::fs::read_to_string(c.lab.dir.path().join("serve.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "the guest does not answer after kill {i}: {e}\n{}serve log (newest first):\n{}",
                stuck_guest(&qmp, g.pid()),
                tail.join("\n")
            )
        });
        assert_eq!(field(&stat, "writing"), 1, "the writer stopped after kill {i}: {stat}");
    }
    eprintln!("kill -9 of the saver: {} snapshots whole, {} absent", outcomes.0, outcomes.1);
    // The daemon dies while a snapshot waits for its disks: the snapshot fails, nothing shows.
    let child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(&c.lab.store)
        .args(["vm", "snapshot", "--qmp", &qmp, "daemon-killed"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    sleep(full / 3);
    c.lab.serve.kill().unwrap();
    let _ = c.lab.serve.wait();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!("the snapshot finished before the daemon died");
    } else {
        assert!(err.contains("strata:"), "no clear error: {err}");
        let list = json_ok(&c.lab.store, &["vm", "list"]);
        assert!(
            !list.as_array().unwrap().iter().any(|e| e["name"] == "daemon-killed"),
            "a failed snapshot is listed: {list}"
        );
    }
    migration_idle(&qmp);
    g.kill().unwrap();
    let chk = json_ok(&c.lab.store, &["check"]);
    assert!(chk["problems"].as_array().is_some_and(|p| p.is_empty()), "{chk}");
}

/// `vm restore --revert`: the original disk gets the snapshot's content (memory and disk
/// agree), and its content before is kept as a disk snapshot holding the newer records.
#[test]
fn revert_gives_the_original_disk_the_snapshot_and_keeps_what_it_had() {
    let (mut g, c, disks) = boot_writer(Machine::Pc, 1, Fs::Direct, "");
    let qmp = c.qmp.clone();
    sleep(Duration::from_millis(1500));
    json_ok(&c.lab.store, &["vm", "snapshot", "--qmp", &qmp, "rev"]);
    sleep(Duration::from_millis(1500));
    g.kill().unwrap();
    let before = c.read(&disks)[0].last();
    let rd = c.lab.dir.path().join("run-rev");
    let json = json_ok(
        &c.lab.store,
        &[
            "vm",
            "restore",
            "rev",
            "--launch",
            "--paused",
            "--revert",
            "--run-dir",
            rd.to_str().unwrap(),
        ],
    );
    let qemu = Proc(json["pid"].as_u64().unwrap() as u32);
    let qmp2 = PathBuf::from(json["qmp"].as_str().unwrap());
    let kept = json["disks"][0]["kept_as"].as_str().unwrap_or_else(|| panic!("{json}")).to_string();
    assert_eq!(json["disks"][0]["now"], disks[0].as_str(), "{json}");
    let state = memory_state(&qmp2, &c.lab.dir.path().join("rev.dump"), c.run);
    check_cut(&state, &c.read(&disks)).unwrap_or_else(|e| panic!("reverted disk: {e} ({state:?})"));
    let kept_last = c.lab.records(&kept, 0, Fs::Direct, c.run).last();
    assert_eq!(kept_last, before, "{kept} does not hold what {} had", disks[0]);
    assert!(kept_last > state.started, "the kept content is not newer than the snapshot");
    let r = Restored { json, qmp: qmp2, qemu, state };
    c.resume_and_check(r, &disks);
}

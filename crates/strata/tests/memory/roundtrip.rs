//! VM memory on the store against a real qemu-system-x86_64 7.2 (TCG): save and live
//! checkpoints stored page by page, restored into a fresh QEMU, and compared page by page with
//! the source's memory captured independently by QEMU itself (`migrate exec:cat`).
//!
//! Run: cargo test -p strata --test memory roundtrip::

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use strata::memory::manifest::Mode;
use strata::memory::restore::{restore, RestoreOptions};
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::progress::NoProgress;
use strata::store::{InitOptions, Store};

fn store_in(dir: &Path) -> Store {
    Store::init_local(&dir.join("store"), InitOptions::default()).unwrap()
}

fn counter(q: &mut Qemu) -> u32 {
    q.read_u32(0x1004)
}

/// Capture a QEMU's memory with QEMU's own `migrate exec:cat` and parse it.
fn capture(q: &mut Qemu, file: &Path) -> MemImage {
    q.fast_migration();
    q.save_to(file);
    let (_, img) = parse_file(file, 1 << 20);
    std::fs::remove_file(file).ok();
    img
}

/// Guest-physical memory [0, bytes) read by QEMU itself (HMP `pmemsave`), whatever the run
/// state (a VM paused by a finished migration cannot be migrated again).
fn pmem(q: &mut Qemu, bytes: u64, file: &Path) -> Vec<u8> {
    let out = q
        .qmp
        .human_monitor_command(&format!("pmemsave 0 {bytes:#x} \"{}\"", file.display()))
        .unwrap();
    assert!(out.trim().is_empty(), "pmemsave: {out}");
    let v = std::fs::read(file).unwrap();
    std::fs::remove_file(file).ok();
    assert_eq!(v.len() as u64, bytes);
    v
}

/// Restore `name` into a fresh paused destination with the same arguments; returns it.
fn restore_into(store: &Store, dir: &Path, tag: &str, args: &[String], name: &str) -> Qemu {
    let mut dst = start_destination(dir, tag, args);
    let opts = RestoreOptions { resume: false, ..Default::default() };
    let r = restore(store, name, &mut dst.qmp, &opts, &NoProgress)
        .unwrap_or_else(|e| panic!("restore {name}: {e:#?}\nQEMU stderr: {}", dst.stderr()));
    assert_eq!(r.pages, r.zero_pages + (r.pages - r.zero_pages));
    eprintln!(
        "{tag}: restored {name}: {} pages ({} zero), {} chunks verified, {} MB read in {} reads, stream {:.0} ms, loaded {:.0} ms",
        r.pages,
        r.zero_pages,
        r.chunks_verified,
        r.bytes_read / 1_000_000,
        r.reads,
        r.stream_ms,
        r.load_ms
    );
    dst
}

fn show(tag: &str, r: &SaveReport) {
    eprintln!(
        "{tag}: {} '{}' {:.0} ms (downtime {:.1} ms, pause {:?}), {} pages sent, {} stored, {} deduped, {} zero; stored {} of {} bytes, codec {} ({})",
        r.mode.as_str(),
        r.name,
        r.total_ms,
        r.downtime_ms,
        r.pause_ms,
        r.pages_sent,
        r.pages_stored,
        r.pages_deduped,
        r.zero_pages,
        r.stored_bytes,
        r.logical_bytes,
        r.codec.chosen,
        r.codec.why
    );
}

/// Stop-and-copy save, restore, compare all memory exactly; the restored guest then runs.
fn save_restore(tag: &str, machine: &str, mem: u32) {
    let dir = workdir(tag);
    let store = store_in(&dir);
    let args = vm_args(machine, mem, true);
    let mut src = Qemu::start(&dir, "src", &args);
    src.wait_guest_filled();
    let r = save(&store, &mut src.qmp, "vm1", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    show(tag, &r);
    // Like virsh save, the VM stays paused.
    let st = src.qmp.query_status().unwrap();
    assert!(!st.running, "source must stay paused after save, status {}", st.status);
    assert_eq!(r.pages_sent, r.logical_bytes / 4096, "stop-and-copy sends every page once");
    assert!(r.zero_pages > 0 && r.pages_stored > 0);
    assert!(r.stored_bytes < r.logical_bytes, "zero pages are not stored");
    let bytes = mem as u64 * 1024 * 1024;
    let want = pmem(&mut src, bytes, &dir.join("src.mem"));
    src.quit();
    prefetch_starts_before_the_stream(&dir, "vm1");

    let mut dst = restore_into(&store, &dir, "dst", &args, "vm1");
    let got = pmem(&mut dst, bytes, &dir.join("dst.mem"));
    let differ = want.chunks(4096).zip(got.chunks(4096)).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} pages of guest memory differ after save -> restore");
    // The restored guest keeps running its loop.
    dst.qmp.cont().unwrap();
    let c0 = counter(&mut dst);
    std::thread::sleep(Duration::from_millis(300));
    assert!(counter(&mut dst) > c0, "restored guest does not run");
    dst.quit();
    assert!(!store.check(Default::default(), &NoProgress).unwrap().is_damaged());
}

/// A backend that counts range reads.
#[derive(Debug)]
struct CountReads(strata::backend::local::LocalBackend, std::sync::atomic::AtomicUsize);

impl strata::backend::Backend for CountReads {
    fn name(&self) -> String {
        self.0.name()
    }
    fn capabilities(&self) -> strata::backend::Capabilities {
        self.0.capabilities()
    }
    fn get(&self, key: &str) -> strata::backend::BResult<Vec<u8>> {
        self.0.get(key)
    }
    fn get_range(&self, key: &str, offset: u64, len: u64) -> strata::backend::BResult<Vec<u8>> {
        if key.starts_with("packs/") {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.0.get_range(key, offset, len)
    }
    fn put(&self, key: &str, data: &[u8]) -> strata::backend::BResult<()> {
        self.0.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> strata::backend::BResult<bool> {
        self.0.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> strata::backend::BResult<Vec<strata::backend::ObjectInfo>> {
        self.0.list(prefix)
    }
    fn delete(&self, key: &str) -> strata::backend::BResult<()> {
        self.0.delete(key)
    }
    fn sync(&self) -> strata::backend::BResult<()> {
        self.0.sync()
    }
}

/// The first reads of a restore start while the plan finishes (and QEMU is being connected),
/// not when the stream starts; the stream then uses them and is whole.
fn prefetch_starts_before_the_stream(dir: &Path, name: &str) {
    use strata::memory::restore::{load_checkpoint, prepare, stream};
    let be = std::sync::Arc::new(CountReads(
        strata::backend::local::LocalBackend::open(dir.join("store")).unwrap(),
        Default::default(),
    ));
    let store = Store::open(be.clone(), &dir.join("prefetch.redb")).unwrap();
    let ckpt = load_checkpoint(&store, name).unwrap();
    let opts = RestoreOptions::default();
    let p = prepare(&store, &ckpt, &opts).unwrap();
    // Maps and tail were read inside `prepare`; give the early reads time to land.
    std::thread::sleep(Duration::from_millis(500));
    let before = be.1.load(std::sync::atomic::Ordering::SeqCst);
    let (_, rep) = stream(p, std::io::sink(), &opts, &NoProgress).unwrap();
    assert!(rep.chunks_verified > 0 && rep.reads > 0, "{rep:?}");
    // The stream reads only what was not read early, and uses the early reads.
    let during = be.1.load(std::sync::atomic::Ordering::SeqCst) - before;
    let early = rep.early_reads as usize;
    assert!(early >= (rep.reads as usize).min(strata::memory::restore::FETCHERS), "{rep:?}");
    assert_eq!(
        during,
        rep.reads as usize - early,
        "{} reads planned, {early} early, {during} made by the stream",
        rep.reads
    );
}

#[test]
fn save_restore_pc_128() {
    save_restore("mem-save-pc-128", "pc", 128);
}

#[test]
fn save_restore_q35_256() {
    save_restore("mem-save-q35-256", "q35", 256);
}

/// Live checkpoint (background-snapshot by default, or precopy + cont): the guest keeps
/// running, the checkpoint restores to the guest's memory (except the words the guest keeps
/// changing), and a second checkpoint costs only the changed pages.
fn live(tag: &str, machine: &str, mem: u32, mode: Mode) {
    let dir = workdir(tag);
    let store = store_in(&dir);
    let args = vm_args(machine, mem, true);
    let mut src = Qemu::start(&dir, "src", &args);
    src.wait_guest_filled();
    let c0 = counter(&mut src);
    let r1 = save(&store, &mut src.qmp, "live1", &SaveOptions::new(mode), &NoProgress).unwrap();
    show(tag, &r1);
    let st = src.qmp.query_status().unwrap();
    assert!(st.running, "guest must keep running through a live checkpoint, status {}", st.status);
    let c1 = counter(&mut src);
    std::thread::sleep(Duration::from_millis(200));
    let c2 = counter(&mut src);
    assert!(c1 > c0 && c2 > c1, "guest counter did not advance: {c0} {c1} {c2}");
    if mode == Mode::BackgroundSnapshot {
        let pause = r1.pause_ms.expect("STOP/RESUME events");
        assert!(pause < 200.0, "background-snapshot paused the guest {pause} ms");
        assert_eq!(
            r1.pages_sent,
            r1.logical_bytes / 4096,
            "background snapshot sends every page once"
        );
    }

    // A second checkpoint of the lightly changed VM stores only what changed: at most 10% of
    // the first. Precopy may store a dirtied page twice (its first-pass version and, held back
    // until the end, its final one), so it gets twice the budget.
    let r2 = save(&store, &mut src.qmp, "live2", &SaveOptions::new(mode), &NoProgress).unwrap();
    show(tag, &r2);
    let budget = if mode == Mode::Precopy { 5 } else { 10 };
    assert!(
        r2.stored_bytes * budget <= r1.stored_bytes,
        "second checkpoint stored {} bytes, first {}",
        r2.stored_bytes,
        r1.stored_bytes
    );

    src.qmp.stop().unwrap();
    let later = capture(&mut src, &dir.join("src.bin"));
    src.quit();
    let mut dst = restore_into(&store, &dir, "dst", &args, "live1");
    let got = capture(&mut dst, &dir.join("dst.bin"));
    let (bad, first) = diff_images(&later, &got, &guest_dirty);
    assert_eq!((bad, first), (0, None), "checkpoint differs from the guest beyond its dirty words");
    let restored_counter = strata::endian::le32(&got.data[0], 0x1004);
    assert!(
        restored_counter >= c0 && restored_counter <= c1,
        "checkpoint counter {restored_counter} not within [{c0}, {c1}]"
    );
    dst.quit();
}

#[test]
fn live_background_snapshot_pc_256() {
    live("mem-live-bg-pc-256", "pc", 256, Mode::BackgroundSnapshot);
}

#[test]
fn live_precopy_q35_128() {
    live("mem-live-pre-q35-128", "q35", 128, Mode::Precopy);
}

/// Two VMs booted from the same image: the second save stores almost nothing.
#[test]
fn dedup_across_vms() {
    let dir = workdir("mem-dedup-vms");
    let store = store_in(&dir);
    let args = vm_args("pc", 128, true);
    let mut reports = Vec::new();
    for i in 0..2 {
        let mut q = Qemu::start(&dir, &format!("vm{i}"), &args);
        q.wait_guest_filled();
        let t = Instant::now();
        let r =
            save(&store, &mut q.qmp, &format!("vm{i}"), &SaveOptions::new(Mode::Save), &NoProgress)
                .unwrap();
        show(&format!("vm{i} ({:.1} s)", t.elapsed().as_secs_f64()), &r);
        reports.push(r);
        q.quit();
    }
    // The guests differ only in the counter page and the dirtied words of [4, 12) MiB.
    assert!(
        reports[1].stored_bytes * 5 < reports[0].stored_bytes,
        "second VM stored {} bytes, first {}",
        reports[1].stored_bytes,
        reports[0].stored_bytes
    );
    assert!(reports[1].pages_deduped > reports[1].pages_stored * 5);
}

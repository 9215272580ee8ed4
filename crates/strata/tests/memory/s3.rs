//! A VM memory save into a store on a real S3 server (versitygw), and what happens when the
//! server dies in the middle: the save fails with an error that says the backend went away,
//! no checkpoint becomes visible (also to a second host opening the bucket afterwards), and a
//! save after the server is back works and restores byte for byte on a host that only has
//! the bucket.
//!
//! Also: a host restores from its own copy of a checkpoint's ref while it fetches the ref, and
//! notices when another host has replaced or deleted the checkpoint since.
//!
//! Run: cargo test -p strata --test memory s3::

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use strata::backend::retry::{RetryBackend, RetryPolicy};
use strata::backend::s3::S3Backend;
use strata::backend::servers::S3Server;
use strata::backend::DynBackend;
use strata::memory::manifest::Mode;
use strata::memory::restore::{restore, RestoreOptions};
use strata::memory::save::{save, SaveOptions};
use strata::progress::{NoProgress, Progress, Unit};
use strata::store::{local_meta_path, InitOptions, Store};

use strata::error_chain as chain;

fn backend(s3: &S3Server) -> DynBackend {
    let b: DynBackend = Arc::new(S3Backend::open(s3.config("s3://vms").unwrap()).unwrap());
    // Short retries, so the test sees the failure in seconds, not a minute.
    let p = RetryPolicy {
        max_attempts: 3,
        base_delay: Duration::from_millis(50),
        max_delay: Duration::from_millis(200),
        max_elapsed: Duration::from_secs(2),
    };
    Arc::new(RetryBackend::new(b, p))
}

/// Kills the S3 server once `after` bytes of pages have arrived.
struct KillS3At {
    pid: u32,
    after: u64,
    seen: AtomicU64,
}

impl Progress for KillS3At {
    fn phase(&self, _: &str, _: Option<u64>, _: Unit) {}
    fn advance(&self, n: u64) {
        let before = self.seen.fetch_add(n, Ordering::SeqCst);
        if before < self.after && before + n >= self.after {
            // SAFETY: plain kill(2) of the versitygw child this test started.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        }
    }
}

#[test]
fn killing_s3_mid_save_leaves_no_checkpoint_and_says_why() {
    let dir = workdir("mem-s3-kill");
    let mut s3 = S3Server::start(&dir.join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("vms").unwrap();
    let store =
        Store::init(backend(&s3), &local_meta_path(&dir.join("hostA")), InitOptions::default())
            .unwrap();

    let mut q = Qemu::start(&dir, "src", &vm_args("pc", 256, true));
    q.wait_guest_filled();
    let kill = KillS3At { pid: s3.pid().unwrap(), after: 64 << 20, seen: AtomicU64::new(0) };
    let e = save(&store, &mut q.qmp, "cut", &SaveOptions::new(Mode::Save), &kill).unwrap_err();
    let msg = chain(&e);
    eprintln!("save with S3 killed: {msg}");
    assert!(kill.seen.load(Ordering::SeqCst) >= 64 << 20, "the save finished before the kill");
    let lower = msg.to_lowercase();
    assert!(
        lower.contains("unavailable") || lower.contains("unreachable") || lower.contains("connect"),
        "the error must say the backend went away: {msg}"
    );
    assert!(msg.contains("s3"), "and name it: {msg}");
    drop(store);

    // The server comes back: nothing is visible, to this host or to a new one.
    s3.restart().unwrap();
    let b = Store::open(backend(&s3), &local_meta_path(&dir.join("hostB"))).unwrap();
    assert!(b.get_ref("vm/cut").unwrap().is_none(), "a cut save must not be visible");
    assert!(b.list_refs("vm/").unwrap().is_empty());

    // The VM is still there (paused, as after a failed `virsh save`); a retry succeeds.
    let r = save(&b, &mut q.qmp, "ok", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    assert!(r.pages_sent > 0 && r.stored_bytes > 0, "{r:?}");
    assert!(b.get_ref("vm/ok").unwrap().is_some());
    strata::memory::restore::load_checkpoint(&b, "ok").unwrap();
    let bytes = 256u64 << 20;
    let want = pmem(&mut q, bytes, &dir.join("src.mem"));
    q.quit();

    // A third host that has only the bucket restores it byte for byte: maps, tail and every
    // page come over HTTP, the pages in reads of a few MiB (the fetchers keep several in
    // flight while the decoders verify).
    let c = Store::open(backend(&s3), &local_meta_path(&dir.join("hostC"))).unwrap();
    let args = vm_args("pc", 256, true);
    let mut dst = start_destination(&dir, "dst", &args);
    let opts = RestoreOptions { resume: false, ..Default::default() };
    let r = restore(&c, "ok", &mut dst.qmp, &opts, &NoProgress)
        .unwrap_or_else(|e| panic!("restore: {}\nQEMU stderr: {}", chain(&e), dst.stderr()));
    eprintln!(
        "restored through S3: {} MB in {} reads, plan {:.0} ms, stream {:.0} ms",
        r.bytes_read / 1_000_000,
        r.reads,
        r.plan_ms,
        r.stream_ms
    );
    let per = (r.bytes_read / 32).max(1 << 20);
    assert!(
        r.reads >= r.bytes_read / per,
        "{} reads for {} bytes: reads larger than planned",
        r.reads,
        r.bytes_read
    );
    let got = pmem(&mut dst, bytes, &dir.join("dst.mem"));
    let differ = want.chunks(4096).zip(got.chunks(4096)).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} pages differ after a save and restore through S3");
    dst.quit();

    // A pack deleted from the bucket behind strata's back (host C listed it at open; GC could
    // not have removed it while C is open): C skips the per-pack HEADs on S3, so the loss is
    // found by the pack's read. The restore fails naming the page, and the target QEMU, which
    // got a cut stream and never a wrong page, does not run the checkpoint.
    let raw = Arc::new(S3Backend::open(s3.config("s3://vms").unwrap()).unwrap());
    let mut packs = strata::backend::Backend::list(&*raw, "packs/").unwrap();
    packs.sort_by_key(|o| o.size);
    let victim = packs.last().expect("the checkpoint has packs").key.clone();
    strata::backend::Backend::delete(&*raw, &victim).unwrap();
    let mut dst = start_destination(&dir, "dst-lost", &args);
    let e = restore(&c, "ok", &mut dst.qmp, &opts, &NoProgress).unwrap_err();
    let msg = chain(&e);
    eprintln!("pack deleted from the bucket: {msg}");
    assert!(matches!(e, strata::memory::error::MemError::PageDamaged { .. }), "{msg}");
    assert!(
        msg.contains("'ok'") && msg.contains("ramblock 'pc.ram'") && msg.contains("page 0x"),
        "{msg}"
    );
    std::thread::sleep(Duration::from_millis(300));
    let running = dst.qmp.query_status().map(|s| s.running).unwrap_or(false);
    assert!(!running, "the target runs after a restore with a lost pack");
    drop(dst);
}

#[test]
fn a_replaced_checkpoint_is_restored_from_the_store_not_from_this_hosts_copy_of_its_ref() {
    let dir = workdir("mem-s3-refcopy");
    let s3 = S3Server::start(&dir.join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("vms").unwrap();
    let a = Store::init(backend(&s3), &local_meta_path(&dir.join("hostA")), InitOptions::default())
        .unwrap();
    let b = Store::open(backend(&s3), &local_meta_path(&dir.join("hostB"))).unwrap();
    let mem = 128u32;
    let bytes = (mem as u64) << 20;
    let args = vm_args("pc", mem, true);
    let mut q = Qemu::start(&dir, "src", &args);
    q.wait_guest_filled();

    // Host A checkpoints the running guest, so it has a copy of the ref; the guest goes on.
    save(&a, &mut q.qmp, "desk", &SaveOptions::new(Mode::BackgroundSnapshot), &NoProgress).unwrap();
    assert!(
        a.ref_copies().unwrap().get("vm/desk").is_some(),
        "the saving host keeps a copy of the ref"
    );
    let c0 = q.read_u32(0x1004);
    let t0 = std::time::Instant::now();
    while q.read_u32(0x1004) == c0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "guest counter did not move");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Host B replaces it with a save of the guest as it is now.
    let mut replace = SaveOptions::new(Mode::Save);
    replace.replace = true;
    save(&b, &mut q.qmp, "desk", &replace, &NoProgress).unwrap();
    let want = pmem(&mut q, bytes, &dir.join("src.mem"));
    q.quit();
    assert_ne!(
        a.ref_copies().unwrap().get("vm/desk"),
        b.get_ref("vm/desk").unwrap(),
        "host A's copy is now stale"
    );

    // Host A restores: its copy is a wrong guess, found out, and the store's ref is used.
    let opts = RestoreOptions { resume: false, ..Default::default() };
    for (round, expect) in [(1, "stale"), (2, "used")] {
        let mut dst = start_destination(&dir, &format!("dst{round}"), &args);
        let r = restore(&a, "desk", &mut dst.qmp, &opts, &NoProgress).unwrap_or_else(|e| {
            panic!("restore {round}: {}\nQEMU stderr: {}", chain(&e), dst.stderr())
        });
        assert_eq!(r.ref_copy, expect, "restore {round}");
        let got = pmem(&mut dst, bytes, &dir.join("dst.mem"));
        let differ = want.chunks(4096).zip(got.chunks(4096)).filter(|(x, y)| x != y).count();
        assert_eq!(
            differ, 0,
            "restore {round} ({expect} copy): {differ} pages differ from host B's save"
        );
        dst.quit();
    }
    assert_eq!(
        a.ref_copies().unwrap().get("vm/desk"),
        b.get_ref("vm/desk").unwrap(),
        "the copy was brought up to date"
    );

    // Host B deletes it: host A's restore says it is gone, not what its copy said.
    strata::memory::catalog::remove(&b, "desk").unwrap();
    let mut dst = start_destination(&dir, "dst3", &args);
    let e = restore(&a, "desk", &mut dst.qmp, &opts, &NoProgress).unwrap_err();
    assert!(matches!(e, strata::memory::error::MemError::NotFound { .. }), "{}", chain(&e));
    assert!(a.ref_copies().unwrap().get("vm/desk").is_none(), "the copy of a deleted ref goes");
    let st = dst.qmp.query_status().unwrap();
    assert_eq!(st.status, "inmigrate", "the target is untouched");
    dst.quit();
}

/// S3 with every listing of checkpoint refs answered late, as a cold server or real object
/// storage answers a LIST; everything else passes straight through.
#[derive(Debug)]
struct LateListing {
    inner: DynBackend,
    delay: Duration,
    lists: AtomicU64,
}

impl strata::backend::Backend for LateListing {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn capabilities(&self) -> strata::backend::Capabilities {
        self.inner.capabilities()
    }
    fn get(&self, key: &str) -> strata::backend::BResult<Vec<u8>> {
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, offset: u64, len: u64) -> strata::backend::BResult<Vec<u8>> {
        self.inner.get_range(key, offset, len)
    }
    fn get_ranges(
        &self,
        key: &str,
        ranges: &[(u64, u64)],
    ) -> strata::backend::BResult<Vec<Vec<u8>>> {
        self.inner.get_ranges(key, ranges)
    }
    fn put(&self, key: &str, data: &[u8]) -> strata::backend::BResult<()> {
        self.inner.put(key, data)
    }
    fn put_shared(&self, key: &str, data: &Arc<Vec<u8>>) -> strata::backend::BResult<()> {
        self.inner.put_shared(key, data)
    }
    fn put_volatile(&self, key: &str, data: &[u8]) -> strata::backend::BResult<()> {
        self.inner.put_volatile(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> strata::backend::BResult<bool> {
        self.inner.put_if_absent(key, data)
    }
    fn list(&self, prefix: &str) -> strata::backend::BResult<Vec<strata::backend::ObjectInfo>> {
        if prefix.starts_with("refs/vm/") {
            self.lists.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
        }
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> strata::backend::BResult<()> {
        self.inner.delete(key)
    }
    fn sync(&self) -> strata::backend::BResult<()> {
        self.inner.sync()
    }
    fn head(&self, key: &str) -> strata::backend::BResult<Option<u64>> {
        self.inner.head(key)
    }
}

/// A save does not wait for a late listing of checkpoint refs unless its answer can change
/// what is saved (`memory/save/listing.rs`), and a taken name is still refused: found during
/// the stream, the migration is cancelled, the guest runs again and the checkpoint there is
/// untouched. With a delta base in view (this host has seen a checkpoint), the save waits.
#[test]
fn a_late_listing_does_not_hold_up_a_save_and_a_taken_name_is_still_refused() {
    let dir = workdir("mem-s3-late-list");
    let s3 = S3Server::start(&dir.join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("vms").unwrap();
    let delay = Duration::from_millis(1500);
    let ms = delay.as_secs_f64() * 1e3;
    let slow = |host: &str| -> (Arc<LateListing>, std::path::PathBuf) {
        (
            Arc::new(LateListing { inner: backend(&s3), delay, lists: AtomicU64::new(0) }),
            local_meta_path(&dir.join(host)),
        )
    };
    let (ba, meta_a) = slow("hostA");
    let a = Store::init(ba.clone(), &meta_a, InitOptions::default()).unwrap();
    let mut q = Qemu::start(&dir, "src", &vm_args("pc", 128, true));
    q.wait_guest_filled();

    // Host A has seen no checkpoint: the first save starts without the listing's answer.
    let r = save(&a, &mut q.qmp, "first", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    assert_eq!(ba.lists.load(Ordering::SeqCst), 1, "the save lists the refs once");
    eprintln!(
        "first save: set-up {:.1} ms, total {:.0} ms (listing {} ms)",
        r.stages.setup_ms,
        r.total_ms,
        delay.as_millis()
    );
    assert!(
        r.stages.setup_ms < ms * 2.0 / 3.0,
        "the set-up waited for the listing: {:.1} ms",
        r.stages.setup_ms
    );
    assert!(
        r.total_ms >= ms * 0.9,
        "the commit must wait for the listing's answer: {:.0} ms",
        r.total_ms
    );
    assert!(r.delta.is_none());
    let first = a.get_ref("vm/first").unwrap().expect("saved");
    q.qmp.cont().unwrap();

    // Host B, fresh, saves the same name: the answer comes during the stream and stops it.
    let (bb, meta_b) = slow("hostB");
    let b = Store::open(bb, &meta_b).unwrap();
    let t = std::time::Instant::now();
    let e = save(&b, &mut q.qmp, "first", &SaveOptions::new(Mode::Save), &NoProgress).unwrap_err();
    eprintln!("refused save: {:.0} ms, {}", t.elapsed().as_secs_f64() * 1e3, chain(&e));
    assert!(matches!(e, strata::memory::error::MemError::Exists { .. }), "{}", chain(&e));
    assert!(chain(&e).contains("first"), "{}", chain(&e));
    std::thread::sleep(Duration::from_millis(200));
    let st = q.qmp.query_status().unwrap();
    assert!(st.running, "the guest must run again after the refused save: {}", st.status);
    assert_eq!(
        b.get_ref("vm/first").unwrap(),
        Some(first.clone()),
        "the checkpoint there is untouched"
    );

    // Host A now has a copy of a checkpoint ref, so the auto delta base may exist: it waits.
    let r = save(&a, &mut q.qmp, "second", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    eprintln!(
        "second save: set-up {:.1} ms, delta {:?}",
        r.stages.setup_ms,
        r.delta.as_ref().map(|d| &d.base)
    );
    assert!(
        r.stages.setup_ms >= ms * 0.9,
        "with a possible base the save waits for the listing: {:.1} ms",
        r.stages.setup_ms
    );
    assert!(r.delta.is_some(), "and takes 'first' as its delta base");
    q.quit();
}

/// A stop-and-copy save to S3 makes runs of compressible groups, and a copy of a page inside
/// one (the memwork guest's text region holds the golden files, as its page cache does) names
/// the run's slot through its leaf's slot table (format version 4) instead of being stored
/// again. The restore, on a host that has only the bucket, is byte for byte the saved memory.
#[test]
fn copies_of_pages_inside_runs_name_the_runs_slot_and_restore_byte_for_byte() {
    use strata::fixtures::{Fixtures, Machine};
    use strata::memory::launch::{restore_launch, LaunchOptions};
    use strata::memory::restore::load_checkpoint;
    let fx = Fixtures::ensure().unwrap();
    let dir = workdir("mem-s3-slots");
    let s3 = S3Server::start(&dir.join("s3")).unwrap_or_else(|e| panic!("{e}"));
    s3.create_bucket("vms").unwrap();
    let a = Store::init(backend(&s3), &local_meta_path(&dir.join("hostA")), InitOptions::default())
        .unwrap();
    let mem = 192u32;
    let mut g = fx
        .guest()
        .memory_mib(mem)
        .machine(Machine::Pc)
        .qmp(true)
        .drive(&format!("file={},if=virtio,format=raw,readonly=on", fx.golden().display()))
        .name("slots")
        .launch()
        .expect("boot the memwork guest");
    g.command("text 48", Duration::from_secs(300)).unwrap();
    let mut q = strata::qmp::QmpClient::connect(g.qmp_path().unwrap()).unwrap();
    let r = save(&a, &mut q, "desk", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    let want = {
        let f = dir.join("src.mem");
        let out = q
            .human_monitor_command(&format!(
                "pmemsave 0 {:#x} \"{}\"",
                (mem as u64) << 20,
                f.display()
            ))
            .unwrap();
        assert!(out.trim().is_empty(), "pmemsave: {out}");
        let v = std::fs::read(&f).unwrap();
        std::fs::remove_file(&f).ok();
        v
    };
    drop(q);
    g.kill().unwrap();
    let ck = load_checkpoint(&a, "desk").unwrap();
    assert_eq!(
        ck.manifest.version, 4,
        "slot tables were written ({} pages stored)",
        r.pages_stored
    );

    // Host B has only the bucket.
    let b = Store::open(backend(&s3), &local_meta_path(&dir.join("hostB"))).unwrap();
    let mut lo = LaunchOptions::new(dir.join("run"));
    lo.restore.resume = false;
    let l = restore_launch(&b, "desk", &lo, &NoProgress)
        .unwrap_or_else(|e| panic!("restore: {}", chain(&e)));
    let mut child = l.child;
    let mut dq = strata::qmp::QmpClient::connect(&l.qmp_path).unwrap();
    let f = dir.join("dst.mem");
    let out = dq
        .human_monitor_command(&format!("pmemsave 0 {:#x} \"{}\"", (mem as u64) << 20, f.display()))
        .unwrap();
    assert!(out.trim().is_empty(), "pmemsave: {out}");
    let got = std::fs::read(&f).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(got.len(), want.len());
    let differ = want.chunks(4096).zip(got.chunks(4096)).filter(|(x, y)| x != y).count();
    assert_eq!(differ, 0, "{differ} pages differ after the restore");

    // `vm inspect --sharing` on the other host, through the slot tables: the distinct pages
    // are at least the RAM's distinct contents, and above them only by the other ramblocks'
    // pages and a few copies two workers stored at once (a copy stored again, not named).
    let i = strata::memory::catalog::inspect(&b, "desk", true).unwrap();
    let distinct_ram = want
        .chunks(4096)
        .filter(|p| p.iter().any(|&x| x != 0))
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    let other: u64 =
        ck.manifest.blocks.iter().filter(|b| b.name != "pc.ram").map(|b| b.pages()).sum();
    let d = i.sharing.unwrap().distinct_pages;
    assert!(
        d >= distinct_ram && d <= distinct_ram + other + 200,
        "{d} distinct pages for {distinct_ram} distinct in RAM and {other} elsewhere"
    );
}

/// Guest-physical memory [0, bytes) read by QEMU itself (HMP `pmemsave`).
fn pmem(q: &mut Qemu, bytes: u64, file: &std::path::Path) -> Vec<u8> {
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

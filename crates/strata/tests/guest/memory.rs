//! VM memory checkpoints of the Linux test guest (`strata::fixtures`, memwork agent): the
//! guest's own checksum of its memory survives a live checkpoint -> `--launch` restore, the
//! guest keeps working through the checkpoint, and guests booted from the same image share
//! their pages in the store (each freshly booted Linux guest still differs from its twin in
//! about 15 MB of kernel state: slab objects, timestamps, page tables).
//!
//! Run: cargo test -p strata --test guest memory:: (builds target/fixtures on first use).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use strata::fixtures::{reply_field, Fixtures, Guest, Machine};
use strata::memory::codec_choice::CodecPolicy;
use strata::memory::delta::BasePolicy;
use strata::memory::launch::{restore_launch, LaunchOptions};
use strata::memory::manifest::{is_run_chunk, Mode};
use strata::memory::restore::load_checkpoint;
use strata::memory::save::{save, SaveOptions};
use strata::progress::NoProgress;
use strata::qmp::QmpClient;
use strata::store::map::read_map;
use strata::store::{InitOptions, Store};

const T: Duration = Duration::from_secs(120);

fn boot(fx: &Fixtures, mem: u32, m: Machine, name: &str) -> Guest {
    fx.guest()
        .memory_mib(mem)
        .machine(m)
        .qmp(true)
        .name(name)
        .launch()
        .expect("boot the memwork guest")
}

fn qmp(g: &Guest) -> QmpClient {
    QmpClient::connect(g.qmp_path().unwrap()).unwrap()
}

fn console(path: &Path, line: &str) -> String {
    let s = UnixStream::connect(path).expect("console socket");
    s.set_read_timeout(Some(T)).unwrap();
    (&s).write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut rd = BufReader::new(&s);
    let mut l = String::new();
    loop {
        l.clear();
        assert!(rd.read_line(&mut l).unwrap() > 0, "console closed");
        let t = l.trim_matches(|c: char| c.is_whitespace() || c == '\0');
        if let Some(p) = t.strip_prefix("OK ") {
            return p.to_string();
        }
        assert!(!t.starts_with("ERR"), "{t}");
    }
}

#[test]
fn live_checkpoint_of_linux_guest_restores_with_launch() {
    let fx = Fixtures::ensure().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(&dir.path().join("store"), InitOptions::default()).unwrap();
    let mut g = boot(&fx, 256, Machine::Q35, "ckpt-launch");
    g.command("fill 64 30 30 1", T).unwrap();
    let sum0 = reply_field(&g.command("sum", T).unwrap(), "sum").unwrap().to_string();

    // The guest keeps working through the checkpoint: it rewrites pages meanwhile.
    g.command("dirty 16 0 7", T).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    g.command("dirty stop", T).unwrap();
    let sum1 = reply_field(&g.command("sum", T).unwrap(), "sum").unwrap().to_string();
    g.command("dirty 16 0 8", T).unwrap();
    let mut q = qmp(&g);
    // Checkpoint while dirtying runs, then once more with the guest quiet (the state to check).
    let busy =
        save(&store, &mut q, "busy", &SaveOptions::new(Mode::BackgroundSnapshot), &NoProgress)
            .unwrap();
    let stop = g.command("dirty stop", T).unwrap();
    let written: u64 = reply_field(&stop, "written").unwrap().parse().unwrap();
    assert!(written > 0, "guest did no work during the checkpoint: {stop}");
    assert!(busy.pause_ms.unwrap() < 100.0, "pause {:?} ms", busy.pause_ms);
    let sum2 = reply_field(&g.command("sum", T).unwrap(), "sum").unwrap().to_string();
    let r = save(&store, &mut q, "quiet", &SaveOptions::new(Mode::BackgroundSnapshot), &NoProgress)
        .unwrap();
    eprintln!(
        "quiet checkpoint: pause {:?} ms, {} pages stored, {} deduplicated",
        r.pause_ms, r.pages_stored, r.pages_deduped
    );
    assert!(q.query_status().unwrap().running);
    // Change memory after the checkpoint; the restore must not see it.
    g.command("fill 16 0 0 9", T).unwrap();
    assert_ne!(sum0, sum1);
    assert_ne!(sum1, sum2);
    drop(q);
    g.kill().unwrap();

    let l =
        restore_launch(&store, "quiet", &LaunchOptions::new(dir.path().join("run")), &NoProgress)
            .unwrap();
    let mut child = l.child;
    let got = console(&g.dir().join("console.sock"), "sum");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        reply_field(&got, "sum"),
        Some(sum2.as_str()),
        "memwork checksum differs after restore: {got}"
    );
}

#[test]
fn guests_from_one_image_share_pages() {
    let fx = Fixtures::ensure().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(&dir.path().join("store"), InitOptions::default()).unwrap();
    let mut stored = Vec::new();
    // Dedup, not the codec choice, is under test: one fixed codec keeps sizes comparable.
    let mut opts = SaveOptions::new(Mode::Save);
    opts.codec = CodecPolicy::Fixed(strata::Codec::Lz4);
    for i in 0..5u32 {
        // Booted from the same image: kernel, initramfs and the golden desktop disk, whose
        // binaries and libraries each guest reads into memory.
        let golden = format!("file={},if=virtio,format=raw,readonly=on", fx.golden().display());
        let mut g = fx
            .guest()
            .memory_mib(256)
            .machine(Machine::Pc)
            .qmp(true)
            .name(&format!("same-image-{i}"))
            .drive(&golden)
            .launch()
            .unwrap();
        g.command("text 64", T).unwrap();
        // Each user's own data: 8 MiB with a per-guest seed.
        g.command(&format!("fill 8 20 30 {}", 100 + i), T).unwrap();
        let mut q = qmp(&g);
        let r = save(&store, &mut q, &format!("vm{i}"), &opts, &NoProgress).unwrap();
        eprintln!(
            "vm{i}: stored {} bytes ({} pages new, {} deduplicated)",
            r.stored_bytes, r.pages_stored, r.pages_deduped
        );
        stored.push(r.stored_bytes);
    }
    let total: u64 = stored.iter().sum();
    eprintln!("5 guests: {total} bytes, {:.2}x one", total as f64 / stored[0] as f64);
    assert!(
        total <= 2 * stored[0],
        "5 guests from one image stored {total} bytes, one stored {}",
        stored[0]
    );
}

/// Pages of checkpoint `name` mapped to a slot of a run chunk (format version 3).
fn run_pages(store: &Store, name: &str) -> usize {
    let c = load_checkpoint(store, name).unwrap();
    assert_eq!(c.manifest.version, 3, "{name} has run chunks, so it is version 3");
    c.map_roots
        .iter()
        .flat_map(|root| read_map(store, root).unwrap())
        .filter(|id| !id.is_zero() && is_run_chunk(store, id))
        .count()
}

/// Incompressible memory in run chunks: a guest holding 96 MiB of random pages saves most
/// of them as runs (one chunk per aligned group of 32 pages) and restores with its checksum
/// intact; a second checkpoint with the first as its base maps the unchanged groups back to
/// the same runs and stores little more than the 4 MiB written in between, and a third, after
/// 200 scattered rewrites, stores those pages and maps their groups' other pages to the runs.
#[test]
fn random_memory_is_kept_in_run_chunks_and_restores() {
    let fx = Fixtures::ensure().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::init_local(&dir.path().join("store"), InitOptions::default()).unwrap();
    let mut g = boot(&fx, 256, Machine::Pc, "runs");
    g.command("fill 96 0 0 3", T).unwrap();
    let mut q = qmp(&g);
    let r0 = save(&store, &mut q, "r0", &SaveOptions::new(Mode::BackgroundSnapshot), &NoProgress)
        .unwrap();
    let runs0 = run_pages(&store, "r0");
    eprintln!(
        "r0: {} pages stored, {} bytes, {runs0} pages in runs",
        r0.pages_stored, r0.stored_bytes
    );
    assert!(runs0 >= 96 * 256 / 2, "only {runs0} of 24576 random pages in runs");
    assert!(r0.delta.is_none());
    g.command("fill 4 0 0 4", T).unwrap();
    let mut opts = SaveOptions::new(Mode::BackgroundSnapshot);
    opts.base = BasePolicy::Named("r0".into());
    let r1 = save(&store, &mut q, "r1", &opts, &NoProgress).unwrap();
    let runs1 = run_pages(&store, "r1");
    eprintln!(
        "r1: {} pages stored, {} bytes, {runs1} pages in runs",
        r1.pages_stored, r1.stored_bytes
    );
    assert_eq!(r1.delta.as_ref().map(|d| d.base.as_str()), Some("r0"));
    assert!(runs1 >= runs0, "r1 has {runs1} pages in runs, r0 {runs0}");
    assert!(
        r1.stored_bytes * 4 < r0.stored_bytes,
        "r1 stored {} bytes, r0 {}: unchanged runs were stored again",
        r1.stored_bytes,
        r0.stored_bytes
    );
    // 200 pages rewritten across the regions: each leaves its run, and the other pages of its
    // group map to the base's run again (compared with their slot) instead of being stored.
    g.command("dirty sync 200 5", T).unwrap();
    let sum = reply_field(&g.command("sum", T).unwrap(), "sum").unwrap().to_string();
    opts.base = BasePolicy::Named("r1".into());
    let r2 = save(&store, &mut q, "r2", &opts, &NoProgress).unwrap();
    let runs2 = run_pages(&store, "r2");
    eprintln!(
        "r2: {} pages stored, {} bytes, {runs2} pages in runs",
        r2.pages_stored, r2.stored_bytes
    );
    assert!(runs2 < runs1 && runs2 + 200 >= runs1, "r2 has {runs2} pages in runs, r1 {runs1}");
    assert!(
        r2.stored_bytes < 4 << 20,
        "r2 stored {} bytes for 200 rewritten pages",
        r2.stored_bytes
    );
    drop(q);
    g.kill().unwrap();
    assert!(!store.check(Default::default(), &NoProgress).unwrap().is_damaged());

    let l = restore_launch(&store, "r2", &LaunchOptions::new(dir.path().join("run")), &NoProgress)
        .unwrap();
    let mut child = l.child;
    let got = console(&g.dir().join("console.sock"), "sum");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        reply_field(&got, "sum"),
        Some(sum.as_str()),
        "memwork checksum differs after restore: {got}"
    );
}

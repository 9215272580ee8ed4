//! Delta pages against a base checkpoint, with a real qemu-system-x86_64 7.2 (TCG) and the
//! test guest (fills RAM with per-run data, then keeps writing a counter into two words of
//! every page of [4, 12) MiB): two guests from the same image differ, page for page, in those
//! words, which is exactly what deltas are for.
//!
//! * round trip: the second guest's pages in [4, 12) MiB are stored as deltas; restored
//!   memory is identical to the source's, byte for byte;
//! * `vm rm` of the base + `gc` keeps the dependent checkpoint restorable;
//! * a damaged base page aborts the restore naming the checkpoint and page, before QEMU runs
//!   anything;
//! * `--no-delta` and `--base NAME` do what they say.
//!
//! Run: cargo test -p strata --test memory delta::

use crate::common;

use std::path::Path;

use common::*;
use strata::memory::catalog;
use strata::memory::delta::{parse_record, BasePolicy};
use strata::memory::error::MemError;
use strata::memory::manifest::Mode;
use strata::memory::restore::{load_checkpoint, restore, RestoreOptions};
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::progress::NoProgress;
use strata::store::objects::Tree;
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store};

fn store_in(dir: &Path) -> Store {
    Store::init_local(&dir.join("store"), InitOptions::default()).unwrap()
}

use strata::error_chain as chain;

/// Guest-physical memory [0, bytes) read by QEMU itself (HMP `pmemsave`).
fn pmem(q: &mut Qemu, bytes: u64, file: &Path) -> Vec<u8> {
    let out = q
        .qmp
        .human_monitor_command(&format!("pmemsave 0 {bytes:#x} \"{}\"", file.display()))
        .unwrap();
    assert!(out.trim().is_empty(), "pmemsave: {out}");
    let v = std::fs::read(file).unwrap();
    std::fs::remove_file(file).ok();
    v
}

fn show(r: &SaveReport) {
    eprintln!(
        "{}: stored {} bytes, {} pages new, {} deduplicated, delta {:?}",
        r.name, r.stored_bytes, r.pages_stored, r.pages_deduped, r.delta
    );
}

const MEM: u32 = 128;

/// Save guest `name` (booted fresh) with `opts`; returns its memory and the report. The
/// source is quit afterwards.
fn save_guest(dir: &Path, store: &Store, name: &str, opts: &SaveOptions) -> (Vec<u8>, SaveReport) {
    let mut q = Qemu::start(dir, name, &vm_args("pc", MEM, true));
    q.wait_guest_filled();
    let r = save(store, &mut q.qmp, name, opts, &NoProgress).unwrap();
    show(&r);
    let mem = pmem(&mut q, (MEM as u64) << 20, &dir.join(format!("{name}.mem")));
    q.quit();
    (mem, r)
}

fn restore_compare(store: &Store, dir: &Path, tag: &str, name: &str, want: &[u8]) {
    let mut dst = start_destination(dir, tag, &vm_args("pc", MEM, true));
    let opts = RestoreOptions { resume: false, ..Default::default() };
    let r = restore(store, name, &mut dst.qmp, &opts, &NoProgress)
        .unwrap_or_else(|e| panic!("restore {name}: {}\nQEMU stderr: {}", chain(&e), dst.stderr()));
    eprintln!("{tag}: restored {name}: {} delta pages rebuilt", r.delta_pages);
    let got = pmem(&mut dst, (MEM as u64) << 20, &dir.join(format!("{tag}.mem")));
    let differ = want.chunks(4096).zip(got.chunks(4096)).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} pages differ after restoring {name}");
    dst.quit();
}

#[test]
fn delta_pages_round_trip_and_survive_removal_of_the_base() {
    let dir = workdir("mem-delta");
    let store = store_in(&dir);
    let opts = SaveOptions::new(Mode::Save);
    let (_, r0) = save_guest(&dir, &store, "vm0", &opts);
    assert!(r0.delta.is_none(), "an empty store has no base");
    let (mem1, r1) = save_guest(&dir, &store, "vm1", &opts);
    let d = r1.delta.clone().expect("vm0 is the automatic base");
    assert_eq!(d.base, "vm0");
    // [4, 12) MiB is 2048 pages, every 4th zero: 1536 pages that differ in two words.
    assert!(d.pages >= 1400, "only {} delta pages", d.pages);
    assert!(d.bytes < d.pages * 64, "deltas of {} bytes for {} pages", d.bytes, d.pages);
    assert!(
        r1.stored_bytes * 20 < r0.stored_bytes,
        "second guest stored {} bytes, first {}",
        r1.stored_bytes,
        r0.stored_bytes
    );
    // The manifest and inspect report it.
    let c = load_checkpoint(&store, "vm1").unwrap();
    assert_eq!(c.manifest.version, 2);
    assert_eq!(c.manifest.delta.as_ref().unwrap().pages, d.pages);
    let i = catalog::inspect(&store, "vm1", false).unwrap();
    assert_eq!(i.manifest.delta.as_ref().unwrap().base, "vm0");

    restore_compare(&store, &dir, "dst1", "vm1", &mem1);

    // Remove the base and collect garbage: vm1's deltas keep their base pages alive.
    catalog::remove(&store, "vm0").unwrap();
    let g = store.gc(&NoProgress).unwrap();
    eprintln!("gc after removing vm0: {g:?}");
    assert!(!store.check(Default::default(), &NoProgress).unwrap().is_damaged());
    drop(store);
    let store = Store::open_local(&dir.join("store")).unwrap();
    restore_compare(&store, &dir, "dst2", "vm1", &mem1);

    // --no-delta stores the changed pages whole; --base names the base.
    let mut off = SaveOptions::new(Mode::Save);
    off.base = BasePolicy::Off;
    let (_, r2) = save_guest(&dir, &store, "vm2", &off);
    assert!(r2.delta.is_none());
    assert!(r2.stored_bytes > r1.stored_bytes * 5, "{} vs {}", r2.stored_bytes, r1.stored_bytes);
    let mut named = SaveOptions::new(Mode::Save);
    named.base = BasePolicy::Named("vm1".into());
    let (mem3, r3) = save_guest(&dir, &store, "vm3", &named);
    let d3 = r3.delta.expect("named base");
    assert_eq!(d3.base, "vm1");
    assert!(d3.pages >= 1400);
    restore_compare(&store, &dir, "dst3", "vm3", &mem3);
    named.base = BasePolicy::Named("nope".into());
    let mut q = Qemu::start(&dir, "vm4", &vm_args("pc", MEM, true));
    q.wait_guest_filled();
    let e = save(&store, &mut q.qmp, "vm4", &named, &NoProgress).unwrap_err();
    assert!(matches!(e, MemError::NotFound { .. }), "{}", chain(&e));
    q.quit();
}

/// Incremental: a live checkpoint of a running guest, then a save of the same guest a moment
/// later. The second takes the first as its base, stores the rewritten pages as deltas, and
/// restores exactly.
#[test]
fn second_checkpoint_of_the_same_vm_stores_deltas() {
    let dir = workdir("mem-delta-incr");
    let store = store_in(&dir);
    let mut q = Qemu::start(&dir, "src", &vm_args("pc", MEM, true));
    q.wait_guest_filled();
    let r1 = save(
        &store,
        &mut q.qmp,
        "desk@1",
        &SaveOptions::new(Mode::BackgroundSnapshot),
        &NoProgress,
    )
    .unwrap();
    show(&r1);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let r2 =
        save(&store, &mut q.qmp, "desk@2", &SaveOptions::new(Mode::Save), &NoProgress).unwrap();
    show(&r2);
    let mem = pmem(&mut q, (MEM as u64) << 20, &dir.join("src.mem"));
    q.quit();
    let d = r2.delta.clone().expect("desk@1 is the base");
    assert_eq!(d.base, "desk@1");
    assert!(d.pages >= 1400, "only {} delta pages", d.pages);
    assert!(
        r2.stored_bytes * 20 < r1.stored_bytes,
        "second checkpoint stored {} bytes, first {}",
        r2.stored_bytes,
        r1.stored_bytes
    );
    restore_compare(&store, &dir, "dst", "desk@2", &mem);
}

#[test]
fn damaged_base_page_aborts_restore_naming_the_page() {
    let dir = workdir("mem-delta-damage");
    let store = store_in(&dir);
    let opts = SaveOptions::new(Mode::Save);
    save_guest(&dir, &store, "gold", &opts);
    let (_, r) = save_guest(&dir, &store, "desk", &opts);
    assert!(r.delta.as_ref().is_some_and(|d| d.pages > 1000));
    // Pick a base page that one of desk's delta records needs, and flip a byte of its frame.
    let c = load_checkpoint(&store, "desk").unwrap();
    let map = strata::store::map::read_map(&store, &c.map_roots[0]).unwrap();
    // Frames holding a page desk uses directly: damaging one of those would fail that page
    // first, wherever it is.
    let direct: std::collections::HashSet<_> = map
        .iter()
        .filter(|id| {
            !id.is_zero() && store.chunk_info(id).is_some_and(|(_, k)| k != ChunkKind::Tree)
        })
        .filter_map(|id| store.locate(id).map(|(p, e)| (p, e.frame_off)))
        .collect();
    let base = map
        .iter()
        .filter(|id| store.chunk_info(id).is_some_and(|(_, k)| k == ChunkKind::Tree))
        .map(|id| parse_record(&Tree::decode(&store.get(id).unwrap()).unwrap()).unwrap().base)
        .filter(|b| !b.is_zero())
        .filter(|b| store.locate(b).is_some_and(|(p, e)| !direct.contains(&(p, e.frame_off))))
        .nth(700) // mid-region: its frame holds only pages the guest changed
        .unwrap();
    let (pack, e) = store.locate(&base).unwrap();
    let packs = walk(&dir.join("store/packs"));
    let victim = packs
        .iter()
        .find(|p| p.to_string_lossy().contains(&pack.to_string()))
        .unwrap_or_else(|| panic!("pack {pack} not among {packs:?}"))
        .clone();
    drop(store);
    let mut bytes = std::fs::read(&victim).unwrap();
    let at = e.frame_off as usize + e.frame_len as usize / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&victim, &bytes).unwrap();
    let store = Store::open_local(&dir.join("store")).unwrap();

    let mut dst = start_destination(&dir, "dst", &vm_args("pc", MEM, true));
    let e =
        restore(&store, "desk", &mut dst.qmp, &RestoreOptions::default(), &NoProgress).unwrap_err();
    let msg = chain(&e);
    eprintln!("damaged base: {msg}");
    let MemError::PageDamaged { ref name, offset, .. } = e else { panic!("{msg}") };
    assert_eq!(name, "desk");
    assert!(msg.contains("ramblock 'pc.ram'") && msg.contains("before QEMU received it"), "{msg}");
    // The page is one of the delta pages (the region the guest keeps changing).
    assert!((0x40_0000..0xC0_0000).contains(&offset), "offset {offset:#x}: {msg}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let running = dst.qmp.query_status().map(|s| s.running).unwrap_or(false);
    assert!(!running, "destination runs after a damaged restore");
}

fn walk(d: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

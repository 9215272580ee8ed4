//! Stream parser + generator against a real qemu-system-x86_64 7.2 (TCG).
//!
//! Run: cargo test -p strata --test memory stream::

use crate::common;

use std::fs;
use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use common::*;
use strata::memory::stream::*;
use strata::qmp::*;

/// Stop-and-copy: capture, parse, regenerate, restore, migrate the restored VM out again and
/// compare every page of every block; then `cont` and check the guest keeps running.
fn roundtrip(tag: &str, machine: &str, mem: u32, with_guest: bool, via_socket: bool) {
    let dir = workdir(tag);
    let args = vm_args(machine, mem, with_guest);
    let mut src = Qemu::start(&dir, "src", &args);
    assert_eq!(src.qmp.version().major, 7);
    assert_eq!(src.qmp.version().minor, 2);
    if with_guest {
        src.wait_guest_filled();
    } else {
        // Let SeaBIOS run so pc.ram holds its data (shadowed BIOS, tables), not only zeros.
        std::thread::sleep(Duration::from_secs(1));
    }
    src.qmp.stop().unwrap();
    src.fast_migration();
    let a = dir.join("a.bin");
    let t0 = Instant::now();
    let (info, img) = if via_socket {
        // Parse while QEMU writes, straight from the socket.
        let sock = dir.join("save.sock");
        let rx = receive_unix(UnixListener::bind(&sock).unwrap(), &a);
        src.qmp.migrate(&format!("unix:{}", sock.display())).unwrap();
        src.qmp.wait_migration(Duration::from_secs(300), Duration::from_millis(20)).unwrap();
        let (info, img, bytes, reads) = rx.join().unwrap();
        eprintln!("{tag}: parsed {bytes} bytes from the socket in {reads} reads");
        (info, img)
    } else {
        src.save_to(&a);
        parse_file(&a, 65537)
    };
    let save_s = t0.elapsed().as_secs_f64();
    let stream_len = fs::metadata(&a).unwrap().len();

    // What QMP says about the VM matches what the stream says.
    let mt = src.qmp.machine_type().unwrap();
    assert_eq!(info.layout.machine_type.as_deref(), Some(mt.as_str()));
    let qmp_blocks = src.qmp.ram_blocks().unwrap();
    let mut sb: Vec<(String, u64)> =
        info.layout.blocks.iter().map(|b| (b.name.clone(), b.used_len)).collect();
    let mut qb: Vec<(String, u64)> = qmp_blocks.iter().map(|b| (b.name.clone(), b.used)).collect();
    sb.sort();
    qb.sort();
    assert_eq!(sb, qb, "MEM_SIZE list differs from info ramblock");
    let base = src.qmp.memory_size_summary().unwrap().base_memory;
    assert_eq!(base, mem as u64 * 1024 * 1024);
    assert_eq!(info.layout.blocks.iter().find(|b| b.name == "pc.ram").unwrap().used_len, base);
    assert_eq!(info.layout.ram_section.version_id, 4);
    assert!(!info.background_snapshot);
    assert!(info.vmdesc_devices > 10, "vmdesc lists {} devices", info.vmdesc_devices);
    assert_eq!(img.missing(), 0, "stop-and-copy must send every page");
    let nonzero = img.nonzero_pages();
    let ram_data_pages =
        img.data[0].chunks(PAGE_SIZE).filter(|p| p.iter().any(|&b| b != 0)).count();
    assert!(ram_data_pages > 20, "pc.ram has only {ram_data_pages} non-zero pages");
    if with_guest {
        // The guest filled 3/4 of the pages between 4 MiB and top-1MiB.
        let expect = (mem as u64 - 5) * 256 * 3 / 4;
        assert!(nonzero > expect, "only {nonzero} non-zero pages, expected > {expect}");
    }
    let counter = strata::endian::le32(&img.data[0], 0x1004);
    src.quit();

    // The same stream parsed whole and in 1-byte pieces gives the same summary.
    let bytes = fs::read(&a).unwrap();
    let whole = parse_all(&bytes).unwrap();
    if stream_len < 8 << 20 {
        assert_eq!(parse_all_chunked(&bytes, 1).unwrap(), whole);
    }
    assert_eq!(parse_all_chunked(&bytes, 4099).unwrap(), whole);

    // Regenerate (every page once) and check it parses back to the same memory.
    let r = dir.join("r.bin");
    let gstats = regenerate_file(&r, &info.layout, &img, &info.tail);
    let (rinfo, rimg) = parse_file(&r, 1 << 20);
    assert_eq!(rinfo.layout, info.layout);
    assert_eq!(rinfo.tail, info.tail);
    assert_eq!(diff_images(&img, &rimg, &exact), (0, None));
    assert_eq!(rinfo.stats.end_sections, 1);
    assert_eq!(rinfo.stats.part_sections, 0);

    // Restore into a fresh QEMU with the same arguments.
    let mut dst = start_destination(&dir, "dst", &args);
    let t1 = Instant::now();
    if via_socket {
        let sock = dir.join("load.sock");
        dst.qmp.migrate_incoming(&format!("unix:{}", sock.display())).unwrap();
        // Generate straight into QEMU's socket, no file in between.
        let s = UnixStream::connect(&sock).unwrap();
        let (mut s, st) = regenerate(s, &info.layout, &img, &info.tail);
        s.flush().unwrap();
        drop(s);
        assert_eq!(st.bytes, gstats.bytes);
    } else {
        dst.qmp.migrate_incoming(&format!("exec:cat {}", r.display())).unwrap();
    }
    let inc = dst.wait_incoming();
    let load_s = t1.elapsed().as_secs_f64();
    assert_eq!(inc.status, "completed");
    assert_eq!(dst.qmp.query_status().unwrap().status, "paused");

    // Migrate the restored (still paused) VM out and compare every page of every block.
    dst.fast_migration();
    let b = dir.join("b.bin");
    dst.save_to(&b);
    let (binfo, bimg) = parse_file(&b, 1 << 20);
    assert_eq!(binfo.layout.blocks, info.layout.blocks);
    assert_eq!(binfo.layout.machine_type, info.layout.machine_type);
    let (bad, first) = diff_images(&img, &bimg, &exact);
    assert_eq!(bad, 0, "{bad} pages differ after restore, first {first:?}");

    // The restored VM runs: the guest's counter moves on from the saved value.
    dst.qmp.cont().unwrap();
    let st = dst.qmp.query_status().unwrap();
    assert!(st.running, "status {}", st.status);
    if with_guest {
        let t = Instant::now();
        loop {
            let c = dst.read_u32(0x1004);
            if c > counter {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "guest counter stuck at {c} (saved {counter})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    dst.quit();
    eprintln!(
        "{tag}: stream {stream_len} B ({} pages, {} zero), regenerated {} B; save {save_s:.2}s, load {load_s:.2}s, tail {} B, {} devices",
        info.stats.page_records, info.stats.zero_records, gstats.bytes, info.tail.len(), info.vmdesc_devices
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn stop_and_copy_pc_128_bios_only() {
    roundtrip("pc128bios", "pc", 128, false, false);
}

#[test]
fn stop_and_copy_pc_128() {
    roundtrip("pc128", "pc", 128, true, false);
}

#[test]
fn stop_and_copy_pc_512() {
    roundtrip("pc512", "pc", 512, true, false);
}

#[test]
fn stop_and_copy_q35_128_over_sockets() {
    roundtrip("q35-128", "q35", 128, true, true);
}

#[test]
fn stop_and_copy_q35_512_over_sockets() {
    roundtrip("q35-512", "q35", 512, true, true);
}

/// background-snapshot: no RAM END, every page once, the VM keeps running.
#[test]
fn background_snapshot_roundtrip() {
    let dir = workdir("bg");
    let args = vm_args("q35", 256, true);
    let mut src = Qemu::start(&dir, "src", &args);
    src.wait_guest_filled();
    src.fast_migration();
    src.qmp.migrate_set_capabilities(&[("background-snapshot", true)]).unwrap();
    src.qmp.ensure_storable_capabilities(&CapabilityPolicy::default()).unwrap();
    let a = dir.join("bg.bin");
    src.save_to(&a);
    assert!(src.qmp.query_status().unwrap().running, "source should keep running");
    let (info, img) = parse_file(&a, 1 << 16);
    assert!(info.background_snapshot);
    assert_eq!(info.stats.end_sections, 0);
    assert_eq!(img.missing(), 0);
    assert_eq!(img.repeated(), 0, "background snapshot sends every page once");
    src.quit();

    let r = dir.join("r.bin");
    regenerate_file(&r, &info.layout, &img, &info.tail);
    let mut dst = start_destination(&dir, "dst", &args);
    dst.qmp.migrate_incoming(&format!("exec:cat {}", r.display())).unwrap();
    dst.wait_incoming();
    dst.fast_migration();
    let b = dir.join("b.bin");
    dst.save_to(&b);
    let (_, bimg) = parse_file(&b, 1 << 20);
    let (bad, first) = diff_images(&img, &bimg, &exact);
    assert_eq!(bad, 0, "{bad} pages differ, first {first:?}");
    let c0 = dst.read_u32(0x1004);
    dst.qmp.cont().unwrap();
    let t = Instant::now();
    while dst.read_u32(0x1004) <= c0 {
        assert!(t.elapsed() < Duration::from_secs(20), "restored guest does not run");
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "bg: {} B, {} pages, {} zero, {} PART sections",
        info.stats.bytes,
        info.stats.page_records,
        info.stats.zero_records,
        info.stats.part_sections
    );
    dst.quit();
    let _ = fs::remove_dir_all(&dir);
}

/// Keep a live precopy from converging (downtime-limit 1 ms) until QEMU has done `syncs`
/// dirty-bitmap syncs, then let it finish.
fn live_precopy(q: &mut Qemu, uri: &str, syncs: u64, bandwidth: u64) -> MigrationInfo {
    q.qmp
        .migrate_set_parameters(&MigrateParameters {
            max_bandwidth: Some(bandwidth),
            downtime_limit: Some(1),
            ..Default::default()
        })
        .unwrap();
    q.qmp.migrate(uri).unwrap();
    let t0 = Instant::now();
    loop {
        let i = q.qmp.query_migrate().unwrap();
        if i.status == "completed" {
            // Converged early (xbzrle makes resent pages tiny); callers check what they need.
            return i;
        }
        assert!(
            i.status == "active" || i.status == "setup",
            "status {} before forcing completion: {:?}",
            i.status,
            i.error_desc
        );
        if i.ram.as_ref().map(|r| r.dirty_sync_count).unwrap_or(0) >= syncs {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress: {:?}", i.raw);
        std::thread::sleep(Duration::from_millis(20));
    }
    q.qmp
        .migrate_set_parameters(&MigrateParameters {
            downtime_limit: Some(60_000),
            ..Default::default()
        })
        .unwrap();
    q.qmp.wait_migration(Duration::from_secs(300), Duration::from_millis(20)).unwrap()
}

/// Live precopy with several passes, parsed from the socket as it arrives: pages are resent
/// and the latest copy wins. Checked by loading the original multi-pass stream into QEMU and
/// migrating it out again, and by restoring the regenerated single-pass stream.
#[test]
fn precopy_multi_pass_latest_wins() {
    let dir = workdir("multipass");
    let args = vm_args("pc", 256, true);
    let mut src = Qemu::start(&dir, "src", &args);
    src.wait_guest_filled();
    let a = dir.join("live.bin");
    let sock = dir.join("save.sock");
    let rx = receive_unix(UnixListener::bind(&sock).unwrap(), &a);
    let mi = live_precopy(&mut src, &format!("unix:{}", sock.display()), 5, 10 << 30);
    let (info, img, bytes, reads) = rx.join().unwrap();
    let syncs = mi.ram.as_ref().unwrap().dirty_sync_count;
    eprintln!(
        "multipass: {bytes} B in {reads} reads, {} PART sections, {syncs} dirty syncs, {} page + {} zero records, {} pages repeated, downtime {:?} ms",
        info.stats.part_sections, info.stats.page_records, info.stats.zero_records, img.repeated(), mi.downtime_ms
    );
    // `live_precopy` forces five dirty syncs, but a guest starved of CPU on a loaded host may
    // dirty nothing in a pass, and QEMU then completes early (CI once saw 4 syncs, 7 PART
    // sections and 2049 resent pages): at least two passes after the bulk one, and resent
    // pages (below), are what this test needs.
    assert!(syncs >= 3, "{syncs} dirty syncs");
    assert!(info.stats.part_sections >= 5);
    assert_eq!(info.stats.end_sections, 1);
    assert!(img.repeated() >= 2048, "only {} pages were resent", img.repeated());
    assert_eq!(img.missing(), 0);
    // The source is postmigrate; it can continue.
    src.qmp.cont().unwrap();
    src.quit();

    // 1. QEMU's own reading of the multi-pass stream equals our latest-wins image.
    let mut d1 = start_destination(&dir, "d1", &args);
    d1.qmp.migrate_incoming(&format!("exec:cat {}", a.display())).unwrap();
    d1.wait_incoming();
    d1.fast_migration();
    let b1 = dir.join("b1.bin");
    d1.save_to(&b1);
    let (_, img1) = parse_file(&b1, 1 << 20);
    let (bad, first) = diff_images(&img, &img1, &exact);
    assert_eq!(bad, 0, "latest-wins image differs from QEMU's load: {bad} pages, first {first:?}");
    d1.quit();

    // 2. The regenerated single-pass stream restores the same memory.
    let r = dir.join("r.bin");
    regenerate_file(&r, &info.layout, &img, &info.tail);
    let mut d2 = start_destination(&dir, "d2", &args);
    d2.qmp.migrate_incoming(&format!("exec:cat {}", r.display())).unwrap();
    d2.wait_incoming();
    d2.fast_migration();
    let b2 = dir.join("b2.bin");
    d2.save_to(&b2);
    let (_, img2) = parse_file(&b2, 1 << 20);
    assert_eq!(diff_images(&img, &img2, &exact).0, 0);
    let c0 = d2.read_u32(0x1004);
    d2.qmp.cont().unwrap();
    let t = Instant::now();
    while d2.read_u32(0x1004) <= c0 {
        assert!(t.elapsed() < Duration::from_secs(20), "restored guest does not run");
        std::thread::sleep(Duration::from_millis(50));
    }
    d2.quit();
    let _ = fs::remove_dir_all(&dir);
}

/// Streams made with capabilities strata refuses fail with errors naming them.
#[test]
fn refused_capabilities_in_real_streams() {
    let dir = workdir("refused");
    let args = vm_args("pc", 128, true);

    // compress: COMPRESS_PAGE records.
    let mut q = Qemu::start(&dir, "compress", &args);
    q.wait_guest_filled();
    q.qmp.stop().unwrap();
    q.fast_migration();
    q.qmp.migrate_set_capabilities(&[("compress", true)]).unwrap();
    assert!(q.qmp.ensure_storable_capabilities(&CapabilityPolicy::default()).is_err());
    let f = dir.join("compress.bin");
    q.save_to(&f);
    q.quit();
    let e = parse_all(&fs::read(&f).unwrap()).unwrap_err();
    eprintln!("compress: {e}");
    assert!(matches!(e, StreamError::RefusedFlag { flag: "COMPRESS_PAGE", .. }), "{e}");
    assert!(e.to_string().contains("disable the compress capability"));

    // xbzrle: XBZRLE records from the second pass on. The first pass is throttled so the
    // guest dirties pages meanwhile even on a loaded machine; retried if it still converged
    // in one pass.
    let f = dir.join("xbzrle.bin");
    let mut attempt = 0;
    let e = loop {
        attempt += 1;
        let mut q = Qemu::start(&dir, &format!("xbzrle{attempt}"), &args);
        q.wait_guest_filled();
        q.qmp.migrate_set_capabilities(&[("xbzrle", true)]).unwrap();
        live_precopy(&mut q, &format!("exec:cat > {}", f.display()), 3, 24 << 20);
        q.quit();
        match parse_all(&fs::read(&f).unwrap()) {
            Err(e) => break e,
            Ok(sum) => {
                assert!(attempt < 4, "xbzrle stream never had a second pass: {:?}", sum.stats);
                eprintln!("xbzrle attempt {attempt} converged in one pass; retrying");
            }
        }
    };
    eprintln!("xbzrle: {e}");
    assert!(matches!(e, StreamError::RefusedFlag { flag: "XBZRLE", .. }), "{e}");

    // x-ignore-shared: a configuration/capabilities subsection.
    let mut q = Qemu::start(&dir, "ignore", &args);
    q.qmp.stop().unwrap();
    q.fast_migration();
    q.qmp.migrate_set_capabilities(&[("x-ignore-shared", true)]).unwrap();
    let f = dir.join("ignore.bin");
    q.save_to(&f);
    q.quit();
    let e = parse_all(&fs::read(&f).unwrap()).unwrap_err();
    eprintln!("x-ignore-shared: {e}");
    assert!(
        matches!(&e, StreamError::RefusedCapability { capability, .. } if capability == "x-ignore-shared"),
        "{e}"
    );
    let _ = fs::remove_dir_all(&dir);
}

/// validate-uuid adds a configuration/uuid subsection: kept verbatim, regenerated, and QEMU
/// checks it on load (same uuid loads, another uuid is refused).
#[test]
fn uuid_subsection_round_trip() {
    let dir = workdir("uuid");
    let mut args = vm_args("pc", 128, false);
    args.extend(["-uuid".to_string(), "6e4b0b9c-0a53-4b7e-9c5e-2f6b9a1d7c11".to_string()]);
    let mut src = Qemu::start(&dir, "src", &args);
    src.qmp.stop().unwrap();
    src.fast_migration();
    src.qmp.migrate_set_capabilities(&[("validate-uuid", true)]).unwrap();
    src.qmp.ensure_storable_capabilities(&CapabilityPolicy::default()).unwrap();
    let a = dir.join("a.bin");
    src.save_to(&a);
    src.quit();
    let (info, img) = parse_file(&a, 1 << 20);
    assert_eq!(info.layout.config_subsections.len(), 1 + 1 + 18 + 4 + 16);
    let r = dir.join("r.bin");
    regenerate_file(&r, &info.layout, &img, &info.tail);

    let mut ok = start_destination(&dir, "ok", &args);
    ok.qmp.migrate_incoming(&format!("exec:cat {}", r.display())).unwrap();
    ok.wait_incoming();
    ok.quit();

    let mut other = vm_args("pc", 128, false);
    other.extend(["-uuid".to_string(), "00000000-1111-2222-3333-444444444444".to_string()]);
    let mut bad = start_destination(&dir, "bad", &other);
    bad.qmp.migrate_incoming(&format!("exec:cat {}", r.display())).unwrap();
    let res = bad.qmp.wait_migration(Duration::from_secs(60), Duration::from_millis(20));
    std::thread::sleep(Duration::from_millis(300));
    let err = bad.stderr();
    assert!(res.is_err(), "a different uuid was accepted");
    assert!(err.contains("UUID"), "stderr: {err}");
    let _ = fs::remove_dir_all(&dir);
}

/// A real stream cut at many offsets, or corrupted at random, gives errors, never panics.
#[test]
fn truncated_and_corrupted_real_stream() {
    let dir = workdir("trunc");
    let args = vm_args("pc", 128, true);
    let mut q = Qemu::start(&dir, "src", &args);
    q.wait_guest_filled();
    q.qmp.stop().unwrap();
    q.fast_migration();
    let f = dir.join("a.bin");
    q.save_to(&f);
    q.quit();
    let s = fs::read(&f).unwrap();
    let full = parse_all(&s).unwrap();
    let t = full.tail_offset as usize;
    let mut cuts: Vec<usize> = (0..s.len()).step_by(4093).collect();
    cuts.extend(0..600);
    cuts.extend(t.saturating_sub(300)..t + 300);
    cuts.extend(s.len() - 2000..s.len());
    let mut truncated = 0;
    let mut bad_tail = 0;
    for &cut in &cuts {
        match parse_all(&s[..cut]) {
            Ok(_) => panic!("stream cut at {cut} of {} accepted", s.len()),
            Err(StreamError::Truncated { offset, .. }) => {
                assert_eq!(offset, cut as u64);
                truncated += 1;
            }
            Err(StreamError::BadTail { offset, .. }) => {
                assert!(cut > t && offset <= cut as u64);
                bad_tail += 1;
            }
            Err(e) => panic!("cut {cut}: unexpected {e}"),
        }
    }
    eprintln!("truncation: {} cuts, {truncated} truncated, {bad_tail} bad tail", cuts.len());

    // Random corruption. A guest stream is mostly page data, where flips go unnoticed, so
    // corrupt the stream of a VM that never ran (-S: the BIOS has not touched RAM): it is
    // mostly 9-byte ZERO records, the same in every run. (Letting the BIOS run first made the
    // share of page data depend on how far it got, and the test on the host's load.)
    let mut args = vm_args("pc", 128, false);
    args.push("-S".into());
    let mut q = Qemu::start(&dir, "bios", &args);
    q.qmp.stop().unwrap();
    q.fast_migration();
    let f = dir.join("bios.bin");
    q.save_to(&f);
    q.quit();
    let s = fs::read(&f).unwrap();
    let full = parse_all(&s).unwrap();
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut errors = 0;
    let mut in_ram = 0;
    let rounds = 1000;
    for _ in 0..rounds {
        let mut c = s.clone();
        let at = rnd() as usize % c.len();
        c[at] ^= 1 << (rnd() % 8);
        if at < full.tail_offset as usize {
            in_ram += 1;
        }
        let chunk = 1 + rnd() as usize % 100_000;
        let whole = parse_all(&c);
        let pieces = parse_all_chunked(&c, chunk);
        assert_eq!(
            whole.as_ref().err().map(|e| e.offset()),
            pieces.as_ref().err().map(|e| e.offset())
        );
        if let Err(e) = whole {
            assert!(e.offset() <= c.len() as u64);
            errors += 1;
        }
    }
    eprintln!(
        "corruption: {errors}/{rounds} single-bit flips refused ({in_ram} landed before the tail)"
    );
    assert!(errors * 3 > in_ram, "too few corruptions detected");
    let _ = fs::remove_dir_all(&dir);
}

//! A TCG guest boots with its root disk on a strata export: the golden desktop image is
//! imported, snapshotted, and a linked clone is served over NBD (`-drive
//! file=nbd:unix:...`). The guest reads its boot working set, writes a file, powers off; a
//! new QEMU on the same clone finds the file, and the golden snapshot is unchanged.

use std::sync::Arc;
use std::time::{Duration, Instant};
use strata::fixtures::{Fixtures, GuestMode};
use strata::nbd::Server;
use strata::progress::NoProgress;
use strata::serve::DiskExports;
use strata::store::{InitOptions, Store};
use strata::{disk, Codec};

const CMD: Duration = Duration::from_secs(120);

#[test]
fn guest_boots_from_a_linked_clone_of_the_golden_image_over_nbd() {
    let fx = Fixtures::ensure().expect("build fixtures (scripts/setup.sh first)");
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::init_local(&tmp.path().join("store"), InitOptions::default()).unwrap();
    let t = Instant::now();
    disk::import(&store, "golden", &fx.golden(), Codec::Lz4, &NoProgress).unwrap();
    eprintln!("imported golden image in {:?}", t.elapsed());
    disk::snapshot(&store, "golden", "base").unwrap();
    let t = Instant::now();
    let c = disk::clone(&store, "golden@base", "desk1", false).unwrap();
    eprintln!("linked clone in {:?}", t.elapsed());
    assert_eq!(c.parent.as_deref(), Some("golden@base"));

    let exports = DiskExports::new(store.clone());
    let sock = tmp.path().join("nbd.sock");
    let handle = Server::bind_unix(&sock).unwrap().serve(exports.clone()).unwrap();

    let builder = fx
        .guest()
        .mode(GuestMode::Root)
        .drive_nbd_unix(&sock, "desk1")
        .no_reboot(false)
        .name("desk1");
    let t = Instant::now();
    let mut g = builder.launch().expect("boot from the strata clone");
    let ready = g.ready_line().unwrap().to_string();
    eprintln!("booted from strata clone in {:?}: {ready}", t.elapsed());
    assert!(ready.contains("bootset_rc=0"), "boot working set unreadable: {ready}");
    g.command("write /root/note from-strata", CMD).unwrap();
    g.command("poweroff", CMD).unwrap();
    assert!(g.wait_exit(CMD).unwrap().success());
    drop(g);

    // A new QEMU on the same clone sees the write.
    let mut g2 = builder.clone().name("desk1-again").launch().expect("boot again");
    assert_eq!(g2.command("cat /root/note", CMD).unwrap(), "from-strata");
    g2.kill().unwrap();
    drop(g2);
    handle.shutdown();
    exports.close_all().unwrap();

    // The golden snapshot still reads as the original image; the clone differs from it.
    let out = tmp.path().join("base.raw");
    disk::export(&store, "golden@base", &out, &NoProgress).unwrap();
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(fx.golden()).unwrap(),
        "golden snapshot changed"
    );
    let out2 = tmp.path().join("desk1.raw");
    disk::export(&store, "desk1", &out2, &NoProgress).unwrap();
    assert!(
        std::fs::read(&out2).unwrap() != std::fs::read(fx.golden()).unwrap(),
        "clone write not persisted"
    );
    let rep = store.check(Default::default(), &NoProgress).unwrap();
    assert!(!rep.is_damaged(), "{:?}", rep.problems);
    let _ = Arc::strong_count(&exports);
}

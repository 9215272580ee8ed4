//! QMP client against a real qemu-system-x86_64 7.2.
//!
//! Run: cargo test -p strata --test memory qmp::

use crate::common;

use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use common::*;
use strata::qmp::*;

#[test]
fn missing_socket_names_the_fix() {
    let e = QmpClient::connect("/nonexistent/strata.qmp").err().unwrap();
    assert!(matches!(e, QmpError::NoSocket { .. }));
    assert_eq!(
        e.to_string(),
        "No QMP socket at /nonexistent/strata.qmp: start QEMU with -qmp unix:/nonexistent/strata.qmp,server=on,wait=off"
    );
}

#[test]
fn stale_socket_is_refused() {
    let dir = workdir("qmp-stale");
    let p = dir.join("stale.qmp");
    drop(UnixListener::bind(&p).unwrap()); // the file stays, nobody listens
    let e = QmpClient::connect(&p).err().unwrap();
    assert!(matches!(e, QmpError::Refused { .. }), "{e}");
    assert!(e.to_string().contains("not running"), "{e}");
}

#[test]
fn session_commands_events_and_errors() {
    let dir = workdir("qmp-session");
    let mut q = Qemu::start(&dir, "vm", &vm_args("pc", 128, false));
    let v = q.qmp.version().clone();
    assert_eq!((v.major, v.minor), (7, 2));
    assert!(v.package.contains("Debian"), "{v:?}");
    assert!(q.qmp.server_capabilities().iter().any(|c| c == "oob"));

    // The peer is the QEMU we started, and /proc shows its arguments.
    assert_eq!(q.qmp.peer_pid().unwrap(), q.child.id());
    let cmdline = q.qmp.peer_cmdline().unwrap();
    assert!(cmdline[0].ends_with("qemu-system-x86_64"), "{cmdline:?}");
    assert!(cmdline.iter().any(|a| a == "-qmp"));

    // Errors carry QEMU's class and description.
    match q.qmp.execute("no-such-command", None) {
        Err(QmpError::Command { class, desc, .. }) => {
            assert_eq!(class, "CommandNotFound");
            assert!(desc.contains("no-such-command"), "{desc}");
        }
        other => panic!("{other:?}"),
    }
    let e = q.qmp.migrate_set_capabilities(&[("no-such-cap", true)]).unwrap_err();
    assert!(matches!(e, QmpError::Command { ref class, .. } if class == "GenericError"), "{e}");

    // Machine and memory.
    assert_eq!(q.qmp.machine_type().unwrap(), "pc-i440fx-7.2");
    let m = q.qmp.current_machine().unwrap();
    assert_eq!(m.alias.as_deref(), Some("pc"));
    assert!(q.qmp.query_machines().unwrap().iter().any(|m| m.name == "pc-q35-7.2"));
    assert_eq!(q.qmp.memory_size_summary().unwrap().base_memory, 128 << 20);
    let blocks = q.qmp.ram_blocks().unwrap();
    let ram = blocks.iter().find(|b| b.name == "pc.ram").unwrap();
    assert_eq!((ram.used, ram.page_size), (128 << 20, 4096));
    assert!(blocks.iter().any(|b| b.name == "pc.bios"));

    // Run state and events.
    assert!(q.qmp.query_status().unwrap().running);
    q.qmp.stop().unwrap();
    let ev = q.qmp.wait_event("STOP", Duration::from_secs(10)).unwrap();
    assert!(ev.seconds > 0);
    assert_eq!(q.qmp.query_status().unwrap().status, "paused");
    q.qmp.cont().unwrap();
    q.qmp.wait_event("RESUME", Duration::from_secs(10)).unwrap();

    // MIGRATION events with the events capability; a failing migration reports QEMU's error.
    q.qmp.migrate_set_capabilities(&[("events", true)]).unwrap();
    q.qmp.migrate(&format!("unix:{}", dir.join("nobody-listens.sock").display())).unwrap_or(());
    let r = q.qmp.wait_migration(Duration::from_secs(30), Duration::from_millis(20));
    match r {
        Err(QmpError::MigrationFailed { status, desc }) => {
            assert_eq!(status, "failed");
            assert!(!desc.is_empty());
            eprintln!("failed migration: {desc}");
        }
        Err(QmpError::Command { desc, .. }) => eprintln!("migrate refused at once: {desc}"),
        other => panic!("{other:?}"),
    }
    q.fast_migration();
    q.qmp.migrate("exec:cat > /dev/null").unwrap();
    let info = q.qmp.wait_migration(Duration::from_secs(60), Duration::from_millis(20)).unwrap();
    assert!(info.ram.unwrap().total >= 128 << 20);
    let mut statuses = Vec::new();
    let _ = q.qmp.poll_events(Duration::from_millis(200)).unwrap();
    for e in q.qmp.take_events() {
        if e.name == "MIGRATION" {
            statuses.push(e.data["status"].as_str().unwrap().to_owned());
        }
    }
    assert!(statuses.contains(&"completed".to_string()), "{statuses:?}");
    q.quit();
}

/// QEMU serves one QMP client per socket: a second one gets no greeting and times out.
#[test]
fn second_client_times_out_cleanly() {
    let dir = workdir("qmp-second");
    let q = Qemu::start(&dir, "vm", &vm_args("pc", 64, false));
    let t = Instant::now();
    let e =
        QmpClient::connect_timeout(dir.join("vm.qmp"), Duration::from_millis(800)).err().unwrap();
    assert!(matches!(e, QmpError::Timeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(e.to_string().contains("another client holds the monitor"), "{e}");
    q.quit();
}

/// A frozen QEMU makes a command time out; once it thaws, the late reply is dropped and the
/// session keeps working.
#[test]
fn timeout_then_recovery() {
    let dir = workdir("qmp-freeze");
    let mut q = Qemu::start(&dir, "vm", &vm_args("pc", 64, false));
    let pid = q.child.id() as i32;
    q.qmp.set_timeout(Duration::from_millis(500));
    // SAFETY: signals to the QEMU child this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let e = q.qmp.query_status().unwrap_err();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(matches!(e, QmpError::Timeout { .. }), "{e}");
    q.qmp.set_timeout(Duration::from_secs(10));
    assert!(q.qmp.query_status().unwrap().running);
    assert_eq!(q.qmp.machine_type().unwrap(), "pc-i440fx-7.2");
    q.quit();
}

/// `pipeline` sends several commands in one write; the typed wrappers then get the read-ahead
/// replies in order (a command's own error included), and a command out of order drops them
/// and goes to QEMU.
#[test]
fn pipelined_replies_in_order() {
    let dir = workdir("qmp-pipeline");
    let mut q = Qemu::start(&dir, "vm", &vm_args("pc", 64, false));
    let machine = serde_json::json!({ "path": "/machine", "property": "type" });
    q.qmp
        .pipeline(&[
            ("query-status", None),
            ("no-such-command", None),
            ("qom-get", Some(machine.clone())),
            ("stop", None),
        ])
        .unwrap();
    // `stop` already ran: the pipelined query-status reply predates it, the fresh one does not.
    assert!(q.qmp.query_status().unwrap().running);
    match q.qmp.execute("no-such-command", None) {
        Err(QmpError::Command { class, .. }) => assert_eq!(class, "CommandNotFound"),
        other => panic!("{other:?}"),
    }
    assert_eq!(q.qmp.machine_type().unwrap(), "pc-i440fx-7.2");
    q.qmp.stop().unwrap();
    assert!(!q.qmp.query_status().unwrap().running);
    // Read ahead, then asked out of order: the replies are dropped, QEMU answers afresh.
    q.qmp.pipeline(&[("query-status", None), ("cont", None)]).unwrap();
    assert_eq!(q.qmp.machine_type().unwrap(), "pc-i440fx-7.2");
    assert!(q.qmp.query_status().unwrap().running, "cont ran in the pipeline");
    // Sent without waiting: the replies are read by the next command, in order, and events
    // that came with them are kept; a send right after another reads the first one's replies.
    q.qmp.send_pipeline(&[("query-status", None), ("stop", None)]).unwrap();
    q.qmp.send_pipeline(&[("query-status", None), ("cont", None)]).unwrap();
    assert!(
        !q.qmp.query_status().unwrap().running,
        "the second query-status ran after the first batch's stop"
    );
    q.qmp.execute("cont", None).unwrap();
    assert!(
        q.qmp.wait_event("STOP", Duration::from_secs(5)).is_ok(),
        "the STOP event read with the replies is kept"
    );
    assert!(q.qmp.query_status().unwrap().running);
    // Unread replies are read (and dropped) by discard_pipelined: the next command gets its own.
    q.qmp.send_pipeline(&[("stop", None), ("query-status", None)]).unwrap();
    q.qmp.discard_pipelined();
    assert!(
        !q.qmp.query_status().unwrap().running,
        "stop ran, and the stale query-status reply was dropped"
    );
    q.quit();
}

/// Enabling each capability strata cannot store makes the check refuse it, by name.
#[test]
fn capability_refusal_against_qemu() {
    let dir = workdir("qmp-caps");
    let mut q = Qemu::start(&dir, "vm", &vm_args("pc", 64, false));
    let policy = CapabilityPolicy::default();
    q.qmp.ensure_storable_capabilities(&policy).unwrap();
    check_capabilities(&q.qmp.query_migrate_capabilities().unwrap()).unwrap();
    for cap in [
        "xbzrle",
        "compress",
        "postcopy-ram",
        "block",
        "multifd",
        "return-path",
        "x-ignore-shared",
        "dirty-bitmaps",
    ] {
        q.qmp
            .migrate_set_capabilities(&[(cap, true)])
            .unwrap_or_else(|e| panic!("enable {cap}: {e}"));
        let caps = q.qmp.query_migrate_capabilities().unwrap();
        assert!(caps.iter().any(|c| c.capability == cap && c.state), "{cap} not enabled");
        let e = check_capabilities(&caps).unwrap_err();
        assert_eq!(e.refused.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), vec![cap]);
        let qe = q.qmp.ensure_storable_capabilities(&policy).unwrap_err();
        assert!(qe.to_string().contains(cap), "{qe}");
        if cap == "multifd" {
            check_capabilities_with(&caps, &CapabilityPolicy { allow_multifd: true }).unwrap();
        }
        q.qmp.migrate_set_capabilities(&[(cap, false)]).unwrap();
        q.qmp.ensure_storable_capabilities(&policy).unwrap();
    }
    // Harmless ones pass.
    q.qmp.migrate_set_capabilities(&[("events", true), ("auto-converge", true)]).unwrap();
    q.qmp.ensure_storable_capabilities(&policy).unwrap();
    // QEMU itself refuses some combinations; the error carries its text.
    let e = q.qmp.migrate_set_capabilities(&[("background-snapshot", true)]).unwrap_err();
    assert!(e.to_string().contains("not compatible with auto-converge"), "{e}");
    q.qmp
        .migrate_set_capabilities(&[("auto-converge", false), ("background-snapshot", true)])
        .unwrap();
    q.qmp.ensure_storable_capabilities(&policy).unwrap();
    q.quit();
}

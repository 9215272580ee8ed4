//! Withdrawn exports end their connections: an export that answers ESHUTDOWN gets the reply
//! out and the connection closed, and a strata disk removed or reverted with `force` closes
//! every connection to it at once, idle ones included, so the daemon's volume (and its lock)
//! goes with them. Without `force` both are refused while clients are connected.

use crate::common;

use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata::nbd::proto::*;
use strata::nbd::{Export, ExportError};
use strata::store::{InitOptions, Store};

/// Reads succeed, writes answer ESHUTDOWN.
struct Withdrawn;

impl Export for Withdrawn {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read(&self, _: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        buf.fill(7);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), ExportError> {
        Err(ExportError::Shutdown { op: "write" })
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
}

/// Wait until the server closes `c`'s connection (EOF), failing after `secs`.
fn closed_within(c: &mut Client, secs: u64) {
    c.s.set_read_timeout(Some(Duration::from_secs(secs))).unwrap();
    let mut b = [0u8; 1];
    match c.s.read(&mut b) {
        Ok(0) => {}
        Ok(_) => panic!("unexpected bytes from the server"),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server did not close the connection within {secs} s: {e}"),
    }
}

#[test]
fn an_eshutdown_reply_ends_the_connection() {
    let s = TestServer::start(Exports::new().add("w", Arc::new(Withdrawn)));
    for structured in [false, true] {
        let mut c = Client::connect(&s.sock, "w", structured, false).unwrap();
        assert_eq!(c.read(0, 512).unwrap(), vec![7u8; 512], "reads still work");
        let h = c.send(Command::Write, 0, 0, 512, &[1u8; 512]).unwrap();
        let (got, reply) = c.recv().unwrap();
        assert_eq!(got, h);
        assert!(matches!(reply, Reply::Error(108, _)), "ESHUTDOWN expected: {reply:?}");
        closed_within(&mut c, 5);
    }
}

fn disk_server() -> (TestServer, Arc<strata::serve::DiskExports>, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::init_local(&tmp.path().join("store"), InitOptions::default()).unwrap();
    strata::disk::create(&store, "desk", 4 << 20).unwrap();
    let exports = strata::serve::DiskExports::new(store);
    (TestServer::start(exports.clone()), exports, tmp)
}

#[test]
fn a_forced_remove_closes_idle_and_busy_connections() {
    let (s, exports, _tmp) = disk_server();
    let mut busy = Client::connect(&s.sock, "desk", true, false).unwrap();
    let mut idle = Client::connect(&s.sock, "desk", true, false).unwrap();
    busy.write(0, &pattern(1, 65536), 0).unwrap();
    assert_eq!(exports.held("desk"), Some(2));
    let e = exports.remove("desk", false).unwrap_err();
    assert!(
        e.to_string().contains("has 2 NBD client(s) connected")
            && e.to_string().contains("--force"),
        "{e}"
    );
    assert!(strata::disk::info(exports.store(), "desk").is_ok(), "a refused remove keeps the disk");

    let t = Instant::now();
    exports.remove("desk", true).unwrap();
    closed_within(&mut idle, 5);
    // The busy client may get its next request refused with ESHUTDOWN before the close.
    match busy.send(Command::Write, 0, 0, 4096, &[2u8; 4096]) {
        Ok(_) => match busy.recv() {
            Ok((_, r)) => assert!(matches!(r, Reply::Error(108, _)), "{r:?}"),
            Err(_) => {}
        },
        Err(_) => {}
    }
    closed_within(&mut busy, 5);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(exports.held("desk"), None);
    assert!(strata::disk::info(exports.store(), "desk").is_err(), "removed");
    // The connections and the volume are gone: the name can be created and served again.
    strata::disk::create(exports.store(), "desk", 1 << 20).unwrap();
    let mut again = Client::connect(&s.sock, "desk", true, false).unwrap();
    assert_eq!(again.read(0, 4096).unwrap(), vec![0u8; 4096]);
    assert_eq!(exports.held("desk"), Some(1));
}

#[test]
fn a_forced_revert_closes_connections_and_serves_the_old_content() {
    let (s, exports, _tmp) = disk_server();
    let mut c = Client::connect(&s.sock, "desk", true, false).unwrap();
    let old = pattern(3, 65536);
    c.write(0, &old, 0).unwrap();
    c.simple(Command::Flush, 0, 0, 0).unwrap();
    // Cut the disk as it is, as `vm snapshot` does, then overwrite it.
    let cuts = exports.cut(&["desk".to_string()]).unwrap();
    let ses = exports.store().session();
    let f = cuts[0].fold(&ses).unwrap();
    c.write(0, &pattern(4, 65536), 0).unwrap();
    let e = exports.revert("desk", f.root, &f.meta, false).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    exports.revert("desk", f.root, &f.meta, true).unwrap();
    drop(ses);
    closed_within(&mut c, 5);
    let mut c = Client::connect(&s.sock, "desk", true, false).unwrap();
    assert_eq!(c.read(0, 65536).unwrap(), old, "the disk reads as it was at the cut");
}

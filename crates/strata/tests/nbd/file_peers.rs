//! The NBD server against real clients: qemu-img, qemu-io, nbdinfo, nbdcopy, fio's nbd
//! engine, nbdfuse + losetup + mkfs.ext4 + fsck, and QEMU's block layer, on a sparse file
//! export. The checks live in `peers.rs` (shared with `disk_peers.rs`); every test
//! checks data, not just exit codes. Needs qemu-utils, libnbd-bin, fio, nbdfuse, e2fsprogs
//! (and root for losetup/mount).

use crate::common;
use crate::peers;

use std::sync::Arc;

use common::*;

/// A server with a sparse file export "disk" of `size` bytes (returned path: the file behind
/// it) and a read-only 1 MiB export "ro" holding `pattern(77, 1 MiB)`.
fn server(size: u64) -> (TestServer, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.raw");
    let disk = Arc::new(FileExport::create(&path, size));
    let ro_path = dir.path().join("ro.raw");
    std::fs::write(&ro_path, pattern(77, 1 << 20)).unwrap();
    let exports =
        Exports::new().add("disk", disk).add("ro", Arc::new(FileExport::open(&ro_path, true)));
    let s = TestServer::start(exports);
    let keep = s.path("disk.raw");
    std::fs::rename(&path, &keep).unwrap(); // the export keeps its descriptor; tests read the file here
    (s, keep)
}

peer_tests!(server);

//! strata DISKS over NBD against real clients: the same checks as `file_peers.rs` (qemu-img,
//! qemu-io, nbdinfo, nbdcopy, fio's nbd engine, nbdfuse + losetup + mkfs.ext4 + fsck, QEMU's
//! block layer; shared in `peers.rs`), but the export is a copy-on-write strata
//! disk (`strata::serve::DiskExports`) instead of a plain file. "Reading the disk directly"
//! means: flush and close every open volume (folding its log into the block map), then read
//! the disk through a freshly opened `Volume`, so each check also covers compaction and
//! reopening.

use crate::common;
use crate::peers;

use std::sync::Arc;

use common::*;
use strata::store::{InitOptions, Store};

/// A strata store with a disk "disk" of `size` bytes and a read-only snapshot export "ro"
/// (`ro` is served under the name of a snapshot holding `pattern(77, 1 MiB)`), served over NBD.
struct DiskBacking {
    store_dir: std::path::PathBuf,
    exports: Arc<strata::serve::DiskExports>,
}

/// Flush and close every open volume, then read the whole disk through a freshly opened one
/// (through a fresh store when the serving store has let go of its metadata lock).
impl peers::Backing for DiskBacking {
    fn contents(&self) -> Vec<u8> {
        self.exports.close_all().unwrap();
        let store =
            Store::open_local(&self.store_dir).unwrap_or_else(|_| self.exports.store().clone());
        let v = strata::disk::volume::Volume::open(&store, "disk").unwrap();
        let mut buf = vec![0u8; v.size() as usize];
        v.read(0, &mut buf).unwrap();
        buf
    }
}

fn server(size: u64) -> (TestServer, DiskBacking) {
    let tmp = tempfile::tempdir().unwrap();
    let store_dir = tmp.path().join("store");
    let store = Store::init_local(&store_dir, InitOptions::default()).unwrap();
    strata::disk::create(&store, "disk", size).unwrap();
    let ro_src = tmp.path().join("ro.raw");
    std::fs::write(&ro_src, pattern(77, 1 << 20)).unwrap();
    strata::disk::import(
        &store,
        "robase",
        &ro_src,
        strata::Codec::Lz4,
        &strata::progress::NoProgress,
    )
    .unwrap();
    strata::disk::snapshot(&store, "robase", "ro").unwrap();
    let exports = strata::serve::DiskExports::new(store);
    // The server owns the store's temporary directory, so it lives exactly as long.
    let s = TestServer::start(Arc::new(Alias(exports.clone(), tmp)));
    (s, DiskBacking { store_dir, exports })
}

/// Serves the snapshot `robase@ro` also under the short name `ro` the shared tests use.
struct Alias(Arc<strata::serve::DiskExports>, #[allow(dead_code)] tempfile::TempDir);
impl strata::nbd::ExportSet for Alias {
    fn list(&self) -> Vec<strata::nbd::ExportInfo> {
        let mut l = self.0.list();
        l.retain(|e| e.name == "disk" || e.name == "robase@ro");
        for e in l.iter_mut() {
            if e.name == "robase@ro" {
                e.name = "ro".into();
            }
        }
        l
    }
    fn open(&self, name: &str) -> Result<Arc<dyn strata::nbd::Export>, strata::nbd::OpenError> {
        self.0.open(if name == "ro" { "robase@ro" } else { name })
    }
}

peer_tests!(server);

//! Differential test for strata DISKS: a copy-on-write disk served by
//! `strata::serve::DiskExports` (imported from the same initial image, with log compactions at
//! random points) against `qemu-nbd` on a raw file; the shared body is
//! `differential.rs` (also run on a file export by `file_differential.rs`).

use crate::common;
use crate::differential;

use std::path::Path;

use common::*;
use differential::{run_sequence, Ours};

fn strata_disk(dir: &Path, image: &Path) -> Ours {
    let store = strata::store::Store::init_local(&dir.join("store"), Default::default()).unwrap();
    strata::disk::import(&store, "d", image, strata::Codec::Lz4, &strata::progress::NoProgress)
        .unwrap();
    let exports = strata::serve::DiskExports::new(store);
    let server = TestServer::start(exports.clone());
    let compact = move || match exports.volume("d") {
        Some(v) => v.compact().map(|_| ()).map_err(|e| e.to_string()),
        None => Ok(()),
    };
    Ours { server, compact: Some(Box::new(compact)) }
}

#[test]
fn disk_differential_against_qemu_nbd_structured() {
    require_tool("qemu-nbd", "qemu-utils");
    for seed in [11, 12] {
        run_sequence(seed, true, 1500, strata_disk);
    }
}

#[test]
fn disk_differential_against_qemu_nbd_simple_replies() {
    require_tool("qemu-nbd", "qemu-utils");
    run_sequence(13, false, 1500, strata_disk);
}

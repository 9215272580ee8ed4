//! Differential test of the NBD server on a sparse file against `qemu-nbd` on a raw file:
//! the shared body is `differential.rs` (also run on strata disks by
//! `disk_differential.rs`).

use crate::common;
use crate::differential;

use std::path::Path;
use std::sync::Arc;

use common::*;
use differential::{run_sequence, Ours};

fn file_export(_dir: &Path, image: &Path) -> Ours {
    Ours {
        server: TestServer::start(
            Exports::new().add("d", Arc::new(FileExport::open(image, false))),
        ),
        compact: None,
    }
}

#[test]
fn differential_against_qemu_nbd_structured() {
    require_tool("qemu-nbd", "qemu-utils");
    for seed in [1, 2] {
        run_sequence(seed, true, 1500, file_export);
    }
}

#[test]
fn differential_against_qemu_nbd_simple_replies() {
    require_tool("qemu-nbd", "qemu-utils");
    run_sequence(3, false, 1500, file_export);
}

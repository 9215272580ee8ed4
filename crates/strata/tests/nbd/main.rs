//! The NBD server end to end: protocol checks with a strict client, differential runs against
//! `qemu-nbd`, and real peers (qemu-img, qemu-io, libnbd tools, fio, nbdfuse, QEMU), each on a
//! sparse file export and on a copy-on-write strata disk, and withdrawn exports closing their
//! connections.
//!
//! One test binary for the area (fewer binaries to link); each module holds one subject.

mod common;
#[macro_use]
mod peers;
mod differential;
mod disk_differential;
mod disk_peers;
mod file_differential;
mod file_peers;
mod protocol;
mod revoke;

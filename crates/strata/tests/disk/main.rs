//! Disks under stress: the harness that cuts power at every sync point of an NBD workload, and
//! boot traces and working sets on a bucket shared by several hosts.
//!
//! One test binary for the area (fewer binaries to link); each module holds one subject.

#[path = "../nbd/common.rs"]
mod common;

mod boot_storm;
mod powercut;

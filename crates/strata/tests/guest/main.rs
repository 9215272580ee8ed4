//! The Linux test guests (`strata::fixtures`) under real QEMU: the fixtures themselves, a root disk
//! served by strata over NBD, and VM memory checkpoints of the running guest.
//!
//! One test binary for the area (fewer binaries to link); each module holds one subject.

mod disk;
mod fixtures;
mod memory;

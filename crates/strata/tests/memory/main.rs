//! VM memory against a real qemu-system-x86_64 7.2 (TCG): the QMP client, the migration stream
//! parser and generator, checkpoints saved to and restored from the store (locally and on S3),
//! deltas against a base checkpoint, and how saves and restores fail.
//!
//! One test binary for the area (fewer binaries to link); each module holds one subject.

mod common;
mod delta;
mod failures;
mod qmp;
mod roundtrip;
mod s3;
mod stream;

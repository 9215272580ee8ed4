//! VM memory on the chunk store: QEMU migration streams received, stored page by page
//! (deduplicated, compressed) and regenerated for restore.
//!
//! `stream` parses and generates QEMU 7.2 precopy streams; the store side (save, checkpoint,
//! restore) builds on it.

pub mod stream;

//! VM memory on the chunk store: QEMU migration streams received, stored page by page
//! (deduplicated, compressed) and regenerated for restore.
//!
//! `stream` parses and generates QEMU 7.2 precopy streams; the store side (save, checkpoint,
//! restore) builds on it.

pub mod catalog;
pub mod codec_choice;
pub mod delta;
pub mod error;
pub mod ingest;
pub mod launch;
pub mod manifest;
pub mod restore;
pub mod save;
pub mod stream;

//! VM memory on the chunk store: QEMU migration streams received, stored page by page
//! (deduplicated, compressed) and regenerated for restore.
//!
//! `stream` parses and generates QEMU 7.2 precopy streams; the store side (save, checkpoint,
//! restore) builds on it.

pub mod catalog;
pub mod codec_choice;
pub mod delta;
pub mod disks;
pub mod error;
pub mod ingest;
pub mod launch;
pub mod manifest;
pub mod restore;
pub mod save;
pub mod stream;

/// Keep freed heap memory for reuse instead of handing it back to the kernel at once. A process
/// that saves or restores memory calls this first, before it starts any thread.
///
/// A save moves ~1 MiB batch buffers, frame outputs and pack buffers between threads. With
/// glibc's defaults, blocks that size are mmapped or trimmed on free, so the next one is fresh
/// memory: a 128 MiB save to S3 would take ~23,000 page faults (each zeroed and charged to
/// the cgroup), ~5% of two cores. With these thresholds allocations under 32 MiB come from the
/// heap, and only more than 64 MiB of free space at a heap's top is trimmed, so an idle daemon
/// still shrinks after a large save.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; the caller has started no thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}

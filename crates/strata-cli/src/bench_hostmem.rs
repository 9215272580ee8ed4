//! Host memory on a benchmark host that hands its free memory back to its own hypervisor.
//!
//! The machines these benchmarks run on are VMs with free page reporting: memory that has
//! been free for about a second is reported to the outer hypervisor, which drops it, and the
//! next process to touch it pays an outer fault per page. Touching 128 MiB of such memory
//! costs ~0.45 s of system time, against ~0.02 s for memory freed a moment before
//! (`probe` measures both in every run). A restore's target QEMU touches its guest's RAM as
//! the pages arrive, so a restore that happens to land on reported memory runs 0.3-0.4 s
//! slower at 128 MiB, whichever method it is: more than the margins being measured. It is
//! luck which one does (most often the first after a pause). A bare-metal KVM host, which is
//! what strata is for, has no such cost.
//!
//! `warm` touches and frees memory just before a timed save or restore, outside its clock and
//! for every method alike, so the kernel's free lists hold backed pages for whichever process
//! allocates next. The kernel reports free memory to the hypervisor a share at a time, every
//! ~2 s, so a warm of N MiB does not keep N MiB backed until the step uses it. Since session
//! 20 the warm is 4x the guest's RAM (capped at 2 GiB) + 64 MiB: with 1x, the one restore
//! that followed a save directly (no stream file freed just before it) ran 1.2-1.4x slower
//! at every size, its target QEMU at 5-10x the system time; with 4x it did not (session 19's
//! trial, `docs/results/README.md`). `bench save-restore --remote --no-warm` measures
//! without it.

use std::time::{Duration, Instant};

/// How many times the guest's RAM is warmed: the kernel hands back a share of what was freed
/// on every pass, so the warm must exceed what the step will allocate.
const WARM_FACTOR: u32 = 4;

/// Largest warm, before the extra: on a 2 GiB guest, 2 GiB (the warm itself takes ~1-6 s).
pub const WARM_CAP_MIB: u32 = 2048;

/// Extra memory warmed beyond the guest's RAM (buffers, page cache of what the step writes).
const WARM_EXTRA_MIB: u32 = 64;

/// MiB to warm before a timed step of a guest of `mem_mib`; 0 when warming is off.
pub fn warm_mib(mem_mib: u32, on: bool) -> u32 {
    if on {
        (mem_mib.saturating_mul(WARM_FACTOR)).min(WARM_CAP_MIB) + WARM_EXTRA_MIB
    } else {
        0
    }
}

/// Touch `mib` MiB of fresh anonymous memory (one byte per 4 KiB page, huge pages allowed) and
/// free it; seconds taken. Nothing happens (0 s) for 0 or if the mapping fails.
pub fn touch(mib: u32) -> f64 {
    if mib == 0 {
        return 0.0;
    }
    let len = (mib as usize) << 20;
    let t = Instant::now();
    // SAFETY: a private anonymous mapping of `len` bytes, written only inside its bounds and
    // unmapped before returning; no reference to it escapes.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return 0.0;
        }
        libc::madvise(p, len, libc::MADV_HUGEPAGE);
        let b = p as *mut u8;
        for off in (0..len).step_by(4096) {
            std::ptr::write_volatile(b.add(off), 1);
        }
        libc::munmap(p, len);
    }
    t.elapsed().as_secs_f64()
}

/// How long the host is left alone after a warm, before the timed step starts. In session 37
/// a step that began right after its warm (30-70 ms of touching, then the `munmap`) sometimes
/// found the whole host slow for its first ~15-25 ms: QEMU answered a save's first QMP
/// queries and the S3 server a listing in 14-18 ms instead of ~2 (128 MiB idle guest, 2 of 5
/// rounds; never with `--no-warm`). The cause was not pinned down (the kernel's work on the
/// memory just freed is the suspect); any method could draw it, and in those rounds it was
/// strata, whose clock starts with those queries. With 150 ms of quiet between the warm and
/// the step, 6 of 6 rounds had set-ups of 2.8-5.7 ms.
pub const SETTLE_MS: u64 = 150;

/// [`touch`] `mib` MiB, then wait [`SETTLE_MS`]: what runs before every timed step.
pub fn warm_host(mib: u32) {
    if mib > 0 {
        touch(mib);
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
    }
}

/// What touching fresh memory costs on this host, in ms per MiB: after a pause (memory the
/// host may have handed back) and right after a warm.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Probe {
    pub after_pause_ms_per_mib: f64,
    pub right_after_free_ms_per_mib: f64,
}

pub fn probe() -> Probe {
    const MIB: u32 = 64;
    std::thread::sleep(Duration::from_millis(2500));
    let cold = touch(MIB);
    let warm = touch(MIB);
    Probe {
        after_pause_ms_per_mib: cold * 1e3 / MIB as f64,
        right_after_free_ms_per_mib: warm * 1e3 / MIB as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_is_capped_and_off_means_zero() {
        assert_eq!(warm_mib(128, true), 512 + WARM_EXTRA_MIB);
        assert_eq!(warm_mib(512, true), 2048 + WARM_EXTRA_MIB);
        assert_eq!(warm_mib(1024, true), WARM_CAP_MIB + WARM_EXTRA_MIB);
        assert_eq!(warm_mib(2048, true), WARM_CAP_MIB + WARM_EXTRA_MIB);
        assert_eq!(warm_mib(2048, false), 0);
        assert_eq!(touch(0), 0.0);
        assert!(touch(4) > 0.0);
    }
}

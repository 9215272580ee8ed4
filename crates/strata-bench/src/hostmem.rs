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
//! ~2 s, so a warm of N MiB does not keep N MiB backed until the step uses it: the warm is 4x
//! the guest's RAM (capped at 2 GiB) + 64 MiB. With only 1x, a restore that follows a save
//! directly (no stream file freed just before it) runs 1.2-1.4x slower at every size, its
//! target QEMU at 5-10x the system time; with 4x it does not (`docs/results/README.md`).
//! `strata-bench save-restore --remote --no-warm` measures without it.
//!
//! The warmed memory is a pool held between steps ([`warm_host`] frees it for a step,
//! [`retake`] takes it back as the step's clock stops). Reporting has a cost of its own here:
//! while a pass runs, the outer VMM does not serve this VM's disk, and passes caused by freed
//! surplus, ~2 s apart until all of it is reported, would otherwise land in later steps and
//! stall the storage host's fsyncs (see [`QUIET_MS`]).

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
    let t = Instant::now();
    match map_touched(mib) {
        Some(p) => unmap(p),
        None => return 0.0,
    }
    t.elapsed().as_secs_f64()
}

/// How long the host is left alone after a warm, before the timed step starts. A step that
/// begins right after its warm (30-70 ms of touching, then the `munmap`) sometimes finds the
/// whole host slow for its first ~15-25 ms: QEMU answers a save's first QMP queries and the
/// S3 server a listing in 14-18 ms instead of ~2 (128 MiB idle guest, 2 of 5 rounds; never
/// with `--no-warm`), probably the kernel's work on the memory just freed. Any method can
/// draw it; strata's clock starts with those queries. With 150 ms of quiet between the warm
/// and the step, set-ups take 2.8-5.7 ms.
pub const SETTLE_MS: u64 = 150;

/// How long the host is left alone, with the warm pool held, before the pool is released for
/// a timed step. The kernel reports free memory to the hypervisor in passes, the first ~2 s
/// after a free and then every ~2 s while unreported blocks remain, and while a pass runs the
/// outer VMM stops serving this VM's disk: on these hosts an fsync of 1 MiB that takes ~2 ms
/// stalls 100 / 84 / 67 / 33 ms at 1.9 / 4.1 / 6.3 / 8.4 s after 2 GiB is freed, and 7 / 16
/// ms after 576 MiB. Memory freed before a step (the warm's surplus, a QEMU that exited)
/// leaves such passes running into later steps, whichever method they are: strata's last
/// objects' fsyncs at the storage host then wait 45-80 ms (not 1-3) and its 128 MiB idle
/// save takes 0.22-0.26 s instead of 0.16, while the streams' one fsync per save is seldom
/// caught. Waiting with the pool held lets any pass that is due run here, off the clock, over
/// little free memory.
pub const QUIET_MS: u64 = 2200;

/// The warmed memory, held between timed steps (see [`warm_host`] and [`retake`]).
struct Pool {
    addr: usize,
    len: usize,
}

static POOL: std::sync::Mutex<Option<Pool>> = std::sync::Mutex::new(None);

/// Map and touch `mib` MiB (one byte per 4 KiB page, huge pages allowed); None if it fails.
fn map_touched(mib: u32) -> Option<Pool> {
    let len = (mib as usize) << 20;
    // SAFETY: a private anonymous mapping of `len` bytes, written only inside its bounds; it
    // is unmapped only by `unmap`, and no reference to it escapes.
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
            return None;
        }
        libc::madvise(p, len, libc::MADV_HUGEPAGE);
        let b = p as *mut u8;
        for off in (0..len).step_by(4096) {
            std::ptr::write_volatile(b.add(off), 1);
        }
        Some(Pool { addr: p as usize, len })
    }
}

fn unmap(p: Pool) {
    // SAFETY: `p` came from `map_touched` and is unmapped once (it is consumed).
    unsafe { libc::munmap(p.addr as *mut libc::c_void, p.len) };
}

/// Before every timed step (outside its clock, for every method alike): hold `mib` MiB of
/// touched memory (the pool [`retake`] took after the last step, or a fresh one), wait
/// [`QUIET_MS`], free it, and wait [`SETTLE_MS`]. Whichever process allocates next gets those
/// backed pages, and no report of free memory falls inside the step unless it lasts ~2 s.
pub fn warm_host(mib: u32) {
    if mib == 0 {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if pool.as_ref().is_some_and(|p| p.len != (mib as usize) << 20) {
        unmap(pool.take().expect("checked"));
    }
    if pool.is_none() {
        *pool = map_touched(mib);
    }
    std::thread::sleep(Duration::from_millis(QUIET_MS));
    if let Some(p) = pool.take() {
        unmap(p);
    }
    drop(pool);
    std::thread::sleep(Duration::from_millis(SETTLE_MS));
}

/// Right after a timed step's clock stops: take the warm pool back (`mib` MiB, as passed to
/// [`warm_host`]). The kernel hands out unreported free pages first, so this takes back what
/// the step did not use, before the report due ~2 s after the pool's release finds it free.
pub fn retake(mib: u32) {
    if mib == 0 {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if pool.is_none() {
        *pool = map_touched(mib);
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

    fn held() -> Option<usize> {
        POOL.lock().unwrap().as_ref().map(|p| p.len)
    }

    #[test]
    fn the_pool_is_held_between_steps_and_freed_for_them() {
        retake(0);
        assert_eq!(held(), None, "warming off holds nothing");
        retake(8);
        assert_eq!(held(), Some(8 << 20));
        retake(8);
        assert_eq!(held(), Some(8 << 20), "a held pool is kept");
        let t = Instant::now();
        warm_host(8);
        assert!(t.elapsed() >= Duration::from_millis(QUIET_MS + SETTLE_MS));
        assert_eq!(held(), None, "the step gets the pool's pages");
        retake(16);
        warm_host(4);
        assert_eq!(held(), None, "a pool of another size is replaced, then freed");
    }
}

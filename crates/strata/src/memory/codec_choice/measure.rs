//! Speed_Comp and Rate: one frame compressed with one codec, timed by the thread's CPU clock
//! with a warmed per-level zstd context, and the cores the pool can really use.

use super::*;

/// CPU time of the calling thread, in nanoseconds (wall clock if unavailable).
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc == 0 {
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    } else {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Cores compression can use while a QEMU on this host migrates (its migration thread keeps
/// one busy): `cores - 1`, at least 1.
pub fn usable_cores(source_is_local: bool) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if source_is_local {
        cores.saturating_sub(1).max(1)
    } else {
        cores
    }
}

/// Compress `raw` with `codec` on this thread, timed by the thread's CPU clock. Output size
/// is `raw.len()` when the codec does not pay (the store keeps such frames raw).
///
/// Only the compression is timed: a zstd context new to this thread (not taken warm from the
/// pool, `codec::with_zstd_compressor`) is first warmed with one untimed compression of `raw`
/// (its workspace is allocated, and page-faulted, on first use). Timing the first use made
/// zstd:1 look up to 2x slower in a save's first samples, which handed the first 130-260
/// frames of a 128 MiB save to lz4.
pub fn measure_once(codec: Codec, raw: &[u8]) -> Measure {
    measure_keep(codec, raw).0
}

/// [`measure_once`], also handing back what the store would keep for `raw` under `codec`:
/// the compressed bytes, or None when they do not pay (the store keeps such frames raw, as
/// [`Codec::compress`] decides). A sampled frame is then stored from its sample instead of
/// being compressed a second time.
pub fn measure_keep(codec: Codec, raw: &[u8]) -> (Measure, Option<Vec<u8>>) {
    let (out, nanos): (Option<Vec<u8>>, u64) = match codec {
        Codec::Zstd(level) => crate::codec::with_zstd_compressor(level, |c, fresh| {
            if fresh {
                let _ = crate::codec::zstd_compress(c, level, raw);
            }
            let t = thread_cpu_ns();
            let z = crate::codec::zstd_compress(c, level, raw);
            (z, thread_cpu_ns().saturating_sub(t))
        })
        .unwrap_or((None, 1)),
        other => {
            let t = thread_cpu_ns();
            let z = other.compress(raw);
            (z, thread_cpu_ns().saturating_sub(t))
        }
    };
    // The store's rule (`Codec::compress`): compressed only when it saves 1/32 of the bytes.
    let out = out.filter(|z| z.len() + raw.len() / 32 < raw.len());
    let m = Measure {
        raw: raw.len() as u64,
        stored: out.as_ref().map_or(raw.len(), Vec::len) as u64,
        nanos: nanos.max(1),
    };
    (m, out)
}

//! Adaptive codec choice for memory saves, after the compressed save/restore paper
//! (`shared/seeds/000_*`): compressing pays when
//!
//! ```text
//! Speed_Transfer ≤ Speed_Comp × (1 − Rate)
//! ```
//!
//! where Speed_Transfer is how fast the backend makes raw bytes durable, Speed_Comp how fast
//! the pool compresses and Rate the compressed/raw ratio. Among the codecs that pass, the
//! one with the smallest expected time per byte, `1/Speed_Comp + Rate/Speed_Transfer` (the
//! paper's equation 3 divided by the file size), is used; when none passes, pages are stored
//! raw, so a save is never slower than storing raw by the paper's model. That is the
//! [`Model::Serial`] used for local disks; on a network backend uploads overlap compression,
//! so [`Model::Overlapped`] takes the slower stage's time instead of the sum.
//!
//! All three inputs are measured, not configured:
//! * Speed_Transfer from the save's own pack uploads (the store's upload meter: bytes over
//!   the wall time uploads were running), re-read at every decision once
//!   [`METER_MIN_BYTES`] went up. Until then a prior is used: the speed this host measured
//!   on the same backend within [`REMEMBER_SECS`] (a small file in the store's local
//!   directory, written after each save), else, on a network backend, 1 Gbit/s
//!   ([`DEFAULT_NETWORK_BPS`]: the first frames get a cheap codec; sending a 16 MiB probe cost
//!   a small save more time and link bytes than it saved), else [`probe_backend`]: one timed
//!   `put` of incompressible bytes (a local disk: cheap, and its first pack is large);
//! * Speed_Comp and Rate on the frames actually arriving: workers compress a sample of
//!   frames (the first few, then one in [`SAMPLE_EVERY`]) with every candidate, timed with the
//!   thread's CPU clock (so a worker preempted by QEMU does not look slow), and the pool's
//!   speed is that per-core speed × the cores compression can really use: all cores minus one
//!   when the source QEMU runs on this host, because its migration thread keeps one core busy
//!   for the whole transfer. On a 2-core host that is one core, which is why a fast local disk
//!   usually gets raw pages. A stop-and-copy save to a network backend counts every core (the
//!   caller passes them): there QEMU's sender blocks whenever the pool falls behind, and the
//!   link is the bottleneck, so it gets zstd:1 (the start-up codec there, [`Chooser::with_start`]).
//!
//! The decision is re-evaluated after every sample over a sliding window, so a save that
//! moves from code pages to random data switches codec per batch. [`decide`] is a pure
//! function, unit-tested on the paper's Table 1 numbers.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use super::manifest::{CodecEstimate, CodecReport};
use crate::backend::{Backend, BackendError};
use crate::codec::Codec;

/// Codecs tried by `auto`, besides storing raw.
pub const CANDIDATES: [Codec; 3] = [Codec::Lz4, Codec::Zstd(1), Codec::Zstd(3)];
/// Frames sampled unconditionally at the start of a save.
pub const WARMUP_SAMPLES: u64 = 6;
/// After the warm-up, one frame in this many is sampled (16 MiB of 128 KiB frames). A sample
/// compresses its frame with every candidate, ~3.4x the work of zstd:1 alone (zstd:3 is
/// ~2.2x); at one in 64 that was ~8% of a 128 MiB save's compressing CPU (`perf`), which on
/// a 2-core host is the save's bottleneck. The sample's output for the chosen codec is now
/// also what the store keeps ([`Chooser::codec_for_frame`]), not compressed again.
pub const SAMPLE_EVERY: u64 = 128;
/// Samples per codec kept in the sliding window.
pub const WINDOW: usize = 24;
/// Bytes written by the backend probe (non-network backends without a remembered speed).
pub const PROBE_BYTES: usize = 16 << 20;
/// Speed_Transfer assumed for a network backend until its uploads are measured: 1 Gbit/s.
pub const DEFAULT_NETWORK_BPS: f64 = 125e6;
/// Uploaded bytes before the measured speed replaces the prior.
/// 4 MiB: a shaped link lets its first burst (`tbf` burst 256 KiB here, a switch's buffers
/// in general) through at wire speed, so a small first upload measures a link several times
/// faster than it is, and the chooser then picked lz4 for up to 130 frames of a 128 MiB save
/// (+1 MB stored) before the measurement settled.
pub const METER_MIN_BYTES: u64 = 4 << 20;
/// How long a speed measured by an earlier save is trusted as the prior.
pub const REMEMBER_SECS: u64 = 7 * 24 * 3600;
/// File in the store's local directory holding the last measured speed.
pub const SPEED_FILE: &str = "backend-speed.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct Remembered {
    backend: String,
    bytes_per_s: f64,
    measured_unix: u64,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The speed an earlier save measured on `backend` from this host, and its age in seconds,
/// if recent enough.
pub fn remembered_speed(dir: &std::path::Path, backend: &str) -> Option<(f64, u64)> {
    let raw = std::fs::read(dir.join(SPEED_FILE)).ok()?;
    let r: Remembered = serde_json::from_slice(&raw).ok()?;
    let age = unix_now().checked_sub(r.measured_unix)?;
    (r.backend == backend && age <= REMEMBER_SECS && r.bytes_per_s.is_finite() && r.bytes_per_s > 0.0)
        .then_some((r.bytes_per_s, age))
}

/// Remember a measured speed for the next save (best effort: a failure only costs the prior).
pub fn remember_speed(dir: &std::path::Path, backend: &str, bytes_per_s: f64) {
    let r = Remembered {
        backend: backend.into(),
        bytes_per_s,
        measured_unix: unix_now(),
    };
    let tmp = dir.join(format!("{SPEED_FILE}.tmp"));
    let ok = serde_json::to_vec(&r)
        .ok()
        .and_then(|b| std::fs::write(&tmp, b).ok())
        .and_then(|_| std::fs::rename(&tmp, dir.join(SPEED_FILE)).ok());
    if ok.is_none() {
        tracing::debug!(target: "strata::memory", dir = %dir.display(), "backend speed not remembered");
    }
}

/// Upload speed in bytes/s from the store's meter (bytes, busy time), once enough went up.
pub fn metered_speed(bytes: u64, busy: std::time::Duration) -> Option<f64> {
    (bytes >= METER_MIN_BYTES && !busy.is_zero()).then(|| bytes as f64 / busy.as_secs_f64())
}

/// Reads the backend's measured speed during a save (`None` until enough was uploaded).
pub type Meter = Box<dyn Fn() -> Option<f64> + Send + Sync>;

thread_local! {
    // One zstd context per level, so sampling levels 1 and 3 in turn does not rebuild them.
    static SAMPLERS: RefCell<Vec<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(Vec::new()) };
}

/// What `--codec` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodecPolicy {
    /// Measure and choose per batch.
    Auto,
    /// Always this codec.
    Fixed(Codec),
}

impl std::str::FromStr for CodecPolicy {
    type Err = crate::codec::CodecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(CodecPolicy::Auto)
        } else {
            s.parse().map(CodecPolicy::Fixed)
        }
    }
}

impl std::fmt::Display for CodecPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CodecPolicy::Auto => f.write_str("auto"),
            CodecPolicy::Fixed(c) => write!(f, "{c}"),
        }
    }
}

/// Accumulated measurements of one codec.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Measure {
    pub raw: u64,
    pub stored: u64,
    pub nanos: u64,
}

impl Measure {
    fn add(&mut self, o: &Measure) {
        self.raw += o.raw;
        self.stored += o.stored;
        self.nanos += o.nanos;
    }
}

/// The outcome of [`decide`].
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub codec: Codec,
    pub why: String,
    pub estimates: Vec<CodecEstimate>,
}

/// The overlapped model counts on the pool compressing at this fraction of its measured speed:
/// the measurement is per-thread CPU time of the codec alone, while the same cores also hash
/// pages, parse the stream, run QEMU's sender and the HTTP client (and, in the benchmark, the
/// storage server: perf put the pool at ~35% of the two cores during a 128 MiB save to S3).
/// Without it the model took zstd:3 for up to half of a 128 MiB save's frames, and zstd:3
/// on every frame made that save CPU-bound; at 1.5 it took lz4 for 100+ frames whenever
/// zstd:1's sampled speed dipped below ~400 MB/s, and sent up to 30% more bytes
/// (`docs/memory.md`).
pub const CPU_HEADROOM: f64 = 1.2;

/// In the overlapped (network) model, how many times each stored byte is expected to come
/// back over the link: a saved desktop is restored at least once, and a restore reads every
/// stored byte through the same link while decompression is cheap. Counting only the save
/// let a dip of zstd:1's sampled speed hand whole 128 MiB saves to lz4 once lz4 got faster:
/// 28% more bytes, a save no faster, and a restore ~20% slower than zstd:1's (session 7).
pub const RESTORE_READS: f64 = 1.0;

/// How compression and the transfer share the save's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// The paper's: compressing, then writing, one after the other. Time per byte is
    /// `1/Speed_Comp + Rate/Speed_Transfer`; compression pays when
    /// `Speed_Transfer <= Speed_Comp x (1 - Rate)`. Used for local disks, whose writes cost
    /// this host's CPU and memory bandwidth too (page-cache copies, fdatasync), so the two
    /// stages do not fully overlap.
    Serial,
    /// strata's pipeline on a network backend: the pool compresses while earlier packs are
    /// uploading, and an upload costs this host little CPU, so the save runs at the slower
    /// stage's speed, `max(h/Speed_Comp, Rate/Speed_Transfer)` per byte with
    /// h = [`CPU_HEADROOM`]. The restore reads the stored bytes back over the same link,
    /// [`RESTORE_READS`] x `Rate/Speed_Transfer` more; a codec pays when the sum beats raw's
    /// `(1 + RESTORE_READS) / Speed_Transfer`. On 1 Gbit/s with one usable core the serial
    /// model sat on its threshold (lz4 123 MB/s x (1 - Rate) against the link's 125) and
    /// stored a 128 MiB save's frames raw for hundreds of frames, 1.5x slower.
    Overlapped,
}

impl std::fmt::Display for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Model::Serial => "serial",
            Model::Overlapped => "overlapped",
        })
    }
}

/// Apply the paper's inequality ([`Model::Serial`]). `backend_bps`: bytes/s the backend
/// stores raw; `parallel`: workers compressing at once; `measures`: per candidate, raw/stored
/// bytes and CPU time of samples.
pub fn decide(backend_bps: f64, parallel: f64, measures: &[(Codec, Measure)]) -> Decision {
    decide_with(Model::Serial, backend_bps, parallel, measures)
}

/// A codec in use is kept while its expected time per byte is within this fraction of the
/// best codec's. Samples are single 64 KiB frames timed on a busy host: with no margin, a
/// 128 MiB save to S3 whose zstd:1 and the link sat within a few percent of each other
/// switched to lz4 or zstd:3 for 200-800 of its 1230 frames in about one run in five, and
/// those runs were 5-17% slower (`bench save-restore --remote`, session 6).
pub const SWITCH_MARGIN: f64 = 0.15;

/// Choose a codec under `model`: among the codecs that pay, the smallest expected time per
/// byte; none paying means raw.
pub fn decide_with(model: Model, backend_bps: f64, parallel: f64, measures: &[(Codec, Measure)]) -> Decision {
    decide_keeping(model, backend_bps, parallel, measures, None)
}

/// [`decide_with`], but `current` (the codec in use) is kept while it pays and its expected
/// time per byte is within [`SWITCH_MARGIN`] of the best.
pub fn decide_keeping(model: Model, backend_bps: f64, parallel: f64, measures: &[(Codec, Measure)], current: Option<Codec>) -> Decision {
    let mb = |bps: f64| bps / 1e6;
    let mut estimates = Vec::new();
    let mut best: Option<(f64, Codec, f64, f64)> = None;
    let mut kept: Option<(f64, Codec, f64, f64)> = None;
    let raw_t = match model {
        Model::Serial => 1.0 / backend_bps,
        Model::Overlapped => (1.0 + RESTORE_READS) / backend_bps,
    };
    for (codec, m) in measures {
        if m.raw == 0 || m.nanos == 0 {
            continue;
        }
        let rate = (m.stored as f64 / m.raw as f64).min(1.0);
        let comp = m.raw as f64 / (m.nanos as f64 / 1e9) * parallel.max(1.0);
        let (secs_per_byte, expected, pays) = match model {
            Model::Serial => {
                let expected = comp * (1.0 - rate);
                (1.0 / comp + rate / backend_bps, expected, backend_bps <= expected)
            }
            Model::Overlapped => {
                let save = (CPU_HEADROOM / comp).max(rate / backend_bps);
                let t = save + RESTORE_READS * rate / backend_bps;
                (t, 1.0 / save, t < raw_t)
            }
        };
        estimates.push(CodecEstimate {
            codec: codec.to_string(),
            ratio: rate,
            comp_mb_s: mb(comp),
            expected_mb_s: mb(expected),
            pays,
        });
        if pays && best.is_none_or(|(t, ..)| secs_per_byte < t) {
            best = Some((secs_per_byte, *codec, comp, rate));
        }
        if pays && Some(*codec) == current {
            kept = Some((secs_per_byte, *codec, comp, rate));
        }
    }
    if let (Some(k), Some(b)) = (kept, best) {
        if k.0 <= b.0 * (1.0 + SWITCH_MARGIN) {
            best = Some(k);
        }
    }
    match (best, model) {
        (Some((t, codec, comp, rate)), Model::Serial) => Decision {
            codec,
            why: format!(
                "backend {:.0} MB/s <= {codec} {:.0} MB/s x (1 - {:.2}) = {:.0} MB/s; expected {:.2} s/GB vs {:.2} s/GB raw",
                mb(backend_bps),
                mb(comp),
                rate,
                mb(comp * (1.0 - rate)),
                t * 1e9,
                raw_t * 1e9
            ),
            estimates,
        },
        (Some((t, codec, comp, rate)), Model::Overlapped) => Decision {
            codec,
            why: format!(
                "{codec} compresses {:.0} MB/s (/ {CPU_HEADROOM} headroom), backend {:.0} MB/s, overlapped with the upload: save at min({:.0}, {:.0} / {:.2}) = {:.0} MB/s; expected {:.2} s/GB saved and restored vs {:.2} s/GB raw",
                mb(comp),
                mb(backend_bps),
                mb(comp / CPU_HEADROOM),
                mb(backend_bps),
                rate,
                mb((comp / CPU_HEADROOM).min(backend_bps / rate)),
                t * 1e9,
                raw_t * 1e9
            ),
            estimates,
        },
        (None, _) => {
            let top = estimates
                .iter()
                .max_by(|a, b| a.expected_mb_s.total_cmp(&b.expected_mb_s))
                .map(|e| format!("; best was {} at {:.0} MB/s", e.codec, e.expected_mb_s))
                .unwrap_or_default();
            let test = match model {
                Model::Serial => "Speed_Comp x (1 - Rate) too low",
                Model::Overlapped => "no codec saves and restores faster than raw",
            };
            Decision {
                codec: Codec::None,
                why: format!("no codec beats the backend's {:.0} MB/s ({test}{top}): storing raw", mb(backend_bps)),
                estimates,
            }
        }
    }
}

/// Time one `put` of `bytes` incompressible bytes (plus its durability) and delete it.
/// Returns bytes per second.
pub fn probe_backend(backend: &dyn Backend, bytes: usize) -> Result<f64, BackendError> {
    let mut data = vec![0u8; bytes];
    let mut x: u64 = rand::random::<u64>() | 1;
    for w in data.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    let key = format!("tmp/strata-probe-{:016x}", rand::random::<u64>());
    let t = Instant::now();
    backend.put(&key, &data)?;
    backend.sync()?;
    let secs = t.elapsed().as_secs_f64().max(1e-6);
    let _ = backend.delete(&key);
    Ok(bytes as f64 / secs)
}

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
/// Only the compression is timed: a zstd context is created, and warmed with one untimed
/// compression of `raw` (its workspace is allocated, and page-faulted, on first use), before
/// the clock starts. Timing the first use made zstd:1 look up to 2x slower in a save's first
/// samples, which handed the first 130-260 frames of a 128 MiB save to lz4.
pub fn measure_once(codec: Codec, raw: &[u8]) -> Measure {
    measure_keep(codec, raw).0
}

/// [`measure_once`], also handing back what the store would keep for `raw` under `codec`:
/// the compressed bytes, or None when they do not pay (the store keeps such frames raw, as
/// [`Codec::compress`] decides). A sampled frame is then stored from its sample instead of
/// being compressed a second time.
pub fn measure_keep(codec: Codec, raw: &[u8]) -> (Measure, Option<Vec<u8>>) {
    let (out, nanos): (Option<Vec<u8>>, u64) = match codec {
        Codec::Zstd(level) => SAMPLERS.with(|s| {
            let mut s = s.borrow_mut();
            let pos = match s.iter().position(|(l, _)| *l == level) {
                Some(p) => p,
                None => match crate::codec::zstd_compressor(level) {
                    Some(mut c) => {
                        let _ = c.compress(raw);
                        s.push((level, c));
                        s.len() - 1
                    }
                    None => return (None, 1),
                },
            };
            let t = thread_cpu_ns();
            let z = s[pos].1.compress(raw).ok();
            (z, thread_cpu_ns().saturating_sub(t))
        }),
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

/// A codec and what it made of a sampled frame (None: it did not pay).
type Kept = (Codec, Option<Vec<u8>>);

struct Window {
    samples: Vec<VecDeque<Measure>>,
    decision: Option<Decision>,
    switches: u64,
}

/// Shared by the pool's workers for one save.
pub struct Chooser {
    policy: CodecPolicy,
    /// Speed_Transfer, f64 bits: the prior, then the meter's latest reading.
    backend_bps: AtomicU64,
    meter: Option<Meter>,
    /// Where the prior came from, for the report.
    prior_from: String,
    metered: std::sync::atomic::AtomicBool,
    parallel: f64,
    model: Model,
    /// The start-up codec was chosen on purpose ([`Chooser::with_start`]): the first decision
    /// keeps it unless another is clearly better, as later decisions keep the codec in use.
    start_kept: bool,
    /// Index into `CANDIDATES`, or `usize::MAX` for raw.
    current: AtomicUsize,
    frames: AtomicU64,
    samples: AtomicU64,
    used: Mutex<Vec<(Codec, u64)>>,
    window: Mutex<Window>,
}

fn slot(c: Codec) -> usize {
    CANDIDATES.iter().position(|x| *x == c).unwrap_or(usize::MAX)
}

impl Chooser {
    /// `backend_bps` from [`probe_backend`] (ignored for a fixed policy); `parallel`: cores
    /// compression can use ([`usable_cores`]).
    pub fn new(policy: CodecPolicy, backend_bps: f64, parallel: usize) -> Chooser {
        let start = match policy {
            // Until the first measurements arrive, the cheapest codec.
            CodecPolicy::Auto => 0,
            CodecPolicy::Fixed(c) => slot(c),
        };
        Chooser {
            policy,
            backend_bps: AtomicU64::new(backend_bps.max(1.0).to_bits()),
            meter: None,
            prior_from: String::new(),
            metered: std::sync::atomic::AtomicBool::new(false),
            parallel: parallel.max(1) as f64,
            model: Model::Serial,
            start_kept: false,
            current: AtomicUsize::new(start),
            frames: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            used: Mutex::new(Vec::new()),
            window: Mutex::new(Window {
                samples: vec![VecDeque::new(); CANDIDATES.len()],
                decision: None,
                switches: 0,
            }),
        }
    }

    /// Refine Speed_Transfer during the save with `meter`; `prior_from` says where the
    /// starting value came from.
    pub fn with_meter(mut self, meter: Meter, prior_from: &str) -> Chooser {
        self.meter = Some(meter);
        self.prior_from = prior_from.into();
        self
    }

    /// Decide with `model` (default [`Model::Serial`]).
    pub fn with_model(mut self, model: Model) -> Chooser {
        self.model = model;
        self
    }

    /// Start with `codec` (one of [`CANDIDATES`]) instead of the cheapest, and let the first
    /// decision keep it while its expected time per byte is within [`SWITCH_MARGIN`] of the
    /// best, as every later decision keeps the codec in use. A network save starts with zstd:1:
    /// single 64 KiB samples on a busy host are noise, and replacing the start-up codec
    /// outright let the first decision pick zstd:3 (3% better by the model, more CPU, not
    /// faster) or lz4 (28% more bytes, slower both ways) on a sample's dip. A fixed policy
    /// ignores it.
    pub fn with_start(mut self, codec: Codec) -> Chooser {
        if self.policy == CodecPolicy::Auto && slot(codec) != usize::MAX {
            self.current.store(slot(codec), Ordering::Relaxed);
            self.start_kept = true;
        }
        self
    }

    /// Speed_Transfer now (bytes/s).
    pub fn backend_bps(&self) -> f64 {
        f64::from_bits(self.backend_bps.load(Ordering::Relaxed))
    }

    /// The meter's reading, if it has one.
    pub fn measured_bps(&self) -> Option<f64> {
        self.meter.as_ref().and_then(|m| m())
    }

    fn current_codec(&self) -> Codec {
        match self.policy {
            CodecPolicy::Fixed(c) => c,
            CodecPolicy::Auto => CANDIDATES
                .get(self.current.load(Ordering::Relaxed))
                .copied()
                .unwrap_or(Codec::None),
        }
    }

    /// Whether the next frame should be measured with every codec (then pass its new bytes
    /// to [`codec_for`](Self::codec_for); otherwise pass an empty slice and skip collecting them).
    pub fn wants_sample(&self) -> bool {
        if self.policy != CodecPolicy::Auto {
            return false;
        }
        let n = self.frames.fetch_add(1, Ordering::Relaxed);
        n < WARMUP_SAMPLES || n % SAMPLE_EVERY == 0
    }

    /// The codec for the next frame. When `sample` holds the frame's new (not yet stored)
    /// bytes, they are first compressed with every candidate to measure them.
    pub fn codec_for(&self, sample: &[u8]) -> Codec {
        self.codec_for_frame(sample).0
    }

    /// [`codec_for`](Self::codec_for), and for a sampled frame what the sample made of it
    /// under the chosen codec (`Some(None)`: store it raw), so the frame is not compressed
    /// again. `None` when nothing was sampled or raw was chosen.
    pub fn codec_for_frame(&self, sample: &[u8]) -> (Codec, Option<Option<Vec<u8>>>) {
        let mut outs = Vec::new();
        if self.policy == CodecPolicy::Auto && !sample.is_empty() {
            outs = self.sample(sample);
        }
        let codec = self.current_codec();
        let mut used = self.used.lock();
        match used.iter_mut().find(|(c, _)| *c == codec) {
            Some((_, n)) => *n += 1,
            None => used.push((codec, 1)),
        }
        let kept = outs.into_iter().find(|(c, _)| *c == codec).map(|(_, o)| o);
        (codec, kept)
    }

    fn sample(&self, fresh: &[u8]) -> Vec<Kept> {
        let (ms, outs): (Vec<Measure>, Vec<Kept>) = CANDIDATES
            .iter()
            .map(|c| {
                let (m, o) = measure_keep(*c, fresh);
                (m, (*c, o))
            })
            .unzip();
        self.record(ms);
        outs
    }

    /// Add one sample's measurements (one per [`CANDIDATES`] entry) and decide again.
    fn record(&self, ms: Vec<Measure>) {
        self.samples.fetch_add(1, Ordering::Relaxed);
        let mut w = self.window.lock();
        for (q, m) in w.samples.iter_mut().zip(ms) {
            q.push_back(m);
            if q.len() > WINDOW {
                q.pop_front();
            }
        }
        let sums: Vec<(Codec, Measure)> = CANDIDATES
            .iter()
            .zip(&w.samples)
            .map(|(c, q)| {
                let mut s = Measure::default();
                q.iter().for_each(|m| s.add(m));
                (*c, s)
            })
            .collect();
        if let Some(bps) = self.measured_bps() {
            self.backend_bps.store(bps.max(1.0).to_bits(), Ordering::Relaxed);
            self.metered.store(true, Ordering::Relaxed);
        }
        // The first decision waits for the warm-up's samples: one frame timed on a busy host
        // is noise, and deciding on it handed 850 of a 128 MiB save's 1,230 frames to lz4
        // (the margin below then kept it) in a run whose later samples preferred zstd:1.
        if w.decision.is_none() && w.samples[0].len() < WARMUP_SAMPLES as usize {
            return;
        }
        // The first decision replaces the placeholder codec outright (unless it was chosen
        // with `with_start`); later ones keep the codec in use unless another is clearly better.
        let keep = match &w.decision {
            Some(d) => Some(d.codec),
            None if self.start_kept => Some(self.current_codec()),
            None => None,
        };
        let d = decide_keeping(self.model, self.backend_bps(), self.parallel, &sums, keep);
        let new = slot(d.codec);
        let old = self.current.swap(new, Ordering::Relaxed);
        if old != new && w.decision.is_some() {
            w.switches += 1;
            tracing::debug!(target: "strata::memory", codec = %d.codec, why = %d.why, "codec switched");
        }
        w.decision = Some(d);
    }

    /// What was used and why, for the manifest and `--json`.
    pub fn report(&self) -> CodecReport {
        let frames: BTreeMap<String, u64> = self.used.lock().iter().map(|(c, n)| (c.to_string(), *n)).collect();
        let w = self.window.lock();
        let chosen = frames
            .iter()
            .max_by_key(|(_, v)| **v)
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| self.current_codec().to_string());
        let (mut why, estimates) = match (&self.policy, &w.decision) {
            (CodecPolicy::Fixed(c), _) => (format!("{c} forced with --codec"), vec![]),
            (CodecPolicy::Auto, Some(d)) => (format!("last decision: {}", d.why), d.estimates.clone()),
            (CodecPolicy::Auto, None) if w.samples[0].is_empty() => ("no new data arrived to measure; nothing compressed".into(), vec![]),
            (CodecPolicy::Auto, None) => (
                format!("fewer than {WARMUP_SAMPLES} frames to measure: kept the start-up codec"),
                vec![],
            ),
        };
        if frames.len() > 1 {
            let per: Vec<String> = frames.iter().map(|(k, v)| format!("{k} {v}")).collect();
            why += &format!(
                " (chosen per batch, {} switches; frames: {})",
                w.switches,
                per.join(", ")
            );
        }
        CodecReport {
            chosen,
            why,
            policy: self.policy.to_string(),
            model: if self.policy == CodecPolicy::Auto { self.model.to_string() } else { String::new() },
            backend_mb_s: if self.policy == CodecPolicy::Auto {
                self.backend_bps() / 1e6
            } else {
                0.0
            },
            backend_speed_from: match (self.policy, self.metered.load(Ordering::Relaxed)) {
                (CodecPolicy::Fixed(_), _) => String::new(),
                (_, true) if self.prior_from.is_empty() => "measured on this save's uploads".into(),
                (_, true) => format!("{}, then measured on this save's uploads", self.prior_from),
                (_, false) if self.prior_from.is_empty() => "probe".into(),
                (_, false) => self.prior_from.clone(),
            },
            frames,
            samples: self.samples.load(Ordering::Relaxed),
            switches: w.switches,
            estimates,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(mb_s: f64, rate: f64) -> Measure {
        // 1 MB compressed in 1/mb_s seconds to rate.
        Measure {
            raw: 1_000_000,
            stored: (1_000_000.0 * rate) as u64,
            nanos: (1e9 / mb_s) as u64,
        }
    }

    #[test]
    fn paper_table_2_numbers() {
        // Table 1 of the paper: LZO 47.43% at 105.76 MB/s, deflate 33.49% at 13.22 MB/s.
        let d = decide(
            12.5e6,
            1.0,
            &[(Codec::Lz4, m(105.76, 0.4743)), (Codec::Zstd(3), m(13.22, 0.3349))],
        );
        let lzo = &d.estimates[0];
        assert!((lzo.expected_mb_s - 55.60).abs() < 0.1, "{lzo:?}");
        assert!((d.estimates[1].expected_mb_s - 8.79).abs() < 0.05);
        // 100 Mbps network (12.5 MB/s): LZO pays, deflate does not.
        assert!(lzo.pays && !d.estimates[1].pays);
        assert_eq!(d.codec, Codec::Lz4);
        // 1 Gbps (125 MB/s): nothing pays at these speeds, so store raw.
        let d = decide(125e6, 1.0, &[(Codec::Lz4, m(105.76, 0.4743))]);
        assert_eq!(d.codec, Codec::None);
        assert!(d.why.contains("storing raw"), "{}", d.why);
        // Two workers double Speed_Comp: 2 x 105.76 x 0.5257 = 111 MB/s, still < 125.
        assert_eq!(
            decide(125e6, 2.0, &[(Codec::Lz4, m(105.76, 0.4743))]).codec,
            Codec::None
        );
        assert_eq!(decide(100e6, 2.0, &[(Codec::Lz4, m(105.76, 0.4743))]).codec, Codec::Lz4);
    }

    #[test]
    fn picks_the_smallest_expected_time_among_passing_codecs() {
        // Slow backend: the better ratio wins even at lower speed.
        let ms = [
            (Codec::Lz4, m(1200.0, 0.45)),
            (Codec::Zstd(1), m(600.0, 0.33)),
            (Codec::Zstd(3), m(150.0, 0.30)),
        ];
        assert_eq!(decide(50e6, 2.0, &ms).codec, Codec::Zstd(1));
        // Fast backend: lz4.
        assert_eq!(decide(500e6, 2.0, &ms).codec, Codec::Lz4);
        // Incompressible data: rate 1, nothing pays.
        let rnd = [(Codec::Lz4, m(3000.0, 1.0)), (Codec::Zstd(1), m(900.0, 1.0))];
        assert_eq!(decide(10e6, 2.0, &rnd).codec, Codec::None);
        // No measurements: raw.
        assert_eq!(decide(10e6, 2.0, &[]).codec, Codec::None);
    }

    #[test]
    fn the_codec_in_use_is_kept_unless_another_is_clearly_better() {
        // zstd:1 and the link within a few percent (the 128 MiB save to S3): a dip of zstd:1's
        // sampled speed to 200 MB/s makes lz4 the best by 5% (saved and restored: lz4
        // max(1.2 / 700, 0.47 / 110) + 0.47 / 110 = 8.55 s/GB, zstd:1 1.2 / 200 + 0.33 / 110 =
        // 9.00 s/GB); the codec in use stays.
        let ms = [(Codec::Lz4, m(700.0, 0.47)), (Codec::Zstd(1), m(200.0, 0.33)), (Codec::Zstd(3), m(150.0, 0.30))];
        let fresh = decide_with(Model::Overlapped, 110e6, 1.0, &ms);
        assert_eq!(fresh.codec, Codec::Lz4, "{}", fresh.why);
        let kept = decide_keeping(Model::Overlapped, 110e6, 1.0, &ms, Some(Codec::Zstd(1)));
        assert_eq!(kept.codec, Codec::Zstd(1), "{}", kept.why);
        // Counting the restore, the same dip to 270 MB/s no longer favours lz4 at all (zstd:1
        // 7.44 s/GB), though the save alone would be 4% faster with lz4 (4.27 vs 4.44 s/GB).
        let dip = [(Codec::Lz4, m(700.0, 0.47)), (Codec::Zstd(1), m(270.0, 0.33))];
        assert_eq!(decide_with(Model::Overlapped, 110e6, 1.0, &dip).codec, Codec::Zstd(1));
        // A codec clearly better (zstd:1 at 160 MB/s: 10.5 s/GB, 23% slower) wins.
        let slow = [(Codec::Lz4, m(700.0, 0.47)), (Codec::Zstd(1), m(160.0, 0.33))];
        assert_eq!(decide_keeping(Model::Overlapped, 110e6, 1.0, &slow, Some(Codec::Zstd(1))).codec, Codec::Lz4);
        // A codec in use that no longer pays is dropped whatever the margin.
        let rnd = [(Codec::Lz4, m(3000.0, 1.0)), (Codec::Zstd(1), m(900.0, 1.0))];
        assert_eq!(decide_keeping(Model::Serial, 10e6, 2.0, &rnd, Some(Codec::Zstd(1))).codec, Codec::None);
        // Same in the serial model: lz4 (4.22 s/GB) kept against zstd:1 (4.13 s/GB).
        let ms = [(Codec::Lz4, m(1200.0, 0.38)), (Codec::Zstd(1), m(600.0, 0.33))];
        assert_eq!(decide(100e6, 2.0, &ms).codec, Codec::Zstd(1));
        assert_eq!(decide_keeping(Model::Serial, 100e6, 2.0, &ms, Some(Codec::Lz4)).codec, Codec::Lz4);
    }

    #[test]
    fn overlapped_model_compresses_whenever_the_pool_outruns_the_link() {
        // Measured at the start of a 128 MiB save to S3 over 1 Gbit/s, one usable core: the
        // serial model's best was lz4 at 123 MB/s against the link's 125, so it stored raw.
        let ms = [(Codec::Lz4, m(250.0, 0.51)), (Codec::Zstd(1), m(200.0, 0.45))];
        assert_eq!(decide(125e6, 1.0, &ms).codec, Codec::None);
        let d = decide_with(Model::Overlapped, 125e6, 1.0, &ms);
        // Both pay (saved and restored: lz4 1.2 / 250 + 0.51 / 125 = 8.88 s/GB, zstd:1
        // 1.2 / 200 + 0.45 / 125 = 9.60 s/GB, raw 2 / 125 = 16 s/GB); the save runs at
        // min(250 / 1.2, 125 / 0.51) = 208 MB/s with lz4 and min(200 / 1.2, 125 / 0.45) = 167
        // with zstd:1.
        assert!(d.estimates.iter().all(|e| e.pays), "{d:?}");
        assert_eq!(d.codec, Codec::Lz4, "{}", d.why);
        assert!((d.estimates[0].expected_mb_s - 208.3).abs() < 0.5, "{:?}", d.estimates[0]);
        // When the link is the bottleneck, the better ratio wins even if it is slower.
        let ms = [(Codec::Lz4, m(450.0, 0.55)), (Codec::Zstd(1), m(430.0, 0.43)), (Codec::Zstd(3), m(250.0, 0.41))];
        assert_eq!(decide_with(Model::Overlapped, 117e6, 1.0, &ms).codec, Codec::Zstd(1));
        // One core of zstd:3 is CPU-bound (250 / 1.2 = 208 MB/s < the 117 / 0.41 = 285 MB/s of
        // input the link could take); two are not (2 x 250 / 1.2 = 417 > 285), so it wins.
        assert_eq!(decide_with(Model::Overlapped, 117e6, 2.0, &ms).codec, Codec::Zstd(3));
        // A disk faster than any codec: raw, as in the serial model.
        let d = decide_with(Model::Overlapped, 1500e6, 1.0, &ms);
        assert_eq!(d.codec, Codec::None);
        assert!(d.why.contains("storing raw"), "{}", d.why);
        // Incompressible data never pays.
        assert_eq!(decide_with(Model::Overlapped, 10e6, 2.0, &[(Codec::Lz4, m(3000.0, 1.0))]).codec, Codec::None);
    }

    #[test]
    fn a_chosen_start_codec_is_kept_unless_another_is_clearly_better() {
        // Samples of the 128 MiB save to S3 (session 9), two cores: zstd:3 is 3% better by the
        // model (max(1.2 / 282, 0.454 / 109) + 0.454 / 109 = 8.42 s/GB against zstd:1's 8.66),
        // within the margin; lz4 (11.0 s/GB) is not close.
        let sample = vec![m(437.0, 0.600), m(258.0, 0.472), m(141.0, 0.454)];
        let run = |c: Chooser, sample: &[Measure]| {
            let c = c.with_model(Model::Overlapped);
            for _ in 0..WARMUP_SAMPLES {
                c.record(sample.to_vec());
            }
            c.current_codec()
        };
        let fresh = || Chooser::new(CodecPolicy::Auto, 109e6, 2);
        assert_eq!(run(fresh(), &sample), Codec::Zstd(3));
        assert_eq!(run(fresh().with_start(Codec::Zstd(1)), &sample), Codec::Zstd(1));
        // Before the first decision the start codec is used.
        let c = fresh().with_start(Codec::Zstd(1));
        assert!(c.wants_sample());
        assert_eq!(c.codec_for(&[]), Codec::Zstd(1));
        // A clearly better codec still wins the first decision: zstd:1 at 60 MB/s a core
        // (max(1.2 / 120, 4.33) + 4.33 = 14.3 s/GB) against lz4 (11.0 s/GB).
        let slow = vec![m(437.0, 0.600), m(60.0, 0.472), m(30.0, 0.454)];
        assert_eq!(run(fresh().with_start(Codec::Zstd(1)), &slow), Codec::Lz4);
        // A fixed policy ignores the start codec.
        let f = Chooser::new(CodecPolicy::Fixed(Codec::Lz4), 109e6, 2).with_start(Codec::Zstd(1));
        assert_eq!(f.codec_for(&[]), Codec::Lz4);
    }

    #[test]
    fn chooser_measures_real_data_and_switches() {
        let c = Chooser::new(CodecPolicy::Auto, 50e6, 2);
        let text: Vec<u8> = (0..65536u32)
            .map(|i| b"strata memory page "[(i % 19) as usize])
            .collect();
        for _ in 0..WARMUP_SAMPLES {
            assert!(c.wants_sample());
            c.codec_for(&text);
        }
        assert_ne!(c.current_codec(), Codec::None, "{:?}", c.report());
        // Random data: after a window of samples the choice becomes raw.
        let mut x = 1u64;
        let rnd: Vec<u8> = (0..65536)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        let mut sampled = 0;
        for _ in 0..(WINDOW as u64 * SAMPLE_EVERY * 2) {
            if c.wants_sample() {
                sampled += 1;
                c.codec_for(&rnd);
            } else {
                c.codec_for(&[]);
            }
        }
        assert_eq!(sampled, WINDOW as u64 * 2, "one frame in SAMPLE_EVERY is measured");
        assert_eq!(c.current_codec(), Codec::None);
        let r = c.report();
        assert!(r.switches >= 1);
        assert!(r.samples >= WARMUP_SAMPLES);
        assert_eq!(r.policy, "auto");
        assert!(r.frames.contains_key("none"));
    }

    #[test]
    fn fixed_policy_never_samples() {
        let c = Chooser::new(CodecPolicy::Fixed(Codec::Zstd(3)), 1.0, 2);
        assert!(!c.wants_sample());
        assert_eq!(c.codec_for(b"abc"), Codec::Zstd(3));
        let r = c.report();
        assert_eq!(r.samples, 0);
        assert_eq!(r.frames.get("zstd:3"), Some(&1));
        assert!(r.why.contains("forced"));
        assert_eq!("auto".parse::<CodecPolicy>().unwrap(), CodecPolicy::Auto);
        assert_eq!(
            "zstd:2".parse::<CodecPolicy>().unwrap(),
            CodecPolicy::Fixed(Codec::Zstd(2))
        );
        assert!("gzip".parse::<CodecPolicy>().is_err());
    }

    #[test]
    fn remembered_speed_is_per_backend_and_meter_replaces_the_prior() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(remembered_speed(d.path(), "s3://b"), None);
        remember_speed(d.path(), "s3://b", 111e6);
        let (bps, age) = remembered_speed(d.path(), "s3://b").unwrap();
        assert!((bps - 111e6).abs() < 1.0 && age < 60);
        assert_eq!(remembered_speed(d.path(), "s3://other"), None, "another backend's speed");
        // Too little uploaded: no reading; then bytes over busy time.
        assert_eq!(metered_speed(METER_MIN_BYTES - 1, std::time::Duration::from_millis(5)), None);
        assert_eq!(metered_speed(METER_MIN_BYTES, std::time::Duration::ZERO), None);
        let m = metered_speed(50_000_000, std::time::Duration::from_secs(1)).unwrap();
        assert!((m - 50e6).abs() < 1.0);
        // A chooser whose prior (1 Gbit/s) says zstd pays switches to raw once the meter
        // reports a backend faster than any codec here.
        let text: Vec<u8> = (0..65536u32).map(|i| b"strata memory page "[(i % 19) as usize]).collect();
        let reading = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let r2 = reading.clone();
        let c = Chooser::new(CodecPolicy::Auto, DEFAULT_NETWORK_BPS, 1).with_meter(
            Box::new(move || {
                let v = r2.load(Ordering::Relaxed);
                (v > 0).then_some(v as f64)
            }),
            "assumed 1 Gbit/s",
        );
        // No decision on fewer than the warm-up's samples: the start-up codec (lz4) stays.
        for _ in 1..WARMUP_SAMPLES {
            assert!(c.wants_sample());
            assert_eq!(c.codec_for(&text), Codec::Lz4);
        }
        assert!(c.report().why.contains("start-up codec"), "{}", c.report().why);
        assert!(c.wants_sample());
        assert_ne!(c.codec_for(&text), Codec::None);
        assert_eq!(c.report().backend_speed_from, "assumed 1 Gbit/s");
        reading.store(1 << 50, Ordering::Relaxed);
        while !c.wants_sample() {}
        assert_eq!(c.codec_for(&text), Codec::None);
        let r = c.report();
        assert!(r.backend_mb_s > 1e6, "{r:?}");
        assert_eq!(r.backend_speed_from, "assumed 1 Gbit/s, then measured on this save's uploads");
    }

    #[test]
    fn probe_measures_something() {
        let b = crate::backend::memory::MemoryBackend::new();
        let bps = probe_backend(&b, 1 << 20).unwrap();
        assert!(bps > 1e6);
        assert!(b.list("tmp/").unwrap().is_empty(), "probe object left behind");
    }
}

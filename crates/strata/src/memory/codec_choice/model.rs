//! The decision model: the paper's inequality ([`Model::Serial`]) or the overlapped pipeline
//! of a network save ([`Model::Overlapped`]) applied to the measured speeds and ratios. Pure
//! functions, so the tests can feed them the paper's numbers.

use super::*;

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
pub(crate) const CPU_HEADROOM: f64 = 1.2;

/// In the overlapped (network) model, how many times each stored byte is expected to come
/// back over the link: a saved desktop is restored at least once, and a restore reads every
/// stored byte through the same link while decompression is cheap. Counting only the save
/// lets a dip of zstd:1's sampled speed hand whole 128 MiB saves to lz4 once lz4 gets faster:
/// 28% more bytes, a save no faster, and a restore ~20% slower than zstd:1's.
pub(crate) const RESTORE_READS: f64 = 1.0;

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
    /// h = `CPU_HEADROOM`. The restore reads the stored bytes back over the same link,
    /// `RESTORE_READS` x `Rate/Speed_Transfer` more; a codec pays when the sum beats raw's
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
/// 128 MiB save to S3 whose zstd:1 and the link sit within a few percent of each other
/// switches to lz4 or zstd:3 for 200-800 of its 1230 frames in about one run in five, and
/// those runs are 5-17% slower (`bench save-restore --remote`).
pub(crate) const SWITCH_MARGIN: f64 = 0.15;

/// Choose a codec under `model`: among the codecs that pay, the smallest expected time per
/// byte; none paying means raw.
pub fn decide_with(
    model: Model,
    backend_bps: f64,
    parallel: f64,
    measures: &[(Codec, Measure)],
) -> Decision {
    decide_keeping(model, backend_bps, parallel, measures, None)
}

/// [`decide_with`], but `current` (the codec in use) is kept while it pays and its expected
/// time per byte is within `SWITCH_MARGIN` of the best.
pub fn decide_keeping(
    model: Model,
    backend_bps: f64,
    parallel: f64,
    measures: &[(Codec, Measure)],
    current: Option<Codec>,
) -> Decision {
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
    if best.is_none() && model == Model::Overlapped {
        if let Some((codec, comp, rate)) = free_codec(backend_bps, parallel, measures, current) {
            return Decision {
                codec,
                why: format!(
                    "no codec saved bytes on the recent samples ({codec}: ratio {:.2}), but {codec} compresses {:.0} MB/s (/ {CPU_HEADROOM} headroom), faster than the backend's {:.0} MB/s: \
                     frames are still compressed, and each one that {codec} shrinks by less than 1/32 is stored raw",
                    rate,
                    mb(comp),
                    mb(backend_bps)
                ),
                estimates,
            };
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

/// In the overlapped model, a codec that costs the save no time: the pool compresses faster
/// (with [`CPU_HEADROOM`]) than the link takes raw bytes. When no codec pays because the
/// recent samples were incompressible (random pages, `Rate` 1), such a codec still loses
/// nothing: [`Codec::compress`] stores a frame raw unless it saves 1/32, so the incompressible
/// frames cost neither bytes nor restore time, and compressible frames that follow are not
/// stored raw on the strength of the random ones sampled before them (a 512 MiB guest of
/// random pages stored ~19 MB of its kernel and page cache raw that way, 3% more bytes than
/// `zstd -1`'s stream; `docs/memory.md`). The codec in use is preferred, then the best ratio.
fn free_codec(
    backend_bps: f64,
    parallel: f64,
    measures: &[(Codec, Measure)],
    current: Option<Codec>,
) -> Option<(Codec, f64, f64)> {
    let free: Vec<(Codec, f64, f64)> = measures
        .iter()
        .filter(|(_, m)| m.raw > 0 && m.nanos > 0)
        .map(|(c, m)| {
            (
                *c,
                m.raw as f64 / (m.nanos as f64 / 1e9) * parallel.max(1.0),
                (m.stored as f64 / m.raw as f64).min(1.0),
            )
        })
        .filter(|(_, comp, _)| CPU_HEADROOM / comp <= 1.0 / backend_bps)
        .collect();
    free.iter()
        .find(|(c, ..)| Some(*c) == current)
        .or_else(|| free.iter().min_by(|a, b| a.2.total_cmp(&b.2).then(b.1.total_cmp(&a.1))))
        .copied()
}

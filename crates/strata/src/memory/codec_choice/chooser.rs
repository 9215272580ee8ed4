//! The [`Chooser`] shared by a save's workers: it samples frames, keeps a sliding window of
//! measurements per candidate, re-decides after every sample and reports what was used.

use super::*;

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
    /// Sample the first frames ([`WARMUP_SAMPLES`]); off: only one frame in [`SAMPLE_EVERY`].
    warmup: bool,
    /// Index into `CANDIDATES`, or `usize::MAX` for raw.
    current: AtomicUsize,
    /// Bytes stored and not yet uploaded, for [`ADAPT_QUEUED_SECS`].
    backlog: Option<Backlog>,
    /// Frames given [`ADAPT_TO`] instead of [`ADAPT_FROM`] because the link was behind.
    adapted: AtomicU64,
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
            warmup: true,
            current: AtomicUsize::new(start),
            backlog: None,
            adapted: AtomicU64::new(0),
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

    /// Let the link's backlog raise `ADAPT_FROM` to `ADAPT_TO` per frame
    /// (`ADAPT_QUEUED_SECS`). Only the `auto` policy uses it.
    pub fn with_backlog(mut self, backlog: Backlog) -> Chooser {
        self.backlog = Some(backlog);
        self
    }

    /// Whether more than [`ADAPT_QUEUED_SECS`] of uploads are queued at the link's speed now.
    fn link_behind(&self) -> bool {
        match &self.backlog {
            Some(b) if self.policy == CodecPolicy::Auto => {
                b() as f64 >= ADAPT_QUEUED_SECS * self.backend_bps()
            }
            _ => false,
        }
    }

    /// Decide with `model` (default [`Model::Serial`]).
    pub fn with_model(mut self, model: Model) -> Chooser {
        self.model = model;
        self
    }

    /// No warm-up: sample only one frame in `SAMPLE_EVERY`, from frame `SAMPLE_EVERY - 1`,
    /// the start codec meanwhile. For a stop-and-copy save to a network backend, bound by the
    /// CPU it shares with QEMU and the storage server: a sample compresses its frame with
    /// every candidate (~2.6 ms of CPU per 256 KiB frame), and six warm-up samples would fall
    /// in the save's first ~30 ms, when the link waits for the first packs. Without the
    /// warm-up, idle-guest saves on 256 KiB frames take 0.180 / 0.186 s against 0.186 /
    /// 0.204 s with it, by median at 128 / 512 MiB (`docs/results/README.md`).
    pub fn without_warmup(mut self) -> Chooser {
        self.warmup = false;
        self
    }

    /// Start with `codec` (one of `CANDIDATES`) instead of the cheapest, and let the first
    /// decision keep it while its expected time per byte is within `SWITCH_MARGIN` of the
    /// best, as every later decision keeps the codec in use. A network save starts with
    /// `SAVE_NETWORK_START` (stop-and-copy) or `NETWORK_START`
    /// (live checkpoints): single 128 KiB samples on a busy host are noise, and replacing the
    /// start-up codec outright let the first decision pick zstd:3 (a few % better by the
    /// model, more CPU, not faster) or lz4 (28% more bytes, slower both ways) on a sample's
    /// dip. A fixed policy ignores it.
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

    pub(super) fn current_codec(&self) -> Codec {
        match self.policy {
            CodecPolicy::Fixed(c) => c,
            CodecPolicy::Auto => {
                CANDIDATES.get(self.current.load(Ordering::Relaxed)).copied().unwrap_or(Codec::None)
            }
        }
    }

    /// Whether the next frame should be measured with every codec (then pass its new bytes
    /// to [`codec_for`](Self::codec_for); otherwise pass an empty slice and skip collecting them).
    pub fn wants_sample(&self) -> bool {
        if self.policy != CodecPolicy::Auto {
            return false;
        }
        let n = self.frames.fetch_add(1, Ordering::Relaxed);
        if !self.warmup {
            return n % SAMPLE_EVERY == SAMPLE_EVERY - 1;
        }
        if self.start_kept {
            // The start codec is in use meanwhile anyway: the warm-up's samples are spread
            // over its first frames instead of all falling on the first ones, which hold back
            // the first pack (and with it the first upload) while every core is short.
            return n < WARMUP_SAMPLES * WARMUP_SPREAD && n % WARMUP_SPREAD == WARMUP_SPREAD - 1
                || n.is_multiple_of(SAMPLE_EVERY) && n >= WARMUP_SAMPLES * WARMUP_SPREAD;
        }
        n < WARMUP_SAMPLES || n.is_multiple_of(SAMPLE_EVERY)
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
        let mut codec = self.current_codec();
        if codec == ADAPT_FROM && self.link_behind() {
            codec = ADAPT_TO;
            self.adapted.fetch_add(1, Ordering::Relaxed);
        }
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
    pub(super) fn record(&self, ms: Vec<Measure>) {
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
        let frames: BTreeMap<String, u64> =
            self.used.lock().iter().map(|(c, n)| (c.to_string(), *n)).collect();
        let w = self.window.lock();
        let chosen = frames
            .iter()
            .max_by_key(|(_, v)| **v)
            .map(|(k, _)| k.clone())
            .unwrap_or_else(|| self.current_codec().to_string());
        let (mut why, estimates) = match (&self.policy, &w.decision) {
            (CodecPolicy::Fixed(c), _) => (format!("{c} forced with --codec"), vec![]),
            (CodecPolicy::Auto, Some(d)) => (format!("last decision: {}", d.why), d.estimates.clone()),
            (CodecPolicy::Auto, None) if frames.is_empty() => ("no new data arrived to measure; nothing compressed".into(), vec![]),
            (CodecPolicy::Auto, None) if w.samples[0].is_empty() => (
                "no frame sampled yet: kept the start-up codec".into(),
                vec![],
            ),
            (CodecPolicy::Auto, None) => (
                format!(
                    "{} frames sampled, fewer than the {WARMUP_SAMPLES} a decision needs: kept the start-up codec",
                    self.samples.load(Ordering::Relaxed)
                ),
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
        let adapted = self.adapted.load(Ordering::Relaxed);
        if adapted > 0 {
            why += &format!(
                "; {adapted} frames {ADAPT_TO} instead of {ADAPT_FROM}: more than {:.0} ms of uploads were queued",
                ADAPT_QUEUED_SECS * 1e3
            );
        }
        CodecReport {
            chosen,
            why,
            policy: self.policy.to_string(),
            model: if self.policy == CodecPolicy::Auto {
                self.model.to_string()
            } else {
                String::new()
            },
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

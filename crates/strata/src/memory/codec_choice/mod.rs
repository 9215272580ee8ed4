//! Adaptive codec choice for memory saves, after the cost model of a paper on compressed
//! save/restore ("the paper" below): compressing pays when
//!
//! ```text
//! Speed_Transfer ≤ Speed_Comp × (1 − Rate)
//! ```
//!
//! where Speed_Transfer is how fast the backend makes raw bytes durable, Speed_Comp how fast
//! the pool compresses and Rate the compressed/raw ratio. Among the codecs that pass, the
//! one with the smallest expected time per byte, `1/Speed_Comp + Rate/Speed_Transfer` (the
//! model's expected save time divided by the file size), is used; when none passes, pages are
//! stored raw, so a save is never slower than storing raw by the model (on a network
//! backend, a codec faster than the link is still tried on every frame: each frame is stored
//! raw anyway unless it shrinks by 1/32, see `model::free_codec`). That is the
//! [`Model::Serial`] used for local disks; on a network backend uploads overlap compression,
//! so [`Model::Overlapped`] takes the slower stage's time instead of the sum.
//!
//! All three inputs are measured, not configured:
//! * Speed_Transfer from the save's own pack uploads (the store's upload meter: bytes over
//!   the wall time uploads were running), re-read at every decision once
//!   `METER_MIN_BYTES` went up. Before that a prior is used: the speed this host measured
//!   on the same backend within `REMEMBER_SECS` (a small file in the store's local
//!   directory, written after each save), else, on a network backend, 1 Gbit/s
//!   (`DEFAULT_NETWORK_BPS`: the first frames get a cheap codec; a 16 MiB probe would cost
//!   a small save more time and link bytes than it saves), else [`probe_backend`]: one timed
//!   `put` of incompressible bytes (a local disk: cheap, and its first pack is large);
//! * Speed_Comp and Rate on the frames actually arriving: workers compress a sample of
//!   frames (the first few, then one in `SAMPLE_EVERY`) with every candidate, timed with the
//!   thread's CPU clock (so a worker preempted by QEMU does not look slow), and the pool's
//!   speed is that per-core speed × the cores compression can really use: all cores minus one
//!   when the source QEMU runs on this host, because its migration thread keeps one core busy
//!   for the whole transfer. On a 2-core host that is one core, which is why a fast local disk
//!   usually gets raw pages. A stop-and-copy save to a network backend counts every core (the
//!   caller passes them): there QEMU's sender blocks whenever the pool falls behind, and the
//!   link is the bottleneck, so it starts at `SAVE_NETWORK_START` on 256 KiB frames (kept
//!   by [`Chooser::with_start`] unless a later decision finds another codec clearly better; a
//!   live checkpoint, whose guest keeps running, starts at `NETWORK_START`); a frame given
//!   zstd:1 is raised to zstd:2 while uploads queue up (`ADAPT_QUEUED_SECS`).
//!
//! The decision is re-evaluated after every sample over a sliding window, so a save that
//! moves from code pages to random data switches codec per batch. [`decide`] is a pure
//! function, unit-tested on the paper's Table 1 numbers.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use super::manifest::{CodecEstimate, CodecReport};
use crate::backend::{Backend, BackendError};
use crate::codec::Codec;

mod chooser;
mod measure;
mod model;
mod speed;
#[cfg(test)]
mod tests;

pub use chooser::Chooser;
pub(crate) use measure::thread_cpu_ns;
pub use measure::{measure_keep, measure_once, usable_cores};
pub use model::{decide, decide_keeping, decide_with, Decision, Model};
pub use speed::{metered_speed, probe_backend, remember_speed, remembered_speed, Meter};
pub(crate) use speed::{DEFAULT_NETWORK_BPS, PROBE_BYTES};

/// Codecs tried by `auto`, besides storing raw.
pub(crate) const CANDIDATES: [Codec; 4] =
    [Codec::Lz4, Codec::Zstd(1), Codec::Zstd(2), Codec::Zstd(3)];
/// The start-up codec of a live checkpoint to a network backend ([`Chooser::with_start`]).
pub(crate) const NETWORK_START: Codec = Codec::Zstd(1);
/// The start-up codec of a stop-and-copy save to a network backend. Such a save is bound by
/// the link whenever its memory does not deduplicate, and the guest is stopped, so the pool
/// has the cores. It writes 256 KiB frames
/// ([`SAVE_NETWORK_FRAME_PAGES`](crate::memory::ingest::SAVE_NETWORK_FRAME_PAGES)), has no
/// warm-up samples ([`Chooser::without_warmup`]), and starts at zstd:1, which on those frames
/// looks for matches of 5 bytes (`codec::ZSTD1_WIDE_MIN_MATCH`): within 0.8% of zstd:2's
/// bytes for ~18% less CPU, and raised to zstd:2 per frame while the link is behind
/// ([`ADAPT_QUEUED_SECS`]). Against a zstd:2 start, idle-guest saves (pool of alternating
/// passes, `docs/results/README.md`) use 10-20 ms less of the host's CPU for 0.5% more bytes;
/// zstd:2 on these frames stores what zstd:3 stores on 128 KiB frames for a fifth less CPU.
/// Fixed levels on 128 KiB frames (3 alternating passes of 5 rounds, idle guest, 128 / 512
/// MiB, save time over `zstd -1`'s by median): zstd:2 1.010 / 1.014, zstd:3 1.013 / 1.001,
/// zstd:4 1.070 / 1.073; zstd:4 stores 1.6% less but the save is bound by the 2 cores it
/// shares with QEMU and the storage server.
pub(crate) const SAVE_NETWORK_START: Codec = Codec::Zstd(1);
/// Bytes stored and not yet acknowledged by the backend (`Store::unsent_bytes`).
pub type Backlog = Box<dyn Fn() -> u64 + Send + Sync>;
/// A frame the chooser gives [`ADAPT_FROM`] is compressed with [`ADAPT_TO`] instead while
/// more than this many seconds of uploads, at the link's measured speed, are queued (the open
/// pack and the sealed packs not yet acknowledged): the link is then what holds the save back,
/// and the stronger level's extra CPU only slows a producer that is ahead anyway, as
/// `zstd --adapt` does. When the save is short of CPU instead, the queue stays short and the
/// frames keep the faster level. 30 ms is ~3.4 MB at 1 Gbit/s, one or two packs.
///
/// Measured (`bench save-restore --remote`, `docs/memory.md`): zstd:2 stores 4.5% fewer
/// bytes than zstd:1 on a 128 MiB guest's frames, but only 1–2% on the 256–1024 MiB guests',
/// for 25–45% more of the pool's CPU. With zstd:2 on every frame the link-bound 128 MiB save
/// gains (three alternating pairs of 5 rounds: median save / best QEMU stream 0.87–0.98
/// against 0.94–1.01) while the larger saves pay the CPU for little; raised per frame, the
/// 128 MiB save is 0.85 of the best stream by median (5 rounds, none slower) and the 512 MiB
/// save is unchanged (two alternating pairs of 3 rounds: 1.118 / 1.081 s against 1.156 /
/// 1.091 s with zstd:1 throughout).
pub(crate) const ADAPT_QUEUED_SECS: f64 = 0.03;
/// The level raised when the link is behind, and what it is raised to.
pub(crate) const ADAPT_FROM: Codec = Codec::Zstd(1);
pub(crate) const ADAPT_TO: Codec = Codec::Zstd(2);
/// Frames sampled unconditionally at the start of a save.
pub(crate) const WARMUP_SAMPLES: u64 = 6;
/// With a start codec kept ([`Chooser::with_start`]), the warm-up samples one frame in this
/// many (frames 7, 15, ... 47) instead of the first six. A sample costs ~1.3 ms of CPU per
/// 128 KiB frame (every candidate, against ~0.25 ms for zstd:1 alone): six on the first
/// frames would be ~8 ms of the ~10 ms before a 128 MiB save's first pack can leave, with the
/// link idle (debug trace).
pub(crate) const WARMUP_SPREAD: u64 = 8;
/// After the warm-up, one frame in this many is sampled (16 MiB of 128 KiB frames). A sample
/// compresses its frame with every candidate, ~3.4x the work of zstd:1 alone (zstd:3 is
/// ~2.2x); at one in 64 that is ~8% of a 128 MiB save's compressing CPU (`perf`), which on
/// a 2-core host is the save's bottleneck. The sample's output for the chosen codec is also
/// what the store keeps ([`Chooser::codec_for_frame`]), not compressed again.
pub(crate) const SAMPLE_EVERY: u64 = 128;
/// Samples per codec kept in the sliding window.
pub(crate) const WINDOW: usize = 24;

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

//! Compression codecs for stored frames: none, LZ4 (lz4_flex) and zstd at a level.
//!
//! A codec is chosen per write (per frame), and recorded in every index entry as one byte plus
//! the level, so readers never need the writer's configuration. Decompression is bounded: the
//! index carries the frame's raw length, which is capped (`MAX_FRAME_RAW`), and a frame that
//! does not decompress to exactly that length is corrupt.
//!
//! zstd contexts are costly to start (a workspace allocated and page-faulted on first use), so
//! each thread keeps one per level it uses, taken from and returned to a process-wide pool of
//! warm ones; a memory save fills that pool on a helper thread before its stream arrives.

use std::fmt;
use std::str::FromStr;

/// Shannon entropy of the byte histogram of `parts` together, in bits per byte (0 if empty):
/// how disks (`disk::block_codec`) and memory saves (`memory/ingest`) tell uniform bytes,
/// which no codec shrinks, without a trial compression.
pub(crate) fn byte_entropy(parts: &[&[u8]]) -> f64 {
    // Four histograms filled in turn, so consecutive equal bytes do not stall on one counter.
    let mut h = [[0u32; 256]; 4];
    let mut total = 0usize;
    for s in parts {
        total += s.len();
        let mut quads = s.chunks_exact(4);
        for q in &mut quads {
            h[0][q[0] as usize] += 1;
            h[1][q[1] as usize] += 1;
            h[2][q[2] as usize] += 1;
            h[3][q[3] as usize] += 1;
        }
        for &b in quads.remainder() {
            h[0][b as usize] += 1;
        }
    }
    if total == 0 {
        return 0.0;
    }
    let n = total as f64;
    let mut bits = 0.0;
    let [h0, h1, h2, h3] = &h;
    for (((a, b), c), d) in h0.iter().zip(h1).zip(h2).zip(h3) {
        let c = (a + b + c + d) as f64;
        if c > 0.0 {
            let p = c / n;
            bits -= p * p.log2();
        }
    }
    bits
}

thread_local! {
    // zstd compression contexts, one per level in use on this thread: a memory save moves
    // frames between levels 1 and 2 as its upload queue grows and shrinks. A thread that ends
    // (a save's pool worker) hands them to `ZSTD_POOL` for the next.
    static ZSTD_C: std::cell::RefCell<ThreadCompressors> = const { std::cell::RefCell::new(ThreadCompressors(Vec::new())) };
    static ZSTD_D: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { std::cell::RefCell::new(None) };
}

/// Warm zstd compression contexts not owned by any thread, by level. A context's first
/// compression allocates and page-faults its workspace (~1 MiB at level 3 for a 128 KiB
/// frame): on these hosts ~6 ms of a save's first frames per pool worker, while the link
/// waits for the first pack. Contexts come here from threads that ended and from
/// [`prewarm_zstd`], which a save runs while its QMP set-up goes back and forth.
static ZSTD_POOL: parking_lot::Mutex<Vec<(i32, zstd::bulk::Compressor<'static>)>> =
    parking_lot::Mutex::new(Vec::new());

/// Pooled contexts kept per level (beyond this they are freed).
fn pool_cap() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 16)
}

fn pool_put(level: i32, c: zstd::bulk::Compressor<'static>) {
    let mut p = ZSTD_POOL.lock();
    if p.iter().filter(|(l, _)| *l == level).count() < pool_cap() {
        p.push((level, c));
    }
}

fn pool_take(level: i32) -> Option<zstd::bulk::Compressor<'static>> {
    let mut p = ZSTD_POOL.lock();
    let i = p.iter().position(|(l, _)| *l == level)?;
    Some(p.swap_remove(i).1)
}

struct ThreadCompressors(Vec<(i32, zstd::bulk::Compressor<'static>)>);

impl Drop for ThreadCompressors {
    fn drop(&mut self) {
        for (l, c) in self.0.drain(..) {
            pool_put(l, c);
        }
    }
}

/// Run `f` with this thread's zstd context for `level` (taken from the pool, or created),
/// telling it whether the context is new (never compressed, so its first use also pays for
/// its workspace). None if zstd refuses the level.
pub fn with_zstd_compressor<R>(
    level: i32,
    f: impl FnOnce(&mut zstd::bulk::Compressor<'static>, bool) -> R,
) -> Option<R> {
    ZSTD_C.with(|t| {
        let mut t = t.borrow_mut();
        let (i, fresh) = match t.0.iter().position(|(l, _)| *l == level) {
            Some(i) => (i, false),
            None => {
                let (c, fresh) = match pool_take(level) {
                    Some(c) => (c, false),
                    None => (zstd_compressor(level)?, true),
                };
                t.0.push((level, c));
                (t.0.len() - 1, fresh)
            }
        };
        Some(f(&mut t.0[i].1, fresh))
    })
}

/// Make sure `per_level` warm contexts exist for each of `levels` (pooled or owned by live
/// threads is not known here: this counts only the pool), each warmed by one compression of
/// a 128 KiB frame. Meant for a helper thread before a burst of compression.
pub fn prewarm_zstd(levels: &[i32], per_level: usize) {
    let want = per_level.min(pool_cap());
    if levels.iter().all(|&l| ZSTD_POOL.lock().iter().filter(|(pl, _)| *pl == l).count() >= want) {
        return;
    }
    // Text-like bytes: matches at every distance, so the hash and chain tables are touched
    // throughout, as real frames touch them.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let sample: Vec<u8> = (0..128 << 10)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b'a' + (x % 23) as u8
        })
        .collect();
    for &level in levels {
        let have = ZSTD_POOL.lock().iter().filter(|(l, _)| *l == level).count();
        for _ in have..per_level.min(pool_cap()) {
            let Some(mut c) = zstd_compressor(level) else { break };
            let _ = c.compress(&sample);
            pool_put(level, c);
        }
    }
}

/// Shortest match zstd level 1 looks for (zstd's own default at this frame size is 6). On a
/// 128 MiB guest's captured migration stream in 128 KiB frames, 7 compresses 16% faster for
/// 1.9% more bytes; a 128 MiB save to S3, bound by its compressing CPU on a 2-core host, takes
/// a median 0.315 s against 0.360 s and its restore 0.228 s against 0.239 s (10 alternating
/// rounds each). Readers are unaffected: zstd frames decode whatever the parameters that made
/// them.
pub(crate) const ZSTD1_MIN_MATCH: i32 = 7;

/// Shortest match zstd level 1 looks for in frames longer than [`ZSTD1_NARROW_FRAME`]: the
/// 256 KiB frames of a stop-and-copy save to a network backend, which is bound by its link
/// and short of CPU on a 2-core host. On a captured idle 512 MiB guest's 92 MB of non-zero
/// pages in 256 KiB blocks (`zstd -b1 -B256K --zstd=mml=N`, one core), minMatch 5 stores
/// 33.78 MB at ~715 MB/s, against zstd:1's usual 7 34.49 MB at ~750 and zstd level 2
/// 33.53 MB at ~590: within 0.8% of level 2's bytes for ~18% less CPU. An A/B pool of
/// idle-guest saves to S3 is in `docs/results/README.md`.
pub(crate) const ZSTD1_WIDE_MIN_MATCH: i32 = 5;

/// Frames up to this size (the 32-page frames of most memory writes, and disk blocks) use
/// [`ZSTD1_MIN_MATCH`] at level 1; longer ones [`ZSTD1_WIDE_MIN_MATCH`].
pub(crate) const ZSTD1_NARROW_FRAME: usize = 128 << 10;

/// The minimum match length a level-1 context should use for a frame of `len` bytes.
pub fn zstd1_min_match(len: usize) -> i32 {
    if len > ZSTD1_NARROW_FRAME {
        ZSTD1_WIDE_MIN_MATCH
    } else {
        ZSTD1_MIN_MATCH
    }
}

/// Compress `raw` with this thread's context for `level`, its parameters set for `raw`'s size
/// (see [`zstd1_min_match`]).
pub fn zstd_compress(
    c: &mut zstd::bulk::Compressor<'static>,
    level: i32,
    raw: &[u8],
) -> Option<Vec<u8>> {
    if level == 1 {
        c.set_parameter(zstd::zstd_safe::CParameter::MinMatch(zstd1_min_match(raw.len()) as u32))
            .ok()?;
    }
    c.compress(raw).ok()
}

/// A zstd compression context for `level`, with strata's parameters.
pub fn zstd_compressor(level: i32) -> Option<zstd::bulk::Compressor<'static>> {
    let mut c = zstd::bulk::Compressor::new(level).ok()?;
    if level == 1 {
        c.set_parameter(zstd::zstd_safe::CParameter::MinMatch(ZSTD1_MIN_MATCH as u32)).ok()?;
    }
    Some(c)
}

/// Largest decompressed frame the store accepts (16 MiB).
pub(crate) const MAX_FRAME_RAW: usize = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Codec {
    None,
    Lz4,
    Zstd(i32),
}

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("Unknown codec byte {0:#x}")]
    UnknownCodec(u8),
    #[error("Frame does not decompress with {codec}: {reason}")]
    Corrupt { codec: Codec, reason: String },
    #[error("Frame decompressed to {got} bytes, expected {expected}")]
    WrongLength { got: usize, expected: usize },
    #[error("Frame of {0} bytes exceeds the {MAX_FRAME_RAW}-byte cap")]
    TooLarge(usize),
    #[error("Unknown codec '{0}': use none, lz4 or zstd[:LEVEL]")]
    Parse(String),
}

impl Codec {
    /// On-disk encoding: (codec byte, level byte).
    pub fn to_bytes(self) -> (u8, u8) {
        match self {
            Codec::None => (0, 0),
            Codec::Lz4 => (1, 0),
            Codec::Zstd(l) => (2, l.clamp(1, 22) as u8),
        }
    }

    pub fn from_bytes(c: u8, level: u8) -> Result<Codec, CodecError> {
        match (c, level) {
            (0, 0) => Ok(Codec::None),
            (1, 0) => Ok(Codec::Lz4),
            (2, 1..=22) => Ok(Codec::Zstd(level as i32)),
            (other, _) => Err(CodecError::UnknownCodec(other)),
        }
    }

    /// Compress `raw`; returns `None` when compression does not save at least 1/32 of the
    /// bytes, in which case the caller stores the frame uncompressed.
    pub fn compress(self, raw: &[u8]) -> Option<Vec<u8>> {
        let out = match self {
            Codec::None => return None,
            Codec::Lz4 => lz4_flex::block::compress(raw),
            Codec::Zstd(level) => {
                with_zstd_compressor(level, |c, _| zstd_compress(c, level, raw))??
            }
        };
        if out.len() + raw.len() / 32 < raw.len() {
            Some(out)
        } else {
            None
        }
    }

    /// Decompress a frame that must expand to exactly `raw_len` bytes.
    pub fn decompress(self, stored: &[u8], raw_len: usize) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::new();
        self.decompress_into(stored, raw_len, &mut out)?;
        Ok(out)
    }

    /// As [`decompress`](Self::decompress), into `out`, whose allocation is reused: a restore
    /// decodes every frame into recycled buffers instead of touching fresh memory for each.
    /// On error `out` holds no meaningful bytes.
    pub fn decompress_into(
        self,
        stored: &[u8],
        raw_len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        if raw_len > MAX_FRAME_RAW {
            return Err(CodecError::TooLarge(raw_len));
        }
        let corrupt = |reason: String| CodecError::Corrupt { codec: self, reason };
        match self {
            Codec::None => {
                out.clear();
                out.extend_from_slice(stored);
            }
            Codec::Lz4 => {
                // A recycled buffer usually has the length already: no zero-fill then.
                out.resize(raw_len, 0);
                let n = lz4_flex::block::decompress_into(stored, out)
                    .map_err(|e| corrupt(e.to_string()))?;
                out.truncate(n);
            }
            Codec::Zstd(_) => {
                out.clear();
                out.reserve_exact(raw_len);
                ZSTD_D
                    .with(|d| {
                        let mut d = d.borrow_mut();
                        if d.is_none() {
                            *d = zstd::bulk::Decompressor::new().ok();
                        }
                        match d.as_mut() {
                            Some(d) => d.decompress_to_buffer(stored, out),
                            None => zstd::bulk::Decompressor::new()
                                .and_then(|mut d| d.decompress_to_buffer(stored, out)),
                        }
                    })
                    .map_err(|e| corrupt(e.to_string()))?;
            }
        }
        if out.len() != raw_len {
            return Err(CodecError::WrongLength { got: out.len(), expected: raw_len });
        }
        Ok(())
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::None => f.write_str("none"),
            Codec::Lz4 => f.write_str("lz4"),
            Codec::Zstd(l) => write!(f, "zstd:{l}"),
        }
    }
}

impl FromStr for Codec {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Codec, CodecError> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "none" | "raw" => Ok(Codec::None),
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd(1)),
            _ => {
                if let Some(l) = s.strip_prefix("zstd:").or_else(|| s.strip_prefix("zstd-")) {
                    let l: i32 = l.parse().map_err(|_| CodecError::Parse(s.clone()))?;
                    if (1..=22).contains(&l) {
                        return Ok(Codec::Zstd(l));
                    }
                }
                Err(CodecError::Parse(s))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text-like bytes whose matches come in every length, so the minimum match changes the
    /// output.
    fn wordy(len: usize, seed: u64) -> Vec<u8> {
        let words: [&[u8]; 8] =
            [b"page ", b"cache ", b"kernel ", b"slab", b"\x00\x00\x01", b"ab", b"vmalloc ", b"zz"];
        let mut x = seed | 1;
        let mut out = Vec::with_capacity(len + 16);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(words[(x % 8) as usize]);
            out.push((x >> 8) as u8 % 7);
        }
        out.truncate(len);
        out
    }

    fn fresh_level1(mml: i32, raw: &[u8]) -> Vec<u8> {
        let mut c = zstd::bulk::Compressor::new(1).unwrap();
        c.set_parameter(zstd::zstd_safe::CParameter::MinMatch(mml as u32)).unwrap();
        c.compress(raw).unwrap()
    }

    /// Level 1 compresses frames up to 128 KiB with minMatch 7 and longer ones with 5, on the
    /// same thread-cached context in any order: each frame gets what a fresh context with its
    /// size's parameter makes, so a wide frame never leaves its setting to a narrow one.
    #[test]
    fn zstd1_min_match_follows_the_frame_size() {
        let narrow = wordy(ZSTD1_NARROW_FRAME, 7);
        let wide = wordy(2 * ZSTD1_NARROW_FRAME, 9);
        assert_eq!(zstd1_min_match(narrow.len()), ZSTD1_MIN_MATCH);
        assert_eq!(zstd1_min_match(narrow.len() + 1), ZSTD1_WIDE_MIN_MATCH);
        let (n7, w5) =
            (fresh_level1(ZSTD1_MIN_MATCH, &narrow), fresh_level1(ZSTD1_WIDE_MIN_MATCH, &wide));
        // The two settings differ on these bytes, so the comparisons below can tell them apart.
        assert_ne!(n7, fresh_level1(ZSTD1_WIDE_MIN_MATCH, &narrow));
        assert_ne!(w5, fresh_level1(ZSTD1_MIN_MATCH, &wide));
        for _ in 0..2 {
            assert_eq!(Codec::Zstd(1).compress(&wide).unwrap(), w5);
            assert_eq!(Codec::Zstd(1).compress(&narrow).unwrap(), n7);
        }
        // The path of a caller that times its compression (this thread's context from
        // `with_zstd_compressor`, then `zstd_compress`) makes the same frame.
        let kept = with_zstd_compressor(1, |c, _| zstd_compress(c, 1, &wide)).unwrap();
        assert_eq!(kept.unwrap(), w5);
        assert_eq!(Codec::Zstd(1).decompress(&w5, wide.len()).unwrap(), wide);
    }

    #[test]
    fn round_trip_every_codec() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        for c in [Codec::Lz4, Codec::Zstd(1), Codec::Zstd(3)] {
            let z = c.compress(&data).expect("compressible");
            assert!(z.len() < data.len());
            assert_eq!(c.decompress(&z, data.len()).unwrap(), data);
            let (b, l) = c.to_bytes();
            assert_eq!(Codec::from_bytes(b, l).unwrap(), c);
        }
        assert!(Codec::None.compress(&data).is_none());
    }

    #[test]
    fn decompress_into_reuses_a_buffer_and_still_checks_the_length() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        let half = &data[..32768];
        for c in [Codec::Lz4, Codec::Zstd(1)] {
            let z = c.compress(&data).unwrap();
            let zh = c.compress(half).unwrap();
            // A recycled buffer, larger than the frame and holding old bytes.
            let mut buf = vec![0xeeu8; 2 * data.len()];
            c.decompress_into(&zh, half.len(), &mut buf).unwrap();
            assert_eq!(buf, half);
            c.decompress_into(&z, data.len(), &mut buf).unwrap();
            assert_eq!(buf, data);
            // A frame that expands beyond its recorded length is corrupt, even with room.
            let mut big = Vec::with_capacity(4 * data.len());
            assert!(c.decompress_into(&z, half.len(), &mut big).is_err());
            assert!(c.decompress_into(&zh, data.len(), &mut big).is_err());
        }
        let mut buf = vec![1u8; 10];
        Codec::None.decompress_into(b"abcd", 4, &mut buf).unwrap();
        assert_eq!(buf, b"abcd");
    }

    #[test]
    fn incompressible_data_is_stored_raw() {
        let data: Vec<u8> = (0..4096).map(|_| rand::random::<u8>()).collect();
        assert!(Codec::Lz4.compress(&data).is_none());
    }

    #[test]
    fn corrupt_frames_are_errors_not_panics() {
        let data = vec![7u8; 65536];
        let mut z = Codec::Lz4.compress(&data).unwrap();
        z[3] ^= 0xff;
        let _ = Codec::Lz4.decompress(&z, data.len()); // must not panic
        assert!(Codec::Lz4.decompress(&z[..z.len() / 2], data.len()).is_err());
        assert!(Codec::Zstd(1).decompress(b"garbage", 10).is_err());
        assert!(matches!(Codec::None.decompress(b"abc", 4), Err(CodecError::WrongLength { .. })));
        assert!(matches!(
            Codec::Lz4.decompress(b"", MAX_FRAME_RAW + 1),
            Err(CodecError::TooLarge(_))
        ));
    }

    #[test]
    fn parse_names() {
        assert_eq!("zstd:3".parse::<Codec>().unwrap(), Codec::Zstd(3));
        assert_eq!("LZ4".parse::<Codec>().unwrap(), Codec::Lz4);
        assert!("gzip".parse::<Codec>().is_err());
        assert!("zstd:99".parse::<Codec>().is_err());
    }
}

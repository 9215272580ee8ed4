//! `strata-bench codecs`: the guest's memory captured with QEMU's `exec:cat`, cut into 64 KiB
//! frames, and every codec's ratio, compress and decompress speeds measured on them one thread
//! at a time, with the expected transfer speeds Speed × (1 − Rate): the rate at which a
//! codec removes bytes from the stream.

use super::*;

#[derive(Clone, Copy, Debug)]
pub(super) enum BenchCodec {
    Lz4,
    Zstd(i32),
    Deflate,
    Huffman,
    #[cfg(feature = "lzo")]
    Lzo,
}

impl BenchCodec {
    pub(super) fn name(self) -> String {
        match self {
            BenchCodec::Lz4 => "lz4".into(),
            BenchCodec::Zstd(l) => format!("zstd:{l}"),
            BenchCodec::Deflate => "deflate:6".into(),
            BenchCodec::Huffman => "huffman-only".into(),
            #[cfg(feature = "lzo")]
            BenchCodec::Lzo => "lzo1x-1".into(),
        }
    }
}

fn deflate(input: &[u8], level: u8, strategy: i32, out: &mut Vec<u8>) {
    use miniz_oxide::deflate::core::{
        compress, create_comp_flags_from_zip_params, CompressorOxide, TDEFLFlush, TDEFLStatus,
    };
    let flags = create_comp_flags_from_zip_params(level.into(), 0, strategy);
    let mut c = CompressorOxide::new(flags);
    out.clear();
    out.resize(input.len() + input.len() / 8 + 64, 0);
    let (mut inp, mut pos) = (input, 0);
    loop {
        let (st, n_in, n_out) = compress(&mut c, inp, &mut out[pos..], TDEFLFlush::Finish);
        pos += n_out;
        inp = &inp[n_in..];
        match st {
            TDEFLStatus::Done => break,
            TDEFLStatus::Okay => out.resize(out.len() * 2, 0),
            _ => panic!("deflate failed"),
        }
    }
    out.truncate(pos);
}

/// Compress every frame, then decompress and compare; returns (stored, comp s, decomp s).
pub(super) fn run_codec(c: BenchCodec, frames: &[&[u8]]) -> Result<(u64, f64, f64)> {
    let mut outs: Vec<Vec<u8>> = Vec::with_capacity(frames.len());
    let t = Instant::now();
    match c {
        BenchCodec::Lz4 => frames.iter().for_each(|f| outs.push(lz4_flex::block::compress(f))),
        BenchCodec::Zstd(l) => {
            let mut z = zstd::bulk::Compressor::new(l)?;
            for f in frames {
                outs.push(z.compress(f)?);
            }
        }
        BenchCodec::Deflate | BenchCodec::Huffman => {
            let strategy = match c {
                BenchCodec::Huffman => {
                    miniz_oxide::deflate::core::CompressionStrategy::HuffmanOnly as i32
                }
                _ => 0,
            };
            for f in frames {
                let mut o = Vec::new();
                deflate(f, 6, strategy, &mut o);
                outs.push(o);
            }
        }
        #[cfg(feature = "lzo")]
        BenchCodec::Lzo => {
            let mut ctx = rust_lzo::LZOContext::new();
            for f in frames {
                let mut o = Vec::with_capacity(rust_lzo::worst_compress(f.len()));
                let e = ctx.compress(f, &mut o);
                anyhow::ensure!(matches!(e, rust_lzo::LZOError::OK), "lzo compress failed");
                outs.push(o);
            }
        }
    }
    let comp = t.elapsed().as_secs_f64();
    let stored: u64 = outs.iter().zip(frames).map(|(o, f)| o.len().min(f.len()) as u64).sum();
    let mut buf = vec![0u8; 64 << 10];
    let t = Instant::now();
    let mut zd = zstd::bulk::Decompressor::new()?;
    for (o, f) in outs.iter().zip(frames) {
        let n = match c {
            BenchCodec::Lz4 => {
                lz4_flex::block::decompress_into(o, &mut buf).map_err(|e| anyhow::anyhow!("{e}"))?
            }
            BenchCodec::Zstd(_) => zd.decompress_to_buffer(o, &mut buf)?,
            BenchCodec::Deflate | BenchCodec::Huffman => {
                let v = miniz_oxide::inflate::decompress_to_vec(o)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                buf[..v.len()].copy_from_slice(&v);
                v.len()
            }
            #[cfg(feature = "lzo")]
            BenchCodec::Lzo => {
                let (d, e) = rust_lzo::LZOContext::decompress_to_slice(o, &mut buf);
                anyhow::ensure!(matches!(e, rust_lzo::LZOError::OK), "lzo decompress failed");
                d.len()
            }
        };
        anyhow::ensure!(&buf[..n] == *f, "{} did not round-trip", c.name());
    }
    Ok((stored, comp, t.elapsed().as_secs_f64()))
}

/// Capture the guest's memory with QEMU's own `exec:cat`, return non-zero pages in stream
/// order and the page counts (total, zero, distinct).
fn capture(q: &mut QmpClient, file: &Path) -> Result<(Vec<u8>, u64, u64, u64)> {
    qemu_save(q, &format!("exec:cat > {}", file.display()), false)?;
    let mut pages = Vec::new();
    let (mut total, mut zero) = (0u64, 0u64);
    let mut distinct = std::collections::HashSet::new();
    {
        let mut sink = |ev: Event<'_>| -> std::result::Result<(), SinkError> {
            match ev {
                Event::Page { data, .. } => {
                    total += 1;
                    if data.iter().all(|&b| b == 0) {
                        zero += 1;
                    } else {
                        distinct.insert(strata::ChunkId::of(data));
                        pages.extend_from_slice(data);
                    }
                }
                Event::Zero { .. } => {
                    total += 1;
                    zero += 1;
                }
                _ => {}
            }
            Ok(())
        };
        let mut p = Parser::default();
        let mut f = std::fs::File::open(file)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            p.feed(&buf[..n], &mut sink)?;
        }
        p.finish(&mut sink)?;
    }
    std::fs::remove_file(file).ok();
    Ok((pages, total, zero, distinct.len() as u64))
}

#[derive(serde::Serialize)]
struct CodecRow {
    codec: String,
    ratio: f64,
    comp_mb_s: f64,
    decomp_mb_s: f64,
    /// Compression speed x (1 - ratio): the save speed the codec can sustain.
    expected_save_mb_s: f64,
    /// Decompression speed x (1 - ratio): the restore speed the codec can sustain.
    expected_restore_mb_s: f64,
}

pub(super) fn bench_codecs(
    mem: u32,
    sample_mib: u32,
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
    let tmp = scratch_dir(scratch)?;
    let fx = Fixtures::ensure()?;
    eprintln!("bench codecs: booting a {mem} MiB guest with the desktop workload");
    let (g, w, mut q) = desktop_guest(&fx, mem, Machine::Pc, "codecs")?;
    let (pages, total, zero, distinct) = capture(&mut q, &tmp.path().join("capture.bin"))?;
    drop(g);
    let data_pages = pages.len() as u64 / 4096;
    eprintln!("  captured {total} pages: {zero} zero, {data_pages} non-zero ({distinct} distinct)");
    // Evenly spaced 64 KiB frames (16 consecutive stream pages), sample_mib in all.
    let frames_all: Vec<&[u8]> = pages.chunks(64 << 10).filter(|f| f.len() == 64 << 10).collect();
    let want = ((sample_mib as usize) << 20) / (64 << 10);
    let step = (frames_all.len() / want.max(1)).max(1);
    let frames: Vec<&[u8]> = frames_all.iter().step_by(step).take(want).copied().collect();
    let raw: u64 = frames.iter().map(|f| f.len() as u64).sum();
    eprintln!("  {} frames of 64 KiB ({} MiB) sampled", frames.len(), raw >> 20);
    #[allow(unused_mut)]
    let mut codecs = vec![
        BenchCodec::Lz4,
        BenchCodec::Zstd(1),
        BenchCodec::Zstd(3),
        BenchCodec::Deflate,
        BenchCodec::Huffman,
    ];
    #[cfg(feature = "lzo")]
    codecs.push(BenchCodec::Lzo);
    let mut rows = Vec::new();
    for c in codecs {
        let (stored, cs, ds) = run_codec(c, &frames)?;
        let rate = stored as f64 / raw as f64;
        let (cm, dm) = (raw as f64 / 1e6 / cs, raw as f64 / 1e6 / ds);
        let r = CodecRow {
            codec: c.name(),
            ratio: rate,
            comp_mb_s: cm,
            decomp_mb_s: dm,
            expected_save_mb_s: cm * (1.0 - rate),
            expected_restore_mb_s: dm * (1.0 - rate),
        };
        eprintln!(
            "  {:<13} ratio {:>6.2}%  comp {:>7.1} MB/s  decomp {:>7.1} MB/s  expected save {:>7.1} MB/s  restore {:>7.1} MB/s",
            r.codec,
            r.ratio * 100.0,
            r.comp_mb_s,
            r.decomp_mb_s,
            r.expected_save_mb_s,
            r.expected_restore_mb_s
        );
        rows.push(r);
    }
    let mut csv = String::from(
        "codec,ratio,comp_mb_s,decomp_mb_s,expected_save_mb_s,expected_restore_mb_s\n",
    );
    for r in &rows {
        csv += &format!(
            "{},{:.4},{:.1},{:.1},{:.1},{:.1}\n",
            r.codec,
            r.ratio,
            r.comp_mb_s,
            r.decomp_mb_s,
            r.expected_save_mb_s,
            r.expected_restore_mb_s
        );
    }
    let json = serde_json::json!({
        "benchmark": "codecs",
        "command": format!("strata-bench codecs --mem {mem} --sample {sample_mib}"),
        "columns": "ratio = compressed/raw; expected_* = speed x (1 - ratio)",
        "data": {
            "guest_mib": mem, "workload": w, "pages": total, "zero_pages": zero, "nonzero_pages": data_pages,
            "distinct_nonzero_pages": distinct, "sampled_bytes": raw, "frame_bytes": 65536,
            "what": "guest memory captured with QEMU migrate exec:cat; non-zero pages in stream order, 16 per frame; one thread per codec"
        },
        "env": env_json(),
        "lzo_built": cfg!(feature = "lzo"),
        "rows": rows,
    });
    let cats: Vec<String> = rows.iter().map(|r| r.codec.clone()).collect();
    let speeds = bars(
        &format!("Codecs on {} MiB of a {mem} MiB desktop guest's memory (one core)", raw >> 20),
        "MB/s",
        &cats,
        &[
            Series { name: "compress".into(), values: rows.iter().map(|r| r.comp_mb_s).collect() },
            Series {
                name: "decompress".into(),
                values: rows.iter().map(|r| r.decomp_mb_s).collect(),
            },
            Series {
                name: "comp x (1-rate)".into(),
                values: rows.iter().map(|r| r.expected_save_mb_s).collect(),
            },
            Series {
                name: "decomp x (1-rate)".into(),
                values: rows.iter().map(|r| r.expected_restore_mb_s).collect(),
            },
        ],
    );
    let ratio = bars(
        "Compressed size / raw (lower is better)",
        "ratio",
        &cats,
        &[Series { name: "ratio".into(), values: rows.iter().map(|r| r.ratio).collect() }],
    );
    write_outputs(out, "codecs", csv, &json, stack(vec![speeds, ratio]))
}

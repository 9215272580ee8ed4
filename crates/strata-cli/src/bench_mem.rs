//! `strata bench codecs | save-restore | live`: the VM-memory benchmarks of issue 4, on a real
//! TCG guest (`strata::fixtures` memory guest with the golden desktop disk attached).
//!
//! Every run boots the guest, loads the *desktop workload* — the golden disk's binaries,
//! libraries and data read into memory page-cache style (`text`), then anonymous memory with
//! 10% zero, 50% repeated and 40% unique random pages (`fill`) — so that most of RAM is
//! touched and the data is neither synthetic-only nor cherry-picked. Results go to
//! `docs/results/bench-<name>.{csv,json,svg}`, and every comparison is measured in the same
//! run, because these 2-core machines are noisy:
//! * `codecs` (paper 000, Tables 1–2): ratio, compress and decompress MB/s and the expected
//!   transfer speeds Speed × (1 − Rate) of each codec on 64 KiB frames of the captured memory.
//! * `save-restore` (000, Figs 2–3): per guest size, save and restore time and stored bytes
//!   of strata against QEMU's `exec:cat > file` + `sync`, `exec:zstd -1`, `exec:lzop`.
//! * `live` (002, Tables 1–4): a guest dirtying memory at set rates, checkpointed by
//!   background-snapshot, precopy + cont and stop-and-copy: pause, total time, pages sent,
//!   stored and skipped by dedup, plus the cost of a second (incremental) checkpoint.
//!
//! LZO is GPL, so it is only built with the bench-only `lzo` cargo feature.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Subcommand;
use strata::fixtures::{Fixtures, Machine};
use strata::memory::manifest::Mode;
use strata::memory::restore::RestoreOptions;
use strata::memory::save::{save, SaveOptions, SaveReport};
use strata::memory::stream::{Event, Parser, SinkError};
use strata::progress::NoProgress;
use strata::qmp::QmpClient;
use strata::store::{InitOptions, Store};

use crate::bench_guest::{
    available_mib, CheckpointCost, boot, desktop_guest, dirty_checkpoint, env_json, machine, qemu_restore, qemu_save, qmp_of,
    restore_verified, scratch_dir, stack, start_dest, write_outputs, LIVE_MODES,
};
use crate::chart::{bars, Series};

#[derive(Subcommand)]
pub enum MemBenchCmd {
    /// Codec ratio and speed on memory captured from a real guest (paper 000, Tables 1 and 2).
    Codecs {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 1024)]
        mem: u32,
        /// MiB of captured non-zero pages each codec compresses (evenly sampled).
        #[arg(long, default_value_t = 256)]
        sample: u32,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        /// Scratch directory (default: a temp dir under /var/tmp).
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Save and restore time and stored bytes vs QEMU exec:cat + sync, zstd -1 and lzop
    /// (paper 000, Figs 2 and 3).
    SaveRestore {
        /// Guest sizes in MiB.
        #[arg(long, value_delimiter = ',', default_value = "128,256,384,512,768,1024,2048")]
        sizes: Vec<u32>,
        /// pc or q35.
        #[arg(long, default_value = "pc")]
        machine: String,
        /// Also boot this many guests from the same image and save them all into one store
        /// (dedup across VMs); 0 skips.
        #[arg(long, default_value_t = 5)]
        vms: u32,
        /// RAM of each of those guests, MiB.
        #[arg(long, default_value_t = 512)]
        vms_mem: u32,
        /// Save to and restore from an emulated 1 Gbit/s storage host (S3 for strata, files
        /// there for the QEMU streams); --vms is ignored (needs root).
        #[arg(long)]
        remote: bool,
        /// Restore decoder threads for --remote (4 fetchers keep the ranged GETs in flight);
        /// default: what `strata vm restore` uses, the host's cores (12 until session 14).
        #[arg(long)]
        restore_workers: Option<usize>,
        /// Codec of strata's saves for --remote: auto (measured per batch) or a fixed one
        /// (none, lz4, zstd:N), to compare the chooser against a fixed codec.
        #[arg(long, default_value = "auto")]
        codec: strata::memory::codec_choice::CodecPolicy,
        /// Rounds for --remote: every method saves and restores once per round, the methods
        /// taking turns at going first; medians are reported (the link and 2 cores are noisy).
        #[arg(long, default_value_t = 4)]
        rounds: u32,
        /// For --remote: do not warm host memory before each timed step. These hosts are VMs
        /// that hand free memory back to their hypervisor; by default every method's save and
        /// restore is preceded by touching and freeing memory, outside its clock, so it gets
        /// backed pages as on bare metal (see docs/results/README.md).
        #[arg(long)]
        no_warm: bool,
        /// For --remote: restore as a host that did not save the checkpoint. strata keeps the
        /// page maps it writes in the saving host's local tree cache; this deletes them before
        /// every strata restore, so they cross the link as on any other host.
        #[arg(long)]
        cold_maps: bool,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Would QEMU's multifd make a save cheaper? The QEMU side measured alone: one stopped
    /// desktop guest migrated into exec:cat + sync, strata vm save, a drained unix socket and
    /// multifd with N drained channels (wall time, CPU of QEMU and of the receiver).
    Multifd {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 2048)]
        mem: u32,
        /// pc or q35.
        #[arg(long, default_value = "pc")]
        machine: String,
        /// multifd-channels values to try.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        channels: Vec<u32>,
        /// Rounds of every method (medians are reported).
        #[arg(long, default_value_t = 3)]
        reps: u32,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
    /// Live checkpoints of a guest dirtying memory (paper 002, Tables 1-4).
    Live {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 1024)]
        mem: u32,
        /// Dirtying rates in MiB/s.
        #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
        rates: Vec<u32>,
        /// Keep the pages in Redis on an emulated 1 Gbit/s storage host (needs root).
        #[arg(long)]
        redis: bool,
        #[arg(long, default_value = "docs/results")]
        out: PathBuf,
        #[arg(long)]
        scratch: Option<PathBuf>,
    },
}

pub fn run(cmd: &MemBenchCmd) -> Result<()> {
    match cmd {
        MemBenchCmd::Codecs {
            mem,
            sample,
            out,
            scratch,
        } => bench_codecs(*mem, *sample, out, scratch.as_deref()),
        MemBenchCmd::SaveRestore {
            sizes,
            machine,
            remote: true,
            restore_workers,
            codec,
            rounds,
            no_warm,
            cold_maps,
            out,
            scratch,
            ..
        } => crate::bench_remote_mem::bench_save_restore_remote(sizes, machine, restore_workers.unwrap_or_else(|| strata::memory::restore::RestoreOptions::default().workers), *codec, *rounds, !*no_warm, *cold_maps, out, scratch.as_deref()),
        MemBenchCmd::SaveRestore {
            sizes,
            machine,
            vms,
            vms_mem,
            out,
            scratch,
            ..
        } => bench_save_restore(sizes, machine, *vms, *vms_mem, out, scratch.as_deref()),
        MemBenchCmd::Multifd {
            mem,
            machine,
            channels,
            reps,
            out,
            scratch,
        } => crate::bench_multifd::bench_multifd(*mem, machine, channels, *reps, out, scratch.as_deref()),
        MemBenchCmd::Live {
            mem,
            rates,
            redis: true,
            out,
            scratch,
        } => crate::bench_remote_mem::bench_live_redis(*mem, rates, out, scratch.as_deref()),
        MemBenchCmd::Live {
            mem,
            rates,
            out,
            scratch,
            ..
        } => bench_live(*mem, rates, out, scratch.as_deref()),
    }
}

// ---------------------------------------------------------------------------------------------
// bench codecs
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum BenchCodec {
    Lz4,
    Zstd(i32),
    Deflate,
    Huffman,
    #[cfg(feature = "lzo")]
    Lzo,
}

impl BenchCodec {
    fn name(self) -> String {
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
fn run_codec(c: BenchCodec, frames: &[&[u8]]) -> Result<(u64, f64, f64)> {
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
                BenchCodec::Huffman => miniz_oxide::deflate::core::CompressionStrategy::HuffmanOnly as i32,
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
            BenchCodec::Lz4 => lz4_flex::block::decompress_into(o, &mut buf).map_err(|e| anyhow::anyhow!("{e}"))?,
            BenchCodec::Zstd(_) => zd.decompress_to_buffer(o, &mut buf)?,
            BenchCodec::Deflate | BenchCodec::Huffman => {
                let v = miniz_oxide::inflate::decompress_to_vec(o).map_err(|e| anyhow::anyhow!("{e:?}"))?;
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
    /// Speed_Comp x (1 - Rate): paper Table 2, equation (3).
    expected_save_mb_s: f64,
    /// Speed_Decomp x (1 - Rate): equation (4).
    expected_restore_mb_s: f64,
}

fn bench_codecs(mem: u32, sample_mib: u32, out: &Path, scratch: Option<&Path>) -> Result<()> {
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
    let mut csv = String::from("codec,ratio,comp_mb_s,decomp_mb_s,expected_save_mb_s,expected_restore_mb_s\n");
    for r in &rows {
        csv += &format!(
            "{},{:.4},{:.1},{:.1},{:.1},{:.1}\n",
            r.codec, r.ratio, r.comp_mb_s, r.decomp_mb_s, r.expected_save_mb_s, r.expected_restore_mb_s
        );
    }
    let json = serde_json::json!({
        "benchmark": "codecs",
        "command": format!("strata bench codecs --mem {mem} --sample {sample_mib}"),
        "paper": "000 Tables 1 and 2 (ratio = compressed/raw; expected = speed x (1 - ratio))",
        "paper_table_1": [
            {"codec": "quickLZ", "ratio": 0.4571, "comp_mb_s": 76.92, "decomp_mb_s": 76.94},
            {"codec": "LZO", "ratio": 0.4743, "comp_mb_s": 105.76, "decomp_mb_s": 141.02},
            {"codec": "huffman", "ratio": 0.6162, "comp_mb_s": 40.29, "decomp_mb_s": 120.88},
            {"codec": "deflate", "ratio": 0.3349, "comp_mb_s": 13.22, "decomp_mb_s": 120.88}
        ],
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
        &format!(
            "Codecs on {} MiB of a {mem} MiB desktop guest's memory (one core)",
            raw >> 20
        ),
        "MB/s",
        &cats,
        &[
            Series {
                name: "compress".into(),
                values: rows.iter().map(|r| r.comp_mb_s).collect(),
            },
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
        &[Series {
            name: "ratio".into(),
            values: rows.iter().map(|r| r.ratio).collect(),
        }],
    );
    write_outputs(out, "codecs", csv, &json, stack(vec![speeds, ratio]))
}

// ---------------------------------------------------------------------------------------------
// bench save-restore
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, serde::Serialize)]
struct SrRow {
    mem_mib: u32,
    method: String,
    save_s: f64,
    restore_s: f64,
    stored_bytes: u64,
    save_vs_cat: f64,
    restore_vs_cat: f64,
    stored_vs_cat: f64,
    verified: bool,
}

pub(crate) fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn bench_save_restore(
    sizes: &[u32],
    mach: &str,
    vms: u32,
    vms_mem: u32,
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
    let m = machine(mach)?;
    let tmp = scratch_dir(scratch)?;
    let fx = Fixtures::ensure()?;
    let mut rows: Vec<SrRow> = Vec::new();
    let mut workloads = Vec::new();
    let mut reports: Vec<(u32, SaveReport)> = Vec::new();
    for &mem in sizes {
        let dir = tmp.path().join(format!("m{mem}"));
        std::fs::create_dir_all(&dir)?;
        eprintln!("bench save-restore: {mem} MiB guest ({mach})");
        let (g, w, mut q) = desktop_guest(&fx, mem, m, &format!("sr{mem}"))?;
        let methods: [(&str, String, String); 3] = [
            (
                "exec:cat+sync",
                format!("exec:cat > {}/cat.bin", dir.display()),
                format!("exec:cat {}/cat.bin", dir.display()),
            ),
            (
                "exec:zstd -1",
                format!("exec:zstd -1 -q > {}/zstd.bin", dir.display()),
                format!("exec:zstd -dc {}/zstd.bin", dir.display()),
            ),
            (
                "exec:lzop",
                format!("exec:lzop -c > {}/lzop.bin", dir.display()),
                format!("exec:lzop -dc {}/lzop.bin", dir.display()),
            ),
        ];
        let mut results: Vec<(String, f64, u64, PathBuf, String)> = Vec::new();
        for (name, save_uri, restore_uri) in &methods {
            let s = qemu_save(&mut q, save_uri, true)?;
            let file = dir.join(format!(
                "{}.bin",
                name.trim_start_matches("exec:").split(['+', ' ']).next().unwrap_or("x")
            ));
            eprintln!("  {name:<14} save {s:>6.2} s  {} MB", file_len(&file) / 1_000_000);
            results.push((name.to_string(), s, file_len(&file), file, restore_uri.clone()));
        }
        // strata: stop-and-copy into a fresh local store (fsync'd packs, index, ref).
        let store = Store::init_local(&dir.join("store"), InitOptions::default())?;
        let r = save(&store, &mut q, "bench", &SaveOptions::new(Mode::Save), &NoProgress)?;
        q.cont()?;
        eprintln!(
            "  {:<14} save {:>6.2} s  {} MB stored (codec {}: {})",
            "strata",
            r.total_ms / 1e3,
            r.stored_bytes / 1_000_000,
            r.codec.chosen,
            r.codec.why
        );
        let cat_save = results[0].1;
        let cat_bytes = results[0].2;
        // Restores, each into a fresh destination QEMU.
        let mut cat_restore = 0.0;
        for (i, (name, s, bytes, _, uri)) in results.iter().enumerate() {
            let mut d = start_dest(&g, &dir, &format!("dst{i}"))?;
            let t = qemu_restore(&mut d, uri)?;
            if i == 0 {
                cat_restore = t;
            }
            eprintln!("  {name:<14} restore {t:>6.2} s");
            rows.push(SrRow {
                mem_mib: mem,
                method: name.clone(),
                save_s: *s,
                restore_s: t,
                stored_bytes: *bytes,
                save_vs_cat: s / cat_save,
                restore_vs_cat: t / cat_restore,
                stored_vs_cat: *bytes as f64 / cat_bytes as f64,
                verified: false,
            });
        }
        let mut d = start_dest(&g, &dir, "dst-strata")?;
        let rr = restore_verified(&store, "bench", &mut d, &w, RestoreOptions::default())?;
        let t = rr.total_ms / 1e3;
        let verified = true;
        eprintln!("  {:<14} restore {t:>6.2} s (memwork sum verified)", "strata");
        rows.push(SrRow {
            mem_mib: mem,
            method: "strata".into(),
            save_s: r.total_ms / 1e3,
            restore_s: t,
            stored_bytes: r.stored_bytes,
            save_vs_cat: r.total_ms / 1e3 / cat_save,
            restore_vs_cat: t / cat_restore,
            stored_vs_cat: r.stored_bytes as f64 / cat_bytes as f64,
            verified,
        });
        drop(d);
        drop(store);
        drop(g);
        workloads.push(serde_json::json!({"mem_mib": mem, "workload": w}));
        reports.push((mem, r));
        std::fs::remove_dir_all(&dir).ok();
    }

    // N guests booted from the same image, each saved into two stores: one with delta pages
    // against the previous guest (the default), one with --no-delta. One fixed codec (lz4) for
    // every save, so the ratios measure dedup and deltas, not the adaptive codec's choices.
    let mut multi = serde_json::Value::Null;
    if vms > 0 {
        let mem = vms_mem;
        let dir = tmp.path().join("multi");
        std::fs::create_dir_all(&dir)?;
        let store = Store::init_local(&dir.join("store"), InitOptions::default())?;
        let plain = Store::init_local(&dir.join("store-no-delta"), InitOptions::default())?;
        // The guests as booted with the shared workload only (before each user's own data).
        let shared = Store::init_local(&dir.join("store-shared"), InitOptions::default())?;
        let mut opts = SaveOptions::new(Mode::Save);
        opts.codec = strata::memory::codec_choice::CodecPolicy::Fixed(strata::Codec::Lz4);
        let mut no_delta = opts.clone();
        no_delta.mode = Mode::BackgroundSnapshot;
        no_delta.base = strata::memory::delta::BasePolicy::Off;
        let mut live = opts.clone();
        live.mode = Mode::BackgroundSnapshot;
        let mut per_shared = Vec::new();
        let mut per = Vec::new();
        let mut per_plain = Vec::new();
        let mut delta_pages = Vec::new();
        let mut deltas = Vec::new();
        let mut save_s = Vec::new();
        let mut save_plain_s = Vec::new();
        for i in 0..vms {
            let mut g = boot(&fx, mem, m, &format!("multi{i}"))?;
            // Same image and binaries; each user's anonymous data differs (own seed).
            let usable = available_mib(&mut g)?.saturating_sub(40).max(8);
            let t = Duration::from_secs(600);
            g.command(&format!("text {}", (usable / 2).min(240)), t)?;
            let mut q = qmp_of(&g)?;
            let sh = save(&shared, &mut q, &format!("vm{i}"), &live, &NoProgress)?;
            eprintln!("  vm{i}: booted + shared workload: stored {} MB", sh.stored_bytes / 1_000_000);
            per_shared.push(sh.stored_bytes);
            g.command(&format!("fill {} 10 50 {}", (usable / 8).max(4), 100 + i), t)?;
            // QEMU refuses a second migration after a completed stop-and-copy, so the
            // --no-delta store gets a live background-snapshot checkpoint first (the idle
            // guest's state a moment earlier), then the delta store the `vm save`.
            let p = save(&plain, &mut q, &format!("vm{i}"), &no_delta, &NoProgress)?;
            let r = save(&store, &mut q, &format!("vm{i}"), &opts, &NoProgress)?;
            let dp = r.delta.as_ref().map_or(0, |d| d.pages);
            if let Some(d) = &r.delta {
                eprintln!(
                    "  vm{i}: delta against {}: {} tried, {} paid ({} bytes of runs, {} records), {} batches skipped",
                    d.base, d.attempts, d.pages, d.bytes, d.records, d.skipped_batches
                );
            }
            deltas.push(r.delta.clone());
            eprintln!(
                "  vm{i}: stored {} MB with deltas ({} pages new, {} as deltas against {}, {} deduplicated; save {:.2} s), {} MB without ({:.2} s)",
                r.stored_bytes / 1_000_000,
                r.pages_stored,
                dp,
                r.delta.as_ref().map_or("-", |d| d.base.as_str()),
                r.pages_deduped,
                r.total_ms / 1e3,
                p.stored_bytes / 1_000_000,
                p.total_ms / 1e3,
            );
            per.push(r.stored_bytes);
            per_plain.push(p.stored_bytes);
            delta_pages.push(dp);
            save_s.push(r.total_ms / 1e3);
            save_plain_s.push(p.total_ms / 1e3);
        }
        let total: u64 = per.iter().sum();
        let total_plain: u64 = per_plain.iter().sum();
        let total_shared: u64 = per_shared.iter().sum();
        eprintln!(
            "  {vms} guests of {mem} MiB booted from one image with the shared workload only: {} MB in all, {:.2}x one guest",
            total_shared / 1_000_000,
            total_shared as f64 / per_shared[0] as f64
        );
        eprintln!(
            "  {vms} guests of {mem} MiB from one image: {} MB in all, {:.2}x one guest with deltas; {} MB, {:.2}x without",
            total / 1_000_000,
            total as f64 / per[0] as f64,
            total_plain / 1_000_000,
            total_plain as f64 / per_plain[0] as f64
        );
        multi = serde_json::json!({
            "guests": vms, "mem_mib": mem, "codec": "lz4 (fixed for every save)",
            "stored_bytes_each": per, "stored_bytes_total": total,
            "total_vs_one": total as f64 / per[0] as f64,
            "delta_pages_each": delta_pages, "delta_each": deltas, "save_s_each": save_s,
            "no_delta": {"stored_bytes_each": per_plain, "stored_bytes_total": total_plain,
                         "total_vs_one": total_plain as f64 / per_plain[0] as f64, "save_s_each": save_plain_s},
            "workload": "same kernel, initramfs and golden disk; text of half the free memory (at most 240 MiB) of the golden files, the same for all, + fill of 1/8 of the free memory with a per-guest seed",
            "shared_workload_only": {"stored_bytes_each": per_shared, "stored_bytes_total": total_shared,
                "total_vs_one": total_shared as f64 / per_shared[0] as f64,
                "how": "background snapshot (deltas on) of each guest after boot + the shared text workload, before its per-user fill"},
        });
        drop((store, plain, shared));
        std::fs::remove_dir_all(&dir).ok();
    }

    let mut csv = String::from(
        "mem_mib,method,save_s,restore_s,stored_bytes,save_vs_cat,restore_vs_cat,stored_vs_cat,verified\n",
    );
    for r in &rows {
        csv += &format!(
            "{},{},{:.3},{:.3},{},{:.3},{:.3},{:.3},{}\n",
            r.mem_mib,
            r.method,
            r.save_s,
            r.restore_s,
            r.stored_bytes,
            r.save_vs_cat,
            r.restore_vs_cat,
            r.stored_vs_cat,
            r.verified
        );
    }
    let json = serde_json::json!({
        "benchmark": "save-restore",
        "command": format!("strata bench save-restore --sizes {} --machine {mach} --vms {vms} --vms-mem {vms_mem}", sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")),
        "paper": "000 Figs 2 and 3",
        "how": "one guest per size; each QEMU baseline: stop, migrate to the URI, wait, then `sync` (save time runs from the stop and includes the sync, as strata's includes its own stop), cont; strata: `vm save` into a fresh local store (durable packs, index and ref). Restores: a fresh QEMU with the same arguments and -incoming defer -S; time from migrate-incoming to completed (strata: the whole `vm restore`, including target checks and verification of every page); strata's restored guest is resumed and its memwork `sum` compared",
        "workloads": workloads,
        "strata_reports": reports.iter().map(|(m, r)| serde_json::json!({"mem_mib": m, "report": r})).collect::<Vec<_>>(),
        "same_image_guests": multi,
        "env": env_json(),
        "rows": rows,
    });
    let cats: Vec<String> = sizes.iter().map(|s| format!("{s} MiB")).collect();
    let method_names = ["exec:cat+sync", "exec:zstd -1", "exec:lzop", "strata"];
    let series = |f: &dyn Fn(&SrRow) -> f64| -> Vec<Series> {
        method_names
            .iter()
            .map(|mname| Series {
                name: mname.to_string(),
                values: sizes
                    .iter()
                    .map(|s| {
                        rows.iter()
                            .find(|r| r.mem_mib == *s && r.method == *mname)
                            .map(f)
                            .unwrap_or(0.0)
                    })
                    .collect(),
            })
            .collect()
    };
    let svg = stack(vec![
        bars(
            "Save time (stop-and-copy, durable)",
            "seconds",
            &cats,
            &series(&|r| r.save_s),
        ),
        bars(
            "Restore time (until QEMU has loaded)",
            "seconds",
            &cats,
            &series(&|r| r.restore_s),
        ),
        bars("Stored bytes", "MB", &cats, &series(&|r| r.stored_bytes as f64 / 1e6)),
    ]);
    write_outputs(out, "save-restore", csv, &json, svg)
}

// ---------------------------------------------------------------------------------------------
// bench live
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, serde::Serialize)]
struct LiveRow {
    #[serde(flatten)]
    cost: CheckpointCost,
    pause_vs_save: f64,
    total_vs_save: f64,
}

impl std::ops::Deref for LiveRow {
    type Target = CheckpointCost;
    fn deref(&self) -> &CheckpointCost {
        &self.cost
    }
}

fn bench_live(mem: u32, rates: &[u32], out: &Path, scratch: Option<&Path>) -> Result<()> {
    let tmp = scratch_dir(scratch)?;
    let fx = Fixtures::ensure()?;
    eprintln!("bench live: {mem} MiB guest, dirtying at {rates:?} MiB/s");
    let (mut g, w, mut q) = desktop_guest(&fx, mem, Machine::Pc, "live")?;
    let mut rows: Vec<LiveRow> = Vec::new();
    let row = |rate: u32, label: &str, r: &SaveReport, written: u64| LiveRow {
        cost: CheckpointCost::of(rate, label, r, written),
        pause_vs_save: 0.0,
        total_vs_save: 0.0,
    };
    for &rate in rates {
        let mut this: Vec<LiveRow> = Vec::new();
        let mut bg_store: Option<Store> = None;
        for (label, mode) in LIVE_MODES {
            let sdir = tmp.path().join(format!("r{rate}-{}", mode.as_str()));
            let store = Store::init_local(&sdir, InitOptions::default())?;
            let (r, written) = dirty_checkpoint(&mut g, &mut q, &store, "ckpt", mode, rate, rate, Duration::from_secs(1))?;
            let lr = row(rate, label, &r, written);
            eprintln!(
                "  {rate:>4} MiB/s {label:<20} pause {:>8.1} ms  total {:>7.0} ms  sent {:>7}  stored {:>7}  dedup {:>7}  ({written} dirtied)",
                lr.pause_ms, r.total_ms, r.pages_sent, r.pages_stored, r.pages_deduped
            );
            this.push(lr);
            if mode == Mode::BackgroundSnapshot {
                bg_store = Some(store);
            } else {
                drop(store);
                std::fs::remove_dir_all(&sdir).ok();
            }
        }
        // A second background snapshot 5 s later into the same store: the incremental cost.
        if let Some(store) = bg_store {
            let (r, written) =
                dirty_checkpoint(&mut g, &mut q, &store, "ckpt2", Mode::BackgroundSnapshot, rate, rate + 1000, Duration::from_secs(5))?;
            let lr = row(rate, "2nd background-snapshot (+5 s)", &r, written);
            eprintln!(
                "  {rate:>4} MiB/s {:<20} pause {:>8.1} ms  total {:>7.0} ms  sent {:>7}  stored {:>7}  dedup {:>7}  ({written} dirtied)",
                "2nd bg-snapshot", lr.pause_ms, r.total_ms, r.pages_sent, r.pages_stored, r.pages_deduped
            );
            this.push(lr);
        }
        let (sp, st) = (this[0].pause_ms, this[0].total_ms);
        for r in &mut this {
            r.pause_vs_save = r.pause_ms / sp;
            r.total_vs_save = r.total_ms / st;
        }
        rows.extend(this);
    }
    drop(g);
    let mut csv = String::from("rate_mib_s,method,pause_ms,total_ms,pages_sent,pages_stored,pages_deduped,zero_pages,stored_bytes,guest_pages_dirtied,pause_vs_save,total_vs_save\n");
    for r in &rows {
        csv += &format!(
            "{},{},{:.2},{:.1},{},{},{},{},{},{},{:.4},{:.3}\n",
            r.rate_mib_s,
            r.method,
            r.pause_ms,
            r.total_ms,
            r.pages_sent,
            r.pages_stored,
            r.pages_deduped,
            r.zero_pages,
            r.stored_bytes,
            r.guest_pages_dirtied,
            r.pause_vs_save,
            r.total_vs_save
        );
    }
    let json = serde_json::json!({
        "benchmark": "live",
        "command": format!("strata bench live --mem {mem} --rates {}", rates.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")),
        "paper": "002 Tables 1-4",
        "how": "memwork `dirty RATE 0` rewrites RATE MiB/s of random pages of its regions while the checkpoint runs (started 1 s before). Each method saves into a fresh local store; the '2nd background-snapshot' row is a second checkpoint 5 s later into the first snapshot's store (incremental cost). Pause: STOP->RESUME from QMP events for the live modes, the whole stopped time for stop-and-copy. Stored/deduped count 4 KiB pages",
        "workload": w,
        "env": env_json(),
        "rows": rows,
    });
    let cats: Vec<String> = rows.iter().map(|r| format!("{} @{}", r.method, r.rate_mib_s)).collect();
    let svg = stack(vec![
        bars(
            "Guest pause per checkpoint",
            "ms",
            &cats,
            &[Series {
                name: "pause".into(),
                values: rows.iter().map(|r| r.pause_ms).collect(),
            }],
        ),
        bars(
            "Total checkpoint time",
            "ms",
            &cats,
            &[Series {
                name: "total".into(),
                values: rows.iter().map(|r| r.total_ms).collect(),
            }],
        ),
        bars(
            "Pages per checkpoint",
            "pages",
            &cats,
            &[
                Series {
                    name: "sent".into(),
                    values: rows.iter().map(|r| r.pages_sent as f64).collect(),
                },
                Series {
                    name: "stored".into(),
                    values: rows.iter().map(|r| r.pages_stored as f64).collect(),
                },
                Series {
                    name: "skipped by dedup".into(),
                    values: rows.iter().map(|r| r.pages_deduped as f64).collect(),
                },
            ],
        ),
    ]);
    write_outputs(out, "live", csv, &json, svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codecs_round_trip_and_rank() {
        let text: Vec<u8> = (0..(256 << 10))
            .map(|i| b"memory pages of a desktop guest "[i % 32])
            .collect();
        let frames: Vec<&[u8]> = text.chunks(64 << 10).collect();
        #[allow(unused_mut)]
        let mut codecs = vec![
            BenchCodec::Lz4,
            BenchCodec::Zstd(1),
            BenchCodec::Deflate,
            BenchCodec::Huffman,
        ];
        #[cfg(feature = "lzo")]
        codecs.push(BenchCodec::Lzo);
        for c in codecs {
            let (stored, cs, ds) = run_codec(c, &frames).unwrap();
            assert!(stored < text.len() as u64 / 2, "{}: {stored}", c.name());
            assert!(cs > 0.0 && ds > 0.0);
        }
        let (h, ..) = run_codec(BenchCodec::Huffman, &frames).unwrap();
        let (d, ..) = run_codec(BenchCodec::Deflate, &frames).unwrap();
        assert!(
            d < h,
            "deflate (LZ77 + Huffman) must beat Huffman alone on repetitive text"
        );
    }

    #[test]
    fn stacked_svg_offsets_charts() {
        let s = stack(vec!["<svg a></svg>".into(), "<svg b></svg>".into()]);
        assert!(s.contains("<svg y=\"0\" a>") && s.contains("<svg y=\"420\" b>") && s.contains("height=\"840\""));
    }
}

//! `strata-bench store`: chunk-store put/get throughput for 4 KiB and 64 KiB chunks with each
//! codec, against writing the same bytes to one file with fdatasync and reading them back.

use crate::chart::{bars, Series};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use strata::store::pack::ChunkKind;
use strata::store::{InitOptions, Store};
use strata::{ChunkId, Codec};

/// Realistic data: host binaries and libraries (what a golden desktop holds), read in a fixed
/// order, with one page in eight zeroed as in real images.
fn corpus(size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size);
    let mut files = Vec::new();
    for dir in ["/usr/lib/x86_64-linux-gnu", "/usr/bin", "/usr/share/doc", "/usr/lib"] {
        collect(Path::new(dir), &mut files, 4);
    }
    files.sort();
    for f in files {
        if out.len() >= size {
            break;
        }
        if let Ok(b) = std::fs::read(&f) {
            out.extend_from_slice(&b[..b.len().min(size - out.len())]);
        }
    }
    while out.len() < size {
        out.push((out.len() % 251) as u8);
    }
    for (i, page) in out.chunks_mut(4096).enumerate() {
        if i % 8 == 7 {
            page.fill(0);
        }
    }
    out
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>, depth: u32) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_file() {
            files.push(e.path());
        } else if ft.is_dir() && depth > 0 {
            collect(&e.path(), files, depth - 1);
        }
    }
}

#[derive(serde::Serialize)]
struct Row {
    case: String,
    chunk_size: usize,
    codec: String,
    bytes: usize,
    put_mib_s: f64,
    get_mib_s: f64,
    stored_bytes: u64,
    stored_ratio: f64,
    put_vs_file_write: f64,
    get_vs_file_read: f64,
}

fn mib_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
}

pub fn bench_store(size: u64, threads: usize, out: &Path, scratch: Option<&Path>) -> Result<()> {
    let size = size as usize;
    let tmp = match scratch {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir_in("/var/tmp").or_else(|_| tempfile::tempdir())?,
    };
    eprintln!(
        "bench store: {} MiB of host binaries/libraries, {threads} writer threads, scratch {}",
        size >> 20,
        tmp.path().display()
    );
    let data = corpus(size);

    // Baseline: the same bytes to one file, fdatasync, then read back.
    let f = tmp.path().join("baseline.bin");
    let t = Instant::now();
    {
        let mut fh = std::fs::File::create(&f)?;
        fh.write_all(&data)?;
        fh.sync_data()?;
    }
    let file_w = mib_s(size, t.elapsed().as_secs_f64());
    let t = Instant::now();
    let back = std::fs::read(&f)?;
    let file_r = mib_s(size, t.elapsed().as_secs_f64());
    anyhow::ensure!(back == data, "baseline read-back differs");
    drop(back);
    std::fs::remove_file(&f)?;

    let mut rows = Vec::new();
    for chunk in [4096usize, 65536] {
        for codec in [Codec::None, Codec::Lz4, Codec::Zstd(1), Codec::Zstd(3)] {
            let dir = tmp.path().join(format!("s-{chunk}-{codec}").replace(':', "_"));
            let store =
                Store::init_local(&dir, InitOptions { pack_size: 32 << 20, default_codec: codec })?;
            let t = Instant::now();
            let per = data.len().div_ceil(threads) / chunk * chunk + chunk;
            let ids: Vec<Vec<ChunkId>> = std::thread::scope(|sc| {
                let hs: Vec<_> = data
                    .chunks(per)
                    .map(|part| {
                        let store = store.clone();
                        sc.spawn(move || -> Result<Vec<ChunkId>> {
                            let ses = store.session();
                            part.chunks(chunk)
                                .map(|c| Ok(ses.put_with(c, ChunkKind::Data, codec)?))
                                .collect()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("writer thread")).collect::<Result<Vec<_>>>()
            })?;
            store.flush()?;
            let put_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut n = 0usize;
            for id in ids.iter().flatten() {
                n += store.get(id)?.len();
            }
            let get_s = t.elapsed().as_secs_f64();
            anyhow::ensure!(n == data.len(), "read back {n} of {} bytes", data.len());
            let stored: u64 = store.backend().list("packs/")?.iter().map(|o| o.size).sum();
            let (put, get) = (mib_s(size, put_s), mib_s(size, get_s));
            let row = Row {
                case: format!("{}K {codec}", chunk / 1024),
                chunk_size: chunk,
                codec: codec.to_string(),
                bytes: size,
                put_mib_s: put,
                get_mib_s: get,
                stored_bytes: stored,
                stored_ratio: stored as f64 / size as f64,
                put_vs_file_write: put / file_w,
                get_vs_file_read: get / file_r,
            };
            eprintln!(
                "  {:<14} put {:>7.0} MiB/s ({:.2}x file)  get {:>7.0} MiB/s ({:.2}x file)  stored {:.3} of input",
                row.case, put, row.put_vs_file_write, get, row.get_vs_file_read, row.stored_ratio
            );
            rows.push(row);
            drop(store);
            std::fs::remove_dir_all(&dir).ok();
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("Cannot create {}", out.display()))?;
    let mut csv = String::from("case,chunk_size,codec,bytes,put_mib_s,get_mib_s,stored_bytes,stored_ratio,put_vs_file_write,get_vs_file_read\n");
    for r in &rows {
        csv += &format!(
            "{},{},{},{},{:.1},{:.1},{},{:.4},{:.3},{:.3}\n",
            r.case,
            r.chunk_size,
            r.codec,
            r.bytes,
            r.put_mib_s,
            r.get_mib_s,
            r.stored_bytes,
            r.stored_ratio,
            r.put_vs_file_write,
            r.get_vs_file_read
        );
    }
    std::fs::write(out.join("bench-store.csv"), csv)?;
    let meta = serde_json::json!({
        "benchmark": "store",
        "command": format!("strata-bench store --size {}M --threads {threads}", size >> 20),
        "data": "host binaries and libraries (/usr/lib/x86_64-linux-gnu, /usr/bin, ...), every 8th page zero",
        "baseline": {"what": "same bytes written to one file + fdatasync, then read back", "write_mib_s": file_w, "read_mib_s": file_r},
        "env": crate::results::env_json(),
        "rows": rows,
    });
    std::fs::write(out.join("bench-store.json"), serde_json::to_string_pretty(&meta)?)?;
    let mut cats: Vec<String> = rows.iter().map(|r| r.case.clone()).collect();
    cats.push("file (cp+sync)".into());
    let mut put: Vec<f64> = rows.iter().map(|r| r.put_mib_s).collect();
    put.push(file_w);
    let mut get: Vec<f64> = rows.iter().map(|r| r.get_mib_s).collect();
    get.push(file_r);
    let svg = bars(
        &format!("strata chunk store: put/get throughput ({} MiB, {threads} writers)", size >> 20),
        "MiB/s",
        &cats,
        &[
            Series { name: "put (incl. flush)".into(), values: put },
            Series { name: "get (verified)".into(), values: get },
        ],
    );
    std::fs::write(out.join("bench-store.svg"), svg)?;
    eprintln!("wrote {}/bench-store.{{csv,json,svg}}", out.display());
    Ok(())
}

//! Disk benchmarks over the 1 Gbit/s storage host: `strata-bench io --remote` and
//! `strata-bench clone --remote`.
//!
//! * **io**: fio's nbd engine (iodepth 16) on a disk whose store is on the storage host's S3.
//!   strata serves it from this host (in-process NBD server on a unix socket), reading through
//!   the link with no SSD cache, with a cold cache (cleared first) and a warm one (the same
//!   reads again). Reads are fixed amounts of work (`io_size`) with a repeatable random
//!   sequence, so the warm run rereads exactly what the cold run fetched. The baseline is
//!   qemu-nbd running *on the storage host*, serving a raw and a qcow2 file there over TCP,
//!   which is where a user without strata keeps images. Writes: strata acknowledges writes
//!   from its local log (durable on a flush), and pushes data to the backend when it
//!   compacts; so the write rows measure the log, and the write-back (compaction to S3) is
//!   timed separately with its link bytes. qemu-nbd's writes cross the link before the reply.
//! * **clone**: N full clones of a large sparse image on the storage host. strata: the image
//!   is imported once into S3 (timed, reported), then each `clone --full` is a few small
//!   objects. Baseline: `qemu-img convert -n --target-is-zero` from a qemu-nbd serving the
//!   golden raw file on the storage host to a qemu-nbd serving a new sparse file there, so the
//!   data goes through this host and the link twice, as `cp` of an image on NFS would; only
//!   allocated extents are copied (NBD block status). Copies are fsynced on the storage host.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use strata::disk;
use strata::progress::NoProgress;
use strata::serve::DiskExports;
use strata::store::Store;
use strata::Codec;

use crate::chart::{bars, Series};
use crate::remote::{mb, Link, StorageHost};

/// Local strata NBD server over a store; stopping it flushes and compacts the disks.
struct Strata {
    handle: Option<strata::nbd::ServerHandle>,
    exports: Arc<DiskExports>,
    uri: String,
}

impl Strata {
    fn start(store: &Store, sock: &Path, disk: &str) -> Result<Strata> {
        let _ = std::fs::remove_file(sock);
        let server = strata::nbd::Server::bind_unix(sock)?;
        let exports = DiskExports::new(store.clone());
        let handle = server.serve(exports.clone())?;
        let uri = handle.uri(disk);
        Ok(Strata { handle: Some(handle), exports, uri })
    }

    /// Stop serving, then fold the logs into chunks (this is when data goes to the backend).
    fn stop(mut self) -> Result<Option<serde_json::Value>> {
        if let Some(h) = self.handle.take() {
            h.shutdown();
        }
        let vol =
            self.exports.volume("io").map(|v| serde_json::to_value(v.stats()).unwrap_or_default());
        self.exports.close_all()?;
        Ok(vol)
    }
}

/// qemu-nbd on the storage host, over TCP.
struct RemoteNbd {
    child: Child,
    uri: String,
}

impl RemoteNbd {
    fn start(
        host: &StorageHost,
        file: &Path,
        fmt: &str,
        port: u16,
        readonly: bool,
    ) -> Result<RemoteNbd> {
        let mut c = host.exec("qemu-nbd");
        c.args([
            "-f",
            fmt,
            "--cache=writeback",
            "--aio=threads",
            "-t",
            "-x",
            "x",
            "-b",
            &host.ip,
            "-p",
            &port.to_string(),
        ]);
        if readonly {
            c.arg("-r");
        }
        let child =
            c.arg(file).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        let addr: std::net::SocketAddr = format!("{}:{port}", host.ip).parse()?;
        let t = Instant::now();
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            ensure!(
                t.elapsed() < Duration::from_secs(30),
                "qemu-nbd on the storage host did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(RemoteNbd { child, uri: format!("nbd://{addr}/x") })
    }

    /// SIGTERM: qemu-nbd flushes and exits.
    fn stop(mut self) -> Result<()> {
        // SAFETY: signalling a process we started (`ip netns exec` execs qemu-nbd).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while self.child.try_wait()?.is_none() {
            if t.elapsed() > Duration::from_secs(60) {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for RemoteNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(serde::Serialize, Clone)]
struct IoRow {
    system: String,
    test: String,
    iops: f64,
    mib_s: f64,
    secs: f64,
    link: Link,
}

/// fio over NBD; `work` is a fixed io_size, or None for `runtime` seconds.
fn fio(
    uri: &str,
    rw: &str,
    bs: &str,
    region: &str,
    work: Option<&str>,
    runtime: u32,
) -> Result<(f64, f64)> {
    let mut c = Command::new("fio");
    c.args([
        "--name=t",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        &format!("--rw={rw}"),
        &format!("--bs={bs}"),
    ]);
    c.args([&format!("--size={region}"), "--iodepth=16", "--output-format=json", "--randrepeat=1"]);
    match work {
        Some(w) => c.arg(format!("--io_size={w}")),
        None => c.args([format!("--runtime={runtime}"), "--time_based=1".into()]),
    };
    let o = c.output().context("running fio")?;
    ensure!(o.status.success(), "fio {rw} failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value =
        serde_json::from_str(&text[text.find('{').context("fio printed no JSON")?..])?;
    let side = if rw.contains("read") { &v["jobs"][0]["read"] } else { &v["jobs"][0]["write"] };
    Ok((side["iops"].as_f64().unwrap_or(0.0), side["bw"].as_f64().unwrap_or(0.0) / 1024.0))
}

pub fn bench_io_remote(runtime: u32, out: &Path, scratch: Option<&Path>) -> Result<()> {
    for t in ["fio", "qemu-nbd", "qemu-img"] {
        crate::disk::ensure_tool(t)?;
    }
    let tmp = crate::guest::scratch_dir(scratch)?;
    let host = StorageHost::up(tmp.path())?;
    let dir = tmp.path();
    let size = 4u64 << 30;
    let region = "1G";
    // Reads are fixed work so that the warm-cache run rereads what the cold run fetched.
    let reads = [("4k randread", "randread", "4k", "64M"), ("1M read", "read", "1M", "1G")];
    let writes = [("4k randwrite", "randwrite", "4k"), ("1M write", "write", "1M")];
    let mut rows: Vec<IoRow> = Vec::new();
    let push = |rows: &mut Vec<IoRow>,
                system: &str,
                test: &str,
                (iops, mib): (f64, f64),
                secs: f64,
                link: Link| {
        eprintln!(
            "  {system:<18} {test:<13} {iops:>8.0} IOPS {mib:>7.1} MiB/s  link {:>6.0} MB",
            mb(link.total())
        );
        rows.push(IoRow { system: system.into(), test: test.into(), iops, mib_s: mib, secs, link });
    };

    // strata: the store on the storage host's S3, served here.
    eprintln!("bench io --remote: strata, store on S3 over the link");
    let local = dir.join("strata-local");
    let sock = dir.join("strata.sock");
    let (backend, _) = host.s3("io", None)?;
    let store = StorageHost::init_store(backend, &local, Codec::Lz4)?;
    disk::create(&store, "io", size)?;
    let s = Strata::start(&store, &sock, "io")?;
    let (l0, t) = (host.link(), Instant::now());
    fio(&s.uri, "write", "1M", region, Some(region), runtime)?;
    let fill = (t.elapsed().as_secs_f64(), host.link().since(l0));
    let (l0, t) = (host.link(), Instant::now());
    s.stop()?;
    store.flush()?;
    let wb = (t.elapsed().as_secs_f64(), host.link().since(l0));
    eprintln!(
        "  strata fill 1 GiB: {:.1} s, {:.0} MB over the link during it; write-back at close {:.1} s, {:.0} MB",
        fill.0,
        mb(fill.1.total()),
        wb.0,
        mb(wb.1.total())
    );
    let mut writeback = vec![
        serde_json::json!({"what": "fill 1 GiB (fio 1M write; the volume compacts to S3 when its log reaches its threshold, inside this time)",
        "fill_s": fill.0, "fill_link": fill.1, "close_writeback_s": wb.0, "close_link": wb.1}),
    ];
    drop(store);

    let meta = local.join("meta.redb");
    let cache_dir = dir.join("cache");
    std::fs::create_dir_all(&cache_dir)?;
    let (cached, cache) = host.s3("io", Some((&cache_dir, 2 << 30)))?;
    let cache = cache.context("cache")?;
    for (test, rw, bs, work) in reads {
        for mode in ["no cache", "cold cache", "warm cache"] {
            let backend = if mode == "no cache" { host.s3("io", None)?.0 } else { cached.clone() };
            if mode == "cold cache" {
                cache.clear();
            }
            let store = Store::open(backend, &meta)?;
            let s = Strata::start(&store, &sock, "io")?;
            let (l0, t) = (host.link(), Instant::now());
            let r = fio(&s.uri, rw, bs, region, Some(work), runtime)?;
            let secs = t.elapsed().as_secs_f64();
            let link = host.link().since(l0);
            s.stop()?;
            drop(store);
            cache.wait_idle();
            push(&mut rows, &format!("strata {mode}"), test, r, secs, link);
        }
    }
    let counters = serde_json::to_value(cache.counters()).unwrap_or_default();
    drop(cached);
    drop(cache);
    // Writes land in the local log; then the write-back is timed.
    {
        let store = Store::open(host.s3("io", None)?.0, &meta)?;
        let s = Strata::start(&store, &sock, "io")?;
        for (test, rw, bs) in writes {
            let (l0, t) = (host.link(), Instant::now());
            let r = fio(&s.uri, rw, bs, region, None, runtime)?;
            push(&mut rows, "strata", test, r, t.elapsed().as_secs_f64(), host.link().since(l0));
        }
        let (l0, t) = (host.link(), Instant::now());
        let stats = s.stop()?;
        store.flush()?;
        let wb = (t.elapsed().as_secs_f64(), host.link().since(l0));
        eprintln!("  strata write-back of the write tests (compaction to S3) {:.1} s, {:.0} MB over the link", wb.0, mb(wb.1.total()));
        writeback.push(serde_json::json!({"what": "after the two write tests", "writeback_s": wb.0, "link": wb.1, "volume_stats": stats}));
    }

    // qemu-nbd on the storage host, raw and qcow2 files on its disk.
    for (i, fmt) in ["raw", "qcow2"].into_iter().enumerate() {
        eprintln!("bench io --remote: qemu-nbd {fmt} on the storage host");
        let f = host.dir().join(format!("io.{fmt}"));
        let o = Command::new("qemu-img")
            .args(["create", "-q", "-f", fmt])
            .arg(&f)
            .arg(size.to_string())
            .output()?;
        ensure!(o.status.success(), "qemu-img create: {}", String::from_utf8_lossy(&o.stderr));
        let port = 10809 + i as u16;
        let n = RemoteNbd::start(&host, &f, fmt, port, false)?;
        fio(&n.uri, "write", "1M", region, Some(region), runtime)?;
        n.stop()?;
        let n = RemoteNbd::start(&host, &f, fmt, port, false)?;
        let system = format!("qemu-nbd {fmt} (storage host)");
        for (test, rw, bs, work) in reads {
            let (l0, t) = (host.link(), Instant::now());
            let r = fio(&n.uri, rw, bs, region, Some(work), runtime)?;
            push(&mut rows, &system, test, r, t.elapsed().as_secs_f64(), host.link().since(l0));
        }
        for (test, rw, bs) in writes {
            let (l0, t) = (host.link(), Instant::now());
            let r = fio(&n.uri, rw, bs, region, None, runtime)?;
            push(&mut rows, &system, test, r, t.elapsed().as_secs_f64(), host.link().since(l0));
        }
        n.stop()?;
        std::fs::remove_file(&f).ok();
    }
    drop(host);

    let get = |sys: &str, test: &str| {
        rows.iter().find(|r| r.system == sys && r.test == test).map(|r| r.mib_s).unwrap_or(0.0)
    };
    let raw = "qemu-nbd raw (storage host)";
    let tests = ["4k randread", "1M read", "4k randwrite", "1M write"];
    let systems = [
        "strata no cache",
        "strata cold cache",
        "strata warm cache",
        "strata",
        raw,
        "qemu-nbd qcow2 (storage host)",
    ];
    let mut ratios = serde_json::Map::new();
    for t in tests {
        for s in systems.iter().filter(|s| s.starts_with("strata") && get(s, t) > 0.0) {
            ratios.insert(
                format!("{t}: {s} / qemu-nbd raw"),
                serde_json::json!(get(s, t) / get(raw, t)),
            );
        }
    }
    for (k, v) in &ratios {
        eprintln!("  {k} = {:.2}", v.as_f64().unwrap_or(0.0));
    }
    std::fs::create_dir_all(out)?;
    let mut csv = String::from("system,test,iops,mib_s,secs,link_to_storage,link_from_storage\n");
    for r in &rows {
        csv += &format!(
            "{},{},{:.0},{:.1},{:.2},{},{}\n",
            r.system, r.test, r.iops, r.mib_s, r.secs, r.link.to_storage, r.link.from_storage
        );
    }
    std::fs::write(out.join("bench-io-remote.csv"), csv)?;
    let json = serde_json::json!({
        "benchmark": "io-remote",
        "command": format!("strata-bench io --remote --runtime {runtime}"),
        "link": "1 Gbit/s (tbf) between this host and the storage host",
        "method": "fio --ioengine=nbd --iodepth=16 --randrepeat=1 on a 1 GiB region of a 4 GiB disk, filled first. Reads are fixed work (4k randread: 64 MiB; 1M read: 1 GiB); writes run for `runtime` seconds. strata: store on the storage host's S3 (versitygw) behind a 1 Gbit/s tbf link, served by an in-process NBD server on a unix socket; every read case starts a new server (empty in-memory block cache); 'cold cache' clears the 2 GiB SSD cache first, 'warm cache' repeats the same reads. qemu-nbd: runs inside the storage host's namespace on a raw/qcow2 file there, fio connects over the link (nbd://)",
        "writes": "strata acknowledges writes from its local write log (durable at a flush); data reaches S3 when the log is compacted (on close here). The write rows measure the log; 'writeback' times the compaction to S3 and its link bytes. qemu-nbd's writes cross the link before each reply",
        "writeback": writeback,
        "cache_counters_after_reads": counters,
        "env": crate::results::env_json(),
        "rows": rows,
        "ratios": ratios,
    });
    std::fs::write(out.join("bench-io-remote.json"), serde_json::to_string_pretty(&json)?)?;
    let series: Vec<Series> = systems
        .iter()
        .map(|s| Series { name: s.to_string(), values: tests.iter().map(|t| get(s, t)).collect() })
        .collect();
    let svg = bars(
        "fio over NBD with the data on a 1 Gbit/s storage host (MiB/s, higher is better)",
        "MiB/s",
        &tests.map(String::from),
        &series,
    );
    std::fs::write(out.join("bench-io-remote.svg"), svg)?;
    eprintln!("wrote {}/bench-io-remote.{{csv,json,svg}}", out.display());
    Ok(())
}

#[derive(serde::Serialize)]
struct CloneRow {
    copies: usize,
    strata_s: f64,
    strata_link: Link,
    qemu_img_s: f64,
    qemu_img_link: Link,
    qemu_img_over_strata: f64,
}

fn free_bytes(p: &Path) -> u64 {
    // SAFETY: statvfs into a zeroed struct with a NUL-terminated path.
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap_or_default();
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return u64::MAX;
    }
    s.f_bavail as u64 * s.f_frsize as u64
}

pub fn bench_clone_remote(
    size: u64,
    data: u64,
    copies: &[usize],
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
    for t in ["qemu-nbd", "qemu-img"] {
        crate::disk::ensure_tool(t)?;
    }
    let tmp = crate::guest::scratch_dir(scratch)?;
    let most = copies.iter().copied().max().unwrap_or(1) as u64;
    let need = data * (most + 3);
    ensure!(
        free_bytes(tmp.path()) > need + (8 << 30),
        "Not enough disk space for {} copies of {} GiB of data: free {} GiB or pass --data smaller",
        most,
        data >> 30,
        need >> 30
    );
    let host = StorageHost::up(tmp.path())?;
    let img = tmp.path().join("golden.raw");
    eprintln!(
        "bench clone --remote: {} GiB image with {:.1} GiB of data on the storage host",
        size >> 30,
        data as f64 / (1u64 << 30) as f64
    );
    crate::disk::make_image(&img, size, data)?;
    // The baseline's golden image sits on the storage host (a local copy: setup, not measured).
    let golden = host.dir().join("golden.raw");
    let o = Command::new("cp").arg("--sparse=always").arg(&img).arg(&golden).output()?;
    ensure!(o.status.success(), "cp: {}", String::from_utf8_lossy(&o.stderr));
    // strata: import once into S3 (one-time cost, through the link).
    let (backend, _) = host.s3("clone", None)?;
    let store = StorageHost::init_store(backend, &tmp.path().join("strata-local"), Codec::Lz4)?;
    let (l0, t) = (host.link(), Instant::now());
    disk::import(&store, "golden", &img, Codec::Lz4, &NoProgress)?;
    let import = (t.elapsed().as_secs_f64(), host.link().since(l0));
    eprintln!(
        "  strata import (one-time): {:.1} s, {:.0} MB over the link",
        import.0,
        mb(import.1.total())
    );
    std::fs::remove_file(&img).ok();

    let src = RemoteNbd::start(&host, &golden, "raw", 10900, true)?;
    let mut rows = Vec::new();
    for &n in copies {
        let (l0, t) = (host.link(), Instant::now());
        for i in 0..n {
            disk::clone(&store, "golden", &format!("c{n}-{i}"), true)?;
        }
        let strata = (t.elapsed().as_secs_f64(), host.link().since(l0));
        for i in 0..n {
            disk::remove(&store, &format!("c{n}-{i}"))?;
        }
        let (l0, t) = (host.link(), Instant::now());
        let mut files: Vec<PathBuf> = Vec::new();
        for i in 0..n {
            let f = host.dir().join(format!("copy{i}.raw"));
            std::fs::File::create(&f)?.set_len(size)?;
            let dst = RemoteNbd::start(&host, &f, "raw", 10901, false)?;
            let o = Command::new("qemu-img")
                .args([
                    "convert",
                    "-n",
                    "--target-is-zero",
                    "-f",
                    "raw",
                    "-O",
                    "raw",
                    &src.uri,
                    &dst.uri,
                ])
                .output()?;
            ensure!(o.status.success(), "qemu-img convert: {}", String::from_utf8_lossy(&o.stderr));
            dst.stop()?;
            std::fs::File::open(&f)?.sync_all()?;
            files.push(f);
        }
        let q = (t.elapsed().as_secs_f64(), host.link().since(l0));
        for f in files {
            std::fs::remove_file(f).ok();
        }
        eprintln!(
            "  {n:>2} copies: strata {:.3} s ({:.2} MB over the link), qemu-img convert via NBD {:.1} s ({:.0} MB) -> {:.0}x",
            strata.0,
            mb(strata.1.total()),
            q.0,
            mb(q.1.total()),
            q.0 / strata.0
        );
        rows.push(CloneRow {
            copies: n,
            strata_s: strata.0,
            strata_link: strata.1,
            qemu_img_s: q.0,
            qemu_img_link: q.1,
            qemu_img_over_strata: q.0 / strata.0,
        });
    }
    src.stop()?;
    drop(store);
    drop(host);
    std::fs::create_dir_all(out)?;
    let mut csv = String::from("copies,strata_s,strata_link_bytes,qemu_img_convert_s,qemu_img_link_bytes,qemu_img_over_strata\n");
    for r in &rows {
        csv += &format!(
            "{},{:.4},{},{:.2},{},{:.1}\n",
            r.copies,
            r.strata_s,
            r.strata_link.total(),
            r.qemu_img_s,
            r.qemu_img_link.total(),
            r.qemu_img_over_strata
        );
    }
    std::fs::write(out.join("bench-clone-remote.csv"), csv)?;
    let gib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 30) as f64);
    let json = serde_json::json!({
        "benchmark": "clone-remote",
        "command": format!("strata-bench clone --remote --size {}G --data {}G --copies {}", size >> 30, gib(data),
            copies.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",")),
        "link": "1 Gbit/s (tbf) between this host and the storage host, which holds the image",
        "image": {"virtual_bytes": size, "data_bytes": data, "strata_import_s": import.0, "strata_import_link": import.1},
        "baseline": "qemu-img convert -n --target-is-zero -f raw -O raw from qemu-nbd serving the golden raw file on the storage host to qemu-nbd serving a new sparse file there (data crosses the link twice, only allocated extents), then fsync of the copy on the storage host; copies made one after another: what copying an image kept on network storage costs (cp over NFS reads and writes through the client too); S3 CopyObject of a 30 GiB raw object would copy 30 GiB on the server and needs the image uploaded whole",
        "env": crate::results::env_json(),
        "rows": rows,
    });
    std::fs::write(out.join("bench-clone-remote.json"), serde_json::to_string_pretty(&json)?)?;
    let cats: Vec<String> = rows.iter().map(|r| format!("{} copies", r.copies)).collect();
    let svg = bars(
        &format!(
            "Full clones of a {} GiB image holding {} GiB on a 1 Gbit/s storage host (seconds)",
            size >> 30,
            gib(data)
        ),
        "seconds",
        &cats,
        &[
            Series {
                name: "strata clone --full (S3)".into(),
                values: rows.iter().map(|r| r.strata_s).collect(),
            },
            Series {
                name: "qemu-img convert via NBD".into(),
                values: rows.iter().map(|r| r.qemu_img_s).collect(),
            },
        ],
    );
    std::fs::write(out.join("bench-clone-remote.svg"), svg)?;
    eprintln!("wrote {}/bench-clone-remote.{{csv,json,svg}}", out.display());
    Ok(())
}

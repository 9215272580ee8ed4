//! `strata-bench save-restore`, local: per guest size, save and restore time and
//! stored bytes of strata against QEMU's own `exec:` migrations to a file (`cat` + `sync`,
//! `zstd -1`, `lzop`), then `--vms` guests from one image saved into one store (what dedup and
//! deltas share). The `--remote` variant lives in `remote_mem.rs`.

use super::*;

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

pub(super) fn bench_save_restore(
    sizes: &[u32],
    mach: &str,
    vms: u32,
    vms_mem: u32,
    mix: &WorkloadMix,
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
        let (g, w, mut q) = workload_guest(&fx, mem, m, &format!("sr{mem}"), mix)?;
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
            eprintln!(
                "  vm{i}: booted + shared workload: stored {} MB",
                sh.stored_bytes / 1_000_000
            );
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
        "command": format!(
            "strata-bench save-restore --sizes {} --machine {mach} --vms {vms} --vms-mem {vms_mem}{}",
            sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","),
            if *mix == WorkloadMix::DESKTOP { String::new() } else { format!(" --workload {mix}") }
        ),
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
        bars("Save time (stop-and-copy, durable)", "seconds", &cats, &series(&|r| r.save_s)),
        bars("Restore time (until QEMU has loaded)", "seconds", &cats, &series(&|r| r.restore_s)),
        bars("Stored bytes", "MB", &cats, &series(&|r| r.stored_bytes as f64 / 1e6)),
    ]);
    write_outputs(out, &results_name("save-restore", mix), csv, &json, svg)
}

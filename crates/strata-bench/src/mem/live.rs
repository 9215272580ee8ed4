//! `strata-bench live`: a guest dirtying memory at set rates, checkpointed
//! by every live mode: pause, total time, pages sent, stored and skipped by dedup, plus the
//! cost of a second (incremental) checkpoint. The `--redis` variant is in `remote_mem.rs`.

use super::*;

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

pub(super) fn bench_live(
    mem: u32,
    rates: &[u32],
    out: &Path,
    scratch: Option<&Path>,
) -> Result<()> {
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
            let (r, written) = dirty_checkpoint(
                &mut g,
                &mut q,
                &store,
                "ckpt",
                mode,
                rate,
                rate,
                Duration::from_secs(1),
            )?;
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
            let (r, written) = dirty_checkpoint(
                &mut g,
                &mut q,
                &store,
                "ckpt2",
                Mode::BackgroundSnapshot,
                rate,
                rate + 1000,
                Duration::from_secs(5),
            )?;
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
        "command": format!("strata-bench live --mem {mem} --rates {}", rates.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")),
        "how": "memwork `dirty RATE 0` rewrites RATE MiB/s of random pages of its regions while the checkpoint runs (started 1 s before). Each method saves into a fresh local store; the '2nd background-snapshot' row is a second checkpoint 5 s later into the first snapshot's store (incremental cost). Pause: STOP->RESUME from QMP events for the live modes, the whole stopped time for stop-and-copy. Stored/deduped count 4 KiB pages",
        "workload": w,
        "env": env_json(),
        "rows": rows,
    });
    let cats: Vec<String> =
        rows.iter().map(|r| format!("{} @{}", r.method, r.rate_mib_s)).collect();
    let svg = stack(vec![
        bars(
            "Guest pause per checkpoint",
            "ms",
            &cats,
            &[Series { name: "pause".into(), values: rows.iter().map(|r| r.pause_ms).collect() }],
        ),
        bars(
            "Total checkpoint time",
            "ms",
            &cats,
            &[Series { name: "total".into(), values: rows.iter().map(|r| r.total_ms).collect() }],
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

#!/usr/bin/env bash
# Write latency under sustained scattered writes: fio 4 KiB random writes (nbd engine, iodepth
# 16) over a fresh 32 GiB strata disk for SECS seconds, with the default 1 GiB compaction
# threshold, so background folds run the whole time and each 4 KiB write costs a 64 KiB block
# when folded. Reports throughput and completion-latency percentiles up to the maximum: a
# writer held back by compaction shows as the maximum.
#
#   scripts/bench-write-stall.sh [SECS] LABEL=BINARY [LABEL=BINARY ...]
#   e.g. scripts/bench-write-stall.sh 180 before=/tmp/strata-unpaced now=target/release/strata
#
# Writes docs/results/bench-write-stall.{csv,json,svg} (override with OUT=dir). The store goes
# under ${SCRATCH:-/var/tmp}; needs fio (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=90
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then secs=$1; shift; fi
[ $# -ge 1 ] || { echo "usage: $0 [SECS] LABEL=BINARY ..." >&2; exit 2; }
out="${OUT:-docs/results}"
scratch="${SCRATCH:-/var/tmp}/strata-write-stall"
mkdir -p "$out"
runs=()
for spec in "$@"; do
  label="${spec%%=*}" bin="${spec#*=}"
  rm -rf "$scratch"; mkdir -p "$scratch"
  export STRATA_STORE="$scratch/store"
  "$bin" init >/dev/null
  "$bin" disk create --size 32G d >/dev/null
  sock="$scratch/nbd.sock"
  "$bin" serve --socket "$sock" >"$scratch/serve.log" 2>&1 &
  srv=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  fio --name=w --ioengine=nbd --uri="nbd+unix:///d?socket=$sock" --rw=randwrite --bs=4k \
    --size=32G --iodepth=16 --time_based=1 --runtime="$secs" \
    --percentile_list=50:99:99.9:99.99:100 --output-format=json >"$scratch/fio.json"
  kill "$srv"; wait "$srv" || true
  stats=$(grep -o '{"d":.*}' "$scratch/serve.log" | tail -1 || true)
  cp "$scratch/fio.json" "$out/.write-stall-$label.json"
  runs+=("$label|$bin|${stats:-{\}}")
  rm -rf "$scratch"
done
python3 - "$out" "$secs" "${runs[@]}" <<'PY'
import json, sys
out, secs, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = []
for r in runs:
    label, binary, stats = r.split("|", 2)
    p = f"{out}/.write-stall-{label}.json"
    s = open(p).read()
    w = json.loads(s[s.index("{"):])["jobs"][0]["write"]
    pc = w["clat_ns"]["percentile"]
    ms = lambda k: pc[k] / 1e6
    rows.append({"label": label, "binary": binary, "iops": w["iops"], "mib_s": w["bw"] / 1024,
                 "p50_ms": ms("50.000000"), "p99_ms": ms("99.000000"), "p99_9_ms": ms("99.900000"),
                 "p99_99_ms": ms("99.990000"), "max_ms": ms("100.000000"),
                 "server_stats": json.loads(stats) if stats.strip() not in ("", "{}") else None})
    import os; os.remove(p)
doc = {"benchmark": "write-stall", "what": "fio 4 KiB random writes, nbd engine, iodepth 16, over a fresh 32 GiB strata disk, default 1 GiB compaction threshold",
       "secs": secs, "rows": rows, "how": "scripts/bench-write-stall.sh " + str(secs) + " " + " ".join(f"{r['label']}=BINARY" for r in rows)}
json.dump(doc, open(f"{out}/bench-write-stall.json", "w"), indent=1)
with open(f"{out}/bench-write-stall.csv", "w") as f:
    f.write("label,iops,mib_s,p50_ms,p99_ms,p99_9_ms,p99_99_ms,max_ms\n")
    for r in rows:
        f.write(f"{r['label']},{r['iops']:.0f},{r['mib_s']:.1f},{r['p50_ms']:.2f},{r['p99_ms']:.1f},{r['p99_9_ms']:.1f},{r['p99_99_ms']:.1f},{r['max_ms']:.1f}\n")
# A bar chart of the maximum and p99.99 latency per label, log scale.
import math
W, H, bar = 780, 60 + 50 * len(rows), 18
top = max(r["max_ms"] for r in rows)
scale = lambda v: 480 * math.log10(max(v, 0.1) / 0.1) / math.log10(max(top, 1) / 0.1)
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<text x="10" y="20">Write completion latency, fio 4 KiB random writes over 32 GiB ({secs} s), log scale</text>']
for i, r in enumerate(rows):
    y = 40 + 50 * i
    svg.append(f'<text x="10" y="{y + 14}">{r["label"]}</text>')
    for j, (k, col) in enumerate((("max_ms", "#c44"), ("p99_99_ms", "#48c"))):
        svg.append(f'<rect x="120" y="{y + j * bar}" width="{scale(r[k]):.0f}" height="{bar - 2}" fill="{col}"/>')
        svg.append(f'<text x="{125 + scale(r[k]):.0f}" y="{y + j * bar + 12}">{k[:-3].replace("_", ".")} {r[k]:.1f} ms</text>')
svg.append("</svg>")
open(f"{out}/bench-write-stall.svg", "w").write("\n".join(svg))
for r in rows:
    print(f"{r['label']:>8}: {r['iops']:.0f} IOPS, {r['mib_s']:.1f} MiB/s, latency ms p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.1f} p99.9 {r['p99_9_ms']:.1f} p99.99 {r['p99_99_ms']:.1f} max {r['max_ms']:.1f}")
print(f"wrote {out}/bench-write-stall.{{csv,json,svg}}")
PY

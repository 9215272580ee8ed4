#!/usr/bin/env python3
"""Where does a remote save's CPU go? Per-thread CPU inside each save's clock (session 38).

`bench save-restore --remote` times every save from its `stop`; this script lines a system-wide
`perf` profile up with those clocks and sums the samples of each thread name inside them, for
strata's saves and for the `zstd -1` stream's, per save. Record with real-time stamps and the
QMP debug log (the save starts are found in it):

    perf record -a -F 1999 -k CLOCK_REALTIME -o /tmp/save.data -q &
    STRATA_LOG=strata::qmp=debug flock /tmp/strata-bench.lock target/release/strata-bench \\
        save-restore --remote --workload idle --sizes 512 --rounds 4 --out /tmp/sc > /tmp/sc.log 2>&1
    kill -INT %1
    scripts/save-cpu.py /tmp/sc.log /tmp/save.data /tmp/sc/bench-save-restore-remote-workload-idle.json

With `perf record -e page-faults -c 1` instead, pass `--per-sample 1` to count faults. `--comm
NAME` lists the symbols of one thread name inside the saves instead. `swapper` is idle time.
"""
import argparse, bisect, collections, datetime, json, re, subprocess


def ts(line):
    return datetime.datetime.strptime(line[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()


def save_windows(log_path, json_path):
    """(method, start, seconds) of every strata and `zstd -1` save, from the log and the rows."""
    log = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in open(log_path)]
    rows = collections.defaultdict(list)
    for r in json.load(open(json_path))["round_rows"]:
        rows[r["method"]].append(r)
    seen = collections.Counter()
    out = []
    for i, line in enumerate(log):
        kind = None
        if 'QMP execute cmd="stop"' in line:
            for later in log[i : i + 300]:
                m = re.match(r"\s+(exec:\S+(?: -1)?)\s+save", later)
                if m:
                    kind = m.group(1)
                    break
        elif 'QMP pipeline cmds=["query-migrate"' in line:
            kind = "strata"
        if kind is None:
            continue
        n = seen[kind]
        seen[kind] += 1
        if kind in ("strata", "exec:zstd -1") and n < len(rows[kind]):
            out.append((kind, ts(line), rows[kind][n]["save_s"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("perf_data")
    ap.add_argument("json")
    ap.add_argument("--per-sample", type=float, default=1e3 / 1999, help="ms per sample (1 to count events)")
    ap.add_argument("--comm", help="list this thread name's symbols instead")
    a = ap.parse_args()
    fields = "comm,tid,time,ip,sym" if a.comm else "comm,tid,time"
    cmd = ["perf", "script", "-i", a.perf_data, "-F", fields] + (["--comm", a.comm] if a.comm else [])
    samples = []
    for line in subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines():
        m = re.match(r"\s*(.+?)\s+(\d+)\s+([\d.]+):\s*(?:[0-9a-f]+\s+(.*))?", line)
        if m:
            samples.append((float(m.group(3)), (m.group(4) or "").strip()[:90] if a.comm else m.group(1).strip()))
    samples.sort()
    times = [s[0] for s in samples]
    totals = collections.defaultdict(collections.Counter)
    count = collections.Counter()
    for kind, t0, secs in save_windows(a.log, a.json):
        if a.comm and kind != "strata":
            continue
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_left(times, t0 + secs)
        totals[kind].update(s[1] for s in samples[lo:hi])
        count[kind] += 1
    for kind, c in totals.items():
        print(f"{kind}: {count[kind]} saves")
        for name, n in c.most_common(25):
            print(f"  {n * a.per_sample / count[kind]:8.1f} per save  {name}")


if __name__ == "__main__":
    main()

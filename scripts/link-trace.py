#!/usr/bin/env python3
"""Trace the benchmark link: where does a remote restore leave it idle? (session 27)

`record OUT` samples the byte counters of the storage host's veth (the `sh*` device that
`strata-bench ... --remote` creates) every millisecond until killed; run it at real-time
priority so its own samples are not late on a busy 2-core host:

    chrt -f 50 scripts/link-trace.py record /tmp/link.txt &
    STRATA_LOG=strata::memory=debug strata-bench save-restore --remote --cold-maps \\
        --workload random --sizes 512 --rounds 1 --out /tmp/lt > /tmp/lt.log 2>&1
    kill %1
    scripts/link-trace.py show /tmp/link.txt /tmp/lt.log

`show LINK LOG` lines the samples up with every strata restore in the log (its start is the
"checkpoint restored" line's time minus its total_ms) and prints, per restore, the first
400 ms in 10 ms windows (MB/s received from the storage host) and the milliseconds the link
lost in 5 ms windows below 100 MB/s, split into start (first 400 ms), middle and end.
"""
import datetime, os, re, sys, time


def record(out):
    dev = None
    with open(out, "w") as f:
        while True:
            if dev is None or not os.path.exists(f"/sys/class/net/{dev}"):
                devs = [d for d in os.listdir("/sys/class/net") if d.startswith("sh")]
                dev = devs[0] if devs else None
                if dev is None:
                    time.sleep(0.05)
                    continue
            try:
                base = f"/sys/class/net/{dev}/statistics/"
                rx = int(open(base + "rx_bytes").read())
                tx = int(open(base + "tx_bytes").read())
            except OSError:
                dev = None
                continue
            f.write(f"{time.time():.4f} {rx} {tx}\n")
            time.sleep(0.001)


def show(link, log):
    samples = [tuple(map(float, l.split())) for l in open(link)]

    def at(t):
        lo, hi = 0, len(samples) - 1
        while lo < hi:
            m = (lo + hi + 1) // 2
            if samples[m][0] <= t:
                lo = m
            else:
                hi = m - 1
        return samples[lo]

    def rate(start, a, b):
        s, e = at(start + a / 1e3), at(start + b / 1e3)
        return (e[1] - s[1]) / max(e[0] - s[0], 1e-6) / 1e6

    lines = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in open(log)]
    for end in (l for l in lines if "checkpoint restored" in l):
        total = float(re.search(r"total_ms=([\d.]+)", end).group(1))
        end_t = datetime.datetime.fromisoformat(end.split()[0].replace("Z", "+00:00")).timestamp()
        start = end_t - total / 1e3
        print(f"restore of {total:.1f} ms")
        for ms in range(0, 400, 10):
            print(f"  {ms:4d} ms  {rate(start, ms, ms + 10):6.1f} MB/s")
        lost, first = [0.0, 0.0, 0.0], None
        for ms in range(0, int(total), 5):
            r = rate(start, ms, ms + 5)
            if first is None and r > 60:
                first = ms
            if first is not None and r < 100:
                k = 0 if ms < 400 else (1 if ms < total - 100 else 2)
                lost[k] += (119.5 - r) / 119.5 * 5
        print(f"  first bytes at {first} ms; lost: start {lost[0]:.0f} ms, middle {lost[1]:.0f} ms, end {lost[2]:.0f} ms")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "show":
        show(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)

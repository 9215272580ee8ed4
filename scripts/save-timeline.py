#!/usr/bin/env python3
"""Where does a remote save's wall time go? One line per strata save, from the debug log (session 39).

A stop-and-copy save to S3 (`bench save-restore --remote`) is a pipeline: QMP set-up, QEMU's
stream into the parser and the pool, packs sealed and uploaded (at most two in flight), then
the page maps, the last pack, the ref and, in the bench, the wait until the storage host has
every object on disk. This script splits each save's clock at the points the debug log marks:

    STRATA_LOG=strata::qmp=debug,strata::store=debug,strata::memory=debug \\
        flock /tmp/strata-bench.lock target/release/strata-bench save-restore --remote \\
        --workload idle --sizes 128,512 --rounds 5 --out /tmp/tl > /tmp/tl.log 2>&1
    scripts/save-timeline.py /tmp/tl.log

Columns, in ms from the save's start (its first QMP query) unless noted:
  setup      until the `migrate-set-parameters, stop, migrate` pipeline was sent (pre-stop
             checks: the name's listing and the source's QMP queries; the guest still runs)
  first      the first pack sealed (the first upload can start)
  ram_end    the RAM section's end in the stream
  last_up    the last pack upload acknowledged
  commit     the checkpoint committed (ref written and, in the bench, every object durable)
  idle       time with no pack upload in flight between `first` and `last_up`: the link
             had nothing of this save to carry
  MB         pack bytes uploaded
  busy_MBps  MB / (last_up - first - idle): the link's rate while it was carrying packs
  packs      the number of packs
"""
import datetime, re, sys


def ts(line):
    return datetime.datetime.strptime(line[:26], "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def main(path):
    start = None
    cur = None
    print(f"{'total':>7} {'setup':>6} {'first':>6} {'ram_end':>7} {'last_up':>7} {'commit':>7} {'idle':>6} {'MB':>6} {'busy_MBps':>9} {'packs':>5}")
    for raw in open(path):
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw)
        if not re.match(r"\d{4}-\d\d-\d\dT", line):
            continue
        if 'QMP pipeline cmds=["query-migrate"' in line:
            start = ts(line)
            continue
        if 'QMP pipeline cmds=["migrate-set-parameters", "stop", "migrate"]' in line and start is not None:
            cur = dict(t0=start, setup=ts(line) - start, pending=0, idle=0.0, last_idle=None, first=None, last_up=None, ram_end=None, bytes=0, packs=0)
            continue
        if cur is None:
            continue
        t = ts(line) - cur["t0"]
        if "pack sealed" in line:
            if cur["first"] is None:
                cur["first"] = t
            if cur["pending"] == 0 and cur["last_idle"] is not None:
                cur["idle"] += t - cur["last_idle"]
            cur["pending"] += 1
            cur["packs"] += 1
        elif "pack uploaded" in line:
            cur["pending"] -= 1
            cur["bytes"] += int(re.search(r"size=(\d+)", line).group(1))
            cur["last_up"] = t
            if cur["pending"] == 0:
                cur["last_idle"] = t
        elif "RAM END" in line and cur["ram_end"] is None:
            cur["ram_end"] = t
        elif "checkpoint committed" in line:
            total = float(re.search(r"total_ms=([0-9.]+)", line).group(1))
            c = cur
            if c["first"] is not None and c["last_up"] is not None:
                busy = c["last_up"] - c["first"] - c["idle"]
                rate = c["bytes"] / busy / 1e6 if busy > 0 else float("nan")
                ram_end = c["ram_end"] * 1e3 if c["ram_end"] is not None else float("nan")
                print(
                    f"{total:7.1f} {c['setup']*1e3:6.1f} {c['first']*1e3:6.1f} {ram_end:7.1f} {c['last_up']*1e3:7.1f} "
                    f"{t*1e3:7.1f} {c['idle']*1e3:6.1f} {c['bytes']/1e6:6.2f} {rate:9.1f} {c['packs']:5d}"
                )
            cur = None
            start = None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: save-timeline.py BENCH_LOG (run with STRATA_LOG=strata::qmp=debug,strata::store=debug,strata::memory=debug)")
    main(sys.argv[1])

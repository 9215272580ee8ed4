#!/usr/bin/env python3
"""What does each QMP command of a save's set-up cost QEMU?

Boots the test guest (`scripts/fixtures.sh` builds it) under TCG with nothing else running,
then times, over one QMP connection, the read-only queries `strata vm save` sends before
`stop`, one at a time and all five pipelined, plus two of them padded with 200 spaces (QEMU
7.2's monitor reads a command one byte per `recvmsg`, so the padding prices an input byte).
With `--active` it also times `query-migrate` while a slow migration into `exec:cat` runs,
as the save's poll does during the stream.

    scripts/qmp-latency.py [--mem 128] [--samples 40] [--active]

Prints the median and 10th percentile of each, in ms, from the write to the reply.
"""
import argparse, json, os, socket, statistics, subprocess, tempfile, time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "target", "fixtures")

QUERIES = [
    ("query-migrate", '{"execute":"query-migrate"}'),
    ("query-migrate-capabilities", '{"execute":"query-migrate-capabilities"}'),
    ("query-status", '{"execute":"query-status"}'),
    ("qom-get machine type", '{"execute":"qom-get","arguments":{"path":"/machine","property":"type"}}'),
    ("query-migrate-parameters", '{"execute":"query-migrate-parameters"}'),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", default="128")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--active", action="store_true")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qmp-latency-")
    sock = os.path.join(tmp, "qmp.sock")
    qemu = subprocess.Popen([
        "qemu-system-x86_64", "-accel", "tcg", "-m", a.mem,
        "-kernel", os.path.join(FIX, "vmlinuz"), "-initrd", os.path.join(FIX, "initramfs.cpio.gz"),
        "-append", "console=ttyS0 strata.mode=mem panic=-1 no_timer_check",
        "-display", "none", "-serial", "null", "-qmp", f"unix:{sock},server=on,wait=off",
    ])
    try:
        time.sleep(10)  # boot; the guest then idles
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        f = s.makefile("rwb", buffering=0)

        def reply():
            while True:
                r = json.loads(f.readline())
                if "return" in r or "error" in r:
                    return r

        def timed(lines):
            t = time.perf_counter()
            f.write(("\n".join(lines) + "\n").encode())
            for _ in lines:
                reply()
            return (time.perf_counter() - t) * 1e3

        def report(name, v):
            print(f"{name:<40} median {statistics.median(v):6.2f} ms   p10 {sorted(v)[len(v) // 10]:6.2f} ms")

        f.readline()
        f.write(b'{"execute":"qmp_capabilities"}\n')
        reply()
        tests = [(n, [c]) for n, c in QUERIES]
        tests.append(("all five pipelined", [c for _, c in QUERIES]))
        tests.append(("query-migrate + 200 spaces", ['{"execute":"query-migrate"' + " " * 200 + "}"]))
        tests.append(("query-status + 200 spaces", ['{"execute":"query-status"' + " " * 200 + "}"]))
        res = {n: [] for n, _ in tests}
        for _ in range(a.samples):
            for n, lines in tests:
                res[n].append(timed(lines))
                time.sleep(0.01)
        for n, _ in tests:
            report(n, res[n])
        if a.active:
            f.write(b'{"execute":"migrate-set-parameters","arguments":{"max-bandwidth":20000000}}\n')
            reply()
            f.write(b'{"execute":"stop"}\n')
            reply()
            f.write(b'{"execute":"migrate","arguments":{"uri":"exec:cat > /dev/null"}}\n')
            reply()
            time.sleep(0.2)
            v = []
            for _ in range(a.samples):
                v.append(timed(['{"execute":"query-migrate"}']))
                time.sleep(0.01)
            report("query-migrate, migration active", v)
    finally:
        qemu.kill()
        qemu.wait()


if __name__ == "__main__":
    main()

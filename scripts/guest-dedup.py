#!/usr/bin/env python3
"""How much of one boot's memory deduplicates against another's, per page and per group?

Boots the test guest (`scripts/fixtures.sh` builds it) twice under TCG, lets each idle, stops
it and dumps its RAM with QMP `pmemsave`, then compares the two dumps: non-zero pages,
duplicates within a guest, pages of the second found anywhere (or at the same address) in
the first, and pages of the second in aligned groups of `--group` pages identical to a group
of the first (what a checkpoint would keep of cross-guest dedup if its maps named groups, as
run chunks do, instead of pages).

    scripts/guest-dedup.py [--mem 128] [--wait 12] [--group 32]
"""
import argparse, hashlib, json, os, socket, subprocess, tempfile, time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "target", "fixtures")
PAGE = 4096


def dump(path, mem, wait, tmp):
    sock = os.path.join(tmp, "qmp.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    qemu = subprocess.Popen([
        "qemu-system-x86_64", "-accel", "tcg", "-m", str(mem),
        "-kernel", os.path.join(FIX, "vmlinuz"), "-initrd", os.path.join(FIX, "initramfs.cpio.gz"),
        "-append", "console=ttyS0 strata.mode=mem panic=-1 no_timer_check",
        "-display", "none", "-serial", "null", "-qmp", f"unix:{sock},server=on,wait=off",
    ])
    try:
        time.sleep(wait)
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        f = s.makefile("rw")

        def cmd(c, a=None):
            f.write(json.dumps({"execute": c, **({"arguments": a} if a else {})}) + "\n")
            f.flush()
            while True:
                r = json.loads(f.readline())
                if "return" in r or "error" in r:
                    return r

        f.readline()
        cmd("qmp_capabilities")
        cmd("stop")
        r = cmd("pmemsave", {"val": 0, "size": mem << 20, "filename": path})
        if "error" in r:
            raise SystemExit(f"pmemsave failed: {r['error']}")
    finally:
        qemu.kill()
        qemu.wait()


def page_hashes(path):
    data = open(path, "rb").read()
    zero = bytes(PAGE)
    return [None if data[i:i + PAGE] == zero else hashlib.blake2b(data[i:i + PAGE], digest_size=16).digest() for i in range(0, len(data), PAGE)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", type=int, default=128)
    ap.add_argument("--wait", type=float, default=12)
    ap.add_argument("--group", type=int, default=32)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="guest-dedup-")
    paths = [os.path.join(tmp, n) for n in ("a.bin", "b.bin")]
    for p in paths:
        dump(p, a.mem, a.wait, tmp)
    A, B = (page_hashes(p) for p in paths)
    for p in paths:
        os.unlink(p)
    nz_a = [h for h in A if h]
    nz_b = [h for h in B if h]
    seen = set(nz_a)
    g = a.group
    groups = lambda hs: [tuple(hs[i:i + g]) for i in range(0, len(hs) - g + 1, g)]
    ga, gb = groups(A), groups(B)
    set_ga = {x for x in ga if any(x)}
    in_groups = sum(sum(1 for h in x if h) for x in gb if any(x) and x in set_ga)
    print(f"non-zero pages: {len(nz_a)} and {len(nz_b)}")
    print(f"duplicates within the first guest: {100 * (1 - len(seen) / len(nz_a)):.1f}%")
    print(f"second guest's pages found in the first: {100 * sum(h in seen for h in nz_b) / len(nz_b):.1f}% anywhere, "
          f"{100 * sum(1 for x, y in zip(A, B) if y and x == y) / len(nz_b):.1f}% at the same address")
    print(f"second guest's pages in {g}-page groups identical to a group of the first: {100 * in_groups / len(nz_b):.1f}%")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Run every cargo-fuzz target for a short time on a corpus seeded from a real store.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 20; CI uses this)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-20}"
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: run scripts/setup.sh" >&2; exit 1; }
# cargo-fuzz needs nightly features; use the nightly toolchain when installed, else let stable
# accept them (RUSTC_BOOTSTRAP) without sanitizers.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  fuzz=(cargo +nightly fuzz); san=()
else
  export RUSTC_BOOTSTRAP=1; fuzz=(cargo fuzz); san=(-s none)
fi

# Seed corpora from a real store built by the strata binary: the one `cargo test` built
# (scripts/test.sh runs this right after it), else a dev build. A release build here would cost
# CI ~5 minutes for a 3 MB import.
bin=target/debug/strata
[ -x "$bin" ] || cargo build -q -p strata-cli
seed=$(mktemp -d); trap 'rm -rf "$seed"' EXIT
"$bin" --store "$seed/s" init --pack-size 64K >/dev/null
head -c 3000000 /usr/bin/bash > "$seed/img" 2>/dev/null || head -c 3000000 /dev/urandom > "$seed/img"
"$bin" --store "$seed/s" disk import seed "$seed/img" >/dev/null
"$bin" --store "$seed/s" disk clone seed seed2 --full >/dev/null
mkdir -p fuzz/corpus/store_pack fuzz/corpus/store_index fuzz/corpus/store_objects
find "$seed/s/packs" -type f | head -4 | while read -r f; do cp "$f" fuzz/corpus/store_pack/; done
cp "$seed"/s/index/* fuzz/corpus/store_index/ 2>/dev/null || true
i=0; for f in "$seed"/s/refs/disk/*; do { printf '\x00'; cat "$f"; } > "fuzz/corpus/store_objects/ref$i"; i=$((i+1)); done
{ printf '\x02'; cat "$seed/s/config"; } > fuzz/corpus/store_objects/config
"$bin" --store "$seed/s" disk compact seed2 >/dev/null
mkdir -p fuzz/corpus/disk_log
find "$seed/s/.meta/disks" -name 'log.*' -exec cp {} fuzz/corpus/disk_log/ \;

# Any extra targets (NBD, QEMU stream) are picked up automatically. Inputs kept in the
# repository (fuzz/inputs, one directory per target) join each target's corpus first.
kept=fuzz/inputs
for t in $("${fuzz[@]}" list); do
  echo "fuzz: $t for ${secs}s"
  mkdir -p "fuzz/corpus/$t"
  [ -d "$kept/$t" ] && cp -n "$kept/$t"/* "fuzz/corpus/$t/" 2>/dev/null || true
  "${fuzz[@]}" run "${san[@]}" "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 2>&1 | tail -n 3
done
echo "fuzz: all targets ran without crashes"

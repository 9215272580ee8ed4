#!/usr/bin/env bash
# Run every test on a fresh Debian 12 machine: installs what is missing, builds the guest
# fixtures, runs the Rust test suites (unit, property, crash harness, CLI and real-peer
# integration tests), then every fuzz target briefly. `.ci/run` calls exactly this.
#   STRATA_FUZZ_SECS   seconds per fuzz target (default 20; 0 skips fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH:/usr/sbin:/sbin"
t0=$(date +%s)
scripts/setup.sh
scripts/fixtures.sh
echo "== cargo test (workspace)"
cargo test --workspace --no-fail-fast 2>&1
secs="${STRATA_FUZZ_SECS:-20}"
if [ "$secs" != 0 ]; then
  echo "== fuzzing (${secs}s per target)"
  scripts/fuzz.sh "$secs"
fi
echo "== all tests passed in $(( $(date +%s) - t0 ))s"

#!/usr/bin/env bash
# Run every test on a fresh Debian 12 machine: installs what is missing, checks formatting,
# lints and the tree's wording, builds the guest fixtures, runs the Rust test suites (unit,
# property, crash harness, CLI and real-peer integration tests), then every fuzz target
# briefly. `.ci/run` calls exactly this.
#   STRATA_FUZZ_SECS      seconds per fuzz target (default 20; 0 skips fuzzing)
#   STRATA_TEST_TIMEOUT   limit for the Rust suites, build included (default 60m)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH:/usr/sbin:/sbin"
t0=$(date +%s)
scripts/setup.sh
echo "== wording (scripts/check-words.sh)"
scripts/check-words.sh
echo "== cargo fmt --check"
cargo fmt --all --check
(cd fuzz && cargo fmt --check)
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
scripts/fixtures.sh
echo "== cargo test (workspace)"
# A hung test must fail the run, not eat CI's whole budget: libtest has no per-test timeout,
# so the suite gets one (normally ~30 min here, build included). Look above for the test
# "running for over 60 seconds".
limit="${STRATA_TEST_TIMEOUT:-60m}"
rc=0
timeout --kill-after=30s "$limit" cargo test --workspace --no-fail-fast 2>&1 || rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "== cargo test did not finish within $limit: a test hung (see 'running for over 60 seconds' above)" >&2
fi
[ "$rc" = 0 ] || exit "$rc"
secs="${STRATA_FUZZ_SECS:-20}"
if [ "$secs" != 0 ]; then
  echo "== fuzzing (${secs}s per target)"
  scripts/fuzz.sh "$secs"
fi
echo "== all tests passed in $(( $(date +%s) - t0 ))s"

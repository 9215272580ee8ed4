#!/usr/bin/env bash
# scripts/check-words.sh: keep the tree in the present tense and docs/results curated.
#
# The code and docs describe what strata does and why; its history lives in git. This check
# fails (exit 1) and prints every hit when tracked files hold history words:
#   - "session" or "sessions" with a number, "paper" with a number 000-004, the papers' folder
#     outside the project (its name and a slash), "issue N" / "issue #N" (case-insensitive);
#   - result files in docs/results named for one run (-s44., -s14-..., -pre-s43, dated
#     -20261121, -repeat2, -run1, -check, pools, timelines, .txt) instead of one current set
#     per benchmark;
#   - more than 60 files in docs/results, or a docs/results/README.md over 320 lines.
#
# Usage: scripts/check-words.sh [--] [PATH...]
#   PATHs limit the word check (default: the whole tracked tree); the docs/results checks
#   always run. Only tracked files are read (git ls-files / git grep), so target/ never counts.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "${1:-}" = "--" ] && shift
paths=("$@")
[ ${#paths[@]} -eq 0 ] && paths=(.)

fail=0
words='sessions? [0-9]+|pape[r] 00[0-4]|see[d]s/|(^|[^[:alnum:]_])issue #?[0-9]+'

# git grep exits 1 when nothing matches; that is the good case.
hits=$(git grep -n -I -i -E "$words" -- "${paths[@]}" || true)
if [ -n "$hits" ]; then
  echo "check-words: history words (rewrite as what the code does and why):"
  printf '%s\n' "$hits" | sed 's/^/  /'
  fail=1
fi

results=$(git ls-files docs/results)
per_run='-s[0-9]+[a-z]*(\.|-)|-pre-s[0-9]*|-20[0-9]{6}|-repeat[0-9]*(\.|-)|-run[0-9]+|-check(\.|-)|-pools?(\.|-)|-timeline(\.|-)|\.txt$'
named=$(printf '%s\n' "$results" | grep -E -- "$per_run" || true)
if [ -n "$named" ]; then
  echo "check-words: docs/results keeps one current set per benchmark; per-run files:"
  printf '%s\n' "$named" | sed 's/^/  /'
  fail=1
fi

count=$(printf '%s\n' "$results" | grep -c . || true)
if [ "$count" -gt 60 ]; then
  echo "check-words: docs/results holds $count files (at most 60)"
  fail=1
fi

if [ -f docs/results/README.md ]; then
  lines=$(wc -l <docs/results/README.md)
  if [ "$lines" -gt 320 ]; then
    echo "check-words: docs/results/README.md has $lines lines (at most 320)"
    fail=1
  fi
fi

[ "$fail" -eq 0 ] && echo "check-words: ok"
exit "$fail"

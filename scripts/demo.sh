#!/usr/bin/env bash
# The strata demo on the embedded default store (a local directory):
# import the golden desktop image, provision desktops as O(metadata) full clones, show the
# space they share, verify everything, delete the golden image and reclaim space, and prove
# the clones are intact byte for byte.
#   STRATA_STORE  where the demo store goes (default: target/demo-store, recreated)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH:/usr/sbin:/sbin"
scripts/setup.sh
scripts/fixtures.sh
cargo build -q --release -p strata-cli
strata() { target/release/strata "$@"; }
fx="${STRATA_FIXTURES:-target/fixtures}"
export STRATA_STORE="${STRATA_STORE:-$PWD/target/demo-store}"
rm -rf "$STRATA_STORE"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "Create a store at $STRATA_STORE"
strata init --codec lz4
step "Import the golden desktop image ($(du -h --apparent-size "$fx/golden.img" | cut -f1))"
strata disk import golden "$fx/golden.img"
step "Provision 5 desktops as full clones (metadata only)"
for i in 1 2 3 4 5; do strata disk clone golden "desk$i" --full; done
strata disk list
step "Space: 6 disks, stored once"
strata du
step "Verify every chunk and ref"
strata check
step "Retire the golden image and collect garbage (the clones keep their data)"
strata disk rm golden
strata gc
step "Export desk3 and compare with the original image"
strata disk export desk3 target/demo-desk3.raw
cmp "$fx/golden.img" target/demo-desk3.raw && echo "desk3 is byte-identical to the golden image"
rm -f target/demo-desk3.raw
strata check
step "Demo done. Next: disks served over NBD and VM memory checkpoints (see README: Status)"

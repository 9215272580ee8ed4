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
step "Snapshot desk2 and make a linked clone of the snapshot for a new user"
strata disk snapshot desk2 monday
strata disk clone desk2@monday desk6
strata disk list

step "Serve every disk over NBD and boot a desktop (TCG guest) from the linked clone desk6"
sock="$STRATA_STORE/.meta/nbd.sock"
strata serve --socket "$sock" > target/demo-serve.log 2>&1 &
serve_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
nbdinfo --list "nbd+unix:///?socket=$sock" | grep -E '^export|read_only' | paste - - | sed 's/^/  /'
ser=target/demo-serial
rm -f "$ser.in" "$ser.out"; mkfifo "$ser.in" "$ser.out"
qemu-system-x86_64 -accel tcg -machine q35 -m 512 -nodefaults -no-user-config -display none \
  -kernel "$fx/vmlinux" -initrd "$fx/initramfs.cpio.gz" \
  -append "console=ttyS0 strata.mode=root panic=-1" \
  -drive "file=nbd:unix:$sock:exportname=desk6,if=virtio,format=raw" \
  -serial "pipe:$ser" -no-reboot > target/demo-qemu.log 2>&1 &
qemu_pid=$!
exec 3<"$ser.out" 4>"$ser.in"
t0=$(date +%s%N)
while IFS= read -r -t 120 line <&3; do
  case "$line" in *STRATA-READY*) echo "  guest: ${line%%$'\r'}"; break ;; esac
done
echo "  desktop booted from the strata clone in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
echo "write /root/hello written-by-the-demo-guest" >&4
while IFS= read -r -t 60 line <&3; do case "$line" in OK*) break ;; esac; done
echo "poweroff" >&4
wait "$qemu_pid" || true
exec 3<&- 4>&-
rm -f "$ser.in" "$ser.out"
kill -INT "$serve_pid"; wait "$serve_pid" || true
echo "  guest wrote /root/hello on desk6 and powered off; strata flushed and compacted the disk"
strata check

step "Demo done"

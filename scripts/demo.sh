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
qmp="$STRATA_STORE/.meta/demo.qmp"
# Started without the `strata` shell function so that $! is the server itself (it flushes and
# compacts on SIGINT).
target/release/strata serve --socket "$sock" > target/demo-serve.log 2>&1 &
serve_pid=$!
qemu_pid=
cleanup() {
  [ -n "$qemu_pid" ] && kill "$qemu_pid" 2>/dev/null
  [ -n "$serve_pid" ] && kill -INT "$serve_pid" 2>/dev/null
  rm -f "$ser.in" "$ser.out"
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
nbdinfo --list "nbd+unix:///?socket=$sock" | grep -E '^export|read_only' | paste - - | sed 's/^/  /'
ser=target/demo-serial
rm -f "$ser.in" "$ser.out" "$qmp"; mkfifo "$ser.in" "$ser.out"
qemu-system-x86_64 -accel tcg -machine q35 -m 512 -nodefaults -no-user-config -display none \
  -kernel "$fx/vmlinux" -initrd "$fx/initramfs.cpio.gz" \
  -append "console=ttyS0 strata.mode=root panic=-1 no_timer_check" \
  -drive "file=nbd:unix:$sock:exportname=desk6,if=virtio,format=raw" \
  -serial "pipe:$ser" -qmp "unix:$qmp,server=on,wait=off" -no-reboot > target/demo-qemu.log 2>&1 &
qemu_pid=$!
exec 3<"$ser.out" 4>"$ser.in"
# One request to the guest's agent on the serial console; prints the reply (OK ...).
guest() {
  echo "$*" >&4
  local line
  while IFS= read -r -t 120 line <&3; do
    line=${line%%$'\r'}
    case "$line" in OK*|ERR*) echo "$line"; return ;; esac
  done
  echo "ERR no reply to '$*'"; return 1
}
t0=$(date +%s%N)
while IFS= read -r -t 120 line <&3; do
  case "$line" in *STRATA-READY*) echo "  guest: ${line%%$'\r'}"; break ;; esac
done
echo "  desktop booted from the strata clone in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
guest write /root/hello written-by-the-demo-guest >/dev/null
guest sync >/dev/null

step "Live-checkpoint the running desktop's memory (background snapshot; the guest keeps running)"
# The checkpoint goes into the same store `strata serve` is serving the disk from: a second
# strata process on the host works beside the daemon (with its own metadata cache).
token="demo-$RANDOM$RANDOM"
# A value that lives only in the guest's memory (a devtmpfs file), and the guest's boot id.
guest sh "echo $token > /dev/strata-demo-token" >/dev/null
boot_id=$(guest sh cat /proc/sys/kernel/random/boot_id | cut -d' ' -f2)
uptime0=$(guest sh cat /proc/uptime | cut -d' ' -f2)
echo "  in guest memory: token $token, boot id $boot_id; guest uptime $uptime0 s"
strata vm checkpoint --qmp "$qmp" demo@1
echo "  guest still running after the checkpoint: it answers, uptime now $(guest sh cat /proc/uptime | cut -d' ' -f2) s"
guest sh "echo changed-after-the-checkpoint > /dev/strata-demo-token" >/dev/null
echo "  token changed in the guest to: $(guest sh cat /dev/strata-demo-token | cut -d' ' -f2)"
strata vm list
strata vm inspect demo@1 | sed -n '1,12p'

step "Stop the desktop (power cut), then restore it from the checkpoint with its recorded command line"
# Nothing was written to the disk after the checkpoint (the guest synced before it), so the
# restored memory matches the disk.
kill -KILL "$qemu_pid"; wait "$qemu_pid" 2>/dev/null || true
qemu_pid=
exec 3<&- 4>&-
out=$(strata vm restore demo@1 --launch --run-dir target/demo-run --json)
qemu_pid=$(printf '%s' "$out" | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -n1)
echo "  restored QEMU pid $qemu_pid, resumed"
exec 3<"$ser.out" 4>"$ser.in"
got=$(guest sh cat /dev/strata-demo-token | cut -d' ' -f2)
got_boot=$(guest sh cat /proc/sys/kernel/random/boot_id | cut -d' ' -f2)
echo "  restored guest's token: $got, boot id $got_boot"
[ "$got" = "$token" ] && [ "$got_boot" = "$boot_id" ] ||
  { echo "the restored guest is not the checkpointed one" >&2; exit 1; }
echo "  the restored desktop is the one checkpointed: same in-memory token, same boot (no reboot)"
guest poweroff >/dev/null
for _ in $(seq 300); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
kill "$qemu_pid" 2>/dev/null || true
qemu_pid=
exec 3<&- 4>&-
rm -f "$ser.in" "$ser.out"
kill -INT "$serve_pid"; wait "$serve_pid" || true
serve_pid=
echo "  guest wrote /root/hello on desk6 and powered off; strata flushed and compacted the disk"
strata check

step "Demo done"

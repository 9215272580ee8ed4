#!/usr/bin/env bash
# The strata demo on the embedded default store (a local directory):
# import the golden desktop image, provision desktops as O(metadata) full clones, show the
# space they share, verify everything, delete the golden image and reclaim space, prove the
# clones are intact byte for byte, then serve a desktop, snapshot its memory and disk while
# its guest writes, power-cut it and revert it, and show its memory and disk agree.
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

step "Snapshot the running desktop, memory and disk, while its guest keeps writing"
# A writer in the guest appends numbered records to /root/records on desk6 (each synced to
# the disk), then notes the number in a file that lives only in guest memory (devtmpfs).
guest sh "printf '%s\n' 'echo \$\$ > /dev/strata-loop.pid; n=0' 'while true; do n=\$((n+1)); echo \$n >> /root/records; sync; echo \$n > /dev/strata-counter; done' > /dev/strata-loop.sh" >/dev/null
guest sh "setsid sh /dev/strata-loop.sh > /dev/null 2>&1 &" >/dev/null
sleep 3
boot_id=$(guest sh cat /proc/sys/kernel/random/boot_id | cut -d' ' -f2)
echo "  guest writing: record $(guest sh cat /dev/strata-counter | cut -d' ' -f2) done; boot id $boot_id"
strata vm snapshot --qmp "$qmp" demo@1
sleep 3
echo "  guest still running and writing: record $(guest sh cat /dev/strata-counter | cut -d' ' -f2) done, past the snapshot"
strata vm list
strata vm inspect demo@1 | grep -E "^Snapshot|disk "

step "Power-cut the desktop, then revert it to the snapshot: memory and disk together"
kill -KILL "$qemu_pid"; wait "$qemu_pid" 2>/dev/null || true
qemu_pid=
exec 3<&- 4>&-
# --revert gives desk6 the snapshot's content (its current content is kept as a disk
# snapshot) and starts QEMU from the recorded command line on it.
out=$(strata vm restore demo@1 --launch --revert --run-dir target/demo-run --json)
qemu_pid=$(printf '%s' "$out" | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' | head -n1)
echo "  restored QEMU pid $qemu_pid, resumed; desk6 reverted:"
strata disk list | grep desk6 | sed 's/^/    /'
exec 3<"$ser.out" 4>"$ser.in"
# The writer goes on from its in-memory count. Stop it and read the file back: with the disk
# from the same instant as the memory, the records run 1, 2, 3, ... with no gap and no repeat
# (a disk from after the snapshot would hold records the memory has not written yet, and the
# resumed writer would write them again).
guest sh 'kill $(cat /dev/strata-loop.pid)' >/dev/null
got_boot=$(guest sh cat /proc/sys/kernel/random/boot_id | cut -d' ' -f2)
verdict=$(guest sh 'sync; c=$(cat /dev/strata-counter); i=0; ok=yes; while read x; do i=$((i+1)); [ "$x" = "$i" ] || ok=no; done < /root/records; echo "records=$i counter=$c consecutive=$ok"' | cut -d' ' -f2-)
echo "  restored guest: boot id $got_boot; $verdict"
[ "$got_boot" = "$boot_id" ] || { echo "the restored guest is not the snapshotted one" >&2; exit 1; }
case "$verdict" in
  *consecutive=yes*) echo "  memory and disk agree: the writer's count and its records on desk6 line up" ;;
  *) echo "memory and disk disagree: $verdict" >&2; exit 1 ;;
esac
guest poweroff >/dev/null
for _ in $(seq 300); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
kill "$qemu_pid" 2>/dev/null || true
qemu_pid=
exec 3<&- 4>&-
rm -f "$ser.in" "$ser.out"
kill -INT "$serve_pid"; wait "$serve_pid" || true
serve_pid=
echo "  the guest powered off; strata flushed and compacted the disk"
strata check

step "Demo done"

#!/usr/bin/env bash
# scripts/fixtures.sh [OUTDIR]: build the test guests that strata's integration tests and
# benchmarks boot under qemu-system-x86_64 -accel tcg.
#
# Outputs (in OUTDIR, default $STRATA_FIXTURES or <repo>/target/fixtures):
#   vmlinuz            Debian 12's kernel (the package linux-image-amd64 depends on)
#   vmlinux            the same kernel uncompressed (ELF with a PVH entry): boots ~4 s faster
#   initramfs.cpio.gz  busybox + /init + memwork + recwriter + the virtio-blk/ext4 modules
#   memwork            the memory agent (static binary, also inside the initramfs)
#   recwriter          the disk record writer (static binary, also inside the initramfs)
#   golden.img         raw ext4 "golden desktop" disk, boots with strata.mode=root
#   bootset.txt        the golden disk's boot working set ("PATH SIZE" per line)
#   manifest.txt       package versions, module load order, sizes and sha256 of the outputs
#   stamp              hash of this script and its fixtures/ sources; a match means up to date
#
# Why it is shaped this way: packages are fetched with `apt-get download` and unpacked with
# `dpkg-deb -x` (no installation, no dependence on what the host has installed), the .debs
# are cached in $STRATA_FIXTURES_CACHE (default ~/.cache/strata/fixtures) so reruns and fresh
# clones do not download again, and every timestamp, UUID and ordering is fixed so that two
# builds from the same packages give byte-identical outputs. A build runs in OUTDIR/.build
# under a lock and moves its outputs into place only when everything succeeded.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC="$REPO/fixtures"
OUT=${1:-${STRATA_FIXTURES:-$REPO/target/fixtures}}
CACHE=${STRATA_FIXTURES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/strata/fixtures}
EPOCH=1700000000 # fixed timestamp of every file in the outputs
UUID=5d1a7a00-0000-4000-8000-000000000001
GOLDEN_MIB=384
OUTPUTS="vmlinuz vmlinux initramfs.cpio.gz memwork recwriter golden.img bootset.txt manifest.txt"

say() { printf 'fixtures: [%3ss] %s\n' "$SECONDS" "$*" >&2; }
die() {
	printf 'fixtures: error: %s\n' "$*" >&2
	exit 1
}

[ -d "$SRC" ] || die "missing $SRC: run this script from a strata checkout"

# ---- the cache key: this script and the fixture sources it reads ------------------------
# (an explicit list: other files in fixtures/, e.g. other tests' guests, do not force a rebuild)
SOURCES="memwork.c recwriter.c initramfs-init.sh initramfs-modules.txt golden-init.sh golden-packages.txt bootset.txt"
stamp_key() {
	(
		cd "$REPO"
		for f in $SOURCES; do [ -f "fixtures/$f" ] || die "missing fixtures/$f: is this a complete strata checkout?"; done
		{
			sha256sum scripts/fixtures.sh
			for f in $SOURCES; do sha256sum "fixtures/$f"; done
		} | sha256sum | cut -d' ' -f1
	)
}

up_to_date() {
	[ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$KEY" ] || return 1
	for f in $OUTPUTS; do [ -s "$OUT/$f" ] || return 1; done
}

KEY=$(stamp_key)
if up_to_date; then
	say "up to date in $OUT"
	exit 0
fi

# ---- tools ------------------------------------------------------------------------------
missing=
for t in apt-get apt-cache dpkg-deb cpio gzip xz gcc readelf mkfs.ext4 debugfs dumpe2fs e2fsck sha256sum flock find xargs awk od; do
	command -v "$t" >/dev/null 2>&1 || PATH="$PATH:/sbin:/usr/sbin" command -v "$t" >/dev/null 2>&1 ||
		missing="$missing $t"
done
[ -z "$missing" ] || die "missing tools:$missing: run scripts/setup.sh (as root)"
export PATH="$PATH:/sbin:/usr/sbin"

mkdir -p "$OUT" "$CACHE/debs" || die "cannot create $OUT or $CACHE: set STRATA_FIXTURES / STRATA_FIXTURES_CACHE to writable paths"
OUT=$(cd "$OUT" && pwd)
CACHE=$(cd "$CACHE" && pwd)
exec 9>"$OUT/.lock"
if ! flock -n 9; then
	say "another build holds $OUT/.lock; waiting"
	flock 9
fi
if up_to_date; then # built by whoever held the lock
	say "up to date in $OUT"
	exit 0
fi

T0=$(date +%s)
say "building into $OUT (key ${KEY:0:12})"
W="$OUT/.build"
rm -rf "$W"
mkdir -p "$W"

# ---- .deb fetching with a cache ----------------------------------------------------------
APT_OPTS=()
# as root, apt would try to drop to its _apt user, which cannot write to our cache
[ "$(id -u)" -ne 0 ] || APT_OPTS=(-o APT::Sandbox::User=root)
# apt-cache is slow (about 1 s a call), so candidate file names are resolved in one call.
declare -A DEBFILE=()
resolve_debs() {
	local info name key val
	info=$(apt-cache show --no-all-versions "$@" 2>/dev/null || true)
	while IFS=': ' read -r key val; do
		case "$key" in
		Package) name=$val ;;
		Filename) [ -n "${DEBFILE[$name]:-}" ] || DEBFILE[$name]=${val##*/} ;;
		esac
	done <<<"$info"
}

# fetch_deb NAME: print the path of NAME's candidate .deb (resolve_debs first), downloading
# it only when the cache lacks that exact file. Without apt lists, fall back to the newest
# cached .deb of NAME.
fetch_deb() {
	local name=$1 fname=${DEBFILE[$1]:-} tmp cached
	if [ -n "$fname" ] && [ -s "$CACHE/debs/$fname" ]; then
		echo "$CACHE/debs/$fname"
		return
	fi
	if [ -n "$fname" ]; then
		tmp=$(mktemp -d "$CACHE/debs/.dl.XXXXXX")
		if (cd "$tmp" && apt-get download -q "${APT_OPTS[@]}" "$name" >/dev/null 2>"$tmp/err"); then
			mv "$tmp"/*.deb "$CACHE/debs/$fname.part" && mv "$CACHE/debs/$fname.part" "$CACHE/debs/$fname"
			rm -rf "$tmp"
			echo "$CACHE/debs/$fname"
			return
		fi
		say "apt-get download $name failed: $(tail -n1 "$tmp/err")"
		rm -rf "$tmp"
	fi
	cached=$(compgen -G "$CACHE/debs/${name}_*.deb" | LC_ALL=C sort -V | tail -n1 || true)
	if [ -n "$cached" ]; then
		say "using cached $(basename "$cached") (apt has no candidate for $name)"
		echo "$cached"
		return
	fi
	die "cannot get package $name: run 'apt-get update' (scripts/setup.sh does it); if it persists, check the name in fixtures/golden-packages.txt"
}

# ---- kernel -----------------------------------------------------------------------------
kinfo=$(apt-cache show --no-all-versions linux-image-amd64 2>/dev/null || true)
kpkg=$(sed -n 's/^Depends: //p' <<<"$kinfo" | tr ',' '\n' | sed -n 's/^ *\(linux-image-[0-9][^ ]*\).*/\1/p')
kpkg=${kpkg%%$'\n'*}
if [ -z "$kpkg" ]; then
	kpkg=$(compgen -G "$CACHE/debs/linux-image-[0-9]*-amd64_*.deb" | sed -n 's|.*/\(linux-image-[^_]*\)_.*|\1|p' | LC_ALL=C sort -V | tail -n1 || true)
	[ -n "$kpkg" ] || die "apt knows no linux-image-amd64: run 'apt-get update' (scripts/setup.sh does it)"
fi
say "kernel package $kpkg"
PKGS=()
while read -r name _; do
	name=${name%%#*}
	[ -n "$name" ] && PKGS+=("$name")
done <"$SRC/golden-packages.txt"
resolve_debs "$kpkg" busybox-static "${PKGS[@]}"
kdeb=$(fetch_deb "$kpkg")
mkdir -p "$W/kernel"
say "unpacking $(basename "$kdeb")"
dpkg-deb -x "$kdeb" "$W/kernel" || die "cannot unpack $kdeb: delete it from $CACHE/debs and rerun"
KVER=$(find "$W/kernel/lib/modules" -mindepth 1 -maxdepth 1 -printf "%f\n" | head -n1)
if [ -z "$KVER" ] || [ ! -f "$W/kernel/boot/vmlinuz-$KVER" ]; then
	die "$kdeb has no vmlinuz/modules: is it a linux-image package?"
fi
KCONFIG="$W/kernel/boot/config-$KVER"
for opt in CONFIG_SERIAL_8250_CONSOLE CONFIG_DEVTMPFS CONFIG_BLK_DEV_INITRD CONFIG_RD_GZIP; do
	grep -q "^$opt=y" "$KCONFIG" || die "kernel $KVER lacks $opt=y, which the fixtures need"
done

# ---- vmlinux: the uncompressed kernel, booted through its PVH entry ------------------------
# Under TCG the bzImage's own xz decompressor takes ~4 s of every boot; QEMU boots the ELF
# vmlinux directly through the PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY, type 0x12).
grep -q '^CONFIG_PVH=y' "$KCONFIG" || die "kernel $KVER lacks CONFIG_PVH=y: cannot make vmlinux"
VMLINUZ="$W/kernel/boot/vmlinuz-$KVER"
if grep -q '^CONFIG_KERNEL_XZ=y' "$KCONFIG"; then
	magic='\xfd7zXZ\x00' unpack=(xz -dc)
elif grep -q '^CONFIG_KERNEL_ZSTD=y' "$KCONFIG"; then
	magic='\x28\xb5\x2f\xfd' unpack=(zstd -dcq)
elif grep -q '^CONFIG_KERNEL_GZIP=y' "$KCONFIG"; then
	magic='\x1f\x8b\x08\x00' unpack=(gzip -dc)
else
	die "kernel $KVER is compressed in a way this script does not unpack (xz, zstd, gzip)"
fi
off=$(LC_ALL=C grep -obUaP "$magic" "$VMLINUZ" | head -n1 | cut -d: -f1 || true)
[ -n "$off" ] || die "no compressed payload found in vmlinuz-$KVER"
# the decompressor complains about the bytes after the payload: judge by the result
tail -c +$((off + 1)) "$VMLINUZ" | "${unpack[@]}" >"$W/vmlinux" 2>/dev/null || true
[ "$(head -c 4 "$W/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] || die "unpacking vmlinuz-$KVER gave no ELF"
notes=$(readelf -n "$W/vmlinux" 2>/dev/null || true)
grep -Eq 'Xen[[:space:]]+0x[0-9a-f]+[[:space:]]+Unknown note type: \(0x00000012\)' <<<"$notes" ||
	die "vmlinux of $KVER has no PVH entry note"
say "vmlinux: $(($(stat -c %s "$W/vmlinux") / 1048576)) MiB (PVH entry)"

# ---- initramfs modules: closure over modules.dep ------------------------------------------
MODDIR="$W/kernel/lib/modules/$KVER"
if [ ! -f "$MODDIR/modules.dep" ]; then
	if command -v depmod >/dev/null 2>&1; then
		depmod -b "$W/kernel" "$KVER"
	else # busybox's depmod writes the same "path: deps..." format
		BB_HOST=$(command -v busybox || true)
		[ -n "$BB_HOST" ] || die "need depmod (kmod) or busybox to generate modules.dep: run scripts/setup.sh"
		"$BB_HOST" depmod -b "$W/kernel" "$KVER"
	fi
fi
[ -s "$MODDIR/modules.dep" ] || die "depmod produced no modules.dep for $KVER"

declare -A DEPS=() SEEN=()
while IFS=: read -r mod deps; do DEPS[$mod]=$deps; done <"$MODDIR/modules.dep"
ORDER=()
visit() {
	local m=$1 d
	[ -z "${SEEN[$m]:-}" ] || return 0
	SEEN[$m]=1
	for d in ${DEPS[$m]}; do visit "$d"; done
	ORDER+=("$m")
}
mod_path() { # module name -> path in modules.dep ('-' and '_' are the same in names)
	local want=${1//-/_} p b
	for p in "${!DEPS[@]}"; do
		b=${p##*/}
		b=${b%.ko*}
		[ "${b//-/_}" = "$want" ] && { echo "$p"; return; }
	done
}
while read -r name _; do
	name=${name%%#*}
	[ -n "$name" ] || continue
	if grep -Eq "/${name//_/[-_]}\.ko\$" "$MODDIR/modules.builtin"; then
		say "module $name is built into $KVER"
		continue
	fi
	p=$(mod_path "$name")
	[ -n "$p" ] || die "kernel $KVER has no module $name (fixtures/initramfs-modules.txt)"
	visit "$p"
done <"$SRC/initramfs-modules.txt"
say "initramfs modules: ${ORDER[*]##*/}"
say "compiling memwork and recwriter"

# ---- memwork ----------------------------------------------------------------------------
echo 'int main(void){return 0;}' >"$W/static-test.c"
gcc -static -o "$W/static-test" "$W/static-test.c" 2>/dev/null ||
	die "gcc cannot link static binaries: install libc6-dev (run scripts/setup.sh)"
gcc -static -O2 -Wall -Wextra -Werror -pthread -o "$W/memwork" "$SRC/memwork.c" ||
	die "cannot compile fixtures/memwork.c"
strip "$W/memwork" 2>/dev/null || true
gcc -static -O2 -Wall -Wextra -Werror -pthread -o "$W/recwriter" "$SRC/recwriter.c" ||
	die "cannot compile fixtures/recwriter.c"
strip "$W/recwriter" 2>/dev/null || true

# ---- busybox (from the busybox-static package, like everything else) ----------------------
bbdeb=$(fetch_deb busybox-static)
mkdir -p "$W/bb"
dpkg-deb -x "$bbdeb" "$W/bb"
BB="$W/bb/bin/busybox"
[ -x "$BB" ] || BB="$W/bb/usr/bin/busybox"
[ -x "$BB" ] || die "$bbdeb has no busybox binary"
APPLETS=$("$BB" --list | grep -v '^busybox$' | LC_ALL=C sort)

# ---- initramfs --------------------------------------------------------------------------
IR="$W/initramfs"
mkdir -p "$IR"/{bin,dev,proc,sys,etc/strata,newroot,golden} "$IR/lib/modules/$KVER"
ln -s bin "$IR/sbin"
cp "$BB" "$IR/bin/busybox"
for a in $APPLETS; do ln -s busybox "$IR/bin/$a"; done
cp "$W/memwork" "$IR/bin/memwork"
cp "$W/recwriter" "$IR/bin/recwriter"
install -m 0755 "$SRC/initramfs-init.sh" "$IR/init"
: >"$IR/etc/strata/modules"
for m in "${ORDER[@]}"; do
	mkdir -p "$IR/lib/modules/$KVER/$(dirname "$m")"
	cp "$MODDIR/$m" "$IR/lib/modules/$KVER/$m"
	echo "$m" >>"$IR/etc/strata/modules"
done
find "$IR" -exec touch -h -d "@$EPOCH" {} +
(cd "$IR" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --reproducible --quiet) |
	gzip -n -9 >"$W/initramfs.cpio.gz"

say "initramfs: $(stat -c %s "$W/initramfs.cpio.gz") bytes"

# ---- golden desktop disk -------------------------------------------------------------------
G="$W/golden"
mkdir -p "$G"
: >"$W/golden-debs.txt"
DEBS=()
for p in "${PKGS[@]}"; do
	deb=$(fetch_deb "$p")
	DEBS+=("$deb")
	basename "$deb" >>"$W/golden-debs.txt"
done
# the packages have disjoint files, so they can be unpacked side by side
printf '%s\0' "${DEBS[@]}" | xargs -0 -P "$(nproc)" -I{} dpkg-deb -x {} "$G" ||
	die "cannot unpack the golden packages: delete the broken .deb from $CACHE/debs and rerun"
say "golden: unpacked ${#PKGS[@]} packages"
mkdir -p "$G"/{bin,sbin,etc/strata,proc,sys,dev,tmp,run,mnt,root,usr/libexec/strata/bb}
[ -x "$G/bin/busybox" ] || die "golden tree has no /bin/busybox (is busybox-static in fixtures/golden-packages.txt?)"
[ -e "$G/bin/sh" ] || ln -s busybox "$G/bin/sh"
for a in $APPLETS; do ln -s /bin/busybox "$G/usr/libexec/strata/bb/$a"; done
install -m 0755 "$SRC/golden-init.sh" "$G/sbin/init"
printf 'strata-golden\n' >"$G/etc/hostname"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$G/etc/passwd"
printf 'root:x:0:\n' >"$G/etc/group"
printf '/dev/vda / ext4 rw 0 1\n' >"$G/etc/fstab"

# boot working set: patterns in order, files sorted within a pattern, each file once
: >"$W/bootset.txt"
declare -A INSET=()
while read -r pat _; do
	pat=${pat%%#*}
	[ -n "$pat" ] || continue
	n=0
	while IFS= read -r f; do
		rel=${f#"$G"}
		if [ ! -f "$f" ] || [ -L "$f" ]; then continue; fi
		[ -z "${INSET[$rel]:-}" ] || continue
		INSET[$rel]=1
		echo "$rel $(stat -c %s "$f")" >>"$W/bootset.txt"
		n=$((n + 1))
	done < <(compgen -G "$G$pat" | LC_ALL=C sort)
	[ "$n" -gt 0 ] || [ -n "$(compgen -G "$G$pat")" ] || die "boot set pattern $pat matches nothing (fixtures/bootset.txt)"
done <"$SRC/bootset.txt"
BS_FILES=$(wc -l <"$W/bootset.txt")
BS_BYTES=$(awk '{s += $2} END {print s + 0}' "$W/bootset.txt")
say "golden: boot set $BS_FILES files, $((BS_BYTES / 1048576)) MiB"
cp "$W/bootset.txt" "$G/etc/strata/bootset.txt"

TREE_KIB=$(du -sk --apparent-size "$G" | cut -f1)
[ $((TREE_KIB / 1024 + 48)) -lt "$GOLDEN_MIB" ] ||
	die "golden tree is $((TREE_KIB / 1024)) MiB, too big for a $GOLDEN_MIB MiB image: trim fixtures/golden-packages.txt"
find "$G" -exec touch -h -d "@$EPOCH" {} +
rm -f "$W/golden.img"
say "golden: mkfs.ext4 -d"
E2FSPROGS_FAKE_TIME=$EPOCH mkfs.ext4 -q -F -L strata-golden -U "$UUID" -m 0 -T default \
	-E "hash_seed=$UUID,root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0" \
	-d "$G" "$W/golden.img" "${GOLDEN_MIB}M" >/dev/null || die "mkfs.ext4 -d failed (e2fsprogs >= 1.43 needed: run scripts/setup.sh)"
# mke2fs -d copies each file's ctime, which no tool can set; pin it with debugfs so that two
# builds give byte-identical images (debugfs rewrites the inode checksums)
dumpe2fs "$W/golden.img" 2>/dev/null | awk -v epoch="$EPOCH" '
	/^Inode count:/ { n = $3 }
	/^  Free inodes:/ {
		sub(/^  Free inodes: */, "")
		m = split($0, r, /, */)
		for (i = 1; i <= m; i++) {
			if (r[i] == "") continue
			k = split(r[i], ab, "-")
			for (j = ab[1]; j <= (k > 1 ? ab[2] : ab[1]); j++) free[j] = 1
		}
	}
	END { for (i = 1; i <= n; i++) if (!(i in free)) printf "sif <%d> ctime @%d\n", i, epoch }
' >"$W/ctime.debugfs"
[ -s "$W/ctime.debugfs" ] || die "dumpe2fs could not read $W/golden.img"
E2FSPROGS_FAKE_TIME=$EPOCH debugfs -w -f "$W/ctime.debugfs" "$W/golden.img" >/dev/null 2>"$W/debugfs.err" ||
	die "debugfs failed on golden.img: $(tail -n1 "$W/debugfs.err")"
e2fsck -fn "$W/golden.img" >"$W/fsck.log" 2>&1 || die "golden.img fails e2fsck: see $W/fsck.log"
say "golden: $((TREE_KIB / 1024)) MiB of files in a $GOLDEN_MIB MiB image"

# ---- manifest and install ----------------------------------------------------------------
say "writing manifest"
cp "$W/kernel/boot/vmlinuz-$KVER" "$W/vmlinuz"
{
	echo "kernel_package $(basename "$kdeb")"
	echo "kernel_version $KVER"
	echo "busybox_package $(basename "$bbdeb")"
	for m in "${ORDER[@]}"; do echo "initramfs_module $m"; done
	while read -r d; do echo "golden_package $d"; done <"$W/golden-debs.txt"
	echo "golden_tree_kib $TREE_KIB"
	echo "golden_image_mib $GOLDEN_MIB"
	echo "bootset_files $BS_FILES"
	echo "bootset_bytes $BS_BYTES"
	for f in vmlinuz vmlinux initramfs.cpio.gz memwork recwriter golden.img bootset.txt; do
		echo "sha256 $f $(sha256sum "$W/$f" | cut -d' ' -f1) size $(stat -c %s "$W/$f")"
	done
} >"$W/manifest.txt"

rm -f "$OUT/stamp"
for f in $OUTPUTS; do mv -f "$W/$f" "$OUT/$f"; done
echo "$KEY" >"$OUT/stamp"
rm -rf "$W"
say "built in $(($(date +%s) - T0)) s into $OUT"

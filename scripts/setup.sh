#!/usr/bin/env bash
# scripts/setup.sh: install what strata's build, tests, fuzzing and benchmarks need on Debian 12.
#
# Idempotent and fast when everything is present: it checks first (dpkg-query, command -v)
# and runs `apt-get update` only when something must be installed, at most once. Works
# non-interactively as root (CI: CI=true, no stdin); as another user it uses `sudo -n`.
#
# What it ensures:
#   Debian packages  QEMU (qemu-system-x86, qemu-utils: qemu-img/qemu-io/qemu-nbd), libnbd-bin
#                    (nbdinfo, nbdcopy, nbdfuse), fio, redis-server, busybox-static, e2fsprogs,
#                    cpio, strace, zstd, lzop, fuse3, gcc + libc6-dev (static memwork), kmod
#                    (depmod for the fixture initramfs), and apt lists that know
#                    linux-image-amd64 (scripts/fixtures.sh downloads the kernel with apt).
#   Rust             a stable toolchain with rustfmt and clippy via rustup (rustup itself cannot be fetched here: only
#                    package registries are reachable, so a missing rustup is reported).
#   cargo-fuzz       `cargo install cargo-fuzz --locked` if `cargo fuzz` is missing.
# No gnuplot: strata draws its charts as SVG from Rust.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
PKGS=(
	qemu-system-x86 qemu-utils libnbd-bin fio redis-server busybox-static e2fsprogs cpio strace
	zstd lzop fuse3 gcc libc6-dev binutils xz-utils kmod util-linux findutils gzip
)

say() { printf 'setup: %s\n' "$*"; }
die() {
	printf 'setup: error: %s\n' "$*" >&2
	exit 1
}

[ -r /etc/debian_version ] || die "this script supports Debian 12 (bookworm); install the packages listed in it by hand"

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
	command -v sudo >/dev/null 2>&1 || die "not root and no sudo: run as root"
	SUDO=(sudo -n)
fi

APT_UPDATED=0
apt_update_once() {
	if [ "$APT_UPDATED" -eq 0 ]; then
		say "apt-get update"
		"${SUDO[@]}" apt-get update -q >/dev/null || die "apt-get update failed: check the network to Debian's mirror"
		APT_UPDATED=1
	fi
}

# ---- Debian packages ----------------------------------------------------------------------
declare -A STATUS=()
while read -r name status; do
	STATUS[${name%%:*}]=$status
done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PKGS[@]}" 2>/dev/null || true)
missing=()
for p in "${PKGS[@]}"; do
	[ "${STATUS[$p]:-}" = "installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	apt_update_once
	say "installing ${missing[*]}"
	"${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null ||
		die "apt-get install ${missing[*]} failed"
else
	say "Debian packages: all ${#PKGS[@]} present"
fi

# scripts/fixtures.sh resolves and downloads the kernel through apt's lists
kernel_known() {
	local info
	info=$(apt-cache show --no-all-versions linux-image-amd64 2>/dev/null || true)
	[[ "$info" == *$'\nDepends: '*linux-image-* ]]
}
if ! kernel_known; then
	apt_update_once
	kernel_known || die "apt knows no linux-image-amd64 even after apt-get update: enable bookworm's main component"
fi

for t in qemu-system-x86_64 qemu-img qemu-io qemu-nbd nbdinfo nbdcopy nbdfuse fio redis-server busybox \
	mkfs.ext4 cpio strace zstd lzop fusermount3 gcc depmod; do
	command -v "$t" >/dev/null 2>&1 || PATH="$PATH:/sbin:/usr/sbin" command -v "$t" >/dev/null 2>&1 ||
		die "$t is still missing after installing packages"
done

# ---- Rust -----------------------------------------------------------------------------------
export PATH="$HOME/.cargo/bin:$PATH"
if command -v rustup >/dev/null 2>&1; then
	if ! rustup toolchain list 2>/dev/null | grep -q '^stable'; then
		say "rustup toolchain install stable"
		rustup toolchain install stable --profile minimal || die "rustup could not install the stable toolchain"
	fi
	for c in rustfmt clippy; do
		rustup component list --installed 2>/dev/null | grep -q "^$c" || {
			say "rustup component add $c"
			rustup component add "$c" || die "rustup could not add $c (CI runs cargo fmt --check and clippy)"
		}
	done
	say "Rust: $(rustc +stable --version 2>/dev/null || rustc --version)"
elif command -v cargo >/dev/null 2>&1; then
	say "Rust without rustup: $(rustc --version) (strata needs >= 1.80; cargo-fuzz needs a nightly via rustup)"
else
	die "no Rust toolchain: install rustup from https://rustup.rs, then rerun this script"
fi

if cargo fuzz --version >/dev/null 2>&1; then
	say "cargo-fuzz: $(cargo fuzz --version)"
else
	say "cargo install cargo-fuzz --locked (a few minutes)"
	cargo install cargo-fuzz --locked -q || die "cargo install cargo-fuzz failed"
fi
if command -v rustup >/dev/null 2>&1 && ! rustup toolchain list | grep -q '^nightly'; then
	say "note: cargo fuzz run needs a nightly toolchain: rustup toolchain install nightly"
fi

# ---- versitygw (S3 test server; owner: remote backends) -------------------------------------
# Tests and remote benchmarks run a real S3 server: versitygw v1.8.0, built from the Go module
# proxy into $(go env GOPATH)/bin (strata finds it there or on PATH). Skipped when that exact
# version is already installed.
VGW_VERSION=v1.8.0
GO=$(command -v go || echo /usr/local/go/bin/go)
[ -x "$GO" ] || die "Go is missing: install Go >= 1.22 (the versitygw S3 test server is built with it)"
VGW_BIN="$("$GO" env GOPATH)/bin/versitygw"
if [ -x "$VGW_BIN" ] && "$GO" version -m "$VGW_BIN" 2>/dev/null | grep -q "github.com/versity/versitygw[[:space:]]*$VGW_VERSION"; then
	say "versitygw: $VGW_VERSION at $VGW_BIN"
else
	say "go install github.com/versity/versitygw/cmd/versitygw@$VGW_VERSION (a few minutes)"
	GOFLAGS=-p=2 "$GO" install "github.com/versity/versitygw/cmd/versitygw@$VGW_VERSION" ||
		die "go install versitygw failed: check that the Go module proxy is reachable"
fi
# ---- end versitygw ----------------------------------------------------------------------------

say "done (next: scripts/fixtures.sh builds the test guests)"

#!/usr/bin/env bash
# scripts/storage-host.sh: emulate a storage host behind a 1 Gbit/s link, for the remote
# benchmarks and their tests.
#
# `up` creates a network namespace holding versitygw (S3, posix backend) and redis-server,
# joined to the host by a veth pair whose two ends are each shaped with `tbf` (default 1gbit,
# so both directions are limited, like a real NIC), and prints the environment a client needs.
# `down` stops the servers and removes the namespace and the veth. `measure` pushes bytes
# through the link in both directions and prints the rate. On this machine a 1gbit tbf gives
# ~119 MB/s = ~114 MiB/s of TCP payload, what a real gigabit link delivers.
#
# Usage: scripts/storage-host.sh up|down|measure|env
#   STRATA_NS    namespace name               (default strata-storage)
#   STRATA_NET   first three octets of a /24   (default 10.203.0; host .1, storage .2)
#   STRATA_RATE  tbf rate                      (default 1gbit)
#   STRATA_DIR   data directory of the servers (default /tmp/$STRATA_NS)
#   STRATA_BUCKET                              (default strata)
# Needs root (ip netns, tc), iproute2, busybox, redis-server and versitygw (scripts/setup.sh).
# Addresses stay inside this machine: the namespace has no route anywhere else.
set -euo pipefail

NS=${STRATA_NS:-strata-storage}
NET=${STRATA_NET:-10.203.0}
RATE=${STRATA_RATE:-1gbit}
DIR=${STRATA_DIR:-/tmp/$NS}
BUCKET=${STRATA_BUCKET:-strata}
HOST_IP=$NET.1
STORE_IP=$NET.2
# veth names are limited to 15 bytes: derive them from a short hash of the namespace name.
TAG=$(printf '%s' "$NS" | cksum | cut -c1-6)
VH=sh$TAG   # host end
VS=ss$TAG   # storage end
S3_PORT=7070
REDIS_PORT=6379
export PATH="$PATH:/usr/sbin:/sbin:$HOME/go/bin:/root/go/bin"

say() { printf 'storage-host: %s\n' "$*" >&2; }
die() {
	printf 'storage-host: error: %s\n' "$*" >&2
	exit 1
}

need() { command -v "$1" >/dev/null 2>&1 || die "$1 is missing: $2"; }

env_lines() {
	local key secret
	key=$(cat "$DIR/s3.key" 2>/dev/null) || die "not up: run '$0 up' first"
	secret=$(cat "$DIR/s3.secret")
	cat <<EOF
export AWS_ENDPOINT_URL=http://$STORE_IP:$S3_PORT
export AWS_ACCESS_KEY_ID=$key
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
export AWS_ALLOW_HTTP=true
export STRATA_S3_URL=s3://$BUCKET
export STRATA_REDIS_URL=redis://$STORE_IP:$REDIS_PORT
export STRATA_STORAGE_NS=$NS
export STRATA_STORAGE_IP=$STORE_IP
EOF
}

wait_port() {
	local port=$1 what=$2
	for _ in $(seq 1 200); do
		# Connect from the host side: this also proves the link works.
		if timeout 1 bash -c ": >/dev/tcp/$STORE_IP/$port" 2>/dev/null; then
			return 0
		fi
		sleep 0.05
	done
	die "$what did not start on $STORE_IP:$port (log in $DIR)"
}

up() {
	[ "$(id -u)" -eq 0 ] || die "run as root (ip netns and tc need it)"
	need ip "apt-get install iproute2"
	need tc "apt-get install iproute2"
	need busybox "apt-get install busybox-static"
	need redis-server "apt-get install redis-server"
	need versitygw "run scripts/setup.sh"
	if ip netns list | grep -qw "$NS"; then
		die "namespace $NS exists already: run '$0 down' first (or set STRATA_NS)"
	fi
	mkdir -p "$DIR/s3/$BUCKET" "$DIR/redis"
	ip netns add "$NS"
	ip link add "$VH" type veth peer name "$VS"
	ip link set "$VS" netns "$NS"
	ip addr add "$HOST_IP/24" dev "$VH"
	ip link set "$VH" up
	ip netns exec "$NS" ip addr add "$STORE_IP/24" dev "$VS"
	ip netns exec "$NS" ip link set "$VS" up
	ip netns exec "$NS" ip link set lo up
	# Shape both directions: host->storage on the host end, storage->host on the storage end.
	tc qdisc add dev "$VH" root tbf rate "$RATE" burst 256kb latency 50ms
	ip netns exec "$NS" tc qdisc add dev "$VS" root tbf rate "$RATE" burst 256kb latency 50ms

	local key secret
	key="strata$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
	secret="$(od -An -N16 -tx8 /dev/urandom | tr -d ' \n')"
	printf '%s' "$key" >"$DIR/s3.key"
	printf '%s' "$secret" >"$DIR/s3.secret"
	# The storage host stands for another machine, but here it shares this host's cores, so
	# its server runs lean, as an operator tuning a gateway would run it: ETags from the CRC64
	# it computes anyway instead of an extra MD5 pass over every object (perf: MD5 is a third
	# of versitygw's CPU during a save), and Go's GC at a quarter of its default frequency
	# (GOGC=400; heap growth is bounded by the objects in flight). strata never reads ETags as
	# MD5s. And a 64 KiB
	# read buffer per ranged GET (`--io-buffer-size`) instead of versitygw 1.8's 1 MiB, which
	# it allocates and zeroes for every ranged GET, however small (14% of its CPU during 4 KiB
	# random reads; a small restore's GETs cost it ~0.05 CPU-s instead of ~0.03).
	ip netns exec "$NS" env GOGC=400 setsid versitygw --access "$key" --secret "$secret" --port "$STORE_IP:$S3_PORT" --quiet --keep-alive \
		posix --data-integrity-etag --io-buffer-size 65536 "$DIR/s3" >"$DIR/versitygw.log" 2>&1 </dev/null &
	echo $! >"$DIR/versitygw.pid"
	ip netns exec "$NS" redis-server --bind "$STORE_IP" --port "$REDIS_PORT" --dir "$DIR/redis" \
		--appendonly yes --appendfsync always --save '' --protected-mode no --daemonize yes \
		--pidfile "$DIR/redis.pid" --logfile "$DIR/redis.log"
	wait_port "$S3_PORT" versitygw
	wait_port "$REDIS_PORT" redis-server
	say "up: namespace $NS, link $RATE, S3 http://$STORE_IP:$S3_PORT bucket $BUCKET, redis $STORE_IP:$REDIS_PORT"
	env_lines
}

down() {
	local pid
	for f in versitygw redis; do
		if [ -f "$DIR/$f.pid" ]; then
			pid=$(cat "$DIR/$f.pid")
			kill "$pid" 2>/dev/null || true
			for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
			kill -9 "$pid" 2>/dev/null || true
			rm -f "$DIR/$f.pid"
		fi
	done
	ip link del "$VH" 2>/dev/null || true
	if ip netns list | grep -qw "$NS"; then
		ip netns del "$NS"
	fi
	say "down: $NS removed (data kept in $DIR)"
}

# Push MiB of zeros with busybox nc from $1 (host|storage) to the other side; print MB/s.
# The listener's stdin is a FIFO we hold open (busybox nc quits at EOF on stdin); it exits when
# the sender closes, and `wc` reports the bytes that arrived.
push() {
	local from=$1 mib=$2 port=$3 t0 t1 fifo out got
	fifo=$(mktemp -u "$DIR/fifo.XXXXXX")
	out=$(mktemp "$DIR/recv.XXXXXX")
	mkfifo "$fifo"
	exec {hold}<>"$fifo"
	if [ "$from" = host ]; then
		(ip netns exec "$NS" timeout 120 busybox nc -l -p "$port" <&"$hold" | wc -c >"$out") &
	else
		(timeout 120 busybox nc -l -p "$port" <&"$hold" | wc -c >"$out") &
	fi
	local listener=$!
	sleep 0.3
	t0=$(date +%s.%N)
	# bash's /dev/tcp lets dd write 1 MiB blocks straight into the socket (busybox nc copies
	# in small pieces and becomes CPU-bound on a busy 2-core machine).
	if [ "$from" = host ]; then
		timeout 120 bash -c "dd if=/dev/zero bs=1M count=$mib status=none >/dev/tcp/$STORE_IP/$port"
	else
		ip netns exec "$NS" timeout 120 bash -c "dd if=/dev/zero bs=1M count=$mib status=none >/dev/tcp/$HOST_IP/$port"
	fi
	wait "$listener" || true
	t1=$(date +%s.%N)
	exec {hold}>&-
	got=$(cat "$out")
	rm -f "$fifo" "$out"
	[ "$got" = "$((mib << 20))" ] || die "only ${got:-0} of $((mib << 20)) bytes crossed the link"
	awk -v b="$got" -v a="$t0" -v z="$t1" 'BEGIN { r = b / (z - a); printf "%.1f MB/s (%.1f MiB/s)\n", r / 1e6, r / 1048576 }'
}

measure() {
	ip netns list | grep -qw "$NS" || die "not up: run '$0 up' first"
	local mib=${1:-256}
	printf 'host->storage %s\n' "$(push host "$mib" 5001)"
	printf 'storage->host %s\n' "$(push storage "$mib" 5002)"
}

case "${1:-}" in
up) up ;;
down) down ;;
measure) measure "${2:-256}" ;;
env) env_lines ;;
*) die "usage: $0 up|down|measure [MiB]|env" ;;
esac

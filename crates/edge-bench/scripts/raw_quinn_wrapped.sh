#!/usr/bin/env bash
# Runs the raw quinn baseline's two parties (`edge-bench role`, as `all` runs them: 10 KiB
# messages, edge-transport's tuning) once, the sending party under a wrapper command, to
# compare a daemon's counts with the raw quinn sender's under the same tool. The certificates
# come from `edge-ingest pki`. Needs target/release/{edge-bench,edge-ingest}.
#
#   crates/edge-bench/scripts/raw_quinn_wrapped.sh 1073741824 perf stat -e context-switches,task-clock
#   crates/edge-bench/scripts/raw_quinn_wrapped.sh 1073741824 perf record -F 999 --call-graph dwarf,32768 -o raw.data
#
# The wrapped process also generates its message bytes before it connects; its RESULT line
# (on stdout) gives the CPU of the sending alone.
set -euo pipefail
bytes=${1:?usage: raw_quinn_wrapped.sh BYTES WRAPPER...}
shift
cd "$(dirname "$0")/../../.."
bin=target/release
work=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin/edge-ingest" pki init --dir "$work/ca" --server-name localhost >/dev/null
"$bin/edge-ingest" pki issue --dir "$work/ca" --device bench-device --out "$work/issued" >/dev/null
mkdir -p "$work/pki/server" "$work/pki/device"
cp "$work/ca/server.pem" "$work/ca/server.key" "$work/ca/ca.pem" "$work/pki/server/"
cp "$work/issued/device.pem" "$work/issued/device.key" "$work/issued/ca.pem" "$work/pki/device/"
"$bin/edge-bench" role server --kind quic --pki "$work/pki" --bytes "$bytes" >"$work/server.out" &
server=$!
for _ in $(seq 100); do
    grep -q '^PORT ' "$work/server.out" && break
    sleep 0.1
done
port=$(sed -n 's/^PORT //p' "$work/server.out")
[ -n "$port" ] || { echo "the server party printed no port" >&2; exit 1; }
"$@" "$bin/edge-bench" role client --kind quic --pki "$work/pki" --bytes "$bytes" --port "$port"
wait "$server"
grep '^RESULT' "$work/server.out" | sed 's/^/server /'

#!/usr/bin/env bash
# A wrapper for `edge-bench profile --wrapper`: runs the agent under GNU time (`/usr/bin/time -v`,
# Debian package `time`), writing its report (peak RSS, CPU seconds) to OUT, and passes the
# SIGTERM with which the bench stops the agent on to the agent itself, so that time can report.
#
#   edge-bench profile --wrapper "crates/edge-bench/scripts/time-v.sh /tmp/agent-time.txt" --mib 512 --per-request 100
set -u
out=$1
shift
/usr/bin/time -v -o "$out" "$@" &
tpid=$!
trap 'pkill -TERM -P "$tpid"' TERM INT
while kill -0 "$tpid" 2>/dev/null; do wait "$tpid"; done

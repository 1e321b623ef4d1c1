#!/bin/bash
# How much of each of the agent's payload segment files (and of the spare) the page cache holds,
# every 50 ms, while a bench case runs: for `edge-bench profile --attach`, which starts it with
# the agent's pid when the measured phase begins and stops it with SIGINT at its end.
#
#   target/release/edge-bench profile --per-request 0 --mib 3072 \
#       --attach "crates/edge-bench/scripts/spool_fincore.sh {agent} /tmp/spool-fincore.txt"
#
# OUT gets the spool's directory, then for each sample a line `t UNIX_SECONDS` and one line per
# segment file from `fincore -b -n -o RES,SIZE,FILE`: bytes cached, bytes long, path.
set -u
pid=${1:?usage: spool_fincore.sh AGENT_PID OUT}
out=${2:?usage: spool_fincore.sh AGENT_PID OUT}
: >"$out"
db=$(readlink /proc/"$pid"/fd/* 2>/dev/null | grep 'spool.db$' | head -1)
[[ -n $db ]] || { echo "spool_fincore.sh: process $pid has no spool.db open" >&2; exit 1; }
dir=$(dirname "$db")
echo "dir $dir" >>"$out"
trap 'exit 0' INT TERM
while true; do
    echo "t $(date +%s.%N)" >>"$out"
    fincore -b -n -o RES,SIZE,FILE "$dir"/* 2>/dev/null | grep -- '-seg' >>"$out"
    sleep 0.05
done

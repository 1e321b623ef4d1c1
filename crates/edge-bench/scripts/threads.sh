#!/bin/bash
# Prints, per thread of a process, the CPU time and the context switches (voluntary and
# involuntary) between its start and SIGINT: for `edge-bench profile --attach`, which stops the
# attached command with SIGINT at the end of the measured phase. Threads that ended meanwhile
# (tokio's blocking pool lets idle threads go after 10 s) are counted up to their last sample,
# taken every 50 ms. Example (the agent's context switches over a 1 GiB drain, as in
# BENCHMARKS.md):
#   cargo run --release -p edge-bench -- profile --drain --mib 1024 \
#       --attach "crates/edge-bench/scripts/threads.sh {agent}"
pid=${1:?usage: threads.sh PID}
declare -A name first last
tick=$(getconf CLK_TCK)
sample() {
    local t stat rest f v nv
    for t in /proc/"$pid"/task/*; do
        stat=$(cat "$t/stat" 2>/dev/null) || continue
        rest=${stat##*) }
        read -r -a f <<<"$rest"
        v=$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status" 2>/dev/null) || continue
        nv=$(awk '/^nonvoluntary_ctxt_switches/ {print $2}' "$t/status" 2>/dev/null) || continue
        local id=${t##*/}
        # utime + stime (fields 14 and 15 of stat; 12 and 13 after the name).
        last[$id]="$((f[11] + f[12])) $v $nv"
        [[ -n ${first[$id]} ]] || { first[$id]=${1:-${last[$id]}}; name[$id]=$(cat "$t/comm" 2>/dev/null); }
    done
}
report() {
    sample
    local id a b total_cpu=0 total_v=0 total_nv=0
    printf '%-8s %-16s %9s %10s %13s\n' tid thread cpu_s voluntary involuntary
    for id in "${!last[@]}"; do
        read -r -a a <<<"${first[$id]}"
        read -r -a b <<<"${last[$id]}"
        local c=$((b[0] - a[0])) v=$((b[1] - a[1])) nv=$((b[2] - a[2]))
        ((c + v + nv > 0)) || continue
        printf '%-8s %-16s %9.2f %10d %13d\n' "$id" "${name[$id]}" "$(awk -v c="$c" -v t="$tick" 'BEGIN {print c / t}')" "$v" "$nv"
        total_cpu=$((total_cpu + c)); total_v=$((total_v + v)); total_nv=$((total_nv + nv))
    done
    printf '%-8s %-16s %9.2f %10d %13d\n' all "" "$(awk -v c="$total_cpu" -v t="$tick" 'BEGIN {print c / t}')" "$total_v" "$total_nv"
    exit 0
}
sample
trap report INT TERM
# A thread born after the start counts from zero.
while :; do sleep 0.05; sample "0 0 0"; done

#!/bin/bash
# Prints the lines of a daemon's /metrics that match PATTERN when interrupted: for
# `edge-bench profile --attach`, which stops the attached command with SIGINT at the end of the
# measured phase. The metrics port is found among the process's listening TCP sockets (ss).
# Example (how many of the chunks of 1 GiB through the record stream were sent from memory,
# as in BENCHMARKS.md):
#   cargo run --release -p edge-bench -- profile --per-request 0 --mib 1024 \
#       --attach "crates/edge-bench/scripts/metrics.sh {agent} upload_chunks"
pid=${1:?usage: metrics.sh PID [PATTERN]}
pattern=${2:-.}
report() {
    local port
    for port in $(ss -ltnpH | grep "pid=$pid," | grep -o '127\.0\.0\.1:[0-9]*' | cut -d: -f2); do
        curl -sf "http://127.0.0.1:$port/metrics" | grep -v '^#' | grep -E "$pattern"
    done
    exit 0
}
trap report INT TERM
while :; do sleep 0.1; done

#!/bin/sh
# Prints a process's peak resident set size (VmHWM) when interrupted: for
# `edge-bench profile --attach "crates/edge-bench/scripts/vmhwm.sh {agent}"`, which stops the
# attached command with SIGINT at the end of the measured phase. Example (the agent's peak RSS
# with 1 MiB NDJSON requests from 8 producers, as in BENCHMARKS.md):
#   cargo run --release -p edge-bench -- profile --mib 1024 --per-request 100 \
#       --attach "crates/edge-bench/scripts/vmhwm.sh {agent}"
pid=${1:?usage: vmhwm.sh PID}
trap 'grep VmHWM "/proc/$pid/status"; exit 0' INT TERM
while :; do sleep 0.1; done

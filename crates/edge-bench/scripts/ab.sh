#!/usr/bin/env bash
# A/B of two builds of the daemons: `edge-bench pipeline --reps 1` with each build's
# edge-uploader and edge-ingest in turn (order A B B A, repeated), so that a machine that
# drifts slower or faster during the run weighs on both builds alike. Each build is a folder
# holding the two binaries (copy them out of target/release/ after each build). The bench
# binary is target/release/edge-bench; the last build measured stays in target/release/ (run
# `cargo build --release --workspace` to put the tree's daemons back).
# Writes one report per run into OUT; ab_summary.py reads them. CASES replaces the bench's
# subcommand `pipeline --reps 1`, e.g. `quick` (which adds the latency case).
#
#   crates/edge-bench/scripts/ab.sh /tmp/base-bin /tmp/new-bin 8 /tmp/ab
#   python3 crates/edge-bench/scripts/ab_summary.py /tmp/ab
set -euo pipefail
a=${1:?usage: ab.sh DIR_A DIR_B ROUNDS OUT [CASES]}
b=${2:?}
rounds=${3:?}
out=${4:?}
read -r -a cases <<<"${5:-pipeline --reps 1}"
cd "$(dirname "$0")/../../.."
mkdir -p "$out"
run=0
measure() {
    local label=$1 dir=$2
    run=$((run + 1))
    # --remove-destination: target/release/X is a hard link to cargo's own copy in deps/;
    # copying over it would write the measured build into that copy, and a later `cargo build`
    # would find it fresh and keep it (a wrapper script, or another build's daemon).
    cp --remove-destination "$dir/edge-uploader" "$dir/edge-ingest" target/release/
    echo "run $run: $label ($(date -u +%H:%M:%S))" >&2
    target/release/edge-bench "${cases[@]}" --allow-stale >"$out/$(printf %02d $run)-$label.md" 2>>"$out/progress.log"
}
for ((i = 0; i < rounds; i += 2)); do
    measure A "$a"
    measure B "$b"
    if ((i + 1 < rounds)); then
        measure B "$b"
        measure A "$a"
    fi
done

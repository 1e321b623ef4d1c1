#!/usr/bin/env bash
# ab.sh for more than two builds: a sweep of one setting, each value in its own build folder
# (env_build_dir.sh makes one per value). Each round measures every build once; the order turns
# by one build each round, so that each goes first, last and in between alike on a machine
# that drifts. Labels name the builds in the reports (letters, digits, `_` and `.`);
# ab_summary.py reads them, with ratios to the first label.
#
#   for b in 2 4 8 16 64; do
#       crates/edge-bench/scripts/env_build_dir.sh /tmp/budget$b uploader \
#           EDGE_UPLOADER__INTAKE__REQUEST_PENDING_TOTAL_BYTES=${b}MiB
#   done
#   crates/edge-bench/scripts/sweep.sh 5 /tmp/sweep "http --reps 1" \
#       64=/tmp/budget64 2=/tmp/budget2 4=/tmp/budget4 8=/tmp/budget8 16=/tmp/budget16
#   python3 crates/edge-bench/scripts/ab_summary.py /tmp/sweep --every
set -euo pipefail
usage="usage: sweep.sh ROUNDS OUT CASES LABEL=DIR LABEL=DIR..."
rounds=${1:?$usage}
out=${2:?$usage}
read -r -a cases <<<"${3:?$usage}"
shift 3
(($# >= 2)) || { echo "sweep.sh: at least two LABEL=DIR builds; $usage" >&2; exit 2; }
labels=()
dirs=()
for pair in "$@"; do
    [[ $pair =~ ^([A-Za-z0-9_.]+)=(.+)$ ]] || { echo "sweep.sh: not LABEL=DIR: $pair" >&2; exit 2; }
    [[ -x ${BASH_REMATCH[2]}/edge-uploader && -x ${BASH_REMATCH[2]}/edge-ingest ]] ||
        { echo "sweep.sh: ${BASH_REMATCH[2]} holds no edge-uploader and edge-ingest" >&2; exit 2; }
    labels+=("${BASH_REMATCH[1]}")
    dirs+=("$(cd "${BASH_REMATCH[2]}" && pwd)")
done
cd "$(dirname "$0")/../../.."
mkdir -p "$out"
n=${#labels[@]}
run=0
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        i=$(((k + r) % n))
        run=$((run + 1))
        # As in ab.sh: never write through cargo's hard link.
        cp --remove-destination "${dirs[i]}/edge-uploader" "${dirs[i]}/edge-ingest" target/release/
        echo "run $run: ${labels[i]} ($(date -u +%H:%M:%S))" >&2
        target/release/edge-bench "${cases[@]}" --allow-stale \
            >"$out/$(printf %03d $run)-${labels[i]}.md" 2>>"$out/progress.log"
    done
done

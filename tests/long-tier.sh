#!/usr/bin/env bash
# The long tier of the reliability battery (RELIABILITY.md): the same tests as the quick tier
# with the issue's full sizes, plus the tests marked #[ignore = "long tier"]. Takes hours on a
# 2-core machine. Figures land in target/reliability/*.json; the results table of
# RELIABILITY.md is then regenerated from them.
#
#   bash tests/long-tier.sh                 # everything
#   bash tests/long-tier.sh 'test(network)' # a nextest filter expression, to run a part
set -euo pipefail
cd "$(dirname "$0")/.."
filter=${1:-all()}
export EDGE_TIER=long
cargo nextest run --workspace --profile long --run-ignored all -E "$filter"
python3 tests/reliability_report.py --write RELIABILITY.md

#!/bin/bash
# Drops the page cache's clean pages (root only), then runs the given command in its place, with
# SIGINT restored to its default. For `edge-bench profile --drain --attach`, whose attached
# command starts as the drain begins: the spool the drain reads is then on the disk and not in
# memory, as a backlog that waited long on a gateway would be. SIGINT is restored because a
# bench started as a background job hands its children SIGINT ignored, and `profile` stops the
# attached command with SIGINT. Example (the agent's CPU per thread over a cold 1 GiB drain,
# as in BENCHMARKS.md):
#   cargo run --release -p edge-bench -- profile --drain --mib 1024 \
#       --attach "crates/edge-bench/scripts/drop_caches_then.sh crates/edge-bench/scripts/threads.sh {agent}"
set -euo pipefail
(($# > 0)) || { echo "usage: drop_caches_then.sh COMMAND [ARG...]" >&2; exit 2; }
# No `sync` first: the spool's pages are clean (every commit is fsynced), and a sync would
# wait for the ingest's writes while the drain goes on.
echo 1 >/proc/sys/vm/drop_caches || { echo "drop_caches_then.sh: cannot drop the page cache (root only)" >&2; exit 1; }
exec python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' "$@"

#!/bin/bash
# Makes a build folder for ab.sh from the daemons in target/release/: with VAR=VALUE pairs, the
# named daemon (uploader or ingest) is replaced by a wrapper that runs its copy with those
# variables set, e.g. a configuration override (`EDGE_UPLOADER__SPOOL__DURABILITY=normal`) or a
# runtime setting (`TOKIO_WORKER_THREADS=1`), so that one build is measured against itself with
# one setting changed. The wrapper runs the copy by its absolute path, so OUT must stay where it
# is while ab.sh runs.
#
#   crates/edge-bench/scripts/env_build_dir.sh /tmp/full uploader
#   crates/edge-bench/scripts/env_build_dir.sh /tmp/normal uploader EDGE_UPLOADER__SPOOL__DURABILITY=normal
#   crates/edge-bench/scripts/ab.sh /tmp/full /tmp/normal 8 /tmp/ab
set -euo pipefail
out=${1:?usage: env_build_dir.sh OUT uploader|ingest [VAR=VALUE...]}
which=${2:?usage: env_build_dir.sh OUT uploader|ingest [VAR=VALUE...]}
shift 2
case $which in
uploader | ingest) name=edge-$which ;;
*) echo "env_build_dir.sh: uploader or ingest, not $which" >&2; exit 2 ;;
esac
for pair in "$@"; do
    [[ $pair =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || { echo "env_build_dir.sh: not VAR=VALUE: $pair" >&2; exit 2; }
done
cd "$(dirname "$0")/../../.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
cp target/release/edge-uploader target/release/edge-ingest "$out/"
if (($# > 0)); then
    mv "$out/$name" "$out/$name.real"
    {
        echo '#!/bin/sh'
        printf 'exec env'
        printf ' %q' "$@" "$out/$name.real"
        echo ' "$@"'
    } >"$out/$name"
    chmod +x "$out/$name"
fi

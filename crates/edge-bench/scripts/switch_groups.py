#!/usr/bin/env python3
"""Says where a process's threads went to sleep: the context switches of a perf recording.

    edge-bench profile --drain --mib 1024 --allow-stale \\
        --attach "perf record -e context-switches -c 1 --call-graph dwarf,16384 -o cs.data -p {agent}"
    perf script -i cs.data --no-inline -F comm,tid,ip,sym > cs.txt
    python3 crates/edge-bench/scripts/switch_groups.py cs.txt

Prints the switches per thread, then per reason: the system call the thread was in (or none:
preempted) and the first three frames of the project, tokio, quinn or std under it; then the
switches spent waiting for a contended mutex, by the two frames that took the lock.
"""

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import perf_groups  # noqa: E402  (the same directory: its parser of `perf script` output)

HASH = re.compile(r"::h[0-9a-f]{16}$")
OURS = re.compile(r"tokio|quinn|edge_|std::")


def samples(path):
    """Yields (thread, [symbols, leaf first, without their hashes]) per sample."""
    for thread, frames in perf_groups.samples(path):
        yield thread, [HASH.sub("", f.strip()) for f in frames]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    threads, reasons, locks = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for thread, syms in samples(sys.argv[1]):
        total += 1
        threads[thread] += 1
        call = next((s.split("+")[0] for s in syms if s.startswith("__x64_sys_")), "(preempted)")
        frames = tuple(s[:90] for s in syms if OURS.search(s))[:3]
        reasons[(call, frames)] += 1
        for i, s in enumerate(syms):
            if "lock_contended" in s:
                locks[tuple(x[:90] for x in syms[i + 1 : i + 3])] += 1
                break
    print(f"{total} context switches\n")
    print("| thread | switches |\n|---|---|")
    for t, n in threads.most_common():
        print(f"| {t} | {n} |")
    print("\n| switches | system call | frames under it |\n|---|---|---|")
    for (call, frames), n in reasons.most_common(20):
        print(f"| {n} | {call} | {' <- '.join(frames)} |")
    print(f"\n{sum(locks.values())} waiting for a contended mutex, taken by:\n")
    print("| switches | taken in |\n|---|---|")
    for frames, n in locks.most_common(10):
        print(f"| {n} | {' <- '.join(frames)} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Counts a perf profile's samples by what their stacks hold, for the figures that
perf_groups.py does not give: how many samples have a frame matching PATTERN anywhere on
their stack, split by the leaf-most frame of theirs that is one of the names in --by (or by
their leaf function without --by); with no PATTERN, every sample by its leaf function (a flat
profile).

    perf script -i FILE --no-inline -F comm,tid,ip,sym,dso > stacks.txt
    python3 crates/edge-bench/scripts/stack_count.py stacks.txt write_vectored \
        --by copy_folio_from_iter_atomic,ext4_da_write_begin
    python3 crates/edge-bench/scripts/stack_count.py stacks.txt ext4_write_inode \
        --by __x64_sys_fsync,__x64_sys_fdatasync
    python3 crates/edge-bench/scripts/stack_count.py stacks.txt          # flat, by leaf
"""
import argparse
import collections
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_groups import samples  # noqa: E402


def stacks(path):
    """Yields each sample's frames, leaf first, as symbol names (perf_groups.py's reader,
    without the library in parentheses after each name)."""
    for _thread, frames in samples(path):
        yield [re.sub(r"\s+\([^)]*\)$", "", f) for f in frames]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stacks")
    ap.add_argument("pattern", nargs="?", help="regular expression a frame must match (default: every sample)")
    ap.add_argument("--by", default="", help="comma-separated frame names to split the matches by")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    pattern = re.compile(args.pattern) if args.pattern else None
    by = [b for b in args.by.split(",") if b]
    counts = collections.Counter()
    total = matched = 0
    for frames in stacks(args.stacks):
        total += 1
        if pattern and not any(pattern.search(f) for f in frames):
            continue
        matched += 1
        if by:
            key = next((f for f in frames if f in by), "(none of them)")
        else:
            key = frames[0]
        counts[key] += 1
    print(f"{matched} of {total} samples" + (f" have a frame matching {args.pattern!r}" if pattern else ""))
    print()
    print("| frame | samples | of all |")
    print("|---|---|---|")
    for key, n in counts.most_common(args.top):
        print(f"| {key[:90]} | {n} | {n / total * 100:.1f} % |")


if __name__ == "__main__":
    main()

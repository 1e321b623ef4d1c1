#!/usr/bin/env python3
"""Sums what a process added to the page cache, from `filemap:mm_filemap_add_to_page_cache`.

    edge-bench profile ... --attach "perf record -e filemap:mm_filemap_add_to_page_cache -o F -p {agent}"
    perf script -i F -F trace | python3 crates/edge-bench/scripts/page_cache_adds.py

Each event is one folio of 4 KiB << order added to a file's cache (a new page, not one the file
already had cached). Prints the MiB added in all, the inodes they went to, and the five inodes
that took most (a file deleted during the run can give its inode number to a later one).
"""

import collections
import re
import sys

EVENT = re.compile(r"ino ([0-9a-f]+) .*?order=(\d+)")


def main():
    by_inode = collections.Counter()
    events = 0
    for line in sys.stdin:
        m = EVENT.search(line)
        if not m:
            continue
        events += 1
        by_inode[m.group(1)] += 4096 << int(m.group(2))
    total = sum(by_inode.values())
    print(f"{events} folios, {total / 2**20:.1f} MiB added to the page cache, {len(by_inode)} inodes")
    for inode, n in by_inode.most_common(5):
        print(f"  inode {inode}: {n / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

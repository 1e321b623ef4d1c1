#!/usr/bin/env python3
"""CPU and time to read a file in 1 MiB `pread`s: through the page cache, and with O_DIRECT.

    python3 crates/edge-bench/scripts/pread_direct.py [DIR] [MIB] [ROUNDS]

The spool reader copies every chunk out of the page cache (`_copy_to_iter`, about a tenth of
the agent's samples in a drain). O_DIRECT would have the disk's DMA fill the buffer instead.
This measures the two on the machine's disk with a file of MIB MiB (default 1024) in DIR
(default: target), written and read once beforehand so it starts in the page cache, as a
drained spool's segments do. Each round reads it once each way; prints per round and the
medians, CPU as the process's user + system time.
"""

import mmap
import os
import resource
import statistics
import sys
import time

CHUNK = 1 << 20


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def read_all(path, flags):
    # An anonymous mapping is page-aligned, as O_DIRECT needs.
    buf = mmap.mmap(-1, CHUNK)
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        c0, t0, off = cpu(), time.monotonic(), 0
        while True:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            off += n
        return off, cpu() - c0, time.monotonic() - t0
    finally:
        os.close(fd)
        buf.close()


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "target"
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    path = os.path.join(d, "pread-direct.bin")
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        read_all(path, 0)
        results = {"page cache": [], "O_DIRECT": []}
        for r in range(rounds):
            for name, flags in (("page cache", 0), ("O_DIRECT", os.O_DIRECT)):
                n, c, t = read_all(path, flags)
                gib = n / (1 << 30)
                results[name].append((c / gib, n / t / 1e6))
                print(f"round {r + 1} {name}: {c / gib:.3f} CPU-s/GiB, {n / t / 1e6:.0f} MB/s")
        for name, rs in results.items():
            print(
                f"median {name}: {statistics.median(x[0] for x in rs):.3f} CPU-s/GiB, "
                f"{statistics.median(x[1] for x in rs):.0f} MB/s"
            )
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""CPU to write a file through the page cache, by where its pages come from.

    python3 crates/edge-bench/scripts/fresh_pages.py [DIR] [MIB] [ROUNDS]

Writes MIB MiB (default 1024) in 1 MiB `write`s to a file in DIR (default: target), four ways:

  new file          a new file: every page of it is a page the kernel takes from its free lists
  overwrite cached  the same file again from offset 0, not truncated: its cached pages are
                    reused, as the spool's recycled segment (the spare) is
  new, just freed   a new file right after the first one was deleted: its pages come from the
                    ones the deletion freed a moment before
  new, freed 8 s    the same, 8 s after the deletion

and prints the CPU (user + system) per GiB of each, medians over ROUNDS rounds (default 3).

On a virtual machine whose balloon device reports free pages to the host (virtio-balloon's
free page reporting, printed at the start when /sys shows it), the guest hands memory that
stays free for about 2 s back to the host, and the host must fault a page in again, zeroed,
the first time the guest writes to it: the guest sees that as a slow copy into the page cache
(`copy_folio_from_iter_atomic`). Writes into pages freed a moment before, or already cached,
do not pay it. A gateway on bare metal has no host to pay.
"""

import os
import resource
import statistics
import sys
import time

CHUNK = 1 << 20
# virtio device id of the balloon, and its feature bit for free page reporting.
VIRTIO_ID_BALLOON = 5
VIRTIO_BALLOON_F_REPORTING = 5


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def balloon_reports_free_pages():
    """True/False from /sys, None when no virtio balloon is visible."""
    root = "/sys/bus/virtio/devices"
    try:
        devices = os.listdir(root)
    except OSError:
        return None
    for d in devices:
        try:
            with open(os.path.join(root, d, "device")) as f:
                if int(f.read().strip(), 16) != VIRTIO_ID_BALLOON:
                    continue
            with open(os.path.join(root, d, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        # The file lists feature bits from bit 0 on, one character each.
        return len(bits) > VIRTIO_BALLOON_F_REPORTING and bits[VIRTIO_BALLOON_F_REPORTING] == "1"
    return None


def write(path, mib, buf, truncate):
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o644)
    try:
        start = cpu()
        for _ in range(mib):
            os.write(fd, buf)
        took = cpu() - start
    finally:
        os.close(fd)
    return took * 1024 / mib


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "target"
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    os.makedirs(directory, exist_ok=True)
    a = os.path.join(directory, "fresh-pages-a")
    b = os.path.join(directory, "fresh-pages-b")
    buf = os.urandom(CHUNK)
    reporting = balloon_reports_free_pages()
    print(f"balloon free page reporting: {'no balloon device' if reporting is None else reporting}")
    results = {}
    try:
        for r in range(rounds):
            row = {}
            row["new file"] = write(a, mib, buf, truncate=True)
            row["overwrite cached"] = write(a, mib, buf, truncate=False)
            os.unlink(a)
            row["new, just freed"] = write(b, mib, buf, truncate=True)
            os.unlink(b)
            time.sleep(8)
            row["new, freed 8 s"] = write(a, mib, buf, truncate=True)
            os.unlink(a)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()) + " CPU-s/GiB", flush=True)
            for k, v in row.items():
                results.setdefault(k, []).append(v)
            time.sleep(8)
    finally:
        for p in (a, b):
            if os.path.exists(p):
                os.unlink(p)
    print(f"medians of {rounds} rounds, {mib} MiB each, CPU-s per GiB written:")
    for k, v in results.items():
        print(f"  {k:18s} {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]")


if __name__ == "__main__":
    main()

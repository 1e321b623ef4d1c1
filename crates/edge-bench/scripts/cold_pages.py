#!/usr/bin/env python3
"""What writing into the page cache costs, by how recently the memory was in use.

Writes 512 MiB to a new file in DIR (1 MiB writes, then one fdatasync) several times, and
prints the CPU seconds (user + system) and the wall time of each: a first file; a second
one right after the first was deleted (its pages freed a moment ago); a third 10 s after
the second was deleted; then the same file written over again (its pages still cached).
On a virtual machine whose balloon reports free memory to the host, a page the guest has
not used for a few seconds costs a fault on the host the first time it is written again.

    python3 crates/edge-bench/scripts/cold_pages.py target/   # a disk file system, not tmpfs
"""
import os
import resource
import sys
import time

MIB = 1 << 20


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write(path: str, buf: bytes, label: str, truncate: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o600)
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(512):
        os.write(fd, buf)
    os.fdatasync(fd)
    print(f"{label:44s} CPU {cpu() - c0:6.3f} s   wall {time.perf_counter() - t0:6.3f} s   (512 MiB)", flush=True)
    os.close(fd)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = os.path.join(sys.argv[1], "cold-pages.tmp")
    buf = os.urandom(MIB)
    try:
        write(path, buf, "new file", True)
        os.unlink(path)
        write(path, buf, "new file, the previous one just deleted", True)
        os.unlink(path)
        time.sleep(10)
        write(path, buf, "new file, the previous one deleted 10 s ago", True)
        write(path, buf, "the same file written over (pages cached)", False)
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""fdatasync after appending to a file against after overwriting blocks it already holds.

Usage: fsync_append_vs_overwrite.py [DIR]   (DIR on the disk to measure; default: target/)

For each variant, writes 15 MiB in pieces of 92,177 bytes (nine 10 KiB records and a bit, so
writes straddle pages as a group commit's do), each followed by fdatasync, and prints:
the median and p90 fdatasync time, the process CPU per write+fdatasync, the process's
`write_bytes` (/proc/self/io) per byte written, and what the block device received per byte
(sectors written in /sys/dev/block/MAJ:MIN/stat, from every process on the machine).

"append" grows a new file, as a new spool segment is written; "overwrite" writes over a
16 MiB file written and fsynced beforehand, as a recycled segment (the spare) is; "reserved"
grows a new file whose 16 MiB of disk blocks were reserved first with
fallocate(FALLOC_FL_KEEP_SIZE), as the ingest's active segment is (the fallocate is measured
with the writes).
"""
import ctypes
import os
import resource
import shutil
import sys
import time

PIECE = 10240 * 9 + 17
TOTAL = 15 << 20


def device_written(path):
    st = os.stat(path)
    with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
        return int(f.read().split()[6]) * 512


def proc_written():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/self/io")


FALLOC_FL_KEEP_SIZE = 1
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def reserve(fd, length):
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fallocate(KEEP_SIZE): {os.strerror(e)}")


def run(d, name, prewrite, reserved=False):
    p = os.path.join(d, name)
    if os.path.exists(p):
        os.unlink(p)
    if prewrite:
        fd = os.open(p, os.O_CREAT | os.O_RDWR)
        os.pwrite(fd, b"z" * (16 << 20), 0)
        os.fsync(fd)
        os.close(fd)
    os.sync()
    time.sleep(0.5)
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    piece = b"x" * PIECE
    times = []
    w0, d0 = proc_written(), device_written(d)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    if reserved:
        reserve(fd, 16 << 20)
    off = 0
    while off < TOTAL:
        os.pwrite(fd, piece, off)
        off += PIECE
        t = time.perf_counter()
        os.fdatasync(fd)
        times.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    w1, d1 = proc_written(), device_written(d)
    os.close(fd)
    os.unlink(p)
    times.sort()
    n = len(times)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n
    print(
        f"{name:9} fdatasync p50 {times[n // 2] * 1e3:.3f} ms, p90 {times[n * 9 // 10] * 1e3:.3f} ms; "
        f"CPU per write+fdatasync {cpu * 1e3:.3f} ms; /proc write_bytes per byte {(w1 - w0) / off:.2f}; "
        f"device bytes per byte {(d1 - d0) / off:.2f}"
    )


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else "target"
    d = os.path.join(base, "fsync-probe")
    os.makedirs(d, exist_ok=True)
    try:
        for _ in range(2):
            run(d, "append", False)
            run(d, "overwrite", True)
            run(d, "reserved", False, reserved=True)
    finally:
        shutil.rmtree(d)


if __name__ == "__main__":
    main()

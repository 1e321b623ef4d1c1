#!/usr/bin/env python3
"""Splits a perf profile's samples into groups by where they were spent.

    perf record -F 499 --call-graph dwarf,32768 -o drain.data -p PID     (edge-bench profile --attach)
    perf script -i drain.data --no-inline -F comm,tid,ip,sym,dso > drain.txt
    python3 crates/edge-bench/scripts/perf_groups.py drain.txt

Each sample goes to the first rule below that matches any frame of its stack, searched from
the caller-most project frame down: the project's own work is named by the outermost
`edge_*` function that is one of the known stages, and everything else by the library the
leaf-most named frame belongs to. Prints the share of samples per group, and per thread.

    python3 crates/edge-bench/scripts/perf_groups.py drain.txt --under 'record_stream::Parser::parse'

counts instead the samples whose stack has a frame matching the pattern (a regular
expression), split by the frame that one called (the outermost match counts).
"""

import collections
import re
import sys

# (group, pattern on a frame's symbol), tried in order against the whole stack.
STAGES = [
    ("spool: reading chunks (SpoolReader)", re.compile(r"edge_spool::reader::")),
    (
        "spool: writer thread (commits, acks, seals)",
        re.compile(r"edge_uploader::spool_task::writer_loop|edge_spool::spool::Spool::"),
    ),
    ("intake (HTTP)", re.compile(r"edge_uploader::intake::")),
    ("intake (record stream)", re.compile(r"edge_uploader::record_stream::")),
    ("ingest store", re.compile(r"edge_ingest::store::")),
]
# Otherwise, by the leaf-most frame that names one of these.
LIBRARIES = [
    ("QUIC and TLS", re.compile(r"quinn|rustls|ring::|ring_core|aes_gcm|aes_hw|gcm_|ChaCha|udp")),
    ("HTTP (hyper, axum)", re.compile(r"hyper::|hyper_util::|axum::|http_body")),
    ("tokio", re.compile(r"tokio::")),
    ("SQLite", re.compile(r"sqlite3")),
    ("allocator", re.compile(r"jemalloc|_rjem_|malloc|free")),
]
KERNEL_SCHED = re.compile(r"schedule|finish_task_switch|futex|_raw_spin_unlock_irq|try_to_wake_up|do_syscall_64")


def samples(path):
    """Yields (thread name, [frames leaf first]) per sample of `perf script` output."""
    head, frames = None, []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                if head is not None:
                    yield head, frames
                head, frames = None, []
            elif not line.startswith((" ", "\t")):
                head = line.split()[0]
            else:
                parts = line.split(None, 1)
                frames.append(parts[1] if len(parts) > 1 else "")
    if head is not None:
        yield head, frames


def classify(frames):
    for name, pat in STAGES:
        if any(pat.search(fr) for fr in frames):
            return name
    for fr in frames:
        for name, pat in LIBRARIES:
            if pat.search(fr):
                return name
    if frames and KERNEL_SCHED.search(" ".join(frames[:6])):
        return "kernel: scheduling, wake-ups"
    return "other"


def under(path, pattern):
    """Samples under the outermost frame matching `pattern`, by the frame it called."""
    pat = re.compile(pattern)
    callees, total, matched = collections.Counter(), 0, 0
    for _comm, frames in samples(path):
        total += 1
        hits = [i for i, fr in enumerate(frames) if pat.search(fr)]
        if not hits:
            continue
        matched += 1
        i = hits[-1]
        callee = frames[i - 1] if i > 0 else "(itself)"
        # "ADDR symbol (dso)": keep the symbol, without generic parameters.
        callee = callee.rsplit(" (", 1)[0]
        while (shorter := re.sub(r"<[^<>]*>", "", callee)) != callee:
            callee = shorter
        callees[callee] += 1
    if total == 0:
        sys.exit("no samples")
    print(f"{matched} of {total} samples under {pattern!r}\n\n| called | samples |\n|---|---|")
    for name, n in callees.most_common(15):
        print(f"| {name[:100]} | {n} |")


def main():
    if len(sys.argv) == 4 and sys.argv[2] == "--under":
        under(sys.argv[1], sys.argv[3])
        return
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    groups, threads, total = collections.Counter(), collections.Counter(), 0
    for comm, frames in samples(sys.argv[1]):
        total += 1
        groups[classify(frames)] += 1
        threads[comm] += 1
    if total == 0:
        sys.exit("no samples")
    print(f"{total} samples\n\n| group | share |\n|---|---|")
    for name, n in groups.most_common():
        print(f"| {name} | {100 * n / total:.1f} % |")
    print("\n| thread | share |\n|---|---|")
    for name, n in threads.most_common():
        print(f"| {name} | {100 * n / total:.1f} % |")


if __name__ == "__main__":
    main()

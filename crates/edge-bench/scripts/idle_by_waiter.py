#!/usr/bin/env python3
"""What a thread was waiting on when its core went idle.

    perf record -e sched:sched_switch -a -g -o F      # e.g. edge-bench profile --drain --attach
    perf script -i F -F comm,pid,tid,cpu,time,event,trace,ip,sym \\
        | python3 idle_by_waiter.py [--window THREAD] [--top N]

Each switch to the idle task starts an idle period on its CPU, which ends at that CPU's next
switch. The period is charged to the thread that switched out into it: its process (named by
the process's main thread, or by PROCESSES below), its thread name, and what it blocked in (the
first kernel frame that names a wait) and from where (the first user frame with a symbol); and the idle time is also split by the
thread that ran next on that CPU, the one whose wake-up ended it.
With --window THREAD only the time from the first to the last switch that a thread of that
name takes part in counts (`edge-store`: from the ingest's first commit to its last, which
leaves out a drain's wait for the connection). Prints the idle share of the CPUs' time, per
process, and per (thread, wait, from where), largest first.
"""
import argparse
import collections
import re
import sys

# Threads whose names tell their process when its main thread never switched in the window.
PROCESSES = {
    "edge-spool": "edge-uploader",
    "edge-spool-sync": "edge-uploader",
    "edge-store": "edge-ingest",
}

WAITS = [
    ("futex", "futex (a parked worker, a lock, a condvar)"),
    ("epoll_wait", "epoll_wait"),
    ("ep_poll", "epoll_wait"),
    ("fdatasync", "fdatasync"),
    ("fsync", "fsync"),
    ("iomap_dio", "direct I/O"),
    ("io_schedule", "disk I/O"),
    ("do_sys_poll", "poll"),
    ("hrtimer_nanosleep", "sleep"),
    ("wait4", "wait for a child"),
]

HEAD = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:\s+(.*)$")


def wait_of(kernel):
    for frame in kernel:
        for key, label in WAITS:
            if key in frame:
                return label
    return "other: " + (kernel[2] if len(kernel) > 2 else "?")


def parse(lines):
    events, cur = [], None
    for line in lines:
        m = HEAD.match(line)
        if m:
            if cur:
                events.append(cur)
            comm, pid, tid, cpu, t, trace = m.groups()
            prev = re.search(r"prev_comm=(.*?) prev_pid=(\d+)", trace)
            nxt = re.search(r"next_comm=(.*?) next_pid=(\d+)", trace)
            cur = {"comm": comm, "pid": int(pid), "cpu": int(cpu), "t": float(t),
                   "prev": prev.group(1) if prev else comm, "next": nxt.group(1) if nxt else "?",
                   "next_pid": int(nxt.group(2)) if nxt else -1, "k": [], "u": []}
        elif cur and line.strip():
            parts = line.split(None, 1)
            sym = parts[1].strip() if len(parts) > 1 else "[unknown]"
            (cur["k"] if parts[0].startswith("ffffffff") else cur["u"]).append(sym)
    if cur:
        events.append(cur)
    return events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", help="thread name whose first and last switch bound the time counted")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    events = parse(sys.stdin)
    if not events:
        sys.exit("no sched_switch events on stdin")
    names = {}
    for e in events:
        if e["prev"] in PROCESSES:
            names.setdefault(e["pid"], PROCESSES[e["prev"]])
    t0, t1 = events[0]["t"], events[-1]["t"]
    if args.window:
        inside = [e["t"] for e in events if args.window in (e["prev"], e["next"])]
        if not inside:
            sys.exit(f"no switch of a thread named {args.window}")
        t0, t1 = inside[0], inside[-1]
    cpus = {e["cpu"] for e in events}
    idle_since = {}
    by_wait, by_waker = collections.Counter(), collections.Counter()
    for e in events:
        if e["t"] < t0 or e["t"] > t1:
            idle_since.pop(e["cpu"], None)
            continue
        if e["cpu"] in idle_since:
            start, key = idle_since.pop(e["cpu"])
            by_wait[key] += e["t"] - start
            if e["pid"] == 0:
                by_waker[e["next"]] += e["t"] - start
        if e["next_pid"] == 0 and e["pid"] != 0:
            proc = names.get(e["pid"], e["comm"] if e["prev"] == e["comm"] else f"pid {e['pid']}")
            where = next((u for u in e["u"] if u != "[unknown]"), "?")
            idle_since[e["cpu"]] = (e["t"], (proc, e["prev"], wait_of(e["k"]), where))
    by_proc = collections.Counter()
    for key, secs in by_wait.items():
        by_proc[key[0]] += secs
    span = (t1 - t0) * len(cpus)
    total = sum(by_proc.values())
    print(f"{t1 - t0:.3f} s on {len(cpus)} CPUs; idle {total:.3f} s = {100 * total / span:.1f} % of the CPUs' time")
    print("ended by the thread that ran next:", ", ".join(
        f"{name} {100 * v / span:.1f} %" for name, v in by_waker.most_common(args.top)))
    for proc, secs in by_proc.most_common():
        print(f"\n{proc}: {100 * secs / span:.1f} %")
        rows = sorted(((k, v) for k, v in by_wait.items() if k[0] == proc), key=lambda kv: -kv[1])
        for (_, thread, why, where), v in rows[: args.top]:
            print(f"  {100 * v / span:5.1f} %  {thread:<16} {why:<44} {where}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Summarises the pipeline reports of ab.sh (or sweep.sh): per build (A, B, or sweep.sh's
labels), the median [min-max] of each figure over its runs, as a Markdown table with each
build's median divided by that of the build measured first (A, or sweep.sh's first label);
then the agent's CPU per GiB divided by the raw quinn sender's of the same run (as the goals
of issue 5 divide them), which takes out how fast the shared machine was during each run.

    python3 crates/edge-bench/scripts/ab_summary.py /tmp/ab
    python3 crates/edge-bench/scripts/ab_summary.py /tmp/ab --every   # every row of the reports

`--every` is for reports of other subcommands (ab.sh's CASES, e.g. `compression`): each
(case, figure) row found, in the order of the first report, instead of the pipeline's list.
"""
import re
import statistics
import sys
from pathlib import Path

FIGURES = [
    ("raw quinn, 10 KiB messages", "MB/s", "raw quinn MB/s"),
    ("raw quinn, 10 KiB messages", "CPU-s/GiB sender", "raw quinn sender CPU-s/GiB"),
    ("drain of a prefilled spool", "MB/s", "drain MB/s"),
    ("drain of a prefilled spool", "CPU-s/GiB agent", "drain: agent CPU-s/GiB"),
    ("drain of a prefilled spool", "CPU-s/GiB ingest", "drain: ingest CPU-s/GiB"),
    ("drain of a prefilled spool", "MiB agent peak RSS", "drain: agent peak RSS MiB"),
    ("live, 10 KiB records, 1 per request", "MB/s", "live HTTP MB/s"),
    ("live, 10 KiB records, 1 per request", "CPU-s/GiB agent", "live HTTP: agent CPU-s/GiB"),
    ("live, 10 KiB records, 1 per request", "MiB agent peak RSS", "live HTTP: agent peak RSS MiB"),
    ("live, 10 KiB records, record-stream intake", "MB/s", "record stream MB/s"),
    ("live, 10 KiB records, record-stream intake", "CPU-s/GiB agent", "record stream: agent CPU-s/GiB"),
    ("live, 10 KiB records, record-stream intake", "CPU-s/GiB ingest", "record stream: ingest CPU-s/GiB"),
    ("live, 10 KiB records, record-stream intake", "MiB agent peak RSS", "record stream: agent peak RSS MiB"),
    # `quick` only:
    ("latency at half the live maximum (10 KiB)", "ms p50", "latency p50 ms (intake commit → ack)"),
    ("latency at half the live maximum (10 KiB)", "ms p99", "latency p99 ms (intake commit → ack)"),
]


SENDER = ("raw quinn, 10 KiB messages", "CPU-s/GiB sender")
# Ratios of a figure to the raw quinn sender's CPU per GiB of the same run.
RATIOS = [
    ("drain of a prefilled spool", "CPU-s/GiB agent", "drain: agent ÷ raw quinn sender"),
    ("live, 10 KiB records, 1 per request", "CPU-s/GiB agent", "live HTTP: agent ÷ raw quinn sender"),
    ("live, 10 KiB records, record-stream intake", "CPU-s/GiB agent", "record stream: agent ÷ raw quinn sender"),
]


def figures(path):
    """{(case, unit): value} of one pipeline report's figure table."""
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            continue
        m = re.match(r"([0-9.]+) (.*)", cells[2])
        if m:
            out[(cells[1], m.group(2))] = float(m.group(1))
    return out


def every(path):
    """The (case, unit) rows of one report, in order."""
    return list(figures(path))


def main():
    folder = Path(sys.argv[1])
    all_rows = "--every" in sys.argv[2:]
    runs = {}
    reports = sorted(folder.glob("*.md"))
    # Reports are named NN-LABEL.md in the order measured: the first label is the first run's.
    for p in reports:
        runs.setdefault(p.stem.split("-", 1)[-1], []).append(figures(p))
    labels = list(runs)
    if not labels:
        sys.exit(f"ab_summary.py: no reports in {folder}")
    first = labels[0]
    head = " | ".join(f"{k} (n={len(runs[k])})" for k in labels)
    ratios = " | ".join(f"{k} ÷ {first} (medians)" for k in labels[1:])
    print(f"| figure | {head} | {ratios} |")
    print("|---" * (2 * len(labels)) + "|")
    listed = FIGURES
    if all_rows:
        listed = [(case, unit, f"{case}: {unit}") for case, unit in every(reports[0])]
    rows = [(name, lambda f, c=case, u=unit: f.get((c, u))) for case, unit, name in listed]
    rows += [
        (name, lambda f, c=case, u=unit: f[(c, u)] / f[SENDER] if (c, u) in f and f.get(SENDER) else None)
        for case, unit, name in RATIOS
    ]
    for name, value in rows:
        if not any(value(f) is not None for k in runs for f in runs[k]):
            continue
        cols = []
        meds = []
        for k in labels:
            vals = [v for v in map(value, runs[k]) if v is not None]
            if not vals:
                cols.append("-")
                meds.append(None)
                continue
            med = statistics.median(vals)
            meds.append(med)
            cols.append(f"{med:.3g} [{min(vals):.3g}-{max(vals):.3g}]")
        ratios = [f"{m / meds[0]:.3f}" if m is not None and meds[0] else "-" for m in meds[1:]]
        print(f"| {name} | {' | '.join(cols)} | {' | '.join(ratios)} |")


if __name__ == "__main__":
    main()

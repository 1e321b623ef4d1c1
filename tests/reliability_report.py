#!/usr/bin/env python3
"""Renders the figures the reliability tests wrote (target/reliability/*.json, one object per
test, written by edge_testkit::report) as the results table of RELIABILITY.md.

    python3 tests/reliability_report.py                      # print the table
    python3 tests/reliability_report.py --write RELIABILITY.md  # merge into the table in the file

The table sits between the markers <!-- results:begin --> and <!-- results:end -->. --write
replaces the rows of the tests (by test and tier) that have a file, and keeps the other rows:
a run of part of the tiers, or on a new checkout whose target/ holds only the tests just run,
does not drop the rows of the tests it did not run.

EDGE_REPORT_DIR overrides the directory. It may list several, separated by ":", each
optionally followed by "@COMMIT", the commit its files were measured on when they do not say
(files from before the tests recorded it); a file in a later directory replaces the file of
the same name in an earlier one:

    EDGE_REPORT_DIR=/a/target/reliability@be378d6:/b/target/reliability python3 tests/reliability_report.py
"""
import datetime
import glob
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
META = {"test", "tier", "unix_time", "commit"}


def fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (list, dict)):
        s = json.dumps(v, separators=(",", ":"))
        return s if len(s) <= 80 else s[:77] + "..."
    return str(v)


def cell(text):
    """`text` fit for one table cell: no column separator, no line break."""
    return " ".join(text.replace("|", "/").split("\n"))


def rows(report_dirs):
    """The rendered rows of the files in `report_dirs`, by (test, tier)."""
    files = {}
    for spec in report_dirs.split(":"):
        directory, _, commit = spec.partition("@")
        for path in glob.glob(os.path.join(directory, "*.json")):
            files[os.path.basename(path)] = (path, commit or None)
    out = {}
    for name in sorted(files):
        path, dir_commit = files[name]
        with open(path) as f:
            doc = json.load(f)
        when = datetime.datetime.fromtimestamp(doc.get("unix_time", 0), datetime.timezone.utc)
        figures = ", ".join(f"{k}={fmt(v)}" for k, v in doc.items() if k not in META)
        commit = doc.get("commit") or dir_commit
        commit = f"`{commit}`" if commit else "(not recorded)"
        test, tier = doc.get("test", name), doc.get("tier", "?")
        out[(test, tier)] = (f"| `{test}` | {tier} | "
                             f"{when:%Y-%m-%d %H:%M} | {commit} | {cell(figures)} |")
    return out


HEAD = ["| test | tier | run (UTC) | commit | figures |", "|---|---|---|---|---|"]


def render(by_key):
    return "\n".join(HEAD + [by_key[k] for k in sorted(by_key)]) + "\n"


def existing_rows(table_text):
    """The rows of a rendered table, by (test, tier)."""
    out = {}
    for line in table_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line in HEAD or len(cells) < 5:
            continue
        out[(cells[0].strip("`"), cells[1])] = line
    return out


def main():
    report_dir = os.environ.get("EDGE_REPORT_DIR", os.path.join(ROOT, "target", "reliability"))
    new = rows(report_dir)
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        path = sys.argv[2]
        text = open(path).read()
        begin, end = "<!-- results:begin -->", "<!-- results:end -->"
        if begin not in text or end not in text:
            sys.exit(f"{path}: markers {begin} / {end} not found")
        head, rest = text.split(begin, 1)
        old, tail = rest.split(end, 1)
        merged = existing_rows(old)
        kept = len(merged.keys() - new.keys())
        merged.update(new)
        open(path, "w").write(f"{head}{begin}\n{render(merged)}{end}{tail}")
        print(f"{path}: {len(new)} row(s) from {report_dir}, {kept} kept from the table")
    elif len(sys.argv) == 1:
        sys.stdout.write(render(new))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

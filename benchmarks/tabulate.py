#!/usr/bin/env python3
"""Turns Google Benchmark JSON files (benchmarks/results/<run>/*.json) into markdown tables.

    python3 benchmarks/tabulate.py benchmarks/results/<run> [--only bench_score,bench_compact]

One table per file: benchmark name, time, and every user counter (bytes_per_second and
items_per_second are left out: the GB/s or TB/s counters say the same in readable units). Every
repetition is a row; a file that holds only aggregates (--benchmark_report_aggregates_only) gives
its medians (names end in _median)."""
import json
import re
import pathlib
import sys

SKIP = {"name", "run_name", "run_type", "repetitions", "repetition_index", "threads", "iterations",
        "family_index", "per_family_instance_index", "time_unit", "real_time", "cpu_time",
        "bytes_per_second", "items_per_second", "aggregate_name", "aggregate_unit", "label", "error_occurred",
        "error_message"}


def fmt(v):
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        return f"{v:.3g}" if a < 1 else f"{v:.1f}" if a < 1000 else f"{v:,.0f}"
    return str(v)


def table(path):
    d = json.loads(path.read_text())
    ctx = d.get("context", {})
    rows = [b for b in d["benchmarks"] if b.get("run_type") != "aggregate"]
    if not rows:  # a run with --benchmark_report_aggregates_only: its medians
        rows = [b for b in d["benchmarks"] if b.get("aggregate_name") == "median"]
    if not rows:
        return ""
    keys = []
    for b in rows:
        for k in b:
            if k not in SKIP and k not in keys and isinstance(b[k], (int, float)):
                keys.append(k)
    out = [f"#### {path.stem}  \n{ctx.get('device', '?')}, commit {ctx.get('commit', '?')}, {ctx.get('date', '?')}\n",
           "| benchmark | time | " + " | ".join(keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    for b in rows:
        name = re.sub(r"/(manual_time|iterations:\d+)", "", b["name"])
        out.append(f"| `{name}` | {b['real_time']:.4g} {b['time_unit']} | " +
                   " | ".join(fmt(b.get(k, "")) for k in keys) + " |")
    return "\n".join(out) + "\n"


def main():
    run = pathlib.Path(sys.argv[1])
    only = None
    if len(sys.argv) > 3 and sys.argv[2] == "--only":
        only = set(sys.argv[3].split(","))
    for p in sorted(run.glob("*.json")):
        if only and p.stem not in only:
            continue
        print(table(p))


if __name__ == "__main__":
    main()

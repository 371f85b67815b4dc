#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots where one 32K layer's scoring time goes (the twelfth session's split runs).

usage: score_time_plot.py RESULTS_DIR OUT_PNG

RESULTS_DIR is benchmarks/results/2026-12-02_session12: Google Benchmark JSON files named
run<k>_<binary>_<rep>.json (bench_score, and the experiment binaries bench_score_exp* of branch
exp-key-terms). One panel per aggregation (mean_variant 5, max_variant 4); one bar per measured
configuration: the median over every repetition in the directory, the whiskers its range; the
issue's target as a dashed line. Needs matplotlib (pip install matplotlib).
"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (label, binary, benchmark name without /manual_time, runs): runs restricts the source runs
# (None: every run that has it); the full kernel "before" is main at 299cd0b (runs 3, 4), "now" 15f864a (run 6).
MEAN = [
    ("plain read of the same K", "bench_score", "BM_read_k/queued:1/kernel:2", None),
    ("ring stream alone (no math)", "bench_score", "BM_ring_read_probe", None),
    ("scorer, no per-key math, no stores", "bench_score_exp4", "BM_score_key_terms/max:0/mean_variant:5", None),
    ("scorer, no per-key math", "bench_score_exp2", "BM_score_key_terms/max:0/mean_variant:5", None),
    ("scorer, norm terms from a buffer", "bench_score_exp", "BM_score_key_terms/max:0/mean_variant:5", None),
    ("scorer, 299cd0b", "bench_score", "BM_score/agg:0/page:16/hnd:0/variant:5/queued:1", {3, 4}),
    ("scorer, keys L2 evict-first (15f864a)", "bench_score", "BM_score/agg:0/page:16/hnd:0/variant:5/queued:1", {6}),
]
MAX = [
    ("scorer, no per-key math, no row fold", "bench_score_exp3", "BM_score_key_terms/max:1/mean_variant:5", None),
    ("scorer, no per-key math", "bench_score_exp2", "BM_score_key_terms/max:1/mean_variant:5", None),
    ("scorer, no row fold", "bench_score_exp5", "BM_score_key_terms/max:1/mean_variant:5", None),
    ("scorer, norm terms from a buffer", "bench_score_exp", "BM_score_key_terms/max:1/mean_variant:5", None),
    ("scorer, 299cd0b", "bench_score", "BM_score/agg:1/page:16/hnd:0/variant:4/queued:1", {3, 4}),
    ("scorer, evict-first + batched fold (15f864a)", "bench_score", "BM_score/agg:1/page:16/hnd:0/variant:4/queued:1", {6}),
]
TARGETS = {"mean": 24.7, "max": 24.9}  # µs: 1235 µs / 50, and 60% of the 4.49 TB/s read roofline

NAME = re.compile(r"run(\d+)_(bench_score(?:_exp\d?)?)(?:_\d+)?\.json$")


def load(results_dir):
    """(run, binary) -> benchmark name -> [real_time µs of each repetition]"""
    times = defaultdict(lambda: defaultdict(list))
    for path in sorted(glob.glob(os.path.join(results_dir, "run*_bench_score*.json"))):
        m = NAME.search(os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            doc = json.load(f)
        for b in doc["benchmarks"]:
            if b.get("run_type") == "aggregate":
                continue
            assert b["time_unit"] == "us", path
            name = b["run_name"].removesuffix("/manual_time")
            times[(int(m.group(1)), m.group(2))][name].append(float(b["real_time"]))
    return times


def series(times, rows):
    out = []
    for label, binary, name, runs in rows:
        v = [t for (run, b), d in times.items() if b == binary and (runs is None or run in runs) for t in d.get(name, [])]
        if not v:
            raise SystemExit(f"no measurement of {binary} {name} in the results directory")
        out.append((label, statistics.median(v), min(v), max(v), len(v)))
    return out


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    times = load(argv[1])
    panels = [("mean aggregation (mean_variant 5)", "mean", series(times, MEAN)),
              ("max aggregation (max_variant 4)", "max", series(times, MAX))]
    fig, axes = plt.subplots(2, 1, figsize=(9.0, 7.2), sharex=True)
    for ax, (title, key, rows) in zip(axes, panels):
        y = list(range(len(rows)))[::-1]
        med = [r[1] for r in rows]
        err = [[r[1] - r[2] for r in rows], [r[3] - r[1] for r in rows]]
        colors = ["tab:gray" if "scorer" not in r[0] else ("tab:red" if "15f864a" in r[0] else "tab:blue") for r in rows]
        ax.barh(y, med, xerr=err, color=colors, alpha=0.85, capsize=3)
        for yi, r in zip(y, rows):
            ax.text(r[3] + 0.3, yi, f"{r[1]:.1f} µs (n={r[4]})", va="center", fontsize=8)
        ax.set_yticks(y)
        ax.set_yticklabels([r[0] for r in rows], fontsize=8)
        ax.axvline(TARGETS[key], color="black", linestyle="--", linewidth=1)
        ax.text(TARGETS[key], len(rows) - 0.45, f" target {TARGETS[key]} µs", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("one 32K layer, 8 KV heads x 32 query heads, d = 128, bf16, page 16 (µs, H200)")
    axes[-1].set_xlim(0, 42)
    fig.suptitle("Where the scorers' time goes (benchmarks/results/2026-12-02_session12)", fontsize=11)
    fig.text(0.01, 0.005, "blue: 299cd0b and the experiments of branch exp-key-terms on it (keys at the default L2 "
             "priority); red: 15f864a", fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

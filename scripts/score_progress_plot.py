#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots the score kernels' time on one 32K layer, run by run, against the issue's targets.

usage: score_progress_plot.py OUT_PNG [REV]

The runs are read from git: benchmarks/results/<run>/ at REV (default a8ec57a, the last commit
that held them in the tree; docs/performance-history.md). Each point is the median of one run's
repetitions of
BM_score/agg:{0,1}/page:16/hnd:0/variant:V/queued:1 (one 32K layer, launch hidden) for the
fastest variant that the library itself offered at that commit (MILESTONES below: builds of main,
no experiments or diagnostic builds, whose JSON sits in the same folders). The x axis lists the
milestones in the order of their runs' dates (JSON context). Dashed lines: the targets (mean 85% of 4.49 TB/s and 50x the public
Triton scorer; max 60%) and a plain read of the same keys. Needs matplotlib (pip install matplotlib).
"""
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (run folder, JSON files in it, commit label, mean variants, max variants): the variants are those
# the library had at that commit (the fastest is plotted); empty: that aggregation was not measured.
MILESTONES = [
    ("2026-11-30_237a043", ["bench_score.json"], "237a043", {0, 1, 2, 3}, {0, 1}),
    ("2026-11-30_e6d29c8", ["bench_score.json"], "e6d29c8", {0, 1, 2, 3, 4}, {0, 1}),
    ("2026-12-01_95a4d1e", ["bench_score.json"], "95a4d1e", {0, 1, 2, 3, 4}, {0, 1}),
    ("2026-12-01_2552e97", ["bench_score.json"], "2552e97", {1, 2}, {1}),
    ("2026-12-01_10521ba", ["score_new_1.json", "score_new_2.json"], "10521ba", {1, 2, 3, 4}, {1}),
    ("2026-12-01_52509d9", ["bench_score.json"], "52509d9", {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3}),
    ("2026-12-01_d75ee8c", ["bench_score.json"], "d75ee8c", {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4}),
    ("2026-12-01_724fa97", ["bench_score.json"], "724fa97", {5}, {4, 5}),
    ("2026-12-01_3dc5bda", ["bench_score.json"], "3dc5bda", {5}, {4, 5, 6}),
    ("2026-12-02_session12", ["run6_bench_score.json"], "15f864a", {5}, {4, 6}),
    ("2026-12-02_session13", ["run7_bench_1.json", "run7_bench_2.json"], "236c3a0", {5}, {4, 5, 6}),
    ("2026-12-02_session15", ["run4_bench_score.json"], "a7f7be5", {4, 5}, {4, 5}),
    ("2026-12-02_session15", ["run5_unit_fold_1.json", "run5_unit_fold_2.json"], "5777ce8", set(), {4, 7, 8}),
    ("2026-12-04_session19", ["run5_final.json"], "f22f65b", {5, 6, 7, 8}, set()),
    ("2026-12-04_session20", ["run6_base_1.json", "run6_base_2.json"], "854d5b8", set(), {4}),
]
TARGETS = [  # (aggregation, µs, label, label offset in µs: the 24.7 and 24.9 lines are 0.2 apart)
    ("max", 24.9, "target: max 60% of 4.49 TB/s (24.9 µs)", 0.5),
    ("mean", 24.7, "target: mean 50x the Triton scorer (24.7 µs)", -1.6),
    ("mean", 17.6, "target: mean 85% of 4.49 TB/s (17.6 µs)", -1.4),
]
PLAIN_READ_US = 18.4  # BM_read_k/queued:1 (a plain 16-byte read of the same 67 MB), docs/performance-history.md
RUNS_REV = "a8ec57a"  # the last commit with every run below in benchmarks/results/
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"BM_score/agg:([01])/page:16/hnd:0/variant:(\d+)/queued:1/manual_time(_median)?$")


def read_run(rev, folder, name):
    """One run's JSON as committed at rev (the runs were pruned from the tree after it)."""
    path = f"benchmarks/results/{folder}/{name}"
    text = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout
    return path, json.loads(text)


def run_times(path, doc):
    """(aggregation 'mean'/'max', variant) -> [µs of each repetition], and the run's date."""
    out = {}
    for b in doc["benchmarks"]:
        m = NAME.match(b["name"])
        # Runs made with aggregates only carry _median rows; otherwise take the repetitions.
        if not m or (b.get("run_type") == "aggregate") != bool(m.group(3)):
            continue
        assert b["time_unit"] == "us", path
        out.setdefault(("mean" if m.group(1) == "0" else "max", int(m.group(2))), []).append(float(b["real_time"]))
    date = datetime.datetime.fromisoformat(doc["context"]["date"].replace("Z", "+00:00"))
    return out, date


def points(rev):
    """aggregation -> [(date, median µs, variant, commit)] over MILESTONES."""
    pts = {"mean": [], "max": []}
    for folder, files, commit, mean_vars, max_vars in MILESTONES:
        times, date = {}, None
        for name in files:
            t, d = run_times(*read_run(rev, folder, name))
            date = date or d
            for k, v in t.items():
                times.setdefault(k, []).extend(v)
        for agg, allowed in (("mean", mean_vars), ("max", max_vars)):
            cands = [(statistics.median(v), var) for (a, var), v in times.items() if a == agg and var in allowed]
            if allowed and not cands:
                raise SystemExit(f"{folder}: no {agg} measurement of variants {sorted(allowed)}")
            if cands:
                med, var = min(cands)
                pts[agg].append((date, med, var, commit))
    return pts


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    pts = points(argv[2] if len(argv) == 3 else RUNS_REV)
    # x: the milestones in date order, evenly spaced, labelled by commit and date.
    order = sorted({(d, c) for agg in pts for d, _, _, c in pts[agg]})
    xpos = {c: i for i, (_, c) in enumerate(order)}
    fig, ax = plt.subplots(figsize=(10.0, 5.6))
    colors = {"mean": "tab:blue", "max": "tab:red"}
    for agg in ("mean", "max"):
        p = sorted(pts[agg])
        xs, ys = [xpos[c] for *_, c in p], [t for _, t, _, _ in p]
        ax.plot(xs, ys, marker="o", color=colors[agg], label=f"{agg} aggregation (the commit's fastest variant)")
        for x, (_, t, var, _) in zip(xs, p):
            ax.annotate(f"{t:.1f}\nv{var}", (x, t), textcoords="offset points", xytext=(0, 7), ha="center",
                        fontsize=6.5, color=colors[agg])
    right = len(order) - 0.5
    left = -0.4  # labels where every series is still well above the lines
    for agg, us, label, dy in TARGETS:
        ax.axhline(us, color=colors[agg], linestyle="--", linewidth=1, alpha=0.7)
        ax.text(left, us + dy, label, fontsize=7.5, color=colors[agg])
    ax.axhline(PLAIN_READ_US, color="black", linestyle=":", linewidth=1)
    ax.text(left, PLAIN_READ_US + 0.5, f"plain read of the same keys ({PLAIN_READ_US} µs)", fontsize=7.5)
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels([f"{c}\n{d:%m-%d %H:%M}" for d, c in order], fontsize=7, rotation=45, ha="right")
    ax.set_xlim(-0.5, right)
    ax.set_ylim(0, 80)
    ax.set_ylabel("µs, one 32K layer (8 KV heads x 32,768 x 128 bf16)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Score kernels on an H200, commit by commit (launch hidden; the public Triton scorer: 1235 µs)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    for agg in ("mean", "max"):
        print(agg, " ".join(f"{c}:v{v}={t:.1f}" for _, t, v, c in sorted(pts[agg])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

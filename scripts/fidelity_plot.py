#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots attention recall vs KV budget per scorer from triattn_fidelity's CSV.

usage: fidelity_plot.py FIDELITY_CSV OUT_PNG

One column per model (stories260K, synthetic), x = budget (tokens, log2 axis); top row y =
attention recall, bottom row y = 1 - recall on a log axis (separates lines that crowd near 1);
one line per scorer. Needs matplotlib (pip install matplotlib).
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "triattention": dict(color="tab:red", marker="o", linewidth=2.2),
    "recency+sinks": dict(color="tab:blue", marker="s"),
    "key_norm": dict(color="tab:green", marker="^"),
    "random": dict(color="tab:gray", marker="x", linestyle="--"),
    "snapkv": dict(color="tab:purple", marker="D"),
    "snapkv_nowin": dict(color="tab:purple", marker="d", linestyle=":"),
    "triattention_plh": dict(color="tab:orange", marker="o", linestyle="--"),
    "triattention_union": dict(color="tab:brown", marker="o", linestyle=":"),
}


def budget_axis(ax, budgets):
    """x = budget on a log2 axis with a tick per budget, and a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.grid(True, which="both", alpha=0.3)


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    data = defaultdict(lambda: defaultdict(list))  # model -> scorer -> [(budget, recall, gen)]
    with open(argv[1], newline="") as f:
        for row in csv.DictReader(f):
            data[row["model"]][row["scorer"]].append((int(row["budget"]), float(row["recall"]), int(row["gen"])))
    models = list(data)
    fig, axes = plt.subplots(2, len(models), figsize=(5.4 * len(models), 8.0), squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        gen = None
        for scorer, pts in data[model].items():
            pts.sort()
            gen = pts[0][2]
            xs = [p[0] for p in pts]
            style = STYLE.get(scorer, {})
            top.plot(xs, [p[1] for p in pts], label=scorer, **style)
            bottom.plot(xs, [max(1.0 - p[1], 1e-6) for p in pts], label=scorer, **style)
        budgets = sorted({p[0] for pts in data[model].values() for p in pts})
        for ax in (top, bottom):
            budget_axis(ax, budgets)
            ax.set_xlabel(f"budget (tokens; {gen} generated per prompt)")
        top.set_ylabel("attention recall (full-KV mass on kept keys)")
        top.set_title(f"{model}: recall vs budget")
        top.legend(fontsize=8, loc="lower right")
        bottom.set_yscale("log")
        bottom.set_ylabel("missed attention mass, 1 - recall (log)")
        bottom.set_title(f"{model}: missed mass (lower is better)")
        bottom.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

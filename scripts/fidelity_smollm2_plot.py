#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots the SmolLM2 long-document fidelity from triattn_fidelity --doc-csv files.

usage: fidelity_smollm2_plot.py OUT_PNG DOC_CSV [DOC_CSV ...]

One column per CSV (a document length), x = budget (tokens, log2 axis); rows: next-token KL
against full KV (log), top-1 agreement with full KV, perplexity increase over full KV (%), and
attention recall. One line per scorer. Needs matplotlib (pip install matplotlib).
"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fidelity_plot import STYLE, budget_axis  # noqa: E402  (same folder)

PANELS = [
    ("kl", "KL full‖compressed (nats, log)", True),
    ("top1", "top-1 = full KV", False),
    ("dppl", "perplexity vs full KV (%)", False),
    ("recall", "attention recall", False),
]


def read(path):
    data = defaultdict(list)  # scorer -> [(budget, metrics)]
    tokens = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["task"] != "doc":
                continue
            tokens = int(row["tokens"])
            ppl, full = float(row["ppl"]), float(row["ppl_full"])
            data[row["scorer"]].append(
                (int(row["budget"]), dict(kl=float(row["kl"]), top1=float(row["top1"]),
                                          dppl=100.0 * (ppl / full - 1.0), recall=float(row["recall"]))))
    return tokens, data


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [read(p) for p in argv[2:]]
    fig, axes = plt.subplots(len(PANELS), len(runs), figsize=(5.6 * len(runs), 3.2 * len(PANELS)), squeeze=False)
    for col, (tokens, data) in enumerate(runs):
        budgets = sorted({b for pts in data.values() for b, _ in pts})
        for row, (key, label, log) in enumerate(PANELS):
            ax = axes[row][col]
            for scorer, pts in data.items():
                pts = sorted(pts)
                ys = [m[key] for _, m in pts]
                if log:
                    ys = [max(y, 1e-5) for y in ys]
                ax.plot([b for b, _ in pts], ys, label=scorer, **STYLE.get(scorer, {}))
            budget_axis(ax, budgets)
            if log:
                ax.set_yscale("log")
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"SmolLM2-135M, {tokens}-token document")
            if row == len(PANELS) - 1:
                ax.set_xlabel("budget (tokens)")
        axes[0][col].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

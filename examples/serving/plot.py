#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of serving runs (the JSON files `serving --json` writes).

    examples/serving/plot.py OUT_DIR run1.json [run2.json ...]

Writes, when matplotlib is installed:
  throughput_vs_rate.png   output tok/s and TTFT p99 against the Poisson arrival rate, one line
                           per configuration (runs with a rate > 0)
  timeline_<file>.png      per run of each file: requests running and waiting, KV bytes held and
                           device memory in use over time
  itl_<file>.png           per run of each file (from its step log): the inter-token latency of
                           every decode-only step over time, with its p50 and p99; steps that
                           mapped or unmapped KV slabs, waited for a round or captured a CUDA
                           graph marked apart
Without matplotlib it prints the same numbers as text (the table rows, the decode ITL by batch
size and what its tail had, and per rate the highest rate whose TTFT p99 is at most --ttft-slo
seconds).
"""
import argparse
import json
import os
import sys


def load(paths):
    files = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            files.append((os.path.basename(p), json.load(f)))
    return files


def sustained(runs, slo):
    """Highest rate per configuration whose TTFT p99 <= slo (None when no rate does)."""
    best = {}
    for r in runs:
        if r["rate"] <= 0:
            continue
        ok = r["ttft_s"]["p99"] is not None and r["ttft_s"]["p99"] <= slo
        cur = best.setdefault(r["config"], None)
        if ok and (cur is None or r["rate"] > cur):
            best[r["config"]] = r["rate"]
    return best


def print_text(files, slo):
    for name, doc in files:
        print(f"== {name}: {doc['model']}, {doc['workload']}, KV limit {doc['kv_limit_bytes'] / 1e9:.2f} GB"
              + (f" ({doc['note']})" if doc.get("note") else ""))
        for r in doc["runs"]:
            rate = "offline" if r["rate"] == 0 else "trace" if r["rate"] < 0 else f"{r['rate']:g}/s"
            print(f"  {r['config']:<12} {rate:>8}  {r['output_tok_s']:9.1f} tok/s  {r['requests_s']:7.3f} req/s  "
                  f"TTFT p50/p99 {r['ttft_s']['p50']:.2f}/{r['ttft_s']['p99']:.2f} s  "
                  f"TPOT p50 {r['tpot_s']['p50'] * 1e3:.1f} ms  decode ITL p50/p99 "
                  f"{r['itl_decode_only_s']['p50'] * 1e3:.1f}/{r['itl_decode_only_s']['p99'] * 1e3:.1f} ms  "
                  f"peak KV {r['peak_kv_bytes'] / 2**30:.2f} GiB  device {r['peak_device_bytes'] / 2**30:.2f} GiB  "
                  f"max running {r['max_running']}  preemptions {r['preemptions']}")
            bands = r.get("itl_bands")
            if bands:
                print("      decode ITL by decode rows (steps: p50/p99 ms): " + "  ".join(
                    f"[{b['rows_lo']}-{b['rows_hi']}] {b['steps']}: {b['p50'] * 1e3:.2f}/{b['p99'] * 1e3:.2f}"
                    for b in bands))
            tail = r.get("itl_tail")
            if tail and tail["tail"]["steps"]:
                for side in ("tail", "all"):
                    t = tail[side]
                    m = t["mean_s"]
                    print(f"      {'tail (>= p99)' if side == 'tail' else 'all decode-only'}: {t['steps']} steps, "
                          f"rows {t['mean_rows']:.0f}, gap {m['gap'] * 1e3:.2f} ms = sched {m['sched'] * 1e3:.2f} "
                          f"(round wait {m['round_wait'] * 1e3:.2f}) + enqueue {m['enqueue'] * 1e3:.2f} + during "
                          f"{m['during'] * 1e3:.2f} + sync {m['sync'] * 1e3:.2f} + post {m['post'] * 1e3:.2f}; device "
                          f"{m['device'] * 1e3:.2f}; round launched {t['round_launched']}, waited {t['round_waited']}, "
                          f"slabs mapped {t['slabs_mapped']} / unmapped {t['slabs_unmapped']}, graph captured "
                          f"{t['graph_captured']}, after prefill {t['after_prefill']}, bucket changed {t['bucket_changed']}")
        for cfg, rate in sustained(doc["runs"], slo).items():
            print(f"  highest rate with TTFT p99 <= {slo:g} s, {cfg}: {rate if rate is not None else 'none measured'}")


def plot(files, out_dir, plt):
    os.makedirs(out_dir, exist_ok=True)
    swept = [r for _, doc in files for r in doc["runs"] if r["rate"] > 0]
    if swept:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for cfg in sorted({r["config"] for r in swept}):
            pts = sorted((r["rate"], r["output_tok_s"], r["ttft_s"]["p99"]) for r in swept if r["config"] == cfg)
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cfg)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=cfg)
        a1.set_xlabel("arrival rate (requests/s)")
        a1.set_ylabel("output tokens/s")
        a2.set_xlabel("arrival rate (requests/s)")
        a2.set_ylabel("TTFT p99 (s)")
        a2.set_yscale("log")
        a1.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "throughput_vs_rate.png"), dpi=120)
        plt.close(fig)
    for name, doc in files:
        runs = doc["runs"]
        if not runs:
            continue
        fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        for r in runs:
            tl = r["timeline"]
            label = r["config"] + ("" if r["rate"] <= 0 else f" @{r['rate']:g}/s")
            axes[0].plot(tl["t"], tl["running"], label=label)
            axes[1].plot(tl["t"], [b / 2**30 for b in tl["kv_bytes"]], label=label + " KV")
            if any(tl["device_bytes"]):
                axes[1].plot(tl["t"], [b / 2**30 for b in tl["device_bytes"]], linestyle="--", label=label + " device")
        axes[0].set_ylabel("requests running")
        axes[1].set_ylabel("GiB")
        axes[1].set_xlabel("time (s)")
        axes[0].legend(fontsize=7)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "timeline_" + os.path.splitext(name)[0] + ".png"), dpi=120)
        plt.close(fig)


def decode_only_steps(run):
    """(time, gap, flagged) of the decode-only steps in a run's step log (flagged: a step that
    mapped or unmapped KV slabs, waited for a round or captured a graph); [] without a log."""
    log = run.get("step_log")
    if not log:
        return []
    out = []
    for i in range(1, len(log["gap_us"])):
        if log["decode_rows"][i] > 0 and log["prefill_tokens"][i] == 0:
            flagged = (log["slabs_mapped"][i] or log["slabs_unmapped"][i] or log["round_waits"][i]
                       or log["graph_captures"][i])
            out.append((log["start_us"][i] * 1e-6, log["gap_us"][i] * 1e-6, bool(flagged)))
    return out


def plot_itl(files, out_dir, plt):
    for name, doc in files:
        runs = [r for r in doc["runs"] if decode_only_steps(r)]
        if not runs:
            continue
        fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
        for ax, r in zip(axes[:, 0], runs):
            pts = decode_only_steps(r)
            plain = [(t, g * 1e3) for t, g, f in pts if not f]
            marked = [(t, g * 1e3) for t, g, f in pts if f]
            ax.scatter([p[0] for p in plain], [p[1] for p in plain], s=2, label="decode-only step")
            if marked:
                ax.scatter([p[0] for p in marked], [p[1] for p in marked], s=6, color="red",
                           label="mapped/unmapped slabs, waited for a round or captured a graph")
            itl = r["itl_decode_only_s"]
            ax.axhline(itl["p50"] * 1e3, color="gray", linestyle="--", linewidth=0.8, label="p50")
            ax.axhline(itl["p99"] * 1e3, color="black", linestyle=":", linewidth=0.8, label="p99")
            label = r["config"] + ("" if r["rate"] <= 0 else f" @{r['rate']:g}/s")
            ax.set_title(label, fontsize=9)
            ax.set_ylabel("ITL (ms)")
            ax.legend(fontsize=6, loc="upper right")
        axes[-1, 0].set_xlabel("time (s)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "itl_" + os.path.splitext(name)[0] + ".png"), dpi=120)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("json", nargs="+")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT p99 bound of a sustained rate (s)")
    a = ap.parse_args()
    files = load(a.json)
    print_text(files, a.ttft_slo)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: text only", file=sys.stderr)
        return 0
    plot(files, a.out_dir, plt)
    plot_itl(files, a.out_dir, plt)
    print(f"plots written to {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

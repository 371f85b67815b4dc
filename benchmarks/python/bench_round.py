#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The round from Python on the GPU, Qwen3-8B shape (36 layers, 32 query / 8 KV heads, head_dim
128, bf16), vLLM FlashAttention layout (block 16), every sequence 2,560 -> 2,048 tokens, batch 1
and 8. In one process:

  * device time of one triattn round (CUDA events over repeated rounds; the round never writes
    seq_lens, so every repetition does the same work);
  * host time of the Python call (Compressor._round with every array preallocated, the
    Compressor.round wrapper, and torch.ops.triattn.round), against the host time spent inside
    the library's C++ launch (cuda::paged_round, measured by the extension): the difference is
    the Python overhead, in microseconds;
  * the same round written in plain PyTorch (scores by matmul, z-normalisation, topk, gather and
    scatter through the block table), device time, and triattn's speed-up over it.

    python benchmarks/python/bench_round.py [--stats ../shared/data/calibration/qwen3_8b.pt] [--json out.json]

Needs torch with CUDA and triattn built with TRIATTN_PYTHON_CUDA=ON.
"""
import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

import triattn
import triattn.torch_ops  # noqa: F401

L, HQ, HKV, D, BS = 36, 32, 8, 128, 16
G, F = HQ // HKV, D // 2
LEN, BUDGET, SLACK = 2560, 2048, 512
THETA = 1e6
OFFSET_MAX = 65536


def build(batch, stats, dev):
    nb = LEN // BS
    num_blocks = batch * nb + 8
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = [torch.randn((2, num_blocks, BS, HKV, D), generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
          for _ in range(L)]
    perm = torch.randperm(num_blocks, generator=gen, device=dev)[: batch * nb].to(torch.int32)
    tables = perm.view(batch, nb).contiguous()
    lens = torch.full((batch,), LEN, dtype=torch.int32, device=dev)
    ids = torch.arange(batch, dtype=torch.int32, device=dev)
    t0 = torch.full((batch,), LEN + 100, dtype=torch.int64, device=dev)
    prompts = torch.zeros(batch, dtype=torch.int32, device=dev)
    return kv, tables, lens, ids, t0, prompts


def cuda_time_us(fn, reps):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def host_call_us(fn, reps):
    """Median host time of one call (synchronised before each, not after: launch cost only)."""
    times, lib = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t) / 1000.0)
        lib.append(triattn._triattn._last_round_ns() / 1000.0)
    torch.cuda.synchronize()
    return statistics.median(times), statistics.median(lib)


class TorchRound:
    """The same round in plain PyTorch (per_head, mean aggregation, z-normalised, no protection)."""

    def __init__(self, stats, dev):
        q = torch.complex(torch.tensor(stats.q_mean_real, dtype=torch.float64),
                          torch.tensor(stats.q_mean_imag, dtype=torch.float64)).to(dev)      # [L, Hq, F]
        absq = torch.sqrt(q.real ** 2 + q.imag ** 2 + 1e-8)
        c = torch.tensor(stats.q_abs_mean, dtype=torch.float64, device=dev) - absq           # [L, Hq, F]
        self.c = c.float().view(L, HKV, G, F).transpose(2, 3).contiguous()                   # [L, Hkv, F, G]
        self.q = q
        self.omega = THETA ** (-torch.arange(F, dtype=torch.float64, device=dev) * 2 / D)    # [F]
        deltas = 2.0 ** torch.arange(int(math.log2(OFFSET_MAX)) + 1, dtype=torch.float64, device=dev)
        self.cmean = torch.exp(1j * deltas[:, None] * self.omega[None, :]).mean(0)            # [F]

    def __call__(self, kv, tables, ids, t0, budget):
        B = ids.shape[0]
        nb = LEN // BS
        blk = tables[ids.long(), :nb].long()                                                 # [B, nb]
        phase = torch.exp(1j * t0.double()[:, None] * self.omega[None, :]) * self.cmean      # [B, F]
        w = self.q[None] * phase[:, None, None, :]                                          # [B, L, Hq, F]
        wcat = torch.cat([w.real, w.imag], dim=-1).float()                                  # [B, L, Hq, D] (half pairing)
        wcat = wcat.view(B, L, HKV, G, D).transpose(3, 4)                                   # [B, L, Hkv, D, G]
        agg = torch.zeros(B, HKV, LEN, device=kv[0].device)
        for l in range(L):
            k = kv[l][0][blk].view(B, LEN, HKV, D).permute(0, 2, 1, 3).float()             # [B, Hkv, T, D]
            s = k @ wcat[:, l]                                                              # [B, Hkv, T, G]
            kn = torch.sqrt(k[..., :F] ** 2 + k[..., F:] ** 2 + 1e-8)
            s = s + kn @ self.c[l]
            s = (s - s.mean(2, keepdim=True)) / s.std(2, unbiased=False, keepdim=True).clamp_min(1e-6)
            agg += s.amax(-1)
        keep = (agg / L).topk(budget, dim=-1).indices.sort(-1).values                       # [B, Hkv, budget]
        slots = torch.arange(budget, device=keep.device)
        dst_b = blk[:, slots // BS]                                                         # [B, budget]
        dst_o = (slots % BS).expand(B, budget)
        idx = keep.transpose(1, 2)[..., None].expand(B, budget, HKV, D)
        for l in range(L):
            for kind in (0, 1):
                x = kv[l][kind][blk].view(B, LEN, HKV, D)
                kv[l][kind][dst_b, dst_o] = x.gather(1, idx)
        return keep


def main():
    ap = argparse.ArgumentParser()
    root = Path(__file__).resolve().parents[2]
    found = [p for p in (root / ".." / "shared", root / "shared") if (p / "data" / "calibration" / "qwen3_8b.pt").exists()]
    default_stats = (found[0] if found else root / ".." / "shared") / "data" / "calibration" / "qwen3_8b.pt"
    ap.add_argument("--stats", default=str(default_stats))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert triattn.has_cuda, "triattn was built without CUDA (TRIATTN_PYTHON_CUDA=ON pip install .)"
    dev = torch.device("cuda:0")
    stats = (triattn.load_pt_stats(args.stats, num_layers=L, num_q_heads=HQ, head_dim=D)
             if Path(args.stats).exists() else triattn.random_query_stats(0, L, HQ, D))
    sel = triattn.SelectionParams(budget=BUDGET, divide_length=SLACK, mode=triattn.PruningMode.PER_HEAD)
    comp = triattn.Compressor(stats, triattn.RopeConfig(theta=THETA), sel, num_kv_heads=HKV)
    results = []
    print(f"device: {torch.cuda.get_device_name(dev)}; stats: {stats.model_name}")
    print("batch | triattn round us | py call us | wrapper us | op us | C++ launch us | overhead us | "
          "torch round us | speed-up")
    for batch in (1, 8):
        kv, tables, lens, ids, t0, prompts = build(batch, stats, dev)
        cache = triattn.vllm_cache(kv, "flash_attn")
        rows = comp.kept_rows()
        out = triattn.RoundResult(*(torch.empty(batch, dtype=torch.int32, device=dev) for _ in range(4)),
                                  torch.empty((batch, rows, LEN), dtype=torch.int32, device=dev), None)
        ws = torch.empty(comp.workspace_size(batch, LEN, "cuda:0", tables.shape[0], cache.num_blocks), dtype=torch.uint8,
                         device=dev)
        stream = torch.cuda.current_stream(dev).cuda_stream
        trig = triattn.RoundTrigger.IF_DUE

        def direct():
            comp._round(cache, tables, lens, ids, t0, prompts, out.new_lens, out.status, out.freed_begin,
                        out.freed_end, out.kept, None, ws, LEN, trig, stream)

        def wrapper():
            comp.round(cache, tables, lens, ids, t0, prompts, out=out, workspace=ws, max_len=LEN)

        handle = triattn.torch_ops.register(comp, cache)

        def op():
            torch.ops.triattn.round(handle, kv, tables, lens, ids, t0, prompts, out.new_lens, out.status,
                                    out.freed_begin, out.freed_end, out.kept, None, ws, LEN, int(trig))

        dev_us = cuda_time_us(direct, args.reps)
        torch.cuda.synchronize()
        assert int(out.new_lens.min()) == BUDGET and int(out.status.max()) == int(triattn.RoundStatus.COMPRESSED)
        py_us, lib_us = host_call_us(direct, args.reps)
        wrap_us, _ = host_call_us(wrapper, args.reps)
        op_us, _ = host_call_us(op, args.reps)
        ref = TorchRound(stats, dev)
        torch_us = cuda_time_us(lambda: ref(kv, tables, ids, t0, BUDGET), max(5, args.reps // 5))
        # agreement of the kept sets on a fresh cache (informative: float order differs)
        kv2, *_ = build(batch, stats, dev)
        cache2 = triattn.vllm_cache(kv2, "flash_attn")
        res = comp.round(cache2, tables, lens, ids, t0, prompts, max_len=LEN)
        kv3, *_ = build(batch, stats, dev)
        keep = ref(kv3, tables, ids, t0, BUDGET)
        torch.cuda.synchronize()
        same = sum(len(set(res.kept[b, h, :BUDGET].tolist()) & set(keep[b, h].tolist()))
                   for b in range(batch) for h in range(HKV)) / (batch * HKV * BUDGET)
        triattn.torch_ops.unregister(handle)
        row = dict(batch=batch, triattn_round_us=dev_us, python_call_us=py_us, wrapper_call_us=wrap_us,
                   torch_op_call_us=op_us, cxx_launch_us=lib_us, python_overhead_us=py_us - lib_us,
                   torch_round_us=torch_us, speedup=torch_us / dev_us, kept_set_agreement=same)
        results.append(row)
        print(f"{batch:5d} | {dev_us:16.1f} | {py_us:10.1f} | {wrap_us:10.1f} | {op_us:5.1f} | {lib_us:13.1f} | "
              f"{py_us - lib_us:11.1f} | {torch_us:14.1f} | {torch_us / dev_us:7.1f}x  (kept sets agree {same:.3f})")
        del kv, kv2, kv3, cache, cache2
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), results=results), indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""triattn from a Python engine: a paged KV cache in vLLM's FlashAttention layout (numpy here; torch
CUDA tensors work the same way on a CUDA build), decode steps, and the compression round between
them. The engine keeps its own block tables, lengths and free-block list; triattn compacts the
K/V in place and says what changed.

    python examples/python/vllm_style.py [--steps 300]
"""
import argparse

import numpy as np

import triattn

L, HQ, HKV, D = 4, 8, 2, 64        # a small model's attention shape
BLOCK, NUM_BLOCKS, MAX_SEQS = 16, 96, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    # The engine's memory: one tensor per layer, [2, num_blocks, block_size, kv_heads, head_dim].
    kv_caches = [np.zeros((2, NUM_BLOCKS, BLOCK, HKV, D), np.float16) for _ in range(L)]
    block_tables = np.full((MAX_SEQS, NUM_BLOCKS), -1, np.int32)
    seq_lens = np.zeros(MAX_SEQS, np.int32)
    free_blocks = list(range(NUM_BLOCKS))

    # triattn: statistics (synthetic here; load_pt_stats("qwen3_8b.pt") for a real model), RoPE,
    # selection. The view is built once over the engine's tensors: no copy.
    sel = triattn.SelectionParams(budget=64, divide_length=32, mode=triattn.PruningMode.PER_HEAD)
    comp = triattn.Compressor(triattn.random_query_stats(1, L, HQ, D), triattn.RopeConfig(theta=1e6), sel,
                              num_kv_heads=HKV)
    cache = triattn.vllm_cache(kv_caches, "flash_attn")

    # Admission: with compression a request never holds more than max_resident_tokens.
    cfg = triattn.CacheConfig(triattn.ModelGeometry(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D),
                              block_size=BLOCK, num_blocks=NUM_BLOCKS, dtype=triattn.DType.FLOAT16)
    requests = [triattn.AdmissionRequest(rng.integers(20, 60), args.steps) for _ in range(6)]
    n = triattn.admissible_prefix(cfg, requests, sel, free_blocks=len(free_blocks))
    fp = [triattn.request_footprint(cfg, r, sel) for r in requests[:n]]
    print(f"admitted {n} of {len(requests)} requests: {sum(f.max_blocks for f in fp)} blocks worst case "
          f"(uncompressed they would need {sum(-(-f.uncompressed_tokens // BLOCK) for f in fp)})")

    rows = comp.kept_rows()
    seqs = {}  # row -> dict(prompt, logical, positions [kept_rows, len]: original position of each slot)

    def write_tokens(row, n_new):
        """The model's forward pass would write K/V here (random values stand in)."""
        start = int(seq_lens[row])
        end = start + n_new
        while -(-end // BLOCK) > np.count_nonzero(block_tables[row] >= 0):
            block_tables[row, np.count_nonzero(block_tables[row] >= 0)] = free_blocks.pop()
        for slot in range(start, end):
            b, off = block_tables[row, slot // BLOCK], slot % BLOCK
            for layer in kv_caches:
                layer[:, b, off] = rng.standard_normal((2, HKV, D)).astype(np.float16)
        seq_lens[row] = end
        s = seqs[row]
        s["positions"] = np.concatenate(
            [s["positions"], np.broadcast_to(np.arange(s["logical"], s["logical"] + n_new, dtype=np.int32),
                                             (rows, n_new))], axis=1)
        s["logical"] += n_new

    for row, r in enumerate(requests[:n]):  # prefill
        seqs[row] = dict(prompt=int(r.prompt_len), logical=0, positions=np.zeros((rows, 0), np.int32))
        write_tokens(row, int(r.prompt_len))

    rounds = evicted = 0
    peak = 0
    for step in range(args.steps):
        for row in seqs:  # one decode step: every sequence appends one token
            write_tokens(row, 1)
        peak = max(peak, int(seq_lens[list(seqs)].max()))
        # The round between decode steps, over the whole running batch: sequences below
        # budget + divide_length come back NOT_DUE and untouched.
        ids = np.array(sorted(seqs), np.int32)
        t0 = np.array([seqs[r]["logical"] for r in ids], np.int64)
        prompts = np.array([seqs[r]["prompt"] for r in ids], np.int32)
        max_len = int(seq_lens[ids].max())
        slot_pos = np.zeros((len(ids), rows, max_len), np.int32)
        for b, r in enumerate(ids):
            slot_pos[b, :, : seq_lens[r]] = seqs[r]["positions"]
        res = comp.round(cache, block_tables, seq_lens, ids, t0, prompts, slot_positions=slot_pos, max_len=max_len)
        # Apply the outputs to the engine's own bookkeeping: lengths, freed blocks, positions.
        for b, (r, blocks) in enumerate(zip(ids, triattn.freed_blocks(block_tables, ids, res))):
            if res.status[b] != triattn.RoundStatus.COMPRESSED:
                continue
            rounds += 1
            evicted += int(seq_lens[r] - res.new_lens[b])
            free_blocks.extend(int(x) for x in blocks)
            block_tables[r, res.freed_begin[b]:res.freed_end[b]] = -1
            seq_lens[r] = res.new_lens[b]
            seqs[r]["positions"] = res.kept[b, :, : res.new_lens[b]].copy()

    for f, r in zip(fp, seqs):
        assert seqs[r]["positions"].shape[1] <= f.max_tokens
    print(f"{args.steps} decode steps, {len(seqs)} sequences: {rounds} rounds evicted {evicted} tokens; "
          f"longest sequence held {peak} tokens (bound {max(f.max_tokens for f in fp)}); "
          f"{len(free_blocks)} of {NUM_BLOCKS} blocks free")
    r0 = sorted(seqs)[0]
    print(f"sequence {r0}: {int(seq_lens[r0])} cached of {seqs[r0]['logical']} processed; KV head 0 keeps "
          f"positions {seqs[r0]['positions'][0, :6].tolist()} ... {seqs[r0]['positions'][0, -4:].tolist()}")


if __name__ == "__main__":
    main()

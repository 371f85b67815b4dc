# SPDX-License-Identifier: Apache-2.0
"""Test helpers: an engine's paged KV cache in numpy (vLLM and SGLang layouts), filled with the
same tokens as the library's own KvCache, which is the oracle the round is compared with.

The engine tensors are written and read through each layout's documented indexing, never through
triattn's view helpers, so a wrong stride in those helpers cannot hide itself."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import triattn

LAYOUTS = ("vllm_flash_attn", "vllm_flashinfer", "vllm_flashinfer_hnd", "sglang")
NP_DTYPES = {triattn.DType.FLOAT32: np.float32, triattn.DType.FLOAT16: np.float16}


class EngineCache:
    """Per-layer tensors of one engine layout, block (page) size bs; SGLang has bs == 1."""

    def __init__(self, layout: str, L: int, Hkv: int, D: int, bs: int, num_blocks: int, dtype, rng):
        self.layout, self.L, self.Hkv, self.D, self.bs, self.num_blocks = layout, L, Hkv, D, bs, num_blocks
        shape = {
            "vllm_flash_attn": (2, num_blocks, bs, Hkv, D),
            "vllm_flashinfer": (num_blocks, 2, bs, Hkv, D),
            "vllm_flashinfer_hnd": (num_blocks, 2, Hkv, bs, D),
            "sglang": (num_blocks, Hkv, D),
        }[layout]
        assert layout != "sglang" or bs == 1
        # Garbage everywhere: slots the round must not touch keep it, and a read of an unwritten
        # slot shows up as a mismatch.
        def fill():
            return rng.standard_normal(shape).astype(dtype) * 7
        if layout == "sglang":
            self.k = [fill() for _ in range(L)]
            self.v = [fill() for _ in range(L)]
        else:
            self.kv = [fill() for _ in range(L)]

    def paged_cache(self) -> triattn.PagedCache:
        if self.layout == "sglang":
            return triattn.sglang_cache(self.k, self.v)
        return triattn.vllm_cache(self.kv, {"vllm_flash_attn": "flash_attn", "vllm_flashinfer": "flashinfer",
                                            "vllm_flashinfer_hnd": "flashinfer_hnd"}[self.layout])

    def _index(self, kind: int, block: int, off: int):
        if self.layout == "vllm_flash_attn":
            return (kind, block, off, slice(None), slice(None))
        if self.layout == "vllm_flashinfer":
            return (block, kind, off, slice(None), slice(None))
        if self.layout == "vllm_flashinfer_hnd":
            return (block, kind, slice(None), off, slice(None))
        return (block, slice(None), slice(None))

    def _tensor(self, layer: int, kind: int):
        if self.layout == "sglang":
            return (self.k if kind == 0 else self.v)[layer]
        return self.kv[layer]

    def write(self, layer: int, block: int, off: int, k_vec, v_vec):
        self._tensor(layer, 0)[self._index(0, block, off)] = k_vec
        self._tensor(layer, 1)[self._index(1, block, off)] = v_vec

    def read(self, layer: int, block: int, off: int):
        return (self._tensor(layer, 0)[self._index(0, block, off)].copy(),
                self._tensor(layer, 1)[self._index(1, block, off)].copy())

    def snapshot(self):
        if self.layout == "sglang":
            return [a.copy() for a in self.k + self.v]
        return [a.copy() for a in self.kv]

    def tensors(self):
        return self.k + self.v if self.layout == "sglang" else self.kv


@dataclass
class Case:
    """A batch of sequences present both in the oracle KvCache and in an engine cache."""
    geom: tuple
    bs: int
    dtype: object
    oracle: triattn.KvCache
    engine: EngineCache
    tables: np.ndarray            # [max_rows, max_blocks] int32, -1 padded
    lens: np.ndarray              # [max_rows] int32
    rows: list                    # engine row of each sequence
    oracle_ids: list              # oracle sequence id of each sequence
    prompts: list
    tokens: list = field(default_factory=list)  # (K, V) [L, T, Hkv, D] of each sequence, original order


def make_stats(L, Hq, D, seed=7):
    return triattn.random_query_stats(seed, L, Hq, D)


def build_case(layout, geom, bs, dtype, seqs, selection, seed=0, extra_rows=2, spare_blocks=5, stats=None):
    """seqs: list of (prompt_len, decode_len). Engine rows are a shuffled subset of more rows than
    sequences, block ids a random permutation of the pool (never in order)."""
    L, Hq, Hkv, D = geom
    rng = np.random.default_rng(seed)
    np_dtype = NP_DTYPES[dtype]
    blocks_per = [-(-(p + n) // bs) for p, n in seqs]
    max_blocks = max(blocks_per) + 2
    num_blocks = sum(blocks_per) + spare_blocks
    stats = stats or make_stats(L, Hq, D)
    rope = triattn.RopeConfig(theta=10000.0)
    cfg = triattn.CacheConfig(triattn.ModelGeometry(num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D),
                              block_size=bs, num_blocks=num_blocks, max_seqs=len(seqs), dtype=dtype,
                              track_positions=True)  # the oracle's reports carry kept positions
    oracle = triattn.KvCache(cfg, stats, rope, selection)
    engine = EngineCache(layout, L, Hkv, D, bs, num_blocks, np_dtype, rng)
    n_rows = len(seqs) + extra_rows
    tables = np.full((n_rows, max_blocks), -1, dtype=np.int32)
    lens = np.zeros(n_rows, dtype=np.int32)
    rows = list(rng.permutation(n_rows)[: len(seqs)])
    pool = list(rng.permutation(num_blocks))
    case = Case(geom, bs, dtype, oracle, engine, tables, lens, rows, [], [p for p, _ in seqs])
    for (p, n), row, nb in zip(seqs, rows, blocks_per):
        T = p + n
        K = (rng.standard_normal((L, T, Hkv, D)) * 2).astype(np_dtype)
        V = rng.standard_normal((L, T, Hkv, D)).astype(np_dtype)
        sid = oracle.add_sequence()
        assert oracle.append(sid, np.ascontiguousarray(K[:, :p]), np.ascontiguousarray(V[:, :p]), triattn.Phase.PREFILL)
        if n:
            assert oracle.append(sid, np.ascontiguousarray(K[:, p:]), np.ascontiguousarray(V[:, p:]),
                                 triattn.Phase.DECODE)
        ids = [pool.pop() for _ in range(nb)]
        tables[row, :nb] = ids
        lens[row] = T
        for l in range(L):
            for i in range(T):
                engine.write(l, ids[i // bs], i % bs, K[l, i], V[l, i])
        case.oracle_ids.append(sid)
        case.tokens.append((K, V))
    return case


def engine_gather(case: Case, row: int, length: int):
    """(K, V) [L, length, Hkv, D] of engine row `row`, slots in order."""
    L, _, Hkv, D = case.geom
    K = np.empty((L, length, Hkv, D), dtype=NP_DTYPES[case.dtype])
    V = np.empty_like(K)
    for l in range(L):
        for i in range(length):
            K[l, i], V[l, i] = case.engine.read(l, int(case.tables[row, i // case.bs]), i % case.bs)
    return K, V


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float array (bitwise comparison, NaN-safe)."""
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def synthetic_batch(L=1, Hq=4, Hkv=2, D=64, bs=16, num_blocks=256, batch=4, seed=0, budget=64):
    """A round's inputs without an oracle: per-layer K and V lists of random float32 arrays
    [num_blocks, bs, Hkv, D] (for PagedCache(k, v)), a Compressor, and the round's arrays
    (keyword arguments of Compressor.round); sequence b owns blocks [b * n, (b + 1) * n) of
    n = num_blocks // batch, all full."""
    rng = np.random.default_rng(seed)
    k = [rng.standard_normal((num_blocks, bs, Hkv, D)).astype(np.float32) for _ in range(L)]
    v = [rng.standard_normal((num_blocks, bs, Hkv, D)).astype(np.float32) for _ in range(L)]
    n = num_blocks // batch
    lens = np.full(batch, n * bs, np.int32)
    args = dict(block_tables=np.arange(batch * n, dtype=np.int32).reshape(batch, n), seq_lens=lens,
                seq_ids=np.arange(batch, dtype=np.int32), t0=lens.astype(np.int64) + 5,
                prompt_lens=np.zeros(batch, np.int32))
    sel = triattn.SelectionParams(budget=budget, divide_length=16)
    comp = triattn.Compressor(triattn.random_query_stats(seed + 1, L, Hq, D), triattn.RopeConfig(), sel,
                              num_kv_heads=Hkv)
    return k, v, comp, args

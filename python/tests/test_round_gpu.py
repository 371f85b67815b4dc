# SPDX-License-Identifier: Apache-2.0
"""GPU tests (torch CUDA tensors): the device round equals the CPU round bitwise; the custom op
under torch.compile and captured in a CUDA graph equals the eager call.

Skipped (with the reason) only where torch or a CUDA device is missing; on a CUDA machine a
triattn built without CUDA fails them instead of skipping."""
import importlib

import numpy as np
import pytest

import triattn
from engine_cache import LAYOUTS

torch = pytest.importorskip("torch", reason="torch is not installed (GPU tests need torch with CUDA)")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

POISON = -7
L, HQ, HKV, D = 3, 8, 2, 128
IF_DUE = int(triattn.RoundTrigger.IF_DUE)  # a plain int: what the op takes (and torch.compile sees)


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    assert triattn.has_cuda, "triattn was built without CUDA: TRIATTN_PYTHON_CUDA=ON pip install ."
    # registers torch.ops.triattn.round (a plain `import triattn.torch_ops` here would make
    # `triattn` local to this function and the assert above read it unbound)
    importlib.import_module("triattn.torch_ops")


def engine_tensors(layout, num_blocks, bs, dtype, gen):
    shape = {"vllm_flash_attn": (2, num_blocks, bs, HKV, D), "vllm_flashinfer": (num_blocks, 2, bs, HKV, D),
             "vllm_flashinfer_hnd": (num_blocks, 2, HKV, bs, D), "sglang": (num_blocks, HKV, D)}[layout]
    n = 2 * L if layout == "sglang" else L
    return [torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype) for _ in range(n)]


def paged(layout, tensors):
    if layout == "sglang":
        return triattn.sglang_cache(tensors[:L], tensors[L:])
    return triattn.vllm_cache(tensors, {"vllm_flash_attn": "flash_attn", "vllm_flashinfer": "flashinfer",
                                        "vllm_flashinfer_hnd": "flashinfer_hnd"}[layout])


def make_batch(layout, dtype, mode, seed):
    """Ragged lengths around the trigger, shuffled block ids; returns host copies too."""
    gen = torch.Generator().manual_seed(seed)
    bs = 1 if layout == "sglang" else 16
    lens = [700, 300, 512 + 64 + 5, 260]  # budget 256 + slack 64: the 300- and 260-token ones differ
    max_blocks = -(-max(lens) // bs) + 1
    num_blocks = sum(-(-x // bs) for x in lens) + 7
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((6, max_blocks), -1, dtype=torch.int32)
    seq_lens = torch.zeros(6, dtype=torch.int32)
    rows = [4, 0, 2, 5]
    k = 0
    for r, n in zip(rows, lens):
        nb = -(-n // bs)
        tables[r, :nb] = perm[k:k + nb]
        k += nb
        seq_lens[r] = n
    host = engine_tensors(layout, num_blocks, bs, dtype, gen)
    sel = triattn.SelectionParams(budget=256, divide_length=64, mode=mode, window=8)
    comp = triattn.Compressor(triattn.random_query_stats(seed, L, HQ, D), triattn.RopeConfig(theta=1e6), sel,
                              num_kv_heads=HKV)
    ids = torch.tensor(rows, dtype=torch.int32)
    t0 = torch.tensor([n + 17 for n in lens], dtype=torch.int64)
    prompts = torch.tensor([5, 0, 40, 3], dtype=torch.int32)
    return comp, host, tables, seq_lens, ids, t0, prompts, max(lens)


def outputs(B, rows, max_len, device):
    return triattn.RoundResult(*(torch.full((B,), POISON, dtype=torch.int32, device=device) for _ in range(4)),
                               torch.full((B, rows, max_len), POISON, dtype=torch.int32, device=device), None)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", [triattn.PruningMode.PER_HEAD, triattn.PruningMode.PER_LAYER_PER_HEAD,
                                  triattn.PruningMode.UNION], ids=lambda m: m.name)
def test_cuda_round_equals_cpu(layout, dtype, mode):
    comp, host, tables, lens, ids, t0, prompts, max_len = make_batch(layout, dtype, mode, seed=3)
    dev = [t.cuda() for t in host]
    # CPU reference: the same round over the host tensors (torch CPU tensors cross by DLPack).
    # bf16 has no numpy dtype, so the reference runs on torch CPU tensors directly.
    ref = comp.round(paged(layout, host), tables, lens, ids, t0, prompts, trigger=triattn.RoundTrigger.IF_DUE,
                     out=outputs(len(ids), comp.kept_rows(), max_len, "cpu"), max_len=max_len)
    out = outputs(len(ids), comp.kept_rows(), max_len, "cuda")
    got = comp.round(paged(layout, dev), tables.cuda(), lens.cuda(), ids.cuda(), t0.cuda(), prompts.cuda(),
                     trigger=triattn.RoundTrigger.IF_DUE, out=out, max_len=max_len)
    torch.cuda.synchronize()
    assert got.compressed is None and ref.compressed == 2
    for name in ("new_lens", "status", "freed_begin", "freed_end"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    for b in range(len(ids)):
        n = int(ref.new_lens[b])
        if ref.status[b] == triattn.RoundStatus.COMPRESSED:
            assert torch.equal(got.kept[b, :, :n].cpu(), ref.kept[b, :, :n])
    for h, d in zip(host, dev):  # the whole cache, bitwise: kept slots and everything not touched
        assert torch.equal(d.cpu().view(torch.int16), h.view(torch.int16))


@pytest.mark.parametrize("layout", ["vllm_flash_attn", "sglang"])
def test_cuda_round_with_protected_prefix_equals_cpu(layout):
    comp, host, tables, lens, ids, t0, prompts, max_len = make_batch(layout, torch.float16,
                                                                     triattn.PruningMode.PER_HEAD, seed=4)
    pp = torch.tensor([32, 0, 64, 300], dtype=torch.int32)  # whole blocks of 16; 300 >= 260: all of it
    dev = [t.cuda() for t in host]
    always = triattn.RoundTrigger.ALWAYS
    ref = comp.round(paged(layout, host), tables, lens, ids, t0, prompts, trigger=always, protected_prefix=pp,
                     out=outputs(len(ids), comp.kept_rows(), max_len, "cpu"), max_len=max_len)
    got = comp.round(paged(layout, dev), tables.cuda(), lens.cuda(), ids.cuda(), t0.cuda(), prompts.cuda(),
                     trigger=always, protected_prefix=pp.cuda(),
                     out=outputs(len(ids), comp.kept_rows(), max_len, "cuda"), max_len=max_len)
    torch.cuda.synchronize()
    assert ref.compressed == 4 and int(ref.new_lens[3]) == 260
    for name in ("new_lens", "status", "freed_begin", "freed_end"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    for b in range(len(ids)):
        n, p = int(ref.new_lens[b]), min(int(pp[b]), int(ref.new_lens[b]))
        assert torch.equal(got.kept[b, :, :n].cpu(), ref.kept[b, :, :n])
        assert torch.equal(ref.kept[b, :, :p], torch.arange(p, dtype=torch.int32).expand(ref.kept.shape[1], p))
    for h, d in zip(host, dev):
        assert torch.equal(d.cpu().view(torch.int16), h.view(torch.int16))


def _op_args(comp, cache, kv, tables, lens, ids, t0, prompts, out, ws, max_len, handle):
    return (handle, kv, tables, lens, ids, t0, prompts, out.new_lens, out.status, out.freed_begin, out.freed_end,
            out.kept, None, ws, max_len, IF_DUE)


def test_custom_op_graph_capture_and_compile():
    comp, host, tables, lens, ids, t0, prompts, max_len = make_batch("vllm_flash_attn", torch.bfloat16,
                                                                     triattn.PruningMode.PER_HEAD, seed=5)
    dev = [t.cuda() for t in host]
    args = [x.cuda() for x in (tables, lens, ids, t0, prompts)]
    cache = paged("vllm_flash_attn", dev)
    handle = triattn.torch_ops.register(comp, cache)
    ws = torch.empty(comp.workspace_size(len(ids), max_len, "cuda:0", tables.shape[0], cache.num_blocks), dtype=torch.uint8,
                     device="cuda")
    rows = comp.kept_rows()
    pristine = [t.clone() for t in dev]

    # eager through the op (also uploads the scorer's constants before capture)
    eager = outputs(len(ids), rows, max_len, "cuda")
    torch.ops.triattn.round(*_op_args(comp, cache, dev, *args, eager, ws, max_len, handle))
    torch.cuda.synchronize()
    eager_cache = [t.clone() for t in dev]

    # captured once, replayed on the restored cache with poisoned outputs
    for t, p in zip(dev, pristine):
        t.copy_(p)
    graphed = outputs(len(ids), rows, max_len, "cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            torch.ops.triattn.round(*_op_args(comp, cache, dev, *args, graphed, ws, max_len, handle))
    torch.cuda.current_stream().wait_stream(s)
    for t, p in zip(dev, pristine):  # capture must not have run anything
        assert torch.equal(t, p)
    for x in graphed[:5]:
        x.fill_(POISON)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager[:5], graphed[:5]):
        assert torch.equal(a, b)
    for a, b in zip(eager_cache, dev):
        assert torch.equal(a, b)

    # torch.compile: the op traces through its fake implementation and runs the same round
    for t, p in zip(dev, pristine):
        t.copy_(p)
    compiled_out = outputs(len(ids), rows, max_len, "cuda")

    @torch.compile(fullgraph=True)
    def step(kv, tables, lens, ids, t0, prompts, new_lens, status, fb, fe, kept, ws):
        torch.ops.triattn.round(handle, kv, tables, lens, ids, t0, prompts, new_lens, status, fb, fe, kept, None, ws,
                                max_len, IF_DUE)
        return new_lens.sum()

    total = step(dev, *args, *compiled_out[:5], ws)
    torch.cuda.synchronize()
    assert int(total) == int(eager.new_lens.sum())
    for a, b in zip(eager[:5], compiled_out[:5]):
        assert torch.equal(a, b)
    for a, b in zip(eager_cache, dev):
        assert torch.equal(a, b)
    triattn.torch_ops.unregister(handle)


def test_device_mismatch_refused():
    comp, host, tables, lens, ids, t0, prompts, max_len = make_batch("sglang", torch.float16,
                                                                     triattn.PruningMode.PER_HEAD, seed=9)
    dev = [t.cuda() for t in host]
    cache = paged("sglang", dev)
    with pytest.raises(triattn.LogicError, match="is on cpu but the cache is on cuda:0"):
        comp.round(cache, tables, lens.cuda(), ids.cuda(), t0.cuda(), prompts.cuda(), max_len=max_len)
    with pytest.raises(triattn.LogicError, match="not C-contiguous"):
        comp.round(cache, tables.cuda().t().contiguous().t(), lens.cuda(), ids.cuda(), t0.cuda(), prompts.cuda(),
                   max_len=max_len)

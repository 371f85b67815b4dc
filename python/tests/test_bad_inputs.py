# SPDX-License-Identifier: Apache-2.0
"""Bad tensors and bad views are refused with the library's message before anything is written."""
import numpy as np
import pytest

import triattn
from engine_cache import bits, build_case

F32 = triattn.DType.FLOAT32


@pytest.fixture
def setup():
    sel = triattn.SelectionParams(budget=16, divide_length=8)
    case = build_case("vllm_flash_attn", (2, 4, 2, 16), 4, F32, [(4, 40), (2, 30)], sel, seed=1)
    comp = triattn.Compressor(triattn.random_query_stats(7, 2, 4, 16), triattn.RopeConfig(theta=1e4), sel,
                              num_kv_heads=2)
    args = dict(
        cache=case.engine.paged_cache(), block_tables=case.tables, seq_lens=case.lens,
        seq_ids=np.array(case.rows, np.int32), t0=np.array([44, 32], np.int64), prompt_lens=np.array([4, 2], np.int32))
    return case, comp, args


def call(comp, args, **kw):
    a = dict(args)
    a.update(kw)
    return comp.round(a.pop("cache"), a.pop("block_tables"), a.pop("seq_lens"), a.pop("seq_ids"), a.pop("t0"),
                      a.pop("prompt_lens"), trigger=triattn.RoundTrigger.ALWAYS, **a)


def untouched(case, before):
    for x, y in zip(before, case.engine.snapshot()):
        np.testing.assert_array_equal(bits(x), bits(y))


def test_good_call_runs(setup):
    case, comp, args = setup
    res = call(comp, args)
    assert res.compressed == 2


@pytest.mark.parametrize("name,bad,needle", [
    ("block_tables", lambda a: a.astype(np.int64), "block_tables has dtype int64"),
    ("block_tables", lambda a: np.asfortranarray(a), "block_tables is not C-contiguous"),
    ("seq_lens", lambda a: a[:-1], "seq_lens has"),
    ("seq_ids", lambda a: a.astype(np.float32), "seq_ids has dtype float32"),
    ("seq_ids", lambda a: np.repeat(a, 2)[::2], "seq_ids is not C-contiguous"),
    ("t0", lambda a: a.astype(np.int32), "t0 has dtype int32"),
    ("t0", lambda a: a[:1], "t0 has 1 entries"),
    ("prompt_lens", lambda a: a.reshape(2, 1), "prompt_lens has 2 dimensions"),
])
def test_bad_round_arrays(setup, name, bad, needle):
    case, comp, args = setup
    before = case.engine.snapshot()
    with pytest.raises(triattn.LogicError, match=needle):
        call(comp, args, **{name: bad(args[name])})
    untouched(case, before)


def test_bad_outputs(setup):
    case, comp, args = setup
    before = case.engine.snapshot()
    i32 = lambda n: np.zeros(n, np.int32)  # noqa: E731
    with pytest.raises(triattn.LogicError, match="new_lens has 3 entries"):
        call(comp, args, out=triattn.RoundResult(i32(3), i32(2), i32(2), i32(2), None, None))
    with pytest.raises(triattn.LogicError, match="status has dtype int64"):
        call(comp, args, out=triattn.RoundResult(i32(2), np.zeros(2, np.int64), i32(2), i32(2), None, None))
    with pytest.raises(triattn.LogicError, match="kept"):  # rows per sequence must match the mode
        call(comp, args, out=triattn.RoundResult(i32(2), i32(2), i32(2), i32(2), np.zeros((2, 5, 44), np.int32),
                                                 None))
    with pytest.raises(triattn.LogicError, match="max_keep|kept"):  # too short for the kept count
        call(comp, args, out=triattn.RoundResult(i32(2), i32(2), i32(2), i32(2), np.zeros((2, 2, 4), np.int32),
                                                 None))
    with pytest.raises(triattn.LogicError, match="workspace"):
        call(comp, args, workspace=np.zeros(16, np.uint8))
    untouched(case, before)


def test_bad_view_contents(setup):
    case, comp, args = setup
    before = case.engine.snapshot()
    tables = case.tables.copy()
    tables[case.rows[0], 3] = case.engine.num_blocks  # block id out of range
    with pytest.raises(triattn.LogicError, match=str(case.engine.num_blocks)):
        call(comp, args, block_tables=tables)
    lens = case.lens.copy()
    lens[case.rows[1]] = case.tables.shape[1] * 4 + 1  # longer than a table row holds
    with pytest.raises(triattn.LogicError):
        call(comp, args, seq_lens=lens, max_len=int(lens.max()))
    with pytest.raises(triattn.LogicError):  # the same row twice
        call(comp, args, seq_ids=np.array([case.rows[0]] * 2, np.int32))
    with pytest.raises(triattn.LogicError):  # a row outside the table
        call(comp, args, seq_ids=np.array([case.rows[0], 99], np.int32), max_len=44)
    untouched(case, before)


def test_bad_cache_tensors():
    kv = [np.zeros((2, 8, 4, 2, 16), np.float32) for _ in range(2)]
    with pytest.raises(triattn.LogicError, match="dtype float64"):
        triattn.vllm_cache([np.zeros((2, 8, 4, 2, 16), np.float64)] * 2)
    with pytest.raises(triattn.LogicError, match="head_dim is not contiguous"):
        triattn.PagedCache([t[0][..., ::2] for t in kv], [t[1][..., ::2] for t in kv])
    with pytest.raises(triattn.LogicError, match="differs from k\\[0\\]"):
        triattn.PagedCache([kv[0][0], kv[1][0][:4]], [kv[0][1], kv[1][1]])
    with pytest.raises(triattn.LogicError, match="one K and one V tensor per layer"):
        triattn.PagedCache([kv[0][0]], [])
    with pytest.raises(triattn.LogicError, match="dimensions"):
        triattn.PagedCache([kv[0]], [kv[1]])
    with pytest.raises(triattn.LogicError, match="unknown layout"):
        triattn.vllm_cache(kv, "paged")
    with pytest.raises(TypeError):
        triattn.PagedCache(["not an array"], ["x"])
    with pytest.raises(triattn.LogicError, match="same memory"):
        triattn.PagedCache([t[0] for t in kv], [t[0] for t in kv])
    cache = triattn.vllm_cache(kv)
    assert (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == (2, 8, 4, 2, 16)
    assert cache.strides == (4 * 2 * 16, 2 * 16, 16)
    hnd = triattn.vllm_cache([np.zeros((8, 2, 2, 4, 16), np.float16)] * 1, "flashinfer_hnd")
    assert hnd.strides == (2 * 2 * 4 * 16, 16, 4 * 16) and hnd.dtype == triattn.DType.FLOAT16


def test_geometry_mismatch():
    sel = triattn.SelectionParams(budget=16, divide_length=8)
    case = build_case("sglang", (2, 4, 2, 16), 1, F32, [(4, 40)], sel, seed=2)
    comp = triattn.Compressor(triattn.random_query_stats(7, 3, 4, 16), triattn.RopeConfig(theta=1e4), sel,
                              num_kv_heads=2)
    with pytest.raises(triattn.LogicError, match="statistics describe"):
        comp.round(case.engine.paged_cache(), case.tables, case.lens, np.array(case.rows, np.int32),
                   np.array([44], np.int64), np.array([4], np.int32))


def test_param_and_stats_errors(tmp_path):
    with pytest.raises(triattn.LogicError, match="budget must be >= 1"):
        triattn.Compressor(triattn.random_query_stats(1, 1, 2, 8), triattn.RopeConfig(),
                           triattn.SelectionParams(budget=0), num_kv_heads=1)
    with pytest.raises(triattn.LogicError, match="divide num_q_heads"):
        triattn.Compressor(triattn.random_query_stats(1, 1, 2, 8), triattn.RopeConfig(),
                           triattn.SelectionParams(), num_kv_heads=3)
    with pytest.raises(triattn.LogicError, match="rope style"):
        triattn.Compressor(triattn.random_query_stats(1, 1, 2, 8), triattn.RopeConfig(style=triattn.RopeStyle.INTERLEAVED),
                           triattn.SelectionParams(), num_kv_heads=1)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(triattn.FormatError):
        triattn.load_pt_stats(str(bad))
    with pytest.raises(triattn.Error):
        triattn.load_stats(str(tmp_path / "missing.safetensors"))

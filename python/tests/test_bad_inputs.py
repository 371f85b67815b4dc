# SPDX-License-Identifier: Apache-2.0
"""Bad tensors and bad views are refused with the library's message before anything is written."""
import numpy as np
import pytest

import triattn
from engine_cache import bits, build_case
from isolated import run_isolated

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


def test_bad_indices_are_named(setup):
    # max_len is left to its default: read from seq_lens at seq_ids, indices checked first.
    case, comp, args = setup
    before = case.engine.snapshot()
    with pytest.raises(triattn.LogicError, match=r"seq_ids\[1\] = 99 is not a row of block_tables / seq_lens \[0, 4\)"):
        call(comp, args, seq_ids=np.array([case.rows[0], 99], np.int32))
    with pytest.raises(triattn.LogicError, match=r"seq_ids\[0\] = -1 is not a row"):
        call(comp, args, seq_ids=np.array([-1, case.rows[0]], np.int32))
    with pytest.raises(triattn.LogicError, match="seq_lens has 1 entries; expected one per block_tables row, max_seqs = 4"):
        call(comp, args, seq_lens=case.lens[:1])
    untouched(case, before)


def test_read_only_and_byte_order_are_named(setup):
    case, comp, args = setup
    before = case.engine.snapshot()
    i32 = lambda n: np.zeros(n, np.int32)  # noqa: E731
    ro = case.engine.tensors()[0].copy()
    ro.flags.writeable = False
    with pytest.raises(triattn.LogicError, match=r"k\[0\] is read-only; triattn writes into it in place"):
        triattn.PagedCache([ro[0]], [case.engine.tensors()[0][1]])
    with pytest.raises(triattn.LogicError, match=r"k\[0\] is big-endian \(>f4\); triattn needs native byte order"):
        triattn.vllm_cache([case.engine.tensors()[0].astype(">f4")])
    with pytest.raises(triattn.LogicError, match=r"t0 is big-endian \(>i8\)"):
        call(comp, args, t0=args["t0"].astype(">i8"))
    with pytest.raises(triattn.LogicError, match=r"seq_ids is big-endian \(>i4\)"):
        call(comp, args, seq_ids=args["seq_ids"].astype(">i4"))
    ro_out = i32(2)
    ro_out.flags.writeable = False
    with pytest.raises(triattn.LogicError, match="new_lens is read-only"):
        call(comp, args, out=triattn.RoundResult(ro_out, i32(2), i32(2), i32(2), None, None))
    untouched(case, before)
    # Inputs are only read: read-only ones are fine.
    inputs = {name: args[name].copy() for name in ("block_tables", "seq_lens", "seq_ids", "t0", "prompt_lens")}
    for a in inputs.values():
        a.flags.writeable = False
    assert call(comp, args, **inputs).compressed == 2


def test_wrong_types_are_argument_type_errors(setup):
    case, comp, args = setup
    before = case.engine.snapshot()
    assert issubclass(triattn.ArgumentTypeError, triattn.LogicError)
    assert issubclass(triattn.ArgumentTypeError, TypeError)
    with pytest.raises(triattn.ArgumentTypeError, match="seq_lens is not an array"):
        call(comp, args, seq_lens=case.lens.tolist())
    with pytest.raises(triattn.ArgumentTypeError, match="prompt_lens is not an array"):
        call(comp, args, prompt_lens=[4, 2])
    with pytest.raises(triattn.ArgumentTypeError, match="cache is not a triattn.PagedCache"):
        call(comp, args, cache=case.engine.tensors())
    with pytest.raises(triattn.ArgumentTypeError, match=r"PagedCache: v\[0\] is not an array.*got str"):
        triattn.PagedCache([case.engine.tensors()[0][0]], ["x"])
    with pytest.raises(triattn.ArgumentTypeError, match="k is not a sequence of arrays"):
        triattn.PagedCache(3, [])
    untouched(case, before)


def test_max_len_beyond_what_a_sequence_holds(setup):
    case, comp, args = setup
    before = case.engine.snapshot()
    cache = args["cache"]
    cap = min(case.tables.shape[1], cache.num_blocks) * cache.block_size
    with pytest.raises(triattn.LogicError, match=f"max_len = {cap + 1} exceeds the most slots a sequence can hold"):
        call(comp, args, max_len=cap + 1)
    untouched(case, before)
    assert call(comp, args, max_len=cap).compressed == 2


def test_sizes_are_capped_before_allocating():
    # Under a 3 GiB address-space limit an allocation from the oversized request fails fast
    # (MemoryError) where the cap is missing, instead of exhausting the machine.
    run_isolated(r"""
    import numpy as np
    import pytest
    import triattn
    from engine_cache import synthetic_batch

    with pytest.raises(triattn.LogicError, match="exceed the supported 16777216 values per array"):
        triattn.random_query_stats(0, 64, 4096, 4096)  # 2**29 values per array, 6 GiB
    with pytest.raises(triattn.LogicError, match="num_layers 5000 is outside"):
        triattn.random_query_stats(0, 5000, 1, 2)
    k, v, comp, a = synthetic_batch()
    a["seq_lens"] = a["seq_lens"].copy()
    a["seq_lens"][1] = 2**31 - 1  # the default max_len: a 32 GiB workspace
    with pytest.raises(triattn.LogicError, match=r"seq_lens\[1\] = 2147483647 \(seq_ids\[1\]\) exceeds"):
        comp.round(triattn.PagedCache(k, v), **a)
    """, address_space=3 << 30)


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
    with pytest.raises(triattn.LogicError, match="does not match the compressor.s statistics"):
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

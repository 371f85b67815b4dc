# SPDX-License-Identifier: Apache-2.0
"""The round over numpy arrays in vLLM and SGLang layouts equals the library's C++ CPU path
(KvCache.compress) bitwise: kept K/V, kept positions, lengths, freed block columns."""
import numpy as np
import pytest

import triattn
from engine_cache import LAYOUTS, bits, build_case, engine_gather

F32, F16 = triattn.DType.FLOAT32, triattn.DType.FLOAT16
MODES = (triattn.PruningMode.PER_HEAD, triattn.PruningMode.PER_LAYER_PER_HEAD, triattn.PruningMode.UNION)
POISON = -7


def page_size(layout, bs):
    return 1 if layout == "sglang" else bs


def run_round(case, selection, trigger, stats=None, slot_positions=None, rows=None):
    L, Hq, Hkv, D = case.geom
    comp = triattn.Compressor(stats or triattn.random_query_stats(7, L, Hq, D), triattn.RopeConfig(theta=10000.0),
                              selection, num_kv_heads=Hkv)
    rows = case.rows if rows is None else rows
    B = len(rows)
    seq_ids = np.array(rows, dtype=np.int32)
    t0 = np.array([case.oracle.logical_position(case.oracle_ids[case.rows.index(r)]) for r in rows], dtype=np.int64)
    prompts = np.array([case.oracle.prompt_length(case.oracle_ids[case.rows.index(r)]) for r in rows], dtype=np.int32)
    max_len = int(case.lens[seq_ids].max())
    out = triattn.RoundResult(*(np.full(B, POISON, np.int32) for _ in range(4)),
                              np.full((B, comp.kept_rows(), max_len), POISON, np.int32), None)
    res = comp.round(case.engine.paged_cache(), case.tables, case.lens, seq_ids, t0, prompts, trigger=trigger,
                     out=out, slot_positions=slot_positions)
    return comp, res


def row_sources(rows, L, Hkv):
    """(layer, head) pairs each kept row stands for."""
    if rows == 1:
        return [[(l, h) for l in range(L) for h in range(Hkv)]]
    if rows == Hkv:
        return [[(l, h) for l in range(L)] for h in range(Hkv)]
    return [[(r // Hkv, r % Hkv)] for r in range(rows)]


def check_against_oracle(case, res, trigger, before):
    """Every sequence of the batch: outputs, kept K/V and positions equal the oracle's round."""
    L, _, Hkv, D = case.geom
    bs = case.bs
    for b, (row, sid) in enumerate(zip(case.rows, case.oracle_ids)):
        old = int(case.lens[row])
        due = trigger == triattn.RoundTrigger.ALWAYS or case.oracle.needs_compression(sid)
        if due:
            rep = case.oracle.compress(sid)
            assert rep.length_before == old and rep.status == triattn.RoundStatus.COMPRESSED
            assert res.status[b] == int(triattn.RoundStatus.COMPRESSED)
            np.testing.assert_array_equal(res.kept[b, :, :rep.length_after], rep.kept_positions)
        else:
            assert res.status[b] == int(triattn.RoundStatus.NOT_DUE)
        new = case.oracle.physical_length(sid)
        assert res.new_lens[b] == new
        assert res.freed_begin[b] == -(-new // bs)
        assert res.freed_end[b] == -(-old // bs)
        k_eng, v_eng = engine_gather(case, row, new)
        k_ref, v_ref = case.oracle.gather(sid)
        np.testing.assert_array_equal(bits(k_eng), bits(k_ref))
        np.testing.assert_array_equal(bits(v_eng), bits(v_ref))
        if not due:
            continue
        # kept[b, r, i] is the original position of what slot i now holds, for every (layer,
        # head) that row r stands for: checked against the sequence's original tokens.
        K, V = case.tokens[b]
        kept = res.kept[b]
        for r, sources in enumerate(row_sources(kept.shape[0], L, Hkv)):
            pos = kept[r, :new]
            assert np.all(np.diff(pos) > 0) and pos[0] >= 0 and pos[-1] < old
            for (l, h) in sources:
                np.testing.assert_array_equal(bits(k_eng[l, :, h]), bits(K[l, pos, h]))
                np.testing.assert_array_equal(bits(v_eng[l, :, h]), bits(V[l, pos, h]))
    # Nothing outside the batch's kept slots was written: blocks of no batch sequence keep their
    # bytes, and so does every slot at or past a sequence's new length.
    owned = set()
    for b, row in enumerate(case.rows):
        owned.update(int(x) for x in case.tables[row, : res.freed_begin[b]])
    after = case.engine.snapshot()
    for t_before, t_after in zip(before, after):
        for blk in range(case.engine.num_blocks):
            if blk in owned:
                continue
            idx = _block_slice(case.engine.layout, blk)
            np.testing.assert_array_equal(bits(t_before[idx]), bits(t_after[idx]))


def _block_slice(layout, blk):
    if layout == "vllm_flash_attn":
        return (slice(None), blk)
    return (blk,)


CASES = [
    # (geometry L, Hq, Hkv, D), bs, dtype, [(prompt, decode)], selection kwargs
    ((2, 4, 2, 16), 16, F32, [(20, 70), (8, 40), (30, 95)], dict(budget=48, divide_length=16)),
    ((3, 8, 2, 32), 4, F16, [(5, 60), (12, 29), (0, 77), (9, 9)], dict(budget=24, divide_length=8, n_sink=2, window=4)),
    ((2, 6, 3, 8), 64, F32, [(40, 100), (3, 150)], dict(budget=64, divide_length=32)),
    ((1, 2, 1, 16), 16, F16, [(4, 33)], dict(budget=16, divide_length=8, prompt=triattn.PromptMode.PINNED_ON_TOP)),
    ((2, 4, 2, 16), 16, F32, [(25, 60), (10, 50)], dict(budget=30, divide_length=10, prompt=triattn.PromptMode.COMPETE,
                                                     window=6)),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_round_equals_kvcache(layout, mode, ci):
    geom, bs, dtype, seqs, kw = CASES[ci]
    sel = triattn.SelectionParams(mode=mode, **kw)
    case = build_case(layout, geom, page_size(layout, bs), dtype, seqs, sel, seed=ci)
    before = case.engine.snapshot()
    _, res = run_round(case, sel, triattn.RoundTrigger.ALWAYS)
    assert res.compressed == len(seqs)
    check_against_oracle(case, res, triattn.RoundTrigger.ALWAYS, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_if_due_leaves_short_sequences_untouched(layout):
    # budget 32 + slack 16: sequences of 60 and 48 tokens are due, 47 and 20 are not.
    sel = triattn.SelectionParams(budget=32, divide_length=16, mode=triattn.PruningMode.PER_LAYER_PER_HEAD)
    seqs = [(10, 50), (6, 14), (0, 48), (7, 40)]
    case = build_case(layout, (2, 4, 2, 16), page_size(layout, 8), F32, seqs, sel, seed=11)
    before = case.engine.snapshot()
    _, res = run_round(case, sel, triattn.RoundTrigger.IF_DUE)
    assert list(res.status) == [int(triattn.RoundStatus.COMPRESSED), int(triattn.RoundStatus.NOT_DUE),
                                int(triattn.RoundStatus.COMPRESSED), int(triattn.RoundStatus.NOT_DUE)]
    assert res.compressed == 2
    check_against_oracle(case, res, triattn.RoundTrigger.IF_DUE, before)


@pytest.mark.parametrize("layout", ["vllm_flash_attn", "sglang"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_second_round_reports_original_positions(layout, mode):
    """Round, apply new lengths, decode more tokens, round again with slot_positions: kept then
    names positions of the original token stream."""
    L, Hq, Hkv, D = geom = (2, 4, 2, 16)
    sel = triattn.SelectionParams(budget=24, divide_length=8, mode=mode)
    bs = page_size(layout, 4)
    case = build_case(layout, geom, bs, F32, [(6, 40), (4, 30)], sel, seed=5)
    _, res1 = run_round(case, sel, triattn.RoundTrigger.ALWAYS)
    rng = np.random.default_rng(99)
    streams = []
    for b, (row, sid) in enumerate(zip(case.rows, case.oracle_ids)):
        case.oracle.compress(sid)
        new = int(res1.new_lens[b])
        case.lens[row] = new
        # decode 12 more tokens into both caches
        n = 12
        K, V = case.tokens[b]
        K2 = (rng.standard_normal((L, n, Hkv, D)) * 2).astype(np.float32)
        V2 = rng.standard_normal((L, n, Hkv, D)).astype(np.float32)
        assert case.oracle.append(sid, K2, V2, triattn.Phase.DECODE)
        need = -(-(new + n) // bs)
        case.tables[row, res1.freed_begin[b]:] = -1  # the engine takes the freed columns back
        free = sorted(set(range(case.engine.num_blocks)) - set(int(x) for x in case.tables.ravel() if x >= 0))
        for j in range(res1.freed_begin[b], need):
            case.tables[row, j] = free.pop(0)
        for l in range(L):
            for i in range(n):
                slot = new + i
                case.engine.write(l, int(case.tables[row, slot // bs]), slot % bs, K2[l, i], V2[l, i])
        case.lens[row] = new + n
        streams.append((np.concatenate([K, K2], axis=1), np.concatenate([V, V2], axis=1), new, n))
    rows = res1.kept.shape[1]
    max_len = int(case.lens[case.rows].max())
    slot_pos = np.full((len(case.rows), rows, max_len), POISON, np.int32)
    for b, (K, V, new, n) in enumerate(streams):
        old_total = K.shape[1] - n
        slot_pos[b, :, :new] = res1.kept[b, :, :new]
        slot_pos[b, :, new:new + n] = np.arange(old_total, old_total + n, dtype=np.int32)
    _, res2 = run_round(case, sel, triattn.RoundTrigger.ALWAYS, slot_positions=slot_pos)
    for b, (row, sid) in enumerate(zip(case.rows, case.oracle_ids)):
        rep = case.oracle.compress(sid)
        new2 = case.oracle.physical_length(sid)
        assert res2.new_lens[b] == new2
        np.testing.assert_array_equal(res2.kept[b, :, :new2], rep.kept_positions)
        k_eng, v_eng = engine_gather(case, row, new2)
        k_ref, v_ref = case.oracle.gather(sid)
        np.testing.assert_array_equal(bits(k_eng), bits(k_ref))
        np.testing.assert_array_equal(bits(v_eng), bits(v_ref))
        K, V, _, _ = streams[b]
        for r, sources in enumerate(row_sources(rows, L, Hkv)):
            pos = res2.kept[b, r, :new2]
            for (l, h) in sources:
                np.testing.assert_array_equal(bits(k_eng[l, :, h]), bits(K[l, pos, h]))


def test_empty_batch_and_outputs_allocated():
    sel = triattn.SelectionParams(budget=16, divide_length=8)
    case = build_case("vllm_flash_attn", (1, 2, 1, 8), 4, F32, [(2, 30)], sel, seed=3)
    L, Hq, Hkv, D = case.geom
    comp = triattn.Compressor(triattn.random_query_stats(7, L, Hq, D), triattn.RopeConfig(theta=1e4), sel,
                              num_kv_heads=Hkv)
    none = np.zeros(0, np.int32)
    res = comp.round(case.engine.paged_cache(), case.tables, case.lens, none, np.zeros(0, np.int64), none)
    assert res.compressed == 0 and res.new_lens.shape == (0,)
    res = comp.round(case.engine.paged_cache(), case.tables, case.lens, np.array(case.rows, np.int32),
                     np.array([32], np.int64), np.array([2], np.int32), kept=None)
    assert res.kept is None and res.compressed == 1 and res.status[0] == int(triattn.RoundStatus.COMPRESSED)
    assert comp.workspace_size(1, 32) >= 1
    assert triattn.freed_blocks(case.tables, np.array(case.rows, np.int32), res)[0].tolist() == \
        case.tables[case.rows[0], res.freed_begin[0]:res.freed_end[0]].tolist()


def _protected_setup(seed=4):
    """vLLM layout, block size 4, two sequences (prompt 4 + 60, prompt 2 + 50 tokens): the case,
    its selection, a snapshot of the engine, and an ALWAYS round over them taking
    protected_prefix (None: the argument left out)."""
    sel = triattn.SelectionParams(budget=16, divide_length=8)
    case = build_case("vllm_flash_attn", (2, 4, 2, 16), 4, F32, [(4, 60), (2, 50)], sel, seed=seed)
    comp = triattn.Compressor(triattn.random_query_stats(7, 2, 4, 16), triattn.RopeConfig(theta=10000.0), sel,
                              num_kv_heads=2)

    def run(pp):
        extra = {} if pp is None else {"protected_prefix": pp}
        return comp.round(case.engine.paged_cache(), case.tables, case.lens, np.array(case.rows, np.int32),
                          np.array([70, 60], np.int64), np.array([4, 2], np.int32),
                          trigger=triattn.RoundTrigger.ALWAYS, **extra)
    return case, sel, case.engine.snapshot(), run


def _protected_round(pp):
    case, sel, before, run = _protected_setup()
    return case, sel, before, run(None if pp is None else np.array(pp, np.int32))


def _block_bytes(case, tensors, row, blocks):
    """Raw bits of the first `blocks` blocks of engine row `row`, every layer, K and V."""
    ids = case.tables[row, :blocks]
    return [bits(t[:, ids]).copy() for t in tensors]  # vLLM flash_attn: [2, num_blocks, ...]


def test_protected_prefix_keeps_its_slots_in_place():
    pp = [12, 8]  # 3 and 2 whole blocks, past the prompts (4, 2) and the default n_sink
    case, sel, before, res = _protected_round(pp)
    _, _, _, plain = _protected_round(None)
    assert res.compressed == 2
    for b, row in enumerate(case.rows):
        length = int(case.lens[row])
        assert res.new_lens[b] == triattn.keep_counts(length, case.prompts[b], sel, pp[b]).keep
        n = pp[b]
        for r in range(res.kept.shape[1]):
            np.testing.assert_array_equal(res.kept[b, r, :n], np.arange(n))
        # the protected blocks' bytes are untouched, in every layer, K and V
        blocks = n // case.bs
        for x, y in zip(_block_bytes(case, before, row, blocks), _block_bytes(case, case.engine.snapshot(), row, blocks)):
            np.testing.assert_array_equal(x, y)
    # Without protection the same round moves or evicts slots of those prefixes.
    assert any((plain.kept[b, r, :pp[b]] != np.arange(pp[b])).any()
               for b in range(2) for r in range(plain.kept.shape[1]))


def test_protected_prefix_past_the_length_protects_everything():
    case, _, before, res = _protected_round([1000, 0])
    row = case.rows[0]
    length = int(case.lens[row])
    assert res.status[0] == int(triattn.RoundStatus.COMPRESSED) and res.new_lens[0] == length
    for x, y in zip(_block_bytes(case, before, row, -(-length // case.bs)),
                    _block_bytes(case, case.engine.snapshot(), row, -(-length // case.bs))):
        np.testing.assert_array_equal(x, y)
    assert res.new_lens[1] < case.lens[case.rows[1]]  # 0 protects nothing: compressed as usual


@pytest.mark.parametrize("pp,needle", [
    ([8], "protected_prefix has 1 entries in its first dimension; expected batch = 2"),
    ([8, -1], r"batch entry 1 \(sequence \d+\): protected_prefix = -1 must be >= 0"),
    (np.array([8, 8], np.int64), "protected_prefix has dtype int64; expected int32"),
    ([[8, 8]], "protected_prefix has 2 dimensions"),
    ("8", "protected_prefix is not an array"),
])
def test_protected_prefix_is_checked(pp, needle):
    case, _, before, run = _protected_setup()
    with pytest.raises(triattn.LogicError, match=needle):
        run(pp if isinstance(pp, (np.ndarray, str)) else np.array(pp, np.int32))
    for x, y in zip(before, case.engine.snapshot()):
        np.testing.assert_array_equal(bits(x), bits(y))


def test_report_positions_need_track_positions():
    """Positions are tracked only on request: without them a compressed report refuses to give
    kept_positions (a LogicError naming the option), never an empty or stale array."""
    L, Hq, Hkv, D, bs = 2, 4, 2, 64, 16
    sel = triattn.SelectionParams(budget=32, divide_length=16)
    geom = triattn.ModelGeometry(num_layers=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    rng = np.random.default_rng(3)
    kv = [rng.standard_normal((L, 64, Hkv, D)).astype(np.float32) for _ in range(2)]
    reports = {}
    for track in (False, True):
        cfg = triattn.CacheConfig(geom, block_size=bs, num_blocks=16, max_seqs=1, dtype=F32, track_positions=track)
        assert cfg.track_positions == track
        cache = triattn.KvCache(cfg, triattn.random_query_stats(7, L, Hq, D), triattn.RopeConfig(theta=10000.0), sel)
        sid = cache.add_sequence()
        assert cache.append(sid, kv[0], kv[1], triattn.Phase.DECODE)
        reports[track] = cache.compress(sid)
        assert reports[track].status == triattn.RoundStatus.COMPRESSED
    assert reports[False].length_after == reports[True].length_after == 32
    assert reports[True].kept_positions.shape == (Hkv, 32)
    with pytest.raises(triattn.LogicError, match="track_positions"):
        _ = reports[False].kept_positions

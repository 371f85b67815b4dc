# SPDX-License-Identifier: Apache-2.0
"""fp8 e4m3 KV in the library's own CPU cache: codes as a uint8 view, the quantising append with
per-layer scales (checked against an e4m3 rounding written here from the format's definition),
and a round that keeps the same tokens as a float32 cache holding the dequantised values."""
import numpy as np
import pytest

import triattn

FP8 = triattn.DType.FP8_E4M3
L, HQ, HKV, D = 2, 4, 2, 16


def e4m3_values():
    """Values of codes 0..126 (non-negative, finite), ascending: subnormals m * 2^-9, then
    (8 + m) * 2^(e - 10)."""
    v = [m * 2.0**-9 for m in range(8)]
    v += [(8 + m) * 2.0 ** (e - 10) for e in range(1, 16) for m in range(8)]
    return np.array(v[:127])


def e4m3_encode(x):
    """Round to nearest even over the code table, saturating at 448, NaN -> 0x7f."""
    table = e4m3_values()
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, 126)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), code)


def e4m3_decode(c):
    c = np.asarray(c, dtype=np.uint8)
    mag = e4m3_values()[np.minimum(c & 0x7F, 126)]
    return np.where(c & 0x80, -mag, mag)


def config(dtype, scales=()):
    return triattn.CacheConfig(triattn.ModelGeometry(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D),
                               block_size=4, num_blocks=40, max_seqs=2, dtype=dtype, track_positions=True,
                               kv_scales=list(scales))


def make_cache(cfg, budget=12):
    return triattn.KvCache(cfg, triattn.random_query_stats(3, L, HQ, D), triattn.RopeConfig(theta=10000.0),
                           triattn.SelectionParams(budget=budget, divide_length=4))


SCALES = [0.02, 0.03, 0.05, 0.07]  # [layer, K|V]: vLLM's k_scale / v_scale per layer


def test_append_values_quantises_with_the_layer_scales_and_gather_returns_uint8_codes():
    cache = make_cache(config(FP8, SCALES))
    s = cache.add_sequence()
    rng = np.random.default_rng(1)
    n = 9
    k = (rng.standard_normal((L, n, HKV, D)) * 2).astype(np.float32)
    v = rng.standard_normal((L, n, HKV, D)).astype(np.float32)
    k[0, 0, 0, 0] = 1e4  # saturates
    assert cache.append_values(s, k, v)
    gk, gv = cache.gather(s)
    assert gk.dtype == np.uint8 and gk.shape == (L, n, HKV, D)
    sc = np.array(SCALES, dtype=np.float32).reshape(L, 2)
    for l in range(L):
        np.testing.assert_array_equal(gk[l], e4m3_encode(k[l] / sc[l, 0]))
        np.testing.assert_array_equal(gv[l], e4m3_encode(v[l] / sc[l, 1]))
    assert gk[0, 0, 0, 0] == 0x7E
    # codes appended as a uint8 view are stored as they are
    s2 = cache.add_sequence()
    assert cache.append(s2, gk, gv)
    g2k, g2v = cache.gather(s2)
    np.testing.assert_array_equal(g2k, gk)
    np.testing.assert_array_equal(g2v, gv)


def test_the_fp8_round_keeps_what_a_float_cache_of_the_dequantised_values_keeps():
    rng = np.random.default_rng(2)
    n = 30
    k = (rng.standard_normal((L, n, HKV, D)) * 2).astype(np.float32)
    v = rng.standard_normal((L, n, HKV, D)).astype(np.float32)
    c8 = make_cache(config(FP8, SCALES))
    s8 = c8.add_sequence()
    assert c8.append_values(s8, k, v)
    gk, gv = c8.gather(s8)
    sc = np.array(SCALES, dtype=np.float32).reshape(L, 2)
    kd = np.stack([e4m3_decode(gk[l]).astype(np.float32) * sc[l, 0] for l in range(L)])
    vd = np.stack([e4m3_decode(gv[l]).astype(np.float32) * sc[l, 1] for l in range(L)])
    c32 = make_cache(config(triattn.DType.FLOAT32))
    s32 = c32.add_sequence()
    assert c32.append(s32, np.ascontiguousarray(kd), np.ascontiguousarray(vd))
    r8, r32 = c8.compress(s8), c32.compress(s32)
    assert r8.length_after == r32.length_after < n
    np.testing.assert_array_equal(r8.kept_positions, r32.kept_positions)


def test_fp8_arrays_and_scales_are_checked():
    with pytest.raises(triattn.LogicError, match="scales are for fp8_e4m3 only"):
        config(triattn.DType.BFLOAT16, SCALES).validate()
    with pytest.raises(triattn.LogicError, match="kv_scales holds 3 values"):
        config(FP8, [1.0, 1.0, 1.0]).validate()
    cache = make_cache(config(FP8, SCALES))
    s = cache.add_sequence()
    with pytest.raises(triattn.LogicError, match="float16 but the cache stores fp8_e4m3"):
        cache.append(s, np.zeros((L, 1, HKV, D), np.float16), np.zeros((L, 1, HKV, D), np.float16))
    with pytest.raises(triattn.LogicError, match="expected float32"):
        cache.append_values(s, np.zeros((L, 1, HKV, D), np.uint8), np.zeros((L, 1, HKV, D), np.uint8))

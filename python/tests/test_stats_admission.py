# SPDX-License-Identifier: Apache-2.0
"""Statistics (loaders, writers, arrays) and admission through the binding."""
import os
from pathlib import Path

import numpy as np
import pytest

import triattn

_ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TRIATTN_SHARED_DATA_DIR", _ROOT / ".." / "shared" / "data"))
if not SHARED.exists() and (_ROOT / "shared" / "data").exists():
    SHARED = _ROOT / "shared" / "data"
QWEN = SHARED / "calibration" / "qwen3_8b.pt"


def test_native_and_pt_round_trip(tmp_path):
    s = triattn.random_query_stats(3, 4, 8, 32)
    triattn.save_stats(str(tmp_path / "s.safetensors"), s)
    triattn.save_pt_stats(str(tmp_path / "s.pt"), s)
    for loaded in (triattn.load_stats(str(tmp_path / "s.safetensors")), triattn.load_pt_stats(str(tmp_path / "s.pt"))):
        assert (loaded.num_layers, loaded.num_q_heads, loaded.head_dim) == (4, 8, 32)
        for name in ("q_mean_real", "q_mean_imag", "q_abs_mean"):
            np.testing.assert_array_equal(getattr(loaded, name), getattr(s, name))
    with pytest.raises(triattn.FormatError, match="num_layers mismatch"):
        triattn.load_stats(str(tmp_path / "s.safetensors"), num_layers=5)
    with pytest.raises(triattn.FormatError, match="rope_style mismatch"):
        triattn.load_pt_stats(str(tmp_path / "s.pt"), rope_style=triattn.RopeStyle.INTERLEAVED)


def test_stats_from_arrays():
    s = triattn.random_query_stats(4, 2, 4, 16)
    t = triattn.QueryStats(s.q_mean_real, s.q_mean_imag, s.q_abs_mean, model_name="m")
    assert t.model_name == "m" and t.num_q_heads == 4 and t.head_dim == 16
    np.testing.assert_array_equal(t.q_abs_mean, s.q_abs_mean)
    with pytest.raises(triattn.LogicError, match="exceeds q_abs_mean"):
        triattn.QueryStats(s.q_mean_real * 100, s.q_mean_imag, s.q_abs_mean)
    with pytest.raises(triattn.LogicError, match="shape"):
        triattn.QueryStats(s.q_mean_real, s.q_mean_imag[:1], s.q_abs_mean)
    with pytest.raises(triattn.LogicError, match="dtype float64"):
        triattn.QueryStats(s.q_mean_real.astype(np.float64), s.q_mean_imag, s.q_abs_mean)


@pytest.mark.skipif(not QWEN.exists(), reason=f"{QWEN} not present (shared data)")
def test_published_qwen3_stats():
    s = triattn.load_pt_stats(str(QWEN), num_layers=36, num_q_heads=32, head_dim=128)
    assert s.model_name == "Qwen/Qwen3-8B" and s.q_mean_real.shape == (36, 32, 64)
    assert np.all(np.hypot(s.q_mean_real, s.q_mean_imag) <= s.q_abs_mean * (1 + 1e-5))


@pytest.mark.parametrize("prompt_mode", list(triattn.PromptMode.__members__.values()))
@pytest.mark.parametrize("prompt,new", [(10, 200), (70, 100), (3, 5), (40, 0)])
def test_max_resident_tokens_is_the_real_peak(prompt_mode, prompt, new):
    """A request decoded token by token with a round after each step never holds more than
    max_resident_tokens, and reaches it exactly."""
    sel = triattn.SelectionParams(budget=32, divide_length=16, prompt=prompt_mode, window=4)
    geom = triattn.ModelGeometry(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
    cfg = triattn.CacheConfig(geom, block_size=4, num_blocks=128, max_seqs=1, dtype=triattn.DType.FLOAT32)
    cache = triattn.KvCache(cfg, triattn.random_query_stats(1, 1, 2, 8), triattn.RopeConfig(), sel)
    rng = np.random.default_rng(0)
    sid = cache.add_sequence()
    tok = lambda n: rng.standard_normal((1, n, 1, 8)).astype(np.float32)  # noqa: E731
    assert cache.append(sid, tok(prompt), tok(prompt), triattn.Phase.PREFILL)
    peak = cache.physical_length(sid)
    for _ in range(new):
        t = tok(1)
        assert cache.append(sid, t, t)
        peak = max(peak, cache.physical_length(sid))
        if cache.needs_compression(sid):
            cache.compress(sid)
    assert peak == triattn.max_resident_tokens(prompt, new, sel)
    fp = triattn.request_footprint(cfg, triattn.AdmissionRequest(prompt, new), sel)
    assert fp.max_tokens == peak and fp.max_blocks == -(-peak // 4)
    assert fp.kv_bytes == fp.max_blocks * cfg.block_bytes_all_ranges()
    assert fp.uncompressed_tokens == prompt + new


def test_admissible_prefix():
    sel = triattn.SelectionParams(budget=64, divide_length=16)
    geom = triattn.ModelGeometry(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
    cfg = triattn.CacheConfig(geom, block_size=16, num_blocks=1000)
    reqs = [triattn.AdmissionRequest(100, 4000), triattn.AdmissionRequest(10, 10), triattn.AdmissionRequest(500, 50)]
    blocks = [triattn.request_footprint(cfg, r, sel).max_blocks for r in reqs]
    assert blocks[0] == -(-max(101, 64 + 16, 65) // 16) == 7  # 4,100 tokens uncompressed, 101 resident
    assert triattn.admissible_prefix(cfg, reqs, sel, sum(blocks)) == 3
    assert triattn.admissible_prefix(cfg, reqs, sel, sum(blocks) - 1) == 2
    assert triattn.admissible_prefix(cfg, reqs, sel, sum(blocks), reserved_blocks=blocks[2]) == 2
    with pytest.raises(triattn.LogicError):
        triattn.admissible_prefix(cfg, reqs, sel, -1)

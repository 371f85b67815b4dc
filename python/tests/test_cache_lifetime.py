# SPDX-License-Identifier: Apache-2.0
"""A PagedCache owns the arrays it views, not the caller's lists: clearing or refilling the lists
after construction changes nothing. Runs in its own interpreter (isolated.run_isolated) so that a
read of freed memory fails the test instead of killing pytest."""
import pytest

from isolated import run_isolated


# "large": arrays past glibc's largest mmap threshold (32 MiB), unmapped when freed, so a read
# faults; "small": heap arrays whose memory the refilled list's new arrays take over.
@pytest.mark.parametrize("num_blocks", [5000, 64], ids=["large", "small"])
def test_round_after_the_lists_are_cleared(num_blocks):
    out = run_isolated(f"""
    import gc
    import numpy as np
    import triattn
    from engine_cache import synthetic_batch

    k, v, comp, a = synthetic_batch(L=2, num_blocks={num_blocks}, batch=2, budget=32)
    k_copy, v_copy = [x.copy() for x in k], [x.copy() for x in v]
    cache = triattn.PagedCache(k, v)
    k.clear()                                      # the only other references to the K arrays
    v[:] = [np.zeros_like(x) for x in v_copy]      # the V arrays replaced by others
    gc.collect()
    got = comp.round(cache, trigger=triattn.RoundTrigger.ALWAYS, **a)
    fresh = triattn.PagedCache(k_copy, v_copy)
    want = comp.round(fresh, trigger=triattn.RoundTrigger.ALWAYS, **a)
    assert got.compressed == want.compressed == 2
    for x, y in zip(got[:4], want[:4]):
        np.testing.assert_array_equal(x, y)
    for b, n in enumerate(want.new_lens):  # kept: entries past new_len are not written
        np.testing.assert_array_equal(got.kept[b, :, :n], want.kept[b, :, :n])
    for x, y in zip(cache.k + cache.v, fresh.k + fresh.v):  # the compacted K and V themselves
        np.testing.assert_array_equal(x, y)
    print("same")
    """)
    assert out.strip() == "same"

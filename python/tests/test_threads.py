# SPDX-License-Identifier: Apache-2.0
"""One Compressor used from several threads: concurrent rounds, a round next to the property
setters, a round while another thread drops the objects. Each scenario runs in its own
interpreter with a timeout (isolated.run_isolated): a deadlock there never lets Python run
again, so it must fail the test rather than hang pytest."""
from isolated import run_isolated

COMMON = """
import gc, threading
import numpy as np
import triattn
from engine_cache import synthetic_batch

ALWAYS = triattn.RoundTrigger.ALWAYS
errors = []

def guarded(f):
    def run(*a):
        try:
            f(*a)
        except BaseException as e:
            errors.append(repr(e))
    return run

def join_all(threads):
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
"""


def test_two_rounds_at_once_serialise_and_match_a_serial_run():
    out = run_isolated(common=COMMON, code="""
    ROUNDS = 40
    k1, v1, comp, a1 = synthetic_batch(seed=0)
    k2, v2, _, a2 = synthetic_batch(seed=3)
    # The same rounds one after another on copies: the reference.
    ref = [([x.copy() for x in k], [x.copy() for x in v]) for k, v in ((k1, v1), (k2, v2))]
    for (rk, rv), a in zip(ref, (a1, a2)):
        cache = triattn.PagedCache(rk, rv)
        for _ in range(ROUNDS):
            comp.round(cache, trigger=ALWAYS, **a)

    @guarded
    def work(cache, a):
        for _ in range(ROUNDS):
            res = comp.round(cache, trigger=ALWAYS, **a)
            assert res.compressed == len(a["seq_ids"])

    join_all([threading.Thread(target=work, args=(triattn.PagedCache(k, v), a))
              for k, v, a in ((k1, v1, a1), (k2, v2, a2))])
    for (rk, rv), k, v in zip(ref, (k1, k2), (v1, v2)):
        for x, y in zip(rk + rv, k + v):
            np.testing.assert_array_equal(x, y)
    print("done")
    """)
    assert out.split() == ["done"]


def test_round_next_to_property_setters():
    out = run_isolated(common=COMMON, code="""
    k, v, comp, a = synthetic_batch(seed=1)
    cache = triattn.PagedCache(k, v)
    done = threading.Event()

    @guarded
    def rounds():
        try:
            for _ in range(60):
                res = comp.round(cache, trigger=ALWAYS, **a)
                assert res.status.tolist() == [int(triattn.RoundStatus.COMPRESSED)] * len(a["seq_ids"])
        finally:
            done.set()

    @guarded
    def setters():
        i = 0
        while not done.is_set():
            comp.selection = triattn.SelectionParams(budget=32 + 32 * (i % 2), divide_length=16)
            assert comp.selection.budget in (32, 64)
            assert comp.kept_rows() == 2
            assert comp.workspace_size(4, 1024) > 0
            i += 1

    join_all([threading.Thread(target=rounds), threading.Thread(target=setters)])
    print("done")
    """)
    assert out.split() == ["done"]


def test_round_while_another_thread_drops_the_objects():
    # Arrays past glibc's largest mmap threshold (32 MiB): freeing one unmaps it, so a round over
    # a freed array faults instead of reading stale memory.
    out = run_isolated(common=COMMON, code="""
    k, v, comp, a = synthetic_batch(num_blocks=5000, batch=4, budget=256)
    assert k[0].nbytes > 32 << 20
    other_k, other_v, other_comp, other_a = synthetic_batch(seed=5)
    cache = triattn.PagedCache(k, v)
    first, dropped = threading.Event(), threading.Event()

    @guarded
    def worker(comp, cache):
        comp.round(cache, trigger=ALWAYS, **a)
        first.set()
        dropped.wait(60)
        for _ in range(3):  # the last references to comp and cache are this thread's
            assert comp.round(cache, trigger=ALWAYS, **a).compressed == 4

    t = threading.Thread(target=worker, args=(comp, cache))
    t.start()
    first.wait(60)
    del cache, comp
    k.clear()
    v.clear()
    gc.collect()
    dropped.set()
    other = triattn.PagedCache(other_k, other_v)
    while t.is_alive():  # rounds here too while the worker's objects die with it
        other_comp.round(other, trigger=ALWAYS, **other_a)
    t.join()
    assert not errors, errors
    print("done")
    """, timeout=300)
    assert out.split() == ["done"]

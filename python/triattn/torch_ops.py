# SPDX-License-Identifier: Apache-2.0
"""The round as a torch custom op, ``torch.ops.triattn.round``, usable inside ``torch.compile``
and CUDA-graph capture.

A custom op only takes tensors and plain values, so the Compressor and the PagedCache it runs
over are registered once (``register``) and named by an integer handle. The cache's K/V tensors
are passed too (``kv``, mutated in place) so that the compiler orders the op correctly with
every other read and write of the cache. Everything the op writes is an argument (mutated in
place); it returns nothing, and its fake implementation does nothing: shapes never change.

CUDA-graph capture: run one round eagerly first (it uploads the scorer's constants to the device
once), then capture; the op allocates nothing and never waits on the host, so a replay runs the
same round on whatever the captured buffers hold then.

Requires torch >= 2.4 (torch.library.custom_op). Imported by ``import triattn`` when torch is
already imported, or explicitly: ``import triattn.torch_ops``.
"""
import itertools
import threading
from typing import List, Optional

import torch

from . import _triattn

_lock = threading.Lock()
_handles = itertools.count(1)
_registry = {}


def register(compressor: "_triattn.Compressor", cache: "_triattn.PagedCache") -> int:
    """A handle for (compressor, cache) to pass to torch.ops.triattn.round; keeps both alive
    until ``unregister``."""
    if not isinstance(compressor, _triattn.Compressor) or not isinstance(cache, _triattn.PagedCache):
        raise _triattn.ArgumentTypeError("triattn.torch_ops.register(compressor, cache): expected a "
                                         "triattn.Compressor and a triattn.PagedCache")
    with _lock:
        h = next(_handles)
        _registry[h] = (compressor, cache)
    return h


def unregister(handle: int) -> None:
    with _lock:
        _registry.pop(handle, None)


def _lookup(handle: int):
    try:
        return _registry[handle]
    except KeyError:
        raise _triattn.LogicError(f"triattn: round op: handle {handle} is not registered "
                                  "(triattn.torch_ops.register)") from None


@torch.library.custom_op("triattn::round",
                         mutates_args=("kv", "new_lens", "status", "freed_begin", "freed_end", "kept", "workspace"))
def round_op(handle: int, kv: List[torch.Tensor], block_tables: torch.Tensor, seq_lens: torch.Tensor,
             seq_ids: torch.Tensor, t0: torch.Tensor, prompt_lens: torch.Tensor, new_lens: torch.Tensor,
             status: torch.Tensor, freed_begin: torch.Tensor, freed_end: torch.Tensor, kept: torch.Tensor,
             slot_positions: Optional[torch.Tensor], workspace: torch.Tensor, max_len: int,
             trigger: int, protected_prefix: Optional[torch.Tensor] = None) -> None:
    """One round (see triattn.Compressor.round); every output is written in place."""
    compressor, cache = _lookup(handle)
    stream = torch.cuda.current_stream(seq_ids.device).cuda_stream if seq_ids.is_cuda else 0
    compressor._round(cache, block_tables, seq_lens, seq_ids, t0, prompt_lens, new_lens, status, freed_begin,
                      freed_end, kept, slot_positions, workspace, max_len, _triattn.RoundTrigger(trigger), stream,
                      protected_prefix)


@round_op.register_fake
def _round_fake(handle, kv, block_tables, seq_lens, seq_ids, t0, prompt_lens, new_lens, status, freed_begin,
                freed_end, kept, slot_positions, workspace, max_len, trigger, protected_prefix=None) -> None:
    return None


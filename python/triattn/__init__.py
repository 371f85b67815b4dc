# SPDX-License-Identifier: Apache-2.0
"""triattn: TriAttention KV-cache compression over an inference engine's own paged cache.

numpy arrays run the library's CPU round; CUDA tensors (torch, CuPy) run its kernels on the
caller's current stream, without copies, when the extension was built with CUDA
(``triattn.has_cuda``). See docs/python.md.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import _triattn
from ._triattn import (  # noqa: F401
    AdmissionRequest,
    Aggregation,
    ArgumentTypeError,
    CacheConfig,
    CompressionReport,
    DType,
    Error,
    FormatError,
    KeepCounts,
    KvCache,
    KvLayout,
    LogicError,
    ModelGeometry,
    NonFinitePolicy,
    OutOfMemoryError,
    PagedCache,
    Phase,
    PromptMode,
    PruningMode,
    QueryStats,
    RequestFootprint,
    RopeConfig,
    RopeScaling,
    RopeScalingKind,
    RopeStyle,
    RoundStatus,
    RoundTrigger,
    ScoringParams,
    SelectionParams,
    UnsupportedError,
    admissible_prefix,
    counted_length,
    has_cuda,
    keep_counts,
    kept_rows,
    load_pt_stats,
    load_stats,
    max_resident_tokens,
    random_query_stats,
    request_footprint,
    save_pt_stats,
    save_stats,
    should_compress,
    slice_for_rank,
)

__version__ = "0.1.0"


# ---- array-library helpers (numpy, torch, CuPy; nothing is imported that the caller lacks) -------

def _library(x: Any, name: str) -> str:
    """'numpy', 'torch' or 'cupy': the library of the array argument `name` (ArgumentTypeError
    naming it for anything else)."""
    mod = type(x).__module__.split(".")[0]
    if mod in ("numpy", "torch", "cupy") and hasattr(x, "shape"):
        return mod
    raise ArgumentTypeError(f"triattn: {name} is not an array: got {type(x).__module__}.{type(x).__name__}; "
                            "pass numpy arrays, torch tensors or CuPy arrays")


def _shape(x: Any, name: str) -> tuple:
    _library(x, name)
    return tuple(int(n) for n in x.shape)


def _empty(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """An uninitialised array of `shape` and `dtype` ('int32', 'int64', 'uint8') from the library
    and on the device of `like` (an array already checked)."""
    lib = _library(like, "array")
    if lib == "numpy":
        return np.empty(shape, dtype=dtype)
    if lib == "torch":
        import torch
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.device)
    import cupy
    with cupy.cuda.Device(like.device.id):
        return cupy.empty(tuple(shape), dtype=dtype)


def _is_cuda(x: Any) -> bool:
    lib = _library(x, "array")
    return (lib == "torch" and x.is_cuda) or lib == "cupy"


def _current_stream(like: Any) -> int:
    """The caller's current CUDA stream on the device of `like` (0 for host arrays)."""
    lib = _library(like, "array")
    if lib == "torch" and like.is_cuda:
        import torch
        return int(torch.cuda.current_stream(like.device).cuda_stream)
    if lib == "cupy":
        import cupy
        with cupy.cuda.Device(like.device.id):
            return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _stream_handle(stream: Any) -> int:
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise ArgumentTypeError(f"triattn: stream: cannot take a CUDA stream from {type(stream).__name__}")


def _to_numpy(x: Any, name: str = "array") -> np.ndarray:
    lib = _library(x, name)
    if lib == "numpy":
        return x
    if lib == "torch":
        return x.detach().cpu().numpy()
    return x.get()


# ---- building the view over an engine's tensors --------------------------------------------------

def vllm_cache(kv_caches: Sequence[Any], layout: str = "flash_attn") -> PagedCache:
    """A PagedCache over vLLM's per-layer KV tensors, without copying.

    layout:
      "flash_attn"      per layer [2, num_blocks, block_size, kv_heads, head_dim] (FlashAttention backend)
      "flashinfer"      per layer [num_blocks, 2, block_size, kv_heads, head_dim] (FlashInfer, NHD)
      "flashinfer_hnd"  per layer [num_blocks, 2, kv_heads, block_size, head_dim] (FlashInfer, HND)
    """
    for i, t in enumerate(kv_caches):
        _library(t, f"kv_caches[{i}]")
    if layout == "flash_attn":
        return PagedCache([t[0] for t in kv_caches], [t[1] for t in kv_caches])
    if layout == "flashinfer":
        return PagedCache([t[:, 0] for t in kv_caches], [t[:, 1] for t in kv_caches])
    if layout == "flashinfer_hnd":
        return PagedCache([t[:, 0].swapaxes(1, 2) for t in kv_caches], [t[:, 1].swapaxes(1, 2) for t in kv_caches])
    raise LogicError(f"triattn: vllm_cache: unknown layout {layout!r}; expected 'flash_attn', 'flashinfer' "
                     "or 'flashinfer_hnd'")


def sglang_cache(k_buffers: Sequence[Any], v_buffers: Sequence[Any]) -> PagedCache:
    """A PagedCache over SGLang's token pool: per layer K and V buffers [num_slots, kv_heads,
    head_dim], one slot per token (page size 1; the block table is req_to_token)."""
    for name, buffers in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
        for i, b in enumerate(buffers):
            _library(b, f"{name}[{i}]")
    return PagedCache([b[:, None] for b in k_buffers], [b[:, None] for b in v_buffers])


# ---- the round ------------------------------------------------------------------------------------

class RoundResult(NamedTuple):
    """Outputs of Compressor.round, arrays of the inputs' library and device ([batch] each)."""
    new_lens: Any     #: physical length after the round (old length unless COMPRESSED)
    status: Any       #: RoundStatus values
    freed_begin: Any  #: block-table columns [freed_begin, freed_end) now hold unused blocks
    freed_end: Any
    kept: Any         #: [batch, kept_rows, max_keep] original positions of the kept tokens (or None)
    compressed: Optional[int]  #: sequences compressed (CPU); None on the GPU (nothing is read back)


class Compressor(_triattn.Compressor):
    """TriAttention's batched compression round for one model: its query statistics, RoPE,
    selection and scoring parameters. ``round`` runs over a PagedCache in host memory (numpy)
    or on a CUDA device (torch / CuPy tensors, on the current stream)."""

    def round(self, cache: PagedCache, block_tables: Any, seq_lens: Any, seq_ids: Any, t0: Any, prompt_lens: Any,
              *, trigger: RoundTrigger = RoundTrigger.IF_DUE, kept: Any = True, slot_positions: Any = None,
              protected_prefix: Any = None, max_len: Optional[int] = None, workspace: Any = None,
              out: Optional[RoundResult] = None, stream: Any = None) -> RoundResult:
        """One compression round over the sequences `seq_ids` of the engine's cache.

        block_tables  int32 [max_seqs, max_blocks_per_seq] (SGLang: req_to_token), read only
        seq_lens      int32 [max_seqs] physical lengths, read only (apply new_lens afterwards)
        seq_ids       int32 [batch] rows of block_tables / seq_lens to consider (no row twice)
        t0            int64 [batch] logical position of each sequence (tokens processed so far)
        prompt_lens   int32 [batch] prompt tokens still in place at slots [0, prompt_len)
        kept          True: allocate and report kept positions; an int32 [batch, kept_rows, max_keep]
                      array to fill; None/False: not reported
        slot_positions optional int32 [batch, kept_rows, >= max_len]: original positions of each
                      sequence's slots after earlier rounds (kept then reports original positions)
        protected_prefix optional int32 [batch], each >= 0: the sequence's slots [0, p) are neither
                      selected away nor moved (p >= its length protects all of it). To protect
                      blocks shared with other sequences (prefix caching), p must cover whole
                      blocks: the block holding slot p is compacted into. Checked on the CPU;
                      on the GPU (not read back) a negative entry counts as 0.
        max_len       >= every sequence's length (sizes the workspace), at most the most slots a
                      sequence can hold, min(max_blocks_per_seq, cache.num_blocks) * block_size;
                      default: read from seq_lens (on the GPU that reads device memory: pass it
                      to avoid the wait)
        workspace     uint8 array of at least workspace_size(batch, max_len, device) bytes (allocated
                      when None; pass one for CUDA-graph capture)
        out           a RoundResult whose arrays are filled in place (allocated when None)
        stream        CUDA stream (int handle, torch or CuPy stream); default: the current one

        Everything is checked before anything is written or allocated; a bad argument raises
        LogicError (ArgumentTypeError for a wrong type) naming it and leaves the cache untouched.
        """
        if not isinstance(cache, PagedCache):
            raise ArgumentTypeError(f"triattn: cache is not a triattn.PagedCache: got {type(cache).__name__}")
        if not isinstance(trigger, RoundTrigger):
            raise ArgumentTypeError(f"triattn: trigger is not a triattn.RoundTrigger: got {type(trigger).__name__}")
        if out is not None and not isinstance(out, RoundResult):
            raise ArgumentTypeError(f"triattn: out is not a triattn.RoundResult: got {type(out).__name__}")
        ids_shape = _shape(seq_ids, "seq_ids")
        if len(ids_shape) != 1:
            raise LogicError(f"triattn: seq_ids has {len(ids_shape)} dimensions; expected 1 ([batch] int32)")
        batch = ids_shape[0]
        tables_shape = _shape(block_tables, "block_tables")
        if len(tables_shape) != 2:
            raise LogicError(f"triattn: block_tables has {len(tables_shape)} dimensions; expected 2 "
                             "([max_seqs, max_blocks_per_seq] int32)")
        on_gpu = _is_cuda(seq_ids)
        capacity = min(tables_shape[1], cache.num_blocks) * cache.block_size
        if max_len is None:
            max_len = _longest(seq_lens, seq_ids, tables_shape[0], capacity)
        elif not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool):
            raise ArgumentTypeError(f"triattn: max_len is not an integer: got {type(max_len).__name__}")
        elif max_len > capacity:
            raise LogicError(f"triattn: max_len = {max_len} exceeds the most slots a sequence can hold, "
                             f"min(max_blocks_per_seq {tables_shape[1]}, num_blocks {cache.num_blocks}) * "
                             f"block_size {cache.block_size} = {capacity}")
        device = "cpu" if not on_gpu else f"cuda:{_device_index(seq_ids)}"
        if workspace is None:
            size = self.workspace_size(batch, max_len, device, tables_shape[0], cache.num_blocks)
            workspace = _empty(seq_ids, (max(1, size),), "uint8")
        if out is None:
            rows = self.kept_rows()
            if kept is True:
                kept_arr = _empty(seq_ids, (batch, rows, max(1, max_len)), "int32")
            elif kept is None or kept is False:
                kept_arr = None
            else:
                kept_arr = kept
            out = RoundResult(*(_empty(seq_ids, (batch,), "int32") for _ in range(4)), kept_arr, None)
        handle = 0
        if on_gpu:
            handle = _stream_handle(stream) if stream is not None else _current_stream(seq_ids)
        done = self._round(cache, block_tables, seq_lens, seq_ids, t0, prompt_lens, out.new_lens, out.status,
                           out.freed_begin, out.freed_end, out.kept, slot_positions, workspace, int(max_len),
                           trigger, handle, protected_prefix)
        return out._replace(compressed=done)


def _longest(seq_lens: Any, seq_ids: Any, max_seqs: int, capacity: int) -> int:
    """The longest of the batch's lengths (max_len's default), every index checked before use:
    seq_lens [max_seqs], seq_ids integers in [0, max_seqs), lengths within `capacity`."""
    lens_shape = _shape(seq_lens, "seq_lens")
    if lens_shape != (max_seqs,):
        raise LogicError(f"triattn: seq_lens has {lens_shape[0] if len(lens_shape) == 1 else list(lens_shape)} "
                         f"entries; expected one per block_tables row, max_seqs = {max_seqs}")
    lens, ids = _to_numpy(seq_lens, "seq_lens"), _to_numpy(seq_ids, "seq_ids")
    if ids.dtype.kind not in "iu":
        raise LogicError(f"triattn: seq_ids has dtype {ids.dtype}; expected int32")
    if ids.size == 0:
        return 0
    outside = np.flatnonzero((ids < 0) | (ids >= max_seqs))
    if outside.size:
        i = int(outside[0])
        raise LogicError(f"triattn: seq_ids[{i}] = {int(ids[i])} is not a row of block_tables / seq_lens "
                         f"[0, {max_seqs})")
    batch_lens = lens[ids.astype(np.int64)]
    longest = int(np.argmax(batch_lens))
    if batch_lens[longest] > capacity:
        raise LogicError(f"triattn: seq_lens[{int(ids[longest])}] = {batch_lens[longest]} (seq_ids[{longest}]) "
                         f"exceeds the most slots a sequence can hold, min(max_blocks_per_seq, num_blocks) * "
                         f"block_size = {capacity}")
    return int(batch_lens[longest])


def _device_index(x: Any) -> int:
    lib = _library(x, "array")
    if lib == "torch":
        return 0 if x.device.index is None else int(x.device.index)
    if lib == "cupy":
        return int(x.device.id)
    return 0


def freed_blocks(block_tables: Any, seq_ids: Any, result: RoundResult) -> list:
    """Host lists of the block ids each sequence of the round no longer uses (columns
    [freed_begin, freed_end) of its block-table row, read before the engine overwrites them).
    Reads device arrays back (a synchronisation): call it when the engine returns blocks."""
    tables, ids = _to_numpy(block_tables), _to_numpy(seq_ids)
    begin, end = _to_numpy(result.freed_begin), _to_numpy(result.freed_end)
    return [tables[int(s), int(b):int(e)].copy() for s, b, e in zip(ids, begin, end)]


if "torch" in sys.modules:  # the torch custom op, registered only where torch is already in use
    from . import torch_ops  # noqa: F401,E402

// SPDX-License-Identifier: Apache-2.0
// Host-side checks of an engine's KvCacheView before a round reads or writes through it: the
// structure (sizes, strides that nest, ranges that do not overlap), the table rows a round reads,
// and that a round's outputs and workspace overlap neither each other nor its inputs. The host
// round runs all of them; the device round's host side runs the structure and aliasing checks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/round_types.hpp>

namespace triattn {

namespace detail {

/// One dimension of the lattice of head vectors: `count` positions `stride` elements apart.
struct StrideDim {
  std::int64_t stride;
  std::int64_t count;
  const char* name;
};

/// True when the dims nest: sorted by stride, each stride is at least the extent of everything
/// below it (head_dim, then the smaller dims), so no two head vectors share an element. Every
/// engine layout nests; dims of count 1 take no part. `bad` names the offending dim.
inline bool strides_nest(std::vector<StrideDim> dims, std::int64_t head_dim, std::string* bad) {
  dims.erase(std::remove_if(dims.begin(), dims.end(), [](const StrideDim& d) { return d.count <= 1; }), dims.end());
  std::sort(dims.begin(), dims.end(), [](const StrideDim& a, const StrideDim& b) { return a.stride < b.stride; });
  std::int64_t extent = head_dim;  // elements spanned by one position of the current dim
  for (const StrideDim& d : dims) {
    if (d.stride < extent) {
      *bad = std::string(d.name) + " stride " + std::to_string(d.stride) + " is smaller than the " +
             std::to_string(extent) + " elements the smaller strides span";
      return false;
    }
    extent += (d.count - 1) * d.stride;
  }
  return true;
}

template <class T, class Id>
std::vector<StrideDim> block_dims(const KvCacheView<T, Id>& v) {
  return {{v.block.stride_head, v.block.num_kv_heads, "head"},
          {v.block.stride_token, v.block.block_size, "token"},
          {v.block.stride_block, v.num_blocks, "block"}};
}

/// Calls f(column, block id) for the first ceil(seq_lens[s] / block_size) entries of row s of a
/// host-readable view, after checking the row's length (in [0, capacity]) and each id (in
/// [0, num_blocks)). @throws triattn::logic_error naming `what` and the bad entry.
template <class T, class Id, class F>
void for_each_row_block(const KvCacheView<T, Id>& view, int s, const std::string& what, F&& f) {
  const std::int64_t len = view.seq_lens[s];
  if (len < 0 || len > view.capacity_tokens())
    TRIATTN_FAIL(what + ": seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) + " is outside [0, capacity " +
                 std::to_string(view.capacity_tokens()) + " = max_blocks_per_seq * block_size]");
  const std::int64_t nb = ceil_div<std::int64_t>(len, view.block.block_size);
  const Id* row = view.table_row(s);
  for (std::int64_t j = 0; j < nb; ++j) {
    const std::int64_t id = row[j];
    if (id < 0 || id >= view.num_blocks)
      TRIATTN_FAIL(what + ": block_tables[" + std::to_string(s) + "][" + std::to_string(j) + "] = " +
                   std::to_string(id) + " is outside [0, num_blocks = " + std::to_string(view.num_blocks) +
                   ") (sequence length " + std::to_string(len) + ")");
    f(j, id);
  }
}

}  // namespace detail

/// Checks a view before anything reads or writes through it, host side. Structure (always):
/// positive sizes, non-null base/tables/lengths, non-negative strides that nest (no two (block,
/// token, head) vectors of one range share an element, and for a single-base view no two
/// (layer, K|V) ranges either). Contents (`contents` true, host-readable views only): the
/// `ranges` pointers are non-null and no two ranges overlap (except by an offset that nests, as
/// K and V interleaved per block do), and for every sequence s of `seqs`: s is a row of the
/// table, 0 <= seq_lens[s] <= capacity_tokens(), and the first ceil(seq_lens[s] / block_size)
/// entries of row s are distinct block ids in [0, num_blocks).
/// @throws triattn::logic_error naming `what` and the bad field.
template <class T, class Id>
void validate_view(const KvCacheView<T, Id>& view, std::span<const std::int32_t> seqs, bool contents,
                   const std::string& what = "KvCacheView") {
  const BlockLayout& b = view.block;
  const auto fail = [&](const std::string& msg) { TRIATTN_FAIL(what + ": " + msg); };
  const auto positive = [&](long long v, const char* name) {
    if (v <= 0) fail(std::string(name) + " = " + std::to_string(v) + " must be positive");
  };
  positive(view.num_layers, "num_layers");
  positive(view.num_blocks, "num_blocks");
  positive(view.max_seqs, "max_seqs");
  positive(view.max_blocks_per_seq, "max_blocks_per_seq");
  positive(b.block_size, "block.block_size");
  positive(b.num_kv_heads, "block.num_kv_heads");
  positive(b.head_dim, "block.head_dim");
  if (view.capacity_tokens() > std::numeric_limits<std::int32_t>::max())
    fail("max_blocks_per_seq * block_size = " + std::to_string(view.capacity_tokens()) + " overflows int32 slots");
  if (view.block_tables == nullptr) fail("block_tables is null");
  if (view.seq_lens == nullptr) fail("seq_lens is null");
  if (view.ranges == nullptr && view.data == nullptr) fail("data and ranges are both null");
  for (const auto& [v, name] : {std::pair{b.stride_block, "block.stride_block"}, std::pair{b.stride_token, "block.stride_token"},
                                std::pair{b.stride_head, "block.stride_head"}, std::pair{view.layer_stride, "layer_stride"},
                                std::pair{view.kind_stride, "kind_stride"}})
    if (v < 0) fail(std::string(name) + " = " + std::to_string(v) + " must be non-negative");
  std::vector<detail::StrideDim> dims = detail::block_dims(view);
  if (view.ranges == nullptr) {
    dims.push_back({view.kind_stride, 2, "kind"});
    dims.push_back({view.layer_stride, view.num_layers, "layer"});
  }
  std::string bad;
  if (!detail::strides_nest(dims, b.head_dim, &bad))
    fail("strides overlap: " + bad + " (block " + std::to_string(b.stride_block) + ", token " +
         std::to_string(b.stride_token) + ", head " + std::to_string(b.stride_head) + ", head_dim " +
         std::to_string(b.head_dim) +
         (view.ranges == nullptr ? ", kind " + std::to_string(view.kind_stride) + ", layer " +
                                       std::to_string(view.layer_stride)
                                 : std::string()) +
         ")");
  if (!contents) return;
  if (view.ranges != nullptr) {
    const std::int64_t extent = (view.num_blocks - 1) * b.stride_block + (b.block_size - 1) * b.stride_token +
                                (b.num_kv_heads - 1) * b.stride_head + b.head_dim;  // elements one range spans
    const int n = 2 * view.num_layers;
    for (int i = 0; i < n; ++i)
      if (view.ranges[i] == nullptr)
        fail("ranges[" + std::to_string(i) + "] (layer " + std::to_string(i / 2) + (i % 2 ? ", V" : ", K") + ") is null");
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j) {
        const auto pi = reinterpret_cast<std::uintptr_t>(view.ranges[i]);
        const auto pj = reinterpret_cast<std::uintptr_t>(view.ranges[j]);
        const std::uintptr_t lo = std::min(pi, pj), hi = std::max(pi, pj);
        const std::uintptr_t gap = hi - lo;
        if (gap >= static_cast<std::uintptr_t>(extent) * sizeof(T)) continue;  // disjoint spans
        std::vector<detail::StrideDim> d2 = detail::block_dims(view);
        d2.push_back({static_cast<std::int64_t>(gap / sizeof(T)), 2, "range offset"});
        std::string why;
        if (gap % sizeof(T) != 0 || !detail::strides_nest(d2, b.head_dim, &why))
          fail("ranges[" + std::to_string(i) + "] and ranges[" + std::to_string(j) + "] overlap (" +
               std::to_string(gap / sizeof(T)) + " elements apart, a range spans " + std::to_string(extent) + ")");
      }
  }
  std::vector<std::uint8_t> seen;  // per block id: used by the current row
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    const int s = seqs[k];
    if (s < 0 || s >= view.max_seqs)
      fail("sequence " + std::to_string(s) + " (batch entry " + std::to_string(k) + ") is not a row of the table [0, " +
           std::to_string(view.max_seqs) + ")");
    seen.assign(static_cast<std::size_t>(view.num_blocks), 0);
    detail::for_each_row_block(view, s, what, [&](std::int64_t j, std::int64_t id) {
      if (seen[static_cast<std::size_t>(id)]++)
        fail("block_tables[" + std::to_string(s) + "][" + std::to_string(j) + "] = " + std::to_string(id) +
             " appears twice in the sequence's row");
    });
  }
}

namespace detail {

/// One byte range a round reads or writes (null or empty: none).
struct MemSpan {
  const void* p;
  std::size_t bytes;
  const char* name;
};

/// Element span of the view's K/V memory (a range per (layer, K|V) when `ranges` is readable
/// here, one span from `data` otherwise; none for a device pointer array).
template <class T, class Id>
std::vector<MemSpan> kv_spans(const KvCacheView<T, Id>& view, bool ranges_readable) {
  const BlockLayout& b = view.block;
  const std::int64_t extent = (view.num_blocks - 1) * b.stride_block + (b.block_size - 1) * b.stride_token +
                              (b.num_kv_heads - 1) * b.stride_head + b.head_dim;  // elements one range spans
  std::vector<MemSpan> spans;
  if (view.ranges == nullptr) {
    const std::int64_t all = (view.num_layers - 1) * view.layer_stride + view.kind_stride + extent;
    spans.push_back({view.data, sizeof(T) * static_cast<std::size_t>(all), "the view's K/V memory"});
  } else if (ranges_readable) {
    for (int i = 0; i < 2 * view.num_layers; ++i)
      spans.push_back({view.ranges[i], sizeof(T) * static_cast<std::size_t>(extent), "the view's K/V memory"});
  }
  return spans;
}

/// Refuses a round whose written spans (outputs, workspace, K/V) overlap each other or anything
/// it reads (tables, lengths, batch arrays, slot positions): a write there would change an input
/// of a later sequence mid-round. Read spans may overlap each other.
/// @throws triattn::logic_error naming `what` and both arrays.
inline void check_disjoint(std::span<const MemSpan> written, std::span<const MemSpan> read, const std::string& what) {
  const auto overlap = [](const MemSpan& a, const MemSpan& b) {
    if (a.p == nullptr || b.p == nullptr || a.bytes == 0 || b.bytes == 0) return false;
    const auto pa = reinterpret_cast<std::uintptr_t>(a.p), pb = reinterpret_cast<std::uintptr_t>(b.p);
    return pa < pb + b.bytes && pb < pa + a.bytes;
  };
  for (std::size_t i = 0; i < written.size(); ++i) {
    for (std::size_t j = i + 1; j < written.size(); ++j)
      if (overlap(written[i], written[j]) && std::string_view(written[i].name) != written[j].name)
        TRIATTN_FAIL(what + ": " + written[i].name + " overlaps " + written[j].name + " (both are written)");
    for (const MemSpan& r : read)
      if (overlap(written[i], r))
        TRIATTN_FAIL(what + ": " + written[i].name + " overlaps " + r.name + ", which the round reads");
  }
}

/// The spans a round over `view` writes and reads (batch.batch > 0; workspace_bytes: what the
/// round uses of it), checked with check_disjoint.
template <class T, class Id>
void check_round_aliasing(const KvCacheView<T, Id>& view, bool ranges_readable, const RoundBatch& batch,
                          const RoundOutputs& out, const void* workspace, std::size_t workspace_bytes,
                          const std::string& what) {
  const std::size_t B = static_cast<std::size_t>(batch.batch), i32 = sizeof(std::int32_t);
  const std::size_t kept_entries = B * static_cast<std::size_t>(out.kept_rows > 0 ? out.kept_rows : 0);
  std::vector<MemSpan> written{{out.new_lens, B * i32, "out.new_lens"},
                               {out.status, B * i32, "out.status"},
                               {out.freed_begin, B * i32, "out.freed_begin"},
                               {out.freed_end, B * i32, "out.freed_end"},
                               {out.kept, kept_entries * static_cast<std::size_t>(out.max_keep > 0 ? out.max_keep : 0) * i32,
                                "out.kept"},
                               {workspace, workspace_bytes, "the workspace"}};
  for (const MemSpan& m : kv_spans(view, ranges_readable)) written.push_back(m);
  const std::size_t table = static_cast<std::size_t>(view.max_seqs) * static_cast<std::size_t>(view.max_blocks_per_seq);
  const MemSpan read[] = {
      {view.block_tables, table * sizeof(Id), "view.block_tables"},
      {view.seq_lens, static_cast<std::size_t>(view.max_seqs) * sizeof(Id), "view.seq_lens"},
      {batch.seq_ids, B * i32, "batch.seq_ids"},
      {batch.t0, B * sizeof(std::int64_t), "batch.t0"},
      {batch.prompt_lens, B * i32, "batch.prompt_lens"},
      {batch.protected_prefix, B * i32, "batch.protected_prefix"},
      {out.slot_positions,
       out.slot_positions != nullptr ? kept_entries * static_cast<std::size_t>(out.positions_stride) * i32 : 0,
       "out.slot_positions"}};
  check_disjoint(written, read, what);
}

}  // namespace detail

}  // namespace triattn

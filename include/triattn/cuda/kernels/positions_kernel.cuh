// SPDX-License-Identifier: Apache-2.0
// Tracked positions of a device cache (CacheConfig::track_positions), kept in device memory beside
// the KV: a store indexed like the pool ([num_blocks, block_size, rows], rows = layers * KV heads)
// that cuda::DeviceRounds updates after each round, in two passes (a row's new slots read old
// slots at or after them, so the reads finish before any write):
//   map_kept_positions_kernel    the kept tokens' original positions, from the round's kept slots
//   store_kept_positions_kernel  written back at their new slots, past what stayed in place
// A slot's position (PositionState): its index below in_place, the store's entry below
// explicit_len, logical - length + slot after (appended since the last compaction).
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn::cuda {

/// Device arrays of one round's position pass (trivially copyable).
struct PositionPass {
  std::int32_t* store = nullptr;          ///< [num_blocks, block_size, rows]
  std::int32_t* positions = nullptr;      ///< [batch, rows, max_keep] kept tokens' original positions
  const std::int32_t* in_place = nullptr;      ///< [batch] PositionState::in_place before the round
  const std::int32_t* explicit_len = nullptr;  ///< [batch] PositionState::explicit_len before the round
  const std::int32_t* old_lens = nullptr;      ///< [batch] lengths before the round
  int rows = 0;        ///< layers * KV heads
  int num_kv_heads = 0;
};
static_assert(std::is_trivially_copyable_v<PositionPass>);

namespace detail {

__device__ __forceinline__ std::int32_t* position_entry(const PositionPass& p, const std::int32_t* table, int block_size,
                                                        int slot, int row) {
  const long long block = table[slot / block_size];
  return p.store + (block * block_size + slot % block_size) * p.rows + row;
}

}  // namespace detail

/// Grid (batch, row chunks): positions[b, c, i] = original position of kept slot i of row c.
__global__ void map_kept_positions_kernel(const std::int32_t* __restrict__ tables, int max_blocks_per_seq,
                                          int block_size, RoundBatch batch, RoundOutputs out, PositionPass p) {
  const int b = static_cast<int>(blockIdx.x);
  if (out.status[b] != static_cast<std::int32_t>(RoundStatus::kCompressed)) return;
  const int seq = batch.seq_ids[b];
  const std::int32_t* table = tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const int keep = out.new_lens[b], ip = p.in_place[b], el = p.explicit_len[b];
  const long long base = batch.t0[b] - p.old_lens[b];  // position of an appended slot: base + slot
  for (int c = static_cast<int>(blockIdx.y); c < p.rows; c += static_cast<int>(gridDim.y)) {
    int l = 0, h = 0;
    kept_row_source(c, p.rows, p.num_kv_heads, &l, &h);  // (layer, head) of row c
    const int r = out.kept_rows == p.rows ? c : out.kept_rows == 1 ? 0 : h;
    const std::int32_t* kept = out.kept + (static_cast<long long>(b) * out.kept_rows + r) * out.max_keep;
    std::int32_t* dst = p.positions + (static_cast<long long>(b) * p.rows + c) * out.max_keep;
    for (int i = static_cast<int>(threadIdx.x); i < keep; i += static_cast<int>(blockDim.x)) {
      const int slot = kept[i];
      dst[i] = slot < ip   ? slot
               : slot < el ? *detail::position_entry(p, table, block_size, slot, c)
                           : static_cast<std::int32_t>(base + slot);
    }
  }
}

/// Grid (batch, row chunks): the store's entries of slots [lo, new_len) take the mapped positions,
/// lo = max(the new in-place prefix, the slots that neither moved nor were implicit). Slots below lo
/// hold their right positions already and may sit in blocks another sequence shares: never written.
__global__ void store_kept_positions_kernel(const std::int32_t* __restrict__ tables, int max_blocks_per_seq,
                                            int block_size, RoundBatch batch, RoundOutputs out, PositionPass p) {
  const int b = static_cast<int>(blockIdx.x);
  if (out.status[b] != static_cast<std::int32_t>(RoundStatus::kCompressed)) return;
  const int seq = batch.seq_ids[b];
  const std::int32_t* table = tables + static_cast<long long>(seq) * max_blocks_per_seq;
  const int keep = out.new_lens[b], fm = out.first_moved[b];
  const int in_place_new = min(min(p.in_place[b], fm), keep);
  const int lo = max(in_place_new, min(fm, p.explicit_len[b]));
  for (int c = static_cast<int>(blockIdx.y); c < p.rows; c += static_cast<int>(gridDim.y)) {
    const std::int32_t* src = p.positions + (static_cast<long long>(b) * p.rows + c) * out.max_keep;
    for (int i = lo + static_cast<int>(threadIdx.x); i < keep; i += static_cast<int>(blockDim.x))
      *detail::position_entry(p, table, block_size, i, c) = src[i];
  }
}

}  // namespace triattn::cuda

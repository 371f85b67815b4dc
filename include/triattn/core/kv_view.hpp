// SPDX-License-Identifier: Apache-2.0
// KvCacheView: the trivially copyable description of the paged cache that kernels (and the CPU
// reference) receive. Its type depends only on the element and index types, never on the
// allocator, scorer or compactor policy, so policy mixes do not multiply kernel instantiations.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/core/layout.hpp>

namespace triattn {

enum class KvKind : int { kKey = 0, kValue = 1 };

/// Memory: 2 * num_layers ranges (range r = 2 * layer + kind), each [num_blocks] blocks laid out
/// as `block` says, consecutive ranges `range_stride` elements apart (a VMM allocator reserves
/// each range its own stretch of address space; a static pool packs them).
/// Block tables are padded rows, vLLM style: entry j of row s is the block holding slots
/// [j * block_size, (j + 1) * block_size) of sequence slot s; unused entries are -1.
template <class T, class Id = std::int32_t>
struct KvCacheView {
  T* data;                   ///< [2 * num_layers][range_stride] elements
  std::int64_t range_stride; ///< elements between consecutive (layer, kind) ranges
  BlockLayout block;         ///< layout inside one block
  int num_layers;
  int num_blocks;            ///< blocks per range (valid ids are [0, num_blocks))
  int max_seqs;              ///< rows of block_tables
  int max_blocks_per_seq;    ///< columns of block_tables
  const Id* block_tables;    ///< [max_seqs, max_blocks_per_seq], -1 padded
  const Id* seq_lens;        ///< [max_seqs] physical lengths (cached tokens)

  [[nodiscard]] TRIATTN_HOST_DEVICE T* range(int layer, KvKind kind) const {
    return data + (2 * static_cast<std::int64_t>(layer) + static_cast<int>(kind)) * range_stride;
  }
  [[nodiscard]] TRIATTN_HOST_DEVICE Id block_of(int seq, int slot) const {
    return block_tables[static_cast<std::int64_t>(seq) * max_blocks_per_seq + slot / block.block_size];
  }
  /// Head vector [head_dim] of (layer, kind, seq, slot, head).
  [[nodiscard]] TRIATTN_HOST_DEVICE T* token(int layer, KvKind kind, int seq, int slot, int head) const {
    return range(layer, kind) + block.offset(block_of(seq, slot), slot % block.block_size, head);
  }
};

static_assert(std::is_trivially_copyable_v<KvCacheView<float>>, "KvCacheView must be trivially copyable");

}  // namespace triattn

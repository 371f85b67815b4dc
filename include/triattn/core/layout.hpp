// SPDX-License-Identifier: Apache-2.0
// Where one token's head vector lives inside a block. Two layouts, as engines use them:
//   NHD: block = [block_size, num_kv_heads, head_dim]   (vLLM, FlashInfer NHD)
//   HND: block = [num_kv_heads, block_size, head_dim]   (TensorRT-LLM, FlashInfer HND)
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>

namespace triattn {

enum class KvLayout : int { kNHD = 0, kHND = 1 };

[[nodiscard]] inline const char* layout_name(KvLayout l) noexcept { return l == KvLayout::kNHD ? "NHD" : "HND"; }

/// Element offsets inside one (layer, K|V) range of blocks. Trivially copyable; kernels use it.
struct BlockLayout {
  KvLayout layout;
  int block_size;    ///< tokens per block
  int num_kv_heads;
  int head_dim;

  /// Elements in one block of one (layer, K|V) range.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t block_elems() const {
    return static_cast<std::int64_t>(block_size) * num_kv_heads * head_dim;
  }
  /// Offset of element 0 of the head vector (token `slot_in_block`, head `head`) of `block`.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t offset(std::int64_t block, int slot_in_block, int head) const {
    const std::int64_t inner = layout == KvLayout::kNHD
                                   ? (static_cast<std::int64_t>(slot_in_block) * num_kv_heads + head) * head_dim
                                   : (static_cast<std::int64_t>(head) * block_size + slot_in_block) * head_dim;
    return block * block_elems() + inner;
  }
  /// Distance in elements between consecutive tokens of one head inside a block.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t token_stride() const {
    return layout == KvLayout::kNHD ? static_cast<std::int64_t>(num_kv_heads) * head_dim : head_dim;
  }
};

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// Where one token's head vector lives inside a block: element strides for block, token-in-block
// and KV head (head_dim is always contiguous). The two canonical layouts, as engines use them:
//   NHD: block = [block_size, num_kv_heads, head_dim]   (vLLM, FlashInfer NHD)
//   HND: block = [num_kv_heads, block_size, head_dim]   (TensorRT-LLM, FlashInfer HND)
// and any other arrangement through BlockLayout::strided (e.g. K and V interleaved per block, or
// several layers packed in one block of a pool: the block stride then spans them all).
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>

namespace triattn {

enum class KvLayout : int { kNHD = 0, kHND = 1 };

[[nodiscard]] inline const char* layout_name(KvLayout l) noexcept { return l == KvLayout::kNHD ? "NHD" : "HND"; }

/// Element offsets inside one (layer, K|V) range of blocks. Trivially copyable; kernels use it.
struct BlockLayout {
  int block_size = 0;    ///< tokens per block (1: one slot per token, SGLang style)
  int num_kv_heads = 0;
  int head_dim = 0;
  std::int64_t stride_block = 0;  ///< elements between block b and block b + 1 of one range
  std::int64_t stride_token = 0;  ///< elements between consecutive tokens of one head in a block
  std::int64_t stride_head = 0;   ///< elements between consecutive KV heads of one token

  BlockLayout() = default;
  /// The canonical dense layout `layout` (blocks packed back to back).
  TRIATTN_HOST_DEVICE constexpr BlockLayout(KvLayout layout, int bs, int kv_heads, int dim)
      : block_size(bs), num_kv_heads(kv_heads), head_dim(dim),
        stride_block(static_cast<std::int64_t>(bs) * kv_heads * dim),
        stride_token(layout == KvLayout::kNHD ? static_cast<std::int64_t>(kv_heads) * dim : dim),
        stride_head(layout == KvLayout::kNHD ? static_cast<std::int64_t>(dim) : static_cast<std::int64_t>(bs) * dim) {}

  /// Any strided arrangement (validate_view checks that no two head vectors overlap).
  [[nodiscard]] static constexpr BlockLayout strided(int bs, int kv_heads, int dim, std::int64_t block_stride,
                                                     std::int64_t token_stride, std::int64_t head_stride) noexcept {
    BlockLayout b;
    b.block_size = bs;
    b.num_kv_heads = kv_heads;
    b.head_dim = dim;
    b.stride_block = block_stride;
    b.stride_token = token_stride;
    b.stride_head = head_stride;
    return b;
  }

  /// Distance in elements between consecutive blocks of one range (block_size * num_kv_heads *
  /// head_dim for the canonical layouts; more when blocks interleave K/V or layers).
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t block_elems() const { return stride_block; }
  /// Elements one block's own head vectors span: block_size * num_kv_heads * head_dim.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t dense_block_elems() const {
    return static_cast<std::int64_t>(block_size) * num_kv_heads * head_dim;
  }
  /// Offset of element 0 of the head vector (token `slot_in_block`, head `head`) of `block`.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t offset(std::int64_t block, int slot_in_block, int head) const {
    return block * stride_block + static_cast<std::int64_t>(slot_in_block) * stride_token +
           static_cast<std::int64_t>(head) * stride_head;
  }
  /// Offset of head `head` inside a block (token 0).
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t head_offset(int head) const {
    return static_cast<std::int64_t>(head) * stride_head;
  }
  /// Distance in elements between consecutive tokens of one head inside a block.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t token_stride() const { return stride_token; }
  /// True when this is the dense canonical `l` layout.
  [[nodiscard]] TRIATTN_HOST_DEVICE bool is(KvLayout l) const {
    const BlockLayout c(l, block_size, num_kv_heads, head_dim);
    return stride_block == c.stride_block && stride_token == c.stride_token && stride_head == c.stride_head;
  }
};

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// View builders for engines' own KV layouts: the strides of vLLM's FlashAttention and FlashInfer
// tensors, SGLang's token pool and TensorRT-LLM-style pools, so a KvCacheView can be laid over an
// engine's memory without copying (docs/integration.md shows each engine's view).
#pragma once

#include <cstdint>

#include <triattn/core/kv_view.hpp>
#include <triattn/core/layout.hpp>

namespace triattn {

/// Geometry of an engine's per-layer tensors, for building a KvCacheView over them without
/// copying (docs/integration.md). Each returns the BlockLayout and, where K and V share one
/// tensor per layer, the element offset of V from K (`kind_offset`).
struct EngineLayout {
  BlockLayout block;
  std::int64_t kind_offset = 0;  ///< V range = K range + kind_offset (one tensor per layer)

  /// vLLM FlashAttention backend, per layer [2, num_blocks, block_size, kv_heads, head_dim].
  [[nodiscard]] static constexpr EngineLayout vllm_flash_attn(int num_blocks, int block_size, int kv_heads,
                                                              int head_dim) noexcept {
    const BlockLayout b(KvLayout::kNHD, block_size, kv_heads, head_dim);
    return EngineLayout{b, static_cast<std::int64_t>(num_blocks) * b.stride_block};
  }
  /// vLLM FlashInfer backend, per layer [num_blocks, 2, block_size, kv_heads, head_dim] (NHD), or
  /// [num_blocks, 2, kv_heads, block_size, head_dim] with KvLayout::kHND.
  [[nodiscard]] static constexpr EngineLayout vllm_flashinfer(int block_size, int kv_heads, int head_dim,
                                                              KvLayout inner = KvLayout::kNHD) noexcept {
    BlockLayout b(inner, block_size, kv_heads, head_dim);
    const std::int64_t one = b.stride_block;
    b.stride_block = 2 * one;
    return EngineLayout{b, one};
  }
  /// SGLang MHA token pool: separate K and V buffers per layer, [num_slots, kv_heads, head_dim],
  /// one slot per token (block_size 1; the block table is req_to_token).
  [[nodiscard]] static constexpr EngineLayout sglang(int kv_heads, int head_dim) noexcept {
    return EngineLayout{BlockLayout(KvLayout::kNHD, 1, kv_heads, head_dim), 0};
  }
  /// TensorRT-LLM-style pool: one block id holds every layer, block = [num_layers, 2, kv_heads,
  /// block_size, head_dim] (HND inside). With it: data = pool base, layer_stride =
  /// 2 * kind_offset, kind_stride = kind_offset.
  [[nodiscard]] static constexpr EngineLayout trtllm_pool(int num_layers, int block_size, int kv_heads,
                                                          int head_dim) noexcept {
    BlockLayout b(KvLayout::kHND, block_size, kv_heads, head_dim);
    const std::int64_t one = b.stride_block;
    b.stride_block = 2 * static_cast<std::int64_t>(num_layers) * one;
    return EngineLayout{b, one};
  }
};

}  // namespace triattn

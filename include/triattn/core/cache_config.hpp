// SPDX-License-Identifier: Apache-2.0
// Model geometry and cache configuration, validated on construction: every error names the bad
// value and why it is bad.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/layout.hpp>

namespace triattn {

/// Attention shape of a model (the part the KV cache cares about).
struct ModelGeometry {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;

  /// Query heads per KV head (GQA group size).
  [[nodiscard]] int group_size() const noexcept { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }

  void validate() const {
    TRIATTN_EXPECTS(num_layers > 0, "num_layers = " + std::to_string(num_layers) + " must be positive");
    TRIATTN_EXPECTS(num_q_heads > 0, "num_q_heads = " + std::to_string(num_q_heads) + " must be positive");
    TRIATTN_EXPECTS(num_kv_heads > 0, "num_kv_heads = " + std::to_string(num_kv_heads) + " must be positive");
    TRIATTN_EXPECTS(num_q_heads % num_kv_heads == 0,
                    "num_q_heads = " + std::to_string(num_q_heads) + " must be a multiple of num_kv_heads = " +
                        std::to_string(num_kv_heads) + " (GQA groups are whole)");
    TRIATTN_EXPECTS(head_dim > 0 && head_dim % 2 == 0,
                    "head_dim = " + std::to_string(head_dim) + " must be positive and even (RoPE pairs)");
  }
};

/// Everything needed to lay out the paged cache.
struct CacheConfig {
  ModelGeometry model;
  int block_size = 16;          ///< tokens per block
  int num_blocks = 0;           ///< blocks per (layer, K|V) range; one block id spans all ranges
  int max_seqs = 256;           ///< sequence slots (rows of the block table)
  int max_blocks_per_seq = 0;   ///< block-table row length; 0 means num_blocks
  KvLayout layout = KvLayout::kNHD;
  DType dtype = DType::kBF16;
  /// Keep each cached slot's original logical position per (layer, KV head), so compression
  /// reports can say which tokens every row kept (CompressionReport::kept). Off (the default),
  /// the cache's host state stays O(blocks) per sequence and rounds commit in O(batch + blocks
  /// freed); reports then carry lengths and status only.
  bool track_positions = false;
  /// fp8 caches only: dequantisation scales [num_layers, 2 (K, V), n] with n = 1 (per layer, like
  /// vLLM's k_scale / v_scale) or num_kv_heads (per (layer, KV head)); a stored code c means
  /// to_float(c) * scale and appending x stores quantize(x / scale). Empty: every scale is 1.
  std::vector<float> kv_scales;

  /// Scales per (layer, K|V) in kv_scales: 0 (none), 1 or num_kv_heads.
  [[nodiscard]] int kv_scale_heads() const noexcept {
    return kv_scales.empty() || model.num_layers <= 0 ? 0
                                                      : static_cast<int>(kv_scales.size() / (2 * static_cast<std::size_t>(model.num_layers)));
  }

  [[nodiscard]] int blocks_per_seq() const noexcept { return max_blocks_per_seq > 0 ? max_blocks_per_seq : num_blocks; }
  [[nodiscard]] BlockLayout block_layout() const noexcept {
    return BlockLayout{layout, block_size, model.num_kv_heads, model.head_dim};
  }
  /// Bytes of one block in one (layer, K|V) range.
  [[nodiscard]] std::int64_t block_bytes() const noexcept {
    return block_layout().block_elems() * static_cast<std::int64_t>(dtype_size(dtype));
  }
  /// Bytes one token occupies across all layers, K and V.
  [[nodiscard]] std::int64_t token_bytes() const noexcept {
    return 2LL * model.num_layers * model.num_kv_heads * model.head_dim * static_cast<std::int64_t>(dtype_size(dtype));
  }
  /// Bytes one block id owns across all layers, K and V.
  [[nodiscard]] std::int64_t block_bytes_all_ranges() const noexcept { return 2LL * model.num_layers * block_bytes(); }

  /// Bytes of the whole pool: num_blocks block ids across all layers, K and V.
  [[nodiscard]] std::int64_t pool_bytes() const noexcept { return block_bytes_all_ranges() * num_blocks; }

  void validate() const {
    model.validate();
    TRIATTN_EXPECTS(block_size > 0, "block_size = " + std::to_string(block_size) + " must be positive");
    TRIATTN_EXPECTS(num_blocks > 0, "num_blocks = " + std::to_string(num_blocks) + " must be positive");
    TRIATTN_EXPECTS(max_seqs > 0, "max_seqs = " + std::to_string(max_seqs) + " must be positive");
    TRIATTN_EXPECTS(max_blocks_per_seq >= 0 && max_blocks_per_seq <= num_blocks,
                    "max_blocks_per_seq = " + std::to_string(max_blocks_per_seq) +
                        " must be in [0, num_blocks = " + std::to_string(num_blocks) + "] (0 means num_blocks)");
    TRIATTN_EXPECTS(is_valid_dtype(dtype), "dtype = " + std::to_string(static_cast<int>(dtype)) +
                                               " is not one of float32, float16, bfloat16, fp8_e4m3");
    if (!kv_scales.empty()) {
      const std::size_t per_layer = kv_scales.size() / (2 * static_cast<std::size_t>(model.num_layers));
      TRIATTN_EXPECTS(dtype == DType::kFP8E4M3, std::string("kv_scales: dtype ") + dtype_name(dtype) +
                                                    " stores values unscaled (scales are for fp8_e4m3 only)");
      TRIATTN_EXPECTS(kv_scales.size() % (2 * static_cast<std::size_t>(model.num_layers)) == 0 &&
                          (per_layer == 1 || per_layer == static_cast<std::size_t>(model.num_kv_heads)),
                      "kv_scales holds " + std::to_string(kv_scales.size()) + " values; expected num_layers * 2 (" +
                          std::to_string(2 * model.num_layers) + ") or num_layers * 2 * num_kv_heads (" +
                          std::to_string(2 * model.num_layers * model.num_kv_heads) + ")");
      for (std::size_t i = 0; i < kv_scales.size(); ++i)
        TRIATTN_EXPECTS(std::isfinite(kv_scales[i]) && kv_scales[i] > 0.0f,
                        "kv_scales[" + std::to_string(i) + "] = " + std::to_string(kv_scales[i]) +
                            " must be finite and positive");
    }
    TRIATTN_EXPECTS(layout == KvLayout::kNHD || layout == KvLayout::kHND,
                    "layout = " + std::to_string(static_cast<int>(layout)) + " is not NHD (0) or HND (1)");
    // Kernels index tokens of one sequence with int32 and elements of one range with int64.
    TRIATTN_EXPECTS(static_cast<std::int64_t>(blocks_per_seq()) * block_size <= std::numeric_limits<std::int32_t>::max(),
                    "max_blocks_per_seq * block_size = " +
                        std::to_string(static_cast<std::int64_t>(blocks_per_seq()) * block_size) +
                        " tokens per sequence overflows int32 token indices");
    // Byte counts (range strides, the pool's size) are int64: the product must not wrap, or a
    // huge configuration would silently become a tiny allocation.
    std::int64_t bytes = static_cast<std::int64_t>(dtype_size(dtype));
    bool fits = true;
    for (const std::int64_t f : {std::int64_t{block_size}, std::int64_t{model.num_kv_heads}, std::int64_t{model.head_dim},
                                 std::int64_t{num_blocks}, std::int64_t{model.num_layers}, std::int64_t{2}}) {
      if (bytes > std::numeric_limits<std::int64_t>::max() / f) {
        fits = false;
        break;
      }
      bytes *= f;
    }
    TRIATTN_EXPECTS(fits, "cache size 2 * num_layers (" + std::to_string(model.num_layers) + ") * num_blocks (" +
                              std::to_string(num_blocks) + ") * block_size (" + std::to_string(block_size) +
                              ") * num_kv_heads (" + std::to_string(model.num_kv_heads) + ") * head_dim (" +
                              std::to_string(model.head_dim) + ") * " + std::to_string(dtype_size(dtype)) +
                              " bytes overflows 64-bit byte counts");
  }
};

/// "CacheConfig{num_layers 36, num_kv_heads 8, head_dim 128, block_size 16, num_blocks 4096,
/// max_seqs 8, dtype bf16} (N bytes)": names a configuration in error messages.
[[nodiscard]] inline std::string describe(const CacheConfig& c) {
  return "CacheConfig{num_layers " + std::to_string(c.model.num_layers) + ", num_kv_heads " +
         std::to_string(c.model.num_kv_heads) + ", head_dim " + std::to_string(c.model.head_dim) + ", block_size " +
         std::to_string(c.block_size) + ", num_blocks " + std::to_string(c.num_blocks) + ", max_seqs " +
         std::to_string(c.max_seqs) + ", dtype " + dtype_name(c.dtype) + "} (" + std::to_string(c.pool_bytes()) +
         " bytes)";
}

}  // namespace triattn

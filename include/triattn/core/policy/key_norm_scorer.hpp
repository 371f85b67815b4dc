// SPDX-License-Identifier: Apache-2.0
// Scorer policy "key norm" (KnormPress): keys with a low L2 norm attract more attention, so the
// selection keeps the lowest-norm keys: score = −‖k‖₂ per (layer, KV head, slot), replicated to
// the group's query heads. CPU path (reads keys through the view); the CUDA kernel is
// cuda/algorithms/key_norm.cuh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/baseline_scores.hpp>

namespace triattn {

/// KnormPress as a scorer: score[l, h, j] = −‖K[l, h / G, j]‖₂ (baseline::key_norm_scores, float
/// accumulation), G = Hq / Hkv. The GQA max of the selector then sees the same value for every
/// query head of a group.
class KeyNormScorer {
 public:
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  KeyNormScorer() = default;
  /// Remembers the query-head count so score() can check the output shape.
  explicit KeyNormScorer(const CacheConfig& cfg) : num_q_heads_(cfg.model.num_q_heads) {}

  /// @param out [num_layers, num_q_heads, length]
  /// @throws logic_error when out's size is not L * Hq * length (Hq a multiple of the KV heads).
  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) {
    (void)t0;
    const int hq = detail::scorer_num_q_heads(out.size(), view.num_layers, view.block.num_kv_heads, length,
                                              num_q_heads_, "KeyNormScorer");
    if (length == 0) return;
    const int hkv = view.block.num_kv_heads, d = view.block.head_dim, G = hq / hkv;
    const std::size_t n_tok = static_cast<std::size_t>(length);
    row_.resize(n_tok * static_cast<std::size_t>(d));
    norms_.resize(n_tok);
    for (int l = 0; l < view.num_layers; ++l)
      for (int g = 0; g < hkv; ++g) {
        dequantize_rows(view, l, KvKind::kKey, seq, g, length, row_.data());  // one (layer, KV head) row
        baseline::key_norm_scores(row_.data(), length, d, norms_.data());
        for (int h = g * G; h < (g + 1) * G; ++h) {
          float* o = out.data() + (static_cast<std::size_t>(l) * hq + h) * n_tok;
          for (std::size_t j = 0; j < n_tok; ++j) o[j] = norms_[j];
        }
      }
  }

 private:
  int num_q_heads_ = 0;      // 0: inferred from the output size
  std::vector<float> row_;   // [length, head_dim] scratch
  std::vector<float> norms_; // [length] scratch
};

}  // namespace triattn

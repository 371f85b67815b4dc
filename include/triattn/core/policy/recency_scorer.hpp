// SPDX-License-Identifier: Apache-2.0
// Scorer policy "recency" (StreamingLLM): a key's score is its slot index, so the selection keeps
// the newest slots; the attention-sink prefix is kept by SelectionParams::n_sink. It reads no
// cache memory, so it serves host and device caches alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/baseline_scores.hpp>

namespace triattn {

/// StreamingLLM as a scorer: score[l, h, j] = j − (length − 1) (baseline::recency_scores), the same
/// for every layer and head. Use it with TopKSelector and SelectionParams::n_sink > 0 (the
/// sinks); the rest of the budget goes to the newest tokens. z-normalisation (on or off) is an
/// increasing map, so the keep set is the same either way; every pruning mode gives the same
/// set too (all rows are equal).
class RecencyScorer {
 public:
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  static constexpr bool reads_cache = false;  ///< never dereferences the view's memory

  RecencyScorer() = default;
  /// Remembers the query-head count so score() can check the output shape.
  explicit RecencyScorer(const CacheConfig& cfg) : num_q_heads_(cfg.model.num_q_heads) {}

  /// @param out [num_layers, num_q_heads, length]
  /// @throws logic_error when out's size is not L * Hq * length (Hq a multiple of the KV heads).
  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) const {
    (void)seq;
    (void)t0;
    const int hq = detail::scorer_num_q_heads(out.size(), view.num_layers, view.block.num_kv_heads, length,
                                              num_q_heads_, "RecencyScorer");
    if (length == 0) return;
    const std::size_t rows = static_cast<std::size_t>(view.num_layers) * static_cast<std::size_t>(hq);
    for (std::size_t r = 0; r < rows; ++r)
      baseline::recency_scores(length, out.data() + r * static_cast<std::size_t>(length));
  }

 private:
  int num_q_heads_ = 0;  // 0: inferred from the output size
};

}  // namespace triattn

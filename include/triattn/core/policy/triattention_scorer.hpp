// SPDX-License-Identifier: Apache-2.0
// Scorer policy of the CPU path: TriAttention scores of every cached key of a sequence, from the
// key alone plus calibrated query statistics (score_sequence). Keys are read through the
// view and widened to float one (layer, KV head) row at a time.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/math/score_model.hpp>

namespace triattn {

class TriAttentionScorer {
 public:
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  /// @param stats  calibrated statistics of the query heads this cache serves
  /// @param rope   the model's RoPE (θ, scaling, pairing); must agree with the stats' pairing
  /// @param num_kv_heads KV heads of the cache
  TriAttentionScorer(const QueryStats& stats, const RopeConfig& rope, const ScoringParams& params, int num_kv_heads)
      : model_(stats, rope, params, num_kv_heads) {}

  [[nodiscard]] const TriAttentionModel& model() const noexcept { return model_; }

  /// Scores slots [0, length) of `seq` for round start t0 (its logical position).
  /// @param out [num_layers, num_q_heads, length]
  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) {
    check_cache_geometry(cache_geometry(view), {model_.num_layers(), model_.num_kv_heads(), model_.head_dim()},
                         "TriAttentionScorer", "the statistics");
    TRIATTN_EXPECTS(out.size() == static_cast<std::size_t>(model_.num_layers()) * model_.num_q_heads() * length,
                    "TriAttentionScorer: output holds " + std::to_string(out.size()) + " floats, expected L*Hq*length");
    const int d = view.block.head_dim;
    row_.resize(static_cast<std::size_t>(length) * d);
    int cur_l = -1, cur_g = -1;
    auto keys = [&](int l, int g, int j) -> const float* {
      if (l != cur_l || g != cur_g) {  // dequantise one (layer, KV head) row of keys to float
        dequantize_rows(view, l, KvKind::kKey, seq, g, length, row_.data());
        cur_l = l;
        cur_g = g;
      }
      return row_.data() + static_cast<std::size_t>(j) * d;
    };
    score_sequence(model_, static_cast<long long>(t0), keys, length, out.data());
  }

 private:
  TriAttentionModel model_;
  std::vector<float> row_;  // [length, head_dim] scratch
};

}  // namespace triattn

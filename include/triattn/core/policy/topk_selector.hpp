// SPDX-License-Identifier: Apache-2.0
// Selector policy: the spec's trigger (slack at budget + divide_length on decode steps) and
// selection (z-normalisation, GQA max, per_head / per_layer_per_head / union top-k with
// protected prompt, sinks and window) through selection::select_keep.
#pragma once

#include <span>
#include <string>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/selection.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/trigger.hpp>

namespace triattn {

class TopKSelector {
 public:
  using policy_role = selector_role;

  TopKSelector() = default;
  /// @throws logic_error naming the first invalid field of `params`.
  explicit TopKSelector(const SelectionParams& params) : params_(params) {}

  [[nodiscard]] const ValidSelectionParams& params() const noexcept { return params_; }

  /// Whether a sequence of physical length `length` (of which `prompt_len` prompt tokens)
  /// should be compressed now.
  [[nodiscard]] bool should_compress(int length, int prompt_len, bool is_decode_step) const {
    return CompressionTrigger::should_compress(CompressionTrigger::counted_length(length, prompt_len, params_),
                                               is_decode_step, params_);
  }

  /// Keep plan from raw scores [L, Hq, length]; the first `protected_prefix` slots (a shared
  /// prefix) are kept in place.
  [[nodiscard]] KeepPlan select(std::span<const float> scores, const ModelGeometry& g, int length, int prompt_len,
                                int protected_prefix = 0) const {
    TRIATTN_EXPECTS(scores.size() == static_cast<std::size_t>(g.num_layers) * g.num_q_heads * length,
                    "TopKSelector: scores hold " + std::to_string(scores.size()) + " values, expected L*Hq*length");
    return selection::select_keep(scores.data(), g.num_layers, g.num_q_heads, g.num_kv_heads, length, prompt_len,
                                  params_, protected_prefix);
  }

 private:
  ValidSelectionParams params_{};
};

}  // namespace triattn

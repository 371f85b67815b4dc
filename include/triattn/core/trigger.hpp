// SPDX-License-Identifier: Apache-2.0
// When a compression round happens (spec §5, "slack"): a sequence is compressed when its counted
// length reaches budget + divide_length, on decode steps only unless compress_during_prefill.
// The round keeps selection::keep_counts(...).keep slots, which brings the counted length back to
// exactly budget (more only when protected tokens alone exceed it), so the cache saw-tooths in
// [budget, budget + divide_length). Integer bookkeeping only: the rule itself (counted /
// fires) is TRIATTN_HOST_DEVICE so the device round applies the same one; the host entry points
// validate their inputs and throw.
#pragma once

#include <string>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn {

struct CompressionTrigger {
  /// counted_length without checks (kernels, or inputs already validated): prompt_len is clamped
  /// to [0, phys_len], which leaves a valid one unchanged.
  [[nodiscard]] static TRIATTN_HOST_DEVICE constexpr int counted(int phys_len, int prompt_len,
                                                                 PromptMode prompt) noexcept {
    prompt_len = prompt_len < 0 ? 0 : (prompt_len > phys_len ? phys_len : prompt_len);
    return prompt == PromptMode::kPinnedOnTop ? phys_len - prompt_len : phys_len;
  }

  /// should_compress without checks (kernels, or params already validated).
  [[nodiscard]] static TRIATTN_HOST_DEVICE constexpr bool fires(int counted_len, bool is_decode_step,
                                                                const SelectionParams& params) noexcept {
    if (!is_decode_step && !params.compress_during_prefill) return false;
    return counted_len >= threshold(params);
  }

  /// Length the budget is compared against: with PromptMode::kPinnedOnTop the pinned prompt
  /// does not count (phys_len − prompt_len); otherwise every cached slot counts (phys_len).
  /// @throws triattn::logic_error when prompt_len is outside [0, phys_len].
  [[nodiscard]] static int counted_length(int phys_len, int prompt_len, const SelectionParams& params) {
    TRIATTN_EXPECTS(prompt_len >= 0 && prompt_len <= phys_len,
                    "CompressionTrigger::counted_length: prompt_len = " + std::to_string(prompt_len) +
                        " must be in [0, phys_len = " + std::to_string(phys_len) + "]");
    return counted(phys_len, prompt_len, params.prompt);
  }

  /// Counted length at which a round fires: budget + divide_length.
  [[nodiscard]] static TRIATTN_HOST_DEVICE constexpr int threshold(const SelectionParams& params) noexcept {
    return params.budget + params.divide_length;
  }

  /// True when a round should run now: counted_len >= budget + divide_length, and this is a
  /// decode step (or compress_during_prefill is set).
  /// @throws triattn::logic_error on invalid params or a negative length.
  [[nodiscard]] static bool should_compress(int counted_len, bool is_decode_step, const ValidSelectionParams& params) {
    TRIATTN_EXPECTS(counted_len >= 0,
                    "CompressionTrigger::should_compress: counted_len must be >= 0, got " + std::to_string(counted_len));
    return fires(counted_len, is_decode_step, params);
  }
};

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// How a compression round splits a sequence into protected and selectable slots, and how many it
// keeps: one host/device definition (selection::keep_counts validates, then calls it; the device round
// calls it per sequence).
#pragma once

#include <triattn/core/config.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn {

/// How a round splits a sequence of `length` slots (pure integer bookkeeping, no scores).
struct KeepCounts {
  int length = 0;              ///< T, slots before the round
  int num_protected = 0;       ///< pinned prompt ∪ sinks ∪ protected prefix ∪ window
  int selectable_begin = 0;    ///< selectable slots are [selectable_begin, selectable_end)
  int selectable_end = 0;
  int quota = 0;               ///< selectable slots kept (when not identity)
  int keep = 0;                ///< slots after the round, the same for every (layer, KV head)
  bool identity = false;       ///< quota >= selectable: the round keeps everything
  bool prompt_over_budget = false;  ///< kPinnedInBudget and prompt_len >= budget
  [[nodiscard]] TRIATTN_HOST_DEVICE constexpr int num_selectable() const noexcept {
    return selectable_end - selectable_begin;
  }
};

/// Splits `length` slots into protected and selectable ones and derives the kept count:
///   begin = max(prompt_len if pinned else 0, min(n_sink, T), min(protected_prefix, T)),
///   end = max(begin, T − window),
///   protected = begin + (T − end),  total = budget (+ prompt_len with kPinnedOnTop),
///   quota = max(0, total − protected),  keep = identity ? T : protected + quota.
/// No validation: a negative length counts as 0 and prompt_len is clamped to [0, length].
/// Params: SelectionParams, or a struct with its budget, n_sink, window and prompt.
template <class Params = SelectionParams>
TRIATTN_HOST_DEVICE constexpr KeepCounts keep_counts_unchecked(int length, int prompt_len, const Params& p,
                                                                int protected_prefix = 0) noexcept {
  KeepCounts k;
  length = length > 0 ? length : 0;
  prompt_len = prompt_len < 0 ? 0 : (prompt_len > length ? length : prompt_len);
  k.length = length;
  const int pinned = p.prompt != PromptMode::kCompete ? prompt_len : 0;
  const int sinks = p.n_sink < length ? p.n_sink : length;
  const int shared = protected_prefix < length ? (protected_prefix > 0 ? protected_prefix : 0) : length;
  k.selectable_begin = pinned > sinks ? pinned : sinks;
  k.selectable_begin = shared > k.selectable_begin ? shared : k.selectable_begin;
  const long long tail = static_cast<long long>(length) - p.window;  // may be negative
  k.selectable_end = static_cast<int>(tail > k.selectable_begin ? tail : k.selectable_begin);
  k.num_protected = k.selectable_begin + (length - k.selectable_end);
  const long long total = static_cast<long long>(p.budget) + (p.prompt == PromptMode::kPinnedOnTop ? prompt_len : 0);
  const long long quota = total - k.num_protected;
  k.quota = static_cast<int>(quota > 0 ? quota : 0);
  k.identity = k.quota >= k.num_selectable();
  if (k.identity) k.quota = k.num_selectable();
  k.keep = k.identity ? length : k.num_protected + k.quota;
  k.prompt_over_budget = p.prompt == PromptMode::kPinnedInBudget && prompt_len >= p.budget;
  return k;
}

}  // namespace triattn

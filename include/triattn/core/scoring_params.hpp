// SPDX-License-Identifier: Apache-2.0
// Parameters of TriAttention scoring (how a key is scored) and selection (which keys survive a
// compression round, and when a round happens). Plain data with validate() methods; the math
// lives in core/ref/score.hpp, core/ref/select.hpp and core/trigger.hpp.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <triattn/core/error.hpp>

namespace triattn {

/// How the per-offset combined scores comb(δ) of one key are reduced over the offsets δ ∈ D.
enum class Aggregation : int {
  kMean = 0,  ///< mean over δ (default; folds exactly into one weight per frequency)
  kMax = 1,   ///< max over δ (no fold: |D| dot products per key)
};

/// What one selection round chooses (spec §4 table).
enum class PruningMode : int {
  kPerHead = 0,          ///< per KV head: mean over layers of the GQA-group max; same set per layer
  kPerLayerPerHead = 1,  ///< per layer and KV head: GQA-group max
  kUnion = 2,            ///< union of per-(layer, query head) top sets; one set for everything
};

/// What a round does with a sequence whose scores in the selectable range are not all finite
/// (NaN or ±Inf: a NaN key, or finite keys whose scores overflow).
enum class NonFinitePolicy : int {
  kRefuse = 0,      ///< leave the sequence unchanged and report it (RoundStatus::kNonFinite; selection::select_keep throws)
  kEvictFirst = 1,  ///< a token with a non-finite score in any row ranks below every finite one in every
                    ///< row (after normalising over the finite tokens): it goes first, the round proceeds
};

/// How prompt tokens take part in selection (spec §5).
enum class PromptMode : int {
  kPinnedInBudget = 0,  ///< prompt never evicted and counted inside the budget (paper setting)
  kPinnedOnTop = 1,     ///< prompt never evicted and not counted: the cache holds budget + prompt
  kCompete = 2,         ///< prompt tokens are scored and evicted like decode tokens
};

[[nodiscard]] inline const char* to_string(Aggregation a) noexcept {
  switch (a) {
    case Aggregation::kMean: return "mean";
    case Aggregation::kMax: return "max";
  }
  return "<invalid Aggregation>";
}
[[nodiscard]] inline const char* to_string(PruningMode m) noexcept {
  switch (m) {
    case PruningMode::kPerHead: return "per_head";
    case PruningMode::kPerLayerPerHead: return "per_layer_per_head";
    case PruningMode::kUnion: return "union";
  }
  return "<invalid PruningMode>";
}
[[nodiscard]] inline const char* to_string(NonFinitePolicy p) noexcept {
  switch (p) {
    case NonFinitePolicy::kRefuse: return "refuse";
    case NonFinitePolicy::kEvictFirst: return "evict_first";
  }
  return "<invalid NonFinitePolicy>";
}
[[nodiscard]] inline const char* to_string(PromptMode m) noexcept {
  switch (m) {
    case PromptMode::kPinnedInBudget: return "pinned_in_budget";
    case PromptMode::kPinnedOnTop: return "pinned_on_top";
    case PromptMode::kCompete: return "compete";
  }
  return "<invalid PromptMode>";
}
/// The PromptMode that to_string() names `name`.
/// @throws triattn::logic_error naming `what` and the three names otherwise.
[[nodiscard]] inline PromptMode prompt_mode_from_string(std::string_view name, std::string_view what = "prompt mode") {
  for (PromptMode m : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete})
    if (name == to_string(m)) return m;
  throw logic_error(std::string(what) + ": '" + std::string(name) + "' is not pinned_in_budget, pinned_on_top or compete");
}

/// How a cached key is scored (spec §3).
struct ScoringParams {
  int offset_max_length = 65536;           ///< M: offsets D = {1, 2, 4, ..., 2^floor(log2 M)}
  Aggregation aggregation = Aggregation::kMean;
  bool disable_mlr = false;                ///< extra term uses s²·A_f instead of s²·(A_f − |q̄_f|)
  bool disable_trig = false;               ///< drop the trigonometric term: comb(δ) = extra

  /// @throws triattn::logic_error naming the first bad value.
  void validate() const {
    TRIATTN_EXPECTS(offset_max_length >= 1,
                    "ScoringParams::offset_max_length must be >= 1, got " + std::to_string(offset_max_length));
    TRIATTN_EXPECTS(aggregation == Aggregation::kMean || aggregation == Aggregation::kMax,
                    "ScoringParams::aggregation has invalid value " + std::to_string(static_cast<int>(aggregation)));
  }
};

/// Which keys a compression round keeps and when rounds happen (spec §4, §5).
struct SelectionParams {
  int budget = 2048;                       ///< B: cached tokens kept per round (see PromptMode)
  int divide_length = 128;                 ///< slack: compress when counted length >= B + divide_length
  PruningMode mode = PruningMode::kPerHead;
  bool normalize = true;                   ///< z-normalise scores per (layer, query head)
  PromptMode prompt = PromptMode::kPinnedInBudget;
  int n_sink = 0;                          ///< attention-sink prefix that is never evicted
  int window = 0;                          ///< newest tokens that are never evicted
  bool compress_during_prefill = false;    ///< allow a round on a non-decode step
  NonFinitePolicy nonfinite = NonFinitePolicy::kRefuse;  ///< scores that are NaN/±Inf (see NonFinitePolicy)

  [[nodiscard]] bool prompt_pinned() const noexcept { return prompt != PromptMode::kCompete; }

  /// @throws triattn::logic_error naming the first bad value.
  void validate() const {
    TRIATTN_EXPECTS(budget >= 1, "SelectionParams::budget must be >= 1, got " + std::to_string(budget));
    TRIATTN_EXPECTS(divide_length >= 1,
                    "SelectionParams::divide_length must be >= 1, got " + std::to_string(divide_length));
    TRIATTN_EXPECTS(n_sink >= 0, "SelectionParams::n_sink must be >= 0, got " + std::to_string(n_sink));
    TRIATTN_EXPECTS(window >= 0, "SelectionParams::window must be >= 0, got " + std::to_string(window));
    TRIATTN_EXPECTS(mode == PruningMode::kPerHead || mode == PruningMode::kPerLayerPerHead || mode == PruningMode::kUnion,
                    "SelectionParams::mode has invalid value " + std::to_string(static_cast<int>(mode)));
    TRIATTN_EXPECTS(prompt == PromptMode::kPinnedInBudget || prompt == PromptMode::kPinnedOnTop ||
                        prompt == PromptMode::kCompete,
                    "SelectionParams::prompt has invalid value " + std::to_string(static_cast<int>(prompt)));
    TRIATTN_EXPECTS(nonfinite == NonFinitePolicy::kRefuse || nonfinite == NonFinitePolicy::kEvictFirst,
                    "SelectionParams::nonfinite has invalid value " + std::to_string(static_cast<int>(nonfinite)));
    // Sinks and window are never evicted: more of them than the budget would keep more than the
    // budget after every round, and every step would fire a round.
    TRIATTN_EXPECTS(static_cast<long long>(n_sink) + window <= budget,
                    "SelectionParams: n_sink (" + std::to_string(n_sink) + ") + window (" + std::to_string(window) +
                        ") = " + std::to_string(static_cast<long long>(n_sink) + window) + " exceeds budget = " +
                        std::to_string(budget) + " (protected tokens alone would exceed the budget)");
    // B + divide_length is compared against int lengths; keep it representable.
    TRIATTN_EXPECTS(static_cast<long long>(budget) + divide_length <= 0x7fffffffLL,
                    "SelectionParams: budget + divide_length = " +
                        std::to_string(static_cast<long long>(budget) + divide_length) + " overflows int");
  }
};

/// SelectionParams validated once: every way of making one runs validate() (logic_error naming the
/// field), so functions taking one do not check again. It converts implicitly from SelectionParams,
/// so a call with plain params validates them once, at that conversion; objects holding selection
/// parameters (TopKSelector, TensorParallelTopKSelector) hold one, validated at their construction.
class ValidSelectionParams : public SelectionParams {
 public:
  ValidSelectionParams() : ValidSelectionParams(SelectionParams{}) {}
  ValidSelectionParams(const SelectionParams& params) : SelectionParams(params) { validate(); }  // NOLINT: implicit
};

/// The future offsets D = {1, 2, 4, ..., 2^floor(log2 M)} as doubles (|D| = floor(log2 M) + 1).
/// @throws triattn::logic_error when offset_max_length < 1.
[[nodiscard]] inline std::vector<double> geometric_offsets(int offset_max_length) {
  TRIATTN_EXPECTS(offset_max_length >= 1,
                  "geometric_offsets: offset_max_length must be >= 1, got " + std::to_string(offset_max_length));
  std::vector<double> d;
  for (long long v = 1; v <= offset_max_length; v *= 2) d.push_back(static_cast<double>(v));
  return d;
}

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// Metric arithmetic of the fidelity harness (examples/fidelity): pure functions on host arrays,
// with no model in sight, so tests/core/test_fidelity_harness.cpp can check them directly.
//
//   PositionTracker    original token position held by every physical slot, per (layer, KV head),
//                      through appends and KeepPlans (compaction moves kept slots to the front)
//   attention_recall   share of a full-KV attention distribution that falls on the tokens a
//                      compressed cache still holds, averaged over layers and query heads
//   kl_divergence      KL(softmax(p) || softmax(q)) of two logit vectors, in nats, float64
//   recency_overlap    share of a keep plan's slots that StreamingLLM would keep too
//   greedy_agreement   position-wise agreement of two token streams from an index on, and the
//                      first index where they differ
//   mean / median / standard_error  of a list of doubles
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>

namespace triattn_fidelity {

/// Which original (logical) token position each physical slot of one sequence holds, per
/// (layer, KV head). Appends add the same positions to every row; a KeepPlan keeps, per row, the
/// slots it lists in their order (what KvCache::apply_keep_plan does to the K/V themselves).
class PositionTracker {
 public:
  PositionTracker(int num_layers, int num_kv_heads) : layers_(num_layers), heads_(num_kv_heads) {
    TRIATTN_EXPECTS(num_layers > 0 && num_kv_heads > 0, "PositionTracker: layers and kv heads must be positive");
    rows_.resize(static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_kv_heads));
  }

  [[nodiscard]] int num_layers() const noexcept { return layers_; }
  [[nodiscard]] int num_kv_heads() const noexcept { return heads_; }
  /// Physical length (the same in every row).
  [[nodiscard]] int length() const noexcept { return static_cast<int>(rows_.front().size()); }

  /// Appends positions first, first + 1, ..., first + n − 1 to every row.
  void append(std::int64_t first, int n) {
    TRIATTN_EXPECTS(n >= 0 && first >= 0, "PositionTracker::append: bad range");
    for (auto& r : rows_)
      for (int i = 0; i < n; ++i) r.push_back(first + i);
  }

  /// Applies a keep plan: row (l, g) becomes old_row[plan.row(l, g)[i]] for i < keep.
  /// @throws triattn::logic_error when the plan does not fit (shape, indices, order).
  void apply(const triattn::KeepPlan& plan) {
    plan.validate(layers_, heads_, length());
    std::vector<std::int64_t> next(static_cast<std::size_t>(plan.keep));
    for (int l = 0; l < layers_; ++l)
      for (int g = 0; g < heads_; ++g) {
        std::vector<std::int64_t>& r = rows_[index(l, g)];
        const std::int32_t* keep = plan.row(l, g);
        for (int i = 0; i < plan.keep; ++i) next[static_cast<std::size_t>(i)] = r[static_cast<std::size_t>(keep[i])];
        r = next;
      }
  }

  /// Original positions of the slots of (layer, KV head), in slot order (ascending).
  [[nodiscard]] std::span<const std::int64_t> row(int layer, int kv_head) const { return rows_[index(layer, kv_head)]; }

 private:
  [[nodiscard]] std::size_t index(int l, int g) const {
    TRIATTN_EXPECTS(l >= 0 && l < layers_ && g >= 0 && g < heads_, "PositionTracker: (layer, kv head) out of range");
    return static_cast<std::size_t>(l) * static_cast<std::size_t>(heads_) + static_cast<std::size_t>(g);
  }

  int layers_;
  int heads_;
  std::vector<std::vector<std::int64_t>> rows_;  // [L * Hkv][length]
};

/// How recency-like a keep plan is: the share of kept slots, over all (layer, KV head) rows,
/// that StreamingLLM would also keep on the same cache, i.e. slots in the pinned prefix
/// [0, pinned) or among the newest keep − pinned slots of the `length` slots before the round.
/// 1 for recency itself; for uniform random picks of the unpinned part its expectation is
/// (pinned + q² / (length − pinned)) / keep with q = keep − pinned.
[[nodiscard]] inline double recency_overlap(const triattn::KeepPlan& plan, int length, int pinned) {
  TRIATTN_EXPECTS(pinned >= 0 && pinned <= plan.keep && plan.keep <= length, "recency_overlap: bad counts");
  const std::size_t rows = static_cast<std::size_t>(plan.num_layers) * static_cast<std::size_t>(plan.num_kv_heads);
  if (rows == 0 || plan.keep == 0) return 1.0;
  const int newest_from = length - (plan.keep - pinned);
  std::size_t hits = 0;
  for (int l = 0; l < plan.num_layers; ++l)
    for (int g = 0; g < plan.num_kv_heads; ++g)
      for (int i = 0; i < plan.keep; ++i) {
        const std::int32_t j = plan.row(l, g)[i];
        if (j < pinned || j >= newest_from) ++hits;
      }
  return static_cast<double>(hits) / (static_cast<double>(rows) * plan.keep);
}

/// Σ probs[p] over the given positions, in float64. Positions must lie in [0, probs.size()),
/// except with `causal`, where positions past the end (later rows of the same chunk, which the
/// query cannot see) carry no mass.
[[nodiscard]] inline double mass_on(std::span<const float> probs, std::span<const std::int64_t> positions,
                                    bool causal = false) {
  double s = 0.0;
  for (std::int64_t p : positions) {
    if (causal && p >= static_cast<std::int64_t>(probs.size())) continue;
    TRIATTN_EXPECTS(p >= 0 && static_cast<std::size_t>(p) < probs.size(),
                    "mass_on: position " + std::to_string(p) + " outside the distribution's " +
                        std::to_string(probs.size()) + " entries");
    s += probs[static_cast<std::size_t>(p)];
  }
  return s;
}

/// Attention recall of one query: for every layer l and query head h, the full-KV attention
/// probabilities probs[l, h, 0..T) over token positions, summed over the positions that the
/// compressed cache holds for (l, KV head h / G); the mean over all (l, h). `causal`: held
/// positions >= T (later rows of a chunk fed together, document.hpp) are skipped, not refused.
/// @param probs [L, Hq, T] full-KV softmax probabilities of one query row
[[nodiscard]] inline double attention_recall(std::span<const float> probs, int num_q_heads, int T,
                                             const PositionTracker& held, bool causal = false) {
  const int L = held.num_layers(), Hkv = held.num_kv_heads();
  TRIATTN_EXPECTS(num_q_heads > 0 && num_q_heads % Hkv == 0, "attention_recall: q heads must be a multiple of kv heads");
  TRIATTN_EXPECTS(T > 0 && probs.size() == static_cast<std::size_t>(L) * num_q_heads * T,
                  "attention_recall: probs must hold L * Hq * T values");
  const int G = num_q_heads / Hkv;
  double s = 0.0;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < num_q_heads; ++h)
      s += mass_on(probs.subspan((static_cast<std::size_t>(l) * num_q_heads + h) * static_cast<std::size_t>(T),
                                 static_cast<std::size_t>(T)),
                   held.row(l, h / G), causal);
  return s / (static_cast<double>(L) * num_q_heads);
}

/// log-softmax of a logit vector in float64.
[[nodiscard]] inline std::vector<double> log_softmax(std::span<const float> logits) {
  TRIATTN_EXPECTS(!logits.empty(), "log_softmax: empty logits");
  double mx = logits[0];
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double lse = mx + std::log(sum);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
  return out;
}

/// KL(P || Q) in nats, P = softmax(p_logits) (the reference), Q = softmax(q_logits). Never
/// negative (rounding is clamped to 0).
[[nodiscard]] inline double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  TRIATTN_EXPECTS(p_logits.size() == q_logits.size(), "kl_divergence: vocabularies differ");
  const std::vector<double> lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0.0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(kl, 0.0);
}

/// Position-wise agreement of `test` with `ref` (same length n) over indices [from, n), and the
/// first index (over all of [0, n)) where they differ; n when they never do.
struct Agreement {
  int matches = 0;           ///< indices in [from, n) with equal tokens
  int counted = 0;           ///< n − from (0 when from >= n)
  int first_divergence = 0;  ///< first i with ref[i] != test[i], or n
  [[nodiscard]] bool diverged(int n) const noexcept { return first_divergence < n; }
  [[nodiscard]] double fraction() const noexcept { return counted > 0 ? static_cast<double>(matches) / counted : 1.0; }
};

[[nodiscard]] inline Agreement greedy_agreement(std::span<const int> ref, std::span<const int> test, int from) {
  TRIATTN_EXPECTS(ref.size() == test.size(), "greedy_agreement: token streams of different lengths");
  TRIATTN_EXPECTS(from >= 0, "greedy_agreement: from must be >= 0");
  const int n = static_cast<int>(ref.size());
  Agreement a;
  a.first_divergence = n;
  for (int i = 0; i < n; ++i) {
    const bool same = ref[static_cast<std::size_t>(i)] == test[static_cast<std::size_t>(i)];
    if (!same && a.first_divergence == n) a.first_divergence = i;
    if (i >= from) {
      ++a.counted;
      if (same) ++a.matches;
    }
  }
  return a;
}

[[nodiscard]] inline double mean(std::span<const double> x) {
  if (x.empty()) return std::nan("");
  double s = 0.0;
  for (double v : x) s += v;
  return s / static_cast<double>(x.size());
}

/// Standard error of the mean, sample standard deviation / sqrt(n); NaN for fewer than 2 values.
[[nodiscard]] inline double standard_error(std::span<const double> x) {
  if (x.size() < 2) return std::nan("");
  const double m = mean(x);
  double ss = 0.0;
  for (double v : x) ss += (v - m) * (v - m);
  return std::sqrt(ss / static_cast<double>(x.size() - 1) / static_cast<double>(x.size()));
}

/// Median (mean of the two middle values for an even count); NaN for an empty list.
[[nodiscard]] inline double median(std::span<const double> x) {
  if (x.empty()) return std::nan("");
  std::vector<double> v(x.begin(), x.end());
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace triattn_fidelity

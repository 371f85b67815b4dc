// SPDX-License-Identifier: Apache-2.0
// Host TriAttention selection (spec §4, §5): from per-(layer, query head) key scores to a
// KeepPlan; what host rounds and selectors run, and the oracle the GPU selection kernels are
// checked against (tests name it ref::, core/ref/select.hpp). The steps are separate functions
// (z-normalisation, GQA max, mean over layers, top-k with ties) so that each can be checked. Protected tokens
// (pinned prompt, attention sinks, recent window) are always kept and never compete; the
// selectable tokens always form one contiguous slot range [begin, end).
// Also holds the library's warning hook (set_warning_handler).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/keep_counts.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn {

/// Receives triattn's warnings (one line of text each, no trailing newline).
using WarningHandler = std::function<void(std::string_view)>;

namespace detail {
/// Warnings that are reported once per installed handler.
enum class WarningId : int { kPromptOverBudget = 0, kCount };

struct WarningState {
  std::mutex mutex;
  WarningHandler handler;  // empty = default (stderr)
  bool fired[static_cast<int>(WarningId::kCount)] = {};
};
inline WarningState& warning_state() {
  static WarningState state;  // one per program (inline function: one instance across TUs)
  return state;
}

/// Reports `message` through the installed handler the first time `id` happens since the
/// handler was installed; later occurrences are dropped.
inline void warn_once(WarningId id, std::string_view message) {
  WarningState& s = warning_state();
  WarningHandler h;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    bool& fired = s.fired[static_cast<int>(id)];
    if (fired) return;
    fired = true;
    h = s.handler;
  }
  if (h) {
    h(message);
  } else {
    std::fprintf(stderr, "triattn warning: %.*s\n", static_cast<int>(message.size()), message.data());
  }
}
}  // namespace detail

/// Installs the handler that receives triattn's warnings and returns the previous one. An empty
/// handler restores the default (print to stderr). Installing a handler re-arms the one-time
/// warnings, so the new handler sees each of them once.
inline WarningHandler set_warning_handler(WarningHandler handler) {
  detail::WarningState& s = detail::warning_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  WarningHandler previous = std::move(s.handler);
  s.handler = std::move(handler);
  for (bool& f : s.fired) f = false;
  return previous;
}

namespace selection {

using triattn::KeepCounts;

/// keep_counts_unchecked (core/keep_counts.hpp) after validating its inputs. `protected_prefix`
/// is a sequence's shared prefix (KvCache::shared_prefix): kept in place like the pinned prompt,
/// counted in the budget as any kept slot (on top of it only as part of the prompt under kPinnedOnTop).
/// @throws triattn::logic_error on invalid params, prompt_len outside [0, length] or a negative
/// protected_prefix.
[[nodiscard]] inline KeepCounts keep_counts(int length, int prompt_len, const ValidSelectionParams& p,
                                            int protected_prefix = 0) {
  TRIATTN_EXPECTS(length >= 0, "keep_counts: length must be >= 0, got " + std::to_string(length));
  TRIATTN_EXPECTS(prompt_len >= 0 && prompt_len <= length,
                  "keep_counts: prompt_len = " + std::to_string(prompt_len) + " must be in [0, length = " +
                      std::to_string(length) + "]");
  TRIATTN_EXPECTS(protected_prefix >= 0,
                  "keep_counts: protected_prefix must be >= 0, got " + std::to_string(protected_prefix));
  return keep_counts_unchecked(length, prompt_len, p, protected_prefix);
}

/// Z-normalises every row over the slot range [begin, end): x ← (x − mean) / max(std, 1e-6),
/// population std, mean and variance accumulated in float64; slots outside the range are left
/// unchanged. With `nonfinite_lowest` (NonFinitePolicy::kEvictFirst), NaN/±Inf values take no part
/// in the mean and std and become the lowest float (they rank below every finite value); rows with
/// only finite values come out exactly as without it.
/// @param scores [rows, T] in place
/// @throws triattn::logic_error on a bad range, or a non-finite value inside the range unless
///         nonfinite_lowest.
inline void normalize_scores(float* scores, int rows, int T, int begin, int end, bool nonfinite_lowest = false) {
  TRIATTN_EXPECTS(rows >= 0 && T >= 0 && begin >= 0 && begin <= end && end <= T,
                  "normalize_scores: bad shape/range (rows " + std::to_string(rows) + ", T " + std::to_string(T) +
                      ", range [" + std::to_string(begin) + ", " + std::to_string(end) + "))");
  if (end == begin) return;
  for (int r = 0; r < rows; ++r) {
    float* x = scores + static_cast<std::size_t>(r) * T;
    double sum = 0.0;
    int n = 0;
    for (int j = begin; j < end; ++j) {
      if (!std::isfinite(x[j])) {
        TRIATTN_EXPECTS(nonfinite_lowest, "normalize_scores: row " + std::to_string(r) + ", slot " +
                                              std::to_string(j) + " is not finite");
        continue;
      }
      sum += x[j];
      ++n;
    }
    if (n == 0) {  // nothing finite: every value is the lowest
      std::fill(x + begin, x + end, std::numeric_limits<float>::lowest());
      continue;
    }
    const double mean = sum / n;
    double ss = 0.0;
    for (int j = begin; j < end; ++j)
      if (std::isfinite(x[j])) ss += (x[j] - mean) * (x[j] - mean);
    const double sd = std::max(std::sqrt(ss / n), 1e-6);
    for (int j = begin; j < end; ++j)
      x[j] = std::isfinite(x[j]) ? static_cast<float>((x[j] - mean) / sd) : std::numeric_limits<float>::lowest();
  }
}

/// True when every score of the `rows` rows [rows, kc.length] is finite over the selectable range.
[[nodiscard]] inline bool selectable_scores_finite(const float* scores, std::size_t rows, const KeepCounts& kc) {
  const std::size_t T = static_cast<std::size_t>(kc.length);
  for (std::size_t r = 0; r < rows; ++r)
    for (int j = kc.selectable_begin; j < kc.selectable_end; ++j)
      if (!std::isfinite(scores[r * T + j])) return false;
  return true;
}

/// GQA reduction: out[l, g, j] = max over the query heads h of KV head g (h / (Hq/Hkv) == g) of
/// in[l, h, j].
/// @param in  [L, Hq, T]
/// @param out [L, Hkv, T]
inline void reduce_gqa_max(const float* in, int L, int Hq, int Hkv, int T, float* out) {
  TRIATTN_EXPECTS(L >= 0 && T >= 0 && Hkv > 0 && Hq > 0 && Hq % Hkv == 0,
                  "reduce_gqa_max: num_q_heads = " + std::to_string(Hq) + " must be a multiple of num_kv_heads = " +
                      std::to_string(Hkv) + " (both > 0)");
  const int G = Hq / Hkv;
  for (int l = 0; l < L; ++l)
    for (int g = 0; g < Hkv; ++g) {
      float* o = out + (static_cast<std::size_t>(l) * Hkv + g) * T;
      const float* first = in + (static_cast<std::size_t>(l) * Hq + g * G) * T;
      std::copy(first, first + T, o);
      for (int h = 1; h < G; ++h) {
        const float* x = first + static_cast<std::size_t>(h) * T;
        for (int j = 0; j < T; ++j) o[j] = std::max(o[j], x[j]);
      }
    }
}

/// out[h, j] = mean over layers of in[l, h, j], summed in float64 in layer order, then rounded.
/// @param in  [L, H, T]
/// @param out [H, T]
inline void mean_over_layers(const float* in, int L, int H, int T, float* out) {
  TRIATTN_EXPECTS(L > 0 && H >= 0 && T >= 0, "mean_over_layers: bad shape (L " + std::to_string(L) + ", H " +
                                                 std::to_string(H) + ", T " + std::to_string(T) + ")");
  const std::size_t plane = static_cast<std::size_t>(H) * T;
  for (std::size_t i = 0; i < plane; ++i) {
    double s = 0.0;
    for (int l = 0; l < L; ++l) s += in[static_cast<std::size_t>(l) * plane + i];
    out[i] = static_cast<float>(s / L);
  }
}

/// Indices of the k largest values, ordered by (value descending, index ascending) so ties go to
/// the lower index; returned in ascending index order.
/// @param values [n], all finite (NaN has no place in a strict order)
/// @throws triattn::logic_error when k is outside [0, n] or a value is not finite.
[[nodiscard]] inline std::vector<std::int32_t> top_k_with_ties(const float* values, int n, int k) {
  TRIATTN_EXPECTS(n >= 0 && k >= 0 && k <= n,
                  "top_k_with_ties: k = " + std::to_string(k) + " must be in [0, n = " + std::to_string(n) + "]");
  for (int i = 0; i < n; ++i)
    TRIATTN_EXPECTS(std::isfinite(values[i]), "top_k_with_ties: value " + std::to_string(i) + " is not finite");
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) idx[i] = i;
  const auto before = [values](std::int32_t a, std::int32_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

namespace detail {
// Fills every (layer, KV head) row of `plan` with [0, begin) ∪ chosen ∪ [end, T).
inline void write_row(std::int32_t* row, const KeepCounts& kc, const std::vector<std::int32_t>& chosen) {
  int i = 0;
  for (int j = 0; j < kc.selectable_begin; ++j) row[i++] = j;
  for (std::int32_t j : chosen) row[i++] = j;
  for (int j = kc.selectable_end; j < kc.length; ++j) row[i++] = j;
}

// Writes the same row into every (layer, KV head) of `plan`.
inline void write_all_rows(KeepPlan& plan, const KeepCounts& kc, const std::vector<std::int32_t>& chosen) {
  for (int l = 0; l < plan.num_layers; ++l)
    for (int g = 0; g < plan.num_kv_heads; ++g) write_row(plan.row(l, g), kc, chosen);
}

// select_keep's checks and bookkeeping before any score is combined: shapes, params, the
// one-time prompt-over-budget warning, finite scores in the selectable range.
inline KeepCounts prepare_selection(const float* scores, int L, int Hq, int Hkv, int T, int prompt_len,
                                    const ValidSelectionParams& params, int protected_prefix = 0) {
  TRIATTN_EXPECTS(L > 0 && Hq > 0 && Hkv > 0 && Hq % Hkv == 0,
                  "select_keep: need layers > 0 and num_q_heads (" + std::to_string(Hq) +
                      ") a positive multiple of num_kv_heads (" + std::to_string(Hkv) + "), layers = " +
                      std::to_string(L));
  TRIATTN_EXPECTS(T >= 0, "select_keep: length must be >= 0, got " + std::to_string(T));
  TRIATTN_EXPECTS(T == 0 || scores != nullptr, "select_keep: scores is null");
  const KeepCounts kc = keep_counts(T, prompt_len, params, protected_prefix);
  if (kc.prompt_over_budget) {
    triattn::detail::warn_once(
        triattn::detail::WarningId::kPromptOverBudget,
        "pinned prompt (" + std::to_string(prompt_len) + " tokens) is not shorter than the budget (" +
            std::to_string(params.budget) +
            ") that counts it (PromptMode::kPinnedInBudget): the whole prompt is kept and no decode token "
            "survives a round beyond sinks/window; consider PromptMode::kPinnedOnTop");
  }
  const std::size_t rows = static_cast<std::size_t>(L) * Hq;
  if (params.nonfinite == NonFinitePolicy::kEvictFirst) return kc;  // selection_values ranks them lowest
  for (std::size_t r = 0; r < rows; ++r)
    for (int j = kc.selectable_begin; j < kc.selectable_end; ++j)
      TRIATTN_EXPECTS(std::isfinite(scores[r * T + j]),
                      "select_keep: score (layer " + std::to_string(r / Hq) + ", q head " + std::to_string(r % Hq) +
                          ", slot " + std::to_string(j) + ") is not finite");
  return kc;
}

// Ŝ: a copy of the scores, z-normalised per row over the selectable range when asked. With
// NonFinitePolicy::kEvictFirst, a slot with a non-finite score in any row is a broken token: it
// takes no part in any row's mean and std and becomes the lowest float in every row, so it ranks
// below every finite value in every mode (union included); rows of finite slots are unchanged.
inline std::vector<float> selection_values(const float* scores, std::size_t rows, const KeepCounts& kc,
                                           const ValidSelectionParams& params) {
  const std::size_t T = static_cast<std::size_t>(kc.length);
  std::vector<float> s(scores, scores + rows * T);  // [rows, T]
  const bool evict_first = params.nonfinite == NonFinitePolicy::kEvictFirst;
  if (evict_first) {
    for (int j = kc.selectable_begin; j < kc.selectable_end; ++j) {
      bool broken = false;
      for (std::size_t r = 0; r < rows && !broken; ++r) broken = !std::isfinite(s[r * T + j]);
      if (!broken) continue;
      for (std::size_t r = 0; r < rows; ++r) s[r * T + j] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  if (params.normalize) {
    normalize_scores(s.data(), static_cast<int>(rows), kc.length, kc.selectable_begin, kc.selectable_end, evict_first);
  } else if (evict_first) {
    for (std::size_t r = 0; r < rows; ++r)
      for (int j = kc.selectable_begin; j < kc.selectable_end; ++j)
        if (std::isnan(s[r * T + j])) s[r * T + j] = std::numeric_limits<float>::lowest();
  }
  return s;
}
}  // namespace detail

/// Union mode, the part each set of rows can do alone. For selectable slot j (relative to
/// kc.selectable_begin): flags[j] = 1 when j is among the top-quota of at least one of the rows,
/// vmax[j] = max over the rows of Ŝ. The element-wise max of flags and of vmax over disjoint sets
/// of rows equals the result on their union (max is exact and order-free), which is how
/// tensor-parallel ranks agree (tp::select_keep).
/// @param s_hat [rows, T] normalised scores Ŝ, T = kc.length; only the selectable range is read
/// @param flags [n] output, n = kc.num_selectable()
/// @param vmax  [n] output
/// @throws logic_error when rows < 1 or the round keeps everything (kc.identity).
inline void union_candidates(const float* s_hat, std::size_t rows, const KeepCounts& kc, std::uint8_t* flags,
                             float* vmax) {
  TRIATTN_EXPECTS(rows >= 1 && !kc.identity,
                  "union_candidates: needs at least one row and a round that does not keep everything (rows " +
                      std::to_string(rows) + ")");
  const int n = kc.num_selectable();
  const std::size_t T = static_cast<std::size_t>(kc.length);
  std::fill(flags, flags + n, std::uint8_t{0});
  std::copy(s_hat + kc.selectable_begin, s_hat + kc.selectable_end, vmax);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* x = s_hat + r * T + kc.selectable_begin;
    for (std::int32_t j : top_k_with_ties(x, n, kc.quota)) flags[j] = 1;
    for (int j = 0; j < n; ++j) vmax[j] = std::max(vmax[j], x[j]);
  }
}

/// Union mode, the part that needs every row: the top-quota of U = {j : flags[j]} by vmax (ties to
/// the lower slot); when |U| < quota, U is kept whole and the rest is filled from outside U by vmax.
/// @param flags [n] candidate flags over all rows, n = kc.num_selectable()
/// @param vmax  [n] max over all rows of Ŝ (finite)
/// @return the chosen selectable slots, absolute and ascending (kc.quota of them)
[[nodiscard]] inline std::vector<std::int32_t> union_finish(const std::uint8_t* flags, const float* vmax,
                                                            const KeepCounts& kc) {
  const int n = kc.num_selectable();
  std::vector<std::int32_t> u, rest;  // ascending, relative to selectable_begin
  for (int j = 0; j < n; ++j) (flags[j] ? u : rest).push_back(j);
  const auto top_of = [&](const std::vector<std::int32_t>& cand, int k) {
    std::vector<float> v(cand.size());
    for (std::size_t i = 0; i < cand.size(); ++i) v[i] = vmax[cand[i]];
    std::vector<std::int32_t> pos = top_k_with_ties(v.data(), static_cast<int>(v.size()), k);
    for (std::int32_t& p : pos) p = cand[p];  // cand ascending: ties still go to the lower slot
    return pos;
  };
  std::vector<std::int32_t> chosen;
  if (static_cast<int>(u.size()) >= kc.quota) {
    chosen = top_of(u, kc.quota);
  } else {  // unreachable with per-row top-quota (|U| >= quota), kept for fidelity to the spec
    chosen = top_of(rest, kc.quota - static_cast<int>(u.size()));
    chosen.insert(chosen.end(), u.begin(), u.end());
    std::sort(chosen.begin(), chosen.end());
  }
  for (std::int32_t& j : chosen) j += kc.selectable_begin;
  return chosen;
}

/// One compression round: which slots of a sequence survive, per (layer, KV head).
///
/// Protected slots ([0, prompt_len) when the prompt is pinned, sinks [0, n_sink), the shared
/// prefix [0, protected_prefix), window [T − window, T)) are always kept; the quota (keep_counts) is filled from the selectable range
/// by the pruning mode on the (optionally z-normalised) scores:
///   kPerHead:         per KV head g, mean over layers of max_{h∈g} Ŝ[l,h,j]; same set per layer
///   kPerLayerPerHead: per (layer, g), max_{h∈g} Ŝ[l,h,j]
///   kUnion:           U = ∪ over (layer, query head) of that row's top-quota; the top-quota of U
///                     by max_{l,h} Ŝ (filled from the rest by that value if |U| < quota); one set
///                     for every layer and head
/// Ties go to the lower slot. When quota >= selectable the plan is the identity (keep = T).
/// With kPinnedInBudget and prompt_len >= budget the whole prompt is kept and no decode token
/// beyond sinks/window, and a one-time warning suggests kPinnedOnTop.
///
/// @param scores [L, Hq, T] raw scores (score_sequence); only the selectable range is read
/// @return plan [L, Hkv, keep], rows ascending
/// Non-finite scores in the selectable range throw (NonFinitePolicy::kRefuse) or rank below every
/// finite one (kEvictFirst: the lowest float after normalising over the finite ones).
/// @throws triattn::logic_error on bad shapes or params, or a non-finite score in the selectable
///         range under kRefuse.
[[nodiscard]] inline KeepPlan select_keep(const float* scores, int L, int Hq, int Hkv, int T, int prompt_len,
                                          const ValidSelectionParams& params, int protected_prefix = 0) {
  const KeepCounts kc = detail::prepare_selection(scores, L, Hq, Hkv, T, prompt_len, params, protected_prefix);
  const std::size_t rows = static_cast<std::size_t>(L) * Hq;
  const int lo = kc.selectable_begin, n = kc.num_selectable();

  KeepPlan plan(L, Hkv, kc.keep);
  if (kc.identity) {
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < Hkv; ++g)
        for (int j = 0; j < T; ++j) plan.row(l, g)[j] = j;
    return plan;
  }

  const std::vector<float> s = detail::selection_values(scores, rows, kc, params);  // Ŝ  [L, Hq, T]

  switch (params.mode) {
    case PruningMode::kPerHead: {
      std::vector<float> gmax(static_cast<std::size_t>(L) * Hkv * T);  // [L, Hkv, T]
      reduce_gqa_max(s.data(), L, Hq, Hkv, T, gmax.data());
      std::vector<float> agg(static_cast<std::size_t>(Hkv) * T);       // [Hkv, T]
      mean_over_layers(gmax.data(), L, Hkv, T, agg.data());
      for (int g = 0; g < Hkv; ++g) {
        std::vector<std::int32_t> chosen = top_k_with_ties(agg.data() + static_cast<std::size_t>(g) * T + lo, n, kc.quota);
        for (std::int32_t& j : chosen) j += lo;
        for (int l = 0; l < L; ++l) detail::write_row(plan.row(l, g), kc, chosen);
      }
      break;
    }
    case PruningMode::kPerLayerPerHead: {
      std::vector<float> gmax(static_cast<std::size_t>(L) * Hkv * T);  // [L, Hkv, T]
      reduce_gqa_max(s.data(), L, Hq, Hkv, T, gmax.data());
      for (int l = 0; l < L; ++l)
        for (int g = 0; g < Hkv; ++g) {
          std::vector<std::int32_t> chosen =
              top_k_with_ties(gmax.data() + (static_cast<std::size_t>(l) * Hkv + g) * T + lo, n, kc.quota);
          for (std::int32_t& j : chosen) j += lo;
          detail::write_row(plan.row(l, g), kc, chosen);
        }
      break;
    }
    case PruningMode::kUnion: {
      // The "query head" unit of the spec's union is one (layer, query head) row.
      std::vector<std::uint8_t> flags(static_cast<std::size_t>(n));  // [n]
      std::vector<float> vmax(static_cast<std::size_t>(n));           // [n] max_{l,h} Ŝ
      union_candidates(s.data(), rows, kc, flags.data(), vmax.data());
      detail::write_all_rows(plan, kc, union_finish(flags.data(), vmax.data(), kc));
      break;
    }
  }
  return plan;
}

}  // namespace selection
}  // namespace triattn

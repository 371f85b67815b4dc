// SPDX-License-Identifier: Apache-2.0
// Host baseline scorers that share TriAttention's selection path: recency (StreamingLLM), key
// norm (KnormPress), seeded random, and SnapKV-style observation-window attention. Pure functions
// on float arrays, one (layer, head) row at a time; the policies in core/policy/*_scorer.hpp loop
// over layers and heads, and the CUDA kernels are checked against these functions (tests name
// them ref::, core/ref/baseline_scores.hpp). Higher score = more important (selection keeps the top).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/hash.hpp>
#include <triattn/core/math/baseline_math.hpp>

namespace triattn::detail {
/// Query heads of a scorer output [num_layers, Hq, length] of `out_size` floats, checked: Hq
/// must be a positive multiple of num_kv_heads and equal `expected` when expected > 0. For
/// length = 0 the output must be empty and `expected` (possibly 0) is returned.
/// @throws triattn::logic_error naming `who` and the sizes.
[[nodiscard]] inline int scorer_num_q_heads(std::size_t out_size, int num_layers, int num_kv_heads, int length,
                                            int expected, const char* who) {
  TRIATTN_EXPECTS(length >= 0, std::string(who) + ": length must be >= 0, got " + std::to_string(length));
  if (length == 0) {
    TRIATTN_EXPECTS(out_size == 0, std::string(who) + ": output holds " + std::to_string(out_size) +
                                       " floats for length 0, expected none");
    return expected;
  }
  const std::size_t per_head = static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(length);
  const std::size_t hq = per_head > 0 ? out_size / per_head : 0;
  const bool ok = per_head > 0 && hq * per_head == out_size && hq > 0 && num_kv_heads > 0 &&
                  hq % static_cast<std::size_t>(num_kv_heads) == 0 &&
                  (expected <= 0 || hq == static_cast<std::size_t>(expected));
  TRIATTN_EXPECTS(ok, std::string(who) + ": output holds " + std::to_string(out_size) +
                          " floats; expected [layers " + std::to_string(num_layers) + ", q heads " +
                          (expected > 0 ? std::to_string(expected) : std::string("(a multiple of kv heads ") +
                                                                       std::to_string(num_kv_heads) + ")") +
                          ", length " + std::to_string(length) + "]");
  return static_cast<int>(hq);
}
}  // namespace triattn::detail

namespace triattn::baseline {

// ---- recency (StreamingLLM) ---------------------------------------------------------------------

/// out[j] = j − (T − 1): the slot index shifted so the newest slot scores 0. The shift keeps the
/// values that decide a round (the newest `budget` slots) exact in float for any T.
/// @param out [T]
inline void recency_scores(int T, float* out) {
  TRIATTN_EXPECTS(T >= 0, "recency_scores: T must be >= 0, got " + std::to_string(T));
  for (int j = 0; j < T; ++j) out[j] = static_cast<float>(static_cast<long long>(j) - (T - 1));
}

// ---- key norm (KnormPress) ----------------------------------------------------------------------

/// ‖k‖₂ with float accumulation in element order.
/// @param k [d]
[[nodiscard]] inline float key_l2_norm(const float* k, int d) {
  float ss = 0.0f;
  for (int e = 0; e < d; ++e) ss += k[e] * k[e];
  return std::sqrt(ss);
}

/// out[j] = −‖k_j‖₂: low-norm keys score highest (KnormPress keeps the lowest-norm keys).
/// @param keys [T, d]
/// @param out  [T]
inline void key_norm_scores(const float* keys, int T, int d, float* out) {
  TRIATTN_EXPECTS(T >= 0 && d > 0, "key_norm_scores: bad shape (T " + std::to_string(T) + ", d " + std::to_string(d) + ")");
  for (int j = 0; j < T; ++j) out[j] = -key_l2_norm(keys + static_cast<std::size_t>(j) * d, d);
}

// ---- seeded random ------------------------------------------------------------------------------

/// Hash of (seed, round start t0, layer, KV head, slot): chained mix64, so it is deterministic
/// and every argument changes the result.
[[nodiscard]] constexpr std::uint64_t random_score_hash(std::uint64_t seed, std::int64_t t0, int layer, int kv_head,
                                                        int slot) noexcept {
  std::uint64_t h = mix64(seed);
  h = mix64(h ^ static_cast<std::uint64_t>(t0));
  h = mix64(h ^ ((static_cast<std::uint64_t>(static_cast<std::uint32_t>(layer)) << 32) |
                 static_cast<std::uint32_t>(kv_head)));
  return mix64(h ^ static_cast<std::uint32_t>(slot));
}

/// Uniform score in [0, 1) with 24 random bits (exact in float) from random_score_hash.
[[nodiscard]] constexpr float random_score(std::uint64_t seed, std::int64_t t0, int layer, int kv_head,
                                           int slot) noexcept {
  return static_cast<float>(random_score_hash(seed, t0, layer, kv_head, slot) >> 40) * (1.0f / 16777216.0f);
}

/// out[j] = random_score(seed, t0, layer, kv_head, j).
/// @param out [T]
inline void random_scores(std::uint64_t seed, std::int64_t t0, int layer, int kv_head, int T, float* out) {
  TRIATTN_EXPECTS(T >= 0, "random_scores: T must be >= 0, got " + std::to_string(T));
  for (int j = 0; j < T; ++j) out[j] = random_score(seed, t0, layer, kv_head, j);
}

// ---- SnapKV-style observation window ------------------------------------------------------------

/// Window attention of one query head: for each window query i with limit lim_i >= 0 (last
/// visible slot, clamped to T − 1), p_i = softmax_j(q_i · k_j / sqrt(d)) over j in [0, lim_i];
/// out[j] = mean over those queries of p_i[j] (0 where a query cannot see j). Queries with
/// lim_i < 0 (or T = 0) see nothing and do not count in the mean; with none left, out = 0.
/// Dot products, softmax and mean are evaluated in float64, then rounded.
/// @param q      [n, d] window queries (post-RoPE, as attention sees them)
/// @param limits [n]    last visible slot per query
/// @param keys   [T, d] cached keys (post-RoPE)
/// @param out    [T]
inline void snapkv_window_attention(const float* q, const int* limits, int n, const float* keys, int T, int d,
                                    float* out) {
  TRIATTN_EXPECTS(n >= 0 && T >= 0 && d > 0, "snapkv_window_attention: bad shape (n " + std::to_string(n) + ", T " +
                                                 std::to_string(T) + ", d " + std::to_string(d) + ")");
  std::vector<double> acc(static_cast<std::size_t>(T), 0.0);
  std::vector<double> logit(static_cast<std::size_t>(T));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  int counted = 0;
  for (int i = 0; i < n; ++i) {
    const int lim = std::min(limits[i], T - 1);
    if (lim < 0) continue;
    ++counted;
    const float* qi = q + static_cast<std::size_t>(i) * d;
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j <= lim; ++j) {
      const float* kj = keys + static_cast<std::size_t>(j) * d;
      double s = 0.0;
      for (int e = 0; e < d; ++e) s += static_cast<double>(qi[e]) * kj[e];
      logit[j] = s * scale;
      m = std::max(m, logit[j]);
    }
    double z = 0.0;
    for (int j = 0; j <= lim; ++j) z += std::exp(logit[j] - m);
    for (int j = 0; j <= lim; ++j) acc[j] += std::exp(logit[j] - m) / z;
  }
  for (int j = 0; j < T; ++j) out[j] = counted > 0 ? static_cast<float>(acc[j] / counted) : 0.0f;
}

/// 1-D max pooling with stride 1 and "same" padding: out[j] = max of in over
/// [j − kernel/2, j + kernel/2] ∩ [0, T). `kernel` must be odd and >= 1 (1 copies).
/// @param in  [T]
/// @param out [T] (must not alias in)
inline void max_pool_same(const float* in, int T, int kernel, float* out) {
  TRIATTN_EXPECTS(kernel >= 1 && kernel % 2 == 1,
                  "max_pool_same: kernel = " + std::to_string(kernel) + " must be odd and >= 1");
  TRIATTN_EXPECTS(T >= 0, "max_pool_same: T must be >= 0, got " + std::to_string(T));
  const int r = kernel / 2;
  for (int j = 0; j < T; ++j) {
    const int lo = std::max(0, j - r), hi = std::min(T - 1, j + r);
    float m = in[lo];
    for (int t = lo + 1; t <= hi; ++t) m = std::max(m, in[t]);
    out[j] = m;
  }
}

/// SnapKV-style score of one query head: snapkv_window_attention, then max_pool_same.
/// @param q      [n, d]
/// @param limits [n]
/// @param keys   [T, d]
/// @param out    [T]
inline void snapkv_scores(const float* q, const int* limits, int n, const float* keys, int T, int d, int pool_kernel,
                          float* out) {
  std::vector<float> attn(static_cast<std::size_t>(T));
  snapkv_window_attention(q, limits, n, keys, T, d, attn.data());
  max_pool_same(attn.data(), T, pool_kernel, out);
}

}  // namespace triattn::baseline

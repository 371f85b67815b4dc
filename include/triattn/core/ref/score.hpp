// SPDX-License-Identifier: Apache-2.0
// CPU reference of the TriAttention key scorer (spec §3). The model (TriAttentionModel, its fold
// into per-round weights) and the per-element math the CUDA kernels share (score_key_folded,
// score_key_max, fold_weight*) live in core/math/; this header holds the oracle only.
// score_key_per_offset evaluates the spec formula directly in float64 and is the oracle for the
// folded (mean) and per-offset (max) paths; ref::score_sequence names the host scorer's loop
// (core/math/score_model.hpp), which tests compare the CUDA scorer against.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>

#include <triattn/core/error.hpp>
#include <triattn/core/math/score_math.hpp>
#include <triattn/core/math/score_model.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn::ref {

/// Direct float64 evaluation of spec §3 for one key and query head, with no fold:
/// comb(δ) = Σ_f s²·Re(q̄_f·conj(K_f)·e^{i(t0+δ)ω_f}) + Σ_f c_f·|K_f| for every δ ∈ D, then the
/// mean or max per the model's aggregation. The oracle for the folded and max paths.
/// @param k [head_dim] the cached (rotated) key
[[nodiscard]] inline double score_key_per_offset(const TriAttentionModel& m, int layer, int q_head, long long t0,
                                                 const float* k) {
  TRIATTN_EXPECTS(layer >= 0 && layer < m.num_layers() && q_head >= 0 && q_head < m.num_q_heads(),
                  "score_key_per_offset: (layer " + std::to_string(layer) + ", q head " + std::to_string(q_head) +
                      ") out of range");
  TRIATTN_EXPECTS(t0 >= 0, "score_key_per_offset: t0 must be >= 0, got " + std::to_string(t0));
  const int d = m.head_dim(), F = m.num_freqs();
  const double s2 = m.freq_scale_sq();
  const double* qr = m.q_mean_re(layer, q_head);
  const double* qi = m.q_mean_im(layer, q_head);
  const double* c = m.mlr_weight(layer, q_head);
  double extra = 0.0;
  for (int f = 0; f < F; ++f) {
    const double kr = k[rope_pair_re(m.style(), f, d)], ki = k[rope_pair_im(m.style(), f, d)];
    extra += c[f] * std::sqrt(kr * kr + ki * ki + 1e-8);
  }
  double acc = 0.0;
  bool first = true;
  for (double delta : m.offsets()) {
    double base = 0.0;
    if (!m.params().disable_trig) {
      for (int f = 0; f < F; ++f) {
        const double kr = k[rope_pair_re(m.style(), f, d)], ki = k[rope_pair_im(m.style(), f, d)];
        const double p_re = qr[f] * kr + qi[f] * ki;  // P = q̄ · conj(K)
        const double p_im = qi[f] * kr - qr[f] * ki;
        const double phi = static_cast<double>(t0 + static_cast<long long>(delta)) * m.omega()[f];
        base += s2 * (p_re * std::cos(phi) - p_im * std::sin(phi));  // Re(P e^{iφ})
      }
    }
    const double comb = base + extra;
    if (m.params().aggregation == Aggregation::kMean) {
      acc += comb;
    } else {
      acc = first ? comb : (comb > acc ? comb : acc);
    }
    first = false;
  }
  return m.params().aggregation == Aggregation::kMean ? acc / static_cast<double>(m.offsets().size()) : acc;
}

using triattn::score_sequence;

}  // namespace triattn::ref

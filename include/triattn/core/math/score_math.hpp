// SPDX-License-Identifier: Apache-2.0
// Per-element TriAttention scoring math shared by the host scorer, the CUDA kernels and the CPU
// oracle (core/ref/score.hpp): the fold of one (head, frequency) weight and the folded and
// max-aggregated score of one key. TRIATTN_HOST_DEVICE, so host and device compute the same thing.
#pragma once

#include <cmath>

#include <triattn/core/config.hpp>
#include <triattn/core/rope.hpp>
#include <triattn/core/rope_types.hpp>

namespace triattn {

namespace detail {
// float64 multiply / add that nvcc may not contract into an FMA, so the device rounds exactly
// as the host does (g++ on the default x86-64 target never contracts; do not build the host
// side with -mfma and -ffp-contract=fast if bitwise host/device weights matter).
TRIATTN_HOST_DEVICE double dmul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
TRIATTN_HOST_DEVICE double dadd_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
TRIATTN_HOST_DEVICE double dsub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
}  // namespace detail

/// Folded weight of one (head, frequency) from the cosine and sine of its phase φ = t0·ω_f:
/// W = s² · q̄ · e^{iφ} · C in float64, then rounded to float. Pure arithmetic, so host and
/// device produce bitwise-identical floats from identical inputs.
/// For max aggregation pass C = 1 + 0i and φ = (t0 + δ)·ω_f.
TRIATTN_HOST_DEVICE void fold_weight_from_phase(double q_re, double q_im, double c_re, double c_im, double cos_phi,
                                                double sin_phi, double s2, float* w_re, float* w_im) {
  using detail::dadd_rn;
  using detail::dmul_rn;
  using detail::dsub_rn;
  // u = q̄ · e^{iφ}
  const double u_re = dsub_rn(dmul_rn(q_re, cos_phi), dmul_rn(q_im, sin_phi));
  const double u_im = dadd_rn(dmul_rn(q_re, sin_phi), dmul_rn(q_im, cos_phi));
  // v = u · C
  const double v_re = dsub_rn(dmul_rn(u_re, c_re), dmul_rn(u_im, c_im));
  const double v_im = dadd_rn(dmul_rn(u_re, c_im), dmul_rn(u_im, c_re));
  *w_re = static_cast<float>(dmul_rn(s2, v_re));
  *w_im = static_cast<float>(dmul_rn(s2, v_im));
}

/// fold_weight_from_phase for C = 1 + 0i (the max aggregation's per-offset weights): the same
/// roundings without the multiplication by C, whose products are exact, so the floats are
/// bitwise those of fold_weight_from_phase(q_re, q_im, 1.0, 0.0, ...) (up to the sign of a zero
/// weight) in 8 float64 operations instead of 14.
TRIATTN_HOST_DEVICE void fold_weight_from_phase_unit(double q_re, double q_im, double cos_phi, double sin_phi, double s2,
                                                     float* w_re, float* w_im) {
  using detail::dadd_rn;
  using detail::dmul_rn;
  using detail::dsub_rn;
  const double u_re = dsub_rn(dmul_rn(q_re, cos_phi), dmul_rn(q_im, sin_phi));
  const double u_im = dadd_rn(dmul_rn(q_re, sin_phi), dmul_rn(q_im, cos_phi));
  *w_re = static_cast<float>(dmul_rn(s2, u_re));
  *w_im = static_cast<float>(dmul_rn(s2, u_im));
}

/// Phase t·ω of a RoPE rotation at logical position t, in float64 (t·ω_0 reaches 1e5 rad and
/// more; a float32 phase is off by ~1e-2 rad there).
TRIATTN_HOST_DEVICE double rope_phase(long long t, double omega) {
  return detail::dmul_rn(static_cast<double>(t), omega);
}

/// fold_weight_from_phase with φ = t0·ω computed here. cos/sin come from the platform's libm
/// (glibc on the host, CUDA's on the device); those may differ in the last float64 bit, so a
/// device-side fold can differ from the host's by one float ulp in rare cases.
TRIATTN_HOST_DEVICE void fold_weight(double q_re, double q_im, double c_re, double c_im, double omega, long long t0,
                                     double s2, float* w_re, float* w_im) {
  const double phi = rope_phase(t0, omega);
  fold_weight_from_phase(q_re, q_im, c_re, c_im, ::cos(phi), ::sin(phi), s2, w_re, w_im);
}

/// Folded score of one key for one query head (mean aggregation; spec §3.1):
///   Σ_f (W_re,f·k_re,f + W_im,f·k_im,f) + Σ_f c_f·sqrt(k_re,f² + k_im,f² + 1e-8)
/// in float32. W·conj(K) has real part W_re·K_re + W_im·K_im, which is why both terms are +.
/// @param k     [head_dim] the cached (already rotated) key
/// @param w_re  [head_dim/2] Re W_f
/// @param w_im  [head_dim/2] Im W_f
/// @param c     [head_dim/2] c_f
TRIATTN_HOST_DEVICE float score_key_folded(const float* k, const float* w_re, const float* w_im, const float* c,
                                           int head_dim, RopeStyle style) {
  float dot = 0.0f;
  float mlr = 0.0f;
  for (int f = 0; f < head_dim / 2; ++f) {
    const float kr = k[rope_pair_re(style, f, head_dim)];
    const float ki = k[rope_pair_im(style, f, head_dim)];
    dot += w_re[f] * kr + w_im[f] * ki;
    mlr += c[f] * ::sqrtf(kr * kr + ki * ki + 1e-8f);
  }
  return dot + mlr;
}

/// Max-aggregated score of one key for one query head: max over the offsets δ of
/// comb(δ) = Σ_f (W_re,f(δ)·k_re,f + W_im,f(δ)·k_im,f) + Σ_f c_f·|K_f|, float32.
/// @param k       [head_dim]
/// @param w_re    [num_offsets, head_dim/2] Re W_f(δ) = Re s²·q̄_f·e^{i(t0+δ)ω_f}
/// @param w_im    [num_offsets, head_dim/2]
/// @param c       [head_dim/2]
TRIATTN_HOST_DEVICE float score_key_max(const float* k, const float* w_re, const float* w_im, const float* c,
                                        int num_offsets, int head_dim, RopeStyle style) {
  const int F = head_dim / 2;
  float mlr = 0.0f;
  for (int f = 0; f < F; ++f) {
    const float kr = k[rope_pair_re(style, f, head_dim)];
    const float ki = k[rope_pair_im(style, f, head_dim)];
    mlr += c[f] * ::sqrtf(kr * kr + ki * ki + 1e-8f);
  }
  float best = 0.0f;
  for (int o = 0; o < num_offsets; ++o) {
    float dot = 0.0f;
    for (int f = 0; f < F; ++f) {
      dot += w_re[o * F + f] * k[rope_pair_re(style, f, head_dim)] +
             w_im[o * F + f] * k[rope_pair_im(style, f, head_dim)];
    }
    const float comb = dot + mlr;
    best = o == 0 ? comb : detail::max_(best, comb);
  }
  return best;
}

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// Rotary position embedding math: the per-pair angular frequencies ω_f with the model's scaling
// (none, linear, llama3 piecewise, YaRN) exactly as Hugging Face computes its inv_freq, YaRN's
// attention factor α, the pair index maps of the two pairing styles, and a host RoPE rotation of
// one head vector (float64 angles, plus a variant that reproduces llama2.c's float32 angles).
// Host-only except rope_pair_re / rope_pair_im, which kernels call.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>

namespace triattn {

/// Index in a head vector of the real component of pair f (spec §2).
TRIATTN_HOST_DEVICE constexpr int rope_pair_re(RopeStyle style, int f, int /*head_dim*/) {
  return style == RopeStyle::kInterleaved ? 2 * f : f;
}
/// Index in a head vector of the imaginary component of pair f (spec §2).
TRIATTN_HOST_DEVICE constexpr int rope_pair_im(RopeStyle style, int f, int head_dim) {
  return style == RopeStyle::kInterleaved ? 2 * f + 1 : f + head_dim / 2;
}

namespace detail {

inline std::string rope_num(double v) {
  // std::to_string(double) prints 6 decimals only, which hides values such as 1e-9.
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

inline void validate_rope(int head_dim, const RopeConfig& cfg) {
  TRIATTN_EXPECTS(head_dim > 0 && head_dim % 2 == 0,
                  "rope: head_dim must be even and > 0, got " + std::to_string(head_dim));
  TRIATTN_EXPECTS(cfg.style == RopeStyle::kHalf || cfg.style == RopeStyle::kInterleaved,
                  "rope: invalid RopeStyle value " + std::to_string(static_cast<int>(cfg.style)));
  TRIATTN_EXPECTS(std::isfinite(cfg.theta) && cfg.theta > 1.0,
                  "rope: theta must be finite and > 1, got " + rope_num(cfg.theta));
  const RopeScaling& s = cfg.scaling;
  switch (s.kind) {
    case RopeScalingKind::kNone: return;
    case RopeScalingKind::kLinear:
      TRIATTN_EXPECTS(std::isfinite(s.factor) && s.factor > 0.0,
                      "rope (linear): factor must be finite and > 0, got " + rope_num(s.factor));
      return;
    case RopeScalingKind::kLlama3:
      TRIATTN_EXPECTS(std::isfinite(s.factor) && s.factor > 0.0,
                      "rope (llama3): factor must be finite and > 0, got " + rope_num(s.factor));
      TRIATTN_EXPECTS(std::isfinite(s.low_freq_factor) && s.low_freq_factor > 0.0,
                      "rope (llama3): low_freq_factor must be finite and > 0, got " + rope_num(s.low_freq_factor));
      // The smooth band divides by (high - low).
      TRIATTN_EXPECTS(std::isfinite(s.high_freq_factor) && s.high_freq_factor > s.low_freq_factor,
                      "rope (llama3): high_freq_factor (" + rope_num(s.high_freq_factor) +
                          ") must be finite and > low_freq_factor (" + rope_num(s.low_freq_factor) + ")");
      TRIATTN_EXPECTS(std::isfinite(s.original_max_position) && s.original_max_position > 0.0,
                      "rope (llama3): original_max_position must be finite and > 0, got " +
                          rope_num(s.original_max_position));
      return;
    case RopeScalingKind::kYarn:
      TRIATTN_EXPECTS(std::isfinite(s.factor) && s.factor > 0.0,
                      "rope (yarn): factor must be finite and > 0, got " + rope_num(s.factor));
      TRIATTN_EXPECTS(std::isfinite(s.original_max_position) && s.original_max_position > 0.0,
                      "rope (yarn): original_max_position must be finite and > 0, got " +
                          rope_num(s.original_max_position));
      TRIATTN_EXPECTS(std::isfinite(s.beta_fast) && s.beta_fast > 0.0,
                      "rope (yarn): beta_fast must be finite and > 0, got " + rope_num(s.beta_fast));
      TRIATTN_EXPECTS(std::isfinite(s.beta_slow) && s.beta_slow > 0.0,
                      "rope (yarn): beta_slow must be finite and > 0, got " + rope_num(s.beta_slow));
      TRIATTN_EXPECTS(std::isfinite(s.mscale) && s.mscale >= 0.0,
                      "rope (yarn): mscale must be finite and >= 0 (0 = unset), got " + rope_num(s.mscale));
      TRIATTN_EXPECTS(std::isfinite(s.mscale_all_dim) && s.mscale_all_dim >= 0.0,
                      "rope (yarn): mscale_all_dim must be finite and >= 0 (0 = unset), got " +
                          rope_num(s.mscale_all_dim));
      TRIATTN_EXPECTS(std::isfinite(s.attention_factor) && s.attention_factor >= 0.0,
                      "rope (yarn): attention_factor must be finite and >= 0 (0 = derive), got " +
                          rope_num(s.attention_factor));
      return;
  }
  TRIATTN_FAIL("rope: invalid RopeScalingKind value " + std::to_string(static_cast<int>(s.kind)));
}

/// HF get_mscale: YaRN's attention temperature for scale factor `scale`.
inline double yarn_get_mscale(double scale, double mscale = 1.0) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

/// HF find_correction_dim: the (fractional) dimension index at which a pair completes
/// `num_rotations` turns over `max_pos` positions.
inline double yarn_correction_dim(double num_rotations, int dim, double base, double max_pos) {
  const double two_pi = 6.283185307179586476925286766559;
  return (dim * std::log(max_pos / (num_rotations * two_pi))) / (2.0 * std::log(base));
}

}  // namespace detail

/// Angular frequency ω_f of every pair f ∈ [0, head_dim/2), in float64, with the model's scaling
/// applied as Hugging Face's rope-init functions do (plain, linear, llama3, yarn).
/// @note HF rounds inv_freq to float32; this returns the unrounded float64 values (the scorer
///       evaluates phases in float64; see docs/algorithm.md).
/// @throws triattn::logic_error naming the bad value (odd head_dim, theta <= 1, factor <= 0, ...).
[[nodiscard]] inline std::vector<double> rope_inv_freq(int head_dim, const RopeConfig& cfg) {
  detail::validate_rope(head_dim, cfg);
  const int F = head_dim / 2;
  const RopeScaling& s = cfg.scaling;
  std::vector<double> w(static_cast<std::size_t>(F));
  for (int f = 0; f < F; ++f) w[f] = std::pow(cfg.theta, -2.0 * f / head_dim);  // θ^(-2f/d)

  switch (s.kind) {
    case RopeScalingKind::kNone: break;
    case RopeScalingKind::kLinear:
      for (double& x : w) x /= s.factor;
      break;
    case RopeScalingKind::kLlama3: {
      // HF _compute_llama3_parameters.
      const double two_pi = 6.283185307179586476925286766559;
      const double low_freq_wavelen = s.original_max_position / s.low_freq_factor;
      const double high_freq_wavelen = s.original_max_position / s.high_freq_factor;
      for (double& x : w) {
        const double wavelen = two_pi / x;
        if (wavelen < high_freq_wavelen) continue;  // high frequency: unchanged
        if (wavelen > low_freq_wavelen) {            // low frequency: interpolated
          x /= s.factor;
          continue;
        }
        const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        x = (1.0 - smooth) * x / s.factor + smooth * x;
      }
      break;
    }
    case RopeScalingKind::kYarn: {
      // HF _compute_yarn_parameters: a linear ramp over the pair index between the dims that
      // turn beta_fast and beta_slow times over the original context blends extrapolation
      // (ω, high frequencies) into interpolation (ω/factor, low frequencies).
      double low = detail::yarn_correction_dim(s.beta_fast, head_dim, cfg.theta, s.original_max_position);
      double high = detail::yarn_correction_dim(s.beta_slow, head_dim, cfg.theta, s.original_max_position);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = low < 0.0 ? 0.0 : low;
      high = high > head_dim - 1 ? static_cast<double>(head_dim - 1) : high;
      if (low == high) high += 0.001;  // HF: prevent a singular ramp
      for (int f = 0; f < F; ++f) {
        double ramp = (f - low) / (high - low);
        ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
        const double extrapolation_factor = 1.0 - ramp;
        const double interp = w[f] / s.factor;
        w[f] = interp * (1.0 - extrapolation_factor) + w[f] * extrapolation_factor;
      }
      break;
    }
  }
  return w;
}

/// Rotary attention factor α (HF "attention_scaling": cos and sin are multiplied by it, so a
/// logit scales by α², the scorer's s²). 1 for none / linear / llama3. YaRN: attention_factor
/// when set (> 0); else, when mscale and mscale_all_dim are both non-zero (DeepSeek),
/// get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); else 0.1·ln(factor) + 1
/// (1 for factor <= 1).
/// @throws triattn::logic_error on an invalid scaling description.
[[nodiscard]] inline double rope_attention_factor(const RopeConfig& cfg) {
  detail::validate_rope(2, cfg);
  const RopeScaling& s = cfg.scaling;
  if (s.kind != RopeScalingKind::kYarn) return 1.0;
  if (s.attention_factor > 0.0) return s.attention_factor;
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0)
    return detail::yarn_get_mscale(s.factor, s.mscale) / detail::yarn_get_mscale(s.factor, s.mscale_all_dim);
  return detail::yarn_get_mscale(s.factor);
}

/// Rotates one head vector in place by RoPE at position `pos`: for each pair f,
/// angle = pos·ω_f in float64, c = (float)cos(angle)·(float)α, s = (float)sin(angle)·(float)α,
/// then in float x_re' = x_re·c − x_im·s, x_im' = x_re·s + x_im·c (z_f ← z_f·α·e^{i·pos·ω_f}).
/// This is HF's rotation with a float64 angle (HF forms the angle in float32, which loses
/// ~pos·2^-24 rad; the float64 angle is the exact rotation the scorer assumes).
/// @param x          [head_dim] the vector, rotated in place
/// @param inv_freq   [head_dim/2] ω_f (rope_inv_freq)
/// @param attention_factor α (rope_attention_factor); 1 leaves the norm unchanged
inline void apply_rope(float* x, int head_dim, long long pos, const double* inv_freq, RopeStyle style,
                       double attention_factor = 1.0) {
  TRIATTN_EXPECTS(head_dim > 0 && head_dim % 2 == 0,
                  "apply_rope: head_dim must be even and > 0, got " + std::to_string(head_dim));
  const float a = static_cast<float>(attention_factor);
  const double p = static_cast<double>(pos);
  for (int f = 0; f < head_dim / 2; ++f) {
    const double angle = p * inv_freq[f];
    const float c = static_cast<float>(std::cos(angle)) * a;
    const float s = static_cast<float>(std::sin(angle)) * a;
    float& re = x[rope_pair_re(style, f, head_dim)];
    float& im = x[rope_pair_im(style, f, head_dim)];
    const float r = re, i = im;
    re = r * c - i * s;
    im = r * s + i * c;
  }
}

/// llama2.c's float32 inv_freq: freq_f = 1.0f / powf(theta, (float)(2f) / (float)head_dim).
/// @return [head_dim/2]
[[nodiscard]] inline std::vector<float> rope_inv_freq_f32(int head_dim, float theta = 10000.0f) {
  TRIATTN_EXPECTS(head_dim > 0 && head_dim % 2 == 0,
                  "rope_inv_freq_f32: head_dim must be even and > 0, got " + std::to_string(head_dim));
  TRIATTN_EXPECTS(std::isfinite(theta) && theta > 1.0f,
                  "rope_inv_freq_f32: theta must be finite and > 1, got " + detail::rope_num(theta));
  std::vector<float> w(static_cast<std::size_t>(head_dim / 2));
  for (int f = 0; f < head_dim / 2; ++f)
    w[f] = 1.0f / std::pow(theta, static_cast<float>(2 * f) / static_cast<float>(head_dim));  // powf
  return w;
}

/// Rotation exactly as llama2.c run.c does it: val = (float)pos * freq in float32,
/// fcr = cosf(val), fci = sinf(val), x_re' = x_re·fcr − x_im·fci, x_im' = x_re·fci + x_im·fcr.
/// Use it (with rope_inv_freq_f32 and RopeStyle::kInterleaved) where logits must match llama2.c;
/// at large pos the float32 angle is off by up to ~pos·2^-24 rad.
/// @param x          [head_dim] the vector, rotated in place
/// @param inv_freq   [head_dim/2] float32 frequencies (rope_inv_freq_f32)
inline void apply_rope_f32_angles(float* x, int head_dim, int pos, const float* inv_freq, RopeStyle style) {
  TRIATTN_EXPECTS(head_dim > 0 && head_dim % 2 == 0,
                  "apply_rope_f32_angles: head_dim must be even and > 0, got " + std::to_string(head_dim));
  for (int f = 0; f < head_dim / 2; ++f) {
    const float val = static_cast<float>(pos) * inv_freq[f];
    const float fcr = std::cos(val);  // float overload = cosf
    const float fci = std::sin(val);
    float& re = x[rope_pair_re(style, f, head_dim)];
    float& im = x[rope_pair_im(style, f, head_dim)];
    const float v0 = re, v1 = im;
    re = v0 * fcr - v1 * fci;
    im = v0 * fci + v1 * fcr;
  }
}

}  // namespace triattn

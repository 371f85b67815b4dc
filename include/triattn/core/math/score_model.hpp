// SPDX-License-Identifier: Apache-2.0
// TriAttentionModel (spec §3): everything the key scorer needs that does not change during
// decoding (ω_f, s² = α², per-head q̄_f, A_f, c_f and the offset average C_f), and its fold into
// per-round weights. Production code shared by the host and device scorers; the oracle
// (ref::score_key_per_offset in core/ref/score.hpp) reads the same model. score_sequence:
// the host scorer's loop over a sequence.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/math/score_math.hpp>
#include <triattn/core/rope.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {

/// Folded weights of one round (mean aggregation).
struct FoldedWeights {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_freqs = 0;
  std::vector<float> w_re;  // [L, Hq, F] Re W_f
  std::vector<float> w_im;  // [L, Hq, F] Im W_f
  std::vector<float> c;     // [L, Hq, F] c_f

  [[nodiscard]] std::size_t offset(int layer, int head) const noexcept {
    return (static_cast<std::size_t>(layer) * num_q_heads + head) * static_cast<std::size_t>(num_freqs);
  }
};

/// Per-offset weights of one round (max aggregation).
struct MaxWeights {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_offsets = 0;
  int num_freqs = 0;
  std::vector<float> w_re;  // [L, Hq, |D|, F] Re s²·q̄_f·e^{i(t0+δ)ω_f}
  std::vector<float> w_im;  // [L, Hq, |D|, F]
  std::vector<float> c;     // [L, Hq, F] c_f

  [[nodiscard]] std::size_t w_offset(int layer, int head) const noexcept {
    return (static_cast<std::size_t>(layer) * num_q_heads + head) * static_cast<std::size_t>(num_offsets) *
           static_cast<std::size_t>(num_freqs);
  }
  [[nodiscard]] std::size_t c_offset(int layer, int head) const noexcept {
    return (static_cast<std::size_t>(layer) * num_q_heads + head) * static_cast<std::size_t>(num_freqs);
  }
};

/// Everything the scorer needs that is fixed for a model: built once from the calibration
/// statistics, the model's RoPE and the scoring parameters. All quantities in float64.
class TriAttentionModel {
 public:
  /// @param num_kv_heads KV heads of the cache this model scores (local to the stats' slice);
  ///        query head h reads KV head h / (Hq / Hkv).
  /// @throws triattn::logic_error when the stats are malformed, disagree with the RoPE config
  ///         (pairing style) or with num_kv_heads, or a parameter is invalid.
  TriAttentionModel(const QueryStats& stats, const RopeConfig& rope, const ScoringParams& params, int num_kv_heads)
      : params_(params), style_(rope.style) {
    params.validate();
    TRIATTN_EXPECTS(stats.num_layers > 0, "TriAttentionModel: stats.num_layers must be > 0, got " +
                                              std::to_string(stats.num_layers));
    TRIATTN_EXPECTS(stats.num_q_heads > 0, "TriAttentionModel: stats.num_q_heads must be > 0, got " +
                                               std::to_string(stats.num_q_heads));
    TRIATTN_EXPECTS(stats.head_dim > 0 && stats.head_dim % 2 == 0,
                    "TriAttentionModel: stats.head_dim must be even and > 0, got " + std::to_string(stats.head_dim));
    TRIATTN_EXPECTS(stats.rope_style == rope.style,
                    std::string("TriAttentionModel: stats were calibrated with rope style ") +
                        (stats.rope_style == RopeStyle::kHalf ? "half" : "interleaved") +
                        " but the RoPE config says " + (rope.style == RopeStyle::kHalf ? "half" : "interleaved"));
    TRIATTN_EXPECTS(num_kv_heads > 0 && stats.num_q_heads % num_kv_heads == 0,
                    "TriAttentionModel: num_kv_heads = " + std::to_string(num_kv_heads) +
                        " must be > 0 and divide num_q_heads = " + std::to_string(stats.num_q_heads));
    L_ = stats.num_layers;
    Hq_ = stats.num_q_heads;
    Hkv_ = num_kv_heads;
    d_ = stats.head_dim;
    F_ = d_ / 2;
    const std::size_t n = static_cast<std::size_t>(L_) * Hq_ * F_;
    const auto check_size = [&](const std::vector<float>& v, const char* name) {
      TRIATTN_EXPECTS(v.size() == n, std::string("TriAttentionModel: stats.") + name + " holds " +
                                         std::to_string(v.size()) + " values, expected layers*q_heads*F = " +
                                         std::to_string(n));
    };
    check_size(stats.q_mean_real, "q_mean_real");
    check_size(stats.q_mean_imag, "q_mean_imag");
    check_size(stats.q_abs_mean, "q_abs_mean");

    omega_ = rope_inv_freq(d_, rope);  // validates the RoPE config
    const double alpha = rope_attention_factor(rope);
    s2_ = alpha * alpha;
    offsets_ = geometric_offsets(params.offset_max_length);

    // C_f = (1/|D|) Σ_δ e^{iδω_f}
    c_re_.assign(F_, 0.0);
    c_im_.assign(F_, 0.0);
    for (int f = 0; f < F_; ++f) {
      double re = 0.0, im = 0.0;
      for (double delta : offsets_) {
        re += std::cos(delta * omega_[f]);
        im += std::sin(delta * omega_[f]);
      }
      c_re_[f] = re / static_cast<double>(offsets_.size());
      c_im_[f] = im / static_cast<double>(offsets_.size());
    }

    q_re_.resize(n);
    q_im_.resize(n);
    a_.resize(n);
    q_abs_.resize(n);
    c_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const double re = stats.q_mean_real[i], im = stats.q_mean_imag[i], a = stats.q_abs_mean[i];
      if (!(std::isfinite(re) && std::isfinite(im) && std::isfinite(a) && a >= 0.0)) {
        const std::size_t per_layer = static_cast<std::size_t>(Hq_) * F_;
        TRIATTN_FAIL("TriAttentionModel: stats (layer " + std::to_string(i / per_layer) + ", q head " +
                     std::to_string((i % per_layer) / F_) + ", f " + std::to_string(i % F_) +
                     ") are not finite or have q_abs_mean < 0");
      }
      q_re_[i] = re;
      q_im_[i] = im;
      a_[i] = a;
      q_abs_[i] = std::sqrt(re * re + im * im + 1e-8);
      c_[i] = params.disable_mlr ? s2_ * a : s2_ * (a - q_abs_[i]);
    }
  }

  [[nodiscard]] int num_layers() const noexcept { return L_; }
  [[nodiscard]] int num_q_heads() const noexcept { return Hq_; }
  [[nodiscard]] int num_kv_heads() const noexcept { return Hkv_; }
  [[nodiscard]] int group_size() const noexcept { return Hq_ / Hkv_; }
  [[nodiscard]] int head_dim() const noexcept { return d_; }
  [[nodiscard]] int num_freqs() const noexcept { return F_; }
  [[nodiscard]] int num_offsets() const noexcept { return static_cast<int>(offsets_.size()); }
  [[nodiscard]] RopeStyle style() const noexcept { return style_; }
  [[nodiscard]] const ScoringParams& params() const noexcept { return params_; }
  [[nodiscard]] double freq_scale_sq() const noexcept { return s2_; }            ///< s² = α²
  [[nodiscard]] const std::vector<double>& omega() const noexcept { return omega_; }     // [F]
  [[nodiscard]] const std::vector<double>& offsets() const noexcept { return offsets_; } // [|D|]
  [[nodiscard]] const std::vector<double>& offset_mean_re() const noexcept { return c_re_; }  // [F] Re C_f
  [[nodiscard]] const std::vector<double>& offset_mean_im() const noexcept { return c_im_; }  // [F] Im C_f

  [[nodiscard]] std::size_t offset(int layer, int head) const noexcept {
    return (static_cast<std::size_t>(layer) * Hq_ + head) * static_cast<std::size_t>(F_);
  }
  [[nodiscard]] const double* q_mean_re(int layer, int head) const noexcept { return q_re_.data() + offset(layer, head); }  // [F]
  [[nodiscard]] const double* q_mean_im(int layer, int head) const noexcept { return q_im_.data() + offset(layer, head); }  // [F]
  [[nodiscard]] const double* q_abs_mean(int layer, int head) const noexcept { return a_.data() + offset(layer, head); }   // [F] A_f
  [[nodiscard]] const double* q_mean_abs(int layer, int head) const noexcept { return q_abs_.data() + offset(layer, head); } // [F] |q̄_f|
  [[nodiscard]] const double* mlr_weight(int layer, int head) const noexcept { return c_.data() + offset(layer, head); }   // [F] c_f

  /// Folded weights for a round starting at logical position t0 (mean aggregation; usable for
  /// any aggregation with disable_trig, where W = 0).
  /// @throws triattn::logic_error when t0 < 0.
  [[nodiscard]] FoldedWeights fold(long long t0) const {
    TRIATTN_EXPECTS(t0 >= 0, "TriAttentionModel::fold: t0 must be >= 0, got " + std::to_string(t0));
    FoldedWeights w;
    w.num_layers = L_;
    w.num_q_heads = Hq_;
    w.num_freqs = F_;
    const std::size_t n = q_re_.size();
    w.w_re.assign(n, 0.0f);
    w.w_im.assign(n, 0.0f);
    w.c.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const int f = static_cast<int>(i % F_);
      w.c[i] = static_cast<float>(c_[i]);
      if (params_.disable_trig) continue;
      fold_weight(q_re_[i], q_im_[i], c_re_[f], c_im_[f], omega_[f], t0, s2_, &w.w_re[i], &w.w_im[i]);
    }
    return w;
  }

  /// Per-offset weights W_f(δ) = s²·q̄_f·e^{i(t0+δ)ω_f} for max aggregation (phase in float64).
  /// @throws triattn::logic_error when t0 < 0.
  [[nodiscard]] MaxWeights fold_per_offset(long long t0) const {
    TRIATTN_EXPECTS(t0 >= 0, "TriAttentionModel::fold_per_offset: t0 must be >= 0, got " + std::to_string(t0));
    MaxWeights w;
    w.num_layers = L_;
    w.num_q_heads = Hq_;
    w.num_offsets = num_offsets();
    w.num_freqs = F_;
    const int D = num_offsets();
    w.w_re.assign(static_cast<std::size_t>(L_) * Hq_ * D * F_, 0.0f);
    w.w_im.assign(w.w_re.size(), 0.0f);
    w.c.resize(c_.size());
    for (std::size_t i = 0; i < c_.size(); ++i) w.c[i] = static_cast<float>(c_[i]);
    if (params_.disable_trig) return w;
    for (int l = 0; l < L_; ++l) {
      for (int h = 0; h < Hq_; ++h) {
        const std::size_t src = offset(l, h);
        float* wr = w.w_re.data() + w.w_offset(l, h);
        float* wi = w.w_im.data() + w.w_offset(l, h);
        for (int o = 0; o < D; ++o) {
          const long long t = t0 + static_cast<long long>(offsets_[o]);
          for (int f = 0; f < F_; ++f)
            fold_weight(q_re_[src + f], q_im_[src + f], 1.0, 0.0, omega_[f], t, s2_, &wr[o * F_ + f], &wi[o * F_ + f]);
        }
      }
    }
    return w;
  }

 private:
  ScoringParams params_;
  RopeStyle style_;
  int L_ = 0, Hq_ = 0, Hkv_ = 0, d_ = 0, F_ = 0;
  double s2_ = 1.0;
  std::vector<double> omega_;    // [F]
  std::vector<double> offsets_;  // [|D|]
  std::vector<double> c_re_;     // [F]
  std::vector<double> c_im_;     // [F]
  std::vector<double> q_re_;     // [L, Hq, F]
  std::vector<double> q_im_;     // [L, Hq, F]
  std::vector<double> a_;        // [L, Hq, F]
  std::vector<double> q_abs_;    // [L, Hq, F]
  std::vector<double> c_;        // [L, Hq, F]
};

/// Scores every cached key of one sequence for every (layer, query head), as the KvCache scorer
/// policy does on the host. keys(layer, kv_head, slot) returns a pointer to the slot's d key
/// floats (already rotated); query head h reads KV head h / (Hq / Hkv). Mean aggregation (or
/// disable_trig) uses the fold; max aggregation the per-offset weights.
/// @param length number of cached slots T
/// @param out    [L, Hq, T] scores
/// @throws triattn::logic_error when t0 < 0, length < 0 or out is null with length > 0.
template <class KeyAccessor>
  requires std::invocable<KeyAccessor&, int, int, int> &&
           std::convertible_to<std::invoke_result_t<KeyAccessor&, int, int, int>, const float*>
void score_sequence(const TriAttentionModel& m, long long t0, KeyAccessor&& keys, int length, float* out) {
  TRIATTN_EXPECTS(length >= 0, "score_sequence: length must be >= 0, got " + std::to_string(length));
  TRIATTN_EXPECTS(t0 >= 0, "score_sequence: t0 must be >= 0, got " + std::to_string(t0));
  if (length == 0) return;
  TRIATTN_EXPECTS(out != nullptr, "score_sequence: out is null");
  const int L = m.num_layers(), Hq = m.num_q_heads(), Hkv = m.num_kv_heads(), G = m.group_size();
  const int d = m.head_dim();
  const auto row = [&](int l, int h) { return out + (static_cast<std::size_t>(l) * Hq + h) * static_cast<std::size_t>(length); };
  if (m.params().aggregation == Aggregation::kMean || m.params().disable_trig) {
    const FoldedWeights w = m.fold(t0);
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < Hkv; ++g)
        for (int j = 0; j < length; ++j) {
          const float* k = keys(l, g, j);  // each key is read once for its G query heads
          for (int h = g * G; h < (g + 1) * G; ++h) {
            const std::size_t o = w.offset(l, h);
            row(l, h)[j] = score_key_folded(k, w.w_re.data() + o, w.w_im.data() + o, w.c.data() + o, d, m.style());
          }
        }
    return;
  }
  const MaxWeights w = m.fold_per_offset(t0);
  for (int l = 0; l < L; ++l)
    for (int g = 0; g < Hkv; ++g)
      for (int j = 0; j < length; ++j) {
        const float* k = keys(l, g, j);
        for (int h = g * G; h < (g + 1) * G; ++h) {
          const std::size_t o = w.w_offset(l, h);
          row(l, h)[j] = score_key_max(k, w.w_re.data() + o, w.w_im.data() + o, w.c.data() + w.c_offset(l, h),
                                       w.num_offsets, d, m.style());
        }
      }
}

}  // namespace triattn

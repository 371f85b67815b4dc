// SPDX-License-Identifier: Apache-2.0
// Streaming computation of QueryStats from pre-RoPE queries, for models without published
// statistics. Feed each layer's queries as they are produced (any layer order, any chunking);
// sums are kept in float64 per (layer, head, frequency) together with a per-layer token count,
// so the result does not depend on how tokens were chunked and loses no precision over millions
// of tokens. finish() divides in float64 and rounds once to float.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/query_stats.hpp>
#include <triattn/core/stats/safetensors.hpp>

namespace triattn {

class Calibrator {
 public:
  /// Throws logic_error for a geometry outside the supported range or an odd head_dim.
  Calibrator(int num_layers, int num_q_heads, int head_dim, RopeStyle style, std::string model_name)
      : num_layers_(num_layers), num_q_heads_(num_q_heads), head_dim_(head_dim), style_(style),
        model_name_(std::move(model_name)) {
    if (auto p = detail::geometry_problem(num_layers, num_q_heads, head_dim)) throw logic_error("Calibrator: " + *p);
    if (style != RopeStyle::kHalf && style != RopeStyle::kInterleaved) throw logic_error("Calibrator: bad RopeStyle");
    const std::size_t n = static_cast<std::size_t>(num_layers) * num_q_heads * (head_dim / 2);
    sum_re_.assign(n, 0.0);
    sum_im_.assign(n, 0.0);
    sum_abs_.assign(n, 0.0);
    tokens_.assign(static_cast<std::size_t>(num_layers), 0);
  }

  /// Accumulates `n_tokens` pre-RoPE queries of `layer`. `q` is [n_tokens, num_q_heads, head_dim],
  /// row-major float32. Throws logic_error (and leaves the sums untouched) for a bad layer or
  /// token count, a null pointer or a non-finite value.
  void add(int layer, const float* q /* [n_tokens, num_q_heads, head_dim] */, int n_tokens) {
    if (layer < 0 || layer >= num_layers_)
      throw logic_error("Calibrator::add: layer " + std::to_string(layer) + " is outside [0, " +
                        std::to_string(num_layers_) + ")");
    if (n_tokens < 0) throw logic_error("Calibrator::add: negative token count " + std::to_string(n_tokens));
    if (n_tokens == 0) return;
    if (q == nullptr) throw logic_error("Calibrator::add: null query pointer");
    const std::size_t total = static_cast<std::size_t>(n_tokens) * num_q_heads_ * head_dim_;
    for (std::size_t i = 0; i < total; ++i) {  // validate first: a NaN would poison the sums for good
      if (std::isfinite(q[i])) continue;
      const std::size_t per_token = static_cast<std::size_t>(num_q_heads_) * head_dim_;
      throw logic_error("Calibrator::add: layer " + std::to_string(layer) + " token " + std::to_string(i / per_token) +
                        " head " + std::to_string(i % per_token / head_dim_) + " dim " +
                        std::to_string(i % head_dim_) + " is not finite");
    }
    const int nf = head_dim_ / 2;
    // half: z_f = (x[f], x[f + F]); interleaved: z_f = (x[2f], x[2f + 1]).
    const std::size_t re_step = style_ == RopeStyle::kHalf ? 1 : 2;
    const std::size_t im_base = style_ == RopeStyle::kHalf ? static_cast<std::size_t>(nf) : 1;
    for (int t = 0; t < n_tokens; ++t) {
      for (int h = 0; h < num_q_heads_; ++h) {
        const float* x = q + (static_cast<std::size_t>(t) * num_q_heads_ + h) * head_dim_;
        const std::size_t base = (static_cast<std::size_t>(layer) * num_q_heads_ + h) * nf;
        for (int f = 0; f < nf; ++f) {
          const double re = x[re_step * f], im = x[im_base + re_step * f];
          sum_re_[base + f] += re;
          sum_im_[base + f] += im;
          sum_abs_[base + f] += std::sqrt(re * re + im * im);
        }
      }
    }
    tokens_[static_cast<std::size_t>(layer)] += n_tokens;
  }

  [[nodiscard]] std::int64_t token_count(int layer) const {
    if (layer < 0 || layer >= num_layers_) throw logic_error("Calibrator::token_count: bad layer " + std::to_string(layer));
    return tokens_[static_cast<std::size_t>(layer)];
  }

  /// Means so far. Throws logic_error naming the first layer that received no tokens.
  [[nodiscard]] QueryStats finish() const {
    for (int l = 0; l < num_layers_; ++l)
      if (tokens_[static_cast<std::size_t>(l)] == 0)
        throw logic_error("Calibrator::finish: layer " + std::to_string(l) + " received no tokens");
    QueryStats out;
    out.model_name = model_name_;
    out.rope_style = style_;
    out.num_layers = num_layers_;
    out.num_q_heads = num_q_heads_;
    out.head_dim = head_dim_;
    out.first_q_head = 0;
    const std::size_t per_layer = static_cast<std::size_t>(num_q_heads_) * (head_dim_ / 2);
    out.q_mean_real.resize(sum_re_.size());
    out.q_mean_imag.resize(sum_re_.size());
    out.q_abs_mean.resize(sum_re_.size());
    for (std::size_t i = 0; i < sum_re_.size(); ++i) {
      const double n = static_cast<double>(tokens_[i / per_layer]);
      out.q_mean_real[i] = static_cast<float>(sum_re_[i] / n);
      out.q_mean_imag[i] = static_cast<float>(sum_im_[i] / n);
      out.q_abs_mean[i] = static_cast<float>(sum_abs_[i] / n);
    }
    return out;
  }

  /// finish() written in the native safetensors format.
  void save(const std::string& path) const { save_safetensors_stats(path, finish()); }

  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] int num_q_heads() const noexcept { return num_q_heads_; }
  [[nodiscard]] int head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] RopeStyle rope_style() const noexcept { return style_; }

 private:
  int num_layers_;
  int num_q_heads_;
  int head_dim_;
  RopeStyle style_;
  std::string model_name_;
  std::vector<double> sum_re_;        // [num_layers, num_q_heads, F]  sum_t Re z_f
  std::vector<double> sum_im_;        // [num_layers, num_q_heads, F]  sum_t Im z_f
  std::vector<double> sum_abs_;       // [num_layers, num_q_heads, F]  sum_t |z_f|
  std::vector<std::int64_t> tokens_;  // [num_layers] tokens seen per layer
};

}  // namespace triattn

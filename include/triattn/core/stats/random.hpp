// SPDX-License-Identifier: Apache-2.0
// Synthetic query statistics for tests, benchmarks and demos (not calibrated, not a model's):
// per (layer, query head, frequency) a mean |z_f| in [0.05, 3), a centre of random phase whose
// length is a uniform fraction of it, so every published invariant (|E z| <= E|z|) holds.
#pragma once

#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <utility>

#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {

/// Statistics of shape [num_layers, num_q_heads, head_dim / 2] drawn from `rng` (the same rng
/// state gives the same statistics). Throws logic_error for a non-positive shape or odd head_dim.
template <class Rng>
[[nodiscard]] QueryStats random_query_stats(Rng& rng, int num_layers, int num_q_heads, int head_dim,
                                            RopeStyle style = RopeStyle::kHalf, std::string name = "random") {
  TRIATTN_EXPECTS(num_layers > 0 && num_q_heads > 0 && head_dim > 0 && head_dim % 2 == 0,
                  "random_query_stats: shape (" + std::to_string(num_layers) + ", " + std::to_string(num_q_heads) +
                      ", " + std::to_string(head_dim) + ") needs positive sizes and an even head_dim");
  QueryStats s;
  s.model_name = std::move(name);
  s.rope_style = style;
  s.num_layers = num_layers;
  s.num_q_heads = num_q_heads;
  s.head_dim = head_dim;
  const std::size_t n = static_cast<std::size_t>(num_layers) * num_q_heads * (head_dim / 2);
  std::uniform_real_distribution<float> ua(0.05f, 3.0f), uu(0.0f, 1.0f), ang(-3.14159f, 3.14159f);
  s.q_mean_real.resize(n);
  s.q_mean_imag.resize(n);
  s.q_abs_mean.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float a = ua(rng), r = a * uu(rng), t = ang(rng);  // draw order fixed: reproducible
    s.q_abs_mean[i] = a;
    s.q_mean_real[i] = r * std::cos(t);
    s.q_mean_imag[i] = r * std::sin(t);
  }
  return s;
}

}  // namespace triattn

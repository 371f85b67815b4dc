// SPDX-License-Identifier: Apache-2.0
// Per-layer concentration summary of QueryStats. R_f = |E[z_f]| / E[|z_f|] is 1 when a query
// frequency always points the same way (the trigonometric score term then predicts attention
// well) and near 0 when it is spread evenly; TriAttention's scoring leans on the first term where
// R is high. The CLI prints the mean, min and max of R over all heads and frequencies per layer.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {

/// R = |q_mean| / q_abs_mean over one layer's heads x frequencies.
struct LayerConcentration {
  int layer = 0;
  double mean = 0.0;
  double min = 0.0;
  double max = 0.0;
};

/// Concentration of one (layer, head, f) element; 0 where q_abs_mean is 0 (no signal at all).
[[nodiscard]] inline double concentration(const QueryStats& s, int layer, int head, int f) {
  const std::size_t i = s.offset(layer, head) + static_cast<std::size_t>(f);
  const double re = s.q_mean_real[i], im = s.q_mean_imag[i], abs_mean = s.q_abs_mean[i];
  return abs_mean > 0.0 ? std::sqrt(re * re + im * im) / abs_mean : 0.0;
}

/// One entry per layer, in layer order. Throws logic_error for a malformed `stats`.
[[nodiscard]] inline std::vector<LayerConcentration> concentration_by_layer(const QueryStats& stats) {
  if (auto p = detail::stats_shape_problem(stats)) throw logic_error("concentration_by_layer: " + *p);
  std::vector<LayerConcentration> out;
  out.reserve(static_cast<std::size_t>(stats.num_layers));
  const int nf = stats.num_freqs();
  for (int l = 0; l < stats.num_layers; ++l) {
    LayerConcentration c{l, 0.0, 1e300, -1e300};
    double sum = 0.0;
    for (int h = 0; h < stats.num_q_heads; ++h) {
      for (int f = 0; f < nf; ++f) {
        const double r = concentration(stats, l, h, f);
        sum += r;
        c.min = std::min(c.min, r);
        c.max = std::max(c.max, r);
      }
    }
    c.mean = sum / (static_cast<double>(stats.num_q_heads) * nf);
    out.push_back(c);
  }
  return out;
}

}  // namespace triattn

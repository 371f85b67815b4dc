// SPDX-License-Identifier: Apache-2.0
// Calibrated per-(layer, query head) pre-RoPE query statistics that drive the TriAttention scorer.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>

namespace triattn {

/// Per (layer, query head) statistics in complex form, F = head_dim / 2 frequencies:
/// q_mean = E[z_f] (real, imag) and q_abs_mean = E[|z_f|], z_f the f-th pair of the pre-RoPE query.
/// Storage is dense and layer-major: index ((layer * num_q_heads) + head) * F + f.
struct QueryStats {
  std::string model_name;               ///< e.g. "Qwen/Qwen3-8B"
  RopeStyle rope_style = RopeStyle::kHalf;
  int num_layers = 0;
  int num_q_heads = 0;                  ///< heads held here (a tensor-parallel slice holds a share)
  int head_dim = 0;                     ///< d; F = d / 2
  int first_q_head = 0;                 ///< global index of local head 0 (non-zero for TP slices)
  std::vector<float> q_mean_real;       // [num_layers, num_q_heads, F]
  std::vector<float> q_mean_imag;       // [num_layers, num_q_heads, F]
  std::vector<float> q_abs_mean;        // [num_layers, num_q_heads, F]

  [[nodiscard]] int num_freqs() const noexcept { return head_dim / 2; }
  [[nodiscard]] std::size_t offset(int layer, int head) const noexcept {
    return (static_cast<std::size_t>(layer) * num_q_heads + head) * static_cast<std::size_t>(num_freqs());
  }
  [[nodiscard]] const float* mean_real(int layer, int head) const noexcept { return q_mean_real.data() + offset(layer, head); }
  [[nodiscard]] const float* mean_imag(int layer, int head) const noexcept { return q_mean_imag.data() + offset(layer, head); }
  [[nodiscard]] const float* abs_mean(int layer, int head) const noexcept { return q_abs_mean.data() + offset(layer, head); }
};

}  // namespace triattn

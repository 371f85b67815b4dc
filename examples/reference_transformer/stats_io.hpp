// SPDX-License-Identifier: Apache-2.0
// TriAttention statistics for a model: loaded from a file (.pt as TriAttention writes it, or
// triattn's .safetensors) and checked against the model's shape, and the model's RoPE as the
// scorers take it. Shared by reference_transformer and the serving example.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/file_io.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/pt_loader.hpp>
#include <triattn/core/stats/safetensors.hpp>

#include "model_config.hpp"

namespace triattn_example {

/// Statistics of `path` (a regular file within triattn::kMaxStatsFileBytes), checked against
/// mc's layers, query heads, head_dim and RoPE style. @throws the loaders' errors naming the file.
[[nodiscard]] inline triattn::QueryStats load_stats(const std::string& path, const ModelConfig& mc) {
  triattn::StatsExpectation expect;
  expect.num_layers = mc.n_layers;
  expect.num_q_heads = mc.n_heads;
  expect.head_dim = mc.head_dim;
  expect.rope_style = mc.rope_style;
  const auto bytes = triattn::read_regular_file<std::vector<std::uint8_t>>(path, triattn::kMaxStatsFileBytes, "--stats");
  if (bytes.size() >= 2 && bytes[0] == 'P' && bytes[1] == 'K')
    return triattn::load_pt_stats(std::span<const std::uint8_t>(bytes), path, expect);  // torch.save zip
  return triattn::load_safetensors_stats(std::span<const std::uint8_t>(bytes), path, expect);
}

/// The model's RoPE, as the TriAttention scorers take it.
[[nodiscard]] inline triattn::RopeConfig rope_config(const ModelConfig& mc) {
  triattn::RopeConfig rope;
  rope.style = mc.rope_style;
  rope.theta = mc.rope_theta;
  return rope;
}

}  // namespace triattn_example

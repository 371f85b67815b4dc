// SPDX-License-Identifier: Apache-2.0
// Deterministic synthetic models: any Llama-family shape with weights drawn from a seeded,
// counter-based generator (value = f(seed, tensor, index)), so the same weights can be produced
// on the host or, later, directly on a GPU without a host copy of a multi-GiB model.
//
// Scales keep activations sane at any width: projections into a space of width `in` are
// uniform with standard deviation 1/sqrt(in); the embedding has std 1; RMSNorm weights are
// 1 ± 0.1. Queries get a fixed per-(layer, head) bias of std kQueryBiasStd, so each head's
// pre-RoPE queries concentrate around a non-zero centre (what TriAttention statistics measure).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/hash.hpp>
#include <triattn/core/rope_types.hpp>

#include "model_config.hpp"

namespace triattn_example {

/// Tensor ids of the synthetic generator (part of the value function: keep them stable).
enum class SynthTensor : std::uint32_t {
  kTokEmb = 1, kRmsAtt, kWq, kWk, kWv, kWo, kRmsFfn, kW1, kW2, kW3, kRmsFinal, kWcls, kBq,
};

inline constexpr float kQueryBiasStd = 1.0f;

using triattn::mix64;  // the library's seeded hash, shared with the device generators

/// Uniform value in [-1, 1) for (seed, tensor, index), 24 random bits, exact in float.
constexpr float synthetic_uniform(std::uint64_t seed, SynthTensor tensor, std::uint64_t index) noexcept {
  const std::uint64_t h = mix64(mix64(seed ^ (static_cast<std::uint64_t>(tensor) << 56)) ^ index);
  return static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/// Value with standard deviation `std` (uniform on [-√3·std, √3·std)).
inline float synthetic_value(std::uint64_t seed, SynthTensor tensor, std::uint64_t index, float std_dev) noexcept {
  return synthetic_uniform(seed, tensor, index) * (1.7320508075688772f * std_dev);
}

/// Shapes by name: "tiny" (CPU tests), "small", "qwen3-8b-like" (36 layers, hidden 4096, 32 q / 8
/// KV heads, d = 128, intermediate 12288, vocab 151936, half pairing, θ = 1e6; ~30 GB of float32
/// weights, meant for the GPU path). layers / vocab > 0 override the shape's layer count and
/// vocabulary (--synthetic-layers / --synthetic-vocab). @throws triattn::logic_error for an
/// unknown name.
inline ModelConfig synthetic_config(std::string_view shape, int layers = 0, int vocab = 0) {
  ModelConfig c;
  c.name = "synthetic-" + std::string(shape);
  c.rope_style = triattn::RopeStyle::kHalf;
  c.rope_f32_angles = false;
  c.shared_classifier = false;
  c.has_qkv_bias = true;
  c.rms_eps = 1e-5f;
  c.bos_id = 1;
  c.eos_id = 2;
  if (shape == "tiny") {
    c.dim = 64, c.hidden_dim = 128, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16;
    c.vocab_size = 512, c.rope_theta = 10000.0;
  } else if (shape == "small") {
    c.dim = 256, c.hidden_dim = 768, c.n_layers = 4, c.n_heads = 8, c.n_kv_heads = 2, c.head_dim = 32;
    c.vocab_size = 1024, c.rope_theta = 1e6;
  } else if (shape == "qwen3-8b-like") {
    c.dim = 4096, c.hidden_dim = 12288, c.n_layers = 36, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128;
    c.vocab_size = 151936, c.rope_theta = 1e6;
  } else {
    TRIATTN_FAIL("synthetic_config: unknown shape '" + std::string(shape) + "' (tiny, small, qwen3-8b-like)");
  }
  if (layers > 0) c.n_layers = layers;
  if (vocab > 0) c.vocab_size = vocab;
  return c;
}

/// Bytes of float32 weights a config needs.
inline std::size_t weight_bytes(const ModelConfig& c) { return c.parameter_count() * sizeof(float); }

/// Fills every tensor of `c` from the counter-based generator. Deterministic in (c, seed).
inline ModelWeights make_synthetic_weights(const ModelConfig& c, std::uint64_t seed) {
  c.validate();
  ModelWeights w;
  w.config = c;
  auto fill = [&](std::vector<float>& t, std::size_t n, SynthTensor id, float std_dev, float mean = 0.0f) {
    t.resize(n);
    for (std::size_t i = 0; i < n; ++i) t[i] = mean + synthetic_value(seed, id, i, std_dev);
  };
  const float s_dim = 1.0f / std::sqrt(static_cast<float>(c.dim));
  fill(w.tok_emb, c.n_tok_emb(), SynthTensor::kTokEmb, 1.0f);
  fill(w.rms_att, c.n_rms(), SynthTensor::kRmsAtt, 0.1f / 1.7320508f, 1.0f);
  fill(w.wq, c.n_wq(), SynthTensor::kWq, s_dim);
  fill(w.wk, c.n_wkv(), SynthTensor::kWk, s_dim);
  fill(w.wv, c.n_wkv(), SynthTensor::kWv, s_dim);
  fill(w.wo, c.n_wo(), SynthTensor::kWo, 1.0f / std::sqrt(static_cast<float>(c.q_dim())));
  fill(w.rms_ffn, c.n_rms(), SynthTensor::kRmsFfn, 0.1f / 1.7320508f, 1.0f);
  fill(w.w1, c.n_mlp(), SynthTensor::kW1, s_dim);
  fill(w.w2, c.n_mlp(), SynthTensor::kW2, 1.0f / std::sqrt(static_cast<float>(c.hidden_dim)));
  fill(w.w3, c.n_mlp(), SynthTensor::kW3, s_dim);
  fill(w.rms_final, static_cast<std::size_t>(c.dim), SynthTensor::kRmsFinal, 0.1f / 1.7320508f, 1.0f);
  if (!c.shared_classifier) fill(w.wcls, c.n_tok_emb(), SynthTensor::kWcls, 2.0f * s_dim);
  if (c.has_qkv_bias) {
    const std::size_t L = static_cast<std::size_t>(c.n_layers);
    fill(w.bq, L * static_cast<std::size_t>(c.q_dim()), SynthTensor::kBq, kQueryBiasStd);
    w.bk.assign(L * static_cast<std::size_t>(c.kv_dim()), 0.0f);
    w.bv.assign(L * static_cast<std::size_t>(c.kv_dim()), 0.0f);
  }
  w.validate();
  return w;
}

}  // namespace triattn_example

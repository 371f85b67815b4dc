// SPDX-License-Identifier: Apache-2.0
// Shape and weights of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied or
// separate classifier), as plain host data. Loaders (llama2c.hpp) and the synthetic generator
// (synthetic.hpp) produce a ModelWeights; Model<Backend> (model.hpp) runs it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>

namespace triattn_example {

/// Everything the forward pass needs to know about the model's shape and conventions.
struct ModelConfig {
  std::string name = "model";
  int dim = 0;            ///< residual stream width
  int hidden_dim = 0;     ///< MLP intermediate size
  int n_layers = 0;
  int n_heads = 0;        ///< query heads
  int n_kv_heads = 0;     ///< key/value heads (GQA: n_heads / n_kv_heads query heads share one)
  int head_dim = 0;       ///< per-head width (llama2.c: dim / n_heads; Qwen3: 128 with dim 4096)
  int vocab_size = 0;
  int max_seq_len = 0;    ///< the checkpoint's nominal context (llama2.c seq_len); 0 = not stated
  bool shared_classifier = true;  ///< logits = tok_emb · x (else a separate wcls)
  bool has_qkv_bias = false;      ///< bq/bk/bv added to the projections (pre-RoPE)
  triattn::RopeStyle rope_style = triattn::RopeStyle::kHalf;
  double rope_theta = 10000.0;
  /// true: llama2.c's float32 angle arithmetic (freq = 1/powf, angle = (float)pos * freq, cosf);
  /// false: float64 angles (triattn::apply_rope), what the TriAttention scorer assumes.
  bool rope_f32_angles = false;
  float rms_eps = 1e-5f;
  int bos_id = 1;
  int eos_id = 2;

  [[nodiscard]] int q_dim() const noexcept { return n_heads * head_dim; }
  [[nodiscard]] int kv_dim() const noexcept { return n_kv_heads * head_dim; }
  [[nodiscard]] int group_size() const noexcept { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }

  /// The attention shape the KV cache is configured with.
  [[nodiscard]] triattn::ModelGeometry geometry() const noexcept {
    return triattn::ModelGeometry{n_layers, n_heads, n_kv_heads, head_dim};
  }

  // Element counts of each tensor (all layers stacked).
  [[nodiscard]] std::size_t n_tok_emb() const noexcept { return sz(vocab_size) * sz(dim); }
  [[nodiscard]] std::size_t n_rms() const noexcept { return sz(n_layers) * sz(dim); }
  [[nodiscard]] std::size_t n_wq() const noexcept { return sz(n_layers) * sz(q_dim()) * sz(dim); }
  [[nodiscard]] std::size_t n_wkv() const noexcept { return sz(n_layers) * sz(kv_dim()) * sz(dim); }
  [[nodiscard]] std::size_t n_wo() const noexcept { return sz(n_layers) * sz(dim) * sz(q_dim()); }
  [[nodiscard]] std::size_t n_mlp() const noexcept { return sz(n_layers) * sz(hidden_dim) * sz(dim); }

  /// Parameters (not counting llama2.c's legacy freq_cis tables).
  [[nodiscard]] std::size_t parameter_count() const noexcept {
    std::size_t n = n_tok_emb() + 2 * n_rms() + n_wq() + 2 * n_wkv() + n_wo() + 3 * n_mlp() + sz(dim);
    if (!shared_classifier) n += n_tok_emb();
    if (has_qkv_bias) n += sz(n_layers) * (sz(q_dim()) + 2 * sz(kv_dim()));
    return n;
  }

  /// @throws triattn::logic_error naming the first bad field.
  void validate() const {
    TRIATTN_EXPECTS(dim > 0, "model " + name + ": dim = " + std::to_string(dim) + " must be positive");
    TRIATTN_EXPECTS(hidden_dim > 0, "model " + name + ": hidden_dim = " + std::to_string(hidden_dim) + " must be positive");
    TRIATTN_EXPECTS(vocab_size > 0, "model " + name + ": vocab_size = " + std::to_string(vocab_size) + " must be positive");
    TRIATTN_EXPECTS(rms_eps > 0.0f, "model " + name + ": rms_eps must be positive");
    TRIATTN_EXPECTS(rope_theta > 1.0, "model " + name + ": rope_theta must be > 1");
    TRIATTN_EXPECTS(rope_style == triattn::RopeStyle::kHalf || rope_style == triattn::RopeStyle::kInterleaved,
                    "model " + name + ": invalid rope_style");
    geometry().validate();
  }

 private:
  static std::size_t sz(int v) noexcept { return static_cast<std::size_t>(v); }
};

/// All weights as float32 host arrays. Matrices are row-major [out][in] (PyTorch nn.Linear), so
/// y[i] = Σ_j W[i*in + j] x[j]; every tensor stacks all layers (layer l starts at l * per-layer).
struct ModelWeights {
  ModelConfig config;
  std::vector<float> tok_emb;    ///< [vocab, dim]
  std::vector<float> rms_att;    ///< [L, dim]
  std::vector<float> wq;         ///< [L, Hq*d, dim]
  std::vector<float> wk;         ///< [L, Hkv*d, dim]
  std::vector<float> wv;         ///< [L, Hkv*d, dim]
  std::vector<float> wo;         ///< [L, dim, Hq*d]
  std::vector<float> rms_ffn;    ///< [L, dim]
  std::vector<float> w1;         ///< [L, hidden, dim] gate
  std::vector<float> w2;         ///< [L, dim, hidden] down
  std::vector<float> w3;         ///< [L, hidden, dim] up
  std::vector<float> rms_final;  ///< [dim]
  std::vector<float> wcls;       ///< [vocab, dim]; empty when shared_classifier
  std::vector<float> bq, bk, bv; ///< [L, Hq*d], [L, Hkv*d], [L, Hkv*d]; empty unless has_qkv_bias

  [[nodiscard]] const float* classifier() const noexcept {
    return config.shared_classifier ? tok_emb.data() : wcls.data();
  }

  /// Checks the config and that every tensor has its expected size.
  void validate() const {
    config.validate();
    const ModelConfig& c = config;
    check(tok_emb, c.n_tok_emb(), "tok_emb");
    check(rms_att, c.n_rms(), "rms_att");
    check(wq, c.n_wq(), "wq");
    check(wk, c.n_wkv(), "wk");
    check(wv, c.n_wkv(), "wv");
    check(wo, c.n_wo(), "wo");
    check(rms_ffn, c.n_rms(), "rms_ffn");
    check(w1, c.n_mlp(), "w1");
    check(w2, c.n_mlp(), "w2");
    check(w3, c.n_mlp(), "w3");
    check(rms_final, static_cast<std::size_t>(c.dim), "rms_final");
    check(wcls, c.shared_classifier ? 0 : c.n_tok_emb(), "wcls");
    const std::size_t L = static_cast<std::size_t>(c.n_layers);
    check(bq, c.has_qkv_bias ? L * static_cast<std::size_t>(c.q_dim()) : 0, "bq");
    check(bk, c.has_qkv_bias ? L * static_cast<std::size_t>(c.kv_dim()) : 0, "bk");
    check(bv, c.has_qkv_bias ? L * static_cast<std::size_t>(c.kv_dim()) : 0, "bv");
  }

 private:
  void check(const std::vector<float>& t, std::size_t expect, const char* what) const {
    TRIATTN_EXPECTS(t.size() == expect, "model " + config.name + ": tensor " + what + " has " +
                                            std::to_string(t.size()) + " elements, expected " + std::to_string(expect));
  }
};

}  // namespace triattn_example

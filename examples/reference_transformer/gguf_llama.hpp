// SPDX-License-Identifier: Apache-2.0
// A GGUF file of general.architecture = "llama" (SmolLM2, TinyLlama, Llama 2 ...) as a
// ModelWeights: the shape from the llama.* metadata, every tensor dequantised to float32 and
// checked against the shape it must have.
//
// RoPE: llama.cpp's converter permutes the rows of attn_q / attn_k so that RoPE rotates adjacent
// pairs (x[2f], x[2f+1]) by pos·θ^(-2f/d). The weights are kept as stored and the model runs
// RopeStyle::kInterleaved, which is llama.cpp's own convention: the cached keys, the pre-RoPE
// queries the calibrator averages and the scorer's frequency pairs all use the same pairing
// (pair f of a head is its entries 2f and 2f+1, frequency θ^(-2f/d)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>

#include "gguf.hpp"
#include "model_config.hpp"

namespace triattn_example {

/// Largest llama.* values accepted; beyond these the metadata is treated as corrupt.
struct GgufLlamaLimits {
  static constexpr std::int64_t kMaxDim = 1 << 16;
  static constexpr std::int64_t kMaxHidden = 1 << 18;
  static constexpr std::int64_t kMaxLayers = 1024;
  static constexpr std::int64_t kMaxHeads = 1024;
  static constexpr std::int64_t kMaxVocab = 1 << 22;
  static constexpr std::int64_t kMaxContext = std::int64_t{1} << 24;
};

/// The model's shape and conventions from a llama-architecture GGUF file's metadata.
/// @throws triattn::format_error naming the file and the key.
inline ModelConfig gguf_llama_config(const gguf::File& f) {
  const std::string& arch = f.get_string("general.architecture");
  if (arch != "llama")
    f.fail("general.architecture is \"" + arch + "\"; only \"llama\" models are supported");
  ModelConfig c;
  c.name = f.name();
  c.n_layers = static_cast<int>(f.get_int("llama.block_count", 1, GgufLlamaLimits::kMaxLayers));
  c.dim = static_cast<int>(f.get_int("llama.embedding_length", 2, GgufLlamaLimits::kMaxDim));
  c.hidden_dim = static_cast<int>(f.get_int("llama.feed_forward_length", 1, GgufLlamaLimits::kMaxHidden));
  c.n_heads = static_cast<int>(f.get_int("llama.attention.head_count", 1, GgufLlamaLimits::kMaxHeads));
  c.n_kv_heads = f.has("llama.attention.head_count_kv")
                     ? static_cast<int>(f.get_int("llama.attention.head_count_kv", 1, GgufLlamaLimits::kMaxHeads))
                     : c.n_heads;
  if (c.dim % c.n_heads != 0)
    f.fail("llama.embedding_length = " + std::to_string(c.dim) + " is not a multiple of llama.attention.head_count = " +
           std::to_string(c.n_heads));
  if (c.n_heads % c.n_kv_heads != 0)
    f.fail("llama.attention.head_count_kv = " + std::to_string(c.n_kv_heads) +
           " does not divide llama.attention.head_count = " + std::to_string(c.n_heads));
  c.head_dim = c.dim / c.n_heads;
  if (f.has("llama.attention.key_length") &&
      f.get_int("llama.attention.key_length", 1, GgufLlamaLimits::kMaxDim) != c.head_dim)
    f.fail("llama.attention.key_length differs from embedding_length / head_count = " + std::to_string(c.head_dim));
  if (f.has("llama.attention.value_length") &&
      f.get_int("llama.attention.value_length", 1, GgufLlamaLimits::kMaxDim) != c.head_dim)
    f.fail("llama.attention.value_length differs from embedding_length / head_count = " + std::to_string(c.head_dim));
  if (c.head_dim % 2 != 0) f.fail("head_dim = " + std::to_string(c.head_dim) + " is odd (RoPE pairs)");
  if (f.has("llama.rope.dimension_count") &&
      f.get_int("llama.rope.dimension_count", 1, GgufLlamaLimits::kMaxDim) != c.head_dim)
    f.fail("llama.rope.dimension_count = " + std::to_string(f.get_int("llama.rope.dimension_count", 1, GgufLlamaLimits::kMaxDim)) +
           ": partial RoPE is not supported (head_dim is " + std::to_string(c.head_dim) + ")");
  if (f.has("llama.rope.scaling.type")) {
    const std::string& t = f.get_string("llama.rope.scaling.type");
    if (t != "none") f.fail("llama.rope.scaling.type = \"" + t + "\" is not supported");
  }
  c.max_seq_len = f.has("llama.context_length")
                      ? static_cast<int>(f.get_int("llama.context_length", 1, GgufLlamaLimits::kMaxContext))
                      : 0;
  c.rope_theta = f.has("llama.rope.freq_base") ? f.get_float("llama.rope.freq_base") : 10000.0;
  if (!(c.rope_theta > 1.0) || c.rope_theta > 1e12)
    f.fail("llama.rope.freq_base = " + std::to_string(c.rope_theta) + " is outside (1, 1e12]");
  const double eps = f.get_float("llama.attention.layer_norm_rms_epsilon");
  if (!(eps > 0.0 && eps < 1.0))
    f.fail("llama.attention.layer_norm_rms_epsilon = " + std::to_string(eps) + " is outside (0, 1)");
  c.rms_eps = static_cast<float>(eps);
  c.rope_style = triattn::RopeStyle::kInterleaved;  // the converter's row permutation (see above)
  c.rope_f32_angles = false;
  const gguf::TensorInfo* emb = f.find_tensor("token_embd.weight");
  if (emb == nullptr) f.fail("tensor token_embd.weight is missing");
  if (emb->shape.size() != 2) f.fail("tensor token_embd.weight has shape " + emb->shape_string() + ", expected 2 dimensions");
  if (emb->shape[1] > static_cast<std::uint64_t>(GgufLlamaLimits::kMaxVocab))
    f.fail("tensor token_embd.weight has " + std::to_string(emb->shape[1]) + " rows, more than " +
           std::to_string(GgufLlamaLimits::kMaxVocab));
  c.vocab_size = static_cast<int>(emb->shape[1]);
  if (f.has("llama.vocab_size") && f.get_int("llama.vocab_size", 1, GgufLlamaLimits::kMaxVocab) != c.vocab_size)
    f.fail("llama.vocab_size differs from the " + std::to_string(c.vocab_size) + " rows of token_embd.weight");
  c.shared_classifier = f.find_tensor("output.weight") == nullptr;
  c.has_qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.bos_id = f.has("tokenizer.ggml.bos_token_id")
                 ? static_cast<int>(f.get_int("tokenizer.ggml.bos_token_id", 0, c.vocab_size - 1))
                 : -1;
  c.eos_id = f.has("tokenizer.ggml.eos_token_id")
                 ? static_cast<int>(f.get_int("tokenizer.ggml.eos_token_id", 0, c.vocab_size - 1))
                 : -1;
  c.validate();
  return c;
}

/// All weights of a llama-architecture GGUF file as float32 (dequantised), checked: every tensor
/// the model needs is present with its exact shape, and no tensor is left unused.
/// @throws triattn::format_error naming the file and the tensor.
inline ModelWeights gguf_llama_weights(const gguf::File& f) {
  ModelWeights w;
  w.config = gguf_llama_config(f);
  const ModelConfig& c = w.config;
  const auto u = [](int v) { return static_cast<std::uint64_t>(v); };
  // Pass 1 lists every tensor with its shape (GGUF order {cols, rows}, or {n}), destination and
  // offset, and checks them all against the file; pass 2 allocates and dequantises. Nothing is
  // allocated for a file whose metadata claims more than its tensors hold.
  struct Item {
    std::string name;
    std::vector<std::uint64_t> shape;
    std::vector<float>* dst;
    std::size_t offset;
    const gguf::TensorInfo* info = nullptr;
  };
  std::vector<Item> items;
  items.push_back({"token_embd.weight", {u(c.dim), u(c.vocab_size)}, &w.tok_emb, 0});
  items.push_back({"output_norm.weight", {u(c.dim)}, &w.rms_final, 0});
  if (!c.shared_classifier) items.push_back({"output.weight", {u(c.dim), u(c.vocab_size)}, &w.wcls, 0});
  const std::size_t D = u(c.dim), QD = u(c.q_dim()), KVD = u(c.kv_dim()), H = u(c.hidden_dim);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    const std::size_t L = static_cast<std::size_t>(l);
    items.push_back({b + "attn_norm.weight", {D}, &w.rms_att, L * D});
    items.push_back({b + "attn_q.weight", {D, QD}, &w.wq, L * QD * D});
    items.push_back({b + "attn_k.weight", {D, KVD}, &w.wk, L * KVD * D});
    items.push_back({b + "attn_v.weight", {D, KVD}, &w.wv, L * KVD * D});
    items.push_back({b + "attn_output.weight", {QD, D}, &w.wo, L * D * QD});
    items.push_back({b + "ffn_norm.weight", {D}, &w.rms_ffn, L * D});
    items.push_back({b + "ffn_gate.weight", {D, H}, &w.w1, L * H * D});
    items.push_back({b + "ffn_down.weight", {H, D}, &w.w2, L * D * H});
    items.push_back({b + "ffn_up.weight", {D, H}, &w.w3, L * H * D});
    if (c.has_qkv_bias) {
      items.push_back({b + "attn_q.bias", {QD}, &w.bq, L * QD});
      items.push_back({b + "attn_k.bias", {KVD}, &w.bk, L * KVD});
      items.push_back({b + "attn_v.bias", {KVD}, &w.bv, L * KVD});
    }
  }
  std::set<std::string> used;
  for (Item& it : items) {
    it.info = f.find_tensor(it.name);
    if (it.info == nullptr) f.fail("tensor " + it.name + " is missing");
    if (it.info->shape != it.shape) {
      gguf::TensorInfo want;
      want.shape = it.shape;
      f.fail("tensor " + it.name + " has shape " + it.info->shape_string() + ", expected " + want.shape_string() +
             " for this model's metadata");
    }
    used.insert(it.name);
  }
  if (used.size() != f.tensors().size()) {
    for (const gguf::TensorInfo& t : f.tensors())  // name the first one the model does not read
      if (used.count(t.name) == 0)
        f.fail("tensor " + t.name + " is not part of a llama model as this loader reads it (" +
               std::to_string(f.tensors().size() - used.size()) + " tensor(s) unused)");
  }
  w.tok_emb.resize(c.n_tok_emb());
  w.rms_att.resize(c.n_rms());
  w.wq.resize(c.n_wq());
  w.wk.resize(c.n_wkv());
  w.wv.resize(c.n_wkv());
  w.wo.resize(c.n_wo());
  w.rms_ffn.resize(c.n_rms());
  w.w1.resize(c.n_mlp());
  w.w2.resize(c.n_mlp());
  w.w3.resize(c.n_mlp());
  w.rms_final.resize(D);
  if (!c.shared_classifier) w.wcls.resize(c.n_tok_emb());
  if (c.has_qkv_bias) {
    w.bq.resize(u(c.n_layers) * QD);
    w.bk.resize(u(c.n_layers) * KVD);
    w.bv.resize(u(c.n_layers) * KVD);
  }
  for (const Item& it : items)
    f.dequantize(*it.info, std::span<float>(it.dst->data() + it.offset, static_cast<std::size_t>(it.info->n_elements)));
  w.validate();
  return w;
}

/// Loads a llama-architecture GGUF model file. @throws triattn::format_error.
inline ModelWeights load_gguf_llama(const std::string& path) { return gguf_llama_weights(gguf::File::load(path)); }

}  // namespace triattn_example

// SPDX-License-Identifier: Apache-2.0
// Test-only GGUF writer: builds small GGUF files in memory (metadata of every type, tensors of
// the dequantised types with block encoders written independently of the reader), and records
// where each tensor's directory fields lie so that tests can corrupt them. Used by
// tests/core/test_gguf.cpp and fuzz/make_seeds.cpp. Plain host C++.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <triattn/core/dtype.hpp>

namespace triattn::test {

class GgufBuilder {
 public:
  // Value type ids of the GGUF spec.
  enum : std::uint32_t { kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
                         kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12 };
  // Tensor type ids (ggml).
  enum : std::uint32_t { tF32 = 0, tF16 = 1, tQ4_0 = 2, tQ4_1 = 3, tQ8_0 = 8, tBF16 = 30 };

  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> shape;
    std::uint32_t type = tF32;
    std::vector<std::uint8_t> data;
    std::vector<float> expect;  ///< what a correct reader dequantises the data to
  };
  /// Where build() put a tensor's directory fields (byte offsets in the file).
  struct Fields {
    std::size_t dims = 0, type = 0, offset = 0, data = 0;
  };

  std::uint32_t version = 3;
  std::uint32_t alignment = 32;  ///< used for layout; written as general.alignment only if set via kv
  std::vector<Tensor> tensors;
  std::vector<Fields> fields;  ///< filled by build()

  void kv_u32(const std::string& k, std::uint32_t v) { key(k, kU32); put(v); }
  void kv_i32(const std::string& k, std::int32_t v) { key(k, kI32); put(v); }
  void kv_u64(const std::string& k, std::uint64_t v) { key(k, kU64); put(v); }
  void kv_f32(const std::string& k, float v) { key(k, kF32); put(v); }
  void kv_f64(const std::string& k, double v) { key(k, kF64); put(v); }
  void kv_bool(const std::string& k, bool v) { key(k, kBool); put(static_cast<std::uint8_t>(v)); }
  void kv_str(const std::string& k, const std::string& v) { key(k, kString); str(v); }
  void kv_str_array(const std::string& k, const std::vector<std::string>& v) {
    key(k, kArray);
    put(kString);
    put(static_cast<std::uint64_t>(v.size()));
    for (const std::string& s : v) str(s);
  }
  void kv_i32_array(const std::string& k, const std::vector<std::int32_t>& v) {
    key(k, kArray);
    put(kI32);
    put(static_cast<std::uint64_t>(v.size()));
    for (std::int32_t x : v) put(x);
  }
  /// Any value, raw: type id and the value's bytes as the file holds them.
  void kv_raw(const std::string& k, std::uint32_t type, const std::vector<std::uint8_t>& bytes) {
    key(k, type);
    meta_.insert(meta_.end(), bytes.begin(), bytes.end());
  }

  /// Adds a tensor of `type` holding `values` (quantised as ggml would store them); its
  /// `expect` is the dequantised value computed here, independently of the reader.
  Tensor& tensor(const std::string& name, std::vector<std::uint64_t> shape, std::uint32_t type,
                 const std::vector<float>& values) {
    Tensor t;
    t.name = name;
    t.shape = std::move(shape);
    t.type = type;
    encode(type, values, t.data, t.expect);
    tensors.push_back(std::move(t));
    return tensors.back();
  }

  [[nodiscard]] std::vector<std::byte> build() {
    std::vector<std::uint8_t> f;
    auto put_to = [&f](const void* p, std::size_t n) {
      const auto* b = static_cast<const std::uint8_t*>(p);
      f.insert(f.end(), b, b + n);
    };
    put_to("GGUF", 4);
    put_to(&version, 4);
    const std::uint64_t nt = tensors.size();
    put_to(&nt, 8);
    put_to(&n_kv_, 8);
    f.insert(f.end(), meta_.begin(), meta_.end());
    fields.assign(tensors.size(), Fields{});
    std::uint64_t off = 0;
    std::vector<std::uint64_t> offsets;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      const std::uint64_t len = t.name.size();
      put_to(&len, 8);
      put_to(t.name.data(), t.name.size());
      const std::uint32_t nd = static_cast<std::uint32_t>(t.shape.size());
      put_to(&nd, 4);
      fields[i].dims = f.size();
      for (std::uint64_t d : t.shape) put_to(&d, 8);
      fields[i].type = f.size();
      put_to(&t.type, 4);
      fields[i].offset = f.size();
      put_to(&off, 8);
      offsets.push_back(off);
      off += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    while (f.size() % alignment != 0) f.push_back(0);
    const std::size_t data0 = f.size();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      f.resize(data0 + offsets[i]);
      fields[i].data = f.size();
      f.insert(f.end(), tensors[i].data.begin(), tensors[i].data.end());
    }
    std::vector<std::byte> out(f.size());
    std::memcpy(out.data(), f.data(), f.size());
    return out;
  }

  /// Writes `v` at byte `at` of a built file.
  template <class T>
  static void poke(std::vector<std::byte>& file, std::size_t at, T v) {
    std::memcpy(file.data() + at, &v, sizeof v);
  }

 private:
  void key(const std::string& k, std::uint32_t type) {
    str(k);
    put(type);
    ++n_kv_;
  }
  template <class T>
  void put(T v) {
    const auto* b = reinterpret_cast<const std::uint8_t*>(&v);
    meta_.insert(meta_.end(), b, b + sizeof v);
  }
  void str(const std::string& s) {
    put(static_cast<std::uint64_t>(s.size()));
    meta_.insert(meta_.end(), s.begin(), s.end());
  }

  static void put16(std::vector<std::uint8_t>& d, std::uint16_t h) {
    d.push_back(static_cast<std::uint8_t>(h & 0xFF));
    d.push_back(static_cast<std::uint8_t>(h >> 8));
  }

  static void encode(std::uint32_t type, const std::vector<float>& v, std::vector<std::uint8_t>& d,
                     std::vector<float>& expect) {
    switch (type) {
      case tF32:
        for (float x : v) {
          const auto* b = reinterpret_cast<const std::uint8_t*>(&x);
          d.insert(d.end(), b, b + 4);
          expect.push_back(x);
        }
        return;
      case tF16:
        for (float x : v) {
          const std::uint16_t h = f32_to_f16_bits(x);
          put16(d, h);
          expect.push_back(f16_bits_to_f32(h));
        }
        return;
      case tBF16:
        for (float x : v) {
          const std::uint16_t h = f32_to_bf16_bits(x);
          put16(d, h);
          expect.push_back(bf16_bits_to_f32(h));
        }
        return;
      default: break;
    }
    // Block types: 32 values per block; value j of a 4-bit block is nibble j % 16 of byte j % 16,
    // the low nibble for j < 16 and the high one for j >= 16.
    for (std::size_t b0 = 0; b0 < v.size(); b0 += 32) {
      float lo = v[b0], hi = v[b0], amax = 0.0f;
      for (std::size_t j = 0; j < 32; ++j) {
        const float x = b0 + j < v.size() ? v[b0 + j] : 0.0f;
        lo = std::fmin(lo, x);
        hi = std::fmax(hi, x);
        amax = std::fmax(amax, std::fabs(x));
      }
      if (type == tQ8_0) {
        const std::uint16_t dh = f32_to_f16_bits(amax / 127.0f);
        const double dd = f16_bits_to_f32(dh);
        put16(d, dh);
        for (std::size_t j = 0; j < 32; ++j) {
          const int q = dd == 0.0 ? 0 : static_cast<int>(std::lround(v[b0 + j] / dd));
          const int qc = q < -128 ? -128 : q > 127 ? 127 : q;
          d.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(qc)));
          expect.push_back(static_cast<float>(qc * dd));
        }
      } else {
        const bool has_min = type == tQ4_1;
        const std::uint16_t dh = f32_to_f16_bits(has_min ? (hi - lo) / 15.0f : amax / 7.0f);
        const std::uint16_t mh = f32_to_f16_bits(lo);
        const double dd = f16_bits_to_f32(dh);
        const double mm = has_min ? f16_bits_to_f32(mh) : -8.0 * dd;
        put16(d, dh);
        if (has_min) put16(d, mh);
        std::uint8_t nib[32];
        for (std::size_t j = 0; j < 32; ++j) {
          const int q = dd == 0.0 ? 0 : static_cast<int>(std::lround((v[b0 + j] - mm) / dd));
          nib[j] = static_cast<std::uint8_t>(q < 0 ? 0 : q > 15 ? 15 : q);
        }
        for (std::size_t j = 0; j < 16; ++j) d.push_back(static_cast<std::uint8_t>(nib[j] | (nib[j + 16] << 4)));
        for (std::size_t j = 0; j < 32; ++j) expect.push_back(static_cast<float>(nib[j] * dd + mm));
      }
    }
  }

  std::vector<std::uint8_t> meta_;
  std::uint64_t n_kv_ = 0;
};

/// A tiny llama-architecture GGUF model (dim 32, 2 query heads and 1 KV head of 16, hidden 64,
/// `layers` layers, a 258-token byte-level vocabulary), every weight type used once or more.
inline GgufBuilder tiny_llama_gguf(int layers = 1) {
  GgufBuilder b;
  const int dim = 32, hidden = 64, kv = 16, vocab = 258;
  b.kv_str("general.architecture", "llama");
  b.kv_u32("llama.block_count", static_cast<std::uint32_t>(layers));
  b.kv_u32("llama.context_length", 256);
  b.kv_u32("llama.embedding_length", dim);
  b.kv_u32("llama.feed_forward_length", hidden);
  b.kv_u32("llama.attention.head_count", 2);
  b.kv_u32("llama.attention.head_count_kv", 1);
  b.kv_f32("llama.rope.freq_base", 10000.0f);
  b.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  b.kv_u32("llama.rope.dimension_count", 16);
  b.kv_str("tokenizer.ggml.model", "gpt2");
  b.kv_str("tokenizer.ggml.pre", "smollm");
  std::vector<std::string> toks{"<|endoftext|>", "<|im_start|>"};
  std::vector<std::int32_t> types{3, 3};
  for (int c = 0; c < 256; ++c) {  // GPT-2 byte symbols
    const bool printable = (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
    int n = 0;
    for (int k = 0; k < c; ++k) n += ((k >= 0x21 && k <= 0x7E) || (k >= 0xA1 && k <= 0xAC) || (k >= 0xAE && k <= 0xFF)) ? 0 : 1;
    const std::uint32_t cp = printable ? static_cast<std::uint32_t>(c) : 256u + static_cast<std::uint32_t>(n);
    std::string s;
    if (cp < 0x80) s += static_cast<char>(cp);
    else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    toks.push_back(s);
    types.push_back(1);
  }
  b.kv_str_array("tokenizer.ggml.tokens", toks);
  b.kv_i32_array("tokenizer.ggml.token_type", types);
  b.kv_str_array("tokenizer.ggml.merges", {});
  b.kv_u32("tokenizer.ggml.bos_token_id", 1);
  b.kv_u32("tokenizer.ggml.eos_token_id", 0);
  std::uint64_t seed = 12345;
  auto values = [&](std::size_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v) {
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      x = scale * (static_cast<float>(seed >> 40) / static_cast<float>(1 << 24) - 0.5f);
    }
    return v;
  };
  const auto u = [](int v) { return static_cast<std::uint64_t>(v); };
  b.tensor("token_embd.weight", {u(dim), u(vocab)}, GgufBuilder::tQ8_0, values(dim * vocab, 2.0f));
  b.tensor("output_norm.weight", {u(dim)}, GgufBuilder::tF32, values(dim, 0.5f));
  for (int l = 0; l < layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    b.tensor(p + "attn_norm.weight", {u(dim)}, GgufBuilder::tF32, values(dim, 0.5f));
    b.tensor(p + "attn_q.weight", {u(dim), u(dim)}, GgufBuilder::tQ4_1, values(dim * dim, 0.5f));
    b.tensor(p + "attn_k.weight", {u(dim), u(kv)}, GgufBuilder::tQ4_0, values(dim * kv, 0.5f));
    b.tensor(p + "attn_v.weight", {u(dim), u(kv)}, GgufBuilder::tF16, values(dim * kv, 0.5f));
    b.tensor(p + "attn_output.weight", {u(dim), u(dim)}, GgufBuilder::tBF16, values(dim * dim, 0.5f));
    b.tensor(p + "ffn_norm.weight", {u(dim)}, GgufBuilder::tF32, values(dim, 0.5f));
    b.tensor(p + "ffn_gate.weight", {u(dim), u(hidden)}, GgufBuilder::tQ4_1, values(dim * hidden, 0.5f));
    b.tensor(p + "ffn_down.weight", {u(hidden), u(dim)}, GgufBuilder::tQ8_0, values(dim * hidden, 0.5f));
    b.tensor(p + "ffn_up.weight", {u(dim), u(hidden)}, GgufBuilder::tF32, values(dim * hidden, 0.5f));
  }
  return b;
}

}  // namespace triattn::test

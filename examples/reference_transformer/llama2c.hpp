// SPDX-License-Identifier: Apache-2.0
// llama2.c files: the "legacy v0" checkpoint (stories260K.bin) and the tokenizer (tok512.bin).
// Formats: ../shared/data/models/README.md. Implemented from that description.
//
// Checkpoint: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
// seq_len), then float32 tensors back to back: tok_emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2,
// w3, rms_final, freq_cis_real, freq_cis_imag (legacy, skipped), and wcls only when vocab_size is
// negative. The expected size follows from the header; anything else is rejected.
//
// Tokenizer: int32 max_token_length, then per token (vocab_size of them; the count comes from the
// model) float32 score, int32 length, `length` raw bytes.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/file_io.hpp>
#include <triattn/core/rope_types.hpp>

#include "model_config.hpp"

namespace triattn_example {

static_assert(std::endian::native == std::endian::little, "llama2.c files are little-endian; add byte swaps");

namespace detail {

/// A regular file of at most `max_bytes` (triattn::read_regular_file); errors start "<what> <path>: ".
inline std::vector<std::byte> read_whole_file(const std::string& path, const char* what, std::uint64_t max_bytes) {
  return triattn::read_regular_file<std::vector<std::byte>>(path, max_bytes, what);
}

inline std::int32_t load_i32(const std::byte* p) noexcept {
  std::int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float load_f32(const std::byte* p) noexcept {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace detail

/// Largest header values accepted; beyond these a header is treated as corrupt.
struct Llama2cLimits {
  static constexpr std::int64_t kMaxDim = 1 << 16;
  static constexpr std::int64_t kMaxHidden = 1 << 18;
  static constexpr std::int64_t kMaxLayers = 1024;
  static constexpr std::int64_t kMaxHeads = 1024;
  static constexpr std::int64_t kMaxVocab = 1 << 22;
  static constexpr std::int64_t kMaxSeqLen = 1 << 24;
  static constexpr std::uint64_t kMaxCheckpointBytes = std::uint64_t{64} << 30;  ///< a 16B model in float32
  static constexpr std::uint64_t kMaxTokenizerBytes = std::uint64_t{1} << 30;
};

/// Parses a llama2.c v0 checkpoint held in memory. `name` is used in error messages.
/// @throws triattn::format_error naming the file and the field (bad header, truncated, trailing bytes).
inline ModelWeights parse_llama2c_checkpoint(std::span<const std::byte> bytes, const std::string& name) {
  constexpr std::size_t kHeader = 7 * sizeof(std::int32_t);
  const std::string where = "llama2.c checkpoint " + name + ": ";
  if (bytes.size() < kHeader)
    throw triattn::format_error(where + "file has " + std::to_string(bytes.size()) +
                                " bytes, too short for the 28-byte header (7 x int32)");
  static constexpr const char* kField[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                            "seq_len"};
  std::int64_t h[7];
  for (int i = 0; i < 7; ++i) h[i] = detail::load_i32(bytes.data() + 4 * i);
  auto bad = [&](int field, const std::string& why) {
    throw triattn::format_error(where + "header field " + kField[field] + " = " + std::to_string(h[field]) + " " + why);
  };
  auto range = [&](int field, std::int64_t lo, std::int64_t hi) {
    if (h[field] < lo || h[field] > hi)
      bad(field, "is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "] (corrupt or not a llama2.c v0 file?)");
  };
  range(0, 2, Llama2cLimits::kMaxDim);
  range(1, 1, Llama2cLimits::kMaxHidden);
  range(2, 1, Llama2cLimits::kMaxLayers);
  range(3, 1, Llama2cLimits::kMaxHeads);
  range(4, 1, Llama2cLimits::kMaxHeads);
  if (h[5] == 0 || h[5] < -Llama2cLimits::kMaxVocab || h[5] > Llama2cLimits::kMaxVocab)
    bad(5, "must be non-zero with |vocab_size| <= " + std::to_string(Llama2cLimits::kMaxVocab) +
               " (negative means a separate classifier)");
  range(6, 1, Llama2cLimits::kMaxSeqLen);
  if (h[0] % h[3] != 0) bad(0, "is not a multiple of n_heads = " + std::to_string(h[3]));
  if (h[3] % h[4] != 0) bad(4, "does not divide n_heads = " + std::to_string(h[3]) + " (GQA groups must be whole)");
  const std::int64_t head_size = h[0] / h[3];
  if (head_size % 2 != 0) bad(0, "gives head_size = dim / n_heads = " + std::to_string(head_size) + ", which is odd (RoPE pairs)");

  ModelWeights w;
  ModelConfig& c = w.config;
  c.name = name;
  c.dim = static_cast<int>(h[0]);
  c.hidden_dim = static_cast<int>(h[1]);
  c.n_layers = static_cast<int>(h[2]);
  c.n_heads = static_cast<int>(h[3]);
  c.n_kv_heads = static_cast<int>(h[4]);
  c.head_dim = static_cast<int>(head_size);
  c.shared_classifier = h[5] > 0;
  c.vocab_size = static_cast<int>(h[5] > 0 ? h[5] : -h[5]);
  c.max_seq_len = static_cast<int>(h[6]);
  c.rope_style = triattn::RopeStyle::kInterleaved;
  c.rope_theta = 10000.0;
  c.rope_f32_angles = true;
  c.rms_eps = 1e-5f;
  c.bos_id = 1;
  c.eos_id = 2;

  // Expected size (fits easily in 64 bits under the limits above).
  const std::size_t freq_cis = static_cast<std::size_t>(c.max_seq_len) * static_cast<std::size_t>(head_size / 2);
  const std::size_t floats = c.n_tok_emb() + 2 * c.n_rms() + c.n_wq() + 2 * c.n_wkv() + c.n_wo() + 3 * c.n_mlp() +
                             static_cast<std::size_t>(c.dim) + 2 * freq_cis + (c.shared_classifier ? 0 : c.n_tok_emb());
  const std::size_t expect = kHeader + 4 * floats;
  if (bytes.size() < expect)
    throw triattn::format_error(where + "truncated: the header (dim " + std::to_string(c.dim) + ", hidden_dim " +
                                std::to_string(c.hidden_dim) + ", n_layers " + std::to_string(c.n_layers) +
                                ", n_heads " + std::to_string(c.n_heads) + ", n_kv_heads " +
                                std::to_string(c.n_kv_heads) + ", vocab_size " + std::to_string(h[5]) + ", seq_len " +
                                std::to_string(c.max_seq_len) + ") needs " + std::to_string(expect) +
                                " bytes, the file has " + std::to_string(bytes.size()));
  if (bytes.size() > expect)
    throw triattn::format_error(where + "has " + std::to_string(bytes.size() - expect) +
                                " trailing bytes after the expected " + std::to_string(expect) +
                                " (wrong header, or not a llama2.c v0 checkpoint)");

  std::size_t off = kHeader;
  auto take = [&](std::vector<float>& t, std::size_t n) {
    t.resize(n);
    if (n > 0) std::memcpy(t.data(), bytes.data() + off, n * sizeof(float));
    off += n * sizeof(float);
  };
  take(w.tok_emb, c.n_tok_emb());
  take(w.rms_att, c.n_rms());
  take(w.wq, c.n_wq());
  take(w.wk, c.n_wkv());
  take(w.wv, c.n_wkv());
  take(w.wo, c.n_wo());
  take(w.rms_ffn, c.n_rms());
  take(w.w1, c.n_mlp());
  take(w.w2, c.n_mlp());
  take(w.w3, c.n_mlp());
  take(w.rms_final, static_cast<std::size_t>(c.dim));
  off += 2 * freq_cis * sizeof(float);  // freq_cis_real, freq_cis_imag: recomputed, not read
  if (!c.shared_classifier) take(w.wcls, c.n_tok_emb());
  w.validate();
  return w;
}

/// Loads a llama2.c v0 checkpoint file. @throws triattn::format_error (see parse_llama2c_checkpoint).
inline ModelWeights load_llama2c_checkpoint(const std::string& path) {
  const std::vector<std::byte> bytes = detail::read_whole_file(path, "llama2.c checkpoint", Llama2cLimits::kMaxCheckpointBytes);
  return parse_llama2c_checkpoint(bytes, path);
}

/// llama2.c's BPE tokenizer (SentencePiece-derived vocabulary with byte fallback).
class Tokenizer {
 public:
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  static constexpr int kByteBase = 3;  ///< id of <0x00>; byte b is id b + 3

  Tokenizer() = default;

  /// Parses tokenizer bytes with `vocab_size` entries (the count is not stored in the file).
  /// @throws triattn::format_error naming the file, the token and the problem.
  static Tokenizer parse(std::span<const std::byte> bytes, int vocab_size, const std::string& name) {
    const std::string where = "llama2.c tokenizer " + name + ": ";
    if (vocab_size <= 0) throw triattn::format_error(where + "vocab_size = " + std::to_string(vocab_size) + " must be positive");
    if (bytes.size() < 4) throw triattn::format_error(where + "file has " + std::to_string(bytes.size()) +
                                                      " bytes, too short for max_token_length");
    Tokenizer t;
    t.max_token_length_ = detail::load_i32(bytes.data());
    if (t.max_token_length_ <= 0 || t.max_token_length_ > (1 << 16))
      throw triattn::format_error(where + "max_token_length = " + std::to_string(t.max_token_length_) +
                                  " is outside [1, 65536]");
    std::size_t off = 4;
    t.pieces_.resize(static_cast<std::size_t>(vocab_size));
    t.scores_.resize(static_cast<std::size_t>(vocab_size));
    for (int i = 0; i < vocab_size; ++i) {
      if (bytes.size() - off < 8)
        throw triattn::format_error(where + "truncated at token " + std::to_string(i) + " of " +
                                    std::to_string(vocab_size) + " (offset " + std::to_string(off) + ")");
      t.scores_[static_cast<std::size_t>(i)] = detail::load_f32(bytes.data() + off);
      const std::int32_t len = detail::load_i32(bytes.data() + off + 4);
      off += 8;
      if (len < 0 || len > t.max_token_length_)
        throw triattn::format_error(where + "token " + std::to_string(i) + " has length " + std::to_string(len) +
                                    ", outside [0, max_token_length = " + std::to_string(t.max_token_length_) + "]");
      if (bytes.size() - off < static_cast<std::size_t>(len))
        throw triattn::format_error(where + "truncated inside token " + std::to_string(i) + " (needs " +
                                    std::to_string(len) + " bytes at offset " + std::to_string(off) + ")");
      t.pieces_[static_cast<std::size_t>(i)].assign(reinterpret_cast<const char*>(bytes.data() + off),
                                                    static_cast<std::size_t>(len));
      off += static_cast<std::size_t>(len);
    }
    if (off != bytes.size())
      throw triattn::format_error(where + std::to_string(bytes.size() - off) + " trailing bytes after " +
                                  std::to_string(vocab_size) + " tokens (tokenizer and model vocab_size disagree?)");
    t.lookup_.reserve(t.pieces_.size());
    for (int i = 0; i < vocab_size; ++i) t.lookup_.emplace(t.pieces_[static_cast<std::size_t>(i)], i);  // first wins
    return t;
  }

  /// Loads a tokenizer file. @throws triattn::format_error.
  static Tokenizer load(const std::string& path, int vocab_size) {
    const std::vector<std::byte> bytes = detail::read_whole_file(path, "llama2.c tokenizer", Llama2cLimits::kMaxTokenizerBytes);
    return parse(bytes, vocab_size, path);
  }

  [[nodiscard]] int vocab_size() const noexcept { return static_cast<int>(pieces_.size()); }
  [[nodiscard]] int max_token_length() const noexcept { return max_token_length_; }
  [[nodiscard]] const std::string& piece(int id) const { return pieces_.at(static_cast<std::size_t>(id)); }
  [[nodiscard]] float score(int id) const { return scores_.at(static_cast<std::size_t>(id)); }
  /// Id of an exact piece, or -1.
  [[nodiscard]] int find(std::string_view piece) const {
    const auto it = lookup_.find(std::string(piece));
    return it == lookup_.end() ? -1 : it->second;
  }

  /// Encodes like run.c: optional BOS, a dummy-prefix " " token for non-empty text, one token per
  /// UTF-8 codepoint (bytes + 3 when the codepoint is not in the vocabulary), then repeatedly
  /// merges the adjacent pair whose concatenation is the highest-scoring vocabulary entry (the
  /// leftmost on ties) until no pair merges; optional EOS.
  [[nodiscard]] std::vector<int> encode(std::string_view text, bool bos, bool eos) const {
    std::vector<int> out;
    if (bos) out.push_back(kBos);
    std::vector<int> toks;
    if (!text.empty()) {
      const int space = find(" ");
      if (space >= 0) toks.push_back(space);
    }
    std::string cp;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto byte = static_cast<unsigned char>(text[i]);
      if ((byte & 0xC0u) != 0x80u) cp.clear();  // not a continuation byte: a new codepoint starts
      cp.push_back(static_cast<char>(byte));
      const bool next_continues =
          i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0u) == 0x80u;
      if (next_continues && cp.size() < 4) continue;
      const int id = find(cp);
      if (id >= 0) {
        toks.push_back(id);
      } else {
        for (char b : cp) toks.push_back(static_cast<unsigned char>(b) + kByteBase);
      }
      cp.clear();
    }
    std::string pair;
    for (;;) {
      float best_score = -1e10f;
      int best_id = -1;
      std::size_t best_at = 0;
      for (std::size_t i = 0; i + 1 < toks.size(); ++i) {
        pair = piece(toks[i]);
        pair += piece(toks[i + 1]);
        const int id = find(pair);
        if (id >= 0 && scores_[static_cast<std::size_t>(id)] > best_score) {
          best_score = scores_[static_cast<std::size_t>(id)];
          best_id = id;
          best_at = i;
        }
      }
      if (best_id < 0) break;
      toks[best_at] = best_id;
      toks.erase(toks.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
    out.insert(out.end(), toks.begin(), toks.end());
    if (eos) out.push_back(kEos);
    return out;
  }

  /// Text of `token` following `prev`, as run.c prints it: after BOS one leading space is
  /// dropped; a piece "<0xHH>" is the raw byte 0xHH.
  [[nodiscard]] std::string decode_piece(int prev, int token) const {
    std::string_view p = piece(token);
    if (prev == kBos && !p.empty() && p.front() == ' ') p.remove_prefix(1);
    if (p.size() == 6 && p.substr(0, 3) == "<0x" && p[5] == '>') {
      const int hi = hex(p[3]), lo = hex(p[4]);
      if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
    }
    return std::string(p);
  }

  /// Concatenated pieces of `tokens`; `prev` is the token before the first (BOS by default).
  [[nodiscard]] std::string decode(std::span<const int> tokens, int prev = kBos) const {
    std::string s;
    for (int t : tokens) {
      s += decode_piece(prev, t);
      prev = t;
    }
    return s;
  }

 private:
  static int hex(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  int max_token_length_ = 0;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;
};

}  // namespace triattn_example

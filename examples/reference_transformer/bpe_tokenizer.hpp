// SPDX-License-Identifier: Apache-2.0
// Byte-level BPE tokenizer (GPT-2 family) from a GGUF file's tokenizer.ggml.* metadata, encoding
// as llama.cpp does for tokenizer.ggml.model = "gpt2" with pre = "smollm" or "gpt2":
//   1. special tokens (control / user-defined) written literally in the text become their ids,
//      longest token text first (llama.cpp's tokenizer_st_partition);
//   2. the remaining text is pre-tokenized: for "smollm" every \p{N} codepoint is first a piece of
//      its own, then every piece is split by GPT-2's pattern
//      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (llama.cpp's hand-written matcher, reproduced step by step);
//   3. each piece's bytes are mapped to printable codepoints (GPT-2's bytes_to_unicode) and merged
//      by BPE, lowest merge rank first (leftmost on ties), through a priority queue of adjacent
//      pairs (O(n log n) in the piece's length); a final symbol missing from the vocabulary falls
//      back to one token per byte, and a byte without a token is dropped and counted.
// Chat prompts (encode_chat) take special tokens from the template only: the messages' text is
// plain text even where it spells "<|im_end|>".
// \p{L} / \p{N} are the Unicode general categories L* / N* (unicode_ranges.hpp); \s is White_Space.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <queue>
#include <unordered_map>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>

#include "gguf.hpp"
#include "unicode_ranges.hpp"

namespace triattn_example {

namespace unicode {

[[nodiscard]] inline bool in_ranges(std::span<const CodepointRange> r, std::uint32_t cp) noexcept {
  const auto it = std::upper_bound(r.begin(), r.end(), cp,
                                   [](std::uint32_t v, const CodepointRange& x) { return v < x.first; });
  return it != r.begin() && cp <= (it - 1)->last;
}
[[nodiscard]] inline bool is_letter(std::uint32_t cp) noexcept { return in_ranges(kLetterRanges, cp); }
[[nodiscard]] inline bool is_number(std::uint32_t cp) noexcept { return in_ranges(kNumberRanges, cp); }
/// Unicode White_Space.
[[nodiscard]] inline bool is_whitespace(std::uint32_t cp) noexcept {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

inline void append_utf8(std::string& s, std::uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// One decoded codepoint and where its bytes are. A byte that does not start a valid UTF-8
/// sequence is a codepoint of its own with kInvalid (no letter / number / space).
struct Cpt {
  static constexpr std::uint32_t kInvalid = 0xFFFFFFFFu;
  std::uint32_t cp;
  std::size_t begin, len;
};

[[nodiscard]] inline std::vector<Cpt> decode_utf8(std::string_view s) {
  std::vector<Cpt> out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    std::size_t n = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : (b0 >> 3) == 0x1E ? 4 : 0;
    std::uint32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1Fu) : n == 3 ? (b0 & 0x0Fu) : (b0 & 0x07u);
    bool ok = n > 0 && i + n <= s.size();
    for (std::size_t k = 1; ok && k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      ok = (b & 0xC0) == 0x80;
      cp = (cp << 6) | (b & 0x3Fu);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid too.
    if (ok) ok = !((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
                   (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF);
    if (!ok) {
      out.push_back({Cpt::kInvalid, i, 1});
      ++i;
    } else {
      out.push_back({cp, i, n});
      i += n;
    }
  }
  return out;
}

}  // namespace unicode

/// One turn of a chat (role "system", "user" or "assistant").
struct ChatMessage {
  std::string role;
  std::string content;
};

class BpeTokenizer {
 public:
  /// tokenizer.ggml.token_type values.
  enum TokenType : int { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
  enum class PreTokenizer { kGpt2, kSmolLM };

  /// Reads tokenizer.ggml.{model, pre, tokens, token_type, merges, bos/eos_token_id} and
  /// tokenizer.chat_template. @throws triattn::format_error naming the file and the key.
  static BpeTokenizer from_gguf(const gguf::File& f) {
    BpeTokenizer t;
    const std::string& model = f.get_string("tokenizer.ggml.model");
    if (model != "gpt2")
      f.fail("tokenizer.ggml.model = \"" + model + "\": only byte-level BPE (\"gpt2\") is supported");
    const std::string pre = f.has("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre") : "default";
    if (pre == "smollm") t.pre_ = PreTokenizer::kSmolLM;
    else if (pre == "gpt2" || pre == "default") t.pre_ = PreTokenizer::kGpt2;
    else f.fail("tokenizer.ggml.pre = \"" + pre + "\" is not supported (\"smollm\", \"gpt2\", \"default\" are)");
    const auto& tokens = f.get_array("tokenizer.ggml.tokens", gguf::ValueType::kString).array;
    if (tokens.empty() || tokens.size() > (std::size_t{1} << 22))
      f.fail("tokenizer.ggml.tokens has " + std::to_string(tokens.size()) + " entries, expected 1 to 4194304");
    t.pieces_.reserve(tokens.size());
    for (const gguf::Value& v : tokens) t.pieces_.push_back(v.s);
    t.types_.assign(tokens.size(), kNormal);
    if (f.has("tokenizer.ggml.token_type")) {
      const auto& types = f.get_array("tokenizer.ggml.token_type", gguf::ValueType::kI32).ints;
      if (types.size() != tokens.size())
        f.fail("tokenizer.ggml.token_type has " + std::to_string(types.size()) + " entries, tokenizer.ggml.tokens " +
               std::to_string(tokens.size()));
      for (std::size_t i = 0; i < types.size(); ++i) {
        if (types[i] < kNormal || types[i] > kByte)
          f.fail("tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(types[i]) +
                 " is not a token type (1 to 6)");
        t.types_[i] = static_cast<int>(types[i]);
      }
    }
    for (std::size_t i = 0; i < t.pieces_.size(); ++i) {
      t.lookup_.emplace(t.pieces_[i], static_cast<int>(i));  // the first id of a duplicated text wins
      if ((t.types_[i] == kControl || t.types_[i] == kUserDefined || t.types_[i] == kUnknown) && !t.pieces_[i].empty())
        t.specials_.push_back(static_cast<int>(i));
    }
    // Longest text first, as llama.cpp partitions (ties by id, for a deterministic order).
    std::sort(t.specials_.begin(), t.specials_.end(), [&](int a, int b) {
      const std::size_t la = t.pieces_[static_cast<std::size_t>(a)].size(), lb = t.pieces_[static_cast<std::size_t>(b)].size();
      return la != lb ? la > lb : a < b;
    });
    const auto& merges = f.get_array("tokenizer.ggml.merges", gguf::ValueType::kString).array;
    t.ranks_.reserve(merges.size());
    for (std::size_t i = 0; i < merges.size(); ++i) {
      const std::string& m = merges[i].s;
      const std::size_t sp = m.find(' ', 1);  // a left part may itself be a space only in raw vocabularies
      if (sp == std::string::npos || sp + 1 >= m.size())
        f.fail("tokenizer.ggml.merges[" + std::to_string(i) + "] = \"" + m + "\" is not two symbols separated by a space");
      t.ranks_.emplace(m, static_cast<int>(i));  // key "left right"; the first rank of a repeated merge wins
    }
    const auto id_or = [&](const char* key, int dflt) {
      return f.has(key) ? static_cast<int>(f.get_int(key, 0, static_cast<std::int64_t>(tokens.size()) - 1)) : dflt;
    };
    t.bos_ = id_or("tokenizer.ggml.bos_token_id", -1);
    t.eos_ = id_or("tokenizer.ggml.eos_token_id", -1);
    t.add_bos_ = f.has("tokenizer.ggml.add_bos_token") && f.at("tokenizer.ggml.add_bos_token").i != 0 &&
                 f.at("tokenizer.ggml.add_bos_token").type == gguf::ValueType::kBool;
    if (f.has("tokenizer.chat_template")) t.chat_template_ = f.get_string("tokenizer.chat_template");
    return t;
  }

  [[nodiscard]] int vocab_size() const noexcept { return static_cast<int>(pieces_.size()); }
  [[nodiscard]] int bos_id() const noexcept { return bos_; }
  [[nodiscard]] int eos_id() const noexcept { return eos_; }
  /// Whether the model wants BOS prepended (tokenizer.ggml.add_bos_token; SmolLM2: no).
  [[nodiscard]] bool add_bos() const noexcept { return add_bos_; }
  [[nodiscard]] PreTokenizer pre_tokenizer() const noexcept { return pre_; }
  [[nodiscard]] const std::string& chat_template() const noexcept { return chat_template_; }
  [[nodiscard]] const std::string& piece(int id) const { return pieces_.at(static_cast<std::size_t>(id)); }
  [[nodiscard]] int token_type(int id) const { return types_.at(static_cast<std::size_t>(id)); }
  /// Id of an exact vocabulary text, or -1.
  [[nodiscard]] int find(std::string_view text) const {
    const auto it = lookup_.find(std::string(text));
    return it == lookup_.end() ? -1 : it->second;
  }

  /// Token ids and what could not be encoded.
  struct Encoded {
    std::vector<int> ids;
    /// Bytes of the text that no token covers (not even a byte token: SmolLM2 lacks a few
    /// control bytes and the bytes that never occur in UTF-8); they are left out of `ids`.
    std::size_t dropped_bytes = 0;
  };

  /// Token ids of `text` (no BOS is added; see add_bos()). With parse_special, control tokens
  /// written in the text ("<|im_start|>") become their ids; user-defined ones always do.
  [[nodiscard]] std::vector<int> encode(std::string_view text, bool parse_special = true) const {
    return encode_counted(text, parse_special).ids;
  }
  /// encode() with the count of the bytes it had to drop.
  [[nodiscard]] Encoded encode_counted(std::string_view text, bool parse_special = true) const {
    std::vector<Frag> frags{{-1, 0, text.size()}};
    split_specials(text, frags, parse_special);
    return encode_frags(text, frags);
  }

  /// Token ids of chat_prompt(messages, add_generation_prompt) where only the template's
  /// "<|im_start|>" / "<|im_end|>" are special tokens: the roles and contents are encoded as
  /// encode(text, false) would, so a message that spells a control token cannot inject it.
  /// Without those tokens in the vocabulary the markers are plain text too.
  [[nodiscard]] Encoded encode_chat(std::span<const ChatMessage> messages, bool add_generation_prompt = true) const {
    std::vector<Frag> frags;
    const std::string text = render_chat(messages, add_generation_prompt, find(kImStart), find(kImEnd), &frags);
    split_specials(text, frags, false);
    return encode_frags(text, frags);
  }

  /// BPE rank of the merge "left right" (byte-level symbols), or -1 when there is none.
  [[nodiscard]] int merge_rank(std::string_view left, std::string_view right) const {
    std::string key;
    key.reserve(left.size() + 1 + right.size());
    key.append(left).append(1, ' ').append(right);
    const auto it = ranks_.find(key);
    return it == ranks_.end() ? -1 : it->second;
  }

  /// The byte-level symbols BPE merges one pre-tokenized piece into (before the lookup of their
  /// ids), in order; their concatenation is the piece's bytes mapped by byte_symbol().
  [[nodiscard]] std::vector<std::string> merge_symbols(std::string_view word) const {
    std::string mapped;
    std::vector<std::string> out;
    const std::vector<Sym> sym = merge(word, mapped);
    for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next)
      out.push_back(mapped.substr(sym[static_cast<std::size_t>(i)].begin, sym[static_cast<std::size_t>(i)].len));
    return out;
  }

  /// The pre-tokenizer's pieces of `text` (views into it), in order; their concatenation is `text`.
  [[nodiscard]] std::vector<std::string_view> pre_tokenize(std::string_view text) const {
    const std::vector<unicode::Cpt> cpts = unicode::decode_utf8(text);
    // Stage 1 ("smollm"): every \p{N} codepoint alone, the text between kept.
    std::vector<std::pair<std::size_t, std::size_t>> spans;  // [first cpt, end cpt)
    if (pre_ == PreTokenizer::kSmolLM) {
      std::size_t start = 0;
      for (std::size_t i = 0; i < cpts.size(); ++i) {
        if (!is_number(cpts[i].cp)) continue;
        if (i > start) spans.emplace_back(start, i);
        spans.emplace_back(i, i + 1);
        start = i + 1;
      }
      if (start < cpts.size()) spans.emplace_back(start, cpts.size());
    } else if (!cpts.empty()) {
      spans.emplace_back(0, cpts.size());
    }
    // Stage 2: GPT-2's pattern within each span.
    std::vector<std::string_view> out;
    for (const auto& span : spans) {
      const std::size_t lo = span.first, hi = span.second;  // (lambdas cannot capture bindings in clang < 16)
      std::size_t prev = lo;
      auto add = [&](std::size_t end) {
        if (end > prev) {
          const std::size_t b = cpts[prev].begin;
          const std::size_t e = cpts[end - 1].begin + cpts[end - 1].len;
          out.push_back(text.substr(b, e - b));
        }
        prev = end;
      };
      auto cp_at = [&](std::size_t p) { return p < hi ? cpts[p].cp : kOutOfRange; };
      for (std::size_t pos = lo; pos < hi;) {
        const std::uint32_t c = cpts[pos].cp;
        if (c == '\'' && pos + 1 < hi) {  // 's 't 'm 'd 're 've 'll
          const std::uint32_t n1 = cp_at(pos + 1);
          if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
            pos += 2;
            add(pos);
            continue;
          }
          const std::uint32_t n2 = cp_at(pos + 2);
          if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
            pos += 3;
            add(pos);
            continue;
          }
        }
        const std::uint32_t c2 = c == ' ' ? cp_at(pos + 1) : c;  // the class after an optional space
        if (is_letter(c2)) {  //  ?\p{L}+
          pos += c == ' ' ? 1 : 0;
          while (is_letter(cp_at(pos))) ++pos;
          add(pos);
          continue;
        }
        if (is_number(c2)) {  //  ?\p{N}+
          pos += c == ' ' ? 1 : 0;
          while (is_number(cp_at(pos))) ++pos;
          add(pos);
          continue;
        }
        if (is_other(c2)) {  //  ?[^\s\p{L}\p{N}]+
          pos += c == ' ' ? 1 : 0;
          while (is_other(cp_at(pos))) ++pos;
          add(pos);
          continue;
        }
        std::size_t ws = 0;
        while (unicode::is_whitespace(cp_at(pos + ws))) ++ws;
        if (ws > 1 && cp_at(pos + ws) != kOutOfRange) {  // \s+(?!\S): leave the last space to the next word
          pos += ws - 1;
          add(pos);
          continue;
        }
        if (ws > 0) {  // \s+
          pos += ws;
          add(pos);
          continue;
        }
        add(++pos);  // no match (not reached: every codepoint belongs to one class)
      }
    }
    return out;
  }

  /// Text of one token: byte-level symbols mapped back to bytes; a control token is its text
  /// when `special`, else empty.
  [[nodiscard]] std::string decode_piece(int id, bool special = true) const {
    const std::string& p = piece(id);
    const int type = types_[static_cast<std::size_t>(id)];
    if (type == kControl || type == kUnknown) return special ? p : std::string();
    if (type == kUserDefined) return p;
    std::string s;
    for (const unicode::Cpt& c : unicode::decode_utf8(p)) {
      const int b = c.cp == unicode::Cpt::kInvalid ? -1 : symbol_byte(c.cp);
      if (b >= 0) s += static_cast<char>(b);
      else s.append(p, c.begin, c.len);
    }
    return s;
  }
  [[nodiscard]] std::string decode(std::span<const int> ids, bool special = true) const {
    std::string s;
    for (int id : ids) s += decode_piece(id, special);
    return s;
  }

  /// ChatML as SmolLM2's template writes it: "<|im_start|>role\ncontent<|im_end|>\n" per message,
  /// then "<|im_start|>assistant\n" when a reply is wanted. (The template also inserts a default
  /// system message when the first one is not "system"; pass one to get it.)
  /// Encode it with encode_chat(), not encode(): encode() would parse control tokens that the
  /// messages spell.
  [[nodiscard]] static std::string chat_prompt(std::span<const ChatMessage> messages, bool add_generation_prompt = true) {
    return render_chat(messages, add_generation_prompt, -1, -1, nullptr);
  }

  /// GPT-2's bytes_to_unicode: the printable symbol byte `b` is written as (UTF-8).
  [[nodiscard]] static const std::string& byte_symbol(std::uint8_t b) {
    static const std::array<std::string, 256> table = [] {
      std::array<std::string, 256> t;
      for (int i = 0; i < 256; ++i) unicode::append_utf8(t[static_cast<std::size_t>(i)], byte_codepoint(static_cast<std::uint8_t>(i)));
      return t;
    }();
    return table[b];
  }

 private:
  static constexpr std::uint32_t kOutOfRange = 0xFFFFFFFEu;
  static constexpr std::string_view kImStart = "<|im_start|>", kImEnd = "<|im_end|>";

  /// A piece of the text being encoded: raw text (id -1) or a special token.
  struct Frag {
    int id;
    std::size_t begin, len;
  };

  /// ChatML text of `messages`; with `frags`, also its fragments: the markers as the special
  /// tokens start_id / end_id (plain text where -1), everything else raw.
  static std::string render_chat(std::span<const ChatMessage> messages, bool add_generation_prompt, int start_id,
                                 int end_id, std::vector<Frag>* frags) {
    std::string s;
    const auto raw = [&](std::string_view t) {
      if (frags && !t.empty()) {
        if (!frags->empty() && frags->back().id < 0) frags->back().len += t.size();
        else frags->push_back({-1, s.size(), t.size()});
      }
      s += t;
    };
    const auto marker = [&](std::string_view t, int id) {
      if (id < 0) return raw(t);
      if (frags) frags->push_back({id, s.size(), t.size()});
      s += t;
    };
    for (const ChatMessage& m : messages) {
      marker(kImStart, start_id);
      raw(m.role);
      raw("\n");
      raw(m.content);
      marker(kImEnd, end_id);
      raw("\n");
    }
    if (add_generation_prompt) {
      marker(kImStart, start_id);
      raw("assistant\n");
    }
    return s;
  }

  /// Cuts the special tokens written in `frags`' raw text out as fragments of their own, longest
  /// token first (control ones only with parse_special).
  void split_specials(std::string_view text, std::vector<Frag>& frags, bool parse_special) const {
    for (int sid : specials_) {
      if (!parse_special && types_[static_cast<std::size_t>(sid)] != kUserDefined) continue;
      const std::string& s = pieces_[static_cast<std::size_t>(sid)];
      std::vector<Frag> next;
      for (const Frag& fr : frags) {
        if (fr.id >= 0) {
          next.push_back(fr);
          continue;
        }
        std::size_t at = fr.begin;
        const std::size_t end = fr.begin + fr.len;
        for (;;) {
          const std::size_t hit = text.substr(0, end).find(s, at);
          if (hit == std::string_view::npos) break;
          if (hit > at) next.push_back({-1, at, hit - at});
          next.push_back({sid, hit, s.size()});
          at = hit + s.size();
        }
        if (at < end) next.push_back({-1, at, end - at});
      }
      frags.swap(next);
    }
  }

  /// Ids of the fragments: special tokens as they are, raw text pre-tokenized and merged.
  Encoded encode_frags(std::string_view text, std::span<const Frag> frags) const {
    Encoded e;
    for (const Frag& fr : frags) {
      if (fr.id >= 0) {
        e.ids.push_back(fr.id);
        continue;
      }
      for (const std::string_view word : pre_tokenize(text.substr(fr.begin, fr.len))) e.dropped_bytes += bpe_word(word, e.ids);
    }
    return e;
  }

  static bool is_number(std::uint32_t cp) noexcept { return cp < 0x110000 && unicode::is_number(cp); }
  static bool is_letter(std::uint32_t cp) noexcept { return cp < 0x110000 && unicode::is_letter(cp); }
  /// [^\s\p{L}\p{N}]: any codepoint in range that is neither (an invalid byte counts here).
  static bool is_other(std::uint32_t cp) noexcept {
    if (cp == kOutOfRange) return false;
    if (cp == unicode::Cpt::kInvalid) return true;
    return !unicode::is_whitespace(cp) && !unicode::is_letter(cp) && !unicode::is_number(cp);
  }

  /// Printable bytes keep their codepoint; the other 68 map to 256, 257, ... in byte order.
  static constexpr bool byte_is_printable(int b) noexcept {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  }
  static std::uint32_t byte_codepoint(std::uint8_t b) noexcept {
    if (byte_is_printable(b)) return b;
    std::uint32_t n = 0;
    for (int k = 0; k < b; ++k) n += byte_is_printable(k) ? 0 : 1;
    return 256 + n;
  }
  /// Inverse of byte_codepoint, or -1.
  static int symbol_byte(std::uint32_t cp) noexcept {
    if (cp < 256) return byte_is_printable(static_cast<int>(cp)) ? static_cast<int>(cp) : -1;
    std::uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      if (byte_is_printable(b)) continue;
      if (256 + n == cp) return b;
      ++n;
    }
    return -1;
  }

  /// A symbol of a word being merged: bytes [begin, begin + len) of the mapped word, linked to
  /// its neighbours (-1 at the ends); len 0 once merged into its left neighbour.
  struct Sym {
    std::uint32_t begin, len;
    int prev, next;
  };

  /// BPE of one pre-tokenized word: `mapped` becomes its bytes as byte symbols and the result
  /// lists the symbols (a linked list from index 0). Every adjacent pair with a merge rank waits
  /// in a min-queue keyed (rank, left symbol's index), which orders pairs as the text does; an
  /// entry whose symbols have changed since it was queued is skipped when it comes up. Each
  /// merge queues at most two pairs, so a word of n bytes costs O(n log n), not O(n^2).
  std::vector<Sym> merge(std::string_view word, std::string& mapped) const {
    mapped.clear();
    std::vector<Sym> sym;
    sym.reserve(word.size());
    for (std::size_t i = 0; i < word.size(); ++i) {
      const std::string& b = byte_symbol(static_cast<std::uint8_t>(word[i]));
      sym.push_back({static_cast<std::uint32_t>(mapped.size()), static_cast<std::uint32_t>(b.size()), static_cast<int>(i) - 1,
                     i + 1 < word.size() ? static_cast<int>(i) + 1 : -1});
      mapped += b;
    }
    struct Pair {
      int rank, left;
      std::uint32_t left_len, right_len;
      bool operator>(const Pair& o) const noexcept { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> queue;
    std::string key;
    const auto push = [&](int left) {
      if (left < 0) return;
      const Sym& l = sym[static_cast<std::size_t>(left)];
      if (l.next < 0) return;
      const Sym& r = sym[static_cast<std::size_t>(l.next)];
      key.assign(mapped, l.begin, l.len).append(1, ' ').append(mapped, r.begin, r.len);
      const auto it = ranks_.find(key);
      if (it != ranks_.end()) queue.push({it->second, left, l.len, r.len});
    };
    for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) push(i);
    while (!queue.empty()) {
      const Pair p = queue.top();
      queue.pop();
      Sym& l = sym[static_cast<std::size_t>(p.left)];
      if (l.len != p.left_len || l.next < 0) continue;  // merged away, or grown since queued
      Sym& r = sym[static_cast<std::size_t>(l.next)];
      if (r.len != p.right_len) continue;
      l.len += r.len;
      l.next = r.next;
      if (r.next >= 0) sym[static_cast<std::size_t>(r.next)].prev = p.left;
      r.len = 0;
      push(l.prev);
      push(p.left);
    }
    return sym;
  }

  /// BPE of one pre-tokenized word; appends its ids to `out` and returns the bytes dropped.
  std::size_t bpe_word(std::string_view word, std::vector<int>& out) const {
    std::string mapped;
    const std::vector<Sym> sym = merge(word, mapped);
    std::size_t dropped = 0;
    for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next) {
      const std::string_view s = std::string_view(mapped).substr(sym[static_cast<std::size_t>(i)].begin,
                                                                  sym[static_cast<std::size_t>(i)].len);
      const int id = find(s);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      // One token per byte symbol; a symbol missing from the vocabulary (SmolLM2 lacks some
      // control bytes) is dropped, as llama.cpp does, and counted.
      for (const unicode::Cpt& c : unicode::decode_utf8(s)) {
        const int id1 = find(s.substr(c.begin, c.len));
        if (id1 >= 0) out.push_back(id1);
        else ++dropped;
      }
    }
    return dropped;
  }

  PreTokenizer pre_ = PreTokenizer::kGpt2;
  std::vector<std::string> pieces_;
  std::vector<int> types_;
  std::vector<int> specials_;  // control / user-defined / unknown ids, longest text first
  std::unordered_map<std::string, int> lookup_;
  std::unordered_map<std::string, int> ranks_;
  int bos_ = -1, eos_ = -1;
  bool add_bos_ = false;
  std::string chat_template_;
};

}  // namespace triattn_example

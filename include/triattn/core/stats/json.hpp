// SPDX-License-Identifier: Apache-2.0
// Tiny JSON reader and writer for safetensors headers: objects, arrays, strings (all escapes,
// \u surrogate pairs to UTF-8) and integers. Floats, true/false/null are rejected because a
// safetensors header never holds them. Nesting is limited so hostile input cannot overflow the
// stack, and duplicate object keys are errors (JSON leaves them undefined).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>

namespace triattn::detail {

struct JsonValue {
  enum class Kind : std::uint8_t { kString, kInt, kArray, kObject };
  Kind kind = Kind::kInt;
  std::string str;                 ///< kString
  std::int64_t integer = 0;        ///< kInt
  std::vector<JsonValue> items;    ///< kArray: elements; kObject: values, parallel to keys
  std::vector<std::string> keys;   ///< kObject: keys in file order

  /// Member `key` of an object, or nullptr.
  [[nodiscard]] const JsonValue* find(std::string_view key) const noexcept {
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &items[i];
    return nullptr;
  }
};

[[nodiscard]] inline const char* json_kind_name(JsonValue::Kind k) noexcept {
  switch (k) {
    case JsonValue::Kind::kString: return "string";
    case JsonValue::Kind::kInt: return "integer";
    case JsonValue::Kind::kArray: return "array";
    case JsonValue::Kind::kObject: return "object";
  }
  return "?";
}

/// Reads the JSON string literal that starts at s[pos] (the opening quote): all escapes, \u
/// surrogate pairs to UTF-8, raw control characters rejected. Leaves pos after the closing quote.
/// `fail(message)` must throw; it is called with pos at the offending byte.
template <class Fail>
[[nodiscard]] std::string read_json_string(std::string_view s, std::size_t& pos, Fail&& fail) {
  const auto hex4 = [&] {
    if (s.size() - pos < 4) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s[pos++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return v;
  };
  const auto put_utf8 = [](std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  };
  if (pos >= s.size() || s[pos] != '"') fail("expected '\"'");
  ++pos;
  std::string out;
  while (true) {
    if (pos >= s.size()) fail("unterminated string (truncated)");
    const char c = s[pos++];
    if (c == '"') return out;
    if (static_cast<unsigned char>(c) < 0x20) fail("raw control character in a string");
    if (c != '\\') {
      out += c;
      continue;
    }
    if (pos >= s.size()) fail("unterminated escape (truncated)");
    const char e = s[pos++];
    switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        unsigned cp = hex4();
        if (cp >= 0xDC00 && cp <= 0xDFFF) fail("unpaired low surrogate in \\u escape");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (s.size() - pos < 2 || s[pos] != '\\' || s[pos + 1] != 'u') fail("unpaired high surrogate");
          pos += 2;
          const unsigned lo = hex4();
          if (lo < 0xDC00 || lo > 0xDFFF) fail("bad low surrogate");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        put_utf8(out, cp);
        break;
      }
      default: fail(std::string("bad escape \\") + e);
    }
  }
}

namespace json_impl {

class Parser {
 public:
  Parser(std::string_view text, const std::string& where) : s_(text), where_(where) {}

  JsonValue parse_document() {
    skip_ws();
    JsonValue v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 16;

  [[noreturn]] void fail(const std::string& what) const {
    throw format_error(where_ + ": " + what + " at header byte " + std::to_string(pos_));
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void expect(char c) {
    if (pos_ >= s_.size() || s_[pos_] != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  JsonValue value(int depth) {
    if (depth > kMaxDepth) fail("JSON nested deeper than " + std::to_string(kMaxDepth) + " levels");
    const char c = peek();
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    JsonValue v;
    if (c == '"') {
      v.kind = JsonValue::Kind::kString;
      v.str = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = JsonValue::Kind::kInt;
      v.integer = integer();
    } else {
      fail(pos_ >= s_.size() ? "JSON ends early (truncated)" : "unsupported JSON value (only strings, integers, arrays, objects)");
    }
    return v;
  }

  JsonValue object(int depth) {
    JsonValue v;
    v.kind = JsonValue::Kind::kObject;
    std::unordered_set<std::string> seen;  // keeps duplicate detection linear for hostile headers
    expect('{');
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      return v;
    }
    while (true) {
      skip_ws();
      if (peek() != '"') fail("expected an object key");
      std::string key = string();
      if (!seen.insert(key).second) fail("duplicate key \"" + key + "\"");
      skip_ws();
      expect(':');
      skip_ws();
      v.items.push_back(value(depth + 1));
      v.keys.push_back(std::move(key));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}');
      return v;
    }
  }

  JsonValue array(int depth) {
    JsonValue v;
    v.kind = JsonValue::Kind::kArray;
    expect('[');
    skip_ws();
    if (peek() == ']') {
      ++pos_;
      return v;
    }
    while (true) {
      skip_ws();
      v.items.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect(']');
      return v;
    }
  }

  std::int64_t integer() {
    const bool neg = peek() == '-';
    if (neg) ++pos_;
    const std::size_t start = pos_;
    std::uint64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const unsigned d = static_cast<unsigned>(s_[pos_] - '0');
      if (v > (static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) - d) / 10)
        fail("integer does not fit in 64 bits");
      v = v * 10 + d;
      ++pos_;
    }
    if (pos_ == start) fail("expected digits");
    if (pos_ - start > 1 && s_[start] == '0') fail("integer with a leading zero");
    if (pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E'))
      fail("only integers are supported in a safetensors header");
    return neg ? -static_cast<std::int64_t>(v) : static_cast<std::int64_t>(v);
  }

  std::string string() {
    return read_json_string(s_, pos_, [this](const std::string& what) { fail(what); });
  }

  std::string_view s_;
  const std::string& where_;
  std::size_t pos_ = 0;
};

}  // namespace json_impl

/// Parses one JSON document; `where` starts every error message.
[[nodiscard]] inline JsonValue parse_json(std::string_view text, const std::string& where) {
  return json_impl::Parser(text, where).parse_document();
}

/// `s` as a JSON string literal (quotes included); control characters become \u escapes.
[[nodiscard]] inline std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace triattn::detail

// SPDX-License-Identifier: Apache-2.0
// Tiny JSON reader and writer: objects, arrays, strings (all escapes, \u surrogate pairs to
// UTF-8) and integers. JsonSubset::kSafetensorsHeader (the default) rejects fractions, exponents,
// true/false/null because a safetensors header never holds them; JsonSubset::kFull accepts them
// (reference data files). Nesting is limited so hostile input cannot overflow the stack, and
// duplicate object keys are errors (JSON leaves them undefined).
#pragma once

#include <charconv>
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

/// What parse_json accepts besides objects, arrays, strings and integers.
enum class JsonSubset : std::uint8_t {
  kSafetensorsHeader,  ///< nothing else
  kFull,               ///< also numbers with a fraction or exponent (kReal) and true/false/null
};

struct JsonValue {
  enum class Kind : std::uint8_t { kString, kInt, kArray, kObject, kReal, kBool, kNull };
  Kind kind = Kind::kInt;
  std::string str;                 ///< kString
  std::int64_t integer = 0;        ///< kInt; kBool: 0 or 1
  double real = 0.0;               ///< kReal
  std::vector<JsonValue> items;    ///< kArray: elements; kObject: values, parallel to keys
  std::vector<std::string> keys;   ///< kObject: keys in file order

  /// Member `key` of an object, or nullptr.
  [[nodiscard]] const JsonValue* find(std::string_view key) const noexcept {
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &items[i];
    return nullptr;
  }

  /// Member `key` of an object. @throws triattn::format_error when absent or not an object.
  [[nodiscard]] const JsonValue& at(std::string_view key) const {
    if (kind != Kind::kObject) throw format_error("json: not an object (looking up \"" + std::string(key) + "\")");
    const JsonValue* v = find(key);
    if (v == nullptr) throw format_error("json: missing key \"" + std::string(key) + "\"");
    return *v;
  }

  /// Element i of an array. @throws triattn::format_error when out of range or not an array.
  [[nodiscard]] const JsonValue& at(std::size_t i) const {
    if (kind != Kind::kArray) throw format_error("json: not an array");
    if (i >= items.size()) throw format_error("json: index " + std::to_string(i) + " out of range");
    return items[i];
  }

  /// A number (kInt or kReal) as a double. @throws triattn::format_error otherwise.
  [[nodiscard]] double as_double() const {
    if (kind == Kind::kInt) return static_cast<double>(integer);
    if (kind != Kind::kReal) throw format_error("json: not a number");
    return real;
  }
};

[[nodiscard]] inline const char* json_kind_name(JsonValue::Kind k) noexcept {
  switch (k) {
    case JsonValue::Kind::kString: return "string";
    case JsonValue::Kind::kInt: return "integer";
    case JsonValue::Kind::kArray: return "array";
    case JsonValue::Kind::kObject: return "object";
    case JsonValue::Kind::kReal: return "number";
    case JsonValue::Kind::kBool: return "boolean";
    case JsonValue::Kind::kNull: return "null";
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
  Parser(std::string_view text, const std::string& where, JsonSubset subset)
      : s_(text), where_(where), full_(subset == JsonSubset::kFull) {}

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
    throw format_error(where_ + ": " + what + (full_ ? " at byte " : " at header byte ") + std::to_string(pos_));
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
      number(v);
    } else if (full_ && literal("true")) {
      v.kind = JsonValue::Kind::kBool;
      v.integer = 1;
    } else if (full_ && literal("false")) {
      v.kind = JsonValue::Kind::kBool;
    } else if (full_ && literal("null")) {
      v.kind = JsonValue::Kind::kNull;
    } else {
      fail(pos_ >= s_.size() ? "JSON ends early (truncated)"
           : full_           ? "unexpected character"
                             : "unsupported JSON value (only strings, integers, arrays, objects)");
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

  bool literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) return false;
    pos_ += lit.size();
    return true;
  }

  /// An integer (kInt), or under kFull one with a fraction and/or exponent (kReal).
  void number(JsonValue& v) {
    const std::size_t start = pos_;
    v.kind = JsonValue::Kind::kInt;
    v.integer = integer();
    if (!full_ || pos_ >= s_.size() || (s_[pos_] != '.' && s_[pos_] != 'e' && s_[pos_] != 'E')) return;
    const auto digits = [&] {
      const std::size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == from) fail("expected digits");
    };
    if (s_[pos_] == '.') {
      ++pos_;
      digits();
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      digits();
    }
    const auto r = std::from_chars(s_.data() + start, s_.data() + pos_, v.real);
    if (r.ec != std::errc() || r.ptr != s_.data() + pos_) fail("number out of range");
    v.kind = JsonValue::Kind::kReal;
    v.integer = 0;
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
    if (!full_ && pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E'))
      fail("only integers are supported in a safetensors header");
    return neg ? -static_cast<std::int64_t>(v) : static_cast<std::int64_t>(v);
  }

  std::string string() {
    return read_json_string(s_, pos_, [this](const std::string& what) { fail(what); });
  }

  std::string_view s_;
  const std::string& where_;
  bool full_;
  std::size_t pos_ = 0;
};

}  // namespace json_impl

/// Parses one JSON document; `where` starts every error message.
[[nodiscard]] inline JsonValue parse_json(std::string_view text, const std::string& where,
                                          JsonSubset subset = JsonSubset::kSafetensorsHeader) {
  return json_impl::Parser(text, where, subset).parse_document();
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

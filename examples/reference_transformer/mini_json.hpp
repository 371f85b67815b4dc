// SPDX-License-Identifier: Apache-2.0
// A small JSON reader for the example's reference files (stories260K_greedy_ref.json): objects,
// arrays, strings (with escapes, \u to UTF-8), numbers (as double), true/false/null. Depth is
// limited; errors throw triattn::format_error with the byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/file_io.hpp>
#include <triattn/core/stats/json.hpp>

namespace triattn_example::json {

struct Value {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0.0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  [[nodiscard]] const Value& at(const std::string& key) const {
    if (kind != Kind::kObject) throw triattn::format_error("json: not an object (looking up \"" + key + "\")");
    const auto it = object.find(key);
    if (it == object.end()) throw triattn::format_error("json: missing key \"" + key + "\"");
    return it->second;
  }
  [[nodiscard]] const Value& at(std::size_t i) const {
    if (kind != Kind::kArray) throw triattn::format_error("json: not an array");
    if (i >= array.size()) throw triattn::format_error("json: index " + std::to_string(i) + " out of range");
    return array[i];
  }
  [[nodiscard]] bool has(const std::string& key) const { return kind == Kind::kObject && object.count(key) != 0; }
  [[nodiscard]] double num() const {
    if (kind != Kind::kNumber) throw triattn::format_error("json: not a number");
    return number;
  }
  [[nodiscard]] const std::string& str() const {
    if (kind != Kind::kString) throw triattn::format_error("json: not a string");
    return string;
  }
  [[nodiscard]] std::size_t size() const { return kind == Kind::kArray ? array.size() : object.size(); }
  /// Array of numbers as floats / ints.
  [[nodiscard]] std::vector<float> floats() const {
    std::vector<float> v;
    for (std::size_t i = 0; i < size(); ++i) v.push_back(static_cast<float>(at(i).num()));
    return v;
  }
  [[nodiscard]] std::vector<double> doubles() const {
    std::vector<double> v;
    for (std::size_t i = 0; i < size(); ++i) v.push_back(at(i).num());
    return v;
  }
  [[nodiscard]] std::vector<int> ints() const {
    std::vector<int> v;
    for (std::size_t i = 0; i < size(); ++i) v.push_back(static_cast<int>(at(i).num()));
    return v;
  }
};

class Parser {
 public:
  Parser(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {}

  Value parse() {
    Value v = value(0);
    ws();
    if (p_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw triattn::format_error(where_ + ": JSON error at byte " + std::to_string(p_) + ": " + what);
  }
  void ws() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\r' || s_[p_] == '\t')) ++p_;
  }
  char peek() {
    ws();
    if (p_ >= s_.size()) fail("unexpected end");
    return s_[p_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++p_;
  }
  bool literal(std::string_view lit) {
    if (s_.substr(p_, lit.size()) != lit) return false;
    p_ += lit.size();
    return true;
  }

  Value value(int depth) {
    if (depth > 64) fail("nesting too deep");
    Value v;
    const char c = peek();
    if (c == '{') {
      v.kind = Value::Kind::kObject;
      ++p_;
      if (peek() == '}') {
        ++p_;
        return v;
      }
      for (;;) {
        if (peek() != '"') fail("expected a key");
        std::string key = string();
        expect(':');
        Value item = value(depth + 1);
        if (!v.object.emplace(key, std::move(item)).second) fail("duplicate key \"" + key + "\"");
        const char n = peek();
        ++p_;
        if (n == '}') break;
        if (n != ',') fail("expected ',' or '}'");
      }
    } else if (c == '[') {
      v.kind = Value::Kind::kArray;
      ++p_;
      if (peek() == ']') {
        ++p_;
        return v;
      }
      for (;;) {
        v.array.push_back(value(depth + 1));
        const char n = peek();
        ++p_;
        if (n == ']') break;
        if (n != ',') fail("expected ',' or ']'");
      }
    } else if (c == '"') {
      v.kind = Value::Kind::kString;
      v.string = string();
    } else if (literal("true")) {
      v.kind = Value::Kind::kBool;
      v.boolean = true;
    } else if (literal("false")) {
      v.kind = Value::Kind::kBool;
    } else if (literal("null")) {
      v.kind = Value::Kind::kNull;
    } else {
      v.kind = Value::Kind::kNumber;
      v.number = number();
    }
    return v;
  }

  double number() {
    const std::size_t start = p_;
    while (p_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[p_])) || s_[p_] == '-' || s_[p_] == '+' ||
                              s_[p_] == '.' || s_[p_] == 'e' || s_[p_] == 'E'))
      ++p_;
    if (start == p_) fail("unexpected character");
    const std::string tok(s_.substr(start, p_ - start));
    char* end = nullptr;
    const double d = std::strtod(tok.c_str(), &end);
    if (end != tok.c_str() + tok.size()) fail("bad number '" + tok + "'");
    return d;
  }

  std::string string() {
    return triattn::detail::read_json_string(s_, p_, [this](const std::string& what) { fail(what); });
  }

  std::string_view s_;
  std::string where_;
  std::size_t p_ = 0;
};

inline Value parse(std::string_view text, const std::string& where = "json") { return Parser(text, where).parse(); }

/// Largest JSON file parse_file() reads (the reference files are tens of KiB).
inline constexpr std::uint64_t kMaxFileBytes = std::uint64_t{256} << 20;

inline Value parse_file(const std::string& path) {
  return parse(triattn::read_regular_file<std::string>(path, kMaxFileBytes), path);
}

}  // namespace triattn_example::json

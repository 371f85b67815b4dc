// SPDX-License-Identifier: Apache-2.0
// triattn's native statistics format: a safetensors file (8-byte little-endian header length,
// JSON header, raw little-endian data) holding three F32 tensors "q_mean_real", "q_mean_imag",
// "q_abs_mean" of shape [num_layers, num_q_heads, F] and string metadata
//   format = "triattn-stats-v1", model_name, rope_style, head_dim, num_layers, num_q_heads,
//   first_q_head, content_crc32.
// content_crc32 (8 lowercase hex digits) is the CRC-32 of every other metadata entry, sorted by
// key, as key NUL value NUL, followed by the whole data section. safetensors itself has no
// checksum; this one makes flipped bytes in values or metadata detectable. The loader is as
// strict as the .pt loader: offsets inside the data, tensors tiling it without gaps or overlap,
// F32 only, shapes matching the metadata, finite values, |q_mean| <= q_abs_mean.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/json.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {

/// Value of the "format" metadata entry of files written by this version.
inline constexpr std::string_view kStatsFormatName = "triattn-stats-v1";

namespace detail {

inline constexpr std::uint64_t kMaxSafetensorsHeader = std::uint64_t{1} << 24;  // ours are < 1 KiB
inline constexpr std::array<const char*, 3> kStatsTensorNames = {"q_mean_real", "q_mean_imag", "q_abs_mean"};

// CRC over metadata (without content_crc32, sorted by key) and then the data section.
[[nodiscard]] inline std::uint32_t stats_content_crc(const std::map<std::string, std::string>& meta,
                                                     std::span<const std::uint8_t> data) {
  std::uint32_t crc = 0;
  const char nul = '\0';
  for (const auto& [k, v] : meta) {
    if (k == "content_crc32") continue;
    crc = crc32_update(crc, k.data(), k.size());
    crc = crc32_update(crc, &nul, 1);
    crc = crc32_update(crc, v.data(), v.size());
    crc = crc32_update(crc, &nul, 1);
  }
  return crc32_update(crc, data.data(), data.size());
}

// Strict decimal: digits only, no sign, no leading zeros, at most 9 digits.
[[nodiscard]] inline std::optional<int> parse_decimal(std::string_view s) {
  if (s.empty() || s.size() > 9 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  int v = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace detail

/// The native file as bytes (see the file comment). Throws logic_error if `stats` is malformed
/// (wrong sizes, odd head_dim, non-finite values...): such a file could never be loaded.
[[nodiscard]] inline std::vector<std::uint8_t> serialize_safetensors_stats(const QueryStats& stats) {
  detail::require_valid_stats(stats, "serialize_safetensors_stats");
  const std::size_t n = stats.q_mean_real.size();
  std::vector<std::uint8_t> data;
  data.reserve(3 * n * 4);
  for (const auto* v : {&stats.q_mean_real, &stats.q_mean_imag, &stats.q_abs_mean})
    for (const float x : *v) detail::append_le_f32(data, x);

  std::map<std::string, std::string> meta = {
      {"format", std::string(kStatsFormatName)},
      {"model_name", stats.model_name},
      {"rope_style", rope_style_name(stats.rope_style)},
      {"head_dim", std::to_string(stats.head_dim)},
      {"num_layers", std::to_string(stats.num_layers)},
      {"num_q_heads", std::to_string(stats.num_q_heads)},
      {"first_q_head", std::to_string(stats.first_q_head)},
  };
  meta["content_crc32"] = detail::hex32(detail::stats_content_crc(meta, data));

  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : meta) {
    if (!first) header += ',';  // appended piecewise: g++ 12 warns falsely on "literal" + string&&
    header += detail::json_quote(k);
    header += ':';
    header += detail::json_quote(v);
    first = false;
  }
  header += "}";
  const std::string shape = "[" + std::to_string(stats.num_layers) + "," + std::to_string(stats.num_q_heads) + "," +
                            std::to_string(stats.num_freqs()) + "]";
  for (std::size_t t = 0; t < 3; ++t) {
    header += std::string(",\"") + detail::kStatsTensorNames[t] + "\":{\"dtype\":\"F32\",\"shape\":" + shape +
              ",\"data_offsets\":[" + std::to_string(t * n * 4) + "," + std::to_string((t + 1) * n * 4) + "]}";
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // data starts 8-byte aligned, as safetensors pads

  std::vector<std::uint8_t> out;
  out.reserve(8 + header.size() + data.size());
  detail::append_le64(out, header.size());
  detail::append_bytes(out, header);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

inline void save_safetensors_stats(const std::string& path, const QueryStats& stats) {
  const auto bytes = serialize_safetensors_stats(stats);
  detail::write_file_bytes(path, bytes);
}

/// Loads the native format from memory; `name` starts every error message (format_error).
[[nodiscard]] inline QueryStats load_safetensors_stats(std::span<const std::uint8_t> bytes, const std::string& name,
                                                       const StatsExpectation& expect = {}) {
  using detail::JsonValue;
  auto fail = [&](const std::string& what) -> void { throw format_error(name + ": " + what); };
  if (bytes.size() < 8)
    fail("file has only " + std::to_string(bytes.size()) + " bytes, too short for a safetensors header (truncated?)");
  const std::uint64_t header_len = detail::load_le64(bytes.data());
  if (header_len > bytes.size() - 8)
    fail("header length " + std::to_string(header_len) + " runs past the end of the file (" +
         std::to_string(bytes.size()) + " bytes): truncated or not a safetensors file");
  if (header_len < 2 || header_len > detail::kMaxSafetensorsHeader)
    fail("implausible header length " + std::to_string(header_len));
  std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(header_len));
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);  // alignment padding is spaces only
  if (text.empty() || text.back() != '}') fail("header does not end with a JSON object (corrupted padding?)");
  const JsonValue root = detail::parse_json(text, name + ": header");
  const std::span<const std::uint8_t> data = bytes.subspan(8 + static_cast<std::size_t>(header_len));
  if (root.kind != JsonValue::Kind::kObject) fail("header is not a JSON object");

  // Metadata: a string -> string map.
  const JsonValue* meta_json = root.find("__metadata__");
  if (!meta_json || meta_json->kind != JsonValue::Kind::kObject) fail("header has no __metadata__ object");
  std::map<std::string, std::string> meta;
  for (std::size_t i = 0; i < meta_json->keys.size(); ++i) {
    if (meta_json->items[i].kind != JsonValue::Kind::kString)
      fail("__metadata__." + meta_json->keys[i] + " is not a string");
    meta[meta_json->keys[i]] = meta_json->items[i].str;
  }
  auto need = [&](const char* key) -> const std::string& {
    const auto it = meta.find(key);
    if (it == meta.end()) fail(std::string("__metadata__ has no \"") + key + "\" entry");
    return it->second;
  };
  auto need_int = [&](const char* key) {
    const auto v = detail::parse_decimal(need(key));
    if (!v) fail(std::string("__metadata__.") + key + " \"" + need(key) + "\" is not a non-negative decimal integer");
    return *v;
  };
  if (need("format") != kStatsFormatName)
    fail("__metadata__.format is \"" + need("format") + "\", expected \"" + std::string(kStatsFormatName) + "\"");
  QueryStats out;
  out.model_name = need("model_name");
  const auto style = parse_rope_style(need("rope_style"));
  if (!style) fail("__metadata__.rope_style \"" + need("rope_style") + "\" is neither \"half\" nor \"interleaved\"");
  out.rope_style = *style;
  out.head_dim = need_int("head_dim");
  out.num_layers = need_int("num_layers");
  out.num_q_heads = need_int("num_q_heads");
  out.first_q_head = need_int("first_q_head");
  const std::string& crc_text = need("content_crc32");
  if (auto p = detail::geometry_problem(out.num_layers, out.num_q_heads, out.head_dim))
    fail("__metadata__ describes an unsupported geometry: " + *p);
  const int nf = out.num_freqs();
  const std::uint64_t count = static_cast<std::uint64_t>(out.num_layers) * out.num_q_heads * nf;

  // Tensors: exactly the three, F32, shape [L, Hq, F], tiling the data section.
  std::array<std::pair<std::uint64_t, std::uint64_t>, 3> ranges{};  // [begin, end) per tensor name
  std::array<bool, 3> present{};
  for (std::size_t i = 0; i < root.keys.size(); ++i) {
    const std::string& key = root.keys[i];
    if (key == "__metadata__") continue;
    std::size_t t = 0;
    while (t < 3 && key != detail::kStatsTensorNames[t]) ++t;
    if (t == 3) fail("unexpected tensor \"" + key + "\" (a stats file holds q_mean_real, q_mean_imag, q_abs_mean)");
    present[t] = true;
    const JsonValue& info = root.items[i];
    if (info.kind != JsonValue::Kind::kObject || info.keys.size() != 3) fail("tensor " + key + ": malformed description");
    const JsonValue* dtype = info.find("dtype");
    const JsonValue* shape = info.find("shape");
    const JsonValue* offs = info.find("data_offsets");
    if (!dtype || !shape || !offs) fail("tensor " + key + ": needs exactly dtype, shape and data_offsets");
    if (dtype->kind != JsonValue::Kind::kString || dtype->str != "F32")
      fail("tensor " + key + " has dtype " + (dtype->kind == JsonValue::Kind::kString ? dtype->str : "?") +
           "; only F32 is supported");
    const std::array<std::int64_t, 3> want = {out.num_layers, out.num_q_heads, nf};
    bool shape_ok = shape->kind == JsonValue::Kind::kArray && shape->items.size() == 3;
    for (std::size_t d = 0; shape_ok && d < 3; ++d)
      shape_ok = shape->items[d].kind == JsonValue::Kind::kInt && shape->items[d].integer == want[d];
    if (!shape_ok)
      fail("tensor " + key + " does not have shape [" + std::to_string(want[0]) + ", " + std::to_string(want[1]) + ", " +
           std::to_string(want[2]) + "] = [num_layers, num_q_heads, head_dim / 2] from __metadata__");
    if (offs->kind != JsonValue::Kind::kArray || offs->items.size() != 2 ||
        offs->items[0].kind != JsonValue::Kind::kInt || offs->items[1].kind != JsonValue::Kind::kInt ||
        offs->items[0].integer < 0 || offs->items[1].integer < offs->items[0].integer)
      fail("tensor " + key + ": data_offsets must be [begin, end] with 0 <= begin <= end");
    ranges[t] = {static_cast<std::uint64_t>(offs->items[0].integer), static_cast<std::uint64_t>(offs->items[1].integer)};
    if (ranges[t].second > data.size())
      fail("tensor " + key + ": data_offsets end " + std::to_string(ranges[t].second) + " is past the " +
           std::to_string(data.size()) + " data bytes (truncated?)");
    if (ranges[t].second - ranges[t].first != count * 4)
      fail("tensor " + key + " spans " + std::to_string(ranges[t].second - ranges[t].first) + " bytes, expected " +
           std::to_string(count * 4) + " for its shape");
  }
  for (std::size_t t = 0; t < 3; ++t)
    if (!present[t]) fail(std::string("tensor ") + detail::kStatsTensorNames[t] + " is missing");
  auto sorted = ranges;
  std::sort(sorted.begin(), sorted.end());
  std::uint64_t cursor = 0;
  for (const auto& [b, e] : sorted) {
    if (b != cursor) fail("tensor data overlaps or leaves a gap at data byte " + std::to_string(std::min(b, cursor)));
    cursor = e;
  }
  if (cursor != data.size())
    fail(std::to_string(data.size() - cursor) + " data bytes after the last tensor (the buffer must be fully indexed)");

  const std::uint32_t crc = detail::stats_content_crc(meta, data);
  if (crc_text.size() != 8 || crc_text.find_first_not_of("0123456789abcdef") != std::string::npos)
    fail("__metadata__.content_crc32 \"" + crc_text + "\" is not 8 lowercase hex digits");
  if (crc_text != detail::hex32(crc) && detail::kEnforceChecksums)
    fail("content CRC-32 mismatch (stored " + crc_text + ", computed " + detail::hex32(crc) +
         "): the values or metadata are corrupted");

  std::vector<float>* dst[3] = {&out.q_mean_real, &out.q_mean_imag, &out.q_abs_mean};
  for (std::size_t t = 0; t < 3; ++t) {
    dst[t]->resize(static_cast<std::size_t>(count));
    const std::uint8_t* p = data.data() + ranges[t].first;
    for (std::size_t i = 0; i < count; ++i) (*dst[t])[i] = detail::load_le_f32(p + 4 * i);
  }
  detail::finish_loaded_stats(out, expect, name);
  return out;
}

[[nodiscard]] inline QueryStats load_safetensors_stats(const std::string& path, const StatsExpectation& expect = {}) {
  const std::vector<std::uint8_t> bytes = detail::read_file_bytes(path);
  return load_safetensors_stats(std::span<const std::uint8_t>(bytes), path, expect);
}

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// Pieces shared by the statistics readers and writers: the caller's geometry expectation
// (StatsExpectation), value checks that every loader applies (finite values, |mean| <= mean |z|),
// rope-style names, CRC-32, little-endian byte access and whole-file I/O (through file_io.hpp).
// Readers work on an in-memory byte span so the same code serves files, tests and fuzzers.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/file_io.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {

/// Geometry the caller knows from the model config. A loader compares every field that is set
/// with what the file holds and throws triattn::format_error naming expected and found values:
/// the files carry no model config, so this is the only guard against loading the wrong model's
/// statistics.
struct StatsExpectation {
  std::optional<int> num_layers;
  std::optional<int> num_q_heads;  ///< heads held in the file (a TP slice file holds a share)
  std::optional<int> head_dim;
  std::optional<RopeStyle> rope_style;
};

/// "half" or "interleaved": the spelling used by TriAttention's files and by ours.
[[nodiscard]] inline const char* rope_style_name(RopeStyle style) noexcept {
  return style == RopeStyle::kInterleaved ? "interleaved" : "half";
}

[[nodiscard]] inline std::optional<RopeStyle> parse_rope_style(std::string_view name) noexcept {
  if (name == "half") return RopeStyle::kHalf;
  if (name == "interleaved") return RopeStyle::kInterleaved;
  return std::nullopt;
}

/// Largest statistics file the loaders read (real ones are a few MiB; the per-array cap
/// kMaxStatsValues bounds a valid file far below this).
inline constexpr std::uint64_t kMaxStatsFileBytes = std::uint64_t{1} << 30;

namespace detail {

// Upper bounds that keep a hostile file from asking for absurd allocations. Real models are far
// below them (Qwen3-8B: 36 layers, 32 heads, head_dim 128).
inline constexpr int kMaxStatsLayers = 1 << 12;
inline constexpr int kMaxStatsHeads = 1 << 12;
inline constexpr int kMaxStatsHeadDim = 1 << 12;
inline constexpr std::uint64_t kMaxStatsValues = std::uint64_t{1} << 24;  // per array: 64 MiB of float

// Fuzz builds define FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION (the libFuzzer / OSS-Fuzz
// convention) so that mutated inputs get past checksums into the parsers behind them.
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
inline constexpr bool kEnforceChecksums = false;
#else
inline constexpr bool kEnforceChecksums = true;
#endif

/// "layer03_head05": TriAttention's key spelling, also used to name heads in messages.
[[nodiscard]] inline std::string head_key(int layer, int head) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "layer%02d_head%02d", layer, head);
  return buf;
}

[[nodiscard]] inline std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", static_cast<unsigned>(v));
  return buf;
}

// CRC-32 (IEEE 802.3, reflected, poly 0xEDB88320): the checksum zip stores per entry.
[[nodiscard]] inline const std::array<std::uint32_t, 256>& crc32_table() noexcept {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

/// Continues a CRC: pass 0 to start, feed the previous result to continue.
[[nodiscard]] inline std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) noexcept {
  const auto& t = crc32_table();
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::uint32_t c = ~crc;
  for (std::size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return ~c;
}

[[nodiscard]] inline std::uint32_t crc32(std::span<const std::uint8_t> bytes) noexcept {
  return crc32_update(0, bytes.data(), bytes.size());
}

[[nodiscard]] inline std::uint16_t load_le16(const std::uint8_t* p) noexcept {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
[[nodiscard]] inline std::uint32_t load_le32(const std::uint8_t* p) noexcept {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
[[nodiscard]] inline std::uint64_t load_le64(const std::uint8_t* p) noexcept {
  return static_cast<std::uint64_t>(load_le32(p)) | (static_cast<std::uint64_t>(load_le32(p + 4)) << 32);
}
[[nodiscard]] inline float load_le_f32(const std::uint8_t* p) noexcept { return std::bit_cast<float>(load_le32(p)); }

inline void append_le16(std::vector<std::uint8_t>& out, std::uint16_t v) {
  out.push_back(static_cast<std::uint8_t>(v));
  out.push_back(static_cast<std::uint8_t>(v >> 8));
}
inline void append_le32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
inline void append_le64(std::vector<std::uint8_t>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
inline void append_le_f32(std::vector<std::uint8_t>& out, float v) { append_le32(out, std::bit_cast<std::uint32_t>(v)); }
inline void append_bytes(std::vector<std::uint8_t>& out, std::string_view s) { out.insert(out.end(), s.begin(), s.end()); }

/// True when [offset, offset + length) lies inside [0, limit), without overflow.
[[nodiscard]] constexpr bool fits(std::uint64_t offset, std::uint64_t length, std::uint64_t limit) noexcept {
  return offset <= limit && length <= limit - offset;
}

/// Whole statistics file into memory (triattn::read_regular_file, capped at kMaxStatsFileBytes):
/// a missing, unreadable, oversized or non-regular file is a format_error naming the path.
[[nodiscard]] inline std::vector<std::uint8_t> read_file_bytes(const std::string& path) {
  return read_regular_file<std::vector<std::uint8_t>>(path, kMaxStatsFileBytes);
}

/// Writes through a temporary file renamed into place (triattn::write_file_atomically).
inline void write_file_bytes(const std::string& path, std::span<const std::uint8_t> bytes) {
  write_file_atomically(path, bytes);
}

/// Problems of a geometry (range limits, odd head_dim), or nullopt.
[[nodiscard]] inline std::optional<std::string> geometry_problem(int num_layers, int num_q_heads, int head_dim) {
  if (num_layers < 1 || num_layers > kMaxStatsLayers)
    return "num_layers " + std::to_string(num_layers) + " is outside [1, " + std::to_string(kMaxStatsLayers) + "]";
  if (num_q_heads < 1 || num_q_heads > kMaxStatsHeads)
    return "num_q_heads " + std::to_string(num_q_heads) + " is outside [1, " + std::to_string(kMaxStatsHeads) + "]";
  if (head_dim < 2 || head_dim > kMaxStatsHeadDim || head_dim % 2 != 0)
    return "head_dim " + std::to_string(head_dim) + " must be even and in [2, " + std::to_string(kMaxStatsHeadDim) + "]";
  if (static_cast<std::uint64_t>(num_layers) * num_q_heads * (head_dim / 2) > kMaxStatsValues)
    return std::to_string(num_layers) + " layers x " + std::to_string(num_q_heads) + " heads x " +
           std::to_string(head_dim / 2) + " frequencies exceed the supported " + std::to_string(kMaxStatsValues) +
           " values per array";
  return std::nullopt;
}

/// Shape problems of a QueryStats object (wrong vector sizes, odd head_dim...), or nullopt.
[[nodiscard]] inline std::optional<std::string> stats_shape_problem(const QueryStats& s) {
  if (auto p = geometry_problem(s.num_layers, s.num_q_heads, s.head_dim)) return p;
  if (s.first_q_head < 0) return "first_q_head " + std::to_string(s.first_q_head) + " is negative";
  if (s.rope_style != RopeStyle::kHalf && s.rope_style != RopeStyle::kInterleaved)
    return "rope_style " + std::to_string(static_cast<int>(s.rope_style)) + " is not a RopeStyle";
  const std::size_t n = static_cast<std::size_t>(s.num_layers) * s.num_q_heads * s.num_freqs();
  for (const auto* v : {&s.q_mean_real, &s.q_mean_imag, &s.q_abs_mean}) {
    if (v->size() != n)
      return "a statistics array holds " + std::to_string(v->size()) + " values, expected num_layers * num_q_heads * F = " +
             std::to_string(n);
  }
  return std::nullopt;
}

/// First non-finite value or violated |q_mean| <= q_abs_mean (1e-5 relative tolerance), or
/// nullopt. The names use the head's global index, as TriAttention's key does.
[[nodiscard]] inline std::optional<std::string> stats_value_problem(const QueryStats& s) {
  const int nf = s.num_freqs();
  const char* names[3] = {"q_mean_real", "q_mean_imag", "q_abs_mean"};
  for (int l = 0; l < s.num_layers; ++l) {
    for (int h = 0; h < s.num_q_heads; ++h) {
      const float* arr[3] = {s.mean_real(l, h), s.mean_imag(l, h), s.abs_mean(l, h)};
      for (int f = 0; f < nf; ++f) {
        for (int a = 0; a < 3; ++a) {
          if (std::isfinite(arr[a][f])) continue;
          return head_key(l, s.first_q_head + h) + " " + names[a] + "[" + std::to_string(f) + "] is " +
                 (std::isnan(arr[a][f]) ? "NaN" : "infinite");
        }
        const double re = arr[0][f], im = arr[1][f], mag = std::sqrt(re * re + im * im), abs_mean = arr[2][f];
        if (mag <= abs_mean * (1.0 + 1e-5)) continue;
        return head_key(l, s.first_q_head + h) + " f=" + std::to_string(f) + ": |q_mean| = " + std::to_string(mag) +
               " exceeds q_abs_mean = " + std::to_string(abs_mean) +
               " (a mean magnitude can never be below the magnitude of the mean)";
      }
    }
  }
  return std::nullopt;
}

/// Throws format_error "<path>: ..." when `s` does not match the caller's expectation.
inline void check_expectation(const QueryStats& s, const StatsExpectation& expect, const std::string& path) {
  auto mismatch = [&](const char* what, const std::string& want, const std::string& found) {
    throw format_error(path + ": " + what + " mismatch: expected " + want + ", the file has " + found +
                       " (statistics of another model?)");
  };
  if (expect.num_layers && *expect.num_layers != s.num_layers)
    mismatch("num_layers", std::to_string(*expect.num_layers), std::to_string(s.num_layers));
  if (expect.num_q_heads && *expect.num_q_heads != s.num_q_heads)
    mismatch("num_q_heads", std::to_string(*expect.num_q_heads), std::to_string(s.num_q_heads));
  if (expect.head_dim && *expect.head_dim != s.head_dim)
    mismatch("head_dim", std::to_string(*expect.head_dim), std::to_string(s.head_dim));
  if (expect.rope_style && *expect.rope_style != s.rope_style)
    mismatch("rope_style", rope_style_name(*expect.rope_style), rope_style_name(s.rope_style));
}

/// Checks a freshly loaded object: values first (they name the entry), then the expectation.
inline void finish_loaded_stats(const QueryStats& s, const StatsExpectation& expect, const std::string& path) {
  if (auto p = stats_shape_problem(s)) throw format_error(path + ": " + *p);
  if (auto p = stats_value_problem(s)) throw format_error(path + ": " + *p);
  check_expectation(s, expect, path);
}

/// For writers and slicers: a malformed in-memory object is the caller's bug (logic_error).
inline void require_valid_stats(const QueryStats& s, const std::string& context) {
  if (auto p = stats_shape_problem(s)) throw logic_error(context + ": " + *p);
  if (auto p = stats_value_problem(s)) throw logic_error(context + ": " + *p);
}

}  // namespace detail
}  // namespace triattn

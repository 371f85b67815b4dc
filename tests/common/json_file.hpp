// SPDX-License-Identifier: Apache-2.0
// Reference data files (llama2.c's and llama.cpp's recorded runs, *_ref.json) read with the
// library's JSON reader in its full subset, and their number arrays converted for comparison.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <triattn/core/file_io.hpp>
#include <triattn/core/stats/json.hpp>

namespace triattn::test {

/// Largest reference file json_file() reads (the files are tens of KiB).
inline constexpr std::uint64_t kMaxJsonFileBytes = std::uint64_t{256} << 20;

/// The JSON document in `path` (a regular file of at most kMaxJsonFileBytes).
/// @throws triattn::format_error / io_error naming the path.
inline triattn::detail::JsonValue json_file(const std::string& path) {
  return triattn::detail::parse_json(triattn::read_regular_file<std::string>(path, kMaxJsonFileBytes), path,
                                     triattn::detail::JsonSubset::kFull);
}

/// An array of numbers as T (float, double, or int: a fraction truncates).
template <class T>
std::vector<T> json_numbers(const triattn::detail::JsonValue& v) {
  if (v.kind != triattn::detail::JsonValue::Kind::kArray) throw triattn::format_error("json: not an array");
  std::vector<T> out;
  out.reserve(v.items.size());
  for (const auto& item : v.items) out.push_back(static_cast<T>(item.as_double()));
  return out;
}

/// A string value. @throws triattn::format_error otherwise.
inline const std::string& json_string(const triattn::detail::JsonValue& v) {
  if (v.kind != triattn::detail::JsonValue::Kind::kString) throw triattn::format_error("json: not a string");
  return v.str;
}

}  // namespace triattn::test

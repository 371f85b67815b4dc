// SPDX-License-Identifier: Apache-2.0
// Integer values of command-line options, parsed strictly: the whole value must be an integer (no
// empty string, sign-only or '+' sign, spaces or trailing text) inside the option's range. One
// parser for every integer option of reference_transformer, so they all refuse the same inputs;
// split_list for the options that take a comma-separated list.
#pragma once

#include <charconv>
#include <string>
#include <system_error>
#include <vector>

#include <triattn/core/error.hpp>

namespace triattn_example {

/// `value` of option `flag` as an integer in [lo, hi].
/// @throws triattn::logic_error "option FLAG: 'VALUE' is not an integer" or "... is outside [lo, hi]".
[[nodiscard]] inline long long parse_int_option(const std::string& flag, const std::string& value, long long lo,
                                                long long hi) {
  long long x = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, x);
  if (value.empty() || ec == std::errc::invalid_argument || ptr != end)
    throw triattn::logic_error("option " + flag + ": '" + value + "' is not an integer");
  if (ec == std::errc::result_out_of_range || x < lo || x > hi)
    throw triattn::logic_error("option " + flag + ": " + value + " is outside [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + "]");
  return x;
}

/// The comma-separated items of an option's value, empty ones kept (so a value parser refuses
/// them by name): "a,,b" gives {"a", "", "b"}, "" gives {""}.
[[nodiscard]] inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    std::size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    out.push_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

}  // namespace triattn_example

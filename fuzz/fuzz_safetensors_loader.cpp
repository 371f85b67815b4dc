// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: arbitrary bytes into the native safetensors loader (length prefix, JSON
// header, offsets, metadata). A triattn::error naming the file is the expected outcome for bad
// input; anything else (other exceptions, crashes, sanitizer reports, a loaded object breaking
// its invariants or not surviving a write/read round trip) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <triattn/core/stats.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  constexpr std::string_view kName = "fuzz.safetensors";
  try {
    const triattn::QueryStats s =
        triattn::load_safetensors_stats(std::span<const std::uint8_t>(data, size), std::string(kName));
    if (triattn::detail::stats_shape_problem(s) || triattn::detail::stats_value_problem(s)) __builtin_trap();
    const auto again = triattn::serialize_safetensors_stats(s);
    const triattn::QueryStats back = triattn::load_safetensors_stats(std::span<const std::uint8_t>(again), "fuzz.rt");
    if (back.q_mean_real != s.q_mean_real || back.q_abs_mean != s.q_abs_mean || back.model_name != s.model_name ||
        back.first_q_head != s.first_q_head)
      __builtin_trap();
  } catch (const triattn::error& e) {
    if (std::string_view(e.what()).substr(0, kName.size()) != kName) __builtin_trap();
  }
  return 0;
}

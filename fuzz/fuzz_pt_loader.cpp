// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: arbitrary bytes into the `.pt` loader (zip reader, pickle decoder, tensor
// interpretation). A triattn::error whose message starts with the file name is the expected
// outcome for bad input; any other exception, a crash, a sanitizer report, an error message
// without the file name, or a loaded object that breaks its invariants is a finding.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <triattn/core/stats.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  constexpr std::string_view kName = "fuzz.pt";
  try {
    const triattn::QueryStats s = triattn::load_pt_stats(std::span<const std::uint8_t>(data, size), std::string(kName));
    if (triattn::detail::stats_shape_problem(s) || triattn::detail::stats_value_problem(s)) __builtin_trap();
    // Whatever loads must survive the native format unchanged.
    const auto st = triattn::serialize_safetensors_stats(s);
    const triattn::QueryStats back = triattn::load_safetensors_stats(std::span<const std::uint8_t>(st), "fuzz.rt");
    if (back.q_mean_real != s.q_mean_real || back.q_mean_imag != s.q_mean_imag || back.q_abs_mean != s.q_abs_mean ||
        back.model_name != s.model_name)
      __builtin_trap();
  } catch (const triattn::error& e) {
    if (std::string_view(e.what()).substr(0, kName.size()) != kName) __builtin_trap();
  }
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: arbitrary bytes straight into the pickle decoder, so mutations are not
// filtered by the zip layer first. Only triattn::format_error may come out.
#include <cstddef>
#include <cstdint>
#include <span>

#include <triattn/core/stats/pickle_reader.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto doc = triattn::detail::parse_pickle(std::span<const std::uint8_t>(data, size), "fuzz.pkl");
    // Every reference must point into the arena.
    for (const auto& o : doc.objects)
      for (const auto id : o.items)
        if (id >= doc.objects.size()) __builtin_trap();
    if (doc.root >= doc.objects.size()) __builtin_trap();
  } catch (const triattn::format_error&) {
  }
  return 0;
}

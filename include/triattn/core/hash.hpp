// SPDX-License-Identifier: Apache-2.0
// The 64-bit mixing function behind every seeded choice: the random scorer's scores
// (ref::random_score_hash), and the examples' and tests' synthetic weights and inputs. One
// definition for host and device code, so a value generated on the GPU equals the host's bit for bit.
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>

namespace triattn {

/// splitmix64's finaliser applied to x + 0x9e3779b97f4a7c15 (one step of the splitmix64 sequence):
/// xor-shift / multiply rounds with odd constants, a bijection on uint64 whose output bits all
/// depend on every input bit. mix64(seed + k·0x9e3779b97f4a7c15) for k = 0, 1, ... is splitmix64.
[[nodiscard]] TRIATTN_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// Division by a run-time divisor fixed at launch (block sizes), as a multiply-high and a shift.
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn::cuda::detail {

/// Unsigned division by a run-time divisor with one multiply-high and one shift (Granlund &
/// Montgomery, as CUTLASS's FastDivmod): exact for every n < 2^31.
struct FastDiv {
  std::uint32_t mul = 0;    ///< 0 means divisor 1
  std::uint32_t shift = 0;

  FastDiv() = default;
  /// @param d divisor, 1 <= d < 2^31
  explicit FastDiv(int d) {
    if (d <= 1) return;
    int l = 0;  // ceil(log2 d)
    while ((1u << l) < static_cast<std::uint32_t>(d)) ++l;
    const int p = 31 + l;
    mul = static_cast<std::uint32_t>(((std::uint64_t{1} << p) + static_cast<std::uint64_t>(d) - 1) /
                                     static_cast<std::uint64_t>(d));
    shift = static_cast<std::uint32_t>(p - 32);
  }
  [[nodiscard]] TRIATTN_HOST_DEVICE std::uint32_t div(std::uint32_t n) const {
#if defined(__CUDA_ARCH__)
    return mul ? (__umulhi(n, mul) >> shift) : n;
#else
    return mul ? static_cast<std::uint32_t>((static_cast<std::uint64_t>(n) * mul) >> 32) >> shift : n;
#endif
  }
};

}  // namespace triattn::cuda::detail

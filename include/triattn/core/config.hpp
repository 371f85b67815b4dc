// SPDX-License-Identifier: Apache-2.0
// Portability macros shared by host-only and CUDA code. Host-only: includes nothing from CUDA.
#pragma once

#define TRIATTN_VERSION_MAJOR 0
#define TRIATTN_VERSION_MINOR 1
#define TRIATTN_VERSION_PATCH 0

// Functions in core/ that kernels may call are marked TRIATTN_HOST_DEVICE; under g++ they are
// plain inline functions, so core/ never needs a CUDA header.
#if defined(__CUDACC__)
#define TRIATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TRIATTN_HOST_DEVICE inline
#endif

namespace triattn::detail {
// std::min/std::max are constexpr __host__ only and cannot be called from device code.
template <class T>
TRIATTN_HOST_DEVICE constexpr T min_(T a, T b) { return b < a ? b : a; }
template <class T>
TRIATTN_HOST_DEVICE constexpr T max_(T a, T b) { return a < b ? b : a; }
template <class T>
TRIATTN_HOST_DEVICE constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }
// std::bit_cast is __host__ only under nvcc; the builtin it wraps works on both sides.
template <class To, class From>
TRIATTN_HOST_DEVICE constexpr To bit_cast_(const From& from) noexcept { return __builtin_bit_cast(To, from); }
}  // namespace triattn::detail

// SPDX-License-Identifier: Apache-2.0
// Streaming global loads of packed cache words and element access by storage type.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <triattn/core/dtype.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn::cuda::detail {

/// Read-only 16-byte / 8-byte / 4-byte global loads that do not allocate in L1 (each key is read once).
__device__ __forceinline__ uint4 ldg_stream_v4(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ldg_stream_v2(const void* p) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ std::uint32_t ldg_stream_u32(const void* p) {
  std::uint32_t r;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

/// Loads kBytes (a multiple of 8, or 4 for the byte-wide fp8 runs) contiguous bytes into
/// words[0 .. kBytes/4).
template <int kBytes>
__device__ __forceinline__ void load_words(const void* p, std::uint32_t* words) {
  static_assert(kBytes % 4 == 0, "loads are 4, 8 or 16 bytes wide");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int v = 0; v < kBytes / 16; ++v) {
      const uint4 r = ldg_stream_v4(static_cast<const char*>(p) + 16 * v);
      words[4 * v + 0] = r.x;
      words[4 * v + 1] = r.y;
      words[4 * v + 2] = r.z;
      words[4 * v + 3] = r.w;
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int v = 0; v < kBytes / 8; ++v) {
      const uint2 r = ldg_stream_v2(static_cast<const char*>(p) + 8 * v);
      words[2 * v + 0] = r.x;
      words[2 * v + 1] = r.y;
    }
  } else {
#pragma unroll
    for (int v = 0; v < kBytes / 4; ++v) words[v] = ldg_stream_u32(static_cast<const char*>(p) + 4 * v);
  }
}

/// Element e (0-based) of a packed array of storage type T, as float (fp8: before its scale).
template <class T>
__device__ __forceinline__ float element(const std::uint32_t* words, int e) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(words[e]);
  } else if constexpr (std::is_same_v<T, bf16_storage>) {
    const std::uint32_t w = words[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  } else if constexpr (std::is_same_v<T, fp8_e4m3_storage>) {
    // The code's value before its scale (exact), byte e % 4 of word e / 4.
    const auto b = static_cast<__nv_fp8_storage_t>((words[e >> 2] >> (8 * (e & 3))) & 0xffu);
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
  } else {
    static_assert(std::is_same_v<T, f16_storage>, "storage type must be float, f16_storage, bf16_storage or fp8_e4m3_storage");
    const std::uint32_t w = words[e >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((e & 1) ? (w >> 16) : (w & 0xffffu))));
  }
}

}  // namespace triattn::cuda::detail

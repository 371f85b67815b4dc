// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the CUDA benchmarks: H200 rooflines, device allocation and upload, a seeded
// bf16 fill, bandwidth counters, and the device-to-device copy every copy-bound benchmark is
// compared against. Benchmark code: errors end the process (TRIATTN_BENCH_CUDA).
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda_event_timer.hpp"

namespace triattn::bench {

/// Measured on the H200 (benchmarks/probe/bandwidth_probe.cu and the issue's figures).
inline constexpr double kReadRoofline = 4.49e12;  // bytes/s, HBM read
inline constexpr double kCopyRoofline = 4.25e12;  // bytes/s, device copy counting read + write

template <class U>
[[nodiscard]] U* device_alloc(std::size_t n) {
  U* p = nullptr;
  TRIATTN_BENCH_CUDA(cudaMalloc(&p, n * sizeof(U)));
  return p;
}

template <class U>
[[nodiscard]] U* upload(const std::vector<U>& h) {
  U* d = device_alloc<U>(h.size());
  TRIATTN_BENCH_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(U), cudaMemcpyHostToDevice));
  return d;
}

/// 32 well-mixed bits from (index, seed): the benchmarks' stateless device random source.
__device__ __forceinline__ std::uint32_t hash_index(std::size_t i, std::uint32_t seed) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  x *= 3266489917u;
  x ^= x >> 16;
  return x;
}

/// bf16 patterns in ±[0.5, 2) from a hash of (index, seed): finite, no denormals, cheap.
/// @param p [n] bf16 bit patterns
__global__ void fill_random_bf16(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t x = hash_index(i, seed);
    p[i] = static_cast<std::uint16_t>((x & 0x8000u) | ((126u + ((x >> 8) & 1u)) << 7) | (x & 0x7Fu));
  }
}

/// bf16 values roughly N(0, 1.5) (Box-Muller on a hash of (index, seed)): key-like data.
/// @param p [n] bf16 bit patterns
__global__ void fill_gaussian_bf16(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t x = hash_index(i, seed);
    const float u = (static_cast<float>(x & 0xffffu) + 0.5f) / 65536.0f;
    const float v = (static_cast<float>(x >> 16) + 0.5f) / 65536.0f;
    const float g = sqrtf(-2.0f * logf(u)) * cospif(2.0f * v) * 1.5f;
    p[i] = static_cast<std::uint16_t>(__float_as_uint(g) >> 16);
  }
}

/// Bytes/s counters for `bytes` moved per iteration: GB/s and percent of `roofline`.
inline void report_bandwidth(benchmark::State& state, double bytes, double roofline) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_roofline"] =
      benchmark::Counter(bytes / roofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
}

/// Times cudaMemcpyAsync of `bytes` device to device from a cold L2 and reports it against the
/// copy roofline (read + write counted): the practical ceiling of a copy-bound kernel.
inline void time_device_copy(benchmark::State& state, std::size_t bytes) {
  char* src = device_alloc<char>(bytes);
  char* dst = device_alloc<char>(bytes);
  TRIATTN_BENCH_CUDA(cudaMemset(src, 1, bytes));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  {
    L2Flusher flush;
    for (auto _ : state) {
      CudaEventTimer timer(state, stream, &flush);
      TRIATTN_BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    }
  }
  report_bandwidth(state, 2.0 * static_cast<double>(bytes), kCopyRoofline);
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(dst);
}

}  // namespace triattn::bench

// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the CUDA benchmarks: H200 rooflines, device allocation and upload, a seeded
// bf16 fill, bandwidth counters, the device-to-device copy every copy-bound benchmark is
// compared against, and the card's read bandwidth measured in the running process. Benchmark
// code: errors end the process (TRIATTN_BENCH_CUDA).
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_fp8.h>
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

/// Roughly N(0, 1.5) from one Box-Muller draw on the hash of (index, seed).
__device__ __forceinline__ float gaussian_at(std::size_t i, std::uint32_t seed) {
  const std::uint32_t x = hash_index(i, seed);
  const float u = (static_cast<float>(x & 0xffffu) + 0.5f) / 65536.0f;
  const float v = (static_cast<float>(x >> 16) + 0.5f) / 65536.0f;
  return sqrtf(-2.0f * logf(u)) * cospif(2.0f * v) * 1.5f;
}

/// bf16 values roughly N(0, 1.5) (Box-Muller on a hash of (index, seed)): key-like data.
/// @param p [n] bf16 bit patterns
__global__ void fill_gaussian_bf16(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<std::uint16_t>(__float_as_uint(gaussian_at(i, seed)) >> 16);
  }
}

/// fp8 e4m3 values from the same N(0, 1.5) / `scale` (saturating): stored values of a cache whose
/// dequantisation scale is `scale`. @param p [n] e4m3 bytes
__global__ void fill_gaussian_fp8(std::uint8_t* p, std::size_t n, std::uint32_t seed, float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(gaussian_at(i, seed) / scale, __NV_SATFINITE, __NV_E4M3));
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

/// Reads `n` 16-byte words of `p` (grid-stride, four loads in flight per thread) and writes
/// nothing unless their XOR is a value random data never gives: a kernel that only reads.
__global__ void read_only_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

/// The current device's measured read bandwidth in bytes/s: the best of `reps` passes of
/// read_only_kernel over `bytes` (many times L2, so every pass reads HBM), measured once per
/// process. Decode steps read weights and KV once: this is their floor's denominator.
inline double measured_read_bandwidth(std::size_t bytes = std::size_t{2} << 30, int reps = 10) {
  static double bw = 0;
  if (bw > 0) return bw;
  const std::size_t words = bytes / 16;
  uint4* p = device_alloc<uint4>(words);
  unsigned* sink = device_alloc<unsigned>(1);
  fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(p), words * 8, 7);
  int sms = 0, dev = 0;
  TRIATTN_BENCH_CUDA(cudaGetDevice(&dev));
  TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaEvent_t t0, t1;
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t0));
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t1));
  float best = 0.f;
  for (int r = 0; r <= reps; ++r) {  // pass 0 warms up
    TRIATTN_BENCH_CUDA(cudaEventRecord(t0));
    read_only_kernel<<<static_cast<unsigned>(sms * 8), 512>>>(p, words, sink);
    TRIATTN_BENCH_CUDA(cudaEventRecord(t1));
    TRIATTN_BENCH_CUDA(cudaEventSynchronize(t1));
    float ms = 0.f;
    TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, t0, t1));
    if (r > 0 && (best == 0.f || ms < best)) best = ms;
  }
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaFree(p);
  cudaFree(sink);
  bw = static_cast<double>(words * 16) / (static_cast<double>(best) * 1e-3);
  return bw;
}

}  // namespace triattn::bench

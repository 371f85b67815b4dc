// SPDX-License-Identifier: Apache-2.0
// RAII CUDA-event timer for Google Benchmark manual timing: records an event pair around the
// body on the benchmark's stream, optionally flushes L2 first, and reports the elapsed time with
// state.SetIterationTime(). Register benchmarks with ->UseManualTime().
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

namespace triattn::bench {

/// Aborting is acceptable here: this is benchmark code, not library code.
#define TRIATTN_BENCH_CUDA(call)                                                             \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

/// How L2Flusher empties L2 before a timed region.
///   kDirty: cudaMemsetAsync of 2x L2. L2 ends full of dirty lines of the flush buffer, so the
///           timed kernel also pays their write-back (up to one L2, 50 MB on an H200: ~12 µs of
///           HBM time, a third of a 134 MB read). Kept as the historical default.
///   kClean: a read kernel over 2x L2 (the buffer is written once, at construction). L2 ends
///           full of clean lines: the timed kernel reads from HBM and writes nothing back, as
///           after the weight-streaming GEMVs that precede attention in a decode step.
enum class L2Flush { kDirty, kClean };

/// Streams n 16-byte vectors [n] with U independent loads in flight per thread (grid-stride
/// sweeps of gridDim.x * blockDim.x * U vectors); the xor into *sink keeps the loads alive.
/// kReadOnce: __ldcs (evict-first, for read-rate baselines); else __ldcg (allocates in L2, what
/// the clean flush needs).
template <int U, bool kReadOnce>
__global__ void stream_read_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t base = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; base < n;
       base += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::size_t i = base + u * stride;
      v[u] = i < n ? (kReadOnce ? __ldcs(p + i) : __ldcg(p + i)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

/// Buffer twice the L2, written (kDirty) or read (kClean) before a timed region so the region
/// starts with a cold cache.
class L2Flusher {
 public:
  explicit L2Flusher(L2Flush mode = L2Flush::kDirty) : mode_(mode) {
    int dev = 0;
    TRIATTN_BENCH_CUDA(cudaGetDevice(&dev));
    TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&bytes_, cudaDevAttrL2CacheSize, dev));
    TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
    bytes_ *= 2;
    TRIATTN_BENCH_CUDA(cudaMalloc(&buf_, static_cast<size_t>(bytes_) + 16));
    TRIATTN_BENCH_CUDA(cudaMemset(buf_, 0, static_cast<size_t>(bytes_) + 16));
    TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  }
  ~L2Flusher() { cudaFree(buf_); }
  L2Flusher(const L2Flusher&) = delete;
  L2Flusher& operator=(const L2Flusher&) = delete;
  void flush(cudaStream_t s) {
    if (mode_ == L2Flush::kDirty) {
      TRIATTN_BENCH_CUDA(cudaMemsetAsync(buf_, 0, static_cast<size_t>(bytes_), s));
    } else {
      auto* p = static_cast<const uint4*>(buf_);
      stream_read_kernel<1, false><<<sms_ * 4, 512, 0, s>>>(p, static_cast<std::size_t>(bytes_) / 16,
                                                    reinterpret_cast<unsigned*>(static_cast<char*>(buf_) + bytes_));
      TRIATTN_BENCH_CUDA(cudaGetLastError());
    }
  }

 private:
  L2Flush mode_;
  int bytes_ = 0;
  int sms_ = 1;
  void* buf_ = nullptr;
};

/// Times its own lifetime on `stream` with CUDA events.
class CudaEventTimer {
 public:
  CudaEventTimer(benchmark::State& state, cudaStream_t stream, L2Flusher* flush = nullptr)
      : state_(state), stream_(stream) {
    if (flush) flush->flush(stream_);
    TRIATTN_BENCH_CUDA(cudaEventCreate(&start_));
    TRIATTN_BENCH_CUDA(cudaEventCreate(&stop_));
    TRIATTN_BENCH_CUDA(cudaEventRecord(start_, stream_));
  }
  ~CudaEventTimer() {
    TRIATTN_BENCH_CUDA(cudaEventRecord(stop_, stream_));
    TRIATTN_BENCH_CUDA(cudaEventSynchronize(stop_));
    float ms = 0.f;
    TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    state_.SetIterationTime(static_cast<double>(ms) * 1e-3);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }

 private:
  benchmark::State& state_;
  cudaStream_t stream_;
  cudaEvent_t start_{}, stop_{};
};

}  // namespace triattn::bench

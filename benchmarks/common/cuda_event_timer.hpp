// SPDX-License-Identifier: Apache-2.0
// RAII CUDA-event timer for Google Benchmark manual timing: records an event pair around the
// body on the benchmark's stream, optionally flushes L2 first, and reports the elapsed time with
// state.SetIterationTime(). Register benchmarks with ->UseManualTime().
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

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

/// Buffer as large as L2, memset before a timed region so the region starts with a cold cache.
class L2Flusher {
 public:
  L2Flusher() {
    int dev = 0;
    TRIATTN_BENCH_CUDA(cudaGetDevice(&dev));
    TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&bytes_, cudaDevAttrL2CacheSize, dev));
    bytes_ *= 2;
    TRIATTN_BENCH_CUDA(cudaMalloc(&buf_, static_cast<size_t>(bytes_)));
  }
  ~L2Flusher() { cudaFree(buf_); }
  void flush(cudaStream_t s) { TRIATTN_BENCH_CUDA(cudaMemsetAsync(buf_, 0, static_cast<size_t>(bytes_), s)); }

 private:
  int bytes_ = 0;
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

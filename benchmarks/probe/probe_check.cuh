// SPDX-License-Identifier: Apache-2.0
// The standalone probes' CUDA error check: prints the failing call and returns 1 from main.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>

#define CHECK(x)                                              \
  do {                                                        \
    cudaError_t err_ = (x);                                   \
    if (err_ != cudaSuccess) {                                \
      std::printf("%s: %s\n", #x, cudaGetErrorString(err_));  \
      return 1;                                               \
    }                                                         \
  } while (0)

/// The MMA probes' device outputs: a 4-byte sink that keeps a kernel's results live and
/// `clocks` clock counts; freed when it goes out of scope (also on CHECK's early return).
struct ProbeOutputs {
  float* sink = nullptr;
  long long* cycles = nullptr;
  ProbeOutputs() = default;
  ProbeOutputs(const ProbeOutputs&) = delete;
  ProbeOutputs& operator=(const ProbeOutputs&) = delete;
  ~ProbeOutputs() {
    cudaFree(sink);
    cudaFree(cycles);
  }
  cudaError_t allocate(int clocks) {
    const cudaError_t err = cudaMalloc(&sink, 4);
    return err != cudaSuccess ? err : cudaMalloc(&cycles, sizeof(long long) * static_cast<std::size_t>(clocks));
  }
};

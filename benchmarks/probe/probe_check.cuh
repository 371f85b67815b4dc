// SPDX-License-Identifier: Apache-2.0
// The standalone probes' CUDA error check: prints the failing call and returns 1 from main.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CHECK(x)                                              \
  do {                                                        \
    cudaError_t err_ = (x);                                   \
    if (err_ != cudaSuccess) {                                \
      std::printf("%s: %s\n", #x, cudaGetErrorString(err_));  \
      return 1;                                               \
    }                                                         \
  } while (0)

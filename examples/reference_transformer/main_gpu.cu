// SPDX-License-Identifier: Apache-2.0
// The reference_transformer program built with the CUDA backend (TRIATTN_ENABLE_CUDA=ON): main.cpp
// compiled as CUDA with TRIATTN_EXAMPLE_CUDA defined, which adds --device gpu (CudaBackend,
// cuda_backend.cuh). The CPU path is the same code as the CPU-only build's.
#ifndef TRIATTN_EXAMPLE_CUDA
#define TRIATTN_EXAMPLE_CUDA 1
#endif
#include "main.cpp"

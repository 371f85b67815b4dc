// SPDX-License-Identifier: Apache-2.0
// The serving program built with the CUDA backend (TRIATTN_ENABLE_CUDA=ON): main.cpp compiled as
// CUDA with TRIATTN_EXAMPLE_CUDA defined, which adds --device gpu.
#ifndef TRIATTN_EXAMPLE_CUDA
#define TRIATTN_EXAMPLE_CUDA 1
#endif
#include "main.cpp"

// SPDX-License-Identifier: Apache-2.0
// Entry of the CUDA layer: requires C++20 and pulls in the host-only core.
#pragma once

#if __cplusplus < 202002L
#error "triattn's CUDA layer needs C++20: with CMake 3.25 add target_compile_options(<t> PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>) (linking triattn::cuda does this for you)"
#endif

#include <cuda_runtime.h>

#include <triattn/core/config.hpp>

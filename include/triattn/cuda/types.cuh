// SPDX-License-Identifier: Apache-2.0
// Maps core's storage tags to CUDA's 16-bit types and gives kernels float load/store helpers.
// f16_storage/__half and bf16_storage/__nv_bfloat16 have identical bit layouts, so a view of
// storage tags is reinterpreted, never converted.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <utility>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn::cuda {

template <class T> struct device_type { using type = T; };
template <> struct device_type<f16_storage> { using type = __half; };
template <> struct device_type<bf16_storage> { using type = __nv_bfloat16; };
/// CUDA arithmetic type of a storage type (float -> float, f16_storage -> __half, ...).
template <class T> using device_type_t = typename device_type<T>::type;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/// The run-time dtype switch of code that reaches the CUDA kernels: f is instantiated for
/// device_storage_types only, and another dtype throws triattn::unsupported "fp8_e4m3 KV is not
/// supported by <op> on the GPU yet". Call it qualified (triattn::dispatch_dtype is found by ADL).
template <class F>
decltype(auto) dispatch_dtype(DType dtype, const std::string& op, F&& f) {
  return dispatch_dtype_in(device_storage_types{}, dtype, op + " on the GPU", std::forward<F>(f));
}
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  return cuda::dispatch_dtype(dtype, std::string("the CUDA kernels"), std::forward<F>(f));
}

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Maps core's storage tags to CUDA's types and gives kernels float load/store helpers.
// f16_storage/__half, bf16_storage/__nv_bfloat16 and fp8_e4m3_storage/__nv_fp8_e4m3 have identical
// bit layouts, so a view of storage tags is reinterpreted, never converted.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <string>
#include <type_traits>
#include <utility>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn::cuda {

template <class T> struct device_type { using type = T; };
template <> struct device_type<f16_storage> { using type = __half; };
template <> struct device_type<bf16_storage> { using type = __nv_bfloat16; };
template <> struct device_type<fp8_e4m3_storage> { using type = __nv_fp8_e4m3; };
/// CUDA arithmetic type of a storage type (float -> float, f16_storage -> __half, ...).
template <class T> using device_type_t = typename device_type<T>::type;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
/// The code's value before its scale (exact: every e4m3 value is a float).
__device__ __forceinline__ float to_f32(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
/// Nearest even, saturating to +-448 (NaN gives 0x7f): core's from_float<fp8_e4m3_storage>.
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_f32<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return r;
}

/// Query type of decode attention over a cache of T: T itself, float for scaled (fp8) caches.
template <class T> using query_type_t = std::conditional_t<is_scaled_dtype<T>, float, T>;

/// Dequantisation scale of (layer, kind, head) as kernels read it: the view's for scaled dtypes,
/// a compile-time 1 otherwise (no load, so unscaled kernels compile as before).
template <class T, class Id>
__device__ __forceinline__ float kv_scale(const KvCacheView<T, Id>& view, int layer, KvKind kind, int head) {
  if constexpr (is_scaled_dtype<T>) return view.scale(layer, kind, head);
  else return 1.0f;
}
/// Value of element x of a cache of T under `scale` (core's dequantize): to_f32(x) * scale for
/// scaled dtypes, to_f32(x) otherwise.
template <class T, class D>
__device__ __forceinline__ float dequant(D x, float scale) {
  if constexpr (is_scaled_dtype<T>) return to_f32(x) * scale;
  else return to_f32(x);
}
/// Stored element of value x under `scale` (core's quantize): from_f32(x / scale) for scaled
/// dtypes (saturating), from_f32(x) otherwise.
template <class T>
__device__ __forceinline__ device_type_t<T> quant(float x, float scale) {
  if constexpr (is_scaled_dtype<T>) return from_f32<device_type_t<T>>(x / scale);
  else return from_f32<device_type_t<T>>(x);
}

/// The run-time dtype switch of code that reaches the CUDA kernels: f is instantiated for the
/// storage types of `types` only (device_storage_types: every dtype the kernels load), and
/// another dtype throws triattn::unsupported "<dtype> KV is not supported by <op> on the GPU yet".
/// A path that does not take fp8 yet passes unscaled_storage_types. Call it qualified
/// (triattn::dispatch_dtype is found by ADL).
template <class... Ts, class F>
decltype(auto) dispatch_dtype(storage_types<Ts...> types, DType dtype, const std::string& op, F&& f) {
  return dispatch_dtype_in(types, dtype, op + " on the GPU", std::forward<F>(f));
}
template <class F>
decltype(auto) dispatch_dtype(DType dtype, const std::string& op, F&& f) {
  return cuda::dispatch_dtype(device_storage_types{}, dtype, op, std::forward<F>(f));
}
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  return cuda::dispatch_dtype(dtype, std::string("the CUDA kernels"), std::forward<F>(f));
}

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Storage dtypes of the cache (float32, fp16, bf16, fp8 e4m3) and exact conversions. fp16/bf16/fp8
// are storage tags holding raw bits, so core/ never needs cuda_fp16.h; cuda/ maps them to __half
// and __nv_bfloat16. Conversions round to nearest even; fp16/bf16 keep NaN and Inf, fp8 e4m3 (the
// OCP/NVIDIA "e4m3fn": no Inf) saturates to +-448 like __nv_cvt_float_to_fp8(__NV_SATFINITE).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>

namespace triattn {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kFP8E4M3 = 3 };

/// IEEE binary16 bits.
struct f16_storage {
  std::uint16_t bits;
};
/// bfloat16 bits (the upper half of a float32).
struct bf16_storage {
  std::uint16_t bits;
};
/// fp8 e4m3fn bits: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no Inf, NaN = 0x7f / 0xff,
/// largest finite 448. A cache of it keeps per-layer (or per (layer, KV head)) scales: a stored
/// code c means to_float(c) * scale (vLLM's k_scale / v_scale).
struct fp8_e4m3_storage {
  std::uint8_t bits;
};
static_assert(sizeof(f16_storage) == 2 && std::is_trivially_copyable_v<f16_storage>);
static_assert(sizeof(bf16_storage) == 2 && std::is_trivially_copyable_v<bf16_storage>);
static_assert(sizeof(fp8_e4m3_storage) == 1 && std::is_trivially_copyable_v<fp8_e4m3_storage>);

[[nodiscard]] constexpr std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kFP8E4M3: return 1;
  }
  return 0;
}
[[nodiscard]] inline const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kFP8E4M3: return "fp8_e4m3";
  }
  return "unknown";
}
/// True for a value of DType (a cast int may hold anything).
[[nodiscard]] constexpr bool is_valid_dtype(DType t) noexcept { return dtype_size(t) != 0; }

template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr DType value = DType::kF32; };
template <> struct dtype_of_t<f16_storage> { static constexpr DType value = DType::kF16; };
template <> struct dtype_of_t<bf16_storage> { static constexpr DType value = DType::kBF16; };
template <> struct dtype_of_t<fp8_e4m3_storage> { static constexpr DType value = DType::kFP8E4M3; };
/// The DType enumerator of a storage type (float, f16_storage, bf16_storage, fp8_e4m3_storage).
template <class T> inline constexpr DType dtype_of = dtype_of_t<std::remove_cv_t<T>>::value;
/// Storage types whose codes carry a scale (value = to_float(code) * scale): the fp8 types.
template <class T> inline constexpr bool is_scaled_dtype = std::is_same_v<std::remove_cv_t<T>, fp8_e4m3_storage>;

namespace detail {
/// Rounds `value >> shift` to nearest, ties to even (shift in [1, 63]).
TRIATTN_HOST_DEVICE constexpr std::uint64_t shift_round_even(std::uint64_t value, int shift) noexcept {
  if (shift >= 64) return 0;
  const std::uint64_t q = value >> shift;
  const std::uint64_t rem = value & ((std::uint64_t{1} << shift) - 1);
  const std::uint64_t half = std::uint64_t{1} << (shift - 1);
  return (rem > half || (rem == half && (q & 1))) ? q + 1 : q;
}
}  // namespace detail

/// float32 -> binary16 bits, round to nearest even; overflow gives Inf, NaN stays a (quiet) NaN.
[[nodiscard]] constexpr std::uint16_t f32_to_f16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t exp = (x >> 23) & 0xffu;
  const std::uint32_t mant = x & 0x7fffffu;
  if (exp == 0xffu) {  // Inf or NaN: keep the top payload bits and force the quiet bit for NaN
    return mant == 0 ? static_cast<std::uint16_t>(sign | 0x7c00u)
                     : static_cast<std::uint16_t>(sign | 0x7e00u | (mant >> 13));
  }
  if (exp >= 143) return static_cast<std::uint16_t>(sign | 0x7c00u);  // |f| >= 2^16: Inf
  if (exp >= 113) {  // normal half (a carry out of the mantissa correctly bumps the exponent, up to Inf)
    const std::uint32_t bits = ((exp - 112) << 10) | (mant >> 13);
    const std::uint32_t rem = mant & 0x1fffu;
    const std::uint32_t r = (rem > 0x1000u || (rem == 0x1000u && (bits & 1u))) ? bits + 1 : bits;
    return static_cast<std::uint16_t>(sign | r);
  }
  if (exp == 0) return sign;  // float subnormals are far below half's smallest subnormal (2^-24)
  // half subnormal: value / 2^-24 = (mant | 2^23) * 2^(exp - 126)
  const std::uint64_t m = mant | 0x800000u;
  return static_cast<std::uint16_t>(sign | detail::shift_round_even(m, static_cast<int>(126 - exp)));
}

/// binary16 bits -> float32 (exact).
[[nodiscard]] constexpr float f16_bits_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    int e = 113;  // normalise the subnormal: value = mant * 2^-24
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    return std::bit_cast<float>(sign | (static_cast<std::uint32_t>(e) << 23) | ((mant & 0x3ffu) << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

/// float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN.
[[nodiscard]] constexpr std::uint16_t f32_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/// bfloat16 bits -> float32 (exact).
[[nodiscard]] constexpr float bf16_bits_to_f32(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// float32 -> fp8 e4m3fn bits, round to nearest even; |f| beyond 448 (Inf included) saturates to
/// +-448 (0x7e / 0xfe), NaN gives the canonical NaN 0x7f (whatever its sign). Same results as CUDA's
/// __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3); callable from device code.
[[nodiscard]] TRIATTN_HOST_DEVICE constexpr std::uint8_t f32_to_fp8_e4m3_bits(float f) noexcept {
  const std::uint32_t x = detail::bit_cast_<std::uint32_t>(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  const std::uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7fu;  // NaN
  if (mag >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448 (and Inf): saturate
  const std::uint32_t exp = mag >> 23;
  const std::uint32_t mant = mag & 0x7fffffu;
  if (exp >= 121) {  // normal e4m3 (2^-6 <= |f| < 448): a mantissa carry bumps the exponent, at most to 448
    const std::uint32_t bits = ((exp - 120) << 3) | (mant >> 20);
    const std::uint32_t rem = mant & 0xfffffu;
    const std::uint32_t r = (rem > 0x80000u || (rem == 0x80000u && (bits & 1u))) ? bits + 1 : bits;
    return static_cast<std::uint8_t>(sign | r);
  }
  if (exp == 0) return sign;  // float subnormals are far below e4m3's smallest subnormal (2^-9)
  // e4m3 subnormal: value / 2^-9 = (mant | 2^23) * 2^(exp - 141); rounding up to 8 gives 2^-6
  const std::uint64_t m = mant | 0x800000u;
  return static_cast<std::uint8_t>(sign | detail::shift_round_even(m, static_cast<int>(141 - exp)));
}

/// fp8 e4m3fn bits -> float32 (exact; 0x7f / 0xff give a quiet NaN with the sign).
[[nodiscard]] TRIATTN_HOST_DEVICE constexpr float fp8_e4m3_bits_to_f32(std::uint8_t b) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t exp = (b >> 3) & 0xfu;
  const std::uint32_t mant = b & 0x7u;
  if ((b & 0x7fu) == 0x7fu) return detail::bit_cast_<float>(sign | 0x7fc00000u);
  if (exp == 0) {  // subnormal: mant * 2^-9, exact in float
    const float v = static_cast<float>(mant) * 0.001953125f;
    return sign != 0 ? -v : v;
  }
  return detail::bit_cast_<float>(sign | ((exp + 120) << 23) | (mant << 20));
}

[[nodiscard]] constexpr float to_float(float x) noexcept { return x; }
[[nodiscard]] constexpr float to_float(f16_storage x) noexcept { return f16_bits_to_f32(x.bits); }
[[nodiscard]] constexpr float to_float(bf16_storage x) noexcept { return bf16_bits_to_f32(x.bits); }
/// The code's value before its scale (dequantise: to_float(c) * scale).
[[nodiscard]] constexpr float to_float(fp8_e4m3_storage x) noexcept { return fp8_e4m3_bits_to_f32(x.bits); }

/// float -> storage type T, rounding to nearest even (fp8: saturating, before any scale).
template <class T>
[[nodiscard]] constexpr T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, f16_storage>) return f16_storage{f32_to_f16_bits(x)};
  else if constexpr (std::is_same_v<T, fp8_e4m3_storage>) return fp8_e4m3_storage{f32_to_fp8_e4m3_bits(x)};
  else return bf16_storage{f32_to_bf16_bits(x)};
}

/// Value of a stored element under `scale` (1 for unscaled dtypes, where it costs nothing).
template <class T>
[[nodiscard]] constexpr float dequantize(T x, float scale) noexcept {
  if constexpr (is_scaled_dtype<T>) return to_float(x) * scale;
  else return to_float(x);
}
/// Stored element of value x under `scale`: from_float(x / scale) for scaled dtypes (saturating),
/// from_float(x) otherwise.
template <class T>
[[nodiscard]] constexpr T quantize(float x, float scale) noexcept {
  if constexpr (is_scaled_dtype<T>) return from_float<T>(x / scale);
  else return from_float<T>(x);
}

/// A set of storage types a code path is compiled for.
template <class... Ts> struct storage_types {};
/// Every storage type of DType, in enumerator order.
using all_storage_types = storage_types<float, f16_storage, bf16_storage, fp8_e4m3_storage>;
/// Storage types the CUDA kernels load (fp8 dequantised by the view's scales): cuda::dispatch_dtype's list.
using device_storage_types = storage_types<float, f16_storage, bf16_storage, fp8_e4m3_storage>;
/// Storage types without a scale: what a path that does not carry fp8 scales yet dispatches over
/// (dispatch_dtype_in), so that it refuses fp8 by name.
using unscaled_storage_types = storage_types<float, f16_storage, bf16_storage>;

/// Calls f(std::type_identity<T>{}) with the storage type of `dtype` when it is one of Ts...;
/// f is instantiated for those types only, so a path not written for a dtype still compiles.
/// @param op what refuses the others, as in "fp8_e4m3 KV is not supported by <op> yet"
/// @throws triattn::unsupported for a dtype outside Ts... (or outside DType), naming it and op.
template <class... Ts, class F>
decltype(auto) dispatch_dtype_in(storage_types<Ts...>, DType dtype, const std::string& op, F&& f) {
  using R = decltype(f(std::type_identity<float>{}));
  if constexpr (std::is_void_v<R>) {
    if (((dtype == dtype_of<Ts> ? (f(std::type_identity<Ts>{}), true) : false) || ...)) return;
  } else {
    R result{};
    if (((dtype == dtype_of<Ts> ? (result = f(std::type_identity<Ts>{}), true) : false) || ...)) return result;
  }
  if (!is_valid_dtype(dtype))
    throw unsupported("triattn: dtype " + std::to_string(static_cast<int>(dtype)) +
                      " not supported (supported: float32, float16, bfloat16, fp8_e4m3)");
  throw unsupported(std::string("triattn: ") + dtype_name(dtype) + " KV is not supported by " + op + " yet");
}

/// Calls f(std::type_identity<T>{}) with the storage type of `dtype` (float, f16_storage,
/// bf16_storage, fp8_e4m3_storage): the one run-time dtype switch of host code.
/// @throws triattn::unsupported for a value outside DType.
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  return dispatch_dtype_in(all_storage_types{}, dtype, "triattn", std::forward<F>(f));
}

}  // namespace triattn

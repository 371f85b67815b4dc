// SPDX-License-Identifier: Apache-2.0
// Storage dtypes of the cache (float32, fp16, bf16) and exact host conversions. fp16/bf16 are
// storage tags holding raw bits, so core/ never needs cuda_fp16.h; cuda/ maps them to __half and
// __nv_bfloat16. Conversions round to nearest even and keep NaN and Inf.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>

namespace triattn {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

/// IEEE binary16 bits.
struct f16_storage {
  std::uint16_t bits;
};
/// bfloat16 bits (the upper half of a float32).
struct bf16_storage {
  std::uint16_t bits;
};
static_assert(sizeof(f16_storage) == 2 && std::is_trivially_copyable_v<f16_storage>);
static_assert(sizeof(bf16_storage) == 2 && std::is_trivially_copyable_v<bf16_storage>);

[[nodiscard]] constexpr std::size_t dtype_size(DType t) noexcept { return t == DType::kF32 ? 4 : 2; }
[[nodiscard]] inline const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
  }
  return "unknown";
}

template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr DType value = DType::kF32; };
template <> struct dtype_of_t<f16_storage> { static constexpr DType value = DType::kF16; };
template <> struct dtype_of_t<bf16_storage> { static constexpr DType value = DType::kBF16; };
/// The DType enumerator of a storage type (float, f16_storage, bf16_storage).
template <class T> inline constexpr DType dtype_of = dtype_of_t<std::remove_cv_t<T>>::value;

namespace detail {
/// Rounds `value >> shift` to nearest, ties to even (shift in [1, 63]).
constexpr std::uint64_t shift_round_even(std::uint64_t value, int shift) noexcept {
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

[[nodiscard]] constexpr float to_float(float x) noexcept { return x; }
[[nodiscard]] constexpr float to_float(f16_storage x) noexcept { return f16_bits_to_f32(x.bits); }
[[nodiscard]] constexpr float to_float(bf16_storage x) noexcept { return bf16_bits_to_f32(x.bits); }

/// float -> storage type T, rounding to nearest even.
template <class T>
[[nodiscard]] constexpr T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, f16_storage>) return f16_storage{f32_to_f16_bits(x)};
  else return bf16_storage{f32_to_bf16_bits(x)};
}

/// Calls f(std::type_identity<T>{}) with the storage type of `dtype` (float, f16_storage,
/// bf16_storage): the one run-time dtype switch of host code.
/// @throws triattn::unsupported for a value outside DType.
template <class F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(std::type_identity<float>{});
    case DType::kF16: return f(std::type_identity<f16_storage>{});
    case DType::kBF16: return f(std::type_identity<bf16_storage>{});
  }
  throw unsupported("triattn: dtype " + std::to_string(static_cast<int>(dtype)) +
                    " not supported (supported: float32, float16, bfloat16)");
}

}  // namespace triattn

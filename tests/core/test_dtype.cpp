// SPDX-License-Identifier: Apache-2.0
// dtype.hpp: fp16/bf16 <-> float conversions checked exhaustively against an independent decoding
// written here from the IEEE definition (sign, biased exponent, fraction; std::ldexp on the fields)
// and an independent round-to-nearest-even built from the sorted table of every finite value.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <triattn/core/dtype.hpp>

#if defined(TRIATTN_TEST_HAVE_CUDA_FP8)
#include <cuda_fp8.h>  // host-callable __nv_cvt_float_to_fp8: the GPU's rounding
#endif

using namespace triattn;

namespace {

// ---- independent description of the two 16-bit formats ----------------------------------------
template <class T> struct Fmt;
template <> struct Fmt<f16_storage> {
  static constexpr int kExpBits = 5, kMantBits = 10, kBias = 15;
  static constexpr const char* kName = "fp16";
};
template <> struct Fmt<bf16_storage> {
  static constexpr int kExpBits = 8, kMantBits = 7, kBias = 127;
  static constexpr const char* kName = "bf16";
};

template <class T> constexpr std::uint32_t kExpMax = (1u << Fmt<T>::kExpBits) - 1u;     // all ones
template <class T> constexpr std::uint16_t kInfBits = static_cast<std::uint16_t>(kExpMax<T> << Fmt<T>::kMantBits);
template <class T> constexpr std::uint16_t kSignBit = 0x8000u;

/// Exact value of a 16-bit pattern from the IEEE definition. With `inf_as_next`, the Inf pattern
/// decodes to the finite value it would have with an unbounded exponent (2^(emax - bias)), the
/// "next value" after the largest finite one that round-to-nearest compares against.
template <class T>
double ref_decode(std::uint16_t bits, bool inf_as_next = false) {
  constexpr int M = Fmt<T>::kMantBits;
  const bool neg = (bits & 0x8000u) != 0;
  const std::uint32_t e = (bits >> M) & kExpMax<T>;
  const std::uint32_t m = bits & ((1u << M) - 1u);
  double mag;
  if (e == kExpMax<T>) {
    if (m != 0) return std::numeric_limits<double>::quiet_NaN();
    mag = inf_as_next ? std::ldexp(1.0, static_cast<int>(kExpMax<T>) - Fmt<T>::kBias)
                      : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    mag = std::ldexp(static_cast<double>(m), 1 - Fmt<T>::kBias - M);  // subnormal: 0.m * 2^(1-bias)
  } else {
    mag = std::ldexp(static_cast<double>(m + (1u << M)), static_cast<int>(e) - Fmt<T>::kBias - M);  // 1.m * 2^(e-bias)
  }
  return neg ? -mag : mag;
}

template <class T> bool is_nan_bits(std::uint16_t b) {
  return ((b >> Fmt<T>::kMantBits) & kExpMax<T>) == kExpMax<T> && (b & ((1u << Fmt<T>::kMantBits) - 1u)) != 0;
}

std::uint32_t fbits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_fbits(std::uint32_t u) { return std::bit_cast<float>(u); }

std::string hex(std::uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

/// Collects up to 8 failure descriptions so that a broken conversion reports a few examples
/// instead of 65,536 assertions.
struct Failures {
  std::size_t count = 0;
  std::vector<std::string> examples;
  void add(const std::string& s) {
    ++count;
    if (examples.size() < 8) examples.push_back(s);
  }
  void check(const char* what) const {
    std::string all;
    for (const auto& e : examples) all += "\n  " + e;
    CHECK_MESSAGE(count == 0, what << ": " << count << " failures, e.g." << all);
  }
};

/// Independent round-to-nearest-even: the sorted table of every non-negative finite value (plus
/// the virtual "next" value standing for Inf), searched for the neighbours of |x|.
template <class T>
struct RefRounder {
  std::vector<double> values;  // values[p] = value of pattern p, p in [0, inf pattern]
  RefRounder() {
    for (std::uint32_t p = 0; p <= kInfBits<T>; ++p) values.push_back(ref_decode<T>(static_cast<std::uint16_t>(p), true));
  }
  std::uint16_t round(float x) const {
    const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= values.back()) return static_cast<std::uint16_t>(sign | kInfBits<T>);  // also Inf itself
    // values[i] <= a < values[i + 1]
    const auto it = std::upper_bound(values.begin(), values.end(), a);
    const std::size_t i = static_cast<std::size_t>(it - values.begin()) - 1;
    const double lo = a - values[i], hi = values[i + 1] - a;  // exact (Sterbenz / zero)
    std::size_t pick = lo < hi ? i : (hi < lo ? i + 1 : ((i % 2 == 0) ? i : i + 1));
    return static_cast<std::uint16_t>(sign | pick);
  }
};

}  // namespace

TEST_SUITE("core") {

TEST_CASE("dtype: enum helpers") {
  CHECK(dtype_size(DType::kF32) == 4);
  CHECK(dtype_size(DType::kF16) == 2);
  CHECK(dtype_size(DType::kBF16) == 2);
  CHECK(std::string(dtype_name(DType::kF32)) == "float32");
  CHECK(std::string(dtype_name(DType::kF16)) == "float16");
  CHECK(std::string(dtype_name(DType::kBF16)) == "bfloat16");
  CHECK(dtype_size(DType::kFP8E4M3) == 1);
  CHECK(std::string(dtype_name(DType::kFP8E4M3)) == "fp8_e4m3");
  CHECK(dtype_of<fp8_e4m3_storage> == DType::kFP8E4M3);
  CHECK(std::string(dtype_name(static_cast<DType>(7))) == "unknown");
  CHECK(dtype_of<float> == DType::kF32);
  CHECK(dtype_of<f16_storage> == DType::kF16);
  CHECK(dtype_of<bf16_storage> == DType::kBF16);
  CHECK(dtype_of<const bf16_storage> == DType::kBF16);
  // float is its own storage type: both directions are the identity, bit for bit.
  for (std::uint32_t u : {0u, 0x80000000u, 0x3f800000u, 0x7f800000u, 0x7fc00001u, 0x00000001u, 0xff7fffffu}) {
    CHECK(fbits(to_float(from_fbits(u))) == u);
    CHECK(fbits(from_float<float>(from_fbits(u))) == u);
  }
  // The conversions are constexpr (kernels and tables may use them at compile time).
  static_assert(f32_to_f16_bits(1.0f) == 0x3c00 && f16_bits_to_f32(0x3c00) == 1.0f);
  static_assert(f32_to_bf16_bits(1.0f) == 0x3f80 && bf16_bits_to_f32(0x3f80) == 1.0f);
}

TEST_CASE_TEMPLATE("dtype: to_float is exact for all 65536 patterns", T, f16_storage, bf16_storage) {
  Failures f;
  std::size_t nans = 0, infs = 0;
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const float got = to_float(T{bits});
    const double want = ref_decode<T>(bits);
    if (std::isnan(want)) {
      ++nans;
      if (!std::isnan(got)) f.add(std::string(Fmt<T>::kName) + " " + hex(p) + " is NaN but decodes to " + hex(fbits(got)));
      else if (std::signbit(got) != ((bits & 0x8000u) != 0)) f.add(hex(p) + ": NaN lost its sign");
      continue;
    }
    if (std::isinf(want)) ++infs;
    // want is exactly representable in float (both formats are subsets of binary32).
    REQUIRE(static_cast<double>(static_cast<float>(want)) == want);
    if (fbits(got) != fbits(static_cast<float>(want)))  // bit compare: also checks the sign of zero
      f.add(std::string(Fmt<T>::kName) + " " + hex(p) + " -> " + hex(fbits(got)) + ", expected " +
            hex(fbits(static_cast<float>(want))));
  }
  f.check("to_float exactness");
  CHECK(infs == 2);
  CHECK(nans == 2 * ((1u << Fmt<T>::kMantBits) - 1u));
}

TEST_CASE_TEMPLATE("dtype: float(h) -> h round trip for all 65536 patterns", T, f16_storage, bf16_storage) {
  Failures f;
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const T back = from_float<T>(to_float(T{bits}));
    if (is_nan_bits<T>(bits)) {
      if (!is_nan_bits<T>(back.bits)) f.add(hex(p) + " (NaN) came back as non-NaN " + hex(back.bits));
      else if ((back.bits & 0x8000u) != (bits & 0x8000u)) f.add(hex(p) + " (NaN) lost its sign");
    } else if (back.bits != bits) {
      f.add(hex(p) + " came back as " + hex(back.bits));
    }
  }
  f.check("round trip");
}

TEST_CASE_TEMPLATE("dtype: midpoints of adjacent values round to even and +-1 ulp to the nearer", T, f16_storage,
                   bf16_storage) {
  Failures f;
  std::size_t pairs = 0;
  // Non-negative patterns are ordered like their values; pair (p, p + 1) runs from (+0, min
  // subnormal) up to (max finite, Inf), the latter's "value" being the first one past max.
  for (std::uint32_t p = 0; p < kInfBits<T>; ++p) {
    const auto a = static_cast<std::uint16_t>(p), b = static_cast<std::uint16_t>(p + 1);
    const double va = ref_decode<T>(a, true), vb = ref_decode<T>(b, true);
    REQUIRE(va < vb);
    const double mid = (va + vb) / 2;
    const float mf = static_cast<float>(mid);
    REQUIRE(static_cast<double>(mf) == mid);  // the midpoint is a float
    const std::uint16_t even = (a % 2 == 0) ? a : b;
    const float up = std::nextafter(mf, std::numeric_limits<float>::infinity());
    const float down = std::nextafter(mf, 0.0f);
    ++pairs;
    auto expect = [&](float x, std::uint16_t want, const char* what) {
      const std::uint16_t got = from_float<T>(x).bits;
      if (got != want)
        f.add(std::string(what) + " between " + hex(a) + " and " + hex(b) + " (x = " + hex(fbits(x)) + ") -> " +
              hex(got) + ", expected " + hex(want));
      const std::uint16_t gotn = from_float<T>(-x).bits;  // mirror image
      if (gotn != (want | kSignBit<T>))
        f.add(std::string("negative ") + what + " between " + hex(a) + " and " + hex(b) + " -> " + hex(gotn));
    };
    expect(mf, even, "midpoint");
    expect(up, b, "midpoint + 1 ulp");
    expect(down, a, "midpoint - 1 ulp");
    expect(static_cast<float>(va), a, "lower value");
  }
  f.check("round to nearest even at midpoints");
  CHECK(pairs == kInfBits<T>);
}

TEST_CASE_TEMPLATE("dtype: float -> 16-bit matches an independent rounding over a sweep of floats", T, f16_storage,
                   bf16_storage) {
  const RefRounder<T> ref;
  Failures f;
  std::size_t n = 0;
  // Every 997th float bit pattern (4.3 M, both signs, all binades, subnormals), NaNs excluded.
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 997) {
    const float x = from_fbits(static_cast<std::uint32_t>(u));
    if (std::isnan(x)) continue;
    ++n;
    const std::uint16_t got = from_float<T>(x).bits, want = ref.round(x);
    if (got != want) f.add(hex(static_cast<std::uint32_t>(u)) + " -> " + hex(got) + ", expected " + hex(want));
  }
  // And the neighbourhood of every 16-bit value (the hard cases for rounding code).
  for (std::uint32_t p = 0; p <= kInfBits<T>; ++p) {
    const float v = static_cast<float>(ref_decode<T>(static_cast<std::uint16_t>(p)));
    std::uint32_t c = fbits(v);
    for (std::uint32_t d = 0; d < 3; ++d) {
      for (std::uint32_t u : {c + d, c - d}) {
        const float x = from_fbits(u);
        if (std::isnan(x)) continue;
        for (float y : {x, -x}) {
          ++n;
          const std::uint16_t got = from_float<T>(y).bits, want = ref.round(y);
          if (got != want) f.add(hex(fbits(y)) + " -> " + hex(got) + ", expected " + hex(want));
        }
      }
    }
  }
  f.check("sweep against reference rounding");
  CHECK(n > 4'000'000);
}

TEST_CASE_TEMPLATE("dtype: NaN of every kind stays NaN (with its sign)", T, f16_storage, bf16_storage) {
  Failures f;
  // Signalling and quiet NaNs, payloads only in the low bits that a 16-bit format drops.
  std::vector<std::uint32_t> nans = {0x7f800001u, 0x7f800002u, 0x7f801fffu, 0x7f802000u, 0x7f80ffffu, 0x7fa00000u,
                                     0x7fc00000u, 0x7fffffffu, 0x7f810000u, 0x7fbfffffu};
  for (std::uint32_t k = 1; k < 0x800000u; k += 4093) nans.push_back(0x7f800000u | k);
  for (std::uint32_t u : nans) {
    for (std::uint32_t s : {0u, 0x80000000u}) {
      const float x = from_fbits(u | s);
      REQUIRE(std::isnan(x));
      const std::uint16_t got = from_float<T>(x).bits;
      if (!is_nan_bits<T>(got)) f.add(hex(u | s) + " -> " + hex(got) + " is not NaN");
      if (((got & 0x8000u) != 0) != (s != 0)) f.add(hex(u | s) + " lost its sign");
      if (!std::isnan(to_float(T{got}))) f.add(hex(u | s) + " does not decode back to NaN");
    }
  }
  f.check("NaN preservation");
}

TEST_CASE("dtype: fp16 special values") {
  auto h = [](float x) { return f32_to_f16_bits(x); };
  // Overflow: 65504 is the largest finite half; 65520 is the midpoint to 2^16 and ties to Inf.
  CHECK(h(65504.0f) == 0x7bff);
  CHECK(h(65519.99f) == 0x7bff);
  CHECK(h(std::nextafter(65520.0f, 0.0f)) == 0x7bff);
  CHECK(h(65520.0f) == 0x7c00);
  CHECK(h(-65520.0f) == 0xfc00);
  CHECK(h(-65519.99f) == 0xfbff);
  CHECK(h(65536.0f) == 0x7c00);
  CHECK(h(1e30f) == 0x7c00);
  CHECK(h(std::numeric_limits<float>::max()) == 0x7c00);
  CHECK(h(-std::numeric_limits<float>::max()) == 0xfc00);
  CHECK(h(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(h(-std::numeric_limits<float>::infinity()) == 0xfc00);
  // Signed zeros and values below half the smallest subnormal.
  CHECK(h(0.0f) == 0x0000);
  CHECK(h(-0.0f) == 0x8000);
  CHECK(h(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(h(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(h(std::numeric_limits<float>::min()) == 0x0000);
  CHECK(h(std::ldexp(1.0f, -26)) == 0x0000);
  // Subnormals: 2^-24 is the smallest; 2^-25 ties to 0 (even), anything above goes up.
  CHECK(h(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(h(std::ldexp(1.0f, -25)) == 0x0000);
  CHECK(h(-std::ldexp(1.0f, -25)) == 0x8000);
  CHECK(h(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(h(std::ldexp(3.0f, -25)) == 0x0002);  // 1.5 * 2^-24: tie between 1 and 2 -> 2
  CHECK(h(std::ldexp(5.0f, -25)) == 0x0002);  // 2.5 * 2^-24: tie between 2 and 3 -> 2
  CHECK(h(std::ldexp(1023.0f, -24)) == 0x03ff);  // largest subnormal
  CHECK(h(std::ldexp(2047.0f, -25)) == 0x0400);  // tie between largest subnormal and 2^-14 -> even 0x400
  CHECK(h(std::ldexp(1.0f, -14)) == 0x0400);     // smallest normal
  CHECK(f16_bits_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_bits_to_f32(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(f16_bits_to_f32(0x8000) == 0.0f);
  CHECK(std::signbit(f16_bits_to_f32(0x8000)));
  CHECK(f16_bits_to_f32(0x7bff) == 65504.0f);
  CHECK(std::isinf(f16_bits_to_f32(0x7c00)));
  CHECK(std::isnan(f16_bits_to_f32(0x7c01)));
  // Normal range ties.
  CHECK(h(1.0f) == 0x3c00);
  CHECK(h(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);         // tie -> even 0x3c00
  CHECK(h(1.0f + std::ldexp(3.0f, -11)) == 0x3c02);         // tie between 0x3c01 and 0x3c02
  CHECK(h(2049.0f) == 0x6800);                               // 2048 + 1: tie between 2048 and 2050 -> 2048
  CHECK(h(2051.0f) == 0x6802);                               // tie between 2050 and 2052 -> 2052
  CHECK(h(-2.0f) == 0xc000);
}

TEST_CASE("dtype: bf16 special values") {
  auto b = [](float x) { return f32_to_bf16_bits(x); };
  const float max_bf16 = bf16_bits_to_f32(0x7f7f);
  CHECK(max_bf16 == std::ldexp(255.0f, 127 - 7));
  CHECK(b(max_bf16) == 0x7f7f);
  const float mid_to_inf = std::ldexp(511.0f, 127 - 8);  // midpoint of max and 2^128
  CHECK(b(mid_to_inf) == 0x7f80);
  CHECK(b(std::nextafter(mid_to_inf, 0.0f)) == 0x7f7f);
  CHECK(b(-mid_to_inf) == 0xff80);
  CHECK(b(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(b(-std::numeric_limits<float>::max()) == 0xff80);
  CHECK(b(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(b(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(b(0.0f) == 0x0000);
  CHECK(b(-0.0f) == 0x8000);
  CHECK(b(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(b(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(b(std::ldexp(1.0f, -133)) == 0x0001);  // smallest bf16 subnormal
  CHECK(b(std::ldexp(1.0f, -134)) == 0x0000);  // tie -> 0
  CHECK(b(std::ldexp(3.0f, -134)) == 0x0002);  // tie between 1 and 2 -> 2
  CHECK(b(1.0f) == 0x3f80);
  CHECK(b(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  CHECK(b(1.0f + std::ldexp(3.0f, -8)) == 0x3f82);
  CHECK(b(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)) == 0x3f81);
  CHECK(std::signbit(bf16_bits_to_f32(0x8000)));
  CHECK(std::isinf(bf16_bits_to_f32(0x7f80)));
  CHECK(std::isnan(bf16_bits_to_f32(0x7f81)));
}

}  // TEST_SUITE

// ---- fp8 e4m3fn ------------------------------------------------------------------------------
// Independent description: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 15 with
// mantissa 7 is NaN, everything else is finite (largest 448); no Inf.
namespace {
double e4m3_decode(std::uint8_t b) {
  const bool neg = (b & 0x80u) != 0;
  const int e = (b >> 3) & 0xf, m = b & 0x7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(static_cast<double>(8 + m), e - 10);
  return neg ? -mag : mag;
}
/// Round to nearest even over the sorted table of the 127 non-negative finite codes; beyond 448
/// saturates, NaN gives the canonical NaN 0x7f (as the GPU's cvt does).
std::uint8_t e4m3_ref_round(float x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80u : 0u;
  if (std::isnan(x)) return 0x7fu;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return static_cast<std::uint8_t>(sign | 0x7eu);
  std::size_t i = 0;  // codes ascend with their value: values of i and i + 1 bracket a
  while (e4m3_decode(static_cast<std::uint8_t>(i + 1)) <= a) ++i;
  const double lo = a - e4m3_decode(static_cast<std::uint8_t>(i));
  const double hi = e4m3_decode(static_cast<std::uint8_t>(i + 1)) - a;
  const std::size_t pick = lo < hi ? i : (hi < lo ? i + 1 : ((i % 2 == 0) ? i : i + 1));
  return static_cast<std::uint8_t>(sign | pick);
}
}  // namespace

TEST_SUITE("core") {

TEST_CASE("dtype: fp8 e4m3 decodes all 256 codes exactly and round-trips every finite one") {
  static_assert(fp8_e4m3_bits_to_f32(0x38) == 1.0f && f32_to_fp8_e4m3_bits(1.0f) == 0x38);  // constexpr
  Failures f;
  for (std::uint32_t c = 0; c < 256; ++c) {
    const auto b = static_cast<std::uint8_t>(c);
    const float v = fp8_e4m3_bits_to_f32(b);
    const double want = e4m3_decode(b);
    if (std::isnan(want)) {
      if (!std::isnan(v) || std::signbit(v) != ((b & 0x80u) != 0)) f.add("code " + hex(c) + " must decode to NaN");
      if (f32_to_fp8_e4m3_bits(v) != 0x7f) f.add("NaN code " + hex(c) + " -> " + hex(f32_to_fp8_e4m3_bits(v)));
      continue;
    }
    if (static_cast<double>(v) != want || std::signbit(v) != ((b & 0x80u) != 0))
      f.add("code " + hex(c) + " decodes to " + std::to_string(v) + ", want " + std::to_string(want));
    if (f32_to_fp8_e4m3_bits(v) != b) f.add("code " + hex(c) + " round-trips to " + hex(f32_to_fp8_e4m3_bits(v)));
    if (to_float(from_float<fp8_e4m3_storage>(v)) != v) f.add("storage round trip of " + hex(c));
  }
  f.check("e4m3 decode / round trip");
  CHECK(fp8_e4m3_bits_to_f32(0x7e) == 448.0f);
  CHECK(fp8_e4m3_bits_to_f32(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(fp8_e4m3_bits_to_f32(0x08) == std::ldexp(1.0f, -6));  // smallest normal
}

TEST_CASE("dtype: fp8 e4m3 rounds every midpoint to even and its neighbours to the nearer code") {
  Failures f;
  for (std::uint32_t c = 0; c < 0x7e; ++c) {  // adjacent finite codes c, c + 1 (both signs)
    for (const float s : {1.0f, -1.0f}) {
      const float lo = fp8_e4m3_bits_to_f32(static_cast<std::uint8_t>(c));
      const float hi = fp8_e4m3_bits_to_f32(static_cast<std::uint8_t>(c + 1));
      const float mid = (lo + hi) / 2;  // exact in float (3 mantissa bits)
      const std::uint8_t sb = s < 0 ? 0x80u : 0u;
      const std::uint8_t even = static_cast<std::uint8_t>(sb | (c % 2 == 0 ? c : c + 1));
      const auto at = [&](float x) { return f32_to_fp8_e4m3_bits(s * x); };
      if (at(mid) != even) f.add("midpoint of " + hex(c) + "/" + hex(c + 1) + " -> " + hex(at(mid)));
      if (at(std::nextafter(mid, 0.0f)) != (sb | c)) f.add("just below midpoint of " + hex(c));
      if (at(std::nextafter(mid, 1000.0f)) != (sb | (c + 1))) f.add("just above midpoint of " + hex(c));
    }
  }
  f.check("e4m3 midpoints");
}

TEST_CASE("dtype: fp8 e4m3 saturates to 448 and keeps NaN and flushes tiny values to signed zero") {
  for (const float x : {448.0f, 449.0f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::infinity()}) {
    CHECK(f32_to_fp8_e4m3_bits(x) == 0x7e);
    CHECK(f32_to_fp8_e4m3_bits(-x) == 0xfe);
  }
  CHECK(f32_to_fp8_e4m3_bits(std::nextafter(448.0f, 0.0f)) == 0x7e);  // rounds up to 448, never to NaN
  CHECK(f32_to_fp8_e4m3_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7f);
  CHECK(f32_to_fp8_e4m3_bits(-std::numeric_limits<float>::quiet_NaN()) == 0x7f);
  CHECK(f32_to_fp8_e4m3_bits(from_fbits(0x7f800001u)) == 0x7f);  // signalling NaN
  CHECK(f32_to_fp8_e4m3_bits(std::ldexp(1.0f, -10)) == 0x00);    // half the smallest subnormal: tie to 0
  CHECK(f32_to_fp8_e4m3_bits(std::nextafter(std::ldexp(1.0f, -10), 1.0f)) == 0x01);
  CHECK(f32_to_fp8_e4m3_bits(-std::ldexp(1.0f, -12)) == 0x80);
  CHECK(f32_to_fp8_e4m3_bits(from_fbits(0x00000001u)) == 0x00);  // float subnormal
  CHECK(f32_to_fp8_e4m3_bits(std::ldexp(15.0f, -10)) == 0x08);   // 7.5 * 2^-9 ties to the even normal
  // scales: value = dequantize(quantize(x / s)) * s
  CHECK(dequantize(quantize<fp8_e4m3_storage>(3.0f, 0.5f), 0.5f) == 3.0f);
  CHECK(quantize<fp8_e4m3_storage>(300.0f, 0.5f).bits == 0x7e);  // 600 saturates
  CHECK(dequantize(quantize<bf16_storage>(3.0f, 0.5f), 0.5f) == 3.0f);  // unscaled dtypes ignore the scale
}

TEST_CASE("dtype: fp8 e4m3 rounding equals an independent rounding over a sweep of floats") {
  Failures f;
  // Every float whose magnitude is in [2^-12, 2^10), with a stride that hits each e4m3 interval
  // thousands of times, plus the stride's neighbours.
  for (std::uint32_t u = 0x39800000u; u < 0x44800000u; u += 997u)
    for (const std::uint32_t w : {u, u | 0x80000000u}) {
      const float x = from_fbits(w);
      if (f32_to_fp8_e4m3_bits(x) != e4m3_ref_round(x))
        f.add(hex(w) + " -> " + hex(f32_to_fp8_e4m3_bits(x)) + ", want " + hex(e4m3_ref_round(x)));
    }
  f.check("e4m3 sweep");
}

#if defined(TRIATTN_TEST_HAVE_CUDA_FP8)
TEST_CASE("dtype: fp8 e4m3 conversions equal CUDA's __nv_cvt_float_to_fp8 (SATFINITE) bit for bit") {
  Failures f;
  const auto cuda_bits = [](float x) { return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); };
  const auto check = [&](std::uint32_t w) {
    const float x = from_fbits(w);
    if (f32_to_fp8_e4m3_bits(x) != cuda_bits(x))
      f.add(hex(w) + " -> " + hex(f32_to_fp8_e4m3_bits(x)) + ", CUDA " + hex(cuda_bits(x)));
  };
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099u) check(static_cast<std::uint32_t>(u));  // all exponents
  for (std::uint32_t c = 0; c < 256; ++c) {  // every code's value and the midpoints' neighbourhoods
    const float v = fp8_e4m3_bits_to_f32(static_cast<std::uint8_t>(c));
    const float n = fp8_e4m3_bits_to_f32(static_cast<std::uint8_t>(c + 1));
    for (const float x : {v, (v + n) / 2})
      for (int k = -2; k <= 2; ++k) check(fbits(x) + static_cast<std::uint32_t>(k));
  }
  for (const float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) check(fbits(x));
  f.check("e4m3 vs CUDA");
  for (std::uint32_t c = 0; c < 256; ++c) {  // decoding: CUDA widens to half, exact for e4m3
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    const float want = f16_bits_to_f32(h.x);
    const float got = fp8_e4m3_bits_to_f32(static_cast<std::uint8_t>(c));
    CHECK_MESSAGE((std::isnan(want) ? std::isnan(got) : fbits(got) == fbits(want)), "code " << hex(c));
  }
}
#endif

}  // TEST_SUITE

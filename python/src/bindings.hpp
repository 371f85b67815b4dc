// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the extension's translation units: the registration functions and the checks
// every array argument goes through before anything is read or written.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>

namespace triattn::python {

namespace nb = nanobind;

/// Any array that speaks DLPack (numpy, torch, CuPy...), taken as is: no implicit copy, so
/// writes reach the caller's memory.
using Array = nb::ndarray<>;
using ConstArray = nb::ndarray<nb::ro>;

/// An argument of the wrong Python type (not an array, not a sequence of arrays): raised as
/// triattn.ArgumentTypeError, a LogicError that is also a TypeError.
class argument_type_error : public logic_error {
 public:
  using logic_error::logic_error;
};

void bind_params(nb::module_& m);
void bind_stats(nb::module_& m);
void bind_round(nb::module_& m);
void bind_paged(nb::module_& m);

/// Raises the reason `h` cannot be taken as the array named `what`: big-endian (or other
/// non-native byte order) and, when `writable`, read-only are LogicErrors; anything that is no
/// array at all is an argument_type_error.
[[noreturn]] void refuse_array(nb::handle h, const std::string& what, bool writable);

/// `h` as an array named `what` (A = Array, written in place, or ConstArray, only read); no copy.
template <class A>
A as_array(nb::handle h, const std::string& what) {
  A a;
  if (!nb::try_cast(h, a, false)) refuse_array(h, what, !std::is_same_v<A, ConstArray>);
  return a;
}

/// "float32", "int32", "bfloat16"... for messages.
std::string dtype_str(nb::dlpack::dtype t);

/// The cache element type of `a` (float32, float16, bfloat16).
/// @throws logic_error naming `what` for any other dtype.
template <class A>
DType cache_dtype(const A& a, const std::string& what) {
  const auto t = a.dtype();
  if (t.lanes == 1 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 32) return DType::kF32;
  if (t.lanes == 1 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return DType::kF16;
  if (t.lanes == 1 && t.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return DType::kBF16;
  throw logic_error("triattn: " + what + " has dtype " + dtype_str(t) + "; expected float32, float16 or bfloat16");
}

/// Refuses `a` unless it has dtype T, `ndim` dimensions and C-contiguous strides.
template <class T, class A>
void expect_contiguous(const A& a, std::size_t ndim, const std::string& what) {
  if (a.dtype() != nb::dtype<T>())
    throw logic_error("triattn: " + what + " has dtype " + dtype_str(a.dtype()) + "; expected " + dtype_str(nb::dtype<T>()));
  if (a.ndim() != ndim)
    throw logic_error("triattn: " + what + " has " + std::to_string(a.ndim()) + " dimensions; expected " +
                      std::to_string(ndim));
  if (a.size() == 0) return;  // nothing is addressed: any strides will do
  std::int64_t expect = 1;
  for (std::size_t i = ndim; i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw logic_error("triattn: " + what + " is not C-contiguous (stride of dimension " + std::to_string(i) + " is " +
                        std::to_string(a.stride(i)) + " elements, expected " + std::to_string(expect) + ")");
    expect *= static_cast<std::int64_t>(a.shape(i));
  }
}

/// Refuses `a` unless it lives in host memory (the CPU path).
template <class A>
void expect_host(const A& a, const std::string& what) {
  if (a.device_type() != nb::device::cpu::value)
    throw logic_error("triattn: " + what + " is not in host memory (DLPack device type " + std::to_string(a.device_type()) +
                      "); this call runs on the CPU");
}

}  // namespace triattn::python

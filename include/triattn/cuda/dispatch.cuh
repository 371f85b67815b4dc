// SPDX-License-Identifier: Apache-2.0
// Run-time value -> compile-time constant dispatch, one function per axis. The supported list is
// declared once; an unsupported value throws triattn::unsupported naming the compiled list.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include <triattn/core/error.hpp>

namespace triattn::cuda {

/// Head dims compiled into the kernels.
using supported_head_dims = std::integer_sequence<int, 64, 128>;

namespace detail {
template <int First, int... Rest>
inline constexpr int first_of = First;

template <class F, int... Vs>
decltype(auto) dispatch_over(int value, const char* axis, F&& f, std::integer_sequence<int, Vs...>) {
  using R = decltype(f(std::integral_constant<int, first_of<Vs...>>{}));
  auto fail = [&] {
    std::string list;
    ((list += (list.empty() ? "" : ",") + std::to_string(Vs)), ...);
    throw unsupported(std::string("triattn: ") + axis + "=" + std::to_string(value) + " not compiled in (supported: " + list + ")");
  };
  if constexpr (std::is_void_v<R>) {
    const bool hit = ((value == Vs ? (f(std::integral_constant<int, Vs>{}), true) : false) || ...);
    if (!hit) fail();
  } else {
    R result{};
    const bool hit = ((value == Vs ? (result = f(std::integral_constant<int, Vs>{}), true) : false) || ...);
    if (!hit) fail();
    return result;
  }
}
}  // namespace detail

/// Calls f(std::integral_constant<int, head_dim>{}) for a compiled head_dim, else throws unsupported.
template <class F>
decltype(auto) dispatch_head_dim(int head_dim, F&& f) {
  return detail::dispatch_over(head_dim, "head_dim", std::forward<F>(f), supported_head_dims{});
}

}  // namespace triattn::cuda

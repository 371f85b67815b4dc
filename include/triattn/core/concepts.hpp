// SPDX-License-Identifier: Apache-2.0
// Policy roles of KvCache<Policy...> and the concepts each role must satisfy. A policy declares
// its role with `using policy_role = allocator_role;` (etc.); KvCache picks each role from its
// order-free parameter pack and falls back to a default.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

namespace triattn {

struct allocator_role {};
struct compactor_role {};
struct scorer_role {};
struct selector_role {};

/// Where an allocator's memory lives; compactors and scorers must match it.
enum class MemorySpace : int { kHost = 0, kDevice = 1 };

template <class P, class Role>
concept plays_role = std::is_same_v<typename std::remove_cvref_t<P>::policy_role, Role>;

/// Owns the cache memory and hands out block ids (all-or-nothing), with reference counts.
template <class A>
concept BlockAllocator = plays_role<A, allocator_role> &&
    requires(A& a, const A& ca, std::span<std::int32_t> out, std::int32_t b) {
      { A::memory_space } -> std::convertible_to<MemorySpace>;
      { a.allocate(out) } -> std::same_as<bool>;
      { a.retain(b) };
      { a.release(b) } -> std::same_as<bool>;
      { ca.num_free() } -> std::convertible_to<std::size_t>;
      { ca.capacity() } -> std::convertible_to<std::size_t>;
      { ca.ref_count(b) } -> std::convertible_to<int>;
      { ca.bytes_resident() } -> std::convertible_to<std::size_t>;
      { ca.data() } -> std::same_as<void*>;
      { ca.range_stride_bytes() } -> std::convertible_to<std::int64_t>;
    };

namespace detail {
template <class Role, class... Ps>
inline constexpr std::size_t count_role = (std::size_t{0} + ... + (plays_role<Ps, Role> ? 1u : 0u));

template <class Role, class Default, class... Ps>
struct pick_role {
  using type = Default;
};
template <class Role, class Default, class P, class... Ps>
struct pick_role<Role, Default, P, Ps...> {
  using type = std::conditional_t<plays_role<P, Role>, P, typename pick_role<Role, Default, Ps...>::type>;
};
/// The policy in Ps playing Role, or Default when none does.
template <class Role, class Default, class... Ps>
using pick_role_t = typename pick_role<Role, Default, Ps...>::type;
}  // namespace detail

}  // namespace triattn

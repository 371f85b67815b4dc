// SPDX-License-Identifier: Apache-2.0
// Policy roles of KvCache<Policy...> and the concept each role must satisfy (BlockAllocator,
// Compactor, Scorer, Selector). A policy declares its role with `using policy_role =
// allocator_role;` (etc.); KvCache picks each role from its order-free parameter pack, falls back
// to a default, and checks each role's concept and memory space.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>

namespace triattn {

struct allocator_role {};
struct compactor_role {};
struct scorer_role {};
struct selector_role {};

/// Where an allocator's memory lives; compactors and scorers must match it.
enum class MemorySpace : int { kHost = 0, kDevice = 1 };

template <class P, class Role>
concept plays_role = std::is_same_v<typename std::remove_cvref_t<P>::policy_role, Role>;

/// P states the memory it works on: `static constexpr MemorySpace memory_space`.
template <class P>
concept declares_memory_space = requires {
  { std::remove_cvref_t<P>::memory_space } -> std::convertible_to<MemorySpace>;
};

namespace detail {
/// False for a policy that declares `static constexpr bool reads_cache = false` (it never
/// dereferences the cache's memory, so either memory space suits it).
template <class P>
inline constexpr bool reads_cache_v = true;
template <class P>
  requires requires { { std::remove_cvref_t<P>::reads_cache } -> std::convertible_to<bool>; }
inline constexpr bool reads_cache_v<P> = std::remove_cvref_t<P>::reads_cache;
}  // namespace detail

/// P can work on a cache whose memory lives in `Space`: it declares that space, or it never
/// reads cache memory. Selectors see only host scores and have no memory space.
template <class P, MemorySpace Space>
concept serves_memory_space =
    !detail::reads_cache_v<P> || (declares_memory_space<P> && std::remove_cvref_t<P>::memory_space == Space);

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

/// Scores every cached key of a sequence: score(view, seq, length, t0, out) writes
/// [num_layers, num_q_heads, length] floats, for a view of each storage type KvCache may hold.
template <class S>
concept Scorer = plays_role<S, scorer_role> && declares_memory_space<S> &&
    requires(S& s, std::int32_t seq, int length, std::int64_t t0, std::span<float> out,
             const KvCacheView<float, std::int32_t>& v32, const KvCacheView<f16_storage, std::int32_t>& v16,
             const KvCacheView<bf16_storage, std::int32_t>& vbf) {
      s.score(v32, seq, length, t0, out);
      s.score(v16, seq, length, t0, out);
      s.score(vbf, seq, length, t0, out);
    };

/// Decides when a sequence is compressed and which slots a round keeps, from host scores
/// [num_layers, num_q_heads, length].
template <class S>
concept Selector = plays_role<S, selector_role> &&
    requires(S& s, const S& cs, std::span<const float> scores, const ModelGeometry& g, int length, bool decoding) {
      { cs.should_compress(length, length, decoding) } -> std::convertible_to<bool>;
      { s.select(scores, g, length, length) } -> std::convertible_to<KeepPlan>;
    };

/// Moves each (layer, KV head)'s kept slots of a sequence to its front: apply(view, seq, plan),
/// for a view of each storage type KvCache may hold.
template <class C>
concept Compactor = plays_role<C, compactor_role> && declares_memory_space<C> &&
    requires(C& c, std::int32_t seq, const KeepPlan& plan, const KvCacheView<float, std::int32_t>& v32,
             const KvCacheView<f16_storage, std::int32_t>& v16, const KvCacheView<bf16_storage, std::int32_t>& vbf) {
      c.apply(v32, seq, plan);
      c.apply(v16, seq, plan);
      c.apply(vbf, seq, plan);
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

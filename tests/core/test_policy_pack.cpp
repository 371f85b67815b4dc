// SPDX-License-Identifier: Apache-2.0
// KvCache<Policy...>: defaults, order-free policy packs, configured policy objects passed to the
// constructor (in any order, by value or by lvalue, which must be copied, not moved from),
// policies built from the CacheConfig when they can be, and the scorer / selector roles driving
// needs_compression / compress / compress_if_needed. Misuse (a policy that misses its role's
// concept or memory space) is checked by test_policy_concepts.cpp and tests/compile_fail.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/ref/compact.hpp>

using namespace triattn;

namespace {

/// Host compactor that counts its calls and carries an id.
struct CountingCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  int id = 0;
  int* calls = nullptr;
  std::vector<int> payload;  // heap state: shows whether a passed lvalue was copied or moved from

  template <class T, class Id>
  void apply(const KvCacheView<T, Id>& view, int seq, const KeepPlan& plan) const {
    if (calls != nullptr) ++*calls;
    ref::compact(view, seq, plan);
  }
};

/// Scorer: slot t of every (layer, q head) scores 1 when t % period == 0, else 0. Records its calls.
struct PeriodScorer {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  int period = 2;
  struct Call {
    int seq, len;
    std::int64_t logical;
    std::size_t out_size;
  };
  std::vector<Call>* calls = nullptr;

  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int len, std::int64_t logical, std::span<float> out) const {
    if (calls != nullptr) calls->push_back(Call{seq, len, logical, out.size()});
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = (static_cast<int>(i % static_cast<std::size_t>(len)) % period == 0) ? 1.0f : 0.0f;
  }
};

/// Selector: compress when decoding and length >= trigger; keep the slots whose score (first q
/// head of the group) is positive.
struct PositiveSelector {
  using policy_role = selector_role;
  int trigger = 8;

  bool should_compress(int len, int prompt_len, bool decoding) const { return decoding && len >= trigger; }
  KeepPlan select(std::span<const float> scores, const ModelGeometry& g, int len, int prompt_len) const {
    std::vector<std::int32_t> keep_slots;
    for (int t = 0; t < len; ++t)
      if (scores[static_cast<std::size_t>(t)] > 0.5f) keep_slots.push_back(t);
    KeepPlan p(g.num_layers, g.num_kv_heads, static_cast<int>(keep_slots.size()));
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) std::copy(keep_slots.begin(), keep_slots.end(), p.row(l, h));
    return p;
  }
};

/// A scorer that can be built from the cache's configuration.
struct ConfigAwareScorer {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  int block_size_seen = -1;
  ConfigAwareScorer() = default;
  explicit ConfigAwareScorer(const CacheConfig& c) : block_size_seen(c.block_size) {}
  template <class T, class Id>
  void score(const KvCacheView<T, Id>&, int, int, std::int64_t, std::span<float> out) const {
    for (float& x : out) x = 0.0f;
  }
};

/// StaticAllocator<HostBackend> that counts allocate() calls and carries a tag.
struct CountingAllocator : StaticAllocator<HostBackend> {
  using policy_role = allocator_role;
  int tag = 0;
  int allocations = 0;
  explicit CountingAllocator(const CacheConfig& c, int t = 0) : StaticAllocator<HostBackend>(c), tag(t) {}
  [[nodiscard]] bool allocate(std::span<std::int32_t> out) {
    ++allocations;
    return StaticAllocator<HostBackend>::allocate(out);
  }
};

CacheConfig config() {
  CacheConfig c;
  c.model = ModelGeometry{2, 4, 2, 4};
  c.block_size = 4;
  c.num_blocks = 16;
  c.max_seqs = 4;
  c.dtype = DType::kF32;
  return c;
}

/// Appends n tokens whose K element 0 of every (layer, head) is the token's logical index.
template <class Cache>
void append_indexed(Cache& c, SeqId s, int n, Phase ph = Phase::kDecode) {
  const auto& g = c.config().model;
  std::vector<float> k(static_cast<std::size_t>(g.num_layers) * n * g.num_kv_heads * g.head_dim), v(k.size());
  const auto base = c.logical_position(s);
  for (std::size_t i = 0; i < k.size(); ++i) {
    const std::size_t t = (i / static_cast<std::size_t>(g.num_kv_heads * g.head_dim)) % static_cast<std::size_t>(n);
    k[i] = static_cast<float>(base + static_cast<std::int64_t>(t));
    v[i] = -k[i];
  }
  REQUIRE(c.template append<float>(s, std::span<const float>(k), std::span<const float>(v), n, ph).ok());
}

template <class Cache>
std::vector<float> first_key_elems(const Cache& c, SeqId s, int layer, int head) {
  const auto view = c.template view<float>();
  std::vector<float> out;
  for (int slot = 0; slot < c.physical_length(s); ++slot) out.push_back(*view.token(layer, KvKind::kKey, s, slot, head));
  return out;
}

template <class C>
concept has_compress = requires(C& c) { c.compress(SeqId{0}); };
template <class C>
concept has_needs_compression = requires(C& c) { c.needs_compression(SeqId{0}); };

KeepPlan moving_plan() {  // keep slots 1 and 3 of 4
  KeepPlan p(2, 2, 2);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      p.row(l, h)[0] = 1;
      p.row(l, h)[1] = 3;
    }
  return p;
}

}  // namespace

TEST_SUITE("core") {

TEST_CASE("policy pack: KvCache<> defaults") {
  using C = KvCache<>;
  CHECK(std::is_same_v<C::allocator_type, StaticAllocator<HostBackend>>);
  CHECK(std::is_same_v<C::compactor_type, HostCompactor>);
  CHECK(std::is_same_v<C::scorer_type, NoScorer>);
  CHECK(std::is_same_v<C::selector_type, NoSelector>);
  CHECK(std::is_same_v<C::index_type, std::int32_t>);
  CHECK(C::memory_space == MemorySpace::kHost);
  // The view type depends on the element type only, never on the policies.
  CHECK(std::is_same_v<decltype(std::declval<const C&>().view<float>()), KvCacheView<float, std::int32_t>>);
  CHECK(std::is_same_v<decltype(std::declval<const KvCache<CountingCompactor, PeriodScorer>&>().view<float>()),
                       KvCacheView<float, std::int32_t>>);
  // Without a scorer and a selector there is no compress().
  CHECK_FALSE(has_compress<C>);
  CHECK_FALSE(has_needs_compression<C>);
  CHECK_FALSE(has_compress<KvCache<PeriodScorer>>);
  CHECK_FALSE(has_compress<KvCache<PositiveSelector>>);
  CHECK(has_compress<KvCache<PeriodScorer, PositiveSelector>>);
  CHECK(has_needs_compression<KvCache<PeriodScorer, PositiveSelector>>);
  // A default cache works end to end.
  C c(config());
  const SeqId s = c.add_sequence();
  append_indexed(c, s, 4, Phase::kPrefill);
  c.apply_keep_plan(s, moving_plan());
  CHECK(first_key_elems(c, s, 1, 1) == std::vector<float>{1, 3});
}

TEST_CASE("policy pack: roles are picked whatever the order") {
  using A = KvCache<CountingCompactor, PeriodScorer, PositiveSelector>;
  using B = KvCache<PositiveSelector, PeriodScorer, CountingCompactor>;
  using Cc = KvCache<PeriodScorer, StaticAllocator<HostBackend>, PositiveSelector, CountingCompactor>;
  using Dd = KvCache<CountingAllocator, PeriodScorer>;
  CHECK(std::is_same_v<A::compactor_type, CountingCompactor>);
  CHECK(std::is_same_v<A::scorer_type, PeriodScorer>);
  CHECK(std::is_same_v<A::selector_type, PositiveSelector>);
  CHECK(std::is_same_v<A::allocator_type, StaticAllocator<HostBackend>>);
  CHECK(std::is_same_v<B::compactor_type, CountingCompactor>);
  CHECK(std::is_same_v<B::scorer_type, PeriodScorer>);
  CHECK(std::is_same_v<B::selector_type, PositiveSelector>);
  CHECK(std::is_same_v<B::allocator_type, StaticAllocator<HostBackend>>);
  CHECK(std::is_same_v<Cc::compactor_type, CountingCompactor>);
  CHECK(std::is_same_v<Cc::scorer_type, PeriodScorer>);
  CHECK(std::is_same_v<Cc::selector_type, PositiveSelector>);
  CHECK(std::is_same_v<Cc::allocator_type, StaticAllocator<HostBackend>>);
  CHECK(std::is_same_v<Dd::allocator_type, CountingAllocator>);
  CHECK(std::is_same_v<Dd::compactor_type, HostCompactor>);
  CHECK(std::is_same_v<Dd::scorer_type, PeriodScorer>);
  CHECK(std::is_same_v<Dd::selector_type, NoSelector>);
  // Role detection itself.
  CHECK(plays_role<CountingCompactor, compactor_role>);
  CHECK_FALSE(plays_role<CountingCompactor, scorer_role>);
  CHECK(plays_role<const PeriodScorer&, scorer_role>);
  CHECK(detail::count_role<scorer_role, CountingCompactor, PeriodScorer, PositiveSelector> == 1);
  CHECK(detail::count_role<allocator_role, CountingCompactor, PeriodScorer> == 0);
  CHECK(std::is_same_v<detail::pick_role_t<scorer_role, NoScorer, CountingCompactor>, NoScorer>);
  CHECK(BlockAllocator<CountingAllocator>);
}

TEST_CASE("policy pack: configured policy objects passed to the constructor are the ones used") {
  int calls = 0;
  {
    KvCache<CountingCompactor> c(config(), CountingCompactor{42, &calls, {}});
    CHECK(c.compactor().id == 42);
    const SeqId s = c.add_sequence();
    append_indexed(c, s, 4, Phase::kPrefill);
    c.apply_keep_plan(s, moving_plan());
    CHECK(calls == 1);
    CHECK(first_key_elems(c, s, 0, 1) == std::vector<float>{1, 3});
    // A plan that moves nothing does not call the compactor at all.
    KeepPlan prefix(2, 2, 1);
    c.apply_keep_plan(s, prefix);
    CHECK(calls == 1);
    CHECK(c.physical_length(s) == 1);
  }
  {  // Any argument order; roles not passed are defaulted.
    std::vector<PeriodScorer::Call> scored;
    KvCache<PeriodScorer, CountingCompactor, PositiveSelector> c(config(), PositiveSelector{6},
                                                                 CountingCompactor{7, &calls, {}},
                                                                 PeriodScorer{3, &scored});
    CHECK(c.selector().trigger == 6);
    CHECK(c.compactor().id == 7);
    CHECK(c.scorer().period == 3);
    KvCache<PeriodScorer, CountingCompactor, PositiveSelector> d(config(), PeriodScorer{5, nullptr});
    CHECK(d.scorer().period == 5);
    CHECK(d.selector().trigger == 8);  // default-constructed
    CHECK(d.compactor().id == 0);
  }
  {  // Lvalues are copied, not moved from; const lvalues work too.
    CountingCompactor comp{9, &calls, {1, 2, 3}};
    const PositiveSelector sel{11};
    KvCache<CountingCompactor, PositiveSelector, PeriodScorer> c(config(), comp, sel);
    CHECK(c.compactor().id == 9);
    CHECK(c.compactor().payload == std::vector<int>{1, 2, 3});
    CHECK(comp.payload == std::vector<int>{1, 2, 3});  // the caller's object is intact
    CHECK(c.selector().trigger == 11);
    // Rvalues are moved.
    CountingCompactor moved{10, &calls, {4, 5}};
    KvCache<CountingCompactor> e(config(), std::move(moved));
    CHECK(e.compactor().payload == std::vector<int>{4, 5});
  }
  {  // A configured allocator, and one built from the config.
    KvCache<CountingAllocator> c(config(), CountingAllocator(config(), 77));
    CHECK(c.allocator().tag == 77);
    const SeqId s = c.add_sequence();
    append_indexed(c, s, 5);
    CHECK(c.allocator().allocations == 1);
    append_indexed(c, s, 3);  // fits the second block: no allocation
    CHECK(c.allocator().allocations == 1);
    append_indexed(c, s, 1);
    CHECK(c.allocator().allocations == 2);
    CHECK(c.memory().blocks_used == 3);
    KvCache<CountingAllocator> d(config());
    CHECK(d.allocator().tag == 0);
    CHECK(d.allocator().capacity() == 16);
  }
  {  // A policy constructible from CacheConfig is built from it when not passed.
    KvCache<ConfigAwareScorer> c(config());
    CHECK(c.scorer().block_size_seen == 4);
    KvCache<ConfigAwareScorer> d(config(), ConfigAwareScorer{});
    CHECK(d.scorer().block_size_seen == -1);
  }
  // A bad config is reported before any policy is built.
  CacheConfig bad = config();
  bad.num_blocks = 0;
  CHECK_THROWS_AS((void)KvCache<CountingAllocator>(bad), triattn::logic_error);
}

TEST_CASE("policy pack: scorer and selector drive needs_compression / compress / compress_if_needed") {
  int calls = 0;
  std::vector<PeriodScorer::Call> scored;
  KvCache<PositiveSelector, CountingCompactor, PeriodScorer> c(config(), PeriodScorer{2, &scored},
                                                                CountingCompactor{1, &calls, {}}, PositiveSelector{8});
  const SeqId a = c.add_sequence(), b = c.add_sequence();
  append_indexed(c, a, 8, Phase::kPrefill);
  CHECK_FALSE(c.needs_compression(a));  // prompt only, no decode step yet
  append_indexed(c, a, 2);
  append_indexed(c, b, 3);
  CHECK(c.needs_compression(a));
  CHECK_FALSE(c.needs_compression(b));
  const CompressionReport r = c.compress(a);
  CHECK(r.seq == a);
  CHECK(r.length_before == 10);
  CHECK(r.length_after == 5);
  CHECK(r.blocks_freed == 1);  // 3 blocks -> 2
  REQUIRE(scored.size() == 1);
  CHECK(scored[0].seq == a);
  CHECK(scored[0].len == 10);
  CHECK(scored[0].logical == 10);
  CHECK(scored[0].out_size == 2u * 4u * 10u);  // [layers, q heads, len]
  CHECK(calls == 1);
  CHECK(first_key_elems(c, a, 1, 0) == std::vector<float>{0, 2, 4, 6, 8});
  CHECK(c.logical_position(a) == 10);
  CHECK(c.physical_length(a) == 5);

  append_indexed(c, a, 3);  // 8 cached: triggers again
  append_indexed(c, b, 2);  // 5 cached: does not
  const std::vector<SeqId> both = {a, b};
  const auto done = c.compress_if_needed(both);
  REQUIRE(done.size() == 1);
  CHECK(done[0].seq == a);
  CHECK(done[0].length_before == 8);
  CHECK(done[0].length_after == 4);
  CHECK(first_key_elems(c, a, 0, 1) == std::vector<float>{0, 4, 8, 11});
  CHECK(c.physical_length(b) == 5);
  CHECK_THROWS_AS(c.compress(3), triattn::logic_error);
  CHECK_THROWS_AS((void)c.needs_compression(-1), triattn::logic_error);
}

TEST_CASE("policy pack: the trigger sees decoding only after a decode token even after compaction shortened the prompt") {
  KvCache<PeriodScorer, PositiveSelector> c(config(), PositiveSelector{2});
  const SeqId s = c.add_sequence();
  append_indexed(c, s, 4, Phase::kPrefill);
  CHECK_FALSE(c.needs_compression(s));
  c.apply_keep_plan(s, moving_plan());  // moves slot 1 -> 0: no prompt slot stays in place
  CHECK(c.prompt_length(s) == 0);
  CHECK(c.physical_length(s) == 2);
  CHECK_FALSE(c.needs_compression(s));  // still no decode token
  append_indexed(c, s, 1);
  CHECK(c.needs_compression(s));
  // A fork of the pure prompt is not decoding; a fork past the prompt is.
  const SeqId p = c.add_sequence();
  append_indexed(c, p, 8, Phase::kPrefill);
  const SeqId f1 = c.fork_prefix(p, 4);
  CHECK_FALSE(c.needs_compression(f1));
  append_indexed(c, p, 4);
  const SeqId f2 = c.fork_prefix(p, 12);
  CHECK(c.prompt_length(f2) == 8);
  CHECK(c.needs_compression(f2));
}

}  // TEST_SUITE

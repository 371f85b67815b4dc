// SPDX-License-Identifier: Apache-2.0
// The role concepts (BlockAllocator, Compactor, Scorer, Selector) and the memory-space check:
// every policy of the library satisfies its role's concept, and policies that miss a member, take
// only some storage types, return the wrong type or declare no memory space are rejected.
// tests/compile_fail checks that KvCache itself refuses such policies with its static_assert.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/key_norm_scorer.hpp>
#include <triattn/core/policy/random_scorer.hpp>
#include <triattn/core/policy/recency_scorer.hpp>
#include <triattn/core/policy/snapkv_scorer.hpp>
#include <triattn/core/policy/tensor_parallel_selector.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/tp/collective.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>

#include "common/vmm/fake_driver.hpp"

using namespace triattn;

namespace {

struct GoodScorer {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  template <class T, class Id>
  void score(const KvCacheView<T, Id>&, int, int, std::int64_t, std::span<float>) {}
};
struct ScorerWithoutScore {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
};
struct ScorerFloatOnly {  // the cache may hold f16/bf16 too
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  void score(const KvCacheView<float, std::int32_t>&, int, int, std::int64_t, std::span<float>) {}
};
struct ScorerWithoutSpace {
  using policy_role = scorer_role;
  template <class T, class Id>
  void score(const KvCacheView<T, Id>&, int, int, std::int64_t, std::span<float>) {}
};
struct DeviceScorer : GoodScorer {
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;
};
struct DeviceScorerReadingNothing : DeviceScorer {
  static constexpr bool reads_cache = false;
};

struct GoodSelector {
  using policy_role = selector_role;
  bool should_compress(int, int, bool) const { return false; }
  KeepPlan select(std::span<const float>, const ModelGeometry&, int, int) { return {}; }
};
struct SelectorWithoutSelect {
  using policy_role = selector_role;
  bool should_compress(int, int, bool) const { return false; }
};
struct SelectorReturningScores {
  using policy_role = selector_role;
  bool should_compress(int, int, bool) const { return false; }
  std::span<const float> select(std::span<const float> s, const ModelGeometry&, int, int) { return s; }
};
struct SelectorMutableTrigger {  // KvCache::needs_compression is const
  using policy_role = selector_role;
  bool should_compress(int, int, bool) { return false; }
  KeepPlan select(std::span<const float>, const ModelGeometry&, int, int) { return {}; }
};

struct CompactorWithoutApply {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
};
struct CompactorWithoutSpace {
  using policy_role = compactor_role;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) {}
};
struct DeviceCompactorStandIn {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) {}
};

struct AllocatorWithoutRelease {
  using policy_role = allocator_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  bool allocate(std::span<std::int32_t>) { return false; }
  void retain(std::int32_t) {}
  std::size_t num_free() const { return 0; }
  std::size_t capacity() const { return 0; }
  int ref_count(std::int32_t) const { return 0; }
  std::size_t bytes_resident() const { return 0; }
  void* data() const { return nullptr; }
  std::int64_t range_stride_bytes() const { return 0; }
};

}  // namespace

TEST_SUITE("core") {

TEST_CASE("policy concepts: the library's host policies satisfy their role") {
  CHECK(BlockAllocator<StaticAllocator<HostBackend>>);
  CHECK(BlockAllocator<vmm::VmmAllocatorCore<vmm::FakeDriver>>);
  CHECK(Compactor<HostCompactor>);
  CHECK(Scorer<TriAttentionScorer>);
  CHECK(Scorer<KeyNormScorer>);
  CHECK(Scorer<RandomScorer>);
  CHECK(Scorer<RecencyScorer>);
  CHECK(Scorer<SnapKvScorer>);
  CHECK(Selector<TopKSelector>);
  CHECK(Selector<TensorParallelTopKSelector<tp::SingleRankCollective>>);
  // The "none" defaults are not scorers or selectors: KvCache then has no compress().
  CHECK_FALSE(Scorer<NoScorer>);
  CHECK_FALSE(Selector<NoSelector>);
}

TEST_CASE("policy concepts: policies missing a member or a storage type are rejected") {
  CHECK(Scorer<GoodScorer>);
  CHECK_FALSE(Scorer<ScorerWithoutScore>);
  CHECK_FALSE(Scorer<ScorerFloatOnly>);
  CHECK_FALSE(Scorer<ScorerWithoutSpace>);
  CHECK_FALSE(Scorer<GoodSelector>);  // wrong role
  CHECK(Selector<GoodSelector>);
  CHECK_FALSE(Selector<SelectorWithoutSelect>);
  CHECK_FALSE(Selector<SelectorReturningScores>);
  CHECK_FALSE(Selector<SelectorMutableTrigger>);
  CHECK(Compactor<DeviceCompactorStandIn>);
  CHECK_FALSE(Compactor<CompactorWithoutApply>);
  CHECK_FALSE(Compactor<CompactorWithoutSpace>);
  CHECK_FALSE(BlockAllocator<AllocatorWithoutRelease>);
}

TEST_CASE("policy concepts: memory spaces") {
  CHECK(serves_memory_space<HostCompactor, MemorySpace::kHost>);
  CHECK_FALSE(serves_memory_space<HostCompactor, MemorySpace::kDevice>);
  CHECK_FALSE(serves_memory_space<DeviceCompactorStandIn, MemorySpace::kHost>);
  CHECK(serves_memory_space<TriAttentionScorer, MemorySpace::kHost>);
  CHECK_FALSE(serves_memory_space<TriAttentionScorer, MemorySpace::kDevice>);
  CHECK_FALSE(serves_memory_space<DeviceScorer, MemorySpace::kHost>);
  CHECK_FALSE(serves_memory_space<ScorerWithoutSpace, MemorySpace::kHost>);
  // Scorers that never read cache memory serve either space.
  CHECK(serves_memory_space<DeviceScorerReadingNothing, MemorySpace::kHost>);
  CHECK(serves_memory_space<RecencyScorer, MemorySpace::kDevice>);
  CHECK(serves_memory_space<RandomScorer, MemorySpace::kDevice>);
  CHECK_FALSE(serves_memory_space<KeyNormScorer, MemorySpace::kDevice>);
  // A host cache accepts such a scorer.
  CHECK(KvCache<DeviceScorerReadingNothing, GoodSelector>::memory_space == MemorySpace::kHost);
}

}  // TEST_SUITE

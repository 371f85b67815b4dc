// SPDX-License-Identifier: Apache-2.0
// Compile-fail cases of KvCache's policy checks: each TRIATTN_CASE must stop the compiler at
// KvCache's static_assert for its role (tests/compile_fail/CMakeLists.txt matches the message);
// TRIATTN_CASE_OK must compile.
#include <cstdint>
#include <span>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>

using namespace triattn;

struct ScorerWithoutScore {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
};
struct DeviceScorer {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;
  template <class T, class Id>
  void score(const KvCacheView<T, Id>&, int, int, std::int64_t, std::span<float>) {}
};
struct HostScorer : DeviceScorer {
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
};
struct SelectorWithoutSelect {
  using policy_role = selector_role;
  bool should_compress(int, int, bool) const { return false; }
};
struct CompactorWithoutApply {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
};
struct DeviceCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) {}
};

#if defined(TRIATTN_CASE_OK)
using Cache = KvCache<HostScorer, TopKSelector>;
#elif defined(TRIATTN_CASE_SCORER_WITHOUT_SCORE)
using Cache = KvCache<ScorerWithoutScore, TopKSelector>;
#elif defined(TRIATTN_CASE_SCORER_SPACE)
using Cache = KvCache<DeviceScorer, TopKSelector>;
#elif defined(TRIATTN_CASE_SELECTOR_WITHOUT_SELECT)
using Cache = KvCache<HostScorer, SelectorWithoutSelect>;
#elif defined(TRIATTN_CASE_COMPACTOR_WITHOUT_APPLY)
using Cache = KvCache<CompactorWithoutApply>;
#elif defined(TRIATTN_CASE_COMPACTOR_SPACE)
using Cache = KvCache<DeviceCompactor>;
#else
#error "define one TRIATTN_CASE_*"
#endif

int main() { return sizeof(Cache) > 0 ? 0 : 1; }

// SPDX-License-Identifier: Apache-2.0
// Prefix caching with compression, memory accounting on the CPU (no K/V is computed): 64 requests
// share a 4,096-token prefix, each adds 256 tokens of its own and generates 4,096, Qwen3-8B KV
// shape (36 layers, 8 KV heads, d 128, bf16, 16-token blocks = 144 KiB per token), budget 2,048,
// divide_length 128. The real KvCache, PrefixCachingAllocator and VmmAllocatorCore bookkeeping run
// over the fake driver (address space only): request 0 prefills and publishes its prompt, then the
// other 63 arrive and are admitted over the cache; all decode together, a round runs when a
// sequence's trigger fires, empty slabs are trimmed after every step.
//
//   BM_PrefixWorkload/<sharing>/<compress>/<prompt_mode>
//     sharing 0|1: prefix cache off | on; compress 0|1; prompt_mode: PromptMode (1 = pinned on top:
//     the prompt is kept and the budget counts decode tokens; 2 = compete: no sharing only)
// Counters: peak_resident_GiB (the VMM ledger's mapped bytes, the peak over all steps),
// peak_used_blocks_GiB (blocks in use incl. cached), prefill_tokens (prompt tokens computed),
// hit_tokens, rounds. Rounds use prefix keep plans of the count the selector would keep (the
// memory behaviour of any plan; no scoring or data movement, so no kernel is needed).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/ref/select.hpp>
#include "common/vmm/fake_driver.hpp"
#include <triattn/core/vmm/vmm_allocator_core.hpp>

namespace {

using namespace triattn;

constexpr int kRequests = 64, kShared = 4096, kOwn = 256, kGenerated = 4096, kBudget = 2048, kDivide = 128;

/// Prefix plans never move data; any other plan is a bug here.
struct PrefixOnlyCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) const {
    throw unsupported("bench_ref_prefix_workload: a plan moved data");
  }
};
/// Writes no scores (the selector below needs only the counts).
struct NoScores {
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  template <class T, class Id>
  void score(const KvCacheView<T, Id>&, int, int, std::int64_t, std::span<float>) const {}
};
/// TopKSelector's trigger and keep count (ref::keep_counts, shared prefix protected), as a
/// prefix plan.
struct CountSelector {
  using policy_role = selector_role;
  SelectionParams p;
  bool should_compress(int len, int prompt_len, bool decode) const { return TopKSelector(p).should_compress(len, prompt_len, decode); }
  KeepPlan select(std::span<const float>, const ModelGeometry& g, int len, int prompt_len, int protected_prefix = 0) const {
    const ref::KeepCounts kc = ref::keep_counts(len, prompt_len, p, protected_prefix);
    KeepPlan plan(g.num_layers, g.num_kv_heads, kc.keep);
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) std::iota(plan.row(l, h), plan.row(l, h) + kc.keep, 0);
    return plan;
  }
};

using Alloc = PrefixCachingAllocator<vmm::VmmAllocatorCore<vmm::FakeDriver>>;
using Cache = KvCache<Alloc, PrefixOnlyCompactor, NoScores, CountSelector>;

void BM_PrefixWorkload(benchmark::State& state) {
  const bool sharing = state.range(0) != 0, compress = state.range(1) != 0;
  const auto mode = static_cast<PromptMode>(state.range(2));
  CacheConfig cfg;
  cfg.model = {36, 32, 8, 128};
  cfg.block_size = 16;
  cfg.dtype = DType::kBF16;
  cfg.max_seqs = kRequests;
  cfg.max_blocks_per_seq = (kShared + kOwn + kGenerated) / 16 + 1;
  cfg.num_blocks = kRequests * cfg.max_blocks_per_seq;  // VA only: the fake maps nothing real
  SelectionParams sel;
  sel.budget = compress ? kBudget : 1 << 30;
  sel.divide_length = kDivide;
  sel.prompt = mode;
  for (auto _ : state) {
    Cache cache(cfg, Alloc(cfg, vmm::VmmOptions{}, vmm::FakeDriver{}), CountSelector{sel});
    auto& mem = cache.allocator();
    std::vector<std::int32_t> shared(kShared);
    std::iota(shared.begin(), shared.end(), 1000);
    std::size_t peak_resident = 0, peak_used = 0;
    std::int64_t prefill = 0, hit = 0, rounds = 0;
    auto sample = [&] {
      peak_resident = std::max(peak_resident, mem.bytes_resident());
      peak_used = std::max(peak_used, mem.blocks_held());
    };
    std::vector<SeqId> seqs;
    for (int r = 0; r < kRequests; ++r) {  // request 0 first; the others find its prompt cached
      std::vector<std::int32_t> prompt = shared;
      for (int i = 0; i < kOwn; ++i) prompt.push_back(r * kOwn + i);
      int cached = 0;
      SeqId s;
      if (sharing) {
        const PrefixAdmission a = admit_prompt(cache, prompt);
        s = a.seq;
        cached = a.cached_tokens;
      } else {
        s = cache.add_sequence();
      }
      if (!cache.extend(s, static_cast<int>(prompt.size()) - cached, Phase::kPrefill).ok())
        state.SkipWithError("out of blocks in prefill");
      if (sharing) (void)publish_prompt(cache, s, prompt);
      prefill += static_cast<std::int64_t>(prompt.size()) - cached;
      hit += cached;
      seqs.push_back(s);
      sample();
    }
    for (int step = 0; step < kGenerated; ++step) {
      for (const SeqId s : seqs)
        if (!cache.extend(s, 1).ok()) state.SkipWithError("out of blocks in decode");
      sample();
      if (compress) rounds += static_cast<std::int64_t>(cache.compress_if_needed(seqs).size());
      (void)mem.trim();
    }
    state.counters["peak_resident_GiB"] = static_cast<double>(peak_resident) / (1 << 30);
    state.counters["peak_used_blocks_GiB"] =
        static_cast<double>(peak_used) * static_cast<double>(cfg.block_bytes_all_ranges()) / (1 << 30);
    state.counters["prefill_tokens"] = static_cast<double>(prefill);
    state.counters["hit_tokens"] = static_cast<double>(hit);
    state.counters["rounds"] = static_cast<double>(rounds);
    for (const SeqId s : seqs) cache.release(s);
  }
}
BENCHMARK(BM_PrefixWorkload)
    ->ArgNames({"sharing", "compress", "prompt_mode"})
    ->Args({0, 0, 1})
    ->Args({1, 0, 1})
    ->Args({0, 1, 1})
    ->Args({1, 1, 1})
    ->Args({0, 1, 2})
    ->Iterations(1)
    ->Unit(benchmark::kSecond);

}  // namespace

BENCHMARK_MAIN();

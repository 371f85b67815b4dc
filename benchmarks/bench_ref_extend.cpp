// SPDX-License-Identifier: Apache-2.0
// Host cost of KvCache::extend in decode steps, before and after a compression round moved data.
// Once a round has compacted a sequence its slots no longer equal positions, and the cache keeps
// each slot's original position per (layer, KV head) row; every extend appends one entry per row.
// Qwen3-8B geometry (36 layers x 8 KV heads = 288 rows), 16 sequences of 6,400 cached tokens (a
// 4,352-token pinned prompt plus a 2,048 budget: bench_prefix_workload's compressed state), one
// token per sequence per step. The allocator is the VMM core over the fake driver (address space
// only), the compactor moves nothing: only the cache's host bookkeeping is timed.
//
//   BM_DecodeExtend/compacted:C   C = 0: slots equal positions (no round yet); 1: after a round
// Counter: us_per_step (all 16 sequences extended by one token).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>
#include "common/vmm/fake_driver.hpp"

namespace {

using namespace triattn;

constexpr int kSeqs = 16, kLen = 6400, kSteps = 512;

/// Moves nothing (the pool is address space only); the plans below are valid for any compactor.
struct NoDataCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) const {}
};

using Cache = KvCache<vmm::VmmAllocatorCore<vmm::FakeDriver>, NoDataCompactor>;

void BM_DecodeExtend(benchmark::State& state) {
  const bool compacted = state.range(0) != 0;
  CacheConfig cfg;
  cfg.model = {36, 32, 8, 128};
  cfg.block_size = 16;
  cfg.dtype = DType::kBF16;
  cfg.max_seqs = kSeqs;
  cfg.max_blocks_per_seq = (kLen + 1 + kSteps) / 16 + 2;
  cfg.num_blocks = kSeqs * cfg.max_blocks_per_seq;
  double us = 0.0;
  std::int64_t steps = 0;
  for (auto _ : state) {
    state.PauseTiming();
    Cache cache(cfg, vmm::VmmAllocatorCore<vmm::FakeDriver>(cfg, vmm::VmmOptions{}, vmm::FakeDriver{}));
    std::vector<SeqId> seqs;
    for (int i = 0; i < kSeqs; ++i) {
      const SeqId s = cache.add_sequence();
      (void)cache.extend(s, kLen + 1, Phase::kDecode);
      // Drop slot 0 in every row: every later slot moves, as after a round.
      KeepPlan plan(cfg.model.num_layers, cfg.model.num_kv_heads, compacted ? kLen : kLen + 1);
      for (int l = 0; l < cfg.model.num_layers; ++l)
        for (int h = 0; h < cfg.model.num_kv_heads; ++h)
          for (int j = 0; j < plan.keep; ++j) plan.row(l, h)[j] = compacted ? j + 1 : j;
      cache.apply_keep_plan(s, plan);
      seqs.push_back(s);
    }
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < kSteps; ++step)
      for (const SeqId s : seqs)
        if (!cache.extend(s, 1).ok()) state.SkipWithError("out of blocks");
    us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    steps += kSteps;
  }
  state.counters["us_per_step"] = steps > 0 ? us / static_cast<double>(steps) : 0.0;
}
BENCHMARK(BM_DecodeExtend)->ArgNames({"compacted"})->Arg(0)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();

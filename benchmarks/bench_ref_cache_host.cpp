// SPDX-License-Identifier: Apache-2.0
// Host costs of KvCache's bookkeeping at Qwen3-8B geometry (36 layers x 8 KV heads = 288 rows),
// 16 sequences in bench_prefix_workload's compressed state (a 4,352-token pinned prompt plus the
// 2,048 budget). With CacheConfig::track_positions (P = 1) the cache keeps each slot's original
// position per (layer, KV head) row once a round has compacted it; without (P = 0, the default)
// its host state is O(blocks). The allocator is the VMM core over the fake driver (address space
// only) and the compactor moves nothing: only the host work is timed.
//
//   BM_DecodeExtend/compacted:C/positions:P  one token appended to each sequence per step; C = 0:
//                                slots equal positions (no round yet), 1: after a round.
//                                Counter us_per_step.
//   BM_RoundCommit/positions:P   KvCache::commit_round of a device round (what DeviceRounds does
//                                on the host after its kernels): 16 sequences of 6,528 slots kept
//                                to 6,400 per row; P = 0 from new lengths and first moved slots,
//                                P = 1 from every row's kept slots, positions reported per row.
//                                Counter ms_per_round.
//   BM_PublishPrompt/tokens:N    publish_prompt of an N-token prompt into the prefix cache at page
//                                size 1 (SGLang's layout: a block per token), every block new;
//                                linear in N (it was quadratic: each block searched the plan).
//                                Counter ns_per_block.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include <numeric>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/prefix_caching_allocator.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/engine/paged_round.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>
#include "common/vmm/fake_driver.hpp"

namespace {

using namespace triattn;

constexpr int kSeqs = 16, kLen = 6400, kSteps = 512, kPrompt = 4352, kDivide = 128;

/// Moves nothing (the pool is address space only); the plans below are valid for any compactor.
struct NoDataCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) const {}
};

using Cache = KvCache<vmm::VmmAllocatorCore<vmm::FakeDriver>, NoDataCompactor>;

CacheConfig bench_config(bool positions) {
  CacheConfig cfg;
  cfg.track_positions = positions;
  cfg.model = {36, 32, 8, 128};
  cfg.block_size = 16;
  cfg.dtype = DType::kBF16;
  cfg.max_seqs = kSeqs;
  cfg.max_blocks_per_seq = (kLen + kDivide + 1 + kSteps) / 16 + 2;
  cfg.num_blocks = kSeqs * cfg.max_blocks_per_seq;
  return cfg;
}

/// `len` slots per sequence, positions made explicit by a plan that drops slot 0 (every later
/// slot moves) when `compacted`.
std::vector<SeqId> fill(Cache& cache, const CacheConfig& cfg, int len, bool compacted) {
  std::vector<SeqId> seqs;
  for (int i = 0; i < kSeqs; ++i) {
    const SeqId s = cache.add_sequence();
    (void)cache.extend(s, len + 1, Phase::kDecode);
    KeepPlan plan(cfg.model.num_layers, cfg.model.num_kv_heads, compacted ? len : len + 1);
    for (int l = 0; l < cfg.model.num_layers; ++l)
      for (int h = 0; h < cfg.model.num_kv_heads; ++h)
        for (int j = 0; j < plan.keep; ++j) plan.row(l, h)[j] = compacted ? j + 1 : j;
    cache.apply_keep_plan(s, plan);
    seqs.push_back(s);
  }
  return seqs;
}

void BM_DecodeExtend(benchmark::State& state) {
  const bool compacted = state.range(0) != 0;
  const CacheConfig cfg = bench_config(state.range(1) != 0);
  double us = 0.0;
  std::int64_t steps = 0;
  for (auto _ : state) {
    state.PauseTiming();
    Cache cache(cfg, vmm::VmmAllocatorCore<vmm::FakeDriver>(cfg, vmm::VmmOptions{}, vmm::FakeDriver{}));
    const std::vector<SeqId> seqs = fill(cache, cfg, kLen, compacted);
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
BENCHMARK(BM_DecodeExtend)
    ->ArgNames({"compacted", "positions"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

void BM_RoundCommit(benchmark::State& state) {
  const bool positions = state.range(0) != 0;
  const CacheConfig cfg = bench_config(positions);
  const int rows = cfg.model.num_layers * cfg.model.num_kv_heads;
  constexpr int kBefore = kLen + kDivide, kKeep = kLen;
  // Every row keeps the prompt and all decode slots but the first kDivide (pre-round slots).
  std::vector<std::int32_t> kept(static_cast<std::size_t>(kSeqs) * rows * kKeep);
  for (std::size_t r = 0; r < static_cast<std::size_t>(kSeqs) * rows; ++r)
    for (int i = 0; i < kKeep; ++i) kept[r * kKeep + i] = i < kPrompt ? i : i + kDivide;
  std::vector<std::int32_t> new_lens(kSeqs, kKeep), status(kSeqs, static_cast<std::int32_t>(RoundStatus::kCompressed));
  std::vector<std::int32_t> first_moved(kSeqs, kPrompt);
  RoundOutputs out;
  out.new_lens = new_lens.data();
  out.status = status.data();
  out.first_moved = first_moved.data();
  if (positions) {  // without tracked positions the round brings no kept slots back
    out.kept = kept.data();
    out.kept_rows = rows;
    out.max_keep = kKeep;
  }
  std::vector<CompressionReport> done;
  double ms = 0.0;
  std::int64_t n = 0;
  for (auto _ : state) {
    state.PauseTiming();
    Cache cache(cfg, vmm::VmmAllocatorCore<vmm::FakeDriver>(cfg, vmm::VmmOptions{}, vmm::FakeDriver{}));
    const std::vector<SeqId> seqs = fill(cache, cfg, kBefore, true);
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    cache.commit_round(seqs, out, done);
    ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++n;
    if (done.size() != seqs.size() || cache.physical_length(seqs[0]) != kKeep) state.SkipWithError("round not committed");
    benchmark::DoNotOptimize(done.data());
  }
  state.counters["ms_per_round"] = n > 0 ? ms / static_cast<double>(n) : 0.0;
}
BENCHMARK(BM_RoundCommit)->ArgNames({"positions"})->Arg(0)->Arg(1)->Iterations(2)->Unit(benchmark::kMillisecond);

void BM_PublishPrompt(benchmark::State& state) {
  using PrefixCache = KvCache<PrefixCachingAllocator<StaticAllocator<HostBackend>>>;
  const int n = static_cast<int>(state.range(0));
  CacheConfig cfg;
  cfg.model = {1, 1, 1, 8};  // the index's work does not depend on the KV geometry
  cfg.block_size = 1;
  cfg.max_seqs = 1;
  cfg.max_blocks_per_seq = n;
  cfg.num_blocks = n;
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(n));
  std::iota(prompt.begin(), prompt.end(), 3);
  double seconds = 0.0;
  for (auto _ : state) {
    PrefixCache cache(cfg);
    const SeqId s = cache.add_sequence();
    (void)cache.extend(s, n, Phase::kPrefill);
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(publish_prompt(cache, s, std::span<const std::int32_t>(prompt)));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    seconds += dt;
  }
  state.counters["ns_per_block"] = seconds * 1e9 / (static_cast<double>(state.iterations()) * n);
}
BENCHMARK(BM_PublishPrompt)->ArgNames({"tokens"})->Arg(8192)->Arg(32768)->Arg(131072)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();

// SPDX-License-Identifier: Apache-2.0
// Elastic KV memory (cuda::VmmAllocator) on the real driver. Host clocks around synchronous calls
// (driver map/unmap work is host-side; every timed region ends synchronised), manual time.
//
//   BM_VmmGrow/<run>/<from_pool>      grow by a run of `run` slabs (1 page x 2 ranges each):
//                                     pages from the handle pool (map + access) or fresh (create too)
//   BM_VmmRelease/<run>/<to_pool>     trim + unmap a run of empty slabs (handles to the pool, or
//                                     released to the driver), event ordering included
//   BM_VmmRawDriver/<run>             the floor: cuMemMap x N + one cuMemSetAccess, then one
//                                     cuMemUnmap, on pre-created handles (no allocator)
//   BM_Qwen3Workload/<seqs>/<tokens>/<compress>
//                                     Qwen3-8B-shaped KV (36 layers, 8 KV heads, d 128, bf16,
//                                     16-token blocks) decoding `seqs` sequences to `tokens` tokens,
//                                     compressed back to 2048 when they reach 2048 + 128 (prefix
//                                     keep plans: the memory behaviour of any plan; no kernel),
//                                     trimming every 128 steps (keeping 2 empty slabs mapped as
//                                     hysteresis; a final trim keeps none). Reports peak/final resident bytes
//                                     (allocator ledger and cudaMemGetInfo), live KV bytes, bytes in
//                                     used blocks and the full-KV requirement; finally releases
//                                     every sequence and checks that the memory went back.
// Counters are per page (2 MiB granule of one range) where named *_us_per_page.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <random>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/cuda/backend/vmm_allocator.cuh>

#include "common/cuda_event_timer.hpp"

namespace {

using namespace triattn;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// Prefix keep plans never move data, so KvCache never calls apply(); the memory workload needs
/// no kernel. Any other plan would be a bug in this benchmark.
struct PrefixOnlyCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>&, int, const KeepPlan&) const {
    throw unsupported("bench_vmm: PrefixOnlyCompactor got a plan that moves data");
  }
};

/// 1 layer (2 ranges) x 8 KV heads x d 128 bf16, 16-token blocks: 32 KiB blocks, 64 per 2 MiB page.
CacheConfig page_config(int slabs_max) {
  CacheConfig cfg;
  cfg.model = ModelGeometry{1, 32, 8, 128};
  cfg.block_size = 16;
  cfg.num_blocks = 64 * slabs_max;
  cfg.max_seqs = 1;
  cfg.dtype = DType::kBF16;
  return cfg;
}

void BM_VmmGrow_body(benchmark::State& state) {
  const int run = static_cast<int>(state.range(0));
  const bool from_pool = state.range(1) != 0;
  cuda::VmmBlockAllocator a(page_config(64));
  const std::size_t slab_blocks = static_cast<std::size_t>(a.geometry().blocks_per_slab);
  const std::size_t pages = static_cast<std::size_t>(run) * a.geometry().pages_per_slab * 2;
  a.set_handle_pool_bytes(from_pool ? pages * a.page_bytes() : 0);
  if (from_pool) a.precreate_handles(pages);
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    if (!a.ensure_mapped(static_cast<std::size_t>(run) * slab_blocks)) state.SkipWithError("ensure_mapped failed");
    const double s = seconds_since(t0);
    state.SetIterationTime(s);
    total += s;
    (void)a.trim(nullptr);  // back to the pool (or the driver), untimed
    a.synchronize();
  }
  state.counters["pages"] = static_cast<double>(pages);
  state.counters["us_per_page"] = total * 1e6 / (static_cast<double>(state.iterations()) * static_cast<double>(pages));
  state.counters["creates"] = static_cast<double>(a.counters().handles_created);
  state.counters["pool_hits"] = static_cast<double>(a.counters().pool_hits);
}
void BM_VmmGrow(benchmark::State& state) {
  try {
    BM_VmmGrow_body(state);
  } catch (const std::exception& e) {  // e.g. no driver: report instead of terminating
    state.SkipWithError(e.what());
  }
}

void BM_VmmRelease_body(benchmark::State& state) {
  const int run = static_cast<int>(state.range(0));
  const bool to_pool = state.range(1) != 0;
  cuda::VmmBlockAllocator a(page_config(64));
  const std::size_t slab_blocks = static_cast<std::size_t>(a.geometry().blocks_per_slab);
  const std::size_t pages = static_cast<std::size_t>(run) * a.geometry().pages_per_slab * 2;
  a.set_handle_pool_bytes(to_pool ? pages * a.page_bytes() : 0);
  double total = 0;
  for (auto _ : state) {
    if (!a.ensure_mapped(static_cast<std::size_t>(run) * slab_blocks)) state.SkipWithError("ensure_mapped failed");
    const auto t0 = Clock::now();
    (void)a.trim(nullptr);
    a.synchronize();
    const double s = seconds_since(t0);
    state.SetIterationTime(s);
    total += s;
  }
  state.counters["pages"] = static_cast<double>(pages);
  state.counters["us_per_page"] = total * 1e6 / (static_cast<double>(state.iterations()) * static_cast<double>(pages));
}
void BM_VmmRelease(benchmark::State& state) {
  try {
    BM_VmmRelease_body(state);
  } catch (const std::exception& e) {  // e.g. no driver: report instead of terminating
    state.SkipWithError(e.what());
  }
}

/// The driver floor without the allocator: N pre-created handles mapped one call each, one access
/// grant over the run, one unmap over the run.
void BM_VmmRawDriver_body(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  cuda::CudaVmmDriver d;
  std::size_t g = 0;
  if (d.granularity(&g) != 0) return state.SkipWithError("granularity");
  vmm::dev_addr va = 0;
  if (d.reserve(g * static_cast<std::size_t>(n), g, &va) != 0) return state.SkipWithError("reserve");
  std::vector<vmm::phys_handle> h(static_cast<std::size_t>(n));
  for (auto& x : h)
    if (d.create(g, &x) != 0) return state.SkipWithError("create");
  double map_s = 0, unmap_s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) (void)d.map(va + static_cast<vmm::dev_addr>(i) * g, g, h[static_cast<std::size_t>(i)]);
    (void)d.set_access(va, g * static_cast<std::size_t>(n));
    const double m = seconds_since(t0);
    const auto t1 = Clock::now();
    (void)d.unmap(va, g * static_cast<std::size_t>(n));
    const double u = seconds_since(t1);
    state.SetIterationTime(m + u);
    map_s += m;
    unmap_s += u;
  }
  for (auto x : h) (void)d.release(x);
  (void)d.free(va, g * static_cast<std::size_t>(n));
  const double per = 1e6 / (static_cast<double>(state.iterations()) * n);
  state.counters["map_access_us_per_page"] = map_s * per;
  state.counters["unmap_us_per_page"] = unmap_s * per;
}
void BM_VmmRawDriver(benchmark::State& state) {
  try {
    BM_VmmRawDriver_body(state);
  } catch (const std::exception& e) {  // e.g. no driver: report instead of terminating
    state.SkipWithError(e.what());
  }
}

// ---- the Qwen3-8B-shaped workload ---------------------------------------------------------------

using WorkloadCache = KvCache<cuda::VmmBlockAllocator, PrefixOnlyCompactor>;

std::size_t device_used() {
  std::size_t f = 0, t = 0;
  TRIATTN_BENCH_CUDA(cudaMemGetInfo(&f, &t));
  return t - f;
}

void BM_Qwen3Workload_body(benchmark::State& state) {
  const int seqs = static_cast<int>(state.range(0));
  const int target = static_cast<int>(state.range(1));
  const bool compress = state.range(2) != 0;
  constexpr int kBudget = 2048, kDivide = 128, kTrimEvery = 128;
  CacheConfig cfg;
  cfg.model = ModelGeometry{36, 32, 8, 128};
  cfg.block_size = 16;
  cfg.max_seqs = seqs;
  cfg.max_blocks_per_seq = target / cfg.block_size;
  cfg.num_blocks = seqs * cfg.max_blocks_per_seq;  // address space for the full cache; pages on demand
  cfg.dtype = DType::kBF16;
  const double gb = 1e9;
  const double full_kv = static_cast<double>(seqs) * target * static_cast<double>(cfg.token_bytes());

  for (auto _ : state) {
    TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
    const std::size_t used0 = device_used();
    auto used_since = [used0] {  // device bytes taken since the baseline (never negative)
      const std::size_t u = device_used();
      return u > used0 ? u - used0 : std::size_t{0};
    };
    const auto t0 = Clock::now();
    WorkloadCache cache(cfg);
    auto& a = cache.allocator();
    KeepPlan plan(cfg.model.num_layers, cfg.model.num_kv_heads, kBudget);
    for (int l = 0; l < cfg.model.num_layers; ++l)
      for (int h = 0; h < cfg.model.num_kv_heads; ++h) std::iota(plan.row(l, h), plan.row(l, h) + kBudget, 0);
    std::mt19937 rng(12345);
    std::vector<SeqId> ids;
    for (int i = 0; i < seqs; ++i) {
      ids.push_back(cache.add_sequence());
      // Prompts of 128..2047 tokens stagger the compression triggers.
      if (!cache.extend(ids.back(), 128 + static_cast<int>(rng() % 1920), Phase::kPrefill).ok())
        return state.SkipWithError("prefill ran out of memory");
    }
    const std::size_t keep_empty = 2 * a.stats().slab_bytes;
    std::size_t peak_resident = 0, peak_physical = 0, peak_meminfo = 0, peak_live = 0, peak_in_used = 0;
    double sum_ratio = 0;  // resident / live, steady state
    int samples = 0;
    std::int64_t compressions = 0, failures = 0;
    auto sample = [&](int step) {
      const auto m = cache.memory();
      const std::size_t mi = used_since();
      peak_resident = std::max(peak_resident, m.bytes_resident);
      peak_physical = std::max(peak_physical, a.physical_bytes());
      peak_meminfo = std::max(peak_meminfo, mi);
      peak_live = std::max(peak_live, m.bytes_live);
      peak_in_used = std::max(peak_in_used, m.bytes_in_used_blocks);
      if (step >= 2 * (kBudget + kDivide) && m.bytes_live > 0) {
        sum_ratio += static_cast<double>(m.bytes_resident) / static_cast<double>(m.bytes_live);
        ++samples;
      }
    };
    int step = 0;
    for (;; ++step) {
      bool any = false;
      for (SeqId s : ids) {
        if (cache.logical_position(s) >= target) continue;
        any = true;
        if (!cache.extend(s, 1).ok()) {
          ++failures;
          continue;
        }
        if (compress && cache.physical_length(s) >= kBudget + kDivide) {
          cache.apply_keep_plan(s, plan);
          ++compressions;
        }
      }
      if (!any) break;
      if (step % kTrimEvery == kTrimEvery - 1) {
        (void)a.trim(nullptr, keep_empty);  // hysteresis: keep a couple of empty slabs for regrowth
        sample(step);
      }
    }
    (void)a.trim(nullptr);
    a.synchronize();
    sample(step);
    const auto fm = cache.memory();
    const std::size_t final_meminfo = used_since();
    const double secs = seconds_since(t0);
    state.SetIterationTime(secs);
    // Requests finish: every page must go back to the driver.
    for (SeqId s : ids) cache.release(s);
    (void)a.trim(nullptr);
    a.synchronize();
    const std::size_t released_meminfo = used_since();

    state.counters["full_kv_GB"] = full_kv / gb;
    state.counters["peak_resident_GB"] = static_cast<double>(peak_resident) / gb;
    state.counters["peak_physical_GB"] = static_cast<double>(peak_physical) / gb;
    state.counters["peak_meminfo_GB"] = static_cast<double>(peak_meminfo) / gb;
    state.counters["peak_live_GB"] = static_cast<double>(peak_live) / gb;
    state.counters["peak_in_used_blocks_GB"] = static_cast<double>(peak_in_used) / gb;
    state.counters["final_resident_GB"] = static_cast<double>(fm.bytes_resident) / gb;
    state.counters["final_meminfo_GB"] = static_cast<double>(final_meminfo) / gb;
    state.counters["final_live_GB"] = static_cast<double>(fm.bytes_live) / gb;
    state.counters["after_release_resident_GB"] = static_cast<double>(a.bytes_resident()) / gb;
    state.counters["after_release_meminfo_GB"] = static_cast<double>(released_meminfo) / gb;
    state.counters["steady_resident_over_live"] = samples > 0 ? sum_ratio / samples : 0.0;
    state.counters["peak_resident_over_full"] = static_cast<double>(peak_resident) / full_kv;
    state.counters["compressions"] = static_cast<double>(compressions);
    state.counters["extend_failures"] = static_cast<double>(failures);
    state.counters["decode_steps"] = static_cast<double>(step);
    state.counters["pages_mapped"] = static_cast<double>(a.counters().pages_mapped);
    state.counters["pages_unmapped"] = static_cast<double>(a.counters().pages_unmapped);
    state.counters["handles_created"] = static_cast<double>(a.counters().handles_created);
    state.counters["slabs_revived"] = static_cast<double>(a.counters().slabs_revived);
    state.counters["slab_MB"] = static_cast<double>(a.stats().slab_bytes) / 1e6;
    std::printf("Qwen3 workload %d seqs x %d tokens (%s): full KV %.1f GB, peak resident %.2f GB (cudaMemGetInfo %.2f GB),"
                " peak live %.2f GB, final resident %.2f GB, %.1f s\n",
                seqs, target, compress ? "compressed to 2048" : "no compression", full_kv / gb, peak_resident / gb,
                peak_meminfo / gb, peak_live / gb, fm.bytes_resident / gb, secs);
  }
}
void BM_Qwen3Workload(benchmark::State& state) {
  try {
    BM_Qwen3Workload_body(state);
  } catch (const std::exception& e) {  // e.g. no driver: report instead of terminating
    state.SkipWithError(e.what());
  }
}

}  // namespace

BENCHMARK(BM_VmmGrow)
    ->ArgsProduct({{1, 2, 4, 8, 16, 32, 64}, {1, 0}})
    ->ArgNames({"run", "from_pool"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_VmmRelease)
    ->ArgsProduct({{1, 2, 4, 8, 16, 32, 64}, {1, 0}})
    ->ArgNames({"run", "to_pool"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_VmmRawDriver)->Arg(1)->Arg(2)->Arg(8)->Arg(64)->ArgName("pages")->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Qwen3Workload)
    ->Args({64, 32768, 1})
    ->Args({16, 16384, 1})
    ->Args({16, 16384, 0})
    ->ArgNames({"seqs", "tokens", "compress"})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kSecond);

BENCHMARK_MAIN();

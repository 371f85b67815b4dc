// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// Decode step of the reference transformer on the GPU, Qwen3-8B-like synthetic model (36 layers,
// hidden 4096, 32 q / 8 KV heads, d = 128, intermediate 12288, vocab 151936, half-pairing RoPE,
// θ = 1e6), bf16 weights generated on the device from a seed (8.2e9 parameters, 16.4 GB), bf16
// KV cache (NHD, 16-token blocks), through CudaBackend (CUDA graphs + PDL) and DeviceDecoder
// (Model::step's backend calls; greedy token by device argmax).
//
// Cache scenarios, all at a logical length of 32,768 (RoPE positions and round starts):
//   compressed  TriAttention budget 2,048 (divide_length 128): cached 2,048..2,175 tokens
//   full        every token cached: 32,768 (+ the steps run)
//   short       64 cached tokens, batch 1: the step's cost without attention (weights only)
// The caches are filled directly: random K/V written with triattn's append kernel in chunks of
// 2,048 tokens; for the compressed cache each further chunk is extended and cut back to its
// first 2,048 slots (KvCache::apply_keep_plan with a prefix plan moves nothing), which advances
// the logical position without a decode step per token.
// Batches: 1, and the largest whose KV fits in 40 GiB: full 4.5 GiB per sequence -> 8;
// compressed at most 2,176 x 144 KiB = 306 MiB per sequence -> 133, rounded down to 128 (one
// tensor-core GEMV pass covers 128 rows; 129..133 would read every weight twice); and batch 64,
// the 64 x 32,768 workload of issue #5, for the allocator comparison.
// Modes: latency = one step per iteration, next tokens = argmax of the logits (the ids cross
// PCIe, the host waits); pipelined = 8 steps per iteration with fixed tokens and no host wait
// (host work of step k+1 overlaps step k on the GPU).
// BM_CompressionRound: one device round (cuda::compression_round::run: score, select, compact)
// for `batch` sequences of 2,176 cached tokens: its cost spread over 128 steps is the
// compressed scenario's amortised overhead.
//
// Allocators (`alloc`): the cache is KvCache<Allocator, cuda::DeviceCompactor,
// cuda::TriAttentionDeviceScorer, TopKSelector>, and the allocator is the only thing a row changes:
//   0 static     cuda::DeviceAllocator: one cudaMalloc pool, all resident from the start
//   1 vmm eager  cuda::VmmAllocator, worst case: after a step's rounds trim(stream) keeps no
//                empty slab and the host waits for its event (synchronize), so every slab the
//                compaction emptied is unmapped and released before the next step, and regrowth
//                is cuMemCreate + cuMemMap + cuMemSetAccess inside the step's extend
//   2 vmm lazy   cuda::VmmAllocator as an engine runs it: trim(stream, 2 empty slabs kept) after
//                a step's rounds, poll() at the start of every step; allocating from a slab whose
//                unmap is still pending cancels it
// Either way VMM memory grows only when KvCache::extend needs a block (DeviceDecoder::step, no
// ensure_mapped ahead) and release is GPU-ordered: trim's event follows the compaction on the
// backend's stream, which also runs every kernel that touched the blocks.
// BM_DecodeCycle/alloc/batch/stagger: the ≤ 2% VMM-overhead question (issue #5). Compressed
// scenario, latency mode, rounds inside the timed steps as an engine runs them: per step
// DeviceDecoder::step + greedy argmax, then cuda::DeviceRounds::compress_if_needed_and_wait (one
// cuda::paged_round: device score, select and compaction; the cache commits lengths and frees the
// tail blocks after the round's event), then the allocator's trim. One iteration = one full round cycle of divide_length = 128
// steps (every sequence compresses exactly once, the memory it gave back grows again), after an
// untimed warm-up cycle; batch 1 runs 4 cycles, batch 64 (the 64 x 32,768 workload) 2.
// stagger 0: all sequences in lock step (the tail blocks of all sequences empty whole slabs at
// once: the most driver work); stagger 1: sequence i starts 2i tokens further, so about one round
// every other step and freed blocks refill half-empty slabs.
// Driver work per cycle (same allocator logic on the fake driver): batch 64 lock step, eager:
// 8 slabs = 576 pages created + mapped and 576 unmapped + released; lazy: 432 (6 slabs; 2 kept);
// batch 1 eager: 72; batch 1 lazy and every staggered row: none (blocks are recycled in place).
// BM_DecodeStep/.../alloc: the plain steady-state step (rewound to 2,048, no round, no trim).
//
// Counters: ms_step, tok_s, floor_pct (= 3.65 ms / ms_step: the batch-1 weight-read floor,
// 16.4 GB at 4.49 TB/s), weight_GB (read per step), kv_resident_GiB / kv_live_GiB
// (KvCache::memory()), cached_len / logical_len (per sequence, mean over the timed steps),
// GBps (weights + live KV bytes per step / time), read_GBps (this card's read bandwidth,
// measured in the same process: common/device_memory.cuh, measured_read_bandwidth), floor_ms
// (weights + live KV read once at read_GBps) and floor_ratio = ms_step / floor_ms (issue #48's
// decode target: <= 1.3 at compressed batch 1, 64, 128 and full batch 8, the largest whose KV
// fits 40 GB).
// BM_DecodeCycle: ms_step = CUDA-event time of all timed steps (rounds, trims and driver calls
// included) / steps; wall_ms_step (host clock, same region); median_step_ms / max_step_ms (per
// step, the round's step included); vs_static_pct = 100 (ms_step / ms_step of the static row of
// the same batch and stagger, which runs earlier) - 100: the overhead, target ≤ 2; seq_rounds
// (sequence rounds timed); kv_resident_GiB (mean) / kv_resident_peak_GiB; VMM rows: pages_mapped,
// pages_unmapped, handles_created, slabs_revived, access_calls, unmap_calls during the timed
// steps (0 would mean the row never exercised the driver). BM_DecodeStep VMM rows report
// vs_static_pct against the static row with the same arguments.
// Run: build/benchmarks/bench_decode_step   (about 4 minutes on an H200; 16.4 GB of weights plus
// at most one cache at a time: ≤ 39 GiB of KV for batch 128, 19.6 GiB for batch 64)
//   just the overhead rows: --benchmark_filter='BM_DecodeCycle|kv:0/batch:(1|64)/pipelined:0/direct:0/'
//   (about 2.5 minutes)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/stats/query_stats.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

#include "common/cuda_event_timer.hpp"
#include "common/decode_step_setup.cuh"
#include "common/device_memory.cuh"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>

namespace ex = triattn_example;
using triattn::SeqId;

namespace {

using namespace triattn::bench::decode_scenario;  // kLogical, kBudget, kDivide, kChunk, kBlock, kSeed
constexpr int kShortLen = 64;
constexpr double kFloorMs = 3.65;
constexpr int kLazyKeepSlabs = 2;  // vmm lazy: empty slabs trim keeps mapped (bench_vmm's workload does the same)

enum class Kv : int { kCompressed = 0, kFull = 1, kShort = 2 };
const char* kv_name(Kv k) { return k == Kv::kCompressed ? "compressed" : k == Kv::kFull ? "full" : "short"; }

enum class Alloc : int { kStatic = 0, kVmmEager = 1, kVmmLazy = 2 };  // see the header comment
const char* alloc_name(Alloc a) {
  return a == Alloc::kStatic ? "static pool" : a == Alloc::kVmmEager ? "vmm eager release" : "vmm lazy release";
}

/// The cache of every row: swapping the allocator is this one template argument. The scorer and
/// selector are what DeviceRounds' rounds need; the plain decode step ignores them.
template <class Allocator>
using BenchCache = triattn::KvCache<Allocator, triattn::cuda::DeviceCompactor, triattn::cuda::TriAttentionDeviceScorer,
                                    triattn::TopKSelector>;
using StaticCache = BenchCache<triattn::cuda::DeviceAllocator>;
using VmmCache = BenchCache<triattn::cuda::VmmAllocator>;
template <class Cache>
inline constexpr bool is_vmm_v = std::is_same_v<typename Cache::allocator_type, triattn::cuda::VmmAllocator>;

using Clock = std::chrono::steady_clock;

/// Static rows record ms_step under a key naming the row's other arguments; a VMM row run later
/// with the same key reports vs_static_pct = its overhead in percent.
void compare_with_static(benchmark::State& state, const std::string& key, double ms_step, bool vmm) {
  static std::map<std::string, double> static_ms;
  if (!vmm) {
    static_ms[key] = ms_step;
    return;
  }
  const auto it = static_ms.find(key);
  if (it != static_ms.end() && it->second > 0) state.counters["vs_static_pct"] = 100.0 * (ms_step / it->second - 1.0);
}

using ModelHolder = triattn::bench::SyntheticModel;
ModelHolder& model() { return triattn::bench::synthetic_model(); }
using triattn::bench::random_stats;

/// A full KV pool while a scenario is filled: an exception, which guarded() turns into a skipped row.
[[noreturn]] void pool_full() { throw std::runtime_error("bench_decode_step: the KV pool is too small"); }

/// A filled cache for (kv, batch, stagger) with the allocator of Cache, reused by consecutive
/// benchmarks of the same scenario.
template <class Cache>
struct Scenario {
  Kv kv;
  int batch;
  bool stagger;  // compressed only: sequence i holds i * kDivide / batch tokens more
  std::unique_ptr<Cache> cache;
  std::vector<SeqId> seqs;
  std::vector<int> tokens;
  triattn::KeepPlan prefix;  // keeps slots [0, kBudget): cuts a sequence back without moving data

  Scenario(Kv k, int b, bool stag) : kv(k), batch(b), stagger(stag) {
    ModelHolder& m = model();
    const ex::ModelConfig& c = m.config;
    const cudaStream_t stream = m.backend.stream();
    triattn::CacheConfig cfg = triattn::bench::bf16_cache_config(c, kBlock, b);
    const int per_seq = kv == Kv::kFull ? kLogical + 512 : kv == Kv::kShort ? kShortLen + 512 : kBudget + kDivide;
    const int blocks = (per_seq + kBlock - 1) / kBlock + 1;
    // compressed: one sequence at a time holds an extra chunk while it is being filled
    // (the VMM allocator reserves address space for as many blocks and maps what is used)
    cfg.num_blocks = b * blocks + (kv == Kv::kCompressed ? kChunk / kBlock : 0);
    cfg.max_blocks_per_seq = kv == Kv::kCompressed ? blocks + kChunk / kBlock : blocks;
    triattn::RopeConfig rope;
    rope.style = c.rope_style;
    rope.theta = c.rope_theta;
    triattn::SelectionParams sp;
    sp.budget = kBudget;
    sp.divide_length = kDivide;
    cache = std::make_unique<Cache>(
        cfg, triattn::cuda::DeviceCompactor(stream),
        triattn::cuda::TriAttentionDeviceScorer(random_stats(c), rope, triattn::ScoringParams{}, c.n_kv_heads, stream),
        triattn::TopKSelector(sp));
    const triattn::bench::RandomKvChunk chunk(c, kChunk, stream);
    prefix = triattn::bench::prefix_plan(c.n_layers, c.n_kv_heads, kBudget);
    for (int i = 0; i < b; ++i) {
      const SeqId s = cache->add_sequence();
      seqs.push_back(s);
      tokens.push_back((i * 7919 + 13) % c.vocab_size);
      if (kv == Kv::kShort) {
        append(s, chunk, kShortLen, triattn::Phase::kPrefill, stream);
      } else if (kv == Kv::kFull) {
        for (int t = 0; t < kLogical; t += kChunk) append(s, chunk, kChunk, triattn::Phase::kPrefill, stream);
      } else {
        triattn::bench::fill_compressed(*cache, s, chunk, kLogical, prefix, stream, pool_full);  // cached 2,048 of 32,768
        // staggered: round triggers spread over the cycle (2,048 + extra reaches 2,176 first)
        const int extra = stagger ? i * kDivide / b : 0;
        if (extra > 0) append(s, chunk, extra, triattn::Phase::kDecode, stream);
      }
    }
    if constexpr (is_vmm_v<Cache>) {
      // An engine's state after its last trim: the fill's emptied slabs go back (GPU-ordered).
      (void)cache->allocator().trim(stream);
      cache->allocator().synchronize();
    }
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  void append(SeqId s, const triattn::bench::RandomKvChunk& chunk, int n, triattn::Phase phase, cudaStream_t stream) {
    triattn::bench::append_chunk(*cache, s, chunk, n, phase, stream, pool_full);
  }
  /// Compressed: back to 2,048 cached tokens (the logical position keeps growing).
  void rewind() {
    if (kv == Kv::kCompressed) triattn::bench::rewind_to_prefix(*cache, seqs, prefix);
  }
  [[nodiscard]] double mean_len() const { return triattn::bench::mean_cached_len(*cache, seqs); }
};
struct ScenarioSlots {
  std::unique_ptr<Scenario<StaticCache>> fixed;
  std::unique_ptr<Scenario<VmmCache>> vmm;
  void reset() {
    fixed.reset();
    vmm.reset();
  }
};
ScenarioSlots& scenario_slots() {
  static ScenarioSlots s;
  return s;
}
/// The scenario for (kv, batch, stagger) with Cache's allocator; `fresh` rebuilds it. At most one
/// cache exists at a time (KV stays within 40 GB).
template <class Cache>
Scenario<Cache>& scenario(Kv kv, int batch, bool stagger = false, bool fresh = false) {
  ScenarioSlots& all = scenario_slots();
  std::unique_ptr<Scenario<Cache>>* s = nullptr;
  if constexpr (is_vmm_v<Cache>) s = &all.vmm;
  else s = &all.fixed;
  if (fresh || !*s || (*s)->kv != kv || (*s)->batch != batch || (*s)->stagger != stagger) {
    all.reset();  // free every cache before filling the next
    *s = std::make_unique<Scenario<Cache>>(kv, batch, stagger);
  }
  return **s;
}

template <class Cache>
void decode_step(benchmark::State& state) {
  const Kv kv = static_cast<Kv>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  const bool pipelined = state.range(2) != 0;
  const bool direct = state.range(3) != 0;
  ModelHolder& m = model();
  const double read_bw = triattn::bench::measured_read_bandwidth();  // before any cache: 2 GiB for a moment
  ex::CudaBackendOptions opt = m.backend.options();
  opt.direct_kv_write = direct;
  m.backend.set_options(opt);
  ex::DeviceDecoder& dec = *m.decoder;
  Scenario<Cache>& sc = scenario<Cache>(kv, batch);
  sc.rewind();  // frees blocks without a trim: a VMM cache regrows into its mapped slabs
  const cudaStream_t stream = m.backend.stream();
  const std::span<const SeqId> seqs(sc.seqs);
  std::vector<int> fixed = sc.tokens;
  auto one_step = [&](bool greedy) {
    dec.step(*sc.cache, seqs, greedy ? std::span<const int>(sc.tokens) : std::span<const int>(fixed));
    if (greedy) sc.tokens = dec.argmax();
  };
  for (int w = 0; w < 3; ++w) one_step(true);  // first step captures the graph
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  const int steps_per_iter = pipelined ? 8 : 1;
  cudaEvent_t t0, t1;
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t0));
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t1));
  double total_s = 0.0, len_sum = 0.0, live_sum = 0.0;
  long long steps = 0;
  for (auto _ : state) {
    TRIATTN_BENCH_CUDA(cudaEventRecord(t0, stream));
    for (int i = 0; i < steps_per_iter; ++i) {
      len_sum += sc.mean_len() + 1.0;
      live_sum += static_cast<double>(sc.cache->memory().bytes_live) +
                  static_cast<double>(sc.cache->config().token_bytes()) * batch;
      one_step(!pipelined);
      for (int& t : fixed) t = (t * 31 + 17) % m.config.vocab_size;
    }
    TRIATTN_BENCH_CUDA(cudaEventRecord(t1, stream));
    total_s += triattn::bench::time_iteration(state, t0, t1);
    steps += steps_per_iter;
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  const double ms_step = steps > 0 ? total_s * 1e3 / static_cast<double>(steps) : 0.0;
  const double wbytes = static_cast<double>(dec.weights().bytes_per_step());
  const double live = steps > 0 ? live_sum / static_cast<double>(steps) : 0.0;
  const triattn::MemoryStats mem = sc.cache->memory();
  state.counters["ms_step"] = ms_step;
  state.counters["tok_s"] = ms_step > 0 ? batch * 1e3 / ms_step : 0.0;
  state.counters["floor_pct"] = ms_step > 0 ? 100.0 * kFloorMs / ms_step : 0.0;
  state.counters["weight_GB"] = wbytes * 1e-9;
  state.counters["kv_resident_GiB"] = static_cast<double>(mem.bytes_resident) / static_cast<double>(1ull << 30);
  state.counters["kv_live_GiB"] = live / static_cast<double>(1ull << 30);
  state.counters["cached_len"] = steps > 0 ? len_sum / static_cast<double>(steps) : 0.0;
  state.counters["logical_len"] = static_cast<double>(sc.cache->logical_position(sc.seqs[0]));
  state.counters["GBps"] = ms_step > 0 ? (wbytes + live) / (ms_step * 1e-3) * 1e-9 : 0.0;
  const double floor_ms = (wbytes + live) / read_bw * 1e3;
  state.counters["read_GBps"] = read_bw * 1e-9;
  state.counters["floor_ms"] = floor_ms;
  state.counters["floor_ratio"] = ms_step > 0 ? ms_step / floor_ms : 0.0;
  const ex::CudaBackend::Stats st = m.backend.stats();
  state.counters["graph_captures"] = static_cast<double>(st.graph_captures);
  const std::string key = "step/" + std::to_string(state.range(0)) + "/" + std::to_string(batch) + "/" +
                          std::to_string(state.range(2)) + "/" + std::to_string(state.range(3));
  compare_with_static(state, key, ms_step, is_vmm_v<Cache>);
  state.SetLabel(std::string(kv_name(kv)) + (pipelined ? " pipelined" : " latency") +
                 (direct ? ", K/V written by the RoPE kernel" : ", K/V through triattn append") +
                 (is_vmm_v<Cache> ? ", vmm" : ", static pool"));
  opt.direct_kv_write = false;
  m.backend.set_options(opt);
}

void BM_DecodeStep(benchmark::State& state) {
  triattn::bench::guarded(state, [&] {
    if (static_cast<Alloc>(state.range(4)) == Alloc::kStatic) decode_step<StaticCache>(state);
    else decode_step<VmmCache>(state);
  });
}

/// Owned CUDA events (timing enabled).
struct Events {
  std::vector<cudaEvent_t> ev;
  explicit Events(std::size_t n) : ev(n, nullptr) {
    for (cudaEvent_t& e : ev) TRIATTN_BENCH_CUDA(cudaEventCreate(&e));
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    for (cudaEvent_t e : ev) (void)cudaEventDestroy(e);
  }
};

/// BM_DecodeCycle: decode steps with the rounds and the allocator's trims inside the timed
/// region, one iteration per round cycle (see the header comment).
template <class Cache>
void decode_cycle(benchmark::State& state) {
  const Alloc alloc = static_cast<Alloc>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  const bool stagger = state.range(2) != 0;
  ModelHolder& m = model();
  ex::DeviceDecoder& dec = *m.decoder;
  const cudaStream_t stream = m.backend.stream();
  // Fresh: the cycle leaves sequences mid-cycle (and staggered ones cannot be rewound).
  Scenario<Cache>& sc = scenario<Cache>(Kv::kCompressed, batch, stagger, /*fresh=*/true);
  Cache& cache = *sc.cache;
  const std::span<const SeqId> seqs(sc.seqs);
  triattn::cuda::DeviceRounds<Cache> rounds(cache);  // score, select and compact on the device
  std::size_t keep_empty = 0;               // bytes of empty slabs a trim keeps mapped
  if constexpr (is_vmm_v<Cache>)
    if (alloc == Alloc::kVmmLazy) keep_empty = kLazyKeepSlabs * cache.allocator().stats().slab_bytes;
  long long seq_rounds = 0;
  // One engine step. Growth happens in dec.step's extend when a sequence needs a block; the trim
  // after the rounds records its event on `stream`, behind the compaction and every step kernel.
  auto one_step = [&] {
    if constexpr (is_vmm_v<Cache>) (void)cache.allocator().poll();  // unmap slabs whose trim event passed
    dec.step(cache, seqs, sc.tokens);
    sc.tokens = dec.argmax();  // waits for the step
    const std::vector<triattn::CompressionReport> done = rounds.compress_if_needed_and_wait(seqs, stream);
    seq_rounds += static_cast<long long>(done.size());
    if constexpr (is_vmm_v<Cache>) {
      if (!done.empty()) {
        (void)cache.allocator().trim(stream, keep_empty);
        if (alloc == Alloc::kVmmEager) cache.allocator().synchronize();  // unmap now, not at a later poll
      }
    }
  };
  // Untimed warm-up cycle: captures the graph, sizes the rounds' buffers, runs every
  // sequence's first round and brings the allocator into its periodic state.
  for (int w = 0; w < kDivide; ++w) one_step();
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  seq_rounds = 0;
  const ex::CudaBackend::Stats st0 = m.backend.stats();
  [[maybe_unused]] triattn::vmm::VmmCounters c0{};
  if constexpr (is_vmm_v<Cache>) c0 = cache.allocator().counters();
  Events events(static_cast<std::size_t>(kDivide) + 1);  // boundaries of the cycle's steps
  std::vector<float> step_ms;
  double total_s = 0.0, wall_s = 0.0, len_sum = 0.0, live_sum = 0.0, resident_sum = 0.0;
  std::size_t resident_peak = 0;
  long long steps = 0;
  for (auto _ : state) {
    const Clock::time_point w0 = Clock::now();
    TRIATTN_BENCH_CUDA(cudaEventRecord(events.ev[0], stream));
    for (int i = 0; i < kDivide; ++i) {
      len_sum += sc.mean_len() + 1.0;
      one_step();
      TRIATTN_BENCH_CUDA(cudaEventRecord(events.ev[static_cast<std::size_t>(i) + 1], stream));
      const triattn::MemoryStats mem = cache.memory();
      live_sum += static_cast<double>(mem.bytes_live);
      resident_sum += static_cast<double>(mem.bytes_resident);
      resident_peak = std::max(resident_peak, mem.bytes_resident);
    }
    TRIATTN_BENCH_CUDA(cudaEventSynchronize(events.ev.back()));
    wall_s += std::chrono::duration<double>(Clock::now() - w0).count();
    float ms = 0.f;
    TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, events.ev.front(), events.ev.back()));
    for (int i = 0; i < kDivide; ++i) {
      float s = 0.f;
      TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&s, events.ev[static_cast<std::size_t>(i)],
                                              events.ev[static_cast<std::size_t>(i) + 1]));
      step_ms.push_back(s);
    }
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    total_s += static_cast<double>(ms) * 1e-3;
    steps += kDivide;
  }
  if (steps == 0) return;
  const double n = static_cast<double>(steps);
  const double ms_step = total_s * 1e3 / n;
  const double gib = static_cast<double>(1ull << 30);
  std::sort(step_ms.begin(), step_ms.end());
  state.counters["ms_step"] = ms_step;
  state.counters["wall_ms_step"] = wall_s * 1e3 / n;
  state.counters["median_step_ms"] = step_ms[step_ms.size() / 2];
  state.counters["max_step_ms"] = step_ms.back();
  state.counters["tok_s"] = batch * 1e3 / ms_step;
  state.counters["seq_rounds"] = static_cast<double>(seq_rounds);
  state.counters["cached_len"] = len_sum / n;
  state.counters["logical_len"] = static_cast<double>(cache.logical_position(sc.seqs[0]));
  state.counters["kv_live_GiB"] = live_sum / n / gib;
  state.counters["kv_resident_GiB"] = resident_sum / n / gib;
  state.counters["kv_resident_peak_GiB"] = static_cast<double>(resident_peak) / gib;
  state.counters["graph_captures"] = static_cast<double>(m.backend.stats().graph_captures - st0.graph_captures);
  const std::string key = "cycle/" + std::to_string(batch) + "/" + std::to_string(stagger ? 1 : 0);
  if constexpr (is_vmm_v<Cache>) {
    const triattn::vmm::VmmCounters& c1 = cache.allocator().counters();
    state.counters["pages_mapped"] = static_cast<double>(c1.pages_mapped - c0.pages_mapped);
    state.counters["pages_unmapped"] = static_cast<double>(c1.pages_unmapped - c0.pages_unmapped);
    state.counters["handles_created"] = static_cast<double>(c1.handles_created - c0.handles_created);
    state.counters["slabs_revived"] = static_cast<double>(c1.slabs_revived - c0.slabs_revived);
    state.counters["access_calls"] = static_cast<double>(c1.access_calls - c0.access_calls);
    state.counters["unmap_calls"] = static_cast<double>(c1.unmap_calls - c0.unmap_calls);
  }
  compare_with_static(state, key, ms_step, is_vmm_v<Cache>);
  state.SetLabel(std::string(alloc_name(alloc)) + (stagger ? ", staggered" : ", lock step") + ", rounds timed");
}

void BM_DecodeCycle(benchmark::State& state) {
  triattn::bench::guarded(state, [&] {
    if (static_cast<Alloc>(state.range(0)) == Alloc::kStatic) decode_cycle<StaticCache>(state);
    else decode_cycle<VmmCache>(state);
  });
}

void compression_round(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  ModelHolder& m = model();
  const ex::ModelConfig& c = m.config;
  const cudaStream_t stream = m.backend.stream();
  Scenario<StaticCache>& sc = scenario<StaticCache>(Kv::kCompressed, batch);
  sc.rewind();
  const triattn::bench::RandomKvChunk chunk(c, kChunk, stream);
  for (SeqId s : sc.seqs)  // 2,048 -> 2,176 cached: a round is due
    if (!triattn::cuda::append_tokens(*sc.cache, s, chunk.kp(), chunk.vp(), kDivide, stream, triattn::Phase::kDecode).ok())
      std::abort();
  triattn::RopeConfig rope;
  rope.style = c.rope_style;
  rope.theta = c.rope_theta;
  triattn::cuda::TriAttentionDeviceScorer scorer(random_stats(c), rope, triattn::ScoringParams{}, c.n_kv_heads, stream);
  triattn::SelectionParams sp;
  sp.budget = kBudget;
  sp.divide_length = kDivide;
  const int len = kBudget + kDivide;
  const triattn::cuda::RoundShape shape{c.n_layers, c.n_heads, c.n_kv_heads};
  const std::size_t ws_bytes = triattn::cuda::compression_round::workspace_size(shape, sp.mode, batch, len);
  ex::cuda_detail::DeviceMem ws = ex::cuda_detail::device_alloc(ws_bytes);
  ex::cuda_detail::DeviceMem kept = ex::cuda_detail::device_alloc(static_cast<std::size_t>(batch) * c.n_layers * c.n_kv_heads * kBudget * 4);
  ex::cuda_detail::DeviceMem io = ex::cuda_detail::device_alloc(static_cast<std::size_t>(batch) * 24);
  std::vector<std::int64_t> t0(static_cast<std::size_t>(batch));
  std::vector<std::int32_t> ids(sc.seqs.begin(), sc.seqs.end()), prompts(static_cast<std::size_t>(batch), 0);
  for (int b = 0; b < batch; ++b) t0[static_cast<std::size_t>(b)] = sc.cache->logical_position(sc.seqs[static_cast<std::size_t>(b)]);
  auto* d_t0 = static_cast<std::int64_t*>(io.get());
  auto* d_ids = reinterpret_cast<std::int32_t*>(d_t0 + batch);
  auto* d_prompts = d_ids + batch;
  auto* d_keep = d_prompts + batch;
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_t0, t0.data(), t0.size() * 8, cudaMemcpyHostToDevice));
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_prompts, prompts.data(), prompts.size() * 4, cudaMemcpyHostToDevice));
  const triattn::cuda::RoundBatch rb{d_ids, d_t0, d_prompts, batch, len};
  const triattn::cuda::DeviceKeepPlanView pv{static_cast<std::int32_t*>(kept.get()), d_keep, kBudget};
  const auto view = sc.cache->view<triattn::bf16_storage>();  // tables published by append_tokens
  auto round = [&] {
    TRIATTN_BENCH_CUDA(triattn::cuda::compression_round::run(view, scorer.device_model(),
                                                             sp, rb, pv, ws.get(),
                                                             ws_bytes, stream));
  };
  round();  // warm-up (first launches set kernel attributes)
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t e0, e1;
  TRIATTN_BENCH_CUDA(cudaEventCreate(&e0));
  TRIATTN_BENCH_CUDA(cudaEventCreate(&e1));
  double total_s = 0.0;
  long long n = 0;
  for (auto _ : state) {
    TRIATTN_BENCH_CUDA(cudaEventRecord(e0, stream));
    round();  // compacts in place; the host bookkeeping stays at 2,176, so every repetition does the same work
    TRIATTN_BENCH_CUDA(cudaEventRecord(e1, stream));
    total_s += triattn::bench::time_iteration(state, e0, e1);
    ++n;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const double ms_round = n > 0 ? total_s * 1e3 / static_cast<double>(n) : 0.0;
  state.counters["ms_round"] = ms_round;
  state.counters["amortised_ms_step"] = ms_round / kDivide;  // one round per divide_length steps
  state.counters["seqs"] = batch;
  state.counters["len"] = len;
  state.SetLabel("score + select + compact");
  for (SeqId s : sc.seqs) sc.cache->apply_keep_plan(s, sc.prefix);  // back to 2,048
}

void BM_CompressionRound(benchmark::State& state) {
  triattn::bench::guarded(state, [&] { compression_round(state); });
}

}  // namespace

// kv: 0 compressed, 1 full, 2 short; direct: K/V written by the RoPE kernel instead of triattn's
// append kernel (one launch per layer less); alloc: 0 static pool, 1 VMM (steady state: no round,
// no trim, so eager and lazy are the same). A VMM row follows the static row it is compared with.
constexpr int kC = static_cast<int>(Kv::kCompressed);
constexpr int kF = static_cast<int>(Kv::kFull);
constexpr int kS = static_cast<int>(Kv::kShort);
BENCHMARK(BM_DecodeStep)
    ->ArgNames({"kv", "batch", "pipelined", "direct", "alloc"})
    ->Args({kS, 1, 0, 0, 0})
    ->Args({kS, 1, 1, 0, 0})
    ->Args({kS, 1, 1, 1, 0})
    ->Args({kC, 1, 0, 0, 0})
    ->Args({kC, 1, 1, 0, 0})
    ->Args({kC, 1, 0, 1, 0})
    ->Args({kC, 1, 1, 1, 0})
    ->Args({kC, 1, 0, 0, 1})
    ->Args({kF, 1, 0, 0, 0})
    ->Args({kF, 1, 1, 0, 0})
    ->Args({kF, 8, 0, 0, 0})
    ->Args({kF, 8, 1, 0, 0})
    ->Args({kC, 64, 0, 0, 0})
    ->Args({kC, 64, 0, 0, 1})
    ->Args({kC, 128, 0, 0, 0})
    ->Args({kC, 128, 1, 0, 0})
    ->Iterations(12)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_CompressionRound)->ArgName("batch")->Arg(128)->Iterations(10)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CompressionRound)->ArgName("batch")->Arg(1)->Iterations(20)->UseManualTime()->Unit(benchmark::kMillisecond);

// alloc: 0 static, 1 vmm eager, 2 vmm lazy; stagger: 0 lock step, 1 staggered triggers. One
// iteration = one round cycle of 128 steps; the static row of each (batch, stagger) runs first.
BENCHMARK(BM_DecodeCycle)
    ->ArgNames({"alloc", "batch", "stagger"})
    ->Args({0, 1, 0})
    ->Args({1, 1, 0})
    ->Args({2, 1, 0})
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeCycle)
    ->ArgNames({"alloc", "batch", "stagger"})
    ->Args({0, 64, 0})
    ->Args({1, 64, 0})
    ->Args({2, 64, 0})
    ->Args({0, 64, 1})
    ->Args({1, 64, 1})
    ->Iterations(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // Device memory goes back before the CUDA runtime shuts down.
  scenario_slots().reset();
  triattn::bench::synthetic_model_slot().reset();
  return 0;
}

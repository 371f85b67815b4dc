// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// Prefix caching with compression on the GPU: bench_ref_prefix_workload.cpp's workload (64 requests
// share a 4,096-token prefix, each adds 256 tokens of its own and generates 4,096; budget 2,048,
// divide_length 128, PromptMode::kPinnedOnTop) with real device memory and a real model:
//   cache   KvCache<PrefixCachingAllocator<cuda::VmmAllocator>, DeviceCompactor,
//           TriAttentionDeviceScorer, TopKSelector>, Qwen3-8B KV shape (36 layers, 8 KV heads,
//           d 128, bf16, 16-token blocks = 144 KiB per token); pages mapped on demand, and every
//           slab that rounds, releases or evictions empty is unmapped (trim after every step)
//   rounds  cuda::DeviceRounds (score, select and compact on the device; shared prefixes protected)
//   model   the Qwen3-8B-like synthetic model of bench_decode_step (bf16 weights generated on the
//           device) through DeviceDecoder: greedy batch-64 decode steps with CUDA graphs
// Prompt K/V are random (append kernel) instead of a prefill (the reference transformer's prefill
// is a GEMV loop, not an engine's); prefill_tokens counts what an engine would compute. Decode:
// three timed windows of 16 real model steps (at 0, 2,048 and 4,080 generated tokens); the tokens
// between them are appended as random K/V in 16-token steps (the memory trajectory of decoding
// them, in a fraction of the time), with the rounds and trims of every step.
//
//   BM_PrefixWorkloadGpu/sharing:S/compress:C/alloc:A
// alloc 0: the VMM allocator, every emptied slab unmapped after each step (eager trim); 1: two
// empty slabs stay mapped (lazy); 2: PrefixCachingAllocator<cuda::DeviceAllocator>, one static
// 28 GiB pool (fits the compressed configurations only).
// Counters: peak_kv_GiB (peak of cudaMemGetInfo's used bytes minus those before the cache existed:
// KV pages, tables and the rounds' workspaces), peak_ledger_GiB (the VMM ledger's mapped KV bytes,
// = bench_ref_prefix_workload's number; static pool: the blocks held), prefill_tokens, hit_tokens, rounds, rounds_ms (the
// launches' stream time: device score, select, compact), commit_ms (host time of committing the
// rounds' results into the cache), launch_host_ms (host time of the compress_if_needed calls that
// launch them); round_calls, max_round_call_ms: the calls (most launch nothing) and the longest
// host time one of them held the engine (its launch plus its commit; the device time is rounds_ms),
// tok_s_0 / tok_s_2048 / tok_s_4080 (decode tokens per second of each window; captures_W /
// replays_W: CUDA graphs the backend captured / replayed in window W; step_ms_W: time per step,
// step_host_ms_W: the host's share, DeviceDecoder::step until it returns),
// device_used_GiB (peak of cudaMemGetInfo's used bytes, weights included), wall_s (the workload's
// wall time from the cache's creation, prefill and decode, on the host clock). A configuration that
// does not fit in device memory ends as an error row saying where it stopped.
// Run: build/benchmarks/bench_prefix_workload (about a minute on an H100/H200)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

#include "common/cuda_event_timer.hpp"
#include "common/decode_step_setup.cuh"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>

namespace ex = triattn_example;
using triattn::SeqId;

namespace {

constexpr int kRequests = 64, kShared = 4096, kOwn = 256, kGenerated = 4096, kBudget = 2048, kDivide = 128;
constexpr int kBlock = 16, kStep = 16, kWindow = 16, kChunk = 2048;
constexpr int kWindowStarts[] = {0, 2048, kGenerated - kWindow};
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr std::size_t kLazyKeepBytes = std::size_t{2} * 144 << 20;  // VMM lazy: two empty slabs stay mapped

template <class Inner>
using CacheOver = triattn::KvCache<triattn::PrefixCachingAllocator<Inner>, triattn::cuda::DeviceCompactor,
                                   triattn::cuda::TriAttentionDeviceScorer, triattn::TopKSelector>;
using VmmCache = CacheOver<triattn::cuda::VmmAllocator>;
using StaticCache = CacheOver<triattn::cuda::DeviceAllocator>;
constexpr std::size_t kStaticPoolBytes = std::size_t{28} << 30;  // the static rows' pool (compressed peaks fit)
enum class AllocKind : int { kVmmEager = 0, kVmmLazy = 1, kStatic = 2 };

using ModelHolder = triattn::bench::SyntheticModel;
ModelHolder& model() { return triattn::bench::synthetic_model(); }

std::size_t device_used() {
  std::size_t free_b = 0, total_b = 0;
  TRIATTN_BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}

template <class Cache>
void run_workload(benchmark::State& state, bool sharing, bool compress, AllocKind kind) {
  constexpr bool kVmm = std::is_same_v<Cache, VmmCache>;
  triattn::bench::guarded(state, [&] {
    ModelHolder& m = model();
    const ex::ModelConfig& c = m.config;
    const cudaStream_t stream = m.backend.stream();
    triattn::CacheConfig cfg = triattn::bench::bf16_cache_config(c, kBlock, kRequests);
    cfg.max_blocks_per_seq = (kShared + kOwn + kGenerated) / kBlock + 1;
    cfg.num_blocks = kRequests * cfg.max_blocks_per_seq;  // VMM: address space; pages are mapped on demand
    if constexpr (!kVmm) cfg.num_blocks = static_cast<int>(kStaticPoolBytes / cfg.block_bytes_all_ranges());
    triattn::SelectionParams sel;
    sel.budget = compress ? kBudget : 1 << 30;
    sel.divide_length = kDivide;
    sel.prompt = triattn::PromptMode::kPinnedOnTop;
    triattn::RopeConfig rope;
    rope.style = c.rope_style;
    rope.theta = c.rope_theta;
    const triattn::QueryStats stats = triattn::bench::random_stats(c);
    const triattn::bench::RandomKvChunk chunk(c, kChunk, stream);

    for (auto _ : state) {
      TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
      const std::size_t used0 = device_used();
      Cache cache(cfg, triattn::cuda::DeviceCompactor(stream),
                  triattn::cuda::TriAttentionDeviceScorer(stats, rope, triattn::ScoringParams{}, c.n_kv_heads, stream),
                  triattn::TopKSelector(sel));
      triattn::cuda::DeviceRounds<Cache> rounds(cache);
      const auto wall0 = std::chrono::steady_clock::now();
      auto& mem = cache.allocator();
      std::size_t peak_used = used0, peak_ledger = 0;
      std::int64_t prefill = 0, hit = 0, n_rounds = 0;
      double rounds_ms = 0.0, commit_ms = 0.0, launch_host_ms = 0.0, max_call_ms = 0.0;
      std::int64_t round_calls = 0;
      int generated = 0;
      std::string where = "prefill";
      const std::size_t block_bytes = static_cast<std::size_t>(cfg.block_bytes_all_ranges());
      auto kv_bytes = [&] {
        if constexpr (kVmm) return mem.bytes_resident();
        else return mem.blocks_held() * block_bytes;  // a static pool is resident as a whole: count the blocks held
      };
      auto sample = [&] {
        if constexpr (kVmm) {
          (void)mem.trim(stream, kind == AllocKind::kVmmLazy ? kLazyKeepBytes : 0);
          mem.synchronize();
        }
        TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
        peak_used = std::max(peak_used, device_used());
        peak_ledger = std::max(peak_ledger, kv_bytes());
      };
      auto full = [&] {
        throw std::runtime_error("out of device memory in " + where + " (generated " + std::to_string(generated) +
                                 "): KV held " + std::to_string(static_cast<double>(kv_bytes()) / kGiB) +
                                 " GiB, device used " + std::to_string(static_cast<double>(device_used()) / kGiB) + " GiB");
      };
      cudaEvent_t e0, e1;
      TRIATTN_BENCH_CUDA(cudaEventCreate(&e0));
      TRIATTN_BENCH_CUDA(cudaEventCreate(&e1));
      auto timed = [&](auto&& f) {
        TRIATTN_BENCH_CUDA(cudaEventRecord(e0, stream));
        f();
        TRIATTN_BENCH_CUDA(cudaEventRecord(e1, stream));
        TRIATTN_BENCH_CUDA(cudaEventSynchronize(e1));
        float ms = 0.f;
        TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        return static_cast<double>(ms);
      };
      auto run_rounds = [&](std::span<const SeqId> seqs) {
        if (!compress) return;
        // Launch (device score, select, compact) timed on the stream and on the host, then the
        // host's commit (the round's event has completed by then: timed() synchronised behind it).
        double launch_host = 0.0;
        const double t = timed([&] {
          const auto l0 = std::chrono::steady_clock::now();
          (void)rounds.compress_if_needed(seqs, stream);
          launch_host = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0).count();
        });
        const auto h0 = std::chrono::steady_clock::now();
        n_rounds += static_cast<std::int64_t>(rounds.wait().size());
        const double commit = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
        rounds_ms += t;
        commit_ms += commit;
        launch_host_ms += launch_host;
        max_call_ms = std::max(max_call_ms, launch_host + commit);
        ++round_calls;
      };

      // Prefill: request 0 first; with sharing the others find its prompt's full blocks cached.
      std::vector<std::int32_t> shared(kShared);
      std::iota(shared.begin(), shared.end(), 1000);
      std::vector<SeqId> seqs;
      std::vector<int> tokens;
      for (int r = 0; r < kRequests; ++r) {
        std::vector<std::int32_t> prompt = shared;
        for (int i = 0; i < kOwn; ++i) prompt.push_back(20000 + r * kOwn + i);
        SeqId s = -1;
        int cached = 0;
        if (sharing) {
          const triattn::PrefixAdmission a = triattn::admit_prompt(cache, prompt);
          s = a.seq;
          cached = a.cached_tokens;
        } else {
          s = cache.add_sequence();
        }
        for (int t = cached; t < static_cast<int>(prompt.size()); t += kChunk)
          triattn::bench::append_chunk(cache, s, chunk, std::min(kChunk, static_cast<int>(prompt.size()) - t),
                                       triattn::Phase::kPrefill, stream, full);
        if (sharing) (void)triattn::publish_prompt(cache, s, prompt);
        prefill += static_cast<std::int64_t>(prompt.size()) - cached;
        hit += cached;
        seqs.push_back(s);
        tokens.push_back((r * 7919 + 13) % c.vocab_size);
        sample();
      }

      // Decode: timed model windows, random K/V appends in between, rounds and trims every step.
      where = "decode";
      std::vector<double> tok_s;
      for (const int w : kWindowStarts) {
        for (; generated < w; generated += kStep) {
          for (const SeqId s : seqs) triattn::bench::append_chunk(cache, s, chunk, kStep, triattn::Phase::kDecode, stream, full);
          run_rounds(seqs);
          sample();
        }
        double ms = 0.0, host_ms = 0.0;
        const ex::CudaBackend::Stats before = m.backend.stats();
        for (int i = 0; i < kWindow; ++i) {
          try {
            ms += timed([&] {
              const auto h0 = std::chrono::steady_clock::now();
              m.decoder->step(cache, std::span<const SeqId>(seqs), std::span<const int>(tokens));
              host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
              tokens = m.decoder->argmax();
            });
          } catch (const ex::OutOfKvBlocks&) {
            full();
          }
          ++generated;
          run_rounds(seqs);
          sample();
        }
        tok_s.push_back(kRequests * kWindow * 1e3 / ms);
        const ex::CudaBackend::Stats after = m.backend.stats();
        const std::string at = std::to_string(w);
        state.counters["captures_" + at] = static_cast<double>(after.graph_captures - before.graph_captures);
        state.counters["replays_" + at] = static_cast<double>(after.graph_replays - before.graph_replays);
        state.counters["step_host_ms_" + at] = host_ms / kWindow;
        state.counters["step_ms_" + at] = ms / kWindow;
      }
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      state.counters["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
      state.counters["peak_kv_GiB"] = static_cast<double>(peak_used - used0) / kGiB;
      state.counters["peak_ledger_GiB"] = static_cast<double>(peak_ledger) / kGiB;
      state.counters["device_used_GiB"] = static_cast<double>(peak_used) / kGiB;
      state.counters["prefill_tokens"] = static_cast<double>(prefill);
      state.counters["hit_tokens"] = static_cast<double>(hit);
      state.counters["rounds"] = static_cast<double>(n_rounds);
      state.counters["rounds_ms"] = rounds_ms;
      state.counters["commit_ms"] = commit_ms;
      state.counters["launch_host_ms"] = launch_host_ms;
      state.counters["round_calls"] = static_cast<double>(round_calls);
      state.counters["max_round_call_ms"] = max_call_ms;
      state.counters["tok_s_0"] = tok_s[0];
      state.counters["tok_s_2048"] = tok_s[1];
      state.counters["tok_s_4080"] = tok_s[2];
      for (const SeqId s : seqs) cache.release(s);
    }
    state.SetLabel(std::string(sharing ? "prefix sharing" : "no sharing") + (compress ? " + compression" : ", no compression") +
                   (kind == AllocKind::kVmmEager ? ", VMM eager trim" : kind == AllocKind::kVmmLazy ? ", VMM lazy trim" : ", static pool"));
  });
}

void BM_PrefixWorkloadGpu(benchmark::State& state) {
  const bool sharing = state.range(0) != 0, compress = state.range(1) != 0;
  const auto kind = static_cast<AllocKind>(state.range(2));
  if (kind == AllocKind::kStatic) run_workload<StaticCache>(state, sharing, compress, kind);
  else run_workload<VmmCache>(state, sharing, compress, kind);
}
BENCHMARK(BM_PrefixWorkloadGpu)
    ->ArgNames({"sharing", "compress", "alloc"})
    ->Args({1, 1, 0})
    ->Args({0, 1, 0})
    ->Args({1, 0, 0})
    ->Args({0, 0, 0})
    ->Args({1, 1, 1})
    ->Args({1, 1, 2})
    ->Iterations(1)
    ->Unit(benchmark::kSecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  triattn::bench::synthetic_model_slot().reset();  // device memory goes back before the CUDA runtime shuts down
  return 0;
}

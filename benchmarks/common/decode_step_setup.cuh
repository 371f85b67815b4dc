// SPDX-License-Identifier: Apache-2.0
// Set-up shared by the decode-step benchmarks of the reference transformer: random K/V chunks
// written with triattn's append kernel, and a compressed cache filled to a logical length without
// a decode step per token (bench_decode_step.cu's scenario, for any model shape or rank shard),
// and the pieces both benchmarks' bodies share. Benchmark code: failures print and exit, except
// where a caller passes its own handler for a full KV pool.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <random>
#include <span>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/device_kv_cache.cuh>

#include "common/cuda_event_timer.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>

namespace triattn::bench {

/// The compressed scenario of the decode-step benchmarks (bench_decode_step.cu's header comment).
namespace decode_scenario {
inline constexpr int kLogical = 32768;      // logical length: RoPE positions and round starts
inline constexpr int kBudget = 2048;        // TriAttention budget
inline constexpr int kDivide = 128;         // divide_length
inline constexpr int kChunk = 2048;         // tokens per fill chunk
inline constexpr int kBlock = 16;           // tokens per KV block
inline constexpr std::uint64_t kSeed = 42;  // synthetic weights
}  // namespace decode_scenario

/// CudaBackend options of the benchmarks: bf16 weight matrices, everything else the default.
inline triattn_example::CudaBackendOptions bf16_backend_options() {
  triattn_example::CudaBackendOptions o;
  o.weights = triattn_example::WeightType::kBF16;
  return o;
}

/// The Qwen3-8B-like synthetic model with bf16 weights generated on the device (kSeed), driven
/// by a DeviceDecoder; made once per process by synthetic_model().
struct SyntheticModel {
  triattn_example::CudaBackend backend{bf16_backend_options()};
  triattn_example::ModelConfig config = triattn_example::synthetic_config("qwen3-8b-like");
  std::unique_ptr<triattn_example::DeviceDecoder> decoder;
  SyntheticModel() {
    decoder = std::make_unique<triattn_example::DeviceDecoder>(config, backend,
                                                               backend.generate_synthetic(config, decode_scenario::kSeed));
    std::fprintf(stderr, "%s, %.2f GB of bf16 weights on the device (%.2f GB read per step)\n", config.name.c_str(),
                 static_cast<double>(decoder->weights().bytes()) * 1e-9,
                 static_cast<double>(decoder->weights().bytes_per_step()) * 1e-9);
  }
};
/// The process's model slot: reset it before main returns (device memory must go back before the
/// CUDA runtime shuts down).
inline std::unique_ptr<SyntheticModel>& synthetic_model_slot() {
  static std::unique_ptr<SyntheticModel> m;
  return m;
}
inline SyntheticModel& synthetic_model() {
  auto& m = synthetic_model_slot();
  if (!m) m = std::make_unique<SyntheticModel>();
  return *m;
}

/// Random query statistics in the model's shape (the rounds' cost does not depend on their values).
inline triattn::QueryStats random_stats(const triattn_example::ModelConfig& c) {
  std::mt19937 rng(1234);
  return triattn::random_query_stats(rng, c.n_layers, c.n_heads, c.head_dim, c.rope_style, c.name);
}

/// A bf16 NHD cache of `c`'s geometry for `max_seqs` sequences; the caller sets num_blocks and
/// max_blocks_per_seq.
inline triattn::CacheConfig bf16_cache_config(const triattn_example::ModelConfig& c, int block_size, int max_seqs) {
  triattn::CacheConfig cfg;
  cfg.model = c.geometry();
  cfg.block_size = block_size;
  cfg.dtype = triattn::DType::kBF16;
  cfg.layout = triattn::KvLayout::kNHD;
  cfg.max_seqs = max_seqs;
  return cfg;
}

/// K/V of `tokens` tokens for every layer of `c` ([L, tokens, Hkv, d] bf16 each), random, on the
/// current device. (Values do not matter for timing; only the shape does.)
struct RandomKvChunk {
  triattn_example::cuda_detail::DeviceMem k, v;
  int tokens = 0;
  RandomKvChunk(const triattn_example::ModelConfig& c, int n_tokens, cudaStream_t s) : tokens(n_tokens) {
    const std::size_t n = static_cast<std::size_t>(c.n_layers) * static_cast<std::size_t>(n_tokens) *
                          static_cast<std::size_t>(c.kv_dim());
    k = triattn_example::cuda_detail::device_alloc(n * 2);
    v = triattn_example::cuda_detail::device_alloc(n * 2);
    triattn_example::gpu::synth_fill_kernel<__nv_bfloat16>
        <<<4096, 256, 0, s>>>(static_cast<__nv_bfloat16*>(k.get()), n, 7, 100, 1.7320508f, 0.0f);
    triattn_example::gpu::synth_fill_kernel<__nv_bfloat16>
        <<<4096, 256, 0, s>>>(static_cast<__nv_bfloat16*>(v.get()), n, 7, 101, 1.7320508f, 0.0f);
    TRIATTN_BENCH_CUDA(cudaGetLastError());
  }
  [[nodiscard]] const triattn::bf16_storage* kp() const { return static_cast<const triattn::bf16_storage*>(k.get()); }
  [[nodiscard]] const triattn::bf16_storage* vp() const { return static_cast<const triattn::bf16_storage*>(v.get()); }
};

/// Keeps slots [0, keep) of every (layer, KV head): cuts a sequence back without moving data.
inline triattn::KeepPlan prefix_plan(int layers, int kv_heads, int keep) {
  triattn::KeepPlan p(layers, kv_heads, keep);
  for (int l = 0; l < layers; ++l)
    for (int g = 0; g < kv_heads; ++g)
      for (int i = 0; i < keep; ++i) p.row(l, g)[i] = i;
  return p;
}

/// What the fill functions do by default when the KV pool has no room: print and exit. A caller
/// may pass another handler (one that throws, say); it must not return.
struct ExitWhenPoolFull {
  [[noreturn]] void operator()() const {
    std::fprintf(stderr, "decode-step benchmark: the KV pool is too small\n");
    std::exit(1);
  }
};

/// Appends n tokens of `chunk` to `seq` (a bf16 device cache); on_full() when the pool is full.
template <class Cache, class OnFull = ExitWhenPoolFull>
void append_chunk(Cache& cache, triattn::SeqId seq, const RandomKvChunk& chunk, int n, triattn::Phase phase,
                  cudaStream_t stream, OnFull on_full = {}) {
  if (!triattn::cuda::append_tokens(cache, seq, chunk.kp(), chunk.vp(), n, stream, phase).ok()) on_full();
}

/// A compressed sequence at logical length `logical` that caches prefix.keep slots: one chunk is
/// appended, then the sequence is extended by chunk.tokens and cut back to the prefix (no data
/// moves) until the logical position is `logical`. The cache needs room for prefix.keep + one chunk;
/// on_full() when it has none.
template <class Cache, class OnFull = ExitWhenPoolFull>
void fill_compressed(Cache& cache, triattn::SeqId seq, const RandomKvChunk& chunk, int logical,
                     const triattn::KeepPlan& prefix, cudaStream_t stream, OnFull on_full = {}) {
  append_chunk(cache, seq, chunk, chunk.tokens, triattn::Phase::kDecode, stream, on_full);
  for (int t = chunk.tokens; t < logical; t += chunk.tokens) {
    if (!cache.extend(seq, chunk.tokens, triattn::Phase::kDecode).ok()) on_full();
    cache.apply_keep_plan(seq, prefix);  // cached prefix.keep, logical + chunk.tokens
  }
}

/// Cuts every sequence of `seqs` holding more than prefix.keep tokens back to its prefix (the
/// logical position keeps growing; no data moves).
template <class Cache>
void rewind_to_prefix(Cache& cache, std::span<const triattn::SeqId> seqs, const triattn::KeepPlan& prefix) {
  for (triattn::SeqId s : seqs)
    if (cache.physical_length(s) > prefix.keep) cache.apply_keep_plan(s, prefix);
}

/// Mean cached (physical) length of `seqs`.
template <class Cache>
double mean_cached_len(const Cache& cache, std::span<const triattn::SeqId> seqs) {
  double t = 0;
  for (triattn::SeqId s : seqs) t += cache.physical_length(s);
  return t / static_cast<double>(seqs.size());
}

/// Runs a benchmark body, turning exceptions (no GPU, out of memory, NCCL) into a skipped
/// benchmark with the error.
template <class F>
void guarded(benchmark::State& state, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// Waits for `stop`, reports the time from `start` to it as the iteration's (manual) time and
/// returns it in seconds.
inline double time_iteration(benchmark::State& state, cudaEvent_t start, cudaEvent_t stop) {
  TRIATTN_BENCH_CUDA(cudaEventSynchronize(stop));
  float ms = 0.f;
  TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  state.SetIterationTime(static_cast<double>(ms) * 1e-3);
  return static_cast<double>(ms) * 1e-3;
}

}  // namespace triattn::bench

// SPDX-License-Identifier: Apache-2.0
// Set-up shared by the decode-step benchmarks of the reference transformer: random K/V chunks
// written with triattn's append kernel, and a compressed cache filled to a logical length without
// a decode step per token (bench_decode_step.cu's scenario, for any model shape or rank shard).
// Benchmark code: failures print and exit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/cuda/device_kv_cache.cuh>

#include "common/cuda_event_timer.hpp"

#include "../examples/reference_transformer/cuda_backend.cuh"

namespace triattn::bench {

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

/// Appends n tokens of `chunk` to `seq` (a bf16 device cache); exits when the pool is full.
template <class Cache>
void append_chunk(Cache& cache, triattn::SeqId seq, const RandomKvChunk& chunk, int n, triattn::Phase phase,
                  cudaStream_t stream) {
  if (!triattn::cuda::append_tokens(cache, seq, chunk.kp(), chunk.vp(), n, stream, phase).ok()) {
    std::fprintf(stderr, "decode-step benchmark: the KV pool is too small\n");
    std::exit(1);
  }
}

/// A compressed sequence at logical length `logical` that caches prefix.keep slots: one chunk is
/// appended, then the sequence is extended by chunk.tokens and cut back to the prefix (no data
/// moves) until the logical position is `logical`. The cache needs room for prefix.keep + one chunk.
template <class Cache>
void fill_compressed(Cache& cache, triattn::SeqId seq, const RandomKvChunk& chunk, int logical,
                     const triattn::KeepPlan& prefix, cudaStream_t stream) {
  append_chunk(cache, seq, chunk, chunk.tokens, triattn::Phase::kDecode, stream);
  for (int t = chunk.tokens; t < logical; t += chunk.tokens) {
    if (!cache.extend(seq, chunk.tokens, triattn::Phase::kDecode).ok()) {
      std::fprintf(stderr, "decode-step benchmark: the KV pool is too small\n");
      std::exit(1);
    }
    cache.apply_keep_plan(seq, prefix);  // cached prefix.keep, logical + chunk.tokens
  }
}

}  // namespace triattn::bench

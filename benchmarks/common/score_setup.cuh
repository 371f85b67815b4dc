// SPDX-License-Identifier: Apache-2.0
// The paged cache and scorer of the score benchmarks (bench_score): one layer
// group of bf16 keys, d = 128, in shuffled blocks, a TriAttentionDeviceScorer on random
// statistics, and a timed loop that rotates over the sequences so the L2 never holds their K.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/algorithms/score.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace triattn::bench::score_setup {

using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::device_alloc;
using triattn::bench::upload;
constexpr int kHeadDim = 128;

/// Keeps one thread busy for `ns` nanoseconds of GPU time: launched before a timed launch, it
/// lets the host enqueue the start event and the launch while the GPU is busy, so the measured
/// time is GPU time only (bench_score's `queued`).
__global__ void gpu_delay(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
constexpr unsigned long long kDelayNs = 30000;

inline QueryStats random_stats(int L, int Hq, int d) {
  std::mt19937 rng(5);
  return random_query_stats(rng, L, Hq, d, RopeStyle::kHalf, "bench");
}

/// A device cache of `seqs` sequences x `len` tokens with shuffled blocks, plus a scorer.
struct Setup {
  int L, Hq, Hkv, len, seqs, bs;
  BlockLayout bl;
  int per_seq, blocks;
  T* data = nullptr;
  std::int32_t *tables = nullptr, *lens = nullptr, *seq_ids = nullptr;
  std::int64_t* t0 = nullptr;
  float* scores = nullptr;
  std::unique_ptr<cuda::TriAttentionDeviceScorer> scorer;

  Setup(int L_, int Hq_, int Hkv_, int len_, int seqs_, int bs_, KvLayout layout, Aggregation agg, int batch,
        bool disable_trig = false, bool shuffle_blocks = true)
      : L(L_), Hq(Hq_), Hkv(Hkv_), len(len_), seqs(seqs_), bs(bs_), bl{layout, bs_, Hkv_, kHeadDim} {
    per_seq = (len + bs - 1) / bs;
    blocks = seqs * per_seq;
    const std::size_t elems = 2ull * L * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(bl.block_elems());
    data = device_alloc<T>(elems);
    bench::fill_gaussian_bf16<<<2048, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 7);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
    for (int i = 0; i < blocks; ++i) ids[static_cast<std::size_t>(i)] = i;
    if (shuffle_blocks)  // else each sequence's blocks lie in order, one contiguous range
      std::shuffle(ids.begin(), ids.end(), std::mt19937(3));  // row s = blocks [s*per_seq, (s+1)*per_seq)
    tables = upload(ids);
    lens = upload(std::vector<std::int32_t>(static_cast<std::size_t>(seqs), len));
    std::vector<std::int32_t> sid(static_cast<std::size_t>(seqs) + batch);
    for (std::size_t i = 0; i < sid.size(); ++i) sid[i] = static_cast<std::int32_t>(i % seqs);
    seq_ids = upload(sid);
    t0 = upload(std::vector<std::int64_t>(sid.size(), static_cast<std::int64_t>(len) + 100000));
    scores = device_alloc<float>(static_cast<std::size_t>(batch) * L * Hq * len);
    RopeConfig rope;
    rope.theta = 1e6;
    ScoringParams sp;
    sp.aggregation = agg;
    sp.disable_trig = disable_trig;
    scorer = std::make_unique<cuda::TriAttentionDeviceScorer>(random_stats(L, Hq, kHeadDim), rope, sp, Hkv);
    TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  }
  ~Setup() {
    for (void* p : {static_cast<void*>(data), static_cast<void*>(tables), static_cast<void*>(lens),
                    static_cast<void*>(seq_ids), static_cast<void*>(t0), static_cast<void*>(scores)})
      cudaFree(p);
  }
  KvCacheView<T, std::int32_t> view() const {
    return KvCacheView<T, std::int32_t>::contiguous(data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, L,
                                                    blocks, seqs, per_seq, tables, lens);
  }
  /// The timed loop of the rotating benchmarks: iteration k launches launch(batch) on sequence
  /// k % seqs (so L2 never holds its K), after a GPU spin kernel when `queued`.
  template <class Launch>
  void time_rotating(benchmark::State& state, cudaStream_t stream, bool queued, Launch&& launch) const {
    int i = 0;
    for (auto _ : state) {
      const cuda::ScoreBatch batch{seq_ids + i, t0 + i, 1, len};
      i = (i + 1) % seqs;
      if (queued) gpu_delay<<<1, 1, 0, stream>>>(kDelayNs);
      CudaEventTimer timer(state, stream);
      launch(batch);
    }
  }
  /// Bytes one scoring of `batch` sequences moves at least.
  double bytes(int batch) const {
    const double tokens = static_cast<double>(batch) * L * len;
    return tokens * Hkv * kHeadDim * sizeof(T) + tokens * Hq * sizeof(float) +
           static_cast<double>(batch) * L * Hkv * per_seq * sizeof(std::int32_t);
  }
};

}  // namespace triattn::bench::score_setup

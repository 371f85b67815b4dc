// SPDX-License-Identifier: Apache-2.0
// A whole TriAttention compression round on the device (cuda::compression_round::run: score →
// normalise → reduce → select → compact) for Qwen3-8B-shaped sequences: 36 layers, 32 query /
// 8 KV heads, head_dim 128, bf16, page size 16, 2,560 → 2,048 tokens (budget 2,048, per_head),
// batch 1 / 8 / 32, end to end including compaction (target <= 250 µs at batch 1). Also the
// round without compaction (plan only) and the same round replayed from a CUDA graph.
// L2 is flushed before every iteration. floor_us = K read at 4.49 TB/s + the moved K/V head
// vectors copied at 4.25 TB/s (read + write), counted from the round's own plan.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;
using triattn::bench::upload;

using triattn::bench::kCopyRoofline;
using triattn::bench::kReadRoofline;
constexpr int kL = 36, kHq = 32, kHkv = 8, kD = 128, kLen = 2560, kBudget = 2048, kPage = 16;

QueryStats random_stats() {
  std::mt19937 rng(5);
  return random_query_stats(rng, kL, kHq, kD, RopeStyle::kHalf, "bench");
}

/// args: batch, variant (0 full round, 1 plan only, 2 full round replayed from a CUDA graph)
void BM_compression_round(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int variant = static_cast<int>(state.range(1));
  const BlockLayout bl{KvLayout::kNHD, kPage, kHkv, kD};
  const int per_seq = kLen / kPage, blocks = batch * per_seq;
  const std::size_t elems = 2ull * kL * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(bl.block_elems());
  T* data = device_alloc<T>(elems);
  bench::fill_gaussian_bf16<<<2048, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 13);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  for (int i = 0; i < blocks; ++i) ids[static_cast<std::size_t>(i)] = i;
  std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
  std::vector<std::int32_t> seq_ids(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) seq_ids[static_cast<std::size_t>(b)] = b;
  std::int32_t* d_tables = upload(ids);
  std::int32_t* d_lens = upload(std::vector<std::int32_t>(static_cast<std::size_t>(batch), kLen));
  std::int32_t* d_seq = upload(seq_ids);
  std::int32_t* d_prompts = upload(std::vector<std::int32_t>(static_cast<std::size_t>(batch), 0));
  std::int64_t* d_t0 = upload(std::vector<std::int64_t>(static_cast<std::size_t>(batch), 41000));
  const KvCacheView<T, std::int32_t> view{data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, kL,
                                          blocks, batch, per_seq, d_tables, d_lens};
  RopeConfig rope;
  rope.theta = 1e6;
  cuda::TriAttentionDeviceScorer scorer(random_stats(), rope, ScoringParams{}, kHkv);
  SelectionParams sp;
  sp.budget = kBudget;
  sp.mode = PruningMode::kPerHead;
  const cuda::DeviceSelectParams dp(sp);
  const cuda::RoundShape shape{kL, kHq, kHkv};
  const int max_keep = kBudget;  // rounds here always keep exactly the budget
  std::int32_t* kept = device_alloc<std::int32_t>(static_cast<std::size_t>(batch) * kL * kHkv * max_keep);
  std::int32_t* keep = device_alloc<std::int32_t>(static_cast<std::size_t>(batch));
  const std::size_t ws_bytes = cuda::compression_round::workspace_size(shape, sp.mode, batch, kLen);
  void* ws = device_alloc<char>(ws_bytes);
  const cuda::RoundBatch rb{d_seq, d_t0, d_prompts, batch, kLen};
  const cuda::DeviceKeepPlanView plan{kept, keep, max_keep};
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto round = [&] {
    if (variant == 1)
      TRIATTN_BENCH_CUDA(
          cuda::compression_round::plan(view, scorer.device_model(), dp, rb, plan, ws, ws_bytes, stream));
    else
      TRIATTN_BENCH_CUDA(cuda::compression_round::run(view, scorer.device_model(), dp, rb, plan, ws, ws_bytes, stream));
  };
  round();  // warm-up, and the plan whose moves the floor counts
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::int32_t> h_kept(static_cast<std::size_t>(batch) * kL * kHkv * max_keep);
  TRIATTN_BENCH_CUDA(cudaMemcpy(h_kept.data(), kept, h_kept.size() * 4, cudaMemcpyDeviceToHost));
  double moved = 0;
  for (std::size_t i = 0; i < h_kept.size(); ++i) moved += h_kept[i] != static_cast<std::int32_t>(i % max_keep);

  cudaGraphExec_t exec = nullptr;
  if (variant == 2) {
    cudaGraph_t graph = nullptr;
    TRIATTN_BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    round();
    TRIATTN_BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    TRIATTN_BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    TRIATTN_BENCH_CUDA(cudaGraphDestroy(graph));
    TRIATTN_BENCH_CUDA(cudaGraphLaunch(exec, stream));
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  L2Flusher flush;
  // Every iteration re-scores the (already compacted) 2,560 slots: the same amount of work.
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    if (variant == 2) TRIATTN_BENCH_CUDA(cudaGraphLaunch(exec, stream));
    else round();
  }
  const double k_bytes = static_cast<double>(batch) * kL * kHkv * kLen * kD * sizeof(T);
  const double move_bytes = variant == 1 ? 0.0 : moved * 2 /*K,V*/ * 2 /*rd,wr*/ * kD * sizeof(T);
  const double floor_s = k_bytes / kReadRoofline + move_bytes / kCopyRoofline;
  state.SetBytesProcessed(static_cast<std::int64_t>(k_bytes + move_bytes) * state.iterations());
  state.counters["GB/s"] =
      benchmark::Counter((k_bytes + move_bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["floor_us"] = floor_s * 1e6;
  state.counters["pct_of_floor"] = benchmark::Counter(floor_s * 100.0, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_read_roofline"] =
      benchmark::Counter(k_bytes / kReadRoofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["moved_frac"] = moved / static_cast<double>(h_kept.size());
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(data), static_cast<void*>(d_tables), static_cast<void*>(d_lens),
                  static_cast<void*>(d_seq), static_cast<void*>(d_prompts), static_cast<void*>(d_t0),
                  static_cast<void*>(kept), static_cast<void*>(keep), ws})
    cudaFree(p);
}

}  // namespace

BENCHMARK(BM_compression_round)
    ->ArgNames({"batch", "variant"})
    ->ArgsProduct({{1, 8, 32}, {0, 1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

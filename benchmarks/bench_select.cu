// SPDX-License-Identifier: Apache-2.0
// The selection half of a round at Qwen3-8B shape (36 layers, 32 query / 8 KV heads): per-row
// z-normalisation statistics (cuda::row_stats), normalise + GQA/layer reduction
// (cuda::gqa_reduce) and top-k selection into the device keep plan (cuda::select_keep), each
// alone and all three, for per_head / per_layer_per_head / union, 2,560 tokens (budget 2,048;
// batch 1, 8, 32) and 32,768 tokens (batch 1). Inputs are random raw scores. L2 is flushed
// before every iteration (pessimistic: in a real round the scores were just written and are
// partly L2-resident). Bytes = what each stage must read and write at least.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/algorithms/normalize.cuh>
#include <triattn/cuda/algorithms/select.cuh>

namespace {

using namespace triattn;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;
using triattn::bench::upload;

using triattn::bench::kReadRoofline;
constexpr int kL = 36, kHq = 32, kHkv = 8, kBudget = 2048;

__global__ void fill_scores(float* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t x = bench::hash_index(i, seed);
    p[i] = 10.0f + 3.0f * (static_cast<float>(x) * (1.0f / 4294967296.0f) - 0.5f);
  }
}

/// args: batch, tokens, mode (0 per_head, 1 per_layer_per_head, 2 union), stage (0 stats,
/// 1 reduce, 2 select, 3 all)
void BM_select(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int T = static_cast<int>(state.range(1));
  const PruningMode mode = static_cast<PruningMode>(state.range(2));
  const int stage = static_cast<int>(state.range(3));
  const cuda::RoundShape shape{kL, kHq, kHkv};
  const int rr = cuda::reduced_rows(shape, mode);
  const std::size_t rows = static_cast<std::size_t>(batch) * kL * kHq;
  float* scores = device_alloc<float>(rows * T);
  float* reduced = device_alloc<float>(static_cast<std::size_t>(batch) * rr * T);
  auto* stats = device_alloc<cuda::RowStats>(rows);
  auto* flags = device_alloc<std::uint8_t>(static_cast<std::size_t>(batch) * T);
  auto* kept = device_alloc<std::int32_t>(static_cast<std::size_t>(batch) * kL * kHkv * T);
  auto* keep = device_alloc<std::int32_t>(static_cast<std::size_t>(batch));
  fill_scores<<<2048, 256>>>(scores, rows * T, 9);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) ids[static_cast<std::size_t>(b)] = b;
  std::int32_t* d_ids = upload(ids);
  std::int32_t* d_lens = upload(std::vector<std::int32_t>(static_cast<std::size_t>(batch), T));
  std::int32_t* d_prompts = upload(std::vector<std::int32_t>(static_cast<std::size_t>(batch), 0));
  SelectionParams sp;
  sp.budget = kBudget;
  sp.mode = mode;
  const SelectionParams dp = sp;
  const cuda::RoundSeqs<std::int32_t> seqs{d_ids, d_lens, d_prompts, batch, T};
  const cuda::DeviceKeepPlanView plan{kept, keep, T};
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto run_stats = [&] { TRIATTN_BENCH_CUDA(cuda::row_stats(scores, stats, seqs, dp, shape, stream)); };
  const auto run_reduce = [&] {
    TRIATTN_BENCH_CUDA(cuda::gqa_reduce(scores, stats, reduced, flags, seqs, dp, shape, stream));
  };
  const auto run_select = [&] {
    TRIATTN_BENCH_CUDA(cuda::select_keep(scores, reduced, flags, plan, seqs, dp, shape, stream));
  };
  run_stats();
  run_reduce();
  run_select();
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    if (stage == 0 || stage == 3) run_stats();
    if (stage == 1 || stage == 3) run_reduce();
    if (stage == 2 || stage == 3) run_select();
  }
  const double score_bytes = static_cast<double>(rows) * T * sizeof(float);
  const double red_bytes = static_cast<double>(batch) * rr * T * sizeof(float);
  const double plan_bytes = static_cast<double>(batch) * kL * kHkv * kBudget * sizeof(std::int32_t);
  double bytes = 0;
  if (stage == 0 || stage == 3) bytes += score_bytes;
  if (stage == 1 || stage == 3) bytes += score_bytes * (mode == PruningMode::kUnion ? 2 : 1) + red_bytes;
  if (stage == 2 || stage == 3) bytes += (mode == PruningMode::kUnion ? score_bytes : 0) + red_bytes + plan_bytes;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_read_roofline"] =
      benchmark::Counter(bytes / kReadRoofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(scores), static_cast<void*>(reduced), static_cast<void*>(stats),
                  static_cast<void*>(flags), static_cast<void*>(kept), static_cast<void*>(keep),
                  static_cast<void*>(d_ids), static_cast<void*>(d_lens), static_cast<void*>(d_prompts)})
    cudaFree(p);
}

}  // namespace

BENCHMARK(BM_select)
    ->ArgNames({"batch", "tokens", "mode", "stage"})
    ->ArgsProduct({{1, 8, 32}, {2560}, {0, 1, 2}, {0, 1, 2, 3}})
    ->ArgsProduct({{1}, {32768}, {0, 1, 2}, {0, 1, 2, 3}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

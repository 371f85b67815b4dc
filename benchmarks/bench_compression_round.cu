// SPDX-License-Identifier: Apache-2.0
// A whole TriAttention compression round on the device (cuda::compression_round::run: score →
// normalise → reduce → select → compact) for Qwen3-8B-shaped sequences: 36 layers, 32 query /
// 8 KV heads, head_dim 128, bf16, page size 16, 2,560 → 2,048 tokens (budget 2,048, per_head),
// batch 1 / 8 / 32, end to end including compaction (target <= 250 µs at batch 1). Also the
// round without compaction (plan only) and the same round replayed from a CUDA graph. Argument
// `fp8`: 1 runs the same round on an fp8 (e4m3) cache with per-(layer, K/V, head) scales
// (issue #46's target: at most 0.6x the bf16 round's time; the floor counts 1-byte elements).
// L2 is flushed before every iteration. floor_us = K read at 4.49 TB/s + the moved K/V head
// vectors copied at 4.25 TB/s (read + write), counted from the first round's plan (moved_frac).
// Argument `restore`: 0 runs every round on the cache the previous round compacted (its first
// 2,048 slots already the kept tokens, the rest stale copies: a different, smaller set of moves,
// moved_frac_timed, counted from the last timed round's plan); 1 restores the original 2,560-token
// cache before each round (a device copy outside the timed region), so every timed round is the
// first round and the floor counts its moves.
// BM_paged_round: cuda::paged_round (the engine-facing round: trigger, non-finite check, kept
// positions and freed columns as device outputs, then compaction) on the same shape over three
// layouts in one binary, every timed round a first round (the cache restored before each):
//   layout 0 KvCache's own (KvCacheView::contiguous, page 16)
//   layout 1 vLLM FlashAttention: a tensor per layer [2, blocks, 16, 8, 128] (pointer per range)
//   layout 2 SGLang: K and V buffers per layer [slots, 8, 128], page size 1 (shuffled slots)
// and variant 0 eager, 1 replayed from a CUDA graph. Target: layouts 1 and 2 within 5% of 0.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/engine/layouts.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/engine/paged_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace {

using namespace triattn;
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

/// Slots of a keep plan [rows][max_keep] that are not their own destination (moved by compaction).
double moved_slots(const std::int32_t* d_kept, std::size_t n, int max_keep) {
  std::vector<std::int32_t> h(n);
  TRIATTN_BENCH_CUDA(cudaMemcpy(h.data(), d_kept, n * 4, cudaMemcpyDeviceToHost));
  double moved = 0;
  for (std::size_t i = 0; i < n; ++i)
    moved += h[i] != static_cast<std::int32_t>(i % static_cast<std::size_t>(max_keep));
  return moved;
}

/// The cache's data, key-like: bf16 N(0, 1.5), or fp8 of the same values at dequantisation scale
/// kFp8Scale.
constexpr float kFp8Scale = 1.0f / 64.0f;
template <class T>
void fill_cache(T* data, std::size_t elems) {
  if constexpr (std::is_same_v<T, fp8_e4m3_storage>)
    bench::fill_gaussian_fp8<<<2048, 256>>>(reinterpret_cast<std::uint8_t*>(data), elems, 13, kFp8Scale);
  else
    bench::fill_gaussian_bf16<<<2048, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 13);
}

/// args: batch, variant (0 full round, 1 plan only, 2 full round replayed from a CUDA graph),
/// restore (1: every timed round starts from the original cache)
template <class T>
void compression_round_bench(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int variant = static_cast<int>(state.range(1));
  const bool restore = state.range(2) != 0;
  const BlockLayout bl{KvLayout::kNHD, kPage, kHkv, kD};
  const int per_seq = kLen / kPage, blocks = batch * per_seq;
  const std::size_t elems = 2ull * kL * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(bl.block_elems());
  T* data = device_alloc<T>(elems);
  fill_cache(data, elems);
  T* pristine = restore ? device_alloc<T>(elems) : nullptr;  // the original cache, copied back before each round
  if (restore) TRIATTN_BENCH_CUDA(cudaMemcpy(pristine, data, elems * sizeof(T), cudaMemcpyDeviceToDevice));
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
  auto view = KvCacheView<T, std::int32_t>::contiguous(data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl,
                                                        kL, blocks, batch, per_seq, d_tables, d_lens);
  float* d_scales = nullptr;  // fp8: one scale per (layer, K/V, head)
  if constexpr (is_scaled_dtype<T>) {
    d_scales = upload(std::vector<float>(2 * kL * kHkv, kFp8Scale));
    view = view.with_scales(d_scales, kHkv);
  }
  RopeConfig rope;
  rope.theta = 1e6;
  cuda::TriAttentionDeviceScorer scorer(random_stats(), rope, ScoringParams{}, kHkv);
  SelectionParams sp;
  sp.budget = kBudget;
  sp.mode = PruningMode::kPerHead;
  const SelectionParams dp = sp;
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
  const auto restore_cache = [&] {
    if (restore)
      TRIATTN_BENCH_CUDA(cudaMemcpyAsync(data, pristine, elems * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  };
  round();  // warm-up, and the plan whose moves the floor counts
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  const std::size_t plan_slots = static_cast<std::size_t>(batch) * kL * kHkv * max_keep;
  const double moved = moved_slots(kept, plan_slots, max_keep);

  cudaGraphExec_t exec = nullptr;
  if (variant == 2) {
    restore_cache();
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
  // restore 0: every iteration re-scores the 2,560 slots the previous round left (compacted front,
  // stale tail); restore 1: the original cache each time.
  for (auto _ : state) {
    restore_cache();
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
  state.counters["moved_frac"] = moved / static_cast<double>(plan_slots);
  if (variant != 1)  // the last timed round's plan (its input was the cache the previous one left, unless restore)
    state.counters["moved_frac_timed"] = moved_slots(kept, plan_slots, max_keep) / static_cast<double>(plan_slots);
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(data), static_cast<void*>(pristine), static_cast<void*>(d_tables),
                  static_cast<void*>(d_lens), static_cast<void*>(d_seq), static_cast<void*>(d_prompts),
                  static_cast<void*>(d_t0), static_cast<void*>(d_scales),
                  static_cast<void*>(kept), static_cast<void*>(keep), ws})
    cudaFree(p);
}

/// args: batch, variant, restore as above; fp8 (0 bf16 cache, 1 fp8 e4m3 with per-head scales)
void BM_compression_round(benchmark::State& state) {
  if (state.range(3) != 0)
    compression_round_bench<fp8_e4m3_storage>(state);
  else
    compression_round_bench<bf16_storage>(state);
}

/// args: batch, layout (0 KvCache, 1 vLLM FlashAttention, 2 SGLang), variant (0 eager, 1 graph)
void BM_paged_round(benchmark::State& state) {
  using T = bf16_storage;
  const int batch = static_cast<int>(state.range(0));
  const int layout = static_cast<int>(state.range(1));
  const bool graph = state.range(2) != 0;
  const int page = layout == 2 ? 1 : kPage;
  const int per_seq = kLen / page, blocks = batch * per_seq;
  const std::int64_t dense = static_cast<std::int64_t>(page) * kHkv * kD;  // one block of one range
  const std::size_t elems = 2ull * kL * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(dense);
  T* data = device_alloc<T>(elems);
  bench::fill_gaussian_bf16<<<2048, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 13);
  T* pristine = device_alloc<T>(elems);
  TRIATTN_BENCH_CUDA(cudaMemcpy(pristine, data, elems * sizeof(T), cudaMemcpyDeviceToDevice));
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
  const std::int64_t range = static_cast<std::int64_t>(blocks) * dense;
  KvCacheView<T, std::int32_t> view;
  T** d_ranges = nullptr;
  if (layout == 0) {
    view = KvCacheView<T, std::int32_t>::contiguous(data, range, BlockLayout{KvLayout::kNHD, kPage, kHkv, kD}, kL,
                                                    blocks, batch, per_seq, d_tables, d_lens);
  } else {
    // vLLM: layer l's tensor [2, blocks, 16, H, D] at l * 2 * range, V at + range (EngineLayout);
    // SGLang: all K buffers, then all V buffers, each [slots, H, D].
    const EngineLayout el = layout == 1 ? EngineLayout::vllm_flash_attn(blocks, kPage, kHkv, kD)
                                        : EngineLayout::sglang(kHkv, kD);
    std::vector<T*> ranges(2 * kL);
    for (int l = 0; l < kL; ++l) {
      ranges[2 * l] = layout == 1 ? data + 2 * l * range : data + l * range;
      ranges[2 * l + 1] = layout == 1 ? ranges[2 * l] + el.kind_offset : data + (kL + l) * range;
    }
    d_ranges = upload(ranges);
    view = KvCacheView<T, std::int32_t>::contiguous(nullptr, 0, el.block, kL, blocks, batch, per_seq, d_tables, d_lens);
    view.ranges = d_ranges;
  }
  RopeConfig rope;
  rope.theta = 1e6;
  cuda::TriAttentionDeviceScorer scorer(random_stats(), rope, ScoringParams{}, kHkv);
  SelectionParams sp;
  sp.budget = kBudget;
  sp.mode = PruningMode::kPerHead;
  const cuda::RoundShape shape{kL, kHq, kHkv};
  const int rows = kept_rows(sp.mode, kL, kHkv);
  std::int32_t* outs = device_alloc<std::int32_t>(4 * static_cast<std::size_t>(batch));
  std::int32_t* kept = device_alloc<std::int32_t>(static_cast<std::size_t>(batch) * rows * kBudget);
  const RoundOutputs out{outs, outs + batch, outs + 2 * batch, outs + 3 * batch, kept, rows, kBudget};
  const std::size_t ws_bytes = cuda::paged_round_workspace_size(shape, sp.mode, batch, kLen, batch);
  void* ws = device_alloc<char>(ws_bytes);
  const RoundBatch rb{d_seq, d_t0, d_prompts, batch, kLen};
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto round = [&] {
    cuda::paged_round(view, scorer.device_model(), sp, RoundTrigger::kAlways, rb, out, ws, ws_bytes, stream);
  };
  const auto restore_cache = [&] {
    TRIATTN_BENCH_CUDA(cudaMemcpyAsync(data, pristine, elems * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  };
  round();  // warm-up
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::int32_t> status(static_cast<std::size_t>(batch));
  TRIATTN_BENCH_CUDA(cudaMemcpy(status.data(), outs + batch, status.size() * 4, cudaMemcpyDeviceToHost));
  for (std::int32_t st : status)
    if (st != static_cast<std::int32_t>(RoundStatus::kCompressed)) state.SkipWithError("a sequence was not compressed");
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    restore_cache();
    cudaGraph_t g = nullptr;
    TRIATTN_BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    round();
    TRIATTN_BENCH_CUDA(cudaStreamEndCapture(stream, &g));
    TRIATTN_BENCH_CUDA(cudaGraphInstantiate(&exec, g, 0));
    TRIATTN_BENCH_CUDA(cudaGraphDestroy(g));
  }
  L2Flusher flush;
  for (auto _ : state) {
    restore_cache();
    CudaEventTimer timer(state, stream, &flush);
    if (graph) TRIATTN_BENCH_CUDA(cudaGraphLaunch(exec, stream));
    else round();
  }
  const double k_bytes = static_cast<double>(batch) * kL * kHkv * kLen * kD * sizeof(T);
  state.SetBytesProcessed(static_cast<std::int64_t>(k_bytes) * state.iterations());
  state.counters["pct_read_roofline"] =
      benchmark::Counter(k_bytes / kReadRoofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(data), static_cast<void*>(pristine), static_cast<void*>(d_tables),
                  static_cast<void*>(d_lens), static_cast<void*>(d_seq), static_cast<void*>(d_prompts),
                  static_cast<void*>(d_t0), static_cast<void*>(d_ranges), static_cast<void*>(outs),
                  static_cast<void*>(kept), ws})
    cudaFree(p);
}

}  // namespace

BENCHMARK(BM_compression_round)
    ->ArgNames({"batch", "variant", "restore", "fp8"})
    ->ArgsProduct({{1, 8, 32}, {0, 1, 2}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_paged_round)
    ->ArgNames({"batch", "layout", "graph"})
    ->ArgsProduct({{1, 8, 32}, {0, 1, 2}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

// SPDX-License-Identifier: Apache-2.0
// cuda::compact on Qwen3-8B shapes: 36 layers x 8 KV heads, head_dim 128, bf16, each sequence
// compacted from 2560 to 2048 tokens with a random sorted keep set per (layer, head), a batch of
// sequences in one launch. Bytes = head vectors that change place, K and V, read + written;
// roofline = 4.25 TB/s device copy. L2 is flushed before every iteration (the pool is also
// >= 377 MB per sequence). BM_memcpy_d2d moves the same bytes with cudaMemcpyAsync.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/cuda/algorithms/compact.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;

constexpr int kLayers = 36, kKvHeads = 8, kHeadDim = 128, kLen = 2560, kKeep = 2048;

/// Random plan [batch, L, Hkv, kKeep]; returns the number of head vectors that move.
std::int64_t make_plan(int batch, std::vector<std::int32_t>& kept) {
  std::mt19937 rng(11);
  kept.resize(static_cast<std::size_t>(batch) * kLayers * kKvHeads * kKeep);
  std::vector<std::int32_t> all(kLen);
  std::int64_t moved = 0;
  for (std::size_t r = 0; r < static_cast<std::size_t>(batch) * kLayers * kKvHeads; ++r) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + kKeep);
    std::copy_n(all.begin(), kKeep, kept.begin() + static_cast<std::ptrdiff_t>(r * kKeep));
    for (int i = 0; i < kKeep; ++i) moved += all[static_cast<std::size_t>(i)] != i;
  }
  return moved;
}

/// args: batch, block_size, layout (0 NHD, 1 HND), column parts and vectors per thread
/// (cuda::CompactOptions; 0 = automatic)
void BM_compact(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int bs = static_cast<int>(state.range(1));
  const KvLayout layout = state.range(2) ? KvLayout::kHND : KvLayout::kNHD;
  const cuda::CompactOptions options{static_cast<int>(state.range(3)), static_cast<int>(state.range(4))};
  const int per_seq = (kLen + bs - 1) / bs;
  const int blocks = batch * per_seq;
  const BlockLayout bl{layout, bs, kKvHeads, kHeadDim};
  const std::size_t elems = 2ull * kLayers * blocks * static_cast<std::size_t>(bl.block_elems());
  T* data = device_alloc<T>(elems);
  bench::fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 1);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), kLen), seq_ids(static_cast<std::size_t>(batch)),
      keep(static_cast<std::size_t>(batch), kKeep), kept;
  std::iota(seq_ids.begin(), seq_ids.end(), 0);
  const std::int64_t moved = make_plan(batch, kept);
  auto upload = [](const std::vector<std::int32_t>& h) {
    std::int32_t* d = device_alloc<std::int32_t>(h.size());
    TRIATTN_BENCH_CUDA(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return d;
  };
  std::int32_t* d_tables = upload(ids);
  std::int32_t* d_lens = upload(lens);
  std::int32_t* d_seq = upload(seq_ids);
  std::int32_t* d_keep = upload(keep);
  std::int32_t* d_kept = upload(kept);
  const auto view = KvCacheView<T, std::int32_t>::contiguous(data, static_cast<std::int64_t>(blocks) * bl.block_elems(),
                                                              bl, kLayers, blocks, batch, per_seq, d_tables, d_lens);
  const cuda::CompactParams plan{d_kept, d_keep, d_seq, kKeep};
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  L2Flusher flush;
  // Repeating the same plan moves the same slots again: same bytes every iteration.
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(cuda::compact::run(view, plan, batch, stream, options));
  }
  bench::report_bandwidth(state, static_cast<double>(cuda::compact::bytes_moved<T>(moved, kHeadDim)), bench::kCopyRoofline);
  state.counters["moved_frac"] = static_cast<double>(moved) / (static_cast<double>(batch) * kLayers * kKvHeads * kKeep);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(data), static_cast<void*>(d_tables), static_cast<void*>(d_lens),
                  static_cast<void*>(d_seq), static_cast<void*>(d_keep), static_cast<void*>(d_kept)})
    cudaFree(p);
}

/// Context: cudaMemcpyAsync moving as many bytes as BM_compact/<batch> (read + write). arg: batch.
void BM_memcpy_d2d(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  std::vector<std::int32_t> kept;
  const std::int64_t moved = make_plan(batch, kept);
  const std::size_t bytes = static_cast<std::size_t>(cuda::compact::bytes_moved<T>(moved, kHeadDim) / 2);
  bench::time_device_copy(state, bytes);
}

}  // namespace

BENCHMARK(BM_compact)
    ->ArgNames({"batch", "page", "hnd", "parts", "vpt"})
    ->ArgsProduct({{1, 4, 16}, {16, 64}, {0, 1}, {0}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
// Every work split at small batches (page 16, NHD).
BENCHMARK(BM_compact)
    ->ArgNames({"batch", "page", "hnd", "parts", "vpt"})
    ->ArgsProduct({{1, 2, 4}, {16}, {0}, {1, 2}, {4, 8}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_memcpy_d2d)->ArgNames({"batch"})->Arg(1)->Arg(4)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

// SPDX-License-Identifier: Apache-2.0
// cuda::append on Qwen3-8B shapes (36 layers, 8 KV heads, head_dim 128, bf16), all layers in one
// launch: prefill of one sequence (contiguous slots through device block tables) and decode of a
// batch (one token per sequence at its last slot). Bytes = K and V read from the input plus
// written to the cache; roofline = 4.25 TB/s device copy (read + write). L2 is flushed before
// every iteration. BM_memcpy_d2d moves the same bytes with cudaMemcpyAsync for context.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/cuda/algorithms/append.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;

constexpr int kLayers = 36, kKvHeads = 8, kHeadDim = 128;

/// Paged cache for `seqs` sequences of `cap` tokens each, shuffled block tables on the device.
struct Cache {
  KvCacheView<T, std::int32_t> view{};
  T* data = nullptr;
  std::int32_t* tables = nullptr;
  std::int32_t* lens = nullptr;

  Cache(int seqs, int cap, int block_size, KvLayout layout, const std::vector<std::int32_t>& lengths) {
    const int per_seq = (cap + block_size - 1) / block_size;
    const int blocks = seqs * per_seq;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    const BlockLayout bl{layout, block_size, kKvHeads, kHeadDim};
    const std::size_t elems = 2ull * kLayers * blocks * static_cast<std::size_t>(bl.block_elems());
    data = device_alloc<T>(elems);
    bench::fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 1);
    tables = device_alloc<std::int32_t>(ids.size());
    lens = device_alloc<std::int32_t>(lengths.size());
    TRIATTN_BENCH_CUDA(cudaMemcpy(tables, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    TRIATTN_BENCH_CUDA(cudaMemcpy(lens, lengths.data(), lengths.size() * 4, cudaMemcpyHostToDevice));
    view = KvCacheView<T, std::int32_t>::contiguous(data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, kLayers,
                                                   blocks, seqs, per_seq, tables, lens);
  }
  ~Cache() {
    cudaFree(data);
    cudaFree(tables);
    cudaFree(lens);
  }
};

/// args: tokens, block_size, layout (0 NHD, 1 HND)
void BM_append_prefill(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const int bs = static_cast<int>(state.range(1));
  const KvLayout layout = state.range(2) ? KvLayout::kHND : KvLayout::kNHD;
  Cache cache(1, n, bs, layout, {n});
  const std::size_t in_elems = static_cast<std::size_t>(kLayers) * n * kKvHeads * kHeadDim;
  T* k = device_alloc<T>(in_elems);
  T* v = device_alloc<T>(in_elems);
  bench::fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(k), in_elems, 2);
  bench::fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(v), in_elems, 3);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(cuda::append::run_contiguous(cache.view, 0, 0, 0, kLayers, k, v, n, stream));
  }
  bench::report_bandwidth(state, 2.0 * 2.0 * in_elems * sizeof(T), bench::kCopyRoofline);  // K and V, read and written
  cudaStreamDestroy(stream);
  cudaFree(k);
  cudaFree(v);
}

/// args: batch, block_size. Each sequence holds 1000 tokens; the new one goes to slot 999.
void BM_append_decode(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int bs = static_cast<int>(state.range(1));
  const int len = 1000;
  Cache cache(batch, len, bs, KvLayout::kNHD, std::vector<std::int32_t>(static_cast<std::size_t>(batch), len));
  const std::size_t in_elems = static_cast<std::size_t>(kLayers) * batch * kKvHeads * kHeadDim;
  T* k = device_alloc<T>(in_elems);
  T* v = device_alloc<T>(in_elems);
  bench::fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(k), in_elems, 4);
  bench::fill_random_bf16<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(v), in_elems, 5);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(batch));
  std::iota(ids.begin(), ids.end(), 0);
  std::int32_t* d_ids = device_alloc<std::int32_t>(ids.size());
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(cuda::append::run_decode(cache.view, d_ids, 0, kLayers, k, v, batch, stream));
  }
  bench::report_bandwidth(state, 2.0 * 2.0 * in_elems * sizeof(T), bench::kCopyRoofline);
  cudaStreamDestroy(stream);
  cudaFree(k);
  cudaFree(v);
  cudaFree(d_ids);
}

/// Context: cudaMemcpyAsync device to device moving the bytes of BM_append_prefill/<tokens>
/// (counted as read + write, like the kernel). arg: tokens.
void BM_memcpy_d2d(benchmark::State& state) {
  const std::size_t bytes = 2ull * kLayers * static_cast<std::size_t>(state.range(0)) * kKvHeads * kHeadDim * sizeof(T);
  bench::time_device_copy(state, bytes);
}

}  // namespace

BENCHMARK(BM_append_prefill)
    ->ArgNames({"tokens", "page", "hnd"})
    ->ArgsProduct({{512, 2048, 8192}, {16, 64}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_append_decode)
    ->ArgNames({"batch", "page"})
    ->ArgsProduct({{1, 16, 64, 256}, {16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_memcpy_d2d)->ArgNames({"tokens"})->Arg(512)->Arg(2048)->Arg(8192)->UseManualTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

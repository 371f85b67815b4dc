// SPDX-License-Identifier: Apache-2.0
// cuda::decode_attention on Qwen3-8B shapes: GQA 32 query / 8 KV heads, head_dim 128, bf16, one
// layer, batch 1 and 16 sequences of 32768 tokens, pages of 16 and 64 (shuffled block tables),
// bf16 output. Bytes = K + V read; roofline = 4.49 TB/s (H200 pure read). L2 is flushed before
// every iteration. For context: BM_read_kernel streams the same bytes through a plain read
// kernel, BM_memcpy_d2d copies them with cudaMemcpyAsync (counted read + write, vs 4.25 TB/s).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/cuda_event_timer.hpp"

#include <triattn/core/ref/attention.hpp>
#include <triattn/cuda/algorithms/decode_attention.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr double kReadRoofline = 4.49e12;  // bytes/s, pure read
constexpr double kCopyRoofline = 4.25e12;  // bytes/s, read + write

__global__ void fill_random(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = static_cast<std::uint16_t>((x & 0x8000u) | ((126u + ((x >> 8) & 1u)) << 7) | (x & 0x7Fu));
  }
}

/// Streams n 16-byte vectors; the xor keeps the loads alive.
__global__ void read_kernel(const uint4* p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 x = __ldcs(p + i);
    acc ^= x.x ^ x.y ^ x.z ^ x.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

template <class U>
U* device_alloc(std::size_t n) {
  U* p = nullptr;
  TRIATTN_BENCH_CUDA(cudaMalloc(&p, n * sizeof(U)));
  return p;
}

void report(benchmark::State& state, double bytes, double roofline) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_roofline"] =
      benchmark::Counter(bytes / roofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
}

/// args: batch, seq_len, block_size, layout (0 NHD, 1 HND)
void BM_decode_attention(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int len = static_cast<int>(state.range(1));
  const int bs = static_cast<int>(state.range(2));
  const KvLayout layout = state.range(3) ? KvLayout::kHND : KvLayout::kNHD;
  const int per_seq = (len + bs - 1) / bs;
  const int blocks = batch * per_seq;
  const BlockLayout bl{layout, bs, kKvHeads, kHeadDim};
  const std::size_t elems = 2ull * blocks * static_cast<std::size_t>(bl.block_elems());
  T* data = device_alloc<T>(elems);
  fill_random<<<1024, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 1);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
  std::int32_t* d_tables = device_alloc<std::int32_t>(ids.size());
  std::int32_t* d_lens = device_alloc<std::int32_t>(lens.size());
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_tables, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const KvCacheView<T, std::int32_t> view{data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, 1, blocks,
                                          batch, per_seq, d_tables, d_lens};
  const std::size_t q_elems = static_cast<std::size_t>(batch) * kQHeads * kHeadDim;
  T* q = device_alloc<T>(q_elems);
  T* out = device_alloc<T>(q_elems);
  fill_random<<<64, 256>>>(reinterpret_cast<std::uint16_t*>(q), q_elems, 2);

  int resident = 0;
  TRIATTN_BENCH_CUDA(cuda::decode_attention::resident_ctas<T>(kHeadDim, &resident));
  const auto plan =
      cuda::decode_attention::make_plan(DType::kBF16, batch, kKvHeads, kQHeads / kKvHeads, len, resident);
  const std::size_t ws_bytes = cuda::decode_attention::workspace_size(plan, batch, kQHeads, kHeadDim);
  void* ws = ws_bytes ? device_alloc<char>(ws_bytes) : nullptr;
  const float scale = ref::default_sm_scale(kHeadDim);

  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(cuda::decode_attention::run(plan, view, 0, q, out, batch, kQHeads, nullptr, scale, ws, ws_bytes,
                                                   stream));
  }
  report(state, static_cast<double>(cuda::decode_attention::bytes_read(static_cast<std::int64_t>(batch) * len, kKvHeads,
                                                                       kHeadDim, sizeof(T))),
         kReadRoofline);
  state.counters["splits"] = plan.num_splits;
  state.counters["resident_ctas"] = resident;
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(data), static_cast<void*>(d_tables), static_cast<void*>(d_lens),
                  static_cast<void*>(q), static_cast<void*>(out), ws})
    cudaFree(p);
}

/// Context: a plain streaming read of the K + V bytes of BM_decode_attention/<batch>/<len>.
void BM_read_kernel(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(cuda::decode_attention::bytes_read(
      static_cast<std::int64_t>(state.range(0)) * state.range(1), kKvHeads, kHeadDim, sizeof(T)));
  uint4* src = device_alloc<uint4>(bytes / 16);
  unsigned* sink = device_alloc<unsigned>(1);
  TRIATTN_BENCH_CUDA(cudaMemset(src, 1, bytes));
  int sms = 0;
  TRIATTN_BENCH_CUDA(cuda::current_device_sm_count(&sms));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    read_kernel<<<sms * 8, 256, 0, stream>>>(src, bytes / 16, sink);
    TRIATTN_BENCH_CUDA(cudaGetLastError());
  }
  report(state, static_cast<double>(bytes), kReadRoofline);
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(sink);
}

/// Context: cudaMemcpyAsync of the same K + V bytes (counted read + write, vs the copy roofline).
void BM_memcpy_d2d(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(cuda::decode_attention::bytes_read(
      static_cast<std::int64_t>(state.range(0)) * state.range(1), kKvHeads, kHeadDim, sizeof(T)));
  char* src = device_alloc<char>(bytes);
  char* dst = device_alloc<char>(bytes);
  TRIATTN_BENCH_CUDA(cudaMemset(src, 1, bytes));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  report(state, 2.0 * bytes, kCopyRoofline);
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(dst);
}

}  // namespace

BENCHMARK(BM_decode_attention)
    ->ArgNames({"batch", "len", "page", "hnd"})
    ->ArgsProduct({{1, 16}, {32768}, {16, 64}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_read_kernel)
    ->ArgNames({"batch", "len"})
    ->ArgsProduct({{1, 16}, {32768}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_memcpy_d2d)
    ->ArgNames({"batch", "len"})
    ->ArgsProduct({{1, 16}, {32768}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The reference transformer's causal prefill attention on Qwen3-8B shapes (32 query / 8 KV
// heads, head_dim 128, bf16 cache, pages of 16, identity block table): one sequence, a chunk of
// `rows` queries after `before` cached slots. BM_prefill_tc: the tensor-core kernel
// (prefill_attention.cuh); BM_prefill_rows: attention_rows_kernel (one warp per row and head),
// the kernel it replaces for prefill steps. Counter TFLOP/s counts the causal QK and PV
// multiply-adds (2 * 2 * d per visible (row, slot, head)).
#include <benchmark/benchmark.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cuda_event_timer.hpp"

#include <reference_transformer/cuda_kernels.cuh>
#include <reference_transformer/prefill_attention.cuh>

namespace {

using T = triattn::bf16_storage;
namespace gpu = triattn_example::gpu;
constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 16;

template <class U>
U* device_alloc(std::size_t n) {
  U* p = nullptr;
  TRIATTN_BENCH_CUDA(cudaMalloc(&p, n * sizeof(U)));
  TRIATTN_BENCH_CUDA(cudaMemset(p, 0x3c, n * sizeof(U)));  // bf16 ~0.011 / fp32 ~0.011: finite
  return p;
}

struct Setup {
  int rows, before, len;
  T* pool = nullptr;
  float *q = nullptr, *out = nullptr;
  std::int32_t *tables = nullptr, *lens = nullptr, *row_seq = nullptr, *row_slot = nullptr;
  gpu::PrefillTile* tiles = nullptr;
  int n_tiles = 0;
  triattn::KvCacheView<T, std::int32_t> view;

  Setup(int r, int b) : rows(r), before(b), len(r + b) {
    const int blocks = (len + kPage - 1) / kPage;
    const triattn::BlockLayout bl(triattn::KvLayout::kNHD, kPage, kHkv, kD);
    pool = device_alloc<T>(2 * static_cast<std::size_t>(blocks) * bl.block_elems());
    q = device_alloc<float>(static_cast<std::size_t>(rows) * kHq * kD);
    out = device_alloc<float>(static_cast<std::size_t>(rows) * kHq * kD);
    std::vector<std::int32_t> tab(static_cast<std::size_t>(blocks)), seq(static_cast<std::size_t>(rows), 0),
        slot(static_cast<std::size_t>(rows));
    for (int i = 0; i < blocks; ++i) tab[static_cast<std::size_t>(i)] = i;
    for (int i = 0; i < rows; ++i) slot[static_cast<std::size_t>(i)] = before + i;
    const std::vector<gpu::PrefillTile> t = gpu::build_prefill_tiles(seq.data(), slot.data(), rows);
    n_tiles = static_cast<int>(t.size());
    tables = upload(tab);
    row_seq = upload(seq);
    row_slot = upload(slot);
    lens = upload(std::vector<std::int32_t>{len});
    tiles = upload(t);
    view = triattn::KvCacheView<T, std::int32_t>::contiguous(pool, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl,
                                                            1, blocks, 1, blocks, tables, lens);
  }
  ~Setup() {
    for (void* p : {static_cast<void*>(pool), static_cast<void*>(q), static_cast<void*>(out), static_cast<void*>(tables),
                    static_cast<void*>(lens), static_cast<void*>(row_seq), static_cast<void*>(row_slot),
                    static_cast<void*>(tiles)})
      cudaFree(p);
  }
  template <class U>
  static U* upload(const std::vector<U>& h) {
    U* p = nullptr;
    TRIATTN_BENCH_CUDA(cudaMalloc(&p, h.size() * sizeof(U)));
    TRIATTN_BENCH_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(U), cudaMemcpyHostToDevice));
    return p;
  }
  [[nodiscard]] double flops() const {
    const double visible = static_cast<double>(rows) * before + 0.5 * static_cast<double>(rows) * (rows + 1);
    return visible * kHq * 4.0 * kD;
  }
};

void BM_prefill_tc(benchmark::State& state) {
  Setup s(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  gpu::PrefillAttentionParams<T> p{};
  p.out = s.out;
  p.q = s.q;
  p.view = s.view;
  p.row_slot = s.row_slot;
  p.tiles = s.tiles;
  p.layer = 0;
  p.hq = kHq;
  p.group = kHq / kHkv;
  p.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(kD)));
  auto launch = [](auto kernel, dim3 grid, dim3 block, std::size_t smem, auto&&... args) {
    kernel<<<grid, block, smem>>>(args...);
  };
  for (auto _ : state) {
    triattn::bench::CudaEventTimer t(state, nullptr);
    gpu::run_prefill_attention(p, kD, s.n_tiles, launch);
  }
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["TFLOP/s"] = benchmark::Counter(s.flops() * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_prefill_rows(benchmark::State& state) {
  Setup s(static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  const auto view = std::bit_cast<triattn::KvCacheView<__nv_bfloat16, std::int32_t>>(s.view);
  const long long warps = static_cast<long long>(s.rows) * kHq;
  const dim3 grid(static_cast<unsigned>((warps + gpu::kAttnRowWarps - 1) / gpu::kAttnRowWarps));
  for (auto _ : state) {
    triattn::bench::CudaEventTimer t(state, nullptr);
    gpu::attention_rows_kernel<__nv_bfloat16><<<grid, gpu::kAttnRowWarps * 32>>>(
        s.out, s.q, view, 0, s.rows, kHq, kHkv, kD, s.row_seq, s.row_slot, std::sqrt(static_cast<float>(kD)));
  }
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["TFLOP/s"] = benchmark::Counter(s.flops() * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "before"})->UseManualTime()->Unit(benchmark::kMicrosecond);
  for (const int rows : {512, 2048})
    for (const int before : {0, 8192}) b->Args({rows, before});
}

BENCHMARK(BM_prefill_tc)->Apply(shapes);
BENCHMARK(BM_prefill_rows)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();

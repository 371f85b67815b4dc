// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The reference transformer's causal prefill attention, bf16 cache, identity block table: one
// sequence, a chunk of `rows` queries after `before` cached slots, pages of `page` slots.
// BM_prefill_tc: the tensor-core kernel (prefill_attention.cuh) on Qwen3-8B shapes (32 query /
// 8 KV heads, head_dim 128); BM_prefill_tc_smollm2: the same kernel on SmolLM2-135M's (9 query /
// 3 KV heads, head_dim 64: GQA group 3); BM_prefill_rows: attention_rows_kernel (one warp per
// row and head) on Qwen3-8B shapes, the kernel the tensor-core one replaces for prefill steps.
// Counter TFLOP/s counts the causal QK and PV multiply-adds (2 * 2 * d per visible (row, slot,
// head)).
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

/// Attention heads and head_dim of a model.
struct Shape {
  int hq, hkv, d;
};
constexpr Shape kQwen3{32, 8, 128}, kSmolLM2{9, 3, 64};

template <class U>
U* device_alloc(std::size_t n) {
  U* p = nullptr;
  TRIATTN_BENCH_CUDA(cudaMalloc(&p, n * sizeof(U)));
  TRIATTN_BENCH_CUDA(cudaMemset(p, 0x3c, n * sizeof(U)));  // bf16 ~0.011 / fp32 ~0.011: finite
  return p;
}

struct Setup {
  Shape sh;
  int rows, before, len;
  T* pool = nullptr;
  float *q = nullptr, *out = nullptr;
  std::int32_t *tables = nullptr, *lens = nullptr, *row_seq = nullptr, *row_slot = nullptr;
  gpu::PrefillTile* tiles = nullptr;
  int n_tiles = 0;
  triattn::KvCacheView<T, std::int32_t> view;

  Setup(Shape shape, int r, int b, int page) : sh(shape), rows(r), before(b), len(r + b) {
    const int blocks = (len + page - 1) / page;
    const triattn::BlockLayout bl(triattn::KvLayout::kNHD, page, sh.hkv, sh.d);
    pool = device_alloc<T>(2 * static_cast<std::size_t>(blocks) * bl.block_elems());
    q = device_alloc<float>(static_cast<std::size_t>(rows) * sh.hq * sh.d);
    out = device_alloc<float>(static_cast<std::size_t>(rows) * sh.hq * sh.d);
    std::vector<std::int32_t> tab(static_cast<std::size_t>(blocks)), seq(static_cast<std::size_t>(rows), 0),
        slot(static_cast<std::size_t>(rows));
    for (int i = 0; i < blocks; ++i) tab[static_cast<std::size_t>(i)] = i;
    for (int i = 0; i < rows; ++i) slot[static_cast<std::size_t>(i)] = before + i;
    const std::vector<gpu::PrefillTile> t = gpu::build_prefill_tiles(seq.data(), slot.data(), rows, sh.hq / sh.hkv);
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
    return visible * sh.hq * 4.0 * sh.d;
  }
};

void run_tc(benchmark::State& state, Shape sh) {
  Setup s(sh, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), static_cast<int>(state.range(2)));
  gpu::PrefillAttentionParams<T> p{};
  p.out = s.out;
  p.q = s.q;
  p.view = s.view;
  p.row_slot = s.row_slot;
  p.tiles = s.tiles;
  p.layer = 0;
  p.hq = sh.hq;
  p.group = sh.hq / sh.hkv;
  p.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(sh.d)));
  auto launch = [](auto kernel, dim3 grid, dim3 block, std::size_t smem, auto&&... args) {
    kernel<<<grid, block, smem>>>(args...);
  };
  for (auto _ : state) {
    triattn::bench::CudaEventTimer t(state, nullptr);
    gpu::run_prefill_attention(p, sh.d, s.n_tiles, launch);
  }
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["TFLOP/s"] = benchmark::Counter(s.flops() * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_prefill_tc(benchmark::State& state) { run_tc(state, kQwen3); }
void BM_prefill_tc_smollm2(benchmark::State& state) { run_tc(state, kSmolLM2); }

void BM_prefill_rows(benchmark::State& state) {
  Setup s(kQwen3, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), static_cast<int>(state.range(2)));
  const auto view = std::bit_cast<triattn::KvCacheView<__nv_bfloat16, std::int32_t>>(s.view);
  const long long warps = static_cast<long long>(s.rows) * kQwen3.hq;
  const dim3 grid(static_cast<unsigned>((warps + gpu::kAttnRowWarps - 1) / gpu::kAttnRowWarps));
  for (auto _ : state) {
    triattn::bench::CudaEventTimer t(state, nullptr);
    gpu::attention_rows_kernel<__nv_bfloat16><<<grid, gpu::kAttnRowWarps * 32>>>(
        s.out, s.q, view, 0, s.rows, kQwen3.hq, kQwen3.hkv, kQwen3.d, s.row_seq, s.row_slot,
        std::sqrt(static_cast<float>(kQwen3.d)));
  }
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["TFLOP/s"] = benchmark::Counter(s.flops() * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "before", "page"})->UseManualTime()->Unit(benchmark::kMicrosecond);
  for (const int page : {16, 64})
    for (const int rows : {512, 2048})
      for (const int before : {0, 8192}) b->Args({rows, before, page});
  b->Args({4096, 0, 16})->Args({8192, 24576, 16});  // a 4K prompt in one chunk; the last 8K chunk of a 32K prompt
}
void rows_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "before", "page"})->UseManualTime()->Unit(benchmark::kMicrosecond);
  for (const int rows : {512, 2048})
    for (const int before : {0, 8192}) b->Args({rows, before, 16});
}

BENCHMARK(BM_prefill_tc)->Apply(shapes);
BENCHMARK(BM_prefill_tc_smollm2)->Apply(shapes);
BENCHMARK(BM_prefill_rows)->Apply(rows_shapes);

}  // namespace

BENCHMARK_MAIN();

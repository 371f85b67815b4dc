// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// Prefill of the reference transformer on the GPU against cuBLAS on the same matmul shapes, in
// one binary (issue #48: prefill at >= 50% of the bf16 GEMM rate cuBLAS reaches in the same run).
// Model: the Qwen3-8B-like synthetic model of bench_decode_step.cu (36 layers, dim 4096, 32 q /
// 8 KV heads of 128, hidden 12288, vocab 151936; bf16 weights generated on the device), bf16 KV
// cache (NHD, 16-token blocks, one static pool), through Model<CudaBackend> as the engine runs it.
//
// BM_PrefillModel/prompt/chunk: one prompt of `prompt` random tokens prefilled in chunks of
//   `chunk` tokens (Model::forward per chunk, generate.hpp's --prefill-chunk), the classifier
//   for the last token only (what sampling the first token needs). Timed with CUDA events from
//   the first chunk's launch to the end of the last; the sequence is released after each
//   iteration. Counters:
//     tok_s          prompt tokens / time
//     TFLOPs         model FLOPs / time: 2 x non-embedding matmul parameters per token (q, k, v,
//                    o, gate, up, down of every layer) + 2 x vocab x dim once (the classifier of
//                    the last token) + causal attention 4 x head_dim x (p + 1) per token at
//                    position p, query head and layer (QK and PV)
//     attn_pct       share of the attention FLOPs in that count
//     cublas_TFLOPs  BM_CublasLayers' rate at M = chunk rows (measured in this process, before
//                    the first prefill row that needs it)
//     vs_cublas_pct  100 x TFLOPs / cublas_TFLOPs: the issue's target is >= 50
// BM_CublasLayers/chunk: the same seven GEMMs per layer as the prefill's matmuls, every layer,
//   through the engine's own cuBLAS wrapper (CublasContext::gemm_rows: bf16 weights x bf16 rows
//   -> fp32, fp32 accumulation) on the model's weights, with M = chunk rows; one iteration = one
//   pass over all 36 layers. Counter TFLOPs (and ms per pass).
// Run: build/benchmarks/bench_prefill_model --benchmark_out=prefill_model.json
//   (16.4 GB of weights + a 4.9 GiB KV pool; about a minute on an H100)
#include <benchmark/benchmark.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <triattn/cuda/device_kv_cache.cuh>

#include "common/cuda_event_timer.hpp"
#include "common/decode_step_setup.cuh"

#include <reference_transformer/cublas_context.cuh>
#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>

namespace ex = triattn_example;
using triattn::SeqId;

namespace {

constexpr int kMaxPrompt = 32768;
constexpr int kMaxChunk = 4096;
constexpr int kBlock = 16;

triattn::bench::SyntheticModel& model() { return triattn::bench::synthetic_model(); }

/// One matmul of a layer: out features M, in features K, and where the layer's weights start.
struct Gemm {
  const float* (*weights)(const ex::WeightPtrs&);
  int M, K;
  std::size_t layer_elems;  // elements of this matrix per layer
};
std::vector<Gemm> layer_gemms(const ex::ModelConfig& c) {
  const std::size_t D = static_cast<std::size_t>(c.dim), QD = static_cast<std::size_t>(c.q_dim());
  const std::size_t KVD = static_cast<std::size_t>(c.kv_dim()), H = static_cast<std::size_t>(c.hidden_dim);
  return {
      {[](const ex::WeightPtrs& w) { return w.wq; }, c.q_dim(), c.dim, QD * D},
      {[](const ex::WeightPtrs& w) { return w.wk; }, c.kv_dim(), c.dim, KVD * D},
      {[](const ex::WeightPtrs& w) { return w.wv; }, c.kv_dim(), c.dim, KVD * D},
      {[](const ex::WeightPtrs& w) { return w.wo; }, c.dim, c.q_dim(), D * QD},
      {[](const ex::WeightPtrs& w) { return w.w1; }, c.hidden_dim, c.dim, H * D},
      {[](const ex::WeightPtrs& w) { return w.w3; }, c.hidden_dim, c.dim, H * D},
      {[](const ex::WeightPtrs& w) { return w.w2; }, c.dim, c.hidden_dim, D * H},
  };
}

/// Non-embedding matmul parameters of one token (every layer's seven matrices).
double layer_params(const ex::ModelConfig& c) {
  double p = 0;
  for (const Gemm& g : layer_gemms(c)) p += static_cast<double>(g.M) * g.K;
  return p * c.n_layers;
}

/// Model FLOPs of prefilling `prompt` tokens (see the header comment); `attn` gets the attention part.
double prefill_flops(const ex::ModelConfig& c, double prompt, double* attn) {
  const double matmul = 2.0 * layer_params(c) * prompt + 2.0 * static_cast<double>(c.vocab_size) * c.dim;
  *attn = 4.0 * c.head_dim * (prompt * (prompt + 1) / 2) * c.n_heads * c.n_layers;
  return matmul + *attn;
}

/// BM_CublasLayers' measurement at M = chunk rows: TFLOP/s of the seven GEMMs over all layers
/// (one untimed pass first), memoized so that the prefill rows compare against this run's rate.
struct CublasRate {
  double tflops = 0, ms_pass = 0;
};
CublasRate cublas_rate(int chunk, int passes) {
  static std::map<int, CublasRate> done;
  if (auto it = done.find(chunk); it != done.end()) return it->second;
  triattn::bench::SyntheticModel& m = model();
  const ex::ModelConfig& c = m.config;
  const cudaStream_t stream = m.backend.stream();
  const ex::WeightPtrs& w = m.decoder->weights().ptrs();
  const std::vector<Gemm> gemms = layer_gemms(c);
  int max_k = 0, max_m = 0;
  for (const Gemm& g : gemms) {
    max_k = std::max(max_k, g.K);
    max_m = std::max(max_m, g.M);
  }
  const std::size_t x_elems = static_cast<std::size_t>(chunk) * max_k;
  ex::cuda_detail::DeviceMem x = ex::cuda_detail::device_alloc(x_elems * sizeof(__nv_bfloat16));
  ex::cuda_detail::DeviceMem y = ex::cuda_detail::device_alloc(static_cast<std::size_t>(chunk) * max_m * sizeof(float));
  ex::gpu::synth_fill_kernel<__nv_bfloat16><<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(x.get()), x_elems, 3,
                                                                       200, 1.7320508f, 0.0f);
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  const ex::CublasContext ctx(stream);
  double flops = 0;
  auto pass = [&] {
    flops = 0;
    for (int l = 0; l < c.n_layers; ++l)
      for (const Gemm& g : gemms) {
        const ex::cuda_detail::ResolvedWeight rw = ex::cuda_detail::resolve_weight(g.weights(w) + l * g.layer_elems);
        ctx.gemm_rows(rw.ptr, CUDA_R_16BF, x.get(), g.K, static_cast<float*>(y.get()), g.M, g.M, chunk, g.K, 0.0f);
        flops += 2.0 * g.M * static_cast<double>(g.K) * chunk;
      }
  };
  pass();  // warm-up: cuBLAS picks and loads its kernels
  cudaEvent_t t0, t1;
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t0));
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t1));
  TRIATTN_BENCH_CUDA(cudaEventRecord(t0, stream));
  for (int p = 0; p < passes; ++p) pass();
  TRIATTN_BENCH_CUDA(cudaEventRecord(t1, stream));
  TRIATTN_BENCH_CUDA(cudaEventSynchronize(t1));
  float ms = 0.f;
  TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, t0, t1));
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  CublasRate r;
  r.ms_pass = static_cast<double>(ms) / passes;
  r.tflops = flops / (r.ms_pass * 1e-3) * 1e-12;
  done[chunk] = r;
  return r;
}

void BM_CublasLayers(benchmark::State& state) {
  triattn::bench::guarded(state, [&] {
    const int chunk = static_cast<int>(state.range(0));
    CublasRate r;
    for (auto _ : state) {
      r = cublas_rate(chunk, 5);
      state.SetIterationTime(r.ms_pass * 1e-3);
    }
    state.counters["TFLOPs"] = r.tflops;
    state.counters["ms_pass"] = r.ms_pass;
    state.counters["rows"] = chunk;
    state.SetLabel("cuBLAS bf16 GEMMs of every layer (q, k, v, o, gate, up, down), M = chunk rows");
  });
}

/// The bf16 KV cache of one prompt of up to kMaxPrompt tokens, made once.
std::unique_ptr<ex::GpuPlainCache>& cache_slot() {
  static std::unique_ptr<ex::GpuPlainCache> cache;
  return cache;
}
ex::GpuPlainCache& cache() {
  std::unique_ptr<ex::GpuPlainCache>& slot = cache_slot();
  if (!slot) {
    const ex::ModelConfig& c = model().config;
    triattn::CacheConfig cfg = triattn::bench::bf16_cache_config(c, kBlock, 1);
    cfg.max_blocks_per_seq = (kMaxPrompt + kMaxChunk) / kBlock + 1;
    cfg.num_blocks = cfg.max_blocks_per_seq;
    slot = std::make_unique<ex::GpuPlainCache>(cfg, triattn::cuda::DeviceCompactor(model().backend.stream()));
  }
  return *slot;
}

/// Prefills `tokens` in chunks into a new sequence of the cache, then releases it.
void prefill(const std::vector<int>& tokens, int chunk) {
  ex::Model<ex::CudaBackend>& mdl = model().decoder->model();
  ex::GpuPlainCache& kv = cache();
  const SeqId seq = kv.add_sequence();
  const std::span<const int> all(tokens);
  for (std::size_t off = 0; off < all.size(); off += static_cast<std::size_t>(chunk)) {
    const std::span<const int> part = all.subspan(off, std::min(all.size() - off, static_cast<std::size_t>(chunk)));
    const ex::Chunk ch{seq, part, triattn::Phase::kPrefill};
    const bool last = off + part.size() == all.size();
    (void)mdl.forward(kv, std::span<const ex::Chunk>(&ch, 1), last ? ex::LogitsFor::kLastOfEachChunk : ex::LogitsFor::kNone);
  }
  model().backend.flush();
  kv.release(seq);
}

void BM_PrefillModel(benchmark::State& state) {
  triattn::bench::guarded(state, [&] {
    const int prompt = static_cast<int>(state.range(0));
    const int chunk = static_cast<int>(state.range(1));
    triattn::bench::SyntheticModel& m = model();
    const ex::ModelConfig& c = m.config;
    const cudaStream_t stream = m.backend.stream();
    const CublasRate peer = cublas_rate(chunk, 5);
    std::vector<int> tokens(static_cast<std::size_t>(prompt));
    for (int i = 0; i < prompt; ++i) tokens[static_cast<std::size_t>(i)] = (i * 7919 + 13) % c.vocab_size;
    // Warm-up: buffers of `chunk` rows, scratch, the kernels' first launches.
    prefill(std::vector<int>(tokens.begin(), tokens.begin() + std::min(prompt, 2 * chunk)), chunk);
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
    cudaEvent_t t0, t1;
    TRIATTN_BENCH_CUDA(cudaEventCreate(&t0));
    TRIATTN_BENCH_CUDA(cudaEventCreate(&t1));
    double total_s = 0;
    long long iters = 0;
    for (auto _ : state) {
      TRIATTN_BENCH_CUDA(cudaEventRecord(t0, stream));
      prefill(tokens, chunk);
      TRIATTN_BENCH_CUDA(cudaEventRecord(t1, stream));
      total_s += triattn::bench::time_iteration(state, t0, t1);
      ++iters;
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    if (iters == 0) return;
    const double s = total_s / static_cast<double>(iters);
    double attn = 0;
    const double flops = prefill_flops(c, prompt, &attn);
    const double tflops = flops / s * 1e-12;
    state.counters["tok_s"] = prompt / s;
    state.counters["TFLOPs"] = tflops;
    state.counters["attn_pct"] = 100.0 * attn / flops;
    state.counters["cublas_TFLOPs"] = peer.tflops;
    state.counters["vs_cublas_pct"] = peer.tflops > 0 ? 100.0 * tflops / peer.tflops : 0.0;
    state.counters["ms"] = s * 1e3;
    state.SetLabel("bf16 weights and KV, chunks of " + std::to_string(chunk) + " tokens");
  });
}

}  // namespace

BENCHMARK(BM_CublasLayers)->ArgName("chunk")->Arg(2048)->Arg(4096)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PrefillModel)
    ->ArgNames({"prompt", "chunk"})
    ->ArgsProduct({{4096, 8192, 16384, 32768}, {2048, kMaxChunk}})
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // Device memory goes back before the CUDA runtime shuts down.
  cache_slot().reset();
  triattn::bench::synthetic_model_slot().reset();
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// GEMV kernels vs cuBLAS for the reference transformer's matmuls, over the row count n: the
// measurement behind kCublasMinRowsBf16 / kCublasMinRowsF32 (examples/reference_transformer/
// gemm_cublas.cuh). Both paths run through the step recorder's own dispatch
// (StepRecorder::launch_gemv with MatmulPath::kGemv or kCublas), with the fused work of a step:
//   shape 0 qkv   RMSNorm prologue + q, k, v sharing x (3 matrices)
//   shape 1 wo    [dim, q_dim] + residual add
//   shape 2 w13   RMSNorm prologue + gate/up paired SwiGLU (2 x [hidden, dim])
//   shape 3 w2    [dim, hidden] + residual add
//   shape 4 cls   RMSNorm prologue + the classifier [vocab, dim]
// model 0: SmolLM2-135M (dim 576, 9 q / 3 KV heads of 64, hidden 1536, vocab 49152);
// model 1: the synthetic Qwen3-8B (dim 4096, 32 q / 8 KV heads of 128, hidden 12288, vocab 151936).
// wtype: 0 fp32, 1 bf16 weights; path: 1 GEMV kernels, 2 cuBLAS; n: 1..128 rows.
// One iteration replays a CUDA graph of the matmul over distinct weight copies back to back
// (>= 512 MB of weights, so nothing is served from L2, as in a real step over all layers), timed
// with CUDA events. Counters: us_call (time per matmul), GBps (weight bytes / time), TFLOPs.
// Reading: for each (model, wtype) the crossover is the smallest n from which path 2's us_call
// is at most path 1's on every shape; set the constants in gemm_cublas.cuh to it.
// Run: build/benchmarks/bench_gemm_crossover --benchmark_counters_tabular=true
//   (~3 GB of device memory at most: Qwen3-8B fp32 classifier)
#include <benchmark/benchmark.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <reference_transformer/cuda_step_recorder.cuh>

namespace ex = triattn_example;
namespace gpu = triattn_example::gpu;

namespace {

struct Shapes {
  const char* name;
  int dim, q_dim, kv_dim, hidden, vocab;
};
constexpr Shapes kModels[] = {{"SmolLM2-135M", 576, 576, 192, 1536, 49152},
                              {"Qwen3-8B", 4096, 4096, 1024, 12288, 151936}};
enum ShapeId : int { kQkv = 0, kWo, kW13, kW2, kCls, kNumShapes };
const char* shape_name(int s) {
  static const char* names[] = {"qkv", "wo", "w13", "w2", "cls"};
  return s >= 0 && s < kNumShapes ? names[s] : "?";
}
constexpr double kMinBytesPerIter = 512e6;
constexpr int kMaxCopies = 512;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
}

struct DevFree {
  void operator()(void* p) const noexcept { cudaFree(p); }
};

/// Device memory and the GemvParams of one (model, shape, wtype, n), one per weight copy.
struct Workload {
  int model, shape, wtype, n;
  std::vector<std::unique_ptr<void, DevFree>> mem;
  std::vector<gpu::GemvParams> calls;
  double weight_bytes = 0, flops = 0;

  Workload(int m, int s, int wt, int rows) : model(m), shape(s), wtype(wt), n(rows) {
    const Shapes& c = kModels[m];
    const bool bf16 = wt == 1;
    int K = c.dim;
    std::vector<int> Ms;
    switch (s) {
      case kQkv: Ms = {c.q_dim, c.kv_dim, c.kv_dim}; break;
      case kWo: Ms = {c.dim}; K = c.q_dim; break;
      case kW13: Ms = {c.hidden, c.hidden}; break;
      case kW2: Ms = {c.dim}; K = c.hidden; break;
      default: Ms = {c.vocab}; break;
    }
    long long per_copy = 0, out_w = 0;
    for (int M : Ms) {
      per_copy += static_cast<long long>(M) * K;
      out_w = std::max<long long>(out_w, M);
    }
    const std::size_t wsize = bf16 ? 2 : 4;
    const int copies = static_cast<int>(std::clamp<double>(std::ceil(kMinBytesPerIter / (per_copy * wsize)), 1, kMaxCopies));
    float* x = floats(static_cast<std::size_t>(n) * std::max(K, c.dim), 1.0f, 1);
    float* xb = floats(static_cast<std::size_t>(n) * std::max(K, c.dim), 0.0f, 2);
    float* res = floats(static_cast<std::size_t>(n) * c.dim, 1.0f, 3);
    const float* norm_w = floats(static_cast<std::size_t>(K), 0.1f, 4, 1.0f);
    std::vector<float*> outs;
    for (std::size_t i = 0; i < Ms.size(); ++i) outs.push_back(floats(static_cast<std::size_t>(n) * Ms[i], 0.0f, 5));
    for (int cp = 0; cp < copies; ++cp) {
      gpu::GemvParams p;
      p.nseg = static_cast<int>(Ms.size());
      for (std::size_t i = 0; i < Ms.size(); ++i) {
        p.seg[i].w = weights(static_cast<long long>(Ms[i]) * K, K, bf16, 10 + static_cast<unsigned>(i));
        p.seg[i].out = outs[i];
        p.seg[i].out_stride = Ms[i];
        p.seg[i].M = Ms[i];
      }
      if (s == kQkv || s == kW13 || s == kCls) {
        p.norm_w = norm_w;
        p.norm_out = xb;
        p.eps = 1e-6f;
      }
      if (s == kWo || s == kW2) {
        p.seg[0].residual = res;
        p.seg[0].res_stride = c.dim;
      }
      p.paired = s == kW13 ? 1 : 0;
      p.x = x;
      p.x_stride = K;
      p.K = K;
      p.n = n;
      calls.push_back(p);
    }
    weight_bytes = static_cast<double>(per_copy) * wsize * copies;
    flops = 2.0 * static_cast<double>(per_copy) * n * copies;
    cuda_check(cudaDeviceSynchronize(), "filling the workload");
  }

  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, bytes), "cudaMalloc");
    mem.emplace_back(p);
    return p;
  }
  float* floats(std::size_t count, float scale, unsigned tensor, float mean = 0.0f) {
    auto* p = static_cast<float*>(alloc(count * sizeof(float)));
    gpu::synth_fill_kernel<float><<<1024, 256>>>(p, count, 7, tensor, 1.7320508f * scale, mean);
    cuda_check(cudaGetLastError(), "synth_fill_kernel");
    return p;
  }
  const void* weights(long long count, int K, bool bf16, unsigned tensor) {
    const float scale = 1.7320508f / std::sqrt(static_cast<float>(K));
    if (bf16) {
      auto* p = static_cast<__nv_bfloat16*>(alloc(static_cast<std::size_t>(count) * 2));
      gpu::synth_fill_kernel<__nv_bfloat16><<<4096, 256>>>(p, static_cast<unsigned long long>(count), 7, tensor, scale, 0.0f);
      cuda_check(cudaGetLastError(), "synth_fill_kernel");
      return p;
    }
    auto* p = static_cast<float*>(alloc(static_cast<std::size_t>(count) * 4));
    gpu::synth_fill_kernel<float><<<4096, 256>>>(p, static_cast<unsigned long long>(count), 7, tensor, scale, 0.0f);
    cuda_check(cudaGetLastError(), "synth_fill_kernel");
    return p;
  }
};

std::unique_ptr<Workload>& workload_slot() {
  static std::unique_ptr<Workload> w;
  return w;
}
Workload& workload(int model, int shape, int wtype, int n) {
  auto& w = workload_slot();
  if (!w || w->model != model || w->shape != shape || w->wtype != wtype || w->n != n) {
    w.reset();  // free the previous workload's weights first
    w = std::make_unique<Workload>(model, shape, wtype, n);
  }
  return *w;
}

void matmul(benchmark::State& state) {
  const int model = static_cast<int>(state.range(0)), shape = static_cast<int>(state.range(1));
  const int wtype = static_cast<int>(state.range(2)), path = static_cast<int>(state.range(3));
  const int n = static_cast<int>(state.range(4));
  const bool bf16 = wtype == 1;
  Workload& w = workload(model, shape, wtype, n);
  ex::CudaBackendOptions o;
  o.weights = bf16 ? ex::WeightType::kBF16 : ex::WeightType::kF32;
  o.matmul_path = static_cast<ex::MatmulPath>(path);
  ex::cuda_detail::StepRecorder rec(o);  // the backend's dispatch, stream and cuBLAS context
  rec.prepare_matmul(n, w.calls[0].K, bf16, false);
  // One iteration = one graph (no host launch overhead between the calls, as in a captured step).
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaStreamBeginCapture(rec.stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    for (const gpu::GemvParams& p : w.calls) rec.launch_gemv(p, bf16);
  } catch (...) {
    cudaStreamEndCapture(rec.stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  cuda_check(cudaStreamEndCapture(rec.stream, &graph), "cudaStreamEndCapture");
  cuda_check(cudaGraphInstantiate(&exec, graph, 0ULL), "cudaGraphInstantiate");
  cudaGraphDestroy(graph);
  for (int i = 0; i < 2; ++i) cuda_check(cudaGraphLaunch(exec, rec.stream), "warm-up");
  cuda_check(cudaStreamSynchronize(rec.stream), "warm-up");
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cuda_check(cudaEventCreate(&e0), "cudaEventCreate");
  cuda_check(cudaEventCreate(&e1), "cudaEventCreate");
  double total_s = 0;
  long long iters = 0;
  for (auto _ : state) {
    cuda_check(cudaEventRecord(e0, rec.stream), "cudaEventRecord");
    cuda_check(cudaGraphLaunch(exec, rec.stream), "cudaGraphLaunch");
    cuda_check(cudaEventRecord(e1, rec.stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0.f;
    cuda_check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    total_s += static_cast<double>(ms) * 1e-3;
    ++iters;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  const double per_iter = iters > 0 ? total_s / static_cast<double>(iters) : 0.0;
  const double calls = static_cast<double>(w.calls.size());
  state.counters["us_call"] = per_iter * 1e6 / calls;
  state.counters["GBps"] = per_iter > 0 ? w.weight_bytes / per_iter * 1e-9 : 0.0;
  state.counters["TFLOPs"] = per_iter > 0 ? w.flops / per_iter * 1e-12 : 0.0;
  state.counters["calls"] = calls;
  state.SetLabel(std::string(kModels[model].name) + " " + shape_name(shape) + (bf16 ? " bf16 " : " f32 ") +
                 (path == 2 ? "cublas" : "gemv"));
}

void BM_Matmul(benchmark::State& state) {
  try {
    matmul(state);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void matmul_args(benchmark::internal::Benchmark* b) {
  const int rows[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128};
  for (int model = 0; model < 2; ++model)
    for (int wtype = 1; wtype >= 0; --wtype)
      for (int shape = 0; shape < kNumShapes; ++shape)
        for (int n : rows)
          for (int path = 1; path <= 2; ++path) b->Args({model, shape, wtype, path, n});
}

}  // namespace

BENCHMARK(BM_Matmul)
    ->ArgNames({"model", "shape", "wtype", "path", "n"})
    ->Apply(matmul_args)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  workload_slot().reset();  // device memory goes back before the runtime shuts down
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The small-batch bf16 GEMVs of the reference transformer (examples/reference_transformer/
// gemv_stream_kernel.cuh) on the Qwen3-8B-like decode step's shapes, variant against variant:
//   shape 0 qkv    [4096 + 1024 + 1024, 4096] one launch, bias + RMSNorm prologue
//   shape 1 wo     [4096, 4096] + residual add
//   shape 2 w13    2 x [12288, 4096] gate/up paired SwiGLU + RMSNorm prologue
//   shape 3 w2     [4096, 12288] + residual add (long rows)
//   shape 4 cls    [151936, 4096] + RMSNorm prologue (the classifier)
//   shape 5 layer  the four above of one layer in the model's order and data flow (qkv -> wo
//                  reads q -> w13 -> w2 reads h1, residual stream x), over 8 layers
// variant: 0 warp (the previous kernel), 1 stream, 2 stream-wide, 3 bulk (TMA); n: x rows (1, 2);
// pdl: programmatic dependent launch between the calls (the decode step uses it).
// Each iteration replays a CUDA graph of the GEMV over distinct weight copies back to back
// (>= 1 GB of weights per iteration, so nothing is served from the 60 MB L2), timed with CUDA
// events. Random weights (synth_fill_kernel, uniform, std 1/sqrt(K)).
// Counters: GBps = weight bytes per call / time per call, us_call, pct_read = GBps / 4490 (the
// read roofline of docs/performance.md), ctas = grid of one call (the first of the layer).
// Run: build/benchmarks/bench_gemv   (~3 GB of device memory for the largest workload)
#include <benchmark/benchmark.h>

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda_event_timer.hpp"

#include <reference_transformer/gemv_stream_kernel.cuh>

namespace gpu = triattn_example::gpu;

namespace {

constexpr int kDim = 4096, kKv = 1024, kHidden = 12288, kVocab = 151936;
constexpr double kReadRooflineGBps = 4490.0;
constexpr double kMinBytesPerIter = 1e9;
constexpr int kLayerCopies = 8;

enum ShapeId : int { kQkv = 0, kWo, kW13, kW2, kCls, kLayer, kNumShapes };
const char* shape_name(int s) {
  static const char* names[] = {"qkv", "wo", "w13", "w2", "cls", "layer"};
  return s >= 0 && s < kNumShapes ? names[s] : "?";
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
}

/// Device memory and the GEMV calls of one (shape, n), reused by its benchmarks.
struct Workload {
  int shape = -1, n = 0;
  std::vector<void*> mem;
  std::vector<gpu::GemvParams> calls;  // one iteration, in launch order
  double weight_bytes = 0;             // over all calls of an iteration
  cudaStream_t stream = nullptr;

  Workload(int s, int rows) : shape(s), n(rows) {
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    // activations, [2, width] each: x = residual stream, xb = RMSNorm output
    float* x = floats(2 * kHidden, 1.0f, 0.0f, 1);
    float* xb = floats(2 * kHidden, 0.0f, 0.0f, 2);
    float* q = floats(2 * kDim, 1.0f, 0.0f, 3);
    float* k = floats(2 * kKv, 0.0f, 0.0f, 4);
    float* v = floats(2 * kKv, 0.0f, 0.0f, 5);
    float* xb2 = floats(2 * kDim, 0.0f, 0.0f, 6);
    float* h1 = floats(2 * kHidden, 1.0f, 0.0f, 7);
    float* h3 = floats(2 * kHidden, 0.0f, 0.0f, 8);
    float* logits = s == kCls ? floats(2LL * kVocab, 0.0f, 0.0f, 9) : nullptr;
    const float* norm_w = floats(kDim, 0.1f, 1.0f, 10);
    const float* bq = floats(kDim, 0.05f, 0.0f, 11);
    const float* bk = floats(kKv, 0.05f, 0.0f, 12);
    const float* bv = floats(kKv, 0.05f, 0.0f, 13);

    auto base = [&](const float* in, long long stride, int K) {
      gpu::GemvParams p;
      p.x = in;
      p.x_stride = stride;
      p.K = K;
      p.n = n;
      return p;
    };
    auto seg = [&](gpu::GemvParams& p, int i, int M, int K, float* out, unsigned tensor) {
      p.seg[i].w = weights(static_cast<long long>(M) * K, K, tensor);
      p.seg[i].M = M;
      p.seg[i].out = out;
      p.seg[i].out_stride = M;
      weight_bytes += 2.0 * M * K;
    };
    auto add_qkv = [&](unsigned t) {
      gpu::GemvParams p = base(x, kDim, kDim);
      p.nseg = 3;
      seg(p, 0, kDim, kDim, q, t);
      seg(p, 1, kKv, kDim, k, t + 1);
      seg(p, 2, kKv, kDim, v, t + 2);
      p.seg[0].bias = bq, p.seg[1].bias = bk, p.seg[2].bias = bv;
      p.norm_w = norm_w, p.norm_out = xb, p.eps = 1e-5f;
      calls.push_back(p);
    };
    auto add_wo = [&](unsigned t) {
      gpu::GemvParams p = base(q, kDim, kDim);  // the attention output has q's shape
      p.nseg = 1;
      seg(p, 0, kDim, kDim, xb2, t);
      p.seg[0].residual = x, p.seg[0].res_stride = kDim;
      calls.push_back(p);
    };
    auto add_w13 = [&](unsigned t) {
      gpu::GemvParams p = base(x, kDim, kDim);
      p.nseg = 2;
      p.paired = 1;
      seg(p, 0, kHidden, kDim, h1, t);
      seg(p, 1, kHidden, kDim, h3, t + 1);
      p.norm_w = norm_w, p.norm_out = xb, p.eps = 1e-5f;
      calls.push_back(p);
    };
    auto add_w2 = [&](unsigned t) {
      gpu::GemvParams p = base(h1, kHidden, kHidden);
      p.nseg = 1;
      seg(p, 0, kDim, kHidden, xb, t);
      p.seg[0].residual = x, p.seg[0].res_stride = kDim;
      calls.push_back(p);
    };
    auto add_cls = [&](unsigned t) {
      gpu::GemvParams p = base(x, kDim, kDim);
      p.nseg = 1;
      seg(p, 0, kVocab, kDim, logits, t);
      p.norm_w = norm_w, p.norm_out = xb, p.eps = 1e-5f;
      calls.push_back(p);
    };
    if (s == kLayer) {
      for (int l = 0; l < kLayerCopies; ++l) {
        const unsigned t = 100u + 10u * static_cast<unsigned>(l);
        add_qkv(t);
        add_wo(t + 3);
        add_w13(t + 4);
        add_w2(t + 6);
      }
      return;
    }
    const double one = s == kQkv ? 2.0 * (kDim + 2 * kKv) * kDim : s == kWo ? 2.0 * kDim * kDim
                     : s == kW13 ? 4.0 * kHidden * kDim : s == kW2 ? 2.0 * kDim * kHidden : 2.0 * kVocab * kDim;
    int copies = static_cast<int>((kMinBytesPerIter + one - 1) / one);
    if (copies < 2) copies = 2;
    for (int c = 0; c < copies; ++c) {
      const unsigned t = 100u + 4u * static_cast<unsigned>(c);
      switch (s) {
        case kQkv: add_qkv(t); break;
        case kWo: add_wo(t); break;
        case kW13: add_w13(t); break;
        case kW2: add_w2(t); break;
        default: add_cls(t); break;
      }
    }
  }
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;
  ~Workload() {
    cudaStreamSynchronize(stream);
    for (void* p : mem) cudaFree(p);
    cudaStreamDestroy(stream);
  }

  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, bytes), "cudaMalloc");
    mem.push_back(p);
    return p;
  }
  /// count floats: mean + uniform * scale * sqrt(3).
  float* floats(long long count, float scale, float mean, unsigned tensor) {
    auto* p = static_cast<float*>(alloc(static_cast<std::size_t>(count) * 4));
    gpu::synth_fill_kernel<float><<<1024, 256, 0, stream>>>(p, static_cast<unsigned long long>(count), 7, tensor,
                                                           1.7320508f * scale, mean);
    cuda_check(cudaGetLastError(), "synth_fill_kernel");
    return p;
  }
  const __nv_bfloat16* weights(long long count, int K, unsigned tensor) {
    auto* p = static_cast<__nv_bfloat16*>(alloc(static_cast<std::size_t>(count) * 2));
    gpu::synth_fill_kernel<__nv_bfloat16><<<4096, 256, 0, stream>>>(p, static_cast<unsigned long long>(count), 7, tensor,
                                                                    1.7320508f / std::sqrt(static_cast<float>(K)), 0.0f);
    cuda_check(cudaGetLastError(), "synth_fill_kernel");
    return p;
  }
};

std::unique_ptr<Workload>& workload_slot() {
  static std::unique_ptr<Workload> w;
  return w;
}
Workload& workload(int shape, int n) {
  auto& w = workload_slot();
  if (!w || w->shape != shape || w->n != n) {
    w.reset();  // free the previous shape's weights first
    w = std::make_unique<Workload>(shape, n);
    cuda_check(cudaStreamSynchronize(w->stream), "filling the weights");
  }
  return *w;
}

void gemv(benchmark::State& state) {
  const int shape = static_cast<int>(state.range(0));
  const int variant = static_cast<int>(state.range(1));
  const int n = static_cast<int>(state.range(2));
  const bool pdl = state.range(3) != 0;
  int dev = 0, sms = 0;
  cuda_check(cudaGetDevice(&dev), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  Workload& w = workload(shape, n);
  std::vector<gpu::GemvLaunch> plans(w.calls.size());
  for (std::size_t i = 0; i < w.calls.size(); ++i) {
    const std::string why = gpu::plan_gemv_bf16_small(w.calls[i], variant, sms, &plans[i]);
    if (!why.empty()) throw std::runtime_error("variant " + std::to_string(variant) + " refused: " + why);
  }
  // One iteration = one graph (no host launch overhead between the calls, as in the decode step).
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  for (const gpu::GemvLaunch& l : plans) {
    const cudaError_t e = gpu::launch_gemv_planned(l, w.stream, pdl);
    if (e != cudaSuccess) {
      cudaStreamEndCapture(w.stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      cuda_check(e, "launch during capture");
    }
  }
  cuda_check(cudaStreamEndCapture(w.stream, &graph), "cudaStreamEndCapture");
  cuda_check(cudaGraphInstantiate(&exec, graph, 0ULL), "cudaGraphInstantiate");
  cudaGraphDestroy(graph);
  for (int i = 0; i < 2; ++i) cuda_check(cudaGraphLaunch(exec, w.stream), "warm-up");
  cuda_check(cudaStreamSynchronize(w.stream), "warm-up");
  double total_s = 0;
  long long iters = 0;
  for (auto _ : state) {
    {
      triattn::bench::CudaEventTimer timer(state, w.stream);
      cuda_check(cudaGraphLaunch(exec, w.stream), "cudaGraphLaunch");
    }
    ++iters;
  }
  // the timer reports each iteration; recompute the mean for the counters
  cudaEvent_t e0, e1;
  cuda_check(cudaEventCreate(&e0), "cudaEventCreate");
  cuda_check(cudaEventCreate(&e1), "cudaEventCreate");
  const int reps = 5;
  cuda_check(cudaEventRecord(e0, w.stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) cuda_check(cudaGraphLaunch(exec, w.stream), "cudaGraphLaunch");
  cuda_check(cudaEventRecord(e1, w.stream), "cudaEventRecord");
  cuda_check(cudaEventSynchronize(e1), "cudaEventSynchronize");
  float ms = 0.f;
  cuda_check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  total_s = static_cast<double>(ms) * 1e-3 / reps;
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  const double calls = static_cast<double>(plans.size());
  const double gbps = total_s > 0 ? w.weight_bytes / total_s * 1e-9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["us_call"] = total_s * 1e6 / calls;
  state.counters["pct_read"] = 100.0 * gbps / kReadRooflineGBps;
  state.counters["ctas"] = plans.empty() ? 0.0 : static_cast<double>(plans[0].grid.x);
  state.counters["calls"] = calls;
  state.counters["MB_call"] = w.weight_bytes / calls * 1e-6;
  state.SetLabel(std::string(shape_name(shape)) + " " + gpu::gemv_variant_name(variant) + (pdl ? " pdl" : " no-pdl") +
                 " (" + std::to_string(iters) + " timed graphs)");
}

void BM_Gemv(benchmark::State& state) {
  try {
    gemv(state);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void gemv_args(benchmark::internal::Benchmark* b) {
  for (int shape = 0; shape < kNumShapes; ++shape)
    for (int v = 0; v < gpu::kGemvNumVariants; ++v) b->Args({shape, v, 1, 1});
  for (int shape = 0; shape < kCls; ++shape)
    for (int v = 0; v < gpu::kGemvNumVariants; ++v) b->Args({shape, v, 2, 1});
  for (int v = 0; v < gpu::kGemvNumVariants; ++v) b->Args({kLayer, v, 1, 0});
}

}  // namespace

BENCHMARK(BM_Gemv)->ArgNames({"shape", "variant", "n", "pdl"})->Apply(gemv_args)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  workload_slot().reset();  // device memory goes back before the runtime shuts down
  return 0;
}

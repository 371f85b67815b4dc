// SPDX-License-Identifier: Apache-2.0
// Cost of the tensor-parallel union agreement per compression round, at the Qwen3-8B shape: 36
// layers, 32 query / 8 KV heads, head_dim 128, bf16, page 16, 2,560 cached tokens, union mode,
// budget 2,048; batch 1 / 8 / 64.
//   variant 0  tp = 2: the agreement alone (NCCL all-reduce, max, of the flags [batch, 2560] uint8
//              and vmax [batch, 2560] float in one group)
//   variant 1  tp = 2: the whole union plan (score → reduce → candidates → agreement → select)
//   variant 2  tp = 1: the union plan on one GPU, no agreement (compression_round::plan)
//   variant 3  tp = 2: the whole round (plan + compaction of the rank's 4 KV heads)
//   variant 4  tp = 1: the whole round on one GPU
// tp = 2: rank r runs on GPU r, rank 0 in the benchmark thread and rank 1 in a helper thread,
// in lockstep. Each iteration both ranks enqueue [L2 flush (plans), a gate kernel, the step],
// rank 0 with CUDA events around its step; then the gate opens on both GPUs at once, so host
// enqueue skew between the threads is not timed. tp = 2 variants need two GPUs and NCCL and
// report an error (SkipWithError) otherwise. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
// Counters: agree_bytes (per rank and round), K_bytes (keys read per rank), agree_GBps.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>
#include <triattn/cuda/tp/nccl_communicator.cuh>
#include <triattn/cuda/tp/nccl_union_agreement.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;
using triattn::bench::upload;

constexpr int kL = 36, kHq = 32, kHkv = 8, kD = 128, kLen = 2560, kBudget = 2048, kPage = 16, kTp = 2;

QueryStats random_stats() {
  std::mt19937 rng(5);
  return random_query_stats(rng, kL, kHq, kD, RopeStyle::kHalf, "bench");
}

/// Spins until the host-mapped flag reaches `epoch`: holds a stream's work until both ranks have
/// enqueued theirs.
__global__ void wait_gate(const volatile int* flag, int epoch) {
  while (*flag < epoch) __nanosleep(200);
}

/// One rank's round at batch B on the current device: cache (its KV heads), scorer (its query
/// heads), plan and workspace. tp = 1: rank 0 holds every head.
struct RankRound {
  int hq = 0, hkv = 0, batch = 0;
  T* data = nullptr;
  std::int32_t *tables = nullptr, *lens = nullptr, *seq = nullptr, *prompts = nullptr, *kept = nullptr,
               *keep = nullptr;
  std::int64_t* t0 = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
  std::unique_ptr<cuda::TriAttentionDeviceScorer> scorer;
  KvCacheView<T, std::int32_t> view{};
  SelectionParams dp;
  cudaStream_t stream = nullptr;
  std::unique_ptr<L2Flusher> flush;

  RankRound(int tp, int rank, int b, const QueryStats& stats) : hq(kHq / tp), hkv(kHkv / tp), batch(b) {
    const BlockLayout bl{KvLayout::kNHD, kPage, hkv, kD};
    const int per_seq = kLen / kPage, blocks = batch * per_seq;
    const std::size_t elems = 2ull * kL * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(bl.block_elems());
    data = device_alloc<T>(elems);
    triattn::bench::fill_random_bf16<<<2048, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 13u + rank);
    TRIATTN_BENCH_CUDA(cudaGetLastError());
    std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
    for (int i = 0; i < blocks; ++i) ids[static_cast<std::size_t>(i)] = i;
    std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
    std::vector<std::int32_t> seq_ids(static_cast<std::size_t>(batch));
    for (int i = 0; i < batch; ++i) seq_ids[static_cast<std::size_t>(i)] = i;
    tables = upload(ids);
    lens = upload(std::vector<std::int32_t>(static_cast<std::size_t>(batch), kLen));
    seq = upload(seq_ids);
    prompts = upload(std::vector<std::int32_t>(static_cast<std::size_t>(batch), 0));
    t0 = upload(std::vector<std::int64_t>(static_cast<std::size_t>(batch), 41000));
    view = KvCacheView<T, std::int32_t>::contiguous(data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, kL,
                                                   blocks, batch, per_seq, tables, lens);
    RopeConfig rope;
    rope.theta = 1e6;
    scorer = std::make_unique<cuda::TriAttentionDeviceScorer>(tp == 1 ? stats : slice_for_rank(stats, rank, tp, kHkv),
                                                              rope, ScoringParams{}, hkv);
    SelectionParams sp;
    sp.budget = kBudget;
    sp.mode = PruningMode::kUnion;
    dp = sp;
    kept = device_alloc<std::int32_t>(static_cast<std::size_t>(batch) * kL * hkv * kLen);
    keep = device_alloc<std::int32_t>(static_cast<std::size_t>(batch));
    ws_bytes = cuda::compression_round::workspace_size(shape(), sp.mode, batch, kLen);
    ws = device_alloc<char>(ws_bytes);
    TRIATTN_BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    flush = std::make_unique<L2Flusher>();
    TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  }
  RankRound(const RankRound&) = delete;
  RankRound& operator=(const RankRound&) = delete;
  ~RankRound() {
    cudaStreamSynchronize(stream);
    flush.reset();
    for (void* p : {static_cast<void*>(data), static_cast<void*>(tables), static_cast<void*>(lens),
                    static_cast<void*>(seq), static_cast<void*>(prompts), static_cast<void*>(t0),
                    static_cast<void*>(kept), static_cast<void*>(keep), ws})
      cudaFree(p);
    cudaStreamDestroy(stream);
  }

  [[nodiscard]] cuda::RoundShape shape() const { return {kL, hq, hkv}; }
  [[nodiscard]] cuda::RoundBatch round_batch() const { return {seq, t0, prompts, batch, kLen}; }
  [[nodiscard]] cuda::DeviceKeepPlanView plan_view() const { return {kept, keep, kLen}; }
  [[nodiscard]] cuda::RoundWorkspace workspace() const {
    cuda::RoundWorkspace w;
    cuda::detail::carve_round_workspace(ws, shape(), PruningMode::kUnion, batch, kLen, &w);
    return w;
  }
  [[nodiscard]] double key_bytes() const {
    return static_cast<double>(batch) * kL * hkv * kLen * kD * sizeof(T);
  }

  /// Enqueues one step of `variant` on this rank's stream (tp = 2 variants use `agree`).
  void step(int variant, cuda::NcclUnionAgreement* agree) {
    cudaError_t e = cudaSuccess;
    switch (variant) {
      case 0: {
        const cuda::RoundWorkspace w = workspace();
        e = (*agree)(w.flags, w.vmax, batch, kLen, stream);
        break;
      }
      case 1: e = cuda::compression_round::plan(view, scorer->device_model(), dp, round_batch(), plan_view(), ws,
                                                ws_bytes, *agree, stream);
        break;
      case 2: e = cuda::compression_round::plan(view, scorer->device_model(), dp, round_batch(), plan_view(), ws,
                                                ws_bytes, stream);
        break;
      case 3: e = cuda::compression_round::run(view, scorer->device_model(), dp, round_batch(), plan_view(), ws,
                                               ws_bytes, *agree, stream);
        break;
      default: e = cuda::compression_round::run(view, scorer->device_model(), dp, round_batch(), plan_view(), ws,
                                                ws_bytes, stream);
        break;
    }
    if (e != cudaSuccess) {
      std::fprintf(stderr, "bench_tp_union: variant %d failed: %s%s%s\n", variant, cudaGetErrorString(e),
                   agree != nullptr && agree->last_status() != 0 ? ", NCCL: " : "",
                   agree != nullptr && agree->last_status() != 0 ? agree->last_error().c_str() : "");
      std::exit(1);
    }
  }
};

/// Two ranks on GPUs 0 and 1: communicators, rank 1's driver thread, the gate. Made on the first
/// tp = 2 benchmark, torn down in main() before CUDA shuts down.
class TpContext {
 public:
  TpContext() {
    const int devices[kTp] = {0, 1};
    comms_ = cuda::NcclCommunicator::init_all(devices);
    void* gate = nullptr;
    TRIATTN_BENCH_CUDA(cudaHostAlloc(&gate, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    gate_ = static_cast<volatile int*>(gate);
    *gate_ = 0;
    worker_ = std::thread([this] { worker(); });
    TRIATTN_BENCH_CUDA(cudaSetDevice(0));
  }
  TpContext(const TpContext&) = delete;
  TpContext& operator=(const TpContext&) = delete;
  ~TpContext() {
    job_ = nullptr;
    quit_ = true;
    sync_.arrive_and_wait();  // A: the worker sees quit_
    worker_.join();
    cudaFreeHost(const_cast<int*>(gate_));
    comms_.clear();
  }

  cuda::NcclCommunicator& comm(int r) { return comms_[static_cast<std::size_t>(r)]; }

  /// One lockstep iteration. rank0(epoch) and rank1(epoch) enqueue their work behind the gate of
  /// `epoch`; rank 0 returns its two events' elapsed time (ms) once both GPUs are done.
  float lockstep(const std::function<void(int)>& rank1, const std::function<void(int, cudaEvent_t, cudaEvent_t)>& rank0,
                 cudaStream_t stream0, cudaEvent_t start, cudaEvent_t stop) {
    const int epoch = ++epoch_;
    job_ = [&rank1, epoch] { rank1(epoch); };
    sync_.arrive_and_wait();  // A: rank 1 starts enqueueing
    rank0(epoch, start, stop);
    sync_.arrive_and_wait();  // B: both enqueued
    __atomic_store_n(const_cast<int*>(gate_), epoch, __ATOMIC_RELEASE);
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream0));
    sync_.arrive_and_wait();  // C: rank 1's stream is done too
    float ms = 0.0f;
    TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }

  [[nodiscard]] const volatile int* gate() const noexcept { return gate_; }
  void set_rank1_stream(cudaStream_t s) noexcept { stream1_ = s; }

 private:
  void worker() {
    TRIATTN_BENCH_CUDA(cudaSetDevice(1));
    for (;;) {
      sync_.arrive_and_wait();  // A
      if (quit_) return;
      job_();
      sync_.arrive_and_wait();  // B
      TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream1_));
      sync_.arrive_and_wait();  // C
    }
  }

  std::vector<cuda::NcclCommunicator> comms_;
  volatile int* gate_ = nullptr;
  int epoch_ = 0;
  std::function<void()> job_;
  bool quit_ = false;
  cudaStream_t stream1_ = nullptr;
  std::barrier<> sync_{2};
  std::thread worker_;
};

std::unique_ptr<TpContext>& tp_context() {
  static std::unique_ptr<TpContext> ctx;
  return ctx;
}

/// Why tp = 2 cannot run here, or "".
std::string tp2_unavailable() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 2)
    return "bench_tp_union tp=2 needs 2 GPUs; found " + std::to_string(e == cudaSuccess ? n : 0);
  if (!cuda::NcclCommunicator::available())
    return "bench_tp_union tp=2 needs NCCL: " + cuda::NcclCommunicator::unavailable_reason();
  return {};
}

/// args: batch, variant (see the file comment)
void BM_tp_union(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int variant = static_cast<int>(state.range(1));
  const bool tp2 = variant == 0 || variant == 1 || variant == 3;
  const QueryStats stats = random_stats();
  const double agree_bytes = static_cast<double>(batch) * kLen * (sizeof(std::uint8_t) + sizeof(float));
  if (!tp2) {  // tp = 1 on GPU 0: the usual event timer
    TRIATTN_BENCH_CUDA(cudaSetDevice(0));
    RankRound r(1, 0, batch, stats);
    r.step(variant, nullptr);  // warm-up
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(r.stream));
    for (auto _ : state) {
      CudaEventTimer timer(state, r.stream, r.flush.get());
      r.step(variant, nullptr);
    }
    state.counters["K_bytes"] = r.key_bytes();
    state.counters["agree_bytes"] = 0;
    return;
  }
  if (const std::string why = tp2_unavailable(); !why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  if (!tp_context()) tp_context() = std::make_unique<TpContext>();
  TpContext& ctx = *tp_context();
  std::vector<std::unique_ptr<RankRound>> ranks;
  for (int r = 0; r < kTp; ++r) {
    TRIATTN_BENCH_CUDA(cudaSetDevice(r));
    ranks.push_back(std::make_unique<RankRound>(kTp, r, batch, stats));
  }
  TRIATTN_BENCH_CUDA(cudaSetDevice(0));
  ctx.set_rank1_stream(ranks[1]->stream);
  cuda::NcclUnionAgreement agree0(ctx.comm(0)), agree1(ctx.comm(1));
  cudaEvent_t start = nullptr, stop = nullptr;
  TRIATTN_BENCH_CUDA(cudaEventCreate(&start));
  TRIATTN_BENCH_CUDA(cudaEventCreate(&stop));
  const bool flush = variant != 0;  // plans start from a cold L2; the agreement's buffers are tiny
  RankRound& r0 = *ranks[0];
  RankRound& r1 = *ranks[1];
  const auto rank1 = [&](int epoch) {
    if (flush) r1.flush->flush(r1.stream);
    wait_gate<<<1, 1, 0, r1.stream>>>(ctx.gate(), epoch);
    // The agreement variant needs defined buffers: a full plan ran in the warm-up.
    r1.step(variant, &agree1);
  };
  const auto rank0 = [&](int epoch, cudaEvent_t a, cudaEvent_t b) {
    if (flush) r0.flush->flush(r0.stream);
    wait_gate<<<1, 1, 0, r0.stream>>>(ctx.gate(), epoch);
    TRIATTN_BENCH_CUDA(cudaEventRecord(a, r0.stream));
    r0.step(variant, &agree0);
    TRIATTN_BENCH_CUDA(cudaEventRecord(b, r0.stream));
  };
  // Warm-up without the gate (NCCL may synchronise while it opens its connections): a whole plan
  // on both ranks, which also defines the flags/vmax buffers the agreement variant reduces.
  ctx.lockstep([&](int) { r1.step(1, &agree1); },
               [&](int, cudaEvent_t a, cudaEvent_t b) {
                 TRIATTN_BENCH_CUDA(cudaEventRecord(a, r0.stream));
                 r0.step(1, &agree0);
                 TRIATTN_BENCH_CUDA(cudaEventRecord(b, r0.stream));
               },
               r0.stream, start, stop);
  (void)ctx.lockstep(rank1, rank0, r0.stream, start, stop);
  for (auto _ : state) state.SetIterationTime(static_cast<double>(ctx.lockstep(rank1, rank0, r0.stream, start, stop)) * 1e-3);
  state.counters["K_bytes"] = variant == 0 ? 0.0 : r0.key_bytes();
  state.counters["agree_bytes"] = agree_bytes;
  state.counters["agree_GBps"] =
      benchmark::Counter(agree_bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (int r = 0; r < kTp; ++r) {
    TRIATTN_BENCH_CUDA(cudaSetDevice(r));
    ranks[static_cast<std::size_t>(r)].reset();
  }
  TRIATTN_BENCH_CUDA(cudaSetDevice(0));
}

}  // namespace

BENCHMARK(BM_tp_union)
    ->ArgNames({"batch", "variant"})
    ->ArgsProduct({{1, 8, 64}, {0, 1, 2, 3, 4}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  tp_context().reset();  // NCCL communicators and rank 1's thread go before CUDA's own teardown
  benchmark::Shutdown();
  return 0;
}

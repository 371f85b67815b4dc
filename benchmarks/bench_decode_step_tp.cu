// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// Decode step of the tensor-parallel reference transformer (examples/reference_transformer/
// tensor_parallel.hpp, tp_cuda.cuh) at tp = 1 (GPU 0) and tp = 2 (GPUs 0 and 1), Qwen3-8B-like
// synthetic model (as bench_decode_step.cu: 36 layers, hidden 4096, 32 q / 8 KV heads, d = 128,
// intermediate 12288, vocab 151936), bf16 weights generated on each rank's GPU as its shard
// (CudaBackend::generate_synthetic(full, seed, rank)), bf16 KV cache of the rank's KV heads.
// Rank r drives device r from its own host thread (DeviceDecoder::step: the backend calls of
// Model::step, CUDA graphs + PDL); the two all-reduces per layer are NCCL fp32 sums captured in
// the step's graph.
//
// Scenario: compressed, TriAttention budget 2,048 (divide_length 128) at a logical length of
// 32,768 (cached 2,048..2,175 tokens per sequence), filled as bench_decode_step.cu does. Batches
// 1 and 128 (bench_decode_step's largest compressed batch in 40 GiB at tp 1; tp 2 holds half of
// it per GPU). Modes: latency = one step per iteration, next tokens = device argmax brought to
// the host (every rank); pipelined = 8 steps per iteration, fixed tokens, no host wait.
// Time: CUDA events on rank 0's stream, after a host barrier of all ranks (the all-reduces keep
// the ranks in lock step, so rank 0's time is the group's).
// Compression rounds at tp 2 and the union agreement's cost: benchmarks/bench_tp_union.cu.
//
// Counters: ms_step, tok_s, vs_tp1 (tp 1's ms_step of the same batch and mode / this row's: the
// speed-up), weight_GB_rank (bf16 weights one rank reads per step), kv_resident_GiB_rank,
// kv_live_GiB_rank, cached_len / logical_len (per sequence).
// Needs 2 GPUs and NCCL: with fewer it stops with an error before running anything.
// Run: build/benchmarks/bench_decode_step_tp   (about 3 minutes on 2 H200s; tp 1 holds 16.4 GB of
// weights + 39 GiB of KV on GPU 0, tp 2 about 9.5 GB + 20 GiB per GPU)
#include <benchmark/benchmark.h>

#include <barrier>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/keep_plan.hpp>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/tp/nccl_communicator.cuh>

#include "common/cuda_event_timer.hpp"
#include "common/decode_step_setup.cuh"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>
#include <reference_transformer/tensor_parallel.hpp>
#include <reference_transformer/tp_cuda.cuh>

namespace ex = triattn_example;
using triattn::SeqId;

namespace {

using namespace triattn::bench::decode_scenario;  // kLogical, kBudget, kDivide, kChunk, kBlock, kSeed
constexpr int kMaxTp = 2;

/// One rank: its GPU, backend, weight shard and decoder, and the cache of the current scenario.
struct Rank {
  int rank = 0;
  ex::CudaBackend backend;
  std::unique_ptr<ex::DeviceDecoder> decoder;
  std::unique_ptr<ex::GpuPlainCache> cache;
  int batch = 0;
  std::vector<SeqId> seqs;
  std::vector<int> tokens;
  triattn::KeepPlan prefix;  // keeps slots [0, kBudget)

  explicit Rank(int r) : rank(r), backend(triattn::bench::bf16_backend_options()) {}

  /// Back to kBudget cached tokens (the logical position keeps growing).
  void rewind() { triattn::bench::rewind_to_prefix(*cache, seqs, prefix); }
  [[nodiscard]] double mean_len() const { return triattn::bench::mean_cached_len(*cache, seqs); }
};

/// tp ranks on GPUs 0..tp-1, each driven from its own thread per call of run().
struct Group {
  int tp = 1;
  ex::ModelConfig full = ex::synthetic_config("qwen3-8b-like");
  std::vector<triattn::cuda::NcclCommunicator> comms;  // tp > 1
  std::vector<std::unique_ptr<Rank>> ranks;

  explicit Group(int t) : tp(t), ranks(static_cast<std::size_t>(t)) {
    if (tp > 1) {
      std::vector<int> devices(static_cast<std::size_t>(tp));
      std::iota(devices.begin(), devices.end(), 0);
      comms = triattn::cuda::NcclCommunicator::init_all(devices);
    }
    run([&](Rank*& unused, int r) {
      (void)unused;
      auto rk = std::make_unique<Rank>(r);
      if (tp > 1) ex::attach_nccl(rk->backend, comms[static_cast<std::size_t>(r)]);
      const ex::TpRank me{r, tp};
      rk->decoder = std::make_unique<ex::DeviceDecoder>(full, rk->backend, rk->backend.generate_synthetic(full, kSeed, me), me);
      ranks[static_cast<std::size_t>(r)] = std::move(rk);
    });
    const ex::DeviceDecoder& d = *ranks[0]->decoder;
    std::fprintf(stderr, "bench_decode_step_tp: tp %d, %s shard: %d q / %d kv heads, MLP %d; %.2f GB of bf16 weights per GPU\n",
                 tp, full.name.c_str(), d.config().n_heads, d.config().n_kv_heads, d.config().hidden_dim,
                 static_cast<double>(d.weights().bytes()) * 1e-9);
  }
  ~Group() {
    // Device memory of rank r is freed with device r current.
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      if (!ranks[r]) continue;
      (void)cudaSetDevice(static_cast<int>(r));
      ranks[r].reset();
    }
    (void)cudaSetDevice(0);
  }

  /// f(rank pointer, r) in tp threads, device r current in thread r. Rank pointers may be null
  /// while the group is being built.
  template <class F>
  void run(F&& f) {
    ex::run_ranks(tp, [&](int r) {
      TRIATTN_CUDA_TRY(cudaSetDevice(r));
      Rank* rk = ranks[static_cast<std::size_t>(r)].get();
      f(rk, r);
    });
    TRIATTN_BENCH_CUDA(cudaSetDevice(0));
  }

  /// Compressed caches of `batch` sequences at logical length kLogical (reused while unchanged).
  void scenario(int batch) {
    if (ranks[0]->batch == batch) return;
    run([&](Rank*& rk, int) {
      rk->cache.reset();  // the previous scenario's memory first
      rk->seqs.clear();
      rk->tokens.clear();
      const ex::ModelConfig& c = rk->decoder->config();
      const cudaStream_t stream = rk->backend.stream();
      triattn::CacheConfig cfg = triattn::bench::bf16_cache_config(c, kBlock, batch);
      const int blocks = (kBudget + kDivide + kBlock - 1) / kBlock + 1;
      cfg.num_blocks = batch * blocks + kChunk / kBlock;  // one sequence at a time holds an extra chunk
      cfg.max_blocks_per_seq = blocks + kChunk / kBlock;
      rk->cache = std::make_unique<ex::GpuPlainCache>(cfg, triattn::cuda::DeviceCompactor(stream));
      const triattn::bench::RandomKvChunk chunk(c, kChunk, stream);
      rk->prefix = triattn::bench::prefix_plan(c.n_layers, c.n_kv_heads, kBudget);
      for (int i = 0; i < batch; ++i) {
        const SeqId s = rk->cache->add_sequence();
        rk->seqs.push_back(s);
        rk->tokens.push_back((i * 7919 + 13) % c.vocab_size);
        triattn::bench::fill_compressed(*rk->cache, s, chunk, kLogical, rk->prefix, stream);
      }
      TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream));
      rk->batch = batch;
    });
  }
};

std::unique_ptr<Group>& group_slot() {
  static std::unique_ptr<Group> g;
  return g;
}
Group& group(int tp) {
  auto& g = group_slot();
  if (!g || g->tp != tp) {
    g.reset();  // one group's weights and caches at a time
    g = std::make_unique<Group>(tp);
  }
  return *g;
}

/// tp 1's ms_step by (batch, pipelined), for vs_tp1 of the tp 2 rows (registered later).
std::map<std::pair<int, int>, double>& tp1_ms() {
  static std::map<std::pair<int, int>, double> m;
  return m;
}

void decode_step(benchmark::State& state) {
  const int tp = static_cast<int>(state.range(0));
  const int batch = static_cast<int>(state.range(1));
  const bool pipelined = state.range(2) != 0;
  Group& g = group(tp);
  g.scenario(batch);
  g.run([&](Rank*& rk, int) { rk->rewind(); });
  std::vector<std::vector<int>> fixed(static_cast<std::size_t>(tp));
  for (int r = 0; r < tp; ++r) fixed[static_cast<std::size_t>(r)] = g.ranks[static_cast<std::size_t>(r)]->tokens;
  auto one_step = [&](Rank& rk, bool greedy) {
    std::vector<int>& fx = fixed[static_cast<std::size_t>(rk.rank)];
    rk.decoder->step(*rk.cache, std::span<const SeqId>(rk.seqs), greedy ? std::span<const int>(rk.tokens) : std::span<const int>(fx));
    if (greedy) rk.tokens = rk.decoder->argmax();
  };
  g.run([&](Rank*& rk, int) {  // warm-up: the first step captures the graph
    for (int w = 0; w < 3; ++w) one_step(*rk, true);
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(rk->backend.stream()));
  });
  const int steps_per_iter = pipelined ? 8 : 1;
  const cudaStream_t s0 = g.ranks[0]->backend.stream();
  cudaEvent_t t0, t1;
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t0));
  TRIATTN_BENCH_CUDA(cudaEventCreate(&t1));
  double total_s = 0.0, len_sum = 0.0;
  long long steps = 0;
  std::barrier<> start(tp);
  for (auto _ : state) {
    for (int i = 0; i < steps_per_iter; ++i) len_sum += g.ranks[0]->mean_len() + 1.0;
    g.run([&](Rank*& rk, int r) {
      start.arrive_and_wait();  // every rank is ready to launch
      if (r == 0) TRIATTN_CUDA_TRY(cudaEventRecord(t0, s0));
      for (int i = 0; i < steps_per_iter; ++i) {
        one_step(*rk, !pipelined);
        for (int& t : fixed[static_cast<std::size_t>(r)]) t = (t * 31 + 17) % g.full.vocab_size;
      }
      if (r == 0) TRIATTN_CUDA_TRY(cudaEventRecord(t1, s0));
    });
    total_s += triattn::bench::time_iteration(state, t0, t1);
    steps += steps_per_iter;
  }
  g.run([&](Rank*& rk, int) { TRIATTN_CUDA_TRY(cudaStreamSynchronize(rk->backend.stream())); });
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  const double ms_step = steps > 0 ? total_s * 1e3 / static_cast<double>(steps) : 0.0;
  const Rank& r0 = *g.ranks[0];
  const triattn::MemoryStats mem = r0.cache->memory();
  state.counters["tp"] = tp;
  state.counters["ms_step"] = ms_step;
  state.counters["tok_s"] = ms_step > 0 ? batch * 1e3 / ms_step : 0.0;
  if (tp == 1) tp1_ms()[{batch, pipelined ? 1 : 0}] = ms_step;
  else if (auto it = tp1_ms().find({batch, pipelined ? 1 : 0}); it != tp1_ms().end() && ms_step > 0)
    state.counters["vs_tp1"] = it->second / ms_step;
  state.counters["weight_GB_rank"] = static_cast<double>(r0.decoder->weights().bytes_per_step()) * 1e-9;
  state.counters["kv_resident_GiB_rank"] = static_cast<double>(mem.bytes_resident) / static_cast<double>(1ull << 30);
  state.counters["kv_live_GiB_rank"] = static_cast<double>(mem.bytes_live) / static_cast<double>(1ull << 30);
  state.counters["cached_len"] = steps > 0 ? len_sum / static_cast<double>(steps) : 0.0;
  state.counters["logical_len"] = static_cast<double>(r0.cache->logical_position(r0.seqs[0]));
  state.SetLabel("tp " + std::to_string(tp) + ", compressed, " + (pipelined ? "pipelined" : "latency"));
}

void BM_DecodeStepTp(benchmark::State& state) {
  triattn::bench::guarded(state, [&] { decode_step(state); });
}

}  // namespace

// tp 1 rows first: tp 2 rows report vs_tp1 against them; one group lives at a time.
BENCHMARK(BM_DecodeStepTp)
    ->ArgNames({"tp", "batch", "pipelined"})
    ->Args({1, 1, 0})
    ->Args({1, 1, 1})
    ->Args({1, 128, 0})
    ->Args({1, 128, 1})
    ->Args({2, 1, 0})
    ->Args({2, 1, 1})
    ->Args({2, 128, 0})
    ->Args({2, 128, 1})
    ->Iterations(12)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // This benchmark compares tp 1 with tp 2: without two GPUs and NCCL it has nothing to show.
  if (const std::string why = ex::gpu_tp_problem(kMaxTp); !why.empty()) {
    std::fprintf(stderr, "bench_decode_step_tp: error: %s\n", why.c_str());
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  group_slot().reset();  // device memory goes back before the CUDA runtime shuts down
  return 0;
}

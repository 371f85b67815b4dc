// SPDX-License-Identifier: Apache-2.0
// Where the ring scorers' time goes, per warp (a diagnostic, not a speed result: the trace adds
// clock reads to every item). Built with TRIATTN_RING_TRACE, so run_key_ring records per warp the
// %globaltimer at entry, after the first table wait, at its first compute and at exit, and the
// clock64 cycles it spent in the slice waits, prepare() (and the first one alone), compute() and
// issue() + fetch(). One traced launch of the mean scorer (mean_variant 2) or of the pipelined
// max scorer (max_variant 1-4, argument `variant`) on BM_score's shape (one sequence, 8 KV
// heads, 32 query heads, d = 128, bf16, page 16), after warm-up, with L2 holding none of the keys. Counters (µs from the
// earliest warp's entry; percentiles over warps): tables_*, first_*, end_*; cycle sums as
// fractions of the warp's loop: wait, prepare, compute, issue; first_prepare_us. With
// TRIATTN_TRACE_DIR set, the last iteration's per-warp rows go to
// $TRIATTN_TRACE_DIR/ring_trace_max<0|1>_v<variant>_<tokens>.csv.
#define TRIATTN_RING_TRACE 1

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/score_setup.cuh"

namespace {

using namespace triattn;
using namespace triattn::bench::score_setup;
using triattn::bench::device_alloc;

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

/// args: aggregation (0 mean, 1 max), the variant (mean 2; max 1-4: those run_key_ring runs), tokens
void BM_ring_trace(benchmark::State& state) {
  const bool max = state.range(0) != 0;
  const int variant = static_cast<int>(state.range(1));
  const int tokens = static_cast<int>(state.range(2));
  constexpr int kSeqs = 4;
  Setup s(1, 32, 8, tokens, kSeqs, 16, KvLayout::kNHD, max ? Aggregation::kMax : Aggregation::kMean, 1);
  cuda::ScoreOptions opt;
  opt.mean_variant = max ? 2 : variant;
  opt.max_variant = max ? variant : 1;
  int sms = 0;
  TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const std::size_t words = static_cast<std::size_t>(sms) * 16 * 32 * cuda::detail::kRingTraceWords;  // >= every warp
  unsigned long long* d_trace = device_alloc<unsigned long long>(words);
  TRIATTN_BENCH_CUDA(cudaMemcpyToSymbol(cuda::detail::ring_trace, &d_trace, sizeof(d_trace)));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  std::vector<unsigned long long> h(words);
  std::vector<double> tables, first, end, wait, prep, comp, issue, prep_first;
  int i = 0;
  for (auto _ : state) {
    TRIATTN_BENCH_CUDA(cudaMemsetAsync(d_trace, 0, words * sizeof(unsigned long long), stream));
    const cuda::ScoreBatch batch{s.seq_ids + i, s.t0 + i, 1, s.len};
    i = (i + 1) % kSeqs;  // the other sequences' K (3 x 64 MiB at 32K tokens) pushed this one out of L2
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, batch, s.scores, stream, opt));
    TRIATTN_BENCH_CUDA(cudaMemcpyAsync(h.data(), d_trace, words * sizeof(unsigned long long), cudaMemcpyDeviceToHost,
                                       stream));
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
    unsigned long long g0 = ~0ull;
    for (std::size_t w = 0; w < words; w += cuda::detail::kRingTraceWords)
      if (h[w + 9] != 0) g0 = std::min(g0, h[w]);
    for (std::size_t w = 0; w < words; w += cuda::detail::kRingTraceWords) {
      if (h[w + 9] == 0) continue;  // no warp here
      tables.push_back((h[w + 1] - g0) * 1e-3);
      first.push_back((h[w + 2] - g0) * 1e-3);
      end.push_back((h[w + 3] - g0) * 1e-3);
      const double loop = static_cast<double>(h[w + 4] + h[w + 5] + h[w + 6] + h[w + 7]);
      wait.push_back(h[w + 4] / loop);
      prep.push_back(h[w + 5] / loop);
      comp.push_back(h[w + 6] / loop);
      issue.push_back(h[w + 7] / loop);
      const double ns_per_cycle = (h[w + 3] - h[w + 2]) / std::max(loop, 1.0);  // rough: loop ≈ first → end
      prep_first.push_back(h[w + 8] * ns_per_cycle * 1e-3);
    }
  }
  if (const char* dir = std::getenv("TRIATTN_TRACE_DIR")) {
    const std::string path = std::string(dir) + "/ring_trace_max" + std::to_string(max ? 1 : 0) + "_v" +
                             std::to_string(variant) + "_" + std::to_string(tokens) + ".csv";
    if (FILE* f = std::fopen(path.c_str(), "w")) {
      std::fprintf(f, "warp_global,entry_ns,tables_ns,first_ns,end_ns,wait_clk,prepare_clk,compute_clk,issue_clk,"
                      "first_prepare_clk,items,sm\n");
      for (std::size_t w = 0; w < words; w += cuda::detail::kRingTraceWords) {
        if (h[w + 9] == 0) continue;
        const std::size_t idx = w / cuda::detail::kRingTraceWords;
        std::fprintf(f, "%zu", idx);  // blockIdx.x * warps per CTA + warp
        for (int k = 0; k < cuda::detail::kRingTraceWords; ++k) std::fprintf(f, ",%llu", h[w + k]);
        std::fprintf(f, "\n");
      }
      std::fclose(f);
    }
  }
  if (end.empty()) {
    state.SkipWithError("no warp wrote a trace");
    cudaStreamDestroy(stream);
    cudaFree(d_trace);
    return;
  }
  for (const auto& [name, v] : {std::pair<const char*, const std::vector<double>*>{"tables", &tables},
                                {"first", &first}, {"end", &end}}) {
    state.counters[std::string(name) + "_p10_us"] = percentile(*v, 0.1);
    state.counters[std::string(name) + "_p50_us"] = percentile(*v, 0.5);
    state.counters[std::string(name) + "_p90_us"] = percentile(*v, 0.9);
    state.counters[std::string(name) + "_max_us"] = percentile(*v, 1.0);
  }
  state.counters["end_min_us"] = percentile(end, 0.0);
  state.counters["wait"] = percentile(wait, 0.5);
  state.counters["prepare"] = percentile(prep, 0.5);
  state.counters["compute"] = percentile(comp, 0.5);
  state.counters["issue"] = percentile(issue, 0.5);
  state.counters["first_prepare_p50_us"] = percentile(prep_first, 0.5);
  state.counters["first_prepare_max_us"] = percentile(prep_first, 1.0);
  state.counters["warps"] = static_cast<double>(end.size()) / static_cast<double>(state.iterations());
  cudaStreamDestroy(stream);
  cudaFree(d_trace);
}

}  // namespace

BENCHMARK(BM_ring_trace)
    ->ArgNames({"max", "variant", "tokens"})
    ->ArgsProduct({{0}, {2}, {32768, 131072}})
    ->ArgsProduct({{1}, {1, 4}, {32768, 131072}})
    ->Iterations(20)
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

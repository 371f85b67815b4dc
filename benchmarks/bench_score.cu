// SPDX-License-Identifier: Apache-2.0
// cuda::score (TriAttention key scoring, one pass over K) on the brief's shape: one layer, one
// sequence of 32,768 tokens, 8 KV heads x 32 query heads (G = 4), head_dim 128, bf16 (64 MiB of K),
// mean (exact fold) and max (|D| = 17; tensor-core and CUDA-core kernels) aggregation, page sizes
// 16 and 64, NHD and HND.
// Four such sequences are scored in rotation (256 MiB of K) so the 50 MB L2 never holds the
// input. Argument `queued` (BM_score, BM_read_k): 1 launches a 30 µs GPU spin kernel before the
// start event, so the host enqueues the event and the measured launch while the GPU is busy and
// the time is GPU time only; 0 times from an idle GPU (the host's launch cost, a few µs, inside).
// Bytes = K read once + block-table entries + scores written (G floats per key);
// pct_read_roofline compares with the 4.49 TB/s read ceiling. BM_read_k streams the same K
// bytes with 16-byte loads and nothing else (the achievable read rate on this device).
// BM_score_round_shape: the scoring part of a Qwen3-8B round (36 layers, 2,560 tokens).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/score_setup.cuh"

namespace {

using namespace triattn;
using namespace triattn::bench::score_setup;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;
using triattn::bench::upload;
using triattn::bench::kReadRoofline;

void report(benchmark::State& state, double bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_read_roofline"] =
      benchmark::Counter(bytes / kReadRoofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
}

/// max aggregation on the CUDA cores for 16-bit caches (the fallback for fp16 weights near the limit)
struct CudaCoreMaxPolicy : cuda::tuning::sm90::Score {
  static constexpr bool kTensorCoreMax = false;
};

/// One layer's scores of `s` with the production policy, or the CUDA-core max policy (cuda_core_max).
cudaError_t score_layer(const Setup& s, const cuda::ScoreBatch& batch, float* scores, cudaStream_t stream,
                        bool cuda_core_max) {
  if (cuda_core_max)
    return cuda::score<T, std::int32_t, CudaCoreMaxPolicy>(s.view(), s.scorer->device_model(), batch, scores, stream);
  return s.scorer->score_async(s.view(), batch, scores, stream);
}

/// One layer's scores timed over the rotating sequences of `s` (warm-up first: module load,
/// occupancy queries); queued: launches back to back (launch overhead hidden).
void time_one_layer(benchmark::State& state, Setup& s, bool queued, bool cuda_core_max = false) {
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  for (int w = 0; w < 3; ++w)
    TRIATTN_BENCH_CUDA(score_layer(s, cuda::ScoreBatch{s.seq_ids, s.t0, 1, s.len}, s.scores, stream, cuda_core_max));
  s.time_rotating(state, stream, queued, [&](const cuda::ScoreBatch& batch) {
    TRIATTN_BENCH_CUDA(score_layer(s, batch, s.scores, stream, cuda_core_max));
  });
  report(state, s.bytes(1));
  cudaStreamDestroy(stream);
}

/// args: aggregation (0 mean, 1 max on the tensor cores, 2 max on the CUDA cores), page size,
/// layout (0 NHD, 1 HND), queued
void BM_score(benchmark::State& state) {
  const Aggregation agg = state.range(0) ? Aggregation::kMax : Aggregation::kMean;
  const int bs = static_cast<int>(state.range(1));
  const KvLayout layout = state.range(2) ? KvLayout::kHND : KvLayout::kNHD;
  constexpr int kSeqs = 4;  // 4 x 64 MiB of K in rotation: more than 5x the L2
  Setup s(1, 32, 8, 32768, kSeqs, bs, layout, agg, 1);
  time_one_layer(state, s, state.range(3) != 0, state.range(0) == 2);
}

/// BM_score's queued rows (page 16, NHD; agg 0 mean, agg 1 max) with the scores written to `buffers` buffers in rotation. With one buffer (BM_score) the score lines
/// a launch writes are overwritten in L2 by the next launch, so with the keys copied L2
/// evict-first they are never written back to HBM inside the timed kernels; 16 buffers (64 MiB of
/// scores, more than the 50 MB L2 holds) leave no steady state without write-backs inside the
/// timed launches, so this row charges the scorer for its output the way a stream of rounds
/// would.
void BM_score_rotated_scores(benchmark::State& state) {
  const bool max = state.range(0) != 0;
  const int buffers = static_cast<int>(state.range(1));
  constexpr int kSeqs = 4;
  Setup s(1, 32, 8, 32768, kSeqs, 16, KvLayout::kNHD, max ? Aggregation::kMax : Aggregation::kMean, 1);
  const std::size_t per = static_cast<std::size_t>(s.L) * s.Hq * s.len;  // floats per buffer
  float* rot = device_alloc<float>(per * static_cast<std::size_t>(buffers));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  int k = 0;
  for (int w = 0; w < buffers + 3; ++w, k = (k + 1) % buffers)  // every buffer written once before timing
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, cuda::ScoreBatch{s.seq_ids, s.t0, 1, s.len},
                                             rot + per * static_cast<std::size_t>(k), stream));
  s.time_rotating(state, stream, true, [&](const cuda::ScoreBatch& batch) {
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, batch, rot + per * static_cast<std::size_t>(k), stream));
    k = (k + 1) % buffers;
  });
  report(state, s.bytes(1));
  cudaStreamDestroy(stream);
  cudaFree(rot);
}

/// Where the mean scorer's time goes: BM_score's queued mean row (page 16, NHD) with the trig
/// term on (0) or off (1: disable_trig, the per-CTA float64 cos/sin and fold are skipped, the
/// keys are still read and the norm term and the MMAs still run).
/// Argument `shuffled` 0 lays each sequence's blocks out in order (the cache is then one
/// contiguous range per sequence, as BM_read_k reads it), 1 shuffles them as BM_score does.
void BM_score_trig(benchmark::State& state) {
  constexpr int kSeqs = 4;
  Setup s(1, 32, 8, 32768, kSeqs, 16, KvLayout::kNHD, Aggregation::kMean, 1, state.range(0) != 0,
          state.range(1) != 0);
  time_one_layer(state, s, true);
}

/// Probe: a ring scorer's memory path without its math. The per-warp cp.async rings of the
/// pipelined max scorer (detail::KeySliceFeed, detail::run_key_ring) over one layer's (row, tile)
/// items, 4 warps x 3 stages, 2 CTAs per SM, but compute() only folds one word of the slice into
/// a checksum: what the stream alone takes.
template <int kWarps, int kStages>
__global__ void __launch_bounds__(32 * kWarps, 2)
    ring_read_probe(KvCacheView<T, std::int32_t> view, cuda::ScoreBatch a, int Hkv, cuda::detail::FastDiv fd,
                    unsigned* sink) {
  using Shape = cuda::detail::MmaMeanShape<T, kHeadDim, kWarps, kStages>;
  extern __shared__ __align__(16) unsigned char probe_smem[];
  const int tiles_per_row = (a.max_len + Shape::kTile - 1) / Shape::kTile;
  const long long total = static_cast<long long>(a.batch) * Hkv * tiles_per_row;
  long long it0, it_end;
  cuda::detail::cta_item_range(total, it0, it_end);
  const int n_items = static_cast<int>(it_end - it0);
  if (n_items <= 0) return;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const uint4* const my_ring = reinterpret_cast<const uint4*>(probe_smem) + static_cast<std::size_t>(warp) * kStages * Shape::kSliceVecs;
  const std::uint32_t ring_addr = cuda::detail::smem_addr(my_ring);
  std::int32_t* const slots = reinterpret_cast<std::int32_t*>(probe_smem + Shape::kRingBytes) +
                              static_cast<std::size_t>(warp) * (kStages + 1) * 32;
  const long long row0 = it0 / tiles_per_row;
  cuda::detail::KeySliceFeed<T, std::int32_t, kHeadDim, Shape::kTile, 32, kStages> feed(
      row0, static_cast<int>(it0 - row0 * tiles_per_row), slots);
  const auto fetch = [&]() { feed.fetch(view, a, fd, tiles_per_row, 1, Hkv, 1, warp, lane); };
  const auto issue = [&](int stage) {
    feed.issue(view, a, fd, tiles_per_row, 1, Hkv, 1, warp, lane,
               ring_addr + static_cast<std::uint32_t>(stage * Shape::kSliceVecs * 16));
  };
  unsigned acc = 0;
  const auto compute = [&](int stage) { acc ^= my_ring[stage * Shape::kSliceVecs + lane].x; };
  const auto start = [&]() { feed.prime(view, a, 1, Hkv, 1); };
  cuda::detail::run_key_ring<kStages>(n_items, fetch, start, issue, [] { return true; }, compute);
  if (acc == 0x9e3779b9u) *sink = acc;
}
/// ring_read_probe launched as one wave of resident CTAs (sms x resident CTAs) on a Setup.
struct RingProbe {
  static constexpr int kWarps = 4, kStages = 3;
  using Shape = cuda::detail::MmaMeanShape<T, kHeadDim, kWarps, kStages>;
  static constexpr std::size_t kSmem = Shape::kRingBytes + Shape::kTableBytes;
  int ctas = 0;
  unsigned* sink = device_alloc<unsigned>(1);
  RingProbe() {
    auto kernel = ring_read_probe<kWarps, kStages>;
    TRIATTN_BENCH_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
    int sms = 0, per_sm = 0;
    TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    TRIATTN_BENCH_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Shape::kThreads, kSmem));
    ctas = sms * per_sm;
  }
  ~RingProbe() { cudaFree(sink); }
  void launch(const Setup& s, const cuda::ScoreBatch& batch, cudaStream_t stream) const {
    ring_read_probe<kWarps, kStages><<<ctas, Shape::kThreads, kSmem, stream>>>(s.view(), batch, s.Hkv,
                                                                              cuda::detail::FastDiv(s.bs), sink);
  }
};
void BM_ring_read_probe(benchmark::State& state) {
  constexpr int kSeqs = 4;
  Setup s(1, 32, 8, 32768, kSeqs, 16, KvLayout::kNHD, Aggregation::kMean, 1);
  const RingProbe probe;
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  s.time_rotating(state, stream, true, [&](const cuda::ScoreBatch& batch) { probe.launch(s, batch, stream); });
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["ctas"] = probe.ctas;
  report(state, static_cast<double>(s.len) * s.Hkv * kHeadDim * sizeof(T));
  cudaStreamDestroy(stream);
}

/// Streams `bytes` from p with 16-byte loads (kernel 0: one load per thread in flight, sms x 8
/// CTAs of 256; 1: four loads in flight, sms x 4 CTAs of 512; 2: eight loads in flight, sms x 2
/// CTAs of 1024).
void launch_read(int kernel, const uint4* p, std::size_t bytes, int sms, unsigned* sink, cudaStream_t stream) {
  if (kernel == 0)
    bench::stream_read_kernel<1, true><<<sms * 8, 256, 0, stream>>>(p, bytes / sizeof(uint4), sink);
  else if (kernel == 1)
    bench::stream_read_kernel<4, true><<<sms * 4, 512, 0, stream>>>(p, bytes / sizeof(uint4), sink);
  else
    bench::stream_read_kernel<8, true><<<sms * 2, 1024, 0, stream>>>(p, bytes / sizeof(uint4), sink);
}

/// Context: the K bytes of one BM_score iteration streamed with 16-byte loads and nothing else
/// (rotating too). args: queued, kernel (0: one load per thread in flight, sms x 8 CTAs of 256; 1: four loads
/// in flight, sms x 4 CTAs of 512; 2: eight loads in flight, sms x 2 CTAs of 1024)
void BM_read_k(benchmark::State& state) {
  constexpr std::size_t kBytes = 32768ull * 8 * kHeadDim * sizeof(T);
  constexpr int kCopies = 4;
  char* buf = device_alloc<char>(kBytes * kCopies);
  TRIATTN_BENCH_CUDA(cudaMemset(buf, 1, kBytes * kCopies));
  unsigned* sink = device_alloc<unsigned>(1);
  int sms = 0;
  TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  int i = 0;
  const bool queued = state.range(0) != 0;
  for (auto _ : state) {
    const uint4* p = reinterpret_cast<const uint4*>(buf + kBytes * static_cast<std::size_t>(i));
    i = (i + 1) % kCopies;
    if (queued) gpu_delay<<<1, 1, 0, stream>>>(kDelayNs);
    CudaEventTimer timer(state, stream);
    launch_read(static_cast<int>(state.range(1)), p, kBytes, sms, sink, stream);
  }
  report(state, static_cast<double>(kBytes));
  cudaStreamDestroy(stream);
  cudaFree(buf);
  cudaFree(sink);
}

/// Fixed cost against streaming rate: one sequence of `tokens` tokens (8 KV heads, d = 128, bf16,
/// page 16, shuffled blocks, rotating over 4 sequences, queued), read by kind 0 the mean scorer,
/// 1 a per-warp ring alone (ring_read_probe), 2 a plain 16-byte read of the same number of K bytes
/// (read kernel 2). A line through time vs bytes splits each into a fixed cost (intercept) and a
/// streaming rate (slope).
void BM_length_sweep(benchmark::State& state) {
  const int kind = static_cast<int>(state.range(0));
  const int tokens = static_cast<int>(state.range(1));
  constexpr int kSeqs = 4;
  Setup s(1, 32, 8, tokens, kSeqs, 16, KvLayout::kNHD, Aggregation::kMean, 1);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  const double k_bytes = static_cast<double>(tokens) * s.Hkv * kHeadDim * sizeof(T);
  const RingProbe probe;
  int sms = 0;
  TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int w = 0; w < 3; ++w)
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, cuda::ScoreBatch{s.seq_ids, s.t0, 1, s.len}, s.scores, stream));
  s.time_rotating(state, stream, true, [&](const cuda::ScoreBatch& batch) {
    if (kind == 0) {
      TRIATTN_BENCH_CUDA(s.scorer->score_async(view, batch, s.scores, stream));
    } else if (kind == 1) {
      probe.launch(s, batch, stream);
    } else {  // sequence k's K range: the layer's blocks in allocation order (no table walk)
      const std::size_t per_seq_bytes = static_cast<std::size_t>(s.per_seq) * s.bl.block_elems() * sizeof(T);
      const auto* base = reinterpret_cast<const char*>(s.data);
      launch_read(2, reinterpret_cast<const uint4*>(base + per_seq_bytes * static_cast<std::size_t>(batch.seq_ids - s.seq_ids)),
                  static_cast<std::size_t>(k_bytes), sms, probe.sink, stream);
    }
  });
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["k_bytes"] = k_bytes;
  report(state, kind == 0 ? s.bytes(1) : k_bytes);
  cudaStreamDestroy(stream);
}

/// Scoring part of a compression round at Qwen3-8B shape: 36 layers, 32/8 heads, 2,560 tokens.
/// args: batch, aggregation (0 mean, 1 max). L2 flushed before each iteration (the flush also
/// keeps the GPU busy while the host enqueues the launch).
void BM_score_round_shape(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const Aggregation agg = state.range(1) ? Aggregation::kMax : Aggregation::kMean;
  Setup s(36, 32, 8, 2560, batch, 16, KvLayout::kNHD, agg, batch);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  const cuda::ScoreBatch sb{s.seq_ids, s.t0, batch, s.len};
  TRIATTN_BENCH_CUDA(s.scorer->score_async(view, sb, s.scores, stream));
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, sb, s.scores, stream));
  }
  report(state, s.bytes(batch));
  cudaStreamDestroy(stream);
}

}  // namespace

BENCHMARK(BM_score)
    ->ArgNames({"agg", "page", "hnd", "queued"})
    ->ArgsProduct({{0, 1, 2}, {16, 64}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_score_rotated_scores)
    ->ArgNames({"agg", "buffers"})
    ->ArgsProduct({{0, 1}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_score_trig)
    ->ArgNames({"disable_trig", "shuffled"})
    ->ArgsProduct({{0, 1}, {1, 0}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ring_read_probe)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_length_sweep)
    ->ArgNames({"kind", "tokens"})
    ->ArgsProduct({{0, 1, 2}, {8192, 16384, 32768, 65536, 131072}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_read_k)->ArgNames({"queued", "kernel"})->ArgsProduct({{0, 1}, {0, 1, 2}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_score_round_shape)
    ->ArgNames({"batch", "max"})
    ->ArgsProduct({{1, 8, 32}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

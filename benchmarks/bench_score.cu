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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/cuda_event_timer.hpp"
#include "common/device_memory.cuh"

#include <triattn/core/dtype.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/algorithms/score.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;
using triattn::bench::CudaEventTimer;
using triattn::bench::L2Flusher;
using triattn::bench::device_alloc;
using triattn::bench::upload;

using triattn::bench::kReadRoofline;
constexpr int kHeadDim = 128;

/// Keeps one thread busy for `ns` nanoseconds of GPU time (see `queued` above).
__global__ void gpu_delay(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
constexpr unsigned long long kDelayNs = 30000;


QueryStats random_stats(int L, int Hq, int d) {
  std::mt19937 rng(5);
  return random_query_stats(rng, L, Hq, d, RopeStyle::kHalf, "bench");
}

/// A device cache of `seqs` sequences x `len` tokens with shuffled blocks, plus a scorer.
struct Setup {
  int L, Hq, Hkv, len, seqs, bs;
  BlockLayout bl;
  int per_seq, blocks;
  T* data = nullptr;
  std::int32_t *tables = nullptr, *lens = nullptr, *seq_ids = nullptr;
  std::int64_t* t0 = nullptr;
  float* scores = nullptr;
  std::unique_ptr<cuda::TriAttentionDeviceScorer> scorer;

  Setup(int L_, int Hq_, int Hkv_, int len_, int seqs_, int bs_, KvLayout layout, Aggregation agg, int batch,
        bool disable_trig = false, bool shuffle_blocks = true)
      : L(L_), Hq(Hq_), Hkv(Hkv_), len(len_), seqs(seqs_), bs(bs_), bl{layout, bs_, Hkv_, kHeadDim} {
    per_seq = (len + bs - 1) / bs;
    blocks = seqs * per_seq;
    const std::size_t elems = 2ull * L * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(bl.block_elems());
    data = device_alloc<T>(elems);
    bench::fill_gaussian_bf16<<<2048, 256>>>(reinterpret_cast<std::uint16_t*>(data), elems, 7);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
    for (int i = 0; i < blocks; ++i) ids[static_cast<std::size_t>(i)] = i;
    if (shuffle_blocks)  // else each sequence's blocks lie in order, one contiguous range
      std::shuffle(ids.begin(), ids.end(), std::mt19937(3));  // row s = blocks [s*per_seq, (s+1)*per_seq)
    tables = upload(ids);
    lens = upload(std::vector<std::int32_t>(static_cast<std::size_t>(seqs), len));
    std::vector<std::int32_t> sid(static_cast<std::size_t>(seqs) + batch);
    for (std::size_t i = 0; i < sid.size(); ++i) sid[i] = static_cast<std::int32_t>(i % seqs);
    seq_ids = upload(sid);
    t0 = upload(std::vector<std::int64_t>(sid.size(), static_cast<std::int64_t>(len) + 100000));
    scores = device_alloc<float>(static_cast<std::size_t>(batch) * L * Hq * len);
    RopeConfig rope;
    rope.theta = 1e6;
    ScoringParams sp;
    sp.aggregation = agg;
    sp.disable_trig = disable_trig;
    scorer = std::make_unique<cuda::TriAttentionDeviceScorer>(random_stats(L, Hq, kHeadDim), rope, sp, Hkv);
    TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  }
  ~Setup() {
    for (void* p : {static_cast<void*>(data), static_cast<void*>(tables), static_cast<void*>(lens),
                    static_cast<void*>(seq_ids), static_cast<void*>(t0), static_cast<void*>(scores)})
      cudaFree(p);
  }
  KvCacheView<T, std::int32_t> view() const {
    return {data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, L, blocks, seqs, per_seq, tables, lens};
  }
  /// The timed loop of the rotating benchmarks: iteration k launches launch(batch) on sequence
  /// k % seqs (so L2 never holds its K), after a GPU spin kernel when `queued`.
  template <class Launch>
  void time_rotating(benchmark::State& state, cudaStream_t stream, bool queued, Launch&& launch) const {
    int i = 0;
    for (auto _ : state) {
      const cuda::ScoreBatch batch{seq_ids + i, t0 + i, 1, len};
      i = (i + 1) % seqs;
      if (queued) gpu_delay<<<1, 1, 0, stream>>>(kDelayNs);
      CudaEventTimer timer(state, stream);
      launch(batch);
    }
  }
  /// Bytes one scoring of `batch` sequences moves at least.
  double bytes(int batch) const {
    const double tokens = static_cast<double>(batch) * L * len;
    return tokens * Hkv * kHeadDim * sizeof(T) + tokens * Hq * sizeof(float) +
           static_cast<double>(batch) * L * Hkv * per_seq * sizeof(std::int32_t);
  }
};

void report(benchmark::State& state, double bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_read_roofline"] =
      benchmark::Counter(bytes / kReadRoofline * 100.0, benchmark::Counter::kIsIterationInvariantRate);
}

/// args: aggregation (0 mean, 1 max on the tensor cores, 2 max on the CUDA cores), page size,
/// layout (0 NHD, 1 HND), kernel variant (agg:0 ScoreOptions::mean_variant, agg:1 max_variant),
/// queued
void BM_score(benchmark::State& state) {
  const Aggregation agg = state.range(0) ? Aggregation::kMax : Aggregation::kMean;
  cuda::ScoreOptions opt;
  opt.tensor_core_max = state.range(0) != 2;
  opt.mean_variant = state.range(0) == 0 ? static_cast<int>(state.range(3)) : 0;
  opt.max_variant = state.range(0) == 1 ? static_cast<int>(state.range(3)) : 0;
  const int bs = static_cast<int>(state.range(1));
  const KvLayout layout = state.range(2) ? KvLayout::kHND : KvLayout::kNHD;
  constexpr int kSeqs = 4;  // 4 x 64 MiB of K in rotation: more than 5x the L2
  Setup s(1, 32, 8, 32768, kSeqs, bs, layout, agg, 1);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  for (int w = 0; w < 3; ++w)  // warm-up: module load, occupancy queries
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, cuda::ScoreBatch{s.seq_ids, s.t0, 1, s.len}, s.scores, stream, opt));
  s.time_rotating(state, stream, state.range(4) != 0, [&](const cuda::ScoreBatch& batch) {
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, batch, s.scores, stream, opt));
  });
  report(state, s.bytes(1));
  cudaStreamDestroy(stream);
}

/// Where the mean scorer's time goes: BM_score's queued mean row (page 16, NHD) with the trig
/// term on (0) or off (1: disable_trig, the per-CTA float64 cos/sin and fold are skipped, the
/// keys are still read and the norm term and the MMAs still run), per mean variant.
/// Argument `shuffled` 0 lays each sequence's blocks out in order (the cache is then one
/// contiguous range per sequence, as BM_read_k reads it), 1 shuffles them as BM_score does.
void BM_score_trig(benchmark::State& state) {
  cuda::ScoreOptions opt;
  opt.mean_variant = static_cast<int>(state.range(1));
  constexpr int kSeqs = 4;
  Setup s(1, 32, 8, 32768, kSeqs, 16, KvLayout::kNHD, Aggregation::kMean, 1, state.range(0) != 0,
          state.range(2) != 0);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  for (int w = 0; w < 3; ++w)
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, cuda::ScoreBatch{s.seq_ids, s.t0, 1, s.len}, s.scores, stream, opt));
  s.time_rotating(state, stream, true, [&](const cuda::ScoreBatch& batch) {
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, batch, s.scores, stream, opt));
  });
  report(state, s.bytes(1));
  cudaStreamDestroy(stream);
}

/// Probe: the tensor-core mean scorer's memory path without its math. The same per-warp cp.async
/// rings (detail::KeySliceFeed, detail::run_key_ring) over the same (row, tile) items and grid
/// as mean_variant 2 (4 warps x 3 stages, 2 CTAs per SM), but compute() only folds one word of
/// the slice into a checksum. Compared with BM_score/variant:2 it splits the scorer's time into
/// the stream and the math.
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
  const std::uint32_t ring_addr = cuda::detail::score_smem_addr(my_ring);
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
  feed.prime(view, a, 1, Hkv, 1);
  cuda::detail::run_key_ring<kStages>(n_items, fetch, issue, [] { return true; }, compute);
  if (acc == 0x9e3779b9u) *sink = acc;
}
void BM_ring_read_probe(benchmark::State& state) {
  constexpr int kWarps = 4, kStages = 3, kSeqs = 4;
  using Shape = cuda::detail::MmaMeanShape<T, kHeadDim, kWarps, kStages>;
  Setup s(1, 32, 8, 32768, kSeqs, 16, KvLayout::kNHD, Aggregation::kMean, 1);
  const auto view = s.view();
  const std::size_t smem = Shape::kRingBytes + Shape::kTableBytes;
  auto kernel = ring_read_probe<kWarps, kStages>;
  TRIATTN_BENCH_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int sms = 0, per_sm = 0;
  TRIATTN_BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  TRIATTN_BENCH_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Shape::kThreads, smem));
  unsigned* sink = device_alloc<unsigned>(1);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const cuda::detail::FastDiv fd(s.bs);
  s.time_rotating(state, stream, true, [&](const cuda::ScoreBatch& batch) {
    kernel<<<sms * per_sm, Shape::kThreads, smem, stream>>>(view, batch, s.Hkv, fd, sink);
  });
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  state.counters["ctas"] = sms * per_sm;
  report(state, static_cast<double>(s.len) * s.Hkv * kHeadDim * sizeof(T));
  cudaStreamDestroy(stream);
  cudaFree(sink);
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
    if (state.range(1) == 0)
      bench::stream_read_kernel<1, true><<<sms * 8, 256, 0, stream>>>(p, kBytes / sizeof(uint4), sink);
    else if (state.range(1) == 1)
      bench::stream_read_kernel<4, true><<<sms * 4, 512, 0, stream>>>(p, kBytes / sizeof(uint4), sink);
    else
      bench::stream_read_kernel<8, true><<<sms * 2, 1024, 0, stream>>>(p, kBytes / sizeof(uint4), sink);
  }
  report(state, static_cast<double>(kBytes));
  cudaStreamDestroy(stream);
  cudaFree(buf);
  cudaFree(sink);
}

/// Scoring part of a compression round at Qwen3-8B shape: 36 layers, 32/8 heads, 2,560 tokens.
/// args: batch, aggregation, kernel variant (mean_variant or max_variant). L2 flushed before each
/// iteration (the flush also keeps the GPU busy while the host enqueues the launch).
void BM_score_round_shape(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const Aggregation agg = state.range(1) ? Aggregation::kMax : Aggregation::kMean;
  cuda::ScoreOptions opt;
  opt.mean_variant = state.range(1) == 0 ? static_cast<int>(state.range(2)) : 0;
  opt.max_variant = state.range(1) == 1 ? static_cast<int>(state.range(2)) : 0;
  Setup s(36, 32, 8, 2560, batch, 16, KvLayout::kNHD, agg, batch);
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  const auto view = s.view();
  const cuda::ScoreBatch sb{s.seq_ids, s.t0, batch, s.len};
  TRIATTN_BENCH_CUDA(s.scorer->score_async(view, sb, s.scores, stream, opt));
  L2Flusher flush;
  for (auto _ : state) {
    CudaEventTimer timer(state, stream, &flush);
    TRIATTN_BENCH_CUDA(s.scorer->score_async(view, sb, s.scores, stream, opt));
  }
  report(state, s.bytes(batch));
  cudaStreamDestroy(stream);
}

}  // namespace

BENCHMARK(BM_score)
    ->ArgNames({"agg", "page", "hnd", "variant", "queued"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (int queued : {0, 1})
        for (int agg : {0, 1, 2})
          for (int page : {16, 64})
            for (int hnd : {0, 1})
              for (int variant : {0, 1, 2, 3, 4})
                if (agg == 0 || variant == 0 || (agg == 1 && variant == 1))
                  b->Args({agg, page, hnd, variant, queued});
    })
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_score_trig)
    ->ArgNames({"disable_trig", "variant", "shuffled"})
    ->ArgsProduct({{0, 1}, {0, 2}, {1, 0}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ring_read_probe)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_read_k)->ArgNames({"queued", "kernel"})->ArgsProduct({{0, 1}, {0, 1, 2}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_score_round_shape)
    ->ArgNames({"batch", "max", "variant"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (int batch : {1, 8, 32})
        for (int max : {0, 1})
          for (int variant : {0, 1, 2, 3, 4})
            if ((max == 0 && variant != 1) || (max == 1 && variant <= 1)) b->Args({batch, max, variant});
    })
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();

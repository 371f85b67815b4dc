// SPDX-License-Identifier: Apache-2.0
// cuda::decode_attention on Qwen3-8B shapes: GQA 32 query / 8 KV heads, head_dim 128, bf16, one
// layer, batch 1 and 16 sequences of 32768 tokens, pages of 16 and 64 (shuffled block tables),
// bf16 output. Bytes = K + V read; roofline = 4.49 TB/s (H200 pure read). L2 is flushed before
// every iteration, two ways (argument `flush`): 0 memset (L2 left dirty: the timed kernels also pay
// up to 50 MB of write-back), 1 read (L2 left clean, as after a decode step's GEMVs). For context: BM_read_kernel streams the same bytes through a plain read
// kernel, BM_memcpy_d2d copies them with cudaMemcpyAsync (counted read + write, vs 4.25 TB/s).
// Batch 1 and 16. Counters: us_med (median iteration), TB/s (bytes / median). A table in GB/s
// closes the output. Pick a subset with e.g. --benchmark_filter='decode_attention/batch:1/.*page:16/hnd:0'.
// Argument `fp8`: 1 reads an fp8 (e4m3) cache with per-(K/V, head) scales (float queries and
// output, the fp32 kernel); its bytes are the fp8 K + V (issue #46: >= 85% of the read bandwidth).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/cuda_event_timer.hpp"

#include <triattn/core/ref/attention.hpp>
#include <triattn/cuda/algorithms/decode_attention.cuh>

namespace {

using namespace triattn;
using T = bf16_storage;  // the context benchmarks' element (BM_read_kernel, BM_memcpy_d2d)
using triattn::bench::L2Flush;
using triattn::bench::L2Flusher;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr double kReadRoofline = 4.49e12;  // bytes/s, pure read
constexpr double kCopyRoofline = 4.25e12;  // bytes/s, read + write

/// The fills' bits of (index, seed).
__device__ __forceinline__ std::uint32_t fill_hash(std::size_t i, std::uint32_t seed) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return x;
}

__global__ void fill_random(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t x = fill_hash(i, seed);
    p[i] = static_cast<std::uint16_t>((x & 0x8000u) | ((126u + ((x >> 8) & 1u)) << 7) | (x & 0x7Fu));
  }
}

/// Floats in ±[0.5, 2) from the same hash (fp8 caches take float queries).
__global__ void fill_random_f32(float* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t x = fill_hash(i, seed);
    p[i] = ((x & 0x8000u) ? -1.0f : 1.0f) * (0.5f + 1.5f * static_cast<float>(x & 0x7FFu) / 2048.0f);
  }
}

/// fp8 e4m3 values in ±[0.5, 2) (stored; the view's scales multiply them).
__global__ void fill_random_fp8(std::uint8_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t x = fill_hash(i, seed);
    p[i] = static_cast<std::uint8_t>((x & 0x80u) | ((6u + ((x >> 8) & 1u)) << 3) | (x & 0x7u));  // exponent 6/7: 2^-1, 2^0
  }
}

template <class V>
void fill_values(V* p, std::size_t n, std::uint32_t seed, int blocks) {
  if constexpr (std::is_same_v<V, float>) fill_random_f32<<<blocks, 256>>>(p, n, seed);
  else if constexpr (std::is_same_v<V, fp8_e4m3_storage>) fill_random_fp8<<<blocks, 256>>>(reinterpret_cast<std::uint8_t*>(p), n, seed);
  else fill_random<<<blocks, 256>>>(reinterpret_cast<std::uint16_t*>(p), n, seed);
}

double to_double(float x) { return x; }
double to_double(bf16_storage x) {
  const std::uint32_t u = static_cast<std::uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class U>
U* device_alloc(std::size_t n) {
  U* p = nullptr;
  TRIATTN_BENCH_CUDA(cudaMalloc(&p, n * sizeof(U)));
  return p;
}

/// CudaEventTimer that also keeps each iteration's time (microseconds) for the median.
class SampledTimer {
 public:
  SampledTimer(benchmark::State& state, cudaStream_t stream, L2Flusher* flush, std::vector<double>& us)
      : state_(state), stream_(stream), us_(us) {
    if (flush) flush->flush(stream_);
    TRIATTN_BENCH_CUDA(cudaEventCreate(&start_));
    TRIATTN_BENCH_CUDA(cudaEventCreate(&stop_));
    TRIATTN_BENCH_CUDA(cudaEventRecord(start_, stream_));
  }
  ~SampledTimer() {
    TRIATTN_BENCH_CUDA(cudaEventRecord(stop_, stream_));
    TRIATTN_BENCH_CUDA(cudaEventSynchronize(stop_));
    float ms = 0.f;
    TRIATTN_BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    state_.SetIterationTime(static_cast<double>(ms) * 1e-3);
    us_.push_back(static_cast<double>(ms) * 1e3);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  SampledTimer(const SampledTimer&) = delete;
  SampledTimer& operator=(const SampledTimer&) = delete;

 private:
  benchmark::State& state_;
  cudaStream_t stream_;
  std::vector<double>& us_;
  cudaEvent_t start_{}, stop_{};
};

/// One line of the closing table.
struct Row {
  std::string name;
  double us_med, us_min, gbps;
};
std::vector<Row>& rows() {
  static std::vector<Row> r;
  return r;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Plain counters (no rate flags): us_med, TB/s and pct_roofline from the median iteration.
void report(benchmark::State& state, const std::string& label, double bytes, double roofline,
            const std::vector<double>& us) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  const double med = median(us);
  const double bps = med > 0 ? bytes / (med * 1e-6) : 0.0;
  state.counters["us_med"] = benchmark::Counter(med);
  state.counters["TB/s"] = benchmark::Counter(bps * 1e-12);
  state.counters["pct_roofline"] = benchmark::Counter(bps / roofline * 100.0);
  if (state.thread_index() == 0 && !us.empty())
    rows().push_back({label, med, *std::min_element(us.begin(), us.end()), bps * 1e-9});
}

/// Argument `flush`: 0 memsets 2x L2 before each iteration (L2 left full of dirty lines whose
/// write-back the timed kernels pay), 1 reads 2x L2 (clean L2; see L2Flush).
L2Flush flush_mode(std::int64_t arg) { return arg ? L2Flush::kClean : L2Flush::kDirty; }
const char* flush_name(std::int64_t arg) { return arg ? " clean-L2" : " dirty-L2"; }

/// args: batch, seq_len, block_size, layout (0 NHD, 1 HND), flush, fp8; Tc the cache's element
template <class Tc>
void decode_attention_bench(benchmark::State& state) {
  using Q = cuda::query_type_t<Tc>;
  using O = std::conditional_t<is_scaled_dtype<Tc>, float, Tc>;
  const int batch = static_cast<int>(state.range(0));
  const int len = static_cast<int>(state.range(1));
  const int bs = static_cast<int>(state.range(2));
  const KvLayout layout = state.range(3) ? KvLayout::kHND : KvLayout::kNHD;
  const int per_seq = (len + bs - 1) / bs;
  const int blocks = batch * per_seq;
  const BlockLayout bl{layout, bs, kKvHeads, kHeadDim};
  const std::size_t elems = 2ull * blocks * static_cast<std::size_t>(bl.block_elems());
  Tc* data = device_alloc<Tc>(elems);
  fill_values(data, elems, 1, 1024);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
  std::int32_t* d_tables = device_alloc<std::int32_t>(ids.size());
  std::int32_t* d_lens = device_alloc<std::int32_t>(lens.size());
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_tables, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  TRIATTN_BENCH_CUDA(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  auto view = KvCacheView<Tc, std::int32_t>::contiguous(data, static_cast<std::int64_t>(blocks) * bl.block_elems(), bl,
                                                         1, blocks, batch, per_seq, d_tables, d_lens);
  float* d_scales = nullptr;  // fp8: one scale per (K/V, head), distinct so a wrong index shows in the check
  if constexpr (is_scaled_dtype<Tc>) {
    std::vector<float> sc(2 * kKvHeads);
    for (std::size_t i = 0; i < sc.size(); ++i) sc[i] = 0.5f + 0.0625f * static_cast<float>(i);
    d_scales = device_alloc<float>(sc.size());
    TRIATTN_BENCH_CUDA(cudaMemcpy(d_scales, sc.data(), sc.size() * 4, cudaMemcpyHostToDevice));
    view = view.with_scales(d_scales, kKvHeads);
  }
  const std::size_t q_elems = static_cast<std::size_t>(batch) * kQHeads * kHeadDim;
  Q* q = device_alloc<Q>(q_elems);
  O* out = device_alloc<O>(q_elems);
  fill_values(q, q_elems, 2, 64);

  int resident = 0;
  TRIATTN_BENCH_CUDA(cuda::decode_attention::resident_ctas<Tc>(kHeadDim, &resident));
  const auto plan = cuda::decode_attention::make_plan(dtype_of<Tc>, batch, kKvHeads, kQHeads / kKvHeads, len, resident);
  const std::size_t ws_bytes = cuda::decode_attention::workspace_size(plan, batch, kQHeads, kHeadDim);
  void* ws = ws_bytes ? device_alloc<char>(ws_bytes) : nullptr;
  const float scale = ref::default_sm_scale(kHeadDim);

  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  TRIATTN_BENCH_CUDA(cudaDeviceSynchronize());
  L2Flusher flush(flush_mode(state.range(4)));
  for (int w = 0; w < 3; ++w)  // warm-up: module load, attribute setting
    TRIATTN_BENCH_CUDA(cuda::decode_attention::run(plan, view, 0, q, out, batch, kQHeads, nullptr, scale, ws, ws_bytes,
                                                   stream));
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (auto _ : state) {
    SampledTimer timer(state, stream, &flush, us);
    TRIATTN_BENCH_CUDA(cuda::decode_attention::run(plan, view, 0, q, out, batch, kQHeads, nullptr, scale, ws, ws_bytes,
                                                   stream));
  }
  TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
  TRIATTN_BENCH_CUDA(cudaGetLastError());
  report(state,
         std::string(is_scaled_dtype<Tc> ? "decode_attention fp8" : "decode_attention") + " batch " +
             std::to_string(batch) + " page " + std::to_string(bs) + (layout == KvLayout::kHND ? " HND" : " NHD") +
             flush_name(state.range(4)),
         static_cast<double>(
             cuda::decode_attention::bytes_read(static_cast<std::int64_t>(batch) * len, kKvHeads, kHeadDim, sizeof(Tc))),
         kReadRoofline, us);
  state.counters["splits"] = plan.num_splits;
  state.counters["resident_ctas"] = resident;

  // Same function with one split (no combine kernel) on these inputs: relative L2 difference of
  // the outputs (bf16: both rounded to bf16, expect ~1e-3, far under 1e-2; fp8: float outputs).
  {
    auto plan0 = plan;
    plan0.num_splits = 1;
    plan0.tokens_per_split = len;
    const std::size_t ws0_bytes = cuda::decode_attention::workspace_size(plan0, batch, kQHeads, kHeadDim);
    void* ws0 = ws0_bytes ? device_alloc<char>(ws0_bytes) : nullptr;
    O* out0 = device_alloc<O>(q_elems);
    TRIATTN_BENCH_CUDA(cuda::decode_attention::run(plan0, view, 0, q, out0, batch, kQHeads, nullptr, scale, ws0,
                                                   ws0_bytes, stream));
    TRIATTN_BENCH_CUDA(cudaStreamSynchronize(stream));
    std::vector<O> a(q_elems), r(q_elems);
    TRIATTN_BENCH_CUDA(cudaMemcpy(a.data(), out, q_elems * sizeof(O), cudaMemcpyDeviceToHost));
    TRIATTN_BENCH_CUDA(cudaMemcpy(r.data(), out0, q_elems * sizeof(O), cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (std::size_t i = 0; i < q_elems; ++i) {
      const double d = to_double(a[i]) - to_double(r[i]);
      num += d * d;
      den += to_double(r[i]) * to_double(r[i]);
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    state.counters["err_vs_one_split"] = benchmark::Counter(rel);
    if (!(rel <= 1e-2)) {
      std::fprintf(stderr, "MISMATCH: differs from one split by %g (batch %d page %d)\n", rel, batch, bs);
      state.SkipWithError("output differs from the one-split run");
    }
    cudaFree(out0);
    if (ws0) cudaFree(ws0);
  }
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(data), static_cast<void*>(d_tables), static_cast<void*>(d_lens),
                  static_cast<void*>(q), static_cast<void*>(out), static_cast<void*>(d_scales), ws})
    cudaFree(p);
}

void BM_decode_attention(benchmark::State& state) {
  if (state.range(5) != 0)
    decode_attention_bench<fp8_e4m3_storage>(state);
  else
    decode_attention_bench<bf16_storage>(state);
}

/// Context: a plain streaming read of the K + V bytes of BM_decode_attention/<batch>/<len>.
void BM_read_kernel(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(cuda::decode_attention::bytes_read(
      static_cast<std::int64_t>(state.range(0)) * state.range(1), kKvHeads, kHeadDim, sizeof(T)));
  uint4* src = device_alloc<uint4>(bytes / 16);
  unsigned* sink = device_alloc<unsigned>(1);
  TRIATTN_BENCH_CUDA(cudaMemset(src, 1, bytes));
  int sms = 0;
  TRIATTN_BENCH_CUDA(cuda::current_device_sm_count(&sms));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  L2Flusher flush(flush_mode(state.range(2)));
  std::vector<double> us;
  for (auto _ : state) {
    SampledTimer timer(state, stream, &flush, us);
    bench::stream_read_kernel<1, true><<<sms * 8, 256, 0, stream>>>(src, bytes / 16, sink);
    TRIATTN_BENCH_CUDA(cudaGetLastError());
  }
  report(state, "read_kernel batch " + std::to_string(state.range(0)) + flush_name(state.range(2)), static_cast<double>(bytes), kReadRoofline, us);
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(sink);
}

/// Context: cudaMemcpyAsync of the same K + V bytes (counted read + write, vs the copy roofline).
void BM_memcpy_d2d(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(cuda::decode_attention::bytes_read(
      static_cast<std::int64_t>(state.range(0)) * state.range(1), kKvHeads, kHeadDim, sizeof(T)));
  char* src = device_alloc<char>(bytes);
  char* dst = device_alloc<char>(bytes);
  TRIATTN_BENCH_CUDA(cudaMemset(src, 1, bytes));
  cudaStream_t stream;
  TRIATTN_BENCH_CUDA(cudaStreamCreate(&stream));
  L2Flusher flush(flush_mode(state.range(2)));
  std::vector<double> us;
  for (auto _ : state) {
    SampledTimer timer(state, stream, &flush, us);
    TRIATTN_BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  report(state, "memcpy_d2d (read + write) batch " + std::to_string(state.range(0)) + flush_name(state.range(2)), 2.0 * bytes, kCopyRoofline, us);
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(dst);
}

}  // namespace

BENCHMARK(BM_decode_attention)
    ->ArgNames({"batch", "len", "page", "hnd", "flush", "fp8"})
    ->ArgsProduct({{1, 16}, {32768}, {16, 64}, {0, 1}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_read_kernel)
    ->ArgNames({"batch", "len", "flush"})
    ->ArgsProduct({{1, 16}, {32768}, {0, 1}})
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_memcpy_d2d)
    ->ArgNames({"batch", "len", "flush"})
    ->ArgsProduct({{1, 16}, {32768}, {0, 1}})
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("\n%-48s %9s %9s %8s\n", "benchmark", "us_med", "us_min", "GB/s");
  for (const Row& r : rows()) std::printf("%-48s %9.1f %9.1f %8.0f\n", r.name.c_str(), r.us_med, r.us_min, r.gbps);
  return 0;
}

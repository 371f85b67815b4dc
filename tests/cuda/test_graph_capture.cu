// SPDX-License-Identifier: Apache-2.0
// A whole compression round (score → normalise → reduce → select → compact) captured once in a
// CUDA graph (global capture mode: no host synchronisation, allocation or host data inside) and
// replayed: every replay must reproduce the eager round bitwise (keep plan and compacted cache),
// and a replay after the per-sequence inputs changed in device memory (t0, prompt lengths) must
// equal an eager round on those new inputs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

using namespace triattn;

namespace {

#define TEST_CUDA(call)                                                                                \
  do {                                                                                                 \
    const cudaError_t e_ = (call);                                                                     \
    REQUIRE_MESSAGE(e_ == cudaSuccess, #call " failed: ", std::string(cudaGetErrorName(e_)), " ",      \
                    std::string(cudaGetErrorString(e_)));                                              \
  } while (0)

void require_gpu() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  REQUIRE_MESSAGE((e == cudaSuccess && n > 0), "a CUDA device is required: ", std::string(cudaGetErrorString(e)));
}

std::uint32_t test_seed() {
  if (const char* s = std::getenv("TRIATTN_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

template <class T>
struct DevBuf {
  T* p = nullptr;
  std::size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(std::size_t count) { reset(count); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
  void reset(std::size_t count) {
    cudaFree(p);
    p = nullptr;
    n = count;
    TEST_CUDA(cudaMalloc(&p, (count ? count : 1) * sizeof(T)));
  }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() <= n);
    TEST_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    TEST_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { TEST_CUDA(cudaMemset(p, 0xff, n * sizeof(T))); }
};

QueryStats random_stats(std::mt19937& rng, int L, int Hq, int d, RopeStyle style) {
  QueryStats s;
  s.model_name = "random";
  s.rope_style = style;
  s.num_layers = L;
  s.num_q_heads = Hq;
  s.head_dim = d;
  const std::size_t n = static_cast<std::size_t>(L) * Hq * (d / 2);
  std::uniform_real_distribution<float> ua(0.05f, 3.0f), uu(0.0f, 1.0f), ang(-3.14159f, 3.14159f);
  s.q_mean_real.resize(n);
  s.q_mean_imag.resize(n);
  s.q_abs_mean.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float a = ua(rng), r = a * uu(rng), t = ang(rng);
    s.q_abs_mean[i] = a;
    s.q_mean_real[i] = r * std::cos(t);
    s.q_mean_imag[i] = r * std::sin(t);
  }
  return s;
}

struct RoundCase {
  int L = 3, Hq = 8, Hkv = 2, d = 128, bs = 16;
  KvLayout layout = KvLayout::kNHD;
  RopeStyle style = RopeStyle::kHalf;
  Aggregation agg = Aggregation::kMean;
  std::vector<int> lens{600, 333, 257, 41};
  std::vector<int> prompts{40, 0, 257, 10};
  SelectionParams sp;

  std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "L=%d Hq=%d Hkv=%d d=%d bs=%d %s %s %s budget=%d mode=%s prompt=%s sink=%d window=%d", L, Hq, Hkv, d,
                  bs, layout_name(layout), style == RopeStyle::kHalf ? "half" : "interleaved", to_string(agg),
                  sp.budget, to_string(sp.mode), to_string(sp.prompt), sp.n_sink, sp.window);
    return buf;
  }
};

/// Everything a round needs, host and device, built from a case and a seed.
template <class T>
struct RoundFixture {
  RoundCase c;
  int batch = 0, max_len = 0, max_seqs = 0, max_blocks = 0, num_blocks = 0, max_keep = 0;
  std::vector<int> seq_ids, tables, seq_lens;
  std::vector<std::int64_t> t0;
  std::vector<T> data;  // [2L, num_blocks, block elems] original contents
  DevBuf<T> d_data;
  DevBuf<int> d_tables, d_lens, d_seq_ids, d_prompts;
  DevBuf<std::int64_t> d_t0;
  DevBuf<std::int32_t> d_kept, d_keep;
  DevBuf<char> d_ws;
  std::size_t ws_bytes = 0;
  std::unique_ptr<cuda::TriAttentionDeviceScorer> scorer;

  RoundFixture(const RoundCase& rc, std::uint32_t seed) : c(rc) {
    std::mt19937 rng(seed);
    batch = static_cast<int>(c.lens.size());
    max_seqs = batch + 2;
    std::vector<int> slots(max_seqs);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    seq_ids.assign(slots.begin(), slots.begin() + batch);
    int need = 0;
    max_blocks = 1;
    max_len = 1;
    for (int len : c.lens) {
      need += (len + c.bs - 1) / c.bs;
      max_blocks = std::max(max_blocks, (len + c.bs - 1) / c.bs + 1);
      max_len = std::max(max_len, len);
    }
    num_blocks = need + 2;
    std::vector<int> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(static_cast<std::size_t>(max_seqs) * max_blocks, -1);
    seq_lens.assign(max_seqs, 0);
    int next = 0;
    for (int b = 0; b < batch; ++b) {
      seq_lens[seq_ids[b]] = c.lens[b];
      for (int j = 0; j < (c.lens[b] + c.bs - 1) / c.bs; ++j)
        tables[static_cast<std::size_t>(seq_ids[b]) * max_blocks + j] = ids[next++];
    }
    data.resize(static_cast<std::size_t>(2 * c.L) * range_stride());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (T& x : data) x = from_float<T>(nd(rng));
    t0.resize(batch);
    for (int b = 0; b < batch; ++b) t0[b] = c.lens[b] + std::uniform_int_distribution<int>(0, 200000)(rng);

    RopeConfig rope;
    rope.style = c.style;
    rope.theta = 1e6;
    ScoringParams scp;
    scp.aggregation = c.agg;
    scorer = std::make_unique<cuda::TriAttentionDeviceScorer>(random_stats(rng, c.L, c.Hq, c.d, c.style), rope, scp,
                                                               c.Hkv);

    d_data.reset(data.size());
    d_data.upload(data);
    d_tables.reset(tables.size());
    d_tables.upload(tables);
    d_lens.reset(seq_lens.size());
    d_lens.upload(seq_lens);
    d_seq_ids.reset(batch);
    d_seq_ids.upload(seq_ids);
    d_prompts.reset(batch);
    d_prompts.upload(c.prompts);
    d_t0.reset(batch);
    d_t0.upload(t0);
    max_keep = cuda::compression_round::safe_max_keep(max_len);
    d_kept.reset(static_cast<std::size_t>(batch) * c.L * c.Hkv * max_keep);
    d_keep.reset(batch);
    ws_bytes = cuda::compression_round::workspace_size(shape(), c.sp.mode, batch, max_len);
    d_ws.reset(ws_bytes);
  }

  BlockLayout block() const { return BlockLayout{c.layout, c.bs, c.Hkv, c.d}; }
  std::int64_t range_stride() const { return static_cast<std::int64_t>(num_blocks) * block().block_elems(); }
  cuda::RoundShape shape() const { return {c.L, c.Hq, c.Hkv}; }
  KvCacheView<T, int> host_view(T* d) {
    return {d, range_stride(), block(), c.L, num_blocks, max_seqs, max_blocks, tables.data(), seq_lens.data()};
  }
  KvCacheView<T, int> device_view() const {
    return {d_data.p, range_stride(), block(), c.L, num_blocks, max_seqs, max_blocks, d_tables.p, d_lens.p};
  }
  cuda::RoundBatch round_batch() const { return {d_seq_ids.p, d_t0.p, d_prompts.p, batch, max_len}; }
  cuda::DeviceKeepPlanView plan() const { return {d_kept.p, d_keep.p, max_keep}; }
  /// Raw scores of the last round ([batch, L, Hq, max_len]; union mode overwrote the selectable slots).
  std::vector<float> round_scores() const {
    cuda::RoundWorkspace ws;
    cuda::detail::carve_round_workspace(d_ws.p, shape(), c.sp.mode, batch, max_len, &ws);
    std::vector<float> h(static_cast<std::size_t>(batch) * c.L * c.Hq * max_len);
    TEST_CUDA(cudaMemcpy(h.data(), ws.scores, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }
};

SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window) {
  SelectionParams p;
  p.budget = budget;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  return p;
}

struct Outcome {
  std::vector<std::int32_t> kept, keep;
  std::vector<char> data;
};

/// Restores the original cache contents and poisons the outputs and the workspace.
template <class T>
void reset_state(RoundFixture<T>& f, const DevBuf<T>& pristine, cudaStream_t s) {
  TEST_CUDA(cudaMemcpyAsync(f.d_data.p, pristine.p, pristine.n * sizeof(T), cudaMemcpyDeviceToDevice, s));
  TEST_CUDA(cudaMemsetAsync(f.d_ws.p, 0xff, f.ws_bytes, s));
  TEST_CUDA(cudaMemsetAsync(f.d_kept.p, 0xff, f.d_kept.n * sizeof(std::int32_t), s));
  TEST_CUDA(cudaMemsetAsync(f.d_keep.p, 0xff, f.d_keep.n * sizeof(std::int32_t), s));
  TEST_CUDA(cudaStreamSynchronize(s));
}

template <class T>
Outcome collect(const RoundFixture<T>& f) {
  Outcome o;
  o.kept = f.d_kept.download();
  o.keep = f.d_keep.download();
  const std::vector<T> d = f.d_data.download();
  o.data.resize(d.size() * sizeof(T));
  std::memcpy(o.data.data(), d.data(), o.data.size());
  return o;
}

template <class T>
cudaError_t eager_round(RoundFixture<T>& f, cudaStream_t s) {
  return cuda::compression_round::run(f.device_view(), f.scorer->device_model(), cuda::DeviceSelectParams(f.c.sp),
                                      f.round_batch(), f.plan(), f.d_ws.p, f.ws_bytes, s);
}

void check_same(const Outcome& a, const Outcome& b, const char* what) {
  INFO(what);
  CHECK(a.keep == b.keep);
  CHECK(a.kept == b.kept);
  CHECK(a.data == b.data);
}

template <class T>
void check_graph(const RoundCase& rc, std::uint32_t seed) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", rc.name());
  RoundFixture<T> f(rc, seed);
  DevBuf<T> pristine(f.d_data.n);
  TEST_CUDA(cudaMemcpy(pristine.p, f.d_data.p, pristine.n * sizeof(T), cudaMemcpyDeviceToDevice));
  cudaStream_t s = nullptr;
  TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  reset_state(f, pristine, s);
  TEST_CUDA(eager_round(f, s));
  TEST_CUDA(cudaStreamSynchronize(s));
  const Outcome eager = collect(f);
  bool any_moved = false;
  for (int k : eager.keep) any_moved |= k >= 0;
  REQUIRE(any_moved);

  reset_state(f, pristine, s);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const cudaError_t captured = eager_round(f, s);
  TEST_CUDA(cudaStreamEndCapture(s, &graph));
  TEST_CUDA(captured);
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    reset_state(f, pristine, s);
    TEST_CUDA(cudaGraphLaunch(exec, s));
    TEST_CUDA(cudaStreamSynchronize(s));
    check_same(eager, collect(f), "graph replay vs eager round");
  }

  // New per-sequence inputs in device memory: the same graph must follow them.
  std::vector<std::int64_t> t0 = f.t0;
  for (auto& x : t0) x += 77777;
  std::vector<int> prompts = f.c.prompts;
  for (std::size_t b = 0; b < prompts.size(); ++b) prompts[b] = prompts[b] / 2;
  f.d_t0.upload(t0);
  f.d_prompts.upload(prompts);
  reset_state(f, pristine, s);
  TEST_CUDA(cudaGraphLaunch(exec, s));
  TEST_CUDA(cudaStreamSynchronize(s));
  const Outcome replayed = collect(f);
  reset_state(f, pristine, s);
  TEST_CUDA(eager_round(f, s));
  TEST_CUDA(cudaStreamSynchronize(s));
  check_same(collect(f), replayed, "graph replay with new device inputs vs eager round on them");
  CHECK((replayed.kept != eager.kept || replayed.keep != eager.keep));  // the inputs did change the round

  TEST_CUDA(cudaGraphExecDestroy(exec));
  TEST_CUDA(cudaGraphDestroy(graph));
  TEST_CUDA(cudaStreamDestroy(s));
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("a compression round captured in a CUDA graph replays the eager round bitwise") {
    require_gpu();
    const std::uint32_t seed = test_seed();
    int combo = 0;
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
      for (Aggregation agg : {Aggregation::kMean, Aggregation::kMax}) {
        RoundCase c;
        c.agg = agg;
        c.sp = sel(160, mode, PromptMode::kPinnedInBudget, 2, 16);
        check_graph<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }
}

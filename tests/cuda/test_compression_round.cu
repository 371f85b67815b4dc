// SPDX-License-Identifier: Apache-2.0
// A whole device compression round (cuda::compression_round::run: score → normalise → reduce →
// select → compact) on a batch of sequences in a randomised paged cache, against the CPU:
//   * the GPU's raw scores match ref::score_sequence (normalised error <= 1e-5) and the round's
//     own copy is bitwise the same (the scorer is deterministic),
//   * its keep plan equals ref::select_keep run on the same (GPU-produced) scores, row by row,
//   * the compacted cache equals ref::compact applied with that plan to a host copy, bitwise.
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

#include <triattn/core/ref/compact.hpp>
#include <triattn/core/ref/score.hpp>
#include <triattn/core/ref/select.hpp>
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

template <class T>
void check_round(const RoundCase& rc, std::uint32_t seed) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", rc.name(), " dtype ", dtype_name(dtype_of<T>));
  RoundFixture<T> f(rc, seed);
  const RoundCase& c = f.c;
  // The round's raw scores, computed separately first (the scorer is deterministic, so these are
  // bitwise the values inside the round; union mode normalises its copy in place).
  DevBuf<float> pre_scores(static_cast<std::size_t>(f.batch) * c.L * c.Hq * f.max_len);
  pre_scores.poison();
  TEST_CUDA(cuda::score(f.device_view(), f.scorer->device_model(),
                        cuda::ScoreBatch{f.d_seq_ids.p, f.d_t0.p, f.batch, f.max_len}, pre_scores.p));
  TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> gpu_scores = pre_scores.download();
  f.d_ws.poison();
  f.d_kept.poison();
  f.d_keep.poison();
  TEST_CUDA(cuda::compression_round::run(f.device_view(), f.scorer->device_model(), cuda::DeviceSelectParams(c.sp),
                                         f.round_batch(), f.plan(), f.d_ws.p, f.ws_bytes));
  TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> scores = f.round_scores();
  const std::vector<std::int32_t> kept = f.d_kept.download(), keep = f.d_keep.download();
  const std::vector<T> compacted = f.d_data.download();

  std::vector<T> expect = f.data;  // host copy the CPU compacts
  const KvCacheView<T, int> orig_view = f.host_view(f.data.data());
  const KvCacheView<T, int> exp_view = f.host_view(expect.data());
  std::vector<float> key(c.d);
  for (int b = 0; b < f.batch; ++b) {
    INFO("batch entry ", b, " length ", c.lens[b], " prompt ", c.prompts[b], " t0 ", f.t0[b]);
    const int T_ = c.lens[b], seq = f.seq_ids[b];
    const std::size_t rows = static_cast<std::size_t>(c.L) * c.Hq;
    // CPU scores from the original keys.
    std::vector<float> want(rows * T_);
    ref::score_sequence(
        f.scorer->model(), f.t0[b],
        [&](int l, int g, int j) -> const float* {
          const T* k = orig_view.token(l, KvKind::kKey, seq, j, g);
          for (int e = 0; e < c.d; ++e) key[e] = to_float(k[e]);
          return key.data();
        },
        T_, want.data());
    std::vector<float> got(rows * T_);
    for (std::size_t r = 0; r < rows; ++r)
      std::copy_n(gpu_scores.data() + (static_cast<std::size_t>(b) * rows + r) * f.max_len, T_, got.begin() + r * T_);
    double e2 = 0, r2 = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      e2 += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
      r2 += static_cast<double>(want[i]) * want[i];
    }
    CHECK_MESSAGE(std::sqrt(e2 / (r2 > 0 ? r2 : 1)) <= 1e-5, "GPU scores: normalised error ", std::sqrt(e2 / r2));
    if (c.sp.mode != PruningMode::kUnion) {  // the round's own copy (union normalised it in place)
      long long differ = 0;
      for (std::size_t r = 0; r < rows; ++r)
        differ += std::memcmp(scores.data() + (static_cast<std::size_t>(b) * rows + r) * f.max_len,
                              got.data() + r * T_, static_cast<std::size_t>(T_) * sizeof(float)) != 0;
      CHECK_MESSAGE(differ == 0, differ, " score rows of the round differ from a separate scoring launch");
    }
    // The plan: equal to the CPU selection on the same (GPU-produced) scores.
    const KeepPlan plan = ref::select_keep(got.data(), c.L, c.Hq, c.Hkv, T_, c.prompts[b], c.sp);
    REQUIRE_EQ(keep[b], plan.keep);
    int bad_rows = 0;
    for (int l = 0; l < c.L; ++l)
      for (int g = 0; g < c.Hkv; ++g) {
        const std::int32_t* row = kept.data() + ((static_cast<std::size_t>(b) * c.L + l) * c.Hkv + g) * f.max_keep;
        bad_rows += !std::equal(plan.row(l, g), plan.row(l, g) + plan.keep, row);
      }
    CHECK_MESSAGE(bad_rows == 0, bad_rows, " plan rows differ from ref::select_keep");
    // The CPU compacts its copy with the GPU's plan; the caches must then be identical.
    KeepPlan gpu_plan(c.L, c.Hkv, keep[b]);
    for (int l = 0; l < c.L; ++l)
      for (int g = 0; g < c.Hkv; ++g)
        std::copy_n(kept.data() + ((static_cast<std::size_t>(b) * c.L + l) * c.Hkv + g) * f.max_keep, keep[b],
                    gpu_plan.row(l, g));
    gpu_plan.validate(c.L, c.Hkv, T_);
    ref::compact(exp_view, seq, gpu_plan);
  }
  CHECK_MESSAGE(std::memcmp(compacted.data(), expect.data(), expect.size() * sizeof(T)) == 0,
                "the compacted device cache differs from ref::compact");
}

SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window) {
  SelectionParams p;
  p.budget = budget;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  return p;
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("compression round: plan and compacted cache match the CPU in every mode", T, float, f16_storage,
                     bf16_storage) {
    require_gpu();
    const std::uint32_t seed = test_seed();
    int combo = 0;
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
      for (PromptMode prompt : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete}) {
        RoundCase c;
        c.sp = sel(combo % 2 ? 200 : 96, mode, prompt, combo % 3 == 1 ? 4 : 0, combo % 3 == 2 ? 32 : 0);
        c.bs = combo % 2 ? 7 : 16;
        c.layout = combo % 4 < 2 ? KvLayout::kNHD : KvLayout::kHND;
        c.style = combo % 3 == 0 ? RopeStyle::kInterleaved : RopeStyle::kHalf;
        check_round<T>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("compression round: Qwen3-8B-like heads with max aggregation and head_dim 64 and page size 1") {
    require_gpu();
    const std::uint32_t seed = test_seed();
    RoundCase c;
    c.L = 2;
    c.Hq = 32;
    c.Hkv = 8;
    c.lens = {700, 512, 1000};
    c.prompts = {100, 0, 0};
    c.sp = sel(512, PruningMode::kPerHead, PromptMode::kPinnedInBudget, 0, 0);
    check_round<bf16_storage>(c, seed);
    c.agg = Aggregation::kMax;
    check_round<bf16_storage>(c, seed + 1);
    c.d = 64;
    c.bs = 1;
    c.sp.window = 64;
    check_round<f16_storage>(c, seed + 2);
  }
}

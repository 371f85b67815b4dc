// SPDX-License-Identifier: Apache-2.0
// A whole device compression round (cuda::compression_round::run: score → normalise → reduce →
// select → compact) on a batch of sequences in a randomised paged cache (fp8: per-head K scales,
// the reference scores the dequantised keys), against the CPU:
//   * the GPU's raw scores match ref::score_sequence (normalised error <= 1e-5) and the round's
//     own copy is bitwise the same (the scorer is deterministic),
//   * its keep plan equals ref::select_keep run on the same (GPU-produced) scores, row by row,
//   * the compacted cache equals ref::compact applied with that plan to a host copy, bitwise.
#include "round_fixture.cuh"

#include <triattn/core/ref/compact.hpp>
#include <triattn/core/ref/score.hpp>
#include <triattn/core/ref/select.hpp>

namespace {

template <class T>
void check_round(const RoundCase& rc, std::uint32_t seed) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", rc.name(), " dtype ", dtype_name(dtype_of<T>));
  RoundFixture<T> f(rc, seed);
  const RoundCase& c = f.c;
  // The round's raw scores, computed separately first (the scorer is deterministic, so these are
  // bitwise the values inside the round; union mode normalises its copy in place).
  test::DeviceBuffer<float> pre_scores(static_cast<std::size_t>(f.batch) * c.L * c.Hq * f.max_len);
  pre_scores.poison();
  TRIATTN_TEST_CUDA(cuda::score(f.device_view(), f.scorer->device_model(),
                        cuda::ScoreBatch{f.d_seq_ids.get(), f.d_t0.get(), f.batch, f.max_len}, pre_scores.get()));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> gpu_scores = pre_scores.download();
  f.d_ws.poison();
  f.d_kept.poison();
  f.d_keep.poison();
  TRIATTN_TEST_CUDA(cuda::compression_round::run(f.device_view(), f.scorer->device_model(), c.sp,
                                         f.round_batch(), f.plan(), f.d_ws.get(), f.ws_bytes));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
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
          for (int e = 0; e < c.d; ++e) key[e] = dequantize(k[e], orig_view.scale(l, KvKind::kKey, g));
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
                     bf16_storage, fp8_e4m3_storage) {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
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
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
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

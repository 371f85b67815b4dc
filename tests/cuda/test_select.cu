// SPDX-License-Identifier: Apache-2.0
// GPU normalisation, GQA/layer reduction and top-k selection (cuda::row_stats, cuda::gqa_reduce,
// cuda::select_keep) against the CPU reference (ref::normalize_scores, reduce_gqa_max,
// mean_over_layers, select_keep): the same raw scores go to both; kept sets must be equal (rows
// are ascending, so equal as lists), including constructed ties (quantised scores, duplicated
// slots, constant rows), every pruning mode, every prompt mode, sinks and windows, identity and
// zero-quota rounds, and rows long enough to skip the shared-memory cache.
#include <doctest/doctest.h>

#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <triattn/core/ref/select.hpp>
#include <triattn/cuda/algorithms/normalize.cuh>
#include <triattn/cuda/algorithms/select.cuh>

using namespace triattn;

namespace {

enum class Fill { kRandom, kQuantised, kDuplicates, kConstantRows };

struct SelCase {
  int L = 3, Hq = 8, Hkv = 2;
  std::vector<int> lens{300, 57, 420};
  std::vector<int> prompts{20, 57, 0};
  SelectionParams sp;
  Fill fill = Fill::kRandom;

  std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "L=%d Hq=%d Hkv=%d budget=%d mode=%s prompt=%s sink=%d window=%d normalize=%d fill=%d", L, Hq, Hkv,
                  sp.budget, to_string(sp.mode), to_string(sp.prompt), sp.n_sink, sp.window, sp.normalize ? 1 : 0,
                  static_cast<int>(fill));
    return buf;
  }
};

/// Raw scores [batch, L, Hq, max_len] with the requested structure (slots past a length: NaN).
std::vector<float> make_scores(const SelCase& c, int max_len, std::mt19937& rng) {
  const int batch = static_cast<int>(c.lens.size());
  const int rows = c.L * c.Hq;
  std::vector<float> s(static_cast<std::size_t>(batch) * rows * max_len, std::nanf(""));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> level(0, 3);
  for (int b = 0; b < batch; ++b) {
    const int T = c.lens[b];
    for (int r = 0; r < rows; ++r) {
      float* x = s.data() + (static_cast<std::size_t>(b) * rows + r) * max_len;
      const float offset = 5.0f * nd(rng), scale = std::exp(nd(rng));
      for (int j = 0; j < T; ++j) {
        switch (c.fill) {
          case Fill::kQuantised: x[j] = offset + scale * static_cast<float>(level(rng)); break;
          case Fill::kConstantRows: x[j] = (r % 3 == 0) ? offset : offset + scale * nd(rng); break;
          default: x[j] = offset + scale * nd(rng); break;
        }
      }
    }
    if (c.fill == Fill::kDuplicates && T > 1) {  // whole slots (every row) duplicated: exact ties after any reduction
      std::uniform_int_distribution<int> u(0, T - 1);
      for (int k = 0; k < T / 4; ++k) {
        const int from = u(rng), to = u(rng);
        for (int r = 0; r < rows; ++r) {
          float* x = s.data() + (static_cast<std::size_t>(b) * rows + r) * max_len;
          x[to] = x[from];
        }
      }
    }
  }
  return s;
}

/// CPU reduced values of batch entry b over its selectable range, in the GPU buffer's row order.
std::vector<float> ref_reduced(const SelCase& c, const float* raw_b, int max_len, int b, const ref::KeepCounts& kc) {
  const int T = c.lens[b], rows = c.L * c.Hq;
  std::vector<float> s(static_cast<std::size_t>(rows) * T);
  for (int r = 0; r < rows; ++r)
    std::copy(raw_b + static_cast<std::size_t>(r) * max_len, raw_b + static_cast<std::size_t>(r) * max_len + T,
              s.begin() + static_cast<std::size_t>(r) * T);
  if (c.sp.normalize) ref::normalize_scores(s.data(), rows, T, kc.selectable_begin, kc.selectable_end);
  std::vector<float> gmax(static_cast<std::size_t>(c.L) * c.Hkv * T);
  ref::reduce_gqa_max(s.data(), c.L, c.Hq, c.Hkv, T, gmax.data());
  if (c.sp.mode == PruningMode::kPerHead) {
    std::vector<float> agg(static_cast<std::size_t>(c.Hkv) * T);
    ref::mean_over_layers(gmax.data(), c.L, c.Hkv, T, agg.data());
    return agg;
  }
  if (c.sp.mode == PruningMode::kPerLayerPerHead) return gmax;
  std::vector<float> lmax(static_cast<std::size_t>(c.L) * T);  // union: max over the layer's query heads
  for (int l = 0; l < c.L; ++l)
    for (int j = 0; j < T; ++j) {
      float m = s[(static_cast<std::size_t>(l) * c.Hq) * T + j];
      for (int h = 1; h < c.Hq; ++h) m = std::max(m, s[(static_cast<std::size_t>(l) * c.Hq + h) * T + j]);
      lmax[static_cast<std::size_t>(l) * T + j] = m;
    }
  return lmax;
}

void check_select(const SelCase& c, std::uint32_t seed) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", c.name());
  std::mt19937 rng(seed);
  const int batch = static_cast<int>(c.lens.size());
  int max_len = 1;
  for (int len : c.lens) max_len = std::max(max_len, len);
  max_len += 3;
  const int max_seqs = batch + 3;
  std::vector<int> slots(max_seqs);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int> seq_ids(slots.begin(), slots.begin() + batch), seq_lens(max_seqs, 0);
  for (int b = 0; b < batch; ++b) seq_lens[seq_ids[b]] = c.lens[b];

  const std::vector<float> raw = make_scores(c, max_len, rng);
  const cuda::RoundShape shape{c.L, c.Hq, c.Hkv};
  const int rr = cuda::reduced_rows(shape, c.sp.mode);
  test::DeviceBuffer<float> d_scores(raw.size()), d_reduced(static_cast<std::size_t>(batch) * rr * max_len);
  test::DeviceBuffer<cuda::RowStats> d_stats(static_cast<std::size_t>(batch) * c.L * c.Hq);
  test::DeviceBuffer<std::uint8_t> d_flags(static_cast<std::size_t>(batch) * max_len);
  test::DeviceBuffer<int> d_seq_ids(batch), d_lens(max_seqs), d_prompts(batch);
  const int max_keep = max_len;
  test::DeviceBuffer<std::int32_t> d_kept(static_cast<std::size_t>(batch) * c.L * c.Hkv * max_keep), d_keep(batch);
  d_scores.upload(raw);
  d_seq_ids.upload(seq_ids);
  d_lens.upload(seq_lens);
  d_prompts.upload(c.prompts);
  d_reduced.poison();
  d_stats.poison();
  d_flags.poison();
  d_kept.poison();
  d_keep.poison();

  const SelectionParams dp = c.sp;
  const cuda::RoundSeqs<int> seqs{d_seq_ids.get(), d_lens.get(), d_prompts.get(), batch, max_len};
  const cuda::DeviceKeepPlanView plan{d_kept.get(), d_keep.get(), max_keep};
  if (c.sp.normalize) TRIATTN_TEST_CUDA(cuda::row_stats(d_scores.get(), d_stats.get(), seqs, dp, shape));
  TRIATTN_TEST_CUDA(cuda::gqa_reduce(d_scores.get(), d_stats.get(), d_reduced.get(), d_flags.get(), seqs, dp, shape));
  TRIATTN_TEST_CUDA(cuda::select_keep(d_scores.get(), d_reduced.get(), d_flags.get(), plan, seqs, dp, shape));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> reduced = d_reduced.download();
  const std::vector<std::int32_t> kept = d_kept.download(), keep = d_keep.download();

  for (int b = 0; b < batch; ++b) {
    INFO("batch entry ", b, " length ", c.lens[b], " prompt ", c.prompts[b]);
    const int T = c.lens[b];
    const float* raw_b = raw.data() + static_cast<std::size_t>(b) * c.L * c.Hq * max_len;
    std::vector<float> dense(static_cast<std::size_t>(c.L) * c.Hq * T);
    for (int r = 0; r < c.L * c.Hq; ++r)
      std::copy(raw_b + static_cast<std::size_t>(r) * max_len, raw_b + static_cast<std::size_t>(r) * max_len + T,
                dense.begin() + static_cast<std::size_t>(r) * T);
    const ref::KeepCounts kc = ref::keep_counts(T, c.prompts[b], c.sp);
    const KeepPlan want = ref::select_keep(dense.data(), c.L, c.Hq, c.Hkv, T, c.prompts[b], c.sp);
    REQUIRE_EQ(keep[b], want.keep);

    // Reduced values on the selectable range (what the top-k ranks): normalised error, and
    // how many are bitwise equal to the CPU's.
    if (!kc.identity) {
      const std::vector<float> want_red = ref_reduced(c, raw_b, max_len, b, kc);
      double e2 = 0, r2 = 0;
      long long equal = 0, total = 0;
      for (int r = 0; r < rr; ++r)
        for (int j = kc.selectable_begin; j < kc.selectable_end; ++j) {
          const float g = reduced[(static_cast<std::size_t>(b) * rr + r) * max_len + j];
          const float w = want_red[static_cast<std::size_t>(r) * T + j];
          REQUIRE(std::isfinite(g));
          e2 += (static_cast<double>(g) - w) * (static_cast<double>(g) - w);
          r2 += static_cast<double>(w) * w;
          equal += g == w;
          ++total;
        }
      const double nerr = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
      CHECK_MESSAGE(nerr <= 1e-5, "reduced values: normalised error ", nerr);
      if (equal != total) MESSAGE("reduced values bitwise equal to the CPU: ", equal, " / ", total);
    }

    long long mismatched_rows = 0;
    for (int l = 0; l < c.L; ++l)
      for (int g = 0; g < c.Hkv; ++g) {
        const std::int32_t* got = kept.data() + ((static_cast<std::size_t>(b) * c.L + l) * c.Hkv + g) * max_keep;
        const std::int32_t* exp = want.row(l, g);
        if (!std::equal(exp, exp + want.keep, got)) ++mismatched_rows;
      }
    CHECK_MESSAGE(mismatched_rows == 0, mismatched_rows, " (layer, KV head) rows differ from ref::select_keep");
  }
}

SelectionParams params(int budget, PruningMode mode, PromptMode prompt, int sink, int window, bool normalize) {
  SelectionParams p;
  p.budget = budget;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  p.normalize = normalize;
  return p;
}

}  // namespace

TEST_CASE("the device round's keep counts equal ref::keep_counts and clamp lengths") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> u(0, 400);
  for (int i = 0; i < 200000; ++i) {
    SelectionParams p;
    p.budget = 1 + u(rng);
    p.n_sink = u(rng) % (std::min(39, p.budget) + 1);                // n_sink + window <= budget
    p.window = u(rng) % (std::min(199, p.budget - p.n_sink) + 1);  // (SelectionParams::validate)
    p.prompt = static_cast<PromptMode>(u(rng) % 3);
    const int T = u(rng), prompt = T ? u(rng) % (T + 1) : 0;
    const ref::KeepCounts r = ref::keep_counts(T, prompt, p);
    const KeepCounts d = keep_counts_unchecked(T, prompt, p);
    REQUIRE_EQ(d.selectable_begin, r.selectable_begin);
    REQUIRE_EQ(d.selectable_end, r.selectable_end);
    REQUIRE_EQ(d.num_protected, r.num_protected);
    REQUIRE_EQ(d.quota, r.quota);
    REQUIRE_EQ(d.keep, r.keep);
    REQUIRE_EQ(d.identity, r.identity);
    // out-of-range inputs (the device clamps where the reference throws)
    const KeepCounts lo = keep_counts_unchecked(T, -1 - prompt, p);
    const KeepCounts hi = keep_counts_unchecked(T, T + 1 + prompt, p);
    REQUIRE_EQ(lo.keep, ref::keep_counts(T, 0, p).keep);
    REQUIRE_EQ(hi.keep, ref::keep_counts(T, T, p).keep);
    REQUIRE_EQ(keep_counts_unchecked(-1 - T, 0, p).keep, 0);
  }
}

TEST_SUITE("gpu") {
  TEST_CASE("select matches ref::select_keep: modes x prompt modes x sinks/window x normalisation x ties") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
      for (PromptMode prompt : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete})
        for (Fill fill : {Fill::kRandom, Fill::kQuantised, Fill::kDuplicates, Fill::kConstantRows})
          for (bool normalize : {true, false}) {
            SelCase c;
            const int v = combo % 3;
            c.sp = params(v == 0 ? 128 : (v == 1 ? 200 : 47), mode, prompt, v == 1 ? 4 : 0, v == 2 ? 16 : 0, normalize);
            c.fill = fill;
            c.lens = {300, 57, 420, 129, 1};
            c.prompts = {20, 57, 0, 129, 0};  // incl. all-prompt sequences and prompt >= budget
            check_select(c, seed + static_cast<std::uint32_t>(combo++));
          }
  }

  TEST_CASE("select: group sizes and layer counts") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    // group sizes 1, 4, 6, 8 and 24 (gqa_reduce is compiled for 1, 2, 4 and 8; 6 and 24 take the
    // generic kernel, 24 in several head chunks)
    for (auto [L, Hq, Hkv] : {std::tuple{1, 1, 1}, std::tuple{1, 4, 4}, std::tuple{36, 32, 8}, std::tuple{5, 12, 2},
                              std::tuple{3, 16, 2}, std::tuple{2, 24, 1}})
      for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
        SelCase c;
        c.L = L;
        c.Hq = Hq;
        c.Hkv = Hkv;
        c.sp = params(100, mode, PromptMode::kPinnedInBudget, 2, 8, true);
        c.fill = combo % 2 ? Fill::kDuplicates : Fill::kRandom;
        c.lens = {400, 233};
        c.prompts = {10, 0};
        check_select(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("select: rows longer than the shared-memory cache (global-memory passes)") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kUnion})
      for (Fill fill : {Fill::kRandom, Fill::kQuantised}) {
        SelCase c;
        c.L = 2;
        c.Hq = 2;
        c.Hkv = 1;
        c.sp = params(2048, mode, PromptMode::kPinnedInBudget, 0, 128, true);
        c.fill = fill;
        c.lens = {cuda::tuning::Selected::Select::kCacheMax + 4000, 3000};
        c.prompts = {100, 0};
        check_select(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("select: a max_keep smaller than the keep count is reported as keep = -1") {
    triattn::test::require_device();
    test::DeviceBuffer<float> scores(2 * 100), reduced(2 * 100);
    test::DeviceBuffer<cuda::RowStats> stats(2);
    test::DeviceBuffer<int> ids(1), lens(1), prompts(1);
    test::DeviceBuffer<std::int32_t> kept(2 * 10), keep(1);
    std::vector<float> h(200);
    std::iota(h.begin(), h.end(), 0.0f);
    scores.upload(h);
    ids.upload({0});
    lens.upload({100});
    prompts.upload({0});
    SelectionParams sp;
    sp.budget = 50;  // keep 50 > max_keep 10
    const SelectionParams dp = sp;
    const cuda::RoundShape shape{1, 2, 2};
    const cuda::RoundSeqs<int> seqs{ids.get(), lens.get(), prompts.get(), 1, 100};
    TRIATTN_TEST_CUDA(cuda::row_stats(scores.get(), stats.get(), seqs, dp, shape));
    TRIATTN_TEST_CUDA(cuda::gqa_reduce(scores.get(), stats.get(), reduced.get(), nullptr, seqs, dp, shape));
    TRIATTN_TEST_CUDA(cuda::select_keep(scores.get(), reduced.get(), nullptr,
                                        cuda::DeviceKeepPlanView{kept.get(), keep.get(), 10}, seqs, dp, shape));
    TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
    CHECK_EQ(keep.download()[0], -1);
  }
}

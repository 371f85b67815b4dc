// SPDX-License-Identifier: Apache-2.0
// Tensor parallelism on the CPU, with ThreadTeamCollective standing in for NCCL (one thread per
// rank): rank geometry and statistics-slice validation; every rank's plan (tp 2 and 4, every
// pruning mode, prompt modes, sinks, window, crafted ties) equals the tp = 1 plan restricted to
// the rank's KV heads; a union round without the agreement would disagree; a failure on one rank
// reaches every rank; and whole KvCache::compress rounds on per-rank caches (TriAttentionScorer
// on sliced statistics + TensorParallelTopKSelector) keep the same tokens and leave the same
// bytes as one tp = 1 cache.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/core/policy/tensor_parallel_selector.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/ref/select.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/core/tp/collective.hpp>
#include <triattn/core/tp/rank_geometry.hpp>
#include <triattn/core/tp/select.hpp>

using namespace triattn;

namespace {

std::uint32_t seed_base() {
  if (const char* s = std::getenv("TRIATTN_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

/// Runs body(rank) in `tp` threads; the first exception of each rank is kept.
std::vector<std::exception_ptr> run_ranks(int tp, const std::function<void(int)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  return errors;
}

void require_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      FAIL("rank ", r, " threw: ", e.what());
    }
  }
}

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return {};
}

/// Rows [L, Hq/tp, T] of rank r from full scores [L, Hq, T].
std::vector<float> rank_scores(const std::vector<float>& full, int L, int Hq, int T, int tp, int r) {
  const int hq = Hq / tp;
  std::vector<float> out(static_cast<std::size_t>(L) * hq * T);
  for (int l = 0; l < L; ++l)
    std::copy_n(full.begin() + (static_cast<std::ptrdiff_t>(l) * Hq + r * hq) * T, static_cast<std::ptrdiff_t>(hq) * T,
                out.begin() + static_cast<std::ptrdiff_t>(l) * hq * T);
  return out;
}

/// The tp = 1 plan's rows of rank r's KV heads.
void check_rank_plan(const KeepPlan& full, const KeepPlan& local, int tp, int r) {
  const int hkv = full.num_kv_heads / tp;
  REQUIRE(local.num_layers == full.num_layers);
  REQUIRE(local.num_kv_heads == hkv);
  REQUIRE(local.keep == full.keep);
  int bad = 0;
  for (int l = 0; l < full.num_layers; ++l)
    for (int g = 0; g < hkv; ++g)
      bad += !std::equal(local.row(l, g), local.row(l, g) + local.keep, full.row(l, r * hkv + g));
  CHECK_MESSAGE(bad == 0, "rank ", r, " of tp ", tp, ": ", bad, " plan rows differ from the tp = 1 plan");
}

struct PlanCase {
  int L = 3, Hq = 8, Hkv = 4, T = 90, prompt = 0;
  SelectionParams sp;
  bool ties = false;  // scores drawn from a handful of values: many exact ties
};

std::vector<float> make_scores(std::mt19937& rng, const PlanCase& c) {
  std::vector<float> s(static_cast<std::size_t>(c.L) * c.Hq * c.T);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> few(0, 3);
  for (float& x : s) x = c.ties ? static_cast<float>(few(rng)) * 0.5f : nd(rng);
  return s;
}

/// tp-way selection on threads vs the tp = 1 plan.
void check_plan_case(const PlanCase& c, int tp, std::uint32_t seed) {
  INFO("seed ", seed, " tp ", tp, " mode ", to_string(c.sp.mode), " prompt ", to_string(c.sp.prompt), " (",
       c.prompt, ") sink ", c.sp.n_sink, " window ", c.sp.window, " normalize ", c.sp.normalize, " ties ", c.ties,
       " budget ", c.sp.budget, " T ", c.T);
  std::mt19937 rng(seed);
  const std::vector<float> full = make_scores(rng, c);
  const KeepPlan want = ref::select_keep(full.data(), c.L, c.Hq, c.Hkv, c.T, c.prompt, c.sp);
  const ModelGeometry model{c.L, c.Hq, c.Hkv, 16};
  tp::ThreadTeam team(tp);
  std::vector<KeepPlan> plans(static_cast<std::size_t>(tp));
  require_no_errors(run_ranks(tp, [&](int r) {
    tp::ThreadTeamCollective comm(team, r);
    const tp::TpGeometry geo(tp, r, model);
    const std::vector<float> mine = rank_scores(full, c.L, c.Hq, c.T, tp, r);
    plans[static_cast<std::size_t>(r)] = tp::select_keep(comm, mine, geo.local(), c.T, c.prompt, c.sp, &geo);
  }));
  for (int r = 0; r < tp; ++r) check_rank_plan(want, plans[static_cast<std::size_t>(r)], tp, r);
}

QueryStats random_stats(std::mt19937& rng, int L, int Hq, int d) { return random_query_stats(rng, L, Hq, d); }

SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window, bool normalize = true) {
  SelectionParams p;
  p.budget = budget;
  p.divide_length = 16;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  p.normalize = normalize;
  return p;
}

}  // namespace

TEST_SUITE("tensor_parallel") {
TEST_CASE("TpGeometry: contiguous head shares and the local geometry") {
  const ModelGeometry qwen{36, 32, 8, 128};
  for (int tp : {1, 2, 4, 8}) {
    int next_q = 0, next_kv = 0;
    for (int r = 0; r < tp; ++r) {
      const tp::TpGeometry g(tp, r, qwen);
      CHECK(g.q_heads().first == next_q);
      CHECK(g.q_heads().count == 32 / tp);
      CHECK(g.kv_heads().first == next_kv);
      CHECK(g.kv_heads().count == 8 / tp);
      next_q = g.q_heads().end();
      next_kv = g.kv_heads().end();
      // Every query head of the rank maps to one of the rank's KV heads (no GQA group straddles).
      for (int h = g.q_heads().first; h < g.q_heads().end(); ++h) CHECK(g.kv_heads().contains(h / qwen.group_size()));
      const ModelGeometry loc = g.local();
      CHECK(loc.num_layers == 36);
      CHECK(loc.num_q_heads == 32 / tp);
      CHECK(loc.num_kv_heads == 8 / tp);
      CHECK(loc.head_dim == 128);
      CHECK(loc.group_size() == qwen.group_size());
      CacheConfig cfg;
      cfg.model = qwen;
      cfg.num_blocks = 4;
      CHECK(g.local_config(cfg).model.num_kv_heads == 8 / tp);
      CHECK_NOTHROW(g.check_local(loc, "test"));
    }
    CHECK(next_q == 32);
    CHECK(next_kv == 8);
  }
}

TEST_CASE("TpGeometry: bad degrees and ranks are refused naming the values") {
  const ModelGeometry m{2, 12, 4, 64};
  const auto msg = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const logic_error& e) {
      return e.what();
    }
    return "(no exception)";
  };
  CHECK(msg([&] { (void)tp::TpGeometry(0, 0, m); }).find("tp must be >= 1") != std::string::npos);
  CHECK(msg([&] { (void)tp::TpGeometry(2, 2, m); }).find("rank must be in [0, tp)") != std::string::npos);
  CHECK(msg([&] { (void)tp::TpGeometry(2, -1, m); }).find("rank -1") != std::string::npos);
  const std::string not_div = msg([&] { (void)tp::TpGeometry(8, 0, m); });
  CHECK(not_div.find("num_q_heads 12 is not divisible by tp") != std::string::npos);
  const std::string straddle = msg([&] { (void)tp::TpGeometry(3, 0, ModelGeometry{2, 12, 4, 64}); });
  CHECK(straddle.find("num_kv_heads 4 is not divisible by tp") != std::string::npos);  // 12 % 3 == 0, 4 % 3 != 0
  const std::string kv_short = msg([&] { (void)tp::TpGeometry(4, 1, ModelGeometry{2, 8, 2, 64}); });
  CHECK(kv_short.find("num_kv_heads 2") != std::string::npos);
  CHECK(msg([&] { (void)tp::TpGeometry(2, 0, ModelGeometry{2, 8, 3, 64}); }).find("invalid model geometry") !=
        std::string::npos);
  const tp::TpGeometry g(2, 1, m);
  CHECK(msg([&] { g.check_local(m, "cache"); }).find("is not rank 1 of tp 2's share") != std::string::npos);
  CacheConfig cfg;
  cfg.model = g.local();
  CHECK(msg([&] { (void)g.local_config(cfg); }).find("is not the full model") != std::string::npos);
}

TEST_CASE("check_stats_for_rank: slices from slice_for_rank pass and anything else is refused") {
  std::mt19937 rng(seed_base());
  const QueryStats full = random_stats(rng, 3, 8, 16);
  const ModelGeometry m{3, 8, 4, 16};
  for (int tp : {1, 2, 4})
    for (int r = 0; r < tp; ++r) CHECK_NOTHROW(tp::check_stats_for_rank(slice_for_rank(full, r, tp, 4), tp::TpGeometry(tp, r, m)));
  const auto msg = [](const QueryStats& s, const tp::TpGeometry& g) -> std::string {
    try {
      tp::check_stats_for_rank(s, g);
    } catch (const logic_error& e) {
      return e.what();
    }
    return "(no exception)";
  };
  const tp::TpGeometry g1(2, 1, m);
  CHECK(msg(slice_for_rank(full, 0, 2, 4), g1).find("hold query heads [0, 4) but the rank holds [4, 8)") !=
        std::string::npos);
  CHECK(msg(full, g1).find("hold query heads [0, 8)") != std::string::npos);
  CHECK(msg(slice_for_rank(full, 1, 4, 4), g1).find("[2, 4)") != std::string::npos);
  QueryStats wrong_layers = slice_for_rank(full, 1, 2, 4);
  CHECK(msg(wrong_layers, tp::TpGeometry(2, 1, ModelGeometry{4, 8, 4, 16})).find("3 layers, the model 4") !=
        std::string::npos);
  CHECK(msg(wrong_layers, tp::TpGeometry(2, 1, ModelGeometry{3, 8, 4, 32})).find("head_dim 16, the model 32") !=
        std::string::npos);
  QueryStats broken = slice_for_rank(full, 1, 2, 4);
  broken.q_abs_mean.pop_back();
  CHECK(msg(broken, g1).find("malformed statistics") != std::string::npos);
}

TEST_CASE("ThreadTeamCollective: rank-order reductions and a length mismatch throws on every rank") {
  constexpr int tp = 3;
  tp::ThreadTeam team(tp);
  std::vector<std::vector<float>> sums(tp), maxes(tp);
  std::vector<std::vector<std::uint8_t>> flags(tp);
  require_no_errors(run_ranks(tp, [&](int r) {
    tp::ThreadTeamCollective c(team, r);
    if (c.rank() != r || c.size() != tp) throw std::runtime_error("wrong rank or size");  // no doctest asserts in threads
    std::vector<float> s{1.0f * r, 2.0f, -1.0f * r};
    c.all_reduce_sum(s);
    std::vector<float> m{1.0f * r, -1.0f * r, 5.0f};
    c.all_reduce_max(m);
    std::vector<std::uint8_t> f{static_cast<std::uint8_t>(r == 1), 0, static_cast<std::uint8_t>(r)};
    c.all_reduce_max(f);
    sums[r] = s;
    maxes[r] = m;
    flags[r] = f;
  }));
  for (int r = 0; r < tp; ++r) {
    CHECK(sums[r] == std::vector<float>{3.0f, 6.0f, -3.0f});
    CHECK(maxes[r] == std::vector<float>{2.0f, 0.0f, 5.0f});
    CHECK(flags[r] == std::vector<std::uint8_t>{1, 0, 2});
  }
  const auto errors = run_ranks(tp, [&](int r) {
    tp::ThreadTeamCollective c(team, r);
    std::vector<float> x(static_cast<std::size_t>(r == 2 ? 5 : 4), 1.0f);
    c.all_reduce_max(x);
  });
  for (int r = 0; r < tp; ++r) {
    REQUIRE_MESSAGE(errors[r] != nullptr, "rank ", r, " did not throw on a length mismatch");
    CHECK(message_of(errors[r]).find("another rank's length differs") != std::string::npos);
  }
  CHECK_THROWS_AS(tp::ThreadTeam(0), logic_error);
  CHECK_THROWS_AS(tp::ThreadTeamCollective(team, 3), logic_error);
}

TEST_CASE("ref union split: candidates then finish equal select_keep and disjoint row sets combine by max") {
  std::mt19937 rng(seed_base());
  const int L = 2, Hq = 6, T = 50;
  std::vector<float> s(static_cast<std::size_t>(L) * Hq * T);
  std::normal_distribution<float> nd;
  for (float& x : s) x = nd(rng);
  const SelectionParams p = sel(20, PruningMode::kUnion, PromptMode::kCompete, 2, 5, false);
  const ref::KeepCounts kc = ref::keep_counts(T, 0, p);
  const int n = kc.num_selectable();
  std::vector<std::uint8_t> f_all(n), f_a(n), f_b(n);
  std::vector<float> v_all(n), v_a(n), v_b(n);
  const std::size_t rows = static_cast<std::size_t>(L) * Hq;
  ref::union_candidates(s.data(), rows, kc, f_all.data(), v_all.data());
  ref::union_candidates(s.data(), 5, kc, f_a.data(), v_a.data());  // rows 0..4 and 5..11
  ref::union_candidates(s.data() + 5 * T, rows - 5, kc, f_b.data(), v_b.data());
  for (int j = 0; j < n; ++j) {
    CHECK(std::max(f_a[j], f_b[j]) == f_all[j]);
    CHECK(std::max(v_a[j], v_b[j]) == v_all[j]);
  }
  const std::vector<std::int32_t> chosen = ref::union_finish(f_all.data(), v_all.data(), kc);
  const KeepPlan plan = ref::select_keep(s.data(), L, Hq, 3, T, 0, p);
  std::vector<std::int32_t> mid(plan.row(0, 0) + kc.selectable_begin, plan.row(0, 0) + kc.selectable_begin + kc.quota);
  CHECK(chosen == mid);
  // The fill rule: with fewer candidates than the quota, all of U plus the best of the rest.
  std::vector<std::uint8_t> few(n, 0);
  few[3] = few[7] = 1;
  std::vector<float> v(n);
  for (int j = 0; j < n; ++j) v[j] = static_cast<float>(j % 5);
  const std::vector<std::int32_t> filled = ref::union_finish(few.data(), v.data(), kc);
  CHECK(static_cast<int>(filled.size()) == kc.quota);
  CHECK(std::is_sorted(filled.begin(), filled.end()));
  CHECK(std::find(filled.begin(), filled.end(), kc.selectable_begin + 3) != filled.end());
  CHECK(std::find(filled.begin(), filled.end(), kc.selectable_begin + 7) != filled.end());
  CHECK_THROWS_AS(ref::union_candidates(s.data(), 0, kc, f_a.data(), v_a.data()), logic_error);
}

TEST_CASE("tp plans equal the tp=1 plan on the rank's heads: every mode and protection and ties") {
  const std::uint32_t seed = seed_base();
  int combo = 0;
  for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
    for (PromptMode prompt : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete})
      for (int variant = 0; variant < 4; ++variant) {
        PlanCase c;
        c.prompt = variant == 3 ? 0 : 7 + variant;
        c.sp = sel(variant == 2 ? 31 : 24, mode, prompt, variant == 1 ? 3 : 0, variant == 2 ? 9 : 0, variant != 3);
        c.ties = variant >= 2;
        c.T = 60 + 13 * variant;
        for (int tp : {1, 2, 4}) check_plan_case(c, tp, seed + static_cast<std::uint32_t>(combo));
        ++combo;
      }
  // GQA group of 4 (2 KV heads), and an identity round (budget above the length).
  PlanCase g;
  g.Hkv = 2;
  g.sp = sel(20, PruningMode::kUnion, PromptMode::kCompete, 0, 0);
  for (int tp : {1, 2}) check_plan_case(g, tp, seed + 1000);
  g.sp.budget = 500;
  for (int tp : {1, 2}) check_plan_case(g, tp, seed + 1001);
}

TEST_CASE("union without the agreement would differ: the collective decides the keep set") {
  // A rank that selected on its own rows only would keep another set: check that this happens
  // for some seed, so the tp tests above really exercise the agreement.
  const std::uint32_t seed = seed_base();
  int differing = 0;
  for (int k = 0; k < 20 && differing == 0; ++k) {
    PlanCase c;
    c.sp = sel(20, PruningMode::kUnion, PromptMode::kCompete, 0, 0);
    std::mt19937 rng(seed + static_cast<std::uint32_t>(k));
    const std::vector<float> full = make_scores(rng, c);
    const KeepPlan want = ref::select_keep(full.data(), c.L, c.Hq, c.Hkv, c.T, 0, c.sp);
    const std::vector<float> mine = rank_scores(full, c.L, c.Hq, c.T, 2, 0);
    tp::SingleRankCollective alone;
    const KeepPlan solo = tp::select_keep(alone, mine, ModelGeometry{c.L, c.Hq / 2, c.Hkv / 2, 16}, c.T, 0, c.sp);
    differing += !std::equal(solo.row(0, 0), solo.row(0, 0) + solo.keep, want.row(0, 0));
  }
  CHECK(differing > 0);
}

TEST_CASE("union: a failure on one rank is reported on every rank") {
  PlanCase c;
  c.sp = sel(20, PruningMode::kUnion, PromptMode::kCompete, 0, 0);
  std::mt19937 rng(seed_base());
  std::vector<float> full = make_scores(rng, c);
  constexpr int tp = 2;
  const ModelGeometry model{c.L, c.Hq, c.Hkv, 16};
  tp::ThreadTeam team(tp);
  const auto errors = run_ranks(tp, [&](int r) {
    tp::ThreadTeamCollective comm(team, r);
    std::vector<float> mine = rank_scores(full, c.L, c.Hq, c.T, tp, r);
    if (r == 1) mine[static_cast<std::size_t>(c.T) + 10] = std::nanf("");  // local row 1, slot 10
    (void)tp::select_keep(comm, mine, tp::TpGeometry(tp, r, model).local(), c.T, 0, c.sp);
  });
  REQUIRE(errors[0] != nullptr);
  REQUIRE(errors[1] != nullptr);
  CHECK(message_of(errors[1]).find("is not finite") != std::string::npos);
  CHECK(message_of(errors[0]).find("another rank's union selection failed") != std::string::npos);
  // A bad score buffer on one rank is caught the same way (no rank waits forever).
  const auto errors2 = run_ranks(tp, [&](int r) {
    tp::ThreadTeamCollective comm(team, r);
    std::vector<float> mine = rank_scores(full, c.L, c.Hq, c.T, tp, r);
    if (r == 0) mine.pop_back();
    const tp::TpGeometry geo(tp, r, model);
    (void)tp::select_keep(comm, mine, geo.local(), c.T, 0, c.sp, &geo);
  });
  CHECK(message_of(errors2[0]).find("scores hold") != std::string::npos);
  CHECK(message_of(errors2[1]).find("another rank's union selection failed") != std::string::npos);
  // The selector's geometry must match the collective's rank.
  tp::ThreadTeam team2(2);
  tp::ThreadTeamCollective c0(team2, 0);
  CHECK_THROWS_AS(TensorParallelTopKSelector<tp::ThreadTeamCollective>(c.sp, c0, tp::TpGeometry(2, 1, model)),
                  logic_error);
  // A cache that is not the rank's share (here: the full model) is refused; per_head needs no
  // collective, so rank 0 alone can try.
  SelectionParams per_head = c.sp;
  per_head.mode = PruningMode::kPerHead;
  const TensorParallelTopKSelector<tp::ThreadTeamCollective> selector(per_head, c0, tp::TpGeometry(2, 0, model));
  std::string refused;
  try {
    (void)selector.select(full, model, c.T, 0);
  } catch (const logic_error& e) {
    refused = e.what();
  }
  CHECK(refused.find("is not rank 0 of tp 2's share") != std::string::npos);
  const ModelGeometry local = tp::TpGeometry(2, 0, model).local();
  CHECK(selector.select(rank_scores(full, c.L, c.Hq, c.T, 2, 0), local, c.T, 0).num_kv_heads == local.num_kv_heads);
}

TEST_CASE_TEMPLATE("KvCache compress on per-rank caches equals one tp=1 cache: keep sets and bytes", T, float,
                   bf16_storage) {
  const std::uint32_t seed = seed_base();
  constexpr int L = 3, Hq = 8, Hkv = 4, d = 16, bs = 7;
  const ModelGeometry model{L, Hq, Hkv, d};
  int combo = 0;
  for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
    for (PromptMode prompt : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete})
      for (int tp : {2, 4}) {
        const std::uint32_t s = seed + static_cast<std::uint32_t>(combo);
        const KvLayout layout = combo % 2 ? KvLayout::kHND : KvLayout::kNHD;
        const SelectionParams sp = sel(30, mode, prompt, combo % 3 == 1 ? 2 : 0, combo % 3 == 2 ? 6 : 0);
        ++combo;
        INFO("seed ", s, " tp ", tp, " mode ", to_string(mode), " prompt ", to_string(prompt), " layout ",
             layout_name(layout), " dtype ", dtype_name(dtype_of<T>));
        std::mt19937 rng(s);
        const QueryStats stats = random_stats(rng, L, Hq, d);
        RopeConfig rope;
        rope.theta = 10000.0;
        CacheConfig cfg;
        cfg.model = model;
        cfg.block_size = bs;
        cfg.num_blocks = 64;
        cfg.max_seqs = 2;
        cfg.layout = layout;
        cfg.dtype = dtype_of<T>;
        // Token stream: [L, n, Hkv, d] keys and values for prompt + decode steps.
        constexpr int prompt_len = 12, steps = 70;
        const int total = prompt_len + steps;
        std::normal_distribution<float> nd;
        std::vector<T> k(static_cast<std::size_t>(L) * total * Hkv * d), v(k.size());
        for (T& x : k) x = from_float<T>(nd(rng));
        for (T& x : v) x = from_float<T>(nd(rng));
        // Tokens [first, first + n) of heads [h0, h0 + hn) as [L, n, hn, d].
        const auto chunk = [&](const std::vector<T>& src, int first, int n, int h0, int hn) {
          std::vector<T> out(static_cast<std::size_t>(L) * n * hn * d);
          for (int l = 0; l < L; ++l)
            for (int i = 0; i < n; ++i)
              for (int h = 0; h < hn; ++h)
                std::copy_n(src.begin() + ((static_cast<std::ptrdiff_t>(l) * total + first + i) * Hkv + h0 + h) * d, d,
                            out.begin() + ((static_cast<std::ptrdiff_t>(l) * n + i) * hn + h) * d);
          return out;
        };

        using FullCache = KvCache<TriAttentionScorer, TopKSelector>;
        using RankCache = KvCache<TriAttentionScorer, TensorParallelTopKSelector<tp::ThreadTeamCollective>>;
        FullCache full(cfg, TriAttentionScorer(stats, rope, ScoringParams{}, Hkv), TopKSelector(sp));
        const SeqId fs = full.add_sequence();
        std::vector<CompressionReport> full_rounds;
        REQUIRE(full.append<T>(fs, chunk(k, 0, prompt_len, 0, Hkv), chunk(v, 0, prompt_len, 0, Hkv), prompt_len,
                               Phase::kPrefill)
                    .ok());
        for (int t = prompt_len; t < total; ++t) {
          REQUIRE(full.append<T>(fs, chunk(k, t, 1, 0, Hkv), chunk(v, t, 1, 0, Hkv), 1).ok());
          if (full.needs_compression(fs)) full_rounds.push_back(full.compress(fs));
        }
        REQUIRE(full_rounds.size() >= 2);  // several rounds, each on an already compacted cache

        tp::ThreadTeam team(tp);
        std::vector<std::vector<CompressionReport>> rank_rounds(static_cast<std::size_t>(tp));
        std::vector<int> mismatches(static_cast<std::size_t>(tp), -1);
        require_no_errors(run_ranks(tp, [&](int r) {
          tp::ThreadTeamCollective comm(team, r);
          const tp::TpGeometry geo(tp, r, model);
          const int h0 = geo.kv_heads().first, hn = geo.kv_heads().count;
          const QueryStats mine = slice_for_rank(stats, r, tp, Hkv);
          tp::check_stats_for_rank(mine, geo);
          RankCache cache(geo.local_config(cfg), TriAttentionScorer(mine, rope, ScoringParams{}, hn),
                          TensorParallelTopKSelector<tp::ThreadTeamCollective>(sp, comm, geo));
          const SeqId rs = cache.add_sequence();
          if (!cache.append<T>(rs, chunk(k, 0, prompt_len, h0, hn), chunk(v, 0, prompt_len, h0, hn), prompt_len,
                               Phase::kPrefill)
                   .ok())
            throw std::runtime_error("prefill failed");
          for (int t = prompt_len; t < total; ++t) {
            if (!cache.append<T>(rs, chunk(k, t, 1, h0, hn), chunk(v, t, 1, h0, hn), 1).ok())
              throw std::runtime_error("append failed");
            if (cache.needs_compression(rs)) rank_rounds[static_cast<std::size_t>(r)].push_back(cache.compress(rs));
          }
          // Every cached K/V vector equals the tp = 1 cache's vector of the same global head.
          if (cache.physical_length(rs) != full.physical_length(fs)) throw std::runtime_error("lengths differ");
          const auto fv = full.view<T>();
          const auto rv = cache.view<T>();
          int bad = 0;
          for (int l = 0; l < L; ++l)
            for (int kind = 0; kind < 2; ++kind)
              for (int h = 0; h < hn; ++h)
                for (int j = 0; j < cache.physical_length(rs); ++j)
                  bad += std::memcmp(rv.token(l, static_cast<KvKind>(kind), rs, j, h),
                                     fv.token(l, static_cast<KvKind>(kind), fs, j, h0 + h), d * sizeof(T)) != 0;
          mismatches[static_cast<std::size_t>(r)] = bad;
        }));
        for (int r = 0; r < tp; ++r) {
          CHECK_MESSAGE(mismatches[static_cast<std::size_t>(r)] == 0, "rank ", r, ": ",
                        mismatches[static_cast<std::size_t>(r)], " cached head vectors differ from the tp = 1 cache");
          const auto& rr = rank_rounds[static_cast<std::size_t>(r)];
          REQUIRE(rr.size() == full_rounds.size());
          for (std::size_t i = 0; i < rr.size(); ++i) {
            CHECK(rr[i].length_before == full_rounds[i].length_before);
            CHECK(rr[i].length_after == full_rounds[i].length_after);
            CHECK(rr[i].blocks_freed == full_rounds[i].blocks_freed);
          }
        }
      }
}
}

// SPDX-License-Identifier: Apache-2.0
// Tests of core/ref/select.hpp: every pruning mode on small hand-built cases whose keep sets are
// written out literally, ties, GQA groups of 1/2/4/8, protection (prompt modes, sinks, window),
// the prompt-over-budget warning, identity plans, normalisation, the building blocks, and errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/ref/select.hpp>

using namespace triattn;
using Idx = std::vector<std::int32_t>;

namespace {
Idx row_of(const KeepPlan& p, int l, int g) { return Idx(p.row(l, g), p.row(l, g) + p.keep); }

SelectionParams raw(int budget, PruningMode mode = PruningMode::kPerHead) {
  SelectionParams s;
  s.budget = budget;
  s.mode = mode;
  s.normalize = false;
  return s;
}

/// Counts warnings while alive; restores the default handler after.
struct WarningCounter {
  int count = 0;
  std::string last;
  WarningCounter() {
    set_warning_handler([this](std::string_view m) {
      ++count;
      last = std::string(m);
    });
  }
  ~WarningCounter() { set_warning_handler(nullptr); }
};
}  // namespace

TEST_SUITE("selection") {
TEST_CASE("top_k_with_ties: value descending and lower index wins ties and output ascending") {
  const float v[] = {5, 1, 4, 4, 0, 2};
  CHECK(ref::top_k_with_ties(v, 6, 3) == Idx{0, 2, 3});
  CHECK(ref::top_k_with_ties(v, 6, 2) == Idx{0, 2});  // 4 at slots 2 and 3: slot 2 wins
  CHECK(ref::top_k_with_ties(v, 6, 0) == Idx{});
  CHECK(ref::top_k_with_ties(v, 6, 6) == Idx{0, 1, 2, 3, 4, 5});
  const float flat[] = {1, 1, 1, 1, 1};
  CHECK(ref::top_k_with_ties(flat, 5, 2) == Idx{0, 1});
  const float t2[] = {1, 3, 3, 3, 0, 2};
  CHECK(ref::top_k_with_ties(t2, 6, 2) == Idx{1, 2});
  const float neg[] = {-0.0f, 0.0f, -1.0f};  // -0 == +0: a tie, lower index wins
  CHECK(ref::top_k_with_ties(neg, 3, 1) == Idx{0});
  const float nan_v[] = {1, std::nanf(""), 2};
  CHECK_THROWS_AS((void)ref::top_k_with_ties(nan_v, 3, 1), logic_error);
  CHECK_THROWS_AS((void)ref::top_k_with_ties(v, 6, 7), logic_error);
  CHECK_THROWS_AS((void)ref::top_k_with_ties(v, 6, -1), logic_error);
}

TEST_CASE("normalize_scores: population z-score over the range and rest untouched") {
  std::vector<float> x = {9, 1, 2, 3, 4, -7};  // range [1, 5): mean 2.5, std sqrt(1.25)
  ref::normalize_scores(x.data(), 1, 6, 1, 5);
  const double sd = std::sqrt(1.25);
  CHECK(x[0] == 9.0f);
  CHECK(x[5] == -7.0f);
  CHECK(x[1] == doctest::Approx(-1.5 / sd));
  CHECK(x[2] == doctest::Approx(-0.5 / sd));
  CHECK(x[3] == doctest::Approx(0.5 / sd));
  CHECK(x[4] == doctest::Approx(1.5 / sd));
  std::vector<float> c = {3, 3, 3, 5, 5, 5};  // two rows; constant: std 0 -> max(std, 1e-6) -> zeros
  ref::normalize_scores(c.data(), 2, 3, 0, 3);
  for (float v : c) CHECK(v == 0.0f);
  std::vector<float> bad = {1, std::nanf(""), 2};
  CHECK_THROWS_AS(ref::normalize_scores(bad.data(), 1, 3, 0, 3), logic_error);
  CHECK_NOTHROW(ref::normalize_scores(bad.data(), 1, 3, 2, 3));  // NaN outside the range is not read
  CHECK_THROWS_AS(ref::normalize_scores(bad.data(), 1, 3, 2, 4), logic_error);
}

TEST_CASE("reduce_gqa_max and mean_over_layers") {
  // L = 2, Hq = 4, Hkv = 2 (G = 2), T = 2
  const float in[] = {1, 5, /**/ 2, 0, /**/ 7, 7, /**/ 8, -1,   // layer 0: heads 0..3
                      0, 0, /**/ -3, -2, /**/ 1, 9, /**/ 2, 3};  // layer 1
  float out[8];
  ref::reduce_gqa_max(in, 2, 4, 2, 2, out);
  CHECK(std::vector<float>(out, out + 8) == std::vector<float>{2, 5, 8, 7, 0, 0, 2, 9});
  float mean[4];
  ref::mean_over_layers(out, 2, 2, 2, mean);
  CHECK(std::vector<float>(mean, mean + 4) == std::vector<float>{1, 2.5f, 5, 8});
  CHECK_THROWS_AS(ref::reduce_gqa_max(in, 2, 4, 3, 2, out), logic_error);
}

TEST_CASE("per_head and per_layer_per_head and union on a two-layer case") {
  // L = 2, Hq = Hkv = 1, T = 5, budget 2, no normalisation.
  const float s[] = {0, 10, 0, 6, 6,   // layer 0
                     0, 0, 9, 6, 5};   // layer 1
  // per_head: mean over layers = {0, 5, 4.5, 6, 5.5} -> {3, 4}, same set in both layers.
  KeepPlan ph = ref::select_keep(s, 2, 1, 1, 5, 0, raw(2, PruningMode::kPerHead));
  CHECK(ph.keep == 2);
  CHECK(row_of(ph, 0, 0) == Idx{3, 4});
  CHECK(row_of(ph, 1, 0) == Idx{3, 4});
  // per_layer_per_head: layer 0 {10@1, 6@3 (tie with 6@4: lower wins)}, layer 1 {9@2, 6@3}.
  KeepPlan plh = ref::select_keep(s, 2, 1, 1, 5, 0, raw(2, PruningMode::kPerLayerPerHead));
  CHECK(row_of(plh, 0, 0) == Idx{1, 3});
  CHECK(row_of(plh, 1, 0) == Idx{2, 3});
  // union: U = {1, 3} ∪ {2, 3} = {1, 2, 3}; max over rows = {0, 10, 9, 6, 6}; top-2 of U: {1, 2}.
  KeepPlan u = ref::select_keep(s, 2, 1, 1, 5, 0, raw(2, PruningMode::kUnion));
  CHECK(row_of(u, 0, 0) == Idx{1, 2});
  CHECK(row_of(u, 1, 0) == Idx{1, 2});
  for (const KeepPlan* p : {&ph, &plh, &u}) CHECK_NOTHROW(p->validate(2, 1, 5));
}

TEST_CASE("per_layer_per_head takes the max over a GQA group per layer") {
  // L = 2, Hq = 2, Hkv = 1, T = 4, budget 1.
  const float s[] = {1, 0, 0, 0, /**/ 0, 0, 3, 0,   // layer 0: group max {1, 0, 3, 0} -> {2}
                     0, 5, 0, 0, /**/ 0, 0, 0, 4};  // layer 1: group max {0, 5, 0, 4} -> {1}
  KeepPlan p = ref::select_keep(s, 2, 2, 1, 4, 0, raw(1, PruningMode::kPerLayerPerHead));
  CHECK(row_of(p, 0, 0) == Idx{2});
  CHECK(row_of(p, 1, 0) == Idx{1});
  // per_head: mean_l of the group max = {0.5, 2.5, 1.5, 2} -> {1} in both layers.
  KeepPlan q = ref::select_keep(s, 2, 2, 1, 4, 0, raw(1, PruningMode::kPerHead));
  CHECK(row_of(q, 0, 0) == Idx{1});
  CHECK(row_of(q, 1, 0) == Idx{1});
}

TEST_CASE("GQA groups of 1 2 4 and 8") {
  // Hkv = 2, Hq = 2G, L = 2, T = 16, budget 3. In KV head g only the LAST query head of the
  // group scores slots 3+g, 7+g, 11+g high (9, 8, 7); the group's other heads score slots 0..2
  // at 5. The kept set of KV head g is therefore {3+g, 7+g, 11+g} in every mode; a wrong head
  // to group map (e.g. h % Hkv) would pick other slots.
  for (int G : {1, 2, 4, 8}) {
    CAPTURE(G);
    const int L = 2, Hkv = 2, Hq = 2 * G, T = 16;
    std::vector<float> s(static_cast<std::size_t>(L) * Hq * T, 0.0f);
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < Hkv; ++g)
        for (int i = 0; i < G; ++i) {
          float* r = s.data() + (static_cast<std::size_t>(l) * Hq + g * G + i) * T;
          if (i == G - 1) {
            r[3 + g] = 9;
            r[7 + g] = 8;
            r[11 + g] = 7;
          } else {
            r[0] = r[1] = r[2] = 5;
          }
        }
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead}) {
      KeepPlan p = ref::select_keep(s.data(), L, Hq, Hkv, T, 0, raw(3, mode));
      CHECK(p.keep == 3);
      for (int l = 0; l < L; ++l) {
        CHECK(row_of(p, l, 0) == Idx{3, 7, 11});
        CHECK(row_of(p, l, 1) == Idx{4, 8, 12});
      }
    }
  }
}

TEST_CASE("union: one set for every layer and KV head") {
  // L = 1, Hq = 2, Hkv = 2, T = 6, budget 2. Row tops: head 0 {0, 1}, head 1 {4, 5};
  // U = {0, 1, 4, 5}, max over rows = {9, 3, 0, 0, 8, 4} -> {0, 4} for both KV heads.
  const float s[] = {9, 3, 0, 0, 1, 1, /**/ 0, 0, 0, 0, 8, 4};
  KeepPlan p = ref::select_keep(s, 1, 2, 2, 6, 0, raw(2, PruningMode::kUnion));
  CHECK(row_of(p, 0, 0) == Idx{0, 4});
  CHECK(row_of(p, 0, 1) == Idx{0, 4});
  // per_layer_per_head keeps each head's own top instead.
  KeepPlan q = ref::select_keep(s, 1, 2, 2, 6, 0, raw(2, PruningMode::kPerLayerPerHead));
  CHECK(row_of(q, 0, 0) == Idx{0, 1});
  CHECK(row_of(q, 0, 1) == Idx{4, 5});
}

TEST_CASE("union equals the top-quota by max over layer and query head on random ties") {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> ud(0, 6);  // coarse values: many exact ties
  for (int trial = 0; trial < 200; ++trial) {
    const int L = 1 + trial % 3, Hkv = 1 + trial % 2, Hq = Hkv * (1 + trial % 4), T = 5 + trial % 23;
    std::vector<float> s(static_cast<std::size_t>(L) * Hq * T);
    for (float& x : s) x = static_cast<float>(ud(rng));
    SelectionParams sp = raw(1 + trial % 7, PruningMode::kUnion);
    sp.normalize = trial % 2 == 0;
    KeepPlan p = ref::select_keep(s.data(), L, Hq, Hkv, T, 0, sp);
    REQUIRE_NOTHROW(p.validate(L, Hkv, T));
    if (sp.budget >= T) {
      CHECK(p.keep == T);
      continue;
    }
    std::vector<float> z = s;
    if (sp.normalize) ref::normalize_scores(z.data(), L * Hq, T, 0, T);
    std::vector<float> vmax(z.begin(), z.begin() + T);
    for (int r = 1; r < L * Hq; ++r)
      for (int j = 0; j < T; ++j) vmax[j] = std::max(vmax[j], z[static_cast<std::size_t>(r) * T + j]);
    const Idx expected = ref::top_k_with_ties(vmax.data(), T, sp.budget);
    CAPTURE(trial);
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < Hkv; ++g) CHECK(row_of(p, l, g) == expected);
  }
}

TEST_CASE("exact ties keep the lower slot with and without normalisation") {
  const float s[] = {1, 1, 1, 1, 1, 1};
  for (bool norm : {false, true}) {
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
      SelectionParams sp = raw(3, mode);
      sp.normalize = norm;
      KeepPlan p = ref::select_keep(s, 1, 1, 1, 6, 0, sp);
      CHECK(row_of(p, 0, 0) == Idx{0, 1, 2});
    }
  }
  const float t[] = {2, 7, 3, 7, 7, 1};  // three 7s, budget 2 -> slots 1 and 3
  CHECK(row_of(ref::select_keep(t, 1, 1, 1, 6, 0, raw(2)), 0, 0) == Idx{1, 3});
}

TEST_CASE("normalisation changes the outcome in a known way") {
  // L = 1, Hq = 2, Hkv = 1, T = 4, budget 1.
  // head 0 {0, 1, 0, 0}: z = {-0.577, 1.732, -0.577, -0.577}
  // head 1 {0, 0, 5, 6}: mean 2.75, std 2.773: z = {-0.992, -0.992, 0.811, 1.172}
  // raw group max {0, 1, 5, 6} -> slot 3; normalised group max {-0.577, 1.732, 0.811, 1.172} -> slot 1.
  const float s[] = {0, 1, 0, 0, /**/ 0, 0, 5, 6};
  SelectionParams sp = raw(1);
  CHECK(row_of(ref::select_keep(s, 1, 2, 1, 4, 0, sp), 0, 0) == Idx{3});
  sp.normalize = true;
  CHECK(row_of(ref::select_keep(s, 1, 2, 1, 4, 0, sp), 0, 0) == Idx{1});
  // With one head per group, normalisation is monotone per row and changes nothing.
  const float one[] = {0, 1, 5, 6};
  CHECK(row_of(ref::select_keep(one, 1, 1, 1, 4, 0, sp), 0, 0) == Idx{3});
}

TEST_CASE("normalisation uses only the selectable range") {
  // L = 1, Hq = 2, Hkv = 1, T = 6, pinned prompt [0, 2), budget 3 (quota 1).
  // Decode range [2, 6): head 0 {0, 4, 0, 0}   -> z {-.577, 1.732, -.577, -.577}
  //                      head 1 {0, 0, 3, 3.5} -> z {-.951, -.951, .841, 1.147}. Group max -> slot 3.
  // Had the prompt entered the statistics, head 0's prompt scores (1000) would inflate its std
  // (z at slot 3 = -0.70) and head 1 (prompt scores 0; z at slot 5 = 1.57) would win: slot 5.
  const float s[] = {1000, 1000, 0, 4, 0, 0, /**/ 0, 0, 0, 0, 3, 3.5f};
  SelectionParams sp = raw(3);
  sp.normalize = true;
  KeepPlan p = ref::select_keep(s, 1, 2, 1, 6, 2, sp);
  CHECK(row_of(p, 0, 0) == Idx{0, 1, 3});
  // Competing with budget 1 the prompt is selectable and enters the statistics, exactly the
  // case above: head 1's slot 5 (z 1.57) beats even the prompt's 1000s (z 1.41 in head 0).
  sp.prompt = PromptMode::kCompete;
  sp.budget = 1;
  CHECK(row_of(ref::select_keep(s, 1, 2, 1, 6, 2, sp), 0, 0) == Idx{5});
  sp.normalize = false;  // raw: the 1000s win, lower slot first
  CHECK(row_of(ref::select_keep(s, 1, 2, 1, 6, 2, sp), 0, 0) == Idx{0});
}

TEST_CASE("prompt pinned in budget vs pinned on top vs competing") {
  // T = 10, prompt 3, budget 5, no normalisation; decode scores at slots 3..9 = {1, 7, 3, 9, 2, 8, 4}.
  const float s[] = {100, -5, 0, 1, 7, 3, 9, 2, 8, 4};
  SelectionParams sp = raw(5);
  sp.prompt = PromptMode::kPinnedInBudget;  // 3 pinned + top-2 of decode (9@6, 8@8)
  CHECK(row_of(ref::select_keep(s, 1, 1, 1, 10, 3, sp), 0, 0) == Idx{0, 1, 2, 6, 8});
  sp.prompt = PromptMode::kPinnedOnTop;  // 3 pinned + top-5 of decode (9, 8, 7, 4, 3)
  KeepPlan top = ref::select_keep(s, 1, 1, 1, 10, 3, sp);
  CHECK(top.keep == 8);
  CHECK(row_of(top, 0, 0) == Idx{0, 1, 2, 4, 5, 6, 8, 9});
  sp.prompt = PromptMode::kCompete;  // top-5 of all: 100@0, 9@6, 8@8, 7@4, 4@9
  CHECK(row_of(ref::select_keep(s, 1, 1, 1, 10, 3, sp), 0, 0) == Idx{0, 4, 6, 8, 9});
}

TEST_CASE("sinks and recent window are kept and do not compete") {
  // T = 12, n_sink 2, window 3, budget 7: protected {0, 1} ∪ {9, 10, 11}, quota 2 from [2, 9).
  // Selectable scores {5, 1, 6, 5, 0, 2, 3} at slots 2..8: 6@4, then 5@2 beats 5@5 (tie).
  const float s[] = {-100, -100, 5, 1, 6, 5, 0, 2, 3, -100, -100, -100};
  SelectionParams sp = raw(7);
  sp.n_sink = 2;
  sp.window = 3;
  const ref::KeepCounts kc = ref::keep_counts(12, 0, sp);
  CHECK(kc.num_protected == 5);
  CHECK(kc.selectable_begin == 2);
  CHECK(kc.selectable_end == 9);
  CHECK(kc.quota == 2);
  CHECK(kc.keep == 7);
  CHECK_FALSE(kc.identity);
  for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
    sp.mode = mode;
    CHECK(row_of(ref::select_keep(s, 1, 1, 1, 12, 0, sp), 0, 0) == Idx{0, 1, 2, 4, 9, 10, 11});
  }
  // Sinks inside a pinned prompt add nothing; a window overlapping the prompt is not double counted.
  SelectionParams o = raw(7);  // n_sink + window <= budget (validate)
  o.n_sink = 2;
  o.window = 5;
  const ref::KeepCounts k2 = ref::keep_counts(8, 4, o);  // prompt [0, 4), window [3, 8)
  CHECK(k2.selectable_begin == 4);
  CHECK(k2.selectable_end == 4);
  CHECK(k2.num_protected == 8);
  CHECK(k2.identity);
  // NaN in protected slots is never read.
  const float q[] = {std::nanf(""), 3, 1, 2, std::nanf("")};
  SelectionParams w = raw(3);
  w.n_sink = 1;
  w.window = 1;
  CHECK(row_of(ref::select_keep(q, 1, 1, 1, 5, 0, w), 0, 0) == Idx{0, 1, 4});
}

TEST_CASE("prompt not shorter than the budget: whole prompt kept and warning once") {
  // T = 10, prompt 6, budget 4 (kPinnedInBudget): quota max(0, 4 - 6) = 0.
  const float s[] = {0, 0, 0, 0, 0, 0, 9, 8, 7, 6};
  WarningCounter wc;
  SelectionParams sp = raw(4);
  KeepPlan p = ref::select_keep(s, 1, 1, 1, 10, 6, sp);
  CHECK(p.keep == 6);
  CHECK(row_of(p, 0, 0) == Idx{0, 1, 2, 3, 4, 5});
  (void)ref::select_keep(s, 1, 1, 1, 10, 6, sp);
  (void)ref::select_keep(s, 1, 1, 1, 10, 8, sp);
  CHECK(wc.count == 1);
  CHECK(wc.last.find("kPinnedOnTop") != std::string::npos);
  sp.window = 2;  // the window is still protected
  CHECK(row_of(ref::select_keep(s, 1, 1, 1, 10, 6, sp), 0, 0) == Idx{0, 1, 2, 3, 4, 5, 8, 9});
  // Prompt exactly = budget also warns (0 decode tokens would survive); re-arm with a new handler.
  WarningCounter wc2;
  SelectionParams eq = raw(6);
  (void)ref::select_keep(s, 1, 1, 1, 10, 6, eq);
  CHECK(wc2.count == 1);
  // On top or competing: no warning.
  WarningCounter wc3;
  eq.prompt = PromptMode::kPinnedOnTop;
  (void)ref::select_keep(s, 1, 1, 1, 10, 6, eq);
  eq.prompt = PromptMode::kCompete;
  (void)ref::select_keep(s, 1, 1, 1, 10, 6, eq);
  CHECK(wc3.count == 0);
}

TEST_CASE("budget covering every selectable token gives the identity plan") {
  const float s[] = {3, 1, 2, 0, 5};
  for (int budget : {5, 6, 100}) {
    KeepPlan p = ref::select_keep(s, 1, 1, 1, 5, 0, raw(budget));
    CHECK(p.keep == 5);
    CHECK(p.is_prefix());
  }
  KeepPlan q = ref::select_keep(s, 1, 1, 1, 5, 0, raw(4));
  CHECK(q.keep == 4);
  CHECK(row_of(q, 0, 0) == Idx{0, 1, 2, 4});
  // T = 0 is a valid, empty round.
  KeepPlan e = ref::select_keep(nullptr, 2, 2, 1, 0, 0, raw(4));
  CHECK(e.keep == 0);
  // Layers and KV heads all get the same count.
  std::vector<float> big(static_cast<std::size_t>(3) * 4 * 9, 1.0f);
  KeepPlan b = ref::select_keep(big.data(), 3, 4, 2, 9, 2, raw(5, PruningMode::kPerLayerPerHead));
  CHECK(b.keep == 5);
  CHECK_NOTHROW(b.validate(3, 2, 9));
}

TEST_CASE("bad inputs are rejected") {
  std::vector<float> s = {1, 2, 3, 4, 5, 6};
  SelectionParams sp = raw(2);
  std::vector<float> n = s;
  n[3] = std::nanf("");
  CHECK_THROWS_WITH_AS((void)ref::select_keep(n.data(), 1, 1, 1, 6, 0, sp), doctest::Contains("slot 3"), logic_error);
  n[3] = INFINITY;
  CHECK_THROWS_AS((void)ref::select_keep(n.data(), 1, 1, 1, 6, 0, sp), logic_error);
  for (int b : {0, -1}) {
    SelectionParams bb = raw(b);
    CHECK_THROWS_WITH_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, 0, bb), doctest::Contains("budget"),
                         logic_error);
  }
  SelectionParams d = raw(2);
  d.divide_length = 0;
  CHECK_THROWS_WITH_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, 0, d), doctest::Contains("divide_length"),
                       logic_error);
  SelectionParams k = raw(2);
  k.n_sink = -1;
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, 0, k), logic_error);
  k = raw(2);
  k.window = -2;
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, 0, k), logic_error);
  k = raw(2);
  k.mode = static_cast<PruningMode>(7);
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, 0, k), logic_error);
  CHECK_THROWS_WITH_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, 7, sp), doctest::Contains("prompt_len"),
                       logic_error);
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 1, 1, 1, 6, -1, sp), logic_error);
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 1, 3, 2, 2, 0, sp), logic_error);  // 3 % 2 != 0
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 0, 1, 1, 6, 0, sp), logic_error);
  CHECK_THROWS_AS((void)ref::select_keep(nullptr, 1, 1, 1, 6, 0, sp), logic_error);
  CHECK_THROWS_AS((void)ref::select_keep(s.data(), 1, 1, 1, -1, 0, sp), logic_error);
}
}

TEST_CASE("prompt_mode_from_string inverts to_string and names a bad value") {
  using triattn::PromptMode;
  for (PromptMode m : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete})
    CHECK(triattn::prompt_mode_from_string(triattn::to_string(m)) == m);
  try {
    (void)triattn::prompt_mode_from_string("pinned", "--prompt-mode");
    FAIL("a bad prompt mode was accepted");
  } catch (const triattn::logic_error& e) {
    const std::string what = e.what();
    CHECK(what.find("--prompt-mode") != std::string::npos);
    CHECK(what.find("'pinned'") != std::string::npos);
  }
}

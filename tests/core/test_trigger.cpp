// SPDX-License-Identifier: Apache-2.0
// Tests of core/trigger.hpp with an integer model of one sequence's cache: prefill, then decode
// steps that append one token and compress when the trigger fires, keeping
// ref::keep_counts(...).keep slots. The counted length must saw-tooth in
// [budget, budget + divide_length) and the logical position must never reset.
#include <doctest/doctest.h>

#include <string>

#include <triattn/core/admission.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/ref/select.hpp>
#include <triattn/core/trigger.hpp>

using namespace triattn;

namespace {
struct SimResult {
  int rounds = 0;
  int first_round_step = -1;
  bool ok = true;
  std::string why;
};

/// Prefill `prompt` tokens, then `steps` decode steps.
SimResult simulate(const SelectionParams& p, int prompt, int steps) {
  SimResult r;
  const auto fail = [&](const std::string& w) {
    if (r.ok) r.why = w;
    r.ok = false;
  };
  int phys = prompt;          // physical slots held
  long long logical = prompt; // tokens processed = RoPE position of the next token
  // Pinned prompt slots stay at [0, prompt); a competing prompt is not tracked after a round.
  int pinned = prompt;
  if (CompressionTrigger::should_compress(CompressionTrigger::counted_length(phys, pinned, p), false, p)) {
    const ref::KeepCounts kc = ref::keep_counts(phys, pinned, p);  // only with compress_during_prefill
    phys = kc.keep;
    ++r.rounds;
    r.first_round_step = 0;
    if (!p.prompt_pinned()) pinned = 0;
  }
  for (int step = 1; step <= steps; ++step) {
    ++phys;  // the new token goes into slot phys - 1, rotated at position `logical`
    ++logical;
    const int counted = CompressionTrigger::counted_length(phys, pinned, p);
    if (CompressionTrigger::should_compress(counted, true, p)) {
      const ref::KeepCounts kc = ref::keep_counts(phys, pinned, p);
      if (kc.identity) fail("step " + std::to_string(step) + ": a fired round kept everything");
      phys = kc.keep;
      ++r.rounds;
      if (r.first_round_step < 0) r.first_round_step = step;
      if (!p.prompt_pinned()) pinned = 0;
      const int after = CompressionTrigger::counted_length(phys, pinned, p);
      const int expect = kc.num_protected > p.budget && p.prompt != PromptMode::kPinnedOnTop
                             ? kc.num_protected  // protected tokens alone exceed the budget
                             : p.budget;
      if (after != expect)
        fail("step " + std::to_string(step) + ": counted length after a round is " + std::to_string(after) +
             ", expected " + std::to_string(expect));
    }
    const int now = CompressionTrigger::counted_length(phys, pinned, p);
    if (r.rounds > 0 && (now < p.budget || now >= p.budget + p.divide_length))
      fail("step " + std::to_string(step) + ": counted length " + std::to_string(now) + " outside [" +
           std::to_string(p.budget) + ", " + std::to_string(p.budget + p.divide_length) + ")");
    if (logical != static_cast<long long>(prompt) + step)
      fail("step " + std::to_string(step) + ": logical position " + std::to_string(logical));
  }
  return r;
}

SelectionParams params(int budget, int divide, PromptMode prompt, int n_sink = 0, int window = 0) {
  SelectionParams s;
  s.budget = budget;
  s.divide_length = divide;
  s.prompt = prompt;
  s.n_sink = n_sink;
  s.window = window;
  return s;
}
}  // namespace

TEST_SUITE("selection") {
TEST_CASE("counted_length and should_compress") {
  SelectionParams p = params(100, 10, PromptMode::kPinnedInBudget);
  CHECK(CompressionTrigger::counted_length(150, 30, p) == 150);
  CHECK(CompressionTrigger::threshold(p) == 110);
  CHECK_FALSE(CompressionTrigger::should_compress(109, true, p));
  CHECK(CompressionTrigger::should_compress(110, true, p));
  CHECK_FALSE(CompressionTrigger::should_compress(110, false, p));  // prefill
  p.compress_during_prefill = true;
  CHECK(CompressionTrigger::should_compress(110, false, p));
  p.prompt = PromptMode::kPinnedOnTop;
  CHECK(CompressionTrigger::counted_length(150, 30, p) == 120);
  p.prompt = PromptMode::kCompete;
  CHECK(CompressionTrigger::counted_length(150, 30, p) == 150);
  CHECK_THROWS_AS((void)CompressionTrigger::counted_length(10, 11, p), logic_error);
  CHECK_THROWS_AS((void)CompressionTrigger::counted_length(10, -1, p), logic_error);
  CHECK_THROWS_AS((void)CompressionTrigger::should_compress(-1, true, p), logic_error);
  SelectionParams bad = params(0, 10, PromptMode::kCompete);
  CHECK_THROWS_AS((void)CompressionTrigger::should_compress(5, true, bad), logic_error);
}

TEST_CASE("10000 decode steps: counted length saw-tooths between budget and budget + divide_length") {
  struct Case {
    SelectionParams p;
    int prompt;
  };
  const Case cases[] = {
      {params(64, 16, PromptMode::kPinnedInBudget), 0},
      {params(64, 16, PromptMode::kPinnedInBudget), 20},
      {params(64, 1, PromptMode::kPinnedInBudget), 20},
      {params(64, 16, PromptMode::kPinnedOnTop), 20},
      {params(64, 16, PromptMode::kPinnedOnTop), 500},  // prompt far over the budget
      {params(64, 16, PromptMode::kCompete), 20},
      {params(64, 16, PromptMode::kCompete), 500},
      {params(64, 16, PromptMode::kPinnedInBudget, 4, 8), 20},
      {params(64, 16, PromptMode::kPinnedOnTop, 4, 8), 200},
      {params(2048, 128, PromptMode::kPinnedInBudget), 300},
      {params(1, 1, PromptMode::kCompete), 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.p.budget);
    CAPTURE(c.p.divide_length);
    CAPTURE(to_string(c.p.prompt));
    CAPTURE(c.prompt);
    const SimResult r = simulate(c.p, c.prompt, 10000);
    CAPTURE(r.why);
    CHECK(r.ok);
    CHECK(r.rounds > 0);
  }
}

TEST_CASE("rounds fire every divide_length steps once saturated") {
  const SelectionParams p = params(64, 16, PromptMode::kPinnedInBudget);
  const SimResult r = simulate(p, 0, 64 + 16 + 16 * 100);
  CHECK(r.first_round_step == 80);  // counted reaches 64 + 16 at step 80
  CHECK(r.rounds == 101);
}

TEST_CASE("a prefill longer than the budget is compressed only once decoding starts") {
  const SelectionParams p = params(64, 16, PromptMode::kCompete);
  CHECK_FALSE(CompressionTrigger::should_compress(CompressionTrigger::counted_length(500, 500, p), false, p));
  const SimResult r = simulate(p, 500, 10);
  CHECK(r.ok);
  CHECK(r.first_round_step == 1);
  SelectionParams q = p;
  q.compress_during_prefill = true;
  const SimResult s = simulate(q, 500, 10);
  CHECK(s.ok);
  CHECK(s.first_round_step == 0);
}

TEST_CASE("pinned prompt over the budget: counted length settles at the prompt length") {
  // Protected tokens alone exceed the budget: every round keeps just them (no decode token).
  SelectionParams p = params(64, 16, PromptMode::kPinnedInBudget);
  int phys = 100;
  for (int step = 0; step < 50; ++step) {
    ++phys;
    if (CompressionTrigger::should_compress(CompressionTrigger::counted_length(phys, 100, p), true, p)) {
      const ref::KeepCounts kc = ref::keep_counts(phys, 100, p);
      CHECK(kc.prompt_over_budget);
      CHECK(kc.quota == 0);
      phys = kc.keep;
    }
    CHECK(phys == 100);
  }
}
}

TEST_CASE("ValidSelectionParams: every way of making one validates and names the field") {
  // Functions taking ValidSelectionParams do not check again: plain params passed to them are
  // validated at the conversion, a selector's at its construction.
  SelectionParams bad = params(100, 10, PromptMode::kCompete);
  bad.window = -1;
  CHECK_THROWS_WITH_AS(ValidSelectionParams{bad}, doctest::Contains("SelectionParams::window"), logic_error);
  CHECK_THROWS_WITH_AS(TopKSelector{bad}, doctest::Contains("SelectionParams::window"), logic_error);
  CHECK_THROWS_WITH_AS((void)CompressionTrigger::should_compress(5, true, bad),
                       doctest::Contains("SelectionParams::window"), logic_error);
  CHECK_THROWS_WITH_AS((void)ref::keep_counts(10, 0, bad), doctest::Contains("SelectionParams::window"), logic_error);
  CHECK_THROWS_WITH_AS((void)max_resident_tokens(10, 10, bad), doctest::Contains("SelectionParams::window"),
                       logic_error);
  const ValidSelectionParams ok{params(100, 10, PromptMode::kCompete)};
  CHECK(ok.budget == 100);
  CHECK(TopKSelector(ok).params().divide_length == 10);
}

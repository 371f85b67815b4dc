// SPDX-License-Identifier: Apache-2.0
// The selection settings the round tests sweep: the three prompt modes, each with its own sinks,
// window and normalisation, at a small budget (24, divide_length 8) that a few dozen tokens reach.
#pragma once

#include <triattn/core/scoring_params.hpp>

namespace triattn::test {

struct Protection {
  const char* name;
  PromptMode prompt;
  int n_sink, window;
  bool normalize;
};
inline constexpr Protection kProtections[] = {{"pinned_in_budget", PromptMode::kPinnedInBudget, 0, 0, true},
                                              {"pinned_on_top", PromptMode::kPinnedOnTop, 2, 4, true},
                                              {"compete", PromptMode::kCompete, 4, 8, false}};

inline SelectionParams make_params(PruningMode mode, const Protection& p) {
  SelectionParams sp;
  sp.budget = 24;
  sp.divide_length = 8;
  sp.mode = mode;
  sp.prompt = p.prompt;
  sp.n_sink = p.n_sink;
  sp.window = p.window;
  sp.normalize = p.normalize;
  return sp;
}

}  // namespace triattn::test

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The reference transformer serving requests that share a system prompt (serve_shared.hpp):
// with TriAttention compression on, the prefix cache on gives bitwise the same tokens as off,
// while later requests take the system prompt's blocks from the cache and compute only the rest.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/stats/calibrator.hpp>

#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/generate.hpp>
#include <reference_transformer/llama2c.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/serve_shared.hpp>

namespace ex = triattn_example;
using triattn::test::cache_config;
using triattn::test::Stories;

TEST_CASE("reference transformer: serving with the prefix cache gives the same tokens as without (compressed)") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  // Statistics from a full-cache prefill of the reference story.
  triattn::Calibrator cal(mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, "stories260K");
  {
    ex::Model<> model(s.weights);
    model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
    triattn::KvCache<> cache(cache_config(mc, 257, 1));
    std::vector<int> seq = {1};
    seq.insert(seq.end(), s.greedy.begin(), s.greedy.end());
    const triattn::SeqId id = cache.add_sequence();
    const ex::Chunk chunk{id, seq, triattn::Phase::kPrefill};
    (void)model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
  }
  const triattn::QueryStats stats = cal.finish();
  triattn::RopeConfig rope;
  rope.style = mc.rope_style;
  rope.theta = mc.rope_theta;
  triattn::SelectionParams sel;
  sel.budget = 56;
  sel.divide_length = 8;

  // A 40-token system prompt (2 full blocks of 16), then each request's own tokens; requests 5
  // and 6 repeat request 4's 48 tokens (request 6, a wave later, hits all but its last token and
  // copies the partly shared third block on write).
  std::vector<int> system(s.greedy.begin(), s.greedy.begin() + 39);
  system.insert(system.begin(), 1);
  std::vector<std::vector<int>> prompts;
  for (int r = 0; r < 4; ++r) {
    std::vector<int> p = system;
    for (int i = 0; i <= r; ++i) p.push_back(s.greedy[static_cast<std::size_t>(100 + 7 * r + i)]);
    prompts.push_back(p);
  }
  std::vector<int> p48 = system;  // 48 tokens: 3 full blocks
  p48.insert(p48.end(), s.greedy.begin() + 200, s.greedy.begin() + 208);
  prompts.push_back(p48);
  prompts.push_back(prompts[4]);  // same wave as request 4: shares the system prompt only
  prompts.push_back(prompts[4]);  // a later wave: 47 of its 48 tokens hit

  using Alloc = triattn::PrefixCachingAllocator<triattn::StaticAllocator<triattn::HostBackend>>;
  using Cache = triattn::KvCache<Alloc, triattn::TriAttentionScorer, triattn::TopKSelector>;
  auto run = [&](bool prefix_cache) {
    Cache cache(cache_config(mc, 56 + 8 + 64, 2), triattn::TriAttentionScorer(stats, rope, {}, mc.n_kv_heads),
                triattn::TopKSelector(sel));
    ex::Model<> model(s.weights);
    std::vector<ex::Sampler> samplers;
    for (std::size_t i = 0; i < prompts.size(); ++i) samplers.emplace_back(0.8f, 0.9f, 11 + i);
    ex::GenerationOptions opt;
    opt.max_new_tokens = 90;
    opt.stop_at_bos = false;
    return ex::serve_shared(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers), opt,
                            prefix_cache, /*wave=*/2,
                            [&](std::span<const triattn::SeqId> live) { return cache.compress_if_needed(live); });
  };
  const ex::ServeReport on = run(true);
  const ex::ServeReport off = run(false);
  REQUIRE(on.requests.size() == prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    CHECK(on.requests[i].generated.size() == 90);
    CHECK(on.requests[i].generated == off.requests[i].generated);
    CHECK(on.requests[i].compression_rounds > 0);
    CHECK(on.requests[i].compression_rounds == off.requests[i].compression_rounds);
    CHECK(off.requests[i].cached_tokens == 0);
  }
  // Wave 1 (requests 0, 1) finds nothing; later ones share the system prompt's 2 blocks.
  CHECK(on.requests[0].cached_tokens == 0);
  CHECK(on.requests[1].cached_tokens == 0);
  CHECK(on.requests[2].cached_tokens == 32);
  CHECK(on.requests[3].cached_tokens == 32);
  CHECK(on.requests[4].cached_tokens == 32);
  CHECK(on.requests[5].cached_tokens == 32);
  CHECK(on.requests[6].cached_tokens == 47);
  CHECK(on.computed_prompt_tokens == off.computed_prompt_tokens - (32 * 4 + 47));
  MESSAGE("prefix cache on: " << on.hits << " hits, prompt tokens computed " << on.computed_prompt_tokens << " of "
                              << on.prompt_tokens << ", peak blocks held " << on.peak_blocks_held << " (off: "
                              << off.peak_blocks_held << ")");
}

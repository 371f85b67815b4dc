// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The serving loop (examples/serving/serving_loop.hpp) on the CPU backend with stories260K: small
// traces (offline and Poisson arrivals, a KV pool that holds only part of them, exact admission
// and optimistic admission with preemption, chunked prefill mixed with decoding, the prefix
// cache) through the loop; every request's tokens must equal those of the request run alone
// (tests/common/serving_checks.hpp): without compression, and with TriAttention rounds (a round
// depends only on its own sequence, and fires at the same lengths as alone).
// ctest: TIMEOUT 300
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/prefix_cache.hpp>

#include "common/reference_transformer_checks.hpp"
#include "common/serving_checks.hpp"

#include <reference_transformer/model.hpp>
#include <reference_transformer/stats_io.hpp>
#include <serving/serving_loop.hpp>
#include <serving/workload.hpp>

namespace ex = triattn_example;
namespace sv = triattn_serving;
using triattn::test::Stories;

namespace {
using Alloc = triattn::PrefixCachingAllocator<triattn::StaticAllocator<triattn::HostBackend>>;
using Plain = triattn::KvCache<Alloc, triattn::HostCompactor>;
using Tri = triattn::KvCache<Alloc, triattn::HostCompactor, triattn::TriAttentionScorer, triattn::TopKSelector>;
}  // namespace

TEST_CASE("serving loop on the CPU: without compression every request generates what it generates alone") {
  const Stories& s = Stories::get();
  ex::Model<> model(s.weights);
  const int preempted = triattn::test::check_serving_traces(
      model, [&] { return std::make_unique<Plain>(triattn::test::serving_pool(s.weights.config)); },
      [](Plain& c) { return std::make_unique<sv::HostRounds<Plain>>(c); }, [](Plain&) { return ex::CompressFn{}; },
      /*compressed=*/false);
  CHECK(preempted > 0);  // the optimistic traces ran out of blocks and recomputed
}

TEST_CASE("serving loop on the CPU: with TriAttention rounds every request generates what it generates alone") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::Model<> model(s.weights);
  const triattn::QueryStats qs = triattn::test::serving_stats(mc);
  (void)triattn::test::check_serving_traces(
      model,
      [&] {
        return std::make_unique<Tri>(triattn::test::serving_pool(mc),
                                     triattn::TriAttentionScorer(qs, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads),
                                     triattn::TopKSelector(triattn::test::serving_selection()));
      },
      [](Tri& c) { return std::make_unique<sv::HostRounds<Tri>>(c); },
      [](Tri& c) { return ex::CompressFn([&c](std::span<const triattn::SeqId> live) { return c.compress_if_needed(live); }); },
      /*compressed=*/true);
}

TEST_CASE("serving loop: a request that can never fit the pool is refused naming it") {
  const Stories& s = Stories::get();
  ex::Model<> model(s.weights);
  triattn::CacheConfig c = triattn::test::serving_pool(s.weights.config);
  c.num_blocks = 4;
  c.max_blocks_per_seq = 4;
  Plain cache(c);
  sv::HostRounds<Plain> rounds(cache);
  std::vector<sv::Request> reqs(2);
  reqs[0].prompt = {1, 5, 6};
  reqs[0].max_new_tokens = 8;
  reqs[1].prompt = {1, 7};
  reqs[1].max_new_tokens = 200;  // 202 tokens: 13 blocks, more than the pool
  CHECK_THROWS_WITH_AS(sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), sv::LoopOptions{}),
                       doctest::Contains("request 1"), triattn::logic_error);
}

TEST_CASE("serving workloads: a JSONL trace replays through the loop and a bad line is refused naming it") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  const std::string text =
      "{\"arrival\": 0.0, \"prompt\": [1, 40, 41, 42], \"max_new_tokens\": 20}\n"
      "\n"
      "{\"arrival\": 0.005, \"prompt_len\": 30, \"max_new_tokens\": 12}\n";
  const std::vector<sv::Request> reqs = sv::parse_trace(text, "t.jsonl", mc.vocab_size, mc.bos_id, 3);
  REQUIRE(reqs.size() == 2);
  CHECK(reqs[0].prompt == std::vector<int>{1, 40, 41, 42});
  CHECK(reqs[0].max_new_tokens == 20);
  CHECK(reqs[1].arrival_s == doctest::Approx(0.005));
  CHECK(reqs[1].prompt.size() == 30);
  CHECK(reqs[1].prompt[0] == mc.bos_id);
  ex::Model<> model(s.weights);
  Plain cache(triattn::test::serving_pool(mc));
  sv::HostRounds<Plain> rounds(cache);
  const sv::LoopResult res = sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), sv::LoopOptions{});
  CHECK(res.requests[0].generated.size() == 20);
  CHECK(res.requests[1].generated.size() == 12);
  CHECK(res.requests[1].first_token_s >= 0.005);  // not served before it arrived
  CHECK_THROWS_WITH_AS((void)sv::parse_trace("{\"arrival\": 0, \"max_new_tokens\": 3, \"prompt\": [1]}\n{\"arrival\": 1}\n",
                                             "t.jsonl", mc.vocab_size, mc.bos_id, 3),
                       doctest::Contains("t.jsonl:2"), triattn::format_error);
  CHECK_THROWS_WITH_AS((void)sv::parse_trace("{\"arrival\": 0, \"max_new_tokens\": 3, \"prompt\": [1, 9999]}\n", "t.jsonl",
                                             mc.vocab_size, mc.bos_id, 3),
                       doctest::Contains("t.jsonl:1"), triattn::format_error);
}

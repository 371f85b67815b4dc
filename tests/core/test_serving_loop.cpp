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

#include <random>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/stats/random.hpp>

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

struct Trace {
  const char* workload;
  double rate;  // 0: offline
  sv::Admission admission;
  bool prefix;
  float temperature;
  int max_running;  // 0: the pool's 8 sequences
};

/// Workload of `t` for stories260K: 8 requests, lengths scaled down (reasoning: prompts of 3-26
/// tokens, 100-410 generated; shared: a 41-token system prompt + 3, 164 generated).
std::vector<sv::Request> requests(const Trace& t, const ex::ModelConfig& mc) {
  sv::WorkloadSpec w;
  w.kind = t.workload;
  w.requests = 8;
  w.scale = std::string(t.workload) == "shared" ? 0.01 : 0.025;
  w.gen_scale = std::string(t.workload) == "shared" ? 4.0 : 1.0;
  w.seed = 7;
  std::vector<sv::Request> r = sv::make_workload(w, mc.vocab_size, mc.bos_id);
  sv::poisson_arrivals(r, t.rate, 7);
  return r;
}

/// 60 blocks of 16 tokens for 8 sequences: uncompressed, about two requests fit at their worst
/// case; compressed (budget 48 + 16), all of them.
triattn::CacheConfig pool(const ex::ModelConfig& mc) {
  triattn::CacheConfig c;
  c.model = mc.geometry();
  c.block_size = 16;
  c.max_seqs = 8;
  c.num_blocks = 60;
  c.max_blocks_per_seq = 30;
  c.dtype = triattn::DType::kF32;
  c.layout = triattn::KvLayout::kNHD;
  return c;
}

sv::LoopOptions loop_options(const Trace& t) {
  sv::LoopOptions lo;
  lo.admission = t.admission;
  lo.prefill_chunk = 24;  // prompts span several steps, mixed with decode rows
  lo.prefix_cache = t.prefix;
  lo.temperature = t.temperature;
  lo.top_p = 0.9f;
  lo.seed = 100;
  lo.max_running = t.max_running;
  return lo;
}

std::string name(const Trace& t) {
  return std::string(t.workload) + (t.rate > 0 ? ", Poisson" : ", offline") +
         (t.admission == sv::Admission::kExact ? ", exact" : ", optimistic") + (t.prefix ? ", prefix cache" : "") +
         (t.temperature > 0 ? ", sampled" : ", greedy");
}

const Trace kTraces[] = {
    {"reasoning", 0.0, sv::Admission::kExact, false, 0.0f, 0},
    {"reasoning", 400.0, sv::Admission::kOptimistic, false, 0.8f, 0},
    // At most 3 running: later requests are admitted after earlier ones published their prompts.
    {"shared", 0.0, sv::Admission::kOptimistic, true, 0.0f, 3},
    {"shared", 400.0, sv::Admission::kExact, true, 0.8f, 3},
};

triattn::SelectionParams selection() {
  triattn::SelectionParams sel;
  sel.budget = 48;
  sel.divide_length = 16;
  return sel;
}

triattn::QueryStats stats(const ex::ModelConfig& mc) {
  std::mt19937 rng(1234);
  return triattn::random_query_stats(rng, mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);
}

}  // namespace

TEST_CASE("serving loop on the CPU: without compression every request generates what it generates alone") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::Model<> model(s.weights);
  int preempted = 0;
  for (const Trace& t : kTraces) {
    CAPTURE(name(t));
    const std::vector<sv::Request> reqs = requests(t, mc);
    const sv::LoopOptions lo = loop_options(t);
    Plain cache(pool(mc));
    sv::HostRounds<Plain> rounds(cache);
    const sv::LoopResult res = sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), lo);
    CHECK(cache.num_active() == 0);
    std::vector<std::vector<int>> alone;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      Plain fresh(pool(mc));
      alone.push_back(triattn::test::tokens_alone(model, fresh, reqs[i], i, lo, {}));
    }
    triattn::test::check_same_tokens(res, alone);
    if (t.admission == sv::Admission::kExact) CHECK(res.preemptions == 0);
    if (t.prefix) CHECK(res.prefix.hit_blocks > 0);
    preempted += res.preemptions;
  }
  CHECK(preempted > 0);  // the optimistic traces ran out of blocks and recomputed
}

TEST_CASE("serving loop on the CPU: with TriAttention rounds every request generates what it generates alone") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::Model<> model(s.weights);
  const triattn::QueryStats qs = stats(mc);
  auto make = [&] {
    return Tri(pool(mc), triattn::TriAttentionScorer(qs, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads),
               triattn::TopKSelector(selection()));
  };
  for (const Trace& t : kTraces) {
    CAPTURE(name(t));
    const std::vector<sv::Request> reqs = requests(t, mc);
    const sv::LoopOptions lo = loop_options(t);
    Tri cache = make();
    sv::HostRounds<Tri> rounds(cache);
    const sv::LoopResult res = sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), lo);
    std::vector<std::vector<int>> alone;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      Tri fresh = make();
      alone.push_back(triattn::test::tokens_alone(model, fresh, reqs[i], i, lo, [&](std::span<const triattn::SeqId> live) {
        return fresh.compress_if_needed(live);
      }));
    }
    triattn::test::check_same_tokens(res, alone);
    CHECK(res.sequences_compressed >= static_cast<std::int64_t>(reqs.size()));  // every request was compressed
    if (t.prefix) CHECK(res.prefix.hit_blocks > 0);
  }
}

TEST_CASE("serving loop: a request that can never fit the pool is refused naming it") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::Model<> model(s.weights);
  triattn::CacheConfig c = pool(mc);
  c.num_blocks = 4;
  c.max_blocks_per_seq = 4;
  Plain cache(c);
  sv::HostRounds<Plain> rounds(cache);
  std::vector<sv::Request> reqs(2);
  reqs[0].prompt = {1, 5, 6};
  reqs[0].max_new_tokens = 8;
  reqs[1].prompt = {1, 7};
  reqs[1].max_new_tokens = 200;  // 202 tokens: 13 blocks, more than a row holds
  CHECK_THROWS_WITH_AS(sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), sv::LoopOptions{}),
                       doctest::Contains("request 1"), triattn::logic_error);
}

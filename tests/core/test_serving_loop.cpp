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

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
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

/// DeviceRounds' schedule on the host (the loop's scheduling, not its arithmetic): launch() only
/// records the sequences (in flight, busy); the round runs (KvCache::compress_if_needed) when
/// poll() sees it a second time, after the step the loop ran beside it, or at wait(). `steps`
/// counts the loop's steps (LoopHooks::after_step): rounds are due after a step, so a launch with
/// no step since the previous launch means the loop relaunches the same sequences at the same
/// lengths, forever (it throws instead of hanging).
template <class Cache>
class DeferredRounds {
 public:
  DeferredRounds(Cache& cache, const std::int64_t& steps) : cache_(&cache), steps_(&steps) {}
  [[nodiscard]] std::vector<triattn::CompressionReport> poll() {
    if (seqs_.empty() || ++polls_ < 2) return {};
    return run();
  }
  [[nodiscard]] bool busy() const noexcept { return !seqs_.empty(); }
  [[nodiscard]] bool in_flight(triattn::SeqId s) const noexcept {
    return std::find(seqs_.begin(), seqs_.end(), s) != seqs_.end();
  }
  void launch(std::span<const triattn::SeqId> seqs) {
    if (seqs.empty()) return;
    if (!seqs_.empty()) throw triattn::logic_error("DeferredRounds: a round launched while one is in flight");
    if (launched_at_ == *steps_)
      throw triattn::logic_error("DeferredRounds: a round launched at step " + std::to_string(*steps_) +
                                 " again, no step since: the loop relaunches rounds without making progress");
    launched_at_ = *steps_;
    seqs_.assign(seqs.begin(), seqs.end());
    polls_ = 0;
  }
  std::vector<triattn::CompressionReport> wait() { return seqs_.empty() ? std::vector<triattn::CompressionReport>{} : run(); }

 private:
  std::vector<triattn::CompressionReport> run() {
    std::vector<triattn::CompressionReport> r = cache_->compress_if_needed(std::span<const triattn::SeqId>(seqs_));
    seqs_.clear();
    return r;
  }
  Cache* cache_;
  const std::int64_t* steps_;
  std::int64_t launched_at_ = -1;
  std::vector<triattn::SeqId> seqs_;
  int polls_ = 0;
};

/// Each request run alone in a fresh cache of make_cache() with its rounds: the tokens, and in
/// `rounds` how many rounds compressed it.
template <class ModelT, class MakeCache>
std::vector<std::vector<int>> tri_alone(ModelT& model, const MakeCache& make_cache, const std::vector<sv::Request>& reqs,
                                        const sv::LoopOptions& lo, std::vector<std::size_t>& rounds) {
  std::vector<std::vector<int>> alone;
  rounds.assign(reqs.size(), 0);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    auto fresh = make_cache();
    Tri& c = *fresh;
    alone.push_back(triattn::test::tokens_alone(
        model, c, reqs[i], i, lo,
        ex::CompressFn([&c](std::span<const triattn::SeqId> live) { return c.compress_if_needed(live); }), &rounds[i]));
  }
  return alone;
}
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

// The GPU run of benchmarks/serving_gpu.sh's shared-prompt table hung in `tri`: prompts (544
// tokens) longer than budget + divide_length (272), pinned in the budget, so a round leaves every
// sequence at its trigger; with rounds in flight across steps the loop relaunched them after each
// commit without a step between (all sequences sat out, no progress). Each sequence must get one
// round per decode step, as alone.
TEST_CASE("serving loop: with rounds in flight across steps and prompts longer than the trigger each sequence gets one round per decode step") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::Model<> model(s.weights);
  const triattn::QueryStats qs = triattn::test::serving_stats(mc);
  const triattn::SelectionParams sel = triattn::test::serving_selection();
  auto make_cache = [&] {
    return std::make_unique<Tri>(triattn::test::serving_pool(mc),
                                 triattn::TriAttentionScorer(qs, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads),
                                 triattn::TopKSelector(sel));
  };
  sv::WorkloadSpec w;
  w.kind = "shared";
  w.requests = 8;
  w.scale = 0.02;  // 82 shared + 5 own prompt tokens (> 48 + 16), 82 generated
  w.seed = 7;
  const std::vector<sv::Request> reqs = sv::make_workload(w, mc.vocab_size, mc.bos_id);
  REQUIRE(static_cast<int>(reqs[0].prompt.size()) > sel.budget + sel.divide_length);
  sv::LoopOptions lo;
  lo.admission = sv::Admission::kExact;
  lo.prefill_chunk = 24;
  auto cache = make_cache();
  std::int64_t steps = 0;
  DeferredRounds<Tri> rounds(*cache, steps);
  sv::LoopHooks hooks;
  hooks.after_step = [&steps] { ++steps; };
  const sv::LoopResult res = sv::serve(model, *cache, rounds, std::span<const sv::Request>(reqs), lo, hooks);
  CHECK(cache->num_active() == 0);
  std::vector<std::size_t> alone_rounds;
  const std::vector<std::vector<int>> alone = tri_alone(model, make_cache, reqs, lo, alone_rounds);
  triattn::test::check_same_tokens(res, alone);
  triattn::test::check_step_records(res);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    CAPTURE(i);
    CHECK(static_cast<std::size_t>(res.requests[i].rounds) == alone_rounds[i]);
    CHECK(alone_rounds[i] + 2 >= static_cast<std::size_t>(reqs[i].max_new_tokens));  // a round (nearly) every decode step
  }
  CHECK(res.preemptions == 0);
}

// No input makes the loop hang: random small workloads (prompts below, at and beyond the
// trigger, with and without a shared system prompt), every prompt mode, budgets, prefill chunks,
// both admissions, the prefix cache, fewer running than the pool holds, greedy and sampled, pools
// of 24-60 blocks of 16 tokens (or the same memory in blocks of 4), f32 or fp8 KV, and rounds in
// flight across steps (DeferredRounds) or committed at once (HostRounds). Each run must finish
// within a step bound linear in its tokens, and every request must generate the tokens and get
// the rounds it gets alone.
TEST_CASE("serving loop soak: random workloads and options finish and every request matches its run alone") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::Model<> model(s.weights);
  const triattn::QueryStats qs = triattn::test::serving_stats(mc);
  const triattn::PromptMode modes[] = {triattn::PromptMode::kPinnedInBudget, triattn::PromptMode::kPinnedOnTop,
                                       triattn::PromptMode::kCompete};
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {  // 300 seeds pass too (20 s)
    std::mt19937_64 rng(seed);
    auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    triattn::SelectionParams sel;
    sel.budget = pick(0, 1) != 0 ? 32 : 48;
    sel.divide_length = pick(0, 1) != 0 ? 8 : 16;
    sel.prompt = modes[pick(0, 2)];
    sv::LoopOptions lo;
    lo.admission = pick(0, 1) != 0 ? sv::Admission::kExact : sv::Admission::kOptimistic;
    const int chunks[] = {0, 7, 24, 64};
    lo.prefill_chunk = chunks[pick(0, 3)];
    lo.prefix_cache = pick(0, 1) != 0;
    lo.max_running = pick(0, 1) != 0 ? 0 : 3;
    lo.temperature = pick(0, 1) != 0 ? 0.0f : 0.8f;
    lo.top_p = 0.9f;
    lo.seed = 100 + seed;
    const bool deferred = pick(0, 1) != 0;
    triattn::CacheConfig pool = triattn::test::serving_pool(mc);
    const int pools[] = {24, 40, 60};  // from a few requests at a time to all of them
    pool.num_blocks = pools[pick(0, 2)];
    pool.max_blocks_per_seq = std::min(pool.max_blocks_per_seq, pool.num_blocks);
    if (pick(0, 3) == 0) pool.dtype = triattn::DType::kFP8E4M3;  // e4m3, every scale 1
    if (pick(0, 2) == 0) {  // the same memory in blocks of 4 tokens
      pool.block_size = 4;
      pool.num_blocks *= 4;
      pool.max_blocks_per_seq *= 4;
    }
    // Prompts of 2-100 tokens (around budget + divide_length), after a shared system prompt of
    // 16-60 tokens in half the runs; 1-90 generated.
    std::vector<int> system{mc.bos_id};
    if (pick(0, 1) != 0) {
      const int n = pick(16, 60);
      for (int t = 0; t < n; ++t) system.push_back(pick(3, mc.vocab_size - 1));
    }
    std::vector<sv::Request> reqs(static_cast<std::size_t>(pick(3, 6)));
    std::int64_t tokens = 0;
    for (sv::Request& r : reqs) {
      r.prompt = system;
      const int own = pick(system.size() > 1 ? 1 : 1, system.size() > 1 ? 40 : 99);
      for (int t = 0; t < own; ++t) r.prompt.push_back(pick(3, mc.vocab_size - 1));
      r.max_new_tokens = pick(1, 90);
      tokens += static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens;
    }
    CAPTURE(seed);
    const std::string mode = triattn::to_string(sel.prompt);
    CAPTURE(mode);
    CAPTURE(system.size());
    CAPTURE(sel.budget);
    CAPTURE(sel.divide_length);
    CAPTURE(lo.prefill_chunk);
    CAPTURE(lo.prefix_cache);
    CAPTURE(static_cast<int>(lo.admission));
    CAPTURE(lo.max_running);
    CAPTURE(deferred);
    CAPTURE(pool.num_blocks);
    CAPTURE(pool.block_size);
    CAPTURE(triattn::dtype_name(pool.dtype));
    auto make_cache = [&] {
      return std::make_unique<Tri>(pool,
                                   triattn::TriAttentionScorer(qs, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads),
                                   triattn::TopKSelector(sel));
    };
    auto cache = make_cache();
    std::int64_t steps = 0;
    const std::int64_t max_steps = 4 * tokens + 64;  // a step runs at least one token of some request
    sv::LoopHooks hooks;
    hooks.after_step = [&steps, max_steps] {
      if (++steps > max_steps)
        throw triattn::logic_error("serving loop soak: " + std::to_string(steps) + " steps, more than " +
                                   std::to_string(max_steps) + " for the workload's tokens (no progress)");
    };
    sv::LoopResult res;
    if (deferred) {
      DeferredRounds<Tri> rounds(*cache, steps);
      res = sv::serve(model, *cache, rounds, std::span<const sv::Request>(reqs), lo, hooks);
    } else {
      sv::HostRounds<Tri> rounds(*cache);
      res = sv::serve(model, *cache, rounds, std::span<const sv::Request>(reqs), lo, hooks);
    }
    CHECK(cache->num_active() == 0);
    std::vector<std::size_t> alone_rounds;
    const std::vector<std::vector<int>> alone = tri_alone(model, make_cache, reqs, lo, alone_rounds);
    triattn::test::check_step_records(res);
    REQUIRE(res.requests.size() == reqs.size());
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      CAPTURE(i);
      CAPTURE(res.requests[i].cached_prompt_tokens);
      CHECK(res.requests[i].generated == alone[i]);
      CHECK(static_cast<std::size_t>(res.requests[i].rounds) == alone_rounds[i]);
    }
  }
}

TEST_CASE("serving loop: an arrival more than a day away is refused instead of slept for") {
  const Stories& s = Stories::get();
  ex::Model<> model(s.weights);
  Plain cache(triattn::test::serving_pool(s.weights.config));
  sv::HostRounds<Plain> rounds(cache);
  std::vector<sv::Request> reqs(2);
  for (sv::Request& r : reqs) r.prompt = {s.weights.config.bos_id, 5, 6};
  reqs[1].arrival_s = 1.7e12;  // an epoch time in ms, say
  CHECK_THROWS_WITH_AS((void)sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), sv::LoopOptions{}),
                       doctest::Contains("request 1 arrives at"), triattn::logic_error);
  CHECK(cache.num_active() == 0);
  sv::LoopOptions offline;
  offline.wall_clock = false;  // arrivals only order the queue: nothing is waited for
  const sv::LoopResult res = sv::serve(model, cache, rounds, std::span<const sv::Request>(reqs), offline);
  CHECK(res.requests[1].generated.size() == 1);
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
  // "prompt_len" lines expand: the prompts' total is capped (here 64 tokens: the third line passes it).
  const std::string lens = "{\"arrival\": 0, \"max_new_tokens\": 1, \"prompt_len\": 30}\n";
  CHECK(sv::parse_trace(lens + lens, "t.jsonl", mc.vocab_size, mc.bos_id, 3, 64).size() == 2);
  CHECK_THROWS_WITH_AS((void)sv::parse_trace(lens + lens + lens, "t.jsonl", mc.vocab_size, mc.bos_id, 3, 64),
                       doctest::Contains("t.jsonl:3: the trace's prompts pass 64 tokens in all (90 so far)"),
                       triattn::format_error);
}

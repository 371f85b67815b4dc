// SPDX-License-Identifier: Apache-2.0
// Checks shared by the serving-loop tests (CPU: tests/core/test_serving_loop.cpp, GPU:
// tests/cuda/test_serving_loop_gpu.cu): every request served through the loop, beside others,
// must generate the tokens it generates alone. "Alone" runs through the reference transformer's
// own drivers, not through the loop: generate() on a fresh cache (rounds after every step), or
// serve_shared() with one prompt when the configuration caches prefixes (its prompt published, so
// its rounds protect the same blocks).
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/stats/random.hpp>

#include <reference_transformer/generate.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/serve_shared.hpp>
#include <serving/report.hpp>
#include <serving/serving_loop.hpp>
#include <serving/workload.hpp>

namespace triattn::test {

/// The tokens request `r` generates alone in `cache` (fresh, empty), sampling as the loop does
/// for request `index` (seed + index); `compress_fn` runs the rounds (empty: none). `rounds`, when
/// given, receives how many rounds compressed the request's sequence.
template <class ModelT, class Cache>
std::vector<int> tokens_alone(ModelT& model, Cache& cache, const triattn_serving::Request& r, std::size_t index,
                              const triattn_serving::LoopOptions& lo, const triattn_example::CompressFn& compress_fn,
                              std::size_t* rounds = nullptr) {
  std::size_t counted = 0;
  triattn_example::CompressFn compress;
  if (compress_fn)
    compress = [&counted, &compress_fn](std::span<const SeqId> live) {
      std::vector<CompressionReport> reps = compress_fn(live);
      counted += reps.size();
      return reps;
    };
  std::vector<triattn_example::Sampler> samplers{triattn_example::Sampler(lo.temperature, lo.top_p, lo.seed + index)};
  triattn_example::GenerationOptions go;
  go.max_new_tokens = r.max_new_tokens;
  go.stop_at_bos = false;
  go.prefill_chunk = lo.prefill_chunk;
  const std::vector<std::vector<int>> prompts{r.prompt};
  if (lo.prefix_cache) {
    const triattn_example::ServeReport rep =
        triattn_example::serve_shared(model, cache, std::span<const std::vector<int>>(prompts),
                                      std::span<triattn_example::Sampler>(samplers), go, true, 1, compress);
    if (rounds != nullptr) *rounds = counted;
    return rep.requests.at(0).generated;
  }
  triattn_example::GenerationCallbacks cb;
  if (compress) cb.after_step = compress;
  const std::vector<triattn_example::SequenceResult> res = triattn_example::generate(
      model, cache, std::span<const std::vector<int>>(prompts), std::span<triattn_example::Sampler>(samplers), go, cb);
  cache.release(res.at(0).seq);
  if (rounds != nullptr) *rounds = counted;
  return res.at(0).generated;
}

/// Every step's record adds up: its gap is the sum of its parts, and the rounds launched and
/// committed over the steps are the sequences compressed.
inline void check_step_records(const triattn_serving::LoopResult& res) {
  std::int64_t launched = 0, committed = 0;
  for (std::size_t i = 0; i < res.steps.size(); ++i) {
    const triattn_serving::StepRecord& st = res.steps[i];
    CAPTURE(i);
    CHECK(st.decode_rows + st.prefill_chunks >= 1);
    CHECK((st.prefill_tokens > 0) == (st.prefill_chunks > 0));
    for (double x : {st.gap_s, st.sched_s, st.enqueue_s, st.during_s, st.sync_s, st.post_s, st.round_wait_s, st.round_host_s})
      CHECK(x >= 0.0);
    if (i > 0) CHECK(st.gap_s == doctest::Approx(st.sched_s + st.enqueue_s + st.during_s + st.sync_s + st.post_s).epsilon(1e-6));
    CHECK(st.round_wait_s <= st.sched_s + 1e-9);
    launched += st.round_launched;
    committed += st.round_committed;
  }
  CHECK(launched == res.sequences_compressed);
  CHECK(committed == res.sequences_compressed);
}

/// Every request's tokens equal `alone[i]`, and the run was a real batch: requests ran together,
/// some steps mixed prefill chunks with decode rows. Returns how many requests matched.
inline std::size_t check_same_tokens(const triattn_serving::LoopResult& res, const std::vector<std::vector<int>>& alone) {
  REQUIRE(res.requests.size() == alone.size());
  std::size_t same = 0;
  for (std::size_t i = 0; i < alone.size(); ++i) {
    CAPTURE(i);
    CHECK(res.requests[i].generated.size() == alone[i].size());
    CHECK(res.requests[i].generated == alone[i]);
    same += res.requests[i].generated == alone[i] ? 1 : 0;
  }
  const triattn_serving::Summary s = triattn_serving::summarize(res, "test", 0.0);
  CHECK(s.max_running > 1);
  bool mixed = false;
  for (const triattn_serving::StepRecord& st : res.steps) mixed = mixed || (st.decode_rows > 0 && st.prefill_tokens > 0);
  CHECK(mixed);
  return same;
}


/// The traces both tests serve: 8 requests each, lengths scaled down for small models.
struct ServingTrace {
  const char* workload;
  double rate;  ///< requests/s; 0: offline
  triattn_serving::Admission admission;
  bool prefix;
  float temperature;
  int max_running;  ///< 0: the pool's 8 sequences
};
inline const ServingTrace kServingTraces[] = {
    {"reasoning", 0.0, triattn_serving::Admission::kExact, false, 0.0f, 0},
    {"reasoning", 400.0, triattn_serving::Admission::kOptimistic, false, 0.8f, 0},
    // At most 3 running: later requests are admitted after earlier ones published their prompts.
    {"shared", 0.0, triattn_serving::Admission::kOptimistic, true, 0.0f, 3},
    {"shared", 400.0, triattn_serving::Admission::kExact, true, 0.8f, 3},
};

inline std::string trace_name(const ServingTrace& t) {
  return std::string(t.workload) + (t.rate > 0 ? " Poisson" : " offline") +
         (t.admission == triattn_serving::Admission::kExact ? " exact" : " optimistic") + (t.prefix ? " prefix-cache" : "") +
         (t.temperature > 0 ? " sampled" : " greedy");
}

/// The requests of `t`: reasoning prompts of 3-26 tokens and 100-410 generated; shared: a
/// 41-token system prompt + 3 of each request's own, 164 generated.
inline std::vector<triattn_serving::Request> trace_requests(const ServingTrace& t, const triattn_example::ModelConfig& mc) {
  triattn_serving::WorkloadSpec w;
  w.kind = t.workload;
  w.requests = 8;
  const bool shared = std::string(t.workload) == "shared";
  w.scale = shared ? 0.01 : 0.025;
  w.gen_scale = shared ? 4.0 : 1.0;
  w.seed = 7;
  std::vector<triattn_serving::Request> r = triattn_serving::make_workload(w, mc.vocab_size, mc.bos_id);
  triattn_serving::poisson_arrivals(r, t.rate, 7);
  return r;
}

/// 60 blocks of 16 tokens for 8 sequences: uncompressed, a few requests fit at their worst case
/// (the rest wait, or preempt); compressed (serving_selection), all of them.
inline CacheConfig serving_pool(const triattn_example::ModelConfig& mc, DType dtype = DType::kF32) {
  CacheConfig c;
  c.model = mc.geometry();
  c.block_size = 16;
  c.max_seqs = 8;
  c.num_blocks = 60;
  c.max_blocks_per_seq = 30;
  c.dtype = dtype;
  c.layout = KvLayout::kNHD;
  return c;
}

/// Budget 48 + divide_length 16: every request goes through many rounds.
inline SelectionParams serving_selection() {
  SelectionParams sel;
  sel.budget = 48;
  sel.divide_length = 16;
  return sel;
}

/// Random statistics (the keep sets depend on them, the equality does not).
inline QueryStats serving_stats(const triattn_example::ModelConfig& mc) {
  std::mt19937 rng(1234);
  return random_query_stats(rng, mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);
}

inline triattn_serving::LoopOptions trace_loop_options(const ServingTrace& t) {
  triattn_serving::LoopOptions lo;
  lo.admission = t.admission;
  lo.prefill_chunk = 24;  // prompts span several steps, mixed with decode rows
  lo.prefix_cache = t.prefix;
  lo.temperature = t.temperature;
  lo.top_p = 0.9f;
  lo.seed = 100;
  lo.max_running = t.max_running;
  return lo;
}

/// Serves every trace of kServingTraces through the loop (a cache of make_cache(), rounds of
/// make_rounds(cache)) and each request alone (a fresh cache, rounds by alone_compress(cache):
/// a CompressFn, empty without compression), and checks the tokens equal. `compressed`: every
/// request must also have been compressed. Returns the preemptions over all traces.
template <class ModelT, class MakeCache, class MakeRounds, class AloneCompress>
int check_serving_traces(ModelT& model, const MakeCache& make_cache, const MakeRounds& make_rounds,
                         const AloneCompress& alone_compress, bool compressed) {
  const triattn_example::ModelConfig& mc = model.config();
  int preempted = 0;
  for (const ServingTrace& t : kServingTraces) {
    CAPTURE(trace_name(t));
    const std::vector<triattn_serving::Request> reqs = trace_requests(t, mc);
    const triattn_serving::LoopOptions lo = trace_loop_options(t);
    auto cache = make_cache();
    auto rounds = make_rounds(*cache);
    const triattn_serving::LoopResult res =
        triattn_serving::serve(model, *cache, *rounds, std::span<const triattn_serving::Request>(reqs), lo);
    CHECK(cache->num_active() == 0);
    std::vector<std::vector<int>> alone;
    std::vector<std::size_t> alone_rounds(reqs.size(), 0);
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      auto fresh = make_cache();
      alone.push_back(tokens_alone(model, *fresh, reqs[i], i, lo, alone_compress(*fresh), &alone_rounds[i]));
    }
    check_same_tokens(res, alone);
    check_step_records(res);
    // Each round is credited to its own request (the loop's commit finds it by sequence slot):
    // as many as alone (a preempted request's count restarts with its recompute).
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      CAPTURE(i);
      CHECK(static_cast<std::size_t>(res.requests[i].rounds) == alone_rounds[i]);
    }
    if (t.admission == triattn_serving::Admission::kExact) CHECK(res.preemptions == 0);
    if (t.prefix) CHECK(res.prefix.hit_blocks > 0);
    if (compressed) CHECK(res.sequences_compressed >= static_cast<std::int64_t>(reqs.size()));
    preempted += res.preemptions;
  }
  return preempted;
}

}  // namespace triattn::test

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// Tensor-parallel reference transformer on the CPU (examples/reference_transformer/
// tensor_parallel.hpp): tp ranks in tp threads, triattn::tp::ThreadTeamCollective as the
// all-reduce (the CPU stand-in for NCCL).
//   * shards reassemble the full weights; splits the heads or the MLP do not allow are refused
//   * stories260K at tp 2 and 4: prefill logits and each rank's K/V equal tp 1's
//   * compressed greedy decoding (several TriAttention rounds, all three pruning modes) of
//     stories260K (tp 2, 4) and a synthetic model (tp 2, 4): every rank samples the same tokens as
//     tp 1, and every rank's keep plan row of local KV head g equals tp 1's row of global KV head
//     rank * Hkv / tp + g; each rank holds 1/tp of the KV bytes
// Data come from TRIATTN_SHARED_DATA_DIR/models; a missing file fails the test.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/tensor_parallel_selector.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/stats/calibrator.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/core/tp/collective.hpp>

#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/generate.hpp>
#include <reference_transformer/llama2c.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/synthetic.hpp>
#include <reference_transformer/tensor_parallel.hpp>

namespace ex = triattn_example;
using triattn::PruningMode;
using triattn::SeqId;

namespace {

using triattn::test::cache_config;
using triattn::test::min_top2_margin;
using triattn::test::mode_name;
using triattn::test::prompt_tokens;
using triattn::test::Stories;

/// A synthetic shape with 8 query / 4 KV heads (tp 1, 2, 4) and q/k/v biases.
ex::ModelWeights synthetic_weights() {
  ex::ModelConfig c = ex::synthetic_config("tiny");
  c.name = "synthetic-tp";
  c.dim = 96;
  c.hidden_dim = 160;
  c.n_layers = 3;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.head_dim = 16;
  c.vocab_size = 384;
  return ex::make_synthetic_weights(c, 77);
}

/// Caches of 8-token blocks.
constexpr int kBlock = 8;

/// Pre-RoPE query statistics of the whole model from a full-cache prefill of `tokens`.
triattn::QueryStats calibrate(const ex::ModelWeights& w, const std::vector<int>& tokens) {
  const ex::ModelConfig& mc = w.config;
  triattn::Calibrator cal(mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);
  ex::Model<> model(w);
  model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
  triattn::KvCache<> cache(cache_config(mc, static_cast<int>(tokens.size()), 1, kBlock));
  const ex::Chunk chunk{cache.add_sequence(), tokens, triattn::Phase::kPrefill};
  (void)model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
  return cal.finish();
}

struct Round {
  SeqId seq = -1;  // generate() opens one sequence per prompt, in order, in a fresh cache
  triattn::KeepPlan plan;
};

/// What one rank saw in a run.
struct RankOut {
  std::vector<std::vector<int>> tokens;          // [prompt][generated]
  std::vector<std::vector<float>> logits;        // every sampled row, in sampling order
  std::vector<Round> rounds;                     // in the order they ran
  triattn::MemoryStats memory;                   // at the end, before release
  std::vector<std::int64_t> logical, physical;   // [prompt] at the end
};

struct RunSpec {
  const ex::ModelWeights* weights = nullptr;
  const triattn::QueryStats* stats = nullptr;
  triattn::SelectionParams sel;
  std::vector<std::vector<int>> prompts;
  int steps = 0;
};

/// One rank: Model (its shard), a cache of its KV heads, a scorer on its statistics slice and a
/// selector made by `make_selector` (TopKSelector or the tensor-parallel one); greedy generation
/// with a round for every triggered sequence after each step, whose keep plans are recorded.
template <class Selector>
RankOut run_rank(const RunSpec& spec, ex::Model<>& model, const triattn::QueryStats& stats, Selector selector) {
  const ex::ModelConfig& mc = model.config();
  triattn::RopeConfig rope;
  rope.style = mc.rope_style;
  rope.theta = mc.rope_theta;
  const int peak = 64 + spec.sel.budget + spec.sel.divide_length;
  triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor, triattn::TriAttentionScorer,
                   Selector>
      cache(cache_config(mc, peak, static_cast<int>(spec.prompts.size()), kBlock),
            triattn::TriAttentionScorer(stats, rope, triattn::ScoringParams{}, mc.n_kv_heads), std::move(selector));
  std::vector<ex::Sampler> samplers(spec.prompts.size());  // greedy
  ex::GenerationOptions opt;
  opt.max_new_tokens = spec.steps;
  opt.stop_at_bos = false;
  RankOut out;
  std::vector<SeqId> ids;
  ex::GenerationCallbacks cb;
  cb.on_token = [&](int, int, std::int64_t, std::span<const float> l) { out.logits.emplace_back(l.begin(), l.end()); };
  // KvCache::compress with the plan kept: score -> select -> apply.
  cb.after_step = [&](std::span<const SeqId> live) {
    std::vector<triattn::CompressionReport> done;
    for (SeqId s : live) {
      if (!cache.needs_compression(s)) continue;
      const int len = cache.physical_length(s);
      const triattn::ModelGeometry& g = cache.config().model;
      std::vector<float> scores(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * len);
      cache.scorer().score(cache.template view<float>(), s, len, cache.logical_position(s), scores);
      triattn::KeepPlan plan = cache.selector().select(scores, g, len, cache.prompt_length(s));
      cache.apply_keep_plan(s, plan);
      triattn::CompressionReport rep;
      rep.seq = s;
      rep.length_before = len;
      rep.length_after = cache.physical_length(s);
      done.push_back(rep);
      out.rounds.push_back(Round{s, std::move(plan)});
    }
    return done;
  };
  const auto res = ex::generate(model, cache, std::span<const std::vector<int>>(spec.prompts),
                                std::span<ex::Sampler>(samplers), opt, cb);
  for (const auto& r : res) {
    out.tokens.push_back(r.generated);
    out.logical.push_back(cache.logical_position(r.seq));
    out.physical.push_back(cache.physical_length(r.seq));
  }
  out.memory = cache.memory();
  for (const auto& r : res) cache.release(r.seq);
  return out;
}

/// tp = 1 without any tensor-parallel code: Model(weights), full statistics, TopKSelector.
RankOut run_single(const RunSpec& spec) {
  ex::Model<> model(*spec.weights);
  return run_rank(spec, model, *spec.stats, triattn::TopKSelector(spec.sel));
}

/// tp ranks in tp threads; every rank selects through TensorParallelTopKSelector (union agrees
/// through the team's all-reduce, the other modes stay rank-local).
std::vector<RankOut> run_tp(const RunSpec& spec, int tp) {
  const int kv_heads = spec.weights->config.n_kv_heads;
  triattn::tp::ThreadTeam team(tp);
  std::vector<RankOut> out(static_cast<std::size_t>(tp));
  ex::run_ranks(tp, [&](int r) {
    triattn::tp::ThreadTeamCollective comm(team, r);
    ex::Model<> model(*spec.weights, ex::TpRank{r, tp}, ex::cpu_backend_for(comm));
    const triattn::QueryStats mine = triattn::slice_for_rank(*spec.stats, r, tp, kv_heads);
    out[static_cast<std::size_t>(r)] =
        run_rank(spec, model, mine, triattn::TensorParallelTopKSelector<triattn::tp::ThreadTeamCollective>(spec.sel, comm));
  });
  return out;
}

/// tp ranks against tp 1: tokens, logits (close), keep plans per KV head (equal), KV bytes.
void check_against_single(const RunSpec& spec, const RankOut& ref, const std::vector<RankOut>& ranks, int tp) {
  const int L = spec.weights->config.n_layers, Hkv = spec.weights->config.n_kv_heads, hkv = Hkv / tp;
  REQUIRE(static_cast<int>(ranks.size()) == tp);
  CHECK(ref.rounds.size() >= 6);  // several rounds per sequence
  triattn::test::TpTally tally;
  for (int r = 0; r < tp; ++r) {
    const RankOut& o = ranks[static_cast<std::size_t>(r)];
    INFO("rank " << r << " of tp " << tp);
    for (std::size_t p = 0; p < ref.tokens.size(); ++p) {
      CHECK(o.logical[p] == ref.logical[p]);
      CHECK(o.physical[p] == ref.physical[p]);
    }
    triattn::test::compare_rank_with_single(o, ref, ranks[0], r, L, hkv, tally);
    // Each rank caches its Hkv / tp heads of every token.
    CHECK(o.memory.bytes_live * static_cast<std::size_t>(tp) == ref.memory.bytes_live);
    CHECK(o.memory.cached_tokens == ref.memory.cached_tokens);
  }
  const int token_mismatch = tally.token_mismatch, plan_mismatch = tally.plan_mismatch;
  const int rows_compared = tally.rows_compared;
  const float worst = tally.worst;
  const float margin = min_top2_margin(ref.logits);
  CHECK_MESSAGE(token_mismatch == 0, token_mismatch << " greedy tokens differ from tp 1 (smallest top-2 logit margin "
                                                    << margin << ", max logit difference " << worst << ")");
  CHECK_MESSAGE(plan_mismatch == 0, plan_mismatch << " of " << rows_compared << " (round, layer, KV head) keep rows differ");
  CHECK(worst < 1e-4f);
  MESSAGE(spec.weights->config.name << ", " << mode_name(spec.sel.mode) << ", tp " << tp << ": " << ref.rounds.size()
                                    << " rounds, " << rows_compared << " keep rows equal to tp 1, tokens equal ("
                                    << ref.logits.size() << " sampled, smallest top-2 margin " << margin
                                    << "), max |logit - tp 1| " << worst);
}

}  // namespace

TEST_SUITE("model_tp") {

TEST_CASE("tensor parallel: rank shards reassemble the full weights") {
  const ex::ModelWeights full = synthetic_weights();  // has q/k/v biases
  const ex::ModelConfig& f = full.config;
  for (int tp : {1, 2, 4}) {
    INFO("tp " << tp);
    std::vector<ex::ModelWeights> sh;
    for (int r = 0; r < tp; ++r) sh.push_back(ex::shard_weights(full, ex::TpRank{r, tp}));
    const ex::ModelConfig& c = sh[0].config;
    CHECK(c.n_heads == f.n_heads / tp);
    CHECK(c.n_kv_heads == f.n_kv_heads / tp);
    CHECK(c.hidden_dim == f.hidden_dim / tp);
    CHECK(c.dim == f.dim);
    CHECK(c.head_dim == f.head_dim);
    CHECK(c.vocab_size == f.vocab_size);
    const std::size_t L = static_cast<std::size_t>(f.n_layers), D = static_cast<std::size_t>(f.dim);
    const std::size_t qd = static_cast<std::size_t>(c.q_dim()), kvd = static_cast<std::size_t>(c.kv_dim());
    const std::size_t h = static_cast<std::size_t>(c.hidden_dim);
    std::size_t mismatch = 0;
    for (int r = 0; r < tp; ++r) {
      const ex::ModelWeights& s = sh[static_cast<std::size_t>(r)];
      const std::size_t R = static_cast<std::size_t>(r);
      CHECK(s.tok_emb == full.tok_emb);
      CHECK(s.wcls == full.wcls);
      CHECK(s.rms_att == full.rms_att);
      CHECK(s.rms_ffn == full.rms_ffn);
      CHECK(s.rms_final == full.rms_final);
      for (std::size_t l = 0; l < L; ++l) {
        for (std::size_t i = 0; i < qd; ++i) {  // output rows of the rank's q heads; wo's input columns
          for (std::size_t j = 0; j < D; ++j) {
            mismatch += s.wq[(l * qd + i) * D + j] != full.wq[(l * f.q_dim() + R * qd + i) * D + j];
            mismatch += s.wo[(l * D + j) * qd + i] != full.wo[(l * D + j) * f.q_dim() + R * qd + i];
          }
          mismatch += s.bq[l * qd + i] != full.bq[l * f.q_dim() + R * qd + i];
        }
        for (std::size_t i = 0; i < kvd; ++i) {
          for (std::size_t j = 0; j < D; ++j) {
            mismatch += s.wk[(l * kvd + i) * D + j] != full.wk[(l * f.kv_dim() + R * kvd + i) * D + j];
            mismatch += s.wv[(l * kvd + i) * D + j] != full.wv[(l * f.kv_dim() + R * kvd + i) * D + j];
          }
          mismatch += s.bk[l * kvd + i] != full.bk[l * f.kv_dim() + R * kvd + i];
        }
        for (std::size_t i = 0; i < h; ++i)
          for (std::size_t j = 0; j < D; ++j) {
            mismatch += s.w1[(l * h + i) * D + j] != full.w1[(l * f.hidden_dim + R * h + i) * D + j];
            mismatch += s.w3[(l * h + i) * D + j] != full.w3[(l * f.hidden_dim + R * h + i) * D + j];
            mismatch += s.w2[(l * D + j) * h + i] != full.w2[(l * D + j) * f.hidden_dim + R * h + i];
          }
      }
    }
    CHECK(mismatch == 0);
  }
}

TEST_CASE("tensor parallel: splits that the heads or the MLP do not allow are refused with the reason") {
  const ex::ModelWeights& s = Stories::get().weights;  // 8 q heads, 4 KV heads, hidden 172
  auto message_of = [&](ex::TpRank t) -> std::string {
    try {
      (void)ex::shard_weights(s, t);
    } catch (const triattn::logic_error& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message_of(ex::TpRank{0, 3}).find("n_heads = 8 is not divisible by tp = 3") != std::string::npos);
  CHECK(message_of(ex::TpRank{0, 8}).find("n_kv_heads = 4 is not divisible by tp = 8") != std::string::npos);
  CHECK(message_of(ex::TpRank{2, 2}).find("rank 2 is outside [0, tp = 2)") != std::string::npos);
  CHECK(message_of(ex::TpRank{0, 0}).find("tp = 0 must be >= 1") != std::string::npos);
  ex::ModelWeights odd = synthetic_weights();
  odd.config.hidden_dim = 162;  // 162 / 4 is not whole
  for (auto* t : {&odd.w1, &odd.w3, &odd.w2}) t->resize(odd.config.n_mlp());
  CHECK_THROWS_WITH_AS((void)ex::shard_weights(odd, ex::TpRank{0, 4}), doctest::Contains("hidden_dim = 162"),
                       triattn::logic_error);
  // A rank whose backend has no all-reduce (or one of another size) is refused.
  CHECK_THROWS_WITH_AS(ex::Model<>(s, ex::TpRank{0, 2}), doctest::Contains("all-reduce spans 2 ranks, it spans 1"),
                       triattn::logic_error);
  triattn::tp::ThreadTeam team(4);
  triattn::tp::ThreadTeamCollective comm(team, 0);
  CHECK_THROWS_WITH_AS(ex::Model<>(s, ex::TpRank{0, 2}, ex::cpu_backend_for(comm)),
                       doctest::Contains("it spans 4"), triattn::logic_error);
  // tp 1 through the tensor-parallel constructor is the plain model.
  ex::Model<> one(s, ex::TpRank{0, 1});
  CHECK(one.config().n_heads == 8);
  CHECK(one.full_config().n_heads == 8);
}

TEST_CASE("tensor parallel: stories260K prefill logits and each rank's K/V equal tp 1") {
  const Stories& st = Stories::get();
  const ex::ModelWeights& w = st.weights;
  std::vector<int> story = {1};
  story.insert(story.end(), st.greedy.begin(), st.greedy.end());
  auto prefill = [&](ex::Model<>& model, triattn::KvCache<>& cache, std::vector<float>& logits) {
    const ex::Chunk chunk{cache.add_sequence(), story, triattn::Phase::kPrefill};
    logits = model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kAllRows).logits;
  };
  ex::Model<> single(w);
  triattn::KvCache<> ref_cache(cache_config(w.config, static_cast<int>(story.size()), 1, kBlock));
  std::vector<float> ref_logits;
  prefill(single, ref_cache, ref_logits);
  const auto ref_view = ref_cache.view<float>();
  for (int tp : {2, 4}) {
    INFO("tp " << tp);
    triattn::tp::ThreadTeam team(tp);
    std::vector<std::vector<float>> logits(static_cast<std::size_t>(tp));
    std::vector<float> kv_worst(static_cast<std::size_t>(tp), 0.0f);
    ex::run_ranks(tp, [&](int r) {
      triattn::tp::ThreadTeamCollective comm(team, r);
      ex::Model<> model(w, ex::TpRank{r, tp}, ex::cpu_backend_for(comm));
      triattn::KvCache<> cache(cache_config(model.config(), static_cast<int>(story.size()), 1, kBlock));
      prefill(model, cache, logits[static_cast<std::size_t>(r)]);
      const auto view = cache.view<float>();
      const int hkv = model.config().n_kv_heads, d = model.config().head_dim;
      float worst = 0.0f;
      for (int l = 0; l < w.config.n_layers; ++l)
        for (int t = 0; t < static_cast<int>(story.size()); ++t)
          for (int g = 0; g < hkv; ++g)
            for (triattn::KvKind kind : {triattn::KvKind::kKey, triattn::KvKind::kValue})
              for (int i = 0; i < d; ++i)
                worst = std::max(worst, std::fabs(view.token(l, kind, 0, t, g)[i] -
                                                  ref_view.token(l, kind, 0, t, r * hkv + g)[i]));
      kv_worst[static_cast<std::size_t>(r)] = worst;
    });
    float worst = 0.0f;
    int argmax_diff = 0;
    const std::size_t V = static_cast<std::size_t>(w.config.vocab_size);
    for (int r = 0; r < tp; ++r) {
      REQUIRE(logits[static_cast<std::size_t>(r)].size() == ref_logits.size());
      CHECK(logits[static_cast<std::size_t>(r)] == logits[0]);
      CHECK(kv_worst[static_cast<std::size_t>(r)] < 1e-4f);  // partial sums added in another order: last bits
    }
    for (std::size_t i = 0; i < ref_logits.size(); ++i) worst = std::max(worst, std::fabs(logits[0][i] - ref_logits[i]));
    for (std::size_t row = 0; row < story.size(); ++row) {
      const auto a = logits[0].begin() + static_cast<std::ptrdiff_t>(row * V);
      const auto b = ref_logits.begin() + static_cast<std::ptrdiff_t>(row * V);
      argmax_diff += std::max_element(a, a + static_cast<std::ptrdiff_t>(V)) - a !=
                     std::max_element(b, b + static_cast<std::ptrdiff_t>(V)) - b;
    }
    CHECK(worst < 1e-4f);  // the llama2.c reference tolerance
    CHECK(argmax_diff == 0);
    MESSAGE("stories260K prefill of " << story.size() << " tokens, tp " << tp << ": max |logit - tp 1| " << worst
                                      << ", max |K/V - tp 1| " << *std::max_element(kv_worst.begin(), kv_worst.end()));
  }
}

TEST_CASE("tensor parallel: compressed greedy decoding keeps tp 1's tokens and keep sets in every pruning mode") {
  const Stories& st = Stories::get();
  const ex::ModelWeights synth = synthetic_weights();
  struct Case {
    const ex::ModelWeights* w;
    std::vector<std::vector<int>> prompts;
  };
  std::vector<int> story_prompt = {1};
  story_prompt.insert(story_prompt.end(), st.greedy.begin(), st.greedy.begin() + 6);
  const std::vector<Case> cases = {
      {&st.weights, {story_prompt, {1}}},
      {&synth, {prompt_tokens(5, 1, synth.config.vocab_size), prompt_tokens(13, 2, synth.config.vocab_size)}}};
  for (const Case& cs : cases) {
    std::vector<int> calib = {1};
    if (cs.w == &st.weights) calib.insert(calib.end(), st.greedy.begin(), st.greedy.end());
    else calib = prompt_tokens(256, 9, cs.w->config.vocab_size);
    const triattn::QueryStats stats = calibrate(*cs.w, calib);
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
      INFO(cs.w->config.name << ", " << mode_name(mode));
      RunSpec spec;
      spec.weights = cs.w;
      spec.stats = &stats;
      spec.sel.budget = 32;
      spec.sel.divide_length = 16;
      spec.sel.mode = mode;
      spec.prompts = cs.prompts;
      spec.steps = 144;  // rounds at cached length 48, then every 16 steps: 7+ per sequence
      const RankOut ref = run_single(spec);
      for (int tp : {2, 4}) {
        INFO("tp " << tp);
        check_against_single(spec, ref, run_tp(spec, tp), tp);
      }
    }
  }
}

}  // TEST_SUITE

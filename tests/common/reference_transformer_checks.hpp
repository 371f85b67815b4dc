// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the reference-transformer tests (tests/core/test_reference_transformer*.cpp
// and tests/cuda/test_reference_transformer*.cu): test data files, stories260K with llama2.c's
// recorded greedy run, cache configurations, the checks against that recording (tokens, logits,
// cached K/V), and the comparison of a tensor-parallel rank's run with tp 1's. Plain host C++, so
// g++ and nvcc both compile it. Test-only; included once per test TU.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/scoring_params.hpp>

#include "common/json_file.hpp"

#include <reference_transformer/generate.hpp>
#include <reference_transformer/llama2c.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/synthetic.hpp>

namespace triattn::test {

/// A small Llama shape whose head_dim triattn's kernels compile (decode attention, append, scoring).
inline triattn_example::ModelConfig small_config(int head_dim, int vocab = 1000) {
  triattn_example::ModelConfig c = triattn_example::synthetic_config("tiny");
  c.name = "synthetic-test-" + std::to_string(head_dim);
  c.dim = 256;
  c.hidden_dim = 512;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = head_dim;
  c.vocab_size = vocab;
  c.rope_theta = 1e6;
  return c;
}

/// The same weights with every matrix rounded to bf16 (what a bf16 WeightStore holds exactly).
inline triattn_example::ModelWeights rounded_to_bf16(triattn_example::ModelWeights w) {
  for (std::vector<float>* t : {&w.tok_emb, &w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3, &w.wcls})
    for (float& x : *t) x = triattn::to_float(triattn::from_float<triattn::bf16_storage>(x));
  return w;
}

/// TRIATTN_SHARED_DATA_DIR/models/<name>; a missing file fails the test.
inline std::string data_file(const std::string& name) {
  const std::string p = std::string(TRIATTN_SHARED_DATA_DIR) + "/models/" + name;
  INFO("data file " << p);
  REQUIRE_MESSAGE(std::filesystem::exists(p), "missing test data file " << p);
  return p;
}

/// stories260K and llama2.c's recorded greedy run of it (stories260K_greedy_ref.json), loaded once.
struct Stories {
  triattn_example::ModelWeights weights;
  triattn::detail::JsonValue ref;
  std::vector<int> greedy;  // llama2.c's greedy story (256 tokens after BOS)
  static const Stories& get() {
    static const Stories s = [] {
      Stories t;
      t.weights = triattn_example::load_llama2c_checkpoint(data_file("stories260K.bin"));
      t.ref = triattn::test::json_file(data_file("stories260K_greedy_ref.json"));
      t.greedy = triattn::test::json_numbers<int>(t.ref.at("greedy_ids"));
      return t;
    }();
    return s;
  }
};

/// A cache of the model's geometry with room for `seqs` sequences of `tokens_per_seq` tokens.
inline CacheConfig cache_config(const triattn_example::ModelConfig& mc, int tokens_per_seq, int seqs,
                                int block_size = 16, DType dtype = DType::kF32, KvLayout layout = KvLayout::kNHD) {
  CacheConfig c;
  c.model = mc.geometry();
  c.block_size = block_size;
  c.max_seqs = seqs;
  c.num_blocks = seqs * ((tokens_per_seq + block_size - 1) / block_size + 1);
  c.dtype = dtype;
  c.layout = layout;
  return c;
}

inline float max_abs_diff(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  float m = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

/// Positions whose logits the reference recorded.
inline const std::vector<int> kLogitPositions = {0, 1, 2, 10, 100, 255};

/// Max abs difference of the logits at kLogitPositions (row_at(p): the logits sampled at
/// position p) from the reference; each must be within 1e-4.
template <class RowAt>
float check_reference_logits(const Stories& s, RowAt&& row_at) {
  float worst = 0.0f;
  for (int p : kLogitPositions) {
    const std::vector<float> ref = triattn::test::json_numbers<float>(s.ref.at("logits").at(std::to_string(p)));
    const float d = max_abs_diff(row_at(p), ref);
    INFO("logits at position " << p << ": max abs diff " << d);
    CHECK(d < 1e-4f);
    worst = std::max(worst, d);
  }
  return worst;
}

/// Greedy decoding of stories260K from BOS for 256 tokens: the one sequence's result and the
/// logits sampled at every position.
struct GreedyRun {
  std::vector<triattn_example::SequenceResult> res;
  std::vector<std::vector<float>> logits_at;  // [position][vocab]
};
template <class ModelT, class Cache>
GreedyRun run_stories_greedy(ModelT& model, Cache& cache) {
  std::vector<std::vector<int>> prompts = {{1}};
  std::vector<triattn_example::Sampler> samplers(1);
  triattn_example::GenerationOptions opt;
  opt.max_new_tokens = 256;
  GreedyRun run;
  run.logits_at.resize(256);
  triattn_example::GenerationCallbacks cb;
  cb.on_token = [&](int, int, std::int64_t pos, std::span<const float> logits) {
    REQUIRE(pos >= 0);
    REQUIRE(pos < 256);
    run.logits_at[static_cast<std::size_t>(pos)].assign(logits.begin(), logits.end());
  };
  run.res = triattn_example::generate(model, cache, std::span<const std::vector<int>>(prompts),
                                      std::span<triattn_example::Sampler>(samplers), opt, cb);
  REQUIRE(run.res.size() == 1);
  return run;
}

/// The greedy tokens must equal the reference's; returns how many leading ones do.
inline int check_greedy_tokens(const Stories& s, const std::vector<int>& got) {
  REQUIRE(got.size() == s.greedy.size());
  int matched = 0;
  while (matched < static_cast<int>(got.size()) &&
         got[static_cast<std::size_t>(matched)] == s.greedy[static_cast<std::size_t>(matched)])
    ++matched;
  CHECK_MESSAGE(matched == 256, "greedy tokens match the reference up to position " << matched);
  return matched;
}

/// Max abs difference of the cached post-RoPE K and V of positions 0..3 of `seq` (read through a
/// float view of the cache) from the reference.
template <class View>
float reference_kv_diff(const Stories& s, const View& view, SeqId seq) {
  const triattn_example::ModelConfig& mc = s.weights.config;
  float kv_worst = 0.0f;
  for (int l = 0; l < mc.n_layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const auto kref =
          triattn::test::json_numbers<float>(s.ref.at("k_cache_pos0to3").at(static_cast<std::size_t>(l)).at(static_cast<std::size_t>(p)));
      const auto vref =
          triattn::test::json_numbers<float>(s.ref.at("v_cache_pos0to3").at(static_cast<std::size_t>(l)).at(static_cast<std::size_t>(p)));
      REQUIRE(kref.size() == static_cast<std::size_t>(mc.kv_dim()));
      for (int h = 0; h < mc.n_kv_heads; ++h)
        for (int i = 0; i < mc.head_dim; ++i) {
          const std::size_t j = static_cast<std::size_t>(h * mc.head_dim + i);
          const float k = view.token(l, KvKind::kKey, seq, p, h)[i];
          const float v = view.token(l, KvKind::kValue, seq, p, h)[i];
          kv_worst = std::max({kv_worst, std::fabs(k - kref[j]), std::fabs(v - vref[j])});
        }
    }
  return kv_worst;
}

/// `steps` decode steps of one forced token per sequence of `ids` (the same inputs for every
/// backend); appends each step's logits to `all`.
template <class ModelT, class Cache>
void forced_decode_steps(ModelT& model, Cache& cache, const std::vector<SeqId>& ids, int steps,
                         std::vector<std::vector<float>>& all) {
  std::vector<int> tok(ids.size());
  for (int s = 0; s < steps; ++s) {
    std::vector<triattn_example::Chunk> chunks;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      tok[i] = (s * 13 + static_cast<int>(i) * 7 + 5) % model.config().vocab_size;
      chunks.push_back(triattn_example::Chunk{ids[i], std::span<const int>(&tok[i], 1), triattn::Phase::kDecode});
    }
    all.push_back(model.step(cache, chunks, triattn_example::LogitsFor::kLastOfEachChunk).logits);
  }
}

// --- tensor parallelism ----------------------------------------------------------------------

/// BOS and len - 1 tokens derived from `salt`.
inline std::vector<int> prompt_tokens(int len, int salt, int vocab) {
  std::vector<int> t = {1};
  for (int i = 1; i < len; ++i) t.push_back((i * 37 + salt * 101 + 11) % vocab);
  return t;
}

inline std::string mode_name(PruningMode m) {
  return m == PruningMode::kPerHead ? "per_head" : m == PruningMode::kPerLayerPerHead ? "per_layer_per_head" : "union";
}

/// Smallest gap between the top two logits over all sampled rows: how much a last-bit
/// difference would have to move a logit to change a greedy token.
inline float min_top2_margin(const std::vector<std::vector<float>>& rows) {
  float m = INFINITY;
  for (const auto& r : rows) {
    float a = -INFINITY, b = -INFINITY;
    for (float v : r) {
      if (v > a) {
        b = a;
        a = v;
      } else if (v > b) {
        b = v;
      }
    }
    m = std::min(m, a - b);
  }
  return m;
}

/// Totals of comparing tp ranks' runs with tp 1's.
struct TpTally {
  int token_mismatch = 0;  // greedy tokens that differ
  int plan_mismatch = 0;   // (round, layer, KV head) keep rows that differ
  int rows_compared = 0;
  float worst = 0.0f;  // max |logit - tp 1|
};

/// One rank's run (`o`, rank `rank`; RankOut has tokens [prompt][generated], logits [row][vocab]
/// and rounds with .seq and .plan) against tp 1's (`ref`): tokens counted into `t`, logits bitwise
/// those of rank 0 and their max difference from tp 1 kept, every round of the same sequence with
/// the same keep count, and each keep plan row of local KV head g compared with tp 1's row of
/// global KV head rank * hkv + g.
template <class RankOut>
void compare_rank_with_single(const RankOut& o, const RankOut& ref, const RankOut& rank0, int rank, int num_layers,
                              int hkv, TpTally& t) {
  REQUIRE(o.tokens.size() == ref.tokens.size());
  for (std::size_t p = 0; p < ref.tokens.size(); ++p) {
    REQUIRE(o.tokens[p].size() == ref.tokens[p].size());
    for (std::size_t i = 0; i < ref.tokens[p].size(); ++i) t.token_mismatch += o.tokens[p][i] != ref.tokens[p][i];
  }
  // Every rank computes the classifier on the same all-reduced residual: bitwise equal logits.
  CHECK(o.logits == rank0.logits);
  REQUIRE(o.logits.size() == ref.logits.size());
  for (std::size_t i = 0; i < o.logits.size(); ++i)
    for (std::size_t v = 0; v < o.logits[i].size(); ++v)
      t.worst = std::max(t.worst, std::fabs(o.logits[i][v] - ref.logits[i][v]));
  REQUIRE(o.rounds.size() == ref.rounds.size());
  for (std::size_t k = 0; k < ref.rounds.size(); ++k) {
    const KeepPlan& mine = o.rounds[k].plan;
    const KeepPlan& full = ref.rounds[k].plan;
    REQUIRE(o.rounds[k].seq == ref.rounds[k].seq);
    REQUIRE(mine.num_layers == num_layers);
    REQUIRE(mine.num_kv_heads == hkv);
    REQUIRE(mine.keep == full.keep);
    for (int l = 0; l < num_layers; ++l)
      for (int g = 0; g < hkv; ++g) {
        ++t.rows_compared;
        t.plan_mismatch += !std::equal(mine.row(l, g), mine.row(l, g) + mine.keep, full.row(l, rank * hkv + g));
      }
  }
}

}  // namespace triattn::test

// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the SmolLM2 tests (tests/core/test_smollm2.cpp, tests/cuda/test_smollm2_gpu.cu):
// the GGUF model, its tokenizer and smollm2_ref.json loaded once, and the runs compared with the
// reference (greedy continuation of a prompt with its logits and layer-0 K/V; a teacher-forced
// pass over prompt + reference continuation). Plain host C++, so g++ and nvcc both compile it.
// Test-only; included once per test TU.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/bpe_tokenizer.hpp>
#include <reference_transformer/gguf.hpp>
#include <reference_transformer/gguf_llama.hpp>

namespace triattn::test {

inline constexpr const char* kSmolLM2File = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// bf16 paths (weights and K/V rounded to bf16, 8 significant bits): largest accepted
/// |logit - reference| at the recorded positions, the reference top-1/top-2 margin above which a
/// greedy choice must not change, and the largest |K - ref|, |V - ref| of layer 0. Set from the CPU measurement on bf16-rounded weights
/// (test_smollm2.cpp), with room for the GPU's bf16 activations in multi-row GEMVs.
inline constexpr double kBf16LogitTolerance = 0.5;
inline constexpr double kBf16DecisiveMargin = 0.5;
inline constexpr double kBf16KvTolerance = 0.1;

/// The GGUF file, its weights, its tokenizer and the reference, loaded once.
struct Smol {
  triattn_example::gguf::File file = triattn_example::gguf::File::load(data_file(kSmolLM2File));
  triattn_example::ModelWeights weights = triattn_example::gguf_llama_weights(file);
  triattn_example::BpeTokenizer tok = triattn_example::BpeTokenizer::from_gguf(file);
  triattn::detail::JsonValue ref = triattn::test::json_file(data_file("smollm2_ref.json"));
  static const Smol& get() {
    static const Smol s;
    return s;
  }
  [[nodiscard]] const triattn::detail::JsonValue& prompt(std::size_t i) const { return ref.at("prompts").at(i); }
  [[nodiscard]] std::size_t num_prompts() const { return ref.at("prompts").items.size(); }
};

/// Largest |logits[id] - value| over the reference's (id, value) pairs.
inline double worst_logit_diff(std::span<const float> logits, const triattn::detail::JsonValue& ids,
                               const triattn::detail::JsonValue& values) {
  double worst = 0.0;
  REQUIRE(ids.items.size() == values.items.size());
  for (std::size_t k = 0; k < ids.items.size(); ++k) {
    const int id = static_cast<int>(ids.at(k).as_double());
    REQUIRE(id >= 0);
    REQUIRE(static_cast<std::size_t>(id) < logits.size());
    worst = std::max(worst, std::fabs(static_cast<double>(logits[static_cast<std::size_t>(id)]) - values.at(k).as_double()));
  }
  return worst;
}

/// Max |logit - reference| at the positions the reference recorded (0..3 top-5, the prompt's last
/// position top-10) of an all-rows prefill; `argmax_equal` counts the rows whose argmax is the
/// reference's top-1 (of `argmax_rows`).
struct RecordedLogits {
  double worst = 0.0;
  int argmax_equal = 0, argmax_rows = 0;
};
inline RecordedLogits check_recorded_logits(const triattn_example::StepOutput& out, const triattn::detail::JsonValue& p) {
  RecordedLogits r;
  const int n = static_cast<int>(p.at("ids").items.size());
  for (std::size_t k = 0; k < p.at("first_positions").items.size(); ++k) {
    const triattn::detail::JsonValue& fp = p.at("first_positions").at(k);
    const int pos = static_cast<int>(fp.at("position").as_double());
    REQUIRE(pos < out.num_logit_rows());
    r.argmax_equal += triattn_example::Sampler::argmax(out.row(pos)) == static_cast<int>(fp.at("top5").at(0).as_double());
    ++r.argmax_rows;
    r.worst = std::max(r.worst, worst_logit_diff(out.row(pos), fp.at("top5"), fp.at("top5_logits")));
  }
  const triattn::detail::JsonValue& last = p.at("last_prompt_logits");
  REQUIRE(static_cast<int>(last.at("position").as_double()) == n - 1);
  r.argmax_equal += triattn_example::Sampler::argmax(out.row(n - 1)) == static_cast<int>(last.at("top10").at(0).as_double());
  ++r.argmax_rows;
  r.worst = std::max(r.worst, worst_logit_diff(out.row(n - 1), last.at("top10"), last.at("top10_logits")));
  return r;
}

/// Max |K - ref|, |V - ref| of layer 0, KV head 0, positions 0..3; kv(t) returns {K, V} as cached.
template <class KvAt>
double worst_layer0_kv_diff(const triattn::detail::JsonValue& p, int head_dim, KvAt&& kv) {
  double worst = 0.0;
  for (int t = 0; t < 4; ++t) {
    const std::vector<double> k_ref =
        triattn::test::json_numbers<double>(p.at("layer0_kvhead0_k_pos0_3").at(static_cast<std::size_t>(t)));
    const std::vector<double> v_ref =
        triattn::test::json_numbers<double>(p.at("layer0_kvhead0_v_pos0_3").at(static_cast<std::size_t>(t)));
    REQUIRE(k_ref.size() == static_cast<std::size_t>(head_dim));
    REQUIRE(v_ref.size() == static_cast<std::size_t>(head_dim));
    const std::array<std::vector<float>, 2> got = kv(t);
    REQUIRE(got[0].size() == k_ref.size());
    REQUIRE(got[1].size() == v_ref.size());
    for (std::size_t i = 0; i < k_ref.size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(got[0][i]) - k_ref[i]));
      worst = std::max(worst, std::fabs(static_cast<double>(got[1][i]) - v_ref[i]));
    }
  }
  return worst;
}

/// Greedy continuation of prompt `p` in a fresh sequence of `cache`: an all-rows prefill (its
/// logits checked against the recorded ones), `kv_after_prefill` run once, then one decode step
/// per token until as many tokens as the reference continuation are produced.
struct GreedyPromptRun {
  std::vector<int> got, want;
  RecordedLogits logits;
};
template <class ModelT, class Cache, class AfterPrefill>
GreedyPromptRun run_greedy_prompt(ModelT& model, Cache& cache, const triattn::detail::JsonValue& p,
                                  AfterPrefill&& after_prefill) {
  GreedyPromptRun r;
  const std::vector<int> prompt = triattn::test::json_numbers<int>(p.at("ids"));
  r.want = triattn::test::json_numbers<int>(p.at("greedy_new_ids"));
  const triattn::SeqId seq = cache.add_sequence();
  const triattn_example::Chunk pre{seq, prompt, triattn::Phase::kPrefill};
  const triattn_example::StepOutput out =
      model.step(cache, std::span<const triattn_example::Chunk>(&pre, 1), triattn_example::LogitsFor::kAllRows);
  REQUIRE(out.num_logit_rows() == static_cast<int>(prompt.size()));
  r.logits = check_recorded_logits(out, p);
  after_prefill(seq);
  r.got.push_back(triattn_example::Sampler::argmax(out.row(static_cast<int>(prompt.size()) - 1)));
  while (r.got.size() < r.want.size()) {
    const triattn_example::Chunk dec{seq, std::span<const int>(&r.got.back(), 1), triattn::Phase::kDecode};
    const triattn_example::StepOutput o = model.step(cache, std::span<const triattn_example::Chunk>(&dec, 1));
    r.got.push_back(triattn_example::Sampler::argmax(o.row(0)));
  }
  return r;
}

/// Teacher-forced pass over prompt + the reference continuation (one prefill step, every row's
/// logits): for each continuation token k, whether the argmax at its position equals it, and the
/// reference's top-1/top-2 margin there.
struct ForcedRun {
  triattn::SeqId seq = -1;
  std::vector<int> argmax, want;
  std::vector<double> margin;
  RecordedLogits logits;
};
template <class ModelT, class Cache>
ForcedRun run_forced_prompt(ModelT& model, Cache& cache, const triattn::detail::JsonValue& p) {
  ForcedRun r;
  std::vector<int> seq_tokens = triattn::test::json_numbers<int>(p.at("ids"));
  const int n = static_cast<int>(seq_tokens.size());
  r.want = triattn::test::json_numbers<int>(p.at("greedy_new_ids"));
  r.margin = triattn::test::json_numbers<double>(p.at("greedy_top1_top2_margins"));
  REQUIRE(r.margin.size() == r.want.size());
  seq_tokens.insert(seq_tokens.end(), r.want.begin(), r.want.end() - 1);
  r.seq = cache.add_sequence();
  const triattn_example::Chunk c{r.seq, seq_tokens, triattn::Phase::kPrefill};
  const triattn_example::StepOutput out =
      model.step(cache, std::span<const triattn_example::Chunk>(&c, 1), triattn_example::LogitsFor::kAllRows);
  REQUIRE(out.num_logit_rows() == static_cast<int>(seq_tokens.size()));
  r.logits = check_recorded_logits(out, p);
  for (std::size_t k = 0; k < r.want.size(); ++k)
    r.argmax.push_back(triattn_example::Sampler::argmax(out.row(n - 1 + static_cast<int>(k))));
  return r;
}

}  // namespace triattn::test

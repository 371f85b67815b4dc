// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// BpeTokenizer::encode (examples/reference_transformer/bpe_tokenizer.hpp) with SmolLM2's
// vocabulary on texts that are one long pre-tokenized word, where a merge that rescans every
// pair is quadratic (100 KB of one letter took 79 s), and on ordinary mixed text.
//
//   BM_EncodeOneLetter/N  N bytes of 'a' (one word; merges into 4-letter tokens)
//   BM_EncodeCjk/N        about N bytes of CJK ideographs without spaces (one word)
//   BM_EncodeVocabText/N  about N bytes of random vocabulary pieces (many short words)
// Counters: MB_per_s of input text, tokens produced.
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <reference_transformer/bpe_tokenizer.hpp>
#include <reference_transformer/gguf.hpp>
#include "common/tokenizer_texts.hpp"

namespace {

namespace ex = triattn_example;

const ex::BpeTokenizer& tokenizer() {
  static const ex::BpeTokenizer t = ex::BpeTokenizer::from_gguf(
      ex::gguf::File::load(std::string(TRIATTN_SHARED_DATA_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
  return t;
}

void encode(benchmark::State& state, const std::string& text) {
  const ex::BpeTokenizer& tok = tokenizer();
  std::size_t tokens = 0;
  for (auto _ : state) {
    const std::vector<int> ids = tok.encode(text);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * text.size()));
  state.counters["MB_per_s"] = benchmark::Counter(static_cast<double>(text.size()) * 1e-6,
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens"] = static_cast<double>(tokens);
}

void BM_EncodeOneLetter(benchmark::State& state) { encode(state, std::string(static_cast<std::size_t>(state.range(0)), 'a')); }
BENCHMARK(BM_EncodeOneLetter)->Arg(100'000)->Arg(1'000'000)->Unit(benchmark::kMillisecond);

void BM_EncodeCjk(benchmark::State& state) {
  encode(state, triattn::test::cjk_run(static_cast<std::size_t>(state.range(0)) / 3, 7));
}
BENCHMARK(BM_EncodeCjk)->Arg(30'000)->Arg(100'000)->Unit(benchmark::kMillisecond);

void BM_EncodeVocabText(benchmark::State& state) {
  const ex::BpeTokenizer& tok = tokenizer();
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> id(0, tok.vocab_size() - 1);
  std::string text;
  while (text.size() < static_cast<std::size_t>(state.range(0))) {
    const int t = id(rng);
    if (tok.token_type(t) == ex::BpeTokenizer::kNormal) text += tok.decode_piece(t);
  }
  encode(state, text);
}
BENCHMARK(BM_EncodeVocabText)->Arg(1'000'000)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();

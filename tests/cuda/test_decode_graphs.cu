// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// Decode under CUDA graphs per batch bucket (examples/reference_transformer/decode_graphs.cuh):
// greedy decoding of 9 sequences whose batch shrinks 9 -> 7 -> 6 -> 5 -> 3 -> 2 -> 1 (sequences
// finish and stay open, as in generate()) with graphs padded to power-of-two buckets gives the
// tokens and logits of eager decoding (f32 weights, GEMV matmuls, f32, bf16 and fp8 KV: fp8's
// decode attention takes the float queries, no converted copy for the padded rows), captures one
// graph per bucket (5), not one per batch size (7), and the padding rows change nothing. A cache
// without an empty sequence slot for the padding rows to attend keeps exact graphs, same tokens.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "cuda_test_utils.cuh"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/synthetic.hpp>

namespace ex = triattn_example;
using triattn::DType;
using triattn::SeqId;

namespace {

// Batch of each decode step: sequences [0, batch) decode, the others have finished.
const std::vector<int> kSchedule = {9, 9, 9, 7, 7, 6, 6, 5, 5, 3, 3, 2, 2, 1, 1};

struct Run {
  std::vector<std::vector<int>> tokens;  // [sequence] greedy tokens
  std::vector<std::vector<float>> logits;  // [step] logits of the step's rows
  ex::CudaBackend::Stats stats;
};

Run run(const ex::ModelWeights& w, ex::CudaBackendOptions opt, DType kv, int max_seqs) {
  const ex::ModelConfig& c = w.config;
  ex::CudaBackend be(opt);
  ex::Model<ex::CudaBackend> model(w, be);
  ex::GpuPlainCache cache(triattn::test::cache_config(c, 64 + static_cast<int>(kSchedule.size()), max_seqs, 16, kv),
                          triattn::cuda::DeviceCompactor(be.stream()));
  const int n = kSchedule.front();
  std::vector<SeqId> ids;
  std::vector<std::vector<int>> prompts;
  std::vector<ex::Chunk> chunks;
  for (int i = 0; i < n; ++i) {
    prompts.push_back(triattn::test::prompt_tokens(5 + 4 * i, 11 + i, c.vocab_size));
    ids.push_back(cache.add_sequence());
  }
  for (int i = 0; i < n; ++i) chunks.push_back(ex::Chunk{ids[i], prompts[i], triattn::Phase::kPrefill});
  Run r;
  r.tokens.resize(static_cast<std::size_t>(n));
  ex::StepOutput out = model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk);
  for (int i = 0; i < n; ++i) r.tokens[i].push_back(ex::Sampler::argmax(out.row(i)));
  for (const int batch : kSchedule) {
    chunks.clear();
    for (int i = 0; i < batch; ++i)
      chunks.push_back(ex::Chunk{ids[i], std::span<const int>(&r.tokens[i].back(), 1), triattn::Phase::kDecode});
    out = model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk);
    r.logits.push_back(out.logits);
    for (int i = 0; i < batch; ++i) r.tokens[i].push_back(ex::Sampler::argmax(out.row(i)));
  }
  r.stats = be.stats();
  return r;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("GPU decode graphs per batch bucket give the eager tokens as the batch shrinks") {
  triattn::test::require_device();
  const ex::ModelConfig c = triattn::test::small_config(64);
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 5);
  const int n = kSchedule.front();
  const std::set<int> sizes(kSchedule.begin(), kSchedule.end());
  std::set<int> buckets;
  int padded = 0;
  for (const int b : kSchedule) {
    buckets.insert(ex::cuda_detail::decode_bucket(b));
    padded += ex::cuda_detail::decode_bucket(b) != b;
  }
  REQUIRE(buckets.size() == 5);
  REQUIRE(sizes.size() == 7);
  for (const DType kv : {DType::kF32, DType::kBF16, DType::kFP8E4M3}) {
    INFO("KV " << std::string(triattn::dtype_name(kv)));
    ex::CudaBackendOptions bucketed;
    bucketed.matmul_path = ex::MatmulPath::kGemv;  // a row's arithmetic never depends on the batch
    ex::CudaBackendOptions eager = bucketed;
    eager.graphs = false;
    ex::CudaBackendOptions exact = bucketed;
    exact.graph_buckets = false;
    const Run e = run(w, eager, kv, n + 1);
    const Run g = run(w, bucketed, kv, n + 1);  // slot n stays empty: the padding rows attend to it
    CHECK(g.tokens == e.tokens);
    REQUIRE(g.logits.size() == e.logits.size());
    float worst = 0.0f, scale = 0.0f;
    for (std::size_t s = 0; s < e.logits.size(); ++s) {
      worst = std::max(worst, triattn::test::max_abs_diff(g.logits[s], e.logits[s]));
      for (float x : e.logits[s]) scale = std::max(scale, std::fabs(x));
    }
    CHECK(worst <= 1e-5f * scale);
    MESSAGE("bucketed graphs: " << g.stats.graph_captures << " captures, " << g.stats.graph_replays << " replays, "
                                << g.stats.padded_steps << " padded steps; logits max abs diff " << worst);
    CHECK(g.stats.graph_captures == buckets.size());
    CHECK(g.stats.padded_steps == static_cast<std::uint64_t>(padded));
    CHECK(g.stats.graph_replays == kSchedule.size());
    CHECK(e.stats.graph_replays == 0);
    // Without buckets: one graph per batch size, the same tokens.
    const Run x = run(w, exact, kv, n + 1);
    CHECK(x.tokens == e.tokens);
    CHECK(x.stats.graph_captures == sizes.size());
    CHECK(x.stats.padded_steps == 0);
    // No empty sequence slot for the padding rows: every step keeps its exact graph.
    const Run f = run(w, bucketed, kv, n);
    CHECK(f.tokens == e.tokens);
    CHECK(f.stats.padded_steps == 0);
    CHECK(f.stats.graph_captures == sizes.size());
  }
}

}  // TEST_SUITE

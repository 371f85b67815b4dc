// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The reference transformer on the GPU (examples/reference_transformer/cuda_backend.cuh):
//   * stories260K greedy decoding through Model<CudaBackend> and a device KvCache reproduces
//     llama2.c (stories260K_greedy_ref.json): 256 tokens, logits within 1e-4, K/V of positions
//     0..3 read back from the device cache; with graphs / PDL / fusion on and off
//   * a one-step prefill of 256 tokens gives the same argmax and logits
//   * a batch of prompts equals each prompt alone (bitwise, GEMV matmuls) and the CPU path's tokens
//   * every backend option (graphs, PDL, fusion, direct KV write) gives bitwise the same logits;
//     DeviceDecoder (device-generated weights, the benchmark's driver) equals Model<CudaBackend>
//   * bf16 weights (warp and tensor-core GEMVs) stay close to the CPU on the same rounded weights
//   * TriAttention compression on the GPU (synthetic model with head_dim 64: triattn's scoring
//     kernels are compiled for 64 and 128, stories260K has 8): every round's keep plans from the
//     full device round (cuda::DeviceRounds: score, select, compact on the device), from the device
//     scorer + host selector (KvCache::compress's path) and from the CPU scorer + selector on the
//     same keys (downloaded) are compared: device vs host selection exactly, device vs CPU scores
//     up to near-ties (the scores agree to ~1e-6); rounds of several sequences at once
//   * the same rounds over the VMM pool with KvCache::relocate_blocks after each (the engine's
//     hook): the tokens of the static pool, and only the fewest slabs that hold the blocks mapped
//   * serving requests that share a system prompt (serve_shared.hpp) over the device pool with
//     the prefix cache on gives bitwise the tokens of the same run with it off, device rounds on
// Data come from TRIATTN_SHARED_DATA_DIR/models; a missing file fails the test. No GPU: fails.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <string>
#include <vector>

#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/stats/calibrator.hpp>

#include "cuda_test_utils.cuh"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>
#include <reference_transformer/generate.hpp>
#include <reference_transformer/llama2c.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/serve_shared.hpp>
#include <reference_transformer/synthetic.hpp>

namespace ex = triattn_example;
using triattn::DType;
using triattn::KvKind;
using triattn::KvLayout;
using triattn::SeqId;

namespace {

using triattn::test::cache_config;
using triattn::test::prompt_tokens;
using triattn::test::rounded_to_bf16;
using triattn::test::small_config;
using triattn::test::max_abs_diff;
using triattn::test::Stories;

/// Host copy of a device cache: the pool plus a view over the cache's host tables.
template <class T>
struct Snapshot {
  std::vector<T> data;
  triattn::KvCacheView<T, std::int32_t> view{};
};
template <class T, class Cache>
Snapshot<T> snapshot(Cache& cache, ex::CudaBackend& be) {
  be.synchronize();
  Snapshot<T> s;
  const std::size_t bytes = cache.allocator().backend().bytes();
  s.data.resize(bytes / sizeof(T));
  TRIATTN_TEST_CUDA(cudaMemcpy(s.data.data(), cache.allocator().data(), bytes, cudaMemcpyDeviceToHost));
  s.view = cache.template view<T>();
  s.view.data = s.data.data();
  s.view.block_tables = cache.host_block_tables().data();
  s.view.seq_lens = cache.host_lengths().data();
  return s;
}

ex::GpuPlainCache plain_cache(const triattn::CacheConfig& cfg, ex::CudaBackend& be) {
  return ex::GpuPlainCache(cfg, triattn::cuda::DeviceCompactor(be.stream()));
}

/// Greedy stories260K from BOS for 256 tokens; checks tokens, logits and K/V of positions 0..3.
template <class Cache>
void check_stories_greedy(Cache& cache, ex::CudaBackend be) {
  const Stories& s = Stories::get();
  ex::Model<ex::CudaBackend> model(s.weights, be);
  const triattn::test::GreedyRun run = triattn::test::run_stories_greedy(model, cache);
  const auto& res = run.res;
  const int matched = triattn::test::check_greedy_tokens(s, res[0].generated);
  const float worst = triattn::test::check_reference_logits(
      s, [&](int p) -> std::span<const float> { return run.logits_at[static_cast<std::size_t>(p)]; });
  const Snapshot<float> snap = snapshot<float>(cache, be);
  const float kv_worst = triattn::test::reference_kv_diff(s, snap.view, res[0].seq);
  CHECK_MESSAGE(kv_worst < 1e-5f, "K/V of positions 0..3: max abs diff " << kv_worst);
  CHECK(cache.physical_length(res[0].seq) == 256);
  CHECK(cache.logical_position(res[0].seq) == 256);
  const ex::CudaBackend::Stats st = be.stats();
  MESSAGE("stories260K on the GPU: " << matched << "/256 tokens, logits max abs diff " << worst << ", K/V max abs diff "
                                     << kv_worst << "; graphs captured " << st.graph_captures << ", replayed "
                                     << st.graph_replays << ", eager flushes " << st.eager_flushes);
  if (be.options().graphs) {
    CHECK(st.graph_captures >= 1);
    CHECK(st.graph_replays >= 250);  // every decode step after the first capture
  } else {
    CHECK(st.graph_replays == 0);
  }
}

/// Prefill of `prompts` then `steps` decode steps with the given tokens (teacher forcing: the
/// same inputs for every backend), all logits returned.
template <class ModelT, class Cache>
std::vector<std::vector<float>> run_forced(ModelT& model, Cache& cache, const std::vector<std::vector<int>>& prompts,
                                           int steps) {
  std::vector<SeqId> ids;
  std::vector<ex::Chunk> chunks;
  for (const auto& p : prompts) {
    ids.push_back(cache.add_sequence());
    chunks.push_back(ex::Chunk{ids.back(), p, triattn::Phase::kPrefill});
  }
  std::vector<std::vector<float>> all;
  ex::StepOutput out = model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk);
  all.push_back(out.logits);
  std::vector<int> tok(prompts.size());
  for (int s = 0; s < steps; ++s) {
    chunks.clear();
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      tok[i] = (s * 13 + static_cast<int>(i) * 7 + 5) % model.config().vocab_size;
      chunks.push_back(ex::Chunk{ids[i], std::span<const int>(&tok[i], 1), triattn::Phase::kDecode});
    }
    out = model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk);
    all.push_back(out.logits);
  }
  return all;
}

/// Query statistics calibrated on the CPU: pre-RoPE queries of a 256-token prefill.
triattn::QueryStats calibrated_stats(const ex::ModelWeights& w) {
  const ex::ModelConfig& c = w.config;
  triattn::Calibrator cal(c.n_layers, c.n_heads, c.head_dim, c.rope_style, c.name);
  ex::Model<> model(w);
  model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
  triattn::KvCache<> cache(cache_config(c, 256, 1));
  const std::vector<int> toks = prompt_tokens(256, 9, c.vocab_size);
  const SeqId id = cache.add_sequence();
  const ex::Chunk chunk{id, toks, triattn::Phase::kPrefill};
  (void)model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
  return cal.finish();
}

triattn::RopeConfig rope_of(const ex::ModelConfig& c) {
  triattn::RopeConfig rope;
  rope.style = c.rope_style;
  rope.theta = c.rope_theta;
  return rope;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("stories260K on the GPU: greedy decoding reproduces llama2.c tokens and logits and K/V") {
  triattn::test::require_device();
  const ex::ModelConfig& mc = Stories::get().weights.config;
  SUBCASE("NHD, block 16, graphs + PDL + fusion") {
    ex::CudaBackend be;
    auto cache = plain_cache(cache_config(mc, 256, 1), be);
    check_stories_greedy(cache, be);
  }
  SUBCASE("HND, block 5, a neighbour shuffles the pool, no graphs / PDL / fusion") {
    ex::CudaBackendOptions o;
    o.graphs = false;
    o.pdl = false;
    o.fuse = false;
    ex::CudaBackend be(o);
    auto cache = plain_cache(cache_config(mc, 256, 2, 5, DType::kF32, KvLayout::kHND), be);
    const SeqId other = cache.add_sequence();
    REQUIRE(cache.extend(other, 7, triattn::Phase::kPrefill).ok());
    check_stories_greedy(cache, be);
  }
}

TEST_CASE("stories260K on the GPU: one prefill step of 256 tokens equals the greedy reference") {
  triattn::test::require_device();
  const Stories& s = Stories::get();
  ex::CudaBackend be;
  ex::Model<ex::CudaBackend> model(s.weights, be);
  auto cache = plain_cache(cache_config(s.weights.config, 256, 1), be);
  std::vector<int> seq = {1};
  seq.insert(seq.end(), s.greedy.begin(), s.greedy.end() - 1);
  const SeqId id = cache.add_sequence();
  const ex::Chunk chunk{id, seq, triattn::Phase::kPrefill};
  const ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kAllRows);
  REQUIRE(out.num_logit_rows() == 256);
  int argmax_ok = 0;
  for (int p = 0; p < 256; ++p) argmax_ok += ex::Sampler::argmax(out.row(p)) == s.greedy[static_cast<std::size_t>(p)];
  CHECK(argmax_ok == 256);
  const float worst = triattn::test::check_reference_logits(s, [&](int p) { return out.row(p); });
  MESSAGE("stories260K GPU prefill of 256 tokens: " << argmax_ok << "/256 argmax, logits max abs diff " << worst);
}

TEST_CASE("stories260K on the GPU: a batch of 3 equals each prompt alone (bitwise) and the CPU's tokens") {
  triattn::test::require_device();
  const Stories& s = Stories::get();
  const std::vector<std::vector<int>> prompts = {{1, 403, 407}, {1}, {1, 403, 407, 261, 378, 260, 375, 261}};
  constexpr int kSteps = 60;
  auto run = [&](const std::vector<std::vector<int>>& ps, bool gpu) {
    std::vector<ex::Sampler> samplers(ps.size());
    ex::GenerationOptions opt;
    opt.max_new_tokens = kSteps;
    opt.stop_at_bos = false;
    std::vector<std::vector<std::vector<float>>> logits(ps.size());
    ex::GenerationCallbacks cb;
    cb.on_token = [&](int i, int, std::int64_t, std::span<const float> l) {
      logits[static_cast<std::size_t>(i)].emplace_back(l.begin(), l.end());
    };
    std::vector<std::vector<int>> toks;
    const auto cfg = cache_config(s.weights.config, 16 + kSteps, static_cast<int>(ps.size()));
    if (gpu) {
      // The GEMV kernels: a row's arithmetic never depends on the batch there; cuBLAS (from
      // kCublasMinRowsF32 rows) picks its kernel by shape, so only the GEMV path is batch-invariant.
      ex::CudaBackendOptions o;
      o.matmul_path = ex::MatmulPath::kGemv;
      ex::CudaBackend be(o);
      ex::Model<ex::CudaBackend> model(s.weights, be);
      auto cache = plain_cache(cfg, be);
      for (const auto& r : ex::generate(model, cache, std::span<const std::vector<int>>(ps), std::span<ex::Sampler>(samplers), opt, cb))
        toks.push_back(r.generated);
    } else {
      ex::Model<> model(s.weights);
      triattn::KvCache<> cache(cfg);
      for (const auto& r : ex::generate(model, cache, std::span<const std::vector<int>>(ps), std::span<ex::Sampler>(samplers), opt, cb))
        toks.push_back(r.generated);
    }
    return std::make_pair(toks, logits);
  };
  const auto batch = run(prompts, true);
  const auto cpu = run(prompts, false);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    INFO("prompt " << i);
    const auto alone = run({prompts[i]}, true);
    CHECK(alone.first[0] == batch.first[i]);
    CHECK(alone.second[0] == batch.second[i]);  // bitwise: a row's arithmetic does not depend on the batch
    CHECK(cpu.first[i] == batch.first[i]);
    float worst = 0.0f;
    for (std::size_t t = 0; t < cpu.second[i].size(); ++t) worst = std::max(worst, max_abs_diff(cpu.second[i][t], batch.second[i][t]));
    CHECK(worst < 1e-4f);
    MESSAGE("prompt " << i << ": GPU vs CPU logits max abs diff " << worst << " over " << kSteps << " tokens");
  }
}

TEST_CASE("GPU generate: greedy decode steps through the device argmax give the host-sampled tokens") {
  // token_logits off: every decode step's tokens come from CudaBackend::argmax_host (only the ids
  // cross to the host); on: the host samples the copied logits. Same tokens, f32 and bf16, with
  // head_dim 64 and GQA (the decode attention kernel, cuBLAS matmuls, graphs at batch 5).
  triattn::test::require_device();
  const ex::ModelWeights w = ex::make_synthetic_weights(small_config(64, 3000), 4242);
  const std::vector<std::vector<int>> prompts = {{1, 40, 41, 42}, {1, 7}, {1, 300, 301}, {1, 9, 10, 11, 12}, {1, 2}};
  constexpr int kSteps = 40;
  for (const bool bf16 : {false, true}) {
    INFO((bf16 ? "bf16 weights and KV" : "f32 weights and KV"));
    auto run = [&](bool token_logits, ex::GenerationStats& st) {
      ex::CudaBackendOptions o;
      o.weights = bf16 ? ex::WeightType::kBF16 : ex::WeightType::kF32;
      ex::CudaBackend be(o);
      ex::Model<ex::CudaBackend> model(w, be);
      auto cache = plain_cache(cache_config(w.config, 16 + kSteps, static_cast<int>(prompts.size()) + 1, 16,
                                            bf16 ? DType::kBF16 : DType::kF32),
                               be);
      std::vector<ex::Sampler> samplers(prompts.size());
      ex::GenerationOptions opt;
      opt.max_new_tokens = kSteps;
      opt.stop_at_bos = false;
      ex::GenerationCallbacks cb;
      cb.token_logits = token_logits;
      std::size_t empty = 0;
      cb.on_token = [&](int, int, std::int64_t, std::span<const float> l) { empty += l.empty() ? 1 : 0; };
      std::vector<std::vector<int>> toks;
      for (const auto& r : ex::generate(model, cache, std::span<const std::vector<int>>(prompts),
                                        std::span<ex::Sampler>(samplers), opt, cb, &st))
        toks.push_back(r.generated);
      CHECK(empty == (token_logits ? 0 : prompts.size() * kSteps));
      return toks;
    };
    ex::GenerationStats host_st, dev_st;
    const auto host = run(true, host_st);
    const auto dev = run(false, dev_st);
    CHECK(dev == host);
    CHECK(host_st.decode_device_argmax_steps == 0);
    CHECK(dev_st.decode_steps == kSteps - 1);
    CHECK(dev_st.decode_device_argmax_steps == dev_st.decode_steps);  // no step fell back to host logits
    // Every decode step was timed on the device: a positive time, within the step's wall time.
    CHECK(dev_st.decode_device_seconds > 0.0);
    CHECK(dev_st.decode_device_seconds <= dev_st.decode_seconds);
    MESSAGE((bf16 ? "bf16" : "f32") << ": decode " << dev_st.decode_seconds * 1e3 / dev_st.decode_steps
                                    << " ms/step with the device argmax (device " << dev_st.decode_device_seconds * 1e3 / dev_st.decode_steps
                                    << " ms), " << host_st.decode_seconds * 1e3 / host_st.decode_steps << " ms/step with host sampling");
  }
}

TEST_CASE("GPU backend options and DeviceDecoder give bitwise the same logits") {
  triattn::test::require_device();
  for (const DType kv : {DType::kF32, DType::kBF16}) {
    for (const int hd : {64, 128}) {
      INFO("KV " << std::string(triattn::dtype_name(kv)) << ", head_dim " << hd);
      const ex::ModelConfig c = small_config(hd);
      const ex::ModelWeights w = ex::make_synthetic_weights(c, 77);
      const std::vector<std::vector<int>> prompts = {prompt_tokens(19, 1, c.vocab_size), prompt_tokens(3, 2, c.vocab_size),
                                                     prompt_tokens(40, 3, c.vocab_size)};
      constexpr int kSteps = 20;
      const auto cfg = cache_config(c, 64 + kSteps, 3, 16, kv);
      auto with = [&](ex::CudaBackendOptions o) {
        ex::CudaBackend be(o);
        ex::Model<ex::CudaBackend> model(w, be);
        auto cache = plain_cache(cfg, be);
        return run_forced(model, cache, prompts, kSteps);
      };
      for (const ex::WeightType wt : {ex::WeightType::kF32, ex::WeightType::kBF16}) {
        INFO("weights " << ex::weight_type_name(wt));
        ex::CudaBackendOptions all_on;
        all_on.weights = wt;
        ex::CudaBackendOptions no_graphs = all_on;
        no_graphs.graphs = no_graphs.pdl = false;
        ex::CudaBackendOptions no_fuse = no_graphs;
        no_fuse.fuse = false;
        ex::CudaBackendOptions direct = all_on;
        direct.direct_kv_write = true;
        const auto a = with(all_on);
        CHECK(a == with(no_graphs));
        CHECK(a == with(direct));
        const auto u = with(no_fuse);
        if (wt == ex::WeightType::kF32) {
          CHECK(a == u);
        } else {
          // Unfused, the classifier runs one row at a time (fp32 activations) instead of one
          // tensor-core GEMV over the picked rows (bf16 activations): close, not bitwise.
          float worst = 0.0f, scale = 0.0f;
          REQUIRE(a.size() == u.size());
          for (std::size_t s = 0; s < a.size(); ++s) {
            worst = std::max(worst, max_abs_diff(a[s], u[s]));
            for (float x : a[s]) scale = std::max(scale, std::fabs(x));
          }
          CHECK(worst <= 3e-2f * scale);
        }
      }
      // DeviceDecoder with device-generated bf16 weights vs Model<CudaBackend> with the host
      // weights uploaded as bf16: same weights (the generator is bitwise the host's), same calls.
      ex::CudaBackendOptions o;
      o.weights = ex::WeightType::kBF16;
      ex::CudaBackend be(o);
      ex::Model<ex::CudaBackend> model(w, be);
      ex::DeviceDecoder dec(c, be, be.generate_synthetic(c, 77));
      auto ca = plain_cache(cfg, be);
      auto cb = plain_cache(cfg, be);
      std::vector<SeqId> ia, ib;
      for (const auto& p : prompts) {
        ia.push_back(ca.add_sequence());
        ib.push_back(cb.add_sequence());
        const ex::Chunk x{ia.back(), p, triattn::Phase::kPrefill}, y{ib.back(), p, triattn::Phase::kPrefill};
        (void)model.step(ca, std::span<const ex::Chunk>(&x, 1));
        (void)model.step(cb, std::span<const ex::Chunk>(&y, 1));
      }
      int equal_steps = 0;
      std::vector<int> tok(prompts.size());
      for (int s = 0; s < kSteps; ++s) {
        std::vector<ex::Chunk> chunks;
        for (std::size_t i = 0; i < prompts.size(); ++i) {
          tok[i] = (s * 29 + static_cast<int>(i) * 3 + 1) % c.vocab_size;
          chunks.push_back(ex::Chunk{ia[i], std::span<const int>(&tok[i], 1), triattn::Phase::kDecode});
        }
        const ex::StepOutput out = model.step(ca, chunks);
        dec.step(cb, ib, tok);
        const std::vector<float> dl = dec.logits_host();
        equal_steps += dl == out.logits;
        const std::vector<int> am = dec.argmax();
        for (std::size_t i = 0; i < prompts.size(); ++i) CHECK(am[i] == ex::Sampler::argmax(out.row(static_cast<int>(i))));
      }
      CHECK(equal_steps == kSteps);
    }
  }
}

TEST_CASE("GPU bf16 weights: warp and tensor-core GEMVs stay close to the CPU on the same rounded weights") {
  triattn::test::require_device();
  const ex::ModelConfig c = small_config(128);
  const ex::ModelWeights w = rounded_to_bf16(ex::make_synthetic_weights(c, 5));
  for (const int batch : {1, 2, 5}) {
    INFO("batch " << batch);
    std::vector<std::vector<int>> prompts;
    for (int i = 0; i < batch; ++i) prompts.push_back(prompt_tokens(7 + 5 * i, i, c.vocab_size));
    const auto cfg = cache_config(c, 64, batch);
    ex::CudaBackendOptions o;
    o.weights = ex::WeightType::kBF16;
    ex::CudaBackend be(o);
    ex::Model<ex::CudaBackend> gm(w, be);
    auto gc = plain_cache(cfg, be);
    const auto g = run_forced(gm, gc, prompts, 10);
    ex::Model<> cm(w);
    triattn::KvCache<> cc(cfg);
    const auto r = run_forced(cm, cc, prompts, 10);
    REQUIRE(g.size() == r.size());
    float worst = 0.0f, scale = 0.0f;
    int same_argmax = 0, rows = 0;
    for (std::size_t s = 0; s < g.size(); ++s) {
      worst = std::max(worst, max_abs_diff(g[s], r[s]));
      for (float x : r[s]) scale = std::max(scale, std::fabs(x));
      for (int i = 0; i < batch; ++i, ++rows) {
        const auto row = [&](const std::vector<float>& l) {
          return std::span<const float>(l.data() + static_cast<std::size_t>(i) * c.vocab_size, static_cast<std::size_t>(c.vocab_size));
        };
        same_argmax += ex::Sampler::argmax(row(g[s])) == ex::Sampler::argmax(row(r[s]));
      }
    }
    // GEMVs of n >= 3 rows round activations to bf16 for the tensor cores (~2^-9 relative). The
    // prefill step always has >= 3 rows, and its K/V feed every later step, so the whole run
    // carries that rounding (measured on the H200: 0.23% of max |logit| at batch 1).
    const float tol = 3e-2f;
    CHECK(same_argmax == rows);
    CHECK_MESSAGE(worst <= tol * scale, "max |GPU - CPU| logit " << worst << " vs max |logit| " << scale);
    MESSAGE("bf16 weights, batch " << batch << ": max |GPU - CPU| " << worst << " (max |logit| " << scale << "), argmax equal "
                                   << same_argmax << "/" << rows);
  }
}

TEST_CASE("TriAttention on the GPU: device rounds keep exactly what the CPU scorer and selector keep") {
  triattn::test::require_device();
  const ex::ModelConfig c = small_config(64, 512);
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 2024);
  const triattn::QueryStats stats = calibrated_stats(w);
  const triattn::RopeConfig rope = rope_of(c);
  constexpr int kBudget = 64, kDivide = 16, kSteps = 200;
  triattn::SelectionParams sel;
  sel.budget = kBudget;
  sel.divide_length = kDivide;

  for (const DType kv : {DType::kF32, DType::kBF16}) {
    INFO("KV " << std::string(triattn::dtype_name(kv)));
    ex::CudaBackend be;
    ex::Model<ex::CudaBackend> model(w, be);
    ex::GpuTriCache cache(cache_config(c, kBudget + kDivide + 48, 3, 16, kv), triattn::cuda::DeviceCompactor(be.stream()),
                          triattn::cuda::TriAttentionDeviceScorer(stats, rope, triattn::ScoringParams{}, c.n_kv_heads, be.stream()),
                          triattn::TopKSelector(sel));
    triattn::TriAttentionScorer cpu_scorer(stats, rope, triattn::ScoringParams{}, c.n_kv_heads);
    const triattn::TopKSelector cpu_selector(sel);
    ex::DeviceRounds device_rounds(cache);
    device_rounds.set_keep_plans(true);  // last_plan: the kept slots come back
    // Prompts of 5 and 21 tokens reach the trigger on the same steps: rounds of two sequences at once.
    const std::vector<std::vector<int>> prompts = {prompt_tokens(5, 1, c.vocab_size), prompt_tokens(21, 2, c.vocab_size),
                                                   prompt_tokens(12, 3, c.vocab_size)};
    std::vector<ex::Sampler> samplers;
    for (int i = 0; i < 3; ++i) samplers.emplace_back(0.8f, 0.95f, 100 + static_cast<std::uint64_t>(i));
    ex::GenerationOptions opt;
    opt.max_new_tokens = kSteps;
    opt.stop_at_bos = false;
    int rounds = 0, plan_mismatch = 0, host_mismatch = 0, max_len = 0, batched_rounds = 0;
    long long swapped = 0, kept_total = 0;
    ex::GenerationCallbacks cb;
    cb.after_step = [&](std::span<const SeqId> seqs) {
      std::vector<SeqId> due;
      for (SeqId s : seqs) {
        max_len = std::max(max_len, cache.physical_length(s));
        if (cache.needs_compression(s)) due.push_back(s);
      }
      std::vector<triattn::CompressionReport> done;
      if (due.empty()) return done;
      batched_rounds += due.size() > 1;
      const triattn::ModelGeometry g = cache.config().model;
      // The CPU's and the host selector's plans from the cache as it is before the round, which
      // then scores, selects and compacts on the device (rounds.last_plan: what it applied).
      std::vector<triattn::KeepPlan> cpu(due.size()), host(due.size());
      auto plan_with = [&](auto tag) {
        using T = typename decltype(tag)::type;
        const Snapshot<T> snap = snapshot<T>(cache, be);
        for (std::size_t b = 0; b < due.size(); ++b) {
          const SeqId s = due[b];
          const int len = cache.physical_length(s);
          std::vector<float> scores(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * len);
          cpu_scorer.score(snap.view, s, len, cache.logical_position(s), scores);  // CPU, same keys
          cpu[b] = cpu_selector.select(scores, g, len, cache.prompt_length(s));
          cache.scorer().score(cache.template view<T>(), s, len, cache.logical_position(s), scores);  // device scores
          host[b] = cache.selector().select(scores, g, len, cache.prompt_length(s));
        }
      };
      if (kv == DType::kF32) plan_with(std::type_identity<float>{});
      else plan_with(std::type_identity<triattn::bf16_storage>{});
      device_rounds.launch(due, be.stream());
      done = device_rounds.wait();
      REQUIRE(done.size() == due.size());
      auto same = [](const triattn::KeepPlan& a, const triattn::KeepPlan& b) { return a.keep == b.keep && a.indices == b.indices; };
      for (std::size_t b = 0; b < due.size(); ++b) {
        REQUIRE(done[b].status == triattn::RoundStatus::kCompressed);
        const triattn::KeepPlan dev = device_rounds.last_plan(b);
        // Device selection vs host selection on the same device scores: exactly equal.
        host_mismatch += !same(host[b], dev);
        // CPU scores (float64 fold on the host) vs device scores agree to ~1e-6: a plan can only
        // differ where two candidates tie that closely (a swapped slot or two).
        if (!same(cpu[b], dev)) {
          ++plan_mismatch;
          for (int l = 0; l < g.num_layers; ++l)
            for (int h = 0; h < g.num_kv_heads; ++h) {
              const std::int32_t* a = cpu[b].row(l, h);
              const std::int32_t* d = dev.row(l, h);
              std::vector<std::int32_t> only;
              std::set_difference(a, a + cpu[b].keep, d, d + dev.keep, std::back_inserter(only));
              swapped += static_cast<long long>(only.size());
            }
        }
        kept_total += static_cast<long long>(dev.keep) * g.num_layers * g.num_kv_heads;
        CHECK(done[b].length_after == dev.keep);
        ++rounds;
      }
      return done;
    };
    const auto res = ex::generate(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers),
                                  opt, cb);
    CHECK(rounds >= 3 * ((kSteps - kBudget) / kDivide - 1));
    CHECK(host_mismatch == 0);
    CHECK_MESSAGE(plan_mismatch <= 1, plan_mismatch << " of " << rounds << " rounds kept other slots than the CPU");
    CHECK_MESSAGE(swapped * 1000 <= kept_total, swapped << " of " << kept_total << " kept slots differ from the CPU's");
    CHECK(max_len == kBudget + kDivide);
    CHECK(batched_rounds > 0);
    for (const auto& r : res) {
      CHECK(r.generated.size() == static_cast<std::size_t>(kSteps));
      CHECK(cache.physical_length(r.seq) >= kBudget);
      CHECK(cache.physical_length(r.seq) < kBudget + kDivide);
      CHECK(cache.logical_position(r.seq) == static_cast<std::int64_t>(r.prompt.size()) + kSteps - 1);
    }
    // The ordinary KvCache path (the device round, waited for) runs too; the
    // last rounds shrank host tables after the step's publish, so publish first.
    triattn::cuda::publish(cache, be.stream());
    const SeqId extra = res[0].seq;
    CHECK_NOTHROW((void)cache.compress(extra));
    MESSAGE("GPU TriAttention (KV " << std::string(triattn::dtype_name(kv)) << "): " << rounds << " rounds (" << batched_rounds
                                     << " steps compressed several sequences at once); device plan != CPU plan in "
                                     << plan_mismatch << " rounds (" << swapped << " of " << kept_total
                                     << " kept slots); graphs captured " << be.stats().graph_captures);
  }
}

TEST_CASE("TriAttention on the GPU over VMM: relocation after rounds packs the slabs and keeps the tokens") {
  triattn::test::require_device();
  const ex::ModelConfig c = small_config(64, 512);
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 2024);
  const triattn::QueryStats stats = calibrated_stats(w);
  const triattn::RopeConfig rope = rope_of(c);
  // reference_transformer's serving run in small: long prompts prefilled in order in chunks, every
  // prompt token competing for the budget, then rounds during decode. bf16 blocks of 16 x 2 heads x
  // 64 = 4 KiB: 512 per 2 MiB page, so 24 prompts of 1,000 tokens fill 3 slabs and their
  // survivors (16 blocks each) sit in all of them.
  constexpr int kBudget = 256, kDivide = 32, kSteps = 80, kSeqs = 24, kPrompt = 1000;
  triattn::SelectionParams sel;
  sel.budget = kBudget;
  sel.divide_length = kDivide;
  sel.prompt = triattn::PromptMode::kCompete;
  auto cfg = cache_config(c, kPrompt + kDivide + 1, kSeqs, 16, DType::kBF16);
  cfg.num_blocks = (cfg.num_blocks + 511) / 512 * 512;  // whole slabs: the packed count is exact
  std::vector<std::vector<int>> prompts;
  for (int i = 0; i < kSeqs; ++i) prompts.push_back(prompt_tokens(kPrompt, 40 + i, c.vocab_size));
  ex::GenerationOptions opt;
  opt.max_new_tokens = kSteps;
  opt.stop_at_bos = false;
  opt.prefill_chunk = 512;
  auto samplers = [] {
    std::vector<ex::Sampler> s;
    for (int i = 0; i < kSeqs; ++i) s.emplace_back(0.8f, 0.95f, 300 + static_cast<std::uint64_t>(i));
    return s;
  };
  auto run = [&](auto& cache, ex::Model<ex::CudaBackend>& model, ex::CudaBackend& be, auto&& after_round) {
    using CacheT = std::remove_reference_t<decltype(cache)>;
    triattn::cuda::DeviceRounds<CacheT> rounds(cache);
    ex::GenerationCallbacks cb;
    cb.after_step = [&](std::span<const SeqId> live) {
      auto done = rounds.compress_if_needed_and_wait(live, be.stream());
      after_round(done);
      return done;
    };
    std::vector<ex::Sampler> s = samplers();
    std::vector<std::vector<int>> tokens;
    for (const auto& r : ex::generate(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(s),
                                      opt, cb))
      tokens.push_back(r.generated);
    return tokens;
  };

  // The static pool without relocation: the tokens to reproduce.
  std::vector<std::vector<int>> want;
  {
    ex::CudaBackend be;
    ex::Model<ex::CudaBackend> model(w, be);
    ex::GpuTriCache cache(cfg, triattn::cuda::DeviceCompactor(be.stream()),
                          triattn::cuda::TriAttentionDeviceScorer(stats, rope, triattn::ScoringParams{}, c.n_kv_heads, be.stream()),
                          triattn::TopKSelector(sel));
    want = run(cache, model, be, [](const auto&) {});
  }
  // VMM with the engine's hook: relocate after a round, trim every empty slab.
  ex::CudaBackend be;
  ex::Model<ex::CudaBackend> model(w, be);
  ex::GpuVmmTriCache cache(cfg, triattn::cuda::DeviceCompactor(be.stream()),
                           triattn::cuda::TriAttentionDeviceScorer(stats, rope, triattn::ScoringParams{}, c.n_kv_heads, be.stream()),
                           triattn::TopKSelector(sel));
  const int per_slab = cache.allocator().geometry().blocks_per_slab;
  REQUIRE(per_slab == 512);
  int rounds = 0, packed = 0;
  std::size_t moved = 0;
  const auto got = run(cache, model, be, [&](const std::vector<triattn::CompressionReport>& done) {
    if (done.empty()) return;
    ++rounds;
    moved += cache.relocate_blocks().blocks_moved;
    (void)cache.allocator().trim(be.stream());
    cache.allocator().synchronize();
    const auto vs = cache.allocator().stats();
    // The fewest slabs that can hold the blocks in use: nothing else stays mapped.
    packed += vs.slabs_mapped == (vs.blocks_used + per_slab - 1) / per_slab;
  });
  CHECK(got == want);
  CHECK(rounds >= 3);
  CHECK(packed == rounds);
  CHECK(moved > 0);
  const triattn::MemoryStats m = cache.memory();
  MESSAGE("VMM + relocation: " << rounds << " rounds, " << moved << " blocks moved; at the end " << m.bytes_resident
                               << " B resident for " << m.bytes_live << " B live, " << m.blocks_used << " blocks in use");
}

TEST_CASE("GPU serving with the prefix cache gives the same tokens as without (compressed on the device)") {
  triattn::test::require_device();
  const ex::ModelConfig c = small_config(64, 512);
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 2024);
  const triattn::QueryStats stats = calibrated_stats(w);
  triattn::SelectionParams sel;
  sel.budget = 64;
  sel.divide_length = 16;
  // A 40-token system prompt (2 full blocks of 16) and each request's own tokens; requests 5 and
  // 6 repeat request 4's 48 tokens (request 6, a wave later, hits 47 of them and copies the partly
  // shared third block on its first write: DeviceCompactor::copy_block).
  const std::vector<int> system = prompt_tokens(40, 5, c.vocab_size);
  std::vector<std::vector<int>> prompts;
  for (int r = 0; r < 4; ++r) {
    std::vector<int> p = system;
    for (int i = 0; i <= r; ++i) p.push_back((100 + 7 * r + i) % c.vocab_size);
    prompts.push_back(p);
  }
  std::vector<int> p48 = system;
  for (int i = 0; i < 8; ++i) p48.push_back((300 + 3 * i) % c.vocab_size);
  prompts.push_back(p48);
  prompts.push_back(p48);
  prompts.push_back(p48);

  constexpr int kSteps = 120;
  for (const DType kv : {DType::kF32, DType::kBF16}) {
    INFO("KV " << std::string(triattn::dtype_name(kv)));
    auto run = [&](bool prefix_cache) {
      ex::CudaBackend be;
      ex::Model<ex::CudaBackend> model(w, be);
      ex::GpuPrefixTriCache cache(cache_config(c, sel.budget + sel.divide_length + 64, 2, 16, kv),
                                  triattn::cuda::DeviceCompactor(be.stream()),
                                  triattn::cuda::TriAttentionDeviceScorer(stats, rope_of(c), triattn::ScoringParams{},
                                                                          c.n_kv_heads, be.stream()),
                                  triattn::TopKSelector(sel));
      triattn::cuda::DeviceRounds<ex::GpuPrefixTriCache> rounds(cache);
      std::vector<ex::Sampler> samplers;
      for (std::size_t i = 0; i < prompts.size(); ++i) samplers.emplace_back(0.8f, 0.9f, 11 + i);
      ex::GenerationOptions opt;
      opt.max_new_tokens = kSteps;
      opt.stop_at_bos = false;
      return ex::serve_shared(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers),
                              opt, prefix_cache, /*wave=*/2, [&](std::span<const SeqId> live) {
                                return rounds.compress_if_needed_and_wait(live, be.stream());
                              });
    };
    const ex::ServeReport on = run(true);
    const ex::ServeReport off = run(false);
    REQUIRE(on.requests.size() == prompts.size());
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      CAPTURE(i);
      CHECK(on.requests[i].generated.size() == static_cast<std::size_t>(kSteps));
      CHECK(on.requests[i].generated == off.requests[i].generated);
      CHECK(on.requests[i].compression_rounds > 0);
      CHECK(on.requests[i].compression_rounds == off.requests[i].compression_rounds);
      CHECK(off.requests[i].cached_tokens == 0);
    }
    const std::vector<int> expect_cached = {0, 0, 32, 32, 32, 32, 47};
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      CAPTURE(i);
      CHECK(on.requests[i].cached_tokens == expect_cached[i]);
    }
    CHECK(on.computed_prompt_tokens == off.computed_prompt_tokens - (32 * 4 + 47));
    CHECK(on.cache.hit_tokens == static_cast<std::uint64_t>(32 * 4 + 47));
    MESSAGE("GPU serving (KV " << std::string(triattn::dtype_name(kv)) << "): " << on.hits << " hits, prompt tokens computed "
                               << on.computed_prompt_tokens << " of " << on.prompt_tokens << ", peak blocks held "
                               << on.peak_blocks_held << " (off: " << off.peak_blocks_held << ")");
  }
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The tensor-parallel reference transformer on GPUs (examples/reference_transformer/tp_cuda.cuh):
// rank r in its own thread on device r, NCCL all-reduces after the attention output and MLP down
// projections, TriAttention rounds on the device (union agreement over NCCL).
//   gpu_multi (2 GPUs; fails with fewer, or without NCCL):
//   * same model, prompts and seed: tp 2 samples the same greedy tokens as tp 1 on GPU 0, and
//     every rank's keep plan row of local KV head g equals tp 1's row of global KV head
//     rank * Hkv / 2 + g, for every pruning mode and for f32 and bf16 KV caches
//   * DeviceDecoder (the benchmark's driver) on device-generated weight shards gives bitwise the
//     logits of Model<CudaBackend> on the host-sharded weights, both at tp 2
//   gpu (1 GPU):
//   * CudaBackend::generate_synthetic of a rank's shard equals shard_weights of the host model
// Rank threads use no doctest assertions (they collect, the test thread checks).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/stats/calibrator.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/cuda/tp/nccl_communicator.cuh>

#include "cuda_test_utils.cuh"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/cuda_device_model.cuh>
#include <reference_transformer/generate.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/synthetic.hpp>
#include <reference_transformer/tensor_parallel.hpp>
#include <reference_transformer/tp_cuda.cuh>

namespace ex = triattn_example;
using triattn::DType;
using triattn::PruningMode;
using triattn::SeqId;

namespace {

constexpr int kTp = 2;

/// Two GPUs and NCCL, or the test fails (never skips).
void require_two_devices() {
  triattn::test::require_device();
  int n = 0;
  TRIATTN_TEST_CUDA(cudaGetDeviceCount(&n));
  REQUIRE_MESSAGE(n >= kTp, "this test needs " << kTp << " GPUs, found " << n);
  REQUIRE_MESSAGE(triattn::cuda::NcclCommunicator::available(),
                  "NCCL is unavailable: " << triattn::cuda::NcclCommunicator::unavailable_reason());
}

/// 8 query / 4 KV heads of d = 64 (the GPU scoring kernels' head_dim), q/k/v biases.
ex::ModelConfig tp_config() {
  ex::ModelConfig c = ex::synthetic_config("tiny");
  c.name = "synthetic-gpu-tp";
  c.dim = 256;
  c.hidden_dim = 512;
  c.n_layers = 2;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.head_dim = 64;
  c.vocab_size = 512;
  c.rope_theta = 1e6;
  return c;
}

using triattn::test::cache_config;
using triattn::test::min_top2_margin;
using triattn::test::mode_name;
using triattn::test::prompt_tokens;

struct Round {
  SeqId seq = -1;
  triattn::KeepPlan plan;
};

/// What one rank (or tp 1) saw.
struct RankOut {
  std::vector<std::vector<int>> tokens;    // [prompt][generated]
  std::vector<std::vector<float>> logits;  // every sampled row, in sampling order
  std::vector<Round> rounds;               // in the order they ran
  std::size_t bytes_live = 0;
};

struct Setup {
  const ex::ModelWeights* weights = nullptr;
  triattn::SelectionParams sel;
  DType kv = DType::kF32;
  std::vector<std::vector<int>> prompts;
  int steps = 0;
};

/// Greedy generation with device rounds (cuda::DeviceRounds: device scores, selection and
/// compaction; the applied plan recorded), for tp 1 or one rank.
template <class ModelT>
RankOut run_compressed(const Setup& su, ModelT& model, ex::CudaBackend& be, const triattn::QueryStats& stats,
                       const std::function<void(ex::DeviceRounds&)>& attach = {}) {
  const ex::ModelConfig& mc = model.config();
  triattn::RopeConfig rope;
  rope.style = mc.rope_style;
  rope.theta = mc.rope_theta;
  ex::GpuTriCache cache(cache_config(mc, 64 + su.sel.budget + su.sel.divide_length, static_cast<int>(su.prompts.size()), 16, su.kv),
                        triattn::cuda::DeviceCompactor(be.stream()),
                        triattn::cuda::TriAttentionDeviceScorer(stats, rope, triattn::ScoringParams{}, mc.n_kv_heads, be.stream()),
                        triattn::TopKSelector(su.sel));
  std::vector<ex::Sampler> samplers(su.prompts.size());  // greedy
  ex::GenerationOptions opt;
  opt.max_new_tokens = su.steps;
  opt.stop_at_bos = false;
  ex::DeviceRounds rounds(cache);
  rounds.set_keep_plans(true);  // last_plan: the kept slots come back
  if (attach) attach(rounds);
  RankOut out;
  ex::GenerationCallbacks cb;
  cb.on_token = [&](int, int, std::int64_t, std::span<const float> l) { out.logits.emplace_back(l.begin(), l.end()); };
  cb.after_step = [&](std::span<const SeqId> live) {
    std::vector<SeqId> due;
    for (SeqId s : live)
      if (cache.needs_compression(s)) due.push_back(s);
    std::vector<triattn::CompressionReport> done;
    if (due.empty()) return done;
    rounds.launch(due, be.stream());  // union: agrees over NCCL
    done = rounds.wait();
    for (std::size_t b = 0; b < due.size(); ++b) {
      REQUIRE(done[b].status == triattn::RoundStatus::kCompressed);
      out.rounds.push_back(Round{due[b], rounds.last_plan(b)});
    }
    return done;
  };
  const auto res = ex::generate(model, cache, std::span<const std::vector<int>>(su.prompts),
                                std::span<ex::Sampler>(samplers), opt, cb);
  for (const auto& r : res) out.tokens.push_back(r.generated);
  out.bytes_live = cache.memory().bytes_live;
  be.synchronize();
  return out;
}

}  // namespace

TEST_SUITE("gpu_multi") {

TEST_CASE("GPU tensor parallel: tp 2 samples tp 1's greedy tokens and keeps its sets in every pruning mode") {
  require_two_devices();
  const ex::ModelConfig c = tp_config();
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 2024);
  // Statistics of the whole model from a CPU prefill; each rank scores with its slice.
  triattn::Calibrator cal(c.n_layers, c.n_heads, c.head_dim, c.rope_style, c.name);
  {
    ex::Model<> model(w);
    model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
    triattn::KvCache<> cache(cache_config(c, 256, 1, 16, DType::kF32));
    const std::vector<int> toks = prompt_tokens(256, 9, c.vocab_size);
    const ex::Chunk chunk{cache.add_sequence(), toks, triattn::Phase::kPrefill};
    (void)model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
  }
  const triattn::QueryStats stats = cal.finish();

  for (const DType kv : {DType::kF32, DType::kBF16}) {
    for (const PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
      INFO("KV " << std::string(triattn::dtype_name(kv)) << ", " << mode_name(mode));
      Setup su;
      su.weights = &w;
      su.kv = kv;
      su.sel.budget = 64;
      su.sel.divide_length = 16;
      su.sel.mode = mode;
      su.prompts = {prompt_tokens(5, 1, c.vocab_size), prompt_tokens(21, 2, c.vocab_size), prompt_tokens(12, 3, c.vocab_size)};
      su.steps = 160;  // rounds from cached length 80 on, every 16 steps: 6+ per sequence

      TRIATTN_TEST_CUDA(cudaSetDevice(0));
      RankOut ref;
      {
        ex::CudaBackend be;
        ex::Model<ex::CudaBackend> model(w, be);
        ref = run_compressed(su, model, be, stats);
      }
      std::vector<RankOut> ranks(kTp);
      ex::run_gpu_ranks(kTp, [&](int r, triattn::cuda::NcclCommunicator& comm) {
        ex::CudaBackend be;
        ex::attach_nccl(be, comm);
        ex::Model<ex::CudaBackend> model(w, ex::TpRank{r, kTp}, be);
        ranks[static_cast<std::size_t>(r)] =
            run_compressed(su, model, be, triattn::slice_for_rank(stats, r, kTp, c.n_kv_heads),
                           [&comm](ex::DeviceRounds& rounds) { ex::attach_nccl(rounds, comm); });
      });
      TRIATTN_TEST_CUDA(cudaSetDevice(0));

      REQUIRE(ref.rounds.size() >= 3 * 5);
      const int hkv = c.n_kv_heads / kTp;
      triattn::test::TpTally tally;
      for (int r = 0; r < kTp; ++r) {
        INFO("rank " << r);
        const RankOut& o = ranks[static_cast<std::size_t>(r)];
        triattn::test::compare_rank_with_single(o, ref, ranks[0], r, c.n_layers, hkv, tally);
        CHECK(o.bytes_live * kTp == ref.bytes_live);  // each rank caches half the KV heads
      }
      const int token_mismatch = tally.token_mismatch, plan_mismatch = tally.plan_mismatch, rows = tally.rows_compared;
      const float worst = tally.worst;
      const float margin = min_top2_margin(ref.logits);
      CHECK_MESSAGE(token_mismatch == 0, token_mismatch << " greedy tokens differ from tp 1 (smallest top-2 logit margin "
                                                        << margin << ", max |logit - tp 1| " << worst << ")");
      CHECK_MESSAGE(plan_mismatch == 0, plan_mismatch << " of " << rows << " (round, layer, KV head) keep rows differ from tp 1");
      MESSAGE("tp 2 vs tp 1 (KV " << triattn::dtype_name(kv) << ", " << mode_name(mode) << "): " << ref.rounds.size()
                                  << " rounds, " << rows << " keep rows compared, " << plan_mismatch << " differ; "
                                  << token_mismatch << " tokens differ; max |logit - tp 1| " << worst
                                  << ", smallest top-2 margin " << margin);
    }
  }
}

TEST_CASE("GPU tensor parallel: DeviceDecoder on device-generated shards gives Model's tp 2 logits bitwise") {
  require_two_devices();
  const ex::ModelConfig c = tp_config();
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 77);
  const std::vector<std::vector<int>> prompts = {prompt_tokens(19, 1, c.vocab_size), prompt_tokens(3, 2, c.vocab_size)};
  constexpr int kSteps = 12;
  std::vector<int> equal_steps(kTp, 0), argmax_equal(kTp, 0);
  ex::run_gpu_ranks(kTp, [&](int r, triattn::cuda::NcclCommunicator& comm) {
    ex::CudaBackend be;  // fp32 weights: the host shard uploaded and the device-generated one are the same bits
    ex::attach_nccl(be, comm);
    ex::Model<ex::CudaBackend> model(w, ex::TpRank{r, kTp}, be);
    ex::DeviceDecoder dec(c, be, be.generate_synthetic(c, 77, ex::TpRank{r, kTp}), ex::TpRank{r, kTp});
    const triattn::CacheConfig cfg = cache_config(model.config(), 64 + kSteps, 2, 16, DType::kBF16);
    ex::GpuPlainCache ca(cfg, triattn::cuda::DeviceCompactor(be.stream()));
    ex::GpuPlainCache cb(cfg, triattn::cuda::DeviceCompactor(be.stream()));
    std::vector<SeqId> ia, ib;
    for (const auto& p : prompts) {
      ia.push_back(ca.add_sequence());
      ib.push_back(cb.add_sequence());
      const ex::Chunk x{ia.back(), p, triattn::Phase::kPrefill}, y{ib.back(), p, triattn::Phase::kPrefill};
      (void)model.step(ca, std::span<const ex::Chunk>(&x, 1));
      (void)model.step(cb, std::span<const ex::Chunk>(&y, 1));
    }
    std::vector<int> tok(prompts.size());
    for (int s = 0; s < kSteps; ++s) {
      std::vector<ex::Chunk> chunks;
      for (std::size_t i = 0; i < prompts.size(); ++i) {
        tok[i] = (s * 29 + static_cast<int>(i) * 3 + 1) % c.vocab_size;
        chunks.push_back(ex::Chunk{ia[i], std::span<const int>(&tok[i], 1), triattn::Phase::kDecode});
      }
      const ex::StepOutput out = model.step(ca, chunks);
      dec.step(cb, ib, tok);
      equal_steps[static_cast<std::size_t>(r)] += dec.logits_host() == out.logits;
      const std::vector<int> am = dec.argmax();
      bool same = true;
      for (std::size_t i = 0; i < prompts.size(); ++i) same = same && am[i] == ex::Sampler::argmax(out.row(static_cast<int>(i)));
      argmax_equal[static_cast<std::size_t>(r)] += same;
    }
    be.synchronize();
  });
  TRIATTN_TEST_CUDA(cudaSetDevice(0));
  for (int r = 0; r < kTp; ++r) {
    INFO("rank " << r);
    CHECK(equal_steps[static_cast<std::size_t>(r)] == kSteps);
    CHECK(argmax_equal[static_cast<std::size_t>(r)] == kSteps);
  }
}

}  // TEST_SUITE

TEST_SUITE("gpu") {

TEST_CASE("CudaBackend::generate_synthetic of a rank's shard equals shard_weights of the host model") {
  triattn::test::require_device();
  const ex::ModelConfig c = tp_config();
  const ex::ModelWeights full = ex::make_synthetic_weights(c, 5);
  for (int tp : {1, 2, 4}) {
    for (int r = 0; r < tp; ++r) {
      INFO("tp " << tp << ", rank " << r);
      const ex::ModelWeights host = ex::shard_weights(full, ex::TpRank{r, tp});
      ex::CudaBackend be;  // fp32: the device pointers are the tensors
      const ex::CudaBackend::WeightStore ws = be.generate_synthetic(c, 5, ex::TpRank{r, tp});
      const ex::WeightPtrs& p = ws.ptrs();
      auto same = [&](const float* dev, const std::vector<float>& want) {
        std::vector<float> got(want.size());
        TRIATTN_TEST_CUDA(cudaMemcpy(got.data(), dev, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
        return got == want;
      };
      CHECK(same(p.tok_emb, host.tok_emb));
      CHECK(same(p.rms_att, host.rms_att));
      CHECK(same(p.wq, host.wq));
      CHECK(same(p.wk, host.wk));
      CHECK(same(p.wv, host.wv));
      CHECK(same(p.wo, host.wo));
      CHECK(same(p.rms_ffn, host.rms_ffn));
      CHECK(same(p.w1, host.w1));
      CHECK(same(p.w2, host.w2));
      CHECK(same(p.w3, host.w3));
      CHECK(same(p.rms_final, host.rms_final));
      CHECK(same(p.wcls, host.wcls));
      CHECK(same(p.bq, host.bq));
      CHECK(same(p.bk, host.bk));
      CHECK(same(p.bv, host.bv));
    }
  }
}

}  // TEST_SUITE

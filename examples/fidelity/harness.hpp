// SPDX-License-Identifier: Apache-2.0
// Model runs of the fidelity harness (examples/fidelity): the full-KV reference run, a run of
// one sequence with a compressing cache (teacher-forced on the reference tokens, or free-running
// greedy), and calibration. Header-only so tests/core/test_fidelity_harness.cpp can drive it
// with a tiny synthetic model.
//
// Pass numbering (one pass = one forward step of the sequence): pass 0 is the prefill of the P
// prompt tokens and yields the logits of generated token g_0; pass i >= 1 feeds g_{i-1} at
// logical position P + i − 1 and yields the logits of g_i. After every pass the harness runs a
// compression round when the cache's trigger fires (budget + divide_length reached on a decode
// step), exactly as KvCache::compress does (score, select, apply_keep_plan), but keeping the
// KeepPlan so that the original position of every cached slot is known (PositionTracker).
// A pass "counts" once at least one round ran before it: passes i > first_round_pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/rope.hpp>
#include <triattn/core/stats/calibrator.hpp>

#include <reference_transformer/backend.hpp>
#include <reference_transformer/cpu_backend.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include "metrics.hpp"

namespace triattn_fidelity {

namespace ex = triattn_example;

/// A host cache without compression (the full-KV reference).
using PlainCache = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor>;
/// A host cache compressed by `Scorer` and the spec's TopKSelector.
template <class Scorer>
using HostCache =
    triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor, Scorer, triattn::TopKSelector>;

/// How a cache stores K/V: its dtype and, for fp8, the per-layer dequantisation scales
/// ([num_layers, 2 (K, V)], CacheConfig::kv_scales; empty means 1).
struct KvFormat {
  triattn::DType dtype = triattn::DType::kF32;
  std::vector<float> scales;
};

/// NHD cache in `kv`'s format (float32 by default) for `max_seqs` sequences of up to
/// `max_tokens` cached tokens each.
inline triattn::CacheConfig cache_config(const ex::ModelConfig& mc, int max_seqs, int max_tokens, int block_size = 16,
                                         const KvFormat& kv = {}) {
  triattn::CacheConfig cfg;
  cfg.model = mc.geometry();
  cfg.block_size = block_size;
  cfg.dtype = kv.dtype;
  cfg.kv_scales = kv.scales;
  cfg.layout = triattn::KvLayout::kNHD;
  cfg.max_seqs = max_seqs;
  cfg.max_blocks_per_seq = (max_tokens + block_size - 1) / block_size + 1;
  cfg.num_blocks = cfg.max_blocks_per_seq * max_seqs;
  return cfg;
}

/// Rotates pre-RoPE queries to post-RoPE exactly as the model's CPU backend does (same tables,
/// same function), for scorers that want post-RoPE queries (SnapKvScorer::observe).
class QueryRotator {
 public:
  explicit QueryRotator(const ex::ModelConfig& mc) : n_heads_(mc.n_heads), head_dim_(mc.head_dim) {
    triattn::RopeConfig rc;
    rc.style = mc.rope_style;
    rc.theta = mc.rope_theta;
    tables_.style = mc.rope_style;
    tables_.f32_angles = mc.rope_f32_angles;
    tables_.inv_freq = triattn::rope_inv_freq(mc.head_dim, rc);
    tables_.inv_freq_f32 = triattn::rope_inv_freq_f32(mc.head_dim, static_cast<float>(mc.rope_theta));
  }
  /// q: [n, n_heads, head_dim] in place; row r is at logical position p0 + r.
  void rotate(float* q, int n, std::int64_t p0) {
    rows_.resize(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) rows_[static_cast<std::size_t>(r)] = ex::TokenInfo{0, r, p0 + r};
    backend_.rope(q, n, n_heads_, head_dim_, rows_, tables_);
  }

 private:
  int n_heads_, head_dim_;
  ex::RopeTables tables_;
  ex::CpuBackend backend_;
  std::vector<ex::TokenInfo> rows_;
};

/// Largest |K| and |V| (dequantised) that `seq` holds per layer, [num_layers, 2 (K, V)]: what an
/// engine measures on calibration data to choose fp8 scales.
template <class Cache>
std::vector<float> kv_abs_max(const Cache& cache, triattn::SeqId seq) {
  const triattn::ModelGeometry& g = cache.config().model;
  std::vector<float> out(static_cast<std::size_t>(g.num_layers) * 2, 0.0f);
  const int len = cache.physical_length(seq);
  triattn::dispatch_dtype(cache.config().dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto view = cache.template view<T>();
    for (int l = 0; l < g.num_layers; ++l)
      for (int kind = 0; kind < 2; ++kind) {
        const auto kk = kind == 0 ? triattn::KvKind::kKey : triattn::KvKind::kValue;
        float& m = out[static_cast<std::size_t>(l) * 2 + static_cast<std::size_t>(kind)];
        for (int h = 0; h < g.num_kv_heads; ++h) {
          const float s = view.scale(l, kk, h);
          for (int t = 0; t < len; ++t) {
            const T* x = view.token(l, kk, seq, t, h);
            for (int i = 0; i < g.head_dim; ++i) m = std::max(m, std::abs(triattn::dequantize(x[i], s)));
          }
        }
      }
  });
  return out;
}

/// Per-layer fp8 e4m3 scales from measured maxima ([num_layers, 2] of kv_abs_max): amax *
/// headroom / 448, so values up to `headroom` times the largest calibration value stay below
/// e4m3's largest finite code instead of saturating (a zero maximum gives 1). A power-of-two
/// headroom leaves the rounding of every value in e4m3's normal range unchanged.
inline std::vector<float> fp8_scales_from_amax(std::span<const float> amax, float headroom = 1.0f) {
  TRIATTN_EXPECTS(std::isfinite(headroom) && headroom >= 1.0f,
                  "fp8_scales_from_amax: headroom " + std::to_string(headroom) + " must be finite and >= 1");
  std::vector<float> out(amax.size());
  for (std::size_t i = 0; i < amax.size(); ++i) {
    TRIATTN_EXPECTS(std::isfinite(amax[i]) && amax[i] >= 0.0f, "fp8_scales_from_amax: amax[" + std::to_string(i) +
                                                                   "] = " + std::to_string(amax[i]) + " is not finite and >= 0");
    out[i] = amax[i] > 0.0f ? amax[i] * headroom / 448.0f : 1.0f;
  }
  return out;
}

/// The full-KV reference of one prompt: its greedy continuation, every pass's logits and the
/// attention probabilities of every decode query over all earlier tokens.
struct FullRun {
  std::vector<int> prompt;
  std::vector<int> generated;              ///< g_0 .. g_{G-1} (greedy, no stop token)
  std::vector<std::vector<float>> logits;  ///< [G][vocab]: logits of pass i (g_i = argmax)
  /// [G][L * Hq * (P + i)] for i >= 1: the softmax of pass i's query (position P + i − 1) over
  /// token positions 0 .. P + i − 1, per layer and query head; [0] is empty (prefill).
  std::vector<std::vector<float>> probs;
};

/// Runs `prompt` with an uncompressed cache for G generated tokens (greedy, BOS/EOS do not stop
/// it), recording logits and decode attention.
template <class ModelT>
FullRun run_full(ModelT& model, std::span<const int> prompt, int G) {
  TRIATTN_EXPECTS(!prompt.empty() && G >= 1, "run_full: need a prompt and G >= 1");
  const ex::ModelConfig& mc = model.config();
  const int P = static_cast<int>(prompt.size());
  PlainCache cache(cache_config(mc, 1, P + G));
  const triattn::SeqId seq = cache.add_sequence();
  FullRun run;
  run.prompt.assign(prompt.begin(), prompt.end());
  run.probs.resize(static_cast<std::size_t>(G));
  std::vector<float>* sink = nullptr;  // where the current decode pass's attention goes
  int T = 0;
  model.set_attention_observer([&](int layer, int, triattn::SeqId, int h, std::span<const float> p) {
    if (sink == nullptr) return;
    TRIATTN_EXPECTS(static_cast<int>(p.size()) == T, "run_full: attention row of unexpected length");
    float* dst = sink->data() + (static_cast<std::size_t>(layer) * mc.n_heads + h) * static_cast<std::size_t>(T);
    for (std::size_t j = 0; j < p.size(); ++j) dst[j] = p[j];
  });
  ex::Chunk ch{seq, prompt, triattn::Phase::kPrefill};
  ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&ch, 1));
  run.logits.emplace_back(out.logits.begin(), out.logits.end());
  run.generated.push_back(ex::Sampler::argmax(out.row(0)));
  for (int i = 1; i < G; ++i) {
    T = P + i;
    std::vector<float>& buf = run.probs[static_cast<std::size_t>(i)];
    buf.assign(static_cast<std::size_t>(mc.n_layers) * mc.n_heads * static_cast<std::size_t>(T), 0.0f);
    sink = &buf;
    const int tok = run.generated.back();
    ch = ex::Chunk{seq, std::span<const int>(&tok, 1), triattn::Phase::kDecode};
    out = model.step(cache, std::span<const ex::Chunk>(&ch, 1));
    sink = nullptr;
    run.logits.emplace_back(out.logits.begin(), out.logits.end());
    run.generated.push_back(ex::Sampler::argmax(out.row(0)));
  }
  model.set_attention_observer({});
  cache.release(seq);
  return run;
}

/// One compression round of `seq`, as KvCache::compress runs it (score every cached key at the
/// round start t0 = logical position, select with the cache's selector, compact), returning the
/// plan that was applied.
template <class Cache>
triattn::KeepPlan compress_round(Cache& cache, triattn::SeqId seq, std::vector<float>& scores) {
  const triattn::ModelGeometry& g = cache.config().model;
  const int len = cache.physical_length(seq);
  scores.resize(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * static_cast<std::size_t>(len));
  triattn::dispatch_dtype(cache.config().dtype, [&](auto tag) {  // the scorer dequantises bf16 / fp8 itself
    cache.scorer().score(cache.template view<typename decltype(tag)::type>(), seq, len, cache.logical_position(seq),
                         std::span<float>(scores));
  });
  triattn::KeepPlan plan = cache.selector().select(std::span<const float>(scores), g, len, cache.prompt_length(seq));
  cache.apply_keep_plan(seq, plan);
  return plan;
}

/// What one compressed run of one prompt produced.
struct PolicyRun {
  std::vector<int> generated;    ///< teacher-forced: the reference tokens; free: its own greedy tokens
  int first_round_pass = -1;     ///< pass after which the first round ran; -1 when none did
  int rounds = 0;
  std::int64_t evicted = 0;      ///< tokens dropped over all rounds
  int max_kept = 0;              ///< largest cache length right after a round (the budget, unless protected tokens exceed it)
  // Teacher-forced runs only, one entry per counted pass (i > first_round_pass):
  std::vector<double> recall;    ///< attention_recall of the full-KV query of pass i
  std::vector<double> kl;        ///< KL(full || compressed) of pass i's next-token distribution
  int tf_top1_matches = 0;       ///< counted passes whose compressed argmax equals the reference token
  std::vector<double> recency_overlap;  ///< per round: recency_overlap() of its plan
};

/// Runs the reference's prompt through `cache` (one sequence, opened and released here) for as
/// many passes as the reference has tokens. teacher_forced: feeds the reference tokens and
/// measures recall, KL and top-1 agreement per counted pass; otherwise generates greedily.
/// Scorers with an observe() (SnapKV) get every token's post-RoPE query for every layer.
template <class ModelT, class Cache>
PolicyRun run_policy(ModelT& model, Cache& cache, const FullRun& full, bool teacher_forced) {
  const ex::ModelConfig& mc = model.config();
  const int P = static_cast<int>(full.prompt.size());
  const int G = static_cast<int>(full.generated.size());
  const triattn::SeqId seq = cache.add_sequence();
  PositionTracker held(mc.n_layers, mc.n_kv_heads);
  std::vector<float> scores;
  std::int64_t p0 = 0;  // logical position of the current pass's first token
  QueryRotator rotator(mc);
  std::vector<float> qbuf;
  if constexpr (requires(Cache& c, const float* q) { c.scorer().observe(triattn::SeqId{}, 0, q, std::int64_t{0}); }) {
    model.set_query_observer([&](int layer, const float* q, int n) {
      const std::size_t qs = static_cast<std::size_t>(mc.n_heads) * mc.head_dim;
      qbuf.assign(q, q + static_cast<std::size_t>(n) * qs);
      rotator.rotate(qbuf.data(), n, p0);
      for (int r = 0; r < n; ++r) cache.scorer().observe(seq, layer, qbuf.data() + static_cast<std::size_t>(r) * qs, p0 + r);
    });
  }
  PolicyRun run;
  auto maybe_round = [&](int pass) {
    if (!cache.needs_compression(seq)) return;
    const int before = cache.physical_length(seq);
    const int pinned = cache.prompt_length(seq);
    const triattn::KeepPlan plan = compress_round(cache, seq, scores);
    run.recency_overlap.push_back(recency_overlap(plan, before, pinned));
    held.apply(plan);
    TRIATTN_EXPECTS(held.length() == cache.physical_length(seq), "run_policy: position tracker out of step");
    run.evicted += before - cache.physical_length(seq);
    run.max_kept = std::max(run.max_kept, cache.physical_length(seq));
    if (run.rounds++ == 0) run.first_round_pass = pass;
  };
  auto next_token = [&](int pass, std::span<const float> logits) {
    const int mine = ex::Sampler::argmax(logits);
    if (!teacher_forced) return mine;
    if (run.rounds > 0 && mine == full.generated[static_cast<std::size_t>(pass)]) ++run.tf_top1_matches;
    return full.generated[static_cast<std::size_t>(pass)];
  };

  ex::Chunk ch{seq, full.prompt, triattn::Phase::kPrefill};
  ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&ch, 1));
  held.append(0, P);
  run.generated.push_back(next_token(0, out.row(0)));
  maybe_round(0);
  for (int i = 1; i < G; ++i) {
    p0 = P + i - 1;
    const int tok = run.generated.back();
    ch = ex::Chunk{seq, std::span<const int>(&tok, 1), triattn::Phase::kDecode};
    out = model.step(cache, std::span<const ex::Chunk>(&ch, 1));
    held.append(p0, 1);
    if (teacher_forced && run.rounds > 0) {
      run.recall.push_back(attention_recall(full.probs[static_cast<std::size_t>(i)], mc.n_heads, P + i, held));
      run.kl.push_back(kl_divergence(full.logits[static_cast<std::size_t>(i)], out.row(0)));
    }
    run.generated.push_back(next_token(i, out.row(0)));
    maybe_round(i);
  }
  model.set_query_observer({});
  cache.release(seq);
  return run;
}

/// Feeds the pre-RoPE queries of every token of `prompts` and of G sampled continuations
/// (temperature / top-p sampling, seeded per prompt) to `cal`. Returns the tokens per layer.
template <class ModelT>
std::int64_t calibrate(ModelT& model, triattn::Calibrator& cal, std::span<const std::vector<int>> prompts, int G,
                       float temperature, float top_p, std::uint64_t seed) {
  const ex::ModelConfig& mc = model.config();
  model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
  for (std::size_t k = 0; k < prompts.size(); ++k) {
    const std::vector<int>& prompt = prompts[k];
    PlainCache cache(cache_config(mc, 1, static_cast<int>(prompt.size()) + G));
    const triattn::SeqId seq = cache.add_sequence();
    ex::Sampler sampler(temperature, top_p, seed + k);
    ex::Chunk ch{seq, prompt, triattn::Phase::kPrefill};
    ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&ch, 1));
    int tok = sampler.sample(out.row(0));
    for (int i = 1; i < G; ++i) {
      ch = ex::Chunk{seq, std::span<const int>(&tok, 1), triattn::Phase::kDecode};
      out = model.step(cache, std::span<const ex::Chunk>(&ch, 1));
      tok = sampler.sample(out.row(0));
    }
    cache.release(seq);
  }
  model.set_query_observer({});
  return cal.token_count(0);
}

}  // namespace triattn_fidelity

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// Tests of the fidelity harness (examples/fidelity): the metric arithmetic (KL, attention
// recall, greedy agreement, position tracking through keep plans) and, on the synthetic 'tiny'
// model, that its runs measure what they claim: recall 1 and KL 0 when nothing is evicted, the
// tracked positions of kept slots are the tokens really in the cache, and the post-RoPE queries
// given to SnapKV are the ones attention uses. Long-document runs (document.hpp): chunked
// teacher forcing equals token-by-token, rounds fall where single steps put them, recall
// ignores later rows of a chunk, and caches in bf16 / fp8 KV run against a bf16 reference (bf16
// without eviction is exact, fp8 finite, rounds on the fp8 cache); fp8 scales from K/V maxima.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/policy/key_norm_scorer.hpp>
#include <triattn/core/policy/recency_scorer.hpp>
#include <triattn/core/policy/snapkv_scorer.hpp>
#include <triattn/core/policy/topk_selector.hpp>

#include <fidelity/document.hpp>
#include <fidelity/harness.hpp>
#include <fidelity/metrics.hpp>
#include <reference_transformer/synthetic.hpp>

namespace ex = triattn_example;
namespace fid = triattn_fidelity;

namespace {

triattn::KeepPlan plan_from(int L, int H, const std::vector<std::vector<std::int32_t>>& rows) {
  triattn::KeepPlan p(L, H, static_cast<int>(rows.front().size()));
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const auto& r = rows[static_cast<std::size_t>(l * H + h)];
      for (std::size_t i = 0; i < r.size(); ++i) p.row(l, h)[i] = r[i];
    }
  return p;
}

std::vector<std::int64_t> as_vec(std::span<const std::int64_t> s) { return {s.begin(), s.end()}; }

}  // namespace

TEST_SUITE("fidelity") {

TEST_CASE("KL divergence: zero for identical logits and a known value and shift invariance") {
  const std::vector<float> a = {0.5f, -1.0f, 2.0f, 0.0f};
  CHECK(fid::kl_divergence(a, a) == 0.0);
  std::vector<float> shifted = a;
  for (float& x : shifted) x += 3.0f;  // softmax is shift invariant
  CHECK(fid::kl_divergence(a, shifted) == doctest::Approx(0.0).epsilon(1e-12));
  // P = (1/2, 1/2), Q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
  const std::vector<float> p = {0.0f, 0.0f}, q = {static_cast<float>(std::log(3.0)), 0.0f};
  CHECK(fid::kl_divergence(p, q) == doctest::Approx(0.5 * std::log(4.0 / 3.0)).epsilon(1e-6));
  CHECK(fid::kl_divergence(q, p) > 0.0);
  CHECK_THROWS((void)fid::kl_divergence(p, a));
}

TEST_CASE("greedy agreement arithmetic") {
  const std::vector<int> ref = {1, 2, 3, 4, 5};
  const fid::Agreement same = fid::greedy_agreement(ref, ref, 0);
  CHECK(same.matches == 5);
  CHECK(same.counted == 5);
  CHECK(same.fraction() == 1.0);
  CHECK(same.first_divergence == 5);
  CHECK_FALSE(same.diverged(5));

  const std::vector<int> test = {1, 2, 9, 4, 7};
  const fid::Agreement a = fid::greedy_agreement(ref, test, 1);  // indices 1..4: 2 of 4 equal
  CHECK(a.counted == 4);
  CHECK(a.matches == 2);
  CHECK(a.fraction() == 0.5);
  CHECK(a.first_divergence == 2);
  CHECK(a.diverged(5));

  const fid::Agreement none = fid::greedy_agreement(ref, test, 5);  // nothing counted
  CHECK(none.counted == 0);
  CHECK(none.fraction() == 1.0);
  CHECK(none.first_divergence == 2);  // divergence is over the whole stream
  CHECK_THROWS((void)fid::greedy_agreement(ref, std::vector<int>{1, 2}, 0));
}

TEST_CASE("mean / median / standard error") {
  CHECK(fid::mean(std::vector<double>{1, 2, 6}) == 3.0);
  CHECK(fid::median(std::vector<double>{5, 1, 3}) == 3.0);
  CHECK(fid::median(std::vector<double>{4, 1, 3, 2}) == 2.5);
  CHECK(std::isnan(fid::mean(std::vector<double>{})));
  CHECK(std::isnan(fid::median(std::vector<double>{})));
  // values 1, 2, 3, 6: mean 3, sample variance (4 + 1 + 0 + 9) / 3 = 14/3, SE = sqrt(14/3 / 4).
  CHECK(fid::standard_error(std::vector<double>{1, 2, 3, 6}) == doctest::Approx(std::sqrt(14.0 / 12.0)));
  CHECK(std::isnan(fid::standard_error(std::vector<double>{1})));
}

TEST_CASE("PositionTracker follows appends and keep plans per layer and KV head") {
  fid::PositionTracker t(2, 2);
  t.append(0, 6);  // positions 0..5
  CHECK(t.length() == 6);
  // Each row keeps a different set (per_layer_per_head style).
  t.apply(plan_from(2, 2, {{0, 1, 4}, {0, 2, 5}, {1, 3, 5}, {0, 4, 5}}));
  CHECK(as_vec(t.row(0, 0)) == std::vector<std::int64_t>{0, 1, 4});
  CHECK(as_vec(t.row(0, 1)) == std::vector<std::int64_t>{0, 2, 5});
  CHECK(as_vec(t.row(1, 0)) == std::vector<std::int64_t>{1, 3, 5});
  t.append(6, 2);
  CHECK(as_vec(t.row(1, 1)) == std::vector<std::int64_t>{0, 4, 5, 6, 7});
  // A second round indexes the compacted slots, not the original positions.
  t.apply(plan_from(2, 2, {{0, 3, 4}, {1, 2, 4}, {0, 1, 2}, {2, 3, 4}}));
  CHECK(as_vec(t.row(0, 0)) == std::vector<std::int64_t>{0, 6, 7});
  CHECK(as_vec(t.row(0, 1)) == std::vector<std::int64_t>{2, 5, 7});
  CHECK(as_vec(t.row(1, 0)) == std::vector<std::int64_t>{1, 3, 5});
  CHECK(as_vec(t.row(1, 1)) == std::vector<std::int64_t>{5, 6, 7});
  CHECK_THROWS(t.apply(plan_from(2, 2, {{0, 9}, {0, 1}, {0, 1}, {0, 1}})));  // slot out of range
  CHECK(t.length() == 3);                                                    // unchanged
}

TEST_CASE("recency overlap of a keep plan") {
  // 10 slots before the round, 2 pinned, keep 5: StreamingLLM keeps {0, 1, 7, 8, 9}.
  CHECK(fid::recency_overlap(plan_from(1, 2, {{0, 1, 7, 8, 9}, {0, 1, 7, 8, 9}}), 10, 2) == 1.0);
  CHECK(fid::recency_overlap(plan_from(1, 2, {{0, 1, 2, 3, 4}, {0, 1, 7, 8, 9}}), 10, 2) == doctest::Approx(0.7));
  CHECK(fid::recency_overlap(plan_from(1, 1, {{0, 1, 2, 3, 9}}), 10, 2) == doctest::Approx(0.6));
  CHECK_THROWS((void)fid::recency_overlap(plan_from(1, 1, {{0, 1}}), 10, 3));  // pinned > keep
}

TEST_CASE("attention recall: 1 when everything is held and the share of mass otherwise") {
  const int L = 2, Hq = 4, T = 5;  // 2 KV heads, groups of 2
  std::vector<float> probs(static_cast<std::size_t>(L * Hq * T), 1.0f / T);
  fid::PositionTracker all(L, 2);
  all.append(0, T);
  CHECK(fid::attention_recall(probs, Hq, T, all) == doctest::Approx(1.0));
  fid::PositionTracker some(L, 2);
  some.append(0, T);
  some.apply(plan_from(L, 2, {{0, 4}, {1, 2}, {0, 1}, {3, 4}}));
  CHECK(fid::attention_recall(probs, Hq, T, some) == doctest::Approx(2.0 / T));
  // All mass on position 4: held by (l0, g0) and (l1, g1) only, i.e. half of the (l, h) pairs.
  std::fill(probs.begin(), probs.end(), 0.0f);
  for (int r = 0; r < L * Hq; ++r) probs[static_cast<std::size_t>(r * T + 4)] = 1.0f;
  CHECK(fid::attention_recall(probs, Hq, T, some) == doctest::Approx(0.5));
  CHECK_THROWS((void)fid::attention_recall(probs, 3, T, some));  // 3 q heads on 2 kv heads
}

TEST_CASE("harness on the tiny model: nothing evicted gives recall 1 and KL 0 and full agreement") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 42);
  ex::Model<ex::CpuBackend> model(w);
  const std::vector<int> prompt = {1, 40, 41, 42, 43, 44};
  const int G = 40;
  const fid::FullRun full = fid::run_full(model, prompt, G);
  REQUIRE(full.generated.size() == static_cast<std::size_t>(G));
  REQUIRE(full.logits.size() == static_cast<std::size_t>(G));
  // Every decode query's attention over all earlier tokens sums to 1 per (layer, head).
  const ex::ModelConfig& mc = model.config();
  const std::vector<float>& pr = full.probs[10];
  REQUIRE(pr.size() == static_cast<std::size_t>(mc.n_layers * mc.n_heads * (static_cast<int>(prompt.size()) + 10)));

  // A budget above the run's length: no round fires, nothing is evicted. (Identity rounds through
  // a window longer than the budget are refused by SelectionParams::validate: sinks + window must
  // fit the budget, so a due round always evicts.)
  triattn::SelectionParams sel;
  sel.budget = static_cast<int>(prompt.size()) + G + 8;
  sel.divide_length = 4;
  const triattn::CacheConfig cfg = fid::cache_config(mc, 1, static_cast<int>(prompt.size()) + G);
  fid::HostCache<triattn::KeyNormScorer> tf_cache(cfg, triattn::TopKSelector(sel));
  const fid::PolicyRun tf = fid::run_policy(model, tf_cache, full, true);
  CHECK(tf.rounds == 0);
  CHECK(tf.evicted == 0);
  CHECK(tf.first_round_pass == -1);
  CHECK(tf.recall.empty());

  fid::HostCache<triattn::KeyNormScorer> fr_cache(cfg, triattn::TopKSelector(sel));
  const fid::PolicyRun fr = fid::run_policy(model, fr_cache, full, false);
  CHECK(fr.generated == full.generated);
  const fid::Agreement a = fid::greedy_agreement(full.generated, fr.generated, fr.first_round_pass + 1);
  CHECK(a.fraction() == 1.0);
  CHECK(a.first_divergence == G);
}

TEST_CASE("harness on the tiny model: tracked positions are the tokens the compressed cache holds") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 42);
  ex::Model<ex::CpuBackend> model(w);
  const ex::ModelConfig& mc = model.config();
  const std::vector<int> prompt = {1, 70, 71, 72};
  const int G = 48, P = static_cast<int>(prompt.size());
  const fid::FullRun full = fid::run_full(model, prompt, G);

  // Reference layer-0 keys by position (layer 0's K depends only on token and position, so the
  // teacher-forced compressed run computes the same values bit for bit).
  fid::PlainCache ref(fid::cache_config(mc, 1, P + G));
  const triattn::SeqId rs = ref.add_sequence();
  std::vector<int> seq_tokens = prompt;
  seq_tokens.insert(seq_tokens.end(), full.generated.begin(), full.generated.end() - 1);
  ex::Chunk all{rs, seq_tokens, triattn::Phase::kPrefill};
  (void)model.step(ref, std::span<const ex::Chunk>(&all, 1), ex::LogitsFor::kNone);

  // Per-layer-per-head key-norm selection: every (layer, KV head) keeps a different set.
  triattn::SelectionParams sel;
  sel.budget = 12;
  sel.divide_length = 5;
  sel.mode = triattn::PruningMode::kPerLayerPerHead;
  fid::HostCache<triattn::KeyNormScorer> cache(fid::cache_config(mc, 1, P + G), triattn::TopKSelector(sel));
  const triattn::SeqId s = cache.add_sequence();
  fid::PositionTracker held(mc.n_layers, mc.n_kv_heads);
  std::vector<float> scratch;
  ex::Chunk ch{s, prompt, triattn::Phase::kPrefill};
  (void)model.step(cache, std::span<const ex::Chunk>(&ch, 1));
  held.append(0, P);
  int rounds = 0;
  bool rows_differ = false;
  for (int i = 1; i < G; ++i) {
    const int tok = full.generated[static_cast<std::size_t>(i - 1)];
    ch = ex::Chunk{s, std::span<const int>(&tok, 1), triattn::Phase::kDecode};
    (void)model.step(cache, std::span<const ex::Chunk>(&ch, 1));
    held.append(P + i - 1, 1);
    if (cache.needs_compression(s)) {
      held.apply(fid::compress_round(cache, s, scratch));
      ++rounds;
    }
    REQUIRE(held.length() == cache.physical_length(s));
    const auto kv = cache.view<float>();
    const auto rv = ref.view<float>();
    for (int g = 0; g < mc.n_kv_heads; ++g) {
      const auto row = held.row(0, g);
      for (int slot = 0; slot < held.length(); ++slot) {
        const float* k = kv.token(0, triattn::KvKind::kKey, s, slot, g);
        const float* kr = rv.token(0, triattn::KvKind::kKey, rs, static_cast<int>(row[static_cast<std::size_t>(slot)]), g);
        for (int e = 0; e < mc.head_dim; ++e) REQUIRE(k[e] == kr[e]);
      }
      for (int slot = 0; slot < P; ++slot) CHECK(row[static_cast<std::size_t>(slot)] == slot);  // pinned prompt
      if (as_vec(row) != as_vec(held.row(mc.n_layers - 1, g))) rows_differ = true;
    }
  }
  CHECK(rounds >= 3);
  CHECK(rows_differ);  // the test exercised distinct per-(layer, head) sets
  cache.release(s);
  ref.release(rs);
}

TEST_CASE("harness on the tiny model: SnapKV gets the post-RoPE queries attention uses") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 42);
  ex::Model<ex::CpuBackend> model(w);
  const ex::ModelConfig& mc = model.config();
  const std::vector<int> prompt = {1, 7, 8, 9, 10};
  const int P = static_cast<int>(prompt.size()), d = mc.head_dim, G = mc.group_size();

  // One decode step: capture layer 0's pre-RoPE query and its attention probabilities.
  fid::PlainCache cache(fid::cache_config(mc, 1, P + 1));
  const triattn::SeqId s = cache.add_sequence();
  ex::Chunk ch{s, prompt, triattn::Phase::kPrefill};
  (void)model.step(cache, std::span<const ex::Chunk>(&ch, 1));
  std::vector<float> q;
  std::vector<std::vector<float>> probs(static_cast<std::size_t>(mc.n_heads));
  model.set_query_observer([&](int layer, const float* x, int n) {
    if (layer == 0) q.assign(x, x + static_cast<std::size_t>(n) * mc.n_heads * d);
  });
  model.set_attention_observer([&](int layer, int, triattn::SeqId, int h, std::span<const float> p) {
    if (layer == 0) probs[static_cast<std::size_t>(h)].assign(p.begin(), p.end());
  });
  const int tok = 33;
  ch = ex::Chunk{s, std::span<const int>(&tok, 1), triattn::Phase::kDecode};
  (void)model.step(cache, std::span<const ex::Chunk>(&ch, 1));
  model.set_query_observer({});
  model.set_attention_observer({});

  fid::QueryRotator rot(mc);
  rot.rotate(q.data(), 1, P);
  const auto view = cache.view<float>();
  for (int h = 0; h < mc.n_heads; ++h) {
    std::vector<double> logit(static_cast<std::size_t>(P + 1));
    double mx = -1e300, sum = 0.0;
    for (int t = 0; t <= P; ++t) {
      const float* k = view.token(0, triattn::KvKind::kKey, s, t, h / G);
      double dot = 0.0;
      for (int e = 0; e < d; ++e) dot += static_cast<double>(q[static_cast<std::size_t>(h * d + e)]) * k[e];
      logit[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(d));
      mx = std::max(mx, logit[static_cast<std::size_t>(t)]);
    }
    for (double& x : logit) sum += (x = std::exp(x - mx));
    for (int t = 0; t <= P; ++t)
      CHECK(probs[static_cast<std::size_t>(h)][static_cast<std::size_t>(t)] ==
            doctest::Approx(logit[static_cast<std::size_t>(t)] / sum).epsilon(1e-4));
  }
  cache.release(s);

  // And a SnapKV run through run_policy observes every layer (score() would throw otherwise).
  const fid::FullRun full = fid::run_full(model, prompt, 40);
  triattn::SelectionParams sel;
  sel.budget = 16;
  sel.divide_length = 8;
  const triattn::CacheConfig cfg = fid::cache_config(mc, 1, P + 40);
  fid::HostCache<triattn::SnapKvScorer> snap(cfg, triattn::TopKSelector(sel),
                                              triattn::SnapKvScorer(cfg, triattn::SnapKvParams{8, 3}));
  const fid::PolicyRun r = fid::run_policy(model, snap, full, true);
  CHECK(r.rounds >= 3);
  CHECK(r.evicted > 0);
  CHECK(r.max_kept == sel.budget);
  for (double x : r.recall) {
    CHECK(x > 0.0);
    CHECK(x <= 1.0 + 1e-6);
  }
}


TEST_CASE("causal attention recall: later rows of the chunk carry no mass and held positions count") {
  // 1 layer, 2 q heads over 1 KV head, T = 3; held positions 0, 2 and 5 (5 is a later chunk row).
  fid::PositionTracker held(1, 1);
  held.append(0, 6);
  held.apply(plan_from(1, 1, {{0, 2, 5}}));
  const std::vector<float> probs = {0.5f, 0.3f, 0.2f, 0.1f, 0.1f, 0.8f};
  CHECK(fid::attention_recall(probs, 2, 3, held, true) == doctest::Approx(((0.5 + 0.2) + (0.1 + 0.8)) / 2).epsilon(1e-6));
  // Without `causal` a held position beyond the row is refused; the causal form is for chunks.
  CHECK_THROWS((void)fid::attention_recall(probs, 2, 3, held));
  CHECK_THROWS((void)fid::attention_recall(std::vector<float>(5, 0.2f), 2, 3, held, true));
  CHECK(fid::token_nll(std::vector<float>{0.0f, 0.0f}, 1) == doctest::Approx(std::log(2.0)).epsilon(1e-12));
}

TEST_CASE("document runs on the tiny model: chunks give the rounds and numbers of single steps") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 42);
  ex::Model<ex::CpuBackend> model(w);
  const ex::ModelConfig& mc = model.config();
  std::vector<int> doc;
  for (int i = 0; i < 70; ++i) doc.push_back(3 + (i * 37) % (mc.vocab_size - 3));
  const int divide = 8, budget = 24;
  triattn::SelectionParams sel;
  sel.budget = budget;
  sel.divide_length = divide;
  auto policy = [&](triattn::SelectionParams s) -> std::unique_ptr<fid::DocumentPolicy> {
    using C = fid::HostCache<triattn::KeyNormScorer>;
    return std::make_unique<fid::DocumentPolicyImpl<ex::Model<ex::CpuBackend>, C>>(
        model, "key_norm", s.budget, std::make_unique<C>(fid::cache_config(mc, 1, s.budget + divide), triattn::TopKSelector(s)));
  };
  std::vector<std::unique_ptr<fid::DocumentPolicy>> chunked, single;
  chunked.push_back(policy(sel));
  single.push_back(policy(sel));
  fid::FullDocument<ex::Model<ex::CpuBackend>> full_a(model, 70), full_b(model, 70);
  std::vector<std::int64_t> progress;
  fid::run_document(full_a, std::span<const std::unique_ptr<fid::DocumentPolicy>>(chunked), 1, doc, divide, true,
                    [&](std::int64_t p) { progress.push_back(p); });
  fid::run_document(full_b, std::span<const std::unique_ptr<fid::DocumentPolicy>>(single), 1, doc, 1, true);
  CHECK(progress == std::vector<std::int64_t>{8, 16, 24, 32, 40, 48, 56, 64, 70});
  const fid::DocumentStats& a = chunked[0]->stats();
  const fid::DocumentStats& b = single[0]->stats();
  // The first round runs once budget + divide tokens are cached, then every divide tokens.
  CHECK(a.first_round_pos == budget + divide - 1);
  CHECK(b.first_round_pos == a.first_round_pos);
  CHECK(a.rounds == (70 - budget) / divide);
  CHECK(b.rounds == a.rounds);
  CHECK(a.max_kept == budget);
  REQUIRE(a.pos.size() == static_cast<std::size_t>(70 - budget - divide));
  REQUIRE(b.pos == a.pos);
  CHECK(a.pos.front() == budget + divide);
  bool evicted_mass = false;
  for (std::size_t i = 0; i < a.pos.size(); ++i) {
    CHECK(a.kl[i] == doctest::Approx(b.kl[i]).epsilon(1e-9));
    CHECK(a.recall[i] == doctest::Approx(b.recall[i]).epsilon(1e-6));
    CHECK(a.top1[i] == b.top1[i]);
    CHECK(a.kl[i] >= 0.0);
    CHECK(a.recall[i] <= 1.0 + 1e-6);
    evicted_mass = evicted_mass || a.recall[i] < 0.999;
    if (a.pos[i] + 1 < 70) {
      CHECK(a.nll[i] == doctest::Approx(b.nll[i]).epsilon(1e-9));
      CHECK(a.nll_full[i] == doctest::Approx(b.nll_full[i]).epsilon(1e-9));
    } else {
      CHECK(std::isnan(a.nll[i]));  // the document's last token predicts nothing
    }
  }
  CHECK(evicted_mass);  // rounds evicted tokens the full model attends to

  // Nothing evicted (budget above the document): recall 1, KL 0, the full-KV NLL.
  sel.budget = 96;
  std::vector<std::unique_ptr<fid::DocumentPolicy>> roomy;
  roomy.push_back(policy(sel));
  fid::run_document(full_a, std::span<const std::unique_ptr<fid::DocumentPolicy>>(roomy), 1, doc, divide, true);
  CHECK(roomy[0]->stats().rounds == 0);
  CHECK(roomy[0]->stats().pos.empty());

  // Two workers give the numbers of one.
  std::vector<std::unique_ptr<fid::DocumentPolicy>> two;
  ex::Model<ex::CpuBackend> model2(w);
  sel.budget = budget;
  two.push_back(policy(sel));
  {
    using C = fid::HostCache<triattn::KeyNormScorer>;
    two.push_back(std::make_unique<fid::DocumentPolicyImpl<ex::Model<ex::CpuBackend>, C>>(
        model2, "key_norm", budget, std::make_unique<C>(fid::cache_config(mc, 1, budget + divide), triattn::TopKSelector(sel))));
  }
  fid::run_document(full_a, std::span<const std::unique_ptr<fid::DocumentPolicy>>(two), 2, doc, divide, true);
  CHECK(two[0]->stats().kl == a.kl);
  CHECK(two[1]->stats().kl == a.kl);
  CHECK(two[1]->stats().recall == a.recall);
}

TEST_CASE("retrieval answers: a cache that evicts nothing answers like the full model") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 42);
  ex::Model<ex::CpuBackend> model(w);
  const ex::ModelConfig& mc = model.config();
  std::vector<int> ctx;
  for (int i = 0; i < 40; ++i) ctx.push_back(3 + (i * 11) % (mc.vocab_size - 3));
  fid::FullDocument<ex::Model<ex::CpuBackend>> full(model, 48);
  full.start();
  fid::FullChunk fc;
  const std::vector<int> ref = fid::answer_greedy(ctx, 8, 6, [&](std::span<const int> t, std::int64_t p0) {
    full.feed(t, p0, false, fc);
    CHECK(fc.probs.empty());
    const std::span<const float> last = fc.row(fc.rows - 1);
    return std::vector<float>(last.begin(), last.end());
  });
  REQUIRE(ref.size() == 6u);
  triattn::SelectionParams sel;
  sel.budget = 64;
  sel.divide_length = 8;
  using C = fid::HostCache<triattn::RecencyScorer>;
  fid::DocumentPolicyImpl<ex::Model<ex::CpuBackend>, C> roomy(model, "recency", 64,
                                                             std::make_unique<C>(fid::cache_config(mc, 1, 72), triattn::TopKSelector(sel)));
  roomy.start();
  const std::vector<int> same =
      fid::answer_greedy(ctx, 8, 6, [&](std::span<const int> t, std::int64_t p0) { return roomy.feed(t, p0, nullptr, {}); });
  CHECK(same == ref);
  // A tiny budget keeps only the newest tokens: the run completes and rounds fired.
  sel.budget = 8;
  fid::DocumentPolicyImpl<ex::Model<ex::CpuBackend>, C> tight(model, "recency", 8,
                                                             std::make_unique<C>(fid::cache_config(mc, 1, 16), triattn::TopKSelector(sel)));
  tight.start();
  const std::vector<int> other =
      fid::answer_greedy(ctx, 8, 6, [&](std::span<const int> t, std::int64_t p0) { return tight.feed(t, p0, nullptr, {}); });
  CHECK(other.size() == 6u);
  CHECK(tight.stats().rounds > 0);
  CHECK(tight.stats().max_kept == 8);
}

TEST_CASE("kv_abs_max reads dequantised K and V per layer and fp8 scales follow from it") {
  const ex::ModelConfig mc = ex::synthetic_config("tiny");  // 2 layers, 2 KV heads, head_dim 16
  const int kv_dim = mc.n_kv_heads * mc.head_dim;
  std::vector<float> k(static_cast<std::size_t>(2 * kv_dim), 0.5f), v(k.size(), -0.25f);
  k[static_cast<std::size_t>(kv_dim + 17)] = -3.0f;  // token 1, KV head 1, element 1
  fid::PlainCache f32(fid::cache_config(mc, 1, 8));
  const triattn::SeqId s = f32.add_sequence();
  REQUIRE(f32.extend(s, 2).ok());
  f32.write_values(s, 0, 0, k.data(), v.data(), 2);
  std::vector<float> k1(k.size(), 0.125f), v1(k.size(), 2.0f);
  f32.write_values(s, 1, 0, k1.data(), v1.data(), 2);
  CHECK(fid::kv_abs_max(f32, s) == std::vector<float>{3.0f, 0.25f, 0.125f, 2.0f});

  const std::vector<float> scales = fid::fp8_scales_from_amax(std::vector<float>{3.0f, 0.25f, 0.0f, 2.0f}, 2.0f);
  CHECK(scales == std::vector<float>{6.0f / 448.0f, 0.5f / 448.0f, 1.0f, 4.0f / 448.0f});
  CHECK(fid::fp8_scales_from_amax(std::vector<float>{448.0f})[0] == 1.0f);
  CHECK_THROWS((void)fid::fp8_scales_from_amax(std::vector<float>{-1.0f}));
  CHECK_THROWS((void)fid::fp8_scales_from_amax(std::vector<float>{std::nanf("")}));
  CHECK_THROWS((void)fid::fp8_scales_from_amax(std::vector<float>{1.0f}, 0.5f));

  // An fp8 cache stores codes: kv_abs_max applies each layer's scale (3 / s = 224 is a code).
  fid::KvFormat fp8{triattn::DType::kFP8E4M3, {6.0f / 448.0f, 0.5f / 448.0f, 1.0f, 4.0f / 448.0f}};
  fid::PlainCache q(fid::cache_config(mc, 1, 8, 16, fp8));
  const triattn::SeqId t = q.add_sequence();
  REQUIRE(q.extend(t, 2).ok());
  q.write_values(t, 0, 0, k.data(), v.data(), 2);
  q.write_values(t, 1, 0, k1.data(), v1.data(), 2);
  const std::vector<float> m = fid::kv_abs_max(q, t);
  CHECK(m[0] == doctest::Approx(3.0f).epsilon(1e-6));
  CHECK(m[1] == doctest::Approx(0.25f).epsilon(1e-6));
  CHECK(m[2] == 0.125f);
  CHECK(m[3] == doctest::Approx(2.0f).epsilon(1e-6));
}

TEST_CASE("document runs in bf16 and fp8 KV: bf16 against a bf16 reference is exact and fp8 finite") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 42);
  ex::Model<ex::CpuBackend> model(w);
  const ex::ModelConfig& mc = model.config();
  const int n = 48, divide = 8, budget = 16;
  std::vector<int> doc, calib;
  for (int i = 0; i < n; ++i) doc.push_back(3 + (i * 37) % (mc.vocab_size - 3));
  for (int i = 0; i < 32; ++i) calib.push_back(3 + (i * 53 + 7) % (mc.vocab_size - 3));
  const fid::KvFormat bf16{triattn::DType::kBF16, {}};
  // fp8 scales as the fidelity program chooses them: a bf16 calibration prefill's max |K|, |V|.
  fid::PlainCache cal(fid::cache_config(mc, 1, 32, 16, bf16));
  const triattn::SeqId cs = cal.add_sequence();
  ex::Chunk ch{cs, calib, triattn::Phase::kPrefill};
  (void)model.step(cal, std::span<const ex::Chunk>(&ch, 1), ex::LogitsFor::kNone);
  const fid::KvFormat fp8{triattn::DType::kFP8E4M3, fid::fp8_scales_from_amax(fid::kv_abs_max(cal, cs), 2.0f)};
  REQUIRE(fp8.scales.size() == static_cast<std::size_t>(2 * mc.n_layers));

  using M = ex::Model<ex::CpuBackend>;
  using C = fid::HostCache<triattn::KeyNormScorer>;
  triattn::SelectionParams sel;
  sel.budget = budget;
  sel.divide_length = divide;
  auto plain = [&](const fid::KvFormat& kv) -> std::unique_ptr<fid::DocumentPolicy> {
    return std::make_unique<fid::DocumentPolicyImpl<M, fid::PlainCache>>(
        model, "no eviction", 0, std::make_unique<fid::PlainCache>(fid::cache_config(mc, 1, n, 16, kv)), 0);
  };
  auto compressed = [&](const fid::KvFormat& kv, std::int64_t from) -> std::unique_ptr<fid::DocumentPolicy> {
    return std::make_unique<fid::DocumentPolicyImpl<M, C>>(
        model, "key_norm", budget, std::make_unique<C>(fid::cache_config(mc, 1, budget + divide, 16, kv), triattn::TopKSelector(sel)),
        from);
  };
  std::vector<std::unique_ptr<fid::DocumentPolicy>> pols;
  pols.push_back(plain(bf16));
  pols.push_back(plain(fp8));
  pols.push_back(compressed(bf16, budget + divide));
  pols.push_back(compressed(fp8, budget + divide));
  pols.push_back(compressed(bf16, 0));
  fid::FullDocument<M> full(model, n, bf16);
  fid::run_document(full, std::span<const std::unique_ptr<fid::DocumentPolicy>>(pols), 1, doc, divide, true);

  // bf16 without eviction is the reference itself: every position, KL exactly 0.
  const fid::DocumentStats& same = pols[0]->stats();
  REQUIRE(same.pos.size() == static_cast<std::size_t>(n));
  CHECK(same.rounds == 0);
  for (std::size_t i = 0; i < same.pos.size(); ++i) {
    CHECK(same.kl[i] == 0.0);
    CHECK(same.top1[i] == 1);
    CHECK(same.recall[i] == doctest::Approx(1.0).epsilon(1e-5));
  }
  // fp8 without eviction: every position, finite metrics, KL above 0 somewhere but small.
  const fid::DocumentStats& q = pols[1]->stats();
  REQUIRE(q.pos.size() == static_cast<std::size_t>(n));
  bool differs = false;
  for (std::size_t i = 0; i < q.pos.size(); ++i) {
    CHECK(std::isfinite(q.kl[i]));
    CHECK(q.kl[i] < 0.05);
    CHECK(q.recall[i] == doctest::Approx(1.0).epsilon(1e-5));
    CHECK((i + 1 == q.pos.size() || std::isfinite(q.nll[i])));
    differs = differs || q.kl[i] > 0.0;
  }
  CHECK(differs);
  // Compressed in either dtype: rounds from budget + divide on, counted from there, finite;
  // the fp8 scorer's rounds ran on the fp8 cache (compress_round dispatches on its dtype).
  for (int p : {2, 3}) {
    const fid::DocumentStats& c = pols[static_cast<std::size_t>(p)]->stats();
    CHECK(c.rounds == (n - budget) / divide);
    CHECK(c.first_round_pos == budget + divide - 1);
    REQUIRE(c.pos.size() == static_cast<std::size_t>(n - budget - divide));
    CHECK(c.pos.front() == budget + divide);
    CHECK(c.max_kept == budget);
    for (double x : c.kl) CHECK(std::isfinite(x));
    for (double x : c.recall) CHECK((x > 0.0 && x <= 1.0 + 1e-6));
  }
  CHECK(pols[2]->stats().kl != pols[3]->stats().kl);
  // Counted from 0, a bf16 cache equals the reference exactly until its first round.
  const fid::DocumentStats& early = pols[4]->stats();
  REQUIRE(early.pos.size() == static_cast<std::size_t>(n));
  bool after = false;
  for (std::size_t i = 0; i < early.pos.size(); ++i) {
    if (early.pos[i] < budget + divide) CHECK(early.kl[i] == 0.0);
    else after = after || early.kl[i] > 0.0;
  }
  CHECK(after);
  CHECK(early.kl[static_cast<std::size_t>(budget + divide)] == pols[2]->stats().kl.front());
  // The reference's own K/V maxima (the saturation check of the fidelity program).
  for (float x : full.kv_abs_max()) CHECK((std::isfinite(x) && x > 0.0f));
}

}  // TEST_SUITE

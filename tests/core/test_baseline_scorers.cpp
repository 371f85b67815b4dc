// SPDX-License-Identifier: Apache-2.0
// Tests of the baseline scorers (recency, key norm, random, SnapKV): their CPU references on
// inputs whose keep set is known in advance, and whole compression rounds through
// KvCache<StaticAllocator<HostBackend>, HostCompactor, XScorer, TopKSelector>, checked by the K
// contents after compaction.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/key_norm_scorer.hpp>
#include <triattn/core/policy/random_scorer.hpp>
#include <triattn/core/policy/recency_scorer.hpp>
#include <triattn/core/policy/snapkv_scorer.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/ref/baseline_scores.hpp>

using namespace triattn;

namespace {

template <class Scorer>
using HostCache = KvCache<StaticAllocator<HostBackend>, HostCompactor, Scorer, TopKSelector>;

using Rows = std::vector<std::vector<int>>;  // [L * Hkv] kept original token indices, ascending

CacheConfig small_config(DType dtype, KvLayout layout, int block_size = 5) {
  CacheConfig c;
  c.model = ModelGeometry{2, 4, 2, 16};
  c.block_size = block_size;
  c.num_blocks = 48;
  c.max_seqs = 4;
  c.layout = layout;
  c.dtype = dtype;
  return c;
}

/// Keys and values of T tokens as KvCache::append takes them: [L, T, Hkv, d] of storage type T.
template <class T>
struct Tokens {
  int L = 0, n = 0, hkv = 0, d = 0;
  std::vector<T> k, v;
  Tokens(const ModelGeometry& g, int count)
      : L(g.num_layers), n(count), hkv(g.num_kv_heads), d(g.head_dim),
        k(static_cast<std::size_t>(L) * n * hkv * d), v(k.size()) {}
  T* key(int l, int t, int g) { return k.data() + ((static_cast<std::size_t>(l) * n + t) * hkv + g) * d; }
  const T* key(int l, int t, int g) const { return k.data() + ((static_cast<std::size_t>(l) * n + t) * hkv + g) * d; }
};

template <class T>
void fill_random(Tokens<T>& tok, std::uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  for (T& x : tok.k) x = from_float<T>(nd(rng));
  for (T& x : tok.v) x = from_float<T>(nd(rng));
}

template <class T>
bool same_bits(const T* a, const T* b, int d) {
  return std::memcmp(a, b, sizeof(T) * static_cast<std::size_t>(d)) == 0;
}

/// Checks that slot i of every (layer, KV head) of `seq` holds the original key of token
/// rows[l * Hkv + g][i] (several token batches concatenated in `all`).
template <class Cache, class T>
void check_kept_keys(const Cache& cache, SeqId seq, const std::vector<const Tokens<T>*>& batches, const Rows& rows) {
  const ModelGeometry& g = cache.config().model;
  const auto view = cache.template view<T>();
  REQUIRE(rows.size() == static_cast<std::size_t>(g.num_layers) * g.num_kv_heads);
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const std::vector<int>& r = rows[static_cast<std::size_t>(l) * g.num_kv_heads + h];
      REQUIRE(static_cast<int>(r.size()) == cache.physical_length(seq));
      for (std::size_t i = 0; i < r.size(); ++i) {
        int t = r[i];
        const Tokens<T>* b = nullptr;
        for (const Tokens<T>* x : batches) {
          if (t < x->n) {
            b = x;
            break;
          }
          t -= x->n;
        }
        REQUIRE(b != nullptr);
        CAPTURE(l);
        CAPTURE(h);
        CAPTURE(i);
        CAPTURE(r[i]);
        CHECK(same_bits(view.token(l, KvKind::kKey, seq, static_cast<int>(i), h), b->key(l, t, h), g.head_dim));
      }
    }
}

std::vector<int> range_of(int lo, int hi) {
  std::vector<int> r(static_cast<std::size_t>(hi - lo));
  std::iota(r.begin(), r.end(), lo);
  return r;
}

/// Independent long-double evaluation of the SnapKV window attention of one query head.
std::vector<double> naive_window_attention(const std::vector<float>& q, const std::vector<int>& lim, int n,
                                           const std::vector<float>& keys, int T, int d) {
  std::vector<long double> a(static_cast<std::size_t>(T), 0.0L);
  int used = 0;
  for (int i = 0; i < n; ++i) {
    const int L = std::min(lim[i], T - 1);
    if (L < 0) continue;
    ++used;
    std::vector<long double> w(static_cast<std::size_t>(L) + 1);
    long double z = 0;
    for (int j = 0; j <= L; ++j) {
      long double s = 0;
      for (int e = 0; e < d; ++e) s += static_cast<long double>(q[i * d + e]) * keys[j * d + e];
      w[j] = std::exp(s / std::sqrt(static_cast<long double>(d)));
      z += w[j];
    }
    for (int j = 0; j <= L; ++j) a[j] += w[j] / z;
  }
  std::vector<double> out(static_cast<std::size_t>(T));
  for (int j = 0; j < T; ++j) out[j] = used ? static_cast<double>(a[j] / used) : 0.0;
  return out;
}

}  // namespace

TEST_SUITE("scorers") {

// ---- references -----------------------------------------------------------------------------

TEST_CASE("recency reference: slot index shifted so the newest slot is 0") {
  std::vector<float> out(6, -99.0f);
  ref::recency_scores(6, out.data());
  CHECK(out == std::vector<float>{-5, -4, -3, -2, -1, 0});
  ref::recency_scores(0, out.data());  // nothing written
  CHECK(out[0] == -5.0f);
  // exact near the newest end even for very long sequences
  std::vector<float> big(1 << 25);
  ref::recency_scores(static_cast<int>(big.size()), big.data());
  CHECK(big.back() == 0.0f);
  CHECK(big[big.size() - 2] == -1.0f);
  CHECK(big[big.size() - 4096] == -4095.0f);
}

TEST_CASE("key norm reference: minus the L2 norm with float accumulation") {
  const std::vector<float> keys = {3, 4, 0, 0,   1, 1, 1, 1,   0, 0, 0, 0,   -2, 0, 0, 0};  // [4, 4]
  std::vector<float> out(4);
  ref::key_norm_scores(keys.data(), 4, 4, out.data());
  CHECK(out == std::vector<float>{-5.0f, -2.0f, 0.0f, -2.0f});
  CHECK(ref::key_l2_norm(keys.data(), 4) == 5.0f);
  CHECK_THROWS_AS(ref::key_norm_scores(keys.data(), 4, 0, out.data()), logic_error);
}

TEST_CASE("random reference: deterministic per seed and round and layer and head and slot and uniform below 1") {
  const int T = 4000;
  std::vector<float> a(T), b(T), c(T);
  ref::random_scores(7, 1000, 1, 2, T, a.data());
  ref::random_scores(7, 1000, 1, 2, T, b.data());
  CHECK(a == b);
  double mean = 0;
  for (float x : a) {
    REQUIRE(x >= 0.0f);
    REQUIRE(x < 1.0f);
    mean += x;
  }
  mean /= T;
  CHECK(mean == doctest::Approx(0.5).epsilon(0.05));
  CHECK(std::set<float>(a.begin(), a.end()).size() > static_cast<std::size_t>(T - 5));  // (almost) no ties
  // every argument changes the draw
  auto differs = [&](std::uint64_t seed, std::int64_t t0, int l, int h) {
    ref::random_scores(seed, t0, l, h, T, c.data());
    int same = 0;
    for (int j = 0; j < T; ++j) same += a[j] == c[j];
    return same < 10;
  };
  CHECK(differs(8, 1000, 1, 2));
  CHECK(differs(7, 1001, 1, 2));
  CHECK(differs(7, 1000, 0, 2));
  CHECK(differs(7, 1000, 1, 3));
  static_assert(ref::random_score_hash(1, 2, 3, 4, 5) == ref::random_score_hash(1, 2, 3, 4, 5));
}

TEST_CASE("max_pool_same: stride 1 and same padding clipped at the edges") {
  const std::vector<float> in = {0, 5, 0, 0, 0, 0, 0, 0, 9, 1};
  std::vector<float> out(in.size());
  ref::max_pool_same(in.data(), 10, 1, out.data());
  CHECK(out == in);
  ref::max_pool_same(in.data(), 10, 3, out.data());
  CHECK(out == std::vector<float>{5, 5, 5, 0, 0, 0, 0, 9, 9, 9});
  ref::max_pool_same(in.data(), 10, 7, out.data());
  CHECK(out == std::vector<float>{5, 5, 5, 5, 5, 9, 9, 9, 9, 9});
  ref::max_pool_same(in.data(), 10, 31, out.data());
  CHECK(out == std::vector<float>(10, 9.0f));
  CHECK_THROWS_WITH_AS(ref::max_pool_same(in.data(), 10, 4, out.data()), doctest::Contains("odd"), logic_error);
  CHECK_THROWS_AS(ref::max_pool_same(in.data(), 10, 0, out.data()), logic_error);
}

TEST_CASE("snapkv_visible_limit: the tokens after a query are the newest slots") {
  CHECK(snapkv_visible_limit(100, 500, 499) == 99);  // newest query sees everything
  CHECK(snapkv_visible_limit(100, 500, 490) == 90);
  CHECK(snapkv_visible_limit(100, 500, 500) == 99);  // observed before its token was appended
  CHECK(snapkv_visible_limit(100, 500, 900) == 99);
  CHECK(snapkv_visible_limit(100, 500, 400) == 0);
  CHECK(snapkv_visible_limit(100, 500, 399) == -1);  // sees nothing
  CHECK(snapkv_visible_limit(100, 500, 0) == -1);
  CHECK(snapkv_visible_limit(0, 5, 4) == -1);
  CHECK(snapkv_visible_limit(100, 100, -1) == -1);  // empty window slot
  CHECK(snapkv_visible_limit(100, 50, -1) == -1);
}

TEST_CASE("SnapKV window attention matches an independent evaluation with causal limits") {
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int d : {8, 64}) {
    for (int n : {1, 5, 32}) {
      const int T = 57;
      std::vector<float> q(static_cast<std::size_t>(n) * d), keys(static_cast<std::size_t>(T) * d);
      for (float& x : q) x = 2.0f * nd(rng);
      for (float& x : keys) x = nd(rng);
      std::vector<int> lim(static_cast<std::size_t>(n));
      std::uniform_int_distribution<int> ul(-3, T + 3);
      for (int& x : lim) x = ul(rng);
      lim[0] = T - 1;
      std::vector<float> out(static_cast<std::size_t>(T));
      ref::snapkv_window_attention(q.data(), lim.data(), n, keys.data(), T, d, out.data());
      const std::vector<double> want = naive_window_attention(q, lim, n, keys, T, d);
      double num = 0, den = 0, total = 0;
      for (int j = 0; j < T; ++j) {
        num += (out[j] - want[j]) * (out[j] - want[j]);
        den += want[j] * want[j];
        total += out[j];
      }
      CAPTURE(d);
      CAPTURE(n);
      CHECK(std::sqrt(num / den) < 1e-6);
      CHECK(total == doctest::Approx(1.0).epsilon(1e-5));  // mean of distributions
      // a slot past every limit gets nothing
      const int max_lim = *std::max_element(lim.begin(), lim.end());
      for (int j = max_lim + 1; j < T; ++j) CHECK(out[j] == 0.0f);
    }
  }
  // nobody sees anything: all zero
  const std::vector<float> q(8, 1.0f), keys(32, 1.0f);
  const std::vector<int> lim = {-1};
  std::vector<float> out(4, 7.0f);
  ref::snapkv_window_attention(q.data(), lim.data(), 1, keys.data(), 4, 8, out.data());
  CHECK(out == std::vector<float>(4, 0.0f));
}

TEST_CASE("SnapKV reference: aligned queries pick their keys and the pool spreads to neighbours and the mask hides later keys") {
  const int d = 16, T = 30;
  std::vector<float> keys(static_cast<std::size_t>(T) * d, 0.0f);
  keys[10 * d + 0] = 8.0f;  // token 10 matches direction 0
  keys[20 * d + 1] = 8.0f;  // token 20 matches direction 1
  keys[29 * d + 0] = 8.0f;  // token 29 matches direction 0 too, but only query 1 may see it
  std::vector<float> q(2 * d, 0.0f);
  q[0 * d + 0] = 8.0f;
  q[1 * d + 1] = 8.0f;
  const std::vector<int> lim = {28, 29};
  std::vector<float> a(T), s(T);
  ref::snapkv_window_attention(q.data(), lim.data(), 2, keys.data(), T, d, a.data());
  // query 0 sees [0, 28]: almost all on token 10; query 1 sees [0, 29]: almost all on token 20
  CHECK(a[10] > 0.49f);
  CHECK(a[20] > 0.49f);
  CHECK(a[29] < 1e-6f);  // hidden from query 0, orthogonal to query 1
  for (int j = 0; j < T; ++j)
    if (j != 10 && j != 20) CHECK(a[j] < 1e-6f);
  ref::snapkv_scores(q.data(), lim.data(), 2, keys.data(), T, d, 7, s.data());
  for (int j = 0; j < T; ++j) {
    CAPTURE(j);
    if (j >= 7 && j <= 13) CHECK(s[j] == a[10]);
    else if (j >= 17 && j <= 23) CHECK(s[j] == a[20]);
    else CHECK(s[j] < 1e-6f);
  }
  // with limit 29 for both, token 29 shares query 0's attention with token 10
  const std::vector<int> lim2 = {29, 29};
  ref::snapkv_window_attention(q.data(), lim2.data(), 2, keys.data(), T, d, a.data());
  CHECK(a[29] == doctest::Approx(a[10]));
  CHECK(a[10] == doctest::Approx(0.25).epsilon(1e-3));
}

// ---- policies -------------------------------------------------------------------------------

TEST_CASE("scorer policies check the output shape") {
  const CacheConfig cfg = small_config(DType::kF32, KvLayout::kNHD);
  HostCache<RecencyScorer> cache(cfg);
  const SeqId s = cache.add_sequence();
  REQUIRE(cache.extend(s, 7).ok());
  const auto view = cache.view<float>();
  std::vector<float> out(static_cast<std::size_t>(2) * 4 * 7);
  RecencyScorer rec(cfg);
  KeyNormScorer kn(cfg);
  RandomScorer rnd(cfg, 3);
  SnapKvScorer snap(cfg);
  CHECK_NOTHROW(rec.score(view, s, 7, 7, out));
  CHECK_NOTHROW(kn.score(view, s, 7, 7, out));
  CHECK_NOTHROW(rnd.score(view, s, 7, 7, out));
  CHECK_THROWS_WITH_AS(snap.score(view, s, 7, 7, out), doctest::Contains("no query observed"), logic_error);
  const std::span<float> short_out(out.data(), out.size() - 7);
  CHECK_THROWS_AS(rec.score(view, s, 7, 7, short_out), logic_error);
  CHECK_THROWS_AS(kn.score(view, s, 7, 7, short_out), logic_error);
  CHECK_THROWS_AS(rnd.score(view, s, 7, 7, short_out), logic_error);
  CHECK_THROWS_AS(snap.score(view, s, 7, 7, short_out), logic_error);
  // stateless defaults infer Hq from the output (a multiple of Hkv = 2)
  RecencyScorer rec0;
  CHECK_NOTHROW(rec0.score(view, s, 7, 7, std::span<float>(out.data(), 2 * 2 * 7)));
  CHECK_THROWS_AS(rec0.score(view, s, 7, 7, std::span<float>(out.data(), 2 * 3 * 7)), logic_error);
  CHECK_NOTHROW(rec.score(view, s, 0, 7, std::span<float>()));
  CHECK_THROWS_AS((SnapKvParams{0, 7}.validate()), logic_error);
  CHECK_THROWS_AS((SnapKvParams{8, 6}.validate()), logic_error);
  CHECK_THROWS_AS((SnapKvScorer(cfg, SnapKvParams{8, 2})), logic_error);
}

TEST_CASE("KeyNormScorer replicates the norms of each KV head to its query heads") {
  const CacheConfig cfg = small_config(DType::kF32, KvLayout::kHND, 3);
  HostCache<KeyNormScorer> cache(cfg);
  const SeqId s = cache.add_sequence();
  Tokens<float> tok(cfg.model, 9);
  fill_random(tok, 5);
  REQUIRE(cache.append<float>(s, tok.k, tok.v, 9).ok());
  std::vector<float> out(static_cast<std::size_t>(2) * 4 * 9);
  cache.scorer().score(cache.view<float>(), s, 9, 9, out);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 4; ++h)
      for (int j = 0; j < 9; ++j) CHECK(out[(l * 4 + h) * 9 + j] == -ref::key_l2_norm(tok.key(l, j, h / 2), 16));
}

TEST_CASE("SnapKvScorer keeps the newest window queries per sequence and layer and forget drops them") {
  const CacheConfig cfg = small_config(DType::kF32, KvLayout::kNHD);
  SnapKvScorer sc(cfg, SnapKvParams{3, 1});
  std::vector<float> q(static_cast<std::size_t>(4) * 16);
  for (int p = 0; p < 5; ++p) {
    std::fill(q.begin(), q.end(), static_cast<float>(p));
    sc.observe(1, 0, q.data(), 100 + p);
  }
  sc.observe(2, 1, q.data(), 7);
  CHECK(sc.num_observed(1, 0) == 3);
  CHECK(sc.num_observed(1, 1) == 0);
  CHECK(sc.num_observed(2, 1) == 1);
  CHECK(sc.num_observed(3, 0) == 0);
  std::vector<float> packed(static_cast<std::size_t>(2) * 3 * 4 * 16, -1.0f);
  std::vector<std::int64_t> pos(6, 99);
  sc.pack_window(1, packed, pos);
  CHECK(pos == std::vector<std::int64_t>{102, 103, 104, -1, -1, -1});  // oldest first, layer 1 empty
  for (int i = 0; i < 3; ++i) CHECK(packed[static_cast<std::size_t>(i) * 64 + 5] == static_cast<float>(2 + i));
  CHECK(packed[static_cast<std::size_t>(3) * 64] == 0.0f);  // padding
  CHECK_THROWS_AS(sc.pack_window(1, std::span<float>(packed).subspan(1), pos), logic_error);
  // a window whose positions are not below t0 is stale (a reused slot without forget)
  std::vector<float> out(static_cast<std::size_t>(2) * 4 * 50);
  {
    CacheConfig c1 = cfg;
    HostCache<RecencyScorer> cache(c1);  // only for a view with 50 slots
    const SeqId s0 = cache.add_sequence();
    const SeqId s1 = cache.add_sequence();
    REQUIRE(s1 == 1);
    REQUIRE(cache.extend(s1, 50).ok());
    (void)s0;
    sc.observe(1, 1, q.data(), 103);
    CHECK_NOTHROW(sc.score(cache.view<float>(), s1, 50, 105, out));
    CHECK_THROWS_WITH_AS(sc.score(cache.view<float>(), s1, 50, 104, out), doctest::Contains("forget"), logic_error);
  }
  sc.forget(1);
  CHECK(sc.num_observed(1, 0) == 0);
  CHECK(sc.num_observed(2, 1) == 1);
  CHECK_THROWS_AS(sc.observe(1, 2, q.data(), 0), logic_error);
  CHECK_THROWS_AS(sc.observe(1, 0, nullptr, 0), logic_error);
}

// ---- whole rounds through KvCache -----------------------------------------------------------

TEST_CASE("recency round: keeps the sinks and the newest tokens normalised or not in every mode") {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
    for (bool normalize : {true, false})
      for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
        CAPTURE(layout_name(layout));
        CAPTURE(normalize);
        CAPTURE(to_string(mode));
        const CacheConfig cfg = small_config(DType::kF32, layout);
        SelectionParams sel;
        sel.budget = 16;
        sel.divide_length = 8;
        sel.n_sink = 4;
        sel.normalize = normalize;
        sel.mode = mode;
        HostCache<RecencyScorer> cache(cfg, TopKSelector(sel));
        const SeqId s = cache.add_sequence();
        Tokens<float> tok(cfg.model, 40);
        fill_random(tok, 11);
        REQUIRE(cache.append<float>(s, tok.k, tok.v, 40).ok());
        CHECK(cache.needs_compression(s));
        const CompressionReport rep = cache.compress(s);
        CHECK(rep.length_before == 40);
        CHECK(rep.length_after == 16);
        CHECK(cache.logical_position(s) == 40);
        std::vector<int> want = range_of(0, 4);
        for (int t = 28; t < 40; ++t) want.push_back(t);
        check_kept_keys<HostCache<RecencyScorer>, float>(cache, s, {&tok}, Rows(4, want));
      }
}

TEST_CASE_TEMPLATE("key-norm round: keeps the lowest-norm keys of each layer and KV head", T, float, bf16_storage) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
    for (PruningMode mode : {PruningMode::kPerLayerPerHead, PruningMode::kPerHead}) {
      CAPTURE(layout_name(layout));
      CAPTURE(to_string(mode));
      const CacheConfig cfg = small_config(dtype_of<T>, layout, 4);
      const ModelGeometry& g = cfg.model;
      const int n = 30, quota = 12;
      SelectionParams sel;
      sel.budget = quota;
      sel.mode = mode;
      HostCache<KeyNormScorer> cache(cfg, TopKSelector(sel));
      const SeqId s = cache.add_sequence();
      Tokens<T> tok(g, n);
      std::mt19937 rng(77);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      Rows want(static_cast<std::size_t>(g.num_layers) * g.num_kv_heads);
      for (int l = 0; l < g.num_layers; ++l)
        for (int h = 0; h < g.num_kv_heads; ++h) {
          // distinct norms 1, 1.5, 2, ... in a random order; per_head needs the same order in every layer
          std::vector<int> rank = range_of(0, n);
          std::mt19937 perm_rng(mode == PruningMode::kPerHead ? 1000u + h : 1000u + 10u * l + h);
          std::shuffle(rank.begin(), rank.end(), perm_rng);
          for (int t = 0; t < n; ++t) {
            std::vector<float> dir(static_cast<std::size_t>(g.head_dim));
            float nn = 0;
            for (float& x : dir) {
              x = nd(rng);
              nn += x * x;
            }
            const float scale = (1.0f + 0.5f * rank[t]) / std::sqrt(nn);
            for (int e = 0; e < g.head_dim; ++e) tok.key(l, t, h)[e] = from_float<T>(dir[e] * scale);
            if (rank[t] < quota) want[static_cast<std::size_t>(l) * g.num_kv_heads + h].push_back(t);
          }
        }
      for (T& x : tok.v) x = from_float<T>(nd(rng));
      REQUIRE(cache.template append<T>(s, tok.k, tok.v, n).ok());
      const CompressionReport rep = cache.compress(s);
      CHECK(rep.length_after == quota);
      CHECK(rep.blocks_freed == 8 - 3);
      check_kept_keys<HostCache<KeyNormScorer>, T>(cache, s, {&tok}, want);
    }
}

TEST_CASE("random round: the same seed keeps the same tokens and another seed others and sinks survive") {
  const CacheConfig cfg = small_config(DType::kF32, KvLayout::kNHD);
  SelectionParams sel;
  sel.budget = 20;
  sel.n_sink = 2;
  sel.mode = PruningMode::kPerLayerPerHead;
  Tokens<float> tok(cfg.model, 60);
  fill_random(tok, 3);
  auto round = [&](std::uint64_t seed) {
    HostCache<RandomScorer> cache(cfg, TopKSelector(sel), RandomScorer(seed));
    const SeqId s = cache.add_sequence();
    REQUIRE(cache.append<float>(s, tok.k, tok.v, 60).ok());
    (void)cache.compress(s);
    REQUIRE(cache.physical_length(s) == 20);
    // which original token sits in each kept slot (keys are unique random vectors)
    Rows kept(4);
    const auto view = cache.view<float>();
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 20; ++i)
          for (int t = 0; t < 60; ++t)
            if (same_bits(view.token(l, KvKind::kKey, s, i, h), tok.key(l, t, h), 16)) {
              kept[static_cast<std::size_t>(l) * 2 + h].push_back(t);
              break;
            }
    return kept;
  };
  const Rows a = round(123), b = round(123), c = round(124);
  CHECK(a == b);
  CHECK(a != c);
  for (const Rows* r : {&a, &c})
    for (const std::vector<int>& row : *r) {
      REQUIRE(row.size() == 20u);
      CHECK(row[0] == 0);
      CHECK(row[1] == 1);
      CHECK(std::is_sorted(row.begin(), row.end()));
    }
  // per-(layer, head) draws differ: the four rows are not all the same set
  CHECK((a[0] != a[1] || a[0] != a[2] || a[0] != a[3]));
}

TEST_CASE("SnapKV round: window queries aligned with keys keep those keys and their pooled neighbours over two rounds") {
  CacheConfig cfg = small_config(DType::kF32, KvLayout::kNHD, 5);
  cfg.model = ModelGeometry{2, 4, 2, 32};
  const ModelGeometry& g = cfg.model;
  const int w = 8, n1 = 48, n2 = 8;
  const float amp = std::sqrt(10.0f * std::sqrt(32.0f));  // aligned logit amp² / sqrt(d) = 10
  // targets [layer][kv head] = two token indices, each aligned with its own direction (0 and 1)
  const int targets[2][2][2] = {{{10, 25}, {5, 30}}, {{12, 33}, {20, 4}}};
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
    for (int kernel : {7, 1}) {
      CAPTURE(layout_name(layout));
      CAPTURE(kernel);
      cfg.layout = layout;
      const int r = kernel / 2, quota = 2 * kernel;
      SelectionParams sel;
      sel.budget = w + quota;
      sel.window = w;
      sel.mode = PruningMode::kPerLayerPerHead;
      HostCache<SnapKvScorer> cache(cfg, TopKSelector(sel), SnapKvScorer(cfg, SnapKvParams{w, kernel}));
      const SeqId s = cache.add_sequence();
      Tokens<float> tok(g, n1);
      fill_random(tok, 9, 0.05f);
      for (int l = 0; l < 2; ++l)
        for (int h = 0; h < 2; ++h)
          for (int a = 0; a < 2; ++a) {
            float* k = tok.key(l, targets[l][h][a], h);
            std::fill(k, k + g.head_dim, 0.0f);
            k[a] = amp;
          }
      REQUIRE(cache.append<float>(s, tok.k, tok.v, n1).ok());
      // the last w tokens' queries: even ones look for direction 0, odd ones for direction 1, in
      // every query head (both heads of a group agree, so the GQA max sees the same picture)
      std::mt19937 rng(4);
      std::normal_distribution<float> nd(0.0f, 0.02f);
      auto observe_window = [&](std::int64_t first_pos) {
        for (int i = 0; i < w; ++i)
          for (int l = 0; l < 2; ++l) {
            std::vector<float> q(static_cast<std::size_t>(g.num_q_heads) * g.head_dim);
            for (float& x : q) x = nd(rng);
            for (int h = 0; h < g.num_q_heads; ++h) q[static_cast<std::size_t>(h) * g.head_dim + (i % 2)] = amp;
            cache.scorer().observe(s, l, q.data(), first_pos + i);
          }
      };
      observe_window(n1 - w);
      (void)cache.compress(s);
      REQUIRE(cache.physical_length(s) == w + quota);
      Rows want(4);
      for (int l = 0; l < 2; ++l)
        for (int h = 0; h < 2; ++h) {
          std::vector<int>& row = want[static_cast<std::size_t>(l) * 2 + h];
          for (int a = 0; a < 2; ++a)
            for (int t = targets[l][h][a] - r; t <= targets[l][h][a] + r; ++t) row.push_back(t);
          for (int t = n1 - w; t < n1; ++t) row.push_back(t);
          std::sort(row.begin(), row.end());
        }
      check_kept_keys<HostCache<SnapKvScorer>, float>(cache, s, {&tok}, want);

      // round 2: n2 more tokens (noise keys) whose queries again look for directions 0 and 1. The
      // window is queries, so compaction did not disturb it; the targets' pooled groups are now
      // contiguous slots and survive, the old window tokens go, the new ones are protected.
      Tokens<float> tok2(g, n2);
      fill_random(tok2, 10, 0.05f);
      REQUIRE(cache.append<float>(s, tok2.k, tok2.v, n2).ok());
      observe_window(n1);
      CHECK(cache.scorer().num_observed(s, 0) == w);
      (void)cache.compress(s);
      REQUIRE(cache.physical_length(s) == w + quota);
      Rows want2(4);
      for (std::size_t i = 0; i < 4; ++i) {
        for (int t : want[i])
          if (t < n1 - w) want2[i].push_back(t);
        for (int t = 0; t < n2; ++t) want2[i].push_back(n1 + t);
      }
      check_kept_keys<HostCache<SnapKvScorer>, float>(cache, s, {&tok, &tok2}, want2);
      cache.scorer().forget(s);
      cache.release(s);
    }
}

TEST_CASE("swapping the scorer is one template argument and the same driver runs every policy") {
  auto run = [](auto scorer) {
    using S = decltype(scorer);
    const CacheConfig cfg = small_config(DType::kF32, KvLayout::kNHD);
    SelectionParams sel;
    sel.budget = 10;
    sel.divide_length = 4;
    sel.window = 8;
    KvCache<StaticAllocator<HostBackend>, HostCompactor, S, TopKSelector> cache(cfg, TopKSelector(sel),
                                                                               std::move(scorer));
    const SeqId s = cache.add_sequence();
    Tokens<float> tok(cfg.model, 1);
    int rounds = 0;
    for (int t = 0; t < 40; ++t) {
      fill_random(tok, 100u + static_cast<unsigned>(t));
      REQUIRE(cache.template append<float>(s, tok.k, tok.v, 1).ok());
      if constexpr (std::is_same_v<S, SnapKvScorer>) {
        std::vector<float> q(static_cast<std::size_t>(4) * 16, 0.1f * static_cast<float>(t % 5));
        for (int l = 0; l < 2; ++l) cache.scorer().observe(s, l, q.data(), t);
      }
      const std::vector<SeqId> ids = {s};
      rounds += static_cast<int>(cache.compress_if_needed(ids).size());
      REQUIRE(cache.physical_length(s) <= 13);
    }
    CHECK(cache.logical_position(s) == 40);
    return rounds;
  };
  const CacheConfig cfg = small_config(DType::kF32, KvLayout::kNHD);
  // rounds fire at length 14 (budget 10 + divide_length 4): tokens 13, 17, ..., 37
  CHECK(run(RecencyScorer{}) == 7);
  CHECK(run(KeyNormScorer{}) == 7);
  CHECK(run(RandomScorer{5}) == 7);
  CHECK(run(SnapKvScorer(cfg)) == 7);
}

}  // TEST_SUITE

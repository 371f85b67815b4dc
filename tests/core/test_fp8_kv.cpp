// SPDX-License-Identifier: Apache-2.0
// fp8 e4m3 KV caches on the CPU: the quantising append with per-(layer, head) scales, every scorer
// and the decode-attention reference reading the dequantised values (checked bitwise against the
// same code run over a float cache holding those values, dequantised here independently),
// compaction and copy-on-write moving bytes, the scale configuration's checks, and the dispatch
// that refuses fp8 wherever the GPU kernels cannot take it yet.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/key_norm_scorer.hpp>
#include <triattn/core/policy/snapkv_scorer.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/ref/attention.hpp>
#include <triattn/core/ref/compact.hpp>
#include <triattn/core/stats/random.hpp>

using namespace triattn;

namespace {

using F8 = fp8_e4m3_storage;
template <class Scorer>
using HostCache = KvCache<StaticAllocator<HostBackend>, HostCompactor, Scorer, TopKSelector>;

constexpr int kL = 2, kHq = 4, kHkv = 2, kD = 16;

/// Scales [L, 2, Hkv]: distinct per (layer, K|V, head), far from 1.
std::vector<float> head_scales() {
  std::vector<float> s(2 * kL * kHkv);
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = 0.01f * static_cast<float>(i + 3);
  return s;
}

CacheConfig config(DType dtype, std::vector<float> scales = {}, KvLayout layout = KvLayout::kNHD, int bs = 5) {
  CacheConfig c;
  c.model = ModelGeometry{kL, kHq, kHkv, kD};
  c.block_size = bs;
  c.num_blocks = 48;
  c.max_seqs = 4;
  c.layout = layout;
  c.dtype = dtype;
  c.kv_scales = std::move(scales);
  c.track_positions = true;
  return c;
}

std::vector<float> random_values(std::size_t n, std::uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

/// Scale of (layer, kind, head) in a [L, 2, H] (or [L, 2]) table, written from the documented layout.
float scale_at(const std::vector<float>& s, int l, int kind, int h) {
  const std::size_t per = s.size() / (2 * kL);
  return s[(static_cast<std::size_t>(l) * 2 + kind) * per + (per == 1 ? 0 : h)];
}

/// Opens a sequence in the float cache `to` holding the n tokens of `seq` of the fp8 cache `from`
/// as values, decoded here from the definition (code value times its scale).
template <class From, class To>
SeqId float_twin(const From& from, SeqId seq, To& to, int n) {
  const auto v8 = from.template view<F8>();
  const std::vector<float>& sc = from.config().kv_scales;
  std::vector<float> k(static_cast<std::size_t>(kL) * n * kHkv * kD), v(k.size());
  for (int l = 0; l < kL; ++l)
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < kHkv; ++h)
        for (int kind = 0; kind < 2; ++kind) {
          const F8* src = v8.token(l, static_cast<KvKind>(kind), seq, t, h);
          float* out = (kind == 0 ? k : v).data() + ((static_cast<std::size_t>(l) * n + t) * kHkv + h) * kD;
          for (int e = 0; e < kD; ++e) out[e] = fp8_e4m3_bits_to_f32(src[e].bits) * scale_at(sc, l, kind, h);
        }
  const SeqId dst = to.add_sequence();
  REQUIRE(to.template append<float>(dst, k, v, n, Phase::kDecode).ok());
  return dst;
}

const QueryStats& stats() {
  static const QueryStats s = [] {
    std::mt19937 rng(31);
    return random_query_stats(rng, kL, kHq, kD);
  }();
  return s;
}

}  // namespace

TEST_SUITE("core") {

TEST_CASE("fp8 KV: append_values stores quantize(x / scale) of its layer and K|V and head") {
  for (const bool per_head : {true, false}) {
    CAPTURE(per_head);
    std::vector<float> sc = head_scales();
    if (!per_head) sc = {0.05f, 0.07f, 0.11f, 0.13f};  // [L, 2]: vLLM's k_scale / v_scale per layer
    HostCache<TriAttentionScorer> c(config(DType::kFP8E4M3, sc),
                                    TriAttentionScorer(stats(), RopeConfig{}, ScoringParams{}, kHkv));
    const SeqId s = c.add_sequence();
    const int n = 23;
    std::vector<float> k = random_values(static_cast<std::size_t>(kL) * n * kHkv * kD, 1, 2.0f);
    std::vector<float> v = random_values(k.size(), 2, 2.0f);
    k[5] = 1e4f;    // saturates to 448 * scale
    v[7] = -1e4f;
    k[9] = 1e-5f;   // flushes to zero
    REQUIRE(c.append_values(s, k, v, n).ok());
    const auto view = c.view<F8>();
    int checked = 0, saturated = 0;
    bool exact = true, within = true;
    for (int l = 0; l < kL; ++l)
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < kHkv; ++h)
          for (int kind = 0; kind < 2; ++kind) {
            const float s0 = scale_at(sc, l, kind, h);
            const float* x = (kind == 0 ? k : v).data() + ((static_cast<std::size_t>(l) * n + t) * kHkv + h) * kD;
            const F8* got = view.token(l, static_cast<KvKind>(kind), s, t, h);
            for (int e = 0; e < kD; ++e) {
              ++checked;
              exact = exact && got[e].bits == f32_to_fp8_e4m3_bits(x[e] / s0);
              const float y = fp8_e4m3_bits_to_f32(got[e].bits) * s0;
              const float a = std::fabs(x[e] / s0);
              if (a >= 448.0f) {
                ++saturated;
                within = within && std::fabs(y) == 448.0f * s0 && std::signbit(y) == std::signbit(x[e]);
              } else {
                // half an ulp: 2^-4 relative for normals (3 mantissa bits), 2^-10 absolute below 2^-6
                const float tol = std::fmax(a * 0.0625f, 0.0009765625f) * s0;
                within = within && std::fabs(y - x[e]) <= tol * 1.0001f;
              }
            }
          }
    CHECK(checked == 2 * kL * n * kHkv * kD);
    CHECK(exact);
    CHECK(within);
    CHECK(saturated >= 2);
  }
}

TEST_CASE("fp8 KV: every scorer scores the dequantised keys bitwise and the round keeps the same tokens") {
  // A cache of fp8 codes with per-head scales and a float cache holding exactly their values: each
  // scorer must give identical scores, and the round the same kept positions.
  const std::vector<float> sc = head_scales();
  const int n = 40, budget = 17;
  SelectionParams sel;
  sel.budget = budget;
  sel.divide_length = 1;
  sel.mode = PruningMode::kPerLayerPerHead;
  const auto fill = [&](auto& c8, auto& c32) {
    const SeqId a = c8.add_sequence();
    std::vector<float> k = random_values(static_cast<std::size_t>(kL) * n * kHkv * kD, 7, 1.5f);
    std::vector<float> v = random_values(k.size(), 8, 1.5f);
    REQUIRE(c8.append_values(a, k, v, n, Phase::kDecode).ok());  // no pinned prompt: the round chooses
    REQUIRE(float_twin(c8, a, c32, n) == a);  // same sequence id in both
    return a;
  };
  const auto same_scores_and_round = [&](auto& c8, auto& c32, SeqId s) {
    std::vector<float> s8(static_cast<std::size_t>(kL) * kHq * n), s32(s8.size());
    c8.scorer().score(c8.template view<F8>(), s, n, n, std::span<float>(s8));
    c32.scorer().score(c32.template view<float>(), s, n, n, std::span<float>(s32));
    CHECK(std::memcmp(s8.data(), s32.data(), s8.size() * sizeof(float)) == 0);
    bool distinct = false;  // the scales matter: the scores are not those of the raw codes
    for (std::size_t i = 1; i < s8.size(); ++i) distinct = distinct || s8[i] != s8[0];
    CHECK(distinct);
    const CompressionReport r8 = c8.compress(s), r32 = c32.compress(s);
    REQUIRE(r8.status == RoundStatus::kCompressed);
    REQUIRE(r32.status == RoundStatus::kCompressed);
    CHECK(r8.length_after == budget);
    CHECK(r32.length_after == budget);
    REQUIRE(r8.kept_rows == r32.kept_rows);
    for (int r = 0; r < r8.kept_rows; ++r) {
      const auto a = r8.kept(r), b = r32.kept(r);
      CHECK(std::vector<std::int32_t>(a.begin(), a.end()) == std::vector<std::int32_t>(b.begin(), b.end()));
    }
  };
  SUBCASE("TriAttention") {
    const TriAttentionScorer proto(stats(), RopeConfig{}, ScoringParams{}, kHkv);
    HostCache<TriAttentionScorer> c8(config(DType::kFP8E4M3, sc), proto, TopKSelector(sel));
    HostCache<TriAttentionScorer> c32(config(DType::kF32), proto, TopKSelector(sel));
    const SeqId s = fill(c8, c32);
    same_scores_and_round(c8, c32, s);
  }
  SUBCASE("key norm") {
    HostCache<KeyNormScorer> c8(config(DType::kFP8E4M3, sc), TopKSelector(sel));
    HostCache<KeyNormScorer> c32(config(DType::kF32), TopKSelector(sel));
    const SeqId s = fill(c8, c32);
    same_scores_and_round(c8, c32, s);
  }
  SUBCASE("SnapKV") {
    const ModelGeometry g{kL, kHq, kHkv, kD};
    HostCache<SnapKvScorer> c8(config(DType::kFP8E4M3, sc), TopKSelector(sel), SnapKvScorer(g, SnapKvParams{6, 3}));
    HostCache<SnapKvScorer> c32(config(DType::kF32), TopKSelector(sel), SnapKvScorer(g, SnapKvParams{6, 3}));
    const SeqId s = fill(c8, c32);
    const std::vector<float> q = random_values(static_cast<std::size_t>(kHq) * kD, 9, 3.0f);
    for (int i = 0; i < 6; ++i)
      for (int l = 0; l < kL; ++l) {
        c8.scorer().observe(s, l, q.data() + 0, n - 6 + i);
        c32.scorer().observe(s, l, q.data() + 0, n - 6 + i);
      }
    same_scores_and_round(c8, c32, s);
  }
}

TEST_CASE("fp8 KV: decode attention reference reads K and V with their scales") {
  const std::vector<float> sc = head_scales();
  const TriAttentionScorer proto(stats(), RopeConfig{}, ScoringParams{}, kHkv);
  HostCache<TriAttentionScorer> c8(config(DType::kFP8E4M3, sc), proto);
  HostCache<TriAttentionScorer> c32(config(DType::kF32), proto);
  const int n = 29;
  const SeqId a = c8.add_sequence();
  REQUIRE(c8.append_values(a, random_values(static_cast<std::size_t>(kL) * n * kHkv * kD, 3, 1.0f),
                           random_values(static_cast<std::size_t>(kL) * n * kHkv * kD, 4, 1.0f), n)
              .ok());
  const SeqId b = float_twin(c8, a, c32, n);
  const std::vector<float> q = random_values(static_cast<std::size_t>(kHq) * kD, 5, 1.0f);
  for (int l = 0; l < kL; ++l) {
    std::vector<float> o8(q.size()), o32(q.size());
    ref::attention(c8.view<F8>(), l, a, q.data(), kHq, o8.data(), ref::default_sm_scale(kD));
    ref::attention(c32.view<float>(), l, b, q.data(), kHq, o32.data(), ref::default_sm_scale(kD));
    CHECK(std::memcmp(o8.data(), o32.data(), o8.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("fp8 KV: compaction and copy-on-write move the bytes of every code exactly") {
  // Every code, NaN codes 0x7f / 0xff included, must survive as bytes: no decode / encode.
  for (const KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    CAPTURE(layout_name(layout));
    HostCache<TriAttentionScorer> c(config(DType::kFP8E4M3, head_scales(), layout, 4),
                                    TriAttentionScorer(stats(), RopeConfig{}, ScoringParams{}, kHkv));
    const SeqId s = c.add_sequence();
    const int n = 30;
    std::vector<F8> k(static_cast<std::size_t>(kL) * n * kHkv * kD), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i].bits = static_cast<std::uint8_t>(i * 7 + 1);
      v[i].bits = static_cast<std::uint8_t>(i * 13 + 5);
    }
    REQUIRE(c.append<F8>(s, k, v, n).ok());
    const auto at = [&](const std::vector<F8>& x, int l, int t, int h) {
      return x.data() + ((static_cast<std::size_t>(l) * n + t) * kHkv + h) * kD;
    };
    // keep every third slot (a different offset per row)
    const int keep = 10;
    KeepPlan plan(kL, kHkv, keep);
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kHkv; ++h)
        for (int i = 0; i < keep; ++i) plan.row(l, h)[i] = 3 * i + (l + h) % 3;
    ref::compact(c.view<F8>(), s, plan);
    const auto view = c.view<F8>();
    bool same = true;
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kHkv; ++h)
        for (int i = 0; i < keep; ++i) {
          const int src = plan.row(l, h)[i];
          same = same && std::memcmp(view.token(l, KvKind::kKey, s, i, h), at(k, l, src, h), kD) == 0 &&
                 std::memcmp(view.token(l, KvKind::kValue, s, i, h), at(v, l, src, h), kD) == 0;
        }
    CHECK(same);
    // copy-on-write: a block copy carries every byte of every range
    const std::int64_t blk = view.block.block_elems();
    ref::copy_block(view, std::int32_t{0}, std::int32_t{40});
    bool copied = true;
    for (int l = 0; l < kL; ++l)
      for (const KvKind kind : {KvKind::kKey, KvKind::kValue})
        copied = copied && std::memcmp(view.range(l, kind) + 40 * blk, view.range(l, kind), static_cast<std::size_t>(blk)) == 0;
    CHECK(copied);
  }
}

TEST_CASE("fp8 KV: scales are checked and only fp8 takes them") {
  CHECK_NOTHROW(config(DType::kFP8E4M3).validate());  // no scales: all 1
  CHECK_NOTHROW(config(DType::kFP8E4M3, head_scales()).validate());
  CHECK_NOTHROW(config(DType::kFP8E4M3, std::vector<float>(2 * kL, 0.5f)).validate());
  CHECK_THROWS_WITH_AS(config(DType::kBF16, head_scales()).validate(), doctest::Contains("scales are for fp8_e4m3 only"),
                       logic_error);
  CHECK_THROWS_WITH_AS(config(DType::kFP8E4M3, std::vector<float>(3, 1.0f)).validate(),
                       doctest::Contains("kv_scales holds 3 values"), logic_error);
  std::vector<float> bad = head_scales();
  bad[5] = 0.0f;
  CHECK_THROWS_WITH_AS(config(DType::kFP8E4M3, bad).validate(), doctest::Contains("kv_scales[5]"), logic_error);
  bad[5] = std::nanf("");
  CHECK_THROWS_AS(config(DType::kFP8E4M3, bad).validate(), logic_error);
  // the view carries them; without scales every scale reads 1 and nothing is dereferenced
  const CacheConfig cfg = config(DType::kFP8E4M3, head_scales());
  HostCache<KeyNormScorer> c(cfg);
  const auto v = c.view<F8>();
  CHECK(v.scale_heads == kHkv);
  CHECK(v.scale(1, KvKind::kValue, 1) == scale_at(cfg.kv_scales, 1, 1, 1));
  CHECK(KvCacheView<F8>{}.scale(3, KvKind::kKey, 9) == 1.0f);
}

TEST_CASE("fp8 KV: paths that take no scales yet refuse fp8 naming the dtype and the operation") {
  bool called = false;
  CHECK_THROWS_WITH_AS(
      dispatch_dtype_in(unscaled_storage_types{}, DType::kFP8E4M3, "the Python CUDA round on the GPU", [&](auto) { called = true; }),
      "triattn: fp8_e4m3 KV is not supported by the Python CUDA round on the GPU yet", unsupported);
  CHECK_FALSE(called);
  // the host dispatch reaches every dtype, fp8 included
  CHECK(dispatch_dtype(DType::kFP8E4M3, [](auto t) { return sizeof(typename decltype(t)::type); }) == 1);
  CHECK(dispatch_dtype_in(device_storage_types{}, DType::kFP8E4M3, "x", [](auto t) { return dtype_of<typename decltype(t)::type>; }) ==
        DType::kFP8E4M3);
  CHECK(dispatch_dtype_in(unscaled_storage_types{}, DType::kBF16, "x", [](auto t) { return dtype_of<typename decltype(t)::type>; }) ==
        DType::kBF16);
  CHECK_THROWS_WITH_AS(dispatch_dtype(static_cast<DType>(9), [](auto) {}), doctest::Contains("dtype 9 not supported"),
                       unsupported);
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// GPU scorer (cuda::score) against the CPU reference (ref::score_sequence): fresh seeded random
// caches with randomised page tables, every dtype (fp8 with per-head K scales, scored against the
// dequantised keys), both layouts, page sizes {1, 7, 16, 64}, head
// dims {64, 128}, both RoPE pairings, mean and max aggregation, disable_mlr / disable_trig, GQA
// group sizes 1..16, the production kernels and every fallback (scoring policies with the ring
// kernels or the tensor-core max turned off; each also with a 3-CTA grid). Scores must match within
// ‖gpu − ref‖/‖ref‖ <= 1e-5, every slot < length must be written (outputs are poisoned with NaN
// before each launch) and nothing past it.
#include <doctest/doctest.h>

#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/ref/score.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/algorithms/score.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

using namespace triattn;

namespace {

/// A paged cache holding `lens.size()` sequences in random slots with randomly permuted blocks.
template <class T>
struct Paged {
  int L = 0, Hkv = 0, d = 0, bs = 0, max_seqs = 0, max_blocks = 0, num_blocks = 0, max_len = 0;
  KvLayout layout = KvLayout::kNHD;
  std::vector<int> lens, seq_ids;          // [batch]
  std::vector<T> data;                     // [2L, num_blocks, block elems]
  std::vector<int> tables, seq_lens;       // [max_seqs, max_blocks], [max_seqs]
  test::DeviceBuffer<T> d_data;
  test::DeviceBuffer<int> d_tables, d_lens, d_seq_ids;
  std::vector<float> scales;               // fp8: [L, 2 (K, V), Hkv] per-head scales; else empty
  test::DeviceBuffer<float> d_scales;

  BlockLayout block() const { return BlockLayout{layout, bs, Hkv, d}; }
  std::int64_t range_stride() const { return static_cast<std::int64_t>(num_blocks) * block().block_elems(); }
  KvCacheView<T, int> host_view() {
    return KvCacheView<T, int>::contiguous(data.data(), range_stride(), block(), L, num_blocks, max_seqs, max_blocks, tables.data(), seq_lens.data())
        .with_scales(scales.empty() ? nullptr : scales.data(), Hkv);
  }
  KvCacheView<T, int> device_view() const {
    return KvCacheView<T, int>::contiguous(d_data.get(), range_stride(), block(), L, num_blocks, max_seqs, max_blocks, d_tables.get(), d_lens.get())
        .with_scales(scales.empty() ? nullptr : d_scales.get(), Hkv);
  }
};

template <class T>
void make_paged(Paged<T>& p, std::mt19937& rng, int L, int Hkv, int d, int bs, KvLayout layout, std::vector<int> lens) {
  p.L = L;
  p.Hkv = Hkv;
  p.d = d;
  p.bs = bs;
  p.layout = layout;
  p.lens = std::move(lens);
  const int batch = static_cast<int>(p.lens.size());
  p.max_seqs = batch + 2;
  std::vector<int> slots(p.max_seqs);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  p.seq_ids.assign(slots.begin(), slots.begin() + batch);
  int need = 0;
  p.max_blocks = 1;
  p.max_len = 1;
  for (int len : p.lens) {
    need += (len + bs - 1) / bs;
    p.max_blocks = std::max(p.max_blocks, (len + bs - 1) / bs + 1);
    p.max_len = std::max(p.max_len, len);
  }
  p.num_blocks = need + 3;
  std::vector<int> ids(p.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.tables.assign(static_cast<std::size_t>(p.max_seqs) * p.max_blocks, -1);
  p.seq_lens.assign(p.max_seqs, 0);
  int next = 0;
  for (int b = 0; b < batch; ++b) {
    const int s = p.seq_ids[b];
    p.seq_lens[s] = p.lens[b];
    for (int j = 0; j < (p.lens[b] + bs - 1) / bs; ++j)
      p.tables[static_cast<std::size_t>(s) * p.max_blocks + j] = ids[next++];
  }
  const std::size_t elems = static_cast<std::size_t>(2 * L) * p.range_stride();
  p.data.resize(elems);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (T& x : p.data) x = from_float<T>(nd(rng));
  p.d_data.reset(elems);
  p.d_data.upload(p.data);
  p.d_tables.reset(p.tables.size());
  p.d_tables.upload(p.tables);
  p.d_lens.reset(p.seq_lens.size());
  p.d_lens.upload(p.seq_lens);
  p.d_seq_ids.reset(p.seq_ids.size());
  p.d_seq_ids.upload(p.seq_ids);
  if constexpr (is_scaled_dtype<T>) {  // distinct per (layer, kind, head): reading another head's fails
    std::uniform_real_distribution<float> u(0.25f, 4.0f);
    p.scales.resize(static_cast<std::size_t>(2 * L * Hkv));
    for (float& x : p.scales) x = u(rng);
    p.d_scales = test::DeviceBuffer<float>(p.scales);
  }
}

QueryStats random_stats(std::mt19937& rng, int L, int Hq, int d, RopeStyle style) {
  return random_query_stats(rng, L, Hq, d, style);
}

/// CPU reference scores of batch entry b: [L, Hq, len].
template <class T>
std::vector<float> ref_scores(Paged<T>& p, const TriAttentionModel& m, int b, long long t0) {
  const int len = p.lens[b], seq = p.seq_ids[b];
  std::vector<float> out(static_cast<std::size_t>(m.num_layers()) * m.num_q_heads() * len);
  std::vector<float> key(p.d);
  const KvCacheView<T, int> v = p.host_view();
  ref::score_sequence(
      m, t0,
      [&](int l, int g, int j) -> const float* {
        const T* k = v.token(l, KvKind::kKey, seq, j, g);
        for (int e = 0; e < p.d; ++e) key[e] = dequantize(k[e], v.scale(l, KvKind::kKey, g));
        return key.data();
      },
      len, out.data());
  return out;
}

struct Case {
  int L = 2, Hq = 8, Hkv = 2, d = 128, bs = 16;
  KvLayout layout = KvLayout::kNHD;
  RopeStyle style = RopeStyle::kHalf;
  Aggregation agg = Aggregation::kMean;
  bool no_mlr = false, no_trig = false;
  int offset_max = 65536;
  std::vector<int> lens{37, 150, 0, 263};

  std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "L=%d Hq=%d Hkv=%d d=%d bs=%d %s %s %s%s%s M=%d", L, Hq, Hkv, d, bs,
                  layout_name(layout), style == RopeStyle::kHalf ? "half" : "interleaved", to_string(agg),
                  no_mlr ? " disable_mlr" : "", no_trig ? " disable_trig" : "", offset_max);
    return buf;
  }
};

double compare(const Case& c, const std::vector<float>& got, const std::vector<std::vector<float>>& wants, int max_len);

// The kernel families check_case runs: the production policy, then the fallbacks (the non-ring
// kernels that K ranges of 64 GiB or more take; the CUDA-core max kernel that fp16 weights near
// fp16's range limit take).
struct NoRingPolicy : cuda::tuning::sm90::Score {
  static constexpr bool kRingKernels = false;
};
struct CudaCoreMaxPolicy : cuda::tuning::sm90::Score {
  static constexpr bool kTensorCoreMax = false;
};
constexpr int kPolicies = 3;
constexpr const char* kPolicyNames[kPolicies] = {"production", "no ring kernels", "CUDA-core max"};

// Largest normalised error and number of runs per policy of the max aggregation on 16-bit caches
// since the last reset (the GQA case reports them).
double g_max_nerr[kPolicies] = {};
int g_max_runs[kPolicies] = {};

template <class T, class Id>
cudaError_t score_with(int policy, const KvCacheView<T, Id>& view, const cuda::ScoreModelView& m,
                       const cuda::ScoreBatch& b, float* scores, const cuda::ScoreOptions& opt) {
  if (policy == 1) return cuda::score<T, Id, NoRingPolicy>(view, m, b, scores, nullptr, opt);
  if (policy == 2) return cuda::score<T, Id, CudaCoreMaxPolicy>(view, m, b, scores, nullptr, opt);
  return cuda::score(view, m, b, scores, nullptr, opt);
}

/// Runs one case on the GPU and compares with the CPU reference.
template <class T>
void check_case(const Case& c, std::uint32_t seed) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", c.name(), " dtype ", dtype_name(dtype_of<T>));
  std::mt19937 rng(seed);
  Paged<T> p;
  make_paged(p, rng, c.L, c.Hkv, c.d, c.bs, c.layout, c.lens);
  const int batch = static_cast<int>(c.lens.size());
  RopeConfig rope;
  rope.style = c.style;
  rope.theta = std::uniform_real_distribution<double>(1e4, 1e6)(rng);
  ScoringParams sp;
  sp.aggregation = c.agg;
  sp.disable_mlr = c.no_mlr;
  sp.disable_trig = c.no_trig;
  sp.offset_max_length = c.offset_max;
  cuda::TriAttentionDeviceScorer scorer(random_stats(rng, c.L, c.Hq, c.d, c.style), rope, sp, c.Hkv);

  std::vector<std::int64_t> t0(batch);
  for (int b = 0; b < batch; ++b) t0[b] = c.lens[b] + std::uniform_int_distribution<int>(0, 300000)(rng);
  test::DeviceBuffer<std::int64_t> d_t0(t0.size());
  d_t0.upload(t0);
  const int max_len = p.max_len + 5;  // rows longer than every sequence: the tail must stay untouched
  test::DeviceBuffer<float> scores(static_cast<std::size_t>(batch) * c.L * c.Hq * max_len);
  std::vector<std::vector<float>> wants;
  for (int b = 0; b < batch; ++b) wants.push_back(ref_scores(p, scorer.model(), b, t0[b]));
  // 16-bit caches: the production kernels (ring kernels on the tensor cores) and both fallback
  // policies; fp32 caches have one path (the CUDA-core kernels), run by every policy alike.
  const int policies = sizeof(T) == 2 ? kPolicies : 1;
  const bool max16 = c.agg == Aggregation::kMax && !c.no_trig && sizeof(T) == 2;
  for (int policy = 0; policy < policies; ++policy) {
    if (policy == 2 && !max16) break;  // the CUDA-core max policy changes nothing else
    for (const int max_ctas : {0, 3}) {  // default grid, at most 3 CTAs (each walks many rows)
      INFO("policy ", kPolicyNames[policy], ", max_ctas = ", max_ctas);
      scores.poison();
      const cuda::ScoreBatch sb{p.d_seq_ids.get(), d_t0.get(), batch, max_len};
      cuda::ScoreOptions opt;
      opt.max_ctas = max_ctas;
      TRIATTN_TEST_CUDA(score_with(policy, p.device_view(), scorer.device_model(), sb, scores.get(), opt));
      TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
      const double nerr = compare(c, scores.download(), wants, max_len);
      if (max16) {
        g_max_nerr[policy] = std::max(g_max_nerr[policy], nerr);
        ++g_max_runs[policy];
      }
    }
  }
}

/// 1 where this file's device code is compiled with wgmma (the scorers' TRIATTN_WGMMA_ENABLED).
__global__ void wgmma_probe(int* out) {
#ifdef TRIATTN_WGMMA_ENABLED
  *out = 1;
#else
  *out = 0;
#endif
}

double compare(const Case& c, const std::vector<float>& got, const std::vector<std::vector<float>>& wants, int max_len) {
  const int batch = static_cast<int>(c.lens.size());

  double err2 = 0.0, ref2 = 0.0;
  long long unwritten = 0, overwritten = 0;
  for (int b = 0; b < batch; ++b) {
    const std::vector<float>& want = wants[static_cast<std::size_t>(b)];
    const int len = c.lens[b];
    for (int r = 0; r < c.L * c.Hq; ++r) {
      const float* g = got.data() + (static_cast<std::size_t>(b) * c.L * c.Hq + r) * max_len;
      for (int j = 0; j < len; ++j) {
        const double w = want[static_cast<std::size_t>(r) * len + j];
        if (!std::isfinite(g[j])) {
          ++unwritten;
          continue;
        }
        err2 += (g[j] - w) * (g[j] - w);
        ref2 += w * w;
      }
      for (int j = len; j < max_len; ++j) {
        std::uint32_t bits;
        std::memcpy(&bits, g + j, 4);
        overwritten += bits != 0xffffffffu;
      }
    }
  }
  CHECK_MESSAGE(unwritten == 0, unwritten, " scores within the lengths were not written");
  CHECK_MESSAGE(overwritten == 0, overwritten, " slots past the lengths were written");
  const double nerr = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  CHECK_MESSAGE(nerr <= 1e-5, "normalised error ", nerr);
  return nerr;
}

}  // namespace

TEST_CASE("FastDiv divides exactly for every n < 2^31 (host twin of the device code)") {
  std::mt19937 rng(12345);
  for (int d : {1, 2, 3, 5, 7, 16, 17, 63, 64, 100, 127, 1000, 65535, 1 << 20, 2147483647}) {
    const cuda::detail::FastDiv fd(d);
    for (std::uint32_t n : {0u, 1u, 2u, 6u, 7u, 8u, 0x7fffffffu, 0x7ffffffeu, static_cast<std::uint32_t>(d),
                            static_cast<std::uint32_t>(d) - 1u})
      if (n < 0x80000000u) REQUIRE_EQ(fd.div(n), n / static_cast<std::uint32_t>(d));
    std::uniform_int_distribution<std::uint32_t> u(0, 0x7fffffffu);
    for (int i = 0; i < 20000; ++i) {
      const std::uint32_t n = u(rng);
      REQUIRE_EQ(fd.div(n), n / static_cast<std::uint32_t>(d));
    }
  }
}

TEST_CASE("wgmma descriptors advanced in place equal descriptors rebuilt at the later address (host twin)") {
  // The max scorers build one descriptor per operand and advance its low word per k-step; that is
  // exact while the operand stays inside the 227 KB of shared memory a CTA can have.
  constexpr std::uint32_t kSmem = 227u * 1024u;
  int checked = 0;
  for (std::uint32_t base = 0; base < kSmem; base += 1024u)
    for (std::uint32_t off = 0; base + off < kSmem; off += 16u * 37u) {  // 16-byte steps, all residues of 2^k
      REQUIRE_EQ(cuda::detail::wgmma_desc_advance(cuda::detail::wgmma_desc_kmajor_sw128(base, 1024u), off),
                 cuda::detail::wgmma_desc_kmajor_sw128(base + off, 1024u));
      REQUIRE_EQ(cuda::detail::wgmma_desc_advance(cuda::detail::wgmma_desc_kmajor(base, 128u, 256u), off),
                 cuda::detail::wgmma_desc_kmajor(base + off, 128u, 256u));
      ++checked;
    }
  CHECK_EQ(checked, 44872);  // 227 bases x every 592-byte step below 227 KB
  // past the 14-bit address field (256 KB) the advance would carry into the next field: the
  // precondition is real, and the check above would catch a descriptor layout that broke it
  CHECK_NE(cuda::detail::wgmma_desc_advance(cuda::detail::wgmma_desc_kmajor(0x3FFF0u, 128u, 256u), 16u),
           cuda::detail::wgmma_desc_kmajor(0x40000u, 128u, 256u));
}

TEST_CASE("ring scorers take K ranges below 64 GiB only (32-bit chunk offsets - host routing rule)") {
  // KeySliceFeed::issue addresses a key as a uint32 count of 16-byte chunks from its layer's K
  // range; cuda::score routes views whose addressable extent is larger to the non-ring kernels.
  // Two blocks `stride` apart, one head vector of 8 elements: the extent is stride + 8 elements.
  KvCacheView<bf16_storage, std::int32_t> v{};
  v.num_blocks = 2;
  for (const long long bytes : {1LL << 20, (1LL << 35) + 2, (1LL << 36) - 2, 1LL << 36, (1LL << 36) + 2, 1LL << 40}) {
    v.block = BlockLayout::strided(1, 1, 8, bytes / static_cast<long long>(sizeof(bf16_storage)) - 8, 8, 8);
    CHECK_EQ(cuda::range_extent(v) * 2, bytes);
    const bool fits = cuda::detail::ring_offsets_fit(v);
    CHECK_EQ(fits, bytes < (1LL << 36));
    if (fits) CHECK_LE((bytes - 1) / 16, 0xffffffffLL);  // the last chunk's offset is a uint32
  }
  KvCacheView<float, std::int64_t> w{};
  w.num_blocks = 2;
  w.block = BlockLayout::strided(1, 1, 4, (1LL << 34) - 1 - 4, 4, 4);  // 4 bytes each: just under 64 GiB
  CHECK(cuda::detail::ring_offsets_fit(w));
  w.block.stride_block += 1;
  CHECK_FALSE(cuda::detail::ring_offsets_fit(w));
}

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("score matches the CPU reference over page sizes x layouts x head dims x pairings x aggregations",
                     T, float, f16_storage, bf16_storage, fp8_e4m3_storage) {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (int bs : {1, 7, 16, 64})
      for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
        for (int d : {64, 128})
          for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved})
            for (Aggregation agg : {Aggregation::kMean, Aggregation::kMax}) {
              Case c;
              c.bs = bs;
              c.layout = layout;
              c.d = d;
              c.style = style;
              c.agg = agg;
              // Cycle the variants across the grid so that every (pairing, aggregation) meets all
              // four: combo % 4 is that pair, combo / 4 the (page size, layout, head dim) block.
              // (combo % 4 alone gave interleaved pairing the trig term off in every case.)
              const int v = (combo % 4 + combo / 4) % 4;
              c.no_mlr = v == 1 || v == 3;
              c.no_trig = v == 2 || v == 3;
              check_case<T>(c, seed + static_cast<std::uint32_t>(combo));
              ++combo;
            }
  }

  TEST_CASE("score: GQA group sizes 1..16 (head chunks of 4 and 8)") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (int v = 0; v < kPolicies; ++v) g_max_nerr[v] = g_max_runs[v] = 0;
    for (int G : {1, 2, 3, 4, 5, 7, 8, 12, 16})
      for (Aggregation agg : {Aggregation::kMean, Aggregation::kMax}) {
        Case c;
        c.Hkv = 2;
        c.Hq = 2 * G;
        c.agg = agg;
        c.bs = 16;
        c.lens = {90, 211};
        check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
        for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {  // fp8: 4-byte runs for chunks of 8
          c.style = style;
          check_case<fp8_e4m3_storage>(c, seed + static_cast<std::uint32_t>(combo++));
        }
      }
    for (int v = 0; v < kPolicies; ++v) {  // the max kernels on bf16 at |D| = 17
      MESSAGE(kPolicyNames[v], ": ", g_max_runs[v], " runs, largest normalised error ", g_max_nerr[v]);
      CHECK(g_max_runs[v] > 0);
    }
  }

  TEST_CASE("score: long sequences over many tiles and short offset sets") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    Case c;
    c.L = 3;
    c.Hq = 16;
    c.Hkv = 4;
    c.lens = {5000, 1, 2049, 4097};
    c.offset_max = 1;  // |D| = 1: max and mean coincide in value, different kernels
    check_case<bf16_storage>(c, seed);
    c.agg = Aggregation::kMax;
    check_case<bf16_storage>(c, seed + 1);
    c.offset_max = 1000;  // |D| = 10
    check_case<f16_storage>(c, seed + 2);
    c.offset_max = 1 << 20;  // |D| = 21: more offsets than one wgmma covers (the mma.sync kernels)
    c.lens = {700, 33};
    check_case<bf16_storage>(c, seed + 4);
    c.lens = {5000, 1, 2049, 4097};
    c.agg = Aggregation::kMean;
    c.layout = KvLayout::kHND;
    c.bs = 7;
    check_case<float>(c, seed + 3);
  }

  TEST_CASE("the max scorer is compiled with warpgroup MMAs where the build targets sm_90a") {
    triattn::test::require_device();
    test::DeviceBuffer<int> flag(1);
    flag.poison();
    wgmma_probe<<<1, 1>>>(flag.get());
    TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
#ifdef TRIATTN_TEST_EXPECT_WGMMA
    CHECK(flag.download()[0] == 1);
#else
    CHECK(flag.download()[0] == 0);
#endif
  }

  TEST_CASE("TriAttentionDeviceScorer::score (the KvCache::compress interface) matches the CPU scorer") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    INFO("seed ", seed);
    std::mt19937 rng(seed);
    Paged<bf16_storage> p;
    make_paged(p, rng, 2, 2, 128, 16, KvLayout::kNHD, {300, 77});
    RopeConfig rope;
    rope.theta = 1e6;
    cuda::TriAttentionDeviceScorer scorer(random_stats(rng, 2, 8, 128, RopeStyle::kHalf), rope, ScoringParams{}, 2);
    for (int b = 0; b < 2; ++b) {
      const long long t0 = 12345 + b;
      std::vector<float> out(static_cast<std::size_t>(2) * 8 * p.lens[b], std::nanf(""));
      scorer.score(p.device_view(), p.seq_ids[b], p.lens[b], t0, std::span<float>(out));
      const std::vector<float> want = ref_scores(p, scorer.model(), b, t0);
      double e2 = 0, r2 = 0;
      for (std::size_t i = 0; i < out.size(); ++i) {
        REQUIRE(std::isfinite(out[i]));
        e2 += (out[i] - want[i]) * (out[i] - want[i]);
        r2 += want[i] * want[i];
      }
      CHECK(std::sqrt(e2 / r2) <= 1e-5);
    }
    // Host-memory tables are refused with a message instead of crashing the kernel.
    std::vector<float> out(static_cast<std::size_t>(2) * 8 * p.lens[0]);
    CHECK_THROWS_AS(scorer.score(p.host_view(), p.seq_ids[0], p.lens[0], 1, std::span<float>(out)), logic_error);
  }
}

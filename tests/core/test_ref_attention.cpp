// SPDX-License-Identifier: Apache-2.0
// ref::attention (the oracle of the CUDA decode attention): exact small cases, GQA head mapping,
// paged == contiguous for both layouts, agreement with a float64 naive implementation, empty
// sequences and argument errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/ref/attention.hpp>

namespace {

using namespace triattn;

/// One-layer paged cache on the host with explicit block tables.
template <class T>
struct HostPaged {
  BlockLayout block;
  int num_blocks;
  std::vector<T> pool;
  std::vector<std::int32_t> tables;
  std::vector<std::int32_t> lens;
  int max_blocks_per_seq;

  HostPaged(KvLayout layout, int bs, int hkv, int d, std::vector<int> seq_lens, bool shuffle, std::mt19937_64& rng)
      : block{layout, bs, hkv, d}, lens(seq_lens.begin(), seq_lens.end()) {
    max_blocks_per_seq = 1;
    int total = 0;
    for (int l : seq_lens) {
      max_blocks_per_seq = std::max(max_blocks_per_seq, (l + bs - 1) / bs);
      total += (l + bs - 1) / bs;
    }
    num_blocks = std::max(total, 1);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    if (shuffle) std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(seq_lens.size() * static_cast<std::size_t>(max_blocks_per_seq), -1);
    std::size_t next = 0;
    for (std::size_t s = 0; s < seq_lens.size(); ++s)
      for (int j = 0; j < (seq_lens[s] + bs - 1) / bs; ++j) tables[s * max_blocks_per_seq + j] = ids[next++];
    pool.assign(2 * static_cast<std::size_t>(num_blocks) * block.block_elems(), from_float<T>(0.f));
  }
  KvCacheView<T, std::int32_t> view() {
    return KvCacheView<T, std::int32_t>::contiguous(pool.data(), static_cast<std::int64_t>(num_blocks) * block.block_elems(),
                                                    block, 1, num_blocks, static_cast<int>(lens.size()),
                                                    max_blocks_per_seq, tables.data(), lens.data());
  }
  /// Logical K/V [len, hkv, d] of sequence s written through the tables.
  void fill(int s, const std::vector<float>& k, const std::vector<float>& v) {
    auto vw = view();
    const int d = block.head_dim, hkv = block.num_kv_heads;
    for (int j = 0; j < lens[static_cast<std::size_t>(s)]; ++j)
      for (int h = 0; h < hkv; ++h)
        for (int e = 0; e < d; ++e) {
          const std::size_t i = (static_cast<std::size_t>(j) * hkv + h) * d + e;
          vw.token(0, KvKind::kKey, s, j, h)[e] = from_float<T>(k[i]);
          vw.token(0, KvKind::kValue, s, j, h)[e] = from_float<T>(v[i]);
        }
  }
};

std::vector<float> uniform(std::mt19937_64& rng, std::size_t n, float scale) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> x(n);
  for (auto& e : x) e = dist(rng);
  return x;
}

}  // namespace

TEST_CASE("ref::attention: one token returns its value vector and equal keys average the values") {
  std::mt19937_64 rng(1);
  const int d = 8, hkv = 1, hq = 2;
  HostPaged<float> c(KvLayout::kNHD, 4, hkv, d, {1, 3}, false, rng);
  const auto k1 = uniform(rng, d, 1.f), v1 = uniform(rng, d, 1.f);
  c.fill(0, k1, v1);
  std::vector<float> k3, v3;
  for (int j = 0; j < 3; ++j) {
    k3.insert(k3.end(), k1.begin(), k1.end());  // identical keys
    const auto vj = uniform(rng, d, 1.f);
    v3.insert(v3.end(), vj.begin(), vj.end());
  }
  c.fill(1, k3, v3);
  const auto q = uniform(rng, hq * d, 3.f);
  std::vector<float> out(hq * d);
  ref::attention(c.view(), 0, 0, q.data(), hq, out.data(), ref::default_sm_scale(d));
  for (int h = 0; h < hq; ++h)
    for (int e = 0; e < d; ++e) CHECK(out[h * d + e] == v1[e]);
  ref::attention(c.view(), 0, 1, q.data(), hq, out.data(), ref::default_sm_scale(d));
  for (int h = 0; h < hq; ++h)
    for (int e = 0; e < d; ++e) CHECK(out[h * d + e] == doctest::Approx((v3[e] + v3[d + e] + v3[2 * d + e]) / 3).epsilon(1e-6));
}

TEST_CASE("ref::attention: query head h reads KV head h / G") {
  std::mt19937_64 rng(2);
  const int d = 4, hkv = 2, group = 3, hq = hkv * group, len = 5;
  HostPaged<float> c(KvLayout::kHND, 2, hkv, d, {len}, true, rng);
  std::vector<float> k = uniform(rng, static_cast<std::size_t>(len) * hkv * d, 1.f), v(k.size());
  for (int j = 0; j < len; ++j)
    for (int h = 0; h < hkv; ++h)
      for (int e = 0; e < d; ++e) v[(static_cast<std::size_t>(j) * hkv + h) * d + e] = static_cast<float>(h + 1);
  c.fill(0, k, v);
  const auto q = uniform(rng, hq * d, 1.f);
  std::vector<float> out(hq * d);
  ref::attention(c.view(), 0, 0, q.data(), hq, out.data(), 0.7f);
  for (int h = 0; h < hq; ++h)
    for (int e = 0; e < d; ++e) CHECK(out[h * d + e] == doctest::Approx(h / group + 1).epsilon(1e-6));
}

TEST_CASE_TEMPLATE("ref::attention: paged == contiguous for both layouts and matches float64", T, float, bf16_storage) {
  std::mt19937_64 rng(3);
  const int d = 32, hkv = 2, hq = 8;
  const std::vector<int> lens{37, 0, 100};
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
    for (int bs : {1, 7, 16}) {
      CAPTURE(bs);
      HostPaged<T> paged(layout, bs, hkv, d, lens, true, rng);
      HostPaged<T> flat(KvLayout::kNHD, 1 << 10, hkv, d, lens, false, rng);
      std::vector<std::vector<float>> ks, vs;
      for (std::size_t s = 0; s < lens.size(); ++s) {
        ks.push_back(uniform(rng, static_cast<std::size_t>(lens[s]) * hkv * d, 1.f));
        vs.push_back(uniform(rng, static_cast<std::size_t>(lens[s]) * hkv * d, 1.f));
        paged.fill(static_cast<int>(s), ks.back(), vs.back());
        flat.fill(static_cast<int>(s), ks.back(), vs.back());
      }
      std::vector<T> q(lens.size() * hq * d);
      for (auto& x : q) x = from_float<T>(std::uniform_real_distribution<float>(-2.f, 2.f)(rng));
      const std::vector<int> seqs{2, 0, 1};
      std::vector<float> a(q.size()), b(q.size());
      const float scale = ref::default_sm_scale(d);
      ref::attention(paged.view(), 0, std::span<const int>(seqs), q.data(), hq, a.data(), scale);
      ref::attention(flat.view(), 0, std::span<const int>(seqs), q.data(), hq, b.data(), scale);
      CHECK(a == b);  // same arithmetic in the same order
      // entry 2 attends the empty sequence 1: zeros
      for (int i = 0; i < hq * d; ++i) CHECK(a[static_cast<std::size_t>(2 * hq * d + i)] == 0.f);
      // float64 naive softmax on the stored (rounded) values
      double num = 0, den = 0;
      for (std::size_t bi = 0; bi < seqs.size(); ++bi) {
        const int s = seqs[bi], len = lens[static_cast<std::size_t>(s)];
        if (len == 0) continue;
        auto vw = paged.view();
        for (int h = 0; h < hq; ++h) {
          const int kvh = h / (hq / hkv);
          std::vector<double> sc(static_cast<std::size_t>(len));
          double mx = -1e300;
          for (int j = 0; j < len; ++j) {
            double acc = 0;
            for (int e = 0; e < d; ++e)
              acc += static_cast<double>(to_float(q[(bi * hq + h) * d + e])) * to_float(vw.token(0, KvKind::kKey, s, j, kvh)[e]);
            sc[static_cast<std::size_t>(j)] = acc * scale;
            mx = std::max(mx, acc * scale);
          }
          double l = 0;
          std::vector<double> o(static_cast<std::size_t>(d), 0.0);
          for (int j = 0; j < len; ++j) {
            const double p = std::exp(sc[static_cast<std::size_t>(j)] - mx);
            l += p;
            for (int e = 0; e < d; ++e) o[static_cast<std::size_t>(e)] += p * to_float(vw.token(0, KvKind::kValue, s, j, kvh)[e]);
          }
          for (int e = 0; e < d; ++e) {
            const double want = o[static_cast<std::size_t>(e)] / l;
            const double got = a[(bi * hq + h) * d + e];
            num += (got - want) * (got - want);
            den += want * want;
          }
        }
      }
      CHECK(std::sqrt(num / den) < 1e-6);
    }
}

TEST_CASE("ref::attention: bad arguments throw logic_error") {
  std::mt19937_64 rng(4);
  HostPaged<float> c(KvLayout::kNHD, 4, 2, 8, {3}, false, rng);
  std::vector<float> q(16 * 8), out(16 * 8);
  CHECK_THROWS_AS(ref::attention(c.view(), 1, 0, q.data(), 4, out.data(), 1.f), logic_error);  // layer
  CHECK_THROWS_AS(ref::attention(c.view(), 0, 1, q.data(), 4, out.data(), 1.f), logic_error);  // sequence
  CHECK_THROWS_AS(ref::attention(c.view(), 0, 0, q.data(), 3, out.data(), 1.f), logic_error);  // 3 % 2 != 0
}

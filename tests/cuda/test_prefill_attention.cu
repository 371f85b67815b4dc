// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The tensor-core causal prefill attention (examples/reference_transformer/prefill_attention.cuh,
// issue #48):
//   * against a float64 CPU attention on random q and a random paged cache (shuffled block
//     tables): bf16 and f16, page sizes 16 and 64, NHD and HND, head_dim 64 and 128, GQA groups
//     4 (8:2), 1 (4:4), 3 (9:3, SmolLM2's) and 8 (16:2), ragged chunks of 1, 7, 64, 300 and 45
//     rows after random physical lengths (the 45-row chunk after 600..900 slots: more KV blocks
//     than the cp.async ring holds), one chunk's rows split around another sequence's (two runs
//     of one sequence). The output is poisoned (NaN) first, and the slots past each sequence's
//     length are NaN in the cache: a (row, head) not written, or a slot read past the tile's last
//     one, shows. The reference takes q rounded to the cache type (what the kernel multiplies);
//     what is left is P rounded to the cache type (FlashAttention's choice, <= 2^-9 relative per
//     weight in bf16) and fp32 accumulation, checked against 1e-2 of the row's max |output|. A
//     causal off-by-one shows on the short rows (a row of one slot outputs that slot's V exactly).
//   * refusals: an fp32 cache, head_dim 96, GQA groups 0 and 129 and a mismatched KV head count
//     throw typed errors naming the dtype / head_dim / group / heads.
//   * Model<CudaBackend> with a bf16 cache, prompts fed in ragged chunks (7, 64, 300 tokens per
//     step) then forced decode steps: the backend runs the prefill kernel, and the logits stay
//     within the bf16 tolerance (3e-2 of max |logit|) of the CPU model on the same cache dtype.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda_test_utils.cuh"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/model.hpp>
#include <reference_transformer/prefill_attention.cuh>
#include <reference_transformer/synthetic.hpp>

namespace {

namespace ex = triattn_example;
namespace gpu = triattn_example::gpu;
using triattn::BlockLayout;
using triattn::KvCacheView;
using triattn::KvKind;
using triattn::KvLayout;
using triattn::test::DeviceBuffer;
using triattn::test::PagedFixture;

/// The kernel through a plain launch on the default stream.
template <class T>
void launch_prefill(const gpu::PrefillAttentionParams<T>& p, int head_dim, int n_tiles) {
  gpu::run_prefill_attention(p, head_dim, n_tiles, [](auto kernel, dim3 grid, dim3 block, std::size_t smem, auto&&... args) {
    kernel<<<grid, block, smem>>>(args...);
  });
  TRIATTN_TEST_CUDA(cudaGetLastError());
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
}

/// Row r (query head h) of a float64 attention over slots [0, slot] of seq: softmax(q·k / sqrt(d)) · V.
template <class T>
std::vector<double> ref_row(const KvCacheView<T, std::int32_t>& v, int layer, int seq, int slot, int kvh,
                            const float* q, int d) {
  std::vector<double> s(static_cast<std::size_t>(slot) + 1);
  double mx = -INFINITY;
  for (int t = 0; t <= slot; ++t) {
    const T* k = v.token(layer, KvKind::kKey, seq, t, kvh);
    double dot = 0;
    for (int e = 0; e < d; ++e) dot += static_cast<double>(q[e]) * triattn::to_float(k[e]);
    s[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(d));
    mx = std::max(mx, s[static_cast<std::size_t>(t)]);
  }
  double l = 0;
  std::vector<double> o(static_cast<std::size_t>(d), 0.0);
  for (int t = 0; t <= slot; ++t) {
    const double p = std::exp(s[static_cast<std::size_t>(t)] - mx);
    l += p;
    const T* vv = v.token(layer, KvKind::kValue, seq, t, kvh);
    for (int e = 0; e < d; ++e) o[static_cast<std::size_t>(e)] += p * triattn::to_float(vv[e]);
  }
  for (double& x : o) x /= l;
  return o;
}

template <class T>
void check_against_reference(std::mt19937_64& rng, int block_size, KvLayout layout, int d, int hq, int hkv) {
  constexpr int kLayers = 2, kLayer = 1;
  // Chunks of 1, 7, 64, 300, 45 rows; the 300-row chunk starts at slot 0 (rows of 1..300 slots),
  // the 45-row one after 600..900 slots, the others after a random physical length (slots, as
  // after compression rounds).
  const std::vector<int> chunk = {1, 7, 64, 300, 45};
  std::vector<int> before(chunk.size()), cap(chunk.size()), len(chunk.size());
  std::uniform_int_distribution<int> before_d(1, 150), long_d(600, 900), spare_d(1, 40);
  for (std::size_t s = 0; s < chunk.size(); ++s) {
    before[s] = chunk[s] == 300 ? 0 : chunk[s] == 45 ? long_d(rng) : before_d(rng);
    len[s] = before[s] + chunk[s];
    cap[s] = len[s] + spare_d(rng);
  }
  PagedFixture<T> f(rng, layout, block_size, hkv, d, kLayers, cap, len);
  for (std::size_t s = 0; s < chunk.size(); ++s) f.poison_slots(static_cast<int>(s), len[s], cap[s] - len[s]);
  f.upload_pool();

  // Row order: seq 3's first 150 rows, seqs 1 and 0, seq 3's last 150 rows, seqs 2 and 4.
  std::vector<std::int32_t> row_seq, row_slot;
  auto add_rows = [&](int s, int i0, int i1) {
    for (int i = i0; i < i1; ++i) {
      row_seq.push_back(s);
      row_slot.push_back(before[static_cast<std::size_t>(s)] + i);
    }
  };
  add_rows(3, 0, 150);
  add_rows(1, 0, 7);
  add_rows(0, 0, 1);
  add_rows(3, 150, 300);
  add_rows(2, 0, 64);
  add_rows(4, 0, 45);
  const int n = static_cast<int>(row_seq.size());
  const std::vector<gpu::PrefillTile> tiles = gpu::build_prefill_tiles(row_seq.data(), row_slot.data(), n, hq / hkv);

  // q with logits of a few units (a peaked softmax), rounded to T for the reference.
  std::uniform_real_distribution<float> qd(-6.0f, 6.0f);
  std::vector<float> q(static_cast<std::size_t>(n) * hq * d);
  for (float& x : q) x = qd(rng);
  std::vector<float> q_t(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q_t[i] = triattn::to_float(triattn::from_float<T>(q[i]));

  DeviceBuffer<float> d_q(q), d_out(q.size());
  DeviceBuffer<std::int32_t> d_slot(row_slot);
  DeviceBuffer<gpu::PrefillTile> d_tiles(tiles);
  d_out.poison();
  gpu::PrefillAttentionParams<T> p{};
  p.out = d_out.get();
  p.q = d_q.get();
  p.view = f.device_view();
  p.row_slot = d_slot.get();
  p.tiles = d_tiles.get();
  p.layer = kLayer;
  p.hq = hq;
  p.group = hq / hkv;
  p.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(d)));
  launch_prefill(p, d, static_cast<int>(tiles.size()));
  const std::vector<float> out = d_out.download();

  const auto hv = f.host_view();
  int bad = 0;
  double worst = 0;
  for (int r = 0; r < n; ++r)
    for (int h = 0; h < hq; ++h) {
      const std::size_t base = (static_cast<std::size_t>(r) * hq + h) * d;
      const std::vector<double> want =
          ref_row(hv, kLayer, row_seq[static_cast<std::size_t>(r)], row_slot[static_cast<std::size_t>(r)], h / (hq / hkv),
                  q_t.data() + base, d);
      double scale = 0;
      for (double x : want) scale = std::max(scale, std::fabs(x));
      for (int e = 0; e < d; ++e) {
        const double err = std::fabs(static_cast<double>(out[base + e]) - want[static_cast<std::size_t>(e)]) / (scale + 1e-30);
        if (!(err <= 1e-2)) {
          if (bad++ == 0)
            FAIL_CHECK("row ", r, " (seq ", row_seq[static_cast<std::size_t>(r)], ", slot ", row_slot[static_cast<std::size_t>(r)],
                       ") head ", h, " dim ", e, ": got ", out[base + e], ", want ", want[static_cast<std::size_t>(e)]);
        } else {
          worst = std::max(worst, err);
        }
      }
    }
  CHECK_MESSAGE(bad == 0, bad << " output elements beyond 1e-2 relative error");
  MESSAGE("worst relative error " << worst);
}

/// Prompts fed in steps of at most `chunk` tokens (every unfinished prompt advances by up to
/// `chunk` tokens per step: ragged), then `steps` forced decode tokens; the logits of every step.
template <class ModelT, class Cache>
std::vector<std::vector<float>> run_chunked(ModelT& model, Cache& cache, const std::vector<std::vector<int>>& prompts,
                                            int chunk, int steps) {
  std::vector<triattn::SeqId> ids;
  for (std::size_t i = 0; i < prompts.size(); ++i) ids.push_back(cache.add_sequence());
  std::vector<std::vector<float>> all;
  std::vector<std::size_t> done(prompts.size(), 0);
  for (bool more = true; more;) {
    std::vector<ex::Chunk> chunks;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const std::size_t k = std::min(prompts[i].size() - done[i], static_cast<std::size_t>(chunk));
      if (k == 0) continue;
      chunks.push_back(ex::Chunk{ids[i], std::span<const int>(prompts[i].data() + done[i], k), triattn::Phase::kPrefill});
      done[i] += k;
    }
    more = !chunks.empty();
    if (more) all.push_back(model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk).logits);
  }
  triattn::test::forced_decode_steps(model, cache, ids, steps, all);
  for (const triattn::SeqId id : ids) cache.release(id);
  return all;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE_TEMPLATE("prefill attention: tensor-core kernel equals a float64 causal attention over the paged cache", T,
                   triattn::bf16_storage, triattn::f16_storage) {
  triattn::test::require_device();
  const std::uint64_t seed = triattn::test::test_seed() ^ triattn::test::dtype_salt<T>();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const int bs : {16, 64})
    for (const KvLayout layout : triattn::test::kLayouts)
      for (const int d : triattn::test::kHeadDims)
        for (const auto& [hq, hkv] : {std::pair{8, 2}, std::pair{4, 4}, std::pair{9, 3}, std::pair{16, 2}}) {
          INFO("page size " << bs << ", layout " << (layout == KvLayout::kNHD ? "NHD" : "HND") << ", head_dim " << d << ", "
                            << hq << " query heads / " << hkv << " KV heads");
          check_against_reference<T>(rng, bs, layout, d, hq, hkv);
        }
}

TEST_CASE("prefill attention: fp32 caches and other head dims and GQA groups and a wrong head count are refused by name") {
  triattn::test::require_device();
  const BlockLayout b64(KvLayout::kNHD, 16, 2, 64);
  gpu::PrefillAttentionParams<float> pf{};
  pf.view.block = b64;
  pf.hq = 8;
  pf.group = 4;
  auto no_launch = [](auto, dim3, dim3, std::size_t, auto&&...) { FAIL("launched"); };
  CHECK_THROWS_WITH_AS(gpu::run_prefill_attention(pf, 64, 1, no_launch), doctest::Contains("float32"), triattn::unsupported);
  gpu::PrefillAttentionParams<triattn::bf16_storage> pb{};
  pb.view.block = BlockLayout(KvLayout::kNHD, 16, 2, 96);
  pb.hq = 8;
  pb.group = 4;
  CHECK_THROWS_WITH_AS(gpu::run_prefill_attention(pb, 96, 1, no_launch), doctest::Contains("96"), triattn::unsupported);
  pb.view.block = b64;
  pb.group = 0;
  CHECK_THROWS_WITH_AS(gpu::run_prefill_attention(pb, 64, 1, no_launch), doctest::Contains("GQA group 0"), triattn::unsupported);
  pb.hq = 258;
  pb.group = 129;  // 2 KV heads of 129 query heads: more than one CTA's 128 MMA rows
  CHECK_THROWS_WITH_AS(gpu::run_prefill_attention(pb, 64, 1, no_launch), doctest::Contains("GQA group 129"),
                       triattn::unsupported);
  pb.hq = 8;
  pb.group = 2;  // 8 / 2 = 4 KV heads, the cache has 2
  CHECK_THROWS_WITH_AS(gpu::run_prefill_attention(pb, 64, 1, no_launch), doctest::Contains("KV heads"), triattn::error);
}

TEST_CASE("prefill attention: chunked prefill on a bf16 cache stays within the bf16 tolerance of the CPU") {
  triattn::test::require_device();
  for (const int hd : {64, 128}) {
    const ex::ModelConfig c = triattn::test::small_config(hd);  // 4 query heads, 2 KV heads
    const ex::ModelWeights w = ex::make_synthetic_weights(c, 41);
    std::vector<std::vector<int>> prompts;
    for (const int len : {45, 1, 137, 300}) prompts.push_back(triattn::test::prompt_tokens(len, static_cast<int>(prompts.size()), c.vocab_size));
    constexpr int kSteps = 6;
    const auto cfg = triattn::test::cache_config(c, 300 + kSteps, static_cast<int>(prompts.size()), 16, triattn::DType::kBF16);
    ex::Model<> cm(w);
    triattn::KvCache<> cc(cfg);
    for (const int chunk : {7, 64, 300}) {
      INFO("head_dim " << hd << ", prefill chunk " << chunk);
      const auto want = run_chunked(cm, cc, prompts, chunk, kSteps);
      ex::CudaBackend be;
      ex::Model<ex::CudaBackend> gm(w, be);
      ex::GpuPlainCache gc(cfg, triattn::cuda::DeviceCompactor(be.stream()));
      const auto got = run_chunked(gm, gc, prompts, chunk, kSteps);
      CHECK(be.stats().prefill_attention > 0);  // the tensor-core kernel ran the prefill steps
      REQUIRE(got.size() == want.size());
      float worst = 0.0f, scale = 0.0f;
      for (std::size_t s = 0; s < got.size(); ++s) {
        worst = std::max(worst, triattn::test::max_abs_diff(got[s], want[s]));
        for (float x : want[s]) scale = std::max(scale, std::fabs(x));
      }
      CHECK_MESSAGE(worst <= 3e-2f * scale, "max |GPU - CPU| logit " << worst << " vs max |logit| " << scale);
      MESSAGE("head_dim " << hd << ", chunk " << chunk << ": max |GPU - CPU| " << worst << " (max |logit| " << scale << ")");
    }
  }
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// Shared fixture of the compression-round GPU tests (test_compression_round.cu and
// test_graph_capture.cu): random paged caches, model statistics, CPU reference rounds and the
// device round with its workspace. Test-only; included once per test TU.
#pragma once

#include <doctest/doctest.h>

#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/ref/compact.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/core/ref/score.hpp>
#include <triattn/core/ref/select.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

using namespace triattn;

namespace {

QueryStats random_stats(std::mt19937& rng, int L, int Hq, int d, RopeStyle style) {
  return random_query_stats(rng, L, Hq, d, style);
}

struct RoundCase {
  int L = 3, Hq = 8, Hkv = 2, d = 128, bs = 16;
  KvLayout layout = KvLayout::kNHD;
  RopeStyle style = RopeStyle::kHalf;
  Aggregation agg = Aggregation::kMean;
  std::vector<int> lens{600, 333, 257, 41};
  std::vector<int> prompts{40, 0, 257, 10};
  SelectionParams sp;

  std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "L=%d Hq=%d Hkv=%d d=%d bs=%d %s %s %s budget=%d mode=%s prompt=%s sink=%d window=%d", L, Hq, Hkv, d,
                  bs, layout_name(layout), style == RopeStyle::kHalf ? "half" : "interleaved", to_string(agg),
                  sp.budget, to_string(sp.mode), to_string(sp.prompt), sp.n_sink, sp.window);
    return buf;
  }
};

/// Everything a round needs, host and device, built from a case and a seed.
template <class T>
struct RoundFixture {
  RoundCase c;
  int batch = 0, max_len = 0, max_seqs = 0, max_blocks = 0, num_blocks = 0, max_keep = 0;
  std::vector<int> seq_ids, tables, seq_lens;
  std::vector<std::int64_t> t0;
  std::vector<T> data;  // [2L, num_blocks, block elems] original contents
  std::vector<float> scales;  // fp8: [L, 2 (K, V), Hkv] per-head scales; else empty
  test::DeviceBuffer<T> d_data;
  test::DeviceBuffer<float> d_scales;
  test::DeviceBuffer<int> d_tables, d_lens, d_seq_ids, d_prompts;
  test::DeviceBuffer<std::int64_t> d_t0;
  test::DeviceBuffer<std::int32_t> d_kept, d_keep;
  test::DeviceBuffer<char> d_ws;
  std::size_t ws_bytes = 0;
  std::unique_ptr<cuda::TriAttentionDeviceScorer> scorer;

  RoundFixture(const RoundCase& rc, std::uint32_t seed) : c(rc) {
    std::mt19937 rng(seed);
    batch = static_cast<int>(c.lens.size());
    max_seqs = batch + 2;
    std::vector<int> slots(max_seqs);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    seq_ids.assign(slots.begin(), slots.begin() + batch);
    int need = 0;
    max_blocks = 1;
    max_len = 1;
    for (int len : c.lens) {
      need += (len + c.bs - 1) / c.bs;
      max_blocks = std::max(max_blocks, (len + c.bs - 1) / c.bs + 1);
      max_len = std::max(max_len, len);
    }
    num_blocks = need + 2;
    std::vector<int> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(static_cast<std::size_t>(max_seqs) * max_blocks, -1);
    seq_lens.assign(max_seqs, 0);
    int next = 0;
    for (int b = 0; b < batch; ++b) {
      seq_lens[seq_ids[b]] = c.lens[b];
      for (int j = 0; j < (c.lens[b] + c.bs - 1) / c.bs; ++j)
        tables[static_cast<std::size_t>(seq_ids[b]) * max_blocks + j] = ids[next++];
    }
    data.resize(static_cast<std::size_t>(2 * c.L) * range_stride());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (T& x : data) x = from_float<T>(nd(rng));
    t0.resize(batch);
    for (int b = 0; b < batch; ++b) t0[b] = c.lens[b] + std::uniform_int_distribution<int>(0, 200000)(rng);

    RopeConfig rope;
    rope.style = c.style;
    rope.theta = 1e6;
    ScoringParams scp;
    scp.aggregation = c.agg;
    scorer = std::make_unique<cuda::TriAttentionDeviceScorer>(random_stats(rng, c.L, c.Hq, c.d, c.style), rope, scp,
                                                               c.Hkv);

    d_data.reset(data.size());
    d_data.upload(data);
    d_tables.reset(tables.size());
    d_tables.upload(tables);
    d_lens.reset(seq_lens.size());
    d_lens.upload(seq_lens);
    d_seq_ids.reset(batch);
    d_seq_ids.upload(seq_ids);
    d_prompts.reset(batch);
    d_prompts.upload(c.prompts);
    d_t0.reset(batch);
    d_t0.upload(t0);
    max_keep = cuda::compression_round::safe_max_keep(max_len);
    d_kept.reset(static_cast<std::size_t>(batch) * c.L * c.Hkv * max_keep);
    d_keep.reset(batch);
    ws_bytes = cuda::compression_round::workspace_size(shape(), c.sp.mode, batch, max_len);
    d_ws.reset(ws_bytes);
    if constexpr (is_scaled_dtype<T>) {  // distinct per (layer, kind, head): reading another head's fails
      std::uniform_real_distribution<float> u(0.25f, 4.0f);
      scales.resize(static_cast<std::size_t>(2 * c.L * c.Hkv));
      for (float& x : scales) x = u(rng);
      d_scales = test::DeviceBuffer<float>(scales);
    }
  }

  BlockLayout block() const { return BlockLayout{c.layout, c.bs, c.Hkv, c.d}; }
  std::int64_t range_stride() const { return static_cast<std::int64_t>(num_blocks) * block().block_elems(); }
  cuda::RoundShape shape() const { return {c.L, c.Hq, c.Hkv}; }
  KvCacheView<T, int> host_view(T* d) {
    return KvCacheView<T, int>::contiguous(d, range_stride(), block(), c.L, num_blocks, max_seqs, max_blocks, tables.data(), seq_lens.data())
        .with_scales(scales.empty() ? nullptr : scales.data(), c.Hkv);
  }
  KvCacheView<T, int> device_view() const {
    return KvCacheView<T, int>::contiguous(d_data.get(), range_stride(), block(), c.L, num_blocks, max_seqs, max_blocks, d_tables.get(), d_lens.get())
        .with_scales(scales.empty() ? nullptr : d_scales.get(), c.Hkv);
  }
  cuda::RoundBatch round_batch() const { return {d_seq_ids.get(), d_t0.get(), d_prompts.get(), batch, max_len}; }
  cuda::DeviceKeepPlanView plan() const { return {d_kept.get(), d_keep.get(), max_keep}; }
  /// Raw scores of the last round ([batch, L, Hq, max_len]; union mode overwrote the selectable slots).
  std::vector<float> round_scores() const {
    cuda::RoundWorkspace ws;
    cuda::detail::carve_round_workspace(d_ws.get(), shape(), c.sp.mode, batch, max_len, &ws);
    std::vector<float> h(static_cast<std::size_t>(batch) * c.L * c.Hq * max_len);
    TRIATTN_TEST_CUDA(cudaMemcpy(h.data(), ws.scores, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace

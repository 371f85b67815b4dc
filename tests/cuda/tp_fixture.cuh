// SPDX-License-Identifier: Apache-2.0
// Shared fixture of the tensor-parallel GPU tests (test_tensor_parallel.cu, one GPU, and
// test_tensor_parallel_multi.cu, two GPUs): one random full-model paged cache with statistics
// (HostRound), each rank's share of it (its KV heads' bytes under the same block tables, its
// query heads' statistics), the device buffers of one rank's round (DeviceRound, allocated on
// the current device), and the comparison of a rank's plan and compacted cache with the tp = 1
// round's. Rank threads never use doctest assertions: they return cudaError_t and the main thread
// checks. Test-only; included once per test TU.
#pragma once

#include <doctest/doctest.h>

#include "cuda_test_utils.cuh"

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/ref/select.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/core/tp/rank_geometry.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace tpfix {

using namespace triattn;

inline std::uint32_t seed() {
  if (const char* s = std::getenv("TRIATTN_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  static const std::uint32_t fresh = std::random_device{}();
  return fresh;
}

/// Device allocation that never asserts (usable in rank threads); check ok() in the main thread.
template <class U>
struct Dev {
  U* p = nullptr;
  std::size_t n = 0;
  cudaError_t status = cudaSuccess;
  Dev() = default;
  explicit Dev(std::size_t count) : n(count) { status = cudaMalloc(&p, (count ? count : 1) * sizeof(U)); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  Dev(Dev&& o) noexcept : p(std::exchange(o.p, nullptr)), n(o.n), status(o.status) {}
  Dev& operator=(Dev&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    std::swap(status, o.status);
    return *this;
  }
  ~Dev() {
    if (p) (void)cudaFree(p);
  }
  cudaError_t upload(const std::vector<U>& h) {
    return h.size() > n ? cudaErrorInvalidValue : cudaMemcpy(p, h.data(), h.size() * sizeof(U), cudaMemcpyHostToDevice);
  }
  cudaError_t download(std::vector<U>& h) const {
    h.resize(n);
    return cudaMemcpy(h.data(), p, n * sizeof(U), cudaMemcpyDeviceToHost);
  }
  /// 0xFF bytes (NaN floats, -1 ints), waited for: the memset runs on the legacy default stream,
  /// which the tests' non-blocking streams do not wait for.
  cudaError_t poison() {
    const cudaError_t e = cudaMemset(p, 0xff, n * sizeof(U));
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
};

struct TpCase {
  int L = 3, Hq = 8, Hkv = 4, d = 128, bs = 16;
  KvLayout layout = KvLayout::kNHD;
  RopeStyle style = RopeStyle::kHalf;
  Aggregation agg = Aggregation::kMean;
  std::vector<int> lens{600, 333, 257, 41};
  std::vector<int> prompts{40, 0, 257, 10};
  SelectionParams sp;

  [[nodiscard]] std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "L=%d Hq=%d Hkv=%d d=%d bs=%d %s %s %s budget=%d mode=%s prompt=%s sink=%d window=%d norm=%d",
                  L, Hq, Hkv, d, bs, layout_name(layout), style == RopeStyle::kHalf ? "half" : "interleaved",
                  to_string(agg), sp.budget, to_string(sp.mode), to_string(sp.prompt), sp.n_sink, sp.window,
                  sp.normalize ? 1 : 0);
    return buf;
  }
};

inline SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window, bool normalize = true) {
  SelectionParams p;
  p.budget = budget;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  p.normalize = normalize;
  return p;
}

/// Every mode × prompt mode, with sinks, a window and normalisation off in turn, block sizes 16/7,
/// both layouts, both pairings (the combinations the single-GPU round tests also cover).
inline std::vector<TpCase> all_mode_cases() {
  std::vector<TpCase> out;
  int combo = 0;
  for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
    for (PromptMode prompt : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete}) {
      TpCase c;
      c.sp = sel(combo % 2 ? 200 : 96, mode, prompt, combo % 3 == 1 ? 4 : 0, combo % 3 == 2 ? 32 : 0, combo % 4 != 3);
      c.bs = combo % 2 ? 7 : 16;
      c.layout = combo % 4 < 2 ? KvLayout::kNHD : KvLayout::kHND;
      c.style = combo % 3 == 0 ? RopeStyle::kInterleaved : RopeStyle::kHalf;
      out.push_back(c);
      ++combo;
    }
  return out;
}

inline QueryStats random_stats(std::mt19937& rng, int L, int Hq, int d, RopeStyle style) {
  return random_query_stats(rng, L, Hq, d, style);
}

/// The host side of a round on the full model: sequences in shuffled slots, shuffled blocks,
/// random K/V, round starts, statistics.
template <class T>
struct HostRound {
  TpCase c;
  int batch = 0, max_len = 1, max_seqs = 0, max_blocks = 1, num_blocks = 0;
  std::vector<int> seq_ids, tables, seq_lens;
  std::vector<std::int64_t> t0;
  QueryStats stats;
  std::vector<T> data;  // [2L, num_blocks, block elems] with all Hkv heads

  HostRound(const TpCase& tc, std::uint32_t s) : c(tc) {
    std::mt19937 rng(s);
    batch = static_cast<int>(c.lens.size());
    max_seqs = batch + 2;
    std::vector<int> slots(static_cast<std::size_t>(max_seqs));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    seq_ids.assign(slots.begin(), slots.begin() + batch);
    int need = 0;
    for (int len : c.lens) {
      need += (len + c.bs - 1) / c.bs;
      max_blocks = std::max(max_blocks, (len + c.bs - 1) / c.bs + 1);
      max_len = std::max(max_len, len);
    }
    num_blocks = need + 2;
    std::vector<int> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(static_cast<std::size_t>(max_seqs) * max_blocks, -1);
    seq_lens.assign(static_cast<std::size_t>(max_seqs), 0);
    int next = 0;
    for (int b = 0; b < batch; ++b) {
      seq_lens[seq_ids[b]] = c.lens[b];
      for (int j = 0; j < (c.lens[b] + c.bs - 1) / c.bs; ++j)
        tables[static_cast<std::size_t>(seq_ids[b]) * max_blocks + j] = ids[next++];
    }
    data.resize(static_cast<std::size_t>(2 * c.L) * num_blocks * block(c.Hkv).block_elems());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (T& x : data) x = from_float<T>(nd(rng));
    t0.resize(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) t0[b] = c.lens[b] + std::uniform_int_distribution<int>(0, 200000)(rng);
    stats = random_stats(rng, c.L, c.Hq, c.d, c.style);
  }

  [[nodiscard]] BlockLayout block(int kv_heads) const { return BlockLayout{c.layout, c.bs, kv_heads, c.d}; }
  [[nodiscard]] std::int64_t range_stride(int kv_heads) const {
    return static_cast<std::int64_t>(num_blocks) * block(kv_heads).block_elems();
  }
  /// A host view of `d` (data of a cache with `kv_heads` heads under this round's tables).
  [[nodiscard]] KvCacheView<T, int> host_view(T* d, int kv_heads) {
    return KvCacheView<T, int>::contiguous(d, range_stride(kv_heads), block(kv_heads), c.L, num_blocks, max_seqs, max_blocks, tables.data(),
            seq_lens.data());
  }
  /// Rank r of tp's cache bytes: the same blocks and tables, KV heads [r·Hkv/tp, (r+1)·Hkv/tp).
  [[nodiscard]] std::vector<T> rank_data(int tp, int r) {
    const int hn = c.Hkv / tp, h0 = r * hn;
    std::vector<T> out(static_cast<std::size_t>(2 * c.L) * num_blocks * block(hn).block_elems(), from_float<T>(0.0f));
    const KvCacheView<T, int> src = host_view(data.data(), c.Hkv), dst = host_view(out.data(), hn);
    for (int b = 0; b < batch; ++b)
      for (int l = 0; l < c.L; ++l)
        for (int kind = 0; kind < 2; ++kind)
          for (int j = 0; j < c.lens[b]; ++j)
            for (int h = 0; h < hn; ++h)
              std::memcpy(dst.token(l, static_cast<KvKind>(kind), seq_ids[b], j, h),
                          src.token(l, static_cast<KvKind>(kind), seq_ids[b], j, h0 + h), c.d * sizeof(T));
    return out;
  }
};

/// One rank's round on the current device: its cache bytes, the round's tables and inputs, its
/// scorer (its query heads' statistics), keep plan and workspace. Build it in the main thread
/// with the rank's device current; ok() says whether every allocation and upload worked.
template <class T>
struct DeviceRound {
  int L = 0, Hq = 0, Hkv = 0, batch = 0, max_len = 0, max_seqs = 0, max_blocks = 0, num_blocks = 0, max_keep = 0;
  BlockLayout block{};
  PruningMode mode = PruningMode::kPerHead;
  Dev<T> data;
  Dev<int> tables, lens, seq_ids, prompts;
  Dev<std::int64_t> t0;
  Dev<std::int32_t> kept, keep;
  Dev<char> ws;
  std::size_t ws_bytes = 0;
  std::unique_ptr<cuda::TriAttentionDeviceScorer> scorer;
  cudaError_t status = cudaSuccess;

  /// tp = 1 when tp == 1 (rank 0 holds everything).
  DeviceRound(HostRound<T>& h, int tp, int r) {
    const TpCase& c = h.c;
    L = c.L;
    Hq = c.Hq / tp;
    Hkv = c.Hkv / tp;
    batch = h.batch;
    max_len = h.max_len;
    max_seqs = h.max_seqs;
    max_blocks = h.max_blocks;
    num_blocks = h.num_blocks;
    block = h.block(Hkv);
    mode = c.sp.mode;
    const std::vector<T> bytes = tp == 1 ? h.data : h.rank_data(tp, r);
    data = Dev<T>(bytes.size());
    tables = Dev<int>(h.tables.size());
    lens = Dev<int>(h.seq_lens.size());
    seq_ids = Dev<int>(h.seq_ids.size());
    prompts = Dev<int>(c.prompts.size());
    t0 = Dev<std::int64_t>(h.t0.size());
    max_keep = cuda::compression_round::safe_max_keep(max_len);
    kept = Dev<std::int32_t>(static_cast<std::size_t>(batch) * L * Hkv * max_keep);
    keep = Dev<std::int32_t>(static_cast<std::size_t>(batch));
    ws_bytes = cuda::compression_round::workspace_size(shape(), mode, batch, max_len);
    ws = Dev<char>(ws_bytes);
    const cudaError_t steps[] = {data.status, tables.status, lens.status, seq_ids.status, prompts.status, t0.status,
                                 kept.status, keep.status, ws.status, data.upload(bytes), tables.upload(h.tables),
                                 lens.upload(h.seq_lens), seq_ids.upload(h.seq_ids), prompts.upload(c.prompts),
                                 t0.upload(h.t0), kept.poison(), keep.poison(), ws.poison()};
    for (const cudaError_t e : steps)
      if (status == cudaSuccess) status = e;
    RopeConfig rope;
    rope.style = c.style;
    rope.theta = 1e6;
    ScoringParams scp;
    scp.aggregation = c.agg;
    const QueryStats mine = tp == 1 ? h.stats : slice_for_rank(h.stats, r, tp, c.Hkv);
    scorer = std::make_unique<cuda::TriAttentionDeviceScorer>(mine, rope, scp, Hkv);
  }

  [[nodiscard]] cuda::RoundShape shape() const { return {L, Hq, Hkv}; }
  [[nodiscard]] std::int64_t range_stride() const { return static_cast<std::int64_t>(num_blocks) * block.block_elems(); }
  [[nodiscard]] KvCacheView<T, int> view() const {
    return KvCacheView<T, int>::contiguous(data.p, range_stride(), block, L, num_blocks, max_seqs, max_blocks, tables.p, lens.p);
  }
  [[nodiscard]] cuda::RoundBatch round_batch() const { return {seq_ids.p, t0.p, prompts.p, batch, max_len}; }
  [[nodiscard]] cuda::DeviceKeepPlanView plan() const { return {kept.p, keep.p, max_keep}; }
  [[nodiscard]] cuda::RoundWorkspace workspace() const {
    cuda::RoundWorkspace w;
    cuda::detail::carve_round_workspace(ws.p, shape(), mode, batch, max_len, &w);
    return w;
  }
  /// The round's score buffer [batch, L, Hq, max_len] (union: Ŝ on the selectable slots).
  [[nodiscard]] cudaError_t round_scores(std::vector<float>& out) const {
    out.resize(static_cast<std::size_t>(batch) * L * Hq * max_len);
    return cudaMemcpy(out.data(), workspace().scores, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  }
};

/// What a finished round left, downloaded.
template <class T>
struct TpRoundResult {
  std::vector<std::int32_t> kept, keep;
  std::vector<T> data;
  std::vector<float> scores;
};

template <class T>
void download(const DeviceRound<T>& d, TpRoundResult<T>& out) {
  TRIATTN_TEST_CUDA(d.kept.download(out.kept));
  TRIATTN_TEST_CUDA(d.keep.download(out.keep));
  TRIATTN_TEST_CUDA(d.data.download(out.data));
  TRIATTN_TEST_CUDA(d.round_scores(out.scores));
}

/// Rank r's round equals the tp = 1 round on its heads: keep counts, plan rows (l, g) against
/// (l, r·hkv + g), the compacted bytes of its KV heads, and (diagnostic) its score rows.
template <class T>
void check_rank_against_full(HostRound<T>& h, const DeviceRound<T>& full_dev, const TpRoundResult<T>& full,
                             const DeviceRound<T>& rank_dev, TpRoundResult<T>& rank, int tp, int r) {
  const TpCase& c = h.c;
  const int hkv = c.Hkv / tp, hq = c.Hq / tp;
  INFO("rank ", r, " of tp ", tp);
  int bad_keep = 0, bad_rows = 0, bad_vectors = 0, bad_score_rows = 0;
  const KvCacheView<T, int> fv = h.host_view(const_cast<T*>(full.data.data()), c.Hkv);
  const KvCacheView<T, int> rv = h.host_view(rank.data.data(), hkv);
  for (int b = 0; b < h.batch; ++b) {
    if (rank.keep[b] != full.keep[b]) {
      ++bad_keep;
      continue;
    }
    const int k = full.keep[b];
    for (int l = 0; l < c.L; ++l)
      for (int g = 0; g < hkv; ++g) {
        const std::int32_t* want = full.kept.data() + ((static_cast<std::size_t>(b) * c.L + l) * c.Hkv + r * hkv + g) * full_dev.max_keep;
        const std::int32_t* got = rank.kept.data() + ((static_cast<std::size_t>(b) * c.L + l) * hkv + g) * rank_dev.max_keep;
        bad_rows += !std::equal(want, want + k, got);
        for (int kind = 0; kind < 2; ++kind)
          for (int j = 0; j < k; ++j)
            bad_vectors += std::memcmp(rv.token(l, static_cast<KvKind>(kind), h.seq_ids[b], j, g),
                                       fv.token(l, static_cast<KvKind>(kind), h.seq_ids[b], j, r * hkv + g),
                                       c.d * sizeof(T)) != 0;
      }
    for (int l = 0; l < c.L; ++l)
      for (int q = 0; q < hq; ++q) {
        const float* want = full.scores.data() + ((static_cast<std::size_t>(b) * c.L + l) * c.Hq + r * hq + q) * full_dev.max_len;
        const float* got = rank.scores.data() + ((static_cast<std::size_t>(b) * c.L + l) * hq + q) * rank_dev.max_len;
        bad_score_rows += std::memcmp(want, got, static_cast<std::size_t>(c.lens[b]) * sizeof(float)) != 0;
      }
  }
  CHECK_MESSAGE(bad_keep == 0, bad_keep, " sequences keep another count than at tp = 1");
  CHECK_MESSAGE(bad_rows == 0, bad_rows, " plan rows differ from the tp = 1 plan");
  CHECK_MESSAGE(bad_vectors == 0, bad_vectors, " compacted head vectors differ from the tp = 1 cache");
  CHECK_MESSAGE(bad_score_rows == 0, bad_score_rows,
                " score rows differ bitwise from the tp = 1 round's (the scorer or normaliser depends on the head count)");
}

/// The tp = 1 round's plan equals ref::select_keep on the GPU's own raw scores (CPU oracle).
/// @param raw [batch, L, Hq, max_len] raw scores of a separate cuda::score launch before the round
template <class T>
void check_full_against_ref(const HostRound<T>& h, const std::vector<float>& raw, const DeviceRound<T>& dev,
                            const TpRoundResult<T>& full) {
  const TpCase& c = h.c;
  for (int b = 0; b < h.batch; ++b) {
    const int len = c.lens[b];
    const std::size_t rows = static_cast<std::size_t>(c.L) * c.Hq;
    std::vector<float> s(rows * len);
    for (std::size_t q = 0; q < rows; ++q)
      std::copy_n(raw.data() + (static_cast<std::size_t>(b) * rows + q) * dev.max_len, len, s.begin() + q * len);
    const KeepPlan plan = ref::select_keep(s.data(), c.L, c.Hq, c.Hkv, len, c.prompts[b], c.sp);
    INFO("batch entry ", b, " length ", len, " prompt ", c.prompts[b]);
    REQUIRE(full.keep[b] == plan.keep);
    int bad = 0;
    for (int l = 0; l < c.L; ++l)
      for (int g = 0; g < c.Hkv; ++g)
        bad += !std::equal(plan.row(l, g), plan.row(l, g) + plan.keep,
                           full.kept.data() + ((static_cast<std::size_t>(b) * c.L + l) * c.Hkv + g) * dev.max_keep);
    CHECK_MESSAGE(bad == 0, bad, " tp = 1 GPU plan rows differ from ref::select_keep");
  }
}

/// Raw scores of the tp = 1 cache before its round ([batch, L, Hq, max_len], poisoned first).
template <class T>
std::vector<float> raw_scores(const DeviceRound<T>& d) {
  test::DeviceBuffer<float> buf(static_cast<std::size_t>(d.batch) * d.L * d.Hq * d.max_len);
  buf.poison();
  TRIATTN_TEST_CUDA(cuda::score(d.view(), d.scorer->device_model(),
                                cuda::ScoreBatch{d.seq_ids.p, d.t0.p, d.batch, d.max_len}, buf.get()));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  return buf.download();
}

}  // namespace tpfix

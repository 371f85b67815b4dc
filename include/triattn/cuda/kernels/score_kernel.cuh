// SPDX-License-Identifier: Apache-2.0
// TriAttention key-scoring kernels (spec §3). One pass over the paged K cache per (sequence,
// layer, KV head): every key is read once with 16-byte loads and scored for all G query heads of
// its KV head at once (a [T×d]·[d×G] product plus an F-long norm term).
//
//   mean aggregation (or disable_trig): the exact fold, score = Σ_f W_re·k_re + W_im·k_im
//                                        + Σ_f c_f·sqrt(k_re² + k_im² + 1e-8)
//                                        (score_mean_kernel: CUDA cores, bound by reading K)
//   max aggregation:                     |D| folds (one per offset δ), max over δ: a
//                                        [T×d]·[d×|D|·G] product, on the tensor cores for 16-bit
//                                        caches (score_max_mma_kernel), else CUDA cores
//                                        (score_max_kernel, ~4.5x the K read time in FMAs)
//   16-bit caches, ring kernels:         score_mean_mma_kernel (mean dot products on the tensor
//                                        cores) and score_max_mma_pipe_kernel; keys stream
//                                        through per-warp cp.async rings (KeySliceFeed)
//
// All kernels accumulate in fp32 in a fixed order: the same inputs give bitwise the same scores
// (what CUDA-graph replays and the round's determinism rely on).
//
// The per-round weights are computed on the device from per-model constants (ScoreModelView) and
// the round start t0 read from device memory, with core's TRIATTN_HOST_DEVICE helpers
// (rope_phase, fold_weight_from_phase): a round needs no host work and no host-to-device copy, so
// it can be captured in a CUDA graph.
//
// Work decomposition: a "row" is (sequence b, layer l, KV head g, head chunk hc); rows are cut
// into tiles of kTile keys; each CTA takes a contiguous range of (row, tile) items, so it
// recomputes the weights only when its row changes (usually once or twice per CTA).
// Lane mapping (CUDA-core kernels): a group of LPK lanes owns one key; lane i of the group owns
// the P consecutive frequency pairs [i·P, (i+1)·P), i.e. whole complex pairs in both RoPE pairings, loaded with
// 16-byte (8-byte for GMAX = 8, 16-bit types, half pairing) loads. Partial sums of the GMAX heads
// are combined across the group with a reduce-scatter (log2(LPK) shuffle steps, GMAX−1 shuffles
// for HD 64, GMAX for HD 128), after which each lane holds the score of one head.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/math/score_math.hpp>
#include <triattn/core/math/score_model.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device/async_copy.cuh>
#include <triattn/cuda/device/fast_div.cuh>
#include <triattn/cuda/device/item_walk.cuh>
#include <triattn/cuda/device/loads.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/kernels/wgmma.cuh>
#include <triattn/cuda/score_model_view.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

namespace detail {

/// |K_f| = sqrt(sq) for sq = re² + im² + 1e-8 >= 1e-8 (a normal float): one MUFU.SQRT. sqrtf
/// adds a denormal fix-up (a compare, a scale and two selects per pair) that cannot trigger here,
/// and sq · rsqrt(sq) one more multiply; the MUFU result is within ~2 ulp, far inside the 1e-5
/// budget.
__device__ __forceinline__ float pair_norm(float sq) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(sq));
  return r;
}

/// cos and sin of the float64 RoPE phase of position t at frequency omega (the phase fold_weight()
/// uses), with one range reduction for both (sincos; within an ulp of separate cos and sin, and
/// the same on every call, so scores stay deterministic).
__device__ __forceinline__ void rope_cos_sin(long long t, double omega, double& cs, double& sn) {
  ::sincos(rope_phase(t, omega), &sn, &cs);
}

/// Compile-time shape of one scoring kernel instance.
template <class T, int HD, int GMAX, int kUnrollCap>
struct ScoreShape {
  static_assert(GMAX == 4 || GMAX == 8, "heads per pass: 4 or 8");
  static constexpr int kF = HD / 2;                  // frequency pairs
  static constexpr int kP = 32 / GMAX;               // pairs per lane (P·GMAX = 32 partial sums)
  static constexpr int kLPK = kF / kP;               // lanes per key
  static_assert(kLPK >= GMAX && kLPK <= 32 && (kLPK & (kLPK - 1)) == 0, "lanes per key");
  static constexpr int kKPW = 32 / kLPK;             // keys per warp pass
  static constexpr int kSegBytes = kP * static_cast<int>(sizeof(T));  // one component run (half pairing)
  static constexpr int kWords = 2 * kSegBytes / 4;   // raw 32-bit words per key per lane
  static constexpr int kU = (64 / kWords) < (32 / GMAX) ? (64 / kWords) : (32 / GMAX);  // keys per lane
  static constexpr int kUnroll = kU < kUnrollCap ? kU : kUnrollCap;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = kWarps * kKPW * kUnroll;  // keys per CTA step
  static constexpr int kQ = GMAX / 4;                // float4 per (pair, weight kind)
};

/// Re and Im of the lane's pair j, read from its raw words (see load order in load_key).
template <class T, RopeStyle S, int P>
__device__ __forceinline__ void pair_of(const std::uint32_t* words, int j, float& re, float& im) {
  if constexpr (S == RopeStyle::kHalf) {
    re = element<T>(words, j);      // first run: Re of pairs [iP, iP+P)
    im = element<T>(words, P + j);  // second run: Im of the same pairs
  } else {
    re = element<T>(words, 2 * j);
    im = element<T>(words, 2 * j + 1);
  }
}

/// Loads the lane's share of one key: half pairing, elements [iP, iP+P) and [F+iP, F+iP+P);
/// interleaved, elements [2iP, 2iP+2P).
template <class T, RopeStyle S, class Shape>
__device__ __forceinline__ void load_key(const T* head_vec, int lane_in_key, std::uint32_t* words) {
  if constexpr (S == RopeStyle::kHalf) {
    load_words<Shape::kSegBytes>(head_vec + lane_in_key * Shape::kP, words);
    load_words<Shape::kSegBytes>(head_vec + Shape::kF + lane_in_key * Shape::kP, words + Shape::kWords / 2);
  } else {
    load_words<2 * Shape::kSegBytes>(head_vec + 2 * lane_in_key * Shape::kP, words);
  }
}

/// Reduce-scatter of GMAX partial sums over the LPK lanes of a key group. On return v[0] of each
/// lane holds the full sum of head `reduce_scatter_head(lane)`.
template <int LPK, int GMAX>
__device__ __forceinline__ void reduce_scatter(float (&v)[GMAX], int lane) {
  constexpr unsigned kFull = 0xffffffffu;
  int n = GMAX;
#pragma unroll
  for (int m = LPK / 2; m >= 1; m >>= 1) {
    if (n > 1) {
      const bool up = (lane & m) != 0;
#pragma unroll
      for (int i = 0; i < GMAX / 2; ++i) {
        if (i < n / 2) {
          const float send = up ? v[i] : v[i + n / 2];
          const float keep = up ? v[i + n / 2] : v[i];
          v[i] = keep + __shfl_xor_sync(kFull, send, m);
        }
      }
      n /= 2;
    } else {
      v[0] += __shfl_xor_sync(kFull, v[0], m);
    }
  }
}
/// Head (0..GMAX-1) whose sum lane `lane` holds after reduce_scatter; lanes whose bits below
/// LPK/GMAX are non-zero hold duplicates.
template <int LPK, int GMAX>
__device__ __forceinline__ int reduce_scatter_head(int lane) {
  int h = 0, n = GMAX;
#pragma unroll
  for (int m = LPK / 2; m >= 1; m >>= 1) {
    if (n > 1) {
      if (lane & m) h += n / 2;
      n /= 2;
    }
  }
  return h;
}

/// The lane's U keys of one tile of the CUDA-core mean scorers (keys key0 + u·KPW, zeros past the
/// row's length), as load_key orders their words.
/// raw: [U][kWords] words of the lane's share of each key.
template <class T, RopeStyle S, class Shape, class Id>
__device__ __forceinline__ void load_tile_keys(const KeyRowAddr<T, Id>& kr, int key0, const FastDiv& fd,
                                               int block_size, int li,
                                               std::uint32_t (&raw)[Shape::kUnroll][Shape::kWords]) {
#pragma unroll
  for (int u = 0; u < Shape::kUnroll; ++u) {
    const int t = key0 + u * Shape::kKPW;
    if (t < kr.len) {
      load_key<T, S, Shape>(kr.key(t, fd, block_size), li, raw[u]);
    } else {
#pragma unroll
      for (int w = 0; w < Shape::kWords; ++w) raw[u][w] = 0u;
    }
  }
}

/// A row's weights for the CUDA-core mean scorers, written by the whole CTA (the caller
/// synchronises before and after): W_re, W_im (the mean fold at the sequence's t0) and c of each
/// pair and head of the row's chunk, 0 past the group.
/// w_s: [pair j][kind: W_re, W_im, c][q][lane_in_key] float4, the order the lanes read them in
/// (the LPK lanes of a key group read LPK consecutive float4: conflict-free, broadcast across groups).
template <class Shape, int GMAX>
__device__ __forceinline__ void fold_mean_weights(float4* w_s, const ScoreModelView& m, const ScoreBatch& a,
                                                  const ScoreRow& row, int Hq, int G) {
  constexpr int F = Shape::kF, P = Shape::kP, LPK = Shape::kLPK, Q = Shape::kQ;
  const long long t0 = a.t0[row.b];
  for (int f = threadIdx.x; f < F; f += blockDim.x) {
    double cs = 1.0, sn = 0.0;
    if (!m.disable_trig) rope_cos_sin(t0, m.omega[f], cs, sn);
    const int i = f / P, j = f % P;
#pragma unroll
    for (int k = 0; k < GMAX; ++k) {
      const int hg = row.hc * GMAX + k;  // head within the group
      float wr = 0.0f, wi = 0.0f, c = 0.0f;
      if (hg < G) {
        const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
        if (!m.disable_trig)
          fold_weight_from_phase(m.q_re[idx], m.q_im[idx], m.cmean_re[f], m.cmean_im[f], cs, sn, m.s2, &wr, &wi);
        c = m.c[idx];
      }
      float* base = reinterpret_cast<float*>(w_s);
      base[(((j * 3 + 0) * Q + k / 4) * LPK + i) * 4 + k % 4] = wr;
      base[(((j * 3 + 1) * Q + k / 4) * LPK + i) * 4 + k % 4] = wi;
      base[(((j * 3 + 2) * Q + k / 4) * LPK + i) * 4 + k % 4] = c;
    }
  }
}

/// Scores of the lane's U keys of one tile (CUDA-core mean scorers): per key Σ_j W_re·k_re +
/// W_im·k_im + c·|k_j| over the lane's pairs, reduce-scattered over the key's lanes; one lane per
/// (key, head) stores the score of keys below `len`. Both scorers share it, so their scores are
/// bitwise the same.
/// w_s: fold_mean_weights' layout. raw: [U][kWords] (load_tile_keys).
/// scores: [batch, L, Hq, max_len].
template <class T, RopeStyle S, class Shape, int GMAX>
__device__ __forceinline__ void mean_tile_scores(const float4* w_s,
                                                 const std::uint32_t (&raw)[Shape::kUnroll][Shape::kWords], int lane,
                                                 int key0, int len, const ScoreRow& row, int L, int Hq, int G,
                                                 const ScoreBatch& a, float* __restrict__ scores) {
  constexpr int P = Shape::kP, LPK = Shape::kLPK, KPW = Shape::kKPW, U = Shape::kUnroll, Q = Shape::kQ;
  const int li = lane % LPK;                                   // lane within the key
  const int my_head = reduce_scatter_head<LPK, GMAX>(lane);    // whose sum reduce_scatter leaves here
  const bool writer = (lane & (LPK / GMAX - 1)) == 0;          // one lane per (key, head) stores
  float acc[U][GMAX];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int k = 0; k < GMAX; ++k) acc[u][k] = 0.0f;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    float4 wre[Q], wim[Q], wc[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      wre[q] = w_s[((j * 3 + 0) * Q + q) * LPK + li];
      wim[q] = w_s[((j * 3 + 1) * Q + q) * LPK + li];
      wc[q] = w_s[((j * 3 + 2) * Q + q) * LPK + li];
    }
    const float* fre = reinterpret_cast<const float*>(wre);
    const float* fim = reinterpret_cast<const float*>(wim);
    const float* fc = reinterpret_cast<const float*>(wc);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float re, im;
      pair_of<T, S, P>(raw[u], j, re, im);
      const float sq = fmaf(re, re, fmaf(im, im, 1e-8f));
      const float nrm = pair_norm(sq);
#pragma unroll
      for (int k = 0; k < GMAX; ++k) {
        acc[u][k] = fmaf(fre[k], re, acc[u][k]);
        acc[u][k] = fmaf(fim[k], im, acc[u][k]);
        acc[u][k] = fmaf(fc[k], nrm, acc[u][k]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    reduce_scatter<LPK, GMAX>(acc[u], lane);
    const int t = key0 + u * KPW;
    const int hg = row.hc * GMAX + my_head;
    if (writer && t < len && hg < G) {
      const std::int64_t o = ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
      scores[o] = acc[u][0];
    }
  }
}

}  // namespace detail

/// Mean-aggregation (and disable_trig) scorer.
/// @param view    paged cache; keys of layer l, KV head g of sequence seq_ids[b]
/// @param m       per-model constants (device)
/// @param a       batch description (device arrays)
/// @param scores  [batch, L, Hq, max_len] output; slots >= the sequence's length are not written
/// @param fd      block_size divider
template <class T, class Id, int HD, RopeStyle S, int GMAX>
__global__ void __launch_bounds__(detail::ScoreShape<T, HD, GMAX, 8>::kThreads, 2)
    score_mean_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                      detail::FastDiv fd) {
  using Shape = detail::ScoreShape<T, HD, GMAX, 8>;
  constexpr int P = Shape::kP, LPK = Shape::kLPK, KPW = Shape::kKPW, U = Shape::kUnroll;
  constexpr int Q = Shape::kQ, W = Shape::kWords;
  __shared__ float4 w_s[P * 3 * Q * LPK];  // the row's weights (fold_mean_weights' layout)

  const detail::ScoreWork work(m, a, GMAX, Shape::kTile);
  const int L = work.L, Hq = work.Hq, G = work.G, tiles_per_row = work.tiles_per_row;
  long long it = work.begin, end = work.end;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int li = lane % LPK, kg = lane / LPK;
  const int block_size = view.block.block_size;

  long long cur_row = -1;  // row whose weights w_s holds
  detail::ItemWalk<T, Id> walk;
  for (; walk.find(it, end, view, a, work, Shape::kTile); ++it) {
    // ---- the tile's loads go out first, so they fly while a new row's weights are computed ----
    // warp w scores keys tile_start + w·KPW·U + u·KPW + kg, u < U
    const int key0 = walk.tile(it, tiles_per_row) * Shape::kTile + warp * KPW * U + kg;
    std::uint32_t raw[U][W];
    detail::load_tile_keys<T, S, Shape>(walk.kr, key0, fd, block_size, li, raw);

    if (walk.rid != cur_row) {
      __syncthreads();  // every warp is done with the previous row's weights
      detail::fold_mean_weights<Shape, GMAX>(w_s, m, a, walk.row, Hq, G);
      __syncthreads();
      cur_row = walk.rid;
    }

    detail::mean_tile_scores<T, S, Shape, GMAX>(w_s, raw, lane, key0, walk.kr.len, walk.row, L, Hq, G, a, scores);
  }
}

/// Dynamic shared memory of score_max_kernel: per-offset W_re/W_im plus c.
template <int HD, int GMAX>
constexpr std::size_t score_max_smem_bytes(int num_offsets) {
  return (static_cast<std::size_t>(num_offsets) * 2 + 1) * (HD / 2) * GMAX * sizeof(float);
}

/// Max-aggregation scorer: comb(δ) = Σ_f W_re,f(δ)·k_re + W_im,f(δ)·k_im + Σ_f c_f·|K_f| for every δ
/// in D, max over δ. Weights W_f(δ) = s²·q̄_f·e^{i(t0+δ)ω_f} (fold_weight_from_phase_unit).
/// Same parameters as score_mean_kernel; dynamic shared memory score_max_smem_bytes<HD, GMAX>(|D|).
template <class T, class Id, int HD, RopeStyle S, int GMAX>
__global__ void __launch_bounds__(detail::ScoreShape<T, HD, GMAX, 4>::kThreads, 2)
    score_max_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                     detail::FastDiv fd) {
  using Shape = detail::ScoreShape<T, HD, GMAX, 4>;
  constexpr int F = Shape::kF, P = Shape::kP, LPK = Shape::kLPK, KPW = Shape::kKPW, U = Shape::kUnroll;
  constexpr int Q = Shape::kQ, W = Shape::kWords;
  // [δ][pair j][kind: W_re, W_im][q][lane_in_key] float4, then c as [pair j][q][lane_in_key].
  extern __shared__ float4 wmax_s[];
  const int D = m.num_offsets;
  float4* c_s = wmax_s + static_cast<std::size_t>(D) * P * 2 * Q * LPK;

  const detail::ScoreWork work(m, a, GMAX, Shape::kTile);
  const int L = work.L, Hq = work.Hq, G = work.G, tiles_per_row = work.tiles_per_row;
  long long it = work.begin, end = work.end;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int li = lane % LPK, kg = lane / LPK;
  const int my_head = detail::reduce_scatter_head<LPK, GMAX>(lane);
  const bool writer = (lane & (LPK / GMAX - 1)) == 0;
  const int block_size = view.block.block_size;

  long long cur_row = -1;  // row whose weights wmax_s holds
  detail::ItemWalk<T, Id> walk;
  const detail::ScoreRow& row = walk.row;
  const detail::KeyRowAddr<T, Id>& kr = walk.kr;
  for (; walk.find(it, end, view, a, work, Shape::kTile); ++it) {
    const int key0 = walk.tile(it, tiles_per_row) * Shape::kTile + warp * KPW * U + kg;
    std::uint32_t raw[U][W];  // loads first: they fly while a new row's weights are computed
    detail::load_tile_keys<T, S, Shape>(kr, key0, fd, block_size, li, raw);
    if (walk.rid != cur_row) {
      __syncthreads();
      const long long t0 = a.t0[row.b];
      float* wbase = reinterpret_cast<float*>(wmax_s);
      for (int item = threadIdx.x; item < D * F; item += blockDim.x) {
        const int o = item / F, f = item % F;
        double cs, sn;
        detail::rope_cos_sin(t0 + static_cast<long long>(m.offsets[o]), m.omega[f], cs, sn);
        const int i = f / P, j = f % P;
#pragma unroll
        for (int k = 0; k < GMAX; ++k) {
          const int hg = row.hc * GMAX + k;
          float wr = 0.0f, wi = 0.0f;
          if (hg < G) {
            const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
            fold_weight_from_phase_unit(m.q_re[idx], m.q_im[idx], cs, sn, m.s2, &wr, &wi);
          }
          wbase[((((static_cast<std::size_t>(o) * P + j) * 2 + 0) * Q + k / 4) * LPK + i) * 4 + k % 4] = wr;
          wbase[((((static_cast<std::size_t>(o) * P + j) * 2 + 1) * Q + k / 4) * LPK + i) * 4 + k % 4] = wi;
        }
      }
      float* cbase = reinterpret_cast<float*>(c_s);
      for (int f = threadIdx.x; f < F; f += blockDim.x) {
        const int i = f / P, j = f % P;
#pragma unroll
        for (int k = 0; k < GMAX; ++k) {
          const int hg = row.hc * GMAX + k;
          const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
          cbase[((j * Q + k / 4) * LPK + i) * 4 + k % 4] = hg < G ? m.c[idx] : 0.0f;
        }
      }
      __syncthreads();
      cur_row = walk.rid;
    }

    float kf[U][2 * P];  // the lane's pairs of U keys, widened once: (re, im) per pair
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < P; ++j) detail::pair_of<T, S, P>(raw[u], j, kf[u][2 * j], kf[u][2 * j + 1]);
    // Norm term Σ_f c_f·|K_f|, reduced like the dot products.
    float mlr[U][GMAX];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < GMAX; ++k) mlr[u][k] = 0.0f;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      float4 wc[Q];
#pragma unroll
      for (int q = 0; q < Q; ++q) wc[q] = c_s[(j * Q + q) * LPK + li];
      const float* fc = reinterpret_cast<const float*>(wc);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float re = kf[u][2 * j], im = kf[u][2 * j + 1];
        const float sq = fmaf(re, re, fmaf(im, im, 1e-8f));
        const float nrm = detail::pair_norm(sq);
#pragma unroll
        for (int k = 0; k < GMAX; ++k) mlr[u][k] = fmaf(fc[k], nrm, mlr[u][k]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) detail::reduce_scatter<LPK, GMAX>(mlr[u], lane);

    float best[U];
#pragma unroll
    for (int u = 0; u < U; ++u) best[u] = 0.0f;
    for (int o = 0; o < D; ++o) {
      float acc[U][GMAX];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < GMAX; ++k) acc[u][k] = 0.0f;
      const float4* wo = wmax_s + static_cast<std::size_t>(o) * P * 2 * Q * LPK;
#pragma unroll
      for (int j = 0; j < P; ++j) {
        float4 wre[Q], wim[Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          wre[q] = wo[((j * 2 + 0) * Q + q) * LPK + li];
          wim[q] = wo[((j * 2 + 1) * Q + q) * LPK + li];
        }
        const float* fre = reinterpret_cast<const float*>(wre);
        const float* fim = reinterpret_cast<const float*>(wim);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int k = 0; k < GMAX; ++k) {
            acc[u][k] = fmaf(fre[k], kf[u][2 * j], acc[u][k]);
            acc[u][k] = fmaf(fim[k], kf[u][2 * j + 1], acc[u][k]);
          }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        detail::reduce_scatter<LPK, GMAX>(acc[u], lane);
        // max_δ fl(dot_δ + mlr) == fl(max_δ dot_δ + mlr): rounding is monotone.
        best[u] = (o == 0 || best[u] < acc[u][0]) ? acc[u][0] : best[u];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = key0 + u * KPW;
      const int hg = row.hc * GMAX + my_head;
      if (writer && t < kr.len && hg < G && D > 0) {
        const std::int64_t o = ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
        scores[o] = best[u] + mlr[u][0];
      }
    }
  }
}


// ---------------------------------------------------------------------------------------------
// Max aggregation on the tensor cores (16-bit caches). The per-offset dot products of a key are
// a [keys × d]·[d × (|D|·4 heads)] product: mma.sync m16n8k16 with the keys as A (exact: the
// cache's own bf16/fp16 values) and the weights as B, split into bf16 hi + mid + lo (bf16
// cache) or fp16 hi + lo (fp16 cache) so the products carry ~fp32 accuracy (residual 2^-24 and
// 2^-22 of |W|), accumulated in fp32. The norm term Σ c_f·|K_f| stays on the CUDA cores.
//
// A fragments come straight from global memory with a permuted k order: lane (g4 = lane/4,
// c4 = lane%4) loads 16-byte chunk j (elements [32j + 8c4, +8)) of its key rows; k-step 2j+h
// takes words 2h, 2h+1 of that chunk as a0/a2 (rows g4, g4+16) and a1/a3 (rows g4+8, g4+24).
// The B fragments in shared memory follow the same permutation, so Σ_k A·B is the dot product.
// Column n of an n-tile is (δ = 2·nt + n/4, head n%4); a lane's accumulators hold one δ and two
// heads per key row; the max over δ finishes with one shuffle.
// ---------------------------------------------------------------------------------------------

namespace detail {

template <class T>
struct MmaMaxTraits;
template <>
struct MmaMaxTraits<bf16_storage> {
  static constexpr int kSplits = 3;
  /// w as kParts bf16 terms (hi, mid, lo): residual <= 2^-9, 2^-17, 2^-25 of |w| for 1, 2, 3.
  template <int kParts = kSplits>
  __device__ static void split(float w, std::uint16_t* out) {
    static_assert(kParts >= 1 && kParts <= 3);
    float r = w;
#pragma unroll
    for (int i = 0; i < kParts; ++i) {
      const __nv_bfloat16 p = __float2bfloat16_rn(r);
      out[i] = __bfloat16_as_ushort(p);
      r -= __bfloat162float(p);
    }
  }
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct MmaMaxTraits<f16_storage> {
  static constexpr int kSplits = 2;
  template <int kParts = kSplits>
  __device__ static void split(float w, std::uint16_t* out) {
    static_assert(kParts == 2, "fp16 weights: hi + lo");
    const __half h = __float2half_rn(w);
    const __half l = __float2half_rn(w - __half2float(h));
    out[0] = __half_as_ushort(h);
    out[1] = __half_as_ushort(l);
  }
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

/// Shape of the tensor-core max scorer: 8 warps x 32 keys, 4 heads per pass.
template <class T, int HD>
struct MmaMaxShape {
  static constexpr int kF = HD / 2;
  static constexpr int kSteps = HD / 16;     // k-steps of 16
  static constexpr int kChunks = HD / 32;    // 16-byte chunks a lane loads per key row
  static constexpr int kSplits = MmaMaxTraits<T>::kSplits;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeysPerWarp = 32;    // two m16 tiles
  static constexpr int kTile = kWarps * kKeysPerWarp;
  static constexpr int kHeads = 4;
};


/// One n-tile of the max scorers' dot products for the warp's two m16 tiles: acc[mt] = rows
/// 16mt + g4 (words 0, 1) and + 8 (words 2, 3) against the tile's B fragments bt[(s·SP + x)·32]
/// (this lane's, [k-step][split] uint2). raw: the lane's rows 8q + g4, chunks 4j + c4.
/// Used by score_max_mma_kernel. One accumulator chain per m-tile (4 chains summed at the end
/// ran slower).
template <class Tr, int KS, int SP, int NC>
__device__ __forceinline__ void max_tile_dot(float (&acc)[2][4], const std::uint32_t (&raw)[4][NC][4],
                                             const uint2* bt) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = 0.0f;
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    const int j = s >> 1, h2 = (s & 1) * 2;
    const std::uint32_t a0[4] = {raw[0][j][h2], raw[1][j][h2], raw[0][j][h2 + 1], raw[1][j][h2 + 1]};
    const std::uint32_t a1[4] = {raw[2][j][h2], raw[3][j][h2], raw[2][j][h2 + 1], raw[3][j][h2 + 1]};
#pragma unroll
    for (int x = 0; x < SP; ++x) {
      const uint2 b = bt[(s * SP + x) * 32];
      Tr::mma(acc[0], a0, b.x, b.y);
      Tr::mma(acc[1], a1, b.x, b.y);
    }
  }
}
}  // namespace detail

/// Dynamic shared memory of score_max_mma_kernel: B fragments for ceil(|D|/2) n-tiles, plus c_f.
template <class T, int HD>
constexpr std::size_t score_max_mma_smem_bytes(int num_offsets) {
  using Shape = detail::MmaMaxShape<T, HD>;
  return static_cast<std::size_t>((num_offsets + 1) / 2) * Shape::kSteps * Shape::kSplits * 32 * 8 +
         static_cast<std::size_t>(Shape::kF) * Shape::kHeads * sizeof(float);
}

/// Tensor-core max-aggregation scorer for 16-bit caches (same contract as score_max_kernel).
template <class T, class Id, int HD, RopeStyle S>
__global__ void __launch_bounds__(detail::MmaMaxShape<T, HD>::kThreads, 2)
    score_max_mma_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                         detail::FastDiv fd) {
  using Shape = detail::MmaMaxShape<T, HD>;
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, NC = Shape::kChunks, SP = Shape::kSplits, GH = Shape::kHeads;
  // B fragments [nt][k-step][split][lane] as uint2 (b0, b1), then c as [f] float4 (4 heads).
  extern __shared__ uint2 bfrag_s[];
  const int D = m.num_offsets;
  const int NT = (D + 1) / 2;
  float4* c_s = reinterpret_cast<float4*>(bfrag_s + static_cast<std::size_t>(NT) * KS * SP * 32);

  const detail::ScoreWork work(m, a, GH, Shape::kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  long long it = work.begin, end = work.end;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const int block_size = view.block.block_size;

  long long cur_row = -1;
  detail::KeyRowAddr<T, Id> kr{};
  detail::ScoreRow row{};
  while (it < end) {
    const long long row_id = it / tiles_per_row;
    const int tile = static_cast<int>(it - row_id * tiles_per_row);
    const bool new_row = row_id != cur_row;
    if (new_row) {
      row = detail::decode_score_row(row_id, L, Hkv, HC);
      kr = detail::key_row(view, a, row.b, row.l, row.g);
      if (tile * Shape::kTile >= kr.len) {
        it = (row_id + 1) * tiles_per_row;
        continue;
      }
    }
    // Key rows of this lane: q = 0..3 -> warp-tile rows g4, g4+8, g4+16, g4+24.
    const int key0 = tile * Shape::kTile + warp * Shape::kKeysPerWarp + g4;
    std::uint32_t raw[4][NC][4];  // [row][chunk][word]: the A fragments
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int t = key0 + 8 * q;
      if (t < kr.len) {
        const T* hv = kr.key(t, fd, block_size);
#pragma unroll
        for (int j = 0; j < NC; ++j) {
          const uint4 v = detail::ldg_stream_v4(hv + 32 * j + 8 * c4);
          raw[q][j][0] = v.x;
          raw[q][j][1] = v.y;
          raw[q][j][2] = v.z;
          raw[q][j][3] = v.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < NC; ++j)
#pragma unroll
          for (int w = 0; w < 4; ++w) raw[q][j][w] = 0u;
      }
    }

    if (new_row) {
      __syncthreads();  // every warp is done with the previous row's fragments
      const long long t0 = a.t0[row.b];
      auto* b16 = reinterpret_cast<std::uint16_t*>(bfrag_s);
      // One item per (δ, f): the weights of its 4 heads at the re and im elements of pair f.
      for (int item = threadIdx.x; item < 2 * NT * F; item += blockDim.x) {
        const int o = item / F, f = item % F;
        double cs = 1.0, sn = 0.0;
        if (o < D) detail::rope_cos_sin(t0 + static_cast<long long>(m.offsets[o]), m.omega[f], cs, sn);
        const int e_re = rope_pair_re(S, f, HD), e_im = rope_pair_im(S, f, HD);
#pragma unroll
        for (int h = 0; h < GH; ++h) {
          const int hg = row.hc * GH + h;
          float wr = 0.0f, wi = 0.0f;
          if (o < D && hg < G) {
            const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
            fold_weight_from_phase_unit(m.q_re[idx], m.q_im[idx], cs, sn, m.s2, &wr, &wi);
          }
          const int n = (o & 1) * 4 + h;  // column within n-tile o/2
#pragma unroll
          for (int part = 0; part < 2; ++part) {
            const int e = part == 0 ? e_re : e_im;
            std::uint16_t sp[SP];
            Tr::split(part == 0 ? wr : wi, sp);
            // element e -> k-step s = 2(e/32) + (e%8)/4, lane n·4 + (e%32)/8, word (e%4)/2, half e%2
            const int s = 2 * (e >> 5) + ((e & 7) >> 2);
            const int ln = n * 4 + ((e & 31) >> 3);
            const int w = (e & 3) >> 1;
#pragma unroll
            for (int x = 0; x < SP; ++x)
              b16[((((static_cast<std::size_t>(o >> 1) * KS + s) * SP + x) * 32 + ln) * 2 + w) * 2 + (e & 1)] = sp[x];
          }
        }
      }
      for (int f = threadIdx.x; f < F; f += blockDim.x) {
        float c[GH];
#pragma unroll
        for (int h = 0; h < GH; ++h) {
          const int hg = row.hc * GH + h;
          c[h] = hg < G ? m.c[(static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f] : 0.0f;
        }
        c_s[f] = make_float4(c[0], c[1], c[2], c[3]);
      }
      __syncthreads();
      cur_row = row_id;
    }

    // ---- norm term on the CUDA cores: the lane holds whole pairs of its 4 key rows -----------
    float nrm[4][GH];
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int h = 0; h < GH; ++h) nrm[q][h] = 0.0f;
#pragma unroll
    for (int j = 0; j < NC; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        // element 32j + 8c4 + e; its pair partner sits in this lane's chunk j ± NC/2 (half) or at e ^ 1
        const int el = 32 * j + 8 * c4 + e;
        bool is_re;
        int f;
        if constexpr (S == RopeStyle::kHalf) {
          is_re = j < NC / 2;
          f = el % F;
        } else {
          is_re = (e & 1) == 0;
          f = el >> 1;
        }
        if (!is_re) continue;  // each pair once, from its real element
        const float4 cw = c_s[f];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float re, im;
          if constexpr (S == RopeStyle::kHalf) {
            re = detail::element<T>(raw[q][j], e);
            im = detail::element<T>(raw[q][j + NC / 2], e);
          } else {
            re = detail::element<T>(raw[q][j], e);
            im = detail::element<T>(raw[q][j], e + 1);
          }
          const float sq = fmaf(re, re, fmaf(im, im, 1e-8f));
          const float n = detail::pair_norm(sq);
          nrm[q][0] = fmaf(cw.x, n, nrm[q][0]);
          nrm[q][1] = fmaf(cw.y, n, nrm[q][1]);
          nrm[q][2] = fmaf(cw.z, n, nrm[q][2]);
          nrm[q][3] = fmaf(cw.w, n, nrm[q][3]);
        }
      }
    }
    // Reduce over the 4 lanes of a row: lane c4 keeps heads 2(c4&1), 2(c4&1)+1.
    const bool hi_pair = (c4 & 1) != 0;
    float nr[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float send = hi_pair ? nrm[q][i] : nrm[q][i + 2];
        const float keep = hi_pair ? nrm[q][i + 2] : nrm[q][i];
        nr[q][i] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
        nr[q][i] += __shfl_xor_sync(0xffffffffu, nr[q][i], 2);
      }
    }

    // ---- dot products on the tensor cores, running max over δ --------------------------------
    float best[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) best[q][0] = best[q][1] = -INFINITY;
    const int my_delta_odd = c4 >> 1;
    for (int nt = 0; nt < NT; ++nt) {
      float acc[2][4];
      detail::max_tile_dot<Tr, KS, SP>(acc, raw, bfrag_s + static_cast<std::size_t>(nt) * KS * SP * 32 + lane);
      if (2 * nt + my_delta_odd < D) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            // acc[mt][i] -> row g4 (+16 mt), acc[mt][2+i] -> row g4+8 (+16 mt); head 2(c4&1)+i
            float& b0 = best[2 * mt][i];
            float& b1 = best[2 * mt + 1][i];
            b0 = b0 < acc[mt][i] ? acc[mt][i] : b0;
            b1 = b1 < acc[mt][2 + i] ? acc[mt][2 + i] : b1;
          }
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, best[q][i], 2);  // the other δ parity
        best[q][i] = best[q][i] < other ? other : best[q][i];
      }
    if (c4 < 2) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // rows: q = 0 -> g4, 1 -> g4+8, 2 -> g4+16, 3 -> g4+24 (raw[] order)
        const int t = key0 + 8 * q;
        if (t >= kr.len) continue;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int hg = row.hc * GH + 2 * (c4 & 1) + i;
          if (hg >= G) continue;
          const std::int64_t o =
              ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
          scores[o] = best[q][i] + nr[q][i];
        }
      }
    }
    ++it;
  }
}


// ---------------------------------------------------------------------------------------------
// Mean aggregation on the tensor cores (16-bit caches).
// Why: the CUDA-core mean kernels issue ~1,200 instructions per key (4 heads x 3 FMAs per pair,
// unpacking, weights), about as long as reading the key, and they load a tile, then compute it,
// so HBM idles while they compute. Here
//  - the dot products Σ_e W_e·k_e run as mma.sync m16n8k16 with the keys as A (exact, ldmatrix
//    fragments in natural element order) and the folded weights as B, split into 16-bit parts
//    as in score_max_mma_kernel (bf16 hi + mid + lo, fp16 hi + lo). Column n of MMA x is
//    (head n/2, split 2x + n%2) (the column past the last split is zero), so lane c4 of a quad
//    ends with head c4's dot product in accumulators 0 + 1 (row g4) and 2 + 3 (row g4 + 8);
//  - the norm term Σ_f c_f·|K_f| runs as m16n8k8 TF32 MMAs into the same columns (norm_tile_mma:
//    the CUDA cores only unpack, square, take one MUFU.SQRT and split each pair's norm);
//  - each computing warp reads its 32-key slices of the CTA's items from its own kStages-deep
//    ring, which producer warps fill with cp.async (KeySliceFeed::copy_slice), handing each
//    slice over on a full mbarrier and taking the stage back on an empty one (no CTA barrier
//    per tile);
//  - the float64 fold runs once per (CTA, row) and the float64 cos/sin once per (CTA, sequence),
//    while the ring's first loads are in flight.
// Key rows in shared memory are 16-byte-chunk swizzled (chunk c of row r at c ^ (r & 7)) so that
// the 8 rows an ldmatrix reads hit distinct banks.
// ---------------------------------------------------------------------------------------------

namespace detail {

/// Shape of score_mean_mma_kernel: kWarps warps, each with a kStages-deep ring of kKeys-key
/// slices (one or two m16 tiles).
template <class T, int HD, int kWarps_, int kStages_, int kKeys_ = 32>
struct MmaMeanShape {
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  static_assert(kStages_ >= 2, "two ring stages at least");
  static_assert(kKeys_ == 16 || kKeys_ == 32, "a slice is one or two m16 tiles");
  static constexpr int kF = HD / 2;
  static constexpr int kSteps = HD / 16;   // MMA k-steps
  static constexpr int kChunks = HD / 32;  // 16-byte chunks a lane holds per key row
  static constexpr int kCPR = HD / 8;      // 16-byte chunks per key
  static constexpr int kSplits = MmaMaxTraits<T>::kSplits;
  static constexpr int kMmas = (kSplits + 1) / 2;  // two weight splits per MMA (columns 2h, 2h + 1)
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeysPerWarp = kKeys_;  // one ring slice
  static constexpr int kTile = kWarps * kKeysPerWarp;
  static constexpr int kHeads = 4;
  static constexpr int kSliceVecs = kKeysPerWarp * kCPR;  // 16-byte chunks per slice
  static constexpr int kCSlots = kF + kF / 8;              // c as float4 per pair, one pad slot every 8 pairs
  static constexpr std::size_t kRingBytes = static_cast<std::size_t>(kWarps) * kStages * kSliceVecs * 16;
  static constexpr std::size_t kBfragBytes = static_cast<std::size_t>(kSteps) * kMmas * 32 * 8;
  static constexpr std::size_t kCBytes = static_cast<std::size_t>(kCSlots) * 16;
  static constexpr std::size_t kPhaseBytes = static_cast<std::size_t>(kF) * 2 * sizeof(double);
  /// Dynamic shared memory: rings, B fragments [k-step][mma][lane] uint2, c [slot] float4, cos/sin
  /// [F] double, table slots [warp][kStages + 1][32] (8 bytes each).
  /// Per-warp block-table slots (KeySliceFeed), after everything else.
  static constexpr std::size_t kTableBytes = static_cast<std::size_t>(kWarps) * ((kStages + 1) * 32 * 8);
  static constexpr std::size_t kSmemBytes = kRingBytes + kBfragBytes + kCBytes + kPhaseBytes + kTableBytes;
  /// With producer warps (score_mean_mma_kernel's kProducers): full and empty mbarriers per
  /// (warp, stage) instead of the per-warp table slots.
  static constexpr std::size_t kBarrierBytes = static_cast<std::size_t>(kWarps) * kStages * 2 * 8;
  static constexpr std::size_t kSmemBytesProducer = kRingBytes + kBfragBytes + kCBytes + kPhaseBytes + kBarrierBytes;
};

/// Issues the copies of the per-model cos/sin(δω_f) tables ([|D|][F] double each, from
/// m.offset_cos / m.offset_sin) into cs_s / sn_s, 16 bytes per copy, thread `tid` of `threads`
/// (the caller commits the group and waits for it before the tables are read).
__device__ __forceinline__ void copy_offset_tables_async(double* cs_s, double* sn_s, const ScoreModelView& m, int D,
                                                         int F, int tid, int threads) {
  const int chunks = D * F / 2;  // 16-byte chunks per table
  for (int i = tid; i < 2 * chunks; i += threads) {
    const bool sn = i >= chunks;
    const int ci = sn ? i - chunks : i;
    cp_async_16(smem_addr((sn ? sn_s : cs_s) + 2 * ci), (sn ? m.offset_sin : m.offset_cos) + 2 * ci, 16);
  }
}

/// Waits until at most N of this thread's committed groups are pending.
/// Block-table entries a warp keeps in flight ahead of its key slices: one per ring stage, plus
/// one slot so that a fetch never lands on the entry its warp has still to read.
template <int kStages>
struct KeyTableSlots {
  static constexpr int kAhead = kStages;
  static constexpr int kSlots = kAhead + 1;
  /// Shared memory per warp for any block-id type (up to 8 bytes).
  static constexpr std::size_t kBytesPerWarp = static_cast<std::size_t>(kSlots) * 32 * 8;
};

/// score_mean_mma_kernel reads each m16 tile of keys with ldmatrix.x4, one per k-step s of 16
/// elements, so the lane (g = lane/4, c = lane%4) holds the MMA A fragment in natural element
/// order: fr[s] = {row g, row g+8} x elements {16s + 2c, +1} (words 0, 1) and {16s + 8 + 2c, +1}
/// (words 2, 3). The B fragments of the trig weights follow the same order.
/// Its norm term Σ_f c_f·|K_f| is a [16 keys x F] by [F x 8] product per tile, run as m16n8k8
/// TF32 MMAs into the same accumulators. The lane holds F/4 whole pairs of each of its two rows
/// (both halves of a pair sit in the same lane); lane-local pair p feeds k8-step p/2 at k = c
/// (p even) or c + 4 (p odd), and the norm B fragments list c_f in that order. Column 2h of B
/// holds the TF32 head of c for head h, column 2h + 1 the rest (c - head), so acc[0] + acc[1]
/// sums both (as the trig MMA's weight splits); A is |K_f| split the same way into two MMAs. The
/// tensor cores read the top 19 bits of a TF32 operand, so each product keeps ~21 bits (the
/// dropped rest·rest part is ~2^-21 relative).
/// Global pair index of lane-local pair p for quad index c.
template <RopeStyle S>
__device__ __forceinline__ int mma_lane_pair(int c, int p) {
  if constexpr (S == RopeStyle::kHalf)  // real part at element f < F: k-step p/4, word 2·(p%4/2), half p%2
    return 16 * (p / 4) + 8 * ((p % 4) / 2) + 2 * c + p % 2;
  else  // elements 2f, 2f + 1 = one word: k-step p/2, word 2·(p%2)
    return 8 * (p / 2) + 4 * (p % 2) + c;
}
/// |K_f| of lane-local pair p of row g + 8q; fr: the tile's A fragments [k-step][word].
template <class T, RopeStyle S, int KS>
__device__ __forceinline__ float mma_lane_pair_norm(const std::uint32_t (&fr)[KS][4], int q, int p) {
  float re, im;
  if constexpr (S == RopeStyle::kHalf) {  // imaginary part F = 8·KS elements later: k-step + KS/2
    const int s = p / 4, w = q + 2 * ((p % 4) / 2);
    re = element<T>(&fr[s][w], p % 2);
    im = element<T>(&fr[s + KS / 2][w], p % 2);
  } else {
    const std::uint32_t* w = &fr[p / 2][q + 2 * (p % 2)];
    re = element<T>(w, 0);
    im = element<T>(w, 1);
  }
  return pair_norm(fmaf(re, re, fmaf(im, im, 1e-8f)));
}
/// Where element e of a B column lives in the MMA fragments that pair with the A fragments of
/// load_tile_fragments (natural element order): k-step e/16, quad lane (e%8)/2 (the lane is
/// 4·column + that), word (e%16)/8 of the lane's uint2, half e%2 of the word. Shared by the
/// mean and max ring scorers' weight fills.
struct BFragmentSlot {
  int step, quad_lane, word, half;
};
__device__ __forceinline__ BFragmentSlot b_fragment_slot(int e) { return {e >> 4, (e & 7) >> 1, (e & 15) >> 3, e & 1}; }
/// ldmatrix.x4: lane l gives the shared address of row l%8 of matrix l/8; word i of the result is
/// matrix i's row lane/4, elements 2·(lane%4), +1.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
/// ldmatrix.x2: lanes 0-15 give the row addresses of two 8x8 matrices; word i = matrix i's row
/// lane/4, elements 2·(lane%4), +1 (the B fragment of mma.m16n8k16 from two K-major core matrices).
__device__ __forceinline__ void ldmatrix_x2(std::uint32_t (&r)[2], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
/// The TF32 head of x (low 13 mantissa bits cleared); x - head is exact in fp32.
__device__ __forceinline__ std::uint32_t tf32_head(float x) { return __float_as_uint(x) & 0xffffe000u; }
/// x - tf32_head(x), as the bits of a TF32 operand.
__device__ __forceinline__ std::uint32_t tf32_rest(float x, std::uint32_t head) {
  return __float_as_uint(x - __uint_as_float(head));
}
/// d += A·B, m16n8k8 TF32 with fp32 accumulation; a: (row g, k c), (g+8, c), (g, c+4), (g+8, c+4).
__device__ __forceinline__ void mma_tf32(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                         std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
/// The A fragments of one m16 tile of a ring stage whose rows hold chunk c at c ^ (row & 7)
/// (KeySliceFeed): fr[s] for every k-step s. tile_addr: shared address of the
/// tile's first row; CPR: 16-byte chunks per row.
template <int KS, int CPR>
__device__ __forceinline__ void load_tile_fragments(std::uint32_t (&fr)[KS][4], std::uint32_t tile_addr, int lane) {
  // lane l gives row (l & 7) + 8·((l >> 3) & 1) (so row & 7 = l & 7) at chunk 2s + l/16
  const std::uint32_t row_addr = tile_addr + static_cast<std::uint32_t>(((lane & 7) + 8 * ((lane >> 3) & 1)) * CPR * 16);
  const int half = lane >> 4, swz = lane & 7;
#pragma unroll
  for (int s = 0; s < KS; ++s) ldmatrix_x4(fr[s], row_addr + static_cast<std::uint32_t>(((2 * s + half) ^ swz) * 16));
}
/// mbarrier primitives (shared::cta addresses) for the producer-warp rings.
/// Word i of this lane's norm B fragment for k8-step s: c of lane-local pair 2s + i for head h, as
/// its TF32 head or (rest) c - head. cf: c as [slot f + f/8][4 heads] floats.
template <RopeStyle S>
__device__ __forceinline__ std::uint32_t norm_b_word(const float* cf, int c4, int s, int i, int h, bool rest) {
  const int f = mma_lane_pair<S>(c4, 2 * s + i);
  const float c = cf[(f + f / 8) * 4 + h];
  const std::uint32_t head = tf32_head(c);
  return rest ? tf32_rest(c, head) : head;
}
/// The norm term of one m16 tile: acc_head += |K|_head·B and acc_rest += |K|_rest·B over the F/8
/// TF32 k8-steps (|K_f| split into TF32 head and rest; the two may be the same accumulators).
template <class T, RopeStyle S, int KS, int KN>
__device__ __forceinline__ void norm_tile_mma(float (&acc_head)[4], float (&acc_rest)[4],
                                              const std::uint32_t (&fr)[KS][4], const std::uint32_t (&bn)[KN][2]) {
#pragma unroll
  for (int s = 0; s < KN; ++s) {
    std::uint32_t hd[2][2], rs[2][2];  // [pair 2s + i][row g + 8q]
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float n = mma_lane_pair_norm<T, S, KS>(fr, q, 2 * s + i);
        hd[i][q] = tf32_head(n);
        rs[i][q] = tf32_rest(n, hd[i][q]);
      }
    mma_tf32(acc_head, hd[0][0], hd[0][1], hd[1][0], hd[1][1], bn[s][0], bn[s][1]);
    mma_tf32(acc_rest, rs[0][0], rs[0][1], rs[1][0], rs[1][1], bn[s][0], bn[s][1]);
  }
}

/// The norm term of one m16 tile on the CUDA cores: out[2q + i] = Σ_f c_f·|K_f| of row g + 8q for
/// head 2(c & 1) + i (the layout of the max scorer's running max). Each lane sums its F/4 pairs
/// for all 4 heads (c as [slot f + f/8] float4 in shared memory), then the quad reduce-scatters.
/// Why not TF32 MMAs (norm_tile_mma): next to warpgroup MMAs they queue on the same tensor pipe,
/// so one warpgroup's norm waits behind the other's MMAs.
template <class T, RopeStyle S, int KS>
__device__ __forceinline__ void norm_tile_ffma(float (&out)[4], const std::uint32_t (&fr)[KS][4], const float4* c_s,
                                               int c) {
  constexpr int kPairs = KS * 2;  // F/4 lane-local pairs per row
  float acc[2][4] = {};           // [row g + 8q][head]
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int f = mma_lane_pair<S>(c, p);
    const float4 cf = c_s[f + f / 8];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float n = mma_lane_pair_norm<T, S, KS>(fr, q, p);
      acc[q][0] = fmaf(cf.x, n, acc[q][0]);
      acc[q][1] = fmaf(cf.y, n, acc[q][1]);
      acc[q][2] = fmaf(cf.z, n, acc[q][2]);
      acc[q][3] = fmaf(cf.w, n, acc[q][3]);
    }
  }
  const bool odd = (c & 1) != 0;  // keeps heads 2, 3 (even lanes 0, 1) after the xor-1 exchange
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float keep = odd ? acc[q][2 + i] : acc[q][i];
      const float give = odd ? acc[q][i] : acc[q][2 + i];
      float v = keep + __shfl_xor_sync(0xffffffffu, give, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      out[2 * q + i] = v;
    }
}

/// 16-byte global -> shared copy through L2 only, or 16 zero bytes when `zero` (src not read).
/// With an L2 evict-first policy (`policy` from l2_stream_policy): the keys are read once per
/// round, so their lines should be the first L2 gives up, not the scores the scorer writes (which
/// the round's next kernel reads) or other data the engine keeps there.
__device__ __forceinline__ void score_cp_async_16_or_zero(std::uint32_t dst, unsigned long long src, bool zero,
                                                          std::uint64_t policy) {
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
      " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, z, %3;\n}" ::"r"(dst),
      "l"(src), "r"(static_cast<int>(zero)), "l"(policy)
      : "memory");
}
/// An L2 evict-first policy for every line of a streamed input (createpolicy, fraction 1).
__device__ __forceinline__ std::uint64_t l2_stream_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
/// base + 16·chunk as one IMAD.WIDE.U32 (the compiler otherwise widens the product with shifts).
__device__ __forceinline__ unsigned long long chunk_address(unsigned long long base, std::uint32_t chunk) {
  unsigned long long r;
  asm("mad.wide.u32 %0, %1, 16, %2;" : "=l"(r) : "r"(chunk), "l"(base));
  return r;
}

/// 4- or 8-byte global -> shared copy (a block-table entry); src_bytes = 0 zero-fills.
template <int kBytes>
__device__ __forceinline__ void score_cp_async_small(std::uint32_t dst, const void* src, int src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8, "4 or 8 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(kBytes), "r"(src_bytes)
               : "memory");
}

/// Key (blk, slot r)'s offset from its layer's K range in 16-byte chunks (32 bits: the ring
/// scorers' launchers route K ranges of 64 GiB or more elsewhere, ring_offsets_fit).
template <class T, class Id>
__device__ __forceinline__ std::uint32_t key_chunk_offset(const KeyRowAddr<T, Id>& k, Id blk, int r) {
  constexpr int kElemsPerChunk = 16 / static_cast<int>(sizeof(T));
  return static_cast<std::uint32_t>(
      static_cast<std::uint64_t>(static_cast<std::int64_t>(blk) * k.block_elems +
                                 static_cast<std::int64_t>(r) * k.token_stride + k.head_off) /
      kElemsPerChunk);
}

/// Producer side of a per-warp key ring (score_mean_mma_kernel, score_max_mma_pipe_kernel). The
/// CTA walks its items (row, tile) in order; the warp's slice of an item is the kKeys (16 or 32)
/// keys from tile·kTile + kKeys·warp, lane l owning key l (lanes >= kKeys own none).
/// Two cursors walk the items:
///  - fetch() copies the block-table entry of each lane's key into a per-warp slot ring in shared
///    memory with a 4/8-byte cp.async, KeyTableSlots::kAhead items before the slice needs it, so
///    the table lookup never stalls the warp (an entry loaded one slice ahead into a register
///    left the warps waiting on it);
///  - issue() reads the entry back and copies the slice into one ring stage with 16-byte cp.async:
///    copy x = i·32 + lane is chunk x % CPR of key x / CPR, so one warp instruction moves 32/CPR
///    whole keys; keys past the length are zero-filled. Chunk c of key k lands at
///    c ^ chunk_swizzle(k) = c ^ (k & 7), so the 8 rows of an ldmatrix hit 8 distinct 16-byte
///    bank groups (load_tile_fragments).
/// run_key_ring() orders the two with the consumer so that every read finds its copy complete.
template <class T, class Id, int HD, int kTile, int kKeys, int kStages>
struct KeySliceFeed {
  static_assert(kKeys == 16 || kKeys == 32, "16 or 32 keys per slice");
  static_assert(sizeof(Id) == 4 || sizeof(Id) == 8, "4- or 8-byte block ids");
  static constexpr int kCPR = HD / 8;  // 16-byte chunks per key
  using Slots = KeyTableSlots<kStages>;
  static_assert(kCPR >= 8, "the 8-row swizzle needs 8 chunks per key");
  static __device__ __forceinline__ int chunk_swizzle(int key) { return key & 7; }

  long long f_rid;       // fetch cursor: row and tile of the next item to fetch
  int f_tile;
  long long f_row = -1;  // row whose table f_table points at
  const Id* f_table = nullptr;
  int f_slot = 0;
  long long i_rid;       // issue cursor
  int i_tile;
  long long kr_row = -1;  // row whose addresses kr holds
  KeyRowAddr<T, Id> kr{};
  int i_slot = 0;
  std::uint32_t slots_addr;  // this warp's [kSlots][32] Id slots (shared memory)
  const Id* slots;           // ... the same as a pointer

  __device__ KeySliceFeed(long long row0, int tile0, Id* warp_slots)
      : f_rid(row0), f_tile(tile0), i_rid(row0), i_tile(tile0),
        slots_addr(static_cast<std::uint32_t>(__cvta_generic_to_shared(warp_slots))), slots(warp_slots) {}

  /// kr = the addresses of row `row` (loads its sequence id and length).
  __device__ __forceinline__ void load_row(const KvCacheView<T, Id>& view, const ScoreBatch& a, long long row, int L,
                                           int Hkv, int HC) {
    const ScoreRow sr = decode_score_row(row, L, Hkv, HC);
    kr = key_row(view, a, sr.b, sr.l, sr.g);
    kr_row = row;
  }
  /// Starts the loads of the first row's addresses, so that they overlap the first table fetch
  /// instead of following it.
  __device__ __forceinline__ void prime(const KvCacheView<T, Id>& view, const ScoreBatch& a, int L, int Hkv, int HC) {
    load_row(view, a, i_rid, L, Hkv, HC);
  }

  __device__ __forceinline__ void fetch(const KvCacheView<T, Id>& view, const ScoreBatch& a, const FastDiv& fd,
                                        int tiles_per_row, int L, int Hkv, int HC, int warp, int lane) {
    const long long row = f_rid;
    const int tl = f_tile;
    if (++f_tile == tiles_per_row) {
      f_tile = 0;
      ++f_rid;
    }
    if (row != f_row) {
      const ScoreRow sr = decode_score_row(row, L, Hkv, HC);
      f_table = view.block_tables + static_cast<std::int64_t>(a.seq_ids[sr.b]) * view.max_blocks_per_seq;
      f_row = row;
    }
    const int t = tl * kTile + warp * kKeys + lane;
    const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
    const bool in = lane < kKeys && page < view.max_blocks_per_seq;  // inside the table row
    score_cp_async_small<sizeof(Id)>(slots_addr + static_cast<std::uint32_t>((f_slot * 32 + lane) * sizeof(Id)),
                                     in ? static_cast<const void*>(f_table + page) : view.block_tables,
                                     in ? static_cast<int>(sizeof(Id)) : 0);
    if (++f_slot == Slots::kSlots) f_slot = 0;
  }

  /// stage_addr: shared-memory address of the stage ([kKeys keys][kCPR] 16-byte chunks).
  /// Each lane turns its key into a 32-bit offset from the layer's K range in 16-byte chunks, so
  /// a copy costs one 32-bit shuffle, one wide multiply-add and the cp.async; keys past the length
  /// (a suffix of the slice) are zero-filled from the range start, which is not read. (Two
  /// shuffles, selects and 64-bit arithmetic per copy before: ~8 instructions per key of 36.) The
  /// launcher routes caches with K ranges of 64 GiB or more elsewhere (ring_offsets_fit).
  __device__ __forceinline__ void issue(const KvCacheView<T, Id>& view, const ScoreBatch& a, const FastDiv& fd,
                                        int tiles_per_row, int L, int Hkv, int HC, int warp, int lane,
                                        std::uint32_t stage_addr) {
    const long long row = i_rid;
    const int tl = i_tile;
    if (++i_tile == tiles_per_row) {
      i_tile = 0;
      ++i_rid;
    }
    if (row != kr_row) load_row(view, a, row, L, Hkv, HC);
    const int t_first = tl * kTile + warp * kKeys;  // the slice's first key
    const int t = t_first + lane;
    const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
    const int r = t - page * view.block.block_size;
    const int n_valid = kr.len - t_first;  // keys kk >= n_valid are zero-filled
    const Id blk = slots[i_slot * 32 + lane];
    if (++i_slot == Slots::kSlots) i_slot = 0;
    copy_slice(stage_addr, kr.range, lane < n_valid && lane < kKeys ? chunk_offset(kr, blk, r) : 0u, n_valid, lane);
  }

  static __device__ __forceinline__ std::uint32_t chunk_offset(const KeyRowAddr<T, Id>& k, Id blk, int r) {
    return key_chunk_offset(k, blk, r);
  }
  /// One warp copies a slice: lane l's `mine` is key l's chunk offset from `range`; keys
  /// kk >= n_valid are zero-filled. Chunk c of key kk lands at c ^ chunk_swizzle(kk).
  static __device__ __forceinline__ void copy_slice(std::uint32_t stage_addr, const T* range, std::uint32_t mine,
                                                    int n_valid, int lane) {
    constexpr int kKeysPerCopy = 32 / kCPR;  // whole keys one warp instruction moves
    const int c = lane % kCPR, sub = lane / kCPR;
    // chunk_swizzle(i·kKeysPerCopy + sub) = chunk_swizzle(i·kKeysPerCopy) ^ chunk_swizzle(sub): disjoint bits
    const int c_sw = c ^ chunk_swizzle(sub);
    const unsigned long long base = reinterpret_cast<unsigned long long>(range) + static_cast<unsigned>(c) * 16u;
    const std::uint64_t policy = l2_stream_policy();
#pragma unroll
    for (int i = 0; i < kCPR * kKeys / 32; ++i) {
      const int kk = i * kKeysPerCopy + sub;
      const std::uint32_t o = __shfl_sync(0xffffffffu, mine, kk);
      const std::uint32_t dst =
          stage_addr + static_cast<std::uint32_t>((kk * kCPR + (c_sw ^ chunk_swizzle(i * kKeysPerCopy))) * 16);
      score_cp_async_16_or_zero(dst, chunk_address(base, o), kk >= n_valid, policy);
    }
  }
};

/// The global inputs of one row's weight fold in the ring scorers, loaded into registers ahead of
/// the fold: the row's length and t0, and this thread's share of q̄ and c (fold items
/// tid + j·kThreads < GH·F, item = h·F + f), with ω_f and C_f for the mean fold (kMean).
/// Why: loaded when the row begins, those few loads queue behind the warps' key copies while the
/// warps hold ready slices. The first row's inputs load up front, the next row's right after a fold.
/// kHeadMinor: fold item -> (h, f) with the head varying fastest within 8-frequency blocks (see
/// item_hf), so that a warp's B-fragment stores of one column land in 4 distinct core-matrix rows.
template <int F, int GH, int kThreads, bool kMean, bool kHeadMinor = false>
struct RowFoldInputs {
  static_assert(!kHeadMinor || (GH == 4 && F % 8 == 0), "head-minor items: 4 heads, whole 8-frequency blocks");
  static constexpr int kItems = (GH * F + kThreads - 1) / kThreads;
  /// Head and frequency of fold item `item` (< GH·F): h = item / F, f = item % F, or head-minor:
  /// f = 8·(item / 32) + item % 8, h = (item / 8) % 4.
  __device__ __forceinline__ static void item_hf(int item, int& h, int& f) {
    if constexpr (kHeadMinor) {
      f = (item >> 5) * 8 + (item & 7);
      h = (item >> 3) & 3;
    } else {
      h = item / F;
      f = item % F;
    }
  }
  static constexpr int kFreqs = (F + kThreads - 1) / kThreads;  // ω_f, f = tid + j·kThreads (kMean)
  long long rid = -1;  // row these are for
  ScoreRow row{};
  int len = 0;         // physical length, clamped to [0, max_len]
  long long t0 = 0;
  double q_re[kItems], q_im[kItems], cm_re[kItems], cm_im[kItems];  // q̄, C_f (kMean) of item j
  float c[kItems];
  double omega[kFreqs];

  /// Issues the loads of row r (no use of their values here). seq_lens: the view's [max_seqs].
  template <class Id>
  __device__ __forceinline__ void load(const ScoreModelView& m, const ScoreBatch& a, const Id* seq_lens, long long r,
                                       int L, int Hkv, int HC) {
    rid = r;
    row = decode_score_row(r, L, Hkv, HC);
    const int l0 = static_cast<int>(seq_lens[a.seq_ids[row.b]]);
    len = l0 < a.max_len ? (l0 > 0 ? l0 : 0) : a.max_len;
    t0 = a.t0[row.b];
    const int Hq = m.num_q_heads, G = Hq / m.num_kv_heads;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int item = static_cast<int>(threadIdx.x) + j * kThreads;
      int h, f;
      item_hf(item, h, f);  // consecutive threads: runs of >= 8 consecutive f (coalesced loads)
      const int hg = row.hc * GH + h;
      q_re[j] = q_im[j] = cm_re[j] = cm_im[j] = 0.0;
      c[j] = 0.0f;
      if (item < GH * F && hg < G) {
        const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
        if (!m.disable_trig) {
          q_re[j] = m.q_re[idx];
          q_im[j] = m.q_im[idx];
          if constexpr (kMean) {
            cm_re[j] = m.cmean_re[f];
            cm_im[j] = m.cmean_im[f];
          }
        }
        c[j] = m.c[idx];
      }
    }
    if constexpr (kMean) {
#pragma unroll
      for (int j = 0; j < kFreqs; ++j) {
        const int f = static_cast<int>(threadIdx.x) + j * kThreads;
        omega[j] = f < F && !m.disable_trig ? m.omega[f] : 0.0;
      }
    }
  }
};

/// Runs one warp's ring over the CTA's n_items items: item k's slice sits in stage k % kStages.
/// Commit group g of the loop holds the slice of item g + kStages - 1 and the table fetch of item
/// g + kStages - 1 + kAhead; waiting until kStages - 1 groups are pending completes the slice
/// of item k and, because kAhead >= kStages, the table entry of every item issued next.
/// fetch(), start(), issue(stage), prepare() and compute(stage) are the caller's bound lambdas:
/// start() runs once after the first table fetches are issued and before the warp waits for them
/// (loads whose latency should overlap that wait); prepare()
/// advances the consumer to item k (its row's weights on a row change; it may __syncthreads,
/// its branches being uniform across the CTA) and returns whether the warp has keys in it; it
/// runs before the wait, so that a row change's loads and weight folding overlap the slices in
/// flight instead of following them.
template <int kStages, class Fetch, class Start, class Issue, class Prepare, class Compute>
__device__ __forceinline__ void run_key_ring(int n_items, Fetch&& fetch, Start&& start, Issue&& issue,
                                             Prepare&& prepare, Compute&& compute) {
  constexpr int kAhead = KeyTableSlots<kStages>::kAhead;
  static_assert(kAhead >= kStages, "a table entry must land before its slice is issued");
#pragma unroll
  for (int j = 0; j < kAhead; ++j)
    if (j < n_items) fetch();
  cp_async_commit();
  start();
  cp_async_wait<0>();  // the first entries (the only table latency the warp waits for)
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < n_items) issue(j);
    if (j + kAhead < n_items) fetch();
    cp_async_commit();
  }
  for (int k = 0; k < n_items; ++k) {
    const int kn = k + kStages - 1;
    if (kn < n_items) issue(kn % kStages);
    if (kn + kAhead < n_items) fetch();
    cp_async_commit();
    const bool live = prepare();
    cp_async_wait<kStages - 1>();  // this lane's copies of item k have landed
    __syncwarp();                          // ... and every lane's
    if (live) compute(k % kStages);
    __syncwarp();  // every lane has read stage k % kStages before it is refilled
  }
  cp_async_wait<0>();
}

}  // namespace detail

/// Tensor-core mean-aggregation (and disable_trig) scorer for 16-bit caches: same contract as
/// score_mean_kernel (scores within fp32 rounding of it, not bitwise); dynamic shared memory
/// MmaMeanShape<...>::kSmemBytesProducer. kProducers producer warps fill the kWarps computing
/// warps' rings (cp.async, full/empty mbarrier per (warp, stage)), so a computing warp never
/// stalls issuing copies. kLoadAhead: row inputs loaded ahead (RowFoldInputs).
template <class T, class Id, int HD, RopeStyle S, int kWarps, int kStages, int kMinCtas, int kKeys, bool kLoadAhead,
          int kProducers>
__global__ void __launch_bounds__(32 * (kWarps + kProducers), kMinCtas)
    score_mean_mma_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                          detail::FastDiv fd) {
  // The round's next kernel (row statistics) is launched dependent: it may be scheduled now and
  // waits for this grid's completion before it reads the scores.
  detail::griddep_launch_dependents();
  using Shape = detail::MmaMeanShape<T, HD, kWarps, kStages, kKeys>;
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, CPR = Shape::kCPR;
  constexpr int SP = Shape::kSplits, NM = Shape::kMmas, GH = Shape::kHeads;
  static_assert(kProducers > 0 && kKeys == 32 && kWarps % kProducers == 0,
                "producer warps fill 32-key slices (one key per lane), the same number each");
  constexpr int kFed = kWarps / kProducers;  // computing warps per producer warp
  constexpr std::size_t kRing = Shape::kRingBytes, kSliceBytes = Shape::kSliceVecs * 16;
  extern __shared__ __align__(16) unsigned char mean_mma_smem[];
  uint4* const ring = reinterpret_cast<uint4*>(mean_mma_smem);
  uint2* const bfrag_s = reinterpret_cast<uint2*>(mean_mma_smem + kRing);
  float4* const c_s = reinterpret_cast<float4*>(mean_mma_smem + kRing + Shape::kBfragBytes);
  double* const cs_s = reinterpret_cast<double*>(mean_mma_smem + kRing + Shape::kBfragBytes + Shape::kCBytes);
  double* const sn_s = cs_s + F;
  // producer-warp ring only: full[warp][stage] then empty[warp][stage] mbarriers
  const std::uint32_t bars = detail::smem_addr(mean_mma_smem + kRing + Shape::kBfragBytes + Shape::kCBytes +
                                                     Shape::kPhaseBytes);
  const auto full_bar = [&](int w, int st) { return bars + static_cast<std::uint32_t>((w * kStages + st) * 8); };
  const auto empty_bar = [&](int w, int st) {
    return bars + static_cast<std::uint32_t>(((kWarps + w) * kStages + st) * 8);
  };

  const detail::ScoreWork work(m, a, GH, Shape::kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  const long long it0 = work.begin, it_end = work.end;
  const int n_items = static_cast<int>(it_end - it0);  // this CTA's share
  if (n_items <= 0) return;                            // uniform across the CTA

  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const long long row0 = it0 / tiles_per_row;
  const int tile0 = static_cast<int>(it0 - row0 * tiles_per_row);
  const auto ring_of = [&](int w) { return detail::smem_addr(ring) + static_cast<std::uint32_t>(w * kStages * kSliceBytes); };
  const std::uint32_t ring_addr = ring_of(warp);

  {
    using Feed = detail::KeySliceFeed<T, Id, HD, Shape::kTile, kKeys, kStages>;
    // full: the producer's 32 lanes arrive (on their copies); empty: the computing warp's 32 lanes,
    // each releasing its own reads of the stage (one lane after a __syncwarp relies on the warp
    // barrier's cumulativity, which compute-sanitizer racecheck does not follow: 80 reported
    // hazards on test_score's GQA case).
    if (threadIdx.x == 0) {
      for (int i = 0; i < 2 * kWarps * kStages; ++i) detail::mbar_init(bars + static_cast<std::uint32_t>(i * 8), 32u);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= kWarps) {  // ---- producer warp p: item k's slices for computing warps p, p + kProducers, ... ----
      const int p = warp - kWarps;
      // The next item's row addresses and block ids load one item ahead, while this item's copies
      // go out, so the table latency stalls neither the copies nor the computing warps.
      struct ItemInputs {  // an item's row addresses, tile and the fed warps' block ids
        detail::KeyRowAddr<T, Id> kr;
        int tile;
        Id blk[kFed];
      };
      long long kr_row = -1;
      ItemInputs next{};
      const auto load_item = [&](long long rid, int tile) {
        if (rid != kr_row) {
          const detail::ScoreRow sr = detail::decode_score_row(rid, L, Hkv, HC);
          next.kr = detail::key_row(view, a, sr.b, sr.l, sr.g);
          kr_row = rid;
        }
        next.tile = tile;
#pragma unroll
        for (int i = 0; i < kFed; ++i) {
          const int t = tile * Shape::kTile + (p + i * kProducers) * 32 + lane;
          const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
          next.blk[i] = t < next.kr.len && page < view.max_blocks_per_seq ? next.kr.table[page] : Id(0);
        }
      };
      // Item k's slices (row addresses kr, tile, block ids blk) into stage k % kStages of each fed
      // warp, once that warp has handed the stage back.
      const auto issue_item = [&](int k, const ItemInputs& in) {
        const detail::KeyRowAddr<T, Id>& kr = in.kr;
        const int tile = in.tile;
        const int st = k % kStages;
#pragma unroll
        for (int i = 0; i < kFed; ++i) {
          const int w = p + i * kProducers;
          const int t_first = tile * Shape::kTile + w * 32, t = t_first + lane;
          const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
          const int n_valid = kr.len - t_first;
          const std::uint32_t mine =
              lane < n_valid ? Feed::chunk_offset(kr, in.blk[i], t - page * view.block.block_size) : 0u;
          if (k >= kStages) detail::mbar_wait(empty_bar(w, st), static_cast<unsigned>(((k / kStages) & 1) ^ 1));
          Feed::copy_slice(ring_of(w) + static_cast<std::uint32_t>(st * kSliceBytes), kr.range, mine, n_valid, lane);
          detail::mbar_arrive_on_cp_async(full_bar(w, st));
        }
      };
      long long rid_n = row0;
      int t_n = static_cast<int>(it0 - row0 * tiles_per_row);
      load_item(rid_n, t_n);
      for (int k = 0; k < n_items; ++k) {
        const ItemInputs cur = next;
        if (++t_n == tiles_per_row) {
          t_n = 0;
          ++rid_n;
        }
        if (k + 1 < n_items) load_item(rid_n, t_n);
        issue_item(k, cur);
      }
      return;  // the copies complete on their own; the computing warps wait for them
    }
  }

  // the computing warps' barrier (without the producer warps)
  const auto consumers_sync = [&]() { asm volatile("bar.sync 1, %0;" ::"n"(32 * kWarps) : "memory"); };

  // ---- consumer state ----
  long long seen_row = -1, w_row = -1, c_rid = row0;
  int c_tile = tile0, w_b = -1, len = 0;
  detail::ScoreRow row{};
  std::uint32_t bq[KS][NM][2];  // this lane's B fragments of row w_row
  std::uint32_t bn[F / 8][2];   // ... and of its norm weights (TF32, see mma_lane_pair)
#pragma unroll
  for (int s = 0; s < KS; ++s)
#pragma unroll
    for (int x = 0; x < NM; ++x) bq[s][x][0] = bq[s][x][1] = 0u;
#pragma unroll
  for (int s = 0; s < F / 8; ++s) bn[s][0] = bn[s][1] = 0u;

  // Row inputs (length, t0, q̄, c, C_f, ω_f) in registers; with kLoadAhead the first row's load
  // up front and each next row's right after a fold (see RowFoldInputs), else when the row begins.
  detail::RowFoldInputs<F, GH, Shape::kThreads, true> pre;
  const auto load_pre = [&](long long r) { pre.load(m, a, view.seq_lens, r, L, Hkv, HC); };
  const long long last_row = (it_end - 1) / tiles_per_row;  // the last row whose inputs may be loaded ahead
  int key0 = 0;  // this warp's first key of the current item (set by prepare)
  const auto prepare = [&]() -> bool {  // the item at the compute cursor, then advance it
    const long long rid = c_rid;
    const int tile = c_tile;
    if (++c_tile == tiles_per_row) {
      c_tile = 0;
      ++c_rid;
    }
    if (rid != seen_row) {
      if (pre.rid != rid) load_pre(rid);  // not loaded ahead (a skipped row)
      row = pre.row;
      len = pre.len;
      seen_row = rid;
    }
    if (tile * Shape::kTile >= len) {  // no key in this item, nor in the row's later ones (uniform across the CTA)
      if (kLoadAhead && pre.rid == rid && rid < last_row) load_pre(rid + 1);
      return false;
    }
    if (rid != w_row) {  // first item of a row with keys (uniform): its weights
      consumers_sync();  // every warp is done with the previous row's weights
      if (row.b != w_b) {
#pragma unroll
        for (int j = 0; j < decltype(pre)::kFreqs; ++j) {
          const int f = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
          if (f >= F) break;
          double cs = 1.0, sn = 0.0;
          if (!m.disable_trig) detail::rope_cos_sin(pre.t0, pre.omega[j], cs, sn);
          cs_s[f] = cs;
          sn_s[f] = sn;
        }
        w_b = row.b;
        consumers_sync();
      }
      auto* b16 = reinterpret_cast<std::uint16_t*>(bfrag_s);
      float* cf = reinterpret_cast<float*>(c_s);
#pragma unroll
      for (int j = 0; j < decltype(pre)::kItems; ++j) {
        const int item = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
        if (item >= GH * F) break;
        const int h = item / F, f = item % F;
        const int hg = row.hc * GH + h;
        float wr = 0.0f, wi = 0.0f;
        if (hg < G && !m.disable_trig)
          fold_weight_from_phase(pre.q_re[j], pre.q_im[j], pre.cm_re[j], pre.cm_im[j], cs_s[f], sn_s[f], m.s2, &wr,
                                 &wi);
        const float c = pre.c[j];  // 0 past the group
        cf[(f + f / 8) * 4 + h] = c;
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          const int e = part == 0 ? rope_pair_re(S, f, HD) : rope_pair_im(S, f, HD);
          std::uint16_t sp[SP];
          Tr::split(part == 0 ? wr : wi, sp);
          const detail::BFragmentSlot b = detail::b_fragment_slot(e);
#pragma unroll
          for (int x = 0; x < 2 * NM; ++x) {
            const int n = 2 * h + (x & 1);
            b16[((((b.step * NM + (x >> 1)) * 32 + n * 4 + b.quad_lane) * 2 + b.word) * 2) + b.half] =
                x < SP ? sp[x < SP ? x : 0] : 0;
          }
        }
      }
      consumers_sync();
#pragma unroll
      for (int s = 0; s < KS; ++s)
#pragma unroll
        for (int x = 0; x < NM; ++x) {
          const uint2 v = bfrag_s[(s * NM + x) * 32 + lane];
          bq[s][x][0] = v.x;
          bq[s][x][1] = v.y;
        }
#pragma unroll
      for (int s = 0; s < F / 8; ++s)
#pragma unroll
        for (int i = 0; i < 2; ++i)  // column g4: head g4/2, TF32 head (g4 even) or rest (odd)
          bn[s][i] = detail::norm_b_word<S>(cf, c4, s, i, g4 >> 1, (g4 & 1) != 0);
      w_row = rid;
      if (kLoadAhead && rid < last_row) load_pre(rid + 1);  // in flight while this row streams
    }
    key0 = tile * Shape::kTile + warp * Shape::kKeysPerWarp;
    return key0 < len;  // uniform across the warp
  };
  const auto compute = [&](int stage) {
    const std::uint32_t st_addr = ring_addr + static_cast<std::uint32_t>(stage * kSliceBytes);
    const int hg = row.hc * GH + c4;
    float* const out = scores + ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + (hg < G ? hg : 0)) *
                                    static_cast<std::int64_t>(a.max_len);
#pragma unroll
    for (int mt = 0; mt < kKeys / 16; ++mt) {
      std::uint32_t fr[KS][4];  // A fragments of rows 16mt + g4, + 8: [k-step][word]
      detail::load_tile_fragments<KS, CPR>(fr, st_addr + static_cast<std::uint32_t>(16 * mt * CPR * 16), lane);
      // Four independent accumulator chains (an MMA waits for the one before it on the same
      // accumulators; one chain of 2·KS + F/4 MMAs left the warps stalled on that latency):
      // trig even / odd k-steps, norm head / rest.
      float acc[4][4] = {};
#pragma unroll
      for (int s = 0; s < KS; ++s)
#pragma unroll
        for (int x = 0; x < NM; ++x) Tr::mma(acc[s & 1], fr[s], bq[s][x][0], bq[s][x][1]);
      detail::norm_tile_mma<T, S>(acc[2], acc[3], fr, bn);  // norm term, two more chains
      // lane c4 holds head c4 (columns 2·c4, 2·c4 + 1) of rows g4 (q = 0) and g4 + 8 (q = 1)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = key0 + 16 * mt + 8 * q + g4;
        const float trig = (acc[0][2 * q] + acc[0][2 * q + 1]) + (acc[1][2 * q] + acc[1][2 * q + 1]);
        const float norm = (acc[2][2 * q] + acc[2][2 * q + 1]) + (acc[3][2 * q] + acc[3][2 * q + 1]);
        if (hg < G && t < len) out[t] = trig + norm;
      }
    }
  };

  {  // the computing warps: wait for the slice, compute, hand the stage back
    if constexpr (kLoadAhead) load_pre(row0);
    const auto run_item = [&](int k, bool live) {
      const int st = k % kStages;
      detail::mbar_wait(full_bar(warp, st), static_cast<unsigned>((k / kStages) & 1));
      if (live) compute(st);
      detail::mbar_arrive(empty_bar(warp, st));  // this lane has read the stage
    };
    for (int k = 0; k < n_items; ++k) run_item(k, prepare());
  }
}

// ---------------------------------------------------------------------------------------------
// Max aggregation on the tensor cores, pipelined (16-bit caches).
// The same dot products and max as score_max_mma_kernel, on ldmatrix A fragments in natural
// element order. Around them: keys arrive through per-warp cp.async rings (KeySliceFeed), so a
// warp's next slices are in flight while it runs its MMAs; the |D|·F float64 cos/sin of
// (t0 + δ)·ω are computed once per (CTA, sequence) into shared memory, so a row change only
// re-folds q̄; the dot products run as warpgroup MMAs (sm_90a, |D| <= 18) or mma.sync, the norm
// term as fp32 FMAs (norm_tile_ffma).
// ---------------------------------------------------------------------------------------------

/// n-tiles of B fragments the warpgroup-MMA max scorer always holds: one m64n72k16 covers
/// |D| <= 18 offsets (columns past |D| are zero weights); more offsets take the mma.sync kernel.
inline constexpr int kWgmmaMaxNTiles = 9;

namespace detail {
/// Stores the SP 16-bit terms of weight element e of B column n of n-tile nt into the warpgroup-MMA
/// B tiles: K-major core matrices [k-step e/16][term][n-tile][k-chunk (e%16)/8][column][e%8]
/// (NT n-tiles per tile).
template <int SP>
__device__ __forceinline__ void store_wgmma_b_terms(std::uint16_t* b16, const std::uint16_t (&sp)[SP], int e, int nt,
                                                    int n, int NT) {
#pragma unroll
  for (int x = 0; x < SP; ++x)
    b16[((((static_cast<std::size_t>(e >> 4) * SP + x) * NT + nt) * 2 + ((e >> 3) & 1)) * 8 + n) * 8 + (e & 7)] = sp[x];
}
/// The folded weight (wr, wi) of offset column o and head h as SP 16-bit terms each (Tr::split),
/// stored at its pair's elements e_re, e_im of B column (o & 1)·4 + h of n-tile o / 2.
template <class Tr, int SP>
__device__ __forceinline__ void store_wgmma_b_weight(std::uint16_t* b16, float wr, float wi, int e_re, int e_im, int o,
                                                     int h, int NT) {
  const int n = (o & 1) * 4 + h;  // column within n-tile o/2
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    std::uint16_t sp[SP];
    Tr::template split<SP>(part == 0 ? wr : wi, sp);
    store_wgmma_b_terms<SP>(b16, sp, part == 0 ? e_re : e_im, o >> 1, n, NT);
  }
}
/// The same weight into the mma.sync B fragments of the pipelined max scorer without wgmma:
/// [n-tile o/2][k-step][term][lane][word][half] (BFragmentSlot), KS k-steps.
template <class Tr, int SP, int KS>
__device__ __forceinline__ void store_mma_b_weight(std::uint16_t* b16, float wr, float wi, int e_re, int e_im, int o,
                                                   int h) {
  const int n = (o & 1) * 4 + h;  // column within n-tile o/2
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    std::uint16_t sp[SP];
    Tr::template split<SP>(part == 0 ? wr : wi, sp);
    const BFragmentSlot b = b_fragment_slot(part == 0 ? e_re : e_im);
    const int ln = n * 4 + b.quad_lane;
#pragma unroll
    for (int x = 0; x < SP; ++x)
      b16[((((static_cast<std::size_t>(o >> 1) * KS + b.step) * SP + x) * 32 + ln) * 2 + b.word) * 2 + b.half] = sp[x];
  }
}
/// cos and sin of offsets o0 .. o0 + kBatch - 1 at frequency f from the [|D|][F] tables, loaded
/// before any of them is used (the max scorers' folds take them in batches: the float64 folds of
/// a batch are independent, so their chains overlap). Offsets past |D| repeat offset D - 1: their
/// weights, hence their products, equal that column's, so a max over every column is the max
/// over D without a select.
template <int kBatch>
__device__ __forceinline__ void load_offset_phases(double (&cs_b)[kBatch], double (&sn_b)[kBatch], const double* cs_s,
                                                   const double* sn_s, int o0, int D, int F, int f) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int od = o0 + u < D ? o0 + u : D - 1;
    cs_b[u] = cs_s[od * F + f];
    sn_b[u] = sn_s[od * F + f];
  }
}
/// The cos/sin of a sequence's phases for the max scorers' folds, by threads i = tid, tid +
/// threads, ...: with the per-model cos/sin(δω_f) tables (angle_tables), cos/sin(t0·ω_f) into
/// ph_c / ph_s [F] (offset_weight adds the angles); without them the whole (t0 + δ)·ω_f table into
/// cs_s / sn_s [|D|][F].
__device__ __forceinline__ void sequence_phases(bool angle_tables, long long t0, const ScoreModelView& m, int D, int F,
                                                int tid, int threads, double* ph_c, double* ph_s, double* cs_s,
                                                double* sn_s) {
  if (angle_tables) {
    for (int f = tid; f < F; f += threads) rope_cos_sin(t0, m.omega[f], ph_c[f], ph_s[f]);
  } else {
    for (int it = tid; it < D * F; it += threads)
      rope_cos_sin(t0 + static_cast<long long>(m.offsets[it / F]), m.omega[it % F], cs_s[it], sn_s[it]);
  }
}
/// The folded weight of one offset: its phase (cs, sn) from the tables, advanced by the sequence's
/// (ct, st) = cos/sin(t0·ω_f) when the tables hold cos/sin(δω_f) (angle_tables), folded with q̄.
__device__ __forceinline__ void offset_weight(double q_re, double q_im, double cs, double sn, bool angle_tables,
                                              double ct, double st, double s2, float* wr, float* wi) {
  if (angle_tables) {  // cos/sin((t0 + δ)ω) by angle addition
    const double cd = cs, sd = sn;
    cs = ct * cd - st * sd;
    sn = st * cd + ct * sd;
  }
  fold_weight_from_phase_unit(q_re, q_im, cs, sn, s2, wr, wi);
}
}  // namespace detail

/// 16-bit terms per weight of the pipelined max scorer (bf16 hi + mid, fp16 hi + lo): weights to
/// 2^-17 of their size, a third fewer MMAs than bf16's three terms.
inline constexpr int kMaxPipeSplits = 2;

/// Dynamic shared memory of score_max_mma_pipe_kernel: rings, c [slot] float4, cos/sin [|D|][F]
/// double, B fragments (mma.sync: [ceil(|D|/2)][k-step][split][lane] uint2; wgmma: [k-step][split]
/// x kWgmmaMaxNTiles core-matrix pairs of 256 bytes), table slots [warp][kStages + 1][32].
template <class T, int HD, int kWarps, int kStages, bool kWgmma, int kKeys = 32>
constexpr std::size_t score_max_mma_pipe_smem_bytes(int num_offsets) {
  using Shape = detail::MmaMeanShape<T, HD, kWarps, kStages, kKeys>;
  const int n_tiles = kWgmma ? kWgmmaMaxNTiles : (num_offsets + 1) / 2;
  return Shape::kRingBytes + Shape::kCBytes + static_cast<std::size_t>(num_offsets) * Shape::kF * 2 * sizeof(double) +
         static_cast<std::size_t>(n_tiles) * Shape::kSteps * kMaxPipeSplits * 32 * 8 + Shape::kTableBytes;
}

/// Pipelined tensor-core max-aggregation scorer for 16-bit caches (same contract as
/// score_max_mma_kernel; dynamic shared memory score_max_mma_pipe_smem_bytes). Per-warp cp.async
/// rings; weights in kMaxPipeSplits 16-bit terms; the norm term Σ_f c_f·|K_f| as fp32 FMAs on the
/// CUDA cores (norm_tile_ffma), off the tensor pipe. kWgmma (|D| <= 18, kWarps a multiple of 4):
/// the dot products as warpgroup MMAs (m64n72k16, A from registers, B from shared memory) where
/// the build targets sm_90a, else mma.sync. kKeys: keys per warp slice (32: two m16 tiles).
template <class T, class Id, int HD, RopeStyle S, int kWarps, int kStages, int kMinCtas, bool kWgmma, int kKeys = 32>
__global__ void __launch_bounds__(32 * kWarps, kMinCtas)
    score_max_mma_pipe_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                              detail::FastDiv fd) {
  // The round's next kernel (row statistics) is launched dependent: it may be scheduled now and
  // waits for this grid's completion before it reads the scores.
  detail::griddep_launch_dependents();
  using Shape = detail::MmaMeanShape<T, HD, kWarps, kStages, kKeys>;
  constexpr int MT = kKeys / 16;  // m16 tiles per warp slice
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, GH = Shape::kHeads;
  constexpr int SP = kMaxPipeSplits;
  static_assert(SP <= Shape::kSplits, "no more terms than the cache type's split");
#ifdef TRIATTN_WGMMA_ENABLED
  constexpr bool kUseWgmma = kWgmma;
#else
  constexpr bool kUseWgmma = false;
#endif
  static_assert(!kWgmma || kWarps % 4 == 0, "warpgroups of 4 warps");
  const int D = m.num_offsets;
  const int NT = kUseWgmma ? kWgmmaMaxNTiles : (D + 1) / 2;  // n-tiles of B in shared memory
  extern __shared__ __align__(16) unsigned char max_pipe_smem[];
  uint4* const ring = reinterpret_cast<uint4*>(max_pipe_smem);
  float4* const c_s = reinterpret_cast<float4*>(max_pipe_smem + Shape::kRingBytes);
  double* const cs_s = reinterpret_cast<double*>(max_pipe_smem + Shape::kRingBytes + Shape::kCBytes);  // [D][F]
  double* const sn_s = cs_s + static_cast<std::size_t>(D) * F;
  uint2* const bfrag_s = reinterpret_cast<uint2*>(sn_s + static_cast<std::size_t>(D) * F);

  const detail::ScoreWork work(m, a, GH, Shape::kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  long long it0 = work.begin, it_end = work.end;
  const int n_items = static_cast<int>(it_end - it0);
  if (n_items <= 0 || D <= 0) return;  // uniform across the CTA

  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const uint4* const my_ring = ring + static_cast<std::size_t>(warp) * kStages * Shape::kSliceVecs;
  const std::uint32_t ring_addr = detail::smem_addr(my_ring);

  const long long row0 = it0 / tiles_per_row;
  const int tile0 = static_cast<int>(it0 - row0 * tiles_per_row);
  Id* const warp_slots = reinterpret_cast<Id*>(bfrag_s + static_cast<std::size_t>(NT) * KS * SP * 32) +
                         static_cast<std::size_t>(warp) * (kStages + 1) * 32;
  detail::KeySliceFeed<T, Id, HD, Shape::kTile, kKeys, kStages> feed(row0, tile0, warp_slots);
  const auto fetch = [&]() { feed.fetch(view, a, fd, tiles_per_row, L, Hkv, HC, warp, lane); };
  const auto issue = [&](int stage) {
    feed.issue(view, a, fd, tiles_per_row, L, Hkv, HC, warp, lane,
               ring_addr + static_cast<std::uint32_t>(stage * Shape::kSliceVecs * 16));
  };

  long long seen_row = -1, w_row = -1, c_rid = row0;
  int c_tile = tile0, w_b = -1, len = 0;
  detail::ScoreRow row{};

  // Row inputs (length, t0, q̄, c) ahead in registers, as in the mean scorer (RowFoldInputs).
  using Pre = detail::RowFoldInputs<F, GH, Shape::kThreads, false, kUseWgmma>;
  Pre pre;
  const auto load_pre = [&](long long r) { pre.load(m, a, view.seq_lens, r, L, Hkv, HC); };
  const long long last_row = (it_end - 1) / tiles_per_row;
  // With the cos/sin(δω_f) tables (angle addition): this thread's ω_f, and the tables copied into
  // cs_s / sn_s, both issued with the first table fetch (before the warps flood HBM with keys).
  const bool angle_tables = m.offset_cos != nullptr && !m.disable_trig;
  double omega_f = 0.0;
  bool tables_in_smem = false;  // cs_s / sn_s hold the raw cos/sin(δω) (until the first sequence's fold)
  const auto start = [&]() {
    feed.prime(view, a, L, Hkv, HC);
    load_pre(row0);
    if (angle_tables) {
      static_assert(Shape::kThreads % F == 0, "every item of a thread has the same frequency");
      omega_f = m.omega[threadIdx.x % F];
      detail::copy_offset_tables_async(cs_s, sn_s, m, D, F, static_cast<int>(threadIdx.x), Shape::kThreads);
      detail::cp_async_commit();  // run_key_ring waits for it right after start()
      tables_in_smem = true;              // visible to all after the first fold's barrier
    }
  };
  int key0 = 0;  // this warp's first key of the current item (set by prepare)
  const auto prepare = [&]() -> bool {  // the item at the compute cursor, then advance it
    const long long rid = c_rid;
    const int tile = c_tile;
    if (++c_tile == tiles_per_row) {
      c_tile = 0;
      ++c_rid;
    }
    if (rid != seen_row) {
      if (pre.rid != rid) load_pre(rid);  // not loaded ahead (a skipped row)
      row = pre.row;
      len = pre.len;
      seen_row = rid;
    }
    if (tile * Shape::kTile >= len) {  // no key in this item, nor in the row's later ones (uniform across the CTA)
      if (pre.rid == rid && rid < last_row) load_pre(rid + 1);
      return false;
    }
    if (rid != w_row) {  // first item of a row with keys (uniform): its weights
      __syncthreads();   // every warp is done with the previous row's fragments
      if (row.b != w_b) {
        if (angle_tables) {  // cos/sin((t0 + δ)ω) by angle addition: one sincos per thread
          double ct, st;
          detail::rope_cos_sin(pre.t0, omega_f, ct, st);
#pragma unroll 5
          for (int item = static_cast<int>(threadIdx.x); item < D * F; item += Shape::kThreads) {
            const double cd = tables_in_smem ? cs_s[item] : m.offset_cos[item];
            const double sd = tables_in_smem ? sn_s[item] : m.offset_sin[item];
            cs_s[item] = ct * cd - st * sd;
            sn_s[item] = st * cd + ct * sd;
          }
          tables_in_smem = false;
        } else {
          for (int item = static_cast<int>(threadIdx.x); item < D * F; item += Shape::kThreads) {
            const int o = item / F, f = item % F;
            detail::rope_cos_sin(pre.t0 + static_cast<long long>(m.offsets[o]), m.omega[f], cs_s[item], sn_s[item]);
          }
        }
        w_b = row.b;
        __syncthreads();
      }
      auto* b16 = reinterpret_cast<std::uint16_t*>(bfrag_s);
      float* cf = reinterpret_cast<float*>(c_s);
#pragma unroll
      for (int j = 0; j < decltype(pre)::kItems; ++j) {
        const int item = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
        if (item >= GH * F) break;
        int h, f;
        Pre::item_hf(item, h, f);
        const double qr = pre.q_re[j], qi = pre.q_im[j];  // 0 past the group
        const float c = pre.c[j];
        cf[(f + f / 8) * 4 + h] = c;
        const int e_re = rope_pair_re(S, f, HD), e_im = rope_pair_im(S, f, HD);
        // kFoldBatch offsets at a time, their cos/sin loaded before any of their stores, so the
        // float64 folds of a batch overlap (all 18 at once spill in the key loop). No branch past
        // the group: its q̄ is 0, so are its weights.
        constexpr int kFoldBatch = 6;
        for (int o0 = 0; o0 < 2 * NT; o0 += kFoldBatch) {
          double cs_b[kFoldBatch], sn_b[kFoldBatch];
          detail::load_offset_phases<kFoldBatch>(cs_b, sn_b, cs_s, sn_s, o0, D, F, f);
#pragma unroll
          for (int u = 0; u < kFoldBatch; ++u) {
            const int o = o0 + u;
            if (o >= 2 * NT) break;
            float wr, wi;
            fold_weight_from_phase_unit(qr, qi, cs_b[u], sn_b[u], m.s2, &wr, &wi);
            if constexpr (kUseWgmma)
              detail::store_wgmma_b_weight<Tr, SP>(b16, wr, wi, e_re, e_im, o, h, NT);
            else
              detail::store_mma_b_weight<Tr, SP, KS>(b16, wr, wi, e_re, e_im, o, h);
          }
        }
      }
#ifdef TRIATTN_WGMMA_ENABLED
      if constexpr (kUseWgmma) detail::fence_proxy_async_smem();  // the B tiles are read by wgmma
#endif
      __syncthreads();
      w_row = rid;
      if (rid < last_row) load_pre(rid + 1);  // in flight while this row streams
    }
    key0 = tile * Shape::kTile + warp * Shape::kKeysPerWarp;
    // A warpgroup's wgmma needs all four warps, also one whose slice is past the length (its
    // rows are computed on whatever its ring holds and never stored).
    return kUseWgmma || key0 < len;  // uniform across the warp (the warpgroup with wgmma)
  };
  const auto compute = [&](int stage) {

    // A fragments of the MT m16 tiles (rows 16mt + g4 and + 8), natural element order
    const std::uint32_t st_addr = ring_addr + static_cast<std::uint32_t>(stage * Shape::kSliceVecs * 16);
    std::uint32_t fr[MT][KS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      detail::load_tile_fragments<KS, Shape::kCPR>(fr[mt], st_addr + static_cast<std::uint32_t>(16 * mt * Shape::kCPR * 16),
                                                   lane);

    // ---- norm term of heads 2(c4 & 1) + i, fp32 FMAs ----
    float nr[MT][4];  // [m-tile][2·(row g4 + 8q) + i]
    const auto norm_tile = [&](int mt) { detail::norm_tile_ffma<T, S, KS>(nr[mt], fr[mt], c_s, c4); };
    if constexpr (!kUseWgmma) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) norm_tile(mt);
    }

    // ---- dot products on the tensor cores, running max over δ (fmaxf: one FMNMX; the values are finite) ----
    float best[MT][4];  // [m-tile][2·(row g4 + 8q) + i]: head 2(c4 & 1) + i
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int v = 0; v < 4; ++v) best[mt][v] = -INFINITY;
    const int my_delta_odd = c4 >> 1;
#ifdef TRIATTN_WGMMA_ENABLED
    if constexpr (kUseWgmma) {
      // Per m-tile one chain of KS·SP warpgroup MMAs over all 72 columns. m-tile 0's MMAs go
      // first; its norm follows wgmma_wait<1>, under m-tile 1's MMAs, and m-tile 1's norm runs
      // under m-tile 0's (a wgmma's A registers are not read before it is waited for).
      // one (k-step, split) B tile
      constexpr auto kTileBytes = static_cast<std::uint32_t>(kWgmmaMaxNTiles * 256);
      const std::uint64_t b_desc = detail::wgmma_desc_kmajor(detail::smem_addr(bfrag_s), 128u, 256u);
      float d[MT][4 * kWgmmaMaxNTiles];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt > 0) norm_tile(mt);
        detail::wgmma_fence();
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int x = 0; x < SP; ++x)
            detail::wgmma_m64n72k16_rs<std::is_same_v<T, f16_storage>>(
                d[mt], fr[mt][s],
                detail::wgmma_desc_advance(b_desc, static_cast<std::uint32_t>(s * SP + x) * kTileBytes), s + x);
        detail::wgmma_commit();
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt + 1 < MT)
          detail::wgmma_wait<1>();  // MT <= 2
        else
          detail::wgmma_wait<0>();
        if (mt == 0) norm_tile(0);
#pragma unroll
        for (int nt = 0; nt < kWgmmaMaxNTiles; ++nt)  // every column: those past |D| repeat offset D - 1
#pragma unroll
          for (int v = 0; v < 4; ++v) best[mt][v] = fmaxf(best[mt][v], d[mt][4 * nt + v]);
      }
    }
#endif
    if constexpr (!kUseWgmma) {
      for (int nt = 0; nt < NT; ++nt) {
        // All of the n-tile's B fragments first (left to itself the compiler loads each one just
        // before its MMA, two registers in rotation, and the warp waits on every load), then the
        // MMAs in two chains per m-tile (even / odd k-steps) so that fewer wait on their predecessor.
        const uint2* bt = bfrag_s + static_cast<std::size_t>(nt) * KS * SP * 32 + lane;
        uint2 b[KS][SP];
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int x = 0; x < SP; ++x) b[s][x] = bt[(s * SP + x) * 32];
        float part[MT][2][4] = {};  // [m-tile][k-step parity]
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int x = 0; x < SP; ++x)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Tr::mma(part[mt][s & 1], fr[mt][s], b[s][x].x, b[s][x].y);
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[mt][v] = part[mt][0][v] + part[mt][1][v];
        if (2 * nt + my_delta_odd < D) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int v = 0; v < 4; ++v) best[mt][v] = fmaxf(best[mt][v], acc[mt][v]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float other = __shfl_xor_sync(0xffffffffu, best[mt][v], 2);  // the other δ parity
        best[mt][v] = fmaxf(best[mt][v], other);
      }
    if (c4 < 2) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int t = key0 + 16 * mt + 8 * q + g4;
          if (t >= len) continue;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int hg = row.hc * GH + 2 * c4 + i;
            if (hg >= G) continue;
            const std::int64_t o =
                ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
            scores[o] = best[mt][2 * q + i] + nr[mt][2 * q + i];
          }
        }
    }
  };

  detail::run_key_ring<kStages>(n_items, fetch, start, issue, prepare, compute);
}

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// The scoring kernels the ring kernels fall back to: CUDA-core mean and max scorers (fp32 caches,
// K ranges of 64 GiB or more, fp16 weights near fp16's range limit) and the non-ring tensor-core
// max scorer (more than the ring's offsets, or no ring).
#pragma once

#include <triattn/cuda/kernels/score/mma_fragments.cuh>

namespace triattn::cuda {

namespace detail {

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

/// Re and Im of the lane's pair j, read from its raw words (see load order in load_key); fp8:
/// the codes' values, before the K scale (the callers multiply).
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
/// w_s: fold_mean_weights' layout. raw: [U][kWords] (load_tile_keys). k_scale: the row's K scale
/// (fp8; unused for the other dtypes).
/// scores: [batch, L, Hq, max_len].
template <class T, RopeStyle S, class Shape, int GMAX>
__device__ __forceinline__ void mean_tile_scores(const float4* w_s,
                                                 const std::uint32_t (&raw)[Shape::kUnroll][Shape::kWords], int lane,
                                                 int key0, int len, const ScoreRow& row, int L, int Hq, int G,
                                                 const ScoreBatch& a, float k_scale, float* __restrict__ scores) {
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
      if constexpr (is_scaled_dtype<T>) re *= k_scale, im *= k_scale;
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

    detail::mean_tile_scores<T, S, Shape, GMAX>(w_s, raw, lane, key0, walk.kr.len, walk.row, L, Hq, G, a,
                                                kv_scale(view, walk.row.l, KvKind::kKey, walk.row.g), scores);
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
    if constexpr (is_scaled_dtype<T>) {  // fp8: the values, code times the K scale of the row's layer and head
      const float ks = kv_scale(view, row.l, KvKind::kKey, row.g);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < 2 * P; ++e) kf[u][e] *= ks;
    }
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

}  // namespace triattn::cuda

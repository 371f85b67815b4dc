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
#include <triattn/core/ref/score.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

/// Per-model scoring constants in device memory (uploaded once, e.g. by
/// TriAttentionDeviceScorer). Everything float64 except c_f, which the reference also rounds to
/// float before use. Trivially copyable: kernels take it by value.
struct ScoreModelView {
  const double* q_re = nullptr;      ///< [L, Hq, F] Re q̄_f
  const double* q_im = nullptr;      ///< [L, Hq, F] Im q̄_f
  const float* c = nullptr;          ///< [L, Hq, F] c_f = s²(A_f − |q̄_f|) (or s²A_f), rounded to float
  const double* omega = nullptr;     ///< [F] ω_f
  const double* cmean_re = nullptr;  ///< [F] Re C_f = mean_δ cos(δω_f)
  const double* cmean_im = nullptr;  ///< [F] Im C_f
  const double* offsets = nullptr;   ///< [num_offsets] δ ∈ D (whole numbers stored as double)
  double s2 = 1.0;                   ///< s² = α²
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int num_offsets = 0;
  RopeStyle style = RopeStyle::kHalf;
  Aggregation aggregation = Aggregation::kMean;
  bool disable_trig = false;
  double max_abs_weight = 0.0;       ///< s²·max|q̄_f| >= every |W_f(δ)| (range check of the fp16 MMA path)
};
static_assert(std::is_trivially_copyable_v<ScoreModelView>);

/// What one scoring launch covers: a batch of sequences of one view.
struct ScoreBatch {
  const std::int32_t* seq_ids = nullptr;  ///< [batch] device: sequence slots (block-table rows)
  const std::int64_t* t0 = nullptr;       ///< [batch] device: round start (logical position) per sequence
  int batch = 0;
  int max_len = 0;  ///< score-row capacity; every sequence's physical length must be <= max_len
};
static_assert(std::is_trivially_copyable_v<ScoreBatch>);

namespace detail {

/// Unsigned division by a run-time divisor with one multiply-high and one shift (Granlund &
/// Montgomery, as CUTLASS's FastDivmod): exact for every n < 2^31.
struct FastDiv {
  std::uint32_t mul = 0;    ///< 0 means divisor 1
  std::uint32_t shift = 0;

  FastDiv() = default;
  /// @param d divisor, 1 <= d < 2^31
  explicit FastDiv(int d) {
    if (d <= 1) return;
    int l = 0;  // ceil(log2 d)
    while ((1u << l) < static_cast<std::uint32_t>(d)) ++l;
    const int p = 31 + l;
    mul = static_cast<std::uint32_t>(((std::uint64_t{1} << p) + static_cast<std::uint64_t>(d) - 1) /
                                     static_cast<std::uint64_t>(d));
    shift = static_cast<std::uint32_t>(p - 32);
  }
  [[nodiscard]] TRIATTN_HOST_DEVICE std::uint32_t div(std::uint32_t n) const {
#if defined(__CUDA_ARCH__)
    return mul ? (__umulhi(n, mul) >> shift) : n;
#else
    return mul ? static_cast<std::uint32_t>((static_cast<std::uint64_t>(n) * mul) >> 32) >> shift : n;
#endif
  }
};

/// Read-only 16-byte / 8-byte global loads that do not allocate in L1 (each key is read once).
__device__ __forceinline__ uint4 ldg_stream_v4(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ldg_stream_v2(const void* p) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

/// Loads kBytes (a multiple of 8) contiguous bytes into words[0 .. kBytes/4).
template <int kBytes>
__device__ __forceinline__ void load_words(const void* p, std::uint32_t* words) {
  static_assert(kBytes % 8 == 0, "loads are 8 or 16 bytes wide");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int v = 0; v < kBytes / 16; ++v) {
      const uint4 r = ldg_stream_v4(static_cast<const char*>(p) + 16 * v);
      words[4 * v + 0] = r.x;
      words[4 * v + 1] = r.y;
      words[4 * v + 2] = r.z;
      words[4 * v + 3] = r.w;
    }
  } else {
#pragma unroll
    for (int v = 0; v < kBytes / 8; ++v) {
      const uint2 r = ldg_stream_v2(static_cast<const char*>(p) + 8 * v);
      words[2 * v + 0] = r.x;
      words[2 * v + 1] = r.y;
    }
  }
}

/// Element e (0-based) of a packed array of storage type T, as float.
template <class T>
__device__ __forceinline__ float element(const std::uint32_t* words, int e) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(words[e]);
  } else if constexpr (std::is_same_v<T, bf16_storage>) {
    const std::uint32_t w = words[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  } else {
    static_assert(std::is_same_v<T, f16_storage>, "storage type must be float, f16_storage or bf16_storage");
    const std::uint32_t w = words[e >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((e & 1) ? (w >> 16) : (w & 0xffffu))));
  }
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

/// Decoded work row: (sequence b, layer l, KV head g, head chunk hc).
struct ScoreRow {
  int b, l, g, hc;
};
__device__ __forceinline__ ScoreRow decode_score_row(long long row, int L, int Hkv, int HC) {
  ScoreRow r;
  r.hc = static_cast<int>(row % HC);
  row /= HC;
  r.g = static_cast<int>(row % Hkv);
  row /= Hkv;
  r.l = static_cast<int>(row % L);
  r.b = static_cast<int>(row / L);
  return r;
}

/// Where the keys of one (b, l, g) live and how long the sequence is.
template <class T, class Id>
struct KeyRowAddr {
  const T* range;             // K range of layer l
  const Id* table;            // block-table row of the sequence
  std::int64_t block_elems;
  std::int64_t token_stride;  // elements between slots of one head inside a block
  std::int64_t head_off;      // element offset of head g inside a block
  int len;                    // physical length, clamped to max_len

  __device__ __forceinline__ const T* key(int t, const FastDiv& fd, int block_size) const {
    const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
    const int r = t - page * block_size;
    const std::int64_t blk = static_cast<std::int64_t>(table[page]);
    return range + blk * block_elems + r * token_stride + head_off;
  }
};

template <class T, class Id>
__device__ __forceinline__ KeyRowAddr<T, Id> key_row(const KvCacheView<T, Id>& view, const ScoreBatch& a, int b,
                                                     int l, int g) {
  KeyRowAddr<T, Id> k;
  const int seq = a.seq_ids[b];
  const int len = static_cast<int>(view.seq_lens[seq]);
  k.len = len < a.max_len ? (len > 0 ? len : 0) : a.max_len;
  k.range = view.range(l, KvKind::kKey);
  k.table = view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq;
  k.block_elems = view.block.block_elems();
  k.token_stride = view.block.token_stride();
  k.head_off = view.block.layout == KvLayout::kNHD
                   ? static_cast<std::int64_t>(g) * view.block.head_dim
                   : static_cast<std::int64_t>(g) * view.block.block_size * view.block.head_dim;
  return k;
}

/// The contiguous [begin, end) range of (row, tile) items of this CTA.
__device__ __forceinline__ void cta_item_range(long long total, long long& begin, long long& end) {
  begin = total * blockIdx.x / gridDim.x;
  end = total * (blockIdx.x + 1) / gridDim.x;
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
  constexpr int F = Shape::kF, P = Shape::kP, LPK = Shape::kLPK, KPW = Shape::kKPW, U = Shape::kUnroll;
  constexpr int Q = Shape::kQ, W = Shape::kWords;
  // Weights in the order lanes read them: [pair j][kind: W_re, W_im, c][q][lane_in_key] float4, so
  // the LPK lanes of a key group read LPK consecutive float4 (conflict-free, broadcast across groups).
  __shared__ float4 w_s[P * 3 * Q * LPK];

  const int L = m.num_layers, Hq = m.num_q_heads, Hkv = m.num_kv_heads;
  const int G = Hq / Hkv;
  const int HC = (G + GMAX - 1) / GMAX;
  const int tiles_per_row = (a.max_len + Shape::kTile - 1) / Shape::kTile;
  const long long total = static_cast<long long>(a.batch) * L * Hkv * HC * tiles_per_row;
  long long it, end;
  detail::cta_item_range(total, it, end);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int li = lane % LPK, kg = lane / LPK;
  const int my_head = detail::reduce_scatter_head<LPK, GMAX>(lane);
  const bool writer = (lane & (LPK / GMAX - 1)) == 0;
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
      if (tile * Shape::kTile >= kr.len) {  // nothing left in this row (uniform across the CTA)
        it = (row_id + 1) * tiles_per_row;
        continue;
      }
    }

    // ---- the tile's loads go out first, so they fly while a new row's weights are computed ----
    // warp w scores keys tile_start + w·KPW·U + u·KPW + kg, u < U
    const int key0 = tile * Shape::kTile + warp * KPW * U + kg;
    std::uint32_t raw[U][W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = key0 + u * KPW;
      if (t < kr.len) {
        detail::load_key<T, S, Shape>(kr.key(t, fd, block_size), li, raw[u]);
      } else {
#pragma unroll
        for (int w = 0; w < W; ++w) raw[u][w] = 0u;
      }
    }

    if (new_row) {
      __syncthreads();  // every warp is done with the previous row's weights
      const long long t0 = a.t0[row.b];
      for (int f = threadIdx.x; f < F; f += blockDim.x) {
        double cs = 1.0, sn = 0.0;
        if (!m.disable_trig) {  // same calls as fold_weight(): bitwise-equal weights on the device
          const double phi = rope_phase(t0, m.omega[f]);
          cs = ::cos(phi);
          sn = ::sin(phi);
        }
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
      __syncthreads();
      cur_row = row_id;
    }

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
        detail::pair_of<T, S, P>(raw[u], j, re, im);
        const float sq = fmaf(re, re, fmaf(im, im, 1e-8f));
        const float nrm = sq * rsqrtf(sq);  // sqrt via MUFU.RSQ: ~2 ulp, far inside the 1e-5 budget
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
      detail::reduce_scatter<LPK, GMAX>(acc[u], lane);
      const int t = key0 + u * KPW;
      const int hg = row.hc * GMAX + my_head;
      if (writer && t < kr.len && hg < G) {
        const std::int64_t o = ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
        scores[o] = acc[u][0];
      }
    }
    ++it;
  }
}

/// Mean-aggregation scorer, variant 1 (same contract and bitwise the same scores as
/// score_mean_kernel): U = 4 keys per lane, register double buffer. The K loads of the CTA's next
/// item are issued before the current item is scored, so a CTA keeps its next tile (32 KiB) in
/// flight while it computes, instead of draining to zero between items. Per key the summation
/// order (pairs j, then the reduce-scatter) is unchanged; only the key-to-lane mapping differs.
template <class T, class Id, int HD, RopeStyle S, int GMAX>
__global__ void __launch_bounds__(detail::ScoreShape<T, HD, GMAX, 4>::kThreads, 2)
    score_mean_pipe_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                           detail::FastDiv fd) {
  using Shape = detail::ScoreShape<T, HD, GMAX, 4>;
  constexpr int F = Shape::kF, P = Shape::kP, LPK = Shape::kLPK, KPW = Shape::kKPW, U = Shape::kUnroll;
  constexpr int Q = Shape::kQ, W = Shape::kWords;
  __shared__ float4 w_s[P * 3 * Q * LPK];

  const int L = m.num_layers, Hq = m.num_q_heads, Hkv = m.num_kv_heads;
  const int G = Hq / Hkv;
  const int HC = (G + GMAX - 1) / GMAX;
  const int tiles_per_row = (a.max_len + Shape::kTile - 1) / Shape::kTile;
  const long long total = static_cast<long long>(a.batch) * L * Hkv * HC * tiles_per_row;
  long long it, end;
  detail::cta_item_range(total, it, end);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int li = lane % LPK, kg = lane / LPK;
  const int my_head = detail::reduce_scatter_head<LPK, GMAX>(lane);
  const bool writer = (lane & (LPK / GMAX - 1)) == 0;
  const int block_size = view.block.block_size;

  // Row of the next item (the one being prefetched).
  long long rid_n = -1;
  detail::ScoreRow row_n{};
  detail::KeyRowAddr<T, Id> kr_n{};
  // Advances i to the next item with keys (uniform across the CTA); false when none is left.
  const auto find = [&](long long& i) -> bool {
    while (i < end) {
      const long long rid = i / tiles_per_row;
      if (rid != rid_n) {
        row_n = detail::decode_score_row(rid, L, Hkv, HC);
        kr_n = detail::key_row(view, a, row_n.b, row_n.l, row_n.g);
        rid_n = rid;
      }
      const int tile = static_cast<int>(i - rid * tiles_per_row);
      if (tile * Shape::kTile < kr_n.len) return true;
      i = (rid + 1) * tiles_per_row;
    }
    return false;
  };
  const auto load = [&](long long i, std::uint32_t (&raw)[U][W]) {
    const int tile = static_cast<int>(i - rid_n * tiles_per_row);
    const int key0 = tile * Shape::kTile + warp * KPW * U + kg;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = key0 + u * KPW;
      if (t < kr_n.len) {
        detail::load_key<T, S, Shape>(kr_n.key(t, fd, block_size), li, raw[u]);
      } else {
#pragma unroll
        for (int w = 0; w < W; ++w) raw[u][w] = 0u;
      }
    }
  };
  long long cur_row = -1;
  const auto compute = [&](const std::uint32_t (&raw)[U][W], long long i, long long rid, const detail::ScoreRow& row,
                           int len) {
    if (rid != cur_row) {
      __syncthreads();  // every warp is done with the previous row's weights
      const long long t0 = a.t0[row.b];
      for (int f = threadIdx.x; f < F; f += blockDim.x) {
        double cs = 1.0, sn = 0.0;
        if (!m.disable_trig) {
          const double phi = rope_phase(t0, m.omega[f]);
          cs = ::cos(phi);
          sn = ::sin(phi);
        }
        const int ii = f / P, j = f % P;
#pragma unroll
        for (int k = 0; k < GMAX; ++k) {
          const int hg = row.hc * GMAX + k;
          float wr = 0.0f, wi = 0.0f, c = 0.0f;
          if (hg < G) {
            const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
            if (!m.disable_trig)
              fold_weight_from_phase(m.q_re[idx], m.q_im[idx], m.cmean_re[f], m.cmean_im[f], cs, sn, m.s2, &wr, &wi);
            c = m.c[idx];
          }
          float* base = reinterpret_cast<float*>(w_s);
          base[(((j * 3 + 0) * Q + k / 4) * LPK + ii) * 4 + k % 4] = wr;
          base[(((j * 3 + 1) * Q + k / 4) * LPK + ii) * 4 + k % 4] = wi;
          base[(((j * 3 + 2) * Q + k / 4) * LPK + ii) * 4 + k % 4] = c;
        }
      }
      __syncthreads();
      cur_row = rid;
    }
    const int tile = static_cast<int>(i - rid * tiles_per_row);
    const int key0 = tile * Shape::kTile + warp * KPW * U + kg;
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
        detail::pair_of<T, S, P>(raw[u], j, re, im);
        const float sq = fmaf(re, re, fmaf(im, im, 1e-8f));
        const float nrm = sq * rsqrtf(sq);
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
      detail::reduce_scatter<LPK, GMAX>(acc[u], lane);
      const int t = key0 + u * KPW;
      const int hg = row.hc * GMAX + my_head;
      if (writer && t < len && hg < G) {
        const std::int64_t o = ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
        scores[o] = acc[u][0];
      }
    }
  };

  if (!find(it)) return;
  std::uint32_t ra[U][W], rb[U][W];
  load(it, ra);
  while (true) {
    long long ic = it, rid_c = rid_n;
    detail::ScoreRow row_c = row_n;
    int len_c = kr_n.len;
    ++it;
    bool more = find(it);
    if (more) load(it, rb);
    compute(ra, ic, rid_c, row_c, len_c);
    if (!more) break;
    ic = it;
    rid_c = rid_n;
    row_c = row_n;
    len_c = kr_n.len;
    ++it;
    more = find(it);
    if (more) load(it, ra);
    compute(rb, ic, rid_c, row_c, len_c);
    if (!more) break;
  }
}

/// Dynamic shared memory of score_max_kernel: per-offset W_re/W_im plus c.
template <int HD, int GMAX>
constexpr std::size_t score_max_smem_bytes(int num_offsets) {
  return (static_cast<std::size_t>(num_offsets) * 2 + 1) * (HD / 2) * GMAX * sizeof(float);
}

/// Max-aggregation scorer: comb(δ) = Σ_f W_re,f(δ)·k_re + W_im,f(δ)·k_im + Σ_f c_f·|K_f| for every δ
/// in D, max over δ. Weights W_f(δ) = s²·q̄_f·e^{i(t0+δ)ω_f} (fold_weight_from_phase with C = 1).
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

  const int L = m.num_layers, Hq = m.num_q_heads, Hkv = m.num_kv_heads;
  const int G = Hq / Hkv;
  const int HC = (G + GMAX - 1) / GMAX;
  const int tiles_per_row = (a.max_len + Shape::kTile - 1) / Shape::kTile;
  const long long total = static_cast<long long>(a.batch) * L * Hkv * HC * tiles_per_row;
  long long it, end;
  detail::cta_item_range(total, it, end);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int li = lane % LPK, kg = lane / LPK;
  const int my_head = detail::reduce_scatter_head<LPK, GMAX>(lane);
  const bool writer = (lane & (LPK / GMAX - 1)) == 0;
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
    const int key0 = tile * Shape::kTile + warp * KPW * U + kg;
    std::uint32_t raw[U][W];  // loads first: they fly while a new row's weights are computed
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = key0 + u * KPW;
      if (t < kr.len) {
        detail::load_key<T, S, Shape>(kr.key(t, fd, block_size), li, raw[u]);
      } else {
#pragma unroll
        for (int w = 0; w < W; ++w) raw[u][w] = 0u;
      }
    }
    if (new_row) {
      __syncthreads();
      const long long t0 = a.t0[row.b];
      float* wbase = reinterpret_cast<float*>(wmax_s);
      for (int item = threadIdx.x; item < D * F; item += blockDim.x) {
        const int o = item / F, f = item % F;
        const double phi = rope_phase(t0 + static_cast<long long>(m.offsets[o]), m.omega[f]);
        const double cs = ::cos(phi), sn = ::sin(phi);  // as fold_weight() computes them
        const int i = f / P, j = f % P;
#pragma unroll
        for (int k = 0; k < GMAX; ++k) {
          const int hg = row.hc * GMAX + k;
          float wr = 0.0f, wi = 0.0f;
          if (hg < G) {
            const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
            fold_weight_from_phase(m.q_re[idx], m.q_im[idx], 1.0, 0.0, cs, sn, m.s2, &wr, &wi);
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
      cur_row = row_id;
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
        const float nrm = sq * rsqrtf(sq);
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
    ++it;
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
  __device__ static void split(float w, std::uint16_t* out) {
    const __nv_bfloat16 h = __float2bfloat16_rn(w);
    const float r1 = w - __bfloat162float(h);
    const __nv_bfloat16 m = __float2bfloat16_rn(r1);
    const __nv_bfloat16 l = __float2bfloat16_rn(r1 - __bfloat162float(m));
    out[0] = __bfloat16_as_ushort(h);
    out[1] = __bfloat16_as_ushort(m);
    out[2] = __bfloat16_as_ushort(l);
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
  __device__ static void split(float w, std::uint16_t* out) {
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

  const int L = m.num_layers, Hq = m.num_q_heads, Hkv = m.num_kv_heads;
  const int G = Hq / Hkv;
  const int HC = (G + GH - 1) / GH;
  const int tiles_per_row = (a.max_len + Shape::kTile - 1) / Shape::kTile;
  const long long total = static_cast<long long>(a.batch) * L * Hkv * HC * tiles_per_row;
  long long it, end;
  detail::cta_item_range(total, it, end);

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
        if (o < D) {
          const double phi = rope_phase(t0 + static_cast<long long>(m.offsets[o]), m.omega[f]);
          cs = ::cos(phi);  // as fold_weight() computes them
          sn = ::sin(phi);
        }
        const int e_re = rope_pair_re(S, f, HD), e_im = rope_pair_im(S, f, HD);
#pragma unroll
        for (int h = 0; h < GH; ++h) {
          const int hg = row.hc * GH + h;
          float wr = 0.0f, wi = 0.0f;
          if (o < D && hg < G) {
            const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
            fold_weight_from_phase(m.q_re[idx], m.q_im[idx], 1.0, 0.0, cs, sn, m.s2, &wr, &wi);
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
          const float n = sq * rsqrtf(sq);
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
      float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
      const uint2* bt = bfrag_s + static_cast<std::size_t>(nt) * KS * SP * 32 + lane;
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

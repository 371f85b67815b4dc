// SPDX-License-Identifier: Apache-2.0
// SnapKV-style scores on the GPU, for a batch of sequences: the causal softmax attention of n
// window queries over each sequence's cached keys, averaged over the window, then max-pooled
// along the tokens. Sequence slots, lengths, round starts and window positions are read on the
// device (causal limits via snapkv_visible_limit), so a round needs no host work.
// Oracle: ref::snapkv_scores (tests/cuda/test_baseline_scorers.cu). Four kernels, run in order by
// cuda/algorithms/snapkv.cuh:
//   1. snapkv_partial_kernel   per (sequence, layer, q head, token chunk): online-softmax max
//                              and sum of each window query over the chunk's visible keys
//   2. snapkv_stats_kernel     per (sequence, layer, q head, query): combine the chunks ->
//                              (max, 1/sum)
//   3. snapkv_attention_kernel per (sequence, layer, q head, token chunk): recompute the logits,
//                              a[j] = mean_i exp(logit_ij − max_i) / sum_i
//   4. snapkv_pool_kernel      out[j] = max of a over [j − r, j + r] ∩ [0, T)
// Kernels 1 and 3 each read the keys of every query head's KV head (K is read 2·G times per
// KV head in total; the G reads of a group mostly hit L2).
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/math/baseline_math.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

inline constexpr int kSnapKvMaxQueries = 64;  ///< window queries per layer (two per lane)
inline constexpr int kSnapKvTokensPerStep = 4;  ///< tokens a warp stages and scores at once

/// POD parameters of the SnapKV kernels (workspace pointers set by the launcher).
struct SnapKvKernelParams {
  const std::int32_t* seq_ids;    ///< [batch] sequence slots; lengths come from view.seq_lens
  const std::int64_t* t0;         ///< [batch] round start (tokens processed) per sequence
  int max_len;                    ///< score-row capacity (>= every length; longer rows are cut)
  int num_q_heads;                ///< Hq, a multiple of the view's KV heads
  int num_queries;                ///< n in [1, kSnapKvMaxQueries]
  int num_chunks;                 ///< C = ceil(max_len / the SnapKv policy's kChunk)
  float scale;                    ///< 1 / sqrt(head_dim)
  int pool_kernel;                ///< odd >= 1
  const float* queries;           ///< [batch, L, n, Hq, head_dim] post-RoPE window queries
  const std::int64_t* positions;  ///< [batch, L, n] logical positions (< 0: empty slot)
  float2* partial;                ///< [batch, L, Hq, n, C] (max, sum of exp(logit − max)) per chunk
  float2* stats;                  ///< [batch, L, Hq, n] (max, 1 / sum); sum = 0 gives 0
  float* attn;                    ///< [batch, L, Hq, max_len] window-mean attention, before pooling
  float* out;                     ///< [batch, L, Hq, max_len] scores
};

namespace detail {

/// Adds logit x to a running (max m, sum s of exp(· − m)).
__device__ __forceinline__ void snapkv_online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;  // m = −inf at the start: s = 0 · 0 + 1
    m = x;
  } else {
    s += expf(x - m);
  }
}

/// Merges two (max, sum) pairs; an empty pair has max = −inf.
__device__ __forceinline__ float2 snapkv_merge(float2 a, float2 b) {
  if (a.x == -INFINITY) return b;
  if (b.x == -INFINITY) return a;
  const float m = fmaxf(a.x, b.x);
  return make_float2(m, a.y * expf(a.x - m) + b.y * expf(b.x - m));
}

/// Shared memory of kernels 1 and 3: the window queries of one query head, transposed so lane i
/// reads query i without bank conflicts (row padded by one against conflicts when filling), and
/// a 4-token key stage per warp.
template <int HeadDim, class Tune>
struct SnapKvSmem {
  float qt[HeadDim][kSnapKvMaxQueries + 1];           // [d, n] queries, zero past n
  float4 keys[Tune::kWarps][HeadDim];                  // [warp][d] 4 staged tokens, component = token
  float2 warp_stats[Tune::kWarps][kSnapKvMaxQueries];  // kernel 1 only
};

/// Loads the n window queries of query head h of (sequence b, layer) into sm.qt.
/// @param bl b * num_layers + layer
template <int HeadDim, class Tune>
__device__ __forceinline__ void snapkv_load_queries(SnapKvSmem<HeadDim, Tune>& sm, const SnapKvKernelParams& p,
                                                    std::int64_t bl, int h) {
  for (int idx = static_cast<int>(threadIdx.x); idx < kSnapKvMaxQueries * HeadDim; idx += static_cast<int>(blockDim.x)) {
    const int i = idx / HeadDim, e = idx % HeadDim;
    sm.qt[e][i] = i < p.num_queries ? p.queries[((bl * p.num_queries + i) * p.num_q_heads + h) * HeadDim + e] : 0.0f;
  }
}

/// Where one block of kernels 1 and 3 works: sequence, layer, heads, token chunk, and the causal
/// limits of the two queries of this lane.
struct SnapKvBlock {
  int seq, length, layer, h, g, j0, j1, lim0, lim1;
  std::int64_t bl;   ///< b * L + layer
  std::int64_t row;  ///< (b * L + layer) * Hq + h: the (sequence, layer, q head) row
};

template <class Tune, class T, class Id>
__device__ __forceinline__ SnapKvBlock snapkv_block(const KvCacheView<T, Id>& view, const SnapKvKernelParams& p,
                                                    int lane) {
  SnapKvBlock k;
  const int b = static_cast<int>(blockIdx.z);
  k.seq = p.seq_ids[b];
  k.length = triattn::detail::min_(static_cast<int>(view.seq_lens[k.seq]), p.max_len);
  k.layer = static_cast<int>(blockIdx.y) / p.num_q_heads;
  k.h = static_cast<int>(blockIdx.y) % p.num_q_heads;
  k.g = k.h / (p.num_q_heads / view.block.num_kv_heads);
  k.j0 = static_cast<int>(blockIdx.x) * Tune::kChunk;
  k.j1 = triattn::detail::min_(k.length, k.j0 + Tune::kChunk);
  k.bl = static_cast<std::int64_t>(b) * view.num_layers + k.layer;
  k.row = k.bl * p.num_q_heads + k.h;
  const std::int64_t t0 = p.t0[b];
  const std::int64_t* pos = p.positions + k.bl * p.num_queries;
  k.lim0 = lane < p.num_queries ? snapkv_visible_limit(k.length, t0, pos[lane]) : -1;
  k.lim1 = lane + 32 < p.num_queries ? snapkv_visible_limit(k.length, t0, pos[lane + 32]) : -1;
  return k;
}

/// One warp loads tokens [base, base + 4) ∩ [0, end) of (layer, KV head g) into its stage as
/// float (zeros past `end`). Each lane loads HeadDim / 32 adjacent elements.
template <int HeadDim, class T, class Id>
__device__ __forceinline__ void snapkv_stage_keys(float4* stage, const KvCacheView<T, Id>& view, int layer, int g,
                                                  int seq, int base, int end, int lane) {
  using D = device_type_t<T>;
  constexpr int kE = HeadDim / 32;
  const float ks = kv_scale(view, layer, KvKind::kKey, g);  // fp8: dequantised per element, as the CPU
  float* f = reinterpret_cast<float*>(stage);
#pragma unroll
  for (int t = 0; t < kSnapKvTokensPerStep; ++t) {
    const int j = base + t;
    float x[kE];
    if (j < end) {
      const D* k = reinterpret_cast<const D*>(view.token(layer, KvKind::kKey, seq, j, g)) + lane * kE;
#pragma unroll
      for (int v = 0; v < kE; ++v) x[v] = dequant<T>(k[v], ks);
    } else {
#pragma unroll
      for (int v = 0; v < kE; ++v) x[v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < kE; ++v) f[(lane * kE + v) * kSnapKvTokensPerStep + t] = x[v];
  }
}

/// Logits (before scaling) of the 4 staged tokens for query `lane` (acc0) and, when `two`,
/// query `lane + 32` (acc1).
template <int HeadDim, class Tune>
__device__ __forceinline__ void snapkv_dots(const SnapKvSmem<HeadDim, Tune>& sm, const float4* stage, int lane, bool two,
                                            float (&acc0)[4], float (&acc1)[4]) {
#pragma unroll
  for (int t = 0; t < 4; ++t) acc0[t] = acc1[t] = 0.0f;
  if (two) {
#pragma unroll 8
    for (int e = 0; e < HeadDim; ++e) {
      const float4 k = stage[e];
      const float q0 = sm.qt[e][lane], q1 = sm.qt[e][lane + 32];
      acc0[0] = fmaf(q0, k.x, acc0[0]);
      acc0[1] = fmaf(q0, k.y, acc0[1]);
      acc0[2] = fmaf(q0, k.z, acc0[2]);
      acc0[3] = fmaf(q0, k.w, acc0[3]);
      acc1[0] = fmaf(q1, k.x, acc1[0]);
      acc1[1] = fmaf(q1, k.y, acc1[1]);
      acc1[2] = fmaf(q1, k.z, acc1[2]);
      acc1[3] = fmaf(q1, k.w, acc1[3]);
    }
  } else {
#pragma unroll 8
    for (int e = 0; e < HeadDim; ++e) {
      const float4 k = stage[e];
      const float q0 = sm.qt[e][lane];
      acc0[0] = fmaf(q0, k.x, acc0[0]);
      acc0[1] = fmaf(q0, k.y, acc0[1]);
      acc0[2] = fmaf(q0, k.z, acc0[2]);
      acc0[3] = fmaf(q0, k.w, acc0[3]);
    }
  }
}

}  // namespace detail

/// Kernel 1. Grid: x = C token chunks, y = L * Hq, z = batch. Block: 32 * Tune::kWarps threads.
template <int HeadDim, class T, class Id, class Tune>
__global__ void __launch_bounds__(32 * Tune::kWarps) snapkv_partial_kernel(KvCacheView<T, Id> view, SnapKvKernelParams p) {
  __shared__ detail::SnapKvSmem<HeadDim, Tune> sm;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const detail::SnapKvBlock k = detail::snapkv_block<Tune>(view, p, lane);
  const int j1 = k.j1, lim0 = k.lim0, lim1 = k.lim1;
  detail::snapkv_load_queries(sm, p, k.bl, k.h);
  __syncthreads();

  const int n = p.num_queries;
  const int i0 = lane, i1 = lane + 32;
  const bool two = n > 32;
  float m0 = -INFINITY, s0 = 0.0f, m1 = -INFINITY, s1 = 0.0f;
  float4* stage = sm.keys[warp];
  for (int base = k.j0 + warp * kSnapKvTokensPerStep; base < j1; base += Tune::kWarps * kSnapKvTokensPerStep) {
    detail::snapkv_stage_keys<HeadDim>(stage, view, k.layer, k.g, k.seq, base, j1, lane);
    __syncwarp();
    float acc0[4], acc1[4];
    detail::snapkv_dots(sm, stage, lane, two, acc0, acc1);
#pragma unroll
    for (int t = 0; t < kSnapKvTokensPerStep; ++t) {
      const int j = base + t;
      if (j >= j1) break;
      if (j <= lim0) detail::snapkv_online_add(m0, s0, acc0[t] * p.scale);
      if (j <= lim1) detail::snapkv_online_add(m1, s1, acc1[t] * p.scale);
    }
    __syncwarp();  // the stage is rewritten next step
  }
  sm.warp_stats[warp][i0] = make_float2(m0, s0);
  sm.warp_stats[warp][i1] = make_float2(m1, s1);
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
    float2 r = sm.warp_stats[0][i];
#pragma unroll
    for (int w = 1; w < Tune::kWarps; ++w) r = detail::snapkv_merge(r, sm.warp_stats[w][i]);
    p.partial[(k.row * n + i) * p.num_chunks + static_cast<int>(blockIdx.x)] = r;  // (-inf, 0) past the length
  }
}

/// Kernel 2. One warp per (sequence, layer, q head, query): grid.x = ceil(rows / kWarpsPerBlock),
/// 32 * kWarpsPerBlock threads. (A template so that the header defines no non-inline symbol.)
template <int kWarpsPerBlock>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) snapkv_stats_kernel(SnapKvKernelParams p, std::int64_t rows) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (row >= rows) return;  // whole warps leave together
  float2 r = make_float2(-INFINITY, 0.0f);
  for (int c = lane; c < p.num_chunks; c += 32) r = detail::snapkv_merge(r, p.partial[row * p.num_chunks + c]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float2 o = make_float2(__shfl_xor_sync(0xffffffffu, r.x, off), __shfl_xor_sync(0xffffffffu, r.y, off));
    r = detail::snapkv_merge(r, o);
  }
  if (lane == 0) p.stats[row] = make_float2(r.x, r.y > 0.0f ? 1.0f / r.y : 0.0f);
}

/// Kernel 3. Grid: x = C token chunks, y = L * Hq, z = batch. Block: 32 * Tune::kWarps threads.
template <int HeadDim, class T, class Id, class Tune>
__global__ void __launch_bounds__(32 * Tune::kWarps) snapkv_attention_kernel(KvCacheView<T, Id> view, SnapKvKernelParams p) {
  __shared__ detail::SnapKvSmem<HeadDim, Tune> sm;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const detail::SnapKvBlock k = detail::snapkv_block<Tune>(view, p, lane);
  if (k.j0 >= k.length) return;  // whole block: nothing of this sequence in the chunk
  const int j1 = k.j1, lim0 = k.lim0, lim1 = k.lim1;
  detail::snapkv_load_queries(sm, p, k.bl, k.h);
  __syncthreads();

  const int n = p.num_queries;
  const int i0 = lane, i1 = lane + 32;
  const float2 st0 = lim0 >= 0 ? p.stats[k.row * n + i0] : make_float2(0.0f, 0.0f);
  const float2 st1 = lim1 >= 0 ? p.stats[k.row * n + i1] : make_float2(0.0f, 0.0f);
  const int counted = __popc(__ballot_sync(0xffffffffu, lim0 >= 0)) + __popc(__ballot_sync(0xffffffffu, lim1 >= 0));
  const float inv_counted = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  const bool two = n > 32;
  float4* stage = sm.keys[warp];
  float* attn = p.attn + k.row * p.max_len;
  for (int base = k.j0 + warp * kSnapKvTokensPerStep; base < j1; base += Tune::kWarps * kSnapKvTokensPerStep) {
    detail::snapkv_stage_keys<HeadDim>(stage, view, k.layer, k.g, k.seq, base, j1, lane);
    __syncwarp();
    float acc0[4], acc1[4];
    detail::snapkv_dots(sm, stage, lane, two, acc0, acc1);
    float pr[4];
#pragma unroll
    for (int t = 0; t < kSnapKvTokensPerStep; ++t) {
      const int j = base + t;
      pr[t] = (j <= lim0 ? expf(acc0[t] * p.scale - st0.x) * st0.y : 0.0f) +
              (j <= lim1 ? expf(acc1[t] * p.scale - st1.x) * st1.y : 0.0f);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
#pragma unroll
      for (int t = 0; t < kSnapKvTokensPerStep; ++t) pr[t] += __shfl_xor_sync(0xffffffffu, pr[t], off);
    if (lane < kSnapKvTokensPerStep && base + lane < j1) {
      float v = pr[0];
#pragma unroll
      for (int t = 1; t < kSnapKvTokensPerStep; ++t) v = lane == t ? pr[t] : v;
      attn[base + lane] = v * inv_counted;
    }
    __syncwarp();  // the stage is rewritten next step
  }
}

/// Kernel 4. Grid-stride over the batch * L * Hq * max_len outputs; kBlockThreads threads per
/// block. Slots at or past a sequence's length are not written.
template <int kBlockThreads, class Id>
__global__ void __launch_bounds__(kBlockThreads) snapkv_pool_kernel(const Id* seq_lens, SnapKvKernelParams p,
                                                                    int rows_per_seq, std::int64_t total) {
  const int r = p.pool_kernel / 2;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = idx / p.max_len;
    const int j = static_cast<int>(idx - row * p.max_len);
    const int b = static_cast<int>(row / rows_per_seq);
    const int length = triattn::detail::min_(static_cast<int>(seq_lens[p.seq_ids[b]]), p.max_len);
    if (j >= length) continue;
    const float* a = p.attn + row * p.max_len;
    const int lo = triattn::detail::max_(0, j - r), hi = triattn::detail::min_(length - 1, j + r);
    float m = a[lo];
    for (int t = lo + 1; t <= hi; ++t) m = fmaxf(m, a[t]);
    p.out[idx] = m;
  }
}

}  // namespace triattn::cuda

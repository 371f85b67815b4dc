// SPDX-License-Identifier: Apache-2.0
// From raw scores to the values a round selects on (spec §4), on the device:
//   row_stats_kernel   z-normalisation statistics of every (sequence, layer, query head) row over
//                      the selectable slots: mean and population std in float64, two passes, as
//                      ref::normalize_scores computes them (only the summation order differs)
//   gqa_reduce_kernel  normalises on the fly and reduces per pruning mode:
//                        per_head           agg[b, g, j]    = mean_l max_{h∈g} Ŝ[l, h, j]
//                        per_layer_per_head gmax[b, l, g, j] = max_{h∈g} Ŝ[l, h, j]
//                        union              Ŝ written back in place, lmax[b, l, j] = max_h Ŝ[l, h, j],
//                                           candidate flags of sequence b cleared
// Ŝ = (float)((x − mean) / std) with a float64 division (one Newton step on the reciprocal), so
// the normalised floats equal the CPU reference's except in the rare case that the two float64
// summation orders round the mean or std differently right at a float rounding boundary.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/core/keep_counts.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/griddep.cuh>

namespace triattn::cuda {

// Kernels take SelectionParams by value (trivially copyable, read on the device as on the host).
static_assert(std::is_trivially_copyable_v<SelectionParams>);

/// Per-sequence inputs of a round, in device memory.
template <class Id>
struct RoundSeqs {
  const std::int32_t* seq_ids = nullptr;      ///< [batch] sequence slots
  const Id* seq_lens = nullptr;               ///< [max_seqs] physical lengths (the view's seq_lens)
  const std::int32_t* prompt_lens = nullptr;  ///< [batch] pinned prompt length per sequence
  int batch = 0;
  int max_len = 0;                            ///< row capacity of every per-slot buffer
  const std::int32_t* protected_prefix = nullptr;  ///< [batch] or null: leading slots never selected away

  [[nodiscard]] __device__ __forceinline__ KeepCounts counts(int b, const SelectionParams& p) const {
    const int len = static_cast<int>(seq_lens[seq_ids[b]]);
    return keep_counts_unchecked(len < max_len ? len : max_len, prompt_lens[b], p,
                                 protected_prefix != nullptr ? protected_prefix[b] : 0);
  }
};

/// z-normalisation statistics of one row: x̂ = (x − mean) / sd, inv ≈ 1/sd.
struct RowStats {
  double mean;
  double sd;
  double inv;
};

namespace detail {

/// (float)((x − mean) / sd) in float64: reciprocal product refined by one Newton step, which gives
/// the correctly rounded quotient except in rare hard cases (then 1 float64 ulp off).
__device__ __forceinline__ float normalized(float x, const RowStats& s) {
  const double d = static_cast<double>(x) - s.mean;
  double q = d * s.inv;
  const double r = fma(-q, s.sd, d);
  q = fma(r, s.inv, q);
  return static_cast<float>(q);
}

/// Sum over a CTA of kThreads in a fixed order (deterministic); every thread gets it.
template <int kThreads>
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  constexpr int kWarps = kThreads / 32;
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();  // scratch is reused by the next call
  return total;
}

}  // namespace detail

/// One CTA of Tune::kRowStatsThreads per (b, l, h) row: mean and population std of the row's selectable
/// slots. Small CTAs keep a Qwen3-8B round's 1,152 rows (batch 1) in one wave.
/// @param scores [batch, L, Hq, max_len] raw scores
/// @param stats  [batch, L, Hq] output (rows of identity rounds or with no selectable slot get {0, 1, 1})
template <class Id, class Tune>
__global__ void __launch_bounds__(Tune::kRowStatsThreads, Tune::kRowStatsMinCtas)
    row_stats_kernel(const float* __restrict__ scores, RowStats* __restrict__ stats, RoundSeqs<Id> seqs,
                     SelectionParams p, int rows_per_seq) {
  __shared__ double scratch[Tune::kRowStatsThreads / 32];
  detail::griddep_launch_dependents();
  const long long row = blockIdx.x;
  const int b = static_cast<int>(row / rows_per_seq);
  const KeepCounts kc = seqs.counts(b, p);  // round inputs: before the wait
  const int n = kc.selectable_end - kc.selectable_begin;
  detail::griddep_wait();  // the scores
  if (kc.identity || n <= 0) {
    if (threadIdx.x == 0) stats[row] = RowStats{0.0, 1.0, 1.0};
    return;
  }
  const int tid = static_cast<int>(threadIdx.x);
  const float* x = scores + row * seqs.max_len + kc.selectable_begin;
  if (p.nonfinite == NonFinitePolicy::kEvictFirst) {  // mean and std over the finite values only (evict-first rounds)
    double sum = 0.0, cnt = 0.0;
    for (int j = tid; j < n; j += Tune::kRowStatsThreads)
      if (isfinite(x[j])) {
        sum += static_cast<double>(x[j]);
        cnt += 1.0;
      }
    sum = detail::block_sum<Tune::kRowStatsThreads>(sum, scratch);
    cnt = detail::block_sum<Tune::kRowStatsThreads>(cnt, scratch);
    const double mean = cnt > 0.0 ? sum / cnt : 0.0;
    double ss = 0.0;
    for (int j = tid; j < n; j += Tune::kRowStatsThreads)
      if (isfinite(x[j])) ss += (static_cast<double>(x[j]) - mean) * (static_cast<double>(x[j]) - mean);
    ss = detail::block_sum<Tune::kRowStatsThreads>(ss, scratch);
    if (tid == 0) {
      double sd = cnt > 0.0 ? sqrt(ss / cnt) : 1.0;
      sd = sd > 1e-6 ? sd : 1e-6;
      stats[row] = RowStats{mean, sd, 1.0 / sd};
    }
    return;
  }
  float cache[Tune::kRowStatsCache];
#pragma unroll
  for (int c = 0; c < Tune::kRowStatsCache; ++c) {
    const int j = tid + c * Tune::kRowStatsThreads;
    cache[c] = j < n ? x[j] : 0.0f;
  }
  // The rest of a longer row, Tune::kRowStatsRestBatch loads in flight (f maps each value to its term).
  const auto add_rest = [&](double acc, auto f) {
    for (int j0 = tid + Tune::kRowStatsCache * Tune::kRowStatsThreads; j0 < n;
         j0 += Tune::kRowStatsThreads * Tune::kRowStatsRestBatch) {
      float v[Tune::kRowStatsRestBatch];
#pragma unroll
      for (int k = 0; k < Tune::kRowStatsRestBatch; ++k) {
        const int j = j0 + k * Tune::kRowStatsThreads;
        v[k] = j < n ? x[j] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < Tune::kRowStatsRestBatch; ++k)
        if (j0 + k * Tune::kRowStatsThreads < n) acc += f(v[k]);
    }
    return acc;
  };
  double sum = 0.0;
#pragma unroll
  for (int c = 0; c < Tune::kRowStatsCache; ++c) sum += static_cast<double>(cache[c]);
  sum = add_rest(sum, [](float v) { return static_cast<double>(v); });
  const double mean = detail::block_sum<Tune::kRowStatsThreads>(sum, scratch) / n;
  double ss = 0.0;
#pragma unroll
  for (int c = 0; c < Tune::kRowStatsCache; ++c) {
    const double d = static_cast<double>(cache[c]) - mean;
    if (tid + c * Tune::kRowStatsThreads < n) ss += d * d;
  }
  ss = add_rest(ss, [mean](float v) {
    const double d = static_cast<double>(v) - mean;
    return d * d;
  });
  ss = detail::block_sum<Tune::kRowStatsThreads>(ss, scratch);
  if (tid == 0) {
    double sd = sqrt(ss / n);
    sd = sd > 1e-6 ? sd : 1e-6;
    stats[row] = RowStats{mean, sd, 1.0 / sd};
  }
}

/// Rows of statistics a gqa_reduce CTA stages in shared memory: the (l, h) rows it normalises.
[[nodiscard]] TRIATTN_HOST_DEVICE int gqa_reduce_stat_rows(PruningMode mode, bool normalize, int L, int Hq,
                                                           int Hkv) noexcept {
  if (!normalize) return 0;
  return mode == PruningMode::kPerHead ? L * (Hq / Hkv) : mode == PruningMode::kPerLayerPerHead ? Hq / Hkv : Hq;
}

/// Dynamic shared memory of gqa_reduce_kernel: the statistics of the rows the CTA normalises
/// (each read by every slot: from shared memory instead of one dependent L2 load per value), and
/// for per_head max_h Ŝ of every layer of its Tune::kReduceSlots slots, so the mean over layers can be
/// summed in layer order.
template <class Tune>
[[nodiscard]] std::size_t gqa_reduce_smem_bytes(PruningMode mode, bool normalize, int L, int Hq,
                                                       int Hkv) noexcept {
  return static_cast<std::size_t>(gqa_reduce_stat_rows(mode, normalize, L, Hq, Hkv)) * sizeof(RowStats) +
         (mode == PruningMode::kPerHead ? static_cast<std::size_t>(L) * Tune::kReduceSlots * sizeof(float) : 0);
}

/// Normalise-and-reduce. Grid: (slot tiles, groups, batch) with groups = Hkv (per_head),
/// L·Hkv (per_layer_per_head) or L (union); slot tiles of Tune::kReduceSlots (per_head) or
/// Tune::kReduceThreads slots. Only selectable slots of non-identity rounds are touched.
/// @param scores  [batch, L, Hq, max_len] raw scores (union: overwritten with Ŝ on the selectable slots)
/// @param stats   [batch, L, Hq] (unused when p.normalize is false)
/// @param out     per_head [batch, Hkv, max_len]; per_layer_per_head [batch, L, Hkv, max_len];
///                union [batch, L, max_len]
/// @param flags   union only: [batch, max_len] candidate flags, cleared on the selectable slots
template <class Id, int kG, class Tune>
__global__ void __launch_bounds__(Tune::kReduceThreads, Tune::kReduceMinCtas)
    gqa_reduce_kernel(float* __restrict__ scores, const RowStats* __restrict__ stats, float* __restrict__ out,
                      std::uint8_t* __restrict__ flags, RoundSeqs<Id> seqs, SelectionParams p, int L, int Hq,
                      int Hkv) {
  extern __shared__ __align__(16) unsigned char s_raw[];
  detail::griddep_launch_dependents();
  const int b = blockIdx.z;
  const int grp = blockIdx.y;
  const KeepCounts kc = seqs.counts(b, p);  // round inputs: before the wait
  detail::griddep_wait();                         // scores and statistics of the kernels before
  if (kc.identity) return;  // uniform across the CTA
  const int G = kG > 0 ? kG : Hq / Hkv;  // kG: the group size this kernel is compiled for (0: any)
  const long long T = seqs.max_len;
  const long long seq_row0 = static_cast<long long>(b) * L * Hq;  // first (l, h) row of sequence b
  // Statistics of the rows this CTA normalises, by local index: per_head l·G + h,
  // per_layer_per_head h, union h.
  const int n_stats = gqa_reduce_stat_rows(p.mode, p.normalize, L, Hq, Hkv);
  RowStats* const s_stats = reinterpret_cast<RowStats*>(s_raw);
  float* const s_layer_max = reinterpret_cast<float*>(s_raw + n_stats * sizeof(RowStats));  // per_head: [L][slots]
  for (int i = threadIdx.x; i < n_stats; i += blockDim.x) {
    long long row = seq_row0 + static_cast<long long>(grp) * Hq + i;  // union: layer grp, head i
    if (p.mode == PruningMode::kPerHead) row = seq_row0 + static_cast<long long>(i / G) * Hq + grp * G + i % G;
    else if (p.mode == PruningMode::kPerLayerPerHead)
      row = seq_row0 + static_cast<long long>(grp / Hkv) * Hq + (grp % Hkv) * G + i;
    s_stats[i] = stats[row];
  }
  __syncthreads();
  const auto value = [&](int local, float x) { return p.normalize ? detail::normalized(x, s_stats[local]) : x; };

  if (p.mode == PruningMode::kPerHead) {
    // Thread (slot ts, layer lane lg) takes layers lg, lg + Tune::kReduceLayerLanes, ...: max over the
    // group's heads per layer into shared memory, then one thread per slot sums them in layer
    // order (float64, as ref::mean_over_layers), so the result does not depend on the split.
    // The kernel is latency- and instruction-bound: loads are issued in batches before any value
    // is normalised, from one base address per layer.
    const int g = grp;
    const int ts = threadIdx.x % Tune::kReduceSlots, lg = threadIdx.x / Tune::kReduceSlots;
    const int t = blockIdx.x * Tune::kReduceSlots + ts;
    const bool valid = t >= kc.selectable_begin && t < kc.selectable_end;
    if (valid) {
      const float* col = scores + (seq_row0 + g * G) * T + t;  // row (l, g·G + h) at col[(l·Hq + h)·T]
      const long long layer_stride = static_cast<long long>(Hq) * T;
      const int nl = (L - lg + Tune::kReduceLayerLanes - 1) / Tune::kReduceLayerLanes;  // layers lg + k·lanes, k < nl
      if constexpr (kG > 0) {
        // The group size is a compile-time constant: Tune::kReduceLayersInFlight layers x kG heads are
        // loaded before any is normalised, without guards or divisions.
        const auto head_max = [&](int l, const float* v) {  // heads in order: std::max(m, x̂) of the reference
          float m = value(l * kG, v[0]);
#pragma unroll
          for (int h = 1; h < kG; ++h) {
            const float xh = value(l * kG + h, v[h]);
            m = m < xh ? xh : m;
          }
          return m;
        };
        const auto load_heads = [&](int l, float* v) {
          const float* pl = col + l * layer_stride;
#pragma unroll
          for (int h = 0; h < kG; ++h) v[h] = pl[static_cast<long long>(h) * T];
        };
        int k = 0;
        for (; k + Tune::kReduceLayersInFlight <= nl; k += Tune::kReduceLayersInFlight) {
          float v[Tune::kReduceLayersInFlight][kG];
#pragma unroll
          for (int i = 0; i < Tune::kReduceLayersInFlight; ++i)
            load_heads(lg + (k + i) * Tune::kReduceLayerLanes, v[i]);
#pragma unroll
          for (int i = 0; i < Tune::kReduceLayersInFlight; ++i) {
            const int l = lg + (k + i) * Tune::kReduceLayerLanes;
            s_layer_max[l * Tune::kReduceSlots + ts] = head_max(l, v[i]);
          }
        }
        for (; k < nl; ++k) {
          float v[kG];
          const int l = lg + k * Tune::kReduceLayerLanes;
          load_heads(l, v);
          s_layer_max[l * Tune::kReduceSlots + ts] = head_max(l, v);
        }
      } else {
        // Any group size: one layer at a time, heads in chunks of Tune::kReduceGenericHeads loads.
        for (int k = 0; k < nl; ++k) {
          const int l = lg + k * Tune::kReduceLayerLanes;
          const float* pl = col + l * layer_stride;
          float m = 0.0f;
          for (int h0 = 0; h0 < G; h0 += Tune::kReduceGenericHeads) {
            float v[Tune::kReduceGenericHeads];
#pragma unroll
            for (int j = 0; j < Tune::kReduceGenericHeads; ++j)
              if (h0 + j < G) v[j] = pl[static_cast<long long>(h0 + j) * T];
#pragma unroll
            for (int j = 0; j < Tune::kReduceGenericHeads; ++j)
              if (h0 + j < G) {
                const float xh = value(l * G + h0 + j, v[j]);
                m = (h0 + j == 0 || m < xh) ? xh : m;
              }
          }
          s_layer_max[l * Tune::kReduceSlots + ts] = m;
        }
      }
    }
    __syncthreads();
    if (valid && lg == 0) {
      double s = 0.0;
      for (int l = 0; l < L; ++l) s += static_cast<double>(s_layer_max[l * Tune::kReduceSlots + ts]);
      out[(static_cast<long long>(b) * Hkv + g) * T + t] = static_cast<float>(s / L);
    }
    return;
  }

  const int t = blockIdx.x * Tune::kReduceThreads + threadIdx.x;
  if (t < kc.selectable_begin || t >= kc.selectable_end) return;
  if (p.mode == PruningMode::kPerLayerPerHead) {
    const int l = grp / Hkv, g = grp % Hkv;
    const long long row0 = seq_row0 + static_cast<long long>(l) * Hq + g * G;
    float m = 0.0f;
    for (int h = 0; h < G; ++h) {
      const float xh = value(h, scores[(row0 + h) * T + t]);
      m = (h == 0 || m < xh) ? xh : m;
    }
    out[((static_cast<long long>(b) * L + l) * Hkv + g) * T + t] = m;
  } else {
    const int l = grp;
    const long long row0 = seq_row0 + static_cast<long long>(l) * Hq;
    float m = 0.0f;
    for (int base = 0; base < Hq; base += Tune::kReduceBatch) {
      float v[Tune::kReduceBatch];
#pragma unroll
      for (int k = 0; k < Tune::kReduceBatch; ++k)
        if (base + k < Hq) v[k] = scores[(row0 + base + k) * T + t];
#pragma unroll
      for (int k = 0; k < Tune::kReduceBatch; ++k) {
        const int h = base + k;
        if (h < Hq) {
          const float xh = value(h, v[k]);
          if (p.normalize) scores[(row0 + h) * T + t] = xh;
          m = (h == 0 || m < xh) ? xh : m;
        }
      }
    }
    out[(static_cast<long long>(b) * L + l) * T + t] = m;
    if (l == 0) flags[b * T + t] = 0;
  }
}

}  // namespace triattn::cuda

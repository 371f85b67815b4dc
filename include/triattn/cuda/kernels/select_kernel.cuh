// SPDX-License-Identifier: Apache-2.0
// Top-k selection of a round (spec §4) on the device: one CTA per (sequence, row) finds the
// `quota` best selectable slots of its row by (value descending, slot ascending), exactly as
// ref::top_k_with_ties orders them, and writes the kept slots in ascending order:
//   [0, begin) ∪ chosen ∪ [end, T)     (protected prefix, selection, protected window)
// into the device keep plan (or, for union-mode member rows, sets candidate flags).
//
// Algorithm: values become order-preserving 32-bit keys (larger float → larger key; −0 → +0 so
// it ties with +0 as in the reference's float compare; NaN → key 1, below every finite value;
// key 0 marks slots that do not compete). Each thread owns a contiguous run of slots. A 4-pass
// 8-bit radix select (shared histogram fed by run-length aggregated atomics, or warp-aggregated
// ones where a thread holds one slot per tile; bin search by one warp, two barriers per pass)
// finds the threshold key and how many slots equal to it are taken;
// one block scan of per-thread counts then ranks slots in index order, so ties go to the lower
// slot and the output comes out sorted without a sort. Rows up to the Select policy's kCacheMax values keep
// their keys in shared memory; longer rows re-read the values (L2) on each pass.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/kernels/normalize_kernel.cuh>

namespace triattn::cuda {

/// The device compaction plan of a round: for sequence b, kept[b, l, g, 0 .. keep[b]) are the
/// slots that survive in (layer l, KV head g), strictly ascending.
struct DeviceKeepPlanView {
  std::int32_t* kept = nullptr;  ///< [batch, L, Hkv, max_keep]
  std::int32_t* keep = nullptr;  ///< [batch] slots kept per (l, g) row; -1 when it exceeds max_keep
  int max_keep = 0;              ///< row capacity of kept
};
static_assert(std::is_trivially_copyable_v<DeviceKeepPlanView>);

/// Where a select CTA's row writes its result.
enum class SelectTarget : int {
  kPerHead = 0,         ///< row r = KV head g; written to (l, g) for every layer l
  kPerLayerPerHead = 1, ///< row r = l·Hkv + g; written to (l, g)
  kAll = 2,             ///< one row per sequence; written to every (l, g)
  kFlags = 3,           ///< chosen slots set flags[b, slot] = 1 (union members)
};

/// Values a select CTA ranks: row r of sequence b is max over `planes` planes of
/// values[((b·rows + r)·planes + p)·max_len + slot]; with `candidates`, only flagged slots compete.
struct SelectInput {
  const float* values = nullptr;             ///< [batch, rows, planes, max_len]
  int rows = 1;
  int planes = 1;
  const std::uint8_t* candidates = nullptr;  ///< [batch, max_len] or null
};
static_assert(std::is_trivially_copyable_v<SelectInput>);

namespace detail {

/// Order-preserving key of a float (see file comment). Finite values map to keys >= 0x007fffff.
__device__ __forceinline__ std::uint32_t order_key(float x) {
  std::uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 1u;  // NaN: lowest priority
  if ((u & 0x7fffffffu) == 0u) u = 0u;             // -0 ties with +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Block-wide exclusive prefix sums of two per-thread counts in thread order, and their totals.
/// s_a / s_b: [32] shared scratch, free again when this returns.
__device__ __forceinline__ void block_exclusive_scan2(int a, int b, int& pre_a, int& pre_b, int& tot_a, int& tot_b,
                                                      int* s_a, int* s_b) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int inc_a = a, inc_b = b;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int va = __shfl_up_sync(0xffffffffu, inc_a, o), vb = __shfl_up_sync(0xffffffffu, inc_b, o);
    if (lane >= o) {
      inc_a += va;
      inc_b += vb;
    }
  }
  if (lane == 31) {
    s_a[warp] = inc_a;
    s_b[warp] = inc_b;
  }
  __syncthreads();
  int off_a = 0, off_b = 0, all_a = 0, all_b = 0;
  for (int w = 0; w < nwarps; ++w) {
    const int ca = s_a[w], cb = s_b[w];
    if (w < warp) {
      off_a += ca;
      off_b += cb;
    }
    all_a += ca;
    all_b += cb;
  }
  pre_a = off_a + inc_a - a;
  pre_b = off_b + inc_b - b;
  tot_a = all_a;
  tot_b = all_b;
  __syncthreads();
}

}  // namespace detail

/// One CTA per (row r, write split, sequence b = blockIdx.y), blockIdx.x = r·splits + split: the
/// `splits` CTAs of a row rank it redundantly (cheap) and each writes its share of the row's
/// target plan rows, so per_head (L rows per KV head) and union (L·Hkv rows) spread their
/// writes over many SMs. Dynamic shared memory: kCache ? max_len·4 bytes : 0.
/// @param in     values to rank (see SelectInput)
/// @param plan   device keep plan (targets kPerHead / kPerLayerPerHead / kAll)
/// @param flags  [batch, max_len] (target kFlags)
/// Tune: the Select policy (kThreads threads per CTA).
template <class Id, bool kCache, class Tune>
__global__ void __launch_bounds__(Tune::kThreads)
    select_kernel(SelectInput in, DeviceKeepPlanView plan, std::uint8_t* __restrict__ flags, RoundSeqs<Id> seqs,
                  SelectionParams p, int L, int Hkv, SelectTarget target, int splits) {
  extern __shared__ std::uint32_t s_keys[];
  __shared__ unsigned s_hist[2][256];
  __shared__ unsigned s_sel[3];
  __shared__ int s_wa[32], s_wb[32];

  // No griddep_launch_dependents(): compaction CTAs scheduled beside select's slow the
  // compaction down; it starts when select completes.
  const int r = blockIdx.x / splits, split = blockIdx.x % splits, b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const KeepCounts kc = seqs.counts(b, p);  // round inputs: before the wait
  detail::griddep_wait();  // the values to rank come from the kernel before
  const int T = kc.length, begin = kc.selectable_begin, end = kc.selectable_end, n = end - begin;
  const long long ML = seqs.max_len;

  // Plan rows this CTA writes: first + q·stride, q < count.
  int first = 0, count = 0, stride = 1;
  if (target == SelectTarget::kPerHead) {
    first = r;
    count = L;
    stride = Hkv;
  } else if (target == SelectTarget::kPerLayerPerHead) {
    first = r;
    count = 1;
  } else if (target == SelectTarget::kAll) {
    count = L * Hkv;
  }
  {  // this CTA's share of the target rows
    const int q0 = static_cast<int>(static_cast<long long>(count) * split / splits);
    const int q1 = static_cast<int>(static_cast<long long>(count) * (split + 1) / splits);
    first += q0 * stride;
    count = q1 - q0;
  }
  if (target != SelectTarget::kFlags) {
    if (r == 0 && split == 0 && tid == 0) plan.keep[b] = kc.keep <= plan.max_keep ? kc.keep : -1;
    if (kc.keep > plan.max_keep) return;  // the caller's max_keep is too small: reported as keep = -1
  }
  std::int32_t* rows0 = plan.kept + static_cast<long long>(b) * L * Hkv * plan.max_keep;
  const auto write_pos = [&](int pos, int slot) {
    for (int q = 0; q < count; ++q)
      rows0[static_cast<long long>(first + q * stride) * plan.max_keep + pos] = slot;
  };

  if (kc.identity) {  // keep everything (nothing to flag in union member rows)
    if (target != SelectTarget::kFlags)
      for (int j = tid; j < T; j += blockDim.x) write_pos(j, j);
    return;
  }
  if (target != SelectTarget::kFlags) {
    for (int j = tid; j < begin; j += blockDim.x) write_pos(j, j);
    for (int j = end + tid; j < T; j += blockDim.x) write_pos(begin + kc.quota + (j - end), j);
  }
  if (kc.quota == 0 || n <= 0) return;

  const float* vals = in.values + (static_cast<long long>(b) * in.rows + r) * in.planes * ML + begin;
  const std::uint8_t* cand = in.candidates ? in.candidates + b * ML + begin : nullptr;
  const auto load_key = [&](int i) -> std::uint32_t {
    float v = vals[i];
    for (int q = 1; q < in.planes; ++q) {
      const float w = vals[q * ML + i];
      v = v < w ? w : v;
    }
    if (cand && !cand[i]) return 0u;
    return detail::order_key(v);
  };
  const auto key_at = [&](int i) -> std::uint32_t {
    if constexpr (kCache) return s_keys[i];
    else return load_key(i);
  };
  if constexpr (kCache)
    for (int i = tid; i < n; i += blockDim.x) s_keys[i] = load_key(i);
  for (int i = tid; i < 256; i += blockDim.x) s_hist[0][i] = 0u;  // the first pass's histogram
  __syncthreads();

  // Keys are walked in tiles of blockDim·per; thread tid owns the contiguous keys
  // [t0 + tid·per, t0 + (tid + 1)·per) of tile t0. With the keys in shared memory one tile covers
  // the row: histogram updates are run-length aggregated (neighbouring slots often share a
  // digit, the first digits nearly always) and the ranking needs a single block scan. Keys read
  // from global memory keep per = 1, so every load of a warp is coalesced.
  const int per = kCache ? (n + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x) : 1;
  const int tile = per * static_cast<int>(blockDim.x);
  // ---- radix select: threshold key `prefix` and how many slots equal to it are taken ---------
  // Two histograms: pass p counts into s_hist[p & 1] while clearing the other, which warp 0 last
  // read in pass p − 1's bin search, finished before that pass's last barrier.
  unsigned prefix = 0u, pmask = 0u, krem = static_cast<unsigned>(kc.quota);
  bool take_all = false;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    unsigned* const hist = s_hist[pass & 1];
    for (int i = tid; i < 256; i += blockDim.x) s_hist[(pass + 1) & 1][i] = 0u;
    unsigned run_bin = 0u, run = 0u;  // cached rows: the open run of equal bins
    for (int t0 = 0; t0 < n; t0 += tile) {
      if constexpr (kCache) {
        const int i0 = t0 + tid * per, i1 = min(n, i0 + per);
        for (int i = i0; i < i1; ++i) {
          const std::uint32_t key = key_at(i);
          if (key != 0u && (key & pmask) == prefix) {
            const unsigned bin = (key >> shift) & 255u;
            if (bin != run_bin && run != 0u) {
              atomicAdd(&hist[run_bin], run);
              run = 0u;
            }
            run_bin = bin;
            ++run;
          }
        }
      } else {
        // One key per thread per tile (per = 1): lanes with equal bins add once, through their
        // lowest lane (t0 is uniform, so the whole warp reaches the match).
        const int i = t0 + tid;
        const std::uint32_t key = i < n ? key_at(i) : 0u;
        const bool counts = key != 0u && (key & pmask) == prefix;
        const unsigned bin = (key >> shift) & 255u;
        const unsigned peers = __match_any_sync(0xffffffffu, counts ? bin : 0xffffffffu);
        if (counts && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
      }
    }
    if constexpr (kCache)
      if (run != 0u) atomicAdd(&hist[run_bin], run);
    __syncthreads();
    if (warp == 0) {
      // lane owns bins 255 − 8·lane − q (q < 8): lane 0 the highest
      unsigned c[8], tot = 0u;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        c[q] = hist[255 - 8 * lane - q];
        tot += c[q];
      }
      unsigned incl = tot;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const unsigned above = incl - tot;
      const bool mine = above < krem && krem <= incl;
      if (!__any_sync(0xffffffffu, mine) && lane == 0) {
        // fewer competing slots than the quota (unreachable in a valid round): take them all
        s_sel[0] = 0u;
        s_sel[1] = 1u;
        s_sel[2] = 1u;
      }
      if (mine) {
        unsigned acc = above;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          if (acc + c[q] >= krem) {
            s_sel[0] = static_cast<unsigned>(255 - 8 * lane - q);
            s_sel[1] = krem - acc;
            s_sel[2] = c[q];
            break;
          }
          acc += c[q];
        }
      }
    }
    __syncthreads();
    const unsigned bin = s_sel[0], need = s_sel[1], cnt = s_sel[2];
    prefix |= bin << shift;
    pmask |= 255u << shift;
    krem = need;
    if (cnt == need) {  // the whole bin is taken: every key >= prefix is selected
      take_all = true;
      break;
    }
    // s_sel is written again only in the next pass's bin search, after its histogram barrier,
    // which every thread reaches after reading it here.
  }
  if (take_all && prefix == 0u) prefix = 1u;  // key 0 never competes
  const int krem_eff = take_all ? INT_MAX : static_cast<int>(krem);

  // ---- rank in slot order and write ------------------------------------------------------------
  // Slot i is taken when its key is above the threshold, or equal to it and among the first
  // krem_eff equal keys in slot order; its output rank is the number of taken slots before it.
  int gt_base = 0, eq_base = 0;  // taken-candidate counts of the tiles before this one
  for (int t0 = 0; t0 < n; t0 += tile) {
    const int i0 = t0 + tid * per, i1 = min(n, i0 + per);
    int gt_cnt = 0, eq_cnt = 0;
    for (int i = i0; i < i1; ++i) {
      const std::uint32_t key = key_at(i);
      gt_cnt += key != 0u && key > prefix;
      eq_cnt += key != 0u && key == prefix;
    }
    int gt_pre, eq_pre, gt_tot, eq_tot;
    detail::block_exclusive_scan2(gt_cnt, eq_cnt, gt_pre, eq_pre, gt_tot, eq_tot, s_wa, s_wb);
    gt_pre += gt_base;
    eq_pre += eq_base;
    for (int i = i0; i < i1; ++i) {
      const std::uint32_t key = key_at(i);
      const bool gt = key != 0u && key > prefix;
      const bool eq = key != 0u && key == prefix;
      if (gt || (eq && eq_pre < krem_eff)) {
        const int out_rank = gt_pre + (eq_pre < krem_eff ? eq_pre : krem_eff);
        const int slot = begin + i;
        if (target == SelectTarget::kFlags) flags[b * ML + slot] = 1;
        else write_pos(begin + out_rank, slot);
      }
      gt_pre += gt;
      eq_pre += eq;
    }
    gt_base += gt_tot;
    eq_base += eq_tot;
  }
}

}  // namespace triattn::cuda

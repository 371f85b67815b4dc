// SPDX-License-Identifier: Apache-2.0
// The kernels cuda::paged_round adds around the scoring / selection / compaction chain:
//   paged_round_prologue_kernel  which sequences take part (RoundTrigger) -> effective lengths
//   nonfinite_scan_kernel        flags sequences with a non-finite raw score in a selectable range
//                                (only without normalisation: row_stats' mean shows it otherwise)
//   paged_round_outputs_kernel   per-sequence status, new length, freed table columns, first
//                                moved slot, kept logical positions, and the keep counts
//                                compaction acts on
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/paged_round.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/kernels/normalize_kernel.cuh>

namespace triattn::cuda {

/// What the round's small kernels need besides the view (trivially copyable).
struct PagedRoundParams {
  SelectionParams select;
  int threshold = 0;       ///< budget + divide_length (RoundTrigger::kIfDue)
  bool if_due = false;     ///< RoundTrigger::kIfDue
  bool refuse_nonfinite = true;
  int num_layers = 0, num_q_heads = 0, num_kv_heads = 0;
  int plan_capacity = 0;   ///< row capacity of the workspace keep plan (max_len)
};
static_assert(std::is_trivially_copyable_v<PagedRoundParams>);

/// Workspace arrays of the round besides compression_round's buffers.
struct PagedRoundScratch {
  std::int32_t* eff_lens = nullptr;   ///< [max_seqs] length seen by scoring / selection (0: not due)
  std::int32_t* nonfinite = nullptr;  ///< [batch] nonzero: a non-finite raw score (nonfinite_scan_kernel)
  std::int32_t* plan_kept = nullptr;  ///< [batch, L, Hkv, plan_capacity] kept slots
  std::int32_t* plan_keep = nullptr;  ///< [batch] kept count from selection
  std::int32_t* apply_keep = nullptr; ///< [batch] what compaction applies: plan_keep, or -1 (untouched)
};
static_assert(std::is_trivially_copyable_v<PagedRoundScratch>);

namespace detail {

/// Whether sequence b takes part in the round (kAlways, or its counted length reached the threshold).
__device__ __forceinline__ bool paged_round_due(int len, int prompt_len, const PagedRoundParams& p) {
  if (!p.if_due) return true;
  prompt_len = prompt_len < 0 ? 0 : (prompt_len > len ? len : prompt_len);
  const int counted = p.select.prompt == PromptMode::kPinnedOnTop ? len - prompt_len : len;
  return counted >= p.threshold;
}

__device__ __forceinline__ int paged_round_len(int len, int max_len) {
  return len < 0 ? 0 : (len > max_len ? max_len : len);
}

}  // namespace detail

/// One thread per sequence: eff_lens[seq] = its length when it takes part, else 0; clears its flag.
template <class Id>
__global__ void paged_round_prologue_kernel(const Id* __restrict__ seq_lens, RoundBatch batch, PagedRoundScratch s,
                                            PagedRoundParams p) {
  const int b = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (b >= batch.batch) return;
  const int seq = batch.seq_ids[b];
  const int len = detail::paged_round_len(static_cast<int>(seq_lens[seq]), batch.max_len);
  s.eff_lens[seq] = detail::paged_round_due(len, batch.prompt_lens[b], p) ? len : 0;
  s.nonfinite[b] = 0;
  s.plan_keep[b] = 0;  // what selection leaves when no row has a slot (max_len 0)
}

/// One CTA per (sequence, layer, query head) row: sets nonfinite[b] when a raw score in the row's
/// selectable range is NaN or ±Inf.
template <class Id>
__global__ void nonfinite_scan_kernel(const float* __restrict__ scores, RoundSeqs<Id> seqs, PagedRoundScratch s,
                                      PagedRoundParams p) {
  const long long row = blockIdx.x;
  const int b = static_cast<int>(row / (static_cast<long long>(p.num_layers) * p.num_q_heads));
  const KeepCounts kc = seqs.counts(b, p.select);
  if (kc.identity) return;
  const float* x = scores + row * seqs.max_len;
  int bad = 0;
  for (int j = kc.selectable_begin + static_cast<int>(threadIdx.x); j < kc.selectable_end; j += static_cast<int>(blockDim.x))
    bad |= !isfinite(x[j]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(s.nonfinite + b, 1);
}

/// NonFinitePolicy::kEvictFirst: a selectable slot with a non-finite raw score in any row of its
/// sequence becomes NaN in every row (row statistics skip it, selection ranks NaN below every
/// finite value), as the CPU round ranks such a token lowest everywhere. Grid (slot tiles, batch).
template <class Id>
__global__ void mark_broken_slots_kernel(float* __restrict__ scores, RoundSeqs<Id> seqs, PagedRoundParams p) {
  const int b = static_cast<int>(blockIdx.y);
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const KeepCounts kc = seqs.counts(b, p.select);
  if (kc.identity || j < kc.selectable_begin || j >= kc.selectable_end) return;
  const long long rows = static_cast<long long>(p.num_layers) * p.num_q_heads;
  float* x = scores + static_cast<long long>(b) * rows * seqs.max_len + j;
  bool broken = false;
  for (long long r = 0; r < rows && !broken; ++r) broken = !isfinite(x[r * seqs.max_len]);
  if (!broken) return;
  const float nan = __int_as_float(0x7fffffff);
  for (long long r = 0; r < rows; ++r) x[r * seqs.max_len] = nan;
}

/// Grid (batch, kept row chunks). Every CTA of sequence b derives its status from the same
/// inputs; CTA (b, 0) writes the per-sequence outputs and the keep count compaction applies,
/// CTAs (b, y) write the kept logical positions of rows y, y + gridDim.y, ...
/// @param stats row statistics [batch, L, Hq] when the round normalised (their mean is finite
///              exactly when every selectable raw score of the row is), else nullptr
template <class Id>
__global__ void paged_round_outputs_kernel(const Id* __restrict__ seq_lens, int block_size, RoundBatch batch,
                                           RoundOutputs out, PagedRoundScratch s, const RowStats* __restrict__ stats,
                                           PagedRoundParams p) {
  const int b = static_cast<int>(blockIdx.x);
  const int seq = batch.seq_ids[b];
  const int len = detail::paged_round_len(static_cast<int>(seq_lens[seq]), batch.max_len);
  const bool due = detail::paged_round_due(len, batch.prompt_lens[b], p);
  int bad = 0;
  if (stats != nullptr) {
    const int rows = p.num_layers * p.num_q_heads;
    const RowStats* st = stats + static_cast<long long>(b) * rows;
    for (int r = static_cast<int>(threadIdx.x); r < rows; r += static_cast<int>(blockDim.x))
      bad |= !isfinite(st[r].mean);
  }
  bad = __syncthreads_or(bad);
  if (stats == nullptr) bad = s.nonfinite[b] != 0;
  const int keep = s.plan_keep[b];
  RoundStatus status = RoundStatus::kCompressed;
  if (!due) status = RoundStatus::kNotDue;
  else if (bad && p.refuse_nonfinite) status = RoundStatus::kNonFinite;
  else if (keep < 0 || (out.kept != nullptr && keep > out.max_keep)) status = RoundStatus::kNoRoom;
  const bool done = status == RoundStatus::kCompressed;
  const int new_len = done ? keep : len;
  if (blockIdx.y == 0 && out.first_moved != nullptr) {  // uniform per CTA: the barriers are safe
    __shared__ int first;
    if (threadIdx.x == 0) first = new_len;
    __syncthreads();
    if (done) {  // binary search per (layer, KV head) row of the plan
      int mine = new_len;
      const int rows = p.num_layers * p.num_kv_heads;
      for (int r = static_cast<int>(threadIdx.x); r < rows; r += static_cast<int>(blockDim.x)) {
        const int f = first_moved_slot(s.plan_kept + (static_cast<long long>(b) * rows + r) * p.plan_capacity, keep);
        mine = f < mine ? f : mine;
      }
      atomicMin(&first, mine);
    }
    __syncthreads();
    if (threadIdx.x == 0) out.first_moved[b] = first;
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    out.status[b] = static_cast<std::int32_t>(status);
    out.new_lens[b] = new_len;
    out.freed_begin[b] = (new_len + block_size - 1) / block_size;
    out.freed_end[b] = (len + block_size - 1) / block_size;
    s.apply_keep[b] = done ? keep : -1;
  }
  if (!done || out.kept == nullptr) return;
  const long long plan_row = static_cast<long long>(p.plan_capacity);
  for (int r = static_cast<int>(blockIdx.y); r < out.kept_rows; r += static_cast<int>(gridDim.y)) {
    int l = 0, g = 0;
    kept_row_source(r, out.kept_rows, p.num_kv_heads, &l, &g);
    const std::int32_t* src =
        s.plan_kept + ((static_cast<long long>(b) * p.num_layers + l) * p.num_kv_heads + g) * plan_row;
    std::int32_t* dst = out.kept + (static_cast<long long>(b) * out.kept_rows + r) * out.max_keep;
    const std::int32_t* pos = out.slot_positions != nullptr
                                  ? out.slot_positions + (static_cast<long long>(b) * out.kept_rows + r) * out.positions_stride
                                  : nullptr;
    for (int i = static_cast<int>(threadIdx.x); i < keep; i += static_cast<int>(blockDim.x)) {
      const std::int32_t slot = src[i];
      dst[i] = pos != nullptr ? pos[slot] : slot;
    }
  }
}

}  // namespace triattn::cuda

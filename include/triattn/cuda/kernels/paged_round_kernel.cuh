// SPDX-License-Identifier: Apache-2.0
// The kernels cuda::paged_round adds around the scoring / selection / compaction chain:
//   paged_round_check_kernel     device validation of the data the round reads (every table row's
//                                length and block ids, the batch's ids, lengths, prompt lengths,
//                                t0, protected prefixes) and block reference counts over every row
//   paged_round_share_kernel     per sequence: leading shared table columns (protected whole) or a
//                                shared block after a private one (refused); its last CTA then
//                                decides which sequences take part (RoundTrigger, and none when
//                                the error record is set) -> effective lengths and prefixes
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
#include <triattn/core/round_types.hpp>
#include <triattn/core/trigger.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/kernels/normalize_kernel.cuh>
#include <triattn/engine/prefix_protection.hpp>

namespace triattn::cuda {

/// What the round's small kernels need besides the view (trivially copyable).
struct PagedRoundParams {
  SelectionParams select;
  bool if_due = false;     ///< RoundTrigger::kIfDue
  bool refuse_nonfinite = true;
  int num_layers = 0, num_q_heads = 0, num_kv_heads = 0;
  int plan_capacity = 0;   ///< row capacity of the workspace keep plan (max_len)
  int max_seqs = 0;        ///< rows of the view's tables (valid sequence ids)
};
static_assert(std::is_trivially_copyable_v<PagedRoundParams>);

/// Why a device round refused its inputs (RoundError::code). The host round throws on the same.
enum class RoundErrorCode : std::int32_t {
  kNone = 0,
  kSeqId = 1,            ///< batch.seq_ids[entry] = value is not a row of the tables
  kDuplicateSeq = 2,     ///< batch.seq_ids[entry] = seq also at batch entry `other`
  kLength = 3,           ///< seq_lens[seq] = value is outside [0, capacity] (any row the round reads)
  kBlockId = 4,          ///< block_tables[seq][column] = value is outside [0, num_blocks)
  kMaxLen = 5,           ///< seq_lens[seq] = value exceeds batch.max_len
  kPromptLen = 6,        ///< batch.prompt_lens[entry] = value is outside [0, length]
  kT0 = 7,               ///< batch.t0[entry] = value is smaller than the cached length
  kProtectedPrefix = 8,  ///< batch.protected_prefix[entry] = value is negative
  kSharedBlock = 9,      ///< block_tables[seq][column] = value is shared with sequence `other` (or
                         ///< appears twice in its row: other = seq) but follows a private block
};

/// The device round's error record, at offset 0 of its workspace (cuda::paged_round_error). It is
/// cleared at the start of every round; when code != kNone after the round, the round wrote
/// nothing to the cache, every status is RoundStatus::kInvalid, and the fields name one of the bad
/// inputs (entry / seq / column: -1 where not applicable).
struct RoundError {
  std::int32_t code;    ///< RoundErrorCode
  std::int32_t entry;   ///< batch entry
  std::int32_t seq;     ///< table row
  std::int32_t column;  ///< table column
  std::int64_t value;   ///< the offending value
  std::int32_t other;   ///< the other sequence (kDuplicateSeq: batch entry; kSharedBlock: row)
  std::int32_t done;    ///< internal: CTAs of paged_round_share_kernel that finished
};
static_assert(std::is_trivially_copyable_v<RoundError> && sizeof(RoundError) <= 256);

/// Workspace arrays of the round besides compression_round's buffers.
struct PagedRoundScratch {
  RoundError* error = nullptr;        ///< the error record (workspace offset 0)
  std::int32_t* block_refs = nullptr; ///< [num_blocks] table entries naming each block (shares plan_kept's memory)
  std::int32_t* eff_lens = nullptr;   ///< [max_seqs] length seen by scoring / selection (0: not due)
  std::int32_t* nonfinite = nullptr;  ///< [batch] nonzero: a non-finite raw score (nonfinite_scan_kernel)
  std::int32_t* plan_kept = nullptr;  ///< [batch, L, Hkv, plan_capacity] kept slots
  std::int32_t* plan_keep = nullptr;  ///< [batch] kept count from selection
  std::int32_t* apply_keep = nullptr; ///< [batch] what compaction applies: plan_keep, or -1 (untouched)
  std::int32_t* safe_ids = nullptr;   ///< [batch] seq_ids for the kernels after the checks (in range)
  std::int32_t* prefix = nullptr;     ///< [batch] effective protected prefix (effective_protected_prefix)
  std::int32_t* first_private = nullptr;  ///< [batch] max over private columns j of nb - j (0: none)
  std::int32_t* last_shared = nullptr;    ///< [batch] max over shared columns j of j + 1 (0: none)
};
static_assert(std::is_trivially_copyable_v<PagedRoundScratch>);

namespace detail {

/// Whether sequence b takes part in the round: kAlways, or CompressionTrigger's rule on a decode
/// step, as the host round decides (an out-of-range prompt length is clamped; the checks flag it).
__device__ __forceinline__ bool paged_round_due(int len, int prompt_len, const PagedRoundParams& p) {
  return !p.if_due ||
         CompressionTrigger::fires(CompressionTrigger::counted(len, prompt_len, p.select.prompt), true, p.select);
}

__device__ __forceinline__ int paged_round_len(int len, int max_len) {
  return len < 0 ? 0 : (len > max_len ? max_len : len);
}

}  // namespace detail

namespace detail {

/// Records the first error of a round (later ones are dropped).
__device__ __forceinline__ void record_round_error(RoundError* e, RoundErrorCode code, int entry, int seq, int column,
                                                   long long value, int other = -1) {
  if (atomicCAS(&e->code, 0, static_cast<std::int32_t>(code)) != 0) return;
  e->entry = entry;
  e->seq = seq;
  e->column = column;
  e->value = value;
  e->other = other;
}

__device__ __forceinline__ bool round_failed(const RoundError* e) {
  return *static_cast<const volatile std::int32_t*>(&e->code) != 0;
}

}  // namespace detail

/// Grid (max_seqs), any block size; the error record and block_refs are zero. CTA r checks row r
/// of the tables (length in [0, capacity], block ids in [0, num_blocks) up to the length) and
/// counts its blocks; thread g < batch checks batch entry g (sequence id, length <= max_len,
/// prompt length, t0, protected prefix) and clears its share counters.
template <class T, class Id>
__global__ void paged_round_check_kernel(KvCacheView<T, Id> view, RoundBatch batch, PagedRoundScratch s) {
  const int row = static_cast<int>(blockIdx.x);
  const long long cap = view.capacity_tokens();
  const long long len = view.seq_lens[row];
  if (len < 0 || len > cap) {
    if (threadIdx.x == 0) detail::record_round_error(s.error, RoundErrorCode::kLength, -1, row, -1, len);
  } else {
    const int nb = static_cast<int>((len + view.block.block_size - 1) / view.block.block_size);
    const Id* ids = view.table_row(row);
    for (int j = static_cast<int>(threadIdx.x); j < nb; j += static_cast<int>(blockDim.x)) {
      const long long id = ids[j];
      if (id < 0 || id >= view.num_blocks)
        detail::record_round_error(s.error, RoundErrorCode::kBlockId, -1, row, j, id);
      else
        atomicAdd(s.block_refs + id, 1);
    }
  }
  const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= batch.batch) return;
  const int b = static_cast<int>(g);
  s.first_private[b] = 0;
  s.last_shared[b] = 0;
  const int seq = batch.seq_ids[b];
  if (seq < 0 || seq >= view.max_seqs) {
    detail::record_round_error(s.error, RoundErrorCode::kSeqId, b, seq, -1, seq);
    return;
  }
  const long long n = view.seq_lens[seq];
  if (n < 0 || n > cap) return;  // reported by row seq's CTA
  if (n > batch.max_len) detail::record_round_error(s.error, RoundErrorCode::kMaxLen, b, seq, -1, n);
  const int pl = batch.prompt_lens[b];
  if (pl < 0 || pl > n) detail::record_round_error(s.error, RoundErrorCode::kPromptLen, b, seq, -1, pl);
  if (batch.t0[b] < n) detail::record_round_error(s.error, RoundErrorCode::kT0, b, seq, -1, batch.t0[b]);
  if (batch.protected_prefix != nullptr && batch.protected_prefix[b] < 0)
    detail::record_round_error(s.error, RoundErrorCode::kProtectedPrefix, b, seq, -1, batch.protected_prefix[b]);
}

/// Grid (column tiles, batch), blockDim.x columns a tile; after paged_round_check_kernel. Each CTA
/// classifies its columns of entry b's row (shared: the block's reference count exceeds 1) into
/// first_private / last_shared. The last CTA to finish then, for every entry: refuses a shared
/// column after a private one (kSharedBlock) and a sequence twice in the batch, and writes what
/// the kernels after it read: safe_ids, eff_lens (0 for sequences that do not take part, and for
/// all when the error record is set), prefix, and cleared nonfinite / plan_keep.
template <class T, class Id>
__global__ void paged_round_share_kernel(KvCacheView<T, Id> view, RoundBatch batch, PagedRoundScratch s,
                                         PagedRoundParams p) {
  __shared__ int sh_first_private, sh_last_shared;
  __shared__ bool sh_last_cta;
  const int b = static_cast<int>(blockIdx.y);
  const int bs = view.block.block_size;
  if (threadIdx.x == 0) {
    sh_first_private = 0;
    sh_last_shared = 0;
  }
  __syncthreads();
  if (!detail::round_failed(s.error)) {  // ids and lengths were checked: the row can be read
    const int seq = batch.seq_ids[b];
    const int nb = (static_cast<int>(view.seq_lens[seq]) + bs - 1) / bs;
    const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (j < nb) {
      if (s.block_refs[view.table_row(seq)[j]] > 1) atomicMax(&sh_last_shared, j + 1);
      else atomicMax(&sh_first_private, nb - j);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (sh_first_private > 0) atomicMax(s.first_private + b, sh_first_private);
    if (sh_last_shared > 0) atomicMax(s.last_shared + b, sh_last_shared);
    __threadfence();
    const unsigned ctas = gridDim.x * gridDim.y;
    sh_last_cta = static_cast<unsigned>(atomicAdd(&s.error->done, 1)) == ctas - 1;
  }
  __syncthreads();
  if (!sh_last_cta) return;
  __threadfence();
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  if (!detail::round_failed(s.error)) {
    for (int e = tid; e < batch.batch; e += nt) s.eff_lens[batch.seq_ids[e]] = e;  // duplicate marks
    __syncthreads();
    for (int e = tid; e < batch.batch; e += nt) {
      const int seq = batch.seq_ids[e];
      const int mark = s.eff_lens[seq];
      if (mark != e) detail::record_round_error(s.error, RoundErrorCode::kDuplicateSeq, e, seq, -1, seq, mark);
      const int nb = (static_cast<int>(view.seq_lens[seq]) + bs - 1) / bs;
      const int fp = __ldcg(s.first_private + e), ls = __ldcg(s.last_shared + e);
      const int first_private = fp > 0 ? nb - fp : nb;
      if (ls - 1 > first_private)
        detail::record_round_error(s.error, RoundErrorCode::kSharedBlock, e, seq, ls - 1,
                                   view.table_row(seq)[ls - 1], seq);
    }
    __syncthreads();
    // Error path only: name a row (other than seq) that references the shared block.
    if (*static_cast<volatile std::int32_t*>(&s.error->code) == static_cast<std::int32_t>(RoundErrorCode::kSharedBlock)) {
      const int seq = s.error->seq;
      const long long block = s.error->value;
      for (int r = tid; r < view.max_seqs; r += nt) {
        if (r == seq) continue;
        const int nb = (static_cast<int>(view.seq_lens[r]) + bs - 1) / bs;
        for (int j = 0; j < nb; ++j)
          if (view.table_row(r)[j] == block) {
            atomicCAS(&s.error->other, seq, r);
            break;
          }
      }
    }
    __syncthreads();
  }
  const bool failed = detail::round_failed(s.error);
  for (int e = tid; e < batch.batch; e += nt) {
    const int raw = batch.seq_ids[e];
    const int seq = raw < 0 ? 0 : (raw >= p.max_seqs ? p.max_seqs - 1 : raw);
    s.safe_ids[e] = seq;
    s.nonfinite[e] = 0;
    s.plan_keep[e] = 0;  // what selection leaves when no row has a slot (max_len 0)
    if (failed) {  // nothing takes part: no kernel after this one reads a slot
      s.eff_lens[seq] = 0;
      s.prefix[e] = 0;
      continue;
    }
    const int len = detail::paged_round_len(static_cast<int>(view.seq_lens[seq]), batch.max_len);
    const int fp = __ldcg(s.first_private + e);
    const int nb = (len + bs - 1) / bs;
    s.eff_lens[seq] = detail::paged_round_due(len, batch.prompt_lens[e], p) ? len : 0;
    s.prefix[e] = effective_protected_prefix(batch.protected_prefix != nullptr ? batch.protected_prefix[e] : 0,
                                             fp > 0 ? nb - fp : nb, bs, len);
  }
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
  if (detail::round_failed(s.error)) {  // the inputs failed the device checks: applying these is a no-op
    if (blockIdx.y == 0 && threadIdx.x == 0) {
      const int raw = batch.seq_ids[b];
      out.status[b] = static_cast<std::int32_t>(RoundStatus::kInvalid);
      out.new_lens[b] = raw >= 0 && raw < p.max_seqs ? static_cast<std::int32_t>(seq_lens[raw]) : 0;
      out.freed_begin[b] = 0;
      out.freed_end[b] = 0;
      s.apply_keep[b] = -1;
    }
    return;
  }
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

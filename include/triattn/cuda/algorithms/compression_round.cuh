// SPDX-License-Identifier: Apache-2.0
// One TriAttention compression round for a batch of sequences, entirely on the device:
//   score (one pass over K) → row statistics → normalise + reduce → top-k select → keep plan
//   → in-place compaction (cuda::compact)
// Caller-owned workspace (workspace_size), no allocation, no host synchronisation, no host
// data: sequence slots, lengths (the view's seq_lens), round starts t0 and prompt lengths are read
// from device memory, so a whole round can be captured once in a CUDA graph and replayed.
//
// After the round, sequence b holds plan.keep[b] slots per (layer, KV head). The device lengths
// and block tables are the caller's (KvCache's host bookkeeping): the kept count is a pure
// function of (length, prompt length, protected prefix, SelectionParams), so the host computes the
// same number with selection::keep_counts without waiting for the device, shrinks its tables and
// publishes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include <triattn/core/kv_view.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/algorithms/compact.cuh>
#include <triattn/cuda/algorithms/normalize.cuh>
#include <triattn/cuda/algorithms/score.cuh>
#include <triattn/cuda/algorithms/select.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// Per-sequence inputs of a round (device arrays) and the row capacity: triattn::RoundBatch.
using RoundBatch = triattn::RoundBatch;

/// Scratch buffers of a round, carved from one caller-owned allocation.
struct RoundWorkspace {
  float* scores = nullptr;       ///< [batch, L, Hq, max_len] raw scores (union: Ŝ)
  RowStats* stats = nullptr;     ///< [batch, L, Hq]
  float* reduced = nullptr;      ///< [batch, reduced_rows, max_len]
  std::uint8_t* flags = nullptr; ///< [batch, max_len] (union)
  float* vmax = nullptr;         ///< [batch, max_len] (union with an agreement: max over this rank's rows)
};

namespace detail {
inline std::size_t round_up_256(std::size_t x) noexcept { return (x + 255) / 256 * 256; }

/// Carves the buffers; returns the bytes used (pass base = nullptr to only measure).
inline std::size_t carve_round_workspace(void* base, const RoundShape& s, PruningMode mode, int batch, int max_len,
                                         RoundWorkspace* out) noexcept {
  const std::size_t B = static_cast<std::size_t>(batch > 0 ? batch : 0);
  const std::size_t T = static_cast<std::size_t>(max_len > 0 ? max_len : 0);
  const std::size_t rows = B * static_cast<std::size_t>(s.num_layers) * static_cast<std::size_t>(s.num_q_heads);
  const bool u = mode == PruningMode::kUnion;
  const std::size_t sizes[5] = {rows * T * sizeof(float), rows * sizeof(RowStats),
                                B * static_cast<std::size_t>(reduced_rows(s, mode)) * T * sizeof(float),
                                u ? B * T : 0, u ? B * T * sizeof(float) : 0};
  std::size_t off[5], total = 0;
  for (int i = 0; i < 5; ++i) {
    off[i] = total;
    total += round_up_256(sizes[i]);
  }
  if (base != nullptr && out != nullptr) {
    char* p = static_cast<char*>(base);
    out->scores = reinterpret_cast<float*>(p + off[0]);
    out->stats = reinterpret_cast<RowStats*>(p + off[1]);
    out->reduced = reinterpret_cast<float*>(p + off[2]);
    out->flags = sizes[3] ? reinterpret_cast<std::uint8_t*>(p + off[3]) : nullptr;
    out->vmax = sizes[4] ? reinterpret_cast<float*>(p + off[4]) : nullptr;
  }
  return total;
}
}  // namespace detail

/// Policy: every stage's tuning (a tuning::ForArch bundle); compression_round (below) takes the
/// selected one.
template <class Policy>
struct basic_compression_round {
  /// Bytes of workspace a round of `batch` sequences of up to `max_len` slots needs.
  [[nodiscard]] static std::size_t workspace_size(const RoundShape& shape, PruningMode mode, int batch,
                                                  int max_len) noexcept {
    return detail::carve_round_workspace(nullptr, shape, mode, batch, max_len, nullptr);
  }

  /// Capacity of a keep-plan row that can never overflow: max_len (a round that keeps
  /// everything, keep = length, writes the identity row). A caller that knows more (e.g. rounds
  /// only run on triggered sequences) may pass less; an overflowing sequence gets keep = -1, no
  /// rows, and is left untouched by compaction.
  [[nodiscard]] static int safe_max_keep(int max_len) noexcept { return max_len; }

  /// Score → select → plan, without compaction (the plan is what compaction consumes).
  /// @param view      paged cache in device memory (data, published block tables and lengths)
  /// @param model     per-model constants in device memory (TriAttentionDeviceScorer)
  /// @param params    selection parameters (by value: nothing is read from the host later)
  /// @param batch     per-sequence device inputs
  /// @param plan      kept [batch, L, Hkv, max_keep], keep [batch] device outputs
  /// @param workspace caller-owned device memory of at least workspace_size(...) bytes
  /// @return cudaErrorInvalidValue on inconsistent arguments or a short workspace, else the
  ///         first failing launch's status
  /// @note asynchronous on `stream`; never allocates, synchronises or throws; capturable.
  template <class T, class Id>
  [[nodiscard]] static cudaError_t plan(const KvCacheView<T, Id>& view, const ScoreModelView& model,
                                        const SelectionParams& params, const RoundBatch& batch,
                                        const DeviceKeepPlanView& plan, void* workspace, std::size_t workspace_bytes,
                                        cudaStream_t stream = nullptr) noexcept {
    Front<Id> f;
    TRIATTN_CUDA_RETURN_IF_ERROR(front(view, model, params, batch, workspace, workspace_bytes, stream, &f));
    if (f.empty) return cudaSuccess;
    return select_keep<Id, typename Policy::Select>(f.ws.scores, f.ws.reduced, f.ws.flags, plan, f.seqs, params,
                                                    f.shape, stream);
  }

  /// plan(...) on one tensor-parallel rank: `view` holds this rank's KV heads and `model` the
  /// statistics of its query heads (slice_for_rank). per_head and per_layer_per_head are
  /// rank-local and ignore `agreement`. union runs in two phases with
  /// agreement(flags [batch, max_len], vmax [batch, max_len], batch, max_len, stream) between them
  /// (see select_union_candidates): with an agreement that leaves the element-wise max over all
  /// ranks (NcclUnionAgreement), every rank writes the tp = 1 keep set for its KV heads. Every
  /// rank must run the same batch (sequence lengths, prompt lengths, params, max_len).
  /// Same contract as plan(); an agreement's error is returned as is.
  template <class T, class Id, UnionAgreement Agreement>
  [[nodiscard]] static cudaError_t plan(const KvCacheView<T, Id>& view, const ScoreModelView& model,
                                        const SelectionParams& params, const RoundBatch& batch,
                                        const DeviceKeepPlanView& plan, void* workspace, std::size_t workspace_bytes,
                                        Agreement&& agreement, cudaStream_t stream) noexcept {
    Front<Id> f;
    TRIATTN_CUDA_RETURN_IF_ERROR(front(view, model, params, batch, workspace, workspace_bytes, stream, &f));
    if (f.empty) return cudaSuccess;
    if (params.mode != PruningMode::kUnion)
      return select_keep<Id, typename Policy::Select>(f.ws.scores, f.ws.reduced, f.ws.flags, plan, f.seqs, params,
                                                      f.shape, stream);
    if (plan.kept == nullptr || plan.keep == nullptr || plan.max_keep < 0) return cudaErrorInvalidValue;
    TRIATTN_CUDA_RETURN_IF_ERROR((select_union_candidates<Id, typename Policy::Select>(
        f.ws.scores, f.ws.reduced, f.ws.flags, f.ws.vmax, f.seqs, params, f.shape, stream)));
    TRIATTN_CUDA_RETURN_IF_ERROR(agreement(f.ws.flags, f.ws.vmax, batch.batch, batch.max_len, stream));
    return select_union_finish<Id, typename Policy::Select>(f.ws.flags, f.ws.vmax, plan, f.seqs, params, f.shape,
                                                            stream);
  }

  /// The whole round: plan(...) then cuda::compact::run on the same plan. Same contract as plan().
  template <class T, class Id>
  [[nodiscard]] static cudaError_t run(const KvCacheView<T, Id>& view, const ScoreModelView& model,
                                       const SelectionParams& params, const RoundBatch& batch,
                                       const DeviceKeepPlanView& plan_out, void* workspace,
                                       std::size_t workspace_bytes, cudaStream_t stream = nullptr) noexcept {
    TRIATTN_CUDA_RETURN_IF_ERROR(plan(view, model, params, batch, plan_out, workspace, workspace_bytes, stream));
    if (batch.batch == 0) return cudaSuccess;
    return compact::run<T, Id, typename Policy::Compact>(
        view, CompactParams{plan_out.kept, plan_out.keep, batch.seq_ids, plan_out.max_keep}, batch.batch, stream);
  }

  /// The whole round on one tensor-parallel rank: plan(..., agreement, stream) then compaction of
  /// this rank's KV heads. Same contract as the plan() overload with an agreement.
  template <class T, class Id, UnionAgreement Agreement>
  [[nodiscard]] static cudaError_t run(const KvCacheView<T, Id>& view, const ScoreModelView& model,
                                       const SelectionParams& params, const RoundBatch& batch,
                                       const DeviceKeepPlanView& plan_out, void* workspace,
                                       std::size_t workspace_bytes, Agreement&& agreement,
                                       cudaStream_t stream) noexcept {
    TRIATTN_CUDA_RETURN_IF_ERROR(plan(view, model, params, batch, plan_out, workspace, workspace_bytes,
                                      std::forward<Agreement>(agreement), stream));
    if (batch.batch == 0) return cudaSuccess;
    return compact::run<T, Id, typename Policy::Compact>(
        view, CompactParams{plan_out.kept, plan_out.keep, batch.seq_ids, plan_out.max_keep}, batch.batch, stream);
  }

 private:
  /// What score → row statistics → normalise-and-reduce leave for the select.
  template <class Id>
  struct Front {
    RoundShape shape;
    RoundWorkspace ws;
    RoundSeqs<Id> seqs;
    bool empty = false;  ///< batch 0: nothing was launched
  };

  template <class T, class Id>
  [[nodiscard]] static cudaError_t front(const KvCacheView<T, Id>& view, const ScoreModelView& model,
                                         const SelectionParams& params, const RoundBatch& batch, void* workspace,
                                         std::size_t workspace_bytes, cudaStream_t stream, Front<Id>* f) noexcept {
    f->shape = RoundShape{model.num_layers, model.num_q_heads, model.num_kv_heads};
    if (!f->shape.valid() || batch.batch < 0 || batch.max_len < 0 || batch.batch > 65535) return cudaErrorInvalidValue;
    if (batch.batch == 0) {
      f->empty = true;
      return cudaSuccess;
    }
    if (batch.seq_ids == nullptr || batch.t0 == nullptr || batch.prompt_lens == nullptr || workspace == nullptr ||
        !is_aligned(workspace, 256))
      return cudaErrorInvalidValue;
    if (detail::carve_round_workspace(workspace, f->shape, params.mode, batch.batch, batch.max_len, &f->ws) >
        workspace_bytes)
      return cudaErrorInvalidValue;
    f->seqs = RoundSeqs<Id>{batch.seq_ids,   view.seq_lens,  batch.prompt_lens,
                            batch.batch,     batch.max_len,  batch.protected_prefix};
    TRIATTN_CUDA_RETURN_IF_ERROR((score<T, Id, typename Policy::Score>(
        view, model, ScoreBatch{batch.seq_ids, batch.t0, batch.batch, batch.max_len}, f->ws.scores, stream)));
    if (params.normalize)
      TRIATTN_CUDA_RETURN_IF_ERROR(
          (row_stats<Id, typename Policy::Normalize>(f->ws.scores, f->ws.stats, f->seqs, params, f->shape, stream)));
    return gqa_reduce<Id, typename Policy::Normalize>(f->ws.scores, f->ws.stats, f->ws.reduced, f->ws.flags, f->seqs,
                                                      params, f->shape, stream);
  }
};

using compression_round = basic_compression_round<tuning::Selected>;

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Host launchers of the normalise-and-reduce stage of a round (spec §4): per-row z-normalisation
// statistics, then the mode's reduction (GQA max, mean over layers). Asynchronous, no allocation,
// no host synchronisation; per-sequence lengths and prompt lengths come from device memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>
#include <triattn/cuda/kernels/normalize_kernel.cuh>

namespace triattn::cuda {

/// Geometry of the score buffers of a round.
struct RoundShape {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;

  [[nodiscard]] bool valid() const noexcept {
    return num_layers > 0 && num_q_heads > 0 && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0;
  }
};

/// Rows of the reduced buffer per sequence: Hkv (per_head), L·Hkv (per_layer_per_head), L (union).
[[nodiscard]] inline int reduced_rows(const RoundShape& s, PruningMode mode) noexcept {
  switch (mode) {
    case PruningMode::kPerHead: return s.num_kv_heads;
    case PruningMode::kPerLayerPerHead: return s.num_layers * s.num_kv_heads;
    case PruningMode::kUnion: return s.num_layers;
  }
  return 0;
}

/// z-normalisation statistics of every (b, l, h) row over its selectable slots.
/// @param scores [batch, L, Hq, max_len] raw scores (device)
/// @param stats  [batch, L, Hq] output (device)
/// @note asynchronous on `stream`; capturable.
template <class Id, class Policy = tuning::Selected::Normalize>
[[nodiscard]] cudaError_t row_stats(const float* scores, RowStats* stats, const RoundSeqs<Id>& seqs,
                                    const SelectionParams& params, const RoundShape& shape,
                                    cudaStream_t stream = nullptr) noexcept {
  if (!shape.valid() || seqs.batch < 0 || seqs.max_len < 0) return cudaErrorInvalidValue;
  if (seqs.batch == 0 || seqs.max_len == 0) return cudaSuccess;
  const int rows_per_seq = shape.num_layers * shape.num_q_heads;
  const long long rows = static_cast<long long>(seqs.batch) * rows_per_seq;
  if (rows > 0x7fffffffLL) return cudaErrorInvalidValue;
  TRIATTN_CUDA_RETURN_IF_ERROR(launch_dependent(row_stats_kernel<Id, Policy>, dim3(static_cast<unsigned>(rows)),
                                                dim3(Policy::kRowStatsThreads), 0, stream, scores, stats, seqs, params,
                                                rows_per_seq));
  return check_launch(stream);
}

/// Normalises (when params.normalize) and reduces per pruning mode.
/// @param scores  [batch, L, Hq, max_len] raw scores; union mode overwrites the selectable slots with Ŝ
/// @param stats   [batch, L, Hq] from row_stats (may be null when params.normalize is false)
/// @param out     [batch, reduced_rows(shape, mode), max_len]
/// @param flags   union mode: [batch, max_len] candidate flags (cleared here); otherwise unused
/// @note asynchronous on `stream`; capturable.
template <class Id, class Policy = tuning::Selected::Normalize>
[[nodiscard]] cudaError_t gqa_reduce(float* scores, const RowStats* stats, float* out, std::uint8_t* flags,
                                     const RoundSeqs<Id>& seqs, const SelectionParams& params,
                                     const RoundShape& shape, cudaStream_t stream = nullptr) noexcept {
  if (!shape.valid() || seqs.batch < 0 || seqs.max_len < 0 || seqs.batch > 65535) return cudaErrorInvalidValue;
  if (params.normalize && stats == nullptr) return cudaErrorInvalidValue;
  if (params.mode == PruningMode::kUnion && flags == nullptr) return cudaErrorInvalidValue;
  if (seqs.batch == 0 || seqs.max_len == 0) return cudaSuccess;
  const int slots_per_cta = params.mode == PruningMode::kPerHead ? Policy::kReduceSlots : Policy::kReduceThreads;
  const dim3 grid(static_cast<unsigned>((seqs.max_len + slots_per_cta - 1) / slots_per_cta),
                  static_cast<unsigned>(reduced_rows(shape, params.mode)), static_cast<unsigned>(seqs.batch));
  if (grid.y > 65535u) return cudaErrorInvalidValue;
  const std::size_t smem = gqa_reduce_smem_bytes<Policy>(params.mode, params.normalize, shape.num_layers,
                                                         shape.num_q_heads, shape.num_kv_heads);
  // per_head is compiled for the common group sizes (no guards or divisions in its loads).
  const auto launch = [&](auto kernel, DynamicSmemGrant& granted) {
    TRIATTN_CUDA_RETURN_IF_ERROR(granted.ensure(kernel, smem));  // > 48 KiB only for very many layers or heads
    return launch_dependent(kernel, grid, dim3(Policy::kReduceThreads), smem, stream, scores, stats, out, flags, seqs,
                            params, shape.num_layers, shape.num_q_heads, shape.num_kv_heads);
  };
  static DynamicSmemGrant granted_any, granted_1, granted_2, granted_4, granted_8;
  const int G = shape.num_q_heads / shape.num_kv_heads;
  const bool per_head = params.mode == PruningMode::kPerHead;
  if (per_head && G == 1) TRIATTN_CUDA_RETURN_IF_ERROR(launch(gqa_reduce_kernel<Id, 1, Policy>, granted_1));
  else if (per_head && G == 2) TRIATTN_CUDA_RETURN_IF_ERROR(launch(gqa_reduce_kernel<Id, 2, Policy>, granted_2));
  else if (per_head && G == 4) TRIATTN_CUDA_RETURN_IF_ERROR(launch(gqa_reduce_kernel<Id, 4, Policy>, granted_4));
  else if (per_head && G == 8) TRIATTN_CUDA_RETURN_IF_ERROR(launch(gqa_reduce_kernel<Id, 8, Policy>, granted_8));
  else TRIATTN_CUDA_RETURN_IF_ERROR(launch(gqa_reduce_kernel<Id, 0, Policy>, granted_any));
  return check_launch(stream);
}

}  // namespace triattn::cuda

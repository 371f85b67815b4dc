// SPDX-License-Identifier: Apache-2.0
// Host launchers of the top-k selection of a round: from reduced scores to the device keep plan
// (kept slots ascending per (sequence, layer, KV head), protected prompt/sinks/window included).
// Asynchronous, no allocation, no host synchronisation; capturable in a CUDA graph.
#pragma once

#include <cstdint>

#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/algorithms/normalize.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/kernels/select_kernel.cuh>

namespace triattn::cuda {

namespace detail {
template <class Id>
[[nodiscard]] inline cudaError_t launch_select(const SelectInput& in, const DeviceKeepPlanView& plan,
                                               std::uint8_t* flags, const RoundSeqs<Id>& seqs,
                                               const DeviceSelectParams& params, const RoundShape& shape,
                                               SelectTarget target, cudaStream_t stream) noexcept {
  if (in.rows <= 0 || in.planes <= 0 || seqs.batch > 65535) return cudaErrorInvalidValue;
  // Plan rows each ranked row feeds: per_head L, union L·Hkv. Split those writes over up to
  // two CTAs per SM in total (each split re-ranks the row: a few µs of redundant L2 reads).
  const int targets = target == SelectTarget::kPerHead ? shape.num_layers
                      : target == SelectTarget::kAll   ? shape.num_layers * shape.num_kv_heads
                                                       : 1;
  int sms = 0;
  TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
  const long long ctas = static_cast<long long>(in.rows) * (seqs.batch > 0 ? seqs.batch : 1);
  long long splits = (2LL * sms + ctas - 1) / ctas;
  splits = splits < 1 ? 1 : (splits > targets ? targets : splits);
  const long long gx = static_cast<long long>(in.rows) * splits;
  if (gx > 0x7fffffffLL) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(seqs.batch));
  const int sp = static_cast<int>(splits);
  if (seqs.max_len <= kSelectCacheMax) {
    const std::size_t smem = static_cast<std::size_t>(seqs.max_len) * sizeof(std::uint32_t);
    select_kernel<Id, true><<<grid, kSelectThreads, smem, stream>>>(in, plan, flags, seqs, params, shape.num_layers,
                                                                   shape.num_kv_heads, target, sp);
  } else {
    select_kernel<Id, false><<<grid, kSelectThreads, 0, stream>>>(in, plan, flags, seqs, params, shape.num_layers,
                                                                 shape.num_kv_heads, target, sp);
  }
  return check_launch(stream);
}
}  // namespace detail

/// Selects the keep set of every sequence from the reduced buffer of gqa_reduce() and writes the
/// device keep plan. per_head and per_layer_per_head: one CTA per (sequence, reduced row). union:
/// per-(layer, query head) top-quota sets flag the candidates U, then the top-quota of U by
/// max_{l,h} Ŝ is written to every (layer, KV head).
///
/// @param scores   [batch, L, Hq, max_len] union only: Ŝ as left by gqa_reduce()
/// @param reduced  [batch, reduced_rows(shape, mode), max_len] from gqa_reduce()
/// @param flags    union only: [batch, max_len] candidate flags as cleared by gqa_reduce()
/// @param plan     kept [batch, L, Hkv, plan.max_keep], keep [batch] (device outputs); a sequence
///                 whose keep count exceeds max_keep gets keep = -1 and no rows
/// @note asynchronous on `stream`; capturable.
template <class Id>
[[nodiscard]] cudaError_t select_keep(const float* scores, const float* reduced, std::uint8_t* flags,
                                      const DeviceKeepPlanView& plan, const RoundSeqs<Id>& seqs,
                                      const DeviceSelectParams& params, const RoundShape& shape,
                                      cudaStream_t stream = nullptr) noexcept {
  if (!shape.valid() || seqs.batch < 0 || seqs.max_len < 0 || plan.max_keep < 0) return cudaErrorInvalidValue;
  if (plan.kept == nullptr || plan.keep == nullptr) return cudaErrorInvalidValue;
  if (seqs.batch == 0) return cudaSuccess;
  switch (params.mode) {
    case PruningMode::kPerHead:
      return detail::launch_select(SelectInput{reduced, shape.num_kv_heads, 1, nullptr}, plan, nullptr, seqs, params,
                                   shape, SelectTarget::kPerHead, stream);
    case PruningMode::kPerLayerPerHead:
      return detail::launch_select(SelectInput{reduced, shape.num_layers * shape.num_kv_heads, 1, nullptr}, plan,
                                   nullptr, seqs, params, shape, SelectTarget::kPerLayerPerHead, stream);
    case PruningMode::kUnion: {
      if (flags == nullptr || scores == nullptr) return cudaErrorInvalidValue;
      TRIATTN_CUDA_RETURN_IF_ERROR(detail::launch_select(
          SelectInput{scores, shape.num_layers * shape.num_q_heads, 1, nullptr}, plan, flags, seqs, params, shape,
          SelectTarget::kFlags, stream));
      return detail::launch_select(SelectInput{reduced, 1, shape.num_layers, flags}, plan, nullptr, seqs, params,
                                   shape, SelectTarget::kAll, stream);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace triattn::cuda

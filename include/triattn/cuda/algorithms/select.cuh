// SPDX-License-Identifier: Apache-2.0
// Host launchers of the top-k selection of a round: from reduced scores to the device keep plan
// (kept slots ascending per (sequence, layer, KV head), protected prompt/sinks/window included).
// Asynchronous, no allocation, no host synchronisation; capturable in a CUDA graph.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/algorithms/normalize.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/kernels/select_kernel.cuh>
#include <triattn/cuda/kernels/union_agreement_kernel.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

namespace detail {
template <class Id, class Policy>
[[nodiscard]] inline cudaError_t launch_select(const SelectInput& in, const DeviceKeepPlanView& plan,
                                               std::uint8_t* flags, const RoundSeqs<Id>& seqs,
                                               const SelectionParams& params, const RoundShape& shape,
                                               SelectTarget target, cudaStream_t stream) noexcept {
  if (in.rows <= 0 || in.planes <= 0 || seqs.batch > 65535) return cudaErrorInvalidValue;
  // Plan rows each ranked row feeds: per_head L, union L·Hkv. Split those writes over up to one
  // CTA per SM in total. Each split re-ranks the row, and a CTA's time is its instruction stream,
  // so two CTAs per SM sharing the schedulers take longer.
  const int targets = target == SelectTarget::kPerHead ? shape.num_layers
                      : target == SelectTarget::kAll   ? shape.num_layers * shape.num_kv_heads
                                                       : 1;
  int sms = 0;
  TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
  const long long ctas = static_cast<long long>(in.rows) * (seqs.batch > 0 ? seqs.batch : 1);
  long long splits = sms / ctas;
  splits = splits < 1 ? 1 : (splits > targets ? targets : splits);
  const long long gx = static_cast<long long>(in.rows) * splits;
  if (gx > 0x7fffffffLL) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(seqs.batch));
  const int sp = static_cast<int>(splits);
  if (seqs.max_len <= Policy::kCacheMax) {
    const std::size_t smem = static_cast<std::size_t>(seqs.max_len) * sizeof(std::uint32_t);
    TRIATTN_CUDA_RETURN_IF_ERROR(launch_dependent(select_kernel<Id, true, Policy>, grid, dim3(Policy::kThreads), smem,
                                                  stream, in, plan, flags, seqs, params, shape.num_layers,
                                                  shape.num_kv_heads, target, sp));
  } else {
    TRIATTN_CUDA_RETURN_IF_ERROR(launch_dependent(select_kernel<Id, false, Policy>, grid, dim3(Policy::kThreads), 0,
                                                  stream, in, plan, flags, seqs, params, shape.num_layers,
                                                  shape.num_kv_heads, target, sp));
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
template <class Id, class Policy = tuning::Selected::Select>
[[nodiscard]] cudaError_t select_keep(const float* scores, const float* reduced, std::uint8_t* flags,
                                      const DeviceKeepPlanView& plan, const RoundSeqs<Id>& seqs,
                                      const SelectionParams& params, const RoundShape& shape,
                                      cudaStream_t stream = nullptr) noexcept {
  if (!shape.valid() || seqs.batch < 0 || seqs.max_len < 0 || plan.max_keep < 0) return cudaErrorInvalidValue;
  if (plan.kept == nullptr || plan.keep == nullptr) return cudaErrorInvalidValue;
  if (seqs.batch == 0) return cudaSuccess;
  switch (params.mode) {
    case PruningMode::kPerHead:
      return detail::launch_select<Id, Policy>(SelectInput{reduced, shape.num_kv_heads, 1, nullptr}, plan, nullptr,
                                               seqs, params, shape, SelectTarget::kPerHead, stream);
    case PruningMode::kPerLayerPerHead:
      return detail::launch_select<Id, Policy>(SelectInput{reduced, shape.num_layers * shape.num_kv_heads, 1, nullptr},
                                               plan, nullptr, seqs, params, shape, SelectTarget::kPerLayerPerHead,
                                               stream);
    case PruningMode::kUnion: {
      if (flags == nullptr || scores == nullptr) return cudaErrorInvalidValue;
      TRIATTN_CUDA_RETURN_IF_ERROR((detail::launch_select<Id, Policy>(
          SelectInput{scores, shape.num_layers * shape.num_q_heads, 1, nullptr}, plan, flags, seqs, params, shape,
          SelectTarget::kFlags, stream)));
      return detail::launch_select<Id, Policy>(SelectInput{reduced, 1, shape.num_layers, flags}, plan, nullptr, seqs,
                                               params, shape, SelectTarget::kAll, stream);
    }
  }
  return cudaErrorInvalidValue;
}

// ---- union selection in two phases (tensor parallelism) ----------------------------------------
//
// select_keep's union mode ranks two things: per (layer, query head) row the top-quota (flags),
// then the flagged slots by max over every row of Ŝ. Under tensor parallelism each rank holds only
// its query heads' rows, so the round splits between the two:
//   select_union_candidates  this rank's flags [batch, max_len] (kFlags select over its rows) and
//                            vmax [batch, max_len] = max over its layers of `reduced`, where
//                            gqa_reduce left reduced[b, l, t] = max over its query heads of Ŝ
//   agreement                element-wise max of flags and of vmax over the ranks (NCCL)
//   select_union_finish      the kAll select over vmax among the flagged slots, every (l, g) row
// Ŝ is z-normalised per (layer, query head) row (row_stats), so every value is rank-local; max is
// exact and order-free, so max over ranks of (max over a rank's layers and heads) is bitwise the
// max over all layers and heads, and the flags' max is their union: every rank finishes on the
// tp = 1 values and writes the tp = 1 keep set. With one rank (and an identity agreement) the
// result is bitwise that of select_keep.

/// A union agreement: called on `stream` between the two union phases with this rank's
/// flags [batch, max_len] (uint8, 0/1) and vmax [batch, max_len] (float); it must enqueue on
/// `stream` whatever leaves in both the element-wise max over all ranks, and return the first
/// error. It runs inside noexcept launchers, so it must not throw.
template <class A>
concept UnionAgreement =
    std::is_nothrow_invocable_r_v<cudaError_t, A&, std::uint8_t*, float*, int, int, cudaStream_t>;

/// tp = 1: nothing to agree on.
struct IdentityAgreement {
  cudaError_t operator()(std::uint8_t*, float*, int, int, cudaStream_t) const noexcept { return cudaSuccess; }
};
static_assert(UnionAgreement<IdentityAgreement>);

/// Union phase 1 on this rank: candidate flags and the per-slot max over this rank's rows.
/// @param scores  [batch, L, Hq, max_len] Ŝ as left by gqa_reduce() (this rank's query heads)
/// @param reduced [batch, L, max_len] union output of gqa_reduce()
/// @param flags   [batch, max_len] as cleared by gqa_reduce(); output (0 off the selectable range)
/// @param vmax    [batch, max_len] output (0 off the selectable range)
/// @note asynchronous on `stream`; capturable.
template <class Id, class Policy = tuning::Selected::Select>
[[nodiscard]] cudaError_t select_union_candidates(const float* scores, const float* reduced, std::uint8_t* flags,
                                                  float* vmax, const RoundSeqs<Id>& seqs,
                                                  const SelectionParams& params, const RoundShape& shape,
                                                  cudaStream_t stream = nullptr) noexcept {
  if (!shape.valid() || seqs.batch < 0 || seqs.max_len < 0 || seqs.batch > 65535 ||
      params.mode != PruningMode::kUnion)
    return cudaErrorInvalidValue;
  if (seqs.batch == 0 || seqs.max_len == 0) return cudaSuccess;
  if (scores == nullptr || reduced == nullptr || flags == nullptr || vmax == nullptr) return cudaErrorInvalidValue;
  // kFlags writes no plan row: an empty plan view (max_keep 0) is never dereferenced.
  TRIATTN_CUDA_RETURN_IF_ERROR((detail::launch_select<Id, Policy>(
      SelectInput{scores, shape.num_layers * shape.num_q_heads, 1, nullptr}, DeviceKeepPlanView{nullptr, nullptr, 0},
      flags, seqs, params, shape, SelectTarget::kFlags, stream)));
  const dim3 grid(static_cast<unsigned>((seqs.max_len + Policy::kUnionThreads - 1) / Policy::kUnionThreads),
                  static_cast<unsigned>(seqs.batch));
  union_layer_max_kernel<Id, Policy><<<grid, Policy::kUnionThreads, 0, stream>>>(reduced, flags, vmax, seqs, params,
                                                                          shape.num_layers);
  return check_launch(stream);
}

/// Union phase 2: the keep plan from the agreed flags and vmax (identical on every rank).
/// @param flags [batch, max_len] candidate flags over all ranks
/// @param vmax  [batch, max_len] max over all ranks' rows of Ŝ
/// @param plan  kept [batch, L, Hkv, plan.max_keep], keep [batch] (device outputs), as select_keep
/// @note asynchronous on `stream`; capturable.
template <class Id, class Policy = tuning::Selected::Select>
[[nodiscard]] cudaError_t select_union_finish(const std::uint8_t* flags, const float* vmax,
                                              const DeviceKeepPlanView& plan, const RoundSeqs<Id>& seqs,
                                              const SelectionParams& params, const RoundShape& shape,
                                              cudaStream_t stream = nullptr) noexcept {
  if (!shape.valid() || seqs.batch < 0 || seqs.max_len < 0 || plan.max_keep < 0 ||
      params.mode != PruningMode::kUnion)
    return cudaErrorInvalidValue;
  if (plan.kept == nullptr || plan.keep == nullptr) return cudaErrorInvalidValue;
  if (seqs.batch == 0) return cudaSuccess;
  if (flags == nullptr || vmax == nullptr) return cudaErrorInvalidValue;
  return detail::launch_select<Id, Policy>(SelectInput{vmax, 1, 1, flags}, plan, nullptr, seqs, params, shape,
                               SelectTarget::kAll, stream);
}

}  // namespace triattn::cuda

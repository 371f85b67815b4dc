// SPDX-License-Identifier: Apache-2.0
// Selection on one tensor-parallel rank (CPU). Each rank holds the scores of its own query heads
// ([L, Hq/tp, T]) and plans for its own KV heads.
//   per_head, per_layer_per_head: a KV head's keep set depends only on the query heads of its GQA
//     group, which live on the same rank (TpGeometry), and z-normalisation is per (layer, query
//     head) row: rank-local, no communication.
//   union: one keep set for every head of every rank. Each rank computes its candidate flags and
//     per-slot max Ŝ over its rows (selection::union_candidates); one all-reduce (max) of each makes
//     them the values over all rows, bit for bit, and every rank then finishes the same way
//     (selection::union_finish), so all ranks write identical rows, equal to the tp = 1 plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/selection.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/cache_config.hpp>
#include <triattn/core/tp/collective.hpp>
#include <triattn/core/tp/rank_geometry.hpp>

namespace triattn::tp {

namespace detail {
// The caller-side checks of select_keep: geometry (when given) and the scores' size.
template <HostCollective Collective>
void check_rank_inputs(const Collective& comm, std::span<const float> scores, const ModelGeometry& local, int T,
                       const TpGeometry* geometry) {
  if (geometry != nullptr) {
    TRIATTN_EXPECTS(comm.rank() == geometry->rank() && comm.size() == geometry->tp(),
                    "tp::select_keep: the collective is rank " + std::to_string(comm.rank()) + " of " +
                        std::to_string(comm.size()) + " but the geometry is rank " + std::to_string(geometry->rank()) +
                        " of " + std::to_string(geometry->tp()));
    geometry->check_local(local, "tp::select_keep");
  }
  TRIATTN_EXPECTS(T >= 0 && scores.size() == static_cast<std::size_t>(local.num_layers) * local.num_q_heads * T,
                  "tp::select_keep: scores hold " + std::to_string(scores.size()) +
                      " values, expected layers * local q heads * length = " +
                      std::to_string(static_cast<long long>(local.num_layers) * local.num_q_heads * T));
}
}  // namespace detail

/// selection::select_keep on one rank of a tensor-parallel group. Every rank calls it for the same
/// round, with the same T, prompt_len and params (union mode reduces buffers sized from them).
/// In union mode a rank whose own checks fail (a bad shape, a non-finite score) still takes part
/// in the collective and flags its failure; then every rank throws, so no rank is left waiting.
/// Identity rounds (quota >= selectable) and the other modes use no collective.
///
/// @param comm     this rank's collective (all ranks of the group)
/// @param scores   [L, Hq_local, T] raw scores of this rank's query heads
/// @param local    this rank's geometry (L, Hq_local, Hkv_local, d)
/// @param geometry when given, `local` and the collective's rank/size are checked against it
/// @param protected_prefix leading slots kept in place (a shared prefix, equal on every rank)
/// @return plan [L, Hkv_local, keep] for this rank's KV heads
/// @throws logic_error on bad shapes/params or a non-finite score (on any rank, in union mode).
template <HostCollective Collective>
[[nodiscard]] KeepPlan select_keep(Collective& comm, std::span<const float> scores, const ModelGeometry& local, int T,
                                   int prompt_len, const ValidSelectionParams& params,
                                   const TpGeometry* geometry = nullptr, int protected_prefix = 0) {
  const int L = local.num_layers, Hq = local.num_q_heads, Hkv = local.num_kv_heads;
  // Depends on (T, prompt_len, params) only, equal on every rank: all ranks agree on whether a
  // collective happens and on its length.
  const KeepCounts kc = selection::keep_counts(T, prompt_len, params, protected_prefix);
  if (params.mode != PruningMode::kUnion || kc.identity) {
    detail::check_rank_inputs(comm, scores, local, T, geometry);
    return selection::select_keep(scores.data(), L, Hq, Hkv, T, prompt_len, params, protected_prefix);
  }

  const std::size_t n = static_cast<std::size_t>(kc.num_selectable());
  std::vector<std::uint8_t> flags(n + 1, 0);  // [n] candidates, then this rank's failure flag
  std::vector<float> vmax(n, 0.0f);           // [n] max over this rank's rows of Ŝ
  std::exception_ptr failure;
  try {
    detail::check_rank_inputs(comm, scores, local, T, geometry);
    (void)selection::detail::prepare_selection(scores.data(), L, Hq, Hkv, T, prompt_len, params, protected_prefix);
    const std::size_t rows = static_cast<std::size_t>(L) * Hq;
    const std::vector<float> s = selection::detail::selection_values(scores.data(), rows, kc, params);  // Ŝ [L, Hq, T]
    selection::union_candidates(s.data(), rows, kc, flags.data(), vmax.data());
  } catch (...) {  // rethrown below, after this rank has met the others
    failure = std::current_exception();
    flags[n] = 1;
  }
  comm.all_reduce_max(std::span<std::uint8_t>(flags));
  comm.all_reduce_max(std::span<float>(vmax));
  if (failure) std::rethrow_exception(failure);
  if (flags[n] != 0)
    throw logic_error("triattn: tp::select_keep (rank " + std::to_string(comm.rank()) + " of " +
                      std::to_string(comm.size()) + "): another rank's union selection failed; see its error");

  KeepPlan plan(L, Hkv, kc.keep);
  selection::detail::write_all_rows(plan, kc, selection::union_finish(flags.data(), vmax.data(), kc));
  return plan;
}

}  // namespace triattn::tp

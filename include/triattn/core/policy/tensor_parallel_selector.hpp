// SPDX-License-Identifier: Apache-2.0
// Selector policy for one tensor-parallel rank: TopKSelector's trigger and selection, with union
// mode agreed across ranks through a host collective (tp::select_keep). The rank's KvCache holds
// its KV heads (TpGeometry::local_config) and its scorer the statistics of its query heads
// (slice_for_rank), so KvCache::compress uses this selector unchanged. Every rank must compress
// the same sequences in the same order (union rounds meet in the collective).
#pragma once

#include <optional>
#include <span>
#include <string>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/tp/collective.hpp>
#include <triattn/core/tp/rank_geometry.hpp>
#include <triattn/core/tp/select.hpp>
#include <triattn/core/trigger.hpp>

namespace triattn {

template <tp::HostCollective Collective>
class TensorParallelTopKSelector {
 public:
  using policy_role = selector_role;

  /// @param collective this rank's collective; not owned, must outlive the selector
  TensorParallelTopKSelector(const SelectionParams& params, Collective& collective)
      : params_(params), comm_(&collective) {}
  /// Also checks, on every select(), that the cache's geometry is `geometry`'s local share and
  /// that the collective's rank and size match it.
  /// @throws logic_error when the collective's rank/size differ from the geometry's.
  TensorParallelTopKSelector(const SelectionParams& params, Collective& collective, const tp::TpGeometry& geometry)
      : TensorParallelTopKSelector(params, collective) {
    TRIATTN_EXPECTS(collective.rank() == geometry.rank() && collective.size() == geometry.tp(),
                    "TensorParallelTopKSelector: the collective is rank " + std::to_string(collective.rank()) + " of " +
                        std::to_string(collective.size()) + " but the geometry is rank " +
                        std::to_string(geometry.rank()) + " of " + std::to_string(geometry.tp()));
    geometry_ = geometry;
  }

  [[nodiscard]] const ValidSelectionParams& params() const noexcept { return params_; }
  [[nodiscard]] Collective& collective() const noexcept { return *comm_; }

  /// Same trigger as TopKSelector (a pure function of length, prompt and params: every rank
  /// decides alike).
  [[nodiscard]] bool should_compress(int length, int prompt_len, bool is_decode_step) const {
    return CompressionTrigger::should_compress(CompressionTrigger::counted_length(length, prompt_len, params_),
                                               is_decode_step, params_);
  }

  /// Keep plan of this rank's KV heads from its raw scores.
  /// @param scores [L, Hq_local, length]
  /// @param g      the rank's cache geometry (local heads)
  /// @param protected_prefix leading slots kept in place (a shared prefix; equal on every rank)
  [[nodiscard]] KeepPlan select(std::span<const float> scores, const ModelGeometry& g, int length, int prompt_len,
                                int protected_prefix = 0) const {
    return tp::select_keep(*comm_, scores, g, length, prompt_len, params_, geometry_ ? &*geometry_ : nullptr,
                           protected_prefix);
  }

 private:
  ValidSelectionParams params_{};
  Collective* comm_ = nullptr;                // not owned
  std::optional<tp::TpGeometry> geometry_;    // set: select() checks the cache's geometry
};

}  // namespace triattn

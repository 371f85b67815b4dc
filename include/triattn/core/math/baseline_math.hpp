// SPDX-License-Identifier: Apache-2.0
// Baseline-scorer math shared by the host scorers, the CUDA kernels and the CPU oracle
// (core/ref/baseline_scores.hpp): the SnapKV causal limit of a window query.
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>

namespace triattn {

/// Last physical slot a window query may attend (causal mask) at a round with `length` cached
/// slots and round start t0 (tokens processed so far), for a query of logical position
/// `position`: the t0 − 1 − position tokens that came after the query are taken to be the newest
/// slots, so the limit is (length − 1) − (t0 − 1 − position), clamped to length − 1 (a query at
/// or past t0 sees everything). −1 means the query sees no cached key; a negative position marks
/// an empty window slot and gives −1. Exact while every token after the query is still cached in
/// order (no compaction ran since the query was observed); see docs/scorers.md. The CUDA kernels
/// and the host SnapKvScorer call this same function.
[[nodiscard]] TRIATTN_HOST_DEVICE int snapkv_visible_limit(int length, std::int64_t t0, std::int64_t position) noexcept {
  if (position < 0) return -1;
  const std::int64_t lim = static_cast<std::int64_t>(length) - t0 + position;
  if (lim >= length) return length - 1;
  if (lim < -1) return -1;
  return static_cast<int>(lim);
}

}  // namespace triattn

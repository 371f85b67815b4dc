// SPDX-License-Identifier: Apache-2.0
// Tensor-parallel slicing of QueryStats. With TP degree tp each rank holds Hq / tp contiguous
// query heads (and num_kv_heads / tp KV heads); the scorer of rank r needs exactly the
// statistics of its own query heads, so a rank keeps only that share. first_q_head records the
// global index of the slice's head 0 so messages and re-slicing stay in global terms.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>

#include <triattn/core/error.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {

/// Heads [first_head, first_head + count) of `stats` (local indices), all layers. The result's
/// first_q_head is stats.first_q_head + first_head. Throws logic_error for an empty or
/// out-of-range head range or a malformed `stats`.
[[nodiscard]] inline QueryStats slice_query_heads(const QueryStats& stats, int first_head, int count) {
  if (auto p = detail::stats_shape_problem(stats)) throw logic_error("slice_query_heads: " + *p);
  if (first_head < 0 || count < 1 || first_head > stats.num_q_heads - count)
    throw logic_error("slice_query_heads: heads [" + std::to_string(first_head) + ", " +
                      std::to_string(static_cast<long long>(first_head) + count) + ") are not a non-empty range inside [0, " +
                      std::to_string(stats.num_q_heads) + ")");
  QueryStats out;
  out.model_name = stats.model_name;
  out.rope_style = stats.rope_style;
  out.num_layers = stats.num_layers;
  out.num_q_heads = count;
  out.head_dim = stats.head_dim;
  out.first_q_head = stats.first_q_head + first_head;
  const std::size_t row = static_cast<std::size_t>(count) * stats.num_freqs();  // one layer's share
  for (auto [dst, src] : {std::pair{&out.q_mean_real, &stats.q_mean_real}, std::pair{&out.q_mean_imag, &stats.q_mean_imag},
                          std::pair{&out.q_abs_mean, &stats.q_abs_mean}}) {
    dst->resize(row * stats.num_layers);
    for (int l = 0; l < stats.num_layers; ++l) {
      const float* from = src->data() + stats.offset(l, first_head);
      std::copy(from, from + row, dst->data() + row * l);
    }
  }
  return out;
}

/// Rank `rank`'s share of the full statistics under tensor parallelism of degree `tp`: query
/// heads [rank * Hq / tp, (rank + 1) * Hq / tp). Requires the full head set (first_q_head 0),
/// Hq % tp == 0, num_kv_heads % tp == 0 and Hq % num_kv_heads == 0, so that every rank's query
/// heads map onto whole KV heads (GQA groups never straddle ranks). Throws logic_error naming
/// the offending values otherwise.
[[nodiscard]] inline QueryStats slice_for_rank(const QueryStats& stats, int rank, int tp, int num_kv_heads) {
  const std::string ctx = "slice_for_rank(rank " + std::to_string(rank) + ", tp " + std::to_string(tp) +
                          ", num_kv_heads " + std::to_string(num_kv_heads) + "): ";
  if (tp < 1) throw logic_error(ctx + "tp must be >= 1");
  if (rank < 0 || rank >= tp) throw logic_error(ctx + "rank must be in [0, tp)");
  if (stats.first_q_head != 0)
    throw logic_error(ctx + "needs the full statistics, but these are already a slice starting at head " +
                      std::to_string(stats.first_q_head));
  if (num_kv_heads < 1 || stats.num_q_heads % num_kv_heads != 0)
    throw logic_error(ctx + "num_q_heads " + std::to_string(stats.num_q_heads) +
                      " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  if (stats.num_q_heads % tp != 0)
    throw logic_error(ctx + "num_q_heads " + std::to_string(stats.num_q_heads) + " is not divisible by tp " +
                      std::to_string(tp));
  if (num_kv_heads % tp != 0)
    throw logic_error(ctx + "num_kv_heads " + std::to_string(num_kv_heads) + " is not divisible by tp " +
                      std::to_string(tp) + " (a rank would hold part of a KV head's query group)");
  const int per_rank = stats.num_q_heads / tp;
  return slice_query_heads(stats, rank * per_rank, per_rank);
}

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// Which heads a tensor-parallel rank holds. Engines shard attention heads contiguously: with
// degree tp, rank r holds query heads [r·Hq/tp, (r+1)·Hq/tp) and KV heads [r·Hkv/tp, (r+1)·Hkv/tp).
// Each rank keeps its own KvCache over its KV heads (the local ModelGeometry) and scores with the
// statistics of its query heads (slice_for_rank). Requiring Hkv % tp == 0 keeps every GQA group
// on one rank, so per_head and per_layer_per_head selection need no communication; replicated KV
// heads (tp > Hkv) are not supported.
#pragma once

#include <string>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn::tp {

/// A contiguous range of head indices [first, first + count), in the full model's numbering.
struct HeadRange {
  int first = 0;
  int count = 0;
  [[nodiscard]] int end() const noexcept { return first + count; }
  [[nodiscard]] bool contains(int head) const noexcept { return head >= first && head < end(); }
};

/// Rank `rank` of a tensor-parallel group of degree `tp` over a model of geometry `full`.
class TpGeometry {
 public:
  /// @throws logic_error (naming the values) when full is invalid, tp < 1, rank is outside
  ///         [0, tp), Hq % tp != 0 or Hkv % tp != 0 (a GQA group would straddle two ranks).
  TpGeometry(int tp, int rank, const ModelGeometry& full) : tp_(tp), rank_(rank), full_(full) {
    const std::string ctx = "TpGeometry(tp " + std::to_string(tp) + ", rank " + std::to_string(rank) + "): ";
    try {
      full.validate();
    } catch (const logic_error& e) {
      throw logic_error(ctx + "invalid model geometry: " + e.what());
    }
    TRIATTN_EXPECTS(tp >= 1, ctx + "tp must be >= 1");
    TRIATTN_EXPECTS(rank >= 0 && rank < tp, ctx + "rank must be in [0, tp)");
    TRIATTN_EXPECTS(full.num_q_heads % tp == 0, ctx + "num_q_heads " + std::to_string(full.num_q_heads) +
                                                    " is not divisible by tp");
    TRIATTN_EXPECTS(full.num_kv_heads % tp == 0,
                    ctx + "num_kv_heads " + std::to_string(full.num_kv_heads) +
                        " is not divisible by tp (a rank would hold part of a KV head's query group; replicated KV "
                        "heads are not supported)");
  }

  [[nodiscard]] int tp() const noexcept { return tp_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] const ModelGeometry& full() const noexcept { return full_; }

  /// This rank's query heads (global indices).
  [[nodiscard]] HeadRange q_heads() const noexcept {
    const int n = full_.num_q_heads / tp_;
    return {rank_ * n, n};
  }
  /// This rank's KV heads (global indices); query head h of the rank reads KV head h / group.
  [[nodiscard]] HeadRange kv_heads() const noexcept {
    const int n = full_.num_kv_heads / tp_;
    return {rank_ * n, n};
  }
  /// The geometry of this rank's cache and scores: all layers, its heads, the same head_dim.
  [[nodiscard]] ModelGeometry local() const noexcept {
    return {full_.num_layers, full_.num_q_heads / tp_, full_.num_kv_heads / tp_, full_.head_dim};
  }
  /// `cfg` (a full-model cache configuration) with the model replaced by local(): the rank's cache.
  /// @throws logic_error when cfg.model differs from full().
  [[nodiscard]] CacheConfig local_config(CacheConfig cfg) const {
    TRIATTN_EXPECTS(cfg.model.num_layers == full_.num_layers && cfg.model.num_q_heads == full_.num_q_heads &&
                        cfg.model.num_kv_heads == full_.num_kv_heads && cfg.model.head_dim == full_.head_dim,
                    "TpGeometry::local_config: the configuration's model [" + describe(cfg.model) +
                        "] is not the full model [" + describe(full_) + "]");
    cfg.model = local();
    return cfg;
  }

  /// Throws logic_error unless `g` is this rank's local geometry (e.g. a cache built for another
  /// rank or for the full model).
  void check_local(const ModelGeometry& g, const std::string& context) const {
    const ModelGeometry want = local();
    TRIATTN_EXPECTS(g.num_layers == want.num_layers && g.num_q_heads == want.num_q_heads &&
                        g.num_kv_heads == want.num_kv_heads && g.head_dim == want.head_dim,
                    context + ": geometry [" + describe(g) + "] is not rank " + std::to_string(rank_) + " of tp " +
                        std::to_string(tp_) + "'s share [" + describe(want) + "] of [" + describe(full_) + "]");
  }

  /// "layers L, q heads Hq, kv heads Hkv, head_dim d".
  [[nodiscard]] static std::string describe(const ModelGeometry& g) {
    return "layers " + std::to_string(g.num_layers) + ", q heads " + std::to_string(g.num_q_heads) + ", kv heads " +
           std::to_string(g.num_kv_heads) + ", head_dim " + std::to_string(g.head_dim);
  }

 private:
  int tp_;
  int rank_;
  ModelGeometry full_;
};

/// Checks that `stats` are exactly this rank's slice (slice_for_rank): first_q_head and
/// num_q_heads equal the rank's query heads, layers and head_dim the model's, arrays well formed.
/// @throws logic_error naming the first mismatch.
inline void check_stats_for_rank(const QueryStats& stats, const TpGeometry& geo) {
  const std::string ctx = "check_stats_for_rank(rank " + std::to_string(geo.rank()) + ", tp " +
                          std::to_string(geo.tp()) + "): ";
  if (auto p = triattn::detail::stats_shape_problem(stats)) throw logic_error(ctx + "malformed statistics: " + *p);
  const HeadRange q = geo.q_heads();
  TRIATTN_EXPECTS(stats.first_q_head == q.first && stats.num_q_heads == q.count,
                  ctx + "statistics hold query heads [" + std::to_string(stats.first_q_head) + ", " +
                      std::to_string(stats.first_q_head + stats.num_q_heads) + ") but the rank holds [" +
                      std::to_string(q.first) + ", " + std::to_string(q.end()) + ") (use slice_for_rank)");
  TRIATTN_EXPECTS(stats.num_layers == geo.full().num_layers,
                  ctx + "statistics have " + std::to_string(stats.num_layers) + " layers, the model " +
                      std::to_string(geo.full().num_layers));
  TRIATTN_EXPECTS(stats.head_dim == geo.full().head_dim,
                  ctx + "statistics have head_dim " + std::to_string(stats.head_dim) + ", the model " +
                      std::to_string(geo.full().head_dim));
}

}  // namespace triattn::tp

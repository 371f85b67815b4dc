// SPDX-License-Identifier: Apache-2.0
// Scorer policy "random": a seeded, deterministic random baseline. It reads no cache memory, so
// it serves host and device caches alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/baseline_scores.hpp>

namespace triattn {

/// Random eviction as a scorer: score[l, h, j] = ref::random_score(seed, t0, l, h / G, j), a
/// uniform value in [0, 1) hashed from (seed, round start t0, layer, KV head, slot) and
/// replicated to the group's G query heads.
///
/// The hash takes the physical slot, not the token: compaction moves tokens between slots, so
/// a token draws a fresh value every round (t0 differs between rounds as well). That is what a
/// random baseline should do, and it needs no per-token state. The result is deterministic: the
/// same seed, round, layer, head and slot always give the same score, so two runs with the same
/// seed keep the same tokens; different seeds give independent keep sets.
class RandomScorer {
 public:
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  static constexpr bool reads_cache = false;  ///< never dereferences the view's memory

  RandomScorer() = default;
  explicit RandomScorer(std::uint64_t seed) : seed_(seed) {}
  /// Remembers the query-head count so score() can check the output shape; seed 0.
  explicit RandomScorer(const CacheConfig& cfg, std::uint64_t seed = 0)
      : seed_(seed), num_q_heads_(cfg.model.num_q_heads) {}

  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }

  /// @param out [num_layers, num_q_heads, length]
  /// @throws logic_error when out's size is not L * Hq * length (Hq a multiple of the KV heads).
  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) const {
    (void)seq;
    const int hq = detail::scorer_num_q_heads(out.size(), view.num_layers, view.block.num_kv_heads, length,
                                              num_q_heads_, "RandomScorer");
    if (length == 0) return;
    const int G = hq / view.block.num_kv_heads;
    const std::size_t n_tok = static_cast<std::size_t>(length);
    for (int l = 0; l < view.num_layers; ++l)
      for (int h = 0; h < hq; ++h)
        baseline::random_scores(seed_, t0, l, h / G, length,
                                out.data() + (static_cast<std::size_t>(l) * hq + h) * n_tok);
  }

 private:
  std::uint64_t seed_ = 0;
  int num_q_heads_ = 0;  // 0: inferred from the output size
};

}  // namespace triattn

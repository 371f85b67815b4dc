// SPDX-License-Identifier: Apache-2.0
// The dimensions a KV cache shares with the model (or statistics) it serves, and the one check
// that they agree: every scorer, round and binding that reads a cache for a model calls
// check_cache_geometry, so the rule and its message live here only.
#pragma once

#include <string>
#include <string_view>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>

namespace triattn {

/// Layers, KV heads and head_dim: what a cache's layout fixes about the model.
struct CacheGeometry {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;

  friend bool operator==(const CacheGeometry&, const CacheGeometry&) = default;
};

[[nodiscard]] inline CacheGeometry cache_geometry(const ModelGeometry& g) noexcept {
  return {g.num_layers, g.num_kv_heads, g.head_dim};
}

template <class T, class Id>
[[nodiscard]] CacheGeometry cache_geometry(const KvCacheView<T, Id>& view) noexcept {
  return {view.num_layers, view.block.num_kv_heads, view.block.head_dim};
}

/// "[layers L, kv heads H, head_dim d]".
[[nodiscard]] inline std::string describe(const CacheGeometry& g) {
  return "[layers " + std::to_string(g.num_layers) + ", kv heads " + std::to_string(g.num_kv_heads) + ", head_dim " +
         std::to_string(g.head_dim) + "]";
}

/// @throws triattn::logic_error "<context>: cache geometry [..] does not match <expected_name> [..]"
///         unless the cache's geometry equals the expected one.
inline void check_cache_geometry(const CacheGeometry& cache, const CacheGeometry& expected, std::string_view context,
                                 std::string_view expected_name) {
  if (cache == expected) return;
  TRIATTN_FAIL(std::string(context) + ": cache geometry " + describe(cache) + " does not match " +
               std::string(expected_name) + " " + describe(expected));
}

}  // namespace triattn

// SPDX-License-Identifier: Apache-2.0
// KeepPlan: which physical slots of one sequence survive a compression round, per layer and KV
// head. It is what a selector produces and what a compactor consumes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>

namespace triattn {

/// First slot a compaction of one row moves: the smallest i with row[i] != i, or keep when the
/// row is 0..keep-1. Kept slots ascend, so row[i] >= i and row[i] == i holds on a prefix of the
/// row: a binary search over its `keep` entries (host and device).
TRIATTN_HOST_DEVICE int first_moved_slot(const std::int32_t* row, int keep) noexcept {
  int lo = 0, hi = keep;  // row[i] == i for i < lo; row[i] != i for i >= hi
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (row[mid] == mid) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// Kept slot indices, per (layer, KV head), strictly increasing, all lists of the same length
/// `keep` (the sequence has one physical length). Slot i of the result holds old slot
/// indices[layer, head, i].
struct KeepPlan {
  int num_layers = 0;
  int num_kv_heads = 0;
  int keep = 0;
  std::vector<std::int32_t> indices;  // [num_layers, num_kv_heads, keep], ascending per row

  KeepPlan() = default;
  /// @throws logic_error when a count is negative (instead of a wrapped, huge allocation).
  KeepPlan(int layers, int kv_heads, int keep_count)
      : num_layers(layers), num_kv_heads(kv_heads), keep(keep_count),
        indices(checked_size(layers, kv_heads, keep_count)) {}

  [[nodiscard]] std::int32_t* row(int layer, int head) noexcept {
    return indices.data() + (static_cast<std::size_t>(layer) * num_kv_heads + head) * keep;
  }
  [[nodiscard]] const std::int32_t* row(int layer, int head) const noexcept {
    return indices.data() + (static_cast<std::size_t>(layer) * num_kv_heads + head) * keep;
  }

  /// Throws triattn::logic_error naming the first problem: wrong shape, an index out of
  /// [0, length), or a row that is not strictly increasing (unsorted or duplicated).
  void validate(int expected_layers, int expected_kv_heads, int length) const {
    TRIATTN_EXPECTS(num_layers == expected_layers && num_kv_heads == expected_kv_heads,
                    "keep plan shape [" + std::to_string(num_layers) + ", " + std::to_string(num_kv_heads) +
                        ", keep] does not match the cache's [" + std::to_string(expected_layers) + ", " +
                        std::to_string(expected_kv_heads) + ", keep]");
    TRIATTN_EXPECTS(keep >= 0 && keep <= length,
                    "keep plan keeps " + std::to_string(keep) + " tokens of a sequence of " + std::to_string(length));
    TRIATTN_EXPECTS(indices.size() == static_cast<std::size_t>(num_layers) * num_kv_heads * keep,
                    "keep plan holds " + std::to_string(indices.size()) + " indices, expected layers*kv_heads*keep = " +
                        std::to_string(static_cast<std::size_t>(num_layers) * num_kv_heads * keep));
    for (int l = 0; l < num_layers; ++l) {
      for (int h = 0; h < num_kv_heads; ++h) {
        const std::int32_t* r = row(l, h);
        for (int i = 0; i < keep; ++i) {
          const bool in_range = r[i] >= 0 && r[i] < length;
          const bool ascending = i == 0 || r[i] > r[i - 1];
          if (in_range && ascending) continue;  // messages are built only on failure
          const std::string where = "keep plan (layer " + std::to_string(l) + ", kv head " + std::to_string(h) +
                                    ", entry " + std::to_string(i) + "): slot " + std::to_string(r[i]);
          if (!in_range) TRIATTN_FAIL(where + " is out of range [0, " + std::to_string(length) + ")");
          TRIATTN_FAIL(where + (r[i] == r[i - 1] ? " is duplicated" : " is not in ascending order"));
        }
      }
    }
  }

  static std::size_t checked_size(int layers, int kv_heads, int keep_count) {
    TRIATTN_EXPECTS(layers >= 0 && kv_heads >= 0 && keep_count >= 0,
                    "KeepPlan(layers = " + std::to_string(layers) + ", kv_heads = " + std::to_string(kv_heads) +
                        ", keep = " + std::to_string(keep_count) + "): counts must be non-negative");
    return static_cast<std::size_t>(layers) * static_cast<std::size_t>(kv_heads) * static_cast<std::size_t>(keep_count);
  }

  /// First slot applying the plan moves in any row (keep when it moves nothing); rows must be
  /// valid (ascending).
  [[nodiscard]] int first_moved() const noexcept {
    int first = keep;
    for (int l = 0; l < num_layers; ++l)
      for (int h = 0; h < num_kv_heads; ++h) {
        const int f = first_moved_slot(row(l, h), keep);
        first = f < first ? f : first;
      }
    return first;
  }
  /// True when every row is 0..keep-1, i.e. applying the plan moves nothing.
  [[nodiscard]] bool is_prefix() const noexcept {
    for (int l = 0; l < num_layers; ++l)
      for (int h = 0; h < num_kv_heads; ++h)
        for (int i = 0; i < keep; ++i)
          if (row(l, h)[i] != i) return false;
    return true;
  }
};

/// Checks a compactor's block copy (KvCache::relocate_blocks): the runs [src, src + count) and
/// [dst, dst + count) lie in a pool of `num_blocks` and do not overlap. @throws logic_error naming
/// `who` and the runs.
inline void check_block_runs(std::int64_t src, std::int64_t dst, std::int64_t count, std::int64_t num_blocks,
                             const char* who) {
  TRIATTN_EXPECTS(count > 0 && src >= 0 && dst >= 0 && src + count <= num_blocks && dst + count <= num_blocks &&
                      (src + count <= dst || dst + count <= src),
                  std::string(who) + ": runs [" + std::to_string(src) + ", +" + std::to_string(count) + ") -> [" +
                      std::to_string(dst) + ", +" + std::to_string(count) + ") overlap or leave the pool of " +
                      std::to_string(num_blocks) + " blocks");
}

}  // namespace triattn

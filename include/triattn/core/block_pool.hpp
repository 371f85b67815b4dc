// SPDX-License-Identifier: Apache-2.0
// Host bookkeeping of block ids: a free list and reference counts (a block can be shared by
// sequences). O(1) allocate and release; no device pointers, so CI tests all of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>

namespace triattn {

class BlockPool {
 public:
  using block_id = std::int32_t;

  BlockPool() = default;
  explicit BlockPool(int num_blocks) : ref_count_(checked_size(num_blocks), 0) {
    free_.reserve(static_cast<std::size_t>(num_blocks));
    // Stack popped from the back: a fresh pool hands out the lowest ids first, which keeps live
    // data packed; released ids are reused most recently freed first (O(1), no search).
    for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  }

  /// All-or-nothing: fills `out` with fresh blocks (ref count 1) or, when fewer than out.size()
  /// are free, changes nothing and returns false.
  [[nodiscard]] bool allocate(std::span<block_id> out) {
    if (out.size() > free_.size()) return false;
    for (auto& b : out) {
      b = free_.back();
      free_.pop_back();
      ref_count_[static_cast<std::size_t>(b)] = 1;
    }
    return true;
  }

  /// Adds a reference to a live block (sharing). Throws on a free or foreign id.
  void retain(block_id b) {
    check_live(b, "retain");
    ++ref_count_[static_cast<std::size_t>(b)];
  }

  /// Drops one reference; returns true when the block became free. Throws logic_error on a
  /// double free or a foreign id (and changes nothing).
  bool release(block_id b) {
    check_live(b, "release");
    if (--ref_count_[static_cast<std::size_t>(b)] > 0) return false;
    free_.push_back(b);
    return true;
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return ref_count_.size(); }
  [[nodiscard]] std::size_t num_free() const noexcept { return free_.size(); }
  [[nodiscard]] std::size_t num_used() const noexcept { return capacity() - num_free(); }
  [[nodiscard]] int ref_count(block_id b) const noexcept {
    return (b >= 0 && static_cast<std::size_t>(b) < ref_count_.size()) ? ref_count_[static_cast<std::size_t>(b)] : 0;
  }

 private:
  // Validates before the vectors are sized: a negative count must not reach std::vector (which
  // would throw length_error / bad_alloc instead of the documented logic_error).
  static std::size_t checked_size(int num_blocks) {
    TRIATTN_EXPECTS(num_blocks > 0, "BlockPool: num_blocks = " + std::to_string(num_blocks) + " must be positive");
    return static_cast<std::size_t>(num_blocks);
  }
  void check_live(block_id b, const char* op) const {
    TRIATTN_EXPECTS(b >= 0 && static_cast<std::size_t>(b) < ref_count_.size(),
                    std::string("BlockPool::") + op + ": block " + std::to_string(b) + " does not belong to this pool of " +
                        std::to_string(ref_count_.size()) + " blocks");
    TRIATTN_EXPECTS(ref_count_[static_cast<std::size_t>(b)] > 0,
                    std::string("BlockPool::") + op + ": block " + std::to_string(b) + " is already free (double free?)");
  }

  std::vector<block_id> free_;      // [num_free] stack of free ids
  std::vector<int> ref_count_;      // [num_blocks] 0 = free
};

}  // namespace triattn

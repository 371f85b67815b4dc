// SPDX-License-Identifier: Apache-2.0
// Compactor policy of the CPU path: applies a KeepPlan to host memory through host::compact.
#pragma once

#include <triattn/core/concepts.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/host_kv_ops.hpp>

namespace triattn {

struct HostCompactor {
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  template <class T, class Id>
  void apply(const KvCacheView<T, Id>& view, int seq, const KeepPlan& plan) const {
    host::compact(view, seq, plan);
  }

  /// Copies block `src` to `dst` in every range (KvCache's copy-on-write of a shared block).
  template <class T, class Id>
  void copy_block(const KvCacheView<T, Id>& view, Id src, Id dst) const {
    host::copy_block(view, src, dst);
  }

  /// Copies `count` adjacent blocks from `src` to those from `dst` (KvCache::relocate_blocks).
  /// @throws logic_error when the runs overlap or leave the pool.
  template <class T, class Id>
  void copy_blocks(const KvCacheView<T, Id>& view, Id src, Id dst, Id count) const {
    check_block_runs(src, dst, count, view.num_blocks, "HostCompactor::copy_blocks");
    host::copy_blocks(view, src, dst, count);
  }
};

}  // namespace triattn

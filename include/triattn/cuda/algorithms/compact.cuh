// SPDX-License-Identifier: Apache-2.0
// Launcher of the in-place compaction kernel: one launch compacts every (layer, K|V, KV head)
// of a batch of sequences following a device plan (cuda::CompactParams). No throw, no
// allocation, no synchronisation.
#pragma once

#include <cstdint>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/compact_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/sm90.cuh>

namespace triattn::cuda {

struct compact {
  /// Compacts `batch` sequences in place. The view's data and block tables must be device
  /// memory (its lengths are not read); plan arrays are device memory. Each plan row must be
  /// strictly ascending and within the sequence's blocks (ref: KeepPlan::validate), and no
  /// two entries may name the same sequence.
  /// @return cudaErrorInvalidValue on bad arguments, cudaErrorNotSupported for an uncompiled
  /// head_dim, else the launch status.
  template <class T, class Id>
  [[nodiscard]] static cudaError_t run(const KvCacheView<T, Id>& view, const CompactParams& plan, int batch,
                                       cudaStream_t stream) noexcept {
    if (batch < 0 || batch > 65535 || plan.max_keep < 0) return cudaErrorInvalidValue;
    if (batch == 0 || plan.max_keep == 0) return cudaSuccess;
    constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
    if (view.data == nullptr || view.block_tables == nullptr || plan.kept == nullptr || plan.keep == nullptr ||
        plan.seq_ids == nullptr || !is_aligned(view.data, 16) || view.block.head_dim % kVecElems != 0 ||
        view.range_stride % kVecElems != 0)
      return cudaErrorInvalidValue;
    const std::int64_t rows = static_cast<std::int64_t>(view.num_layers) * view.block.num_kv_heads;
    if (rows <= 0 || rows > 0x7fffffff) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(batch));
    return dispatch_head_dim_status(view.block.head_dim, [&](auto hd) {
      compact_kernel<decltype(hd)::value, T, Id><<<grid, tuning::sm90::Compact::kThreads, 0, stream>>>(view, plan);
      return check_launch(stream);
    });
  }

  /// Bytes one call moves (read + write) when `moved_tokens` (sequence, layer, head) head
  /// vectors change place, counting K and V: what benchmarks divide by time.
  template <class T>
  [[nodiscard]] static constexpr std::int64_t bytes_moved(std::int64_t moved_vectors, int head_dim) noexcept {
    return moved_vectors * 2 /*K, V*/ * 2 /*read, write*/ * head_dim * static_cast<std::int64_t>(sizeof(T));
  }
};

}  // namespace triattn::cuda

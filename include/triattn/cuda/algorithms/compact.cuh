// SPDX-License-Identifier: Apache-2.0
// Launcher of the in-place compaction kernel: one launch compacts every (layer, K|V, KV head)
// of a batch of sequences following a device plan (cuda::CompactParams). No throw, no
// allocation, no synchronisation.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/kernels/compact_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// How a compaction launch splits its work (the Compact policy). Zeros choose automatically
/// from the number of rows per SM; every choice moves the same bytes to the same places.
struct CompactOptions {
  /// Column parts per row, each walked by its own CTA: 1 or 2 (capped by compact_parts()).
  int parts = 0;
  /// 16-byte vectors each thread moves per chunk: 4 or 8.
  int vecs_per_thread = 0;
};

namespace detail {
template <int HeadDim, class T, class Id, int kVecsPerThread, class Tune>
[[nodiscard]] cudaError_t launch_compact(const KvCacheView<T, Id>& view, const CompactParams& plan, unsigned rows,
                                         int batch, int parts, cudaStream_t stream) noexcept {
  constexpr int kThreads = Tune::kThreads;
  const dim3 grid(rows, static_cast<unsigned>(batch), static_cast<unsigned>(parts));
  switch (parts) {
    // Dependent launch: each CTA waits for the previous grid (griddep_wait) before it reads the
    // plan. A round's select does not trigger early (see select_kernel), so nothing overlaps it.
    case 1:
      TRIATTN_CUDA_RETURN_IF_ERROR(launch_dependent(compact_kernel<HeadDim, T, Id, 1, kVecsPerThread, Tune>, grid,
                                                    dim3(kThreads), 0, stream, view, plan));
      break;
    case 2:
      if constexpr (compact_parts<HeadDim, T>(2, kVecsPerThread) == 2)
        TRIATTN_CUDA_RETURN_IF_ERROR(launch_dependent(compact_kernel<HeadDim, T, Id, 2, kVecsPerThread, Tune>, grid,
                                                      dim3(kThreads), 0, stream, view, plan));
      break;
    default: return cudaErrorInvalidValue;
  }
  return check_launch(stream);
}
}  // namespace detail

struct compact {
  /// Compacts `batch` sequences in place. The view's data and block tables must be device
  /// memory (its lengths are not read); plan arrays are device memory. Each plan row must be
  /// strictly ascending and within the sequence's blocks (ref: KeepPlan::validate), and no
  /// two entries may name the same sequence.
  /// @return cudaErrorInvalidValue on bad arguments, cudaErrorNotSupported for an uncompiled
  /// head_dim, else the launch status.
  /// Policy: the Compact tuning (default: tuning::Selected::Compact).
  template <class T, class Id, class Policy = tuning::Selected::Compact>
  [[nodiscard]] static cudaError_t run(const KvCacheView<T, Id>& view, const CompactParams& plan, int batch,
                                       cudaStream_t stream, CompactOptions options = {}) noexcept {
    using Tune = Policy;
    if (batch < 0 || batch > 65535 || plan.max_keep < 0) return cudaErrorInvalidValue;
    if (options.parts < 0 || options.parts > 2) return cudaErrorInvalidValue;
    if (options.vecs_per_thread != 0 && options.vecs_per_thread != 4 && options.vecs_per_thread != 8)
      return cudaErrorInvalidValue;
    if (batch == 0 || plan.max_keep == 0) return cudaSuccess;
    constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
    if (!has_kv_memory(view) || view.block_tables == nullptr || plan.kept == nullptr || plan.keep == nullptr ||
        plan.seq_ids == nullptr || !head_vectors_aligned(view, 16) || view.block.head_dim % kVecElems != 0)
      return cudaErrorInvalidValue;
    const std::int64_t rows = static_cast<std::int64_t>(view.num_layers) * view.block.num_kv_heads;
    if (rows <= 0 || rows > 0x7fffffff) return cudaErrorInvalidValue;
    int parts = options.parts, vecs = options.vecs_per_thread;
    if (parts == 0 || vecs == 0) {
      int sms = 0;
      TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
      const std::int64_t units = rows * batch;
      if (parts == 0) parts = units <= static_cast<std::int64_t>(Tune::kSplitRowsPerSm) * sms ? 2 : 1;
      if (vecs == 0) vecs = units <= static_cast<std::int64_t>(Tune::kShortRowsPerSm) * sms ? 4 : 8;
    }
    return dispatch_head_dim_status(view.block.head_dim, [&](auto hd) {
      constexpr int D = decltype(hd)::value;
      const auto go = [&](auto v) {
        constexpr int V = decltype(v)::value;
        return detail::launch_compact<D, T, Id, V, Tune>(view, plan, static_cast<unsigned>(rows), batch,
                                                   compact_parts<D, T>(parts, V), stream);
      };
      return vecs == 4 ? go(std::integral_constant<int, 4>{}) : go(std::integral_constant<int, 8>{});
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

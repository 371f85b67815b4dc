// SPDX-License-Identifier: Apache-2.0
// Launch-layer helpers shared by cuda/algorithms: the post-launch check (with an optional debug
// synchronisation), a no-throw head_dim dispatch over the compiled list, device queries, and the
// error hook that noexcept paths (destructors) report through instead of throwing.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <utility>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/error.cuh>

namespace triattn::cuda {

/// Call right after a kernel launch. Returns the launch error; when TRIATTN_DEBUG_SYNC is
/// defined it also synchronises `stream` and returns the kernel's own error (CubDebug style).
[[nodiscard]] inline cudaError_t check_launch([[maybe_unused]] cudaStream_t stream) noexcept {
  cudaError_t e = cudaGetLastError();
#if defined(TRIATTN_DEBUG_SYNC)
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
#endif
  return e;
}

/// Receives CUDA errors that happen where throwing is not allowed (destructors, frees).
using error_hook_t = void (*)(cudaError_t error, const char* what) noexcept;

namespace detail {
inline void default_error_hook(cudaError_t error, const char* what) noexcept {
  std::fprintf(stderr, "triattn: %s failed: %s (%s)\n", what, cudaGetErrorName(error), cudaGetErrorString(error));
}
inline std::atomic<error_hook_t>& error_hook_slot() noexcept {
  static std::atomic<error_hook_t> hook{&default_error_hook};
  return hook;
}
}  // namespace detail

/// Installs `hook` (nullptr restores the default, which prints to stderr); returns the old one.
inline error_hook_t set_error_hook(error_hook_t hook) noexcept {
  return detail::error_hook_slot().exchange(hook ? hook : &detail::default_error_hook);
}

/// Reports a failed call from a noexcept path and clears the sticky last error.
inline void report_error(cudaError_t error, const char* what) noexcept {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  detail::error_hook_slot().load()(error, what);
}

namespace detail {
template <class F, int... Vs>
cudaError_t dispatch_head_dim_status(int head_dim, F&& f, std::integer_sequence<int, Vs...>) noexcept {
  cudaError_t result = cudaErrorNotSupported;
  (void)((head_dim == Vs ? (result = f(std::integral_constant<int, Vs>{}), true) : false) || ...);
  return result;
}
}  // namespace detail

/// No-throw twin of dispatch_head_dim for launchers: calls f(integral_constant<int, D>) for a
/// compiled head_dim (cuda::supported_head_dims) and returns its cudaError_t, else
/// cudaErrorNotSupported. The owning API calls dispatch_head_dim first to get the message.
template <class F>
[[nodiscard]] cudaError_t dispatch_head_dim_status(int head_dim, F&& f) noexcept {
  return detail::dispatch_head_dim_status(head_dim, std::forward<F>(f), supported_head_dims{});
}

/// True when `head_dim` is one of the compiled head dims.
[[nodiscard]] inline bool is_supported_head_dim(int head_dim) noexcept {
  return dispatch_head_dim_status(head_dim, [](auto) { return cudaSuccess; }) == cudaSuccess;
}

/// Number of multiprocessors of the current device.
[[nodiscard]] inline cudaError_t current_device_sm_count(int* count) noexcept {
  int dev = 0;
  TRIATTN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, dev);
}

/// True when `p` is aligned to `bytes`.
[[nodiscard]] inline bool is_aligned(const void* p, std::size_t bytes) noexcept {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

/// True when `view` names its K/V memory (a pointer array or a base).
template <class T, class Id>
[[nodiscard]] inline bool has_kv_memory(const KvCacheView<T, Id>& view) noexcept {
  return view.ranges != nullptr || view.data != nullptr;
}

/// True when every head vector `view` addresses starts on a `bytes` boundary, as far as the host
/// can tell: the block, token and head strides (those that are used) and, for a single-base view,
/// the base and its layer / K|V strides. A pointer array `ranges` lives in the kernels' memory
/// space, which the launch does not read: its entries must be `bytes`-aligned (allocations are).
template <class T, class Id>
[[nodiscard]] inline bool head_vectors_aligned(const KvCacheView<T, Id>& view, std::size_t bytes) noexcept {
  const auto mult = [bytes](std::int64_t elems) {
    return (static_cast<std::uint64_t>(elems < 0 ? -elems : elems) * sizeof(T)) % bytes == 0;
  };
  const BlockLayout& b = view.block;
  if ((static_cast<std::size_t>(b.head_dim) * sizeof(T)) % bytes != 0) return false;
  if ((view.num_blocks > 1 && !mult(b.stride_block)) || (b.block_size > 1 && !mult(b.stride_token)) ||
      (b.num_kv_heads > 1 && !mult(b.stride_head)))
    return false;
  if (view.ranges != nullptr) return true;
  return is_aligned(view.data, bytes) && (view.num_layers <= 1 || mult(view.layer_stride)) && mult(view.kind_stride);
}

/// Elements from a range's base to the end of the last head vector it can address (non-negative
/// strides, as validate_view requires): what 32-bit chunk offsets must cover.
template <class T, class Id>
[[nodiscard]] inline std::int64_t range_extent(const KvCacheView<T, Id>& view) noexcept {
  const BlockLayout& b = view.block;
  if (view.num_blocks <= 0 || b.block_size <= 0 || b.num_kv_heads <= 0) return 0;
  return b.offset(view.num_blocks - 1, b.block_size - 1, b.num_kv_heads - 1) + b.head_dim;
}

/// Dynamic shared memory a kernel has been opted into, per device. cudaFuncSetAttribute acts on
/// the current device only, so a process driving several GPUs (tensor parallelism) opts in on
/// each; after that, launches (also inside a graph capture) make no attribute call. Keep one
/// static instance per kernel instantiation.
class DynamicSmemGrant {
 public:
  template <class Kernel>
  [[nodiscard]] cudaError_t ensure(Kernel kernel, std::size_t smem) noexcept {
    if (smem <= kDefaultLimit) return cudaSuccess;
    int dev = 0;
    TRIATTN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    std::atomic<std::size_t>* slot = dev >= 0 && dev < kMaxDevices ? &granted_[dev] : nullptr;
    if (slot != nullptr && smem <= slot->load(std::memory_order_relaxed)) return cudaSuccess;
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e == cudaSuccess && slot != nullptr) slot->store(smem, std::memory_order_relaxed);  // a race repeats the call
    return e;
  }

 private:
  static constexpr std::size_t kDefaultLimit = 48 * 1024;  // what every kernel may use unasked
  static constexpr int kMaxDevices = 64;                   // beyond: opt in on every launch
  std::atomic<std::size_t> granted_[kMaxDevices]{};
};

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Convenience layer for a KvCache that lives on the GPU: the DeviceKvCache alias, publish() of
// the host bookkeeping to the allocator's device mirror, and a throwing append_tokens() that extends a
// sequence and writes its new tokens with the append kernel.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include <triattn/core/kv_cache.hpp>
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/device_tables.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>

namespace triattn::cuda {

/// KvCache over one cudaMalloc with published device tables and the device compactor.
template <class... Extra>
using DeviceKvCache = KvCache<DeviceAllocator, DeviceCompactor, Extra...>;

/// True when Cache's allocator keeps a device mirror of the tables (WithDeviceTables).
template <class Cache>
inline constexpr bool has_device_tables_v = requires(typename Cache::allocator_type& a) {
  a.publish(std::span<const std::int32_t>{}, std::span<const std::int32_t>{}, cudaStream_t{});
  a.published_tables();
};

/// Uploads `cache`'s host block tables and lengths to its allocator's device mirror on
/// `stream`. Call after extend / apply_keep_plan / release / fork and before kernels that read
/// cache.view(); use the stream those kernels (and the compactor) run on.
template <class Cache>
  requires has_device_tables_v<Cache>
void publish(Cache& cache, cudaStream_t stream) {
  cache.allocator().publish(cache.host_block_tables(), cache.host_lengths(), stream);
}

/// extend(seq, n) + publish + append kernel for all layers: k, v are [num_layers, n,
/// num_kv_heads, head_dim] device arrays of the cache's dtype. On kOutOfBlocks nothing was
/// written and nothing changed. Asynchronous on `stream`.
/// @throws logic_error on bad arguments, cuda_error when publishing or the launch fails.
template <class T, class Cache>
  requires has_device_tables_v<Cache>
[[nodiscard]] AppendResult append_tokens(Cache& cache, SeqId seq, const T* k, const T* v, int n, cudaStream_t stream,
                                  Phase phase = Phase::kDecode) {
  TRIATTN_EXPECTS(dtype_of<T> == cache.config().dtype, std::string("cuda::append_tokens: element type is ") +
                                                           dtype_name(dtype_of<T>) + " but the cache stores " +
                                                           dtype_name(cache.config().dtype));
  dispatch_head_dim(cache.config().model.head_dim, [](auto) {});  // throws unsupported naming the list
  const AppendResult r = cache.extend(seq, n, phase);
  if (!r.ok() || n == 0) return r;
  publish(cache, stream);
  TRIATTN_CUDA_TRY(append::run_contiguous(cache.template view<T>(), seq, r.first_slot, 0,
                                          cache.config().model.num_layers, k, v, n, stream));
  return r;
}

}  // namespace triattn::cuda

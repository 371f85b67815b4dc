// SPDX-License-Identifier: Apache-2.0
// The serving loop's compression rounds on the GPU: cuda::DeviceRounds behind the Rounds
// interface of serving_loop.hpp. launch() queues a batched round on the model's stream and returns
// at once; the loop keeps stepping the other requests while the round's sequences sit out, and
// poll() commits the round (tables, lengths, freed blocks) once its event has passed. Pages the
// round emptied go back to the driver (VMM trim), two slabs kept mapped for regrowth.
#pragma once

#include <span>
#include <vector>

#include <cuda_runtime.h>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace triattn_serving {

/// The serving caches on the GPU: CUDA virtual memory (pages mapped as blocks are used, returned
/// at trim) behind the prefix cache (LoopOptions::prefix_cache off: nothing is looked up or
/// published), without compression and with TriAttention rounds on the device.
using GpuAllocator = triattn::PrefixCachingAllocator<triattn::cuda::VmmAllocator>;
using GpuPlainCache = triattn::KvCache<GpuAllocator, triattn::cuda::DeviceCompactor>;
using GpuTriCache = triattn::KvCache<GpuAllocator, triattn::cuda::DeviceCompactor, triattn::cuda::TriAttentionDeviceScorer,
                                     triattn::TopKSelector>;

template <class Cache>
class DeviceRoundsAdapter {
 public:
  DeviceRoundsAdapter(Cache& cache, cudaStream_t stream) : cache_(&cache), rounds_(cache), stream_(stream) {}

  [[nodiscard]] std::vector<triattn::CompressionReport> poll() { return trimmed(rounds_.poll()); }
  [[nodiscard]] bool busy() const noexcept { return rounds_.pending(); }
  [[nodiscard]] bool in_flight(triattn::SeqId s) const noexcept { return rounds_.in_flight(s); }
  void launch(std::span<const triattn::SeqId> seqs) { rounds_.launch(seqs, stream_); }
  std::vector<triattn::CompressionReport> wait() { return trimmed(rounds_.wait()); }

 private:
  std::vector<triattn::CompressionReport> trimmed(const std::vector<triattn::CompressionReport>& done) {
    if constexpr (requires { cache_->allocator().trim(stream_, std::size_t{0}); })
      if (!done.empty()) (void)cache_->allocator().trim(stream_, 2 * cache_->allocator().stats().slab_bytes);
    return done;
  }

  Cache* cache_;
  triattn::cuda::DeviceRounds<Cache> rounds_;
  cudaStream_t stream_;
};

}  // namespace triattn_serving

// SPDX-License-Identifier: Apache-2.0
// StaticAllocator<Backend>: the whole pool (num_blocks blocks in every (layer, K|V) range) is
// taken from the backend once; blocks are handed out by a BlockPool. Backend is HostBackend for
// the CPU path or triattn::cuda::DeviceBackend (one cudaMalloc) on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string>

#include <triattn/core/block_pool.hpp>
#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>

namespace triattn {

template <class Backend>
class StaticAllocator {
 public:
  using policy_role = allocator_role;
  using backend_type = Backend;
  static constexpr MemorySpace memory_space = Backend::memory_space;

  /// @throws triattn::out_of_memory naming `cfg` when the host cannot hold the pool (a device
  /// backend's failure is its own typed error).
  explicit StaticAllocator(const CacheConfig& cfg) try
      : pool_(cfg.num_blocks),
        range_stride_bytes_(cfg.block_bytes() * cfg.num_blocks),
        backend_(static_cast<std::size_t>(range_stride_bytes_) * 2u * static_cast<std::size_t>(cfg.model.num_layers)) {
  } catch (const out_of_memory& e) {
    throw out_of_memory(std::string(e.what()) + "; the pool of " + describe(cfg));
  } catch (const std::bad_alloc&) {
    throw out_of_memory("StaticAllocator: cannot allocate the pool of " + describe(cfg));
  }

  [[nodiscard]] bool allocate(std::span<std::int32_t> out) { return pool_.allocate(out); }
  void retain(std::int32_t b) { pool_.retain(b); }
  bool release(std::int32_t b) { return pool_.release(b); }

  [[nodiscard]] std::size_t num_free() const noexcept { return pool_.num_free(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return pool_.capacity(); }
  [[nodiscard]] int ref_count(std::int32_t b) const noexcept { return pool_.ref_count(b); }
  /// A static pool keeps all of its memory resident whatever is in use.
  [[nodiscard]] std::size_t bytes_resident() const noexcept { return backend_.bytes(); }
  [[nodiscard]] void* data() const noexcept { return backend_.data(); }
  [[nodiscard]] std::int64_t range_stride_bytes() const noexcept { return range_stride_bytes_; }
  [[nodiscard]] Backend& backend() noexcept { return backend_; }

 private:
  BlockPool pool_;
  std::int64_t range_stride_bytes_;
  Backend backend_;
};

}  // namespace triattn

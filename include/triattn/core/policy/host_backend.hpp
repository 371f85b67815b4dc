// SPDX-License-Identifier: Apache-2.0
// Memory backend for the CPU path: one zero-initialised, 64-byte aligned host buffer.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <new>

#include <triattn/core/concepts.hpp>

namespace triattn {

class HostBackend {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  HostBackend() = default;
  explicit HostBackend(std::size_t bytes)
      : data_(static_cast<std::byte*>(::operator new[](bytes == 0 ? 1 : bytes, std::align_val_t{64}))), bytes_(bytes) {
    std::memset(data_.get(), 0, bytes_);
  }
  [[nodiscard]] void* data() const noexcept { return data_.get(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  struct aligned_delete {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte, aligned_delete> data_;
  std::size_t bytes_ = 0;
};

}  // namespace triattn

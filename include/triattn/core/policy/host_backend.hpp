// SPDX-License-Identifier: Apache-2.0
// Memory backend for the CPU path: one zero-initialised, 64-byte aligned host buffer.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>
#include <utility>

#include <triattn/core/concepts.hpp>

namespace triattn {

class HostBackend {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  HostBackend() = default;
  explicit HostBackend(std::size_t bytes)
      : data_(static_cast<std::byte*>(::operator new[](bytes == 0 ? 1 : bytes, std::align_val_t{64}))), bytes_(bytes) {
    std::memset(data_, 0, bytes_);
  }
  HostBackend(HostBackend&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, std::size_t{0})) {}
  HostBackend& operator=(HostBackend&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~HostBackend() {
    if (data_ != nullptr) ::operator delete[](data_, std::align_val_t{64});
  }
  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::byte* data_ = nullptr;  // owned; a raw pointer keeps <memory> out of every core TU
  std::size_t bytes_ = 0;
};

}  // namespace triattn

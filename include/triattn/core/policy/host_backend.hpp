// SPDX-License-Identifier: Apache-2.0
// Memory backend for the CPU path: one zero-initialised, 64-byte aligned host buffer.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>

namespace triattn {

class HostBackend {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::kHost;

  HostBackend() = default;
  /// @throws triattn::out_of_memory when `bytes` exceed the host's physical memory (zeroing such
  /// a buffer would swap or be killed, not fail) or the allocation fails.
  explicit HostBackend(std::size_t bytes) : data_(allocate(bytes)), bytes_(bytes) { std::memset(data_, 0, bytes_); }
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
  [[nodiscard]] static std::size_t physical_memory_bytes() noexcept {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
#endif
    return 0;  // unknown: only the allocation itself can fail
  }
  static std::byte* allocate(std::size_t bytes) {
    const std::size_t physical = physical_memory_bytes();
    if (physical != 0 && bytes > physical)
      throw out_of_memory("HostBackend: " + std::to_string(bytes) + " bytes exceed the host's physical memory (" +
                          std::to_string(physical) + " bytes)");
    try {
      return static_cast<std::byte*>(::operator new[](bytes == 0 ? 1 : bytes, std::align_val_t{64}));
    } catch (const std::bad_alloc&) {
      throw out_of_memory("HostBackend: cannot allocate " + std::to_string(bytes) + " bytes of host memory");
    }
  }
  std::byte* data_ = nullptr;  // owned; a raw pointer keeps <memory> out of every core TU
  std::size_t bytes_ = 0;
};

}  // namespace triattn

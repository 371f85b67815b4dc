// SPDX-License-Identifier: Apache-2.0
// DeviceBackend: the memory backend of StaticAllocator on the GPU. One cudaMalloc of the whole
// pool at construction (zeroed by default, like HostBackend, or poisoned for debugging), one
// cudaFree in the noexcept destructor (failures go to cuda::report_error, never thrown).
#pragma once

#include <cstddef>
#include <utility>

#include <triattn/core/concepts.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/launch.cuh>

namespace triattn::cuda {

class DeviceBackend {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;

  /// What the fresh allocation holds.
  enum class Fill : int {
    kZero = 0,    ///< zero bytes (matches HostBackend, so host and device caches compare bitwise)
    kPoison = 1,  ///< 0xFF bytes: NaN for fp32/fp16/bf16, so reads of unwritten slots show up
    kNone = 2,    ///< leave as cudaMalloc returned it
  };

  DeviceBackend() noexcept = default;

  /// Allocates `bytes` on the current device and fills them; returns when the fill is done.
  /// @throws triattn::cuda_error when cudaMalloc or the fill fails (nothing is leaked).
  explicit DeviceBackend(std::size_t bytes, Fill fill = Fill::kZero) : bytes_(bytes) {
    TRIATTN_CUDA_TRY(cudaGetDevice(&device_));
    TRIATTN_CUDA_TRY(cudaMalloc(&data_, bytes == 0 ? 1 : bytes));
    if (fill == Fill::kNone) return;
    // cudaMemset may run asynchronously; wait so that any stream may use the memory afterwards.
    cudaError_t e = cudaMemset(data_, fill == Fill::kZero ? 0 : 0xFF, bytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      reset();
      TRIATTN_CUDA_TRY(e);
    }
  }

  DeviceBackend(const DeviceBackend&) = delete;
  DeviceBackend& operator=(const DeviceBackend&) = delete;
  DeviceBackend(DeviceBackend&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), device_(o.device_) {}
  DeviceBackend& operator=(DeviceBackend&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      device_ = o.device_;
    }
    return *this;
  }
  ~DeviceBackend() { reset(); }

  /// Device pointer to the pool ([bytes]), 256-byte aligned.
  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// Device the memory lives on.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) report_error(cudaFree(data_), "DeviceBackend: cudaFree");
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;  // [bytes_] device memory
  std::size_t bytes_ = 0;
  int device_ = 0;
};

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// triattn::cuda::VmmAllocator: the elastic KvCache allocator on CUDA virtual memory management.
// All logic lives host-only in core/vmm/vmm_allocator_core.hpp (tested in CI with FakeDriver);
// this file supplies the real driver: cuMem* entry points fetched at run time (cuda/driver.cuh,
// no libcuda link) and cudaEvent_t ordering on the caller's stream.
//
//   using Cache = triattn::KvCache<triattn::cuda::VmmAllocator, triattn::cuda::DeviceCompactor>;
//   Cache cache(cfg, triattn::cuda::DeviceCompactor(stream)); // reserves VA, maps nothing
//   ... extend / publish / kernels / apply_keep_plan on `stream` ...
//   cache.allocator().trim(stream);                           // empty pages go back after `stream`'s work
//   cache.allocator().set_memory_limit(8ull << 30, stream);   // shrink to 8 GiB (free pages only)
//
// Threading: driver calls need the device's primary context current on the calling thread (any
// thread that used the runtime on that device has it).
#pragma once

#include <string>
#include <vector>

#include <triattn/core/vmm/driver_api.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device_tables.cuh>
#include <triattn/cuda/driver.cuh>
#include <triattn/cuda/error.cuh>

namespace triattn::cuda {

/// The VmmDriver of the real GPU: one device, pinned device memory, read-write access for it.
class CudaVmmDriver {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;
  using stream_type = cudaStream_t;
  using event_type = cudaEvent_t;

  /// @param device  ordinal; < 0 means the current device.
  /// @throws cuda_error when no driver is present (cudaErrorInsufficientDriver), the driver is
  ///         older than CUDA 12.0, or the device cannot be initialised.
  explicit CudaVmmDriver(int device = -1) : api_(&driver_api()) {
    int current = 0;
    TRIATTN_CUDA_TRY(cudaGetDevice(&current));
    device_ = device < 0 ? current : device;
    // Driver VMM calls need the primary context to exist: create it (cudaFree(0)) on device_.
    if (device_ != current) TRIATTN_CUDA_TRY(cudaSetDevice(device_));
    const cudaError_t init = cudaFree(nullptr);
    if (device_ != current) (void)cudaSetDevice(current);
    TRIATTN_CUDA_TRY(init);
    int vmm_supported = 0;
    if (const CUresult r = api_->device_get_attribute(&vmm_supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                                      static_cast<CUdevice>(device_));
        r != CUDA_SUCCESS || vmm_supported == 0)
      throw cuda_error("triattn: device " + std::to_string(device_) +
                           " does not support virtual memory management (cuDeviceGetAttribute: " + cu_result_string(r) + ")",
                       r != CUDA_SUCCESS ? static_cast<int>(r) : static_cast<int>(CUDA_ERROR_NOT_SUPPORTED));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device_;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  CudaVmmDriver(CudaVmmDriver&& o) noexcept
      : api_(o.api_), device_(o.device_), prop_(o.prop_), access_(o.access_), free_events_(std::move(o.free_events_)) {
    o.free_events_.clear();
  }
  CudaVmmDriver& operator=(CudaVmmDriver&& o) noexcept {
    if (this != &o) {
      destroy_events();
      api_ = o.api_;
      device_ = o.device_;
      prop_ = o.prop_;
      access_ = o.access_;
      free_events_ = std::move(o.free_events_);
      o.free_events_.clear();
    }
    return *this;
  }
  CudaVmmDriver(const CudaVmmDriver&) = delete;
  CudaVmmDriver& operator=(const CudaVmmDriver&) = delete;
  ~CudaVmmDriver() { destroy_events(); }

  [[nodiscard]] int device() const noexcept { return device_; }

  // ---- VmmDriver ----------------------------------------------------------------------------------

  int granularity(std::size_t* out) noexcept {
    return api_->mem_get_allocation_granularity(out, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  }
  int create(std::size_t bytes, vmm::phys_handle* out) noexcept {
    CUmemGenericAllocationHandle h{};
    const CUresult r = api_->mem_create(&h, bytes, &prop_, 0);
    if (r == CUDA_SUCCESS) *out = static_cast<vmm::phys_handle>(h);
    return r;
  }
  int release(vmm::phys_handle h) noexcept {
    return teardown_ok(api_->mem_release(static_cast<CUmemGenericAllocationHandle>(h)));
  }
  int reserve(std::size_t bytes, std::size_t alignment, vmm::dev_addr* out) noexcept {
    CUdeviceptr p{};
    const CUresult r = api_->mem_address_reserve(&p, bytes, alignment, 0, 0);
    if (r == CUDA_SUCCESS) *out = static_cast<vmm::dev_addr>(p);
    return r;
  }
  int free(vmm::dev_addr va, std::size_t bytes) noexcept {
    return teardown_ok(api_->mem_address_free(static_cast<CUdeviceptr>(va), bytes));
  }
  int map(vmm::dev_addr va, std::size_t bytes, vmm::phys_handle h) noexcept {
    return api_->mem_map(static_cast<CUdeviceptr>(va), bytes, 0, static_cast<CUmemGenericAllocationHandle>(h), 0);
  }
  int unmap(vmm::dev_addr va, std::size_t bytes) noexcept {
    return teardown_ok(api_->mem_unmap(static_cast<CUdeviceptr>(va), bytes));
  }
  int set_access(vmm::dev_addr va, std::size_t bytes) noexcept {
    return api_->mem_set_access(static_cast<CUdeviceptr>(va), bytes, &access_, 1);
  }

  int event_record(cudaStream_t stream, cudaEvent_t* out) noexcept {
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    } else if (const cudaError_t c = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); c != cudaSuccess) {
      (void)cudaGetLastError();
      return c;
    }
    if (const cudaError_t c = cudaEventRecord(e, stream); c != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaEventDestroy(e);
      return c;
    }
    *out = e;
    return cudaSuccess;
  }
  int event_query(cudaEvent_t e, bool* done) noexcept {
    const cudaError_t c = cudaEventQuery(e);
    *done = c == cudaSuccess;
    if (c == cudaSuccess || c == cudaErrorNotReady) return cudaSuccess;
    (void)cudaGetLastError();
    return c;
  }
  int event_sync(cudaEvent_t e) noexcept {
    const cudaError_t c = cudaEventSynchronize(e);
    if (c != cudaSuccess) (void)cudaGetLastError();
    return c;
  }
  void event_destroy(cudaEvent_t e) noexcept {
    if (free_events_.size() < kMaxPooledEvents) {
      try {
        free_events_.push_back(e);
        return;
      } catch (...) {
      }
    }
    (void)cudaEventDestroy(e);
  }
  int quiesce() noexcept {
    int current = 0;
    if (cudaGetDevice(&current) != cudaSuccess) current = device_;
    if (current != device_) (void)cudaSetDevice(device_);
    cudaError_t c = cudaDeviceSynchronize();
    if (current != device_) (void)cudaSetDevice(current);
    if (c == cudaErrorCudartUnloading) c = cudaSuccess;  // process exit: the driver frees everything
    if (c != cudaSuccess) (void)cudaGetLastError();
    return c;
  }

  [[nodiscard]] void* pointer(vmm::dev_addr va) const noexcept {
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va));
  }

  [[nodiscard]] std::string describe(vmm::DriverCall call, int code) const {
    const bool runtime = call == vmm::DriverCall::kEventRecord || call == vmm::DriverCall::kEventQuery ||
                         call == vmm::DriverCall::kEventSync || call == vmm::DriverCall::kQuiesce;
    const std::string what = runtime ? std::string(cudaGetErrorName(static_cast<cudaError_t>(code))) + " (" +
                                           cudaGetErrorString(static_cast<cudaError_t>(code)) + ")"
                                     : cu_result_string(static_cast<CUresult>(code));
    return std::string(vmm::driver_call_name(call)) + " failed: " + what + " on device " + std::to_string(device_);
  }
  [[noreturn]] void raise(vmm::DriverCall call, int code, const std::string& what) const {
    throw cuda_error("triattn: " + describe(call, code) + (what.empty() ? "" : " while " + what), code);
  }

 private:
  static constexpr std::size_t kMaxPooledEvents = 64;

  /// During process teardown the driver may already be gone; everything is freed anyway.
  static int teardown_ok(CUresult r) noexcept { return r == CUDA_ERROR_DEINITIALIZED ? CUDA_SUCCESS : r; }
  void destroy_events() noexcept {
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    free_events_.clear();
  }

  const DriverEntryPoints* api_ = nullptr;
  int device_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::vector<cudaEvent_t> free_events_;  // recycled events (cudaEventDisableTiming)
};

static_assert(vmm::VmmDriver<CudaVmmDriver>, "CudaVmmDriver must model VmmDriver");

using VmmOptions = vmm::VmmOptions;
using VmmStats = vmm::VmmStats;
using AllocStatus = vmm::AllocStatus;

/// The elastic block allocator on CUDA VMM without a device copy of the block tables (for
/// engines that keep their own page table and only need memory + block ids).
using VmmBlockAllocator = vmm::VmmAllocatorCore<CudaVmmDriver>;

/// Drop-in for cuda::DeviceAllocator: VMM memory plus the published device tables that
/// KvCache::view() hands to kernels (cuda::publish(cache, stream)).
///   KvCache<cuda::DeviceAllocator, cuda::DeviceCompactor>  ->  KvCache<cuda::VmmAllocator, cuda::DeviceCompactor>
/// Everything elastic (trim, set_memory_limit, ensure_mapped, stats, ...) is inherited from
/// VmmBlockAllocator; options other than the limit are set after construction
/// (set_handle_pool_bytes, set_error_hook).
using VmmAllocator = WithDeviceTables<VmmBlockAllocator>;

}  // namespace triattn::cuda

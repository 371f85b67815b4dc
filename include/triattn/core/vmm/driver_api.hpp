// SPDX-License-Identifier: Apache-2.0
// The driver interface of the elastic (VMM) allocator: what VmmAllocatorCore<Driver> needs from
// "a GPU driver" (reserve address space, create/release physical pages, map/unmap them, grant
// access, order work with events). Host-only: the real CUDA implementation lives in
// cuda/backend/vmm_allocator.cuh, a fake with fault and latency injection in tests/common/vmm/fake_driver.hpp.
//
// Every call but raise() is noexcept and returns a status code: 0 is success, anything else is
// the driver's own code (CUresult for the cuMem* calls, cudaError_t for the event calls). The
// allocator turns a failure into a rollback plus either a typed "exhausted" outcome (out of
// memory) or the driver's exception (everything else), built by Driver::raise().
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>

namespace triattn::vmm {

/// Physical allocation handle (CUmemGenericAllocationHandle).
using phys_handle = std::uint64_t;
/// Device virtual address (CUdeviceptr).
using dev_addr = std::uint64_t;

/// Status codes shared by the driver and runtime enums (CUDA_SUCCESS/cudaSuccess = 0,
/// CUDA_ERROR_OUT_OF_MEMORY/cudaErrorMemoryAllocation = 2); cuda/driver.cuh checks them.
inline constexpr int kStatusSuccess = 0;
inline constexpr int kStatusInvalidValue = 1;
inline constexpr int kStatusOutOfMemory = 2;

/// The driver entry points the allocator uses (fault injection and call counters index by it).
enum class DriverCall : int {
  kGranularity = 0,  ///< cuMemGetAllocationGranularity
  kCreate,           ///< cuMemCreate
  kRelease,          ///< cuMemRelease
  kReserve,          ///< cuMemAddressReserve
  kFree,             ///< cuMemAddressFree
  kMap,              ///< cuMemMap
  kUnmap,            ///< cuMemUnmap
  kSetAccess,        ///< cuMemSetAccess
  kEventRecord,      ///< cudaEventCreateWithFlags + cudaEventRecord
  kEventQuery,       ///< cudaEventQuery
  kEventSync,        ///< cudaEventSynchronize
  kQuiesce,          ///< cudaDeviceSynchronize (destructor only)
  kCount
};
inline constexpr int kNumDriverCalls = static_cast<int>(DriverCall::kCount);

[[nodiscard]] inline const char* driver_call_name(DriverCall c) noexcept {
  switch (c) {
    case DriverCall::kGranularity: return "cuMemGetAllocationGranularity";
    case DriverCall::kCreate: return "cuMemCreate";
    case DriverCall::kRelease: return "cuMemRelease";
    case DriverCall::kReserve: return "cuMemAddressReserve";
    case DriverCall::kFree: return "cuMemAddressFree";
    case DriverCall::kMap: return "cuMemMap";
    case DriverCall::kUnmap: return "cuMemUnmap";
    case DriverCall::kSetAccess: return "cuMemSetAccess";
    case DriverCall::kEventRecord: return "cudaEventRecord";
    case DriverCall::kEventQuery: return "cudaEventQuery";
    case DriverCall::kEventSync: return "cudaEventSynchronize";
    case DriverCall::kQuiesce: return "cudaDeviceSynchronize";
    case DriverCall::kCount: break;
  }
  return "unknown driver call";
}

/// Error thrown by drivers without a CUDA error type of their own (the fake driver). The real
/// driver throws triattn::cuda_error. Both carry the call and the driver's code.
class driver_error : public error {
 public:
  driver_error(const std::string& what, DriverCall call, int code) : error(what), call_(call), code_(code) {}
  [[nodiscard]] DriverCall call() const noexcept { return call_; }
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  DriverCall call_;
  int code_;
};

/// What VmmAllocatorCore needs from a driver. All addresses and sizes are multiples of the
/// granularity; a physical handle is always exactly one granule and mapped whole.
template <class D>
concept VmmDriver = std::movable<D> &&
    requires(D& d, const D& cd, std::size_t n, phys_handle h, phys_handle* hp, dev_addr va, dev_addr* vap,
             typename D::stream_type s, typename D::event_type e, typename D::event_type* ep, bool* done,
             DriverCall call, int code, const std::string& what) {
      { D::memory_space } -> std::convertible_to<MemorySpace>;
      { d.granularity(&n) } noexcept -> std::same_as<int>;
      { d.create(n, hp) } noexcept -> std::same_as<int>;
      { d.release(h) } noexcept -> std::same_as<int>;
      { d.reserve(n, n, vap) } noexcept -> std::same_as<int>;
      { d.free(va, n) } noexcept -> std::same_as<int>;
      { d.map(va, n, h) } noexcept -> std::same_as<int>;
      { d.unmap(va, n) } noexcept -> std::same_as<int>;
      { d.set_access(va, n) } noexcept -> std::same_as<int>;
      { d.event_record(s, ep) } noexcept -> std::same_as<int>;  // creates (or reuses) and records
      { d.event_query(e, done) } noexcept -> std::same_as<int>;
      { d.event_sync(e) } noexcept -> std::same_as<int>;
      { d.event_destroy(e) } noexcept;                            // back to the driver's event pool
      { d.quiesce() } noexcept -> std::same_as<int>;              // wait for all device work (teardown)
      { cd.pointer(va) } noexcept -> std::same_as<void*>;         // what data() hands to kernels / the CPU
      { cd.describe(call, code) } -> std::convertible_to<std::string>;
      { cd.raise(call, code, what) };                             // [[noreturn]]: throws the driver's error
    };

}  // namespace triattn::vmm

// SPDX-License-Identifier: Apache-2.0
// CUDA driver entry points for the VMM allocator, fetched at run time through
// cudaGetDriverEntryPointByVersion with the PFN_* typedefs of <cudaTypedefs.h>. Nothing links
// libcuda, so every binary starts on a driver-less CI machine; there, driver_api() throws a
// triattn::cuda_error saying that no driver is present (cudaErrorInsufficientDriver).
#pragma once

#include <cudaTypedefs.h>  // PFN_cuMem*: types only, no link dependency

#include <string>

#include <triattn/core/vmm/driver_api.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>

namespace triattn::cuda {

static_assert(CUDA_SUCCESS == vmm::kStatusSuccess && CUDA_ERROR_OUT_OF_MEMORY == vmm::kStatusOutOfMemory &&
                  cudaErrorMemoryAllocation == vmm::kStatusOutOfMemory,
              "vmm status codes must match CUresult/cudaError_t");

/// The driver functions triattn uses (all from the CUDA 12.0 ABI).
struct DriverEntryPoints {
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
};

namespace detail {

struct DriverLoad {
  DriverEntryPoints api;
  cudaError_t error = cudaSuccess;  ///< first failure of cudaGetDriverEntryPointByVersion
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSuccess;
  const char* symbol = nullptr;     ///< the symbol that failed
};

template <class Fn>
inline bool load_entry_point(DriverLoad& l, const char* symbol, Fn& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    l.error = e != cudaSuccess ? e : cudaErrorSymbolNotFound;
    l.query = q;
    l.symbol = symbol;
    return false;
  }
  fn = reinterpret_cast<Fn>(p);
  return true;
}

/// Loaded once per process (thread-safe static initialisation); a failure is remembered.
inline const DriverLoad& driver_load() {
  static const DriverLoad load = [] {
    DriverLoad l;
    DriverEntryPoints& a = l.api;
    (void)(load_entry_point(l, "cuMemCreate", a.mem_create) && load_entry_point(l, "cuMemRelease", a.mem_release) &&
           load_entry_point(l, "cuMemAddressReserve", a.mem_address_reserve) &&
           load_entry_point(l, "cuMemAddressFree", a.mem_address_free) && load_entry_point(l, "cuMemMap", a.mem_map) &&
           load_entry_point(l, "cuMemUnmap", a.mem_unmap) && load_entry_point(l, "cuMemSetAccess", a.mem_set_access) &&
           load_entry_point(l, "cuMemGetAllocationGranularity", a.mem_get_allocation_granularity) &&
           load_entry_point(l, "cuDeviceGetAttribute", a.device_get_attribute) &&
           load_entry_point(l, "cuGetErrorName", a.get_error_name) &&
           load_entry_point(l, "cuGetErrorString", a.get_error_string));
    return l;
  }();
  return load;
}

}  // namespace detail

/// The driver's VMM entry points.
/// @throws cuda_error (code = the cudaError_t) when they cannot be had, e.g. no driver installed
///         (cudaErrorInsufficientDriver) or a driver older than CUDA 12.0.
inline const DriverEntryPoints& driver_api() {
  const detail::DriverLoad& l = detail::driver_load();
  if (l.error != cudaSuccess) {
    const char* why = l.error == cudaErrorInsufficientDriver || l.error == cudaErrorNoDevice
                          ? "no usable CUDA driver/GPU on this machine; the VMM allocator needs one"
                      : l.query == cudaDriverEntryPointVersionNotSufficent ? "the installed driver is older than CUDA 12.0"
                                                                           : "driver entry point not found";
    throw cuda_error(std::string("triattn: cudaGetDriverEntryPointByVersion(\"") + l.symbol + "\", 12000) failed: " +
                         cudaGetErrorName(l.error) + " (" + why + ")",
                     static_cast<int>(l.error));
  }
  return l.api;
}

/// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for a CUresult (driver loaded or not).
inline std::string cu_result_string(CUresult r) {
  const detail::DriverLoad& l = detail::driver_load();
  const char* name = nullptr;
  const char* text = nullptr;
  if (l.api.get_error_name != nullptr) (void)l.api.get_error_name(r, &name);
  if (l.api.get_error_string != nullptr) (void)l.api.get_error_string(r, &text);
  return std::string(name ? name : "CUresult") + " (" + (text ? text : std::to_string(static_cast<int>(r))) + ")";
}

}  // namespace triattn::cuda

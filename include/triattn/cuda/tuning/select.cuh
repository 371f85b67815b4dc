// SPDX-License-Identifier: Apache-2.0
// The one selector of tuning policies: the architecture the build targets picks the policy every
// CUDA algorithm defaults to (tuning::Selected); owning APIs check at construction that the
// device is of that architecture (require_device_arch).
#pragma once

#include <string>

#include <cuda_runtime.h>

#include <triattn/core/error.hpp>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/tuning/sm90.cuh>

/// Compute capability (major * 10 + minor) whose policies the build uses; the default matches
/// CMake's CUDA_ARCHITECTURES 90a. Another value needs a tuning::ForArch specialisation.
#ifndef TRIATTN_TUNING_ARCH
#define TRIATTN_TUNING_ARCH 90
#endif

namespace triattn::cuda::tuning {

/// The policies tuned for compute capability kArch; one specialisation per tuned architecture.
template <int kArch>
struct ForArch {
  static_assert(kArch < 0, "triattn: no tuning policy for TRIATTN_TUNING_ARCH: add one under cuda/tuning/ "
                           "(and a ForArch specialisation) or build for sm_90");
};
template <>
struct ForArch<90> : sm90::Policy {};

/// The policies of the architecture the build targets: each algorithm's default Policy argument.
using Selected = ForArch<TRIATTN_TUNING_ARCH>;

/// Throws unsupported naming `device` and its compute capability major.minor unless it is the
/// architecture whose policies the build uses (Selected::kArch).
inline void require_arch(int device, int major, int minor) {
  if (major * 10 + minor != Selected::kArch)
    throw unsupported("triattn: device " + std::to_string(device) + " has compute capability " +
                      std::to_string(major) + "." + std::to_string(minor) + ", but this build's kernels are tuned " +
                      "for sm_" + std::to_string(Selected::kArch) + " (cuda/tuning/select.cuh, TRIATTN_TUNING_ARCH)");
}

/// require_arch for `device` (-1: the current one), as the driver reports it; cuda_error when a
/// query fails.
inline void require_device_arch(int device = -1) {
  if (device < 0) TRIATTN_CUDA_TRY(cudaGetDevice(&device));
  int major = 0, minor = 0;
  TRIATTN_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TRIATTN_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  require_arch(device, major, minor);
}

}  // namespace triattn::cuda::tuning

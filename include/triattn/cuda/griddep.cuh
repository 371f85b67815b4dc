// SPDX-License-Identifier: Apache-2.0
// Programmatic dependent launch (sm_90): a kernel launched with launch_dependent() may start while
// the previous kernel in the stream still runs, once every CTA of that kernel has called
// griddep_launch_dependents() (or exited). It must call griddep_wait() before it touches anything
// the previous kernel writes, and before it writes anything that kernel reads; griddep_wait()
// returns when the previous grid has completed and its memory is visible. Work before the wait
// (sequence lengths, block-table lookups, index math) overlaps the previous kernel's tail.
// Every CTA of a dependent kernel calls griddep_wait() before it exits, so completion stays
// transitive along a chain of such kernels. Where the stream or device refuses the attribute
// the launch falls back to plain stream order, in which both calls are no-ops.
#pragma once

#include <cstddef>
#include <utility>

#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>

namespace triattn::cuda {

namespace detail {

/// Lets the next kernel of the stream (if launched dependent) be scheduled.
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Waits for the previous kernel of the stream to complete with its memory visible.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace detail

/// Launches `kernel` with cudaLaunchKernelEx; with `dependent`, as a programmatic dependent of
/// the previous work in `stream` (falling back to a plain launch where that is refused). Returns
/// the launch status.
template <class... Params, class... Args>
[[nodiscard]] cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                                        cudaStream_t stream, bool dependent, Args&&... args) noexcept {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e == cudaSuccess || !dependent) return e;
  (void)cudaGetLastError();  // no programmatic launch here: plain stream order
  cfg.numAttrs = 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

/// launch_kernel(..., dependent = true, ...).
template <class... Params, class... Args>
[[nodiscard]] cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                                           cudaStream_t stream, Args&&... args) noexcept {
  return launch_kernel(kernel, grid, block, smem, stream, true, std::forward<Args>(args)...);
}

}  // namespace triattn::cuda

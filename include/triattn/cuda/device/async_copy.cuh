// SPDX-License-Identifier: Apache-2.0
// Asynchronous global -> shared copies (cp.async) and shared-memory mbarriers (sm_80+ / sm_90).
#pragma once

#include <cstdint>

#include <triattn/cuda/config.cuh>

namespace triattn::cuda::detail {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
/// 16-byte global -> shared copy through L2 only (cp.async.cg).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
/// The same copy of the first src_bytes bytes, the rest zero-filled (src_bytes = 0: src is not read).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
/// Waits until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mbar_init(std::uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
/// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}
/// Arrives on mbarrier `bar` once every cp.async this thread has issued so far has completed
/// (without raising the pending count: the barrier's init count includes this arrival).
__device__ __forceinline__ void mbar_arrive_on_cp_async(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

}  // namespace triattn::cuda::detail

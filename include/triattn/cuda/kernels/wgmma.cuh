// SPDX-License-Identifier: Apache-2.0
// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) for the scorers: the few PTX wrappers they use.
//
// wgmma exists only in code compiled for the arch-specific target sm_90a
// (-gencode=arch=compute_90a,code=sm_90a; CMake: CUDA_ARCHITECTURES 90a). TRIATTN_WGMMA_ENABLED is
// defined in exactly those device passes; kernels that use these wrappers keep an mma.sync path
// for every other target, so a plain sm_90 build computes the same function, only slower.
#pragma once

#include <cstdint>

#include <triattn/cuda/config.cuh>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TRIATTN_WGMMA_ENABLED 1
#endif

namespace triattn::cuda::detail {

/// Shared-memory matrix descriptor of a K-major operand without swizzle ("interleave" layout):
/// core matrices of 8 rows x 16 bytes (8 16-bit elements of K), each 128 contiguous bytes.
/// k_chunk_stride: bytes between the two core matrices of a k16 step (the leading dimension);
/// row_group_stride: bytes between core matrices 8 rows (N) apart. All multiples of 16.
__host__ __device__ __forceinline__ std::uint64_t wgmma_desc_kmajor(std::uint32_t smem_addr, std::uint32_t k_chunk_stride,
                                                           std::uint32_t row_group_stride) {
  return static_cast<std::uint64_t>((smem_addr >> 4) & 0x3FFFu) |
         (static_cast<std::uint64_t>((k_chunk_stride >> 4) & 0x3FFFu) << 16) |
         (static_cast<std::uint64_t>((row_group_stride >> 4) & 0x3FFFu) << 32);  // layout type 0: no swizzle
}

/// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout: rows of
/// 64 16-bit elements (128 bytes) in 8-row atoms of 1,024 bytes, 16-byte chunk c of row r stored
/// at chunk c ^ (r % 8); the atom must start at a 1,024-byte aligned address. A k16 step at
/// element offset 16·j inside the row starts 32·j bytes later (the swizzle applies to the
/// address the hardware forms). row_group_stride: bytes between 8-row atoms.
__host__ __device__ __forceinline__ std::uint64_t wgmma_desc_kmajor_sw128(std::uint32_t smem_addr,
                                                                 std::uint32_t row_group_stride) {
  return static_cast<std::uint64_t>((smem_addr >> 4) & 0x3FFFu) | (static_cast<std::uint64_t>(1u) << 16) |
         (static_cast<std::uint64_t>((row_group_stride >> 4) & 0x3FFFu) << 32) |
         (static_cast<std::uint64_t>(1u) << 62);  // layout type 1: 128-byte swizzle
}

/// `desc` with its start address `bytes` later (a multiple of 16). Only the low word changes: the
/// operand stays inside shared memory (< 256 KB), so the 14-bit address field cannot carry, and a
/// loop of MMAs keeps one descriptor's high word in place (one add per MMA instead of a rebuild).
__host__ __device__ __forceinline__ std::uint64_t wgmma_desc_advance(std::uint64_t desc, std::uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | static_cast<std::uint32_t>(static_cast<std::uint32_t>(desc) + (bytes >> 4));
}

#ifdef TRIATTN_WGMMA_ENABLED
/// Orders this thread's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
/// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/// Makes this thread's generic-proxy shared-memory writes visible to wgmma (async proxy) reads
/// that follow a barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The 36 fp32 accumulators of an m64n72 tile as in-out asm operands %0-%35.
#define TRIATTN_WGMMA_N72_D_OPERANDS(d)                                                                           \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),     \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),    \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),    \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define TRIATTN_WGMMA_N72_D_LIST                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "                              \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, "

/// d (+)= A·B for one m64n72k16 step, fp32 accumulators. A from registers: this warp's 16 rows
/// of the warpgroup's 64 in mma.sync m16n8k16 A-fragment order; B (K-major, 72 x 16) from the
/// shared-memory descriptor b_desc. accumulate = 0 overwrites d. d[4j + v] is column
/// 8j + 2·(lane % 4) + (v & 1) of row lane / 4 + 8·(v >> 1) (the m16n8 C layout per 8 columns).
/// kF16: fp16 operands, else bf16.
template <bool kF16>
__device__ __forceinline__ void wgmma_m64n72k16_rs(float (&d)[36], const std::uint32_t (&a)[4], std::uint64_t b_desc,
                                                   int accumulate) {
#define TRIATTN_WGMMA_N72_ASM(TY)                                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n"                                                        \
               "wgmma.mma_async.sync.aligned.m64n72k16.f32." TY "." TY " " TRIATTN_WGMMA_N72_D_LIST              \
               "{%36, %37, %38, %39}, %40, p, 1, 1, 0;\n}\n"                                                       \
               : TRIATTN_WGMMA_N72_D_OPERANDS(d)                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate))
  if constexpr (kF16)
    TRIATTN_WGMMA_N72_ASM("f16");
  else
    TRIATTN_WGMMA_N72_ASM("bf16");
#undef TRIATTN_WGMMA_N72_ASM
}

/// The same step with A from shared memory too (descriptor a_desc).
template <bool kF16>
__device__ __forceinline__ void wgmma_m64n72k16_ss(float (&d)[36], std::uint64_t a_desc, std::uint64_t b_desc,
                                                   int accumulate) {
#define TRIATTN_WGMMA_N72_SS_ASM(TY)                                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                                        \
               "wgmma.mma_async.sync.aligned.m64n72k16.f32." TY "." TY " " TRIATTN_WGMMA_N72_D_LIST              \
               "%36, %37, p, 1, 1, 0, 0;\n}\n"                                                                     \
               : TRIATTN_WGMMA_N72_D_OPERANDS(d)                                                                    \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))
  if constexpr (kF16)
    TRIATTN_WGMMA_N72_SS_ASM("f16");
  else
    TRIATTN_WGMMA_N72_SS_ASM("bf16");
#undef TRIATTN_WGMMA_N72_SS_ASM
}

// The 72 fp32 accumulators of an m64n144 tile, as two 36-register sets, as in-out asm operands %0-%71.
#define TRIATTN_WGMMA_N144_D_OPERANDS(d)                                                                              \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]),                           \
      "+f"(d[0][6]), "+f"(d[0][7]), "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]),                     \
      "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]), "+f"(d[0][16]), "+f"(d[0][17]),                 \
      "+f"(d[0][18]), "+f"(d[0][19]), "+f"(d[0][20]), "+f"(d[0][21]), "+f"(d[0][22]), "+f"(d[0][23]),                 \
      "+f"(d[0][24]), "+f"(d[0][25]), "+f"(d[0][26]), "+f"(d[0][27]), "+f"(d[0][28]), "+f"(d[0][29]),                 \
      "+f"(d[0][30]), "+f"(d[0][31]), "+f"(d[0][32]), "+f"(d[0][33]), "+f"(d[0][34]), "+f"(d[0][35]),                 \
      "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]),                       \
      "+f"(d[1][6]), "+f"(d[1][7]), "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]),                     \
      "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15]), "+f"(d[1][16]), "+f"(d[1][17]),                 \
      "+f"(d[1][18]), "+f"(d[1][19]), "+f"(d[1][20]), "+f"(d[1][21]), "+f"(d[1][22]), "+f"(d[1][23]),                 \
      "+f"(d[1][24]), "+f"(d[1][25]), "+f"(d[1][26]), "+f"(d[1][27]), "+f"(d[1][28]), "+f"(d[1][29]),                 \
      "+f"(d[1][30]), "+f"(d[1][31]), "+f"(d[1][32]), "+f"(d[1][33]), "+f"(d[1][34]), "+f"(d[1][35])
#define TRIATTN_WGMMA_N144_D_LIST                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "                                 \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "                        \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "                        \
  "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, "

/// One m64n144k16 step with both operands in shared memory: B's 144 columns are the two 72-column
/// halves that the two 16-bit terms of each weight occupy next to each other per k-step; they
/// accumulate into d[0] (columns 0-71) and d[1] (72-143), each in the layout of
/// wgmma_m64n72k16_rs. One A read from shared memory serves both terms (two m64n72 steps read it
/// twice).
template <bool kF16>
__device__ __forceinline__ void wgmma_m64n144k16_ss(float (&d)[2][36], std::uint64_t a_desc, std::uint64_t b_desc,
                                                    int accumulate) {
#define TRIATTN_WGMMA_N144_SS_ASM(TY)                                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\n"                                                        \
               "wgmma.mma_async.sync.aligned.m64n144k16.f32." TY "." TY " " TRIATTN_WGMMA_N144_D_LIST            \
               "%72, %73, p, 1, 1, 0, 0;\n}\n"                                                                     \
               : TRIATTN_WGMMA_N144_D_OPERANDS(d)                                                                   \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))
  if constexpr (kF16)
    TRIATTN_WGMMA_N144_SS_ASM("f16");
  else
    TRIATTN_WGMMA_N144_SS_ASM("bf16");
#undef TRIATTN_WGMMA_N144_SS_ASM
}
#undef TRIATTN_WGMMA_N144_D_LIST
#undef TRIATTN_WGMMA_N144_D_OPERANDS
#undef TRIATTN_WGMMA_N72_D_LIST
#undef TRIATTN_WGMMA_N72_D_OPERANDS
#endif  // TRIATTN_WGMMA_ENABLED

}  // namespace triattn::cuda::detail

// SPDX-License-Identifier: Apache-2.0
// The step recorder's matmuls of many rows (prefill chunks, large decode batches) through cuBLAS
// instead of the GEMV kernels, with the same fused work (cuda_kernels.cuh's GemvParams):
//   RMSNorm prologue   rmsnorm_kernel first (it writes norm_out as the GEMV prologue does)
//   x rows             gathered (x_rows) and, for bf16 weights, rounded to bf16 into a scratch
//                      buffer: cuBLAS's bf16 GEMM takes bf16 on both sides, which is the rounding
//                      gemv_mma_kernel applies on the fly; fp32 accumulation either way
//   GEMM               one cublasGemmEx per matrix (bf16 x bf16 -> fp32, or fp32 throughout)
//   epilogue           bias / residual add / SwiGLU in one element-wise kernel per matrix
// A bf16 matmul whose only epilogue is the residual add accumulates into the residual in the
// GEMM itself (beta = 1) and leaves its own output unwritten: the recorder fuses that add only
// where the model overwrites the output before reading it again (model.hpp's xb2 and xb). fp32
// keeps out-then-add, the unfused arithmetic, so fused and unfused fp32 steps stay bitwise equal.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include <triattn/core/error.hpp>

#include "cublas_context.cuh"
#include "cuda_kernels.cuh"

namespace triattn_example {

/// Which kernels run the backend's matmuls.
enum class MatmulPath : int {
  kAuto = 0,    ///< the GEMV kernels below the measured crossover (kCublasMinRows*), cuBLAS from it
  kGemv = 1,    ///< always the GEMV kernels (a row's arithmetic then never depends on the batch)
  kCublas = 2,  ///< always cuBLAS
};

/// Rows (x vectors of one matmul) from which kAuto sends a bf16 matmul to cuBLAS; below it the
/// streaming GEMV runs. Measured by bench_gemm_crossover (BM_Matmul, wtype 1; H100, 2026-12-07):
/// the GEMV wins only at n = 1 on most shapes, and this threshold's matmul time summed over the
/// five shapes of each model for n = 1..128 is within 11% (SmolLM2-135M) and 1% (Qwen3-8B shape)
/// of picking the faster path per shape; the next best, 32, was 19% / 10% off.
inline constexpr int kCublasMinRowsBf16 = 2;
/// The same for fp32 weights (gemv_warp_kernel below it; BM_Matmul wtype 0, same run): within
/// 24% (SmolLM2-135M, whose tiny shapes favour neither path) and 0.4% (Qwen3-8B shape).
inline constexpr int kCublasMinRowsF32 = 4;

[[nodiscard]] inline bool use_cublas(MatmulPath path, bool bf16, int n) noexcept {
  if (path == MatmulPath::kGemv || n <= 0) return false;
  if (path == MatmulPath::kCublas) return true;
  return n >= (bf16 ? kCublasMinRowsBf16 : kCublasMinRowsF32);
}

namespace gpu {

inline constexpr int kGemmEpiThreads = 256;

/// dst[r] = x row r (x + rows[r] or r * stride), K elements, converted to T. Grid: [n], any block.
template <class T>
__global__ void gather_rows_kernel(T* __restrict__ dst, const float* __restrict__ x, const long long* __restrict__ rows,
                                   long long stride, int K) {
  pdl_trigger();
  pdl_wait();
  const long long r = blockIdx.x;
  const float* xr = x + (rows != nullptr ? rows[r] : r * stride);
  for (int i = static_cast<int>(threadIdx.x); i < K; i += static_cast<int>(blockDim.x))
    dst[r * K + i] = cvt_from_f32<T>(xr[i]);
}

/// The GEMV epilogue of one matrix after cuBLAS wrote W·x into s.out: gemv_store's arithmetic
/// (bias, then out, then residual +=), or with `up` (a SwiGLU pair, s = gate) gemv_store_pair's.
__global__ void __launch_bounds__(kGemmEpiThreads) gemm_epilogue_kernel(GemvSeg s, GemvSeg up, int paired, int n) {
  pdl_trigger();
  pdl_wait();
  const long long total = static_cast<long long>(n) * s.M;
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>(e / s.M);
    const int i = static_cast<int>(e - static_cast<long long>(b) * s.M);
    const float v = s.out[static_cast<long long>(b) * s.out_stride + i];
    if (paired != 0) gemv_store_pair(s, up, b, i, v, up.out[static_cast<long long>(b) * up.out_stride + i]);
    else gemv_store(s, b, i, v);
  }
}

}  // namespace gpu

namespace cuda_detail {

/// Scratch bytes cublas_matmul needs for n x rows of K (0: cuBLAS reads fp32 rows in place;
/// gathered: the rows come through a row-offset list).
[[nodiscard]] inline std::size_t cublas_x_scratch_bytes(int n, int K, bool bf16, bool gathered) noexcept {
  if (!bf16 && !gathered) return 0;
  return static_cast<std::size_t>(n) * static_cast<std::size_t>(K) * (bf16 ? sizeof(__nv_bfloat16) : sizeof(float));
}
[[nodiscard]] inline std::size_t cublas_x_scratch_bytes(const gpu::GemvParams& p, bool bf16) noexcept {
  return cublas_x_scratch_bytes(p.n, p.K, bf16, p.x_rows != nullptr);
}

/// y_s = W_s · x with p's prologue and epilogues (see the file comment) through cuBLAS on the
/// context's stream. x_scratch: cublas_x_scratch_bytes(p, bf16) bytes. launch(kernel, grid,
/// block, args...) launches the element-wise kernels on the same stream.
template <class Launch>
void cublas_matmul(gpu::GemvParams p, bool bf16, const CublasContext& ctx, void* x_scratch, std::size_t scratch_bytes,
                   Launch&& launch) {
  if (p.n <= 0) return;
  TRIATTN_EXPECTS(scratch_bytes >= cublas_x_scratch_bytes(p, bf16), "cublas_matmul: x scratch buffer too small");
  if (p.norm_w != nullptr) {  // RMSNorm first, as for gemv_mma_kernel: its output is the model's xb
    launch(gpu::rmsnorm_kernel, dim3(static_cast<unsigned>(p.n)), dim3(gpu::kNormThreads), p.norm_out, p.x, p.norm_w,
           p.K, p.eps, p.x_rows, p.x_stride);
    p.x = p.norm_out;
  }
  const void* xin = p.x;
  long long ldx = p.x_stride;
  if (cublas_x_scratch_bytes(p, bf16) > 0) {
    const dim3 grid(static_cast<unsigned>(p.n)), block(256);
    if (bf16)
      launch(gpu::gather_rows_kernel<__nv_bfloat16>, grid, block, static_cast<__nv_bfloat16*>(x_scratch), p.x, p.x_rows,
             p.x_stride, p.K);
    else
      launch(gpu::gather_rows_kernel<float>, grid, block, static_cast<float*>(x_scratch), p.x, p.x_rows, p.x_stride, p.K);
    xin = x_scratch;
    ldx = p.K;
  }
  const cudaDataType wt = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const int nmat = p.paired ? 2 : p.nseg;
  for (int s = 0; s < nmat; ++s) {
    gpu::GemvSeg& g = p.seg[s];
    if (bf16 && !p.paired && g.bias == nullptr && g.residual != nullptr) {
      ctx.gemm_rows(g.w, wt, xin, ldx, g.residual, g.res_stride, g.M, p.n, p.K, 1.0f);  // residual += W·x
      g.residual = nullptr;
      g.out = nullptr;  // done: no epilogue
      continue;
    }
    ctx.gemm_rows(g.w, wt, xin, ldx, g.out, g.out_stride, g.M, p.n, p.K, 0.0f);
  }
  auto epilogue = [&](const gpu::GemvSeg& s, const gpu::GemvSeg& up, int paired) {
    const long long total = static_cast<long long>(p.n) * s.M;
    const long long blocks = (total + gpu::kGemmEpiThreads - 1) / gpu::kGemmEpiThreads;
    launch(gpu::gemm_epilogue_kernel, dim3(static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8)),
           dim3(gpu::kGemmEpiThreads), s, up, paired, p.n);
  };
  if (p.paired) {
    epilogue(p.seg[0], p.seg[1], 1);
    return;
  }
  for (int s = 0; s < p.nseg; ++s)
    if (p.seg[s].out != nullptr && (p.seg[s].bias != nullptr || p.seg[s].residual != nullptr))
      epilogue(p.seg[s], p.seg[s], 0);
}

}  // namespace cuda_detail
}  // namespace triattn_example

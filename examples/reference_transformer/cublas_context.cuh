// SPDX-License-Identifier: Apache-2.0
// CublasContext: one cuBLAS handle bound to one stream with its own device workspace. The
// workspace is set with cublasSetWorkspace, so cuBLAS allocates nothing per call and its calls
// can be captured into CUDA graphs (the backend captures decode steps). Failures throw
// triattn::cuda_error naming the cuBLAS call and its status; nothing aborts.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <limits>
#include <string>

#include <triattn/core/error.hpp>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/launch.cuh>

namespace triattn_example {

namespace cuda_detail {
[[noreturn]] inline void throw_cublas(cublasStatus_t s, const char* call) {
  throw triattn::cuda_error(std::string("triattn_example: ") + call + " failed: " + cublasGetStatusName(s) + " (" +
                                cublasGetStatusString(s) + ")",
                            static_cast<int>(s));
}
}  // namespace cuda_detail

/// Evaluates a cublasStatus_t expression; on failure throws triattn::cuda_error naming the call.
#define TRIATTN_CUBLAS_TRY(call)                                                           \
  do {                                                                                     \
    const cublasStatus_t triattn_cublas_status_ = (call);                                  \
    if (triattn_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                   \
      ::triattn_example::cuda_detail::throw_cublas(triattn_cublas_status_, #call);         \
  } while (0)

class CublasContext {
 public:
  /// cuBLAS's advice for Hopper: 32 MiB lets every GEMM kernel (split-K included) run.
  static constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;

  explicit CublasContext(cudaStream_t stream, std::size_t workspace_bytes = kWorkspaceBytes) {
    TRIATTN_CUDA_TRY(cudaMalloc(&workspace_, workspace_bytes > 0 ? workspace_bytes : 1));
    const cublasStatus_t s = cublasCreate(&handle_);
    if (s != CUBLAS_STATUS_SUCCESS) {
      triattn::cuda::report_error(cudaFree(workspace_), "CublasContext: cudaFree");
      cuda_detail::throw_cublas(s, "cublasCreate");
    }
    try {
      // cublasSetStream resets the workspace to cuBLAS's own pool: the stream first.
      TRIATTN_CUBLAS_TRY(cublasSetStream(handle_, stream));
      TRIATTN_CUBLAS_TRY(cublasSetWorkspace(handle_, workspace_, workspace_bytes));
      // f32 stays f32 (no TF32); bf16 GEMMs accumulate in fp32 through their compute type.
      TRIATTN_CUBLAS_TRY(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
      TRIATTN_CUBLAS_TRY(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
    } catch (...) {
      release();
      throw;
    }
  }
  CublasContext(const CublasContext&) = delete;
  CublasContext& operator=(const CublasContext&) = delete;
  ~CublasContext() { release(); }

  [[nodiscard]] cublasHandle_t handle() const noexcept { return handle_; }

  /// Row-major y[r] = W · x[r] (+ beta * y[r]) for r < n: W [M, K] of `wtype` (CUDA_R_16BF or
  /// CUDA_R_32F, rows of K elements), x [n, K] of the same type (row stride ldx), y [n, M] fp32
  /// (row stride ldy), fp32 accumulation. In cuBLAS's column-major terms y^T = W^T' · x^T.
  void gemm_rows(const void* W, cudaDataType wtype, const void* x, long long ldx, float* y, long long ldy, int M, int n,
                 int K, float beta) const {
    constexpr long long kIntMax = std::numeric_limits<int>::max();
    TRIATTN_EXPECTS(M > 0 && n > 0 && K > 0 && ldx >= K && ldy >= M && ldx <= kIntMax && ldy <= kIntMax,
                    "CublasContext::gemm_rows: bad shape M " + std::to_string(M) + ", n " + std::to_string(n) + ", K " +
                        std::to_string(K) + ", ldx " + std::to_string(ldx) + ", ldy " + std::to_string(ldy));
    const float alpha = 1.0f;
    TRIATTN_CUBLAS_TRY(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, M, n, K, &alpha, W, wtype, K, x, wtype,
                                    static_cast<int>(ldx), &beta, y, CUDA_R_32F, static_cast<int>(ldy),
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

 private:
  void release() noexcept {
    if (handle_ != nullptr) {
      const cublasStatus_t s = cublasDestroy(handle_);
      if (s != CUBLAS_STATUS_SUCCESS) triattn::cuda::report_error(cudaErrorUnknown, "CublasContext: cublasDestroy");
      handle_ = nullptr;
    }
    if (workspace_ != nullptr) {
      triattn::cuda::report_error(cudaFree(workspace_), "CublasContext: cudaFree");
      workspace_ = nullptr;
    }
  }

  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

}  // namespace triattn_example

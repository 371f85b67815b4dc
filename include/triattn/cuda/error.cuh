// SPDX-License-Identifier: Apache-2.0
// CUDA error handling. Launchers return cudaError_t (no throw); the owning API converts failures
// into triattn::cuda_error with the call, the code's name and its text.
#pragma once

#include <string>

#include <triattn/core/error.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn {

/// A CUDA runtime or driver call failed.
class cuda_error : public error {
 public:
  cuda_error(const std::string& what, int code) : error(what), code_(code) {}
  /// cudaError_t (runtime) or CUresult (driver) value.
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace detail {
[[noreturn]] inline void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  throw cuda_error(std::string("triattn: ") + call + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                       ") [" + file + ":" + std::to_string(line) + "]",
                   static_cast<int>(e));
}
}  // namespace detail
}  // namespace triattn

/// Evaluates a cudaError_t expression; on failure clears the sticky last error and throws
/// triattn::cuda_error naming the call.
#define TRIATTN_CUDA_TRY(call)                                              \
  do {                                                                      \
    const cudaError_t triattn_err_ = (call);                                \
    if (triattn_err_ != cudaSuccess) {                                      \
      (void)cudaGetLastError();                                             \
      ::triattn::detail::throw_cuda(triattn_err_, #call, __FILE__, __LINE__); \
    }                                                                       \
  } while (0)

/// Inside a launcher returning cudaError_t: return the error of `call` if it failed.
#define TRIATTN_CUDA_RETURN_IF_ERROR(call)        \
  do {                                            \
    const cudaError_t triattn_err_ = (call);      \
    if (triattn_err_ != cudaSuccess) return triattn_err_; \
  } while (0)

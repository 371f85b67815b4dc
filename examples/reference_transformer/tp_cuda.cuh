// SPDX-License-Identifier: Apache-2.0
// Tensor parallelism on GPUs (tensor_parallel.hpp's split): rank r runs in its own host thread on
// CUDA device r, with a triattn::cuda::NcclCommunicator per rank.
//   attach_nccl(CudaBackend&, comm)       the model's two all-reduces per layer (after the
//                                         attention output and the MLP down projection) become
//                                         NCCL fp32 sums on the backend's stream, captured into
//                                         its decode-step CUDA graphs like every other launch
//   attach_nccl(DeviceRounds&, comm)      union rounds agree through cuda::NcclUnionAgreement
//                                         (all-reduce max of candidate flags and per-slot max
//                                         score), on the device, no host round trip
//   run_gpu_ranks(tp, f)                  one communicator per device (NcclCommunicator::
//                                         init_all), then f(rank, comm) in tp threads
// NCCL is loaded at run time (nccl_communicator.cuh), NVLink multicast stays off.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/tp/nccl_communicator.cuh>
#include <triattn/cuda/tp/nccl_union_agreement.cuh>

#include "cuda_backend.cuh"
#include "tensor_parallel.hpp"

namespace triattn_example {

/// `backend` all-reduces through `comm` (which must outlive the backend's last step).
inline void attach_nccl(const CudaBackend& backend, triattn::cuda::NcclCommunicator& comm) {
  backend.set_all_reduce(comm.size(), [&comm](float* x, std::size_t n, cudaStream_t s) {
    comm.all_reduce_sum(x, x, n, s);  // in place; throws triattn::nccl_error naming the call
  });
}

/// `rounds`' union rounds agree over `comm` (which must outlive their use).
inline void attach_nccl(DeviceRounds& rounds, triattn::cuda::NcclCommunicator& comm) {
  rounds.set_agreement([agree = triattn::cuda::NcclUnionAgreement(comm)](
                               std::uint8_t* flags, float* vmax, int batch, int max_len, cudaStream_t s) mutable {
    const cudaError_t e = agree(flags, vmax, batch, max_len, s);
    // the round only sees a cudaError_t: say what NCCL said
    if (e != cudaSuccess) std::fprintf(stderr, "union agreement over NCCL failed: %s\n", agree.last_error().c_str());
    return e;
  });
}

/// Why tensor parallelism over `tp` GPUs cannot run here (empty when it can): too few devices,
/// or NCCL missing.
[[nodiscard]] inline std::string gpu_tp_problem(int tp) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  if (n < tp)
    return "tensor parallelism over " + std::to_string(tp) + " GPUs needs " + std::to_string(tp) +
           " CUDA devices, this machine has " + std::to_string(n) +
           (e != cudaSuccess ? std::string(" (") + cudaGetErrorString(e) + ")" : std::string());
  if (!triattn::cuda::NcclCommunicator::available())
    return "tensor parallelism over GPUs needs NCCL: " + triattn::cuda::NcclCommunicator::unavailable_reason();
  return {};
}

/// Runs f(rank, comm) for rank = 0 .. tp-1, rank r in its own thread with device r current and
/// `comm` its NCCL communicator; joins and rethrows the lowest rank's exception. A rank that
/// fails alone can leave the others waiting inside NCCL: validate inputs before calling.
/// @throws triattn::unsupported (gpu_tp_problem) before starting anything.
template <class F>
void run_gpu_ranks(int tp, F&& f) {
  if (const std::string why = gpu_tp_problem(tp); !why.empty()) throw triattn::unsupported(why);
  std::vector<int> devices(static_cast<std::size_t>(tp));
  std::iota(devices.begin(), devices.end(), 0);
  std::vector<triattn::cuda::NcclCommunicator> comms = triattn::cuda::NcclCommunicator::init_all(devices);
  run_ranks(tp, [&](int r) {
    triattn::cuda::NcclCommunicator& comm = comms[static_cast<std::size_t>(r)];
    TRIATTN_CUDA_TRY(cudaSetDevice(comm.device()));
    f(r, comm);
  });
}

}  // namespace triattn_example

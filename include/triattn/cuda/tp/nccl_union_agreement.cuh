// SPDX-License-Identifier: Apache-2.0
// The union agreement of a tensor-parallel compression round over NCCL: an all-reduce (max) of
// the candidate flags (uint8) and of the per-slot max Ŝ (float), fused in one NCCL group, on the
// round's stream. No host round trip and no synchronisation, so a whole rank's round (score →
// reduce → candidates → agreement → select → compact) can be captured in a CUDA graph.
//
// Usage (one thread or process per rank, each with its own NcclCommunicator and stream):
//   cuda::NcclUnionAgreement agree(comm);
//   cuda::compression_round::run(view, model, params, batch, plan, ws, ws_bytes, agree, stream);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <triattn/cuda/algorithms/select.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/tp/nccl_communicator.cuh>

namespace triattn::cuda {

class NcclUnionAgreement {
 public:
  /// @param comm this rank's communicator; not owned, must outlive the agreement
  explicit NcclUnionAgreement(NcclCommunicator& comm) noexcept : comm_(&comm) {}

  /// Element-wise max over all ranks, in place, enqueued on `stream`.
  /// @param flags [batch, max_len] candidate flags (uint8)
  /// @param vmax  [batch, max_len] per-slot max of Ŝ over this rank's rows
  /// @return cudaSuccess, cudaErrorInvalidValue on a bad argument, or cudaErrorUnknown when NCCL
  ///         fails (last_status() / last_error() then say why).
  cudaError_t operator()(std::uint8_t* flags, float* vmax, int batch, int max_len, cudaStream_t stream) noexcept {
    if (batch < 0 || max_len < 0) return cudaErrorInvalidValue;
    const std::size_t n = static_cast<std::size_t>(batch) * static_cast<std::size_t>(max_len);
    if (n == 0) return cudaSuccess;
    if (flags == nullptr || vmax == nullptr) return cudaErrorInvalidValue;
    // One group: NCCL launches both reductions as one operation.
    int s = NcclCommunicator::group_start_status();
    if (s == 0) {
      const int a = comm_->all_reduce_status(flags, flags, n, NcclDataType::kUint8, NcclReduceOp::kMax, stream);
      const int b = comm_->all_reduce_status(vmax, vmax, n, NcclDataType::kFloat32, NcclReduceOp::kMax, stream);
      const int e = NcclCommunicator::group_end_status();  // always closes the group
      s = a != 0 ? a : (b != 0 ? b : e);
    }
    last_status_ = s;
    return s == 0 ? cudaSuccess : cudaErrorUnknown;
  }

  /// ncclResult_t of the last call (0 = success).
  [[nodiscard]] int last_status() const noexcept { return last_status_; }
  /// NCCL's text for the last call's status ("" after a success).
  [[nodiscard]] std::string last_error() const {
    return last_status_ == 0 ? std::string() : comm_->status_message(last_status_);
  }
  [[nodiscard]] NcclCommunicator& communicator() const noexcept { return *comm_; }

 private:
  NcclCommunicator* comm_;
  int last_status_ = 0;
};

static_assert(UnionAgreement<NcclUnionAgreement>);

}  // namespace triattn::cuda

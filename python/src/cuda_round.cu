// SPDX-License-Identifier: Apache-2.0
// The CUDA side of the extension (TRIATTN_PYTHON_CUDA builds only): the scorer's constants on a
// device, the device copy of a view's range pointers, and the library's cuda::paged_round on the
// caller's stream. Plain C++ interface (cuda_glue.hpp); no nanobind here.
#include "cuda_glue.hpp"

#include <memory>
#include <string>

#include <cuda_runtime.h>

#include <triattn/cuda/engine/paged_round.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace triattn::python::cuda_glue {

struct DeviceModel {
  cuda::TriAttentionDeviceScorer scorer;
  int device;
};

namespace {
/// Makes `device` current for the scope (and restores the caller's device); no-op when it already is.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TRIATTN_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != device) TRIATTN_CUDA_TRY(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};
}  // namespace

DeviceModel* make_device_model(const QueryStats& stats, const RopeConfig& rope, const ScoringParams& scoring,
                               int num_kv_heads, int device) {
  DeviceGuard guard(device);
  auto m = std::make_unique<DeviceModel>(DeviceModel{cuda::TriAttentionDeviceScorer(stats, rope, scoring, num_kv_heads),
                                                     device});
  // The constants' uploads are complete before any stream of the caller's uses them.
  TRIATTN_CUDA_TRY(cudaDeviceSynchronize());
  return m.release();
}

void free_device_model(DeviceModel* model) noexcept {
  if (model == nullptr) return;
  const int device = model->device;
  int previous = 0;
  const bool ok = cudaGetDevice(&previous) == cudaSuccess;
  if (ok && previous != device) (void)cudaSetDevice(device);
  delete model;
  if (ok && previous != device) (void)cudaSetDevice(previous);
}

void* upload_pointers(const void* const* host, std::size_t count, int device) {
  DeviceGuard guard(device);
  void* dev = nullptr;
  TRIATTN_CUDA_TRY(cudaMalloc(&dev, count * sizeof(void*)));
  const cudaError_t e = cudaMemcpy(dev, host, count * sizeof(void*), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    (void)cudaFree(dev);
    TRIATTN_CUDA_TRY(e);
  }
  return dev;
}

void free_pointers(void* device_ptrs, int device) noexcept {
  int previous = 0;
  const bool ok = cudaGetDevice(&previous) == cudaSuccess;
  if (ok && previous != device) (void)cudaSetDevice(device);
  (void)cudaFree(device_ptrs);
  if (ok && previous != device) (void)cudaSetDevice(previous);
}

std::size_t workspace_size(const DeviceModel* model, const SelectionParams& params, int batch, int max_len,
                           int max_seqs, int num_blocks) {
  const auto& v = model->scorer.device_model();
  return cuda::paged_round_workspace_size(cuda::RoundShape{v.num_layers, v.num_q_heads, v.num_kv_heads}, params.mode,
                                          batch, max_len, max_seqs, num_blocks);
}

std::string round_error(const void* workspace, int device) {
  DeviceGuard guard(device);
  cuda::RoundError e{};
  TRIATTN_CUDA_TRY(cudaDeviceSynchronize());
  TRIATTN_CUDA_TRY(cudaMemcpy(&e, cuda::paged_round_error(workspace), sizeof e, cudaMemcpyDeviceToHost));
  return cuda::describe(e);
}

void run_round(DType dtype, const ViewParts& parts, const DeviceModel* model, const SelectionParams& params,
               RoundTrigger trigger, const RoundBatch& batch, const RoundOutputs& out, void* workspace,
               std::size_t workspace_bytes, std::uintptr_t stream, int device) {
  DeviceGuard guard(device);
  auto go = [&](auto tag) {
    using T = typename decltype(tag)::type;
    KvCacheView<T, std::int32_t> view;
    view.ranges = reinterpret_cast<T* const*>(parts.ranges);
    view.block = parts.block;
    view.num_layers = parts.num_layers;
    view.num_blocks = parts.num_blocks;
    view.max_seqs = parts.max_seqs;
    view.max_blocks_per_seq = parts.max_blocks_per_seq;
    view.block_tables = parts.block_tables;
    view.seq_lens = parts.seq_lens;
    cuda::paged_round(view, model->scorer.device_model(), params, trigger, batch, out, workspace, workspace_bytes,
                      reinterpret_cast<cudaStream_t>(stream));
  };
  // The engine-layout views built here carry no fp8 scales yet: fp8 is refused by name.
  triattn::cuda::dispatch_dtype(unscaled_storage_types{}, dtype, "the Python CUDA round", go);
}

}  // namespace triattn::python::cuda_glue

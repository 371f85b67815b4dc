// SPDX-License-Identifier: Apache-2.0
// The extension's interface to its CUDA translation unit (cuda_round.cu): plain C++, so nanobind
// never passes through nvcc and nvcc never sees nanobind. Compiled only with TRIATTN_PYTHON_CUDA.
#pragma once

#include <string>

#include <cstddef>
#include <cstdint>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn::python::cuda_glue {

/// The scorer's per-model constants uploaded to one device (opaque to the host TUs).
struct DeviceModel;

/// Every function throws triattn::error (a CUDA failure, with cudaGetErrorString) or
/// triattn::logic_error (bad arguments) and leaves nothing allocated on failure.
[[nodiscard]] DeviceModel* make_device_model(const QueryStats& stats, const RopeConfig& rope,
                                             const ScoringParams& scoring, int num_kv_heads, int device);
void free_device_model(DeviceModel* model) noexcept;

/// A device copy of the [2 * num_layers] range pointers of a view (cudaMalloc + copy; done once
/// when a cache is wrapped, never per round).
[[nodiscard]] void* upload_pointers(const void* const* host, std::size_t count, int device);
void free_pointers(void* device_ptrs, int device) noexcept;

/// A view's fields with the element type erased (the range pointers are device pointers).
struct ViewParts {
  void* const* ranges = nullptr;  ///< [2 * num_layers] device array of range bases
  BlockLayout block{};
  int num_layers = 0;
  int num_blocks = 0;
  int max_seqs = 0;
  int max_blocks_per_seq = 0;
  const std::int32_t* block_tables = nullptr;
  const std::int32_t* seq_lens = nullptr;
};

/// Device workspace bytes of a round.
[[nodiscard]] std::size_t workspace_size(const DeviceModel* model, const SelectionParams& params, int batch, int max_len,
                                         int max_seqs, int num_blocks);

/// What the device checks of the last round run with `workspace` found ("" when nothing): copies
/// its error record (waits for the work on the device's streams that wrote it).
[[nodiscard]] std::string round_error(const void* workspace, int device);

/// The batched round over a device view, enqueued on `stream` (asynchronous; nothing is read
/// back); every pointer is a device pointer of `device`.
void run_round(DType dtype, const ViewParts& view, const DeviceModel* model,
               const SelectionParams& params, RoundTrigger trigger, const RoundBatch& batch, const RoundOutputs& out,
               void* workspace, std::size_t workspace_bytes, std::uintptr_t stream, int device);

}  // namespace triattn::python::cuda_glue

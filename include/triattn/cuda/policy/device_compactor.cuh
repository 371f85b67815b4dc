// SPDX-License-Identifier: Apache-2.0
// Compactor policy for device memory: KvCache<..., cuda::DeviceCompactor> compacts through the
// compact kernel. apply() packs the host KeepPlan (and, when the view's block tables are host
// memory, the sequence's block-table row) into a pinned buffer, uploads it with one
// cudaMemcpyAsync and launches one kernel on the compactor's stream. It does not wait for the
// kernel: work on the cache must be ordered after it on the same stream (or after
// synchronize()); that includes writes into blocks KvCache frees right after apply() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/algorithms/compact.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/launch.cuh>

namespace triattn::cuda {

class DeviceCompactor {
 public:
  using policy_role = compactor_role;
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;

  /// Works on the default stream. No CUDA call until the first apply().
  DeviceCompactor() noexcept = default;
  /// Works on `stream` (not owned).
  explicit DeviceCompactor(cudaStream_t stream) noexcept : stream_(stream) {}

  DeviceCompactor(const DeviceCompactor&) = delete;
  DeviceCompactor& operator=(const DeviceCompactor&) = delete;
  DeviceCompactor(DeviceCompactor&& o) noexcept { swap(o); }
  DeviceCompactor& operator=(DeviceCompactor&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~DeviceCompactor() { reset(); }

  /// Compacts sequence `seq` of `view` (device data) following `plan`, which the caller
  /// validated against the sequence's length (KvCache::apply_keep_plan does). The view's block
  /// tables may be device memory (a published mirror, current for `seq`) or host memory (then the
  /// row is uploaded with the plan).
  /// @throws unsupported for an uncompiled head_dim, logic_error on a plan/view shape mismatch,
  /// cuda_error when an upload or the launch fails.
  template <class T, class Id>
  void apply(const KvCacheView<T, Id>& view, int seq, const KeepPlan& plan) {
    dispatch_head_dim(view.block.head_dim, [](auto) {});  // throws unsupported naming the compiled list
    TRIATTN_EXPECTS(plan.num_layers == view.num_layers && plan.num_kv_heads == view.block.num_kv_heads,
                    "DeviceCompactor::apply: plan shape [" + std::to_string(plan.num_layers) + ", " +
                        std::to_string(plan.num_kv_heads) + "] does not match the view's [" +
                        std::to_string(view.num_layers) + ", " + std::to_string(view.block.num_kv_heads) + "]");
    TRIATTN_EXPECTS(seq >= 0 && seq < view.max_seqs, "DeviceCompactor::apply: sequence " + std::to_string(seq) +
                                                         " is not a row of the view's block tables");
    if (plan.keep == 0) return;

    const bool host_tables = !device_accessible(view.block_tables);
    // Columns the kernel touches: every slot up to the largest kept index.
    int max_slot = 0;
    for (int l = 0; l < plan.num_layers; ++l)
      for (int h = 0; h < plan.num_kv_heads; ++h) max_slot = triattn::detail::max_(max_slot, static_cast<int>(plan.row(l, h)[plan.keep - 1]));
    const int ncols = max_slot / view.block.block_size + 1;
    TRIATTN_EXPECTS(ncols <= view.max_blocks_per_seq, "DeviceCompactor::apply: kept slot " + std::to_string(max_slot) +
                                                          " is past the sequence's block-table row");

    // Upload layout: kept [L, Hkv, keep] | keep | seq id | block-table row [ncols] (host tables).
    const std::size_t kept_bytes = plan.indices.size() * sizeof(std::int32_t);
    const std::size_t row_off = round_up(kept_bytes + 2 * sizeof(std::int32_t), alignof(Id) > 8 ? alignof(Id) : 8);
    const std::size_t bytes = host_tables ? row_off + static_cast<std::size_t>(ncols) * sizeof(Id) : row_off;
    reserve(bytes);
    TRIATTN_CUDA_TRY(cudaEventSynchronize(uploaded_));  // the previous upload may still read host_
    std::memcpy(host_, plan.indices.data(), kept_bytes);
    const std::int32_t counts[2] = {plan.keep, host_tables ? 0 : seq};
    std::memcpy(host_ + kept_bytes, counts, sizeof(counts));
    if (host_tables)
      std::memcpy(host_ + row_off, view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq,
                  static_cast<std::size_t>(ncols) * sizeof(Id));
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(dev_, host_, bytes, cudaMemcpyHostToDevice, stream_));
    TRIATTN_CUDA_TRY(cudaEventRecord(uploaded_, stream_));

    KvCacheView<T, Id> v = view;
    if (host_tables) {
      v.block_tables = reinterpret_cast<const Id*>(dev_ + row_off);
      v.max_seqs = 1;  // the uploaded row is row 0
    }
    const auto* dev_counts = reinterpret_cast<const std::int32_t*>(dev_ + kept_bytes);
    CompactParams params{reinterpret_cast<const std::int32_t*>(dev_), dev_counts, dev_counts + 1, plan.keep};
    TRIATTN_CUDA_TRY(compact::run(v, params, 1, stream_));
  }

  /// Copies block `src` to `dst` in every (layer, K|V) range with one 2D copy on the stream
  /// (KvCache's copy-on-write of a shared block). @throws cuda_error when the copy fails.
  template <class T, class Id>
  void copy_block(const KvCacheView<T, Id>& view, Id src, Id dst) {
    copy_blocks(view, src, dst, Id{1});
  }

  /// Copies the n adjacent blocks from `src` to the n adjacent blocks from `dst` (runs that do
  /// not overlap) in every (layer, K|V) range with one 2D copy on the stream (KvCache::
  /// relocate_blocks). @throws logic_error on a bad run, cuda_error when the copy fails.
  template <class T, class Id>
  void copy_blocks(const KvCacheView<T, Id>& view, Id src, Id dst, Id n) {
    check_block_runs(src, dst, n, view.num_blocks, "DeviceCompactor::copy_blocks");
    const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(view.block.block_elems()) * static_cast<std::size_t>(n);
    // KvCache's own layout: every (layer, K|V) range kind_stride apart, so one 2D copy does all.
    TRIATTN_EXPECTS(view.ranges == nullptr && view.layer_stride == 2 * view.kind_stride,
                    "DeviceCompactor::copy_blocks: needs KvCache's contiguous view (no per-range pointers, "
                    "layer_stride = 2 * kind_stride)");
    const std::size_t pitch = sizeof(T) * static_cast<std::size_t>(view.kind_stride);
    TRIATTN_CUDA_TRY(cudaMemcpy2DAsync(view.data + static_cast<std::int64_t>(dst) * view.block.block_elems(), pitch,
                                       view.data + static_cast<std::int64_t>(src) * view.block.block_elems(), pitch,
                                       bytes, 2 * static_cast<std::size_t>(view.num_layers), cudaMemcpyDeviceToDevice,
                                       stream_));
  }

  /// Stream the kernels run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /// Waits for everything issued on the compactor's stream.
  void synchronize() const { TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream_)); }

 private:
  static std::size_t round_up(std::size_t x, std::size_t a) noexcept { return (x + a - 1) / a * a; }

  static bool device_accessible(const void* p) {
    cudaPointerAttributes attr{};
    TRIATTN_CUDA_TRY(cudaPointerGetAttributes(&attr, p));
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  }

  void reserve(std::size_t bytes) {
    if (uploaded_ == nullptr) TRIATTN_CUDA_TRY(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
    if (bytes <= capacity_) return;
    // Kernels already queued may still read dev_: drain the stream before replacing buffers.
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream_));
    release_buffers();
    const std::size_t cap = round_up(bytes > 2 * capacity_ ? bytes : 2 * capacity_, 4096);
    TRIATTN_CUDA_TRY(cudaMallocHost(&host_, cap));
    TRIATTN_CUDA_TRY(cudaMalloc(&dev_, cap));
    capacity_ = cap;
  }
  void release_buffers() noexcept {
    if (host_ != nullptr) report_error(cudaFreeHost(host_), "DeviceCompactor: cudaFreeHost");
    if (dev_ != nullptr) report_error(cudaFree(dev_), "DeviceCompactor: cudaFree");
    host_ = nullptr;
    dev_ = nullptr;
    capacity_ = 0;
  }
  void reset() noexcept {
    if (uploaded_ != nullptr) {
      report_error(cudaEventSynchronize(uploaded_), "DeviceCompactor: cudaEventSynchronize");
      report_error(cudaEventDestroy(uploaded_), "DeviceCompactor: cudaEventDestroy");
      uploaded_ = nullptr;
    }
    // cudaFree waits for kernels that still read dev_.
    release_buffers();
  }
  void swap(DeviceCompactor& o) noexcept {
    std::swap(stream_, o.stream_);
    std::swap(host_, o.host_);
    std::swap(dev_, o.dev_);
    std::swap(capacity_, o.capacity_);
    std::swap(uploaded_, o.uploaded_);
  }

  cudaStream_t stream_ = nullptr;
  char* host_ = nullptr;           // [capacity_] pinned upload buffer
  char* dev_ = nullptr;            // [capacity_] device copy of the plan
  std::size_t capacity_ = 0;
  cudaEvent_t uploaded_ = nullptr; // recorded after the last upload from host_
};

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Device mirror of KvCache's host bookkeeping (block tables and physical lengths), so that
// KvCache::view() can hand kernels device pointers.
//
// KvCache keeps the tables on the host and, when its allocator has published_tables() /
// published_lengths(), puts those pointers into the view. WithDeviceTables<Base> adds exactly
// that to any device allocator (a mixin: the bookkeeping stays Base's), and the caller publishes
// after changing the bookkeeping and before launching kernels that read the view (the fp8 scales,
// fixed by the config, are uploaded once at construction: published_scales()):
//
//   KvCache<cuda::DeviceAllocator, cuda::DeviceCompactor> cache(cfg);
//   cache.extend(seq, n);                       // host bookkeeping only
//   cuda::publish(cache, stream);               // device_kv_cache.cuh: one staged upload
//   cuda::append::run(cache.view<T>(), ...);    // kernels read device tables
//
// publish() packs the used columns into a pinned staging buffer and uploads them with
// cudaMemcpy2DAsync (tables) + cudaMemcpyAsync (lengths); it never synchronises except to reuse
// the staging buffer while the previous upload is still in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/cuda/backend/device_backend.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/launch.cuh>

namespace triattn::cuda {

/// Device copy of block tables [max_seqs, max_blocks_per_seq] (-1 padded) and lengths
/// [max_seqs], int32, with a pinned staging buffer. Move-only; noexcept destructor.
class DeviceTables {
 public:
  DeviceTables() noexcept = default;

  /// Allocates the mirror (tables all -1, lengths all 0) and its staging buffer.
  /// @throws logic_error on a bad shape, cuda_error when an allocation fails.
  DeviceTables(int max_seqs, int max_blocks_per_seq) : max_seqs_(max_seqs), cols_(max_blocks_per_seq) {
    TRIATTN_EXPECTS(max_seqs > 0 && max_blocks_per_seq > 0,
                    "DeviceTables: shape [" + std::to_string(max_seqs) + ", " + std::to_string(max_blocks_per_seq) +
                        "] must be positive");
    try {
      const std::size_t n = elems();
      TRIATTN_CUDA_TRY(cudaMalloc(&dev_, n * sizeof(std::int32_t)));
      TRIATTN_CUDA_TRY(cudaMallocHost(&staging_, n * sizeof(std::int32_t)));
      TRIATTN_CUDA_TRY(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
      TRIATTN_CUDA_TRY(cudaMemset(dev_, 0, static_cast<std::size_t>(max_seqs_) * sizeof(std::int32_t)));
      TRIATTN_CUDA_TRY(cudaMemset(dev_ + max_seqs_, 0xFF, table_elems() * sizeof(std::int32_t)));  // -1
      TRIATTN_CUDA_TRY(cudaDeviceSynchronize());
    } catch (...) {
      reset();
      throw;
    }
  }

  DeviceTables(const DeviceTables&) = delete;
  DeviceTables& operator=(const DeviceTables&) = delete;
  DeviceTables(DeviceTables&& o) noexcept { swap(o); }
  DeviceTables& operator=(DeviceTables&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~DeviceTables() { reset(); }

  /// Uploads host tables [max_seqs, max_blocks_per_seq] and lengths [max_seqs] on `stream`.
  /// Only columns that hold a block now or held one at the previous publish are copied, so the
  /// mirror equals the host arrays afterwards (stream-ordered) at a cost proportional to the
  /// cache's use, not its capacity. Kernels reading the mirror must be ordered after it on
  /// `stream`, and a later publish must not overtake kernels still reading it (use one stream).
  /// @throws logic_error on a size mismatch, cuda_error when a copy cannot be enqueued.
  void publish(std::span<const std::int32_t> tables, std::span<const std::int32_t> lens, int block_size,
               cudaStream_t stream) {
    TRIATTN_EXPECTS(dev_ != nullptr, "DeviceTables::publish: empty (default-constructed or moved-from) mirror");
    TRIATTN_EXPECTS(tables.size() == table_elems() && lens.size() == static_cast<std::size_t>(max_seqs_),
                    "DeviceTables::publish: got " + std::to_string(tables.size()) + " table entries and " +
                        std::to_string(lens.size()) + " lengths, expected " + std::to_string(table_elems()) + " and " +
                        std::to_string(max_seqs_));
    TRIATTN_EXPECTS(block_size > 0, "DeviceTables::publish: block_size must be positive");
    int used = 0;
    for (std::int32_t len : lens) used = len > 0 ? triattn::detail::max_(used, static_cast<int>((len + block_size - 1) / block_size)) : used;
    const int ncols = triattn::detail::min_(cols_, triattn::detail::max_(used, published_cols_));
    // The staging buffer may still feed the previous upload.
    TRIATTN_CUDA_TRY(cudaEventSynchronize(uploaded_));
    std::memcpy(staging_, lens.data(), lens.size_bytes());
    std::int32_t* st = staging_ + max_seqs_;
    for (int s = 0; s < max_seqs_ && ncols > 0; ++s)
      std::memcpy(st + static_cast<std::size_t>(s) * ncols, tables.data() + static_cast<std::size_t>(s) * cols_,
                  static_cast<std::size_t>(ncols) * sizeof(std::int32_t));
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(dev_, staging_, lens.size_bytes(), cudaMemcpyHostToDevice, stream));
    if (ncols > 0) {
      TRIATTN_CUDA_TRY(cudaMemcpy2DAsync(dev_ + max_seqs_, static_cast<std::size_t>(cols_) * sizeof(std::int32_t), st,
                                         static_cast<std::size_t>(ncols) * sizeof(std::int32_t),
                                         static_cast<std::size_t>(ncols) * sizeof(std::int32_t),
                                         static_cast<std::size_t>(max_seqs_), cudaMemcpyHostToDevice, stream));
    }
    TRIATTN_CUDA_TRY(cudaEventRecord(uploaded_, stream));
    published_cols_ = used;
  }

  /// Device block tables [max_seqs, max_blocks_per_seq], -1 padded.
  [[nodiscard]] const std::int32_t* tables() const noexcept { return dev_ ? dev_ + max_seqs_ : nullptr; }
  /// Device physical lengths [max_seqs].
  [[nodiscard]] const std::int32_t* lengths() const noexcept { return dev_; }
  [[nodiscard]] int max_seqs() const noexcept { return max_seqs_; }
  [[nodiscard]] int max_blocks_per_seq() const noexcept { return cols_; }

 private:
  [[nodiscard]] std::size_t table_elems() const noexcept {
    return static_cast<std::size_t>(max_seqs_) * static_cast<std::size_t>(cols_);
  }
  [[nodiscard]] std::size_t elems() const noexcept { return static_cast<std::size_t>(max_seqs_) + table_elems(); }
  void swap(DeviceTables& o) noexcept {
    std::swap(max_seqs_, o.max_seqs_);
    std::swap(cols_, o.cols_);
    std::swap(published_cols_, o.published_cols_);
    std::swap(dev_, o.dev_);
    std::swap(staging_, o.staging_);
    std::swap(uploaded_, o.uploaded_);
  }
  void reset() noexcept {
    if (uploaded_ != nullptr) {
      // The staging buffer must outlive the copy that reads it.
      report_error(cudaEventSynchronize(uploaded_), "DeviceTables: cudaEventSynchronize");
      report_error(cudaEventDestroy(uploaded_), "DeviceTables: cudaEventDestroy");
    }
    if (staging_ != nullptr) report_error(cudaFreeHost(staging_), "DeviceTables: cudaFreeHost");
    if (dev_ != nullptr) report_error(cudaFree(dev_), "DeviceTables: cudaFree");
    uploaded_ = nullptr;
    staging_ = nullptr;
    dev_ = nullptr;
    max_seqs_ = cols_ = published_cols_ = 0;
  }

  int max_seqs_ = 0;
  int cols_ = 0;              // max_blocks_per_seq
  int published_cols_ = 0;    // columns in use at the last publish (they must be re-sent to clear them)
  std::int32_t* dev_ = nullptr;      // [max_seqs] lengths, then [max_seqs, cols] tables (device)
  std::int32_t* staging_ = nullptr;  // same shape, tables packed [max_seqs, ncols] (pinned host)
  cudaEvent_t uploaded_ = nullptr;   // recorded after the last upload from staging_
};

/// Allocator mixin: Base's bookkeeping and memory plus a DeviceTables mirror that KvCache::view()
/// picks up through published_tables() / published_lengths().
template <class Base>
class WithDeviceTables : public Base {
 public:
  using base_type = Base;
  static_assert(Base::memory_space == MemorySpace::kDevice, "WithDeviceTables: the base allocator must own device memory");

  explicit WithDeviceTables(const CacheConfig& cfg)
      : Base(cfg), block_size_(cfg.block_size), num_blocks_(cfg.num_blocks), tables_(cfg.max_seqs, cfg.blocks_per_seq()) {
    // The fp8 scales are fixed by the config: one upload, before any kernel reads the view.
    if (!cfg.kv_scales.empty()) {
      void* p = nullptr;
      const std::size_t bytes = cfg.kv_scales.size() * sizeof(float);
      TRIATTN_CUDA_TRY(cudaMalloc(&p, bytes));
      scales_.reset(static_cast<float*>(p));
      TRIATTN_CUDA_TRY(cudaMemcpy(p, cfg.kv_scales.data(), bytes, cudaMemcpyHostToDevice));
    }
  }

  /// Device block tables [max_seqs, max_blocks_per_seq] as of the last publish().
  [[nodiscard]] const std::int32_t* published_tables() const noexcept { return tables_.tables(); }
  /// Device physical lengths [max_seqs] as of the last publish().
  [[nodiscard]] const std::int32_t* published_lengths() const noexcept { return tables_.lengths(); }

  /// Device copy of CacheConfig::kv_scales ([num_layers, 2, scale heads]); null without scales.
  [[nodiscard]] const float* published_scales() const noexcept { return scales_.get(); }

  /// Uploads the cache's host tables ([max_seqs, max_blocks_per_seq]) and lengths ([max_seqs]).
  void publish(std::span<const std::int32_t> host_tables, std::span<const std::int32_t> host_lens, cudaStream_t stream) {
    tables_.publish(host_tables, host_lens, block_size_, stream);
  }
  [[nodiscard]] DeviceTables& device_tables() noexcept { return tables_; }

  /// The tracked positions of a cache with CacheConfig::track_positions, beside the KV: int32
  /// [num_blocks, block_size, rows] (rows = layers * KV heads) in device memory, indexed like the
  /// pool, allocated at the first call. One store per cache, so every round over it (KvCache::compress
  /// on the device, any cuda::DeviceRounds) reads what the previous one wrote; an entry is written
  /// by the round that compacts its slot before any round reads it (positions_kernel.cuh).
  /// @throws logic_error when rows differs from the first call's, cuda_error when allocation fails.
  [[nodiscard]] std::int32_t* position_store(int rows) {
    TRIATTN_EXPECTS(rows > 0 && (store_rows_ == 0 || rows == store_rows_),
                    "WithDeviceTables::position_store: rows = " + std::to_string(rows) + " (the store holds " +
                        std::to_string(store_rows_) + " rows per slot)");
    if (store_ == nullptr) {
      void* p = nullptr;
      TRIATTN_CUDA_TRY(cudaMalloc(&p, static_cast<std::size_t>(num_blocks_) * static_cast<std::size_t>(block_size_) *
                                          static_cast<std::size_t>(rows) * sizeof(std::int32_t)));
      store_.reset(static_cast<std::int32_t*>(p));
      store_rows_ = rows;
    }
    return store_.get();
  }
  /// The store position_store() allocated (null before its first call).
  [[nodiscard]] const std::int32_t* position_store() const noexcept { return store_.get(); }

 private:
  struct DeviceFree {
    void operator()(void* p) const noexcept { report_error(cudaFree(p), "WithDeviceTables: cudaFree"); }
  };
  int block_size_;
  int num_blocks_;
  DeviceTables tables_;
  std::unique_ptr<std::int32_t, DeviceFree> store_;
  std::unique_ptr<float, DeviceFree> scales_;
  int store_rows_ = 0;
};

/// StaticAllocator over one cudaMalloc, with published device tables.
using DeviceAllocator = WithDeviceTables<StaticAllocator<DeviceBackend>>;

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// The serving loop's compression rounds on the GPU: cuda::DeviceRounds behind the Rounds
// interface of serving_loop.hpp. launch() queues a batched round and returns at once; the loop
// keeps stepping the other requests while the round's sequences sit out, and poll() commits the
// round (tables, lengths, freed blocks) once its event has passed. By default the round runs on a
// stream of its own (DeviceRounds::launch_beside), so its kernels overlap the next decode steps
// instead of delaying them; RoundStream::kEngine keeps it on the model's stream (the step after a
// launch then waits for the round on the device). Each round's device time is measured (events).
// Returning emptied pages to the driver is the caller's (main.cpp's hooks), not the commit's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <cuda_runtime.h>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace triattn_serving {

/// The serving caches on the GPU: CUDA virtual memory (pages mapped as blocks are used, returned
/// at trim) behind the prefix cache (LoopOptions::prefix_cache off: nothing is looked up or
/// published), without compression and with TriAttention rounds on the device.
using GpuAllocator = triattn::PrefixCachingAllocator<triattn::cuda::VmmAllocator>;
using GpuPlainCache = triattn::KvCache<GpuAllocator, triattn::cuda::DeviceCompactor>;
using GpuTriCache = triattn::KvCache<GpuAllocator, triattn::cuda::DeviceCompactor, triattn::cuda::TriAttentionDeviceScorer,
                                     triattn::TopKSelector>;

/// Where DeviceRoundsAdapter runs a round's kernels.
enum class RoundStream : int {
  kSide = 0,    ///< a stream of its own beside the model's: the round overlaps the next steps
  kEngine = 1,  ///< the model's stream: between two steps (the next step's tokens wait for it)
};

template <class Cache>
class DeviceRoundsAdapter {
 public:
  /// `stream`: the model's (the engine's) stream, where tables are published and steps run.
  DeviceRoundsAdapter(Cache& cache, cudaStream_t stream, RoundStream where = RoundStream::kSide)
      : rounds_(cache), engine_(stream), where_(where), flight_(static_cast<std::size_t>(cache.config().max_seqs), 0) {
    // Non-blocking: no legacy-stream call of the loop may wait for a round.
    if (where_ == RoundStream::kSide) TRIATTN_CUDA_TRY(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    TRIATTN_CUDA_TRY(cudaEventCreate(&begin_));
    TRIATTN_CUDA_TRY(cudaEventCreate(&end_));
  }
  DeviceRoundsAdapter(const DeviceRoundsAdapter&) = delete;
  DeviceRoundsAdapter& operator=(const DeviceRoundsAdapter&) = delete;
  ~DeviceRoundsAdapter() {
    if (rounds_.pending())
      triattn::cuda::report_error(cudaEventSynchronize(end_), "DeviceRoundsAdapter: waiting for a round");
    triattn::cuda::report_error(cudaEventDestroy(begin_), "DeviceRoundsAdapter: cudaEventDestroy");
    triattn::cuda::report_error(cudaEventDestroy(end_), "DeviceRoundsAdapter: cudaEventDestroy");
    if (side_ != nullptr)
      triattn::cuda::report_error(cudaStreamDestroy(side_), "DeviceRoundsAdapter: cudaStreamDestroy");
  }

  [[nodiscard]] const std::vector<triattn::CompressionReport>& poll() {
    const bool was = rounds_.pending();
    const std::vector<triattn::CompressionReport>& r = rounds_.poll();
    if (was && !rounds_.pending()) committed();
    return r;
  }
  [[nodiscard]] bool busy() const noexcept { return rounds_.pending(); }
  /// O(1): a flag per sequence slot, set at launch and cleared at the commit.
  [[nodiscard]] bool in_flight(triattn::SeqId s) const noexcept {
    return s >= 0 && static_cast<std::size_t>(s) < flight_.size() && flight_[static_cast<std::size_t>(s)] != 0;
  }
  void launch(std::span<const triattn::SeqId> seqs) {
    if (seqs.empty()) return;
    const cudaStream_t on = where_ == RoundStream::kSide ? side_ : engine_;
    TRIATTN_CUDA_TRY(cudaEventRecord(begin_, on));
    if (where_ == RoundStream::kSide) rounds_.launch_beside(seqs, engine_, side_);
    else rounds_.launch(seqs, engine_);
    TRIATTN_CUDA_TRY(cudaEventRecord(end_, on));
    for (triattn::SeqId s : seqs) flight_[static_cast<std::size_t>(s)] = 1;
  }
  const std::vector<triattn::CompressionReport>& wait() {
    const bool was = rounds_.pending();
    const std::vector<triattn::CompressionReport>& r = rounds_.wait();
    if (was) committed();
    return r;
  }
  /// Device time of the round the last poll()/wait() committed, in seconds (launch to its outputs
  /// on the host side of PCIe; beside the model's steps when they overlap).
  [[nodiscard]] double last_device_s() const noexcept { return last_device_s_; }
  [[nodiscard]] RoundStream where() const noexcept { return where_; }

 private:
  void committed() {
    for (triattn::SeqId s : rounds_.last_seqs()) flight_[static_cast<std::size_t>(s)] = 0;
    // end_ follows the round's own event on its stream: at most the gap between two records.
    TRIATTN_CUDA_TRY(cudaEventSynchronize(end_));
    float ms = 0.0f;
    TRIATTN_CUDA_TRY(cudaEventElapsedTime(&ms, begin_, end_));
    last_device_s_ = static_cast<double>(ms) * 1e-3;
  }

  triattn::cuda::DeviceRounds<Cache> rounds_;
  cudaStream_t engine_;
  RoundStream where_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
  std::vector<std::uint8_t> flight_;  // [max_seqs]: 1 while the sequence's round is in flight
  double last_device_s_ = 0.0;
};

}  // namespace triattn_serving

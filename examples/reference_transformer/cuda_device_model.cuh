// SPDX-License-Identifier: Apache-2.0
// DeviceDecoder: batched decode steps of Model<CudaBackend> whose weights exist only on the
// device, with the logits left there and greedy tokens from a device argmax. Model<> built from
// host ModelWeights would need 33 GB of host float32 for the Qwen3-8B-like shape;
// CudaBackend::generate_synthetic() produces the same weights directly on the GPU, and this class
// runs them through Model::forward (the one model code path; model.hpp) one token per sequence.
// The benchmarks (bench_decode_step.cu, bench_prefix_workload.cu) drive it;
// tests/cuda/test_reference_transformer_gpu.cu checks that its logits equal those of
// Model<CudaBackend> built from host weights, bit for bit.
// Tensor parallel: give it the full config, the rank and generate_synthetic(full, seed, rank) on
// a backend with set_all_reduce (tp_cuda.cuh).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>

#include "cuda_backend.cuh"
#include "model.hpp"
#include "model_config.hpp"
#include "tensor_parallel.hpp"

namespace triattn_example {

class DeviceDecoder {
 public:
  DeviceDecoder(const ModelConfig& full, CudaBackend backend, CudaBackend::WeightStore store, TpRank tp = {})
      : model_(full, tp, std::move(backend), std::move(store)) {}

  [[nodiscard]] const ModelConfig& config() const noexcept { return model_.config(); }
  [[nodiscard]] CudaBackend& backend() noexcept { return model_.backend(); }
  [[nodiscard]] const CudaBackend::WeightStore& weights() const noexcept { return model_.weights(); }
  [[nodiscard]] Model<CudaBackend>& model() noexcept { return model_; }

  /// One decode step: token tokens[i] is appended to sequence seqs[i] (distinct, active).
  /// Afterwards logits() holds [seqs.size(), vocab] on the device.
  /// @throws OutOfKvBlocks when the step does not fit (nothing changed: the check runs first).
  template <class Cache>
  void step(Cache& cache, std::span<const triattn::SeqId> seqs, std::span<const int> tokens) {
    TRIATTN_EXPECTS(seqs.size() == tokens.size() && !seqs.empty(), "DeviceDecoder::step: one token per sequence");
    chunks_.clear();
    for (std::size_t i = 0; i < seqs.size(); ++i)
      chunks_.push_back(Chunk{seqs[i], tokens.subspan(i, 1), triattn::Phase::kDecode});
    rows_ = model_.forward(cache, std::span<const Chunk>(chunks_), LogitsFor::kLastOfEachChunk);
  }

  /// Device logits of the last step, [rows, vocab].
  [[nodiscard]] const float* logits() const noexcept { return model_.logits(); }
  /// Host copy of the last step's logits.
  [[nodiscard]] std::vector<float> logits_host() {
    std::vector<float> h(static_cast<std::size_t>(rows_) * static_cast<std::size_t>(config().vocab_size));
    backend().download(h.data(), logits(), h.size() * sizeof(float));
    return h;
  }
  /// Greedy tokens of the last step (device argmax; only the ids cross PCIe).
  [[nodiscard]] std::vector<int> argmax() {
    std::vector<int> h(static_cast<std::size_t>(rows_));
    backend().argmax_host(h.data(), logits(), rows_, config().vocab_size);
    return h;
  }

 private:
  Model<CudaBackend> model_;
  std::vector<Chunk> chunks_;
  int rows_ = 0;
};

}  // namespace triattn_example

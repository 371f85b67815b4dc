// SPDX-License-Identifier: Apache-2.0
// DeviceDecoder: the decode step of Model<CudaBackend> for weights that exist only on the
// device. Model<> is built from host ModelWeights (33 GB of float32 for the Qwen3-8B-like shape);
// CudaBackend::generate_synthetic() produces the same weights directly on the GPU, and this class
// issues exactly the backend calls Model::step makes for a batch of one-token decode chunks
// (model.hpp: extend, layers, classify with LogitsFor::kLastOfEachChunk), except that the logits
// stay on the device (greedy tokens come back through a device argmax). The benchmark
// (benchmarks/bench_decode_step.cu) times it; tests/cuda/test_reference_transformer_gpu.cu checks
// that its logits equal Model<CudaBackend>'s bit for bit. Keep the two in step when model.hpp changes.
// Tensor parallel: give it shard_config(full, rank) and generate_synthetic(full, seed, rank) on a
// backend with set_all_reduce (tp_cuda.cuh); it all-reduces where Model does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/rope.hpp>

#include "backend.hpp"
#include "cuda_backend.cuh"
#include "model.hpp"
#include "model_config.hpp"

namespace triattn_example {

class DeviceDecoder {
 public:
  DeviceDecoder(const ModelConfig& c, CudaBackend backend, CudaBackend::WeightStore store)
      : config_((c.validate(), c)), backend_(std::move(backend)), store_(std::move(store)) {
    rope_.style = config_.rope_style;
    rope_.f32_angles = config_.rope_f32_angles;
    triattn::RopeConfig rc;
    rc.style = config_.rope_style;
    rc.theta = config_.rope_theta;
    rope_.inv_freq = triattn::rope_inv_freq(config_.head_dim, rc);
    rope_.inv_freq_f32 = triattn::rope_inv_freq_f32(config_.head_dim, static_cast<float>(config_.rope_theta));
  }

  [[nodiscard]] const ModelConfig& config() const noexcept { return config_; }
  [[nodiscard]] CudaBackend& backend() noexcept { return backend_; }
  [[nodiscard]] const CudaBackend::WeightStore& weights() const noexcept { return store_; }

  /// One decode step: token tokens[i] is appended to sequence seqs[i] (distinct, active).
  /// Afterwards logits() holds [seqs.size(), vocab] on the device.
  /// @throws OutOfKvBlocks when a sequence cannot grow (nothing changed for the sequences before it
  ///         either: the check runs first).
  template <class Cache>
  void step(Cache& cache, std::span<const triattn::SeqId> seqs, std::span<const int> tokens) {
    TRIATTN_EXPECTS(seqs.size() == tokens.size() && !seqs.empty(), "DeviceDecoder::step: one token per sequence");
    const triattn::CacheConfig& cfg = cache.config();
    std::int64_t need = 0;
    for (triattn::SeqId s : seqs) {
      const int len = cache.physical_length(s);
      if (len + 1 > cfg.blocks_per_seq() * cfg.block_size)
        throw OutOfKvBlocks("DeviceDecoder: sequence " + std::to_string(s) + " fills its block-table row");
      need += len % cfg.block_size == 0 ? 1 : 0;
    }
    if (need > static_cast<std::int64_t>(cache.allocator().num_free()))
      throw OutOfKvBlocks("DeviceDecoder: the step needs " + std::to_string(need) + " new KV blocks");
    rows_.clear();
    tokens_.assign(tokens.begin(), tokens.end());
    slots_.clear();
    for (triattn::SeqId s : seqs) {
      const std::int64_t p0 = cache.logical_position(s);
      const triattn::AppendResult r = cache.extend(s, 1, triattn::Phase::kDecode);
      TRIATTN_EXPECTS(r.ok(), "DeviceDecoder::step: extend failed after the capacity check");
      rows_.push_back(TokenInfo{s, r.first_slot, p0});
      slots_.push_back(r.first_slot);
    }
    switch (cfg.dtype) {
      case triattn::DType::kF32: layers<float>(cache, seqs); break;
      case triattn::DType::kF16: layers<triattn::f16_storage>(cache, seqs); break;
      case triattn::DType::kBF16: layers<triattn::bf16_storage>(cache, seqs); break;
    }
    classify();
  }

  /// Device logits of the last step, [rows, vocab].
  [[nodiscard]] const float* logits() const noexcept { return CudaBackend::data(logits_); }
  /// Host copy of the last step's logits.
  [[nodiscard]] std::vector<float> logits_host() {
    std::vector<float> h(rows_.size() * static_cast<std::size_t>(config_.vocab_size));
    backend_.download(h.data(), logits(), h.size() * sizeof(float));
    return h;
  }
  /// Greedy tokens of the last step (device argmax; only the ids cross PCIe).
  [[nodiscard]] std::vector<int> argmax() {
    const std::size_t n = rows_.size();
    if (CudaBackend::size(ids_) < n) ids_ = backend_.alloc(n);
    int* ids = reinterpret_cast<int*>(CudaBackend::data(ids_));
    backend_.argmax(ids, logits(), static_cast<int>(n), config_.vocab_size);
    std::vector<int> h(n);
    backend_.download(h.data(), ids, n * sizeof(int));
    return h;
  }

 private:
  void ensure(CudaBackend::Buffer& b, std::size_t n) {
    if (CudaBackend::size(b) < n) b = backend_.alloc(n);
  }

  // model.hpp Model::layers, one token per chunk.
  template <class T, class Cache>
  void layers(Cache& cache, std::span<const triattn::SeqId> seqs) {
    const ModelConfig& c = config_;
    const WeightPtrs& w = store_.ptrs();
    const int n = static_cast<int>(rows_.size());
    const std::size_t N = rows_.size();
    ensure(x_, N * c.dim);
    ensure(xb_, N * c.dim);
    ensure(xb2_, N * c.dim);
    ensure(q_, N * c.q_dim());
    ensure(k_, N * c.kv_dim());
    ensure(v_, N * c.kv_dim());
    ensure(att_, N * c.q_dim());
    ensure(h1_, N * c.hidden_dim);
    ensure(h3_, N * c.hidden_dim);
    float* x = CudaBackend::data(x_);
    float* xb = CudaBackend::data(xb_);
    float* xb2 = CudaBackend::data(xb2_);
    float* q = CudaBackend::data(q_);
    float* k = CudaBackend::data(k_);
    float* v = CudaBackend::data(v_);
    float* att = CudaBackend::data(att_);
    float* h1 = CudaBackend::data(h1_);
    float* h3 = CudaBackend::data(h3_);
    const std::size_t D = static_cast<std::size_t>(c.dim);
    const std::size_t QD = static_cast<std::size_t>(c.q_dim());
    const std::size_t KVD = static_cast<std::size_t>(c.kv_dim());
    const std::size_t H = static_cast<std::size_t>(c.hidden_dim);
    const std::span<const TokenInfo> rows(rows_);

    backend_.embed(x, w.tok_emb, tokens_, c.dim);
    for (int l = 0; l < c.n_layers; ++l) {
      const std::size_t L = static_cast<std::size_t>(l);
      backend_.rmsnorm(xb, x, w.rms_att + L * D, n, c.dim, c.rms_eps);
      backend_.matmul(q, w.wq + L * QD * D, xb, n, c.q_dim(), c.dim);
      backend_.matmul(k, w.wk + L * KVD * D, xb, n, c.kv_dim(), c.dim);
      backend_.matmul(v, w.wv + L * KVD * D, xb, n, c.kv_dim(), c.dim);
      if (w.bq != nullptr) {
        backend_.add_bias(q, w.bq + L * QD, n, c.q_dim());
        backend_.add_bias(k, w.bk + L * KVD, n, c.kv_dim());
        backend_.add_bias(v, w.bv + L * KVD, n, c.kv_dim());
      }
      backend_.rope(q, n, c.n_heads, c.head_dim, rows, rope_);
      backend_.rope(k, n, c.n_kv_heads, c.head_dim, rows, rope_);
      for (std::size_t i = 0; i < seqs.size(); ++i)
        backend_.template write_kv<T>(cache, seqs[i], l, slots_[i], k + i * KVD, v + i * KVD, 1, c.kv_dim());
      backend_.template attention<T>(att, q, rows, cache, l, c, nullptr);
      backend_.matmul(xb2, w.wo + L * D * QD, att, n, c.dim, c.q_dim());
      backend_.all_reduce_sum(xb2, N * D);  // tensor parallel (set_all_reduce); records nothing at tp 1
      backend_.add(x, xb2, n * c.dim);
      backend_.rmsnorm(xb, x, w.rms_ffn + L * D, n, c.dim, c.rms_eps);
      backend_.matmul(h1, w.w1 + L * H * D, xb, n, c.hidden_dim, c.dim);
      backend_.matmul(h3, w.w3 + L * H * D, xb, n, c.hidden_dim, c.dim);
      backend_.swiglu(h1, h3, n * c.hidden_dim);
      backend_.matmul(xb, w.w2 + L * D * H, h1, n, c.dim, c.hidden_dim);
      backend_.all_reduce_sum(xb, N * D);
      backend_.add(x, xb, n * c.dim);
    }
  }

  // model.hpp Model::classify with LogitsFor::kLastOfEachChunk (one row per chunk).
  void classify() {
    const ModelConfig& c = config_;
    const WeightPtrs& w = store_.ptrs();
    const std::size_t D = static_cast<std::size_t>(c.dim);
    const std::size_t V = static_cast<std::size_t>(c.vocab_size);
    ensure(logits_, rows_.size() * V);
    float* x = CudaBackend::data(x_);
    float* xb = CudaBackend::data(xb_);
    float* logits = CudaBackend::data(logits_);
    for (std::size_t i = 0; i < rows_.size(); ++i) {
      backend_.rmsnorm(xb + i * D, x + i * D, w.rms_final, 1, c.dim, c.rms_eps);
      backend_.matmul(logits + i * V, w.wcls, xb + i * D, 1, c.vocab_size, c.dim);
    }
    backend_.flush();
  }

  ModelConfig config_;
  CudaBackend backend_;
  CudaBackend::WeightStore store_;
  RopeTables rope_;
  std::vector<TokenInfo> rows_;
  std::vector<int> tokens_;
  std::vector<int> slots_;
  CudaBackend::Buffer x_, xb_, xb2_, q_, k_, v_, att_, h1_, h3_, logits_, ids_;
};

}  // namespace triattn_example

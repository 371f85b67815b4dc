// SPDX-License-Identifier: Apache-2.0
// What Model<Backend> (model.hpp) asks of a compute backend, and the small types both share.
//
// A backend owns where activations and weights live and implements these operations (all
// pointers are the backend's memory unless a parameter says "host"):
//
//   using Buffer = ...;                         // activation storage
//   Buffer alloc(std::size_t n);                // n floats
//   float* data(Buffer&);  const float* data(const Buffer&);  std::size_t size(const Buffer&);
//   WeightStore upload(const ModelWeights&);    // .ptrs() -> WeightPtrs in backend memory
//   void embed(float* x, const float* table, std::span<const int> tokens /*host*/, int dim);
//   void rmsnorm(float* out, const float* x, const float* w, int n, int dim, float eps);
//   void matmul(float* out, const float* W, const float* x, int n, int out_dim, int in_dim); // out[n,out] = x[n,in]·Wᵀ
//   void add_bias(float* y, const float* b, int n, int dim);
//   void rope(float* x, int n, int n_heads, int head_dim, std::span<const TokenInfo> rows /*host*/, const RopeTables&);
//   template <class T, class Cache> void write_kv(Cache&, SeqId, int layer, int first_slot,
//                                                 const float* k, const float* v, int n, int kv_dim);
//   template <class T, class Cache> void attention(float* out, const float* q, std::span<const TokenInfo> rows,
//                                                  const Cache&, int layer, const ModelConfig&,
//                                                  const AttentionObserver* /*may be null*/);
//   using kv_storage_types = triattn::storage_types<...>;  // cache dtypes it runs (others refused)
//   void swiglu(float* gate, const float* up, int n);   // gate = silu(gate) * up
//   void add(float* x, const float* y, int n);          // x += y
//   const float* host_view(const float* p, std::size_t n); // host-readable copy (observers, logits)
//
// The CPU backend (cpu_backend.hpp) is the reference. A CUDA backend plugs in with the same calls
// and the model code does not change: matmul through cuBLAS or a kernel; write_kv through
// triattn::cuda::append (SlotSource::kContiguous per chunk, or kLastSlot for a decode batch) on the
// cache's device view; attention through triattn::cuda::decode_attention for decode rows (one row
// per sequence, length = physical length) and a causal prefill kernel for prompt chunks (rows
// attend to [0, slot]); observers get host copies through host_view(). cuda_backend.cuh is that
// backend.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/rope_types.hpp>

#include "model_config.hpp"

namespace triattn_example {

/// One row of a step's activation matrix: which sequence it belongs to, the physical slot its
/// K/V is written to (attention reads slots [0, slot]), and its logical position (RoPE).
struct TokenInfo {
  triattn::SeqId seq = -1;
  int slot = 0;
  std::int64_t pos = 0;
};

/// Precomputed RoPE frequencies for the model's convention.
struct RopeTables {
  triattn::RopeStyle style = triattn::RopeStyle::kHalf;
  bool f32_angles = false;             ///< llama2.c float32 arithmetic (uses inv_freq_f32)
  std::vector<double> inv_freq;        ///< [head_dim/2] float64 ω_f (triattn::apply_rope)
  std::vector<float> inv_freq_f32;     ///< [head_dim/2] llama2.c's 1/powf(θ, 2f/d)
};

/// Base pointers of every tensor (layer l of a stacked tensor starts at l * per-layer size).
struct WeightPtrs {
  const float* tok_emb = nullptr;
  const float* rms_att = nullptr;
  const float* wq = nullptr;
  const float* wk = nullptr;
  const float* wv = nullptr;
  const float* wo = nullptr;
  const float* rms_ffn = nullptr;
  const float* w1 = nullptr;
  const float* w2 = nullptr;
  const float* w3 = nullptr;
  const float* rms_final = nullptr;
  const float* wcls = nullptr;  ///< the classifier (tok_emb when shared)
  const float* bq = nullptr;    ///< null when the model has no biases
  const float* bk = nullptr;
  const float* bv = nullptr;
};

/// Called once per layer and step with the pre-RoPE queries of the step's rows (after biases),
/// host memory [n_rows, n_heads, head_dim]: what calibration averages.
using QueryObserver = std::function<void(int layer, const float* q, int n_rows)>;

/// Called per (layer, row, query head) with the softmax probabilities over the row's sequence's
/// physical slots [0, slot] (host memory): for attention-fidelity measurements.
using AttentionObserver =
    std::function<void(int layer, int row, triattn::SeqId seq, int q_head, std::span<const float> probs)>;

}  // namespace triattn_example

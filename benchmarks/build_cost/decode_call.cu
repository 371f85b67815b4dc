// SPDX-License-Identifier: Apache-2.0
// Build-cost probe (benchmarks/build_cost.sh): a downstream decode step on a bf16 cache, append
// of the new token's K/V and decode attention (bf16 and fp32 caches, the fp32 fallback).
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/algorithms/decode_attention.cuh>

namespace tc = triattn::cuda;

template <class T>
cudaError_t downstream_decode(const tc::DecodeAttentionPlan& plan, const triattn::KvCacheView<T>& view,
                              const std::int32_t* seq_ids, const T* k, const T* v, const T* q, T* out, int batch,
                              int num_q_heads, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const cudaError_t e = tc::append::run_decode(view, seq_ids, 0, view.num_layers, k, v, batch, stream);
  if (e != cudaSuccess) return e;
  return tc::decode_attention::run(plan, view, 0, q, out, batch, num_q_heads, seq_ids, 0.088f, workspace,
                                   workspace_bytes, stream);
}

template cudaError_t downstream_decode<triattn::bf16_storage>(const tc::DecodeAttentionPlan&,
                                                              const triattn::KvCacheView<triattn::bf16_storage>&,
                                                              const std::int32_t*, const triattn::bf16_storage*,
                                                              const triattn::bf16_storage*, const triattn::bf16_storage*,
                                                              triattn::bf16_storage*, int, int, void*, std::size_t,
                                                              cudaStream_t);
template cudaError_t downstream_decode<float>(const tc::DecodeAttentionPlan&, const triattn::KvCacheView<float>&,
                                              const std::int32_t*, const float*, const float*, const float*, float*,
                                              int, int, void*, std::size_t, cudaStream_t);

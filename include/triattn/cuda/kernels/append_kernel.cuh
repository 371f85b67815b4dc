// SPDX-License-Identifier: Apache-2.0
// Append kernel: writes the K and V head vectors of new tokens into the paged cache, for one or
// many layers in one launch. A copy: bit-exact with ref::append. A thread moves kVecsPerThread
// 16-byte vectors of K and the matching ones of V; grid = [vectors / (threads * kVecsPerThread), layers].
// append_values_kernel takes float K and V and quantises them (the fp8 append).
#pragma once

#include <cstdint>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

/// Where each input token goes in the cache.
enum class SlotSource : int {
  kSlotMapping = 0,  ///< slot_mapping[token] = block_id * block_size + offset; -1 skips (vLLM padding)
  kContiguous = 1,   ///< slot first_slot + token of sequence `seq`, through the view's block tables
  kLastSlot = 2,     ///< slot seq_lens[s] - 1 of sequence s = seq_ids[token] (decode after extend)
};

/// POD parameters of append_kernel (T: the cache's storage type) and append_values_kernel (T =
/// float, any cache type).
template <class T>
struct AppendParams {
  const T* k;                        ///< [num_layers, num_tokens, num_kv_heads, head_dim] (strides below)
  const T* v;                        ///< [num_layers, num_tokens, num_kv_heads, head_dim]
  std::int64_t token_stride;         ///< elements between consecutive tokens of k and v (>= num_kv_heads * head_dim)
  std::int64_t layer_stride;         ///< elements between consecutive layers of k and v (any value when num_layers == 1)
  int num_tokens;
  int first_layer;                   ///< cache layer that input layer 0 goes to
  int num_layers;                    ///< input layers, written to [first_layer, first_layer + num_layers)
  SlotSource source;
  const std::int64_t* slot_mapping;  ///< [num_tokens] (kSlotMapping), device
  const std::int32_t* seq_ids;       ///< [num_tokens] (kLastSlot), device
  int seq;                           ///< sequence slot (kContiguous)
  int first_slot;                    ///< slot of token 0 (kContiguous)
};

namespace detail {

/// Block id and offset in block of `token`'s destination; block < 0 means skip.
template <class T, class Id, class In>
__device__ __forceinline__ void append_destination(const KvCacheView<T, Id>& view, const AppendParams<In>& p, int token,
                                                   std::int64_t& block, int& offset) {
  const int bs = view.block.block_size;
  if (p.source == SlotSource::kSlotMapping) {
    const std::int64_t slot = p.slot_mapping[token];
    block = slot < 0 ? -1 : slot / bs;
    offset = static_cast<int>(slot - block * bs);
    return;
  }
  int seq, pos;
  if (p.source == SlotSource::kContiguous) {
    seq = p.seq;
    pos = p.first_slot + token;
  } else {
    seq = p.seq_ids[token];
    pos = seq < 0 ? -1 : view.seq_lens[seq] - 1;
  }
  if (pos < 0) {
    block = -1;
    offset = 0;
    return;
  }
  block = view.block_tables[static_cast<std::int64_t>(seq) * view.max_blocks_per_seq + pos / bs];
  offset = pos % bs;
}

/// Where 16-byte cache vector idx (< total) = (token, head, vector) of a launch goes: block < 0
/// when its token is skipped. heads: the view's KV heads.
struct AppendVector {
  std::int64_t block;       ///< destination block
  int offset, token, head, vec;  ///< slot in the block, input token, KV head, vector in the head vector
};
template <int HeadDim, class T, class Id, class In>
__device__ __forceinline__ AppendVector append_vector(const KvCacheView<T, Id>& view, const AppendParams<In>& p,
                                                      int heads, int idx) {
  constexpr int kVecs = HeadDim / (16 / static_cast<int>(sizeof(T)));  // 16-byte vectors per head vector
  AppendVector a;
  const int row = idx / kVecs;  // (token, head)
  a.vec = idx % kVecs;
  a.token = row / heads;
  a.head = row - a.token * heads;
  detail::append_destination(view, p, a.token, a.block, a.offset);
  return a;
}
/// Element of p.k / p.v where vector `a` starts.
template <int HeadDim, class T, class In>
__device__ __forceinline__ std::int64_t append_source(const AppendParams<In>& p, int layer_in, const AppendVector& a) {
  return static_cast<std::int64_t>(layer_in) * p.layer_stride + static_cast<std::int64_t>(a.token) * p.token_stride +
         static_cast<std::int64_t>(a.head) * HeadDim + a.vec * (16 / static_cast<int>(sizeof(T)));
}

}  // namespace detail

/// Tune: the Append policy (tuning::Selected::Append or a type like it).
template <int HeadDim, class T, class Id, class Tune>
__global__ void __launch_bounds__(Tune::kThreads)
    append_kernel(KvCacheView<T, Id> view, AppendParams<T> p) {
  constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
  constexpr int kVecs = HeadDim / kVecElems;  // 16-byte vectors per head vector
  static_assert(HeadDim % kVecElems == 0, "head vectors must be whole 16-byte vectors");
  const int heads = view.block.num_kv_heads;
  const int layer_in = static_cast<int>(blockIdx.y);
  const int layer = p.first_layer + layer_in;
  const int total = p.num_tokens * heads * kVecs;

  // All loads first (kVecsPerThread of K and of V in flight), then all stores. Vector r of a
  // thread is idx0 + r * kThreads, so each load and store instruction stays coalesced.
  const int idx0 = static_cast<int>(blockIdx.x) * Tune::kThreads * Tune::kVecsPerThread + static_cast<int>(threadIdx.x);
  uint4 kx[Tune::kVecsPerThread], vx[Tune::kVecsPerThread];
  std::int64_t dst[Tune::kVecsPerThread];
#pragma unroll
  for (int r = 0; r < Tune::kVecsPerThread; ++r) {
    const int idx = idx0 + r * Tune::kThreads;
    dst[r] = -1;
    if (idx >= total) continue;
    const detail::AppendVector a = detail::append_vector<HeadDim>(view, p, heads, idx);
    if (a.block < 0) continue;
    const std::int64_t src = detail::append_source<HeadDim, T>(p, layer_in, a);
    // Inputs are read once: streaming loads keep them from evicting the lines just written.
    kx[r] = __ldcs(reinterpret_cast<const uint4*>(p.k + src));
    vx[r] = __ldcs(reinterpret_cast<const uint4*>(p.v + src));
    dst[r] = view.block.offset(a.block, a.offset, a.head) + a.vec * kVecElems;
  }
  T* const k_out = view.range(layer, KvKind::kKey);
  T* const v_out = view.range(layer, KvKind::kValue);
#pragma unroll
  for (int r = 0; r < Tune::kVecsPerThread; ++r) {
    if (dst[r] < 0) continue;
    *reinterpret_cast<uint4*>(k_out + dst[r]) = kx[r];
    *reinterpret_cast<uint4*>(v_out + dst[r]) = vx[r];
  }
}

/// The quantising append: float K and V rounded to the cache's T (fp8: x / scale of the layer
/// and head, nearest even, saturating; core's quantize, bit-exact with host::append_values). A
/// thread converts one 16-byte cache vector of K and of V (kVecElems floats each) per step.
template <int HeadDim, class T, class Id, class Tune>
__global__ void __launch_bounds__(Tune::kThreads)
    append_values_kernel(KvCacheView<T, Id> view, AppendParams<float> p) {
  using D = device_type_t<T>;
  constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
  constexpr int kVecs = HeadDim / kVecElems;
  static_assert(HeadDim % kVecElems == 0 && kVecElems % 4 == 0, "head vectors must be whole 16-byte vectors");
  const int heads = view.block.num_kv_heads;
  const int layer_in = static_cast<int>(blockIdx.y);
  const int layer = p.first_layer + layer_in;
  const int total = p.num_tokens * heads * kVecs;
  T* const k_out = view.range(layer, KvKind::kKey);
  T* const v_out = view.range(layer, KvKind::kValue);
  const int idx0 = static_cast<int>(blockIdx.x) * Tune::kThreads * Tune::kVecsPerThread + static_cast<int>(threadIdx.x);
#pragma unroll
  for (int r = 0; r < Tune::kVecsPerThread; ++r) {
    const int idx = idx0 + r * Tune::kThreads;
    if (idx >= total) continue;
    const detail::AppendVector a = detail::append_vector<HeadDim>(view, p, heads, idx);
    if (a.block < 0) continue;
    const std::int64_t src = detail::append_source<HeadDim, T>(p, layer_in, a);
    const std::int64_t dst = view.block.offset(a.block, a.offset, a.head) + a.vec * kVecElems;
    const float ks = kv_scale(view, layer, KvKind::kKey, a.head), vs = kv_scale(view, layer, KvKind::kValue, a.head);
    uint4 ko, vo;
    D* const ke = reinterpret_cast<D*>(&ko);
    D* const ve = reinterpret_cast<D*>(&vo);
#pragma unroll
    for (int e = 0; e < kVecElems; e += 4) {
      const float4 kf = __ldcs(reinterpret_cast<const float4*>(p.k + src + e));
      const float4 vf = __ldcs(reinterpret_cast<const float4*>(p.v + src + e));
      ke[e] = quant<T>(kf.x, ks), ke[e + 1] = quant<T>(kf.y, ks), ke[e + 2] = quant<T>(kf.z, ks), ke[e + 3] = quant<T>(kf.w, ks);
      ve[e] = quant<T>(vf.x, vs), ve[e + 1] = quant<T>(vf.y, vs), ve[e + 2] = quant<T>(vf.z, vs), ve[e + 3] = quant<T>(vf.w, vs);
    }
    *reinterpret_cast<uint4*>(k_out + dst) = ko;
    *reinterpret_cast<uint4*>(v_out + dst) = vo;
  }
}

}  // namespace triattn::cuda

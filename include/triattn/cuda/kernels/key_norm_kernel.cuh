// SPDX-License-Identifier: Apache-2.0
// Key-norm (KnormPress) scores on the GPU: one pass over the cached keys of a batch of sequences
// through the paged view, score = −‖k‖₂ per (layer, KV head, slot), written to every query head
// of the GQA group. Oracle: ref::key_norm_scores (tests/cuda/test_baseline_scorers.cu). Launcher:
// cuda/algorithms/key_norm.cuh.
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

/// POD parameters of key_norm_kernel.
struct KeyNormParams {
  const std::int32_t* seq_ids;  ///< [batch] device: sequence slots; lengths come from view.seq_lens
  int max_len;                  ///< score-row capacity (>= every length; longer rows are cut)
  int num_q_heads;              ///< Hq, a multiple of the view's KV heads
  float* out;                   ///< [batch, num_layers, num_q_heads, max_len]
};

/// Work split of key_norm_kernel: each thread loads 16 bytes of a head vector, so a token's
/// vector is read by kThreadsPerToken adjacent lanes (4 to 32) with one 16-byte load each.
/// Tune: the KeyNorm policy (kThreads per block).
template <int HeadDim, class T, class Tune>
struct KeyNormShape {
  using device_t = device_type_t<T>;
  static constexpr int kVec = 16 / static_cast<int>(sizeof(device_t));  ///< elements per thread
  static constexpr int kThreadsPerToken = HeadDim / kVec;
  static constexpr int kBlockThreads = Tune::kThreads;
  static constexpr int kTokensPerBlock = kBlockThreads / kThreadsPerToken;  ///< per grid-stride step
  static_assert(HeadDim % kVec == 0 && kThreadsPerToken >= 1 && kThreadsPerToken <= 32 &&
                    (kThreadsPerToken & (kThreadsPerToken - 1)) == 0,
                "KeyNormShape: a head vector must split into a power-of-two count (<= 32) of 16-byte loads");
};

/// Grid: x = token tiles (grid-stride over slots), y = num_layers * num_kv_heads, z = batch.
/// Block: KeyNormShape::kBlockThreads threads. Needs 16-byte aligned head vectors (the launcher
/// checks). Slots at or past a sequence's length are not written.
template <int HeadDim, class T, class Id, class Tune>
__global__ void __launch_bounds__(KeyNormShape<HeadDim, T, Tune>::kBlockThreads)
    key_norm_kernel(KvCacheView<T, Id> view, KeyNormParams p) {
  using Shape = KeyNormShape<HeadDim, T, Tune>;
  using D = typename Shape::device_t;
  using Word = uint4;  // 16 bytes: kVec elements
  constexpr int kTpt = Shape::kThreadsPerToken;
  const int b = static_cast<int>(blockIdx.z);
  const int seq = p.seq_ids[b];
  const int length = triattn::detail::min_(static_cast<int>(view.seq_lens[seq]), p.max_len);
  const int hkv = view.block.num_kv_heads;
  const int layer = static_cast<int>(blockIdx.y) / hkv;
  const int g = static_cast<int>(blockIdx.y) % hkv;
  const int group = p.num_q_heads / hkv;
  const float ks = kv_scale(view, layer, KvKind::kKey, g);  // fp8: dequantised per element, as the CPU
  const int sub = static_cast<int>(threadIdx.x) % kTpt;  // part of the head vector this thread reads
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // The lanes of one token: shuffles stay inside this aligned group, which iterates in lockstep.
  const unsigned mask = kTpt == 32 ? 0xffffffffu : (((1u << (kTpt % 32)) - 1u) << (lane / kTpt * kTpt));
  float* out = p.out + ((static_cast<std::int64_t>(b) * view.num_layers + layer) * p.num_q_heads +
                        static_cast<std::int64_t>(g) * group) * p.max_len;
  const int stride = static_cast<int>(gridDim.x) * Shape::kTokensPerBlock;
  for (int j = static_cast<int>(blockIdx.x) * Shape::kTokensPerBlock + static_cast<int>(threadIdx.x) / kTpt;
       j < length; j += stride) {
    const D* k = reinterpret_cast<const D*>(view.token(layer, KvKind::kKey, seq, j, g)) + sub * Shape::kVec;
    const Word w = *reinterpret_cast<const Word*>(k);
    const D* e = reinterpret_cast<const D*>(&w);
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < Shape::kVec; ++v) {
      const float x = dequant<T>(e[v], ks);
      ss += x * x;
    }
#pragma unroll
    for (int off = kTpt / 2; off > 0; off /= 2) ss += __shfl_xor_sync(mask, ss, off);
    const float score = -sqrtf(ss);
    for (int t = sub; t < group; t += kTpt) out[static_cast<std::int64_t>(t) * p.max_len + j] = score;
  }
}

}  // namespace triattn::cuda

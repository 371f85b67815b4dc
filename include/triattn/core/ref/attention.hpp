// SPDX-License-Identifier: Apache-2.0
// CPU reference of paged decode attention: one query per sequence, GQA (query head h reads KV
// head h / G), softmax(sm_scale * q . k) over the sequence's physical length, float
// accumulation. The oracle of cuda::decode_attention.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>

namespace triattn::ref {

/// The usual softmax scale 1 / sqrt(head_dim).
[[nodiscard]] inline float default_sm_scale(int head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

/// Decode attention of sequence `seq` at `layer`: out[h] = sum_j softmax_j(sm_scale * q[h] .
/// K[j]) V[j] over slots j in [0, seq_lens[seq]) of KV head h / (num_q_heads / num_kv_heads).
/// An empty sequence gives zeros. The view's tables and lengths must be host memory.
/// q: [num_q_heads, head_dim] of the cache's type or float (fp8 caches); out: [num_q_heads, head_dim].
/// K and V are read as dequantize(code, the view's scale) (fp8: code * k_scale / v_scale).
/// @throws logic_error on a bad layer, sequence or head count.
template <class T, class Id, class Q>
void attention(const KvCacheView<T, Id>& view, int layer, int seq, const Q* q, int num_q_heads, float* out,
               float sm_scale) {
  const int hkv = view.block.num_kv_heads;
  const int d = view.block.head_dim;
  TRIATTN_EXPECTS(layer >= 0 && layer < view.num_layers,
                  "ref::attention: layer " + std::to_string(layer) + " out of [0, " + std::to_string(view.num_layers) + ")");
  TRIATTN_EXPECTS(seq >= 0 && seq < view.max_seqs,
                  "ref::attention: sequence " + std::to_string(seq) + " out of [0, " + std::to_string(view.max_seqs) + ")");
  TRIATTN_EXPECTS(num_q_heads > 0 && num_q_heads % hkv == 0,
                  "ref::attention: num_q_heads = " + std::to_string(num_q_heads) + " must be a positive multiple of " +
                      "num_kv_heads = " + std::to_string(hkv));
  const int group = num_q_heads / hkv;
  const int len = static_cast<int>(view.seq_lens[seq]);
  std::vector<float> scores(static_cast<std::size_t>(len > 0 ? len : 0));
  std::vector<float> qf(static_cast<std::size_t>(d));
  for (int h = 0; h < num_q_heads; ++h) {
    float* o = out + static_cast<std::size_t>(h) * d;
    for (int e = 0; e < d; ++e) o[e] = 0.0f;
    if (len <= 0) continue;
    const int kvh = h / group;
    const float ks = view.scale(layer, KvKind::kKey, kvh), vs = view.scale(layer, KvKind::kValue, kvh);
    for (int e = 0; e < d; ++e) qf[static_cast<std::size_t>(e)] = to_float(q[static_cast<std::size_t>(h) * d + e]);
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < len; ++j) {
      const T* k = view.token(layer, KvKind::kKey, seq, j, kvh);
      float s = 0.0f;
      for (int e = 0; e < d; ++e) s += qf[static_cast<std::size_t>(e)] * dequantize(k[e], ks);
      s *= sm_scale;
      scores[static_cast<std::size_t>(j)] = s;
      m = s > m ? s : m;
    }
    float l = 0.0f;
    for (int j = 0; j < len; ++j) {
      const float p = std::exp(scores[static_cast<std::size_t>(j)] - m);
      l += p;
      const T* v = view.token(layer, KvKind::kValue, seq, j, kvh);
      for (int e = 0; e < d; ++e) o[e] += p * dequantize(v[e], vs);
    }
    for (int e = 0; e < d; ++e) o[e] /= l;
  }
}

/// Batched form: entry b attends sequence seqs[b] with q[b] and writes out[b].
/// q: [batch, num_q_heads, head_dim]; out: [batch, num_q_heads, head_dim].
template <class T, class Id, class Q>
void attention(const KvCacheView<T, Id>& view, int layer, std::span<const int> seqs, const Q* q, int num_q_heads,
               float* out, float sm_scale) {
  const std::size_t per = static_cast<std::size_t>(num_q_heads) * view.block.head_dim;
  for (std::size_t b = 0; b < seqs.size(); ++b)
    attention(view, layer, seqs[b], q + b * per, num_q_heads, out + b * per, sm_scale);
}

}  // namespace triattn::ref

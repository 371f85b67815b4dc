// SPDX-License-Identifier: Apache-2.0
// Host K/V operations on a paged cache view: in-place compaction (for every layer, K and V, and
// KV head, move the kept slots of one sequence to slots 0..keep-1 in ascending order), block copy
// and append. What host caches run, and the oracle of the CUDA compactor (tests name it ref::,
// core/ref/compact.hpp).
#pragma once

#include <cstring>

#include <triattn/core/dtype.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>

namespace triattn::host {

/// Compacts sequence `seq` of `view` in place following `plan` (already validated against the
/// sequence's physical length). Moving forward is safe: row[i] >= i, and every source slot > i
/// is read before anything writes it.
template <class T, class Id>
void compact(const KvCacheView<T, Id>& view, int seq, const KeepPlan& plan) {
  const std::size_t vec_bytes = sizeof(T) * static_cast<std::size_t>(view.block.head_dim);
  for (int l = 0; l < plan.num_layers; ++l)
    for (int kind = 0; kind < 2; ++kind)
      for (int h = 0; h < plan.num_kv_heads; ++h) {
        const std::int32_t* row = plan.row(l, h);
        for (int i = 0; i < plan.keep; ++i) {
          if (row[i] == i) continue;
          const T* src = view.token(l, static_cast<KvKind>(kind), seq, row[i], h);
          T* dst = view.token(l, static_cast<KvKind>(kind), seq, i, h);
          std::memmove(dst, src, vec_bytes);
        }
      }
}

/// Copies the `count` adjacent blocks from `src` to those from `dst` in every (layer, K|V) range
/// (KvCache::relocate_blocks). The two runs must not overlap. Whole blocks: slots past a
/// sequence's length are copied too and never read.
template <class T, class Id>
void copy_blocks(const KvCacheView<T, Id>& view, Id src, Id dst, Id count) {
  const std::int64_t n = view.block.block_elems();
  for (int l = 0; l < view.num_layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      T* r = view.range(l, static_cast<KvKind>(kind));
      std::memcpy(r + dst * n, r + src * n, sizeof(T) * static_cast<std::size_t>(n) * static_cast<std::size_t>(count));
    }
}

/// Copies block `src` into block `dst` in every (layer, K|V) range (copy-on-write of a shared
/// block).
template <class T, class Id>
void copy_block(const KvCacheView<T, Id>& view, Id src, Id dst) {
  copy_blocks(view, src, dst, Id{1});
}

/// CPU reference of append: writes n tokens' K and V for one layer at slots [first_slot,
/// first_slot + n) of `seq`. k, v: [n, num_kv_heads, head_dim].
template <class T, class Id>
void append(const KvCacheView<T, Id>& view, int seq, int layer, int first_slot, const T* k, const T* v, int n) {
  const int hkv = view.block.num_kv_heads;
  const int d = view.block.head_dim;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < hkv; ++h) {
      const std::size_t src = (static_cast<std::size_t>(t) * hkv + h) * d;
      std::memcpy(view.token(layer, KvKind::kKey, seq, first_slot + t, h), k + src, sizeof(T) * d);
      std::memcpy(view.token(layer, KvKind::kValue, seq, first_slot + t, h), v + src, sizeof(T) * d);
    }
}

/// The quantising append: like append, from float K and V; element x of (layer,
/// K|V, head h) is stored as quantize<T>(x, view.scale(layer, K|V, h)) (fp8: x / scale rounded to
/// nearest even, saturating at +-448; f16/bf16: rounded to nearest even; float: copied).
template <class T, class Id>
void append_values(const KvCacheView<T, Id>& view, int seq, int layer, int first_slot, const float* k, const float* v,
                   int n) {
  const int hkv = view.block.num_kv_heads;
  const int d = view.block.head_dim;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < hkv; ++h) {
      const std::size_t src = (static_cast<std::size_t>(t) * hkv + h) * d;
      for (const KvKind kind : {KvKind::kKey, KvKind::kValue}) {
        const float* x = (kind == KvKind::kKey ? k : v) + src;
        const float s = view.scale(layer, kind, h);
        T* dst = view.token(layer, kind, seq, first_slot + t, h);
        for (int e = 0; e < d; ++e) dst[e] = quantize<T>(x[e], s);
      }
    }
}

}  // namespace triattn::host

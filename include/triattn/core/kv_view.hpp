// SPDX-License-Identifier: Apache-2.0
// KvCacheView: the non-owning, trivially copyable description of a paged KV cache that kernels
// (and the CPU reference) receive, whoever owns the memory: triattn's own KvCache or an engine
// (vLLM's FlashAttention and FlashInfer layouts, SGLang's per-token slots, TensorRT-LLM-style
// pools with several layers per block). Like FlashInfer's paged_kv_t it only holds pointers,
// strides and sizes; its type depends only on the element and index types, never on the
// allocator, scorer or compactor policy, so policy mixes do not multiply kernel instantiations.
//
// Addressing (every pointer in the memory space of whoever reads the view):
//   range(l, kind) = ranges ? ranges[2*l + kind]                        (a pointer per (layer, K|V))
//                           : data + l*layer_stride + kind*kind_stride  (one base and two strides)
//   token(l, kind, s, i, h) = range(l, kind) + block.offset(block_tables[s][i / block_size],
//                                                           i % block_size, h)
// with head_dim elements contiguous from there. Block tables are padded rows, vLLM style: entry
// j of row s is the block holding slots [j * block_size, (j + 1) * block_size) of sequence s;
// entries past the sequence's blocks are ignored (-1 by convention). Page size 1 (block_size 1,
// one slot per token, SGLang's req_to_token) is the same thing with one entry per token.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/layout.hpp>

namespace triattn {

enum class KvKind : int { kKey = 0, kValue = 1 };

template <class T, class Id = std::int32_t>
struct KvCacheView {
  T* data = nullptr;               ///< base of range (0, K) when `ranges` is null
  T* const* ranges = nullptr;      ///< optional [2 * num_layers] base of each (layer, K|V); overrides data
  std::int64_t layer_stride = 0;   ///< elements between (l, kind) and (l + 1, kind) when ranges is null
  std::int64_t kind_stride = 0;    ///< elements between (l, K) and (l, V) when ranges is null
  BlockLayout block{};             ///< strides inside one range (shared by K and V)
  int num_layers = 0;
  int num_blocks = 0;              ///< valid block ids are [0, num_blocks) (SGLang: slots)
  int max_seqs = 0;                ///< rows of block_tables and entries of seq_lens
  int max_blocks_per_seq = 0;      ///< columns of block_tables (row stride, in entries)
  const Id* block_tables = nullptr;  ///< [max_seqs, max_blocks_per_seq]
  const Id* seq_lens = nullptr;      ///< [max_seqs] physical lengths (cached tokens)
  /// Scaled dtypes (fp8): [num_layers, 2 (K, V), scale_heads] dequantisation scales, value =
  /// to_float(code) * scale; null means 1. Unscaled dtypes never read it.
  const float* scales = nullptr;
  int scale_heads = 0;  ///< 1 (per layer, vLLM's k_scale / v_scale) or num_kv_heads (per head)

  [[nodiscard]] TRIATTN_HOST_DEVICE T* range(int layer, KvKind kind) const {
    if (ranges != nullptr) return ranges[2 * layer + static_cast<int>(kind)];
    return data + static_cast<std::int64_t>(layer) * layer_stride + static_cast<int>(kind) * kind_stride;
  }
  /// Block-table row of sequence `seq` ([max_blocks_per_seq] entries).
  [[nodiscard]] TRIATTN_HOST_DEVICE const Id* table_row(int seq) const {
    return block_tables + static_cast<std::int64_t>(seq) * max_blocks_per_seq;
  }
  [[nodiscard]] TRIATTN_HOST_DEVICE Id block_of(int seq, int slot) const {
    return table_row(seq)[slot / block.block_size];
  }
  /// Head vector [head_dim] of (layer, kind, seq, slot, head).
  [[nodiscard]] TRIATTN_HOST_DEVICE T* token(int layer, KvKind kind, int seq, int slot, int head) const {
    return range(layer, kind) + block.offset(block_of(seq, slot), slot % block.block_size, head);
  }
  /// Dequantisation scale of (layer, kind, head): 1 without scales.
  [[nodiscard]] TRIATTN_HOST_DEVICE float scale(int layer, KvKind kind, int head) const {
    if (scales == nullptr) return 1.0f;
    const int r = 2 * layer + static_cast<int>(kind);
    return scales[static_cast<std::int64_t>(r) * scale_heads + (scale_heads > 1 ? head : 0)];
  }
  /// Slots a sequence can hold: max_blocks_per_seq * block_size.
  [[nodiscard]] TRIATTN_HOST_DEVICE std::int64_t capacity_tokens() const {
    return static_cast<std::int64_t>(max_blocks_per_seq) * block.block_size;
  }

  /// triattn's own layout (KvCache): 2 * num_layers ranges back to back, range r = 2 * layer + kind
  /// starting at data + r * range_stride, each [num_blocks] dense blocks of layout `block`.
  [[nodiscard]] static constexpr KvCacheView contiguous(T* data, std::int64_t range_stride, const BlockLayout& block,
                                                        int num_layers, int num_blocks, int max_seqs,
                                                        int max_blocks_per_seq, const Id* block_tables,
                                                        const Id* seq_lens) noexcept {
    KvCacheView v;
    v.data = data;
    v.layer_stride = 2 * range_stride;
    v.kind_stride = range_stride;
    v.block = block;
    v.num_layers = num_layers;
    v.num_blocks = num_blocks;
    v.max_seqs = max_seqs;
    v.max_blocks_per_seq = max_blocks_per_seq;
    v.block_tables = block_tables;
    v.seq_lens = seq_lens;
    return v;
  }

  /// Same view with dequantisation scales ([num_layers, 2, heads], heads 1 or num_kv_heads).
  [[nodiscard]] constexpr KvCacheView with_scales(const float* s, int heads) const noexcept {
    KvCacheView v = *this;
    v.scales = s;
    v.scale_heads = s != nullptr ? heads : 0;
    return v;
  }

  /// Same memory and geometry with other block tables and lengths (e.g. published device copies).
  [[nodiscard]] constexpr KvCacheView with_tables(const Id* tables, const Id* lens) const noexcept {
    KvCacheView v = *this;
    v.block_tables = tables;
    v.seq_lens = lens;
    return v;
  }
};

static_assert(std::is_trivially_copyable_v<KvCacheView<float>>, "KvCacheView must be trivially copyable");

/// Float values of slots [0, length) of (layer, kind, seq, head) into out[length * head_dim]:
/// dequantize(code, the view's scale) per element, what every CPU scorer reads. Host code.
template <class T, class Id>
void dequantize_rows(const KvCacheView<T, Id>& view, int layer, KvKind kind, int seq, int head, int length,
                     float* out) {
  const int d = view.block.head_dim;
  const float s = view.scale(layer, kind, head);
  for (int j = 0; j < length; ++j) {
    const T* x = view.token(layer, kind, seq, j, head);
    float* o = out + static_cast<std::int64_t>(j) * d;
    for (int e = 0; e < d; ++e) o[e] = dequantize(x[e], s);
  }
}
static_assert(std::is_trivially_copyable_v<BlockLayout>, "BlockLayout must be trivially copyable");

}  // namespace triattn

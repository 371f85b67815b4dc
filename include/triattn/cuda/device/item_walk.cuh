// SPDX-License-Identifier: Apache-2.0
// How scoring kernels walk their work: rows (sequence, layer, KV head, head chunk) cut into
// key tiles, a contiguous range of (row, tile) items per CTA, and the keys' addresses of a row.
#pragma once

#include <cstdint>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device/fast_div.cuh>
#include <triattn/cuda/score_model_view.cuh>

namespace triattn::cuda::detail {

/// Decoded work row: (sequence b, layer l, KV head g, head chunk hc).
struct ScoreRow {
  int b, l, g, hc;
};
__device__ __forceinline__ ScoreRow decode_score_row(long long row, int L, int Hkv, int HC) {
  ScoreRow r;
  r.hc = static_cast<int>(row % HC);
  row /= HC;
  r.g = static_cast<int>(row % Hkv);
  row /= Hkv;
  r.l = static_cast<int>(row % L);
  r.b = static_cast<int>(row / L);
  return r;
}

/// Where the keys of one (b, l, g) live and how long the sequence is.
template <class T, class Id>
struct KeyRowAddr {
  const T* range;             // K range of layer l
  const Id* table;            // block-table row of the sequence
  std::int64_t block_elems;   // elements between consecutive blocks (the layout's block stride)
  std::int64_t token_stride;  // elements between slots of one head inside a block
  std::int64_t head_off;      // element offset of head g inside a block
  int len;                    // physical length, clamped to max_len

  __device__ __forceinline__ const T* key(int t, const FastDiv& fd, int block_size) const {
    const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
    const int r = t - page * block_size;
    const std::int64_t blk = static_cast<std::int64_t>(table[page]);
    return range + blk * block_elems + r * token_stride + head_off;
  }
};

template <class T, class Id>
__device__ __forceinline__ KeyRowAddr<T, Id> key_row(const KvCacheView<T, Id>& view, const ScoreBatch& a, int b,
                                                     int l, int g) {
  KeyRowAddr<T, Id> k;
  const int seq = a.seq_ids[b];
  const int len = static_cast<int>(view.seq_lens[seq]);
  k.len = len < a.max_len ? (len > 0 ? len : 0) : a.max_len;
  k.range = view.range(l, KvKind::kKey);
  k.table = view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq;
  k.block_elems = view.block.block_elems();
  k.token_stride = view.block.token_stride();
  k.head_off = view.block.offset(0, 0, g);
  return k;
}

/// The contiguous [begin, end) range of (row, tile) items of this CTA.
__device__ __forceinline__ void cta_item_range(long long total, long long& begin, long long& end) {
  begin = total * blockIdx.x / gridDim.x;
  end = total * (blockIdx.x + 1) / gridDim.x;
}

/// The work of a scoring launch: rows (sequence, layer, KV head, chunk of `heads` query heads)
/// cut into tiles of `tile` keys, and this CTA's contiguous [begin, end) range of (row, tile) items.
struct ScoreWork {
  int L, Hq, Hkv, G, HC, tiles_per_row;
  long long total;  ///< items of the launch
  long long begin, end;
  __device__ __forceinline__ ScoreWork(const ScoreModelView& m, const ScoreBatch& a, int heads, int tile)
      : L(m.num_layers), Hq(m.num_q_heads), Hkv(m.num_kv_heads), G(Hq / Hkv), HC((G + heads - 1) / heads),
        tiles_per_row((a.max_len + tile - 1) / tile),
        total(static_cast<long long>(a.batch) * L * Hkv * HC * tiles_per_row) {
    cta_item_range(total, begin, end);
  }
};

/// The item walk of the CUDA-core scorers: item i of the CTA's range is tile i % tiles_per_row of
/// row i / tiles_per_row. find() moves i to the next item with keys: a new row's addresses are
/// loaded, the rest of a row past its length is skipped (uniform across the CTA).
template <class T, class Id>
struct ItemWalk {
  long long rid = -1;  // row whose description and addresses row / kr hold
  ScoreRow row{};
  KeyRowAddr<T, Id> kr{};
  /// false when no item with keys is left in [i, end)
  __device__ __forceinline__ bool find(long long& i, long long end, const KvCacheView<T, Id>& view, const ScoreBatch& a,
                                       const ScoreWork& w, int tile_keys) {
    while (i < end) {
      const long long r = i / w.tiles_per_row;
      if (r != rid) {
        row = decode_score_row(r, w.L, w.Hkv, w.HC);
        kr = key_row(view, a, row.b, row.l, row.g);
        rid = r;
      }
      if (tile(i, w.tiles_per_row) * tile_keys < kr.len) return true;
      i = (r + 1) * w.tiles_per_row;
    }
    return false;
  }
  /// tile of item i, which lies in row rid
  __device__ __forceinline__ int tile(long long i, int tiles_per_row) const {
    return static_cast<int>(i - rid * tiles_per_row);
  }
};

}  // namespace triattn::cuda::detail

// SPDX-License-Identifier: Apache-2.0
// In-place, order-preserving compaction: slot i of every (sequence, layer, K|V, KV head) row
// receives old slot kept[i]. Bit-exact with ref::compact.
//
// Race freedom. A row's destinations i and sources kept[i] >= i lie in the same memory, and
// slot s may be both written (as destination s) and read (as the source of some j <= s with
// kept[j] = s). One CTA owns a (sequence, layer, KV head) row, or one column part of it, and walks
// it in ascending chunks [c*C, (c+1)*C) of destinations:
//   1. it loads every source of chunk c into registers, then __syncthreads(), then stores
//      (the next chunk's loads may overlap these stores: see 3);
//   2. chunk c's sources are >= c*C, and chunks before it wrote only slots < c*C: nothing that
//      chunk c reads was overwritten earlier;
//   3. chunk c writes slots in [c*C, (c+1)*C); a later chunk c' > c reads only slots
//      >= c'*C >= (c+1)*C, and chunk c's own readers finished at the barrier of step 1.
// Column parts. Each byte column of a row (K or V, offset within the head vector) is its own
// in-place problem: a slot's column is only ever read and written at that column. So a row's
// 2 * HeadDim columns may be split into kParts disjoint parts walked by independent CTAs, which
// need no ordering between them: more, smaller CTAs for small batches.
// Rows of different (layer, kind, head) never share memory, and sequences own distinct blocks
// (KvCache refuses to compact shared blocks), so CTAs need no ordering between them.
#pragma once

#include <cstdint>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/griddep.cuh>

namespace triattn::cuda {

/// Device compaction plan of a batch of sequences (what a GPU selector can write directly).
struct CompactParams {
  const std::int32_t* kept;     ///< [batch, num_layers, num_kv_heads, max_keep], strictly ascending per row
  const std::int32_t* keep;     ///< [batch] kept tokens of each entry (<= max_keep); rows use entries [0, keep)
  const std::int32_t* seq_ids;  ///< [batch] sequence slot (block-table row) of each entry; -1 skips the entry
  int max_keep;                 ///< row pitch of `kept`
};

/// Column parts of a row that a launch with `requested` parts uses: a chunk must not hold more
/// tokens than the CTA has threads (each thread resolves at most one token per chunk), so parts
/// are capped at 2 * HeadDim / (16-byte vector elements * vectors per thread).
template <int HeadDim, class T>
[[nodiscard]] TRIATTN_HOST_DEVICE constexpr int compact_parts(int requested, int vecs_per_thread) noexcept {
  const int row_vecs = 2 * HeadDim / (16 / static_cast<int>(sizeof(T)));  // K and V of one token
  int parts = 1;
  while (parts * 2 <= requested && row_vecs % (parts * 2) == 0 && parts * 2 * vecs_per_thread <= row_vecs)
    parts *= 2;
  return parts;
}

/// Grid: (layer * num_kv_heads + head, batch entry, column part). Each thread moves
/// kVecsPerThread 16-byte vectors of one column of K or V per chunk. Tune: the Compact policy.
template <int HeadDim, class T, class Id, int kParts, int kVecsPerThread, class Tune>
__global__ void __launch_bounds__(Tune::kThreads)
    compact_kernel(KvCacheView<T, Id> view, CompactParams p) {
  constexpr int kThreads = Tune::kThreads;
  constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));
  constexpr int kVecs = HeadDim / kVecElems;               // 16-byte vectors per head vector
  constexpr int kRowVecs = 2 * kVecs;                      // K and V of one token
  static_assert(kParts == compact_parts<HeadDim, T>(kParts, kVecsPerThread), "use compact_parts()");
  constexpr int kPartVecs = kRowVecs / kParts;             // vectors per token of this CTA's part
  constexpr int kTokenLanes = kThreads / kPartVecs;        // tokens one pass of the CTA covers
  constexpr int kChunk = kTokenLanes * kVecsPerThread;     // destinations per chunk
  static_assert(kThreads % kPartVecs == 0, "a CTA must cover whole parts of a token");
  static_assert(kChunk <= kThreads, "one thread resolves at most one token of a chunk");

  // Element offsets (in the range) of each chunk token's source and destination; -1 = no move.
  // Three buffers: chunk c's offsets are written during chunk c-1 (their lookups overlap chunk
  // c-1's data loads) and read until chunk c's stores; the buffer written during chunk c was last
  // read by chunk c-2's stores, which every thread finished before the barrier of chunk c-1.
  __shared__ std::int64_t s_src[3][kChunk];
  __shared__ std::int64_t s_dst[3][kChunk];

  const int heads = view.block.num_kv_heads;
  const int layer = static_cast<int>(blockIdx.x) / heads;
  const int head = static_cast<int>(blockIdx.x) % heads;
  const int b = static_cast<int>(blockIdx.y);
  detail::griddep_wait();  // the plan (a round's select writes it) and the cache
  const int seq = p.seq_ids[b];
  const int keep = p.keep[b];
  if (seq < 0 || keep <= 0) return;  // padding entry; uniform over the CTA, so no barrier is split
  const std::int32_t* row = p.kept + ((static_cast<std::int64_t>(b) * view.num_layers + layer) * heads + head) * p.max_keep;
  const Id* table = view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq;
  const int bs = view.block.block_size;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane_token = tid / kPartVecs;
  const int col = static_cast<int>(blockIdx.z) * kPartVecs + tid % kPartVecs;  // in [0, kRowVecs)
  // This thread's column: K for col < kVecs, else V; every offset below is relative to it.
  T* const base = view.range(layer, col < kVecs ? KvKind::kKey : KvKind::kValue) + (col % kVecs) * kVecElems;

  // Thread t < kChunk resolves token t of each chunk; its kept index is loaded one chunk early.
  auto resolve = [&](int i, int s, int buf) {
    std::int64_t src = -1, dst = -1;
    if (i < keep && s != i) {
      src = view.block.offset(table[s / bs], s % bs, head);
      dst = view.block.offset(table[i / bs], i % bs, head);
    }
    s_src[buf][tid] = src;
    s_dst[buf][tid] = dst;
  };
  int next_kept = 0;  // kept index of token tid of the chunk after the one being resolved
  if (tid < kChunk) {
    resolve(tid, tid < keep ? row[tid] : 0, 0);
    next_kept = kChunk + tid < keep ? row[kChunk + tid] : 0;
  }
  __syncthreads();

  for (int c0 = 0, buf = 0; c0 < keep; c0 += kChunk, buf = buf == 2 ? 0 : buf + 1) {
    uint4 x[kVecsPerThread];
#pragma unroll
    for (int r = 0; r < kVecsPerThread; ++r) {
      const std::int64_t src = s_src[buf][lane_token + r * kTokenLanes];
      if (src >= 0) x[r] = *reinterpret_cast<const uint4*>(base + src);
    }
    // Offsets of the next chunk while this chunk's loads are in flight.
    const int n0 = c0 + kChunk;
    if (tid < kChunk && n0 < keep) {
      resolve(n0 + tid, next_kept, buf == 2 ? 0 : buf + 1);
      next_kept = n0 + kChunk + tid < keep ? row[n0 + kChunk + tid] : 0;
    }
    // Every thread's reads of this chunk are complete before any of its slots is written, and
    // the next chunk's offsets are visible.
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kVecsPerThread; ++r) {
      const std::int64_t dst = s_dst[buf][lane_token + r * kTokenLanes];
      if (dst >= 0) *reinterpret_cast<uint4*>(base + dst) = x[r];
    }
  }
}

}  // namespace triattn::cuda

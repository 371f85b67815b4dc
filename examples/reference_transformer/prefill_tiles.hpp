// SPDX-License-Identifier: Apache-2.0
// Host-side work split and index math of the tensor-core prefill attention (prefill_attention.cuh),
// in plain C++ so the CPU tests check it (tests/core/test_prefill_tiles.cpp) and the kernel
// calls the same functions.
//
// A CTA takes one tile of consecutive query rows of one sequence and one KV head, and runs all
// `group` query heads of that KV head on it: its kPrefillMmaRows MMA rows are (row, head) pairs,
// m = row * group + head, so each K/V block is staged once per GQA group, not once per head.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/layout.hpp>

namespace triattn_example::gpu {

inline constexpr int kPrefillWarps = 8;
inline constexpr int kPrefillMmaRows = 16 * kPrefillWarps;  // (row, head) pairs of one CTA
inline constexpr int kPrefillKvBlock = 64;                   // KV slots per shared-memory stage
inline constexpr int kPrefillStages = 3;                     // cp.async ring depth (blocks in flight)
inline constexpr int kPrefillMaxGroup = kPrefillMmaRows;     // a CTA holds at least one row

/// Rows [row0, row0 + rows) of the step, all of sequence seq; kv_len = max row_slot + 1.
struct PrefillTile {
  int row0, rows, seq, kv_len;
};

/// Query rows of one tile for GQA group `group` (1..kPrefillMaxGroup): rows * group <= kPrefillMmaRows.
TRIATTN_HOST_DEVICE constexpr int prefill_tile_rows(int group) { return kPrefillMmaRows / group; }

/// MMA row m of a CTA: query row m / group of the tile, query head kv_head * group + m % group.
struct PrefillMmaRow {
  int row, head;
};
TRIATTN_HOST_DEVICE constexpr PrefillMmaRow prefill_mma_row(int m, int group, int kv_head) {
  return PrefillMmaRow{m / group, kv_head * group + m % group};
}

/// KV blocks a tile streams: slots [0, kv_len) in blocks of kPrefillKvBlock.
TRIATTN_HOST_DEVICE constexpr int prefill_kv_blocks(int kv_len) { return (kv_len + kPrefillKvBlock - 1) / kPrefillKvBlock; }

/// Slot staged in row r of the block starting at n0: slots past kv_len repeat the last one (finite,
/// masked out), so nothing past the tile's slots, or past its block table, is read.
TRIATTN_HOST_DEVICE constexpr int prefill_stage_slot(int n0, int r, int kv_len) {
  return n0 + r < kv_len ? n0 + r : kv_len - 1;
}

/// The copy of one staged block: thread tid (of kPrefillWarps * 32) copies 16-byte chunk
/// prefill_copy_chunk(tid, d) of rows prefill_copy_row(tid, i, d), i < prefill_copy_iters(d).
TRIATTN_HOST_DEVICE constexpr int prefill_copy_chunk(int tid, int d) { return tid % (d / 8); }
TRIATTN_HOST_DEVICE constexpr int prefill_copy_row(int tid, int i, int d) {
  return tid / (d / 8) + i * (kPrefillWarps * 32 / (d / 8));
}
TRIATTN_HOST_DEVICE constexpr int prefill_copy_iters(int d) { return kPrefillKvBlock / (kPrefillWarps * 32 / (d / 8)); }

/// Element offset, from its K or V range, of 16-byte chunk c of KV head kvh at slot `slot`, on
/// page `page` (the block table's entry for slot / block_size).
TRIATTN_HOST_DEVICE std::int64_t prefill_chunk_offset(const triattn::BlockLayout& b, int page, int slot, int kvh, int c) {
  return b.offset(page, slot % b.block_size, kvh) + c * 8;
}

/// Whether a warp whose rows see slots up to [lim_min, lim_max] works on the block at n0 (some
/// row sees a slot of it) and whether it must mask (some slot of it is past some row's limit).
TRIATTN_HOST_DEVICE constexpr bool prefill_block_active(int n0, int lim_max) { return n0 <= lim_max; }
TRIATTN_HOST_DEVICE constexpr bool prefill_block_masked(int n0, int lim_min) { return n0 + kPrefillKvBlock - 1 > lim_min; }

/// 16-byte chunk index of chunk c of row r in a [kPrefillKvBlock x d] shared-memory tile (d / 8
/// chunks a row): chunks XOR (r % 8), so the 8 rows one ldmatrix matrix reads (same c, 8
/// consecutive r) fall in 8 distinct 16-byte bank groups.
TRIATTN_HOST_DEVICE constexpr int prefill_smem_chunk(int r, int c, int d) { return r * (d / 8) + (c ^ (r & 7)); }

/// Tiles of the step's rows (row_seq / row_slot per row) for GQA group `group`: runs of
/// consecutive rows of one sequence, cut every prefill_tile_rows(group) rows; longest kv_len
/// first, so the CTAs with the most work start in the first wave.
inline std::vector<PrefillTile> build_prefill_tiles(const std::int32_t* row_seq, const std::int32_t* row_slot, int n,
                                                    int group) {
  const int cap = group >= 1 && group <= kPrefillMaxGroup ? prefill_tile_rows(group) : 1;
  std::vector<PrefillTile> tiles;
  for (int r = 0; r < n; ++r) {
    PrefillTile* t = tiles.empty() ? nullptr : &tiles.back();
    if (t == nullptr || t->seq != row_seq[r] || t->rows == cap) {
      tiles.push_back(PrefillTile{r, 0, row_seq[r], 0});
      t = &tiles.back();
    }
    ++t->rows;
    t->kv_len = std::max(t->kv_len, row_slot[r] + 1);
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const PrefillTile& a, const PrefillTile& b) { return a.kv_len > b.kv_len; });
  return tiles;
}

}  // namespace triattn_example::gpu

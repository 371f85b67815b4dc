// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The index math of the tensor-core prefill attention (examples/reference_transformer/
// prefill_tiles.hpp), on the CPU; the GPU test (tests/cuda/test_prefill_attention.cu) checks the
// kernel's numbers.
//   * tiles: for GQA groups 1..12, 16, 64 and 128 and ragged interleaved rows, every row is in
//     exactly one tile of consecutive rows of one sequence, a tile's (row, head) pairs fit one
//     CTA's 128 MMA rows and map one-to-one onto the query heads of its KV head, kv_len is the
//     tile's largest slot + 1, the longest tiles come first.
//   * staging: the copy threads cover every (row, chunk) of a block once; the staged slots of a
//     tile's blocks are [0, kv_len) in order, then repeats of kv_len - 1 (never a slot past the
//     tile); the chunk offsets equal KvCacheView::token's on shuffled tables, pages of 16 and 64,
//     NHD and HND.
//   * causal limits: a warp works on exactly the blocks holding a slot one of its rows sees and
//     skips the mask only where no slot of the block is past any row's limit or past kv_len.
//   * the shared-memory swizzle is a bijection, and the 8 rows of each ldmatrix matrix (K
//     fragments and transposed V fragments) fall in 8 distinct 16-byte bank groups.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <triattn/core/kv_view.hpp>

#include <reference_transformer/prefill_tiles.hpp>

namespace gpu = triattn_example::gpu;

TEST_CASE("prefill tiles: every (row and query head) pair of a step is one MMA row of one CTA within 128") {
  // Ragged rows: seq 0's 300 rows split around seqs 1 (7 rows) and 2 (1 row), seq 3's 45 rows
  // after 700 cached slots.
  std::vector<std::int32_t> seq, slot;
  auto add = [&](int s, int before, int i0, int i1) {
    for (int i = i0; i < i1; ++i) {
      seq.push_back(s);
      slot.push_back(before + i);
    }
  };
  add(0, 0, 0, 150);
  add(1, 33, 0, 7);
  add(2, 5, 0, 1);
  add(0, 0, 150, 300);
  add(3, 700, 0, 45);
  const int n = static_cast<int>(seq.size());
  for (const int group : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 64, 128}) {
    INFO("group " << group);
    const std::vector<gpu::PrefillTile> tiles = gpu::build_prefill_tiles(seq.data(), slot.data(), n, group);
    std::vector<int> seen(static_cast<std::size_t>(n), 0);
    for (std::size_t i = 0; i < tiles.size(); ++i) {
      const gpu::PrefillTile& t = tiles[i];
      REQUIRE(t.rows >= 1);
      CHECK(t.rows * group <= gpu::kPrefillMmaRows);
      if (i > 0) CHECK(tiles[i - 1].kv_len >= t.kv_len);
      int kv_len = 0;
      for (int r = t.row0; r < t.row0 + t.rows; ++r) {
        CHECK(seq[static_cast<std::size_t>(r)] == t.seq);
        ++seen[static_cast<std::size_t>(r)];
        kv_len = std::max(kv_len, slot[static_cast<std::size_t>(r)] + 1);
      }
      CHECK(t.kv_len == kv_len);
      for (const int kvh : {0, 2}) {
        std::set<std::pair<int, int>> pairs;
        for (int m = 0; m < t.rows * group; ++m) {
          const gpu::PrefillMmaRow mr = gpu::prefill_mma_row(m, group, kvh);
          CHECK(mr.row >= 0);
          CHECK(mr.row < t.rows);
          CHECK(mr.head / group == kvh);
          pairs.insert({mr.row, mr.head});
        }
        CHECK(static_cast<int>(pairs.size()) == t.rows * group);
      }
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int x) { return x == 1; }));
  }
}

TEST_CASE("prefill tiles: a tile stages slots 0..kv_len-1 through the block table and nothing past them") {
  for (const int d : {64, 128}) {
    // Thread -> (row, chunk) of a staged block: one-to-one.
    std::vector<int> hits(static_cast<std::size_t>(gpu::kPrefillKvBlock * (d / 8)), 0);
    for (int tid = 0; tid < gpu::kPrefillWarps * 32; ++tid)
      for (int i = 0; i < gpu::prefill_copy_iters(d); ++i) {
        const int r = gpu::prefill_copy_row(tid, i, d), c = gpu::prefill_copy_chunk(tid, d);
        REQUIRE(r >= 0);
        REQUIRE(r < gpu::kPrefillKvBlock);
        ++hits[static_cast<std::size_t>(r * (d / 8) + c)];
      }
    CHECK(std::all_of(hits.begin(), hits.end(), [](int x) { return x == 1; }));
  }

  std::mt19937_64 rng(7);
  for (const int bs : {16, 64})
    for (const triattn::KvLayout layout : {triattn::KvLayout::kNHD, triattn::KvLayout::kHND}) {
      constexpr int kHeads = 3, kD = 64, kLen = 1000;
      const triattn::BlockLayout bl(layout, bs, kHeads, kD);
      const int blocks = (kLen + bs - 1) / bs;
      std::vector<std::int32_t> table(static_cast<std::size_t>(blocks));
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng);
      const std::vector<std::int32_t> lens = {kLen};
      std::vector<std::uint16_t> pool(2 * static_cast<std::size_t>(blocks) * static_cast<std::size_t>(bl.block_elems()));
      const auto view = triattn::KvCacheView<std::uint16_t, std::int32_t>::contiguous(
          pool.data(), static_cast<std::int64_t>(blocks) * bl.block_elems(), bl, 1, blocks, 1, blocks, table.data(),
          lens.data());
      for (const int kv_len : {1, 15, 63, 64, 65, 300, kLen}) {
        INFO("page " << bs << ", kv_len " << kv_len);
        int next = 0;  // the slot the next in-range staged row must hold
        for (int blk = 0; blk < gpu::prefill_kv_blocks(kv_len); ++blk)
          for (int r = 0; r < gpu::kPrefillKvBlock; ++r) {
            const int s = gpu::prefill_stage_slot(blk * gpu::kPrefillKvBlock, r, kv_len);
            REQUIRE(s >= 0);
            REQUIRE(s < kv_len);
            if (blk * gpu::kPrefillKvBlock + r < kv_len) CHECK(s == next++);
            else CHECK(s == kv_len - 1);
            for (const int kvh : {0, kHeads - 1})
              for (const int c : {0, kD / 8 - 1}) {
                const std::int64_t off = gpu::prefill_chunk_offset(view.block, table[static_cast<std::size_t>(s / bs)], s, kvh, c);
                CHECK(view.range(0, triattn::KvKind::kValue) + off == view.token(0, triattn::KvKind::kValue, 0, s, kvh) + 8 * c);
              }
          }
        CHECK(next == kv_len);
        CHECK(gpu::prefill_kv_blocks(kv_len) * gpu::kPrefillKvBlock >= kv_len);
        CHECK((gpu::prefill_kv_blocks(kv_len) - 1) * gpu::kPrefillKvBlock < kv_len);
      }
    }
}

TEST_CASE("prefill tiles: a warp works on exactly the blocks its rows see and masks every block crossing a limit") {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> lim_d(0, 700);
  for (int trial = 0; trial < 2000; ++trial) {
    // A warp's rows: limits within a tile whose kv_len is at least the warp's largest limit + 1.
    int lo = lim_d(rng), hi = lim_d(rng);
    if (lo > hi) std::swap(lo, hi);
    const int kv_len = hi + 1 + (trial % 3 == 0 ? 0 : lim_d(rng) % 200);
    for (int blk = 0; blk < gpu::prefill_kv_blocks(kv_len); ++blk) {
      const int n0 = blk * gpu::kPrefillKvBlock;
      const bool active = gpu::prefill_block_active(n0, hi);
      bool some_seen = false, all_seen = true;
      for (int t = n0; t < n0 + gpu::kPrefillKvBlock; ++t) {
        some_seen = some_seen || t <= hi;
        all_seen = all_seen && t <= lo && t < kv_len;
      }
      CHECK(active == some_seen);
      if (!gpu::prefill_block_masked(n0, lo)) CHECK(all_seen);
      if (all_seen) CHECK_FALSE(gpu::prefill_block_masked(n0, lo));
    }
  }
}

TEST_CASE("prefill tiles: the shared-memory swizzle is a bijection free of ldmatrix bank conflicts") {
  for (const int d : {64, 128}) {
    INFO("head_dim " << d);
    const int cpr = d / 8;
    std::vector<int> hits(static_cast<std::size_t>(gpu::kPrefillKvBlock * cpr), 0);
    for (int r = 0; r < gpu::kPrefillKvBlock; ++r)
      for (int c = 0; c < cpr; ++c) {
        const int x = gpu::prefill_smem_chunk(r, c, d);
        REQUIRE(x >= r * cpr);
        REQUIRE(x < (r + 1) * cpr);  // stays in its row: a row is one contiguous head vector
        ++hits[static_cast<std::size_t>(x)];
      }
    CHECK(std::all_of(hits.begin(), hits.end(), [](int x) { return x == 1; }));
    // One ldmatrix matrix reads chunk c of 8 consecutive rows from a multiple of 8 (K: slots
    // 8j.., V: slots 16ks + 0 / 8 ..): 8 distinct 16-byte bank groups (chunk index mod 8).
    for (int r0 = 0; r0 < gpu::kPrefillKvBlock; r0 += 8)
      for (int c = 0; c < cpr; ++c) {
        std::set<int> groups;
        for (int r = r0; r < r0 + 8; ++r) groups.insert(gpu::prefill_smem_chunk(r, c, d) % 8);
        CHECK(groups.size() == 8);
      }
  }
}

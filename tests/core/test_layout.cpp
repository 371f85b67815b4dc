// SPDX-License-Identifier: Apache-2.0
// layout.hpp / kv_view.hpp: BlockLayout offsets are a bijection onto [0, num_blocks * block_elems)
// for NHD and HND and many geometries (non-power-of-two block sizes included), token_stride is
// the real distance between consecutive tokens, and KvCacheView addresses what the layout says.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/layout.hpp>

using namespace triattn;

namespace {

/// Offset of (block, slot, head, dim) from the layouts' definitions, written independently.
std::int64_t expected_offset(KvLayout l, int bs, int heads, int dim, std::int64_t block, int slot, int head, int d) {
  if (l == KvLayout::kNHD) return ((block * bs + slot) * heads + head) * dim + d;  // [block][slot][head][dim]
  return ((block * heads + head) * bs + slot) * dim + d;                             // [block][head][slot][dim]
}

struct Geometry {
  int block_size, heads, head_dim, num_blocks;
};

}  // namespace

TEST_SUITE("core") {

TEST_CASE("layout: names") {
  CHECK(std::string(layout_name(KvLayout::kNHD)) == "NHD");
  CHECK(std::string(layout_name(KvLayout::kHND)) == "HND");
}

TEST_CASE("layout: offsets of both layouts tile num_blocks x block_elems exactly") {
  std::vector<Geometry> geos;
  for (int bs : {1, 3, 7, 16})
    for (int heads : {1, 2, 3, 8})
      for (int dim : {1, 2, 6, 64})
        for (int nb : {1, 5}) geos.push_back({bs, heads, dim, nb});
  int checked = 0;
  for (KvLayout l : {KvLayout::kNHD, KvLayout::kHND}) {
    for (const Geometry& g : geos) {
      CAPTURE(layout_name(l));
      CAPTURE(g.block_size);
      CAPTURE(g.heads);
      CAPTURE(g.head_dim);
      CAPTURE(g.num_blocks);
      const BlockLayout bl{l, g.block_size, g.heads, g.head_dim};
      REQUIRE(bl.block_elems() == std::int64_t{g.block_size} * g.heads * g.head_dim);
      const std::int64_t total = bl.block_elems() * g.num_blocks;
      std::vector<int> hits(static_cast<std::size_t>(total), 0);
      bool in_range = true, formula = true, stride_ok = true, head_vec_in_block = true;
      for (int b = 0; b < g.num_blocks; ++b)
        for (int s = 0; s < g.block_size; ++s)
          for (int h = 0; h < g.heads; ++h) {
            const std::int64_t o = bl.offset(b, s, h);
            if (o != expected_offset(l, g.block_size, g.heads, g.head_dim, b, s, h, 0)) formula = false;
            // The whole head vector lies inside block b.
            if (o < b * bl.block_elems() || o + g.head_dim > (b + 1) * bl.block_elems()) head_vec_in_block = false;
            if (s + 1 < g.block_size && bl.offset(b, s + 1, h) - o != bl.token_stride()) stride_ok = false;
            for (int d = 0; d < g.head_dim; ++d) {
              const std::int64_t e = o + d;
              if (e < 0 || e >= total) {
                in_range = false;
                continue;
              }
              ++hits[static_cast<std::size_t>(e)];
            }
          }
      CHECK(in_range);
      CHECK(formula);
      CHECK(stride_ok);
      CHECK(head_vec_in_block);
      int zero = 0, multi = 0;
      for (int c : hits) {
        zero += c == 0;
        multi += c > 1;
      }
      CHECK(zero == 0);   // every element is some (block, slot, head, dim)
      CHECK(multi == 0);  // and only one
      ++checked;
    }
  }
  CHECK(checked == 2 * 4 * 4 * 4 * 2);
}

TEST_CASE("layout: token_stride and head stride per layout") {
  const BlockLayout nhd{KvLayout::kNHD, 7, 3, 6};
  const BlockLayout hnd{KvLayout::kHND, 7, 3, 6};
  CHECK(nhd.token_stride() == 3 * 6);
  CHECK(hnd.token_stride() == 6);
  // Consecutive heads of one token: adjacent in NHD, block_size tokens apart in HND.
  CHECK(nhd.offset(2, 4, 1) - nhd.offset(2, 4, 0) == 6);
  CHECK(hnd.offset(2, 4, 1) - hnd.offset(2, 4, 0) == 7 * 6);
  CHECK(nhd.offset(2, 0, 0) == 2 * 7 * 3 * 6);
  CHECK(hnd.offset(2, 0, 0) == 2 * 7 * 3 * 6);
  // Large block ids do not overflow 32 bits.
  const BlockLayout big{KvLayout::kHND, 16, 8, 128};
  CHECK(big.offset(1'000'000, 15, 7) == std::int64_t{1'000'000} * 16 * 8 * 128 + (7 * 16 + 15) * 128);
}

TEST_CASE("layout: CacheConfig derived sizes") {
  CacheConfig c;
  c.model = ModelGeometry{3, 8, 2, 6};
  c.block_size = 7;
  c.num_blocks = 11;
  c.max_seqs = 4;
  c.layout = KvLayout::kHND;
  c.dtype = DType::kF16;
  CHECK(c.model.group_size() == 4);
  CHECK(c.blocks_per_seq() == 11);
  c.max_blocks_per_seq = 5;
  CHECK(c.blocks_per_seq() == 5);
  const BlockLayout bl = c.block_layout();
  CHECK(bl.is(KvLayout::kHND));
  CHECK(!bl.is(KvLayout::kNHD));
  CHECK(bl.block_size == 7);
  CHECK(bl.num_kv_heads == 2);
  CHECK(bl.head_dim == 6);
  CHECK(c.block_bytes() == 7 * 2 * 6 * 2);
  CHECK(c.token_bytes() == 2 * 3 * 2 * 6 * 2);
  CHECK(c.block_bytes_all_ranges() == 2 * 3 * c.block_bytes());
  c.dtype = DType::kF32;
  CHECK(c.block_bytes() == 7 * 2 * 6 * 4);
  CHECK(c.token_bytes() == 2 * 3 * 2 * 6 * 4);
}

TEST_CASE("layout: KvCacheView addresses range and block table entry and slot and head as the layout says") {
  for (KvLayout l : {KvLayout::kNHD, KvLayout::kHND}) {
    CAPTURE(layout_name(l));
    const int L = 2, H = 3, D = 4, bs = 3, nb = 5, max_seqs = 2, mbps = 4;
    const BlockLayout bl{l, bs, H, D};
    const std::int64_t range_stride = bl.block_elems() * nb + 8;  // padded ranges are allowed
    std::vector<float> mem(static_cast<std::size_t>(range_stride * 2 * L));
    // seq 0 uses blocks 4, 1, 3; seq 1 uses block 0.
    const std::vector<std::int32_t> tables = {4, 1, 3, -1, 0, -1, -1, -1};
    const std::vector<std::int32_t> lens = {8, 2};
    const auto v = KvCacheView<float>::contiguous(mem.data(), range_stride, bl, L, nb, max_seqs, mbps, tables.data(),
                                                  lens.data());
    bool ok = true;
    for (int layer = 0; layer < L; ++layer)
      for (int kind = 0; kind < 2; ++kind) {
        if (v.range(layer, static_cast<KvKind>(kind)) != mem.data() + (2 * layer + kind) * range_stride) ok = false;
        for (int seq = 0; seq < max_seqs; ++seq)
          for (int slot = 0; slot < lens[static_cast<std::size_t>(seq)]; ++slot)
            for (int h = 0; h < H; ++h) {
              const int block = tables[static_cast<std::size_t>(seq * mbps + slot / bs)];
              if (v.block_of(seq, slot) != block) ok = false;
              const float* want = mem.data() + (2 * layer + kind) * range_stride +
                                  expected_offset(l, bs, H, D, block, slot % bs, h, 0);
              if (v.token(layer, static_cast<KvKind>(kind), seq, slot, h) != want) ok = false;
            }
      }
    CHECK(ok);
  }
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// Tensor-parallel slicing: each rank's share is contiguous, shares tile the full head set in
// rank order for every layer, first_q_head is set, and invalid TP layouts are refused naming the
// offending values.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>

namespace {

const triattn::QueryStats& qwen() {
  static const triattn::QueryStats s =
      triattn::load_pt_stats(std::string(TRIATTN_SHARED_DATA_DIR) + "/calibration/qwen3_8b.pt");
  return s;
}

bool same_head(const triattn::QueryStats& a, int la, int ha, const triattn::QueryStats& b, int lb, int hb) {
  const std::size_t bytes = static_cast<std::size_t>(a.num_freqs()) * sizeof(float);
  return std::memcmp(a.mean_real(la, ha), b.mean_real(lb, hb), bytes) == 0 &&
         std::memcmp(a.mean_imag(la, ha), b.mean_imag(lb, hb), bytes) == 0 &&
         std::memcmp(a.abs_mean(la, ha), b.abs_mean(lb, hb), bytes) == 0;
}

}  // namespace

TEST_SUITE("stats") {

TEST_CASE("stats: rank shares are contiguous and tile the full head set") {
  const auto& full = qwen();
  for (const int tp : {1, 2, 4, 8}) {
    CAPTURE(tp);
    std::vector<int> owner(full.num_q_heads, -1);  // [num_q_heads] rank holding each global head
    for (int rank = 0; rank < tp; ++rank) {
      const auto part = triattn::slice_for_rank(full, rank, tp, 8);
      CHECK(part.num_q_heads == full.num_q_heads / tp);
      CHECK(part.first_q_head == rank * full.num_q_heads / tp);
      CHECK(part.num_layers == full.num_layers);
      CHECK(part.head_dim == full.head_dim);
      CHECK(part.model_name == full.model_name);
      CHECK(part.q_mean_real.size() == full.q_mean_real.size() / tp);
      for (int h = 0; h < part.num_q_heads; ++h) {
        const int global = part.first_q_head + h;
        CHECK(owner[global] == -1);
        owner[global] = rank;
        for (int l = 0; l < full.num_layers; ++l) CHECK(same_head(part, l, h, full, l, global));
      }
    }
    for (int h = 0; h < full.num_q_heads; ++h) CHECK(owner[h] == h / (full.num_q_heads / tp));
  }
}

TEST_CASE("stats: slice_query_heads composes and keeps global head numbers") {
  const auto& full = qwen();
  const auto a = triattn::slice_query_heads(full, 8, 16);  // global 8..23
  const auto b = triattn::slice_query_heads(a, 4, 4);      // global 12..15
  CHECK(a.first_q_head == 8);
  CHECK(b.first_q_head == 12);
  CHECK(b.num_q_heads == 4);
  for (int l = 0; l < full.num_layers; ++l)
    for (int h = 0; h < 4; ++h) CHECK(same_head(b, l, h, full, l, 12 + h));
  const auto whole = triattn::slice_query_heads(full, 0, full.num_q_heads);
  CHECK(whole.q_abs_mean == full.q_abs_mean);
}

TEST_CASE("stats: bad TP layouts and head ranges are refused naming the values") {
  const auto& full = qwen();
  CHECK_THROWS_WITH_AS(triattn::slice_for_rank(full, 0, 3, 8), doctest::Contains("num_q_heads 32 is not divisible by tp 3"),
                       triattn::logic_error);
  CHECK_THROWS_WITH_AS(triattn::slice_for_rank(full, 0, 16, 8),
                       doctest::Contains("num_kv_heads 8 is not divisible by tp 16"), triattn::logic_error);
  CHECK_THROWS_WITH_AS(triattn::slice_for_rank(full, 4, 4, 8), doctest::Contains("rank must be in [0, tp)"),
                       triattn::logic_error);
  CHECK_THROWS_WITH_AS(triattn::slice_for_rank(full, 0, 0, 8), doctest::Contains("tp must be >= 1"), triattn::logic_error);
  CHECK_THROWS_WITH_AS(triattn::slice_for_rank(full, 0, 2, 5),
                       doctest::Contains("num_q_heads 32 is not a multiple of num_kv_heads 5"), triattn::logic_error);
  const auto part = triattn::slice_for_rank(full, 1, 2, 8);
  CHECK_THROWS_WITH_AS(triattn::slice_for_rank(part, 0, 2, 4), doctest::Contains("already a slice starting at head 16"),
                       triattn::logic_error);
  CHECK_THROWS_WITH_AS(triattn::slice_query_heads(full, 30, 4), doctest::Contains("heads [30, 34)"), triattn::logic_error);
  CHECK_THROWS_AS(triattn::slice_query_heads(full, -1, 2), triattn::logic_error);
  CHECK_THROWS_AS(triattn::slice_query_heads(full, 0, 0), triattn::logic_error);
  triattn::QueryStats broken = full;
  broken.q_mean_imag.resize(3);
  CHECK_THROWS_WITH_AS(triattn::slice_query_heads(broken, 0, 1), doctest::Contains("holds 3 values"), triattn::logic_error);
}

}  // TEST_SUITE

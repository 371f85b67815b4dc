// SPDX-License-Identifier: Apache-2.0
// Calibrator: streaming means over chunked, layer-shuffled input equal an independent float64
// computation exactly, for both RoPE pairings; argument errors; save/load round trip; and the
// per-layer concentration summary on inputs whose R is known.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>

namespace {

constexpr int kLayers = 3, kHeads = 4, kHeadDim = 16, kFreqs = kHeadDim / 2, kTokens = 37;

// queries[layer] is [kTokens, kHeads, kHeadDim]; biased so that means are far from zero.
std::vector<std::vector<float>> make_queries(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<std::vector<float>> q(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    q[l].resize(static_cast<std::size_t>(kTokens) * kHeads * kHeadDim);
    for (std::size_t i = 0; i < q[l].size(); ++i) q[l][i] = noise(rng) + 0.3f * static_cast<float>(i % kHeadDim) - 2.0f;
  }
  return q;
}

// Independent reference: plain loops, float64 sums in token order, one division, one cast.
triattn::QueryStats reference(const std::vector<std::vector<float>>& q, triattn::RopeStyle style) {
  triattn::QueryStats s;
  s.num_layers = kLayers;
  s.num_q_heads = kHeads;
  s.head_dim = kHeadDim;
  s.rope_style = style;
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kHeads; ++h) {
      for (int f = 0; f < kFreqs; ++f) {
        double sr = 0, si = 0, sa = 0;
        for (int t = 0; t < kTokens; ++t) {
          const float* x = q[l].data() + (static_cast<std::size_t>(t) * kHeads + h) * kHeadDim;
          const double re = style == triattn::RopeStyle::kHalf ? x[f] : x[2 * f];
          const double im = style == triattn::RopeStyle::kHalf ? x[f + kFreqs] : x[2 * f + 1];
          sr += re;
          si += im;
          sa += std::sqrt(re * re + im * im);
        }
        s.q_mean_real.push_back(static_cast<float>(sr / kTokens));
        s.q_mean_imag.push_back(static_cast<float>(si / kTokens));
        s.q_abs_mean.push_back(static_cast<float>(sa / kTokens));
      }
    }
  }
  return s;
}

// Feeds every layer in chunks (sizes 5, 0, 12, rest), interleaving layers in a shuffled order
// while keeping each layer's own token order.
void feed_shuffled(triattn::Calibrator& cal, const std::vector<std::vector<float>>& q, std::uint64_t seed) {
  const int chunks[] = {5, 0, 12, kTokens - 17};
  std::vector<int> events;  // one entry per (layer, chunk), in layer-chunk order per layer
  for (int l = 0; l < kLayers; ++l)
    for (int c = 0; c < 4; ++c) events.push_back(l);
  std::mt19937_64 rng(seed);
  std::shuffle(events.begin(), events.end(), rng);
  std::vector<int> next_chunk(kLayers, 0), next_token(kLayers, 0);
  for (const int l : events) {
    const int n = chunks[next_chunk[l]++];
    cal.add(l, q[l].data() + static_cast<std::size_t>(next_token[l]) * kHeads * kHeadDim, n);
    next_token[l] += n;
  }
  for (int l = 0; l < kLayers; ++l) REQUIRE(next_token[l] == kTokens);
}

}  // namespace

TEST_SUITE("stats") {

TEST_CASE("stats: calibrator means equal an independent float64 computation exactly for both pairings") {
  const auto q = make_queries(3);
  for (const auto style : {triattn::RopeStyle::kHalf, triattn::RopeStyle::kInterleaved}) {
    CAPTURE(static_cast<int>(style));
    triattn::Calibrator cal(kLayers, kHeads, kHeadDim, style, "test/model");
    feed_shuffled(cal, q, 100 + static_cast<int>(style));
    for (int l = 0; l < kLayers; ++l) CHECK(cal.token_count(l) == kTokens);
    const triattn::QueryStats got = cal.finish();
    const triattn::QueryStats want = reference(q, style);
    CHECK(got.model_name == "test/model");
    CHECK(got.rope_style == style);
    CHECK(got.num_layers == kLayers);
    CHECK(got.num_q_heads == kHeads);
    CHECK(got.head_dim == kHeadDim);
    CHECK(got.first_q_head == 0);
    CHECK(got.q_mean_real == want.q_mean_real);
    CHECK(got.q_mean_imag == want.q_mean_imag);
    CHECK(got.q_abs_mean == want.q_abs_mean);
    // The two pairings really differ on this input.
    CHECK(got.q_mean_imag != reference(q, style == triattn::RopeStyle::kHalf ? triattn::RopeStyle::kInterleaved
                                                                           : triattn::RopeStyle::kHalf)
                                 .q_mean_imag);
  }
}

TEST_CASE("stats: calibrator pairing: one non-zero coordinate lands where the style says") {
  std::vector<float> q(static_cast<std::size_t>(kHeads) * kHeadDim, 0.0f);  // one token
  q[1] = 3.0f;  // head 0, coordinate 1
  triattn::Calibrator half(1, kHeads, kHeadDim, triattn::RopeStyle::kHalf, "m");
  triattn::Calibrator inter(1, kHeads, kHeadDim, triattn::RopeStyle::kInterleaved, "m");
  half.add(0, q.data(), 1);
  inter.add(0, q.data(), 1);
  const auto h = half.finish(), i = inter.finish();
  CHECK(h.mean_real(0, 0)[1] == 3.0f);  // half: z_1 = (x[1], x[1 + F])
  CHECK(h.mean_imag(0, 0)[1] == 0.0f);
  CHECK(i.mean_real(0, 0)[0] == 0.0f);  // interleaved: z_0 = (x[0], x[1])
  CHECK(i.mean_imag(0, 0)[0] == 3.0f);
  CHECK(i.abs_mean(0, 0)[0] == 3.0f);
}

TEST_CASE("stats: calibrator argument errors leave the sums untouched") {
  const auto q = make_queries(5);
  triattn::Calibrator cal(kLayers, kHeads, kHeadDim, triattn::RopeStyle::kHalf, "m");
  cal.add(0, q[0].data(), kTokens);
  cal.add(1, q[1].data(), kTokens);
  CHECK_THROWS_WITH_AS(cal.finish(), doctest::Contains("layer 2 received no tokens"), triattn::logic_error);
  cal.add(2, q[2].data(), kTokens);
  const auto before = cal.finish();
  CHECK_THROWS_WITH_AS(cal.add(3, q[0].data(), 1), doctest::Contains("layer 3 is outside [0, 3)"), triattn::logic_error);
  CHECK_THROWS_AS(cal.add(-1, q[0].data(), 1), triattn::logic_error);
  CHECK_THROWS_AS(cal.add(0, q[0].data(), -1), triattn::logic_error);
  CHECK_THROWS_AS(cal.add(0, nullptr, 1), triattn::logic_error);
  std::vector<float> bad(q[0].begin(), q[0].begin() + 2 * kHeads * kHeadDim);
  bad[kHeads * kHeadDim + 2 * kHeadDim + 5] = std::numeric_limits<float>::quiet_NaN();  // token 1, head 2, dim 5
  CHECK_THROWS_WITH_AS(cal.add(0, bad.data(), 2), doctest::Contains("token 1 head 2 dim 5 is not finite"),
                       triattn::logic_error);
  cal.add(0, q[0].data(), 0);  // zero tokens: a no-op
  const auto after = cal.finish();
  CHECK(after.q_mean_real == before.q_mean_real);
  CHECK(after.q_abs_mean == before.q_abs_mean);
  CHECK(cal.token_count(0) == kTokens);
  CHECK_THROWS_AS(triattn::Calibrator(0, 4, 16, triattn::RopeStyle::kHalf, "m"), triattn::logic_error);
  CHECK_THROWS_WITH_AS(triattn::Calibrator(2, 4, 15, triattn::RopeStyle::kHalf, "m"), doctest::Contains("head_dim 15"),
                       triattn::logic_error);
}

TEST_CASE("stats: calibrator save writes loadable safetensors") {
  const auto q = make_queries(9);
  triattn::Calibrator cal(kLayers, kHeads, kHeadDim, triattn::RopeStyle::kInterleaved, "calibrated/model");
  for (int l = 0; l < kLayers; ++l) cal.add(l, q[l].data(), kTokens);
  const auto path = std::filesystem::temp_directory_path() /
                    ("triattn_test_calib_" + std::to_string(std::random_device{}()) + ".safetensors");
  cal.save(path.string());
  triattn::StatsExpectation expect;
  expect.num_layers = kLayers;
  expect.num_q_heads = kHeads;
  expect.head_dim = kHeadDim;
  expect.rope_style = triattn::RopeStyle::kInterleaved;
  const auto back = triattn::load_safetensors_stats(path.string(), expect);
  std::filesystem::remove(path);
  const auto direct = cal.finish();
  CHECK(back.model_name == "calibrated/model");
  CHECK(back.q_mean_real == direct.q_mean_real);
  CHECK(back.q_mean_imag == direct.q_mean_imag);
  CHECK(back.q_abs_mean == direct.q_abs_mean);
}

TEST_CASE("stats: concentration summary: R is 1 for a fixed direction and 0 for cancelling ones") {
  // Layer 0: every token identical (R = 1). Layer 1: tokens z and -z alternate (R = 0).
  std::vector<float> same(4u * kHeads * kHeadDim), flip(4u * kHeads * kHeadDim);
  for (std::size_t i = 0; i < same.size(); ++i) {
    same[i] = 0.5f + static_cast<float>(i % kHeadDim);
    flip[i] = (i / (kHeads * kHeadDim)) % 2 == 0 ? same[i] : -same[i];
  }
  triattn::Calibrator cal(2, kHeads, kHeadDim, triattn::RopeStyle::kHalf, "m");
  cal.add(0, same.data(), 4);
  cal.add(1, flip.data(), 4);
  const auto summary = triattn::concentration_by_layer(cal.finish());
  REQUIRE(summary.size() == 2);
  CHECK(summary[0].layer == 0);
  CHECK(summary[0].mean == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(summary[0].min == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(summary[0].max == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(summary[1].mean == 0.0);
  CHECK(summary[1].max == 0.0);

  // On real statistics R lies in [0, 1] (up to float rounding of the stored values).
  const auto real = triattn::load_pt_stats(std::string(TRIATTN_SHARED_DATA_DIR) + "/calibration/qwen3_8b.pt");
  const auto rs = triattn::concentration_by_layer(real);
  REQUIRE(rs.size() == 36);
  for (const auto& c : rs) {
    CHECK(c.min >= 0.0);
    CHECK(c.max <= 1.0 + 1e-5);
    CHECK(c.min <= c.mean);
    CHECK(c.mean <= c.max);
  }
}

}  // TEST_SUITE

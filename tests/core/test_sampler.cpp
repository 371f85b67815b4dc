// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// The reference transformer's Sampler (examples/reference_transformer/sampler.hpp): temperature
// sampling stays a valid distribution for any finite temperature.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <triattn/core/error.hpp>

#include <reference_transformer/sampler.hpp>

namespace ex = triattn_example;

TEST_SUITE("sampler") {

TEST_CASE("Sampler: a tiny temperature picks the largest logit and never overflows into NaN") {
  // logits / 1e-45 overflow to inf; inf - inf = NaN made every draw fall through to the last id.
  const std::vector<std::vector<float>> cases{{1.0f, 3.0f, 2.0f, -1.0f}, {-5.0f, 0.5f, 0.25f}, {10.0f, 9.99f, -3.0f, 0.0f}};
  for (const float t : {std::numeric_limits<float>::denorm_min(), 1e-45f, 1e-30f, 1e-6f}) {
    for (const float top_p : {0.9f, 1.0f}) {
      for (std::uint64_t seed = 0; seed < 20; ++seed) {
        ex::Sampler s(t, top_p, seed);
        for (const std::vector<float>& l : cases) {
          INFO("temperature " << t << " top_p " << top_p << " seed " << seed);
          CHECK(s.sample(l) == ex::Sampler::argmax(l));
        }
      }
    }
  }
}

TEST_CASE("Sampler: a huge temperature samples every token and non-finite logits are refused") {
  ex::Sampler s(1e30f, 1.0f, 3);
  const std::vector<float> l{100.0f, -100.0f, 0.0f, 50.0f};
  std::vector<int> seen(l.size(), 0);
  for (int i = 0; i < 400; ++i) ++seen.at(static_cast<std::size_t>(s.sample(l)));
  for (const int n : seen) CHECK(n > 50);  // about uniform: 100 each
  const std::vector<float> bad{1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  CHECK_THROWS_AS((void)s.sample(bad), triattn::logic_error);
  const std::vector<float> inf{1.0f, std::numeric_limits<float>::infinity()};
  CHECK_THROWS_AS((void)s.sample(inf), triattn::logic_error);
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// Token sampling: greedy (temperature 0) or seeded temperature / top-p (nucleus) sampling. Each
// sequence owns its Sampler, so a sequence samples the same tokens whether it runs alone or in a
// batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <triattn/core/error.hpp>

#include "synthetic.hpp"  // mix64

namespace triattn_example {

class Sampler {
 public:
  /// temperature 0 = greedy argmax, > 0 samples softmax(logits / temperature) (finite for any
  /// finite temperature; a tiny one picks like greedy); top_p in (0, 1) restricts sampling to the
  /// smallest set of most likely tokens whose probability exceeds top_p (1 or more = the full
  /// distribution).
  explicit Sampler(float temperature = 0.0f, float top_p = 1.0f, std::uint64_t seed = 0)
      : temperature_(temperature), top_p_(top_p), state_(mix64(seed) | 1u) {
    TRIATTN_EXPECTS(temperature >= 0.0f && std::isfinite(temperature), "Sampler: temperature must be finite and >= 0");
    TRIATTN_EXPECTS(top_p > 0.0f && std::isfinite(top_p), "Sampler: top_p must be finite and > 0");
  }

  /// Whether sample() is argmax (temperature 0): a device argmax may pick for it.
  [[nodiscard]] bool greedy() const noexcept { return temperature_ == 0.0f; }

  /// Index of the largest value (the first one on ties, as run.c).
  [[nodiscard]] static int argmax(std::span<const float> x) {
    int best = 0;
    for (std::size_t i = 1; i < x.size(); ++i)
      if (x[i] > x[static_cast<std::size_t>(best)]) best = static_cast<int>(i);
    return best;
  }

  [[nodiscard]] int sample(std::span<const float> logits) {
    TRIATTN_EXPECTS(!logits.empty(), "Sampler::sample: no logits");
    if (temperature_ == 0.0f) return argmax(logits);
    // softmax(logits / T) with the largest logit subtracted before the division: every exponent
    // is <= 0 and the largest is exactly 0, so the sum is >= 1 and finite for any T > 0. (Dividing
    // first overflows for a tiny T, e.g. 1e-45: inf - inf = NaN, and every draw fell through to
    // the last id.) A tiny T thus samples like greedy.
    probs_.resize(logits.size());
    const float max_val = *std::max_element(logits.begin(), logits.end());
    float sum = 0.0f;
    for (std::size_t i = 0; i < logits.size(); ++i) {
      probs_[i] = std::exp((logits[i] - max_val) / temperature_);
      sum += probs_[i];
    }
    TRIATTN_EXPECTS(std::isfinite(sum), "Sampler::sample: the logits are not all finite");
    for (float& p : probs_) p /= sum;
    const float r = next_float();
    if (top_p_ >= 1.0f) {
      float cdf = 0.0f;
      for (std::size_t i = 0; i < probs_.size(); ++i) {
        cdf += probs_[i];
        if (r < cdf) return static_cast<int>(i);
      }
      return static_cast<int>(probs_.size()) - 1;  // rounding
    }
    order_.resize(probs_.size());
    for (std::size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int>(i);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int a, int b) { return probs_[static_cast<std::size_t>(a)] > probs_[static_cast<std::size_t>(b)]; });
    float cum = 0.0f;
    std::size_t last = order_.size() - 1;
    for (std::size_t i = 0; i < order_.size(); ++i) {
      cum += probs_[static_cast<std::size_t>(order_[i])];
      if (cum > top_p_) {
        last = i;
        break;
      }
    }
    const float target = r * cum;
    float cdf = 0.0f;
    for (std::size_t i = 0; i <= last; ++i) {
      cdf += probs_[static_cast<std::size_t>(order_[i])];
      if (target < cdf) return order_[i];
    }
    return order_[last];
  }

 private:
  /// xorshift64* in [0, 1), 24 bits.
  float next_float() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    const std::uint64_t v = state_ * 0x2545F4914F6CDD1Dull;
    return static_cast<float>(v >> 40) * (1.0f / 16777216.0f);
  }

  float temperature_;
  float top_p_;
  std::uint64_t state_;
  std::vector<float> probs_;
  std::vector<int> order_;
};

}  // namespace triattn_example

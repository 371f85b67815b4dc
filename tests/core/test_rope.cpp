// SPDX-License-Identifier: Apache-2.0
// Tests of core/rope.hpp: inv_freq for every scaling kind against independently computed values,
// YaRN's attention factor, the pair index maps, and both rotation functions.
#include <doctest/doctest.h>

#include <math.h>  // ::powf, ::cosf, ::sinf for the verbatim llama2.c loop

#include <cmath>
#include <complex>
#include <cstring>
#include <random>
#include <vector>

#include <triattn/core/rope.hpp>

using namespace triattn;

namespace {
RopeConfig plain(double theta, RopeStyle style = RopeStyle::kHalf) {
  RopeConfig c;
  c.style = style;
  c.theta = theta;
  return c;
}
RopeConfig llama3_r1_distill_8b() {
  RopeConfig c = plain(5e5);
  c.scaling.kind = RopeScalingKind::kLlama3;
  c.scaling.factor = 8;
  c.scaling.low_freq_factor = 1;
  c.scaling.high_freq_factor = 4;
  c.scaling.original_max_position = 8192;
  return c;
}
RopeConfig yarn_small() {  // d = 8, θ = 1e4, factor 4, original context 64, betas 32 / 1
  RopeConfig c = plain(1e4);
  c.scaling.kind = RopeScalingKind::kYarn;
  c.scaling.factor = 4;
  c.scaling.original_max_position = 64;
  c.scaling.beta_fast = 32;
  c.scaling.beta_slow = 1;
  return c;
}
}  // namespace

TEST_SUITE("scoring") {
TEST_CASE("rope_inv_freq: plain RoPE is theta^(-2f/d)") {
  for (int d : {2, 8, 64, 128}) {
    for (double theta : {1e4, 5e5, 1e6}) {
      const std::vector<double> w = rope_inv_freq(d, plain(theta));
      REQUIRE(w.size() == static_cast<std::size_t>(d / 2));
      for (int f = 0; f < d / 2; ++f) {
        const double expected = 1.0 / std::pow(theta, static_cast<double>(2 * f) / d);
        CHECK(w[f] == doctest::Approx(expected).epsilon(1e-14));
      }
    }
  }
  // A couple of literal values: θ = 1e4, d = 8 gives 1, 0.1, 0.01, 0.001.
  const std::vector<double> w = rope_inv_freq(8, plain(1e4));
  CHECK(w[0] == 1.0);
  CHECK(w[1] == doctest::Approx(0.1).epsilon(1e-15));
  CHECK(w[2] == doctest::Approx(0.01).epsilon(1e-15));
  CHECK(w[3] == doctest::Approx(0.001).epsilon(1e-15));
}

TEST_CASE("rope_inv_freq: linear scaling divides by the factor") {
  RopeConfig c = plain(1e4);
  c.scaling.kind = RopeScalingKind::kLinear;
  c.scaling.factor = 4;
  const std::vector<double> w = rope_inv_freq(8, c);
  CHECK(w[0] == doctest::Approx(0.25).epsilon(1e-15));
  CHECK(w[1] == doctest::Approx(0.025).epsilon(1e-15));
  CHECK(w[3] == doctest::Approx(0.00025).epsilon(1e-15));
}

TEST_CASE("rope_inv_freq: llama3 scaling of DeepSeek-R1-Distill-Llama-8B") {
  // θ = 5e5, d = 128, factor 8, low 1, high 4, original 8192: high_freq_wavelen = 2048,
  // low_freq_wavelen = 8192. wavelen_f = 2π·5e5^(f/64) is < 2048 for f <= 28 (unchanged),
  // > 8192 for f >= 35 (divided by 8), and in between for f = 29..34 (smooth band).
  // Literal values below were computed separately (Python math, float64) from the HF formula.
  const std::vector<double> w = rope_inv_freq(128, llama3_r1_distill_8b());
  REQUIRE(w.size() == 64u);
  CHECK(w[0] == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(w[10] == doctest::Approx(0.12868737343265052).epsilon(1e-13));   // unchanged
  CHECK(w[28] == doctest::Approx(0.003211445994752591).epsilon(1e-13));  // wavelen 1956.5: unchanged
  CHECK(w[35] == doctest::Approx(0.0007644969883171747 / 8).epsilon(1e-13));  // wavelen 8218.7: /8
  CHECK(w[63] == doctest::Approx(2.455140791131609e-06 / 8).epsilon(1e-13));
  // f = 32: ω = 1/sqrt(5e5) = 0.0014142135623730950, wavelen = 2π·sqrt(5e5) = 4442.88,
  // smooth = (8192/4442.88 − 1)/3 = 0.2812826, ω' = ω·((1 − smooth)/8 + smooth).
  const double om32 = 1.0 / std::sqrt(5e5);
  const double smooth32 = (8192.0 / (2.0 * 3.14159265358979323846 / om32) - 1.0) / 3.0;
  CHECK(smooth32 == doctest::Approx(0.28128260516325104).epsilon(1e-12));
  CHECK(w[32] == doctest::Approx(0.0005248461609929547).epsilon(1e-13));
  CHECK(w[32] == doctest::Approx(om32 * ((1.0 - smooth32) / 8.0 + smooth32)).epsilon(1e-13));
  CHECK(w[30] == doctest::Approx(0.0013718935677611381).epsilon(1e-13));
  // The smooth band is strictly between the two unsmoothed curves.
  for (int f = 29; f <= 34; ++f) {
    const double om = std::pow(5e5, -f / 64.0);
    CHECK(w[f] < om);
    CHECK(w[f] > om / 8);
  }
}

TEST_CASE("rope_inv_freq: YaRN against a hand-derived case") {
  // d = 8, θ = 1e4, factor 4, original 64, beta_fast 32, beta_slow 1.
  // correction dim(r) = 8·ln(64/(r·2π)) / (2·ln 1e4):
  //   r = 32: 8·ln(0.3183)/18.42 = −0.497 → floor −1 → clamp 0 = low
  //   r = 1:  8·ln(10.186)/18.42 =  1.008 → ceil 2 = high
  // ramp_f = clamp(f/2, 0, 1) = 0, 0.5, 1, 1; ω_f = ω(1 − ramp) + (ω/4)·ramp with ω = 1, 0.1, 0.01, 0.001.
  const std::vector<double> w = rope_inv_freq(8, yarn_small());
  CHECK(w[0] == doctest::Approx(1.0).epsilon(1e-14));
  CHECK(w[1] == doctest::Approx(0.0625).epsilon(1e-14));  // 0.1·0.5 + 0.025·0.5
  CHECK(w[2] == doctest::Approx(0.0025).epsilon(1e-14));
  CHECK(w[3] == doctest::Approx(0.00025).epsilon(1e-14));

  // truncate = false: low = max(−0.497, 0) = 0, high = 1.0080001056 (not ceiled), so ramp_1 = 1/1.008.
  RopeConfig c = yarn_small();
  c.scaling.truncate = false;
  const std::vector<double> u = rope_inv_freq(8, c);
  CHECK(u[0] == doctest::Approx(1.0).epsilon(1e-14));
  CHECK(u[1] == doctest::Approx(0.02559524589192421).epsilon(1e-12));
  CHECK(u[2] == doctest::Approx(0.0025).epsilon(1e-14));
}

TEST_CASE("rope_attention_factor") {
  CHECK(rope_attention_factor(plain(1e4)) == 1.0);
  CHECK(rope_attention_factor(llama3_r1_distill_8b()) == 1.0);
  RopeConfig lin = plain(1e4);
  lin.scaling.kind = RopeScalingKind::kLinear;
  lin.scaling.factor = 4;
  CHECK(rope_attention_factor(lin) == 1.0);

  RopeConfig y = yarn_small();  // factor 4: 0.1·ln 4 + 1
  CHECK(rope_attention_factor(y) == doctest::Approx(1.138629436111989).epsilon(1e-14));
  y.scaling.factor = 1.0;  // get_mscale(<= 1) = 1
  CHECK(rope_attention_factor(y) == 1.0);
  y.scaling.factor = 40;  // DeepSeek: (0.1·1·ln 40 + 1) / (0.1·0.5·ln 40 + 1)
  y.scaling.mscale = 1.0;
  y.scaling.mscale_all_dim = 0.5;
  CHECK(rope_attention_factor(y) == doctest::Approx(1.1557219901962608).epsilon(1e-14));
  y.scaling.mscale_all_dim = 1.0;  // DeepSeek-V3's values: ratio 1
  CHECK(rope_attention_factor(y) == doctest::Approx(1.0).epsilon(1e-15));
  y.scaling.attention_factor = 0.7;  // explicit value wins
  CHECK(rope_attention_factor(y) == 0.7);
}

TEST_CASE("rope: invalid configurations are rejected with the value named") {
  CHECK_THROWS_AS((void)rope_inv_freq(7, plain(1e4)), logic_error);
  CHECK_THROWS_AS((void)rope_inv_freq(0, plain(1e4)), logic_error);
  CHECK_THROWS_WITH_AS((void)rope_inv_freq(-4, plain(1e4)), doctest::Contains("-4"), logic_error);
  CHECK_THROWS_WITH_AS((void)rope_inv_freq(8, plain(1.0)), doctest::Contains("theta"), logic_error);
  CHECK_THROWS_AS((void)rope_inv_freq(8, plain(std::nan(""))), logic_error);
  RopeConfig c = plain(1e4);
  c.scaling.kind = RopeScalingKind::kLinear;
  c.scaling.factor = 0;
  CHECK_THROWS_WITH_AS((void)rope_inv_freq(8, c), doctest::Contains("factor"), logic_error);
  RopeConfig l3 = llama3_r1_distill_8b();
  l3.scaling.high_freq_factor = 1;  // == low: division by zero in the smooth band
  CHECK_THROWS_WITH_AS((void)rope_inv_freq(128, l3), doctest::Contains("high_freq_factor"), logic_error);
  RopeConfig y = yarn_small();
  y.scaling.beta_fast = 0;
  CHECK_THROWS_WITH_AS((void)rope_inv_freq(8, y), doctest::Contains("beta_fast"), logic_error);
  y = yarn_small();
  y.scaling.attention_factor = -1;
  CHECK_THROWS_AS((void)rope_attention_factor(y), logic_error);
  RopeConfig bad = plain(1e4);
  bad.scaling.kind = static_cast<RopeScalingKind>(9);
  CHECK_THROWS_AS((void)rope_inv_freq(8, bad), logic_error);
  CHECK_THROWS_AS((void)rope_inv_freq_f32(6, 1.0f), logic_error);
}

TEST_CASE("rope pair index maps") {
  // half: (x[f], x[f + d/2]); interleaved: (x[2f], x[2f+1]).
  static_assert(rope_pair_re(RopeStyle::kHalf, 3, 16) == 3);
  static_assert(rope_pair_im(RopeStyle::kHalf, 3, 16) == 11);
  static_assert(rope_pair_re(RopeStyle::kInterleaved, 3, 16) == 6);
  static_assert(rope_pair_im(RopeStyle::kInterleaved, 3, 16) == 7);
  for (RopeStyle s : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (int d : {2, 8, 128}) {
      std::vector<int> hits(d, 0);
      for (int f = 0; f < d / 2; ++f) {
        ++hits[rope_pair_re(s, f, d)];
        ++hits[rope_pair_im(s, f, d)];
      }
      for (int i = 0; i < d; ++i) CHECK(hits[i] == 1);  // a permutation of [0, d)
    }
  }
  CHECK(rope_pair_re(RopeStyle::kHalf, 0, 128) == 0);
  CHECK(rope_pair_im(RopeStyle::kHalf, 63, 128) == 127);
  CHECK(rope_pair_im(RopeStyle::kInterleaved, 63, 128) == 127);
}

TEST_CASE("apply_rope: complex multiply by e^{i pos omega} and norms preserved") {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (int d : {8, 64, 128}) {
      const std::vector<double> w = rope_inv_freq(d, plain(1e6, style));
      for (long long pos : {0LL, 1LL, 17LL, 4096LL, 123457LL, 1000003LL}) {
        std::vector<float> x(d);
        for (float& v : x) v = nd(rng);
        std::vector<float> y = x;
        apply_rope(y.data(), d, pos, w.data(), style);
        double n0 = 0, n1 = 0;
        for (int f = 0; f < d / 2; ++f) {
          const int re = style == RopeStyle::kHalf ? f : 2 * f;  // written out independently
          const int im = style == RopeStyle::kHalf ? f + d / 2 : 2 * f + 1;
          const std::complex<double> z(x[re], x[im]);
          const std::complex<double> r = z * std::polar(1.0, static_cast<double>(pos) * w[f]);
          CHECK(y[re] == doctest::Approx(r.real()).epsilon(1e-6).scale(std::abs(z)));
          CHECK(y[im] == doctest::Approx(r.imag()).epsilon(1e-6).scale(std::abs(z)));
          n0 += std::norm(z);
          n1 += double(y[re]) * y[re] + double(y[im]) * y[im];
        }
        CHECK(n1 == doctest::Approx(n0).epsilon(1e-6));
      }
    }
  }
  // pos = 0 is the identity; the attention factor scales the vector by α.
  std::vector<float> x = {1, 2, 3, 4};
  const std::vector<double> w = rope_inv_freq(4, plain(1e4));
  apply_rope(x.data(), 4, 0, w.data(), RopeStyle::kHalf);
  CHECK(x == std::vector<float>{1, 2, 3, 4});
  apply_rope(x.data(), 4, 0, w.data(), RopeStyle::kHalf, 2.0);
  CHECK(x == std::vector<float>{2, 4, 6, 8});
}

TEST_CASE("apply_rope_f32_angles reproduces llama2.c's rotation bit for bit") {
  const int head_size = 48, n_heads = 3, dim = head_size * n_heads;
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> ud(-2.0f, 2.0f);
  const std::vector<float> freq = rope_inv_freq_f32(head_size);  // θ = 10000
  for (int pos : {0, 1, 7, 255, 1000, 32767}) {
    std::vector<float> q(dim);
    for (float& v : q) v = ud(rng);
    std::vector<float> expected = q;
    // llama2.c run.c, verbatim in structure (q only).
    for (int i = 0; i < dim; i += 2) {
      int head_dim = i % head_size;
      float fr = 1.0f / ::powf(10000.0f, head_dim / (float)head_size);
      float val = pos * fr;
      float fcr = ::cosf(val);
      float fci = ::sinf(val);
      float v0 = expected[i];
      float v1 = expected[i + 1];
      expected[i] = v0 * fcr - v1 * fci;
      expected[i + 1] = v0 * fci + v1 * fcr;
    }
    std::vector<float> got = q;
    for (int h = 0; h < n_heads; ++h)
      apply_rope_f32_angles(got.data() + h * head_size, head_size, pos, freq.data(), RopeStyle::kInterleaved);
    CHECK(std::memcmp(got.data(), expected.data(), sizeof(float) * dim) == 0);
  }
  // The float32 frequencies are llama2.c's: 1.0f / powf(10000, 2f/d).
  for (int f = 0; f < head_size / 2; ++f)
    CHECK(freq[f] == 1.0f / ::powf(10000.0f, static_cast<float>(2 * f) / static_cast<float>(head_size)));
}
}

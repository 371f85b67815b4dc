// SPDX-License-Identifier: Apache-2.0
// Tests of core/ref/score.hpp and core/scoring_params.hpp: the folded and max scorers against an
// independent long-double evaluation of spec §3 (written here with std::complex, sharing no code
// with the library), the sign convention against real RoPE rotations, the fold against the
// per-offset path, and why the phase must be float64.
#include <doctest/doctest.h>

#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/ref/score.hpp>
#include <triattn/core/rope.hpp>
#include <triattn/core/scoring_params.hpp>

using namespace triattn;
using cld = std::complex<long double>;

namespace {

struct Problem {
  int L = 2, Hq = 4, Hkv = 2, d = 64, T = 40;
  RopeStyle style = RopeStyle::kHalf;
  QueryStats stats;
  std::vector<float> keys;  // [L, Hkv, T, d]

  const float* key(int l, int g, int j) const {
    return keys.data() + ((static_cast<std::size_t>(l) * Hkv + g) * T + j) * d;
  }
};

Problem make_problem(int d, RopeStyle style, std::uint32_t seed, int L = 2, int Hq = 4, int Hkv = 2, int T = 40) {
  Problem p;
  p.L = L;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.d = d;
  p.T = T;
  p.style = style;
  const int F = d / 2;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> ua(0.05f, 3.0f), uu(0.0f, 1.0f), ang(-3.14159f, 3.14159f);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  p.stats.model_name = "random";
  p.stats.rope_style = style;
  p.stats.num_layers = L;
  p.stats.num_q_heads = Hq;
  p.stats.head_dim = d;
  const std::size_t n = static_cast<std::size_t>(L) * Hq * F;
  p.stats.q_mean_real.resize(n);
  p.stats.q_mean_imag.resize(n);
  p.stats.q_abs_mean.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float a = ua(rng);
    const float r = a * uu(rng);  // |q̄| <= A
    const float t = ang(rng);
    p.stats.q_abs_mean[i] = a;
    p.stats.q_mean_real[i] = r * std::cos(t);
    p.stats.q_mean_imag[i] = r * std::sin(t);
  }
  p.keys.resize(static_cast<std::size_t>(L) * Hkv * T * d);
  for (float& k : p.keys) k = nd(rng);
  return p;
}

/// Independent oracle: spec §3 in long double with std::complex. `omega` and `alpha` are passed
/// in (the frequencies are checked against hand values in test_rope).
struct Oracle {
  std::vector<long double> omega;  // [F]
  long double s2 = 1;
  int M = 65536;
  bool max_agg = false, no_mlr = false, no_trig = false;

  long double score(const Problem& p, int l, int h, long long t0, const float* k) const {
    const int d = p.d, F = d / 2;
    std::vector<long double> deltas;
    for (long long v = 1; v <= M; v *= 2) deltas.push_back(static_cast<long double>(v));
    const std::size_t base_i = (static_cast<std::size_t>(l) * p.Hq + h) * F;
    long double extra = 0;
    std::vector<cld> P(F);
    for (int f = 0; f < F; ++f) {
      const int re = p.style == RopeStyle::kInterleaved ? 2 * f : f;
      const int im = p.style == RopeStyle::kInterleaved ? 2 * f + 1 : f + F;
      const cld K(k[re], k[im]);
      const cld qbar(p.stats.q_mean_real[base_i + f], p.stats.q_mean_imag[base_i + f]);
      const long double A = p.stats.q_abs_mean[base_i + f];
      const long double qabs = std::sqrt(std::norm(qbar) + 1e-8L);
      const long double kabs = std::sqrt(std::norm(K) + 1e-8L);
      P[f] = qbar * std::conj(K);
      extra += s2 * (no_mlr ? A : (A - qabs)) * kabs;
    }
    long double acc = 0;
    bool first = true;
    for (long double delta : deltas) {
      long double base = 0;
      for (int f = 0; f < F; ++f) {
        const long double phi = (static_cast<long double>(t0) + delta) * omega[f];
        base += s2 * std::real(P[f] * cld(std::cos(phi), std::sin(phi)));
      }
      const long double comb = no_trig ? extra : base + extra;
      if (max_agg) {
        acc = first ? comb : std::max(acc, comb);
      } else {
        acc += comb;
      }
      first = false;
    }
    return max_agg ? acc : acc / static_cast<long double>(deltas.size());
  }
};

std::vector<float> run_scores(const Problem& p, const TriAttentionModel& m, long long t0) {
  std::vector<float> out(static_cast<std::size_t>(p.L) * p.Hq * p.T, std::nanf(""));
  ref::score_sequence(m, t0, [&](int l, int g, int j) { return p.key(l, g, j); }, p.T, out.data());
  return out;
}

/// ‖s − ref‖ / ‖ref‖ over every (layer, q head, slot).
double nerr(const Problem& p, const std::vector<float>& s, const Oracle& o, long long t0) {
  const int G = p.Hq / p.Hkv;
  long double num = 0, den = 0;
  for (int l = 0; l < p.L; ++l)
    for (int h = 0; h < p.Hq; ++h)
      for (int j = 0; j < p.T; ++j) {
        const long double r = o.score(p, l, h, t0, p.key(l, h / G, j));
        const long double x = s[(static_cast<std::size_t>(l) * p.Hq + h) * p.T + j];
        num += (x - r) * (x - r);
        den += r * r;
      }
  return static_cast<double>(std::sqrt(num / den));
}

struct Variant {
  const char* name;
  Aggregation agg;
  bool no_mlr, no_trig;
};

}  // namespace

TEST_SUITE("scoring") {
TEST_CASE("geometric_offsets and ScoringParams validation") {
  CHECK(geometric_offsets(1) == std::vector<double>{1});
  CHECK(geometric_offsets(7) == std::vector<double>{1, 2, 4});
  CHECK(geometric_offsets(8) == std::vector<double>{1, 2, 4, 8});
  const std::vector<double> d = geometric_offsets(65536);
  CHECK(d.size() == 17u);
  CHECK(d.back() == 65536.0);
  CHECK(geometric_offsets(0x7fffffff).size() == 31u);
  CHECK_THROWS_AS((void)geometric_offsets(0), logic_error);
  ScoringParams sp;
  CHECK_NOTHROW(sp.validate());
  sp.offset_max_length = 0;
  CHECK_THROWS_WITH_AS(sp.validate(), doctest::Contains("offset_max_length"), logic_error);
  sp = ScoringParams{};
  sp.aggregation = static_cast<Aggregation>(5);
  CHECK_THROWS_AS(sp.validate(), logic_error);
}

TEST_CASE("scores match an independent long-double evaluation of the spec formula") {
  const Variant variants[] = {
      {"mean", Aggregation::kMean, false, false},          {"max", Aggregation::kMax, false, false},
      {"mean no_mlr", Aggregation::kMean, true, false},    {"mean no_trig", Aggregation::kMean, false, true},
      {"mean no_mlr no_trig", Aggregation::kMean, true, true}, {"max no_mlr", Aggregation::kMax, true, false},
      {"max no_trig", Aggregation::kMax, false, true},
  };
  std::uint32_t seed = 100;
  std::mt19937_64 t0_rng(31);
  for (int d : {8, 64, 128}) {
    for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      for (int M : {1, 7, 65536}) {
        for (const Variant& v : variants) {
          for (long long t0_max : {100000LL, 1000000LL}) {
            ++seed;
            const long long t0 = std::uniform_int_distribution<long long>(0, t0_max)(t0_rng);
            CAPTURE(seed);
            CAPTURE(d);
            CAPTURE(M);
            CAPTURE(t0);
            CAPTURE(std::string(v.name));
            CAPTURE(style == RopeStyle::kHalf ? "half" : "interleaved");
            const Problem p = make_problem(d, style, seed, 2, 4, 2, 20);
            RopeConfig rope;
            rope.style = style;
            rope.theta = 1e6;
            ScoringParams sp;
            sp.offset_max_length = M;
            sp.aggregation = v.agg;
            sp.disable_mlr = v.no_mlr;
            sp.disable_trig = v.no_trig;
            const TriAttentionModel m(p.stats, rope, sp, p.Hkv);
            Oracle o;
            for (int f = 0; f < d / 2; ++f) o.omega.push_back(std::pow(1e6L, -2.0L * f / d));
            o.M = M;
            o.max_agg = v.agg == Aggregation::kMax;
            o.no_mlr = v.no_mlr;
            o.no_trig = v.no_trig;
            const std::vector<float> s = run_scores(p, m, t0);
            CHECK(nerr(p, s, o, t0) < 1e-5);
          }
        }
      }
    }
  }
}

TEST_CASE("YaRN: s² = α² scales every term") {
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (Aggregation agg : {Aggregation::kMean, Aggregation::kMax}) {
      const Problem p = make_problem(64, style, 7 + static_cast<int>(agg));
      RopeConfig rope;
      rope.style = style;
      rope.theta = 1e4;
      rope.scaling.kind = RopeScalingKind::kYarn;
      rope.scaling.factor = 16;
      rope.scaling.original_max_position = 4096;
      ScoringParams sp;
      sp.aggregation = agg;
      const TriAttentionModel m(p.stats, rope, sp, p.Hkv);
      const long double alpha = 0.1L * std::log(16.0L) + 1.0L;  // independent of the library
      CHECK(m.freq_scale_sq() == doctest::Approx(static_cast<double>(alpha * alpha)).epsilon(1e-14));
      Oracle o;
      const std::vector<double> w = rope_inv_freq(64, rope);
      o.omega.assign(w.begin(), w.end());
      o.s2 = alpha * alpha;
      o.max_agg = agg == Aggregation::kMax;
      for (long long t0 : {5LL, 65537LL, 999999LL}) {
        CAPTURE(t0);
        CHECK(nerr(p, run_scores(p, m, t0), o, t0) < 1e-5);
        Oracle wrong = o;  // the test can fail: α² matters
        wrong.s2 = 1;
        CHECK(nerr(p, run_scores(p, m, t0), wrong, t0) > 1e-2);
      }
    }
  }
}

TEST_CASE("sign convention: the folded score is the dot product of RoPE-rotated query and key") {
  // A query equal to q̄ (every pair), rotated at t0 + 1, dotted with a key rotated at its own
  // position p, must give base(δ = 1); M = 1 makes D = {1}. With α ≠ 1 the model's RoPE scales
  // both vectors by α (HF multiplies cos and sin by attention_scaling), so the true logit `dot`
  // carries α²; the cached key already carries one α, so base = s²·Re(q̄·conj(K)·e^{..}) = α·dot
  // (a constant factor per model, irrelevant to ranking; spec §3).
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    const int d = 64, F = d / 2;
    Problem p = make_problem(d, style, 4242, 1, 1, 1, 1);
    RopeConfig rope;
    rope.style = style;
    rope.theta = 1e4;
    rope.scaling.kind = RopeScalingKind::kYarn;
    rope.scaling.factor = 8;
    rope.scaling.original_max_position = 2048;
    const double alpha = rope_attention_factor(rope);
    const std::vector<double> w = rope_inv_freq(d, rope);
    ScoringParams sp;
    sp.offset_max_length = 1;
    const TriAttentionModel m(p.stats, rope, sp, 1);
    for (long long t0 : {1LL, 300LL, 2500LL}) {
      for (long long pos : {0LL, 13LL, t0 - 1}) {
        std::vector<float> q(d), k(d);
        std::mt19937 rng(static_cast<std::uint32_t>(t0 * 31 + pos));
        std::normal_distribution<float> nd;
        for (int f = 0; f < F; ++f) {
          const int re = style == RopeStyle::kHalf ? f : 2 * f, im = style == RopeStyle::kHalf ? f + F : 2 * f + 1;
          q[re] = p.stats.q_mean_real[f];
          q[im] = p.stats.q_mean_imag[f];
        }
        for (float& x : k) x = nd(rng);
        apply_rope(q.data(), d, t0 + 1, w.data(), style, alpha);
        apply_rope(k.data(), d, pos, w.data(), style, alpha);
        p.keys = k;
        double dot = 0, extra = 0;
        for (int i = 0; i < d; ++i) dot += double(q[i]) * k[i];
        for (int f = 0; f < F; ++f) {
          const int re = style == RopeStyle::kHalf ? f : 2 * f, im = style == RopeStyle::kHalf ? f + F : 2 * f + 1;
          extra += m.mlr_weight(0, 0)[f] * std::sqrt(double(k[re]) * k[re] + double(k[im]) * k[im] + 1e-8);
        }
        const std::vector<float> s = run_scores(p, m, t0);
        CAPTURE(t0);
        CAPTURE(pos);
        CHECK(s[0] == doctest::Approx(alpha * dot + extra).epsilon(1e-5).scale(std::abs(dot) + std::abs(extra)));
        // The opposite sign (W_re·K_re − W_im·K_im) would give Re(W·K) instead: far off.
        const FoldedWeights fw = m.fold(t0);
        double wrong = 0;
        for (int f = 0; f < F; ++f) {
          const int re = style == RopeStyle::kHalf ? f : 2 * f, im = style == RopeStyle::kHalf ? f + F : 2 * f + 1;
          wrong += double(fw.w_re[f]) * k[re] - double(fw.w_im[f]) * k[im];
        }
        CHECK(std::abs(wrong - alpha * dot) > 1e-3 * (std::abs(dot) + 1.0));
      }
    }
  }
}

TEST_CASE("fold and max weights match the per-offset path") {
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (Aggregation agg : {Aggregation::kMean, Aggregation::kMax}) {
      const Problem p = make_problem(128, style, 77, 2, 8, 2, 16);
      RopeConfig rope;
      rope.style = style;
      rope.theta = 1e6;
      ScoringParams sp;
      sp.aggregation = agg;
      const TriAttentionModel m(p.stats, rope, sp, p.Hkv);
      CHECK(m.group_size() == 4);
      CHECK(m.num_offsets() == 17);
      for (long long t0 : {0LL, 31337LL, 1234567LL}) {
        const std::vector<float> s = run_scores(p, m, t0);
        double num = 0, den = 0;
        for (int l = 0; l < p.L; ++l)
          for (int h = 0; h < p.Hq; ++h)
            for (int j = 0; j < p.T; ++j) {
              const double r = ref::score_key_per_offset(m, l, h, t0, p.key(l, h / 4, j));
              const double x = s[(static_cast<std::size_t>(l) * p.Hq + h) * p.T + j];
              num += (x - r) * (x - r);
              den += r * r;
            }
        CAPTURE(t0);
        CHECK(std::sqrt(num / den) < 1e-6);
      }
    }
  }
}

TEST_CASE("GQA: query head h reads KV head h / G") {
  // Give KV head 1 zero keys: heads 2, 3 (G = 2) then score exactly Σ c_f·sqrt(1e-8), heads 0, 1
  // do not.
  Problem p = make_problem(8, RopeStyle::kHalf, 5, 1, 4, 2, 3);
  for (int j = 0; j < p.T; ++j)
    for (int i = 0; i < p.d; ++i) p.keys[(static_cast<std::size_t>(1) * p.T + j) * p.d + i] = 0.0f;
  RopeConfig rope;
  const TriAttentionModel m(p.stats, rope, ScoringParams{}, 2);
  const std::vector<float> s = run_scores(p, m, 100);
  for (int h = 0; h < 4; ++h) {
    double floor_score = 0;
    for (int f = 0; f < 4; ++f) floor_score += m.mlr_weight(0, h)[f] * std::sqrt(1e-8);
    for (int j = 0; j < p.T; ++j) {
      const float x = s[static_cast<std::size_t>(h) * p.T + j];
      if (h >= 2) {
        CHECK(x == doctest::Approx(floor_score).epsilon(1e-5));
      } else {
        CHECK(std::abs(x - floor_score) > 1e-3);
      }
    }
  }
}

TEST_CASE("fold weights: float64 phase and formula and host-device helper agree") {
  const Problem p = make_problem(64, RopeStyle::kHalf, 11, 1, 2, 1, 1);
  RopeConfig rope;
  rope.theta = 1e6;
  const TriAttentionModel m(p.stats, rope, ScoringParams{}, 1);
  const long long t0 = 987654;
  const FoldedWeights w = m.fold(t0);
  for (int h = 0; h < 2; ++h)
    for (int f = 0; f < 32; ++f) {
      const std::size_t i = m.offset(0, h) + f;
      // W = s²·q̄·e^{i t0 ω}·C, C = mean_δ e^{iδω}, in long double.
      cld C(0, 0);
      for (long long v = 1; v <= 65536; v *= 2) C += std::polar(1.0L, static_cast<long double>(v) * m.omega()[f]);
      C /= 17.0L;
      const cld W = cld(p.stats.q_mean_real[i], p.stats.q_mean_imag[i]) *
                    std::polar(1.0L, static_cast<long double>(t0) * m.omega()[f]) * C;
      CHECK(w.w_re[i] == doctest::Approx(static_cast<double>(W.real())).epsilon(1e-6).scale(std::abs(W)));
      CHECK(w.w_im[i] == doctest::Approx(static_cast<double>(W.imag())).epsilon(1e-6).scale(std::abs(W)));
      // The helper kernels use gives the same bits as fold().
      float wr, wi;
      fold_weight(m.q_mean_re(0, h)[f], m.q_mean_im(0, h)[f], m.offset_mean_re()[f], m.offset_mean_im()[f],
                  m.omega()[f], t0, m.freq_scale_sq(), &wr, &wi);
      CHECK(wr == w.w_re[i]);
      CHECK(wi == w.w_im[i]);
      CHECK(w.c[i] == static_cast<float>(m.mlr_weight(0, h)[f]));
    }
  ScoringParams nt;
  nt.disable_trig = true;
  const TriAttentionModel mt(p.stats, rope, nt, 1);
  const FoldedWeights z = mt.fold(t0);
  for (float x : z.w_re) CHECK(x == 0.0f);
  for (float x : z.w_im) CHECK(x == 0.0f);
}

TEST_CASE("a float32 phase would be wrong at t0 ~ 1e5") {
  const Problem p = make_problem(128, RopeStyle::kHalf, 2024, 1, 4, 1, 64);
  RopeConfig rope;
  rope.theta = 1e6;
  const TriAttentionModel m(p.stats, rope, ScoringParams{}, 1);
  Oracle o;
  for (int f = 0; f < 64; ++f) o.omega.push_back(std::pow(1e6L, -2.0L * f / 128));
  for (long long t0 : {123457LL, 1234567LL}) {
    CAPTURE(t0);
    const double err64 = nerr(p, run_scores(p, m, t0), o, t0);
    CHECK(err64 < 1e-5);
    // Same fold with the phase formed and evaluated in float32.
    const FoldedWeights w64 = m.fold(t0);
    FoldedWeights w = w64;
    double worst = 0;  // largest relative weight error
    for (int h = 0; h < 4; ++h)
      for (int f = 0; f < 64; ++f) {
        const std::size_t i = m.offset(0, h) + f;
        const float phi = static_cast<float>(t0) * static_cast<float>(m.omega()[f]);
        fold_weight_from_phase(m.q_mean_re(0, h)[f], m.q_mean_im(0, h)[f], m.offset_mean_re()[f],
                               m.offset_mean_im()[f], std::cos(phi), std::sin(phi), m.freq_scale_sq(), &w.w_re[i],
                               &w.w_im[i]);
        const double mag = std::hypot(double(w64.w_re[i]), double(w64.w_im[i]));
        worst = std::max(worst, std::hypot(double(w.w_re[i]) - w64.w_re[i], double(w.w_im[i]) - w64.w_im[i]) / mag);
      }
    long double num = 0, den = 0;
    for (int h = 0; h < 4; ++h)
      for (int j = 0; j < p.T; ++j) {
        const std::size_t o_ = m.offset(0, h);
        const float x = score_key_folded(p.key(0, 0, j), w.w_re.data() + o_, w.w_im.data() + o_, w.c.data() + o_,
                                         128, RopeStyle::kHalf);
        const long double r = o.score(p, 0, h, t0, p.key(0, 0, j));
        num += (x - r) * (x - r);
        den += r * r;
      }
    const double err32 = static_cast<double>(std::sqrt(num / den));
    MESSAGE("t0 " << t0 << ": worst fp32-phase weight error " << worst << " rad; score error fp32 phase " << err32
                  << " vs fp64 phase " << err64);
    CHECK(worst > 1e-3);           // a few mrad at 1e5, tens of mrad at 1e6
    CHECK(err32 > 10.0 * err64);
  }
}

TEST_CASE("TriAttentionModel rejects malformed input") {
  Problem p = make_problem(8, RopeStyle::kHalf, 3, 1, 4, 2, 1);
  RopeConfig rope;
  CHECK_NOTHROW(TriAttentionModel(p.stats, rope, ScoringParams{}, 2));
  CHECK_THROWS_WITH_AS(TriAttentionModel(p.stats, rope, ScoringParams{}, 3), doctest::Contains("num_kv_heads"),
                       logic_error);
  CHECK_THROWS_AS(TriAttentionModel(p.stats, rope, ScoringParams{}, 0), logic_error);
  RopeConfig inter;
  inter.style = RopeStyle::kInterleaved;
  CHECK_THROWS_WITH_AS(TriAttentionModel(p.stats, inter, ScoringParams{}, 2), doctest::Contains("style"),
                       logic_error);
  ScoringParams bad;
  bad.offset_max_length = -3;
  CHECK_THROWS_WITH_AS(TriAttentionModel(p.stats, rope, bad, 2), doctest::Contains("-3"), logic_error);
  QueryStats s = p.stats;
  s.q_abs_mean.pop_back();
  CHECK_THROWS_WITH_AS(TriAttentionModel(s, rope, ScoringParams{}, 2), doctest::Contains("q_abs_mean"),
                       logic_error);
  s = p.stats;
  s.head_dim = 7;
  CHECK_THROWS_AS(TriAttentionModel(s, rope, ScoringParams{}, 2), logic_error);
  s = p.stats;
  s.q_mean_imag[5] = std::nanf("");
  CHECK_THROWS_WITH_AS(TriAttentionModel(s, rope, ScoringParams{}, 2), doctest::Contains("q head 1, f 1"),
                       logic_error);
  RopeConfig badrope;
  badrope.theta = 0.5;
  CHECK_THROWS_AS(TriAttentionModel(p.stats, badrope, ScoringParams{}, 2), logic_error);
  const TriAttentionModel m(p.stats, rope, ScoringParams{}, 2);
  CHECK_THROWS_AS((void)m.fold(-1), logic_error);
  CHECK_THROWS_AS((void)m.fold_per_offset(-1), logic_error);
  std::vector<float> out(4);
  CHECK_THROWS_AS(ref::score_sequence(m, 0, [&](int, int, int) { return p.keys.data(); }, -1, out.data()), logic_error);
  CHECK_THROWS_AS(ref::score_sequence(m, -5, [&](int, int, int) { return p.keys.data(); }, 1, out.data()), logic_error);
}
}

TEST_CASE("fold_weight_from_phase_unit is fold_weight_from_phase with C = 1 bit for bit") {
  // The max scorers' folds call the unit form (8 float64 operations instead of 14); the CPU
  // reference calls the general one. Their floats must be the same bits (a zero may differ in sign).
  std::mt19937_64 rng(20261202);
  std::uniform_real_distribution<double> q(-4.0, 4.0), phi(-1e5, 1e5), s2(0.25, 4.0);
  std::uniform_int_distribution<int> exponent(-60, 60);
  const auto same = [](float a, float b) {
    return (a == 0.0f && b == 0.0f) || std::memcmp(&a, &b, sizeof a) == 0;
  };
  int mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    // magnitudes over many binades, so the roundings of both forms are exercised everywhere
    const double qr = std::ldexp(q(rng), exponent(rng)), qi = std::ldexp(q(rng), exponent(rng));
    const double p = phi(rng), s = s2(rng);
    float gr = 0, gi = 0, ur = 0, ui = 0;
    fold_weight_from_phase(qr, qi, 1.0, 0.0, std::cos(p), std::sin(p), s, &gr, &gi);
    fold_weight_from_phase_unit(qr, qi, std::cos(p), std::sin(p), s, &ur, &ui);
    if (!same(gr, ur) || !same(gi, ui)) {
      if (mismatches++ == 0) {
        INFO("first mismatch: i = ", i, " q = (", qr, ", ", qi, ") phi = ", p, " s2 = ", s);
        CHECK(gr == ur);
        CHECK(gi == ui);
      }
    }
  }
  CHECK(mismatches == 0);
}

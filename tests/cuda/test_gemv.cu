// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The small-batch bf16 GEMVs of the reference transformer (examples/reference_transformer/
// gemv_stream_kernel.cuh: variant 0 = gemv_warp_kernel, 1 = stream, 2 = stream-wide, 3 = bulk)
// against a float64 CPU reference on fresh random inputs, outputs poisoned (NaN bytes) before
// every launch:
//   * the decode step's shapes (qkv with 3 matrices + bias + RMSNorm prologue, wo + residual,
//     gate/up paired SwiGLU + RMSNorm, down K = 12288 + residual, the 151936-row classifier +
//     RMSNorm) and odd ones: rows not a multiple of the tile, K a multiple of 8 but not of 256 or
//     of 2048, K = 8, one-row matrices, segment boundaries inside a tile, padded x / output rows,
//     x rows through a row-offset list; n = 1 and 2
//   * padding between output rows stays poisoned; the RMSNorm output row equals rmsnorm_kernel's
//     bitwise; variants 1-3 give bitwise the same results (same per-row arithmetic by design)
//   * unsupported inputs are refused with a reason (n = 3, K % 8 != 0, misaligned rows, x too
//     large for shared memory, unknown variant)
//   * Model<CudaBackend> decode steps (graphs + PDL) with each variant: 1-3 bitwise equal, all
//     close to variant 0
// Tolerance: the weights are bf16 and x fp32 in both computations, so all the GPU adds is fp32
// rounding. A dot product of K terms summed in chains of depth d has |error| <= d u sum|w x|
// (u = 2^-24, first order): d = K/256 + 12 for variants 1-3 (per-thread chain, 5 warp levels, 7
// cross-warp adds), K/32 + 5 for variant 0; the RMSNorm prologue adds (K/256 + 20) u relative
// per x (sum of squares, sqrt, divide, two products). We use d = K/32 + K/256 + 36, twice that
// bound, plus a few u of |result| per epilogue operation; a wrong or missing 16-byte block
// shows up as an error of order |w x| / sum|w x| ~ 1/K, well above it.
#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/gemv_stream_kernel.cuh>
#include <reference_transformer/model.hpp>
#include <reference_transformer/synthetic.hpp>

namespace {

namespace ex = triattn_example;
namespace gpu = triattn_example::gpu;
using triattn::bf16_storage;
using triattn::test::DeviceBuffer;

constexpr double kU = 1.0 / 16777216.0;  // 2^-24
constexpr std::uint32_t kPoison = 0xFFFFFFFFu;

struct Shape {
  std::string name;
  std::vector<int> M;  // rows per matrix (paired: gate and up, equal)
  int K = 0;
  int n = 1;
  bool paired = false, bias = false, residual = false, norm = false, x_rows = false;
  int x_pad = 0;    // floats between x rows (a multiple of 4)
  int out_pad = 0;  // floats between output rows
};

/// Fast random bf16 patterns: random sign, exponent 2^-7 .. 2^-1, random mantissa.
void fill_bf16(std::vector<bf16_storage>& w, std::uint64_t seed) {
  std::uint64_t z = seed;
  for (std::size_t i = 0; i < w.size(); i += 4) {
    const std::uint64_t h = triattn::mix64(z);  // splitmix64: mix64 of seed + k * its increment
    z += 0x9e3779b97f4a7c15ull;
    for (std::size_t j = 0; j < 4 && i + j < w.size(); ++j) {
      const auto r = static_cast<std::uint16_t>(h >> (16 * j));
      const std::uint16_t exp = static_cast<std::uint16_t>(120 + (r >> 8) % 7);  // 2^-7 .. 2^-1
      w[i + j].bits = static_cast<std::uint16_t>((r & 0x8000u) | (exp << 7) | (r & 0x7Fu));
    }
  }
}

std::vector<float> uniform(std::mt19937_64& rng, std::size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<std::uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<std::uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * 4);
  return b;
}

/// Inputs of one case on host and device; the device outputs are re-poisoned by run().
struct Case {
  Shape sh;
  int nseg = 0;
  long long x_stride = 0;
  std::vector<long long> x_off;  // offset of x row b in the x buffer
  std::vector<float> x, norm_w;
  std::vector<std::vector<bf16_storage>> w;
  std::vector<std::vector<float>> bias, res0;  // per matrix
  DeviceBuffer<float> d_x, d_norm_w, d_norm_out;
  DeviceBuffer<long long> d_x_rows;
  std::vector<DeviceBuffer<bf16_storage>> d_w;
  std::vector<DeviceBuffer<float>> d_bias, d_out, d_res;

  [[nodiscard]] long long out_stride(int s) const { return sh.M[static_cast<std::size_t>(s)] + sh.out_pad; }

  Case(const Shape& s, std::uint64_t seed) : sh(s) {
    std::mt19937_64 rng(seed);
    nseg = static_cast<int>(sh.M.size());
    const int K = sh.K;
    x_stride = K + sh.x_pad;
    const long long rows_span = x_stride * (sh.n + 1);
    for (int b = 0; b < sh.n; ++b)  // through the offset list the rows come in reverse order
      x_off.push_back(sh.x_rows ? (sh.n - b) * x_stride : b * x_stride);
    x = uniform(rng, static_cast<std::size_t>(rows_span), -2.0f, 2.0f);
    d_x = DeviceBuffer<float>(x);
    if (sh.x_rows) d_x_rows = DeviceBuffer<long long>(x_off);
    if (sh.norm) {
      norm_w = uniform(rng, static_cast<std::size_t>(K), 0.5f, 1.5f);
      d_norm_w = DeviceBuffer<float>(norm_w);
      d_norm_out = DeviceBuffer<float>(x.size());
    }
    for (int g = 0; g < nseg; ++g) {
      const std::size_t M = static_cast<std::size_t>(sh.M[static_cast<std::size_t>(g)]);
      w.emplace_back(M * static_cast<std::size_t>(K));
      fill_bf16(w.back(), seed * 31 + static_cast<std::uint64_t>(g) + 1);
      d_w.emplace_back(w.back());
      bias.push_back(sh.bias ? uniform(rng, M, -0.5f, 0.5f) : std::vector<float>{});
      if (sh.bias) d_bias.emplace_back(bias.back());
      else d_bias.emplace_back(1);
      const std::size_t out_n = static_cast<std::size_t>(out_stride(g) * sh.n);
      d_out.emplace_back(out_n);
      res0.push_back(sh.residual ? uniform(rng, out_n, -3.0f, 3.0f) : std::vector<float>{});
      d_res.emplace_back(sh.residual ? out_n : 1);
    }
  }

  [[nodiscard]] gpu::GemvParams params() const {
    gpu::GemvParams p;
    p.nseg = nseg;
    for (int g = 0; g < nseg; ++g) {
      gpu::GemvSeg& s = p.seg[g];
      s.w = d_w[static_cast<std::size_t>(g)].get();
      s.bias = sh.bias ? d_bias[static_cast<std::size_t>(g)].get() : nullptr;
      s.out = d_out[static_cast<std::size_t>(g)].get();
      s.out_stride = out_stride(g);
      s.residual = sh.residual ? d_res[static_cast<std::size_t>(g)].get() : nullptr;
      s.res_stride = out_stride(g);
      s.M = sh.M[static_cast<std::size_t>(g)];
    }
    p.paired = sh.paired ? 1 : 0;
    p.x = d_x.get();
    p.x_rows = sh.x_rows ? d_x_rows.get() : nullptr;
    p.x_stride = x_stride;
    p.K = sh.K;
    p.n = sh.n;
    if (sh.norm) {
      p.norm_w = d_norm_w.get();
      p.norm_out = d_norm_out.get();
      p.eps = 1e-5f;
    }
    return p;
  }

  /// Poisons every output, resets the residuals, launches `variant`, waits.
  void run(int variant, int sms) {
    for (auto& o : d_out) o.poison();
    if (sh.norm) d_norm_out.poison();
    for (int g = 0; g < nseg && sh.residual; ++g) d_res[static_cast<std::size_t>(g)].upload(res0[static_cast<std::size_t>(g)]);
    gpu::GemvLaunch l;
    const std::string why = gpu::plan_gemv_bf16_small(params(), variant, sms, &l);
    REQUIRE_MESSAGE(why.empty(), "variant ", variant, " refused ", sh.name, ": ", why);
    TRIATTN_TEST_CUDA(gpu::launch_gemv_planned(l, nullptr, true));
    TRIATTN_TEST_CUDA(cudaGetLastError());
    TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  }

  /// Device outputs (and residuals) of the last run, concatenated, as bit patterns.
  [[nodiscard]] std::vector<std::uint32_t> result_bits() const {
    std::vector<std::uint32_t> all;
    for (int g = 0; g < nseg; ++g) {
      const auto o = bits_of(d_out[static_cast<std::size_t>(g)].download());
      all.insert(all.end(), o.begin(), o.end());
      if (sh.residual) {
        const auto r = bits_of(d_res[static_cast<std::size_t>(g)].download());
        all.insert(all.end(), r.begin(), r.end());
      }
    }
    if (sh.norm) {
      const auto r = bits_of(d_norm_out.download());
      all.insert(all.end(), r.begin(), r.end());
    }
    return all;
  }
};

/// float64 reference and per-element tolerance of one case.
struct Reference {
  std::vector<std::vector<double>> out, out_tol, res, res_tol;  // [matrix][b * out_stride + i]
};

Reference reference(const Case& c) {
  const Shape& sh = c.sh;
  const int K = sh.K;
  std::vector<std::vector<double>> xn(static_cast<std::size_t>(sh.n), std::vector<double>(static_cast<std::size_t>(K)));
  for (int b = 0; b < sh.n; ++b) {
    const float* xr = c.x.data() + c.x_off[static_cast<std::size_t>(b)];
    double inv = 1.0;
    if (sh.norm) {
      double ss = 0.0;
      for (int k = 0; k < K; ++k) ss += static_cast<double>(xr[k]) * xr[k];
      inv = 1.0 / std::sqrt(ss / K + 1e-5);
    }
    for (int k = 0; k < K; ++k)
      xn[static_cast<std::size_t>(b)][static_cast<std::size_t>(k)] =
          sh.norm ? static_cast<double>(c.norm_w[static_cast<std::size_t>(k)]) * (inv * xr[k]) : xr[k];
  }
  const double d = K / 32.0 + K / 256.0 + 36.0;
  auto dot = [&](int g, int row, int b, double* mag) {
    const bf16_storage* wr = c.w[static_cast<std::size_t>(g)].data() + static_cast<std::size_t>(row) * K;
    const double* xb = xn[static_cast<std::size_t>(b)].data();
    double s = 0.0, a = 0.0;
    for (int k = 0; k < K; ++k) {
      const double t = static_cast<double>(triattn::to_float(wr[k])) * xb[k];
      s += t;
      a += std::fabs(t);
    }
    *mag = a;
    return s;
  };
  Reference r;
  for (int g = 0; g < c.nseg; ++g) {
    const std::size_t n_out = static_cast<std::size_t>(c.out_stride(g) * sh.n);
    r.out.emplace_back(n_out, 0.0);
    r.out_tol.emplace_back(n_out, -1.0);  // -1: a gap that must stay poisoned
    r.res.emplace_back(sh.residual ? n_out : 0, 0.0);
    r.res_tol.emplace_back(sh.residual ? n_out : 0, -1.0);
  }
  for (int b = 0; b < sh.n; ++b) {
    if (sh.paired) {
      for (int i = 0; i < sh.M[0]; ++i) {
        double mg = 0, mu = 0;
        double gate = dot(0, i, b, &mg), up = dot(1, i, b, &mu);
        const double bg = sh.bias ? c.bias[0][static_cast<std::size_t>(i)] : 0.0;
        const double bu = sh.bias ? c.bias[1][static_cast<std::size_t>(i)] : 0.0;
        gate += bg;
        up += bu;
        const double tg = 2 * d * kU * mg + 4 * kU * (std::fabs(gate) + std::fabs(bg));
        const double tu = 2 * d * kU * mu + 4 * kU * (std::fabs(up) + std::fabs(bu));
        const double silu = gate / (1.0 + std::exp(-gate));
        const std::size_t e = static_cast<std::size_t>(b * c.out_stride(0) + i);
        r.out[0][e] = silu * up;
        r.out_tol[0][e] = 1.1 * tg * std::fabs(up) + std::fabs(silu) * tu + tg * tu + 16 * kU * std::fabs(silu * up);
        r.out[1][e] = up;
        r.out_tol[1][e] = tu;
      }
    } else {
      for (int g = 0; g < c.nseg; ++g)
        for (int i = 0; i < sh.M[static_cast<std::size_t>(g)]; ++i) {
          double m = 0;
          const double bi = sh.bias ? c.bias[static_cast<std::size_t>(g)][static_cast<std::size_t>(i)] : 0.0;
          const double y = dot(g, i, b, &m) + bi;
          const double t = 2 * d * kU * m + 4 * kU * (std::fabs(y) + std::fabs(bi));
          const std::size_t e = static_cast<std::size_t>(b * c.out_stride(g) + i);
          r.out[static_cast<std::size_t>(g)][e] = y;
          r.out_tol[static_cast<std::size_t>(g)][e] = t;
          if (sh.residual) {
            const double old = c.res0[static_cast<std::size_t>(g)][e];
            r.res[static_cast<std::size_t>(g)][e] = old + y;
            r.res_tol[static_cast<std::size_t>(g)][e] = t + 4 * kU * (std::fabs(old) + std::fabs(y));
          }
        }
    }
  }
  // residual gaps keep their old values exactly
  for (int g = 0; g < c.nseg && sh.residual; ++g)
    for (std::size_t e = 0; e < r.res[static_cast<std::size_t>(g)].size(); ++e)
      if (r.res_tol[static_cast<std::size_t>(g)][e] < 0) {
        r.res[static_cast<std::size_t>(g)][e] = c.res0[static_cast<std::size_t>(g)][e];
        r.res_tol[static_cast<std::size_t>(g)][e] = 0.0;
      }
  return r;
}

/// Compares one device array with the reference; tol < 0 marks elements that must keep the poison.
/// Returns the worst |error| / tolerance.
double check_against(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& tol,
                     const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  double worst = 0.0;
  for (std::size_t e = 0; e < got.size(); ++e) {
    bool ok;
    if (tol[e] < 0) {
      std::uint32_t bits;
      std::memcpy(&bits, &got[e], 4);
      ok = bits == kPoison;
    } else {
      const double err = std::fabs(static_cast<double>(got[e]) - want[e]);
      ok = std::isfinite(got[e]) && err <= tol[e];
      if (tol[e] > 0) worst = std::max(worst, err / tol[e]);
    }
    if (!ok && bad++ == 0) first = e;
  }
  if (bad > 0)
    FAIL_CHECK(what, ": ", bad, " of ", got.size(), " elements wrong; first at ", first, ": got ", got[first], ", want ",
               want[first], " (tolerance ", tol[first], ", < 0: must stay poisoned)");
  return worst;
}

int device_sms() {
  int dev = 0, sms = 0;
  TRIATTN_TEST_CUDA(cudaGetDevice(&dev));
  TRIATTN_TEST_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

/// rmsnorm_kernel's output for the case's x rows, in x's layout (gaps poisoned).
std::vector<float> rmsnorm_rows(const Case& c) {
  DeviceBuffer<float> out(c.x.size());
  out.poison();
  DeviceBuffer<long long> rows(c.x_off);
  gpu::rmsnorm_kernel<<<static_cast<unsigned>(c.sh.n), gpu::kNormThreads>>>(out.get(), c.d_x.get(), c.d_norm_w.get(), c.sh.K,
                                                                            1e-5f, rows.get(), 0LL);
  TRIATTN_TEST_CUDA(cudaGetLastError());
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  return out.download();
}

void run_case(const Shape& sh, std::uint64_t seed) {
  INFO("case " << sh.name << ", n " << sh.n << ", K " << sh.K << ", seed " << seed);
  const int sms = device_sms();
  Case c(sh, seed);
  const Reference ref = reference(c);
  const std::vector<float> norm_ref = sh.norm ? rmsnorm_rows(c) : std::vector<float>{};
  std::vector<std::uint32_t> first_stream;
  for (int v = 0; v < gpu::kGemvNumVariants; ++v) {
    INFO("variant " << v << " (" << gpu::gemv_variant_name(v) << ")");
    c.run(v, sms);
    double worst = 0.0;
    for (int g = 0; g < c.nseg; ++g) {
      const std::string m = "matrix " + std::to_string(g);
      worst = std::max(worst, check_against(c.d_out[static_cast<std::size_t>(g)].download(), ref.out[static_cast<std::size_t>(g)],
                                            ref.out_tol[static_cast<std::size_t>(g)], m + " output"));
      if (sh.residual)
        worst = std::max(worst, check_against(c.d_res[static_cast<std::size_t>(g)].download(),
                                              ref.res[static_cast<std::size_t>(g)], ref.res_tol[static_cast<std::size_t>(g)],
                                              m + " residual"));
    }
    if (sh.norm) {
      const auto got = bits_of(c.d_norm_out.download());
      const auto want = bits_of(norm_ref);
      CHECK_MESSAGE(got == want, "the fused RMSNorm output differs from rmsnorm_kernel's");
    }
    MESSAGE(sh.name << " n " << sh.n << " variant " << gpu::gemv_variant_name(v) << ": worst error / tolerance " << worst);
    if (v >= gpu::kGemvVariantStream) {
      const auto bits = c.result_bits();
      if (first_stream.empty()) first_stream = bits;
      else CHECK_MESSAGE(bits == first_stream, "variant " << v << " differs bitwise from variant " << gpu::kGemvVariantStream);
    }
  }
}

std::uint64_t case_seed(int i) { return triattn::test::test_seed() * 1000003ull + static_cast<std::uint64_t>(i); }

Shape make(std::string name, std::vector<int> M, int K, int n) {
  Shape s;
  s.name = std::move(name);
  s.M = std::move(M);
  s.K = K;
  s.n = n;
  return s;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("small-batch bf16 GEMV: the decode step's shapes against a float64 reference") {
  triattn::test::require_device();
  int i = 0;
  for (const int n : {1, 2}) {
    Shape qkv = make("qkv 4096+1024+1024 x 4096 + bias + RMSNorm", {4096, 1024, 1024}, 4096, n);
    qkv.bias = qkv.norm = true;
    run_case(qkv, case_seed(i++));
    Shape wo = make("wo 4096 x 4096 + residual", {4096}, 4096, n);
    wo.residual = true;
    run_case(wo, case_seed(i++));
    Shape w13 = make("gate/up 2 x 12288 x 4096 paired + RMSNorm", {12288, 12288}, 4096, n);
    w13.paired = w13.norm = true;
    run_case(w13, case_seed(i++));
    Shape w2 = make("down 4096 x 12288 + residual", {4096}, 12288, n);
    w2.residual = true;
    run_case(w2, case_seed(i++));
  }
  Shape cls = make("classifier 151936 x 4096 + RMSNorm", {151936}, 4096, 1);
  cls.norm = true;
  run_case(cls, case_seed(i++));
  Shape cls2 = make("classifier 151936 x 4096 over a row list", {151936}, 4096, 2);
  cls2.x_rows = true;
  run_case(cls2, case_seed(i++));
}

TEST_CASE("small-batch bf16 GEMV: odd sizes against a float64 reference") {
  triattn::test::require_device();
  int i = 100;
  for (const int n : {1, 2}) {
    Shape a = make("3 matrices 37+5+1 rows K 264 + bias + RMSNorm + padded rows", {37, 5, 1}, 264, n);
    a.bias = a.norm = true;
    a.x_pad = 4;
    a.out_pad = 3;
    run_case(a, case_seed(i++));
    run_case(make("one row K 8", {1}, 8, n), case_seed(i++));
    Shape b = make("paired 333 rows K 2056 + bias", {333, 333}, 2056, n);
    b.paired = b.bias = true;
    b.out_pad = 1;
    run_case(b, case_seed(i++));
    Shape c = make("1001 rows K 12296 + residual", {1001}, 12296, n);
    c.residual = true;
    c.out_pad = 2;
    run_case(c, case_seed(i++));
    Shape d = make("4099 rows K 4096 via row list", {4099}, 4096, n);
    d.x_rows = true;
    d.x_pad = 8;
    run_case(d, case_seed(i++));
    Shape e = make("2 matrices 3+4101 rows K 1032 + RMSNorm", {3, 4101}, 1032, n);
    e.norm = true;
    run_case(e, case_seed(i++));
    Shape f = make("paired 7 rows K 4104 + RMSNorm + residual-free", {7, 7}, 4104, n);
    f.paired = f.norm = true;
    run_case(f, case_seed(i++));
  }
}

TEST_CASE("small-batch bf16 GEMV: unsupported inputs are refused with a reason") {
  triattn::test::require_device();
  const int sms = device_sms();
  Shape s = make("base", {64}, 256, 1);
  Case c(s, case_seed(200));
  gpu::GemvLaunch l;
  auto refused = [&](gpu::GemvParams p, int variant, const char* needle) {
    const std::string why = gpu::plan_gemv_bf16_small(p, variant, sms, &l);
    INFO("variant " << variant << ": '" << why << "'");
    CHECK(!why.empty());
    CHECK(why.find(needle) != std::string::npos);
  };
  for (int v = 0; v < gpu::kGemvNumVariants; ++v) {
    INFO("variant " << v);
    CHECK(gpu::plan_gemv_bf16_small(c.params(), v, sms, &l).empty());
    gpu::GemvParams p = c.params();
    p.n = 3;
    refused(p, v, "1 or 2");
    p = c.params();
    p.K = 252;
    refused(p, v, "multiple of 8");
    p = c.params();
    p.seg[0].w = static_cast<const bf16_storage*>(p.seg[0].w) + 1;
    refused(p, v, "aligned");
    p = c.params();
    p.x_stride = 6;
    refused(p, v, "aligned");
    p = c.params();
    p.x = p.x + 1;
    refused(p, v, "aligned");
    p = c.params();
    p.paired = 1;
    refused(p, v, "paired");
  }
  gpu::GemvParams big = c.params();
  big.K = 60000;
  big.n = 2;
  for (int v = 1; v < gpu::kGemvNumVariants; ++v) refused(big, v, "shared memory");
  refused(c.params(), gpu::kGemvNumVariants, "does not exist");
  refused(c.params(), -1, "does not exist");
}

TEST_CASE("small-batch bf16 GEMV: Model decode steps with each variant (graphs and PDL)") {
  triattn::test::require_device();
  ex::ModelConfig cfg = ex::synthetic_config("tiny");
  cfg.name = "synthetic-gemv-test";
  cfg.dim = 256;
  cfg.hidden_dim = 512;
  cfg.n_layers = 2;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.vocab_size = 1000;
  const ex::ModelWeights w = ex::make_synthetic_weights(cfg, 23);
  constexpr int kSteps = 12;
  auto run = [&](int variant, int batch) {
    ex::CudaBackendOptions o;
    o.weights = ex::WeightType::kBF16;
    o.gemv_variant = variant;
    ex::CudaBackend be(o);
    ex::Model<ex::CudaBackend> model(w, be);
    triattn::CacheConfig cc;
    cc.model = cfg.geometry();
    cc.block_size = 16;
    cc.max_seqs = batch;
    cc.num_blocks = batch * 8;
    cc.dtype = triattn::DType::kBF16;
    ex::GpuPlainCache cache(cc, triattn::cuda::DeviceCompactor(be.stream()));
    std::vector<triattn::SeqId> ids;
    std::vector<std::vector<int>> prompts;
    std::vector<ex::Chunk> chunks;
    for (int b = 0; b < batch; ++b) {
      prompts.push_back({1, 17 + b, 400 + 3 * b, 9});
      ids.push_back(cache.add_sequence());
    }
    for (int b = 0; b < batch; ++b) chunks.push_back(ex::Chunk{ids[static_cast<std::size_t>(b)], prompts[static_cast<std::size_t>(b)], triattn::Phase::kPrefill});
    std::vector<std::vector<float>> all;
    all.push_back(model.step(cache, chunks).logits);
    std::vector<int> tok(static_cast<std::size_t>(batch));
    for (int s = 0; s < kSteps; ++s) {
      chunks.clear();
      for (int b = 0; b < batch; ++b) {
        tok[static_cast<std::size_t>(b)] = (s * 13 + b * 7 + 5) % cfg.vocab_size;
        chunks.push_back(ex::Chunk{ids[static_cast<std::size_t>(b)], std::span<const int>(&tok[static_cast<std::size_t>(b)], 1),
                                   triattn::Phase::kDecode});
      }
      all.push_back(model.step(cache, chunks).logits);
    }
    CHECK(be.stats().graph_captures >= 1);
    return all;
  };
  for (const int batch : {1, 2}) {
    INFO("batch " << batch);
    const auto base = run(gpu::kGemvVariantWarp, batch);
    const auto s1 = run(gpu::kGemvVariantStream, batch);
    double worst = 0.0, scale = 0.0;
    for (std::size_t s = 0; s < base.size(); ++s)
      for (std::size_t e = 0; e < base[s].size(); ++e) {
        worst = std::max(worst, static_cast<double>(std::fabs(base[s][e] - s1[s][e])));
        scale = std::max(scale, static_cast<double>(std::fabs(base[s][e])));
      }
    // Different fp32 summation orders, compounded over 2 layers and 12 steps of feedback.
    CHECK_MESSAGE(worst <= 1e-3 * scale, "stream vs warp logits differ by " << worst << " (max |logit| " << scale << ")");
    MESSAGE("batch " << batch << ": stream vs warp max |diff| " << worst << ", max |logit| " << scale);
    for (int v = gpu::kGemvVariantStream + 1; v < gpu::kGemvNumVariants; ++v) {
      INFO("variant " << v);
      CHECK(run(v, batch) == s1);
    }
  }
}

}  // TEST_SUITE

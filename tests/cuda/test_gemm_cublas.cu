// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The reference transformer's matmuls through cuBLAS (examples/reference_transformer/
// gemm_cublas.cuh) against a float64 CPU reference and against the GEMV kernels, on fresh random
// inputs with every output poisoned (NaN bytes) first:
//   * the fused groups the step recorder builds, for fp32 and bf16 weights, n = 1..130 rows,
//     both paths (MatmulPath::kGemv, kCublas): RMSNorm prologue + q/k/v with biases, wo + the
//     residual add, gate/up + SwiGLU, down + the residual add, and the classifier over picked
//     rows (a row-offset list); the unfused ops (fuse off) too
//   * Model<CudaBackend> prefill + decode steps: cuBLAS close to the GEMV kernels; with CUDA
//     graphs the cuBLAS decode steps are captured and replayed, bitwise equal to eager launches
// Reference inputs are what the GPU read (the RMSNorm output is read back), rounded to bf16
// where the path rounds x (bf16 weights: cuBLAS always, the GEMV kernels from 3 rows). Tolerance:
// fp32 accumulation over K terms, |error| <= K u sum|w x| (u = 2^-24) for any summation order;
// we allow 2 K u sum|w x| + 4 u |result| per epilogue step. A missing or wrong element of W or
// x shows as ~sum|w x| / K, K = 256..512 times above.
#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/model.hpp>
#include <reference_transformer/synthetic.hpp>

namespace {

namespace ex = triattn_example;
using triattn::test::DeviceBuffer;
using triattn::test::prompt_tokens;
using triattn::test::rounded_to_bf16;

ex::ModelConfig gemm_config() {
  ex::ModelConfig c = triattn::test::small_config(64);
  c.n_layers = 1;
  c.has_qkv_bias = true;
  return c;
}

float round_bf16(float x) { return triattn::to_float(triattn::from_float<triattn::bf16_storage>(x)); }

struct Ref {
  double value = 0, mag = 0;  // W·x and sum |w x|
};

/// W [M, K] (host) times row x (K), x rounded to bf16 if `round`.
std::vector<Ref> ref_matvec(const float* W, int M, int K, const float* x, bool round) {
  std::vector<Ref> r(static_cast<std::size_t>(M));
  for (int i = 0; i < M; ++i) {
    double s = 0, m = 0;
    for (int k = 0; k < K; ++k) {
      const double p = static_cast<double>(W[static_cast<std::size_t>(i) * K + k]) * (round ? round_bf16(x[k]) : x[k]);
      s += p;
      m += std::fabs(p);
    }
    r[static_cast<std::size_t>(i)] = {s, m};
  }
  return r;
}

constexpr double kU = 1.0 / 16777216.0;

/// Counts elements of `got` outside the bound around `want` (NaN counts as outside).
struct Checker {
  int bad = 0, checked = 0;
  double worst = 0;  // error / bound
  void near(float got, double want, double mag, int K, int epi_steps) {
    const double bound = 2.0 * K * kU * mag + (4.0 * epi_steps + 1.0) * kU * std::fabs(want) + 1e-30;
    const double err = std::fabs(static_cast<double>(got) - want);
    ++checked;
    if (!(err <= bound)) ++bad;
    else worst = std::max(worst, err / bound);
  }
};

std::vector<float> host(const DeviceBuffer<float>& b) { return b.download(); }

void run_groups(ex::WeightType wt, ex::MatmulPath path, bool fuse, int n, std::mt19937_64& rng) {
  INFO("weights " << ex::weight_type_name(wt) << ", path " << static_cast<int>(path) << ", fuse " << fuse << ", n " << n);
  const ex::ModelConfig c = gemm_config();
  const ex::ModelWeights w = rounded_to_bf16(ex::make_synthetic_weights(c, rng()));
  ex::CudaBackendOptions o;
  o.weights = wt;
  o.matmul_path = path;
  o.fuse = fuse;
  ex::CudaBackend be(o);
  const ex::CudaBackend::WeightStore ws = be.upload(w);
  const ex::WeightPtrs& p = ws.ptrs();
  const int D = c.dim, QD = c.q_dim(), KVD = c.kv_dim(), H = c.hidden_dim, V = c.vocab_size;
  const std::size_t N = static_cast<std::size_t>(n);
  const bool bf16 = wt == ex::WeightType::kBF16;
  // bf16 x for the tensor cores: cuBLAS always, gemv_mma_kernel from 3 rows (m rows in one launch)
  auto rounds = [&](int m) { return bf16 && (ex::use_cublas(path, true, m) || m >= 3); };

  const std::vector<float> x0 = triattn::test::random_values<float>(rng, N * D);
  const std::vector<float> att0 = triattn::test::random_values<float>(rng, N * QD);
  const std::vector<float> res0 = triattn::test::random_values<float>(rng, N * D);
  DeviceBuffer<float> x(x0), att(att0), res_o(res0), res_d(res0);
  DeviceBuffer<float> xb(N * D), q(N * QD), k(N * KVD), v(N * KVD), xb2(N * D), h1(N * H), h3(N * H), xb3(N * D);
  DeviceBuffer<float> xf(N * D), logits(N * V);
  for (DeviceBuffer<float>* b : {&xb, &q, &k, &v, &xb2, &h1, &h3, &xb3, &xf, &logits}) b->poison();

  // the model's order (model.hpp): attention block, then the MLP block
  be.rmsnorm(xb.get(), x.get(), p.rms_att, n, D, c.rms_eps);
  be.matmul(q.get(), p.wq, xb.get(), n, QD, D);
  be.matmul(k.get(), p.wk, xb.get(), n, KVD, D);
  be.matmul(v.get(), p.wv, xb.get(), n, KVD, D);
  be.add_bias(q.get(), p.bq, n, QD);
  be.add_bias(k.get(), p.bk, n, KVD);
  be.add_bias(v.get(), p.bv, n, KVD);
  be.matmul(xb2.get(), p.wo, att.get(), n, D, QD);
  be.add(res_o.get(), xb2.get(), n * D);
  be.matmul(h1.get(), p.w1, xb.get(), n, H, D);
  be.matmul(h3.get(), p.w3, xb.get(), n, H, D);
  be.swiglu(h1.get(), h3.get(), n * H);
  be.matmul(xb3.get(), p.w2, h1.get(), n, D, H);
  be.add(res_d.get(), xb3.get(), n * D);
  // classifier over every other row (one picked row: the single-row path)
  std::vector<int> picked;
  for (int r = 0; r < n; r += 2) picked.push_back(r);
  for (std::size_t i = 0; i < picked.size(); ++i) {
    const std::size_t r = static_cast<std::size_t>(picked[i]);
    be.rmsnorm(xf.get() + r * D, x.get() + r * D, p.rms_final, 1, D, c.rms_eps);
    be.matmul(logits.get() + i * V, p.wcls, xf.get() + r * D, 1, V, D);
  }
  be.synchronize();

  const std::vector<float> hxb = host(xb), hq = host(q), hk = host(k), hv = host(v), hro = host(res_o),
                           hh1 = host(h1), hh3 = host(h3), hrd = host(res_d), hxf = host(xf), hl = host(logits);
  Checker ck;
  // RMSNorm output against float64 (it feeds the references below as read)
  for (int r = 0; r < n; ++r) {
    double ss = 0;
    for (int i = 0; i < D; ++i) ss += static_cast<double>(x0[static_cast<std::size_t>(r) * D + i]) * x0[static_cast<std::size_t>(r) * D + i];
    const double inv = 1.0 / std::sqrt(ss / D + c.rms_eps);
    for (int i = 0; i < D; ++i) {
      const std::size_t e = static_cast<std::size_t>(r) * D + i;
      const double want = static_cast<double>(w.rms_att[static_cast<std::size_t>(i)]) * inv * x0[e];
      ck.near(hxb[e], want, std::fabs(want), D, 8);
    }
  }
  auto check_mat = [&](const std::vector<float>& got, const float* W, const float* bias, int M, int K,
                       const std::vector<float>& in, const std::vector<float>* res, std::size_t row_in, std::size_t row_out,
                       int launch_rows) {
    const std::vector<Ref> ref = ref_matvec(W, M, K, in.data() + row_in * K, rounds(launch_rows));
    for (int i = 0; i < M; ++i) {
      double want = ref[static_cast<std::size_t>(i)].value + (bias != nullptr ? bias[i] : 0.0);
      if (res != nullptr) want += (*res)[row_out * M + i];
      ck.near(got[row_out * M + i], want, ref[static_cast<std::size_t>(i)].mag, K, 2);
    }
  };
  for (std::size_t r = 0; r < N; ++r) {
    check_mat(hq, w.wq.data(), w.bq.data(), QD, D, hxb, nullptr, r, r, n);
    check_mat(hk, w.wk.data(), w.bk.data(), KVD, D, hxb, nullptr, r, r, n);
    check_mat(hv, w.wv.data(), w.bv.data(), KVD, D, hxb, nullptr, r, r, n);
    check_mat(hro, w.wo.data(), nullptr, D, QD, att0, &res0, r, r, n);
    // SwiGLU: h3 = up, h1 = silu(gate) * up
    const std::vector<Ref> g = ref_matvec(w.w1.data(), H, D, hxb.data() + r * D, rounds(n));
    const std::vector<Ref> u = ref_matvec(w.w3.data(), H, D, hxb.data() + r * D, rounds(n));
    for (int i = 0; i < H; ++i) {
      const double gv = g[static_cast<std::size_t>(i)].value, uv = u[static_cast<std::size_t>(i)].value;
      const double sg = gv / (1.0 + std::exp(-gv));
      ck.near(hh3[r * H + i], uv, u[static_cast<std::size_t>(i)].mag, D, 1);
      // d(silu(g) up) = up silu'(g) dg + silu(g) dup, silu' <= 1.1
      const double mag = 1.1 * std::fabs(uv) * g[static_cast<std::size_t>(i)].mag + std::fabs(sg) * u[static_cast<std::size_t>(i)].mag;
      ck.near(hh1[r * H + i], sg * uv, mag, D, 6);
    }
    check_mat(hrd, w.w2.data(), nullptr, D, H, hh1, &res0, r, r, n);
  }
  // fused, the picked rows go through one launch (from 2 rows); unfused, one row at a time
  const int cls_rows = fuse && picked.size() >= 2 ? static_cast<int>(picked.size()) : 1;
  for (std::size_t i = 0; i < picked.size(); ++i)
    check_mat(hl, w.wcls.data(), nullptr, V, D, hxf, nullptr, static_cast<std::size_t>(picked[i]), i, cls_rows);
  CHECK_MESSAGE(ck.bad == 0, ck.bad << " of " << ck.checked << " outputs outside the bound (worst inside: " << ck.worst << ")");
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("cuBLAS matmuls: the recorder's fused groups against a float64 reference") {
  triattn::test::require_device();
  const std::uint64_t seed = triattn::test::test_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const ex::WeightType wt : {ex::WeightType::kF32, ex::WeightType::kBF16})
    for (const ex::MatmulPath path : {ex::MatmulPath::kGemv, ex::MatmulPath::kCublas, ex::MatmulPath::kAuto})
      for (const int n : {1, 2, 3, 17, 64, 130}) run_groups(wt, path, true, n, rng);
  for (const ex::WeightType wt : {ex::WeightType::kF32, ex::WeightType::kBF16})
    for (const int n : {1, 40}) run_groups(wt, ex::MatmulPath::kCublas, false, n, rng);
}

TEST_CASE("cuBLAS matmuls in Model steps: close to the GEMV kernels and captured in CUDA graphs") {
  triattn::test::require_device();
  ex::ModelConfig c = gemm_config();
  c.n_layers = 2;
  c.has_qkv_bias = false;
  const ex::ModelWeights w = ex::make_synthetic_weights(c, triattn::test::test_seed());
  constexpr int kBatch = 6, kSteps = 8;
  std::vector<std::vector<int>> prompts;
  for (int i = 0; i < kBatch; ++i) prompts.push_back(prompt_tokens(5 + 7 * i, i, c.vocab_size));
  const auto cfg = triattn::test::cache_config(c, 64 + kSteps, kBatch);
  auto run = [&](ex::CudaBackendOptions o, ex::CudaBackend::Stats* st) {
    ex::CudaBackend be(o);
    ex::Model<ex::CudaBackend> model(w, be);
    ex::GpuPlainCache cache(cfg, triattn::cuda::DeviceCompactor(be.stream()));
    std::vector<triattn::SeqId> ids;
    std::vector<ex::Chunk> chunks;
    for (const auto& pr : prompts) {
      ids.push_back(cache.add_sequence());
      chunks.push_back(ex::Chunk{ids.back(), pr, triattn::Phase::kPrefill});
    }
    std::vector<float> all = model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk).logits;
    std::vector<int> tok(kBatch);
    for (int s = 0; s < kSteps; ++s) {
      chunks.clear();
      for (int i = 0; i < kBatch; ++i) {
        tok[static_cast<std::size_t>(i)] = (s * 13 + i * 7 + 5) % c.vocab_size;
        chunks.push_back(ex::Chunk{ids[static_cast<std::size_t>(i)], std::span<const int>(&tok[static_cast<std::size_t>(i)], 1),
                                   triattn::Phase::kDecode});
      }
      const std::vector<float> l = model.step(cache, chunks, ex::LogitsFor::kLastOfEachChunk).logits;
      all.insert(all.end(), l.begin(), l.end());
    }
    if (st != nullptr) *st = be.stats();
    CHECK(be.options().graphs == o.graphs);  // a failed capture would have turned graphs off
    return all;
  };
  for (const ex::WeightType wt : {ex::WeightType::kF32, ex::WeightType::kBF16}) {
    INFO("weights " << ex::weight_type_name(wt));
    ex::CudaBackendOptions gemv;
    gemv.weights = wt;
    gemv.matmul_path = ex::MatmulPath::kGemv;
    ex::CudaBackendOptions cub = gemv;
    cub.matmul_path = ex::MatmulPath::kCublas;
    ex::CudaBackendOptions cub_eager = cub;
    cub_eager.graphs = false;
    ex::CudaBackend::Stats st;
    const std::vector<float> a = run(gemv, nullptr), b = run(cub, &st), e = run(cub_eager, nullptr);
    CHECK(b == e);  // captured cuBLAS calls compute what eager ones do
    CHECK(st.graph_captures >= 1);
    CHECK(st.graph_replays >= kSteps - 1);
    REQUIRE(a.size() == b.size());
    float worst = 0.0f, scale = 0.0f;
    for (std::size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::fabs(a[i] - b[i]));
      scale = std::max(scale, std::fabs(a[i]));
    }
    // fp32: both paths are fp32 throughout; bf16: the GEMV path keeps x in fp32 at 1-2 rows.
    const float tol = wt == ex::WeightType::kF32 ? 1e-4f : 3e-2f;
    CHECK_MESSAGE(worst <= tol * scale, "max |cuBLAS - GEMV| logit " << worst << " vs max |logit| " << scale);
  }
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// cuda::decode_attention vs ref::attention: page sizes {1, 7, 16, 64}, both layouts, head_dim 64
// and 128, fp32/fp16/bf16/fp8 (per-head K and V scales, float queries), GQA groups 1, 4 and 12 (12 needs two passes of 8 heads), lengths
// 0, 1, 15, 16, 17 and random, sequences picked through seq_ids, and plans with one split, the
// device's own choice, many splits and an odd split length. Outputs and the workspace are
// poisoned (NaN) before each launch.
// Bound: ||out - ref|| / ||ref|| <= 1e-5 (fp32, fp8), 1e-3 (16-bit caches, float out), plus the
// output's own rounding for 16-bit outputs.
#include "cuda_test_utils.cuh"

#include <cmath>
#include <cstring>

#include <triattn/core/ref/attention.hpp>
#include <triattn/cuda/algorithms/decode_attention.cuh>

namespace {

using namespace triattn;
using test::DeviceBuffer;
using test::PagedFixture;

constexpr int kGroups[] = {1, 4, 12};

/// ||got - want|| / ||want||; every element must be finite (the output was poisoned with NaN).
template <class O>
double rel_error(const std::vector<O>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = to_float(got[i]);
    REQUIRE_MESSAGE(std::isfinite(g), "output element ", i, " not written or not finite");
    num += (g - want[i]) * (g - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// fp8 caches run the fp32 kernel on the same dequantised values as the reference: fp32's bound.
template <class T>
double tolerance(bool out_is_t) {
  const double kernel = std::is_same_v<T, float> || is_scaled_dtype<T> ? 1e-5 : 1e-3;
  if (!out_is_t || std::is_same_v<T, float>) return kernel;
  return kernel + (std::is_same_v<T, bf16_storage> ? 0x1p-8 : 0x1p-11);  // the output's own rounding
}

/// Runs `plan` and checks the output.
template <class T, class O>
void run_and_check(const PagedFixture<T>& f, const cuda::DecodeAttentionPlan& plan, int layer,
                   const DeviceBuffer<cuda::query_type_t<T>>& dq, const DeviceBuffer<std::int32_t>* dids, int batch, int hq, float scale,
                   const std::vector<float>& want) {
  const int d = f.block.head_dim;
  DeviceBuffer<O> out(static_cast<std::size_t>(batch) * hq * d);
  const std::size_t ws_bytes = cuda::decode_attention::workspace_size(plan, batch, hq, d);
  DeviceBuffer<unsigned char> ws(ws_bytes);
  ws.poison();
  const bool out_is_t = !std::is_same_v<O, float>;
  CAPTURE(out_is_t);
  CAPTURE(plan.num_splits);
  CAPTURE(plan.tokens_per_split);
  out.poison();
  TRIATTN_TEST_CUDA(cuda::decode_attention::run(plan, f.device_view(), layer, dq.get(), out.get(), batch, hq,
                                                dids ? dids->get() : nullptr, scale, ws_bytes ? ws.get() : nullptr,
                                                ws_bytes, nullptr));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  const double err = rel_error(out.download(), want);
  CHECK_MESSAGE(err <= tolerance<T>(out_is_t), "relative error ", err);
}

}  // namespace

TEST_CASE("decode_attention: plan and workspace arithmetic (no device needed)") {
  using DA = cuda::decode_attention;
  // batch 1 x 32K, 8 KV heads, GQA 4: splits fill the resident CTAs (one wave)
  const auto p1 = DA::make_plan(DType::kBF16, 1, 8, 4, 32768, 396);
  CHECK(p1.heads_per_pass == 8);
  CHECK(p1.num_splits * 8 <= 396);
  CHECK(p1.num_splits * p1.tokens_per_split >= 32768);
  CHECK(p1.tokens_per_split % cuda::tuning::sm90::DecodeAttention::kSplitGranule == 0);
  // many sequences already fill the GPU: no split, no workspace
  const auto p2 = DA::make_plan(DType::kBF16, 64, 8, 4, 4096, 396);
  CHECK(p2.num_splits == 1);
  CHECK(DA::workspace_size(p2, 64, 32, 128) == 0);
  // short sequences are not split below kMinTokensPerSplit
  const auto p3 = DA::make_plan(DType::kF32, 1, 1, 4, 300, 1000);
  CHECK(p3.heads_per_pass == 4);
  CHECK(p3.num_splits <= 2);
  CHECK(DA::workspace_size(p1, 1, 32, 128) >= static_cast<std::size_t>(32) * p1.num_splits * (128 + 2) * 4);
  KvCacheView<bf16_storage, std::int32_t> v{};
  v.block = BlockLayout{KvLayout::kNHD, 16, 8, 128};
  v.num_layers = 1;
  float* out = nullptr;
  CHECK(DA::run(p1, v, 0, static_cast<const bf16_storage*>(nullptr), out, 1, 32, nullptr, 1.f, nullptr, 0, nullptr) ==
        cudaErrorInvalidValue);
  CHECK(DA::run(p1, v, 0, static_cast<const bf16_storage*>(nullptr), out, 0, 32, nullptr, 1.f, nullptr, 0, nullptr) ==
        cudaSuccess);
}

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("decode_attention: paged GQA decode vs ref::attention", T, float, f16_storage, bf16_storage,
                     fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed, " (set TRIATTN_TEST_SEED to replay)");
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>());
    for (int bs : test::kPageSizes)
      for (KvLayout layout : test::kLayouts)
        for (int d : test::kHeadDims)
          for (int group : kGroups) {
            CAPTURE(seed);
            CAPTURE(bs);
            CAPTURE(layout_name(layout));
            CAPTURE(d);
            CAPTURE(group);
            const int layers = 2, hkv = 2, hq = hkv * group, layer = 1;
            std::vector<int> lens{0, 1, 15, 16, 17};
            for (int i = 0; i < 3; ++i) lens.push_back(std::uniform_int_distribution<int>(18, 700)(rng));
            PagedFixture<T> f(rng, layout, bs, hkv, d, layers, lens, lens);
            // Batch: all sequences in shuffled order (the empty one included).
            std::vector<std::int32_t> ids(lens.size());
            std::iota(ids.begin(), ids.end(), 0);
            std::shuffle(ids.begin(), ids.end(), rng);
            const int batch = static_cast<int>(ids.size());
            const auto q = test::random_values<cuda::query_type_t<T>>(rng, static_cast<std::size_t>(batch) * hq * d, 2.0f);
            const float scale = ref::default_sm_scale(d);
            std::vector<float> want(q.size());
            const std::vector<int> seqs(ids.begin(), ids.end());
            ref::attention(f.host_view(), layer, std::span<const int>(seqs), q.data(), hq, want.data(), scale);

            DeviceBuffer<cuda::query_type_t<T>> dq(q);
            DeviceBuffer<std::int32_t> dids(ids);
            const int max_len = *std::max_element(lens.begin(), lens.end());
            int resident = 0;
            TRIATTN_TEST_CUDA(cuda::decode_attention::resident_ctas<T>(d, &resident));
            std::vector<cuda::DecodeAttentionPlan> plans;
            plans.push_back(cuda::decode_attention::make_plan(dtype_of<T>, batch, hkv, group, max_len, resident));
            auto forced = plans.front();
            forced.num_splits = 1;
            forced.tokens_per_split = max_len;
            plans.push_back(forced);
            forced.tokens_per_split = 64;
            forced.num_splits = (max_len + 63) / 64;
            plans.push_back(forced);
            forced.tokens_per_split = 80;  // not a multiple of the tile: warps' last tiles are partial
            forced.num_splits = (max_len + 79) / 80;
            plans.push_back(forced);
            forced.tokens_per_split = 16;  // one tile per split: most warps of a CTA have no tokens
            forced.num_splits = (max_len + 15) / 16;
            plans.push_back(forced);
            for (const auto& plan : plans) {
              run_and_check<T, float>(f, plan, layer, dq, &dids, batch, hq, scale, want);
              if constexpr (!is_scaled_dtype<T>) run_and_check<T, T>(f, plan, layer, dq, &dids, batch, hq, scale, want);
            }
          }
  }

  TEST_CASE_TEMPLATE("decode_attention: null seq_ids with peaked softmax and a long sequence", T, float, bf16_storage,
                     fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ 5);
    const int hkv = 8, group = 4, hq = 32, d = 128;
    const std::vector<int> lens{5000, 3, 1200};
    PagedFixture<T> f(rng, KvLayout::kNHD, 16, hkv, d, 1, lens, lens);
    const int batch = 3;
    const auto q = test::random_values<cuda::query_type_t<T>>(rng, static_cast<std::size_t>(batch) * hq * d, 8.0f);  // large logits
    const float scale = ref::default_sm_scale(d);
    std::vector<float> want(q.size());
    const std::vector<int> seqs{0, 1, 2};
    ref::attention(f.host_view(), 0, std::span<const int>(seqs), q.data(), hq, want.data(), scale);
    DeviceBuffer<cuda::query_type_t<T>> dq(q);
    int resident = 0;
    TRIATTN_TEST_CUDA(cuda::decode_attention::resident_ctas<T>(d, &resident));
    auto plan = cuda::decode_attention::make_plan(dtype_of<T>, batch, hkv, group, 5000, resident);
    CHECK(plan.num_splits > 1);
    run_and_check<T, float>(f, plan, 0, dq, nullptr, batch, hq, scale, want);
    plan.num_splits = 1;  // one CTA per head group: ~80 tiles per warp through the pipeline
    plan.tokens_per_split = 5000;
    run_and_check<T, float>(f, plan, 0, dq, nullptr, batch, hq, scale, want);
  }

  TEST_CASE("decode_attention: replays from a CUDA graph") {
    // Graph replays re-run the programmatic dependent launch of the combine kernel.
    test::require_device();
    using T = bf16_storage;
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ 7);
    const int hkv = 8, group = 4, hq = 32, d = 128, batch = 2;
    const std::vector<int> lens{3000, 777};
    PagedFixture<T> f(rng, KvLayout::kHND, 16, hkv, d, 1, lens, lens);
    const auto q = test::random_values<T>(rng, static_cast<std::size_t>(batch) * hq * d, 2.0f);
    const float scale = ref::default_sm_scale(d);
    std::vector<float> want(q.size());
    const std::vector<int> seqs{0, 1};
    ref::attention(f.host_view(), 0, std::span<const int>(seqs), q.data(), hq, want.data(), scale);
    DeviceBuffer<cuda::query_type_t<T>> dq(q);
    cudaStream_t stream;
    TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      int resident = 0;
      TRIATTN_TEST_CUDA(cuda::decode_attention::resident_ctas<T>(d, &resident));
      const auto plan = cuda::decode_attention::make_plan(dtype_of<T>, batch, hkv, group, 3000, resident);
      REQUIRE(plan.num_splits > 1);
      const std::size_t ws_bytes = cuda::decode_attention::workspace_size(plan, batch, hq, d);
      DeviceBuffer<unsigned char> ws(ws_bytes);
      TRIATTN_TEST_CUDA(cudaMemset(ws.get(), 0xFF, ws.size()));
      TRIATTN_TEST_CUDA(cudaDeviceSynchronize());  // the memset ran on the legacy stream: `stream` would not wait
      DeviceBuffer<float> out(q.size());
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      TRIATTN_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const cudaError_t launched = cuda::decode_attention::run(plan, f.device_view(), 0, dq.get(), out.get(), batch, hq,
                                                               nullptr, scale, ws.get(), ws_bytes, stream);
      TRIATTN_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
      TRIATTN_TEST_CUDA(launched);
      TRIATTN_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int rep = 0; rep < 3; ++rep) {
        CAPTURE(rep);
        out.poison();
        TRIATTN_TEST_CUDA(cudaGraphLaunch(exec, stream));
        TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
        const double err = rel_error(out.download(), want);
        CHECK_MESSAGE(err <= tolerance<T>(false), "relative error ", err);
      }
      TRIATTN_TEST_CUDA(cudaGraphExecDestroy(exec));
      TRIATTN_TEST_CUDA(cudaGraphDestroy(graph));
    }
    TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
  }
}

// SPDX-License-Identifier: Apache-2.0
// cuda::compact vs ref::compact, bitwise, over a batch of sequences in one launch: page sizes
// {1, 7, 16, 64}, both layouts, head_dim 64 and 128, fp32/fp16/bf16/fp8, shuffled block tables.
// Plans include the adversarial in-place patterns (keep every other, keep the last half, keep
// all but the first, random subsets, identity) on rows long enough for many chunks; the whole
// pool is compared, so a read-after-write race or a stray write fails. The same binary under
// `compute-sanitizer --tool racecheck` checks the kernel's shared-memory protocol. Every work split
// (column parts 1, 2 x 4 or 8 vectors per thread, and the automatic choice) runs on the same
// original cache and must give the same pool.
#include "cuda_test_utils.cuh"

#include <triattn/core/keep_plan.hpp>
#include <triattn/core/ref/compact.hpp>
#include <triattn/cuda/algorithms/compact.cuh>

namespace {

using namespace triattn;
using test::DeviceBuffer;
using test::PagedFixture;

// {parts, vecs_per_thread}: the automatic choice first, then every compiled split.
constexpr cuda::CompactOptions kSplits[] = {{0, 0}, {1, 4}, {1, 8}, {2, 4}, {2, 8}};

enum class Pattern { kEveryOther, kLastHalf, kAllButFirst, kRandom, kIdentity, kPrefixThenRandom, kCount };

const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kEveryOther: return "every other";
    case Pattern::kLastHalf: return "last half";
    case Pattern::kAllButFirst: return "all but first";
    case Pattern::kRandom: return "random";
    case Pattern::kIdentity: return "identity";
    case Pattern::kPrefixThenRandom: return "prefix then random";
    default: return "?";
  }
}

/// A KeepPlan of `pattern` for a sequence of `len` >= 1 tokens; random rows differ per (layer, head).
KeepPlan make_plan(std::mt19937_64& rng, Pattern pattern, int layers, int heads, int len) {
  int keep = 0;
  switch (pattern) {
    case Pattern::kEveryOther: keep = (len + 1) / 2; break;
    case Pattern::kLastHalf: keep = (len + 1) / 2; break;
    case Pattern::kAllButFirst: keep = len > 1 ? len - 1 : 1; break;
    case Pattern::kRandom: keep = std::uniform_int_distribution<int>(1, len)(rng); break;
    case Pattern::kIdentity: keep = std::uniform_int_distribution<int>(1, len)(rng); break;
    case Pattern::kPrefixThenRandom: keep = std::uniform_int_distribution<int>(1, len)(rng); break;
    default: break;
  }
  KeepPlan plan(layers, heads, keep);
  std::vector<std::int32_t> all(static_cast<std::size_t>(len));
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < heads; ++h) {
      std::int32_t* r = plan.row(l, h);
      switch (pattern) {
        case Pattern::kEveryOther:
          for (int i = 0; i < keep; ++i) r[i] = 2 * i;
          break;
        case Pattern::kLastHalf:
          for (int i = 0; i < keep; ++i) r[i] = len - keep + i;
          break;
        case Pattern::kAllButFirst:
          for (int i = 0; i < keep; ++i) r[i] = len > 1 ? i + 1 : 0;
          break;
        case Pattern::kIdentity:
          for (int i = 0; i < keep; ++i) r[i] = i;
          break;
        case Pattern::kRandom:
        case Pattern::kPrefixThenRandom: {
          const int prefix = pattern == Pattern::kRandom ? 0 : std::uniform_int_distribution<int>(0, keep)(rng);
          for (int i = 0; i < prefix; ++i) r[i] = i;
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin() + prefix, all.end(), rng);
          std::sort(all.begin() + prefix, all.begin() + keep);
          for (int i = prefix; i < keep; ++i) r[i] = all[static_cast<std::size_t>(i)];
          break;
        }
        default: break;
      }
    }
  plan.validate(layers, heads, len);
  return plan;
}

/// Packs per-entry plans into the device layout [batch, L, Hkv, max_keep] (padding: -7, never read).
struct DevicePlan {
  DeviceBuffer<std::int32_t> kept, keep, seq_ids;
  int max_keep = 0;
  DevicePlan(const std::vector<KeepPlan>& plans, const std::vector<int>& seqs) {
    for (const auto& p : plans) max_keep = std::max(max_keep, p.keep);
    const int layers = plans.front().num_layers, heads = plans.front().num_kv_heads;
    std::vector<std::int32_t> k(plans.size() * layers * heads * static_cast<std::size_t>(max_keep), -7), n, ids;
    for (std::size_t b = 0; b < plans.size(); ++b) {
      for (int l = 0; l < layers; ++l)
        for (int h = 0; h < heads; ++h)
          std::copy_n(plans[b].row(l, h), plans[b].keep,
                      k.begin() + static_cast<std::ptrdiff_t>(((b * layers + l) * heads + h) * max_keep));
      n.push_back(plans[b].keep);
      ids.push_back(seqs[b]);
    }
    kept = DeviceBuffer<std::int32_t>(k);
    keep = DeviceBuffer<std::int32_t>(n);
    seq_ids = DeviceBuffer<std::int32_t>(ids);
  }
  [[nodiscard]] cuda::CompactParams params() const { return {kept.get(), keep.get(), seq_ids.get(), max_keep}; }
};

}  // namespace

TEST_CASE("compact: argument checks (no device needed)") {
  KvCacheView<float, std::int32_t> v{};
  v.block = BlockLayout{KvLayout::kNHD, 16, 2, 128};
  v.num_layers = 2;
  CHECK(cuda::compact::run(v, cuda::CompactParams{}, 0, nullptr) == cudaSuccess);
  CHECK(cuda::compact::run(v, cuda::CompactParams{nullptr, nullptr, nullptr, 4}, 1, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda::compact::run(v, cuda::CompactParams{}, -1, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda::compact::run(v, cuda::CompactParams{}, 1, nullptr, cuda::CompactOptions{3, 0}) == cudaErrorInvalidValue);
  CHECK(cuda::compact::run(v, cuda::CompactParams{}, 1, nullptr, cuda::CompactOptions{0, 6}) == cudaErrorInvalidValue);
}

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("compact: batch of sequences with adversarial and random plans in one launch", T, float, f16_storage,
                     bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed, " (set TRIATTN_TEST_SEED to replay)");
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>());
    for (int bs : test::kPageSizes)
      for (KvLayout layout : test::kLayouts)
        for (int d : test::kHeadDims) {
          CAPTURE(seed);
          CAPTURE(bs);
          CAPTURE(layout_name(layout));
          CAPTURE(d);
          const int layers = 2, heads = 3;
          constexpr int kPatterns = static_cast<int>(Pattern::kCount);
          // One sequence per pattern plus a long one (many chunks); sequence 0 stays untouched.
          std::vector<int> lens{37};
          for (int i = 0; i < kPatterns; ++i) lens.push_back(std::uniform_int_distribution<int>(1, 300)(rng));
          lens.push_back(std::uniform_int_distribution<int>(700, 1100)(rng));
          PagedFixture<T> f(rng, layout, bs, heads, d, layers, lens, lens);
          std::vector<KeepPlan> plans;
          std::vector<int> seqs;
          for (int s = 1; s < static_cast<int>(lens.size()); ++s) {
            const Pattern pat = s <= kPatterns ? static_cast<Pattern>(s - 1)
                                               : static_cast<Pattern>(rng() % static_cast<unsigned>(kPatterns));
            CAPTURE(pattern_name(pat));
            plans.push_back(make_plan(rng, pat, layers, heads, lens[static_cast<std::size_t>(s)]));
            seqs.push_back(s);
          }
          // Entries in shuffled order: the launch must not depend on it.
          std::vector<std::size_t> order(plans.size());
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(), rng);
          std::vector<KeepPlan> plans_o;
          std::vector<int> seqs_o;
          for (std::size_t i : order) {
            plans_o.push_back(plans[i]);
            seqs_o.push_back(seqs[i]);
          }
          // A padding entry (sequence -1) in the middle must be skipped.
          plans_o.insert(plans_o.begin() + 1, plans_o.front());
          seqs_o.insert(seqs_o.begin() + 1, -1);
          const std::vector<T> original = f.pool;
          auto hv = f.host_view();
          for (std::size_t b = 0; b < plans_o.size(); ++b)
            if (seqs_o[b] >= 0) ref::compact(hv, seqs_o[b], plans_o[b]);
          const DevicePlan dp(plans_o, seqs_o);
          for (const cuda::CompactOptions& o : kSplits) {
            CAPTURE(o.parts);
            CAPTURE(o.vecs_per_thread);
            f.d_pool.upload(original);
            TRIATTN_TEST_CUDA(
                cuda::compact::run(f.device_view(), dp.params(), static_cast<int>(plans_o.size()), nullptr, o));
            TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
            test::require_bitwise_equal(f.d_pool.download(), f.pool, "cache pool after compaction");
          }
        }
  }

  TEST_CASE("compact: long rows with every in-place pattern repeated on fresh data (race stress)") {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ 77);
    using T = bf16_storage;
    const int layers = 2, heads = 8, d = 128, len = 2000;
    for (int round = 0; round < 3; ++round)
      for (Pattern pat : {Pattern::kAllButFirst, Pattern::kEveryOther, Pattern::kLastHalf, Pattern::kRandom}) {
        CAPTURE(seed);
        CAPTURE(round);
        CAPTURE(pattern_name(pat));
        const KvLayout layout = round % 2 ? KvLayout::kHND : KvLayout::kNHD;
        PagedFixture<T> f(rng, layout, 16, heads, d, layers, {len, len}, {len, len});
        std::vector<KeepPlan> plans{make_plan(rng, pat, layers, heads, len), make_plan(rng, pat, layers, heads, len)};
        const std::vector<T> original = f.pool;
        auto hv = f.host_view();
        ref::compact(hv, 0, plans[0]);
        ref::compact(hv, 1, plans[1]);
        const DevicePlan dp(plans, {0, 1});
        for (const cuda::CompactOptions& o : kSplits) {
          CAPTURE(o.parts);
          CAPTURE(o.vecs_per_thread);
          f.d_pool.upload(original);
          TRIATTN_TEST_CUDA(cuda::compact::run(f.device_view(), dp.params(), 2, nullptr, o));
          TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
          test::require_bitwise_equal(f.d_pool.download(), f.pool, "cache pool after compaction");
        }
      }
  }
}

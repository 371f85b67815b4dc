// SPDX-License-Identifier: Apache-2.0
// cuda::append vs ref::append, bitwise: every page size in {1, 7, 16, 64}, both layouts, head_dim
// 64 and 128, fp32/fp16/bf16/fp8, shuffled block tables, several sequences of different lengths,
// -1 padding slots, one layer and all layers per launch; and the quantising append (float in,
// fp8 with per-head scales and saturation) vs host::append_values. The whole pool is compared, so
// stray writes fail too; target slots are poisoned (NaN) before the launch, so missed writes fail.
#include "cuda_test_utils.cuh"

#include <triattn/core/host_kv_ops.hpp>
#include <triattn/core/ref/compact.hpp>
#include <triattn/cuda/algorithms/append.cuh>

namespace {

using namespace triattn;
using test::DeviceBuffer;
using test::PagedFixture;

}  // namespace

TEST_CASE("append: argument checks (no device needed)") {
  KvCacheView<bf16_storage, std::int32_t> v{};
  v.block = BlockLayout{KvLayout::kNHD, 16, 2, 128};
  v.num_layers = 2;
  const bf16_storage* null_t = nullptr;
  // null inputs, layers out of range, an uncompiled head_dim: rejected before any launch
  CHECK(cuda::append::run_slots(v, 0, 1, null_t, null_t, nullptr, 4, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda::append::run_slots(v, 1, 2, null_t, null_t, nullptr, 4, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda::append::run_slots(v, 0, 1, null_t, null_t, nullptr, 0, nullptr) == cudaSuccess);
  alignas(16) static bf16_storage buf[96 * 2 * 4];
  static std::int64_t slots[4];
  v.data = buf;
  v.block.head_dim = 96;
  CHECK(cuda::append::run_slots(v, 0, 1, buf, buf, slots, 2, nullptr) == cudaErrorNotSupported);
  v.block.head_dim = 128;
  CHECK(cuda::append::run_slots(v, 0, 1, buf + 1, buf, slots, 2, nullptr) == cudaErrorInvalidValue);  // misaligned
  std::int64_t out[3];
  const std::int32_t table[2] = {5, 2};
  CHECK(cuda::append::host_slot_mapping(table, 16, 15, 3, out));
  CHECK(out[0] == 5 * 16 + 15);
  CHECK(out[1] == 2 * 16 + 0);
  CHECK(out[2] == 2 * 16 + 1);
  CHECK_FALSE(cuda::append::host_slot_mapping(table, 16, 30, 3, out));  // slot 32 has no block
}

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("append: prefill of several sequences through a slot mapping - all layers in one launch", T, float,
                     f16_storage, bf16_storage, fp8_e4m3_storage) {
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
          const int layers = 3, heads = 4, nseq = 4;
          std::vector<int> lens0(nseq), add(nseq), cap(nseq);
          for (int s = 0; s < nseq; ++s) {
            lens0[s] = std::uniform_int_distribution<int>(0, 70)(rng);
            add[s] = std::uniform_int_distribution<int>(1, 40)(rng);
            cap[s] = lens0[s] + add[s];
          }
          PagedFixture<T> f(rng, layout, bs, heads, d, layers, cap, lens0);
          // Tokens of all sequences interleaved, with -1 padding entries mixed in.
          std::vector<std::pair<int, int>> tok;  // (seq, slot); seq -1 = padding
          std::vector<int> next(lens0);
          for (bool more = true; more;) {
            more = false;
            for (int s = 0; s < nseq; ++s)
              if (next[s] < cap[s]) {
                tok.emplace_back(s, next[s]++);
                more = true;
                if (rng() % 5 == 0) tok.emplace_back(-1, -1);
              }
          }
          const int n = static_cast<int>(tok.size());
          const std::size_t per_tok = static_cast<std::size_t>(heads) * d;
          const auto k = test::random_values<T>(rng, layers * n * per_tok);
          const auto v = test::random_values<T>(rng, layers * n * per_tok);
          std::vector<std::int64_t> slots(static_cast<std::size_t>(n), -1);
          for (int t = 0; t < n; ++t) {
            const auto [s, slot] = tok[static_cast<std::size_t>(t)];
            if (s < 0) continue;
            const std::span<const std::int32_t> row(f.tables.data() + static_cast<std::size_t>(s) * f.max_blocks_per_seq,
                                                    static_cast<std::size_t>(f.max_blocks_per_seq));
            REQUIRE(cuda::append::host_slot_mapping(row, bs, slot, 1, &slots[static_cast<std::size_t>(t)]));
          }
          for (int s = 0; s < nseq; ++s) f.poison_slots(s, lens0[s], add[s]);
          f.upload_pool();
          auto hv = f.host_view();
          for (int t = 0; t < n; ++t) {
            const auto [s, slot] = tok[static_cast<std::size_t>(t)];
            if (s < 0) continue;
            for (int l = 0; l < layers; ++l) {
              const std::size_t off = (static_cast<std::size_t>(l) * n + t) * per_tok;
              ref::append(hv, s, l, slot, k.data() + off, v.data() + off, 1);
            }
          }
          DeviceBuffer<T> dk(k), dv(v);
          DeviceBuffer<std::int64_t> dslots(slots);
          TRIATTN_TEST_CUDA(
              cuda::append::run_slots(f.device_view(), 0, layers, dk.get(), dv.get(), dslots.get(), n, nullptr));
          TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
          test::require_bitwise_equal(f.d_pool.download(), f.pool, "cache pool after append");
        }
  }

  TEST_CASE_TEMPLATE("append: decode - one token per sequence at its last slot (device tables)", T, float, f16_storage,
                     bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ 1);
    for (int bs : test::kPageSizes)
      for (KvLayout layout : test::kLayouts)
        for (int d : test::kHeadDims) {
          CAPTURE(seed);
          CAPTURE(bs);
          CAPTURE(layout_name(layout));
          CAPTURE(d);
          const int layers = 2, heads = 2, nseq = 6;
          std::vector<int> lens(nseq);
          for (int s = 0; s < nseq; ++s) lens[s] = std::uniform_int_distribution<int>(1, 90)(rng);  // after extend
          PagedFixture<T> f(rng, layout, bs, heads, d, layers, lens, lens);
          // Batch: sequences in shuffled order, one padding entry (-1), one sequence left out.
          std::vector<std::int32_t> ids(nseq);
          std::iota(ids.begin(), ids.end(), 0);
          std::shuffle(ids.begin(), ids.end(), rng);
          ids.back() = -1;
          const int batch = nseq;
          const std::size_t per_tok = static_cast<std::size_t>(heads) * d;
          const auto k = test::random_values<T>(rng, layers * batch * per_tok);
          const auto v = test::random_values<T>(rng, layers * batch * per_tok);
          for (int s : ids)
            if (s >= 0) f.poison_slots(s, lens[s] - 1, 1);
          f.upload_pool();
          auto hv = f.host_view();
          for (int b = 0; b < batch; ++b) {
            const int s = ids[static_cast<std::size_t>(b)];
            if (s < 0) continue;
            for (int l = 0; l < layers; ++l) {
              const std::size_t off = (static_cast<std::size_t>(l) * batch + b) * per_tok;
              ref::append(hv, s, l, lens[s] - 1, k.data() + off, v.data() + off, 1);
            }
          }
          DeviceBuffer<T> dk(k), dv(v);
          DeviceBuffer<std::int32_t> dids(ids);
          TRIATTN_TEST_CUDA(
              cuda::append::run_decode(f.device_view(), dids.get(), 0, layers, dk.get(), dv.get(), batch, nullptr));
          TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
          test::require_bitwise_equal(f.d_pool.download(), f.pool, "cache pool after decode append");
        }
  }

  TEST_CASE_TEMPLATE("append: one sequence and one layer from strided input (contiguous slots via device tables)", T, float,
                     f16_storage, bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ 2);
    for (int bs : test::kPageSizes)
      for (KvLayout layout : test::kLayouts)
        for (int d : test::kHeadDims) {
          CAPTURE(seed);
          CAPTURE(bs);
          CAPTURE(layout_name(layout));
          CAPTURE(d);
          const int layers = 3, heads = 3;
          const int len0 = std::uniform_int_distribution<int>(0, 50)(rng);
          const int n = std::uniform_int_distribution<int>(1, 150)(rng);
          PagedFixture<T> f(rng, layout, bs, heads, d, layers, {30, len0 + n, 10}, {30, len0, 10});
          // Input rows padded by one 16-byte vector, as when K is a slice of a fused QKV tensor.
          const std::int64_t stride = static_cast<std::int64_t>(heads) * d + 16 / static_cast<int>(sizeof(T));
          const auto k = test::random_values<T>(rng, static_cast<std::size_t>(n * stride));
          const auto v = test::random_values<T>(rng, static_cast<std::size_t>(n * stride));
          const int layer = 1, seq = 1;
          f.poison_slots(seq, len0, n);
          f.upload_pool();
          auto hv = f.host_view();
          for (int t = 0; t < n; ++t) ref::append(hv, seq, layer, len0 + t, k.data() + t * stride, v.data() + t * stride, 1);
          DeviceBuffer<T> dk(k), dv(v);
          cuda::AppendParams<T> p{};
          p.k = dk.get();
          p.v = dv.get();
          p.token_stride = stride;
          p.layer_stride = 0;
          p.num_tokens = n;
          p.first_layer = layer;
          p.num_layers = 1;
          p.source = cuda::SlotSource::kContiguous;
          p.seq = seq;
          p.first_slot = len0;
          TRIATTN_TEST_CUDA(cuda::append::run(f.device_view(), p, nullptr));
          TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
          test::require_bitwise_equal(f.d_pool.download(), f.pool, "cache pool after contiguous append");
        }
  }
  TEST_CASE_TEMPLATE("append: float K and V quantised to the cache's dtype (fp8 - x over its head's scale - saturating)", T,
                     f16_storage, bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ 3);
    for (int bs : test::kPageSizes)
      for (KvLayout layout : test::kLayouts)
        for (int d : test::kHeadDims) {
          CAPTURE(seed);
          CAPTURE(bs);
          CAPTURE(layout_name(layout));
          CAPTURE(d);
          const int layers = 2, heads = 3;
          const int len0 = std::uniform_int_distribution<int>(0, 40)(rng);
          const int n = std::uniform_int_distribution<int>(1, 90)(rng);
          PagedFixture<T> f(rng, layout, bs, heads, d, layers, {20, len0 + n}, {20, len0});
          const std::size_t per_tok = static_cast<std::size_t>(heads) * d;
          auto k = test::random_values<float>(rng, layers * n * per_tok, 4.0f);
          auto v = test::random_values<float>(rng, layers * n * per_tok, 4.0f);
          for (std::size_t i = 0; i < k.size(); i += 7) k[i] *= 300.0f, v[i] *= 300.0f;  // past fp8's 448 * scale
          const int seq = 1;
          std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
          const std::span<const std::int32_t> row(f.tables.data() + static_cast<std::size_t>(seq) * f.max_blocks_per_seq,
                                                  static_cast<std::size_t>(f.max_blocks_per_seq));
          REQUIRE(cuda::append::host_slot_mapping(row, bs, len0, n, slots.data()));
          f.poison_slots(seq, len0, n);
          f.upload_pool();
          auto hv = f.host_view();
          for (int l = 0; l < layers; ++l)
            host::append_values(hv, seq, l, len0, k.data() + l * n * per_tok, v.data() + l * n * per_tok, n);
          DeviceBuffer<float> dk(k), dv(v);
          DeviceBuffer<std::int64_t> dslots(slots);
          TRIATTN_TEST_CUDA(
              cuda::append::run_slots(f.device_view(), 0, layers, dk.get(), dv.get(), dslots.get(), n, nullptr));
          TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
          test::require_bitwise_equal(f.d_pool.download(), f.pool, "cache pool after the quantising append");
        }
  }
}

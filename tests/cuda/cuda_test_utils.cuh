// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the CUDA tests: CUDA checks that fail the test, RAII device buffers, seeded
// random data, and a random paged cache (shuffled block tables) mirrored on host and device.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/layout.hpp>
#include <triattn/cuda/error.cuh>

namespace triattn::test {

/// Fails the current test (not just the assertion) on any CUDA error, naming the call.
#define TRIATTN_TEST_CUDA(call)                                                                      \
  do {                                                                                               \
    const cudaError_t triattn_test_e_ = (call);                                                      \
    if (triattn_test_e_ != cudaSuccess) (void)cudaGetLastError();                                    \
    REQUIRE_MESSAGE(triattn_test_e_ == cudaSuccess, #call " failed: ", cudaGetErrorName(triattn_test_e_), \
                    " (", cudaGetErrorString(triattn_test_e_), ")");                                 \
  } while (0)

/// GPU tests must fail, not skip, where no device is usable.
inline void require_device() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) (void)cudaGetLastError();
  REQUIRE_MESSAGE((e == cudaSuccess && n > 0), (std::string("no usable CUDA device: ") + cudaGetErrorName(e)));
}

/// Seed of this run: TRIATTN_TEST_SEED if set, else fresh; printed with every failure.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("TRIATTN_TEST_SEED")) return static_cast<std::uint64_t>(std::strtoull(s, nullptr, 10));
    return static_cast<std::uint64_t>(std::random_device{}()) ^ (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  }();
  return seed;
}

/// The grid issue #4 asks every copying and attention kernel to pass: page sizes, both layouts,
/// head dims (every dtype comes from the test's template list).
constexpr int kPageSizes[] = {1, 7, 16, 64};
constexpr KvLayout kLayouts[] = {KvLayout::kNHD, KvLayout::kHND};
constexpr int kHeadDims[] = {64, 128};

/// Per-dtype salt of a seed, so the dtypes of one run draw different data.
template <class T>
std::uint64_t dtype_salt() {
  return static_cast<std::uint64_t>(dtype_of<T>) * 0x9E3779B97F4A7C15ull;
}

/// Seed of one case for a 32-bit std::mt19937: TRIATTN_TEST_SEED if set, else a fresh one on
/// every call.
inline std::uint32_t fresh_seed32() {
  if (const char* s = std::getenv("TRIATTN_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

/// Owning device buffer of n elements of T (trivially copyable).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) { TRIATTN_TEST_CUDA(cudaMalloc(&p_, (n == 0 ? 1 : n) * sizeof(T))); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  /// Frees the current allocation and allocates n elements.
  void reset(std::size_t n) { *this = DeviceBuffer(n); }
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    TRIATTN_TEST_CUDA(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> h(n_);
    TRIATTN_TEST_CUDA(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  /// 0xFF bytes: NaN for every float type, -1 for integers. Waits for the memset: it runs on the
  /// legacy default stream, which a non-blocking stream's work would not wait for.
  void poison() {
    TRIATTN_TEST_CUDA(cudaMemset(p_, 0xFF, n_ * sizeof(T)));
    TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  }
  [[nodiscard]] T* get() const noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// n values of storage type T drawn uniformly from [-scale, scale].
template <class T>
std::vector<T> random_values(std::mt19937_64& rng, std::size_t n, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = from_float<T>(dist(rng));
  return v;
}

/// Bytewise equality of two arrays; on mismatch reports the first differing element.
template <class T>
void require_bitwise_equal(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return;
  std::size_t i = 0, bad = 0;
  for (std::size_t j = 0; j < got.size(); ++j)
    if (std::memcmp(&got[j], &want[j], sizeof(T)) != 0) {
      if (bad++ == 0) i = j;
    }
  FAIL_CHECK(what, ": ", bad, " of ", got.size(), " elements differ; first at element ", i, " (got ",
             to_float(got[i]), ", want ", to_float(want[i]), ")");
  REQUIRE(bad == 0);
}

/// A paged cache with random contents and shuffled block tables, on the host (the reference's
/// copy) and on the device; fp8 caches get random per-head K and V scales in both views.
template <class T>
struct PagedFixture {
  BlockLayout block{};
  int num_layers = 0;
  int num_blocks = 0;
  int max_seqs = 0;
  int max_blocks_per_seq = 0;
  std::vector<T> pool;                 // [2 * num_layers, num_blocks * block_elems]
  std::vector<std::int32_t> tables;    // [max_seqs, max_blocks_per_seq], -1 padded
  std::vector<std::int32_t> lens;      // [max_seqs]
  std::vector<float> scales;           // fp8: [num_layers, 2 (K, V), kv_heads] in [0.25, 4]; else empty
  DeviceBuffer<T> d_pool;
  DeviceBuffer<std::int32_t> d_tables, d_lens;
  DeviceBuffer<float> d_scales;

  /// capacity[s] tokens of room for sequence s (its blocks), current length lens0[s] <= capacity[s].
  PagedFixture(std::mt19937_64& rng, KvLayout layout, int block_size, int kv_heads, int head_dim, int layers,
               const std::vector<int>& capacity, const std::vector<int>& lens0, int spare_blocks = 3) {
    block = BlockLayout{layout, block_size, kv_heads, head_dim};
    num_layers = layers;
    max_seqs = static_cast<int>(capacity.size());
    int total = spare_blocks;
    for (int c : capacity) {
      const int nb = (c + block_size - 1) / block_size;
      max_blocks_per_seq = std::max(max_blocks_per_seq, nb);
      total += nb;
    }
    max_blocks_per_seq = std::max(max_blocks_per_seq, 1);
    num_blocks = total;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(static_cast<std::size_t>(max_seqs) * max_blocks_per_seq, -1);
    std::size_t next = 0;
    for (int s = 0; s < max_seqs; ++s) {
      const int nb = (capacity[static_cast<std::size_t>(s)] + block_size - 1) / block_size;
      for (int j = 0; j < nb; ++j) tables[static_cast<std::size_t>(s) * max_blocks_per_seq + j] = ids[next++];
    }
    lens.assign(lens0.begin(), lens0.end());
    pool = random_values<T>(rng, static_cast<std::size_t>(2 * num_layers) * num_blocks * block.block_elems());
    d_pool = DeviceBuffer<T>(pool);
    d_tables = DeviceBuffer<std::int32_t>(tables);
    d_lens = DeviceBuffer<std::int32_t>(lens);
    if constexpr (is_scaled_dtype<T>) {  // per (layer, kind, head), so a kernel reading another's fails
      std::uniform_real_distribution<float> sd(0.25f, 4.0f);
      scales.resize(static_cast<std::size_t>(2 * num_layers * kv_heads));
      for (float& x : scales) x = sd(rng);
      d_scales = DeviceBuffer<float>(scales);
    }
  }

  [[nodiscard]] std::int64_t range_stride() const noexcept { return static_cast<std::int64_t>(num_blocks) * block.block_elems(); }
  /// View of the host copy (host tables).
  [[nodiscard]] KvCacheView<T, std::int32_t> host_view() {
    return KvCacheView<T, std::int32_t>::contiguous(pool.data(), range_stride(), block, num_layers, num_blocks, max_seqs, max_blocks_per_seq, tables.data(),
            lens.data()).with_scales(scales.empty() ? nullptr : scales.data(), block.num_kv_heads);
  }
  /// View of the device copy (device tables and lengths).
  [[nodiscard]] KvCacheView<T, std::int32_t> device_view() const {
    return KvCacheView<T, std::int32_t>::contiguous(d_pool.get(), range_stride(), block, num_layers, num_blocks, max_seqs, max_blocks_per_seq, d_tables.get(),
            d_lens.get()).with_scales(scales.empty() ? nullptr : d_scales.get(), block.num_kv_heads);
  }
  void sync_lens_to_device() { d_lens.upload(lens); }
  /// Sets the head vectors of slots [first, first + n) of `seq` (all layers, kinds, heads) to
  /// 0xFF (NaN) in the host copy; upload_pool() makes the device copy match.
  void poison_slots(int seq, int first, int n) {
    const std::size_t vec = static_cast<std::size_t>(block.head_dim) * sizeof(T);
    auto view = host_view();
    for (int l = 0; l < num_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (int h = 0; h < block.num_kv_heads; ++h)
          for (int i = first; i < first + n; ++i) std::memset(view.token(l, static_cast<KvKind>(kind), seq, i, h), 0xFF, vec);
  }
  void upload_pool() { d_pool.upload(pool); }
};

}  // namespace triattn::test

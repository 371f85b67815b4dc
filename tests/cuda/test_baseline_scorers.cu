// SPDX-License-Identifier: Apache-2.0
// GPU tests of the baseline scorer kernels (key norm, SnapKV) against their CPU references
// (core/ref/baseline_scores.hpp) on fresh random inputs: a batch of three sequences in a shuffled
// page table, page sizes {1, 7, 16}, both layouts, head_dim {64, 128}, fp32/fp16/bf16/fp8 (per-head
// K scales; the reference scores the dequantised keys). Outputs
// are poisoned with NaN first: an unwritten score fails the normalised-error check, and the slots
// past each length must still hold the poison. Launcher argument checks (no GPU needed) are in
// the "scorers" suite.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/layout.hpp>
#include <triattn/core/ref/baseline_scores.hpp>
#include <triattn/cuda/algorithms/key_norm.cuh>
#include <triattn/cuda/algorithms/snapkv.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/score_kernel.cuh>

using namespace triattn;

namespace {

/// Owning device buffer (cudaMalloc / cudaFree).
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ > 0) TRIATTN_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) {
    if (n_ > 0) TRIATTN_CUDA_TRY(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  [[nodiscard]] T* get() const noexcept { return p_; }
  void poison() { TRIATTN_CUDA_TRY(cudaMemset(p_, 0xff, n_ * sizeof(T))); }  // float NaN
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0) TRIATTN_CUDA_TRY(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// ‖x − ref‖ / ‖ref‖ (NaN anywhere in x gives NaN, which fails every "<" check).
double nerr(const std::vector<float>& x, const std::vector<float>& ref) {
  REQUIRE(x.size() == ref.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double e = static_cast<double>(x[i]) - ref[i];
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
}

/// A paged K/V store holding kSeqs sequences of the given lengths: block ids shuffled across
/// sequences, random contents everywhere (unused blocks too), and a range stride padded past the
/// blocks. Host copy for the CPU reference, device copy for the kernels.
template <class T>
struct PagedStore {
  static constexpr int kSeqs = 3;
  int L, hkv, d;
  std::vector<int> lengths;  // [kSeqs]
  BlockLayout block;
  int num_blocks, max_blocks;
  std::int64_t range_stride;
  std::vector<T> data;       // [2 * L, range_stride]
  std::vector<int> tables;   // [kSeqs, max_blocks], -1 padded
  DeviceBuffer<T> d_data;
  DeviceBuffer<int> d_tables, d_lens;
  std::vector<float> scales;  // fp8: [L, 2 (K, V), hkv] per-head scales; else empty
  DeviceBuffer<float> d_scales;

  PagedStore(int layers, int kv_heads, int head_dim, int block_size, KvLayout layout, std::vector<int> lens,
             std::mt19937& rng)
      : L(layers), hkv(kv_heads), d(head_dim), lengths(std::move(lens)), block{layout, block_size, kv_heads, head_dim},
        num_blocks(total_blocks(lengths, block_size) + 4), max_blocks(num_blocks),
        range_stride(block.block_elems() * num_blocks + 64),
        data(static_cast<std::size_t>(2 * L) * static_cast<std::size_t>(range_stride)),
        tables(static_cast<std::size_t>(kSeqs) * max_blocks, -1), d_data(fill(data, rng)), d_tables(make_tables(rng)),
        d_lens(lengths), scales(make_scales(rng)), d_scales(scales) {}

  [[nodiscard]] KvCacheView<T, int> host_view() const {
    return KvCacheView<T, int>::contiguous(const_cast<T*>(data.data()), range_stride, block, L, num_blocks, kSeqs, max_blocks, tables.data(),
            lengths.data()).with_scales(scales.empty() ? nullptr : scales.data(), hkv);
  }
  [[nodiscard]] KvCacheView<T, int> device_view() const {
    return KvCacheView<T, int>::contiguous(d_data.get(), range_stride, block, L, num_blocks, kSeqs, max_blocks, d_tables.get(), d_lens.get())
        .with_scales(scales.empty() ? nullptr : d_scales.get(), hkv);
  }
  /// Keys of (seq, layer, KV head) as values (fp8: code times its head's scale): [length, d].
  [[nodiscard]] std::vector<float> keys(int seq, int l, int g) const {
    const auto v = host_view();
    const int n = lengths[static_cast<std::size_t>(seq)];
    std::vector<float> k(static_cast<std::size_t>(n) * d);
    for (int j = 0; j < n; ++j) {
      const T* src = v.token(l, KvKind::kKey, seq, j, g);
      for (int e = 0; e < d; ++e) k[static_cast<std::size_t>(j) * d + e] = dequantize(src[e], v.scale(l, KvKind::kKey, g));
    }
    return k;
  }

 private:
  static int total_blocks(const std::vector<int>& lens, int bs) {
    int n = 0;
    for (int x : lens) n += static_cast<int>(detail::ceil_div(x, bs));
    return n;
  }
  static const std::vector<T>& fill(std::vector<T>& v, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (T& x : v) x = from_float<T>(nd(rng));
    return v;
  }
  // Distinct per (layer, kind, head), so a kernel reading another head's scale fails.
  std::vector<float> make_scales(std::mt19937& rng) const {
    std::vector<float> sc;
    if constexpr (is_scaled_dtype<T>) {
      std::uniform_real_distribution<float> u(0.25f, 4.0f);
      sc.resize(static_cast<std::size_t>(2 * L * hkv));
      for (float& x : sc) x = u(rng);
    } else {
      (void)rng;
    }
    return sc;
  }
  const std::vector<int>& make_tables(std::mt19937& rng) {
    std::vector<int> ids(static_cast<std::size_t>(num_blocks));
    for (int b = 0; b < num_blocks; ++b) ids[b] = b;
    std::shuffle(ids.begin(), ids.end(), rng);
    std::size_t next = 0;
    for (int s = 0; s < kSeqs; ++s)
      for (int j = 0; j < static_cast<int>(detail::ceil_div(lengths[s], block.block_size)); ++j)
        tables[static_cast<std::size_t>(s) * max_blocks + j] = ids[next++];
    return tables;
  }
};

/// The batch of a test: the sequences in a scrambled order, their round starts, and the row
/// capacity (longer than every length, so the untouched tail is checked too).
struct Batch {
  std::vector<std::int32_t> seq_ids = {2, 0, 1};
  std::vector<std::int64_t> t0;  // [batch]
  int max_len = 0;
  Batch(const std::vector<int>& lengths, std::mt19937& rng) {
    std::uniform_int_distribution<int> extra(0, 1000);
    for (std::int32_t s : seq_ids) {
      t0.push_back(lengths[static_cast<std::size_t>(s)] + extra(rng));
      max_len = std::max(max_len, lengths[static_cast<std::size_t>(s)]);
    }
    max_len += 9;
  }
  [[nodiscard]] int size() const { return static_cast<int>(seq_ids.size()); }
};

/// Compares the written part of [batch, L, Hq, max_len] with the reference and checks that the
/// part past each length still holds the poison (all bits set).
void check_rows(const std::vector<float>& got, const std::vector<float>& want, const Batch& b,
                const std::vector<int>& lengths, int rows_per_seq, double tol) {
  std::vector<float> g, w;
  bool tail_untouched = true;
  for (int i = 0; i < b.size(); ++i) {
    const int len = lengths[static_cast<std::size_t>(b.seq_ids[static_cast<std::size_t>(i)])];
    for (int r = 0; r < rows_per_seq; ++r) {
      const std::size_t row = (static_cast<std::size_t>(i) * rows_per_seq + r) * b.max_len;
      for (int j = 0; j < b.max_len; ++j) {
        if (j < len) {
          g.push_back(got[row + j]);
          w.push_back(want[row + j]);
        } else {
          std::uint32_t bits;
          std::memcpy(&bits, &got[row + j], 4);
          tail_untouched = tail_untouched && bits == 0xffffffffu;
        }
      }
    }
  }
  CHECK(tail_untouched);
  CHECK(all_finite(g));
  CHECK(nerr(g, w) <= tol);
}

const char* type_name(float) { return "float32"; }
const char* type_name(f16_storage) { return "float16"; }
const char* type_name(bf16_storage) { return "bfloat16"; }
const char* type_name(fp8_e4m3_storage) { return "fp8_e4m3"; }

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE_TEMPLATE("key-norm kernel matches ref::key_norm_scores", T, float, f16_storage, bf16_storage,
                   fp8_e4m3_storage) {
  const int L = 3, hkv = 2, hq = 6;
  const std::vector<std::vector<int>> length_sets = {{37, 700, 1}, {0, 16, 129}};
  std::uint32_t seed = 1000;
  for (int d : {64, 128})
    for (int page : {1, 7, 16})
      for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
        for (const std::vector<int>& lengths : length_sets) {
          ++seed;
          CAPTURE(seed);
          CAPTURE(type_name(T{}));
          CAPTURE(d);
          CAPTURE(page);
          CAPTURE(layout_name(layout));
          std::mt19937 rng(seed);
          const PagedStore<T> s(L, hkv, d, page, layout, lengths, rng);
          const Batch b(lengths, rng);
          std::vector<float> want(static_cast<std::size_t>(b.size()) * L * hq * b.max_len, 0.0f);
          for (int i = 0; i < b.size(); ++i) {
            const int seq = b.seq_ids[static_cast<std::size_t>(i)], len = lengths[static_cast<std::size_t>(seq)];
            std::vector<float> row(static_cast<std::size_t>(len));
            for (int l = 0; l < L; ++l)
              for (int g = 0; g < hkv; ++g) {
                const std::vector<float> k = s.keys(seq, l, g);
                ref::key_norm_scores(k.data(), len, d, row.data());
                for (int h = g * (hq / hkv); h < (g + 1) * (hq / hkv); ++h)
                  std::copy(row.begin(), row.end(),
                            want.begin() + ((static_cast<std::ptrdiff_t>(i) * L + l) * hq + h) * b.max_len);
              }
          }
          const DeviceBuffer<std::int32_t> d_ids(b.seq_ids);
          const DeviceBuffer<std::int64_t> d_t0(b.t0);
          DeviceBuffer<float> out(want.size());
          out.poison();
          const cuda::ScoreBatch batch{d_ids.get(), d_t0.get(), b.size(), b.max_len};
          REQUIRE(cuda::key_norm::run(s.device_view(), hq, batch, out.get()) == cudaSuccess);
          REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
          check_rows(out.download(), want, b, lengths, L * hq, 1e-5);
        }
}

TEST_CASE_TEMPLATE("SnapKV kernels match ref::snapkv_scores", T, float, f16_storage, bf16_storage, fp8_e4m3_storage) {
  struct Config {
    int n, pool;
    std::vector<int> lengths;
    float q_scale;
  };
  const std::vector<Config> configs = {{1, 7, {5, 0, 300}, 1.0f},
                                       {13, 1, {300, 17, 1}, 1.0f},
                                       {32, 7, {257, 512, 3}, 2.0f},
                                       {64, 7, {600, 64, 250}, 1.0f},
                                       {40, 5, {1, 2, 100}, 1.0f}};
  const int L = 2, hkv = 2, hq = 6;
  std::uint32_t seed = 5000;
  for (int d : {64, 128})
    for (int page : {1, 7, 16})
      for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
        for (const Config& c : configs) {
          ++seed;
          CAPTURE(seed);
          CAPTURE(type_name(T{}));
          CAPTURE(d);
          CAPTURE(page);
          CAPTURE(layout_name(layout));
          CAPTURE(c.n);
          CAPTURE(c.pool);
          std::mt19937 rng(seed);
          const int n = c.n;
          const PagedStore<T> s(L, hkv, d, page, layout, c.lengths, rng);
          const Batch b(c.lengths, rng);
          std::normal_distribution<float> nd(0.0f, c.q_scale);
          std::vector<float> q(static_cast<std::size_t>(b.size()) * L * n * hq * d);  // [batch, L, n, Hq, d]
          for (float& x : q) x = nd(rng);
          std::vector<std::int64_t> pos(static_cast<std::size_t>(b.size()) * L * n);  // [batch, L, n]
          std::uniform_int_distribution<int> coin(0, 5);
          for (int i = 0; i < b.size(); ++i) {
            const std::int64_t t0 = b.t0[static_cast<std::size_t>(i)];
            std::uniform_int_distribution<std::int64_t> any(-1, t0 + 1);
            for (int l = 0; l < L; ++l)
              for (int qi = 0; qi < n; ++qi)  // mostly the newest n tokens, sometimes anything (or empty)
                pos[(static_cast<std::size_t>(i) * L + l) * n + qi] = coin(rng) == 0 ? any(rng) : t0 - n + qi;
          }
          std::vector<float> want(static_cast<std::size_t>(b.size()) * L * hq * b.max_len, 0.0f);
          std::vector<float> qh(static_cast<std::size_t>(n) * d);
          std::vector<int> lim(static_cast<std::size_t>(n));
          for (int i = 0; i < b.size(); ++i) {
            const int seq = b.seq_ids[static_cast<std::size_t>(i)], len = c.lengths[static_cast<std::size_t>(seq)];
            for (int l = 0; l < L; ++l) {
              const std::size_t bl = static_cast<std::size_t>(i) * L + l;
              for (int qi = 0; qi < n; ++qi)
                lim[qi] = snapkv_visible_limit(len, b.t0[static_cast<std::size_t>(i)], pos[bl * n + qi]);
              for (int g = 0; g < hkv; ++g) {
                const std::vector<float> k = s.keys(seq, l, g);
                for (int h = g * (hq / hkv); h < (g + 1) * (hq / hkv); ++h) {
                  for (int qi = 0; qi < n; ++qi)
                    std::copy_n(q.begin() + static_cast<std::ptrdiff_t>(((bl * n + qi) * hq + h) * d), d,
                                qh.begin() + static_cast<std::ptrdiff_t>(qi) * d);
                  ref::snapkv_scores(qh.data(), lim.data(), n, k.data(), len, d, c.pool,
                                     want.data() + (bl * hq + h) * b.max_len);
                }
              }
            }
          }
          const DeviceBuffer<std::int32_t> d_ids(b.seq_ids);
          const DeviceBuffer<std::int64_t> d_t0(b.t0);
          const DeviceBuffer<float> d_q(q);
          const DeviceBuffer<std::int64_t> d_pos(pos);
          DeviceBuffer<float> out(want.size());
          out.poison();
          const std::size_t ws_bytes = cuda::snapkv::workspace_size(b.size(), L, hq, n, b.max_len);
          DeviceBuffer<unsigned char> ws(ws_bytes);
          TRIATTN_CUDA_TRY(cudaMemset(ws.get(), 0xff, ws_bytes));
          const cuda::ScoreBatch batch{d_ids.get(), d_t0.get(), b.size(), b.max_len};
          const cuda::SnapKvWindow window{d_q.get(), d_pos.get(), n, c.pool};
          REQUIRE(cuda::snapkv::run(ws.get(), ws_bytes, s.device_view(), hq, batch, window, out.get()) == cudaSuccess);
          REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
          check_rows(out.download(), want, b, c.lengths, L * hq, 1e-4);
        }
}

}  // TEST_SUITE("gpu")

TEST_SUITE("scorers") {

TEST_CASE("baseline scorer launchers reject bad arguments without touching the device") {
  alignas(16) static float dummy_data[64] = {};
  static const int table[4] = {0, 1, 2, 3}, lens[1] = {4};
  static const std::int32_t ids[1] = {0};
  static const std::int64_t t0s[1] = {4};
  const auto v = KvCacheView<float, int>::contiguous(dummy_data, 16, BlockLayout{KvLayout::kNHD, 1, 2, 64}, 1, 4, 1, 4, table, lens);
  float* out = reinterpret_cast<float*>(16);  // never dereferenced: every call below fails validation
  const cuda::ScoreBatch one{ids, t0s, 1, 4};
  CHECK(cuda::key_norm::run(v, 3, one, out) == cudaErrorInvalidValue);  // Hq not a multiple of Hkv
  CHECK(cuda::key_norm::run(v, 2, cuda::ScoreBatch{ids, t0s, -1, 4}, out) == cudaErrorInvalidValue);
  CHECK(cuda::key_norm::run(v, 2, cuda::ScoreBatch{nullptr, t0s, 1, 4}, out) == cudaErrorInvalidValue);
  CHECK(cuda::key_norm::run(v, 2, one, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda::key_norm::run(v, 2, cuda::ScoreBatch{nullptr, nullptr, 0, 4}, nullptr) == cudaSuccess);  // nothing to do
  KvCacheView<float, int> v96 = v;
  v96.block.head_dim = 96;
  CHECK(cuda::key_norm::run(v96, 2, one, out) == cudaErrorNotSupported);
  KvCacheView<float, int> odd = v;
  odd.data = dummy_data + 1;  // not 16-byte aligned
  CHECK(cuda::key_norm::run(odd, 2, one, out) == cudaErrorMisalignedAddress);

  CHECK(cuda::snapkv::workspace_size(1, 2, 4, 8, 0) == 0u);
  CHECK(cuda::snapkv::workspace_size(3, 2, 4, 8, 300) >= 3u * 2 * 4 * (300 + 8 * 2 * 2 + 8 * 2) * sizeof(float));
  alignas(256) static unsigned char ws[1 << 16];
  const cuda::SnapKvWindow win{out, reinterpret_cast<const std::int64_t*>(16), 8, 7};
  const std::size_t need = cuda::snapkv::workspace_size(1, 1, 2, 8, 4);
  auto bad = [&](auto&& tweak) {
    cuda::SnapKvWindow w = win;
    cuda::ScoreBatch b = one;
    int hq = 2;
    tweak(w, b, hq);
    return cuda::snapkv::run(ws, need, v, hq, b, w, out);
  };
  using W = cuda::SnapKvWindow;
  using B = cuda::ScoreBatch;
  CHECK(bad([](W& w, B&, int&) { w.num_queries = 0; }) == cudaErrorInvalidValue);
  CHECK(bad([](W& w, B&, int&) { w.num_queries = cuda::kSnapKvMaxQueries + 1; }) == cudaErrorInvalidValue);
  CHECK(bad([](W& w, B&, int&) { w.pool_kernel = 6; }) == cudaErrorInvalidValue);
  CHECK(bad([](W&, B&, int& hq) { hq = 3; }) == cudaErrorInvalidValue);
  CHECK(bad([](W& w, B&, int&) { w.positions = nullptr; }) == cudaErrorInvalidValue);
  CHECK(bad([](W&, B& b, int&) { b.t0 = nullptr; }) == cudaErrorInvalidValue);
  CHECK(bad([](W&, B& b, int&) { b.max_len = 0; }) == cudaSuccess);
  CHECK(cuda::snapkv::run(ws, need - 1, v, 2, one, win, out) == cudaErrorInvalidValue);  // short workspace
  CHECK(cuda::snapkv::run(ws + 8, need, v, 2, one, win, out) == cudaErrorInvalidValue);  // misaligned workspace
  CHECK(cuda::snapkv::run(ws, need, v96, 2, one, win, out) == cudaErrorNotSupported);
}

}  // TEST_SUITE("scorers")

// SPDX-License-Identifier: Apache-2.0
// The CPU reference backend of Model<Backend>: plain loops in float32, in the order of llama2.c's
// run.c (RMSNorm sum of squares; softmax with max subtraction; value accumulation in slot order)
// except that the dot products of matmul and of attention scores run in 8 interleaved lanes
// (vectorisable; stories260K stays within 1e-5 of run.c's logits).
// K/V go through triattn::KvCache::write (converted to the cache dtype) and attention reads them
// back through the cache's KvCacheView, slot by slot, via the block table.
#pragma once

#include <cmath>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/rope.hpp>

#include "backend.hpp"
#include "model_config.hpp"

namespace triattn_example {

class CpuBackend {
 public:
  static constexpr const char* kName = "cpu";
  /// Cache dtypes it runs: all of them (fp8 K/V dequantised with the cache's scales).
  using kv_storage_types = triattn::all_storage_types;
  using Buffer = std::vector<float>;

  /// Weights stay where they are: a non-owning set of host pointers.
  class WeightStore {
   public:
    explicit WeightStore(const ModelWeights& w) {
      p_.tok_emb = w.tok_emb.data();
      p_.rms_att = w.rms_att.data();
      p_.wq = w.wq.data();
      p_.wk = w.wk.data();
      p_.wv = w.wv.data();
      p_.wo = w.wo.data();
      p_.rms_ffn = w.rms_ffn.data();
      p_.w1 = w.w1.data();
      p_.w2 = w.w2.data();
      p_.w3 = w.w3.data();
      p_.rms_final = w.rms_final.data();
      p_.wcls = w.classifier();
      if (w.config.has_qkv_bias) {
        p_.bq = w.bq.data();
        p_.bk = w.bk.data();
        p_.bv = w.bv.data();
      }
    }
    [[nodiscard]] const WeightPtrs& ptrs() const noexcept { return p_; }

   private:
    WeightPtrs p_;
  };

  [[nodiscard]] Buffer alloc(std::size_t n) const { return Buffer(n, 0.0f); }
  [[nodiscard]] static float* data(Buffer& b) noexcept { return b.data(); }
  [[nodiscard]] static const float* data(const Buffer& b) noexcept { return b.data(); }
  [[nodiscard]] static std::size_t size(const Buffer& b) noexcept { return b.size(); }
  [[nodiscard]] WeightStore upload(const ModelWeights& w) const { return WeightStore(w); }
  [[nodiscard]] const float* host_view(const float* p, std::size_t) const noexcept { return p; }

  void embed(float* x, const float* table, std::span<const int> tokens, int dim) const {
    for (std::size_t r = 0; r < tokens.size(); ++r) {
      const float* src = table + static_cast<std::size_t>(tokens[r]) * dim;
      float* dst = x + r * static_cast<std::size_t>(dim);
      for (int i = 0; i < dim; ++i) dst[i] = src[i];
    }
  }

  /// out = w * x / sqrt(mean(x²) + eps), row by row (run.c's rmsnorm).
  void rmsnorm(float* out, const float* x, const float* w, int n, int dim, float eps) const {
    for (int r = 0; r < n; ++r) {
      const float* xr = x + static_cast<std::size_t>(r) * dim;
      float* o = out + static_cast<std::size_t>(r) * dim;
      float ss = 0.0f;
      for (int j = 0; j < dim; ++j) ss += xr[j] * xr[j];
      ss /= static_cast<float>(dim);
      ss += eps;
      ss = 1.0f / std::sqrt(ss);
      for (int j = 0; j < dim; ++j) o[j] = w[j] * (ss * xr[j]);
    }
  }

  /// out[r, i] = Σ_j W[i, j] · x[r, j] (W row-major [out_dim, in_dim]).
  /// Each dot product runs in 8 lanes (lane u sums j ≡ u mod 8 from j = 0 up; the lanes are then
  /// added pairwise, then the tail), so the compiler can vectorise it without reassociating;
  /// blocks of 8 rows share one pass over a weight row, the rest go one by one. A row's result
  /// does not depend on how many rows are computed with it (prefill and decode agree bit for bit).
  void matmul(float* out, const float* W, const float* x, int n, int out_dim, int in_dim) const {
    constexpr int kRows = 8;
    int r0 = 0;
    for (; r0 + kRows <= n; r0 += kRows) matmul_rows<kRows>(out, W, x, r0, out_dim, in_dim);
    for (; r0 < n; ++r0) matmul_rows<1>(out, W, x, r0, out_dim, in_dim);
  }

  // Rows [r0, r0 + NR) of matmul(); NR is a constant so that the accumulators stay in registers.
  template <int NR>
  static void matmul_rows(float* out, const float* W, const float* x, int r0, int out_dim, int in_dim) {
    constexpr int kLanes = 8;
    const int body = in_dim / kLanes * kLanes;
    const float* xs = x + static_cast<std::size_t>(r0) * in_dim;
    for (int i = 0; i < out_dim; ++i) {
      const float* wi = W + static_cast<std::size_t>(i) * in_dim;
      float acc[NR][kLanes] = {};
      for (int j = 0; j < body; j += kLanes)
        for (int r = 0; r < NR; ++r) {
          const float* xr = xs + static_cast<std::size_t>(r) * in_dim + j;
          for (int u = 0; u < kLanes; ++u) acc[r][u] += wi[j + u] * xr[u];
        }
      for (int r = 0; r < NR; ++r) {
        const float* xr = xs + static_cast<std::size_t>(r) * in_dim;
        const float* a = acc[r];
        float val = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        for (int j = body; j < in_dim; ++j) val += wi[j] * xr[j];
        out[static_cast<std::size_t>(r0 + r) * out_dim + i] = val;
      }
    }
  }

  // Σ_i a[i]·b[i] in 8 lanes (lane u sums i ≡ u mod 8; lanes added pairwise, then the tail):
  // vectorisable without reassociation, like matmul's dot products.
  // b is dequantised with `scale` (fp8 caches; unscaled dtypes ignore it).
  template <class T>
  static float dot_lanes(const float* a, const T* b, int n, float scale = 1.0f) {
    constexpr int kLanes = 8;
    const int body = n / kLanes * kLanes;
    float acc[kLanes] = {};
    for (int i = 0; i < body; i += kLanes)
      for (int u = 0; u < kLanes; ++u) acc[u] += a[i + u] * triattn::dequantize(b[i + u], scale);
    float val = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (int i = body; i < n; ++i) val += a[i] * triattn::dequantize(b[i], scale);
    return val;
  }

  void add_bias(float* y, const float* b, int n, int dim) const {
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < dim; ++i) y[static_cast<std::size_t>(r) * dim + i] += b[i];
  }

  /// Rotates every head of every row at the row's logical position.
  void rope(float* x, int n, int n_heads, int head_dim, std::span<const TokenInfo> rows, const RopeTables& t) const {
    for (int r = 0; r < n; ++r) {
      const std::int64_t pos = rows[static_cast<std::size_t>(r)].pos;
      for (int h = 0; h < n_heads; ++h) {
        float* v = x + (static_cast<std::size_t>(r) * n_heads + h) * head_dim;
        if (t.f32_angles)
          triattn::apply_rope_f32_angles(v, head_dim, static_cast<int>(pos), t.inv_freq_f32.data(), t.style);
        else
          triattn::apply_rope(v, head_dim, pos, t.inv_freq.data(), t.style);
      }
    }
  }

  /// Writes n rows of K and V ([n, kv_dim] float) at slots [first_slot, first_slot + n),
  /// rounded to the cache's storage type T (fp8: divided by the cache's scales, saturating).
  template <class T, class Cache>
  void write_kv(Cache& cache, triattn::SeqId seq, int layer, int first_slot, const float* k, const float* v, int n,
                int /*kv_dim*/) {
    cache.write_values(seq, layer, first_slot, k, v, n);
  }

  /// Causal paged attention: row r attends to the physical slots [0, rows[r].slot] of its
  /// sequence, reading K/V through the cache view (GQA: query head h reads KV head h / group).
  /// out, q: [n, n_heads * head_dim].
  template <class T, class Cache>
  void attention(float* out, const float* q, std::span<const TokenInfo> rows, const Cache& cache, int layer,
                 const ModelConfig& c, const AttentionObserver* observer) {
    const auto view = cache.template view<T>();
    const int d = c.head_dim;
    const int group = c.group_size();
    const float sqrt_d = std::sqrt(static_cast<float>(d));
    for (std::size_t r = 0; r < rows.size(); ++r) {
      const TokenInfo& info = rows[r];
      const int len = info.slot + 1;
      TRIATTN_EXPECTS(len <= view.seq_lens[info.seq], "attention: slot " + std::to_string(info.slot) +
                                                          " is beyond the physical length of sequence " +
                                                          std::to_string(info.seq));
      att_.resize(static_cast<std::size_t>(len));
      for (int h = 0; h < c.n_heads; ++h) {
        const float* qh = q + (r * c.n_heads + static_cast<std::size_t>(h)) * d;
        const int kvh = h / group;
        const float ks = view.scale(layer, triattn::KvKind::kKey, kvh);
        const float vs = view.scale(layer, triattn::KvKind::kValue, kvh);
        for (int t = 0; t < len; ++t) {
          const T* k = view.token(layer, triattn::KvKind::kKey, info.seq, t, kvh);
          att_[static_cast<std::size_t>(t)] = dot_lanes(qh, k, d, ks) / sqrt_d;  // run.c divides
        }
        softmax(att_.data(), len);
        if (observer != nullptr && *observer)
          (*observer)(layer, static_cast<int>(r), info.seq, h, std::span<const float>(att_.data(), att_.size()));
        float* oh = out + (r * c.n_heads + static_cast<std::size_t>(h)) * d;
        for (int i = 0; i < d; ++i) oh[i] = 0.0f;
        for (int t = 0; t < len; ++t) {
          const T* v = view.token(layer, triattn::KvKind::kValue, info.seq, t, kvh);
          const float a = att_[static_cast<std::size_t>(t)];
          for (int i = 0; i < d; ++i) oh[i] += a * triattn::dequantize(v[i], vs);
        }
      }
    }
  }

  /// gate = silu(gate) * up.
  void swiglu(float* gate, const float* up, int n) const {
    for (int i = 0; i < n; ++i) {
      float val = gate[i];
      val *= 1.0f / (1.0f + std::exp(-val));
      val *= up[i];
      gate[i] = val;
    }
  }

  void add(float* x, const float* y, int n) const {
    for (int i = 0; i < n; ++i) x[i] += y[i];
  }

  /// Tensor parallelism (tensor_parallel.hpp): `sum` adds a host array over the `ranks` ranks of
  /// the group, in place, identically on every rank. Model calls all_reduce_sum after the
  /// attention output and MLP down projections. Never set: a single rank.
  void set_all_reduce(int ranks, std::function<void(std::span<float>)> sum) {
    TRIATTN_EXPECTS(ranks >= 1 && (ranks == 1 || sum), "CpuBackend::set_all_reduce: ranks = " + std::to_string(ranks) +
                                                           " must be >= 1, with a function when > 1");
    tp_size_ = ranks;
    all_reduce_ = ranks > 1 ? std::move(sum) : nullptr;
  }
  [[nodiscard]] int tp_size() const noexcept { return tp_size_; }
  /// x[0..n) = sum over the ranks (a no-op for a single rank).
  void all_reduce_sum(float* x, std::size_t n) {
    if (all_reduce_) all_reduce_(std::span<float>(x, n));
  }

  /// In-place softmax with max subtraction (run.c's order).
  static void softmax(float* x, int n) {
    float max_val = x[0];
    for (int i = 1; i < n; ++i)
      if (x[i] > max_val) max_val = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      x[i] = std::exp(x[i] - max_val);
      sum += x[i];
    }
    for (int i = 0; i < n; ++i) x[i] /= sum;
  }

 private:
  int tp_size_ = 1;
  std::function<void(std::span<float>)> all_reduce_;  // empty: single rank
  std::vector<float> att_;
};

}  // namespace triattn_example

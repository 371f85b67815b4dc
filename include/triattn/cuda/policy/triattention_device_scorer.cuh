// SPDX-License-Identifier: Apache-2.0
// Scorer policy for caches in device memory: KvCache<..., cuda::TriAttentionDeviceScorer> scores
// keys with the GPU kernels (cuda/algorithms/score.cuh). The per-model constants (q̄, c_f, ω_f,
// C_f, the offsets, s²) are uploaded once at construction; every round after that computes its
// weights on the device from t0, so the device paths need no per-round host work.
//
// Three ways to use it:
//   * KvCache::compress(seq) / compress_if_needed(seqs) on a cache with device tables and a
//     selector with SelectionParams call compress_round(): the batched device round of
//     cuda::DeviceRounds (score, select, compact, positions when tracked) on stream(), waited for.
//     Scores and keep sets never leave the device; a few integers per sequence come back.
//   * score(view, seq, length, t0, std::span<float> out) copies [L, Hq, length] scores to the host
//     (synchronises): what KvCache rounds use where the device round cannot run (a
//     tensor-parallel selector that meets the other ranks in select()), and tests comparing scores.
//   * Engines call device_model() and run cuda::score / cuda::paged_round themselves with device
//     arrays, asynchronously and capturable in a CUDA graph (score_async is a shorthand).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/math/score_math.hpp>
#include <triattn/core/math/score_model.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/stats/query_stats.hpp>
#include <triattn/cuda/algorithms/score.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/launch.cuh>

namespace triattn::cuda {

class TriAttentionDeviceScorer {
 public:
  using policy_role = scorer_role;
  static constexpr MemorySpace memory_space = MemorySpace::kDevice;

  /// Builds the reference model (validating stats, RoPE and parameters) and uploads its constants.
  /// @param stream stream of the synchronous score() path (not owned)
  /// @throws logic_error on invalid statistics or parameters, cuda_error when an upload fails.
  TriAttentionDeviceScorer(const QueryStats& stats, const RopeConfig& rope, const ScoringParams& params,
                           int num_kv_heads, cudaStream_t stream = nullptr)
      : TriAttentionDeviceScorer(TriAttentionModel(stats, rope, params, num_kv_heads), stream) {}

  /// Uploads the constants of an existing reference model.
  explicit TriAttentionDeviceScorer(TriAttentionModel model, cudaStream_t stream = nullptr)
      : model_(std::move(model)), stream_(stream) {
    upload();
  }

  TriAttentionDeviceScorer(const TriAttentionDeviceScorer&) = delete;
  TriAttentionDeviceScorer& operator=(const TriAttentionDeviceScorer&) = delete;
  TriAttentionDeviceScorer(TriAttentionDeviceScorer&& o) noexcept : model_(std::move(o.model_)) { swap(o); }
  TriAttentionDeviceScorer& operator=(TriAttentionDeviceScorer&& o) noexcept {
    if (this != &o) {
      reset();
      model_ = std::move(o.model_);
      swap(o);
    }
    return *this;
  }
  ~TriAttentionDeviceScorer() { reset(); }

  /// The host model (the CPU oracle of this scorer).
  [[nodiscard]] const TriAttentionModel& model() const noexcept { return model_; }
  /// Device constants for cuda::score / cuda::compression_round (valid while *this lives).
  [[nodiscard]] const ScoreModelView& device_model() const noexcept { return view_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  /// KvCache path: scores slots [0, length) of `seq` for round start t0 into host memory.
  /// The view's data, block tables and lengths must be device memory (publish() the cache's
  /// tables first); its length for `seq` must equal `length`.
  /// @param out [num_layers, num_q_heads, length] host output
  /// @note synchronises `stream()`.
  /// @throws logic_error on a shape mismatch or host-memory tables, unsupported for an uncompiled
  ///         head dim, cuda_error on a CUDA failure.
  template <class T, class Id>
  void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) {
    check_view(view);
    dispatch_head_dim(view.block.head_dim, [](auto) {});  // throws unsupported naming the compiled list
    const std::size_t rows = static_cast<std::size_t>(model_.num_layers()) * model_.num_q_heads();
    TRIATTN_EXPECTS(length >= 0 && out.size() == rows * static_cast<std::size_t>(length),
                    "TriAttentionDeviceScorer::score: output holds " + std::to_string(out.size()) +
                        " floats, expected L*Hq*length = " + std::to_string(rows * static_cast<std::size_t>(length)));
    TRIATTN_EXPECTS(t0 >= 0, "TriAttentionDeviceScorer::score: t0 must be >= 0, got " + std::to_string(t0));
    TRIATTN_EXPECTS(seq >= 0 && seq < view.max_seqs, "TriAttentionDeviceScorer::score: sequence " +
                                                         std::to_string(seq) +
                                                         " is not a row of the view's block tables");
    TRIATTN_EXPECTS(
        is_device_memory(view.block_tables) && is_device_memory(view.seq_lens) &&
            is_device_memory(view.ranges != nullptr ? static_cast<const void*>(view.ranges) : view.data),
        "TriAttentionDeviceScorer::score: the view's data, block tables and lengths must be device "
        "memory (publish the cache's tables to its device mirror first)");
    if (length == 0) return;
    reserve_scratch(out.size());
    // (seq, t0) staged in the scratch header; the kernel reads them from device memory.
    struct Header {
      std::int64_t t0;
      std::int32_t seq;
      std::int32_t pad;
    } h{t0, seq, 0};
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(scratch_, &h, sizeof(h), cudaMemcpyHostToDevice, stream_));
    const auto* dh = reinterpret_cast<const Header*>(scratch_);
    float* dev_scores = reinterpret_cast<float*>(scratch_ + kHeaderBytes);
    const ScoreBatch batch{&dh->seq, &dh->t0, 1, length};
    TRIATTN_CUDA_TRY(cuda::score(view, view_, batch, dev_scores, stream_));
    TRIATTN_CUDA_TRY(
        cudaMemcpyAsync(out.data(), dev_scores, out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream_));
  }

  /// KvCache's round on a device cache (KvCache::compress / compress_if_needed call it with the
  /// checked sequences to compress): cuda::DeviceRounds' batched round over `seqs` on stream(),
  /// waited for. Every sequence is brought to its keep count (RoundTrigger::kAlways); scores and
  /// keep sets stay on the device, and with CacheConfig::track_positions so do the positions.
  /// `reports` gets one per sequence, in order. Not while a DeviceRounds round over any of `seqs`
  /// is in flight. @throws logic_error (cache unchanged) as DeviceRounds::launch and wait do.
  template <class Cache>
    requires DeviceRoundCache<Cache> && (!requires(const typename Cache::selector_type& s) { s.collective(); })
  void compress_round(Cache& cache, std::span<const SeqId> seqs, std::vector<CompressionReport>& reports) {
    // One DeviceRounds per cache, its buffers reused round after round; a moved cache gets a new one.
    if (rounds_ == nullptr || rounds_cache_ != static_cast<const void*>(&cache) || rounds_type_ != &kRoundsOf<Cache>) {
      rounds_ = std::make_shared<DeviceRounds<Cache>>(cache);
      rounds_cache_ = &cache;
      rounds_type_ = &kRoundsOf<Cache>;
    }
    auto& rounds = *static_cast<DeviceRounds<Cache>*>(rounds_.get());
    // Compactions (apply_keep_plan) queued on the compactor's stream come first.
    if constexpr (requires { cache.compactor().synchronize(); }) cache.compactor().synchronize();
    rounds.launch(seqs, stream_);
    reports = rounds.wait();
  }

  /// Device path: asynchronous cuda::score with this scorer's constants (see cuda::score).
  template <class T, class Id>
  [[nodiscard]] cudaError_t score_async(const KvCacheView<T, Id>& view, const ScoreBatch& batch, float* scores,
                                        cudaStream_t stream, const ScoreOptions& options = {}) const noexcept {
    return cuda::score(view, view_, batch, scores, stream, options);
  }

 private:
  static constexpr std::size_t kHeaderBytes = 256;

  template <class T, class Id>
  void check_view(const KvCacheView<T, Id>& view) const {
    check_cache_geometry(cache_geometry(view), {model_.num_layers(), model_.num_kv_heads(), model_.head_dim()},
                         "TriAttentionDeviceScorer", "the statistics");
  }

  static bool is_device_memory(const void* p) {
    if (p == nullptr) return false;
    cudaPointerAttributes attr{};
    TRIATTN_CUDA_TRY(cudaPointerGetAttributes(&attr, p));
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  }

  static std::size_t round_up(std::size_t x) noexcept { return (x + 255) / 256 * 256; }

  /// One allocation: q_re, q_im (double), omega, cmean_re, cmean_im, offsets, cos / sin of δ·ω_f
  /// (double), c (float).
  void upload() {
    const TriAttentionModel& m = model_;
    const std::size_t n = static_cast<std::size_t>(m.num_layers()) * m.num_q_heads() * m.num_freqs();
    const std::size_t F = static_cast<std::size_t>(m.num_freqs());
    const std::size_t D = static_cast<std::size_t>(m.num_offsets());
    std::vector<float> c(n);
    std::vector<double> off_cos(D * F), off_sin(D * F);  // [D][F], the phase as rope_phase forms it
    for (std::size_t o = 0; o < D; ++o)
      for (std::size_t f = 0; f < F; ++f) {
        const double phi = rope_phase(static_cast<long long>(m.offsets()[o]), m.omega()[f]);
        off_cos[o * F + f] = std::cos(phi);
        off_sin[o * F + f] = std::sin(phi);
      }
    const double* cd = m.mlr_weight(0, 0);  // [L, Hq, F], contiguous
    for (std::size_t i = 0; i < n; ++i) c[i] = static_cast<float>(cd[i]);  // as TriAttentionModel::fold
    struct Part {
      const void* src;
      std::size_t bytes;
      std::size_t off;
    };
    Part parts[9] = {{m.q_mean_re(0, 0), n * sizeof(double), 0},
                     {m.q_mean_im(0, 0), n * sizeof(double), 0},
                     {m.omega().data(), F * sizeof(double), 0},
                     {m.offset_mean_re().data(), F * sizeof(double), 0},
                     {m.offset_mean_im().data(), F * sizeof(double), 0},
                     {m.offsets().data(), D * sizeof(double), 0},
                     {c.data(), n * sizeof(float), 0},
                     {off_cos.data(), D * F * sizeof(double), 0},
                     {off_sin.data(), D * F * sizeof(double), 0}};
    std::size_t total = 0;
    for (Part& p : parts) {
      p.off = total;
      total += round_up(p.bytes);
    }
    std::vector<char> staging(total, 0);
    for (const Part& p : parts) std::memcpy(staging.data() + p.off, p.src, p.bytes);
    TRIATTN_CUDA_TRY(cudaMalloc(&constants_, total));
    const cudaError_t e = cudaMemcpy(constants_, staging.data(), total, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      reset();
      TRIATTN_CUDA_TRY(e);
    }
    const auto at = [&](int i) { return constants_ + parts[i].off; };
    view_.q_re = reinterpret_cast<const double*>(at(0));
    view_.q_im = reinterpret_cast<const double*>(at(1));
    view_.omega = reinterpret_cast<const double*>(at(2));
    view_.cmean_re = reinterpret_cast<const double*>(at(3));
    view_.cmean_im = reinterpret_cast<const double*>(at(4));
    view_.offsets = reinterpret_cast<const double*>(at(5));
    view_.c = reinterpret_cast<const float*>(at(6));
    view_.offset_cos = reinterpret_cast<const double*>(at(7));
    view_.offset_sin = reinterpret_cast<const double*>(at(8));
    view_.s2 = m.freq_scale_sq();
    view_.num_layers = m.num_layers();
    view_.num_q_heads = m.num_q_heads();
    view_.num_kv_heads = m.num_kv_heads();
    view_.head_dim = m.head_dim();
    view_.num_offsets = m.num_offsets();
    view_.style = m.style();
    view_.aggregation = m.params().aggregation;
    view_.disable_trig = m.params().disable_trig;
    double qmax = 0.0;  // |W_f(δ)| = s²·|q̄_f| for every offset
    for (std::size_t i = 0; i < n; ++i) {
      const double re = m.q_mean_re(0, 0)[i], im = m.q_mean_im(0, 0)[i];
      qmax = std::max(qmax, std::sqrt(re * re + im * im));
    }
    view_.max_abs_weight = m.freq_scale_sq() * qmax;
  }

  void reserve_scratch(std::size_t floats) {
    const std::size_t bytes = kHeaderBytes + floats * sizeof(float);
    if (bytes <= scratch_bytes_) return;
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream_));  // earlier launches may still use the old buffer
    if (scratch_ != nullptr) report_error(cudaFree(scratch_), "TriAttentionDeviceScorer: cudaFree");
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    TRIATTN_CUDA_TRY(cudaMalloc(&scratch_, bytes));
    scratch_bytes_ = bytes;
  }

  void reset() noexcept {
    if (constants_ != nullptr) report_error(cudaFree(constants_), "TriAttentionDeviceScorer: cudaFree");
    if (scratch_ != nullptr) report_error(cudaFree(scratch_), "TriAttentionDeviceScorer: cudaFree");
    constants_ = nullptr;
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    view_ = ScoreModelView{};
  }
  void swap(TriAttentionDeviceScorer& o) noexcept {
    std::swap(view_, o.view_);
    std::swap(stream_, o.stream_);
    std::swap(constants_, o.constants_);
    std::swap(scratch_, o.scratch_);
    std::swap(scratch_bytes_, o.scratch_bytes_);
    std::swap(rounds_, o.rounds_);
    std::swap(rounds_cache_, o.rounds_cache_);
    std::swap(rounds_type_, o.rounds_type_);
  }

  TriAttentionModel model_;
  ScoreModelView view_{};           // device pointers into constants_
  cudaStream_t stream_ = nullptr;   // not owned
  char* constants_ = nullptr;       // [upload() layout] device constants
  char* scratch_ = nullptr;         // [kHeaderBytes + L·Hq·length floats] score() scratch
  std::size_t scratch_bytes_ = 0;
  // compress_round's DeviceRounds<Cache> of the cache at rounds_cache_; rounds_type_ names Cache.
  template <class Cache>
  static constexpr char kRoundsOf = 0;
  std::shared_ptr<void> rounds_;
  const void* rounds_cache_ = nullptr;
  const char* rounds_type_ = nullptr;
};

}  // namespace triattn::cuda

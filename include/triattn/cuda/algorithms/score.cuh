// SPDX-License-Identifier: Apache-2.0
// Host launcher of the TriAttention scorer: scores every cached key of a batch of sequences for
// every (layer, query head) into a [batch, L, Hq, max_len] buffer. No allocation, no host
// synchronisation, no host-to-device copy: sequence slots, lengths and round starts are read
// from device memory, so the launch can be captured in a CUDA graph.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <triattn/core/kv_view.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/score_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// Execution choices of a scoring launch that leave the scores unchanged.
struct ScoreOptions {
  /// Upper bound of the grid (0: one wave of resident CTAs). Tests lower it so that every CTA
  /// walks many items across rows and sequences.
  int max_ctas = 0;
};

namespace detail {

/// Rows of a scoring launch: (sequence, layer, KV head, chunk of `heads` query heads).
inline long long score_rows(const ScoreModelView& m, const ScoreBatch& a, int heads) noexcept {
  const int G = m.num_q_heads / m.num_kv_heads;
  return static_cast<long long>(a.batch) * m.num_layers * m.num_kv_heads * ((G + heads - 1) / heads);
}

/// CTAs of `kernel` that fit on one multiprocessor (at least 1).
template <class Kernel>
inline int resident_ctas(Kernel kernel, int threads, std::size_t smem) noexcept {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 1;
  }
  return n;
}

/// Prefers the largest shared-memory carveout for `kernel`, then returns the CTAs per SM it gives
/// (callers cache it: no attribute call or occupancy query inside a graph capture later).
template <class Kernel>
inline int prefer_max_shared_then_occupancy(Kernel kernel, int threads, std::size_t smem) noexcept {
  (void)cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  (void)cudaGetLastError();
  return resident_ctas(kernel, threads, smem);
}

/// CTAs per SM of a kernel whose dynamic shared memory depends on |D|: `query()` (one of the two
/// above) runs when `smem` differs from the last call's, and the answer is kept in `cache` as
/// (smem << 16 | CTAs), so a round captured in a graph makes no occupancy query. At least 1.
template <class Query>
inline int ctas_per_sm_cached(std::atomic<unsigned long long>& cache, std::size_t smem, Query&& query) noexcept {
  unsigned long long c = cache.load(std::memory_order_relaxed);
  if ((c >> 16) != smem || c == 0) {
    c = (static_cast<unsigned long long>(smem) << 16) | static_cast<unsigned long long>(query() & 0xffff);
    cache.store(c, std::memory_order_relaxed);
  }
  const int n = static_cast<int>(c & 0xffff);
  return n > 0 ? n : 1;
}

/// Raises `kernel`'s dynamic shared-memory limit to `smem` once per device (tracked in
/// `granted`), so steady-state launches (e.g. inside a graph capture) make no attribute call.
template <class Kernel>
[[nodiscard]] inline cudaError_t ensure_dynamic_smem(Kernel kernel, std::size_t smem,
                                                     DynamicSmemGrant& granted) noexcept {
  return granted.ensure(kernel, smem);
}

/// Grid of a scoring launch: one persistent wave of resident CTAs, capped by the items (and by
/// max_ctas when > 0).
inline unsigned score_grid(long long items, int sms, int per_sm, const ScoreOptions& opt) noexcept {
  long long cap = static_cast<long long>(sms) * per_sm;
  if (opt.max_ctas > 0 && opt.max_ctas < cap) cap = opt.max_ctas;
  const long long g = items < cap ? items : cap;
  return static_cast<unsigned>(g > 0 ? g : 1);
}

template <class T, class Id>
[[nodiscard]] inline cudaError_t check_score_args(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                  const ScoreBatch& a, const float* scores) noexcept {
  if (m.num_layers != view.num_layers || m.num_kv_heads != view.block.num_kv_heads ||
      m.head_dim != view.block.head_dim || m.num_kv_heads <= 0 || m.num_q_heads % m.num_kv_heads != 0 ||
      m.num_q_heads <= 0 || a.batch < 0 || a.max_len < 0 || view.block.block_size <= 0)
    return cudaErrorInvalidValue;
  if (m.aggregation == Aggregation::kMax && !m.disable_trig && m.num_offsets <= 0) return cudaErrorInvalidValue;
  if (a.batch > 0 && a.max_len > 0 && (scores == nullptr || a.seq_ids == nullptr || a.t0 == nullptr))
    return cudaErrorInvalidValue;
  // 16-byte loads need 16-byte aligned head vectors.
  if (a.batch > 0 && a.max_len > 0 && (!has_kv_memory(view) || view.block_tables == nullptr || view.seq_lens == nullptr))
    return cudaErrorInvalidValue;
  if (!head_vectors_aligned(view, 16)) return cudaErrorMisalignedAddress;
  return cudaSuccess;
}

/// Tensor-core max path: 16-bit caches; fp16 weights must stay far from fp16's range limit.
template <class T, class Policy>
[[nodiscard]] inline bool use_mma_max(const ScoreModelView& m) noexcept {
  if (!Policy::kTensorCoreMax || m.aggregation != Aggregation::kMax || m.disable_trig) return false;
  if constexpr (std::is_same_v<T, bf16_storage>) return true;
  else if constexpr (std::is_same_v<T, f16_storage>) return m.max_abs_weight < 16384.0;
  else return false;
}

/// The ring kernels (score_mean_mma_kernel, score_max_mma_pipe_kernel) address keys as 32-bit
/// offsets in 16-byte chunks from their layer's K range (KeySliceFeed::issue): ranges whose
/// addressable extent is below 64 GiB.
template <class T, class Id>
[[nodiscard]] inline bool ring_offsets_fit(const KvCacheView<T, Id>& view) noexcept {
  return static_cast<unsigned long long>(range_extent(view)) * sizeof(T) < (1ull << 36);
}

/// Tensor-core mean path: 16-bit caches; fp16 weights far from fp16's range limit.
template <class T>
[[nodiscard]] inline bool use_mma_mean(const ScoreModelView& m) noexcept {
  if (m.aggregation != Aggregation::kMean && !m.disable_trig) return false;
  if constexpr (std::is_same_v<T, bf16_storage>) return true;
  else if constexpr (std::is_same_v<T, f16_storage>) return m.max_abs_weight < 16384.0;  // |W_f| <= s²|q̄_f|
  else return false;
}

template <class T, class Id, int HD, RopeStyle S, class Cfg>
[[nodiscard]] inline cudaError_t launch_score_mean_mma(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                       const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                       const ScoreOptions& opt) noexcept {
  if constexpr (sizeof(T) == 2) {
    using Shape = MmaMeanShape<T, HD, Cfg::kWarps, Cfg::kStages, Cfg::kKeys>;
    const FastDiv fd(view.block.block_size);
    const long long rows = score_rows(m, a, Shape::kHeads);
    int sms = 0;
    TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
    auto kernel = score_mean_mma_kernel<T, Id, HD, S, Cfg::kWarps, Cfg::kStages, Cfg::kMinCtas, Cfg::kKeys,
                                        Cfg::kLoadAhead, Cfg::kProducers>;
    constexpr std::size_t smem = Shape::kSmemBytesProducer;
    constexpr int threads = Shape::kThreads + 32 * Cfg::kProducers;
    static DynamicSmemGrant granted;
    TRIATTN_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem(kernel, smem, granted));
    // Once per instantiation (no attribute call or occupancy query inside a graph capture later):
    // the carveout that fits kMinCtas rings per SM, then the occupancy it gives.
    static const int per_sm = prefer_max_shared_then_occupancy(kernel, threads, smem);
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    kernel<<<score_grid(items, sms, per_sm, opt), threads, smem, stream>>>(view, m, a, scores, fd);
    return check_launch(stream);
  } else {
    return cudaErrorNotSupported;
  }
}

template <class T, class Id, int HD, RopeStyle S>
[[nodiscard]] inline cudaError_t launch_score_max_mma(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                      const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                      const ScoreOptions& opt) noexcept {
  if constexpr (sizeof(T) == 2) {
    using Shape = MmaMaxShape<T, HD>;
    const FastDiv fd(view.block.block_size);
    const long long rows = score_rows(m, a, Shape::kHeads);
    int sms = 0;
    TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
    auto kernel = score_max_mma_kernel<T, Id, HD, S>;
    const std::size_t smem = score_max_mma_smem_bytes<T, HD>(m.num_offsets);
    static DynamicSmemGrant granted;
    TRIATTN_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem(kernel, smem, granted));
    static std::atomic<unsigned long long> cached{0};
    const int per_sm = ctas_per_sm_cached(cached, smem, [&] { return resident_ctas(kernel, Shape::kThreads, smem); });
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    kernel<<<score_grid(items, sms, per_sm, opt), Shape::kThreads, smem, stream>>>(view, m, a, scores, fd);
    return check_launch(stream);
  } else {
    return cudaErrorNotSupported;
  }
}

/// The device's opt-in limit of shared memory per CTA (queried once; 0 when the query fails).
inline std::size_t smem_optin_limit() noexcept {
  static const int optin = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return v;
  }();
  return static_cast<std::size_t>(optin);
}

/// Launches a ring, warp-specialized or direct scorer: `threads` threads and `smem` bytes of dynamic shared memory
/// per CTA, one wave of resident CTAs (score_grid) over the rows of `heads` query heads cut into
/// `tile`-key items. granted / cached: the caller's statics for this kernel (its shared-memory
/// grant, and its CTAs per SM for the last smem size asked).
template <class Kernel, class T, class Id>
[[nodiscard]] inline cudaError_t launch_smem_scorer(Kernel kernel, int threads, std::size_t smem, int heads, int tile,
                                                    DynamicSmemGrant& granted, std::atomic<unsigned long long>& cached,
                                                    const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                    const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                    const ScoreOptions& opt) noexcept {
  const FastDiv fd(view.block.block_size);
  const long long rows = score_rows(m, a, heads);
  int sms = 0;
  TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
  TRIATTN_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem(kernel, smem, granted));
  const int per_sm =
      ctas_per_sm_cached(cached, smem, [&] { return prefer_max_shared_then_occupancy(kernel, threads, smem); });
  const long long items = rows * ((a.max_len + tile - 1) / tile);
  kernel<<<score_grid(items, sms, per_sm, opt), threads, smem, stream>>>(view, m, a, scores, fd);
  return check_launch(stream);
}

/// Pipelined tensor-core max scorer; the kernel without wgmma when |D| > 18 (one m64n72 covers
/// 18 offsets), score_max_mma_kernel when its shared memory does not fit.
template <class T, class Id, int HD, RopeStyle S, bool kWgmma, class Cfg>
[[nodiscard]] inline cudaError_t launch_score_max_mma_pipe(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                           const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                           const ScoreOptions& opt) noexcept {
  if constexpr (sizeof(T) == 2) {
    if constexpr (kWgmma)
      if (m.num_offsets > 2 * kWgmmaMaxNTiles)
        return launch_score_max_mma_pipe<T, Id, HD, S, false, Cfg>(view, m, a, scores, stream, opt);
    using Shape = MmaMeanShape<T, HD, Cfg::kWarps, Cfg::kStages, Cfg::kKeys>;
    const std::size_t smem =
        score_max_mma_pipe_smem_bytes<T, HD, Cfg::kWarps, Cfg::kStages, kWgmma, Cfg::kKeys>(m.num_offsets);
    if (smem > smem_optin_limit())
      return launch_score_max_mma<T, Id, HD, S>(view, m, a, scores, stream, opt);
    auto kernel =
        score_max_mma_pipe_kernel<T, Id, HD, S, Cfg::kWarps, Cfg::kStages, Cfg::kMinCtas, kWgmma, Cfg::kKeys>;
    static DynamicSmemGrant granted;
    static std::atomic<unsigned long long> cached{0};
    return launch_smem_scorer(kernel, Shape::kThreads, smem, Shape::kHeads, Shape::kTile, granted, cached, view, m, a,
                              scores, stream, opt);
  } else {
    return cudaErrorNotSupported;
  }
}

/// The CUDA-core scorers (GMAX query heads per pass); kWithMax: whether score_max_kernel can be
/// reached for T (not for bf16 caches when the max aggregation takes the tensor cores).
template <class T, class Id, int HD, RopeStyle S, int GMAX, bool kWithMax>
[[nodiscard]] inline cudaError_t launch_score_kernel(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                     const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                     const ScoreOptions& opt) noexcept {
  const FastDiv fd(view.block.block_size);
  const long long rows = score_rows(m, a, GMAX);
  int sms = 0;
  TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
  if (m.aggregation == Aggregation::kMean || m.disable_trig) {
    using Shape = ScoreShape<T, HD, GMAX, 8>;
    auto kernel = score_mean_kernel<T, Id, HD, S, GMAX>;
    static const int per_sm = resident_ctas(kernel, Shape::kThreads, 0);
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    kernel<<<score_grid(items, sms, per_sm, opt), Shape::kThreads, 0, stream>>>(view, m, a, scores, fd);
    return check_launch(stream);
  }
  if constexpr (kWithMax) {
    using Shape = ScoreShape<T, HD, GMAX, 4>;
    auto kernel = score_max_kernel<T, Id, HD, S, GMAX>;
    const std::size_t smem = score_max_smem_bytes<HD, GMAX>(m.num_offsets);
    static DynamicSmemGrant granted;
    TRIATTN_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem(kernel, smem, granted));
    static std::atomic<unsigned long long> cached{0};  // occupancy depends on |D| (shared memory)
    const int per_sm = ctas_per_sm_cached(cached, smem, [&] { return resident_ctas(kernel, Shape::kThreads, smem); });
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    kernel<<<score_grid(items, sms, per_sm, opt), Shape::kThreads, smem, stream>>>(view, m, a, scores, fd);
    return check_launch(stream);
  } else {
    return cudaErrorNotSupported;  // unreachable: the caller routes this case to the tensor cores
  }
}

}  // namespace detail

/// Scores slots [0, length) of every sequence of the batch for every (layer, query head).
/// Query head h reads KV head h / (Hq / Hkv). Mean aggregation (or disable_trig) uses the exact
/// fold; max aggregation the |D| per-offset weight sets (on the tensor cores for 16-bit caches).
/// Policy: tuning::Selected::Score (the default) or a type like it: which kernel families may run
/// (kRingKernels, kTensorCoreMax; tests turn them off to reach the fallbacks) and the ring kernels'
/// shapes.
///
/// @param view    paged cache (device memory); its seq_lens give each sequence's length
/// @param model   per-model constants in device memory (TriAttentionDeviceScorer::device_model())
/// @param batch   seq_ids [batch], t0 [batch] in device memory; max_len >= every length
/// @param scores  [batch, L, Hq, max_len] device output; row (b, l, h) holds slots [0, length_b),
///                slots past the length are left untouched
/// @return cudaErrorInvalidValue on inconsistent shapes, cudaErrorMisalignedAddress when head
///         vectors are not 16-byte aligned, cudaErrorNotSupported for an uncompiled head dim
///         (the owning API calls dispatch_head_dim first for the message), else the launch status
/// @note asynchronous on `stream`; allocates nothing, never throws; capturable in a CUDA graph.
template <class T, class Id, class Policy = tuning::Selected::Score>
[[nodiscard]] cudaError_t score(const KvCacheView<T, Id>& view, const ScoreModelView& model, const ScoreBatch& batch,
                                float* scores, cudaStream_t stream = nullptr,
                                const ScoreOptions& options = {}) noexcept {
  TRIATTN_CUDA_RETURN_IF_ERROR(detail::check_score_args(view, model, batch, scores));
  if (batch.batch == 0 || batch.max_len == 0) return cudaSuccess;
  const int G = model.num_q_heads / model.num_kv_heads;
  const bool mma = detail::use_mma_max<T, Policy>(model);
  const bool ring_ok = Policy::kRingKernels && detail::ring_offsets_fit(view);  // else the non-ring kernels
  const bool mma_mean = ring_ok && detail::use_mma_mean<T>(model);
  // bf16 max aggregation always takes the tensor cores (score_max_kernel unreachable for it)
  constexpr bool kCudaCoreMax = !(Policy::kTensorCoreMax && std::is_same_v<T, bf16_storage>);
  return dispatch_head_dim_status(view.block.head_dim, [&](auto hd) -> cudaError_t {
    constexpr int HD = decltype(hd)::value;
    const auto by_group = [&](auto style) -> cudaError_t {
      constexpr RopeStyle S = decltype(style)::value;
      // fp8 keys take the CUDA-core kernels (use_mma_* are false): the MMA kernels are not
      // instantiated for them.
      if constexpr (Policy::kRingKernels && !is_scaled_dtype<T>) {
        if (mma && ring_ok)
          return detail::launch_score_max_mma_pipe<T, Id, HD, S, true, typename Policy::Max>(view, model, batch, scores,
                                                                                            stream, options);
        if (mma_mean)
          return detail::launch_score_mean_mma<T, Id, HD, S, typename Policy::Mean>(view, model, batch, scores,
                                                                                   stream, options);
      }
      if constexpr (!is_scaled_dtype<T>)
        if (mma) return detail::launch_score_max_mma<T, Id, HD, S>(view, model, batch, scores, stream, options);
      if (G <= 4)
        return detail::launch_score_kernel<T, Id, HD, S, 4, kCudaCoreMax>(view, model, batch, scores, stream, options);
      // G > 4: chunks of 8
      return detail::launch_score_kernel<T, Id, HD, S, 8, kCudaCoreMax>(view, model, batch, scores, stream, options);
    };
    if (model.style == RopeStyle::kHalf) return by_group(std::integral_constant<RopeStyle, RopeStyle::kHalf>{});
    return by_group(std::integral_constant<RopeStyle, RopeStyle::kInterleaved>{});
  });
}

}  // namespace triattn::cuda

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
#include <triattn/cuda/kernels/score_max_direct_kernel.cuh>
#include <triattn/cuda/kernels/score_max_ws_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/sm90.cuh>

namespace triattn::cuda {

/// Execution choices of a scoring launch (results agree within fp32 rounding either way).
struct ScoreOptions {
  /// Max aggregation on 16-bit caches through mma.sync (weights split into 16-bit parts);
  /// false runs the CUDA-core kernel (always used for float32 caches).
  bool tensor_core_max = true;
  /// Mean-aggregation (and disable_trig) kernel: 0 score_mean_kernel (8 keys per lane, one tile
  /// in flight per CTA), 1 score_mean_pipe_kernel (4 keys per lane, next tile prefetched into a
  /// register double buffer; bitwise the same scores as 0), 2-6 score_mean_mma_kernel (dot
  /// products on the tensor cores; tuning::sm90::ScoreMeanMma::Variant2-5; 16-bit caches, else
  /// variant 0; within fp32 rounding of 0, not bitwise): 2, 3 and 4 with per-warp cp.async rings,
  /// 5 with 8 computing warps fed by 2 producer warps, 6 as 5 with a dynamic tail (work_counter),
  /// 7 and 8 as 5 with work stealing (work_counter; the last 2 or 4 items of each CTA's share).
  /// Default 5. H200, 2026-12-02: one Qwen3-8B layer at 32K 23.5-23.7 µs with the keys copied
  /// L2 evict-first (25.8-26.1 before: the scores written during the stream were evicted by the
  /// keys behind them). 2026-12-01, on one machine: 25.8 µs (2: 25.8-26.1); a whole 36-layer
  /// round's scores 62.5-62.7 vs 65.6-65.7 µs at batch 1, 391-392 vs 398 at batch 8; the batch-1
  /// round from a CUDA graph 246-247 vs 248-250 µs. Its computing warps' lanes each arrive on the
  /// stage's empty mbarrier (compute-sanitizer racecheck clean on test_score's GQA case; with one
  /// lane after a __syncwarp it reported 80 hazards).
  int mean_variant = 5;
  /// Work counter of mean_variant 6 (5 with a dynamic tail: the CTAs split three quarters of the
  /// items statically and claim the rest one 256-key tile at a time, so that multiprocessors with
  /// a faster memory path take more of it), 7 and 8 (5 with work stealing: each CTA walks its
  /// share, then takes single tiles from the last 2 (7) or 4 (8) of the shares with the most left):
  /// score_work_counter_bytes of device memory, zero before its first launch; every completed
  /// launch leaves it zero again. One launch at a time per counter (launches on concurrent streams
  /// need one each). nullptr: mean_variants 6-8 run as 5.
  /// H200, 2026-12-04: all three slower than 5 (one 32K layer 6 / 7 / 8: 26.6 / 28.5 / 31.2 vs
  /// 23.5 µs): see tuning::sm90::ScoreMeanMma.
  unsigned int* work_counter = nullptr;
  /// Tensor-core max kernel (16-bit caches, tensor_core_max): 0 score_max_mma_kernel (load a
  /// tile, then compute it), 1 score_max_mma_pipe_kernel (per-warp cp.async rings, cos/sin once
  /// per CTA and sequence; falls back to 0 when its shared memory exceeds the device's limit,
  /// i.e. for very many offsets), 2 the same kernel with the dot products as warpgroup MMAs
  /// (wgmma; needs a build for sm_90a, else it runs as 1; |D| > 18 offsets run as 1), 3 as 2 with
  /// bf16 weights in two 16-bit terms instead of three (each weight to 2^-17 of its size instead
  /// of 2^-25, a third fewer MMAs; fp16 caches: as 2; without sm_90a or for |D| > 18 the mma.sync
  /// kernel with two terms), 4 as 3 with the norm term Σ_f c_f·|K_f| as fp32 FMAs on the CUDA
  /// cores instead of TF32 MMAs on the tensor pipe (which the other warpgroup's MMAs hold), 5 and
  /// 6 score_max_ws_kernel (warp-specialized: a producer warpgroup, one MMA warpgroup with both
  /// operands in shared memory, norm warps; 5 with two accumulator sets per tile (the two weight
  /// terms, one m64n144 step per k-step) and setmaxnreg, 6 with one m64n72 chain; |D| > 18 or too
  /// little shared memory run as 4; without sm_90a the same kernel on
  /// mma.sync), 7 and 8 score_max_direct_kernel (one warpgroup per CTA; each thread copies its
  /// share of the keys into shared-memory slots of its own and reads them back as the warpgroup
  /// MMA's A fragments, no ring handshake, no ldmatrix; the norm term from the same registers
  /// while the MMAs run; 7: 2 slots, 2 CTAs per SM, 8: 1 slot, 3 CTAs per SM; |D| > 18 or too
  /// little shared memory run as 0; without sm_90a as 4; tuning::sm90::ScoreMaxDirect has
  /// the measurements: 8 ~4% faster than 4 from a batch-8 round's shape up, both slower at one
  /// layer).
  /// 0-2 within fp32 rounding of each other.
  /// Default 4. H200, 2026-12-02, one 32K layer (8 KV heads, |D| = 17): 34.0-34.2 µs with m-tile
  /// 0's norm term under m-tile 1's MMAs (sixteenth session), 34.5 µs with the unit fold
  /// (5777ce8); 35.4-35.5 µs before (keys copied L2 evict-first, the row fold batched;
  /// 36.6-36.8 before that). 2026-12-01: 36.8-37.0 µs vs 37.6-37.8
  /// (3, same run), 44.5 (2), 53.6 (1). Largest normalised error against the CPU reference in
  /// test_score's GQA case: 3.2e-7 (4) vs 9.3e-7 (3), 9.1e-7 (2), 8.8e-7 (1), 1.5e-7 (0): the TF32
  /// products of the norm term (~21 bits), not the weights' third term, set the error of 1-3.
  /// Variants 5 / 6 (eleventh session, same run as 4's 37.0 µs): 42.0-42.4 / 41.2-41.4 µs, error 3.4e-7;
  /// twelfth session (descriptors advanced in uniform registers, no selects in the max over δ;
  /// same run as 4's 36.8-36.9 µs): 40.4-40.6 / 39.5-39.7 µs; thirteenth session (5 with the
  /// m64n144 step; same run as 4's 35.7 µs): 37.3-37.6 (39.0-39.3 with two m64n72 chains) / 38.7-39.0 µs.
  int max_variant = 4;
  /// Upper bound of the grid (0: one wave of resident CTAs). Tests lower it so that every CTA
  /// walks many items across rows and sequences.
  int max_ctas = 0;
  /// CTAs per resident CTA slot (>= 1): 1 launches one persistent wave (each CTA walks a
  /// contiguous share of the items); k > 1 launches k times as many CTAs with k times shorter
  /// shares, so the hardware hands the later waves to whichever multiprocessors finish first
  /// (balancing against per-SM speed differences, at the cost of more per-CTA start-up work).
  /// H200, 2026-12-01, one 32K layer: mean_variant 2 26.5 µs at 1 wave, 31.4 at 2, 33.3 at 3;
  /// max_variant 2 49.0 at 1, 56.8 at 2 (each CTA's start-up is not hidden): keep 1.
  int grid_waves = 1;
};

/// 64-bit words of ScoreOptions::work_counter: mean_variant 6 uses its first two 32-bit halves,
/// mean_variants 7 and 8 one word per CTA plus a done count (larger grids run them as 5).
inline constexpr std::size_t score_work_counter_words = 1024;
/// Bytes of device memory ScoreOptions::work_counter points at (8-byte aligned, as cudaMalloc's).
inline constexpr std::size_t score_work_counter_bytes = score_work_counter_words * sizeof(unsigned long long);

namespace detail {

/// Rows of a scoring launch: (sequence, layer, KV head, chunk of `heads` query heads).
inline long long score_rows(const ScoreModelView& m, const ScoreBatch& a, int heads) noexcept {
  const int G = m.num_q_heads / m.num_kv_heads;
  return static_cast<long long>(a.batch) * m.num_layers * m.num_kv_heads * ((G + heads - 1) / heads);
}

/// Whether `kernel`'s compiled attributes (registers, static shared memory) satisfy `pred`; false
/// where they cannot be read. Callers keep the answer in a static (no attribute call inside a
/// graph capture later).
template <class Kernel, class Pred>
inline bool kernel_attributes_satisfy(Kernel kernel, Pred pred) noexcept {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return pred(attr);
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

/// Grid of a scoring launch: grid_waves waves of resident CTAs (one persistent wave by
/// default), capped by the items (and by max_ctas when > 0).
inline unsigned score_grid(long long items, int sms, int per_sm, const ScoreOptions& opt) noexcept {
  long long cap = static_cast<long long>(sms) * per_sm * (opt.grid_waves > 1 ? opt.grid_waves : 1);
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
template <class T>
[[nodiscard]] inline bool use_mma_max(const ScoreModelView& m, const ScoreOptions& opt) noexcept {
  if (!opt.tensor_core_max || m.aggregation != Aggregation::kMax || m.disable_trig) return false;
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

/// Tensor-core mean path (mean_variant 2-8): 16-bit caches; fp16 weights far from fp16's range limit.
template <class T>
[[nodiscard]] inline bool use_mma_mean(const ScoreModelView& m, const ScoreOptions& opt) noexcept {
  if (opt.mean_variant < 2 || opt.mean_variant > 8) return false;
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
                                        Cfg::kLoadAhead, Cfg::kProducers, Cfg::kStaticEighths, Cfg::kStealBack>;
    constexpr bool dynamic_tail = mean_mma_dynamic_tail(Cfg::kProducers, Cfg::kStaticEighths, Cfg::kStealBack);
    constexpr std::size_t smem = dynamic_tail         ? Shape::kSmemBytesDynamic
                                 : Cfg::kProducers > 0 ? Shape::kSmemBytesProducer
                                                       : Shape::kSmemBytes;
    constexpr int threads = Shape::kThreads + 32 * Cfg::kProducers;
    static DynamicSmemGrant granted;
    TRIATTN_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem(kernel, smem, granted));
    // Once per instantiation (no attribute call or occupancy query inside a graph capture later):
    // the carveout that fits kMinCtas rings per SM, then the occupancy it gives.
    static const int per_sm = prefer_max_shared_then_occupancy(kernel, threads, smem);
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    const unsigned grid = score_grid(items, sms, per_sm, opt);
    // the claim counter counts the tail's items plus one empty claim per CTA in 32 bits; stealing
    // needs a word per CTA (and the done count) inside the counter, and a share's front and back
    // counts (plus a failed take per CTA) in 32 bits each
    const bool counter_fits = items < (1ll << 31) && (Cfg::kStealBack == 0 || grid < score_work_counter_words);
    unsigned int* const claims = dynamic_tail && counter_fits ? opt.work_counter : nullptr;
    kernel<<<grid, threads, smem, stream>>>(view, m, a, scores, fd, claims);
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

/// Pipelined tensor-core max scorer (max_variant 1; 2, 3, 4 with kWgmma; 4 with kNormFfma); the
/// kernel without wgmma when |D| > 18 (one m64n72 covers 18 offsets), score_max_mma_kernel when
/// its shared memory does not fit.
template <class T, class Id, int HD, RopeStyle S, bool kWgmma, int kSplits = 0, bool kNormFfma = false,
          class Cfg = tuning::sm90::ScoreMaxMma>
[[nodiscard]] inline cudaError_t launch_score_max_mma_pipe(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                           const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                           const ScoreOptions& opt) noexcept {
  if constexpr (sizeof(T) == 2) {
    if constexpr (kWgmma)
      if (m.num_offsets > 2 * kWgmmaMaxNTiles)
        return launch_score_max_mma_pipe<T, Id, HD, S, false, kSplits, kNormFfma, Cfg>(view, m, a, scores, stream, opt);
    using Shape = MmaMeanShape<T, HD, Cfg::kWarps, Cfg::kStages, Cfg::kKeys>;
    const std::size_t smem =
        score_max_mma_pipe_smem_bytes<T, HD, Cfg::kWarps, Cfg::kStages, kWgmma, kSplits, Cfg::kKeys>(m.num_offsets);
    if (smem > smem_optin_limit())
      return launch_score_max_mma<T, Id, HD, S>(view, m, a, scores, stream, opt);
    auto kernel = score_max_mma_pipe_kernel<T, Id, HD, S, Cfg::kWarps, Cfg::kStages, Cfg::kMinCtas, kWgmma, kSplits,
                                            Cfg::kKeys, kNormFfma>;
    static DynamicSmemGrant granted;
    static std::atomic<unsigned long long> cached{0};
    return launch_smem_scorer(kernel, Shape::kThreads, smem, Shape::kHeads, Shape::kTile, granted, cached, view, m, a,
                              scores, stream, opt);
  } else {
    return cudaErrorNotSupported;
  }
}

template <class T, class Id, int HD, RopeStyle S, int GMAX>
[[nodiscard]] inline cudaError_t launch_score_kernel(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                     const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                     const ScoreOptions& opt) noexcept {
  const int mean_variant = opt.mean_variant;
  const FastDiv fd(view.block.block_size);
  const long long rows = score_rows(m, a, GMAX);
  int sms = 0;
  TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
  if ((m.aggregation == Aggregation::kMean || m.disable_trig) && mean_variant == 1) {
    using Shape = ScoreShape<T, HD, GMAX, 4>;
    auto kernel = score_mean_pipe_kernel<T, Id, HD, S, GMAX>;
    static const int per_sm = resident_ctas(kernel, Shape::kThreads, 0);
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    kernel<<<score_grid(items, sms, per_sm, opt), Shape::kThreads, 0, stream>>>(view, m, a, scores, fd);
    return check_launch(stream);
  }
  if (m.aggregation == Aggregation::kMean || m.disable_trig) {
    using Shape = ScoreShape<T, HD, GMAX, 8>;
    auto kernel = score_mean_kernel<T, Id, HD, S, GMAX>;
    static const int per_sm = resident_ctas(kernel, Shape::kThreads, 0);
    const long long items = rows * ((a.max_len + Shape::kTile - 1) / Shape::kTile);
    kernel<<<score_grid(items, sms, per_sm, opt), Shape::kThreads, 0, stream>>>(view, m, a, scores, fd);
    return check_launch(stream);
  }
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
}

/// Warp-specialized max scorer (max_variant 5: two accumulator sets per tile from m64n144 steps,
/// 6: one m64n72 chain): one CTA per SM; |D| > 18 offsets, or shared memory beyond the device's
/// limit, run as max_variant 4.
template <class T, class Id, int HD, RopeStyle S, int kChains, class Cfg = tuning::sm90::ScoreMaxWs>
[[nodiscard]] inline cudaError_t launch_score_max_ws(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                     const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                     const ScoreOptions& opt) noexcept {
  if constexpr (sizeof(T) == 2) {
    using Shape = MaxWsShape<T, HD, Cfg::kStages>;
    const std::size_t smem = Shape::smem_bytes(m.num_offsets);
    if (m.num_offsets > 2 * kWgmmaMaxNTiles || smem > smem_optin_limit())
      return launch_score_max_mma_pipe<T, Id, HD, S, true, 2, true>(view, m, a, scores, stream, opt);
    auto kernel = score_max_ws_kernel<T, Id, HD, S, Cfg::kStages, kChains>;
    if constexpr (kChains > 1) {
      // setmaxnreg's targets balance the registers of a launch at Shape::kLaunchRegs; a build
      // whose kernel got fewer would hang in setmaxnreg.inc, so it runs as max_variant 4
      static const bool regs_match =
          kernel_attributes_satisfy(kernel, [](const cudaFuncAttributes& f) { return f.numRegs == Shape::kLaunchRegs; });
      if (!regs_match) return launch_score_max_mma_pipe<T, Id, HD, S, true, 2, true>(view, m, a, scores, stream, opt);
    }
    static DynamicSmemGrant granted;
    static std::atomic<unsigned long long> cached{0};  // 1 CTA per SM for every |D|: its 12 warps fill the registers
    return launch_smem_scorer(kernel, Shape::kThreads, smem, Shape::kHeads, Shape::kTile, granted, cached, view, m, a,
                              scores, stream, opt);
  } else {
    return cudaErrorNotSupported;
  }
}

/// Direct max scorer (max_variant 7; 8 with Cfg ScoreMaxDirectWide): |D| > 18 offsets, or shared
/// memory beyond the device's limit, run as score_max_mma_kernel; builds without sm_90a as
/// max_variant 4.
template <class T, class Id, int HD, RopeStyle S, class Cfg = tuning::sm90::ScoreMaxDirect>
[[nodiscard]] inline cudaError_t launch_score_max_direct(const KvCacheView<T, Id>& view, const ScoreModelView& m,
                                                         const ScoreBatch& a, float* scores, cudaStream_t stream,
                                                         const ScoreOptions& opt) noexcept {
  if constexpr (sizeof(T) == 2) {
    using Shape = MaxDirectShape<T, HD, Cfg::kBufs>;
    const std::size_t smem = Shape::smem_bytes(m.num_offsets);
    if (m.num_offsets > 2 * kWgmmaMaxNTiles || smem > smem_optin_limit())
      return launch_score_max_mma<T, Id, HD, S>(view, m, a, scores, stream, opt);
    auto kernel = score_max_direct_kernel<T, Id, HD, S, Cfg::kBufs, Cfg::kMinCtas>;
    // A build without sm_90a compiles the kernel as an empty marker with static shared memory
    // (the kernel's first lines): run max_variant 4 there
    static const bool wgmma_build = kernel_attributes_satisfy(kernel, [](const cudaFuncAttributes& f) {
      return f.sharedSizeBytes < static_cast<std::size_t>(kDirectNoWgmmaMarkerBytes);
    });
    if (!wgmma_build) return launch_score_max_mma_pipe<T, Id, HD, S, true, 2, true>(view, m, a, scores, stream, opt);
    static DynamicSmemGrant granted;
    static std::atomic<unsigned long long> cached{0};
    return launch_smem_scorer(kernel, Shape::kThreads, smem, Shape::kHeads, Shape::kTile, granted, cached, view, m, a,
                              scores, stream, opt);
  } else {
    return cudaErrorNotSupported;
  }
}

}  // namespace detail

/// Scores slots [0, length) of every sequence of the batch for every (layer, query head).
/// Query head h reads KV head h / (Hq / Hkv). Mean aggregation (or disable_trig) uses the exact
/// fold; max aggregation the |D| per-offset weight sets (on the tensor cores for 16-bit caches
/// unless options.tensor_core_max is false).
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
template <class T, class Id>
[[nodiscard]] cudaError_t score(const KvCacheView<T, Id>& view, const ScoreModelView& model, const ScoreBatch& batch,
                                float* scores, cudaStream_t stream = nullptr,
                                const ScoreOptions& options = {}) noexcept {
  TRIATTN_CUDA_RETURN_IF_ERROR(detail::check_score_args(view, model, batch, scores));
  if (batch.batch == 0 || batch.max_len == 0) return cudaSuccess;
  const int G = model.num_q_heads / model.num_kv_heads;
  const bool mma = detail::use_mma_max<T>(model, options);
  const bool ring_ok = detail::ring_offsets_fit(view);  // else the non-ring kernels
  const bool mma_mean = ring_ok && detail::use_mma_mean<T>(model, options);
  return dispatch_head_dim_status(view.block.head_dim, [&](auto hd) -> cudaError_t {
    constexpr int HD = decltype(hd)::value;
    const auto by_group = [&](auto style) -> cudaError_t {
      constexpr RopeStyle S = decltype(style)::value;
      using Tune = tuning::sm90::ScoreMeanMma;
      if (mma && options.max_variant == 7)
        return detail::launch_score_max_direct<T, Id, HD, S>(view, model, batch, scores, stream, options);
      if (mma && options.max_variant == 8)
        return detail::launch_score_max_direct<T, Id, HD, S, tuning::sm90::ScoreMaxDirectWide>(
            view, model, batch, scores, stream, options);
      if (mma && options.max_variant == 5 && ring_ok)
        return detail::launch_score_max_ws<T, Id, HD, S, 2>(view, model, batch, scores, stream, options);
      if (mma && options.max_variant == 6 && ring_ok)
        return detail::launch_score_max_ws<T, Id, HD, S, 1>(view, model, batch, scores, stream, options);
      if (mma && options.max_variant == 2 && ring_ok)
        return detail::launch_score_max_mma_pipe<T, Id, HD, S, true>(view, model, batch, scores, stream, options);
      if (mma && options.max_variant == 3 && ring_ok)
        return detail::launch_score_max_mma_pipe<T, Id, HD, S, true, 2>(view, model, batch, scores, stream, options);
      if (mma && options.max_variant == 4 && ring_ok)
        return detail::launch_score_max_mma_pipe<T, Id, HD, S, true, 2, true>(view, model, batch, scores, stream,
                                                                             options);
      if (mma && options.max_variant >= 1 && ring_ok)
        return detail::launch_score_max_mma_pipe<T, Id, HD, S, false>(view, model, batch, scores, stream, options);
      if (mma) return detail::launch_score_max_mma<T, Id, HD, S>(view, model, batch, scores, stream, options);
      if (mma_mean && options.mean_variant == 2)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant2>(view, model, batch, scores, stream, options);
      if (mma_mean && options.mean_variant == 3)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant3>(view, model, batch, scores, stream, options);
      if (mma_mean && options.mean_variant == 5)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant5>(view, model, batch, scores, stream, options);
      if (mma_mean && options.mean_variant == 6)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant6>(view, model, batch, scores, stream, options);
      if (mma_mean && options.mean_variant == 7)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant7>(view, model, batch, scores, stream, options);
      if (mma_mean && options.mean_variant == 8)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant8>(view, model, batch, scores, stream, options);
      if (mma_mean)
        return detail::launch_score_mean_mma<T, Id, HD, S, Tune::Variant4>(view, model, batch, scores, stream, options);
      if (G <= 4) return detail::launch_score_kernel<T, Id, HD, S, 4>(view, model, batch, scores, stream, options);
      return detail::launch_score_kernel<T, Id, HD, S, 8>(view, model, batch, scores, stream, options);  // G > 8: chunks of 8
    };
    if (model.style == RopeStyle::kHalf) return by_group(std::integral_constant<RopeStyle, RopeStyle::kHalf>{});
    return by_group(std::integral_constant<RopeStyle, RopeStyle::kInterleaved>{});
  });
}

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Launcher of the SnapKV-style scorer kernels: for a batch of sequences, the causal softmax
// attention of n window queries over each sequence's cached keys, averaged over the window and
// max-pooled along the tokens (ref::snapkv_scores per (sequence, layer, query head)). The window
// comes from the engine (post-RoPE queries and their logical positions, e.g.
// SnapKvScorer::pack_window per sequence); the GQA max and the top-k are the selector's.
// Same batch shape as cuda::score (TriAttention). Two-phase like CUB: workspace_size(), then
// run(workspace, ...).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <triattn/core/config.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/score_model_view.cuh>
#include <triattn/cuda/kernels/snapkv_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// The observation window of every sequence of a batch (device memory).
struct SnapKvWindow {
  const float* queries = nullptr;         ///< [batch, L, num_queries, Hq, head_dim] post-RoPE queries
  const std::int64_t* positions = nullptr;  ///< [batch, L, num_queries] logical positions (< 0: empty slot)
  int num_queries = 0;                    ///< n in [1, kSnapKvMaxQueries]
  int pool_kernel = 7;                    ///< odd >= 1 (1: no pooling)
};

/// The algorithm under a SnapKv tuning policy; snapkv (below) takes the selected one.
template <class Policy>
struct basic_snapkv {
  /// Bytes of workspace run() needs (256-byte aligned parts): per-chunk softmax partials
  /// [batch, L, Hq, n, ceil(max_len / Policy::kChunk)], final stats [batch, L, Hq, n] and the
  /// pre-pool attention [batch, L, Hq, max_len]. 0 when there is nothing to score.
  [[nodiscard]] static std::size_t workspace_size(int batch, int num_layers, int num_q_heads, int num_queries,
                                                  int max_len) noexcept {
    if (batch <= 0 || num_layers <= 0 || num_q_heads <= 0 || num_queries <= 0 || max_len <= 0) return 0;
    return layout(batch, num_layers, num_q_heads, num_queries, max_len).total;
  }

  /// Scores slots [0, length_b) of every sequence of the batch for every (layer, query head).
  /// Window query i of (sequence b, layer l) attends slots j <= snapkv_visible_limit(length_b,
  /// t0[b], positions[b, l, i]).
  /// @param workspace device memory of at least workspace_size(...) bytes, 256-byte aligned
  /// @param view      paged cache in device memory; its seq_lens give each sequence's length
  /// @param batch     seq_ids [batch] and t0 [batch] in device memory; max_len >= every length
  /// @param scores    [batch, L, Hq, max_len] device output; slots past a length are untouched
  /// @return cudaErrorInvalidValue on bad arguments or a short/misaligned workspace,
  ///         cudaErrorNotSupported for an uncompiled head dim, else the first failing launch's status
  /// @note asynchronous on `stream`; allocates nothing, never throws; capturable in a CUDA graph.
  template <class T, class Id>
  [[nodiscard]] static cudaError_t run(void* workspace, std::size_t workspace_bytes, const KvCacheView<T, Id>& view,
                                       int num_q_heads, const ScoreBatch& batch, const SnapKvWindow& window,
                                       float* scores, cudaStream_t stream = nullptr) noexcept {
    const int hkv = view.block.num_kv_heads;
    const std::int64_t rows = static_cast<std::int64_t>(view.num_layers) * num_q_heads;  // (layer, q head)
    if (hkv <= 0 || num_q_heads <= 0 || num_q_heads % hkv != 0 || batch.batch < 0 || batch.max_len < 0 ||
        batch.batch > 65535 || rows <= 0 || rows > 65535 || window.num_queries < 1 ||
        window.num_queries > kSnapKvMaxQueries || window.pool_kernel < 1 || window.pool_kernel % 2 == 0)
      return cudaErrorInvalidValue;
    if (batch.batch == 0 || batch.max_len == 0) return cudaSuccess;
    if (scores == nullptr || batch.seq_ids == nullptr || batch.t0 == nullptr || window.queries == nullptr ||
        window.positions == nullptr || !has_kv_memory(view) || view.block_tables == nullptr ||
        view.seq_lens == nullptr || workspace == nullptr || !is_aligned(workspace, 256) ||
        workspace_bytes < workspace_size(batch.batch, view.num_layers, num_q_heads, window.num_queries, batch.max_len))
      return cudaErrorInvalidValue;
    const Layout w = layout(batch.batch, view.num_layers, num_q_heads, window.num_queries, batch.max_len);
    char* base = static_cast<char*>(workspace);
    SnapKvKernelParams p{};
    p.seq_ids = batch.seq_ids;
    p.t0 = batch.t0;
    p.max_len = batch.max_len;
    p.num_q_heads = num_q_heads;
    p.num_queries = window.num_queries;
    p.num_chunks = w.chunks;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(view.block.head_dim)));
    p.pool_kernel = window.pool_kernel;
    p.queries = window.queries;
    p.positions = window.positions;
    p.partial = reinterpret_cast<float2*>(base + w.partial);
    p.stats = reinterpret_cast<float2*>(base + w.stats);
    p.attn = reinterpret_cast<float*>(base + w.attn);
    p.out = scores;
    return dispatch_head_dim_status(view.block.head_dim, [&](auto hd) -> cudaError_t {
      constexpr int kHd = decltype(hd)::value;
      const dim3 grid(static_cast<unsigned>(w.chunks), static_cast<unsigned>(rows), static_cast<unsigned>(batch.batch));
      snapkv_partial_kernel<kHd, T, Id, Policy><<<grid, 32 * Policy::kWarps, 0, stream>>>(view, p);
      TRIATTN_CUDA_RETURN_IF_ERROR(check_launch(stream));
      const std::int64_t stat_rows = static_cast<std::int64_t>(batch.batch) * rows * window.num_queries;
      constexpr int kStatWarps = Policy::kStatWarps;
      snapkv_stats_kernel<kStatWarps>
          <<<static_cast<unsigned>(triattn::detail::ceil_div<std::int64_t>(stat_rows, kStatWarps)), 32 * kStatWarps, 0,
             stream>>>(p, stat_rows);
      TRIATTN_CUDA_RETURN_IF_ERROR(check_launch(stream));
      snapkv_attention_kernel<kHd, T, Id, Policy><<<grid, 32 * Policy::kWarps, 0, stream>>>(view, p);
      TRIATTN_CUDA_RETURN_IF_ERROR(check_launch(stream));
      constexpr int kPoolThreads = Policy::kPoolThreads;
      const std::int64_t total = static_cast<std::int64_t>(batch.batch) * rows * batch.max_len;
      const std::int64_t blocks = triattn::detail::ceil_div<std::int64_t>(total, kPoolThreads);
      snapkv_pool_kernel<kPoolThreads, Id>
          <<<static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8), kPoolThreads, 0, stream>>>(
              view.seq_lens, p, static_cast<int>(rows), total);
      return check_launch(stream);
    });
  }

 private:
  struct Layout {
    int chunks = 0;
    std::size_t partial = 0, stats = 0, attn = 0, total = 0;  // byte offsets, total size
  };
  static constexpr std::size_t align256(std::size_t b) noexcept { return (b + 255) / 256 * 256; }
  static Layout layout(int batch, int L, int hq, int n, int max_len) noexcept {
    Layout w;
    w.chunks = static_cast<int>(triattn::detail::ceil_div(max_len, Policy::kChunk));
    const std::size_t rows = static_cast<std::size_t>(batch) * static_cast<std::size_t>(L) * static_cast<std::size_t>(hq);
    w.partial = 0;
    w.stats = align256(rows * static_cast<std::size_t>(n) * static_cast<std::size_t>(w.chunks) * sizeof(float2));
    w.attn = w.stats + align256(rows * static_cast<std::size_t>(n) * sizeof(float2));
    w.total = w.attn + align256(rows * static_cast<std::size_t>(max_len) * sizeof(float));
    return w;
  }
};

using snapkv = basic_snapkv<tuning::Selected::SnapKv>;

}  // namespace triattn::cuda

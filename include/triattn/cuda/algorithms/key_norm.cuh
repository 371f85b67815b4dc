// SPDX-License-Identifier: Apache-2.0
// Launcher of the key-norm (KnormPress) scorer kernel: scores every cached key of a batch of
// sequences, scores[b, l, h, j] = −‖K[l, h / G, j]‖₂ of sequence seq_ids[b]. Reads K once
// (Σ_b L·Hkv·len_b·head_dim elements) and writes Σ_b L·Hq·len_b floats. Same batch shape as
// cuda::score (TriAttention), so an engine swaps one launcher for the other.
#pragma once

#include <cstddef>
#include <cstdint>

#include <triattn/core/config.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/kernels/key_norm_kernel.cuh>
#include <triattn/cuda/score_model_view.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

struct key_norm {
  /// The kernel needs no workspace.
  [[nodiscard]] static constexpr std::size_t workspace_size() noexcept { return 0; }

  /// Scores slots [0, length_b) of every sequence of the batch for every (layer, query head).
  /// @param view        paged cache in device memory; its seq_lens give each sequence's length
  /// @param num_q_heads Hq, a positive multiple of view.block.num_kv_heads
  /// @param batch       seq_ids [batch] in device memory (t0 is not used and may be null);
  ///                    max_len >= every length
  /// @param scores      [batch, L, Hq, max_len] device output; slots past a length are untouched
  /// @return cudaErrorInvalidValue on bad arguments, cudaErrorMisalignedAddress when head vectors
  ///         are not 16-byte aligned, cudaErrorNotSupported for an uncompiled head dim, else the
  ///         launch status
  /// @note asynchronous on `stream`; allocates nothing, never throws; capturable in a CUDA graph.
  /// Policy: the KeyNorm tuning (default: tuning::Selected::KeyNorm).
  template <class T, class Id, class Policy = tuning::Selected::KeyNorm>
  [[nodiscard]] static cudaError_t run(const KvCacheView<T, Id>& view, int num_q_heads, const ScoreBatch& batch,
                                       float* scores, cudaStream_t stream = nullptr) noexcept {
    const int hkv = view.block.num_kv_heads;
    const std::int64_t rows = static_cast<std::int64_t>(view.num_layers) * hkv;
    if (hkv <= 0 || num_q_heads <= 0 || num_q_heads % hkv != 0 || batch.batch < 0 || batch.max_len < 0 ||
        rows <= 0 || rows > 65535 || batch.batch > 65535)
      return cudaErrorInvalidValue;
    if (batch.batch == 0 || batch.max_len == 0) return cudaSuccess;
    if (scores == nullptr || batch.seq_ids == nullptr || !has_kv_memory(view) || view.block_tables == nullptr ||
        view.seq_lens == nullptr)
      return cudaErrorInvalidValue;
    if (!head_vectors_aligned(view, 16)) return cudaErrorMisalignedAddress;
    return dispatch_head_dim_status(view.block.head_dim, [&](auto hd) -> cudaError_t {
      constexpr int kHd = decltype(hd)::value;
      using Shape = KeyNormShape<kHd, T, Policy>;
      const std::int64_t tiles = triattn::detail::ceil_div<std::int64_t>(batch.max_len, Shape::kTokensPerBlock);
      const dim3 grid(static_cast<unsigned>(tiles < 65535 ? tiles : 65535), static_cast<unsigned>(rows),
                      static_cast<unsigned>(batch.batch));
      const KeyNormParams p{batch.seq_ids, batch.max_len, num_q_heads, scores};
      key_norm_kernel<kHd, T, Id, Policy><<<grid, Shape::kBlockThreads, 0, stream>>>(view, p);
      return check_launch(stream);
    });
  }
};

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Launcher of the append kernel: writes K and V of new tokens into the paged cache (decode: one
// token per sequence; prefill: many tokens of one or more sequences), one layer or all layers in
// one launch; float K and V are quantised to the cache's dtype (the fp8 append). No throw, no
// allocation, no synchronisation; returns the launch status.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/append_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// Policy of every entry point: the Append tuning (default: tuning::Selected::Append).
struct append {
  /// General form. The view's data must be device memory; its block tables and lengths too for
  /// kContiguous / kLastSlot (kSlotMapping never reads them). In = T copies the values; In =
  /// float quantises them to T (fp8: x / scale of the layer and head, saturating; the scales are
  /// the view's, device memory), as KvCache::append_values does on the host.
  /// @return cudaErrorInvalidValue on bad shapes, null or misaligned pointers (k, v and their
  /// strides must be 16-byte multiples and multiples of a 16-byte cache vector's elements),
  /// cudaErrorNotSupported for an uncompiled head_dim, else the launch status.
  template <class T, class Id, class Policy = tuning::Selected::Append, class In>
  [[nodiscard]] static cudaError_t run(const KvCacheView<T, Id>& view, const AppendParams<In>& p,
                                       cudaStream_t stream) noexcept {
    static_assert(std::is_same_v<In, T> || std::is_same_v<In, float>, "append: k and v are T or float");
    if (p.num_tokens < 0 || p.num_layers < 0 || p.first_layer < 0 || p.first_layer + p.num_layers > view.num_layers)
      return cudaErrorInvalidValue;
    if (p.num_tokens == 0 || p.num_layers == 0) return cudaSuccess;
    if (p.num_layers > 65535) return cudaErrorInvalidValue;  // grid.y
    constexpr std::int64_t kVecElems = 16 / static_cast<std::int64_t>(sizeof(T));
    const int d = view.block.head_dim;
    if (p.k == nullptr || p.v == nullptr || !has_kv_memory(view) || !is_aligned(p.k, 16) || !is_aligned(p.v, 16) ||
        !head_vectors_aligned(view, 16) || p.token_stride % kVecElems != 0 || d % kVecElems != 0 ||
        (p.num_layers > 1 && p.layer_stride % kVecElems != 0))
      return cudaErrorInvalidValue;
    if (p.token_stride < static_cast<std::int64_t>(view.block.num_kv_heads) * d) return cudaErrorInvalidValue;
    if (p.source == SlotSource::kSlotMapping && p.slot_mapping == nullptr) return cudaErrorInvalidValue;
    if (p.source == SlotSource::kLastSlot && (p.seq_ids == nullptr || view.seq_lens == nullptr))
      return cudaErrorInvalidValue;
    if (p.source != SlotSource::kSlotMapping && view.block_tables == nullptr) return cudaErrorInvalidValue;
    if (p.source == SlotSource::kContiguous &&
        (p.seq < 0 || p.seq >= view.max_seqs || p.first_slot < 0 ||
         static_cast<std::int64_t>(p.first_slot) + p.num_tokens >
             static_cast<std::int64_t>(view.max_blocks_per_seq) * view.block.block_size))
      return cudaErrorInvalidValue;

    const std::int64_t vecs = static_cast<std::int64_t>(p.num_tokens) * view.block.num_kv_heads * (d / kVecElems);
    constexpr int kThreads = Policy::kThreads;
    constexpr int kPerCta = kThreads * Policy::kVecsPerThread;
    if (vecs > std::numeric_limits<int>::max() - kPerCta) return cudaErrorInvalidValue;  // int32 vector index
    const dim3 grid(static_cast<unsigned>((vecs + kPerCta - 1) / kPerCta), static_cast<unsigned>(p.num_layers));
    return dispatch_head_dim_status(d, [&](auto hd) {
      if constexpr (std::is_same_v<In, T>)
        append_kernel<decltype(hd)::value, T, Id, Policy><<<grid, kThreads, 0, stream>>>(view, p);
      else
        append_values_kernel<decltype(hd)::value, T, Id, Policy><<<grid, kThreads, 0, stream>>>(view, p);
      return check_launch(stream);
    });
  }

  /// Tokens to explicit slots. k, v: [num_layers, num_tokens, num_kv_heads, head_dim] packed
  /// (num_layers = 1: [num_tokens, num_kv_heads, head_dim]); slot_mapping: [num_tokens] device
  /// int64, -1 skips the token.
  template <class T, class Id, class Policy = tuning::Selected::Append, class In>
  [[nodiscard]] static cudaError_t run_slots(const KvCacheView<T, Id>& view, int first_layer, int num_layers,
                                             const In* k, const In* v, const std::int64_t* slot_mapping,
                                             int num_tokens, cudaStream_t stream) noexcept {
    AppendParams<In> p = packed(view, k, v, num_tokens, first_layer, num_layers);
    p.source = SlotSource::kSlotMapping;
    p.slot_mapping = slot_mapping;
    return run<T, Id, Policy, In>(view, p, stream);
  }

  /// Prefill of one sequence: token i goes to slot first_slot + i of `seq` (device tables).
  /// k, v: [num_layers, num_tokens, num_kv_heads, head_dim] packed.
  template <class T, class Id, class Policy = tuning::Selected::Append, class In>
  [[nodiscard]] static cudaError_t run_contiguous(const KvCacheView<T, Id>& view, int seq, int first_slot,
                                                  int first_layer, int num_layers, const In* k, const In* v,
                                                  int num_tokens, cudaStream_t stream) noexcept {
    AppendParams<In> p = packed(view, k, v, num_tokens, first_layer, num_layers);
    p.source = SlotSource::kContiguous;
    p.seq = seq;
    p.first_slot = first_slot;
    return run<T, Id, Policy, In>(view, p, stream);
  }

  /// Decode: token i goes to the last slot (seq_lens[s] - 1, i.e. after extend + publish) of
  /// sequence s = seq_ids[i]; seq_ids: [batch] device, -1 skips. k, v: [num_layers, batch,
  /// num_kv_heads, head_dim] packed.
  template <class T, class Id, class Policy = tuning::Selected::Append, class In>
  [[nodiscard]] static cudaError_t run_decode(const KvCacheView<T, Id>& view, const std::int32_t* seq_ids,
                                              int first_layer, int num_layers, const In* k, const In* v, int batch,
                                              cudaStream_t stream) noexcept {
    AppendParams<In> p = packed(view, k, v, batch, first_layer, num_layers);
    p.source = SlotSource::kLastSlot;
    p.seq_ids = seq_ids;
    return run<T, Id, Policy, In>(view, p, stream);
  }

  /// Host helper: slots of `n` consecutive tokens starting at `first_slot` of a sequence whose
  /// blocks are `block_table` (out: [n]). Returns false when a slot falls outside the table.
  [[nodiscard]] static bool host_slot_mapping(std::span<const std::int32_t> block_table, int block_size,
                                              int first_slot, int n, std::int64_t* out) noexcept {
    for (int i = 0; i < n; ++i) {
      const std::int64_t pos = static_cast<std::int64_t>(first_slot) + i;
      const std::int64_t j = pos / block_size;
      if (pos < 0 || j >= static_cast<std::int64_t>(block_table.size()) || block_table[static_cast<std::size_t>(j)] < 0)
        return false;
      out[i] = static_cast<std::int64_t>(block_table[static_cast<std::size_t>(j)]) * block_size + pos % block_size;
    }
    return true;
  }

 private:
  template <class T, class Id, class In>
  static AppendParams<In> packed(const KvCacheView<T, Id>& view, const In* k, const In* v, int num_tokens,
                                 int first_layer, int num_layers) noexcept {
    AppendParams<In> p{};
    p.k = k;
    p.v = v;
    p.token_stride = static_cast<std::int64_t>(view.block.num_kv_heads) * view.block.head_dim;
    p.layer_stride = p.token_stride * num_tokens;
    p.num_tokens = num_tokens;
    p.first_layer = first_layer;
    p.num_layers = num_layers;
    p.seq = -1;
    return p;
  }
};

}  // namespace triattn::cuda

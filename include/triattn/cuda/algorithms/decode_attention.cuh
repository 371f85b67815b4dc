// SPDX-License-Identifier: Apache-2.0
// Launcher of paged decode attention (flash decoding). Two-phase like CUB:
//   plan = decode_attention::make_plan(...)               (host arithmetic, no CUDA call)
//   bytes = decode_attention::workspace_size(plan, ...)   (0 when there is one split)
//   decode_attention::run(plan, ..., workspace, bytes, stream)
// run() launches the split kernel and, with more than one split, the combine kernel through
// programmatic dependent launch, so its launch latency hides behind the split kernel's tail.
// No throw, no allocation, no synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/decode_attention_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// How one decode_attention call splits its work. Plain data: engines may build it themselves.
struct DecodeAttentionPlan {
  int num_splits = 1;        ///< token splits per (entry, KV head); 1 = no combine kernel
  int tokens_per_split = 0;  ///< > 0
  int heads_per_pass = 0;    ///< query heads per CTA: 8 (16-bit caches) or 4 (fp32, fp8)
};

/// The algorithm under a DecodeAttention tuning policy Tune; decode_attention (below) takes the
/// selected one (tuning::Selected).
template <class Tune>
struct basic_decode_attention {

  /// True when caches of `dtype` take the CUDA-core kernel (fp32, fp8), false for the 16-bit
  /// tensor-core kernel.
  [[nodiscard]] static constexpr bool cuda_core_kernel(DType dtype) noexcept {
    return dtype == DType::kF32 || dtype == DType::kFP8E4M3;
  }
  /// Query heads one CTA handles for a cache of `dtype`.
  [[nodiscard]] static constexpr int heads_per_pass(DType dtype) noexcept {
    return cuda_core_kernel(dtype) ? Tune::kHeadsPerPassF32 : Tune::kHeadsPerPassMma;
  }

  /// Picks the split so that batch * num_kv_heads * passes * splits CTAs fill one wave of
  /// `resident_ctas` (see resident_ctas()), without splits shorter than kMinTokensPerSplit.
  /// max_seq_len: an upper bound of the batch's physical lengths (tokens past it are ignored).
  /// resident_ctas: resident_ctas<T>(head_dim, &n).
  [[nodiscard]] static DecodeAttentionPlan make_plan(DType dtype, int batch, int num_kv_heads, int group_size,
                                                     int max_seq_len, int resident_ctas) noexcept {
    DecodeAttentionPlan plan;
    plan.heads_per_pass = heads_per_pass(dtype);
    const int passes = (group_size + plan.heads_per_pass - 1) / plan.heads_per_pass;
    const std::int64_t base = static_cast<std::int64_t>(batch > 0 ? batch : 1) * (num_kv_heads > 0 ? num_kv_heads : 1) *
                              (passes > 0 ? passes : 1);
    const int len = max_seq_len > 0 ? max_seq_len : 1;
    std::int64_t splits = resident_ctas > base ? resident_ctas / base : 1;
    const std::int64_t useful = (len + Tune::kMinTokensPerSplit - 1) / Tune::kMinTokensPerSplit;
    splits = triattn::detail::max_<std::int64_t>(
        1, triattn::detail::min_<std::int64_t>(splits, triattn::detail::min_<std::int64_t>(useful, Tune::kMaxSplits)));
    std::int64_t tps = (len + splits - 1) / splits;
    tps = (tps + Tune::kSplitGranule - 1) / Tune::kSplitGranule * Tune::kSplitGranule;
    plan.tokens_per_split = static_cast<int>(tps);
    plan.num_splits = static_cast<int>((len + tps - 1) / tps);
    return plan;
  }

  /// CTAs of the split kernel for T that the current device keeps resident at once
  /// (multiprocessors x occupancy).
  template <class T>
  [[nodiscard]] static cudaError_t resident_ctas(int head_dim, int* out) noexcept {
    int sms = 0;
    TRIATTN_CUDA_RETURN_IF_ERROR(current_device_sm_count(&sms));
    int per_sm = 0;
    const cudaError_t e = dispatch_head_dim_status(head_dim, [&](auto hd) {
      constexpr int kD = decltype(hd)::value;
      if constexpr (cuda_core_kernel(dtype_of<T>)) {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, decode_attention_f32_kernel<kD, std::int32_t, float, Tune, T>, Tune::kThreads, 0);
      } else {
        // Same resources for every Id / OutT instantiation.
        auto kernel = decode_attention_mma_pipe_kernel<kD, T, std::int32_t, T, Tune>;
        TRIATTN_CUDA_RETURN_IF_ERROR(prepare_pipe_kernel<kD>(kernel));
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Tune::kThreads,
                                                             decode_attention_pipe_smem_bytes<kD, Tune>());
      }
    });
    if (e != cudaSuccess) return e;
    *out = sms * (per_sm > 0 ? per_sm : 1);
    return cudaSuccess;
  }

  /// Bytes of workspace run() needs for `plan` (0 with one split).
  [[nodiscard]] static std::size_t workspace_size(const DecodeAttentionPlan& plan, int batch, int num_q_heads,
                                                  int head_dim) noexcept {
    if (plan.num_splits <= 1) return 0;
    const std::size_t rows = static_cast<std::size_t>(batch) * num_q_heads * plan.num_splits;
    return align(rows * head_dim * sizeof(float)) + align(rows * sizeof(float2));
  }

  /// Decode attention of `batch` entries at `layer`: entry b attends sequence seq_ids[b] (or b
  /// when seq_ids is null) over its physical length with query q[b]; query head h reads KV head
  /// h / (num_q_heads / num_kv_heads). An empty sequence gives zeros.
  /// The view's data, block tables and lengths must be device memory.
  /// q: [batch, num_q_heads, head_dim] (device, 16-byte aligned); out: [batch, num_q_heads,
  /// head_dim] (device), OutT = float or T; seq_ids: [batch] device or nullptr. fp8 caches: q is
  /// float and OutT float; K and V are dequantised by the view's scales (device memory).
  /// Every length must be <= plan.num_splits * plan.tokens_per_split (tokens past it are
  /// ignored), i.e. plan from an upper bound of the lengths.
  /// @return cudaErrorInvalidValue on bad arguments or a too small workspace,
  /// cudaErrorNotSupported for an uncompiled head_dim, else the launch status.
  template <class T, class Id, class OutT>
  [[nodiscard]] static cudaError_t run(const DecodeAttentionPlan& plan, const KvCacheView<T, Id>& view, int layer,
                                       const query_type_t<T>* q, OutT* out, int batch, int num_q_heads,
                                       const std::int32_t* seq_ids, float sm_scale, void* workspace,
                                       std::size_t workspace_bytes, cudaStream_t stream) noexcept {
    static_assert(std::is_same_v<OutT, float> || (std::is_same_v<OutT, T> && !is_scaled_dtype<T>),
                  "decode_attention: out is float or T (float for fp8 caches)");
    if (batch < 0 || batch > 65535) return cudaErrorInvalidValue;
    if (batch == 0) return cudaSuccess;
    const int hkv = view.block.num_kv_heads;
    const int d = view.block.head_dim;
    if (hkv <= 0 || num_q_heads <= 0 || num_q_heads % hkv != 0 || layer < 0 || layer >= view.num_layers)
      return cudaErrorInvalidValue;
    if (plan.heads_per_pass != heads_per_pass(dtype_of<T>) || plan.num_splits < 1 || plan.tokens_per_split <= 0 ||
        plan.num_splits > Tune::kMaxSplits)
      return cudaErrorInvalidValue;
    if (q == nullptr || out == nullptr || !has_kv_memory(view) || view.block_tables == nullptr ||
        view.seq_lens == nullptr || !is_aligned(q, 16) || !head_vectors_aligned(view, 16) ||
        (d * sizeof(T)) % 16 != 0)
      return cudaErrorInvalidValue;
    const int group = num_q_heads / hkv;
    const int passes = (group + plan.heads_per_pass - 1) / plan.heads_per_pass;
    if (static_cast<std::int64_t>(hkv) * passes > 65535) return cudaErrorInvalidValue;

    DecodeAttentionParams<T, OutT> p{};
    p.q = q;
    p.out = out;
    p.seq_ids = seq_ids;
    p.num_q_heads = num_q_heads;
    p.group_size = group;
    p.heads_per_pass = plan.heads_per_pass;
    p.layer = layer;
    p.num_splits = plan.num_splits;
    p.tokens_per_split = plan.tokens_per_split;
    p.scale_log2 = sm_scale * 1.4426950408889634f;
    if (plan.num_splits > 1) {
      if (workspace == nullptr || workspace_bytes < workspace_size(plan, batch, num_q_heads, d) ||
          !is_aligned(workspace, 16))
        return cudaErrorInvalidValue;
      const std::size_t rows = static_cast<std::size_t>(batch) * num_q_heads * plan.num_splits;
      char* ws = static_cast<char*>(workspace);
      p.partial_o = reinterpret_cast<float*>(ws);
      p.partial_ml = reinterpret_cast<float2*>(ws + align(rows * d * sizeof(float)));
    }

    const dim3 grid(static_cast<unsigned>(plan.num_splits), static_cast<unsigned>(hkv * passes),
                    static_cast<unsigned>(batch));
    return dispatch_head_dim_status(d, [&](auto hd) -> cudaError_t {
      constexpr int kD = decltype(hd)::value;
      if constexpr (cuda_core_kernel(dtype_of<T>)) {
        decode_attention_f32_kernel<kD, Id, OutT, Tune, T><<<grid, Tune::kThreads, 0, stream>>>(view, p);
      } else {
        auto kernel = decode_attention_mma_pipe_kernel<kD, T, Id, OutT, Tune>;
        TRIATTN_CUDA_RETURN_IF_ERROR(prepare_pipe_kernel<kD>(kernel));
        kernel<<<grid, Tune::kThreads, decode_attention_pipe_smem_bytes<kD, Tune>(), stream>>>(view, p);
      }
      TRIATTN_CUDA_RETURN_IF_ERROR(check_launch(stream));
      if (plan.num_splits == 1) return cudaSuccess;

      const dim3 cgrid(static_cast<unsigned>(num_q_heads), static_cast<unsigned>(batch));
      // Dependent launch: the combine kernel's CTAs start during the split kernel's tail.
      const Id* lens = view.seq_lens;
      const float* po = p.partial_o;
      const float2* pml = p.partial_ml;
      TRIATTN_CUDA_RETURN_IF_ERROR(launch_dependent(decode_attention_combine_kernel<kD, Id, OutT, Tune>, cgrid,
                                                    dim3(kD), 0, stream, lens, seq_ids, po, pml, out, num_q_heads,
                                                    plan.num_splits, plan.tokens_per_split));
      return check_launch(stream);
    });
  }

  /// K + V bytes one call reads for `tokens` cached tokens in total over the batch (what
  /// benchmarks divide by time).
  [[nodiscard]] static constexpr std::int64_t bytes_read(std::int64_t tokens, int num_kv_heads, int head_dim,
                                                         std::size_t elem_bytes) noexcept {
    return tokens * 2 * num_kv_heads * head_dim * static_cast<std::int64_t>(elem_bytes);
  }

 private:
  static constexpr std::size_t align(std::size_t bytes) noexcept { return (bytes + 255) / 256 * 256; }

  /// Opts the cp.async kernel into its dynamic shared memory (and the carveout that fits the
  /// most CTAs). Cheap; called before every occupancy query and launch.
  template <int D, class K>
  static cudaError_t prepare_pipe_kernel(K* kernel) noexcept {
    TRIATTN_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      decode_attention_pipe_smem_bytes<D, Tune>()));
    return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  }
};

using decode_attention = basic_decode_attention<tuning::Selected::DecodeAttention>;

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Page-granular bulk copies of a paged K cache (TMA, sm_90): a tensor map over every layer's K
// range, built on the host through the driver's cuTensorMapEncodeTiled (fetched at run time, so
// nothing links libcuda), and the device side of one copy into shared memory that completes on
// an mbarrier.
// Why: the ring scorers move each key slice with 16-byte cp.async, one per chunk and lane, plus
// the address arithmetic per chunk (~100 instructions per lane per 32-key slice); where the
// scorer is bound by its instruction issue (the tensor-core max scorer: H200 trace, 2026-12-02,
// 12.7% of each warp's loop issuing copies, 0.3% waiting for them) one lane issuing a few
// tensor copies per slice frees those slots. (Where the scorer waits on memory it does not pay:
// a probe streaming one 32K layer page by page through TMA ran at the cp.async ring's rate,
// benchmarks/probe/page_tma_probe.cu.)
#pragma once

#include <cuda.h>  // CUtensorMap and its enums: types only, no link dependency
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>

namespace triattn::cuda::detail {

/// Keys a tensor copy moves per key group: 16-row boxes, so that every 16-aligned group of keys
/// of a cache with pages of a multiple of 16 tokens lies in one page.
inline constexpr int kKeyTmaRows = 16;
/// Elements of a key row one box covers: 128 bytes, the span of the 128-byte swizzle.
inline constexpr int kKeyTmaCols = 64;

/// A tensor map over the K ranges of a KvCacheView (5-D, innermost first: NHD {head_dim,
/// KV heads, block_size, num_blocks, layers}, HND {head_dim, block_size, KV heads, num_blocks,
/// layers}) with boxes of kKeyTmaRows keys x kKeyTmaCols elements, 128-byte swizzled in shared
/// memory: 16-byte chunk c of box row r lands at chunk c ^ (r & 7) of its 128-byte row (the
/// layout the ring scorers' ldmatrix reads, given a 1024-byte aligned destination).
/// `valid` is false when the view cannot be described (see make_key_tensor_map); passed by value
/// as a __grid_constant__ kernel parameter.
struct KeyTensorMap {  // 128-byte aligned (CUtensorMap)
  CUtensorMap map;
  int valid;
};
static_assert(std::is_trivially_copyable_v<KeyTensorMap>, "a kernel parameter");

/// cuTensorMapEncodeTiled from the driver, loaded once (nullptr where there is no driver).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encode_tiled() noexcept {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

/// The K tensor map of `view` (16-bit elements). Not valid (valid = 0; the caller takes its
/// cp.async path) where TMA cannot address the cache: pages not a multiple of kKeyTmaRows
/// tokens, head_dim not a multiple of kKeyTmaCols, K ranges or blocks not 16-byte aligned, or
/// no driver entry point.
template <class T, class Id>
[[nodiscard]] inline KeyTensorMap make_key_tensor_map(const KvCacheView<T, Id>& view) noexcept {
  static_assert(sizeof(T) == 2, "16-bit caches");
  KeyTensorMap km{};
  const BlockLayout& b = view.block;
  const auto encode = tensor_map_encode_tiled();
  const std::uint64_t esz = sizeof(T);
  const std::uint64_t block_bytes = static_cast<std::uint64_t>(b.block_elems()) * esz;
  const std::uint64_t layer_bytes = 2 * static_cast<std::uint64_t>(view.range_stride) * esz;
  if (encode == nullptr || b.block_size % kKeyTmaRows != 0 || b.head_dim % kKeyTmaCols != 0 ||
      reinterpret_cast<std::uintptr_t>(view.data) % 16 != 0 || block_bytes % 16 != 0 || layer_bytes % 16 != 0 ||
      layer_bytes >= (std::uint64_t{1} << 40) || view.num_blocks <= 0 || view.num_layers <= 0)
    return km;
  const bool nhd = b.layout == KvLayout::kNHD;
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(b.head_dim),
                              static_cast<cuuint64_t>(nhd ? b.num_kv_heads : b.block_size),
                              static_cast<cuuint64_t>(nhd ? b.block_size : b.num_kv_heads),
                              static_cast<cuuint64_t>(view.num_blocks), static_cast<cuuint64_t>(view.num_layers)};
  const std::uint64_t row = static_cast<std::uint64_t>(b.head_dim) * esz;
  // byte strides of dims 1-4: the next head (NHD) or token (HND) is one row on
  const cuuint64_t strides[4] = {row, row * static_cast<std::uint64_t>(nhd ? b.num_kv_heads : b.block_size),
                                 block_bytes, layer_bytes};
  const cuuint32_t box[5] = {kKeyTmaCols, nhd ? 1u : static_cast<cuuint32_t>(kKeyTmaRows),
                             nhd ? static_cast<cuuint32_t>(kKeyTmaRows) : 1u, 1, 1};
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(&km.map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, static_cast<void*>(view.data), dims, strides,
                            box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  km.valid = r == CUDA_SUCCESS ? 1 : 0;
  return km;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/// This thread's expected transaction bytes on mbarrier `bar`, with its arrival (the barrier's
/// phase completes when every arrival and every expected byte is in).
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
/// One box of `km` at 5-D coordinates c (innermost first) into shared memory at dst (1024-byte
/// aligned for the swizzle), completing on mbarrier `bar`, with L2 cache policy `policy`.
__device__ __forceinline__ void tma_load_key_box(std::uint32_t dst, const KeyTensorMap& km, int c0, int c1, int c2,
                                                 int c3, int c4, std::uint32_t bar, std::uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7], %8;" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(&km.map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar), "l"(policy)
      : "memory");
}
/// Orders this thread's earlier generic-proxy accesses of shared memory before its later
/// async-proxy ones (a TMA refilling a stage the warp has just read).
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

}  // namespace triattn::cuda::detail

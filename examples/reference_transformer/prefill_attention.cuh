// SPDX-License-Identifier: Apache-2.0
// Causal prefill attention over the paged KV cache on tensor cores (FlashAttention-2 style),
// for 16-bit caches (bf16, f16) and head_dim 64 / 128; the CUDA backend runs it for every
// attention step that is not a decode step (cuda_backend.cuh), fp32 caches and other head dims
// keep attention_rows_kernel (cuda_kernels.cuh). So do fp8 e4m3 caches: attention_rows_kernel
// dequantises each K/V element by the view's scale and works in fp32, the CPU backend's
// arithmetic. Here fp8 would need its own staging (codes dequantised to bf16 in shared memory,
// scales per KV head, or e4m3 MMAs with q quantised too); not written yet.
//
// Semantics are attention_rows_kernel's: row r of sequence seq attends, with query head h, to
// the physical slots [0, row_slot[r]] of seq through its block table (KV head h / group). Slots
// are physical, not positions: after compression rounds a chunk starting at physical length
// len_before has row_slot = len_before + i, and the chunk's own K/V are in the cache already.
//
// Work split (prefill_tiles.hpp): CTA (KV head, tile) runs the tile's rows for all `group` query
// heads of its KV head as kPrefillMmaRows = 128 MMA rows (8 warps of 16), so each K/V block is
// read and staged once per GQA group. The KV slots [0, tile.kv_len) stream through shared memory
// in blocks of kPrefillKvBlock slots, a ring of kPrefillStages blocks in flight (cp.async, 16-byte
// chunks XOR-swizzled per row so ldmatrix is free of bank conflicts; the page table is read per
// staged slot). Per block and warp:
//   S[16 x 64]  = Q[16 x d] · K^T       mma.sync m16n8k16, Q fragments in registers, K^T
//                                       fragments by ldmatrix from K rows
//   online softmax in fp32 (log2 units); the causal mask only on blocks crossing a row's limit,
//   blocks past all of a warp's rows skipped
//   O[16 x d]  += P[16 x 64] · V        P rounded to the cache type (as FlashAttention does), V
//                                       by ldmatrix.trans
// q and out are the backend's fp32 activations [rows, hq, d]; q is rounded to the cache type
// once (as the decode path does), the logits are scaled in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/device/async_copy.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/kernels/decode_attention_kernel.cuh>  // mma_16816
#include <triattn/cuda/kernels/score_kernel.cuh>             // ldmatrix_x4
#include <triattn/cuda/launch.cuh>                           // DynamicSmemGrant
#include <triattn/cuda/types.cuh>

#include "prefill_tiles.hpp"

namespace triattn_example::gpu {

/// Why the tensor-core prefill kernel cannot take this cache, head_dim and GQA group, or "" if
/// it can: a 16-bit cache, head_dim 64 or 128, group 1..kPrefillMaxGroup, head vectors 16-byte
/// aligned (any NHD / HND / strided layout whose strides and base keep them so).
template <class T>
std::string prefill_attention_refusal(const triattn::KvCacheView<T, std::int32_t>& view, int head_dim, int group) {
  const triattn::DType dt = triattn::dtype_of<T>;
  if (dt != triattn::DType::kBF16 && dt != triattn::DType::kF16)
    return std::string("prefill attention: cache dtype ") + triattn::dtype_name(dt) +
           " has no tensor-core path (bf16 and f16 only)";
  if (head_dim != 64 && head_dim != 128)
    return "prefill attention: head_dim " + std::to_string(head_dim) + " is not compiled (64 and 128 only)";
  if (group < 1 || group > kPrefillMaxGroup)
    return "prefill attention: GQA group " + std::to_string(group) + " is outside 1.." + std::to_string(kPrefillMaxGroup);
  const triattn::BlockLayout& b = view.block;
  if (b.head_dim != head_dim) return "prefill attention: view.block.head_dim " + std::to_string(b.head_dim) +
                                     " differs from head_dim " + std::to_string(head_dim);
  if (b.stride_block % 8 != 0 || b.stride_token % 8 != 0 || b.stride_head % 8 != 0 || view.layer_stride % 8 != 0 ||
      view.kind_stride % 8 != 0 || reinterpret_cast<std::uintptr_t>(view.data) % 16 != 0)
    return "prefill attention: view strides / base leave head vectors unaligned to 16 bytes (layout not supported)";
  return {};
}

/// Kernel arguments. T: the cache's storage type (bf16_storage, f16_storage; float is refused).
template <class T>
struct PrefillAttentionParams {
  float* out;                         ///< [rows, hq, d]
  const float* q;                     ///< [rows, hq, d]
  triattn::KvCacheView<T, std::int32_t> view;
  const std::int32_t* row_slot;       ///< [rows] last slot each row attends to
  const PrefillTile* tiles;           ///< [gridDim.y], from build_prefill_tiles(..., group)
  int layer;
  int hq;
  int group;                          ///< query heads per KV head
  float scale_log2;                   ///< log2(e) / sqrt(d)
};

/// Dynamic shared memory of the kernel for head_dim d: kPrefillStages blocks of K and V.
constexpr std::size_t prefill_smem_bytes(int d) {
  return static_cast<std::size_t>(kPrefillStages) * 2 * kPrefillKvBlock * d * 2;
}

namespace detail {

/// ldmatrix.x4.trans: as ldmatrix_x4, each 8x8 matrix transposed (word i = matrix i's column
/// lane/4, rows 2·(lane%4), +1): the B fragment of P·V from row-major V.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// Byte offset of 16-byte chunk c of row r in a [kPrefillKvBlock x D] tile (prefill_smem_chunk).
template <int D>
__device__ __forceinline__ std::uint32_t tile_off(int r, int c) {
  return static_cast<std::uint32_t>(prefill_smem_chunk(r, c, D) * 16);
}

template <class DT>
__device__ __forceinline__ std::uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<DT, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

}  // namespace detail

/// Grid: [num_kv_heads, tiles], kPrefillWarps * 32 threads, prefill_smem_bytes(D) bytes of
/// dynamic shared memory. Tiles must hold at most prefill_tile_rows(group) rows (build_prefill_tiles).
template <int D, class T>
__global__ void __launch_bounds__(kPrefillWarps * 32, D == 64 ? 2 : 1) prefill_attention_kernel(PrefillAttentionParams<T> p) {
  using DT = triattn::cuda::device_type_t<T>;
  static_assert(D == 64 || D == 128, "head_dim 64 and 128");
  static_assert(sizeof(DT) == 2, "16-bit caches");
  constexpr int kN = kPrefillKvBlock;
  constexpr int kKSteps = D / 16;
  constexpr int kDTiles = D / 8;
  constexpr int kNTiles = kN / 8;
  constexpr int kThreads = kPrefillWarps * 32;
  constexpr int kStageBytes = 2 * kN * D * 2;  // K then V of one block
  static_assert(kThreads % (D / 8) == 0 && kN % (kThreads / (D / 8)) == 0, "copy rows divide the block");
  extern __shared__ __align__(128) unsigned char prefill_smem[];

  triattn::cuda::detail::griddep_launch_dependents();
  triattn::cuda::detail::griddep_wait();  // q and the cache are written by the kernels before

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const int kvh = static_cast<int>(blockIdx.x);
  const PrefillTile tile = p.tiles[blockIdx.y];
  const int group = p.group;
  const int m_valid = tile.rows * group;  // MMA rows holding a (row, head) pair

  // This lane's two MMA rows (g, g + 8 of the warp's 16). Rows past m_valid repeat the last
  // valid one (finite work, never stored); a warp with no valid row skips every block.
  const int ma = warp * 16 + g, mb = ma + 8;
  const PrefillMmaRow pa = prefill_mma_row(min(ma, m_valid - 1), group, kvh);
  const PrefillMmaRow pb = prefill_mma_row(min(mb, m_valid - 1), group, kvh);
  const int lim_a = p.row_slot[tile.row0 + pa.row];
  const int lim_b = p.row_slot[tile.row0 + pb.row];
  int warp_max = max(lim_a, lim_b), warp_min = min(lim_a, lim_b);
#pragma unroll
  for (int x = 1; x < 32; x <<= 1) {
    warp_max = max(warp_max, __shfl_xor_sync(0xffffffffu, warp_max, x));
    warp_min = min(warp_min, __shfl_xor_sync(0xffffffffu, warp_min, x));
  }
  if (warp * 16 >= m_valid) warp_max = -1;

  // Q A fragments: a0 (row g, dims 2q4..), a1 (row g+8), a2 (row g, dims 8+2q4..), a3 (row g+8).
  std::uint32_t qf[kKSteps][4];
  {
    const float* qa = p.q + (static_cast<std::int64_t>(tile.row0 + pa.row) * p.hq + pa.head) * D;
    const float* qb = p.q + (static_cast<std::int64_t>(tile.row0 + pb.row) * p.hq + pb.head) * D;
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      const int c = 16 * s + 2 * q4;
      const float2 x0 = *reinterpret_cast<const float2*>(qa + c), x1 = *reinterpret_cast<const float2*>(qb + c);
      const float2 x2 = *reinterpret_cast<const float2*>(qa + c + 8), x3 = *reinterpret_cast<const float2*>(qb + c + 8);
      qf[s][0] = detail::pack2<DT>(x0.x, x0.y);
      qf[s][1] = detail::pack2<DT>(x1.x, x1.y);
      qf[s][2] = detail::pack2<DT>(x2.x, x2.y);
      qf[s][3] = detail::pack2<DT>(x3.x, x3.y);
    }
  }

  float o[kDTiles][4];
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;  // l: this lane's partial sums

  const auto& view = p.view;
  const std::int32_t* table = view.table_row(tile.seq);
  const int bs = view.block.block_size;
  const DT* kbase = reinterpret_cast<const DT*>(view.range(p.layer, triattn::KvKind::kKey));
  const DT* vbase = reinterpret_cast<const DT*>(view.range(p.layer, triattn::KvKind::kValue));
  const std::uint32_t smem0 = triattn::cuda::detail::smem_addr(prefill_smem);
  const int kv_len = tile.kv_len;
  const int nblocks = prefill_kv_blocks(kv_len);

  // Stages block blk (slots blk * kN ..) into ring buffer blk % kStages and commits one cp.async
  // group (empty past the last block, so the group count per iteration stays uniform). This
  // thread copies one chunk of kRowIters rows (prefill_copy_row), of K and of V; pages[i] holds
  // those rows' page ids, read one iteration ahead (load_pages) so the table lookup's latency
  // hides behind a block's math.
  constexpr int kRowIters = prefill_copy_iters(D);
  const int c = prefill_copy_chunk(tid, D);
  int pages[kRowIters];
  auto load_pages = [&](int blk) {
#pragma unroll
    for (int i = 0; i < kRowIters; ++i)
      pages[i] = blk < nblocks ? table[prefill_stage_slot(blk * kN, prefill_copy_row(tid, i, D), kv_len) / bs] : 0;
  };
  auto stage = [&](int blk) {
    if (blk < nblocks) {
      const std::uint32_t dk = smem0 + static_cast<std::uint32_t>((blk % kPrefillStages) * kStageBytes);
      const std::uint32_t dv = dk + kN * D * 2;
#pragma unroll
      for (int i = 0; i < kRowIters; ++i) {
        const int r = prefill_copy_row(tid, i, D);
        const std::int64_t off = prefill_chunk_offset(view.block, pages[i], prefill_stage_slot(blk * kN, r, kv_len), kvh, c);
        triattn::cuda::detail::cp_async_16(dk + detail::tile_off<D>(r, c), kbase + off);
        triattn::cuda::detail::cp_async_16(dv + detail::tile_off<D>(r, c), vbase + off);
      }
    }
    triattn::cuda::detail::cp_async_commit();
  };

#pragma unroll
  for (int b = 0; b < kPrefillStages - 1; ++b) {
    load_pages(b);
    stage(b);
  }
  load_pages(kPrefillStages - 1);
  for (int blk = 0; blk < nblocks; ++blk) {
    // Groups committed so far: kStages - 1 + blk; at most kStages - 2 pending means block blk
    // (group blk) has landed. The barrier publishes it and ends every warp's use of block
    // blk - 1, whose buffer the next stage call refills.
    triattn::cuda::detail::cp_async_wait<kPrefillStages - 2>();
    __syncthreads();
    stage(blk + kPrefillStages - 1);
    load_pages(blk + kPrefillStages);

    const int n0 = blk * kN;
    if (!prefill_block_active(n0, warp_max)) continue;  // no row of this warp sees this block
    const std::uint32_t sk = smem0 + static_cast<std::uint32_t>((blk % kPrefillStages) * kStageBytes);
    const std::uint32_t sv = sk + kN * D * 2;

    float s[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int s2 = 0; s2 < kKSteps / 2; ++s2) {
        // matrices: slots 8j..8j+7 x chunks 4 s2 + 0..3 -> (b0, b1) of k-steps 2 s2 and 2 s2 + 1
        std::uint32_t b[4];
        triattn::cuda::detail::ldmatrix_x4(b, sk + detail::tile_off<D>(8 * j + (lane & 7), 4 * s2 + (lane >> 3)));
        triattn::cuda::detail::mma_16816<DT>(s[j], qf[2 * s2][0], qf[2 * s2][1], qf[2 * s2][2], qf[2 * s2][3], b[0],
                                             b[1]);
        triattn::cuda::detail::mma_16816<DT>(s[j], qf[2 * s2 + 1][0], qf[2 * s2 + 1][1], qf[2 * s2 + 1][2],
                                             qf[2 * s2 + 1][3], b[2], b[3]);
      }
    }

    // Scale, and the causal mask where the block crosses a row's limit; s[j]: (row g, slots
    // n0+8j+2q4, +1), (row g+8, same slots).
    float mx_a = -INFINITY, mx_b = -INFINITY;
    if (prefill_block_masked(n0, warp_min)) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const int t = n0 + 8 * j + 2 * q4;
        s[j][0] = t <= lim_a ? s[j][0] * p.scale_log2 : -INFINITY;
        s[j][1] = t + 1 <= lim_a ? s[j][1] * p.scale_log2 : -INFINITY;
        s[j][2] = t <= lim_b ? s[j][2] * p.scale_log2 : -INFINITY;
        s[j][3] = t + 1 <= lim_b ? s[j][3] * p.scale_log2 : -INFINITY;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
    }
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
    }
    const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
    // A row with no visible slot yet keeps m = -inf: use 0 as its reference (all p are 0).
    const float ref_a = mn_a == -INFINITY ? 0.f : mn_a, ref_b = mn_b == -INFINITY ? 0.f : mn_b;
    const float al_a = exp2f(m_a - ref_a), al_b = exp2f(m_b - ref_b);
    m_a = mn_a;
    m_b = mn_b;
    float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      s[j][0] = exp2f(s[j][0] - ref_a);
      s[j][1] = exp2f(s[j][1] - ref_a);
      s[j][2] = exp2f(s[j][2] - ref_b);
      s[j][3] = exp2f(s[j][3] - ref_b);
      sum_a += s[j][0] + s[j][1];
      sum_b += s[j][2] + s[j][3];
    }
    l_a = l_a * al_a + sum_a;
    l_b = l_b * al_b + sum_b;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      o[j][0] *= al_a;
      o[j][1] *= al_a;
      o[j][2] *= al_b;
      o[j][3] *= al_b;
    }

#pragma unroll
    for (int ks = 0; ks < kN / 16; ++ks) {
      // A fragment of k-step ks (slots 16ks..): a0 = S tile 2ks rows g, a1 = rows g+8, a2/a3 tile 2ks+1.
      const std::uint32_t a0 = detail::pack2<DT>(s[2 * ks][0], s[2 * ks][1]);
      const std::uint32_t a1 = detail::pack2<DT>(s[2 * ks][2], s[2 * ks][3]);
      const std::uint32_t a2 = detail::pack2<DT>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      const std::uint32_t a3 = detail::pack2<DT>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
      for (int dt = 0; dt < kDTiles; dt += 2) {
        // matrices: slots 16ks + 0..7 / 8..15 x chunks dt, dt + 1 -> (b0, b1) of d-tiles dt and dt + 1
        std::uint32_t b[4];
        const int mi = lane >> 3;
        detail::ldmatrix_x4_trans(b, sv + detail::tile_off<D>(16 * ks + 8 * (mi & 1) + (lane & 7), dt + (mi >> 1)));
        triattn::cuda::detail::mma_16816<DT>(o[dt], a0, a1, a2, a3, b[0], b[1]);
        triattn::cuda::detail::mma_16816<DT>(o[dt + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
  }
  // o[j]: (row g, dims 8j + 2q4, +1), (row g+8, same dims).
  if (ma < m_valid) {
    float* oa = p.out + (static_cast<std::int64_t>(tile.row0 + pa.row) * p.hq + pa.head) * D + 2 * q4;
    const float inv = 1.0f / l_a;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) *reinterpret_cast<float2*>(oa + 8 * j) = make_float2(o[j][0] * inv, o[j][1] * inv);
  }
  if (mb < m_valid) {
    float* ob = p.out + (static_cast<std::int64_t>(tile.row0 + pb.row) * p.hq + pb.head) * D + 2 * q4;
    const float inv = 1.0f / l_b;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) *reinterpret_cast<float2*>(ob + 8 * j) = make_float2(o[j][2] * inv, o[j][3] * inv);
  }
}

namespace detail {
/// Opts prefill_attention_kernel<D, T> into its dynamic shared memory (once per device) and launches it.
template <int D, class T, class Launch>
void launch_prefill(const PrefillAttentionParams<T>& p, dim3 grid, dim3 block, Launch& launch) {
  static triattn::cuda::DynamicSmemGrant grant;
  TRIATTN_CUDA_TRY(grant.ensure(prefill_attention_kernel<D, T>, prefill_smem_bytes(D)));
  launch(prefill_attention_kernel<D, T>, grid, block, prefill_smem_bytes(D), p);
}
}  // namespace detail

/// Launches the kernel for p over n_tiles tiles (build_prefill_tiles with p.group) through
/// launch(kernel, grid, block, smem, p) (the backend's PDL launch, or a plain <<<>>> in tests).
/// Throws triattn::unsupported naming the dtype / head_dim / group / layout the kernel does not
/// take; q and out must be 8-byte aligned.
template <class T, class Launch>
void run_prefill_attention(const PrefillAttentionParams<T>& p, int head_dim, int n_tiles, Launch&& launch) {
  const std::string why = prefill_attention_refusal(p.view, head_dim, p.group);
  if (!why.empty()) throw triattn::unsupported(why);
  TRIATTN_EXPECTS(p.hq > 0 && p.hq % p.group == 0 && p.hq / p.group == p.view.block.num_kv_heads,
                  "prefill attention: hq " + std::to_string(p.hq) + " / group " + std::to_string(p.group) +
                      " does not match the cache's " + std::to_string(p.view.block.num_kv_heads) + " KV heads");
  TRIATTN_EXPECTS(n_tiles >= 0 && n_tiles <= 65535, "prefill attention: bad grid (tiles " + std::to_string(n_tiles) + ")");
  TRIATTN_EXPECTS(reinterpret_cast<std::uintptr_t>(p.q) % 8 == 0 && reinterpret_cast<std::uintptr_t>(p.out) % 8 == 0,
                  "prefill attention: q and out must be 8-byte aligned");
  if constexpr (sizeof(T) == 2) {
    if (n_tiles == 0) return;
    const dim3 grid(static_cast<unsigned>(p.view.block.num_kv_heads), static_cast<unsigned>(n_tiles));
    const dim3 block(kPrefillWarps * 32);
    if (head_dim == 64) detail::launch_prefill<64>(p, grid, block, launch);
    else detail::launch_prefill<128>(p, grid, block, launch);
  }
}

}  // namespace triattn_example::gpu

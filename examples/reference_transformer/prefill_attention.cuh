// SPDX-License-Identifier: Apache-2.0
// Causal prefill attention over the paged KV cache on tensor cores (FlashAttention-2 style),
// for 16-bit caches (bf16, f16) and head_dim 64 / 128; the CUDA backend runs it for every
// attention step that is not a decode step (cuda_backend.cuh), fp32 caches and other head dims
// keep attention_rows_kernel (cuda_kernels.cuh).
//
// Semantics are attention_rows_kernel's: row r of sequence seq attends, with query head h, to
// the physical slots [0, row_slot[r]] of seq through its block table (KV head h / group). Slots
// are physical, not positions: after compression rounds a chunk starting at physical length
// len_before has row_slot = len_before + i, and the chunk's own K/V are in the cache already.
//
// Work split: the host groups the rows into tiles of at most kPrefillTileRows rows of one
// sequence (build_prefill_tiles); CTA (tile, query head) runs 4 warps of 16 rows each. The KV
// slots [0, tile.kv_len) stream through shared memory in blocks of kPrefillKvBlock slots
// (cp.async, 16-byte chunks XOR-swizzled per row so ldmatrix is free of bank conflicts; K of
// the next block loads while P·V of this one runs). Per block and warp:
//   S[16 x 64]  = Q[16 x d] · K^T       mma.sync m16n8k16, Q fragments in registers (bf16),
//                                       K^T fragments by ldmatrix from K rows
//   online softmax in fp32 (log2 units), per-row causal mask slot <= row_slot
//   O[16 x d]  += P[16 x 64] · V        P from the S accumulators (hi + lo 16-bit parts, as the
//                                       decode kernel does: ~16 bits of P), V by ldmatrix.trans
// q and out are the backend's fp32 activations [rows, hq, d]; q is rounded to the cache type
// once (as the decode path does), the logits are scaled in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/device/async_copy.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/kernels/decode_attention_kernel.cuh>  // mma_16816, split_pack
#include <triattn/cuda/kernels/score_kernel.cuh>             // ldmatrix_x4
#include <triattn/cuda/types.cuh>

namespace triattn_example::gpu {

inline constexpr int kPrefillWarps = 4;
inline constexpr int kPrefillTileRows = 16 * kPrefillWarps;  // query rows of one CTA
inline constexpr int kPrefillKvBlock = 64;                   // KV slots per shared-memory block

/// Rows [row0, row0 + rows) of the step, all of sequence seq; kv_len = max row_slot + 1.
struct PrefillTile {
  int row0, rows, seq, kv_len;
};

/// Tiles of the step's rows (row_seq / row_slot per row): runs of consecutive rows of one
/// sequence, cut every kPrefillTileRows rows.
inline std::vector<PrefillTile> build_prefill_tiles(const std::int32_t* row_seq, const std::int32_t* row_slot, int n) {
  std::vector<PrefillTile> tiles;
  for (int r = 0; r < n; ++r) {
    PrefillTile* t = tiles.empty() ? nullptr : &tiles.back();
    if (t == nullptr || t->seq != row_seq[r] || t->rows == kPrefillTileRows) {
      tiles.push_back(PrefillTile{r, 0, row_seq[r], 0});
      t = &tiles.back();
    }
    ++t->rows;
    t->kv_len = std::max(t->kv_len, row_slot[r] + 1);
  }
  return tiles;
}

/// Why the tensor-core prefill kernel cannot take this cache and head_dim, or "" if it can:
/// a 16-bit cache, head_dim 64 or 128, head vectors 16-byte aligned (any NHD / HND / strided
/// layout whose strides and base keep them so).
template <class T>
std::string prefill_attention_refusal(const triattn::KvCacheView<T, std::int32_t>& view, int head_dim) {
  const triattn::DType dt = triattn::dtype_of<T>;
  if (dt != triattn::DType::kBF16 && dt != triattn::DType::kF16)
    return std::string("prefill attention: cache dtype ") + triattn::dtype_name(dt) +
           " has no tensor-core path (bf16 and f16 only)";
  if (head_dim != 64 && head_dim != 128)
    return "prefill attention: head_dim " + std::to_string(head_dim) + " is not compiled (64 and 128 only)";
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
  const PrefillTile* tiles;           ///< [gridDim.x]
  int layer;
  int hq;
  int group;                          ///< query heads per KV head
  float scale_log2;                   ///< log2(e) / sqrt(d)
};

namespace detail {

/// ldmatrix.x4.trans: as ldmatrix_x4, each 8x8 matrix transposed (word i = matrix i's column
/// lane/4, rows 2·(lane%4), +1): the B fragment of P·V from row-major V.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// Byte offset of 16-byte chunk c of row r in a [kPrefillKvBlock x D] tile: chunks XOR (r % 8),
/// so the 8 rows an ldmatrix reads land in 8 distinct bank groups.
template <int D>
__device__ __forceinline__ std::uint32_t tile_off(int r, int c) {
  return static_cast<std::uint32_t>((r * (D / 8) + (c ^ (r & 7))) * 16);
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

/// Grid: [tiles, hq], kPrefillWarps * 32 threads, static shared memory 2 * kPrefillKvBlock * D * 2 bytes.
template <int D, class T>
__global__ void __launch_bounds__(kPrefillWarps * 32) prefill_attention_kernel(PrefillAttentionParams<T> p) {
  using DT = triattn::cuda::device_type_t<T>;
  static_assert(D == 64 || D == 128, "head_dim 64 and 128");
  static_assert(sizeof(DT) == 2, "16-bit caches");
  constexpr int kN = kPrefillKvBlock;
  constexpr int kCPR = D / 8;    // 16-byte chunks per head vector
  constexpr int kKSteps = D / 16;
  constexpr int kDTiles = D / 8;
  constexpr int kNTiles = kN / 8;
  constexpr int kThreads = kPrefillWarps * 32;
  __shared__ __align__(128) unsigned char smem_k[kN * D * 2];
  __shared__ __align__(128) unsigned char smem_v[kN * D * 2];

  triattn::cuda::detail::griddep_launch_dependents();
  triattn::cuda::detail::griddep_wait();  // q and the cache are written by the kernels before

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const PrefillTile tile = p.tiles[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y);
  const int kvh = h / p.group;

  // This lane's two rows (g, g + 8 of the warp's 16); rows past the tile attend to nothing.
  const int ra = warp * 16 + g, rb = ra + 8;
  const int lim_a = ra < tile.rows ? p.row_slot[tile.row0 + ra] : -1;
  const int lim_b = rb < tile.rows ? p.row_slot[tile.row0 + rb] : -1;
  int warp_lim = max(lim_a, lim_b);
#pragma unroll
  for (int x = 1; x < 32; x <<= 1) warp_lim = max(warp_lim, __shfl_xor_sync(0xffffffffu, warp_lim, x));

  // Q A fragments: a0 (row g, dims 2q4..), a1 (row g+8), a2 (row g, dims 8+2q4..), a3 (row g+8).
  std::uint32_t qf[kKSteps][4];
  {
    const float* qa = p.q + (static_cast<std::int64_t>(tile.row0 + min(ra, tile.rows - 1)) * p.hq + h) * D;
    const float* qb = p.q + (static_cast<std::int64_t>(tile.row0 + min(rb, tile.rows - 1)) * p.hq + h) * D;
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
  const std::uint32_t sk = triattn::cuda::detail::smem_addr(smem_k);
  const std::uint32_t sv = triattn::cuda::detail::smem_addr(smem_v);
  const int kv_len = tile.kv_len;
  const int nblocks = (kv_len + kN - 1) / kN;

  // Copies slots [n0, n0 + kN) of K or V into shared memory; slots past kv_len repeat the last
  // one (finite, masked out), so nothing past the tile's slots (or its block table) is read.
  auto issue = [&](const DT* base, std::uint32_t dst, int n0) {
#pragma unroll
    for (int i = tid; i < kN * kCPR; i += kThreads) {
      const int r = i / kCPR, c = i % kCPR;
      const int slot = min(n0 + r, kv_len - 1);
      const std::int64_t off = view.block.offset(table[slot / bs], slot % bs, kvh);
      triattn::cuda::detail::cp_async_16(dst + detail::tile_off<D>(r, c), base + off + c * 8);
    }
    triattn::cuda::detail::cp_async_commit();
  };

  issue(kbase, sk, 0);
  issue(vbase, sv, 0);
  for (int blk = 0; blk < nblocks; ++blk) {
    const int n0 = blk * kN;
    const bool more = blk + 1 < nblocks;
    const bool active = n0 <= warp_lim;  // some row of this warp sees a slot of this block
    triattn::cuda::detail::cp_async_wait<1>();  // K of this block landed (V may be in flight)
    __syncthreads();

    float s[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    if (active) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int s2 = 0; s2 < kKSteps / 2; ++s2) {
          // matrices: slots 8j..8j+7 x chunks 4 s2 + 0..3 -> (b0, b1) of k-steps 2 s2 and 2 s2 + 1
          std::uint32_t b[4];
          triattn::cuda::detail::ldmatrix_x4(b, sk + detail::tile_off<D>(8 * j + (lane & 7), 4 * s2 + (lane >> 3)));
          triattn::cuda::detail::mma_16816<DT>(s[j], qf[2 * s2][0], qf[2 * s2][1], qf[2 * s2][2], qf[2 * s2][3],
                                               b[0], b[1]);
          triattn::cuda::detail::mma_16816<DT>(s[j], qf[2 * s2 + 1][0], qf[2 * s2 + 1][1], qf[2 * s2 + 1][2],
                                               qf[2 * s2 + 1][3], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with K
    if (more) issue(kbase, sk, n0 + kN);

    std::uint32_t ph[kN / 16][4], pl[kN / 16][4];  // P A fragments, hi and lo parts
    if (active) {
      // Causal mask and scale; s[j]: (row g, slots n0+8j+2q4, +1), (row g+8, same slots).
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const int t = n0 + 8 * j + 2 * q4;
        s[j][0] = t <= lim_a ? s[j][0] * p.scale_log2 : -INFINITY;
        s[j][1] = t + 1 <= lim_a ? s[j][1] * p.scale_log2 : -INFINITY;
        s[j][2] = t <= lim_b ? s[j][2] * p.scale_log2 : -INFINITY;
        s[j][3] = t + 1 <= lim_b ? s[j][3] * p.scale_log2 : -INFINITY;
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
      // A fragment of k-step ks (slots 16ks..): a0 = S tile 2ks rows g, a1 = rows g+8, a2/a3 tile 2ks+1.
#pragma unroll
      for (int ks = 0; ks < kN / 16; ++ks) {
        triattn::cuda::detail::split_pack<DT>(s[2 * ks][0], s[2 * ks][1], ph[ks][0], pl[ks][0]);
        triattn::cuda::detail::split_pack<DT>(s[2 * ks][2], s[2 * ks][3], ph[ks][1], pl[ks][1]);
        triattn::cuda::detail::split_pack<DT>(s[2 * ks + 1][0], s[2 * ks + 1][1], ph[ks][2], pl[ks][2]);
        triattn::cuda::detail::split_pack<DT>(s[2 * ks + 1][2], s[2 * ks + 1][3], ph[ks][3], pl[ks][3]);
      }
    }

    if (more) triattn::cuda::detail::cp_async_wait<1>();  // V of this block landed, next K may fly
    else triattn::cuda::detail::cp_async_wait<0>();
    __syncthreads();
    if (active) {
#pragma unroll
      for (int ks = 0; ks < kN / 16; ++ks) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; dt += 2) {
          // matrices: slots 16ks + 0..7 / 8..15 x chunks dt, dt + 1 -> (b0, b1) of d-tiles dt and dt + 1
          std::uint32_t b[4];
          const int mi = lane >> 3;
          detail::ldmatrix_x4_trans(b, sv + detail::tile_off<D>(16 * ks + 8 * (mi & 1) + (lane & 7), dt + (mi >> 1)));
          triattn::cuda::detail::mma_16816<DT>(o[dt], ph[ks][0], ph[ks][1], ph[ks][2], ph[ks][3], b[0], b[1]);
          triattn::cuda::detail::mma_16816<DT>(o[dt], pl[ks][0], pl[ks][1], pl[ks][2], pl[ks][3], b[0], b[1]);
          triattn::cuda::detail::mma_16816<DT>(o[dt + 1], ph[ks][0], ph[ks][1], ph[ks][2], ph[ks][3], b[2], b[3]);
          triattn::cuda::detail::mma_16816<DT>(o[dt + 1], pl[ks][0], pl[ks][1], pl[ks][2], pl[ks][3], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with V
    if (more) issue(vbase, sv, n0 + kN);
  }

#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
  }
  // o[j]: (row g, dims 8j + 2q4, +1), (row g+8, same dims).
  if (ra < tile.rows) {
    float* oa = p.out + (static_cast<std::int64_t>(tile.row0 + ra) * p.hq + h) * D + 2 * q4;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) *reinterpret_cast<float2*>(oa + 8 * j) = make_float2(o[j][0] / l_a, o[j][1] / l_a);
  }
  if (rb < tile.rows) {
    float* ob = p.out + (static_cast<std::int64_t>(tile.row0 + rb) * p.hq + h) * D + 2 * q4;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) *reinterpret_cast<float2*>(ob + 8 * j) = make_float2(o[j][2] / l_b, o[j][3] / l_b);
  }
}

/// Launches the kernel for p over n_tiles tiles through launch(kernel, grid, block, smem, p)
/// (the backend's PDL launch, or a plain <<<>>> in tests). Throws triattn::unsupported naming
/// the dtype / head_dim / layout the kernel does not take; q and out must be 8-byte aligned.
template <class T, class Launch>
void run_prefill_attention(const PrefillAttentionParams<T>& p, int head_dim, int n_tiles, Launch&& launch) {
  const std::string why = prefill_attention_refusal(p.view, head_dim);
  if (!why.empty()) throw triattn::unsupported(why);
  TRIATTN_EXPECTS(p.hq > 0 && p.group > 0 && p.hq % p.group == 0 && p.hq / p.group == p.view.block.num_kv_heads,
                  "prefill attention: hq " + std::to_string(p.hq) + " / group " + std::to_string(p.group) +
                      " does not match the cache's " + std::to_string(p.view.block.num_kv_heads) + " KV heads");
  TRIATTN_EXPECTS(n_tiles >= 0 && p.hq <= 65535, "prefill attention: bad grid (tiles " + std::to_string(n_tiles) +
                                                     ", hq " + std::to_string(p.hq) + ")");
  TRIATTN_EXPECTS(reinterpret_cast<std::uintptr_t>(p.q) % 8 == 0 && reinterpret_cast<std::uintptr_t>(p.out) % 8 == 0,
                  "prefill attention: q and out must be 8-byte aligned");
  if constexpr (sizeof(T) == 2) {
    if (n_tiles == 0) return;
    const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(p.hq));
    const dim3 block(kPrefillWarps * 32);
    if (head_dim == 64) launch(prefill_attention_kernel<64, T>, grid, block, 0, p);
    else launch(prefill_attention_kernel<128, T>, grid, block, 0, p);
  }
}

}  // namespace triattn_example::gpu

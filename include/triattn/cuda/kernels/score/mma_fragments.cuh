// SPDX-License-Identifier: Apache-2.0
// Tensor-core fragment helpers of the 16-bit scoring kernels: the 16-bit weight splits and mma.sync
// of each cache type (MmaMaxTraits), ldmatrix A fragments, B-fragment slots and the norm term as
// TF32 MMAs or fp32 FMAs.
#pragma once

#include <triattn/cuda/kernels/score/common.cuh>

namespace triattn::cuda {

namespace detail {

template <class T>
struct MmaMaxTraits;
template <>
struct MmaMaxTraits<bf16_storage> {
  static constexpr int kSplits = 3;
  /// w as kParts bf16 terms (hi, mid, lo): residual <= 2^-9, 2^-17, 2^-25 of |w| for 1, 2, 3.
  template <int kParts = kSplits>
  __device__ static void split(float w, std::uint16_t* out) {
    static_assert(kParts >= 1 && kParts <= 3);
    float r = w;
#pragma unroll
    for (int i = 0; i < kParts; ++i) {
      const __nv_bfloat16 p = __float2bfloat16_rn(r);
      out[i] = __bfloat16_as_ushort(p);
      r -= __bfloat162float(p);
    }
  }
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct MmaMaxTraits<f16_storage> {
  static constexpr int kSplits = 2;
  template <int kParts = kSplits>
  __device__ static void split(float w, std::uint16_t* out) {
    static_assert(kParts == 2, "fp16 weights: hi + lo");
    const __half h = __float2half_rn(w);
    const __half l = __float2half_rn(w - __half2float(h));
    out[0] = __half_as_ushort(h);
    out[1] = __half_as_ushort(l);
  }
  __device__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

/// score_mean_mma_kernel reads each m16 tile of keys with ldmatrix.x4, one per k-step s of 16
/// elements, so the lane (g = lane/4, c = lane%4) holds the MMA A fragment in natural element
/// order: fr[s] = {row g, row g+8} x elements {16s + 2c, +1} (words 0, 1) and {16s + 8 + 2c, +1}
/// (words 2, 3). The B fragments of the trig weights follow the same order.
/// Its norm term Σ_f c_f·|K_f| is a [16 keys x F] by [F x 8] product per tile, run as m16n8k8
/// TF32 MMAs into the same accumulators. The lane holds F/4 whole pairs of each of its two rows
/// (both halves of a pair sit in the same lane); lane-local pair p feeds k8-step p/2 at k = c
/// (p even) or c + 4 (p odd), and the norm B fragments list c_f in that order. Column 2h of B
/// holds the TF32 head of c for head h, column 2h + 1 the rest (c - head), so acc[0] + acc[1]
/// sums both (as the trig MMA's weight splits); A is |K_f| split the same way into two MMAs. The
/// tensor cores read the top 19 bits of a TF32 operand, so each product keeps ~21 bits (the
/// dropped rest·rest part is ~2^-21 relative).
/// Global pair index of lane-local pair p for quad index c.
template <RopeStyle S>
__device__ __forceinline__ int mma_lane_pair(int c, int p) {
  if constexpr (S == RopeStyle::kHalf)  // real part at element f < F: k-step p/4, word 2·(p%4/2), half p%2
    return 16 * (p / 4) + 8 * ((p % 4) / 2) + 2 * c + p % 2;
  else  // elements 2f, 2f + 1 = one word: k-step p/2, word 2·(p%2)
    return 8 * (p / 2) + 4 * (p % 2) + c;
}
/// |K_f| of lane-local pair p of row g + 8q; fr: the tile's A fragments [k-step][word].
template <class T, RopeStyle S, int KS>
__device__ __forceinline__ float mma_lane_pair_norm(const std::uint32_t (&fr)[KS][4], int q, int p) {
  float re, im;
  if constexpr (S == RopeStyle::kHalf) {  // imaginary part F = 8·KS elements later: k-step + KS/2
    const int s = p / 4, w = q + 2 * ((p % 4) / 2);
    re = element<T>(&fr[s][w], p % 2);
    im = element<T>(&fr[s + KS / 2][w], p % 2);
  } else {
    const std::uint32_t* w = &fr[p / 2][q + 2 * (p % 2)];
    re = element<T>(w, 0);
    im = element<T>(w, 1);
  }
  return pair_norm(fmaf(re, re, fmaf(im, im, 1e-8f)));
}
/// Where element e of a B column lives in the MMA fragments that pair with the A fragments of
/// load_tile_fragments (natural element order): k-step e/16, quad lane (e%8)/2 (the lane is
/// 4·column + that), word (e%16)/8 of the lane's uint2, half e%2 of the word. Shared by the
/// mean and max ring scorers' weight fills.
struct BFragmentSlot {
  int step, quad_lane, word, half;
};
__device__ __forceinline__ BFragmentSlot b_fragment_slot(int e) { return {e >> 4, (e & 7) >> 1, (e & 15) >> 3, e & 1}; }
/// ldmatrix.x4: lane l gives the shared address of row l%8 of matrix l/8; word i of the result is
/// matrix i's row lane/4, elements 2·(lane%4), +1.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
/// ldmatrix.x2: lanes 0-15 give the row addresses of two 8x8 matrices; word i = matrix i's row
/// lane/4, elements 2·(lane%4), +1 (the B fragment of mma.m16n8k16 from two K-major core matrices).
__device__ __forceinline__ void ldmatrix_x2(std::uint32_t (&r)[2], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
/// The TF32 head of x (low 13 mantissa bits cleared); x - head is exact in fp32.
__device__ __forceinline__ std::uint32_t tf32_head(float x) { return __float_as_uint(x) & 0xffffe000u; }
/// x - tf32_head(x), as the bits of a TF32 operand.
__device__ __forceinline__ std::uint32_t tf32_rest(float x, std::uint32_t head) {
  return __float_as_uint(x - __uint_as_float(head));
}
/// d += A·B, m16n8k8 TF32 with fp32 accumulation; a: (row g, k c), (g+8, c), (g, c+4), (g+8, c+4).
__device__ __forceinline__ void mma_tf32(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                         std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
/// The A fragments of one m16 tile of a ring stage whose rows hold chunk c at c ^ (row & 7)
/// (KeySliceFeed): fr[s] for every k-step s. tile_addr: shared address of the
/// tile's first row; CPR: 16-byte chunks per row.
template <int KS, int CPR>
__device__ __forceinline__ void load_tile_fragments(std::uint32_t (&fr)[KS][4], std::uint32_t tile_addr, int lane) {
  // lane l gives row (l & 7) + 8·((l >> 3) & 1) (so row & 7 = l & 7) at chunk 2s + l/16
  const std::uint32_t row_addr = tile_addr + static_cast<std::uint32_t>(((lane & 7) + 8 * ((lane >> 3) & 1)) * CPR * 16);
  const int half = lane >> 4, swz = lane & 7;
#pragma unroll
  for (int s = 0; s < KS; ++s) ldmatrix_x4(fr[s], row_addr + static_cast<std::uint32_t>(((2 * s + half) ^ swz) * 16));
}
/// Word i of this lane's norm B fragment for k8-step s: c of lane-local pair 2s + i for head h, as
/// its TF32 head or (rest) c - head. cf: c as [slot f + f/8][4 heads] floats.
template <RopeStyle S>
__device__ __forceinline__ std::uint32_t norm_b_word(const float* cf, int c4, int s, int i, int h, bool rest) {
  const int f = mma_lane_pair<S>(c4, 2 * s + i);
  const float c = cf[(f + f / 8) * 4 + h];
  const std::uint32_t head = tf32_head(c);
  return rest ? tf32_rest(c, head) : head;
}
/// The norm term of one m16 tile: acc_head += |K|_head·B and acc_rest += |K|_rest·B over the F/8
/// TF32 k8-steps (|K_f| split into TF32 head and rest; the two may be the same accumulators).
template <class T, RopeStyle S, int KS, int KN>
__device__ __forceinline__ void norm_tile_mma(float (&acc_head)[4], float (&acc_rest)[4],
                                              const std::uint32_t (&fr)[KS][4], const std::uint32_t (&bn)[KN][2]) {
#pragma unroll
  for (int s = 0; s < KN; ++s) {
    std::uint32_t hd[2][2], rs[2][2];  // [pair 2s + i][row g + 8q]
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float n = mma_lane_pair_norm<T, S, KS>(fr, q, 2 * s + i);
        hd[i][q] = tf32_head(n);
        rs[i][q] = tf32_rest(n, hd[i][q]);
      }
    mma_tf32(acc_head, hd[0][0], hd[0][1], hd[1][0], hd[1][1], bn[s][0], bn[s][1]);
    mma_tf32(acc_rest, rs[0][0], rs[0][1], rs[1][0], rs[1][1], bn[s][0], bn[s][1]);
  }
}

/// The norm term of one m16 tile on the CUDA cores: out[2q + i] = Σ_f c_f·|K_f| of row g + 8q for
/// head 2(c & 1) + i (the layout of the max scorer's running max). Each lane sums its F/4 pairs
/// for all 4 heads (c as [slot f + f/8] float4 in shared memory), then the quad reduce-scatters.
/// Why not TF32 MMAs (norm_tile_mma): next to warpgroup MMAs they queue on the same tensor pipe,
/// so one warpgroup's norm waits behind the other's MMAs.
template <class T, RopeStyle S, int KS>
__device__ __forceinline__ void norm_tile_ffma(float (&out)[4], const std::uint32_t (&fr)[KS][4], const float4* c_s,
                                               int c) {
  constexpr int kPairs = KS * 2;  // F/4 lane-local pairs per row
  float acc[2][4] = {};           // [row g + 8q][head]
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int f = mma_lane_pair<S>(c, p);
    const float4 cf = c_s[f + f / 8];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float n = mma_lane_pair_norm<T, S, KS>(fr, q, p);
      acc[q][0] = fmaf(cf.x, n, acc[q][0]);
      acc[q][1] = fmaf(cf.y, n, acc[q][1]);
      acc[q][2] = fmaf(cf.z, n, acc[q][2]);
      acc[q][3] = fmaf(cf.w, n, acc[q][3]);
    }
  }
  const bool odd = (c & 1) != 0;  // keeps heads 2, 3 (even lanes 0, 1) after the xor-1 exchange
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float keep = odd ? acc[q][2 + i] : acc[q][i];
      const float give = odd ? acc[q][i] : acc[q][2 + i];
      float v = keep + __shfl_xor_sync(0xffffffffu, give, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      out[2 * q + i] = v;
    }
}

}  // namespace detail

}  // namespace triattn::cuda

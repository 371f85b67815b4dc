// SPDX-License-Identifier: Apache-2.0
// Paged decode attention (one query per sequence, GQA), split-K over the sequence: CTA
// (split, KV head [, head pass], batch entry) reads its token range of one KV head once for all
// the query heads of that head's group, keeps an online softmax, and either writes the output
// (one split) or an unnormalised partial that decode_attention_combine_kernel merges.
//
// 16-bit caches (mma kernel): each warp takes 16-token tiles and uses mma.sync m16n8k16.
//   QK:  S^T[16 tokens x 8 heads] = K[16 x d] . Q^T[d x 8]      (d/16 MMAs)
//   PV:  O^T[d x 8 heads] += V^T[d x 16 tokens] . P^T[16 x 8]   (d/16 MMAs, twice: P = hi + lo)
// Operands come straight from 16-byte global loads: a dot product does not care in which order
// it visits d, so lane (g, q) loads chunks 4i+q of tokens g, g+8 and feeds them as its A
// fragment of K, with Q loaded in the same permuted order as B. V is loaded as chunks g (and
// g+8) of tokens 2q, 2q+1, 8+2q, 9+2q and paired across tokens with one PRMT per register.
// P leaves the QK accumulator as S^T and becomes P^T's B fragment through movmatrix.trans.
// P is split into hi + lo 16-bit parts, so PV keeps ~16 bits of P (a single bf16 P would give
// ~1e-3 relative error by itself).
// fp32 caches (f32 kernel): CUDA cores, a half-warp per token, 4 query heads per pass.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/tuning/sm90.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

/// POD parameters of the decode attention kernels. T: the cache's storage type; OutT: float or T.
template <class T, class OutT>
struct DecodeAttentionParams {
  const T* q;                   ///< [batch, num_q_heads, head_dim]
  OutT* out;                    ///< [batch, num_q_heads, head_dim]
  float* partial_o;             ///< [batch, num_q_heads, num_splits, head_dim] unnormalised (workspace)
  float2* partial_ml;           ///< [batch, num_q_heads, num_splits] (max in log2 units, sum of exp2)
  const std::int32_t* seq_ids;  ///< [batch] sequence slot of each entry, or nullptr (entry b = slot b)
  int num_q_heads;
  int group_size;               ///< num_q_heads / num_kv_heads
  int heads_per_pass;           ///< query heads one CTA handles (the kernel's fixed value)
  int layer;
  int num_splits;               ///< 1: write `out` directly; > 1: write partials
  int tokens_per_split;
  float scale_log2;             ///< sm_scale * log2(e)
};

namespace detail {

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <class T>
__device__ __forceinline__ void store_f32(T* p, float x) {
  using DT = device_type_t<T>;
  *reinterpret_cast<DT*>(p) = from_f32<DT>(x);
}

/// D = A . B + D, m16n8k16, 16-bit inputs (__half or __nv_bfloat16), fp32 accumulators.
template <class DT>
__device__ __forceinline__ void mma_16816(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                          std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<DT, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

/// Transposes an 8x8 matrix of 16-bit values held one register per lane (fragment layout).
__device__ __forceinline__ std::uint32_t movmatrix_trans(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

/// Packs (x, y) into 16-bit pairs hi + lo with x ~= hi.x + lo.x (about 16 significant bits).
template <class DT>
__device__ __forceinline__ void split_pack(float x, float y, std::uint32_t& hi, std::uint32_t& lo) {
  if constexpr (std::is_same_v<DT, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    const float2 hf = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
    hi = *reinterpret_cast<const std::uint32_t*>(&h);
    lo = *reinterpret_cast<const std::uint32_t*>(&l);
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 hf = __half22float2(h);
    const __half2 l = __floats2half2_rn(x - hf.x, y - hf.y);
    hi = *reinterpret_cast<const std::uint32_t*>(&h);
    lo = *reinterpret_cast<const std::uint32_t*>(&l);
  }
}

__device__ __forceinline__ std::uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/// Element offset (inside its range) of head vector (slot, head) of a sequence whose block-table
/// row is `table`.
template <class T, class Id>
__device__ __forceinline__ std::int64_t slot_offset(const KvCacheView<T, Id>& view, const Id* table, int slot,
                                                    int head) {
  const int bs = view.block.block_size;
  return view.block.offset(table[slot / bs], slot % bs, head);
}

/// Merges the warps' online-softmax states (shared memory) and writes the CTA's result: the
/// output when there is one split, else the split's partial.
template <int D, int kHP, int kWarps, class T, class OutT>
__device__ __forceinline__ void cta_merge_store(const float (&s_o)[kWarps][kHP][D + 1], const float (&s_m)[kWarps][kHP],
                                                const float (&s_l)[kWarps][kHP], int nh, int b, int first_q_head,
                                                const DecodeAttentionParams<T, OutT>& p) {
  for (int idx = static_cast<int>(threadIdx.x); idx < nh * D; idx += kWarps * 32) {
    const int h = idx / D;
    const int e = idx % D;
    float mx = s_m[0][h];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float sc = exp2f(s_m[w][h] - mx);  // warps without tokens: exp2(-inf) = 0
      l += s_l[w][h] * sc;
      o += s_o[w][h][e] * sc;
    }
    const std::int64_t row = static_cast<std::int64_t>(b) * p.num_q_heads + first_q_head + h;
    if (p.num_splits == 1) {
      store_f32(p.out + row * D + e, o / l);
    } else {
      const std::int64_t part = row * p.num_splits + blockIdx.x;
      p.partial_o[part * D + e] = o;
      if (e == 0) p.partial_ml[part] = make_float2(mx, l);
    }
  }
}

/// Zero output for an empty sequence when no combine kernel runs.
template <int D, class T, class OutT>
__device__ __forceinline__ void store_empty(int nh, int b, int first_q_head, const DecodeAttentionParams<T, OutT>& p) {
  for (int idx = static_cast<int>(threadIdx.x); idx < nh * D; idx += static_cast<int>(blockDim.x))
    store_f32(p.out + (static_cast<std::int64_t>(b) * p.num_q_heads + first_q_head + idx / D) * D + idx % D, 0.f);
}

}  // namespace detail

/// 16-bit caches. Grid: [num_splits, num_kv_heads * passes, batch], tuning::DecodeAttention::kThreads.
template <int HeadDim, class T, class Id, class OutT>
__global__ void __launch_bounds__(tuning::sm90::DecodeAttention::kThreads, tuning::sm90::DecodeAttention::kMinCtasPerSmMma)
    decode_attention_mma_kernel(KvCacheView<T, Id> view, DecodeAttentionParams<T, OutT> p) {
  using Tune = tuning::sm90::DecodeAttention;
  using DT = device_type_t<T>;
  static_assert(sizeof(DT) == 2, "the mma kernel takes 16-bit caches");
  static_assert(HeadDim == 64 || HeadDim == 128, "fragment mapping written for head_dim 64 and 128");
  constexpr int D = HeadDim;
  constexpr int kWarps = Tune::kWarps;
  constexpr int kTile = Tune::kTileTokens;
  constexpr int kHP = Tune::kHeadsPerPassMma;  // the MMA's N
  constexpr int kKSteps = D / 16;              // QK k-steps
  constexpr int kMTiles = D / 16;              // PV m-tiles
  constexpr int kKChunks = D / 32;             // K chunks per lane per token: 4i + q
  constexpr int kVChunks = D / 64;             // V chunks per lane per token: g + 8u

  __shared__ float s_o[kWarps][kHP][D + 1];
  __shared__ float s_m[kWarps][kHP];
  __shared__ float s_l[kWarps][kHP];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2;  // MMA group id
  const int q4 = lane & 3;  // thread in group
  const int b = static_cast<int>(blockIdx.z);
  const int passes = (p.group_size + kHP - 1) / kHP;
  const int kvh = static_cast<int>(blockIdx.y) / passes;
  const int head0 = (static_cast<int>(blockIdx.y) % passes) * kHP;
  const int nh = min(kHP, p.group_size - head0);
  const int first_q_head = kvh * p.group_size + head0;
  const int seq = p.seq_ids != nullptr ? p.seq_ids[b] : b;
  const int len = static_cast<int>(view.seq_lens[seq]);
  const int start = static_cast<int>(blockIdx.x) * p.tokens_per_split;
  const int end = min(len, start + p.tokens_per_split);

  detail::griddep_launch_dependents();
  if (start >= end) {
    if (p.num_splits == 1) detail::store_empty<D>(nh, b, first_q_head, p);
    return;
  }

  // Q^T as B fragments: lane (g, q4) holds query head g's chunks 4i + q4 (zeros past nh).
  std::uint32_t qf[kKSteps][2];
  {
    const uint4* qp = reinterpret_cast<const uint4*>(p.q + (static_cast<std::int64_t>(b) * p.num_q_heads +
                                                            first_q_head + (g < nh ? g : 0)) * D);
#pragma unroll
    for (int i = 0; i < kKChunks; ++i) {
      const uint4 x = g < nh ? qp[4 * i + q4] : make_uint4(0, 0, 0, 0);
      qf[2 * i][0] = x.x;
      qf[2 * i][1] = x.y;
      qf[2 * i + 1][0] = x.z;
      qf[2 * i + 1][1] = x.w;
    }
  }

  float o[kMTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (log2 units) of heads 2q4, 2q4 + 1
  float l0 = 0.f, l1 = 0.f;              // this lane's share of the running sums

  const Id* table = view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq;
  const DT* kbase = reinterpret_cast<const DT*>(view.range(p.layer, KvKind::kKey));
  const DT* vbase = reinterpret_cast<const DT*>(view.range(p.layer, KvKind::kValue));

  for (int t0 = start + warp * kTile; t0 < end; t0 += kTile * kWarps) {
    // Lane l < 16 resolves token t0 + l (past the end: the last valid token, masked below).
    const std::int64_t my_off = detail::slot_offset(view, table, min(t0 + (lane & 15), end - 1), kvh);
    const std::int64_t off_ka = __shfl_sync(0xffffffffu, my_off, g);
    const std::int64_t off_kb = __shfl_sync(0xffffffffu, my_off, g + 8);
    const std::int64_t off_v0 = __shfl_sync(0xffffffffu, my_off, 2 * q4);
    const std::int64_t off_v1 = __shfl_sync(0xffffffffu, my_off, 2 * q4 + 1);
    const std::int64_t off_v2 = __shfl_sync(0xffffffffu, my_off, 8 + 2 * q4);
    const std::int64_t off_v3 = __shfl_sync(0xffffffffu, my_off, 9 + 2 * q4);

    uint4 ka[kKChunks], kb[kKChunks], v[4][kVChunks];
#pragma unroll
    for (int i = 0; i < kKChunks; ++i) {
      ka[i] = *reinterpret_cast<const uint4*>(kbase + off_ka + (4 * i + q4) * 8);
      kb[i] = *reinterpret_cast<const uint4*>(kbase + off_kb + (4 * i + q4) * 8);
    }
#pragma unroll
    for (int u = 0; u < kVChunks; ++u) {
      const int c = (g + 8 * u) * 8;
      v[0][u] = *reinterpret_cast<const uint4*>(vbase + off_v0 + c);
      v[1][u] = *reinterpret_cast<const uint4*>(vbase + off_v1 + c);
      v[2][u] = *reinterpret_cast<const uint4*>(vbase + off_v2 + c);
      v[3][u] = *reinterpret_cast<const uint4*>(vbase + off_v3 + c);
    }

    // S^T: s[0] = (token g, head 2q4), s[1] = (g, 2q4+1), s[2] = (g+8, 2q4), s[3] = (g+8, 2q4+1).
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kKChunks; ++i) {
      detail::mma_16816<DT>(s, ka[i].x, kb[i].x, ka[i].y, kb[i].y, qf[2 * i][0], qf[2 * i][1]);
      detail::mma_16816<DT>(s, ka[i].z, kb[i].z, ka[i].w, kb[i].w, qf[2 * i + 1][0], qf[2 * i + 1][1]);
    }
    const bool valid_a = t0 + g < end;
    const bool valid_b = t0 + g + 8 < end;
    const float s0 = valid_a ? s[0] * p.scale_log2 : -INFINITY;
    const float s1 = valid_a ? s[1] * p.scale_log2 : -INFINITY;
    const float s2 = valid_b ? s[2] * p.scale_log2 : -INFINITY;
    const float s3 = valid_b ? s[3] * p.scale_log2 : -INFINITY;

    // Online softmax per head over the tile's 16 tokens (lanes of one q4 hold one head pair).
    float mx0 = fmaxf(s0, s2), mx1 = fmaxf(s1, s3);
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);  // finite: token t0 is valid
    const float a0 = exp2f(m0 - mn0), a1 = exp2f(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = exp2f(s0 - mn0), p1 = exp2f(s1 - mn1), p2 = exp2f(s2 - mn0), p3 = exp2f(s3 - mn1);
    l0 = l0 * a0 + (p0 + p2);
    l1 = l1 * a1 + (p1 + p3);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      o[mt][0] *= a0;
      o[mt][1] *= a1;
      o[mt][2] *= a0;
      o[mt][3] *= a1;
    }

    // P^T B fragments: b0 = P[head g][tokens 2q4, 2q4+1], b1 = P[head g][tokens 8+2q4, 9+2q4].
    std::uint32_t h01, l01, h23, l23;
    detail::split_pack<DT>(p0, p1, h01, l01);
    detail::split_pack<DT>(p2, p3, h23, l23);
    const std::uint32_t bh0 = detail::movmatrix_trans(h01), bh1 = detail::movmatrix_trans(h23);
    const std::uint32_t bl0 = detail::movmatrix_trans(l01), bl1 = detail::movmatrix_trans(l23);

#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      // V^T A fragment of m-tile mt: rows g / g+8 are dims dim_of(mt, 0|1, g); columns are
      // tokens (2q4, 2q4+1) for a0/a1 and (8+2q4, 9+2q4) for a2/a3.
      std::uint32_t a0r, a1r, a2r, a3r;
      if constexpr (D == 128) {
        const std::uint32_t sel = (mt & 1) ? 0x7632u : 0x5410u;
        const int w = mt >> 1;
        a0r = __byte_perm(detail::word(v[0][0], w), detail::word(v[1][0], w), sel);
        a1r = __byte_perm(detail::word(v[0][1], w), detail::word(v[1][1], w), sel);
        a2r = __byte_perm(detail::word(v[2][0], w), detail::word(v[3][0], w), sel);
        a3r = __byte_perm(detail::word(v[2][1], w), detail::word(v[3][1], w), sel);
      } else {
        a0r = __byte_perm(detail::word(v[0][0], mt), detail::word(v[1][0], mt), 0x5410u);
        a1r = __byte_perm(detail::word(v[0][0], mt), detail::word(v[1][0], mt), 0x7632u);
        a2r = __byte_perm(detail::word(v[2][0], mt), detail::word(v[3][0], mt), 0x5410u);
        a3r = __byte_perm(detail::word(v[2][0], mt), detail::word(v[3][0], mt), 0x7632u);
      }
      detail::mma_16816<DT>(o[mt], a0r, a1r, a2r, a3r, bh0, bh1);
      detail::mma_16816<DT>(o[mt], a0r, a1r, a2r, a3r, bl0, bl1);
    }
  }

  // Warp state -> shared memory. Lane (g, q4) holds O[head 2q4 (+1)][dim_of(mt, 0|1, g)].
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
  }
  if (g == 0) {
    s_m[warp][2 * q4] = m0;
    s_m[warp][2 * q4 + 1] = m1;
    s_l[warp][2 * q4] = l0;
    s_l[warp][2 * q4 + 1] = l1;
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const int d0 = D == 128 ? 8 * g + mt : 8 * g + 2 * mt;       // row g
    const int d1 = D == 128 ? 64 + 8 * g + mt : 8 * g + 2 * mt + 1;  // row g + 8
    s_o[warp][2 * q4][d0] = o[mt][0];
    s_o[warp][2 * q4 + 1][d0] = o[mt][1];
    s_o[warp][2 * q4][d1] = o[mt][2];
    s_o[warp][2 * q4 + 1][d1] = o[mt][3];
  }
  __syncthreads();
  detail::cta_merge_store<D, kHP, kWarps>(s_o, s_m, s_l, nh, b, first_q_head, p);
}

/// fp32 caches, CUDA cores: a half-warp per token (head_dim / 16 floats per lane), kHeadsPerPassF32
/// query heads per pass. Grid as the mma kernel.
template <int HeadDim, class Id, class OutT>
__global__ void __launch_bounds__(tuning::sm90::DecodeAttention::kThreads)
    decode_attention_f32_kernel(KvCacheView<float, Id> view, DecodeAttentionParams<float, OutT> p) {
  using Tune = tuning::sm90::DecodeAttention;
  constexpr int D = HeadDim;
  constexpr int kWarps = Tune::kWarps;
  constexpr int kTile = Tune::kTileTokens;
  constexpr int kHP = Tune::kHeadsPerPassF32;
  constexpr int kE = D / 16;  // floats per lane
  static_assert(kE % 4 == 0, "lanes load whole float4s");

  __shared__ float s_o[kWarps][kHP][D + 1];
  __shared__ float s_m[kWarps][kHP];
  __shared__ float s_l[kWarps][kHP];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int half = lane >> 4;
  const int hl = lane & 15;
  const int b = static_cast<int>(blockIdx.z);
  const int passes = (p.group_size + kHP - 1) / kHP;
  const int kvh = static_cast<int>(blockIdx.y) / passes;
  const int head0 = (static_cast<int>(blockIdx.y) % passes) * kHP;
  const int nh = min(kHP, p.group_size - head0);
  const int first_q_head = kvh * p.group_size + head0;
  const int seq = p.seq_ids != nullptr ? p.seq_ids[b] : b;
  const int len = static_cast<int>(view.seq_lens[seq]);
  const int start = static_cast<int>(blockIdx.x) * p.tokens_per_split;
  const int end = min(len, start + p.tokens_per_split);

  detail::griddep_launch_dependents();
  if (start >= end) {
    if (p.num_splits == 1) detail::store_empty<D>(nh, b, first_q_head, p);
    return;
  }

  // Queries pre-scaled into log2 units (fp32: one rounding, far below the 1e-5 bound).
  float qv[kHP][kE];
#pragma unroll
  for (int h = 0; h < kHP; ++h) {
    const float* qp = p.q + (static_cast<std::int64_t>(b) * p.num_q_heads + first_q_head + (h < nh ? h : 0)) * D + hl * kE;
#pragma unroll
    for (int e = 0; e < kE; e += 4) {
      const float4 x = h < nh ? *reinterpret_cast<const float4*>(qp + e) : make_float4(0.f, 0.f, 0.f, 0.f);
      qv[h][e] = x.x * p.scale_log2;
      qv[h][e + 1] = x.y * p.scale_log2;
      qv[h][e + 2] = x.z * p.scale_log2;
      qv[h][e + 3] = x.w * p.scale_log2;
    }
  }
  float o[kHP][kE], m[kHP], l[kHP];
#pragma unroll
  for (int h = 0; h < kHP; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) o[h][e] = 0.f;
  }

  const Id* table = view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq;
  const float* kbase = view.range(p.layer, KvKind::kKey);
  const float* vbase = view.range(p.layer, KvKind::kValue);

  for (int t0 = start + warp * kTile; t0 < end; t0 += kTile * kWarps) {
    const std::int64_t my_off = detail::slot_offset(view, table, min(t0 + hl, end - 1), kvh);
#pragma unroll 4
    for (int j = 0; j < kTile / 2; ++j) {
      const int tt = 2 * j + half;  // half-warp `half` takes token t0 + tt
      const std::int64_t off = __shfl_sync(0xffffffffu, my_off, tt) + hl * kE;
      float kx[kE], vx[kE];
#pragma unroll
      for (int e = 0; e < kE; e += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(kbase + off + e);
        const float4 v4 = *reinterpret_cast<const float4*>(vbase + off + e);
        kx[e] = k4.x, kx[e + 1] = k4.y, kx[e + 2] = k4.z, kx[e + 3] = k4.w;
        vx[e] = v4.x, vx[e + 1] = v4.y, vx[e + 2] = v4.z, vx[e + 3] = v4.w;
      }
      float s[kHP];
#pragma unroll
      for (int h = 0; h < kHP; ++h) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc = fmaf(qv[h][e], kx[e], acc);
#pragma unroll
        for (int x = 1; x < 16; x <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, x);
        s[h] = acc;
      }
      if (t0 + tt < end) {
#pragma unroll
        for (int h = 0; h < kHP; ++h) {
          const float mn = fmaxf(m[h], s[h]);
          const float a = exp2f(m[h] - mn);
          const float pp = exp2f(s[h] - mn);
          l[h] = l[h] * a + pp;
          m[h] = mn;
#pragma unroll
          for (int e = 0; e < kE; ++e) o[h][e] = fmaf(o[h][e], a, pp * vx[e]);
        }
      }
    }
  }

  // Merge the two half-warps (either may have seen no token: m = -inf).
#pragma unroll
  for (int h = 0; h < kHP; ++h) {
    const float mo = __shfl_xor_sync(0xffffffffu, m[h], 16);
    const float lo = __shfl_xor_sync(0xffffffffu, l[h], 16);
    const float mx = fmaxf(m[h], mo);
    const float wa = m[h] == -INFINITY ? 0.f : exp2f(m[h] - mx);
    const float wb = mo == -INFINITY ? 0.f : exp2f(mo - mx);
    l[h] = l[h] * wa + lo * wb;
    m[h] = mx;
#pragma unroll
    for (int e = 0; e < kE; ++e) o[h][e] = o[h][e] * wa + __shfl_xor_sync(0xffffffffu, o[h][e], 16) * wb;
  }
  if (half == 0) {
#pragma unroll
    for (int h = 0; h < kHP; ++h) {
#pragma unroll
      for (int e = 0; e < kE; ++e) s_o[warp][h][hl * kE + e] = o[h][e];
      if (hl == 0) {
        s_m[warp][h] = m[h];
        s_l[warp][h] = l[h];
      }
    }
  }
  __syncthreads();
  detail::cta_merge_store<D, kHP, kWarps>(s_o, s_m, s_l, nh, b, first_q_head, p);
}

/// Merges the splits of each (entry, query head). Grid: [num_q_heads, batch], HeadDim threads.
/// Launched with programmatic dependent launch: waits for the split kernel's results first.
template <int HeadDim, class Id, class OutT>
__global__ void __launch_bounds__(HeadDim) decode_attention_combine_kernel(const Id* seq_lens,          // [max_seqs]
                                                                          const std::int32_t* seq_ids,  // [batch] or nullptr
                                                                          const float* partial_o,  // [batch, Hq, S, D]
                                                                          const float2* partial_ml,  // [batch, Hq, S]
                                                                          OutT* out,  // [batch, Hq, D]
                                                                          int num_q_heads, int num_splits,
                                                                          int tokens_per_split) {
  detail::griddep_wait();
  const int hq = static_cast<int>(blockIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  const int e = static_cast<int>(threadIdx.x);
  const int seq = seq_ids != nullptr ? seq_ids[b] : b;
  const int len = static_cast<int>(seq_lens[seq]);
  const int n = min(num_splits, (len + tokens_per_split - 1) / tokens_per_split);
  const std::int64_t row = static_cast<std::int64_t>(b) * num_q_heads + hq;
  const float2* ml = partial_ml + row * num_splits;
  const float* po = partial_o + row * num_splits * HeadDim + e;
  float mx = -INFINITY;
  for (int s = 0; s < n; ++s) mx = fmaxf(mx, ml[s].x);
  float l = 0.f, o = 0.f;
  for (int s = 0; s < n; ++s) {
    const float2 x = ml[s];
    const float sc = exp2f(x.x - mx);
    l += x.y * sc;
    o += po[static_cast<std::int64_t>(s) * HeadDim] * sc;
  }
  detail::store_f32(out + row * HeadDim + e, n > 0 ? o / l : 0.f);
}

}  // namespace triattn::cuda

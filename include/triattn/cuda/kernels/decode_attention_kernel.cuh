// SPDX-License-Identifier: Apache-2.0
// Paged decode attention (one query per sequence, GQA), split-K over the sequence: CTA
// (split, KV head [, head pass], batch entry) reads its token range of one KV head once for all
// the query heads of that head's group, keeps an online softmax, and either writes the output
// (one split) or an unnormalised partial that decode_attention_combine_kernel merges.
//
// 16-bit caches (mma pipe kernel): each warp takes 16-token tiles and uses mma.sync m16n8k16.
//   QK:  S^T[16 tokens x 8 heads] = K[16 x d] . Q^T[d x 8]      (d/16 MMAs)
//   PV:  O^T[d x 8 heads] += V^T[d x 16 tokens] . P^T[16 x 8]   (d/16 MMAs, twice: P = hi + lo)
// Operands come straight from 16-byte global loads: a dot product does not care in which order
// it visits d, so lane (g, q) loads chunks 4i+q of tokens g, g+8 and feeds them as its A
// fragment of K, with Q loaded in the same permuted order as B. V is loaded as chunks g (and
// g+8) of tokens 2q, 2q+1, 8+2q, 9+2q and paired across tokens with one PRMT per register.
// P leaves the QK accumulator as S^T and becomes P^T's B fragment through movmatrix.trans.
// P is split into hi + lo 16-bit parts, so PV keeps ~16 bits of P (a single bf16 P would give
// ~1e-3 relative error by itself).
// fp32 and fp8 caches (f32 kernel): CUDA cores, a half-warp per token, 4 query heads per pass;
// fp8 elements are widened and multiplied by their layer's (and head's) K / V scale on load.
//
// Each warp streams its tiles through kStages shared-memory buffers (cp.async, 16 bytes, coalesced
// per 128-byte line; chunks XOR-swizzled per token so the fragment reads are free of bank
// conflicts), so kStages tiles stay in flight while it computes; the block-table entry of a tile
// is fetched one tile ahead.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/kv_view.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device/async_copy.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

/// POD parameters of the decode attention kernels. T: the cache's storage type; OutT: float or T
/// (float for fp8 caches).
template <class T, class OutT>
struct DecodeAttentionParams {
  const query_type_t<T>* q;     ///< [batch, num_q_heads, head_dim] (float for fp8 caches)
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

/// XOR applied to a 16-byte chunk index of token row t (0..15) of a shared-memory tile: the K
/// fragment reads (tokens t, t+1 x chunks 4i..4i+3 per quarter warp) and the V fragment reads
/// (tokens t, t+2, t+4, t+6 x chunks 2j, 2j+1) then hit 8 distinct 16-byte bank groups.
__device__ __forceinline__ int chunk_swizzle(int t) { return (((t >> 1) & 3) << 1) ^ ((t & 1) << 2); }

/// One 16-token tile of the mma kernels: S^T = K Q^T, online softmax, O^T += V^T P^T (hi + lo).
/// ka/kb: chunks 4i + q4 of tokens g / g + 8; v[j][u]: chunk g + 8u of tokens 2q4, 2q4 + 1,
/// 8 + 2q4, 9 + 2q4 (see the file comment). valid_a / valid_b: tokens g / g + 8 exist.
template <int D, class DT>
__device__ __forceinline__ void mma_tile_update(const uint4 (&ka)[D / 32], const uint4 (&kb)[D / 32],
                                                const uint4 (&v)[4][D / 64], const std::uint32_t (&qf)[D / 16][2],
                                                float (&o)[D / 16][4], float& m0, float& m1, float& l0, float& l1,
                                                bool valid_a, bool valid_b, float scale_log2) {
  constexpr int kKChunks = D / 32;
  constexpr int kMTiles = D / 16;
  // S^T: s[0] = (token g, head 2q4), s[1] = (g, 2q4+1), s[2] = (g+8, 2q4), s[3] = (g+8, 2q4+1).
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kKChunks; ++i) {
    mma_16816<DT>(s, ka[i].x, kb[i].x, ka[i].y, kb[i].y, qf[2 * i][0], qf[2 * i][1]);
    mma_16816<DT>(s, ka[i].z, kb[i].z, ka[i].w, kb[i].w, qf[2 * i + 1][0], qf[2 * i + 1][1]);
  }
  const float s0 = valid_a ? s[0] * scale_log2 : -INFINITY;
  const float s1 = valid_a ? s[1] * scale_log2 : -INFINITY;
  const float s2 = valid_b ? s[2] * scale_log2 : -INFINITY;
  const float s3 = valid_b ? s[3] * scale_log2 : -INFINITY;

  // Online softmax per head over the tile's 16 tokens (lanes of one q4 hold one head pair).
  float mx0 = fmaxf(s0, s2), mx1 = fmaxf(s1, s3);
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
  }
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);  // finite: the tile's first token is valid
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
  split_pack<DT>(p0, p1, h01, l01);
  split_pack<DT>(p2, p3, h23, l23);
  const std::uint32_t bh0 = movmatrix_trans(h01), bh1 = movmatrix_trans(h23);
  const std::uint32_t bl0 = movmatrix_trans(l01), bl1 = movmatrix_trans(l23);

#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    // V^T A fragment of m-tile mt: rows g / g+8 are dims dim_of(mt, 0|1, g); columns are
    // tokens (2q4, 2q4+1) for a0/a1 and (8+2q4, 9+2q4) for a2/a3.
    std::uint32_t a0r, a1r, a2r, a3r;
    if constexpr (D == 128) {
      const std::uint32_t sel = (mt & 1) ? 0x7632u : 0x5410u;
      const int w = mt >> 1;
      a0r = __byte_perm(word(v[0][0], w), word(v[1][0], w), sel);
      a1r = __byte_perm(word(v[0][1], w), word(v[1][1], w), sel);
      a2r = __byte_perm(word(v[2][0], w), word(v[3][0], w), sel);
      a3r = __byte_perm(word(v[2][1], w), word(v[3][1], w), sel);
    } else {
      a0r = __byte_perm(word(v[0][0], mt), word(v[1][0], mt), 0x5410u);
      a1r = __byte_perm(word(v[0][0], mt), word(v[1][0], mt), 0x7632u);
      a2r = __byte_perm(word(v[2][0], mt), word(v[3][0], mt), 0x5410u);
      a3r = __byte_perm(word(v[2][0], mt), word(v[3][0], mt), 0x7632u);
    }
    mma_16816<DT>(o[mt], a0r, a1r, a2r, a3r, bh0, bh1);
    mma_16816<DT>(o[mt], a0r, a1r, a2r, a3r, bl0, bl1);
  }
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

/// Shared memory of the CTA merge (the cp.async kernel aliases it with its pipeline buffers).
template <int D, int kHP, int kWarps>
struct MergeSmem {
  float o[kWarps][kHP][D + 1];
  float m[kWarps][kHP];
  float l[kWarps][kHP];
};

/// Zero output for an empty sequence when no combine kernel runs.
template <int D, class T, class OutT>
__device__ __forceinline__ void store_empty(int nh, int b, int first_q_head, const DecodeAttentionParams<T, OutT>& p) {
  for (int idx = static_cast<int>(threadIdx.x); idx < nh * D; idx += static_cast<int>(blockDim.x))
    store_f32(p.out + (static_cast<std::int64_t>(b) * p.num_q_heads + first_q_head + idx / D) * D + idx % D, 0.f);
}

/// This CTA's share of the split-K decode grid (x: token split, y: KV head x head pass, z: entry of
/// the batch): kHP query heads from head0 of KV head kvh's group, nh of them real.
template <int kHP>
struct DecodeCtaHeads {
  int b, kvh, head0, nh, first_q_head, seq;
  template <class Params>
  __device__ __forceinline__ explicit DecodeCtaHeads(const Params& p) {
    b = static_cast<int>(blockIdx.z);
    const int passes = (p.group_size + kHP - 1) / kHP;
    kvh = static_cast<int>(blockIdx.y) / passes;
    head0 = (static_cast<int>(blockIdx.y) % passes) * kHP;
    nh = min(kHP, p.group_size - head0);
    first_q_head = kvh * p.group_size + head0;
    seq = p.seq_ids != nullptr ? p.seq_ids[b] : b;
  }
};

}  // namespace detail

/// Shared memory bytes of decode_attention_mma_pipe_kernel<HeadDim, ...> (dynamic).
template <int HeadDim, class Tune>
[[nodiscard]] constexpr int decode_attention_pipe_smem_bytes() {
  constexpr int pipe = Tune::kWarps * Tune::kStages * 2 * Tune::kTileTokens * HeadDim * 2;
  constexpr int merge = static_cast<int>(sizeof(detail::MergeSmem<HeadDim, Tune::kHeadsPerPassMma, Tune::kWarps>));
  return pipe > merge ? pipe : merge;
}

/// 16-bit caches, cp.async pipeline: each warp streams its tiles through Tune::kStages
/// shared-memory buffers. Grid: [num_splits, num_kv_heads * passes, batch], Tune::kThreads.
template <int HeadDim, class T, class Id, class OutT, class Tune>
__global__ void __launch_bounds__(Tune::kThreads, Tune::kMinCtasPerSmPipe)
    decode_attention_mma_pipe_kernel(KvCacheView<T, Id> view, DecodeAttentionParams<T, OutT> p) {
  using DT = device_type_t<T>;
  static_assert(sizeof(DT) == 2, "the mma kernel takes 16-bit caches");
  static_assert(HeadDim == 64 || HeadDim == 128, "fragment mapping written for head_dim 64 and 128");
  static_assert(Tune::kTileTokens == 16, "the tile is the MMA's 16 rows");
  constexpr int D = HeadDim;
  constexpr int kWarps = Tune::kWarps;
  constexpr int kTile = Tune::kTileTokens;
  constexpr int kStages = Tune::kStages;
  constexpr int kHP = Tune::kHeadsPerPassMma;
  constexpr int kKSteps = D / 16;
  constexpr int kMTiles = D / 16;
  constexpr int kKChunks = D / 32;
  constexpr int kVChunks = D / 64;
  constexpr int kCPR = D / 8;                 // 16-byte chunks per head vector
  constexpr int kTileVecs = kTile * kCPR;     // 16-byte chunks per K (or V) tile
  constexpr int kStride = kTile * kWarps;     // tokens between a warp's consecutive tiles
  static_assert(kStages >= 2, "two stages at least");

  extern __shared__ __align__(16) unsigned char dsmem[];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const detail::DecodeCtaHeads<kHP> cta(p);
  const int b = cta.b, kvh = cta.kvh, nh = cta.nh, first_q_head = cta.first_q_head, seq = cta.seq;
  const Id* table = view.block_tables + static_cast<std::int64_t>(seq) * view.max_blocks_per_seq;
  const int bs = view.block.block_size;
  const int start = static_cast<int>(blockIdx.x) * p.tokens_per_split;
  const int wstart = start + warp * kTile;  // first token of this warp's first tile

  // Independent loads first: the length, the block of this lane's token of tile 0 assuming the
  // split is full (true for all but a sequence's last split; checked below), and Q.
  const int len = static_cast<int>(view.seq_lens[seq]);
  const int cap = view.max_blocks_per_seq * bs;
  const int spec_slot = max(0, min(wstart + (lane & 15), min(start + p.tokens_per_split, cap) - 1));
  const Id spec_blk = cap > 0 ? table[spec_slot / bs] : Id(0);

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

  const int end = min(len, start + p.tokens_per_split);
  detail::griddep_launch_dependents();
  if (start >= end) {
    if (p.num_splits == 1) detail::store_empty<D>(nh, b, first_q_head, p);  // this CTA owns the output
    return;
  }

  float o[kMTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;
  float l0 = 0.f, l1 = 0.f;

  const DT* kbase = reinterpret_cast<const DT*>(view.range(p.layer, KvKind::kKey));
  const DT* vbase = reinterpret_cast<const DT*>(view.range(p.layer, KvKind::kValue));
  uint4* const pipe = reinterpret_cast<uint4*>(dsmem) + warp * (kStages * 2 * kTileVecs);
  const int ntiles = wstart < end ? (end - wstart + kStride - 1) / kStride : 0;

  // Lane l resolves token (l & 15) of a tile; tokens past the end read the last valid token.
  auto slot_of = [&](int k) { return min(wstart + k * kStride + (lane & 15), end - 1); };
  auto block_of = [&](int k) -> Id { return table[slot_of(k) / bs]; };
  // Copies tile k (its lanes' block ids in `blk`) into buffer `buf`. Lane (r = lane / 8, c8 =
  // lane % 8) copies chunks c8 + 8hh of tokens 4j + r: a quarter warp moves one 128-byte line.
  auto issue = [&](int k, Id blk, int buf) {
    const int slot = slot_of(k);
    const std::int64_t my_off = view.block.offset(blk, slot % bs, kvh);
    const std::uint32_t sk = detail::smem_addr(pipe + buf * 2 * kTileVecs);
    const std::uint32_t sv = sk + kTileVecs * 16;
    const int r = lane >> 3;
    const int c8 = lane & 7;
#pragma unroll
    for (int j = 0; j < kTile / 4; ++j) {
      const int t = 4 * j + r;
      const std::int64_t off = __shfl_sync(0xffffffffu, my_off, t);
      const int sw = detail::chunk_swizzle(t);
#pragma unroll
      for (int hh = 0; hh < kCPR / 8; ++hh) {
        const int c = 8 * hh + c8;
        const std::uint32_t so = static_cast<std::uint32_t>(t * kCPR + (c ^ sw)) * 16u;
        detail::cp_async_16(sk + so, kbase + off + c * 8);
        detail::cp_async_16(sv + so, vbase + off + c * 8);
      }
    }
  };

  Id blk_next = cap > 0 && slot_of(0) / bs == spec_slot / bs ? spec_blk : block_of(0);
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    if (k < ntiles) issue(k, blk_next, k);
    blk_next = block_of(k + 1);
    detail::cp_async_commit();
  }

  const int sg = detail::chunk_swizzle(g);           // rows g and g + 8
  const int sv0 = detail::chunk_swizzle(2 * q4);     // rows 2q4 and 8 + 2q4
  const int sv1 = detail::chunk_swizzle(2 * q4 + 1); // rows 2q4 + 1 and 9 + 2q4
  for (int k = 0; k < ntiles; ++k) {
    const int kn = k + kStages - 1;
    if (kn < ntiles) issue(kn, blk_next, kn % kStages);
    blk_next = block_of(kn + 1);  // fetched a tile ahead of its use (clamped: always a valid entry)
    detail::cp_async_commit();
    detail::cp_async_wait<kStages - 1>();  // this lane's copies of tile k have landed
    __syncwarp();                          // ... and every lane's

    const uint4* tk = pipe + (k % kStages) * 2 * kTileVecs;
    const uint4* tv = tk + kTileVecs;
    uint4 ka[kKChunks], kb[kKChunks], v[4][kVChunks];
#pragma unroll
    for (int i = 0; i < kKChunks; ++i) {
      ka[i] = tk[g * kCPR + ((4 * i + q4) ^ sg)];
      kb[i] = tk[(g + 8) * kCPR + ((4 * i + q4) ^ sg)];
    }
#pragma unroll
    for (int u = 0; u < kVChunks; ++u) {
      const int c = g + 8 * u;
      v[0][u] = tv[(2 * q4) * kCPR + (c ^ sv0)];
      v[1][u] = tv[(2 * q4 + 1) * kCPR + (c ^ sv1)];
      v[2][u] = tv[(8 + 2 * q4) * kCPR + (c ^ sv0)];
      v[3][u] = tv[(9 + 2 * q4) * kCPR + (c ^ sv1)];
    }
    const int t0 = wstart + k * kStride;
    detail::mma_tile_update<D, DT>(ka, kb, v, qf, o, m0, m1, l0, l1, t0 + g < end, t0 + g + 8 < end, p.scale_log2);
    __syncwarp();  // every lane has read buffer k % kStages before it is refilled
  }
  detail::cp_async_wait<0>();

  // Warp state -> shared memory (aliasing the pipeline buffers: wait for every warp first).
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
  }
  __syncthreads();
  auto& ms = *reinterpret_cast<detail::MergeSmem<D, kHP, kWarps>*>(dsmem);
  if (g == 0) {
    ms.m[warp][2 * q4] = m0;
    ms.m[warp][2 * q4 + 1] = m1;
    ms.l[warp][2 * q4] = l0;
    ms.l[warp][2 * q4 + 1] = l1;
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const int d0 = D == 128 ? 8 * g + mt : 8 * g + 2 * mt;
    const int d1 = D == 128 ? 64 + 8 * g + mt : 8 * g + 2 * mt + 1;
    ms.o[warp][2 * q4][d0] = o[mt][0];
    ms.o[warp][2 * q4 + 1][d0] = o[mt][1];
    ms.o[warp][2 * q4][d1] = o[mt][2];
    ms.o[warp][2 * q4 + 1][d1] = o[mt][3];
  }
  __syncthreads();
  detail::cta_merge_store<D, kHP, kWarps>(ms.o, ms.m, ms.l, nh, b, first_q_head, p);
}

namespace detail {
/// Elements [0, kE) of a head vector of an fp8 cache as values: kE bytes (whole 32-bit words),
/// widened and multiplied by `scale`.
template <int kE, class T>
__device__ __forceinline__ void load_fp8_row(const T* p, float scale, float (&x)[kE]) {
  static_assert(sizeof(T) == 1 && kE % 4 == 0, "byte-wide codes, whole 32-bit words per lane");
  using D = device_type_t<T>;
  std::uint32_t w[kE / 4];
  if constexpr (kE % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kE / 8; ++i) {
      const uint2 v = *reinterpret_cast<const uint2*>(p + 8 * i);
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kE / 4; ++i) w[i] = *reinterpret_cast<const std::uint32_t*>(p + 4 * i);
  }
  const D* c = reinterpret_cast<const D*>(w);
#pragma unroll
  for (int e = 0; e < kE; ++e) x[e] = dequant<T>(c[e], scale);
}
}  // namespace detail

/// fp32 and fp8 caches, CUDA cores: a half-warp per token (head_dim / 16 elements per lane),
/// kHeadsPerPassF32 query heads per pass, fp32 arithmetic. Grid as the mma kernel.
template <int HeadDim, class Id, class OutT, class Tune, class T = float>
__global__ void __launch_bounds__(Tune::kThreads)
    decode_attention_f32_kernel(KvCacheView<T, Id> view, DecodeAttentionParams<T, OutT> p) {
  static_assert(std::is_same_v<T, float> || is_scaled_dtype<T>, "the CUDA-core kernel takes fp32 and fp8 caches");
  constexpr int D = HeadDim;
  constexpr int kWarps = Tune::kWarps;
  constexpr int kTile = Tune::kTileTokens;
  constexpr int kHP = Tune::kHeadsPerPassF32;
  constexpr int kE = D / 16;  // elements per lane
  static_assert(kE % 4 == 0, "lanes load whole float4s (fp8: whole 32-bit words)");

  __shared__ float s_o[kWarps][kHP][D + 1];
  __shared__ float s_m[kWarps][kHP];
  __shared__ float s_l[kWarps][kHP];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int half = lane >> 4;
  const int hl = lane & 15;
  const detail::DecodeCtaHeads<kHP> cta(p);
  const int b = cta.b, kvh = cta.kvh, nh = cta.nh, first_q_head = cta.first_q_head, seq = cta.seq;
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
  const T* kbase = view.range(p.layer, KvKind::kKey);
  const T* vbase = view.range(p.layer, KvKind::kValue);
  const float ks = kv_scale(view, p.layer, KvKind::kKey, kvh), vs = kv_scale(view, p.layer, KvKind::kValue, kvh);

  for (int t0 = start + warp * kTile; t0 < end; t0 += kTile * kWarps) {
    const std::int64_t my_off = detail::slot_offset(view, table, min(t0 + hl, end - 1), kvh);
#pragma unroll 4
    for (int j = 0; j < kTile / 2; ++j) {
      const int tt = 2 * j + half;  // half-warp `half` takes token t0 + tt
      const std::int64_t off = __shfl_sync(0xffffffffu, my_off, tt) + hl * kE;
      float kx[kE], vx[kE];
      if constexpr (std::is_same_v<T, float>) {
#pragma unroll
        for (int e = 0; e < kE; e += 4) {
          const float4 k4 = *reinterpret_cast<const float4*>(kbase + off + e);
          const float4 v4 = *reinterpret_cast<const float4*>(vbase + off + e);
          kx[e] = k4.x, kx[e + 1] = k4.y, kx[e + 2] = k4.z, kx[e + 3] = k4.w;
          vx[e] = v4.x, vx[e + 1] = v4.y, vx[e + 2] = v4.z, vx[e + 3] = v4.w;
        }
      } else {
        detail::load_fp8_row<kE>(kbase + off, ks, kx);
        detail::load_fp8_row<kE>(vbase + off, vs, vx);
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

namespace detail {
/// What every combine kernel reads first: its (entry, query head) row, the splits the sequence
/// filled, and this thread's dimension e of the row's partials.
struct CombineRow {
  int e;                // this thread's output dimension
  int n;                // splits holding tokens of the sequence (0 for an empty one)
  std::int64_t row;     // b * num_q_heads + hq
  const float2* ml;     // [n] (max, sum) of the row's splits
  const float* po;      // [n] strided by HeadDim: dimension e of the row's partial outputs
  template <int HeadDim, class Id>
  __device__ __forceinline__ static CombineRow load(const Id* seq_lens, const std::int32_t* seq_ids,
                                                    const float* partial_o, const float2* partial_ml,
                                                    int num_q_heads, int num_splits, int tokens_per_split) {
    CombineRow c;
    const int hq = static_cast<int>(blockIdx.x);
    const int b = static_cast<int>(blockIdx.y);
    c.e = static_cast<int>(threadIdx.x);
    const int seq = seq_ids != nullptr ? seq_ids[b] : b;
    const int len = static_cast<int>(seq_lens[seq]);
    c.n = min(num_splits, (len + tokens_per_split - 1) / tokens_per_split);
    c.row = static_cast<std::int64_t>(b) * num_q_heads + hq;
    c.ml = partial_ml + c.row * num_splits;
    c.po = partial_o + c.row * num_splits * HeadDim + c.e;
    return c;
  }
};
}  // namespace detail

/// Merges the splits of each (entry, query head). Grid: [num_q_heads, batch], HeadDim threads.
/// Launched with programmatic dependent launch: waits for the split kernel's results first. The
/// split weights are computed once per CTA (threads over splits) into shared memory, then each
/// thread sums its dimension over the splits in order with kMergeBatch loads in flight.
template <int HeadDim, class Id, class OutT, class Tune>
__global__ void __launch_bounds__(HeadDim) decode_attention_combine_kernel(const Id* seq_lens,
                                                                               const std::int32_t* seq_ids,
                                                                               const float* partial_o,
                                                                               const float2* partial_ml, OutT* out,
                                                                               int num_q_heads, int num_splits,
                                                                               int tokens_per_split) {
  constexpr int kWarpsC = HeadDim / 32;
  constexpr int kBatch = Tune::kMergeBatch;
  __shared__ float s_w[Tune::kMaxSplits];
  __shared__ float s_red[2][kWarpsC];
  detail::griddep_wait();
  const auto [e, n, row, ml, po] = detail::CombineRow::load<HeadDim>(seq_lens, seq_ids, partial_o, partial_ml,
                                                                     num_q_heads, num_splits, tokens_per_split);
  const int lane = e & 31;
  const int warp = e >> 5;

  float mx = -INFINITY;
  for (int s = e; s < n; s += HeadDim) mx = fmaxf(mx, ml[s].x);
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
  if (lane == 0) s_red[0][warp] = mx;
  __syncthreads();
  mx = s_red[0][0];
#pragma unroll
  for (int w = 1; w < kWarpsC; ++w) mx = fmaxf(mx, s_red[0][w]);
  float ls = 0.f;
  for (int s = e; s < n; s += HeadDim) {
    const float2 x = ml[s];
    const float w = exp2f(x.x - mx);
    s_w[s] = w;
    ls += x.y * w;
  }
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, x);
  if (lane == 0) s_red[1][warp] = ls;
  __syncthreads();
  float l = 0.f;
#pragma unroll
  for (int w = 0; w < kWarpsC; ++w) l += s_red[1][w];

  float o = 0.f;
  for (int s0 = 0; s0 < n; s0 += kBatch) {
    // Unpredicated loads (index clamped to a valid split) so that all kBatch are in flight.
    float x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) x[u] = po[static_cast<std::int64_t>(min(s0 + u, n - 1)) * HeadDim];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (s0 + u < n) o += x[u] * s_w[s0 + u];
  }
  detail::store_f32(out + row * HeadDim + e, n > 0 ? o / l : 0.f);
}

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Kernels of the reference transformer's CUDA backend (cuda_backend.cuh). Everything the model
// needs besides triattn's own kernels (append, decode attention, compression rounds):
//
//   embed_kernel            token rows of the embedding table (fp32 or bf16) -> fp32 activations
//   rmsnorm_kernel          one CTA per row, run.c's arithmetic (mean of squares, 1/sqrt, w * (s * x))
//   gemv_warp_kernel        y = W x for few rows (bf16: n <= 2, fp32: any n): one warp per output row
//                           (two rows when a SwiGLU pair is fused), 16-byte streaming loads of W
//                           (8 loads in flight per lane), fp32 x from L1, fp32 accumulation;
//                           bf16 with n <= 2 goes to gemv_stream_kernel.cuh's streaming variants
//   gemv_mma_kernel         bf16 W, n >= 3 rows: mma.sync m16n8k16 with W fragments straight from
//                           16-byte global loads, x rounded to bf16 on the fly, split-K over the
//                           CTA's warps with a fixed-order reduction (deterministic)
//   rope_kv_kernel          RoPE of q and k (float64 angles or llama2.c float32 angles, either
//                           pairing) in place, plus converted copies for triattn's kernels or a
//                           direct write of K/V into the paged cache
//   attention_rows_kernel   causal paged attention, one warp per (row, query head), any head_dim:
//                           fp32 and fp8 caches and head dims prefill_attention.cuh does not compile
//                           (16-bit caches with head_dim 64 / 128 go to its tensor-core kernel)
//   write_kv_kernel         K/V rows -> paged cache at explicit slots (any head_dim, converting)
//
// fp8 e4m3 caches: what these kernels write is quantised by triattn::cuda::quant (x / the view's
// scale of its layer, K|V and head, nearest even, saturating: the library append's and
// KvCache::write_values' rounding), and what they read is dequantised (code * scale); the other
// dtypes never read a scale. They write fp8 only for head dims triattn's append does not compile
// (the backend sends the others to its quantising append, cuda_step_recorder.cuh).
//   add/bias/swiglu/convert element-wise ops; argmax_kernel greedy token per row
//   synth_fill_kernel       synthetic.hpp's counter-based weight generator, on the device
//
// GEMV epilogues fuse what the model does right after a matmul: bias add, residual add
// (x += W·a) and SwiGLU (gate and up rows computed by the same warp). Every kernel starts with
// griddepcontrol.launch_dependents and waits (griddepcontrol.wait) before touching activations,
// so launched with programmatic dependent launch the next kernel's CTAs are resident while this
// one drains; the GEMVs issue their first weight loads before the wait.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <triattn/core/dtype.hpp>
#include <triattn/core/hash.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn_example::gpu {

using triattn::KvCacheView;
using triattn::KvKind;
using triattn::RopeStyle;

// ---- small device helpers -----------------------------------------------------------------------

// Programmatic dependent launch (triattn/cuda/griddep.cuh): trigger the next kernel, wait for the previous.
__device__ __forceinline__ void pdl_wait() { triattn::cuda::detail::griddep_wait(); }
__device__ __forceinline__ void pdl_trigger() { triattn::cuda::detail::griddep_launch_dependents(); }

/// 16-byte load that bypasses L1 (weights are read once per step).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ float ld_f32(const float* p) { return *p; }
__device__ __forceinline__ float ld_f32(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld_f32(const __half* p) { return __half2float(*p); }

template <class T> __device__ __forceinline__ T cvt_from_f32(float x);
template <> __device__ __forceinline__ float cvt_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 cvt_from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half cvt_from_f32<__half>(float x) { return __float2half_rn(x); }

// ---- cache elements (the kernels below are templated on the cache's device type) ---------------

/// Storage type (core/dtype.hpp) of a cache's device type: the inverse of triattn::cuda::device_type_t,
/// for the library's triattn::cuda::quant / dequant (what these kernels write and read of a cache).
template <class T> struct storage_of { using type = T; };
template <> struct storage_of<__half> { using type = triattn::f16_storage; };
template <> struct storage_of<__nv_bfloat16> { using type = triattn::bf16_storage; };
template <> struct storage_of<__nv_fp8_e4m3> { using type = triattn::fp8_e4m3_storage; };
template <class T> using storage_of_t = typename storage_of<T>::type;
/// True for a device type whose codes carry a scale (fp8).
template <class T> inline constexpr bool is_scaled_v = triattn::is_scaled_dtype<storage_of_t<T>>;

/// Dequantisation scale of (layer, kind, head) of a cache of device type T: the view's for fp8,
/// a compile-time 1 otherwise (no load); triattn::cuda::kv_scale for a view typed by device type.
template <class T>
__device__ __forceinline__ float cache_scale(const KvCacheView<T, std::int32_t>& view, int layer, KvKind kind, int head) {
  if constexpr (is_scaled_v<T>) return view.scale(layer, kind, head);
  else return 1.0f;
}
/// Cache element of value x under `scale` (fp8: x / scale, nearest even, saturating; the library
/// append's and the CPU's rounding).
template <class T>
__device__ __forceinline__ T to_cache(float x, float scale) {
  return triattn::cuda::quant<storage_of_t<T>>(x, scale);
}
/// Value of cache element *p under `scale` (fp8: code * scale, as the CPU's dequantize).
template <class T>
__device__ __forceinline__ float from_cache(const T* p, float scale) {
  return triattn::cuda::dequant<storage_of_t<T>>(*p, scale);
}

/// 16 bytes of weights as floats: 4 (fp32) or 8 (bf16) values.
__device__ __forceinline__ void unpack16(const uint4& v, float (&f)[4]) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void unpack16(const uint4& v, float (&f)[8]) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

/// D = A·B + D, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                               std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- embedding ----------------------------------------------------------------------------------

/// x[r] = table[tokens[r]] (as float). Grid: [n rows], any block size.
template <class WT>
__global__ void embed_kernel(float* __restrict__ x, const WT* __restrict__ table, const int* __restrict__ tokens,
                             int dim) {
  pdl_trigger();
  pdl_wait();
  const long long r = blockIdx.x;
  const long long t = tokens[r];
  for (int i = static_cast<int>(threadIdx.x); i < dim; i += static_cast<int>(blockDim.x))
    x[r * dim + i] = ld_f32(table + t * dim + i);
}

// ---- RMSNorm ------------------------------------------------------------------------------------

inline constexpr int kNormThreads = 256;

/// 1/sqrt(mean(x²) + eps) of one row, computed by a whole CTA of kNormThreads threads (every
/// thread gets the value). The GEMV's fused prologue calls the same function, so fused and
/// separate RMSNorm give bitwise the same activations. s_part: kNormThreads / 32 floats.
__device__ __forceinline__ float row_inv_rms(const float* xr, int dim, float eps, float* s_part) {
  float ss = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < dim; i += kNormThreads) ss += xr[i] * xr[i];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += s_part[i];
  __syncthreads();  // s_part may be reused right after
  total /= static_cast<float>(dim);
  total += eps;
  return 1.0f / sqrtf(total);
}

/// out = w * (x * 1/sqrt(mean(x²) + eps)) per row; row r at offset rows[r] (or r * stride) of
/// both x and out. Grid: [n rows], kNormThreads.
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(float* out, const float* x, const float* __restrict__ w, int dim, float eps,
                   const long long* __restrict__ rows, long long stride) {
  __shared__ float s_part[kNormThreads / 32];
  pdl_trigger();
  pdl_wait();
  const long long off = rows != nullptr ? rows[blockIdx.x] : static_cast<long long>(blockIdx.x) * stride;
  const float* xr = x + off;
  const float inv = row_inv_rms(xr, dim, eps, s_part);
  float* o = out + off;
  for (int i = static_cast<int>(threadIdx.x); i < dim; i += kNormThreads) o[i] = w[i] * (inv * xr[i]);
}

// ---- GEMV ---------------------------------------------------------------------------------------

inline constexpr int kMaxGemvSegs = 3;

/// One matrix of a batched GEMV launch and the epilogue of its rows.
struct GemvSeg {
  const void* w = nullptr;      ///< [M, K] weights (float or bf16), 16-byte aligned rows on the vector paths
  const float* bias = nullptr;  ///< [M] added to the result, or null
  float* out = nullptr;         ///< result row b at out + b * out_stride
  float* residual = nullptr;    ///< row b at residual + b * res_stride receives += result, or null
  long long out_stride = 0;
  long long res_stride = 0;
  int M = 0;
  int first = 0;                ///< first work unit of this matrix
};

/// y_s = W_s · x for up to kMaxGemvSegs matrices sharing x (one launch). paired: seg[0] = gate,
/// seg[1] = up with equal M, and out_0 = silu(gate) * up, out_1 = up (the model's SwiGLU).
struct GemvParams {
  GemvSeg seg[kMaxGemvSegs];
  int nseg = 0;
  int units = 0;                    ///< work units over all segments (rows or row tiles)
  int paired = 0;
  const float* x = nullptr;         ///< row b at x + (x_rows ? x_rows[b] : b * x_stride)
  const long long* x_rows = nullptr;
  long long x_stride = 0;
  int K = 0;
  int n = 0;
  // Fused RMSNorm prologue (warp kernel only): x rows are the raw residual stream; the GEMV reads
  // norm_w * (x * inv_rms(x)) and the CTAs of blockIdx.x == 0 write that row to norm_out (the
  // model's xb) as the separate kernel would.
  const float* norm_w = nullptr;
  float* norm_out = nullptr;
  float eps = 0.0f;
};

__device__ __forceinline__ const float* gemv_x_row(const GemvParams& p, int b) {
  return p.x + (p.x_rows != nullptr ? p.x_rows[b] : static_cast<long long>(b) * p.x_stride);
}

__device__ __forceinline__ void gemv_store(const GemvSeg& s, int b, int i, float v) {
  if (s.bias != nullptr) v += s.bias[i];
  s.out[static_cast<long long>(b) * s.out_stride + i] = v;
  if (s.residual != nullptr) s.residual[static_cast<long long>(b) * s.res_stride + i] += v;
}

__device__ __forceinline__ void gemv_store_pair(const GemvSeg& g, const GemvSeg& u, int b, int i, float gate, float up) {
  if (g.bias != nullptr) gate += g.bias[i];
  if (u.bias != nullptr) up += u.bias[i];
  u.out[static_cast<long long>(b) * u.out_stride + i] = up;
  float val = gate;
  val *= 1.0f / (1.0f + expf(-val));
  val *= up;
  g.out[static_cast<long long>(b) * g.out_stride + i] = val;
}

inline constexpr int kGemvWarpThreads = 256;

/// CUDA-core GEMV: work unit = one output row (R = 2: row i of the gate and of the up matrix),
/// one warp each; blockIdx.y picks NB consecutive x rows. VEC: 16-byte loads (K a multiple of
/// 16 / sizeof(WT), aligned rows and x); else scalar loads.
template <class WT, int NB, int R, bool VEC>
__global__ void __launch_bounds__(kGemvWarpThreads) gemv_warp_kernel(const __grid_constant__ GemvParams p) {
  static_assert(kGemvWarpThreads == kNormThreads, "the fused RMSNorm prologue reduces like rmsnorm_kernel");
  __shared__ float s_part[kNormThreads / 32];
  __shared__ float s_inv[NB];
  pdl_trigger();
  constexpr int V = 16 / static_cast<int>(sizeof(WT));
  constexpr int U = 8 / R;  // 16-byte weight loads in flight per lane: 8
  constexpr int kStep = 32 * V * U;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int unit = static_cast<int>(blockIdx.x) * (kGemvWarpThreads / 32) + (static_cast<int>(threadIdx.x) >> 5);
  const bool active = unit < p.units;
  const bool norm = p.norm_w != nullptr;
  const int b0 = static_cast<int>(blockIdx.y) * NB;
  int s = 0;
  if constexpr (R == 1)
    while (s + 1 < p.nseg && unit >= p.seg[s + 1].first) ++s;
  const int i = active ? unit - p.seg[s].first : 0;
  const long long K = p.K;
  const WT* w[R];
  w[0] = static_cast<const WT*>(p.seg[s].w) + i * K;
  if constexpr (R == 2) w[1] = static_cast<const WT*>(p.seg[1].w) + i * K;

  // Weights never depend on the previous kernel: the first tile is fetched before waiting.
  uint4 wv[R][U];
  auto load = [&](int base) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * 32 * V;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[r][u] = idx < p.K ? ld_stream(w[r] + idx) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  if (VEC && active) load(lane * V);
  pdl_wait();

  if (norm) {  // the whole CTA computes its rows' 1/rms before any warp may leave
#pragma unroll 1
    for (int b = 0; b < NB && b0 + b < p.n; ++b) {
      const float* xr = gemv_x_row(p, b0 + b);
      const float inv = row_inv_rms(xr, p.K, p.eps, s_part);
      if (threadIdx.x == 0) s_inv[b] = inv;
      if (blockIdx.x == 0) {  // the model's normalised row, same layout as x
        float* o = p.norm_out + (xr - p.x);
        for (int e = static_cast<int>(threadIdx.x); e < p.K; e += kGemvWarpThreads) o[e] = p.norm_w[e] * (inv * xr[e]);
      }
    }
    __syncthreads();
  }
  if (!active) return;

  float acc[R][NB];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;

  if constexpr (VEC) {
    const float* xr[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) xr[b] = b0 + b < p.n ? gemv_x_row(p, b0 + b) : nullptr;
    int base = lane * V;
    for (;;) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * 32 * V;
        if (idx < p.K) {
          float wf[R][V];
#pragma unroll
          for (int r = 0; r < R; ++r) unpack16(wv[r][u], wf[r]);
          float nw[V];
          if (norm) {
#pragma unroll
            for (int j = 0; j < V; j += 4) {
              const float4 t = __ldg(reinterpret_cast<const float4*>(p.norm_w + idx + j));
              nw[j] = t.x, nw[j + 1] = t.y, nw[j + 2] = t.z, nw[j + 3] = t.w;
            }
          }
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            if (b0 + b < p.n) {
              float xv[V];
#pragma unroll
              for (int j = 0; j < V; j += 4) {
                const float4 t = __ldg(reinterpret_cast<const float4*>(xr[b] + idx + j));
                xv[j] = t.x, xv[j + 1] = t.y, xv[j + 2] = t.z, xv[j + 3] = t.w;
              }
              if (norm) {
                const float inv = s_inv[b];
#pragma unroll
                for (int j = 0; j < V; ++j) xv[j] = nw[j] * (inv * xv[j]);
              }
#pragma unroll
              for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < V; ++j) acc[r][b] = fmaf(wf[r][j], xv[j], acc[r][b]);
            }
          }
        }
      }
      base += kStep;
      if (base >= p.K) break;
      load(base);
    }
  } else {
    for (int k = lane; k < p.K; k += 32) {
      float wf[R];
#pragma unroll
      for (int r = 0; r < R; ++r) wf[r] = ld_f32(w[r] + k);
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        if (b0 + b < p.n) {
          float xv = gemv_x_row(p, b0 + b)[k];
          if (norm) xv = p.norm_w[k] * (s_inv[b] * xv);
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][b] = fmaf(wf[r], xv, acc[r][b]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[r][b] = warp_sum(acc[r][b]);
  if (lane != 0) return;
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (b0 + b >= p.n) break;
    if constexpr (R == 2) gemv_store_pair(p.seg[0], p.seg[1], b0 + b, i, acc[0][b], acc[1][b]);
    else gemv_store(p.seg[s], b0 + b, i, acc[0][b]);
  }
}

inline constexpr int kGemvMmaWarps = 4;

/// Tensor-core GEMV for bf16 weights and n >= 3 rows (K a multiple of 32, 16-byte aligned).
/// Work unit = one CTA = one tile of 16 output rows (paired: 8 gate rows + the same 8 up rows)
/// times NT x 8 x rows (blockIdx.y picks the x-row block). The CTA's kGemvMmaWarps warps split
/// K in interleaved groups of 32·U columns and reduce in shared memory in a fixed order.
/// Fragments (m16n8k16): lane (g, q) loads 16 bytes at columns k0 + 8q of W rows g and g + 8 and
/// of x row g; the mma's k order is thereby permuted identically for A and B, which a dot
/// product does not notice (the same trick as triattn's decode attention kernel).
template <int NT>
__global__ void __launch_bounds__(kGemvMmaWarps * 32) gemv_mma_kernel(const __grid_constant__ GemvParams p) {
  constexpr int KS = kGemvMmaWarps;
  constexpr int U = NT >= 8 ? 2 : 4;
  __shared__ float s_red[KS - 1][NT * 4][32];
  pdl_trigger();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2;
  const int q = lane & 3;
  const int unit = static_cast<int>(blockIdx.x);
  if (unit >= p.units) return;  // uniform over the CTA
  int s = 0;
  if (!p.paired)
    while (s + 1 < p.nseg && unit >= p.seg[s + 1].first) ++s;
  const GemvSeg& sa = p.seg[s];
  const GemvSeg& sb = p.paired ? p.seg[1] : p.seg[s];
  const int tile = unit - sa.first;
  const int M = sa.M;
  const int ra = p.paired ? tile * 8 + g : tile * 16 + g;
  const int rb = p.paired ? ra : ra + 8;
  const long long K = p.K;
  const __nv_bfloat16* wa = static_cast<const __nv_bfloat16*>(sa.w) + static_cast<long long>(ra < M ? ra : M - 1) * K;
  const __nv_bfloat16* wb = static_cast<const __nv_bfloat16*>(sb.w) + static_cast<long long>(rb < M ? rb : M - 1) * K;
  const int nb0 = static_cast<int>(blockIdx.y) * NT * 8;
  const int nsteps = p.K / 32;

  float c[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;

  uint4 xa[U], xb[U];
  auto load = [&](int j0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u;
      if (j < nsteps) {
        const long long k = static_cast<long long>(j) * 32 + q * 8;
        xa[u] = ld_stream(wa + k);
        xb[u] = ld_stream(wb + k);
      } else {
        xa[u] = xb[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  int j0 = warp * U;
  load(j0);
  pdl_wait();
  while (j0 < nsteps) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u;
      if (j < nsteps) {
        const int k = j * 32 + q * 8;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int br = nb0 + t * 8 + g;
          std::uint32_t b0 = 0u, b1 = 0u, b2 = 0u, b3 = 0u;
          if (br < p.n) {
            const float* xp = gemv_x_row(p, br) + k;
            const float4 x0 = __ldg(reinterpret_cast<const float4*>(xp));
            const float4 x1 = __ldg(reinterpret_cast<const float4*>(xp + 4));
            b0 = pack_bf16x2(x0.x, x0.y);
            b1 = pack_bf16x2(x0.z, x0.w);
            b2 = pack_bf16x2(x1.x, x1.y);
            b3 = pack_bf16x2(x1.z, x1.w);
          }
          mma_bf16_16816(c[t], xa[u].x, xb[u].x, xa[u].y, xb[u].y, b0, b1);
          mma_bf16_16816(c[t], xa[u].z, xb[u].z, xa[u].w, xb[u].w, b2, b3);
        }
      }
    }
    j0 += KS * U;
    if (j0 < nsteps) load(j0);
  }

  if (warp > 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_red[warp - 1][t * 4 + e][lane] = c[t][e];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 0; w < KS - 1; ++w)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[t][e] += s_red[w][t * 4 + e][lane];

  // c[t]: (row g, x rows 2q, 2q+1) and (row g + 8, x rows 2q, 2q+1) of n-tile t.
  const bool va = ra < M;
  const bool vb = rb < M;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int br0 = nb0 + t * 8 + 2 * q;
    const int br1 = br0 + 1;
    if (p.paired) {
      if (va) {
        if (br0 < p.n) gemv_store_pair(sa, sb, br0, ra, c[t][0], c[t][2]);
        if (br1 < p.n) gemv_store_pair(sa, sb, br1, ra, c[t][1], c[t][3]);
      }
    } else {
      if (va) {
        if (br0 < p.n) gemv_store(sa, br0, ra, c[t][0]);
        if (br1 < p.n) gemv_store(sa, br1, ra, c[t][1]);
      }
      if (vb) {
        if (br0 < p.n) gemv_store(sa, br0, rb, c[t][2]);
        if (br1 < p.n) gemv_store(sa, br1, rb, c[t][3]);
      }
    }
  }
}

// ---- RoPE (+ KV write) --------------------------------------------------------------------------

/// RoPE of q ([n, hq, d]) and k ([n, hkv, d]) in place at each row's logical position, and what
/// triattn's kernels need next: q_t / k_t / v_t converted copies (T = a 16-bit cache type; fp32
/// and fp8 caches take the floats themselves, fp8 has no unscaled copy), or, with `direct`, K and
/// V written straight into the paged cache at slots[r] (vLLM slot mapping; fp8: quantised with
/// the view's scales).
template <class T>
struct RopeKvParams {
  float* q = nullptr;
  float* k = nullptr;        ///< may be null (q only)
  const float* v = nullptr;  ///< may be null (no V handling)
  int n = 0, hq = 0, hkv = 0, d = 0;
  const long long* pos = nullptr;  ///< [n] logical positions
  const double* inv64 = nullptr;   ///< [d/2] float64 ω_f
  const float* inv32 = nullptr;    ///< [d/2] llama2.c float32 frequencies
  int f32_angles = 0;
  RopeStyle style = RopeStyle::kHalf;
  T* q_t = nullptr;
  T* k_t = nullptr;
  T* v_t = nullptr;
  int direct = 0;
  KvCacheView<T, std::int32_t> view{};
  int layer = 0;
  const long long* slots = nullptr;  ///< [n] block * block_size + offset, -1 skips (direct)
};

template <class T>
__device__ __forceinline__ T* cache_slot_ptr(const KvCacheView<T, std::int32_t>& view, int layer, KvKind kind,
                                             long long slot, int head) {
  const int bs = view.block.block_size;
  return view.range(layer, kind) + view.block.offset(slot / bs, static_cast<int>(slot % bs), head);
}

template <class T>
__global__ void __launch_bounds__(256) rope_kv_kernel(const RopeKvParams<T> p) {
  pdl_trigger();
  pdl_wait();
  const int F = p.d / 2;
  const int heads = p.hq + (p.k != nullptr ? p.hkv : 0);
  const long long pairs = static_cast<long long>(p.n) * heads * F;
  const long long vals = p.v != nullptr ? static_cast<long long>(p.n) * p.hkv * p.d : 0;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < pairs) {
    const int r = static_cast<int>(idx / (static_cast<long long>(heads) * F));
    const int rem = static_cast<int>(idx - static_cast<long long>(r) * heads * F);
    const int h = rem / F;
    const int f = rem - h * F;
    const bool is_q = h < p.hq;
    const int head = is_q ? h : h - p.hq;
    const int nh = is_q ? p.hq : p.hkv;
    float* x = (is_q ? p.q : p.k) + (static_cast<long long>(r) * nh + head) * p.d;
    const int ire = p.style == RopeStyle::kInterleaved ? 2 * f : f;
    const int iim = p.style == RopeStyle::kInterleaved ? 2 * f + 1 : f + F;
    float c, s;
    if (p.f32_angles) {  // run.c: float val = pos * freq; cosf(val), sinf(val)
      const float val = static_cast<float>(static_cast<int>(p.pos[r])) * p.inv32[f];
      c = cosf(val);
      s = sinf(val);
    } else {
      const double a = static_cast<double>(p.pos[r]) * p.inv64[f];
      c = static_cast<float>(cos(a));
      s = static_cast<float>(sin(a));
    }
    const float v0 = x[ire], v1 = x[iim];
    const float re = v0 * c - v1 * s;
    const float im = v0 * s + v1 * c;
    x[ire] = re;
    x[iim] = im;
    const long long e0 = (static_cast<long long>(r) * nh + head) * p.d;
    if (is_q) {
      if constexpr (!is_scaled_v<T>) {
        if (p.q_t != nullptr) {
          p.q_t[e0 + ire] = cvt_from_f32<T>(re);
          p.q_t[e0 + iim] = cvt_from_f32<T>(im);
        }
      }
    } else {
      if constexpr (!is_scaled_v<T>) {
        if (p.k_t != nullptr) {
          p.k_t[e0 + ire] = cvt_from_f32<T>(re);
          p.k_t[e0 + iim] = cvt_from_f32<T>(im);
        }
      }
      if (p.direct) {
        const long long slot = p.slots[r];
        if (slot >= 0) {
          T* dst = cache_slot_ptr(p.view, p.layer, KvKind::kKey, slot, head);
          const float s = cache_scale(p.view, p.layer, KvKind::kKey, head);
          dst[ire] = to_cache<T>(re, s);
          dst[iim] = to_cache<T>(im, s);
        }
      }
    }
  } else if (idx < pairs + vals) {
    const long long e = idx - pairs;
    const int per_row = p.hkv * p.d;
    const int r = static_cast<int>(e / per_row);
    const int rest = static_cast<int>(e - static_cast<long long>(r) * per_row);
    const float val = p.v[e];
    if constexpr (!is_scaled_v<T>) {
      if (p.v_t != nullptr) p.v_t[e] = cvt_from_f32<T>(val);
    }
    if (p.direct) {
      const long long slot = p.slots[r];
      if (slot >= 0) {
        const int head = rest / p.d;
        cache_slot_ptr(p.view, p.layer, KvKind::kValue, slot, head)[rest % p.d] =
            to_cache<T>(val, cache_scale(p.view, p.layer, KvKind::kValue, head));
      }
    }
  }
}

/// K and V rows ([n, hkv, d] float) -> the paged cache at slots[r] (-1 skips), converted to T
/// (fp8: quantised with the view's scales).
template <class T>
__global__ void __launch_bounds__(256) write_kv_kernel(KvCacheView<T, std::int32_t> view, int layer,
                                                       const float* __restrict__ k, const float* __restrict__ v,
                                                       const long long* __restrict__ slots, int n, int hkv, int d) {
  pdl_trigger();
  pdl_wait();
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int per_row = hkv * d;
  if (idx >= static_cast<long long>(n) * per_row) return;
  const int r = static_cast<int>(idx / per_row);
  const int rest = static_cast<int>(idx - static_cast<long long>(r) * per_row);
  const long long slot = slots[r];
  if (slot < 0) return;
  const int head = rest / d;
  cache_slot_ptr(view, layer, KvKind::kKey, slot, head)[rest % d] =
      to_cache<T>(k[idx], cache_scale(view, layer, KvKind::kKey, head));
  cache_slot_ptr(view, layer, KvKind::kValue, slot, head)[rest % d] =
      to_cache<T>(v[idx], cache_scale(view, layer, KvKind::kValue, head));
}

// ---- attention over rows (prefill, or head dims without a compiled decode kernel) ---------------

inline constexpr int kAttnRowWarps = 4;
inline constexpr int kAttnMaxDimsPerLane = 8;  // head_dim <= 256

/// Row r (sequence row_seq[r]) attends, with query head h, to slots [0, row_slot[r]] of its
/// sequence through the block table (KV head h / (hq / hkv)); online softmax in fp32 with the
/// logits divided by sqrt(d) as run.c does. One warp per (row, head). out, q: [n, hq, d] float.
/// fp8 caches: each K and V element is dequantised (code * the view's scale of its layer, K|V
/// and KV head) before it is used, as the CPU backend does.
template <class T>
__global__ void __launch_bounds__(kAttnRowWarps * 32)
    attention_rows_kernel(float* __restrict__ out, const float* __restrict__ q, KvCacheView<T, std::int32_t> view,
                          int layer, int n, int hq, int hkv, int d, const int* __restrict__ row_seq,
                          const int* __restrict__ row_slot, float sqrt_d) {
  pdl_trigger();
  pdl_wait();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const long long wid = static_cast<long long>(blockIdx.x) * kAttnRowWarps + (threadIdx.x >> 5);
  if (wid >= static_cast<long long>(n) * hq) return;
  const int r = static_cast<int>(wid / hq);
  const int h = static_cast<int>(wid - static_cast<long long>(r) * hq);
  const int seq = row_seq[r];
  const int len = row_slot[r] + 1;
  const int kvh = h / (hq / hkv);
  const float* qh = q + wid * d;
  const int bs = view.block.block_size;
  const std::int32_t* table = view.block_tables + static_cast<long long>(seq) * view.max_blocks_per_seq;
  const T* kbase = view.range(layer, KvKind::kKey);
  const T* vbase = view.range(layer, KvKind::kValue);
  const float ks = cache_scale(view, layer, KvKind::kKey, kvh);
  const float vs = cache_scale(view, layer, KvKind::kValue, kvh);

  float o[kAttnMaxDimsPerLane];
#pragma unroll
  for (int j = 0; j < kAttnMaxDimsPerLane; ++j) o[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int t0 = 0; t0 < len; t0 += 32) {
    const int t = t0 + lane;
    float sc = -INFINITY;
    if (t < len) {
      const T* kp = kbase + view.block.offset(table[t / bs], t % bs, kvh);
      float dot = 0.0f;
      for (int e = 0; e < d; ++e) dot += qh[e] * from_cache(kp + e, ks);
      sc = dot / sqrt_d;
    }
    const float mnew = fmaxf(m, warp_max(sc));  // finite: token t0 < len exists
    const float corr = expf(m - mnew);
    const float pr = t < len ? expf(sc - mnew) : 0.0f;
    l = l * corr + warp_sum(pr);
#pragma unroll
    for (int j = 0; j < kAttnMaxDimsPerLane; ++j) o[j] *= corr;
    const int cnt = len - t0 < 32 ? len - t0 : 32;
    for (int jj = 0; jj < cnt; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, pr, jj);
      const int tt = t0 + jj;
      const T* vp = vbase + view.block.offset(table[tt / bs], tt % bs, kvh);
#pragma unroll
      for (int j = 0; j < kAttnMaxDimsPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < d) o[j] += pj * from_cache(vp + e, vs);
      }
    }
    m = mnew;
  }
  float* oh = out + wid * d;
#pragma unroll
  for (int j = 0; j < kAttnMaxDimsPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e < d) oh[e] = o[j] / l;
  }
}

// ---- element-wise --------------------------------------------------------------------------------

/// x[i] += y[i].
__global__ void add_kernel(float* x, const float* y, long long count) {
  pdl_trigger();
  pdl_wait();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) x[i] += y[i];
}

/// y[r, i] += b[i].
__global__ void bias_kernel(float* y, const float* __restrict__ b, long long count, int dim) {
  pdl_trigger();
  pdl_wait();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] += b[i % dim];
}

/// gate = silu(gate) * up.
__global__ void swiglu_kernel(float* gate, const float* up, long long count) {
  pdl_trigger();
  pdl_wait();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float val = gate[i];
  val *= 1.0f / (1.0f + expf(-val));
  val *= up[i];
  gate[i] = val;
}

/// dst = (T) src.
template <class T>
__global__ void convert_kernel(T* __restrict__ dst, const float* __restrict__ src, long long count) {
  pdl_trigger();
  pdl_wait();
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) dst[i] = cvt_from_f32<T>(src[i]);
}

inline constexpr int kArgmaxThreads = 256;

/// ids[r] = argmax_i logits[r, i] (the first index on ties, as run.c). Grid: [rows].
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(int* ids, const float* __restrict__ logits, int vocab) {
  __shared__ float s_v[kArgmaxThreads / 32];
  __shared__ int s_i[kArgmaxThreads / 32];
  pdl_trigger();
  pdl_wait();
  const float* row = logits + static_cast<long long>(blockIdx.x) * vocab;
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int i = static_cast<int>(threadIdx.x); i < vocab; i += kArgmaxThreads) {
    const float v = row[i];
    if (v > best) best = v, bi = i;  // ascending i per thread: keeps the first maximum
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
  }
  if ((threadIdx.x & 31) == 0) s_v[threadIdx.x >> 5] = best, s_i[threadIdx.x >> 5] = bi;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kArgmaxThreads / 32; ++w)
    if (s_v[w] > best || (s_v[w] == best && s_i[w] < bi)) best = s_v[w], bi = s_i[w];
  ids[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}

// ---- synthetic weights on the device --------------------------------------------------------------

/// out[i] = mean + synthetic_uniform(seed, tensor, i) * (√3 · std), bitwise as synthetic.hpp
/// computes it on the host (no FMA contraction), then rounded to OutT.
template <class OutT>
__global__ void synth_fill_kernel(OutT* out, unsigned long long count, unsigned long long seed, unsigned tensor,
                                  float scale /* (float)√3 * std */, float mean) {
  const std::uint64_t hs = triattn::mix64(seed ^ (static_cast<std::uint64_t>(tensor) << 56));
  for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    const std::uint64_t h = triattn::mix64(hs ^ i);
    const float u = __fsub_rn(__fmul_rn(static_cast<float>(h >> 40), 2.0f / 16777216.0f), 1.0f);
    out[i] = cvt_from_f32<OutT>(__fadd_rn(mean, __fmul_rn(u, scale)));
  }
}

}  // namespace triattn_example::gpu

// SPDX-License-Identifier: Apache-2.0
// Streaming GEMVs for bf16 weights and 1-2 activation rows: the matmuls of a batch-1 (or 2)
// decode step, which must read every weight byte once at close to the HBM read rate. They take
// the same GemvParams as gemv_warp_kernel (cuda_kernels.cuh) with every epilogue (bias,
// residual add, paired SwiGLU) and the fused RMSNorm prologue, and CudaBackend::launch_gemv picks
// them for bf16 weights and n <= 2 rows.
//
// Variants (run-time choice: CudaBackendOptions::gemv_variant, else TRIATTN_GEMV_VARIANT, else
// kGemvDefaultVariant), so one run on the device compares them:
//   0 warp         gemv_warp_kernel: one warp per output row, 8 loads in flight per lane, a
//                  grid of one CTA per 8 rows (the kernel before this file)
//   1 stream       gemv_stream_kernel, 4 rows per tile, 2 x 8 16-byte loads per thread
//                  (double-buffered: the next tile's loads are in flight during the FMAs)
//   2 stream-wide  gemv_stream_kernel, 8 rows per tile, 16 loads per thread, single buffer
//   3 bulk         gemv_bulk_kernel: 1D TMA bulk copies (cp.async.bulk) into a shared-memory
//                  ring of 16 KB stages, mbarrier completion, 3-6 stages in flight per CTA
//
// Variants 1-3 share one design. A persistent grid (multiprocessors x occupancy CTAs, each
// owning a contiguous range of row tiles, balanced to within one tile) of 256-thread CTAs.
// Split-K inside the CTA: thread t owns the 16-byte column blocks t, t + 256, t + 512, ... of
// every row, so the x values it needs are the same for every row; x (fp32, RMSNorm applied) is
// staged in shared memory once per CTA. Per tile the partial sums of TU rows are reduced with a
// butterfly reduce-scatter (one value per lane group), then across the 8 warps in a fixed order.
// Every row's arithmetic is therefore the same in variants 1-3 and for any grid: their outputs
// are bitwise equal. The weights are fetched before griddepcontrol.wait (they never depend on
// the previous kernel) with an L2 evict-first policy (read once per step).
//
// Supported: bf16 weights, 1 <= n <= 2, K a positive multiple of 8 (16-byte rows), 16-byte
// aligned weights, x rows, norm weights and norm output, n * K * 4 <= 200 KB of x in shared
// memory (bulk: plus two 16 KB stages), e.g. K <= 51,200 for n = 1. plan_gemv_bf16_small says
// why it refuses anything else; launch_gemv then falls back to gemv_warp_kernel's other paths.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda_kernels.cuh"

namespace triattn_example::gpu {

inline constexpr int kGemvVariantWarp = 0;
inline constexpr int kGemvVariantStream = 1;
inline constexpr int kGemvVariantStreamWide = 2;
inline constexpr int kGemvVariantBulk = 3;
inline constexpr int kGemvNumVariants = 4;
// H200, 2026-11-30 (git show a8ec57a:benchmarks/results/2026-11-30_gemv_vmm/bench_gemv.json):
// stream-wide streams a whole layer's weights at 3.85 TB/s (stream 3.77, bulk 3.73, warp 2.71)
// and gives the fastest batch-1 step.
inline constexpr int kGemvDefaultVariant = kGemvVariantStreamWide;

[[nodiscard]] inline const char* gemv_variant_name(int v) noexcept {
  switch (v) {
    case kGemvVariantWarp: return "warp";
    case kGemvVariantStream: return "stream";
    case kGemvVariantStreamWide: return "stream-wide";
    case kGemvVariantBulk: return "bulk";
    default: return "unknown";
  }
}

/// TRIATTN_GEMV_VARIANT (0 .. kGemvNumVariants - 1) if set, else kGemvDefaultVariant. Read once.
[[nodiscard]] inline int gemv_default_variant() {
  static const int v = [] {
    const char* s = std::getenv("TRIATTN_GEMV_VARIANT");
    if (s == nullptr || *s == '\0') return kGemvDefaultVariant;
    char* end = nullptr;
    const long x = std::strtol(s, &end, 10);
    if (end == s || *end != '\0' || x < 0 || x >= kGemvNumVariants) {
      std::fprintf(stderr, "TRIATTN_GEMV_VARIANT=%s is not a variant in [0, %d]: using %d\n", s, kGemvNumVariants - 1,
                   kGemvDefaultVariant);
      return kGemvDefaultVariant;
    }
    return static_cast<int>(x);
  }();
  return v;
}

inline constexpr int kStreamThreads = 256;
inline constexpr int kStreamWarps = kStreamThreads / 32;
static_assert(kStreamThreads == kNormThreads, "the RMSNorm prologue reduces like rmsnorm_kernel");

// ---- device helpers ---------------------------------------------------------------------------------

__device__ __forceinline__ std::uint64_t l2_evict_first_policy() {
  std::uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

/// 16 bytes of weights, no L1 allocation, L2 evict-first. volatile + memory clobber: the loads
/// stay where they are written (before griddepcontrol.wait, before the previous tile's FMAs).
__device__ __forceinline__ uint4 ld_stream_ef(const void* p, std::uint64_t pol) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(pol)
               : "memory");
  return r;
}

/// Unit (output row, or gate/up row pair) -> its segment (units of segment s start at seg[s].first).
__device__ __forceinline__ int gemv_seg_of(const GemvParams& p, int unit) {
  int s = 0;
  while (s + 1 < p.nseg && unit >= p.seg[s + 1].first) ++s;
  return s;
}

/// Weight row r (0, or 1 = the up row of a pair) of a unit.
template <int R>
__device__ __forceinline__ const __nv_bfloat16* gemv_unit_row(const GemvParams& p, int unit, int r) {
  if constexpr (R == 2) {
    return static_cast<const __nv_bfloat16*>(p.seg[r].w) + static_cast<long long>(unit) * p.K;
  } else {
    const int s = gemv_seg_of(p, unit);
    return static_cast<const __nv_bfloat16*>(p.seg[s].w) + static_cast<long long>(unit - p.seg[s].first) * p.K;
  }
}

template <int NV>
struct Log2 {
  static constexpr int value = NV == 1 ? 0 : NV == 2 ? 1 : NV == 4 ? 2 : NV == 8 ? 3 : NV == 16 ? 4 : NV == 32 ? 5 : -1;
  static_assert(value >= 0, "a power of two <= 32");
};

/// Sums each of v[0..NV) over the warp: lane l returns the total of index l >> (5 - log2 NV).
/// log2 NV halving exchanges, then plain butterflies: NV + 4 - log2 NV shuffles instead of 5 NV.
/// The pairing is warp_sum's (offsets 16, 8, 4, 2, 1, own + partner), so each total is bitwise
/// warp_sum's whatever NV is.
template <int NV>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[NV], int lane) {
  constexpr int LN = Log2<NV>::value;
#pragma unroll
  for (int k = 0; k < LN; ++k) {
    const int o = 16 >> k;
    const int h = NV >> (k + 1);
    const bool hi = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = hi ? v[i] : v[i + h];
      const float keep = hi ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float r = v[0];
#pragma unroll
  for (int o = 16 >> LN; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

/// x rows [0, NB) -> s_x ([NB, K] fp32), with the RMSNorm prologue applied when p.norm_w is set
/// (CTA 0 also writes the normalised rows to p.norm_out, as rmsnorm_kernel would, bitwise).
/// Needs x rows, norm_w and norm_out 16-byte aligned, K % 4 == 0. Ends with __syncthreads.
template <int NB>
__device__ __forceinline__ void gemv_stage_x(const GemvParams& p, float* s_x, float* s_part) {
  constexpr int kB = 8;  // float4 loads in flight per thread
  const int K = p.K;
  const int K4 = K >> 2;
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll 1
  for (int b = 0; b < NB; ++b) {
    const float4* xr = reinterpret_cast<const float4*>(gemv_x_row(p, b));
    float4* sx = reinterpret_cast<float4*>(s_x + b * K);
#pragma unroll 1
    for (int base = 0; base < K4; base += kB * kStreamThreads) {
      float4 t[kB];
#pragma unroll
      for (int u = 0; u < kB; ++u) {
        const int i = base + u * kStreamThreads + tid;
        t[u] = i < K4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kB; ++u) {
        const int i = base + u * kStreamThreads + tid;
        if (i < K4) sx[i] = t[u];
      }
    }
  }
  if (p.norm_w != nullptr) {
    __syncthreads();
    float inv[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) inv[b] = row_inv_rms(s_x + b * K, K, p.eps, s_part);  // every thread gets it
    const float4* nw = reinterpret_cast<const float4*>(p.norm_w);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      float4* sx = reinterpret_cast<float4*>(s_x + b * K);
      float4* no = blockIdx.x == 0 ? reinterpret_cast<float4*>(p.norm_out + (gemv_x_row(p, b) - p.x)) : nullptr;
#pragma unroll 1
      for (int base = 0; base < K4; base += kB * kStreamThreads) {
        float4 w[kB];
#pragma unroll
        for (int u = 0; u < kB; ++u) {
          const int i = base + u * kStreamThreads + tid;
          w[u] = i < K4 ? __ldg(nw + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kB; ++u) {
          const int i = base + u * kStreamThreads + tid;
          if (i < K4) {
            float4 v = sx[i];  // this thread's own element: no barrier needed since row_inv_rms's last one
            v.x = w[u].x * (inv[b] * v.x);  // rmsnorm_kernel's expression, element by element
            v.y = w[u].y * (inv[b] * v.y);
            v.z = w[u].z * (inv[b] * v.z);
            v.w = w[u].w * (inv[b] * v.w);
            sx[i] = v;
            if (no != nullptr) no[i] = v;
          }
        }
      }
    }
  }
  __syncthreads();
}

/// acc[tu][r][b] += W block (16 bytes = 8 columns, cb-th block of the row) · x block, for the
/// TU units of a tile; w: the blocks as loaded (registers or shared memory). Same order in every
/// variant: blocks in increasing cb, columns 0..7 within a block.
template <int NB, int R, int TU>
__device__ __forceinline__ void gemv_fma_block(float (&acc)[TU][R][NB], const uint4 (&w)[TU][R], const float* s_x, int K,
                                               int cb) {
  float xv[NB][8];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const float4* xp = reinterpret_cast<const float4*>(s_x + b * K) + 2 * cb;
    const float4 a = xp[0], c = xp[1];
    xv[b][0] = a.x, xv[b][1] = a.y, xv[b][2] = a.z, xv[b][3] = a.w;
    xv[b][4] = c.x, xv[b][5] = c.y, xv[b][6] = c.z, xv[b][7] = c.w;
  }
#pragma unroll
  for (int tu = 0; tu < TU; ++tu)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float wf[8];
      unpack16(w[tu][r], wf);
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[tu][r][b] = fmaf(wf[j], xv[b][j], acc[tu][r][b]);
    }
}

/// End of a tile: CTA-wide sums of acc (zeroed afterwards) and the epilogue of its units.
/// Contains a __syncthreads (s_red is double-buffered by `buf` so one barrier per tile suffices).
template <int NB, int R, int TU>
__device__ __forceinline__ void gemv_finish_tile(const GemvParams& p, float (&acc)[TU][R][NB],
                                                 float (*s_red)[kStreamWarps][TU * R * NB], int& buf, int tile) {
  constexpr int NV = TU * R * NB;
  constexpr int LN = Log2<NV>::value;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  float v[NV];
#pragma unroll
  for (int tu = 0; tu < TU; ++tu)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        v[(tu * R + r) * NB + b] = acc[tu][r][b];
        acc[tu][r][b] = 0.0f;
      }
  const float red = warp_reduce_scatter<NV>(v, lane);
  if ((lane & ((32 >> LN) - 1)) == 0) s_red[buf][warp][lane >> (5 - LN)] = red;
  __syncthreads();
  if (tid < TU * NB) {
    const int tu = tid / NB;
    const int b = tid - tu * NB;
    const int unit = tile * TU + tu;
    if (unit < p.units) {
      float tot[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int idx = (tu * R + r) * NB + b;
        float t = s_red[buf][0][idx];
#pragma unroll
        for (int w = 1; w < kStreamWarps; ++w) t += s_red[buf][w][idx];
        tot[r] = t;
      }
      if constexpr (R == 2) {
        gemv_store_pair(p.seg[0], p.seg[1], b, unit, tot[0], tot[1]);
      } else {
        const int s = gemv_seg_of(p, unit);
        gemv_store(p.seg[s], b, unit - p.seg[s].first, tot[0]);
      }
    }
  }
  buf ^= 1;
}

// ---- variants 1 and 2: 16-byte loads into registers --------------------------------------------------

/// (tile, k-step) -> the next one; a tile has KS k-steps.
__device__ __forceinline__ void gemv_next_step(int& tile, int& ks, int KS) {
  if (++ks == KS) {
    ks = 0;
    ++tile;
  }
}

/// Weight blocks of (tile, k-step ks): TU units x R rows x UK blocks.
template <int R, int TU, int UK>
__device__ __forceinline__ void gemv_stream_load(uint4 (&w)[UK][TU][R], const GemvParams& p, int tile, int ks, int K8,
                                                 std::uint64_t pol) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int tu = 0; tu < TU; ++tu) {
    const int unit = tile * TU + tu;
    const bool ok = unit < p.units;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const __nv_bfloat16* row = ok ? gemv_unit_row<R>(p, unit, r) : nullptr;
#pragma unroll
      for (int uk = 0; uk < UK; ++uk) {
        const int cb = (ks * UK + uk) * kStreamThreads + tid;
        w[uk][tu][r] = ok && cb < K8 ? ld_stream_ef(row + static_cast<long long>(cb) * 8, pol) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

template <int NB, int R, int TU, int UK>
__device__ __forceinline__ void gemv_stream_compute(float (&acc)[TU][R][NB], const uint4 (&w)[UK][TU][R], const float* s_x,
                                                    int K, int K8, int ks) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int uk = 0; uk < UK; ++uk) {
    const int cb = (ks * UK + uk) * kStreamThreads + tid;
    if (cb < K8) gemv_fma_block<NB, R, TU>(acc, w[uk], s_x, K, cb);
  }
}

/// Variants 1 (DB: two register buffers, the loads of step s + 2 go out while step s + 1's are
/// in flight) and 2 (one buffer, latency hidden by the other warps). NB: x rows (= n), R: rows
/// per unit (2 = paired SwiGLU), TU: units per tile, UK: 16-byte blocks per thread and row per
/// step. Grid: [CTAs], kStreamThreads; dynamic shared memory NB * K floats.
template <int NB, int R, int TU, int UK, bool DB>
__global__ void __launch_bounds__(kStreamThreads, 2) gemv_stream_kernel(const __grid_constant__ GemvParams p) {
  constexpr int NV = TU * R * NB;
  extern __shared__ float4 s_stream_dyn[];
  __shared__ float s_part[kNormThreads / 32];
  __shared__ float s_red[2][kStreamWarps][NV];
  pdl_trigger();
  float* s_x = reinterpret_cast<float*>(s_stream_dyn);
  const int K = p.K;
  const int K8 = K >> 3;
  const int KS = (K8 + kStreamThreads * UK - 1) / (kStreamThreads * UK);
  const long long tiles = (p.units + TU - 1) / TU;
  const int t0 = static_cast<int>(static_cast<long long>(blockIdx.x) * tiles / gridDim.x);
  const int t1 = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * tiles / gridDim.x);
  const std::uint64_t pol = l2_evict_first_policy();

  uint4 wa[UK][TU][R], wb[UK][TU][R];
  int lt = t0, lk = 0;  // the next (tile, k-step) to load
  if (lt < t1) {
    gemv_stream_load<R, TU, UK>(wa, p, lt, lk, K8, pol);
    gemv_next_step(lt, lk, KS);
  }
  if (DB && lt < t1) {
    gemv_stream_load<R, TU, UK>(wb, p, lt, lk, K8, pol);
    gemv_next_step(lt, lk, KS);
  }
  pdl_wait();
  gemv_stage_x<NB>(p, s_x, s_part);

  float acc[TU][R][NB];
#pragma unroll
  for (int tu = 0; tu < TU; ++tu)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < NB; ++b) acc[tu][r][b] = 0.0f;
  int buf = 0;
  int ct = t0, ck = 0;  // the (tile, k-step) computed
#pragma unroll 1
  while (ct < t1) {
    gemv_stream_compute<NB, R, TU, UK>(acc, wa, s_x, K, K8, ck);
    if (lt < t1) {  // in flight across the reduction and the other buffer's FMAs
      gemv_stream_load<R, TU, UK>(wa, p, lt, lk, K8, pol);
      gemv_next_step(lt, lk, KS);
    }
    if (ck == KS - 1) gemv_finish_tile<NB, R, TU>(p, acc, s_red, buf, ct);
    gemv_next_step(ct, ck, KS);
    if constexpr (DB) {
      if (ct >= t1) break;
      gemv_stream_compute<NB, R, TU, UK>(acc, wb, s_x, K, K8, ck);
      if (lt < t1) {
        gemv_stream_load<R, TU, UK>(wb, p, lt, lk, K8, pol);
        gemv_next_step(lt, lk, KS);
      }
      if (ck == KS - 1) gemv_finish_tile<NB, R, TU>(p, acc, s_red, buf, ct);
      gemv_next_step(ct, ck, KS);
    }
  }
}

// ---- variant 3: TMA bulk copies into a shared-memory ring ------------------------------------------

inline constexpr int kBulkCols = 8 * kStreamThreads;  // columns of a row per stage: one block per thread
inline constexpr int kBulkRowBytes = kBulkCols * 2;
inline constexpr int kBulkMaxStages = 8;

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}
/// bytes (a multiple of 16) from global src to shared dst, completing on bar; L2 policy pol.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                              std::uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol)
      : "memory");
}

/// Thread 0: the stage of (tile, k-step ks) = columns [ks * kBulkCols, +kBulkCols) of the tile's
/// rows, into ring slot `slot`.
template <int R, int TU>
__device__ __forceinline__ void gemv_bulk_issue(const GemvParams& p, unsigned char* ring, unsigned long long* bars, int tile,
                                                int ks, int slot, std::uint64_t pol) {
  constexpr int kStageBytes = TU * R * kBulkRowBytes;
  const int col0 = ks * kBulkCols;
  const int cols = p.K - col0 < kBulkCols ? p.K - col0 : kBulkCols;
  const unsigned bytes = static_cast<unsigned>(cols) * 2u;
  int rows = 0;
#pragma unroll
  for (int tu = 0; tu < TU; ++tu) rows += tile * TU + tu < p.units ? R : 0;
  // The slot was last read through the generic proxy (all threads passed a barrier since).
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_arrive_expect_tx(bars + slot, bytes * static_cast<unsigned>(rows));
  unsigned char* dst = ring + static_cast<std::size_t>(slot) * kStageBytes;
#pragma unroll
  for (int tu = 0; tu < TU; ++tu) {
    const int unit = tile * TU + tu;
    if (unit >= p.units) break;
#pragma unroll
    for (int r = 0; r < R; ++r)
      bulk_copy_g2s(dst + (tu * R + r) * kBulkRowBytes, gemv_unit_row<R>(p, unit, r) + col0, bytes, bars + slot, pol);
  }
}

/// Variant 3. Dynamic shared memory: S stages of TU * R * kBulkRowBytes, then NB * K floats of x
/// (S = (dynamic bytes - x bytes) / stage bytes, at most kBulkMaxStages; the planner makes it >= 2).
/// Thread 0 keeps S - 1 stages in flight; every step ends with a CTA barrier, after which the
/// slot just read is refilled.
template <int NB, int R, int TU>
__global__ void __launch_bounds__(kStreamThreads, 1) gemv_bulk_kernel(const __grid_constant__ GemvParams p) {
  constexpr int NV = TU * R * NB;
  constexpr int kStageBytes = TU * R * kBulkRowBytes;
  extern __shared__ __align__(128) unsigned char s_bulk_dyn[];
  __shared__ alignas(8) unsigned long long s_bar[kBulkMaxStages];
  __shared__ float s_part[kNormThreads / 32];
  __shared__ float s_red[2][kStreamWarps][NV];
  pdl_trigger();
  const int tid = static_cast<int>(threadIdx.x);
  const int K = p.K;
  const int K8 = K >> 3;
  const int x_bytes = NB * K * 4;
  int S = (static_cast<int>(dynamic_smem_bytes()) - x_bytes) / kStageBytes;
  S = S < kBulkMaxStages ? S : kBulkMaxStages;
  float* s_x = reinterpret_cast<float*>(s_bulk_dyn + static_cast<std::size_t>(S) * kStageBytes);
  const int KS = (K + kBulkCols - 1) / kBulkCols;
  const long long tiles = (p.units + TU - 1) / TU;
  const int t0 = static_cast<int>(static_cast<long long>(blockIdx.x) * tiles / gridDim.x);
  const int t1 = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * tiles / gridDim.x);
  std::uint64_t pol = 0;
  if (tid == 0) {
    pol = l2_evict_first_policy();
    for (int i = 0; i < S; ++i) mbar_init(s_bar + i, 1);
    mbar_fence_init();
  }
  __syncthreads();
  int it = t0, ik = 0, islot = 0;  // thread 0: the next (tile, k-step) to fetch and its slot
  if (tid == 0)
    for (int i = 0; i < S - 1 && it < t1; ++i) {
      gemv_bulk_issue<R, TU>(p, s_bulk_dyn, s_bar, it, ik, islot, pol);
      gemv_next_step(it, ik, KS);
      islot = islot + 1 == S ? 0 : islot + 1;
    }
  pdl_wait();
  gemv_stage_x<NB>(p, s_x, s_part);

  float acc[TU][R][NB];
#pragma unroll
  for (int tu = 0; tu < TU; ++tu)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < NB; ++b) acc[tu][r][b] = 0.0f;
  int buf = 0;
  int ct = t0, ck = 0, slot = 0;  // the (tile, k-step) computed and its slot
  unsigned parity = 0;             // phase parity of the slot's barrier: flips each time round the ring
#pragma unroll 1
  while (ct < t1) {
    if (tid == 0 && it < t1) {  // into the slot read one step ago (every thread passed a barrier since)
      gemv_bulk_issue<R, TU>(p, s_bulk_dyn, s_bar, it, ik, islot, pol);
      gemv_next_step(it, ik, KS);
      islot = islot + 1 == S ? 0 : islot + 1;
    }
    mbar_wait(s_bar + slot, parity);
    const int cb = ck * kStreamThreads + tid;
    if (cb < K8) {
      const uint4* st = reinterpret_cast<const uint4*>(s_bulk_dyn + static_cast<std::size_t>(slot) * kStageBytes);
      uint4 w[TU][R];
#pragma unroll
      for (int tu = 0; tu < TU; ++tu)
#pragma unroll
        for (int r = 0; r < R; ++r)  // slots of units past the end hold stale bytes: zeros instead
          w[tu][r] = ct * TU + tu < p.units ? st[(tu * R + r) * (kBulkCols / 8) + tid] : make_uint4(0u, 0u, 0u, 0u);
      gemv_fma_block<NB, R, TU>(acc, w, s_x, K, cb);
    }
    if (ck == KS - 1) gemv_finish_tile<NB, R, TU>(p, acc, s_red, buf, ct);
    else __syncthreads();
    gemv_next_step(ct, ck, KS);
    if (++slot == S) {
      slot = 0;
      parity ^= 1u;
    }
  }
}

// ---- host: planning and launching -------------------------------------------------------------------

using GemvKernelFn = void (*)(GemvParams);

/// A planned launch: kernel, grid, block, dynamic shared memory and the completed parameters.
struct GemvLaunch {
  GemvKernelFn kernel = nullptr;
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  std::size_t smem = 0;
  GemvParams p{};
  int variant = 0;
};

inline constexpr int kBulkSmemTarget = 108 * 1024;  // dynamic bytes per CTA that leave room for two per SM
inline constexpr int kSmemLimit = 200 * 1024;       // below the 227 KB opt-in maximum, static smem included

namespace detail {

inline bool aligned16(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <int NB, int R>
GemvKernelFn small_gemv_kernel(int variant) {
  constexpr int TU1 = R == 2 ? 2 : 4;  // 4 weight rows per tile
  constexpr int TU2 = R == 2 ? 4 : 8;  // 8 weight rows per tile
  switch (variant) {
    case kGemvVariantStream: return gemv_stream_kernel<NB, R, TU1, 2, true>;
    case kGemvVariantStreamWide: return gemv_stream_kernel<NB, R, TU2, 2, false>;
    case kGemvVariantBulk: return gemv_bulk_kernel<NB, R, TU1>;
    default: return gemv_warp_kernel<__nv_bfloat16, NB, R, true>;
  }
}

}  // namespace detail

/// Units per tile of a variant (R = 2 when paired).
[[nodiscard]] inline int gemv_tile_units(int variant, int R) noexcept {
  if (variant == kGemvVariantStreamWide) return 8 / R;
  return 4 / R;
}

/// Plans a bf16 GEMV of 1-2 x rows with `variant` on a device with `sms` multiprocessors (the
/// current device; the occupancy query runs there). p: as for gemv_warp_kernel, units and
/// segment starts are filled in here. Returns "" and fills *out, or the reason it cannot.
[[nodiscard]] inline std::string plan_gemv_bf16_small(GemvParams p, int variant, int sms, GemvLaunch* out) {
  if (variant < 0 || variant >= kGemvNumVariants)
    return "GEMV variant " + std::to_string(variant) + " does not exist (0.." + std::to_string(kGemvNumVariants - 1) + ")";
  if (p.n < 1 || p.n > 2) return "n = " + std::to_string(p.n) + " x rows: the small-batch GEMV takes 1 or 2";
  if (p.nseg < 1 || p.nseg > kMaxGemvSegs) return "nseg = " + std::to_string(p.nseg) + " matrices (1.." + std::to_string(kMaxGemvSegs) + ")";
  if (p.K <= 0 || p.K % 8 != 0)
    return "K = " + std::to_string(p.K) + ": needs a positive multiple of 8 (16-byte bf16 rows)";
  if (p.paired && (p.nseg != 2 || p.seg[0].M != p.seg[1].M)) return "paired SwiGLU needs 2 matrices of equal M";
  for (int s = 0; s < p.nseg; ++s) {
    if (p.seg[s].M <= 0) return "matrix " + std::to_string(s) + " has M = " + std::to_string(p.seg[s].M);
    if (p.seg[s].w == nullptr || !detail::aligned16(p.seg[s].w)) return "weights of matrix " + std::to_string(s) + " not 16-byte aligned";
    if (p.seg[s].out == nullptr) return "matrix " + std::to_string(s) + " has no output";
  }
  if (p.x == nullptr || !detail::aligned16(p.x) || (p.x_rows == nullptr && p.x_stride % 4 != 0))
    return "x rows must be 16-byte aligned (x_stride a multiple of 4 floats)";
  if (p.norm_w != nullptr && (!detail::aligned16(p.norm_w) || p.norm_out == nullptr || !detail::aligned16(p.norm_out)))
    return "RMSNorm weights and output must be 16-byte aligned";
  const int R = p.paired ? 2 : 1;
  const int NB = p.n;
  long long units = 0;
  for (int s = 0; s < p.nseg; ++s) {
    p.seg[s].first = static_cast<int>(units);
    if (!p.paired || s == 0) units += p.seg[s].M;
  }
  if (p.paired) p.seg[1].first = 0;
  if (units >= (1LL << 30)) return "too many output rows";
  p.units = static_cast<int>(units);

  GemvKernelFn k = nullptr;
  if (NB == 1) k = R == 1 ? detail::small_gemv_kernel<1, 1>(variant) : detail::small_gemv_kernel<1, 2>(variant);
  else k = R == 1 ? detail::small_gemv_kernel<2, 1>(variant) : detail::small_gemv_kernel<2, 2>(variant);
  GemvLaunch l;
  l.kernel = k;
  l.variant = variant;
  l.block = dim3(kStreamThreads);
  if (variant == kGemvVariantWarp) {  // exactly CudaBackend::launch_gemv's warp-kernel launch
    static_assert(kGemvWarpThreads == kStreamThreads);
    l.grid = dim3(static_cast<unsigned>((units + kGemvWarpThreads / 32 - 1) / (kGemvWarpThreads / 32)), 1);
    l.smem = 0;
    l.p = p;
    *out = l;
    return {};
  }
  const long long x_bytes = static_cast<long long>(NB) * p.K * 4;
  if (variant == kGemvVariantBulk) {
    const long long stage = static_cast<long long>(gemv_tile_units(variant, R)) * R * kBulkRowBytes;
    long long S = (kBulkSmemTarget - x_bytes) / stage;  // two CTAs per SM
    if (S < 2) S = (kSmemLimit - x_bytes) / stage;      // else one
    if (S < 2) return "K = " + std::to_string(p.K) + " with n = " + std::to_string(NB) + ": x and two stages exceed shared memory";
    if (S > kBulkMaxStages) S = kBulkMaxStages;
    l.smem = static_cast<std::size_t>(S * stage + x_bytes);
  } else {
    if (x_bytes > kSmemLimit)
      return "K = " + std::to_string(p.K) + " with n = " + std::to_string(NB) + ": x does not fit in shared memory";
    l.smem = static_cast<std::size_t>(x_bytes);
  }
  // The opt-in limit is set to the device's maximum, the same for every shape: a lower value set
  // for one shape would break a captured launch of another shape of the same kernel.
  int dev = 0, optin = 0, occ = 0;
  cudaFuncAttributes fa{};
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, k);
  const long long max_dyn = static_cast<long long>(optin) - static_cast<long long>(fa.sharedSizeBytes);
  if (e == cudaSuccess && static_cast<long long>(l.smem) > max_dyn)
    return std::to_string(l.smem) + " bytes of shared memory (x and stages) exceed the device's " + std::to_string(max_dyn);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_dyn));
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, kStreamThreads, l.smem);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("CUDA refused the launch setup: ") + cudaGetErrorString(e);
  }
  if (occ < 1) return "the kernel does not fit on a multiprocessor with " + std::to_string(l.smem) + " bytes of shared memory";
  const long long tu = gemv_tile_units(variant, R);
  const long long tiles = (units + tu - 1) / tu;
  const long long gmax = static_cast<long long>(sms > 0 ? sms : 1) * occ;
  const long long per = (tiles + gmax - 1) / gmax;  // tiles of the busiest CTA
  l.grid = dim3(static_cast<unsigned>((tiles + per - 1) / per));  // fewest CTAs with that maximum
  l.p = p;
  *out = l;
  return {};
}

/// Launches a planned GEMV on `stream`, with programmatic dependent launch when `pdl` (falling
/// back to a plain launch where the stream refuses it).
inline cudaError_t launch_gemv_planned(const GemvLaunch& l, cudaStream_t stream, bool pdl) {
  return triattn::cuda::launch_kernel(l.kernel, l.grid, l.block, l.smem, stream, pdl, l.p);
}

}  // namespace triattn_example::gpu

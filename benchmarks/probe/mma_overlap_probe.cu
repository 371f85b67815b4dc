// SPDX-License-Identifier: Apache-2.0
// Does a warpgroup's chain of register-A warpgroup MMAs overlap the CUDA-core work of the same
// warps? The pipelined max scorer issues, per 32-key warp slice, two chains of 16
// m64n72k16 RS MMAs (bf16 weights in two terms) and computes each m-tile's norm term Σ_f c_f·|K_f|
// on the CUDA cores (unpack, two FMAs, MUFU.SQRT, four FMAs per pair and row) while the other
// m-tile's chain runs. Timing experiments put the chains' in-kernel cost near 1.5x their rate here
// (wgmma_rate_probe: 36-37.5 cycles per m64n72k16 at two warpgroups per SM). This probe gives each
// of a CTA's two warpgroups a role (Role below: MMA chains alone, the norm term alone, both
// overlapped or in turn, the scorer's order, the same with A from shared memory) at the scorer's
// occupancy (one CTA of 8 warps per SM) and prints each warpgroup's cycles per group of 16 MMAs.
// If `overlap` is near max(chain, norm), the two overlap; near their sum, they take turns on the
// SM sub-partitions (register-file ports, issue slots), and the norm term cannot hide under the
// products as the scorer intends. The split rows (one warpgroup multiplies, the other computes
// norms) say whether putting the two in different warpgroups overlaps them instead.
// H200, 2026-12-04 (git show a8ec57a:benchmarks/results/2026-12-04_session20/README.md): they add
// in every arrangement; with MMAs running, the other warps' FMAs, roots and loads issue at about
// half their rate.
// Standalone: nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a -O3 -I../../include
//             mma_overlap_probe.cu -o mma_overlap_probe && ./mma_overlap_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include <triattn/cuda/kernels/wgmma.cuh>

#include "probe_check.cuh"

namespace {

/// What one warpgroup does per group (the CTA has two; each has a role).
enum class Role {
  kIdle,       // nothing (the other warpgroup alone)
  kChain,      // 16 RS MMAs, then wait (the tensor pipe alone)
  kNorm,       // one m-tile's norm term (32 pair norms a thread: 16 pairs x 2 rows, c from shared memory)
  kOverlap,    // 16 RS MMAs, the norm term, then wait (the norm under the chain)
  kSerial,     // 16 RS MMAs, wait, then the norm term (no overlap, for reference)
  kScorer,     // the scorer's order per slice, two groups: chain 0, norm 1, chain 1, wait 1, norm 0, wait 0
  kSsChain,    // 16 SS MMAs (A from shared memory, 128-byte swizzle), then wait
  kSsOverlap,  // 16 SS MMAs, the norm term, then wait
  kNormRegs,   // the norm term's arithmetic on registers only (no shared-memory loads or stores)
  kFfmaOnly,   // its FMAs alone (6 per pair norm: the squares and the 4 heads), no MUFU, no loads
  kMufuOnly,   // its MUFU.SQRT alone (one per pair norm, each summed with one add), no loads
};
constexpr const char* name(Role r) {
  switch (r) {
    case Role::kIdle: return "idle";
    case Role::kChain: return "chain";
    case Role::kNorm: return "norm";
    case Role::kOverlap: return "overlap";
    case Role::kSerial: return "serial";
    case Role::kScorer: return "scorer";
    case Role::kSsChain: return "ss-chain";
    case Role::kSsOverlap: return "ss-overlap";
    case Role::kNormRegs: return "norm-regs";
    case Role::kFfmaOnly: return "ffma-only";
    case Role::kMufuOnly: return "mufu-only";
  }
  return "?";
}

constexpr int kChain = 16;        // MMAs per committed group (one m-tile: 8 k-steps x 2 weight terms)
constexpr int kWords = 32;        // bf16-pair words a thread holds per m-tile (16 pairs x 2 rows, re + im)
constexpr int kCBytes = 64 * 16;  // c as float4 per pair (4 heads)
constexpr int kBBytes = 72 * 32 * 8;  // B: 72 rows x 32 B per k-step, 8 k-steps
constexpr int kABytes = 8192;         // A for the SS roles: 64 rows x 128 B, swizzled atoms
constexpr int kFragBytes = 8 * kWords * 32 * 4;
constexpr int kOutBytes = 8 * 256 * 4;
constexpr int kSmem = kABytes + kBBytes + kFragBytes + kCBytes + kOutBytes;

#ifdef TRIATTN_WGMMA_ENABLED
/// The norm term's arithmetic over a thread's 16 pairs x 2 rows into acc[row][head], as the scorer
/// computes it (unpack, two FMAs, MUFU.SQRT, four FMAs per pair and row): word(i, re) gives
/// fragment word i (as a real or an imaginary part), coef(p) the float4 c of pair p. kR picks all
/// of it (kNorm, kNormRegs), only its FMAs (kFfmaOnly) or only its roots, each summed with one
/// add (kMufuOnly).
template <Role kR, class Word, class Coef>
__device__ __forceinline__ void pair_norms(float (&acc)[2][4], Word&& word, Coef&& coef) {
#pragma unroll
  for (int p = 0; p < 16; ++p) {
    const float4 c = coef(p);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const std::uint32_t re_w = word(p + 16 * q, true), im_w = word((p + 8) % 16 + 16 * q, false);
      const float re = __uint_as_float(re_w << 16), im = __uint_as_float(im_w & 0xffff0000u);
      float n;
      if constexpr (kR == Role::kFfmaOnly) {
        n = fmaf(re, re, fmaf(im, im, 1e-8f));
      } else if constexpr (kR == Role::kMufuOnly) {
        asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(n) : "f"(re));
        acc[q][p & 3] += n;
        continue;
      } else {
        asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(n) : "f"(fmaf(re, re, fmaf(im, im, 1e-8f))));
      }
      acc[q][0] = fmaf(c.x, n, acc[q][0]);
      acc[q][1] = fmaf(c.y, n, acc[q][1]);
      acc[q][2] = fmaf(c.z, n, acc[q][2]);
      acc[q][3] = fmaf(c.w, n, acc[q][3]);
    }
  }
}

/// One m-tile's norm term as the scorer computes it: the thread's kWords fragment words are
/// loaded from shared memory (as ldmatrix would deliver them) and c comes from shared memory; the
/// 8 sums go back to shared memory so that the work stays between the asm statements around it
/// (loads and stores do not cross them).
__device__ __forceinline__ void norm_work(const std::uint32_t* words, const float4* c_s, float* out, int lane) {
  std::uint32_t w[kWords];
#pragma unroll
  for (int i = 0; i < kWords; i += 4) {
    const uint4 v = reinterpret_cast<const uint4*>(words)[(i / 4) * 32 + lane];
    w[i] = v.x;
    w[i + 1] = v.y;
    w[i + 2] = v.z;
    w[i + 3] = v.w;
  }
  float acc[2][4] = {};
  pair_norms<Role::kNorm>(
      acc, [&](int i, bool) { return w[i]; }, [&](int p) { return c_s[(p * 4 + (lane & 3)) & 63]; });
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int h = 0; h < 4; ++h) out[(q * 4 + h) * 256 + threadIdx.x] = acc[q][h];
}

/// The norm term's arithmetic (or only its FMAs / only its roots) on registers: the real parts
/// are mixed with the group index so that nothing is loop-invariant; the sums are folded into
/// `keep`.
template <Role kR>
__device__ __forceinline__ void register_work(const std::uint32_t (&w0)[kWords], const float4 (&c)[4], int g,
                                              float& keep) {
  float acc[2][4] = {};
  pair_norms<kR>(
      acc, [&](int i, bool re) { return re ? w0[i] ^ static_cast<std::uint32_t>(g) : w0[i]; },
      [&](int p) { return c[p & 3]; });
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int h = 0; h < 4; ++h) keep += acc[q][h];
}

/// `groups` groups of role kR by one warpgroup; returns its clock cycles.
template <Role kR>
__device__ __forceinline__ long long run_role(int groups, std::uint32_t base, const std::uint32_t* words,
                                              const float4* c_s, float* out, float (&d)[2][36]) {
  using namespace triattn::cuda::detail;
  constexpr int N = 72;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::uint32_t a[4] = {0x3c003c01u + threadIdx.x, 0x3c013c00u, 0x3bff3c00u, 0x3c003bffu};
  const std::uint64_t a_desc = wgmma_desc_kmajor_sw128(base, 1024u);
  const std::uint64_t b_desc = wgmma_desc_kmajor(base + kABytes, 128u, 256u);
  const auto chain = [&](int t) {
#pragma unroll
    for (int s = 0; s < kChain; ++s) {
      const std::uint64_t b = wgmma_desc_advance(b_desc, static_cast<std::uint32_t>((s & 7) * N * 32));
      if constexpr (kR == Role::kSsChain || kR == Role::kSsOverlap)
        wgmma_m64n72k16_ss<false>(d[t], wgmma_desc_advance(a_desc, static_cast<std::uint32_t>((s & 3) * 32)), b, 1);
      else
        wgmma_m64n72k16_rs<false>(d[t], a, b, 1);
    }
    wgmma_commit();
  };
  const auto norm = [&] { norm_work(words, c_s, out, lane); };
  std::uint32_t w0[kWords];
  float4 c[4];
#pragma unroll
  for (int i = 0; i < kWords; ++i) w0[i] = words[i * 32 + lane];
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] = c_s[i * 4 + (lane & 3)];
  float keep = 0.0f;
  const long long t0 = clock64();
  for (int g = 0; g < groups; ++g) {
    if constexpr (kR == Role::kNormRegs || kR == Role::kFfmaOnly || kR == Role::kMufuOnly) {
      register_work<kR>(w0, c, g, keep);
    } else if constexpr (kR == Role::kNorm) {
      norm();
      __syncwarp();
    } else if constexpr (kR == Role::kScorer) {
      wgmma_fence();
      chain(0);
      norm();
      wgmma_fence();
      chain(1);
      wgmma_wait<1>();
      norm();
      wgmma_wait<0>();
    } else if constexpr (kR != Role::kIdle) {
      wgmma_fence();
      chain(0);
      if constexpr (kR == Role::kOverlap || kR == Role::kSsOverlap) norm();
      wgmma_wait<0>();
      if constexpr (kR == Role::kSerial) norm();
    }
  }
  const long long t1 = clock64();
  if (keep == 12345.0f) out[threadIdx.x] = keep;  // keeps the register work live
  return t1 - t0;
}
#endif

/// Warpgroup 0 runs role kR0 and warpgroup 1 role kR1 for `groups` groups each; warp 0 and warp 4
/// of CTA 0 write their warpgroup's cycles.
template <Role kR0, Role kR1>
__global__ void __launch_bounds__(256, 1) overlap_kernel(int groups, float* sink, long long* cycles) {
#ifdef TRIATTN_WGMMA_ENABLED
  using namespace triattn::cuda::detail;
  extern __shared__ __align__(1024) unsigned char smem[];
  const auto base = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  auto* frag = reinterpret_cast<std::uint32_t*>(smem + kABytes + kBBytes);
  auto* c_s = reinterpret_cast<float4*>(smem + kABytes + kBBytes + kFragBytes);
  auto* out = reinterpret_cast<float*>(smem + kABytes + kBBytes + kFragBytes + kCBytes);
  for (int i = static_cast<int>(threadIdx.x); i < kSmem / 4; i += static_cast<int>(blockDim.x))
    reinterpret_cast<std::uint32_t*>(smem)[i] =
        0x3c003c00u ^ (static_cast<std::uint32_t>(i) * 2654435761u & 0x00ff00ffu);  // bf16 pairs near 1
  fence_proxy_async_smem();
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const std::uint32_t* my_words = frag + warp * kWords * 32;
  float d[2][36] = {};
  const long long c = warp < 4 ? run_role<kR0>(groups, base, my_words, c_s, out, d)
                               : run_role<kR1>(groups, base, my_words, c_s, out, d);
  float sum = out[threadIdx.x];
  for (int t = 0; t < 2; ++t)
    for (int v = 0; v < 36; ++v) sum += d[t][v];
  if (sum == 12345.0f) sink[0] = sum;  // keeps the products live
  if (blockIdx.x == 0 && (threadIdx.x & 127) == 0) cycles[threadIdx.x >> 7] = c;
#else
  (void)groups;
  (void)sink;
  (void)cycles;
#endif
}

template <Role kR0, Role kR1>
int run(int sms, float* sink, long long* cyc) {
  const int groups = 2000;
  auto k = overlap_kernel<kR0, kR1>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  k<<<sms, 256, kSmem>>>(10, sink, cyc);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  k<<<sms, 256, kSmem>>>(groups, sink, cyc);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  long long c[2] = {};
  CHECK(cudaMemcpy(c, cyc, sizeof(c), cudaMemcpyDeviceToHost));
  // cycles per group of 16 MMAs (the scorer role does two chains per group)
  const auto per = [&](Role r, long long x) {
    return static_cast<double>(x) / groups / (r == Role::kScorer ? 2 : 1);
  };
  std::printf("wg0 %-10s %7.1f | wg1 %-10s %7.1f  cycles per 16-MMA group\n", name(kR0), per(kR0, c[0]), name(kR1),
              per(kR1, c[1]));
  return 0;
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  ProbeOutputs out;
  CHECK(out.allocate(2));
  float* const sink = out.sink;
  long long* const cyc = out.cycles;
  using R = Role;
  for (int rep = 0; rep < 2; ++rep) {
    // both warpgroups in one role (the scorer's shape)
    if (run<R::kChain, R::kChain>(sms, sink, cyc) || run<R::kNorm, R::kNorm>(sms, sink, cyc) ||
        run<R::kOverlap, R::kOverlap>(sms, sink, cyc) || run<R::kSerial, R::kSerial>(sms, sink, cyc) ||
        run<R::kScorer, R::kScorer>(sms, sink, cyc) || run<R::kSsChain, R::kSsChain>(sms, sink, cyc) ||
        run<R::kSsOverlap, R::kSsOverlap>(sms, sink, cyc))
      return 1;
    // one warpgroup alone, and split roles (one warpgroup multiplies, the other computes norms)
    if (run<R::kChain, R::kIdle>(sms, sink, cyc) || run<R::kIdle, R::kNorm>(sms, sink, cyc) ||
        run<R::kChain, R::kNorm>(sms, sink, cyc) || run<R::kSsChain, R::kNorm>(sms, sink, cyc) ||
        run<R::kOverlap, R::kIdle>(sms, sink, cyc))
      return 1;
    // which part of the norm term contends with the MMAs: register-only arithmetic, FMAs, roots
    if (run<R::kIdle, R::kNormRegs>(sms, sink, cyc) || run<R::kChain, R::kNormRegs>(sms, sink, cyc) ||
        run<R::kIdle, R::kFfmaOnly>(sms, sink, cyc) || run<R::kChain, R::kFfmaOnly>(sms, sink, cyc) ||
        run<R::kIdle, R::kMufuOnly>(sms, sink, cyc) || run<R::kChain, R::kMufuOnly>(sms, sink, cyc) ||
        run<R::kSsChain, R::kFfmaOnly>(sms, sink, cyc))
      return 1;
  }
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// Warpgroup-MMA rate on this GPU: cycles per wgmma.mma_async step of the shapes the max scorers
// issue, through the library's own wrappers (include/triattn/cuda/kernels/wgmma.cuh): m64n72k16
// with A from registers (RS, the pipelined scorer) or shared memory (SS, 128-byte swizzle, the
// warp-specialized scorer's one-chain variant) and m64n144k16 SS (its two-term variant), bf16 in,
// fp32 accumulators, B K-major without swizzle as the scorers' weight tiles; 1 or 2 warpgroups per
// SM, chains of 16 MMAs (one 64-key tile: 8 k-steps x 2 weight terms) each waited for, as in the
// scorers. The probe's first version (957ef16, in git history) also
// timed m64n144k16 RS and m64n256k16 with its own PTX.
// Standalone: nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a -O3 -I../../include
//             wgmma_rate_probe.cu -o wgmma_probe && ./wgmma_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include <triattn/cuda/kernels/wgmma.cuh>

#include "probe_check.cuh"

namespace {

enum class Shape { kN72Rs, kN72Ss, kN144Ss };
__host__ __device__ constexpr int columns(Shape s) { return s == Shape::kN144Ss ? 144 : 72; }
constexpr const char* name(Shape s) {
  return s == Shape::kN72Rs ? "m64n72k16 RS" : s == Shape::kN72Ss ? "m64n72k16 SS" : "m64n144k16 SS";
}

constexpr int kChain = 16;  // MMAs per committed group

// `groups` chains of kChain MMAs per warpgroup, each waited for; thread 0 of each CTA writes its
// elapsed clock cycles.
template <Shape kShape>
__global__ void __launch_bounds__(256, 1) rate_kernel(int groups, float* sink, long long* cycles) {
#ifdef TRIATTN_WGMMA_ENABLED
  using namespace triattn::cuda::detail;
  constexpr int N = columns(kShape);
  extern __shared__ __align__(1024) unsigned char smem[];
  const auto base = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  // A: 8 KB (64 rows x 128 B, swizzled atoms); B: N rows x 32 B per k-step, 8 k-steps
  for (int i = static_cast<int>(threadIdx.x); i < (8192 + N * 32 * 8) / 4; i += static_cast<int>(blockDim.x))
    reinterpret_cast<std::uint32_t*>(smem)[i] =
        0x3c003c00u ^ (static_cast<std::uint32_t>(i) * 2654435761u & 0x00ff00ffu);  // bf16 pairs near 1
  fence_proxy_async_smem();
  __syncthreads();
  float d[2][36] = {};  // N = 144 uses both sets, N = 72 the first
  const std::uint32_t a[4] = {0x3c003c01u + threadIdx.x, 0x3c013c00u, 0x3bff3c00u, 0x3c003bffu};
  const std::uint64_t b_desc = wgmma_desc_kmajor(base + 8192, 128u, 256u);
  const std::uint64_t a_desc = wgmma_desc_kmajor_sw128(base, 1024u);
  const long long t0 = clock64();
  for (int g = 0; g < groups; ++g) {
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kChain; ++s) {
      const std::uint64_t b = wgmma_desc_advance(b_desc, static_cast<std::uint32_t>((s & 7) * N * 32));
      if constexpr (kShape == Shape::kN72Rs)
        wgmma_m64n72k16_rs<false>(d[0], a, b, 1);
      else if constexpr (kShape == Shape::kN72Ss)
        wgmma_m64n72k16_ss<false>(d[0], wgmma_desc_advance(a_desc, static_cast<std::uint32_t>((s & 3) * 32)), b, 1);
      else
        wgmma_m64n144k16_ss<false>(d, wgmma_desc_advance(a_desc, static_cast<std::uint32_t>((s & 3) * 32)), b, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
  const long long t1 = clock64();
  float sum = 0.0f;
  for (int c = 0; c < 2; ++c)
    for (int v = 0; v < 36; ++v) sum += d[c][v];
  if (sum == 12345.0f) sink[0] = sum;  // keeps the products live
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
#else
  (void)groups;
  (void)sink;
  (void)cycles;
#endif
}

template <Shape kShape>
int run(int sms, int wgs, float* sink, long long* cyc) {
  constexpr int N = columns(kShape);
  const int groups = 2000;
  const int smem = 1024 + 8192 + N * 32 * 8;
  auto k = rate_kernel<kShape>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k<<<sms, 128 * wgs, smem>>>(10, sink, cyc);  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  k<<<sms, 128 * wgs, smem>>>(groups, sink, cyc);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  long long c0 = 0;
  CHECK(cudaMemcpy(&c0, cyc, sizeof(c0), cudaMemcpyDeviceToHost));
  const double mmas_per_sm = static_cast<double>(groups) * kChain * wgs;
  const double flops = mmas_per_sm * sms * 64.0 * N * 16 * 2;
  std::printf("%s, warpgroups/SM=%d: %.1f cycles per wgmma per SM (CTA 0 clock), %.0f TFLOPS, %.1f us\n",
              name(kShape), wgs, static_cast<double>(c0) / mmas_per_sm, flops / (ms * 1e-3) / 1e12, ms * 1e3);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 0;
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  ProbeOutputs out;
  CHECK(out.allocate(sms));
  float* const sink = out.sink;
  long long* const cyc = out.cycles;
  for (int wgs : {1, 2})
    if (run<Shape::kN72Rs>(sms, wgs, sink, cyc) || run<Shape::kN72Ss>(sms, wgs, sink, cyc) ||
        run<Shape::kN144Ss>(sms, wgs, sink, cyc))
      return 1;
  return 0;
}

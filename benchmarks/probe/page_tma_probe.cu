// SPDX-License-Identifier: Apache-2.0
// Probe: can page-granular bulk copies (TMA) stream a paged K cache faster than the ring
// scorers' 16-byte cp.async per chunk? One 32K-token layer as BM_score reads it (8 KV heads x
// 32,768 tokens x d = 128 bf16, pages of 16 tokens, blocks shuffled, four sequences rotated so
// that every launch reads from HBM, each launch queued behind a 30 µs spin so that its launch is
// hidden), streamed by
//   - tensor/nhd/128: one cp.async.bulk.tensor per (page, head) over an NHD cache, box
//     {128 dims, 1 head, 16 tokens, 1 block} (4 KB, unswizzled);
//   - tensor/nhd/2x64: two per (page, head), box {64 dims, ...} with the 128-byte swizzle (the
//     layout an ldmatrix consumer needs without bank conflicts);
//   - bulk/hnd: one cp.async.bulk per (page, head) over an HND cache (its 4 KB are contiguous);
// into a per-CTA ring of 4 KB stages (one producer warp, kConsumers consumer warps that XOR the
// stage into a checksum and hand it back on an empty mbarrier), and compared with a plain
// 16-byte streaming read of the same number of bytes. The checksums are compared with the CPU's.
// Standalone: nvcc -std=c++20 -arch=sm_90 -O3 -I../../include page_tma_probe.cu -o page_tma_probe && ./page_tma_probe
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <triattn/cuda/kernels/score_kernel.cuh>

#include "probe_check.cuh"

namespace {

constexpr int kHkv = 8, kD = 128, kPage = 16, kTokens = 32768, kSeqs = 4;
constexpr int kPagesPerSeq = kTokens / kPage;                     // 2,048
constexpr int kBlocks = kSeqs * kPagesPerSeq;                     // 8,192
constexpr std::size_t kBlockBytes = std::size_t(kPage) * kHkv * kD * 2;  // 32 KB
constexpr int kStageBytes = kPage * kD * 2;                       // one (page, head): 4 KB
constexpr int kItems = kHkv * kPagesPerSeq;                       // (head, page) items per launch

using triattn::cuda::detail::mbar_arrive;  // the ring scorers' mbarrier primitives
using triattn::cuda::detail::mbar_init;
using triattn::cuda::detail::mbar_wait;
using triattn::cuda::detail::smem_addr;
__device__ __forceinline__ void bar_expect_tx(std::uint32_t bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

enum Mode { kTensor128 = 0, kTensor2x64 = 1, kBulkHnd = 2 };

/// items [begin, end) of (head, page) in row-major order; table: [kSeqs][kPagesPerSeq] block ids
/// (the launch's sequence `seq`); out[blockIdx.x]: the CTA's checksum.
template <int kMode, int kStages, int kConsumers>
__global__ void __launch_bounds__(32 * (kConsumers + 1)) page_stream(const __grid_constant__ CUtensorMap tmap,
                                                                    const std::uint16_t* __restrict__ hnd,
                                                                    const int* __restrict__ table, int seq,
                                                                    unsigned* __restrict__ out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[2 * kStages];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int per = (kItems + gridDim.x - 1) / gridDim.x;
  const int begin = min(kItems, per * static_cast<int>(blockIdx.x)), end = min(kItems, begin + per);
  const std::uint32_t full0 = smem_addr(bars), empty0 = full0 + 8 * kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const std::uint32_t ring = smem_addr(smem);
  const int* tab = table + seq * kPagesPerSeq;
  if (warp == 0) {
    const std::uint64_t policy = triattn::cuda::detail::l2_stream_policy();
    // lane j holds the block of item base + j, loaded one batch of 32 ahead
    int next = begin + lane < end ? tab[(begin + lane) % kPagesPerSeq] : 0;
    for (int base = begin; base < end; base += 32) {
      const int cur = next;
      next = base + 32 + lane < end ? tab[(base + 32 + lane) % kPagesPerSeq] : 0;
      const int n = min(32, end - base);
      for (int j = 0; j < n; ++j) {
        const int blk = __shfl_sync(0xffffffffu, cur, j);
        if (lane == 0) {
          const int k = base + j - begin, s = k % kStages;
          if (k >= kStages) mbar_wait(empty0 + 8 * s, ((k / kStages) - 1) & 1);
          const std::uint32_t full = full0 + 8 * s, dst = ring + s * kStageBytes;
          const int head = (base + j) / kPagesPerSeq;
          bar_expect_tx(full, kStageBytes);
          if constexpr (kMode == kBulkHnd) {
            const std::uint16_t* src = hnd + (static_cast<std::size_t>(blk) * kHkv + head) * kPage * kD;
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
                "%4;" ::"r"(dst),
                "l"(src), "r"(kStageBytes), "r"(full), "l"(policy)
                : "memory");
          } else {
            constexpr int kParts = kMode == kTensor128 ? 1 : 2;
#pragma unroll
            for (int p = 0; p < kParts; ++p)
              asm volatile(
                  "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                  " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(dst + p * (kStageBytes / kParts)),
                  "l"(reinterpret_cast<std::uint64_t>(&tmap)), "r"(p * (kD / kParts)), "r"(head), "r"(0), "r"(blk),
                  "r"(full), "l"(policy)
                  : "memory");
          }
        }
      }
    }
  } else {
    unsigned acc = 0;
    const int t = threadIdx.x - 32;
    for (int k = 0; k < end - begin; ++k) {
      const int s = k % kStages;
      mbar_wait(full0 + 8 * s, (k / kStages) & 1);
      const uint4* st = reinterpret_cast<const uint4*>(smem + s * kStageBytes);
      for (int i = t; i < kStageBytes / 16; i += 32 * kConsumers) {
        const uint4 v = st[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * s);
    }
    acc = __reduce_xor_sync(0xffffffffu, acc);
    if (lane == 0) atomicXor(out + blockIdx.x, acc);
  }
}

__global__ void plain_read(const uint4* __restrict__ p, std::size_t n, unsigned* out) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((threadIdx.x & 31) == 0) atomicXor(out + blockIdx.x, acc);
}

__global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

template <class Launch>
double median_us(Launch&& launch, int iters = 24) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int it = 0; it < iters + 4; ++it) {
    spin<<<1, 1>>>(30000);
    cudaEventRecord(a);
    launch(it % kSeqs);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float m = 0;
    cudaEventElapsedTime(&m, a, b);
    if (it >= 4) ms.push_back(m);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2];
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);

  // Host data: NHD cache [block][page][head][d] and its HND twin [block][head][page][d].
  const std::size_t elems = kBlockBytes / 2 * kBlocks;
  std::vector<std::uint16_t> nhd(elems), hnd(elems);
  std::mt19937 rng(7);
  for (auto& x : nhd) x = static_cast<std::uint16_t>(rng());
  for (int b = 0; b < kBlocks; ++b)
    for (int p = 0; p < kPage; ++p)
      for (int h = 0; h < kHkv; ++h)
        for (int d = 0; d < kD; ++d)
          hnd[((std::size_t(b) * kHkv + h) * kPage + p) * kD + d] = nhd[((std::size_t(b) * kPage + p) * kHkv + h) * kD + d];
  std::vector<int> table(kBlocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  // The checksum of a sequence's whole layer (XOR is order-free): what every streamer must get.
  std::vector<unsigned> expect(kSeqs, 0);
  for (int s = 0; s < kSeqs; ++s)
    for (int p = 0; p < kPagesPerSeq; ++p) {
      const unsigned* w = reinterpret_cast<const unsigned*>(nhd.data() + std::size_t(table[s * kPagesPerSeq + p]) * kBlockBytes / 2);
      for (std::size_t i = 0; i < kBlockBytes / 4; ++i) expect[s] ^= w[i];
    }

  std::uint16_t *d_nhd, *d_hnd;
  int* d_table;
  unsigned* d_out;
  const int max_ctas = sms * 8;
  CHECK(cudaMalloc(&d_nhd, elems * 2));
  CHECK(cudaMalloc(&d_hnd, elems * 2));
  CHECK(cudaMalloc(&d_table, kBlocks * sizeof(int)));
  CHECK(cudaMalloc(&d_out, max_ctas * sizeof(unsigned)));
  CHECK(cudaMemcpy(d_nhd, nhd.data(), elems * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_hnd, hnd.data(), elems * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_table, table.data(), kBlocks * sizeof(int), cudaMemcpyHostToDevice));

  CUtensorMap maps[2];
  for (int m = 0; m < 2; ++m) {
    const cuuint64_t dims[4] = {kD, kHkv, kPage, kBlocks};
    const cuuint64_t strides[3] = {kD * 2, kHkv * kD * 2, kBlockBytes};
    const cuuint32_t box[4] = {m == 0 ? 128u : 64u, 1, kPage, 1};
    const cuuint32_t estr[4] = {1, 1, 1, 1};
    const CUresult r = encode(&maps[m], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, d_nhd, dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE,
                              m == 0 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      std::printf("cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
      return 1;
    }
  }

  const double mb = double(kItems) * kStageBytes / 1e6;
  int failures = 0;
  const auto check = [&](const char* name, int ctas, int seq) {
    std::vector<unsigned> o(ctas);
    cudaMemcpy(o.data(), d_out, ctas * sizeof(unsigned), cudaMemcpyDeviceToHost);
    unsigned x = 0;
    for (unsigned v : o) x ^= v;
    if (x != expect[seq]) {
      std::printf("%s: checksum %08x, expected %08x\n", name, x, expect[seq]);
      ++failures;
    }
  };
  {
    // plain read: sequence s's share of the same number of bytes, contiguous
    const std::size_t n = std::size_t(kItems) * kStageBytes / 16;
    const int ctas = sms * 8;
    const double us = median_us([&](int s) {
      plain_read<<<ctas, 512>>>(reinterpret_cast<const uint4*>(d_nhd) + s * n, n, d_out);
    });
    std::printf("plain read             %7.2f us  %6.0f GB/s\n", us, mb * 1e3 / us);
  }
  const auto run = [&](auto kernel, const char* name, int mode, int stages, int consumers, int ctas_per_sm) {
    const int ctas = sms * ctas_per_sm;
    const int smem = stages * kStageBytes;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
      std::printf("%s: smem %d refused\n", name, smem);
      ++failures;
      return;
    }
    const CUtensorMap& tm = maps[mode == kTensor2x64 ? 1 : 0];
    const double us = median_us([&](int s) {
      kernel<<<ctas, 32 * (consumers + 1), smem>>>(tm, d_hnd, d_table, s, d_out);
    });
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      std::printf("%s: %s\n", name, cudaGetErrorString(e));
      ++failures;
      return;
    }
    cudaMemset(d_out, 0, ctas * sizeof(unsigned));
    kernel<<<ctas, 32 * (consumers + 1), smem>>>(tm, d_hnd, d_table, 1, d_out);
    cudaDeviceSynchronize();
    check(name, ctas, 1);
    std::printf("%-14s st%2d c%d x%d %7.2f us  %6.0f GB/s\n", name, stages, consumers, ctas_per_sm, us, mb * 1e3 / us);
  };
#define RUN(mode, st, c, x) run(page_stream<mode, st, c>, #mode, mode, st, c, x)
  RUN(kTensor128, 8, 4, 2);
  RUN(kTensor128, 12, 4, 2);
  RUN(kTensor128, 16, 4, 2);
  RUN(kTensor128, 24, 4, 2);
  RUN(kTensor128, 8, 4, 4);
  RUN(kTensor128, 12, 4, 4);
  RUN(kTensor128, 16, 4, 1);
  RUN(kTensor128, 32, 4, 1);
  RUN(kTensor2x64, 8, 4, 2);
  RUN(kTensor2x64, 16, 4, 2);
  RUN(kTensor2x64, 24, 4, 2);
  RUN(kTensor2x64, 12, 4, 4);
  RUN(kBulkHnd, 8, 4, 2);
  RUN(kBulkHnd, 16, 4, 2);
  RUN(kBulkHnd, 12, 4, 4);
#undef RUN
  std::printf("%s\n", failures == 0 ? "all checksums match" : "FAILURES");
  return failures == 0 ? 0 : 1;
}

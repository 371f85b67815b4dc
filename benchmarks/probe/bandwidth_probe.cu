// SPDX-License-Identifier: Apache-2.0
// Measures the two memory ceilings the performance targets refer to: device-to-device copy
// (bytes read + written) and a pure streaming read (16-byte loads, reduced to one value).
// Standalone: nvcc -std=c++20 -arch=sm_90 -O3 bandwidth_probe.cu -o probe && ./probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_check.cuh"

__global__ void read_kernel(const int4* __restrict__ p, size_t n, int* out) {
  int acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    int4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *out = acc;  // keeps the loads alive
}

int main() {
  const size_t bytes = size_t(4) << 30;  // 4 GiB, far beyond the 50 MB L2
  void *a, *b;
  int* out;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMalloc(&out, 4));
  CHECK(cudaMemset(a, 1, bytes));
  cudaEvent_t s, e;
  cudaEventCreate(&s);
  cudaEventCreate(&e);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::vector<float> copy_ms, read_ms;
  for (int it = 0; it < 12; ++it) {
    cudaEventRecord(s);
    CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    float ms;
    cudaEventElapsedTime(&ms, s, e);
    if (it >= 2) copy_ms.push_back(ms);
    cudaEventRecord(s);
    read_kernel<<<sms * 8, 512>>>(static_cast<const int4*>(a), bytes / 16, out);
    cudaEventRecord(e);
    CHECK(cudaEventSynchronize(e));
    cudaEventElapsedTime(&ms, s, e);
    if (it >= 2) read_ms.push_back(ms);
  }
  std::sort(copy_ms.begin(), copy_ms.end());
  std::sort(read_ms.begin(), read_ms.end());
  const double cm = copy_ms[copy_ms.size() / 2], rm = read_ms[read_ms.size() / 2];
  std::printf("copy (read+write): %.0f GB/s (median of %zu, %.3f ms for 2x%zu MiB)\n", 2.0 * bytes / cm / 1e6,
              copy_ms.size(), cm, bytes >> 20);
  std::printf("read: %.0f GB/s (median %.3f ms)\n", bytes / rm / 1e6, rm);
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// Device kernels of the tensor-parallel reference transformer (tensor_parallel.hpp):
//   synth_fill_shard_kernel  one rank's shard of a synthetic tensor, generated in place on the
//                            rank's GPU with the values of the full tensor (synthetic.hpp's
//                            counter-based generator at the full tensor's indices), so a rank
//                            never needs the whole model in memory
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_kernels.cuh"

namespace triattn_example::gpu {

/// Which elements of a full tensor a shard holds: `rows` runs of `cols` consecutive elements,
/// run i starting at full index base + i * stride. Shard element k = full element
/// base + (k / cols) * stride + k % cols. The whole tensor: rows 1, cols n, base 0.
struct ShardMap {
  unsigned long long rows = 1;
  unsigned long long cols = 0;
  unsigned long long stride = 0;
  unsigned long long base = 0;
  [[nodiscard]] __host__ __device__ unsigned long long count() const { return rows * cols; }
};

/// out[k] = the synthetic value of full element map(k) (see synth_fill_kernel), rounded to OutT.
/// @param out [map.count()]
template <class OutT>
__global__ void synth_fill_shard_kernel(OutT* out, ShardMap map, unsigned long long seed, unsigned tensor,
                                        float scale /* (float)√3 * std */, float mean) {
  const std::uint64_t hs = triattn::mix64(seed ^ (static_cast<std::uint64_t>(tensor) << 56));
  const unsigned long long n = map.count();
  for (unsigned long long k = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    const unsigned long long i = map.base + (k / map.cols) * map.stride + k % map.cols;
    const std::uint64_t h = triattn::mix64(hs ^ i);
    const float u = __fsub_rn(__fmul_rn(static_cast<float>(h >> 40), 2.0f / 16777216.0f), 1.0f);
    out[k] = cvt_from_f32<OutT>(__fadd_rn(mean, __fmul_rn(u, scale)));
  }
}

}  // namespace triattn_example::gpu

// SPDX-License-Identifier: Apache-2.0
// Union selection split for tensor parallelism: the per-rank part leaves two small per-slot
// buffers that ranks combine with an element-wise max, so the agreement moves batch·max_len·5
// bytes per round instead of the [batch, L, max_len] reduced scores.
//   union_layer_max_kernel  vmax[b, t] = max_l reduced[b, l, t] on the selectable slots (the same
//                           comparison order as select_kernel's plane loop, so the select on vmax
//                           ranks exactly like the select on `reduced`), and zeroes flags and vmax
//                           everywhere else, so every byte an all-reduce reads is defined.
#pragma once

#include <cstdint>

#include <triattn/core/config.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/kernels/normalize_kernel.cuh>

namespace triattn::cuda {

/// Grid (ceil(max_len / Tune::kUnionThreads), batch); one thread per slot (Tune: the Select policy).
/// @param reduced [batch, L, max_len] union output of gqa_reduce (max over query heads of Ŝ)
/// @param flags   [batch, max_len] candidate flags from the kFlags select; zeroed off the selectable range
/// @param vmax    [batch, max_len] output: max over layers on the selectable range, 0 elsewhere
template <class Id, class Tune>
__global__ void __launch_bounds__(Tune::kUnionThreads)
    union_layer_max_kernel(const float* __restrict__ reduced, std::uint8_t* __restrict__ flags,
                           float* __restrict__ vmax, RoundSeqs<Id> seqs, SelectionParams p, int L) {
  const int b = blockIdx.y;
  const int t = blockIdx.x * Tune::kUnionThreads + threadIdx.x;
  const long long T = seqs.max_len;
  if (t >= T) return;
  const KeepCounts kc = seqs.counts(b, p);
  const long long o = static_cast<long long>(b) * T + t;
  if (kc.identity || t < kc.selectable_begin || t >= kc.selectable_end) {
    flags[o] = 0;
    vmax[o] = 0.0f;
    return;
  }
  const float* x = reduced + static_cast<long long>(b) * L * T + t;
  float v = x[0];
  for (int l = 1; l < L; ++l) {
    const float w = x[static_cast<long long>(l) * T];
    v = v < w ? w : v;
  }
  vmax[o] = v;
}

}  // namespace triattn::cuda

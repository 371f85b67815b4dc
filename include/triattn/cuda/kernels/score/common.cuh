// SPDX-License-Identifier: Apache-2.0
// Device helpers every TriAttention scoring kernel shares: the key-pair norm and the float64 RoPE
// phase (see score_kernel.cuh for the kernels and their work decomposition).
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/math/score_math.hpp>
#include <triattn/core/math/score_model.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device/async_copy.cuh>
#include <triattn/cuda/device/fast_div.cuh>
#include <triattn/cuda/device/item_walk.cuh>
#include <triattn/cuda/device/loads.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/score_model_view.cuh>
#include <triattn/cuda/types.cuh>

namespace triattn::cuda {

namespace detail {

/// |K_f| = sqrt(sq) for sq = re² + im² + 1e-8 >= 1e-8 (a normal float): one MUFU.SQRT. sqrtf
/// adds a denormal fix-up (a compare, a scale and two selects per pair) that cannot trigger here,
/// and sq · rsqrt(sq) one more multiply; the MUFU result is within ~2 ulp, far inside the 1e-5
/// budget.
__device__ __forceinline__ float pair_norm(float sq) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(sq));
  return r;
}

/// cos and sin of the float64 RoPE phase of position t at frequency omega (the phase fold_weight()
/// uses), with one range reduction for both (sincos; within an ulp of separate cos and sin, and
/// the same on every call, so scores stay deterministic).
__device__ __forceinline__ void rope_cos_sin(long long t, double omega, double& cs, double& sn) {
  ::sincos(rope_phase(t, omega), &sn, &cs);
}

}  // namespace detail

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// What a scoring launch reads: the per-model constants (ScoreModelView) and the batch (ScoreBatch).
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn::cuda {

/// Per-model scoring constants in device memory (uploaded once, e.g. by
/// TriAttentionDeviceScorer). Everything float64 except c_f, which the reference also rounds to
/// float before use. Trivially copyable: kernels take it by value.
struct ScoreModelView {
  const double* q_re = nullptr;      ///< [L, Hq, F] Re q̄_f
  const double* q_im = nullptr;      ///< [L, Hq, F] Im q̄_f
  const float* c = nullptr;          ///< [L, Hq, F] c_f = s²(A_f − |q̄_f|) (or s²A_f), rounded to float
  const double* omega = nullptr;     ///< [F] ω_f
  const double* cmean_re = nullptr;  ///< [F] Re C_f = mean_δ cos(δω_f)
  const double* cmean_im = nullptr;  ///< [F] Im C_f
  const double* offsets = nullptr;   ///< [num_offsets] δ ∈ D (whole numbers stored as double)
  /// [num_offsets, F] cos / sin of δ·ω_f, optional: with them the max scorers form the phase
  /// (t0 + δ)·ω_f by angle addition from F sincos per sequence instead of |D|·F.
  const double* offset_cos = nullptr;
  const double* offset_sin = nullptr;
  double s2 = 1.0;                   ///< s² = α²
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int num_offsets = 0;
  RopeStyle style = RopeStyle::kHalf;
  Aggregation aggregation = Aggregation::kMean;
  bool disable_trig = false;
  double max_abs_weight = 0.0;       ///< s²·max|q̄_f| >= every |W_f(δ)| (range check of the fp16 MMA path)
};
static_assert(std::is_trivially_copyable_v<ScoreModelView>);

/// What one scoring launch covers: a batch of sequences of one view.
struct ScoreBatch {
  const std::int32_t* seq_ids = nullptr;  ///< [batch] device: sequence slots (block-table rows)
  const std::int64_t* t0 = nullptr;       ///< [batch] device: round start (logical position) per sequence
  int batch = 0;
  int max_len = 0;  ///< score-row capacity; every sequence's physical length must be <= max_len
};
static_assert(std::is_trivially_copyable_v<ScoreBatch>);

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// Oracle of the GPU selection kernels: the host selection (core/selection.hpp), under the names
// tests compare against. Production code includes core/selection.hpp, never this folder.
#pragma once

#include <triattn/core/selection.hpp>

namespace triattn::ref {

using triattn::KeepCounts;
using selection::keep_counts;
using selection::mean_over_layers;
using selection::normalize_scores;
using selection::reduce_gqa_max;
using selection::select_keep;
using selection::selectable_scores_finite;
using selection::top_k_with_ties;
using selection::union_candidates;
using selection::union_finish;

}  // namespace triattn::ref

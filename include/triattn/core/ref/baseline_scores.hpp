// SPDX-License-Identifier: Apache-2.0
// Oracle of the CUDA baseline scorers: the host baseline scores (core/baseline_scores.hpp), under
// the names tests compare against. Production code includes core/baseline_scores.hpp.
#pragma once

#include <triattn/core/baseline_scores.hpp>

namespace triattn::ref {

using baseline::key_l2_norm;
using baseline::key_norm_scores;
using baseline::max_pool_same;
using baseline::random_score;
using baseline::random_score_hash;
using baseline::random_scores;
using baseline::recency_scores;
using baseline::snapkv_scores;
using baseline::snapkv_window_attention;

}  // namespace triattn::ref

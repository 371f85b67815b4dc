// SPDX-License-Identifier: Apache-2.0
// Umbrella header of the host-only core (g++ alone compiles it; never includes a CUDA header):
// KvCache, its configuration and policies, the scorers, the CPU reference (triattn::ref) and the
// host side of engine integration (engine/: view builders, checks, the engine-layout round).
// Include on demand, they cost compile time most programs need not pay:
//   <triattn/core/stats.hpp>                          statistics files (load, write, calibrate)
//   <triattn/core/policy/tensor_parallel_selector.hpp> tensor parallelism (with core/tp/*.hpp)
//   <triattn/core/vmm/vmm_allocator_core.hpp>         the VMM allocator's host logic
#pragma once

#include <triattn/core/admission.hpp>
#include <triattn/core/block_pool.hpp>
#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/layout.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/key_norm_scorer.hpp>
#include <triattn/core/policy/no_scorer.hpp>
#include <triattn/core/policy/random_scorer.hpp>
#include <triattn/core/policy/recency_scorer.hpp>
#include <triattn/core/policy/snapkv_scorer.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/ref/attention.hpp>
#include <triattn/core/ref/baseline_scores.hpp>
#include <triattn/core/ref/compact.hpp>
#include <triattn/core/ref/score.hpp>
#include <triattn/core/ref/select.hpp>
#include <triattn/core/rope.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/trigger.hpp>
#include <triattn/engine/layouts.hpp>
#include <triattn/engine/paged_round.hpp>
#include <triattn/engine/prefix_protection.hpp>
#include <triattn/engine/view_checks.hpp>

// SPDX-License-Identifier: Apache-2.0
// Umbrella header of the host-only core (g++ alone compiles it; never includes a CUDA header).
#pragma once

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
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/ref/compact.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/query_stats.hpp>

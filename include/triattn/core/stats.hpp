// SPDX-License-Identifier: Apache-2.0
// Umbrella for TriAttention query statistics: the QueryStats type, loaders for TriAttention's
// `.pt` files and triattn's native safetensors format, a `.pt` writer, tensor-parallel slicing,
// the streaming Calibrator and the per-layer concentration summary. Host-only, standard library
// only.
#pragma once

#include <triattn/core/stats/query_stats.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/zip_reader.hpp>
#include <triattn/core/stats/pickle_reader.hpp>
#include <triattn/core/stats/json.hpp>
#include <triattn/core/stats/pt_loader.hpp>
#include <triattn/core/stats/pt_writer.hpp>
#include <triattn/core/stats/safetensors.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/core/stats/calibrator.hpp>
#include <triattn/core/stats/summary.hpp>
#include <triattn/core/stats/random.hpp>

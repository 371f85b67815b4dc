// SPDX-License-Identifier: Apache-2.0
// Umbrella header of the CUDA layer (includes the host-only core).
#pragma once

#include <triattn/triattn.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/types.cuh>

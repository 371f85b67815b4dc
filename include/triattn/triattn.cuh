// SPDX-License-Identifier: Apache-2.0
// Umbrella header of the CUDA layer (includes the host-only core).
#pragma once

#include <triattn/triattn.hpp>
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/algorithms/compact.cuh>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/algorithms/decode_attention.cuh>
#include <triattn/cuda/algorithms/key_norm.cuh>
#include <triattn/cuda/algorithms/normalize.cuh>
#include <triattn/cuda/algorithms/score.cuh>
#include <triattn/cuda/algorithms/select.cuh>
#include <triattn/cuda/algorithms/snapkv.cuh>
#include <triattn/cuda/backend/device_backend.cuh>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/device_tables.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/driver.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/append_kernel.cuh>
#include <triattn/cuda/kernels/compact_kernel.cuh>
#include <triattn/cuda/kernels/decode_attention_kernel.cuh>
#include <triattn/cuda/kernels/key_norm_kernel.cuh>
#include <triattn/cuda/kernels/normalize_kernel.cuh>
#include <triattn/cuda/kernels/score_kernel.cuh>
#include <triattn/cuda/kernels/select_kernel.cuh>
#include <triattn/cuda/kernels/snapkv_kernel.cuh>
#include <triattn/cuda/kernels/union_agreement_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>
#include <triattn/cuda/tp/nccl_communicator.cuh>
#include <triattn/cuda/tp/nccl_union_agreement.cuh>
#include <triattn/cuda/tuning/sm90.cuh>
#include <triattn/cuda/types.cuh>

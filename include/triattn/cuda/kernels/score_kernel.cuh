// SPDX-License-Identifier: Apache-2.0
// TriAttention key-scoring kernels (spec §3). One pass over the paged K cache per (sequence,
// layer, KV head): every key is read once with 16-byte loads and scored for all G query heads of
// its KV head at once (a [T×d]·[d×G] product plus an F-long norm term).
//
//   mean aggregation (or disable_trig): the exact fold, score = Σ_f W_re·k_re + W_im·k_im
//                                        + Σ_f c_f·sqrt(k_re² + k_im² + 1e-8)
//                                        (score_mean_kernel: CUDA cores, bound by reading K)
//   max aggregation:                     |D| folds (one per offset δ), max over δ: a
//                                        [T×d]·[d×|D|·G] product, on the tensor cores for 16-bit
//                                        caches (score_max_mma_kernel), else CUDA cores
//                                        (score_max_kernel, ~4.5x the K read time in FMAs)
//   16-bit caches, ring kernels:         score_mean_mma_kernel (mean dot products on the tensor
//                                        cores) and score_max_mma_pipe_kernel; keys stream
//                                        through per-warp cp.async rings (KeySliceFeed)
//   fp8 caches:                          the CUDA-core kernels, keys widened and multiplied by
//                                        their K scale in registers (pair_of)
//
// All kernels accumulate in fp32 in a fixed order: the same inputs give bitwise the same scores
// (what CUDA-graph replays and the round's determinism rely on).
//
// The per-round weights are computed on the device from per-model constants (ScoreModelView) and
// the round start t0 read from device memory, with core's TRIATTN_HOST_DEVICE helpers
// (rope_phase, fold_weight_from_phase): a round needs no host work and no host-to-device copy, so
// it can be captured in a CUDA graph.
//
// Work decomposition: a "row" is (sequence b, layer l, KV head g, head chunk hc); rows are cut
// into tiles of kTile keys; each CTA takes a contiguous range of (row, tile) items, so it
// recomputes the weights only when its row changes (usually once or twice per CTA).
// Lane mapping (CUDA-core kernels): a group of LPK lanes owns one key; lane i of the group owns
// the P consecutive frequency pairs [i·P, (i+1)·P), i.e. whole complex pairs in both RoPE pairings, loaded with
// 16-byte (8-byte for GMAX = 8, 16-bit types, half pairing; 4 or 8 bytes for fp8) loads. Partial sums of the GMAX heads
// are combined across the group with a reduce-scatter (log2(LPK) shuffle steps, GMAX−1 shuffles
// for HD 64, GMAX for HD 128), after which each lane holds the score of one head.
//
// Files (kernels/score/): common.cuh (pair norm, RoPE phase), mma_fragments.cuh (tensor-core
// fragments), key_ring.cuh (the ring kernels' shared key rings, row inputs and compute cursor),
// mean_mma_kernel.cuh and max_mma_pipe_kernel.cuh (the production ring kernels),
// fallback_kernels.cuh (CUDA-core and non-ring tensor-core scorers).
#pragma once

#include <triattn/cuda/kernels/score/fallback_kernels.cuh>
#include <triattn/cuda/kernels/score/max_mma_pipe_kernel.cuh>
#include <triattn/cuda/kernels/score/mean_mma_kernel.cuh>

// SPDX-License-Identifier: Apache-2.0
// Tuning values for Hopper (sm_90): constexpr aggregates, CUB ReducePolicy style. Launchers and
// kernels read them; they are never KvCache template parameters.
// NOTE: the values are first choices from the bandwidth arithmetic in the comments; replace each
// comment with the H200 measurement that confirms or changes it.
#pragma once

namespace triattn::cuda::tuning::sm90 {

/// Append: each thread moves kVecsPerThread 16-byte vectors of K and of V, loads first. 256
/// threads * 4 * 2 * 16 B = 32 KB of loads in flight per CTA, and 4x fewer (short-lived) CTAs
/// than one vector per thread for a 36-layer prefill (CTA turnover stays off the critical path).
struct Append {
  static constexpr int kThreads = 256;
  static constexpr int kVecsPerThread = 4;
};

/// Compaction: one CTA per (sequence, layer, KV head), K and V together, ascending chunks of
/// kThreads * kVecsPerThread 16-byte vectors per kind, one barrier per chunk (the next chunk's
/// index lookups overlap this chunk's loads). 256 threads * 4 vectors * 2 kinds = 32 KB of loads
/// in flight per CTA; <= 64 registers keeps 4 CTAs/SM, so Qwen3-8B's 288 rows per sequence are
/// all resident at batch 1 (a second wave would double the time of its CTAs).
struct Compact {
  static constexpr int kThreads = 256;
  static constexpr int kVecsPerThread = 4;
};

/// Paged decode attention (split-K / flash decoding).
/// 16-bit caches use mma.sync m16n8k16: a warp takes 16-token tiles, 8 query heads per pass
/// (the MMA's N); fp32 caches use CUDA cores, 4 query heads per pass. kWarps warps per CTA share
/// one split and merge in shared memory. Splits fill one wave of resident CTAs.
struct DecodeAttention {
  static constexpr int kWarps = 4;
  /// __launch_bounds__ min CTAs/SM of the mma kernel. 1: ptxas uses 147 registers (d=128), no
  /// spill, 3 CTAs/SM. 4 caps it at 128 registers with a 20-byte spill (ptxas, CUDA 13.0).
  static constexpr int kMinCtasPerSmMma = 1;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileTokens = 16;
  static constexpr int kHeadsPerPassMma = 8;
  static constexpr int kHeadsPerPassF32 = 4;
  /// Splits are multiples of this (one tile per warp) and at least this long.
  static constexpr int kSplitGranule = kWarps * kTileTokens;
  /// Fewer tokens per split than this leaves the CTA's fixed cost (Q load, merge) dominant.
  static constexpr int kMinTokensPerSplit = 256;
  /// Upper bound of splits (bounds the combine kernel's loop and the workspace).
  static constexpr int kMaxSplits = 1024;

  /// Launcher variants (DecodeAttentionPlan::variant); every one computes the same function.
  ///   0 register-load kernel (loads of one 16-token tile in flight per warp, then its math);
  ///     combine kernel with a serial per-split loop (about 2 * splits / 4 dependent L2 trips)
  ///   1 register-load kernel; parallel combine (weights in shared memory, kMergeBatch loads in
  ///     flight per thread)
  ///   2 cp.async kernel (kStages tiles per warp in flight through shared memory, block-table
  ///     entry fetched one tile ahead, length / Q / first table entry loaded together);
  ///     parallel combine
  ///   3 cp.async kernel; the last CTA of each (entry, KV head) merges the splits (arrival
  ///     counters in the workspace, zeroed by a one-CTA kernel that the split kernel overlaps
  ///     through programmatic dependent launch): no combine kernel
  ///   4 as 3 without the zeroing kernel (measures its cost): the workspace must be zero-filled
  ///     before the first call and then serve only variant-4 calls of one batch / num_q_heads;
  ///     every completed call leaves the counters zero again
  /// fp32 caches run their one kernel; variants >= 1 use the parallel combine.
  static constexpr int kNumVariants = 5;
  static constexpr int kDefaultVariant = 2;
  /// Stages of the cp.async kernel: per warp kStages x (K + V) 16-token tiles, 8 KB each at
  /// d = 128, i.e. 64 KB per CTA with 2 stages (3 CTAs/SM as the register kernel).
  static constexpr int kStages = 2;
  /// __launch_bounds__ min CTAs/SM of the cp.async kernel.
  static constexpr int kMinCtasPerSmPipe = 1;
  /// Partial loads a thread keeps in flight when merging splits.
  static constexpr int kMergeBatch = 16;
};

}  // namespace triattn::cuda::tuning::sm90

// SPDX-License-Identifier: Apache-2.0
// Tuning values for Hopper (sm_90): constexpr aggregates, CUB policy style. Launchers and kernels
// read them through the policy tuning::select.cuh picks; they are never KvCache template
// parameters. Each value names the benchmark (benchmarks/) that measured it.
#pragma once

namespace triattn::cuda::tuning::sm90 {

/// Append: each thread moves kVecsPerThread 16-byte vectors of K and of V, loads first. 256
/// threads * 4 * 2 * 16 B = 32 KB of loads in flight per CTA, and 4x fewer (short-lived) CTAs
/// than one vector per thread for a 36-layer prefill (CTA turnover stays off the critical path).
struct Append {
  static constexpr int kThreads = 256;       // measured by bench_append (BM_AppendPrefill)
  static constexpr int kVecsPerThread = 4;   // measured by bench_append (BM_AppendPrefill)
};

/// Compaction: one CTA per (sequence, layer, KV head) row, or per column part of it (K and V
/// columns split into 2 parts), ascending chunks of kThreads 16-byte vectors per thread, one
/// barrier per chunk. <= kSplitRowsPerSm rows per SM (rows = sequences * layers * KV heads) run 2
/// parts; <= kShortRowsPerSm rows per SM 4 vectors per thread, else 8 (more loads in flight).
struct Compact {
  static constexpr int kThreads = 256;        // measured by bench_compact
  static constexpr int kSplitRowsPerSm = 6;   // measured by bench_compact (few-row cases)
  static constexpr int kShortRowsPerSm = 3;   // measured by bench_compact (few-row cases)
};

/// Scoring policy (cuda::score's Policy). Mean: the tensor-core mean scorer (score_mean_mma_kernel),
/// one CTA per SM of kWarps computing warps, each with a kStages-deep ring of kKeys-key slices
/// (192 KB at d = 128) that kProducers producer warps fill, so memory back-pressure stalls only the
/// producers; kLoadAhead loads each next row's weight inputs while a row streams. Max: the
/// pipelined tensor-core max scorer (score_max_mma_pipe_kernel), one CTA of kWarps warps per SM,
/// per-warp rings of kStages kKeys-key slices (200 KB per CTA at d = 128 with |D| = 17).
/// kRingKernels: the ring kernels where they apply (false: the non-ring fallbacks that views with
/// K ranges of 64 GiB or more take); kTensorCoreMax: max aggregation on the tensor cores for
/// 16-bit caches (false: the CUDA-core kernel that fp16 weights near fp16's range limit take).
struct Score {
  static constexpr bool kRingKernels = true;    // measured by bench_score (ring vs non-ring kernels)
  static constexpr bool kTensorCoreMax = true;  // measured by bench_score (max aggregation)
  struct Mean {
    static constexpr int kWarps = 8, kStages = 3, kMinCtas = 1, kKeys = 32;  // measured by bench_score (mean)
    static constexpr bool kLoadAhead = true;   // measured by bench_score (mean)
    static constexpr int kProducers = 2;       // measured by bench_score (mean)
  };
  struct Max {
    static constexpr int kWarps = 8, kStages = 2, kMinCtas = 1, kKeys = 32;  // measured by bench_score (max)
  };
};

/// Key-norm baseline scorer (key_norm_kernel): threads per block.
struct KeyNorm {
  static constexpr int kThreads = 256;  // not measured: no benchmark covers the baselines yet
};

/// SnapKV-style baseline scorer: kWarps warps per block of the partial and attention kernels,
/// kChunk tokens per block, kStatWarps warps per block of the stats kernel, kPoolThreads threads
/// per block of the pooling kernel.
struct SnapKv {
  static constexpr int kWarps = 4;           // not measured: no benchmark covers the baselines yet
  static constexpr int kChunk = 256;         // not measured: no benchmark covers the baselines yet
  static constexpr int kStatWarps = 4;       // not measured: no benchmark covers the baselines yet
  static constexpr int kPoolThreads = 256;   // not measured: no benchmark covers the baselines yet
};

/// Normalisation. row_stats_kernel: one CTA of kRowStatsThreads per (b, l, h) row, kRowStatsCache
/// values per thread kept in registers between the passes (2,560 per row, a Qwen3-8B round: the
/// second pass re-reads nothing), the rest of a longer row re-read in batches of kRowStatsRestBatch;
/// kRowStatsMinCtas: <= 56 registers, 9 CTAs per SM, 1,152 rows in one wave on 132 SMs.
/// gqa_reduce_kernel: kReduceThreads threads, <= 80 registers (kReduceMinCtas per SM); per_head takes
/// kReduceSlots slots per CTA (kReduceLayerLanes threads per slot split the layers).
struct Normalize {
  static constexpr int kRowStatsThreads = 128;      // measured by bench_compression_round (row stats)
  static constexpr int kRowStatsCache = 20;         // measured by bench_compression_round (row stats)
  static constexpr int kRowStatsRestBatch = 8;      // measured by bench_compression_round (long rows)
  static constexpr int kRowStatsMinCtas = 9;        // measured by bench_compression_round (row stats)
  static constexpr int kReduceThreads = 128;        // measured by bench_compression_round (gqa_reduce)
  static constexpr int kReduceMinCtas = 6;          // measured by bench_compression_round (gqa_reduce)
  static constexpr int kReduceBatch = 16;           // union: loads in flight per thread; bench_compression_round
  static constexpr int kReduceSlots = 32;           // per_head: slots per CTA; bench_compression_round
  static constexpr int kReduceLayerLanes = kReduceThreads / kReduceSlots;
  static constexpr int kReduceLayersInFlight = 3;   // per_head: layers loaded at once; bench_compression_round
  static constexpr int kReduceGenericHeads = 8;     // per_head, any group size: heads loaded at once; same
};

/// The engine-layout round's own kernels (cuda::paged_round): kCheckThreads threads per block of the
/// input checks and shared-prefix pass, kThreads of the per-slot passes and outputs.
struct PagedRound {
  static constexpr int kCheckThreads = 128;  // not measured: latency-bound checks, a common size
  static constexpr int kThreads = 256;       // not measured: a common size (bench_compression_round times the round)
};

/// Selection (select_kernel): one CTA of kThreads ranks a row; rows of up to kCacheMax slots keep
/// their keys in shared memory. union_layer_max_kernel: kUnionThreads threads, one per slot.
struct Select {
  static constexpr int kThreads = 512;         // measured by bench_select
  static constexpr int kCacheMax = 11264;      // a bound: 44 KB of keys + 1.3 KB static under 48 KB
  static constexpr int kUnionThreads = 256;    // measured by bench_select (union)
};

/// Paged decode attention (split-K / flash decoding).
/// 16-bit caches use mma.sync m16n8k16: a warp takes 16-token tiles, 8 query heads per pass
/// (the MMA's N); fp32 caches use CUDA cores, 4 query heads per pass. kWarps warps per CTA share
/// one split and merge in shared memory. Splits fill one wave of resident CTAs.
struct DecodeAttention {
  static constexpr int kWarps = 4;  // measured by bench_decode_attention
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileTokens = 16;       // the MMA's M
  static constexpr int kHeadsPerPassMma = 8;   // the MMA's N
  static constexpr int kHeadsPerPassF32 = 4;   // measured by bench_decode_attention (fp32 cache)
  /// Splits are multiples of this (one tile per warp) and at least this long.
  static constexpr int kSplitGranule = kWarps * kTileTokens;
  /// Fewer tokens per split than this leaves the CTA's fixed cost (Q load, merge) dominant.
  static constexpr int kMinTokensPerSplit = 256;  // measured by bench_decode_attention (split sweep)
  /// Upper bound of splits (bounds the combine kernel's loop and the workspace).
  static constexpr int kMaxSplits = 1024;  // a bound, not a measurement

  /// Stages of the cp.async kernel: per warp kStages x (K + V) 16-token tiles, 8 KB each at
  /// d = 128, i.e. 64 KB per CTA with 2 stages (3 CTAs/SM).
  static constexpr int kStages = 2;  // measured by bench_decode_attention
  /// __launch_bounds__ min CTAs/SM of the cp.async kernel.
  static constexpr int kMinCtasPerSmPipe = 1;  // measured by bench_decode_attention
  /// Partial loads a thread keeps in flight when merging splits.
  static constexpr int kMergeBatch = 16;  // measured by bench_decode_attention (many splits)
};

/// Every algorithm's policy for sm_90: what tuning::ForArch<90> (select.cuh) gives.
struct Policy {
  static constexpr int kArch = 90;
  using Append = sm90::Append;
  using Compact = sm90::Compact;
  using Score = sm90::Score;
  using KeyNorm = sm90::KeyNorm;
  using Normalize = sm90::Normalize;
  using PagedRound = sm90::PagedRound;
  using Select = sm90::Select;
  using SnapKv = sm90::SnapKv;
  using DecodeAttention = sm90::DecodeAttention;
};

}  // namespace triattn::cuda::tuning::sm90

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

/// Compaction: one CTA per (sequence, layer, KV head) row, or per column part of it (its K and
/// V columns split into 2 parts), ascending chunks of kThreads * vectors-per-thread 16-byte
/// vectors, one barrier per chunk (the next chunk's index lookups overlap this chunk's loads).
/// Automatic split by rows per SM (rows = sequences * layers * KV heads): <= kSplitRowsPerSm rows
/// per SM run 2 parts, <= kShortRowsPerSm rows per SM 4 vectors per thread (16 KB of loads in
/// flight per CTA, 40 registers, 6 CTAs per SM), else 8 (32 KB, 64 registers, 4 CTAs per SM).
/// H200, 2026-12-01, Qwen3-8B rows, 2,560 -> 2,048, µs (parts x vectors):
///   batch 1 (2.2 rows/SM):  1x8 172, 1x4 168, 2x8 174, 2x4 163, 4x8 181, 4x4 191
///   batch 2 (4.4 rows/SM):  1x8 341, 1x4 321, 2x8 315, 2x4 335, 4x8 362, 4x4 367
///   batch 4 (8.7 rows/SM):  1x8 620, 1x4 646, 2x8 623, 2x4 629, 4x8 722, 4x4 731
/// (4 parts were measured, never faster, and are not compiled; one CTA per row with 4 K + 4 V
/// vectors per thread, before: 181 / - / 632 µs).
struct Compact {
  static constexpr int kThreads = 256;
  static constexpr int kSplitRowsPerSm = 6;
  static constexpr int kShortRowsPerSm = 3;
};

/// Tensor-core mean scorer (score_mean_mma_kernel; ScoreOptions::mean_variant 2-5): warps per
/// CTA, cp.async ring stages per warp (a stage is a 32-key slice: 8 KB at d = 128) and the CTAs
/// per SM each is built for. Per SM both keep ~128-190 KB of K in flight (HBM needs ~50-70 KB at
/// ~1.5 µs loaded latency), with 8 or 12 warps to issue the per-pair norm math.
/// kLoadAhead: each row's weight inputs are loaded ahead into registers (RowFoldInputs; H200,
/// 2026-12-01: variant 2 27.7 -> 26.7 µs at one layer). Off where the register cap is tight:
/// variants 3 (168) and 4 (128) spilled with it and ran 33.2 and 39.9 µs.
struct ScoreMeanMma {
  /// Every item split statically among the CTAs (no dynamic tail, no work stealing).
  struct StaticSplit {
    static constexpr int kStaticEighths = 8;
    static constexpr int kStealBack = 0;
  };
  struct Variant2 : StaticSplit {  // 2 CTAs x 4 warps, 3 stages: 102 KB shared memory per CTA at d = 128
    static constexpr int kWarps = 4, kStages = 3, kMinCtas = 2, kKeys = 32;
    static constexpr bool kLoadAhead = true;
    static constexpr int kProducers = 0;
  };
  struct Variant3 : StaticSplit {  // 3 CTAs x 4 warps, 2 stages: 70 KB per CTA, <= 168 registers
    static constexpr int kWarps = 4, kStages = 2, kMinCtas = 3, kKeys = 32;
    static constexpr bool kLoadAhead = false;
    static constexpr int kProducers = 0;
  };
  /// 2 CTAs x 8 warps of 16-key slices (one m16 tile), 3 stages: the same 96 KB of rings per CTA
  /// but twice the warps per scheduler (ncu on variant 2: 2 warps per scheduler, an instruction
  /// issued only every ~1.9 cycles; <= 128 registers).
  struct Variant4 : StaticSplit {
    static constexpr int kWarps = 8, kStages = 3, kMinCtas = 2, kKeys = 16;
    static constexpr bool kLoadAhead = false;
    static constexpr int kProducers = 0;
  };
  /// One CTA per SM: 8 computing warps with 3 stages of 32 keys each (192 KB at d = 128) and
  /// kProducers producer warps that fill them (cp.async), so that memory back-pressure stalls
  /// only the producers. H200, 2026-12-01: one producer warp could not keep 8 rings full
  /// (29.8 µs at one layer), one bulk copy per key (TMA) ran at ~0.9 TB/s, 4 producers 26.6 µs;
  /// 2 producers 26.0 µs at one layer (variant 2: 26.2), 63.0 / 393 µs for a round's scores at
  /// batch 1 / 8 (66.2 / 399). 2026-12-02, keys copied L2 evict-first (KeySliceFeed): 23.5-23.7 µs.
  struct Variant5 : StaticSplit {
    static constexpr int kWarps = 8, kStages = 3, kMinCtas = 1, kKeys = 32;
    static constexpr bool kLoadAhead = true;
    static constexpr int kProducers = 2;
  };
  /// Variant5 with a dynamic tail (ScoreOptions::work_counter): the CTAs split kStaticEighths / 8
  /// of the items in contiguous shares and claim the rest one tile at a time. Why: with a static
  /// split every CTA streams the same bytes, and the multiprocessors with the slowest memory path
  /// set the end (per-item times of 1.9-2.4 µs p10-p90 across SMs in the sixteenth session's trace
  /// of variant 2; its last warp ended ~5 µs after the median one).
  /// H200, 2026-12-03: correct but slower (one 32K layer 27.9 vs 23.4 µs; a round's scores 68.8 vs
  /// 60.6 µs at batch 1, 477 vs 406 at batch 8; 2026-12-04, f22f65b: 26.6 vs 23.5 µs, 69.1 / 484
  /// µs): the claimed tiles come in global order, so nearly every one starts a new row and a
  /// weight fold on the computing warps' path. Not the default.
  struct Variant6 : Variant5 {
    static constexpr int kStaticEighths = 6;
  };
  /// Variant5 with work stealing (ScoreOptions::work_counter; detail::StealingShares): every
  /// CTA takes its contiguous share in order, then steals single tiles from the last kStealBack
  /// of the shares with the most left, so that the fast multiprocessors take over the slow ones'
  /// last tiles while each CTA keeps walking one row at a time (Variant6's global claims lost
  /// that). Correct but slower, not the default. H200, 2026-12-04 (f22f65b): one 32K layer
  /// 28.5 µs (5: 23.5), write-back charged 30.6 (26.4), a round's scores 65.3 / 440 µs at batch
  /// 1 / 8 (61.5 / 425). The machinery with nothing to steal costs ~3 µs and each item open to
  /// thieves ~1 µs more: the producers run kStages items ahead, so owners take their deques and
  /// thieves start looking ~3 items before they finish, and with ~8 items per CTA the deques are
  /// empty by then. (2026-12-03, all but 2 items of each share open to thieves: 34.3 µs.)
  struct Variant7 : Variant5 {
    static constexpr int kStealBack = 2;
  };
  /// Variant7 with the last 4 items of each share open to thieves. H200, 2026-12-04: one 32K
  /// layer 31.2 µs, write-back charged 32.8, a round's scores 66.7 / 440 µs at batch 1 / 8.
  struct Variant8 : Variant5 {
    static constexpr int kStealBack = 4;
  };

};

/// Pipelined tensor-core max scorer (score_max_mma_pipe_kernel; ScoreOptions::max_variant 1-4):
/// one CTA of 8 warps per SM, 2 ring stages of 32 keys per warp (128 KB of rings; with |D| = 17
/// the B fragments take 54 KB and the cos/sin 17 KB: 200 KB per CTA at d = 128).
struct ScoreMaxMma {
  /// kKeys: keys per warp slice. 16 (one m16 tile) with 16 warps, i.e. four warpgroups per SM
  /// for the wgmma variants, ran slower on the H200 (2026-12-01: 54.1 / 49.0 µs vs 44.5 / 37.6 at
  /// one 32K layer; the 128-register cap spills 244 bytes); so did three warpgroups (12 warps of
  /// 16-key slices, 3 stages, no spill): 40.3 vs 37.5 µs (2026-12-01, seventh session).
  static constexpr int kWarps = 8, kStages = 2, kMinCtas = 1, kKeys = 32;
};

/// Warp-specialized max scorer (score_max_ws_kernel; ScoreOptions::max_variant 5, 6): stages per
/// ring, each one 64-key tile (16 KB at d = 128) plus its norm terms (1 KB); with |D| = 17 the CTA
/// takes 2·kStages·17 KB + 55 KB of shared memory (191 KB at 4 stages). The first choice; not
/// swept (the kernel is bound by its MMA loop, not by the bytes in flight).
struct ScoreMaxWs {
  static constexpr int kStages = 4;
};

/// Direct max scorer (score_max_direct_kernel; ScoreOptions::max_variant 7 and 8): key slots per
/// thread (kBufs tiles in flight while one is multiplied) and CTAs (one warpgroup each) per SM.
/// H200, 2026-12-02, one 32K layer / Qwen3-8B round shape at batch 8 and 32 (max_variant 4 in the
/// same run: 35.5 / 719 / 2,863 µs): 2 slots at 2 CTAs (7) 38.0 / 714 / 2,833 µs; 1 slot at 3
/// CTAs (8, 167 registers) 42.1 / 691 / 2,752 µs; 3 slots at 2 CTAs 39.3 / 730 / 2,898 µs. One
/// CTA per SM (4 warps, 6 slots) took 65 µs at one layer against 38-39 at two (an earlier build
/// whose scores were still wrong: indicative): the steps are latency-bound, so warps per SM count
/// more than bytes in flight.
struct ScoreMaxDirect {
  static constexpr int kBufs = 2, kMinCtas = 2;
};
struct ScoreMaxDirectWide {
  static constexpr int kBufs = 1, kMinCtas = 3;
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
  ///   5 cp.async kernel; wide combine (every split's partial of a thread in flight at once: one
  ///     L2 round trip after the split kernel instead of ~5 for the parallel combine)
  ///   6 as 5 with splits that are multiples of one 16-token tile instead of kSplitGranule, so
  ///     the splits fill the resident CTAs (batch 1 x 32K on an H200: 49 x 8 = 392 CTAs of 396
  ///     instead of 47 x 8 = 376); warps of a split may then differ by one tile
  ///   7 as 5, K/V copied into L2 as evict-first: the stream recycles its own L2 lines instead
  ///     of evicting what L2 held (the benchmark's memset flush leaves up to a full L2 of dirty
  ///     lines whose write-back otherwise competes with the batch-1 read)
  ///   8 as 6 with evict-first K/V
  /// fp32 caches run their one kernel; variants 1-4 use the parallel combine, 5-8 the wide one.
  static constexpr int kNumVariants = 9;
  static constexpr int kDefaultVariant = 2;
  /// Stages of the cp.async kernel: per warp kStages x (K + V) 16-token tiles, 8 KB each at
  /// d = 128, i.e. 64 KB per CTA with 2 stages (3 CTAs/SM as the register kernel).
  static constexpr int kStages = 2;
  /// __launch_bounds__ min CTAs/SM of the cp.async kernel.
  static constexpr int kMinCtasPerSmPipe = 1;
  /// Partial loads a thread keeps in flight when merging splits.
  static constexpr int kMergeBatch = 16;
  /// Splits whose (m, l) and partial a thread of the wide combine loads at once (variants 5-8;
  /// 3 registers each); covers the 47-49 splits of batch 1 x 32K in one round trip.
  static constexpr int kCombineWide = 52;
};

}  // namespace triattn::cuda::tuning::sm90

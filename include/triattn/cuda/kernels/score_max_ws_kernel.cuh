// SPDX-License-Identifier: Apache-2.0
// Warp-specialized tensor-core max scorer (16-bit caches, |D| <= 18). Same contract as
// score_max_mma_pipe_kernel.
// The MMA warpgroup's instruction stream is this kernel's limit (ncu, 2026-12-01: ~354
// instructions per 64-key tile, 3.5% of its samples waiting on mbarriers), so it is kept thin: the
// warp index is broadcast so that the role branches are warp-uniform (descriptors in uniform
// registers), one descriptor per operand is advanced per k-step, and B's columns past |D| repeat
// offset D - 1's weights so that the max over δ needs no selects (ptxas 13.0: the MMA role's SASS
// 1,067 -> 849 instructions; H200: 41.5 -> 39.6 µs at one 32K layer with max_variant 6).
// Two variants (ScoreOptions::max_variant): 6 keeps one accumulator chain per tile; 5 keeps two
// accumulator sets per tile (the two weight terms, filled by one m64n144 step per k-step), which
// needs more registers than the 168 each of the 12 warps starts with, so setmaxnreg moves them:
// the MMA warpgroup to 240, the producer warpgroup to 104, the norm warps to 160 (the three must
// balance: 240 against the producers' registers alone waited forever). A new sequence's phases
// (sincos, whose slow path is a call) are computed by the norm warps only: with a call in the MMA
// warpgroup's code ptxas 13.0 ignored setmaxnreg and crashed. H200, 2026-12-02, one 32K layer:
// 38.7-39.0 µs (6), 37.3-37.6 (5), 35.7 (max_variant 4, the default). What bounds it (same day,
// timing experiments): without the products 26.6-26.8 µs, without the norm warps' work 32.9-33.2,
// without both 24.4-24.6 (6): the MMAs cost as much as if they ran after the stream, not under it
// (the tensor pipe itself runs m64n72k16 at 36 cycles, benchmarks/probe/wgmma_rate_probe.cu); the
// shared-memory reads of SS-mode MMAs at N = 72 (~118 bytes per cycle at full rate) leave the
// ring copies and the norm warps little of the 128 bytes per cycle, which the wide step eases.
// Roles:
//   producer warps  copy each 64-key tile into a shared-memory ring stage (cp.async), two warps
//                   per ring (one ring per tile of a 128-key item), and signal a full mbarrier;
//   MMA warpgroup   runs each tile's [64 x d]·[d x (|D|·4 heads)] product as warpgroup MMAs with both
//                   operands in shared memory (keys as A, the folded weights as B: bf16 hi + mid or
//                   fp16 hi + lo), take the max over δ, add the norm term and store the scores;
//   norm warps      compute the norm term of every key of the tile (one key per lane, all pairs and
//                   the 4 heads) into a small per-stage buffer, next to the MMAs.
// A stage is handed back (empty mbarrier) when the MMA warpgroup has stored its scores and the
// norm warps are done reading it. Items are (row, 128-key tile) as in the other ring scorers; each
// CTA walks a contiguous range of them, all roles in the same order (rows without keys skipped).
// The A tiles use the K-major 128-byte swizzle layout: the tile's 64 keys as rows of 128 bytes per
// 64-element half of the key (halves 8 KB apart), chunk c (8 elements) of key r at 16-byte slot
// (c % 8) ^ (r % 8) of its row. A warp copies whole keys (8 lanes = 128 contiguous global bytes
// per phase, as the hardware coalesces 16-byte accesses) into 8 distinct bank groups, and the norm
// warps' reads (8 keys' same chunk per phase) hit 8 distinct bank groups too. (The no-swizzle
// core-matrix layout made either the copies uncoalesced or the writes conflict: ncu, 2026-12-01,
// twice the ideal L2 sectors and 45% excess shared wavefronts, 62 µs at one 32K layer.)
// Builds without sm_90a run the same dot products as mma.sync from the same layouts.
#pragma once

#include <cstdint>
#include <type_traits>

#include <triattn/cuda/kernels/score_kernel.cuh>
#include <triattn/cuda/kernels/wgmma.cuh>

namespace triattn::cuda {

namespace detail {

/// Shape and shared-memory map of score_max_ws_kernel.
template <class T, int HD, int kStages_>
struct MaxWsShape : MaxWeightTiles<HD> {
  using W = MaxWeightTiles<HD>;
  using W::kBBytes, W::kCBytes, W::kF, W::kHeads;
  static constexpr int kCPR = HD / 8;  // 16-byte chunks per key
  static constexpr int kStages = kStages_;
  static constexpr int kGroups = 2;     // tiles per item, each with its own ring
  static constexpr int kMmaWarps = 4;   // one warpgroup runs the MMAs of every ring's tile
  static constexpr int kNormWarps = 4;  // two per tile (32 keys each)
  static constexpr int kProducers = 2 * kGroups;  // two per ring, 32 keys of each tile each (a whole warpgroup)
  static constexpr int kConsumerThreads = 32 * (kMmaWarps + kNormWarps);
  static constexpr int kThreads = kConsumerThreads + 32 * kProducers;
  // 12 warps at one CTA per SM: 168 registers per thread at launch (the register file over the
  // threads, in steps of 8); with two chains setmaxnreg moves them to the MMA warpgroup (240), taking
  // them from the producers (104) and the norm warps (what balances the pool: 160).
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kMmaRegs = 240, kProducerRegs = 104;
  static constexpr int kNormRegs =
      kLaunchRegs - ((kMmaRegs - kLaunchRegs) * kMmaWarps - (kLaunchRegs - kProducerRegs) * kProducers) / kNormWarps;
  static_assert(kNormRegs % 8 == 0 && kNormRegs <= kLaunchRegs &&
                    (kMmaRegs - kLaunchRegs) * kMmaWarps <=
                        (kLaunchRegs - kProducerRegs) * kProducers + (kLaunchRegs - kNormRegs) * kNormWarps,
                "setmaxnreg targets must fit the registers the CTA was launched with");
  static constexpr int kRows = 64;                 // keys per tile (one m64 wgmma tile)
  static constexpr int kTile = kGroups * kRows;    // keys per item
  static constexpr std::size_t kATileBytes = static_cast<std::size_t>(kRows) * HD * 2;
  static constexpr std::size_t kNormBytes = static_cast<std::size_t>(kRows) * kHeads * 4;  // float4 per key
  static constexpr int kBarriers = 3 * kGroups * kStages;  // full, norm-full, empty per (group, stage)
  // [A tiles: group][stage] | [norm terms: group][stage] | B | c | barriers | cos, sin [|D|][F] double
  static constexpr std::size_t kAOff = 0;
  static constexpr std::size_t kNormOff = kAOff + kATileBytes * kGroups * kStages;
  static constexpr std::size_t kBOff = kNormOff + kNormBytes * kGroups * kStages;
  static constexpr std::size_t kCOff = kBOff + kBBytes;
  static constexpr std::size_t kBarOff = kCOff + kCBytes;
  static constexpr std::size_t kPhaseOff = kBarOff + static_cast<std::size_t>(kBarriers) * 8;  // cos, sin(t0·ω_f) [F] double
  static constexpr std::size_t kTablesOff = kPhaseOff + static_cast<std::size_t>(kF) * 2 * sizeof(double);
  static_assert(kNormOff % 128 == 0 && kBOff % 128 == 0 && kBarOff % 8 == 0 && kTablesOff % 16 == 0, "alignment");
  /// Dynamic shared memory for |D| offsets (+1 KB: the A tiles start at a 1,024-byte aligned
  /// address, which the swizzle needs).
  static constexpr std::size_t smem_bytes(int num_offsets) {
    return 1024 + kTablesOff + static_cast<std::size_t>(num_offsets) * kF * 2 * sizeof(double);
  }
};

/// Byte offset of chunk c of key r in an A tile (128-byte swizzle, see above).
__device__ __forceinline__ std::uint32_t ws_chunk_offset(int r, int c) {
  return static_cast<std::uint32_t>((c >> 3) * 8192 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}



/// The dot products of one A tile into kChains accumulator sets (weight term x goes to set
/// x % kChains; their sum is the product), d[c][4·nt + v] in the wgmma accumulator layout (column
/// 8·nt + 2·(lane%4) + (v&1) of the warp's row 16·(warp%4) + lane/4 + 8·(v>>1)). Two sets: one
/// m64n144k16 per k-step over both terms' columns (B holds a k-step's two terms next to each
/// other), so A is read from shared memory once per k-step instead of twice (H200, 2026-12-02,
/// max_variant 5 at one 32K layer: 39.0-39.3 -> 37.3-37.6 µs).
/// a_tile / b_base: shared addresses of the stage's A tile and of the B tiles [k-step][split].
template <class T, int KS, int SP, int kChains>
__device__ __forceinline__ void ws_tile_products(float (&d)[kChains][36], std::uint32_t a_tile, std::uint32_t b_base,
                                                 int warp_in_group, int lane) {
  static_assert(SP % kChains == 0, "each chain takes the same weight terms");
  constexpr std::uint32_t kBTile = kWgmmaMaxNTiles * 256;
#ifdef TRIATTN_WGMMA_ENABLED
  (void)warp_in_group;
  (void)lane;
  // one descriptor per operand, advanced per k-step (rebuilding each cost ~6 instructions per MMA)
  const std::uint64_t a_desc = wgmma_desc_kmajor_sw128(a_tile, 1024u);
  const std::uint64_t b_desc = wgmma_desc_kmajor(b_base, 128u, 256u);
  wgmma_fence();
  if constexpr (kChains == 2 && SP == 2) {
#pragma unroll
    for (int s = 0; s < KS; ++s)
      wgmma_m64n144k16_ss<std::is_same_v<T, f16_storage>>(
          d, wgmma_desc_advance(a_desc, static_cast<std::uint32_t>((s >> 2) * 8192 + (s & 3) * 32)),
          wgmma_desc_advance(b_desc, static_cast<std::uint32_t>(s * SP) * kBTile), s);
  } else {
#pragma unroll
    for (int s = 0; s < KS; ++s)
#pragma unroll
      for (int x = 0; x < SP; ++x)
        wgmma_m64n72k16_ss<std::is_same_v<T, f16_storage>>(
            d[x % kChains], wgmma_desc_advance(a_desc, static_cast<std::uint32_t>((s >> 2) * 8192 + (s & 3) * 32)),
            wgmma_desc_advance(b_desc, static_cast<std::uint32_t>(s * SP + x) * kBTile),
            s * (SP / kChains) + x / kChains);
  }
  wgmma_commit();
#else
  // mma.sync: the warp's 16 rows (row groups 2w, 2w + 1) against each n-tile of 8 columns
  using Tr = MmaMaxTraits<T>;
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int v = 0; v < 36; ++v) d[c][v] = 0.0f;
  const int mrow = lane & 7, mat = lane >> 3;  // ldmatrix: this lane's row address in matrix `mat`
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    std::uint32_t a[4];  // matrices (rows +0, chunk 2s), (+8, 2s), (+0, 2s+1), (+8, 2s+1)
    ldmatrix_x4(a, a_tile + ws_chunk_offset(16 * warp_in_group + 8 * (mat & 1) + mrow, 2 * s + (mat >> 1)));
#pragma unroll
    for (int x = 0; x < SP; ++x)
#pragma unroll
      for (int nt = 0; nt < kWgmmaMaxNTiles; ++nt) {
        std::uint32_t b[2];  // the n-tile's two k-chunk core matrices, 128 bytes apart
        ldmatrix_x2(b, b_base + static_cast<std::uint32_t>(s * SP + x) * kBTile +
                           static_cast<std::uint32_t>(nt * 256 + ((lane >> 3) & 1) * 128 + mrow * 16));
        float* dc = d[x % kChains];
        float acc[4] = {dc[4 * nt], dc[4 * nt + 1], dc[4 * nt + 2], dc[4 * nt + 3]};
        Tr::mma(acc, a, b[0], b[1]);
#pragma unroll
        for (int v = 0; v < 4; ++v) dc[4 * nt + v] = acc[v];
      }
  }
#endif
}

/// Pins the accumulators at this point of the instruction stream (the compiler sees no register
/// dependency between an asynchronous wgmma and its wait, so reads of d could move above it).
template <int kChains>
__device__ __forceinline__ void ws_fence_operands(float (&d)[kChains][36]) {
#ifdef TRIATTN_WGMMA_ENABLED
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int v = 0; v < 36; ++v) asm volatile("" : "+f"(d[c][v])::"memory");
#else
  (void)d;
#endif
}

/// Register reallocation between warpgroups (setmaxnreg, sm_90a) for two chains per tile: the
/// MMA warpgroup's 2 x 2 accumulator sets (144 registers) need more than the kLaunchRegs every
/// thread starts with, which the producer and norm warpgroups give up. setmaxnreg.inc blocks until
/// the CTA's pool holds the registers asked for, so the three targets must balance exactly (an
/// MMA target beyond what the others release hangs the kernel). One chain keeps the launch split.
enum class WsRole { kMma, kNorm, kProducer };
template <class Shape, int kChains, WsRole kRole>
__device__ __forceinline__ void ws_set_max_registers() {
#ifdef TRIATTN_WGMMA_ENABLED
  if constexpr (kChains > 1) {
    if constexpr (kRole == WsRole::kMma)
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Shape::kMmaRegs) : "memory");
    else
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRole == WsRole::kNorm ? Shape::kNormRegs
                                                                                     : Shape::kProducerRegs)
                   : "memory");
  }
#endif
}

/// Waits for the tile's products (all but the newest kPending committed groups).
template <int kPending>
__device__ __forceinline__ void ws_wait_products() {
#ifdef TRIATTN_WGMMA_ENABLED
  wgmma_wait<kPending>();
#endif
}

/// Σ_f c_f·|K_f| of key r of an A tile for the 4 heads (c as [slot f + f/8] float4). The key's
/// chunks are loaded first and the pairs summed into two interleaved accumulator sets, so that
/// the square roots and FMAs of neighbouring pairs overlap.
template <class T, RopeStyle S, int HD>
__device__ __forceinline__ float4 ws_key_norm(std::uint32_t a_tile, int r, const float4* c_s) {
  constexpr int kCPR = HD / 8;
  std::uint32_t w[kCPR][4];
#pragma unroll
  for (int c = 0; c < kCPR; ++c)
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[c][0]), "=r"(w[c][1]), "=r"(w[c][2]), "=r"(w[c][3])
                 : "r"(a_tile + ws_chunk_offset(r, c)));
  float4 acc[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
  const auto add = [&](int f, float re, float im) {
    const float n = pair_norm(fmaf(re, re, fmaf(im, im, 1e-8f)));
    const float4 c = c_s[f + f / 8];
    float4& s = acc[f & 1];
    s.x = fmaf(c.x, n, s.x);
    s.y = fmaf(c.y, n, s.y);
    s.z = fmaf(c.z, n, s.z);
    s.w = fmaf(c.w, n, s.w);
  };
  if constexpr (S == RopeStyle::kHalf) {  // pair f = elements (f, f + F): chunks c and c + kCPR/2
#pragma unroll
    for (int c = 0; c < kCPR / 2; ++c)
#pragma unroll
      for (int e = 0; e < 8; ++e) add(8 * c + e, element<T>(w[c], e), element<T>(w[c + kCPR / 2], e));
  } else {  // pair f = elements (2f, 2f + 1): one word
#pragma unroll
    for (int c = 0; c < kCPR; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) add(4 * c + e, element<T>(w[c], 2 * e), element<T>(w[c], 2 * e + 1));
  }
  return make_float4(acc[0].x + acc[1].x, acc[0].y + acc[1].y, acc[0].z + acc[1].z, acc[0].w + acc[1].w);
}

}  // namespace detail

/// Warp-specialized tensor-core max-aggregation scorer (see the top of this file); dynamic shared
/// memory MaxWsShape<T, HD, kStages>::smem_bytes(|D|), |D| <= 2·kWgmmaMaxNTiles.
template <class T, class Id, int HD, RopeStyle S, int kStages, int kChains = 1>
__global__ void __launch_bounds__(detail::MaxWsShape<T, HD, kStages>::kThreads, 1)
    score_max_ws_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                        detail::FastDiv fd) {
  detail::griddep_launch_dependents();  // the round's next kernel waits for this grid's completion
  using Shape = detail::MaxWsShape<T, HD, kStages>;
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, SP = Shape::kSplits, GH = Shape::kHeads, CPR = Shape::kCPR;
  constexpr int NT = kWgmmaMaxNTiles;
  extern __shared__ __align__(128) unsigned char ws_smem_raw[];
  const std::uint32_t smem_raw = detail::score_smem_addr(ws_smem_raw);
  const std::uint32_t smem = (smem_raw + 1023u) & ~1023u;  // the swizzle atoms' alignment
  unsigned char* const ws_smem = ws_smem_raw + (smem - smem_raw);
  const auto a_tile = [&](int grp, int st) {
    return smem + static_cast<std::uint32_t>(Shape::kAOff + (grp * kStages + st) * Shape::kATileBytes);
  };
  float4* const norm_s = reinterpret_cast<float4*>(ws_smem + Shape::kNormOff);  // [group][stage][64]
  const std::uint32_t b_base = smem + static_cast<std::uint32_t>(Shape::kBOff);
  float4* const c_s = reinterpret_cast<float4*>(ws_smem + Shape::kCOff);
  const std::uint32_t bars = smem + static_cast<std::uint32_t>(Shape::kBarOff);
  const auto full_bar = [&](int grp, int st) { return bars + static_cast<std::uint32_t>((grp * kStages + st) * 8); };
  const auto nfull_bar = [&](int grp, int st) {
    return bars + static_cast<std::uint32_t>(((Shape::kGroups + grp) * kStages + st) * 8);
  };
  const auto empty_bar = [&](int grp, int st) {
    return bars + static_cast<std::uint32_t>(((2 * Shape::kGroups + grp) * kStages + st) * 8);
  };
  double* const cs_s = reinterpret_cast<double*>(ws_smem + Shape::kTablesOff);  // [D][F]
  const int D = m.num_offsets;
  double* const sn_s = cs_s + static_cast<std::size_t>(D) * F;

  const detail::ScoreWork work(m, a, GH, Shape::kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  long long it0 = work.begin, it_end = work.end;
  if (it_end <= it0 || D <= 0) return;  // uniform across the CTA
  const long long row0 = it0 / tiles_per_row, last_row = (it_end - 1) / tiles_per_row;
  const int tile0 = static_cast<int>(it0 - row0 * tiles_per_row);
  // The warp index broadcast from lane 0: the compiler then knows it is warp-uniform, so the role
  // branches are uniform and the MMA warpgroup's descriptors can live in uniform registers.
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Shape::kBarriers; ++i) {
      // 0 full: the ring's producer warp; 1 norm-full: the ring's norm warps; 2 empty: both
      // consumers of the stage (the MMA warpgroup and the norm warps)
      const int kind = i / (Shape::kGroups * kStages);
      constexpr unsigned kNormLanes = 32u * Shape::kNormWarps / Shape::kGroups;
      detail::mbar_init(bars + static_cast<std::uint32_t>(i * 8),
                        kind == 0 ? 32u * Shape::kProducers / Shape::kGroups : kind == 1 ? kNormLanes : 128u + kNormLanes);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Item cursor shared by every role: (row, tile) from it0; live items (with keys) count stages.
  struct Cursor {
    long long rid;
    int tile;
    long long n;  // items left
  };

  if (warp >= Shape::kConsumerThreads / 32) {  // ---- producer warp: keys 32·half .. +32 of ring p's tiles ----
    detail::ws_set_max_registers<Shape, kChains, detail::WsRole::kProducer>();
    const int pw = warp - Shape::kConsumerThreads / 32, p = pw % Shape::kGroups, half = pw / Shape::kGroups;
    Cursor cur{row0, tile0, it_end - it0};
    long long kr_row = -1;
    detail::KeyRowAddr<T, Id> kr{};
    // The next live item's tile, row addresses and block id (key 32·half + lane of tile p),
    // their loads issued kAhead items before the copies that need them: a table lookup per item
    // in line with the copies left the producers waiting on it (ncu, 2026-12-01: long-scoreboard
    // stalls the top reason, 1.15 TB/s).
    struct Ahead {
      bool valid;
      int tile;
      const T* range;
      std::int64_t block_elems, token_stride, head_off;
      int len;
      Id blk;
    };
    const auto gen = [&]() -> Ahead {
      Ahead q{};
      while (cur.n > 0) {
        const long long rid = cur.rid;
        const int tile = cur.tile;
        if (++cur.tile == tiles_per_row) {
          cur.tile = 0;
          ++cur.rid;
        }
        --cur.n;
        if (rid != kr_row) {
          const detail::ScoreRow sr = detail::decode_score_row(rid, L, Hkv, HC);
          kr = detail::key_row(view, a, sr.b, sr.l, sr.g);
          kr_row = rid;
        }
        if (tile * Shape::kTile >= kr.len) continue;  // no keys (every role skips it)
        q.valid = true;
        q.tile = tile;
        q.range = kr.range;
        q.block_elems = kr.block_elems;
        q.token_stride = kr.token_stride;
        q.head_off = kr.head_off;
        q.len = kr.len;
        const int t = tile * Shape::kTile + p * Shape::kRows + 32 * half + lane;
        const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
        q.blk = t < kr.len && page < view.max_blocks_per_seq ? kr.table[page] : Id(0);
        return q;
      }
      return q;
    };
    Ahead q0 = gen(), q1 = gen();
    int live = 0;
    while (q0.valid) {
      detail::KeyRowAddr<T, Id> ka{};
      ka.block_elems = q0.block_elems;
      ka.token_stride = q0.token_stride;
      ka.head_off = q0.head_off;
      const int t_first = q0.tile * Shape::kTile + p * Shape::kRows + 32 * half;  // this warp's first key
      const int n_valid = q0.len - t_first;  // keys r >= n_valid are zero-filled
      const int t = t_first + lane;
      const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
      const std::uint32_t mine =  // chunk offset of key 32·half + lane
          lane < n_valid ? detail::key_chunk_offset(ka, q0.blk, t - page * view.block.block_size) : 0u;
      const int st = live % kStages;
      if (live >= kStages) detail::mbar_wait(empty_bar(p, st), static_cast<unsigned>(((live / kStages) & 1) ^ 1));
      // copy i: chunk lane % CPR of key i·(32 / CPR) + lane / CPR (whole keys per instruction)
      constexpr int kKeysPerCopy = 32 / CPR;
      const int cc = lane % CPR, sub = lane / CPR;
      const std::uint32_t dst0 = a_tile(p, st);
      const unsigned long long base = reinterpret_cast<unsigned long long>(q0.range) + static_cast<unsigned>(cc) * 16u;
      const std::uint64_t policy = detail::l2_stream_policy();
#pragma unroll
      for (int i = 0; i < 32 / kKeysPerCopy; ++i) {
        const int r = i * kKeysPerCopy + sub;  // key of this warp's 32
        const std::uint32_t o = __shfl_sync(0xffffffffu, mine, r);
        detail::score_cp_async_16_or_zero(dst0 + detail::ws_chunk_offset(32 * half + r, cc),
                                          detail::chunk_address(base, o), r >= n_valid, policy);
      }
      detail::mbar_arrive_on_cp_async(full_bar(p, st));
      ++live;
      q0 = q1;
      q1 = gen();
    }
    return;  // the copies complete on their own
  }

  // ---- consumers: the MMA warpgroup (warps 0-3) and the norm warps ----
  const auto consumers_sync = [&]() { asm volatile("bar.sync 1, %0;" ::"n"(Shape::kConsumerThreads) : "memory"); };
  using Pre = detail::RowFoldInputs<F, GH, Shape::kConsumerThreads, false, true>;
  static_assert(Pre::kItems == 1, "one fold item (head, frequency) per consumer thread at most");
  Pre pre;
  const auto load_pre = [&](long long r) { pre.load(m, a, view.seq_lens, r, L, Hkv, HC); };
  // The per-model cos/sin(δω_f) tables stay in shared memory (copied once, in flight with the
  // first row's inputs); a sequence's phases (t0 + δ)ω_f come by angle addition from cos/sin(t0·ω_f)
  // of the thread's fold frequency.
  const bool angle_tables = m.offset_cos != nullptr;
  if (angle_tables) {
    detail::copy_offset_tables_async(cs_s, sn_s, m, D, F, static_cast<int>(threadIdx.x), Shape::kConsumerThreads);
  }
  detail::score_cp_async_commit();
  load_pre(row0);
  detail::score_cp_async_wait<0>();  // made visible to all by the first fold's barrier

  // Row change (uniform across the consumers): once every consumer is done with the old weights,
  // the MMA threads write the new row's B tiles (K-major core matrices [k-step][split][n-tile]
  // [k-chunk][column][8], column n of n-tile nt = (δ = 2·nt + n/4, head n%4)) and c.
  // A new sequence's phases come from the norm warps: sincos has a slow path that is a call, and
  // ptxas (CUDA 13.0) cannot apply setmaxnreg to a warpgroup whose code calls (it crashed).
  int w_b = -1;
  double* const ph_c = reinterpret_cast<double*>(ws_smem + Shape::kPhaseOff);  // cos(t0·ω_f) [F]
  double* const ph_s = ph_c + F;                                                 // sin(t0·ω_f) [F]
  long long w_row = -1;
  // is_norm: std::true_type in the norm warps' copy, false_type in the MMA warpgroup's (which then
  // holds no sincos code at all).
  const auto fold_row = [&](auto is_norm) {
    consumers_sync();
    if (pre.row.b != w_b) {  // uniform across the consumers
      if constexpr (decltype(is_norm)::value) {
        detail::sequence_phases(angle_tables, pre.t0, m, D, F, static_cast<int>(threadIdx.x) - 32 * Shape::kMmaWarps,
                                32 * Shape::kNormWarps, ph_c, ph_s, cs_s, sn_s);
      }
      consumers_sync();
    }
    const int item = static_cast<int>(threadIdx.x);
    if (item < GH * F) {
      int h, f;
      Pre::item_hf(item, h, f);
      const double ct = ph_c[f], st = ph_s[f];
      const int hg = pre.row.hc * GH + h;
      const float c = pre.c[0];  // 0 past the group
      reinterpret_cast<float*>(c_s)[(f + f / 8) * 4 + h] = c;
      auto* b16 = reinterpret_cast<std::uint16_t*>(ws_smem + Shape::kBOff);
      const int e_re = rope_pair_re(S, f, HD), e_im = rope_pair_im(S, f, HD);
      for (int o = 0; o < 2 * NT; ++o) {
        // columns past |D| repeat offset D - 1's weights: their products equal that column's, so
        // the max over every column is the max over D and the MMA warpgroup needs no selects
        const int od = o < D ? o : D - 1;
        float wr = 0.0f, wi = 0.0f;
        if (hg < G)
          detail::offset_weight(pre.q_re[0], pre.q_im[0], cs_s[od * F + f], sn_s[od * F + f], angle_tables, ct, st, m.s2,
                                &wr, &wi);
        detail::store_wgmma_b_weight<Tr, SP>(b16, wr, wi, e_re, e_im, o, h, NT);
      }
    }
#ifdef TRIATTN_WGMMA_ENABLED
    detail::fence_proxy_async_smem();  // the B tiles are read by wgmma
#endif
    w_b = pre.row.b;
    consumers_sync();
  };

  // Advances `cur` to its next item with keys; returns false when the CTA's range is done. On the
  // first item of a new row it folds the row's weights (every consumer takes part; no MMA is in
  // flight between items) and loads the next row's inputs ahead.
  Cursor cur{row0, tile0, it_end - it0};
  int live = 0;
  detail::ScoreRow row{};
  int len = 0;
  const auto next_item = [&](int& tile, auto is_norm) -> bool {
    while (cur.n > 0) {
      const long long rid = cur.rid;
      tile = cur.tile;
      if (++cur.tile == tiles_per_row) {
        cur.tile = 0;
        ++cur.rid;
      }
      --cur.n;
      if (pre.rid != rid) load_pre(rid);  // not loaded ahead (a skipped row)
      if (tile * Shape::kTile >= pre.len) {
        if (rid < last_row) load_pre(rid + 1);
        continue;  // no keys in this item (every role skips it)
      }
      if (rid != w_row) {
        fold_row(is_norm);
        w_row = rid;
        row = pre.row;  // what the stores of this row need
        len = pre.len;
        if (rid < last_row) load_pre(rid + 1);  // in flight while this row streams
      }
      return true;
    }
    return false;
  };

  if (warp < Shape::kMmaWarps) {  // ---- the MMA warpgroup: each item's tiles ----
    detail::ws_set_max_registers<Shape, kChains, detail::WsRole::kMma>();
    const int wig = warp;
    const int g4 = lane >> 2, c4 = lane & 3;
    struct Pending {
      int grp;  // ring (tile of the item)
      int stage;
      unsigned parity;
      int key0;  // the tile's first key
    };
    // Max over δ (lane c4 holds δ parity c4/2 of heads 2(c4 & 1) + i), plus the norm term, stored.
    const auto finish = [&](float (&dc)[kChains][36], const Pending& pd) {
      float(&d)[36] = dc[0];
#pragma unroll
      for (int c = 1; c < kChains; ++c)
#pragma unroll
        for (int v = 0; v < 36; ++v) d[v] += dc[c][v];
      float best[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};  // [2·q + i]: row g4 + 8q, head 2(c4 & 1) + i
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)  // every column: those past |D| repeat offset D - 1 (fold_row)
#pragma unroll
        for (int v = 0; v < 4; ++v) best[v] = fmaxf(best[v], d[4 * nt + v]);
#pragma unroll
      for (int v = 0; v < 4; ++v) best[v] = fmaxf(best[v], __shfl_xor_sync(0xffffffffu, best[v], 2));
      detail::mbar_wait(nfull_bar(pd.grp, pd.stage), pd.parity);
      if (c4 < 2) {
        const float4* nb = norm_s + (pd.grp * kStages + pd.stage) * Shape::kRows;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int r = 16 * wig + 8 * q + g4, t = pd.key0 + r;
          if (t >= len) continue;
          const float2 nv = reinterpret_cast<const float2*>(nb + r)[c4];  // heads 2·c4, 2·c4 + 1
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int hg = row.hc * GH + 2 * c4 + i;
            if (hg >= G) continue;
            const std::int64_t o =
                ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
            scores[o] = best[2 * q + i] + (i == 0 ? nv.x : nv.y);
          }
        }
      }
      detail::mbar_arrive(empty_bar(pd.grp, pd.stage));  // this lane is done with the stage
    };
    // Per item: the products of the item's tiles issued back to back, then each tile's max and
    // stores while the later tiles' MMAs run. Every accumulator is waited for within its item, so
    // the loop's data-dependent control flow holds no MMA in flight (ptxas serialized every wgmma
    // of a variant that kept one pending across items: C7518, WG.DP in a divergent path).
    constexpr int kTilesPerWg = Shape::kGroups;
    static_assert(kTilesPerWg == 2, "the waits below assume two tiles per item");
    float d[kTilesPerWg][kChains][36];
    int tile = 0;
    while (next_item(tile, std::false_type{})) {
      Pending pd[kTilesPerWg];
#pragma unroll
      for (int j = 0; j < kTilesPerWg; ++j) {
        pd[j].grp = j;
        pd[j].stage = live % kStages;
        pd[j].parity = static_cast<unsigned>((live / kStages) & 1);
        pd[j].key0 = tile * Shape::kTile + pd[j].grp * Shape::kRows;
        detail::mbar_wait(full_bar(pd[j].grp, pd[j].stage), pd[j].parity);
#ifdef TRIATTN_WGMMA_ENABLED
        detail::fence_proxy_async_smem();  // the producer's cp.async writes, read by wgmma (async proxy)
#endif
        detail::ws_fence_operands(d[j]);
        detail::ws_tile_products<T, KS, SP, kChains>(d[j], a_tile(pd[j].grp, pd[j].stage), b_base, wig, lane);
      }
      ++live;
#pragma unroll
      for (int j = 0; j < kTilesPerWg; ++j) {
        if (j + 1 < kTilesPerWg)
          detail::ws_wait_products<1>();
        else
          detail::ws_wait_products<0>();
        detail::ws_fence_operands(d[j]);
        finish(d[j], pd[j]);
      }
    }
  } else {  // ---- norm warp nw: key 32·(nw % 2) + lane of MMA warpgroup nw / 2's tiles ----
    detail::ws_set_max_registers<Shape, kChains, detail::WsRole::kNorm>();
    const int nw = warp - Shape::kMmaWarps, grp = nw >> 1;
    const int r = 32 * (nw & 1) + lane;
    int tile = 0;
    while (next_item(tile, std::true_type{})) {
      const int stg = live % kStages;
      const unsigned par = static_cast<unsigned>((live / kStages) & 1);
      ++live;
      detail::mbar_wait(full_bar(grp, stg), par);
      norm_s[(grp * kStages + stg) * Shape::kRows + r] = detail::ws_key_norm<T, S, HD>(a_tile(grp, stg), r, c_s);
      detail::mbar_arrive(nfull_bar(grp, stg));  // the norm terms are written
      detail::mbar_arrive(empty_bar(grp, stg));  // and the tile read
    }
  }
}

}  // namespace triattn::cuda

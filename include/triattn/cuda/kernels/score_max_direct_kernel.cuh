// SPDX-License-Identifier: Apache-2.0
// Tensor-core max scorer with each thread's keys in its own shared-memory slots (16-bit caches,
// |D| <= 18; ScoreOptions::max_variant 7 and 8). Same contract as score_max_mma_pipe_kernel.
//
// Why: the ring scorers copy keys into a swizzled per-warp ring with a handshake per slice and
// read them back with ldmatrix; their max variants measured 35-39 µs at one 32K layer with no
// unit of the SM full (ncu, 2026-12-02). Here:
//  - thread (warp w, lane 4·g4 + c4) of the CTA's one warpgroup owns key rows 16w + g4 and + 8 of
//    each 64-key tile and copies 16-byte chunks 4j + c4 of both (j < HD/32) into slots of its own
//    (cp.async, L2 evict-first; no barrier, no swizzle: a warp's copies and reads are 512
//    contiguous bytes). Read back in the permuted element order of score_max_mma_kernel (k-step
//    2j + h takes words 2h, 2h + 1 of chunk j), those words are the warpgroup MMA's A fragments
//    as they are: no shuffle, no conversion;
//  - the weights (B, bf16 hi + mid or fp16 hi + lo) sit in shared memory in the same permuted k
//    order, column n of n-tile nt = (head n / 2, δ = 2·nt + n % 2): lane c4's accumulators hold
//    head c4 for every δ, so the max over δ needs no shuffle;
//  - the norm term Σ_f c_f·|K_f| is computed from the same registers (a lane holds whole pairs in
//    both RoPE pairings) while the tile's MMAs run, then reduce-scattered over the quad;
//  - kBufs slots per thread: kBufs tiles are in flight while one is multiplied (a slot is refilled
//    as soon as its words are in registers); each tile's products are waited for inside its step,
//    so no MMA is pending across the loop's data-dependent control flow (ptxas serializes wgmma
//    otherwise).
// Keys loaded straight into registers, kept in flight across steps, measured 51.6 µs at one 32K
// layer (H200, 2026-12-02): every wgmma.fence waited for the newest of those loads too.
// Each CTA (one warpgroup) walks a contiguous range of (row, 64-key tile) items; a row change
// re-folds the weights (cos/sin(δω_f) tables in shared memory, angle addition per sequence).
// sm_90a only: in builds without it max_variant 7 and 8 run as 4 (see the kernel's first lines).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <triattn/cuda/kernels/score_kernel.cuh>
#include <triattn/cuda/kernels/wgmma.cuh>

namespace triattn::cuda {

namespace detail {

/// Shape and shared-memory map of score_max_direct_kernel.
template <class T, int HD, int kBufs>
struct MaxDirectShape : MaxWeightTiles<HD> {
  using W = MaxWeightTiles<HD>;
  using W::kBBytes, W::kCBytes, W::kF;
  static constexpr int kChunks = HD / 32;  // 16-byte chunks a thread loads per key row
  static constexpr int kThreads = 128;     // one warpgroup
  static constexpr int kTile = 64;         // keys per item (one m64 tile)
  // a key slot: one tile's words, [chunk j][row i][thread] 16 bytes (each thread's own chunks)
  static constexpr std::size_t kSlotBytes = static_cast<std::size_t>(kChunks) * 2 * kThreads * 16;
  // [key slots] | [B: k-step][term] | c [slot f + f/8] float4 | cos, sin(t0·ω_f) [F] double |
  // cos, sin [|D|][F] double
  static constexpr std::size_t kBOff = kSlotBytes * kBufs;
  static constexpr std::size_t kCOff = kBOff + kBBytes;
  static constexpr std::size_t kPhaseOff = kCOff + kCBytes;
  static constexpr std::size_t kTablesOff = kPhaseOff + static_cast<std::size_t>(kF) * 2 * sizeof(double);
  static_assert(kBOff % 128 == 0 && kCOff % 16 == 0 && kTablesOff % 16 == 0, "alignment");
  static constexpr std::size_t smem_bytes(int num_offsets) {
    return kTablesOff + static_cast<std::size_t>(num_offsets) * kF * 2 * sizeof(double);
  }
};

/// Static shared memory of score_max_direct_kernel in builds without sm_90a (a marker; see there).
inline constexpr int kDirectNoWgmmaMarkerBytes = 8192;

/// Position of key element e in the permuted k order of the A fragments above: 16·(k-step) + k.
/// Element e = 32j + 8c + 2w + b sits in chunk j of lane c, word w: k-step 2j + w/2, fragment
/// register a0 (w even) or a2 (w odd), i.e. k = 2c + b (+ 8 for a2).
__host__ __device__ constexpr int direct_k_index(int e) {
  return 16 * (2 * (e >> 5) + ((e & 7) >> 2)) + 2 * ((e & 31) >> 3) + (e & 1) + 8 * ((e & 3) >> 1);
}

/// One key tile's share of a thread: [row 16w + g4 + 8i][chunk j][word].
template <int NC>
using DirectKeyWords = std::uint32_t[2][NC][4];

/// Σ_f c_f·|K_f| of the thread's two key rows for head c4 (out[i]: row g4 + 8i), from its words
/// (both elements of each of its pairs are in its own chunks), reduce-scattered over the quad.
/// c_s: c as [slot f + f/8] float4 (4 heads).
template <class T, RopeStyle S, int NC>
__device__ __forceinline__ void direct_tile_norms(float (&out)[2], const DirectKeyWords<NC>& k, const float4* c_s,
                                                  int c4) {
  float4 acc[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
  const auto add = [&](int i, float re, float im, const float4& c) {
    const float n = pair_norm(fmaf(re, re, fmaf(im, im, 1e-8f)));
    acc[i].x = fmaf(c.x, n, acc[i].x);
    acc[i].y = fmaf(c.y, n, acc[i].y);
    acc[i].z = fmaf(c.z, n, acc[i].z);
    acc[i].w = fmaf(c.w, n, acc[i].w);
  };
  if constexpr (S == RopeStyle::kHalf) {  // pair f = elements (f, f + HD/2): chunks j and j + NC/2
#pragma unroll
    for (int j = 0; j < NC / 2; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int f = 32 * j + 8 * c4 + e;
        const float4 c = c_s[f + f / 8];
#pragma unroll
        for (int i = 0; i < 2; ++i) add(i, element<T>(k[i][j], e), element<T>(k[i][j + NC / 2], e), c);
      }
  } else {  // pair f = elements (2f, 2f + 1): one word
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int f = 16 * j + 4 * c4 + w;
        const float4 c = c_s[f + f / 8];
#pragma unroll
        for (int i = 0; i < 2; ++i) add(i, element<T>(k[i][j], 2 * w), element<T>(k[i][j], 2 * w + 1), c);
      }
  }
  // reduce-scatter over the quad: lanes with bit 1 of c4 keep heads 2, 3 after the xor-2 step,
  // then bit 0 picks one of the two
  const bool hi = (c4 & 2) != 0, odd = (c4 & 1) != 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float h[4] = {acc[i].x, acc[i].y, acc[i].z, acc[i].w};
    float v[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float keep = hi ? h[2 + x] : h[x];
      const float give = hi ? h[x] : h[2 + x];
      v[x] = keep + __shfl_xor_sync(0xffffffffu, give, 2);
    }
    const float keep = odd ? v[1] : v[0];
    const float give = odd ? v[0] : v[1];
    out[i] = keep + __shfl_xor_sync(0xffffffffu, give, 1);
  }
}

#ifdef TRIATTN_WGMMA_ENABLED  // the kernel has no other path (see its first lines)
/// The tile's [64 x HD]·[HD x 72] products into d (wgmma accumulator layout: d[4·nt + v] = column
/// 8·nt + 2·c4 + (v & 1) of row 16w + g4 + 8·(v >> 1)), both weight terms into the same
/// accumulators. b_base: shared address of the B tiles [k-step][term].
template <class T, int KS, int SP, int NC>
__device__ __forceinline__ void direct_tile_products(float (&d)[36], const DirectKeyWords<NC>& k, std::uint32_t b_base) {
  constexpr std::uint32_t kBTile = kWgmmaMaxNTiles * 256;
  const std::uint64_t b_desc = wgmma_desc_kmajor(b_base, 128u, 256u);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    const int j = s >> 1, h2 = (s & 1) * 2;
    const std::uint32_t a[4] = {k[0][j][h2], k[1][j][h2], k[0][j][h2 + 1], k[1][j][h2 + 1]};
#pragma unroll
    for (int x = 0; x < SP; ++x)
      wgmma_m64n72k16_rs<std::is_same_v<T, f16_storage>>(
          d, a, wgmma_desc_advance(b_desc, static_cast<std::uint32_t>(s * SP + x) * kBTile), s + x);
  }
  wgmma_commit();
}

/// Waits for the tile's products, then pins the accumulators and the A registers after the wait:
/// the compiler sees no register dependency between an asynchronous wgmma and its wait, so it
/// could otherwise read d early, or reuse A's registers while the tensor cores still read them
/// (CUTLASS fences register operands of RS-mode wgmma the same way; a precaution here: no build
/// without the A fence was measured correct or wrong, the wrong scores of runs 2-3 had another
/// cause).
template <int NC>
__device__ __forceinline__ void direct_wait_products(float (&d)[36], DirectKeyWords<NC>& k) {
  wgmma_wait<0>();
#pragma unroll
  for (int v = 0; v < 36; ++v) asm volatile("" : "+f"(d[v])::"memory");
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
      for (int w = 0; w < 4; ++w) asm volatile("" : "+r"(k[i][j][w])::"memory");
}
#endif

}  // namespace detail

/// Tensor-core max-aggregation scorer with thread-private key slots (see the top of this file);
/// dynamic shared memory MaxDirectShape<T, HD, kBufs>::smem_bytes(|D|), |D| <= 2·kWgmmaMaxNTiles.
/// kBufs (>= 1): key slots per thread (kBufs tiles in flight while one is multiplied).
template <class T, class Id, int HD, RopeStyle S, int kBufs, int kMinCtas>
__global__ void __launch_bounds__(detail::MaxDirectShape<T, HD, kBufs>::kThreads, kMinCtas)
    score_max_direct_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                            detail::FastDiv fd) {
  detail::griddep_launch_dependents();  // the round's next kernel waits for this grid's completion
  static_assert(kBufs >= 1, "at least one tile in flight");
#ifndef TRIATTN_WGMMA_ENABLED
  // Builds without sm_90a: never launched. The static shared memory of this marker is how
  // launch_score_max_direct tells such a build (cudaFuncAttributes::sharedSizeBytes >=
  // kDirectNoWgmmaMarkerBytes; the sm_90a kernel has none, whether or not the 1 KB the system
  // reserves per CTA is counted) and runs max_variant 4 instead: this kernel's mma.sync twin
  // stopped with an illegal instruction on the H200 (2026-12-02, test_cuda_test_score_sm_90) and
  // was removed rather than shipped unexplained.
  volatile __shared__ int direct_kernel_without_wgmma[detail::kDirectNoWgmmaMarkerBytes / 4];
  if (threadIdx.x == 0) direct_kernel_without_wgmma[0] = 0;
  (void)view, (void)m, (void)a, (void)scores, (void)fd;
#else
  using Shape = detail::MaxDirectShape<T, HD, kBufs>;
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, SP = Shape::kSplits, GH = Shape::kHeads, NC = Shape::kChunks;
  constexpr int NT = Shape::kNT, kTile = Shape::kTile;
  extern __shared__ __align__(128) unsigned char direct_smem[];
  const std::uint32_t keys_base = detail::score_smem_addr(direct_smem);
  const std::uint32_t b_base = keys_base + static_cast<std::uint32_t>(Shape::kBOff);
  float4* const c_s = reinterpret_cast<float4*>(direct_smem + Shape::kCOff);
  double* const ph_c = reinterpret_cast<double*>(direct_smem + Shape::kPhaseOff);  // cos(t0·ω_f) [F]
  double* const ph_s = ph_c + F;                                                   // sin(t0·ω_f) [F]
  double* const cs_s = reinterpret_cast<double*>(direct_smem + Shape::kTablesOff);  // [D][F]
  const int D = m.num_offsets;
  double* const sn_s = cs_s + static_cast<std::size_t>(D) * F;

  const detail::ScoreWork work(m, a, GH, kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  const long long it0 = work.begin, it_end = work.end;
  if (it_end <= it0 || D <= 0) return;  // uniform across the CTA
  const long long row0 = it0 / tiles_per_row, last_row = (it_end - 1) / tiles_per_row;
  const int tile0 = static_cast<int>(it0 - row0 * tiles_per_row);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
  const int g4 = lane >> 2, c4 = lane & 3;
  const int block_size = view.block.block_size;

  // Row inputs (length, t0, q̄, c) ahead in registers; the per-model cos/sin(δω_f) tables copied
  // into shared memory with them (both in flight while the first key tiles are requested).
  using Pre = detail::RowFoldInputs<F, GH, Shape::kThreads, false>;
  Pre pre;
  const auto load_pre = [&](long long r) { pre.load(m, a, view.seq_lens, r, L, Hkv, HC); };
  const bool angle_tables = m.offset_cos != nullptr;
  if (angle_tables)
    detail::copy_offset_tables_async(cs_s, sn_s, m, D, F, static_cast<int>(threadIdx.x), Shape::kThreads);
  detail::score_cp_async_commit();
  load_pre(row0);

  // ---- load cursor: the next item with keys, its two block-table entries for this thread issued
  // one item before its key loads (a lookup in line with the loads would stall the warp) ----
  struct Cursor {
    long long rid;
    int tile;
    long long n;  // items left
  } lc{row0, tile0, it_end - it0};
  long long kr_row = -1;
  detail::KeyRowAddr<T, Id> kr{};
  struct Ahead {
    bool valid;
    long long rid;
    int tile, len;
    const T* base;  // K range of the row's layer, at its KV head (+ this lane's chunk 0)
    std::int64_t block_elems, token_stride;
    Id blk[2];
    int slot[2];
  };
  const auto gen = [&]() -> Ahead {
    Ahead q{};
    q.valid = false;
    while (lc.n > 0) {
      const long long rid = lc.rid;
      const int tile = lc.tile;
      if (rid != kr_row) {
        const detail::ScoreRow sr = detail::decode_score_row(rid, L, Hkv, HC);
        kr = detail::key_row(view, a, sr.b, sr.l, sr.g);
        kr_row = rid;
      }
      if (tile * kTile >= kr.len) {  // no keys here nor in the row's later tiles
        lc.n -= tiles_per_row - tile;
        ++lc.rid;
        lc.tile = 0;
        continue;
      }
      if (++lc.tile == tiles_per_row) {
        lc.tile = 0;
        ++lc.rid;
      }
      --lc.n;
      q.valid = true;
      q.rid = rid;
      q.tile = tile;
      q.len = kr.len;
      q.base = kr.range + kr.head_off + 8 * c4;
      q.block_elems = kr.block_elems;
      q.token_stride = kr.token_stride;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int t = tile * kTile + 16 * warp + g4 + 8 * i;
        const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
        q.slot[i] = t - page * block_size;
        q.blk[i] = t < kr.len && page < view.max_blocks_per_seq ? kr.table[page] : Id(0);
      }
      return q;
    }
    return q;
  };
  // Thread-private key slots: chunk j of row i of slot `slot` at [slot][j][i][thread], so the
  // copies and the thread's own reads of them (LDS.128, 512 contiguous bytes per warp) are
  // conflict-free and need no barrier. The tile's words land in registers only when it is used
  // (see the top of this file).
  const std::uint64_t policy = detail::l2_stream_policy();
  using Words = detail::DirectKeyWords<NC>;
  const auto word_addr = [&](int slot, int j, int i) {
    return keys_base + static_cast<std::uint32_t>(((slot * NC + j) * 2 + i) * Shape::kThreads * 16) +
           static_cast<std::uint32_t>(threadIdx.x) * 16u;
  };
  const auto issue = [&](const Ahead& q, int slot) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = q.tile * kTile + 16 * warp + g4 + 8 * i;
      const bool zero = !q.valid || t >= q.len;  // past the row's length: zeros (computed, never stored)
      const T* p = q.base + static_cast<std::int64_t>(q.blk[i]) * q.block_elems +
                   static_cast<std::int64_t>(q.slot[i]) * q.token_stride;
#pragma unroll
      for (int j = 0; j < NC; ++j)
        detail::score_cp_async_16_or_zero(word_addr(slot, j, i), reinterpret_cast<unsigned long long>(p + 32 * j),
                                          zero, policy);
    }
    detail::score_cp_async_commit();
  };
  const auto read_slot = [&](int slot, Words& k) {
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(k[i][j][0]), "=r"(k[i][j][1]), "=r"(k[i][j][2]), "=r"(k[i][j][3])
                     : "r"(word_addr(slot, j, i)));
  };

  // ---- the weights of a row (every thread of the CTA; no MMA is in flight between tiles) ----
  long long w_row = -1;
  int w_b = -1, len = 0;
  detail::ScoreRow row{};
  const auto fold_row = [&](long long rid) {
    if (pre.rid != rid) load_pre(rid);  // not loaded ahead (a skipped row)
    __syncthreads();  // every warp is done with the previous row's weights (and the first step
                      // waited for the angle tables' copies, the oldest group)
    if (pre.row.b != w_b) {  // a new sequence: its phases
      detail::sequence_phases(angle_tables, pre.t0, m, D, F, static_cast<int>(threadIdx.x), Shape::kThreads, ph_c, ph_s,
                              cs_s, sn_s);
      __syncthreads();
    }
    auto* b16 = reinterpret_cast<std::uint16_t*>(direct_smem + Shape::kBOff);
#pragma unroll
    for (int j = 0; j < Pre::kItems; ++j) {
      const int item = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
      if (item >= GH * F) break;
      int h, f;
      Pre::item_hf(item, h, f);
      const int hg = pre.row.hc * GH + h;
      reinterpret_cast<float*>(c_s)[(f + f / 8) * 4 + h] = pre.c[j];  // 0 past the group
      const int k_re = detail::direct_k_index(rope_pair_re(S, f, HD));
      const int k_im = detail::direct_k_index(rope_pair_im(S, f, HD));
      const double ct = angle_tables ? ph_c[f] : 1.0, st = angle_tables ? ph_s[f] : 0.0;
      // kFoldBatch offsets at a time, their cos/sin read before any of their math: the float64
      // chains of different offsets are independent, so they overlap
      constexpr int kFoldBatch = 6;
      static_assert((2 * NT) % kFoldBatch == 0, "whole batches of offset columns");
#pragma unroll 1
      for (int o0 = 0; o0 < 2 * NT; o0 += kFoldBatch) {
        double cs_b[kFoldBatch], sn_b[kFoldBatch];
        detail::load_offset_phases<kFoldBatch>(cs_b, sn_b, cs_s, sn_s, o0, D, F, f);
#pragma unroll
        for (int u = 0; u < kFoldBatch; ++u) {
          const int o = o0 + u;
          float wr = 0.0f, wi = 0.0f;
          if (hg < G)
            detail::offset_weight(pre.q_re[j], pre.q_im[j], cs_b[u], sn_b[u], angle_tables, ct, st, m.s2, &wr, &wi);
          const int n = 2 * h + (o & 1);  // column of n-tile o / 2: lane h's accumulators
#pragma unroll
          for (int part = 0; part < 2; ++part) {
            std::uint16_t sp[SP];
            Tr::template split<SP>(part == 0 ? wr : wi, sp);
            detail::store_wgmma_b_terms<SP>(b16, sp, part == 0 ? k_re : k_im, o >> 1, n, NT);
          }
        }
      }
    }
    detail::fence_proxy_async_smem();  // the B tiles are read by wgmma
    __syncthreads();
    row = pre.row;
    len = pre.len;
    w_b = row.b;
    w_row = rid;
    if (rid < last_row) load_pre(rid + 1);  // in flight while this row streams
  };

  // ---- the loop: slot j holds the item of step j (mod kBufs); kBufs tiles in flight while
  // one is multiplied (its slot is refilled once its words are in registers) ----
  long long b_rid[kBufs];
  int b_tile[kBufs];
  bool b_valid[kBufs];
  {
    Ahead first[kBufs];
#pragma unroll
    for (int j = 0; j < kBufs; ++j) first[j] = gen();  // table lookups in flight together
#pragma unroll
    for (int j = 0; j < kBufs; ++j) {
      issue(first[j], j);
      b_rid[j] = first[j].rid;
      b_tile[j] = first[j].tile;
      b_valid[j] = first[j].valid;
    }
  }
  Ahead nxt = gen();
  float d[36];
  const auto step = [&](auto jc) -> bool {
    constexpr int j = decltype(jc)::value;
    if (!b_valid[j]) return false;  // uniform across the CTA
    detail::score_cp_async_wait<kBufs - 1>();  // this thread's copies of the tile (and older groups)
    Words k;
    read_slot(j, k);
    if (b_rid[j] != w_row) fold_row(b_rid[j]);
    const int tile = b_tile[j];
    detail::direct_tile_products<T, KS, SP, NC>(d, k, b_base);
    // The slot's words are in registers (the wgmma fence waited for them): refill it with the
    // item kBufs ahead.
    issue(nxt, j);
    b_rid[j] = nxt.rid;
    b_tile[j] = nxt.tile;
    b_valid[j] = nxt.valid;
    nxt = gen();   // its table lookups in flight until the next step's copies
    float nrm[2];  // the norm terms of head c4, computed while the products run
    detail::direct_tile_norms<T, S, NC>(nrm, k, c_s, c4);
    detail::direct_wait_products<NC>(d, k);
    float best[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};  // [row][δ parity]
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)  // every column: those past |D| repeat offset D - 1
#pragma unroll
      for (int v = 0; v < 4; ++v) best[v >> 1][v & 1] = fmaxf(best[v >> 1][v & 1], d[4 * nt + v]);
    const int hg = row.hc * GH + c4;
    if (hg < G) {
      float* const out = scores + ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int t = tile * kTile + 16 * warp + g4 + 8 * i;
        if (t < len) out[t] = fmaxf(best[i][0], best[i][1]) + nrm[i];
      }
    }
    return true;
  };
  // kBufs steps per pass (the buffers' indices compile-time), until the range is done
  const auto pass = [&](auto... jc) { return (step(jc) && ...); };
  const auto all_steps = [&]<int... J>(std::integer_sequence<int, J...>) {
    while (pass(std::integral_constant<int, J>{}...)) {
    }
  };
  all_steps(std::make_integer_sequence<int, kBufs>{});
#endif
}

}  // namespace triattn::cuda

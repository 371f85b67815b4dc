// SPDX-License-Identifier: Apache-2.0
// Pipelined tensor-core max-aggregation scorer for 16-bit caches (score_max_mma_pipe_kernel).
#pragma once

#include <triattn/cuda/kernels/score/key_ring.cuh>
#include <triattn/cuda/kernels/wgmma.cuh>

namespace triattn::cuda {

// ---------------------------------------------------------------------------------------------
// Max aggregation on the tensor cores, pipelined (16-bit caches).
// The same dot products and max as score_max_mma_kernel, on ldmatrix A fragments in natural
// element order. Around them: keys arrive through per-warp cp.async rings (KeySliceFeed), so a
// warp's next slices are in flight while it runs its MMAs; the |D|·F float64 cos/sin of
// (t0 + δ)·ω are computed once per (CTA, sequence) into shared memory, so a row change only
// re-folds q̄; the dot products run as warpgroup MMAs (sm_90a, |D| <= 18) or mma.sync, the norm
// term as fp32 FMAs (norm_tile_ffma).
// ---------------------------------------------------------------------------------------------

/// n-tiles of B fragments the warpgroup-MMA max scorer always holds: one m64n72k16 covers
/// |D| <= 18 offsets (columns past |D| are zero weights); more offsets take the mma.sync kernel.
inline constexpr int kWgmmaMaxNTiles = 9;

namespace detail {
/// Issues the copies of the per-model cos/sin(δω_f) tables ([|D|][F] double each, from
/// m.offset_cos / m.offset_sin) into cs_s / sn_s, 16 bytes per copy, thread `tid` of `threads`
/// (the caller commits the group and waits for it before the tables are read).
__device__ __forceinline__ void copy_offset_tables_async(double* cs_s, double* sn_s, const ScoreModelView& m, int D,
                                                         int F, int tid, int threads) {
  const int chunks = D * F / 2;  // 16-byte chunks per table
  for (int i = tid; i < 2 * chunks; i += threads) {
    const bool sn = i >= chunks;
    const int ci = sn ? i - chunks : i;
    cp_async_16(smem_addr((sn ? sn_s : cs_s) + 2 * ci), (sn ? m.offset_sin : m.offset_cos) + 2 * ci, 16);
  }
}

/// Stores the SP 16-bit terms of weight element e of B column n of n-tile nt into the warpgroup-MMA
/// B tiles: K-major core matrices [k-step e/16][term][n-tile][k-chunk (e%16)/8][column][e%8]
/// (NT n-tiles per tile).
template <int SP>
__device__ __forceinline__ void store_wgmma_b_terms(std::uint16_t* b16, const std::uint16_t (&sp)[SP], int e, int nt,
                                                    int n, int NT) {
#pragma unroll
  for (int x = 0; x < SP; ++x)
    b16[((((static_cast<std::size_t>(e >> 4) * SP + x) * NT + nt) * 2 + ((e >> 3) & 1)) * 8 + n) * 8 + (e & 7)] = sp[x];
}
/// The folded weight (wr, wi) of offset column o and head h as SP 16-bit terms each (Tr::split),
/// stored at its pair's elements e_re, e_im of B column (o & 1)·4 + h of n-tile o / 2.
template <class Tr, int SP>
__device__ __forceinline__ void store_wgmma_b_weight(std::uint16_t* b16, float wr, float wi, int e_re, int e_im, int o,
                                                     int h, int NT) {
  const int n = (o & 1) * 4 + h;  // column within n-tile o/2
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    std::uint16_t sp[SP];
    Tr::template split<SP>(part == 0 ? wr : wi, sp);
    store_wgmma_b_terms<SP>(b16, sp, part == 0 ? e_re : e_im, o >> 1, n, NT);
  }
}
/// The same weight into the mma.sync B fragments of the pipelined max scorer without wgmma:
/// [n-tile o/2][k-step][term][lane][word][half] (BFragmentSlot), KS k-steps.
template <class Tr, int SP, int KS>
__device__ __forceinline__ void store_mma_b_weight(std::uint16_t* b16, float wr, float wi, int e_re, int e_im, int o,
                                                   int h) {
  const int n = (o & 1) * 4 + h;  // column within n-tile o/2
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    std::uint16_t sp[SP];
    Tr::template split<SP>(part == 0 ? wr : wi, sp);
    const BFragmentSlot b = b_fragment_slot(part == 0 ? e_re : e_im);
    const int ln = n * 4 + b.quad_lane;
#pragma unroll
    for (int x = 0; x < SP; ++x)
      b16[((((static_cast<std::size_t>(o >> 1) * KS + b.step) * SP + x) * 32 + ln) * 2 + b.word) * 2 + b.half] = sp[x];
  }
}
/// cos and sin of offsets o0 .. o0 + kBatch - 1 at frequency f from the [|D|][F] tables, loaded
/// before any of them is used (the max scorers' folds take them in batches: the float64 folds of
/// a batch are independent, so their chains overlap). Offsets past |D| repeat offset D - 1: their
/// weights, hence their products, equal that column's, so a max over every column is the max
/// over D without a select.
template <int kBatch>
__device__ __forceinline__ void load_offset_phases(double (&cs_b)[kBatch], double (&sn_b)[kBatch], const double* cs_s,
                                                   const double* sn_s, int o0, int D, int F, int f) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int od = o0 + u < D ? o0 + u : D - 1;
    cs_b[u] = cs_s[od * F + f];
    sn_b[u] = sn_s[od * F + f];
  }
}
/// The cos/sin of a sequence's phases for the max scorers' folds, by threads i = tid, tid +
/// threads, ...: with the per-model cos/sin(δω_f) tables (angle_tables), cos/sin(t0·ω_f) into
/// ph_c / ph_s [F] (offset_weight adds the angles); without them the whole (t0 + δ)·ω_f table into
/// cs_s / sn_s [|D|][F].
__device__ __forceinline__ void sequence_phases(bool angle_tables, long long t0, const ScoreModelView& m, int D, int F,
                                                int tid, int threads, double* ph_c, double* ph_s, double* cs_s,
                                                double* sn_s) {
  if (angle_tables) {
    for (int f = tid; f < F; f += threads) rope_cos_sin(t0, m.omega[f], ph_c[f], ph_s[f]);
  } else {
    for (int it = tid; it < D * F; it += threads)
      rope_cos_sin(t0 + static_cast<long long>(m.offsets[it / F]), m.omega[it % F], cs_s[it], sn_s[it]);
  }
}
/// The folded weight of one offset: its phase (cs, sn) from the tables, advanced by the sequence's
/// (ct, st) = cos/sin(t0·ω_f) when the tables hold cos/sin(δω_f) (angle_tables), folded with q̄.
__device__ __forceinline__ void offset_weight(double q_re, double q_im, double cs, double sn, bool angle_tables,
                                              double ct, double st, double s2, float* wr, float* wi) {
  if (angle_tables) {  // cos/sin((t0 + δ)ω) by angle addition
    const double cd = cs, sd = sn;
    cs = ct * cd - st * sd;
    sn = st * cd + ct * sd;
  }
  fold_weight_from_phase_unit(q_re, q_im, cs, sn, s2, wr, wi);
}
}  // namespace detail

/// 16-bit terms per weight of the pipelined max scorer (bf16 hi + mid, fp16 hi + lo): weights to
/// 2^-17 of their size, a third fewer MMAs than bf16's three terms.
inline constexpr int kMaxPipeSplits = 2;

/// Dynamic shared memory of score_max_mma_pipe_kernel: rings, c [slot] float4, cos/sin [|D|][F]
/// double, B fragments (mma.sync: [ceil(|D|/2)][k-step][split][lane] uint2; wgmma: [k-step][split]
/// x kWgmmaMaxNTiles core-matrix pairs of 256 bytes), table slots [warp][kStages + 1][32].
template <class T, int HD, int kWarps, int kStages, bool kWgmma, int kKeys = 32>
constexpr std::size_t score_max_mma_pipe_smem_bytes(int num_offsets) {
  using Shape = detail::MmaMeanShape<T, HD, kWarps, kStages, kKeys>;
  const int n_tiles = kWgmma ? kWgmmaMaxNTiles : (num_offsets + 1) / 2;
  return Shape::kRingBytes + Shape::kCBytes + static_cast<std::size_t>(num_offsets) * Shape::kF * 2 * sizeof(double) +
         static_cast<std::size_t>(n_tiles) * Shape::kSteps * kMaxPipeSplits * 32 * 8 + Shape::kTableBytes;
}

/// Pipelined tensor-core max-aggregation scorer for 16-bit caches (same contract as
/// score_max_mma_kernel; dynamic shared memory score_max_mma_pipe_smem_bytes). Per-warp cp.async
/// rings; weights in kMaxPipeSplits 16-bit terms; the norm term Σ_f c_f·|K_f| as fp32 FMAs on the
/// CUDA cores (norm_tile_ffma), off the tensor pipe. kWgmma (|D| <= 18, kWarps a multiple of 4):
/// the dot products as warpgroup MMAs (m64n72k16, A from registers, B from shared memory) where
/// the build targets sm_90a, else mma.sync. kKeys: keys per warp slice (32: two m16 tiles).
template <class T, class Id, int HD, RopeStyle S, int kWarps, int kStages, int kMinCtas, bool kWgmma, int kKeys = 32>
__global__ void __launch_bounds__(32 * kWarps, kMinCtas)
    score_max_mma_pipe_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                              detail::FastDiv fd) {
  // The round's next kernel (row statistics) is launched dependent: it may be scheduled now and
  // waits for this grid's completion before it reads the scores.
  detail::griddep_launch_dependents();
  using Shape = detail::MmaMeanShape<T, HD, kWarps, kStages, kKeys>;
  constexpr int MT = kKeys / 16;  // m16 tiles per warp slice
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, GH = Shape::kHeads;
  constexpr int SP = kMaxPipeSplits;
  static_assert(SP <= Shape::kSplits, "no more terms than the cache type's split");
#ifdef TRIATTN_WGMMA_ENABLED
  constexpr bool kUseWgmma = kWgmma;
#else
  constexpr bool kUseWgmma = false;
#endif
  static_assert(!kWgmma || kWarps % 4 == 0, "warpgroups of 4 warps");
  const int D = m.num_offsets;
  const int NT = kUseWgmma ? kWgmmaMaxNTiles : (D + 1) / 2;  // n-tiles of B in shared memory
  extern __shared__ __align__(16) unsigned char max_pipe_smem[];
  uint4* const ring = reinterpret_cast<uint4*>(max_pipe_smem);
  float4* const c_s = reinterpret_cast<float4*>(max_pipe_smem + Shape::kRingBytes);
  double* const cs_s = reinterpret_cast<double*>(max_pipe_smem + Shape::kRingBytes + Shape::kCBytes);  // [D][F]
  double* const sn_s = cs_s + static_cast<std::size_t>(D) * F;
  uint2* const bfrag_s = reinterpret_cast<uint2*>(sn_s + static_cast<std::size_t>(D) * F);

  const detail::ScoreWork work(m, a, GH, Shape::kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  long long it0 = work.begin, it_end = work.end;
  const int n_items = static_cast<int>(it_end - it0);
  if (n_items <= 0 || D <= 0) return;  // uniform across the CTA

  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const uint4* const my_ring = ring + static_cast<std::size_t>(warp) * kStages * Shape::kSliceVecs;
  const std::uint32_t ring_addr = detail::smem_addr(my_ring);

  const long long row0 = it0 / tiles_per_row;
  const int tile0 = static_cast<int>(it0 - row0 * tiles_per_row);
  Id* const warp_slots = reinterpret_cast<Id*>(bfrag_s + static_cast<std::size_t>(NT) * KS * SP * 32) +
                         static_cast<std::size_t>(warp) * (kStages + 1) * 32;
  detail::KeySliceFeed<T, Id, HD, Shape::kTile, kKeys, kStages> feed(row0, tile0, warp_slots);
  const auto fetch = [&]() { feed.fetch(view, a, fd, tiles_per_row, L, Hkv, HC, warp, lane); };
  const auto issue = [&](int stage) {
    feed.issue(view, a, fd, tiles_per_row, L, Hkv, HC, warp, lane,
               ring_addr + static_cast<std::uint32_t>(stage * Shape::kSliceVecs * 16));
  };

  long long seen_row = -1, w_row = -1, c_rid = row0;
  int c_tile = tile0, w_b = -1, len = 0;
  detail::ScoreRow row{};

  // Row inputs (length, t0, q̄, c) ahead in registers, as in the mean scorer (RowFoldInputs).
  using Pre = detail::RowFoldInputs<F, GH, Shape::kThreads, false, kUseWgmma>;
  Pre pre;
  const auto load_pre = [&](long long r) { pre.load(m, a, view.seq_lens, r, L, Hkv, HC); };
  const long long last_row = (it_end - 1) / tiles_per_row;
  // With the cos/sin(δω_f) tables (angle addition): this thread's ω_f, and the tables copied into
  // cs_s / sn_s, both issued with the first table fetch (before the warps flood HBM with keys).
  const bool angle_tables = m.offset_cos != nullptr && !m.disable_trig;
  double omega_f = 0.0;
  bool tables_in_smem = false;  // cs_s / sn_s hold the raw cos/sin(δω) (until the first sequence's fold)
  const auto start = [&]() {
    feed.prime(view, a, L, Hkv, HC);
    load_pre(row0);
    if (angle_tables) {
      static_assert(Shape::kThreads % F == 0, "every item of a thread has the same frequency");
      omega_f = m.omega[threadIdx.x % F];
      detail::copy_offset_tables_async(cs_s, sn_s, m, D, F, static_cast<int>(threadIdx.x), Shape::kThreads);
      detail::cp_async_commit();  // run_key_ring waits for it right after start()
      tables_in_smem = true;              // visible to all after the first fold's barrier
    }
  };
  int key0 = 0;  // this warp's first key of the current item (set by prepare)
  const auto prepare = [&]() -> bool {  // the item at the compute cursor, then advance it
    long long rid;
    int tile;
    if (!detail::take_ring_item<true, Shape::kTile>(c_rid, c_tile, tiles_per_row, last_row, seen_row, row, len, pre,
                                                 load_pre, rid, tile))
      return false;
    if (rid != w_row) {  // first item of a row with keys (uniform): its weights
      __syncthreads();   // every warp is done with the previous row's fragments
      if (row.b != w_b) {
        if (angle_tables) {  // cos/sin((t0 + δ)ω) by angle addition: one sincos per thread
          double ct, st;
          detail::rope_cos_sin(pre.t0, omega_f, ct, st);
#pragma unroll 5
          for (int item = static_cast<int>(threadIdx.x); item < D * F; item += Shape::kThreads) {
            const double cd = tables_in_smem ? cs_s[item] : m.offset_cos[item];
            const double sd = tables_in_smem ? sn_s[item] : m.offset_sin[item];
            cs_s[item] = ct * cd - st * sd;
            sn_s[item] = st * cd + ct * sd;
          }
          tables_in_smem = false;
        } else {
          for (int item = static_cast<int>(threadIdx.x); item < D * F; item += Shape::kThreads) {
            const int o = item / F, f = item % F;
            detail::rope_cos_sin(pre.t0 + static_cast<long long>(m.offsets[o]), m.omega[f], cs_s[item], sn_s[item]);
          }
        }
        w_b = row.b;
        __syncthreads();
      }
      auto* b16 = reinterpret_cast<std::uint16_t*>(bfrag_s);
      float* cf = reinterpret_cast<float*>(c_s);
#pragma unroll
      for (int j = 0; j < decltype(pre)::kItems; ++j) {
        const int item = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
        if (item >= GH * F) break;
        int h, f;
        Pre::item_hf(item, h, f);
        const double qr = pre.q_re[j], qi = pre.q_im[j];  // 0 past the group
        const float c = pre.c[j];
        cf[(f + f / 8) * 4 + h] = c;
        const int e_re = rope_pair_re(S, f, HD), e_im = rope_pair_im(S, f, HD);
        // kFoldBatch offsets at a time, their cos/sin loaded before any of their stores, so the
        // float64 folds of a batch overlap (all 18 at once spill in the key loop). No branch past
        // the group: its q̄ is 0, so are its weights.
        constexpr int kFoldBatch = 6;
        for (int o0 = 0; o0 < 2 * NT; o0 += kFoldBatch) {
          double cs_b[kFoldBatch], sn_b[kFoldBatch];
          detail::load_offset_phases<kFoldBatch>(cs_b, sn_b, cs_s, sn_s, o0, D, F, f);
#pragma unroll
          for (int u = 0; u < kFoldBatch; ++u) {
            const int o = o0 + u;
            if (o >= 2 * NT) break;
            float wr, wi;
            fold_weight_from_phase_unit(qr, qi, cs_b[u], sn_b[u], m.s2, &wr, &wi);
            if constexpr (kUseWgmma)
              detail::store_wgmma_b_weight<Tr, SP>(b16, wr, wi, e_re, e_im, o, h, NT);
            else
              detail::store_mma_b_weight<Tr, SP, KS>(b16, wr, wi, e_re, e_im, o, h);
          }
        }
      }
#ifdef TRIATTN_WGMMA_ENABLED
      if constexpr (kUseWgmma) detail::fence_proxy_async_smem();  // the B tiles are read by wgmma
#endif
      __syncthreads();
      w_row = rid;
      if (rid < last_row) load_pre(rid + 1);  // in flight while this row streams
    }
    key0 = tile * Shape::kTile + warp * Shape::kKeysPerWarp;
    // A warpgroup's wgmma needs all four warps, also one whose slice is past the length (its
    // rows are computed on whatever its ring holds and never stored).
    return kUseWgmma || key0 < len;  // uniform across the warp (the warpgroup with wgmma)
  };
  const auto compute = [&](int stage) {

    // A fragments of the MT m16 tiles (rows 16mt + g4 and + 8), natural element order
    const std::uint32_t st_addr = ring_addr + static_cast<std::uint32_t>(stage * Shape::kSliceVecs * 16);
    std::uint32_t fr[MT][KS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      detail::load_tile_fragments<KS, Shape::kCPR>(
          fr[mt], st_addr + static_cast<std::uint32_t>(16 * mt * Shape::kCPR * 16), lane);

    // ---- norm term of heads 2(c4 & 1) + i, fp32 FMAs ----
    float nr[MT][4];  // [m-tile][2·(row g4 + 8q) + i]
    const auto norm_tile = [&](int mt) { detail::norm_tile_ffma<T, S, KS>(nr[mt], fr[mt], c_s, c4); };
    if constexpr (!kUseWgmma) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) norm_tile(mt);
    }

    // ---- dot products on the tensor cores, running max over δ (fmaxf: one FMNMX; the values are finite) ----
    float best[MT][4];  // [m-tile][2·(row g4 + 8q) + i]: head 2(c4 & 1) + i
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int v = 0; v < 4; ++v) best[mt][v] = -INFINITY;
    const int my_delta_odd = c4 >> 1;
#ifdef TRIATTN_WGMMA_ENABLED
    if constexpr (kUseWgmma) {
      // Per m-tile one chain of KS·SP warpgroup MMAs over all 72 columns. m-tile 0's MMAs go
      // first; its norm follows wgmma_wait<1>, under m-tile 1's MMAs, and m-tile 1's norm runs
      // under m-tile 0's (a wgmma's A registers are not read before it is waited for).
      // one (k-step, split) B tile
      constexpr auto kTileBytes = static_cast<std::uint32_t>(kWgmmaMaxNTiles * 256);
      const std::uint64_t b_desc = detail::wgmma_desc_kmajor(detail::smem_addr(bfrag_s), 128u, 256u);
      float d[MT][4 * kWgmmaMaxNTiles];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt > 0) norm_tile(mt);
        detail::wgmma_fence();
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int x = 0; x < SP; ++x)
            detail::wgmma_m64n72k16_rs<std::is_same_v<T, f16_storage>>(
                d[mt], fr[mt][s],
                detail::wgmma_desc_advance(b_desc, static_cast<std::uint32_t>(s * SP + x) * kTileBytes), s + x);
        detail::wgmma_commit();
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt + 1 < MT)
          detail::wgmma_wait<1>();  // MT <= 2
        else
          detail::wgmma_wait<0>();
        if (mt == 0) norm_tile(0);
#pragma unroll
        for (int nt = 0; nt < kWgmmaMaxNTiles; ++nt)  // every column: those past |D| repeat offset D - 1
#pragma unroll
          for (int v = 0; v < 4; ++v) best[mt][v] = fmaxf(best[mt][v], d[mt][4 * nt + v]);
      }
    }
#endif
    if constexpr (!kUseWgmma) {
      for (int nt = 0; nt < NT; ++nt) {
        // All of the n-tile's B fragments first (left to itself the compiler loads each one just
        // before its MMA, two registers in rotation, and the warp waits on every load), then the
        // MMAs in two chains per m-tile (even / odd k-steps) so that fewer wait on their predecessor.
        const uint2* bt = bfrag_s + static_cast<std::size_t>(nt) * KS * SP * 32 + lane;
        uint2 b[KS][SP];
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int x = 0; x < SP; ++x) b[s][x] = bt[(s * SP + x) * 32];
        float part[MT][2][4] = {};  // [m-tile][k-step parity]
#pragma unroll
        for (int s = 0; s < KS; ++s)
#pragma unroll
          for (int x = 0; x < SP; ++x)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Tr::mma(part[mt][s & 1], fr[mt][s], b[s][x].x, b[s][x].y);
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[mt][v] = part[mt][0][v] + part[mt][1][v];
        if (2 * nt + my_delta_odd < D) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int v = 0; v < 4; ++v) best[mt][v] = fmaxf(best[mt][v], acc[mt][v]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float other = __shfl_xor_sync(0xffffffffu, best[mt][v], 2);  // the other δ parity
        best[mt][v] = fmaxf(best[mt][v], other);
      }
    if (c4 < 2) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int t = key0 + 16 * mt + 8 * q + g4;
          if (t >= len) continue;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int hg = row.hc * GH + 2 * c4 + i;
            if (hg >= G) continue;
            const std::int64_t o =
                ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + hg) * a.max_len + t;
            scores[o] = best[mt][2 * q + i] + nr[mt][2 * q + i];
          }
        }
    }
  };

  detail::run_key_ring<kStages>(n_items, fetch, start, issue, prepare, compute);
}

}  // namespace triattn::cuda

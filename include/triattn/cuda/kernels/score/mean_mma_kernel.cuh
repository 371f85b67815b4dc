// SPDX-License-Identifier: Apache-2.0
// Tensor-core mean-aggregation scorer for 16-bit caches (score_mean_mma_kernel), fed by producer warps.
#pragma once

#include <triattn/cuda/kernels/score/key_ring.cuh>

namespace triattn::cuda {

// ---------------------------------------------------------------------------------------------
// Mean aggregation on the tensor cores (16-bit caches).
// Why: the CUDA-core mean kernels issue ~1,200 instructions per key (4 heads x 3 FMAs per pair,
// unpacking, weights), about as long as reading the key, and they load a tile, then compute it,
// so HBM idles while they compute. Here
//  - the dot products Σ_e W_e·k_e run as mma.sync m16n8k16 with the keys as A (exact, ldmatrix
//    fragments in natural element order) and the folded weights as B, split into 16-bit parts
//    as in score_max_mma_kernel (bf16 hi + mid + lo, fp16 hi + lo). Column n of MMA x is
//    (head n/2, split 2x + n%2) (the column past the last split is zero), so lane c4 of a quad
//    ends with head c4's dot product in accumulators 0 + 1 (row g4) and 2 + 3 (row g4 + 8);
//  - the norm term Σ_f c_f·|K_f| runs as m16n8k8 TF32 MMAs into the same columns (norm_tile_mma:
//    the CUDA cores only unpack, square, take one MUFU.SQRT and split each pair's norm);
//  - each computing warp reads its 32-key slices of the CTA's items from its own kStages-deep
//    ring, which producer warps fill with cp.async (KeySliceFeed::copy_slice), handing each
//    slice over on a full mbarrier and taking the stage back on an empty one (no CTA barrier
//    per tile);
//  - the float64 fold runs once per (CTA, row) and the float64 cos/sin once per (CTA, sequence),
//    while the ring's first loads are in flight.
// Key rows in shared memory are 16-byte-chunk swizzled (chunk c of row r at c ^ (r & 7)) so that
// the 8 rows an ldmatrix reads hit distinct banks.
// ---------------------------------------------------------------------------------------------

/// Tensor-core mean-aggregation (and disable_trig) scorer for 16-bit caches: same contract as
/// score_mean_kernel (scores within fp32 rounding of it, not bitwise); dynamic shared memory
/// MmaMeanShape<...>::kSmemBytesProducer. kProducers producer warps fill the kWarps computing
/// warps' rings (cp.async, full/empty mbarrier per (warp, stage)), so a computing warp never
/// stalls issuing copies. kLoadAhead: row inputs loaded ahead (RowFoldInputs).
template <class T, class Id, int HD, RopeStyle S, int kWarps, int kStages, int kMinCtas, int kKeys, bool kLoadAhead,
          int kProducers>
__global__ void __launch_bounds__(32 * (kWarps + kProducers), kMinCtas)
    score_mean_mma_kernel(KvCacheView<T, Id> view, ScoreModelView m, ScoreBatch a, float* __restrict__ scores,
                          detail::FastDiv fd) {
  // The round's next kernel (row statistics) is launched dependent: it may be scheduled now and
  // waits for this grid's completion before it reads the scores.
  detail::griddep_launch_dependents();
  using Shape = detail::MmaMeanShape<T, HD, kWarps, kStages, kKeys>;
  using Tr = detail::MmaMaxTraits<T>;
  constexpr int F = Shape::kF, KS = Shape::kSteps, CPR = Shape::kCPR;
  constexpr int SP = Shape::kSplits, NM = Shape::kMmas, GH = Shape::kHeads;
  static_assert(kProducers > 0 && kKeys == 32 && kWarps % kProducers == 0,
                "producer warps fill 32-key slices (one key per lane), the same number each");
  constexpr int kFed = kWarps / kProducers;  // computing warps per producer warp
  constexpr std::size_t kRing = Shape::kRingBytes, kSliceBytes = Shape::kSliceVecs * 16;
  extern __shared__ __align__(16) unsigned char mean_mma_smem[];
  uint4* const ring = reinterpret_cast<uint4*>(mean_mma_smem);
  uint2* const bfrag_s = reinterpret_cast<uint2*>(mean_mma_smem + kRing);
  float4* const c_s = reinterpret_cast<float4*>(mean_mma_smem + kRing + Shape::kBfragBytes);
  double* const cs_s = reinterpret_cast<double*>(mean_mma_smem + kRing + Shape::kBfragBytes + Shape::kCBytes);
  double* const sn_s = cs_s + F;
  // producer-warp ring only: full[warp][stage] then empty[warp][stage] mbarriers
  const std::uint32_t bars = detail::smem_addr(mean_mma_smem + kRing + Shape::kBfragBytes + Shape::kCBytes +
                                                     Shape::kPhaseBytes);
  const auto full_bar = [&](int w, int st) { return bars + static_cast<std::uint32_t>((w * kStages + st) * 8); };
  const auto empty_bar = [&](int w, int st) {
    return bars + static_cast<std::uint32_t>(((kWarps + w) * kStages + st) * 8);
  };

  const detail::ScoreWork work(m, a, GH, Shape::kTile);
  const int L = work.L, Hq = work.Hq, Hkv = work.Hkv, G = work.G, HC = work.HC, tiles_per_row = work.tiles_per_row;
  const long long it0 = work.begin, it_end = work.end;
  const int n_items = static_cast<int>(it_end - it0);  // this CTA's share
  if (n_items <= 0) return;                            // uniform across the CTA

  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const long long row0 = it0 / tiles_per_row;
  const int tile0 = static_cast<int>(it0 - row0 * tiles_per_row);
  const auto ring_of = [&](int w) {
    return detail::smem_addr(ring) + static_cast<std::uint32_t>(w * kStages * kSliceBytes);
  };
  const std::uint32_t ring_addr = ring_of(warp);

  {
    using Feed = detail::KeySliceFeed<T, Id, HD, Shape::kTile, kKeys, kStages>;
    // full: the producer's 32 lanes arrive (on their copies); empty: the computing warp's 32 lanes,
    // each releasing its own reads of the stage (one lane after a __syncwarp relies on the warp
    // barrier's cumulativity, which compute-sanitizer racecheck does not follow: 80 reported
    // hazards on test_score's GQA case).
    if (threadIdx.x == 0) {
      for (int i = 0; i < 2 * kWarps * kStages; ++i) detail::mbar_init(bars + static_cast<std::uint32_t>(i * 8), 32u);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= kWarps) {  // ---- producer warp p: item k's slices for computing warps p, p + kProducers, ... ----
      const int p = warp - kWarps;
      // The next item's row addresses and block ids load one item ahead, while this item's copies
      // go out, so the table latency stalls neither the copies nor the computing warps.
      struct ItemInputs {  // an item's row addresses, tile and the fed warps' block ids
        detail::KeyRowAddr<T, Id> kr;
        int tile;
        Id blk[kFed];
      };
      long long kr_row = -1;
      ItemInputs next{};
      const auto load_item = [&](long long rid, int tile) {
        if (rid != kr_row) {
          const detail::ScoreRow sr = detail::decode_score_row(rid, L, Hkv, HC);
          next.kr = detail::key_row(view, a, sr.b, sr.l, sr.g);
          kr_row = rid;
        }
        next.tile = tile;
#pragma unroll
        for (int i = 0; i < kFed; ++i) {
          const int t = tile * Shape::kTile + (p + i * kProducers) * 32 + lane;
          const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
          next.blk[i] = t < next.kr.len && page < view.max_blocks_per_seq ? next.kr.table[page] : Id(0);
        }
      };
      // Item k's slices (row addresses kr, tile, block ids blk) into stage k % kStages of each fed
      // warp, once that warp has handed the stage back.
      const auto issue_item = [&](int k, const ItemInputs& in) {
        const detail::KeyRowAddr<T, Id>& kr = in.kr;
        const int tile = in.tile;
        const int st = k % kStages;
#pragma unroll
        for (int i = 0; i < kFed; ++i) {
          const int w = p + i * kProducers;
          const int t_first = tile * Shape::kTile + w * 32, t = t_first + lane;
          const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
          const int n_valid = kr.len - t_first;
          const std::uint32_t mine =
              lane < n_valid ? Feed::chunk_offset(kr, in.blk[i], t - page * view.block.block_size) : 0u;
          if (k >= kStages) detail::mbar_wait(empty_bar(w, st), static_cast<unsigned>(((k / kStages) & 1) ^ 1));
          Feed::copy_slice(ring_of(w) + static_cast<std::uint32_t>(st * kSliceBytes), kr.range, mine, n_valid, lane);
          detail::mbar_arrive_on_cp_async(full_bar(w, st));
        }
      };
      long long rid_n = row0;
      int t_n = static_cast<int>(it0 - row0 * tiles_per_row);
      load_item(rid_n, t_n);
      for (int k = 0; k < n_items; ++k) {
        const ItemInputs cur = next;
        if (++t_n == tiles_per_row) {
          t_n = 0;
          ++rid_n;
        }
        if (k + 1 < n_items) load_item(rid_n, t_n);
        issue_item(k, cur);
      }
      return;  // the copies complete on their own; the computing warps wait for them
    }
  }

  // the computing warps' barrier (without the producer warps)
  const auto consumers_sync = [&]() { asm volatile("bar.sync 1, %0;" ::"n"(32 * kWarps) : "memory"); };

  // ---- consumer state ----
  long long seen_row = -1, w_row = -1, c_rid = row0;
  int c_tile = tile0, w_b = -1, len = 0;
  detail::ScoreRow row{};
  std::uint32_t bq[KS][NM][2];  // this lane's B fragments of row w_row
  std::uint32_t bn[F / 8][2];   // ... and of its norm weights (TF32, see mma_lane_pair)
#pragma unroll
  for (int s = 0; s < KS; ++s)
#pragma unroll
    for (int x = 0; x < NM; ++x) bq[s][x][0] = bq[s][x][1] = 0u;
#pragma unroll
  for (int s = 0; s < F / 8; ++s) bn[s][0] = bn[s][1] = 0u;

  // Row inputs (length, t0, q̄, c, C_f, ω_f) in registers; with kLoadAhead the first row's load
  // up front and each next row's right after a fold (see RowFoldInputs), else when the row begins.
  detail::RowFoldInputs<F, GH, Shape::kThreads, true> pre;
  const auto load_pre = [&](long long r) { pre.load(m, a, view.seq_lens, r, L, Hkv, HC); };
  const long long last_row = (it_end - 1) / tiles_per_row;  // the last row whose inputs may be loaded ahead
  int key0 = 0;  // this warp's first key of the current item (set by prepare)
  const auto prepare = [&]() -> bool {  // the item at the compute cursor, then advance it
    long long rid;
    int tile;
    if (!detail::take_ring_item<kLoadAhead, Shape::kTile>(c_rid, c_tile, tiles_per_row, last_row, seen_row, row, len, pre,
                                                 load_pre, rid, tile))
      return false;
    if (rid != w_row) {  // first item of a row with keys (uniform): its weights
      consumers_sync();  // every warp is done with the previous row's weights
      if (row.b != w_b) {
#pragma unroll
        for (int j = 0; j < decltype(pre)::kFreqs; ++j) {
          const int f = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
          if (f >= F) break;
          double cs = 1.0, sn = 0.0;
          if (!m.disable_trig) detail::rope_cos_sin(pre.t0, pre.omega[j], cs, sn);
          cs_s[f] = cs;
          sn_s[f] = sn;
        }
        w_b = row.b;
        consumers_sync();
      }
      auto* b16 = reinterpret_cast<std::uint16_t*>(bfrag_s);
      float* cf = reinterpret_cast<float*>(c_s);
#pragma unroll
      for (int j = 0; j < decltype(pre)::kItems; ++j) {
        const int item = static_cast<int>(threadIdx.x) + j * Shape::kThreads;
        if (item >= GH * F) break;
        const int h = item / F, f = item % F;
        const int hg = row.hc * GH + h;
        float wr = 0.0f, wi = 0.0f;
        if (hg < G && !m.disable_trig)
          fold_weight_from_phase(pre.q_re[j], pre.q_im[j], pre.cm_re[j], pre.cm_im[j], cs_s[f], sn_s[f], m.s2, &wr,
                                 &wi);
        const float c = pre.c[j];  // 0 past the group
        cf[(f + f / 8) * 4 + h] = c;
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          const int e = part == 0 ? rope_pair_re(S, f, HD) : rope_pair_im(S, f, HD);
          std::uint16_t sp[SP];
          Tr::split(part == 0 ? wr : wi, sp);
          const detail::BFragmentSlot b = detail::b_fragment_slot(e);
#pragma unroll
          for (int x = 0; x < 2 * NM; ++x) {
            const int n = 2 * h + (x & 1);
            b16[((((b.step * NM + (x >> 1)) * 32 + n * 4 + b.quad_lane) * 2 + b.word) * 2) + b.half] =
                x < SP ? sp[x < SP ? x : 0] : 0;
          }
        }
      }
      consumers_sync();
#pragma unroll
      for (int s = 0; s < KS; ++s)
#pragma unroll
        for (int x = 0; x < NM; ++x) {
          const uint2 v = bfrag_s[(s * NM + x) * 32 + lane];
          bq[s][x][0] = v.x;
          bq[s][x][1] = v.y;
        }
#pragma unroll
      for (int s = 0; s < F / 8; ++s)
#pragma unroll
        for (int i = 0; i < 2; ++i)  // column g4: head g4/2, TF32 head (g4 even) or rest (odd)
          bn[s][i] = detail::norm_b_word<S>(cf, c4, s, i, g4 >> 1, (g4 & 1) != 0);
      w_row = rid;
      if (kLoadAhead && rid < last_row) load_pre(rid + 1);  // in flight while this row streams
    }
    key0 = tile * Shape::kTile + warp * Shape::kKeysPerWarp;
    return key0 < len;  // uniform across the warp
  };
  const auto compute = [&](int stage) {
    const std::uint32_t st_addr = ring_addr + static_cast<std::uint32_t>(stage * kSliceBytes);
    const int hg = row.hc * GH + c4;
    float* const out = scores + ((static_cast<std::int64_t>(row.b) * L + row.l) * Hq + row.g * G + (hg < G ? hg : 0)) *
                                    static_cast<std::int64_t>(a.max_len);
#pragma unroll
    for (int mt = 0; mt < kKeys / 16; ++mt) {
      std::uint32_t fr[KS][4];  // A fragments of rows 16mt + g4, + 8: [k-step][word]
      detail::load_tile_fragments<KS, CPR>(fr, st_addr + static_cast<std::uint32_t>(16 * mt * CPR * 16), lane);
      // Four independent accumulator chains (an MMA waits for the one before it on the same
      // accumulators; one chain of 2·KS + F/4 MMAs left the warps stalled on that latency):
      // trig even / odd k-steps, norm head / rest.
      float acc[4][4] = {};
#pragma unroll
      for (int s = 0; s < KS; ++s)
#pragma unroll
        for (int x = 0; x < NM; ++x) Tr::mma(acc[s & 1], fr[s], bq[s][x][0], bq[s][x][1]);
      detail::norm_tile_mma<T, S>(acc[2], acc[3], fr, bn);  // norm term, two more chains
      // lane c4 holds head c4 (columns 2·c4, 2·c4 + 1) of rows g4 (q = 0) and g4 + 8 (q = 1)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = key0 + 16 * mt + 8 * q + g4;
        const float trig = (acc[0][2 * q] + acc[0][2 * q + 1]) + (acc[1][2 * q] + acc[1][2 * q + 1]);
        const float norm = (acc[2][2 * q] + acc[2][2 * q + 1]) + (acc[3][2 * q] + acc[3][2 * q + 1]);
        if (hg < G && t < len) out[t] = trig + norm;
      }
    }
  };

  {  // the computing warps: wait for the slice, compute, hand the stage back
    if constexpr (kLoadAhead) load_pre(row0);
    const auto run_item = [&](int k, bool live) {
      const int st = k % kStages;
      detail::mbar_wait(full_bar(warp, st), static_cast<unsigned>((k / kStages) & 1));
      if (live) compute(st);
      detail::mbar_arrive(empty_bar(warp, st));  // this lane has read the stage
    };
    for (int k = 0; k < n_items; ++k) run_item(k, prepare());
  }
}

}  // namespace triattn::cuda

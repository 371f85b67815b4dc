// SPDX-License-Identifier: Apache-2.0
// Shared device primitives of the two ring scorers (score_mean_mma_kernel, score_max_mma_pipe_kernel):
// their shape, the per-warp cp.async key rings (KeySliceFeed, run_key_ring), the row inputs loaded
// ahead (RowFoldInputs) and the compute cursor over the CTA's (row, tile) items (take_ring_item).
#pragma once

#include <triattn/cuda/kernels/score/mma_fragments.cuh>

namespace triattn::cuda {

namespace detail {

/// Shape of score_mean_mma_kernel: kWarps warps, each with a kStages-deep ring of kKeys-key
/// slices (one or two m16 tiles).
template <class T, int HD, int kWarps_, int kStages_, int kKeys_ = 32>
struct MmaMeanShape {
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  static_assert(kStages_ >= 2, "two ring stages at least");
  static_assert(kKeys_ == 16 || kKeys_ == 32, "a slice is one or two m16 tiles");
  static constexpr int kF = HD / 2;
  static constexpr int kSteps = HD / 16;   // MMA k-steps
  static constexpr int kChunks = HD / 32;  // 16-byte chunks a lane holds per key row
  static constexpr int kCPR = HD / 8;      // 16-byte chunks per key
  static constexpr int kSplits = MmaMaxTraits<T>::kSplits;
  static constexpr int kMmas = (kSplits + 1) / 2;  // two weight splits per MMA (columns 2h, 2h + 1)
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeysPerWarp = kKeys_;  // one ring slice
  static constexpr int kTile = kWarps * kKeysPerWarp;
  static constexpr int kHeads = 4;
  static constexpr int kSliceVecs = kKeysPerWarp * kCPR;  // 16-byte chunks per slice
  static constexpr int kCSlots = kF + kF / 8;              // c as float4 per pair, one pad slot every 8 pairs
  static constexpr std::size_t kRingBytes = static_cast<std::size_t>(kWarps) * kStages * kSliceVecs * 16;
  static constexpr std::size_t kBfragBytes = static_cast<std::size_t>(kSteps) * kMmas * 32 * 8;
  static constexpr std::size_t kCBytes = static_cast<std::size_t>(kCSlots) * 16;
  static constexpr std::size_t kPhaseBytes = static_cast<std::size_t>(kF) * 2 * sizeof(double);
  /// Dynamic shared memory: rings, B fragments [k-step][mma][lane] uint2, c [slot] float4, cos/sin
  /// [F] double, table slots [warp][kStages + 1][32] (8 bytes each).
  /// Per-warp block-table slots (KeySliceFeed), after everything else.
  static constexpr std::size_t kTableBytes = static_cast<std::size_t>(kWarps) * ((kStages + 1) * 32 * 8);
  static constexpr std::size_t kSmemBytes = kRingBytes + kBfragBytes + kCBytes + kPhaseBytes + kTableBytes;
  /// With producer warps (score_mean_mma_kernel's kProducers): full and empty mbarriers per
  /// (warp, stage) instead of the per-warp table slots.
  static constexpr std::size_t kBarrierBytes = static_cast<std::size_t>(kWarps) * kStages * 2 * 8;
  static constexpr std::size_t kSmemBytesProducer = kRingBytes + kBfragBytes + kCBytes + kPhaseBytes + kBarrierBytes;
};

/// Block-table entries a warp keeps in flight ahead of its key slices: one per ring stage, plus
/// one slot so that a fetch never lands on the entry its warp has still to read.
template <int kStages>
struct KeyTableSlots {
  static constexpr int kAhead = kStages;
  static constexpr int kSlots = kAhead + 1;
  /// Shared memory per warp for any block-id type (up to 8 bytes).
  static constexpr std::size_t kBytesPerWarp = static_cast<std::size_t>(kSlots) * 32 * 8;
};

/// 16-byte global -> shared copy through L2 only, or 16 zero bytes when `zero` (src not read).
/// With an L2 evict-first policy (`policy` from l2_stream_policy): the keys are read once per
/// round, so their lines should be the first L2 gives up, not the scores the scorer writes (which
/// the round's next kernel reads) or other data the engine keeps there.
__device__ __forceinline__ void score_cp_async_16_or_zero(std::uint32_t dst, unsigned long long src, bool zero,
                                                          std::uint64_t policy) {
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
      " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, z, %3;\n}" ::"r"(dst),
      "l"(src), "r"(static_cast<int>(zero)), "l"(policy)
      : "memory");
}
/// An L2 evict-first policy for every line of a streamed input (createpolicy, fraction 1).
__device__ __forceinline__ std::uint64_t l2_stream_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
/// base + 16·chunk as one IMAD.WIDE.U32 (the compiler otherwise widens the product with shifts).
__device__ __forceinline__ unsigned long long chunk_address(unsigned long long base, std::uint32_t chunk) {
  unsigned long long r;
  asm("mad.wide.u32 %0, %1, 16, %2;" : "=l"(r) : "r"(chunk), "l"(base));
  return r;
}

/// 4- or 8-byte global -> shared copy (a block-table entry); src_bytes = 0 zero-fills.
template <int kBytes>
__device__ __forceinline__ void score_cp_async_small(std::uint32_t dst, const void* src, int src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8, "4 or 8 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(kBytes), "r"(src_bytes)
               : "memory");
}

/// Key (blk, slot r)'s offset from its layer's K range in 16-byte chunks (32 bits: the ring
/// scorers' launchers route K ranges of 64 GiB or more elsewhere, ring_offsets_fit).
template <class T, class Id>
__device__ __forceinline__ std::uint32_t key_chunk_offset(const KeyRowAddr<T, Id>& k, Id blk, int r) {
  constexpr int kElemsPerChunk = 16 / static_cast<int>(sizeof(T));
  return static_cast<std::uint32_t>(
      static_cast<std::uint64_t>(static_cast<std::int64_t>(blk) * k.block_elems +
                                 static_cast<std::int64_t>(r) * k.token_stride + k.head_off) /
      kElemsPerChunk);
}

/// Producer side of a per-warp key ring (score_mean_mma_kernel, score_max_mma_pipe_kernel). The
/// CTA walks its items (row, tile) in order; the warp's slice of an item is the kKeys (16 or 32)
/// keys from tile·kTile + kKeys·warp, lane l owning key l (lanes >= kKeys own none).
/// Two cursors walk the items:
///  - fetch() copies the block-table entry of each lane's key into a per-warp slot ring in shared
///    memory with a 4/8-byte cp.async, KeyTableSlots::kAhead items before the slice needs it, so
///    the table lookup never stalls the warp (an entry loaded one slice ahead into a register
///    left the warps waiting on it);
///  - issue() reads the entry back and copies the slice into one ring stage with 16-byte cp.async:
///    copy x = i·32 + lane is chunk x % CPR of key x / CPR, so one warp instruction moves 32/CPR
///    whole keys; keys past the length are zero-filled. Chunk c of key k lands at
///    c ^ chunk_swizzle(k) = c ^ (k & 7), so the 8 rows of an ldmatrix hit 8 distinct 16-byte
///    bank groups (load_tile_fragments).
/// run_key_ring() orders the two with the consumer so that every read finds its copy complete.
template <class T, class Id, int HD, int kTile, int kKeys, int kStages>
struct KeySliceFeed {
  static_assert(kKeys == 16 || kKeys == 32, "16 or 32 keys per slice");
  static_assert(sizeof(Id) == 4 || sizeof(Id) == 8, "4- or 8-byte block ids");
  static constexpr int kCPR = HD / 8;  // 16-byte chunks per key
  using Slots = KeyTableSlots<kStages>;
  static_assert(kCPR >= 8, "the 8-row swizzle needs 8 chunks per key");
  static __device__ __forceinline__ int chunk_swizzle(int key) { return key & 7; }

  long long f_rid;       // fetch cursor: row and tile of the next item to fetch
  int f_tile;
  long long f_row = -1;  // row whose table f_table points at
  const Id* f_table = nullptr;
  int f_slot = 0;
  long long i_rid;       // issue cursor
  int i_tile;
  long long kr_row = -1;  // row whose addresses kr holds
  KeyRowAddr<T, Id> kr{};
  int i_slot = 0;
  std::uint32_t slots_addr;  // this warp's [kSlots][32] Id slots (shared memory)
  const Id* slots;           // ... the same as a pointer

  __device__ KeySliceFeed(long long row0, int tile0, Id* warp_slots)
      : f_rid(row0), f_tile(tile0), i_rid(row0), i_tile(tile0),
        slots_addr(static_cast<std::uint32_t>(__cvta_generic_to_shared(warp_slots))), slots(warp_slots) {}

  /// kr = the addresses of row `row` (loads its sequence id and length).
  __device__ __forceinline__ void load_row(const KvCacheView<T, Id>& view, const ScoreBatch& a, long long row, int L,
                                           int Hkv, int HC) {
    const ScoreRow sr = decode_score_row(row, L, Hkv, HC);
    kr = key_row(view, a, sr.b, sr.l, sr.g);
    kr_row = row;
  }
  /// Starts the loads of the first row's addresses, so that they overlap the first table fetch
  /// instead of following it.
  __device__ __forceinline__ void prime(const KvCacheView<T, Id>& view, const ScoreBatch& a, int L, int Hkv, int HC) {
    load_row(view, a, i_rid, L, Hkv, HC);
  }

  __device__ __forceinline__ void fetch(const KvCacheView<T, Id>& view, const ScoreBatch& a, const FastDiv& fd,
                                        int tiles_per_row, int L, int Hkv, int HC, int warp, int lane) {
    const long long row = f_rid;
    const int tl = f_tile;
    if (++f_tile == tiles_per_row) {
      f_tile = 0;
      ++f_rid;
    }
    if (row != f_row) {
      const ScoreRow sr = decode_score_row(row, L, Hkv, HC);
      f_table = view.block_tables + static_cast<std::int64_t>(a.seq_ids[sr.b]) * view.max_blocks_per_seq;
      f_row = row;
    }
    const int t = tl * kTile + warp * kKeys + lane;
    const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
    const bool in = lane < kKeys && page < view.max_blocks_per_seq;  // inside the table row
    score_cp_async_small<sizeof(Id)>(slots_addr + static_cast<std::uint32_t>((f_slot * 32 + lane) * sizeof(Id)),
                                     in ? static_cast<const void*>(f_table + page) : view.block_tables,
                                     in ? static_cast<int>(sizeof(Id)) : 0);
    if (++f_slot == Slots::kSlots) f_slot = 0;
  }

  /// stage_addr: shared-memory address of the stage ([kKeys keys][kCPR] 16-byte chunks).
  /// Each lane turns its key into a 32-bit offset from the layer's K range in 16-byte chunks, so
  /// a copy costs one 32-bit shuffle, one wide multiply-add and the cp.async; keys past the length
  /// (a suffix of the slice) are zero-filled from the range start, which is not read. (Two
  /// shuffles, selects and 64-bit arithmetic per copy before: ~8 instructions per key of 36.) The
  /// launcher routes caches with K ranges of 64 GiB or more elsewhere (ring_offsets_fit).
  __device__ __forceinline__ void issue(const KvCacheView<T, Id>& view, const ScoreBatch& a, const FastDiv& fd,
                                        int tiles_per_row, int L, int Hkv, int HC, int warp, int lane,
                                        std::uint32_t stage_addr) {
    const long long row = i_rid;
    const int tl = i_tile;
    if (++i_tile == tiles_per_row) {
      i_tile = 0;
      ++i_rid;
    }
    if (row != kr_row) load_row(view, a, row, L, Hkv, HC);
    const int t_first = tl * kTile + warp * kKeys;  // the slice's first key
    const int t = t_first + lane;
    const int page = static_cast<int>(fd.div(static_cast<std::uint32_t>(t)));
    const int r = t - page * view.block.block_size;
    const int n_valid = kr.len - t_first;  // keys kk >= n_valid are zero-filled
    const Id blk = slots[i_slot * 32 + lane];
    if (++i_slot == Slots::kSlots) i_slot = 0;
    copy_slice(stage_addr, kr.range, lane < n_valid && lane < kKeys ? chunk_offset(kr, blk, r) : 0u, n_valid, lane);
  }

  static __device__ __forceinline__ std::uint32_t chunk_offset(const KeyRowAddr<T, Id>& k, Id blk, int r) {
    return key_chunk_offset(k, blk, r);
  }
  /// One warp copies a slice: lane l's `mine` is key l's chunk offset from `range`; keys
  /// kk >= n_valid are zero-filled. Chunk c of key kk lands at c ^ chunk_swizzle(kk).
  static __device__ __forceinline__ void copy_slice(std::uint32_t stage_addr, const T* range, std::uint32_t mine,
                                                    int n_valid, int lane) {
    constexpr int kKeysPerCopy = 32 / kCPR;  // whole keys one warp instruction moves
    const int c = lane % kCPR, sub = lane / kCPR;
    // chunk_swizzle(i·kKeysPerCopy + sub) = chunk_swizzle(i·kKeysPerCopy) ^ chunk_swizzle(sub): disjoint bits
    const int c_sw = c ^ chunk_swizzle(sub);
    const unsigned long long base = reinterpret_cast<unsigned long long>(range) + static_cast<unsigned>(c) * 16u;
    const std::uint64_t policy = l2_stream_policy();
#pragma unroll
    for (int i = 0; i < kCPR * kKeys / 32; ++i) {
      const int kk = i * kKeysPerCopy + sub;
      const std::uint32_t o = __shfl_sync(0xffffffffu, mine, kk);
      const std::uint32_t dst =
          stage_addr + static_cast<std::uint32_t>((kk * kCPR + (c_sw ^ chunk_swizzle(i * kKeysPerCopy))) * 16);
      score_cp_async_16_or_zero(dst, chunk_address(base, o), kk >= n_valid, policy);
    }
  }
};

/// The global inputs of one row's weight fold in the ring scorers, loaded into registers ahead of
/// the fold: the row's length and t0, and this thread's share of q̄ and c (fold items
/// tid + j·kThreads < GH·F, item = h·F + f), with ω_f and C_f for the mean fold (kMean).
/// Why: loaded when the row begins, those few loads queue behind the warps' key copies while the
/// warps hold ready slices. The first row's inputs load up front, the next row's right after a fold.
/// kHeadMinor: fold item -> (h, f) with the head varying fastest within 8-frequency blocks (see
/// item_hf), so that a warp's B-fragment stores of one column land in 4 distinct core-matrix rows.
template <int F, int GH, int kThreads, bool kMean, bool kHeadMinor = false>
struct RowFoldInputs {
  static_assert(!kHeadMinor || (GH == 4 && F % 8 == 0), "head-minor items: 4 heads, whole 8-frequency blocks");
  static constexpr int kItems = (GH * F + kThreads - 1) / kThreads;
  /// Head and frequency of fold item `item` (< GH·F): h = item / F, f = item % F, or head-minor:
  /// f = 8·(item / 32) + item % 8, h = (item / 8) % 4.
  __device__ __forceinline__ static void item_hf(int item, int& h, int& f) {
    if constexpr (kHeadMinor) {
      f = (item >> 5) * 8 + (item & 7);
      h = (item >> 3) & 3;
    } else {
      h = item / F;
      f = item % F;
    }
  }
  static constexpr int kFreqs = (F + kThreads - 1) / kThreads;  // ω_f, f = tid + j·kThreads (kMean)
  long long rid = -1;  // row these are for
  ScoreRow row{};
  int len = 0;         // physical length, clamped to [0, max_len]
  long long t0 = 0;
  double q_re[kItems], q_im[kItems], cm_re[kItems], cm_im[kItems];  // q̄, C_f (kMean) of item j
  float c[kItems];
  double omega[kFreqs];

  /// Issues the loads of row r (no use of their values here). seq_lens: the view's [max_seqs].
  template <class Id>
  __device__ __forceinline__ void load(const ScoreModelView& m, const ScoreBatch& a, const Id* seq_lens, long long r,
                                       int L, int Hkv, int HC) {
    rid = r;
    row = decode_score_row(r, L, Hkv, HC);
    const int l0 = static_cast<int>(seq_lens[a.seq_ids[row.b]]);
    len = l0 < a.max_len ? (l0 > 0 ? l0 : 0) : a.max_len;
    t0 = a.t0[row.b];
    const int Hq = m.num_q_heads, G = Hq / m.num_kv_heads;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int item = static_cast<int>(threadIdx.x) + j * kThreads;
      int h, f;
      item_hf(item, h, f);  // consecutive threads: runs of >= 8 consecutive f (coalesced loads)
      const int hg = row.hc * GH + h;
      q_re[j] = q_im[j] = cm_re[j] = cm_im[j] = 0.0;
      c[j] = 0.0f;
      if (item < GH * F && hg < G) {
        const std::int64_t idx = (static_cast<std::int64_t>(row.l) * Hq + row.g * G + hg) * F + f;
        if (!m.disable_trig) {
          q_re[j] = m.q_re[idx];
          q_im[j] = m.q_im[idx];
          if constexpr (kMean) {
            cm_re[j] = m.cmean_re[f];
            cm_im[j] = m.cmean_im[f];
          }
        }
        c[j] = m.c[idx];
      }
    }
    if constexpr (kMean) {
#pragma unroll
      for (int j = 0; j < kFreqs; ++j) {
        const int f = static_cast<int>(threadIdx.x) + j * kThreads;
        omega[j] = f < F && !m.disable_trig ? m.omega[f] : 0.0;
      }
    }
  }
};

/// The compute cursor over a CTA's (row, tile) items: takes the item at (c_rid, c_tile), returns it
/// in (rid, tile) and advances the cursor, making the item's row current in (row, len, seen_row)
/// (from `pre` when loaded ahead, else loaded now). Returns false when the item holds no key (its
/// tile starts past the row's length, as do the row's later tiles; uniform across the CTA); with
/// kLoadAhead the next row's inputs are then loaded ahead, unless `pre` already moved past this row.
template <bool kLoadAhead, int kTile, class Pre, class LoadPre>
__device__ __forceinline__ bool take_ring_item(long long& c_rid, int& c_tile, int tiles_per_row, long long last_row,
                                               long long& seen_row, ScoreRow& row, int& len, Pre& pre,
                                               const LoadPre& load_pre, long long& rid, int& tile) {
  rid = c_rid;
  tile = c_tile;
  if (++c_tile == tiles_per_row) {
    c_tile = 0;
    ++c_rid;
  }
  if (rid != seen_row) {
    if (pre.rid != rid) load_pre(rid);  // not loaded ahead (a skipped row)
    row = pre.row;
    len = pre.len;
    seen_row = rid;
  }
  if (tile * kTile >= len) {
    if (kLoadAhead && pre.rid == rid && rid < last_row) load_pre(rid + 1);
    return false;
  }
  return true;
}

/// Runs one warp's ring over the CTA's n_items items: item k's slice sits in stage k % kStages.
/// Commit group g of the loop holds the slice of item g + kStages - 1 and the table fetch of item
/// g + kStages - 1 + kAhead; waiting until kStages - 1 groups are pending completes the slice
/// of item k and, because kAhead >= kStages, the table entry of every item issued next.
/// fetch(), start(), issue(stage), prepare() and compute(stage) are the caller's bound lambdas:
/// start() runs once after the first table fetches are issued and before the warp waits for them
/// (loads whose latency should overlap that wait); prepare()
/// advances the consumer to item k (its row's weights on a row change; it may __syncthreads,
/// its branches being uniform across the CTA) and returns whether the warp has keys in it; it
/// runs before the wait, so that a row change's loads and weight folding overlap the slices in
/// flight instead of following them.
template <int kStages, class Fetch, class Start, class Issue, class Prepare, class Compute>
__device__ __forceinline__ void run_key_ring(int n_items, Fetch&& fetch, Start&& start, Issue&& issue,
                                             Prepare&& prepare, Compute&& compute) {
  constexpr int kAhead = KeyTableSlots<kStages>::kAhead;
  static_assert(kAhead >= kStages, "a table entry must land before its slice is issued");
#pragma unroll
  for (int j = 0; j < kAhead; ++j)
    if (j < n_items) fetch();
  cp_async_commit();
  start();
  cp_async_wait<0>();  // the first entries (the only table latency the warp waits for)
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < n_items) issue(j);
    if (j + kAhead < n_items) fetch();
    cp_async_commit();
  }
  for (int k = 0; k < n_items; ++k) {
    const int kn = k + kStages - 1;
    if (kn < n_items) issue(kn % kStages);
    if (kn + kAhead < n_items) fetch();
    cp_async_commit();
    const bool live = prepare();
    cp_async_wait<kStages - 1>();  // this lane's copies of item k have landed
    __syncwarp();                          // ... and every lane's
    if (live) compute(k % kStages);
    __syncwarp();  // every lane has read stage k % kStages before it is refilled
  }
  cp_async_wait<0>();
}

}  // namespace detail

}  // namespace triattn::cuda

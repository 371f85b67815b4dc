// SPDX-License-Identifier: Apache-2.0
// The page-occupancy ledger of the elastic allocator: how block ids map onto pages, which pages
// are mapped, how many live blocks each holds, and where the next block goes. Pure bookkeeping,
// no driver, no pointers.
//
// Geometry. The cache has R = 2 * num_layers ranges; block b lives at b * block_bytes in every
// range, so a block id spans all ranges and a page index is mapped in all R ranges together.
// The ledger's unit is the slab: the smallest run of pages holding whole blocks,
// lcm(block_bytes, page_bytes) bytes per range. When blocks divide the page (the usual case:
// a bf16 block of 16 tokens x 8 heads x 128 dims is 32 KiB, 64 per 2 MiB page) a slab is one
// page; when the page divides a block, a slab is one block spanning several pages; otherwise it
// is the lcm (coarser, still exact). Slab s covers blocks [s * bps, (s + 1) * bps) and pages
// [s * pps, (s + 1) * pps) of every range (the last slab may be shorter).
//
// Placement is best-fit by occupancy: a block is taken from the fullest mapped slab that has
// room (ties: the lowest slab), lowest free block first; when mapped slabs cannot satisfy a
// request, the lowest unmapped slabs are mapped. Full slabs stay full, and the blocks freed by
// compaction are refilled before an emptier slab is touched, so slabs empty out whole.
// Placement alone cannot empty a slab that still holds a few survivors of several sequences
// (compaction keeps each sequence's first blocks); pick_evacuees() chooses slabs whose blocks
// the owner moves into the free room of fuller slabs (VmmAllocatorCore::plan_relocation).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>

namespace triattn::vmm {

/// Immutable geometry of blocks, pages and slabs.
struct SlabGeometry {
  std::int64_t page_bytes = 0;       ///< driver granularity
  std::int64_t block_bytes = 0;      ///< one block in one range
  std::int64_t slab_bytes = 0;       ///< one slab in one range: lcm(block_bytes, page_bytes)
  std::int64_t range_stride = 0;     ///< bytes between ranges: pages_per_range * page_bytes
  int num_ranges = 0;                ///< 2 * num_layers
  int num_blocks = 0;
  int blocks_per_slab = 0;
  int pages_per_slab = 0;
  int pages_per_range = 0;
  int num_slabs = 0;

  /// @throws logic_error on non-positive sizes or when the reservation would overflow.
  static SlabGeometry make(int num_blocks, std::int64_t block_bytes, int num_ranges, std::int64_t page_bytes) {
    TRIATTN_EXPECTS(num_blocks > 0 && block_bytes > 0 && num_ranges > 0 && page_bytes > 0,
                    "SlabGeometry: num_blocks, block_bytes, num_ranges and page_bytes must be positive (got " +
                        std::to_string(num_blocks) + ", " + std::to_string(block_bytes) + ", " +
                        std::to_string(num_ranges) + ", " + std::to_string(page_bytes) + ")");
    SlabGeometry g;
    g.page_bytes = page_bytes;
    g.block_bytes = block_bytes;
    g.num_ranges = num_ranges;
    g.num_blocks = num_blocks;
    const std::int64_t l = std::lcm(block_bytes, page_bytes);
    const std::int64_t total = static_cast<std::int64_t>(num_blocks) * block_bytes;
    g.pages_per_range = static_cast<int>((total + page_bytes - 1) / page_bytes);
    g.range_stride = static_cast<std::int64_t>(g.pages_per_range) * page_bytes;
    TRIATTN_EXPECTS(g.range_stride <= (std::int64_t{1} << 56) / num_ranges,
                    "SlabGeometry: the reservation of " + std::to_string(num_ranges) + " ranges of " +
                        std::to_string(g.range_stride) + " bytes is too large");
    // A slab never needs to be longer than the range (huge lcm of odd block sizes).
    g.slab_bytes = l <= g.range_stride ? l : g.range_stride;
    if (l <= g.range_stride) {
      g.blocks_per_slab = static_cast<int>(l / block_bytes);
      g.pages_per_slab = static_cast<int>(l / page_bytes);
    } else {
      g.blocks_per_slab = num_blocks;
      g.pages_per_slab = g.pages_per_range;
    }
    g.num_slabs = (num_blocks + g.blocks_per_slab - 1) / g.blocks_per_slab;
    return g;
  }

  [[nodiscard]] int slab_of(std::int32_t block) const noexcept { return block / blocks_per_slab; }
  [[nodiscard]] int first_block(int s) const noexcept { return s * blocks_per_slab; }
  [[nodiscard]] int blocks_in(int s) const noexcept {
    const int e = (s + 1) * blocks_per_slab;
    return (e < num_blocks ? e : num_blocks) - s * blocks_per_slab;
  }
  [[nodiscard]] int first_page(int s) const noexcept { return s * pages_per_slab; }
  [[nodiscard]] int pages_in(int s) const noexcept {
    const int e = (s + 1) * pages_per_slab;
    return (e < pages_per_range ? e : pages_per_range) - s * pages_per_slab;
  }
  /// Physical bytes of slab s over all ranges.
  [[nodiscard]] std::int64_t slab_bytes_all_ranges(int s) const noexcept {
    return static_cast<std::int64_t>(pages_in(s)) * num_ranges * page_bytes;
  }
  [[nodiscard]] std::int64_t reservation_bytes() const noexcept { return range_stride * num_ranges; }
};

enum class SlabState : std::uint8_t {
  kUnmapped = 0,  ///< no physical memory
  kMapped = 1,    ///< mapped and accessible in every range
  kPending = 2,   ///< mapped, empty, scheduled for unmapping once its event completes (still allocatable)
  kBroken = 3,    ///< a driver call failed half-way; held out of placement until retried
};

class SlabLedger {
 public:
  SlabLedger() = default;
  explicit SlabLedger(const SlabGeometry& g)
      : g_(g),
        ref_(static_cast<std::size_t>(g.num_blocks), 0),
        free_bits_((static_cast<std::size_t>(g.num_blocks) + 63) / 64, 0),
        state_(static_cast<std::size_t>(g.num_slabs), SlabState::kUnmapped),
        used_(static_cast<std::size_t>(g.num_slabs), 0) {
    for (int b = 0; b < g.num_blocks; ++b) set_free(b, true);
    for (int s = 0; s < g.num_slabs; ++s) unmapped_.insert(s);
    count_[static_cast<int>(SlabState::kUnmapped)] = static_cast<std::size_t>(g.num_slabs);
  }

  [[nodiscard]] const SlabGeometry& geometry() const noexcept { return g_; }
  [[nodiscard]] SlabState state(int s) const noexcept { return state_[static_cast<std::size_t>(s)]; }
  [[nodiscard]] int used(int s) const noexcept { return used_[static_cast<std::size_t>(s)]; }
  [[nodiscard]] int ref_count(std::int32_t b) const noexcept {
    return (b >= 0 && b < g_.num_blocks) ? ref_[static_cast<std::size_t>(b)] : 0;
  }
  [[nodiscard]] bool is_allocatable_state(int s) const noexcept {
    return state(s) == SlabState::kMapped || state(s) == SlabState::kPending;
  }
  [[nodiscard]] std::size_t used_blocks() const noexcept { return used_blocks_; }
  /// Free blocks on mapped (or pending) slabs: what allocate() can hand out without the driver.
  [[nodiscard]] std::size_t mapped_free_blocks() const noexcept { return mapped_free_; }
  [[nodiscard]] std::size_t num_in_state(SlabState st) const noexcept { return count_[static_cast<int>(st)]; }
  [[nodiscard]] const std::vector<std::int32_t>& ref_counts() const noexcept { return ref_; }
  [[nodiscard]] const std::vector<SlabState>& states() const noexcept { return state_; }
  [[nodiscard]] const std::vector<std::int32_t>& used_counts() const noexcept { return used_; }

  // ---- placement ------------------------------------------------------------------------------

  /// Takes one block by best fit from the mapped slabs (mapped_free_blocks() must be > 0).
  /// Returns the block; `revived` is set when its slab was pending (the caller drops the
  /// scheduled unmap, which only needs the state change done here).
  std::int32_t take_best(bool* revived = nullptr) {
    TRIATTN_EXPECTS(!room_.empty(), "SlabLedger::take_best: no mapped slab has room");
    return take_from(room_.begin()->second, revived);
  }

  /// Takes the lowest free block of slab `s`, which must be mapped (or pending) with room.
  std::int32_t take_from(int s, bool* revived = nullptr) {
    TRIATTN_EXPECTS(s >= 0 && s < g_.num_slabs && is_allocatable_state(s) && used(s) < g_.blocks_in(s),
                    "SlabLedger::take_from: slab " + std::to_string(s) + " is not a mapped slab with a free block");
    const std::int32_t b = lowest_free(s);
    if (revived) *revived = state(s) == SlabState::kPending;
    if (state(s) == SlabState::kPending) set_state(s, SlabState::kMapped);
    room_.erase({-used(s), s});
    set_free(b, false);
    ref_[static_cast<std::size_t>(b)] = 1;
    ++used_[static_cast<std::size_t>(s)];
    if (used(s) < g_.blocks_in(s)) room_.emplace(-used(s), s);
    --mapped_free_;
    ++used_blocks_;
    return b;
  }

  /// The lowest unmapped slabs holding at least `blocks` blocks between them (what allocate()
  /// maps when mapped slabs fall short); empty when the unmapped slabs cannot hold that many.
  [[nodiscard]] std::vector<int> plan_grow(std::size_t blocks) const {
    std::vector<int> plan;
    std::size_t got = 0;
    for (auto it = unmapped_.begin(); it != unmapped_.end() && got < blocks; ++it) {
      plan.push_back(*it);
      got += static_cast<std::size_t>(g_.blocks_in(*it));
    }
    if (got < blocks) plan.clear();
    return plan;
  }

  /// The slabs a relocation empties: `movable[s]` of slab s's live blocks can be moved, and a
  /// slab qualifies only when all of them can. The emptiest qualifying slabs (ties: the highest)
  /// are taken while their blocks, at most `max_blocks` in all, still fit into the free blocks of
  /// the non-empty mapped slabs that stay. Empty slabs need no moves (trim() takes them) and are
  /// never destinations, so the slabs left hold the live blocks as densely as the free room
  /// allows. Ascending.
  [[nodiscard]] std::vector<int> pick_evacuees(std::span<const std::int32_t> movable, std::size_t max_blocks) const {
    TRIATTN_EXPECTS(movable.size() == static_cast<std::size_t>(g_.num_slabs),
                    "SlabLedger::pick_evacuees: " + std::to_string(movable.size()) + " counts for " +
                        std::to_string(g_.num_slabs) + " slabs");
    std::vector<std::pair<int, int>> cand;  // (used, -slab)
    std::size_t room = 0;                   // free blocks on non-empty mapped slabs
    for (int s = 0; s < g_.num_slabs; ++s) {
      if (state(s) != SlabState::kMapped || used(s) == 0) continue;
      room += static_cast<std::size_t>(g_.blocks_in(s) - used(s));
      if (movable[static_cast<std::size_t>(s)] == used(s)) cand.emplace_back(used(s), -s);
    }
    std::sort(cand.begin(), cand.end());
    std::vector<int> out;
    std::size_t moves = 0;
    for (const auto& [u, neg_s] : cand) {
      const std::size_t own_room = static_cast<std::size_t>(g_.blocks_in(-neg_s) - u);
      const std::size_t next = moves + static_cast<std::size_t>(u);
      if (next > max_blocks || next > room - own_room) continue;
      moves = next;
      room -= own_room;
      out.push_back(-neg_s);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  /// Empty slabs in state kMapped (candidates for unmapping), ascending.
  [[nodiscard]] std::vector<int> empty_mapped_slabs() const {
    std::vector<int> out;
    // Empty mapped slabs sort last in room_ (key 0), ascending by index.
    for (auto it = room_.lower_bound({0, -1}); it != room_.end(); ++it)
      if (state(it->second) == SlabState::kMapped) out.push_back(it->second);
    return out;
  }

  // ---- reference counts -----------------------------------------------------------------------

  void retain(std::int32_t b) {
    check_live(b, "retain");
    ++ref_[static_cast<std::size_t>(b)];
  }
  /// Drops one reference; true when the block became free. @throws logic_error (unchanged) on a
  /// foreign id or a block that is already free.
  bool release(std::int32_t b) {
    check_live(b, "release");
    if (--ref_[static_cast<std::size_t>(b)] > 0) return false;
    const int s = g_.slab_of(b);
    if (used(s) < g_.blocks_in(s)) room_.erase({-used(s), s});
    --used_[static_cast<std::size_t>(s)];
    room_.emplace(-used(s), s);
    set_free(b, true);
    ++mapped_free_;
    --used_blocks_;
    return true;
  }

  // ---- slab state transitions (driven by the allocator after the driver calls succeeded) -----

  void mark_mapped(int s) {
    expect_state(s, SlabState::kUnmapped, "mark_mapped");
    unmapped_.erase(s);
    set_state(s, SlabState::kMapped);
    room_.emplace(0, s);
    mapped_free_ += static_cast<std::size_t>(g_.blocks_in(s));
  }
  void mark_pending(int s) {
    expect_state(s, SlabState::kMapped, "mark_pending");
    TRIATTN_EXPECTS(used(s) == 0, "SlabLedger::mark_pending: slab " + std::to_string(s) + " still holds blocks");
    set_state(s, SlabState::kPending);
  }
  /// kMapped/kPending (empty) -> kUnmapped or kBroken.
  void mark_unmapped(int s, bool broken = false) {
    TRIATTN_EXPECTS(is_allocatable_state(s) && used(s) == 0,
                    "SlabLedger::mark_unmapped: slab " + std::to_string(s) + " is not an empty mapped slab");
    room_.erase({0, s});
    mapped_free_ -= static_cast<std::size_t>(g_.blocks_in(s));
    set_state(s, broken ? SlabState::kBroken : SlabState::kUnmapped);
    if (!broken) unmapped_.insert(s);
  }
  /// kUnmapped -> kBroken (a rollback could not undo a map).
  void mark_broken(int s) {
    expect_state(s, SlabState::kUnmapped, "mark_broken");
    unmapped_.erase(s);
    set_state(s, SlabState::kBroken);
  }
  /// kBroken -> kUnmapped (its stuck pages were finally given back).
  void mark_repaired(int s) {
    expect_state(s, SlabState::kBroken, "mark_repaired");
    set_state(s, SlabState::kUnmapped);
    unmapped_.insert(s);
  }

  /// Recomputes every derived counter from the arrays; throws logic_error naming the first
  /// mismatch. O(num_blocks); for tests.
  void check_invariants() const {
    std::size_t used_total = 0, mapped_free = 0;
    std::size_t counts[4] = {0, 0, 0, 0};
    for (int s = 0; s < g_.num_slabs; ++s) {
      int u = 0;
      for (int b = g_.first_block(s); b < g_.first_block(s) + g_.blocks_in(s); ++b) {
        const bool live = ref_[static_cast<std::size_t>(b)] > 0;
        TRIATTN_EXPECTS(live != is_free(b), "SlabLedger: free bit of block " + std::to_string(b) + " disagrees with its ref count");
        u += live ? 1 : 0;
      }
      TRIATTN_EXPECTS(u == used(s), "SlabLedger: slab " + std::to_string(s) + " counts " + std::to_string(used(s)) +
                                        " used blocks, holds " + std::to_string(u));
      used_total += static_cast<std::size_t>(u);
      ++counts[static_cast<int>(state(s))];
      const bool alloc = is_allocatable_state(s);
      TRIATTN_EXPECTS(alloc || u == 0, "SlabLedger: unmapped slab " + std::to_string(s) + " holds blocks");
      TRIATTN_EXPECTS(state(s) != SlabState::kPending || u == 0, "SlabLedger: pending slab " + std::to_string(s) + " holds blocks");
      if (alloc) mapped_free += static_cast<std::size_t>(g_.blocks_in(s) - u);
      const bool in_room = room_.count({-u, s}) != 0;
      TRIATTN_EXPECTS(in_room == (alloc && u < g_.blocks_in(s)), "SlabLedger: room set wrong for slab " + std::to_string(s));
      TRIATTN_EXPECTS((unmapped_.count(s) != 0) == (state(s) == SlabState::kUnmapped),
                      "SlabLedger: unmapped set wrong for slab " + std::to_string(s));
    }
    std::size_t room_expected = 0;
    for (int s = 0; s < g_.num_slabs; ++s) room_expected += (is_allocatable_state(s) && used(s) < g_.blocks_in(s)) ? 1u : 0u;
    TRIATTN_EXPECTS(room_.size() == room_expected, "SlabLedger: room set holds stale entries");
    TRIATTN_EXPECTS(used_total == used_blocks_, "SlabLedger: used block count drifted");
    TRIATTN_EXPECTS(mapped_free == mapped_free_, "SlabLedger: mapped free block count drifted");
    for (int i = 0; i < 4; ++i) TRIATTN_EXPECTS(counts[i] == count_[i], "SlabLedger: slab state count drifted");
  }

 private:
  [[nodiscard]] bool is_free(int b) const noexcept {
    return (free_bits_[static_cast<std::size_t>(b) >> 6] >> (b & 63)) & 1u;
  }
  void set_free(int b, bool f) noexcept {
    const std::uint64_t m = std::uint64_t{1} << (b & 63);
    auto& w = free_bits_[static_cast<std::size_t>(b) >> 6];
    w = f ? (w | m) : (w & ~m);
  }
  std::int32_t lowest_free(int s) const {
    const int lo = g_.first_block(s), hi = lo + g_.blocks_in(s);
    for (int w = lo >> 6; w <= (hi - 1) >> 6; ++w) {
      std::uint64_t bits = free_bits_[static_cast<std::size_t>(w)];
      if (w == (lo >> 6)) bits &= ~std::uint64_t{0} << (lo & 63);
      if (bits == 0) continue;
      const int b = w * 64 + std::countr_zero(bits);
      if (b < hi) return b;
      break;
    }
    TRIATTN_FAIL("SlabLedger: slab " + std::to_string(s) + " is in the room set but has no free block");
  }
  void set_state(int s, SlabState st) noexcept {
    --count_[static_cast<int>(state_[static_cast<std::size_t>(s)])];
    state_[static_cast<std::size_t>(s)] = st;
    ++count_[static_cast<int>(st)];
  }
  void expect_state(int s, SlabState st, const char* op) const {
    TRIATTN_EXPECTS(s >= 0 && s < g_.num_slabs && state(s) == st,
                    std::string("SlabLedger::") + op + ": slab " + std::to_string(s) + " is in state " +
                        std::to_string(static_cast<int>(s >= 0 && s < g_.num_slabs ? state(s) : SlabState::kBroken)));
  }
  void check_live(std::int32_t b, const char* op) const {
    TRIATTN_EXPECTS(b >= 0 && b < g_.num_blocks, std::string("VmmAllocator::") + op + ": block " + std::to_string(b) +
                                                     " does not belong to this allocator of " +
                                                     std::to_string(g_.num_blocks) + " blocks");
    TRIATTN_EXPECTS(ref_[static_cast<std::size_t>(b)] > 0, std::string("VmmAllocator::") + op + ": block " +
                                                                std::to_string(b) + " is already free (double free?)");
  }

  SlabGeometry g_;
  std::vector<std::int32_t> ref_;         // [num_blocks] 0 = free
  std::vector<std::uint64_t> free_bits_;  // [ceil(num_blocks / 64)] bit set = free
  std::vector<SlabState> state_;          // [num_slabs]
  std::vector<std::int32_t> used_;        // [num_slabs] live blocks per slab
  std::set<std::pair<int, int>> room_;    // (-used, slab) of mapped/pending slabs with a free block
  std::set<int> unmapped_;                // slabs in kUnmapped, ascending
  std::size_t count_[4] = {0, 0, 0, 0};   // slabs per state
  std::size_t used_blocks_ = 0;
  std::size_t mapped_free_ = 0;
};

}  // namespace triattn::vmm

// SPDX-License-Identifier: Apache-2.0
// VmmAllocatorCore<Driver>: the elastic block allocator of KvCache, written against the VmmDriver
// interface so that all of its logic is host-only and tested in CI with FakeDriver;
// triattn::cuda::VmmAllocator is this class over the real CUDA driver.
//
// Memory model (what KvCache expects of every allocator): 2 * num_layers ranges, one per
// (layer, K|V), range_stride_bytes() apart from data(); block b at b * block_bytes in every
// range. The allocator reserves address space for all ranges once (one reservation, each range
// rounded up to whole pages) and backs it with physical pages only where blocks are in use.
//
// Pools, cheapest first:
//   1. free blocks on mapped slabs (including slabs already scheduled for unmapping: allocating
//      from one cancels its unmap) - allocate() makes no driver call at all;
//   2. created-but-unmapped physical handles (the handle pool) - a map, no create;
//   3. new handles from the driver (cuMemCreate).
// Placement is best-fit by slab occupancy (see slab_ledger.hpp); growth maps the lowest unmapped
// slabs; each run of adjacent pages gets one cuMemSetAccess per range (cuMemMap binds exactly one
// handle, and handles are one page each so any page can go back alone; the access grant costs
// far more than a map, see docs/memory.md).
//
// Relocation: compaction keeps each sequence's first blocks, so a slab holding the survivors of a
// few sequences stays mapped however much of it was freed. plan_relocation() picks the emptiest
// slabs whose blocks the owner can move into the free room of fuller ones (KvCache::
// relocate_blocks copies them and repoints its tables), so those slabs empty and trim() unmaps them.
//
// Reclaim is GPU-ordered: release() only updates the ledger. trim(stream) records an event on the
// caller's stream for the empty slabs it gives back and unmaps them once that event completed
// (checked at trim/poll/synchronize; never under in-flight kernels). Unmapped handles return to
// the handle pool up to options.handle_pool_bytes, the rest to the driver.
//
// The memory limit caps physical bytes (mapped + pooled + stuck). Lowering it releases pooled
// handles, then unmaps empty slabs (GPU-ordered) down to the limit; live blocks are never touched,
// so usage above the limit only blocks further growth. Raising it just allows growth.
//
// Failure semantics: allocate() is all-or-nothing. Running out (no free block ids, the memory
// limit, or the driver's CUDA_ERROR_OUT_OF_MEMORY) returns false with last_status() saying which,
// and leaves the allocator exactly as it was (handles created, maps done are rolled back). Any
// other driver failure rolls back the same way and throws the driver's error (cuda_error for the
// real driver) naming the call and the code. Double free and foreign ids throw logic_error and
// change nothing. The destructor never throws: it waits for the device, unmaps and releases
// everything and reports failures through options.error_hook. If an undo itself fails, the
// affected pages are held as "stuck" (counted, retried at every trim/poll) and their slabs are
// kept out of placement; the hook is told.
//
// Not thread-safe: one owner (the KvCache) drives it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/vmm/driver_api.hpp>
#include <triattn/core/vmm/slab_ledger.hpp>

namespace triattn::vmm {

/// Why the last allocate()/ensure_mapped() call failed (kOk when it did not).
enum class AllocStatus : int {
  kOk = 0,
  kNoBlocks = 1,           ///< fewer free block ids than requested (capacity)
  kMemoryLimit = 2,        ///< mapping the pages would exceed the memory limit
  kDriverOutOfMemory = 3,  ///< the driver had no physical memory (CUDA_ERROR_OUT_OF_MEMORY)
};

[[nodiscard]] inline const char* alloc_status_name(AllocStatus s) noexcept {
  switch (s) {
    case AllocStatus::kOk: return "ok";
    case AllocStatus::kNoBlocks: return "no free blocks";
    case AllocStatus::kMemoryLimit: return "memory limit";
    case AllocStatus::kDriverOutOfMemory: return "driver out of memory";
  }
  return "unknown";
}

struct VmmOptions {
  /// Cap on physical bytes held (mapped + pooled handles). Can be changed at run time.
  std::size_t memory_limit = std::numeric_limits<std::size_t>::max();
  /// Unmapped physical handles kept for reuse (bytes); beyond this, unmapped pages go back to the
  /// driver. 0 (default) makes trim() return memory to the driver.
  std::size_t handle_pool_bytes = 0;
  /// Receives errors that cannot be thrown (destructor, failed rollbacks). Default: stderr.
  std::function<void(const std::string&)> error_hook;
};

/// Counters since construction (driver work done, outcomes).
struct VmmCounters {
  std::uint64_t handles_created = 0;   ///< cuMemCreate successes
  std::uint64_t handles_released = 0;  ///< cuMemRelease successes
  std::uint64_t pool_hits = 0;         ///< pages mapped from the handle pool
  std::uint64_t pages_mapped = 0;      ///< cuMemMap successes (one page each)
  std::uint64_t pages_unmapped = 0;
  std::uint64_t access_calls = 0;      ///< cuMemSetAccess successes (one per run and range)
  std::uint64_t unmap_calls = 0;       ///< cuMemUnmap successes (one per run and range)
  std::uint64_t slabs_mapped = 0;
  std::uint64_t slabs_unmapped = 0;
  std::uint64_t slabs_revived = 0;     ///< pending slabs taken back by allocate() (unmap cancelled)
  std::uint64_t trims = 0;
  std::uint64_t relocations = 0;       ///< plan_relocation calls that planned moves
  std::uint64_t blocks_relocated = 0;  ///< blocks those plans moved
  std::uint64_t slabs_evacuated = 0;   ///< slabs those plans emptied
  std::uint64_t rollbacks = 0;
  std::uint64_t fail_no_blocks = 0;
  std::uint64_t fail_memory_limit = 0;
  std::uint64_t fail_driver_oom = 0;
  std::uint64_t hook_reports = 0;      ///< errors reported through the hook
};

/// Accounting snapshot. Bytes are physical bytes over all ranges.
struct VmmStats {
  std::size_t page_bytes = 0;          ///< driver granularity
  std::size_t slab_bytes = 0;          ///< one full slab over all ranges
  int blocks_per_slab = 0;
  int pages_per_slab = 0;              ///< per range
  int num_slabs = 0;
  std::size_t blocks_used = 0;
  std::size_t blocks_free_mapped = 0;  ///< allocatable without a driver call
  std::size_t slabs_mapped = 0;        ///< includes pending
  std::size_t slabs_pending = 0;
  std::size_t slabs_broken = 0;
  std::size_t bytes_mapped = 0;        ///< == bytes_resident()
  std::size_t bytes_pooled = 0;        ///< unmapped handles kept for reuse
  std::size_t bytes_stuck = 0;         ///< pages a failed driver call left behind (retried)
  std::size_t bytes_physical = 0;      ///< mapped + pooled + stuck unmapped
  std::size_t bytes_in_used_blocks = 0;
  std::size_t bytes_pending = 0;       ///< mapped bytes scheduled for unmapping
  std::size_t memory_limit = 0;
  VmmCounters counters;
};

struct TrimResult {
  std::size_t slabs_scheduled = 0;  ///< empty slabs this call scheduled for unmapping
  std::size_t bytes_scheduled = 0;
  std::size_t bytes_unmapped = 0;   ///< unmapped during this call (event already complete)
  std::size_t bytes_pending = 0;    ///< still waiting for their event after this call
};

/// What plan_relocation() decided: move from[i] to to[i] for every i, which empties `slabs`.
struct RelocationPlan {
  std::vector<std::int32_t> from;  ///< live blocks to move, ascending
  std::vector<std::int32_t> to;    ///< their new places: fresh blocks (reference count 1) on slabs that stay
  std::vector<int> slabs;          ///< slabs the moves empty, ascending
  std::size_t bytes_freed = 0;     ///< mapped bytes of those slabs (all ranges): what trim() can then give back
  [[nodiscard]] bool empty() const noexcept { return from.empty(); }
};

struct LimitResult {
  std::size_t bytes_physical = 0;    ///< after the call
  std::size_t bytes_over_limit = 0;  ///< physical bytes above the limit that could not go (live blocks, pending events)
};

/// Exact allocator state for transactional tests (equal before and after a failed call).
struct VmmLedgerSnapshot {
  std::vector<SlabState> states;
  std::vector<std::int32_t> used;
  std::vector<std::int32_t> refs;
  std::vector<phys_handle> pool;
  std::size_t mapped_pages = 0;
  std::size_t stuck_pages = 0;
  std::size_t pending_groups = 0;
  bool operator==(const VmmLedgerSnapshot&) const = default;
};

template <VmmDriver Driver>
class VmmAllocatorCore {
 public:
  using policy_role = allocator_role;
  using driver_type = Driver;
  using stream_type = typename Driver::stream_type;
  using event_type = typename Driver::event_type;
  static constexpr MemorySpace memory_space = Driver::memory_space;

  /// Reserves address space for all 2 * num_layers ranges; maps nothing yet.
  /// @throws logic_error on an invalid cfg; the driver's error (cuda_error for the real driver)
  ///         when the granularity query or the reservation fails, or no driver is present.
  explicit VmmAllocatorCore(const CacheConfig& cfg, VmmOptions opts = {}, Driver driver = Driver{})
      : st_(std::make_unique<State>(std::move(driver), std::move(opts))) {
    cfg.validate();
    State& s = *st_;
    std::size_t gran = 0;
    if (const int c = s.drv.granularity(&gran)) s.drv.raise(DriverCall::kGranularity, c, "querying the page granularity");
    TRIATTN_EXPECTS(gran > 0, "VmmAllocator: the driver reported a zero granularity");
    s.geo = SlabGeometry::make(cfg.num_blocks, cfg.block_bytes(), 2 * cfg.model.num_layers, static_cast<std::int64_t>(gran));
    s.ledger = SlabLedger(s.geo);
    s.handles.assign(static_cast<std::size_t>(s.geo.num_ranges) * static_cast<std::size_t>(s.geo.pages_per_range), 0);
    s.stuck_per_slab.assign(static_cast<std::size_t>(s.geo.num_slabs), 0);
    s.group_of.assign(static_cast<std::size_t>(s.geo.num_slabs), 0);
    dev_addr base = 0;
    const auto bytes = static_cast<std::size_t>(s.geo.reservation_bytes());
    if (const int c = s.drv.reserve(bytes, gran, &base))
      s.drv.raise(DriverCall::kReserve, c, "reserving " + std::to_string(bytes) + " bytes of address space");
    s.base = base;
    s.reserved = true;
    s.data = s.drv.pointer(base);
  }

  VmmAllocatorCore(VmmAllocatorCore&&) noexcept = default;
  VmmAllocatorCore& operator=(VmmAllocatorCore&&) noexcept = default;
  VmmAllocatorCore(const VmmAllocatorCore&) = delete;
  VmmAllocatorCore& operator=(const VmmAllocatorCore&) = delete;
  ~VmmAllocatorCore() = default;  // State's destructor tears down, noexcept

  // ---- BlockAllocator ---------------------------------------------------------------------------

  /// All-or-nothing: fills `out` with fresh blocks (ref count 1), mapping pages as needed.
  /// @return false (nothing changed; last_status() says why) when the blocks cannot all be had.
  /// @throws the driver's error (after a full rollback) on a driver failure other than OOM.
  [[nodiscard]] bool allocate(std::span<std::int32_t> out) {
    State& s = st();
    const std::size_t n = out.size();
    if (n > s.ledger.mapped_free_blocks()) {
      const AllocStatus g = grow(n - s.ledger.mapped_free_blocks(), "allocating blocks");
      if (g != AllocStatus::kOk) return fail(g);
    }
    for (auto& b : out) {
      bool revived = false;
      b = s.ledger.take_best(&revived);
      s.counters.slabs_revived += revived ? 1u : 0u;
    }
    s.last = AllocStatus::kOk;
    return true;
  }
  /// Adds a reference (sharing). @throws logic_error on a free or foreign id.
  void retain(std::int32_t b) { st().ledger.retain(b); }
  /// Drops a reference; true when the block became free. Never calls the driver: freed pages
  /// stay mapped until trim(). @throws logic_error (unchanged) on a double free or foreign id.
  bool release(std::int32_t b) { return st().ledger.release(b); }

  [[nodiscard]] std::size_t num_free() const noexcept {
    return static_cast<std::size_t>(st_->geo.num_blocks) - st_->ledger.used_blocks();
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return static_cast<std::size_t>(st_->geo.num_blocks); }
  [[nodiscard]] int ref_count(std::int32_t b) const noexcept { return st_->ledger.ref_count(b); }
  /// Physically mapped bytes (the ledger; no driver query).
  [[nodiscard]] std::size_t bytes_resident() const noexcept { return st_->mapped_pages * page(); }
  [[nodiscard]] void* data() const noexcept { return st_->data; }
  [[nodiscard]] std::int64_t range_stride_bytes() const noexcept { return st_->geo.range_stride; }

  // ---- elasticity -------------------------------------------------------------------------------

  [[nodiscard]] AllocStatus last_status() const noexcept { return st_->last; }

  /// Maps slabs ahead of need so that at least `free_blocks` blocks are allocatable without a
  /// driver call (grow off the critical path). Same failure semantics as allocate().
  [[nodiscard]] bool ensure_mapped(std::size_t free_blocks) {
    State& s = st();
    if (free_blocks > s.ledger.mapped_free_blocks()) {
      const AllocStatus g = grow(free_blocks - s.ledger.mapped_free_blocks(), "mapping ahead");
      if (g != AllocStatus::kOk) return fail(g);
    }
    s.last = AllocStatus::kOk;
    return true;
  }

  /// Creates up to `pages` physical pages into the handle pool (within the memory limit).
  /// @return pages created (fewer when the limit or the driver's memory ran out).
  std::size_t precreate_handles(std::size_t pages) {
    State& s = st();
    std::size_t made = 0;
    for (; made < pages; ++made) {
      if (physical_bytes() + page() > s.limit) break;
      phys_handle h = 0;
      const int c = s.drv.create(page(), &h);
      if (c == kStatusOutOfMemory) break;
      if (c) s.drv.raise(DriverCall::kCreate, c, "pre-creating pooled pages");
      ++s.counters.handles_created;
      s.pool.push_back(h);
    }
    return made;
  }

  /// Releases pooled handles beyond `keep_bytes` to the driver.
  void release_handle_pool(std::size_t keep_bytes = 0) {
    State& s = st();
    Failure f;
    while (!s.pool.empty() && s.pool.size() * page() > keep_bytes) {
      const phys_handle h = s.pool.back();
      s.pool.pop_back();
      release_handle(h, 0, f);
    }
    if (f.code) s.drv.raise(f.call, f.code, f.what);
  }

  /// Gives back empty slabs beyond the lowest `keep_empty_bytes` of them: records an event on
  /// `stream` (which must be ordered after all work that touched them, e.g. the compaction) and
  /// unmaps them once it completed; finalises earlier trims whose events completed.
  /// @note No host synchronisation. synchronize() waits for the pending events.
  /// @throws the driver's error when recording/querying the event or unmapping fails (the
  ///         ledger stays consistent; failed pages are retried later).
  TrimResult trim(stream_type stream = stream_type{}, std::size_t keep_empty_bytes = 0) {
    State& s = st();
    TrimResult r;
    const std::size_t before = bytes_resident();
    poll();
    std::vector<int> sched;
    std::size_t kept = 0;
    for (int slab : s.ledger.empty_mapped_slabs()) {
      const auto b = static_cast<std::size_t>(s.geo.slab_bytes_all_ranges(slab));
      if (kept + b <= keep_empty_bytes) kept += b;
      else sched.push_back(slab);
    }
    if (!sched.empty()) {
      s.groups.reserve(s.groups.size() + 1);  // nothing below may throw once the event exists
      event_type ev{};
      if (const int c = s.drv.event_record(stream, &ev)) s.drv.raise(DriverCall::kEventRecord, c, "ordering a trim");
      const std::uint64_t id = ++s.next_group;
      for (int slab : sched) {
        s.ledger.mark_pending(slab);
        s.group_of[static_cast<std::size_t>(slab)] = id;
        r.bytes_scheduled += static_cast<std::size_t>(s.geo.slab_bytes_all_ranges(slab));
      }
      r.slabs_scheduled = sched.size();
      s.groups.push_back(Group{id, ev, std::move(sched)});
      ++s.counters.trims;
    }
    poll();
    r.bytes_unmapped = before - bytes_resident();
    r.bytes_pending = pending_bytes();
    return r;
  }

  /// Unmaps the slabs of every scheduled trim whose event completed; retries stuck pages.
  /// @return bytes unmapped. @throws the driver's error (ledger consistent) on a failure.
  std::size_t poll() {
    State& s = st();
    const std::size_t before = bytes_resident();
    Failure f;
    retry_stuck();
    for (auto it = s.groups.begin(); it != s.groups.end();) {
      bool done = false;
      if (const int c = s.drv.event_query(it->event, &done)) s.drv.raise(DriverCall::kEventQuery, c, "polling a trim's event");
      if (!done) {
        ++it;
        continue;
      }
      finalize(*it, f);
      it = s.groups.erase(it);
    }
    if (f.code) s.drv.raise(f.call, f.code, f.what);
    return before - bytes_resident();
  }

  /// Plans moving live blocks out of sparsely used slabs so that whole slabs empty and trim()
  /// can unmap them: placement never moves a block, so after a compaction a slab that keeps a
  /// few survivors of several sequences stays mapped. `movable` lists live blocks the caller can
  /// move (it holds their only reference and can repoint every table entry that names them); a
  /// slab with any other live block stays. The emptiest slabs are emptied while their blocks (at
  /// most `max_blocks`) fit into the free blocks of the fuller mapped slabs (best fit, fullest
  /// first); empty slabs are never destinations. The destinations are taken now (reference
  /// count 1, no driver call). The caller then copies every from[i] to to[i] (ordered before
  /// anything reuses from[i]), repoints its tables and releases from[i]; to abandon the plan it
  /// releases every to[i] instead.
  /// @return an empty plan when no slab can be emptied this way.
  /// @throws logic_error (nothing changed) on a foreign, free, shared or repeated block in `movable`.
  [[nodiscard]] RelocationPlan plan_relocation(std::span<const std::int32_t> movable,
                                               std::size_t max_blocks = std::numeric_limits<std::size_t>::max()) {
    State& s = st();
    const SlabGeometry& g = s.geo;
    std::vector<std::int32_t> per_slab(static_cast<std::size_t>(g.num_slabs), 0);
    std::vector<std::uint8_t> seen(static_cast<std::size_t>(g.num_blocks), 0);
    for (const std::int32_t b : movable) {
      TRIATTN_EXPECTS(b >= 0 && b < g.num_blocks && s.ledger.ref_count(b) == 1 && !seen[static_cast<std::size_t>(b)],
                      "VmmAllocator::plan_relocation: block " + std::to_string(b) +
                          " is not a live block with one reference listed once (ref count " +
                          std::to_string(s.ledger.ref_count(b)) + ")");
      seen[static_cast<std::size_t>(b)] = 1;
      ++per_slab[static_cast<std::size_t>(g.slab_of(b))];
    }
    RelocationPlan plan;
    plan.slabs = s.ledger.pick_evacuees(per_slab, max_blocks);
    if (plan.slabs.empty()) return plan;
    std::vector<std::uint8_t> leaving(static_cast<std::size_t>(g.num_slabs), 0);
    for (const int slab : plan.slabs) {
      leaving[static_cast<std::size_t>(slab)] = 1;
      plan.bytes_freed += static_cast<std::size_t>(g.slab_bytes_all_ranges(slab));
      for (int b = g.first_block(slab); b < g.first_block(slab) + g.blocks_in(slab); ++b)
        if (s.ledger.ref_count(b) > 0) plan.from.push_back(b);
    }
    // Destinations: the staying non-empty slabs, fullest first (ties: lowest), lowest block first.
    std::vector<std::pair<int, int>> stay;  // (-used, slab)
    for (int slab = 0; slab < g.num_slabs; ++slab)
      if (s.ledger.state(slab) == SlabState::kMapped && s.ledger.used(slab) > 0 && !leaving[static_cast<std::size_t>(slab)] &&
          s.ledger.used(slab) < g.blocks_in(slab))
        stay.emplace_back(-s.ledger.used(slab), slab);
    std::sort(stay.begin(), stay.end());
    plan.to.reserve(plan.from.size());
    for (std::size_t i = 0; i < stay.size() && plan.to.size() < plan.from.size(); ++i)
      while (plan.to.size() < plan.from.size() && s.ledger.used(stay[i].second) < g.blocks_in(stay[i].second))
        plan.to.push_back(s.ledger.take_from(stay[i].second));
    if (plan.to.size() != plan.from.size()) {  // pick_evacuees counted the room: never happens
      for (const std::int32_t b : plan.to) (void)s.ledger.release(b);
      TRIATTN_FAIL("VmmAllocator::plan_relocation: found " + std::to_string(plan.to.size()) + " destinations for " +
                   std::to_string(plan.from.size()) + " blocks");
    }
    ++s.counters.relocations;
    s.counters.blocks_relocated += plan.from.size();
    s.counters.slabs_evacuated += plan.slabs.size();
    return plan;
  }

  /// Waits (host-blocking) for every scheduled trim's event, then unmaps.
  void synchronize() {
    State& s = st();
    for (auto& g : s.groups)
      if (const int c = s.drv.event_sync(g.event)) s.drv.raise(DriverCall::kEventSync, c, "waiting for a trim's event");
    poll();
  }

  /// Sets the cap on physical bytes. Lowering it releases pooled handles, then schedules empty
  /// slabs (highest first) for unmapping after an event on `stream`, and with `wait` blocks until
  /// they are gone. Live blocks are never unmapped: what they hold above the limit is reported.
  LimitResult set_memory_limit(std::size_t bytes, stream_type stream = stream_type{}, bool wait = true) {
    State& s = st();
    s.limit = bytes;
    Failure f;
    while (!s.pool.empty() && physical_bytes() > s.limit) {
      const phys_handle h = s.pool.back();
      s.pool.pop_back();
      release_handle(h, 0, f);
    }
    if (f.code) s.drv.raise(f.call, f.code, f.what);
    if (physical_bytes() > s.limit) {
      poll();
      std::size_t going = pending_bytes();
      std::vector<int> empties = s.ledger.empty_mapped_slabs();
      std::vector<int> sched;
      for (auto it = empties.rbegin(); it != empties.rend() && physical_bytes() > s.limit + going; ++it) {
        sched.push_back(*it);
        going += static_cast<std::size_t>(s.geo.slab_bytes_all_ranges(*it));
      }
      if (!sched.empty()) {
        s.groups.reserve(s.groups.size() + 1);
        event_type ev{};
        if (const int c = s.drv.event_record(stream, &ev)) s.drv.raise(DriverCall::kEventRecord, c, "ordering a limit change");
        const std::uint64_t id = ++s.next_group;
        for (int slab : sched) {
          s.ledger.mark_pending(slab);
          s.group_of[static_cast<std::size_t>(slab)] = id;
        }
        s.groups.push_back(Group{id, ev, std::move(sched)});
      }
      if (wait) synchronize();
      else poll();
    }
    LimitResult r;
    r.bytes_physical = physical_bytes();
    r.bytes_over_limit = r.bytes_physical > s.limit ? r.bytes_physical - s.limit : 0;
    return r;
  }
  [[nodiscard]] std::size_t memory_limit() const noexcept { return st_->limit; }

  /// Changes options.handle_pool_bytes (takes effect at the next unmap; see release_handle_pool).
  void set_handle_pool_bytes(std::size_t bytes) noexcept { st_->opt.handle_pool_bytes = bytes; }
  [[nodiscard]] std::size_t handle_pool_bytes() const noexcept { return st_->opt.handle_pool_bytes; }
  /// Replaces options.error_hook (useful when a wrapper constructs the allocator from cfg only).
  void set_error_hook(std::function<void(const std::string&)> hook) { st_->opt.error_hook = std::move(hook); }

  // ---- accounting -------------------------------------------------------------------------------

  [[nodiscard]] std::size_t bytes_pooled() const noexcept { return st_->pool.size() * page(); }
  /// Physical bytes held from the driver: mapped + pooled + stuck.
  [[nodiscard]] std::size_t physical_bytes() const noexcept {
    return (st_->mapped_pages + st_->pool.size() + st_->stuck_unmapped) * page();
  }
  [[nodiscard]] std::size_t pending_bytes() const noexcept {
    std::size_t b = 0;
    for (int s = 0; s < st_->geo.num_slabs; ++s)
      if (st_->ledger.state(s) == SlabState::kPending) b += static_cast<std::size_t>(st_->geo.slab_bytes_all_ranges(s));
    return b;
  }
  [[nodiscard]] std::size_t page_bytes() const noexcept { return page(); }
  [[nodiscard]] const SlabGeometry& geometry() const noexcept { return st_->geo; }
  [[nodiscard]] const SlabLedger& ledger() const noexcept { return st_->ledger; }
  [[nodiscard]] std::size_t num_pending_trims() const noexcept { return st_->groups.size(); }
  [[nodiscard]] std::size_t num_stuck_pages() const noexcept { return st_->stuck.size(); }
  [[nodiscard]] const VmmCounters& counters() const noexcept { return st_->counters; }
  [[nodiscard]] Driver& driver() noexcept { return st_->drv; }
  [[nodiscard]] const Driver& driver() const noexcept { return st_->drv; }
  [[nodiscard]] dev_addr base_address() const noexcept { return st_->base; }
  /// Address of page `p` of range `r`.
  [[nodiscard]] dev_addr page_address(int r, int p) const noexcept {
    return st_->base + static_cast<dev_addr>(r) * static_cast<dev_addr>(st_->geo.range_stride) +
           static_cast<dev_addr>(p) * page();
  }

  [[nodiscard]] VmmStats stats() const {
    const State& s = *st_;
    VmmStats v;
    v.page_bytes = page();
    v.slab_bytes = static_cast<std::size_t>(s.geo.slab_bytes) * static_cast<std::size_t>(s.geo.num_ranges);
    v.blocks_per_slab = s.geo.blocks_per_slab;
    v.pages_per_slab = s.geo.pages_per_slab;
    v.num_slabs = s.geo.num_slabs;
    v.blocks_used = s.ledger.used_blocks();
    v.blocks_free_mapped = s.ledger.mapped_free_blocks();
    v.slabs_pending = s.ledger.num_in_state(SlabState::kPending);
    v.slabs_mapped = s.ledger.num_in_state(SlabState::kMapped) + v.slabs_pending;
    v.slabs_broken = s.ledger.num_in_state(SlabState::kBroken);
    v.bytes_mapped = bytes_resident();
    v.bytes_pooled = bytes_pooled();
    v.bytes_stuck = s.stuck.size() * page();
    v.bytes_physical = physical_bytes();
    v.bytes_in_used_blocks = s.ledger.used_blocks() * static_cast<std::size_t>(s.geo.block_bytes) *
                             static_cast<std::size_t>(s.geo.num_ranges);
    v.bytes_pending = pending_bytes();
    v.memory_limit = s.limit;
    v.counters = s.counters;
    return v;
  }

  [[nodiscard]] VmmLedgerSnapshot snapshot() const {
    const State& s = *st_;
    return VmmLedgerSnapshot{s.ledger.states(), s.ledger.used_counts(), s.ledger.ref_counts(), s.pool,
                             s.mapped_pages,    s.stuck.size(),          s.groups.size()};
  }

  /// Recomputes the ledger's derived counters and the page accounting; throws logic_error on a
  /// mismatch. O(num_blocks); for tests.
  void check_invariants() const {
    const State& s = *st_;
    s.ledger.check_invariants();
    std::size_t mapped = 0;
    for (int slab = 0; slab < s.geo.num_slabs; ++slab)
      if (s.ledger.is_allocatable_state(slab))
        mapped += static_cast<std::size_t>(s.geo.pages_in(slab)) * static_cast<std::size_t>(s.geo.num_ranges);
    std::size_t stuck_mapped = 0, stuck_unmapped = 0;
    for (auto& e : s.stuck) (e.mapped ? stuck_mapped : stuck_unmapped) += 1;
    TRIATTN_EXPECTS(mapped + stuck_mapped == s.mapped_pages, "VmmAllocator: mapped page count drifted");
    TRIATTN_EXPECTS(stuck_unmapped == s.stuck_unmapped, "VmmAllocator: stuck page count drifted");
    for (int slab = 0; slab < s.geo.num_slabs; ++slab) {
      const bool pending = s.ledger.state(slab) == SlabState::kPending;
      bool in_group = false;
      for (auto& g : s.groups)
        if (g.id == s.group_of[static_cast<std::size_t>(slab)])
          in_group = in_group || std::find(g.slabs.begin(), g.slabs.end(), slab) != g.slabs.end();
      TRIATTN_EXPECTS(!pending || in_group, "VmmAllocator: pending slab " + std::to_string(slab) + " has no trim event");
    }
  }

 private:
  struct Group {
    std::uint64_t id;
    event_type event;
    std::vector<int> slabs;  // scheduled; those revived since are skipped (state or group changed)
  };
  struct Stuck {
    std::size_t slot;  // range * pages_per_range + page
    phys_handle handle;
    bool mapped;
  };
  struct Failure {
    DriverCall call = DriverCall::kCount;
    int code = 0;
    std::string what;
    void set(DriverCall c, int e, std::string w) {
      if (code != 0) return;  // keep the first
      call = c;
      code = e;
      what = std::move(w);
    }
  };
  struct State {
    Driver drv;
    VmmOptions opt;
    SlabGeometry geo;
    SlabLedger ledger;
    std::vector<phys_handle> handles;  // [num_ranges * pages_per_range] handle of each mapped page
    std::vector<phys_handle> pool;     // created-but-unmapped, LIFO
    std::vector<Stuck> stuck;
    std::vector<int> stuck_per_slab;   // [num_slabs]
    std::vector<std::uint64_t> group_of;  // [num_slabs] id of the trim a pending slab belongs to
    std::vector<Group> groups;         // scheduled trims, oldest first
    std::uint64_t next_group = 0;
    std::size_t mapped_pages = 0;      // pages (per range, per page) mapped, stuck included
    std::size_t stuck_unmapped = 0;    // stuck entries holding an unmapped handle
    std::size_t limit;
    dev_addr base = 0;
    bool reserved = false;
    void* data = nullptr;
    AllocStatus last = AllocStatus::kOk;
    VmmCounters counters;

    State(Driver d, VmmOptions o) : drv(std::move(d)), opt(std::move(o)), limit(opt.memory_limit) {}
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() { teardown(); }

    void report(const std::string& msg) noexcept {
      ++counters.hook_reports;
      try {
        if (opt.error_hook) opt.error_hook(msg);
        else std::fprintf(stderr, "triattn: VmmAllocator: %s\n", msg.c_str());
      } catch (...) {
      }
    }
    void report(DriverCall call, int code, const char* what) noexcept {
      try {
        report(drv.describe(call, code) + " while " + what);
      } catch (...) {
      }
    }
    dev_addr va(std::size_t slot) const noexcept {
      const auto ppr = static_cast<std::size_t>(geo.pages_per_range);
      return base + static_cast<dev_addr>(slot / ppr) * static_cast<dev_addr>(geo.range_stride) +
             static_cast<dev_addr>(slot % ppr) * static_cast<dev_addr>(geo.page_bytes);
    }

    /// Never throws: waits for the device, unmaps and releases everything, frees the VA.
    void teardown() noexcept {
      if (!reserved) return;
      reserved = false;
      const auto g = static_cast<std::size_t>(geo.page_bytes);
      const auto ppr = static_cast<std::size_t>(geo.pages_per_range);
      bool clean = true;
      if (mapped_pages > 0 || !groups.empty())
        if (const int c = drv.quiesce()) report(DriverCall::kQuiesce, c, "waiting for the device before unmapping (destructor)");
      for (auto& grp : groups) drv.event_destroy(grp.event);
      groups.clear();
      // Unmap every mapped slab, one call per run of slabs and range.
      for (int s0 = 0; s0 < geo.num_slabs;) {
        if (!ledger.is_allocatable_state(s0)) {
          ++s0;
          continue;
        }
        int s1 = s0;
        while (s1 + 1 < geo.num_slabs && ledger.is_allocatable_state(s1 + 1)) ++s1;
        const auto p0 = static_cast<std::size_t>(geo.first_page(s0));
        const auto np = static_cast<std::size_t>(geo.first_page(s1) + geo.pages_in(s1)) - p0;
        for (std::size_t r = 0; r < static_cast<std::size_t>(geo.num_ranges); ++r) {
          if (const int c = drv.unmap(va(r * ppr + p0), np * g)) {
            report(DriverCall::kUnmap, c, "unmapping pages (destructor)");
            clean = false;
            continue;
          }
          for (std::size_t p = p0; p < p0 + np; ++p)
            if (const int c = drv.release(handles[r * ppr + p])) report(DriverCall::kRelease, c, "releasing pages (destructor)");
        }
        s0 = s1 + 1;
      }
      for (phys_handle h : pool)
        if (const int c = drv.release(h)) report(DriverCall::kRelease, c, "releasing pooled pages (destructor)");
      pool.clear();
      for (auto& e : stuck) {
        if (e.mapped) {
          if (const int c = drv.unmap(va(e.slot), g)) {
            report(DriverCall::kUnmap, c, "unmapping a stuck page (destructor)");
            clean = false;
            continue;
          }
        }
        if (const int c = drv.release(e.handle)) report(DriverCall::kRelease, c, "releasing a stuck page (destructor)");
      }
      stuck.clear();
      if (const int c = drv.free(base, static_cast<std::size_t>(geo.reservation_bytes())))
        report(DriverCall::kFree, c, clean ? "freeing the address space (destructor)"
                                           : "freeing the address space after failed unmaps (destructor)");
    }
  };

  State& st() {
    TRIATTN_EXPECTS(st_ != nullptr, "VmmAllocator: use of a moved-from allocator");
    return *st_;
  }
  std::size_t page() const noexcept { return static_cast<std::size_t>(st_->geo.page_bytes); }

  bool fail(AllocStatus g) {
    State& s = *st_;
    s.last = g;
    if (g == AllocStatus::kNoBlocks) ++s.counters.fail_no_blocks;
    if (g == AllocStatus::kMemoryLimit) ++s.counters.fail_memory_limit;
    if (g == AllocStatus::kDriverOutOfMemory) ++s.counters.fail_driver_oom;
    return false;
  }

  /// Maps the lowest unmapped slabs holding at least `blocks` blocks. Transactional.
  AllocStatus grow(std::size_t blocks, const char* why) {
    State& s = *st_;
    const std::vector<int> plan = s.ledger.plan_grow(blocks);
    if (plan.empty()) return AllocStatus::kNoBlocks;
    std::size_t pages = 0;
    for (int slab : plan) pages += static_cast<std::size_t>(s.geo.pages_in(slab)) * static_cast<std::size_t>(s.geo.num_ranges);
    const std::size_t fresh = pages > s.pool.size() ? pages - s.pool.size() : 0;
    if (fresh > 0 && (physical_bytes() > s.limit || fresh * page() > s.limit - physical_bytes()))
      return AllocStatus::kMemoryLimit;
    return map_slabs(plan, why);
  }

  struct Taken {
    std::size_t slot;
    phys_handle handle;
    bool pooled;
    bool mapped;
  };

  AllocStatus map_slabs(const std::vector<int>& plan, const char* why) {
    State& s = *st_;
    const auto ppr = static_cast<std::size_t>(s.geo.pages_per_range);
    std::vector<Taken> log;
    Failure f;
    std::uint64_t access_calls = 0;
    for (std::size_t i = 0; i < plan.size() && !f.code;) {
      std::size_t j = i;
      while (j + 1 < plan.size() && plan[j + 1] == plan[j] + 1) ++j;
      const auto p0 = static_cast<std::size_t>(s.geo.first_page(plan[i]));
      const auto np = static_cast<std::size_t>(s.geo.first_page(plan[j]) + s.geo.pages_in(plan[j])) - p0;
      for (std::size_t r = 0; r < static_cast<std::size_t>(s.geo.num_ranges) && !f.code; ++r) {
        for (std::size_t p = p0; p < p0 + np; ++p) {
          const std::size_t slot = r * ppr + p;
          phys_handle h = 0;
          bool pooled = false;
          if (!s.pool.empty()) {
            h = s.pool.back();
            s.pool.pop_back();
            pooled = true;
          } else if (const int c = s.drv.create(page(), &h)) {
            f.set(DriverCall::kCreate, c, why);
            break;
          }
          log.push_back(Taken{slot, h, pooled, false});
          if (const int c = s.drv.map(s.va(slot), page(), h)) {
            f.set(DriverCall::kMap, c, why);
            break;
          }
          log.back().mapped = true;
        }
        if (f.code) break;
        if (const int c = s.drv.set_access(s.va(r * ppr + p0), np * page())) {
          f.set(DriverCall::kSetAccess, c, why);
          break;
        }
        ++access_calls;
      }
      i = j + 1;
    }
    if (f.code) {
      rollback(log, plan);
      ++s.counters.rollbacks;
      if (f.code == kStatusOutOfMemory) return AllocStatus::kDriverOutOfMemory;
      s.drv.raise(f.call, f.code, f.what);
    }
    for (const Taken& t : log) {
      s.handles[t.slot] = t.handle;
      (t.pooled ? s.counters.pool_hits : s.counters.handles_created) += 1;
    }
    s.counters.pages_mapped += log.size();
    s.counters.access_calls += access_calls;
    s.counters.slabs_mapped += plan.size();
    s.mapped_pages += log.size();
    for (int slab : plan) s.ledger.mark_mapped(slab);
    return AllocStatus::kOk;
  }

  /// Undoes a failed map_slabs in reverse order; pooled handles go back in their old order.
  void rollback(const std::vector<Taken>& log, const std::vector<int>& plan) noexcept {
    State& s = *st_;
    for (auto it = log.rbegin(); it != log.rend(); ++it) {
      if (it->mapped) {
        if (const int c = s.drv.unmap(s.va(it->slot), page())) {
          s.report(DriverCall::kUnmap, c, "rolling back a failed allocation (page kept as stuck)");
          add_stuck(Stuck{it->slot, it->handle, true});
          continue;
        }
      }
      if (it->pooled) {
        s.pool.push_back(it->handle);  // cannot throw: popped from it before
      } else if (const int c = s.drv.release(it->handle)) {
        s.report(DriverCall::kRelease, c, "rolling back a failed allocation (handle kept as stuck)");
        add_stuck(Stuck{it->slot, it->handle, false});
      }
    }
    for (int slab : plan)
      if (s.stuck_per_slab[static_cast<std::size_t>(slab)] > 0 && s.ledger.state(slab) == SlabState::kUnmapped)
        s.ledger.mark_broken(slab);
  }

  /// Records a page a failed driver call left behind. A stuck *mapped* page keeps its slab out of
  /// placement (kBroken) until retry_stuck() unmaps it; a stuck unmapped handle only waits for
  /// its release.
  void add_stuck(const Stuck& e) noexcept {
    State& s = *st_;
    try {
      s.stuck.push_back(e);
    } catch (...) {
      s.report("out of host memory while recording a stuck page");
      return;
    }
    if (e.mapped) {
      ++s.stuck_per_slab[slab_of_slot(e.slot)];
      ++s.mapped_pages;
    } else {
      ++s.stuck_unmapped;
    }
  }
  std::size_t slab_of_slot(std::size_t slot) const noexcept {
    return (slot % static_cast<std::size_t>(st_->geo.pages_per_range)) / static_cast<std::size_t>(st_->geo.pages_per_slab);
  }

  /// Pool (within options.handle_pool_bytes and the limit) or release one unmapped handle.
  void give_back(phys_handle h, std::size_t slot, Failure& f) {
    State& s = *st_;
    if ((s.pool.size() + 1) * page() <= s.opt.handle_pool_bytes && physical_bytes() + page() <= s.limit) {
      s.pool.push_back(h);
      return;
    }
    release_handle(h, slot, f);
  }
  void release_handle(phys_handle h, std::size_t slot, Failure& f) {
    State& s = *st_;
    if (const int c = s.drv.release(h)) {
      f.set(DriverCall::kRelease, c, "releasing an unmapped page");
      add_stuck(Stuck{slot, h, false});
      return;
    }
    ++s.counters.handles_released;
  }

  /// Unmaps the still-pending slabs of a completed trim, one call per run of slabs and range.
  void finalize(Group& grp, Failure& f) {
    State& s = *st_;
    std::vector<int> slabs;
    for (int slab : grp.slabs)
      if (s.ledger.state(slab) == SlabState::kPending && s.group_of[static_cast<std::size_t>(slab)] == grp.id)
        slabs.push_back(slab);
    s.drv.event_destroy(grp.event);
    std::sort(slabs.begin(), slabs.end());
    unmap_slabs(slabs, f);
  }

  void unmap_slabs(const std::vector<int>& slabs, Failure& f) {
    State& s = *st_;
    const auto ppr = static_cast<std::size_t>(s.geo.pages_per_range);
    for (std::size_t i = 0; i < slabs.size();) {
      std::size_t j = i;
      while (j + 1 < slabs.size() && slabs[j + 1] == slabs[j] + 1) ++j;
      const auto p0 = static_cast<std::size_t>(s.geo.first_page(slabs[i]));
      const auto np = static_cast<std::size_t>(s.geo.first_page(slabs[j]) + s.geo.pages_in(slabs[j])) - p0;
      // The ledger first (the slabs' blocks leave placement whatever the driver says)...
      for (std::size_t k = i; k <= j; ++k) s.ledger.mark_unmapped(slabs[k], /*broken=*/false);
      for (std::size_t r = 0; r < static_cast<std::size_t>(s.geo.num_ranges); ++r) {
        if (const int c = s.drv.unmap(s.va(r * ppr + p0), np * page())) {
          f.set(DriverCall::kUnmap, c, "unmapping trimmed pages");
          for (std::size_t p = p0; p < p0 + np; ++p) {
            const std::size_t slot = r * ppr + p;
            --s.mapped_pages;  // add_stuck counts it again as a stuck mapped page
            add_stuck(Stuck{slot, s.handles[slot], true});
          }
          continue;
        }
        ++s.counters.unmap_calls;
        for (std::size_t p = p0; p < p0 + np; ++p) {
          --s.mapped_pages;
          ++s.counters.pages_unmapped;
          give_back(s.handles[r * ppr + p], r * ppr + p, f);
        }
      }
      // ...then the slabs a failure left pages of are held out of placement until repaired.
      for (std::size_t k = i; k <= j; ++k) {
        ++s.counters.slabs_unmapped;
        if (s.stuck_per_slab[static_cast<std::size_t>(slabs[k])] > 0) s.ledger.mark_broken(slabs[k]);
      }
      i = j + 1;
    }
  }

  /// Retries the driver calls that left stuck pages; repaired slabs return to placement.
  void retry_stuck() noexcept {
    State& s = *st_;
    for (std::size_t i = 0; i < s.stuck.size();) {
      Stuck& e = s.stuck[i];
      if (e.mapped) {
        if (s.drv.unmap(s.va(e.slot), page()) != 0) {
          ++i;
          continue;
        }
        e.mapped = false;
        --s.mapped_pages;
        ++s.stuck_unmapped;
        ++s.counters.pages_unmapped;
        const std::size_t slab = slab_of_slot(e.slot);
        if (--s.stuck_per_slab[slab] == 0 && s.ledger.state(static_cast<int>(slab)) == SlabState::kBroken)
          s.ledger.mark_repaired(static_cast<int>(slab));
      }
      if (s.drv.release(e.handle) != 0) {
        ++i;
        continue;
      }
      --s.stuck_unmapped;
      ++s.counters.handles_released;
      s.stuck.erase(s.stuck.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  std::unique_ptr<State> st_;
};

}  // namespace triattn::vmm

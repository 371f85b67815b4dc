// SPDX-License-Identifier: Apache-2.0
// Consistency check between a VmmAllocatorCore<FakeDriver> and the fake device under it: what
// the allocator's ledger says is mapped, pooled and live must be exactly what the driver holds.
// Test support of triattn (not installed).
#pragma once

#include <cstddef>
#include <string>

#include <triattn/core/error.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>

#include "fake_driver.hpp"

namespace triattn::vmm {

/// Throws logic_error naming the first disagreement:
///  - the ledger's own invariants (VmmAllocatorCore::check_invariants);
///  - the fake saw no misuse (violations() == 0);
///  - mapped bytes, mapping count, created bytes and live handles equal the ledger's
///    (bytes_resident, physical_bytes), so nothing leaked and nothing is half-mapped;
///  - every page of every mapped slab is mapped and accessible in every range, and no page of
///    an unmapped slab is;
///  - one reservation; one live event per scheduled trim.
inline void check_consistent(const VmmAllocatorCore<FakeDriver>& a) {
  a.check_invariants();
  const FakeDriver& d = a.driver();
  auto expect = [](bool ok, const std::string& what) { TRIATTN_EXPECTS(ok, "vmm::check_consistent: " + what); };
  expect(d.violations() == 0, "the fake driver saw misuse: " + d.last_violation());
  expect(d.bytes_mapped() == a.bytes_resident(), "driver maps " + std::to_string(d.bytes_mapped()) +
                                                     " bytes, ledger says " + std::to_string(a.bytes_resident()));
  expect(d.num_mappings() * a.page_bytes() == d.bytes_mapped(), "a mapping is not exactly one page");
  expect(d.bytes_created() == a.physical_bytes(), "driver holds " + std::to_string(d.bytes_created()) +
                                                      " physical bytes, ledger says " + std::to_string(a.physical_bytes()));
  expect(d.live_handles() * a.page_bytes() == d.bytes_created(), "a handle is not exactly one page");
  expect(d.num_reservations() == 1, "expected one reservation, driver holds " + std::to_string(d.num_reservations()));
  expect(d.live_events() == a.num_pending_trims(), "driver holds " + std::to_string(d.live_events()) +
                                                       " events for " + std::to_string(a.num_pending_trims()) + " trims");
  const SlabGeometry& g = a.geometry();
  if (a.num_stuck_pages() == 0)
    expect(d.bytes_accessible() == d.bytes_mapped(), "mapped pages without access");
  for (int s = 0; s < g.num_slabs; ++s) {
    const bool mapped = a.ledger().is_allocatable_state(s);
    if (!mapped && a.ledger().state(s) == SlabState::kBroken) continue;
    for (int r = 0; r < g.num_ranges; ++r) {
      const dev_addr va = a.page_address(r, g.first_page(s));
      const std::size_t bytes = static_cast<std::size_t>(g.pages_in(s)) * a.page_bytes();
      if (mapped) {
        expect(d.accessible(va, bytes), "slab " + std::to_string(s) + " range " + std::to_string(r) + " is not accessible");
      } else {
        for (int p = 0; p < g.pages_in(s); ++p)
          expect(!d.accessible(va + static_cast<dev_addr>(p) * a.page_bytes(), a.page_bytes()),
                 "unmapped slab " + std::to_string(s) + " has a mapped page in range " + std::to_string(r));
      }
    }
  }
}

}  // namespace triattn::vmm

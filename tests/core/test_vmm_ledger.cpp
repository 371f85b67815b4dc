// SPDX-License-Identifier: Apache-2.0
// VmmAllocatorCore on the fake driver: geometry, best-fit placement, batching of driver calls,
// pools, GPU-ordered trim, memory limit, error handling, and KvCache integration.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>

#include "common/vmm/fake_driver.hpp"
#include "common/vmm/testing.hpp"

namespace {

using triattn::CacheConfig;
using triattn::DType;
using triattn::vmm::AllocStatus;
using triattn::vmm::DriverCall;
using triattn::vmm::FakeDriver;
using triattn::vmm::FakeDriverOptions;
using triattn::vmm::SlabState;
using triattn::vmm::VmmOptions;
using Alloc = triattn::vmm::VmmAllocatorCore<FakeDriver>;

static_assert(triattn::BlockAllocator<Alloc>);
static_assert(Alloc::memory_space == triattn::MemorySpace::kHost);

constexpr std::size_t kPage = 4096;

/// 2 layers (4 ranges), f32; block_bytes = block_size * kv_heads * head_dim * 4.
CacheConfig config(int block_size, int kv_heads, int head_dim, int num_blocks) {
  CacheConfig c;
  c.model = {2, kv_heads, kv_heads, head_dim};
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.max_seqs = 8;
  c.dtype = DType::kF32;
  return c;
}
/// 256-byte blocks: 16 per 4 KiB page, 32 slabs of one page.
CacheConfig small_config() { return config(4, 2, 8, 512); }

FakeDriver fake(bool host = false, bool manual = false) {
  FakeDriverOptions o;
  o.granularity = kPage;
  o.host_backed = host;
  o.manual_events = manual;
  return FakeDriver(o);
}

std::vector<std::int32_t> take(Alloc& a, std::size_t n) {
  std::vector<std::int32_t> out(n, -1);
  REQUIRE(a.allocate(out));
  return out;
}

}  // namespace

TEST_SUITE("vmm") {

TEST_CASE("vmm: geometry of slabs for blocks smaller than or larger than or not dividing the page") {
  using triattn::vmm::SlabGeometry;
  SUBCASE("block divides the page") {
    const auto g = SlabGeometry::make(512, 256, 4, 4096);
    CHECK(g.blocks_per_slab == 16);
    CHECK(g.pages_per_slab == 1);
    CHECK(g.num_slabs == 32);
    CHECK(g.pages_per_range == 32);
    CHECK(g.range_stride == 32 * 4096);
  }
  SUBCASE("page divides the block") {
    const auto g = SlabGeometry::make(100, 8192, 4, 4096);
    CHECK(g.blocks_per_slab == 1);
    CHECK(g.pages_per_slab == 2);
    CHECK(g.num_slabs == 100);
    CHECK(g.pages_in(99) == 2);
  }
  SUBCASE("neither: slab = lcm, last slab short") {
    const auto g = SlabGeometry::make(400, 192, 4, 4096);
    CHECK(g.slab_bytes == 12288);
    CHECK(g.blocks_per_slab == 64);
    CHECK(g.pages_per_slab == 3);
    CHECK(g.num_slabs == 7);
    CHECK(g.pages_per_range == 19);  // ceil(400 * 192 / 4096)
    CHECK(g.blocks_in(6) == 16);
    CHECK(g.pages_in(6) == 1);
  }
  SUBCASE("huge lcm is capped at the range") {
    const auto g = SlabGeometry::make(10, 4200, 2, 1 << 21);
    CHECK(g.num_slabs == 1);
    CHECK(g.blocks_per_slab == 10);
    CHECK(g.pages_in(0) == g.pages_per_range);
  }
  CHECK_THROWS_AS(SlabGeometry::make(0, 256, 4, 4096), triattn::logic_error);
}

TEST_CASE("vmm: construction reserves address space once and maps nothing") {
  Alloc a(small_config(), {}, fake());
  const FakeDriver& d = a.driver();
  CHECK(d.num_reservations() == 1);
  CHECK(d.bytes_reserved() == 4 * 32 * kPage);
  CHECK(d.calls(DriverCall::kReserve) == 1);
  CHECK(d.live_handles() == 0);
  CHECK(a.bytes_resident() == 0);
  CHECK(a.capacity() == 512);
  CHECK(a.num_free() == 512);
  CHECK(a.range_stride_bytes() == 32 * static_cast<std::int64_t>(kPage));
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: pages are mapped on demand in all ranges with one access grant per run and range") {
  Alloc a(small_config(), {}, fake());
  FakeDriver d = a.driver();
  auto b = take(a, 5);
  CHECK(b == std::vector<std::int32_t>{0, 1, 2, 3, 4});
  CHECK(a.bytes_resident() == 4 * kPage);  // one page in each of the 4 ranges
  CHECK(d.calls(DriverCall::kCreate) == 4);
  CHECK(d.calls(DriverCall::kMap) == 4);
  CHECK(d.calls(DriverCall::kSetAccess) == 4);
  triattn::vmm::check_consistent(a);

  d.reset_counters();
  auto c = take(a, 11 + 40);  // fills slab 0, then maps slabs 1..3 as one run
  CHECK(c.front() == 5);
  CHECK(a.bytes_resident() == 4 * 4 * kPage);
  CHECK(d.calls(DriverCall::kMap) == 3 * 4);
  CHECK(d.calls(DriverCall::kSetAccess) == 4);  // one per range for the 3-page run
  CHECK(a.ledger().mapped_free_blocks() == 64 - 56);
  triattn::vmm::check_consistent(a);

  d.reset_counters();
  (void)take(a, 8);  // from mapped slabs: no driver call at all
  CHECK(d.total_calls() == 0);
}

TEST_CASE("vmm: best fit fills the fullest mapped slab and then the lowest") {
  Alloc a(small_config(), {}, fake());
  auto all = take(a, 64);  // slabs 0..3 full
  // Free 2 blocks in slab 0, 5 in slab 1, 1 in slab 2, 16 (all) in slab 3.
  for (int b : {3, 9}) CHECK(a.release(b));
  for (int b : {16, 17, 20, 25, 31}) CHECK(a.release(b));
  CHECK(a.release(40));
  for (int b = 48; b < 64; ++b) CHECK(a.release(b));
  CHECK(a.ledger().used(0) == 14);
  CHECK(a.ledger().used(1) == 11);
  CHECK(a.ledger().used(2) == 15);
  CHECK(a.ledger().used(3) == 0);
  // Fullest first: slab 2 (15), then slab 0 (14: lowest free first), then slab 1, then slab 3.
  CHECK(take(a, 1) == std::vector<std::int32_t>{40});
  CHECK(take(a, 2) == std::vector<std::int32_t>{3, 9});
  CHECK(take(a, 6) == std::vector<std::int32_t>{16, 17, 20, 25, 31, 48});
  CHECK(a.ledger().used(3) == 1);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: after freeing the upper half trim returns exactly those pages") {
  Alloc a(small_config(), {}, fake());
  FakeDriver d = a.driver();
  auto all = take(a, 512);
  CHECK(a.bytes_resident() == 32 * 4 * kPage);
  for (int b = 256; b < 512; ++b) CHECK(a.release(b));
  CHECK(a.bytes_resident() == 32 * 4 * kPage);  // release never calls the driver
  d.reset_counters();
  const auto r = a.trim(0);
  CHECK(r.slabs_scheduled == 16);
  CHECK(r.bytes_scheduled == 16 * 4 * kPage);
  CHECK(r.bytes_unmapped == 16 * 4 * kPage);
  CHECK(r.bytes_pending == 0);
  CHECK(a.bytes_resident() == 16 * 4 * kPage);
  CHECK(d.bytes_created() == 16 * 4 * kPage);  // handle pool 0: memory went back to the driver
  CHECK(d.calls(DriverCall::kUnmap) == 4);     // one run, one call per range
  CHECK(d.calls(DriverCall::kRelease) == 16 * 4);
  for (int s = 0; s < 32; ++s) CHECK(a.ledger().state(s) == (s < 16 ? SlabState::kMapped : SlabState::kUnmapped));
  triattn::vmm::check_consistent(a);
  // Regrowth maps them again.
  (void)take(a, 100);
  CHECK(a.bytes_resident() == (16 + 7) * 4 * kPage);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: trim keeps the lowest empty slabs when asked to keep some") {
  Alloc a(small_config(), {}, fake());
  auto all = take(a, 128);  // 8 slabs
  for (int b = 16; b < 128; ++b) CHECK(a.release(b));
  const auto r = a.trim(0, /*keep_empty_bytes=*/3 * 4 * kPage);
  CHECK(r.slabs_scheduled == 4);
  for (int s = 0; s < 8; ++s) CHECK(a.ledger().is_allocatable_state(s) == (s < 4));
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: unmapping waits for the trim's event (GPU-ordered reclaim)") {
  Alloc a(small_config(), {}, fake(false, /*manual_events=*/true));
  FakeDriver d = a.driver();
  auto all = take(a, 48);
  for (int b = 16; b < 48; ++b) CHECK(a.release(b));
  d.reset_counters();
  const auto r = a.trim(7);
  CHECK(r.slabs_scheduled == 2);
  CHECK(r.bytes_unmapped == 0);
  CHECK(r.bytes_pending == 2 * 4 * kPage);
  CHECK(d.calls(DriverCall::kEventRecord) == 1);
  CHECK(d.calls(DriverCall::kUnmap) == 0);
  CHECK(a.ledger().state(1) == SlabState::kPending);
  CHECK(a.bytes_resident() == 3 * 4 * kPage);
  triattn::vmm::check_consistent(a);
  CHECK(a.poll() == 0);  // the GPU has not reached the event
  CHECK(d.calls(DriverCall::kUnmap) == 0);
  d.signal_events();
  CHECK(a.poll() == 2 * 4 * kPage);
  CHECK(d.calls(DriverCall::kUnmap) == 4);
  CHECK(a.bytes_resident() == 1 * 4 * kPage);
  CHECK(d.live_events() == 0);
  triattn::vmm::check_consistent(a);

  SUBCASE("synchronize waits for the event") {
    (void)take(a, 40);
    for (int b = 16; b < 48; ++b) (void)a.release(b);
    (void)a.trim(7);
    CHECK(a.num_pending_trims() == 1);
    a.synchronize();
    CHECK(a.num_pending_trims() == 0);
    CHECK(a.bytes_resident() == 2 * 4 * kPage);  // slabs 0 and 3 hold blocks
    triattn::vmm::check_consistent(a);
  }
}

TEST_CASE("vmm: allocating from a pending slab cancels its unmap without driver calls") {
  Alloc a(small_config(), {}, fake(false, /*manual_events=*/true));
  FakeDriver d = a.driver();
  auto all = take(a, 32);
  for (int b = 16; b < 32; ++b) CHECK(a.release(b));
  (void)a.trim(0);
  CHECK(a.ledger().state(1) == SlabState::kPending);
  d.reset_counters();
  auto again = take(a, 3);
  CHECK(again == std::vector<std::int32_t>{16, 17, 18});
  CHECK(d.total_calls() == 0);
  CHECK(a.ledger().state(1) == SlabState::kMapped);
  CHECK(a.counters().slabs_revived == 1);
  d.signal_events();
  CHECK(a.poll() == 0);  // nothing left to unmap
  CHECK(a.bytes_resident() == 2 * 4 * kPage);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: handle pool: trimmed pages are kept for reuse up to handle_pool_bytes") {
  VmmOptions o;
  o.handle_pool_bytes = 6 * kPage;
  Alloc a(small_config(), o, fake());
  FakeDriver d = a.driver();
  auto all = take(a, 64);  // 4 slabs = 16 pages
  for (int b = 16; b < 64; ++b) CHECK(a.release(b));
  (void)a.trim(0);
  CHECK(a.bytes_pooled() == 6 * kPage);
  CHECK(a.physical_bytes() == 4 * kPage + 6 * kPage);
  CHECK(d.bytes_created() == a.physical_bytes());
  d.reset_counters();
  (void)take(a, 16 + 16);  // slab 1 and 2: 8 pages, 6 from the pool, 2 created
  CHECK(d.calls(DriverCall::kCreate) == 2);
  CHECK(a.counters().pool_hits == 6);
  CHECK(a.bytes_pooled() == 0);
  triattn::vmm::check_consistent(a);

  SUBCASE("pre-created handles make growth create-free") {
    CHECK(a.precreate_handles(8) == 8);
    d.reset_counters();
    (void)take(a, 32);
    CHECK(d.calls(DriverCall::kCreate) == 0);
    CHECK(d.calls(DriverCall::kMap) == 8);
    triattn::vmm::check_consistent(a);
  }
  SUBCASE("release_handle_pool returns them") {
    CHECK(a.precreate_handles(5) == 5);
    a.release_handle_pool(2 * kPage);
    CHECK(a.bytes_pooled() == 2 * kPage);
    triattn::vmm::check_consistent(a);
  }
}

TEST_CASE("vmm: memory limit: growth beyond fails typed and changes nothing and lowering unmaps free pages") {
  Alloc a(small_config(), {}, fake());
  FakeDriver d = a.driver();
  a.set_memory_limit(3 * 4 * kPage);  // three slabs
  auto b = take(a, 40);
  const auto before = a.snapshot();
  std::vector<std::int32_t> more(9, -1);  // needs a 4th slab
  CHECK_FALSE(a.allocate(more));
  CHECK(a.last_status() == AllocStatus::kMemoryLimit);
  CHECK(a.snapshot() == before);
  CHECK(a.counters().fail_memory_limit == 1);
  triattn::vmm::check_consistent(a);
  std::vector<std::int32_t> fits(8, -1);
  CHECK(a.allocate(fits));
  CHECK(a.last_status() == AllocStatus::kOk);

  // Free slabs 1 and 2 entirely, lower the limit to one slab: both go.
  for (int x = 16; x < 48; ++x) CHECK(a.release(x));
  const auto r = a.set_memory_limit(1 * 4 * kPage);
  CHECK(r.bytes_over_limit == 0);
  CHECK(a.bytes_resident() == 4 * kPage);
  CHECK(d.bytes_created() == 4 * kPage);
  triattn::vmm::check_consistent(a);

  SUBCASE("a limit below live usage only blocks growth") {
    const auto r2 = a.set_memory_limit(0);
    CHECK(r2.bytes_over_limit == 4 * kPage);
    CHECK(a.bytes_resident() == 4 * kPage);  // live blocks are never unmapped
    CHECK(a.release(5));
    std::vector<std::int32_t> one(1, -1);
    CHECK(a.allocate(one));  // slab 0 has room again: no driver work needed
    CHECK(one[0] == 5);
    std::vector<std::int32_t> lots(16, -1);
    CHECK_FALSE(a.allocate(lots));
    CHECK(a.last_status() == AllocStatus::kMemoryLimit);
  }
  SUBCASE("raising it allows growth again") {
    a.set_memory_limit(~std::size_t{0});
    (void)take(a, 200);
    triattn::vmm::check_consistent(a);
  }
}

TEST_CASE("vmm: lowering the limit with pending events and pooled handles") {
  VmmOptions o;
  o.handle_pool_bytes = 64 * kPage;
  Alloc a(small_config(), o, fake(false, /*manual_events=*/true));
  FakeDriver d = a.driver();
  auto b = take(a, 16 * 6);  // 6 slabs
  for (int x = 16; x < 96; ++x) CHECK(a.release(x));
  (void)a.trim(0, 0);
  CHECK(a.num_pending_trims() == 1);
  CHECK(a.bytes_resident() == 6 * 4 * kPage);
  // wait = false: nothing may be unmapped while the event is pending
  auto r = a.set_memory_limit(2 * 4 * kPage, 0, /*wait=*/false);
  CHECK(a.bytes_resident() == 6 * 4 * kPage);
  CHECK(r.bytes_over_limit == 4 * 4 * kPage);
  // wait = true: the host waits for the event, then unmaps; handles above the limit go back.
  r = a.set_memory_limit(2 * 4 * kPage, 0, /*wait=*/true);
  CHECK(r.bytes_over_limit == 0);
  CHECK(a.bytes_resident() == 4 * kPage);
  CHECK(a.physical_bytes() <= 2 * 4 * kPage);
  CHECK(a.bytes_pooled() == 4 * kPage);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: exhaustion of block ids and of the driver's memory") {
  Alloc a(small_config(), {}, fake());
  FakeDriver d = a.driver();
  std::vector<std::int32_t> too_many(513, -1);
  CHECK_FALSE(a.allocate(too_many));
  CHECK(a.last_status() == AllocStatus::kNoBlocks);
  CHECK(d.total_calls() == 2);  // granularity and reservation only
  d.set_physical_bytes(10 * kPage);
  std::vector<std::int32_t> three_slabs(40, -1);
  CHECK_FALSE(a.allocate(three_slabs));  // needs 12 pages, the device has 10
  CHECK(a.last_status() == AllocStatus::kDriverOutOfMemory);
  CHECK(a.bytes_resident() == 0);
  CHECK(d.live_handles() == 0);
  triattn::vmm::check_consistent(a);
  std::vector<std::int32_t> two_slabs(32, -1);
  CHECK(a.allocate(two_slabs));
}

TEST_CASE("vmm: double free and foreign ids and retain are checked and change nothing") {
  Alloc a(small_config(), {}, fake());
  auto b = take(a, 3);
  const auto before = a.snapshot();
  CHECK_THROWS_AS(a.release(-1), triattn::logic_error);
  CHECK_THROWS_AS(a.release(512), triattn::logic_error);
  CHECK_THROWS_AS(a.release(7), triattn::logic_error);  // never allocated
  CHECK_THROWS_AS(a.retain(7), triattn::logic_error);
  CHECK(a.snapshot() == before);
  CHECK(a.release(2));
  CHECK_THROWS_WITH_AS(a.release(2), doctest::Contains("already free"), triattn::logic_error);
  a.retain(1);
  CHECK(a.ref_count(1) == 2);
  CHECK_FALSE(a.release(1));
  CHECK(a.release(1));
  CHECK(a.ref_count(1) == 0);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: a non-OOM driver failure rolls back and throws naming the call") {
  Alloc a(small_config(), {}, fake());
  FakeDriver d = a.driver();
  auto b = take(a, 20);  // slabs 0, 1
  const auto before = a.snapshot();
  d.fail_nth(DriverCall::kMap, 3, 999);
  std::vector<std::int32_t> more(30, -1);
  try {
    (void)a.allocate(more);
    FAIL("expected a driver_error");
  } catch (const triattn::vmm::driver_error& e) {
    CHECK(e.call() == DriverCall::kMap);
    CHECK(e.code() == 999);
    CHECK(std::string(e.what()).find("cuMemMap") != std::string::npos);
    CHECK(std::string(e.what()).find("CUDA_ERROR_UNKNOWN") != std::string::npos);
  }
  CHECK(a.snapshot() == before);
  CHECK(a.counters().rollbacks == 1);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: construction failures throw and leak nothing") {
  SUBCASE("granularity") {
    FakeDriver d = fake();
    d.fail_nth(DriverCall::kGranularity, 1, 999);
    CHECK_THROWS_AS(Alloc(small_config(), {}, d), triattn::vmm::driver_error);
    CHECK(d.num_reservations() == 0);
  }
  SUBCASE("reserve") {
    FakeDriver d = fake();
    d.fail_nth(DriverCall::kReserve, 1, 2);
    CHECK_THROWS_WITH_AS(Alloc(small_config(), {}, d), doctest::Contains("cuMemAddressReserve"), triattn::vmm::driver_error);
    CHECK(d.num_reservations() == 0);
  }
  SUBCASE("bad config") {
    CacheConfig c = small_config();
    c.num_blocks = 0;
    CHECK_THROWS_AS(Alloc(c, {}, fake()), triattn::logic_error);
  }
}

TEST_CASE("vmm: destructor never throws and reports failures to the error hook and leaks nothing") {
  FakeDriver d = fake();
  std::vector<std::string> reports;
  {
    VmmOptions o;
    o.error_hook = [&](const std::string& m) { reports.push_back(m); };
    Alloc a(small_config(), o, d);
    (void)take(a, 40);
  }
  CHECK(reports.empty());
  CHECK(d.live_handles() == 0);
  CHECK(d.num_mappings() == 0);
  CHECK(d.num_reservations() == 0);
  CHECK(d.violations() == 0);

  SUBCASE("an unmap failure in the destructor is reported, not thrown") {
    FakeDriver d2 = fake();
    {
      VmmOptions o;
      o.error_hook = [&](const std::string& m) { reports.push_back(m); };
      Alloc a(small_config(), o, d2);
      (void)take(a, 40);
      d2.fail_nth(DriverCall::kUnmap, 1, 999);
    }
    REQUIRE(!reports.empty());
    CHECK(reports.front().find("cuMemUnmap") != std::string::npos);
  }
}

TEST_CASE("vmm: moved allocators keep working and a moved-from one is inert") {
  Alloc a(small_config(), {}, fake());
  auto b = take(a, 10);
  Alloc m(std::move(a));
  CHECK(m.ref_count(b[3]) == 1);
  (void)take(m, 10);
  triattn::vmm::check_consistent(m);
  std::vector<std::int32_t> x(1, -1);
  CHECK_THROWS_AS((void)a.allocate(x), triattn::logic_error);  // NOLINT(bugprone-use-after-move)
}

TEST_CASE("vmm: blocks larger than a page span several pages") {
  const CacheConfig c = config(64, 4, 8, 64);  // 8 KiB blocks = 2 pages, slab = 1 block
  Alloc a(c, {}, fake());
  FakeDriver d = a.driver();
  CHECK(a.geometry().pages_per_slab == 2);
  auto b = take(a, 3);
  CHECK(b == std::vector<std::int32_t>{0, 1, 2});
  CHECK(a.bytes_resident() == 3 * 2 * 4 * kPage);
  CHECK(d.calls(DriverCall::kSetAccess) == 4);  // one 6-page run per range
  CHECK(a.release(1));
  (void)a.trim(0);
  CHECK(a.bytes_resident() == 2 * 2 * 4 * kPage);
  CHECK(a.ledger().state(1) == SlabState::kUnmapped);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: blocks that neither divide nor are multiples of the page (lcm slabs)") {
  const CacheConfig c = config(3, 2, 8, 400);  // 192-byte blocks, slab = 3 pages = 64 blocks
  Alloc a(c, {}, fake());
  CHECK(a.geometry().num_slabs == 7);
  auto b = take(a, 400);
  CHECK(a.bytes_resident() == 19 * 4 * kPage);
  for (int x = 0; x < 400; ++x) CHECK(a.release(x));
  (void)a.trim(0);
  CHECK(a.bytes_resident() == 0);
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm: KvCache runs on the elastic allocator (host-backed fake)") {
  using Cache = triattn::KvCache<Alloc>;
  const CacheConfig c = small_config();
  Cache cache(c, Alloc(c, {}, fake(/*host=*/true)));
  const int per_layer_tok = c.model.num_kv_heads * c.model.head_dim;
  const int n = 37;
  std::vector<float> k(static_cast<std::size_t>(c.model.num_layers) * n * per_layer_tok);
  std::vector<float> v(k.size());
  std::iota(k.begin(), k.end(), 1.0f);
  std::iota(v.begin(), v.end(), 10000.0f);
  const auto s = cache.add_sequence();
  REQUIRE(cache.append<float>(s, k, v, n, triattn::Phase::kPrefill).ok());
  CHECK(cache.memory().bytes_resident == cache.allocator().bytes_resident());
  CHECK(cache.allocator().bytes_resident() == 4 * kPage);
  // Compact to the first 9 tokens: blocks past ceil(9/4) = 3 are released; trim unmaps nothing
  // (slab 0 still holds live blocks).
  triattn::KeepPlan plan(c.model.num_layers, c.model.num_kv_heads, 9);
  for (auto& x : plan.indices) x = 0;
  for (int l = 0; l < c.model.num_layers; ++l)
    for (int h = 0; h < c.model.num_kv_heads; ++h)
      for (int i = 0; i < 9; ++i) plan.row(l, h)[i] = 3 * i;
  cache.apply_keep_plan(s, plan);
  CHECK(cache.memory().blocks_used == 3);
  // Compacted token i of layer l, head h came from slot 3i.
  const auto view = cache.view<float>();
  for (int l = 0; l < c.model.num_layers; ++l)
    for (int h = 0; h < c.model.num_kv_heads; ++h)
      for (int i = 0; i < 9; ++i) {
        const float* kp = view.token(l, triattn::KvKind::kKey, s, i, h);
        const std::size_t src = (static_cast<std::size_t>(l) * n + 3 * i) * per_layer_tok + static_cast<std::size_t>(h) * c.model.head_dim;
        CHECK(kp[0] == k[src]);
      }
  cache.release(s);
  (void)cache.allocator().trim(0);
  CHECK(cache.memory().bytes_resident == 0);
  triattn::vmm::check_consistent(cache.allocator());
  // Out of blocks under the limit is the cache's typed outcome.
  cache.allocator().set_memory_limit(4 * kPage);
  const auto s2 = cache.add_sequence();
  CHECK(cache.extend(s2, 64).ok());
  CHECK(cache.extend(s2, 1).status == triattn::AppendStatus::kOutOfBlocks);
  CHECK(cache.physical_length(s2) == 64);
  triattn::vmm::check_consistent(cache.allocator());
}

}  // TEST_SUITE

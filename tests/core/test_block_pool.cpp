// SPDX-License-Identifier: Apache-2.0
// block_pool.hpp and StaticAllocator<HostBackend>: all-or-nothing allocation, lowest ids first
// on a fresh pool, reference counts, double free / foreign ids rejected without a change, and a
// long random run checked against a plain model.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <triattn/core/block_pool.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/static_allocator.hpp>

using namespace triattn;
using block_id = BlockPool::block_id;

namespace {

/// Everything observable about a pool, including the order in which it would hand out the
/// remaining free ids (obtained by draining a copy).
struct PoolSnapshot {
  std::size_t capacity, num_free, num_used;
  std::vector<int> refs;
  std::vector<block_id> drain_order;
  bool operator==(const PoolSnapshot&) const = default;
};
PoolSnapshot snapshot(const BlockPool& p) {
  PoolSnapshot s{p.capacity(), p.num_free(), p.num_used(), {}, {}};
  for (std::size_t b = 0; b < p.capacity(); ++b) s.refs.push_back(p.ref_count(static_cast<block_id>(b)));
  BlockPool copy = p;
  s.drain_order.resize(copy.num_free());
  REQUIRE(copy.allocate(s.drain_order));
  return s;
}

template <class F>
std::string logic_error_message(F&& f) {
  try {
    f();
  } catch (const triattn::logic_error& e) {
    return e.what();
  } catch (...) {
    return "<threw something other than triattn::logic_error>";
  }
  return "<did not throw>";
}

}  // namespace

TEST_SUITE("core") {

TEST_CASE("block pool: construction") {
  const BlockPool p(5);
  CHECK(p.capacity() == 5);
  CHECK(p.num_free() == 5);
  CHECK(p.num_used() == 0);
  for (block_id b = 0; b < 5; ++b) CHECK(p.ref_count(b) == 0);
  const BlockPool empty;
  CHECK(empty.capacity() == 0);
  CHECK(empty.num_free() == 0);
  for (int n : {0, -1, -1000}) {
    const std::string msg = logic_error_message([&] { BlockPool bad(n); });
    CAPTURE(msg);
    CHECK(msg.find("num_blocks = " + std::to_string(n)) != std::string::npos);
  }
}

TEST_CASE("block pool: a fresh pool hands out the lowest ids first") {
  BlockPool p(10);
  std::vector<block_id> a(3), b(4);
  REQUIRE(p.allocate(a));
  CHECK(a == std::vector<block_id>{0, 1, 2});
  REQUIRE(p.allocate(b));
  CHECK(b == std::vector<block_id>{3, 4, 5, 6});
  CHECK(p.num_free() == 3);
  CHECK(p.num_used() == 7);
  for (block_id id = 0; id < 7; ++id) CHECK(p.ref_count(id) == 1);
  for (block_id id = 7; id < 10; ++id) CHECK(p.ref_count(id) == 0);
  // A released id is handed out again (and ids stay unique among live blocks).
  CHECK(p.release(4));
  std::vector<block_id> c(4);
  REQUIRE(p.allocate(c));
  CHECK(std::set<block_id>(c.begin(), c.end()) == std::set<block_id>{4, 7, 8, 9});
  CHECK(p.num_free() == 0);
  // An empty request always succeeds, even on a full pool.
  std::vector<block_id> none;
  CHECK(p.allocate(none));
}

TEST_CASE("block pool: allocation is all-or-nothing") {
  BlockPool p(6);
  std::vector<block_id> a(4);
  REQUIRE(p.allocate(a));
  const PoolSnapshot before = snapshot(p);
  std::vector<block_id> too_many(3, -7);
  CHECK_FALSE(p.allocate(too_many));
  CHECK(too_many == std::vector<block_id>(3, -7));  // output untouched
  CHECK(snapshot(p) == before);                     // pool untouched (incl. free-list order)
  std::vector<block_id> way_too_many(100, -7);
  CHECK_FALSE(p.allocate(way_too_many));
  CHECK(snapshot(p) == before);
  std::vector<block_id> exact(2);
  CHECK(p.allocate(exact));
  CHECK(exact == std::vector<block_id>{4, 5});
  CHECK(p.num_free() == 0);
  std::vector<block_id> one(1, -7);
  CHECK_FALSE(p.allocate(one));
  CHECK(one[0] == -7);
}

TEST_CASE("block pool: reference counts - shared blocks are freed only at zero") {
  BlockPool p(4);
  std::vector<block_id> a(2);
  REQUIRE(p.allocate(a));
  p.retain(1);
  p.retain(1);
  CHECK(p.ref_count(1) == 3);
  CHECK(p.num_used() == 2);
  CHECK_FALSE(p.release(1));
  CHECK_FALSE(p.release(1));
  CHECK(p.ref_count(1) == 1);
  CHECK(p.num_free() == 2);
  CHECK(p.release(1));
  CHECK(p.ref_count(1) == 0);
  CHECK(p.num_free() == 3);
  CHECK(p.release(0));
  CHECK(p.num_free() == 4);
}

TEST_CASE("block pool: double free and retain of a free block and foreign ids throw and change nothing") {
  BlockPool p(5);
  std::vector<block_id> a(3);
  REQUIRE(p.allocate(a));
  p.retain(2);
  REQUIRE(p.release(1));
  const PoolSnapshot before = snapshot(p);
  {
    const std::string msg = logic_error_message([&] { p.release(1); });  // double free
    CAPTURE(msg);
    CHECK(msg.find("block 1") != std::string::npos);
    CHECK(msg.find("already free") != std::string::npos);
    CHECK(snapshot(p) == before);
  }
  {
    const std::string msg = logic_error_message([&] { p.release(4); });  // never allocated
    CAPTURE(msg);
    CHECK(msg.find("block 4") != std::string::npos);
    CHECK(snapshot(p) == before);
  }
  {
    const std::string msg = logic_error_message([&] { p.retain(3); });  // retain of a free block
    CAPTURE(msg);
    CHECK(msg.find("retain") != std::string::npos);
    CHECK(msg.find("block 3") != std::string::npos);
    CHECK(snapshot(p) == before);
  }
  for (block_id foreign : {-1, 5, 6, -2147483647 - 1, 2147483647}) {
    CAPTURE(foreign);
    for (int op = 0; op < 2; ++op) {
      const std::string msg =
          logic_error_message([&] { op == 0 ? (void)p.release(foreign) : p.retain(foreign); });
      CAPTURE(msg);
      CHECK(msg.find("block " + std::to_string(foreign)) != std::string::npos);
      CHECK(msg.find("does not belong") != std::string::npos);
      CHECK(snapshot(p) == before);
    }
    CHECK(p.ref_count(foreign) == 0);
  }
}

TEST_CASE("block pool: 1000000 random operations against a model (O(1) per op)") {
  constexpr int kBlocks = 4096;
  const std::uint64_t seed = 0x5eed'b10c;
  MESSAGE("block pool random run seed = " << seed);
  std::mt19937_64 rng(seed);
  BlockPool p(kBlocks);
  std::vector<int> model(kBlocks, 0);  // reference counts
  std::vector<block_id> live;          // one entry per reference
  int model_free = kBlocks;
  std::size_t failures = 0;
  std::vector<block_id> buf;
  for (int op = 0; op < 1'000'000; ++op) {
    const int r = static_cast<int>(rng() % 100);
    if (r < 45) {  // allocate 1..8 (sometimes more than free)
      const std::size_t n = 1 + rng() % 8;
      buf.assign(n, -1);
      const bool ok = p.allocate(buf);
      if (ok != (static_cast<int>(n) <= model_free)) ++failures;
      if (ok) {
        for (block_id b : buf) {
          if (b < 0 || b >= kBlocks || model[static_cast<std::size_t>(b)] != 0) ++failures;
          else model[static_cast<std::size_t>(b)] = 1;
          live.push_back(b);
        }
        model_free -= static_cast<int>(n);
      } else if (buf != std::vector<block_id>(n, -1)) {
        ++failures;
      }
    } else if (r < 55 && !live.empty()) {  // share
      const block_id b = live[rng() % live.size()];
      p.retain(b);
      ++model[static_cast<std::size_t>(b)];
      live.push_back(b);
    } else if (!live.empty()) {  // drop one reference
      const std::size_t i = rng() % live.size();
      const block_id b = live[i];
      live[i] = live.back();
      live.pop_back();
      const bool freed = p.release(b);
      const bool want = --model[static_cast<std::size_t>(b)] == 0;
      if (freed != want) ++failures;
      model_free += want;
    }
    if (p.num_free() != static_cast<std::size_t>(model_free)) ++failures;
    if (op % 4096 == 0) {
      for (block_id b = 0; b < kBlocks; ++b)
        if (p.ref_count(b) != model[static_cast<std::size_t>(b)]) ++failures;
    }
  }
  CHECK(failures == 0);
  for (block_id b = 0; b < kBlocks; ++b) CHECK(p.ref_count(b) == model[static_cast<std::size_t>(b)]);
  CHECK(p.num_free() + p.num_used() == p.capacity());
  // Drop everything: the pool is whole again and hands out every id exactly once.
  for (block_id b : live) p.release(b);
  CHECK(p.num_free() == kBlocks);
  std::vector<block_id> all(kBlocks);
  REQUIRE(p.allocate(all));
  std::sort(all.begin(), all.end());
  std::vector<block_id> iota(kBlocks);
  std::iota(iota.begin(), iota.end(), 0);
  CHECK(all == iota);
}

TEST_CASE("StaticAllocator<HostBackend>: one zeroed and aligned buffer of 2 x layers ranges") {
  static_assert(BlockAllocator<StaticAllocator<HostBackend>>);
  static_assert(StaticAllocator<HostBackend>::memory_space == MemorySpace::kHost);
  CacheConfig cfg;
  cfg.model = ModelGeometry{3, 4, 2, 6};
  cfg.block_size = 7;
  cfg.num_blocks = 5;
  cfg.dtype = DType::kF16;
  StaticAllocator<HostBackend> a(cfg);
  CHECK(a.capacity() == 5);
  CHECK(a.num_free() == 5);
  CHECK(a.range_stride_bytes() == cfg.block_bytes() * 5);
  CHECK(a.bytes_resident() == static_cast<std::size_t>(2 * 3 * cfg.block_bytes() * 5));
  CHECK(a.backend().bytes() == a.bytes_resident());
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 64 == 0);
  const auto* bytes = static_cast<const unsigned char*>(a.data());
  CHECK(std::all_of(bytes, bytes + a.bytes_resident(), [](unsigned char c) { return c == 0; }));
  std::vector<std::int32_t> ids(2);
  REQUIRE(a.allocate(ids));
  CHECK(ids == std::vector<std::int32_t>{0, 1});
  a.retain(1);
  CHECK(a.ref_count(1) == 2);
  CHECK_FALSE(a.release(1));
  CHECK(a.release(1));
  CHECK(a.num_free() == 4);
  CHECK_THROWS_AS(a.release(1), triattn::logic_error);
  CHECK(a.num_free() == 4);
  // Resident memory does not depend on what is in use.
  CHECK(a.bytes_resident() == static_cast<std::size_t>(2 * 3 * cfg.block_bytes() * 5));
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// Fault-injection sweeps over VmmAllocatorCore<FakeDriver>: a scripted workload runs once per
// (call kind, N, code) with the N-th call of that kind failing. Every allocation that fails must
// leave the allocator exactly as it was (snapshot equality) and the fake device exactly matching
// the ledger (no leaked handle, no half-mapped slab); after the allocator is destroyed the fake
// device must be empty.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
using triattn::vmm::kStatusOutOfMemory;
using triattn::vmm::VmmOptions;
using Alloc = triattn::vmm::VmmAllocatorCore<FakeDriver>;

constexpr std::size_t kPage = 4096;
constexpr int kUnknownError = 999;

CacheConfig small_config() {
  CacheConfig c;
  c.model = {2, 2, 2, 8};
  c.block_size = 4;
  c.num_blocks = 512;  // 256-byte blocks, 16 per page, 32 slabs, 4 ranges
  c.max_seqs = 8;
  c.dtype = DType::kF32;
  return c;
}

struct RunOutcome {
  int failed_ops = 0;      ///< operations that returned false or threw
  int threw = 0;
  int exhausted = 0;       ///< allocate/ensure_mapped returned false
  std::uint64_t fault_hits = 0;  ///< calls the fake failed on purpose
  std::vector<std::string> problems;
};

/// The scripted workload. `live` tracks held blocks so releases are always valid.
class Workload {
 public:
  Workload(Alloc& a, RunOutcome& out) : a_(a), out_(out) {}

  void run() {
    alloc(5);
    alloc(60);
    release_range(16, 64);  // slabs 1..3 empty (if those blocks were granted)
    release_some(3);
    trim(0);
    alloc(40);
    ensure(80);
    precreate(3);
    limit(a_.physical_bytes() + 8 * kPage);
    alloc(100);
    limit(~std::size_t{0});
    alloc(100);
    release_all();
    trim(2 * 4 * kPage);
    alloc(200);
    release_some(50);
    limit(a_.bytes_resident());
    alloc(30);
    limit(~std::size_t{0});
    trim(0);
    alloc(150);
    release_all();
    trim(0);
    alloc(33);
  }

 private:
  template <class F>
  void transactional(const char* what, F&& f) {
    const auto before = a_.snapshot();
    bool ok = false;
    try {
      ok = f();
    } catch (const triattn::vmm::driver_error&) {
      ++out_.threw;
    }
    if (!ok) {
      ++out_.failed_ops;
      if (!(a_.snapshot() == before)) out_.problems.push_back(std::string(what) + ": state changed by a failed call");
    }
    check(what);
  }
  void check(const char* what) {
    try {
      triattn::vmm::check_consistent(a_);
    } catch (const std::exception& e) {
      out_.problems.push_back(std::string(what) + ": " + e.what());
    }
  }
  void alloc(std::size_t n) {
    transactional("allocate", [&] {
      std::vector<std::int32_t> b(n, -1);
      if (!a_.allocate(b)) {
        ++out_.exhausted;
        return false;
      }
      live_.insert(live_.end(), b.begin(), b.end());
      return true;
    });
  }
  void ensure(std::size_t n) {
    transactional("ensure_mapped", [&] {
      if (!a_.ensure_mapped(n)) {
        ++out_.exhausted;
        return false;
      }
      return true;
    });
  }
  void precreate(std::size_t pages) {
    try {
      (void)a_.precreate_handles(pages);
    } catch (const triattn::vmm::driver_error&) {
      ++out_.threw;
    }
    check("precreate");
  }
  void release_range(int lo, int hi) {
    std::vector<std::int32_t> keep;
    for (auto b : live_) {
      if (b >= lo && b < hi) (void)a_.release(b);
      else keep.push_back(b);
    }
    live_.swap(keep);
    check("release");
  }
  void release_some(std::size_t every) {
    std::vector<std::int32_t> keep;
    for (std::size_t i = 0; i < live_.size(); ++i) {
      if (i % every == 0) (void)a_.release(live_[i]);
      else keep.push_back(live_[i]);
    }
    live_.swap(keep);
    check("release");
  }
  void release_all() {
    for (auto b : live_) (void)a_.release(b);
    live_.clear();
    check("release");
  }
  void trim(std::size_t keep) {
    try {
      (void)a_.trim(0, keep);
    } catch (const triattn::vmm::driver_error&) {
      ++out_.threw;
    }
    check("trim");
  }
  void limit(std::size_t bytes) {
    try {
      (void)a_.set_memory_limit(bytes);
    } catch (const triattn::vmm::driver_error&) {
      ++out_.threw;
    }
    check("set_memory_limit");
  }

  Alloc& a_;
  RunOutcome& out_;
  std::vector<std::int32_t> live_;
};

FakeDriver make_fake() {
  FakeDriverOptions o;
  o.granularity = kPage;
  return FakeDriver(o);
}
VmmOptions options(std::vector<std::string>* reports) {
  VmmOptions o;
  o.handle_pool_bytes = 6 * kPage;
  o.error_hook = [reports](const std::string& m) { reports->push_back(m); };
  return o;
}

/// Runs the workload with `inject` applied to a fresh fake; returns the outcome and checks that
/// the device is empty after destruction.
RunOutcome run_once(const std::function<void(FakeDriver&)>& inject, std::uint64_t* calls_of = nullptr,
                    DriverCall kind = DriverCall::kCreate) {
  RunOutcome out;
  FakeDriver d = make_fake();
  std::vector<std::string> reports;
  {
    Alloc a(small_config(), options(&reports), d);
    inject(d);
    Workload(a, out).run();
    for (int c = 0; c < triattn::vmm::kNumDriverCalls; ++c) out.fault_hits += d.failures(static_cast<DriverCall>(c));
    d.clear_faults();
    if (calls_of) *calls_of = d.calls(kind);
  }
  if (d.live_handles() != 0) out.problems.push_back("leaked " + std::to_string(d.live_handles()) + " handles");
  if (d.num_mappings() != 0) out.problems.push_back("left " + std::to_string(d.num_mappings()) + " mappings");
  if (d.num_reservations() != 0) out.problems.push_back("left the reservation");
  if (d.live_events() != 0) out.problems.push_back("left events");
  if (d.violations() != 0) out.problems.push_back("driver misuse: " + d.last_violation());
  if (!reports.empty()) out.problems.push_back("error hook: " + reports.front());
  return out;
}

}  // namespace

TEST_SUITE("vmm") {

TEST_CASE("vmm faults: the clean workload exercises every growth path") {
  std::uint64_t creates = 0, maps = 0, access = 0;
  const RunOutcome clean = run_once([](FakeDriver&) {}, &creates, DriverCall::kCreate);
  (void)run_once([](FakeDriver&) {}, &maps, DriverCall::kMap);
  (void)run_once([](FakeDriver&) {}, &access, DriverCall::kSetAccess);
  CHECK(clean.problems.empty());
  CHECK(clean.threw == 0);
  CHECK(clean.exhausted >= 1);  // the limit step refuses growth once
  MESSAGE("clean workload: " << creates << " creates, " << maps << " maps, " << access << " set_access");
  CHECK(creates >= 60);
  CHECK(maps >= 60);
  CHECK(access >= 20);
}

TEST_CASE("vmm faults: failure at the N-th create / map / set_access leaves no leak and no half state") {
  struct Kind {
    DriverCall call;
    const char* name;
  };
  const Kind kinds[] = {{DriverCall::kCreate, "create"}, {DriverCall::kMap, "map"}, {DriverCall::kSetAccess, "set_access"}};
  const int codes[] = {kStatusOutOfMemory, kUnknownError};
  int triggered = 0, runs = 0;
  for (const Kind& k : kinds) {
    std::uint64_t total = 0;
    (void)run_once([](FakeDriver&) {}, &total, k.call);
    for (int code : codes) {
      for (std::uint64_t n = 1; n <= 60; ++n) {
        const RunOutcome r = run_once([&](FakeDriver& d) { d.fail_nth(k.call, n, code); });
        ++runs;
        INFO("fail the " << n << "-th " << k.name << " with code " << code);
        for (const auto& p : r.problems) FAIL_CHECK(p);
        if (n <= total) {
          CHECK(r.fault_hits == 1);
          if (code == kUnknownError) CHECK(r.threw == 1);  // any other error is an exception
          if (code == kStatusOutOfMemory) CHECK(r.threw == 0);  // out of memory is an outcome
          ++triggered;
        }
      }
    }
  }
  MESSAGE(runs << " fault runs, " << triggered << " with the fault inside the workload");
  CHECK(triggered >= 3 * 2 * 20);
}

TEST_CASE("vmm faults: a driver that refuses every call of a kind from the N-th on") {
  for (DriverCall k : {DriverCall::kCreate, DriverCall::kMap, DriverCall::kSetAccess}) {
    for (std::uint64_t n : {1u, 5u, 17u, 40u}) {
      const RunOutcome r = run_once([&](FakeDriver& d) { d.fail_nth(k, n, kStatusOutOfMemory, /*sticky=*/true); });
      INFO("sticky failure of " << triattn::vmm::driver_call_name(k) << " from call " << n);
      for (const auto& p : r.problems) FAIL_CHECK(p);
      CHECK(r.threw == 0);  // out of memory is an outcome, never an exception
    }
  }
}

TEST_CASE("vmm faults: unmap / release / event failures keep the ledger equal to the device") {
  // Failed unmaps leave "stuck" pages that later trims retry; nothing may leak in the end.
  for (DriverCall k : {DriverCall::kUnmap, DriverCall::kRelease, DriverCall::kEventRecord, DriverCall::kEventQuery}) {
    for (std::uint64_t n = 1; n <= 12; ++n) {
      const RunOutcome r = run_once([&](FakeDriver& d) { d.fail_nth(k, n, kUnknownError); });
      INFO("fail the " << n << "-th " << triattn::vmm::driver_call_name(k));
      for (const auto& p : r.problems) FAIL_CHECK(p);
    }
  }
}

TEST_CASE("vmm faults: a failed unmap is retried and the slab comes back into use") {
  FakeDriver d = make_fake();
  std::vector<std::string> reports;
  Alloc a(small_config(), options(&reports), d);
  std::vector<std::int32_t> b(48, -1);
  REQUIRE(a.allocate(b));
  for (int x = 16; x < 48; ++x) CHECK(a.release(x));
  d.fail_nth(DriverCall::kUnmap, 2, kUnknownError);  // range 1 of the run
  CHECK_THROWS_WITH_AS(a.trim(0), doctest::Contains("cuMemUnmap"), triattn::vmm::driver_error);
  CHECK(a.num_stuck_pages() == 2);  // 2 slabs x 1 page in range 1
  CHECK(a.ledger().state(1) == triattn::vmm::SlabState::kBroken);
  triattn::vmm::check_consistent(a);
  // While broken, growth skips the slabs.
  std::vector<std::int32_t> more(20, -1);
  REQUIRE(a.allocate(more));
  CHECK(more[0] == 48);
  triattn::vmm::check_consistent(a);
  (void)a.poll();  // the retry succeeds
  CHECK(a.num_stuck_pages() == 0);
  CHECK(a.ledger().state(1) == triattn::vmm::SlabState::kUnmapped);
  triattn::vmm::check_consistent(a);
  std::vector<std::int32_t> again(40, -1);
  REQUIRE(a.allocate(again));
  triattn::vmm::check_consistent(a);
  CHECK(reports.empty());
}

TEST_CASE("vmm faults: a failed rollback is reported through the hook and retried") {
  FakeDriver d = make_fake();
  std::vector<std::string> reports;
  Alloc a(small_config(), options(&reports), d);
  d.fail_nth(DriverCall::kSetAccess, 1, kStatusOutOfMemory);
  d.fail_nth(DriverCall::kUnmap, 1, kUnknownError);  // the rollback's first unmap fails too
  std::vector<std::int32_t> b(5, -1);
  CHECK_FALSE(a.allocate(b));
  CHECK(a.last_status() == AllocStatus::kDriverOutOfMemory);
  REQUIRE(reports.size() == 1);
  CHECK(reports[0].find("cuMemUnmap") != std::string::npos);
  CHECK(a.num_stuck_pages() == 1);
  triattn::vmm::check_consistent(a);
  (void)a.poll();
  CHECK(a.num_stuck_pages() == 0);
  REQUIRE(a.allocate(b));
  triattn::vmm::check_consistent(a);
}

TEST_CASE("vmm faults: latency injection accumulates on the virtual clock") {
  FakeDriver d = make_fake();
  d.set_latency(DriverCall::kCreate, std::chrono::microseconds(16));
  d.set_latency(DriverCall::kMap, std::chrono::nanoseconds(1600));
  d.set_latency(DriverCall::kSetAccess, std::chrono::microseconds(49));
  Alloc a(small_config(), {}, d);
  std::vector<std::int32_t> b(64, -1);  // 4 slabs = 16 pages, one run: 16 creates, 16 maps, 4 grants
  REQUIRE(a.allocate(b));
  CHECK(d.virtual_time() == std::chrono::nanoseconds(16 * 16000 + 16 * 1600 + 4 * 49000));
}

}  // TEST_SUITE

TEST_CASE("vmm faults: every call position of every call kind and of any call - one-shot and sticky") {
  // The clean workload's call count of each kind (and of all kinds) bounds the sweep: n runs over
  // every position, so each call the workload makes fails once in some run, one-shot and from
  // then on (sticky). Faults are cleared before the allocator is destroyed (a driver that refuses
  // every cleanup for good must leak; the destructor's own failures are the next test's subject).
  std::vector<std::pair<DriverCall, std::uint64_t>> sweeps;
  std::uint64_t any = 0;
  for (int c = 0; c < triattn::vmm::kNumDriverCalls; ++c) {
    std::uint64_t n = 0;
    (void)run_once([](FakeDriver&) {}, &n, static_cast<DriverCall>(c));
    if (n != 0) sweeps.emplace_back(static_cast<DriverCall>(c), n);
    any += n;
  }
  sweeps.emplace_back(DriverCall::kCount, any);  // kCount: the n-th call of any kind
  int runs = 0, hits = 0;
  for (const auto& [kind, total] : sweeps) {
    const std::string name = kind == DriverCall::kCount ? "any call" : triattn::vmm::driver_call_name(kind);
    for (const bool sticky : {false, true}) {
      for (std::uint64_t n = 1; n <= total; ++n) {
        const int code = (n % 2 == 0) ? kStatusOutOfMemory : kUnknownError;
        const RunOutcome r = run_once([&](FakeDriver& d) { d.fail_nth(kind, n, code, sticky); });
        ++runs;
        hits += r.fault_hits > 0 ? 1 : 0;
        // A driver refusing every call from some point on also refuses the rollback of the failed
        // allocation: the page is kept as stuck (retried by later trims), reported through the
        // error hook, so that allocation leaves the stuck page behind. Only then is a changed
        // state allowed; leaks, driver misuse, untyped exceptions and ledger/device mismatches
        // never are.
        std::vector<std::string> problems;
        const bool rollback_failed =
            std::any_of(r.problems.begin(), r.problems.end(), [](const std::string& p) {
              return p.rfind("error hook: ", 0) == 0 && p.find("rolling back a failed allocation") != std::string::npos;
            });
        for (const auto& p : r.problems) {
          const bool hook = p.rfind("error hook: ", 0) == 0;
          const bool changed = p.find(": state changed by a failed call") != std::string::npos;
          if (kind == DriverCall::kCount && sticky && rollback_failed && (hook || changed)) continue;
          problems.push_back(p);
        }
        if (!problems.empty()) {
          const std::string what = "fail the " + std::to_string(n) + "-th " + name +
                                   (sticky ? " and every later one" : "") + " with code " + std::to_string(code);
          for (const auto& p : problems) FAIL_CHECK(what << ": " << p);
        }
        if (!sticky && r.fault_hits > 1) {
          INFO("one-shot fault of the " << n << "-th " << name);
          CHECK(r.fault_hits == 1);
        }
      }
    }
  }
  MESSAGE((sweeps.size() - 1) << " call kinds, " << any << " calls in the clean workload, " << runs << " fault runs, "
                            << hits << " with the fault hit");
  CHECK(hits >= runs * 9 / 10);
}

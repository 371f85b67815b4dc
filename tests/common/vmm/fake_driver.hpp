// SPDX-License-Identifier: Apache-2.0
// FakeDriver: a host-only stand-in for the CUDA VMM driver, so the elastic allocator's logic runs
// in CI. It simulates reserved address space, physical handles (with a device capacity), maps,
// access grants and events, and checks every call the way the driver would (misuse is counted as
// a violation and answered with CUDA_ERROR_INVALID_VALUE). Tests drive it through:
//   - fault injection: fail the n-th call of one kind (or of any kind), once or for good, with a
//     chosen code (out of memory by default);
//   - latency injection: per-call latency added to a virtual clock, or really slept;
//   - call counters and live-state counters (handles, bytes created/mapped, mappings, events);
//   - optional host backing: reserved VA is real host memory, mapped pages are readable and
//     writable, unmapped pages are poisoned and (where mprotect exists) inaccessible, so a stray
//     access faults like it would on the GPU instead of silently reading stale data;
//   - manual events: recorded events stay pending until signal_events(), so tests can check
//     that nothing is unmapped before the GPU work that touched it has finished.
// A FakeDriver is a cheap handle to shared state: copies observe and steer the same fake device.
// Not thread-safe (neither is the allocator).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <triattn/core/concepts.hpp>
#include <triattn/core/vmm/driver_api.hpp>

#if __has_include(<sys/mman.h>) && __has_include(<unistd.h>)
#include <sys/mman.h>
#include <unistd.h>
#define TRIATTN_FAKE_DRIVER_HAS_MMAN 1
#else
#define TRIATTN_FAKE_DRIVER_HAS_MMAN 0
#endif

namespace triattn::vmm {

struct FakeDriverOptions {
  std::size_t granularity = std::size_t{2} << 20;                     ///< page size (2 MiB, the usual GPU granularity)
  std::size_t physical_bytes = std::numeric_limits<std::size_t>::max();  ///< device memory: create fails with OOM beyond
  bool host_backed = false;     ///< back reserved VA with host memory (needed to run KvCache's CPU path on it)
  bool manual_events = false;   ///< events complete only on signal_events()/event_sync (default: at once)
};

inline constexpr std::uint8_t kFakeJunkByte = 0xA5;    ///< fresh mapping: contents undefined
inline constexpr std::uint8_t kFakePoisonByte = 0xDD;  ///< unmapped page

class FakeDriver {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::kHost;
  using stream_type = int;
  using event_type = std::uint64_t;

  FakeDriver() : FakeDriver(FakeDriverOptions{}) {}
  explicit FakeDriver(const FakeDriverOptions& o) : s_(std::make_shared<State>()) {
    TRIATTN_EXPECTS(o.granularity > 0, "FakeDriver: granularity must be positive");
    s_->opt = o;
#if TRIATTN_FAKE_DRIVER_HAS_MMAN
    const long sys = ::sysconf(_SC_PAGESIZE);
    s_->protect = o.host_backed && sys > 0 && o.granularity % static_cast<std::size_t>(sys) == 0;
#endif
  }

  // ---- the VmmDriver interface ----------------------------------------------------------------

  int granularity(std::size_t* out) noexcept {
    if (const int f = enter(DriverCall::kGranularity)) return f;
    *out = s_->opt.granularity;
    return kStatusSuccess;
  }

  int create(std::size_t bytes, phys_handle* out) noexcept {
    if (const int f = enter(DriverCall::kCreate)) return f;
    if (bytes == 0 || bytes % g() != 0) return violation("create: size not a positive multiple of the granularity");
    if (s_->bytes_created + bytes > s_->opt.physical_bytes || s_->bytes_created + bytes < s_->bytes_created)
      return kStatusOutOfMemory;
    const phys_handle h = s_->next_handle++;
    s_->handles.emplace(h, Handle{bytes, 0});
    s_->bytes_created += bytes;
    *out = h;
    return kStatusSuccess;
  }

  int release(phys_handle h) noexcept {
    if (const int f = enter(DriverCall::kRelease)) return f;
    auto it = s_->handles.find(h);
    if (it == s_->handles.end()) return violation("release: unknown handle (double release?)");
    if (it->second.maps != 0) return violation("release: handle is still mapped");
    s_->bytes_created -= it->second.bytes;
    s_->handles.erase(it);
    return kStatusSuccess;
  }

  int reserve(std::size_t bytes, std::size_t alignment, dev_addr* out) noexcept {
    if (const int f = enter(DriverCall::kReserve)) return f;
    if (bytes == 0 || bytes % g() != 0) return violation("reserve: size not a positive multiple of the granularity");
    if (alignment != 0 && alignment % g() != 0) return violation("reserve: alignment not a multiple of the granularity");
    Reservation r{bytes, nullptr, 0};
    dev_addr va = 0;
    if (s_->opt.host_backed) {
      const std::size_t len = bytes + g();
      void* base = nullptr;
#if TRIATTN_FAKE_DRIVER_HAS_MMAN
      base = ::mmap(nullptr, len, s_->protect ? PROT_NONE : (PROT_READ | PROT_WRITE), MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) return kStatusOutOfMemory;
#else
      base = ::operator new(len, std::nothrow);
      if (base == nullptr) return kStatusOutOfMemory;
#endif
      const std::uintptr_t a = (reinterpret_cast<std::uintptr_t>(base) + g() - 1) / g() * g();
      r.host_base = base;
      r.host_len = len;
      va = static_cast<dev_addr>(a);
      if (!s_->protect) std::memset(reinterpret_cast<void*>(a), kFakePoisonByte, bytes);
    } else {
      va = (s_->next_va + g() - 1) / g() * g();
      s_->next_va = va + bytes + g();  // a guard gap between reservations
    }
    s_->reservations.emplace(va, r);
    s_->bytes_reserved += bytes;
    *out = va;
    return kStatusSuccess;
  }

  int free(dev_addr va, std::size_t bytes) noexcept {
    if (const int f = enter(DriverCall::kFree)) return f;
    auto it = s_->reservations.find(va);
    if (it == s_->reservations.end() || it->second.bytes != bytes)
      return violation("free: not a reservation of that size");
    auto m = s_->mappings.lower_bound(va);
    if (m != s_->mappings.end() && m->first < va + bytes) return violation("free: the range still holds mappings");
    release_host(it->second);
    s_->bytes_reserved -= bytes;
    s_->reservations.erase(it);
    return kStatusSuccess;
  }

  int map(dev_addr va, std::size_t bytes, phys_handle h) noexcept {
    if (const int f = enter(DriverCall::kMap)) return f;
    if (bytes == 0 || bytes % g() != 0 || va % g() != 0) return violation("map: unaligned address or size");
    auto hit = s_->handles.find(h);
    if (hit == s_->handles.end()) return violation("map: unknown handle");
    if (hit->second.bytes != bytes) return violation("map: size differs from the handle's size");
    if (!inside_reservation(va, bytes)) return violation("map: range outside every reservation");
    auto next = s_->mappings.lower_bound(va);
    if (next != s_->mappings.end() && next->first < va + bytes) return violation("map: range overlaps a mapping");
    if (next != s_->mappings.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.bytes > va) return violation("map: range overlaps a mapping");
    }
    s_->mappings.emplace(va, Mapping{bytes, h, false});
    ++hit->second.maps;
    s_->bytes_mapped += bytes;
    host_fill(va, bytes, kFakeJunkByte, /*accessible=*/true);
    return kStatusSuccess;
  }

  int unmap(dev_addr va, std::size_t bytes) noexcept {
    if (const int f = enter(DriverCall::kUnmap)) return f;
    // Like cuMemUnmap: the range must consist of whole mappings (one or several adjacent ones).
    std::size_t covered = 0;
    for (auto it = s_->mappings.find(va); covered < bytes; ++it) {
      if (it == s_->mappings.end() || it->first != va + covered) return violation("unmap: range is not whole mappings");
      covered += it->second.bytes;
    }
    if (covered != bytes) return violation("unmap: range ends inside a mapping");
    for (auto it = s_->mappings.find(va); it != s_->mappings.end() && it->first < va + bytes;) {
      --s_->handles[it->second.handle].maps;
      s_->bytes_mapped -= it->second.bytes;
      if (it->second.access) s_->bytes_accessible -= it->second.bytes;
      it = s_->mappings.erase(it);
    }
    host_fill(va, bytes, kFakePoisonByte, /*accessible=*/false);
    return kStatusSuccess;
  }

  int set_access(dev_addr va, std::size_t bytes) noexcept {
    if (const int f = enter(DriverCall::kSetAccess)) return f;
    std::size_t covered = 0;
    for (auto it = s_->mappings.find(va); covered < bytes; ++it) {
      if (it == s_->mappings.end() || it->first != va + covered) return violation("set_access: range not fully mapped");
      covered += it->second.bytes;
    }
    if (covered != bytes) return violation("set_access: range ends inside a mapping");
    for (auto it = s_->mappings.find(va); it != s_->mappings.end() && it->first < va + bytes; ++it) {
      if (!it->second.access) s_->bytes_accessible += it->second.bytes;
      it->second.access = true;
    }
    return kStatusSuccess;
  }

  int event_record(stream_type, event_type* out) noexcept {
    if (const int f = enter(DriverCall::kEventRecord)) return f;
    const event_type e = s_->next_event++;
    s_->events.emplace(e, !s_->opt.manual_events);
    *out = e;
    return kStatusSuccess;
  }
  int event_query(event_type e, bool* done) noexcept {
    if (const int f = enter(DriverCall::kEventQuery)) return f;
    auto it = s_->events.find(e);
    if (it == s_->events.end()) return violation("event_query: unknown event");
    *done = it->second;
    return kStatusSuccess;
  }
  int event_sync(event_type e) noexcept {
    if (const int f = enter(DriverCall::kEventSync)) return f;
    auto it = s_->events.find(e);
    if (it == s_->events.end()) return violation("event_sync: unknown event");
    it->second = true;  // the host waited for the stream
    return kStatusSuccess;
  }
  void event_destroy(event_type e) noexcept {
    if (s_->events.erase(e) == 0) (void)violation("event_destroy: unknown event");
  }
  int quiesce() noexcept {
    if (const int f = enter(DriverCall::kQuiesce)) return f;
    signal_events();
    return kStatusSuccess;
  }

  [[nodiscard]] void* pointer(dev_addr va) const noexcept { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va)); }

  [[nodiscard]] std::string describe(DriverCall call, int code) const {
    return std::string(driver_call_name(call)) + " failed: " + code_name(code) + " (fake driver)";
  }
  [[noreturn]] void raise(DriverCall call, int code, const std::string& what) const {
    throw driver_error("triattn: " + describe(call, code) + (what.empty() ? "" : " while " + what), call, code);
  }

  // ---- steering -------------------------------------------------------------------------------

  /// The n-th next call of `call` (1 = the very next; DriverCall::kCount = a call of any kind)
  /// fails with `code`, once, or every time from then on when `sticky`.
  void fail_nth(DriverCall call, std::uint64_t n, int code = kStatusOutOfMemory, bool sticky = false) {
    TRIATTN_EXPECTS(n >= 1, "FakeDriver::fail_nth: n counts from 1");
    s_->faults.push_back(Fault{call, n, code, sticky});
  }
  void clear_faults() noexcept { s_->faults.clear(); }
  /// Latency per call of `call`, added to the virtual clock, or slept when `sleep` is true.
  void set_latency(DriverCall call, std::chrono::nanoseconds ns, bool sleep = false) {
    s_->latency[idx(call)] = ns;
    s_->sleep[idx(call)] = sleep;
  }
  /// Completes every recorded event (the GPU caught up).
  void signal_events() noexcept {
    for (auto& e : s_->events) e.second = true;
  }
  void set_manual_events(bool manual) noexcept { s_->opt.manual_events = manual; }
  /// Device capacity for create() (out of memory beyond).
  void set_physical_bytes(std::size_t bytes) noexcept { s_->opt.physical_bytes = bytes; }
  void reset_counters() noexcept {
    s_->calls.fill(0);
    s_->failures.fill(0);
  }

  // ---- observation ----------------------------------------------------------------------------

  [[nodiscard]] std::uint64_t calls(DriverCall c) const noexcept { return s_->calls[idx(c)]; }
  [[nodiscard]] std::uint64_t failures(DriverCall c) const noexcept { return s_->failures[idx(c)]; }
  [[nodiscard]] std::uint64_t total_calls() const noexcept {
    std::uint64_t t = 0;
    for (auto c : s_->calls) t += c;
    return t;
  }
  [[nodiscard]] std::size_t live_handles() const noexcept { return s_->handles.size(); }
  [[nodiscard]] std::size_t bytes_created() const noexcept { return s_->bytes_created; }
  [[nodiscard]] std::size_t bytes_mapped() const noexcept { return s_->bytes_mapped; }
  [[nodiscard]] std::size_t bytes_accessible() const noexcept { return s_->bytes_accessible; }
  [[nodiscard]] std::size_t bytes_reserved() const noexcept { return s_->bytes_reserved; }
  [[nodiscard]] std::size_t num_mappings() const noexcept { return s_->mappings.size(); }
  [[nodiscard]] std::size_t num_reservations() const noexcept { return s_->reservations.size(); }
  [[nodiscard]] std::size_t live_events() const noexcept { return s_->events.size(); }
  [[nodiscard]] std::size_t pending_events() const noexcept {
    std::size_t n = 0;
    for (auto& e : s_->events) n += e.second ? 0u : 1u;
    return n;
  }
  /// Misuse detected (a call the real driver would reject); the allocator must never cause one.
  [[nodiscard]] std::uint64_t violations() const noexcept { return s_->violations; }
  [[nodiscard]] const std::string& last_violation() const noexcept { return s_->last_violation; }
  [[nodiscard]] std::chrono::nanoseconds virtual_time() const noexcept { return s_->virtual_time; }
  /// True when [va, va + bytes) is mapped and access was granted.
  [[nodiscard]] bool accessible(dev_addr va, std::size_t bytes) const noexcept {
    std::size_t covered = 0;
    auto it = s_->mappings.upper_bound(va);
    if (it == s_->mappings.begin()) return false;
    --it;
    while (covered < bytes) {
      const dev_addr at = va + covered;
      if (it == s_->mappings.end() || it->first > at || it->first + it->second.bytes <= at || !it->second.access)
        return false;
      covered = static_cast<std::size_t>(it->first + it->second.bytes - va);
      ++it;
    }
    return true;
  }
  [[nodiscard]] const FakeDriverOptions& options() const noexcept { return s_->opt; }

  [[nodiscard]] static const char* code_name(int code) noexcept {
    switch (code) {
      case kStatusSuccess: return "CUDA_SUCCESS";
      case kStatusInvalidValue: return "CUDA_ERROR_INVALID_VALUE";
      case kStatusOutOfMemory: return "CUDA_ERROR_OUT_OF_MEMORY";
      case 600: return "CUDA_ERROR_NOT_READY";
      case 999: return "CUDA_ERROR_UNKNOWN";
      default: return "CUDA_ERROR_(other)";
    }
  }

 private:
  struct Handle {
    std::size_t bytes;
    int maps;
  };
  struct Reservation {
    std::size_t bytes;
    void* host_base;  // mmap/new base (host-backed only)
    std::size_t host_len;
  };
  struct Mapping {
    std::size_t bytes;
    phys_handle handle;
    bool access;
  };
  struct Fault {
    DriverCall call;  // kCount = any
    std::uint64_t countdown;
    int code;
    bool sticky;
  };
  struct State {
    FakeDriverOptions opt;
    bool protect = false;
    std::unordered_map<phys_handle, Handle> handles;
    std::map<dev_addr, Reservation> reservations;
    std::map<dev_addr, Mapping> mappings;
    std::unordered_map<event_type, bool> events;  // id -> completed
    std::vector<Fault> faults;
    std::array<std::uint64_t, kNumDriverCalls> calls{};
    std::array<std::uint64_t, kNumDriverCalls> failures{};
    std::array<std::chrono::nanoseconds, kNumDriverCalls> latency{};
    std::array<bool, kNumDriverCalls> sleep{};
    std::chrono::nanoseconds virtual_time{0};
    phys_handle next_handle = 0x1000;
    dev_addr next_va = dev_addr{1} << 40;
    event_type next_event = 1;
    std::size_t bytes_created = 0, bytes_mapped = 0, bytes_accessible = 0, bytes_reserved = 0;
    std::uint64_t violations = 0;
    std::string last_violation;

    State() = default;
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() {
      for (auto& r : reservations) release_host(r.second);
    }
  };

  static std::size_t idx(DriverCall c) noexcept { return static_cast<std::size_t>(c); }
  std::size_t g() const noexcept { return s_->opt.granularity; }

  /// Counts the call, applies its latency and returns the injected failure code (0 = none).
  int enter(DriverCall c) noexcept {
    ++s_->calls[idx(c)];
    const auto lat = s_->latency[idx(c)];
    if (lat.count() > 0) {
      if (s_->sleep[idx(c)]) std::this_thread::sleep_for(lat);
      else s_->virtual_time += lat;
    }
    for (std::size_t i = 0; i < s_->faults.size(); ++i) {
      Fault& f = s_->faults[i];
      if (f.call != c && f.call != DriverCall::kCount) continue;
      if (f.countdown > 1) {
        --f.countdown;
        continue;
      }
      const int code = f.code;
      if (!f.sticky) s_->faults.erase(s_->faults.begin() + static_cast<std::ptrdiff_t>(i));
      ++s_->failures[idx(c)];
      return code;
    }
    return kStatusSuccess;
  }
  int violation(const char* what) noexcept {
    ++s_->violations;
    try {
      s_->last_violation = what;
    } catch (...) {
    }
    return kStatusInvalidValue;
  }
  bool inside_reservation(dev_addr va, std::size_t bytes) const noexcept {
    auto it = s_->reservations.upper_bound(va);
    if (it == s_->reservations.begin()) return false;
    --it;
    return va >= it->first && va + bytes <= it->first + it->second.bytes;
  }
  void host_fill(dev_addr va, std::size_t bytes, std::uint8_t byte, bool accessible) noexcept {
    if (!s_->opt.host_backed) return;
    void* p = reinterpret_cast<void*>(static_cast<std::uintptr_t>(va));
#if TRIATTN_FAKE_DRIVER_HAS_MMAN
    if (s_->protect) {
      (void)::mprotect(p, bytes, PROT_READ | PROT_WRITE);
      std::memset(p, byte, bytes);
      if (!accessible) (void)::mprotect(p, bytes, PROT_NONE);
      return;
    }
#endif
    (void)accessible;
    std::memset(p, byte, bytes);
  }
  static void release_host(Reservation& r) noexcept {
    if (r.host_base == nullptr) return;
#if TRIATTN_FAKE_DRIVER_HAS_MMAN
    (void)::munmap(r.host_base, r.host_len);
#else
    ::operator delete(r.host_base);
#endif
    r.host_base = nullptr;
  }

  std::shared_ptr<State> s_;
};

static_assert(VmmDriver<FakeDriver>, "FakeDriver must model VmmDriver");

}  // namespace triattn::vmm

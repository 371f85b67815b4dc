// SPDX-License-Identifier: Apache-2.0
// Random soak of KvCache<VmmAllocatorCore<FakeDriver>> on a host-backed fake device: sequences
// are added (prefill), forked, extended (decode), compressed (random keep plans: survivors move
// down, tail blocks are freed), released; the memory limit and the device capacity change; trims
// run with events that complete at once or only when signalled. After every operation:
//   - a plain brute-force model of the allocator's policy (best-fit placement, lowest-slab
//     growth, trims, limit, pools) predicts the exact block ids, slab states, ref counts, mapped
//     and pooled bytes, and the allocator must agree;
//   - the fake device must hold exactly what the ledger says (check_consistent);
// and every few hundred operations every cached K/V value is read back and compared with what was
// written (unmapped pages are inaccessible on the fake, so a wrong unmap faults).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/vmm/vmm_allocator_core.hpp>

#include "common/vmm/fake_driver.hpp"
#include "common/vmm/testing.hpp"

namespace {

using triattn::CacheConfig;
using triattn::DType;
using triattn::KeepPlan;
using triattn::KvKind;
using triattn::Phase;
using triattn::SeqId;
using triattn::vmm::AllocStatus;
using triattn::vmm::FakeDriver;
using triattn::vmm::FakeDriverOptions;
using triattn::vmm::SlabGeometry;
using triattn::vmm::SlabState;
using triattn::vmm::VmmOptions;
using Alloc = triattn::vmm::VmmAllocatorCore<FakeDriver>;
using Cache = triattn::KvCache<Alloc>;

constexpr std::size_t kPage = 4096;
constexpr std::size_t kUnlimited = std::numeric_limits<std::size_t>::max();

// ---- the plain model of the allocator's policy ---------------------------------------------------

class Model {
 public:
  enum St : int { kUnmapped = 0, kMapped = 1, kPending = 2 };

  Model(const SlabGeometry& g, std::size_t pool_cap_bytes)
      : g_(g), ref_(static_cast<std::size_t>(g.num_blocks), 0), used_(static_cast<std::size_t>(g.num_slabs), 0),
        st_(static_cast<std::size_t>(g.num_slabs), kUnmapped), group_of_(static_cast<std::size_t>(g.num_slabs), 0), pool_cap_(pool_cap_bytes) {}

  std::size_t limit = kUnlimited;
  std::size_t capacity = kUnlimited;  // the fake device's memory
  bool manual = false;                // events complete only when signalled
  AllocStatus last = AllocStatus::kOk;

  int used(int s) const { return used_[idx(s)]; }
  std::size_t physical_pages() const { return mapped_ + pool_; }
  std::size_t mapped_bytes() const { return mapped_ * kPage; }
  std::size_t pooled_bytes() const { return pool_ * kPage; }
  const std::vector<int>& refs() const { return ref_; }
  const std::vector<int>& used_counts() const { return used_; }
  int state(int s) const { return st_[idx(s)]; }

  /// Returns the predicted block ids, or false with `last` set.
  bool allocate(std::size_t n, std::vector<std::int32_t>& out) {
    if (!grow_for(n)) return false;
    out.clear();
    for (std::size_t i = 0; i < n; ++i) {
      int best = -1, best_used = -1;
      for (int s = 0; s < g_.num_slabs; ++s) {
        if (st_[idx(s)] == kUnmapped) continue;
        const int u = used(s);
        if (u < g_.blocks_in(s) && u > best_used) best = s, best_used = u;
      }
      REQUIRE(best >= 0);
      int b = g_.first_block(best);
      while (ref_[idx(b)] != 0) ++b;
      ref_[idx(b)] = 1;
      ++used_[idx(best)];
      st_[idx(best)] = kMapped;  // revives a pending slab
      out.push_back(b);
    }
    last = AllocStatus::kOk;
    return true;
  }
  bool ensure_mapped(std::size_t n) {
    if (!grow_for(n)) return false;
    last = AllocStatus::kOk;
    return true;
  }
  void retain(int b) { ++ref_[idx(b)]; }
  void release(int b) {
    if (--ref_[idx(b)] == 0) --used_[idx(g_.slab_of(b))];
  }

  void trim(std::size_t keep_bytes) {
    poll();
    std::vector<int> sched;
    std::size_t kept = 0;
    for (int s = 0; s < g_.num_slabs; ++s) {
      if (st_[idx(s)] != kMapped || used(s) != 0) continue;
      const auto b = slab_bytes(s);
      if (kept + b <= keep_bytes) kept += b;
      else sched.push_back(s);
    }
    schedule(sched);
    poll();
  }
  void signal() {
    for (auto& gr : groups_) gr.done = true;
  }
  void synchronize() {
    signal();
    poll();
  }
  void set_limit(std::size_t bytes, bool wait) {
    limit = bytes;
    while (pool_ > 0 && physical_pages() * kPage > limit) --pool_;
    if (physical_pages() * kPage <= limit) return;
    poll();
    std::size_t going = pending_bytes();
    std::vector<int> sched;
    for (int s = g_.num_slabs - 1; s >= 0 && physical_pages() * kPage > limit + going; --s) {
      if (st_[idx(s)] != kMapped || used(s) != 0) continue;
      sched.push_back(s);
      going += slab_bytes(s);
    }
    schedule(sched);
    if (wait) synchronize();
    else poll();
  }
  void poll() {
    for (auto it = groups_.begin(); it != groups_.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      for (int s : it->slabs)
        if (st_[idx(s)] == kPending && group_of_[idx(s)] == it->id) unmap(s);
      it = groups_.erase(it);
    }
  }
  std::size_t pending_bytes() const {
    std::size_t b = 0;
    for (int s = 0; s < g_.num_slabs; ++s) b += st_[idx(s)] == kPending ? slab_bytes(s) : 0;
    return b;
  }
  std::size_t num_groups() const { return groups_.size(); }

 private:
  struct Group {
    std::uint64_t id;
    bool done;
    std::vector<int> slabs;
  };
  static std::size_t idx(int i) { return static_cast<std::size_t>(i); }
  std::size_t slab_bytes(int s) const { return static_cast<std::size_t>(g_.slab_bytes_all_ranges(s)); }
  std::size_t slab_pages(int s) const { return slab_bytes(s) / kPage; }

  bool grow_for(std::size_t n) {
    std::size_t mapped_free = 0;
    for (int s = 0; s < g_.num_slabs; ++s)
      if (st_[idx(s)] != kUnmapped) mapped_free += static_cast<std::size_t>(g_.blocks_in(s) - used(s));
    if (n <= mapped_free) return true;
    std::vector<int> plan;
    std::size_t got = 0;
    for (int s = 0; s < g_.num_slabs && got < n - mapped_free; ++s)
      if (st_[idx(s)] == kUnmapped) plan.push_back(s), got += static_cast<std::size_t>(g_.blocks_in(s));
    if (got < n - mapped_free) return fail(AllocStatus::kNoBlocks);
    std::size_t pages = 0;
    for (int s : plan) pages += slab_pages(s);
    const std::size_t fresh = pages > pool_ ? pages - pool_ : 0;
    if (fresh > 0 && (physical_pages() + fresh) * kPage > limit) return fail(AllocStatus::kMemoryLimit);
    if (fresh > 0 && (physical_pages() + fresh) * kPage > capacity) return fail(AllocStatus::kDriverOutOfMemory);
    pool_ -= pages - fresh;
    mapped_ += pages;
    for (int s : plan) st_[idx(s)] = kMapped;
    return true;
  }
  bool fail(AllocStatus s) {
    last = s;
    return false;
  }
  void schedule(const std::vector<int>& sched) {
    if (sched.empty()) return;
    const std::uint64_t id = ++next_group_;
    for (int s : sched) st_[idx(s)] = kPending, group_of_[idx(s)] = id;
    groups_.push_back(Group{id, !manual, sched});
  }
  void unmap(int s) {
    st_[idx(s)] = kUnmapped;
    for (std::size_t p = 0; p < slab_pages(s); ++p) {
      --mapped_;
      if ((pool_ + 1) * kPage <= pool_cap_ && (physical_pages() + 1) * kPage <= limit) ++pool_;
    }
  }

  SlabGeometry g_;
  std::vector<int> ref_;
  std::vector<int> used_;  // live blocks per slab
  std::vector<int> st_;
  std::vector<std::uint64_t> group_of_;
  std::vector<Group> groups_;
  std::uint64_t next_group_ = 0;
  std::size_t mapped_ = 0, pool_ = 0;
  std::size_t pool_cap_;
};

// ---- the soak ---------------------------------------------------------------------------------------

float value(std::int64_t uid, int layer, int kind, int head, int d) {
  std::uint64_t x = static_cast<std::uint64_t>(uid) * 0x9E3779B97F4A7C15ull ^
                    (static_cast<std::uint64_t>(layer) << 40 | static_cast<std::uint64_t>(kind) << 36 |
                     static_cast<std::uint64_t>(head) << 20 | static_cast<std::uint64_t>(d));
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(x & 0xFFFFFF);  // exact in float
}

struct SeqModel {
  bool active = false;
  int protected_prefix = 0;                 // tokens shared with another sequence (never rewritten)
  std::vector<std::vector<std::int64_t>> uids;  // [layer * kv_heads + head] -> uid per slot
};

class Soak {
 public:
  Soak(const CacheConfig& cfg, std::size_t pool_cap, std::uint64_t seed, int max_len)
      : cfg_(cfg), drv_(make_fake()), cache_(cfg, Alloc(cfg, options(pool_cap), drv_)),
        model_(cache_.allocator().geometry(), pool_cap), rng_(seed), seqs_(static_cast<std::size_t>(cfg.max_seqs)),
        max_len_(max_len), seed_(seed) {}

  void run(int ops) {
    for (op_ = 0; op_ < ops; ++op_) {
      const int r = pick(100);
      if (r < 30) append_decode();
      else if (r < 38) add_sequence();
      else if (r < 41) fork();
      else if (r < 51) compress();
      else if (r < 56) release_seq();
      else if (r < 64) trim();
      else if (r < 69) change_limit();
      else if (r < 73) signal();
      else if (r < 75) toggle_manual();
      else if (r < 78) synchronize();
      else if (r < 81) ensure();
      else if (r < 83) change_capacity();
      else append_decode();
      compare();
      if (op_ % 250 == 0) verify_data();
      if (failed_) return;
    }
    verify_data();
    model_.limit = kUnlimited;
    cache_.allocator().set_memory_limit(kUnlimited);
    for (int s = 0; s < cfg_.max_seqs; ++s)
      if (seqs_[static_cast<std::size_t>(s)].active) release_seq_id(s);
    (void)cache_.allocator().trim(0);
    cache_.allocator().synchronize();  // events may be in manual mode
    model_.trim(0);
    model_.synchronize();
    compare();
    CHECK(cache_.allocator().bytes_resident() == 0);
  }

  std::size_t appends_failed = 0, compressions = 0, max_resident = 0, limit_failures = 0, oom_failures = 0;

 private:
  static FakeDriver make_fake() {
    FakeDriverOptions o;
    o.granularity = kPage;
    o.host_backed = true;
    return FakeDriver(o);
  }
  static VmmOptions options(std::size_t pool_cap) {
    VmmOptions o;
    o.handle_pool_bytes = pool_cap;
    return o;
  }
  int pick(int n) { return static_cast<int>(rng_() % static_cast<std::uint64_t>(n)); }
  Alloc& alloc() { return cache_.allocator(); }
  int kv() const { return cfg_.model.num_kv_heads; }
  int hd() const { return cfg_.model.head_dim; }
  int layers() const { return cfg_.model.num_layers; }
  int random_active() {
    std::vector<int> a;
    for (int s = 0; s < cfg_.max_seqs; ++s)
      if (seqs_[static_cast<std::size_t>(s)].active) a.push_back(s);
    return a.empty() ? -1 : a[static_cast<std::size_t>(pick(static_cast<int>(a.size())))];
  }
  int blocks_of(int len) const { return (len + cfg_.block_size - 1) / cfg_.block_size; }

  /// extend() on the cache and the model; writes K/V when it succeeded.
  bool append(int s, int n, Phase phase) {
    SeqModel& m = seqs_[static_cast<std::size_t>(s)];
    const int len = cache_.physical_length(s);
    const int need = blocks_of(len + n) - blocks_of(len);
    std::vector<std::int32_t> expect;
    const bool model_ok = need == 0 || model_.allocate(static_cast<std::size_t>(need), expect);
    const auto r = cache_.extend(s, n, phase);
    if (r.ok() != model_ok) return fail("extend: cache says " + std::to_string(r.ok()) + ", model " + std::to_string(model_ok));
    if (!r.ok()) {
      ++appends_failed;
      if (alloc().last_status() != model_.last)
        return fail("extend: status " + std::string(alloc_status_name(alloc().last_status())) + " vs model " +
                    alloc_status_name(model_.last));
      limit_failures += model_.last == AllocStatus::kMemoryLimit ? 1u : 0u;
      oom_failures += model_.last == AllocStatus::kDriverOutOfMemory ? 1u : 0u;
      return false;
    }
    const auto table = cache_.block_table(s);
    for (int j = 0; j < need; ++j)
      if (table[static_cast<std::size_t>(blocks_of(len) + j)] != expect[static_cast<std::size_t>(j)])
        return fail("extend: block " + std::to_string(table[static_cast<std::size_t>(blocks_of(len) + j)]) +
                    " placed where the model expects " + std::to_string(expect[static_cast<std::size_t>(j)]));
    // Write n tokens of every layer.
    std::vector<float> k(static_cast<std::size_t>(n) * kv() * hd()), v(k.size());
    std::vector<std::int64_t> uid(static_cast<std::size_t>(n));
    for (auto& u : uid) u = next_uid_++;
    for (int l = 0; l < layers(); ++l) {
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < kv(); ++h)
          for (int d = 0; d < hd(); ++d) {
            const std::size_t i = (static_cast<std::size_t>(t) * kv() + h) * hd() + d;
            k[i] = value(uid[static_cast<std::size_t>(t)], l, 0, h, d);
            v[i] = value(uid[static_cast<std::size_t>(t)], l, 1, h, d);
          }
      cache_.write<float>(s, l, r.first_slot, k.data(), v.data(), n);
      for (int h = 0; h < kv(); ++h)
        m.uids[static_cast<std::size_t>(l * kv() + h)].insert(m.uids[static_cast<std::size_t>(l * kv() + h)].end(), uid.begin(),
                                                              uid.end());
    }
    return true;
  }

  void add_sequence() {
    if (cache_.num_active() == cfg_.max_seqs) return release_seq();
    const SeqId s = cache_.add_sequence();
    SeqModel& m = seqs_[static_cast<std::size_t>(s)];
    m = SeqModel{};
    m.active = true;
    m.uids.assign(static_cast<std::size_t>(layers() * kv()), {});
    (void)append(s, 1 + pick(64), Phase::kPrefill);
  }
  void append_decode() {
    const int s = random_active();
    if (s < 0) return add_sequence();
    const int n = 1 + pick(8);
    if (cache_.physical_length(s) + n > max_len_) return compress_seq(s);
    (void)append(s, n, Phase::kDecode);
  }
  void fork() {
    const int p = random_active();
    if (p < 0 || cache_.num_active() == cfg_.max_seqs) return;
    const int full = cache_.forkable_prefix(p) / cfg_.block_size;  // whole blocks still holding tokens in order
    if (full == 0) return;
    const int tokens = (1 + pick(full)) * cfg_.block_size;
    const auto parent_table = cache_.block_table(p);
    const SeqId c = cache_.fork_prefix(p, tokens);
    for (int j = 0; j < tokens / cfg_.block_size; ++j) model_.retain(parent_table[static_cast<std::size_t>(j)]);
    SeqModel& pm = seqs_[static_cast<std::size_t>(p)];
    SeqModel& cm = seqs_[static_cast<std::size_t>(c)];
    cm = SeqModel{};
    cm.active = true;
    cm.protected_prefix = tokens;
    pm.protected_prefix = std::max(pm.protected_prefix, tokens);
    for (const auto& row : pm.uids) cm.uids.emplace_back(row.begin(), row.begin() + tokens);
  }
  void compress() {
    const int s = random_active();
    if (s >= 0) compress_seq(s);
  }
  void compress_seq(int s) {
    SeqModel& m = seqs_[static_cast<std::size_t>(s)];
    const int len = cache_.physical_length(s);
    const int lo = std::min(m.protected_prefix, len);
    const int keep = lo + pick(len - lo + 1);
    const bool prefix = pick(4) == 0;
    KeepPlan plan(layers(), kv(), keep);
    for (int l = 0; l < layers(); ++l)
      for (int h = 0; h < kv(); ++h) {
        std::int32_t* row = plan.row(l, h);
        for (int i = 0; i < lo; ++i) row[i] = i;
        // Selection sampling: keep - lo sorted slots out of [lo, len).
        int need = keep - lo, i = lo;
        for (int slot = lo; slot < len && need > 0; ++slot) {
          if (prefix || pick(len - slot) < need) {
            row[i++] = slot;
            --need;
          }
        }
      }
    const auto table = cache_.block_table(s);
    const std::vector<std::int32_t> old(table.begin(), table.end());
    cache_.apply_keep_plan(s, plan);
    for (int j = blocks_of(keep); j < blocks_of(len); ++j) model_.release(old[static_cast<std::size_t>(j)]);
    for (int l = 0; l < layers(); ++l)
      for (int h = 0; h < kv(); ++h) {
        auto& row = m.uids[static_cast<std::size_t>(l * kv() + h)];
        std::vector<std::int64_t> kept(static_cast<std::size_t>(keep));
        for (int i = 0; i < keep; ++i) kept[static_cast<std::size_t>(i)] = row[static_cast<std::size_t>(plan.row(l, h)[i])];
        row.swap(kept);
      }
    ++compressions;
  }
  void release_seq() {
    const int s = random_active();
    if (s >= 0) release_seq_id(s);
  }
  void release_seq_id(int s) {
    const auto table = cache_.block_table(s);
    const std::vector<std::int32_t> old(table.begin(), table.end());
    cache_.release(s);
    for (auto b : old) model_.release(b);
    seqs_[static_cast<std::size_t>(s)] = SeqModel{};
  }
  void trim() {
    const std::size_t slab = static_cast<std::size_t>(alloc().geometry().slab_bytes_all_ranges(0));
    const std::size_t keeps[] = {0, 0, slab, 3 * slab};
    const std::size_t keep = keeps[pick(4)];
    (void)alloc().trim(0, keep);
    model_.trim(keep);
  }
  void change_limit() {
    const std::size_t slab = static_cast<std::size_t>(alloc().geometry().slab_bytes_all_ranges(0));
    const std::size_t phys = alloc().physical_bytes();
    std::size_t l = kUnlimited;
    switch (pick(5)) {
      case 0: l = kUnlimited; break;
      case 1: l = phys; break;
      case 2: l = phys > slab ? phys - slab : 0; break;
      case 3: l = alloc().bytes_resident() / 2; break;
      case 4: l = phys + 2 * slab; break;
    }
    const bool wait = pick(3) != 0;
    (void)alloc().set_memory_limit(l, 0, wait);
    model_.set_limit(l, wait);
  }
  void change_capacity() {
    const std::size_t cap = pick(2) == 0 ? kUnlimited : drv_.bytes_created() + static_cast<std::size_t>(pick(24)) * kPage;
    drv_.set_physical_bytes(cap);
    model_.capacity = cap;
  }
  void signal() {
    drv_.signal_events();
    model_.signal();
    (void)alloc().poll();
    model_.poll();
  }
  void toggle_manual() {
    model_.manual = !model_.manual;
    drv_.set_manual_events(model_.manual);
  }
  void synchronize() {
    alloc().synchronize();
    model_.synchronize();
  }
  void ensure() {
    const std::size_t n = static_cast<std::size_t>(pick(64));
    const bool a = alloc().ensure_mapped(n);
    const bool m = model_.ensure_mapped(n);
    if (a != m) (void)fail("ensure_mapped disagrees with the model");
  }

  void compare() {
    const Alloc& a = alloc();
    if (a.ledger().ref_counts() != model_.refs()) return (void)fail("ref counts differ from the model");
    if (a.ledger().used_counts() != model_.used_counts()) return (void)fail("per-slab occupancy differs from the model");
    for (int s = 0; s < a.geometry().num_slabs; ++s)
      if (static_cast<int>(a.ledger().state(s)) != model_.state(s))
        return (void)fail("slab " + std::to_string(s) + " state " + std::to_string(static_cast<int>(a.ledger().state(s))) +
                          " vs model " + std::to_string(model_.state(s)));
    if (a.bytes_resident() != model_.mapped_bytes())
      return (void)fail("bytes_resident " + std::to_string(a.bytes_resident()) + " vs model " +
                        std::to_string(model_.mapped_bytes()));
    if (a.bytes_pooled() != model_.pooled_bytes())
      return (void)fail("bytes_pooled " + std::to_string(a.bytes_pooled()) + " vs model " + std::to_string(model_.pooled_bytes()));
    if (a.num_pending_trims() != model_.num_groups()) return (void)fail("pending trims differ from the model");
    const auto mem = cache_.memory();
    std::size_t distinct = 0;
    for (int r : model_.refs()) distinct += r > 0 ? 1u : 0u;
    if (mem.blocks_used != distinct) return (void)fail("blocks_used differs from the live blocks");
    if (mem.bytes_resident != a.bytes_resident()) return (void)fail("MemoryStats.bytes_resident is not the allocator's");
    max_resident = std::max(max_resident, a.bytes_resident());
    try {
      triattn::vmm::check_consistent(a);
    } catch (const std::exception& e) {
      (void)fail(e.what());
    }
  }
  void verify_data() {
    const auto view = cache_.view<float>();
    for (int s = 0; s < cfg_.max_seqs; ++s) {
      const SeqModel& m = seqs_[static_cast<std::size_t>(s)];
      if (!m.active) continue;
      const int len = cache_.physical_length(s);
      for (int l = 0; l < layers(); ++l)
        for (int h = 0; h < kv(); ++h) {
          const auto& row = m.uids[static_cast<std::size_t>(l * kv() + h)];
          if (static_cast<int>(row.size()) != len) return (void)fail("model length mismatch");
          for (int i = 0; i < len; ++i)
            for (int kind = 0; kind < 2; ++kind) {
              const float* p = view.token(l, static_cast<KvKind>(kind), s, i, h);
              for (int d = 0; d < hd(); ++d)
                if (p[d] != value(row[static_cast<std::size_t>(i)], l, kind, h, d))
                  return (void)fail("data mismatch: seq " + std::to_string(s) + " layer " + std::to_string(l) + " head " +
                                    std::to_string(h) + " slot " + std::to_string(i));
            }
        }
    }
  }
  bool fail(const std::string& what) {
    if (!failed_) FAIL_CHECK("op " << op_ << " (seed " << seed_ << "): " << what);
    failed_ = true;
    return false;
  }

  CacheConfig cfg_;
  FakeDriver drv_;
  Cache cache_;
  Model model_;
  std::mt19937_64 rng_;
  std::vector<SeqModel> seqs_;
  int max_len_;
  std::uint64_t seed_;
  std::int64_t next_uid_ = 1;
  int op_ = 0;
  bool failed_ = false;
};

CacheConfig config(int block_size, int kv_heads, int head_dim, int num_blocks) {
  CacheConfig c;
  c.model = {2, kv_heads, kv_heads, head_dim};
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.max_seqs = 8;
  c.dtype = DType::kF32;
  return c;
}

}  // namespace

TEST_SUITE("vmm") {

TEST_CASE("vmm soak: 100000 random operations with blocks smaller than a page") {
  Soak soak(config(4, 2, 8, 512), 6 * kPage, 20240611, 400);
  soak.run(100000);
  MESSAGE("compressions " << soak.compressions << ", failed appends " << soak.appends_failed << " (limit "
                          << soak.limit_failures << ", driver OOM " << soak.oom_failures << "), peak resident "
                          << soak.max_resident << " bytes");
  CHECK(soak.compressions > 1000);
  CHECK(soak.limit_failures > 0);
  CHECK(soak.oom_failures > 0);
}

TEST_CASE("vmm soak: blocks of two pages (slab = one block)") {
  Soak soak(config(64, 4, 8, 64), 0, 77, 700);
  soak.run(30000);
  CHECK(soak.compressions > 300);
}

TEST_CASE("vmm soak: 192-byte blocks (slab = lcm = 3 pages and a short last slab)") {
  Soak soak(config(3, 2, 8, 400), 16 * kPage, 4242, 300);
  soak.run(30000);
  CHECK(soak.compressions > 300);
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// Randomized soak of the prefix cache: requests arrive with shared prompts (a few system prompts,
// two extra keys, exact repeats) and private tails, are admitted over their longest cached chain,
// prefill the rest, publish their prompt blocks, decode, run compression rounds and leave; the
// pool is small, so idle cached blocks are evicted. Three allocators: a static pool, and the VMM
// allocator over the host-backed fake driver under a memory limit with injected driver faults.
//
// Every operation runs on the sharing cache and on a plain cache (no prefix cache, every token
// computed, its selector told the same protected prefix) and is checked against a plain model:
//   - every block's reference count (sequences holding it + the cache's own reference);
//   - every cached chain (parent, key, tokens) and its K/V content, and the eviction order
//     (least recently used idle leaf first, predicted from the model's own recency clock);
//   - for the static pool, exactly when eviction happens and how much (only when memory is needed);
//   - every sequence's lengths, and its K/V, bitwise equal to the plain cache's.
// Operations: TRIATTN_PREFIX_SOAK_OPS (default 100,000 per allocator), seed TRIATTN_SOAK_SEED.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include "common/vmm/fake_driver.hpp"
#include "common/vmm/testing.hpp"
#include <triattn/core/vmm/vmm_allocator_core.hpp>

namespace {

using triattn::CacheConfig;
using triattn::DType;
using triattn::KvKind;
using triattn::Phase;
using triattn::PromptMode;
using triattn::SeqId;

std::uint64_t soak_seed() {
  if (const char* s = std::getenv("TRIATTN_SOAK_SEED"); s != nullptr && *s != '\0') return std::strtoull(s, nullptr, 0);
  return 0x5eed36;
}
int soak_ops() {
  if (const char* s = std::getenv("TRIATTN_PREFIX_SOAK_OPS"); s != nullptr && *s != '\0') return std::atoi(s);
  return 100000;
}

// Scores from the cached keys (element 0 of each head vector): equal contents give equal plans.
struct ContentScorer {
  using policy_role = triattn::scorer_role;
  static constexpr triattn::MemorySpace memory_space = triattn::MemorySpace::kHost;
  template <class Id>
  void score(const triattn::KvCacheView<float, Id>& v, int seq, int len, std::int64_t, std::span<float> out) const {
    const int hkv = v.block.num_kv_heads;
    const int hq = static_cast<int>(out.size() / (static_cast<std::size_t>(v.num_layers) * std::max(len, 1)));
    for (int l = 0; l < v.num_layers; ++l)
      for (int h = 0; h < hq; ++h)
        for (int j = 0; j < len; ++j)
          out[(static_cast<std::size_t>(l) * hq + h) * len + j] = v.token(l, KvKind::kKey, seq, j, h * hkv / hq)[h % 2];
  }
  template <class T, class Id>
  void score(const triattn::KvCacheView<T, Id>&, int, int, std::int64_t, std::span<float>) const {}
};

// TopKSelector that also protects a prefix the test names (the plain cache shares nothing, so it
// learns the sharing cache's protected prefix this way).
struct ProtectingSelector {
  using policy_role = triattn::selector_role;
  triattn::TopKSelector inner;
  int protect = 0;
  explicit ProtectingSelector(const triattn::SelectionParams& p) : inner(p) {}
  bool should_compress(int len, int prompt_len, bool decode) const { return inner.should_compress(len, prompt_len, decode); }
  triattn::KeepPlan select(std::span<const float> s, const triattn::ModelGeometry& g, int len, int prompt_len, int pp = 0) const {
    return inner.select(s, g, len, prompt_len, std::max(pp, protect));
  }
};

using Plain = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, ContentScorer, ProtectingSelector>;
using StaticPC = triattn::PrefixCachingAllocator<triattn::StaticAllocator<triattn::HostBackend>>;
using VmmPC = triattn::PrefixCachingAllocator<triattn::vmm::VmmAllocatorCore<triattn::vmm::FakeDriver>>;

float kv_value(std::uint64_t prefix_hash, std::int64_t pos, int layer, int kind, int head, int d) {
  const std::uint64_t h = triattn::mix64(prefix_hash ^ static_cast<std::uint64_t>(((pos * 2 + layer) * 2 + kind) * 16 + head * 4 + d));
  return static_cast<float>(h >> 40) / static_cast<float>(1 << 24) - 0.5f;
}

template <class Alloc>
class Soak {
 public:
  using Sharing = triattn::KvCache<Alloc, ContentScorer, triattn::TopKSelector>;

  Soak(const CacheConfig& cfg, const CacheConfig& plain_cfg, Alloc alloc, const triattn::SelectionParams& sel, std::uint64_t seed)
      : cfg_(cfg), rng_(seed), share_(cfg, std::move(alloc), triattn::TopKSelector(sel)),
        plain_(plain_cfg, ProtectingSelector(sel)), refs_(static_cast<std::size_t>(cfg.num_blocks), 0) {
    for (int s = 0; s < 4; ++s) {
      std::vector<std::int32_t> p(static_cast<std::size_t>(std::vector<int>{6, 12, 17, 33}[static_cast<std::size_t>(s)]));
      for (auto& t : p) t = rand(0, 40);
      systems_.push_back(p);
    }
  }

  static constexpr bool kStatic = std::is_same_v<Alloc, StaticPC>;

  int rand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(int pct) { return rand(0, 99) < pct; }
  Sharing& sharing() { return share_; }

  struct Seq {
    SeqId s = -1, p = -1;  // ids in the sharing and plain caches
    std::uint64_t key = 0;
    std::vector<std::int32_t> toks;       // prompt + generated
    std::vector<std::uint64_t> hashes;    // prefix hash after each token
    int prompt = 0;
  };
  struct Entry {
    std::int32_t block;
    std::int32_t parent;  // block, -1 for a first block
    std::uint64_t tick;
    std::vector<std::int32_t> tokens;  // the whole chain's tokens up to this block
    std::uint64_t key;
  };

  // ---- model helpers -------------------------------------------------------------------------

  std::uint64_t tick() { return ++clock_; }
  bool cached(std::int32_t b) const { return by_block_.count(b) != 0; }
  int children(std::int32_t b) const {
    int n = 0;
    for (const auto& [blk, e] : by_block_) n += e.parent == b ? 1 : 0;
    return n;
  }
  void m_release(std::int32_t b) {
    int& r = refs_[static_cast<std::size_t>(b)];
    REQUIRE(r > 0);
    if (--r == 1 && cached(b)) by_block_.at(b).tick = tick();
  }
  std::size_t idle_count() const {
    std::size_t n = 0;
    for (const auto& [b, e] : by_block_) n += refs_[static_cast<std::size_t>(b)] == 1 ? 1 : 0;
    return n;
  }
  std::size_t inner_free() const {
    return static_cast<std::size_t>(std::count(refs_.begin(), refs_.end(), 0));
  }
  void m_evict_one() {
    std::optional<std::int32_t> victim;
    std::uint64_t best = ~std::uint64_t{0};
    for (const auto& [b, e] : by_block_)
      if (refs_[static_cast<std::size_t>(b)] == 1 && children(b) == 0 && e.tick < best) best = e.tick, victim = b;
    REQUIRE(victim.has_value());
    const Entry& e = by_block_.at(*victim);
    by_chain_.erase({e.key, e.tokens});
    by_block_.erase(*victim);
    refs_[static_cast<std::size_t>(*victim)] = 0;
  }
  // Syncs evictions the sharing cache reported during one call (VMM: the count is its business;
  // which blocks go is checked against the model's order by the chain comparison afterwards).
  void sync_evictions(std::uint64_t before, std::optional<std::size_t> predicted) {
    const std::uint64_t k = share_.allocator().prefix_stats().evicted_blocks - before;
    if (predicted) REQUIRE(k == *predicted);
    for (std::uint64_t i = 0; i < k; ++i) m_evict_one();
    evictions_ += k;
  }
  // Static pool: evictions an allocation of n blocks causes (nullopt: it fails).
  std::optional<std::size_t> predict_alloc(std::size_t n) const {
    const std::size_t f = inner_free();
    if (n <= f) return 0;
    if (f + idle_count() < n) return std::nullopt;
    return n - f;
  }

  // ---- operations ----------------------------------------------------------------------------

  std::vector<std::int32_t> new_prompt(std::uint64_t& key) {
    key = static_cast<std::uint64_t>(rand(0, 1));
    if (!done_prompts_.empty() && chance(15)) {  // an exact repeat (hits up to its last token)
      const auto& [k, p] = done_prompts_[static_cast<std::size_t>(rand(0, static_cast<int>(done_prompts_.size()) - 1))];
      key = k;
      return p;
    }
    std::vector<std::int32_t> p;
    if (chance(80)) p = systems_[static_cast<std::size_t>(rand(0, 3))];
    const int own = rand(p.empty() ? 1 : 0, 10);
    for (int i = 0; i < own; ++i) p.push_back(rand(0, 40));
    return p;
  }

  void write(Seq& q, int first_slot_s, int first_slot_p, int first_pos, int n, bool to_plain) {
    const auto& g = cfg_.model;
    std::vector<float> k(static_cast<std::size_t>(n) * g.num_kv_heads * g.head_dim), v(k.size());
    for (int l = 0; l < g.num_layers; ++l) {
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < g.num_kv_heads; ++h)
          for (int d = 0; d < g.head_dim; ++d) {
            const std::size_t i = (static_cast<std::size_t>(t) * g.num_kv_heads + h) * g.head_dim + d;
            const std::uint64_t ph = q.hashes[static_cast<std::size_t>(first_pos + t)];
            k[i] = kv_value(ph, first_pos + t, l, 0, h, d);
            v[i] = kv_value(ph, first_pos + t, l, 1, h, d);
          }
      if (first_slot_s >= 0) share_.template write<float>(q.s, l, first_slot_s, k.data(), v.data(), n);
      if (to_plain) plain_.template write<float>(q.p, l, first_slot_p, k.data(), v.data(), n);
    }
  }
  void push_tokens(Seq& q, std::span<const std::int32_t> t) {
    for (const std::int32_t x : t) {
      const std::uint64_t prev = q.hashes.empty() ? 0x1234 : q.hashes.back();
      q.toks.push_back(x);
      q.hashes.push_back(triattn::mix64(prev ^ static_cast<std::uint32_t>(x)));
    }
  }

  void op_arrive() {
    if (share_.num_active() == cfg_.max_seqs) return;
    Seq q;
    const std::vector<std::int32_t> prompt = new_prompt(q.key);
    push_tokens(q, prompt);
    q.prompt = static_cast<int>(prompt.size());
    const int bs = cfg_.block_size;
    // Model: the longest chain of full blocks, at most prompt - 1 tokens.
    std::vector<std::int32_t> chain;
    for (int j = 0; (j + 1) * bs <= q.prompt; ++j) {
      const auto it = by_chain_.find({q.key, std::vector<std::int32_t>(prompt.begin(), prompt.begin() + (j + 1) * bs)});
      if (it == by_chain_.end()) break;
      chain.push_back(it->second);
    }
    const int hit = std::min(static_cast<int>(chain.size()) * bs, q.prompt - 1);
    const int nb = (hit + bs - 1) / bs;
    const triattn::PrefixAdmission a = triattn::admit_prompt(share_, std::span<const std::int32_t>(prompt), q.key);
    REQUIRE(a.cached_tokens == hit);
    for (int j = 0; j < nb; ++j) {
      REQUIRE(share_.block_table(a.seq)[static_cast<std::size_t>(j)] == chain[static_cast<std::size_t>(j)]);
      ++refs_[static_cast<std::size_t>(chain[static_cast<std::size_t>(j)])];
      by_block_.at(chain[static_cast<std::size_t>(j)]).tick = tick();
    }
    hits_ += static_cast<std::uint64_t>(hit);
    q.s = a.seq;
    const int rest = q.prompt - hit;
    // Extend (copy-on-write of a partly shared block, eviction when the pool is full).
    const bool cow = hit % bs != 0 && refs_[static_cast<std::size_t>(chain[static_cast<std::size_t>(nb - 1)])] > 1;
    const std::size_t need = static_cast<std::size_t>((q.prompt + bs - 1) / bs - nb) + (cow ? 1 : 0);
    if (!extend_share(q, rest, Phase::kPrefill, need, nb, cow)) {
      release_share(q);
      return;
    }
    q.p = plain_.add_sequence();
    REQUIRE(plain_.extend(q.p, q.prompt, Phase::kPrefill).ok());
    computed_ += static_cast<std::uint64_t>(rest);
    write(q, -1, 0, 0, q.prompt, true);
    write(q, hit, 0, hit, rest, false);
    if (chance(85)) publish(q);
    seqs_.push_back(q);
  }

  // Extends the sharing cache by n tokens; `need` new blocks (cow: the last of them replaces the
  // partly shared block nb - 1). Returns false (model unchanged but for evictions) when refused.
  bool extend_share(Seq& q, int n, Phase ph, std::size_t need, int nb, bool cow) {
    const std::uint64_t ev = share_.allocator().prefix_stats().evicted_blocks;
    std::optional<std::size_t> predicted;
    if constexpr (kStatic) predicted = predict_alloc(need);
    const std::int32_t old_last = nb > 0 ? share_.block_table(q.s)[static_cast<std::size_t>(nb - 1)] : -1;
    triattn::AppendResult r;
    if constexpr (!kStatic) {
      if (chance(20)) {  // a driver fault in the growth this extend may need
        const auto call = chance(50) ? triattn::vmm::DriverCall::kCreate : triattn::vmm::DriverCall::kMap;
        share_.allocator().driver().fail_nth(call, static_cast<std::uint64_t>(rand(1, 3)),
                                             chance(50) ? triattn::vmm::kStatusOutOfMemory : 999);
      }
    }
    try {
      r = share_.extend(q.s, n, ph);
    } catch (const triattn::vmm::driver_error&) {
      ++faults_;
      if constexpr (!kStatic) share_.allocator().driver().clear_faults();
      sync_evictions(ev, std::nullopt);
      return false;
    }
    if constexpr (!kStatic) share_.allocator().driver().clear_faults();
    if (!r.ok()) {
      if constexpr (kStatic) REQUIRE(!predicted.has_value());
      ++refused_;
      sync_evictions(ev, std::nullopt);
      return false;
    }
    if constexpr (kStatic) REQUIRE(predicted.has_value());
    sync_evictions(ev, predicted);
    REQUIRE(static_cast<std::size_t>(r.blocks_needed) == need);
    const auto tab = share_.block_table(q.s);
    for (std::size_t j = static_cast<std::size_t>(nb); j < tab.size(); ++j) {
      REQUIRE(refs_[static_cast<std::size_t>(tab[j])] == 0);
      refs_[static_cast<std::size_t>(tab[j])] = 1;
    }
    if (cow) {
      REQUIRE(tab[static_cast<std::size_t>(nb - 1)] != old_last);
      REQUIRE(refs_[static_cast<std::size_t>(tab[static_cast<std::size_t>(nb - 1)])] == 0);
      refs_[static_cast<std::size_t>(tab[static_cast<std::size_t>(nb - 1)])] = 1;
      m_release(old_last);
      ++cows_;
    }
    return true;
  }

  void release_share(Seq& q) {
    const auto tab = std::vector<std::int32_t>(share_.block_table(q.s).begin(), share_.block_table(q.s).end());
    share_.release(q.s);
    for (const std::int32_t b : tab) m_release(b);
  }

  void publish(Seq& q) {
    const int bs = cfg_.block_size;
    const int in_place = std::min(share_.prompt_length(q.s), share_.forkable_prefix(q.s));
    const auto tab = share_.block_table(q.s);
    std::int32_t parent = -1;
    std::vector<std::int32_t> expect_new;
    for (int j = 0; j < in_place / bs; ++j) {
      std::vector<std::int32_t> pre(q.toks.begin(), q.toks.begin() + (j + 1) * bs);
      const std::int32_t b = tab[static_cast<std::size_t>(j)];
      if (const auto it = by_chain_.find({q.key, pre}); it != by_chain_.end()) {
        if (it->second != b) {  // computed twice: the sequence shares the cached block instead
          ++refs_[static_cast<std::size_t>(it->second)];
          m_release(b);
          ++shared_on_publish_;
        }
        parent = it->second;
        continue;
      }
      REQUIRE(!cached(b));
      by_chain_[{q.key, pre}] = b;
      by_block_[b] = Entry{b, parent, tick(), pre, q.key};
      ++refs_[static_cast<std::size_t>(b)];
      parent = b;
    }
    (void)triattn::publish_prompt(share_, q.s, std::span<const std::int32_t>(q.toks.data(), static_cast<std::size_t>(q.prompt)), q.key);
  }

  void op_decode(Seq& q) {
    std::int32_t t = rand(0, 40);
    const int bs = cfg_.block_size;
    const int len = share_.physical_length(q.s);
    const int nb = (len + bs - 1) / bs;
    const bool cow = len % bs != 0 && refs_[static_cast<std::size_t>(share_.block_table(q.s)[static_cast<std::size_t>(nb - 1)])] > 1;
    const std::size_t need = static_cast<std::size_t>((len + 1 + bs - 1) / bs - nb) + (cow ? 1 : 0);
    if (!extend_share(q, 1, Phase::kDecode, need, nb, cow)) return;
    REQUIRE(plain_.extend(q.p, 1, Phase::kDecode).ok());
    push_tokens(q, std::span<const std::int32_t>(&t, 1));
    const int pos = static_cast<int>(q.toks.size()) - 1;
    write(q, len, plain_.physical_length(q.p) - 1, pos, 1, true);
  }

  void op_compress(Seq& q) {
    const bool due = share_.needs_compression(q.s);
    REQUIRE(due == plain_.needs_compression(q.p));
    if (!due) return;
    const int shared = share_.shared_prefix(q.s);
    plain_.selector().protect = shared;
    const auto before = std::vector<std::int32_t>(share_.block_table(q.s).begin(), share_.block_table(q.s).end());
    const auto rs = share_.compress(q.s);
    const auto rp = plain_.compress(q.p);
    REQUIRE(rs.length_after == rp.length_after);
    REQUIRE(rs.length_after >= shared);
    const auto after = share_.block_table(q.s);
    for (std::size_t j = 0; j < after.size(); ++j) REQUIRE(after[j] == before[j]);
    for (std::size_t j = after.size(); j < before.size(); ++j) m_release(before[j]);
    ++rounds_;
  }

  void op_release(std::size_t i) {
    release_share(seqs_[i]);
    plain_.release(seqs_[i].p);
    if (seqs_[i].prompt > 0 && chance(50))
      done_prompts_.emplace_back(seqs_[i].key, std::vector<std::int32_t>(seqs_[i].toks.begin(), seqs_[i].toks.begin() + seqs_[i].prompt));
    if (done_prompts_.size() > 16) done_prompts_.erase(done_prompts_.begin());
    seqs_.erase(seqs_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  // ---- checks --------------------------------------------------------------------------------

  void check_refs_and_chains() {
    for (int b = 0; b < cfg_.num_blocks; ++b)
      if (share_.allocator().ref_count(b) != refs_[static_cast<std::size_t>(b)]) {
        FAIL("block " << b << ": ref count " << share_.allocator().ref_count(b) << ", model "
                      << refs_[static_cast<std::size_t>(b)] << " after op " << op_);
      }
    const auto entries = share_.allocator().entries();
    REQUIRE(entries.size() == by_block_.size());
    for (const auto& e : entries) {
      const auto it = by_block_.find(e.block);
      REQUIRE(it != by_block_.end());
      REQUIRE(it->second.parent == e.parent_block);
      REQUIRE(it->second.key == e.key);
      REQUIRE(std::equal(e.tokens.begin(), e.tokens.end(), it->second.tokens.end() - cfg_.block_size));
    }
    REQUIRE(share_.allocator().prefix_stats().idle_blocks == idle_count());
    REQUIRE(share_.memory().blocks_free == inner_free() + idle_count());
    if constexpr (!kStatic) triattn::vmm::check_consistent(share_.allocator());
  }

  void check_contents() {
    const auto vs = share_.template view<float>();
    const auto vp = plain_.template view<float>();
    const auto& g = cfg_.model;
    for (const Seq& q : seqs_) {
      const int len = share_.physical_length(q.s);
      REQUIRE(len == plain_.physical_length(q.p));
      REQUIRE(share_.logical_position(q.s) == plain_.logical_position(q.p));
      REQUIRE(share_.prompt_length(q.s) == plain_.prompt_length(q.p));
      for (int j = 0; j < len; ++j)
        for (int l = 0; l < g.num_layers; ++l)
          for (int kind = 0; kind < 2; ++kind)
            for (int h = 0; h < g.num_kv_heads; ++h)
              if (std::memcmp(vs.token(l, static_cast<KvKind>(kind), q.s, j, h), vp.token(l, static_cast<KvKind>(kind), q.p, j, h),
                              sizeof(float) * static_cast<std::size_t>(g.head_dim)) != 0)
                FAIL("sequence " << q.s << " slot " << j << " layer " << l << " differs from the run without sharing (op " << op_ << ")");
    }
    // Every cached block holds the K/V of its chain's tokens.
    for (const auto& [b, e] : by_block_) {
      std::uint64_t ph = 0x1234;
      std::vector<std::uint64_t> hs;
      for (const std::int32_t t : e.tokens) hs.push_back(ph = triattn::mix64(ph ^ static_cast<std::uint32_t>(t)));
      const int base = static_cast<int>(e.tokens.size()) - cfg_.block_size;
      for (int i = 0; i < cfg_.block_size; ++i)
        for (int l = 0; l < g.num_layers; ++l)
          for (int kind = 0; kind < 2; ++kind)
            for (int h = 0; h < g.num_kv_heads; ++h)
              for (int d = 0; d < g.head_dim; ++d) {
                const float* p = vs.range(l, static_cast<KvKind>(kind)) + vs.block.offset(b, i, h);
                if (p[d] != kv_value(hs[static_cast<std::size_t>(base + i)], base + i, l, kind, h, d))
                  FAIL("cached block " << b << " slot " << i << " does not hold its chain's K/V (op " << op_ << ")");
              }
    }
  }

  void run(int ops, const char* name) {
    const auto t0 = std::chrono::steady_clock::now();
    for (op_ = 0; op_ < ops; ++op_) {
      const int r = rand(0, 99);
      if (r < 18 || seqs_.empty()) op_arrive();
      else if (r < 78) op_decode(seqs_[static_cast<std::size_t>(rand(0, static_cast<int>(seqs_.size()) - 1))]);
      else if (r < 90) op_compress(seqs_[static_cast<std::size_t>(rand(0, static_cast<int>(seqs_.size()) - 1))]);
      else op_release(static_cast<std::size_t>(rand(0, static_cast<int>(seqs_.size()) - 1)));
      if constexpr (!kStatic) {
        if (chance(5)) {  // give idle blocks back explicitly, so that slabs empty and growth (with faults) recurs
          const std::uint64_t ev = share_.allocator().prefix_stats().evicted_blocks;
          (void)share_.allocator().evict_idle(static_cast<std::size_t>(rand(0, 16)));
          sync_evictions(ev, std::nullopt);
        }
        if (chance(10)) (void)share_.allocator().trim();
        if (chance(1)) (void)share_.allocator().set_memory_limit(static_cast<std::size_t>(rand(1, 4)) * slab_bytes_);
      }
      check_refs_and_chains();
      if (op_ % 97 == 0) check_contents();
    }
    check_contents();
    while (!seqs_.empty()) op_release(0);
    check_refs_and_chains();
    share_.allocator().evict_idle();
    CHECK(share_.allocator().inner_type::num_free() == static_cast<std::size_t>(cfg_.num_blocks));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[prefix soak] %s: %d ops in %.1f s; hit tokens %llu, computed prompt tokens %llu, evicted %llu, "
                "copy-on-write %llu, shared at publish %llu, rounds %llu, refused %llu, driver faults %llu\n",
                name, ops, s, static_cast<unsigned long long>(hits_), static_cast<unsigned long long>(computed_),
                static_cast<unsigned long long>(evictions_), static_cast<unsigned long long>(cows_),
                static_cast<unsigned long long>(shared_on_publish_), static_cast<unsigned long long>(rounds_), static_cast<unsigned long long>(refused_),
                static_cast<unsigned long long>(faults_));
    if constexpr (!kStatic) {
      const auto c = share_.allocator().stats().counters;
      std::printf("[prefix soak] %s: slabs mapped %llu, unmapped %llu, rollbacks %llu, limit refusals %llu\n", name,
                  static_cast<unsigned long long>(c.slabs_mapped), static_cast<unsigned long long>(c.slabs_unmapped),
                  static_cast<unsigned long long>(c.rollbacks), static_cast<unsigned long long>(c.fail_memory_limit));
      CHECK(faults_ > 0);
      CHECK(c.rollbacks > 0);
    }
    CHECK(hits_ > 0);
    CHECK(evictions_ > 0);
    CHECK(cows_ > 0);
    CHECK(shared_on_publish_ > 0);
    CHECK(rounds_ > 0);
  }

 private:
  CacheConfig cfg_;
  std::mt19937_64 rng_;
  Sharing share_;
  Plain plain_;
  std::vector<int> refs_;
  std::map<std::int32_t, Entry> by_block_;
  std::map<std::pair<std::uint64_t, std::vector<std::int32_t>>, std::int32_t> by_chain_;
  std::vector<Seq> seqs_;
  std::vector<std::vector<std::int32_t>> systems_;
  std::vector<std::pair<std::uint64_t, std::vector<std::int32_t>>> done_prompts_;
  std::uint64_t clock_ = 0, hits_ = 0, computed_ = 0, evictions_ = 0, cows_ = 0, rounds_ = 0, refused_ = 0, faults_ = 0;
  std::uint64_t shared_on_publish_ = 0;  // prompt blocks computed twice, shared at publish_prompt
  int op_ = 0;

 public:
  std::size_t slab_bytes_ = 0;  // VMM: bytes of one slab over all ranges (limit steps)
};

CacheConfig share_config(int num_blocks) {
  CacheConfig c;
  c.model = {2, 4, 2, 4};
  c.block_size = 4;
  c.num_blocks = num_blocks;
  c.max_seqs = 10;
  c.max_blocks_per_seq = 24;
  c.dtype = DType::kF32;
  return c;
}
CacheConfig plain_config() {
  CacheConfig c = share_config(10 * 24);
  return c;
}
triattn::SelectionParams selection(PromptMode m) {
  triattn::SelectionParams s;
  s.budget = 20;
  s.divide_length = 6;
  s.prompt = m;
  return s;
}

}  // namespace

TEST_CASE("prefix cache soak: static pool against the plain model and a run without sharing") {
  const std::uint64_t seed = soak_seed();
  const triattn::WarningHandler quiet = triattn::set_warning_handler([](std::string_view) {});
  for (const PromptMode m : {PromptMode::kPinnedInBudget, PromptMode::kPinnedOnTop, PromptMode::kCompete}) {
    CAPTURE(seed);
    CAPTURE(triattn::to_string(m));
    const CacheConfig cfg = share_config(56);
    Soak<StaticPC> soak(cfg, plain_config(), StaticPC(cfg), selection(m), seed + static_cast<int>(m));
    soak.run(soak_ops() / 3, (std::string("static ") + triattn::to_string(m)).c_str());
  }
  triattn::set_warning_handler(quiet);
}

TEST_CASE("prefix cache soak: VMM allocator over the fake driver with a memory limit and faults") {
  const std::uint64_t seed = soak_seed();
  const triattn::WarningHandler quiet = triattn::set_warning_handler([](std::string_view) {});
  CAPTURE(seed);
  const CacheConfig cfg = share_config(256);
  triattn::vmm::FakeDriverOptions fo;
  fo.granularity = 4096;
  fo.host_backed = true;
  triattn::vmm::VmmOptions vo;
  vo.error_hook = [](const std::string&) {};
  VmmPC alloc(cfg, vo, triattn::vmm::FakeDriver(fo));
  // 128-byte blocks: 32 per slab (4 ranges x 4 KiB); two slabs = 64 blocks.
  (void)alloc.set_memory_limit(2 * 4 * 4096);
  Soak<VmmPC> soak(cfg, plain_config(), std::move(alloc), selection(PromptMode::kPinnedInBudget), seed + 7);
  soak.slab_bytes_ = 4 * 4096;
  soak.run(soak_ops(), "vmm pinned_in_budget");
  triattn::set_warning_handler(quiet);
}

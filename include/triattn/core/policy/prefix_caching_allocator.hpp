// SPDX-License-Identifier: Apache-2.0
// PrefixCachingAllocator<Inner>: an allocator policy that wraps any block allocator
// (StaticAllocator, VmmAllocatorCore, cuda::VmmBlockAllocator...) and keeps full blocks of prompt
// tokens after their request ends, for later requests whose prompts start with the same tokens.
// The index is a chain of entries, one per cached block, each keyed by a 64-bit hash of (its
// parent's hash, the engine's extra key, its block_size token ids). A hit compares the stored
// parent, key and token ids, so a hash collision is a miss, never a wrong block. The index holds
// one reference on every cached block; a block only the index holds is idle. When an allocation
// finds no free block, idle blocks are evicted least recently used first, leaves first along
// their chains, and go back to the inner allocator like any freed block (the VMM allocator unmaps
// their pages at its next trim()). core/prefix_cache.hpp admits and publishes prompts through it.
//
// Error model: lookups are read-only; insert() checks everything before it changes anything and
// leaves the index as it was when it throws (logic_error naming the input). Eviction inside
// allocate() gives idle blocks back and is not undone when the allocation still fails (the inner
// allocator's own outcome: false, nothing else changed).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/hash.hpp>

namespace triattn {

/// Hash of one cached block: its parent's hash (kPrefixRootHash for the first block), the
/// engine's extra key (LoRA id, tenant, ...) and its token ids. Each token goes through mix64,
/// a bijection with full avalanche, so equal hashes of different chains are chance events.
inline constexpr std::uint64_t kPrefixRootHash = 0x6a09e667f3bcc908ULL;
[[nodiscard]] inline std::uint64_t prefix_block_hash(std::uint64_t parent, std::uint64_t key,
                                                     std::span<const std::int32_t> tokens) noexcept {
  std::uint64_t h = mix64(parent ^ mix64(key ^ 0xbb67ae8584caa73bULL));
  for (const std::int32_t t : tokens) h = mix64(h ^ static_cast<std::uint32_t>(t));
  return h;
}

struct PrefixCacheOptions {
  /// Bits of the block hash that are used (64 in production). Fewer bits make collisions common,
  /// which is how tests exercise the collision path.
  int hash_bits = 64;
};

/// Counters since construction.
struct PrefixCacheStats {
  std::uint64_t lookups = 0;          ///< admit_prompt calls
  std::uint64_t hit_blocks = 0;       ///< cached blocks shared by admitted sequences
  std::uint64_t hit_tokens = 0;       ///< prompt tokens not computed thanks to hits
  std::uint64_t inserted_blocks = 0;  ///< blocks that entered the cache
  std::uint64_t evicted_blocks = 0;   ///< idle blocks given back under memory pressure
  std::uint64_t collisions = 0;       ///< inserts stopped by a hash equal to another chain's
  std::size_t cached_blocks = 0;      ///< blocks the cache holds now
  std::size_t idle_blocks = 0;        ///< of which no sequence uses (evictable)
};

/// Longest cached chain for a prompt (read-only result of match()).
struct PrefixMatch {
  std::vector<std::int32_t> blocks;   ///< block ids, chain order
  std::vector<std::int32_t> entries;  ///< index entries, chain order
  [[nodiscard]] int num_blocks() const noexcept { return static_cast<int>(blocks.size()); }
};

template <class Inner>
class PrefixCachingAllocator : public Inner {
  static_assert(BlockAllocator<Inner>, "PrefixCachingAllocator<Inner>: Inner must be a block allocator");

 public:
  using inner_type = Inner;

  /// Builds the inner allocator from (cfg, args...) and an empty index.
  template <class... Args>
  explicit PrefixCachingAllocator(const CacheConfig& cfg, Args&&... args)
      : PrefixCachingAllocator(PrefixCacheOptions{}, cfg, std::forward<Args>(args)...) {}
  template <class... Args>
  PrefixCachingAllocator(const PrefixCacheOptions& opt, const CacheConfig& cfg, Args&&... args)
      : Inner(cfg, std::forward<Args>(args)...),
        block_size_(cfg.block_size),
        hash_mask_(checked_mask(opt.hash_bits)),
        entry_of_block_(Inner::capacity(), -1) {
    free_ids_.reserve(Inner::capacity());
  }

  // ---- BlockAllocator (what KvCache calls) ----------------------------------------------------

  /// All-or-nothing like Inner::allocate. When Inner has too few blocks, idle cached blocks are
  /// evicted (least recently used, leaves first) until it has enough; false when even all of
  /// them would not do (then nothing is evicted) or Inner still refuses.
  [[nodiscard]] bool allocate(std::span<std::int32_t> out) {
    if (Inner::allocate(out)) return true;
    const std::size_t n = out.size();
    if (idle_.empty() || Inner::num_free() + idle_count_ < n) return false;
    // Exactly the missing blocks first (enough for a static pool), then up to n in all: n freed
    // blocks sit on mapped memory, so an elastic allocator needs no growth for them.
    std::size_t evicted = 0;
    const std::size_t first = n > Inner::num_free() ? n - Inner::num_free() : 1;
    for (; evicted < first && !idle_.empty(); ++evicted) evict_one();
    if (Inner::allocate(out)) return true;
    for (; evicted < n && !idle_.empty(); ++evicted) evict_one();
    return Inner::allocate(out);
  }
  void retain(std::int32_t b) {
    Inner::retain(b);
    if (const int e = entry_of(b); e >= 0 && Inner::ref_count(b) == 2) {  // idle until now
      idle_.erase(idle_key(e));
      --idle_count_;
    }
  }
  bool release(std::int32_t b) {
    const bool freed = Inner::release(b);
    if (const int e = entry_of(b); e >= 0 && Inner::ref_count(b) == 1) {
      entries_[static_cast<std::size_t>(e)].last_used = ++clock_;  // its last user just left
      ++idle_count_;
      if (entries_[static_cast<std::size_t>(e)].children == 0) idle_.insert(idle_key(e));
    }
    return freed;
  }
  /// Blocks in use or cached (what the inner allocator holds): capacity() - Inner::num_free().
  [[nodiscard]] std::size_t blocks_held() const noexcept { return Inner::capacity() - Inner::num_free(); }
  /// Free blocks plus idle cached blocks: what allocate() can hand out. Every idle block can be
  /// evicted: a sequence that uses a cached block uses all of its ancestors too.
  [[nodiscard]] std::size_t num_free() const noexcept { return Inner::num_free() + idle_count_; }

  // ---- the index ------------------------------------------------------------------------------

  [[nodiscard]] int block_size() const noexcept { return block_size_; }

  /// Longest chain of cached blocks equal to the leading full blocks of `tokens` under `key`.
  /// Read-only (no recency update).
  [[nodiscard]] PrefixMatch match(std::span<const std::int32_t> tokens, std::uint64_t key) const {
    PrefixMatch m;
    std::uint64_t parent_hash = kPrefixRootHash;
    int parent = -1;
    for (std::size_t j = 0; (j + 1) * static_cast<std::size_t>(block_size_) <= tokens.size(); ++j) {
      const auto blk = tokens.subspan(j * static_cast<std::size_t>(block_size_), static_cast<std::size_t>(block_size_));
      const std::uint64_t h = hash(parent_hash, key, blk);
      const auto it = by_hash_.find(h);
      if (it == by_hash_.end() || !same_entry(it->second, parent, key, blk)) break;
      m.entries.push_back(it->second);
      m.blocks.push_back(entries_[static_cast<std::size_t>(it->second)].block);
      parent = it->second;
      parent_hash = h;
    }
    return m;
  }

  /// Marks the first `nblocks` entries of `m` as just used (they are now a sequence's).
  void touch(const PrefixMatch& m, int nblocks) noexcept {
    for (int j = 0; j < nblocks; ++j) entries_[static_cast<std::size_t>(m.entries[static_cast<std::size_t>(j)])].last_used = ++clock_;
  }

  /// Enters blocks[0..nblocks) holding the full blocks of tokens[0 .. nblocks·block_size) under
  /// `key`. Blocks already cached for that chain stay as they are; the insert stops at a block
  /// whose content is cached in another block (computed twice) and at a hash equal to another
  /// chain's. New entries take one reference each.
  /// @return blocks of the chain that are cached after the call
  /// @throws logic_error (nothing changed) when a block is not live, is cached for other tokens,
  ///         or tokens/blocks are too short.
  int insert(std::span<const std::int32_t> tokens, std::uint64_t key, std::span<const std::int32_t> blocks, int nblocks) {
    TRIATTN_EXPECTS(nblocks >= 0 && static_cast<std::size_t>(nblocks) <= blocks.size() &&
                        static_cast<std::size_t>(nblocks) * static_cast<std::size_t>(block_size_) <= tokens.size(),
                    "prefix cache insert: " + std::to_string(nblocks) + " blocks need " + std::to_string(nblocks) +
                        " block ids and " + std::to_string(static_cast<std::int64_t>(nblocks) * block_size_) +
                        " tokens, got " + std::to_string(blocks.size()) + " and " + std::to_string(tokens.size()));
    // Plan without changing anything: which blocks become new entries under which parent.
    struct New {
      std::uint64_t hash;
      int parent;  // entry id, or -(k + 2) for the k-th new entry of this call
      std::size_t j;
    };
    std::vector<New> plan;
    // Hashes and blocks the plan already takes: a repeat inside the chain is found in O(1), so an
    // insert is linear in the chain (page size 1 makes chains of 10^5 blocks).
    std::unordered_set<std::uint64_t> plan_hashes;
    std::unordered_set<std::int32_t> plan_blocks;
    std::uint64_t parent_hash = kPrefixRootHash;
    int parent = -1;
    int cached = 0;
    bool collided = false;
    for (int j = 0; j < nblocks; ++j) {
      const std::int32_t b = blocks[static_cast<std::size_t>(j)];
      TRIATTN_EXPECTS(b >= 0 && static_cast<std::size_t>(b) < Inner::capacity() && Inner::ref_count(b) > 0,
                      "prefix cache insert: block " + std::to_string(b) + " (chain position " + std::to_string(j) +
                          ") is not a live block");
      const auto blk = tokens.subspan(static_cast<std::size_t>(j) * block_size_, static_cast<std::size_t>(block_size_));
      const std::uint64_t h = hash(parent_hash, key, blk);
      const int own = entry_of(b);
      if (const auto it = by_hash_.find(h); it != by_hash_.end()) {
        if (!same_entry(it->second, parent, key, blk)) {  // another chain's hash (a new parent never matches)
          collided = true;
          break;
        }
        TRIATTN_EXPECTS(own < 0 || own == it->second,
                        "prefix cache insert: block " + std::to_string(b) + " is cached for other tokens");
        // Cached in another block (computed twice): stop, so that a block some sequence uses
        // always has every ancestor used by it too, and idle blocks are exactly the evictable ones.
        if (entries_[static_cast<std::size_t>(it->second)].block != b) break;
        parent = it->second;
        parent_hash = h;
        ++cached;
        continue;
      }
      TRIATTN_EXPECTS(own < 0, "prefix cache insert: block " + std::to_string(b) + " is cached for other tokens");
      if (plan_hashes.count(h) != 0 || plan_blocks.count(b) != 0) {
        collided = true;  // a hash (or block) repeated inside this chain: stop like any collision
        break;
      }
      plan_hashes.insert(h);
      plan_blocks.insert(b);
      plan.push_back(New{h, parent, static_cast<std::size_t>(j)});
      parent = -static_cast<int>(plan.size()) - 1;
      parent_hash = h;
      ++cached;
    }
    // Commit. Everything that can throw comes first and is undone on failure: entry slots (reused
    // from evicted entries, else appended) and the hash map's nodes.
    const std::size_t old_size = entries_.size();
    const std::size_t reuse = std::min(free_ids_.size(), plan.size());
    std::vector<int> ids(plan.size());
    try {
      entries_.resize(old_size + plan.size() - reuse);
      tokens_.resize(entries_.size() * static_cast<std::size_t>(block_size_));
      by_hash_.reserve(by_hash_.size() + plan.size());
    } catch (...) {
      entries_.resize(old_size);
      tokens_.resize(old_size * static_cast<std::size_t>(block_size_));
      throw;
    }
    for (std::size_t k = 0; k < plan.size(); ++k)
      ids[k] = k < reuse ? free_ids_[free_ids_.size() - 1 - k] : static_cast<int>(old_size + (k - reuse));
    std::size_t mapped = 0;
    try {
      for (; mapped < plan.size(); ++mapped) by_hash_.emplace(plan[mapped].hash, ids[mapped]);
    } catch (...) {
      for (std::size_t k = 0; k < mapped; ++k) by_hash_.erase(plan[k].hash);
      entries_.resize(old_size);
      tokens_.resize(old_size * static_cast<std::size_t>(block_size_));
      throw;
    }
    free_ids_.resize(free_ids_.size() - reuse);
    for (std::size_t k = 0; k < plan.size(); ++k) {
      const New& x = plan[k];
      const int id = ids[k];
      const int p = x.parent >= -1 ? x.parent : ids[static_cast<std::size_t>(-x.parent - 2)];
      const std::int32_t b = blocks[x.j];
      entries_[static_cast<std::size_t>(id)] = Entry{x.hash, key, p, b, 0, ++clock_};
      std::copy_n(tokens.begin() + static_cast<std::ptrdiff_t>(x.j * static_cast<std::size_t>(block_size_)), block_size_,
                  tokens_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(id) * block_size_));
      Inner::retain(b);
      entry_of_block_[static_cast<std::size_t>(b)] = id;
      if (p >= 0) {
        idle_.erase(idle_key(p));
        ++entries_[static_cast<std::size_t>(p)].children;
      }
      ++live_;
    }
    // A new entry is a sequence's block (ref count 2 now): never idle here.
    stats_.inserted_blocks += plan.size();
    stats_.collisions += collided ? 1u : 0u;
    return cached;
  }

  /// Gives every idle block back (e.g. before a memory limit is lowered). @return blocks evicted
  std::size_t evict_idle(std::size_t max_blocks = static_cast<std::size_t>(-1)) {
    std::size_t k = 0;
    for (; k < max_blocks && !idle_.empty(); ++k) evict_one();
    return k;
  }

  /// Whether `block` is in the cache.
  [[nodiscard]] bool is_cached(std::int32_t block) const noexcept { return entry_of(block) >= 0; }
  /// Idle cached leaves in eviction order (next victim first; its parent may follow). O(idle).
  [[nodiscard]] std::vector<std::int32_t> idle_blocks_in_eviction_order() const {
    std::vector<std::int32_t> out;
    for (const auto& k : idle_) out.push_back(entries_[static_cast<std::size_t>(k.second)].block);
    return out;
  }
  /// Every cached chain entry as (block, parent block or -1, key, tokens), for checks and tools.
  struct EntryInfo {
    std::int32_t block;
    std::int32_t parent_block;
    std::uint64_t key;
    std::vector<std::int32_t> tokens;
  };
  [[nodiscard]] std::vector<EntryInfo> entries() const {
    std::vector<EntryInfo> out;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if (e.block < 0) continue;
      const auto* t = tokens_.data() + i * static_cast<std::size_t>(block_size_);
      out.push_back(EntryInfo{e.block, e.parent >= 0 ? entries_[static_cast<std::size_t>(e.parent)].block : -1, e.key,
                              std::vector<std::int32_t>(t, t + block_size_)});
    }
    return out;
  }

  [[nodiscard]] PrefixCacheStats prefix_stats() const noexcept {
    PrefixCacheStats s = stats_;
    s.cached_blocks = live_;
    s.idle_blocks = idle_count_;
    return s;
  }
  /// For admit_prompt: counts one lookup and its hit.
  void count_lookup(int hit_blocks, int hit_tokens) noexcept {
    ++stats_.lookups;
    stats_.hit_blocks += static_cast<std::uint64_t>(hit_blocks);
    stats_.hit_tokens += static_cast<std::uint64_t>(hit_tokens);
  }

 private:
  struct Entry {
    std::uint64_t hash;
    std::uint64_t key;
    int parent;            // entry id, -1 for a first block
    std::int32_t block;    // -1 once evicted (the slot is reused)
    int children;          // cached entries whose parent this is
    std::uint64_t last_used;
  };
  using IdleKey = std::pair<std::uint64_t, int>;  // (last_used, entry): oldest first

  static std::uint64_t checked_mask(int bits) {
    TRIATTN_EXPECTS(bits >= 1 && bits <= 64, "PrefixCacheOptions::hash_bits = " + std::to_string(bits) + " must be in [1, 64]");
    return bits == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1;
  }
  std::uint64_t hash(std::uint64_t parent, std::uint64_t key, std::span<const std::int32_t> t) const noexcept {
    return prefix_block_hash(parent, key, t) & hash_mask_;
  }
  int entry_of(std::int32_t b) const noexcept {
    return b >= 0 && static_cast<std::size_t>(b) < entry_of_block_.size() ? entry_of_block_[static_cast<std::size_t>(b)] : -1;
  }
  IdleKey idle_key(int e) const noexcept { return {entries_[static_cast<std::size_t>(e)].last_used, e}; }
  bool same_entry(int id, int parent, std::uint64_t key, std::span<const std::int32_t> blk) const noexcept {
    const Entry& e = entries_[static_cast<std::size_t>(id)];
    const auto* t = tokens_.data() + static_cast<std::size_t>(id) * static_cast<std::size_t>(block_size_);
    return e.parent == parent && e.key == key && std::equal(blk.begin(), blk.end(), t);
  }

  // Evicts the least recently used idle leaf; its parent may become an idle leaf.
  void evict_one() {
    const int id = idle_.begin()->second;
    idle_.erase(idle_.begin());
    Entry& e = entries_[static_cast<std::size_t>(id)];
    by_hash_.erase(e.hash);
    const std::int32_t b = e.block;
    entry_of_block_[static_cast<std::size_t>(b)] = -1;
    if (e.parent >= 0) {
      Entry& p = entries_[static_cast<std::size_t>(e.parent)];
      if (--p.children == 0 && Inner::ref_count(p.block) == 1) idle_.insert(idle_key(e.parent));
    }
    e.block = -1;
    --idle_count_;
    free_ids_.push_back(id);  // capacity: at most one entry per block, reserved in the constructor
    --live_;
    ++stats_.evicted_blocks;
    (void)Inner::release(b);
  }

  int block_size_;
  std::uint64_t hash_mask_;
  std::vector<Entry> entries_;             // entry slots (evicted ones keep block = -1)
  std::vector<std::int32_t> tokens_;       // [entries, block_size] token ids of each entry
  std::unordered_map<std::uint64_t, int> by_hash_;
  std::vector<int> entry_of_block_;        // [capacity] entry caching the block, or -1
  std::vector<int> free_ids_;              // entry slots of evicted entries, reused first
  std::set<IdleKey> idle_;                 // idle leaves, eviction order
  std::size_t idle_count_ = 0;             // cached blocks only the cache holds
  std::uint64_t clock_ = 0;
  std::size_t live_ = 0;
  PrefixCacheStats stats_;
};

}  // namespace triattn

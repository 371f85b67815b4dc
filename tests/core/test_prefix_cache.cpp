// SPDX-License-Identifier: Apache-2.0
// Prefix cache (core/prefix_cache.hpp) with KvCache: hits share blocks with reference counts,
// keys and token ids decide hits (hash collisions are misses), idle blocks are evicted least
// recently used and leaves first only when memory is needed, a partly shared block is copied on
// the first write past the shared tokens, compression rounds protect the shared prefix, and failed
// calls leave everything as it was.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/random_scorer.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/ref/select.hpp>

namespace {

using triattn::AppendStatus;
using triattn::CacheConfig;
using triattn::DType;
using triattn::KeepPlan;
using triattn::KvKind;
using triattn::Phase;
using triattn::SeqId;
using Alloc = triattn::PrefixCachingAllocator<triattn::StaticAllocator<triattn::HostBackend>>;
using Cache = triattn::KvCache<Alloc>;

constexpr int kBs = 4;

CacheConfig config(int num_blocks, int max_seqs = 8, DType dtype = DType::kF32) {
  CacheConfig c;
  c.model = {2, 4, 2, 8};
  c.block_size = kBs;
  c.num_blocks = num_blocks;
  c.max_seqs = max_seqs;
  c.dtype = dtype;
  if (dtype == DType::kFP8E4M3) c.kv_scales = {0.01f, 0.02f, 0.03f, 0.04f};  // [layer, K|V]
  return c;
}

std::vector<std::int32_t> iota_tokens(int n, int first) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// K/V of token p of a prompt: a function of the token ids up to p (as a model's K/V are).
float kv_value(std::span<const std::int32_t> toks, int p, int layer, int kind, int head, int d) {
  std::uint64_t h = 1469598103934665603ULL;
  for (int i = 0; i <= p; ++i) h = triattn::mix64(h ^ static_cast<std::uint32_t>(toks[static_cast<std::size_t>(i)]));
  h = triattn::mix64(h ^ static_cast<std::uint64_t>(((p * 4 + layer) * 2 + kind) * 64 + head * 16 + d));
  return static_cast<float>(h >> 40) / static_cast<float>(1 << 24);
}

template <class C>
void write_tokens(C& cache, SeqId s, std::span<const std::int32_t> toks, int first_slot, int first_pos, int n) {
  const auto& g = cache.config().model;
  std::vector<float> k(static_cast<std::size_t>(n) * g.num_kv_heads * g.head_dim), v(k.size());
  for (int l = 0; l < g.num_layers; ++l) {
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < g.num_kv_heads; ++h)
        for (int d = 0; d < g.head_dim; ++d) {
          const std::size_t i = (static_cast<std::size_t>(t) * g.num_kv_heads + h) * g.head_dim + d;
          k[i] = kv_value(toks, first_pos + t, l, 0, h, d);
          v[i] = kv_value(toks, first_pos + t, l, 1, h, d);
        }
    cache.write_values(s, l, first_slot, k.data(), v.data(), n);  // rounded to the cache's dtype
  }
}

// Admits `prompt` and prefills the rest; returns the admission (seq -1 when out of blocks).
triattn::PrefixAdmission serve(Cache& c, std::span<const std::int32_t> prompt, std::uint64_t key = 0, bool publish = true) {
  triattn::PrefixAdmission a = triattn::admit_prompt(c, prompt, key);
  const int rest = static_cast<int>(prompt.size()) - a.cached_tokens;
  const triattn::AppendResult r = c.extend(a.seq, rest, Phase::kPrefill);
  if (!r.ok()) {
    c.release(a.seq);
    a.seq = -1;
    return a;
  }
  write_tokens(c, a.seq, prompt, r.first_slot, a.cached_tokens, rest);
  if (publish) (void)triattn::publish_prompt(c, a.seq, prompt, key);
  return a;
}

// Whether slots [0, n) of `s` hold the K/V of `toks` as the cache's dtype stores them.
template <class C>
bool holds(const C& c, SeqId s, std::span<const std::int32_t> toks, int n) {
  return triattn::dispatch_dtype(c.config().dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto v = c.template view<T>();
    const auto& g = c.config().model;
    for (int p = 0; p < n; ++p)
      for (int l = 0; l < g.num_layers; ++l)
        for (int kind = 0; kind < 2; ++kind)
          for (int h = 0; h < g.num_kv_heads; ++h) {
            const float sc = v.scale(l, static_cast<KvKind>(kind), h);
            for (int d = 0; d < g.head_dim; ++d) {
              const T want = triattn::quantize<T>(kv_value(toks, p, l, kind, h, d), sc);
              if (std::memcmp(v.token(l, static_cast<KvKind>(kind), s, p, h) + d, &want, sizeof(T)) != 0) return false;
            }
          }
    return true;
  });
}

// What prefix_hit reads of a cache, for one whose compactor cannot copy blocks.
struct NoCopyCache {
  const Alloc& alloc;
  static constexpr bool copies_blocks = false;
  [[nodiscard]] const Alloc& allocator() const { return alloc; }
};

}  // namespace

TEST_CASE_TEMPLATE("prefix cache: a hit shares the cached blocks and computes only the rest", T, float,
                   triattn::fp8_e4m3_storage) {
  Cache c(config(32, 8, triattn::dtype_of<T>));
  const auto sys = iota_tokens(10, 100);  // 2 full blocks + 2 tokens
  std::vector<std::int32_t> p1 = sys, p2 = sys;
  for (int i = 0; i < 5; ++i) p1.push_back(7 + i), p2.push_back(50 + i);

  const auto a = serve(c, p1);
  CHECK(a.cached_tokens == 0);
  auto& pc = c.allocator();
  CHECK(pc.prefix_stats().cached_blocks == 3);  // 15 tokens: 3 full blocks published
  const auto t1 = std::vector<std::int32_t>(c.block_table(a.seq).begin(), c.block_table(a.seq).end());
  for (int j = 0; j < 3; ++j) CHECK(c.allocator().ref_count(t1[static_cast<std::size_t>(j)]) == 2);
  CHECK(c.allocator().ref_count(t1[3]) == 1);

  const auto b = serve(c, p2);
  CHECK(b.cached_tokens == 8);  // the two blocks of the system prompt
  CHECK(b.hit_blocks == 2);
  const auto t2 = c.block_table(b.seq);
  CHECK(t2[0] == t1[0]);
  CHECK(t2[1] == t1[1]);
  CHECK(t2[2] != t1[2]);
  CHECK(c.allocator().ref_count(t1[0]) == 3);
  CHECK(holds(c, a.seq, p1, 15));
  CHECK(holds(c, b.seq, p2, 15));
  CHECK(c.shared_prefix(b.seq) == 12);  // its third block was published too
  CHECK(pc.prefix_stats().hit_tokens == 8);

  // Another key (e.g. a LoRA adapter) never hits.
  const auto k = serve(c, p2, /*key=*/7, /*publish=*/false);
  CHECK(k.cached_tokens == 0);
  // A prompt of 3 full cached blocks: all but its last token come from the cache; the third
  // block is shared partly and copied on the first write (the cached one stays as it was).
  const std::vector<std::int32_t> p3(p2.begin(), p2.begin() + 12);
  const auto again = serve(c, p3, 0, false);
  CHECK(again.cached_tokens == 11);
  CHECK(holds(c, again.seq, p3, 12));
  CHECK(c.block_table(again.seq)[2] != c.block_table(b.seq)[2]);
  CHECK(c.block_table(again.seq)[1] == c.block_table(b.seq)[1]);
  CHECK(holds(c, b.seq, p2, 15));
  CHECK(c.shared_prefix(again.seq) == 8);

  c.release(a.seq);
  c.release(b.seq);
  c.release(k.seq);
  c.release(again.seq);
  // Released blocks stay cached (held only by the cache: idle) until memory is needed.
  CHECK(pc.prefix_stats().cached_blocks == 4);
  CHECK(pc.prefix_stats().idle_blocks == 4);
  CHECK(pc.idle_blocks_in_eviction_order().size() == 2);  // leaves: p1's and p2's third blocks
  CHECK(c.memory().blocks_free == 32);       // idle blocks count as free (allocate() evicts them)
  CHECK(c.allocator().inner_type::num_free() == 28);
}

TEST_CASE("prefix cache: prefix_hit reports what admit_prompt shares and changes nothing") {
  Cache c(config(32));
  const auto sys = iota_tokens(10, 100);  // 2 full blocks + 2 tokens
  std::vector<std::int32_t> p1 = sys, p2 = sys;
  for (int i = 0; i < 5; ++i) p1.push_back(7 + i), p2.push_back(50 + i);
  const auto a = serve(c, p1);  // publishes p1's 3 full blocks
  const auto& pc = c.allocator();
  const auto before = pc.prefix_stats();
  const auto order = pc.idle_blocks_in_eviction_order();

  const triattn::PrefixHit h = triattn::prefix_hit(c, p2);
  CHECK(h.match.num_blocks() == 2);
  CHECK(h.cached_tokens == 8);
  CHECK(h.blocks == 2);
  CHECK(h.match.blocks[0] == c.block_table(a.seq)[0]);
  CHECK(h.match.blocks[1] == c.block_table(a.seq)[1]);
  // Read-only: no lookup counted, no sequence opened, recency unchanged.
  CHECK(pc.prefix_stats().lookups == before.lookups);
  CHECK(pc.prefix_stats().hit_tokens == before.hit_tokens);
  CHECK(c.memory().blocks_free == 32 - 4);
  CHECK(pc.idle_blocks_in_eviction_order() == order);

  const auto b = serve(c, p2, 0, false);
  CHECK(b.cached_tokens == h.cached_tokens);
  CHECK(b.hit_blocks == h.blocks);
  // Three full cached blocks: the last prompt token is computed, the third block is shared partly.
  const std::vector<std::int32_t> p3(p1.begin(), p1.begin() + 12);
  const triattn::PrefixHit h3 = triattn::prefix_hit(c, p3);
  CHECK(h3.match.num_blocks() == 3);
  CHECK(h3.cached_tokens == 11);
  CHECK(h3.blocks == 3);
  // A cache that cannot copy blocks shares whole blocks only.
  const triattn::PrefixHit whole = triattn::prefix_hit(NoCopyCache{pc}, p3);
  CHECK(whole.cached_tokens == 8);
  CHECK(whole.blocks == 2);
  CHECK(triattn::prefix_hit(c, p2, /*key=*/7).blocks == 0);
  CHECK_THROWS_AS((void)triattn::prefix_hit(c, std::span<const std::int32_t>{}), triattn::logic_error);
  c.release(a.seq);
  c.release(b.seq);
}

// Two requests with one prompt prefilled at once (neither hits: nothing is cached yet) compute it
// twice. Publishing the second must share the first's cached blocks (its own go back to the
// pool), so that both prompts are cached and protected from rounds as each would be alone.
TEST_CASE("prefix cache: a prompt computed twice is shared at publish and its duplicate blocks freed") {
  Cache c(config(32));
  std::vector<std::int32_t> prompt = iota_tokens(10, 3);  // 2 full blocks + 2 tokens
  const auto a = serve(c, prompt, 0, false);
  const auto b = serve(c, prompt, 0, false);
  REQUIRE(a.cached_tokens == 0);
  REQUIRE(b.cached_tokens == 0);
  const std::vector<std::int32_t> a_blocks(c.block_table(a.seq).begin(), c.block_table(a.seq).end());
  const std::vector<std::int32_t> b_blocks(c.block_table(b.seq).begin(), c.block_table(b.seq).end());
  CHECK(c.memory().blocks_free == 32 - 6);
  CHECK(triattn::publish_prompt(c, a.seq, prompt) == 2);
  CHECK(c.shared_prefix(a.seq) == 2 * kBs);  // the prefix cache holds its two full blocks
  CHECK(c.shared_prefix(b.seq) == 0);
  CHECK(triattn::publish_prompt(c, b.seq, prompt) == 2);
  const auto now = c.block_table(b.seq);
  CHECK(now[0] == a_blocks[0]);
  CHECK(now[1] == a_blocks[1]);
  CHECK(now[2] == b_blocks[2]);  // the partial block stays its own
  CHECK(c.shared_prefix(b.seq) == 2 * kBs);
  CHECK(c.allocator().ref_count(a_blocks[0]) == 3);  // a, b and the prefix cache
  CHECK(c.allocator().ref_count(b_blocks[0]) == 0);
  CHECK(c.allocator().ref_count(b_blocks[1]) == 0);
  CHECK(c.memory().blocks_free == 32 - 4);
  CHECK(holds(c, b.seq, prompt, 10));
  // Publishing again changes nothing.
  CHECK(triattn::publish_prompt(c, b.seq, prompt) == 2);
  CHECK(c.memory().blocks_free == 32 - 4);
  // share_block refuses what it cannot do, and changes nothing then.
  CHECK_THROWS_AS(c.share_block(b.seq, 2, a_blocks[2]), triattn::logic_error);   // block 2 is not full
  CHECK_THROWS_AS(c.share_block(b.seq, -1, a_blocks[0]), triattn::logic_error);
  CHECK_THROWS_AS(c.share_block(b.seq, 0, b_blocks[0]), triattn::logic_error);  // a free block
  CHECK_THROWS_AS(c.share_block(b.seq, 0, 32), triattn::logic_error);
  CHECK(c.block_table(b.seq)[0] == a_blocks[0]);
  c.release(a.seq);
  c.release(b.seq);
  CHECK(c.memory().blocks_free == 32);  // the two cached blocks are idle, so they count as free
}

TEST_CASE("prefix cache: idle blocks are evicted least recently used and leaves first only when needed") {
  Cache c(config(12));
  auto& pc = c.allocator();
  const auto pa = iota_tokens(9, 0), pb = iota_tokens(9, 1000), pcp = iota_tokens(9, 2000);
  const SeqId a = serve(c, pa).seq;
  const SeqId b = serve(c, pb).seq;
  const auto ta = std::vector<std::int32_t>(c.block_table(a).begin(), c.block_table(a).end());
  const auto tb = std::vector<std::int32_t>(c.block_table(b).begin(), c.block_table(b).end());
  c.release(a);  // a's chain becomes idle first
  c.release(b);
  CHECK(pc.idle_blocks_in_eviction_order() == std::vector<std::int32_t>{ta[1], tb[1]});
  CHECK(pc.prefix_stats().cached_blocks == 4);
  // 12 blocks: 4 cached idle, 8 free. A 9-token prompt needs 3 blocks: no eviction.
  const SeqId s = serve(c, pcp).seq;
  CHECK(pc.prefix_stats().evicted_blocks == 0);
  // 5 free now; 7 tokens of decode more (2 blocks) fit; 24 more tokens need 6: evict a's chain
  // leaf first (a1, then a0 which became a leaf), then... exactly the missing one.
  REQUIRE(c.extend(s, 3).ok());  // 12 tokens, still 3 blocks
  const auto r = c.extend(s, 24);  // 6 blocks, 5 free (+4 idle)
  REQUIRE(r.ok());
  CHECK(pc.prefix_stats().evicted_blocks == 1);
  CHECK(!pc.is_cached(ta[1]));
  CHECK(pc.is_cached(ta[0]));
  CHECK(pc.idle_blocks_in_eviction_order() == std::vector<std::int32_t>{ta[0], tb[1]});
  // Too much even with every idle block: refused, nothing evicted.
  const auto before = pc.prefix_stats();
  const auto too_much = c.extend(s, 4 * 4 + 1);
  CHECK(too_much.status == AppendStatus::kOutOfBlocks);
  CHECK(pc.prefix_stats().evicted_blocks == before.evicted_blocks);
  CHECK(pc.prefix_stats().cached_blocks == 5);  // s published its 2 full prompt blocks
  // A hit on b's chain makes it recently used: a0 goes next, then b's leaf.
  const SeqId b2 = triattn::admit_prompt(c, pb).seq;
  c.release(b2);
  CHECK(pc.idle_blocks_in_eviction_order() == std::vector<std::int32_t>{ta[0], tb[1]});
  CHECK(c.extend(s, 4 * 3).ok());  // 3 blocks, 0 free: all 3 idle go (a0, b1, then b0)
  CHECK(pc.prefix_stats().cached_blocks == 2);
  CHECK(pc.prefix_stats().evicted_blocks == 4);
}

TEST_CASE("prefix cache: hash collisions are misses and never wrong hits") {
  // With 2 hash bits, almost every chain collides with another.
  CacheConfig cfg = config(200, 64);
  Cache c(cfg, Alloc(triattn::PrefixCacheOptions{2}, cfg));
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<SeqId> seqs;
  for (int i = 0; i < 24; ++i) {
    std::vector<std::int32_t> p = iota_tokens(8, 100 * (i % 6));  // 6 distinct first two blocks
    for (int j = 0; j < 5; ++j) p.push_back((i * 7 + j) % 11);
    prompts.push_back(p);
    const auto a = serve(c, p);
    REQUIRE(a.seq >= 0);
    seqs.push_back(a.seq);
  }
  CHECK(c.allocator().prefix_stats().collisions > 0);
  for (std::size_t i = 0; i < seqs.size(); ++i) CHECK(holds(c, seqs[i], prompts[i], 13));
  // Every cached entry's tokens are what its block holds.
  for (const auto& e : c.allocator().entries()) CHECK(e.tokens.size() == static_cast<std::size_t>(kBs));
}

TEST_CASE("prefix cache: failed calls leave everything as it was") {
  Cache c(config(10, 2));
  auto& pc = c.allocator();
  const auto p = iota_tokens(9, 0);
  const SeqId a = serve(c, p).seq;
  const SeqId b = triattn::admit_prompt(c, p).seq;  // 2 blocks shared
  const auto stats = pc.prefix_stats();
  const auto refs = [&] {
    std::vector<int> r;
    for (int i = 0; i < 10; ++i) r.push_back(c.allocator().ref_count(i));
    return r;
  };
  const auto r0 = refs();
  // No sequence slot left: admit throws, no reference taken, no recency change.
  CHECK_THROWS_AS((void)triattn::admit_prompt(c, p), triattn::logic_error);
  CHECK(refs() == r0);
  CHECK(pc.prefix_stats().lookups == stats.lookups);
  // Publishing tokens that disagree with what a block is cached for is refused, unchanged.
  std::vector<std::int32_t> wrong = p;
  wrong[1] = 99;
  CHECK_THROWS_AS((void)triattn::publish_prompt(c, b, wrong), triattn::logic_error);
  CHECK(refs() == r0);
  CHECK(pc.prefix_stats().cached_blocks == stats.cached_blocks);
  // Bad block lists for add_sequence.
  c.release(b);
  const std::int32_t live = c.block_table(a)[0];
  CHECK_THROWS_AS((void)c.add_sequence(std::span<const std::int32_t>(&live, 1), 5), triattn::logic_error);
  const std::int32_t dead = 9;
  REQUIRE(c.allocator().ref_count(dead) == 0);
  CHECK_THROWS_AS((void)c.add_sequence(std::span<const std::int32_t>(&dead, 1), 4), triattn::logic_error);
  CHECK(c.num_active() == 1);
}

TEST_CASE("prefix cache: compression protects the shared prefix and never writes a shared block") {
  CacheConfig cfg = config(64);
  triattn::SelectionParams sel;
  sel.budget = 10;
  sel.divide_length = 4;
  sel.prompt = triattn::PromptMode::kCompete;  // the prompt competes: only sharing protects it
  using TCache = triattn::KvCache<Alloc, triattn::RandomScorer, triattn::TopKSelector>;
  TCache c(cfg, triattn::RandomScorer(cfg, 5), triattn::TopKSelector(sel));
  const auto p = iota_tokens(13, 0);
  auto a = triattn::admit_prompt(c, p);
  REQUIRE(c.extend(a.seq, 13, Phase::kPrefill).ok());
  write_tokens(c, a.seq, p, 0, 0, 13);
  CHECK(triattn::publish_prompt(c, a.seq, p) == 3);
  auto b = triattn::admit_prompt(c, p);
  CHECK(b.cached_tokens == 12);
  REQUIRE(c.extend(b.seq, 1, Phase::kPrefill).ok());
  write_tokens(c, b.seq, p, 12, 12, 1);
  const auto shared = std::vector<std::int32_t>(c.block_table(a.seq).begin(), c.block_table(a.seq).begin() + 3);
  // Decode until rounds run; the three shared blocks are never selected away or rewritten.
  std::vector<std::int32_t> toks = p;
  for (int step = 0; step < 20; ++step) {
    toks.push_back(500 + step);
    const auto r = c.extend(b.seq, 1);
    REQUIRE(r.ok());
    write_tokens(c, b.seq, toks, r.first_slot, static_cast<int>(c.logical_position(b.seq)) - 1, 1);
    if (c.needs_compression(b.seq)) {
      CHECK(c.shared_prefix(b.seq) == 12);
      const auto rep = c.compress(b.seq);
      CHECK(rep.length_after == 12);  // budget 10 < 12 protected: only the shared prefix stays
    }
    for (int j = 0; j < 3; ++j) CHECK(c.block_table(b.seq)[static_cast<std::size_t>(j)] == shared[static_cast<std::size_t>(j)]);
  }
  CHECK(holds(c, a.seq, p, 13));
  CHECK(holds(c, b.seq, p, 12));
  // A plan that moves data into a shared block is refused.
  KeepPlan bad(2, 2, 12);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 12; ++i) bad.row(l, h)[i] = i + (i >= 5 ? 1 : 0);
  if (c.physical_length(b.seq) >= 13) CHECK_THROWS_AS(c.apply_keep_plan(b.seq, bad), triattn::logic_error);
  // The selector keeps the protected prefix in place with kPinnedOnTop counted on top.
  triattn::SelectionParams top = sel;
  top.prompt = triattn::PromptMode::kPinnedOnTop;
  const auto kc = triattn::ref::keep_counts(30, 13, top, 12);
  CHECK(kc.selectable_begin == 13);
  CHECK(kc.keep == 13 + 10);
  const auto kc2 = triattn::ref::keep_counts(30, 0, sel, 12);
  CHECK(kc2.selectable_begin == 12);
  CHECK(kc2.keep == 12);
}

// SPDX-License-Identifier: Apache-2.0
// KvCache<> on the CPU (StaticAllocator<HostBackend>, HostCompactor): sequences, prefill and
// decode appends, bookkeeping queries, keep-plan compaction (per (layer, KV head) subsets, both
// layouts, all three dtypes, page sizes 1, 7 and 16), release, fork_prefix sharing and memory
// accounting. Every K/V element written is a unique function of (sequence, token, layer, K|V,
// head, dim), and the tests read it back from the raw memory with addresses computed here from
// the layout definitions, independently of KvCacheView.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <triattn/core/hash.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/stats/random.hpp>

using namespace triattn;

namespace {

/// A cached token: which sequence created it (uid, never reused) and its logical index there.
struct Tok {
  std::uint32_t uid;
  std::int32_t idx;
  bool operator==(const Tok&) const = default;
  bool operator<(const Tok& o) const { return uid != o.uid ? uid < o.uid : idx < o.idx; }
};

/// Content of element d of token `t`'s head vector (layer, kind, head): a hash of all of them,
/// never NaN/Inf (so that even a float round trip would keep it), compared bit for bit.
template <class T>
T content(Tok t, int layer, int kind, int head, int d) {
  const std::uint64_t h = mix64(mix64(mix64(t.uid) ^ static_cast<std::uint64_t>(t.idx)) ^
                                (static_cast<std::uint64_t>(layer) << 40 | static_cast<std::uint64_t>(kind) << 32 |
                                 static_cast<std::uint64_t>(head) << 16 | static_cast<std::uint64_t>(d)));
  if constexpr (std::is_same_v<T, float>) {
    std::uint32_t b = static_cast<std::uint32_t>(h);
    if (((b >> 23) & 0xffu) == 0xffu) b ^= 0x40000000u;
    return std::bit_cast<float>(b);
  } else {
    std::uint16_t b = static_cast<std::uint16_t>(h);
    const std::uint16_t exp_mask = std::is_same_v<T, f16_storage> ? 0x7c00u : 0x7f80u;
    if ((b & exp_mask) == exp_mask) b ^= 0x4000u;
    return T{b};
  }
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// Element offset of (block, slot, head, 0) inside one range, from the layout definitions.
std::int64_t ref_offset(const CacheConfig& c, std::int64_t block, int slot, int head) {
  const int bs = c.block_size, H = c.model.num_kv_heads, D = c.model.head_dim;
  return c.layout == KvLayout::kNHD ? ((block * bs + slot) * H + head) * D : ((block * H + head) * bs + slot) * D;
}

template <class T>
struct Harness {
  struct SeqModel {
    std::uint32_t uid = 0;
    std::int64_t logical = 0;
    int prompt = 0;
    std::vector<std::vector<Tok>> toks;  // [layer * H + head] -> tokens in slot order
    int len() const { return toks.empty() ? 0 : static_cast<int>(toks[0].size()); }
  };

  CacheConfig cfg;
  KvCache<> cache;
  std::map<SeqId, SeqModel> model;
  std::uint32_t next_uid = 1;

  explicit Harness(const CacheConfig& c) : cfg(c), cache(c) {}

  int L() const { return cfg.model.num_layers; }
  int H() const { return cfg.model.num_kv_heads; }
  int D() const { return cfg.model.head_dim; }

  SeqId add() {
    const SeqId s = cache.add_sequence();
    SeqModel m;
    m.uid = next_uid++;
    m.toks.assign(static_cast<std::size_t>(L() * H()), {});
    model[s] = m;
    return s;
  }

  /// Builds k, v ([L, n, H, D]) for the next n tokens of s.
  void make_kv(SeqId s, int n, std::vector<T>& k, std::vector<T>& v) const {
    const SeqModel& m = model.at(s);
    k.resize(static_cast<std::size_t>(L()) * n * H() * D());
    v.resize(k.size());
    std::size_t i = 0;
    for (int l = 0; l < L(); ++l)
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < H(); ++h)
          for (int d = 0; d < D(); ++d, ++i) {
            const Tok tok{m.uid, static_cast<std::int32_t>(m.logical + t)};
            k[i] = content<T>(tok, l, 0, h, d);
            v[i] = content<T>(tok, l, 1, h, d);
          }
  }

  void model_append(SeqId s, int n, Phase ph) {
    SeqModel& m = model.at(s);
    if (ph == Phase::kPrefill) m.prompt += n;
    for (int t = 0; t < n; ++t)
      for (auto& row : m.toks) row.push_back(Tok{m.uid, static_cast<std::int32_t>(m.logical + t)});
    m.logical += n;
  }

  AppendResult append(SeqId s, int n, Phase ph = Phase::kDecode) {
    std::vector<T> k, v;
    make_kv(s, n, k, v);
    const AppendResult r = cache.template append<T>(s, std::span<const T>(k), std::span<const T>(v), n, ph);
    if (r.ok()) model_append(s, n, ph);
    return r;
  }

  T* elem(int layer, int kind, std::int32_t block, int slot_in_block, int head) const {
    const std::int64_t range_elems = cfg.block_bytes() * cfg.num_blocks / static_cast<std::int64_t>(sizeof(T));
    return static_cast<T*>(cache.allocator().data()) + (2 * layer + kind) * range_elems +
           ref_offset(cfg, block, slot_in_block, head);
  }

  /// Counts elements of s whose bytes differ from what the model says.
  std::size_t mismatches(SeqId s) const {
    const SeqModel& m = model.at(s);
    const auto table = cache.block_table(s);
    std::size_t bad = 0;
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h) {
        const auto& row = m.toks[static_cast<std::size_t>(l * H() + h)];
        for (int slot = 0; slot < static_cast<int>(row.size()); ++slot)
          for (int kind = 0; kind < 2; ++kind) {
            const T* p = elem(l, kind, table[static_cast<std::size_t>(slot / cfg.block_size)], slot % cfg.block_size, h);
            for (int d = 0; d < D(); ++d)
              if (!same_bits(p[d], content<T>(row[static_cast<std::size_t>(slot)], l, kind, h, d))) ++bad;
          }
      }
    return bad;
  }

  /// Every observable per-sequence value agrees with the model, and every byte is in place.
  void verify_all() const {
    std::set<std::int32_t> distinct;
    std::int64_t cached = 0, logical = 0;
    for (const auto& [s, m] : model) {
      CAPTURE(s);
      REQUIRE(cache.is_active(s));
      CHECK(cache.physical_length(s) == m.len());
      CHECK(cache.logical_position(s) == m.logical);
      CHECK(cache.prompt_length(s) == m.prompt);
      const auto table = cache.block_table(s);
      CHECK(table.size() == static_cast<std::size_t>((m.len() + cfg.block_size - 1) / cfg.block_size));
      CHECK(cache.host_lengths()[static_cast<std::size_t>(s)] == m.len());
      const auto row = cache.host_block_tables().subspan(static_cast<std::size_t>(s) * cfg.blocks_per_seq(),
                                                         static_cast<std::size_t>(cfg.blocks_per_seq()));
      for (std::size_t j = 0; j < row.size(); ++j) CHECK(row[j] == (j < table.size() ? table[j] : -1));
      for (auto b : table) {
        CHECK(b >= 0);
        CHECK(b < cfg.num_blocks);
        distinct.insert(b);
      }
      CHECK(mismatches(s) == 0);
      cached += m.len();
      logical += m.logical;
    }
    CHECK(cache.num_active() == static_cast<int>(model.size()));
    const MemoryStats ms = cache.memory();
    CHECK(ms.blocks_total == static_cast<std::size_t>(cfg.num_blocks));
    CHECK(ms.blocks_used == distinct.size());
    CHECK(ms.blocks_free == cfg.num_blocks - distinct.size());
    CHECK(ms.bytes_resident == static_cast<std::size_t>(2 * L() * cfg.block_bytes() * cfg.num_blocks));
    CHECK(ms.bytes_in_used_blocks == distinct.size() * static_cast<std::size_t>(cfg.block_bytes_all_ranges()));
    CHECK(ms.cached_tokens == cached);
    CHECK(ms.logical_tokens == logical);
    CHECK(ms.bytes_live == static_cast<std::size_t>(cached * 2 * L() * H() * D()) * sizeof(T));
  }

  /// A plan keeping `keep` random slots per (layer, head); the first `fixed_prefix` slots are
  /// kept in place in every row.
  KeepPlan random_plan(SeqId s, int keep, std::mt19937& rng, int fixed_prefix = 0) const {
    const int len = model.at(s).len();
    KeepPlan p(L(), H(), keep);
    std::vector<std::int32_t> all(static_cast<std::size_t>(len - fixed_prefix));
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h) {
        std::iota(all.begin(), all.end(), fixed_prefix);
        std::shuffle(all.begin(), all.end(), rng);
        std::int32_t* r = p.row(l, h);
        for (int i = 0; i < fixed_prefix; ++i) r[i] = i;
        std::copy_n(all.begin(), keep - fixed_prefix, r + fixed_prefix);
        std::sort(r, r + keep);
      }
    return p;
  }

  void apply(SeqId s, const KeepPlan& p) {
    cache.apply_keep_plan(s, p);
    SeqModel& m = model.at(s);
    int first_moved = p.keep;
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h) {
        auto& row = m.toks[static_cast<std::size_t>(l * H() + h)];
        std::vector<Tok> kept;
        for (int i = 0; i < p.keep; ++i) {
          kept.push_back(row[static_cast<std::size_t>(p.row(l, h)[i])]);
          if (p.row(l, h)[i] != i) first_moved = std::min(first_moved, i);
        }
        row = kept;
      }
    // Slots [0, first_moved) are untouched in every row: that much of the prompt stays in place.
    m.prompt = std::min(m.prompt, first_moved);
  }

  void release(SeqId s) {
    cache.release(s);
    model.erase(s);
  }

  std::vector<unsigned char> raw() const {
    const auto* p = static_cast<const unsigned char*>(cache.allocator().data());
    return {p, p + cache.allocator().bytes_resident()};
  }
  /// Whether any byte of a block outside `except` changed between two raw snapshots.
  bool only_blocks_changed(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b,
                           const std::set<std::int32_t>& except) const {
    const std::size_t bb = static_cast<std::size_t>(cfg.block_bytes());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a[i] == b[i]) continue;
      const auto block = static_cast<std::int32_t>((i % (bb * cfg.num_blocks)) / bb);
      if (!except.count(block)) return false;
    }
    return true;
  }
};

CacheConfig make_config(DType dt, KvLayout layout, int bs, int num_blocks, int max_seqs = 8, int mbps = 0) {
  CacheConfig c;
  c.model = ModelGeometry{2, 4, 2, 6};
  c.block_size = bs;
  c.num_blocks = num_blocks;
  c.max_seqs = max_seqs;
  c.max_blocks_per_seq = mbps;
  c.layout = layout;
  c.dtype = dt;
  return c;
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

TEST_SUITE("core") {

TEST_CASE("kv cache: a fresh cache") {
  const CacheConfig cfg = make_config(DType::kBF16, KvLayout::kNHD, 16, 10, 3);
  const KvCache<> c(cfg);
  CHECK(c.config().num_blocks == 10);
  CHECK(c.num_active() == 0);
  for (SeqId s : {-1, 0, 1, 2, 3}) CHECK_FALSE(c.is_active(s));
  CHECK(c.host_block_tables().size() == 3u * 10u);
  CHECK(std::all_of(c.host_block_tables().begin(), c.host_block_tables().end(), [](auto b) { return b == -1; }));
  CHECK(c.host_lengths().size() == 3u);
  CHECK(std::all_of(c.host_lengths().begin(), c.host_lengths().end(), [](auto l) { return l == 0; }));
  const MemoryStats m = c.memory();
  CHECK(m.blocks_total == 10);
  CHECK(m.blocks_used == 0);
  CHECK(m.blocks_free == 10);
  CHECK(m.bytes_resident == static_cast<std::size_t>(2 * 2 * cfg.block_bytes() * 10));
  CHECK(m.bytes_in_used_blocks == 0);
  CHECK(m.bytes_live == 0);
  CHECK(m.cached_tokens == 0);
  CHECK(m.logical_tokens == 0);
  const KvCacheView<bf16_storage> v = c.view<bf16_storage>();
  CHECK(v.data == c.allocator().data());
  CHECK(v.ranges == nullptr);
  CHECK(v.kind_stride == cfg.block_bytes() * 10 / 2);
  CHECK(v.layer_stride == 2 * v.kind_stride);
  CHECK(v.num_layers == 2);
  CHECK(v.num_blocks == 10);
  CHECK(v.max_seqs == 3);
  CHECK(v.max_blocks_per_seq == 10);
  CHECK(v.block_tables == c.host_block_tables().data());
  CHECK(v.seq_lens == c.host_lengths().data());
  CHECK(v.block.block_size == 16);
  CHECK(v.block.num_kv_heads == 2);
  CHECK(v.block.head_dim == 6);
}

TEST_CASE("kv cache: sequence slots are lowest first and reused after release with a fresh state") {
  KvCache<> c(make_config(DType::kF32, KvLayout::kNHD, 4, 16, 3));
  const SeqId a = c.add_sequence(), b = c.add_sequence(), d = c.add_sequence();
  CHECK(a == 0);
  CHECK(b == 1);
  CHECK(d == 2);
  CHECK(c.num_active() == 3);
  REQUIRE(c.extend(b, 6, Phase::kPrefill).ok());
  REQUIRE(c.extend(b, 1).ok());
  CHECK(c.block_table(b).size() == 2);
  c.release(b);
  CHECK_FALSE(c.is_active(b));
  CHECK(c.num_active() == 2);
  CHECK(c.memory().blocks_used == 0);
  CHECK(c.host_lengths()[1] == 0);
  CHECK(c.host_block_tables()[1 * 16] == -1);
  CHECK(c.host_block_tables()[1 * 16 + 1] == -1);
  const SeqId e = c.add_sequence();
  CHECK(e == b);
  CHECK(c.physical_length(e) == 0);
  CHECK(c.logical_position(e) == 0);
  CHECK(c.prompt_length(e) == 0);
  CHECK(c.block_table(e).empty());
}

TEST_CASE("kv cache: extend bookkeeping (first slot / blocks needed / positions / prompt)") {
  KvCache<> c(make_config(DType::kF16, KvLayout::kHND, 7, 32, 4));
  const SeqId s = c.add_sequence();
  AppendResult r = c.extend(s, 10, Phase::kPrefill);
  CHECK(r.ok());
  CHECK(r.first_slot == 0);
  CHECK(r.blocks_needed == 2);
  CHECK(c.physical_length(s) == 10);
  CHECK(c.logical_position(s) == 10);
  CHECK(c.prompt_length(s) == 10);
  r = c.extend(s, 3, Phase::kPrefill);  // chunked prefill
  CHECK(r.first_slot == 10);
  CHECK(r.blocks_needed == 0);
  CHECK(c.prompt_length(s) == 13);
  r = c.extend(s, 1);
  CHECK(r.first_slot == 13);
  CHECK(r.blocks_needed == 0);
  r = c.extend(s, 1);
  CHECK(r.first_slot == 14);
  CHECK(r.blocks_needed == 1);
  CHECK(c.physical_length(s) == 15);
  CHECK(c.logical_position(s) == 15);
  CHECK(c.prompt_length(s) == 13);
  r = c.extend(s, 0);
  CHECK(r.ok());
  CHECK(r.first_slot == 15);
  CHECK(r.blocks_needed == 0);
  CHECK(c.physical_length(s) == 15);
  const auto t = c.block_table(s);
  REQUIRE(t.size() == 3);
  CHECK(std::vector<std::int32_t>(t.begin(), t.end()) == std::vector<std::int32_t>{0, 1, 2});
}

TEST_CASE_TEMPLATE("kv cache: prefill and decode and keep-plan compaction move exactly the kept tokens", T, float,
                   f16_storage, bf16_storage) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND})
    for (int bs : {1, 7, 16}) {
      CAPTURE(layout_name(layout));
      CAPTURE(bs);
      std::mt19937 rng(1234u + static_cast<unsigned>(bs) * 7u + static_cast<unsigned>(layout));
      const int nb = 3 * ceil_div(48, bs) + 2;
      Harness<T> t(make_config(dtype_of<T>, layout, bs, nb));
      REQUIRE(t.cache.allocator().range_stride_bytes() == t.cfg.block_bytes() * nb);
      const SeqId a = t.add(), b = t.add(), c = t.add();

      // Prefill in one call, then interleaved single-token decode so that blocks interleave.
      AppendResult r = t.append(a, 13, Phase::kPrefill);
      CHECK(r.ok());
      CHECK(r.first_slot == 0);
      CHECK(r.blocks_needed == ceil_div(13, bs));
      REQUIRE(t.append(b, 5, Phase::kPrefill).ok());
      for (int i = 0; i < 6; ++i) {
        r = t.append(a, 1);
        REQUIRE(r.ok());
        CHECK(r.first_slot == 13 + i);
        REQUIRE(t.append(b, 1).ok());
      }
      REQUIRE(t.append(c, 20, Phase::kPrefill).ok());
      REQUIRE(t.append(c, 3).ok());
      t.verify_all();
      CHECK(t.cache.prompt_length(a) == 13);
      CHECK(t.cache.physical_length(a) == 19);
      CHECK(t.cache.logical_position(a) == 19);

      // Random per-(layer, head) subsets: every row keeps different tokens.
      {
        const auto before_table = std::vector<std::int32_t>(t.cache.block_table(a).begin(), t.cache.block_table(a).end());
        const auto raw_before = t.raw();
        const std::size_t used_before = t.cache.memory().blocks_used;
        const KeepPlan p = t.random_plan(a, 9, rng);
        t.apply(a, p);
        t.verify_all();
        CHECK(t.cache.physical_length(a) == 9);
        CHECK(t.cache.logical_position(a) == 19);  // RoPE position unchanged
        const auto after_table = t.cache.block_table(a);
        REQUIRE(after_table.size() == static_cast<std::size_t>(ceil_div(9, bs)));
        CHECK(std::equal(after_table.begin(), after_table.end(), before_table.begin()));  // a prefix of the old table
        CHECK(t.cache.memory().blocks_used == used_before - (before_table.size() - after_table.size()));
        for (std::size_t j = after_table.size(); j < before_table.size(); ++j)
          CHECK(t.cache.allocator().ref_count(before_table[j]) == 0);  // tail blocks freed
        // Nothing outside a's kept blocks was written.
        CHECK(t.only_blocks_changed(raw_before, t.raw(), std::set<std::int32_t>(after_table.begin(), after_table.end())));
      }
      // Decode continues right after the kept tokens.
      for (int i = 0; i < 4; ++i) {
        r = t.append(a, 1);
        REQUIRE(r.ok());
        CHECK(r.first_slot == 9 + i);
      }
      t.verify_all();
      CHECK(t.cache.logical_position(a) == 23);

      // A prefix plan moves nothing: not one byte changes; tail blocks are freed.
      {
        const auto raw_before = t.raw();
        KeepPlan p(2, 2, 10);
        for (int l = 0; l < 2; ++l)
          for (int h = 0; h < 2; ++h) std::iota(p.row(l, h), p.row(l, h) + 10, 0);
        REQUIRE(p.is_prefix());
        t.apply(c, p);
        CHECK(t.raw() == raw_before);
        t.verify_all();
        CHECK(t.cache.prompt_length(c) == 10);
      }
      // Identity plan (keep == length): nothing changes at all.
      {
        const auto raw_before = t.raw();
        const auto used = t.cache.memory().blocks_used;
        t.apply(c, t.random_plan(c, 10, rng));
        CHECK(t.raw() == raw_before);
        CHECK(t.cache.memory().blocks_used == used);
        t.verify_all();
      }
      // Compaction keeping the prompt in place (the pinned-prompt shape) keeps prompt_length.
      {
        REQUIRE(t.append(b, 7).ok());
        const KeepPlan p = t.random_plan(b, 8, rng, /*fixed_prefix=*/5);
        t.apply(b, p);
        t.verify_all();
        CHECK(t.cache.prompt_length(b) == 5);
      }
      // keep = 0 frees everything; the sequence lives on and can grow again.
      {
        t.apply(b, KeepPlan(2, 2, 0));
        CHECK(t.cache.physical_length(b) == 0);
        CHECK(t.cache.block_table(b).empty());
        CHECK(t.cache.logical_position(b) == 18);
        REQUIRE(t.append(b, 3).ok());
        t.verify_all();
      }
      // Several rounds of compaction and growth on every sequence.
      for (int round = 0; round < 4; ++round) {
        for (SeqId s : {a, b, c}) {
          REQUIRE(t.append(s, 1 + static_cast<int>(rng() % 9)).ok());
          const int len = t.cache.physical_length(s);
          t.apply(s, t.random_plan(s, static_cast<int>(rng() % (len + 1)), rng));
        }
        t.verify_all();
      }
      // Release frees every block of the sequence, and only those.
      const std::size_t a_blocks = t.cache.block_table(a).size();
      const std::size_t used = t.cache.memory().blocks_used;
      t.release(a);
      CHECK(t.cache.memory().blocks_used == used - a_blocks);
      CHECK_FALSE(t.cache.is_active(a));
      t.verify_all();
      t.release(b);
      t.release(c);
      t.verify_all();
      CHECK(t.cache.memory().blocks_used == 0);
      CHECK(t.cache.memory().blocks_free == static_cast<std::size_t>(nb));
    }
}

TEST_CASE_TEMPLATE("kv cache: extend + write per layer (the engine's path)", T, float, f16_storage, bf16_storage) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    CAPTURE(layout_name(layout));
    Harness<T> t(make_config(dtype_of<T>, layout, 7, 12));
    const SeqId s = t.add();
    for (int n : {9, 1, 1, 6, 1}) {
      const Phase ph = n == 9 ? Phase::kPrefill : Phase::kDecode;
      std::vector<T> k, v;
      t.make_kv(s, n, k, v);
      const AppendResult r = t.cache.extend(s, n, ph);
      REQUIRE(r.ok());
      const std::size_t per_layer = static_cast<std::size_t>(n) * t.H() * t.D();
      for (int l = t.L() - 1; l >= 0; --l)  // any layer order
        t.cache.template write<T>(s, l, r.first_slot, k.data() + l * per_layer, v.data() + l * per_layer, n);
      t.model_append(s, n, ph);
      t.verify_all();
    }
    // Rewriting one already-written slot of one layer (e.g. a re-run step) touches only that.
    std::vector<T> k(static_cast<std::size_t>(t.H() * t.D())), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = content<T>(Tok{999, 0}, 0, 0, 0, static_cast<int>(i));
      v[i] = content<T>(Tok{999, 1}, 0, 0, 0, static_cast<int>(i));
    }
    const auto raw_before = t.raw();
    t.cache.template write<T>(s, 1, 4, k.data(), v.data(), 1);
    const auto raw_after = t.raw();
    std::size_t changed = 0;
    for (std::size_t i = 0; i < raw_before.size(); ++i) changed += raw_before[i] != raw_after[i];
    CHECK(changed <= 2 * k.size() * sizeof(T));
    CHECK(changed > 0);
    for (int h = 0; h < t.H(); ++h)
      for (int d = 0; d < t.D(); ++d) {
        const std::int32_t blk = t.cache.block_table(s)[0];
        CHECK(same_bits(t.elem(1, 0, blk, 4, h)[d], k[static_cast<std::size_t>(h * t.D() + d)]));
        CHECK(same_bits(t.elem(1, 1, blk, 4, h)[d], v[static_cast<std::size_t>(h * t.D() + d)]));
      }
    // view<T>().token() agrees with the independent address.
    const auto view = t.cache.template view<T>();
    const auto table = t.cache.block_table(s);
    bool ok = true;
    for (int l = 0; l < t.L(); ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (int slot = 0; slot < t.cache.physical_length(s); ++slot)
          for (int h = 0; h < t.H(); ++h)
            ok &= view.token(l, static_cast<KvKind>(kind), s, slot, h) ==
                  t.elem(l, kind, table[static_cast<std::size_t>(slot / 7)], slot % 7, h);
    CHECK(ok);
  }
}

TEST_CASE("kv cache: fork_prefix shares whole blocks with reference counts") {
  Harness<bf16_storage> t(make_config(DType::kBF16, KvLayout::kHND, 4, 20));
  std::mt19937 rng(99);
  const SeqId p = t.add();
  REQUIRE(t.append(p, 6, Phase::kPrefill).ok());
  REQUIRE(t.append(p, 4).ok());  // 10 tokens: blocks b0 b1 (full) and b2 (2 tokens)
  const auto ptab = std::vector<std::int32_t>(t.cache.block_table(p).begin(), t.cache.block_table(p).end());
  REQUIRE(ptab.size() == 3);
  const std::size_t used = t.cache.memory().blocks_used;

  const SeqId c = t.cache.fork_prefix(p, 8);
  {
    auto& m = t.model[c];
    m.uid = t.next_uid++;
    m.logical = 8;
    m.prompt = 6;
    m.toks = t.model.at(p).toks;
    for (auto& row : m.toks) row.resize(8);
  }
  CHECK(c != p);
  CHECK(t.cache.physical_length(c) == 8);
  CHECK(t.cache.logical_position(c) == 8);
  CHECK(t.cache.prompt_length(c) == 6);  // min(parent prompt, tokens)
  const auto ctab = t.cache.block_table(c);
  REQUIRE(ctab.size() == 2);
  CHECK(ctab[0] == ptab[0]);
  CHECK(ctab[1] == ptab[1]);
  CHECK(t.cache.allocator().ref_count(ptab[0]) == 2);
  CHECK(t.cache.allocator().ref_count(ptab[1]) == 2);
  CHECK(t.cache.allocator().ref_count(ptab[2]) == 1);
  CHECK(t.cache.memory().blocks_used == used);  // sharing costs no block
  t.verify_all();

  // Both grow independently, into their own blocks.
  REQUIRE(t.append(c, 3).ok());
  REQUIRE(t.append(p, 3).ok());
  t.verify_all();
  CHECK(t.cache.block_table(c)[2] != t.cache.block_table(p)[2]);
  CHECK(t.cache.memory().blocks_used == used + 2);

  // A grandchild shares the same two blocks.
  const SeqId g = t.cache.fork_prefix(c, 4);
  {
    auto& m = t.model[g];
    m.uid = t.next_uid++;
    m.logical = 4;
    m.prompt = 4;
    m.toks = t.model.at(c).toks;
    for (auto& row : m.toks) row.resize(4);
  }
  CHECK(t.cache.allocator().ref_count(ptab[0]) == 3);
  CHECK(t.cache.allocator().ref_count(ptab[1]) == 2);
  CHECK(t.cache.prompt_length(g) == 4);
  REQUIRE(t.append(g, 1, Phase::kPrefill).ok());  // the grandchild is still all prompt: prefill may go on
  t.verify_all();

  // Compacting the child past the shared prefix is fine (the shared blocks are not rewritten).
  {
    const auto raw_before = t.raw();
    const KeepPlan plan = t.random_plan(c, 9, rng, /*fixed_prefix=*/8);
    t.apply(c, plan);
    t.verify_all();
    std::set<std::int32_t> own(t.cache.block_table(c).begin() + 2, t.cache.block_table(c).end());
    CHECK(t.only_blocks_changed(raw_before, t.raw(), own));
  }
  // Compacting the whole shared prefix away just drops the references.
  {
    t.apply(g, KeepPlan(2, 2, 0));
    CHECK(t.cache.allocator().ref_count(ptab[0]) == 2);
    t.verify_all();
  }

  // Releasing the parent keeps the shared blocks alive for the child.
  t.release(p);
  CHECK(t.cache.allocator().ref_count(ptab[0]) == 1);
  CHECK(t.cache.allocator().ref_count(ptab[1]) == 1);
  CHECK(t.cache.allocator().ref_count(ptab[2]) == 0);
  t.verify_all();
  // Now the child owns them alone, so it may compact them.
  t.apply(c, t.random_plan(c, 5, rng));
  t.verify_all();
  t.release(c);
  t.release(g);
  CHECK(t.cache.memory().blocks_used == 0);

  // A zero-token fork is an empty sequence that shares nothing.
  const SeqId q = t.add();
  REQUIRE(t.append(q, 5, Phase::kPrefill).ok());
  const SeqId z = t.cache.fork_prefix(q, 0);
  CHECK(t.cache.physical_length(z) == 0);
  CHECK(t.cache.prompt_length(z) == 0);
  CHECK(t.cache.logical_position(z) == 0);
  CHECK(t.cache.block_table(z).empty());
  CHECK(t.cache.allocator().ref_count(t.cache.block_table(q)[0]) == 1);
}

TEST_CASE("kv cache: memory accounting") {
  const CacheConfig cfg = make_config(DType::kF16, KvLayout::kNHD, 4, 10, 4);
  KvCache<> c(cfg);
  const std::size_t resident = static_cast<std::size_t>(2 * 2 * cfg.block_bytes() * 10);
  const SeqId a = c.add_sequence(), b = c.add_sequence();
  REQUIRE(c.extend(a, 5, Phase::kPrefill).ok());  // 2 blocks
  REQUIRE(c.extend(b, 4).ok());                   // 1 block
  MemoryStats m = c.memory();
  CHECK(m.blocks_used == 3);
  CHECK(m.blocks_free == 7);
  CHECK(m.blocks_total == 10);
  CHECK(m.bytes_resident == resident);
  CHECK(m.bytes_in_used_blocks == 3u * static_cast<std::size_t>(cfg.block_bytes_all_ranges()));
  CHECK(m.cached_tokens == 9);
  CHECK(m.logical_tokens == 9);
  CHECK(m.bytes_live == 9u * static_cast<std::size_t>(cfg.token_bytes()));
  CHECK(cfg.token_bytes() == 2 * 2 * 2 * 6 * 2);
  // Compaction lowers cached tokens, not logical ones.
  KeepPlan p(2, 2, 2);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      p.row(l, h)[0] = 1;
      p.row(l, h)[1] = 4;
    }
  c.apply_keep_plan(a, p);
  m = c.memory();
  CHECK(m.blocks_used == 2);
  CHECK(m.cached_tokens == 6);
  CHECK(m.logical_tokens == 9);
  CHECK(m.bytes_live == 6u * static_cast<std::size_t>(cfg.token_bytes()));
  CHECK(m.bytes_resident == resident);
  // A fork adds cached tokens (each sequence reads them) but no blocks.
  const SeqId f = c.fork_prefix(b, 4);
  m = c.memory();
  CHECK(m.blocks_used == 2);
  CHECK(m.cached_tokens == 10);
  CHECK(m.logical_tokens == 13);
  c.release(a);
  c.release(b);
  c.release(f);
  m = c.memory();
  CHECK(m.blocks_used == 0);
  CHECK(m.blocks_free == 10);
  CHECK(m.bytes_in_used_blocks == 0);
  CHECK(m.bytes_live == 0);
  CHECK(m.bytes_resident == resident);
}

TEST_CASE("kv cache: a moved cache keeps its state") {
  Harness<float> t(make_config(DType::kF32, KvLayout::kNHD, 3, 8));
  const SeqId s = t.add();
  REQUIRE(t.append(s, 7, Phase::kPrefill).ok());
  const void* data = t.cache.allocator().data();
  KvCache<> moved(std::move(t.cache));
  CHECK(moved.allocator().data() == data);
  CHECK(moved.physical_length(s) == 7);
  CHECK(moved.prompt_length(s) == 7);
  CHECK(moved.block_table(s).size() == 3);
  CHECK(moved.memory().blocks_used == 3);
  t.cache = std::move(moved);
  t.verify_all();
}

}  // TEST_SUITE

TEST_CASE("kv cache: per-head reports after per-layer plans name every layer's own positions") {
  // An engine applies a plan that differs per layer through apply_keep_plan; a later per-head round
  // must not label layer 1 with layer 0's positions (its report falls back to one row per pair).
  constexpr int L = 2, Hq = 4, Hkv = 2, D = 16;
  CacheConfig cfg;
  cfg.model = ModelGeometry{L, Hq, Hkv, D};
  cfg.block_size = 4;
  cfg.num_blocks = 8;
  cfg.max_seqs = 1;
  cfg.dtype = DType::kF32;
  cfg.track_positions = true;
  SelectionParams sp;
  sp.budget = 8;
  sp.divide_length = 4;
  sp.mode = PruningMode::kPerHead;
  sp.prompt = PromptMode::kCompete;
  std::mt19937 rng(11);
  const QueryStats stats = random_query_stats(rng, L, Hq, D);
  KvCache<TriAttentionScorer, TopKSelector> c(cfg, TriAttentionScorer(stats, RopeConfig{}, ScoringParams{}, Hkv),
                                              TopKSelector(sp));
  const SeqId s = c.add_sequence();
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(L) * 16 * Hkv * D), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  REQUIRE(c.append(s, std::span<const float>(k), std::span<const float>(v), 16).ok());
  KeepPlan plan(L, Hkv, 12);  // layer 0 drops slots 0..3, layer 1 drops 12..15
  for (int h = 0; h < Hkv; ++h)
    for (int i = 0; i < 12; ++i) {
      plan.row(0, h)[i] = i + 4;
      plan.row(1, h)[i] = i;
    }
  c.apply_keep_plan(s, plan);
  const CompressionReport rep = c.compress(s);
  REQUIRE(rep.status == RoundStatus::kCompressed);
  REQUIRE(rep.length_after == 8);
  CHECK(rep.kept_rows == L * Hkv);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < Hkv; ++h) {
      const int row = rep.kept_rows == L * Hkv ? l * Hkv + h : h;
      for (const std::int32_t p : rep.kept(row)) {
        INFO("layer ", l, " head ", h, " position ", p);
        CHECK((l == 0 ? (p >= 4 && p < 16) : (p >= 0 && p < 12)));
      }
      const auto kept = rep.kept(row);
      CHECK(c.positions(s, l, h) == std::vector<std::int32_t>(kept.begin(), kept.end()));
    }
  // Appended slots are implicit (logical - length + slot) and no position work per token.
  REQUIRE(c.append(s, std::span<const float>(k.data(), k.size() / 16 * 2), std::span<const float>(v.data(), v.size() / 16 * 2), 2).ok());
  const std::vector<std::int32_t> after = c.positions(s, 1, 0);
  REQUIRE(after.size() == 10);
  CHECK(after[8] == 16);
  CHECK(after[9] == 17);
  CHECK(c.position_state(s).explicit_len == 8);
}

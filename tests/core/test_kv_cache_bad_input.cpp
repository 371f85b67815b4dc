// SPDX-License-Identifier: Apache-2.0
// KvCache<> error model: every bad argument throws triattn::logic_error whose message names the
// bad value, and leaves the cache EXACTLY as it was. "Exactly" is checked twice: (1) a snapshot
// of everything observable (per-slot state, block tables, lengths, memory stats, every block's
// reference count and every byte of the cache memory) is equal before and after; (2) a twin cache
// built the same way but never given the bad call, and the rejected one, then run the same long
// follow-up script (fill all sequence slots, grow until out of blocks, compact, release, regrow),
// and must end identical, so that hidden state such as free-list order cannot differ either.
// Running out of blocks is not an error: it returns AppendStatus::kOutOfBlocks, also unchanged.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include <triattn/core/hash.hpp>
#include <triattn/core/kv_cache.hpp>

using namespace triattn;

namespace {

using T = bf16_storage;
constexpr int kL = 2, kH = 2, kD = 4, kBs = 4, kBlocks = 12, kMaxSeqs = 5, kRow = 6;

std::uint16_t mix16(std::uint64_t x) {
  std::uint16_t b = static_cast<std::uint16_t>(mix64(x));
  if ((b & 0x7f80u) == 0x7f80u) b ^= 0x4000u;  // never NaN/Inf
  return b;
}

CacheConfig base_config(KvLayout layout) {
  CacheConfig c;
  c.model = ModelGeometry{kL, 4, kH, kD};
  c.block_size = kBs;
  c.num_blocks = kBlocks;
  c.max_seqs = kMaxSeqs;
  c.max_blocks_per_seq = kRow;
  c.layout = layout;
  c.dtype = DType::kBF16;
  return c;
}

/// A cache in a non-trivial state: a (prefill 10 + decode 2 = 12 tokens, 3 blocks), b (5 tokens),
/// f = fork_prefix(a, 8) + 1 own token (shares a's first 2 blocks), r added, grown and released
/// (so the free lists are not in their initial order), slot 4 never used.
struct Fixture {
  CacheConfig cfg;
  KvCache<> c;
  SeqId a = -1, b = -1, f = -1, r = -1;
  SeqId x = -1, y = -1;  // set by some preparations

  explicit Fixture(KvLayout layout) : cfg(base_config(layout)), c(cfg) {
    a = c.add_sequence();
    REQUIRE(append(a, 10, Phase::kPrefill).ok());
    REQUIRE(append(a, 2).ok());
    b = c.add_sequence();
    REQUIRE(append(b, 5, Phase::kPrefill).ok());
    r = c.add_sequence();
    REQUIRE(append(r, 3).ok());
    f = c.fork_prefix(a, 8);
    REQUIRE(append(f, 1).ok());
    c.release(r);
    REQUIRE(a == 0);
    REQUIRE(b == 1);
    REQUIRE(r == 2);
    REQUIRE(f == 3);
  }

  std::vector<T> kv(SeqId s, int n, int kind) const {
    std::vector<T> out;
    const std::int64_t pos = c.logical_position(s);
    for (int l = 0; l < kL; ++l)
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < kH; ++h)
          for (int d = 0; d < kD; ++d)
            out.push_back(T{mix16((static_cast<std::uint64_t>(s) << 48) ^ (static_cast<std::uint64_t>(pos + t) << 16) ^
                                  static_cast<std::uint64_t>(((l * 2 + kind) * kH + h) * kD + d))});
    return out;
  }
  AppendResult append(SeqId s, int n, Phase ph = Phase::kDecode) {
    const auto k = kv(s, n, 0), v = kv(s, n, 1);
    return c.append<T>(s, std::span<const T>(k), std::span<const T>(v), n, ph);
  }
  /// A valid plan that moves data, for a sequence of length len and keep <= (len + 1) / 2:
  /// rows with even l + h keep the last `keep` slots, the others every second slot from 0.
  static KeepPlan plan(int len, int keep) {
    REQUIRE(keep <= (len + 1) / 2);
    KeepPlan p(kL, kH, keep);
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kH; ++h)
        for (int i = 0; i < keep; ++i) p.row(l, h)[i] = (l + h) % 2 == 0 ? len - keep + i : 2 * i;
    return p;
  }
};

/// Everything the cache lets one observe.
struct Snapshot {
  std::vector<std::int64_t> seqs;   // per slot: active, len, logical, prompt, then its block table
  std::vector<std::int32_t> tables, lens;
  std::vector<std::int64_t> mem;    // MemoryStats fields
  std::vector<int> refs;            // every block's reference count
  std::vector<unsigned char> raw;   // every byte of cache memory
  int num_active = 0;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snap(const KvCache<>& c) {
  Snapshot s;
  for (SeqId q = 0; q < c.config().max_seqs; ++q) {
    s.seqs.push_back(c.is_active(q));
    if (!c.is_active(q)) continue;
    s.seqs.push_back(c.physical_length(q));
    s.seqs.push_back(c.logical_position(q));
    s.seqs.push_back(c.prompt_length(q));
    for (auto b : c.block_table(q)) s.seqs.push_back(b);
  }
  s.tables.assign(c.host_block_tables().begin(), c.host_block_tables().end());
  s.lens.assign(c.host_lengths().begin(), c.host_lengths().end());
  const MemoryStats m = c.memory();
  s.mem = {static_cast<std::int64_t>(m.blocks_total),   static_cast<std::int64_t>(m.blocks_used),
           static_cast<std::int64_t>(m.blocks_free),    static_cast<std::int64_t>(m.bytes_resident),
           static_cast<std::int64_t>(m.bytes_in_used_blocks), static_cast<std::int64_t>(m.bytes_live),
           m.cached_tokens, m.logical_tokens};
  for (int b = 0; b < c.config().num_blocks; ++b) s.refs.push_back(c.allocator().ref_count(b));
  s.refs.push_back(static_cast<int>(c.allocator().num_free()));
  const auto* p = static_cast<const unsigned char*>(c.allocator().data());
  s.raw.assign(p, p + c.allocator().bytes_resident());
  s.num_active = c.num_active();
  return s;
}

/// The same long script on any fixture; its outcome depends on every bit of hidden state.
void follow_up(Fixture& F) {
  KvCache<>& c = F.c;
  for (int i = 0; i < kMaxSeqs; ++i) {
    if (c.num_active() == kMaxSeqs) break;
    (void)c.add_sequence();
  }
  for (int round = 0; round < 6; ++round)
    for (SeqId s = 0; s < kMaxSeqs; ++s)
      if (c.is_active(s)) (void)F.append(s, 1 + (s + round) % 4);
  for (SeqId s = 0; s < kMaxSeqs; ++s) {
    if (!c.is_active(s)) continue;
    const int len = c.physical_length(s);
    try {
      c.apply_keep_plan(s, Fixture::plan(len, len / 2));
    } catch (const triattn::logic_error&) {  // shared blocks: refused, unchanged
    }
  }
  if (c.is_active(1)) c.release(1);
  if (c.num_active() < kMaxSeqs) {
    const SeqId n = c.add_sequence();
    for (int i = 0; i < 8; ++i) (void)F.append(n, 3);
  }
  for (SeqId s = 0; s < kMaxSeqs; ++s)
    if (c.is_active(s)) (void)F.append(s, 2);
}

template <class F>
std::string logic_error_message(F&& f) {
  try {
    f();
  } catch (const triattn::logic_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<wrong exception type: ") + e.what() + ">";
  } catch (...) {
    return "<threw something other than triattn::logic_error>";
  }
  return "<did not throw>";
}

using Op = std::function<void(Fixture&)>;

/// Runs `bad` on a fixture (after `prep` on it and on its twin), expects a logic_error whose
/// message contains every string of `must`, and checks the cache is exactly as it was.
void expect_rejected(const Op& bad, const std::vector<std::string>& must, const Op& prep = {}) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    CAPTURE(layout_name(layout));
    Fixture A(layout), B(layout);
    if (prep) {
      prep(A);
      prep(B);
    }
    const Snapshot before = snap(A.c);
    REQUIRE(before == snap(B.c));
    const std::string msg = logic_error_message([&] { bad(A); });
    CAPTURE(msg);
    CHECK(msg.rfind("triattn: ", 0) == 0);
    for (const auto& m : must) CHECK_MESSAGE(msg.find(m) != std::string::npos, "message lacks \"" << m << "\"");
    const Snapshot after = snap(A.c);
    CHECK(after.seqs == before.seqs);
    CHECK(after.tables == before.tables);
    CHECK(after.lens == before.lens);
    CHECK(after.mem == before.mem);
    CHECK(after.refs == before.refs);
    CHECK(after.raw == before.raw);
    CHECK(after.num_active == before.num_active);
    follow_up(A);
    follow_up(B);
    CHECK(snap(A.c) == snap(B.c));
  }
}

/// Like expect_rejected, for calls that must return kOutOfBlocks and change nothing.
void expect_out_of_blocks(const std::function<AppendResult(Fixture&)>& op, int blocks_needed, const Op& prep = {}) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    CAPTURE(layout_name(layout));
    Fixture A(layout), B(layout);
    if (prep) {
      prep(A);
      prep(B);
    }
    const Snapshot before = snap(A.c);
    REQUIRE(before == snap(B.c));
    const AppendResult r = op(A);
    CHECK(r.status == AppendStatus::kOutOfBlocks);
    CHECK_FALSE(r.ok());
    CHECK(r.blocks_needed == blocks_needed);
    CHECK(snap(A.c) == before);
    follow_up(A);
    follow_up(B);
    CHECK(snap(A.c) == snap(B.c));
  }
}

std::vector<T> zeros(std::size_t n) { return std::vector<T>(n, T{0}); }

}  // namespace

TEST_SUITE("core") {

TEST_CASE("bad input: the fixture and the follow-up script are deterministic") {
  Fixture A(KvLayout::kNHD), B(KvLayout::kNHD);
  CHECK(snap(A.c) == snap(B.c));
  follow_up(A);
  follow_up(B);
  CHECK(snap(A.c) == snap(B.c));
  // The script is sensitive: one extra token anywhere changes the outcome.
  Fixture C(KvLayout::kNHD), D(KvLayout::kNHD);
  REQUIRE(C.append(C.b, 1).ok());
  follow_up(C);
  follow_up(D);
  CHECK_FALSE(snap(C.c) == snap(D.c));
}

TEST_CASE("bad input: unknown and never-added and released sequences for every method") {
  const auto k1 = zeros(kL * kH * kD), v1 = zeros(kL * kH * kD);
  // -1 and >= max_seqs are not ids; 2 was released; 4 was never added.
  for (SeqId s : {-1, kMaxSeqs, 1000, std::numeric_limits<SeqId>::min(), 2, 4}) {
    CAPTURE(s);
    const std::string id = "sequence " + std::to_string(s);
    const std::string why = (s == 2 || s == 4) ? "not active" : "not a sequence id";
    expect_rejected([&](Fixture& F) { (void)F.c.fork_prefix(s, 0); }, {"fork_prefix", id, why});
    expect_rejected([&](Fixture& F) { F.c.release(s); }, {"release", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.extend(s, 1); }, {"extend", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.extend(s, 0, Phase::kPrefill); }, {"extend", id, why});
    expect_rejected([&](Fixture& F) { F.c.write<T>(s, 0, 0, k1.data(), v1.data(), 1); }, {"write", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.append<T>(s, k1, v1, 1); }, {"append", id, why});
    expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(s, KeepPlan(kL, kH, 0)); }, {"apply_keep_plan", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.block_table(s); }, {"block_table", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.logical_position(s); }, {"logical_position", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.physical_length(s); }, {"physical_length", id, why});
    expect_rejected([&](Fixture& F) { (void)F.c.prompt_length(s); }, {"prompt_length", id, why});
  }
  // Releasing twice: the second release is rejected and does not double-free the blocks.
  expect_rejected([](Fixture& F) { F.c.release(F.b); }, {"release", "sequence 1", "not active"},
                  [](Fixture& F) { F.c.release(F.b); });
}

TEST_CASE("bad input: sequence slots exhausted") {
  const Op fill = [](Fixture& F) {
    (void)F.c.add_sequence();
    (void)F.c.add_sequence();
    REQUIRE(F.c.num_active() == kMaxSeqs);
  };
  expect_rejected([](Fixture& F) { (void)F.c.add_sequence(); }, {"add_sequence", "max_seqs = 5"}, fill);
  expect_rejected([](Fixture& F) { (void)F.c.fork_prefix(F.a, 8); }, {"max_seqs = 5"}, fill);
}

TEST_CASE("bad input: out of blocks returns kOutOfBlocks and writes nothing") {
  // Pool exhaustion: leave 1 free block; b (5 tokens, 2 blocks, 3 free slots) asks for 9 more.
  const Op fill_pool = [](Fixture& F) {
    const SeqId x = F.c.add_sequence();
    REQUIRE(F.append(x, 5 * 4, Phase::kPrefill).ok());  // 12 - 6 - 5 = 1 block left
    REQUIRE(F.c.memory().blocks_free == 1);
  };
  expect_out_of_blocks(
      [](Fixture& F) {
        const auto k = F.kv(F.b, 9, 0), v = F.kv(F.b, 9, 1);
        return F.c.append<T>(F.b, k, v, 9);
      },
      2, fill_pool);
  expect_out_of_blocks([](Fixture& F) { return F.c.extend(F.b, 9); }, 2, fill_pool);
  expect_out_of_blocks([](Fixture& F) { return F.c.extend(F.b, 9, Phase::kPrefill); }, 2, fill_pool);
  // A fresh, empty sequence asking for more than is free.
  const Op fresh_and_full = [](Fixture& F) {
    F.y = F.c.add_sequence();
    F.x = F.c.add_sequence();
    REQUIRE(F.append(F.x, 5 * 4).ok());
    REQUIRE(F.c.memory().blocks_free == 1);
  };
  expect_out_of_blocks([](Fixture& F) { return F.c.extend(F.y, 13, Phase::kPrefill); }, 4, fresh_and_full);
  expect_out_of_blocks(
      [](Fixture& F) {
        const auto k = F.kv(F.y, 5, 0), v = F.kv(F.y, 5, 1);
        return F.c.append<T>(F.y, k, v, 5, Phase::kPrefill);
      },
      2, fresh_and_full);
  // Block-table row full (kRow = 6 blocks = 24 tokens) while the pool still has room.
  expect_out_of_blocks(
      [](Fixture& F) {
        REQUIRE(F.c.memory().blocks_free >= 4);
        const auto k = F.kv(F.a, 13, 0), v = F.kv(F.a, 13, 1);
        return F.c.append<T>(F.a, k, v, 13);  // 12 + 13 = 25 > 24
      },
      4);
  expect_out_of_blocks([](Fixture& F) { return F.c.extend(F.a, 13); }, 4);
  // An absurd request is an ordinary out-of-blocks outcome, with a sane blocks_needed.
  expect_out_of_blocks([](Fixture& F) { return F.c.extend(F.b, std::numeric_limits<int>::max()); },
                       static_cast<int>((5 + std::int64_t{std::numeric_limits<int>::max()} + 3) / 4 - 2));
  // The boundary itself fits.
  Fixture F(KvLayout::kNHD);
  CHECK(F.append(F.a, 12).ok());
  CHECK(F.c.physical_length(F.a) == 24);
  CHECK(F.c.extend(F.a, 1).status == AppendStatus::kOutOfBlocks);
  CHECK(F.c.extend(F.a, 0).ok());
}

TEST_CASE("bad input: keep plans") {
  // a has 12 tokens. Each bad plan is bad only in its LAST row, so a compactor that worked row by
  // row before validating would already have moved data.
  auto last_row_bad = [](std::vector<std::int32_t> last) {
    KeepPlan p(kL, kH, static_cast<int>(last.size()));
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kH; ++h) {
        std::int32_t* r = p.row(l, h);
        for (int i = 0; i < p.keep; ++i) r[i] = 2 * i + 1;  // moves data in every good row
      }
    std::copy(last.begin(), last.end(), p.row(kL - 1, kH - 1));
    return p;
  };
  const KeepPlan unsorted = last_row_bad({1, 5, 3, 7});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, unsorted); },
                  {"layer 1, kv head 1, entry 2", "slot 3", "not in ascending order"});
  const KeepPlan dup = last_row_bad({1, 3, 3, 7});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, dup); }, {"entry 2", "slot 3", "duplicated"});
  const KeepPlan too_big = last_row_bad({1, 3, 5, 12});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, too_big); }, {"slot 12", "out of range [0, 12)"});
  const KeepPlan negative = last_row_bad({-1, 3, 5, 7});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, negative); }, {"slot -1", "out of range"});
  const KeepPlan huge = last_row_bad({1, 3, 5, std::numeric_limits<std::int32_t>::max()});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, huge); }, {"slot 2147483647", "out of range"});
  // Wrong shape.
  expect_rejected([](Fixture& F) { F.c.apply_keep_plan(F.a, KeepPlan(kL + 1, kH, 2)); }, {"shape [3, 2", "[2, 2"});
  expect_rejected([](Fixture& F) { F.c.apply_keep_plan(F.a, KeepPlan(kL - 1, kH, 2)); }, {"shape [1, 2"});
  expect_rejected([](Fixture& F) { F.c.apply_keep_plan(F.a, KeepPlan(kL, kH + 1, 2)); }, {"shape [2, 3"});
  expect_rejected([](Fixture& F) { F.c.apply_keep_plan(F.a, KeepPlan()); }, {"shape [0, 0"});
  {
    KeepPlan more = last_row_bad({1, 3, 5, 7});
    more.indices.push_back(9);
    expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, more); }, {"holds 17 indices", "= 16"});
    KeepPlan fewer = last_row_bad({1, 3, 5, 7});
    fewer.indices.pop_back();
    expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, fewer); }, {"holds 15 indices", "= 16"});
  }
  // keep > length, keep < 0.
  {
    KeepPlan p(kL, kH, 13);
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kH; ++h) std::iota(p.row(l, h), p.row(l, h) + 13, 0);
    expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, p); }, {"keeps 13", "of 12"});
    KeepPlan neg;
    neg.num_layers = kL;
    neg.num_kv_heads = kH;
    neg.keep = -1;
    expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, neg); }, {"keeps -1"});
  }
  // Negative counts are caught when the plan is built, not by a wrapped allocation.
  for (const auto& [l, h, k] : {std::tuple{-1, 2, 2}, std::tuple{2, -2, 2}, std::tuple{2, 2, -3}}) {
    const std::string msg = logic_error_message([&] { KeepPlan p(l, h, k); });
    CAPTURE(msg);
    CHECK(msg.find("KeepPlan(layers = " + std::to_string(l) + ", kv_heads = " + std::to_string(h) +
                   ", keep = " + std::to_string(k) + ")") != std::string::npos);
  }
  // A plan valid for another sequence's length is checked against this one's (b has 5 tokens).
  const KeepPlan for_a = last_row_bad({1, 3, 5, 7});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.b, for_a); }, {"slot 5", "out of range [0, 5)"});
}

TEST_CASE("bad input: mismatched tensor shapes and counts") {
  const std::size_t per_token = kL * kH * kD;
  expect_rejected([&](Fixture& F) { (void)F.c.append<T>(F.b, zeros(2 * per_token + 1), zeros(2 * per_token), 2); },
                  {"append", "k has 33", "v 32", "= 32"});
  expect_rejected([&](Fixture& F) { (void)F.c.append<T>(F.b, zeros(2 * per_token), zeros(2 * per_token - 1), 2); },
                  {"append", "v 31", "= 32"});
  expect_rejected([&](Fixture& F) { (void)F.c.append<T>(F.b, zeros(per_token), zeros(per_token), 2); },
                  {"k has 16", "= 32"});
  expect_rejected([&](Fixture& F) { (void)F.c.append<T>(F.b, zeros(0), zeros(0), -1); }, {"append", "n = -1"});
  expect_rejected([&](Fixture& F) { (void)F.c.extend(F.b, -1); }, {"extend", "n = -1"});
  expect_rejected([&](Fixture& F) { (void)F.c.extend(F.b, std::numeric_limits<int>::min()); },
                  {"n = -2147483648"});
  // write(): layer, slot range, counts and pointers.
  const auto k = zeros(per_token), v = zeros(per_token);
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, kL, 0, k.data(), v.data(), 1); }, {"write", "layer 2"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, -1, 0, k.data(), v.data(), 1); }, {"write", "layer -1"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, 0, 5, k.data(), v.data(), 1); }, {"slots [5, 6)", "length 5"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, 0, 4, k.data(), v.data(), 2); }, {"slots [4, 6)", "length 5"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, 0, -1, k.data(), v.data(), 1); }, {"slots [-1, 0)"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, 0, 0, k.data(), v.data(), -1); }, {"slots [0, -1)"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, 0, 0, nullptr, v.data(), 1); }, {"write", "null"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.b, 0, 0, k.data(), nullptr, 1); }, {"write", "null"});
}

TEST_CASE("bad input: wrong dtype") {
  const std::size_t per_token = kL * kH * kD;
  const std::vector<float> kf(per_token), vf(per_token);
  const std::vector<f16_storage> kh(per_token, f16_storage{0}), vh(per_token, f16_storage{0});
  expect_rejected([&](Fixture& F) { (void)F.c.append<float>(F.b, kf, vf, 1); }, {"append", "float32", "bfloat16"});
  expect_rejected([&](Fixture& F) { (void)F.c.append<f16_storage>(F.b, kh, vh, 1); },
                  {"append", "float16", "bfloat16"});
  expect_rejected([&](Fixture& F) { F.c.write<float>(F.b, 0, 0, kf.data(), vf.data(), 1); }, {"write", "float32"});
  expect_rejected([&](Fixture& F) { (void)F.c.view<f16_storage>(); }, {"view", "float16", "bfloat16"});
  expect_rejected([&](Fixture& F) { (void)F.c.view<float>(); }, {"view", "float32"});
  // Wrong dtype wins over other problems of the same call (it is checked first), and a wrong
  // dtype on an inactive sequence is still rejected without a change.
  expect_rejected([&](Fixture& F) { (void)F.c.append<float>(4, kf, vf, 1); }, {"float32"});
}

TEST_CASE("bad input: rewriting a shared (forked) block") {
  // a's blocks 0 and 1 are shared with f (ref count 2). Any compaction that moves data into
  // them, from either side, is refused.
  expect_rejected([](Fixture& F) { F.c.apply_keep_plan(F.a, Fixture::plan(12, 6)); },
                  {"apply_keep_plan", "block 0", "shares"});
  expect_rejected(
      [](Fixture& F) {
        KeepPlan p(kL, kH, 7);  // moves only from slot 5 on: block 1 (slots 4..7) is shared
        for (int l = 0; l < kL; ++l)
          for (int h = 0; h < kH; ++h)
            for (int i = 0; i < 7; ++i) p.row(l, h)[i] = i < 5 ? i : i + 1 + h;
        F.c.apply_keep_plan(F.a, p);
      },
      {"block 1", "slots from 4", "sequence 0"});
  expect_rejected([](Fixture& F) { F.c.apply_keep_plan(F.f, Fixture::plan(9, 3)); },
                  {"block 0", "sequence 3", "shares"});
  // Only the last row moves data, into shared block 0: still refused as a whole.
  expect_rejected(
      [](Fixture& F) {
        KeepPlan p(kL, kH, 9);
        for (int l = 0; l < kL; ++l)
          for (int h = 0; h < kH; ++h) std::iota(p.row(l, h), p.row(l, h) + 9, 0);
        std::iota(p.row(kL - 1, kH - 1), p.row(kL - 1, kH - 1) + 9, 3);
        F.c.apply_keep_plan(F.a, p);
      },
      {"block 0"});
  // A prefix plan that would leave a shared block partly filled: the next append would write
  // into the slots the other sequence still reads.
  const auto prefix = [](int keep) {
    KeepPlan p(kL, kH, keep);
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kH; ++h) std::iota(p.row(l, h), p.row(l, h) + keep, 0);
    return p;
  };
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.a, prefix(6)); },
                  {"apply_keep_plan", "block 1", "partly", "sequence 0"});
  expect_rejected([&](Fixture& F) { F.c.apply_keep_plan(F.f, prefix(3)); }, {"block 0", "partly", "sequence 3"});
  // write() into a shared slot.
  const auto k = zeros(kH * kD), v = zeros(kH * kD);
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.f, 0, 7, k.data(), v.data(), 1); },
                  {"write", "block 1", "shares"});
  expect_rejected([&](Fixture& F) { F.c.write<T>(F.a, 1, 0, k.data(), v.data(), 1); }, {"write", "block 0"});
  // What is allowed: prefix plans ending on a block boundary, and compaction past the shared blocks.
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    Fixture F(layout);
    const Snapshot before = snap(F.c);
    F.c.apply_keep_plan(F.a, prefix(8));
    CHECK(F.c.physical_length(F.a) == 8);
    CHECK(F.c.allocator().ref_count(F.c.block_table(F.a)[1]) == 2);
    CHECK(snap(F.c).raw == before.raw);
    REQUIRE(F.append(F.a, 1).ok());
    CHECK(F.c.block_table(F.a).size() == 3);
    KeepPlan p(kL, kH, 9);
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kH; ++h) std::iota(p.row(l, h), p.row(l, h) + 9, 0);
    F.c.apply_keep_plan(F.f, p);  // identity on f: nothing to rewrite
    CHECK(F.c.physical_length(F.f) == 9);
  }
}

TEST_CASE("bad input: prefill after decode and bad fork sizes") {
  // a has decode tokens: a prefill extend is refused before anything moves.
  expect_rejected([](Fixture& F) { (void)F.c.extend(F.a, 1, Phase::kPrefill); }, {"prefill", "sequence 0"});
  expect_rejected([](Fixture& F) { (void)F.c.extend(F.a, 5, Phase::kPrefill); }, {"prefill", "sequence 0"});
  expect_rejected(
      [](Fixture& F) {
        const auto k = F.kv(F.a, 2, 0), v = F.kv(F.a, 2, 1);
        (void)F.c.append<T>(F.a, k, v, 2, Phase::kPrefill);
      },
      {"prefill", "sequence 0"});
  // fork_prefix: tokens must be whole blocks within the parent's length.
  expect_rejected([](Fixture& F) { (void)F.c.fork_prefix(F.a, 3); }, {"fork_prefix", "tokens = 3", "block_size = 4"});
  expect_rejected([](Fixture& F) { (void)F.c.fork_prefix(F.a, 16); }, {"tokens = 16", "length 12"});
  expect_rejected([](Fixture& F) { (void)F.c.fork_prefix(F.a, -4); }, {"tokens = -4"});
  expect_rejected([](Fixture& F) { (void)F.c.fork_prefix(F.b, 8); }, {"tokens = 8", "length 5"});
}

TEST_CASE("bad input: every invalid CacheConfig field is named with its value") {
  struct Case {
    std::function<void(CacheConfig&)> edit;
    std::vector<std::string> must;
  };
  const std::vector<Case> cases = {
      {[](CacheConfig& c) { c.model.num_layers = 0; }, {"num_layers = 0"}},
      {[](CacheConfig& c) { c.model.num_layers = -3; }, {"num_layers = -3"}},
      {[](CacheConfig& c) { c.model.num_q_heads = 0; }, {"num_q_heads = 0"}},
      {[](CacheConfig& c) { c.model.num_q_heads = -4; }, {"num_q_heads = -4"}},
      {[](CacheConfig& c) { c.model.num_kv_heads = 0; }, {"num_kv_heads = 0"}},
      {[](CacheConfig& c) { c.model.num_kv_heads = -2; }, {"num_kv_heads = -2"}},
      {[](CacheConfig& c) { c.model.num_q_heads = 6; c.model.num_kv_heads = 4; }, {"num_q_heads = 6", "num_kv_heads = 4"}},
      {[](CacheConfig& c) { c.model.num_q_heads = 2; c.model.num_kv_heads = 4; }, {"num_q_heads = 2", "num_kv_heads = 4"}},
      {[](CacheConfig& c) { c.model.head_dim = 0; }, {"head_dim = 0"}},
      {[](CacheConfig& c) { c.model.head_dim = -8; }, {"head_dim = -8"}},
      {[](CacheConfig& c) { c.model.head_dim = 7; }, {"head_dim = 7", "even"}},
      {[](CacheConfig& c) { c.block_size = 0; }, {"block_size = 0"}},
      {[](CacheConfig& c) { c.block_size = -16; }, {"block_size = -16"}},
      {[](CacheConfig& c) { c.num_blocks = 0; }, {"num_blocks = 0"}},
      {[](CacheConfig& c) { c.num_blocks = -1; }, {"num_blocks = -1"}},
      {[](CacheConfig& c) { c.max_seqs = 0; }, {"max_seqs = 0"}},
      {[](CacheConfig& c) { c.max_seqs = -5; }, {"max_seqs = -5"}},
      {[](CacheConfig& c) { c.max_blocks_per_seq = -1; }, {"max_blocks_per_seq = -1"}},
      {[](CacheConfig& c) { c.max_blocks_per_seq = kBlocks + 1; }, {"max_blocks_per_seq = 13", "num_blocks = 12"}},
      {[](CacheConfig& c) { c.layout = static_cast<KvLayout>(2); }, {"layout = 2"}},
      {[](CacheConfig& c) { c.layout = static_cast<KvLayout>(-1); }, {"layout = -1"}},
      {[](CacheConfig& c) { c.dtype = static_cast<DType>(4); }, {"dtype = 4"}},
      {[](CacheConfig& c) { c.dtype = static_cast<DType>(-1); }, {"dtype = -1"}},
      // 65536 blocks of 65536 tokens: a sequence could exceed int32 token indices.
      {[](CacheConfig& c) { c.block_size = 65536; c.num_blocks = 65536; c.max_blocks_per_seq = 0; }, {"4294967296", "int32"}},
      // Sizes whose product overflows 64-bit byte counts must not wrap to a tiny allocation.
      {[](CacheConfig& c) {
         c.model = ModelGeometry{1 << 20, 1 << 12, 1 << 12, 1 << 12};
         c.block_size = 1 << 10;
         c.num_blocks = 1 << 10;
       },
       {"bytes", "overflow"}},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(i);
    CacheConfig cfg = base_config(KvLayout::kNHD);
    cfg.validate();  // the base is valid
    cases[i].edit(cfg);
    const std::string direct = logic_error_message([&] { cfg.validate(); });
    const std::string built = logic_error_message([&] { KvCache<> c(cfg); });
    CAPTURE(direct);
    CAPTURE(built);
    for (const auto& m : cases[i].must) {
      CHECK(direct.find(m) != std::string::npos);
      CHECK(built.find(m) != std::string::npos);
    }
  }
  // Boundary values that are valid.
  CacheConfig ok = base_config(KvLayout::kHND);
  ok.max_blocks_per_seq = kBlocks;
  CHECK_NOTHROW(ok.validate());
  ok.max_blocks_per_seq = 0;
  ok.block_size = 1;
  ok.max_seqs = 1;
  ok.model = ModelGeometry{1, 1, 1, 2};
  CHECK_NOTHROW(ok.validate());
  CHECK_NOTHROW((void)KvCache<>(ok));
}

}  // TEST_SUITE

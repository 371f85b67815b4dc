// SPDX-License-Identifier: Apache-2.0
// Randomized soak of KvCache<> on the CPU: 100,000 add / append (prefill and decode) / compact /
// release / fork_prefix operations, plus out-of-blocks events and rejected bad calls, checked
// against a plain model. The model keeps, per sequence and per (layer, KV head), the list of
// token ids in slot order, and abstract block handles with holder counts (sharing). Every K/V
// element is a unique function of (sequence uid, token index, layer, K|V, head, dim), read back
// from raw memory at addresses computed here from the layout definitions.
//
// After every operation the touched sequence is checked completely (bookkeeping and every byte);
// every 64 operations and at the end, everything is: all sequences' bytes, block counts
// (used == distinct live handles, i.e. sum of ceil(len / block_size) minus sharing, free + used ==
// capacity), a consistent handle <-> block id bijection, every block's reference count, host block
// tables and lengths, and the memory stats. Seed: TRIATTN_SOAK_SEED (default fixed), printed.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <triattn/core/hash.hpp>
#include <triattn/core/kv_cache.hpp>

using namespace triattn;

namespace {

struct Tok {
  std::uint32_t uid;
  std::int32_t idx;
};

template <class T>
T content(Tok t, int layer, int kind, int head, int d) {
  const std::uint64_t h = mix64((static_cast<std::uint64_t>(t.uid) << 32 | static_cast<std::uint32_t>(t.idx)) ^
                                mix64(static_cast<std::uint64_t>(((layer * 2 + kind) * 64 + head) * 64 + d)));
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

std::uint64_t seed_from_env(std::uint64_t fallback) {
  if (const char* s = std::getenv("TRIATTN_SOAK_SEED"); s != nullptr && *s != '\0') return std::strtoull(s, nullptr, 0);
  return fallback;
}

template <class T>
class Soak {
 public:
  Soak(const CacheConfig& cfg, std::uint64_t seed)
      : cfg_(cfg), cache_(cfg), rng_(seed), seqs_(static_cast<std::size_t>(cfg.max_seqs)),
        r2h_(static_cast<std::size_t>(cfg.num_blocks), -1) {}

  struct Counts {
    long add = 0, fork = 0, release = 0, append_ok = 0, append_oob = 0, prefill = 0, compact = 0,
         compact_refused = 0, bad_rejected = 0, full_checks = 0;
  };

  /// Runs `ops` operations; returns an empty string or the first discrepancy.
  std::string run(int ops) {
    for (op_ = 0; op_ < ops; ++op_) {
      std::string err = step();
      if (err.empty() && (op_ % 64 == 63 || op_ == ops - 1)) {
        err = check_all();
        ++counts_.full_checks;
      }
      if (!err.empty()) return "op #" + std::to_string(op_) + " (" + last_op_ + "): " + err;
    }
    return {};
  }
  const Counts& counts() const { return counts_; }

 private:
  struct MSeq {
    std::uint32_t uid = 0;
    std::int64_t logical = 0;
    int prompt = 0;
    std::vector<std::vector<Tok>> toks;  // [layer * H + head] -> token ids in slot order
    std::vector<int> handles;            // model block handles, [ceil(len / bs)]
    int len() const { return static_cast<int>(toks[0].size()); }
  };

  int L() const { return cfg_.model.num_layers; }
  int H() const { return cfg_.model.num_kv_heads; }
  int D() const { return cfg_.model.head_dim; }
  int bs() const { return cfg_.block_size; }
  int cap_tokens() const { return cfg_.blocks_per_seq() * cfg_.block_size; }
  int free_blocks() const { return cfg_.num_blocks - static_cast<int>(holders_.size()); }
  int rand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }  // [lo, hi]
  bool chance(int percent) { return rand(0, 99) < percent; }

  std::vector<SeqId> active() const {
    std::vector<SeqId> a;
    for (SeqId s = 0; s < cfg_.max_seqs; ++s)
      if (seqs_[static_cast<std::size_t>(s)]) a.push_back(s);
    return a;
  }
  MSeq& m(SeqId s) { return *seqs_[static_cast<std::size_t>(s)]; }

  int new_handle() {
    const int h = next_handle_++;
    holders_[h] = 1;
    return h;
  }
  void drop_handle(int h) {
    auto it = holders_.find(h);
    if (--it->second > 0) return;
    holders_.erase(it);
    if (auto jt = h2r_.find(h); jt != h2r_.end()) {
      r2h_[static_cast<std::size_t>(jt->second)] = -1;
      h2r_.erase(jt);
    }
  }

  // ---- one random operation ----------------------------------------------------------------------
  std::string step() {
    const auto act = active();
    const bool room = static_cast<int>(act.size()) < cfg_.max_seqs;
    const int r = rand(0, 99);
    if (act.empty() || (room && r < 6)) return op_add();
    const SeqId s = act[static_cast<std::size_t>(rand(0, static_cast<int>(act.size()) - 1))];
    if (r < 10 && room) return op_fork(s);
    if (r < 14) return op_release(s);
    if (r < 24) return op_compact(s);
    if (r < 27) return op_bad(s);
    const bool big = chance(15);
    const int n = big ? rand(0, 12) : 1;
    Phase ph = Phase::kDecode;
    if (m(s).prompt == m(s).len() && chance(50)) ph = Phase::kPrefill;  // prefill allowed while all cached is prompt
    return op_append(s, n, ph);
  }

  std::string op_add() {
    last_op_ = "add_sequence";
    const SeqId s = cache_.add_sequence();
    if (s < 0 || s >= cfg_.max_seqs || seqs_[static_cast<std::size_t>(s)]) return "add_sequence returned slot " + std::to_string(s);
    MSeq q;
    q.uid = next_uid_++;
    q.toks.assign(static_cast<std::size_t>(L() * H()), {});
    seqs_[static_cast<std::size_t>(s)] = std::move(q);
    ++counts_.add;
    return check_seq(s);
  }

  std::string op_fork(SeqId parent) {
    const int tokens = bs() * rand(0, cache_.forkable_prefix(parent) / bs());
    last_op_ = "fork_prefix(" + std::to_string(parent) + ", " + std::to_string(tokens) + ")";
    const SeqId c = cache_.fork_prefix(parent, tokens);
    if (c < 0 || c >= cfg_.max_seqs || seqs_[static_cast<std::size_t>(c)]) return "fork_prefix returned slot " + std::to_string(c);
    MSeq q;
    const MSeq& p = m(parent);
    q.uid = next_uid_++;
    q.logical = tokens;
    q.prompt = std::min(p.prompt, tokens);
    for (const auto& row : p.toks) q.toks.emplace_back(row.begin(), row.begin() + tokens);
    for (int j = 0; j < tokens / bs(); ++j) {
      const int h = p.handles[static_cast<std::size_t>(j)];
      ++holders_[h];
      q.handles.push_back(h);
    }
    seqs_[static_cast<std::size_t>(c)] = std::move(q);
    ++counts_.fork;
    std::string e = check_seq(c);
    return e.empty() ? check_seq(parent) : e;
  }

  std::string op_release(SeqId s) {
    last_op_ = "release(" + std::to_string(s) + ")";
    cache_.release(s);
    for (int h : m(s).handles) drop_handle(h);
    seqs_[static_cast<std::size_t>(s)].reset();
    ++counts_.release;
    if (cache_.is_active(s)) return "still active after release";
    return check_blocks_count();
  }

  void make_kv(const MSeq& q, int n, std::vector<T>& k, std::vector<T>& v) const {
    k.resize(static_cast<std::size_t>(L()) * n * H() * D());
    v.resize(k.size());
    std::size_t i = 0;
    for (int l = 0; l < L(); ++l)
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < H(); ++h)
          for (int d = 0; d < D(); ++d, ++i) {
            const Tok tok{q.uid, static_cast<std::int32_t>(q.logical + t)};
            k[i] = content<T>(tok, l, 0, h, d);
            v[i] = content<T>(tok, l, 1, h, d);
          }
  }

  std::string op_append(SeqId s, int n, Phase ph) {
    MSeq& q = m(s);
    last_op_ = "append(" + std::to_string(s) + ", n = " + std::to_string(n) +
               (ph == Phase::kPrefill ? ", prefill)" : ", decode)");
    const int len = q.len();
    const int need = (len + n + bs() - 1) / bs() - static_cast<int>(q.handles.size());
    const bool oob = len + n > cap_tokens() || need > free_blocks();
    make_kv(q, n, k_, v_);
    const AppendResult r = cache_.append<T>(s, std::span<const T>(k_), std::span<const T>(v_), n, ph);
    if (r.first_slot != len) return "first_slot " + std::to_string(r.first_slot) + ", expected " + std::to_string(len);
    if (r.blocks_needed != std::max(need, 0))
      return "blocks_needed " + std::to_string(r.blocks_needed) + ", expected " + std::to_string(need);
    if (oob) {
      if (r.status != AppendStatus::kOutOfBlocks) return "expected kOutOfBlocks";
      ++counts_.append_oob;
      return check_seq(s);
    }
    if (r.status != AppendStatus::kOk) return "unexpected kOutOfBlocks";
    for (int j = 0; j < need; ++j) q.handles.push_back(new_handle());
    for (int t = 0; t < n; ++t)
      for (auto& row : q.toks) row.push_back(Tok{q.uid, static_cast<std::int32_t>(q.logical + t)});
    q.logical += n;
    if (ph == Phase::kPrefill) {
      q.prompt += n;
      ++counts_.prefill;
    }
    ++counts_.append_ok;
    return check_seq(s);
  }

  /// Leading tokens of s that sit in blocks shared with another sequence.
  int shared_prefix_tokens(const MSeq& q) const {
    int j = 0;
    while (j < static_cast<int>(q.handles.size()) && holders_.at(q.handles[static_cast<std::size_t>(j)]) > 1) ++j;
    return j * bs();
  }

  KeepPlan random_plan(const MSeq& q) {
    const int len = q.len();
    int keep;
    switch (rand(0, 3)) {
      case 0: keep = rand(0, len); break;
      case 1: keep = std::max(0, len - rand(0, 4)); break;
      case 2: keep = len / 2; break;
      default: keep = rand(0, std::min(len, 2 * bs())); break;
    }
    int fixed = 0;  // slots kept in place in every row
    const int mode = rand(0, 3);
    if (mode == 0) fixed = std::min(keep, shared_prefix_tokens(q));
    else if (mode == 1) fixed = std::min(keep, q.prompt);
    else if (mode == 2 && chance(30)) fixed = keep;  // a prefix plan: moves nothing
    KeepPlan p(L(), H(), keep);
    std::vector<std::int32_t> pool(static_cast<std::size_t>(len - fixed));
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h) {
        std::int32_t* row = p.row(l, h);
        for (int i = 0; i < fixed; ++i) row[i] = i;
        std::iota(pool.begin(), pool.end(), fixed);
        for (int i = 0; i < keep - fixed; ++i) {  // partial Fisher-Yates
          const int j = rand(i, static_cast<int>(pool.size()) - 1);
          std::swap(pool[static_cast<std::size_t>(i)], pool[static_cast<std::size_t>(j)]);
          row[fixed + i] = pool[static_cast<std::size_t>(i)];
        }
        std::sort(row + fixed, row + keep);
      }
    return p;
  }

  std::string op_compact(SeqId s) {
    MSeq& q = m(s);
    const KeepPlan p = random_plan(q);
    const int len = q.len();
    last_op_ = "apply_keep_plan(" + std::to_string(s) + ", len " + std::to_string(len) + ", keep " +
               std::to_string(p.keep) + ")";
    int first_moved = p.keep;
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h)
        for (int i = 0; i < p.keep; ++i)
          if (p.row(l, h)[i] != i) {
            first_moved = std::min(first_moved, i);
            break;
          }
    // Refused when it would rewrite a shared block, or leave one partly filled.
    bool refuse = false;
    if (first_moved < p.keep)
      for (int j = first_moved / bs(); j < (p.keep + bs() - 1) / bs(); ++j)
        refuse |= holders_.at(q.handles[static_cast<std::size_t>(j)]) > 1;
    if (p.keep < len && p.keep % bs() != 0)
      refuse |= holders_.at(q.handles[static_cast<std::size_t>((p.keep - 1) / bs())]) > 1;
    bool threw = false;
    try {
      cache_.apply_keep_plan(s, p);
    } catch (const triattn::logic_error&) {
      threw = true;
    }
    if (threw != refuse) return refuse ? "expected a refusal (shared block)" : "unexpected refusal";
    if (refuse) {
      ++counts_.compact_refused;
      return check_seq(s);
    }
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h) {
        auto& row = q.toks[static_cast<std::size_t>(l * H() + h)];
        std::vector<Tok> kept;
        kept.reserve(static_cast<std::size_t>(p.keep));
        for (int i = 0; i < p.keep; ++i) kept.push_back(row[static_cast<std::size_t>(p.row(l, h)[i])]);
        row = std::move(kept);
      }
    q.prompt = std::min(q.prompt, first_moved);
    const std::size_t nb = static_cast<std::size_t>((p.keep + bs() - 1) / bs());
    while (q.handles.size() > nb) {
      drop_handle(q.handles.back());
      q.handles.pop_back();
    }
    ++counts_.compact;
    std::string e = check_seq(s);
    return e.empty() ? check_blocks_count() : e;
  }

  /// A call that must be rejected with logic_error and change nothing.
  std::string op_bad(SeqId s) {
    MSeq& q = m(s);
    int kind = rand(0, 5);
    if (kind == 1 && q.prompt == q.len()) kind = 2;  // prefill is allowed there: pick another bad call
    last_op_ = "bad call #" + std::to_string(kind) + " on " + std::to_string(s);
    bool threw = false;
    try {
      switch (kind) {
        case 0: {  // a plan with one broken row
          KeepPlan p = random_plan(q);
          if (p.keep == 0) p = KeepPlan(L(), H() + 1, 0);
          else {
            std::int32_t* row = p.row(rand(0, L() - 1), rand(0, H() - 1));
            const int i = rand(0, p.keep - 1);
            row[i] = chance(50) ? q.len() : (i > 0 ? row[i - 1] : -1);
          }
          cache_.apply_keep_plan(s, p);
          break;
        }
        case 1: {  // prefill after a decode token (or on a compacted prompt): only when not allowed
          make_kv(q, 1, k_, v_);
          (void)cache_.append<T>(s, std::span<const T>(k_), std::span<const T>(v_), 1, Phase::kPrefill);
          break;
        }
        case 2: {  // wrong element count
          make_kv(q, 2, k_, v_);
          k_.pop_back();
          (void)cache_.append<T>(s, std::span<const T>(k_), std::span<const T>(v_), 2);
          break;
        }
        case 3: {  // inactive sequence
          SeqId dead = -1;
          for (SeqId x = 0; x < cfg_.max_seqs; ++x)
            if (!seqs_[static_cast<std::size_t>(x)]) dead = x;
          make_kv(q, 1, k_, v_);
          (void)cache_.append<T>(dead, std::span<const T>(k_), std::span<const T>(v_), 1);
          break;
        }
        case 4:  // fork of a length that is not whole blocks
          (void)cache_.fork_prefix(s, q.len() % bs() == 0 ? q.len() + bs() : q.len());
          break;
        default:  // write past the physical length
          make_kv(q, 1, k_, v_);
          cache_.write<T>(s, rand(0, L() - 1), q.len(), k_.data(), v_.data(), 1);
          break;
      }
    } catch (const triattn::logic_error&) {
      threw = true;
    }
    if (!threw) return "a bad call was accepted";
    ++counts_.bad_rejected;
    std::string e = check_seq(s);
    return e.empty() ? check_blocks_count() : e;
  }

  // ---- checks ---------------------------------------------------------------------------------------
  const T* elem(int layer, int kind, std::int32_t block, int slot_in_block, int head) const {
    const std::int64_t range_elems = cfg_.block_bytes() * cfg_.num_blocks / static_cast<std::int64_t>(sizeof(T));
    const std::int64_t off = cfg_.layout == KvLayout::kNHD
                                 ? ((block * bs() + slot_in_block) * H() + head) * D()
                                 : ((static_cast<std::int64_t>(block) * H() + head) * bs() + slot_in_block) * D();
    return static_cast<const T*>(cache_.allocator().data()) + (2 * layer + kind) * range_elems + off;
  }

  std::string check_blocks_count() const {
    const MemoryStats ms = cache_.memory();
    if (ms.blocks_used != holders_.size())
      return "blocks used " + std::to_string(ms.blocks_used) + ", model " + std::to_string(holders_.size());
    if (ms.blocks_free + ms.blocks_used != ms.blocks_total || ms.blocks_total != static_cast<std::size_t>(cfg_.num_blocks))
      return "free + used != capacity";
    return {};
  }

  /// Bookkeeping and every byte of one sequence; maps new handles to block ids.
  std::string check_seq(SeqId s) {
    std::ostringstream err;
    if (!cache_.is_active(s)) return "sequence " + std::to_string(s) + " not active";
    const MSeq& q = m(s);
    if (cache_.physical_length(s) != q.len()) err << "length " << cache_.physical_length(s) << " vs " << q.len() << "; ";
    if (cache_.logical_position(s) != q.logical) err << "logical " << cache_.logical_position(s) << " vs " << q.logical << "; ";
    if (cache_.prompt_length(s) != q.prompt) err << "prompt " << cache_.prompt_length(s) << " vs " << q.prompt << "; ";
    const auto table = cache_.block_table(s);
    if (table.size() != q.handles.size()) err << "table size " << table.size() << " vs " << q.handles.size() << "; ";
    if (cache_.host_lengths()[static_cast<std::size_t>(s)] != q.len()) err << "host length; ";
    if (!err.str().empty()) return "sequence " + std::to_string(s) + ": " + err.str();
    for (std::size_t j = 0; j < table.size(); ++j) {
      const std::int32_t real = table[j];
      const int h = q.handles[j];
      if (real < 0 || real >= cfg_.num_blocks) return "block id " + std::to_string(real) + " out of range";
      if (auto it = h2r_.find(h); it != h2r_.end()) {
        if (it->second != real)
          return "sequence " + std::to_string(s) + " entry " + std::to_string(j) + " is block " + std::to_string(real) +
                 ", model says " + std::to_string(it->second);
      } else {
        if (r2h_[static_cast<std::size_t>(real)] != -1)
          return "block " + std::to_string(real) + " handed out while still live (duplicated block)";
        h2r_[h] = real;
        r2h_[static_cast<std::size_t>(real)] = h;
      }
      if (cache_.allocator().ref_count(real) != holders_.at(h))
        return "block " + std::to_string(real) + " ref count " + std::to_string(cache_.allocator().ref_count(real)) +
               ", model " + std::to_string(holders_.at(h));
    }
    const auto row = cache_.host_block_tables().subspan(static_cast<std::size_t>(s) * cfg_.blocks_per_seq(),
                                                        static_cast<std::size_t>(cfg_.blocks_per_seq()));
    for (std::size_t j = table.size(); j < row.size(); ++j)
      if (row[j] != -1) return "block table row not -1 padded";
    for (int l = 0; l < L(); ++l)
      for (int h = 0; h < H(); ++h) {
        const auto& toks = q.toks[static_cast<std::size_t>(l * H() + h)];
        for (int slot = 0; slot < q.len(); ++slot)
          for (int kind = 0; kind < 2; ++kind) {
            const T* p = elem(l, kind, table[static_cast<std::size_t>(slot / bs())], slot % bs(), h);
            for (int d = 0; d < D(); ++d) {
              const T want = content<T>(toks[static_cast<std::size_t>(slot)], l, kind, h, d);
              if (std::memcmp(p + d, &want, sizeof(T)) != 0)
                return "sequence " + std::to_string(s) + " (layer " + std::to_string(l) + ", " + (kind ? "V" : "K") +
                       ", head " + std::to_string(h) + ", slot " + std::to_string(slot) + ", dim " + std::to_string(d) +
                       ") does not hold token (" + std::to_string(toks[static_cast<std::size_t>(slot)].uid) + ", " +
                       std::to_string(toks[static_cast<std::size_t>(slot)].idx) + ")";
            }
          }
      }
    return {};
  }

  std::string check_all() {
    std::int64_t cached = 0, logical = 0;
    for (SeqId s = 0; s < cfg_.max_seqs; ++s) {
      const bool want = seqs_[static_cast<std::size_t>(s)].has_value();
      if (cache_.is_active(s) != want) return "sequence " + std::to_string(s) + " activity differs from the model";
      if (!want) {
        if (cache_.host_lengths()[static_cast<std::size_t>(s)] != 0) return "inactive slot with a length";
        for (int j = 0; j < cfg_.blocks_per_seq(); ++j)
          if (cache_.host_block_tables()[static_cast<std::size_t>(s) * cfg_.blocks_per_seq() + j] != -1)
            return "inactive slot with blocks";
        continue;
      }
      if (std::string e = check_seq(s); !e.empty()) return e;
      // The model itself holds no duplicated token in any row.
      for (const auto& row : m(s).toks)
        for (std::size_t i = 1; i < row.size(); ++i)
          if (row[i].uid == row[i - 1].uid && row[i].idx <= row[i - 1].idx) return "model row not ordered";
      cached += m(s).len();
      logical += m(s).logical;
    }
    if (std::string e = check_blocks_count(); !e.empty()) return e;
    // Every handle is mapped; blocks not mapped are free.
    if (h2r_.size() != holders_.size()) return "live handles without a block";
    for (std::int32_t b = 0; b < cfg_.num_blocks; ++b)
      if (r2h_[static_cast<std::size_t>(b)] == -1 && cache_.allocator().ref_count(b) != 0)
        return "block " + std::to_string(b) + " is referenced but no sequence holds it (leak)";
    const MemoryStats ms = cache_.memory();
    if (ms.cached_tokens != cached || ms.logical_tokens != logical) return "memory(): token counts";
    if (ms.bytes_live != static_cast<std::size_t>(cached) * static_cast<std::size_t>(cfg_.token_bytes()))
      return "memory(): bytes_live";
    if (ms.bytes_in_used_blocks != holders_.size() * static_cast<std::size_t>(cfg_.block_bytes_all_ranges()))
      return "memory(): bytes_in_used_blocks";
    if (cache_.num_active() != static_cast<int>(active().size())) return "num_active";
    return {};
  }

  CacheConfig cfg_;
  KvCache<> cache_;
  std::mt19937_64 rng_;
  std::vector<std::optional<MSeq>> seqs_;  // by slot
  std::unordered_map<int, int> holders_;   // live handle -> sequences holding it
  std::unordered_map<int, std::int32_t> h2r_;
  std::vector<int> r2h_;                   // block id -> live handle or -1
  int next_handle_ = 0;
  std::uint32_t next_uid_ = 1;
  int op_ = 0;
  std::string last_op_;
  std::vector<T> k_, v_;
  Counts counts_;
};

CacheConfig soak_config(DType dt, KvLayout layout, int bs, int head_dim) {
  CacheConfig c;
  c.model = ModelGeometry{2, 4, 2, head_dim};
  c.block_size = bs;
  c.num_blocks = 40;
  c.max_seqs = 8;
  c.max_blocks_per_seq = 16;
  c.layout = layout;
  c.dtype = dt;
  return c;
}

template <class T>
void run_soak(KvLayout layout, int bs, int head_dim, int ops, std::uint64_t default_seed) {
  const std::uint64_t seed = seed_from_env(default_seed);
  std::printf("[soak] %s %s block_size %d head_dim %d: %d ops, seed %llu (set TRIATTN_SOAK_SEED to replay)\n",
              dtype_name(dtype_of<T>), layout_name(layout), bs, head_dim, ops, static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  INFO("seed = " << seed);
  const auto t0 = std::chrono::steady_clock::now();
  Soak<T> soak(soak_config(dtype_of<T>, layout, bs, head_dim), seed);
  const std::string err = soak.run(ops);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_MESSAGE(err.empty(), err);
  const auto& c = soak.counts();
  std::printf("[soak]   %.2f s: add %ld, fork %ld, release %ld, append ok %ld (prefill %ld), out-of-blocks %ld, "
              "compact %ld, refused (shared) %ld, bad calls rejected %ld, full checks %ld\n",
              secs, c.add, c.fork, c.release, c.append_ok, c.prefill, c.append_oob, c.compact, c.compact_refused,
              c.bad_rejected, c.full_checks);
  std::fflush(stdout);
  // The run exercised every kind of event.
  CHECK(c.add > 0);
  CHECK(c.fork > 0);
  CHECK(c.release > 0);
  CHECK(c.append_ok > 0);
  CHECK(c.prefill > 0);
  CHECK(c.append_oob > 0);
  CHECK(c.compact > 0);
  CHECK(c.compact_refused > 0);
  CHECK(c.bad_rejected > 0);
  CHECK(c.full_checks >= ops / 64);
}

}  // namespace

TEST_SUITE("core") {

TEST_CASE("kv cache soak: 100000 random operations against a model (fp16 NHD block size 3)") {
  run_soak<f16_storage>(KvLayout::kNHD, 3, 4, 100'000, 20240601);
}

TEST_CASE("kv cache soak: other dtypes and layouts (25000 operations each)") {
  run_soak<bf16_storage>(KvLayout::kHND, 4, 8, 25'000, 7);
  run_soak<float>(KvLayout::kHND, 3, 4, 25'000, 8);
  run_soak<bf16_storage>(KvLayout::kNHD, 4, 6, 25'000, 9);
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// Keep sets pinned by a checked-in golden file (tests/core/golden/keep_sets.txt): a fixed set of
// decode runs with rounds (every pruning mode, the three prompt settings with sinks and windows,
// a prefix shared between two sequences, a ragged batch, f32 and bf16 KV) records, for every
// round of every sequence, the original logical positions each (layer, KV head) row keeps. Two
// paths must reproduce the file: KvCache::compress_if_needed, and the engine round
// (triattn::paged_round over the cache's view) committed with KvCache::commit_round. A change to
// the round's bookkeeping can therefore never change what is kept. With positions off (the
// default) the same runs leave the same K/V bytes, lengths and prompt state after every step,
// through both paths, and asking a report for positions is an error naming the option.
// Regenerate (only when the selection itself is meant to change) with
// TRIATTN_GOLDEN_WRITE=<path> ./test_core_test_keep_sets_golden.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/engine/paged_round.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/stats/random.hpp>

#include "common/round_settings.hpp"

using namespace triattn;
using triattn::test::kProtections;
using triattn::test::make_params;
using triattn::test::Protection;

namespace {

using Cache = KvCache<StaticAllocator<HostBackend>, HostCompactor, TriAttentionScorer, TopKSelector>;

constexpr int kL = 2, kHq = 4, kHkv = 2, kD = 16, kBlock = 8, kMaxTokens = 128, kSteps = 40;

constexpr PruningMode kModes[] = {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion};

const QueryStats& stats() {
  static const QueryStats s = [] {
    std::mt19937 rng(4242);
    return random_query_stats(rng, kL, kHq, kD);
  }();
  return s;
}

CacheConfig make_config(DType dt, bool positions) {
  CacheConfig c;
  c.model = ModelGeometry{kL, kHq, kHkv, kD};
  c.block_size = kBlock;
  c.max_blocks_per_seq = kMaxTokens / kBlock;
  c.max_seqs = 4;
  c.num_blocks = c.max_seqs * c.max_blocks_per_seq;
  c.dtype = dt;
  c.track_positions = positions;
  return c;
}

// Appends n random tokens to `seq` (the same draws for every path: one rng per run).
template <class T>
void append_random(Cache& c, SeqId seq, int n, Phase phase, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<T> k(static_cast<std::size_t>(kL) * n * kHkv * kD), v(k.size());
  for (T& x : k) x = from_float<T>(nd(rng));
  for (T& x : v) x = from_float<T>(nd(rng));
  REQUIRE(c.append(seq, std::span<const T>(k), std::span<const T>(v), n, phase).ok());
}

void record(std::ostringstream& os, const std::string& scenario, int step, const CompressionReport& r) {
  os << scenario << " step " << step << " seq " << r.seq << " len " << r.length_before << "->" << r.length_after
     << " status " << static_cast<int>(r.status);
  if (r.status == RoundStatus::kCompressed && !r.has_positions) {
    CHECK_THROWS_WITH_AS((void)r.kept(0), doctest::Contains("CacheConfig::track_positions"), logic_error);
    os << " | positions not tracked\n";
    return;
  }
  // Every (layer, KV head) in order, whichever row of the report stands for it.
  if (r.status == RoundStatus::kCompressed)
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kHkv; ++h) {
        const int row = r.kept_rows == 1 ? 0 : r.kept_rows == kHkv ? h : l * kHkv + h;
        os << " |";
        for (const std::int32_t p : r.kept(row)) os << ' ' << p;
      }
  os << '\n';
}

enum class Path { kCompressIfNeeded, kEngineRoundCommit };

// The engine round over the cache's own view for the due sequences of `ids`, then commit_round.
template <class T>
std::vector<CompressionReport> engine_round(Cache& c, const std::vector<SeqId>& ids) {
  const ModelGeometry& g = c.config().model;
  const SelectionParams& sp = c.selector().params();
  std::vector<SeqId> due;
  for (SeqId s : ids)
    if (c.needs_compression(s)) due.push_back(s);
  if (due.empty()) return {};
  const int B = static_cast<int>(due.size());
  std::vector<std::int64_t> t0;
  std::vector<std::int32_t> prompts, prot;
  for (SeqId s : due) {
    t0.push_back(c.logical_position(s));
    prompts.push_back(c.prompt_length(s));
    prot.push_back(c.shared_prefix(s));
  }
  const RoundBatch batch{due.data(), t0.data(), prompts.data(), B, kMaxTokens, prot.data()};
  // With positions off the commit needs no kept slots: only lengths and the first moved slot.
  const bool positions = c.config().track_positions;
  RoundResult res(B, positions ? kept_rows(sp.mode, g.num_layers, g.num_kv_heads) : 0, positions ? kMaxTokens : 0);
  std::vector<float> ws(paged_round_workspace_size(g, kMaxTokens) / sizeof(float));
  TriAttentionScorer scorer = c.scorer();
  (void)paged_round(c.template view<T>(), scorer, sp, g, RoundTrigger::kAlways, batch, res.outputs(), ws.data(),
                    ws.size() * sizeof(float));
  return c.commit_round(std::span<const SeqId>(due), res.outputs());
}

// Lengths, prompt state and a hash of the K/V bytes of every cached slot of `ids`.
template <class T>
void record_state(std::ostringstream& os, const Cache& c, const std::vector<SeqId>& ids, int step) {
  const auto v = c.template view<T>();
  for (SeqId s : ids) {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    const int len = c.physical_length(s);
    for (int l = 0; l < kL; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (int i = 0; i < len; ++i)
          for (int hd = 0; hd < kHkv; ++hd) {
            const auto* p = reinterpret_cast<const unsigned char*>(v.token(l, static_cast<KvKind>(kind), s, i, hd));
            for (std::size_t b = 0; b < sizeof(T) * kD; ++b) h = (h ^ p[b]) * 1099511628211ull;
          }
    os << "step " << step << " seq " << s << " len " << len << " logical " << c.logical_position(s) << " prompt "
       << c.prompt_length(s) << " forkable " << c.forkable_prefix(s) << " kv " << h << '\n';
    if (!c.config().track_positions) continue;
    // Independent of the cache's own bookkeeping: the leading slots whose token is still the one
    // of that index in every row bound the prompt and give the forkable prefix exactly.
    int in_order = len;
    for (int l = 0; l < kL; ++l)
      for (int hd = 0; hd < kHkv; ++hd) {
        const std::vector<std::int32_t> p = c.positions(s, l, hd);
        for (int i = 0; i < in_order; ++i)
          if (p[static_cast<std::size_t>(i)] != i) in_order = i;
      }
    CHECK(c.forkable_prefix(s) == in_order - in_order % kBlock);
    CHECK(c.prompt_length(s) <= in_order);
  }
}

// One scenario: sequence a (20 prompt tokens), b forked from a's first 16 (two shared blocks),
// c (9 prompt tokens) growing two tokens a step; a round is asked for after every step.
template <class T>
std::string run(PruningMode mode, const Protection& prot, Path path, bool positions, std::string* state = nullptr) {
  const DType dt = dtype_of<T>;
  const std::string scenario = std::string(to_string(mode)) + "/" + prot.name + "/" + dtype_name(dt);
  const SelectionParams sp = make_params(mode, prot);
  Cache c(make_config(dt, positions), TriAttentionScorer(stats(), RopeConfig{}, ScoringParams{}, kHkv),
          TopKSelector(sp));
  std::mt19937 rng(1234 + static_cast<unsigned>(mode) * 7 + static_cast<unsigned>(prot.prompt) * 3);
  const SeqId a = c.add_sequence();
  append_random<T>(c, a, 20, Phase::kPrefill, rng);
  const SeqId b = c.fork_prefix(a, 16);
  const SeqId cc = c.add_sequence();
  append_random<T>(c, cc, 9, Phase::kPrefill, rng);
  const std::vector<SeqId> ids{a, b, cc};
  std::ostringstream os;
  for (int step = 0; step < kSteps; ++step) {
    append_random<T>(c, a, 1, Phase::kDecode, rng);
    append_random<T>(c, b, 1, Phase::kDecode, rng);
    append_random<T>(c, cc, 2, Phase::kDecode, rng);
    const std::vector<CompressionReport> reps =
        path == Path::kCompressIfNeeded ? c.compress_if_needed(ids) : engine_round<T>(c, ids);
    for (const CompressionReport& r : reps) record(os, scenario, step, r);
    if (state != nullptr) {
      std::ostringstream st;
      record_state<T>(st, c, ids, step);
      *state += scenario + " " + st.str();
    }
  }
  return os.str();
}

std::string all_runs(Path path, bool positions) {
  std::string s;
  for (const PruningMode mode : kModes)
    for (const Protection& prot : kProtections) {
      s += run<float>(mode, prot, path, positions);
      s += run<bf16_storage>(mode, prot, path, positions);
    }
  return s;
}

std::filesystem::path golden_path() {
  return std::filesystem::path(__FILE__).parent_path() / "golden" / "keep_sets.txt";
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot read the golden file " << p.string());
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// First differing line, for a readable failure.
std::string first_difference(const std::string& got, const std::string& want) {
  std::istringstream g(got), w(want);
  std::string lg, lw;
  for (int line = 1;; ++line) {
    const bool hg = static_cast<bool>(std::getline(g, lg)), hw = static_cast<bool>(std::getline(w, lw));
    if (!hg && !hw) return "identical";
    if (lg != lw || hg != hw)
      return "line " + std::to_string(line) + "\n  got:  " + (hg ? lg : "<end>") + "\n  want: " + (hw ? lw : "<end>");
  }
}

}  // namespace

TEST_CASE("keep sets: compress_if_needed reproduces the golden file") {
  const std::string got = all_runs(Path::kCompressIfNeeded, true);
  if (const char* out = std::getenv("TRIATTN_GOLDEN_WRITE")) {
    std::ofstream(out, std::ios::binary) << got;
    MESSAGE("wrote " << out);
  }
  const std::string want = read_file(golden_path());
  CHECK_MESSAGE(got == want, first_difference(got, want));
}

TEST_CASE("keep sets: the engine round committed with commit_round reproduces the golden file") {
  const std::string got = all_runs(Path::kEngineRoundCommit, true);
  const std::string want = read_file(golden_path());
  CHECK_MESSAGE(got == want, first_difference(got, want));
}

TEST_CASE("keep sets: positions off leaves the same cache after every step on both paths") {
  for (const PruningMode mode : kModes)
    for (const Protection& prot : kProtections) {
      std::string on, off_host, off_engine;
      (void)run<bf16_storage>(mode, prot, Path::kCompressIfNeeded, true, &on);
      const std::string rep_host = run<bf16_storage>(mode, prot, Path::kCompressIfNeeded, false, &off_host);
      (void)run<bf16_storage>(mode, prot, Path::kEngineRoundCommit, false, &off_engine);
      INFO(to_string(mode), " / ", prot.name);
      CHECK(rep_host.find("positions not tracked") != std::string::npos);  // rounds did compress
      CHECK_MESSAGE(off_host == on, first_difference(off_host, on));
      CHECK_MESSAGE(off_engine == on, first_difference(off_engine, on));
    }
}

// SPDX-License-Identifier: Apache-2.0
// The documentation's host C++ examples, as written: each ```cpp block of README.md and docs/*.md
// (extracted by tests/docs/CMakeLists.txt) is #included inside a test case, after the context it
// assumes and before checks on what it built. A block that stops compiling or behaving as its
// text says fails here. The CUDA blocks (docs/memory.md) are in test_doc_snippets_cuda.cu.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>
#include <triattn/triattn.hpp>

#include "snippet_counts.hpp"

// Every block of each file is covered below (statistics.md block 0 is a declaration synopsis of
// stats.hpp, which cannot be compiled a second time; the loaders it lists run in blocks 1-3).
// A new block fails this until a test case includes it.
static_assert(kDocBlocks_README == 1, "README.md: a ```cpp block was added or removed; cover it here");
static_assert(kDocBlocks_integration == 2, "docs/integration.md: cover the new ```cpp block here");
static_assert(kDocBlocks_scorers == 1, "docs/scorers.md: cover the new ```cpp block here");
static_assert(kDocBlocks_statistics == 4, "docs/statistics.md: cover the new ```cpp block here");
static_assert(kDocBlocks_memory == 1, "docs/memory.md: cover the new ```cpp block in test_doc_snippets_cuda.cu");

namespace {

namespace fs = std::filesystem;

/// Runs a block in `dir` (the examples name files relative to the working directory).
class ScopedCwd {
 public:
  explicit ScopedCwd(const fs::path& dir) : old_(fs::current_path()) { fs::current_path(dir); }
  ScopedCwd(const ScopedCwd&) = delete;
  ScopedCwd& operator=(const ScopedCwd&) = delete;
  ~ScopedCwd() {
    std::error_code ec;
    fs::current_path(old_, ec);
  }

 private:
  fs::path old_;
};

/// A fresh directory under the system's temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("triattn_doc_" + std::to_string(std::random_device{}()))) {
    fs::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  [[nodiscard]] const fs::path& path() const noexcept { return path_; }

 private:
  fs::path path_;
};

/// The published calibration files (shared data; a missing directory fails the test).
fs::path calibration_dir() {
  const fs::path dir = fs::path(TRIATTN_SHARED_DATA_DIR) / "calibration";
  REQUIRE_MESSAGE(fs::is_regular_file(dir / "qwen3_8b.pt"), "missing shared data: ", (dir / "qwen3_8b.pt").string());
  return dir;
}

/// Decode steps until `cache` asks for a round, then the round; returns the length after it.
template <class Cache>
int decode_until_round_and_compress(Cache& cache, triattn::SeqId seq, int max_steps) {
  for (int step = 0; step < max_steps && !cache.needs_compression(seq); ++step)
    REQUIRE(cache.extend(seq, 1, triattn::Phase::kDecode).ok());
  REQUIRE(cache.needs_compression(seq));
  const triattn::CompressionReport rep = cache.compress(seq);
  CHECK(rep.length_after == cache.physical_length(seq));
  return cache.physical_length(seq);
}

/// Statistics of a small model from random pre-RoPE queries (for blocks that take `stats`).
triattn::QueryStats random_stats(int layers, int q_heads, int head_dim, std::uint64_t seed) {
  triattn::Calibrator cal(layers, q_heads, head_dim, triattn::RopeStyle::kHalf, "doc/small");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.5f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(8) * q_heads * head_dim);
  for (int l = 0; l < layers; ++l) {
    for (float& x : q) x = nd(rng);
    cal.add(l, q.data(), 8);
  }
  return cal.finish();
}

}  // namespace

TEST_SUITE("docs") {
  TEST_CASE("README.md: Use it (published Qwen3-8B statistics and one round on the CPU)") {
    ScopedCwd cwd(calibration_dir());  // the block loads "qwen3_8b.pt"
    const int n_prompt = 64;
#include "README_0.inc"
    CHECK(r.ok());
    CHECK(r.first_slot == 0);
    CHECK(cache.physical_length(seq) == n_prompt);
    CHECK(stats.num_layers == cfg.model.num_layers);
    // The decode steps the block leaves out, up to the first round: back to the budget.
    CHECK(decode_until_round_and_compress(cache, seq, 4 * sel.budget) == sel.budget);
    CHECK(cache.logical_position(seq) == sel.budget + sel.divide_length);
  }

  TEST_CASE("docs/integration.md block 0: extend once per step before layer 0") {
    triattn::CacheConfig cfg;
    cfg.model = {2, 4, 2, 16};
    cfg.num_blocks = 8;
    cfg.max_seqs = 2;
    triattn::KvCache<> cache(cfg);
    const triattn::SeqId seq = cache.add_sequence();
    REQUIRE(cache.extend(seq, 5, triattn::Phase::kPrefill).ok());
    const int n = 3;
    const triattn::Phase phase = triattn::Phase::kDecode;
#include "integration_0.inc"
    CHECK(r.ok());
    CHECK(p0 == 5);
    CHECK(r.first_slot == 5);
    CHECK(cache.physical_length(seq) == 8);
    CHECK(cache.logical_position(seq) == 8);
    // kOutOfBlocks leaves the cache unchanged, as the block's comment says.
    const triattn::AppendResult full = cache.extend(seq, 1000, phase);
    CHECK(full.status == triattn::AppendStatus::kOutOfBlocks);
    CHECK(cache.physical_length(seq) == 8);
  }

  TEST_CASE("docs/integration.md block 1: FlashInfer page arrays from the block tables") {
    triattn::CacheConfig cfg;
    cfg.model = {1, 2, 1, 16};
    cfg.block_size = 16;
    cfg.num_blocks = 16;
    cfg.max_seqs = 4;
    triattn::KvCache<> cache(cfg);
    const int bs = cfg.block_size;
    const std::vector<int> lens{20, 5, 32, 1};
    std::vector<triattn::SeqId> seqs;
    for (int len : lens) {
      seqs.push_back(cache.add_sequence());
      REQUIRE(cache.extend(seqs.back(), len, triattn::Phase::kPrefill).ok());
    }
    const int B = static_cast<int>(seqs.size());
    std::vector<int> indptr;
    std::vector<std::int32_t> indices;
    std::vector<int> last_page_len;
#include "integration_1.inc"
    CHECK(indptr == std::vector<int>{0, 2, 3, 5, 6});
    CHECK(last_page_len == std::vector<int>{4, 5, 16, 1});
    std::vector<std::int32_t> want;
    for (triattn::SeqId s : seqs) {
      const auto row = cache.block_table(s);
      want.insert(want.end(), row.begin(), row.end());
    }
    CHECK(indices == want);
    CHECK(std::none_of(indices.begin(), indices.end(), [](std::int32_t b) { return b < 0; }));
  }

  TEST_CASE("docs/scorers.md: swapping the scorer (each cache runs a round)") {
    triattn::CacheConfig cfg;
    cfg.model = {2, 4, 2, 16};
    cfg.num_blocks = 160;
    cfg.max_seqs = 2;
    const int hkv = cfg.model.num_kv_heads;
    const triattn::QueryStats stats = random_stats(2, 4, 16, 7);
    const triattn::RopeConfig rope{triattn::RopeStyle::kHalf, 1e6};
    const triattn::ScoringParams sp;
    triattn::SelectionParams sel_with_sinks;
    sel_with_sinks.n_sink = 4;
    triattn::SelectionParams sel_with_window;
    sel_with_window.window = 32;
#include "scorers_0.inc"
    const auto round = [&](auto& cache) {
      const triattn::SeqId seq = cache.add_sequence();
      REQUIRE(cache.extend(seq, 16, triattn::Phase::kPrefill).ok());
      return decode_until_round_and_compress(cache, seq, 4 * sel.budget);
    };
    CHECK(round(tri) == sel.budget);
    CHECK(round(knorm) == sel.budget);
    CHECK(round(streaming) == sel_with_sinks.budget);
    CHECK(round(rnd) == sel.budget);
    // SnapKV scores from observed queries; the block built it with a window of 32, kernel 7.
    CHECK(snap.scorer().params().window == 32);
    CHECK(snap.scorer().params().pool_kernel == 7);
  }

  TEST_CASE("docs/statistics.md block 1: load the published .pt with the model's geometry") {
    ScopedCwd cwd(calibration_dir());  // the block loads "qwen3_8b.pt"
#include "statistics_1.inc"
    CHECK(stats.num_layers == 36);
    CHECK(stats.num_q_heads == 32);
    CHECK(stats.head_dim == 128);
    CHECK(stats.q_abs_mean.size() == static_cast<std::size_t>(36) * 32 * 64);
    // A wrong expectation is refused with the file's name in the message.
    expect.num_layers = 28;
    CHECK_THROWS_WITH_AS(triattn::load_pt_stats("qwen3_8b.pt", expect), doctest::Contains("qwen3_8b.pt"),
                         triattn::format_error);
  }

  TEST_CASE("docs/statistics.md block 2: a tensor-parallel rank's slice") {
    const triattn::QueryStats stats = random_stats(2, 32, 16, 11);
    const int rank = 1, tp = 2;
#include "statistics_2.inc"
    CHECK(mine.num_q_heads == 16);
    CHECK(mine.first_q_head == 16);
    CHECK(std::equal(mine.mean_real(1, 0), mine.mean_real(1, 0) + 8, stats.mean_real(1, 16)));
  }

  TEST_CASE("docs/statistics.md block 3: calibrate and save native statistics") {
    TempDir tmp;
    ScopedCwd cwd(tmp.path());  // the block saves "my_model.safetensors"
    // One layer: the block's add() stands for every layer's call, run here once.
    const int num_layers = 1, num_q_heads = 4, head_dim = 16, n_tokens = 5, layer = 0;
    std::vector<float> q(static_cast<std::size_t>(n_tokens) * num_q_heads * head_dim);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 7) - 3.0f;
    const float* q_pre_rope = q.data();
#include "statistics_3.inc"
    CHECK(cal.token_count(0) == n_tokens);
    const triattn::QueryStats back = triattn::load_safetensors_stats("my_model.safetensors");
    const triattn::QueryStats want = cal.finish();
    CHECK(back.model_name == "my/model");
    CHECK(back.num_layers == num_layers);
    CHECK(back.num_q_heads == num_q_heads);
    CHECK(back.head_dim == head_dim);
    CHECK(back.q_mean_real == want.q_mean_real);
    CHECK(back.q_mean_imag == want.q_mean_imag);
    CHECK(back.q_abs_mean == want.q_abs_mean);
  }
}

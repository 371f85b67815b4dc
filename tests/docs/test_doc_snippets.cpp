// SPDX-License-Identifier: Apache-2.0
// The documentation's host C++ examples, as written: each ```cpp block of README.md and docs/*.md
// (extracted by tests/docs/CMakeLists.txt) is #included inside a test case, after the context it
// assumes and before checks on what it built. A block that stops compiling or behaving as its
// text says fails here. The CUDA blocks (docs/memory.md) are in test_doc_snippets_cuda.cu.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <filesystem>
#include <numeric>
#include <utility>
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
static_assert(kDocBlocks_integration == 10, "docs/integration.md: cover the new ```cpp block here");
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


/// The engine side of the Part A adapters: random bf16 K/V, three requests of which two are due
/// (budget 24, slack 8: lengths 40 and 36 reach 32; 20 does not), block ids shuffled.
struct AdapterCase {
  using bf16 = triattn::bf16_storage;
  static constexpr int kLayers = 2, kHkv = 2, kD = 16;
  const triattn::ModelGeometry geometry{kLayers, 4, kHkv, kD};
  triattn::TriAttentionScorer scorer{random_stats(kLayers, 4, kD, 11), triattn::RopeConfig{}, triattn::ScoringParams{}, kHkv};
  triattn::SelectionParams params;
  std::vector<int> lens{40, 20, 36};
  std::vector<std::int64_t> num_computed_tokens{40, 20, 36};
  std::vector<std::int32_t> prompt_lens{4, 4, 4};
  std::vector<std::int32_t> freed;
  std::mt19937 rng{3};
  AdapterCase() {
    params.budget = 24;
    params.divide_length = 8;
  }
  std::vector<bf16> tensor(std::size_t n) {
    std::normal_distribution<float> nd;
    std::vector<bf16> t(n);
    for (bf16& x : t) x = triattn::from_float<bf16>(nd(rng));
    return t;
  }
  /// Rows `rows` of a [num_rows, cols] table: distinct shuffled ids for `per` tokens per entry.
  std::vector<std::int32_t> table(const std::vector<std::int32_t>& rows, int num_rows, int cols, int per, int num_ids) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_ids));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<std::int32_t> t(static_cast<std::size_t>(num_rows) * cols, -1);
    std::size_t next = 0;
    for (std::size_t b = 0; b < rows.size(); ++b)
      for (int j = 0; j < (lens[b] + per - 1) / per; ++j) t[static_cast<std::size_t>(rows[b]) * cols + j] = ids[next++];
    return t;
  }
  /// What the round step must leave: due rows at the budget, their tail entries freed in order
  /// and -1, everything else unchanged.
  void check(const std::vector<std::int32_t>& rows, const std::vector<std::int32_t>& before, const std::vector<std::int32_t>& after,
             const std::vector<std::int32_t>& seq_lens, int cols, int per) const {
    std::vector<std::int32_t> want_freed, want_table = before;
    for (std::size_t b = 0; b < rows.size(); ++b) {
      const int now = lens[b] >= 32 ? 24 : lens[b];
      CHECK(seq_lens[static_cast<std::size_t>(rows[b])] == now);
      for (int j = (now + per - 1) / per; j < (lens[b] + per - 1) / per; ++j) {
        want_freed.push_back(before[static_cast<std::size_t>(rows[b]) * cols + j]);
        want_table[static_cast<std::size_t>(rows[b]) * cols + j] = -1;
      }
    }
    CHECK(!want_freed.empty());
    CHECK(freed == want_freed);
    CHECK(after == want_table);
  }
};
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

  TEST_CASE("docs/integration.md blocks 0 and 1: vLLM FlashAttention adapter and the round step") {
    AdapterCase c;
    auto [geometry, scorer, params, num_computed_tokens, prompt_lens] =
        std::tie(c.geometry, c.scorer, c.params, c.num_computed_tokens, c.prompt_lens);
    const int num_blocks = 12, block_size = 16, num_kv_heads = 2, head_size = 16, num_reqs = 3, max_blocks = 4;
    std::vector<std::vector<AdapterCase::bf16>> storage;
    std::vector<AdapterCase::bf16*> kv_caches;
    for (int l = 0; l < 2; ++l) storage.push_back(c.tensor(2u * num_blocks * block_size * num_kv_heads * head_size));
    for (auto& t : storage) kv_caches.push_back(t.data());
    std::vector<std::int32_t> block_table = c.table({0, 1, 2}, num_reqs, max_blocks, block_size, num_blocks);
    const std::vector<std::int32_t> before = block_table;
    std::vector<std::int32_t> seq_lens(c.lens.begin(), c.lens.end());
    const auto free_block = [&](std::int32_t id) { c.freed.push_back(id); };
#include "integration_0.inc"
#include "integration_1.inc"
    c.check(rows, before, block_table, seq_lens, max_blocks, block_size);
    CHECK(res.status_of(1) == triattn::RoundStatus::kNotDue);
  }

  TEST_CASE("docs/integration.md block 2: vLLM FlashInfer adapter") {
    AdapterCase c;
    auto [geometry, scorer, params, num_computed_tokens, prompt_lens] =
        std::tie(c.geometry, c.scorer, c.params, c.num_computed_tokens, c.prompt_lens);
    const int num_blocks = 12, block_size = 16, num_kv_heads = 2, head_size = 16, num_reqs = 3, max_blocks = 4;
    std::vector<std::vector<AdapterCase::bf16>> storage;
    std::vector<AdapterCase::bf16*> kv_caches;
    for (int l = 0; l < 2; ++l) storage.push_back(c.tensor(2u * num_blocks * block_size * num_kv_heads * head_size));
    for (auto& t : storage) kv_caches.push_back(t.data());
    std::vector<std::int32_t> block_table = c.table({0, 1, 2}, num_reqs, max_blocks, block_size, num_blocks);
    const std::vector<std::int32_t> before = block_table;
    std::vector<std::int32_t> seq_lens(c.lens.begin(), c.lens.end());
    const auto free_block = [&](std::int32_t id) { c.freed.push_back(id); };
#include "integration_2.inc"
    CHECK(view.block.stride_block == 2 * block_size * num_kv_heads * head_size);
#include "integration_1.inc"
    c.check(rows, before, block_table, seq_lens, max_blocks, block_size);
  }

  TEST_CASE("docs/integration.md block 3: SGLang adapter (one slot per token)") {
    AdapterCase c;
    auto [geometry, scorer, params, num_computed_tokens, prompt_lens] =
        std::tie(c.geometry, c.scorer, c.params, c.num_computed_tokens, c.prompt_lens);
    const int num_slots = 128, num_kv_heads = 2, head_dim = 16, pool_size = 4, max_context_len = 64;
    std::vector<std::vector<AdapterCase::bf16>> storage;
    std::vector<AdapterCase::bf16*> k_buffer, v_buffer;
    for (int l = 0; l < 4; ++l) storage.push_back(c.tensor(static_cast<std::size_t>(num_slots) * num_kv_heads * head_dim));
    for (int l = 0; l < 2; ++l) {
      k_buffer.push_back(storage[static_cast<std::size_t>(2 * l)].data());
      v_buffer.push_back(storage[static_cast<std::size_t>(2 * l + 1)].data());
    }
    const std::vector<std::int32_t> req_pool_indices{2, 0, 3};
    std::vector<std::int32_t> req_to_token = c.table(req_pool_indices, pool_size, max_context_len, 1, num_slots);
    const std::vector<std::int32_t> before = req_to_token;
    std::vector<std::int32_t> seq_lens(static_cast<std::size_t>(pool_size), 0);
    for (std::size_t b = 0; b < 3; ++b) seq_lens[static_cast<std::size_t>(req_pool_indices[b])] = c.lens[b];
    const auto free_block = [&](std::int32_t slot) { c.freed.push_back(slot); };
#include "integration_3.inc"
#include "integration_1.inc"
    c.check(rows, before, req_to_token, seq_lens, max_context_len, 1);
  }

  TEST_CASE("docs/integration.md block 4: TensorRT-LLM-style pool adapter") {
    AdapterCase c;
    auto [geometry, scorer, params, num_computed_tokens, prompt_lens] =
        std::tie(c.geometry, c.scorer, c.params, c.num_computed_tokens, c.prompt_lens);
    const int num_blocks = 12, num_layers = 2, block_size = 16, num_kv_heads = 2, head_dim = 16, num_reqs = 3,
              max_blocks = 4;
    std::vector<AdapterCase::bf16> storage = c.tensor(2u * num_blocks * num_layers * block_size * num_kv_heads * head_dim);
    AdapterCase::bf16* pool = storage.data();
    std::vector<std::int32_t> block_table = c.table({0, 1, 2}, num_reqs, max_blocks, block_size, num_blocks);
    const std::vector<std::int32_t> before = block_table;
    std::vector<std::int32_t> seq_lens(c.lens.begin(), c.lens.end());
    const auto free_block = [&](std::int32_t id) { c.freed.push_back(id); };
#include "integration_4.inc"
#include "integration_1.inc"
    c.check(rows, before, block_table, seq_lens, max_blocks, block_size);
  }

  TEST_CASE("docs/integration.md blocks 5 and 6: FlashInfer CSR page table adapter") {
    AdapterCase c;
    auto [geometry, scorer, params, num_computed_tokens, prompt_lens] =
        std::tie(c.geometry, c.scorer, c.params, c.num_computed_tokens, c.prompt_lens);
    const int max_pages = 12, page_size = 16, num_kv_heads = 2, head_dim = 16;
    std::vector<std::vector<AdapterCase::bf16>> storage;
    std::vector<AdapterCase::bf16*> kv_data;
    for (int l = 0; l < 2; ++l) storage.push_back(c.tensor(2u * max_pages * page_size * num_kv_heads * head_dim));
    for (auto& t : storage) kv_data.push_back(t.data());
    const std::vector<std::int32_t> padded = c.table({0, 1, 2}, 3, 3, page_size, max_pages);  // 3 pages at most
    std::vector<int> indptr{0}, last_page_len;
    std::vector<std::int32_t> indices;
    for (int b = 0; b < 3; ++b) {
      const int pages = (c.lens[static_cast<std::size_t>(b)] + page_size - 1) / page_size;
      indices.insert(indices.end(), padded.begin() + b * 3, padded.begin() + b * 3 + pages);
      indptr.push_back(indptr.back() + pages);
      last_page_len.push_back(c.lens[static_cast<std::size_t>(b)] - (pages - 1) * page_size);
    }
    const auto free_block = [&](std::int32_t id) { c.freed.push_back(id); };
#include "integration_5.inc"
    CHECK(block_table == padded);
    CHECK(seq_lens == std::vector<std::int32_t>{40, 20, 36});
#include "integration_1.inc"
    c.check(rows, padded, block_table, seq_lens, max_blocks, page_size);
#include "integration_6.inc"
    CHECK(indptr == std::vector<int>{0, 2, 4, 6});
    CHECK(last_page_len == std::vector<int>{8, 4, 8});
    CHECK(indices.size() == 6);
  }

  TEST_CASE("docs/integration.md block 7: admission") {
    triattn::CacheConfig cfg;
    cfg.model = {36, 32, 8, 128};
    cfg.block_size = 16;
    cfg.num_blocks = 4096;
    cfg.max_blocks_per_seq = 1024;
    triattn::SelectionParams params;
    params.budget = 2048;
    params.divide_length = 128;
    const std::int64_t free_blocks = 136 + 136 + 100, reserved = 0;
#include "integration_7.inc"
    CHECK(f.max_tokens == 2176);
    CHECK(f.max_blocks == 136);
    CHECK(f.max_blocks * cfg.block_size >= f.max_tokens);
    CHECK(admit == 2);  // the third (6000-token prompt: 376 blocks) does not fit in the 100 left
  }

  TEST_CASE("docs/integration.md block 8: extend once per step before layer 0") {
    triattn::CacheConfig cfg;
    cfg.model = {2, 4, 2, 16};
    cfg.num_blocks = 8;
    cfg.max_seqs = 2;
    triattn::KvCache<> cache(cfg);
    const triattn::SeqId seq = cache.add_sequence();
    REQUIRE(cache.extend(seq, 5, triattn::Phase::kPrefill).ok());
    const int n = 3;
    const triattn::Phase phase = triattn::Phase::kDecode;
#include "integration_8.inc"
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

  TEST_CASE("docs/integration.md block 9: FlashInfer page arrays from the block tables") {
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
#include "integration_9.inc"
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

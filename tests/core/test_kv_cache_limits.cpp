// SPDX-License-Identifier: Apache-2.0
// Failures outside the per-call argument checks, each a typed triattn error naming the input:
// a valid CacheConfig too large for host memory (was std::bad_alloc from the host backend, or
// an abort under ASan), any query on a moved-from KvCache (was a null dereference), and
// SelectionParams whose protected tokens alone exceed the budget (was accepted: every step then
// fired a round that kept more than the budget).
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/trigger.hpp>

using namespace triattn;

namespace {

CacheConfig small_config() {
  CacheConfig c;
  c.model = ModelGeometry{2, 2, 2, 4};
  c.block_size = 4;
  c.num_blocks = 8;
  c.max_seqs = 2;
  c.dtype = DType::kF32;
  return c;
}

template <class F>
std::string logic_message(F&& f) {
  try {
    f();
  } catch (const logic_error& e) {
    return e.what();
  }
  return "(no logic_error)";
}

}  // namespace

TEST_CASE("limits: a valid CacheConfig too large for host memory is a typed error naming it") {
  // 2 * 64 layers * 2^20 blocks * 16 tokens * 8 heads * 128 * 4 bytes = 2^43 bytes (8 TiB): valid,
  // but more than any host's memory.
  CacheConfig c;
  c.model = ModelGeometry{64, 8, 8, 128};
  c.block_size = 16;
  c.num_blocks = 1 << 20;
  c.max_seqs = 1;
  c.max_blocks_per_seq = 64;
  c.dtype = DType::kF32;
  REQUIRE_NOTHROW(c.validate());
  std::string message = "(no out_of_memory)";
  try {
    KvCache<> cache(c);
  } catch (const out_of_memory& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("8796093022208 bytes") != std::string::npos);  // the size asked for
  CHECK(message.find("num_blocks 1048576") != std::string::npos);   // and the config that asked
  CHECK(message.find("num_layers 64") != std::string::npos);
  CHECK_THROWS_AS(StaticAllocator<HostBackend>{c}, out_of_memory);
}

TEST_CASE("limits: every query on a moved-from KvCache throws a typed error") {
  KvCache<> a(small_config());
  const SeqId s = a.add_sequence();
  REQUIRE(a.extend(s, 5).ok());
  KvCache<> b(std::move(a));
  // The cache that was moved to owns everything.
  CHECK(b.physical_length(s) == 5);
  CHECK(b.is_active(s));
  CHECK(b.memory().blocks_used == 2);
  // The moved-from one refuses every call with a logic_error saying so.
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"physical_length", [&] { (void)a.physical_length(s); }},
      {"logical_position", [&] { (void)a.logical_position(s); }},
      {"prompt_length", [&] { (void)a.prompt_length(s); }},
      {"block_table", [&] { (void)a.block_table(s); }},
      {"forkable_prefix", [&] { (void)a.forkable_prefix(s); }},
      {"memory", [&] { (void)a.memory(); }},
      {"view", [&] { (void)a.view<float>(); }},
      {"add_sequence", [&] { (void)a.add_sequence(); }},
      {"extend", [&] { (void)a.extend(s, 1); }},
      {"release", [&] { a.release(s); }},
  };
  for (const auto& [name, call] : calls) {
    INFO(name);
    CHECK(logic_message(call).find("moved-from KvCache") != std::string::npos);
  }
  CHECK_FALSE(a.is_active(s));
  CHECK(a.num_active() == 0);
  // Assigning a fresh cache makes it usable again.
  a = KvCache<>(small_config());
  CHECK(a.num_active() == 0);
  const SeqId t = a.add_sequence();
  CHECK(a.extend(t, 3).ok());
  CHECK(a.physical_length(t) == 3);
}

TEST_CASE("limits: n_sink + window over the budget is refused when the params are validated") {
  SelectionParams p;
  p.budget = 8;
  p.n_sink = 4;
  p.window = 5;
  const std::string m = logic_message([&] { p.validate(); });
  INFO(m);
  CHECK(m.find("n_sink (4) + window (5) = 9") != std::string::npos);
  CHECK(m.find("budget = 8") != std::string::npos);
  CHECK_THROWS_AS(TopKSelector{p}, logic_error);
  CHECK_THROWS_AS((void)CompressionTrigger::should_compress(100, true, p), logic_error);
  p.window = 4;  // exactly the budget: every kept token protected, a valid (if degenerate) setting
  CHECK_NOTHROW(p.validate());
}

// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// ctest: TIMEOUT 300
// The GGUF reader (examples/reference_transformer/gguf.hpp) and the llama mapping
// (gguf_llama.hpp) on small files built in memory (tests/common/gguf_builder.hpp) and on the real
// SmolLM2 file's header: metadata of every type, dequantisation of every supported type, and
// refusal with a message naming the file and the entry of truncated files, bad offsets, unknown
// tensor types, wrong shapes, a directory, and inconsistent metadata.
#include <doctest/doctest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>

#include "common/gguf_builder.hpp"
#include "common/non_regular_files.hpp"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/bpe_tokenizer.hpp>
#include <reference_transformer/gguf.hpp>
#include <reference_transformer/gguf_llama.hpp>

// Live bytes requested through operator new, for the check that the GGUF reader's memory count
// covers what it allocates (mallinfo would not see allocations under ASan's allocator).
namespace {
std::atomic<std::size_t> g_live_new_bytes{0};
constexpr std::size_t kNewHeader = 16;  // keeps the size; preserves malloc's 16-byte alignment
}  // namespace

void* operator new(std::size_t n) {
  void* p = std::malloc(n + kNewHeader);
  if (p == nullptr) throw std::bad_alloc();
  *static_cast<std::size_t*>(p) = n;
  g_live_new_bytes += n;
  return static_cast<char*>(p) + kNewHeader;
}
void operator delete(void* p) noexcept {
  if (p == nullptr) return;
  char* block = static_cast<char*>(p) - kNewHeader;
  g_live_new_bytes -= *reinterpret_cast<std::size_t*>(block);
  std::free(block);
}
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }

namespace ex = triattn_example;
using triattn::test::GgufBuilder;
using triattn::test::tiny_llama_gguf;

namespace {

/// The format_error message of f(), or "" when it does not throw one.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const triattn::format_error& e) {
    return e.what();
  }
  return "";
}

std::string load_error(const std::vector<std::byte>& bytes) {
  return error_of([&] { (void)ex::gguf_llama_weights(ex::gguf::File::parse(std::span<const std::byte>(bytes), "t.gguf")); });
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A message must name the file first and contain `part`.
#define CHECK_REFUSED(msg, part)                                   \
  do {                                                             \
    const std::string m_ = (msg);                                  \
    INFO("message: " << m_);                                       \
    CHECK(m_.rfind("t.gguf: ", 0) == 0);                           \
    CHECK(contains(m_, part));                                     \
  } while (0)

}  // namespace

TEST_SUITE("model") {

TEST_CASE("GGUF: a tiny llama file loads and every type dequantises to the values its blocks encode") {
  GgufBuilder b = tiny_llama_gguf(2);
  const std::vector<std::byte> bytes = b.build();
  const ex::gguf::File f = ex::gguf::File::parse(std::span<const std::byte>(bytes), "t.gguf");
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.data_offset() % 32 == 0);
  CHECK(f.tensors().size() == b.tensors.size());
  for (const GgufBuilder::Tensor& t : b.tensors) {
    INFO("tensor " << t.name);
    const ex::gguf::TensorInfo* info = f.find_tensor(t.name);
    REQUIRE(info != nullptr);
    CHECK(info->shape == t.shape);
    CHECK(f.dequantize(*info) == t.expect);
  }
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_int("llama.block_count", 0, 10) == 2);
  CHECK(f.get_float("llama.rope.freq_base") == 10000.0);
  CHECK(f.get_array("tokenizer.ggml.tokens", ex::gguf::ValueType::kString).size() == 258);
  CHECK(f.get_array("tokenizer.ggml.token_type", ex::gguf::ValueType::kI32).ints.at(2) == 1);

  const ex::ModelWeights w = ex::gguf_llama_weights(f);
  CHECK(w.config.n_layers == 2);
  CHECK(w.config.head_dim == 16);
  CHECK(w.config.group_size() == 2);
  CHECK(w.config.vocab_size == 258);
  CHECK(w.config.rope_style == triattn::RopeStyle::kInterleaved);
  // Layer 1's query weights are the second attn_q tensor, row-major [out][in] as GGUF stores them.
  const GgufBuilder::Tensor* q1 = nullptr;
  for (const auto& t : b.tensors)
    if (t.name == "blk.1.attn_q.weight") q1 = &t;
  REQUIRE(q1 != nullptr);
  CHECK(std::vector<float>(w.wq.begin() + 32 * 32, w.wq.end()) == q1->expect);

  // It runs: one prefill step of 5 tokens.
  ex::Model<> model(w);
  triattn::KvCache<> cache(triattn::test::cache_config(w.config, 8, 1));
  const triattn::SeqId seq = cache.add_sequence();
  const std::vector<int> toks{1, 40, 41, 42, 43};
  const ex::Chunk c{seq, toks, triattn::Phase::kPrefill};
  const ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&c, 1), ex::LogitsFor::kAllRows);
  CHECK(out.num_logit_rows() == 5);

  // Its tokenizer: no merges, so one byte symbol per byte; specials by text.
  const ex::BpeTokenizer tok = ex::BpeTokenizer::from_gguf(f);
  CHECK(tok.encode("<|im_start|>ab") == std::vector<int>{1, 2 + 'a', 2 + 'b'});
  CHECK(tok.decode(tok.encode("x y\n")) == "x y\n");
}

TEST_CASE("GGUF: metadata of every value type with arrays included") {
  GgufBuilder b;
  b.kv_raw("a.u8", GgufBuilder::kU8, {200});
  b.kv_raw("a.i8", GgufBuilder::kI8, {0xFE});
  b.kv_raw("a.u16", GgufBuilder::kU16, {0x34, 0x12});
  b.kv_raw("a.i16", GgufBuilder::kI16, {0xFF, 0xFF});
  b.kv_u32("a.u32", 4000000000u);
  b.kv_i32("a.i32", -7);
  b.kv_u64("a.u64", 1ull << 40);
  b.kv_raw("a.i64", GgufBuilder::kI64, {0xFB, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF});
  b.kv_f32("a.f32", 0.5f);
  b.kv_f64("a.f64", -2.25);
  b.kv_bool("a.bool", true);
  b.kv_str("a.str", "h\xC3\xA9");
  // An array of arrays of u8: [[1, 2], []].
  b.kv_raw("a.nested", GgufBuilder::kArray,
           {9, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,            // elem type array, 2 elements
            0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 2,      // [u8; 2] = {1, 2}
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});          // [u8; 0]
  const std::vector<std::byte> bytes = b.build();
  const ex::gguf::File f = ex::gguf::File::parse(std::span<const std::byte>(bytes), "t.gguf");
  CHECK(f.metadata().size() == 13);
  CHECK(f.get_int("a.u8", 0, 255) == 200);
  CHECK(f.get_int("a.i8", -10, 10) == -2);
  CHECK(f.get_int("a.u16", 0, 65535) == 0x1234);
  CHECK(f.get_int("a.i16", -10, 10) == -1);
  CHECK(f.get_int("a.u32", 0, 5000000000LL) == 4000000000LL);
  CHECK(f.get_int("a.i32", -10, 10) == -7);
  CHECK(f.get_int("a.u64", 0, 1LL << 41) == (1LL << 40));
  CHECK(f.get_int("a.i64", -10, 10) == -5);
  CHECK(f.get_float("a.f32") == 0.5);
  CHECK(f.get_float("a.f64") == -2.25);
  CHECK(f.at("a.bool").i == 1);
  CHECK(f.get_string("a.str") == "h\xC3\xA9");
  const ex::gguf::Value& n = f.at("a.nested");
  REQUIRE(n.array.size() == 2);
  CHECK(n.elem == ex::gguf::ValueType::kArray);
  REQUIRE(n.array[0].ints.size() == 2);
  CHECK(n.array[0].ints[1] == 2);
  CHECK(n.array[1].size() == 0);
  CHECK(f.tensors().empty());
  // Out of range and wrong types are refused with the key named.
  CHECK_REFUSED(error_of([&] { (void)f.get_int("a.u8", 0, 100); }), "a.u8 = 200 is outside [0, 100]");
  CHECK_REFUSED(error_of([&] { (void)f.get_string("a.u8"); }), "a.u8 has type u8, expected string");
  CHECK_REFUSED(error_of([&] { (void)f.get_float("a.str"); }), "a.str has type string");
  CHECK_REFUSED(error_of([&] { (void)f.at("nope"); }), "metadata key nope is missing");
  CHECK_REFUSED(error_of([&] { (void)f.get_array("a.nested", ex::gguf::ValueType::kString); }),
                "expected array of string");
}

TEST_CASE("GGUF: every truncation of a file is refused with a message") {
  GgufBuilder b = tiny_llama_gguf(1);
  const std::vector<std::byte> full = b.build();
  REQUIRE(load_error(full).empty());
  int refused = 0;
  for (std::size_t n = 0; n < full.size(); ++n) {
    // Past the last tensor's data only padding would be missing: every shorter file loses bytes
    // the loader needs.
    const std::vector<std::byte> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    const std::string m = load_error(cut);
    INFO("truncated to " << n << " of " << full.size() << " bytes: " << m);
    REQUIRE(m.rfind("t.gguf: ", 0) == 0);
    CHECK((contains(m, "truncated") || contains(m, "not a GGUF file")));
    ++refused;
  }
  CHECK(refused == static_cast<int>(full.size()));
}

TEST_CASE("GGUF: bad offsets and unknown tensor types and wrong shapes and bad headers are refused") {
  GgufBuilder b = tiny_llama_gguf(1);
  const std::vector<std::byte> good = b.build();
  const std::vector<GgufBuilder::Fields> fl = b.fields;
  const std::size_t q = 3;  // blk.0.attn_q.weight (after token_embd, output_norm, attn_norm)
  REQUIRE(b.tensors[q].name == "blk.0.attn_q.weight");
  auto with = [&](auto edit) {
    std::vector<std::byte> f = good;
    edit(f);
    return load_error(f);
  };
  SUBCASE("offset not a multiple of the alignment") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].offset, 48); }),
                  "blk.0.attn_q.weight data offset 48 is not a multiple of the alignment 32");
  }
  SUBCASE("offset past the end") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].offset, 1ull << 40); }),
                  "bad offset: tensor blk.0.attn_q.weight");
  }
  SUBCASE("a huge offset that would wrap around") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].offset, ~std::uint64_t{31}); }),
                  "bad offset: tensor blk.0.attn_q.weight");
  }
  SUBCASE("overlapping tensors") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].offset, 0); }), "overlaps tensor");
  }
  SUBCASE("a known type this reader does not dequantize, by name") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, fl[q].type, 12); }),
                  "blk.0.attn_q.weight has type Q4_K, which this reader does not dequantize");
  }
  SUBCASE("an unknown type id") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, fl[q].type, 99); }), "has type type 99");
  }
  SUBCASE("a block type whose row is not whole blocks") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].dims, 16); }),
                  "not a multiple of its block of 32");
  }
  SUBCASE("wrong shape for the metadata") {
    // attn_q as 32 x 16 with the data of 32 x 16: a consistent file, the wrong model.
    GgufBuilder c = tiny_llama_gguf(1);
    GgufBuilder other;
    c.tensors[q] = other.tensor("blk.0.attn_q.weight", {32, 16}, GgufBuilder::tQ4_1, std::vector<float>(512, 0.25f));
    CHECK_REFUSED(load_error(c.build()), "tensor blk.0.attn_q.weight has shape [32, 16], expected [32, 32]");
  }
  SUBCASE("a shape or type changed to one that reads fewer bytes than the tensor's span") {
    // attn_q's 640 bytes of Q4_1 [32, 32] read as [32, 16] (320 bytes) or as Q4_0 (576 bytes):
    // the directory disagrees with the data. Before the span rule both loaded silently.
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].dims + 8, 16); }),
                  "size mismatch: tensor blk.0.attn_q.weight (Q4_1 [32, 16], 320 bytes at data offset");
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, fl[q].type, GgufBuilder::tQ4_0); }),
                  "size mismatch: tensor blk.0.attn_q.weight (Q4_0 [32, 32], 576 bytes at data offset");
    // The last tensor by offset (blk.0.ffn_up.weight, F32 [32, 64]) as F16: half its bytes.
    const std::size_t last = b.tensors.size() - 1;
    REQUIRE(b.tensors[last].name == "blk.0.ffn_up.weight");
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, fl[last].type, GgufBuilder::tF16); }),
                  "bytes before the end of the file, more than the padding to the alignment 32 allows");
  }
  SUBCASE("zero-sized dimension") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].dims + 8, 0); }), "dimension 1 = 0");
  }
  SUBCASE("element count overflow") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, fl[q].dims + 8, 1ull << 61); }),
                  "element count overflows");
  }
  SUBCASE("bad magic, version 1, unknown version, big-endian") {
    CHECK_REFUSED(with([&](auto& f) { f[0] = std::byte{'X'}; }), "not a GGUF file");
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, 4, 1); }), "version 1");
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, 4, 7); }), "GGUF version 7 is not supported");
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint32_t>(f, 4, 0x03000000u); }), "big-endian");
  }
  SUBCASE("counts larger than the file") {
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, 8, 1ull << 50); }), "tensors, more than");
    CHECK_REFUSED(with([&](auto& f) { GgufBuilder::poke<std::uint64_t>(f, 16, 1ull << 50); }), "metadata entries, more than");
  }
}

TEST_CASE("GGUF: inconsistent metadata and tensor sets are refused") {
  SUBCASE("duplicate key") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_u32("llama.block_count", 1);
    CHECK_REFUSED(load_error(b.build()), "metadata key llama.block_count appears twice");
  }
  SUBCASE("alignment not a power of two") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_u32("general.alignment", 24);
    CHECK_REFUSED(load_error(b.build()), "general.alignment = 24 is not a power of two");
  }
  SUBCASE("alignment of a wrong type") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_u64("general.alignment", 32);
    CHECK_REFUSED(load_error(b.build()), "general.alignment has type u64, expected u32");
  }
  SUBCASE("an alignment of 64 is honoured") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_u32("general.alignment", 64);
    b.alignment = 64;
    const std::vector<std::byte> bytes = b.build();
    const ex::gguf::File f = ex::gguf::File::parse(std::span<const std::byte>(bytes), "t.gguf");
    CHECK(f.alignment() == 64);
    CHECK(f.data_offset() % 64 == 0);
    CHECK(f.dequantize(*f.find_tensor("blk.0.ffn_up.weight")) == b.tensors.back().expect);
  }
  SUBCASE("bool that is neither 0 nor 1") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_raw("x.flag", GgufBuilder::kBool, {2});
    CHECK_REFUSED(load_error(b.build()), "bool value 2");
  }
  SUBCASE("unknown value type") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_raw("x.odd", 13, {0});
    CHECK_REFUSED(load_error(b.build()), "x.odd has unknown value type 13");
  }
  SUBCASE("array longer than the file") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_raw("x.arr", GgufBuilder::kArray, {4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1});
    CHECK_REFUSED(load_error(b.build()), "truncated: metadata x.arr declares");
  }
  SUBCASE("not llama") {
    GgufBuilder b;
    b.kv_str("general.architecture", "qwen2");
    CHECK_REFUSED(load_error(b.build()), "only \"llama\" models are supported");
  }
  SUBCASE("a missing key") {
    GgufBuilder b;
    b.kv_str("general.architecture", "llama");
    CHECK_REFUSED(load_error(b.build()), "metadata key llama.block_count is missing");
  }
  SUBCASE("head counts that do not divide") {
    GgufBuilder b = tiny_llama_gguf(1);
    GgufBuilder c;  // same tensors, head_count_kv 3
    c.kv_str("general.architecture", "llama");
    c.kv_u32("llama.block_count", 1);
    c.kv_u32("llama.embedding_length", 32);
    c.kv_u32("llama.feed_forward_length", 64);
    c.kv_u32("llama.attention.head_count", 2);
    c.kv_u32("llama.attention.head_count_kv", 3);
    c.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    c.tensors = b.tensors;
    CHECK_REFUSED(load_error(c.build()), "head_count_kv = 3 does not divide");
  }
  SUBCASE("a missing tensor") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.tensors.erase(b.tensors.begin() + 4);  // blk.0.attn_k.weight
    CHECK_REFUSED(load_error(b.build()), "tensor blk.0.attn_k.weight is missing");
  }
  SUBCASE("an extra tensor") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.tensor("rope_freqs.weight", {8}, GgufBuilder::tF32, std::vector<float>(8, 1.0f));
    CHECK_REFUSED(load_error(b.build()), "tensor rope_freqs.weight is not part of a llama model");
  }
  SUBCASE("duplicate tensor name") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.tensors.push_back(b.tensors[1]);
    CHECK_REFUSED(load_error(b.build()), "tensor output_norm.weight appears twice");
  }
  SUBCASE("rope scaling") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_str("llama.rope.scaling.type", "linear");
    CHECK_REFUSED(load_error(b.build()), "llama.rope.scaling.type = \"linear\" is not supported");
  }
}

TEST_CASE("GGUF: the tensors tile the data section: spans padded at most to the alignment") {
  // a: F32 [3] (12 bytes) at 0, its span padded to 32; b: F16 [5] (10 bytes) at 32, the last.
  GgufBuilder g;
  g.tensor("a", {3}, GgufBuilder::tF32, {1.0f, 2.0f, 3.0f});
  g.tensor("b", {5}, GgufBuilder::tF16, {1.0f, 2.0f, 3.0f, 4.0f, 5.0f});
  const std::vector<std::byte> base = g.build();
  const std::vector<GgufBuilder::Fields> fl = g.fields;
  auto parse_error = [](const std::vector<std::byte>& bytes) {
    return error_of([&] { (void)ex::gguf::File::parse(std::span<const std::byte>(bytes), "t.gguf"); });
  };
  auto padded = [&](std::size_t extra) {
    std::vector<std::byte> f = base;
    f.resize(f.size() + extra);
    return f;
  };
  CHECK(parse_error(base).empty());       // the last tensor ends the file
  CHECK(parse_error(padded(22)).empty());  // ... or its padding to 32 does
  CHECK_REFUSED(parse_error(padded(23)),
                "size mismatch: tensor b (F16 [5], 10 bytes at data offset 32) is followed by 23 bytes before the end of "
                "the file, more than the padding to the alignment 32 allows");
  // Both tensors moved up by 32: the first 32 bytes of the data section belong to no tensor.
  std::vector<std::byte> shifted = padded(32);
  GgufBuilder::poke<std::uint64_t>(shifted, fl[0].offset, 32);
  GgufBuilder::poke<std::uint64_t>(shifted, fl[1].offset, 64);
  CHECK_REFUSED(parse_error(shifted), "bad offset: tensor a (F32 [3], 12 bytes at data offset 32) is the first tensor but "
                                      "does not start the data section (32 unused bytes before it)");
}

TEST_CASE("GGUF: a non-finite quantisation scale or weight is refused naming the tensor") {
  GgufBuilder b = tiny_llama_gguf(1);
  const std::vector<std::byte> good = b.build();
  const std::vector<GgufBuilder::Fields> fl = b.fields;
  REQUIRE(load_error(good).empty());
  struct Case {
    std::size_t tensor, byte;  // which tensor, which byte of its data
    std::uint16_t bits;        // f16 or bf16 bits written there (NaN 0x7E00 / 0x7FC0, +-inf 0x7C00 / 0xFC00)
    const char* expect;
  };
  const Case cases[] = {
      {0, 0, 0x7E00, "tensor token_embd.weight (Q8_0): block 0 has a non-finite scale d (NaN)"},
      {0, 34 * 5, 0x7C00, "tensor token_embd.weight (Q8_0): block 5 has a non-finite scale d (infinite)"},
      {3, 20, 0x7E00, "tensor blk.0.attn_q.weight (Q4_1): block 1 has a non-finite scale d (NaN)"},
      {3, 2, 0xFC00, "tensor blk.0.attn_q.weight (Q4_1): block 0 has a non-finite minimum m (infinite)"},
      {4, 18 * 2, 0x7E00, "tensor blk.0.attn_k.weight (Q4_0): block 2 has a non-finite scale d (NaN)"},
      {5, 2 * 3, 0x7C00, "tensor blk.0.attn_v.weight (F16): element 3 is non-finite (infinite)"},
      {6, 0, 0x7FC0, "tensor blk.0.attn_output.weight (BF16): element 0 is non-finite (NaN)"},
      {1, 4 * 7 + 2, 0x7FC0, "tensor output_norm.weight (F32): element 7 is non-finite (NaN)"},  // f32 NaN's high half
  };
  for (const Case& c : cases) {
    INFO("tensor " << b.tensors[c.tensor].name << ", byte " << c.byte);
    std::vector<std::byte> f = good;
    GgufBuilder::poke<std::uint16_t>(f, fl[c.tensor].data + c.byte, c.bits);
    CHECK_REFUSED(load_error(f), c.expect);
  }
}

TEST_CASE("GGUF: metadata that would take many times the file's size in memory is refused") {
  SUBCASE("300000 empty strings: 2.4 MB of file, about 43 MB as values") {
    GgufBuilder b = tiny_llama_gguf(1);
    b.kv_str_array("x.empty", std::vector<std::string>(300000));
    const std::string m = load_error(b.build());
    CHECK_REFUSED(m, "the metadata and tensor directory would take more than");
    CHECK(contains(m, "at metadata x.empty"));
  }
  SUBCASE("150000 one-byte entries: about 3 MB of file, 40 MB as entries and index") {
    GgufBuilder b;
    for (int k = 0; k < 150000; ++k) b.kv_raw(std::to_string(k), GgufBuilder::kU8, {0});
    CHECK_REFUSED(load_error(b.build()), "the metadata and tensor directory would take more than");
  }
  SUBCASE("the count covers what parsing allocates") {
    // 40000 empty strings stay under the 16 MiB slack: parsed, and the heap growth measured.
    GgufBuilder b;
    b.kv_str_array("x.empty", std::vector<std::string>(40000));
    b.kv_str_array("x.long", std::vector<std::string>(2000, std::string(100, 'z')));
    std::vector<std::byte> bytes = b.build();
    const std::size_t file_size = bytes.size();
    const std::size_t before = g_live_new_bytes;
    const ex::gguf::File f = ex::gguf::File::parse(std::move(bytes), "t.gguf");
    const std::size_t grown = g_live_new_bytes - before;  // the moved file bytes are not new
    INFO("counted " << f.metadata_memory() << " bytes, the heap grew by " << grown << ", file " << file_size);
    CHECK(f.metadata_memory() >= grown * 9 / 10);
    CHECK(f.metadata_memory() <= grown * 3 / 2);
  }
}

TEST_CASE("GGUF: a FIFO or a character device is refused by type without blocking") {
  const triattn::test::NonRegularPaths p;
  triattn::test::check_refused([](const std::string& f) { (void)ex::gguf::File::load(f); }, p.fifo, "FIFO");
  triattn::test::check_refused([](const std::string& f) { (void)ex::gguf::File::load(f); }, "/dev/zero",
                               "character device");
}

TEST_CASE("GGUF: a directory or a missing path is refused before reading") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "triattn_gguf_dir_test.gguf";
  std::filesystem::create_directories(dir);
  const std::string m = error_of([&] { (void)ex::gguf::File::load(dir.string()); });
  std::filesystem::remove(dir);
  CHECK(m == dir.string() + ": is a directory, not a regular file");
  const std::string missing = error_of([&] { (void)ex::gguf::File::load(dir.string() + ".none"); });
  CHECK(missing == dir.string() + ".none: no such file");
}

TEST_CASE("GGUF: the real SmolLM2 file truncated in its metadata or directory or data is refused") {
  const std::string path = triattn::test::data_file("SmolLM2-135M-Instruct.Q4_1.gguf");
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in);
  const ex::gguf::File whole = ex::gguf::File::load(path);
  // A real model's metadata (49k-token vocabulary, 49k merges) is a fraction of its size.
  CHECK(whole.metadata_memory() > 0);
  CHECK(whole.metadata_memory() < whole.file_size() / 2);
  const std::uint64_t data0 = whole.data_offset();
  // Cuts: inside the header, the tokenizer arrays, the tensor directory, and the data section.
  for (const std::uint64_t n : {std::uint64_t{10}, std::uint64_t{3000}, std::uint64_t{1500000}, data0 - 100,
                                data0 + 1000, whole.file_size() - 1}) {
    std::vector<std::byte> bytes(static_cast<std::size_t>(n));
    in.clear();
    in.seekg(0);
    REQUIRE(in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(n)));
    const std::string m =
        error_of([&] { (void)ex::gguf_llama_weights(ex::gguf::File::parse(std::move(bytes), "cut.gguf")); });
    INFO("cut at " << n << ": " << m);
    CHECK(m.rfind("cut.gguf: truncated", 0) == 0);
  }
}

}  // TEST_SUITE("model")

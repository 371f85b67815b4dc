// SPDX-License-Identifier: Apache-2.0
// triattn's native safetensors statistics: .pt -> safetensors -> load is bitwise equal for both
// real files, 200 seeded corruptions per file are all rejected naming the file, hand-made
// headers with one defect each are rejected naming the defect, and the JSON reader's guards.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>

namespace {

using Bytes = std::vector<std::uint8_t>;

std::string calib_path(const char* file) { return std::string(TRIATTN_SHARED_DATA_DIR) + "/calibration/" + file; }

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

std::string load_error(const Bytes& bytes, const std::string& name, const triattn::StatsExpectation& expect = {}) {
  try {
    (void)triattn::load_safetensors_stats(std::span<const std::uint8_t>(bytes), name, expect);
  } catch (const triattn::format_error& e) {
    return e.what();
  }
  return "";
}

void check_bitwise_equal(const triattn::QueryStats& a, const triattn::QueryStats& b) {
  CHECK(a.model_name == b.model_name);
  CHECK(a.rope_style == b.rope_style);
  CHECK(a.num_layers == b.num_layers);
  CHECK(a.num_q_heads == b.num_q_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.first_q_head == b.first_q_head);
  REQUIRE(a.q_mean_real.size() == b.q_mean_real.size());
  REQUIRE(a.q_mean_imag.size() == b.q_mean_imag.size());
  REQUIRE(a.q_abs_mean.size() == b.q_abs_mean.size());
  CHECK(std::memcmp(a.q_mean_real.data(), b.q_mean_real.data(), a.q_mean_real.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(a.q_mean_imag.data(), b.q_mean_imag.data(), a.q_mean_imag.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(a.q_abs_mean.data(), b.q_abs_mean.data(), a.q_abs_mean.size() * sizeof(float)) == 0);
}

std::filesystem::path temp_file(const std::string& stem) {
  return std::filesystem::temp_directory_path() /
         ("triattn_test_" + stem + "_" + std::to_string(std::random_device{}()) + ".safetensors");
}

// Hand-made file: metadata (content_crc32 added unless given), tensor JSON, data.
struct Spec {
  std::map<std::string, std::string> meta;
  std::string tensors;  // JSON members after __metadata__, e.g. "\"q_mean_real\":{...},..."
  Bytes data;
  bool add_crc = true;
};

Spec base_spec(int layers, int heads, int head_dim) {
  Spec s;
  s.meta = {{"format", "triattn-stats-v1"}, {"model_name", "test/model"}, {"rope_style", "half"},
            {"head_dim", std::to_string(head_dim)}, {"num_layers", std::to_string(layers)},
            {"num_q_heads", std::to_string(heads)}, {"first_q_head", "0"}};
  const std::size_t n = static_cast<std::size_t>(layers) * heads * (head_dim / 2);
  const std::string shape = "[" + std::to_string(layers) + "," + std::to_string(heads) + "," +
                            std::to_string(head_dim / 2) + "]";
  const char* names[3] = {"q_mean_real", "q_mean_imag", "q_abs_mean"};
  for (int t = 0; t < 3; ++t) {
    s.tensors += std::string(t ? "," : "") + "\"" + names[t] + "\":{\"dtype\":\"F32\",\"shape\":" + shape +
                 ",\"data_offsets\":[" + std::to_string(t * n * 4) + "," + std::to_string((t + 1) * n * 4) + "]}";
  }
  for (int t = 0; t < 3; ++t)
    for (std::size_t i = 0; i < n; ++i) triattn::detail::append_le_f32(s.data, t == 2 ? 1.0f : 0.25f);
  return s;
}

Bytes make_file(const Spec& s) {
  auto meta = s.meta;
  if (s.add_crc) meta["content_crc32"] = triattn::detail::hex32(triattn::detail::stats_content_crc(meta, s.data));
  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : meta) {
    if (!first) header += ',';
    header += triattn::detail::json_quote(k);
    header += ':';
    header += triattn::detail::json_quote(v);
    first = false;
  }
  header += '}';
  if (!s.tensors.empty()) {
    header += ',';
    header += s.tensors;
  }
  header += '}';
  Bytes out;
  triattn::detail::append_le64(out, header.size());
  triattn::detail::append_bytes(out, header);
  out.insert(out.end(), s.data.begin(), s.data.end());
  return out;
}

void corruption_campaign(const char* pt_file) {
  const auto stats = triattn::load_pt_stats(calib_path(pt_file));
  const Bytes pristine = triattn::serialize_safetensors_stats(stats);
  const std::string name = std::string(pt_file) + ".safetensors";
  REQUIRE(load_error(pristine, name).empty());
  const char* env = std::getenv("TRIATTN_TEST_SEED");
  const std::uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : 20240918ull;
  MESSAGE(name << ": corruption seed " << seed << " (set TRIATTN_TEST_SEED to change)");
  std::mt19937_64 rng(seed);
  const std::uint64_t header_end = 8 + triattn::detail::load_le64(pristine.data());
  auto pick = [&](std::uint64_t begin, std::uint64_t end) {
    return static_cast<std::size_t>(std::uniform_int_distribution<std::uint64_t>(begin, end - 1)(rng));
  };
  // Half the positions in the length prefix and JSON header (small but dense with meaning), half
  // anywhere in the file (mostly tensor data).
  auto pick_position = [&](int i) { return i % 2 == 0 ? pick(0, header_end) : pick(0, pristine.size()); };
  int rejected = 0;
  for (int i = 0; i < 100; ++i) {
    const std::size_t keep = pick_position(i);
    const Bytes cut(pristine.begin(), pristine.begin() + static_cast<std::ptrdiff_t>(keep));
    const std::string msg = load_error(cut, name);
    INFO("truncated to " << keep << " bytes (seed " << seed << "): " << msg);
    CHECK(msg.rfind(name, 0) == 0);
    rejected += msg.rfind(name, 0) == 0 ? 1 : 0;
  }
  for (int i = 0; i < 100; ++i) {
    const std::size_t pos = pick_position(i);
    const auto mask = static_cast<std::uint8_t>(pick(1, 256));
    Bytes bad = pristine;
    bad[pos] ^= mask;
    const std::string msg = load_error(bad, name);
    INFO("byte " << pos << " xor " << int(mask) << " (seed " << seed << "): " << msg);
    CHECK(msg.rfind(name, 0) == 0);
    rejected += msg.rfind(name, 0) == 0 ? 1 : 0;
  }
  CHECK(rejected == 200);
}

}  // namespace

TEST_SUITE("stats") {

TEST_CASE("stats: .pt -> safetensors -> load is bitwise equal for both real files") {
  for (const char* file : {"qwen3_8b.pt", "ds_llama8b.pt"}) {
    CAPTURE(file);
    const auto pt = triattn::load_pt_stats(calib_path(file));
    const auto path = temp_file(file);
    triattn::save_safetensors_stats(path.string(), pt);
    triattn::StatsExpectation expect;
    expect.num_layers = pt.num_layers;
    expect.head_dim = 128;
    const auto st = triattn::load_safetensors_stats(path.string(), expect);
    std::filesystem::remove(path);
    check_bitwise_equal(pt, st);
    // Serialization is deterministic.
    CHECK(triattn::serialize_safetensors_stats(st) == triattn::serialize_safetensors_stats(pt));
  }
}

TEST_CASE("stats: the header is plain safetensors: aligned F32 tensors of shape L x Hq x F and string metadata") {
  const auto pt = triattn::load_pt_stats(calib_path("qwen3_8b.pt"));
  const Bytes b = triattn::serialize_safetensors_stats(pt);
  const std::uint64_t n = triattn::detail::load_le64(b.data());
  CHECK((8 + n) % 8 == 0);
  const std::string header(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  CHECK(contains(header, "\"format\":\"triattn-stats-v1\""));
  CHECK(contains(header, "\"model_name\":\"Qwen/Qwen3-8B\""));
  CHECK(contains(header, "\"q_abs_mean\":{\"dtype\":\"F32\",\"shape\":[36,32,64]"));
  CHECK(b.size() == 8 + n + 3u * 36u * 32u * 64u * 4u);
  // The data section is the raw little-endian floats, q_mean_real first.
  CHECK(triattn::detail::load_le_f32(b.data() + 8 + n) == pt.q_mean_real[0]);
}

TEST_CASE("stats: TP slices keep first_q_head through safetensors") {
  const auto pt = triattn::load_pt_stats(calib_path("ds_llama8b.pt"));
  const auto slice = triattn::slice_for_rank(pt, 3, 4, 8);
  const Bytes b = triattn::serialize_safetensors_stats(slice);
  const auto back = triattn::load_safetensors_stats(std::span<const std::uint8_t>(b), "slice");
  check_bitwise_equal(slice, back);
  CHECK(back.first_q_head == 24);
}

TEST_CASE("stats: every truncation and every byte flip of a small real safetensors file is rejected") {
  // One query head of ds_llama8b's statistics (every layer): the real values and metadata in a file
  // small enough to try every position in CI time. Every proper prefix; three masks at every
  // header byte, one at every tensor byte.
  const Bytes pristine =
      triattn::serialize_safetensors_stats(triattn::slice_query_heads(triattn::load_pt_stats(calib_path("ds_llama8b.pt")), 0, 1));
  const std::string name = "ds_llama8b_head0.safetensors";
  REQUIRE(load_error(pristine, name).empty());
  int tried = 0, accepted = 0;
  std::string first;
  const auto expect_rejected = [&](const Bytes& bad, const std::string& what) {
    ++tried;
    const std::string msg = load_error(bad, name);
    if (msg.rfind(name, 0) == 0) return;
    if (accepted++ == 0) first = what + ": " + (msg.empty() ? std::string("loaded") : msg);
  };
  for (std::size_t keep = 0; keep < pristine.size(); ++keep)
    expect_rejected(Bytes(pristine.begin(), pristine.begin() + static_cast<std::ptrdiff_t>(keep)),
                    "truncated to " + std::to_string(keep));
  const std::size_t header_end = 8 + static_cast<std::size_t>(triattn::detail::load_le64(pristine.data()));
  for (std::size_t pos = 0; pos < pristine.size(); ++pos)
    for (const std::uint8_t mask : {std::uint8_t{0x01}, std::uint8_t{0x80}, std::uint8_t{0xff}}) {
      if (pos >= header_end && mask != 0x01) break;  // tensor bytes: one flip each (the CRC-32 sees any)
      Bytes bad = pristine;
      bad[pos] ^= mask;
      expect_rejected(bad, "byte " + std::to_string(pos) + " xor " + std::to_string(mask));
    }
  MESSAGE(name << ": " << pristine.size() << " bytes, " << tried << " corruptions tried");
  INFO("first accepted corruption: " << first);
  CHECK(accepted == 0);
}

TEST_CASE("stats: 200 corruptions of qwen3_8b statistics in safetensors are all rejected") {
  corruption_campaign("qwen3_8b.pt");
}

TEST_CASE("stats: 200 corruptions of ds_llama8b statistics in safetensors are all rejected") {
  corruption_campaign("ds_llama8b.pt");
}

TEST_CASE("stats: hand-made safetensors files: the valid one loads and each defect is named") {
  const std::string name = "handmade.safetensors";
  Spec spec = base_spec(2, 3, 8);
  REQUIRE(load_error(make_file(spec), name).empty());
  auto err = [&](const Spec& s) {
    const std::string msg = load_error(make_file(s), name);
    CHECK(msg.rfind(name, 0) == 0);
    return msg;
  };
  auto replace = [](std::string s, const std::string& from, const std::string& to) {
    const auto at = s.find(from);
    REQUIRE(at != std::string::npos);
    return s.replace(at, from.size(), to);
  };
  SUBCASE("dtype other than F32") {
    Spec s = spec;
    s.tensors = replace(s.tensors, "\"F32\"", "\"F16\"");
    CHECK(contains(err(s), "tensor q_mean_real has dtype F16; only F32 is supported"));
  }
  SUBCASE("shape disagreeing with the metadata") {
    Spec s = spec;
    s.tensors = replace(s.tensors, "[2,3,4]", "[2,4,3]");
    CHECK(contains(err(s), "tensor q_mean_real does not have shape [2, 3, 4]"));
  }
  SUBCASE("overlapping and gapped offsets") {
    Spec s = spec;
    s.tensors = replace(s.tensors, "[96,192]", "[92,188]");
    CHECK(contains(err(s), "overlaps or leaves a gap"));
    s = spec;
    s.data.resize(s.data.size() + 4);
    s.tensors = replace(s.tensors, "[96,192]", "[100,196]");
    s.tensors = replace(s.tensors, "[192,288]", "[196,292]");
    CHECK(contains(err(s), "overlaps or leaves a gap"));
  }
  SUBCASE("offsets outside the data") {
    Spec s = spec;
    s.tensors = replace(s.tensors, "[192,288]", "[288,384]");
    CHECK(contains(err(s), "is past the 288 data bytes"));
  }
  SUBCASE("unindexed trailing data") {
    Spec s = spec;
    s.data.resize(s.data.size() + 8);
    CHECK(contains(err(s), "8 data bytes after the last tensor"));
  }
  SUBCASE("missing and unknown tensors") {
    Spec s = spec;
    s.tensors = replace(s.tensors, "\"q_abs_mean\"", "\"k_abs_mean\"");
    CHECK(contains(err(s), "unexpected tensor \"k_abs_mean\""));
  }
  SUBCASE("NaN value") {
    Spec s = spec;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::uint32_t bits = 0;
    std::memcpy(&bits, &nan, 4);
    // q_mean_imag of layer 1, head 0, f 2 = element 96/4 + (1*3 + 0)*4 + 2.
    const std::size_t at = 96 + ((1 * 3 + 0) * 4 + 2) * 4;
    for (int i = 0; i < 4; ++i) s.data[at + i] = static_cast<std::uint8_t>(bits >> (8 * i));
    CHECK(contains(err(s), "layer01_head00 q_mean_imag[2] is NaN"));
  }
  SUBCASE("metadata problems") {
    Spec s = spec;
    s.meta["format"] = "something-else";
    CHECK(contains(err(s), "__metadata__.format is \"something-else\""));
    s = spec;
    s.meta.erase("head_dim");
    CHECK(contains(err(s), "__metadata__ has no \"head_dim\" entry"));
    s = spec;
    s.meta["num_layers"] = "02";
    CHECK(contains(err(s), "__metadata__.num_layers \"02\" is not a non-negative decimal integer"));
    s = spec;
    s.meta["rope_style"] = "neox";
    CHECK(contains(err(s), "rope_style \"neox\""));
    s = spec;
    s.add_crc = false;
    CHECK(contains(err(s), "no \"content_crc32\" entry"));
    s = spec;
    s.meta["model_name"] = "other/model";
    s.add_crc = false;
    s.meta["content_crc32"] = triattn::detail::hex32(triattn::detail::stats_content_crc(spec.meta, spec.data));
    CHECK(contains(err(s), "content CRC-32 mismatch"));
  }
  SUBCASE("a caller expectation mismatch") {
    triattn::StatsExpectation expect;
    expect.num_q_heads = 4;
    CHECK(contains(load_error(make_file(spec), name, expect), "num_q_heads mismatch: expected 4, the file has 3"));
  }
  SUBCASE("header length past the file") {
    Bytes b = make_file(spec);
    b[7] = 1;
    CHECK(contains(load_error(b, name), "runs past the end of the file"));
    CHECK(contains(load_error(Bytes{1, 2, 3}, name), "too short for a safetensors header"));
  }
}

TEST_CASE("stats: writing refuses malformed statistics") {
  triattn::QueryStats s;
  s.num_layers = 1;
  s.num_q_heads = 1;
  s.head_dim = 4;
  s.q_mean_real = {0.5f, 0.0f};
  s.q_mean_imag = {0.0f, 0.0f};
  s.q_abs_mean = {1.0f, 1.0f};
  CHECK(triattn::serialize_safetensors_stats(s).size() > 8);
  s.q_abs_mean[1] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS((void)triattn::serialize_safetensors_stats(s), doctest::Contains("is NaN"), triattn::logic_error);
  s.q_abs_mean = {1.0f};
  CHECK_THROWS_WITH_AS((void)triattn::serialize_safetensors_stats(s), doctest::Contains("holds 1 values"),
                       triattn::logic_error);
  s.head_dim = 3;
  CHECK_THROWS_AS((void)triattn::serialize_safetensors_stats(s), triattn::logic_error);
}

TEST_CASE("stats: JSON reader") {
  using triattn::detail::JsonValue;
  using triattn::detail::parse_json;
  const JsonValue v = parse_json(R"( {"a": [1, -2, 0], "s": "x\"\\\/\n\u00e9\ud83d\ude00", "o": {}} )", "j");
  REQUIRE(v.kind == JsonValue::Kind::kObject);
  REQUIRE(v.find("a") != nullptr);
  CHECK(v.find("a")->items.size() == 3);
  CHECK(v.find("a")->items[1].integer == -2);
  CHECK(v.find("s")->str == "x\"\\/\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(v.find("o")->kind == JsonValue::Kind::kObject);
  CHECK(triattn::detail::json_quote("a\"b\\c\n\x01") == "\"a\\\"b\\\\c\\n\\u0001\"");
  auto err = [](const std::string& text) -> std::string {
    try {
      (void)parse_json(text, "j");
    } catch (const triattn::format_error& e) {
      return e.what();
    }
    return "";
  };
  CHECK(contains(err("{\"a\":1,\"a\":2}"), "duplicate key"));
  CHECK(contains(err("[1.5]"), "only integers"));
  CHECK(contains(err("[true]"), "unsupported JSON value"));
  CHECK(contains(err("[01]"), "leading zero"));
  CHECK(contains(err("[99999999999999999999]"), "64 bits"));
  CHECK(contains(err("\"\\ud800\""), "unpaired high surrogate"));
  CHECK(contains(err("\"abc"), "unterminated string"));
  CHECK(contains(err("{\"a\":1} x"), "unexpected text"));
  CHECK(contains(err(std::string(10000, '[')), "nested deeper"));
  CHECK(contains(err("\"a\tb\""), "raw control character"));
}

TEST_CASE("stats: JSON reader in its full subset (reference data files) reads fractions and literals") {
  using triattn::detail::JsonSubset;
  using triattn::detail::JsonValue;
  using triattn::detail::parse_json;
  const JsonValue v =
      parse_json(R"({"r": [1.5, -2e-3, 0.25E+2, 7], "t": true, "f": false, "n": null})", "j", JsonSubset::kFull);
  const JsonValue& r = v.at("r");
  REQUIRE(r.items.size() == 4);
  CHECK(r.at(std::size_t{0}).kind == JsonValue::Kind::kReal);
  CHECK(r.at(std::size_t{0}).as_double() == 1.5);
  CHECK(r.at(1).as_double() == -2e-3);
  CHECK(r.at(2).as_double() == 25.0);
  CHECK(r.at(3).kind == JsonValue::Kind::kInt);
  CHECK(r.at(3).as_double() == 7.0);
  CHECK((v.at("t").kind == JsonValue::Kind::kBool && v.at("t").integer == 1));
  CHECK((v.at("f").kind == JsonValue::Kind::kBool && v.at("f").integer == 0));
  CHECK(v.at("n").kind == JsonValue::Kind::kNull);
  CHECK_THROWS_AS((void)v.at("missing"), triattn::format_error);
  CHECK_THROWS_AS((void)r.at(4), triattn::format_error);
  CHECK_THROWS_AS((void)v.at("t").as_double(), triattn::format_error);
  auto err = [](const std::string& text) -> std::string {
    try {
      (void)parse_json(text, "j", JsonSubset::kFull);
    } catch (const triattn::format_error& e) {
      return e.what();
    }
    return "";
  };
  for (const char* bad : {"[1.]", "[1e]", "[1e+]", "[.5]", "[-]", "[tru]", "[01.5]", "[1e999]"})
    CHECK_MESSAGE(!err(bad).empty(), bad);
  CHECK(contains(err("[1.x]"), "at byte 3"));
}

}  // TEST_SUITE

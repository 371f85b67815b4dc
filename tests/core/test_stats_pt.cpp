// SPDX-License-Identifier: Apache-2.0
// Loading TriAttention's published `.pt` statistics: both real files, their first values, the
// caller's geometry check, 200 seeded corruptions per file (truncations and flipped bytes, each
// must be a format_error naming the file), hand-made bad archives (unsupported opcode,
// big-endian, wrong shape, missing head, NaN...) and the `.pt` writer round trip.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>

#include "common/non_regular_files.hpp"

namespace {

using Bytes = std::vector<std::uint8_t>;

std::string calib_path(const char* file) { return std::string(TRIATTN_SHARED_DATA_DIR) + "/calibration/" + file; }

// A missing data file must fail the test, not skip it: read_file_bytes throws.
Bytes read_real(const char* file) { return triattn::detail::read_file_bytes(calib_path(file)); }

// Runs the loader; returns the format_error message, or "" when the bytes loaded. Any other
// exception escapes and fails the test case.
std::string load_error(const Bytes& bytes, const std::string& name, const triattn::StatsExpectation& expect = {}) {
  try {
    (void)triattn::load_pt_stats(std::span<const std::uint8_t>(bytes), name, expect);
  } catch (const triattn::format_error& e) {
    return e.what();
  }
  return "";
}

// Small random statistics with |mean| < abs mean everywhere.
triattn::QueryStats make_stats(int layers, int heads, int head_dim, std::uint64_t seed) {
  triattn::QueryStats s;
  s.model_name = "test/model";
  s.num_layers = layers;
  s.num_q_heads = heads;
  s.head_dim = head_dim;
  const std::size_t n = static_cast<std::size_t>(layers) * heads * (head_dim / 2);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    const float re = u(rng), im = u(rng);
    s.q_mean_real.push_back(re);
    s.q_mean_imag.push_back(im);
    s.q_abs_mean.push_back(std::sqrt(re * re + im * im) + 0.5f);
  }
  return s;
}

// Hand-made archives: TriAttention's layout with one thing changed.
struct Tweak {
  std::vector<std::int64_t> shape;     // empty: (F,)
  int omit_layer = -1, omit_head = -1;  // leave this head out of sampled_heads and stats
  std::string storage_type = "FloatStorage";
  std::int64_t stride = 1;
  std::string byteorder = "little";
  std::string rope_style = "half";
  bool insert_int_opcode = false;  // protocol-0 INT ('I'), outside the supported subset
};

Bytes make_pt(const triattn::QueryStats& s, const Tweak& t = {}) {
  using triattn::detail::PickleWriter;
  const int nf = s.num_freqs();
  const std::vector<std::int64_t> shape = t.shape.empty() ? std::vector<std::int64_t>{nf} : t.shape;
  const std::vector<std::int64_t> stride(shape.size(), t.stride);
  auto omitted = [&](int l, int h) { return l == t.omit_layer && h == t.omit_head; };
  PickleWriter w;
  w.proto();
  if (t.insert_int_opcode) w.op('I').op('1').op('\n');
  w.empty_dict().mark().str("metadata").empty_dict().mark();
  w.str("rope_style").str(t.rope_style).str("sampled_heads").empty_list().mark();
  for (int l = 0; l < s.num_layers; ++l)
    for (int h = 0; h < s.num_q_heads; ++h)
      if (!omitted(l, h)) w.empty_list().mark().integer(l).integer(h).appends();
  w.appends().str("head_dim").integer(s.head_dim).str("model_name").str(s.model_name).setitems();
  w.str("stats").empty_dict().mark();
  std::vector<Bytes> storages;
  std::int64_t numel = 1;
  for (const auto d : shape) numel *= d;
  for (int l = 0; l < s.num_layers; ++l) {
    for (int h = 0; h < s.num_q_heads; ++h) {
      if (omitted(l, h)) continue;
      w.str(triattn::detail::head_key(l, h)).empty_dict().mark();
      const float* arrays[3] = {s.mean_real(l, h), s.mean_imag(l, h), s.abs_mean(l, h)};
      const char* names[3] = {"q_mean_real", "q_mean_imag", "q_abs_mean"};
      for (int a = 0; a < 3; ++a) {
        w.str(names[a]).tensor(std::to_string(storages.size()), numel, 0, shape, stride, t.storage_type);
        Bytes data;
        for (std::int64_t f = 0; f < numel; ++f) triattn::detail::append_le_f32(data, arrays[a][f % nf]);
        storages.push_back(std::move(data));
      }
      w.setitems();
    }
  }
  w.setitems().setitems().stop();
  triattn::detail::PtArchiveOptions opt;
  opt.root = "handmade";
  opt.byteorder = t.byteorder;
  return triattn::detail::build_pt_archive(w.bytes, storages, opt);
}

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

std::uint64_t test_seed() {
  const char* env = std::getenv("TRIATTN_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20240917ull;
}

// Byte ranges whose content no reader gives meaning to: central-directory "version made by",
// internal and external attributes, and the ZIP64 record's version fields. Flipping them leaves
// the archive semantically identical, so the flip test does not pick them (every other byte is
// covered by a CRC, a cross-check between local header / descriptor / central directory, the
// no-gap layout check, or the padding check).
std::set<std::size_t> ignorable_bytes(const Bytes& file) {
  const triattn::detail::ZipReader zip(file, "pristine");
  std::set<std::size_t> out;
  for (const auto& e : zip.entries()) {
    const std::size_t c = static_cast<std::size_t>(e.central_header_offset);
    for (std::size_t i : {4, 5, 36, 37, 38, 39, 40, 41}) out.insert(c + i);
  }
  const std::size_t eocd = file.size() - 22;
  const std::size_t zip64 = static_cast<std::size_t>(triattn::detail::load_le64(file.data() + eocd - 20 + 8));
  for (std::size_t i = 12; i < 16; ++i) out.insert(zip64 + i);
  return out;
}

void corruption_campaign(const char* file) {
  const std::string path = calib_path(file);
  const Bytes pristine = read_real(file);
  REQUIRE(load_error(pristine, path).empty());
  const std::uint64_t seed = test_seed();
  MESSAGE(std::string(file) << ": corruption seed " << seed << " (set TRIATTN_TEST_SEED to change)");
  std::mt19937_64 rng(seed);

  // Regions the positions are drawn from: the pickle, the payloads, the central directory, the
  // end records and the whole file.
  const triattn::detail::ZipReader zip(pristine, path);
  std::uint64_t cd_start = pristine.size();
  const triattn::detail::ZipEntry* pkl = nullptr;
  std::vector<const triattn::detail::ZipEntry*> storages;
  for (const auto& e : zip.entries()) {
    cd_start = std::min(cd_start, e.central_header_offset);
    if (contains(e.name, "data.pkl")) pkl = &e;
    if (contains(e.name, "/data/")) storages.push_back(&e);
  }
  REQUIRE(pkl != nullptr);
  REQUIRE(!storages.empty());
  auto pick = [&](std::uint64_t begin, std::uint64_t end) {
    return static_cast<std::size_t>(std::uniform_int_distribution<std::uint64_t>(begin, end - 1)(rng));
  };
  auto pick_position = [&](int i) -> std::size_t {
    switch (i % 5) {
      case 0: return pick(pkl->data_offset, pkl->data_offset + pkl->compressed_size);
      case 1: {
        const auto* e = storages[pick(0, storages.size())];
        return pick(e->local_header_offset, e->data_offset + e->compressed_size + 16);  // header..descriptor
      }
      case 2: return pick(cd_start, pristine.size() - 98);  // central directory
      case 3: return pick(pristine.size() - 98, pristine.size());  // ZIP64 record, locator, EOCD
      default: return pick(0, pristine.size());
    }
  };

  const std::set<std::size_t> ignorable = ignorable_bytes(pristine);
  int rejected = 0, attempts = 0;
  for (int i = 0; i < 100; ++i) {  // truncations
    const std::size_t keep = pick_position(i);
    const Bytes cut(pristine.begin(), pristine.begin() + static_cast<std::ptrdiff_t>(keep));
    const std::string msg = load_error(cut, path);
    INFO("truncated to " << keep << " bytes (seed " << seed << "): " << msg);
    CHECK(contains(msg, path));
    rejected += msg.rfind(path, 0) == 0 ? 1 : 0;
    ++attempts;
  }
  for (int i = 0; i < 100; ++i) {  // single flipped bytes
    std::size_t pos = pick_position(i);
    while (ignorable.count(pos) != 0) pos = pick_position(i);
    const auto mask = static_cast<std::uint8_t>(pick(1, 256));
    Bytes bad = pristine;
    bad[pos] ^= mask;
    const std::string msg = load_error(bad, path);
    INFO("byte " << pos << " xor 0x" << std::hex << int(mask) << std::dec << " (seed " << seed << "): " << msg);
    CHECK(contains(msg, path));
    rejected += msg.rfind(path, 0) == 0 ? 1 : 0;
    ++attempts;
  }
  CHECK(attempts == 200);
  CHECK(rejected == 200);
}

}  // namespace

TEST_SUITE("stats") {

TEST_CASE("stats: qwen3_8b.pt loads with the documented geometry and first values") {
  const triattn::QueryStats s = triattn::load_pt_stats(calib_path("qwen3_8b.pt"));
  CHECK(s.model_name == "Qwen/Qwen3-8B");
  CHECK(s.rope_style == triattn::RopeStyle::kHalf);
  CHECK(s.num_layers == 36);
  CHECK(s.num_q_heads == 32);
  CHECK(s.head_dim == 128);
  CHECK(s.num_freqs() == 64);
  CHECK(s.first_q_head == 0);
  REQUIRE(s.q_mean_real.size() == 36u * 32u * 64u);
  const float re[4] = {-0.0800152f, 0.0675611f, 0.321134f, 0.206012f};
  const float im[4] = {-0.0252257f, 0.145549f, 0.0103844f, 0.047275f};
  const float ab[4] = {0.181334f, 0.258058f, 0.490048f, 0.349481f};
  for (int f = 0; f < 4; ++f) {
    CHECK(std::fabs(s.mean_real(0, 0)[f] - re[f]) < 1e-6f);
    CHECK(std::fabs(s.mean_imag(0, 0)[f] - im[f]) < 1e-6f);
    CHECK(std::fabs(s.abs_mean(0, 0)[f] - ab[f]) < 1e-6f);
  }
  // README: the first storage's bytes start 08 df a3 bd (little-endian -0.0800152).
  std::uint32_t bits = 0;
  std::memcpy(&bits, s.q_mean_real.data(), 4);
  CHECK(bits == 0xbda3df08u);
}

TEST_CASE("stats: ds_llama8b.pt loads with the documented geometry and first values") {
  triattn::StatsExpectation expect;
  expect.num_layers = 32;
  expect.num_q_heads = 32;
  expect.head_dim = 128;
  expect.rope_style = triattn::RopeStyle::kHalf;
  const triattn::QueryStats s = triattn::load_pt_stats(calib_path("ds_llama8b.pt"), expect);
  CHECK(s.model_name == "deepseek-ai/DeepSeek-R1-Distill-Llama-8B");
  CHECK(s.num_layers == 32);
  CHECK(s.num_q_heads == 32);
  CHECK(s.num_freqs() == 64);
  const float re[4] = {0.4916f, 1.43099f, 1.06925f, -1.20059f};
  const float ab[4] = {0.541743f, 1.7543f, 1.99781f, 1.68536f};
  for (int f = 0; f < 4; ++f) {
    CHECK(std::fabs(s.mean_real(0, 0)[f] - re[f]) < 1e-5f);  // README prints 6 significant digits
    CHECK(std::fabs(s.abs_mean(0, 0)[f] - ab[f]) < 1e-5f);
  }
  // Value ranges from the README.
  const auto [lo, hi] = std::minmax_element(s.q_abs_mean.begin(), s.q_abs_mean.end());
  CHECK(*lo > 0.09f);
  CHECK(*hi < 15.1f);
}

TEST_CASE("stats: a geometry mismatch names expected and found values") {
  const std::string path = calib_path("qwen3_8b.pt");
  const Bytes bytes = read_real("qwen3_8b.pt");
  triattn::StatsExpectation expect;
  expect.num_layers = 32;
  std::string msg = load_error(bytes, path, expect);
  CHECK(msg.rfind(path, 0) == 0);
  CHECK(contains(msg, "num_layers mismatch: expected 32, the file has 36"));
  expect = {};
  expect.head_dim = 64;
  CHECK(contains(load_error(bytes, path, expect), "head_dim mismatch: expected 64, the file has 128"));
  expect = {};
  expect.rope_style = triattn::RopeStyle::kInterleaved;
  CHECK(contains(load_error(bytes, path, expect), "rope_style mismatch: expected interleaved, the file has half"));
  expect = {};
  expect.num_q_heads = 8;
  CHECK(contains(load_error(bytes, path, expect), "num_q_heads mismatch: expected 8, the file has 32"));
}

TEST_CASE("stats: a missing file is a format_error naming it") {
  const std::string path = calib_path("no_such_file.pt");
  CHECK_THROWS_WITH_AS(triattn::load_pt_stats(path), doctest::Contains(path.c_str()), triattn::format_error);
}

TEST_CASE("stats: 200 corruptions of qwen3_8b.pt are all rejected") { corruption_campaign("qwen3_8b.pt"); }

TEST_CASE("stats: 200 corruptions of ds_llama8b.pt are all rejected") { corruption_campaign("ds_llama8b.pt"); }

TEST_CASE("stats: every truncation and every byte flip of a small .pt file is rejected") {
  // The published files are too large to try every position in CI time (1.7 and 1.9 MB); this
  // file from the .pt writer has the same structure (pickle, storages, descriptors, ZIP64 end
  // records). Every proper prefix and, at every byte but the ignorable ones, three masks.
  const Bytes pristine = triattn::serialize_pt_stats(make_stats(2, 2, 8, 5), "small");
  const std::string name = "small.pt";
  REQUIRE(load_error(pristine, name).empty());
  const std::set<std::size_t> ignorable = ignorable_bytes(pristine);
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
  for (std::size_t pos = 0; pos < pristine.size(); ++pos) {
    if (ignorable.count(pos) != 0) continue;
    for (const std::uint8_t mask : {std::uint8_t{0x01}, std::uint8_t{0x80}, std::uint8_t{0xff}}) {
      Bytes bad = pristine;
      bad[pos] ^= mask;
      expect_rejected(bad, "byte " + std::to_string(pos) + " xor " + std::to_string(mask));
    }
  }
  MESSAGE(name << ": " << pristine.size() << " bytes (" << ignorable.size() << " ignorable), " << tried
                << " corruptions tried");
  INFO("first accepted corruption: " << first);
  CHECK(accepted == 0);
}

TEST_CASE("stats: hand-made archives: the valid one loads and each defect is named") {
  const triattn::QueryStats s = make_stats(2, 3, 8, 7);
  const std::string name = "handmade.pt";
  SUBCASE("valid") {
    const Bytes good = make_pt(s);
    const auto loaded = triattn::load_pt_stats(std::span<const std::uint8_t>(good), name);
    CHECK(loaded.num_layers == 2);
    CHECK(loaded.num_q_heads == 3);
    CHECK(loaded.head_dim == 8);
    CHECK(loaded.q_mean_real == s.q_mean_real);
    CHECK(loaded.q_abs_mean == s.q_abs_mean);
  }
  SUBCASE("unsupported pickle opcode") {
    Tweak t;
    t.insert_int_opcode = true;
    const std::string msg = load_error(make_pt(s, t), name);
    CHECK(msg.rfind(name, 0) == 0);
    CHECK(contains(msg, "unsupported pickle opcode 0x49 (INT) at byte offset 2"));
  }
  SUBCASE("big-endian byteorder") {
    Tweak t;
    t.byteorder = "big";
    CHECK(contains(load_error(make_pt(s, t), name), "big-endian not supported"));
  }
  SUBCASE("wrong tensor shape") {
    Tweak t;
    t.shape = {2, 2};
    const std::string msg = load_error(make_pt(s, t), name);
    CHECK(contains(msg, "stats['layer00_head00']['q_mean_real'] has shape (2, 2), expected (4,)"));
    t.shape = {3};
    CHECK(contains(load_error(make_pt(s, t), name), "has shape (3,), expected (4,)"));
  }
  SUBCASE("wrong stride") {
    Tweak t;
    t.stride = 2;
    CHECK(contains(load_error(make_pt(s, t), name), "has stride (2,), expected (1,)"));
  }
  SUBCASE("missing head") {
    Tweak t;
    t.omit_layer = 1;
    t.omit_head = 2;  // the grid's last head: sampled_heads still spans 2 x 3 but lacks it
    CHECK(contains(load_error(make_pt(s, t), name), "missing head layer01_head02"));
    t.omit_layer = 0;
    t.omit_head = 1;
    CHECK(contains(load_error(make_pt(s, t), name), "missing head layer00_head01"));
  }
  SUBCASE("NaN and infinite values") {
    triattn::QueryStats bad = s;
    bad.q_mean_imag[bad.offset(1, 2) + 3] = std::numeric_limits<float>::quiet_NaN();
    CHECK(contains(load_error(make_pt(bad), name), "layer01_head02 q_mean_imag[3] is NaN"));
    bad = s;
    bad.q_abs_mean[bad.offset(0, 1)] = std::numeric_limits<float>::infinity();
    CHECK(contains(load_error(make_pt(bad), name), "layer00_head01 q_abs_mean[0] is infinite"));
  }
  SUBCASE("mean magnitude above the magnitude mean") {
    triattn::QueryStats bad = s;
    bad.q_abs_mean[bad.offset(1, 0) + 2] = 0.01f;
    CHECK(contains(load_error(make_pt(bad), name), "layer01_head00 f=2: |q_mean|"));
  }
  SUBCASE("other storage dtypes") {
    Tweak t;
    t.storage_type = "HalfStorage";
    CHECK(contains(load_error(make_pt(s, t), name), "storage type torch.HalfStorage is not supported"));
  }
  SUBCASE("unknown rope style") {
    Tweak t;
    t.rope_style = "neox";
    CHECK(contains(load_error(make_pt(s, t), name), "metadata.rope_style 'neox'"));
  }
  SUBCASE("interleaved rope style is carried through") {
    Tweak t;
    t.rope_style = "interleaved";
    const Bytes b = make_pt(s, t);
    CHECK(triattn::load_pt_stats(std::span<const std::uint8_t>(b), name).rope_style ==
          triattn::RopeStyle::kInterleaved);
  }
  SUBCASE("a compressed entry is refused naming entry and method") {
    Bytes b = make_pt(s);
    // Set method 8 (deflate) on data.pkl in both its local header and its central record.
    const triattn::detail::ZipReader zip(b, name);
    const auto* e = zip.find("handmade/data.pkl");
    REQUIRE(e != nullptr);
    b[e->local_header_offset + 8] = 8;
    b[e->central_header_offset + 10] = 8;
    const std::string msg = load_error(b, name);
    CHECK(contains(msg, "entry 'handmade/data.pkl' uses compression method 8 (deflate)"));
  }
}

TEST_CASE("stats: pickle decoder guards") {
  using triattn::detail::parse_pickle;
  auto err = [](std::vector<std::uint8_t> b) -> std::string {
    try {
      (void)parse_pickle(b, "p");
    } catch (const triattn::format_error& e) {
      return e.what();
    }
    return "";
  };
  CHECK(contains(err({0x80, 2, 'a'}), "stack underflow in APPEND"));
  CHECK(contains(err({0x80, 2, 'h', 7}), "memo GET of key 7"));
  CHECK(contains(err({0x80, 2, 'X', 0xff, 0xff, 0xff, 0x7f, 'a'}), "runs past the end of the pickle"));
  CHECK(contains(err({0x80, 2, ']'}), "without a STOP opcode"));
  CHECK(contains(err({0x80, 2, ']', ']', '.'}), "2 values on the stack"));
  CHECK(contains(err({0x80, 2, '(', ']', '.'}), "STOP with an open MARK"));
  CHECK(contains(err({0x80, 2, ']', '.', '.'}), "bytes after STOP"));
  CHECK(contains(err({0x80, 2, 'e'}), "APPENDS without a MARK"));
  CHECK(contains(err({0x80, 2, '}', '(', 'K', 1, 'u', '.'}), "odd number"));
  CHECK(contains(err({0x80, 2, 0x8a, 9}), "does not fit in 64 bits"));
  CHECK(contains(err({0x80, 2, 0x95}), "unsupported pickle opcode 0x95 (FRAME)"));
  CHECK(contains(err({0x80, 9}), "unsupported pickle protocol 9"));
  CHECK(contains(err({0x80, 2, ']', '(', 'a'}), "stack underflow in APPEND"));  // the list is below the MARK
  // A list that contains itself decodes (no recursion anywhere) and frees cleanly.
  const auto doc = parse_pickle(std::vector<std::uint8_t>{0x80, 2, ']', 'q', 0, 'h', 0, 'a', '.'}, "p");
  CHECK(doc[doc.root].kind == triattn::detail::PyKind::kList);
  CHECK(doc[doc.root].items.size() == 1);
  CHECK(doc[doc.root].items[0] == doc.root);
  // Deep nesting costs no stack either.
  std::vector<std::uint8_t> deep = {0x80, 2};
  for (int i = 0; i < 100000; ++i) deep.push_back('(');
  deep.push_back(')');
  for (int i = 0; i < 100000; ++i) deep.push_back('t');
  deep.push_back('.');
  CHECK(parse_pickle(deep, "p").objects.size() == 100001u);
  // Integers: BININT is signed, LONG1 sign-extends.
  const auto ints = parse_pickle(std::vector<std::uint8_t>{0x80, 2, '(', 'J', 0xff, 0xff, 0xff, 0xff, 0x8a, 2, 0x00, 0x80,
                                                          'M', 0x34, 0x12, 't', '.'},
                                 "p");
  const auto& tup = ints[ints.root];
  REQUIRE(tup.items.size() == 3);
  CHECK(ints[tup.items[0]].integer == -1);
  CHECK(ints[tup.items[1]].integer == -32768);
  CHECK(ints[tup.items[2]].integer == 0x1234);
}

TEST_CASE("stats: .pt writer round trip is bitwise and the real files survive it") {
  const triattn::QueryStats s = make_stats(3, 4, 16, 11);
  const Bytes b = triattn::serialize_pt_stats(s, "roundtrip");
  const auto back = triattn::load_pt_stats(std::span<const std::uint8_t>(b), "roundtrip.pt");
  CHECK(back.model_name == s.model_name);
  CHECK(std::memcmp(back.q_mean_real.data(), s.q_mean_real.data(), s.q_mean_real.size() * 4) == 0);
  CHECK(std::memcmp(back.q_mean_imag.data(), s.q_mean_imag.data(), s.q_mean_imag.size() * 4) == 0);
  CHECK(std::memcmp(back.q_abs_mean.data(), s.q_abs_mean.data(), s.q_abs_mean.size() * 4) == 0);

  const auto real = triattn::load_pt_stats(calib_path("ds_llama8b.pt"));
  const Bytes rb = triattn::serialize_pt_stats(real, "ds_llama8b");
  const auto real_back = triattn::load_pt_stats(std::span<const std::uint8_t>(rb), "rewritten.pt");
  CHECK(real_back.q_abs_mean == real.q_abs_mean);
  CHECK(real_back.model_name == real.model_name);

  triattn::QueryStats slice = s;
  slice.first_q_head = 2;
  CHECK_THROWS_AS((void)triattn::serialize_pt_stats(slice), triattn::logic_error);
  triattn::QueryStats broken = s;
  broken.q_abs_mean.pop_back();
  CHECK_THROWS_AS((void)triattn::serialize_pt_stats(broken), triattn::logic_error);
}

}  // TEST_SUITE

TEST_CASE("stats loaders refuse a directory or a FIFO by type before reading") {
  // tellg() on a directory is LLONG_MAX (the loader asked for ~9.2 EB: std::bad_alloc) and opening
  // a FIFO blocks until a writer appears; both must be a format_error naming the path.
  const triattn::test::NonRegularPaths p;
  for (const auto& [path, why] : {std::pair{p.dir, "directory"}, std::pair{p.fifo, "FIFO"}}) {
    triattn::test::check_refused([](const std::string& f) { (void)triattn::load_pt_stats(f); }, path, why);
    triattn::test::check_refused([](const std::string& f) { (void)triattn::load_safetensors_stats(f); }, path, why);
    triattn::test::check_refused([](const std::string& f) { (void)triattn::detail::read_file_bytes(f); }, path, why);
  }
}

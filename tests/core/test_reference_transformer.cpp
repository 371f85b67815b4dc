// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_model
// Tests of the reference transformer (examples/reference_transformer): the llama2.c loader and
// tokenizer, the Model's forward pass over a triattn::KvCache against recorded llama2.c outputs
// (stories260K_greedy_ref.json: greedy tokens, logits, post-RoPE K and V), prefill vs decode,
// batching, deterministic sampling, and a TriAttention-compressed run.
// Data come from TRIATTN_SHARED_DATA_DIR/models; a missing file fails the test.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/random_scorer.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/ref/attention.hpp>
#include <triattn/core/stats/calibrator.hpp>

#include "common/non_regular_files.hpp"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/generate.hpp>
#include <reference_transformer/llama2c.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/synthetic.hpp>

namespace ex = triattn_example;
using triattn::DType;
using triattn::KvKind;
using triattn::KvLayout;

namespace {

using triattn::test::cache_config;
using triattn::test::data_file;
using triattn::test::max_abs_diff;
using triattn::test::Stories;

std::vector<std::byte> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f);
  std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  std::memcpy(b.data(), c.data(), c.size());
  return b;
}

/// stories260K's tokenizer, loaded once.
const ex::Tokenizer& stories_tokenizer() {
  static const ex::Tokenizer tok =
      ex::Tokenizer::load(data_file("tok512.bin"), Stories::get().weights.config.vocab_size);
  return tok;
}

/// Greedy decode of stories260K from BOS for 256 tokens in `cache`; checks tokens, logits and
/// the cached K/V of positions 0..3 against the reference. Returns the max logit difference.
template <class Cache>
float check_greedy_reference(Cache& cache) {
  const Stories& s = Stories::get();
  ex::Model<> model(s.weights);
  const triattn::test::GreedyRun run = triattn::test::run_stories_greedy(model, cache);
  const auto& res = run.res;
  CHECK(res[0].stop_token == -1);
  const int matched = triattn::test::check_greedy_tokens(s, res[0].generated);
  const float worst = triattn::test::check_reference_logits(
      s, [&](int p) -> std::span<const float> { return run.logits_at[static_cast<std::size_t>(p)]; });
  // Post-RoPE K and V of positions 0..3, read back from the cache through its view.
  const auto view = cache.template view<float>();
  const ex::ModelConfig& mc = s.weights.config;
  const float kv_worst = triattn::test::reference_kv_diff(s, view, res[0].seq);
  CHECK_MESSAGE(kv_worst < 1e-5f, "K/V of positions 0..3: max abs diff " << kv_worst);

  // The model's attention agrees with triattn::ref::attention (the oracle of the CUDA decode
  // kernel) over the whole cached sequence, for an arbitrary query.
  ex::CpuBackend backend;
  std::vector<float> q(static_cast<std::size_t>(mc.q_dim())), mine(q.size()), oracle(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 2.0f * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  const ex::TokenInfo last{res[0].seq, cache.physical_length(res[0].seq) - 1, 0};
  float att_worst = 0.0f;
  for (int l = 0; l < mc.n_layers; ++l) {
    backend.attention<float>(mine.data(), q.data(), std::span<const ex::TokenInfo>(&last, 1), cache, l, mc, nullptr);
    triattn::ref::attention(view, l, res[0].seq, q.data(), mc.n_heads, oracle.data(),
                            triattn::ref::default_sm_scale(mc.head_dim));
    att_worst = std::max(att_worst, max_abs_diff(mine, oracle));
  }
  CHECK_MESSAGE(att_worst < 1e-5f, "model attention vs ref::attention: max abs diff " << att_worst);
  MESSAGE("stories260K greedy: " << matched << "/256 tokens match, logits max abs diff " << worst
                                 << ", K/V max abs diff " << kv_worst
                                 << ", attention vs ref::attention max abs diff " << att_worst);
  CHECK(cache.physical_length(res[0].seq) == 256);
  CHECK(cache.logical_position(res[0].seq) == 256);
  return worst;
}

using PlainCache = triattn::KvCache<>;
using TriCache = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor,
                                  triattn::TriAttentionScorer, triattn::TopKSelector>;

std::vector<std::byte> header_with(const std::vector<std::byte>& file, int field, std::int32_t value) {
  std::vector<std::byte> b = file;
  std::memcpy(b.data() + 4 * field, &value, 4);
  return b;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const triattn::format_error& e) {
    return e.what();
  }
  return "";
}

/// Runs prompts through a fresh cache; returns generated tokens and every sampled row's logits.
struct RunOut {
  std::vector<std::vector<int>> tokens;
  std::vector<std::vector<std::vector<float>>> logits;  // [prompt][token][vocab]
};
RunOut run_synthetic(const ex::ModelWeights& w, const std::vector<std::vector<int>>& prompts,
                     const std::vector<std::uint64_t>& seeds, int steps, float temperature, float top_p,
                     DType dtype = DType::kF32) {
  PlainCache cache(cache_config(w.config, 64 + steps, static_cast<int>(prompts.size()), 8, dtype));
  ex::Model<> model(w);
  std::vector<ex::Sampler> samplers;
  for (std::uint64_t s : seeds) samplers.emplace_back(temperature, top_p, s);
  ex::GenerationOptions opt;
  opt.max_new_tokens = steps;
  opt.stop_at_bos = false;
  RunOut out;
  out.logits.resize(prompts.size());
  ex::GenerationCallbacks cb;
  cb.on_token = [&](int i, int, std::int64_t, std::span<const float> l) {
    out.logits[static_cast<std::size_t>(i)].emplace_back(l.begin(), l.end());
  };
  const auto res = ex::generate(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers),
                                opt, cb);
  for (const auto& r : res) out.tokens.push_back(r.generated);
  return out;
}

}  // namespace

TEST_SUITE("model") {

TEST_CASE("stories260K: greedy decoding through KvCache reproduces llama2.c tokens and logits and K/V") {
  const ex::ModelConfig& mc = Stories::get().weights.config;
  CHECK(mc.dim == 64);
  CHECK(mc.hidden_dim == 172);
  CHECK(mc.n_layers == 5);
  CHECK(mc.n_heads == 8);
  CHECK(mc.n_kv_heads == 4);
  CHECK(mc.vocab_size == 512);
  CHECK(mc.max_seq_len == 512);
  CHECK(mc.shared_classifier);
  CHECK(mc.parameter_count() == 260032);
  SUBCASE("NHD, block 16") {
    PlainCache cache(cache_config(mc, 256, 1));
    check_greedy_reference(cache);
  }
  SUBCASE("HND, block 5 (blocks straddle positions 0..3 and the pool is shuffled by a neighbour)") {
    auto cfg = cache_config(mc, 256, 2, 5, DType::kF32, KvLayout::kHND);
    PlainCache cache(cfg);
    const triattn::SeqId other = cache.add_sequence();  // takes slot ids and blocks first
    REQUIRE(cache.extend(other, 7, triattn::Phase::kPrefill).ok());
    check_greedy_reference(cache);
  }
}

TEST_CASE("stories260K: one prefill step over the whole sequence equals token-by-token decoding") {
  const Stories& s = Stories::get();
  ex::Model<> model(s.weights);
  PlainCache cache(cache_config(s.weights.config, 256, 1));
  std::vector<int> seq = {1};
  seq.insert(seq.end(), s.greedy.begin(), s.greedy.end() - 1);  // inputs at positions 0..255
  const triattn::SeqId id = cache.add_sequence();
  const ex::Chunk chunk{id, seq, triattn::Phase::kPrefill};
  const ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kAllRows);
  REQUIRE(out.num_logit_rows() == 256);
  REQUIRE(out.rows.size() == 256);
  for (int p = 0; p < 256; ++p) {
    CHECK(out.rows[static_cast<std::size_t>(p)].slot == p);
    CHECK(out.rows[static_cast<std::size_t>(p)].pos == p);
    CHECK(ex::Sampler::argmax(out.row(p)) == s.greedy[static_cast<std::size_t>(p)]);
  }
  const float worst = triattn::test::check_reference_logits(s, [&](int p) { return out.row(p); });
  MESSAGE("stories260K prefill of 256 tokens: logits max abs diff " << worst);
  CHECK(cache.prompt_length(id) == 256);
}

TEST_CASE_TEMPLATE("stories260K: a bf16 or fp8 cache stores the rounded K/V and still runs", T, triattn::bf16_storage,
                   triattn::fp8_e4m3_storage) {
  const Stories& s = Stories::get();
  ex::Model<> model(s.weights);
  triattn::CacheConfig cfg = cache_config(s.weights.config, 64, 1, 16, triattn::dtype_of<T>);
  constexpr bool fp8 = triattn::is_scaled_dtype<T>;
  if constexpr (fp8) cfg.kv_scales.assign(2 * static_cast<std::size_t>(s.weights.config.n_layers), 0.5f);
  triattn::KvCache<> cache(cfg);
  const triattn::SeqId id = cache.add_sequence();
  const std::vector<int> toks = {1, s.greedy[0], s.greedy[1], s.greedy[2]};
  const ex::Chunk chunk{id, toks, triattn::Phase::kPrefill};
  const ex::StepOutput out = model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kAllRows);
  const auto view = cache.view<T>();
  const ex::ModelConfig& mc = s.weights.config;
  // layer 0 sees exact float inputs (bf16 keeps 8 bits, e4m3 4: half an ulp relative plus the
  // subnormal step); deeper layers see rounded attention, so allow more
  const float tol0 = fp8 ? 0.0625f + 1e-3f : 4e-3f, tol = fp8 ? 0.25f : 5e-2f;
  for (int l = 0; l < mc.n_layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const auto kref =
          triattn::test::json_numbers<float>(s.ref.at("k_cache_pos0to3").at(static_cast<std::size_t>(l)).at(static_cast<std::size_t>(p)));
      for (int h = 0; h < mc.n_kv_heads; ++h)
        for (int i = 0; i < mc.head_dim; ++i) {
          const float want = kref[static_cast<std::size_t>(h * mc.head_dim + i)];
          const float got = triattn::dequantize(view.token(l, KvKind::kKey, id, p, h)[i], view.scale(l, KvKind::kKey, h));
          CHECK(std::fabs(got - want) <= (l == 0 ? tol0 : tol) * std::max(1.0f, std::fabs(want)));
        }
    }
  for (int p = 0; p < 3; ++p) CHECK(ex::Sampler::argmax(out.row(p)) == s.greedy[static_cast<std::size_t>(p)]);
}

TEST_CASE("llama2.c checkpoint: malformed files are rejected with the file and field named") {
  const std::string path = data_file("stories260K.bin");
  const std::vector<std::byte> good = file_bytes(path);
  REQUIRE(good.size() == 1056540);
  CHECK_NOTHROW((void)ex::parse_llama2c_checkpoint(good, "good.bin"));

  SUBCASE("truncated by one byte") {
    const std::vector<std::byte> b(good.begin(), good.end() - 1);
    const std::string e = error_of([&] { (void)ex::parse_llama2c_checkpoint(b, "cut.bin"); });
    CHECK(e.find("cut.bin") != std::string::npos);
    CHECK(e.find("truncated") != std::string::npos);
    CHECK(e.find("1056540") != std::string::npos);
  }
  SUBCASE("trailing bytes") {
    std::vector<std::byte> b = good;
    b.push_back(std::byte{0});
    CHECK(error_of([&] { (void)ex::parse_llama2c_checkpoint(b, "long.bin"); }).find("trailing") != std::string::npos);
  }
  SUBCASE("shorter than the header") {
    const std::vector<std::byte> b(good.begin(), good.begin() + 10);
    CHECK(error_of([&] { (void)ex::parse_llama2c_checkpoint(b, "tiny.bin"); }).find("header") != std::string::npos);
  }
  SUBCASE("bad header values") {
    struct Case { int field; std::int32_t value; const char* name; };
    for (const Case c : {Case{0, 0, "dim"}, Case{0, -64, "dim"}, Case{0, 63, "dim"}, Case{1, 0, "hidden_dim"},
                         Case{2, 1000000, "n_layers"}, Case{3, 0, "n_heads"}, Case{4, 3, "n_kv_heads"},
                         Case{4, 0, "n_kv_heads"}, Case{5, 0, "vocab_size"}, Case{5, 1 << 30, "vocab_size"},
                         Case{6, -1, "seq_len"}, Case{3, 16, "n_heads"} /* plausible, but the size disagrees */}) {
      const auto b = header_with(good, c.field, c.value);
      const std::string e = error_of([&] { (void)ex::parse_llama2c_checkpoint(b, "bad.bin"); });
      INFO("field " << c.name << " = " << c.value << ": " << e);
      REQUIRE(!e.empty());
      CHECK(e.find("bad.bin") != std::string::npos);
      if (c.field != 3) CHECK(e.find(c.name) != std::string::npos);
    }
  }
  SUBCASE("a negative vocab (separate classifier) needs the extra tensor") {
    const auto b = header_with(good, 5, -512);
    const std::string e = error_of([&] { (void)ex::parse_llama2c_checkpoint(b, "cls.bin"); });
    CHECK(e.find("truncated") != std::string::npos);
    std::vector<std::byte> with_cls = b;
    with_cls.insert(with_cls.end(), good.begin() + 28, good.begin() + 28 + 512 * 64 * 4);  // wcls = tok_emb
    const ex::ModelWeights w = ex::parse_llama2c_checkpoint(with_cls, "cls.bin");
    CHECK(!w.config.shared_classifier);
    CHECK(w.wcls == w.tok_emb);
  }
  SUBCASE("missing and truncated files on disk") {
    CHECK(error_of([] { (void)ex::load_llama2c_checkpoint("/nonexistent/model.bin"); }).find("/nonexistent/model.bin") !=
          std::string::npos);
    const std::filesystem::path tmp = std::filesystem::temp_directory_path() / "triattn_test_truncated_model.bin";
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(reinterpret_cast<const char*>(good.data()), 100000);
    }
    const std::string e = error_of([&] { (void)ex::load_llama2c_checkpoint(tmp.string()); });
    std::filesystem::remove(tmp);
    CHECK(e.find(tmp.string()) != std::string::npos);
    CHECK(e.find("truncated") != std::string::npos);
  }
}

TEST_CASE("llama2.c checkpoint and tokenizer and JSON loaders refuse a directory or a FIFO by type") {
  // A directory's tellg() is LLONG_MAX (the loader asked for ~9.2 EB) and a FIFO blocks on open.
  const triattn::test::NonRegularPaths p;
  for (const auto& [path, why] : {std::pair{p.dir, "directory"}, std::pair{p.fifo, "FIFO"}}) {
    triattn::test::check_refused([](const std::string& f) { (void)ex::load_llama2c_checkpoint(f); }, path, why);
    triattn::test::check_refused([](const std::string& f) { (void)ex::Tokenizer::load(f, 512); }, path, why);
    triattn::test::check_refused([](const std::string& f) { (void)triattn::test::json_file(f); }, path, why);
  }
}

TEST_CASE("tokenizer: decode of the reference tokens and encode/decode round trip and malformed files") {
  const Stories& s = Stories::get();
  const ex::Tokenizer& tok = stories_tokenizer();
  CHECK(tok.vocab_size() == 512);
  CHECK(tok.max_token_length() == 7);
  CHECK(tok.piece(259) == " t");
  CHECK(tok.piece(265) == " the");
  CHECK(tok.decode_piece(13, 16) == std::string(1, '\x0d'));  // <0x0D> is a raw byte
  const std::string text = triattn::test::json_string(s.ref.at("text"));
  CHECK(tok.decode(s.greedy) == text);

  const std::vector<int> ids = tok.encode(text, true, false);
  REQUIRE(ids.size() > 2);
  CHECK(ids.front() == 1);
  CHECK(tok.decode(std::span<const int>(ids).subspan(1)) == text);
  CHECK(ids.size() <= s.greedy.size() + 1);  // the merges are at least as compact as the model's choices
  const std::vector<int> with_eos = tok.encode("Lily", true, true);
  CHECK(with_eos.front() == 1);
  CHECK(with_eos.back() == 2);
  CHECK(tok.encode("", false, false).empty());
  // Codepoints absent from the vocabulary fall back to bytes + 3.
  const std::vector<int> e = tok.encode("\xC3\xA9", false, false);  // é
  CHECK(tok.decode(e, 0).substr(1) == "\xC3\xA9");
  // run.c's merge order on a known word.
  const std::vector<int> once = tok.encode("Once upon a time", false, false);
  CHECK(tok.decode(once, 1) == "Once upon a time");
  CHECK(once == std::vector<int>(s.greedy.begin(), s.greedy.begin() + static_cast<std::ptrdiff_t>(once.size())));

  const std::vector<std::byte> bytes = file_bytes(data_file("tok512.bin"));
  CHECK_NOTHROW((void)ex::Tokenizer::parse(bytes, 512, "t.bin"));
  const std::vector<std::byte> cut(bytes.begin(), bytes.end() - 3);
  CHECK(error_of([&] { (void)ex::Tokenizer::parse(cut, 512, "t.bin"); }).find("truncated") != std::string::npos);
  CHECK(error_of([&] { (void)ex::Tokenizer::parse(bytes, 500, "t.bin"); }).find("trailing") != std::string::npos);
  std::vector<std::byte> badlen = bytes;
  const std::int32_t huge = 1000;
  std::memcpy(badlen.data() + 8, &huge, 4);  // token 0's length
  CHECK(error_of([&] { (void)ex::Tokenizer::parse(badlen, 512, "t.bin"); }).find("token 0") != std::string::npos);
}

TEST_CASE("synthetic model: batch of 3 is deterministic and equals each sequence run alone") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 1234);
  CHECK(w.config.rope_style == triattn::RopeStyle::kHalf);
  CHECK(ex::make_synthetic_weights(ex::synthetic_config("tiny"), 1234).wq == w.wq);  // deterministic weights
  CHECK(ex::make_synthetic_weights(ex::synthetic_config("tiny"), 99).wq != w.wq);
  const std::vector<std::vector<int>> prompts = {{1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50}, {1, 7}, {1, 300, 301, 302, 303, 304}};
  const std::vector<std::uint64_t> seeds = {11, 22, 33};
  for (const float temperature : {0.0f, 0.9f}) {
    INFO("temperature " << temperature);
    const RunOut a = run_synthetic(w, prompts, seeds, 40, temperature, 0.9f);
    const RunOut b = run_synthetic(w, prompts, seeds, 40, temperature, 0.9f);
    CHECK(a.tokens == b.tokens);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      REQUIRE(a.tokens[i].size() == 40);
      const RunOut alone = run_synthetic(w, {prompts[i]}, {seeds[i]}, 40, temperature, 0.9f);
      CHECK(alone.tokens[0] == a.tokens[i]);
      CHECK(alone.logits[0] == a.logits[i]);  // bitwise: a row's arithmetic does not depend on the batch
    }
    // Distinct prompts and seeds give distinct continuations.
    CHECK(a.tokens[0] != a.tokens[1]);
    if (temperature > 0) {
      const RunOut c = run_synthetic(w, prompts, {12, 22, 33}, 40, temperature, 0.9f);
      CHECK(c.tokens[0] != a.tokens[0]);
      CHECK(c.tokens[1] == a.tokens[1]);
    }
  }
  // The per-head query bias gives every head a concentrated pre-RoPE query direction, which is
  // what TriAttention statistics capture: mean resultant length |E z_f| / E|z_f| well above 0.
  {
    triattn::Calibrator cal(w.config.n_layers, w.config.n_heads, w.config.head_dim, w.config.rope_style, "tiny");
    ex::Model<> model(w);
    model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
    PlainCache cache(cache_config(w.config, 128, 1));
    std::vector<int> toks;
    for (int i = 0; i < 128; ++i) toks.push_back((i * 37 + 11) % w.config.vocab_size);
    const triattn::SeqId id = cache.add_sequence();
    const ex::Chunk chunk{id, toks, triattn::Phase::kPrefill};
    (void)model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
    const triattn::QueryStats st = cal.finish();
    double mrl = 0.0;
    for (std::size_t i = 0; i < st.q_abs_mean.size(); ++i)
      mrl += std::hypot(st.q_mean_real[i], st.q_mean_imag[i]) / st.q_abs_mean[i];
    mrl /= static_cast<double>(st.q_abs_mean.size());
    MESSAGE("synthetic tiny: mean resultant length of pre-RoPE queries " << mrl);
    CHECK(mrl > 0.4);
  }
  // A bf16 cache runs the same loop and stays close to the float32 one: K/V rounded to bf16
  // (relative 2^-9) move the logits by under 1% of their largest magnitude, and greedy tokens agree until
  // the first step whose float32 top-2 margin is within that difference.
  const RunOut h = run_synthetic(w, prompts, seeds, 8, 0.0f, 1.0f, DType::kBF16);
  const RunOut f = run_synthetic(w, prompts, seeds, 8, 0.0f, 1.0f, DType::kF32);
  REQUIRE(h.tokens.size() == 3);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    REQUIRE(h.tokens[i].size() == 8);
    for (std::size_t t = 0; t < 8; ++t) {
      const float diff = max_abs_diff(h.logits[i][t], f.logits[i][t]);
      float spread = 0.0f;
      for (float x : f.logits[i][t]) spread = std::max(spread, std::fabs(x));
      INFO("sequence " << i << ", step " << t << ": bf16 vs f32 logits differ by " << diff << " (max |logit| " << spread << ")");
      CHECK(diff <= 0.01f * spread);  // measured <= 0.3% (0.019 of 6.97)
      if (h.tokens[i][t] != f.tokens[i][t]) {
        CHECK(triattn::test::min_top2_margin({f.logits[i][t]}) <= 2.0f * diff);  // a near tie may flip
        break;                                                     // then the texts differ
      }
    }
  }
}

TEST_CASE("generate: without logits for on_token the same tokens come out (sampled from the logits in place)") {
  // Decode steps read the logits where the backend keeps them (no StepOutput copy); with
  // token_logits off on_token gets empty spans (on the GPU greedy steps then take a device argmax).
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 77);
  const std::vector<std::vector<int>> prompts = {{1, 40, 41, 42, 43}, {1, 7}, {1, 300, 301, 302}};
  constexpr int kSteps = 24;
  struct Out {
    std::vector<std::vector<int>> tokens, seen;          // generated; what on_token saw
    std::vector<std::vector<std::int64_t>> pos;          // on_token's positions
    std::vector<std::vector<std::vector<float>>> logits; // non-empty spans on_token got
    std::size_t empty_spans = 0;
    ex::GenerationStats st;
  };
  auto run = [&](const std::vector<float>& temperatures, bool token_logits) {
    PlainCache cache(cache_config(w.config, 64 + kSteps, static_cast<int>(prompts.size())));
    ex::Model<> model(w);
    std::vector<ex::Sampler> samplers;
    for (std::size_t i = 0; i < prompts.size(); ++i) samplers.emplace_back(temperatures[i], 0.9f, 5 + i);
    ex::GenerationOptions opt;
    opt.max_new_tokens = kSteps;
    opt.stop_at_bos = false;
    Out o;
    o.seen.resize(prompts.size());
    o.pos.resize(prompts.size());
    o.logits.resize(prompts.size());
    ex::GenerationCallbacks cb;
    cb.token_logits = token_logits;
    cb.on_token = [&](int i, int token, std::int64_t pos, std::span<const float> l) {
      const auto k = static_cast<std::size_t>(i);
      o.seen[k].push_back(token);
      o.pos[k].push_back(pos);
      if (l.empty()) ++o.empty_spans;
      else o.logits[k].emplace_back(l.begin(), l.end());
    };
    for (const auto& r : ex::generate(model, cache, std::span<const std::vector<int>>(prompts),
                                      std::span<ex::Sampler>(samplers), opt, cb, &o.st))
      o.tokens.push_back(r.generated);
    return o;
  };
  for (const std::vector<float>& temps : {std::vector<float>{0.0f, 0.0f, 0.0f}, std::vector<float>{0.0f, 0.8f, 0.0f}}) {
    INFO("temperatures " << temps[0] << ", " << temps[1] << ", " << temps[2]);
    const Out with = run(temps, true);
    const Out without = run(temps, false);
    CHECK(without.tokens == with.tokens);
    CHECK(without.seen == with.seen);
    CHECK(without.pos == with.pos);
    CHECK(without.empty_spans == prompts.size() * kSteps);
    CHECK(with.empty_spans == 0);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      REQUIRE(with.tokens[i].size() == kSteps);
      REQUIRE(with.logits[i].size() == kSteps);
      for (std::size_t t = 0; t < kSteps; ++t) {
        CHECK(with.pos[i][t] == static_cast<std::int64_t>(prompts[i].size() - 1 + t));
        REQUIRE(with.logits[i][t].size() == static_cast<std::size_t>(w.config.vocab_size));
        if (temps[i] == 0.0f) CHECK(with.tokens[i][t] == ex::Sampler::argmax(with.logits[i][t]));
      }
    }
    // Each sequence of the batch samples what it samples alone (a step's logit rows are not mixed up).
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const RunOut alone = run_synthetic(w, {prompts[i]}, {5 + i}, kSteps, temps[i], 0.9f);
      CHECK(alone.tokens[0] == without.tokens[i]);
    }
    // Step timing: host forward + wait-and-sample within the step; the CPU backend has no device clock.
    const ex::GenerationStats& st = without.st;
    CHECK(st.decode_steps == kSteps - 1);
    CHECK(st.decode_forward_seconds > 0.0);
    CHECK(st.decode_sample_seconds >= 0.0);
    CHECK(st.decode_forward_seconds + st.decode_sample_seconds <= st.decode_seconds * (1 + 1e-9) + 1e-12);
    CHECK(st.decode_device_seconds == -1.0);
    CHECK(st.decode_device_argmax_steps == 0);
  }
}

TEST_CASE("synthetic model: prefill in one step equals token-by-token decode and observers see the right shapes") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 5);
  const ex::ModelConfig& mc = w.config;
  const std::vector<int> toks = {1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180};
  ex::Model<> m1(w), m2(w);
  PlainCache c1(cache_config(mc, 32, 1, 4)), c2(cache_config(mc, 32, 1, 4));
  const triattn::SeqId s1 = c1.add_sequence(), s2 = c2.add_sequence();

  int q_calls = 0, att_calls = 0;
  double worst_sum = 0.0;
  m1.set_query_observer([&](int layer, const float* q, int n) {
    CHECK(layer == q_calls % mc.n_layers);
    CHECK(n == static_cast<int>(toks.size()));
    CHECK(q != nullptr);
    ++q_calls;
  });
  m1.set_attention_observer([&](int layer, int row, triattn::SeqId seq, int h, std::span<const float> p) {
    CHECK(seq == s1);
    CHECK(layer < mc.n_layers);
    CHECK(h < mc.n_heads);
    CHECK(p.size() == static_cast<std::size_t>(row + 1));  // causal: row r sees slots 0..r
    double sum = 0.0;
    for (float x : p) sum += x;
    worst_sum = std::max(worst_sum, std::fabs(sum - 1.0));
    ++att_calls;
  });
  const ex::Chunk all{s1, toks, triattn::Phase::kPrefill};
  const ex::StepOutput pre = m1.step(c1, std::span<const ex::Chunk>(&all, 1), ex::LogitsFor::kAllRows);
  CHECK(q_calls == mc.n_layers);
  CHECK(att_calls == mc.n_layers * mc.n_heads * static_cast<int>(toks.size()));
  CHECK(worst_sum < 1e-5);

  for (std::size_t t = 0; t < toks.size(); ++t) {
    const ex::Chunk one{s2, std::span<const int>(&toks[t], 1), t == 0 ? triattn::Phase::kPrefill : triattn::Phase::kDecode};
    const ex::StepOutput o = m2.step(c2, std::span<const ex::Chunk>(&one, 1));
    const auto a = pre.row(static_cast<int>(t));
    const auto b = o.row(0);
    CHECK(std::equal(a.begin(), a.end(), b.begin()));
  }
  CHECK(c1.physical_length(s1) == c2.physical_length(s2));
}

TEST_CASE("Model::step: argument errors and a full pool leave the cache unchanged") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 5);
  ex::Model<> m(w);
  triattn::CacheConfig cfg = cache_config(w.config, 8, 2, 4);
  cfg.num_blocks = 3;  // 12 tokens in all
  PlainCache cache(cfg);
  const triattn::SeqId a = cache.add_sequence();
  const std::vector<int> eight(8, 5), five(5, 5);
  const ex::Chunk c8{a, eight, triattn::Phase::kPrefill};
  REQUIRE_NOTHROW((void)m.step(cache, std::span<const ex::Chunk>(&c8, 1)));
  const ex::Chunk c5{a, five, triattn::Phase::kDecode};
  CHECK_THROWS_AS((void)m.step(cache, std::span<const ex::Chunk>(&c5, 1)), ex::OutOfKvBlocks);
  CHECK(cache.physical_length(a) == 8);
  CHECK(cache.logical_position(a) == 8);
  const std::vector<int> bad = {100000};
  const ex::Chunk cb{a, bad, triattn::Phase::kDecode};
  CHECK_THROWS_AS((void)m.step(cache, std::span<const ex::Chunk>(&cb, 1)), triattn::logic_error);
  const ex::Chunk twice[2] = {{a, std::span<const int>(five).first(1), triattn::Phase::kDecode},
                              {a, std::span<const int>(five).first(1), triattn::Phase::kDecode}};
  CHECK_THROWS_WITH_AS((void)m.step(cache, std::span<const ex::Chunk>(twice, 2)),
                       doctest::Contains("appears in two chunks of one step"), triattn::logic_error);
  const triattn::SeqId b = cache.add_sequence();
  const ex::Chunk apart[3] = {{a, std::span<const int>(five).first(1), triattn::Phase::kDecode},
                              {b, std::span<const int>(five).first(1), triattn::Phase::kPrefill},
                              {a, std::span<const int>(five).first(1), triattn::Phase::kDecode}};
  const std::string which = "sequence " + std::to_string(a) + " appears in two chunks";
  CHECK_THROWS_WITH_AS((void)m.step(cache, std::span<const ex::Chunk>(apart, 3)), doctest::Contains(which.c_str()),
                       triattn::logic_error);
  CHECK(cache.physical_length(a) == 8);
  CHECK(cache.physical_length(b) == 0);
  cache.release(b);
  // A cache of another geometry is refused.
  triattn::CacheConfig other = cfg;
  other.model.num_layers += 1;
  PlainCache wrong(other);
  const triattn::SeqId z = wrong.add_sequence();
  const ex::Chunk cz{z, five, triattn::Phase::kPrefill};
  CHECK_THROWS_AS((void)m.step(wrong, std::span<const ex::Chunk>(&cz, 1)), triattn::logic_error);
}

TEST_CASE("Model::step: a write past a shared partly filled block counts its copy-on-write block") {
  const ex::ModelWeights w = ex::make_synthetic_weights(ex::synthetic_config("tiny"), 5);
  ex::Model<> m(w);
  triattn::CacheConfig cfg = cache_config(w.config, 8, 3, 4);
  cfg.num_blocks = 3;
  PlainCache cache(cfg);
  const triattn::SeqId a = cache.add_sequence();
  const std::vector<int> six(6, 7), one(1, 9);
  const ex::Chunk ca{a, six, triattn::Phase::kPrefill};
  REQUIRE_NOTHROW((void)m.step(cache, std::span<const ex::Chunk>(&ca, 1)));
  // b shares a's 6 tokens: one full block and one holding 2 of its 4 slots.
  const std::vector<int> blocks(cache.block_table(a).begin(), cache.block_table(a).begin() + 2);
  const triattn::SeqId b = cache.add_sequence(blocks, 6);
  CHECK(cache.blocks_to_extend(b, 1) == 1);  // no new block past the last, but its copy
  CHECK(cache.blocks_to_extend(b, 3) == 2);
  CHECK(cache.blocks_to_extend(b, 0) == 0);
  // The pool's last block goes to c: b's first write cannot copy the shared block.
  const triattn::SeqId c = cache.add_sequence();
  const ex::Chunk cc{c, one, triattn::Phase::kPrefill};
  REQUIRE_NOTHROW((void)m.step(cache, std::span<const ex::Chunk>(&cc, 1)));
  REQUIRE(cache.allocator().num_free() == 0);
  const ex::Chunk cb{b, one, triattn::Phase::kPrefill};
  CHECK_FALSE(ex::Model<>::fits(cache, std::span<const ex::Chunk>(&cb, 1)));
  CHECK_THROWS_AS((void)m.step(cache, std::span<const ex::Chunk>(&cb, 1)), ex::OutOfKvBlocks);
  CHECK(cache.physical_length(b) == 6);
  CHECK(cache.block_table(b)[1] == cache.block_table(a)[1]);  // still shared, nothing copied
  // Once c is gone the copy fits and b continues in a block of its own.
  cache.release(c);
  REQUIRE_NOTHROW((void)m.step(cache, std::span<const ex::Chunk>(&cb, 1)));
  CHECK(cache.physical_length(b) == 7);
  CHECK(cache.block_table(b)[1] != cache.block_table(a)[1]);
}

TEST_CASE("stories260K with TriAttention compression: saw-tooth cache and RoPE at logical positions") {
  const Stories& s = Stories::get();
  const ex::ModelConfig& mc = s.weights.config;
  // Calibrate on the reference story (pre-RoPE queries of a full-cache prefill).
  triattn::Calibrator cal(mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, "stories260K");
  {
    ex::Model<> model(s.weights);
    model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
    PlainCache cache(cache_config(mc, 256, 1));
    std::vector<int> seq = {1};
    seq.insert(seq.end(), s.greedy.begin(), s.greedy.end());
    const triattn::SeqId id = cache.add_sequence();
    const ex::Chunk chunk{id, seq, triattn::Phase::kPrefill};
    (void)model.step(cache, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
  }
  const triattn::QueryStats stats = cal.finish();
  CHECK(cal.token_count(0) == 257);

  constexpr int kBudget = 64, kDivide = 16, kSteps = 300;
  triattn::SelectionParams sel;
  sel.budget = kBudget;
  sel.divide_length = kDivide;
  triattn::RopeConfig rope;
  rope.style = mc.rope_style;
  rope.theta = mc.rope_theta;
  TriCache cache(cache_config(mc, kBudget + kDivide + 8, 1), triattn::TriAttentionScorer(stats, rope, {}, mc.n_kv_heads),
                 triattn::TopKSelector(sel));
  ex::Model<> model(s.weights);
  std::vector<std::vector<int>> prompts = {{1}};
  std::vector<ex::Sampler> samplers(1);
  ex::GenerationOptions opt;
  opt.max_new_tokens = kSteps;
  opt.stop_at_bos = false;
  int max_len = 0;
  bool order_ok = true;
  ex::GenerationCallbacks cb;
  cb.after_step = [&](std::span<const triattn::SeqId> seqs) {
    max_len = std::max(max_len, cache.physical_length(seqs[0]));
    return cache.compress_if_needed(seqs);
  };
  model.set_attention_observer([&](int, int, triattn::SeqId seq, int, std::span<const float> p) {
    order_ok = order_ok && p.size() == static_cast<std::size_t>(cache.physical_length(seq));  // decode: all slots
  });
  const auto res = ex::generate(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers),
                                opt, cb);
  REQUIRE(res[0].generated.size() == kSteps);
  CHECK(order_ok);
  CHECK(max_len == kBudget + kDivide);
  CHECK(res[0].compression_rounds >= (kSteps - kBudget) / kDivide - 1);
  CHECK(cache.logical_position(res[0].seq) == kSteps);
  CHECK(cache.physical_length(res[0].seq) >= kBudget);
  CHECK(cache.physical_length(res[0].seq) < kBudget + kDivide);
  // The first round runs after position 79 (cache length 80): tokens sampled at 0..79 are unchanged.
  const int same = kBudget + kDivide;
  CHECK(std::equal(s.greedy.begin(), s.greedy.begin() + same, res[0].generated.begin()));
  int agree = 0;
  for (int i = 0; i < 256; ++i) agree += res[0].generated[static_cast<std::size_t>(i)] == s.greedy[static_cast<std::size_t>(i)];
  MESSAGE("compressed run (budget " << kBudget << ", divide " << kDivide << "): " << res[0].compression_rounds
                                    << " rounds, " << res[0].tokens_evicted << " tokens evicted, " << agree
                                    << "/256 tokens equal to the full-cache run; text: "
                                    << stories_tokenizer().decode(std::span<const int>(res[0].generated).first(120)));
  const triattn::MemoryStats m = cache.memory();
  CHECK(m.cached_tokens == cache.physical_length(res[0].seq));
  CHECK(m.logical_tokens == kSteps);

  // Quality: at the same budget and selector, RANDOM scores must stay further from the full-cache
  // text (tokens equal to it, of 256) than TriAttention's, for each of 5 seeds (measured: 118 vs
  // 81..90). Recency is not the bar: on this 260K-parameter story model it keeps 152.
  {
    using RandomCache = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor,
                                         triattn::RandomScorer, triattn::TopKSelector>;
    for (std::uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
      RandomCache rc(cache_config(mc, kBudget + kDivide + 8, 1), triattn::RandomScorer(seed), triattn::TopKSelector(sel));
      ex::GenerationCallbacks rcb;
      rcb.after_step = [&](std::span<const triattn::SeqId> seqs) { return rc.compress_if_needed(seqs); };
      std::vector<ex::Sampler> rs(1);
      const auto r = ex::generate(model, rc, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(rs), opt, rcb);
      int random_agree = 0;
      for (int i = 0; i < 256; ++i)
        random_agree += r[0].generated[static_cast<std::size_t>(i)] == s.greedy[static_cast<std::size_t>(i)];
      INFO("random scores, seed " << seed << ": " << random_agree << "/256; TriAttention " << agree << "/256");
      CHECK(agree > random_agree);
    }
  }

  // RoPE at logical positions, checked on the keys themselves: layer 0's pre-RoPE key depends on
  // the token alone, so an uncompressed prefill of the same tokens holds the expected key of every
  // position. Compaction keeps slots in position order, so walking the positions upward must find
  // each slot's key at some position; a key rotated at its physical slot (smaller than its
  // position once a round has run) matches none of them.
  {
    std::vector<int> fed = {1};  // what the compressed run fed: BOS, then all but the last token
    fed.insert(fed.end(), res[0].generated.begin(), res[0].generated.end() - 1);
    REQUIRE(fed.size() == static_cast<std::size_t>(kSteps));
    PlainCache full(cache_config(mc, kSteps, 1));
    ex::Model<> full_model(s.weights);
    const triattn::SeqId fid = full.add_sequence();
    const ex::Chunk chunk{fid, fed, triattn::Phase::kPrefill};
    (void)full_model.step(full, std::span<const ex::Chunk>(&chunk, 1), ex::LogitsFor::kNone);
    const auto fv = full.view<float>();
    const auto cv = cache.view<float>();
    // Per KV head: in per_head mode each head keeps its own tokens.
    const auto key_diff = [&](int h, int slot, int pos) {
      float worst = 0.0f;
      for (int i = 0; i < mc.head_dim; ++i)
        worst = std::max(worst, std::fabs(cv.token(0, KvKind::kKey, res[0].seq, slot, h)[i] -
                                          fv.token(0, KvKind::kKey, fid, pos, h)[i]));
      return worst;
    };
    const int len = cache.physical_length(res[0].seq);
    int matched = 0;
    std::string unmatched;  // the first slot whose key is no position's key
    for (int h = 0; h < mc.n_kv_heads; ++h) {
      int pos = 0;
      for (int slot = 0; slot < len; ++slot) {
        int p = pos;
        while (p < kSteps && key_diff(h, slot, p) > 1e-5f) ++p;
        if (p == kSteps) {
          if (unmatched.empty()) unmatched = "kv head " + std::to_string(h) + ", slot " + std::to_string(slot);
          continue;
        }
        ++matched;
        pos = p + 1;
      }
    }
    INFO("first slot whose key is no position's key: " << unmatched);
    CHECK(matched == len * mc.n_kv_heads);
  }
}

}  // TEST_SUITE

// SPDX-License-Identifier: Apache-2.0
// triattn_fidelity: how much of the full-KV model's behaviour each KV-compression scorer keeps,
// on the reference transformer (SmolLM2-135M, stories260K and a synthetic model), at several
// budgets.
//
//   triattn_fidelity                                  # stories260K and synthetic
//   triattn_fidelity --models stories --prompts 2 --gen 128 --md out.md --csv out.csv
//   triattn_fidelity --models smollm2 --doc-tokens 2048 --doc-csv doc.csv   # real text (document.hpp)
//   triattn_fidelity --models smollm2 --kv-dtypes bf16,fp8 --doc-policies triattention  # fp8 KV stacked
//
// Per model: TriAttention statistics are calibrated first, on calibration prompts that are not
// evaluation prompts. Then per evaluation prompt: one full-KV greedy run (the reference: its
// tokens, logits and decode attention), and per (scorer, budget) a teacher-forced compressed run
// on the reference tokens (attention recall, KL, teacher-forced top-1) and a free-running greedy
// compressed run (agreement, first divergence). Metric definitions: docs/fidelity.md and
// harness.hpp / metrics.hpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <triattn/core/policy/key_norm_scorer.hpp>
#include <triattn/core/policy/random_scorer.hpp>
#include <triattn/core/policy/recency_scorer.hpp>
#include <triattn/core/policy/snapkv_scorer.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/stats/calibrator.hpp>

#include <reference_transformer/bpe_tokenizer.hpp>
#include <reference_transformer/gguf.hpp>
#include <reference_transformer/gguf_llama.hpp>
#include <reference_transformer/llama2c.hpp>
#include <reference_transformer/synthetic.hpp>

#include "document.hpp"
#include "harness.hpp"

#ifndef TRIATTN_SHARED_DATA_DIR
#define TRIATTN_SHARED_DATA_DIR "../shared/data"
#endif

namespace ex = triattn_example;
namespace fid = triattn_fidelity;
using clk = std::chrono::steady_clock;

namespace {

double since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

// Evaluation and calibration texts (TinyStories-like openings; the two sets share no prompt).
const std::vector<std::string> kEvalTexts = {
    "Once upon a time, there was a little girl named Lily.",
    "One day, a big dog went to the park.",
    "Tom had a red ball. He liked to",
    "The sun was shining and the birds were singing.",
    "Once upon a time, there was a small cat who lived in a house.",
    "Sam and his mom went to the store to buy",
    "There was a tiny bird in a tree.",
    "Anna found a shiny box under her bed.",
};
const std::vector<std::string> kCalibTexts = {
    "Once upon a time, in a big forest, there lived a bear.",
    "Ben wanted to play with his friends.",
    "The little boy saw a big truck.",
    "It was a rainy day and Mia was sad.",
    "A princess lived in a tall castle.",
    "The fish swam in the blue sea.",
    "Max the puppy loved to run.",
    "Lucy and Tim were building a sand castle.",
};

constexpr int kSnapWindow = 32;    // SnapKV observation window w
constexpr int kSnapPool = 7;       // SnapKV max-pool kernel
constexpr int kStreamingSinks = 4; // StreamingLLM's attention sinks

struct Options {
  std::vector<std::string> models = {"stories", "synthetic"};
  // stories260K
  int prompts = 8;
  int gen = 384;
  std::vector<int> budgets;  // empty: gen/8, gen/4, gen/2
  int calib_prompts = 8;
  int calib_gen = 384;
  // synthetic
  std::string synthetic_shape = "small";
  int synthetic_prompts = 4;
  int synthetic_gen = 256;
  std::vector<int> synthetic_budgets;
  std::uint64_t synthetic_seed = 42;
  // SmolLM2-135M (long documents of real text)
  int doc_tokens = 4096;
  int docs = 1;
  std::vector<int> doc_budgets = {128, 256, 512, 1024, 2048};
  std::vector<std::string> doc_policies = {"triattention", "triattention_plh", "triattention_union", "recency+sinks",
                                           "snapkv", "key_norm", "random"};
  int doc_divide = 128;
  int doc_calib_tokens = 4096;
  int retrieval_tokens = 2048;
  std::vector<int> retrieval_budgets = {256, 1024};
  std::vector<std::string> retrieval_policies = {"triattention", "recency+sinks", "snapkv", "key_norm", "random"};
  int threads = 2;
  std::string doc_csv_path;
  // KV formats of the SmolLM2 runs: the first is the full-KV reference's (and the calibration's);
  // every scorer runs in each, and each later one also runs without eviction.
  std::vector<std::string> kv_dtypes = {"f32"};
  std::string fp8_scales = "calib";  // calib: per-layer calibration max * headroom / 448; unit: every scale 1
  int fp8_headroom = 2;
  // shared
  int divide_length = 32;
  std::uint64_t random_seed = 1234;
  std::string md_path;
  std::string csv_path;
};

void usage() {
  std::printf(
      "usage: triattn_fidelity [options]\n"
      "  --models LIST            comma list of stories,synthetic,smollm2 (default stories,synthetic)\n"
      "  --prompts N              stories260K evaluation prompts (default 8, at most %zu)\n"
      "  --gen N                  stories260K generated tokens per prompt (default 384)\n"
      "  --budgets LIST           stories260K budgets (default gen/8,gen/4,gen/2)\n"
      "  --calib-prompts N        calibration prompts (default 8, at most %zu)\n"
      "  --calib-gen N            tokens sampled per calibration prompt (default 384)\n"
      "  --synthetic-shape S      synthetic shape: tiny | small (default small)\n"
      "  --synthetic-prompts N    synthetic evaluation prompts (default 4)\n"
      "  --synthetic-gen N        synthetic generated tokens per prompt (default 256)\n"
      "  --synthetic-budgets LIST synthetic budgets (default gen/8,gen/4,gen/2)\n"
      "  --divide-length N        compression slack (default 32)\n"
      "SmolLM2-135M (--models smollm2; documents of real text, teacher-forced):\n"
      "  --doc-tokens N           tokens per evaluation document (default 4096)\n"
      "  --docs N                 evaluation documents from Pride and Prejudice (default 1)\n"
      "  --doc-budgets LIST       budgets, multiples of --doc-divide (default 128,256,512,1024,2048)\n"
      "  --doc-policies LIST      scorers (default triattention,triattention_plh,triattention_union,\n"
      "                           recency+sinks,snapkv,key_norm,random)\n"
      "  --doc-divide N           divide_length = chunk size (default 128)\n"
      "  --doc-calib-tokens N     Shakespeare tokens for calibration (default 4096)\n"
      "  --retrieval-tokens N     document length of the retrieval task (default 2048; 0 = skip)\n"
      "  --retrieval-budgets LIST budgets of the retrieval task (default 256,1024)\n"
      "  --retrieval-policies LIST scorers of the retrieval task (default triattention,recency+sinks,\n"
      "                           snapkv,key_norm,random)\n"
      "  --threads N              threads over the compressed runs (default 2)\n"
      "  --doc-csv PATH           the SmolLM2 numbers as CSV (scripts/fidelity_plot.py --smollm2 reads it)\n"
      "  --kv-dtypes LIST         KV dtypes of the SmolLM2 runs, of f32,f16,bf16,fp8 (default f32); the first\n"
      "                           is the full-KV reference's (not fp8); every scorer and budget runs in each,\n"
      "                           each later dtype also without eviction ('no eviction' rows)\n"
      "  --fp8-scales MODE        fp8 K/V scales per layer: calib (calibration max |K|, |V| * headroom / 448;\n"
      "                           default) or unit (all 1)\n"
      "  --fp8-headroom N         calib: room for values N times the calibration max (default 2)\n"
      "  --random-seed N          seed of the random scorer (default 1234)\n"
      "  --md PATH                write the markdown tables there\n"
      "  --csv PATH               write the numbers as CSV there (scripts/fidelity_plot.py reads it)\n",
      kEvalTexts.size(), kCalibTexts.size());
}

int to_int(const std::string& flag, const std::string& v) {
  std::size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || x < 0 || x > 1000000) throw std::runtime_error("option " + flag + ": bad value '" + v + "'");
  return static_cast<int>(x);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

/// The KV dtype of a --kv-dtypes entry.
triattn::DType parse_kv_dtype(const std::string& v) {
  if (v == "f32") return triattn::DType::kF32;
  if (v == "f16") return triattn::DType::kF16;
  if (v == "bf16") return triattn::DType::kBF16;
  if (v == "fp8") return triattn::DType::kFP8E4M3;
  throw std::runtime_error("--kv-dtypes: '" + v + "' is not f32, f16, bf16 or fp8");
}

Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::runtime_error(std::string("option ") + argv[i] + " needs a value");
    return argv[++i];
  };
  auto int_list = [&](const std::string& flag, const std::string& v) {
    std::vector<int> out;
    for (const std::string& x : split(v)) out.push_back(to_int(flag, x));
    return out;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else if (a == "--models") o.models = split(need(i));
    else if (a == "--prompts") o.prompts = to_int(a, need(i));
    else if (a == "--gen") o.gen = to_int(a, need(i));
    else if (a == "--budgets") o.budgets = int_list(a, need(i));
    else if (a == "--calib-prompts") o.calib_prompts = to_int(a, need(i));
    else if (a == "--calib-gen") o.calib_gen = to_int(a, need(i));
    else if (a == "--synthetic-shape") o.synthetic_shape = need(i);
    else if (a == "--synthetic-prompts") o.synthetic_prompts = to_int(a, need(i));
    else if (a == "--synthetic-gen") o.synthetic_gen = to_int(a, need(i));
    else if (a == "--synthetic-budgets") o.synthetic_budgets = int_list(a, need(i));
    else if (a == "--divide-length") o.divide_length = to_int(a, need(i));
    else if (a == "--doc-tokens") o.doc_tokens = to_int(a, need(i));
    else if (a == "--docs") o.docs = to_int(a, need(i));
    else if (a == "--doc-budgets") o.doc_budgets = int_list(a, need(i));
    else if (a == "--doc-policies") o.doc_policies = split(need(i));
    else if (a == "--doc-divide") o.doc_divide = to_int(a, need(i));
    else if (a == "--doc-calib-tokens") o.doc_calib_tokens = to_int(a, need(i));
    else if (a == "--retrieval-tokens") o.retrieval_tokens = to_int(a, need(i));
    else if (a == "--retrieval-budgets") o.retrieval_budgets = int_list(a, need(i));
    else if (a == "--retrieval-policies") o.retrieval_policies = split(need(i));
    else if (a == "--threads") o.threads = to_int(a, need(i));
    else if (a == "--doc-csv") o.doc_csv_path = need(i);
    else if (a == "--kv-dtypes") o.kv_dtypes = split(need(i));
    else if (a == "--fp8-scales") o.fp8_scales = need(i);
    else if (a == "--fp8-headroom") o.fp8_headroom = to_int(a, need(i));
    else if (a == "--random-seed") o.random_seed = static_cast<std::uint64_t>(to_int(a, need(i)));
    else if (a == "--md") o.md_path = need(i);
    else if (a == "--csv") o.csv_path = need(i);
    else throw std::runtime_error("unknown option '" + a + "' (--help lists them)");
  }
  for (const std::string& m : o.models)
    if (m != "stories" && m != "synthetic" && m != "smollm2")
      throw std::runtime_error("--models: unknown model '" + m + "'");
  const std::vector<std::string> known = {"triattention", "triattention_plh", "triattention_union", "recency+sinks",
                                          "snapkv", "key_norm", "random"};
  for (const auto* list : {&o.doc_policies, &o.retrieval_policies})
    for (const std::string& p : *list)
      if (std::find(known.begin(), known.end(), p) == known.end())
        throw std::runtime_error("unknown scorer '" + p + "' (--doc-policies / --retrieval-policies)");
  if (o.kv_dtypes.empty()) throw std::runtime_error("--kv-dtypes: empty list");
  for (std::size_t i = 0; i < o.kv_dtypes.size(); ++i) {
    (void)parse_kv_dtype(o.kv_dtypes[i]);
    if (std::find(o.kv_dtypes.begin(), o.kv_dtypes.begin() + static_cast<std::ptrdiff_t>(i), o.kv_dtypes[i]) !=
        o.kv_dtypes.begin() + static_cast<std::ptrdiff_t>(i))
      throw std::runtime_error("--kv-dtypes: '" + o.kv_dtypes[i] + "' given twice");
  }
  if (parse_kv_dtype(o.kv_dtypes.front()) == triattn::DType::kFP8E4M3)
    throw std::runtime_error("--kv-dtypes: the first dtype is the reference's and calibration's; fp8 needs scales "
                             "from that calibration, so put it later (e.g. bf16,fp8)");
  if (o.fp8_scales != "calib" && o.fp8_scales != "unit")
    throw std::runtime_error("--fp8-scales: '" + o.fp8_scales + "' is not calib or unit");
  if (o.fp8_headroom < 1) throw std::runtime_error("--fp8-headroom must be >= 1");
  if (o.doc_divide < 1 || o.docs < 1 || o.doc_tokens < 2 || o.threads < 1 || o.doc_calib_tokens < 1)
    throw std::runtime_error("--doc-divide, --docs, --threads, --doc-calib-tokens must be >= 1, --doc-tokens >= 2");
  for (const auto* list : {&o.doc_budgets, &o.retrieval_budgets})
    for (int b : *list)
      if (b < o.doc_divide || b % o.doc_divide != 0)
        throw std::runtime_error("budget " + std::to_string(b) + " is not a positive multiple of --doc-divide " +
                                 std::to_string(o.doc_divide) + " (rounds must fall on chunk boundaries)");
  if (o.prompts < 1 || o.prompts > static_cast<int>(kEvalTexts.size()))
    throw std::runtime_error("--prompts must be in [1, " + std::to_string(kEvalTexts.size()) + "]");
  if (o.calib_prompts < 1 || o.calib_prompts > static_cast<int>(kCalibTexts.size()))
    throw std::runtime_error("--calib-prompts must be in [1, " + std::to_string(kCalibTexts.size()) + "]");
  if (o.gen < 2 || o.synthetic_gen < 2 || o.calib_gen < 1 || o.synthetic_prompts < 1 || o.divide_length < 1)
    throw std::runtime_error("--gen, --synthetic-gen must be >= 2; counts and --divide-length >= 1");
  return o;
}

/// One model's experiment.
struct Experiment {
  std::string label;
  std::string description;
  ex::ModelWeights weights;
  std::vector<std::vector<int>> eval_prompts;
  std::vector<std::vector<int>> calib_prompts;
  int gen = 0;
  int calib_gen = 0;
  std::vector<int> budgets;
};

/// Aggregates of one (scorer, budget) cell over all prompts.
struct Cell {
  std::vector<double> recall;        // per counted teacher-forced pass, all prompts
  std::vector<double> kl;            // idem
  std::vector<double> recall_prompt; // per prompt: mean recall over its counted passes
  std::vector<double> kl_prompt;     // per prompt: mean KL
  int tf_matches = 0, tf_counted = 0;
  int agree_matches = 0, agree_counted = 0;
  std::vector<double> first_div;     // per prompt (generated-token index; G when none)
  int censored = 0;                  // prompts without divergence
  std::vector<double> first_round;   // per prompt: pass index of the first round
  std::vector<double> overlap;       // per round of the teacher-forced runs: recency_overlap
  double rounds = 0;                 // total rounds (free runs)
  double seconds = 0;
};

struct Policy {
  std::string name;
  std::string settings;  // what differs from the shared SelectionParams
};

std::vector<Policy> policies(int divide_length) {
  std::vector<Policy> p = {
      {"triattention", "own calibration, default ScoringParams"},
      {"recency+sinks", "n_sink = 4 (StreamingLLM)"},
      {"key_norm", "-"},
      {"random", "seeded"},
      {"snapkv", "w = 32, pool 7, newest min(32, B - prompt) tokens protected"},
  };
  // Without the protected window SnapKV's causal limits need rounds >= w decode steps apart.
  if (divide_length >= kSnapWindow) p.push_back({"snapkv_nowin", "w = 32, pool 7, window not protected"});
  return p;
}

/// Builds the cache of `policy` (on the heap, so that fn may keep it) and hands it to fn as a
/// std::unique_ptr. `prompt_len` caps SnapKV's protected window; triattention_plh / _union are
/// TriAttention in the per_layer_per_head / union selection modes.
template <class Fn>
void make_cache(const std::string& policy, const triattn::CacheConfig& cfg, triattn::SelectionParams sel, int prompt_len,
                const triattn::QueryStats& stats, const ex::ModelConfig& mc, std::uint64_t random_seed, Fn&& fn) {
  using namespace triattn;
  if (policy.rfind("triattention", 0) == 0) {
    if (policy == "triattention_plh") sel.mode = PruningMode::kPerLayerPerHead;
    else if (policy == "triattention_union") sel.mode = PruningMode::kUnion;
    else if (policy != "triattention") throw std::runtime_error("unknown policy " + policy);
    RopeConfig rope;
    rope.style = mc.rope_style;
    rope.theta = mc.rope_theta;
    fn(std::make_unique<fid::HostCache<TriAttentionScorer>>(
        cfg, TopKSelector(sel), TriAttentionScorer(stats, rope, ScoringParams{}, mc.n_kv_heads)));
  } else if (policy == "recency+sinks") {
    sel.n_sink = kStreamingSinks;
    fn(std::make_unique<fid::HostCache<RecencyScorer>>(cfg, TopKSelector(sel)));
  } else if (policy == "key_norm") {
    fn(std::make_unique<fid::HostCache<KeyNormScorer>>(cfg, TopKSelector(sel)));
  } else if (policy == "random") {
    fn(std::make_unique<fid::HostCache<RandomScorer>>(cfg, TopKSelector(sel), RandomScorer(random_seed)));
  } else if (policy == "snapkv" || policy == "snapkv_nowin") {
    // The protected window is capped so that pinned prompt + window fit in the budget: every
    // scorer then runs at the same cache size (uncapped, a long prompt would push SnapKV's
    // cache above the budget). Rounds are divide_length >= w apart, so the causal limits of
    // SnapKvScorer hold with any window.
    if (policy == "snapkv") sel.window = std::min(kSnapWindow, std::max(0, sel.budget - prompt_len));
    fn(std::make_unique<fid::HostCache<SnapKvScorer>>(cfg, TopKSelector(sel),
                                                       SnapKvScorer(cfg, SnapKvParams{kSnapWindow, kSnapPool})));
  } else {
    throw std::runtime_error("unknown policy " + policy);
  }
}

std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "n/a";  // e.g. a standard error over a single prompt
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

struct Report {
  std::ostringstream md;
  std::ostringstream csv;
  std::ostringstream doc_csv;  ///< SmolLM2 documents and retrieval
};

void run_experiment(const Experiment& e, const Options& o, Report& rep) {
  const auto t_model = clk::now();
  ex::Model<ex::CpuBackend> model(e.weights);
  const ex::ModelConfig& mc = model.config();
  std::fprintf(stderr, "\n=== %s: %d layers, dim %d, %d q / %d kv heads, head_dim %d, vocab %d, theta %g ===\n",
               e.label.c_str(), mc.n_layers, mc.dim, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.vocab_size, mc.rope_theta);

  // 1. Calibration on the calibration prompts only.
  auto t0 = clk::now();
  triattn::Calibrator cal(mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);
  const std::int64_t calib_tokens =
      fid::calibrate(model, cal, std::span<const std::vector<int>>(e.calib_prompts), e.calib_gen, 1.0f, 0.9f, 7);
  const triattn::QueryStats stats = cal.finish();
  const double calib_s = since(t0);
  std::fprintf(stderr, "[%s] calibration: %zu prompts, %lld tokens per layer, %.1f s\n", e.label.c_str(),
               e.calib_prompts.size(), static_cast<long long>(calib_tokens), calib_s);

  const std::vector<Policy> pols = policies(o.divide_length);
  std::vector<std::vector<Cell>> cells(pols.size(), std::vector<Cell>(e.budgets.size()));
  int max_prompt = 0;
  for (const auto& p : e.eval_prompts) max_prompt = std::max(max_prompt, static_cast<int>(p.size()));
  const triattn::CacheConfig cfg = fid::cache_config(mc, 1, max_prompt + e.gen);

  // 2. Per prompt: the reference, then every (scorer, budget) twice.
  for (std::size_t k = 0; k < e.eval_prompts.size(); ++k) {
    const auto t_prompt = clk::now();
    t0 = clk::now();
    const fid::FullRun full = fid::run_full(model, e.eval_prompts[k], e.gen);
    std::fprintf(stderr, "[%s] prompt %zu/%zu (%zu tokens): full-KV run %.2f s\n", e.label.c_str(), k + 1,
                 e.eval_prompts.size(), e.eval_prompts[k].size(), since(t0));
    for (std::size_t pi = 0; pi < pols.size(); ++pi) {
      t0 = clk::now();
      for (std::size_t bi = 0; bi < e.budgets.size(); ++bi) {
        triattn::SelectionParams sel;  // shared: per_head, z-normalised, prompt pinned in the budget
        sel.budget = e.budgets[bi];
        sel.divide_length = o.divide_length;
        Cell& c = cells[pi][bi];
        const auto t_cell = clk::now();
        fid::PolicyRun tf, fr;
        const int P = static_cast<int>(full.prompt.size());
        make_cache(pols[pi].name, cfg, sel, P, stats, mc, o.random_seed,
                   [&](auto cache) { tf = fid::run_policy(model, *cache, full, true); });
        make_cache(pols[pi].name, cfg, sel, P, stats, mc, o.random_seed,
                   [&](auto cache) { fr = fid::run_policy(model, *cache, full, false); });
        TRIATTN_EXPECTS(tf.first_round_pass == fr.first_round_pass, "round timing differs between runs");
        TRIATTN_EXPECTS(P >= sel.budget || (tf.max_kept <= sel.budget && fr.max_kept <= sel.budget),
                        pols[pi].name + " kept more than the budget " + std::to_string(sel.budget));
        c.recall.insert(c.recall.end(), tf.recall.begin(), tf.recall.end());
        c.kl.insert(c.kl.end(), tf.kl.begin(), tf.kl.end());
        c.recall_prompt.push_back(fid::mean(tf.recall));
        c.kl_prompt.push_back(fid::mean(tf.kl));
        c.tf_matches += tf.tf_top1_matches;
        c.overlap.insert(c.overlap.end(), tf.recency_overlap.begin(), tf.recency_overlap.end());
        c.tf_counted += static_cast<int>(tf.kl.size());
        const int from = fr.first_round_pass < 0 ? e.gen : fr.first_round_pass + 1;
        const fid::Agreement a = fid::greedy_agreement(full.generated, fr.generated, from);
        c.agree_matches += a.matches;
        c.agree_counted += a.counted;
        c.first_div.push_back(a.first_divergence);
        if (!a.diverged(e.gen)) ++c.censored;
        c.first_round.push_back(fr.first_round_pass);
        c.rounds += fr.rounds;
        c.seconds += since(t_cell);
      }
      std::string line;
      for (std::size_t bi = 0; bi < e.budgets.size(); ++bi) {
        const Cell& c = cells[pi][bi];
        line += "  B=" + std::to_string(e.budgets[bi]) + ": recall " + fmt("%.3f", fid::mean(c.recall)) + ", 1st div " +
                fmt("%.0f", c.first_div.back());
      }
      std::fprintf(stderr, "[%s]   %-14s %5.2f s |%s  (recall: mean so far; 1st div: this prompt)\n", e.label.c_str(), pols[pi].name.c_str(),
                   since(t0), line.c_str());
    }
    std::fprintf(stderr, "[%s] prompt %zu done in %.1f s (elapsed %.1f s)\n", e.label.c_str(), k + 1, since(t_prompt),
                 since(t_model));
  }
  const double total_s = since(t_model);

  // 3. Report.
  std::ostringstream& md = rep.md;
  md << "### " << e.label << "\n\n" << e.description << "\n\n";
  md << "Prompts: " << e.eval_prompts.size() << " evaluation (" << e.gen << " generated tokens each), calibration "
     << e.calib_prompts.size() << " other prompts (" << calib_tokens
     << " tokens per layer, sampled at temperature 1.0, top-p 0.9). divide_length " << o.divide_length
     << ". Runtime " << fmt("%.1f", total_s) << " s (calibration " << fmt("%.1f", calib_s) << " s).\n\n";
  md << "First compression round after generated token (mean over prompts): ";
  for (std::size_t bi = 0; bi < e.budgets.size(); ++bi)
    md << (bi ? ", " : "") << "B=" << e.budgets[bi] << ": " << fmt("%.1f", fid::mean(cells[0][bi].first_round));
  md << ".\n\n";
  md << "| scorer | budget | attention recall | greedy agreement | first divergence mean / median (no div.) | KL full‖comp (nats) | TF top-1 | recency overlap | TriAttention recall higher (prompts) |\n";
  md << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (std::size_t bi = 0; bi < e.budgets.size(); ++bi)
    for (std::size_t pi = 0; pi < pols.size(); ++pi) {
      const Cell& c = cells[pi][bi];
      const double agree = c.agree_counted > 0 ? static_cast<double>(c.agree_matches) / c.agree_counted : 1.0;
      const double top1 = c.tf_counted > 0 ? static_cast<double>(c.tf_matches) / c.tf_counted : 1.0;
      std::string paired = "-";  // prompts on which TriAttention's recall beats this row's
      if (pi != 0) {
        const Cell& tri = cells[0][bi];
        int wins = 0;
        for (std::size_t k = 0; k < c.recall_prompt.size(); ++k) wins += tri.recall_prompt[k] > c.recall_prompt[k] ? 1 : 0;
        paired = std::to_string(wins) + "/" + std::to_string(c.recall_prompt.size());
      }
      md << "| " << pols[pi].name << " | " << e.budgets[bi] << " | " << fmt("%.3f", fid::mean(c.recall)) << " ± "
         << fmt("%.3f", fid::standard_error(c.recall_prompt)) << " | " << fmt("%.3f", agree) << " | "
         << fmt("%.1f", fid::mean(c.first_div)) << " / " << fmt("%.1f", fid::median(c.first_div)) << " ("
         << c.censored << ") | " << fmt("%.4f", fid::mean(c.kl)) << " ± " << fmt("%.4f", fid::standard_error(c.kl_prompt))
         << " | " << fmt("%.3f", top1) << " | " << fmt("%.3f", fid::mean(c.overlap)) << " | " << paired << " |\n";
      rep.csv << e.label << "," << pols[pi].name << "," << e.budgets[bi] << "," << fmt("%.6f", fid::mean(c.recall))
              << "," << fmt("%.6f", agree) << "," << fmt("%.3f", fid::mean(c.first_div)) << ","
              << fmt("%.3f", fid::median(c.first_div)) << "," << c.censored << "," << fmt("%.6f", fid::mean(c.kl))
              << "," << fmt("%.6f", top1) << "," << e.eval_prompts.size() << "," << e.gen << ","
              << fmt("%.3f", fid::mean(c.first_round)) << "," << fmt("%.6f", fid::mean(c.overlap)) << ","
              << fmt("%.6f", fid::standard_error(c.recall_prompt)) << "," << fmt("%.6f", fid::standard_error(c.kl_prompt))
              << "," << fmt("%.2f", c.seconds) << "\n";
    }
  md << "\nScorer settings beyond the shared SelectionParams: ";
  for (std::size_t pi = 0; pi < pols.size(); ++pi)
    md << (pi ? "; " : "") << pols[pi].name << ": " << pols[pi].settings;
  md << ".\n\n";
  std::fprintf(stderr, "[%s] done in %.1f s\n", e.label.c_str(), total_s);
}

std::vector<int> default_budgets(int gen) { return {gen / 8, gen / 4, gen / 2}; }

/// BOS then 7 pseudo-random token ids (seeded): prompts for a model without a tokenizer.
std::vector<int> random_prompt(int vocab, std::uint64_t seed) {
  std::vector<int> p{1};
  for (std::uint64_t i = 0; i < 7; ++i)
    p.push_back(3 + static_cast<int>(ex::mix64(seed * 1000 + i) % static_cast<std::uint64_t>(vocab - 3)));
  return p;
}

// ---- SmolLM2-135M: long documents of real text (document.hpp) ----

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// `n` tokens of `text` from the first paragraph start at or after `frac` of it.
std::vector<int> excerpt_tokens(const ex::BpeTokenizer& tok, const std::string& text, double frac, int n) {
  std::size_t start = text.find("\n\n", static_cast<std::size_t>(frac * static_cast<double>(text.size())));
  start = start == std::string::npos ? 0 : start + 2;
  for (std::size_t chars = static_cast<std::size_t>(n) * 6;; chars *= 2) {
    std::vector<int> ids = tok.encode(std::string_view(text).substr(start, chars), false);
    if (static_cast<int>(ids.size()) >= n) {
      ids.resize(static_cast<std::size_t>(n));
      return ids;
    }
    if (start + chars >= text.size())
      throw std::runtime_error("text too short for " + std::to_string(n) + " tokens from " + fmt("%.2f", frac));
  }
}

using SmolModel = ex::Model<ex::CpuBackend>;

/// A compressing cache for `name` at `budget` in KV format `kv` (document setting: no prompt,
/// chunks of `divide`); count_from as DocumentPolicyImpl's.
std::unique_ptr<fid::DocumentPolicy> make_doc_policy(const std::string& name, int budget, int divide,
                                                     const triattn::QueryStats& stats, SmolModel& model,
                                                     std::uint64_t random_seed, const fid::KvFormat& kv = {},
                                                     std::int64_t count_from = -1) {
  triattn::SelectionParams sel;
  sel.budget = budget;
  sel.divide_length = divide;
  std::unique_ptr<fid::DocumentPolicy> out;
  make_cache(name, fid::cache_config(model.config(), 1, budget + divide, 16, kv), sel, 0, stats, model.config(),
             random_seed, [&](auto cache) {
               using C = typename decltype(cache)::element_type;
               out = std::make_unique<fid::DocumentPolicyImpl<SmolModel, C>>(model, name, budget, std::move(cache),
                                                                             count_from);
             });
  return out;
}

/// A cache in KV format `kv` that never evicts (room for `tokens`), compared on every position.
std::unique_ptr<fid::DocumentPolicy> make_plain_doc_policy(SmolModel& model, int tokens, const fid::KvFormat& kv) {
  return std::make_unique<fid::DocumentPolicyImpl<SmolModel, fid::PlainCache>>(
      model, "no eviction", 0, std::make_unique<fid::PlainCache>(fid::cache_config(model.config(), 1, tokens, 16, kv)), 0);
}

/// Short name of a KV dtype for the tables (the --kv-dtypes spelling).
std::string kv_label(triattn::DType t) {
  switch (t) {
    case triattn::DType::kF32: return "f32";
    case triattn::DType::kF16: return "f16";
    case triattn::DType::kBF16: return "bf16";
    case triattn::DType::kFP8E4M3: return "fp8";
  }
  return "?";
}

/// Standard error of the mean of `v` over consecutive blocks of `block` values (neighbouring
/// positions are correlated; block means are closer to independent).
double blocked_se(const std::vector<double>& v, std::size_t block) {
  std::vector<double> means;
  for (std::size_t i = 0; i + block <= v.size(); i += block)
    means.push_back(fid::mean(std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(i),
                                                  v.begin() + static_cast<std::ptrdiff_t>(i + block))));
  return fid::standard_error(means);
}

std::vector<double> finite(const std::vector<double>& v) {
  std::vector<double> out;
  for (double x : v)
    if (std::isfinite(x)) out.push_back(x);
  return out;
}

void run_smollm2(const Options& o, Report& rep) {
  const auto t_model = clk::now();
  const std::string data = TRIATTN_SHARED_DATA_DIR;
  const std::string path = data + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  const ex::gguf::File file = ex::gguf::File::load(path);
  const ex::ModelWeights weights = ex::gguf_llama_weights(file);
  const ex::BpeTokenizer tok = ex::BpeTokenizer::from_gguf(file);
  std::vector<std::unique_ptr<SmolModel>> models;
  for (int t = 0; t < o.threads; ++t) models.push_back(std::make_unique<SmolModel>(weights));
  SmolModel& model = *models.front();
  const ex::ModelConfig& mc = model.config();
  std::fprintf(stderr, "\n=== SmolLM2-135M-Instruct: %d layers, dim %d, %d q / %d kv heads, head_dim %d, theta %g ===\n",
               mc.n_layers, mc.dim, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.rope_theta);

  // KV formats: [0] is the reference's and the calibration's; fp8 scales come from calibration.
  std::vector<fid::KvFormat> kvs;
  for (const std::string& name : o.kv_dtypes) kvs.push_back(fid::KvFormat{parse_kv_dtype(name), {}});
  const fid::KvFormat& ref_kv = kvs.front();
  const bool multi_kv = kvs.size() > 1;

  // 1. Calibration: pre-RoPE queries of Shakespeare (never evaluated on), 2,048-token passages;
  // the same prefills give the largest |K| and |V| per layer, from which fp8 scales are chosen.
  auto t0 = clk::now();
  const std::string calib_text = read_text(data + "/text/shakespeare.txt");
  triattn::Calibrator cal(mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);
  std::vector<float> calib_amax(static_cast<std::size_t>(mc.n_layers) * 2, 0.0f);
  model.set_query_observer([&](int layer, const float* q, int n) { cal.add(layer, q, n); });
  for (int done = 0, k = 0; done < o.doc_calib_tokens; ++k) {
    const int n = std::min(2048, o.doc_calib_tokens - done);
    const std::vector<int> ids = excerpt_tokens(tok, calib_text, 0.1 + 0.2 * k, n);
    fid::PlainCache cache(fid::cache_config(mc, 1, n, 16, ref_kv));
    const triattn::SeqId seq = cache.add_sequence();
    ex::Chunk ch{seq, ids, triattn::Phase::kPrefill};
    (void)model.step(cache, std::span<const ex::Chunk>(&ch, 1), ex::LogitsFor::kNone);
    const std::vector<float> amax = fid::kv_abs_max(cache, seq);
    for (std::size_t i = 0; i < amax.size(); ++i) calib_amax[i] = std::max(calib_amax[i], amax[i]);
    cache.release(seq);
    done += n;
  }
  model.set_query_observer({});
  const triattn::QueryStats stats = cal.finish();
  const double calib_s = since(t0);
  std::fprintf(stderr, "[smollm2] calibration: %d Shakespeare tokens, %.1f s\n", o.doc_calib_tokens, calib_s);
  for (fid::KvFormat& kv : kvs)
    if (kv.dtype == triattn::DType::kFP8E4M3 && o.fp8_scales == "calib") kv.scales = fid::fp8_scales_from_amax(calib_amax, static_cast<float>(o.fp8_headroom));

  // 2. Documents: full KV and every (scorer, KV dtype, budget) in lock step, plus every later KV
  // dtype without eviction. All rows of a budget count the same positions: those after the
  // budget's first round (it fires once budget + divide tokens are cached, for every scorer),
  // or every position when the document ends before it.
  const std::string eval_text = read_text(data + "/text/pride_and_prejudice.txt");
  auto count_from = [&](int budget) -> std::int64_t {
    return budget + o.doc_divide < o.doc_tokens ? budget + o.doc_divide : 0;
  };
  struct Arm {
    std::string policy;  // "no eviction": a cache of kvs[kv] that keeps everything
    std::size_t kv = 0;
    int budget = 0;
  };
  std::vector<Arm> arms;
  for (std::size_t k = 1; k < kvs.size(); ++k) arms.push_back({"no eviction", k, 0});
  for (const std::string& name : o.doc_policies)
    for (std::size_t k = 0; k < kvs.size(); ++k)
      for (int b : o.doc_budgets) arms.push_back({name, k, b});
  struct Row {
    std::size_t arm;
    int budget;
  };
  std::vector<Row> rows;  // the table's order: per budget, no-eviction rows then scorer x dtype
  for (int b : o.doc_budgets)
    for (std::size_t a = 0; a < arms.size(); ++a)
      if (arms[a].budget == 0 || arms[a].budget == b) rows.push_back({a, b});
  struct DocCell {
    std::vector<double> kl, recall, nll, nll_full;
    std::size_t top1 = 0, counted = 0;
  };
  std::vector<DocCell> cells(rows.size());
  std::vector<float> eval_amax(static_cast<std::size_t>(mc.n_layers) * 2, 0.0f);
  double doc_s = 0;
  for (int d = 0; d < o.docs; ++d) {
    const std::vector<int> doc = excerpt_tokens(tok, eval_text, (d + 1.0) / (o.docs + 1.0), o.doc_tokens);
    std::vector<std::unique_ptr<fid::DocumentPolicy>> pols;
    for (const Arm& a : arms) {
      SmolModel& m = *models[pols.size() % models.size()];
      pols.push_back(a.budget == 0 ? make_plain_doc_policy(m, o.doc_tokens, kvs[a.kv])
                                   : make_doc_policy(a.policy, a.budget, o.doc_divide, stats, m, o.random_seed,
                                                     kvs[a.kv], count_from(a.budget)));
    }
    fid::FullDocument<SmolModel> full(model, o.doc_tokens, ref_kv);
    t0 = clk::now();
    auto t_report = clk::now();
    fid::run_document(full, std::span<const std::unique_ptr<fid::DocumentPolicy>>(pols), o.threads, doc, o.doc_divide, true,
                      [&](std::int64_t pos) {
                        if (since(t_report) < 30 && pos < o.doc_tokens) return;
                        t_report = clk::now();
                        std::fprintf(stderr, "[smollm2] document %d/%d: %lld / %d tokens, %.0f s\n", d + 1, o.docs,
                                     static_cast<long long>(pos), o.doc_tokens, since(t0));
                      });
    doc_s += since(t0);
    const std::vector<float> amax = full.kv_abs_max();
    for (std::size_t i = 0; i < amax.size(); ++i) eval_amax[i] = std::max(eval_amax[i], amax[i]);
    for (std::size_t i = 0; i < pols.size(); ++i) {
      const fid::DocumentStats& st = pols[i]->stats();
      TRIATTN_EXPECTS(st.max_kept <= pols[i]->budget(), pols[i]->name() + " kept more than its budget");
      TRIATTN_EXPECTS(st.rounds == 0 || st.first_round_pos + 1 == count_from(arms[i].budget),
                      pols[i]->name() + ": first round at position " + std::to_string(st.first_round_pos) +
                          ", not where budget + divide tokens are cached");
    }
    for (std::size_t r = 0; r < rows.size(); ++r) {
      const fid::DocumentStats& st = pols[rows[r].arm]->stats();
      DocCell& c = cells[r];
      const std::int64_t from = count_from(rows[r].budget);
      for (std::size_t j = 0; j < st.pos.size(); ++j) {
        if (st.pos[j] < from) continue;
        c.kl.push_back(st.kl[j]);
        c.recall.push_back(st.recall[j]);
        c.nll.push_back(st.nll[j]);
        c.nll_full.push_back(st.nll_full[j]);
        c.top1 += st.top1[j] != 0 ? 1 : 0;
        ++c.counted;
      }
    }
  }
  const double doc_tokens_total = static_cast<double>(o.docs) * o.doc_tokens;

  std::ostringstream& md = rep.md;
  md << "### SmolLM2-135M-Instruct: long documents\n\n"
     << "30 layers, 9 q / 3 KV heads, head_dim 64 (32 RoPE frequencies, half pairing, theta 1e5), Q4_1 weights "
        "dequantised to float32, CPU path. Calibration: "
     << o.doc_calib_tokens << " tokens of Shakespeare (" << fmt("%.1f", calib_s)
     << " s). Evaluation: " << o.docs << " excerpt(s) of Pride and Prejudice of " << o.doc_tokens
     << " tokens each, teacher-forced in chunks of " << o.doc_divide << " (= divide_length). Prompt setting: the whole "
     << "document competes for the budget (no pinned prompt); rounds whenever the cache reaches budget + "
     << o.doc_divide << ". Metrics over every position after the budget's first round (every position when the "
     << "document ends before it), the same positions for every row of a budget; ± is the standard error over "
     << "256-position blocks. Lock-step run " << fmt("%.0f", doc_s) << " s on " << o.threads << " thread(s).\n\n";
  if (multi_kv) {
    md << "KV caches: the full-KV reference and the calibration in " << kv_label(ref_kv.dtype) << "; rows in";
    for (std::size_t k = 0; k < kvs.size(); ++k) md << (k ? ", " : " ") << kv_label(kvs[k].dtype);
    md << "; 'no eviction' rows keep every token in their dtype.";
    for (const fid::KvFormat& kv : kvs) {
      if (kv.dtype != triattn::DType::kFP8E4M3) continue;
      if (kv.scales.empty()) {
        md << " fp8 e4m3 scales: 1 for every layer.";
        continue;
      }
      float kmin = 1e30f, kmax = 0, vmin = 1e30f, vmax = 0, over = 0;
      for (int l = 0; l < mc.n_layers; ++l) {
        const std::size_t ik = static_cast<std::size_t>(l) * 2, iv = ik + 1;
        kmin = std::min(kmin, kv.scales[ik]);
        kmax = std::max(kmax, kv.scales[ik]);
        vmin = std::min(vmin, kv.scales[iv]);
        vmax = std::max(vmax, kv.scales[iv]);
        over = std::max({over, eval_amax[ik] / (448.0f * kv.scales[ik]), eval_amax[iv] / (448.0f * kv.scales[iv])});
      }
      md << " fp8 e4m3 scales per layer = calibration max |K|, |V| × " << o.fp8_headroom << " / 448: K " << fmt("%.4g", kmin) << " … "
         << fmt("%.4g", kmax) << ", V " << fmt("%.4g", vmin) << " … " << fmt("%.4g", vmax)
         << "; the evaluation text's largest |K|, |V| (reference cache) reach at most " << fmt("%.3f", over)
         << " of a layer's fp8 range (above 1: values saturated).";
    }
    md << "\n\n";
  }
  md << (multi_kv ? "| scorer | KV | budget |" : "| scorer | budget |")
     << " KL full‖comp (nats) | top-1 = full | PPL comp / full | ΔPPL | attention recall | positions |\n";
  md << (multi_kv ? "|---|---|---:|" : "|---|---:|") << "---:|---:|---:|---:|---:|---:|\n";
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const DocCell& c = cells[r];
    const Arm& a = arms[rows[r].arm];
    const std::vector<double> nll = finite(c.nll), nll_full = finite(c.nll_full);
    const double ppl = std::exp(fid::mean(nll)), ppl_full = std::exp(fid::mean(nll_full));
    const double top1 = c.counted ? static_cast<double>(c.top1) / static_cast<double>(c.counted) : 1.0;
    const std::string kv = kv_label(kvs[a.kv].dtype);
    md << "| " << a.policy << " | " << (multi_kv ? kv + " | " : "") << rows[r].budget << " | "
       << fmt("%.4f", fid::mean(c.kl)) << " ± " << fmt("%.4f", blocked_se(c.kl, 256)) << " | " << fmt("%.3f", top1)
       << " | " << fmt("%.2f", ppl) << " / " << fmt("%.2f", ppl_full) << " | "
       << fmt("%+.1f%%", 100.0 * (ppl / ppl_full - 1.0)) << " | " << fmt("%.3f", fid::mean(c.recall)) << " ± "
       << fmt("%.3f", blocked_se(c.recall, 256)) << " | " << c.counted << " |\n";
    rep.doc_csv << "doc," << a.policy << "," << rows[r].budget << "," << fmt("%.6f", fid::mean(c.kl)) << ","
                << fmt("%.6f", blocked_se(c.kl, 256)) << "," << fmt("%.6f", top1) << "," << fmt("%.4f", ppl) << ","
                << fmt("%.4f", ppl_full) << "," << fmt("%.6f", fid::mean(c.recall)) << ","
                << fmt("%.6f", blocked_se(c.recall, 256)) << "," << c.counted << "," << o.doc_tokens << "," << kv << "\n";
  }
  md << "\n";

  // 3. Retrieval: a fact at depth 10 / 50 / 90 % of a document, asked about at the end.
  if (o.retrieval_tokens > 0) {
    t0 = clk::now();
    const double depths[] = {0.1, 0.5, 0.9};
    const char* codes[] = {"4817", "2963", "7350"};
    const int answer_len = 6;
    const std::vector<int> question =
        tok.encode("\n\nQuestion: What is the secret number mentioned in the text above?\nAnswer: The secret number is", false);
    struct RetCell {
      int equal = 0, has_fact = 0;
      std::string answers;
    };
    const std::size_t rb = o.retrieval_budgets.size();
    std::vector<RetCell> ret(o.retrieval_policies.size() * rb);
    int full_has = 0;
    std::string full_answers;
    for (int di = 0; di < 3; ++di) {
      const std::vector<int> fact = tok.encode(std::string(" The secret number is ") + codes[di] + ". Remember it. ", false);
      const int filler_n = o.retrieval_tokens - static_cast<int>(fact.size() + question.size());
      if (filler_n < 16) throw std::runtime_error("--retrieval-tokens too small for the fact and the question");
      const std::vector<int> filler = excerpt_tokens(tok, eval_text, 0.05 + 0.3 * di, filler_n);
      const auto at = static_cast<std::ptrdiff_t>(depths[di] * filler_n);
      std::vector<int> ctx(filler.begin(), filler.begin() + at);
      ctx.insert(ctx.end(), fact.begin(), fact.end());
      ctx.insert(ctx.end(), filler.begin() + at, filler.end());
      ctx.insert(ctx.end(), question.begin(), question.end());
      fid::FullDocument<SmolModel> full(model, o.retrieval_tokens + answer_len, ref_kv);
      full.start();
      fid::FullChunk fc;
      const std::vector<int> ref = fid::answer_greedy(ctx, o.doc_divide, answer_len, [&](std::span<const int> t, std::int64_t p0) {
        full.feed(t, p0, false, fc);
        const std::span<const float> last = fc.row(fc.rows - 1);
        return std::vector<float>(last.begin(), last.end());
      });
      const std::string ref_text = tok.decode(ref, false);
      full_has += ref_text.find(codes[di]) != std::string::npos ? 1 : 0;
      full_answers += (di ? " / " : "") + std::string("`") + ref_text + "`";
      std::vector<std::unique_ptr<fid::DocumentPolicy>> pols;
      for (const std::string& name : o.retrieval_policies)
        for (int b : o.retrieval_budgets)
          pols.push_back(
              make_doc_policy(name, b, o.doc_divide, stats, *models[pols.size() % models.size()], o.random_seed, ref_kv));
      std::vector<std::vector<int>> answers(pols.size());
      fid::parallel_for(static_cast<int>(pols.size()), o.threads, [&](int, int i) {
        fid::DocumentPolicy& p = *pols[static_cast<std::size_t>(i)];
        p.start();
        answers[static_cast<std::size_t>(i)] = fid::answer_greedy(
            ctx, o.doc_divide, answer_len, [&](std::span<const int> t, std::int64_t p0) { return p.feed(t, p0, nullptr, {}); });
      });
      for (std::size_t i = 0; i < pols.size(); ++i) {
        const std::string text = tok.decode(answers[i], false);
        ret[i].equal += answers[i] == ref ? 1 : 0;
        ret[i].has_fact += text.find(codes[di]) != std::string::npos ? 1 : 0;
        ret[i].answers += (di ? " / " : "") + std::string("`") + text + "`";
      }
      std::fprintf(stderr, "[smollm2] retrieval depth %.0f%%: full KV answers \"%s\" (%.0f s)\n", 100 * depths[di],
                   ref_text.c_str(), since(t0));
    }
    md << "### SmolLM2-135M-Instruct: retrieval\n\n"
       << "A sentence \"The secret number is N. Remember it.\" planted at 10 %, 50 % and 90 % of a " << o.retrieval_tokens
       << "-token context (Pride and Prejudice filler), then \"Question: What is the secret number mentioned in the "
          "text above? Answer: The secret number is\" and "
       << answer_len << " greedy tokens. Same prompt setting as above (everything competes; rounds during the long "
                        "prefill). Full KV answers: "
       << full_answers << " (" << full_has << "/3 contain N). Run " << fmt("%.0f", since(t0)) << " s.\n\n";
    md << "| scorer | budget | answer = full KV (of 3) | contains N (of 3) | answers (10 % / 50 % / 90 %) |\n";
    md << "|---|---:|---:|---:|---|\n";
    for (std::size_t bi = 0; bi < rb; ++bi)
      for (std::size_t pi = 0; pi < o.retrieval_policies.size(); ++pi) {
        const RetCell& c = ret[pi * rb + bi];
        std::string answers = c.answers;
        std::replace(answers.begin(), answers.end(), '\n', ' ');
        std::replace(answers.begin(), answers.end(), '|', '/');
        md << "| " << o.retrieval_policies[pi] << " | " << o.retrieval_budgets[bi] << " | " << c.equal << " | "
           << c.has_fact << " | " << answers << " |\n";
        rep.doc_csv << "retrieval," << o.retrieval_policies[pi] << "," << o.retrieval_budgets[bi] << "," << c.equal << ","
                    << c.has_fact << ",,,,,,," << o.retrieval_tokens << "," << kv_label(ref_kv.dtype) << "\n";
      }
    md << "\n";
  }
  md << "SmolLM2 CPU path: " << fmt("%.1f", 1000.0 * doc_s / doc_tokens_total)
     << " ms of wall time per document token for the whole lock-step run (full KV + " << arms.size()
     << " other caches on " << o.threads << " thread(s)). Total " << fmt("%.0f", since(t_model)) << " s.\n\n";
  std::fprintf(stderr, "[smollm2] done in %.1f s\n", since(t_model));
}

int real_main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  const auto t_all = clk::now();
  const std::string started = utc_now();
  Report rep;
  rep.csv << "model,scorer,budget,recall,agreement,first_div_mean,first_div_median,censored,kl,tf_top1,prompts,gen,"
             "first_round_mean,recency_overlap,recall_se,kl_se,seconds\n";
  rep.doc_csv << "task,scorer,budget,kl,kl_se,top1,ppl,ppl_full,recall,recall_se,positions,tokens,kv\n";
  for (const std::string& m : o.models) {
    if (m == "smollm2") {
      run_smollm2(o, rep);
      continue;
    }
    Experiment e;
    if (m == "stories") {
      const std::string dir = std::string(TRIATTN_SHARED_DATA_DIR) + "/models";
      e.weights = ex::load_llama2c_checkpoint(dir + "/stories260K.bin");
      const ex::Tokenizer tok = ex::Tokenizer::load(dir + "/tok512.bin", e.weights.config.vocab_size);
      e.label = "stories260K";
      e.description =
          "llama2.c stories260K (5 layers, 8 q / 4 kv heads, head_dim 8 = 4 RoPE frequencies, interleaved, "
          "theta 1e4, trained context 512). Evaluation prompts: " +
          std::to_string(o.prompts) + " TinyStories-style openings; calibration prompts: " +
          std::to_string(o.calib_prompts) + " different openings.";
      for (int i = 0; i < o.prompts; ++i) e.eval_prompts.push_back(tok.encode(kEvalTexts[static_cast<std::size_t>(i)], true, false));
      for (int i = 0; i < o.calib_prompts; ++i)
        e.calib_prompts.push_back(tok.encode(kCalibTexts[static_cast<std::size_t>(i)], true, false));
      e.gen = o.gen;
      e.calib_gen = o.calib_gen;
      e.budgets = o.budgets.empty() ? default_budgets(o.gen) : o.budgets;
    } else {
      ex::ModelConfig c = ex::synthetic_config(o.synthetic_shape);
      e.weights = ex::make_synthetic_weights(c, o.synthetic_seed);
      e.label = c.name;
      e.description = "Synthetic " + o.synthetic_shape + " model (" + std::to_string(c.n_layers) + " layers, dim " +
                      std::to_string(c.dim) + ", " + std::to_string(c.n_heads) + " q / " + std::to_string(c.n_kv_heads) +
                      " kv heads, head_dim " + std::to_string(c.head_dim) + ", half pairing, theta " +
                      fmt("%g", c.rope_theta) + ", vocab " + std::to_string(c.vocab_size) +
                      "), random weights (seed " + std::to_string(o.synthetic_seed) +
                      ") with a per-head query bias. Prompts: BOS + 7 seeded pseudo-random tokens.";
      for (int i = 0; i < o.synthetic_prompts; ++i)
        e.eval_prompts.push_back(random_prompt(c.vocab_size, 100 + static_cast<std::uint64_t>(i)));
      for (int i = 0; i < o.calib_prompts; ++i)
        e.calib_prompts.push_back(random_prompt(c.vocab_size, 900 + static_cast<std::uint64_t>(i)));
      e.gen = o.synthetic_gen;
      e.calib_gen = o.calib_gen;
      e.budgets = o.synthetic_budgets.empty() ? default_budgets(o.synthetic_gen) : o.synthetic_budgets;
    }
    run_experiment(e, o, rep);
  }
  const double total = since(t_all);
  std::ostringstream head;
  head << "<!-- generated by triattn_fidelity, started " << started << ", total runtime " << fmt("%.1f", total)
       << " s -->\n\n";
  const std::string md = head.str() + rep.md.str();
  std::printf("%s", md.c_str());
  if (!o.md_path.empty()) {
    std::ofstream f(o.md_path);
    if (!f) throw std::runtime_error("cannot write " + o.md_path);
    f << md;
  }
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    if (!f) throw std::runtime_error("cannot write " + o.csv_path);
    f << rep.csv.str();
  }
  if (!o.doc_csv_path.empty()) {
    std::ofstream f(o.doc_csv_path);
    if (!f) throw std::runtime_error("cannot write " + o.doc_csv_path);
    f << rep.doc_csv.str();
  }
  std::fprintf(stderr, "\ntotal runtime %.1f s\n", total);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return real_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triattn_fidelity: error: %s\n", e.what());
    return 1;
  }
}

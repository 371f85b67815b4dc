// SPDX-License-Identifier: Apache-2.0
// serving: the continuous-batching loop of serving_loop.hpp under a workload, measured as serving
// benchmarks measure engines (README.md in this folder). Loads a model once (llama2.c, GGUF or a
// synthetic shape), then runs every (configuration, arrival rate) pair on a fresh KV cache of the
// same memory limit and prints a table row per run; --json writes them all.
//
//   serving --workload reasoning --requests 8 --scale 0.02 --configs full,tri --kv-limit 64M
//   serving --device gpu --synthetic qwen3-8b-like --workload reasoning --kv-limit 40G
//           --configs full,tri,full+prefix,tri+prefix --rates 0 --json out.json   (one line)
//
// Compiled as C++ for the CPU (host rounds: KvCache::compress_if_needed) and through main_gpu.cu
// as CUDA (--device gpu: CudaBackend, the KV pool in CUDA virtual memory, rounds on the device
// with cuda::DeviceRounds overlapped with the next decode steps).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include <triattn/core/file_io.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/stats/random.hpp>

#if defined(TRIATTN_EXAMPLE_CUDA)
#include <reference_transformer/cuda_backend.cuh>

#include "device_rounds.cuh"
#endif
#include <reference_transformer/cli_numbers.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/model_files.hpp>
#include <reference_transformer/stats_io.hpp>
#include <reference_transformer/synthetic.hpp>

#include "report.hpp"
#include "serving_loop.hpp"
#include "workload.hpp"

#ifndef TRIATTN_SHARED_DATA_DIR
#define TRIATTN_SHARED_DATA_DIR "../shared/data"
#endif

namespace ex = triattn_example;
namespace sv = triattn_serving;

namespace {

struct Options {
  std::string model_path, synthetic, stats_path, trace_path, json_out, note;
  int synthetic_layers = 0, synthetic_vocab = 0;
  std::string device = "cpu";
  bool weights_bf16 = false, batch_invariant = false, no_graphs = false, stop_at_eos = false;
  bool rounds_on_engine = false, map_ahead = true;  // gpu: --round-stream engine, --no-map-ahead
  int trim_every = 16;                              // gpu: steps between VMM trims
  int step_log = 20000;                             // steps in each run's JSON step log (0: none)
  triattn::DType kv_dtype = triattn::DType::kF32;
  int block_size = 16, max_seqs = 256, prefill_chunk = 2048, budget = 2048, divide_length = 128;
  triattn::PromptMode prompt_mode = triattn::PromptMode::kPinnedInBudget;
  sv::WorkloadSpec workload;
  std::vector<double> rates{0.0};
  std::vector<std::string> configs{"full"};
  std::uint64_t kv_limit = 0;  // bytes; 0 = every request's worst case at once
  sv::Admission admission = sv::Admission::kExact;
  float temperature = 0.0f, top_p = 1.0f;
  double progress_s = 5.0;
};

void usage() {
  std::printf(
      "usage: serving [options]\n"
      "model:\n"
      "  --model PATH            llama2.c checkpoint or GGUF (default %s/models/stories260K.bin)\n"
      "  --synthetic SHAPE       random weights: tiny | small | qwen3-8b-like (--synthetic-layers N,\n"
      "                          --synthetic-vocab N shrink it)\n"
      "  --device D              cpu (default) | gpu\n"
      "  --weight-dtype T        gpu: f32 | bf16 (default f32; bf16 for synthetic shapes on the gpu)\n"
      "  --kv-dtype T            f32 (default on cpu) | bf16 (default on gpu) | f16 | fp8 (e4m3, every\n"
      "                          scale 1: half the bytes of bf16, so --kv-limit holds twice the tokens)\n"
      "  --batch-invariant       gpu: GEMV matmuls and the per-row attention kernel for every step, so\n"
      "                          a row's arithmetic never depends on the batch (slower; for equality checks)\n"
      "  --no-graphs             gpu: launch decode steps kernel by kernel (no CUDA graphs; a changing\n"
      "                          batch composition captures a new graph whenever it changes)\n"
      "  --round-stream S        gpu: side (default: rounds on a stream of their own, overlapping the next\n"
      "                          decode steps) | engine (on the model's stream, between two steps)\n"
      "  --no-map-ahead          gpu: map KV pages when a step's extend needs them (default: while the\n"
      "                          device runs the previous step, for the blocks the next one may take)\n"
      "  --trim-every N          gpu: give empty KV slabs back every N steps, 2 kept (default 16)\n"
      "workload:\n"
      "  --workload W            reasoning (default) | longqa | shared\n"
      "  --trace PATH            replay a JSONL trace instead ({\"arrival\", \"prompt\" | \"prompt_len\",\n"
      "                          \"max_new_tokens\"} per line), at its own arrival times unless --rates\n"
      "  --requests N            requests generated (default 16)\n"
      "  --scale F               all lengths times F (default 1)\n"
      "  --gen-scale F           generated lengths times F as well (default 1)\n"
      "  --seed S                workload, arrivals and sampling seed (default 1)\n"
      "  --rates R1,R2,...       Poisson arrival rates in requests/s; 0 = offline (all at t = 0);\n"
      "                          'trace' = the trace's own arrival times (default: 0, or 'trace' with --trace)\n"
      "serving:\n"
      "  --configs C1,C2,...     full | tri | full+prefix | tri+prefix (default full)\n"
      "  --kv-limit BYTES        KV memory limit shared by all configurations (suffix K, M, G = 10^3..;\n"
      "                          Ki, Mi, Gi = 2^10..); default: every request's worst case at once\n"
      "  --admission A           exact (default: core/admission.hpp worst case, never preempts) |\n"
      "                          optimistic (admit while the prompt fits; preempt by recompute)\n"
      "  --max-seqs N            requests running at once at most (default 256)\n"
      "  --prefill-chunk N       prompt tokens per step, mixed with the decode rows (default 2048; 0 = whole)\n"
      "  --block-size N          tokens per KV block (default 16)\n"
      "  --budget B              TriAttention budget (default 2048)\n"
      "  --divide-length D       compress when a sequence reaches B + D (default 128)\n"
      "  --prompt-mode M         pinned_in_budget (default) | pinned_on_top | compete: prompt tokens\n"
      "                          kept inside the budget, kept on top of it, or scored like the rest\n"
      "                          (pinned_on_top for prompts longer than B, e.g. a shared system prompt)\n"
      "  --stats PATH            TriAttention statistics (.pt / .safetensors); default: random ones\n"
      "                          (the rounds' cost does not depend on their values)\n"
      "  --temperature T, --top-p P   sampling (default greedy)\n"
      "  --stop-at-eos           end a request at EOS/BOS (default: ignore them, fixed lengths)\n"
      "output:\n"
      "  --json PATH             write every run (summary, per request, timeline, step log) as JSON\n"
      "  --step-log N            steps per run in the JSON step log (default 20000, every k-th beyond; 0 = none)\n"
      "  --note TEXT             stored in the JSON (e.g. how lengths were scaled)\n"
      "  --progress S            progress line every S seconds (default 5; 0 = off)\n",
      TRIATTN_SHARED_DATA_DIR);
}

double to_double(const std::string& flag, const std::string& v) {
  double x = 0;
  const char* end = v.data() + v.size();
  const auto [ptr, ec] = std::from_chars(v.data(), end, x);
  if (v.empty() || ec != std::errc{} || ptr != end || !std::isfinite(x))
    throw triattn::logic_error("option " + flag + ": '" + v + "' is not a finite number");
  return x;
}

/// "40G", "512Mi", "1000000" as bytes.
std::uint64_t to_bytes(const std::string& flag, const std::string& v) {
  std::size_t digits = 0;
  while (digits < v.size() && (std::isdigit(static_cast<unsigned char>(v[digits])) || v[digits] == '.')) ++digits;
  const double x = to_double(flag, v.substr(0, digits));
  const std::string suf = v.substr(digits);
  double m = 1;
  if (suf == "K") m = 1e3;
  else if (suf == "M") m = 1e6;
  else if (suf == "G") m = 1e9;
  else if (suf == "Ki") m = 1024.0;
  else if (suf == "Mi") m = 1024.0 * 1024;
  else if (suf == "Gi") m = 1024.0 * 1024 * 1024;
  else if (!suf.empty()) throw triattn::logic_error("option " + flag + ": '" + v + "': unknown suffix '" + suf + "'");
  const double b = x * m;
  if (!(b >= 1) || b > 1e15) throw triattn::logic_error("option " + flag + ": '" + v + "' is outside [1 B, 1 PB]");
  return static_cast<std::uint64_t>(b);
}

Options parse_args(int argc, char** argv) {
  Options o;
  bool kv_dtype_set = false, rates_set = false;
  std::vector<std::string> gpu_only;  // options that apply to --device gpu only
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw triattn::logic_error(std::string("option ") + argv[i] + " needs a value");
    return argv[++i];
  };
  auto to_int = [](const std::string& f, const std::string& v, long long lo, long long hi) {
    return static_cast<int>(ex::parse_int_option(f, v, lo, hi));
  };
  constexpr long long kMax = 2147483647LL;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else if (a == "--model") o.model_path = need(i);
    else if (a == "--synthetic") o.synthetic = need(i);
    else if (a == "--synthetic-layers") o.synthetic_layers = to_int(a, need(i), 1, ex::Llama2cLimits::kMaxLayers);
    else if (a == "--synthetic-vocab") o.synthetic_vocab = to_int(a, need(i), 2, ex::Llama2cLimits::kMaxVocab);
    else if (a == "--device") {
      o.device = need(i);
      if (o.device != "cpu" && o.device != "gpu") throw triattn::logic_error("--device: '" + o.device + "' is not cpu or gpu");
    } else if (a == "--weight-dtype") {
      const std::string v = need(i);
      if (v != "f32" && v != "bf16") throw triattn::logic_error("--weight-dtype: '" + v + "' is not f32 or bf16");
      o.weights_bf16 = v == "bf16";
    } else if (a == "--kv-dtype") {
      const std::string v = need(i);
      kv_dtype_set = true;
      if (v == "f32") o.kv_dtype = triattn::DType::kF32;
      else if (v == "bf16") o.kv_dtype = triattn::DType::kBF16;
      else if (v == "f16") o.kv_dtype = triattn::DType::kF16;
      else if (v == "fp8") o.kv_dtype = triattn::DType::kFP8E4M3;
      else throw triattn::logic_error("--kv-dtype: '" + v + "' is not f32, bf16, f16 or fp8");
    } else if (a == "--batch-invariant") o.batch_invariant = true;
    else if (a == "--no-graphs") o.no_graphs = true;
    else if (a == "--round-stream") {
      const std::string v = need(i);
      if (v != "side" && v != "engine") throw triattn::logic_error("--round-stream: '" + v + "' is not side or engine");
      o.rounds_on_engine = v == "engine";
      gpu_only.push_back(a);
    } else if (a == "--no-map-ahead") {
      o.map_ahead = false;
      gpu_only.push_back(a);
    } else if (a == "--trim-every") {
      o.trim_every = to_int(a, need(i), 1, kMax);
      gpu_only.push_back(a);
    } else if (a == "--step-log") o.step_log = to_int(a, need(i), 0, kMax);
    else if (a == "--workload") o.workload.kind = need(i);
    else if (a == "--trace") o.trace_path = need(i);
    else if (a == "--requests") o.workload.requests = to_int(a, need(i), 1, 1 << 20);
    else if (a == "--scale") o.workload.scale = to_double(a, need(i));
    else if (a == "--gen-scale") o.workload.gen_scale = to_double(a, need(i));
    else if (a == "--seed") o.workload.seed = static_cast<std::uint64_t>(ex::parse_int_option(a, need(i), 0, kMax));
    else if (a == "--rates") {
      rates_set = true;
      o.rates.clear();
      for (const std::string& r : ex::split_list(need(i))) o.rates.push_back(r == "trace" ? -1.0 : to_double("--rates", r));
      for (double r : o.rates)
        if (r < 0 && r != -1.0) throw triattn::logic_error("--rates: a rate must be >= 0 (or 'trace')");
    } else if (a == "--configs") {
      o.configs = ex::split_list(need(i));
      for (const std::string& c : o.configs)
        if (c != "full" && c != "tri" && c != "full+prefix" && c != "tri+prefix")
          throw triattn::logic_error("--configs: '" + c + "' is not full, tri, full+prefix or tri+prefix");
    } else if (a == "--kv-limit") o.kv_limit = to_bytes(a, need(i));
    else if (a == "--admission") {
      const std::string v = need(i);
      if (v == "exact") o.admission = sv::Admission::kExact;
      else if (v == "optimistic") o.admission = sv::Admission::kOptimistic;
      else throw triattn::logic_error("--admission: '" + v + "' is not exact or optimistic");
    } else if (a == "--max-seqs") o.max_seqs = to_int(a, need(i), 1, 65535);
    else if (a == "--prefill-chunk") o.prefill_chunk = to_int(a, need(i), 0, kMax);
    else if (a == "--block-size") o.block_size = to_int(a, need(i), 1, 1 << 16);
    else if (a == "--budget") o.budget = to_int(a, need(i), 1, kMax);
    else if (a == "--divide-length") o.divide_length = to_int(a, need(i), 1, kMax);
    else if (a == "--prompt-mode") o.prompt_mode = triattn::prompt_mode_from_string(need(i), "--prompt-mode");
    else if (a == "--stats") o.stats_path = need(i);
    else if (a == "--temperature") o.temperature = static_cast<float>(to_double(a, need(i)));
    else if (a == "--top-p") o.top_p = static_cast<float>(to_double(a, need(i)));
    else if (a == "--stop-at-eos") o.stop_at_eos = true;
    else if (a == "--json") o.json_out = need(i);
    else if (a == "--note") o.note = need(i);
    else if (a == "--progress") o.progress_s = to_double(a, need(i));
    else throw triattn::logic_error("unknown option '" + a + "' (--help lists them)");
  }
#if !defined(TRIATTN_EXAMPLE_CUDA)
  if (o.device == "gpu") throw triattn::logic_error("--device gpu: this build has no CUDA support (TRIATTN_ENABLE_CUDA=ON)");
#endif
  if (o.device == "cpu" && (o.weights_bf16 || o.batch_invariant || o.no_graphs))
    throw triattn::logic_error("--weight-dtype bf16, --batch-invariant and --no-graphs apply to --device gpu only");
  if (o.device == "cpu" && !gpu_only.empty())
    throw triattn::logic_error(gpu_only.front() + " applies to --device gpu only");
  if (o.device == "gpu" && !kv_dtype_set) o.kv_dtype = triattn::DType::kBF16;
  if (!o.trace_path.empty() && !rates_set) o.rates = {-1.0};  // a trace keeps its own arrival times
  for (double r : o.rates)
    if (r == -1.0 && o.trace_path.empty()) throw triattn::logic_error("--rates trace needs --trace");
  if (o.temperature < 0 || !(o.top_p > 0)) throw triattn::logic_error("--temperature must be >= 0 and --top-p > 0");
  if (!(o.workload.scale > 0) || !(o.workload.gen_scale > 0)) throw triattn::logic_error("--scale and --gen-scale must be > 0");
  if (o.progress_s < 0) throw triattn::logic_error("--progress must be >= 0");
  if (!o.json_out.empty()) triattn::check_write_target(o.json_out, "--json");
  return o;
}

/// The KV cache configuration every configuration of a run shares: `limit` bytes of blocks, rows
/// wide enough for the longest request uncompressed.
triattn::CacheConfig cache_config(const ex::ModelConfig& mc, const std::vector<sv::Request>& reqs, const Options& o) {
  triattn::CacheConfig cfg;
  cfg.model = mc.geometry();
  cfg.block_size = o.block_size;
  cfg.dtype = o.kv_dtype;
  cfg.layout = triattn::KvLayout::kNHD;
  cfg.max_seqs = o.max_seqs;
  std::int64_t widest = 1, all = 0;
  for (const sv::Request& r : reqs) {
    const std::int64_t b = (static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens + o.block_size - 1) / o.block_size + 1;
    widest = std::max(widest, b);
    all += b;
  }
  const std::int64_t block_bytes = cfg.block_bytes_all_ranges();
  const std::int64_t blocks = o.kv_limit > 0 ? static_cast<std::int64_t>(o.kv_limit / static_cast<std::uint64_t>(block_bytes)) : all;
  if (blocks < 1 || blocks > 0x7fffffffLL)
    throw triattn::logic_error("--kv-limit: " + std::to_string(o.kv_limit) + " bytes make " + std::to_string(blocks) +
                               " KV blocks of " + std::to_string(block_bytes) + " bytes (need 1 .. 2^31 - 1)");
  cfg.num_blocks = static_cast<int>(blocks);
  cfg.max_blocks_per_seq = static_cast<int>(std::min<std::int64_t>(widest, blocks));
  return cfg;
}

triattn::SelectionParams selection(const Options& o) {
  triattn::SelectionParams sel;
  sel.budget = o.budget;
  sel.divide_length = o.divide_length;
  sel.prompt = o.prompt_mode;
  return sel;
}

/// The workload of one run: generated (arrivals at `rate`) or the trace (rate -1: its own times).
std::vector<sv::Request> workload(const Options& o, const ex::ModelConfig& mc, double rate) {
  std::vector<sv::Request> reqs = o.trace_path.empty() ? sv::make_workload(o.workload, mc.vocab_size, mc.bos_id)
                                                       : sv::load_trace(o.trace_path, mc.vocab_size, mc.bos_id, o.workload.seed);
  if (rate >= 0) sv::poisson_arrivals(reqs, rate, o.workload.seed);
  return reqs;
}

sv::LoopOptions loop_options(const Options& o, const ex::ModelConfig& mc, bool prefix) {
  sv::LoopOptions lo;
  lo.admission = o.admission;
  lo.prefill_chunk = o.prefill_chunk;
  lo.prefix_cache = prefix;
  lo.temperature = o.temperature;
  lo.top_p = o.top_p;
  lo.seed = o.workload.seed;
  if (o.stop_at_eos) lo.stop_tokens = {mc.eos_id, mc.bos_id};
  if (o.progress_s > 0) {
    lo.progress_s = o.progress_s;
    lo.on_progress = [](const sv::Progress& p) {
      std::fprintf(stderr, "  [%7.1f s] %zu/%zu done, %zu running, %zu waiting, %lld tokens, KV %.2f GiB, %d preemptions\n",
                   p.now_s, p.finished, p.total, p.running, p.waiting, static_cast<long long>(p.generated),
                   static_cast<double>(p.kv_bytes) / (1024.0 * 1024.0 * 1024.0), p.preemptions);
    };
  }
  return lo;
}

/// Collects the runs' JSON and writes the file at the end.
struct JsonSink {
  std::vector<std::string> runs;
  void write(const Options& o, const ex::ModelConfig& mc, const triattn::CacheConfig& cfg, const char* backend) const {
    if (o.json_out.empty()) return;
    std::string s = "{\"model\": " + triattn::detail::json_quote(mc.name) + ", \"layers\": " + std::to_string(mc.n_layers) +
                    ", \"dim\": " + std::to_string(mc.dim) + ", \"kv_heads\": " + std::to_string(mc.n_kv_heads) +
                    ", \"head_dim\": " + std::to_string(mc.head_dim) + ", \"backend\": \"" + backend +
                     "\", \"workload\": " + triattn::detail::json_quote(o.trace_path.empty() ? o.workload.kind : o.trace_path) +
                     ", \"scale\": " + std::to_string(o.workload.scale) + ", \"gen_scale\": " + std::to_string(o.workload.gen_scale) +
                     ", \"note\": " + triattn::detail::json_quote(o.note) + ", \"kv_limit_bytes\": " +
                     std::to_string(static_cast<std::int64_t>(cfg.num_blocks) * cfg.block_bytes_all_ranges()) +
                     ", \"kv_dtype\": \"" + triattn::dtype_name(cfg.dtype) + "\", \"block_size\": " + std::to_string(cfg.block_size) +
                     ", \"budget\": " + std::to_string(o.budget) + ", \"divide_length\": " + std::to_string(o.divide_length) +
                     ", \"prompt_mode\": \"" + triattn::to_string(o.prompt_mode) + "\"" +
                     ", \"prefill_chunk\": " + std::to_string(o.prefill_chunk) +
                     ", \"round_stream\": \"" + (o.rounds_on_engine ? "engine" : "side") + "\", \"map_ahead\": " +
                     (o.map_ahead ? "true" : "false") + ", \"trim_every\": " + std::to_string(o.trim_every) +
                     ", \"admission\": \"" +
                     (o.admission == sv::Admission::kExact ? "exact" : "optimistic") + "\", \"runs\": [\n";
    for (std::size_t i = 0; i < runs.size(); ++i) s += (i ? ",\n" : "") + runs[i];
    s += "\n]}\n";
    triattn::write_file_atomically(o.json_out, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()), "--json");
  }
};

/// Runs every (configuration, rate) of `o`: uncompressed configurations through run_plain,
/// compressed ones through run_tri (each makes its cache, rounds and hooks); prints the table.
template <class ModelT, class RunPlain, class RunTri>
void run_all(const Options& o, ModelT& model, const RunPlain& run_plain, const RunTri& run_tri, const char* backend) {
  const ex::ModelConfig& mc = model.config();
  JsonSink sink;
  std::vector<sv::Summary> rows;
  triattn::CacheConfig cfg_shown;
  for (double rate : o.rates) {
    const std::vector<sv::Request> reqs = workload(o, mc, rate);
    const triattn::CacheConfig cfg = cache_config(mc, reqs, o);
    cfg_shown = cfg;
    for (const std::string& c : o.configs) {
      const bool tri = c.rfind("tri", 0) == 0;
      const bool prefix = c.find("+prefix") != std::string::npos;
      char arrivals[64] = "offline";
      if (rate > 0) std::snprintf(arrivals, sizeof arrivals, "Poisson %g req/s", rate);
      else if (rate < 0) std::snprintf(arrivals, sizeof arrivals, "trace arrivals");
      std::fprintf(stderr, "run: %s, %s, %zu requests, KV pool %d blocks (%.2f GiB)\n", c.c_str(), arrivals,
                   reqs.size(), cfg.num_blocks,
                   static_cast<double>(cfg.num_blocks) * static_cast<double>(cfg.block_bytes_all_ranges()) / (1u << 30));
      const sv::LoopOptions lo = loop_options(o, mc, prefix);
      const sv::LoopResult res = tri ? run_tri(cfg, std::span<const sv::Request>(reqs), lo)
                                     : run_plain(cfg, std::span<const sv::Request>(reqs), lo);
      const sv::Summary s = sv::summarize(res, c, rate);
      rows.push_back(s);
      sv::print_table_header(stderr);
      sv::print_table_row(stderr, s);
      sv::print_itl_breakdown(stderr, s);
      sink.runs.push_back(sv::run_json(s, res, 2000, static_cast<std::size_t>(o.step_log)));
    }
  }
  std::printf("\n%s, %s backend, KV %s, %d-token blocks\n", mc.name.c_str(), backend, triattn::dtype_name(o.kv_dtype),
              o.block_size);
  sv::print_table_header(stdout);
  for (const sv::Summary& s : rows) sv::print_table_row(stdout, s);
  sink.write(o, mc, cfg_shown, backend);
}

triattn::QueryStats stats_for(const Options& o, const ex::ModelConfig& mc) {
  if (!o.stats_path.empty()) return ex::load_stats(o.stats_path, mc);
  std::mt19937 rng(1234);
  return triattn::random_query_stats(rng, mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);
}

using HostAlloc = triattn::PrefixCachingAllocator<triattn::StaticAllocator<triattn::HostBackend>>;
using HostPlain = triattn::KvCache<HostAlloc, triattn::HostCompactor>;
using HostTri = triattn::KvCache<HostAlloc, triattn::HostCompactor, triattn::TriAttentionScorer, triattn::TopKSelector>;

void run_cpu(const Options& o, const ex::ModelWeights& weights) {
  ex::Model<ex::CpuBackend> model(weights);
  const ex::ModelConfig& mc = model.config();
  const triattn::QueryStats stats = stats_for(o, mc);
  auto run_plain = [&](const triattn::CacheConfig& cfg, std::span<const sv::Request> reqs, const sv::LoopOptions& lo) {
    HostPlain cache(cfg);
    sv::HostRounds<HostPlain> none(cache);
    return sv::serve(model, cache, none, reqs, lo);
  };
  auto run_tri = [&](const triattn::CacheConfig& cfg, std::span<const sv::Request> reqs, const sv::LoopOptions& lo) {
    HostTri cache(cfg, triattn::TriAttentionScorer(stats, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads),
                  triattn::TopKSelector(selection(o)));
    sv::HostRounds<HostTri> rounds(cache);
    return sv::serve(model, cache, rounds, reqs, lo);
  };
  run_all(o, model, run_plain, run_tri, "cpu");
}

#if defined(TRIATTN_EXAMPLE_CUDA)
using GpuPlain = sv::GpuPlainCache;
using GpuTri = sv::GpuTriCache;

void run_gpu(const Options& o, ex::Model<ex::CudaBackend>& model, ex::CudaBackend& backend) {
  const ex::ModelConfig& mc = model.config();
  if (!triattn::cuda::is_supported_head_dim(mc.head_dim))
    for (const std::string& c : o.configs)
      if (c.rfind("tri", 0) == 0)
        throw triattn::logic_error("configuration " + c + ": the GPU rounds need head_dim 64 or 128, " + mc.name + " has " +
                                   std::to_string(mc.head_dim));
  const triattn::QueryStats stats = stats_for(o, mc);
  const cudaStream_t stream = backend.stream();
  // Per step: two events on the model's stream around the step's own work (its device time); while
  // the device runs the step, the VMM upkeep: the pages of the blocks the next step may take
  // mapped ahead (so no step's extend maps them on the host's critical path), and every
  // --trim-every steps the empty slabs beyond two given back (their unmap waits for an event
  // behind the step). Rounds no longer trim when they commit: the slabs they empty go back here.
  struct StepEvents {
    cudaEvent_t begin = nullptr, end = nullptr;
    StepEvents() {
      TRIATTN_CUDA_TRY(cudaEventCreate(&begin));
      TRIATTN_CUDA_TRY(cudaEventCreate(&end));
    }
    StepEvents(const StepEvents&) = delete;
    StepEvents& operator=(const StepEvents&) = delete;
    ~StepEvents() {
      triattn::cuda::report_error(cudaEventDestroy(begin), "serving: cudaEventDestroy");
      triattn::cuda::report_error(cudaEventDestroy(end), "serving: cudaEventDestroy");
    }
  };
  auto events = std::make_shared<StepEvents>();
  auto hooks_for = [&, events](auto& cache) {
    using Inner = typename std::remove_reference_t<decltype(cache.allocator())>::inner_type;
    sv::LoopHooks h;
    h.device_bytes = [] { return ex::device_memory_used(); };
    h.before_step = [events, stream] { TRIATTN_CUDA_TRY(cudaEventRecord(events->begin, stream)); };
    h.during_step = [&cache, &o, events, stream, n = std::size_t{0}](std::int64_t next_blocks) mutable {
      TRIATTN_CUDA_TRY(cudaEventRecord(events->end, stream));
      auto& a = cache.allocator();
      // Trim first: it unmaps slabs whose earlier trim completed, which ensure_mapped counts as mapped.
      if (++n % static_cast<std::size_t>(o.trim_every) == 0) (void)a.trim(stream, 2 * a.stats().slab_bytes);
      if (o.map_ahead && next_blocks > 0) {  // within the free block ids: asking for more maps nothing
        const auto ids = static_cast<std::int64_t>(static_cast<const Inner&>(a).num_free());
        (void)a.ensure_mapped(static_cast<std::size_t>(std::min(next_blocks, ids)));
      }
    };
    h.step_device_s = [events] {
      float ms = 0.0f;
      TRIATTN_CUDA_TRY(cudaEventElapsedTime(&ms, events->begin, events->end));
      return static_cast<double>(ms) * 1e-3;
    };
    h.counters = [&cache, &backend] {
      const triattn::cuda::VmmStats v = cache.allocator().stats();
      sv::HostCounters c;
      c.graph_captures = static_cast<std::int64_t>(backend.stats().graph_captures);
      c.slabs_mapped = static_cast<std::int64_t>(v.counters.slabs_mapped);
      c.slabs_unmapped = static_cast<std::int64_t>(v.counters.slabs_unmapped);
      return c;
    };
    return h;
  };
  auto run_plain = [&](const triattn::CacheConfig& cfg, std::span<const sv::Request> reqs, const sv::LoopOptions& lo) {
    GpuPlain cache(cfg, triattn::cuda::DeviceCompactor(stream));
    sv::HostRounds<GpuPlain> none(cache);
    return sv::serve(model, cache, none, reqs, lo, hooks_for(cache));
  };
  auto run_tri = [&](const triattn::CacheConfig& cfg, std::span<const sv::Request> reqs, const sv::LoopOptions& lo) {
    GpuTri cache(cfg, triattn::cuda::DeviceCompactor(stream),
                 triattn::cuda::TriAttentionDeviceScorer(stats, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads,
                                                         stream),
                 triattn::TopKSelector(selection(o)));
    sv::DeviceRoundsAdapter<GpuTri> rounds(cache, stream,
                                           o.rounds_on_engine ? sv::RoundStream::kEngine : sv::RoundStream::kSide);
    return sv::serve(model, cache, rounds, reqs, lo, hooks_for(cache));
  };
  run_all(o, model, run_plain, run_tri, "cuda");
}
#endif

int real_main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  const std::string data_dir = TRIATTN_SHARED_DATA_DIR;
  ex::ModelConfig shape;
  ex::ModelWeights weights;
  if (!o.synthetic.empty()) {
    shape = ex::synthetic_config(o.synthetic, o.synthetic_layers, o.synthetic_vocab);
  } else {
    weights = ex::load_model_weights(o.model_path.empty() ? data_dir + "/models/stories260K.bin" : o.model_path);
  }
#if defined(TRIATTN_EXAMPLE_CUDA)
  if (o.device == "gpu") {
    ex::CudaBackendOptions bo;
    bo.weights = o.weights_bf16 ? ex::WeightType::kBF16 : ex::WeightType::kF32;
    bo.graphs = !o.no_graphs;
    if (o.batch_invariant) bo = ex::batch_invariant(bo);
    ex::CudaBackend backend(bo);
    if (!o.synthetic.empty()) {  // weights generated on the device (a Qwen3-8B shape has no room on the host path)
      ex::Model<ex::CudaBackend> model(shape, ex::TpRank{}, backend, backend.generate_synthetic(shape, o.workload.seed));
      run_gpu(o, model, backend);
    } else {
      ex::Model<ex::CudaBackend> model(weights, backend);
      run_gpu(o, model, backend);
    }
    return 0;
  }
#endif
  if (!o.synthetic.empty()) {
    if (ex::weight_bytes(shape) > (std::size_t{8} << 30))
      throw triattn::logic_error("synthetic '" + o.synthetic + "' needs over 8 GiB of float32 weights on the CPU; shrink it "
                                 "with --synthetic-layers / --synthetic-vocab or use --device gpu");
    weights = ex::make_synthetic_weights(shape, o.workload.seed);
  }
  run_cpu(o, weights);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return real_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serving: error: %s\n", e.what());
    return 1;
  }
}

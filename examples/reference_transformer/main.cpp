// SPDX-License-Identifier: Apache-2.0
// reference_transformer: runs a Llama-family model (llama2.c's stories260K by default, or a
// synthetic model of any shape) with its KV cache in a triattn::KvCache, optionally compressed
// by TriAttention rounds, and reports cached vs logical lengths, rounds and KV memory.
//
//   reference_transformer                                  # stories260K, greedy, 256 tokens
//   reference_transformer --prompt "Once upon a time" --prompt "The dog" --temperature 0.8 --seed 7
//   reference_transformer --calibrate stats.safetensors --steps 512       # write query statistics
//   reference_transformer --stats stats.safetensors --budget 64 --divide-length 16 --steps 400
//   reference_transformer --synthetic tiny --steps 64
//   reference_transformer --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt "What is the capital of France?"
//   reference_transformer --device gpu --synthetic small --weight-dtype bf16 --kv-dtype bf16
//   reference_transformer --tp 2 --stats stats.safetensors --budget 64 --divide-length 16
//
// The model code (model.hpp) is written against a backend interface (backend.hpp): --device cpu
// runs CpuBackend, --device gpu CudaBackend (cuda_backend.cuh) with the cache in device memory and
// TriAttention rounds on the device. Built without CUDA (TRIATTN_ENABLE_CUDA=OFF), this file is
// compiled as C++ and --device gpu is refused; with CUDA it is compiled through main_gpu.cu.
// --tp N runs the model tensor-parallel (tensor_parallel.hpp): N ranks in N threads, each with its
// shard of the weights, its own KvCache over its KV heads and its statistics slice; on the CPU
// they all-reduce through triattn::tp::ThreadTeamCollective, on the GPU rank r runs on device r
// and all-reduces through NCCL (tp_cuda.cuh).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <triattn/core/file_io.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/tensor_parallel_selector.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/stats/calibrator.hpp>
#include <triattn/core/stats/pt_loader.hpp>
#include <triattn/core/stats/pt_writer.hpp>
#include <triattn/core/stats/safetensors.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/core/tp/collective.hpp>
#include <triattn/core/tp/rank_geometry.hpp>

#if defined(TRIATTN_EXAMPLE_CUDA)
#include "cuda_backend.cuh"
#include "tp_cuda.cuh"
#endif
#include "bpe_tokenizer.hpp"
#include "cli_numbers.hpp"
#include "generate.hpp"
#include "gguf_llama.hpp"
#include "llama2c.hpp"
#include "model.hpp"
#include "model_files.hpp"
#include "sampler.hpp"
#include "serve_shared.hpp"
#include "stats_io.hpp"
#include "synthetic.hpp"
#include "tensor_parallel.hpp"

#ifndef TRIATTN_SHARED_DATA_DIR
#define TRIATTN_SHARED_DATA_DIR "../shared/data"
#endif

namespace ex = triattn_example;

namespace {

/// A cache without compression (the engine may still apply plans itself).
using PlainCache = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor>;
/// A cache that runs TriAttention rounds: compress_if_needed() scores, selects and compacts.
using TriCache = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor,
                                  triattn::TriAttentionScorer, triattn::TopKSelector>;
/// One tensor-parallel rank's compressing cache: union rounds agree through the team's all-reduce.
using TpTriCache = triattn::KvCache<triattn::StaticAllocator<triattn::HostBackend>, triattn::HostCompactor,
                                    triattn::TriAttentionScorer,
                                    triattn::TensorParallelTopKSelector<triattn::tp::ThreadTeamCollective>>;

struct Options {
  std::string model_path;       // empty = default
  std::string tokenizer_path;   // empty = next to the model
  std::string synthetic;        // shape name; empty = llama2.c file
  int synthetic_layers = 0;     // 0 = the shape's
  int synthetic_vocab = 0;
  std::vector<std::string> prompts;
  bool chat = true;             // GGUF models: each prompt is a user turn of the chat template
  triattn::PromptMode prompt_mode = triattn::PromptMode::kPinnedInBudget;
  int steps = 256;
  float temperature = 0.0f;
  float top_p = 0.9f;
  std::uint64_t seed = 42;
  int budget = 2048;
  int divide_length = 128;
  std::string stats_path;
  std::string calibrate_out;
  bool no_compress = false;
  triattn::DType kv_dtype = triattn::DType::kF32;
  std::vector<float> kv_scales;  // --kv-scales (fp8): 1, 2 or 2 * layers values; empty: every scale 1
  int block_size = 16;
  int report_every = 64;
  bool quiet = false;
  std::string device = "cpu";   // cpu | gpu
  bool weights_bf16 = false;     // GPU: matrices stored as bf16
  bool no_graphs = false;        // GPU: launch decode steps kernel by kernel
  bool no_graph_buckets = false; // GPU: one decode graph per batch size instead of per bucket
  bool static_pool = false;      // GPU: --allocator static (one cudaMalloc pool) instead of VMM
  int prefill_chunk = 0;         // prefill tokens per step (0: every prompt in one step)
  int prompt_tokens = 0;         // keep the first N tokens of every encoded prompt (0: all)
  std::string json_out;          // --json PATH: the run's numbers as one JSON object
  int tp = 1;                    // tensor-parallel ranks
  triattn::PruningMode mode = triattn::PruningMode::kPerHead;
};

#if defined(TRIATTN_EXAMPLE_CUDA)
constexpr bool kHaveCuda = true;
#else
constexpr bool kHaveCuda = false;
#endif

void usage() {
  std::printf(
      "usage: reference_transformer [options]\n"
      "  --model PATH          llama2.c v0 checkpoint, or a llama-architecture GGUF file (*.gguf:\n"
      "                        weights and BPE tokenizer; e.g. SmolLM2-135M-Instruct.Q4_1.gguf)\n"
      "                        (default: %s/models/stories260K.bin;\n"
      "                        when that is absent, the synthetic 'tiny' model)\n"
      "  --tokenizer PATH      llama2.c tokenizer (default: tok512.bin next to the model); a .gguf\n"
      "                        model carries its own, so the two are refused together\n"
      "  --synthetic SHAPE     synthetic model: tiny | small | qwen3-8b-like\n"
      "  --synthetic-layers N  override the synthetic shape's layer count\n"
      "  --synthetic-vocab N   override the synthetic shape's vocabulary size\n"
      "  --prompt TEXT         a prompt; repeat for a batch (default: one empty prompt = BOS)\n"
      "  --prompt-file PATH    the text of a file as a prompt (repeatable, like --prompt)\n"
      "  --no-chat             GGUF models: prompts are raw text, not user turns of the chat template\n"
      "                        (in a user turn, text such as <|im_end|> stays text, never a control\n"
      "                        token; with --no-chat such text is the token)\n"
      "  --prompt-mode M       pinned_in_budget (default) | pinned_on_top | compete: whether prompt\n"
      "                        tokens are kept outside rounds or compete with the rest (long documents)\n"
      "  --steps N             tokens to generate per sequence (default 256)\n"
      "  --temperature T       0 = greedy (default); > 0 samples softmax(logits / T), computed so\n"
      "                        that any finite T stays finite: a tiny T (1e-30) picks like greedy\n"
      "  --top-p P             nucleus sampling threshold (default 0.9; 1 = off)\n"
      "  --seed S              sampling seed (sequence i uses S + i)\n"
      "  --stats PATH          TriAttention statistics (.pt or .safetensors): compression on\n"
      "  --budget B            tokens kept per compression round (default 2048)\n"
      "  --divide-length D     compress when the cache reaches B + D (default 128)\n"
      "  --no-compress         ignore --stats' compression\n"
      "  --pruning MODE        per_head (default) | per_layer_per_head | union\n"
      "  --calibrate OUT       record pre-RoPE query statistics over the run, save to OUT\n"
      "                        (.safetensors: triattn's native format; .pt: TriAttention's layout)\n"
      "  --kv-dtype T          f32 (default) | bf16 | f16 | fp8 (e4m3 with --kv-scales; cpu and gpu)\n"
      "  --kv-scales LIST      fp8: dequantisation scales, comma-separated: 1 value (every layer's K\n"
      "                        and V), 2 (K, V of every layer) or 2 x layers (layer 0 K, layer 0 V,\n"
      "                        layer 1 K, ...); a stored code c means c * scale, values beyond\n"
      "                        +-448 * scale saturate (default: every scale 1). E.g. max |K| / 448\n"
      "                        per layer, as the fidelity harness calibrates them (--fp8-scales calib)\n"
      "  --block-size N        tokens per KV block (default 16)\n"
      "  --report-every N      status line every N decode steps (default 64; 0 = off)\n"
      "  --prefill-chunk N     prefill at most N prompt tokens per step (e.g. 512-2048; default 0:\n"
      "                        every prompt in one step)\n"
      "  --prompt-tokens N     keep the first N tokens of every encoded prompt (a shorter prompt is\n"
      "                        an error): prompts of an exact length for measurements\n"
      "  --json PATH           write the run's numbers (prefill and decode tok/s, KV live and\n"
      "                        resident at the end, gpu: device memory in use) to PATH as JSON\n"
      "  --quiet               do not stream the text\n"
      "  --device D            cpu (default) | gpu (needs a build with TRIATTN_ENABLE_CUDA=ON)\n"
      "  --weight-dtype T      gpu: f32 (default) | bf16 weight matrices\n"
      "  --no-graphs           gpu: launch every decode step kernel by kernel (no CUDA graphs)\n"
      "  --no-graph-buckets    gpu: capture a decode graph per batch size, not per power-of-two\n"
      "                        bucket (decode steps are then never padded)\n"
      "  --allocator A         gpu: vmm (default: KV pages mapped as used, returned after rounds) |\n"
      "                        static (one pool, all resident); --tp and --system-prompt use static\n"
      "  --tp N                tensor parallelism over N ranks (threads; gpu: devices 0..N-1, NCCL);\n"
      "                        N must divide the query heads, KV heads and MLP width (default 1)\n"
      "  --system-prompt TEXT  serve the prompts as requests that start with TEXT, through the prefix\n"
      "                        cache (cpu or gpu); --wave N requests arrive together (default 1);\n"
      "                        --no-prefix-cache computes every prompt token (same tokens)\n",
      TRIATTN_SHARED_DATA_DIR);
}

/// Largest --prompt-file: 64 MiB of text is millions of tokens, past any model's context.
constexpr std::uint64_t kMaxPromptFileBytes = std::uint64_t{64} << 20;

/// The bytes of a text file (--prompt-file): a regular file of at most kMaxPromptFileBytes (a
/// FIFO or device is refused without blocking or reading).
std::string read_text_file(const std::string& path) {
  return triattn::read_regular_file<std::string>(path, kMaxPromptFileBytes, "--prompt-file");
}

Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::runtime_error(std::string("option ") + argv[i] + " needs a value");
    return argv[++i];
  };
  // Strict numbers: the whole value must parse (no empty string, sign-only, spaces or trailing
  // text) and lie in the option's range; anything else is an error naming the option.
  auto to_int = [](const std::string& flag, const std::string& v, long long lo, long long hi) {
    return static_cast<int>(ex::parse_int_option(flag, v, lo, hi));
  };
  auto to_u64 = [](const std::string& flag, const std::string& v) {
    std::uint64_t x = 0;
    const char* end = v.data() + v.size();
    const auto [ptr, ec] = std::from_chars(v.data(), end, x);
    if (v.empty() || ec == std::errc::invalid_argument || ptr != end)
      throw std::runtime_error("option " + flag + ": '" + v + "' is not a non-negative integer");
    if (ec == std::errc::result_out_of_range)
      throw std::runtime_error("option " + flag + ": " + v + " is outside [0, 2^64 - 1]");
    return x;
  };
  auto to_float = [](const std::string& flag, const std::string& v) {
    float x = 0;
    const char* end = v.data() + v.size();
    const auto [ptr, ec] = std::from_chars(v.data(), end, x);
    if (v.empty() || ec != std::errc{} || ptr != end || !std::isfinite(x))
      throw std::runtime_error("option " + flag + ": '" + v + "' is not a finite number");
    return x;
  };
  constexpr long long kIntMax = 2147483647LL;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else if (a == "--model") o.model_path = need(i);
    else if (a == "--tokenizer") o.tokenizer_path = need(i);
    else if (a == "--synthetic") o.synthetic = need(i);
    else if (a == "--synthetic-layers") o.synthetic_layers = to_int(a, need(i), 1, ex::Llama2cLimits::kMaxLayers);
    else if (a == "--synthetic-vocab") o.synthetic_vocab = to_int(a, need(i), 1, ex::Llama2cLimits::kMaxVocab);
    else if (a == "--prompt") o.prompts.push_back(need(i));
    else if (a == "--prompt-file") o.prompts.push_back(read_text_file(need(i)));
    else if (a == "--no-chat") o.chat = false;
    else if (a == "--prompt-mode") o.prompt_mode = triattn::prompt_mode_from_string(need(i), "--prompt-mode");
    else if (a == "--steps") o.steps = to_int(a, need(i), 0, kIntMax);
    else if (a == "--temperature") o.temperature = to_float(a, need(i));
    else if (a == "--top-p") o.top_p = to_float(a, need(i));
    else if (a == "--seed") o.seed = to_u64(a, need(i));
    else if (a == "--budget") o.budget = to_int(a, need(i), 1, kIntMax);
    else if (a == "--divide-length") o.divide_length = to_int(a, need(i), 1, kIntMax);
    else if (a == "--stats") o.stats_path = need(i);
    else if (a == "--calibrate") o.calibrate_out = need(i);
    else if (a == "--no-compress") o.no_compress = true;
    else if (a == "--pruning") {
      const std::string v = need(i);
      if (v == "per_head") o.mode = triattn::PruningMode::kPerHead;
      else if (v == "per_layer_per_head") o.mode = triattn::PruningMode::kPerLayerPerHead;
      else if (v == "union") o.mode = triattn::PruningMode::kUnion;
      else throw std::runtime_error("--pruning: '" + v + "' is not per_head, per_layer_per_head or union");
    }
    else if (a == "--kv-dtype") {
      const std::string v = need(i);
      if (v == "f32") o.kv_dtype = triattn::DType::kF32;
      else if (v == "bf16") o.kv_dtype = triattn::DType::kBF16;
      else if (v == "f16") o.kv_dtype = triattn::DType::kF16;
      else if (v == "fp8") o.kv_dtype = triattn::DType::kFP8E4M3;
      else throw std::runtime_error("--kv-dtype: '" + v + "' is not f32, bf16, f16 or fp8");
    } else if (a == "--kv-scales") {
      o.kv_scales.clear();
      for (const std::string& item : ex::split_list(need(i))) {
        const float x = to_float(a, item);
        if (!(x > 0.0f)) throw std::runtime_error("option --kv-scales: '" + item + "' is not > 0");
        o.kv_scales.push_back(x);
      }
    } else if (a == "--block-size") o.block_size = to_int(a, need(i), 1, 1 << 16);
    else if (a == "--report-every") o.report_every = to_int(a, need(i), 0, kIntMax);
    else if (a == "--prefill-chunk") o.prefill_chunk = to_int(a, need(i), 0, kIntMax);
    else if (a == "--prompt-tokens") o.prompt_tokens = to_int(a, need(i), 1, kIntMax);
    else if (a == "--json") o.json_out = need(i);
    else if (a == "--quiet") o.quiet = true;
    else if (a == "--device") {
      o.device = need(i);
      if (o.device != "cpu" && o.device != "gpu") throw std::runtime_error("--device: '" + o.device + "' is not cpu or gpu");
    } else if (a == "--weight-dtype") {
      const std::string v = need(i);
      if (v == "f32") o.weights_bf16 = false;
      else if (v == "bf16") o.weights_bf16 = true;
      else throw std::runtime_error("--weight-dtype: '" + v + "' is not f32 or bf16");
    } else if (a == "--no-graphs") o.no_graphs = true;
    else if (a == "--no-graph-buckets") o.no_graph_buckets = true;
    else if (a == "--allocator") {
      const std::string v = need(i);
      if (v != "vmm" && v != "static") throw std::runtime_error("--allocator: '" + v + "' is not vmm or static");
      o.static_pool = v == "static";
    }
    else if (a == "--tp") o.tp = to_int(a, need(i), 1, 1024);
    else throw std::runtime_error("unknown option '" + a + "' (--help lists them)");
  }
  if (!o.tokenizer_path.empty() && ex::is_gguf_path(o.model_path))
    throw std::runtime_error("--tokenizer " + o.tokenizer_path + " with --model " + o.model_path +
                             ": a .gguf model uses the tokenizer in its file; drop --tokenizer");
  if (o.steps < 0) throw std::runtime_error("--steps must be >= 0");
  if (o.temperature < 0) throw std::runtime_error("--temperature must be >= 0");
  if (!(o.top_p > 0)) throw std::runtime_error("--top-p must be > 0");
  if (o.block_size <= 0) throw std::runtime_error("--block-size must be positive");
  if (!o.kv_scales.empty() && o.kv_dtype != triattn::DType::kFP8E4M3)
    throw std::runtime_error("--kv-scales applies to --kv-dtype fp8 only (the other dtypes store values unscaled)");
  if (o.tp < 1) throw std::runtime_error("--tp must be >= 1");
  if (o.tp > 1 && !o.calibrate_out.empty())
    throw std::runtime_error("--calibrate records the whole model's query heads; run it with --tp 1");
  if (!o.calibrate_out.empty() && !o.stats_path.empty())
    throw std::runtime_error("--calibrate and --stats exclude each other (calibration runs uncompressed)");
  if (o.device == "gpu" && !kHaveCuda)
    throw std::runtime_error(
        "--device gpu: this build has no CUDA support; reconfigure with -DTRIATTN_ENABLE_CUDA=ON on a machine with "
        "the CUDA toolkit (scripts/demo.sh does that when nvcc is present), or use --device cpu");
  if (o.device == "cpu" && (o.weights_bf16 || o.no_graphs || o.static_pool))
    throw std::runtime_error("--weight-dtype bf16, --no-graphs and --allocator apply to --device gpu only");
  if (o.prompts.empty()) o.prompts.emplace_back();
  return o;
}

/// Text <-> tokens: the llama2.c tokenizer or a GGUF model's BPE tokenizer when there is one,
/// else bytes (id = byte + 3).
struct TextCodec {
  std::optional<ex::Tokenizer> tok;
  std::optional<ex::BpeTokenizer> bpe;
  bool chat = true;  // bpe: wrap a prompt as a user turn of the chat template
  int vocab = 0;
  int bos = 1;

  /// Token ids of a prompt. bpe: bytes the vocabulary has no token for are left out, with one
  /// warning per prompt on stderr that counts them.
  [[nodiscard]] std::vector<int> encode(const std::string& text) const {
    if (tok) return tok->encode(text, true, false);
    if (bpe) {
      const ex::ChatMessage user{"user", text.empty() ? "Tell me a short story." : text};
      ex::BpeTokenizer::Encoded e = chat ? bpe->encode_chat(std::span<const ex::ChatMessage>(&user, 1)) : bpe->encode_counted(text);
      if (e.dropped_bytes > 0)
        std::fprintf(stderr, "warning: %zu byte(s) of the prompt have no token in the vocabulary and were left out\n",
                     e.dropped_bytes);
      if (bpe->add_bos() || e.ids.empty()) e.ids.insert(e.ids.begin(), bos);
      return std::move(e.ids);
    }
    std::vector<int> ids{bos};
    for (unsigned char c : text) ids.push_back(c + 3 < vocab ? c + 3 : c % vocab);
    return ids;
  }
  [[nodiscard]] std::string piece(int prev, int token) const {
    if (tok) return tok->decode_piece(prev, token);
    if (bpe) return bpe->decode_piece(token, false);
    const int byte = token - 3;  // synthetic models: printable bytes as text, anything else as <id>
    if ((byte >= 32 && byte < 127) || byte == '\n') return std::string(1, static_cast<char>(byte));
    return "<" + std::to_string(token) + ">";
  }
};

std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, unit[u]);
  return buf;
}

/// CacheConfig::kv_scales ([layers, 2 (K, V)]) from --kv-scales: one value for every K and V,
/// a (K, V) pair for every layer, or all 2 * layers values.
std::vector<float> expand_kv_scales(const std::vector<float>& given, int layers) {
  const std::size_t L = static_cast<std::size_t>(layers);
  if (given.empty() || given.size() == 2 * L) return given;
  if (given.size() != 1 && given.size() != 2)
    throw std::runtime_error("--kv-scales: " + std::to_string(given.size()) + " values; give 1 (every K and V), 2 (K, V of " +
                             "every layer) or 2 x " + std::to_string(layers) + " layers = " + std::to_string(2 * L) +
                             " (layer 0 K, layer 0 V, ...)");
  std::vector<float> s(2 * L);
  for (std::size_t l = 0; l < L; ++l) {
    s[2 * l] = given.front();
    s[2 * l + 1] = given.back();
  }
  return s;
}

/// The cache configuration for these prompts: every sequence gets the blocks it can ever need
/// (prompt + steps, or with compression the saw-tooth's peak max(prompt, B) + D + 1). fp8 caches
/// get --kv-scales (the same CacheConfig, so the same scales, for --device cpu and gpu).
triattn::CacheConfig make_cache_config(const ex::ModelConfig& mc, const std::vector<std::vector<int>>& prompts,
                                       const Options& o, bool compress) {
  triattn::CacheConfig cfg;
  cfg.model = mc.geometry();
  cfg.block_size = o.block_size;
  cfg.dtype = o.kv_dtype;
  cfg.kv_scales = expand_kv_scales(o.kv_scales, mc.n_layers);
  cfg.layout = triattn::KvLayout::kNHD;
  // One slot more than prompts: never used, it is the empty sequence the padding rows of
  // bucketed decode graphs attend to (decode_graphs.cuh); it holds no block.
  cfg.max_seqs = static_cast<int>(prompts.size()) + 1;
  std::int64_t total = 0, widest = 1;
  for (const auto& p : prompts) {
    std::int64_t peak = static_cast<std::int64_t>(p.size()) + o.steps;
    if (compress)
      peak = std::min<std::int64_t>(peak, std::max<std::int64_t>(static_cast<std::int64_t>(p.size()), o.budget) +
                                              o.divide_length + 1);
    const std::int64_t blocks = (peak + o.block_size - 1) / o.block_size + 1;
    total += blocks;
    widest = std::max(widest, blocks);
  }
  if (total > 0x7fffffffLL) throw std::runtime_error("the KV pool would need more than 2^31 blocks");
  cfg.num_blocks = static_cast<int>(total);
  cfg.max_blocks_per_seq = static_cast<int>(widest);
  return cfg;
}

template <class Cache>
void print_status(const Cache& cache, std::span<const ex::SequenceResult> res) {
  const triattn::MemoryStats m = cache.memory();
  std::fprintf(stderr, "  KV: %zu/%zu blocks used (%s in used blocks, %s live, %s resident)\n", m.blocks_used,
               m.blocks_total, human_bytes(static_cast<double>(m.bytes_in_used_blocks)).c_str(),
               human_bytes(static_cast<double>(m.bytes_live)).c_str(),
               human_bytes(static_cast<double>(m.bytes_resident)).c_str());
  for (std::size_t i = 0; i < res.size(); ++i) {
    const ex::SequenceResult& r = res[i];
    if (!cache.is_active(r.seq)) continue;
    std::fprintf(stderr, "  seq %zu: cached %d / logical %lld tokens, %d compression round(s), %lld evicted\n", i,
                 cache.physical_length(r.seq), static_cast<long long>(cache.logical_position(r.seq)),
                 r.compression_rounds, static_cast<long long>(r.tokens_evicted));
  }
}

/// JSON text of a string (quotes, backslashes and control characters escaped).
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') out += {'\\', static_cast<char>(c)};
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  return out + "\"";
}

/// --json: the run's numbers as one JSON object (written atomically), read at the end of the
/// run with the sequences still open: prefill and decode rates, the KV cache's live and resident
/// bytes, and on the GPU the device memory in use (cudaMemGetInfo) and the CUDA-graph counts.
template <class ModelT, class Cache>
void write_run_json(const Options& o, ModelT& model, const Cache& cache, std::size_t prompts,
                    const ex::GenerationStats& st, std::int64_t generated, double total_s) {
  constexpr bool kCompress = !std::is_same_v<typename Cache::scorer_type, triattn::NoScorer>;
  const triattn::MemoryStats m = cache.memory();
  auto rate = [](double n, double s) { return s > 0 ? n / s : 0.0; };
  std::vector<std::pair<std::string, std::string>> f;  // key, JSON value
  auto num = [&](const char* k, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    f.emplace_back(k, buf);
  };
  f.emplace_back("model", json_string(model.full_config().name));
  f.emplace_back("backend", json_string(ModelT::backend_type::kName));
  f.emplace_back("kv_dtype", json_string(triattn::dtype_name(cache.config().dtype)));
  f.emplace_back("compression", kCompress ? "true" : "false");
  num("budget", kCompress ? o.budget : 0);
  num("divide_length", kCompress ? o.divide_length : 0);
  num("prompts", static_cast<double>(prompts));
  num("prefill_chunk", o.prefill_chunk);
  num("prefill_tokens", static_cast<double>(st.prefill_tokens));
  num("prefill_seconds", st.prefill_seconds);
  num("prefill_tok_s", rate(static_cast<double>(st.prefill_tokens), st.prefill_seconds));
  num("decode_tokens", static_cast<double>(st.decode_tokens));
  num("decode_steps", st.decode_steps);
  num("decode_seconds", st.decode_seconds);
  num("decode_tok_s", rate(static_cast<double>(st.decode_tokens), st.decode_seconds));
  // Where a decode step's time goes (per step, milliseconds): host time in Model::forward
  // (recording and launching), host time from there to the tokens (waiting for the device,
  // copies, sampling), and on the GPU the device time from the step's first launch to its
  // tokens on the host (CUDA events).
  const double steps = st.decode_steps > 0 ? static_cast<double>(st.decode_steps) : 1.0;
  num("decode_ms_per_step", 1e3 * st.decode_seconds / steps);
  num("decode_forward_host_ms_per_step", 1e3 * st.decode_forward_seconds / steps);
  num("decode_wait_sample_ms_per_step", 1e3 * st.decode_sample_seconds / steps);
  if (st.decode_device_seconds >= 0) num("decode_device_ms_per_step", 1e3 * st.decode_device_seconds / steps);
  num("decode_device_argmax_steps", st.decode_device_argmax_steps);
  num("compress_seconds", st.compress_seconds);
  num("generated_tokens", static_cast<double>(generated));
  num("total_seconds", total_s);
  num("kv_bytes_live", static_cast<double>(m.bytes_live));
  num("kv_bytes_in_used_blocks", static_cast<double>(m.bytes_in_used_blocks));
  num("kv_bytes_resident", static_cast<double>(m.bytes_resident));
  num("kv_resident_over_live", m.bytes_live > 0 ? static_cast<double>(m.bytes_resident) / static_cast<double>(m.bytes_live) : 0.0);
  num("kv_blocks_used", static_cast<double>(m.blocks_used));
  num("kv_blocks_total", static_cast<double>(m.blocks_total));
  if constexpr (requires { cache.allocator().stats().counters.blocks_relocated; }) {
    // The VMM pool: its unit of mapping (a slab: whole blocks over every layer's K and V ranges),
    // how many are mapped now, and what trims and relocations did over the run.
    const auto vs = cache.allocator().stats();
    num("kv_vmm_slab_bytes", static_cast<double>(vs.slab_bytes));
    num("kv_vmm_blocks_per_slab", vs.blocks_per_slab);
    num("kv_vmm_slabs_mapped", static_cast<double>(vs.slabs_mapped));
    num("kv_vmm_bytes_pending", static_cast<double>(vs.bytes_pending));
    num("kv_vmm_pages_mapped", static_cast<double>(vs.counters.pages_mapped));
    num("kv_vmm_pages_unmapped", static_cast<double>(vs.counters.pages_unmapped));
    num("kv_vmm_slabs_unmapped", static_cast<double>(vs.counters.slabs_unmapped));
    num("kv_vmm_trims", static_cast<double>(vs.counters.trims));
    num("kv_vmm_relocations", static_cast<double>(vs.counters.relocations));
    num("kv_vmm_blocks_relocated", static_cast<double>(vs.counters.blocks_relocated));
    num("kv_vmm_slabs_evacuated", static_cast<double>(vs.counters.slabs_evacuated));
  }
#if defined(TRIATTN_EXAMPLE_CUDA)
  if constexpr (std::is_same_v<typename ModelT::backend_type, ex::CudaBackend>) {
    model.backend().synchronize();
    const auto bs = model.backend().stats();
    f.emplace_back("weights", json_string(ex::weight_type_name(model.backend().options().weights)));
    f.emplace_back("allocator", json_string(o.static_pool ? "static" : "vmm"));
    num("device_memory_used_bytes", static_cast<double>(ex::device_memory_used()));
    num("graph_captures", static_cast<double>(bs.graph_captures));
    num("graph_replays", static_cast<double>(bs.graph_replays));
    num("graph_padded_steps", static_cast<double>(bs.padded_steps));
  }
#endif
  std::string text = "{\n";
  for (std::size_t i = 0; i < f.size(); ++i)
    text += "  " + json_string(f[i].first) + ": " + f[i].second + (i + 1 < f.size() ? ",\n" : "\n");
  text += "}\n";
  triattn::write_file_atomically(o.json_out, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()), "--json");
  std::fprintf(stderr, "numbers written to %s\n", o.json_out.c_str());
}

/// Tensor parallelism: which rank run() is, and where it leaves its KV memory at the end.
struct RankSlot {
  int rank = 0;
  std::vector<triattn::MemoryStats>* kv = nullptr;  // [tp] one entry per rank
};

template <class Cache, class ModelT>
int run(ModelT& model, Cache& cache, const TextCodec& codec, const std::vector<std::vector<int>>& prompts,
        const Options& o_in, triattn::Calibrator* calibrator, ex::CompressFn compress_fn = {}, RankSlot rank = {}) {
  constexpr bool kCompress = !std::is_same_v<typename Cache::scorer_type, triattn::NoScorer>;
  // Every rank generates the same tokens; only rank 0 talks.
  Options o = o_in;
  if (rank.rank != 0) {
    o.quiet = true;
    o.report_every = 0;
  }
  const bool speak = rank.rank == 0;
  const bool stream = !o.quiet && prompts.size() == 1;
  std::vector<ex::Sampler> samplers;
  for (std::size_t i = 0; i < prompts.size(); ++i) samplers.emplace_back(o.temperature, o.top_p, o.seed + i);

  if (calibrator != nullptr)
    model.set_query_observer([&](int layer, const float* q, int n) { calibrator->add(layer, q, n); });

  std::vector<int> prev(prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i) prev[i] = prompts[i].back();

  if (stream) {
    std::string shown;
    if (codec.bpe) shown = codec.piece(-1, prompts[0][0]);  // no BOS to skip
    for (std::size_t t = 1; t < prompts[0].size(); ++t) shown += codec.piece(prompts[0][t - 1], prompts[0][t]);
    std::printf("%s", shown.c_str());
    std::fflush(stdout);
  }

  ex::GenerationOptions go;
  go.max_new_tokens = o.steps;
  go.stop_at_bos = codec.tok.has_value();  // llama2.c ends a story at BOS; a random model would stop anywhere
  go.stop_at_eos = codec.bpe.has_value();  // a chat model ends its turn with EOS (<|im_end|>)
  go.prefill_chunk = o.prefill_chunk;
  ex::GenerationCallbacks cb;
  cb.on_token = [&](int i, int token, std::int64_t, std::span<const float>) {
    if (stream && token != model.config().bos_id) {
      std::printf("%s", codec.piece(prev[static_cast<std::size_t>(i)], token).c_str());
      std::fflush(stdout);
    }
    prev[static_cast<std::size_t>(i)] = token;
  };
  cb.token_logits = false;  // greedy decode steps then copy only the token ids from the GPU
  if constexpr (kCompress) {
    // After every step: a TriAttention round for each sequence whose cache reached B + D.
    if (compress_fn) cb.after_step = compress_fn;
    else cb.after_step = [&](std::span<const triattn::SeqId> live) { return cache.compress_if_needed(live); };
  }
  auto t_start = std::chrono::steady_clock::now();
  auto t_last = t_start;
  std::int64_t tokens_last = 0;
  ex::GenerationStats st;
  cb.on_step = [&](int step, std::span<const ex::SequenceResult> results) {
    if (o.report_every <= 0 || step % o.report_every != 0) return;
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - t_last).count();
    const double tps = dt > 0 ? static_cast<double>(st.decode_tokens - tokens_last) / dt : 0.0;
    t_last = now;
    tokens_last = st.decode_tokens;
    std::fprintf(stderr, "\n[decode step %d] %.1f tok/s\n", step, tps);
    print_status(cache, results);
  };

  std::vector<ex::SequenceResult> res = ex::generate(model, cache, std::span<const std::vector<int>>(prompts),
                                                     std::span<ex::Sampler>(samplers), go, cb, &st);
  // An elastic pool: the last step's trim unmaps once the stream passed it; wait for it so that
  // the resident bytes reported below are what the driver holds.
  if constexpr (requires { cache.allocator().synchronize(); }) cache.allocator().synchronize();
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (stream) std::printf("\n");
  if (rank.kv != nullptr) (*rank.kv)[static_cast<std::size_t>(rank.rank)] = cache.memory();
  if (!speak) {
    for (const auto& r : res) cache.release(r.seq);
    return 0;
  }

  if (!o.quiet && prompts.size() > 1) {
    for (std::size_t i = 0; i < res.size(); ++i) {
      std::string text;
      for (std::size_t t = 1; t < prompts[i].size(); ++t) text += codec.piece(prompts[i][t - 1], prompts[i][t]);
      int p = prompts[i].back();
      for (int t : res[i].generated) {
        text += codec.piece(p, t);
        p = t;
      }
      std::printf("--- sequence %zu ---\n%s\n", i, text.c_str());
    }
  }

  std::fprintf(stderr, "\n=== summary ===\n");
  const ex::ModelConfig& full = model.full_config();
  std::fprintf(stderr, "model %s (%d layers, dim %d, %d q / %d kv heads, d %d, vocab %d), backend %s, KV %s\n",
               full.name.c_str(), full.n_layers, full.dim, full.n_heads, full.n_kv_heads, full.head_dim,
               full.vocab_size, ModelT::backend_type::kName, triattn::dtype_name(cache.config().dtype));
  if (cache.config().dtype == triattn::DType::kFP8E4M3) {
    const std::vector<float>& sc = cache.config().kv_scales;
    if (sc.empty()) std::fprintf(stderr, "fp8 scales: 1 (no --kv-scales)\n");
    else
      std::fprintf(stderr, "fp8 scales (--kv-scales): %zu values [layer, K|V] from %g to %g\n", sc.size(),
                   static_cast<double>(*std::min_element(sc.begin(), sc.end())),
                   static_cast<double>(*std::max_element(sc.begin(), sc.end())));
  }
  if (model.tp().size > 1)
    std::fprintf(stderr, "tensor parallel: %d ranks, each %d q / %d kv heads and %d of %d MLP columns (KV below: rank 0)\n",
                 model.tp().size, model.config().n_heads, model.config().n_kv_heads, model.config().hidden_dim,
                 full.hidden_dim);
  std::fprintf(stderr, "compression: %s\n",
               kCompress ? ("TriAttention, budget " + std::to_string(o.budget) + ", divide_length " +
                            std::to_string(o.divide_length))
                               .c_str()
                         : "off");
  std::int64_t generated = 0;
  for (std::size_t i = 0; i < res.size(); ++i) {
    const auto& r = res[i];
    generated += static_cast<std::int64_t>(r.generated.size());
    std::fprintf(stderr,
                 "seq %zu: prompt %zu tokens, generated %zu%s, cached %d / logical %lld, %d round(s), %lld evicted\n", i,
                 r.prompt.size(), r.generated.size(), r.stop_token >= 0 ? " (stopped at BOS/EOS)" : "",
                 cache.physical_length(r.seq), static_cast<long long>(cache.logical_position(r.seq)),
                 r.compression_rounds, static_cast<long long>(r.tokens_evicted));
  }
  std::fprintf(stderr, "prefill: %lld tokens in %.3f s (%.1f tok/s)\n", static_cast<long long>(st.prefill_tokens),
               st.prefill_seconds, st.prefill_seconds > 0 ? static_cast<double>(st.prefill_tokens) / st.prefill_seconds : 0.0);
  std::fprintf(stderr, "decode: %lld tokens in %d steps, %.3f s (%.1f tok/s); compression %.3f s\n",
               static_cast<long long>(st.decode_tokens), st.decode_steps, st.decode_seconds,
               st.decode_seconds > 0 ? static_cast<double>(st.decode_tokens) / st.decode_seconds : 0.0,
               st.compress_seconds);
  if (st.decode_steps > 0) {
    const double per = 1e3 / st.decode_steps;
    std::fprintf(stderr, "decode step: %.3f ms = forward (host) %.3f + wait and sample %.3f + loop %.3f", st.decode_seconds * per,
                 st.decode_forward_seconds * per, st.decode_sample_seconds * per,
                 (st.decode_seconds - st.decode_forward_seconds - st.decode_sample_seconds) * per);
    if (st.decode_device_seconds >= 0) std::fprintf(stderr, "; device %.3f ms", st.decode_device_seconds * per);
    std::fprintf(stderr, "; %d of %d steps sampled by a device argmax\n", st.decode_device_argmax_steps, st.decode_steps);
  }
  std::fprintf(stderr, "total: %lld tokens generated in %.3f s\n", static_cast<long long>(generated), total_s);
#if defined(TRIATTN_EXAMPLE_CUDA)
  if constexpr (std::is_same_v<typename ModelT::backend_type, ex::CudaBackend>) {
    const auto bs = model.backend().stats();
    std::fprintf(stderr, "gpu: %s weights, CUDA graphs %s: %llu captured, %llu steps replayed, %llu eager flushes\n",
                 ex::weight_type_name(model.backend().options().weights), model.backend().options().graphs ? "on" : "off",
                 static_cast<unsigned long long>(bs.graph_captures), static_cast<unsigned long long>(bs.graph_replays),
                 static_cast<unsigned long long>(bs.eager_flushes));
  }
#endif
  print_status(cache, std::span<const ex::SequenceResult>(res));
  if (!o.json_out.empty()) write_run_json(o, model, cache, prompts.size(), st, generated, total_s);

  if (calibrator != nullptr) {
    const std::string& out = o.calibrate_out;
    if (out.size() > 3 && out.substr(out.size() - 3) == ".pt")
      triattn::save_pt_stats(out, calibrator->finish());  // TriAttention's official layout
    else
      calibrator->save(out);  // triattn's native safetensors format
    std::fprintf(stderr, "calibration: %lld tokens per layer, statistics written to %s\n",
                 static_cast<long long>(calibrator->token_count(0)), o.calibrate_out.c_str());
  }
  for (const auto& r : res) cache.release(r.seq);
  return 0;
}

/// A GGUF model's llama.context_length bounds each sequence: its prompt and the --steps tokens
/// generated after it must fit, or positions past the trained context would be run silently.
void check_context_length(const std::vector<std::vector<int>>& prompts, int steps, const ex::ModelConfig& mc) {
  const std::int64_t ctx = mc.max_seq_len;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto n = static_cast<std::int64_t>(prompts[i].size());
    const std::string which = "prompt " + std::to_string(i) + " (" + std::to_string(n) + " tokens)";
    const std::string limit = "the context length " + std::to_string(ctx) + " of " + mc.name + " (llama.context_length)";
    if (n > ctx) throw std::runtime_error(which + " is longer than " + limit);
    if (n + steps > ctx)
      throw std::runtime_error(which + " and --steps " + std::to_string(steps) + " need " + std::to_string(n + steps) +
                               " positions, more than " + limit + "; use --steps " + std::to_string(ctx - n) + " or less");
  }
}

/// The compression rounds' selection: --budget, --divide-length, --pruning.
triattn::SelectionParams selection_params(const Options& o) {
  triattn::SelectionParams sel;
  sel.budget = o.budget;
  sel.divide_length = o.divide_length;
  sel.mode = o.mode;
  sel.prompt = o.prompt_mode;
  return sel;
}

#if defined(TRIATTN_EXAMPLE_CUDA)
/// @throws std::runtime_error when no CUDA device can be used.
void require_gpu() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("--device gpu: no usable CUDA device (") + cudaGetErrorString(e) + ")");
  }
}

/// --weight-dtype, --no-graphs, --no-graph-buckets.
ex::CudaBackendOptions backend_options(const Options& o) {
  ex::CudaBackendOptions bo;
  bo.weights = o.weights_bf16 ? ex::WeightType::kBF16 : ex::WeightType::kF32;
  bo.graphs = !o.no_graphs;
  bo.graph_buckets = !o.no_graph_buckets;
  return bo;
}

/// GPU compression needs triattn's scoring kernels for the model's head_dim.
void check_gpu_head_dim(const ex::ModelConfig& mc) {
  if (!triattn::cuda::is_supported_head_dim(mc.head_dim))
    throw std::runtime_error("--device gpu with --stats: the GPU scoring kernels are compiled for head_dim 64 and 128, " +
                             mc.name + " has head_dim " + std::to_string(mc.head_dim) +
                             " (compress on the CPU with --device cpu, or run without --stats)");
}

/// The GPU path: Model<CudaBackend>, the cache in device memory (VMM pages, or a static pool with
/// --allocator static), TriAttention rounds on the device. After the summary: device memory in
/// use (cudaMemGetInfo) now and at its peak after a step's rounds, and the KV pool's resident bytes.
template <class PlainT, class TriT>
int run_gpu_with(const Options& o, ex::Model<ex::CudaBackend>& model, ex::CudaBackend& backend, const TextCodec& codec,
                 const std::vector<std::vector<int>>& prompts, const triattn::CacheConfig& cfg, bool compress,
                 triattn::Calibrator* calibrator) {
  constexpr bool kVmm = std::is_same_v<typename PlainT::allocator_type, triattn::cuda::VmmAllocator>;
  const ex::ModelConfig& mc = model.config();
  std::size_t peak_used = ex::device_memory_used();
  auto report = [&](const auto& cache) {
    backend.synchronize();
    const std::size_t used = ex::device_memory_used();
    std::fprintf(stderr, "device memory (cudaMemGetInfo): %s in use at the end, peak %s after a step; KV %s resident (%s)\n",
                 human_bytes(static_cast<double>(used)).c_str(),
                 human_bytes(static_cast<double>(std::max(peak_used, used))).c_str(),
                 human_bytes(static_cast<double>(cache.memory().bytes_resident)).c_str(),
                 kVmm ? "VMM: mapped pages" : "static pool");
    if constexpr (kVmm) {
      const auto vs = cache.allocator().stats();
      std::fprintf(stderr, "VMM: %zu slabs of %s mapped; %llu slabs unmapped by %llu trims; %llu blocks relocated in %llu "
                           "passes, emptying %llu slabs\n",
                   vs.slabs_mapped, human_bytes(static_cast<double>(vs.slab_bytes)).c_str(),
                   static_cast<unsigned long long>(vs.counters.slabs_unmapped), static_cast<unsigned long long>(vs.counters.trims),
                   static_cast<unsigned long long>(vs.counters.blocks_relocated),
                   static_cast<unsigned long long>(vs.counters.relocations),
                   static_cast<unsigned long long>(vs.counters.slabs_evacuated));
    }
  };
  if (!compress) {
    PlainT cache(cfg, triattn::cuda::DeviceCompactor(backend.stream()));
    const int rc = run(model, cache, codec, prompts, o, calibrator);
    report(cache);
    return rc;
  }
  check_gpu_head_dim(mc);
  const triattn::QueryStats stats = ex::load_stats(o.stats_path, mc);
  TriT cache(cfg, triattn::cuda::DeviceCompactor(backend.stream()),
             triattn::cuda::TriAttentionDeviceScorer(stats, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads,
                                                     backend.stream()),
             triattn::TopKSelector(selection_params(o)));
  triattn::cuda::DeviceRounds<TriT> rounds(cache);  // score, select and compact on the device, one batch per step
  const int rc = run(model, cache, codec, prompts, o, nullptr, [&](std::span<const triattn::SeqId> live) {
    auto done = rounds.compress_if_needed_and_wait(live, backend.stream());
    if constexpr (kVmm) {
      // Compaction keeps each sequence's first blocks, so a round leaves survivors of a few
      // sequences in every slab: move them into fuller slabs (device copies on the stream), then
      // give the emptied slabs back once the stream passes them. Empty slabs stay mapped for
      // regrowth only up to 5% of the live KV (at most two), so resident stays within 1.1x of live.
      if (!done.empty()) (void)cache.relocate_blocks();
      const std::size_t slab = cache.allocator().stats().slab_bytes;
      (void)cache.allocator().trim(backend.stream(), std::min(2 * slab, cache.memory().bytes_live / 20));
    }
    peak_used = std::max(peak_used, ex::device_memory_used());
    return done;
  });
  report(cache);
  return rc;
}

int run_gpu(const Options& o, const ex::ModelWeights& weights, const TextCodec& codec,
            const std::vector<std::vector<int>>& prompts, const triattn::CacheConfig& cfg, bool compress,
            triattn::Calibrator* calibrator) {
  require_gpu();
  ex::CudaBackend backend(backend_options(o));
  ex::Model<ex::CudaBackend> model(weights, backend);
  if (o.static_pool)
    return run_gpu_with<ex::GpuPlainCache, ex::GpuTriCache>(o, model, backend, codec, prompts, cfg, compress, calibrator);
  return run_gpu_with<ex::GpuVmmPlainCache, ex::GpuVmmTriCache>(o, model, backend, codec, prompts, cfg, compress,
                                                               calibrator);
}
#endif

/// After a tensor-parallel run: what each rank's cache holds.
void print_rank_kv(const std::vector<triattn::MemoryStats>& kv) {
  std::fprintf(stderr, "per-rank KV (each rank caches its own KV heads of every token):\n");
  for (std::size_t r = 0; r < kv.size(); ++r)
    std::fprintf(stderr, "  rank %zu: %s live, %s in used blocks, %s resident, %lld cached / %lld logical tokens\n", r,
                 human_bytes(static_cast<double>(kv[r].bytes_live)).c_str(),
                 human_bytes(static_cast<double>(kv[r].bytes_in_used_blocks)).c_str(),
                 human_bytes(static_cast<double>(kv[r].bytes_resident)).c_str(),
                 static_cast<long long>(kv[r].cached_tokens), static_cast<long long>(kv[r].logical_tokens));
}

/// Rank `rank`'s share of the statistics (its query heads), checked against its geometry.
triattn::QueryStats rank_stats(const triattn::QueryStats& full, const ex::ModelConfig& mc, int rank, int tp) {
  const triattn::tp::TpGeometry geo(tp, rank, mc.geometry());
  triattn::QueryStats s = triattn::slice_for_rank(full, rank, tp, mc.n_kv_heads);
  triattn::tp::check_stats_for_rank(s, geo);
  return s;
}

/// The CPU path with --tp N: N ranks in N threads, all-reduce through a ThreadTeamCollective.
int run_cpu_tp(const Options& o, const ex::ModelWeights& weights, const TextCodec& codec,
               const std::vector<std::vector<int>>& prompts, bool compress) {
  const ex::ModelConfig& mc = weights.config;
  ex::check_tp(mc, ex::TpRank{0, o.tp});  // before the threads start: a bad split fails here, once
  triattn::QueryStats stats;
  if (compress) stats = ex::load_stats(o.stats_path, mc);
  triattn::tp::ThreadTeam team(o.tp);
  std::vector<triattn::MemoryStats> kv(static_cast<std::size_t>(o.tp));
  ex::run_ranks(o.tp, [&](int r) {
    triattn::tp::ThreadTeamCollective comm(team, r);
    ex::Model<ex::CpuBackend> model(weights, ex::TpRank{r, o.tp}, ex::cpu_backend_for(comm));
    const ex::ModelConfig& local = model.config();
    const triattn::CacheConfig cfg = make_cache_config(local, prompts, o, compress);  // this rank's KV heads
    if (!compress) {
      PlainCache cache(cfg);
      (void)run(model, cache, codec, prompts, o, nullptr, {}, RankSlot{r, &kv});
      return;
    }
    const triattn::RopeConfig rope = ex::rope_config(mc);
    const triattn::SelectionParams sel = selection_params(o);
    TpTriCache cache(cfg, triattn::TriAttentionScorer(rank_stats(stats, mc, r, o.tp), rope, triattn::ScoringParams{},
                                                      local.n_kv_heads),
                     triattn::TensorParallelTopKSelector<triattn::tp::ThreadTeamCollective>(
                         sel, comm, triattn::tp::TpGeometry(o.tp, r, mc.geometry())));
    (void)run(model, cache, codec, prompts, o, nullptr, {}, RankSlot{r, &kv});
  });
  print_rank_kv(kv);
  return 0;
}

#if defined(TRIATTN_EXAMPLE_CUDA)
/// The GPU path with --tp N: rank r on device r, all-reduces and union agreement over NCCL.
int run_gpu_tp(const Options& o, const ex::ModelWeights& weights, const TextCodec& codec,
               const std::vector<std::vector<int>>& prompts, bool compress) {
  const ex::ModelConfig& mc = weights.config;
  ex::check_tp(mc, ex::TpRank{0, o.tp});  // before any thread or communicator exists
  if (compress) check_gpu_head_dim(mc);
  triattn::QueryStats stats;
  if (compress) stats = ex::load_stats(o.stats_path, mc);
  std::vector<triattn::MemoryStats> kv(static_cast<std::size_t>(o.tp));
  ex::run_gpu_ranks(o.tp, [&](int r, triattn::cuda::NcclCommunicator& comm) {
    ex::CudaBackend backend(backend_options(o));
    ex::attach_nccl(backend, comm);
    ex::Model<ex::CudaBackend> model(weights, ex::TpRank{r, o.tp}, backend);
    const ex::ModelConfig& local = model.config();
    const triattn::CacheConfig cfg = make_cache_config(local, prompts, o, compress);  // this rank's KV heads
    if (!compress) {
      ex::GpuPlainCache cache(cfg, triattn::cuda::DeviceCompactor(backend.stream()));
      (void)run(model, cache, codec, prompts, o, nullptr, {}, RankSlot{r, &kv});
      return;
    }
    const triattn::RopeConfig rope = ex::rope_config(mc);
    const triattn::SelectionParams sel = selection_params(o);
    ex::GpuTriCache cache(cfg, triattn::cuda::DeviceCompactor(backend.stream()),
                          triattn::cuda::TriAttentionDeviceScorer(rank_stats(stats, mc, r, o.tp), rope,
                                                                  triattn::ScoringParams{}, local.n_kv_heads,
                                                                  backend.stream()),
                          triattn::TopKSelector(sel));
    ex::DeviceRounds rounds(cache);
    ex::attach_nccl(rounds, comm);  // union: one keep set for every rank
    (void)run(model, cache, codec, prompts, o, nullptr,
              [&](std::span<const triattn::SeqId> live) {
                return rounds.compress_if_needed_and_wait(live, backend.stream());
              },
              RankSlot{r, &kv});
  });
  print_rank_kv(kv);
  return 0;
}
#endif

/// --system-prompt: serves the prompts as requests in waves with the prefix cache
/// (serve_shared.hpp) on `cache`, prints the generated text and the serving report.
template <class ModelT, class Cache, class Compress>
int serve(const Options& o, const ex::ServeArgs& serve, ModelT& model, Cache& cache, const TextCodec& codec,
          const std::vector<std::vector<int>>& prompts, const Compress& compress) {
  std::vector<ex::Sampler> samplers;
  for (std::size_t i = 0; i < prompts.size(); ++i) samplers.emplace_back(o.temperature, o.top_p, o.seed + i);
  ex::GenerationOptions go;
  go.max_new_tokens = o.steps;
  go.stop_at_bos = codec.tok.has_value();
  go.prefill_chunk = o.prefill_chunk;
  const ex::ServeReport rep = ex::serve_shared(model, cache, std::span<const std::vector<int>>(prompts),
                                               std::span<ex::Sampler>(samplers), go, serve.prefix_cache, serve.wave, compress);
  if (!o.quiet)
    for (std::size_t i = 0; i < rep.requests.size(); ++i) {
      std::string text;
      int p = prompts[i].back();
      for (int t : rep.requests[i].generated) {
        text += codec.piece(p, t);
        p = t;
      }
      std::printf("--- request %zu ---\n%s\n", i, text.c_str());
    }
  ex::print_serve_report(rep, serve.prefix_cache);
  return 0;
}

/// --system-prompt on the CPU: a host KvCache over a PrefixCachingAllocator.
int run_serve_cpu(const Options& o, const ex::ServeArgs& sa, const ex::ModelWeights& weights, const TextCodec& codec,
                  const std::vector<std::vector<int>>& prompts, const triattn::CacheConfig& cfg, bool compress) {
  using Alloc = triattn::PrefixCachingAllocator<triattn::StaticAllocator<triattn::HostBackend>>;
  ex::Model<ex::CpuBackend> model(weights);
  if (!compress) {
    triattn::KvCache<Alloc, triattn::HostCompactor> cache(cfg);
    return serve(o, sa, model, cache, codec, prompts, ex::CompressFn{});
  }
  const triattn::QueryStats stats = ex::load_stats(o.stats_path, weights.config);
  triattn::KvCache<Alloc, triattn::HostCompactor, triattn::TriAttentionScorer, triattn::TopKSelector> cache(
      cfg, triattn::TriAttentionScorer(stats, ex::rope_config(weights.config), triattn::ScoringParams{}, weights.config.n_kv_heads),
      triattn::TopKSelector(selection_params(o)));
  return serve(o, sa, model, cache, codec, prompts,
               ex::CompressFn([&](std::span<const triattn::SeqId> live) { return cache.compress_if_needed(live); }));
}

#if defined(TRIATTN_EXAMPLE_CUDA)
/// --system-prompt on the GPU: the device pool behind a PrefixCachingAllocator, rounds on the
/// device (cuda::DeviceRounds protects each request's shared prefix). Prints the device memory
/// in use around the run (cudaMemGetInfo) after the serving report.
int run_serve_gpu(const Options& o, const ex::ServeArgs& sa, const ex::ModelWeights& weights, const TextCodec& codec,
                  const std::vector<std::vector<int>>& prompts, const triattn::CacheConfig& cfg, bool compress) {
  require_gpu();
  ex::CudaBackend backend(backend_options(o));
  ex::Model<ex::CudaBackend> model(weights, backend);
  const ex::ModelConfig& mc = model.config();
  auto report_memory = [](const char* when) {
    std::size_t free_b = 0, total_b = 0;
    TRIATTN_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    std::fprintf(stderr, "device memory %s: %s in use of %s\n", when, human_bytes(static_cast<double>(total_b - free_b)).c_str(),
                 human_bytes(static_cast<double>(total_b)).c_str());
  };
  if (!compress) {
    ex::GpuPrefixPlainCache cache(cfg, triattn::cuda::DeviceCompactor(backend.stream()));
    const int rc = serve(o, sa, model, cache, codec, prompts, ex::CompressFn{});
    report_memory("after serving (weights, activations and the KV pool)");
    return rc;
  }
  check_gpu_head_dim(mc);
  const triattn::QueryStats stats = ex::load_stats(o.stats_path, mc);
  ex::GpuPrefixTriCache cache(cfg, triattn::cuda::DeviceCompactor(backend.stream()),
                              triattn::cuda::TriAttentionDeviceScorer(stats, ex::rope_config(mc), triattn::ScoringParams{},
                                                                      mc.n_kv_heads, backend.stream()),
                              triattn::TopKSelector(selection_params(o)));
  triattn::cuda::DeviceRounds<ex::GpuPrefixTriCache> rounds(cache);
  const int rc = serve(o, sa, model, cache, codec, prompts, ex::CompressFn([&](std::span<const triattn::SeqId> live) {
                         return rounds.compress_if_needed_and_wait(live, backend.stream());
                       }));
  report_memory("after serving (weights, activations and the KV pool)");
  return rc;
}
#endif

int real_main(int argc, char** argv) {
  const ex::ServeArgs serve = ex::take_serve_args(argc, argv);  // --system-prompt, --wave, --no-prefix-cache
  const Options o = parse_args(argc, argv);
  const std::string data_dir = TRIATTN_SHARED_DATA_DIR;
  // The output path is checked now, not after the run: a FIFO or a missing directory fails fast.
  if (!o.calibrate_out.empty()) triattn::check_write_target(o.calibrate_out, "--calibrate");
  if (!o.json_out.empty()) triattn::check_write_target(o.json_out, "--json");

  ex::ModelWeights weights;
  TextCodec codec;
  std::string shape = o.synthetic;
  if (shape.empty()) {
    const std::string path = o.model_path.empty() ? data_dir + "/models/stories260K.bin" : o.model_path;
    if (o.model_path.empty() && !std::filesystem::exists(path)) {
      std::fprintf(stderr, "note: %s not found; using the synthetic 'tiny' model\n", path.c_str());
      shape = "tiny";
    } else if (ex::is_gguf_path(path)) {
      const ex::gguf::File file = ex::gguf::File::load(path);
      weights = ex::gguf_llama_weights(file);
      codec.bpe = ex::BpeTokenizer::from_gguf(file);
      codec.chat = o.chat;
    } else {
      weights = ex::load_llama2c_checkpoint(path);
      const std::string tok_path = !o.tokenizer_path.empty()
                                       ? o.tokenizer_path
                                       : (std::filesystem::path(path).parent_path() / "tok512.bin").string();
      codec.tok = ex::Tokenizer::load(tok_path, weights.config.vocab_size);
    }
  }
  if (!shape.empty()) {
    const ex::ModelConfig c = ex::synthetic_config(shape, o.synthetic_layers, o.synthetic_vocab);
    constexpr std::size_t kCpuLimit = std::size_t{8} << 30;
    constexpr std::size_t kGpuLimit = std::size_t{64} << 30;  // host float32 copy made before the upload
    if (o.device == "cpu" && ex::weight_bytes(c) > kCpuLimit)
      throw std::runtime_error("synthetic '" + shape + "' needs " + human_bytes(static_cast<double>(ex::weight_bytes(c))) +
                               " of float32 weights, over the CPU path's 8 GiB limit; shrink it with "
                               "--synthetic-layers / --synthetic-vocab (the full shape is meant for the GPU path)");
    if (o.device == "gpu" && ex::weight_bytes(c) > kGpuLimit)
      throw std::runtime_error("synthetic '" + shape + "' needs " + human_bytes(static_cast<double>(ex::weight_bytes(c))) +
                               " of float32 host weights before the upload, over 64 GiB");
    if (o.device == "gpu" && ex::weight_bytes(c) > (std::size_t{4} << 30))
      std::fprintf(stderr, "note: generating %s of float32 weights on the host first (takes a while; "
                           "benchmarks/bench_decode_step generates them on the GPU)\n",
                   human_bytes(static_cast<double>(ex::weight_bytes(c))).c_str());
    weights = ex::make_synthetic_weights(c, o.seed);
  }
  codec.vocab = weights.config.vocab_size;
  codec.bos = weights.config.bos_id;

  std::vector<std::vector<int>> prompts;
  for (const std::string& p : o.prompts) prompts.push_back(codec.encode(serve.system_prompt + p));
  if (o.prompt_tokens > 0)
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      if (prompts[i].size() < static_cast<std::size_t>(o.prompt_tokens))
        throw std::runtime_error("--prompt-tokens " + std::to_string(o.prompt_tokens) + ": prompt " + std::to_string(i) +
                                 " has only " + std::to_string(prompts[i].size()) + " tokens");
      prompts[i].resize(static_cast<std::size_t>(o.prompt_tokens));
    }
  // GGUF models (the ones with a BPE codec) state llama.context_length; llama2.c's seq_len is
  // nominal (stories260K runs past its 512 in the demo) and synthetic models have none.
  if (codec.bpe && weights.config.max_seq_len > 0) check_context_length(prompts, o.steps, weights.config);

  const ex::ModelConfig& mc = weights.config;
  std::fprintf(stderr, "model %s: %zu parameters, %d layers, dim %d, %d q / %d kv heads, head_dim %d, %s RoPE\n",
               mc.name.c_str(), mc.parameter_count(), mc.n_layers, mc.dim, mc.n_heads, mc.n_kv_heads, mc.head_dim,
               mc.rope_style == triattn::RopeStyle::kHalf ? "half" : "interleaved");

  std::unique_ptr<triattn::Calibrator> calibrator;
  if (!o.calibrate_out.empty())
    calibrator = std::make_unique<triattn::Calibrator>(mc.n_layers, mc.n_heads, mc.head_dim, mc.rope_style, mc.name);

  const bool compress = !o.stats_path.empty() && !o.no_compress;
  if (!o.stats_path.empty() && o.no_compress) std::fprintf(stderr, "note: --no-compress: statistics ignored\n");
  if (o.stats_path.empty() && !o.no_compress && o.calibrate_out.empty())
    std::fprintf(stderr, "note: no --stats given: compression off (make statistics with --calibrate OUT)\n");

  const triattn::CacheConfig cfg = make_cache_config(mc, prompts, o, compress);
  if (serve.on) {
    if (o.tp > 1 || calibrator || !o.json_out.empty())
      throw std::runtime_error("--system-prompt serves with --tp 1, without --calibrate or --json");
#if defined(TRIATTN_EXAMPLE_CUDA)
    if (o.device == "gpu") return run_serve_gpu(o, serve, weights, codec, prompts, cfg, compress);
#endif
    return run_serve_cpu(o, serve, weights, codec, prompts, cfg, compress);
  }
#if defined(TRIATTN_EXAMPLE_CUDA)
  if (o.device == "gpu" && o.tp > 1) return run_gpu_tp(o, weights, codec, prompts, compress);
  if (o.device == "gpu") return run_gpu(o, weights, codec, prompts, cfg, compress, calibrator.get());
#endif
  if (o.tp > 1) return run_cpu_tp(o, weights, codec, prompts, compress);
  ex::Model<ex::CpuBackend> model(weights);
  if (!compress) {
    PlainCache cache(cfg);
    return run(model, cache, codec, prompts, o, calibrator.get());
  }
  const triattn::QueryStats stats = ex::load_stats(o.stats_path, mc);
  const triattn::RopeConfig rope = ex::rope_config(mc);
  const triattn::SelectionParams sel = selection_params(o);
  TriCache cache(cfg, triattn::TriAttentionScorer(stats, rope, triattn::ScoringParams{}, mc.n_kv_heads),
                 triattn::TopKSelector(sel));
  return run(model, cache, codec, prompts, o, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return real_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reference_transformer: error: %s\n", e.what());
    return 1;
  }
}

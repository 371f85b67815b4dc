// SPDX-License-Identifier: Apache-2.0
// Workloads for the serving loop: seeded generators of the three request mixes serving
// benchmarks use, Poisson arrivals, and replay of a JSONL trace.
//   reasoning   prompts of 128-1,024 tokens, 4,096-16,384 generated
//   longqa      prompts of 8K-32K tokens, 256-1,024 generated
//   shared      a 4,096-token system prompt every request shares + 256 of its own, 4,096 generated
// Lengths are drawn uniformly, then multiplied by `scale` (prompt and generated) and by
// `gen_scale` (generated only), so small versions run on the CPU. Prompt tokens are uniform random
// ids (BOS first): only lengths and sharing matter to a serving benchmark.
// Trace lines: {"arrival": seconds, "prompt": [ids...] | "prompt_len": n, "max_new_tokens": n}.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/file_io.hpp>
#include <triattn/core/stats/json.hpp>

#include "serving_loop.hpp"

namespace triattn_serving {

struct WorkloadSpec {
  std::string kind = "reasoning";  ///< reasoning | longqa | shared
  int requests = 16;
  double scale = 1.0;              ///< all lengths
  double gen_scale = 1.0;          ///< generated lengths only
  std::uint64_t seed = 1;
};

/// Prompt tokens a workload or trace may hold in all: "prompt_len" lines expand and --scale
/// multiplies, so a small file or a big factor could ask for more memory than any machine has
/// (2^28 ids: 1 GiB).
inline constexpr std::int64_t kMaxTraceTokens = std::int64_t{1} << 28;

/// max(1, round(x * f)).
[[nodiscard]] inline int scaled(int x, double f) { return std::max(1, static_cast<int>(std::lround(x * f))); }

/// `n` random prompt tokens after BOS, ids in [first_id, vocab).
inline void append_random_tokens(std::vector<int>& out, int n, int vocab, std::mt19937_64& rng) {
  const int lo = std::min(3, vocab - 1);
  std::uniform_int_distribution<int> tok(lo, vocab - 1);
  for (int i = 0; i < n; ++i) out.push_back(tok(rng));
}

/// The requests of `spec`, all arriving at t = 0 (poisson_arrivals spreads them).
/// @throws triattn::logic_error on an unknown kind or a non-positive count / scale.
[[nodiscard]] inline std::vector<Request> make_workload(const WorkloadSpec& spec, int vocab, int bos) {
  TRIATTN_EXPECTS(spec.requests >= 1, "make_workload: requests = " + std::to_string(spec.requests) + " must be >= 1");
  TRIATTN_EXPECTS(spec.scale > 0 && spec.gen_scale > 0 && std::isfinite(spec.scale) && std::isfinite(spec.gen_scale),
                  "make_workload: scale and gen_scale must be finite and positive");
  TRIATTN_EXPECTS(vocab >= 2 && bos >= 0 && bos < vocab, "make_workload: bad vocab / bos");
  struct Range {
    int p_lo, p_hi, n_lo, n_hi;
  };
  Range r{};
  int shared = 0;
  if (spec.kind == "reasoning") r = {128, 1024, 4096, 16384};
  else if (spec.kind == "longqa") r = {8192, 32768, 256, 1024};
  else if (spec.kind == "shared") {
    r = {256, 256, 4096, 4096};
    shared = 4096;
  } else {
    throw triattn::logic_error("make_workload: kind '" + spec.kind + "' is not reasoning, longqa or shared");
  }
  // The longest prompt and generation the ranges can give, in range of an int, and all prompts
  // at their longest within kMaxTraceTokens (a huge --scale would ask for more memory than any
  // machine has).
  const double longest_prompt = (r.p_hi + shared) * spec.scale, longest_gen = r.n_hi * spec.scale * spec.gen_scale;
  auto g = [](double x) {
    char b[32];
    std::snprintf(b, sizeof b, "%.6g", x);
    return std::string(b);
  };
  TRIATTN_EXPECTS(longest_prompt <= (1 << 24) && longest_gen <= (1 << 24),
                  "make_workload: scale " + g(spec.scale) + " and gen_scale " + g(spec.gen_scale) + " make " + spec.kind +
                      " prompts of up to " + g(longest_prompt) + " tokens and " + g(longest_gen) +
                      " generated (at most 2^24 each)");
  TRIATTN_EXPECTS(longest_prompt * spec.requests <= static_cast<double>(kMaxTraceTokens),
                  "make_workload: " + std::to_string(spec.requests) + " requests of up to " + g(longest_prompt) +
                      " prompt tokens could pass " + std::to_string(kMaxTraceTokens) + " tokens in all");
  std::mt19937_64 rng(spec.seed);
  std::vector<int> system{bos};
  if (shared > 0) append_random_tokens(system, scaled(shared, spec.scale) - 1, vocab, rng);
  std::vector<Request> out(static_cast<std::size_t>(spec.requests));
  for (Request& q : out) {
    const int p = scaled(std::uniform_int_distribution<int>(r.p_lo, r.p_hi)(rng), spec.scale);
    const int n = scaled(std::uniform_int_distribution<int>(r.n_lo, r.n_hi)(rng), spec.scale * spec.gen_scale);
    if (shared > 0) {
      q.prompt = system;
      append_random_tokens(q.prompt, p, vocab, rng);
    } else {
      q.prompt = {bos};
      append_random_tokens(q.prompt, p - 1, vocab, rng);
    }
    q.max_new_tokens = n;
  }
  return out;
}

/// Arrival times of a Poisson process of `rate` requests per second (seeded), in request order;
/// rate 0 = offline (all at t = 0).
inline void poisson_arrivals(std::vector<Request>& reqs, double rate, std::uint64_t seed) {
  TRIATTN_EXPECTS(rate >= 0 && std::isfinite(rate), "poisson_arrivals: rate must be finite and >= 0");
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ULL);
  std::exponential_distribution<double> gap(rate > 0 ? rate : 1.0);
  double t = 0.0;
  for (Request& q : reqs) {
    q.arrival_s = rate > 0 ? t : 0.0;
    if (rate > 0) t += gap(rng);
  }
}

/// Requests of a JSONL trace (one object per line; blank lines skipped). A "prompt_len" prompt is
/// BOS + random ids (seeded). @throws triattn::format_error naming the line on a bad record, or
/// on the line where the prompts pass `max_tokens` in all.
[[nodiscard]] inline std::vector<Request> parse_trace(std::string_view text, const std::string& name, int vocab, int bos,
                                                      std::uint64_t seed, std::int64_t max_tokens = kMaxTraceTokens) {
  using triattn::detail::JsonValue;
  std::mt19937_64 rng(seed);
  std::vector<Request> out;
  std::size_t line_no = 0;
  std::int64_t total = 0;  // prompt tokens so far
  for (std::size_t pos = 0; pos <= text.size();) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = name + ":" + std::to_string(line_no);
    const JsonValue v = triattn::detail::parse_json(line, where, triattn::detail::JsonSubset::kFull);
    auto bad = [&](const std::string& why) { return triattn::format_error(where + ": " + why); };
    if (v.kind != JsonValue::Kind::kObject) throw bad("a trace line must be an object");
    Request q;
    const JsonValue* arrival = v.find("arrival");
    const JsonValue* mnt = v.find("max_new_tokens");
    if (arrival == nullptr || mnt == nullptr) throw bad("needs \"arrival\" and \"max_new_tokens\"");
    q.arrival_s = arrival->as_double();
    if (!(q.arrival_s >= 0) || !std::isfinite(q.arrival_s)) throw bad("\"arrival\" must be a finite number >= 0");
    if (mnt->kind != JsonValue::Kind::kInt || mnt->integer < 1 || mnt->integer > (1 << 24))
      throw bad("\"max_new_tokens\" must be an integer in [1, 2^24]");
    q.max_new_tokens = static_cast<int>(mnt->integer);
    if (const JsonValue* p = v.find("prompt")) {
      if (p->kind != JsonValue::Kind::kArray || p->items.empty()) throw bad("\"prompt\" must be a non-empty array of token ids");
      for (const JsonValue& t : p->items) {
        if (t.kind != JsonValue::Kind::kInt || t.integer < 0 || t.integer >= vocab)
          throw bad("\"prompt\" holds a token outside [0, " + std::to_string(vocab) + ")");
        q.prompt.push_back(static_cast<int>(t.integer));
      }
    } else if (const JsonValue* n = v.find("prompt_len")) {
      if (n->kind != JsonValue::Kind::kInt || n->integer < 1 || n->integer > (1 << 24))
        throw bad("\"prompt_len\" must be an integer in [1, 2^24]");
      q.prompt = {bos};
      append_random_tokens(q.prompt, static_cast<int>(n->integer) - 1, vocab, rng);
    } else {
      throw bad("needs \"prompt\" or \"prompt_len\"");
    }
    total += static_cast<std::int64_t>(q.prompt.size());
    if (total > max_tokens)
      throw bad("the trace's prompts pass " + std::to_string(max_tokens) + " tokens in all (" + std::to_string(total) +
                " so far)");
    out.push_back(std::move(q));
  }
  if (out.empty()) throw triattn::format_error(name + ": the trace has no requests");
  return out;
}

/// parse_trace of a file (a regular file of at most 1 GiB).
[[nodiscard]] inline std::vector<Request> load_trace(const std::string& path, int vocab, int bos, std::uint64_t seed) {
  const std::string text = triattn::read_regular_file<std::string>(path, std::uint64_t{1} << 30, "--trace");
  return parse_trace(text, path, vocab, bos, seed);
}

}  // namespace triattn_serving

// SPDX-License-Identifier: Apache-2.0
// What a serving run reports, as serving benchmarks do: output tok/s, requests/s, TTFT and TPOT
// percentiles, the inter-token latency of decode steps that carry no prefill chunk, peak memory,
// preemptions, requests in flight over time; as a table row on the terminal and as JSON.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <triattn/core/stats/json.hpp>

#include "serving_loop.hpp"

namespace triattn_serving {

/// The q-quantile (0..1) of `v` by linear interpolation between order statistics; 0 when empty.
[[nodiscard]] inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double x = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(x));
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (x - static_cast<double>(lo));
}

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};
[[nodiscard]] inline Percentiles percentiles(const std::vector<double>& v) {
  Percentiles p;
  p.p50 = percentile(v, 0.50);
  p.p90 = percentile(v, 0.90);
  p.p99 = percentile(v, 0.99);
  for (double x : v) p.mean += x / static_cast<double>(v.size());
  return p;
}

/// The numbers of one run.
struct Summary {
  std::string config;        ///< e.g. "tri+prefix"
  double rate = 0.0;         ///< requests/s offered (0 = offline, -1 = a trace's own arrival times)
  std::size_t requests = 0;
  std::int64_t output_tokens = 0, prompt_tokens = 0, cached_prompt_tokens = 0;
  double seconds = 0.0;
  double output_tok_s = 0.0, requests_s = 0.0;
  Percentiles ttft, tpot;     ///< seconds
  Percentiles itl_decode;     ///< inter-token latency (StepRecord::gap_s) of decode steps without a prefill chunk
  std::size_t decode_only_steps = 0, steps = 0;
  std::size_t peak_kv_bytes = 0, peak_device_bytes = 0;
  int preemptions = 0, rounds = 0, max_running = 0;
  std::int64_t sequences_compressed = 0;
};

[[nodiscard]] inline Summary summarize(const LoopResult& r, const std::string& config, double rate) {
  Summary s;
  s.config = config;
  s.rate = rate;
  s.requests = r.requests.size();
  std::vector<double> ttft, tpot, itl;
  for (const RequestResult& q : r.requests) {
    s.output_tokens += static_cast<std::int64_t>(q.generated.size());
    s.prompt_tokens += q.prompt_tokens;
    s.cached_prompt_tokens += q.cached_prompt_tokens;
    ttft.push_back(q.ttft());
    if (q.generated.size() > 1) tpot.push_back(q.tpot());
  }
  for (const StepRecord& st : r.steps) {
    if (st.prefill_tokens == 0 && st.decode_rows > 0) itl.push_back(st.gap_s);
    s.max_running = std::max(s.max_running, st.running);
  }
  s.seconds = r.seconds;
  s.output_tok_s = r.seconds > 0 ? static_cast<double>(s.output_tokens) / r.seconds : 0.0;
  s.requests_s = r.seconds > 0 ? static_cast<double>(s.requests) / r.seconds : 0.0;
  s.ttft = percentiles(ttft);
  s.tpot = percentiles(tpot);
  s.itl_decode = percentiles(itl);
  s.decode_only_steps = itl.size();
  s.steps = r.steps.size();
  s.peak_kv_bytes = r.peak_kv_bytes;
  s.peak_device_bytes = r.peak_device_bytes;
  s.preemptions = r.preemptions;
  s.rounds = r.rounds;
  s.sequences_compressed = r.sequences_compressed;
  return s;
}

inline void print_table_header(std::FILE* f) {
  std::fprintf(f, "| config | rate req/s | requests | out tok/s | req/s | TTFT p50/p90/p99 s | TPOT p50/p90/p99 ms | "
                  "decode ITL p50/p99 ms | peak KV MiB | peak device MiB | max running | preemptions |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
}

inline void print_table_row(std::FILE* f, const Summary& s) {
  constexpr double kMiB = 1024.0 * 1024.0;
  std::fprintf(f, "| %s | %s | %zu | %.1f | %.3f | %.2f / %.2f / %.2f | %.1f / %.1f / %.1f | %.2f / %.2f | %.1f | %.0f | %d | %d |\n",
               s.config.c_str(), s.rate > 0 ? std::to_string(s.rate).substr(0, 6).c_str() : s.rate < 0 ? "trace" : "offline", s.requests,
               s.output_tok_s, s.requests_s, s.ttft.p50, s.ttft.p90, s.ttft.p99, s.tpot.p50 * 1e3, s.tpot.p90 * 1e3,
               s.tpot.p99 * 1e3, s.itl_decode.p50 * 1e3, s.itl_decode.p99 * 1e3,
               static_cast<double>(s.peak_kv_bytes) / kMiB, static_cast<double>(s.peak_device_bytes) / kMiB, s.max_running,
               s.preemptions);
}

namespace json_detail {
inline std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  char b[40];
  std::snprintf(b, sizeof b, "%.6g", x);
  return b;
}
inline std::string pct(const Percentiles& p) {
  return "{\"p50\": " + num(p.p50) + ", \"p90\": " + num(p.p90) + ", \"p99\": " + num(p.p99) + ", \"mean\": " + num(p.mean) + "}";
}
}  // namespace json_detail

/// One run as a JSON object: the summary, per-request timings, and a timeline of at most
/// `max_points` steps (time, running, waiting, KV bytes, device bytes).
[[nodiscard]] inline std::string run_json(const Summary& s, const LoopResult& r, std::size_t max_points = 2000) {
  using json_detail::num;
  using json_detail::pct;
  std::string o = "{";
  o += "\"config\": " + triattn::detail::json_quote(s.config);
  o += ", \"rate\": " + num(s.rate);
  o += ", \"requests\": " + std::to_string(s.requests);
  o += ", \"output_tokens\": " + std::to_string(s.output_tokens);
  o += ", \"prompt_tokens\": " + std::to_string(s.prompt_tokens);
  o += ", \"cached_prompt_tokens\": " + std::to_string(s.cached_prompt_tokens);
  o += ", \"seconds\": " + num(s.seconds);
  o += ", \"output_tok_s\": " + num(s.output_tok_s);
  o += ", \"requests_s\": " + num(s.requests_s);
  o += ", \"ttft_s\": " + pct(s.ttft);
  o += ", \"tpot_s\": " + pct(s.tpot);
  o += ", \"itl_decode_only_s\": " + pct(s.itl_decode);
  o += ", \"decode_only_steps\": " + std::to_string(s.decode_only_steps);
  o += ", \"steps\": " + std::to_string(s.steps);
  o += ", \"peak_kv_bytes\": " + std::to_string(s.peak_kv_bytes);
  o += ", \"peak_device_bytes\": " + std::to_string(s.peak_device_bytes);
  o += ", \"max_running\": " + std::to_string(s.max_running);
  o += ", \"preemptions\": " + std::to_string(s.preemptions);
  o += ", \"rounds\": " + std::to_string(s.rounds);
  o += ", \"sequences_compressed\": " + std::to_string(s.sequences_compressed);
  o += ", \"per_request\": [";
  for (std::size_t i = 0; i < r.requests.size(); ++i) {
    const RequestResult& q = r.requests[i];
    o += std::string(i ? ", " : "") + "{\"arrival\": " + num(q.arrival_s) + ", \"admitted\": " + num(q.admitted_s) +
         ", \"first_token\": " + num(q.first_token_s) + ", \"finish\": " + num(q.finish_s) +
         ", \"prompt\": " + std::to_string(q.prompt_tokens) + ", \"cached\": " + std::to_string(q.cached_prompt_tokens) +
         ", \"generated\": " + std::to_string(q.generated.size()) + ", \"preemptions\": " + std::to_string(q.preemptions) +
         ", \"rounds\": " + std::to_string(q.rounds) + "}";
  }
  o += "], \"timeline\": {\"t\": [";
  const std::size_t stride = std::max<std::size_t>(1, (r.steps.size() + max_points - 1) / std::max<std::size_t>(1, max_points));
  std::string t, run, wait, kv, dev;
  for (std::size_t i = 0; i < r.steps.size(); i += stride) {
    const StepRecord& st = r.steps[i];
    const char* sep = t.empty() ? "" : ", ";
    t += sep + num(st.start_s);
    run += sep + std::to_string(st.running);
    wait += sep + std::to_string(st.waiting);
    kv += sep + std::to_string(st.kv_bytes);
    dev += sep + std::to_string(st.device_bytes);
  }
  o += t + "], \"running\": [" + run + "], \"waiting\": [" + wait + "], \"kv_bytes\": [" + kv + "], \"device_bytes\": [" +
       dev + "]}}";
  return o;
}

}  // namespace triattn_serving

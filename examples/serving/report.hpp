// SPDX-License-Identifier: Apache-2.0
// What a serving run reports, as serving benchmarks do: output tok/s, requests/s, TTFT and TPOT
// percentiles, the inter-token latency of decode steps that carry no prefill chunk, peak memory,
// preemptions, requests in flight over time; as a table row on the terminal and as JSON. The
// decode-only inter-token latency is also broken down by batch size and its tail attributed
// (what the slowest steps had in common: rounds, waits, memory upkeep, graph captures, ...), and
// the JSON carries every step's StepRecord so a run's p99 can be explained after the fact.
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

/// Decode-only inter-token latency of the steps whose decode rows fall in [rows_lo, rows_hi].
struct ItlBand {
  int rows_lo = 0, rows_hi = 0;
  std::size_t steps = 0;
  double p50 = 0, p99 = 0, max = 0;  ///< seconds
};

/// What the slowest decode-only steps (gap >= the p99) had, against all decode-only steps: a
/// count of the steps with each feature in each set, and mean host / device times (seconds).
struct ItlTail {
  double threshold_s = 0;  ///< the p99 of the decode-only gaps
  struct Side {
    std::size_t steps = 0;
    std::size_t round_launched = 0, round_committed = 0, round_in_flight = 0, round_waited = 0;
    std::size_t slabs_mapped = 0, slabs_unmapped = 0, graph_captured = 0;
    std::size_t after_prefill = 0;   ///< the previous step carried a prefill chunk
    std::size_t bucket_changed = 0;  ///< decode rows in another power-of-two bucket than the previous step's
    std::size_t admitted = 0, preempted = 0;
    double gap = 0, sched = 0, enqueue = 0, during = 0, sync = 0, post = 0, device = 0, round_wait = 0, round_host = 0,
           round_device = 0, rows = 0;  ///< means
  } tail, all;
};

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
  std::vector<ItlBand> itl_bands;  ///< the same steps by decode rows (1, 2, 3-4, 5-8, ...): nonempty bands
  ItlTail itl_tail;
  std::size_t peak_kv_bytes = 0, peak_device_bytes = 0;
  int preemptions = 0, rounds = 0, max_running = 0;
  std::int64_t sequences_compressed = 0;
};

/// The steps the decode ITL counts: decode rows and no prefill chunk.
[[nodiscard]] inline bool decode_only(const StepRecord& st) noexcept {
  return st.prefill_tokens == 0 && st.decode_rows > 0;
}

/// The power-of-two batch bucket of n rows (1, 2, 4, ...): the GPU backend's decode graphs.
[[nodiscard]] inline int rows_bucket(int n) noexcept {
  int b = 1;
  while (b < n) b *= 2;
  return b;
}

/// Decode-only gaps by decode rows, in power-of-two bands (1, 2, 3-4, 5-8, ...).
[[nodiscard]] inline std::vector<ItlBand> itl_bands(const std::vector<StepRecord>& steps) {
  std::vector<std::vector<double>> by;
  for (const StepRecord& st : steps) {
    if (!decode_only(st)) continue;
    std::size_t k = 0;
    while ((1 << k) < st.decode_rows) ++k;
    if (by.size() <= k) by.resize(k + 1);
    by[k].push_back(st.gap_s);
  }
  std::vector<ItlBand> out;
  for (std::size_t k = 0; k < by.size(); ++k) {
    if (by[k].empty()) continue;
    ItlBand b;
    b.rows_hi = 1 << k;
    b.rows_lo = k == 0 ? 1 : (1 << (k - 1)) + 1;
    b.steps = by[k].size();
    b.p50 = percentile(by[k], 0.50);
    b.p99 = percentile(by[k], 0.99);
    b.max = *std::max_element(by[k].begin(), by[k].end());
    out.push_back(b);
  }
  return out;
}

/// What the decode-only steps with gap_s >= threshold had, against all decode-only steps.
[[nodiscard]] inline ItlTail itl_tail(const std::vector<StepRecord>& steps, double threshold) {
  ItlTail t;
  t.threshold_s = threshold;
  auto add = [](ItlTail::Side& s, const StepRecord& st, const StepRecord* prev) {
    ++s.steps;
    s.round_launched += st.round_launched > 0;
    s.round_committed += st.round_committed > 0;
    s.round_in_flight += st.round_in_flight;
    s.round_waited += st.round_waits > 0;
    s.slabs_mapped += st.slabs_mapped > 0;
    s.slabs_unmapped += st.slabs_unmapped > 0;
    s.graph_captured += st.graph_captures > 0;
    s.after_prefill += prev != nullptr && prev->prefill_tokens > 0;
    s.bucket_changed += prev != nullptr && rows_bucket(prev->decode_rows) != rows_bucket(st.decode_rows);
    s.admitted += st.admitted > 0;
    s.preempted += st.preempted > 0;
    s.gap += st.gap_s;
    s.sched += st.sched_s;
    s.enqueue += st.enqueue_s;
    s.during += st.during_s;
    s.sync += st.sync_s;
    s.post += st.post_s;
    s.device += st.device_s;
    s.round_wait += st.round_wait_s;
    s.round_host += st.round_host_s;
    s.round_device += st.round_device_s;
    s.rows += st.decode_rows;
  };
  for (std::size_t i = 1; i < steps.size(); ++i) {  // the first step has no gap of its own
    const StepRecord& st = steps[i];
    if (!decode_only(st)) continue;
    add(t.all, st, &steps[i - 1]);
    if (st.gap_s >= threshold) add(t.tail, st, &steps[i - 1]);
  }
  for (ItlTail::Side* s : {&t.tail, &t.all}) {
    if (s->steps == 0) continue;
    const double n = static_cast<double>(s->steps);
    for (double* m : {&s->gap, &s->sched, &s->enqueue, &s->during, &s->sync, &s->post, &s->device, &s->round_wait,
                      &s->round_host, &s->round_device, &s->rows})
      *m /= n;
  }
  return t;
}

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
    if (decode_only(st)) itl.push_back(st.gap_s);
    s.max_running = std::max(s.max_running, st.running);
  }
  s.seconds = r.seconds;
  s.output_tok_s = r.seconds > 0 ? static_cast<double>(s.output_tokens) / r.seconds : 0.0;
  s.requests_s = r.seconds > 0 ? static_cast<double>(s.requests) / r.seconds : 0.0;
  s.ttft = percentiles(ttft);
  s.tpot = percentiles(tpot);
  s.itl_decode = percentiles(itl);
  s.decode_only_steps = itl.size();
  s.itl_bands = itl_bands(r.steps);
  s.itl_tail = itl_tail(r.steps, s.itl_decode.p99);
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

/// The decode ITL by batch band and what its tail had, as a few lines under a run's table row.
inline void print_itl_breakdown(std::FILE* f, const Summary& s) {
  std::fprintf(f, "  decode ITL by decode rows (steps: p50 / p99 / max ms):");
  for (const ItlBand& b : s.itl_bands) {
    if (b.rows_lo == b.rows_hi) std::fprintf(f, " [%d]", b.rows_lo);
    else std::fprintf(f, " [%d-%d]", b.rows_lo, b.rows_hi);
    std::fprintf(f, " %zu: %.2f/%.2f/%.2f", b.steps, b.p50 * 1e3, b.p99 * 1e3, b.max * 1e3);
  }
  std::fprintf(f, "\n");
  const ItlTail& t = s.itl_tail;
  for (const auto* side : {&t.tail, &t.all}) {
    const bool tail = side == &t.tail;
    std::fprintf(f,
                 "  %s %zu steps: rows %.0f, gap %.2f ms = sched %.2f (round wait %.2f, rounds host %.2f) + "
                 "enqueue %.2f + during %.2f + sync %.2f + post %.2f; device %.2f, round device %.2f; with round launched %zu, "
                 "committed %zu, in flight %zu, waited %zu; slabs mapped %zu, unmapped %zu; graph captured %zu; "
                 "after prefill %zu; bucket changed %zu; admitted %zu; preempted %zu\n",
                 tail ? "ITL tail (>= p99)" : "all decode-only ", side->steps, side->rows, side->gap * 1e3,
                 side->sched * 1e3, side->round_wait * 1e3, side->round_host * 1e3, side->enqueue * 1e3,
                 side->during * 1e3, side->sync * 1e3, side->post * 1e3, side->device * 1e3, side->round_device * 1e3,
                 side->round_launched, side->round_committed, side->round_in_flight, side->round_waited,
                 side->slabs_mapped, side->slabs_unmapped, side->graph_captured, side->after_prefill,
                 side->bucket_changed, side->admitted, side->preempted);
  }
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
inline std::string tail_side(const ItlTail::Side& s) {
  auto z = [](std::size_t v) { return std::to_string(v); };
  return "{\"steps\": " + z(s.steps) + ", \"round_launched\": " + z(s.round_launched) + ", \"round_committed\": " +
         z(s.round_committed) + ", \"round_in_flight\": " + z(s.round_in_flight) + ", \"round_waited\": " +
         z(s.round_waited) + ", \"slabs_mapped\": " + z(s.slabs_mapped) + ", \"slabs_unmapped\": " +
         z(s.slabs_unmapped) +
         ", \"graph_captured\": " + z(s.graph_captured) + ", \"after_prefill\": " + z(s.after_prefill) +
         ", \"bucket_changed\": " + z(s.bucket_changed) + ", \"admitted\": " + z(s.admitted) + ", \"preempted\": " +
         z(s.preempted) + ", \"mean_s\": {\"gap\": " + num(s.gap) + ", \"sched\": " + num(s.sched) +
         ", \"enqueue\": " + num(s.enqueue) + ", \"during\": " + num(s.during) + ", \"sync\": " + num(s.sync) +
         ", \"post\": " + num(s.post) + ", \"device\": " + num(s.device) + ", \"round_wait\": " + num(s.round_wait) +
         ", \"round_host\": " + num(s.round_host) + ", \"round_device\": " + num(s.round_device) +
         "}, \"mean_rows\": " + num(s.rows) + "}";
}
}  // namespace json_detail

/// Every StepRecord field as a column ({"stride": k, "<field>": [...]}, steps 0, k, 2k, ...;
/// times in whole microseconds, "_us"): the raw material to attribute any step's latency
/// (examples/serving/plot.py draws the decode ITL over time from it).
[[nodiscard]] inline std::string step_log_json(const std::vector<StepRecord>& steps, std::size_t max_steps) {
  if (max_steps == 0) return "null";
  const std::size_t stride = std::max<std::size_t>(1, (steps.size() + max_steps - 1) / max_steps);
  struct Col {
    const char* name;
    double (*get)(const StepRecord&);
    bool seconds;
    std::string text;
  };
  Col cols[] = {
      {"start_us", [](const StepRecord& s) { return s.start_s; }, true, {}},
      {"gap_us", [](const StepRecord& s) { return s.gap_s; }, true, {}},
      {"decode_rows", [](const StepRecord& s) { return double(s.decode_rows); }, false, {}},
      {"prefill_tokens", [](const StepRecord& s) { return double(s.prefill_tokens); }, false, {}},
      {"prefill_chunks", [](const StepRecord& s) { return double(s.prefill_chunks); }, false, {}},
      {"held_rows", [](const StepRecord& s) { return double(s.held_rows); }, false, {}},
      {"running", [](const StepRecord& s) { return double(s.running); }, false, {}},
      {"admitted", [](const StepRecord& s) { return double(s.admitted); }, false, {}},
      {"preempted", [](const StepRecord& s) { return double(s.preempted); }, false, {}},
      {"round_launched", [](const StepRecord& s) { return double(s.round_launched); }, false, {}},
      {"round_committed", [](const StepRecord& s) { return double(s.round_committed); }, false, {}},
      {"round_in_flight", [](const StepRecord& s) { return s.round_in_flight ? 1.0 : 0.0; }, false, {}},
      {"round_waits", [](const StepRecord& s) { return double(s.round_waits); }, false, {}},
      {"round_wait_us", [](const StepRecord& s) { return s.round_wait_s; }, true, {}},
      {"round_host_us", [](const StepRecord& s) { return s.round_host_s; }, true, {}},
      {"round_device_us", [](const StepRecord& s) { return s.round_device_s; }, true, {}},
      {"sched_us", [](const StepRecord& s) { return s.sched_s; }, true, {}},
      {"enqueue_us", [](const StepRecord& s) { return s.enqueue_s; }, true, {}},
      {"during_us", [](const StepRecord& s) { return s.during_s; }, true, {}},
      {"sync_us", [](const StepRecord& s) { return s.sync_s; }, true, {}},
      {"post_us", [](const StepRecord& s) { return s.post_s; }, true, {}},
      {"device_us", [](const StepRecord& s) { return s.device_s; }, true, {}},
      {"graph_captures", [](const StepRecord& s) { return double(s.graph_captures); }, false, {}},
      {"slabs_mapped", [](const StepRecord& s) { return double(s.slabs_mapped); }, false, {}},
      {"slabs_unmapped", [](const StepRecord& s) { return double(s.slabs_unmapped); }, false, {}},
  };
  for (std::size_t i = 0; i < steps.size(); i += stride)
    for (Col& c : cols) {
      const double v = c.get(steps[i]);
      c.text += (i ? ", " : "") + std::to_string(std::llround(c.seconds ? v * 1e6 : v));
    }
  std::string o = "{\"stride\": " + std::to_string(stride);
  for (const Col& c : cols) o += std::string(", \"") + c.name + "\": [" + c.text + "]";
  return o + "}";
}

/// One run as a JSON object: the summary, per-request timings, a timeline of at most
/// `max_points` steps (time, running, waiting, KV bytes, device bytes, and the largest gap of the
/// steps each point stands for), and the step log: every StepRecord field, column by column, for
/// up to `max_steps` steps (every k-th beyond; 0: none).
[[nodiscard]] inline std::string run_json(const Summary& s, const LoopResult& r, std::size_t max_points = 2000,
                                          std::size_t max_steps = 20000) {
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
  o += ", \"itl_bands\": [";
  for (std::size_t i = 0; i < s.itl_bands.size(); ++i) {
    const ItlBand& b = s.itl_bands[i];
    o += std::string(i ? ", " : "") + "{\"rows_lo\": " + std::to_string(b.rows_lo) + ", \"rows_hi\": " +
         std::to_string(b.rows_hi) + ", \"steps\": " + std::to_string(b.steps) + ", \"p50\": " + num(b.p50) +
         ", \"p99\": " + num(b.p99) + ", \"max\": " + num(b.max) + "}";
  }
  o += "], \"itl_tail\": {\"threshold_s\": " + num(s.itl_tail.threshold_s) + ", \"tail\": " +
       json_detail::tail_side(s.itl_tail.tail) + ", \"all\": " + json_detail::tail_side(s.itl_tail.all) + "}";
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
  std::string t, run, wait, kv, dev, gmax;
  for (std::size_t i = 0; i < r.steps.size(); i += stride) {
    const StepRecord& st = r.steps[i];
    const char* sep = t.empty() ? "" : ", ";
    t += sep + num(st.start_s);
    run += sep + std::to_string(st.running);
    wait += sep + std::to_string(st.waiting);
    kv += sep + std::to_string(st.kv_bytes);
    dev += sep + std::to_string(st.device_bytes);
    double g = 0;  // the largest decode-only gap the point stands for (-1: none)
    bool any = false;
    for (std::size_t j = i; j < std::min(i + stride, r.steps.size()); ++j)
      if (decode_only(r.steps[j]) && j > 0) {
        g = std::max(g, r.steps[j].gap_s);
        any = true;
      }
    gmax += sep + num(any ? g : -1.0);
  }
  o += t + "], \"running\": [" + run + "], \"waiting\": [" + wait + "], \"kv_bytes\": [" + kv + "], \"device_bytes\": [" +
       dev + "], \"decode_gap_max\": [" + gmax + "]}";
  o += ", \"step_log\": " + step_log_json(r.steps, max_steps) + "}";
  return o;
}

}  // namespace triattn_serving

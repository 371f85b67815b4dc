// SPDX-License-Identifier: Apache-2.0
// A minimal continuous-batching loop over Model<Backend> and a KvCache: prefill every prompt in
// one step (or in steps of at most GenerationOptions::prefill_chunk tokens), then decode all
// unfinished sequences together, one token each per step. After every
// step an optional hook may run compression rounds (the engine's scheduler decides; see
// docs/integration.md). This is the worked example of where an engine calls what.
// A decode step's logits stay in the backend's memory: when every sampler is greedy and nobody
// asks for the logits, a backend with a device argmax (CudaBackend::argmax_host) sends back only
// the token ids; otherwise the samplers read the backend's host view of the logits in place.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>

#include "model.hpp"
#include "sampler.hpp"

namespace triattn_example {

struct GenerationOptions {
  int max_new_tokens = 256;  ///< tokens sampled per sequence (the prefill step samples the first)
  bool stop_at_bos = true;   ///< llama2.c ends a story when it samples BOS
  bool stop_at_eos = false;
  /// Prefill tokens per step over all prompts (0 = every prompt in one step): long prompts are
  /// prefilled in chunks, each step attending to what the earlier chunks cached.
  int prefill_chunk = 0;
};

struct SequenceResult {
  triattn::SeqId seq = -1;       ///< the cache's sequence id (left open: the caller releases it)
  std::vector<int> prompt;
  std::vector<int> generated;    ///< sampled tokens, without the stop token
  int stop_token = -1;           ///< BOS/EOS that ended generation, or -1
  int compression_rounds = 0;
  std::int64_t tokens_evicted = 0;
};

struct GenerationStats {
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  double compress_seconds = 0.0;
  std::int64_t prefill_tokens = 0;
  std::int64_t decode_tokens = 0;  ///< tokens run through decode steps
  int decode_steps = 0;
  /// decode_seconds split by host clock: in Model::forward (recording and launching a step, or
  /// computing it on the CPU), and from its return to the sampled tokens (waiting for the device,
  /// copies, sampling). The rest of decode_seconds is the loop's own bookkeeping.
  double decode_forward_seconds = 0.0;
  double decode_sample_seconds = 0.0;
  /// Device time of the decode steps (backends with device_seconds(): CUDA events from a step's
  /// first launch to its results on the host); -1 when the backend does not measure it.
  double decode_device_seconds = -1.0;
  int decode_device_argmax_steps = 0;  ///< decode steps whose tokens came from a device argmax
};

/// Runs the compression rounds that are due for `seqs` and returns what they did (e.g.
/// [&](auto seqs) { return cache.compress_if_needed(seqs); }); empty = no rounds.
using CompressFn = std::function<std::vector<triattn::CompressionReport>(std::span<const triattn::SeqId> seqs)>;

struct GenerationCallbacks {
  /// After each sampled token of prompt `index`; `pos` is the logical position whose logits were
  /// sampled (the prompt's last position for the first token).
  std::function<void(int index, int token, std::int64_t pos, std::span<const float> logits)> on_token;
  /// Whether on_token reads its `logits` (false: it gets an empty span, so greedy decode steps
  /// need no logits on the host). Without on_token no logits are needed either.
  bool token_logits = true;
  /// After each step, with the sequences still decoding (compression rounds).
  CompressFn after_step;
  /// After each decode step (1-based count), for progress output; `results` so far.
  std::function<void(int step, std::span<const SequenceResult> results)> on_step;
  /// Opens the sequence of prompt `index` (default: cache.add_sequence()) and returns how many of
  /// its leading tokens are already cached (a prefix-cache hit, serve_shared.hpp); the prefill
  /// step computes the rest (at least one token).
  std::function<int(int index, std::span<const int> prompt, triattn::SeqId& seq)> open;
  /// After the prefill step, before the first round (e.g. publish the prompts to the prefix cache).
  std::function<void(std::span<const SequenceResult> results)> after_prefill;
};

/// Runs prompts[i] with samplers[i] to completion. Opens one cache sequence per prompt.
/// @throws OutOfKvBlocks when the cache runs out; triattn::logic_error on bad arguments.
template <class ModelT, class Cache>
std::vector<SequenceResult> generate(ModelT& model, Cache& cache, std::span<const std::vector<int>> prompts,
                                     std::span<Sampler> samplers, const GenerationOptions& opt,
                                     const GenerationCallbacks& cb = {}, GenerationStats* stats = nullptr) {
  using clock = std::chrono::steady_clock;
  TRIATTN_EXPECTS(samplers.size() == prompts.size(), "generate: one sampler per prompt is needed");
  const ModelConfig& mc = model.config();
  GenerationStats local;
  GenerationStats& st = stats != nullptr ? *stats : local;
  std::vector<SequenceResult> res(prompts.size());
  std::vector<bool> done(prompts.size(), false);
  std::vector<int> cached(prompts.size(), 0);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    TRIATTN_EXPECTS(!prompts[i].empty(), "generate: prompt " + std::to_string(i) + " is empty (start it with BOS)");
    res[i].prompt = prompts[i];
    if (cb.open) {
      cached[i] = cb.open(static_cast<int>(i), prompts[i], res[i].seq);
      TRIATTN_EXPECTS(cached[i] >= 0 && cached[i] < static_cast<int>(prompts[i].size()),
                      "generate: open() reported " + std::to_string(cached[i]) + " cached tokens of prompt " +
                          std::to_string(i) + " (" + std::to_string(prompts[i].size()) + " tokens); at least one must be computed");
    } else {
      res[i].seq = cache.add_sequence();
    }
  }
  if (prompts.empty()) return res;

  auto accept = [&](std::size_t i, int token, std::int64_t pos, std::span<const float> logits) {
    if (cb.on_token) cb.on_token(static_cast<int>(i), token, pos, logits);
    if ((opt.stop_at_bos && token == mc.bos_id) || (opt.stop_at_eos && token == mc.eos_id)) {
      res[i].stop_token = token;
      done[i] = true;
      return;
    }
    res[i].generated.push_back(token);
    if (static_cast<int>(res[i].generated.size()) >= opt.max_new_tokens) done[i] = true;
  };
  auto compress = [&] {
    if (!cb.after_step) return;
    std::vector<triattn::SeqId> live;
    for (std::size_t i = 0; i < res.size(); ++i)
      if (!done[i]) live.push_back(res[i].seq);
    if (live.empty()) return;
    const auto t0 = clock::now();
    for (const triattn::CompressionReport& r : cb.after_step(live))
      for (SequenceResult& s : res)
        if (s.seq == r.seq) {
          ++s.compression_rounds;
          s.tokens_evicted += r.length_before - r.length_after;
        }
    st.compress_seconds += std::chrono::duration<double>(clock::now() - t0).count();
  };

  // Prefill: every prompt in one step, or steps of at most opt.prefill_chunk tokens (prompts in
  // order, a prompt's tail continuing in the next step).
  TRIATTN_EXPECTS(opt.prefill_chunk >= 0, "generate: prefill_chunk must be >= 0");
  std::vector<std::size_t> next(prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    next[i] = static_cast<std::size_t>(cached[i]);
    st.prefill_tokens += static_cast<std::int64_t>(prompts[i].size()) - cached[i];
  }
  std::vector<Chunk> chunks;
  std::vector<std::size_t> owner;  // prompt of each chunk
  std::vector<std::vector<float>> last_logits(prompts.size());
  const std::size_t budget = opt.prefill_chunk > 0 ? static_cast<std::size_t>(opt.prefill_chunk) : std::numeric_limits<std::size_t>::max();
  auto t0 = clock::now();
  for (std::size_t first = 0; first < prompts.size();) {
    chunks.clear();
    owner.clear();
    bool any_last = false;
    std::size_t used = 0;
    for (std::size_t i = first; i < prompts.size() && used < budget; ++i) {
      const std::size_t take = std::min(prompts[i].size() - next[i], budget - used);
      chunks.push_back(Chunk{res[i].seq, std::span<const int>(prompts[i]).subspan(next[i], take), triattn::Phase::kPrefill});
      owner.push_back(i);
      next[i] += take;
      used += take;
      any_last = any_last || next[i] == prompts[i].size();
    }
    const bool logits = opt.max_new_tokens > 0 && any_last;
    const StepOutput out = model.step(cache, chunks, logits ? LogitsFor::kLastOfEachChunk : LogitsFor::kNone);
    for (std::size_t c = 0; c < chunks.size(); ++c)
      if (logits && next[owner[c]] == prompts[owner[c]].size()) {
        const std::span<const float> row = out.row(static_cast<int>(c));
        last_logits[owner[c]].assign(row.begin(), row.end());
      }
    while (first < prompts.size() && next[first] == prompts[first].size()) ++first;
  }
  st.prefill_seconds += std::chrono::duration<double>(clock::now() - t0).count();
  if (cb.after_prefill) cb.after_prefill(std::span<const SequenceResult>(res));
  if (opt.max_new_tokens <= 0) return res;
  const bool want_logits = cb.on_token && cb.token_logits;
  for (std::size_t i = 0; i < prompts.size(); ++i)
    accept(i, samplers[i].sample(last_logits[i]), static_cast<std::int64_t>(prompts[i].size()) - 1,
           want_logits ? std::span<const float>(last_logits[i]) : std::span<const float>{});
  compress();

  // Decode: one token per unfinished sequence per step. The logits stay in the backend's memory
  // (Model::forward); only what sampling needs comes to the host.
  const std::size_t V = static_cast<std::size_t>(mc.vocab_size);
  constexpr bool kDeviceArgmax = requires(typename ModelT::backend_type& b, int* ids, const float* l) {
    b.argmax_host(ids, l, 1, 1);
  };
  constexpr bool kDeviceClock = requires(typename ModelT::backend_type& b) {
    { b.device_seconds() } -> std::convertible_to<double>;
  };
  double device0 = 0.0;
  if constexpr (kDeviceClock) device0 = model.backend().device_seconds();
  std::vector<std::size_t> idx;
  std::vector<int> last(prompts.size());
  std::vector<int> ids;
  for (;;) {
    chunks.clear();
    idx.clear();
    bool greedy = !want_logits;
    for (std::size_t i = 0; i < res.size(); ++i) {
      if (done[i]) continue;
      last[i] = res[i].generated.back();
      chunks.push_back(Chunk{res[i].seq, std::span<const int>(&last[i], 1), triattn::Phase::kDecode});
      idx.push_back(i);
      greedy = greedy && samplers[i].greedy();
    }
    if (chunks.empty()) break;
    t0 = clock::now();
    const int n = model.forward(cache, chunks, LogitsFor::kLastOfEachChunk);
    const auto t1 = clock::now();
    const std::span<const TokenInfo> rows = model.rows();  // one row per chunk: row j is chunk j
    TRIATTN_EXPECTS(n == static_cast<int>(idx.size()) && rows.size() == idx.size(),
                    "generate: a decode step returned " + std::to_string(n) + " logit rows for " +
                        std::to_string(idx.size()) + " sequences");
    auto& be = model.backend();
    bool sampled = false;
    if constexpr (kDeviceArgmax) {
      if (greedy) {  // argmax on the device: n token ids cross to the host, one wait
        ids.resize(idx.size());
        be.argmax_host(ids.data(), model.logits(), n, mc.vocab_size);
        for (std::size_t j = 0; j < idx.size(); ++j) accept(idx[j], ids[j], rows[j].pos, {});
        ++st.decode_device_argmax_steps;
        sampled = true;
      }
    }
    if (!sampled) {  // the backend's host view of the logits, read in place (no copy per step)
      const float* host = be.host_view(model.logits(), static_cast<std::size_t>(n) * V);
      for (std::size_t j = 0; j < idx.size(); ++j) {
        const std::span<const float> row(host + j * V, V);
        accept(idx[j], samplers[idx[j]].sample(row), rows[j].pos, want_logits ? row : std::span<const float>{});
      }
    }
    const auto t2 = clock::now();
    st.decode_forward_seconds += std::chrono::duration<double>(t1 - t0).count();
    st.decode_sample_seconds += std::chrono::duration<double>(t2 - t1).count();
    st.decode_seconds += std::chrono::duration<double>(t2 - t0).count();
    st.decode_tokens += static_cast<std::int64_t>(idx.size());
    ++st.decode_steps;
    compress();
    if (cb.on_step) cb.on_step(st.decode_steps, std::span<const SequenceResult>(res));
  }
  if constexpr (kDeviceClock) st.decode_device_seconds = model.backend().device_seconds() - device0;
  return res;
}

}  // namespace triattn_example

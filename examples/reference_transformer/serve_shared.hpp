// SPDX-License-Identifier: Apache-2.0
// Serving requests that share a prompt prefix (a system prompt) with triattn's prefix cache
// (core/prefix_cache.hpp) and compression together. Requests arrive in waves; each wave runs
// through generate() to completion and leaves. With the prefix cache on, a request is admitted
// over the longest cached chain of its prompt's full blocks (admit_prompt: those blocks are
// shared, reference counted, never rewritten; compression rounds protect them), its prefill
// computes only the rest, and its prompt blocks are published for later requests. Released
// requests' blocks stay cached until the pool needs them (evicted least recently used first).
//
//   reference_transformer --system-prompt "Once upon a time, there was a little girl"
//       --prompt " She liked" --prompt " One day" --prompt " The dog" --wave 1 --stats S --budget 64
//   (one command line)
//   ... --no-prefix-cache   (the same requests, every prompt token computed: same tokens)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/prefix_cache.hpp>

#include "cli_numbers.hpp"
#include "generate.hpp"

namespace triattn_example {

/// Command-line switches of the serving mode, taken out of argv before the main parser runs.
struct ServeArgs {
  bool on = false;               ///< --system-prompt given
  std::string system_prompt;     ///< text every request starts with
  bool prefix_cache = true;      ///< --no-prefix-cache turns it off
  int wave = 1;                  ///< --wave N: requests arriving together
};

/// Removes --system-prompt TEXT, --no-prefix-cache and --wave N from argv (argc updated).
/// @throws triattn::logic_error on a missing or bad value (the integer options' strict parser).
inline ServeArgs take_serve_args(int& argc, char** argv) {
  ServeArgs a;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--system-prompt" || s == "--wave") {
      TRIATTN_EXPECTS(i + 1 < argc, "option " + s + " needs a value");
      const std::string v = argv[++i];
      if (s == "--system-prompt") {
        a.on = true;
        a.system_prompt = v;
      } else {
        a.wave = static_cast<int>(parse_int_option(s, v, 1, 2147483647LL));
      }
    } else if (s == "--no-prefix-cache") {
      a.prefix_cache = false;
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return a;
}

/// What serving did, per request and in total.
struct ServeReport {
  struct Request {
    int prompt_tokens = 0;
    int cached_tokens = 0;  ///< taken from the prefix cache
    std::vector<int> generated;
    int compression_rounds = 0;
  };
  std::vector<Request> requests;
  std::int64_t prompt_tokens = 0;
  std::int64_t computed_prompt_tokens = 0;
  std::int64_t hits = 0;              ///< requests that found at least one cached block
  std::size_t peak_blocks_held = 0;   ///< blocks in use or cached, peak over steps
  std::size_t peak_bytes_held = 0;
  triattn::PrefixCacheStats cache;    ///< prefix cache counters at the end
};

/// Serves prompts[i] with samplers[i] in waves of `wave`, the prefix cache on or off (the cache's
/// allocator must be a PrefixCachingAllocator either way: off, nothing is looked up or published).
/// `compress` runs after every step (as GenerationCallbacks::after_step; empty = no rounds).
template <class ModelT, class Cache>
ServeReport serve_shared(ModelT& model, Cache& cache, std::span<const std::vector<int>> prompts,
                         std::span<Sampler> samplers, const GenerationOptions& opt, bool prefix_cache, int wave,
                         const CompressFn& compress = {}) {
  TRIATTN_EXPECTS(wave >= 1, "serve_shared: wave = " + std::to_string(wave) + " must be positive");
  TRIATTN_EXPECTS(samplers.size() == prompts.size(), "serve_shared: one sampler per prompt is needed");
  ServeReport rep;
  rep.requests.resize(prompts.size());
  auto& mem = cache.allocator();
  const std::size_t block_bytes = static_cast<std::size_t>(cache.config().block_bytes_all_ranges());
  auto sample = [&] {
    const std::size_t held = mem.blocks_held();
    rep.peak_blocks_held = std::max(rep.peak_blocks_held, held);
    rep.peak_bytes_held = std::max(rep.peak_bytes_held, held * block_bytes);
  };
  for (std::size_t w0 = 0; w0 < prompts.size(); w0 += static_cast<std::size_t>(wave)) {
    const std::size_t n = std::min(prompts.size() - w0, static_cast<std::size_t>(wave));
    const auto wp = prompts.subspan(w0, n);
    GenerationCallbacks cb;
    cb.open = [&](int i, std::span<const int> prompt, triattn::SeqId& seq) {
      ServeReport::Request& r = rep.requests[w0 + static_cast<std::size_t>(i)];
      r.prompt_tokens = static_cast<int>(prompt.size());
      if (!prefix_cache) {
        seq = cache.add_sequence();
        return 0;
      }
      const triattn::PrefixAdmission a = triattn::admit_prompt(cache, prompt);
      seq = a.seq;
      r.cached_tokens = a.cached_tokens;
      return a.cached_tokens;
    };
    cb.after_prefill = [&](std::span<const SequenceResult> res) {
      sample();
      if (prefix_cache)
        for (const SequenceResult& s : res) (void)triattn::publish_prompt(cache, s.seq, s.prompt);
    };
    if (compress) cb.after_step = compress;
    cb.on_step = [&](int, std::span<const SequenceResult>) { sample(); };
    const std::vector<SequenceResult> res = generate(model, cache, wp, samplers.subspan(w0, n), opt, cb);
    for (std::size_t i = 0; i < n; ++i) {
      ServeReport::Request& r = rep.requests[w0 + i];
      r.generated = res[i].generated;
      r.compression_rounds = res[i].compression_rounds;
      cache.release(res[i].seq);  // its published blocks stay cached
    }
  }
  for (const ServeReport::Request& r : rep.requests) {
    rep.prompt_tokens += r.prompt_tokens;
    rep.computed_prompt_tokens += r.prompt_tokens - r.cached_tokens;
    rep.hits += r.cached_tokens > 0 ? 1 : 0;
  }
  rep.cache = mem.prefix_stats();
  return rep;
}

/// Prints a ServeReport (stderr).
inline void print_serve_report(const ServeReport& rep, bool prefix_cache) {
  for (std::size_t i = 0; i < rep.requests.size(); ++i) {
    const ServeReport::Request& r = rep.requests[i];
    std::fprintf(stderr, "request %zu: prompt %d tokens, %d from the prefix cache, %d computed; %zu generated, %d round(s)\n", i,
                 r.prompt_tokens, r.cached_tokens, r.prompt_tokens - r.cached_tokens, r.generated.size(),
                 r.compression_rounds);
  }
  std::fprintf(stderr, "prefix cache %s: %lld of %zu requests hit, prompt tokens computed %lld of %lld\n",
               prefix_cache ? "on" : "off", static_cast<long long>(rep.hits), rep.requests.size(),
               static_cast<long long>(rep.computed_prompt_tokens), static_cast<long long>(rep.prompt_tokens));
  std::fprintf(stderr, "KV memory: peak %zu blocks held (%.1f KiB, cached prefixes included); now %zu cached blocks, "
               "%zu idle; %llu evicted\n",
               rep.peak_blocks_held, static_cast<double>(rep.peak_bytes_held) / 1024.0, rep.cache.cached_blocks,
               rep.cache.idle_blocks, static_cast<unsigned long long>(rep.cache.evicted_blocks));
}

}  // namespace triattn_example

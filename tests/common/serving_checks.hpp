// SPDX-License-Identifier: Apache-2.0
// Checks shared by the serving-loop tests (CPU: tests/core/test_serving_loop.cpp, GPU:
// tests/cuda/test_serving_loop_gpu.cu): every request served through the loop, beside others,
// must generate the tokens it generates alone. "Alone" runs through the reference transformer's
// own drivers, not through the loop: generate() on a fresh cache (rounds after every step), or
// serve_shared() with one prompt when the configuration caches prefixes (its prompt published, so
// its rounds protect the same blocks).
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <span>
#include <vector>

#include <triattn/core/kv_cache.hpp>

#include <reference_transformer/generate.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/serve_shared.hpp>
#include <serving/report.hpp>
#include <serving/serving_loop.hpp>

namespace triattn::test {

/// The tokens request `r` generates alone in `cache` (fresh, empty), sampling as the loop does
/// for request `index` (seed + index); `compress` runs the rounds (empty: none).
template <class ModelT, class Cache>
std::vector<int> tokens_alone(ModelT& model, Cache& cache, const triattn_serving::Request& r, std::size_t index,
                              const triattn_serving::LoopOptions& lo, const triattn_example::CompressFn& compress) {
  std::vector<triattn_example::Sampler> samplers{triattn_example::Sampler(lo.temperature, lo.top_p, lo.seed + index)};
  triattn_example::GenerationOptions go;
  go.max_new_tokens = r.max_new_tokens;
  go.stop_at_bos = false;
  go.prefill_chunk = lo.prefill_chunk;
  const std::vector<std::vector<int>> prompts{r.prompt};
  if (lo.prefix_cache) {
    const triattn_example::ServeReport rep =
        triattn_example::serve_shared(model, cache, std::span<const std::vector<int>>(prompts),
                                      std::span<triattn_example::Sampler>(samplers), go, true, 1, compress);
    return rep.requests.at(0).generated;
  }
  triattn_example::GenerationCallbacks cb;
  if (compress) cb.after_step = compress;
  const std::vector<triattn_example::SequenceResult> res = triattn_example::generate(
      model, cache, std::span<const std::vector<int>>(prompts), std::span<triattn_example::Sampler>(samplers), go, cb);
  cache.release(res.at(0).seq);
  return res.at(0).generated;
}

/// Every request's tokens equal `alone[i]`, and the run was a real batch: requests ran together,
/// some steps mixed prefill chunks with decode rows. Returns how many requests matched.
inline std::size_t check_same_tokens(const triattn_serving::LoopResult& res, const std::vector<std::vector<int>>& alone) {
  REQUIRE(res.requests.size() == alone.size());
  std::size_t same = 0;
  for (std::size_t i = 0; i < alone.size(); ++i) {
    CAPTURE(i);
    CHECK(res.requests[i].generated.size() == alone[i].size());
    CHECK(res.requests[i].generated == alone[i]);
    same += res.requests[i].generated == alone[i] ? 1 : 0;
  }
  const triattn_serving::Summary s = triattn_serving::summarize(res, "test", 0.0);
  CHECK(s.max_running > 1);
  bool mixed = false;
  for (const triattn_serving::StepRecord& st : res.steps) mixed = mixed || (st.decode_rows > 0 && st.prefill_tokens > 0);
  CHECK(mixed);
  return same;
}

}  // namespace triattn::test

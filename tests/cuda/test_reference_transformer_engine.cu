// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The reference transformer's engine paths on the GPU (issue #48):
//   * the KV cache on cuda::VmmAllocator (reference_transformer's GPU default) gives bitwise the
//     tokens and logits of the static pool; its resident bytes follow the blocks in use, and
//     drop to nothing once the sequences are released and trim()'s event has passed
//   * chunked prefill (GenerationOptions::prefill_chunk: steps of at most N prompt tokens, ragged
//     prompts split across steps) gives bitwise the tokens and logits of one prefill step (fp32
//     weights and the GEMV matmuls: a row's arithmetic never depends on the step's rows)
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "cuda_test_utils.cuh"
#include "common/reference_transformer_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/generate.hpp>
#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>
#include <reference_transformer/synthetic.hpp>

namespace {

namespace ex = triattn_example;

std::vector<std::vector<int>> prompts_of(const std::vector<int>& lens, int vocab) {
  std::vector<std::vector<int>> ps;
  for (std::size_t s = 0; s < lens.size(); ++s) ps.push_back(triattn::test::prompt_tokens(lens[s], static_cast<int>(s), vocab));
  return ps;
}

struct Run {
  std::vector<std::vector<int>> tokens;
  std::vector<std::vector<std::vector<float>>> logits;  // [prompt][token][vocab]
};

/// Greedy generation of `steps` tokens per prompt through Model<CudaBackend> on `cache`.
template <class Cache>
Run generate_on(ex::Model<ex::CudaBackend>& model, Cache& cache, const std::vector<std::vector<int>>& prompts, int steps,
                int prefill_chunk) {
  Run r;
  r.logits.resize(prompts.size());
  std::vector<ex::Sampler> samplers(prompts.size());
  ex::GenerationOptions opt;
  opt.max_new_tokens = steps;
  opt.stop_at_bos = false;
  opt.prefill_chunk = prefill_chunk;
  ex::GenerationCallbacks cb;
  cb.on_token = [&](int i, int, std::int64_t, std::span<const float> l) {
    r.logits[static_cast<std::size_t>(i)].emplace_back(l.begin(), l.end());
  };
  for (const auto& s : ex::generate(model, cache, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers), opt, cb)) {
    r.tokens.push_back(s.generated);
    cache.release(s.seq);
  }
  return r;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("GPU engine: the KV cache on VMM equals the static pool and its resident bytes follow the live blocks") {
  triattn::test::require_device();
  const ex::ModelConfig c = triattn::test::small_config(64);
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 21);
  const auto prompts = prompts_of({40, 3, 97}, c.vocab_size);
  constexpr int kSteps = 24;
  auto cfg = triattn::test::cache_config(c, 128 + kSteps, static_cast<int>(prompts.size()), 16, triattn::DType::kBF16);
  cfg.num_blocks = 8192;  // 128 MiB: a static pool resident as a whole, VMM pages only where blocks are used
  ex::CudaBackend be;
  ex::Model<ex::CudaBackend> model(w, be);
  ex::GpuPlainCache fixed(cfg, triattn::cuda::DeviceCompactor(be.stream()));
  const Run a = generate_on(model, fixed, prompts, kSteps, 0);
  ex::GpuVmmPlainCache vmm(cfg, triattn::cuda::DeviceCompactor(be.stream()));
  CHECK(vmm.memory().bytes_resident == 0);  // nothing mapped before the first block
  std::size_t resident_live = 0;
  {
    std::vector<ex::Sampler> samplers(prompts.size());
    ex::GenerationOptions opt;
    opt.max_new_tokens = kSteps;
    opt.stop_at_bos = false;
    Run b;
    b.logits.resize(prompts.size());
    ex::GenerationCallbacks cb;
    cb.on_token = [&](int i, int, std::int64_t, std::span<const float> l) {
      b.logits[static_cast<std::size_t>(i)].emplace_back(l.begin(), l.end());
    };
    const auto res = ex::generate(model, vmm, std::span<const std::vector<int>>(prompts), std::span<ex::Sampler>(samplers), opt, cb);
    for (const auto& s : res) b.tokens.push_back(s.generated);
    CHECK(a.tokens == b.tokens);
    CHECK(a.logits == b.logits);
    const triattn::MemoryStats m = vmm.memory();
    resident_live = m.bytes_resident;
    CHECK(m.bytes_resident >= m.bytes_in_used_blocks);
    CHECK(m.bytes_resident < fixed.memory().bytes_resident);  // only what the blocks in use touch
    for (const auto& s : res) vmm.release(s.seq);
  }
  be.synchronize();
  (void)vmm.allocator().trim(be.stream());
  vmm.allocator().synchronize();
  CHECK(resident_live > 0);
  CHECK(vmm.memory().bytes_resident == 0);
}

TEST_CASE("GPU engine: chunked prefill gives bitwise the tokens and logits of one prefill step") {
  triattn::test::require_device();
  const ex::ModelConfig c = triattn::test::small_config(64);
  const ex::ModelWeights w = ex::make_synthetic_weights(c, 33);
  // 200 tokens: no chunk size below leaves a step of only one-token tails (such a step would go
  // to the decode attention kernel, whose arithmetic differs from the prefill kernel's)
  const auto prompts = prompts_of({45, 1, 137, 17}, c.vocab_size);
  constexpr int kSteps = 12;
  const auto cfg = triattn::test::cache_config(c, 160 + kSteps, static_cast<int>(prompts.size()), 16);
  ex::CudaBackendOptions o;
  o.matmul_path = ex::MatmulPath::kGemv;
  ex::CudaBackend be(o);
  ex::Model<ex::CudaBackend> model(w, be);
  ex::GpuPlainCache cache(cfg, triattn::cuda::DeviceCompactor(be.stream()));
  const Run whole = generate_on(model, cache, prompts, kSteps, 0);
  for (const int chunk : {7, 16, 64, 500}) {
    INFO("prefill chunk " << chunk);
    const Run part = generate_on(model, cache, prompts, kSteps, chunk);
    CHECK(part.tokens == whole.tokens);
    CHECK(part.logits == whole.logits);
  }
}

}  // TEST_SUITE

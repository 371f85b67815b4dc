// SPDX-License-Identifier: Apache-2.0
// links: triattn_example_cuda
// The serving loop (examples/serving/serving_loop.hpp) on the GPU with SmolLM2-135M (float32
// weights and KV cache, the pool in CUDA virtual memory behind the prefix cache, TriAttention
// rounds on the device through cuda::DeviceRounds launched without waiting, their sequences
// sitting out while the others decode; the rounds on a stream of their own beside the decode
// steps (DeviceRounds::launch_beside, the default) and on the model's stream): the traces of
// tests/common/serving_checks.hpp, and every request's tokens must equal those of the request run
// alone (generate() / serve_shared() with rounds that wait), without compression and with
// compression, and each request must be credited with as many rounds as alone.
//
// Bitwise equality needs a row's arithmetic not to depend on the batch. The default GPU path does
// not give that: matmuls of 4+ rows run through cuBLAS, of fewer through the GEMV kernels, the
// decode attention splits its work by batch size, and mixed steps run another attention kernel,
// so the same row rounds differently alone and batched (in f32 as in bf16). Both runs therefore
// use CudaBackendOptions of batch_invariant(): GEMV matmuls and the per-row attention kernel for
// every step. That is the honest reading of "equal to running it alone": the scheduling (which
// rows share a step, when rounds run, what they touch) is what is checked, not cuBLAS's rounding.
// Data: TRIATTN_SHARED_DATA_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf (missing: fails). No GPU: fails.
// ctest: RUN_SERIAL
#include <doctest/doctest.h>

#include <memory>

#include "cuda_test_utils.cuh"
#include "common/serving_checks.hpp"
#include "common/smollm2_checks.hpp"

#include <reference_transformer/cuda_backend.cuh>
#include <reference_transformer/stats_io.hpp>
#include <serving/device_rounds.cuh>
#include <serving/serving_loop.hpp>

namespace ex = triattn_example;
namespace sv = triattn_serving;
using triattn::test::Smol;

TEST_SUITE("gpu") {

TEST_CASE("serving loop on the GPU: SmolLM2 f32 without compression: every request generates what it generates alone") {
  triattn::test::require_device();
  const Smol& s = Smol::get();
  ex::CudaBackend be(ex::batch_invariant(ex::CudaBackendOptions{}));
  ex::Model<ex::CudaBackend> model(s.weights, be);
  const cudaStream_t stream = be.stream();
  const int preempted = triattn::test::check_serving_traces(
      model,
      [&] {
        return std::make_unique<sv::GpuPlainCache>(triattn::test::serving_pool(s.weights.config),
                                                   triattn::cuda::DeviceCompactor(stream));
      },
      [](sv::GpuPlainCache& c) { return std::make_unique<sv::HostRounds<sv::GpuPlainCache>>(c); },
      [](sv::GpuPlainCache&) { return ex::CompressFn{}; }, /*compressed=*/false);
  CHECK(preempted > 0);
}

TEST_CASE("serving loop on the GPU: SmolLM2 f32 with device rounds: every request generates what it generates alone") {
  triattn::test::require_device();
  const Smol& s = Smol::get();
  const ex::ModelConfig& mc = s.weights.config;
  ex::CudaBackend be(ex::batch_invariant(ex::CudaBackendOptions{}));
  ex::Model<ex::CudaBackend> model(s.weights, be);
  const cudaStream_t stream = be.stream();
  const triattn::QueryStats qs = triattn::test::serving_stats(mc);
  for (const sv::RoundStream where : {sv::RoundStream::kSide, sv::RoundStream::kEngine}) {
    CAPTURE(where == sv::RoundStream::kSide ? "rounds on a side stream" : "rounds on the model's stream");
    (void)triattn::test::check_serving_traces(
        model,
        [&] {
          return std::make_unique<sv::GpuTriCache>(
              triattn::test::serving_pool(mc), triattn::cuda::DeviceCompactor(stream),
              triattn::cuda::TriAttentionDeviceScorer(qs, ex::rope_config(mc), triattn::ScoringParams{}, mc.n_kv_heads, stream),
              triattn::TopKSelector(triattn::test::serving_selection()));
        },
        [&](sv::GpuTriCache& c) { return std::make_unique<sv::DeviceRoundsAdapter<sv::GpuTriCache>>(c, stream, where); },
        [&](sv::GpuTriCache& c) {  // the reference's rounds wait: launch, wait, commit after every step
          auto r = std::make_shared<triattn::cuda::DeviceRounds<sv::GpuTriCache>>(c);
          return ex::CompressFn([r, stream](std::span<const triattn::SeqId> live) {
            return r->compress_if_needed_and_wait(live, stream);
          });
        },
        /*compressed=*/true);
  }
}

}  // TEST_SUITE("gpu")

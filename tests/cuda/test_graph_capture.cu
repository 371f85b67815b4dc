// SPDX-License-Identifier: Apache-2.0
// A whole compression round (score → normalise → reduce → select → compact) captured once in a
// CUDA graph (global capture mode: no host synchronisation, allocation or host data inside) and
// replayed: every replay must reproduce the eager round bitwise (keep plan and compacted cache),
// and a replay after the per-sequence inputs changed in device memory (t0, prompt lengths) must
// equal an eager round on those new inputs.
#include "round_fixture.cuh"

namespace {

SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window) {
  SelectionParams p;
  p.budget = budget;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  return p;
}

struct Outcome {
  std::vector<std::int32_t> kept, keep;
  std::vector<char> data;
};

/// Restores the original cache contents and poisons the outputs and the workspace.
template <class T>
void reset_state(RoundFixture<T>& f, const test::DeviceBuffer<T>& pristine, cudaStream_t s) {
  TRIATTN_TEST_CUDA(
      cudaMemcpyAsync(f.d_data.get(), pristine.get(), pristine.size() * sizeof(T), cudaMemcpyDeviceToDevice, s));
  TRIATTN_TEST_CUDA(cudaMemsetAsync(f.d_ws.get(), 0xff, f.ws_bytes, s));
  TRIATTN_TEST_CUDA(cudaMemsetAsync(f.d_kept.get(), 0xff, f.d_kept.size() * sizeof(std::int32_t), s));
  TRIATTN_TEST_CUDA(cudaMemsetAsync(f.d_keep.get(), 0xff, f.d_keep.size() * sizeof(std::int32_t), s));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(s));
}

template <class T>
Outcome collect(const RoundFixture<T>& f) {
  Outcome o;
  o.kept = f.d_kept.download();
  o.keep = f.d_keep.download();
  const std::vector<T> d = f.d_data.download();
  o.data.resize(d.size() * sizeof(T));
  std::memcpy(o.data.data(), d.data(), o.data.size());
  return o;
}

template <class T>
cudaError_t eager_round(RoundFixture<T>& f, cudaStream_t s) {
  return cuda::compression_round::run(f.device_view(), f.scorer->device_model(), f.c.sp,
                                      f.round_batch(), f.plan(), f.d_ws.get(), f.ws_bytes, s);
}

void check_same(const Outcome& a, const Outcome& b, const char* what) {
  INFO(what);
  CHECK(a.keep == b.keep);
  CHECK(a.kept == b.kept);
  CHECK(a.data == b.data);
}

template <class T>
void check_graph(const RoundCase& rc, std::uint32_t seed) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", rc.name());
  RoundFixture<T> f(rc, seed);
  test::DeviceBuffer<T> pristine(f.d_data.size());
  cudaStream_t s = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // On s and waited for: a device-to-device cudaMemcpy returns before the copy ends, and s does
  // not wait for the legacy stream (the first eager round once read a half-copied original).
  TRIATTN_TEST_CUDA(
      cudaMemcpyAsync(pristine.get(), f.d_data.get(), pristine.size() * sizeof(T), cudaMemcpyDeviceToDevice, s));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(s));

  reset_state(f, pristine, s);
  TRIATTN_TEST_CUDA(eager_round(f, s));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(s));
  const Outcome eager = collect(f);
  bool any_moved = false;
  for (int k : eager.keep) any_moved |= k >= 0;
  REQUIRE(any_moved);

  reset_state(f, pristine, s);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const cudaError_t captured = eager_round(f, s);
  TRIATTN_TEST_CUDA(cudaStreamEndCapture(s, &graph));
  TRIATTN_TEST_CUDA(captured);
  TRIATTN_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    reset_state(f, pristine, s);
    TRIATTN_TEST_CUDA(cudaGraphLaunch(exec, s));
    TRIATTN_TEST_CUDA(cudaStreamSynchronize(s));
    check_same(eager, collect(f), "graph replay vs eager round");
  }

  // New per-sequence inputs in device memory: the same graph must follow them.
  std::vector<std::int64_t> t0 = f.t0;
  for (auto& x : t0) x += 77777;
  std::vector<int> prompts = f.c.prompts;
  for (std::size_t b = 0; b < prompts.size(); ++b) prompts[b] = prompts[b] / 2;
  f.d_t0.upload(t0);
  f.d_prompts.upload(prompts);
  reset_state(f, pristine, s);
  TRIATTN_TEST_CUDA(cudaGraphLaunch(exec, s));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(s));
  const Outcome replayed = collect(f);
  reset_state(f, pristine, s);
  TRIATTN_TEST_CUDA(eager_round(f, s));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(s));
  check_same(collect(f), replayed, "graph replay with new device inputs vs eager round on them");
  CHECK((replayed.kept != eager.kept || replayed.keep != eager.keep));  // the inputs did change the round

  TRIATTN_TEST_CUDA(cudaGraphExecDestroy(exec));
  TRIATTN_TEST_CUDA(cudaGraphDestroy(graph));
  TRIATTN_TEST_CUDA(cudaStreamDestroy(s));
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("a compression round captured in a CUDA graph replays the eager round bitwise") {
    triattn::test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
      for (Aggregation agg : {Aggregation::kMean, Aggregation::kMax}) {
        RoundCase c;
        c.agg = agg;
        c.sp = sel(160, mode, PromptMode::kPinnedInBudget, 2, 16);
        check_graph<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }
}

// SPDX-License-Identifier: Apache-2.0
// Tensor-parallel compression rounds on ONE GPU (label gpu):
//   * the split union round (candidates → agreement → finish) with an identity agreement gives
//     bitwise the keep plan of the one-phase select, in every mode, eagerly and replayed from a
//     CUDA graph, and that plan equals ref::select_keep on the GPU's own scores;
//   * tp = 2 and tp = 4 "ranks" on the same GPU (one host thread and stream each, their own
//     caches holding their KV heads, scorers on sliced statistics) agree through a device max of
//     their buffers done by a small kernel here (no NCCL): every rank keeps exactly the tp = 1
//     tokens and its compacted KV heads equal the tp = 1 cache's, in every mode.
#include "tp_fixture.cuh"

#include <array>
#include <barrier>
#include <thread>

#include <triattn/core/ref/select.hpp>
#include <triattn/cuda/algorithms/select.cuh>

using namespace triattn;
using namespace tpfix;

namespace {

constexpr int kMaxRanks = 4;

struct RankPointers {
  const std::uint8_t* flags[kMaxRanks];
  const float* vmax[kMaxRanks];
  int ranks;
};

/// out = element-wise max over the ranks' buffers, in rank order (as an all-reduce would).
/// @param flags_out [n] @param vmax_out [n]
__global__ void max_over_ranks(RankPointers in, std::uint8_t* flags_out, float* vmax_out, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint8_t f = in.flags[0][i];
    float v = in.vmax[0][i];
    for (int q = 1; q < in.ranks; ++q) {
      const std::uint8_t g = in.flags[q][i];
      const float w = in.vmax[q][i];
      f = f < g ? g : f;
      v = v < w ? w : v;
    }
    flags_out[i] = f;
    vmax_out[i] = v;
  }
}

/// Shared state of `tp` ranks living in threads of one process on one GPU.
struct Exchange {
  int tp;
  std::barrier<> sync;
  std::array<std::uint8_t*, kMaxRanks> flags{};  // each rank's round buffers, published per round
  std::array<float*, kMaxRanks> vmax{};
  std::array<cudaEvent_t, kMaxRanks> ready{}, read{};
  std::array<bool, kMaxRanks> absent{};  // a rank whose round ended before its agreement
  std::vector<Dev<std::uint8_t>> tmp_flags;  // per-rank result before it is copied back
  std::vector<Dev<float>> tmp_vmax;

  Exchange(int ranks, std::size_t n) : tp(ranks), sync(ranks) {
    for (int r = 0; r < tp; ++r) {
      TRIATTN_TEST_CUDA(cudaEventCreateWithFlags(&ready[r], cudaEventDisableTiming));
      TRIATTN_TEST_CUDA(cudaEventCreateWithFlags(&read[r], cudaEventDisableTiming));
      tmp_flags.emplace_back(n);
      tmp_vmax.emplace_back(n);
      TRIATTN_TEST_CUDA(tmp_flags.back().status);
      TRIATTN_TEST_CUDA(tmp_vmax.back().status);
    }
  }
  /// A rank whose round never reached the agreement (it failed first, or its mode needs none)
  /// still meets the others at both barriers, so nobody waits for it forever.
  void stand_in(int rank) {
    absent[rank] = true;
    sync.arrive_and_wait();
    sync.arrive_and_wait();
  }
  ~Exchange() {
    for (int r = 0; r < tp; ++r) {
      (void)cudaEventDestroy(ready[r]);
      (void)cudaEventDestroy(read[r]);
    }
  }
};

/// The agreement of rank `rank`: publish, wait for every rank's phase 1, max into scratch, wait
/// until nobody reads this rank's buffers any more, copy back. Every rank always reaches both
/// barriers, also after an error, so none is left waiting.
struct DeviceMaxAgreement {
  Exchange* x;
  int rank;
  bool called = false;
  cudaError_t operator()(std::uint8_t* flags, float* vmax, int batch, int max_len, cudaStream_t s) noexcept {
    called = true;
    const std::size_t n = static_cast<std::size_t>(batch) * static_cast<std::size_t>(max_len);
    cudaError_t err = cudaSuccess;
    const auto note = [&](cudaError_t e) {
      if (err == cudaSuccess) err = e;
    };
    x->flags[rank] = flags;
    x->vmax[rank] = vmax;
    note(cudaEventRecord(x->ready[rank], s));
    x->sync.arrive_and_wait();  // every rank's buffers and phase-1 events are published
    RankPointers p{};
    p.ranks = x->tp;
    for (int q = 0; q < x->tp; ++q)
      if (x->absent[q]) note(cudaErrorUnknown);  // another rank failed before its agreement
    for (int q = 0; q < x->tp && err == cudaSuccess; ++q) {
      p.flags[q] = x->flags[q];
      p.vmax[q] = x->vmax[q];
      if (q != rank) note(cudaStreamWaitEvent(s, x->ready[q], 0));
    }
    if (err == cudaSuccess && n > 0) {
      max_over_ranks<<<256, 256, 0, s>>>(p, x->tmp_flags[rank].p, x->tmp_vmax[rank].p, n);
      note(cudaGetLastError());
    }
    note(cudaEventRecord(x->read[rank], s));
    x->sync.arrive_and_wait();  // every rank has enqueued its reads of the others' buffers
    for (int q = 0; q < x->tp; ++q)
      if (q != rank) note(cudaStreamWaitEvent(s, x->read[q], 0));
    if (err == cudaSuccess && n > 0) {
      note(cudaMemcpyAsync(flags, x->tmp_flags[rank].p, n, cudaMemcpyDeviceToDevice, s));
      note(cudaMemcpyAsync(vmax, x->tmp_vmax[rank].p, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    }
    return err;
  }
};
static_assert(cuda::UnionAgreement<DeviceMaxAgreement>);

template <class T>
void check_identity_split(const TpCase& c, std::uint32_t s) {
  INFO("seed ", s, " (TRIATTN_TEST_SEED replays): ", c.name(), " dtype ", dtype_name(dtype_of<T>));
  HostRound<T> h(c, s);
  DeviceRound<T> one(h, 1, 0), split(h, 1, 0);
  TRIATTN_TEST_CUDA(one.status);
  TRIATTN_TEST_CUDA(split.status);
  const std::vector<float> raw = raw_scores(one);
  const SelectionParams dp = c.sp;
  TRIATTN_TEST_CUDA(cuda::compression_round::plan(one.view(), one.scorer->device_model(), dp, one.round_batch(),
                                                  one.plan(), one.ws.p, one.ws_bytes));
  TRIATTN_TEST_CUDA(cuda::compression_round::plan(split.view(), split.scorer->device_model(), dp, split.round_batch(),
                                                  split.plan(), split.ws.p, split.ws_bytes, cuda::IdentityAgreement{},
                                                  nullptr));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  TpRoundResult<T> a, b;
  download(one, a);
  download(split, b);
  test::require_bitwise_equal(b.keep, a.keep, "keep counts of the split round");
  test::require_bitwise_equal(b.kept, a.kept, "keep plan of the split round (whole buffer, poison included)");
  check_full_against_ref(h, raw, one, a);

  // Replayed from a CUDA graph: the plan step reads the cache and writes only the plan.
  TRIATTN_TEST_CUDA(split.kept.poison());
  TRIATTN_TEST_CUDA(split.keep.poison());
  cudaStream_t stream = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t captured =
      cuda::compression_round::plan(split.view(), split.scorer->device_model(), dp, split.round_batch(), split.plan(),
                                    split.ws.p, split.ws_bytes, cuda::IdentityAgreement{}, stream);
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  TRIATTN_TEST_CUDA(captured);
  TRIATTN_TEST_CUDA(ended);
  TRIATTN_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  TRIATTN_TEST_CUDA(cudaGraphLaunch(exec, stream));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
  TpRoundResult<T> g;
  download(split, g);
  test::require_bitwise_equal(g.kept, a.kept, "keep plan of the split round replayed from a graph");
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
  (void)cudaStreamDestroy(stream);
}

template <class T>
void check_ranks_on_one_gpu(const TpCase& c, int tp, std::uint32_t s) {
  INFO("seed ", s, " (TRIATTN_TEST_SEED replays): tp ", tp, " ", c.name(), " dtype ", dtype_name(dtype_of<T>));
  HostRound<T> h(c, s);
  DeviceRound<T> full(h, 1, 0);
  TRIATTN_TEST_CUDA(full.status);
  const std::vector<float> raw = raw_scores(full);
  const SelectionParams dp = c.sp;
  TRIATTN_TEST_CUDA(cuda::compression_round::run(full.view(), full.scorer->device_model(), dp, full.round_batch(),
                                                 full.plan(), full.ws.p, full.ws_bytes));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  TpRoundResult<T> want;
  download(full, want);
  check_full_against_ref(h, raw, full, want);

  int device = 0;
  TRIATTN_TEST_CUDA(cudaGetDevice(&device));
  std::vector<std::unique_ptr<DeviceRound<T>>> ranks;
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(tp), nullptr);
  for (int r = 0; r < tp; ++r) {
    ranks.push_back(std::make_unique<DeviceRound<T>>(h, tp, r));
    TRIATTN_TEST_CUDA(ranks.back()->status);
    TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }
  Exchange x(tp, static_cast<std::size_t>(h.batch) * h.max_len);
  std::vector<cudaError_t> status(static_cast<std::size_t>(tp), cudaErrorUnknown);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      cudaError_t e = cudaSetDevice(device);  // the current device is per thread
      const DeviceRound<T>& d = *ranks[r];
      DeviceMaxAgreement agree{&x, r};
      const cudaError_t round = cuda::compression_round::run(d.view(), d.scorer->device_model(), dp, d.round_batch(),
                                                             d.plan(), d.ws.p, d.ws_bytes, agree, streams[r]);
      if (!agree.called) x.stand_in(r);  // per-head modes, or a failure before the agreement
      if (e == cudaSuccess) e = round;
      const cudaError_t synced = cudaStreamSynchronize(streams[r]);
      status[r] = e != cudaSuccess ? e : synced;
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < tp; ++r) {
    INFO("rank ", r);
    TRIATTN_TEST_CUDA(status[r]);
  }
  for (int r = 0; r < tp; ++r) {
    TpRoundResult<T> got;
    download(*ranks[r], got);
    check_rank_against_full(h, full, want, *ranks[r], got, tp, r);
    (void)cudaStreamDestroy(streams[r]);
  }
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("tp union split: an identity agreement gives the one-phase plan bitwise in every mode", T, float,
                     bf16_storage) {
    test::require_device();
    const std::uint32_t s = seed();
    int i = 0;
    for (const TpCase& c : all_mode_cases()) check_identity_split<T>(c, s + static_cast<std::uint32_t>(i++));
  }

  TEST_CASE_TEMPLATE("tp ranks on one GPU through a device max agreement keep the tp=1 tokens in every mode", T, float,
                     bf16_storage) {
    test::require_device();
    const std::uint32_t s = seed();
    int i = 0;
    for (const TpCase& c : all_mode_cases())
      for (int tp : {2, 4}) check_ranks_on_one_gpu<T>(c, tp, s + static_cast<std::uint32_t>(i++));
  }

  TEST_CASE("tp ranks on one GPU: Qwen3-8B-like heads with max aggregation and head_dim 64") {
    test::require_device();
    const std::uint32_t s = seed();
    TpCase c;
    c.L = 2;
    c.Hq = 32;
    c.Hkv = 8;
    c.lens = {700, 512, 1000};
    c.prompts = {100, 0, 0};
    c.sp = sel(512, PruningMode::kUnion, PromptMode::kPinnedInBudget, 4, 64);
    check_ranks_on_one_gpu<bf16_storage>(c, 2, s);
    c.agg = Aggregation::kMax;
    c.d = 64;
    check_ranks_on_one_gpu<float>(c, 4, s + 1);
    c.sp.mode = PruningMode::kPerHead;
    check_ranks_on_one_gpu<bf16_storage>(c, 2, s + 2);
  }

  TEST_CASE("tp union split launchers refuse bad arguments") {
    test::require_device();
    const cuda::RoundShape shape{2, 4, 2};
    const cuda::RoundSeqs<int> seqs{nullptr, nullptr, nullptr, 1, 8};
    SelectionParams p;
    p.mode = PruningMode::kPerHead;  // the split launchers are union-only
    float f = 0;
    std::uint8_t u = 0;
    CHECK(cuda::select_union_candidates(&f, &f, &u, &f, seqs, p, shape) == cudaErrorInvalidValue);
    p.mode = PruningMode::kUnion;
    CHECK(cuda::select_union_candidates(nullptr, &f, &u, &f, seqs, p, shape) == cudaErrorInvalidValue);
    CHECK(cuda::select_union_candidates(&f, &f, &u, &f, seqs, p, cuda::RoundShape{2, 3, 2}) == cudaErrorInvalidValue);
    CHECK(cuda::select_union_finish(&u, &f, cuda::DeviceKeepPlanView{}, seqs, p, shape) == cudaErrorInvalidValue);
    std::int32_t k = 0;
    CHECK(cuda::select_union_finish(nullptr, &f, cuda::DeviceKeepPlanView{&k, &k, 4}, seqs, p, shape) ==
          cudaErrorInvalidValue);
  }
}

// SPDX-License-Identifier: Apache-2.0
// Tensor parallelism over TWO GPUs with NCCL (label gpu_multi; CI's `ctest -LE gpu` and
// single-GPU runs with `-L '^gpu$'` leave these out). Every case FAILS, never skips, when fewer
// than two GPUs are usable or NCCL cannot be loaded (set TRIATTN_NCCL_LIBRARY to libnccl.so.2's
// path when it is not on the loader's path).
//   * NcclCommunicator: init_all from one thread and InitRank from one thread per GPU;
//     all_reduce_sum (float, bf16) and all_reduce_max (float, uint8), in place and out of place,
//     against host reductions, eagerly and captured in CUDA graphs; NCCL_NVLS_ENABLE is 0.
//   * Compression rounds at tp = 2 (rank r on GPU r driven by its own thread, communicators from
//     init_all, NcclUnionAgreement) keep
//     exactly the tp = 1 tokens of a round on GPU 0 and leave the same compacted bytes, in every
//     pruning mode; the tp = 1 round matches ref::select_keep.
#include "tp_fixture.cuh"

#include <cuda_bf16.h>

#include <exception>
#include <functional>
#include <string>
#include <thread>

#include <triattn/core/ref/select.hpp>
#include <triattn/cuda/tp/nccl_communicator.cuh>
#include <triattn/cuda/tp/nccl_union_agreement.cuh>

using namespace triattn;
using namespace tpfix;

namespace {

/// Two usable GPUs and a loadable NCCL, or the test fails saying which is missing.
void require_two_gpus_and_nccl() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) (void)cudaGetLastError();
  REQUIRE_MESSAGE((e == cudaSuccess && n >= 2), "gpu_multi tests need 2 GPUs; found ", (e == cudaSuccess ? n : 0),
                  " (", std::string(cudaGetErrorName(e)), ")");
  REQUIRE_MESSAGE(cuda::NcclCommunicator::available(), "NCCL unavailable: ", cuda::NcclCommunicator::unavailable_reason());
}

std::string what(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  return "unknown exception";
}

constexpr int kRanks = 2;

/// Per-rank inputs of the collective test, host side (values exactly representable, sums exact).
struct ReduceInputs {
  std::vector<float> f;                 // [n]
  std::vector<__nv_bfloat16> h;         // [n]
  std::vector<std::uint8_t> u;          // [n]
};

ReduceInputs make_inputs(std::mt19937& rng, std::size_t n) {
  ReduceInputs in;
  std::uniform_int_distribution<int> q(-64, 64);
  std::uniform_int_distribution<int> b(0, 255);
  in.f.resize(n);
  in.h.resize(n);
  in.u.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    in.f[i] = static_cast<float>(q(rng)) * 0.25f;          // sums of two stay exact in float
    in.h[i] = __float2bfloat16(static_cast<float>(q(rng)) * 0.125f);  // and in bf16 (|sum| <= 16, 7 bits)
    in.u[i] = static_cast<std::uint8_t>(b(rng));
  }
  return in;
}

/// Runs sum/max reductions of every type for both ranks (rank r drives GPU r from `issue`) and
/// checks them against the host reductions.
void check_reductions(const std::vector<ReduceInputs>& in, std::size_t n,
                      const std::function<void(int rank, float* f, float* f_out, __nv_bfloat16* h, std::uint8_t* u,
                                               float* fmax)>& issue,
                      const std::vector<cudaStream_t>& streams, bool in_place) {
  std::vector<Dev<float>> f(kRanks), f_out(kRanks), fmax(kRanks);
  std::vector<Dev<__nv_bfloat16>> h(kRanks);
  std::vector<Dev<std::uint8_t>> u(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    TRIATTN_TEST_CUDA(cudaSetDevice(r));
    f[r] = Dev<float>(n);
    f_out[r] = Dev<float>(n);
    fmax[r] = Dev<float>(n);
    h[r] = Dev<__nv_bfloat16>(n);
    u[r] = Dev<std::uint8_t>(n);
    const cudaError_t steps[] = {f[r].status,           f_out[r].status,         fmax[r].status,
                                 h[r].status,           u[r].status,             f[r].upload(in[r].f),
                                 fmax[r].upload(in[r].f), h[r].upload(in[r].h), u[r].upload(in[r].u),
                                 f_out[r].poison()};
    for (const cudaError_t e : steps) TRIATTN_TEST_CUDA(e);
  }
  for (int r = 0; r < kRanks; ++r) issue(r, f[r].p, in_place ? f[r].p : f_out[r].p, h[r].p, u[r].p, fmax[r].p);
  for (int r = 0; r < kRanks; ++r) {
    TRIATTN_TEST_CUDA(cudaSetDevice(r));
    TRIATTN_TEST_CUDA(cudaStreamSynchronize(streams[r]));
  }
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank ", r, " n ", n, in_place ? " in place" : " out of place");
    TRIATTN_TEST_CUDA(cudaSetDevice(r));
    std::vector<float> got_f, got_max;
    std::vector<__nv_bfloat16> got_h;
    std::vector<std::uint8_t> got_u;
    TRIATTN_TEST_CUDA((in_place ? f[r] : f_out[r]).download(got_f));
    TRIATTN_TEST_CUDA(fmax[r].download(got_max));
    TRIATTN_TEST_CUDA(h[r].download(got_h));
    TRIATTN_TEST_CUDA(u[r].download(got_u));
    std::size_t bad_f = 0, bad_h = 0, bad_u = 0, bad_max = 0;
    for (std::size_t i = 0; i < n; ++i) {
      bad_f += got_f[i] != in[0].f[i] + in[1].f[i];
      bad_max += got_max[i] != std::max(in[0].f[i], in[1].f[i]);
      const float hs = __bfloat162float(__float2bfloat16(__bfloat162float(in[0].h[i]) + __bfloat162float(in[1].h[i])));
      bad_h += __bfloat162float(got_h[i]) != hs;
      bad_u += got_u[i] != std::max(in[0].u[i], in[1].u[i]);
    }
    CHECK_MESSAGE(bad_f == 0, bad_f, " float sums wrong");
    CHECK_MESSAGE(bad_max == 0, bad_max, " float maxima wrong");
    CHECK_MESSAGE(bad_h == 0, bad_h, " bf16 sums wrong");
    CHECK_MESSAGE(bad_u == 0, bad_u, " uint8 maxima wrong");
  }
  TRIATTN_TEST_CUDA(cudaSetDevice(0));
}

template <class T>
void check_round_tp2(const TpCase& c, std::uint32_t s, std::vector<cuda::NcclCommunicator>& comms) {
  INFO("seed ", s, " (TRIATTN_TEST_SEED replays): ", c.name(), " dtype ", dtype_name(dtype_of<T>));
  HostRound<T> h(c, s);
  TRIATTN_TEST_CUDA(cudaSetDevice(0));
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

  std::vector<std::unique_ptr<DeviceRound<T>>> ranks;
  std::vector<cudaStream_t> streams(kRanks, nullptr);
  for (int r = 0; r < kRanks; ++r) {
    TRIATTN_TEST_CUDA(cudaSetDevice(r));
    ranks.push_back(std::make_unique<DeviceRound<T>>(h, kRanks, r));
    TRIATTN_TEST_CUDA(ranks.back()->status);
    TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }
  std::vector<cudaError_t> status(kRanks, cudaErrorUnknown);
  std::vector<std::string> nccl_error(kRanks);
  std::vector<std::exception_ptr> thrown(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      try {
        TRIATTN_CUDA_TRY(cudaSetDevice(r));
        cuda::NcclUnionAgreement agree(comms[r]);  // rank r's communicator lives on GPU r
        const DeviceRound<T>& d = *ranks[r];
        cudaError_t e = cuda::compression_round::run(d.view(), d.scorer->device_model(), dp, d.round_batch(), d.plan(),
                                                     d.ws.p, d.ws_bytes, agree, streams[r]);
        const cudaError_t synced = cudaStreamSynchronize(streams[r]);
        status[r] = e != cudaSuccess ? e : synced;
        nccl_error[r] = agree.last_error();
      } catch (...) {
        thrown[r] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank ", r, " NCCL: ", nccl_error[r]);
    REQUIRE_MESSAGE(!thrown[r], "rank ", r, " threw: ", what(thrown[r]));
    TRIATTN_TEST_CUDA(status[r]);
  }
  for (int r = 0; r < kRanks; ++r) {
    TRIATTN_TEST_CUDA(cudaSetDevice(r));
    TpRoundResult<T> got;
    download(*ranks[r], got);
    check_rank_against_full(h, full, want, *ranks[r], got, kRanks, r);
    (void)cudaStreamDestroy(streams[r]);
  }
  TRIATTN_TEST_CUDA(cudaSetDevice(0));
}

}  // namespace

TEST_SUITE("gpu_multi") {
  TEST_CASE("NcclCommunicator: all_reduce sum and max of float and bf16 and uint8 equal host reductions") {
    require_two_gpus_and_nccl();
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    REQUIRE_MESSAGE((nvls != nullptr && std::string(nvls) == "0"), "NCCL_NVLS_ENABLE must be 0 once NCCL is loaded");
    std::mt19937 rng(seed());
    const int devices[kRanks] = {0, 1};
    std::vector<cuda::NcclCommunicator> comms = cuda::NcclCommunicator::init_all(devices);
    REQUIRE(comms.size() == 2);
    std::vector<cudaStream_t> streams(kRanks, nullptr);
    for (int r = 0; r < kRanks; ++r) {
      CHECK(comms[r].rank() == r);
      CHECK(comms[r].size() == kRanks);
      CHECK(comms[r].device() == r);
      TRIATTN_TEST_CUDA(cudaSetDevice(r));
      TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
    TRIATTN_TEST_CUDA(cudaSetDevice(0));
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{4099}, std::size_t{1000003}})
      for (bool in_place : {true, false}) {
        std::vector<ReduceInputs> in;
        for (int r = 0; r < kRanks; ++r) in.push_back(make_inputs(rng, n));
        // One thread drives both GPUs: the calls of all ranks go into one NCCL group.
        check_reductions(
            in, n,
            [&](int r, float* f, float* f_out, __nv_bfloat16* h, std::uint8_t* u, float* fmax) {
              if (r == 0) comms[0].group_start();
              comms[r].all_reduce_sum(f, f_out, n, streams[r]);
              comms[r].all_reduce_sum(h, h, n, streams[r]);
              comms[r].all_reduce_max(u, u, n, streams[r]);
              comms[r].all_reduce_max(fmax, fmax, n, streams[r]);
              if (r == kRanks - 1) comms[0].group_end();
            },
            streams, in_place);
      }
    CHECK_THROWS_AS(comms[0].all_reduce_sum(static_cast<const float*>(nullptr), nullptr, 4, streams[0]), logic_error);
    const int twice[2] = {0, 0};
    CHECK_THROWS_AS((void)cuda::NcclCommunicator::init_all(twice), logic_error);
    for (int r = 0; r < kRanks; ++r) {
      TRIATTN_TEST_CUDA(cudaSetDevice(r));
      (void)cudaStreamDestroy(streams[r]);
    }
    TRIATTN_TEST_CUDA(cudaSetDevice(0));
  }

  TEST_CASE("NcclCommunicator: one thread per GPU and all_reduce captured in CUDA graphs") {
    require_two_gpus_and_nccl();
    std::mt19937 rng(seed() + 7);
    constexpr std::size_t n = 65537;
    std::vector<ReduceInputs> in;
    for (int r = 0; r < kRanks; ++r) in.push_back(make_inputs(rng, n));
    const cuda::NcclUniqueId id = cuda::NcclCommunicator::create_unique_id();
    std::vector<std::vector<float>> sums(kRanks), maxes(kRanks);
    std::vector<std::exception_ptr> thrown(kRanks);
    std::vector<cudaError_t> status(kRanks, cudaErrorUnknown);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        try {
          TRIATTN_CUDA_TRY(cudaSetDevice(r));
          cuda::NcclCommunicator comm(kRanks, r, id);
          if (comm.rank() != r || comm.size() != kRanks || comm.device() != r)
            throw std::runtime_error("communicator reports the wrong rank, size or device");
          Dev<float> sum(n), mx(n);
          const cudaError_t steps[] = {sum.status, mx.status, sum.upload(in[r].f), mx.upload(in[r].f)};
          for (const cudaError_t e : steps) TRIATTN_CUDA_TRY(e);
          cudaStream_t stream = nullptr;
          TRIATTN_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          TRIATTN_CUDA_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          comm.group_start();
          comm.all_reduce_sum(sum.p, sum.p, n, stream);
          comm.all_reduce_max(mx.p, mx.p, n, stream);
          comm.group_end();
          TRIATTN_CUDA_TRY(cudaStreamEndCapture(stream, &graph));
          TRIATTN_CUDA_TRY(cudaGraphInstantiate(&exec, graph, 0));
          TRIATTN_CUDA_TRY(cudaGraphLaunch(exec, stream));
          TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream));
          TRIATTN_CUDA_TRY(sum.download(sums[r]));
          TRIATTN_CUDA_TRY(mx.download(maxes[r]));
          (void)cudaGraphExecDestroy(exec);
          (void)cudaGraphDestroy(graph);
          (void)cudaStreamDestroy(stream);
          status[r] = cudaSuccess;
        } catch (...) {
          thrown[r] = std::current_exception();
        }
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      REQUIRE_MESSAGE(!thrown[r], "rank ", r, " threw: ", what(thrown[r]));
      TRIATTN_TEST_CUDA(status[r]);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i)
        bad += sums[r][i] != in[0].f[i] + in[1].f[i] || maxes[r][i] != std::max(in[0].f[i], in[1].f[i]);
      CHECK_MESSAGE(bad == 0, "rank ", r, ": ", bad, " graph-replayed reductions wrong");
    }
    TRIATTN_TEST_CUDA(cudaSetDevice(0));
  }

  TEST_CASE_TEMPLATE("tp=2 rounds on two GPUs with the NCCL agreement keep the tp=1 tokens in every mode", T, float,
                     bf16_storage) {
    require_two_gpus_and_nccl();
    const std::uint32_t s = seed();
    const int devices[kRanks] = {0, 1};
    std::vector<cuda::NcclCommunicator> comms = cuda::NcclCommunicator::init_all(devices);
    int i = 0;
    for (const TpCase& c : all_mode_cases()) check_round_tp2<T>(c, s + static_cast<std::uint32_t>(i++), comms);
  }

  TEST_CASE("tp=2 on two GPUs: Qwen3-8B-like heads in union mode with head_dim 64 and max aggregation") {
    require_two_gpus_and_nccl();
    const std::uint32_t s = seed();
    TpCase c;
    c.L = 2;
    c.Hq = 32;
    c.Hkv = 8;
    c.lens = {700, 512, 1000};
    c.prompts = {100, 0, 0};
    c.sp = sel(512, PruningMode::kUnion, PromptMode::kPinnedInBudget, 4, 64);
    const int devices[kRanks] = {0, 1};
    std::vector<cuda::NcclCommunicator> comms = cuda::NcclCommunicator::init_all(devices);
    check_round_tp2<bf16_storage>(c, s, comms);
    c.agg = Aggregation::kMax;
    c.d = 64;
    check_round_tp2<float>(c, s + 1, comms);
  }

  TEST_CASE("tp=2 on two GPUs: bf16 max aggregation with head_dim 128 (large dynamic shared memory on both GPUs)") {
    // The tensor-core max scorer needs > 48 KB of dynamic shared memory here, an attribute set
    // per device: GPU 0's round must not leave GPU 1 without it.
    require_two_gpus_and_nccl();
    TpCase c;
    c.agg = Aggregation::kMax;
    c.sp = sel(200, PruningMode::kUnion, PromptMode::kPinnedOnTop, 4, 16);
    const int devices[kRanks] = {0, 1};
    std::vector<cuda::NcclCommunicator> comms = cuda::NcclCommunicator::init_all(devices);
    check_round_tp2<bf16_storage>(c, seed() + 11, comms);
  }
}

// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: one rank of a tensor-parallel group on one GPU, over NCCL loaded at run time.
//
// Nothing links NCCL and no nccl.h is needed: the library is dlopen()ed on first use
// ("libnccl.so.2", or the path in TRIATTN_NCCL_LIBRARY) and the few ABI types it needs are
// declared below from the public NCCL 2.x ABI (nccl.h of NCCL >= 2.10, checked against 2.28):
//   ncclUniqueId   struct { char internal[128]; }        (NCCL_UNIQUE_ID_BYTES = 128)
//   ncclComm_t     opaque pointer
//   ncclResult_t   ncclSuccess = 0 ... ncclInProgress = 7
//   ncclDataType_t ncclUint8 = 1, ncclFloat32 = 7, ncclBfloat16 = 9 (2.10+)
//   ncclRedOp_t    ncclSum = 0, ncclMax = 2
// C enums are passed as int (same size and calling convention). The library handle is never
// closed: NCCL keeps helper threads alive for the life of the process.
//
// NVLink multicast (NVLS) stays off: before NCCL is loaded, NCCL_NVLS_ENABLE=0 is put into the
// environment unless the caller already set it. A program using NVLS can put a shared host's GPUs
// out of service. NCCL_RUNTIME_CONNECT=0 is set the same way, so that a communicator's first
// collective can be captured in a CUDA graph. Load NCCL (available(), create_unique_id(),
// init_all()) before starting other threads that read the environment: setenv is not thread-safe.
#pragma once

#include <cuda_bf16.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/cuda/config.cuh>
#include <triattn/cuda/error.cuh>

namespace triattn {

/// An NCCL call failed (or NCCL could not be loaded). code() is the ncclResult_t value (or -1
/// when the library itself is missing).
class nccl_error : public error {
 public:
  nccl_error(const std::string& what, int code) : error(what), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

}  // namespace triattn

namespace triattn::cuda {

/// The bytes of an ncclUniqueId: rank 0 creates it, every rank receives a copy.
struct NcclUniqueId {
  char bytes[128];
};
static_assert(sizeof(NcclUniqueId) == 128 && alignof(NcclUniqueId) == 1 && std::is_trivially_copyable_v<NcclUniqueId>,
              "NcclUniqueId must have the layout of ncclUniqueId (char[NCCL_UNIQUE_ID_BYTES = 128])");

/// ncclDataType_t values this library uses (public ABI).
enum class NcclDataType : int { kUint8 = 1, kFloat32 = 7, kBfloat16 = 9 };
/// ncclRedOp_t values this library uses (public ABI).
enum class NcclReduceOp : int { kSum = 0, kMax = 2 };

namespace detail {

inline constexpr int kNcclSuccess = 0;
inline constexpr int kNcclInvalidUsage = 5;  // ncclInvalidUsage: returned here when NCCL is not loaded

struct NcclLibrary {
  using GetVersion = int (*)(int*);
  using GetUniqueId = int (*)(NcclUniqueId*);
  using CommInitRank = int (*)(void** comm, int nranks, NcclUniqueId id, int rank);  // id by value, as in nccl.h
  using CommFree = int (*)(void* comm);
  using AllReduce = int (*)(const void* send, void* recv, std::size_t count, int dtype, int op, void* comm,
                            cudaStream_t stream);
  using Group = int (*)();
  using GetErrorString = const char* (*)(int result);
  using GetLastError = const char* (*)(void* comm);

  std::string path;
  std::string problem;  // empty when usable
  int version = 0;      // ncclGetVersion: major * 10000 + minor * 100 + patch
  GetVersion get_version = nullptr;
  GetUniqueId get_unique_id = nullptr;
  CommInitRank comm_init_rank = nullptr;
  CommFree comm_destroy = nullptr;
  CommFree comm_abort = nullptr;
  AllReduce all_reduce = nullptr;
  Group group_start = nullptr;
  Group group_end = nullptr;
  GetErrorString get_error_string = nullptr;
  GetLastError get_last_error = nullptr;  // optional (NCCL 2.13+)
};

/// Loaded once per process (thread-safe static initialisation); a failure is remembered.
inline const NcclLibrary& nccl_library() {
  static const NcclLibrary lib = [] {
    NcclLibrary l;
    // Before NCCL can read its environment: multicast off unless the caller decided otherwise.
    (void)::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    // Connect peers at init, not at the first collective: that one may be inside a CUDA graph
    // capture, where NCCL's peer setup fails ("operation not permitted when stream is
    // capturing" with lazy connection).
    (void)::setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
    const char* env = std::getenv("TRIATTN_NCCL_LIBRARY");
    l.path = env != nullptr && env[0] != '\0' ? env : "libnccl.so.2";
    void* h = ::dlopen(l.path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* why = ::dlerror();
      l.problem = "dlopen(\"" + l.path + "\") failed: " + (why ? why : "unknown error") +
                  " (install NCCL 2.10+, or set TRIATTN_NCCL_LIBRARY to the path of libnccl.so.2)";
      return l;
    }
    const auto sym = [&](const char* name, auto& fn, bool required) {
      void* p = ::dlsym(h, name);
      if (p == nullptr && required && l.problem.empty()) l.problem = l.path + " has no symbol " + name;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym("ncclGetVersion", l.get_version, true);
    sym("ncclGetUniqueId", l.get_unique_id, true);
    sym("ncclCommInitRank", l.comm_init_rank, true);
    sym("ncclCommDestroy", l.comm_destroy, true);
    sym("ncclCommAbort", l.comm_abort, true);
    sym("ncclAllReduce", l.all_reduce, true);
    sym("ncclGroupStart", l.group_start, true);
    sym("ncclGroupEnd", l.group_end, true);
    sym("ncclGetErrorString", l.get_error_string, true);
    sym("ncclGetLastError", l.get_last_error, false);
    if (l.problem.empty() && l.get_version(&l.version) != kNcclSuccess) l.problem = "ncclGetVersion failed";
    if (l.problem.empty() && l.version < 21000)  // ncclBfloat16 = 9 appeared in 2.10
      l.problem = l.path + " is NCCL " + std::to_string(l.version) + "; triattn needs NCCL 2.10 or newer";
    return l;  // the handle stays open for the life of the process (NCCL's threads use it)
  }();
  return lib;
}

/// The loaded library. @throws nccl_error (code -1) naming why NCCL is unusable.
inline const NcclLibrary& require_nccl(const char* what) {
  const NcclLibrary& l = nccl_library();
  if (!l.problem.empty()) throw nccl_error(std::string("triattn: ") + what + ": NCCL is unavailable: " + l.problem, -1);
  return l;
}

}  // namespace detail

/// One rank of an NCCL communicator, bound to one CUDA device. Move-only; the destructor calls
/// ncclCommDestroy (synchronise the streams that used it first).
class NcclCommunicator {
 public:
  /// True when libnccl.so.2 (or TRIATTN_NCCL_LIBRARY) loads, has every symbol used here and is
  /// NCCL 2.10 or newer. Loading sets NCCL_NVLS_ENABLE=0 unless it was set.
  [[nodiscard]] static bool available() noexcept {
    try {
      return detail::nccl_library().problem.empty();
    } catch (...) {  // allocation failure while building a message
      return false;
    }
  }

  /// Why NCCL is unavailable ("" when it is available).
  [[nodiscard]] static std::string unavailable_reason() { return detail::nccl_library().problem; }

  /// NCCL's version code (major * 10000 + minor * 100 + patch). @throws nccl_error when unavailable.
  [[nodiscard]] static int version() { return detail::require_nccl("NcclCommunicator::version").version; }

  /// A fresh id for a new communicator (ncclGetUniqueId); made once, copied to every rank.
  /// @throws nccl_error naming the call and NCCL's message.
  [[nodiscard]] static NcclUniqueId create_unique_id() {
    const detail::NcclLibrary& l = detail::require_nccl("ncclGetUniqueId");
    NcclUniqueId id{};
    check(l.get_unique_id(&id), "ncclGetUniqueId", nullptr);
    return id;
  }

  /// Joins rank `rank` of `size` on the CURRENT CUDA device (ncclCommInitRank). Every rank calls
  /// this concurrently (one thread or process per rank) with the same id; it returns once all
  /// have joined.
  /// @throws logic_error on a bad size/rank, nccl_error naming the call, cuda_error when the
  ///         current device cannot be read.
  NcclCommunicator(int size, int rank, const NcclUniqueId& id) : size_(size), rank_(rank) {
    TRIATTN_EXPECTS(size >= 1 && rank >= 0 && rank < size,
                    "NcclCommunicator: rank " + std::to_string(rank) + " must be in [0, size = " + std::to_string(size) +
                        ") with size >= 1");
    const detail::NcclLibrary& l = detail::require_nccl("ncclCommInitRank");
    TRIATTN_CUDA_TRY(cudaGetDevice(&device_));
    void* comm = nullptr;
    const int r = l.comm_init_rank(&comm, size, id, rank);
    if (r != detail::kNcclSuccess) {
      if (comm != nullptr) (void)l.comm_abort(comm);
      check(r, "ncclCommInitRank(size " + std::to_string(size) + ", rank " + std::to_string(rank) + ", device " +
                   std::to_string(device_) + ")",
            nullptr);
    }
    comm_ = comm;
  }

  /// All ranks of a single-process group from one thread: rank i on device devices[i] (a group of
  /// ncclCommInitRank calls, as ncclCommInitAll does). The caller's current device is kept.
  /// @throws logic_error for an empty list or a bad/duplicate device, nccl_error naming the call.
  [[nodiscard]] static std::vector<NcclCommunicator> init_all(std::span<const int> devices) {
    const int n = static_cast<int>(devices.size());
    TRIATTN_EXPECTS(n >= 1, "NcclCommunicator::init_all: the device list is empty");
    int count = 0;
    TRIATTN_CUDA_TRY(cudaGetDeviceCount(&count));
    for (int i = 0; i < n; ++i) {
      TRIATTN_EXPECTS(devices[i] >= 0 && devices[i] < count,
                      "NcclCommunicator::init_all: device " + std::to_string(devices[i]) + " (rank " +
                          std::to_string(i) + ") is not in [0, " + std::to_string(count) + ")");
      for (int j = 0; j < i; ++j)
        TRIATTN_EXPECTS(devices[j] != devices[i], "NcclCommunicator::init_all: device " + std::to_string(devices[i]) +
                                                      " is listed twice (ranks " + std::to_string(j) + " and " +
                                                      std::to_string(i) + ")");
    }
    const detail::NcclLibrary& l = detail::require_nccl("NcclCommunicator::init_all");
    int saved = 0;
    TRIATTN_CUDA_TRY(cudaGetDevice(&saved));
    // Make every device current once before the group: a failure inside the group would leave
    // the ranks already started waiting for the missing ones.
    for (int i = 0; i < n; ++i) {
      const cudaError_t e = cudaSetDevice(devices[i]);
      if (e != cudaSuccess) {
        (void)cudaSetDevice(saved);
        TRIATTN_CUDA_TRY(e);
      }
    }
    TRIATTN_CUDA_TRY(cudaSetDevice(saved));
    const NcclUniqueId id = create_unique_id();
    // Allocated before any communicator exists, so nothing below can leak one on bad_alloc.
    std::vector<NcclCommunicator> out;
    out.reserve(static_cast<std::size_t>(n));
    std::vector<void*> comms(static_cast<std::size_t>(n), nullptr);
    int status = l.group_start();
    int failed_rank = -2;  // -2 ncclGroupStart, -1 ncclGroupEnd, else the rank whose InitRank failed
    cudaError_t cuda_status = cudaSuccess;
    if (status == detail::kNcclSuccess) {
      for (int i = 0; i < n; ++i) {
        const cudaError_t e = cudaSetDevice(devices[i]);
        if (e != cudaSuccess && cuda_status == cudaSuccess) cuda_status = e;
        const int r = l.comm_init_rank(&comms[static_cast<std::size_t>(i)], n, id, i);
        if (r != detail::kNcclSuccess && status == detail::kNcclSuccess) {
          status = r;
          failed_rank = i;
        }
      }
      const int e = l.group_end();  // always closes the group
      if (e != detail::kNcclSuccess && status == detail::kNcclSuccess) {
        status = e;
        failed_rank = -1;
      }
    }
    const cudaError_t restore = cudaSetDevice(saved);
    if (status != detail::kNcclSuccess || cuda_status != cudaSuccess || restore != cudaSuccess) {
      for (void* c : comms)
        if (c != nullptr) (void)l.comm_abort(c);
      if (cuda_status != cudaSuccess) TRIATTN_CUDA_TRY(cuda_status);
      if (restore != cudaSuccess) TRIATTN_CUDA_TRY(restore);
      check(status,
            failed_rank == -2   ? std::string("ncclGroupStart")
            : failed_rank == -1 ? "ncclGroupEnd (after ncclCommInitRank of " + std::to_string(n) + " ranks)"
                                : "ncclCommInitRank(size " + std::to_string(n) + ", rank " + std::to_string(failed_rank) +
                                      ", device " + std::to_string(devices[failed_rank]) + ")",
            nullptr);
    }
    for (int i = 0; i < n; ++i) out.push_back(NcclCommunicator(comms[static_cast<std::size_t>(i)], n, i, devices[i]));
    return out;
  }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  NcclCommunicator(NcclCommunicator&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)), size_(o.size_), rank_(o.rank_), device_(o.device_) {}
  NcclCommunicator& operator=(NcclCommunicator&& o) noexcept {
    if (this != &o) {
      destroy();
      comm_ = std::exchange(o.comm_, nullptr);
      size_ = o.size_;
      rank_ = o.rank_;
      device_ = o.device_;
    }
    return *this;
  }
  ~NcclCommunicator() { destroy(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// CUDA device this rank runs on.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The ncclComm_t (null after a move), for calls this class does not wrap.
  [[nodiscard]] void* native_handle() const noexcept { return comm_; }

  // Element-wise all-reduces: asynchronous on `stream` (a stream of this rank's device), in place
  // allowed (send == recv), capturable in a CUDA graph. Every rank calls the same sequence with
  // the same counts. @throws nccl_error naming the call on failure, logic_error on null buffers.

  /// @param send [count] @param recv [count]
  void all_reduce_sum(const float* send, float* recv, std::size_t count, cudaStream_t stream) {
    all_reduce(send, recv, count, NcclDataType::kFloat32, NcclReduceOp::kSum, stream, "ncclAllReduce(float, sum)");
  }
  /// @param send [count] @param recv [count]; summed in bf16 as NCCL does (rank order not fixed)
  void all_reduce_sum(const __nv_bfloat16* send, __nv_bfloat16* recv, std::size_t count, cudaStream_t stream) {
    all_reduce(send, recv, count, NcclDataType::kBfloat16, NcclReduceOp::kSum, stream, "ncclAllReduce(bf16, sum)");
  }
  /// @param send [count] @param recv [count]
  void all_reduce_max(const float* send, float* recv, std::size_t count, cudaStream_t stream) {
    all_reduce(send, recv, count, NcclDataType::kFloat32, NcclReduceOp::kMax, stream, "ncclAllReduce(float, max)");
  }
  /// @param send [count] @param recv [count]
  void all_reduce_max(const std::uint8_t* send, std::uint8_t* recv, std::size_t count, cudaStream_t stream) {
    all_reduce(send, recv, count, NcclDataType::kUint8, NcclReduceOp::kMax, stream, "ncclAllReduce(uint8, max)");
  }

  /// ncclGroupStart / ncclGroupEnd: the calls between them are fused into one launch (per thread,
  /// not per communicator). @throws nccl_error on failure.
  void group_start() { check(group_start_status(), "ncclGroupStart", nullptr); }
  void group_end() { check(group_end_status(), "ncclGroupEnd", comm_); }

  // No-throw forms for launch paths (cudaError_t-returning code): they return the ncclResult_t
  // value (0 = success); status_message() turns it into text.

  /// @param send [count] elements of `type` @param recv [count]
  [[nodiscard]] int all_reduce_status(const void* send, void* recv, std::size_t count, NcclDataType type,
                                      NcclReduceOp op, cudaStream_t stream) const noexcept {
    if (comm_ == nullptr) return detail::kNcclInvalidUsage;
    if (count == 0) return detail::kNcclSuccess;
    return detail::nccl_library().all_reduce(send, recv, count, static_cast<int>(type), static_cast<int>(op), comm_,
                                             stream);
  }
  [[nodiscard]] static int group_start_status() noexcept {
    const detail::NcclLibrary* l = loaded();
    return l ? l->group_start() : detail::kNcclInvalidUsage;
  }
  [[nodiscard]] static int group_end_status() noexcept {
    const detail::NcclLibrary* l = loaded();
    return l ? l->group_end() : detail::kNcclInvalidUsage;
  }
  /// "ncclUnhandledCudaError: <NCCL's string> (<NCCL's last error>)" for a status of this rank.
  [[nodiscard]] std::string status_message(int status) const { return describe(status, comm_); }

 private:
  NcclCommunicator(void* comm, int size, int rank, int device) noexcept
      : comm_(comm), size_(size), rank_(rank), device_(device) {}

  static const detail::NcclLibrary* loaded() noexcept {
    try {
      const detail::NcclLibrary& l = detail::nccl_library();
      return l.problem.empty() ? &l : nullptr;
    } catch (...) {
      return nullptr;
    }
  }

  static std::string describe(int status, void* comm) {
    const detail::NcclLibrary* l = loaded();
    std::string s = "ncclResult_t " + std::to_string(status);
    if (l != nullptr && l->get_error_string != nullptr) {
      const char* text = l->get_error_string(status);
      if (text != nullptr) s += " (" + std::string(text) + ")";
    }
    if (l != nullptr && l->get_last_error != nullptr) {
      const char* last = l->get_last_error(comm);
      if (last != nullptr && last[0] != '\0') s += ": " + std::string(last);
    }
    return s;
  }

  static void check(int status, const std::string& call, void* comm) {
    if (status != detail::kNcclSuccess) throw nccl_error("triattn: " + call + " failed: " + describe(status, comm), status);
  }

  void all_reduce(const void* send, void* recv, std::size_t count, NcclDataType type, NcclReduceOp op,
                  cudaStream_t stream, const char* what) {
    TRIATTN_EXPECTS(comm_ != nullptr, std::string(what) + ": the communicator was moved from");
    TRIATTN_EXPECTS(count == 0 || (send != nullptr && recv != nullptr),
                    std::string(what) + ": null buffer for " + std::to_string(count) + " elements");
    check(all_reduce_status(send, recv, count, type, op, stream), std::string(what) + " of " + std::to_string(count) +
                                                                      " elements on rank " + std::to_string(rank_),
          comm_);
  }

  void destroy() noexcept {
    if (comm_ == nullptr) return;
    if (const detail::NcclLibrary* l = loaded()) (void)l->comm_destroy(comm_);
    comm_ = nullptr;
  }

  void* comm_ = nullptr;  // ncclComm_t
  int size_ = 0;
  int rank_ = 0;
  int device_ = 0;
};

}  // namespace triattn::cuda

// SPDX-License-Identifier: Apache-2.0
// The step recorder behind CudaBackend (cuda_backend.cuh): the backend's calls of one step are
// recorded as plain-data ops and launched at a flush, where what the model does back to back is
// fused:
//   matmul q, k, v (same x) + their biases       -> one GEMV launch, bias in the epilogue
//   matmul wo + add(x, ·)                         -> GEMV with a residual epilogue
//   matmul w1, w3 + swiglu                        -> one GEMV, gate and up rows in one warp
//   matmul w2 + add(x, ·)                         -> GEMV with a residual epilogue
//   rope q, rope k, write_kv of every chunk       -> one RoPE kernel + triattn append (run_slots)
//   rmsnorm + matmul per picked row (classifier)  -> one RMSNorm + one GEMV over the picked rows
// Flushes happen when the layers are done (the model's 2 * n_layers residual adds), at
// host_view(), alloc(), the next step's embed() and synchronize(). A step whose rows are all
// decode rows is padded to its batch bucket (decode_graphs.cuh: one graph per power of two
// serves every batch size in it), captured into a CUDA graph at that first flush and replayed
// afterwards while the op list (pointers, shapes, decode-attention plan) stays the same; per-step data (token
// ids, positions, slots, sequence ids) lives in a device arena uploaded before each launch, and
// the block tables are published (cuda::publish) at the step's first write_kv. Kernels are
// launched with programmatic dependent launch: each GEMV fetches its first weights while the
// previous kernel drains. The GEMV kernels live in cuda_kernels.cuh and gemv_stream_kernel.cuh.
// fp8 e4m3 caches (kv_storage_types below) take the float K/V through triattn's quantising append
// (x / the view's scale, saturating) and float queries into its decode attention; their prefill
// rows go to attention_rows_kernel, which dequantises with the view's scales (the tensor-core
// prefill kernel is for 16-bit caches). Head dims triattn's append does not compile (stories260K's
// 8) are written by the backend's own kernels, which quantise fp8 with the same triattn::cuda::quant.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nvtx3/nvToolsExt.h>  // header-only: a no-op unless a profiler (ncu --nvtx) is attached

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/algorithms/decode_attention.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/launch.cuh>

#include "backend.hpp"
#include "cublas_context.cuh"
#include "cuda_kernels.cuh"
#include "gemm_cublas.cuh"
#include "gemv_stream_kernel.cuh"
#include "model_config.hpp"
#include "prefill_attention.cuh"
#include "tp_kernels.cuh"

namespace triattn_example {

/// Storage type of the weight matrices (norm weights and biases stay fp32).
enum class WeightType : int { kF32 = 0, kBF16 = 1 };

[[nodiscard]] inline const char* weight_type_name(WeightType t) noexcept { return t == WeightType::kF32 ? "f32" : "bf16"; }

struct CudaBackendOptions {
  WeightType weights = WeightType::kF32;
  bool graphs = true;            ///< capture decode steps into CUDA graphs and replay them
  /// pad decode steps to power-of-two batch buckets: one graph per bucket (decode_graphs.cuh)
  bool graph_buckets = true;
  bool pdl = true;               ///< programmatic dependent launch between the backend's kernels
  bool fuse = true;              ///< fused epilogues, batched matmuls, RoPE + KV write in one pass
  bool direct_kv_write = false;  ///< the RoPE kernel writes K/V into the cache itself (else triattn's append kernel)
  /// bf16 GEMVs of 1-2 rows: gemv_stream_kernel.cuh variant (0 = warp kernel); -1: TRIATTN_GEMV_VARIANT or the default
  int gemv_variant = -1;
  /// GEMV kernels or cuBLAS per matmul (gemm_cublas.cuh): by row count at the measured crossover
  MatmulPath matmul_path = MatmulPath::kAuto;
  /// Every step's attention through attention_rows_kernel (one warp per row and head), never the
  /// split decode kernel or the tiled prefill kernel: with MatmulPath::kGemv a row's arithmetic
  /// then never depends on the batch (batch_invariant(); slower, for equality checks).
  bool row_attention = false;
};

/// Options whose results do not depend on the batch: a row gives bitwise the same logits alone
/// or beside any other rows (GEMV matmuls, per-row attention).
[[nodiscard]] inline CudaBackendOptions batch_invariant(CudaBackendOptions o) {
  o.matmul_path = MatmulPath::kGemv;
  o.row_attention = true;
  return o;
}

namespace cuda_detail {

struct DeviceFree {
  void operator()(void* p) const noexcept {
    if (p != nullptr) triattn::cuda::report_error(cudaFree(p), "CudaBackend: cudaFree");
  }
};
struct HostFree {
  void operator()(void* p) const noexcept {
    if (p != nullptr) triattn::cuda::report_error(cudaFreeHost(p), "CudaBackend: cudaFreeHost");
  }
};
using DeviceMem = std::unique_ptr<void, DeviceFree>;
using HostMem = std::unique_ptr<void, HostFree>;

inline DeviceMem device_alloc(std::size_t bytes) {
  void* p = nullptr;
  TRIATTN_CUDA_TRY(cudaMalloc(&p, bytes > 0 ? bytes : 1));
  return DeviceMem(p);
}
inline HostMem host_alloc(std::size_t bytes) {
  void* p = nullptr;
  TRIATTN_CUDA_TRY(cudaMallocHost(&p, bytes > 0 ? bytes : 1));
  return HostMem(p);
}

// ---- weight handles -------------------------------------------------------------------------------
// A bf16 tensor's WeightPtrs entry is kHandleBase + (id << kHandleShift): outside any real
// address (non-canonical on x86-64), so Model's float-sized pointer arithmetic on it (layer
// offsets) stays decodable: byte offset / 4 = element offset in the bf16 tensor.
inline constexpr std::uintptr_t kHandleBase = std::uintptr_t{1} << 62;
inline constexpr int kHandleShift = 40;

class HandleTable {
 public:
  static HandleTable& get() {
    static HandleTable t;
    return t;
  }
  std::uint32_t add(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      const std::uint32_t id = free_.back();
      free_.pop_back();
      real_[id] = p;
      return id;
    }
    real_.push_back(p);
    return static_cast<std::uint32_t>(real_.size() - 1);
  }
  void remove(std::uint32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < real_.size()) {
      real_[id] = nullptr;
      free_.push_back(id);
    }
  }
  const void* lookup(std::uint32_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return id < real_.size() ? real_[id] : nullptr;
  }

 private:
  std::mutex mu_;
  std::vector<const void*> real_;
  std::vector<std::uint32_t> free_;
};

inline const float* make_handle(std::uint32_t id) {
  return reinterpret_cast<const float*>(kHandleBase + (static_cast<std::uintptr_t>(id) << kHandleShift));
}

struct ResolvedWeight {
  const void* ptr = nullptr;
  bool bf16 = false;
};

/// Real address (and type) behind a WeightPtrs-derived pointer.
inline ResolvedWeight resolve_weight(const float* h) {
  const auto a = reinterpret_cast<std::uintptr_t>(h);
  if (a < kHandleBase) return {h, false};
  const std::uintptr_t rel = a - kHandleBase;
  const auto id = static_cast<std::uint32_t>(rel >> kHandleShift);
  const std::uintptr_t byte_off = rel & ((std::uintptr_t{1} << kHandleShift) - 1);
  const void* base = HandleTable::get().lookup(id);
  TRIATTN_EXPECTS(base != nullptr && byte_off % sizeof(float) == 0,
                  "CudaBackend: a weight pointer that is neither device memory nor a live bf16 weight handle");
  return {static_cast<const __nv_bfloat16*>(base) + byte_off / sizeof(float), true};
}

// ---- per-step arena: host pinned staging + device copy --------------------------------------------

class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    if (event_ != nullptr) {
      triattn::cuda::report_error(cudaEventSynchronize(event_), "CudaBackend arena: cudaEventSynchronize");
      triattn::cuda::report_error(cudaEventDestroy(event_), "CudaBackend arena: cudaEventDestroy");
    }
  }

  /// Starts a new step: the previous upload must be finished before the staging is rewritten.
  void reset() {
    if (event_ != nullptr) TRIATTN_CUDA_TRY(cudaEventSynchronize(event_));
    used_ = uploaded_ = 0;
  }
  /// Appends `bytes` (aligned to `align`), returns the offset.
  long long push(const void* src, std::size_t bytes, std::size_t align, cudaStream_t stream) {
    std::size_t off = (used_ + align - 1) / align * align;
    if (off + bytes > cap_) grow(off + bytes, stream);
    if (bytes > 0) std::memcpy(static_cast<char*>(host_.get()) + off, src, bytes);
    used_ = off + bytes;
    return static_cast<long long>(off);
  }
  /// Uploads what was pushed since the last upload.
  void upload(cudaStream_t stream) {
    if (used_ <= uploaded_) return;
    if (event_ == nullptr) TRIATTN_CUDA_TRY(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(static_cast<char*>(dev_.get()) + uploaded_, static_cast<char*>(host_.get()) + uploaded_,
                                     used_ - uploaded_, cudaMemcpyHostToDevice, stream));
    TRIATTN_CUDA_TRY(cudaEventRecord(event_, stream));
    uploaded_ = used_;
  }
  template <class T>
  [[nodiscard]] const T* dev(long long off) const {
    return off < 0 ? nullptr : reinterpret_cast<const T*>(static_cast<const char*>(dev_.get()) + off);
  }
  [[nodiscard]] const void* device_base() const noexcept { return dev_.get(); }
  /// What was pushed at `off` (host staging; valid until the next reset).
  template <class T>
  [[nodiscard]] const T* host(long long off) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(host_.get()) + off);
  }

 private:
  void grow(std::size_t need, cudaStream_t stream) {
    std::size_t cap = cap_ > 0 ? cap_ : (std::size_t{1} << 16);
    while (cap < need) cap *= 2;
    // In-flight kernels may still read the old device copy, an in-flight upload the old staging.
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream));
    HostMem h = host_alloc(cap);
    if (used_ > 0) std::memcpy(h.get(), host_.get(), used_);
    host_ = std::move(h);
    dev_ = device_alloc(cap);
    cap_ = cap;
    uploaded_ = 0;  // the new device copy holds nothing yet
  }

  HostMem host_;
  DeviceMem dev_;
  std::size_t cap_ = 0, used_ = 0, uploaded_ = 0;
  cudaEvent_t event_ = nullptr;
};

// ---- recorded ops ----------------------------------------------------------------------------------

enum class OpKind : std::uint8_t { kEmbed = 1, kRmsNorm, kMatmul, kBias, kRope, kWriteKv, kAttention, kSwiglu, kAdd, kAllReduce };
/// Op::flag of an attention: which kernel runs it.
enum AttnKernel : std::uint8_t {
  kAttnRows = 0,     // gpu::attention_rows_kernel (fp32 and fp8 caches, other head dims)
  kAttnDecode = 1,   // triattn's paged decode attention (one row per sequence at its last slot)
  kAttnPrefill = 2,  // gpu::prefill_attention_kernel (tensor cores, 16-bit caches)
};

/// One recorded backend call, plain data (the graph signature is the byte image of the op list).
struct Op {
  OpKind kind;
  std::uint8_t wbf16;   // matmul / embed: bf16 weights
  std::uint8_t dtype;   // write_kv / attention: the cache's triattn::DType
  std::uint8_t flag;    // rope: float32 angles; attention: kAttn* (which kernel)
  std::uint8_t style;   // rope: RopeStyle
  std::uint8_t pad0[3];  // explicit: the byte image has no implicit padding
  int n;                // rows
  int a, b;             // matmul: out_dim, in_dim; rmsnorm/embed/bias: dim; rope: heads, head_dim;
                        // write_kv: kv_dim, num_kv_heads; attention: q heads, kv heads
  int d;                // head_dim (write_kv, attention)
  int layer;
  float eps;
  long long count;      // add / swiglu: elements; attention: prefill tiles, or the decode plan's length bound
  float* y;             // output or in-place target
  const float* x;       // input
  const float* x2;      // add: y; swiglu: up; write_kv: v; rope: float32 frequencies
  const void* w;        // weights, norm weights, bias, float64 frequencies
  long long arena_a;    // embed: tokens; rope: positions; write_kv: slots; attention: row sequences
  long long arena_b;    // attention: row slots
  long long arena_c;    // attention (prefill kernel): PrefillTile array; `count` holds its length
  triattn::KvCacheView<float, std::int32_t> view;  // type-erased cache view (write_kv, attention)
  triattn::cuda::DecodeAttentionPlan plan;
  int spare_seq;        // attention (decode): a sequence slot of length 0 for padding rows, -1: none
  void* q_t;            // attention (decode, 16-bit cache): q converted to the cache type (fp32, fp8: null)
  void* workspace;
  std::size_t workspace_bytes;
};
static_assert(std::is_trivially_copyable_v<Op>);

inline Op make_op(OpKind k) {
  Op o;
  std::memset(static_cast<void*>(&o), 0, sizeof o);
  o.kind = k;
  o.arena_a = o.arena_b = o.arena_c = -1;
  o.spare_seq = -1;
  return o;
}

template <class T>
triattn::KvCacheView<float, std::int32_t> erase_view(const triattn::KvCacheView<T, std::int32_t>& v) {
  return std::bit_cast<triattn::KvCacheView<float, std::int32_t>>(v);
}
template <class T>
triattn::KvCacheView<T, std::int32_t> typed_view(const triattn::KvCacheView<float, std::int32_t>& v) {
  return std::bit_cast<triattn::KvCacheView<T, std::int32_t>>(v);
}

/// Cache dtypes the CUDA backend runs on (CudaBackend::kv_storage_types): every dtype triattn's
/// kernels load, fp8 e4m3 included (its appends quantise float K/V with the view's scales, its
/// decode attention takes float queries; see the file comment). The one list every dtype switch
/// of the backend goes through (dispatch_cache_type).
using kv_storage_types = triattn::device_storage_types;

/// Calls f(type_identity<storage T>, type_identity<device T>) for a cache dtype.
template <class F>
void dispatch_cache_type(triattn::DType dt, F&& f) {
  triattn::cuda::dispatch_dtype(kv_storage_types{}, dt, "the reference transformer's CudaBackend", [&](auto tag) {
    using T = typename decltype(tag)::type;
    f(tag, std::type_identity<triattn::cuda::device_type_t<T>>{});
  });
}

/// True when triattn's decode attention over a cache of `dt` takes q converted to the cache type
/// (16-bit caches: the backend converts it first, into Op::q_t), false when it takes the float q
/// itself (fp32; fp8, whose queries stay float: triattn::cuda::query_type_t).
inline bool converts_query(triattn::DType dt) {
  bool r = false;
  dispatch_cache_type(dt, [&](auto st, auto) {
    using ST = typename decltype(st)::type;
    r = !std::is_same_v<triattn::cuda::query_type_t<ST>, float>;
  });
  return r;
}

/// True when the codes of a cache of `dt` carry a scale (fp8).
inline bool scaled_cache(triattn::DType dt) {
  bool r = false;
  dispatch_cache_type(dt, [&](auto st, auto) { r = triattn::is_scaled_dtype<typename decltype(st)::type>; });
  return r;
}

/// True when K/V of a cache of `dt` with `head_dim` go through triattn's append kernel, false
/// when the backend's own kernels write them (the RoPE kernel's direct write, write_kv_kernel):
/// head dims triattn's append does not compile, or CudaBackendOptions::direct_kv_write. A scaled
/// (fp8) cache takes the library's quantising append wherever it compiles the head_dim, whatever
/// direct_kv_write says.
inline bool library_append(triattn::DType dt, int head_dim, bool direct_kv_write) {
  return triattn::cuda::is_supported_head_dim(head_dim) && (!direct_kv_write || scaled_cache(dt));
}

/// True when triattn's append takes the float K/V as they are for a cache of storage type ST
/// (fp32: a copy; fp8: quantised by the view's scales), false when it copies K/V converted to the
/// cache type first (16-bit caches: the RoPE kernel writes those copies into scratch).
template <class ST>
inline constexpr bool append_takes_float_v = std::is_same_v<ST, float> || triattn::is_scaled_dtype<ST>;
/// append_takes_float_v of a cache dtype.
inline bool append_takes_float(triattn::DType dt) {
  bool r = false;
  dispatch_cache_type(dt, [&](auto st, auto) { r = append_takes_float_v<typename decltype(st)::type>; });
  return r;
}

inline bool aligned16(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }


/// Why a flush happens: only the end of a step's layers may capture a CUDA graph.
enum class FlushReason { kLayersDone, kOther };

struct RecorderStats {
  std::uint64_t graph_captures = 0;  ///< steps captured into a new graph
  std::uint64_t graph_replays = 0;   ///< steps replayed from a captured graph (captures included)
  std::uint64_t padded_steps = 0;    ///< decode steps padded to their batch bucket (decode_graphs.cuh)
  std::uint64_t eager_flushes = 0;   ///< flushes launched kernel by kernel
  std::uint64_t kernels = 0;         ///< kernels the backend launched itself (outside replays)
  std::uint64_t prefill_attention = 0;  ///< attention ops run by the tensor-core prefill kernel
  /// Device time of the timed steps (CUDA events: a step's first launch to its results on the
  /// host, see StepRecorder::finish_step_and_wait) and how many steps were timed.
  double device_seconds = 0.0;
  std::uint64_t timed_steps = 0;
};

/// Tensor parallelism: an in-place sum of `count` device floats over the ranks on `stream`.
using AllReduceFn = std::function<void(float* x, std::size_t count, cudaStream_t stream)>;

}  // namespace cuda_detail
}  // namespace triattn_example

// Padding of decode steps to batch buckets: needs the op list above, used by the flush below.
#include "decode_graphs.cuh"

namespace triattn_example {
namespace cuda_detail {

/// CudaBackend's state, shared by its copies: the stream, the recorded ops of the open step, the
/// per-step arena, scratch buffers and the captured graphs.

class StepRecorder {
 public:
  using Options = CudaBackendOptions;
  static constexpr int kPlanGranule = 512;
  enum ScratchId : int { kQt = 0, kKt, kVt, kWorkspace, kXt, kIds, kScratchCount };

  struct RowInfo {
    long long pos = -1, seq = -1, slot = -1;
    long long tiles = -1;  // gpu::PrefillTile array of the rows (prefill_attention.cuh), by prefill_tiles
    int n_tiles = 0;
    int tiles_group = 0;   // the GQA group the tiles were cut for
  };
  struct RopeDev {
    const RopeTables* key = nullptr;
    std::vector<double> inv64;
    std::vector<float> inv32;
    cuda_detail::DeviceMem mem;
    const double* d64 = nullptr;
    const float* d32 = nullptr;
  };
  struct SlotMemo {
    triattn::SeqId seq;
    int first_slot, n;
    long long off;
  };
  struct Graph {
    std::vector<unsigned char> sig;
    cudaGraphExec_t exec = nullptr;
    std::uint64_t used = 0;
  };

  Options opt;
  cudaStream_t stream = nullptr;
  int sms = 0;
  std::vector<cuda_detail::Op> ops;
  bool step_open = false;
  bool mid_flush = false;
  int adds = 0;
  int n_layers = 0;
  const void* published_cache = nullptr;
  cuda_detail::Arena arena;
  std::vector<TokenInfo> rows_copy;
  RowInfo rows_info;
  std::vector<std::int32_t> rows_seq, rows_slot;  // host copies of rows_info.seq / .slot
  std::vector<SlotMemo> slot_memo;
  std::size_t slot_cursor = 0;
  std::vector<RopeDev> ropes;
  cuda_detail::DeviceMem scratch_mem[kScratchCount];
  std::size_t scratch_bytes[kScratchCount] = {};
  std::vector<cuda_detail::DeviceMem> retired;
  cuda_detail::HostMem host_buf;
  std::size_t host_bytes = 0;
  cuda_detail::HostMem ids_buf;  // pinned: argmax_host's token ids
  std::size_t ids_bytes = 0;
  // Step timing: begin_step arms, the step's first launch records ev_begin, the copy of its
  // results to the host records ev_end (finish_step_and_wait).
  enum class StepClock { kIdle, kArmed, kRunning };
  StepClock clock = StepClock::kIdle;
  cudaEvent_t ev_begin = nullptr, ev_end = nullptr;
  std::vector<Graph> graphs;
  std::uint64_t tick = 0;
  std::map<std::pair<int, int>, int> resident;
  std::vector<unsigned char> seen;
  RecorderStats stats;
  int tp_size = 1;
  AllReduceFn all_reduce;  // empty: a single rank
  std::unique_ptr<CublasContext> cublas;  // created at the first matmul that goes to cuBLAS
  BufferMap buffers;  // the activation buffers alloc() handed out (padding stays inside them)
  const void* spare_cache = nullptr;  // the cache whose spare slot was looked up this step
  int spare = -1;

  explicit StepRecorder(const Options& o) : opt(o) {
    TRIATTN_CUDA_TRY(cudaStreamCreate(&stream));  // blocking: legacy-stream copies wait for it
    TRIATTN_CUDA_TRY(triattn::cuda::current_device_sm_count(&sms));
  }
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;
  ~StepRecorder() {
    triattn::cuda::report_error(cudaStreamSynchronize(stream), "CudaBackend: cudaStreamSynchronize");
    if (ev_begin != nullptr) triattn::cuda::report_error(cudaEventDestroy(ev_begin), "CudaBackend: cudaEventDestroy");
    if (ev_end != nullptr) triattn::cuda::report_error(cudaEventDestroy(ev_end), "CudaBackend: cudaEventDestroy");
    for (Graph& g : graphs) triattn::cuda::report_error(cudaGraphExecDestroy(g.exec), "CudaBackend: cudaGraphExecDestroy");
    graphs.clear();
    cublas.reset();  // before its stream
    triattn::cuda::report_error(cudaStreamDestroy(stream), "CudaBackend: cudaStreamDestroy");
  }

  void set_model(const ModelConfig& c) { n_layers = c.n_layers; }

  // ---- step bookkeeping ----

  void begin_step() {
    flush(FlushReason::kOther);
    arena.reset();
    rows_copy.clear();
    rows_info = RowInfo{};
    slot_memo.clear();
    slot_cursor = 0;
    published_cache = nullptr;
    adds = 0;
    step_open = true;
    mid_flush = false;
    spare_cache = nullptr;
    clock = StepClock::kArmed;
  }

  /// The step's first launch: its device time starts here (not at begin_step: the device idles
  /// while the host records the layers).
  void start_clock() {
    if (clock != StepClock::kArmed) return;
    if (ev_begin == nullptr) TRIATTN_CUDA_TRY(cudaEventCreate(&ev_begin));
    if (ev_end == nullptr) TRIATTN_CUDA_TRY(cudaEventCreate(&ev_end));
    TRIATTN_CUDA_TRY(cudaEventRecord(ev_begin, stream));
    clock = StepClock::kRunning;
  }

  /// After the copy of a step's results to the host was enqueued: waits for the stream (the
  /// step's only wait) and adds the step's device time to stats.
  void finish_step_and_wait() {
    const bool timed = clock == StepClock::kRunning;
    if (timed) TRIATTN_CUDA_TRY(cudaEventRecord(ev_end, stream));
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream));
    if (!timed) return;
    clock = StepClock::kIdle;
    float ms = 0.0f;
    TRIATTN_CUDA_TRY(cudaEventElapsedTime(&ms, ev_begin, ev_end));
    stats.device_seconds += static_cast<double>(ms) * 1e-3;
    ++stats.timed_steps;
  }

  /// Device buffer for n token ids (argmax_host).
  void* ids_scratch(std::size_t bytes) { return scratch(kIds, bytes); }
  /// Pinned host buffer for token ids (argmax_host).
  void* ids_pinned(std::size_t bytes) {
    if (bytes > ids_bytes) {
      ids_buf = cuda_detail::host_alloc(bytes);
      ids_bytes = bytes;
    }
    return ids_buf.get();
  }

  /// After the arena was rebuilt (pad_decode_step): later calls of the step push their rows again.
  void forget_row_memos() {
    rows_copy.clear();
    rows_info = RowInfo{};
    slot_memo.clear();
    slot_cursor = 0;
  }

  /// A sequence slot of `cache` holding no token (padding rows of a decode step attend to it),
  /// or -1; looked up once per step.
  template <class Cache>
  int spare_seq(const Cache& cache) {
    if (spare_cache == static_cast<const void*>(&cache)) return spare;
    spare_cache = &cache;
    spare = -1;
    const auto lens = cache.host_lengths();
    for (std::size_t s = 0; s < lens.size(); ++s)
      if (lens[s] == 0) {
        spare = static_cast<int>(s);
        break;
      }
    return spare;
  }

  template <class Cache>
  void publish_once(Cache& cache) {
    if (published_cache == static_cast<const void*>(&cache)) return;
    triattn::cuda::publish(cache, stream);  // extend() ran before the layers: upload once per step
    published_cache = &cache;
  }

  /// Positions, sequences and slots of a step's rows, in the arena (once per step).
  RowInfo row_info(std::span<const TokenInfo> rows) {
    if (rows_info.pos >= 0 && rows.size() == rows_copy.size() &&
        std::memcmp(rows.data(), rows_copy.data(), rows.size_bytes()) == 0)
      return rows_info;
    rows_copy.assign(rows.begin(), rows.end());
    rows_info = RowInfo{};  // new rows: the tiles too are rebuilt on demand
    std::vector<long long> pos(rows.size());
    std::vector<std::int32_t>& seq = rows_seq;
    std::vector<std::int32_t>& slot = rows_slot;
    seq.resize(rows.size());
    slot.resize(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      pos[i] = rows[i].pos;
      seq[i] = rows[i].seq;
      slot[i] = rows[i].slot;
    }
    rows_info.pos = arena.push(pos.data(), pos.size() * sizeof(long long), 16, stream);
    rows_info.seq = arena.push(seq.data(), seq.size() * sizeof(std::int32_t), 16, stream);
    rows_info.slot = arena.push(slot.data(), slot.size() * sizeof(std::int32_t), 16, stream);
    return rows_info;
  }

  /// The prefill attention's tiles of the rows of the last row_info call for GQA group `group`
  /// (gpu::build_prefill_tiles), in the arena; built once per step and group.
  RowInfo prefill_tiles(int group) {
    if (rows_info.tiles >= 0 && rows_info.tiles_group == group) return rows_info;
    const std::vector<gpu::PrefillTile> tiles =
        gpu::build_prefill_tiles(rows_seq.data(), rows_slot.data(), static_cast<int>(rows_seq.size()), group);
    rows_info.tiles = arena.push(tiles.data(), tiles.size() * sizeof(gpu::PrefillTile), 16, stream);
    rows_info.n_tiles = static_cast<int>(tiles.size());
    rows_info.tiles_group = group;
    return rows_info;
  }

  /// Slot mapping (block * block_size + offset) of n tokens from first_slot of seq, in the
  /// arena; chunks of one layer get consecutive arrays, later layers reuse them.
  template <class Cache>
  long long slot_mapping(const Cache& cache, triattn::SeqId seq, int first_slot, int n) {
    auto same = [&](const SlotMemo& m) { return m.seq == seq && m.first_slot == first_slot && m.n == n; };
    if (slot_cursor < slot_memo.size() && same(slot_memo[slot_cursor])) return slot_memo[slot_cursor++].off;
    for (std::size_t i = 0; i < slot_memo.size(); ++i)
      if (same(slot_memo[i])) {
        slot_cursor = i + 1;
        return slot_memo[i].off;
      }
    std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
    TRIATTN_EXPECTS(triattn::cuda::append::host_slot_mapping(cache.block_table(seq), cache.config().block_size,
                                                              first_slot, n, slots.data()),
                    "CudaBackend::write_kv: slots [" + std::to_string(first_slot) + ", " +
                        std::to_string(first_slot + n) + ") of sequence " + std::to_string(seq) +
                        " are beyond its blocks (call extend first)");
    const long long off = arena.push(slots.data(), slots.size() * sizeof(std::int64_t), 8, stream);
    slot_memo.push_back(SlotMemo{seq, first_slot, n, off});
    slot_cursor = slot_memo.size();
    return off;
  }

  const RopeDev& rope_tables(const RopeTables& t, int head_dim) {
    const std::size_t F = static_cast<std::size_t>(head_dim / 2);
    TRIATTN_EXPECTS(head_dim % 2 == 0 && t.inv_freq.size() >= F && t.inv_freq_f32.size() >= F,
                    "CudaBackend::rope: RoPE tables shorter than head_dim / 2");
    for (const RopeDev& r : ropes)
      if (r.key == &t && r.inv64.size() == t.inv_freq.size() && r.inv32.size() == t.inv_freq_f32.size() &&
          std::equal(r.inv64.begin(), r.inv64.end(), t.inv_freq.begin()) &&
          std::equal(r.inv32.begin(), r.inv32.end(), t.inv_freq_f32.begin()))
        return r;
    RopeDev r;
    r.key = &t;
    r.inv64 = t.inv_freq;
    r.inv32 = t.inv_freq_f32;
    const std::size_t b64 = r.inv64.size() * sizeof(double), b32 = r.inv32.size() * sizeof(float);
    r.mem = cuda_detail::device_alloc(b64 + b32 + 16);
    char* base = static_cast<char*>(r.mem.get());
    TRIATTN_CUDA_TRY(cudaMemcpy(base, r.inv64.data(), b64, cudaMemcpyHostToDevice));
    TRIATTN_CUDA_TRY(cudaMemcpy(base + (b64 + 15) / 16 * 16, r.inv32.data(), b32, cudaMemcpyHostToDevice));
    r.d64 = reinterpret_cast<const double*>(base);
    r.d32 = reinterpret_cast<const float*>(base + (b64 + 15) / 16 * 16);
    ropes.push_back(std::move(r));
    return ropes.back();
  }

  /// Grow-only scratch buffer; a replaced buffer lives until the next flush has finished.
  void* scratch(int id, std::size_t bytes) {
    if (bytes > scratch_bytes[id]) {
      if (scratch_mem[id]) retired.push_back(std::move(scratch_mem[id]));
      scratch_mem[id] = cuda_detail::device_alloc(bytes);
      scratch_bytes[id] = bytes;
    }
    return scratch_mem[id].get();
  }

  void ensure_host(std::size_t bytes) {
    if (bytes <= host_bytes) return;
    host_buf = cuda_detail::host_alloc(bytes);
    host_bytes = bytes;
  }

  template <class T>
  int resident_ctas(int head_dim) {
    const auto key = std::make_pair(static_cast<int>(triattn::dtype_of<T>), head_dim);
    if (auto it = resident.find(key); it != resident.end()) return it->second;
    int ctas = 0;
    TRIATTN_CUDA_TRY(triattn::cuda::decode_attention::resident_ctas<T>(head_dim, &ctas));
    resident[key] = ctas;
    return ctas;
  }

  template <class... KArgs, class... Args>
  void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem, Args&&... args) {
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
    // Programmatic dependent launch where opt.pdl (triattn falls back to a plain launch where it
    // is refused; the kernels' griddepcontrol instructions are then no-ops).
    const cudaError_t e = triattn::cuda::launch_kernel(kernel, grid, block, smem, stream, opt.pdl, args...);
    TRIATTN_CUDA_TRY(e);
    ++stats.kernels;
  }

  // ---- flush: plan (fuse), upload, launch or replay ----

  void flush(FlushReason why) {
    if (ops.empty()) {
      if (why == FlushReason::kLayersDone) step_open = false;
      return;
    }
    // A decode step (one token per chunk): its launches repeat step after step.
    bool decode_step = why == FlushReason::kLayersDone && step_open && ops.front().kind == cuda_detail::OpKind::kEmbed;
    bool any_write = false;
    for (const cuda_detail::Op& o : ops)
      if (o.kind == cuda_detail::OpKind::kWriteKv) {
        any_write = true;
        decode_step = decode_step && o.n == 1;
      }
    decode_step = decode_step && any_write;
    bool graphable = opt.graphs && decode_step && !mid_flush;
    // Names a decode step's launches for a profiler: ncu --nvtx --nvtx-include "decode_step/".
    struct NvtxRange {
      bool on;
      explicit NvtxRange(bool b) : on(b) { if (on) nvtxRangePushA("decode_step"); }
      ~NvtxRange() { if (on) nvtxRangePop(); }
      NvtxRange(const NvtxRange&) = delete;
      NvtxRange& operator=(const NvtxRange&) = delete;
    } nvtx_range(decode_step);
    if (why == FlushReason::kLayersDone) step_open = false;
    else if (step_open) mid_flush = true;

    if (graphable) {
      if (opt.graph_buckets && !all_reduce) {  // one graph per batch bucket
        const int n = ops.front().n;
        if (pad_decode_step(*this, n, decode_bucket(n))) ++stats.padded_steps;
      }
      // What only the padding reads stays out of the signature (the spare slot moves as
      // sequences come and go; the plan already holds what the length bound decides).
      for (cuda_detail::Op& o : ops)
        if (o.kind == cuda_detail::OpKind::kAttention && o.flag == cuda_detail::kAttnDecode) {
          o.spare_seq = -1;
          o.count = 0;
        }
    }
    if (graphable) {  // a replay needs no planning: the launches are the graph's
      const std::vector<unsigned char> sig = signature();
      for (Graph& g : graphs)
        if (g.sig == sig) {
          start_clock();
          arena.upload(stream);
          g.used = ++tick;
          TRIATTN_CUDA_TRY(cudaGraphLaunch(g.exec, stream));
          ++stats.graph_replays;
          finish_flush();
          return;
        }
    }
    std::vector<std::function<void()>> items;
    plan(items);
    start_clock();
    arena.upload(stream);
    if (graphable) {
      capture(items, signature());  // after planning: it may have replaced scratch buffers
    } else {
      for (auto& f : items) f();
      ++stats.eager_flushes;
    }
    finish_flush();
  }

  void finish_flush() {
    ops.clear();
    if (!retired.empty()) {
      TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream));
      retired.clear();
    }
  }

  /// What a captured graph depends on: the op list (pointers, shapes, plans, arena offsets),
  /// the arena's device address and the scratch buffers the planner adds.
  std::vector<unsigned char> signature() const {
    const void* extra[4] = {arena.device_base(), scratch_mem[kKt].get(), scratch_mem[kVt].get(), scratch_mem[kXt].get()};
    const unsigned char flags[6] = {static_cast<unsigned char>(opt.fuse), static_cast<unsigned char>(opt.pdl),
                                    static_cast<unsigned char>(opt.direct_kv_write),
                                    static_cast<unsigned char>(opt.gemv_variant + 1),
                                    static_cast<unsigned char>(opt.matmul_path),
                                    static_cast<unsigned char>(opt.graph_buckets)};
    std::vector<unsigned char> sig(ops.size() * sizeof(cuda_detail::Op) + sizeof extra + sizeof flags);
    unsigned char* out = sig.data();
    std::memcpy(out, ops.data(), ops.size() * sizeof(cuda_detail::Op));
    out += ops.size() * sizeof(cuda_detail::Op);
    std::memcpy(out, extra, sizeof extra);
    std::memcpy(out + sizeof extra, flags, sizeof flags);
    return sig;
  }

  void capture(const std::vector<std::function<void()>>& items, std::vector<unsigned char> sig) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::string failed;
    cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
      try {
        for (auto& f : items) f();
      } catch (const std::exception& ex) {
        failed = ex.what();
      }
      e = cudaStreamEndCapture(stream, &graph);
      if (failed.empty() && e != cudaSuccess) failed = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(e);
      if (failed.empty()) {
        e = cudaGraphInstantiate(&exec, graph, 0ULL);
        if (e != cudaSuccess) failed = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(e);
      }
      if (graph != nullptr) triattn::cuda::report_error(cudaGraphDestroy(graph), "CudaBackend: cudaGraphDestroy");
    } else {
      failed = std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(e);
    }
    if (!failed.empty()) {
      // Nothing of the step ran yet: run it kernel by kernel, and stop capturing.
      (void)cudaGetLastError();
      std::fprintf(stderr, "CudaBackend: capturing a decode step failed (%s); CUDA graphs off\n", failed.c_str());
      opt.graphs = false;
      for (auto& f : items) f();
      ++stats.eager_flushes;
      return;
    }
    if (graphs.size() >= 8) {  // least recently used goes
      auto lru = std::min_element(graphs.begin(), graphs.end(), [](const Graph& a, const Graph& b) { return a.used < b.used; });
      triattn::cuda::report_error(cudaGraphExecDestroy(lru->exec), "CudaBackend: cudaGraphExecDestroy");
      graphs.erase(lru);
    }
    graphs.push_back(Graph{std::move(sig), exec, ++tick});
    ++stats.graph_captures;
    TRIATTN_CUDA_TRY(cudaGraphLaunch(exec, stream));
    ++stats.graph_replays;
  }

  /// Turns the op list into launches, fusing neighbours (see the file comment).
  void plan(std::vector<std::function<void()>>& items) {
    using cuda_detail::OpKind;
    std::vector<char> q_ready(ops.size(), 0);
    std::size_t i = 0;
    while (i < ops.size()) {
      const cuda_detail::Op& o = ops[i];
      std::size_t used = 0;
      if (opt.fuse) {
        switch (o.kind) {
          case OpKind::kRmsNorm:
            used = plan_classifier(i, items);
            if (used == 0) used = plan_matmul_group(i, items);  // RMSNorm as the GEMV's prologue
            break;
          case OpKind::kMatmul: used = plan_matmul_group(i, items); break;
          case OpKind::kRope: used = plan_rope_group(i, items, q_ready); break;
          default: break;
        }
      }
      if (used == 0) used = plan_single(i, items, q_ready[i] != 0);
      i += used;
    }
  }

  // rmsnorm(row r) + matmul(reading it) repeated for n = 1 rows with the same weights: the
  // classifier over the picked rows. One RMSNorm over a row list + one GEMV over those rows.
  std::size_t plan_classifier(std::size_t i, std::vector<std::function<void()>>& items) {
    using cuda_detail::OpKind;
    const cuda_detail::Op& n0 = ops[i];
    auto pair_at = [&](std::size_t j) {
      if (j + 1 >= ops.size()) return false;
      const cuda_detail::Op& nm = ops[j];
      const cuda_detail::Op& mm = ops[j + 1];
      return nm.kind == OpKind::kRmsNorm && mm.kind == OpKind::kMatmul && nm.n == 1 && mm.n == 1 && nm.w == n0.w &&
             nm.a == n0.a && nm.eps == n0.eps && mm.x == nm.y && mm.b == nm.a && mm.w == ops[i + 1].w &&
             mm.a == ops[i + 1].a && mm.wbf16 == ops[i + 1].wbf16 && (nm.x - n0.x) == (nm.y - n0.y) &&
             mm.y == ops[i + 1].y + (static_cast<long long>(j - i) / 2) * mm.a;
    };
    std::size_t j = i;
    while (pair_at(j)) j += 2;
    const int rows = static_cast<int>((j - i) / 2);
    if (rows < 2 || n0.a % 4 != 0) return 0;
    std::vector<long long> off(static_cast<std::size_t>(rows));
    for (int r = 0; r < rows; ++r) off[static_cast<std::size_t>(r)] = ops[i + 2 * static_cast<std::size_t>(r)].x - n0.x;
    const long long roff = arena.push(off.data(), off.size() * sizeof(long long), 16, stream);
    const cuda_detail::Op norm = n0;
    const cuda_detail::Op mm = ops[i + 1];
    items.push_back([this, norm, rows, roff] {
      launch(gpu::rmsnorm_kernel, dim3(static_cast<unsigned>(rows)), dim3(gpu::kNormThreads), 0, norm.y, norm.x,
             static_cast<const float*>(norm.w), norm.a, norm.eps, arena.dev<long long>(roff), 0LL);
    });
    prepare_matmul(rows, mm.b, mm.wbf16 != 0, true);
    items.push_back([this, norm, mm, rows, roff] {
      gpu::GemvParams p;
      p.nseg = 1;
      p.seg[0].w = mm.w;
      p.seg[0].out = mm.y;
      p.seg[0].out_stride = mm.a;
      p.seg[0].M = mm.a;
      p.x = norm.y;
      p.x_rows = arena.dev<long long>(roff);
      p.K = mm.b;
      p.n = rows;
      launch_gemv(p, mm.wbf16 != 0);
    });
    return j - i;
  }

  // [rmsnorm +] matmuls sharing x (+ their biases) and an epilogue: residual add or SwiGLU.
  std::size_t plan_matmul_group(std::size_t i, std::vector<std::function<void()>>& items) {
    using cuda_detail::OpKind;
    const cuda_detail::Op* norm = nullptr;
    std::size_t first = i;
    if (ops[i].kind == OpKind::kRmsNorm) {
      norm = &ops[i];
      first = i + 1;
      if (first >= ops.size() || ops[first].kind != OpKind::kMatmul || ops[first].x != norm->y ||
          ops[first].n != norm->n || ops[first].b != norm->a || norm->a % 4 != 0)
        return 0;
    }
    const cuda_detail::Op& m0 = ops[first];
    const float* in = norm != nullptr ? norm->x : m0.x;  // what the kernel reads
    const long long in_len = static_cast<long long>(m0.n) * m0.b;
    std::size_t j = first;
    std::vector<std::size_t> mem;
    while (j < ops.size() && ops[j].kind == OpKind::kMatmul && mem.size() < static_cast<std::size_t>(gpu::kMaxGemvSegs) &&
           ops[j].x == m0.x && ops[j].n == m0.n && ops[j].b == m0.b && ops[j].wbf16 == m0.wbf16) {
      // a member must not write what the kernel reads (x, or the RMSNorm's input and output)
      const float* y = ops[j].y;
      const long long y_len = static_cast<long long>(m0.n) * ops[j].a;
      auto overlaps = [&](const float* a, long long alen) { return y < a + alen && a < y + y_len; };
      if (overlaps(m0.x, in_len) || overlaps(in, in_len)) break;
      mem.push_back(j++);
    }
    if (mem.empty()) return 0;
    gpu::GemvParams p;
    p.nseg = static_cast<int>(mem.size());
    for (std::size_t s = 0; s < mem.size(); ++s) {
      const cuda_detail::Op& m = ops[mem[s]];
      p.seg[s].w = m.w;
      p.seg[s].out = m.y;
      p.seg[s].out_stride = m.a;
      p.seg[s].M = m.a;
    }
    if (norm != nullptr) {
      p.norm_w = static_cast<const float*>(norm->w);
      p.norm_out = norm->y;
      p.eps = norm->eps;
    }
    p.x = in;
    p.x_stride = m0.b;
    p.K = m0.b;
    p.n = m0.n;
    // biases of the members' outputs
    while (j < ops.size() && ops[j].kind == OpKind::kBias) {
      int hit = -1;
      for (std::size_t s = 0; s < mem.size(); ++s)
        if (ops[j].y == p.seg[s].out && ops[j].n == m0.n && ops[j].a == p.seg[s].M && p.seg[s].bias == nullptr)
          hit = static_cast<int>(s);
      if (hit < 0) break;
      p.seg[hit].bias = static_cast<const float*>(ops[j].w);
      ++j;
    }
    if (j < ops.size() && ops[j].kind == OpKind::kAdd && mem.size() == 1) {
      const cuda_detail::Op& ad = ops[j];
      const long long cnt = static_cast<long long>(m0.n) * p.seg[0].M;
      auto apart = [&](const float* a, long long alen) { return ad.y + cnt <= a || ad.y >= a + alen; };
      const bool disjoint = apart(in, in_len) && apart(m0.x, in_len);
      if (ad.x2 == p.seg[0].out && ad.count == cnt && disjoint && ad.y != p.seg[0].out) {
        p.seg[0].residual = ad.y;
        p.seg[0].res_stride = p.seg[0].M;
        ++j;
      }
    } else if (j < ops.size() && ops[j].kind == OpKind::kSwiglu && mem.size() == 2 && p.seg[0].M == p.seg[1].M) {
      const cuda_detail::Op& sw = ops[j];
      if (sw.y == p.seg[0].out && sw.x2 == p.seg[1].out && sw.count == static_cast<long long>(m0.n) * p.seg[0].M) {
        p.paired = 1;
        ++j;
      }
    }
    const bool bf16 = m0.wbf16 != 0;
    prepare_matmul(p.n, p.K, bf16, false);
    items.push_back([this, p, bf16] { launch_gemv(p, bf16); });
    return j - i;
  }

  // rope(q) [+ rope(k)] [+ write_kv of every row] [-> q converted for the decode attention].
  std::size_t plan_rope_group(std::size_t i, std::vector<std::function<void()>>& items, std::vector<char>& q_ready) {
    using cuda_detail::OpKind;
    const cuda_detail::Op rq = ops[i];
    std::size_t j = i + 1;
    const cuda_detail::Op* rk = nullptr;
    if (j < ops.size() && ops[j].kind == OpKind::kRope && ops[j].n == rq.n && ops[j].b == rq.b &&
        ops[j].arena_a == rq.arena_a && ops[j].w == rq.w && ops[j].x2 == rq.x2 && ops[j].flag == rq.flag &&
        ops[j].style == rq.style)
      rk = &ops[j++];
    // write_kv ops covering rows [0, n) of k in order, with consecutive slot arrays
    const cuda_detail::Op* w0 = nullptr;
    std::size_t wend = j;
    if (rk != nullptr) {
      long long r0 = 0;
      std::size_t t = j;
      while (t < ops.size() && ops[t].kind == OpKind::kWriteKv) {
        const cuda_detail::Op& w = ops[t];
        const cuda_detail::Op& first = w0 != nullptr ? *w0 : w;
        if (w.layer != first.layer || w.dtype != first.dtype || w.a != rk->a * rk->b || w.d != rk->b ||
            w.x != rk->y + r0 * w.a || w.x2 != first.x2 + r0 * w.a || w.arena_a != first.arena_a + r0 * 8 ||
            std::memcmp(&w.view, &first.view, sizeof w.view) != 0)
          break;
        if (w0 == nullptr) w0 = &ops[t];
        r0 += w.n;
        ++t;
      }
      if (w0 != nullptr && r0 == rk->n) wend = t;
      else w0 = nullptr;
    }
    const triattn::DType dt = w0 != nullptr ? static_cast<triattn::DType>(w0->dtype) : triattn::DType::kF32;
    // K/V through triattn's append (fp8: always where it compiles the head_dim, quantising the
    // float K/V), else written by the RoPE kernel itself (fp8: quantised with the view's scales)
    const bool lib_ok = w0 != nullptr && cuda_detail::library_append(dt, w0->d, opt.direct_kv_write);
    // q in the cache type for the decode attention right after
    void* q_t = nullptr;
    if (w0 != nullptr && wend < ops.size() && ops[wend].kind == OpKind::kAttention && ops[wend].x == rq.y &&
        ops[wend].flag == cuda_detail::kAttnDecode && ops[wend].q_t != nullptr && ops[wend].dtype == w0->dtype) {
      q_t = ops[wend].q_t;
      q_ready[wend] = 1;
    }
    void* k_t = nullptr;
    void* v_t = nullptr;
    if (lib_ok && !cuda_detail::append_takes_float(dt)) {  // 16-bit caches: converted copies to append
      const std::size_t bytes = static_cast<std::size_t>(rk->n) * w0->a * triattn::dtype_size(dt);
      k_t = scratch(kKt, bytes);
      v_t = scratch(kVt, bytes);
    }
    const cuda_detail::Op wk = w0 != nullptr ? *w0 : cuda_detail::make_op(OpKind::kWriteKv);
    const bool has_kv = w0 != nullptr;
    const cuda_detail::Op rkc = rk != nullptr ? *rk : cuda_detail::make_op(OpKind::kRope);
    const bool has_k = rk != nullptr;
    items.push_back([this, rq, rkc, has_k, wk, has_kv, lib_ok, dt, q_t, k_t, v_t] {
      cuda_detail::dispatch_cache_type(dt, [&](auto st, auto dtag) {
        using ST = typename decltype(st)::type;
        using DT = typename decltype(dtag)::type;
        gpu::RopeKvParams<DT> p;
        p.q = rq.y;
        p.k = has_k ? rkc.y : nullptr;
        p.v = has_kv && (!lib_ok || v_t != nullptr) ? wk.x2 : nullptr;  // fp32 / fp8 + append: V is read in place
        p.n = rq.n;
        p.hq = rq.a;
        p.hkv = has_k ? rkc.a : 0;
        p.d = rq.b;
        p.pos = arena.dev<long long>(rq.arena_a);
        p.inv64 = static_cast<const double*>(rq.w);
        p.inv32 = rq.x2;
        p.f32_angles = rq.flag;
        p.style = static_cast<triattn::RopeStyle>(rq.style);
        p.q_t = static_cast<DT*>(q_t);
        p.k_t = static_cast<DT*>(k_t);
        p.v_t = static_cast<DT*>(v_t);
        if (has_kv && !lib_ok) {
          p.direct = 1;
          p.view = cuda_detail::typed_view<DT>(wk.view);
          p.layer = wk.layer;
          p.slots = arena.dev<long long>(wk.arena_a);
        }
        const long long heads = p.hq + p.hkv;
        const long long threads = static_cast<long long>(p.n) * heads * (p.d / 2) +
                                  (p.v != nullptr ? static_cast<long long>(p.n) * p.hkv * p.d : 0);
        launch(gpu::rope_kv_kernel<DT>, dim3(static_cast<unsigned>((threads + 255) / 256)), dim3(256), 0, p);
        if (has_kv && lib_ok) {
          const auto view = cuda_detail::typed_view<ST>(wk.view);
          const auto* slots = reinterpret_cast<const std::int64_t*>(arena.dev<long long>(wk.arena_a));
          if constexpr (cuda_detail::append_takes_float_v<ST>) {
            // fp32: copied; fp8: quantised by the view's scales (the roped K, V as computed)
            TRIATTN_CUDA_TRY(triattn::cuda::append::run_slots(view, wk.layer, 1, static_cast<const float*>(p.k), wk.x2,
                                                              slots, rq.n, stream));
          } else {
            TRIATTN_CUDA_TRY(triattn::cuda::append::run_slots(view, wk.layer, 1, static_cast<const ST*>(k_t),
                                                              static_cast<const ST*>(v_t), slots, rq.n, stream));
          }
        }
      });
    });
    return wend - i;
  }

  std::size_t plan_single(std::size_t i, std::vector<std::function<void()>>& items, bool q_ready) {
    using cuda_detail::OpKind;
    const cuda_detail::Op o = ops[i];
    auto blocks = [](long long count, int threads) { return dim3(static_cast<unsigned>((count + threads - 1) / threads)); };
    switch (o.kind) {
      case OpKind::kEmbed:
        items.push_back([this, o] {
          const int* tok = arena.dev<int>(o.arena_a);
          if (o.wbf16)
            launch(gpu::embed_kernel<__nv_bfloat16>, dim3(static_cast<unsigned>(o.n)), dim3(256), 0, o.y,
                   static_cast<const __nv_bfloat16*>(o.w), tok, o.a);
          else
            launch(gpu::embed_kernel<float>, dim3(static_cast<unsigned>(o.n)), dim3(256), 0, o.y,
                   static_cast<const float*>(o.w), tok, o.a);
        });
        break;
      case OpKind::kRmsNorm:
        items.push_back([this, o] {
          launch(gpu::rmsnorm_kernel, dim3(static_cast<unsigned>(o.n)), dim3(gpu::kNormThreads), 0, o.y, o.x,
                 static_cast<const float*>(o.w), o.a, o.eps, static_cast<const long long*>(nullptr),
                 static_cast<long long>(o.a));
        });
        break;
      case OpKind::kMatmul:
        prepare_matmul(o.n, o.b, o.wbf16 != 0, false);
        items.push_back([this, o] {
          gpu::GemvParams p;
          p.nseg = 1;
          p.seg[0].w = o.w;
          p.seg[0].out = o.y;
          p.seg[0].out_stride = o.a;
          p.seg[0].M = o.a;
          p.x = o.x;
          p.x_stride = o.b;
          p.K = o.b;
          p.n = o.n;
          launch_gemv(p, o.wbf16 != 0);
        });
        break;
      case OpKind::kBias:
        items.push_back([this, o, blocks] {
          const long long cnt = static_cast<long long>(o.n) * o.a;
          launch(gpu::bias_kernel, blocks(cnt, 256), dim3(256), 0, o.y, static_cast<const float*>(o.w), cnt, o.a);
        });
        break;
      case OpKind::kAdd:
        items.push_back([this, o, blocks] { launch(gpu::add_kernel, blocks(o.count, 256), dim3(256), 0, o.y, o.x2, o.count); });
        break;
      case OpKind::kSwiglu:
        items.push_back(
            [this, o, blocks] { launch(gpu::swiglu_kernel, blocks(o.count, 256), dim3(256), 0, o.y, o.x2, o.count); });
        break;
      case OpKind::kRope:
        return plan_rope_alone(i, items);
      case OpKind::kAllReduce:
        items.push_back([this, o] { all_reduce(o.y, static_cast<std::size_t>(o.count), stream); });
        break;
      case OpKind::kWriteKv: {
        const triattn::DType dt = static_cast<triattn::DType>(o.dtype);
        // fp8: triattn's quantising append where it compiles the head_dim (never an unscaled
        // write); write_kv_kernel otherwise (it quantises fp8 with the view's scales too)
        const bool lib = cuda_detail::scaled_cache(dt) && cuda_detail::library_append(dt, o.d, opt.direct_kv_write);
        items.push_back([this, o, blocks, dt, lib] {
          cuda_detail::dispatch_cache_type(dt, [&](auto st, auto dtag) {
            using ST = typename decltype(st)::type;
            using DT = typename decltype(dtag)::type;
            if constexpr (cuda_detail::append_takes_float_v<ST>) {
              if (lib) {
                TRIATTN_CUDA_TRY(triattn::cuda::append::run_slots(
                    cuda_detail::typed_view<ST>(o.view), o.layer, 1, o.x, o.x2,
                    reinterpret_cast<const std::int64_t*>(arena.dev<long long>(o.arena_a)), o.n, stream));
                return;
              }
            }
            launch(gpu::write_kv_kernel<DT>, blocks(static_cast<long long>(o.n) * o.a, 256), dim3(256), 0,
                   cuda_detail::typed_view<DT>(o.view), o.layer, o.x, o.x2, arena.dev<long long>(o.arena_a), o.n,
                   o.b, o.d);
          });
        });
        break;
      }
      case OpKind::kAttention:
        items.push_back([this, o, blocks, q_ready] {
          cuda_detail::dispatch_cache_type(static_cast<triattn::DType>(o.dtype), [&](auto st, auto dtag) {
            using ST = typename decltype(st)::type;
            using DT = typename decltype(dtag)::type;
            if (o.flag == cuda_detail::kAttnDecode) {
              // 16-bit caches take q in the cache type; fp32 and fp8 the float q (fp8: K/V
              // dequantised by the view's scales, float out)
              using QT = triattn::cuda::query_type_t<ST>;
              const QT* q = reinterpret_cast<const QT*>(o.x);
              if constexpr (!std::is_same_v<QT, float>) {
                if (!q_ready) {
                  const long long cnt = static_cast<long long>(o.n) * o.a * o.d;
                  launch(gpu::convert_kernel<DT>, blocks(cnt, 256), dim3(256), 0, static_cast<DT*>(o.q_t), o.x, cnt);
                }
                q = static_cast<const QT*>(o.q_t);
              }
              TRIATTN_CUDA_TRY(triattn::cuda::decode_attention::run(
                  o.plan, cuda_detail::typed_view<ST>(o.view), o.layer, q, o.y, o.n, o.a,
                  arena.dev<std::int32_t>(o.arena_a), 1.0f / std::sqrt(static_cast<float>(o.d)), o.workspace,
                  o.workspace_bytes, stream));
            } else if (o.flag == cuda_detail::kAttnPrefill) {  // 16-bit caches only (prefill_attention_refusal)
              gpu::PrefillAttentionParams<ST> p;
              p.out = o.y;
              p.q = o.x;
              p.view = cuda_detail::typed_view<ST>(o.view);
              p.row_slot = arena.dev<std::int32_t>(o.arena_b);
              p.tiles = arena.dev<gpu::PrefillTile>(o.arena_c);
              p.layer = o.layer;
              p.hq = o.a;
              p.group = o.a / o.b;
              p.scale_log2 = 1.4426950408889634f / std::sqrt(static_cast<float>(o.d));
              ++stats.prefill_attention;
              gpu::run_prefill_attention(p, o.d, static_cast<int>(o.count),
                                         [this](auto kernel, dim3 grid, dim3 block, std::size_t smem, auto&&... args) {
                                           launch(kernel, grid, block, smem, args...);
                                         });
            } else {  // fp32 and fp8 caches (fp8 dequantised in its loads), other head dims, row_attention
              const long long warps = static_cast<long long>(o.n) * o.a;
              launch(gpu::attention_rows_kernel<DT>, blocks(warps, gpu::kAttnRowWarps), dim3(gpu::kAttnRowWarps * 32), 0,
                     o.y, o.x, cuda_detail::typed_view<DT>(o.view), o.layer, o.n, o.a, o.b, o.d,
                     arena.dev<int>(o.arena_a), arena.dev<int>(o.arena_b), std::sqrt(static_cast<float>(o.d)));
            }
          });
        });
        break;
    }
    return 1;
  }

  std::size_t plan_rope_alone(std::size_t i, std::vector<std::function<void()>>& items) {
    const cuda_detail::Op o = ops[i];
    items.push_back([this, o] {
      gpu::RopeKvParams<float> p;
      p.q = o.y;
      p.n = o.n;
      p.hq = o.a;
      p.d = o.b;
      p.pos = arena.dev<long long>(o.arena_a);
      p.inv64 = static_cast<const double*>(o.w);
      p.inv32 = o.x2;
      p.f32_angles = o.flag;
      p.style = static_cast<triattn::RopeStyle>(o.style);
      const long long threads = static_cast<long long>(p.n) * p.hq * (p.d / 2);
      launch(gpu::rope_kv_kernel<float>, dim3(static_cast<unsigned>((threads + 255) / 256)), dim3(256), 0, p);
    });
    return 1;
  }

  /// At plan time (never inside a graph capture): the cuBLAS handle and the x scratch a matmul
  /// of n rows of K will need if it goes to cuBLAS.
  void prepare_matmul(int n, int K, bool bf16, bool gathered) {
    if (!use_cublas(opt.matmul_path, bf16, n)) return;
    if (!cublas) cublas = std::make_unique<CublasContext>(stream);
    const std::size_t bytes = cuda_detail::cublas_x_scratch_bytes(n, K, bf16, gathered);
    if (bytes > 0) (void)scratch(kXt, bytes);
  }

  /// Picks the GEMV kernel for p (units and segment starts are filled in here), or cuBLAS for
  /// many rows (gemm_cublas.cuh; prepare_matmul ran at plan time).
  void launch_gemv(gpu::GemvParams p, bool bf16) {
    if (use_cublas(opt.matmul_path, bf16, p.n)) {
      TRIATTN_EXPECTS(cublas != nullptr, "CudaBackend: a cuBLAS matmul was not prepared at plan time");
      cuda_detail::cublas_matmul(p, bf16, *cublas, scratch_mem[kXt].get(), scratch_bytes[kXt],
                                 [this](auto kernel, dim3 grid, dim3 block, auto&&... args) {
                                   launch(kernel, grid, block, 0, args...);
                                 });
      return;
    }
    const int V = bf16 ? 8 : 4;
    const std::size_t wsize = bf16 ? 2 : 4;
    bool vec = p.K % V == 0 && cuda_detail::aligned16(p.x) && (p.x_rows != nullptr || p.x_stride % 4 == 0) &&
               (static_cast<std::size_t>(p.K) * wsize) % 16 == 0 &&
               (p.norm_w == nullptr || (cuda_detail::aligned16(p.norm_w) && cuda_detail::aligned16(p.norm_out)));
    for (int s = 0; s < p.nseg; ++s) vec = vec && cuda_detail::aligned16(p.seg[s].w);
    if (p.n <= 0) return;
    const bool mma = bf16 && vec && p.n >= 3 && p.K % 32 == 0;
    if (mma && p.norm_w != nullptr) {  // the tensor-core kernel has no RMSNorm prologue: run it first
      launch(gpu::rmsnorm_kernel, dim3(static_cast<unsigned>(p.n)), dim3(gpu::kNormThreads), 0, p.norm_out, p.x,
             p.norm_w, p.K, p.eps, p.x_rows, p.x_stride);
      p.x = p.norm_out;
      p.norm_w = nullptr;
      p.norm_out = nullptr;
    }
    if (mma) {
      int units = 0;
      for (int s = 0; s < p.nseg; ++s) {
        p.seg[s].first = units;
        if (!p.paired || s == 0) units += p.paired ? (p.seg[s].M + 7) / 8 : (p.seg[s].M + 15) / 16;
      }
      if (p.paired) p.seg[1].first = 0;
      p.units = units;
      const int tiles8 = (p.n + 7) / 8;
      const int nt = tiles8 >= 16 ? 16 : tiles8 >= 8 ? 8 : tiles8 >= 4 ? 4 : tiles8 >= 2 ? 2 : 1;
      const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>((p.n + nt * 8 - 1) / (nt * 8)));
      const dim3 block(gpu::kGemvMmaWarps * 32);
      switch (nt) {
        case 1: launch(gpu::gemv_mma_kernel<1>, grid, block, 0, p); break;
        case 2: launch(gpu::gemv_mma_kernel<2>, grid, block, 0, p); break;
        case 4: launch(gpu::gemv_mma_kernel<4>, grid, block, 0, p); break;
        case 8: launch(gpu::gemv_mma_kernel<8>, grid, block, 0, p); break;
        default: launch(gpu::gemv_mma_kernel<16>, grid, block, 0, p); break;
      }
      return;
    }
    if (bf16 && vec && p.n <= 2) {  // streaming GEMVs (gemv_stream_kernel.cuh); refused shapes go on below
      gpu::GemvLaunch gl;
      const int variant = opt.gemv_variant >= 0 ? opt.gemv_variant : gpu::gemv_default_variant();
      if (gpu::plan_gemv_bf16_small(p, variant, sms, &gl).empty()) {
        launch(gl.kernel, gl.grid, gl.block, gl.smem, gl.p);
        return;
      }
    }
    int units = 0;
    for (int s = 0; s < p.nseg; ++s) {
      p.seg[s].first = units;
      if (!p.paired || s == 0) units += p.seg[s].M;
    }
    if (p.paired) p.seg[1].first = 0;
    p.units = units;
    const int nb = bf16 ? (p.n >= 2 ? 2 : 1) : (p.n >= 3 ? 4 : p.n >= 2 ? 2 : 1);
    const dim3 grid(static_cast<unsigned>((units + gpu::kGemvWarpThreads / 32 - 1) / (gpu::kGemvWarpThreads / 32)),
                    static_cast<unsigned>((p.n + nb - 1) / nb));
    const dim3 block(gpu::kGemvWarpThreads);
    auto go = [&](auto wt, auto nbc, auto rc, auto vc) {
      using WT = typename decltype(wt)::type;
      launch(gpu::gemv_warp_kernel<WT, decltype(nbc)::value, decltype(rc)::value, decltype(vc)::value>, grid, block, 0, p);
    };
    auto by_vec = [&](auto wt, auto nbc, auto rc) {
      if (vec) go(wt, nbc, rc, std::true_type{});
      else go(wt, nbc, rc, std::false_type{});
    };
    auto by_r = [&](auto wt, auto nbc) {
      if (p.paired) by_vec(wt, nbc, std::integral_constant<int, 2>{});
      else by_vec(wt, nbc, std::integral_constant<int, 1>{});
    };
    auto by_nb = [&](auto wt) {
      if (nb == 1) by_r(wt, std::integral_constant<int, 1>{});
      else if (nb == 2) by_r(wt, std::integral_constant<int, 2>{});
      else by_r(wt, std::integral_constant<int, 4>{});
    };
    if (bf16) by_nb(std::type_identity<__nv_bfloat16>{});
    else by_nb(std::type_identity<float>{});
  }
};

}  // namespace cuda_detail
}  // namespace triattn_example

// SPDX-License-Identifier: Apache-2.0
// CudaBackend: the GPU backend of Model<Backend> (backend.hpp). Activations live in device
// memory (fp32), weights are uploaded once (fp32, or bf16 for the matrices), the K/V go into a
// device KvCache (cuda::DeviceAllocator: published device block tables) through triattn's append
// kernel, decode rows attend through triattn's paged decode attention, prefill rows of 16-bit
// caches through the tensor-core prefill kernel (prefill_attention.cuh), and the rest (fp32 and
// fp8 caches, head dims it does not compile, e.g. stories260K's 8) through attention_rows_kernel.
// Every cache dtype runs, fp8 e4m3 included: its K/V are quantised with the cache's scales
// (CacheConfig::kv_scales, uploaded with the cache; the same values and rounding as the CPU
// backend's KvCache::write_values) and dequantised in every attention kernel's loads.
//
// How calls become kernels: the backend records each call as an op and launches a step's ops
// at a flush, fused and captured into a CUDA graph when it is a decode step
// (cuda_step_recorder.cuh). This file is what each Model call records, the weight upload
// and the device-generated synthetic weights.
//
// Weight pointers of a bf16 WeightStore are handles (Model only does pointer arithmetic on
// them): the backend maps handle + offset back to the bf16 element.
//
// The cache's compactor and scorer must run on stream() (pass it to cuda::DeviceCompactor and
// cuda::TriAttentionDeviceScorer). Ops are stream-ordered: code that reads device memory
// written by the model outside this stream calls synchronize() first.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/prefix_cache.hpp>
#include <triattn/core/ref/select.hpp>
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/algorithms/decode_attention.cuh>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/griddep.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

#include "backend.hpp"
#include "cuda_kernels.cuh"
#include "cuda_step_recorder.cuh"
#include "model_config.hpp"
#include "synthetic.hpp"
#include "tensor_parallel.hpp"
#include "tp_kernels.cuh"

namespace triattn_example {

/// A KvCache in device memory without compression, and one running TriAttention rounds with
/// the device scorer (KvCache::compress: the device round, waited for) or DeviceRounds (the same
/// round, asynchronous). Construct the compactor / scorer with the backend's stream.
using GpuPlainCache = triattn::KvCache<triattn::cuda::DeviceAllocator, triattn::cuda::DeviceCompactor>;
using GpuTriCache = triattn::KvCache<triattn::cuda::DeviceAllocator, triattn::cuda::DeviceCompactor,
                                     triattn::cuda::TriAttentionDeviceScorer, triattn::TopKSelector>;
/// The same two over CUDA virtual memory (cuda::VmmAllocator): pages are mapped as blocks are
/// first used and go back to the driver at trim(), so resident memory follows what is live.
using GpuVmmPlainCache = triattn::KvCache<triattn::cuda::VmmAllocator, triattn::cuda::DeviceCompactor>;
using GpuVmmTriCache = triattn::KvCache<triattn::cuda::VmmAllocator, triattn::cuda::DeviceCompactor,
                                        triattn::cuda::TriAttentionDeviceScorer, triattn::TopKSelector>;
/// Device memory in use on the current device, all processes (cudaMemGetInfo: total - free).
[[nodiscard]] inline std::size_t device_memory_used() {
  std::size_t free_b = 0, total_b = 0;
  TRIATTN_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}
/// The same two with the prefix cache (core/prefix_cache.hpp) over the device pool: requests that
/// share a prompt prefix share its blocks (serve_shared.hpp).
using GpuPrefixAllocator = triattn::PrefixCachingAllocator<triattn::cuda::DeviceAllocator>;
using GpuPrefixPlainCache = triattn::KvCache<GpuPrefixAllocator, triattn::cuda::DeviceCompactor>;
using GpuPrefixTriCache = triattn::KvCache<GpuPrefixAllocator, triattn::cuda::DeviceCompactor,
                                           triattn::cuda::TriAttentionDeviceScorer, triattn::TopKSelector>;


class CudaBackend {
 public:
  static constexpr const char* kName = "cuda";
  /// Cache dtypes it runs on: all of them, fp8 e4m3 with its scales (cuda_detail::kv_storage_types).
  using kv_storage_types = cuda_detail::kv_storage_types;
  using Options = CudaBackendOptions;

  /// Device activation buffer of n floats (shared ownership: Model keeps copies in members).
  class Buffer {
   public:
    Buffer() = default;
    [[nodiscard]] float* get() const noexcept { return ptr_; }
    [[nodiscard]] std::size_t size() const noexcept { return n_; }

   private:
    friend class CudaBackend;
    std::shared_ptr<void> mem_;
    float* ptr_ = nullptr;
    std::size_t n_ = 0;
  };

  /// Weights in device memory; ptrs() as backend.hpp describes (bf16 matrices are handles).
  class WeightStore {
   public:
    WeightStore() = default;
    [[nodiscard]] const WeightPtrs& ptrs() const noexcept { return impl_->ptrs; }
    [[nodiscard]] WeightType matrix_type() const noexcept { return impl_->type; }
    /// Bytes of all weights held on the device.
    [[nodiscard]] std::size_t bytes() const noexcept { return impl_->bytes; }
    /// Bytes one decode step reads at batch 1: every matrix except the embedding table (one row
    /// of it is read), plus norms and biases.
    [[nodiscard]] std::size_t bytes_per_step() const noexcept { return impl_->bytes_per_step; }

   private:
    friend class CudaBackend;
    struct Impl {
      WeightPtrs ptrs;
      WeightType type = WeightType::kF32;
      std::vector<cuda_detail::DeviceMem> mem;
      std::vector<std::uint32_t> handles;
      std::size_t bytes = 0, bytes_per_step = 0;
      Impl() = default;
      Impl(const Impl&) = delete;
      Impl& operator=(const Impl&) = delete;
      ~Impl() {
        for (std::uint32_t id : handles) cuda_detail::HandleTable::get().remove(id);
      }
    };
    std::shared_ptr<Impl> impl_;
  };

  explicit CudaBackend(const Options& opt = Options{}) : s_(std::make_shared<State>(opt)) {}

  [[nodiscard]] const Options& options() const noexcept { return s_->opt; }
  /// Changes graphs / PDL / fusion / direct KV write for the following steps (weights: future
  /// uploads). Pending work is launched first; captured graphs of other settings stay unused.
  void set_options(const Options& o) const {
    s_->flush(FlushReason::kOther);
    s_->opt = o;
  }
  /// The stream every kernel of the backend runs on (give it to the cache's compactor and scorer).
  [[nodiscard]] cudaStream_t stream() const noexcept { return s_->stream; }

  // ---- backend.hpp interface ---------------------------------------------------------------------

  [[nodiscard]] Buffer alloc(std::size_t n) const {
    State& s = *s_;
    s.flush(FlushReason::kOther);  // the buffer this one replaces may still be named by pending ops
    Buffer b;
    void* raw = cuda_detail::device_alloc(n * sizeof(float)).release();
    // Tracked while it lives: a decode step is padded to its bucket only inside such buffers.
    b.mem_ = std::shared_ptr<void>(raw, [owner = std::weak_ptr<State>(s_)](void* p) noexcept {
      if (const std::shared_ptr<State> st = owner.lock()) st->buffers.remove(p);
      cuda_detail::DeviceFree{}(p);
    });
    s.buffers.add(raw, n * sizeof(float));
    b.ptr_ = static_cast<float*>(b.mem_.get());
    b.n_ = n;
    TRIATTN_CUDA_TRY(cudaMemsetAsync(b.ptr_, 0, n * sizeof(float), s.stream));
    return b;
  }
  [[nodiscard]] static float* data(Buffer& b) noexcept { return b.ptr_; }
  [[nodiscard]] static const float* data(const Buffer& b) noexcept { return b.ptr_; }
  [[nodiscard]] static std::size_t size(const Buffer& b) noexcept { return b.n_; }

  /// Copies the model's weights to the device (matrices converted to options().weights).
  [[nodiscard]] WeightStore upload(const ModelWeights& w) const {
    w.validate();
    s_->set_model(w.config);
    auto impl = std::make_shared<WeightStore::Impl>();
    impl->type = s_->opt.weights;
    const ModelConfig& c = w.config;
    WeightPtrs& p = impl->ptrs;
    auto matrix = [&](const std::vector<float>& t) { return put_matrix(*impl, t.data(), t.size()); };
    auto vec = [&](const std::vector<float>& t) { return put_f32(*impl, t.data(), t.size()); };
    p.tok_emb = matrix(w.tok_emb);
    p.rms_att = vec(w.rms_att);
    p.wq = matrix(w.wq);
    p.wk = matrix(w.wk);
    p.wv = matrix(w.wv);
    p.wo = matrix(w.wo);
    p.rms_ffn = vec(w.rms_ffn);
    p.w1 = matrix(w.w1);
    p.w2 = matrix(w.w2);
    p.w3 = matrix(w.w3);
    p.rms_final = vec(w.rms_final);
    p.wcls = c.shared_classifier ? p.tok_emb : matrix(w.wcls);
    if (c.has_qkv_bias) {
      p.bq = vec(w.bq);
      p.bk = vec(w.bk);
      p.bv = vec(w.bv);
    }
    finish_store(*impl, c);
    WeightStore ws;
    ws.impl_ = std::move(impl);
    return ws;
  }

  /// make_synthetic_weights(c, seed) generated directly on the device (same values: fp32 bitwise,
  /// bf16 = those values rounded), for models too large for host memory. With `shard` (tensor
  /// parallelism) only that rank's share, shard_weights(make_synthetic_weights(c, seed), shard):
  /// a model of shard_config(c, shard).
  [[nodiscard]] WeightStore generate_synthetic(const ModelConfig& c, std::uint64_t seed, TpRank shard = {}) const {
    c.validate();
    const ModelConfig sc = shard_config(c, shard);  // sizes; the standard deviations stay the full model's
    s_->set_model(sc);
    auto impl = std::make_shared<WeightStore::Impl>();
    impl->type = s_->opt.weights;
    WeightPtrs& p = impl->ptrs;
    const float s_dim = 1.0f / std::sqrt(static_cast<float>(c.dim));
    const float norm_std = 0.1f / 1.7320508f;
    using gpu::ShardMap;
    auto gen = [&](ShardMap map, SynthTensor id, float std_dev, float mean, bool is_matrix) {
      return gen_tensor(*impl, map, seed, id, std_dev, mean, is_matrix && impl->type == WeightType::kBF16);
    };
    auto whole = [](std::size_t n) { return ShardMap{1, n, 0, 0}; };
    const std::size_t L = static_cast<std::size_t>(c.n_layers), D = static_cast<std::size_t>(c.dim);
    const std::size_t QD = static_cast<std::size_t>(c.q_dim()), KVD = static_cast<std::size_t>(c.kv_dim());
    const std::size_t H = static_cast<std::size_t>(c.hidden_dim), r = static_cast<std::size_t>(shard.rank);
    const std::size_t qd = static_cast<std::size_t>(sc.q_dim()), kvd = static_cast<std::size_t>(sc.kv_dim());
    const std::size_t h = static_cast<std::size_t>(sc.hidden_dim);
    // tensor_parallel.hpp's split: row shards (one run per layer), column shards (one run per row)
    const ShardMap q_rows{L, qd * D, QD * D, r * qd * D}, kv_rows{L, kvd * D, KVD * D, r * kvd * D};
    const ShardMap o_cols{L * D, qd, QD, r * qd}, mlp_rows{L, h * D, H * D, r * h * D}, down_cols{L * D, h, H, r * h};
    p.tok_emb = gen(whole(c.n_tok_emb()), SynthTensor::kTokEmb, 1.0f, 0.0f, true);
    p.rms_att = gen(whole(c.n_rms()), SynthTensor::kRmsAtt, norm_std, 1.0f, false);
    p.wq = gen(q_rows, SynthTensor::kWq, s_dim, 0.0f, true);
    p.wk = gen(kv_rows, SynthTensor::kWk, s_dim, 0.0f, true);
    p.wv = gen(kv_rows, SynthTensor::kWv, s_dim, 0.0f, true);
    p.wo = gen(o_cols, SynthTensor::kWo, 1.0f / std::sqrt(static_cast<float>(c.q_dim())), 0.0f, true);
    p.rms_ffn = gen(whole(c.n_rms()), SynthTensor::kRmsFfn, norm_std, 1.0f, false);
    p.w1 = gen(mlp_rows, SynthTensor::kW1, s_dim, 0.0f, true);
    p.w2 = gen(down_cols, SynthTensor::kW2, 1.0f / std::sqrt(static_cast<float>(c.hidden_dim)), 0.0f, true);
    p.w3 = gen(mlp_rows, SynthTensor::kW3, s_dim, 0.0f, true);
    p.rms_final = gen(whole(D), SynthTensor::kRmsFinal, norm_std, 1.0f, false);
    p.wcls = c.shared_classifier ? p.tok_emb : gen(whole(c.n_tok_emb()), SynthTensor::kWcls, 2.0f * s_dim, 0.0f, true);
    if (c.has_qkv_bias) {
      p.bq = gen(ShardMap{L, qd, QD, r * qd}, SynthTensor::kBq, kQueryBiasStd, 0.0f, false);
      p.bk = zeros(*impl, L * kvd);
      p.bv = zeros(*impl, L * kvd);
    }
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(s_->stream));
    finish_store(*impl, sc);
    WeightStore ws;
    ws.impl_ = std::move(impl);
    return ws;
  }

  /// Host-readable copy of n floats (valid until the next host_view); runs pending work first.
  [[nodiscard]] const float* host_view(const float* p, std::size_t n) const {
    State& s = *s_;
    s.flush(FlushReason::kOther);
    s.ensure_host(n * sizeof(float));
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(s.host_buf.get(), p, n * sizeof(float), cudaMemcpyDeviceToHost, s.stream));
    s.finish_step_and_wait();
    return static_cast<const float*>(s.host_buf.get());
  }

  void embed(float* x, const float* table, std::span<const int> tokens, int dim) {
    State& s = *s_;
    s.begin_step();
    const cuda_detail::ResolvedWeight rw = cuda_detail::resolve_weight(table);
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kEmbed);
    o.y = x;
    o.w = rw.ptr;
    o.wbf16 = rw.bf16;
    o.n = static_cast<int>(tokens.size());
    o.a = dim;
    o.arena_a = s.arena.push(tokens.data(), tokens.size_bytes(), 16, s.stream);
    s.ops.push_back(o);
  }

  void rmsnorm(float* out, const float* x, const float* w, int n, int dim, float eps) {
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kRmsNorm);
    o.y = out;
    o.x = x;
    o.w = w;
    o.n = n;
    o.a = dim;
    o.eps = eps;
    s_->ops.push_back(o);
  }

  void matmul(float* out, const float* W, const float* x, int n, int out_dim, int in_dim) {
    const cuda_detail::ResolvedWeight rw = cuda_detail::resolve_weight(W);
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kMatmul);
    o.y = out;
    o.x = x;
    o.w = rw.ptr;
    o.wbf16 = rw.bf16;
    o.n = n;
    o.a = out_dim;
    o.b = in_dim;
    s_->ops.push_back(o);
  }

  void add_bias(float* y, const float* b, int n, int dim) {
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kBias);
    o.y = y;
    o.w = b;
    o.n = n;
    o.a = dim;
    s_->ops.push_back(o);
  }

  void rope(float* x, int n, int n_heads, int head_dim, std::span<const TokenInfo> rows, const RopeTables& t) {
    State& s = *s_;
    TRIATTN_EXPECTS(static_cast<int>(rows.size()) >= n, "CudaBackend::rope: fewer row infos than rows");
    const State::RopeDev& rd = s.rope_tables(t, head_dim);
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kRope);
    o.y = x;
    o.n = n;
    o.a = n_heads;
    o.b = head_dim;
    o.flag = t.f32_angles ? 1 : 0;
    o.style = static_cast<std::uint8_t>(t.style);
    o.w = rd.d64;
    o.x2 = rd.d32;
    o.arena_a = s.row_info(rows).pos;
    s.ops.push_back(o);
  }

  template <class T, class Cache>
  void write_kv(Cache& cache, triattn::SeqId seq, int layer, int first_slot, const float* k, const float* v, int n,
                int kv_dim) {
    static_assert(triattn::cuda::has_device_tables_v<Cache>,
                  "CudaBackend needs a KvCache whose allocator publishes device tables (cuda::DeviceAllocator, cuda::VmmAllocator)");
    State& s = *s_;
    s.publish_once(cache);
    const triattn::CacheConfig& cfg = cache.config();
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kWriteKv);
    o.x = k;
    o.x2 = v;
    o.n = n;
    o.a = kv_dim;
    o.b = cfg.model.num_kv_heads;
    o.d = cfg.model.head_dim;
    o.layer = layer;
    o.dtype = static_cast<std::uint8_t>(cfg.dtype);
    o.view = cuda_detail::erase_view(cache.template view<T>());
    o.arena_a = s.slot_mapping(cache, seq, first_slot, n);
    s.ops.push_back(o);
  }

  template <class T, class Cache>
  void attention(float* out, const float* q, std::span<const TokenInfo> rows, const Cache& cache, int layer,
                 const ModelConfig& c, const AttentionObserver* observer) {
    static_assert(triattn::cuda::has_device_tables_v<Cache>,
                  "CudaBackend needs a KvCache whose allocator publishes device tables (cuda::DeviceAllocator, cuda::VmmAllocator)");
    if (observer != nullptr && *observer)
      throw triattn::unsupported(
          "CudaBackend: attention observers need the probabilities on the host; use the CPU backend for them");
    State& s = *s_;
    TRIATTN_EXPECTS(c.head_dim <= gpu::kAttnMaxDimsPerLane * 32,
                    "CudaBackend::attention: head_dim " + std::to_string(c.head_dim) + " > 256 is not supported");
    const State::RowInfo ri = s.row_info(rows);
    const int n = static_cast<int>(rows.size());
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kAttention);
    o.y = out;
    o.x = q;
    o.n = n;
    o.a = c.n_heads;
    o.b = c.n_kv_heads;
    o.d = c.head_dim;
    o.layer = layer;
    o.dtype = static_cast<std::uint8_t>(cache.config().dtype);
    o.view = cuda_detail::erase_view(cache.template view<T>());
    o.arena_a = ri.seq;
    o.arena_b = ri.slot;
    // triattn's decode kernel: one row per sequence at its last slot, a compiled head_dim.
    bool decode = !s.opt.row_attention && triattn::cuda::is_supported_head_dim(c.head_dim) && n <= 65535;
    int max_len = 1;
    if (decode) {
      s.seen.assign(static_cast<std::size_t>(cache.config().max_seqs), 0);
      for (const TokenInfo& r : rows) {
        auto& mark = s.seen[static_cast<std::size_t>(r.seq)];
        if (mark != 0 || r.slot + 1 != cache.physical_length(r.seq)) {
          decode = false;
          break;
        }
        mark = 1;
        max_len = std::max(max_len, r.slot + 1);
      }
    }
    if (decode) {
      o.flag = cuda_detail::kAttnDecode;
      // A rounded bound keeps the plan (and a captured graph) stable while sequences grow.
      const int bound = (max_len + State::kPlanGranule - 1) / State::kPlanGranule * State::kPlanGranule;
      o.plan = triattn::cuda::decode_attention::make_plan(triattn::dtype_of<T>, n, c.n_kv_heads, c.group_size(), bound,
                                                          s.resident_ctas<T>(c.head_dim));
      o.count = bound;                    // a padded step re-plans for its bucket (decode_graphs.cuh)
      o.spare_seq = s.spare_seq(cache);  // what its padding rows attend to
      o.workspace_bytes = triattn::cuda::decode_attention::workspace_size(o.plan, n, c.n_heads, c.head_dim);
      o.workspace = o.workspace_bytes > 0 ? s.scratch(State::kWorkspace, o.workspace_bytes) : nullptr;
      // 16-bit caches take q converted to the cache type; fp32 and fp8 (float queries) the q itself
      if constexpr (!std::is_same_v<triattn::cuda::query_type_t<T>, float>)
        o.q_t = s.scratch(State::kQt, static_cast<std::size_t>(n) * c.q_dim() * sizeof(T));
    } else if (!s.opt.row_attention &&
               gpu::prefill_attention_refusal(cache.template view<T>(), c.head_dim, c.group_size()).empty()) {
      // Prefill (or mixed) rows of a 16-bit cache: the tensor-core kernel over the row tiles.
      // fp32 and fp8 caches are refused there and stay on attention_rows_kernel (fp8: K/V
      // dequantised by the view's scales in its loads, fp32 arithmetic).
      o.flag = cuda_detail::kAttnPrefill;
      const State::RowInfo ti = s.prefill_tiles(c.group_size());
      o.arena_c = ti.tiles;
      o.count = ti.n_tiles;
    }
    s.ops.push_back(o);
  }

  void swiglu(float* gate, const float* up, int n) {
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kSwiglu);
    o.y = gate;
    o.x2 = up;
    o.count = n;
    s_->ops.push_back(o);
  }

  /// Tensor parallelism (tensor_parallel.hpp, tp_cuda.cuh): `sum` enqueues an in-place sum of
  /// `count` device floats over the `ranks` ranks on `stream` (e.g. an NCCL all-reduce; it must be
  /// capturable, steps are replayed from CUDA graphs) and throws on failure. Never set: one rank.
  using AllReduceFn = cuda_detail::AllReduceFn;
  void set_all_reduce(int ranks, AllReduceFn sum) const {
    TRIATTN_EXPECTS(ranks >= 1 && (ranks == 1 || sum), "CudaBackend::set_all_reduce: ranks = " + std::to_string(ranks) +
                                                           " must be >= 1, with a function when > 1");
    s_->flush(FlushReason::kOther);
    s_->tp_size = ranks;
    s_->all_reduce = ranks > 1 ? std::move(sum) : nullptr;
  }
  [[nodiscard]] int tp_size() const noexcept { return s_->tp_size; }
  /// x[0..n) = sum over the ranks, in stream order (records nothing for a single rank, so the
  /// GEMV + residual-add fusions stay intact at tp 1).
  void all_reduce_sum(float* x, std::size_t n) {
    if (!s_->all_reduce) return;
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kAllReduce);
    o.y = x;
    o.count = static_cast<long long>(n);
    s_->ops.push_back(o);
  }

  void add(float* x, const float* y, int n) {
    State& s = *s_;
    cuda_detail::Op o = cuda_detail::make_op(cuda_detail::OpKind::kAdd);
    o.y = x;
    o.x2 = y;
    o.count = n;
    s.ops.push_back(o);
    // The model adds two residuals per layer: after the last one the layers are done.
    if (s.step_open && s.n_layers > 0 && ++s.adds == 2 * s.n_layers) s.flush(FlushReason::kLayersDone);
  }

  // ---- beyond backend.hpp ------------------------------------------------------------------------

  /// Launches everything pending and waits for the stream.
  void synchronize() const {
    s_->flush(FlushReason::kOther);
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(s_->stream));
  }
  /// Launches everything pending (no wait).
  void flush() const { s_->flush(FlushReason::kOther); }

  /// ids[r] = argmax of logits row r ([n, vocab], device), on the stream, after pending work.
  void argmax(int* ids, const float* logits, int n, int vocab) const {
    State& s = *s_;
    s.flush(FlushReason::kOther);
    if (n <= 0) return;
    s.launch(gpu::argmax_kernel, dim3(static_cast<unsigned>(n)), dim3(gpu::kArgmaxThreads), 0, ids, logits, vocab);
  }
  /// ids_host[r] = argmax of logits row r ([n, vocab], device; the first index on ties, as
  /// Sampler::argmax): the argmax runs on the device after pending work and only the n ids cross
  /// to the host, with one wait. What generate() uses for greedy decode steps.
  void argmax_host(int* ids_host, const float* logits, int n, int vocab) const {
    State& s = *s_;
    TRIATTN_EXPECTS(n >= 0 && vocab > 0, "CudaBackend::argmax_host: n = " + std::to_string(n) + ", vocab = " +
                                             std::to_string(vocab) + " (need n >= 0, vocab > 0)");
    s.flush(FlushReason::kOther);
    if (n == 0) return;
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(int);
    int* ids = static_cast<int*>(s.ids_scratch(bytes));
    s.launch(gpu::argmax_kernel, dim3(static_cast<unsigned>(n)), dim3(gpu::kArgmaxThreads), 0, ids, logits, vocab);
    void* pinned = s.ids_pinned(bytes);
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(pinned, ids, bytes, cudaMemcpyDeviceToHost, s.stream));
    s.finish_step_and_wait();
    std::memcpy(ids_host, pinned, bytes);
  }
  /// Copies device memory to the host after pending work, and waits.
  void download(void* host, const void* dev, std::size_t bytes) const {
    State& s = *s_;
    s.flush(FlushReason::kOther);
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s.stream));
    s.finish_step_and_wait();
  }
  /// Device time of the steps so far whose results came to the host (host_view, download,
  /// argmax_host): CUDA events from each step's first launch to the end of that copy. A step
  /// whose results never came back (a prefill chunk without logits) is not counted.
  [[nodiscard]] double device_seconds() const noexcept { return s_->stats.device_seconds; }

  using Stats = cuda_detail::RecorderStats;
  [[nodiscard]] Stats stats() const noexcept { return s_->stats; }

 private:
  using FlushReason = cuda_detail::FlushReason;
  using State = cuda_detail::StepRecorder;

  // ---- weight upload helpers ----

  const float* put_f32(WeightStore::Impl& impl, const float* src, std::size_t n) const {
    cuda_detail::DeviceMem m = cuda_detail::device_alloc(n * sizeof(float));
    if (n > 0) TRIATTN_CUDA_TRY(cudaMemcpy(m.get(), src, n * sizeof(float), cudaMemcpyHostToDevice));
    const float* p = static_cast<const float*>(m.get());
    impl.bytes += n * sizeof(float);
    impl.mem.push_back(std::move(m));
    return p;
  }
  const float* put_matrix(WeightStore::Impl& impl, const float* src, std::size_t n) const {
    if (impl.type == WeightType::kF32) return put_f32(impl, src, n);
    cuda_detail::DeviceMem m = cuda_detail::device_alloc(n * sizeof(__nv_bfloat16));
    constexpr std::size_t kChunk = std::size_t{1} << 22;
    std::vector<triattn::bf16_storage> tmp(std::min(n, kChunk));
    for (std::size_t off = 0; off < n; off += kChunk) {
      const std::size_t cnt = std::min(kChunk, n - off);
      for (std::size_t e = 0; e < cnt; ++e) tmp[e] = triattn::from_float<triattn::bf16_storage>(src[off + e]);
      TRIATTN_CUDA_TRY(cudaMemcpy(static_cast<triattn::bf16_storage*>(m.get()) + off, tmp.data(),
                                  cnt * sizeof(triattn::bf16_storage), cudaMemcpyHostToDevice));
    }
    return add_handle(impl, std::move(m), n);
  }
  const float* add_handle(WeightStore::Impl& impl, cuda_detail::DeviceMem m, std::size_t n) const {
    impl.bytes += n * sizeof(__nv_bfloat16);
    const std::uint32_t id = cuda_detail::HandleTable::get().add(m.get());
    impl.handles.push_back(id);
    impl.mem.push_back(std::move(m));
    return cuda_detail::make_handle(id);
  }
  // The elements `map` selects of synthetic tensor `id` (the whole tensor: ShardMap{1, n, 0, 0}).
  const float* gen_tensor(WeightStore::Impl& impl, gpu::ShardMap map, std::uint64_t seed, SynthTensor id, float std_dev,
                          float mean, bool bf16) const {
    const float scale = 1.7320508075688772f * std_dev;
    const std::size_t n = static_cast<std::size_t>(map.count());
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 65536));
    if (bf16) {
      cuda_detail::DeviceMem m = cuda_detail::device_alloc(n * sizeof(__nv_bfloat16));
      if (n > 0)
        gpu::synth_fill_shard_kernel<__nv_bfloat16><<<blocks, 256, 0, s_->stream>>>(
            static_cast<__nv_bfloat16*>(m.get()), map, seed, static_cast<unsigned>(id), scale, mean);
      TRIATTN_CUDA_TRY(cudaGetLastError());
      return add_handle(impl, std::move(m), n);
    }
    cuda_detail::DeviceMem m = cuda_detail::device_alloc(n * sizeof(float));
    if (n > 0)
      gpu::synth_fill_shard_kernel<float><<<blocks, 256, 0, s_->stream>>>(static_cast<float*>(m.get()), map, seed,
                                                                           static_cast<unsigned>(id), scale, mean);
    TRIATTN_CUDA_TRY(cudaGetLastError());
    const float* p = static_cast<const float*>(m.get());
    impl.bytes += n * sizeof(float);
    impl.mem.push_back(std::move(m));
    return p;
  }
  const float* zeros(WeightStore::Impl& impl, std::size_t n) const {
    cuda_detail::DeviceMem m = cuda_detail::device_alloc(n * sizeof(float));
    TRIATTN_CUDA_TRY(cudaMemsetAsync(m.get(), 0, n * sizeof(float), s_->stream));
    const float* p = static_cast<const float*>(m.get());
    impl.bytes += n * sizeof(float);
    impl.mem.push_back(std::move(m));
    return p;
  }
  static void finish_store(WeightStore::Impl& impl, const ModelConfig& c) {
    const std::size_t wb = impl.type == WeightType::kBF16 ? 2 : 4;
    std::size_t per_step = impl.bytes;
    if (!c.shared_classifier) per_step -= c.n_tok_emb() * wb;  // only one embedding row is read
    impl.bytes_per_step = per_step;
  }

  std::shared_ptr<State> s_;
};

// ---- compression rounds entirely on the device ------------------------------------------------------

/// Batched device rounds over a GpuTriCache: the library's cuda::DeviceRounds (cuda::paged_round
/// for every triggered sequence in one batch on the backend's stream; the cache commits the
/// lengths, tables and freed blocks once the round's event has passed).
using DeviceRounds = triattn::cuda::DeviceRounds<GpuTriCache>;

}  // namespace triattn_example

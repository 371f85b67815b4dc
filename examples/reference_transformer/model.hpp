// SPDX-License-Identifier: Apache-2.0
// Model<Backend>: a Llama-family decoder (RMSNorm, RoPE in either pairing, GQA attention,
// SwiGLU MLP, tied or separate classifier) whose attention keeps its K/V in a triattn::KvCache.
//
// One call to step() runs one forward pass over a batch of chunks (a chunk = some new tokens of
// one sequence: a whole prompt for prefill, one token for decode). Per chunk it
//   1. reads the sequence's logical position p0 (cache.logical_position, tokens processed so
//      far, never reset by compression) and calls cache.extend(seq, n, phase) once, before
//      layer 0, which returns the physical slots [first_slot, first_slot + n);
//   2. per layer rotates q and k of token t at LOGICAL position p0 + t, writes k (post-RoPE) and
//      v at PHYSICAL slot first_slot + t, and lets token t attend to slots [0, first_slot + t]
//      (all older cached tokens, compacted or not, plus the chunk's tokens up to t: causal).
// After a compression round the slots hold the kept tokens in their original order, so the
// same code is right before and after compaction; the new token's own key is always last.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/rope.hpp>

#include "backend.hpp"
#include "cpu_backend.hpp"
#include "model_config.hpp"
#include "tensor_parallel.hpp"

namespace triattn_example {

/// New tokens of one sequence for one step.
struct Chunk {
  triattn::SeqId seq = -1;
  std::span<const int> tokens;
  triattn::Phase phase = triattn::Phase::kDecode;
};

/// Which rows' logits step() computes.
enum class LogitsFor : int {
  kLastOfEachChunk = 0,  ///< one row per chunk (what sampling needs)
  kAllRows = 1,          ///< every token (prefill perplexity, tests)
  kNone = 2,
};

/// Result of one step: logits (host memory) and the rows' (seq, slot, position).
struct StepOutput {
  int vocab = 0;
  std::vector<float> logits;     ///< [rows, vocab]
  std::vector<TokenInfo> rows;   ///< every token of the step, in chunk order
  [[nodiscard]] int num_logit_rows() const noexcept {
    return vocab > 0 ? static_cast<int>(logits.size() / static_cast<std::size_t>(vocab)) : 0;
  }
  [[nodiscard]] std::span<const float> row(int i) const {
    return {logits.data() + static_cast<std::size_t>(i) * vocab, static_cast<std::size_t>(vocab)};
  }
};

/// Thrown by step() when the cache cannot hold the step's tokens; nothing was changed.
class OutOfKvBlocks : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class Backend = CpuBackend>
class Model {
 public:
  using backend_type = Backend;

  /// `weights` must outlive the model (backends may keep pointers into it).
  explicit Model(const ModelWeights& weights, Backend backend = Backend{})
      : Model(nullptr, weights, TpRank{}, std::move(backend)) {}

  /// Rank tp.rank of a tensor-parallel group of tp.size (tensor_parallel.hpp): the model runs its
  /// shard of `full` (copied, so `full` may go away; with tp.size 1 nothing is copied and `full`
  /// must outlive the model). config() is then the shard's (Hq, Hkv, hidden divided by tp.size):
  /// the cache gets that geometry. For tp.size > 1 the backend must carry the group's all-reduce
  /// (backend.tp_size() == tp.size). @throws triattn::logic_error when the model cannot be split.
  Model(const ModelWeights& full, TpRank tp, Backend backend = Backend{})
      : Model(tp.size > 1 ? std::make_shared<const ModelWeights>(shard_weights(full, tp)) : nullptr, full, tp,
              std::move(backend)) {}

  [[nodiscard]] TpRank tp() const noexcept { return tp_; }
  /// The whole model's config (equals config() at tp 1).
  [[nodiscard]] const ModelConfig& full_config() const noexcept { return full_config_; }

 /// Weights already in the backend's memory (CudaBackend::generate_synthetic makes them on the GPU,
  /// for shapes whose host copy would be too large): `store` holds rank tp.rank's shard of a model
  /// whose whole config is `full` (config() is shard_config(full, tp)).
  Model(const ModelConfig& full, TpRank tp, Backend backend, typename Backend::WeightStore store)
      : tp_((check_tp(full, tp), tp)),
        full_config_(full),
        config_(tp.size > 1 ? shard_config(full, tp) : (full.validate(), full)),
        backend_(std::move(backend)),
        store_(std::move(store)) {
    init();
  }

 private:
  Model(std::shared_ptr<const ModelWeights> shard, const ModelWeights& full, TpRank tp, Backend backend)
      : shard_(std::move(shard)),
        tp_((check_tp(full.config, tp), tp)),
        full_config_(full.config),
        config_(((shard_ ? *shard_ : full).validate(), (shard_ ? *shard_ : full).config)),
        backend_(std::move(backend)),
        store_(backend_.upload(shard_ ? *shard_ : full)) {
    init();
  }

  void init() {
    if (tp_.size > 1) {
      if constexpr (requires(Backend& b, float* p) {
                      { b.tp_size() } -> std::convertible_to<int>;
                      b.all_reduce_sum(p, std::size_t{1});
                    }) {
        TRIATTN_EXPECTS(backend_.tp_size() == tp_.size,
                        "Model: rank " + std::to_string(tp_.rank) + " of tp = " + std::to_string(tp_.size) +
                            " needs a backend whose all-reduce spans " + std::to_string(tp_.size) + " ranks, it spans " +
                            std::to_string(backend_.tp_size()) + " (set_all_reduce)");
      } else {
        throw triattn::unsupported(std::string("Model: backend ") + Backend::kName +
                                   " has no all_reduce_sum / tp_size: it cannot run tensor-parallel");
      }
    }
    rope_.style = config_.rope_style;
    rope_.f32_angles = config_.rope_f32_angles;
    triattn::RopeConfig rc;
    rc.style = config_.rope_style;
    rc.theta = config_.rope_theta;
    rope_.inv_freq = triattn::rope_inv_freq(config_.head_dim, rc);
    rope_.inv_freq_f32 = triattn::rope_inv_freq_f32(config_.head_dim, static_cast<float>(config_.rope_theta));
  }

 public:
  [[nodiscard]] const ModelConfig& config() const noexcept { return config_; }
  [[nodiscard]] triattn::ModelGeometry geometry() const noexcept { return config_.geometry(); }
  [[nodiscard]] Backend& backend() noexcept { return backend_; }
  /// The weights in the backend's memory.
  [[nodiscard]] const typename Backend::WeightStore& weights() const noexcept { return store_; }

  /// Observer of pre-RoPE queries (calibration). Empty function = off.
  void set_query_observer(QueryObserver f) { q_observer_ = std::move(f); }
  /// Observer of attention probabilities (fidelity measurements). Empty function = off.
  void set_attention_observer(AttentionObserver f) { att_observer_ = std::move(f); }

  /// Whether step() would find room for `chunks` (blocks in the pool and in each block-table row).
  template <class Cache>
  [[nodiscard]] static bool fits(const Cache& cache, std::span<const Chunk> chunks) {
    return capacity_problem(cache, chunks).empty();
  }

  /// One forward pass over `chunks` (distinct sequences, each with >= 1 token). Extends every
  /// chunk's sequence, writes its K/V into `cache`, and returns the requested logits.
  /// @throws OutOfKvBlocks (cache unchanged) when the tokens do not fit;
  ///         triattn::logic_error on a bad argument (unknown sequence, token out of range...).
  template <class Cache>
  StepOutput step(Cache& cache, std::span<const Chunk> chunks, LogitsFor which = LogitsFor::kLastOfEachChunk) {
    const int n = forward(cache, chunks, which);
    StepOutput out;
    out.vocab = config_.vocab_size;
    out.rows = rows_;
    if (n > 0) {
      const std::size_t count = static_cast<std::size_t>(n) * static_cast<std::size_t>(config_.vocab_size);
      const float* host = backend_.host_view(backend_.data(logits_), count);
      out.logits.assign(host, host + count);
    }
    return out;
  }

  /// step() without the copy to the host: the logits of `which` rows stay in the backend's memory
  /// (logits(), [rows, vocab]; the CUDA backend leaves them on the device for a device argmax).
  /// Returns the number of logit rows. Same checks and throws as step().
  template <class Cache>
  int forward(Cache& cache, std::span<const Chunk> chunks, LogitsFor which = LogitsFor::kLastOfEachChunk) {
    validate(cache, chunks);
    if (const std::string why = capacity_problem(cache, chunks); !why.empty()) throw OutOfKvBlocks(why);
    rows_.clear();
    tokens_.clear();
    chunk_row_.clear();
    chunk_slot_.clear();
    for (const Chunk& ch : chunks) {
      const std::int64_t p0 = cache.logical_position(ch.seq);
      const triattn::AppendResult r = cache.extend(ch.seq, static_cast<int>(ch.tokens.size()), ch.phase);
      TRIATTN_EXPECTS(r.ok(), "Model::step: extend failed after the capacity check (sequence " + std::to_string(ch.seq) + ")");
      chunk_row_.push_back(static_cast<int>(rows_.size()));
      chunk_slot_.push_back(r.first_slot);
      for (std::size_t t = 0; t < ch.tokens.size(); ++t) {
        rows_.push_back(TokenInfo{ch.seq, r.first_slot + static_cast<int>(t), p0 + static_cast<std::int64_t>(t)});
        tokens_.push_back(ch.tokens[t]);
      }
    }
    triattn::dispatch_dtype_in(typename Backend::kv_storage_types{}, cache.config().dtype,
                               std::string("the reference transformer's ") + Backend::kName + " backend",
                               [&](auto tag) { layers<typename decltype(tag)::type>(cache, chunks); });
    return which == LogitsFor::kNone ? 0 : classify(chunks, which);
  }

  /// Logits of the last forward() / step(), [rows, vocab] in the backend's memory.
  [[nodiscard]] const float* logits() const noexcept { return backend_.data(logits_); }
  /// (seq, slot, position) of every token of the last forward() / step(), in chunk order.
  [[nodiscard]] std::span<const TokenInfo> rows() const noexcept { return rows_; }

 private:
  template <class Cache>
  void validate(const Cache& cache, std::span<const Chunk> chunks) const {
    const triattn::ModelGeometry& g = cache.config().model;
    const triattn::ModelGeometry m = geometry();
    TRIATTN_EXPECTS(g.num_layers == m.num_layers && g.num_q_heads == m.num_q_heads &&
                        g.num_kv_heads == m.num_kv_heads && g.head_dim == m.head_dim,
                    "Model::step: the cache geometry (layers, q heads, kv heads, head_dim) = (" +
                        std::to_string(g.num_layers) + ", " + std::to_string(g.num_q_heads) + ", " +
                        std::to_string(g.num_kv_heads) + ", " + std::to_string(g.head_dim) + ") differs from the model's (" +
                        std::to_string(m.num_layers) + ", " + std::to_string(m.num_q_heads) + ", " +
                        std::to_string(m.num_kv_heads) + ", " + std::to_string(m.head_dim) + ")");
    TRIATTN_EXPECTS(!chunks.empty(), "Model::step: no chunks");
    seen_.assign(static_cast<std::size_t>(cache.config().max_seqs), 0);  // O(chunks) duplicate check
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      const Chunk& ch = chunks[i];
      TRIATTN_EXPECTS(cache.is_active(ch.seq), "Model::step: sequence " + std::to_string(ch.seq) + " is not active");
      TRIATTN_EXPECTS(!ch.tokens.empty(), "Model::step: chunk " + std::to_string(i) + " has no tokens");
      TRIATTN_EXPECTS(seen_[static_cast<std::size_t>(ch.seq)]++ == 0,
                      "Model::step: sequence " + std::to_string(ch.seq) + " appears in two chunks of one step");
      for (int t : ch.tokens)
        TRIATTN_EXPECTS(t >= 0 && t < config_.vocab_size, "Model::step: token id " + std::to_string(t) +
                                                              " outside [0, vocab_size = " +
                                                              std::to_string(config_.vocab_size) + ")");
    }
  }

  template <class Cache>
  static std::string capacity_problem(const Cache& cache, std::span<const Chunk> chunks) {
    const triattn::CacheConfig& cfg = cache.config();
    const std::int64_t row_cap = static_cast<std::int64_t>(cfg.blocks_per_seq()) * cfg.block_size;
    std::int64_t need = 0;
    for (const Chunk& ch : chunks) {
      const std::int64_t len = cache.physical_length(ch.seq);
      const std::int64_t new_len = len + static_cast<std::int64_t>(ch.tokens.size());
      if (new_len > row_cap)
        return "sequence " + std::to_string(ch.seq) + " would hold " + std::to_string(new_len) +
               " tokens, more than its block-table row (" + std::to_string(row_cap) + ")";
      need += cache.blocks_to_extend(ch.seq, static_cast<int>(ch.tokens.size()));  // incl. a copy-on-write block
    }
    const auto free_blocks = static_cast<std::int64_t>(cache.allocator().num_free());
    if (need > free_blocks)
      return "the step needs " + std::to_string(need) + " new KV blocks, the pool has " + std::to_string(free_blocks) + " free";
    return {};
  }

  // The only cross-rank step (tensor_parallel.hpp); nothing at tp 1, so single-rank backends
  // keep their fusions (e.g. a GEMV with the residual add as its epilogue).
  void all_reduce(float* p, std::size_t n) {
    if constexpr (requires { backend_.all_reduce_sum(p, n); }) {
      if (tp_.size > 1) backend_.all_reduce_sum(p, n);
    }
  }

  void ensure(typename Backend::Buffer& b, std::size_t n) {
    if (backend_.size(b) < n) b = backend_.alloc(n);
  }

  template <class T, class Cache>
  void layers(Cache& cache, std::span<const Chunk> chunks) {
    const std::span<const TokenInfo> rows(rows_);
    const ModelConfig& c = config_;
    const WeightPtrs& w = store_.ptrs();
    const int n = static_cast<int>(rows.size());
    const std::size_t N = rows.size();
    ensure(x_, N * c.dim);
    ensure(xb_, N * c.dim);
    ensure(xb2_, N * c.dim);
    ensure(q_, N * c.q_dim());
    ensure(k_, N * c.kv_dim());
    ensure(v_, N * c.kv_dim());
    ensure(att_, N * c.q_dim());
    ensure(h1_, N * c.hidden_dim);
    ensure(h3_, N * c.hidden_dim);
    float* x = backend_.data(x_);
    float* xb = backend_.data(xb_);
    float* xb2 = backend_.data(xb2_);
    float* q = backend_.data(q_);
    float* k = backend_.data(k_);
    float* v = backend_.data(v_);
    float* att = backend_.data(att_);
    float* h1 = backend_.data(h1_);
    float* h3 = backend_.data(h3_);
    const std::size_t D = static_cast<std::size_t>(c.dim);
    const std::size_t QD = static_cast<std::size_t>(c.q_dim());
    const std::size_t KVD = static_cast<std::size_t>(c.kv_dim());
    const std::size_t H = static_cast<std::size_t>(c.hidden_dim);

    backend_.embed(x, w.tok_emb, tokens_, c.dim);
    for (int l = 0; l < c.n_layers; ++l) {
      const std::size_t L = static_cast<std::size_t>(l);
      backend_.rmsnorm(xb, x, w.rms_att + L * D, n, c.dim, c.rms_eps);
      backend_.matmul(q, w.wq + L * QD * D, xb, n, c.q_dim(), c.dim);
      backend_.matmul(k, w.wk + L * KVD * D, xb, n, c.kv_dim(), c.dim);
      backend_.matmul(v, w.wv + L * KVD * D, xb, n, c.kv_dim(), c.dim);
      if (w.bq != nullptr) {
        backend_.add_bias(q, w.bq + L * QD, n, c.q_dim());
        backend_.add_bias(k, w.bk + L * KVD, n, c.kv_dim());
        backend_.add_bias(v, w.bv + L * KVD, n, c.kv_dim());
      }
      if (q_observer_) q_observer_(l, backend_.host_view(q, N * QD), n);
      backend_.rope(q, n, c.n_heads, c.head_dim, rows, rope_);
      backend_.rope(k, n, c.n_kv_heads, c.head_dim, rows, rope_);
      for (std::size_t i = 0; i < chunks.size(); ++i) {
        const std::size_t r0 = static_cast<std::size_t>(chunk_row_[i]);
        backend_.template write_kv<T>(cache, chunks[i].seq, l, chunk_slot_[i], k + r0 * KVD, v + r0 * KVD,
                                      static_cast<int>(chunks[i].tokens.size()), c.kv_dim());
      }
      backend_.template attention<T>(att, q, rows, cache, l, c, att_observer_ ? &att_observer_ : nullptr);
      backend_.matmul(xb2, w.wo + L * D * QD, att, n, c.dim, c.q_dim());
      all_reduce(xb2, N * D);  // tensor parallel: sum of the ranks' partial projections
      backend_.add(x, xb2, n * c.dim);
      backend_.rmsnorm(xb, x, w.rms_ffn + L * D, n, c.dim, c.rms_eps);
      backend_.matmul(h1, w.w1 + L * H * D, xb, n, c.hidden_dim, c.dim);
      backend_.matmul(h3, w.w3 + L * H * D, xb, n, c.hidden_dim, c.dim);
      backend_.swiglu(h1, h3, n * c.hidden_dim);
      backend_.matmul(xb, w.w2 + L * D * H, h1, n, c.dim, c.hidden_dim);
      all_reduce(xb, N * D);
      backend_.add(x, xb, n * c.dim);
    }
  }

  // The logits of the picked rows into logits_ (backend memory); returns how many rows.
  int classify(std::span<const Chunk> chunks, LogitsFor which) {
    const ModelConfig& c = config_;
    const WeightPtrs& w = store_.ptrs();
    const std::size_t D = static_cast<std::size_t>(c.dim);
    const std::size_t V = static_cast<std::size_t>(c.vocab_size);
    const bool all = which == LogitsFor::kAllRows;
    const std::size_t picked = all ? rows_.size() : chunks.size();
    ensure(logits_, picked * V);
    float* x = backend_.data(x_);
    float* xb = backend_.data(xb_);
    float* logits = backend_.data(logits_);
    if (all) {  // every row: one matmul shares the pass over the classifier
      const int n = static_cast<int>(picked);
      backend_.rmsnorm(xb, x, w.rms_final, n, c.dim, c.rms_eps);
      backend_.matmul(logits, w.wcls, xb, n, c.vocab_size, c.dim);
    } else {  // the last row of each chunk
      for (std::size_t i = 0; i < chunks.size(); ++i) {
        const std::size_t r = static_cast<std::size_t>(chunk_row_[i]) + chunks[i].tokens.size() - 1;
        backend_.rmsnorm(xb + r * D, x + r * D, w.rms_final, 1, c.dim, c.rms_eps);
        backend_.matmul(logits + i * V, w.wcls, xb + r * D, 1, c.vocab_size, c.dim);
      }
    }
    if constexpr (requires { backend_.flush(); }) backend_.flush();  // launch what a recording backend holds
    return static_cast<int>(picked);
  }

  std::shared_ptr<const ModelWeights> shard_;  // this rank's weights when tp > 1 (else the caller's)
  TpRank tp_;
  ModelConfig full_config_;
  ModelConfig config_;
  Backend backend_;
  typename Backend::WeightStore store_;
  RopeTables rope_;
  QueryObserver q_observer_;
  AttentionObserver att_observer_;
  std::vector<TokenInfo> rows_;  // every token of the current step, in chunk order
  std::vector<int> tokens_;      // [rows] host token ids of the current step
  std::vector<int> chunk_row_;   // first row of each chunk
  std::vector<int> chunk_slot_;  // first physical slot of each chunk
  mutable std::vector<unsigned char> seen_;  // validate(): sequences met in this step's chunks
  typename Backend::Buffer x_, xb_, xb2_, q_, k_, v_, att_, h1_, h3_, logits_;
};

}  // namespace triattn_example

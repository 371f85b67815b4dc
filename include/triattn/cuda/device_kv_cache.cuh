// SPDX-License-Identifier: Apache-2.0
// Convenience layer for a KvCache that lives on the GPU: the DeviceKvCache alias, publish() of
// the host bookkeeping to the allocator's device mirror, a throwing append_tokens() that extends a
// sequence and writes its new tokens with the append kernel, and DeviceRounds: batched,
// asynchronous compression rounds (cuda::paged_round) whose table and length updates and block
// releases are committed once the GPU work is done (an event), never while a kernel may still
// touch the blocks.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <triattn/core/keep_counts.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/device_tables.cuh>
#include <triattn/cuda/engine/paged_round.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/positions_kernel.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>
#include <triattn/cuda/tuning/select.cuh>

namespace triattn::cuda {

/// KvCache over one cudaMalloc with published device tables and the device compactor.
template <class... Extra>
using DeviceKvCache = KvCache<DeviceAllocator, DeviceCompactor, Extra...>;

/// True when Cache's allocator keeps a device mirror of the tables (WithDeviceTables).
template <class Cache>
inline constexpr bool has_device_tables_v = requires(typename Cache::allocator_type& a) {
  a.publish(std::span<const std::int32_t>{}, std::span<const std::int32_t>{}, cudaStream_t{});
  a.published_tables();
};

/// Uploads `cache`'s host block tables and lengths to its allocator's device mirror on
/// `stream`. Call after extend / apply_keep_plan / release / fork and before kernels that read
/// cache.view(); use the stream those kernels (and the compactor) run on.
template <class Cache>
  requires has_device_tables_v<Cache>
void publish(Cache& cache, cudaStream_t stream) {
  cache.allocator().publish(cache.host_block_tables(), cache.host_lengths(), stream);
}

/// extend(seq, n) + publish + append kernel for all layers: k, v are [num_layers, n,
/// num_kv_heads, head_dim] device arrays of the cache's dtype (copied), or float for any cache
/// dtype (rounded as KvCache::append_values does; fp8: x / scale, saturating). On kOutOfBlocks
/// nothing was written and nothing changed. Asynchronous on `stream`.
/// @throws logic_error on bad arguments, cuda_error when publishing or the launch fails.
template <class T, class Cache>
  requires has_device_tables_v<Cache>
[[nodiscard]] AppendResult append_tokens(Cache& cache, SeqId seq, const T* k, const T* v, int n, cudaStream_t stream,
                                  Phase phase = Phase::kDecode) {
  TRIATTN_EXPECTS((dtype_of<T> == cache.config().dtype || std::is_same_v<T, float>),
                  std::string("cuda::append_tokens: element type is ") + dtype_name(dtype_of<T>) +
                      " but the cache stores " + dtype_name(cache.config().dtype) + " (pass that or float32)");
  dispatch_head_dim(cache.config().model.head_dim, [](auto) {});  // throws unsupported naming the list
  const AppendResult r = cache.extend(seq, n, phase);
  if (!r.ok() || n == 0) return r;
  publish(cache, stream);
  cuda::dispatch_dtype(cache.config().dtype, "cuda::append_tokens", [&](auto tag) {
    using C = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, C> || std::is_same_v<T, float>)
      TRIATTN_CUDA_TRY(append::run_contiguous(cache.template view<C>(), seq, r.first_slot, 0,
                                              cache.config().model.num_layers, k, v, n, stream));
  });
  return r;
}

/// A scorer whose statistics live on the device (TriAttentionDeviceScorer): the ScoreModelView
/// a device round scores with is all DeviceRounds asks of it.
template <class S>
concept DeviceScorer = requires(const S& s) {
  { s.device_model() } -> std::convertible_to<const ScoreModelView&>;
};

/// A selector that describes itself by SelectionParams (TopKSelector): what a device round selects with.
template <class S>
concept ParamsSelector = requires(const S& s) {
  { s.params() } -> std::convertible_to<const SelectionParams&>;
};

/// A KvCache a device round can run on: published device tables, a DeviceScorer and a ParamsSelector.
template <class Cache>
concept DeviceRoundCache =
    has_device_tables_v<Cache> && DeviceScorer<typename Cache::scorer_type> && ParamsSelector<typename Cache::selector_type>;

/// Batched, asynchronous compression rounds for a KvCache on the GPU (a device allocator with
/// published tables, TriAttentionDeviceScorer, a selector with SelectionParams). A sequence's
/// shared prefix (KvCache::shared_prefix: blocks another sequence or the prefix cache holds) is
/// protected as in KvCache::compress: never selected away, moved or rewritten.
///
/// compress_if_needed(seqs, stream) launches one cuda::paged_round on `stream` for the sequences
/// of `seqs` whose trigger fired and records an event behind it; it does not wait. The cache's
/// block tables, lengths, prompt state and freed blocks are updated by poll() (when the event has
/// completed; no wait) or wait() (waits for it): a few integers per sequence come back, and the
/// commit is O(batch + blocks freed). With CacheConfig::track_positions the positions stay in
/// device memory beside the KV (the allocator's WithDeviceTables::position_store, which the round
/// updates on the device; tracked_positions() reads a sequence's); kept_positions() holds the last
/// round's kept tokens' original positions for the caller to copy, and its kept slots also come
/// back (last_plan). Until then the launched sequences are in flight:
/// the engine must not extend, fork or release them (in_flight(seq) tells), nothing else changes,
/// and their tail blocks stay allocated, so no block is reused while a kernel may touch it.
/// Other sequences may be extended meanwhile (their appends publish tables the round does not read
/// after it started). One round is in flight at a time: compress_if_needed first polls and, while
/// the previous round is still running, launches nothing (the trigger fires again next step).
/// launch_beside() runs the round on a stream of its own beside the engine's (its kernels overlap
/// the engine's next decode steps instead of running between them) over a private copy of the
/// device tables.
/// Steady state allocates nothing, on the device or the host: buffers grow to the largest round
/// seen (reserve() sizes them up front), and the reports returned by reference are reused. A
/// sequence with non-finite scores is reported kNonFinite and left unchanged (NonFinitePolicy::kRefuse).
template <class Cache>
  requires DeviceRoundCache<Cache>
class DeviceRounds {
 public:
  /// Tensor parallelism: union rounds agree through `agree` (see paged_round with an agreement).
  using AgreementFn = std::function<cudaError_t(std::uint8_t* flags, float* vmax, int batch, int max_len, cudaStream_t)>;

  explicit DeviceRounds(Cache& cache) : cache_(&cache) { tuning::require_device_arch(); }
  DeviceRounds(const DeviceRounds&) = delete;
  DeviceRounds& operator=(const DeviceRounds&) = delete;
  ~DeviceRounds() {
    if (event_ != nullptr) {
      if (pending_) report_error(cudaEventSynchronize(event_), "DeviceRounds: waiting for a round at destruction");
      report_error(cudaEventDestroy(event_), "DeviceRounds: cudaEventDestroy");
    }
    if (snap_ready_ != nullptr) report_error(cudaEventDestroy(snap_ready_), "DeviceRounds: cudaEventDestroy");
    for (void* p : {dev_, ws_, static_cast<void*>(positions_), static_cast<void*>(snap_)})
      report_error(p != nullptr ? cudaFree(p) : cudaSuccess, "DeviceRounds: cudaFree");
    report_error(host_ != nullptr ? cudaFreeHost(host_) : cudaSuccess, "DeviceRounds: cudaFreeHost");
  }

  void set_agreement(AgreementFn agree) { agreement_ = std::move(agree); }

  /// Also bring back every round's kept slots (last_plan), with or without tracked positions: a
  /// [batch, kept rows, max_keep] download per round, for tests and tools that replay the plans.
  void set_keep_plans(bool on) {
    TRIATTN_EXPECTS(!pending_, "DeviceRounds::set_keep_plans: a round is in flight");
    keep_plans_ = on;
  }

  /// Sizes the buffers for rounds of up to `batch` sequences of up to `max_len` slots.
  void reserve(int batch, int max_len) { ensure(batch, max_len, max_len); }

  /// Commits a finished round (no wait), then launches a round for the due sequences of `seqs`
  /// unless one is still running. Returns the reports of the round committed by this call (empty
  /// when none was), one per sequence of that round; valid until the next call of this object.
  /// @throws logic_error (nothing launched) on a bad, inactive, duplicate or in-flight id, or
  /// when a round could rewrite a shared block that is not part of the sequence's leading shared
  /// prefix.
  const std::vector<CompressionReport>& compress_if_needed(std::span<const SeqId> seqs, cudaStream_t stream) {
    const std::vector<CompressionReport>& done = poll();
    if (pending_) return done;
    due_.clear();
    for (SeqId s : seqs)
      if (cache_->needs_compression(s)) due_.push_back(s);
    launch(due_, stream);
    return done;
  }

  /// Launches a round for every sequence of `seqs` (due or not: each is brought to its keep
  /// count, as KvCache::compress). @throws logic_error when a round is still in flight.
  void launch(std::span<const SeqId> seqs, cudaStream_t stream) { launch_on(seqs, stream, stream, false); }

  /// launch() with the round's kernels on `side`, beside an engine that goes on decoding other
  /// sequences on `engine`. The tables are published on `engine` and copied there into the round's
  /// own device buffer, which is all the round reads of them: the engine's next publishes rewrite
  /// the mirror while the round runs, and the round's device checks read every table row, so the
  /// mirror itself could be seen half rewritten. `side` waits for that copy (an event) and for
  /// nothing else of `engine`; poll()/wait() commit as for launch() and publish on `engine`.
  /// Until then the launched sequences must not be extended, forked or released (in_flight()).
  /// @throws as launch().
  void launch_beside(std::span<const SeqId> seqs, cudaStream_t engine, cudaStream_t side) {
    launch_on(seqs, engine, side, true);
  }

 private:
  // Publishes on `engine` and runs the round on `side` (the same stream for launch()); with
  // `snapshot` the round reads a copy of the device tables taken on `engine`.
  void launch_on(std::span<const SeqId> seqs, cudaStream_t engine, cudaStream_t side, bool snapshot) {
    TRIATTN_EXPECTS(!pending_, "DeviceRounds::launch: a round is still in flight (poll() or wait() first)");
    if (seqs.empty()) return;
    const CacheConfig& cfg = cache_->config();
    const ValidSelectionParams& sp = cache_->selector().params();
    const int batch = static_cast<int>(seqs.size());
    int max_len = 1, max_keep = 1;
    seen_.assign(static_cast<std::size_t>(cfg.max_seqs), 0);  // no allocation once sized
    for (SeqId s : seqs) {
      const int len = cache_->physical_length(s);  // throws on a bad or inactive id
      TRIATTN_EXPECTS(!seen_[static_cast<std::size_t>(s)]++,
                      "DeviceRounds::launch: sequence " + std::to_string(s) + " appears twice");
      const int prompt = cache_->prompt_length(s);
      const KeepCounts kc = keep_counts_unchecked(len, prompt, sp, cache_->shared_prefix(s));
      // Compaction never moves slots [0, begin) (the shared prefix among them); every block from
      // there on must be this sequence's alone.
      const auto table = cache_->block_table(s);
      for (std::size_t j = static_cast<std::size_t>(kc.selectable_begin / cfg.block_size); j < table.size(); ++j)
        TRIATTN_EXPECTS(cache_->allocator().ref_count(table[j]) == 1,
                        "DeviceRounds::launch: sequence " + std::to_string(s) + " shares block " +
                            std::to_string(table[j]) + " (slots from " + std::to_string(j * cfg.block_size) +
                            ") with another sequence, and the round may rewrite it");
      max_len = std::max(max_len, len);
      max_keep = std::max(max_keep, kc.keep);
    }
    ensure(batch, max_len, max_keep);
    const int rows = kept_row_count();
    const Layout lay = layout(batch, rows, max_keep);
    char* h = static_cast<char*>(host_);
    char* d = static_cast<char*>(dev_);
    auto* h_ids = reinterpret_cast<std::int32_t*>(h + lay.ids);
    auto* h_t0 = reinterpret_cast<std::int64_t*>(h + lay.t0);
    auto* h_prompts = reinterpret_cast<std::int32_t*>(h + lay.prompts);
    auto* h_shared = reinterpret_cast<std::int32_t*>(h + lay.shared);
    auto* h_in_place = reinterpret_cast<std::int32_t*>(h + lay.in_place);
    auto* h_explicit = reinterpret_cast<std::int32_t*>(h + lay.explicit_len);
    auto* h_old = reinterpret_cast<std::int32_t*>(h + lay.old_lens);
    for (int b = 0; b < batch; ++b) {
      const SeqId s = seqs[static_cast<std::size_t>(b)];
      h_ids[b] = s;
      h_t0[b] = cache_->logical_position(s);
      h_prompts[b] = cache_->prompt_length(s);
      h_shared[b] = cache_->shared_prefix(s);
      const PositionState ps = cache_->position_state(s);
      h_in_place[b] = ps.in_place;
      h_explicit[b] = ps.explicit_len;
      h_old[b] = cache_->physical_length(s);
    }
    publish(*cache_, engine);  // the round reads the device mirror of the tables and lengths
    const std::int32_t* tables = cache_->allocator().published_tables();
    const std::int32_t* lens = cache_->allocator().published_lengths();
    if (snapshot) {
      const std::size_t S = static_cast<std::size_t>(cfg.max_seqs);
      const std::size_t T = S * static_cast<std::size_t>(cfg.blocks_per_seq());
      if (snap_ready_ == nullptr) TRIATTN_CUDA_TRY(cudaEventCreateWithFlags(&snap_ready_, cudaEventDisableTiming));
      if (snap_ == nullptr) TRIATTN_CUDA_TRY(cudaMalloc(&snap_, (S + T) * sizeof(std::int32_t)));  // lengths, tables
      TRIATTN_CUDA_TRY(cudaMemcpyAsync(snap_, lens, S * sizeof(std::int32_t), cudaMemcpyDeviceToDevice, engine));
      TRIATTN_CUDA_TRY(cudaMemcpyAsync(snap_ + S, tables, T * sizeof(std::int32_t), cudaMemcpyDeviceToDevice, engine));
      TRIATTN_CUDA_TRY(cudaEventRecord(snap_ready_, engine));
      TRIATTN_CUDA_TRY(cudaStreamWaitEvent(side, snap_ready_, 0));
      lens = snap_;
      tables = snap_ + S;
    }
    const cudaStream_t stream = side;
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(d, h, lay.inputs, cudaMemcpyHostToDevice, stream));
    const RoundBatch rb{reinterpret_cast<const std::int32_t*>(d + lay.ids), reinterpret_cast<const std::int64_t*>(d + lay.t0),
                        reinterpret_cast<const std::int32_t*>(d + lay.prompts), batch, max_len,
                        reinterpret_cast<const std::int32_t*>(d + lay.shared)};
    const RoundOutputs out = outputs(d, lay, batch, rows, max_keep);
    const std::size_t ws_bytes = paged_round_workspace_size(
        RoundShape{cfg.model.num_layers, cfg.model.num_q_heads, cfg.model.num_kv_heads}, sp.mode, batch, max_len,
        cfg.max_seqs, cfg.num_blocks);
    const auto run = [&](auto tag) {
      using T = typename decltype(tag)::type;
      if (agreement_) {
        auto agree = [this](std::uint8_t* f, float* v, int b, int m, cudaStream_t st) noexcept {
          try {
            return agreement_(f, v, b, m, st);
          } catch (...) {
            return cudaErrorUnknown;
          }
        };
        paged_round(cache_->template view<T>().with_tables(tables, lens), cache_->scorer().device_model(), sp,
                    RoundTrigger::kAlways, rb, out, ws_, ws_bytes, agree, stream);
      } else {
        paged_round(cache_->template view<T>().with_tables(tables, lens), cache_->scorer().device_model(), sp,
                    RoundTrigger::kAlways, rb, out, ws_, ws_bytes, stream);
      }
    };
    cuda::dispatch_dtype(cfg.dtype, "the device compression round", run);
    if (cfg.track_positions) map_positions(d, lay, rb, out, tables, stream);
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(h + lay.outputs, d + lay.outputs, lay.err - lay.outputs, cudaMemcpyDeviceToHost,
                                     stream));
    // The device checks' verdict (all clear for a consistent cache; commit() throws otherwise).
    TRIATTN_CUDA_TRY(cudaMemcpyAsync(h + lay.err, paged_round_error(ws_), sizeof(RoundError), cudaMemcpyDeviceToHost,
                                     stream));
    TRIATTN_CUDA_TRY(cudaEventRecord(event_, stream));
    in_flight_.assign(seqs.begin(), seqs.end());  // reuses its capacity
    flight_.resize(static_cast<std::size_t>(cfg.max_seqs), 0);
    for (SeqId s : seqs) flight_[static_cast<std::size_t>(s)] = 1;
    batch_ = batch;
    rows_ = rows;
    max_keep_ = max_keep;
    stream_ = engine;  // the commit publishes where the engine's kernels read the tables
    pending_ = true;
  }

 public:
  /// Commits the round in flight if its event has completed (no wait): updates the cache and
  /// publishes its tables on the stream launch() published on (the engine's for launch_beside). Returns its reports (empty if none was
  /// committed), valid until the next call of this object.
  const std::vector<CompressionReport>& poll() {
    reports_.clear();
    if (!pending_) return reports_;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return reports_;
    TRIATTN_CUDA_TRY(e);
    return commit();
  }

  /// Waits for the round in flight (if any) and commits it. Reports as poll().
  const std::vector<CompressionReport>& wait() {
    reports_.clear();
    if (!pending_) return reports_;
    TRIATTN_CUDA_TRY(cudaEventSynchronize(event_));
    return commit();
  }

  /// compress_if_needed, then wait(): the reports of the round this call launched (simple
  /// generation loops that extend every sequence on the next step anyway).
  const std::vector<CompressionReport>& compress_if_needed_and_wait(std::span<const SeqId> seqs, cudaStream_t stream) {
    (void)wait();
    (void)compress_if_needed(seqs, stream);
    return wait();
  }

  /// Sequences of the last committed round, in batch order.
  [[nodiscard]] std::span<const SeqId> last_seqs() const noexcept { return last_seqs_; }
  /// The keep plan (pre-round slots) entry b of the last committed round applied; an empty
  /// KeepPlan (no layers) when it was not compressed (its report's status says why). Valid until
  /// the next launch. @throws logic_error unless the cache tracks positions (the kept slots only
  /// come back then).
  [[nodiscard]] KeepPlan last_plan(std::size_t b) const {
    TRIATTN_EXPECTS(rows_ > 0, "DeviceRounds::last_plan: the kept slots come back only with set_keep_plans(true) "
                               "or when the cache tracks positions (CacheConfig::track_positions)");
    TRIATTN_EXPECTS(!pending_ && b < last_seqs_.size(), "DeviceRounds::last_plan: entry " + std::to_string(b) +
                                                            " of the last committed round does not exist");
    const ModelGeometry& g = cache_->config().model;
    const Layout lay = layout(batch_, rows_, max_keep_);
    const RoundOutputs out = outputs(static_cast<char*>(host_), lay, batch_, rows_, max_keep_);
    if (out.status[b] != static_cast<std::int32_t>(RoundStatus::kCompressed)) return KeepPlan{};
    const int keep = out.new_lens[b];
    KeepPlan plan(g.num_layers, g.num_kv_heads, keep);
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const int r = rows_ == 1 ? 0 : rows_ == g.num_kv_heads ? h : l * g.num_kv_heads + h;
        std::copy_n(out.kept + (b * static_cast<std::size_t>(rows_) + static_cast<std::size_t>(r)) * max_keep_, keep,
                    plan.row(l, h));
      }
    return plan;
  }

  /// The last launched round's kept positions in device memory (CacheConfig::track_positions):
  /// positions[(b * rows + r) * max_keep + i] is the original logical position of the token slot
  /// i of row r = layer * num_kv_heads + kv_head of batch entry b holds after the round, i below
  /// the entry's new length (kCompressed entries only). Ordered on the round's stream; valid until
  /// the next launch. Copy it asynchronously if wanted; nothing comes to the host otherwise.
  struct KeptPositions {
    const std::int32_t* positions = nullptr;
    int batch = 0, rows = 0, max_keep = 0;
  };
  [[nodiscard]] KeptPositions kept_positions() const {
    TRIATTN_EXPECTS(cache_->config().track_positions,
                    "DeviceRounds::kept_positions: the cache does not track positions (CacheConfig::track_positions)");
    const CacheConfig& cfg = cache_->config();
    return {positions_, batch_, cfg.model.num_layers * cfg.model.num_kv_heads, max_keep_};
  }

  [[nodiscard]] bool pending() const noexcept { return pending_; }
  /// O(1): engines ask it of every sequence every step.
  [[nodiscard]] bool in_flight(SeqId s) const noexcept {
    return pending_ && s >= 0 && static_cast<std::size_t>(s) < flight_.size() && flight_[static_cast<std::size_t>(s)] != 0;
  }

 private:
  struct Layout {
    std::size_t ids, t0, prompts, shared, in_place, explicit_len, old_lens, inputs, outputs, new_lens, status, fb, fe,
        fm, kept, err, total;
  };
  // Rows of kept slots a round brings back: none unless positions or plans are asked for.
  [[nodiscard]] int kept_row_count() const {
    const CacheConfig& cfg = cache_->config();
    return cfg.track_positions || keep_plans_
               ? kept_rows(cache_->selector().params().mode, cfg.model.num_layers, cfg.model.num_kv_heads)
               : 0;
  }
  static std::size_t up(std::size_t x) noexcept { return (x + 255) / 256 * 256; }
  static Layout layout(int batch, int rows, int max_keep) noexcept {
    const std::size_t B = static_cast<std::size_t>(batch);
    Layout l{};
    l.t0 = 0;
    l.ids = up(B * 8);
    l.prompts = l.ids + up(B * 4);
    l.shared = l.prompts + up(B * 4);
    l.in_place = l.shared + up(B * 4);
    l.explicit_len = l.in_place + up(B * 4);
    l.old_lens = l.explicit_len + up(B * 4);
    l.inputs = l.old_lens + up(B * 4);
    l.outputs = l.inputs;
    l.new_lens = l.outputs;
    l.status = l.new_lens + up(B * 4);
    l.fb = l.status + up(B * 4);
    l.fe = l.fb + up(B * 4);
    l.fm = l.fe + up(B * 4);
    l.kept = l.fm + up(B * 4);
    l.err = l.kept + up(B * static_cast<std::size_t>(rows) * static_cast<std::size_t>(max_keep) * 4);
    l.total = l.err + up(sizeof(RoundError));
    return l;
  }
  static RoundOutputs outputs(char* base, const Layout& l, int batch, int rows, int max_keep) noexcept {
    (void)batch;
    RoundOutputs o;
    o.new_lens = reinterpret_cast<std::int32_t*>(base + l.new_lens);
    o.status = reinterpret_cast<std::int32_t*>(base + l.status);
    o.freed_begin = reinterpret_cast<std::int32_t*>(base + l.fb);
    o.freed_end = reinterpret_cast<std::int32_t*>(base + l.fe);
    o.first_moved = reinterpret_cast<std::int32_t*>(base + l.fm);
    o.kept = rows > 0 ? reinterpret_cast<std::int32_t*>(base + l.kept) : nullptr;
    o.kept_rows = rows;
    o.max_keep = max_keep;
    return o;
  }

  // Grows the buffers (only when a round is larger than every earlier one).
  void ensure(int batch, int max_len, int max_keep) {
    const CacheConfig& cfg = cache_->config();
    const ValidSelectionParams& sp = cache_->selector().params();
    const int rows = kept_row_count();
    const std::size_t io = layout(batch, rows, max_keep).total;
    const std::size_t ws = paged_round_workspace_size(
        RoundShape{cfg.model.num_layers, cfg.model.num_q_heads, cfg.model.num_kv_heads}, sp.mode, batch, max_len,
        cfg.max_seqs, cfg.num_blocks);
    if (event_ == nullptr) TRIATTN_CUDA_TRY(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));

    if (io > io_bytes_) {
      if (dev_ != nullptr) TRIATTN_CUDA_TRY(cudaFree(dev_));
      if (host_ != nullptr) TRIATTN_CUDA_TRY(cudaFreeHost(host_));
      dev_ = host_ = nullptr;
      io_bytes_ = 0;
      TRIATTN_CUDA_TRY(cudaMalloc(&dev_, io));
      TRIATTN_CUDA_TRY(cudaMallocHost(&host_, io));
      io_bytes_ = io;
    }
    if (ws > ws_bytes_) {
      if (ws_ != nullptr) TRIATTN_CUDA_TRY(cudaFree(ws_));
      ws_ = nullptr;
      ws_bytes_ = 0;
      TRIATTN_CUDA_TRY(cudaMalloc(&ws_, ws));
      ws_bytes_ = ws;
    }
    if (!cfg.track_positions) return;
    const std::size_t R = static_cast<std::size_t>(cfg.model.num_layers) * cfg.model.num_kv_heads;
    (void)cache_->allocator().position_store(static_cast<int>(R));  // the cache's store, shared by its rounds
    const std::size_t pos = static_cast<std::size_t>(batch) * R * static_cast<std::size_t>(max_keep) * 4;
    if (pos > positions_bytes_) {
      if (positions_ != nullptr) TRIATTN_CUDA_TRY(cudaFree(positions_));
      positions_ = nullptr;
      positions_bytes_ = 0;
      TRIATTN_CUDA_TRY(cudaMalloc(&positions_, pos));
      positions_bytes_ = pos;
    }
  }

  // The tracked positions' two passes behind the round (positions_kernel.cuh).
  void map_positions(char* d, const Layout& lay, const RoundBatch& rb, const RoundOutputs& out,
                     const std::int32_t* tables, cudaStream_t stream) {
    const CacheConfig& cfg = cache_->config();
    PositionPass p;
    p.store = cache_->allocator().position_store(cfg.model.num_layers * cfg.model.num_kv_heads);
    p.positions = positions_;
    p.in_place = reinterpret_cast<const std::int32_t*>(d + lay.in_place);
    p.explicit_len = reinterpret_cast<const std::int32_t*>(d + lay.explicit_len);
    p.old_lens = reinterpret_cast<const std::int32_t*>(d + lay.old_lens);
    p.rows = cfg.model.num_layers * cfg.model.num_kv_heads;
    p.num_kv_heads = cfg.model.num_kv_heads;
    const dim3 grid(static_cast<unsigned>(rb.batch), static_cast<unsigned>(std::min(p.rows, 64)));
    map_kept_positions_kernel<<<grid, 256, 0, stream>>>(tables, cfg.blocks_per_seq(), cfg.block_size, rb, out, p);
    TRIATTN_CUDA_TRY(check_launch(stream));
    store_kept_positions_kernel<<<grid, 256, 0, stream>>>(tables, cfg.blocks_per_seq(), cfg.block_size, rb, out, p);
    TRIATTN_CUDA_TRY(check_launch(stream));
  }

  // Applies the downloaded outputs to the cache (O(batch + blocks freed) without positions).
  const std::vector<CompressionReport>& commit() {
    const Layout lay = layout(batch_, rows_, max_keep_);
    const RoundOutputs out = outputs(static_cast<char*>(host_), lay, batch_, rows_, max_keep_);
    pending_ = false;
    for (SeqId s : in_flight_) flight_[static_cast<std::size_t>(s)] = 0;
    last_seqs_.swap(in_flight_);  // both keep their capacity
    in_flight_.clear();
    // A refused round wrote nothing: the cache stays as it was and the error names the input.
    check_round_error(*reinterpret_cast<const RoundError*>(static_cast<char*>(host_) + lay.err));
    cache_->commit_round(last_seqs_, out, reports_);
    publish(*cache_, stream_);
    return reports_;
  }

  Cache* cache_;
  AgreementFn agreement_;
  void* dev_ = nullptr;   // [inputs | outputs] device
  void* host_ = nullptr;  // the same layout, pinned
  void* ws_ = nullptr;
  std::size_t io_bytes_ = 0, ws_bytes_ = 0, positions_bytes_ = 0;
  std::int32_t* positions_ = nullptr;  // the last round's kept positions [batch, rows, max_keep]
  std::int32_t* snap_ = nullptr;       // launch_beside's copy of the device lengths and tables
  cudaEvent_t snap_ready_ = nullptr;   // recorded on the engine's stream behind that copy
  cudaEvent_t event_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool pending_ = false;
  bool keep_plans_ = false;
  std::vector<SeqId> in_flight_, last_seqs_, due_;
  std::vector<unsigned char> flight_;  // [max_seqs] 1 while the sequence's round is in flight
  std::vector<std::uint8_t> seen_;
  std::vector<CompressionReport> reports_;
  int batch_ = 0, rows_ = 0, max_keep_ = 0;
};

/// Original logical position of every slot of row (layer, kv_head) of `seq` ([physical_length]) in
/// a device cache with CacheConfig::track_positions: KvCache::positions for positions kept on the
/// device. Copies the sequence's tracked entries of the position store on `stream` and waits.
/// @throws logic_error naming CacheConfig::track_positions when the cache does not track them, or
/// on a bad id, layer or head; cuda_error when a copy fails.
template <class Cache>
  requires has_device_tables_v<Cache>
[[nodiscard]] std::vector<std::int32_t> tracked_positions(const Cache& cache, SeqId seq, int layer, int kv_head,
                                                          cudaStream_t stream) {
  const CacheConfig& cfg = cache.config();
  TRIATTN_EXPECTS(cfg.track_positions, "cuda::tracked_positions: the cache does not track positions "
                                       "(CacheConfig::track_positions)");
  const int len = cache.physical_length(seq);  // throws on a bad or inactive id
  TRIATTN_EXPECTS(layer >= 0 && layer < cfg.model.num_layers && kv_head >= 0 && kv_head < cfg.model.num_kv_heads,
                  "cuda::tracked_positions: (layer " + std::to_string(layer) + ", kv head " + std::to_string(kv_head) +
                      ") is outside the model");
  const PositionState ps = cache.position_state(seq);
  const std::int64_t base = cache.logical_position(seq) - len;  // an appended slot holds base + slot
  const std::size_t rows = static_cast<std::size_t>(cfg.model.num_layers) * static_cast<std::size_t>(cfg.model.num_kv_heads);
  const std::size_t row = static_cast<std::size_t>(layer) * static_cast<std::size_t>(cfg.model.num_kv_heads) +
                          static_cast<std::size_t>(kv_head);
  std::vector<std::int32_t> p(static_cast<std::size_t>(len));
  for (int i = 0; i < len; ++i) p[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i < ps.in_place ? i : base + i);
  if (ps.explicit_len > ps.in_place) {  // slots [in_place, explicit_len) read the store, block by block
    const std::int32_t* store = cache.allocator().position_store();
    TRIATTN_EXPECTS(store != nullptr, "cuda::tracked_positions: sequence " + std::to_string(seq) +
                                          " has tracked positions but the cache has no position store");
    const auto table = cache.block_table(seq);
    const int bs = cfg.block_size;
    for (int j = ps.in_place / bs; j * bs < ps.explicit_len; ++j) {
      const int lo = std::max(j * bs, ps.in_place), hi = std::min((j + 1) * bs, ps.explicit_len);
      const std::int32_t* src =
          store + (static_cast<std::size_t>(table[static_cast<std::size_t>(j)]) * bs + static_cast<std::size_t>(lo % bs)) * rows + row;
      TRIATTN_CUDA_TRY(cudaMemcpy2DAsync(p.data() + lo, sizeof(std::int32_t), src, rows * sizeof(std::int32_t),
                                         sizeof(std::int32_t), static_cast<std::size_t>(hi - lo), cudaMemcpyDeviceToHost,
                                         stream));
    }
    TRIATTN_CUDA_TRY(cudaStreamSynchronize(stream));
  }
  return p;
}

}  // namespace triattn::cuda

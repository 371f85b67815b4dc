// SPDX-License-Identifier: Apache-2.0
// A continuous-batching serving loop over the reference transformer (Model<Backend>) and a
// triattn::KvCache: requests arrive over time (Request::arrival_s), wait in a FIFO queue, are
// admitted when the KV memory allows it, prefill in chunks mixed into the decode steps of the
// requests already running, decode one token per step, are compressed by TriAttention rounds when
// their trigger fires, and leave when done. Per step:
//   1. commit finished compression rounds (Rounds::poll) and launch rounds for the sequences whose
//      trigger fired and that decoded since their last round (one round per length, as alone); a
//      sequence whose round is in flight (or still waiting for one) sits out;
//   2. admit arrived requests, front of the queue first (exact worst case or optimistic);
//   3. compose the step: one decode token per running request, then prompt chunks of the
//      requests still prefilling, at most `prefill_chunk` prompt tokens in all;
//   4. when the step does not fit the pool, preempt the most recently admitted request (its KV is
//      dropped and it restarts from its prompt later: recompute) until it does;
//   5. run the step, sample the tokens, publish prefilled prompt blocks to the prefix cache, release
//      finished requests.
// A request's tokens depend only on its own sequence: its rounds fire at the same lengths as when
// it runs alone (rounds are due after a step, before the next one extends it), so the tokens
// equal a run of that request alone whenever the backend's arithmetic of a row does not depend
// on the batch (the CPU backend; the GPU backend with ServingOptions of batch_invariant()).
// Every step's StepRecord says where its inter-token latency went (host scheduling, rounds
// launched, committed or waited for, the device's time, memory upkeep), so a latency tail can be
// attributed from the JSON alone (report.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <triattn/core/admission.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/prefix_cache.hpp>

#include <reference_transformer/model.hpp>
#include <reference_transformer/sampler.hpp>

namespace triattn_serving {

namespace ex = triattn_example;

/// One request: when it arrives (seconds after the run starts), its prompt, how many tokens it
/// generates at most.
struct Request {
  double arrival_s = 0.0;
  std::vector<int> prompt;
  int max_new_tokens = 1;
};

/// Latest arrival serve() waits for in real time (one day): a later one is refused, not slept for.
inline constexpr double kMaxArrivalS = 86400.0;

enum class Admission : int {
  kExact = 0,       ///< admit only what fits at its worst case (core/admission.hpp): never preempts
  kOptimistic = 1,  ///< admit while the prompt fits; preempt (recompute) when a step runs out
};

struct LoopOptions {
  Admission admission = Admission::kExact;
  /// Prompt tokens per step over all prefilling requests (0: every admitted prompt whole).
  int prefill_chunk = 0;
  bool prefix_cache = false;       ///< admit over cached prompt blocks, publish prompts (admit_prompt)
  int max_running = 0;             ///< requests running at once (0: the cache's max_seqs)
  std::vector<int> stop_tokens;    ///< tokens that end a request (not counted as generated)
  float temperature = 0.0f;        ///< 0: greedy
  float top_p = 1.0f;
  std::uint64_t seed = 42;         ///< request i samples with seed + i
  bool wall_clock = true;          ///< wait for arrivals in real time (false: admit as if all had arrived)
  /// Called about every progress_s seconds (and at the end) with the state so far.
  std::function<void(const struct Progress&)> on_progress;
  double progress_s = 2.0;
};

/// What happened to one request (times in seconds since the run started; -1 = never).
struct RequestResult {
  std::vector<int> generated;
  double arrival_s = 0.0, admitted_s = -1.0, first_token_s = -1.0, finish_s = -1.0;
  int prompt_tokens = 0;
  int cached_prompt_tokens = 0;  ///< taken from the prefix cache (last admission)
  int preemptions = 0;
  int rounds = 0;                ///< compression rounds of its sequence
  std::int64_t tokens_evicted = 0;
  [[nodiscard]] double ttft() const { return first_token_s - arrival_s; }
  /// Mean time per output token after the first (0 with one token).
  [[nodiscard]] double tpot() const {
    return generated.size() > 1 ? (finish_s - first_token_s) / static_cast<double>(generated.size() - 1) : 0.0;
  }
};

/// One step of the loop. "Since the previous step" = between the previous step's sampled tokens
/// and this step's: what the gap (the inter-token latency) contains.
struct StepRecord {
  double start_s = 0.0, seconds = 0.0;  ///< wall time from the forward's launch to the sampled tokens
  /// Since the previous step's tokens: the inter-token latency of this step's decode rows (rounds
  /// launched or committed in between and the host's scheduling included).
  /// gap_s = sched_s + enqueue_s + during_s + sync_s + post_s.
  double gap_s = 0.0;
  int decode_rows = 0;                  ///< decode tokens in the step
  int prefill_tokens = 0;               ///< prompt tokens in the step
  int prefill_chunks = 0;               ///< prompt chunks in the step (requests prefilling in it)
  int held_rows = 0;                    ///< decoding requests sitting the step out (their round in flight or due)
  int running = 0, waiting = 0;         ///< admitted requests, arrived requests not admitted (after the step)
  int admitted = 0, preempted = 0;      ///< since the previous step
  std::size_t kv_bytes = 0;             ///< KV blocks held (in use or cached) * block bytes
  std::size_t device_bytes = 0;         ///< device memory in use (LoopHooks::device_bytes; 0 on the CPU)
  // Rounds since the previous step.
  int round_launched = 0;               ///< sequences launched into a round
  int round_committed = 0;              ///< sequences whose round was committed (poll or wait)
  bool round_in_flight = false;         ///< a round was in flight on the device while this step ran
  int round_waits = 0;                  ///< times the host blocked on a round (Rounds::wait)
  double round_wait_s = 0.0;            ///< host time blocked on rounds (part of sched_s)
  double round_host_s = 0.0;            ///< host time polling, launching and committing rounds (part of sched_s; the
                                        ///< whole round on the CPU)
  double round_device_s = 0.0;          ///< device time of the rounds committed (Rounds::last_device_s; 0: unknown)
  // Where the gap went (host clock).
  double sched_s = 0.0;    ///< previous step's tokens -> this step's forward: hooks, rounds, admission, composing
  double enqueue_s = 0.0;  ///< the forward and the device argmax launched (all of the step's compute on the CPU)
  double during_s = 0.0;   ///< LoopHooks::during_step (memory upkeep while the device runs the step)
  double sync_s = 0.0;     ///< waiting for the step's tokens (or logits) to reach the host
  double post_s = 0.0;     ///< sampling, bookkeeping, releasing finished requests
  double device_s = 0.0;   ///< device time of the step's own work (LoopHooks::step_device_s; 0 on the CPU)
  // Counters of the surroundings since the previous step (LoopHooks::counters; 0 on the CPU).
  std::int64_t graph_captures = 0;  ///< CUDA graphs captured (a new batch bucket or plan)
  std::int64_t slabs_mapped = 0;    ///< VMM slabs mapped (pages mapped, access granted)
  std::int64_t slabs_unmapped = 0;  ///< VMM slabs unmapped
};

struct Progress {
  double now_s = 0.0;
  std::size_t finished = 0, total = 0, running = 0, waiting = 0;
  std::int64_t generated = 0;
  std::size_t kv_bytes = 0;
  int preemptions = 0;
};

struct LoopResult {
  std::vector<RequestResult> requests;
  std::vector<StepRecord> steps;
  double seconds = 0.0;  ///< first arrival to last finish (the run's length)
  int preemptions = 0;
  int rounds = 0;        ///< compression rounds committed (batches)
  std::int64_t sequences_compressed = 0;
  std::size_t peak_kv_bytes = 0, peak_device_bytes = 0;
  triattn::PrefixCacheStats prefix;  ///< zero unless the allocator caches prefixes
};

/// Host compression rounds: KvCache::compress_if_needed at once (the CPU path).
template <class Cache>
class HostRounds {
 public:
  explicit HostRounds(Cache& cache) : cache_(&cache) {}
  [[nodiscard]] std::vector<triattn::CompressionReport> poll() { return std::exchange(done_, {}); }
  [[nodiscard]] bool busy() const noexcept { return false; }
  [[nodiscard]] bool in_flight(triattn::SeqId) const noexcept { return false; }
  void launch(std::span<const triattn::SeqId> seqs) { done_ = cache_->compress_if_needed(seqs); }
  std::vector<triattn::CompressionReport> wait() { return poll(); }

 private:
  Cache* cache_;
  std::vector<triattn::CompressionReport> done_;
};

/// Cumulative counters of the loop's surroundings; StepRecord keeps their growth per step.
struct HostCounters {
  std::int64_t graph_captures = 0, slabs_mapped = 0, slabs_unmapped = 0;
};

/// What the loop asks of its surroundings besides the model and the cache (all optional).
struct LoopHooks {
  std::function<std::size_t()> device_bytes;  ///< device memory in use now (GPU); empty: 0
  std::function<void()> after_step;           ///< after every step's tokens
  std::function<void()> before_step;          ///< just before a step's forward (e.g. record a start event)
  /// After the step is launched (forward and device argmax queued), before the host waits for its
  /// tokens, with the KV blocks the next step may take (a decoding request at a block boundary:
  /// one; prompts still prefilling or waiting: their next chunk's): work that may overlap the
  /// device's, e.g. mapping those pages ahead so that no step maps them itself.
  std::function<void(std::int64_t next_blocks)> during_step;
  std::function<double()> step_device_s;  ///< after the tokens are back: the step's device time (s)
  std::function<HostCounters()> counters;  ///< cumulative counters (graph captures, VMM slabs)
};

template <class Cache>
inline constexpr bool kCompresses = !std::is_same_v<typename Cache::scorer_type, triattn::NoScorer>;

template <class Cache>
inline constexpr bool kCachesPrefixes = requires(Cache& c) { c.allocator().prefix_stats(); };

/// KV blocks the pool holds: in use by sequences, or cached by the prefix cache.
template <class Cache>
[[nodiscard]] std::size_t blocks_held(const Cache& cache) {
  if constexpr (kCachesPrefixes<Cache>) return cache.allocator().blocks_held();
  else return static_cast<std::size_t>(cache.config().num_blocks) - cache.allocator().num_free();
}

/// Most blocks request `r` ever holds in `cache` (its table at its peak): the exact worst case
/// of core/admission.hpp under compression, prompt + max_new_tokens without.
template <class Cache>
[[nodiscard]] int worst_case_blocks(const Cache& cache, const Request& r) {
  const triattn::CacheConfig& cfg = cache.config();
  if constexpr (kCompresses<Cache>) {
    return triattn::request_footprint(cfg, {static_cast<int>(r.prompt.size()), r.max_new_tokens},
                                      const_cast<Cache&>(cache).selector().params())
        .max_blocks;
  } else {
    const std::int64_t tokens = static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens;
    return static_cast<int>((tokens + cfg.block_size - 1) / cfg.block_size);
  }
}

/// Runs `requests` to completion through `model` and `cache` (empty at the start; every request's
/// sequence is released at the end). `rounds` runs the compression rounds (HostRounds, or the GPU
/// loop's DeviceRounds adapter); ignored by a cache without a scorer.
/// @throws triattn::logic_error on a bad request or a request that can never fit the pool.
template <class ModelT, class Cache, class Rounds>
LoopResult serve(ModelT& model, Cache& cache, Rounds& rounds, std::span<const Request> requests, const LoopOptions& opt,
                 const LoopHooks& hooks = {}) {
  using clock = std::chrono::steady_clock;
  using triattn::SeqId;
  const triattn::CacheConfig& cfg = cache.config();
  const int vocab = model.config().vocab_size;
  TRIATTN_EXPECTS(opt.prefill_chunk >= 0, "serve: prefill_chunk must be >= 0");
  if constexpr (!kCachesPrefixes<Cache>)
    TRIATTN_EXPECTS(!opt.prefix_cache, "serve: prefix_cache needs a PrefixCachingAllocator");
  const int max_running = opt.max_running > 0 ? std::min(opt.max_running, cfg.max_seqs) : cfg.max_seqs;
  const std::int64_t block_bytes = cfg.block_bytes_all_ranges();
  const bool prefix = opt.prefix_cache;

  // Per request state.
  enum class Phase { kWaiting, kPrefill, kDecode, kDone };
  struct State {
    Phase phase = Phase::kWaiting;
    SeqId seq = -1;
    std::size_t next = 0;  // prompt tokens cached so far
    int last = 0;          // last sampled token (the next decode input)
    int worst_blocks = 0;
    // A round ran (or runs) at the sequence's current length: not due again until a decode step
    // extends it. A round may leave a sequence at its trigger (a pinned prompt of budget +
    // divide_length tokens or more keeps every prompt token): alone it gets one round per decode
    // step, never two at one length, and relaunching it after its commit would hold it forever.
    bool rounded = false;
    std::size_t emitted = 0;  // tokens emitted before a preemption (their times stand)
    ex::Sampler sampler;
  };
  LoopResult out;
  out.requests.resize(requests.size());
  std::vector<State> st(requests.size());
  std::vector<std::size_t> order(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    TRIATTN_EXPECTS(!r.prompt.empty(), "serve: request " + std::to_string(i) + " has an empty prompt");
    TRIATTN_EXPECTS(r.max_new_tokens >= 1, "serve: request " + std::to_string(i) + " has max_new_tokens " +
                                               std::to_string(r.max_new_tokens) + " (at least 1)");
    TRIATTN_EXPECTS(r.arrival_s >= 0.0, "serve: request " + std::to_string(i) + " arrives before 0");
    // Waited for in real time: an arrival in other units (ms, or an epoch time) would sleep for years.
    TRIATTN_EXPECTS(!opt.wall_clock || r.arrival_s <= kMaxArrivalS,
                    "serve: request " + std::to_string(i) + " arrives at " + std::to_string(r.arrival_s) +
                        " s, more than a day after the start (arrival times are seconds from the start)");
    for (int t : r.prompt)
      TRIATTN_EXPECTS(t >= 0 && t < vocab, "serve: request " + std::to_string(i) + " has token " + std::to_string(t) +
                                               " outside [0, " + std::to_string(vocab) + ")");
    st[i].worst_blocks = worst_case_blocks(cache, r);  // throws when a block-table row cannot hold it
    TRIATTN_EXPECTS(opt.admission != Admission::kExact || st[i].worst_blocks <= cfg.num_blocks,
                    "serve: request " + std::to_string(i) + " needs up to " + std::to_string(st[i].worst_blocks) +
                        " KV blocks, the pool has " + std::to_string(cfg.num_blocks));
    st[i].sampler = ex::Sampler(opt.temperature, opt.top_p, opt.seed + i);
    out.requests[i].arrival_s = r.arrival_s;
    out.requests[i].prompt_tokens = static_cast<int>(r.prompt.size());
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return requests[a].arrival_s < requests[b].arrival_s; });
  std::deque<std::size_t> queue;        // arrived, not admitted (a preempted request re-enters at the front)
  std::size_t next_arrival = 0;         // into `order`
  std::vector<std::size_t> running;     // admission order
  constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> owner_of(static_cast<std::size_t>(cfg.max_seqs), kNone);  // sequence slot -> request
  std::size_t finished = 0;
  std::int64_t generated = 0;
  bool admission_held = false;          // after a preemption: admit nothing until a request finishes
  typename ModelT::backend_type::Buffer ids_buf;  // device argmax output

  const auto t0 = clock::now();
  auto now = [&] { return std::chrono::duration<double>(clock::now() - t0).count(); };
  double last_progress = 0.0;
  double last_end = 0.0;  // when the previous step's tokens were sampled
  auto progress = [&](bool force) {
    if (!opt.on_progress) return;
    const double t = now();
    if (!force && t - last_progress < opt.progress_s) return;
    last_progress = t;
    Progress p;
    p.now_s = t;
    p.finished = finished;
    p.total = requests.size();
    p.running = running.size();
    p.waiting = queue.size();
    p.generated = generated;
    p.kv_bytes = blocks_held(cache) * static_cast<std::size_t>(block_bytes);
    p.preemptions = out.preemptions;
    opt.on_progress(p);
  };

  StepRecord acc;  // what happened since the previous step's tokens (rounds, admission, waits)
  auto release = [&](std::size_t i) {
    cache.release(st[i].seq);
    owner_of[static_cast<std::size_t>(st[i].seq)] = kNone;
    st[i].seq = -1;
    running.erase(std::find(running.begin(), running.end(), i));
  };
  auto preempt = [&](std::size_t i) {
    release(i);
    State& s = st[i];
    s.emitted = std::max(s.emitted, out.requests[i].generated.size());
    s.phase = Phase::kWaiting;
    s.next = 0;
    s.rounded = false;
    s.sampler = ex::Sampler(opt.temperature, opt.top_p, opt.seed + i);  // recompute draws the same tokens
    out.requests[i].generated.clear();
    out.requests[i].rounds = 0;
    out.requests[i].tokens_evicted = 0;
    ++out.requests[i].preemptions;
    ++out.preemptions;
    ++acc.preempted;
    queue.push_front(i);
    admission_held = true;
  };
  // Blocks the running requests may still take at their worst case (exact admission).
  auto reserved_blocks = [&] {
    std::int64_t r = 0;
    for (std::size_t i : running)
      r += std::max<std::int64_t>(0, st[i].worst_blocks + (prefix ? 1 : 0) -
                                         static_cast<std::int64_t>(cache.block_table(st[i].seq).size()));
    return r;
  };
  // Blocks the prefilling requests still need for their prompts (optimistic admission).
  auto prompt_blocks_pending = [&] {
    std::int64_t r = 0;
    for (std::size_t i : running)
      if (st[i].phase == Phase::kPrefill) {
        const std::int64_t total = (static_cast<std::int64_t>(requests[i].prompt.size()) + cfg.block_size) / cfg.block_size;
        r += std::max<std::int64_t>(0, total - static_cast<std::int64_t>(cache.block_table(st[i].seq).size()));
      }
    return r;
  };
  auto admit = [&] {
    const std::int64_t watermark = cfg.num_blocks / 100;
    if (running.empty()) admission_held = false;
    while (!admission_held && !queue.empty() && static_cast<int>(running.size()) < max_running) {
      const std::size_t i = queue.front();
      const Request& r = requests[i];
      const auto free_blocks = static_cast<std::int64_t>(cache.allocator().num_free());
      if (opt.admission == Admission::kExact) {
        // Blocks a prefix hit shares are held already; idle ones among them stop being free.
        std::int64_t hit = 0, idle_hit = 0;
        if constexpr (kCachesPrefixes<Cache>)
          if (prefix) {
            const triattn::PrefixHit h = triattn::prefix_hit(cache, std::span<const int>(r.prompt));
            hit = h.blocks;
            for (std::int64_t j = 0; j < hit; ++j)
              idle_hit += cache.allocator().ref_count(h.match.blocks[static_cast<std::size_t>(j)]) == 1 ? 1 : 0;
          }
        if (st[i].worst_blocks + (prefix ? 1 : 0) - hit > free_blocks - idle_hit - reserved_blocks()) break;
      } else {
        const std::int64_t need = (static_cast<std::int64_t>(r.prompt.size()) + cfg.block_size) / cfg.block_size;
        if (!running.empty() && need + watermark > free_blocks - prompt_blocks_pending()) break;
      }
      queue.pop_front();
      State& s = st[i];
      if constexpr (kCachesPrefixes<Cache>) {
        if (prefix) {
          const triattn::PrefixAdmission a = triattn::admit_prompt(cache, std::span<const int>(r.prompt));
          s.seq = a.seq;
          s.next = static_cast<std::size_t>(a.cached_tokens);
          out.requests[i].cached_prompt_tokens = a.cached_tokens;
        }
      }
      if (!prefix) s.seq = cache.add_sequence();
      TRIATTN_EXPECTS(s.seq >= 0 && s.seq < cfg.max_seqs && owner_of[static_cast<std::size_t>(s.seq)] == kNone,
                      "serve: the cache gave request " + std::to_string(i) + " sequence " + std::to_string(s.seq) +
                          ", not a free slot below max_seqs");
      owner_of[static_cast<std::size_t>(s.seq)] = i;
      ++acc.admitted;
      s.phase = Phase::kPrefill;
      if (out.requests[i].admitted_s < 0) out.requests[i].admitted_s = now();
      running.push_back(i);
    }
  };
  // O(reports): a report names its sequence, owner_of its request (in flight: never released).
  auto commit = [&](const std::vector<triattn::CompressionReport>& reps) {
    if (reps.empty()) return;
    ++out.rounds;
    acc.round_committed += static_cast<int>(reps.size());
    if constexpr (requires { rounds.last_device_s(); }) acc.round_device_s += rounds.last_device_s();
    for (const triattn::CompressionReport& rep : reps) {
      const std::size_t i = rep.seq >= 0 && rep.seq < cfg.max_seqs ? owner_of[static_cast<std::size_t>(rep.seq)] : kNone;
      if (i == kNone) continue;
      ++out.requests[i].rounds;
      out.requests[i].tokens_evicted += rep.length_before - rep.length_after;
      ++out.sequences_compressed;
    }
  };
  // Rounds::wait (the host blocks on the device): counted and timed.
  auto wait_rounds = [&] {
    const double t = now();
    ++acc.round_waits;
    commit(rounds.wait());
    acc.round_wait_s += now() - t;
  };
  // Whether request i's round is due: it decodes, its trigger fired, and no round ran at its
  // current length (State::rounded).
  auto due_round = [&](std::size_t i) {
    if constexpr (kCompresses<Cache>)
      return st[i].phase == Phase::kDecode && !st[i].rounded && cache.needs_compression(st[i].seq);
    else
      return false;
  };
  // Whether request i sits this step out: its round is in flight, or due while another round
  // runs (it waits for its own at this length, as it would alone).
  auto held = [&](std::size_t i) {
    if constexpr (kCompresses<Cache>)
      return rounds.in_flight(st[i].seq) || (rounds.busy() && due_round(i));
    else
      return false;
  };

  std::vector<ex::Chunk> chunks;
  std::vector<std::size_t> owner;
  std::vector<SeqId> due;
  std::vector<int> picked;
  int held_rows = 0;
  // An upper estimate of the blocks the next step takes (see LoopHooks::during_step), O(running).
  auto next_blocks = [&] {
    std::int64_t decode = 0, prompt = 0, chunks_next = 0;
    for (std::size_t i : running) {
      if (st[i].phase == Phase::kDecode) {
        decode += cache.blocks_to_extend(st[i].seq, 1);
      } else if (st[i].phase == Phase::kPrefill) {
        prompt += static_cast<std::int64_t>(requests[i].prompt.size() - st[i].next) / cfg.block_size + 1;
        ++chunks_next;
      }
    }
    if (!queue.empty()) {
      prompt += static_cast<std::int64_t>(requests[queue.front()].prompt.size()) / cfg.block_size + 1;
      ++chunks_next;
    }
    if (opt.prefill_chunk > 0)  // a chunk's blocks, plus a partial one per prompt it touches
      prompt = std::min<std::int64_t>(prompt, opt.prefill_chunk / cfg.block_size + chunks_next);
    return decode + prompt;
  };
  HostCounters counted = hooks.counters ? hooks.counters() : HostCounters{};
  auto compose = [&] {
    chunks.clear();
    owner.clear();
    held_rows = 0;
    for (std::size_t i : running)
      if (st[i].phase == Phase::kDecode) {
        if (held(i)) {
          ++held_rows;
          continue;
        }
        chunks.push_back(ex::Chunk{st[i].seq, std::span<const int>(&st[i].last, 1), triattn::Phase::kDecode});
        owner.push_back(i);
      }
    std::size_t used = 0;
    const std::size_t budget = opt.prefill_chunk > 0 ? static_cast<std::size_t>(opt.prefill_chunk)
                                                     : std::numeric_limits<std::size_t>::max();
    for (std::size_t i : running) {
      if (st[i].phase != Phase::kPrefill || used >= budget) continue;
      const std::vector<int>& p = requests[i].prompt;
      const std::size_t take = std::min(p.size() - st[i].next, budget - used);
      chunks.push_back(ex::Chunk{st[i].seq, std::span<const int>(p).subspan(st[i].next, take), triattn::Phase::kPrefill});
      owner.push_back(i);
      used += take;
    }
  };

  while (finished < requests.size()) {
    // Arrivals.
    const double t_now = now();
    while (next_arrival < order.size() &&
           (!opt.wall_clock || requests[order[next_arrival]].arrival_s <= t_now))
      queue.push_back(order[next_arrival++]);
    // Rounds: commit what finished, launch what is due.
    if constexpr (kCompresses<Cache>) {
      const double t_rounds = now();
      commit(rounds.poll());
      if (!rounds.busy()) {
        due.clear();
        for (std::size_t i : running)
          if (due_round(i)) {
            due.push_back(st[i].seq);
            st[i].rounded = true;
          }
        if (!due.empty()) rounds.launch(std::span<const SeqId>(due));
        acc.round_launched += static_cast<int>(due.size());
        commit(rounds.poll());
      }
      acc.round_host_s += now() - t_rounds;
    }
    admit();
    compose();
    // Preempt (recompute) until the step fits the pool.
    while (!chunks.empty() && !ex::Model<typename ModelT::backend_type>::fits(cache, std::span<const ex::Chunk>(chunks))) {
      std::size_t victim = requests.size();
      for (auto it = running.rbegin(); it != running.rend(); ++it)
        if (!rounds.in_flight(st[*it].seq)) {
          victim = *it;
          break;
        }
      if (victim == requests.size() || (running.size() == 1 && !rounds.busy())) {
        if (rounds.busy()) {
          wait_rounds();  // memory: every request that could give way has its round in flight
        } else {
          throw triattn::logic_error("serve: request " + std::to_string(running.empty() ? 0 : running.front()) +
                                     " does not fit the KV pool (" + std::to_string(cfg.num_blocks) +
                                     " blocks) even alone");
        }
      } else {
        preempt(victim);
      }
      compose();
    }
    if (chunks.empty()) {
      if (rounds.busy()) {
        wait_rounds();  // every running request sits out for a round: nothing else to run
        continue;
      }
      if (running.empty() && queue.empty() && next_arrival < order.size()) {
        const double wait_s = requests[order[next_arrival]].arrival_s - now();
        if (wait_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
        continue;
      }
      // Nothing runs, nothing is in flight and something is waiting: it can never be admitted.
      throw triattn::logic_error(queue.empty() ? std::string("serve: no step could be composed")
                                               : "serve: request " + std::to_string(queue.front()) +
                                                     " cannot be admitted into an empty KV pool");
    }

    // The step.
    StepRecord rec = std::exchange(acc, StepRecord{});
    rec.held_rows = held_rows;
    rec.round_in_flight = rounds.busy();
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      if (chunks[c].phase == triattn::Phase::kDecode) {
        ++rec.decode_rows;
      } else {
        ++rec.prefill_chunks;
        rec.prefill_tokens += static_cast<int>(chunks[c].tokens.size());
      }
    }
    if (hooks.before_step) hooks.before_step();
    rec.start_s = now();
    rec.sched_s = out.steps.empty() ? 0.0 : rec.start_s - last_end;
    const int rows = model.forward(cache, std::span<const ex::Chunk>(chunks), ex::LogitsFor::kLastOfEachChunk);
    picked.assign(static_cast<std::size_t>(rows), -1);
    bool greedy = opt.temperature == 0.0f;
    [[maybe_unused]] int* ids = nullptr;  // device argmax output
    if constexpr (requires(typename ModelT::backend_type& b, int* p) {
                    b.argmax(p, model.logits(), rows, vocab);
                    b.download(p, p, std::size_t{0});
                  }) {
      if (greedy) {  // a device argmax: only the ids come back
        auto& be = model.backend();
        if (be.size(ids_buf) < static_cast<std::size_t>(rows)) ids_buf = be.alloc(static_cast<std::size_t>(rows));
        ids = reinterpret_cast<int*>(be.data(ids_buf));
        be.argmax(ids, model.logits(), rows, vocab);
      }
    } else {
      greedy = false;
    }
    const double t_enqueued = now();
    rec.enqueue_s = t_enqueued - rec.start_s;
    if (hooks.during_step) hooks.during_step(next_blocks());
    const double t_during = now();
    rec.during_s = t_during - t_enqueued;
    if constexpr (requires(typename ModelT::backend_type& b, int* p) { b.download(p, p, std::size_t{0}); })
      if (greedy) model.backend().download(picked.data(), ids, static_cast<std::size_t>(rows) * sizeof(int));
    const float* logits = greedy ? nullptr
                                 : model.backend().host_view(model.logits(), static_cast<std::size_t>(rows) * vocab);
    const double t_tok = now();
    rec.sync_s = t_tok - t_during;
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const std::size_t i = owner[c];
      State& s = st[i];
      RequestResult& rr = out.requests[i];
      if (chunks[c].phase == triattn::Phase::kDecode) s.rounded = false;  // a new length: due again when it fires
      if (s.phase == Phase::kPrefill) {
        s.next += chunks[c].tokens.size();
        // Each chunk's full blocks enter the prefix cache at once: requests admitted while this
        // prompt is still prefilling share them. (Rounds start after the prompt: none moved yet.)
        if constexpr (kCachesPrefixes<Cache>)
          if (prefix) (void)triattn::publish_prompt(cache, s.seq, std::span<const int>(requests[i].prompt));
        if (s.next < requests[i].prompt.size()) continue;
        s.phase = Phase::kDecode;
      }
      const int tok = greedy ? picked[c]
                             : s.sampler.sample(std::span<const float>(logits + c * static_cast<std::size_t>(vocab),
                                                                       static_cast<std::size_t>(vocab)));
      const bool stop = std::find(opt.stop_tokens.begin(), opt.stop_tokens.end(), tok) != opt.stop_tokens.end();
      if (!stop) {
        rr.generated.push_back(tok);
        s.last = tok;
        if (rr.generated.size() > s.emitted) ++generated;
      }
      if (rr.first_token_s < 0) rr.first_token_s = t_tok;
      if (stop || static_cast<int>(rr.generated.size()) >= requests[i].max_new_tokens) {
        rr.finish_s = t_tok;
        s.phase = Phase::kDone;
        release(i);
        ++finished;
        admission_held = false;
      }
    }
    const double t_end = now();
    rec.post_s = t_end - t_tok;
    rec.seconds = t_end - rec.start_s;
    rec.gap_s = out.steps.empty() ? rec.seconds : t_end - last_end;
    last_end = t_end;
    if (hooks.step_device_s) rec.device_s = hooks.step_device_s();
    if (hooks.counters) {
      const HostCounters c = hooks.counters();
      rec.graph_captures = c.graph_captures - counted.graph_captures;
      rec.slabs_mapped = c.slabs_mapped - counted.slabs_mapped;
      rec.slabs_unmapped = c.slabs_unmapped - counted.slabs_unmapped;
      counted = c;
    }
    rec.running = static_cast<int>(running.size());
    rec.waiting = static_cast<int>(queue.size());
    rec.kv_bytes = blocks_held(cache) * static_cast<std::size_t>(block_bytes);
    if (hooks.after_step) hooks.after_step();
    rec.device_bytes = hooks.device_bytes ? hooks.device_bytes() : 0;
    out.peak_kv_bytes = std::max(out.peak_kv_bytes, rec.kv_bytes);
    out.peak_device_bytes = std::max(out.peak_device_bytes, rec.device_bytes);
    out.steps.push_back(rec);
    progress(false);
  }
  if constexpr (kCompresses<Cache>) commit(rounds.wait());
  double first = std::numeric_limits<double>::infinity(), last = 0.0;
  for (const RequestResult& r : out.requests) {
    first = std::min(first, r.arrival_s);
    last = std::max(last, r.finish_s);
  }
  out.seconds = requests.empty() ? 0.0 : last - first;
  if constexpr (kCachesPrefixes<Cache>) out.prefix = cache.allocator().prefix_stats();
  progress(true);
  return out;
}

}  // namespace triattn_serving
